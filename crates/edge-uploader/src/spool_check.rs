//! `edge-uploader spool check`: audits the spool file without changing it.
//!
//! Runs SQLite's full `integrity_check` and verifies the CRC-32C of every batch (sealed chunks,
//! quarantined chunks and open batches), then prints which chunks and streams are damaged and
//! how many records and bytes that is. Read-only, so it works while the agent is stopped and
//! also while it runs (WAL: the check reads one consistent snapshot and never blocks the
//! agent's writer).
//!
//! Exit codes: 0 clean (quarantined chunks do not count: they are known and out of
//! circulation), 1 damage found, 78 usage or configuration error (including a missing file).

use std::path::{Path, PathBuf};

use edge_spool::{CheckReport, DamagedChunk};
use serde_json::json;

use crate::EXIT_CONFIG;

/// Exit code when the file is clean.
pub const EXIT_CLEAN: u8 = 0;
/// Exit code when damage was found.
pub const EXIT_DAMAGE: u8 = 1;

/// The spool the `spool` subcommands work on: `--spool` (default options) wins over the
/// config (its spool options, with the service's overrides). `Err` is the exit code, the reason
/// printed: an invalid config, or no spool file there (opening would create one).
pub(crate) fn existing_spool(config: Option<&Path>, spool: Option<PathBuf>) -> Result<edge_spool::SpoolOptions, u8> {
    existing_spool_and_config(config, spool).map(|(opts, _)| opts)
}

/// [`existing_spool`], with the config it was named by (`None` under `--spool`).
pub(crate) fn existing_spool_and_config(
    config: Option<&Path>,
    spool: Option<PathBuf>,
) -> Result<(edge_spool::SpoolOptions, Option<crate::config::Config>), u8> {
    let (opts, config) = match spool {
        Some(p) => (edge_spool::SpoolOptions::new(p), None),
        None => match crate::config::load_as_service(config) {
            Ok(c) => (c.spool.clone(), Some(c)),
            Err(e) => {
                eprintln!("edge-uploader: invalid config: {}", edge_telemetry::logging::error_chain(e.as_ref()));
                return Err(config_exit());
            }
        },
    };
    if !opts.path.is_file() {
        eprintln!("edge-uploader: spool file {} does not exist", opts.path.display());
        return Err(config_exit());
    }
    Ok((opts, config))
}

/// Resolves the spool path ([`existing_spool`]), runs the check, prints the result and returns
/// the exit code.
pub fn run(config: Option<&Path>, spool: Option<PathBuf>, json: bool) -> u8 {
    let path = match existing_spool(config, spool) {
        Ok(opts) => opts.path,
        Err(code) => return code,
    };
    let report = match edge_spool::check(&path) {
        Ok(r) => r,
        Err(e) => {
            // SQLite could not even open it: that is damage too, reported as such.
            eprintln!("edge-uploader: cannot check {}: {e}", path.display());
            if json {
                println!("{}", json!({"version": 1, "path": path, "clean": false, "error": e.to_string()}));
            }
            return EXIT_DAMAGE;
        }
    };
    if json {
        println!("{}", to_json(&path, &report));
    } else {
        print!("{}", render(&path, &report));
    }
    if report.has_damage() { EXIT_DAMAGE } else { EXIT_CLEAN }
}

pub(crate) fn config_exit() -> u8 {
    u8::try_from(EXIT_CONFIG).unwrap_or(78)
}

fn chunk_json(c: &DamagedChunk) -> serde_json::Value {
    json!({
        "id": c.id, "stream": c.stream, "seq": c.seq, "records": c.records, "bytes": c.bytes,
        "quarantined": c.quarantined, "bad_batches": c.bad_batches,
        "salvageable_records": c.salvageable_records, "salvageable_bytes": c.salvageable_bytes,
        "detail": c.detail,
    })
}

/// The machine-readable report (`"version": 1`).
pub fn to_json(path: &Path, r: &CheckReport) -> serde_json::Value {
    let mut streams: Vec<&str> = r.damaged_chunks.iter().map(|c| c.stream.as_str()).collect();
    streams.extend(r.damaged_open_batches.iter().map(|b| b.stream.as_str()));
    streams.sort_unstable();
    streams.dedup();
    json!({
        "version": 1,
        "path": path,
        "clean": !r.has_damage(),
        "integrity": r.integrity,
        "read_error": r.read_error,
        "damaged_rows": r.damaged_rows,
        "chunks": r.chunks,
        "batches": r.batches,
        "bytes": r.bytes,
        "damaged_chunks": r.damaged_chunks.iter().map(chunk_json).collect::<Vec<_>>(),
        "damaged_open_batches": r.damaged_open_batches.iter().map(|b| json!({
            "id": b.id, "stream": b.stream, "records": b.records, "bytes": b.bytes, "detail": b.detail,
        })).collect::<Vec<_>>(),
        "damaged_streams": streams,
        "damaged_records": r.damaged_records(),
        "damaged_bytes": damaged_bytes(r),
        "quarantined_damaged": r.quarantined_damaged.iter().map(chunk_json).collect::<Vec<_>>(),
        "quarantined_intact": r.quarantined_intact,
        "lost_tail": r.lost_tail.as_ref().map(|t| json!({
            "first_batch": t.first_batch, "batches": t.batches, "records": t.records,
        })),
        "replayable": r.replayable.map(|t| json!({
            "commits": t.commits, "records": t.records, "chunks": t.chunks,
        })),
    })
}

/// Payload bytes of the damaged live chunks and open batches. The sizes are the rows' own,
/// which may be damaged too (a flipped top bit): a negative one counts 0, as the agent counts
/// it, and the sum saturates (an `i64` sum of them overflowed, a panic in a debug build).
fn damaged_bytes(r: &CheckReport) -> u64 {
    let chunks = r.damaged_chunks.iter().map(|c| u64::try_from(c.bytes).unwrap_or(0));
    chunks.chain(r.damaged_open_batches.iter().map(|b| b.bytes)).fold(0, u64::saturating_add)
}

/// The human-readable report.
pub fn render(path: &Path, r: &CheckReport) -> String {
    use std::fmt::Write;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "spool {}: {} chunks, {} batches, {} payload bytes checked",
        path.display(),
        r.chunks,
        r.batches,
        r.bytes
    );
    if r.integrity.is_empty() {
        let _ = writeln!(out, "sqlite integrity_check: ok");
    } else {
        let _ = writeln!(out, "sqlite integrity_check: {} problem(s)", r.integrity.len());
        for l in &r.integrity {
            let _ = writeln!(out, "  {l}");
        }
    }
    if let Some(e) = &r.read_error {
        let _ = writeln!(out, "reading rows stopped: {e}");
    }
    for row in &r.damaged_rows {
        let _ = writeln!(out, "DAMAGED: {row} (the agent moves this file aside when it opens it)");
    }
    for c in &r.damaged_chunks {
        let _ = writeln!(
            out,
            "DAMAGED chunk {} (stream {}, seq {}): {} records / {} bytes; {} bad batch(es), {} records salvageable: {}",
            c.id, c.stream, c.seq, c.records, c.bytes, c.bad_batches, c.salvageable_records, c.detail
        );
    }
    for b in &r.damaged_open_batches {
        let _ = writeln!(
            out,
            "DAMAGED open batch {} (stream {}): {} records / {} bytes: {}",
            b.id, b.stream, b.records, b.bytes, b.detail
        );
    }
    for c in &r.quarantined_damaged {
        let _ =
            writeln!(out, "quarantined chunk {} (stream {}, seq {}) is damaged: {}", c.id, c.stream, c.seq, c.detail);
    }
    if r.quarantined_intact > 0 {
        let _ = writeln!(out, "{} quarantined chunk(s) with intact bytes", r.quarantined_intact);
    }
    if r.quarantined_intact > 0 || !r.quarantined_damaged.is_empty() {
        let _ = writeln!(
            out,
            "the records of the quarantined chunks (their batches that check out, of chunks whose rows add up): \
             `edge-uploader spool export-quarantined`"
        );
    }
    if let Some(t) = &r.lost_tail {
        let _ = writeln!(
            out,
            "lost in a power cut before their sync: {} records in {} batch(es) from batch {} (no producer was told they \
             were stored, none was sent; the agent drops them when it starts)",
            t.records, t.batches, t.first_batch
        );
    }
    if let Some(t) = &r.replayable {
        let _ = writeln!(
            out,
            "in the payload segments' commit records, not in the index: {} records of {} commit(s), {} chunk(s) sealed \
             (a power cut took their rows before the WAL's sync; the agent adds them back when it starts)",
            t.records, t.commits, t.chunks
        );
    }
    let _ = writeln!(
        out,
        "{}",
        if r.has_damage() { format!("DAMAGE FOUND: {} records affected", r.damaged_records()) } else { "clean".into() }
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_tail_is_reported_as_what_the_agent_drops_not_as_damage() {
        let report = CheckReport {
            chunks: 1,
            batches: 3,
            lost_tail: Some(edge_spool::LostTail { first_batch: 7, batches: 2, records: 40 }),
            ..CheckReport::default()
        };
        let path = Path::new("/var/lib/edge-uploader/spool.db");
        let text = render(path, &report);
        assert!(
            text.contains("lost in a power cut before their sync: 40 records in 2 batch(es) from batch 7"),
            "{text}"
        );
        assert!(text.trim_end().ends_with("clean"), "{text}");
        let doc = to_json(path, &report);
        assert_eq!(doc["clean"], true);
        assert_eq!(doc["lost_tail"]["records"], 40);
        assert_eq!(doc["damaged_records"], 0);
    }

    fn damaged_chunk(id: i64, records: i64, bytes: i64) -> DamagedChunk {
        DamagedChunk {
            id,
            stream: "s".into(),
            seq: id,
            records,
            bytes,
            quarantined: None,
            bad_batches: 1,
            salvageable_records: 0,
            salvageable_bytes: 0,
            detail: "chunk row fails its checksum".into(),
        }
    }

    #[test]
    fn damaged_sizes_past_i64_or_negative_are_summed_without_overflowing() {
        // The sizes are the damaged rows' own: a flipped top bit makes one negative, two near
        // i64::MAX overflowed the sum.
        let open = |bytes| edge_spool::DamagedBatch {
            id: 9,
            stream: "s".into(),
            records: i64::MAX,
            bytes,
            detail: "crc32c".into(),
        };
        let report = CheckReport {
            damaged_chunks: vec![
                damaged_chunk(1, i64::MAX, i64::MAX),
                damaged_chunk(2, -1, -5),
                damaged_chunk(3, 1, i64::MAX),
            ],
            damaged_open_batches: vec![open(u64::MAX)],
            ..CheckReport::default()
        };
        let path = Path::new("/var/lib/edge-uploader/spool.db");
        let doc = to_json(path, &report);
        assert_eq!((doc["damaged_bytes"].clone(), doc["damaged_records"].clone()), (json!(u64::MAX), json!(u64::MAX)));
        assert!(render(path, &report).contains(&format!("DAMAGE FOUND: {} records affected", u64::MAX)));
        // A negative size takes nothing from the others.
        let report = CheckReport {
            damaged_chunks: vec![damaged_chunk(1, 10, 1000), damaged_chunk(2, -1, -5)],
            damaged_open_batches: vec![edge_spool::DamagedBatch { records: 2, ..open(24) }],
            ..CheckReport::default()
        };
        let doc = to_json(path, &report);
        assert_eq!((doc["damaged_bytes"].clone(), doc["damaged_records"].clone()), (json!(1024), json!(12)));
    }

    #[test]
    fn commits_in_the_records_but_not_the_index_are_reported_as_what_the_agent_adds_back() {
        let report = CheckReport {
            replayable: Some(edge_spool::Replayable { commits: 3, records: 120, chunks: 1 }),
            ..CheckReport::default()
        };
        let path = Path::new("/var/lib/edge-uploader/spool.db");
        let text = render(path, &report);
        assert!(text.contains("not in the index: 120 records of 3 commit(s), 1 chunk(s) sealed"), "{text}");
        assert!(text.trim_end().ends_with("clean"), "{text}");
        let doc = to_json(path, &report);
        assert_eq!((doc["clean"].clone(), doc["replayable"]["records"].clone()), (json!(true), json!(120)));
    }
}
