//! libFuzzer entry point of the `frame_decoder` target; the checks live in `src/frame_decoder.rs`, shared with the
//! regression test that replays `fuzz/regressions/frame_decoder/` under plain `cargo test`.
#![no_main]

#[path = "../src/frame_decoder.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
