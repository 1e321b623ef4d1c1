//! libFuzzer entry point of the `ack_handling` target; the checks live in `src/ack_handling.rs`, shared with the
//! regression test that replays `fuzz/regressions/ack_handling/` under plain `cargo test`.
#![no_main]

#[path = "../src/ack_handling.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
