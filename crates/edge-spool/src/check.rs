//! [`check`]: an offline (or read-only, next to a running agent) audit of a spool file, for
//! `edge-uploader spool check`.
//!
//! It runs SQLite's full `PRAGMA integrity_check` (b-tree structure, index consistency, page
//! accounting) and then reads every batch, sealed or open, quarantined or not, and compares it
//! with its stored CRC-32C, and every chunk row with the sizes of its batches. It never writes:
//! the connection is read-only, so it can run while the agent appends (WAL readers see one
//! consistent snapshot and never block the writer).
//!
//! After a power cut the last commits' batches may point at bytes that were lost before their
//! sync (see `unsynced.rs`): they are reported as a [`LostTail`], what the agent drops at its
//! next open, and neither they nor the chunks sealed over them count as damage. The commits
//! whose bytes were synced and whose index rows the WAL lost are in their commit records
//! (`journal.rs`): they are reported as [`Replayable`], what the agent adds back at its next
//! open (next to a running agent, a commit in progress can show there too).
//!
//! Salvage: each batch has its own checksum, so the good batches of a damaged chunk are known
//! intact and are reported (`salvageable_records` / `salvageable_bytes`). Re-sealing them into
//! a new chunk is not done: a chunk's sequence number and contents never change once sealed,
//! and the records lost in the bad batches would make any re-sealed chunk a partial one.
//! Once quarantined, a chunk's good batches can be exported as records (`salvage.rs`), for an
//! operator to push again as new ones.

use std::path::Path;

use rusqlite::{Connection, OpenFlags};

use crate::error::ctx;
use crate::rowcrc::{self, BatchRow, ChunkRow, SegRef};
use crate::segment::SegmentFiles;
use crate::{SpoolError, schema};

/// Damage found in one sealed chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedChunk {
    /// Chunk id (`chunks.id`).
    pub id: i64,
    /// Stream name (`?` if the stream row is missing).
    pub stream: String,
    /// Sequence number.
    pub seq: i64,
    /// Records and payload bytes the chunk row claims.
    pub records: i64,
    /// Payload bytes the chunk row claims.
    pub bytes: i64,
    /// Already quarantined (by the agent); the reason it gave.
    pub quarantined: Option<String>,
    /// Batches whose checksum failed (or could not be read).
    pub bad_batches: u64,
    /// Records in batches whose checksum passed: what a salvage could keep.
    pub salvageable_records: u64,
    /// Bytes of those batches.
    pub salvageable_bytes: u64,
    /// What did not match, first problem first.
    pub detail: String,
}

/// The last commits' batches whose payload bytes a power cut lost before their sync (see
/// [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync)): no producer was told they were
/// stored and none was sent. The agent drops them, with every later batch and the chunks
/// sealed over them, when it next opens the spool. Not damage.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostTail {
    /// The first batch whose bytes were lost.
    pub first_batch: i64,
    /// Batches from it on.
    pub batches: u64,
    /// Records in them.
    pub records: u64,
}

/// The last commits whose index rows a power cut lost before the WAL's sync, while their
/// payload bytes and commit records were synced: the agent adds them back, with the same ids
/// and sequence numbers, when it next opens the spool. Not damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replayable {
    /// Commits.
    pub commits: u64,
    /// Records in them.
    pub records: u64,
    /// Chunks they sealed.
    pub chunks: u64,
}

/// Damage found in one open (not yet sealed) batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedBatch {
    /// Batch id.
    pub id: i64,
    /// Stream name.
    pub stream: String,
    /// Records the row claims.
    pub records: i64,
    /// Bytes of its data.
    pub bytes: u64,
    /// What did not match.
    pub detail: String,
}

/// What [`check`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// `integrity_check` problems (empty: "ok"). At most 100 lines.
    pub integrity: Vec<String>,
    /// Chunks examined (quarantined ones included).
    pub chunks: u64,
    /// Batches examined (sealed and open).
    pub batches: u64,
    /// Payload bytes examined.
    pub bytes: u64,
    /// Chunks with damage, not yet quarantined: these would be found and quarantined by the
    /// agent when it reads them.
    pub damaged_chunks: Vec<DamagedChunk>,
    /// Quarantined chunks whose bytes are damaged (known damage, already out of circulation).
    pub quarantined_damaged: Vec<DamagedChunk>,
    /// Quarantined chunks whose bytes check out (e.g. rejected by the server for their size).
    pub quarantined_intact: u64,
    /// Open batches with damage.
    pub damaged_open_batches: Vec<DamagedBatch>,
    /// Stream rows and `meta` values that fail their row checksums (schema version 3): damage
    /// the agent refuses to run on (it moves the file aside at open). Also a synced-segments
    /// mark that fails its checksum and `meta` rows with a key the spool never writes, which
    /// open removes (`unsynced.rs`).
    pub damaged_rows: Vec<String>,
    /// A read error that stopped the walk over the rows (SQLite-level damage), if any.
    pub read_error: Option<String>,
    /// Batches of the last commits that a power cut took the bytes of, if any: not counted
    /// as damage, nor are the chunks sealed over them.
    pub lost_tail: Option<LostTail>,
    /// Commits the segments' commit records hold beyond the index, if any.
    pub replayable: Option<Replayable>,
}

impl CheckReport {
    /// True when there is damage that is not yet quarantined: SQLite-level problems, damaged
    /// live chunks or open batches, or rows that could not be read.
    pub fn has_damage(&self) -> bool {
        !self.integrity.is_empty()
            || !self.damaged_chunks.is_empty()
            || !self.damaged_open_batches.is_empty()
            || !self.damaged_rows.is_empty()
            || self.read_error.is_some()
    }

    /// Records in damaged live chunks and open batches (what is lost unless salvaged). The
    /// counts are the rows' own, which may be damaged too: a negative one counts 0, and the
    /// sum saturates.
    pub fn damaged_records(&self) -> u64 {
        let records =
            self.damaged_chunks.iter().map(|c| c.records).chain(self.damaged_open_batches.iter().map(|b| b.records));
        records.fold(0, |sum, n| sum.saturating_add(u64::try_from(n).unwrap_or(0)))
    }
}

/// Audits the spool file at `path` read-only. See the module docs.
///
/// # Errors
/// [`SpoolError::Io`] if the file does not exist; [`SpoolError::Sqlite`] if SQLite cannot open
/// it at all. A file that is not a database is *reported* (in `integrity`), not an error.
pub fn check(path: &Path) -> Result<CheckReport, SpoolError> {
    let conn = open_read_only(path)?;
    let mut report = CheckReport::default();
    match integrity(&conn) {
        Ok(lines) => report.integrity = lines,
        Err(e) => {
            report.integrity = vec![error_text(&e)];
            return Ok(report);
        }
    }
    // An empty or truncated-to-nothing file passes integrity_check as an empty database.
    // Files of older versions (not yet migrated by an agent of this version) are audited as
    // they are, without row checksums: the check never writes, so it cannot migrate them.
    let version = match schema::inspect(&conn) {
        Ok((version @ (1..=schema::SCHEMA_VERSION), _)) => version,
        Ok((version, objects)) => {
            report.integrity.push(format!("not an edge spool: user_version {version}, {objects} schema objects"));
            return Ok(report);
        }
        Err(e) => {
            report.integrity.push(error_text(&e));
            return Ok(report);
        }
    };
    if version >= 4 {
        match lost_tail(&conn, path) {
            Ok(tail) => report.lost_tail = tail,
            Err(e) => report.read_error = Some(error_text(&e)),
        }
    }
    if let Err(e) = walk(&conn, path, version, &mut report) {
        report.read_error = Some(error_text(&e));
    }
    // Replay needs the stream rows it builds on: damaged ones are reported above.
    if version >= 4 && report.damaged_rows.is_empty() && report.read_error.is_none() {
        match crate::state::State::load(&conn).and_then(|state| crate::journal::plan(&state, path)) {
            Ok(plan) if plan.counts.commits > 0 => {
                let c = plan.counts;
                report.replayable = Some(Replayable { commits: c.commits, records: c.records, chunks: c.chunks });
            }
            Ok(_) => {}
            Err(e) => report.read_error = Some(error_text(&e)),
        }
    }
    Ok(report)
}

/// The spool file at `path`, opened read-only (never created): for readers beside the agent,
/// which read WAL snapshots and never block its writer.
pub(crate) fn open_read_only(path: &Path) -> Result<Connection, SpoolError> {
    std::fs::metadata(path).map_err(|source| SpoolError::Io { path: path.to_owned(), source })?;
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(ctx("opening the database read-only"))?;
    conn.busy_timeout(schema::BUSY_TIMEOUT).map_err(ctx("setting busy_timeout"))?;
    Ok(conn)
}

pub(crate) fn error_text(e: &SpoolError) -> String {
    let mut out = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}

/// The batches open would drop as a lost tail (`unsynced.rs`).
fn lost_tail(conn: &Connection, path: &Path) -> Result<Option<LostTail>, SpoolError> {
    let Some(first_batch) = crate::unsynced::scan(conn, path)?.and_then(|s| s.first_lost) else {
        return Ok(None);
    };
    let (batches, records) = crate::unsynced::count_from(conn, first_batch)?;
    Ok(Some(LostTail { first_batch, batches, records }))
}

/// `PRAGMA integrity_check(100)`: empty when "ok".
fn integrity(conn: &Connection) -> Result<Vec<String>, SpoolError> {
    let mut lines = Vec::new();
    conn.pragma_query(None, "integrity_check", |r| {
        lines.push(r.get::<_, String>(0)?);
        Ok(())
    })
    .map_err(ctx("running integrity_check"))?;
    if lines.len() == 1 && lines[0] == "ok" {
        lines.clear();
    }
    lines.truncate(100);
    Ok(lines)
}

/// One batch row's verdict.
pub(crate) struct BatchCheck {
    pub(crate) records: i64,
    pub(crate) len: u64,
    pub(crate) problem: Option<String>,
}

/// Checks a batch row: its data (in the row, or from version 4 in a segment file) against
/// `crc32c`, and from version 3 its other columns against `row_crc` (batches up to
/// `legacy_through` may have none: written before version 3). A batch that checks out is
/// handed to `good` (its data, as stored) before the verdict is returned.
pub(crate) fn check_batch(
    r: &rusqlite::Row<'_>,
    rows: Option<RowChecks>,
    files: &mut Files,
    good: &mut dyn FnMut(&[u8]),
) -> rusqlite::Result<BatchCheck> {
    let id: i64 = r.get("id")?;
    let records: i64 = r.get("records")?;
    let stored: i64 = r.get("crc32c")?;
    let seg = match rows {
        Some(RowChecks { segments: true, .. }) => {
            match SegRef::from_columns((r.get("segment")?, r.get("seg_offset")?, r.get("seg_len")?)) {
                Ok(seg) => seg,
                Err(e) => return Ok(BatchCheck { records, len: 0, problem: Some(format!("batch {id}: {e}")) }),
            }
        }
        _ => None,
    };
    let (data, place) = match seg {
        None => {
            let data = r.get_ref("data")?;
            let Ok(data) = data.as_blob() else {
                return Ok(BatchCheck { records, len: 0, problem: Some(format!("batch {id}: data is not a blob")) });
            };
            (data, String::new())
        }
        Some(s) => {
            files.buf.clear();
            let len = s.len as u64;
            match files.segments.read_into(s.segment, s.offset as u64, len, &mut files.buf) {
                Ok(()) => {}
                Err(detail) => {
                    let detail = detail.unwrap_or_else(|| format!("payload segment file {} is missing", s.segment));
                    return Ok(BatchCheck { records, len, problem: Some(format!("batch {id}: {detail}")) });
                }
            }
            (files.buf.as_slice(), format!(" (segment {} at {})", s.segment, s.offset))
        }
    };
    let computed = crate::crc::crc32c(data);
    let len = crate::len_u64(data);
    let mut problem = (stored != i64::from(computed))
        .then(|| format!("batch {id}: crc32c stored {stored:08x}, computed {computed:08x} over {len} bytes{place}"));
    if let Some(RowChecks { legacy_through, .. }) = rows
        && problem.is_none()
    {
        let row_crc: Option<i64> = r.get("row_crc")?;
        let row = BatchRow {
            id,
            stream_id: r.get("stream_id")?,
            records,
            crc32c: stored,
            commit_ms: r.get("commit_ms")?,
            seg,
        };
        if !row.ok(row_crc, legacy_through) {
            problem = Some(format!("batch {id}: row fails its checksum (stored {row_crc:?})"));
        }
    }
    if problem.is_none() {
        good(data);
    }
    Ok(BatchCheck { records, len, problem })
}

/// Version 3's row checksums are checked; from version 4, batches may be in segment files.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RowChecks {
    pub(crate) legacy_through: i64,
    pub(crate) segments: bool,
}

/// The segment files of the checked spool, and a buffer for one batch.
pub(crate) struct Files {
    pub(crate) segments: SegmentFiles,
    pub(crate) buf: Vec<u8>,
}

/// Membership by schema version: a chunk's batches, and the open batches.
pub(crate) struct Membership {
    pub(crate) chunk_columns: &'static str,
    pub(crate) chunk_batches: &'static str,
    pub(crate) open_filter: &'static str,
}

const V1_MEMBERSHIP: Membership = Membership {
    chunk_columns: "c.id, c.id, c.id",
    chunk_batches: "SELECT id, data, records, crc32c FROM batches WHERE chunk_id = ?1 ORDER BY id",
    open_filter: "b.chunk_id IS NULL",
};

const V2_MEMBERSHIP: Membership = Membership {
    chunk_columns: "c.stream_id, c.first_batch, c.last_batch",
    chunk_batches: "SELECT id, data, records, crc32c FROM batches
                    WHERE stream_id = ?1 AND id BETWEEN ?2 AND ?3 ORDER BY id",
    open_filter: "s.id IS NULL OR b.id > s.sealed_through",
};

const V3_MEMBERSHIP: Membership = Membership {
    chunk_columns: "c.stream_id, c.first_batch, c.last_batch",
    chunk_batches: "SELECT id, stream_id, data, records, crc32c, commit_ms, row_crc FROM batches
                    WHERE stream_id = ?1 AND id BETWEEN ?2 AND ?3 ORDER BY id",
    open_filter: "s.id IS NULL OR b.id > s.sealed_through",
};

const V4_MEMBERSHIP: Membership = Membership {
    chunk_columns: "c.stream_id, c.first_batch, c.last_batch",
    chunk_batches: "SELECT id, stream_id, data, records, crc32c, commit_ms, row_crc, segment, seg_offset, seg_len
                    FROM batches WHERE stream_id = ?1 AND id BETWEEN ?2 AND ?3 ORDER BY id",
    open_filter: "s.id IS NULL OR b.id > s.sealed_through",
};

/// Version 3: the `meta` values and every stream row against their checksums. Returns the
/// legacy mark when the meta values check out (else every batch row must have a checksum).
fn check_fixed_rows(conn: &Connection, report: &mut CheckReport) -> Result<i64, SpoolError> {
    let legacy = match schema::read_verified_meta(conn) {
        Ok(meta) => meta.legacy_batches_through,
        Err(e) => {
            report.damaged_rows.push(error_text(&e));
            0
        }
    };
    // The synced-segments mark has a checksum of its own, and no other key is ever written.
    report.damaged_rows.extend(crate::unsynced::read_mark(conn)?.damage);
    // So has the host id (the next open names this machine again).
    if let crate::host::Stored::Damaged(why) = crate::host::read(conn)? {
        report.damaged_rows.push(why);
    }
    let mut stmt = conn
        .prepare("SELECT id, name, next_seq, sealed_through, row_crc FROM streams ORDER BY id")
        .map_err(ctx("reading streams"))?;
    let mut rows = stmt.query([]).map_err(ctx("reading streams"))?;
    while let Some(r) = rows.next().map_err(ctx("reading streams"))? {
        let get = |e| ctx("reading streams")(e);
        let (id, name, next_seq, sealed_through, stored): (i64, String, i64, i64, Option<i64>) = (
            r.get(0).map_err(get)?,
            r.get(1).map_err(get)?,
            r.get(2).map_err(get)?,
            r.get(3).map_err(get)?,
            r.get(4).map_err(get)?,
        );
        let computed = rowcrc::stream(id, &name, next_seq, sealed_through);
        if stored != Some(computed) {
            report.damaged_rows.push(format!(
                "stream row {id} ({name:?}, next_seq {next_seq}, sealed_through {sealed_through}) fails its checksum \
                 (stored {stored:?}, computed {computed})"
            ));
        }
    }
    Ok(legacy)
}

/// How a file of schema `version` ties batches to chunks.
pub(crate) fn membership(version: i64) -> &'static Membership {
    match version {
        1 => &V1_MEMBERSHIP,
        2 => &V2_MEMBERSHIP,
        3 => &V3_MEMBERSHIP,
        _ => &V4_MEMBERSHIP,
    }
}

fn walk(conn: &Connection, path: &Path, version: i64, report: &mut CheckReport) -> Result<(), SpoolError> {
    let m = membership(version);
    let rows_checked = if version >= 3 {
        Some(RowChecks { legacy_through: check_fixed_rows(conn, report)?, segments: version >= 4 })
    } else {
        None
    };
    let mut files = Files { segments: SegmentFiles::new(path), buf: Vec::new() };
    // Batches from here on belong to the lost tail: open drops them, and the chunks over them.
    let tail = report.lost_tail.as_ref().map_or(i64::MAX, |t| t.first_batch);
    let chunk_crc_columns = if version >= 3 {
        ", c.id, c.stream_id, c.seq, c.records, c.bytes, c.first_ms, c.sealed_ms, c.first_batch, c.last_batch, c.row_crc"
    } else {
        ""
    };
    let mut chunks = conn
        .prepare(&format!(
            "SELECT c.id, coalesce(s.name, '?'), c.seq, c.records, c.bytes, c.quarantine, {}{chunk_crc_columns}
             FROM chunks c LEFT JOIN streams s ON s.id = c.stream_id ORDER BY c.id",
            m.chunk_columns
        ))
        .map_err(ctx("listing chunks"))?;
    let mut batches = conn.prepare(m.chunk_batches).map_err(ctx("reading batches"))?;
    let mut rows = chunks.query([]).map_err(ctx("listing chunks"))?;
    while let Some(r) = rows.next().map_err(ctx("listing chunks"))? {
        let get = |e| ctx("listing chunks")(e);
        let mut c = DamagedChunk {
            id: r.get(0).map_err(get)?,
            stream: r.get(1).map_err(get)?,
            seq: r.get(2).map_err(get)?,
            records: r.get(3).map_err(get)?,
            bytes: r.get(4).map_err(get)?,
            quarantined: r.get(5).map_err(get)?,
            bad_batches: 0,
            salvageable_records: 0,
            salvageable_bytes: 0,
            detail: String::new(),
        };
        report.chunks += 1;
        let mut problems = Vec::new();
        if rows_checked.is_some() {
            let row = ChunkRow::from_row(r, 9).map_err(get)?;
            let stored: Option<i64> = r.get(18).map_err(get)?;
            if stored != Some(row.crc()) {
                problems.push(format!("chunk row fails its checksum (stored {stored:?}, computed {})", row.crc()));
            }
        }
        let (mut records, mut bytes, mut n) = (0i64, 0u64, 0u64);
        let range: (i64, i64, i64) = (r.get(6).map_err(get)?, r.get(7).map_err(get)?, r.get(8).map_err(get)?);
        let mut b =
            if version == 1 { batches.query([c.id]) } else { batches.query(range) }.map_err(ctx("reading batches"))?;
        loop {
            let row = match b.next() {
                Ok(Some(row)) => row,
                Ok(None) => break,
                Err(e) => {
                    problems.push(format!("batches unreadable: {e}"));
                    c.bad_batches += 1;
                    break;
                }
            };
            match check_batch(row, rows_checked, &mut files, &mut |_| {}) {
                Ok(v) => {
                    // Saturating: a damaged row may claim any length (it is checked last).
                    n += 1;
                    records = records.saturating_add(v.records);
                    bytes = bytes.saturating_add(v.len);
                    report.bytes = report.bytes.saturating_add(v.len);
                    match v.problem {
                        Some(p) => {
                            c.bad_batches += 1;
                            problems.push(p);
                        }
                        None => {
                            c.salvageable_records =
                                c.salvageable_records.saturating_add(u64::try_from(v.records).unwrap_or(0));
                            c.salvageable_bytes = c.salvageable_bytes.saturating_add(v.len);
                        }
                    }
                }
                Err(e) => {
                    c.bad_batches += 1;
                    problems.push(format!("a batch row is unreadable: {e}"));
                }
            }
        }
        report.batches += n;
        if n == 0 && problems.is_empty() {
            problems.push("chunk has no batches".into());
        } else if problems.is_empty() && (records != c.records || i64::try_from(bytes).ok() != Some(c.bytes)) {
            problems.push(format!(
                "chunk row says {} bytes / {} records, batches hold {bytes} bytes / {records} records",
                c.bytes, c.records
            ));
        }
        match (problems.is_empty(), c.quarantined.is_some()) {
            (false, false) if range.2 >= tail => {}
            (true, false) => {}
            (true, true) => report.quarantined_intact += 1,
            (false, quarantined) => {
                c.detail = problems.join("; ");
                if quarantined { report.quarantined_damaged.push(c) } else { report.damaged_chunks.push(c) }
            }
        }
    }
    let mut open = conn
        .prepare(&format!(
            "SELECT b.id, coalesce(s.name, '?') AS stream, b.data, b.records, b.crc32c{}
             FROM batches b LEFT JOIN streams s ON s.id = b.stream_id
             WHERE {} ORDER BY b.id",
            match rows_checked {
                Some(RowChecks { segments: true, .. }) => {
                    ", b.stream_id, b.commit_ms, b.row_crc, b.segment, b.seg_offset, b.seg_len"
                }
                Some(_) => ", b.stream_id, b.commit_ms, b.row_crc",
                None => "",
            },
            m.open_filter
        ))
        .map_err(ctx("reading open batches"))?;
    let mut rows = open.query([]).map_err(ctx("reading open batches"))?;
    while let Some(r) = rows.next().map_err(ctx("reading open batches"))? {
        let v = check_batch(r, rows_checked, &mut files, &mut |_| {}).map_err(ctx("reading open batches"))?;
        report.batches += 1;
        report.bytes = report.bytes.saturating_add(v.len);
        let id: i64 = r.get(0).map_err(ctx("reading open batches"))?;
        if let Some(detail) = v.problem
            && id < tail
        {
            report.damaged_open_batches.push(DamagedBatch {
                id,
                stream: r.get(1).map_err(ctx("reading open batches"))?,
                records: v.records,
                bytes: v.len,
                detail,
            });
        }
    }
    Ok(())
}
