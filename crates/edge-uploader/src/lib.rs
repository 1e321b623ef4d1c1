//! edge-uploader: the edge agent.
//!
//! Producers post records to the local intake; the spool thread commits them to SQLite in group
//! commits and seals them into chunks; the uploader sends chunks over parallel QUIC uni-streams
//! to `edge-ingest` and deletes each one only after the server acked it as durable. See
//! `ARCHITECTURE.md` at the repository root for the whole picture.

pub mod agent;
pub mod client;
pub mod client_tls;
pub mod compress;
pub mod config;
pub mod demo;
pub mod handoff;
pub mod intake;
pub mod machine_id;
pub mod metrics;
pub mod netwatch;
pub mod probe;
pub mod record_stream;
pub mod spool_check;
pub mod spool_export;
pub mod spool_purge;
pub mod spool_task;
pub mod status;
pub mod uploader;

/// Locks `m` even if a thread panicked while holding it. Every lock of this crate guards state
/// that each holder leaves consistent (no panic can come between two updates that belong
/// together), so a poisoned lock holds nothing half done, and refusing it would only stop the
/// agent.
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Exit code for configuration errors (`EX_CONFIG`); systemd is told not to restart on it.
pub const EXIT_CONFIG: i32 = 78;
