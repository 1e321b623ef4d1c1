//! System tests: the real `edge-uploader` and `edge-ingest` binaries as separate processes,
//! talking QUIC with mutual TLS over loopback, with real SQLite and real fsync.
//!
//! One test binary (ripgrep style); each module is one area.

mod cli;
mod common;
mod crash_loop;
mod ingest_status;
mod metrics;
mod notify;
mod reload;
