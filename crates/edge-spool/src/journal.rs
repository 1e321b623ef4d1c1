//! Commit records: each commit that appends writes, around its payload bytes in the segment, a
//! record of the rows it adds to the index, so that the payload segment alone can bring back
//! a commit whose index rows a power cut lost. A commit is then durable once its segment bytes
//! are, and the WAL's sync can come later (see `walsync.rs`): one sync per commit, not two.
//!
//! # Layout
//!
//! A record is a fixed prefix, the payload (the commit's batches back to back, where its rows
//! point), and a trailer:
//!
//! * prefix ([`PREFIX`] bytes, little-endian): magic `ESJ1` (`ESJX` once voided, see below),
//!   the segment id, the payload's length, the trailer's length, four zero bytes, and a
//!   CRC-32C of the 24 bytes after the magic;
//! * trailer: the streams the commit created (id, name), its batch rows (id, stream id,
//!   records, CRC-32C of the bytes, commit time, offset, length) and the chunk rows it sealed
//!   (the nine columns `chunks.row_crc` covers), then a CRC-32C of the prefix and the trailer
//!   before it.
//!
//! Records follow each other from offset 0 of a segment; each starts where the last ended. The
//! segment id in the prefix keeps the old bytes of a recycled segment file (a spare) from
//! passing for records of the new one. A record whose index `COMMIT` failed after its bytes
//! were written is *voided* (its magic overwritten) so that it is stepped over: its rows may
//! or may not be in the WAL, and the next commit reuses its batch ids.
//!
//! # Replay at open
//!
//! The index's durable state is a prefix of the commits (the WAL is synced in commit order);
//! the segments hold records up to the last segment sync. At open, before anything else looks
//! at the segments, [`replay`] reads the records of the newest segment that rows point into,
//! and of every later segment, in order. A record whose first batch id is below the index's
//! next batch id is already in the index; the first one at it, and those after, are added in
//! one transaction, each after its payload passes its CRC-32C. Replay leaves a segment at the
//! first record that is not intact, and at a gap: a record whose batch or chunk ids are not the
//! next ones (a commit without a record, such as a seal on its own, is missing before it: its
//! producers were never answered, since such a commit waits for the WAL's sync). Nothing after
//! such a record in the same file was answered either, since a sync covers the whole file; a
//! later segment is still read, as after a lost tail was dropped the writer starts a new
//! segment and gives the next commits the dropped ids again. Acks and evictions are
//! not recorded: a power cut can bring back a chunk already acked (sent again, deduplicated by
//! the server) or evicted (kept after all), never lose one.
//!
//! A read error (a failing disk) ends a segment's records as a record that is not intact does:
//! failing the open for it would fail every open (see `unreadable`).
//!
//! The end of the last record replay accepted is where the writer continues that segment; a
//! segment whose records do not reach its last row (written by an older version, or damaged)
//! is not continued, so that the records of the commits to come can always be read back.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;

use rusqlite::{Connection, TransactionBehavior};

use crate::SpoolError;
use crate::error::ctx;
use crate::rowcrc::{self, BatchRow, ChunkRow, SegRef};
use crate::segment;
use crate::state::State;

/// Bytes of a record's prefix.
pub(crate) const PREFIX: u64 = 32;
const MAGIC: [u8; 4] = *b"ESJ1";
const VOID: [u8; 4] = *b"ESJX";
/// A trailer longer than this is not one of ours (a commit of 16 Mi rows would need more).
const MAX_TRAILER: u32 = 1 << 30;

/// The rows one commit added to the index.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Record {
    pub streams: Vec<(i64, String)>,
    pub batches: Vec<BatchRow>,
    pub chunks: Vec<ChunkRow>,
}

/// The prefix of a record in segment `segment` with `payload` bytes of payload.
pub(crate) fn prefix(segment: i64, payload: u64, trailer: u32) -> [u8; PREFIX as usize] {
    let mut p = [0u8; PREFIX as usize];
    p[..4].copy_from_slice(&MAGIC);
    p[4..12].copy_from_slice(&segment.to_le_bytes());
    p[12..20].copy_from_slice(&payload.to_le_bytes());
    p[20..24].copy_from_slice(&trailer.to_le_bytes());
    let crc = crate::crc::crc32c(&p[4..28]);
    p[28..32].copy_from_slice(&crc.to_le_bytes());
    p
}

/// The trailer of `record`, whose prefix is `prefix` (with the trailer's length in it: see
/// [`trailer_len`]).
pub(crate) fn trailer(prefix: &[u8; PREFIX as usize], record: &Record) -> Vec<u8> {
    let mut t = Vec::with_capacity(usize::try_from(trailer_len(record)).unwrap_or(0));
    for n in [record.streams.len(), record.batches.len(), record.chunks.len()] {
        t.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
    }
    for (id, name) in &record.streams {
        t.extend_from_slice(&id.to_le_bytes());
        t.extend_from_slice(&u32::try_from(name.len()).unwrap_or(u32::MAX).to_le_bytes());
        t.extend_from_slice(name.as_bytes());
    }
    for b in &record.batches {
        let (offset, len) = b.seg.map_or((0, 0), |s| (s.offset, s.len));
        for v in [b.id, b.stream_id, b.records, b.crc32c, b.commit_ms, offset, len] {
            t.extend_from_slice(&v.to_le_bytes());
        }
    }
    for c in &record.chunks {
        for v in [c.id, c.stream_id, c.seq, c.records, c.bytes, c.first_ms, c.sealed_ms, c.first_batch, c.last_batch] {
            t.extend_from_slice(&v.to_le_bytes());
        }
    }
    let crc = crate::crc::crc32c_append(crate::crc::crc32c(prefix), &t);
    t.extend_from_slice(&crc.to_le_bytes());
    t
}

/// The length of `record`'s trailer.
pub(crate) fn trailer_len(record: &Record) -> u32 {
    let names: usize = record.streams.iter().map(|(_, n)| 12 + n.len()).sum();
    let n = 12 + names + record.batches.len() * 56 + record.chunks.len() * 72 + 4;
    u32::try_from(n).unwrap_or(u32::MAX)
}

/// Overwrites the magic of the record at `offset` so that replay steps over it.
pub(crate) fn void(file: &File, offset: u64) -> io::Result<()> {
    file.write_all_at(&VOID, offset)
}

/// One record read back: where it ends, and its rows (`None`: voided).
#[derive(Debug)]
struct Found {
    end: u64,
    record: Option<Record>,
}

/// Reads the record at `at` of segment `segment` (`len` bytes long); `None` when there is no
/// intact record there (the end of the records).
fn read_at(f: &File, segment: i64, len: u64, at: u64) -> io::Result<Option<Found>> {
    let Some(body_at) = at.checked_add(PREFIX).filter(|e| *e <= len) else { return Ok(None) };
    let mut p = [0u8; PREFIX as usize];
    f.read_exact_at(&mut p, at)?;
    let word = |r: std::ops::Range<usize>| p[r].iter().rev().fold(0u64, |acc, b| (acc << 8) | u64::from(*b));
    let voided = match p[..4].try_into() {
        Ok(MAGIC) => false,
        Ok(VOID) => true,
        _ => return Ok(None),
    };
    if word(28..32) != u64::from(crate::crc::crc32c(&p[4..28])) || word(4..12) as i64 != segment {
        return Ok(None);
    }
    let (payload, trailer) = (word(12..20), word(20..24));
    let Some(trailer_at) = body_at.checked_add(payload) else { return Ok(None) };
    let Some(end) = trailer_at.checked_add(trailer).filter(|e| *e <= len) else { return Ok(None) };
    if trailer < 16 || trailer > u64::from(MAX_TRAILER) {
        return Ok(None);
    }
    let mut t = vec![0u8; usize::try_from(trailer).unwrap_or(0)];
    f.read_exact_at(&mut t, trailer_at)?;
    let (body, crc) = t.split_at(t.len() - 4);
    let mut stamped = p;
    stamped[..4].copy_from_slice(&MAGIC);
    if u32::from_le_bytes([crc[0], crc[1], crc[2], crc[3]])
        != crate::crc::crc32c_append(crate::crc::crc32c(&stamped), body)
    {
        return Ok(None);
    }
    if voided {
        return Ok(Some(Found { end, record: None }));
    }
    let Some(record) = decode(body, segment, body_at, payload) else { return Ok(None) };
    Ok(Some(Found { end, record: Some(record) }))
}

/// The rows in a trailer's body; `None` when they do not fit the record (its payload range).
fn decode(body: &[u8], segment: i64, payload_at: u64, payload: u64) -> Option<Record> {
    let mut c = Cursor(body);
    let (ns, nb, nc) = (c.u32()?, c.u32()?, c.u32()?);
    let mut r = Record::default();
    for _ in 0..ns {
        let id = c.i64()?;
        let n = usize::try_from(c.u32()?).ok()?;
        r.streams.push((id, String::from_utf8(c.take(n)?.to_vec()).ok()?));
    }
    let payload_end = payload_at.checked_add(payload)?;
    for _ in 0..nb {
        let v: [i64; 7] = [c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?];
        let (off, len) = (u64::try_from(v[5]).ok()?, u64::try_from(v[6]).ok()?);
        if off < payload_at || off.checked_add(len)? > payload_end {
            return None;
        }
        let seg = SegRef { segment, offset: v[5], len: v[6] };
        r.batches.push(BatchRow {
            id: v[0],
            stream_id: v[1],
            records: v[2],
            crc32c: v[3],
            commit_ms: v[4],
            seg: Some(seg),
        });
    }
    for _ in 0..nc {
        let v: [i64; 9] = [c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?, c.i64()?];
        r.chunks.push(ChunkRow {
            id: v[0],
            stream_id: v[1],
            seq: v[2],
            records: v[3],
            bytes: v[4],
            first_ms: v[5],
            sealed_ms: v[6],
            first_batch: v[7],
            last_batch: v[8],
        });
    }
    (c.0.is_empty() && !r.batches.is_empty()).then_some(r)
}

struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }

    fn u32(&mut self) -> Option<u32> {
        self.take(4).and_then(|b| b.try_into().ok()).map(u32::from_le_bytes)
    }

    fn i64(&mut self) -> Option<i64> {
        self.take(8).and_then(|b| b.try_into().ok()).map(i64::from_le_bytes)
    }
}

/// What [`replay`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Replayed {
    /// Commits added to the index from their records.
    pub commits: u64,
    /// Their batch rows, and the records in them.
    pub batches: u64,
    pub records: u64,
    /// Chunk rows they sealed.
    pub chunks: u64,
    /// The segment and offset where the records the index now holds end: where the writer
    /// continues that segment (`None`: no segment to continue).
    pub tail: Option<(i64, u64)>,
}

/// The index's next ids, and the stream rows, as [`replay`] goes.
struct Next {
    batch: i64,
    chunk: i64,
    /// Stream id → (name, next_seq, sealed_through).
    streams: BTreeMap<i64, (String, i64, i64)>,
}

/// What [`replay`] would add: the records, in order, and the name of every stream by id.
pub(crate) struct Plan {
    pub records: Vec<Record>,
    names: BTreeMap<i64, String>,
    pub counts: Replayed,
}

/// Finds the commits whose records are in the segments but whose rows are not in the index
/// whose counters are `state` (see the module's text). Reads only (`spool check` runs it too).
pub(crate) fn plan(state: &State, db: &Path) -> Result<Plan, SpoolError> {
    let mut plan = Plan { records: Vec::new(), names: BTreeMap::new(), counts: Replayed::default() };
    let newest_used = state.segments.keys().next_back();
    let files: Vec<(i64, std::path::PathBuf)> =
        segment::list(db)?.into_iter().filter(|(id, _)| newest_used.is_none_or(|n| id >= n)).collect();
    if files.is_empty() {
        return Ok(plan);
    }
    let mut next = Next {
        batch: state.next_batch_id,
        chunk: state.next_chunk_id,
        streams: state
            .streams
            .iter()
            .map(|(name, s)| (s.id, (name.clone(), i64::try_from(s.next_seq).unwrap_or(i64::MAX), s.sealed_through)))
            .collect(),
    };
    let mut buf = Vec::new();
    let out = &mut plan.counts;
    'files: for (id, p) in files {
        let f = File::open(&p).map_err(|e| segment::io_error(&p, e))?;
        let len = f.metadata().map_err(|e| segment::io_error(&p, e))?.len();
        let mut at = 0;
        loop {
            let found = match read_at(&f, id, len, at) {
                Ok(Some(found)) => found,
                Ok(None) => break,
                Err(e) => {
                    unreadable(&p, at, e)?;
                    continue 'files;
                }
            };
            let start = at;
            at = found.end;
            let Some(record) = found.record else { continue };
            let first = record.batches.first().map_or(i64::MAX, |b| b.id);
            if first < next.batch {
                out.tail = Some((id, at));
                continue;
            }
            let ok = fits(&record, &next)
                && match intact(&f, &record, &mut buf) {
                    Ok(intact) => intact,
                    Err(e) => {
                        unreadable(&p, start, e)?;
                        false
                    }
                };
            if !ok {
                // Nothing after it in this file was answered (a sync covers the whole file),
                // unless it could not be read (see `unreadable`). A later segment may still
                // hold the next commits: after open dropped a lost tail (`unsynced.rs`), the
                // writer starts a new segment and reuses the ids.
                continue 'files;
            }
            advance(&record, &mut next);
            out.commits += 1;
            out.batches += record.batches.len() as u64;
            out.records += record.batches.iter().map(|b| u64::try_from(b.records).unwrap_or(0)).sum::<u64>();
            out.chunks += record.chunks.len() as u64;
            out.tail = Some((id, at));
            plan.records.push(record);
        }
    }
    plan.names = next.streams.into_iter().map(|(id, (name, _, _))| (id, name)).collect();
    Ok(plan)
}

/// A read error in segment file `p` at `at`: the records from there on are not read, as after
/// a record that is not intact. At run time the same error makes the chunks whose bytes are
/// there corrupt (quarantined when read); failing the open for it would fail every open, and
/// the agent would never start. What is lost: the commits whose records lie past the error and
/// whose rows the WAL lost (a power cut), which nothing can read back either. A shortage of
/// memory is not the file's fault: it still fails the open, which a restart tries again.
fn unreadable(p: &Path, at: u64, e: io::Error) -> Result<(), SpoolError> {
    if matches!(e.kind(), io::ErrorKind::OutOfMemory | io::ErrorKind::WouldBlock) {
        return Err(segment::io_error(p, e));
    }
    tracing::error!(
        segment = %p.display(),
        offset = at,
        error = %e,
        "a payload segment cannot be read; its commit records from here on are not replayed, and its chunks \
         are quarantined when read"
    );
    Ok(())
}

/// Adds the commits whose records are in the segments but whose rows are not in the index
/// whose counters are `state` (see the module's text), in one transaction, made durable
/// before it returns.
pub(crate) fn replay(conn: &mut Connection, state: &State, db: &Path) -> Result<Replayed, SpoolError> {
    let plan = plan(state, db)?;
    let out = plan.counts;
    if plan.records.is_empty() {
        return Ok(out);
    }
    let tx = conn
        .transaction_with_behavior(TransactionBehavior::Immediate)
        .map_err(ctx("beginning the replay transaction"))?;
    for record in &plan.records {
        insert(&tx, record, &plan.names)?;
    }
    tx.commit().map_err(ctx("committing the replay transaction"))?;
    // Durable before the writer cuts or reuses anything past the rows (under either
    // synchronous setting).
    let wal = crate::recovery::with_suffix(db, "-wal");
    File::open(&wal).and_then(|f| f.sync_data()).map_err(|source| SpoolError::Io { path: wal, source })?;
    tracing::warn!(
        commits = out.commits,
        batches = out.batches,
        records = out.records,
        chunks = out.chunks,
        "the index had lost its last commits (a power cut before the WAL's sync); added them back from the \
         payload segments' commit records"
    );
    Ok(out)
}

/// The record's rows are the next ones: its batch ids follow on from the index's, its chunks'
/// ids too, each chunk has its stream's next sequence number and starts past the stream's
/// sealed batches, and a stream it creates is new.
fn fits(record: &Record, next: &Next) -> bool {
    if !(next.batch..).zip(&record.batches).all(|(id, b)| b.id == id) {
        return false;
    }
    let mut streams = next.streams.clone();
    for (id, name) in &record.streams {
        if streams.insert(*id, (name.clone(), 1, 0)).is_some() {
            return false;
        }
    }
    if record.batches.iter().any(|b| !streams.contains_key(&b.stream_id)) {
        return false;
    }
    for (id, c) in (next.chunk..).zip(&record.chunks) {
        let Some((_, seq, sealed_through)) = streams.get_mut(&c.stream_id) else { return false };
        if c.id != id || c.seq != *seq || c.first_batch <= *sealed_through || c.last_batch < c.first_batch {
            return false;
        }
        (*seq, *sealed_through) = (c.seq + 1, c.last_batch);
    }
    true
}

/// Every batch's bytes pass their CRC-32C.
fn intact(f: &File, record: &Record, buf: &mut Vec<u8>) -> io::Result<bool> {
    for b in &record.batches {
        let Some(seg) = b.seg else { return Ok(false) };
        let (Ok(at), Ok(len)) = (u64::try_from(seg.offset), usize::try_from(seg.len)) else { return Ok(false) };
        buf.resize(len, 0);
        match f.read_exact_at(buf, at) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(e),
        }
        if i64::from(crate::crc::crc32c(buf)) != b.crc32c {
            return Ok(false);
        }
    }
    Ok(true)
}

/// Moves `next` past `record`.
fn advance(record: &Record, next: &mut Next) {
    for (id, name) in &record.streams {
        next.streams.insert(*id, (name.clone(), 1, 0));
    }
    if let Some(b) = record.batches.last() {
        next.batch = b.id + 1;
    }
    for c in &record.chunks {
        if let Some((_, seq, sealed_through)) = next.streams.get_mut(&c.stream_id) {
            (*seq, *sealed_through) = (c.seq + 1, c.last_batch);
        }
        next.chunk = c.id + 1;
    }
}

/// Inserts `record`'s rows; `names` holds every stream's name by id.
fn insert(tx: &rusqlite::Transaction<'_>, record: &Record, names: &BTreeMap<i64, String>) -> Result<(), SpoolError> {
    for (id, name) in &record.streams {
        tx.execute(
            "INSERT INTO streams (id, name, next_seq, sealed_through, row_crc) VALUES (?1, ?2, 1, 0, ?3)",
            (id, name, rowcrc::stream(*id, name, 1, 0)),
        )
        .map_err(ctx("replaying a stream row"))?;
    }
    for b in &record.batches {
        let Some(seg) = b.seg else { continue };
        tx.execute(
            "INSERT INTO batches (id, stream_id, records, crc32c, commit_ms, row_crc, segment, seg_offset, seg_len, data)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, X'')",
            (b.id, b.stream_id, b.records, b.crc32c, b.commit_ms, b.crc(), seg.segment, seg.offset, seg.len),
        )
        .map_err(ctx("replaying a batch row"))?;
    }
    for c in &record.chunks {
        tx.execute(
            "INSERT INTO chunks (id, stream_id, seq, records, bytes, first_ms, sealed_ms, first_batch, last_batch, row_crc)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
            (c.id, c.stream_id, c.seq, c.records, c.bytes, c.first_ms, c.sealed_ms, c.first_batch, c.last_batch, c.crc()),
        )
        .map_err(ctx("replaying a chunk row"))?;
        let Some(name) = names.get(&c.stream_id) else {
            return Err(SpoolError::Inconsistent(format!("replayed chunk {} of unknown stream {}", c.id, c.stream_id)));
        };
        let (seq, sealed_through) = (c.seq + 1, c.last_batch);
        tx.execute(
            "UPDATE streams SET next_seq = ?1, sealed_through = ?2, row_crc = ?3 WHERE id = ?4",
            (seq, sealed_through, rowcrc::stream(c.stream_id, name, seq, sealed_through), c.stream_id),
        )
        .map_err(ctx("replaying a seal"))?;
    }
    Ok(())
}

/// The payload bytes of every record in segment file `path` (id `segment`), in order; asserts
/// that the records fill the file (tests).
#[cfg(test)]
pub(crate) fn payloads(path: &Path, segment: i64) -> Vec<u8> {
    let f = File::open(path).expect("segment file");
    let len = f.metadata().expect("length").len();
    let (mut out, mut at) = (Vec::new(), 0);
    while let Some(found) = read_at(&f, segment, len, at).expect("read") {
        for b in found.record.iter().flat_map(|r| &r.batches) {
            let s = b.seg.expect("a segment batch");
            let mut buf = vec![0; usize::try_from(s.len).expect("len")];
            f.read_exact_at(&mut buf, u64::try_from(s.offset).expect("offset")).expect("payload");
            out.extend_from_slice(&buf);
        }
        at = found.end;
    }
    assert_eq!(at, len, "records up to the end of {}", path.display());
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        let seg = |offset, len| Some(SegRef { segment: 3, offset, len });
        Record {
            streams: vec![(2, "temp".into())],
            batches: vec![
                BatchRow { id: 7, stream_id: 2, records: 1, crc32c: 11, commit_ms: 5, seg: seg(32, 4) },
                BatchRow { id: 8, stream_id: 1, records: 2, crc32c: 12, commit_ms: 5, seg: seg(36, 6) },
            ],
            chunks: vec![ChunkRow {
                id: 4,
                stream_id: 2,
                seq: 1,
                records: 1,
                bytes: 4,
                first_ms: 5,
                sealed_ms: 5,
                first_batch: 7,
                last_batch: 7,
            }],
        }
    }

    fn write(f: &File, at: u64, segment: i64, r: &Record) -> u64 {
        let p = prefix(segment, 10, trailer_len(r));
        let t = trailer(&p, r);
        assert_eq!(t.len() as u32, trailer_len(r));
        f.write_all_at(&p, at).expect("write");
        f.write_all_at(&[0xAB; 10], at + PREFIX).expect("write");
        f.write_all_at(&t, at + PREFIX + 10).expect("write");
        at + PREFIX + 10 + t.len() as u64
    }

    fn scratch(dir: &tempfile::TempDir) -> File {
        std::fs::OpenOptions::new().read(true).write(true).create_new(true).open(dir.path().join("s")).expect("file")
    }

    #[test]
    fn a_record_reads_back_as_written_and_a_damaged_or_foreign_one_ends_the_records() {
        let dir = tempfile::tempdir().expect("dir");
        let f = scratch(&dir);
        let end = write(&f, 0, 3, &record());
        let len = f.metadata().expect("len").len();
        let found = read_at(&f, 3, len, 0).expect("read").expect("a record");
        assert_eq!((found.end, found.record), (end, Some(record())));
        assert!(read_at(&f, 4, len, 0).expect("read").is_none(), "another segment's record (a recycled file)");
        assert!(read_at(&f, 3, len - 1, 0).expect("read").is_none(), "cut short");
        assert!(read_at(&f, 3, len, end).expect("read").is_none(), "nothing after it");
        // Any flipped bit in the prefix or the trailer.
        for at in [5, PREFIX - 1, PREFIX + 10, end - 5] {
            let mut b = [0u8];
            f.read_exact_at(&mut b, at).expect("read");
            f.write_all_at(&[b[0] ^ 1], at).expect("flip");
            assert!(read_at(&f, 3, len, 0).expect("read").is_none(), "bit flipped at {at}");
            f.write_all_at(&b, at).expect("restore");
        }
        // A voided record is stepped over, not an end.
        void(&f, 0).expect("void");
        let found = read_at(&f, 3, len, 0).expect("read").expect("a voided record");
        assert_eq!((found.end, found.record), (end, None));
    }

    #[test]
    fn batches_outside_their_record_payload_are_refused() {
        let mut r = record();
        r.batches[1].seg = Some(SegRef { segment: 3, offset: 40, len: 6 });
        let dir = tempfile::tempdir().expect("dir");
        let f = scratch(&dir);
        write(&f, 0, 3, &r);
        let len = f.metadata().expect("len").len();
        assert!(read_at(&f, 3, len, 0).expect("read").is_none());
    }
}
