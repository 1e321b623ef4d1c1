//! The read side: [`SpoolReader`] lists sealed chunks and reads their bytes, verifying every
//! batch's CRC-32C, over its own read-only connection (WAL readers never block the writer).

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};

use crate::crc;
use crate::error::ctx;
use crate::rowcrc::{self, BatchRow, ChunkRow, SegRef};
use crate::schema;
use crate::segment::SegmentFiles;
use crate::walsync::Visible;
use crate::{ChunkId, ChunkMeta, ChunkPayload, QuarantinedChunk, SpoolError};

/// A read-only connection to a spool file, made by [`Spool::reader`](crate::Spool::reader).
/// `Send`; give each thread its own.
#[derive(Debug)]
pub struct SpoolReader {
    conn: Connection,
    /// `meta.legacy_batches_through`: batch rows up to this id may have no row checksum.
    legacy_batches_through: i64,
    segments: SegmentFiles,
    /// Chunks with a greater id are committed but not durable yet (see `walsync.rs`).
    visible: Visible,
}

const META_COLUMNS: &str = "c.id, s.name, c.seq, c.records, c.bytes, c.first_ms, c.sealed_ms";

impl SpoolReader {
    pub(crate) fn open(path: &Path, legacy_batches_through: i64, visible: Visible) -> Result<SpoolReader, SpoolError> {
        Ok(SpoolReader {
            conn: schema::open_reader(path)?,
            legacy_batches_through,
            segments: SegmentFiles::new(path),
            visible,
        })
    }

    /// Up to `limit` sealed, not quarantined chunks with an id greater than `after` (all if
    /// `None`), ordered by id, which is sealing order. While the writer defers its WAL sync
    /// ([`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync)), only chunks a sync has made
    /// durable.
    ///
    /// A chunk row with a value its [`ChunkMeta`] field cannot hold (damage) is listed with
    /// that value clamped into range, and reading it gives [`SpoolError::Corrupt`].
    ///
    /// # Errors
    /// SQLite errors.
    pub fn sealed_after(&mut self, after: Option<ChunkId>, limit: usize) -> Result<Vec<ChunkMeta>, SpoolError> {
        let after = after.map_or(i64::MIN, |c| c.0);
        // No `LIMIT ?2`: SQLite recompiles a statement whose LIMIT is a parameter each time
        // that parameter is bound again (it may plan with the value), and every call binds it;
        // the recompiles were 4 % of the agent's drain samples. Rows come one step at a time,
        // so taking `limit` of them reads no further.
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT {META_COLUMNS} FROM chunks c JOIN streams s ON s.id = c.stream_id
                 WHERE c.id > ?1 AND c.id <= ?2 AND c.quarantine IS NULL ORDER BY c.id"
            ))
            .map_err(ctx("listing sealed chunks"))?;
        let rows = stmt.query_map([after, self.visible.get()], meta_from_row).map_err(ctx("listing sealed chunks"))?;
        rows.take(limit).collect::<Result<_, _>>().map_err(ctx("listing sealed chunks"))
    }

    /// The chunk's payload: its batches' data concatenated in append order, each checked
    /// against its stored CRC-32C. Read in one read transaction, so it sees one snapshot.
    ///
    /// # Errors
    /// [`SpoolError::ChunkGone`] if the chunk was deleted (acked, dropped, purged) in the
    /// meantime; [`SpoolError::Corrupt`] if a checksum, size or record count does not match.
    pub fn read(&mut self, meta: &ChunkMeta) -> Result<Vec<u8>, SpoolError> {
        self.read_payload(meta).map(|p| p.data)
    }

    /// As [`SpoolReader::read`], and also the CRC-32C of the whole payload, computed while the
    /// verified batches are concatenated, so the sender need not hash the payload again.
    ///
    /// # Errors
    /// As [`SpoolReader::read`].
    pub fn read_payload(&mut self, meta: &ChunkMeta) -> Result<ChunkPayload, SpoolError> {
        let result = self.read_payload_inner(meta);
        // A segment deleted after its chunks were acked gives its disk space back only once
        // every descriptor is closed: keeping one open across reads could hold the space a
        // full disk waits for.
        self.segments.close_all();
        result
    }

    fn read_payload_inner(&mut self, meta: &ChunkMeta) -> Result<ChunkPayload, SpoolError> {
        let id = meta.id;
        let tx = self.conn.transaction().map_err(ctx("beginning a read transaction"))?;
        let corrupt = |detail: String| SpoolError::Corrupt { chunk: id, detail };
        // The chunk row and its stream's row, each against its checksum, and the values the
        // caller will send (listed earlier, maybe from a damaged row) against the row.
        type Rows = (ChunkRow, Option<i64>, String, i64, i64, Option<i64>);
        let row: Option<Rows> = tx
            .prepare_cached(
                "SELECT c.id, c.stream_id, c.seq, c.records, c.bytes, c.first_ms, c.sealed_ms, c.first_batch,
                        c.last_batch, c.row_crc, s.name, s.next_seq, s.sealed_through, s.row_crc
                 FROM chunks c LEFT JOIN streams s ON s.id = c.stream_id WHERE c.id = ?1",
            )
            .and_then(|mut s| {
                s.query_row([id.0], |r| {
                    Ok((
                        ChunkRow::from_row(r, 0)?,
                        r.get(9)?,
                        r.get::<_, Option<String>>(10)?.unwrap_or_default(),
                        r.get::<_, Option<i64>>(11)?.unwrap_or(0),
                        r.get::<_, Option<i64>>(12)?.unwrap_or(0),
                        r.get(13)?,
                    ))
                })
                .optional()
            })
            .map_err(ctx("looking up a chunk"))?;
        let Some((c, chunk_crc, name, next_seq, sealed_through, stream_crc)) = row else {
            return Err(SpoolError::ChunkGone(id));
        };
        if chunk_crc != Some(c.crc()) {
            return Err(corrupt(format!("chunk row fails its checksum (stored {chunk_crc:?}, computed {})", c.crc())));
        }
        let stream_want = rowcrc::stream(c.stream_id, &name, next_seq, sealed_through);
        if stream_crc != Some(stream_want) {
            return Err(corrupt(format!(
                "the row of its stream {} ({name:?}) fails its checksum (stored {stream_crc:?}, computed {stream_want})",
                c.stream_id
            )));
        }
        // Values our types cannot hold, even under a checksum that matches: listed clamped
        // (`meta_from_row`), never sent.
        let (Ok(seq), Ok(records), Ok(bytes), Ok(first_ms), Ok(_)) = (
            u64::try_from(c.seq),
            u32::try_from(c.records),
            u64::try_from(c.bytes),
            u64::try_from(c.first_ms),
            u64::try_from(c.sealed_ms),
        ) else {
            return Err(corrupt(format!("chunk row holds values out of range: {c:?}")));
        };
        let listed = (meta.stream.as_str(), meta.seq, u64::from(meta.records), meta.bytes, meta.first_ms);
        let on_disk = (name.as_str(), seq, u64::from(records), bytes, first_ms);
        if listed != on_disk {
            return Err(corrupt(format!("listed as {listed:?}, the verified rows say {on_disk:?}")));
        }
        let (want_records, want_bytes, stream_id, first_batch, last_batch) =
            (on_disk.2, on_disk.3, c.stream_id, c.first_batch, c.last_batch);
        let mut payload = Assembly::new(want_bytes);
        // Bytes that do not check out, or a missing segment file. Reported as damage only if
        // the chunk still exists once this snapshot is over: a chunk deleted meanwhile
        // (dropped, acked as a duplicate) may have had its segment deleted or recycled.
        let mut damage: Option<Damage> = None;
        {
            let mut stmt = tx
                .prepare_cached(
                    "SELECT id, records, crc32c, commit_ms, row_crc, segment, seg_offset, seg_len, data FROM batches
                     WHERE stream_id = ?1 AND id BETWEEN ?2 AND ?3 ORDER BY id",
                )
                .map_err(ctx("reading a chunk's batches"))?;
            let mut rows =
                stmt.query((stream_id, first_batch, last_batch)).map_err(ctx("reading a chunk's batches"))?;
            while let Some(r) = rows.next().map_err(ctx("reading a chunk's batches"))? {
                let batch: i64 = r.get(0).map_err(ctx("reading a chunk's batches"))?;
                let bad = |what: &str, e: rusqlite::Error| corrupt(format!("batch {batch}: bad {what} column: {e}"));
                let n: u32 = r.get(1).map_err(|e| bad("records", e))?;
                let stored: u32 = r.get(2).map_err(|e| bad("crc32c", e))?;
                let commit_ms: i64 = r.get(3).map_err(|e| bad("commit_ms", e))?;
                let row_crc: Option<i64> = r.get(4).map_err(|e| bad("row_crc", e))?;
                let seg_cols = (
                    r.get(5).map_err(|e| bad("segment", e))?,
                    r.get(6).map_err(|e| bad("seg_offset", e))?,
                    r.get(7).map_err(|e| bad("seg_len", e))?,
                );
                let seg = SegRef::from_columns(seg_cols).map_err(|e| corrupt(format!("batch {batch}: {e}")))?;
                let row =
                    BatchRow { id: batch, stream_id, records: i64::from(n), crc32c: i64::from(stored), commit_ms, seg };
                if !row.ok(row_crc, self.legacy_batches_through) {
                    return Err(corrupt(format!("batch {batch}: row fails its checksum (stored {row_crc:?})")));
                }
                let part = Part { batch, records: n, crc32c: stored };
                let added = match seg {
                    None => {
                        let data = r
                            .get_ref(8)
                            .map_err(ctx("reading a chunk's batches"))?
                            .as_blob()
                            .map_err(|e| corrupt(format!("batch {batch}: data is not a blob: {e}")))?;
                        payload.add_inline(part, data, &mut self.segments)
                    }
                    // Both are non-negative: `SegRef::from_columns` checked.
                    Some(s) => {
                        payload.add_in_segment(part, s.segment, s.offset as u64, s.len as u64, &mut self.segments)
                    }
                };
                if let Err(d) = added {
                    damage = Some(d);
                    break;
                }
            }
        }
        if damage.is_none() {
            damage = payload.flush(&mut self.segments).err();
        }
        tx.finish().map_err(ctx("ending a read transaction"))?;
        let damage = damage.map(|d| match d {
            Damage::MissingSegment(segment) => format!("payload segment file {segment} is missing"),
            Damage::BadBytes(detail) => detail,
        });
        if let Some(detail) = damage {
            // Deleted (and its segment deleted or recycled) after this read began, or damage.
            let still_there: bool = self
                .conn
                .query_row("SELECT EXISTS (SELECT 1 FROM chunks WHERE id = ?1)", [id.0], |r| r.get(0))
                .map_err(ctx("looking up a chunk"))?;
            if !still_there {
                return Err(SpoolError::ChunkGone(id));
            }
            return Err(corrupt(detail));
        }
        let Assembly { out, records, batches, crc, .. } = payload;
        if batches == 0 {
            return Err(corrupt("chunk has no batches".into()));
        }
        if crate::len_u64(&out) != want_bytes || records != want_records {
            return Err(corrupt(format!(
                "chunk row says {want_bytes} bytes / {want_records} records, \
                 batches hold {len} bytes / {records} records",
                len = out.len()
            )));
        }
        Ok(ChunkPayload { data: out, crc32c: crc })
    }

    /// The chunks held in quarantine, by id, with their reasons.
    ///
    /// # Errors
    /// SQLite errors.
    pub fn quarantined(&mut self) -> Result<Vec<QuarantinedChunk>, SpoolError> {
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT {META_COLUMNS}, c.quarantine
                 FROM chunks c JOIN streams s ON s.id = c.stream_id
                 WHERE c.quarantine IS NOT NULL ORDER BY c.id"
            ))
            .map_err(ctx("listing quarantined chunks"))?;
        let rows = stmt
            .query_map([], |r| Ok(QuarantinedChunk { meta: meta_from_row(r)?, reason: r.get(7)? }))
            .map_err(ctx("listing quarantined chunks"))?;
        rows.collect::<Result<_, _>>().map_err(ctx("listing quarantined chunks"))
    }
}

/// Why a chunk's bytes could not be assembled.
enum Damage {
    MissingSegment(i64),
    BadBytes(String),
}

/// One batch row of a chunk: what its bytes must check out as.
struct Part {
    batch: i64,
    records: u32,
    crc32c: u32,
}

/// Batch rows whose bytes lie back to back in one segment file, not read yet.
struct Run {
    segment: i64,
    offset: u64,
    len: u64,
    /// Each row with its length.
    parts: Vec<(Part, u64)>,
}

/// Longest run read with one `pread`.
const MAX_RUN: u64 = 8 << 20;

/// A chunk's payload, put together from its batch rows in id order. The rows of one commit
/// lie back to back in one segment, so a chunk is mostly one run of bytes: it is read with one
/// `pread` per run rather than one per row, and each row's bytes are then checked against its
/// CRC-32C, which also gives the payload's CRC (`crc::combine`) without a second pass.
struct Assembly {
    /// The bytes the chunk row says the payload has.
    want: u64,
    /// The bytes of the rows added so far, read or not.
    claimed: u64,
    out: Vec<u8>,
    records: u64,
    batches: u64,
    /// CRC-32C of `out`.
    crc: u32,
    run: Option<Run>,
}

impl Assembly {
    fn new(want: u64) -> Self {
        let capacity = usize::try_from(want).unwrap_or(0).min(64 << 20);
        Assembly { want, claimed: 0, out: Vec::with_capacity(capacity), records: 0, batches: 0, crc: 0, run: None }
    }

    /// Counts a row's length against the chunk's, before anything is read or allocated for it.
    fn claim(&mut self, part: &Part, len: u64) -> Result<(), Damage> {
        match self.claimed.checked_add(len) {
            Some(total) if total <= self.want => {
                self.claimed = total;
                Ok(())
            }
            _ => Err(Damage::BadBytes(format!(
                "batch {}: its {len} bytes take the chunk's rows past the {} bytes of its row",
                part.batch, self.want
            ))),
        }
    }

    fn add_in_segment(
        &mut self,
        part: Part,
        segment: i64,
        offset: u64,
        len: u64,
        files: &mut SegmentFiles,
    ) -> Result<(), Damage> {
        self.claim(&part, len)?;
        // `run.len + len` cannot overflow: both are within `want`, claimed above.
        if let Some(run) = &mut self.run
            && run.segment == segment
            && run.offset.checked_add(run.len) == Some(offset)
            && run.len + len <= MAX_RUN
        {
            run.len += len;
            run.parts.push((part, len));
            return Ok(());
        }
        self.flush(files)?;
        self.run = Some(Run { segment, offset, len, parts: vec![(part, len)] });
        Ok(())
    }

    fn add_inline(&mut self, part: Part, data: &[u8], files: &mut SegmentFiles) -> Result<(), Damage> {
        self.claim(&part, crate::len_u64(data))?;
        self.flush(files)?;
        let start = self.out.len();
        self.out.extend_from_slice(data);
        self.check(part, start, self.out.len(), None)
    }

    /// Reads the pending run and checks its rows.
    fn flush(&mut self, files: &mut SegmentFiles) -> Result<(), Damage> {
        let Some(run) = self.run.take() else { return Ok(()) };
        match files.read_into(run.segment, run.offset, run.len, &mut self.out) {
            Ok(()) => {}
            Err(None) => return Err(Damage::MissingSegment(run.segment)),
            Err(Some(detail)) => {
                let first = run.parts.first().map_or(0, |(p, _)| p.batch);
                return Err(Damage::BadBytes(format!("batch {first}: {detail}")));
            }
        }
        // `read_into` appended exactly `run.len` bytes, the sum of the parts' lengths.
        let mut start = self.out.len() - usize::try_from(run.len).unwrap_or(0);
        let mut offset = run.offset;
        for (part, len) in run.parts {
            let end = start + usize::try_from(len).unwrap_or(0);
            self.check(part, start, end, Some((run.segment, offset)))?;
            (start, offset) = (end, offset + len);
        }
        Ok(())
    }

    /// Checks the row whose bytes are `out[start..end]`, found at `place` (segment, offset),
    /// and counts it into the payload.
    fn check(&mut self, part: Part, start: usize, end: usize, place: Option<(i64, u64)>) -> Result<(), Damage> {
        let data = &self.out[start..end];
        let computed = crate::crc::crc32c(data);
        if computed != part.crc32c {
            return Err(Damage::BadBytes(format!(
                "batch {}: crc32c stored {:08x}, computed {computed:08x} over {} bytes{}",
                part.batch,
                part.crc32c,
                data.len(),
                place.map(|(s, o)| format!(" (segment {s} at {o})")).unwrap_or_default()
            )));
        }
        self.crc = crc::combine(self.crc, computed, crate::len_u64(data));
        self.records += u64::from(part.records);
        self.batches += 1;
        Ok(())
    }
}

/// A listed chunk, from its row as it is, before any check: the row checksum is checked when
/// the chunk is read. A value the field cannot hold (one flipped top bit makes a negative
/// number, or a record count past `u32`) is listed clamped into range, never an error: an
/// error would fail every listing that reaches the row, and the uploader, which quarantines
/// what a read finds corrupt, would never get past it. The read finds such a row corrupt (its
/// checksum, its range, and the clamped values differ from the row's), and the chunk is
/// quarantined.
fn meta_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ChunkMeta> {
    // Not an integer at all (damage to the row's record header): 0, found by the read too.
    let int = |i| r.get::<_, i64>(i).unwrap_or(0);
    let unsigned = |i| u64::try_from(int(i)).unwrap_or(0);
    let records = int(3);
    Ok(ChunkMeta {
        id: ChunkId(r.get(0)?),
        stream: r.get(1)?,
        seq: unsigned(2),
        records: u32::try_from(records).unwrap_or(if records < 0 { 0 } else { u32::MAX }),
        bytes: unsigned(4),
        first_ms: unsigned(5),
        sealed_ms: unsigned(6),
    })
}
