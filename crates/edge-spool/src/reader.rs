//! The read side: [`SpoolReader`] lists sealed chunks and reads their bytes, verifying every
//! batch's CRC-32C, over its own read-only connection (WAL readers never block the writer).

use std::path::Path;

use rusqlite::{Connection, OptionalExtension};

use crate::error::ctx;
use crate::rowcrc::{self, BatchRow, ChunkRow, SegRef};
use crate::schema;
use crate::segment::SegmentFiles;
use crate::{ChunkId, ChunkMeta, ChunkPayload, QuarantinedChunk, SpoolError};

/// A read-only connection to a spool file, made by [`Spool::reader`](crate::Spool::reader).
/// `Send`; give each thread its own.
#[derive(Debug)]
pub struct SpoolReader {
    conn: Connection,
    /// `meta.legacy_batches_through`: batch rows up to this id may have no row checksum.
    legacy_batches_through: i64,
    segments: SegmentFiles,
}

const META_COLUMNS: &str = "c.id, s.name, c.seq, c.records, c.bytes, c.first_ms, c.sealed_ms";

impl SpoolReader {
    pub(crate) fn open(path: &Path, legacy_batches_through: i64) -> Result<SpoolReader, SpoolError> {
        Ok(SpoolReader { conn: schema::open_reader(path)?, legacy_batches_through, segments: SegmentFiles::new(path) })
    }

    /// Up to `limit` sealed, not quarantined chunks with an id greater than `after` (all if
    /// `None`), ordered by id, which is sealing order.
    ///
    /// # Errors
    /// SQLite errors; a row with values our schema cannot hold gives a
    /// [`SpoolError::Sqlite`] conversion error.
    pub fn sealed_after(&mut self, after: Option<ChunkId>, limit: usize) -> Result<Vec<ChunkMeta>, SpoolError> {
        let after = after.map_or(i64::MIN, |c| c.0);
        let limit = i64::try_from(limit).unwrap_or(i64::MAX);
        let mut stmt = self
            .conn
            .prepare_cached(&format!(
                "SELECT {META_COLUMNS} FROM chunks c JOIN streams s ON s.id = c.stream_id
                 WHERE c.id > ?1 AND c.quarantine IS NULL ORDER BY c.id LIMIT ?2"
            ))
            .map_err(ctx("listing sealed chunks"))?;
        let rows = stmt.query_map((after, limit), meta_from_row).map_err(ctx("listing sealed chunks"))?;
        rows.collect::<Result<_, _>>().map_err(ctx("listing sealed chunks"))
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
        let listed = (meta.stream.as_str(), meta.seq, u64::from(meta.records), meta.bytes, meta.first_ms);
        let on_disk = (name.as_str(), c.seq as u64, c.records as u64, c.bytes as u64, c.first_ms as u64);
        if listed != on_disk {
            return Err(corrupt(format!("listed as {listed:?}, the verified rows say {on_disk:?}")));
        }
        let (want_records, want_bytes, stream_id, first_batch, last_batch) =
            (on_disk.2, on_disk.3, c.stream_id, c.first_batch, c.last_batch);
        let mut out = Vec::with_capacity(usize::try_from(want_bytes).unwrap_or(0).min(64 << 20));
        let mut records = 0u64;
        let mut crc = 0u32;
        let mut batches = 0u64;
        let mut missing_segment = None;
        // A batch whose bytes do not check out. Reported as damage only if the chunk still
        // exists once this snapshot is over: a chunk deleted meanwhile (dropped, acked as a
        // duplicate) may have had its segment recycled, its bytes overwritten.
        let mut bad_bytes = None;
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
                let start = out.len();
                match seg {
                    None => {
                        let data = r
                            .get_ref(8)
                            .map_err(ctx("reading a chunk's batches"))?
                            .as_blob()
                            .map_err(|e| corrupt(format!("batch {batch}: data is not a blob: {e}")))?;
                        out.extend_from_slice(data);
                    }
                    Some(s) => {
                        // Both are non-negative: `SegRef::from_columns` checked.
                        let (offset, len) = (s.offset as u64, s.len as u64);
                        match self.segments.read_into(s.segment, offset, len, &mut out) {
                            Ok(()) => {}
                            Err(None) => {
                                missing_segment = Some(s.segment);
                                break;
                            }
                            Err(Some(detail)) => {
                                bad_bytes = Some(format!("batch {batch}: {detail}"));
                                break;
                            }
                        }
                    }
                }
                let computed = crc32c::crc32c(&out[start..]);
                let data = &out[start..];
                if stored != computed {
                    bad_bytes = Some(format!(
                        "batch {batch}: crc32c stored {stored:08x}, computed {computed:08x} \
                         over {len} bytes{place}",
                        len = data.len(),
                        place = seg.map(|s| format!(" (segment {} at {})", s.segment, s.offset)).unwrap_or_default()
                    ));
                    break;
                }
                records += u64::from(n);
                batches += 1;
                // Continuing the running CRC over the same (cache-hot) bytes: the hardware CRC
                // costs far less than `crc32c_combine`, whose GF(2) matrix products took a tenth
                // of the agent's CPU in a live profile with 10 KiB batches.
                crc = crc32c::crc32c_append(crc, data);
            }
        }
        tx.finish().map_err(ctx("ending a read transaction"))?;
        let damage = match (missing_segment, bad_bytes) {
            (Some(segment), _) => Some(format!("payload segment file {segment} is missing")),
            (None, bad) => bad,
        };
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

fn meta_from_row(r: &rusqlite::Row<'_>) -> rusqlite::Result<ChunkMeta> {
    Ok(ChunkMeta {
        id: ChunkId(r.get(0)?),
        stream: r.get(1)?,
        seq: r.get(2)?,
        records: r.get(3)?,
        bytes: r.get(4)?,
        first_ms: r.get(5)?,
        sealed_ms: r.get(6)?,
    })
}
