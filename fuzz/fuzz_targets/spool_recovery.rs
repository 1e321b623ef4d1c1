//! libFuzzer entry point of the `spool_recovery` target; the checks live in `src/spool_recovery.rs`, shared with the
//! regression test that replays `fuzz/regressions/spool_recovery/` under plain `cargo test`.
#![no_main]

#[path = "../src/spool_recovery.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
