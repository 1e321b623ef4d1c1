//! [`export_quarantined`]: the records of the chunks in quarantine, read-only, for
//! `edge-uploader spool export-quarantined`.
//!
//! A quarantined chunk is never sent again. It stays in the spool, with its reason, until an
//! operator purges it. This gives its records back, so that they can be looked at, fixed, or
//! pushed again as new records, before the purge deletes them. (Whether the ingest may hold the
//! chunk already depends on why it was quarantined; the caller says so.)
//!
//! Only what checks out is handed over: a batch whose bytes match their CRC-32C and whose row
//! matches its row checksum, of a chunk whose own row and stream row match theirs (from schema
//! version 3; older files have no row checksums), and whose batches' rows, the failed ones
//! included, add up to the chunk's records and bytes. A chunk's row names the range of batches
//! it holds, so a damaged chunk row, or a batch row without a checksum, could bring in another
//! chunk's batches, whose records are not in quarantine and will be delivered: nothing of such a
//! chunk is handed over, and nothing of a chunk before all of its batches are checked. Each
//! chunk says what was handed over and what was not, and why.
//!
//! The connection is read-only and reads one snapshot, so it can run beside the agent; the
//! agent never deletes a quarantined chunk (only a purge does, with the agent stopped).

use std::path::Path;

use crate::check::{Files, RowChecks, check_batch, membership, open_read_only};
use crate::error::ctx;
use crate::rowcrc::{self, ChunkRow};
use crate::segment::SegmentFiles;
use crate::{SpoolError, SpoolId, schema};

/// Which quarantined chunks [`export_quarantined`] reads; `None` takes every one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Selection<'a> {
    /// Only this stream's.
    pub stream: Option<&'a str>,
    /// Only the chunk of this sequence number (of each stream, without `stream`).
    pub seq: Option<i64>,
}

/// What [`export_quarantined`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Salvage {
    /// The spool's id, the one its chunks are sent under (with the device and stream, the key the
    /// ingest stores them by). `None` when the row that holds it fails its checksum or is missing.
    pub spool_id: Option<SpoolId>,
    /// The quarantined chunks selected, each with what was handed over of it.
    pub chunks: Vec<SalvagedChunk>,
}

/// One quarantined chunk, as [`export_quarantined`] read it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SalvagedChunk {
    /// Chunk id (`chunks.id`).
    pub id: i64,
    /// Stream name (`?` if the stream row is missing).
    pub stream: String,
    /// Sequence number.
    pub seq: i64,
    /// Records the chunk row claims.
    pub records: i64,
    /// Payload bytes the chunk row claims.
    pub bytes: i64,
    /// Why it was quarantined.
    pub reason: String,
    /// Batches handed over: every one whose bytes and row checked out.
    pub batches: u64,
    /// Records in them, as their rows count them.
    pub exported_records: u64,
    /// Bytes in them.
    pub exported_bytes: u64,
    /// Batches not handed over (damaged or unreadable).
    pub bad_batches: u64,
    /// What kept records back, first problem first; empty when the whole chunk was handed over.
    pub problems: Vec<String>,
}

impl SalvagedChunk {
    /// Whether every record of the chunk was handed over.
    pub fn complete(&self) -> bool {
        self.problems.is_empty()
    }
}

/// What [`export_quarantined`] hands each batch that checks out to: its chunk, its data as
/// stored (the intake's framed records) and the records its row counts.
pub type OnBatch<'a> = dyn FnMut(&SalvagedChunk, &[u8], i64) -> std::io::Result<()> + 'a;

/// Why [`export_quarantined`] stopped.
#[derive(Debug, thiserror::Error)]
pub enum ExportError {
    /// The spool could not be read.
    #[error(transparent)]
    Spool(#[from] SpoolError),
    /// The caller's `batch` callback failed (writing the output, say).
    #[error("writing the exported records")]
    Output(#[source] std::io::Error),
}

/// Reads the spool file at `path` read-only and hands every batch of every quarantined chunk
/// that `select` takes and that checks out to `batch`, with its chunk and the number of records
/// its row counts, in order of stream name, then sequence number, then batch id; a chunk's
/// batches only once all of them are checked and add up to its row. Returns the spool's id and
/// the chunks, each with what was handed over and what was not. See the module docs.
///
/// # Errors
/// [`ExportError::Spool`] when the file does not exist or is not a spool SQLite can read (then
/// nothing was handed over), or a read failed part-way; [`ExportError::Output`] when `batch`
/// failed. What was handed over before stays handed over.
pub fn export_quarantined(path: &Path, select: Selection<'_>, batch: &mut OnBatch<'_>) -> Result<Salvage, ExportError> {
    let conn = open_read_only(path)?;
    let version = match schema::inspect(&conn)? {
        // A file of no tables yet (a spool created and never written): nothing in quarantine.
        (0, 0) => return Ok(Salvage { spool_id: None, chunks: Vec::new() }),
        (version @ 1..=schema::SCHEMA_VERSION, _) => version,
        (found, _) if found > schema::SCHEMA_VERSION => {
            return Err(SpoolError::UnsupportedSchema { found, supported: schema::SCHEMA_VERSION }.into());
        }
        (found, objects) => {
            return Err(SpoolError::Inconsistent(format!(
                "{} is not an edge spool: user_version {found}, {objects} schema objects",
                path.display()
            ))
            .into());
        }
    };
    // One snapshot for the whole export: the chunk rows and the batches they name agree.
    let tx = conn.unchecked_transaction().map_err(ctx("beginning a read transaction"))?;
    let m = membership(version);
    // From version 3 the meta values have a checksum; before, the id's row is taken as it is.
    let meta = (version >= 3).then(|| schema::read_verified_meta(&tx).ok()).flatten();
    let spool_id = if version >= 3 {
        meta.as_ref().map(|meta| meta.spool_id.clone())
    } else {
        tx.query_row("SELECT value FROM meta WHERE key = ?1", [schema::META_SPOOL_ID], |r| r.get::<_, Vec<u8>>(0)).ok()
    };
    let spool_id = spool_id.and_then(|id| <[u8; 16]>::try_from(id.as_slice()).ok()).map(SpoolId);
    // A damaged `meta` row leaves no legacy mark: every batch row must then have a checksum.
    let rows = (version >= 3).then(|| RowChecks {
        legacy_through: meta.as_ref().map_or(0, |meta| meta.legacy_batches_through),
        segments: version >= 4,
    });
    let row_columns = if rows.is_some() {
        ", c.id, c.stream_id, c.seq, c.records, c.bytes, c.first_ms, c.sealed_ms, c.first_batch, c.last_batch, \
         c.row_crc, s.id, s.next_seq, s.sealed_through, s.row_crc"
    } else {
        ""
    };
    let mut chunks = tx
        .prepare(&format!(
            "SELECT c.id, coalesce(s.name, '?'), c.seq, c.records, c.bytes, c.quarantine, {}{row_columns}
             FROM chunks c LEFT JOIN streams s ON s.id = c.stream_id
             WHERE c.quarantine IS NOT NULL ORDER BY s.name, c.seq, c.id",
            m.chunk_columns
        ))
        .map_err(ctx("listing quarantined chunks"))?;
    let mut batches = tx.prepare(m.chunk_batches).map_err(ctx("reading batches"))?;
    let mut files = Files { segments: SegmentFiles::new(path), buf: Vec::new() };
    let mut out = Vec::new();
    let mut listed = chunks.query([]).map_err(ctx("listing quarantined chunks"))?;
    while let Some(r) = listed.next().map_err(ctx("listing quarantined chunks"))? {
        let get = |e| ctx("listing quarantined chunks")(e);
        let mut c = SalvagedChunk {
            id: r.get(0).map_err(get)?,
            stream: r.get(1).map_err(get)?,
            seq: r.get(2).map_err(get)?,
            records: r.get(3).map_err(get)?,
            bytes: r.get(4).map_err(get)?,
            reason: r.get::<_, Option<String>>(5).map_err(get)?.unwrap_or_default(),
            batches: 0,
            exported_records: 0,
            exported_bytes: 0,
            bad_batches: 0,
            problems: Vec::new(),
        };
        if select.stream.is_some_and(|s| s != c.stream) || select.seq.is_some_and(|seq| seq != c.seq) {
            continue;
        }
        if rows.is_some() {
            let row = ChunkRow::from_row(r, 9).map_err(get)?;
            let stored: Option<i64> = r.get(18).map_err(get)?;
            if stored != Some(row.crc()) {
                c.problems.push(format!(
                    "its chunk row fails its checksum (stored {stored:?}, computed {}): the batches it names may be \
                     another chunk's, so none is exported",
                    row.crc()
                ));
            }
            let (id, next_seq, sealed_through, stored): (Option<i64>, Option<i64>, Option<i64>, Option<i64>) =
                (r.get(19).map_err(get)?, r.get(20).map_err(get)?, r.get(21).map_err(get)?, r.get(22).map_err(get)?);
            let want = id.map(|id| rowcrc::stream(id, &c.stream, next_seq.unwrap_or(0), sealed_through.unwrap_or(0)));
            if want.is_none() || stored != want {
                c.problems.push(format!(
                    "the row of its stream fails its checksum or is missing, so the stream's name {:?} is not \
                     known to be its own: nothing is exported",
                    c.stream
                ));
            }
        }
        if c.complete() {
            export_chunk(r, version, rows, &mut batches, &mut files, &mut c, batch)?;
        }
        out.push(c);
    }
    Ok(Salvage { spool_id, chunks: out })
}

/// Hands over the batches of the chunk of row `r` that check out, and counts what does not.
/// Every batch is read and checked first, and the batches' rows (the failed ones included) must
/// add up to the chunk's records and bytes: only then is anything handed over. A range that
/// names a batch too many or too few (which rows without checksums, of versions 1 and 2 or
/// legacy batches, cannot show otherwise) hands over nothing, for the extra batch could be
/// another chunk's.
fn export_chunk(
    r: &rusqlite::Row<'_>,
    version: i64,
    rows: Option<RowChecks>,
    batches: &mut rusqlite::Statement<'_>,
    files: &mut Files,
    c: &mut SalvagedChunk,
    batch: &mut OnBatch<'_>,
) -> Result<(), ExportError> {
    let get = |e| ctx("listing quarantined chunks")(e);
    let range: (i64, i64, i64) = (r.get(6).map_err(get)?, r.get(7).map_err(get)?, r.get(8).map_err(get)?);
    let mut b =
        if version == 1 { batches.query([c.id]) } else { batches.query(range) }.map_err(ctx("reading batches"))?;
    // The good batches, held until the chunk adds up: a chunk is at most a few MiB.
    let mut good: Vec<(Vec<u8>, i64)> = Vec::new();
    let (mut records, mut bytes, mut unreadable) = (0i64, 0u64, false);
    loop {
        let row = match b.next() {
            Ok(Some(row)) => row,
            Ok(None) => break,
            Err(e) => {
                c.bad_batches += 1;
                c.problems.push(format!("the rest of its batches are unreadable: {e}"));
                unreadable = true;
                break;
            }
        };
        let mut kept: Option<Vec<u8>> = None;
        match check_batch(row, rows, files, &mut |data| kept = Some(data.to_vec())) {
            Ok(v) => {
                records = records.saturating_add(v.records);
                bytes = bytes.saturating_add(v.len);
                match (v.problem, kept) {
                    (None, Some(data)) => good.push((data, v.records)),
                    (problem, _) => {
                        c.bad_batches += 1;
                        c.problems.push(problem.unwrap_or_else(|| "a batch was not handed over".into()));
                    }
                }
            }
            Err(e) => {
                c.bad_batches += 1;
                c.problems.push(format!("a batch row is unreadable: {e}"));
                unreadable = true;
            }
        }
    }
    if good.is_empty() && c.bad_batches == 0 {
        c.problems.push("it has no batches".into());
        return Ok(());
    }
    if unreadable {
        c.problems.push("with rows unread its batches cannot be counted against its row: none is exported".into());
        return Ok(());
    }
    if records != c.records || i64::try_from(bytes).ok() != Some(c.bytes) {
        c.problems.push(format!(
            "its row says {} bytes / {} records, the batches it names hold {bytes} bytes / {records} records: they \
             may not all be its own, so none is exported",
            c.bytes, c.records
        ));
        return Ok(());
    }
    for (data, n) in good {
        batch(c, &data, n).map_err(ExportError::Output)?;
        c.batches += 1;
        c.exported_records = c.exported_records.saturating_add(u64::try_from(n).unwrap_or(0));
        c.exported_bytes = c.exported_bytes.saturating_add(crate::len_u64(&data));
    }
    Ok(())
}
