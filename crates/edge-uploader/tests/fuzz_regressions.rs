//! Replays the `config_parse` fuzz target's regression inputs under plain `cargo test`: each
//! file under `fuzz/regressions/config_parse/` is loaded as the agent's and as the ingest
//! server's configuration file through `fuzz/src/config_parse.rs`, compiled in as it is.
//! See `fuzz/README.md`.

#[path = "../../../fuzz/src/config_parse.rs"]
mod config_parse;
#[path = "../../../fuzz/src/replay.rs"]
mod replay;

#[test]
fn config_parse_regressions() {
    replay::replay("config_parse", config_parse::run, config_parse::seeds);
}
