//! `config_parse`: arbitrary bytes as the agent's and the ingest server's configuration file.
//!
//! Both loaders are called the way the daemons call them, `config::load(Some(path))`, on a file
//! in a scratch directory (in `/dev/shm` when there is one). The bytes are written as they are,
//! so invalid UTF-8 is exercised as well as TOML.
//!
//! Asserts, for every input:
//! - no panic in either loader (TOML parsing, the `config` crate's merge, size and duration
//!   parsing, validation);
//! - every error names the file: its `{:#}` rendering contains the file's path, so an operator
//!   reading the log knows which file to fix;
//! - a successfully loaded config remembers that file as its source.

use std::path::PathBuf;
use std::sync::OnceLock;

fn dir() -> &'static (tempfile::TempDir, PathBuf, PathBuf) {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf, PathBuf)> = OnceLock::new();
    DIR.get_or_init(|| {
        let base =
            if std::path::Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
        let dir = tempfile::Builder::new().prefix("edge-fuzz-config-").tempdir_in(base).expect("scratch directory");
        let agent = dir.path().join("edge-uploader.toml");
        let ingest = dir.path().join("edge-ingest.toml");
        (dir, agent, ingest)
    })
}

/// Runs one input; panics if a property is broken.
///
/// Not safe to call from two threads at once (both write the same two files); the regression
/// test runs its files one after the other.
pub fn run(data: &[u8]) {
    let (_, agent, ingest) = dir();
    std::fs::write(agent, data).expect("writing the agent config");
    match edge_uploader::config::load(Some(agent)) {
        Ok(cfg) => assert_eq!(cfg.source.as_deref(), Some(agent.as_path())),
        Err(e) => {
            let msg = format!("{e:#}");
            assert!(msg.contains(&agent.display().to_string()), "agent config error does not name the file: {msg}");
        }
    }
    std::fs::write(ingest, data).expect("writing the ingest config");
    match edge_ingest::config::load(Some(ingest)) {
        Ok(cfg) => assert_eq!(cfg.source.as_deref(), Some(ingest.as_path())),
        Err(e) => {
            let msg = format!("{e:#}");
            assert!(msg.contains(&ingest.display().to_string()), "ingest config error does not name the file: {msg}");
        }
    }
}

/// Seed inputs: both example configs, an empty file, and a few broken ones.
#[allow(dead_code)] // Used by the corpus generator and the regression tests, not the fuzz target.
pub fn seeds() -> Vec<Vec<u8>> {
    vec![
        include_bytes!("../../config/edge-uploader.toml").to_vec(),
        include_bytes!("../../config/edge-ingest.toml").to_vec(),
        Vec::new(),
        b"[spool]\nmax_bytes = \"1GiB\"\nlinger = \"50ms\"\n".to_vec(),
        b"[spool]\nlinger = \"soon\"\n".to_vec(),
        b"[server]\nlisten = \"0.0.0.0:4433\"\nmax_chunk_bytes = \"300MiB\"\n".to_vec(),
        b"[upload]\nmax_in_flight = -1\n".to_vec(),
        b"[intake]\nsocket_mode = \"0o9\"\n".to_vec(),
        b"\xff\xfe[spool]".to_vec(),
        b"[[spool]]\n".to_vec(),
        b"spool = 3\n".to_vec(),
        b"[log]\nlevel = \"info,foo=bar=baz\"\n".to_vec(),
    ]
}
