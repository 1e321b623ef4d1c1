//! libFuzzer entry point of the `config_parse` target; the checks live in `src/config_parse.rs`, shared with the
//! regression test that replays `fuzz/regressions/config_parse/` under plain `cargo test`.
#![no_main]

#[path = "../src/config_parse.rs"]
mod check;

libfuzzer_sys::fuzz_target!(|data: &[u8]| check::run(data));
