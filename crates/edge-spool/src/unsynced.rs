//! Open: the rows of commits whose payload bytes a power cut lost.
//!
//! With deferred syncs (see `walsync.rs`) a commit's rows can be durable before its segment
//! bytes: the WAL's sync makes every commit in the file durable, also those whose bytes were
//! written after the segments' sync began, and the kernel may write the WAL back on its own.
//! No producer was answered for such a commit, and no chunk holding its batches was ever
//! visible to a reader, so it was never sent (both wait for a sync that covers the bytes).
//!
//! Commits record in `meta` (`segments_synced_through`) the newest batch id whose bytes a
//! completed sync covered when they were built (the first commit after each sync moves it),
//! and a clean shutdown moves it to the newest batch
//! ([`Spool::mark_synced`](crate::Spool::mark_synced)). At open, every batch above it is read
//! and checked against its CRC-32C. From the first one that fails (its segment missing, too
//! short, or its bytes different), that batch and every later one are deleted, and so are the
//! chunks sealed over them: their earlier batches become open again, and each stream's next
//! sequence number goes back to the first deleted chunk's (never sent, so the server never saw
//! it). A later batch that passes goes too: its commit came after the lost one, so it was not
//! answered either. The batches that pass are written again in place and synced (after a crash
//! without a power cut their bytes may still be only in the page cache; after a sync that failed
//! they may be there marked clean, which a sync alone would not write), and the mark is
//! removed: everything in the file
//! is then durable, and [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync) writes a new
//! one.
//!
//! The mark is kept close behind the syncs because above it a batch whose bytes fail is taken
//! for a lost write, where below it the same failure is damage and its chunk is quarantined
//! when read: after a crash the batches above the mark are those of the last sync or two,
//! which a power cut could lose, and after a clean shutdown there are none.
//!
//! The mark's value is a 12-byte blob, the batch id and a CRC-32C over the key and the id
//! (earlier builds wrote a plain integer, still read as it is, unchecked). A value that fails its
//! checksum, or a `meta` row whose key is none the spool writes (one flipped bit in the
//! mark's key is enough), is damage: `spool check` reports it, and open checks nothing from
//! such a mark (below the real mark, a batch that fails is damage, not a lost write, and
//! dropping from there could drop answered records), removes the damaged rows and logs it. A
//! write a power cut lost is then found when its chunk is read, and quarantined.
//!
//! A batch row that fails its own row checksum is left alone: that is damage to the file, not
//! a lost write, and reading its chunk quarantines it as before. So is a batch whose segment
//! cannot be read (an I/O error: a failing disk, not a lost write).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use crate::SpoolError;
use crate::error::ctx;
use crate::rowcrc::{self, BatchRow, ChunkRow, SegRef};
use crate::schema::{META_KEYS, META_SEGMENTS_SYNCED};
use crate::segment;

/// What open dropped because its bytes were lost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Dropped {
    /// Batch rows deleted (one per stream per commit).
    pub batches: u64,
    /// Records in them (never acknowledged to a producer).
    pub records: u64,
    /// Chunks deleted (never sent); their earlier batches are open again.
    pub chunks: u64,
}

/// Reads at most this much of a batch at a time.
const READ_PIECE: usize = 1 << 20;

/// What the check of the batches above the mark found.
#[derive(Debug, Default)]
pub(crate) struct Scan {
    /// The first batch above the mark whose bytes were lost: it and every later batch go.
    pub first_lost: Option<i64>,
    /// The segments of the batches above the mark that passed.
    pub intact_segments: BTreeSet<i64>,
}

/// The synced-segments mark's value for batch id `mark`: the id and its checksum.
pub(crate) fn mark_value(mark: i64) -> Vec<u8> {
    let mut v = Vec::with_capacity(12);
    v.extend_from_slice(&mark.to_le_bytes());
    v.extend_from_slice(&rowcrc::synced_mark(META_SEGMENTS_SYNCED, mark).to_le_bytes());
    v
}

/// What the `meta` rows say of the synced-segments mark.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct MarkRead {
    /// The mark, when present and intact.
    pub mark: Option<i64>,
    /// A mark value that fails its checksum, and rows whose key the spool never writes.
    pub damage: Vec<String>,
}

/// Reads the mark and looks for `meta` rows with keys the spool never writes.
pub(crate) fn read_mark(conn: &Connection) -> Result<MarkRead, SpoolError> {
    use rusqlite::types::Value;
    let mut read = MarkRead::default();
    let value: Option<Value> = conn
        .query_row("SELECT value FROM meta WHERE key = ?1", [META_SEGMENTS_SYNCED], |r| r.get(0))
        .optional()
        .map_err(ctx("reading the synced-segments mark"))?;
    match value {
        None => {}
        // Written by an agent before the mark had a checksum.
        Some(Value::Integer(m)) => read.mark = Some(m),
        Some(Value::Blob(b)) if b.len() == 12 => {
            let (id, crc) = b.split_at(8);
            let id = i64::from_le_bytes(id.try_into().unwrap_or_default());
            let crc = u32::from_le_bytes(crc.try_into().unwrap_or_default());
            if crc == rowcrc::synced_mark(META_SEGMENTS_SYNCED, id) {
                read.mark = Some(id);
            } else {
                read.damage.push(format!("the synced-segments mark (batch {id}) fails its checksum"));
            }
        }
        Some(other) => read.damage.push(format!("the synced-segments mark holds {other:?}, not a checked batch id")),
    }
    let mut stmt = conn.prepare("SELECT key FROM meta").map_err(ctx("listing the meta keys"))?;
    let keys = stmt.query_map([], |r| r.get::<_, Value>(0)).map_err(ctx("listing the meta keys"))?;
    for key in keys {
        let key = key.map_err(ctx("listing the meta keys"))?;
        if !matches!(&key, Value::Text(k) if META_KEYS.contains(&k.as_str())) {
            read.damage.push(format!("a meta row has the key {key:?}, which the spool never writes (a damaged key)"));
        }
    }
    Ok(read)
}

/// Checks the batches above the mark against their CRC-32C, up to the first that fails;
/// `None` when the file has no intact mark. Reads only (`spool check` runs it too).
pub(crate) fn scan(conn: &Connection, db: &Path) -> Result<Option<Scan>, SpoolError> {
    let Some(mark) = read_mark(conn)?.mark else { return Ok(None) };
    scan_from(conn, db, mark, false).map(Some)
}

/// With `rewrite`, the bytes of each batch read are written back where they are, so that the
/// sync that follows writes them: after a write-back that failed in the process before (its
/// sync failed, and it exited), they may be in the page cache, marked clean, and not on disk,
/// where a sync would write nothing. `spool check` reads only.
fn scan_from(conn: &Connection, db: &Path, mark: i64, rewrite: bool) -> Result<Scan, SpoolError> {
    let mut found = Scan::default();
    let mut files: BTreeMap<i64, Segment> = BTreeMap::new();
    let mut stmt = conn
        .prepare(
            "SELECT id, stream_id, records, crc32c, commit_ms, row_crc, segment, seg_offset, seg_len
             FROM batches WHERE id > ?1 AND segment IS NOT NULL ORDER BY id",
        )
        .map_err(ctx("listing the batches above the synced-segments mark"))?;
    let mut rows = stmt.query([mark]).map_err(ctx("listing the batches above the synced-segments mark"))?;
    let mut buf = Vec::new();
    while let Some(r) = rows.next().map_err(ctx("listing the batches above the synced-segments mark"))? {
        let cols = (r.get(6), r.get(7), r.get(8));
        let read = |i| r.get::<_, i64>(i);
        let (Ok(id), Ok(stream_id), Ok(records), Ok(crc32c), Ok(commit_ms), Ok(stored), (Ok(s), Ok(o), Ok(l))) =
            (read(0), read(1), read(2), read(3), read(4), r.get::<_, Option<i64>>(5), cols)
        else {
            // Values of the wrong type: damage, for the reader and `spool check` to report.
            continue;
        };
        let Ok(Some(seg)) = SegRef::from_columns((Some(s), Some(o), Some(l))) else { continue };
        let row = BatchRow { id, stream_id, records, crc32c, commit_ms, seg: Some(seg) };
        if stored != Some(row.crc()) {
            continue;
        }
        let file = files.entry(seg.segment).or_insert_with(|| {
            let p = segment::path(db, seg.segment);
            let writable = if rewrite { OpenOptions::new().read(true).write(true).open(&p).ok() } else { None };
            match writable.map_or_else(|| File::open(&p), Ok) {
                Ok(f) => Segment::Open(f),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Segment::Missing,
                Err(e) => {
                    unreadable(&p, &e);
                    Segment::Unreadable
                }
            }
        });
        let intact = match file {
            Segment::Open(f) => match crc_of(f, seg, &mut buf, rewrite) {
                Ok(crc) => crc.map(i64::from) == Some(crc32c),
                Err(e) => {
                    unreadable(&segment::path(db, seg.segment), &e);
                    continue;
                }
            },
            Segment::Missing => false,
            Segment::Unreadable => continue,
        };
        if !intact {
            found.first_lost = Some(id);
            break;
        }
        found.intact_segments.insert(seg.segment);
    }
    Ok(found)
}

/// A segment file as [`scan_from`] found it.
enum Segment {
    Open(File),
    /// Not there: its batches' bytes were lost.
    Missing,
    /// There, but it cannot be opened: see [`unreadable`].
    Unreadable,
}

/// A segment that cannot be opened or read (a failing disk): its batches are left alone, as a
/// row that fails its checksum is. A read error says nothing of whether the bytes were written:
/// taking the batch for a lost write would drop it and every later batch, answered ones among
/// them (a failing sector under synced bytes). Its chunk reads as corrupt and is quarantined,
/// as it would be at run time; failing the open instead would fail every open.
fn unreadable(p: &Path, e: &io::Error) {
    tracing::error!(
        segment = %p.display(),
        error = %e,
        "a payload segment cannot be read; its batches are left in place, their chunks quarantined when read"
    );
}

/// Checks the batches above the mark, drops the lost tail and removes the mark (see the
/// module's text), with any damaged `meta` row. Does nothing when the file has neither.
pub(crate) fn drop_lost_tail(conn: &mut Connection, db: &Path) -> Result<Dropped, SpoolError> {
    let read = read_mark(conn)?;
    if !read.damage.is_empty() && read.mark.is_some() {
        tracing::warn!(damage = %read.damage.join("; "), "damaged meta rows in the spool; removed");
    } else if !read.damage.is_empty() {
        tracing::warn!(
            damage = %read.damage.join("; "),
            "damaged meta rows in the spool, removed; without an intact synced-segments mark the last \
             commits' bytes are not checked at open: a write a power cut lost is found when its chunk is read"
        );
    }
    let (first_lost, synced) = match read.mark {
        Some(mark) => {
            let found = scan_from(conn, db, mark, true)?;
            (found.first_lost, found.intact_segments)
        }
        None if read.damage.is_empty() => return Ok(Dropped::default()),
        None => (None, BTreeSet::new()),
    };
    // The bytes that passed are on disk or in the page cache: make them durable before the
    // mark that says so goes.
    for id in &synced {
        let p = segment::path(db, *id);
        File::open(&p).and_then(|f| f.sync_data()).map_err(|e| segment::io_error(&p, e))?;
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(ctx("beginning the lost-tail transaction"))?;
    let mut dropped = Dropped::default();
    if let Some(b) = first_lost {
        dropped = drop_from(&tx, b)?;
    }
    // The mark, and any row whose key the spool never writes (`read_mark`).
    let known = (2..=META_KEYS.len() + 1).map(|i| format!("?{i}")).collect::<Vec<_>>().join(", ");
    tx.execute(
        &format!("DELETE FROM meta WHERE key = ?1 OR key IS NULL OR key NOT IN ({known})"),
        rusqlite::params_from_iter(std::iter::once(META_SEGMENTS_SYNCED).chain(META_KEYS)),
    )
    .map_err(ctx("removing the synced-segments mark"))?;
    tx.commit().map_err(ctx("committing the lost-tail transaction"))?;
    if let Some(b) = first_lost {
        tracing::warn!(
            first_batch = b,
            batches = dropped.batches,
            records = dropped.records,
            chunks_unsealed = dropped.chunks,
            "payload bytes of the last commits were lost (a power cut before their sync); dropped them: \
             no producer was answered for these records and none of them was sent"
        );
    }
    Ok(dropped)
}

/// The CRC-32C of a batch's bytes, or `None` when the file ends before them. With `rewrite`,
/// each piece read is written back in place (see [`scan_from`]); a failed write is logged and
/// leaves the sync as the only guarantee, as before.
fn crc_of(f: &File, seg: SegRef, buf: &mut Vec<u8>, rewrite: bool) -> io::Result<Option<u32>> {
    let (Ok(mut at), Ok(mut left)) = (u64::try_from(seg.offset), u64::try_from(seg.len)) else {
        return Ok(None);
    };
    let mut crc = 0;
    while left > 0 {
        let n = usize::try_from(left).unwrap_or(usize::MAX).min(READ_PIECE);
        buf.resize(n, 0);
        match f.read_exact_at(&mut buf[..n], at) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e),
        }
        crc = crate::crc::crc32c_append(crc, &buf[..n]);
        if rewrite && let Err(e) = f.write_all_at(&buf[..n], at) {
            tracing::warn!(error = %e, "could not write a batch's bytes again at open; only a sync makes them durable");
        }
        at += n as u64;
        left -= n as u64;
    }
    Ok(Some(crc))
}

/// Deletes batch `b` and every later batch, and the chunks sealed over any of them; moves each
/// such stream's `next_seq` and `sealed_through` back to before its first deleted chunk.
///
/// The deleted chunks of a stream are its newest ones (sealed after the lost batch was
/// committed, or over it): none was listed or sent, so the server holds no sequence number from
/// the first of them on, and the stream takes it again (no gap). Only rows that pass their
/// checksum say where that is. A damaged row's `seq` may be anything: a negative one fails the
/// open (the CHECK on `next_seq`; without it, written under a good checksum, every later open),
/// and a smaller one reuses sequence numbers the server holds (new data answered `Duplicate`
/// and deleted). So a row that
/// fails is deleted with the others but not used: if it was the stream's first deleted chunk,
/// the stream goes back only to its first intact one, or not at all (`next_seq` stays past
/// every number the stream sealed), and skips the numbers in between. Those were never sent:
/// the gap is one more range in the server's dedup index, as a quarantined chunk leaves one,
/// while a reused number loses data. The batches of such a chunk below `b` stay in no chunk and
/// are never sent; its damaged row would have had them quarantined anyway. Nothing goes forward
/// (`next_seq`, `sealed_through`), and a stream row that fails its own checksum is left as it
/// is, for `State::load` to refuse, not rewritten under a good one.
fn drop_from(tx: &rusqlite::Transaction<'_>, b: i64) -> Result<Dropped, SpoolError> {
    let (batches, records) = count_from(tx, b)?;
    // Per stream: the first deleted chunk's sequence number and first batch, from intact rows.
    let mut first: BTreeMap<i64, (i64, i64)> = BTreeMap::new();
    let mut damaged = 0_u64;
    {
        let mut stmt = tx
            .prepare(
                "SELECT id, stream_id, seq, records, bytes, first_ms, sealed_ms, first_batch, last_batch, row_crc
                 FROM chunks WHERE last_batch >= ?1",
            )
            .map_err(ctx("listing the chunks sealed over lost batches"))?;
        let mut rows = stmt.query([b]).map_err(ctx("listing the chunks sealed over lost batches"))?;
        while let Some(r) = rows.next().map_err(ctx("listing the chunks sealed over lost batches"))? {
            // Values of the wrong type are damage too.
            let intact = ChunkRow::from_row(r, 0)
                .ok()
                .filter(|c| r.get::<_, Option<i64>>(9).ok().flatten() == Some(c.crc()) && c.seq >= 1);
            let Some(c) = intact else {
                damaged += 1;
                continue;
            };
            let at = first.entry(c.stream_id).or_insert((c.seq, c.first_batch));
            *at = (at.0.min(c.seq), at.1.min(c.first_batch));
        }
    }
    for (stream_id, (seq, first_batch)) in first {
        let row: Option<(String, i64, i64, Option<i64>)> = tx
            .query_row("SELECT name, next_seq, sealed_through, row_crc FROM streams WHERE id = ?1", [stream_id], |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
            })
            .optional()
            .map_err(ctx("reading a stream to rewind"))?;
        let Some((name, next_seq, sealed_through, stored)) = row else { continue };
        if stored != Some(rowcrc::stream(stream_id, &name, next_seq, sealed_through)) {
            continue;
        }
        let (seq, sealed_through) = (seq.min(next_seq), first_batch.saturating_sub(1).min(sealed_through));
        tx.execute(
            "UPDATE streams SET next_seq = ?1, sealed_through = ?2, row_crc = ?3 WHERE id = ?4",
            (seq, sealed_through, rowcrc::stream(stream_id, &name, seq, sealed_through), stream_id),
        )
        .map_err(ctx("rewinding a stream past its lost chunks"))?;
    }
    let chunks = tx
        .execute("DELETE FROM chunks WHERE last_batch >= ?1", [b])
        .map_err(ctx("deleting chunks over lost batches"))?;
    tx.execute("DELETE FROM batches WHERE id >= ?1", [b]).map_err(ctx("deleting lost batches"))?;
    if damaged > 0 {
        tracing::warn!(
            chunks = damaged,
            "chunk rows sealed over lost batches fail their checksums (damaged); deleted without rewinding their \
             streams to them: their sequence numbers, never sent, are skipped"
        );
    }
    Ok(Dropped { batches, records, chunks: u64::try_from(chunks).unwrap_or(u64::MAX) })
}

/// The batch rows from `b` on and the records in them, as open drops them and `spool check`
/// reports them. A damaged count (negative, or not an integer) counts 0: `sum` would fail past
/// i64 (failing the open), and a negative count would take from the others; `total` (a float,
/// saturating as it becomes a `u64`) does neither.
pub(crate) fn count_from(conn: &Connection, b: i64) -> Result<(u64, u64), SpoolError> {
    let (batches, records): (i64, f64) = conn
        .query_row(
            "SELECT count(*), total(CASE WHEN typeof(records) = 'integer' AND records > 0 THEN records END)
             FROM batches WHERE id >= ?1",
            [b],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .map_err(ctx("counting the lost batches"))?;
    Ok((u64::try_from(batches).unwrap_or(0), records as u64))
}
