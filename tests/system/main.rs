//! System tests: the real `edge-uploader` and `edge-ingest` binaries as separate processes,
//! talking QUIC with mutual TLS over loopback, with real SQLite and real fsync.
//!
//! One test binary (ripgrep style); each module is one area.

mod cli;
mod cloned_disk;
mod common;
mod crash_loop;
mod crash_points;
mod ingest_status;
mod jetstream;
mod link;
mod metrics;
mod network;
mod notify;
mod power_cut;
mod record_stream;
mod reload;
mod storage_faults;
