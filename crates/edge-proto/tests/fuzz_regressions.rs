//! Replays the fuzz targets' regression inputs under plain `cargo test` (stable, no cargo-fuzz).
//!
//! Each target's checks live in `fuzz/src/<target>.rs` and are compiled into this test as they
//! are, so a file under `fuzz/regressions/<target>/` goes through exactly the code path the fuzzer
//! ran: crashes the fuzzer found (once fixed) and hand-made edge cases. The seed inputs of the
//! corpus generator are replayed too. See `fuzz/README.md`.

#[path = "../../../fuzz/src/ack_handling.rs"]
mod ack_handling;
#[path = "../../../fuzz/src/chunk_header.rs"]
mod chunk_header;
#[path = "../../../fuzz/src/frame_decoder.rs"]
mod frame_decoder;
#[path = "../../../fuzz/src/records_decode.rs"]
mod records_decode;
#[path = "../../../fuzz/src/replay.rs"]
mod replay;

#[test]
fn frame_decoder_regressions() {
    replay::replay("frame_decoder", frame_decoder::run, frame_decoder::seeds);
}

#[test]
fn chunk_header_regressions() {
    replay::replay("chunk_header", chunk_header::run, chunk_header::seeds);
}

#[test]
fn ack_handling_regressions() {
    replay::replay("ack_handling", ack_handling::run, ack_handling::seeds);
}

#[test]
fn records_decode_regressions() {
    replay::replay("records_decode", records_decode::run, records_decode::seeds);
}
