//! `edge-uploader spool export-quarantined`: the records of the chunks held in quarantine.
//!
//! A quarantined chunk (its bytes failed their checksum, or the ingest rejected it) is never
//! sent again, and is kept until `spool purge-quarantined` deletes it. This prints its records,
//! so that an operator can look at them, fix them and push them again as new records
//! (`edge-uploader push`) before the purge. A chunk the ingest refused was not stored there; one
//! whose bytes went bad in the spool may have been, if the agent had sent it before (its answer
//! lost): for each such chunk the report prints the `edge-ingest stored` command that asks the
//! ingest, with the chunk's key (the device, from the config's certificate; the stream; the
//! spool id; the seq), and `--stream S --seq N` exports one chunk alone. It only reads
//! (`edge_spool::export_quarantined`: every batch whose checksums pass, nothing of a chunk whose
//! own row is damaged), so it runs beside the agent too.
//!
//! The records go to standard output, in the formats of `edge-ingest export`: NDJSON (each
//! record and a newline) or raw (a 4-byte little-endian length and the record). Each chunk, with
//! what was exported of it and why it is in quarantine, goes to standard error.
//!
//! Exit codes: 0 every record of every quarantined chunk exported (none in quarantine
//! included), 1 some records could not be exported (named on standard error), the output or the
//! spool failed, or no chunk of the `--seq` asked for is in quarantine, 78 configuration error
//! (no such file); clap's usage errors exit 2.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::io::Write;
use std::path::{Path, PathBuf};

use edge_spool::{ExportError, SalvagedChunk, Selection, SpoolId};

/// Exit code when records could not be exported, or the export failed.
pub const EXIT_INCOMPLETE: u8 = 1;

/// How the records are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// Each record followed by a newline (records are expected to be JSON lines; a record that
    /// holds a newline is not written, and named, in this format).
    Ndjson,
    /// Each record as a 4-byte little-endian length and its bytes: binary-safe.
    Raw,
}

/// What the command exported of one chunk, beyond what the spool handed over: batches whose
/// records could not be written in the chosen format.
#[derive(Debug, Default)]
struct Written {
    records: u64,
    problems: Vec<String>,
}

/// The key the ingest would store a chunk of this spool under, less its stream and seq.
#[derive(Debug, Clone, Default)]
struct Origin {
    /// The device id, from the config's certificate (`None` under `--spool`, or unreadable).
    device: Option<String>,
    /// The spool id, `None` when its row fails its checksum.
    spool: Option<SpoolId>,
}

/// Resolves the spool ([`crate::spool_check::existing_spool_and_config`]), exports the chunks
/// `select` takes to standard output, reports on standard error and returns the exit code.
pub fn run(config: Option<&Path>, spool: Option<PathBuf>, select: Selection<'_>, format: Format) -> u8 {
    let (path, device) = match crate::spool_check::existing_spool_and_config(config, spool) {
        Ok((opts, config)) => (opts.path, config.and_then(|c| device_of(&c.upload.tls.cert))),
        Err(code) => return code,
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::with_capacity(1 << 20, stdout.lock());
    let exported = export(&path, select, format, &mut out);
    let flushed = out.flush();
    match (exported, flushed) {
        (Ok((salvage, written)), Ok(())) => {
            let origin = Origin { device, spool: salvage.spool_id };
            let (text, complete) = render(&path, select, &origin, &salvage.chunks, &written);
            eprint!("{text}");
            if complete { 0 } else { EXIT_INCOMPLETE }
        }
        (Err(e), _) => {
            eprintln!("edge-uploader: exporting from {}: {}", path.display(), edge_telemetry::logging::error_chain(&e));
            EXIT_INCOMPLETE
        }
        (Ok(_), Err(e)) => {
            eprintln!("edge-uploader: exporting from {}: writing the exported records: {e}", path.display());
            EXIT_INCOMPLETE
        }
    }
}

/// The device id in the certificate file `cert` (the agent's `upload.cert`), if it reads.
fn device_of(cert: &Path) -> Option<String> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let der = CertificateDer::from_pem_file(cert).ok()?;
    edge_transport::device_id_from_cert_der(der.as_ref()).ok()
}

/// Writes the records of every quarantined chunk `select` takes to `out`; returns the spool's id
/// and chunks as the spool read them, and what was written of each (by chunk id).
fn export(
    path: &Path,
    select: Selection<'_>,
    format: Format,
    out: &mut dyn Write,
) -> Result<(edge_spool::Salvage, HashMap<i64, Written>), ExportError> {
    let mut written: HashMap<i64, Written> = HashMap::new();
    let salvage = edge_spool::export_quarantined(path, select, &mut |chunk, batch, records| {
        let w = written.entry(chunk.id).or_default();
        match check_batch(batch, records, format) {
            Ok(recs) => {
                for rec in &recs {
                    write_record(out, rec, format)?;
                }
                w.records += recs.len() as u64;
            }
            Err(why) => w.problems.push(why),
        }
        Ok(())
    })?;
    Ok((salvage, written))
}

/// The records of one batch, all of them writable in `format`, or why none is written. A batch
/// is written whole or not at all, so that what is missing is a batch the report names.
fn check_batch(batch: &[u8], records: i64, format: Format) -> Result<Vec<&[u8]>, String> {
    let expected = u32::try_from(records).map_err(|_| format!("a batch's row counts {records} records"))?;
    let recs = edge_proto::records::split_records(batch, expected)
        .map_err(|e| format!("a batch of {} bytes does not hold {records} framed records: {e}", batch.len()))?;
    // A newline inside would split the record, and the intake takes a line's trailing `\r` off
    // (CRLF input): pushed back as NDJSON, either would come back changed.
    if format == Format::Ndjson
        && let Some(i) = recs.iter().position(|r| r.contains(&b'\n') || r.last() == Some(&b'\r'))
    {
        return Err(format!(
            "record {} of a batch of {records} holds a newline or ends in a carriage return, which NDJSON does \
             not carry as it is: export it with --format raw",
            i + 1
        ));
    }
    Ok(recs)
}

fn write_record(out: &mut dyn Write, rec: &[u8], format: Format) -> std::io::Result<()> {
    match format {
        Format::Ndjson => {
            out.write_all(rec)?;
            out.write_all(b"\n")
        }
        Format::Raw => {
            let len = u32::try_from(rec.len()).map_err(std::io::Error::other)?;
            out.write_all(&len.to_le_bytes())?;
            out.write_all(rec)
        }
    }
}

/// Whether a chunk quarantined for `reason` may be stored at the ingest already: one whose bytes
/// went bad in the spool may have been sent before they did, with the answer lost, and one over
/// the ingest's limit may have been stored before the limit was lowered. The others (refused by
/// the ingest, over the protocol's limit) were not stored.
fn may_be_stored(reason: &str) -> bool {
    use crate::uploader::{OVER_SERVER_LIMIT, QUARANTINE_CORRUPT, QUARANTINE_UNREADABLE};
    reason.starts_with(QUARANTINE_CORRUPT)
        || reason.starts_with(QUARANTINE_UNREADABLE)
        || reason.contains(OVER_SERVER_LIMIT)
}

/// The `edge-ingest stored` command that asks the ingest whether chunk `c` of `origin` is
/// stored; placeholders where the device or the spool id is not known here.
fn stored_command(origin: &Origin, c: &SalvagedChunk) -> String {
    let device = origin.device.as_deref().unwrap_or("<the device id: the common name of upload.cert>");
    let spool = origin
        .spool
        .map_or_else(|| "<the spool id: its row in the spool fails its checksum>".into(), |id| id.to_string());
    // `--name=value`: a device id or a stream name may start with `-`.
    format!(
        "edge-ingest stored --config /etc/edge-ingest/edge-ingest.toml --device={device} --stream={} --spool={spool} \
         --seq={}",
        c.stream, c.seq
    )
}

/// The report for standard error, and whether every record was exported.
fn render(
    path: &Path,
    select: Selection<'_>,
    origin: &Origin,
    chunks: &[SalvagedChunk],
    written: &HashMap<i64, Written>,
) -> (String, bool) {
    let mut text = String::new();
    let (mut total, mut claimed, mut partial, mut ask) = (0u64, 0u64, 0usize, 0usize);
    for c in chunks {
        let w = written.get(&c.id);
        let records = w.map_or(0, |w| w.records);
        let problems: Vec<&str> = c
            .problems
            .iter()
            .map(String::as_str)
            .chain(w.iter().flat_map(|w| w.problems.iter().map(String::as_str)))
            .collect();
        let claims = u64::try_from(c.records).unwrap_or(0);
        total += records;
        claimed = claimed.saturating_add(claims);
        let _ = write!(text, "chunk {} (stream {}, seq {}): ", c.id, c.stream, c.seq);
        if problems.is_empty() {
            let _ = write!(text, "{records} records exported");
        } else {
            partial += 1;
            let _ = write!(text, "{records} of {claims} records exported; not exported: {}", problems.join("; "));
        }
        let _ = write!(text, " (quarantined: {})", c.reason);
        if records > 0 && may_be_stored(&c.reason) {
            ask += 1;
            let _ = write!(
                text,
                "; the agent may have sent it before it was quarantined (its answer lost, then its bytes went bad, or \
                 the ingest's limit lowered since): before pushing these records again, ask the ingest with\n    {}",
                stored_command(origin, c)
            );
        }
        let _ = writeln!(text);
    }
    let of = match (select.stream, select.seq) {
        (Some(s), Some(seq)) => format!(" of stream {s:?}, seq {seq}"),
        (Some(s), None) => format!(" of stream {s:?}"),
        (None, Some(seq)) => format!(" of seq {seq}"),
        (None, None) => String::new(),
    };
    let _ = write!(text, "{}: exported {total} records of {} quarantined chunk(s){of}", path.display(), chunks.len());
    if partial == 0 {
        let _ = writeln!(text);
    } else {
        let _ = writeln!(
            text,
            "; {partial} chunk(s) not in full ({} of their records are not exported, see above)",
            claimed.saturating_sub(total)
        );
    }
    if ask > 0 {
        let _ = writeln!(
            text,
            "{ask} chunk(s) may be stored at the ingest already: where `edge-ingest stored` exits 0 (stored), leave \
             that chunk's records out of the push (`--stream S --seq N` exports one chunk alone); where it exits 4 \
             (some parts in JetStream), pushing them again would store those parts' records twice. The spool id is \
             the one the spool has now: if it took a new one since the chunk was sent (the agent logs it, and \
             `status` says so for a while, when another gateway used its id), leave --spool out, and the ingest \
             lists every spool's chunk of that seq"
        );
    }
    if let (Some(seq), true) = (select.seq, chunks.is_empty()) {
        let of = select.stream.map(|s| format!(" of stream {s:?}")).unwrap_or_default();
        let _ = writeln!(text, "no chunk{of} with seq {seq} is in quarantine");
        return (text, false);
    }
    (text, partial == 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(records: &[&[u8]]) -> Vec<u8> {
        let mut out = Vec::new();
        for r in records {
            edge_proto::records::encode_record(&mut out, r);
        }
        out
    }

    #[test]
    fn ndjson_refuses_a_batch_whose_records_would_come_back_changed_and_raw_takes_it() {
        for odd in [&b"a\nb"[..], b"crlf\r"] {
            let batch = framed(&[b"{}", odd]);
            let why = check_batch(&batch, 2, Format::Ndjson).expect_err("not NDJSON-safe");
            assert!(why.starts_with("record 2 of a batch of 2 holds a newline or ends in a carriage return"), "{why}");
            assert_eq!(check_batch(&batch, 2, Format::Raw).expect("raw"), vec![&b"{}"[..], odd]);
        }
        // A carriage return inside a record is carried as it is.
        assert_eq!(check_batch(&framed(&[b"a\rb"]), 1, Format::Ndjson).expect("ndjson").len(), 1);
        // Framing that does not hold the row's count of records.
        let why = check_batch(&framed(&[b"{}"]), 2, Format::Raw).expect_err("count");
        assert!(why.contains("does not hold 2 framed records"), "{why}");
    }

    #[test]
    fn only_chunks_whose_bytes_went_bad_or_were_over_the_ingests_limit_may_be_stored_already() {
        assert!(may_be_stored("corrupt in spool: batch 3: crc32c stored 1, computed 2"));
        assert!(may_be_stored("unreadable in spool: database disk image is malformed"));
        assert!(may_be_stored("600000 bytes, over the server's limit of 524288"));
        assert!(!may_be_stored("rejected by server: BadRecords"));
        assert!(!may_be_stored("9000 records, over the protocol's limit of 8192"));
    }
}
