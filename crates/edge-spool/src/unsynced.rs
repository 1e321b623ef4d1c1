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
//! answered either. The batches that pass are synced (after a crash without a power cut their
//! bytes may still be only in the page cache), and the mark is removed: everything in the file
//! is then durable, and [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync) writes a new
//! one.
//!
//! The mark is kept close behind the syncs because above it a batch whose bytes fail is taken
//! for a lost write, where below it the same failure is damage and its chunk is quarantined
//! when read: after a crash the batches above the mark are those of the last sync or two,
//! which a power cut could lose, and after a clean shutdown there are none.
//!
//! A batch row that fails its own row checksum is left alone: that is damage to the file, not
//! a lost write, and reading its chunk quarantines it as before.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use crate::SpoolError;
use crate::error::ctx;
use crate::rowcrc::{self, BatchRow, SegRef};
use crate::schema::META_SEGMENTS_SYNCED;
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

/// Checks the batches above the mark against their CRC-32C, up to the first that fails;
/// `None` when the file has no mark. Reads only (`spool check` runs it too).
pub(crate) fn scan(conn: &Connection, db: &Path) -> Result<Option<Scan>, SpoolError> {
    let mark: Option<rusqlite::types::Value> = conn
        .query_row("SELECT value FROM meta WHERE key = ?1", [META_SEGMENTS_SYNCED], |r| r.get(0))
        .optional()
        .map_err(ctx("reading the synced-segments mark"))?;
    let Some(mark) = mark else { return Ok(None) };
    let mark = match mark {
        rusqlite::types::Value::Integer(m) => m,
        other => {
            // Not a value we wrote: check every batch (slower, never wrong).
            tracing::warn!(value = ?other, "the synced-segments mark is not an integer; checking every batch");
            0
        }
    };
    let mut found = Scan::default();
    let mut files: BTreeMap<i64, Option<File>> = BTreeMap::new();
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
        let file = match files.entry(seg.segment) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let p = segment::path(db, seg.segment);
                match File::open(&p) {
                    Ok(f) => e.insert(Some(f)),
                    Err(err) if err.kind() == io::ErrorKind::NotFound => e.insert(None),
                    Err(err) => return Err(segment::io_error(&p, err)),
                }
            }
        };
        let intact = match file {
            Some(f) => {
                crc_of(f, seg, &mut buf)
                    .map_err(|e| segment::io_error(&segment::path(db, seg.segment), e))?
                    .map(i64::from)
                    == Some(crc32c)
            }
            None => false,
        };
        if !intact {
            found.first_lost = Some(id);
            break;
        }
        found.intact_segments.insert(seg.segment);
    }
    Ok(Some(found))
}

/// Checks the batches above the mark, drops the lost tail and removes the mark (see the
/// module's text). Does nothing when the file has no mark.
pub(crate) fn drop_lost_tail(conn: &mut Connection, db: &Path) -> Result<Dropped, SpoolError> {
    let Some(Scan { first_lost, intact_segments: synced }) = scan(conn, db)? else {
        return Ok(Dropped::default());
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
    tx.execute("DELETE FROM meta WHERE key = ?1", [META_SEGMENTS_SYNCED])
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

/// The CRC-32C of a batch's bytes, or `None` when the file ends before them.
fn crc_of(f: &File, seg: SegRef, buf: &mut Vec<u8>) -> io::Result<Option<u32>> {
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
        at += n as u64;
        left -= n as u64;
    }
    Ok(Some(crc))
}

/// Deletes batch `b` and every later batch, and the chunks sealed over any of them; moves each
/// such stream's `next_seq` and `sealed_through` back to before its first deleted chunk.
fn drop_from(tx: &rusqlite::Transaction<'_>, b: i64) -> Result<Dropped, SpoolError> {
    let (batches, records): (i64, i64) = tx
        .query_row("SELECT count(*), coalesce(sum(records), 0) FROM batches WHERE id >= ?1", [b], |r| {
            Ok((r.get(0)?, r.get(1)?))
        })
        .map_err(ctx("counting the lost batches"))?;
    // Per stream: the first deleted chunk's sequence number and first batch.
    let rewind: Vec<(i64, String, i64, i64, i64)> = tx
        .prepare(
            "SELECT c.stream_id, s.name, min(c.seq), min(c.first_batch), count(*)
             FROM chunks c JOIN streams s ON s.id = c.stream_id
             WHERE c.last_batch >= ?1 GROUP BY c.stream_id",
        )
        .and_then(|mut s| s.query_map([b], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?)))?.collect())
        .map_err(ctx("listing the chunks sealed over lost batches"))?;
    let mut chunks = 0;
    for (stream_id, name, seq, first_batch, n) in rewind {
        let sealed_through = first_batch.saturating_sub(1);
        tx.execute(
            "UPDATE streams SET next_seq = ?1, sealed_through = ?2, row_crc = ?3 WHERE id = ?4",
            (seq, sealed_through, rowcrc::stream(stream_id, &name, seq, sealed_through), stream_id),
        )
        .map_err(ctx("rewinding a stream past its lost chunks"))?;
        chunks += n;
    }
    tx.execute("DELETE FROM chunks WHERE last_batch >= ?1", [b]).map_err(ctx("deleting chunks over lost batches"))?;
    tx.execute("DELETE FROM batches WHERE id >= ?1", [b]).map_err(ctx("deleting lost batches"))?;
    let n = |v: i64| u64::try_from(v).unwrap_or(0);
    Ok(Dropped { batches: n(batches), records: n(records), chunks: n(chunks) })
}
