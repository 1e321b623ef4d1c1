//! Writes the seed corpus of every target to `fuzz/corpus/<target>/seed-<n>` (the corpus
//! directory is not checked in; run this before the first `cargo fuzz run`):
//! `cargo run --manifest-path fuzz/Cargo.toml --example gen_corpus`.

#[path = "../src/ack_handling.rs"]
mod ack_handling;
#[path = "../src/chunk_header.rs"]
mod chunk_header;
#[path = "../src/config_parse.rs"]
mod config_parse;
#[path = "../src/frame_decoder.rs"]
mod frame_decoder;
#[path = "../src/records_decode.rs"]
mod records_decode;
#[path = "../src/spool_recovery.rs"]
mod spool_recovery;

fn main() -> std::io::Result<()> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let targets: [(&str, fn() -> Vec<Vec<u8>>, fn(&[u8])); 6] = [
        ("frame_decoder", frame_decoder::seeds, frame_decoder::run),
        ("chunk_header", chunk_header::seeds, chunk_header::run),
        ("ack_handling", ack_handling::seeds, ack_handling::run),
        ("spool_recovery", spool_recovery::seeds, spool_recovery::run),
        ("config_parse", config_parse::seeds, config_parse::run),
        ("records_decode", records_decode::seeds, records_decode::run),
    ];
    for (name, seeds, run) in targets {
        let dir = root.join(name);
        std::fs::create_dir_all(&dir)?;
        let seeds = seeds();
        for (i, seed) in seeds.iter().enumerate() {
            // Every seed must pass its own target before it is handed to the fuzzer.
            run(seed);
            std::fs::write(dir.join(format!("seed-{i}")), seed)?;
        }
        println!("{name}: {} seeds in {}", seeds.len(), dir.display());
    }
    Ok(())
}
