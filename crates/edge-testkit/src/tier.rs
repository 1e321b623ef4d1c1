//! The two tiers of the reliability battery, and where tests write their figures.
//!
//! The quick tier runs inside the README's test command (`cargo nextest run --workspace`) with
//! small sizes. The long tier is the same tests with their full sizes plus the tests marked
//! `#[ignore = "long tier"]`, run by `tests/long-tier.sh` (`EDGE_TIER=long`). Every test
//! writes its figures as one JSON object to `target/reliability/<name>.<tier>.json`;
//! `tests/reliability_report.py` turns those files into the results table of `RELIABILITY.md`.

use std::path::PathBuf;

/// Which tier this test process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tier {
    /// Small sizes, part of the everyday test command and CI.
    Quick,
    /// Full sizes from the issue, run by `tests/long-tier.sh`.
    Long,
}

impl Tier {
    /// `EDGE_TIER=long` selects the long tier; anything else (or nothing) is the quick tier.
    pub fn current() -> Tier {
        match std::env::var("EDGE_TIER") {
            Ok(v) if v.eq_ignore_ascii_case("long") => Tier::Long,
            _ => Tier::Quick,
        }
    }

    /// `quick` in the quick tier, `long` in the long tier.
    pub fn pick<T>(self, quick: T, long: T) -> T {
        match self {
            Tier::Quick => quick,
            Tier::Long => long,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tier::Quick => "quick",
            Tier::Long => "long",
        }
    }
}

/// Directory the figures go to: `$EDGE_REPORT_DIR`, else `<workspace>/target/reliability`.
pub fn report_dir() -> PathBuf {
    match std::env::var_os("EDGE_REPORT_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/reliability"),
    }
}

/// The short commit id of the workspace, with `+changes` when tracked files differ from it;
/// `unknown` without git. Figures are only as good as the code they were measured on.
pub fn commit() -> String {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    let git = |args: &[&str]| {
        std::process::Command::new("git")
            .arg("-C")
            .arg(&root)
            .args(args)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
    };
    match git(&["rev-parse", "--short", "HEAD"]) {
        Some(id) if !id.is_empty() => match git(&["status", "--porcelain", "--untracked-files=no"]) {
            Some(changes) if !changes.is_empty() => format!("{id}+changes"),
            _ => id,
        },
        _ => "unknown".to_owned(),
    }
}

/// Writes the figures of test `name` (one JSON object) to `<report_dir>/<name>.<tier>.json`,
/// adding the tier, the time (so a quick run never overwrites the long tier's figures) and the
/// commit the workspace is at (see [`commit`]). The test's own assertions decide pass or fail;
/// this is the record.
pub fn report(name: &str, figures: &serde_json::Value) -> anyhow::Result<PathBuf> {
    let dir = report_dir();
    std::fs::create_dir_all(&dir)?;
    let mut doc = serde_json::json!({
        "test": name,
        "tier": Tier::current().name(),
        "unix_time": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
        "commit": commit(),
    });
    if let (Some(out), Some(extra)) = (doc.as_object_mut(), figures.as_object()) {
        for (k, v) in extra {
            out.insert(k.clone(), v.clone());
        }
    }
    let path = dir.join(format!("{name}.{}.json", Tier::current().name()));
    std::fs::write(&path, serde_json::to_vec_pretty(&doc)?)?;
    eprintln!("figures of {name}: {}", path.display());
    Ok(path)
}
