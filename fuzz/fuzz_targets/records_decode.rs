//! libFuzzer entry point of the `records_decode` target; the checks live in `src/records_decode.rs`, shared with the
//! regression test that replays `fuzz/regressions/records_decode/` under plain `cargo test`.
#![no_main]

#[path = "../src/records_decode.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
