//! Replays the `spool_recovery` fuzz target's regression inputs under plain `cargo test`.
//!
//! The target's checks (`fuzz/src/spool_recovery.rs`) are compiled in as they are, so each file
//! under `fuzz/regressions/spool_recovery/` (a mutation program applied to a freshly built spool)
//! runs exactly as under the fuzzer. See `fuzz/README.md`.

#[path = "../../../fuzz/src/replay.rs"]
mod replay;
#[path = "../../../fuzz/src/spool_recovery.rs"]
mod spool_recovery;

#[test]
fn spool_recovery_regressions() {
    replay::replay("spool_recovery", spool_recovery::run, spool_recovery::seeds);
}
