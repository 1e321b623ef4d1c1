//! Replays `fuzz/regressions/<target>/*` and a target's seeds through its checks; used by the
//! `fuzz_regressions` tests of the workspace crates (not by the fuzz targets).

use std::path::{Path, PathBuf};

/// Runs every file of `fuzz/regressions/<target>/` and every seed through `run`, and fails
/// naming each input that panicked. There must be at least three files, so a moved or emptied
/// directory cannot make the test pass vacuously.
pub fn replay(target: &str, run: fn(&[u8]), seeds: fn() -> Vec<Vec<u8>>) {
    let dir = regressions_dir().join(target);
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", dir.display()))
        .map(|entry| entry.expect("listing the regression directory").path())
        .filter(|p| p.is_file())
        .collect();
    files.sort();
    assert!(files.len() >= 3, "{}: expected at least 3 regression inputs, found {}", dir.display(), files.len());
    let mut failed = Vec::new();
    for file in &files {
        let data = std::fs::read(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
        if std::panic::catch_unwind(|| run(&data)).is_err() {
            failed.push(file.display().to_string());
        }
    }
    for (i, seed) in seeds().iter().enumerate() {
        if std::panic::catch_unwind(|| run(seed)).is_err() {
            failed.push(format!("seed #{i} of {target}"));
        }
    }
    assert!(failed.is_empty(), "{target}: {} inputs broke a property: {failed:#?}", failed.len());
}

fn regressions_dir() -> PathBuf {
    // The tests run from their crate's directory, two levels below the repository root.
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/regressions")
}
