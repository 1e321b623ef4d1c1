//! The in-memory counters behind [`Spool::stats`](crate::Spool::stats) and the capacity check.
//!
//! They are loaded from the database at open (accounting comes from disk, never from a guess)
//! and kept up to date by the writer. Every write works on a clone and swaps it in only after
//! `COMMIT` succeeded, so a rolled-back transaction leaves them untouched.
//!
//! What a commit needs of them costs it no work per stream of the spool, however many streams
//! it has: the per-stream maps are persistent (`imbl`), so the clone and a published
//! [`Snapshot`] share their nodes, and the sums a commit asks for (the capacity check) and the
//! streams a linger seal looks at (those with open batches) are kept in step with every change
//! of a stream's counters ([`State::recount`]).

use std::collections::BTreeMap;

use imbl::{OrdMap, OrdSet};

use rusqlite::Connection;
use rusqlite::types::Value;

use crate::error::ctx;
use crate::rowcrc::{self, MetaValues};
use crate::schema::{self, BATCH_LEN};
use crate::segment::SegmentUse;
use crate::{SpoolError, SpoolStats, StreamStats};

/// Counters of one stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct StreamState {
    /// `streams.id`.
    pub id: i64,
    /// `streams.next_seq`.
    pub next_seq: u64,
    /// `streams.sealed_through`: the stream's batches with a greater id are its open batches.
    pub sealed_through: i64,
    pub open_batches: u64,
    pub open_records: u64,
    pub open_bytes: u64,
    /// Smallest `commit_ms` among open batches.
    pub oldest_open_ms: Option<u64>,
    /// An open batch row holds a damaged count, length or time ([`sum_open_batches`]): what the
    /// open batches hold is not known. Found at open, cleared by the seal.
    pub open_damaged: bool,
    /// Sealed, not quarantined chunks.
    pub sealed_chunks: u64,
    pub sealed_bytes: u64,
    /// Smallest `first_ms` among sealed, not quarantined chunks.
    pub oldest_sealed_ms: Option<u64>,
}

impl StreamState {
    pub(crate) fn oldest_ms(&self) -> Option<u64> {
        min_opt(self.oldest_open_ms, self.oldest_sealed_ms)
    }
}

/// Counters of the whole spool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct State {
    /// By stream name.
    pub streams: OrdMap<String, StreamState>,
    /// Stream name by `streams.id`.
    pub names: OrdMap<i64, String>,
    /// Sums over `streams`, kept in step by [`State::recount`].
    pub totals: Totals,
    /// Ids of the streams with open batches (or an open time): [`Counted::open`].
    pub open: OrdSet<i64>,
    pub quarantined_chunks: u64,
    /// The id the next inserted batch gets: greater than every batch id in the file and every
    /// `streams.sealed_through`. SQLite's own rowid choice (largest id + 1) would reuse the ids
    /// of acked batches once the newest ones are deleted, putting a new batch inside a range
    /// that is already sealed.
    pub next_batch_id: i64,
    /// The id the next sealed chunk gets (the row checksum covers it, so it is chosen before
    /// the insert).
    pub next_chunk_id: i64,
    /// The id the next new stream gets (streams are never deleted).
    pub next_stream_id: i64,
    /// The `meta` values as on disk (their checksum is rewritten with every change).
    pub meta: MetaValues,
    /// Payload segments that rows point into, by id: bytes still referenced and the end of the
    /// last row. A segment leaves the map when its last row is deleted.
    pub segments: BTreeMap<i64, SegmentUse>,
    /// `meta.segments_synced_through` as on disk (`None`: absent; open removes it, and
    /// [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync) writes it).
    pub segments_synced_through: Option<i64>,
}

impl State {
    /// Reads every counter from the database.
    pub(crate) fn load(conn: &Connection) -> Result<State, SpoolError> {
        let mut st = State::default();
        {
            // Each row is checked against its checksum: the next sequence number and the open
            // set come from here, and a damaged one would reuse sequence numbers the server
            // already holds (it would answer Duplicate for new data) or seal batches twice.
            let mut stmt = conn
                .prepare("SELECT id, name, next_seq, sealed_through, row_crc FROM streams")
                .map_err(ctx("loading streams"))?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get(2)?, r.get(3)?, r.get::<_, Option<i64>>(4)?))
                })
                .map_err(ctx("loading streams"))?;
            for row in rows {
                let (id, name, next_seq, sealed_through, stored): (i64, String, i64, i64, Option<i64>) =
                    row.map_err(ctx("loading streams"))?;
                let computed = rowcrc::stream(id, &name, next_seq, sealed_through);
                if stored != Some(computed) {
                    return Err(SpoolError::Inconsistent(format!(
                        "stream row {id} ({name:?}, next_seq {next_seq}, sealed_through {sealed_through}) fails its \
                         checksum (stored {stored:?}, computed {computed})"
                    )));
                }
                let next_seq = u64::try_from(next_seq)
                    .map_err(|_| SpoolError::Inconsistent(format!("stream row {id}: next_seq {next_seq}")))?;
                st.names.insert(id, name.clone());
                st.streams.insert(name, StreamState { id, next_seq, sealed_through, ..StreamState::default() });
            }
            st.next_stream_id = st.names.keys().max().map_or(1, |m| m.saturating_add(1));
        }
        {
            // Open batches, stream by stream, over the (stream_id, id) index, counted as every
            // seal counts them (`sum_open_batches`).
            let names: Vec<String> = st.streams.keys().cloned().collect();
            for name in names {
                let Some(s) = st.streams.get_mut(&name) else { continue };
                let open = sum_open_batches(conn, s.id, s.sealed_through)?;
                (s.open_batches, s.open_records, s.open_bytes, s.oldest_open_ms, s.open_damaged) =
                    (open.batches, open.records, open.bytes, open.oldest_ms, open.damaged > 0);
                if s.open_damaged {
                    tracing::warn!(
                        stream_id = s.id,
                        batches = open.damaged,
                        "open batch rows hold a record count, length or time that is negative or not an integer \
                         (damaged); counted as 0 (a time as none), their chunk quarantined when read"
                    );
                }
            }
            // A batch row of no stream is a damaged row (a changed `stream_id`): no chunk range
            // and no open set reaches it, so it can never be sent. It is left in place for
            // `spool check` (which lists it) and offline salvage, not a reason to move the
            // whole file aside (found by the `spool_recovery` fuzz target: quarantining the
            // chunk it came from rebuilt the index under the damaged value, and the next open
            // refused the file).
            let orphans: i64 = conn
                .query_row("SELECT count(*) FROM batches WHERE stream_id NOT IN (SELECT id FROM streams)", [], |r| {
                    r.get(0)
                })
                .map_err(ctx("looking for batches of unknown streams"))?;
            if orphans > 0 {
                tracing::warn!(rows = orphans, "batch rows belong to no stream (damaged); left in place, never sent");
            }
            let last: Option<i64> = conn
                .query_row(
                    "SELECT max(coalesce((SELECT max(id) FROM batches), 0),
                                coalesce((SELECT max(sealed_through) FROM streams), 0))",
                    [],
                    |r| r.get(0),
                )
                .map_err(ctx("finding the last batch id"))?;
            st.next_batch_id = last.unwrap_or(0).saturating_add(1);
            // As AUTOINCREMENT would choose: past every id in use or ever handed out.
            let last: i64 = conn
                .query_row(
                    "SELECT max(coalesce((SELECT max(id) FROM chunks), 0),
                                coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'chunks'), 0))",
                    [],
                    |r| r.get(0),
                )
                .map_err(ctx("finding the last chunk id"))?;
            st.next_chunk_id = last.saturating_add(1);
        }
        {
            // Chunk rows are checked against their checksums when read, not here: a damaged
            // value (one flipped top bit makes it negative) must not fail the open, which would
            // move the whole file aside for one chunk that the reader quarantines. A negative
            // size counts 0 (as where the chunk leaves the counters: `counted` in `spool.rs`), a
            // negative time is no time, and `total` (a float, exact below 2^53) cannot overflow
            // as `sum` would on damaged sizes.
            let mut stmt = conn
                .prepare(
                    "SELECT stream_id, count(*), total(max(bytes, 0)), min(CASE WHEN first_ms >= 0 THEN first_ms END),
                            count(CASE WHEN bytes < 0 OR first_ms < 0 THEN 1 END)
                     FROM chunks WHERE quarantine IS NULL GROUP BY stream_id",
                )
                .map_err(ctx("loading chunk counters"))?;
            let mut rows = stmt.query([]).map_err(ctx("loading chunk counters"))?;
            while let Some(r) = rows.next().map_err(ctx("loading chunk counters"))? {
                let stream_id: i64 = r.get(0).map_err(ctx("loading chunk counters"))?;
                let s = st.stream_by_id_mut(stream_id)?;
                s.sealed_chunks = r.get(1).map_err(ctx("loading chunk counters"))?;
                // Saturating: a float past u64::MAX gives u64::MAX.
                s.sealed_bytes = r.get::<_, f64>(2).map_err(ctx("loading chunk counters"))? as u64;
                s.oldest_sealed_ms = r
                    .get::<_, Option<i64>>(3)
                    .map_err(ctx("loading chunk counters"))?
                    .and_then(|ms| u64::try_from(ms).ok());
                let damaged: i64 = r.get(4).map_err(ctx("loading chunk counters"))?;
                if damaged > 0 {
                    tracing::warn!(
                        stream_id,
                        chunks = damaged,
                        "chunk rows hold a negative size or time (damaged); counted as 0, quarantined when read"
                    );
                }
            }
        }
        st.quarantined_chunks = conn
            .query_row("SELECT count(*) FROM chunks WHERE quarantine IS NOT NULL", [], |r| r.get(0))
            .map_err(ctx("counting quarantined chunks"))?;
        {
            let mut stmt = conn
                .prepare(
                    "SELECT segment, count(*), max(seg_offset + seg_len), min(id), max(id) FROM batches
                     WHERE segment IS NOT NULL GROUP BY segment",
                )
                .map_err(ctx("loading payload segment use"))?;
            let rows = stmt
                .query_map([], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, u64>(1)?, r.get::<_, Value>(2)?, r.get(3)?, r.get(4)?))
                })
                .map_err(ctx("loading payload segment use"))?;
            for row in rows {
                // A damaged row is found by its checksum when its chunk is read; here it only
                // must not stop the spool from opening. SQLite gives a sum past i64 (a damaged
                // length) as a float: saturated, as a negative end is 0.
                let (id, rows, end, first_batch, last_batch) = row.map_err(ctx("loading payload segment use"))?;
                let end = match end {
                    Value::Integer(end) => u64::try_from(end).unwrap_or(0),
                    Value::Real(end) => end as u64,
                    _ => 0,
                };
                st.segments.insert(id, SegmentUse { rows, end, first_batch, last_batch });
            }
        }
        let meta = schema::read_verified_meta(conn)?;
        st.meta = meta;
        (st.totals, st.open) = st.recounted();
        Ok(st)
    }

    /// The sums and the open set counted afresh from every stream: at open, and in debug
    /// builds before every `COMMIT`, to check the ones kept in step ([`State::check_counts`]).
    fn recounted(&self) -> (Totals, OrdSet<i64>) {
        let mut totals = Totals::default();
        let mut open = OrdSet::new();
        for s in self.streams.values() {
            let c = Counted::of(s);
            totals.add(&c);
            if c.open {
                open.insert(c.id);
            }
        }
        (totals, open)
    }

    /// Takes a change of one stream's counters, from `before` to `after` (both
    /// [`Counted::of`] the stream), into the sums and the open set. Every change of
    /// `open_bytes`, `open_batches`, `sealed_bytes`, `sealed_chunks`, `oldest_open_ms` goes
    /// through here.
    pub(crate) fn recount(&mut self, before: &Counted, after: &Counted) {
        self.totals.sub(before);
        self.totals.add(after);
        match (before.open, after.open) {
            (false, true) => {
                self.open.insert(after.id);
            }
            (true, false) => {
                self.open.remove(&after.id);
            }
            _ => {}
        }
    }

    /// In debug builds (the tests), that the sums and the open set kept in step equal those
    /// counted afresh. Nothing in release builds, where it would cost a pass over every stream.
    pub(crate) fn check_counts(&self) {
        #[cfg(debug_assertions)]
        {
            let (totals, open) = self.recounted();
            assert_eq!(self.totals, totals, "stream sums kept in step");
            assert_eq!(self.open, open, "open streams kept in step");
        }
    }

    /// What the published statistics are made from: shares the maps' nodes (O(1)).
    pub(crate) fn snapshot(&self) -> Snapshot {
        Snapshot {
            streams: self.streams.clone(),
            quarantined_chunks: self.quarantined_chunks,
            dropped_records: u64::try_from(self.meta.dropped_records).unwrap_or(0),
            dropped_chunks: u64::try_from(self.meta.dropped_chunks).unwrap_or(0),
        }
    }

    fn stream_by_id_mut(&mut self, id: i64) -> Result<&mut StreamState, SpoolError> {
        let missing =
            || SpoolError::Inconsistent(format!("a row references stream id {id}, which is not in `streams`"));
        let name = self.names.get(&id).ok_or_else(missing)?;
        self.streams.get_mut(name).ok_or_else(missing)
    }

    /// Stored payload bytes (open + sealed, quarantine excluded). The sums here saturate: a
    /// damaged row's size may be counted as anything up to `u64::MAX` (see [`sum_open_batches`]).
    pub(crate) fn total_bytes(&self) -> u64 {
        saturated(self.totals.open_bytes + self.totals.sealed_bytes)
    }

    pub(crate) fn open_bytes(&self) -> u64 {
        saturated(self.totals.open_bytes)
    }

    pub(crate) fn open_batches(&self) -> u64 {
        saturated(self.totals.open_batches)
    }

    pub(crate) fn sealed_chunks(&self) -> u64 {
        saturated(self.totals.sealed_chunks)
    }

    pub(crate) fn stats(&self) -> SpoolStats {
        self.snapshot().stats()
    }
}

/// The sums over every stream of the counters a commit needs whole. Wide enough that no sum
/// of `u64`s over any number of streams overflows, so a change is taken out exactly as it was
/// put in; read saturated to `u64`, as the fold over the streams they replace saturated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    pub open_bytes: u128,
    pub sealed_bytes: u128,
    pub open_batches: u128,
    pub sealed_chunks: u128,
}

impl Totals {
    fn add(&mut self, c: &Counted) {
        self.open_bytes += u128::from(c.open_bytes);
        self.sealed_bytes += u128::from(c.sealed_bytes);
        self.open_batches += u128::from(c.open_batches);
        self.sealed_chunks += u128::from(c.sealed_chunks);
    }

    /// Saturating: `c` was added before, so nothing saturates unless a change went around
    /// [`State::recount`], which [`State::check_counts`] catches in the tests.
    fn sub(&mut self, c: &Counted) {
        self.open_bytes = self.open_bytes.saturating_sub(u128::from(c.open_bytes));
        self.sealed_bytes = self.sealed_bytes.saturating_sub(u128::from(c.sealed_bytes));
        self.open_batches = self.open_batches.saturating_sub(u128::from(c.open_batches));
        self.sealed_chunks = self.sealed_chunks.saturating_sub(u128::from(c.sealed_chunks));
    }
}

fn saturated(v: u128) -> u64 {
    u64::try_from(v).unwrap_or(u64::MAX)
}

/// The part of a stream's counters that [`Totals`] and the open set are made of, taken before
/// and after a change ([`State::recount`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Counted {
    pub id: i64,
    pub open_bytes: u64,
    pub sealed_bytes: u64,
    pub open_batches: u64,
    pub sealed_chunks: u64,
    /// Whether a linger seal has to look at the stream: it has open batches, or an open time.
    pub open: bool,
}

impl Counted {
    pub(crate) fn of(s: &StreamState) -> Counted {
        Counted {
            id: s.id,
            open_bytes: s.open_bytes,
            sealed_bytes: s.sealed_bytes,
            open_batches: s.open_batches,
            sealed_chunks: s.sealed_chunks,
            open: s.open_batches > 0 || s.oldest_open_ms.is_some(),
        }
    }
}

/// The counters as of one commit, for statistics: taken in O(1) after each commit, turned into
/// [`SpoolStats`] (a pass over the streams) only when someone asks.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    streams: OrdMap<String, StreamState>,
    quarantined_chunks: u64,
    dropped_records: u64,
    dropped_chunks: u64,
}

impl Snapshot {
    /// Chunks evicted by the cap, ever (as [`SpoolStats::dropped_chunks`]).
    pub fn dropped_chunks(&self) -> u64 {
        self.dropped_chunks
    }

    /// The statistics.
    pub fn stats(&self) -> SpoolStats {
        let mut out = SpoolStats {
            dropped_records: self.dropped_records,
            dropped_chunks: self.dropped_chunks,
            quarantined_chunks: self.quarantined_chunks,
            ..SpoolStats::default()
        };
        for (name, s) in &self.streams {
            out.sealed_chunks += s.sealed_chunks;
            out.sealed_bytes = out.sealed_bytes.saturating_add(s.sealed_bytes);
            out.open_bytes = out.open_bytes.saturating_add(s.open_bytes);
            out.open_records = out.open_records.saturating_add(s.open_records);
            out.oldest_ms = min_opt(out.oldest_ms, s.oldest_ms());
            out.streams.push(StreamStats {
                name: name.clone(),
                next_seq: s.next_seq,
                sealed_chunks: s.sealed_chunks,
                bytes: s.open_bytes.saturating_add(s.sealed_bytes),
                oldest_ms: s.oldest_ms(),
            });
        }
        out.total_bytes = out.sealed_bytes.saturating_add(out.open_bytes);
        out
    }
}

/// A stream's open batches (its batch rows above its `sealed_through`) as the counters take
/// them. See [`sum_open_batches`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct OpenBatches {
    pub batches: u64,
    pub records: u64,
    pub bytes: u64,
    /// Smallest commit time; `None` when no open batch has one (none open, or damaged times).
    pub oldest_ms: Option<u64>,
    pub first_batch: Option<i64>,
    pub last_batch: Option<i64>,
    /// Rows with a record count, length or time that is negative or not an integer.
    pub damaged: u64,
}

/// Sums the open batch rows of stream `stream_id`, at open (`State::load`) and in every seal
/// (`seal_stream`), which checks the counters kept since the open against these sums: both
/// must count alike. The rows are not checked against their checksums here but when their
/// chunk is read, which quarantines it: a damaged value (one flipped top bit makes it
/// negative) must not fail the open, which would move the whole file aside, nor the seal,
/// which would fail every commit. So, as for chunk rows (`counted` in `spool.rs`), a negative
/// (or not integer) record count or length counts 0, a negative time is no time, and `total`
/// (a float, exact below 2^53, saturating as it becomes a `u64`) cannot overflow as `sum`
/// does on damaged values.
pub(crate) fn sum_open_batches(
    conn: &Connection,
    stream_id: i64,
    sealed_through: i64,
) -> Result<OpenBatches, SpoolError> {
    let ok = |col: &str| format!("typeof({col}) = 'integer' AND {col} >= 0");
    let (records, len, time) = (ok("records"), ok(&format!("({BATCH_LEN})")), ok("commit_ms"));
    let sql = format!(
        "SELECT count(*), total(CASE WHEN {records} THEN records END), total(CASE WHEN {len} THEN {BATCH_LEN} END),
                min(CASE WHEN {time} THEN commit_ms END), min(id), max(id),
                count(CASE WHEN NOT ({records} AND {len} AND {time}) THEN 1 END)
         FROM batches WHERE stream_id = ?1 AND id > ?2"
    );
    let row: (i64, f64, f64, Option<i64>, Option<i64>, Option<i64>, i64) = conn
        .prepare_cached(&sql)
        .and_then(|mut s| {
            s.query_row((stream_id, sealed_through), |r| {
                Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?))
            })
        })
        .map_err(ctx("summing open batches"))?;
    let (batches, records, bytes, oldest, first_batch, last_batch, damaged) = row;
    let count = |n: i64| u64::try_from(n).unwrap_or(0);
    Ok(OpenBatches {
        batches: count(batches),
        // Saturating (a float past u64::MAX gives u64::MAX, a NaN 0).
        records: records as u64,
        bytes: bytes as u64,
        oldest_ms: oldest.and_then(|ms| u64::try_from(ms).ok()),
        first_batch,
        last_batch,
        damaged: count(damaged),
    })
}

/// The smaller of two optional values; `None` only if both are.
pub(crate) fn min_opt(a: Option<u64>, b: Option<u64>) -> Option<u64> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}
