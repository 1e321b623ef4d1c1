//! edge-ingest: the server side of edge-uploader.
//!
//! The binary in `main.rs` is a thin CLI over this library so that tests and the agent's `demo`
//! command can run a server in-process.

pub mod config;
pub mod metrics;
pub mod server;
pub mod status;
pub mod store;

/// Exit code for configuration errors (`EX_CONFIG`); systemd is told not to restart on it.
pub const EXIT_CONFIG: i32 = 78;
