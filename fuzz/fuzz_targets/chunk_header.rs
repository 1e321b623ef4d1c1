//! libFuzzer entry point of the `chunk_header` target; the checks live in `src/chunk_header.rs`, shared with the
//! regression test that replays `fuzz/regressions/chunk_header/` under plain `cargo test`.
#![no_main]

#[path = "../src/chunk_header.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
