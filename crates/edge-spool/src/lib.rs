//! edge-spool: the agent's durable queue, producer batches held until the ingest server has
//! acknowledged them: their bytes in append-only payload segment files, the index in a SQLite
//! (WAL) database.
//!
//! Producers hand the agent [`Batch`]es (already framed records, opaque bytes). [`Spool::append`]
//! stores them, one transaction per call (group commit). Open batches of a stream are *sealed*
//! into a chunk when they reach [`SpoolOptions::chunk_target_bytes`] or when the oldest of them
//! is older than [`SpoolOptions::linger`]; sealing gives the chunk the stream's next sequence
//! number. The uploader lists sealed chunks through a [`SpoolReader`], sends them, and calls
//! [`Spool::ack`] once the server says a chunk is durable; only then are its rows deleted.
//!
//! The API is synchronous; the agent runs it on a blocking thread. There is one writer
//! ([`Spool`]) per file, across processes too: [`Spool::open`] takes an exclusive `flock` on
//! `<path>-lock` and fails with [`SpoolError::Locked`] while another holds it (`lock.rs`); and
//! any number of readers ([`SpoolReader`]).
//!
//! # On-disk format (`PRAGMA user_version = 4`)
//!
//! One SQLite database file in WAL mode (`<path>`, `<path>-wal`, `<path>-shm`), and payload
//! segment files `<path>-seg-<id>` (ten digits) in the same directory (see `segment.rs`), and
//! at most one spare `<path>-seg-spare-0`: an emptied segment's file, dead bytes only, kept for
//! the next segment to be renamed from (an `fdatasync` after overwriting allocated blocks skips
//! the file system's journal).
//!
//! * `meta(key TEXT PRIMARY KEY, value NOT NULL) WITHOUT ROWID`
//!   * `spool_id`: 16 random bytes (BLOB), written in the transaction that creates the schema.
//!     A file created anew (new SD card, factory reset, quarantine) gets a new identity, so the
//!     server never mistakes its fresh sequence numbers for old ones; so does a copy of the
//!     file opened on another machine (`host_id` below), so that the server never mistakes
//!     the copy's chunks for the original's.
//!   * `dropped_chunks`, `dropped_records`: INTEGER counters of what
//!     [`FullPolicy::DropOldest`] evicted, updated in the evicting transaction.
//!   * `legacy_batches_through`: the last batch id written before the file was migrated to
//!     version 3 (0 for a file created at version 3); those batches have no `row_crc`.
//!   * `row_crc`: the row checksum (see `rowcrc.rs`) over the four values above, rewritten with
//!     the counters.
//!   * `host_id`: the identity of the machine the file was last opened on (the agent's
//!     `/etc/machine-id`) and its checksum (BLOB). Absent until the spool is opened with one.
//!     An open on a machine with another identity draws a new `spool_id` first (see
//!     [`SpoolOptions::host_id`]). Not in `row_crc`.
//!   * `segments_synced_through`: while a [`WalSync`] makes the commits durable, a batch id
//!     whose payload bytes, and those of every batch below it, are known to be synced; open
//!     checks the batches above it and removes it (see `unsynced.rs`). Not in `row_crc`.
//! * Every `streams`, `chunks` and `batches` row has a `row_crc` INTEGER: a CRC-32C over the
//!   table name and the row's other columns (for `batches` all but `data`, which `crc32c`
//!   covers; for `chunks` all but `quarantine`). Stream rows and `meta` are checked at
//!   [`Spool::open`] (a mismatch is corruption: the file is moved aside), chunk and batch rows
//!   by every [`SpoolReader::read`] (a mismatch is [`SpoolError::Corrupt`]), all of them by
//!   [`check`]. The writer chooses stream and chunk ids itself (as SQLite would), since the
//!   checksum covers the id.
//! * `streams(id INTEGER PRIMARY KEY, name TEXT NOT NULL UNIQUE, next_seq INTEGER NOT NULL,
//!   sealed_through INTEGER NOT NULL)`: one row per stream ever seen, never deleted; `next_seq`
//!   is the sequence number the next sealed chunk of that stream gets (starts at 1);
//!   `sealed_through` is the id of the last batch of the stream's newest chunk (0 before the
//!   first seal): the stream's batches with a greater id are its *open* batches.
//! * `chunks(id INTEGER PRIMARY KEY AUTOINCREMENT, stream_id, seq, records, bytes, first_ms,
//!   sealed_ms, quarantine TEXT NULL, first_batch, last_batch, UNIQUE(stream_id, seq))`: one row
//!   per sealed chunk. `AUTOINCREMENT` makes ids strictly increasing in sealing order and never
//!   reused, even after the newest chunk is deleted. `quarantine` holds the reason once the chunk
//!   is quarantined. The chunk's batches are the batches *of its stream* with `first_batch <= id
//!   <= last_batch` (batch ids are shared by all streams, so a range always goes with
//!   `stream_id`).
//! * `batches(id INTEGER PRIMARY KEY, stream_id, records, crc32c, commit_ms, row_crc, segment,
//!   seg_offset, seg_len, data BLOB)`: one row per stream per writer transaction, standing for
//!   the producer batches that transaction appended to the stream back to back (cut where the
//!   stream is sealed), in append order, **never updated**: inserted by `append`/`commit`
//!   (or, after a power cut took it from the WAL, by open from its commit record, as it was),
//!   deleted with its chunk. Its bytes are `seg_len` bytes at `seg_offset` of segment file
//!   `segment`, and `data` is empty; rows written before version 4 have the three columns NULL
//!   and their bytes in `data`. `crc32c` is the CRC-32C of the bytes, computed at append and
//!   checked on every read. A chunk's payload is the concatenation of its batches' bytes in `id`
//!   order. The row checksum of a row with a segment also covers the three location columns. The
//!   writer chooses each id: greater than every batch id in the file and every
//!   `streams.sealed_through` (SQLite's own choice, largest id + 1, would reuse the ids of acked
//!   batches and put a new batch inside a sealed range). Files migrated from version 1 keep
//!   version 1's column order and a `chunk_id` column, no longer read or written (see
//!   `schema.rs`).
//! * Indexes: `batches(stream_id, id)` (a chunk's batches, a stream's open batches, deleting a
//!   range), `chunks(stream_id, first_ms) WHERE quarantine IS NULL` (per-stream oldest data).
//! * Migration: a version-1 file (membership in `batches.chunk_id`) is converted in place at
//!   [`Spool::open`], in one transaction that writes only `chunks`, `streams` and the indexes;
//!   a version-2 file gets its `row_crc` columns in one transaction that computes them for
//!   `streams`, `chunks` and `meta` and leaves batch rows as they are; a version-3 file gets the
//!   three location columns, and its batches keep their bytes inline.
//!
//! Times (`commit_ms`, `first_ms`, `sealed_ms`) are the `now_ms` values the caller passed in
//! (unix milliseconds); the spool reads no clock for them.
//!
//! # Commit sequence
//!
//! Every write call (`commit`, and `append`, `seal_*`, `ack`, which are `commit`s with one kind
//! of work; `quarantine`, `purge_quarantined`) is one `BEGIN IMMEDIATE` ... `COMMIT`. A call
//! with appends first writes their bytes, back to back, at the committed end of the active
//! segment (one `pwritev` of the batches themselves, framed as one *commit record* whose
//! trailer lists the rows the commit adds: see `journal.rs`) and `fdatasync`s it, under either
//! durability, so a committed row never points at bytes that were not durable; a new segment
//! (when the active one holds [`SpoolOptions::segment_target_bytes`]) is created and the
//! directory fsynced first. Bytes of a call that fails are cut off again (and by the next
//! open), unless only its index `COMMIT` failed: SQLite cannot say whether such a transaction
//! reached the WAL, so its bytes are stepped over, never overwritten. After `COMMIT`, segments
//! no row points into any more are deleted (the active one too once it is all dead and a quarter
//! full); a crash before that leaves files the next open deletes. Whether a segment is unused
//! is asked of the rows, not only of a counter: `batches` is counted over the id range the
//! segment's rows were given (kept per segment, read at open), which is a small run of the
//! table rather than all of it.
//! [`Spool::commit`] puts a writer iteration's acks, appends and seals (in that order) into one
//! transaction, so the agent pays one index fsync per iteration (and one `fdatasync` of the
//! segment when it appends); a call with nothing to do opens no
//! transaction. At `COMMIT` SQLite appends the changed pages to `-wal` with a
//! commit frame; under `synchronous=FULL` it then fsyncs `-wal` before `COMMIT` returns, under
//! `NORMAL` it does not. [`Spool::defer_wal_sync`] switches a `Full` spool to `NORMAL`, takes
//! the segment's `fdatasync` out of `commit`, and returns a [`WalSync`] that, on another
//! thread, makes every commit that returned before it starts durable while the writer goes
//! on: it `fdatasync`s the segments those commits wrote, which is enough for a commit that
//! appends (its record brings its rows back if the WAL loses them), and fsyncs `-wal` too,
//! beside them on a thread of its own, when a commit without a record needs it (seals on their
//! own) and at least every second or 64 MiB of records (see `walsync.rs`; what open does about
//! rows whose bytes a power cut lost is in `unsynced.rs`, about records whose rows it lost in
//! `journal.rs`). Checkpoints (automatic, every ~1000 WAL pages, and when the last
//! connection closes) copy WAL pages into the main file and fsync both in either mode; the WAL is
//! then reset and kept at most 64 MiB (`journal_size_limit`). Rows are never changed outside
//! such a transaction, so every crash point lands on a committed state.
//!
//! # Durability contract
//!
//! * When [`Spool::append`] returns `Ok` (or [`Spool::commit`] returns `Ok` with
//!   [`CommitReport::appends`] `Ok`), every request reported [`AppendOutcome::Accepted`] is in
//!   a committed transaction. With [`Durability::Full`] (`synchronous=FULL`) the WAL was fsynced
//!   before `COMMIT` returned, so the batches survive a process crash *and* a power cut; after
//!   [`Spool::defer_wal_sync`] that holds once a [`WalSync::sync`] begun after the call has
//!   returned `Ok`, and until then readers do not list the chunks sealed since. Such a sync may
//!   leave the commit's rows in the WAL only, not durable: a power cut then loses them, and the
//!   next [`Spool::open`] adds them back, with the same ids, sequence numbers and bytes, from
//!   the commit record in the payload segment, which the sync did make durable (counted in
//!   [`OpenReport::replayed_records`]). Acks and evictions are not in the records: one that a
//!   power cut rolls back is undone (the chunk is offered again, or kept). With
//!   [`Durability::Normal`] (`synchronous=NORMAL`) they survive a process crash; after a power
//!   cut or OS crash the last transactions (those since the last WAL sync/checkpoint) may be
//!   rolled back, but the database stays consistent.
//! * A request reported [`AppendOutcome::Full`] stored none of its batches; the other requests of
//!   the same call are unaffected. When `append` returns `Err`, the whole call was rolled back and
//!   no request was accepted. When the appends of a [`Spool::commit`] fail, its acks and seals
//!   are committed on their own (with the disk-reserve headroom), and the appends' error is
//!   reported in [`CommitReport::appends`]. (Caveat from SQLite: after an I/O error *during* `COMMIT` the
//!   outcome is unknowable; such a transaction may reappear after a restart.)
//! * Sealing happens inside a transaction together with the `streams.next_seq` and
//!   `sealed_through` bump, so a chunk's id, sequence number and contents never change once
//!   sealed, and a sequence number is never reused, across acks, drops, quarantines and reopens.
//!   The one exception was never visible: after [`Spool::defer_wal_sync`], a chunk sealed over
//!   batches whose bytes a power cut lost before their sync is deleted at open and its sequence
//!   number used again; readers list a chunk only after a sync that covers its bytes, so it
//!   was never sent. Under [`Durability::Normal`] a power cut may roll back a seal too: one made
//!   in a commit that appended nothing (so without a commit record to add it back from) is
//!   listed only after a sync of the WAL that follows it, so a chunk that was sent keeps its
//!   sequence number and contents ([`Spool::seals_wait_for_sync`]). Once such a sync failed,
//!   none later is trusted ([`Spool::wal_sync_failed`]; the agent stops, exit status 74); open
//!   first writes the WAL into the main file again (a truncating checkpoint, which syncs it:
//!   after a write-back that failed, the WAL's pages may be clean in the cache and not on
//!   disk, and a sync would write nothing), else syncs the WAL, and fails if it cannot.
//!   Sealing writes the chunk row and the stream row only; batch rows are written once, at
//!   append.
//! * Rows are deleted only (a) by [`Spool::ack`], chunk and batches in one transaction;
//!   (b) by [`FullPolicy::DropOldest`] eviction inside an `append` transaction, counted in `meta`
//!   in that same transaction; (c) by [`Spool::purge_quarantined`]; (d) at open, after
//!   [`Spool::defer_wal_sync`], the batches from the first whose bytes a power cut lost on (no
//!   producer was answered for them), counted in [`OpenReport::unsynced_records_dropped`].
//!   Reading never deletes.
//! * An ack may be lost in a crash (the process dies before `ack` commits, or a power cut rolls
//!   it back under `Normal`). The chunk is then still in the spool after restart and is offered
//!   again with the same id, stream, seq and bytes. That is safe because the server dedups by
//!   (spool id, stream, seq).
//! * [`Spool::open`] runs `PRAGMA quick_check`. A file that is not a SQLite database, fails the
//!   check, is a SQLite database that is not a spool, has no valid spool id, has stream rows or
//!   meta values that fail their row checksums, or whose header forbids writing (SQLite opens
//!   it read-only although the file may be written), is moved aside (with its `-wal`/`-shm`
//!   and payload segments) as `<path>.corrupt-<unix-seconds>` and replaced by a fresh spool
//!   with a new id, reported in [`OpenReport::quarantined`]. Then `integrity_check` of
//!   `streams`, `chunks` and `batches` compares their indexes with their rows (`quick_check`
//!   does not), and an index that disagrees is rebuilt (`REINDEX`). A batch row of no stream
//!   (a damaged `stream_id`) is logged and left in place: nothing can reach it. We prefer that over refusing to
//!   start: an agent wedged on a bad file loses *all* data from then on, while the quarantined
//!   file stays available for offline recovery. A file from a newer schema version is *not*
//!   moved; `open` fails with [`SpoolError::UnsupportedSchema`] (a downgrade must not destroy
//!   data).
//! * A full file system (`ENOSPC` → `SQLITE_FULL` → [`SpoolError::DiskFull`]) fails the call
//!   with nothing stored, like any error. Writes that free space (ack, quarantine, purge) and
//!   sealing must not wedge on it, yet in WAL mode they need WAL space and a checkpoint that may
//!   grow the main file: a ballast file `<path>-reserve` ([`SpoolOptions::disk_reserve_bytes`])
//!   is deleted for them, the WAL checkpointed and truncated, and the call retried once. Appends
//!   are refused while the ballast cannot be written back (see `reserve.rs`). A segment write
//!   that fails with `ENOSPC` is [`SpoolError::DiskFull`] too; the segment is then retired
//!   (no longer written to), so it is deleted, and its space returned, once its chunks are
//!   acked.
//! * Every batch carries a CRC-32C; [`SpoolReader::read`] fails with [`SpoolError::Corrupt`] on a
//!   mismatch instead of serving bad bytes. [`SpoolReader::read_payload`] also returns the
//!   payload's CRC-32C, computed while the verified batches are concatenated. The caller then
//!   calls [`Spool::quarantine`]: the chunk stays on disk for inspection, is never offered again
//!   and no longer counts against `max_bytes`.
//!
//! # Invariants
//!
//! * A batch is either open (`id > sealed_through` of its stream) or lies in the range of exactly
//!   one chunk of its stream; the ranges of a stream's chunks do not overlap and all lie at or
//!   below its `sealed_through`.
//! * A chunk's `records`, `bytes` and `first_ms` equal the sum/sum/minimum over its batches.
//! * For every stream, the chunks ever sealed carry exactly the seqs `1..next_seq`, each once.
//! * Chunk ids increase strictly in sealing order and are never reused.
//! * After every public call, whether it returned `Ok` or `Err`, the in-memory counters behind
//!   [`Spool::stats`] equal the aggregates on disk (the working copy is swapped in only after
//!   `COMMIT` succeeded).
//! * After every accepted request, stored bytes (open + sealed, quarantine excluded) are
//!   `<= max_bytes`, unless `max_bytes` was lowered at run time by [`Spool::set_limits`] (that
//!   evicts nothing by itself).
//!
//! # Codemap
//!
//! * `lib.rs`: this contract and the public value types.
//! * `error.rs`: [`SpoolError`].
//! * `schema.rs`: DDL, pragmas, `user_version` migrations (versions 1 to 2 to 3 to 4).
//! * `rowcrc.rs`: the row checksums of version 3 (and the location columns of version 4).
//! * `journal.rs`: the commit records in the payload segments, and their replay at open.
//! * `segment.rs`: payload segment files: the writer's active segment, deletion, the sweep at
//!   open, reading.
//! * `lock.rs`: the one-writer lock on `<path>-lock`.
//! * `recovery.rs`: opening a file, quick check, quarantine of a bad file.
//! * `check.rs`: [`check`], the read-only audit behind `edge-uploader spool check`.
//! * `salvage.rs`: [`export_quarantined`], the records of the quarantined chunks, read-only,
//!   behind `edge-uploader spool export-quarantined`.
//! * `reserve.rs`: the disk reserve that keeps acks working on a full file system.
//! * `walsync.rs`: [`WalSync`], the WAL's sync off the commit path, and the watermark readers
//!   list chunks up to.
//! * `state.rs`: the in-memory counters.
//! * `spool.rs`: the writer [`Spool`].
//! * `reader.rs`: [`SpoolReader`].

/// A crash point for the reliability tests: in a build with the `failpoints` feature, a process
/// started with `FAILPOINTS=<name>=return` aborts here (as a power cut or SIGKILL would stop it).
/// Without the feature it compiles to nothing.
macro_rules! crash_point {
    ($name:literal) => {
        #[cfg(feature = "failpoints")]
        if fail::eval($name, |_| ()).is_some() {
            eprintln!(concat!("failpoint ", $name, ": crashing the process"));
            std::process::abort();
        }
    };
}
pub(crate) use crash_point;

mod check;
mod crc;
mod error;
mod host;
mod journal;
mod lock;
mod reader;
mod recovery;
mod reserve;
mod rowcrc;
mod salvage;
mod schema;
mod segment;
mod spool;
mod state;
mod unsynced;
mod walsync;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

pub use check::{CheckReport, DamagedBatch, DamagedChunk, LostTail, Replayable, check};
pub use error::SpoolError;
pub use host::HostCheck;
pub use reader::SpoolReader;
pub use salvage::{ExportError, OnBatch, Salvage, SalvagedChunk, Selection, export_quarantined};
pub use segment::disk_usage;
pub use spool::Spool;
pub use state::Snapshot;
pub use walsync::WalSync;

/// The identity of one spool file, 16 random bytes drawn when the file is created.
///
/// `Display` gives 32 lowercase hex characters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpoolId(pub [u8; 16]);

impl SpoolId {
    /// A fresh random identity.
    pub fn random() -> Self {
        SpoolId(rand::random())
    }
}

impl fmt::Display for SpoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// How hard `COMMIT` works before it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Durability {
    /// `synchronous=FULL`: every commit is durable before anyone acts on it (the WAL fsynced by
    /// `COMMIT` itself, or the commit made durable by a [`WalSync`] after
    /// [`Spool::defer_wal_sync`]); survives power cuts.
    #[default]
    Full,
    /// `synchronous=NORMAL`: survives process crashes; a power cut may roll back the last commits.
    Normal,
}

/// What [`Spool::append`] does with a request that does not fit under `max_bytes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum FullPolicy {
    /// Refuse the request ([`AppendOutcome::Full`]); nothing already stored is touched.
    #[default]
    Reject,
    /// Delete the oldest sealed chunks (counted in [`SpoolStats::dropped_chunks`] and
    /// [`SpoolStats::dropped_records`]) until the request fits.
    DropOldest,
}

/// Settings of a spool. Build with [`SpoolOptions::new`] and adjust the fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpoolOptions {
    /// The database file; its parent directory is created if missing.
    pub path: PathBuf,
    /// Whether a commit survives a power cut (see [`Durability`]).
    pub durability: Durability,
    /// Cap on stored payload bytes (sum of batch data lengths, sealed and open, quarantine
    /// excluded). SQLite overhead (pages, indexes, WAL) comes on top.
    pub max_bytes: u64,
    /// What to do with a request that does not fit.
    pub full_policy: FullPolicy,
    /// A stream's open batches are sealed into a chunk once they reach this many bytes.
    pub chunk_target_bytes: u64,
    /// ... and before a batch that would take the chunk past this many records: the ingest
    /// refuses a chunk of more (`edge_proto::Limits::max_records_per_chunk`, 2^20), and a chunk
    /// it refuses would be sent again on every connection. A single batch must not hold more.
    pub chunk_max_records: u32,
    /// ... or once the oldest open batch is at least this old (see [`Spool::seal_due`]).
    pub linger: Duration,
    /// Size of the disk reserve `<path>-reserve`: a ballast file deleted when the file system
    /// is full, so acks and seals (which need WAL space too) can still commit and free space.
    /// Appends are refused while it cannot be written back. 0 disables it.
    pub disk_reserve_bytes: u64,
    /// Payload segment files (`<path>-seg-<id>`) are started anew once the active one holds
    /// this many bytes; a segment is deleted when no chunk in it is left. Smaller segments give
    /// disk space back sooner when streams drain at different speeds; larger ones mean fewer
    /// files.
    pub segment_target_bytes: u64,
    /// Streams the spool may know. A spool never forgets a stream (its sequence numbers go on,
    /// and the ingest deduplicates by them), and each costs memory for as long as the spool
    /// lives: a request that names a stream past this many is refused
    /// ([`AppendOutcome::TooManyStreams`]), so that a producer naming a new stream per record
    /// finds out at once instead of growing the agent without bound. Streams known already
    /// stay usable whatever it is lowered to.
    pub max_streams: u64,
    /// The identity of the machine the spool runs on (the agent passes `/etc/machine-id`), or
    /// `None` to check nothing. A file last opened on a machine with another identity is a
    /// copy (a cloned disk image): [`Spool::open`] gives it a new [`SpoolId`] before anything
    /// is sent, so that its records cannot collide with those of the machine it was copied
    /// from at the ingest ([`HostCheck::Moved`]; `host.rs`).
    pub host_id: Option<String>,
}

/// Default of [`SpoolOptions::max_streams`]: far above a gateway's sensors, and about 4 MiB of
/// the agent's memory when all are used (about 0.4 KiB a stream: `edge-bench spool --streams`,
/// BENCHMARKS.md).
pub const DEFAULT_MAX_STREAMS: u64 = 10_000;

impl SpoolOptions {
    /// Defaults: [`Durability::Full`], 1 GiB, [`FullPolicy::Reject`], 1 MiB chunks of at most
    /// 2^20 records, 50 ms linger,
    /// 8 MiB disk reserve (a checkpoint may have to copy a whole WAL, about 4 MiB between
    /// automatic checkpoints plus the last group commit, into a growing main file), 16 MiB
    /// payload segments.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        SpoolOptions {
            path: path.into(),
            durability: Durability::Full,
            max_bytes: 1 << 30,
            full_policy: FullPolicy::Reject,
            chunk_target_bytes: 1 << 20,
            chunk_max_records: 1 << 20,
            linger: Duration::from_millis(50),
            disk_reserve_bytes: 8 << 20,
            segment_target_bytes: 16 << 20,
            max_streams: DEFAULT_MAX_STREAMS,
            host_id: None,
        }
    }
}

/// Records of one stream from one producer request. `data` is opaque and stored unchanged:
/// concatenating batches must give a valid chunk payload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Batch {
    /// Stream name.
    pub stream: String,
    /// Already framed records.
    pub data: Vec<u8>,
    /// Number of records in `data`.
    pub records: u32,
}

/// One producer request: all of its batches are stored, or none.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AppendRequest {
    /// The batches, in order.
    pub batches: Vec<Batch>,
}

impl AppendRequest {
    /// Payload bytes of the request.
    pub fn bytes(&self) -> u64 {
        self.batches.iter().map(|b| len_u64(&b.data)).sum()
    }
}

/// The fate of one [`AppendRequest`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AppendOutcome {
    /// Committed at the configured durability.
    Accepted,
    /// Did not fit under `max_bytes`; none of its batches was stored.
    Full,
    /// Named a stream the spool does not know while it knows `max_streams` already; none of
    /// its batches was stored.
    TooManyStreams,
}

/// Identifies a sealed chunk. Increases strictly in sealing order; never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ChunkId(pub i64);

/// How far the spool's drops ([`FullPolicy::DropOldest`]) are committed and how far durable,
/// as totals of dropped chunks ([`SpoolStats::dropped_chunks`]), shared with the agent
/// ([`Spool::drop_marks`]). A drop is visible to readers at its `COMMIT` but, with deferred
/// syncs ([`Spool::defer_wal_sync`]), durable only once the WAL is synced: evictions are not in
/// the segments' commit records, and a power cut before that sync brings the dropped chunks
/// back. The uploader tells the server that a stream's dropped chunks will never come only when
/// [`all_durable`](DropMarks::all_durable) holds.
#[derive(Debug, Clone, Default)]
pub struct DropMarks(std::sync::Arc<DropMarksInner>);

#[derive(Debug, Default)]
struct DropMarksInner {
    committing: std::sync::atomic::AtomicU64,
    durable: std::sync::atomic::AtomicU64,
}

impl DropMarks {
    /// Both marks at `total`: the state of a spool just opened and synced.
    fn at(total: u64) -> Self {
        let m = Self::default();
        m.0.committing.store(total, std::sync::atomic::Ordering::SeqCst);
        m.0.durable.store(total, std::sync::atomic::Ordering::SeqCst);
        m
    }

    /// The spool, before the `COMMIT` of a transaction that drops chunks: the total after it.
    fn committing(&self, total: u64) {
        self.0.committing.fetch_max(total, std::sync::atomic::Ordering::SeqCst);
    }

    /// The spool, after a writer transaction failed: its drops were never visible, and the
    /// mark goes back to `total`, the total committed before it (the spool's thread is the one
    /// that raises it). Left high, it withheld every floor until the next drop reached it.
    fn rolled_back(&self, total: u64) {
        self.0.committing.store(total, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whoever makes commits durable: the commits up to the one that left `total` dropped
    /// chunks are durable now.
    pub fn durable(&self, total: u64) {
        self.0.durable.fetch_max(total, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether every drop a reader may have seen is durable.
    pub fn all_durable(&self) -> bool {
        // `committing` first: it is raised before a drop is visible, and `durable` only grows.
        let committing = self.0.committing.load(std::sync::atomic::Ordering::SeqCst);
        committing <= self.0.durable.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// The chunks an uploader has sent and not yet seen answered, told to the spool
/// ([`Spool::chunks_in_flight`]). Under [`FullPolicy::DropOldest`] the spool evicts the oldest
/// chunk that is *not* among them first: one on its way is likely stored by the server already,
/// and deleting it would free no bandwidth, count as lost records that were delivered, and make
/// its ack find nothing. Only when every chunk is in flight is one of them evicted.
#[derive(Debug, Clone, Default)]
pub struct ChunksInFlight(std::sync::Arc<std::sync::Mutex<Vec<i64>>>);

impl ChunksInFlight {
    /// Replaces the set.
    pub fn set(&self, ids: impl IntoIterator<Item = ChunkId>) {
        let mut v = self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        v.clear();
        v.extend(ids.into_iter().map(|c| c.0));
        v.sort_unstable();
    }

    /// Whether `id` is in the set.
    pub fn contains(&self, id: ChunkId) -> bool {
        self.snapshot().binary_search(&id.0).is_ok()
    }

    /// The ids now, sorted.
    pub(crate) fn snapshot(&self) -> Vec<i64> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl fmt::Display for ChunkId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Metadata of a sealed chunk.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkMeta {
    /// Row id; sealing order.
    pub id: ChunkId,
    /// Stream name.
    pub stream: String,
    /// Per-stream sequence number, gapless from 1 in sealing order.
    pub seq: u64,
    /// Records in the chunk.
    pub records: u32,
    /// Payload bytes (sum of its batches' data lengths).
    pub bytes: u64,
    /// Commit time (unix ms as passed to `append`) of its oldest batch.
    pub first_ms: u64,
    /// Time (unix ms as passed in) it was sealed.
    pub sealed_ms: u64,
}

/// A chunk's payload as [`SpoolReader::read_payload`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkPayload {
    /// The batches' data, concatenated in append order.
    pub data: Vec<u8>,
    /// CRC-32C of `data`, computed while the verified batches were concatenated.
    pub crc32c: u32,
}

impl ChunkPayload {
    /// Payload bytes.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True for an empty payload.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }
}

/// What [`Spool::open`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenReport {
    /// A new spool (new [`SpoolId`]) was created: the file was missing, empty, or quarantined.
    pub created: bool,
    /// Where a corrupt file was moved to, if one was.
    pub quarantined: Option<PathBuf>,
    /// Open (not yet sealed) batch rows found: one per stream per commit that appended to it.
    pub open_batches: u64,
    /// Sealed, not quarantined chunks found (they will be offered again).
    pub sealed_chunks: u64,
    /// Records whose payload bytes a power cut lost before their deferred sync, dropped at
    /// open (see [`Spool::defer_wal_sync`]). No producer was answered for them.
    pub unsynced_records_dropped: u64,
    /// Records whose index rows a power cut lost before the WAL's sync, added back at open from
    /// the commit records in the payload segments (see [`Spool::defer_wal_sync`]).
    pub replayed_records: u64,
    /// What open found of the machine the file belongs to (see [`SpoolOptions::host_id`]).
    pub host: HostCheck,
}

/// Result of [`Spool::ack`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AckReport {
    /// Chunks deleted.
    pub acked: u32,
    /// Ids not found (already acked, dropped, quarantined, or never existed).
    pub unknown: u32,
}

/// Which streams [`Spool::commit`] seals after its appends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SealWhat {
    /// None (streams still seal by size during the appends).
    #[default]
    Nothing,
    /// Those whose linger expired, as [`Spool::seal_due`].
    Due,
    /// Every stream with open batches, as [`Spool::seal_all`].
    All,
}

/// What [`Spool::commit`] did, all of it in one committed transaction.
#[derive(Debug)]
pub struct CommitReport {
    /// One outcome per append request, in order; or the error that kept every request out
    /// (the acks and seals were then committed without them).
    pub appends: Result<Vec<AppendOutcome>, SpoolError>,
    /// The acks.
    pub acks: AckReport,
    /// Chunks sealed by the call, in sealing (and id) order: by size during the appends, and by
    /// `seal`. Not a net change: the acks of the same call may have deleted as many chunks.
    /// Each chunk is exactly the open batches its stream had when it was sealed.
    pub sealed: Vec<ChunkMeta>,
}

/// Counters of the spool, kept in memory and true to disk after every call.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SpoolStats {
    /// Sealed chunks waiting for an ack (quarantine excluded).
    pub sealed_chunks: u64,
    /// Payload bytes of those chunks.
    pub sealed_bytes: u64,
    /// Payload bytes of open batches.
    pub open_bytes: u64,
    /// Records in open batches.
    pub open_records: u64,
    /// `sealed_bytes + open_bytes`: what counts against `max_bytes`.
    pub total_bytes: u64,
    /// Commit time of the oldest stored batch (quarantine excluded).
    pub oldest_ms: Option<u64>,
    /// Records evicted by [`FullPolicy::DropOldest`], ever (durable).
    pub dropped_records: u64,
    /// Chunks evicted by [`FullPolicy::DropOldest`], ever (durable).
    pub dropped_chunks: u64,
    /// Chunks currently held in quarantine.
    pub quarantined_chunks: u64,
    /// Every stream ever seen, by name.
    pub streams: Vec<StreamStats>,
}

/// Per-stream part of [`SpoolStats`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamStats {
    /// Stream name.
    pub name: String,
    /// Sequence number the next sealed chunk of this stream gets.
    pub next_seq: u64,
    /// Sealed chunks waiting for an ack.
    pub sealed_chunks: u64,
    /// Payload bytes stored for the stream (open + sealed, quarantine excluded).
    pub bytes: u64,
    /// Commit time of the stream's oldest stored batch.
    pub oldest_ms: Option<u64>,
}

/// A chunk held in quarantine, as listed by [`SpoolReader::quarantined`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuarantinedChunk {
    /// The chunk.
    pub meta: ChunkMeta,
    /// The reason given to [`Spool::quarantine`].
    pub reason: String,
}

/// Length of a byte slice as u64 (lossless on every supported target).
pub(crate) fn len_u64(data: &[u8]) -> u64 {
    data.len() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spool_id_displays_as_32_lowercase_hex_chars() {
        let id =
            SpoolId([0x00, 0x01, 0xab, 0xcd, 0xef, 0x10, 0x20, 0x30, 0x40, 0x50, 0x60, 0x70, 0x80, 0x90, 0xa0, 0xff]);
        assert_eq!(id.to_string(), "0001abcdef102030405060708090a0ff");
        assert_eq!(id.to_string().len(), 32);
    }

    #[test]
    fn random_spool_ids_differ() {
        assert_ne!(SpoolId::random(), SpoolId::random());
    }

    #[test]
    fn options_defaults_match_the_documented_values() {
        let o = SpoolOptions::new("/x/spool.db");
        assert_eq!(o.durability, Durability::Full);
        assert_eq!(o.max_bytes, 1 << 30);
        assert_eq!(o.full_policy, FullPolicy::Reject);
        assert_eq!(o.chunk_target_bytes, 1 << 20);
        assert_eq!(o.linger, Duration::from_millis(50));
    }
}
