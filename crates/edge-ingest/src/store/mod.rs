//! Durable chunk store: the default file sink of the ingest server.
//!
//! A [`Store`] appends every new chunk to a segment file, deduplicates by
//! [`ChunkKey`] `(device, spool, stream, seq)` and says [`PersistOutcome::Stored`] only once the
//! bytes are on stable storage. Chunks are written in group commits: one write and one
//! `fdatasync` for a whole batch, which [`StoreHandle`] fills from every connection at once.
//! The commit's whole 4 KiB blocks go past the page cache (`O_DIRECT`, from one reused aligned
//! buffer; see `direct`), its partial last block through it, so the file always ends exactly
//! where the last commit does. Where the file system refuses `O_DIRECT`, or with
//! [`StoreOptions::direct_writes`] off, the whole commit goes through the page cache, whose
//! committed pages are then dropped (`posix_fadvise(DONTNEED)`, all but the partial last one):
//! nothing in the server reads them back, and their freed pages are what the next commits
//! write into. The active segment's disk blocks are reserved up to 16 MiB
//! ahead of its writes (`fallocate(FALLOC_FL_KEEP_SIZE)`, where the file system can), which
//! leaves its length alone; what is reserved past its end is given back when it is rolled, or
//! at open when it will not be appended to again.
//! [`export`] reads the chunks back, also while a server runs on the same directory.
//!
//! # On-disk layout
//!
//! ```text
//! <data_dir>/LOCK                                   flock'ed by the open Store (empty file)
//! <data_dir>/segments/00000000000000000001.seg      segments, numbered from 1, never reused
//! ```
//!
//! All integers are little-endian. CRCs are CRC32C (Castagnoli).
//!
//! A segment is empty (0 bytes; nothing was written yet) or starts with a 64-byte header made of
//! two identical 32-byte copies, so one damaged copy does not lose the segment:
//!
//! | offset | size | field                                               |
//! |-------:|-----:|-----------------------------------------------------|
//! | 0      | 8    | magic `"EDGSEG\0\x01"` (format version 1)           |
//! | 8      | 8    | segment number (same as the file name)              |
//! | 16     | 8    | salt: random, seeds every entry header CRC          |
//! | 24     | 4    | CRC of bytes 0..24                                  |
//! | 28     | 4    | zero                                                |
//!
//! Entries follow back to back. Each is a header and the payload as received on the wire:
//!
//! | offset    | size | field                                                        |
//! |----------:|-----:|--------------------------------------------------------------|
//! | 0         | 8    | magic `ED 'G' 'E' 'C' 'H' 'N' 'K' 01`                        |
//! | 8         | 4    | `B`: length of the body that follows (77 + names)            |
//! | 12        | 8    | commit: id of the group commit that wrote the entry          |
//! | 20        | 8    | prev_commit: newest commit known durable at that time (0: none) |
//! | 28        | 16   | spool id                                                     |
//! | 44        | 8    | seq                                                          |
//! | 52        | 4    | records                                                      |
//! | 56        | 1    | codec (`edge_proto::Codec`: 0 none, 1 zstd)                  |
//! | 57        | 4    | raw_len: payload size once decoded                           |
//! | 61        | 4    | payload_len `P`                                              |
//! | 65        | 4    | payload CRC (the wire checksum)                              |
//! | 69        | 8    | created_ms (agent clock)                                     |
//! | 77        | 8    | stored_ms (server clock)                                     |
//! | 85        | 2    | device length `D` (at most 4096)                             |
//! | 87        | 2    | stream length `S` (at most 4096)                             |
//! | 89        | D+S  | device id, then stream name (UTF-8)                          |
//! | 12 + B    | 4    | header CRC of bytes `0 .. 12+B`, seeded with the segment salt |
//! | 16 + B    | P    | payload                                                      |
//!
//! The salt keeps bytes that a device placed inside a payload from ever passing as a header when
//! recovery scans for the magic after damage.
//!
//! # Durability contract
//!
//! - When [`Store::persist`] returns `Stored` for a chunk, its entry was written, the segment was
//!   `fdatasync`ed after the write, and if the commit created the segment the `segments`
//!   directory was fsynced too: entry and directory entry are on stable storage. The key enters
//!   the dedup index only after that, so `Duplicate` also means "durable".
//! - A commit is one write (direct writes of its whole blocks and an ordinary one of its
//!   partial last block, see `direct`) and one `fdatasync` on one segment. A batch takes two commits only
//!   when it crosses a segment roll (each at most `segment_max_bytes`, except that a single chunk
//!   larger than that gets a segment of its own).
//! - A write or fsync error fails every chunk of that commit and of the rest of the batch
//!   (`Failed`, never `Stored`). The segment is truncated back to its last durable length (a
//!   segment created by the commit is removed), best effort, and the next commit starts a new
//!   segment with a new file descriptor: after a failed fsync the page cache cannot be trusted.
//!   Should those bytes stay on disk anyway, the next commit's `prev_commit` marks the failed
//!   commit, and recovery and export ignore its entries. `ENOSPC`/`EDQUOT` map to
//!   [`StoreFailure::DiskFull`], `EROFS` to [`StoreFailure::ReadOnly`]. The store keeps serving.
//! - [`Store::open`] scans every entry header and seeks over the payloads. It verifies the
//!   payload CRC of the entries of the newest commit only, the one commit that may have been in
//!   flight when the process or the power stopped; older commits were fsynced before anything
//!   after them was written.
//! - Torn tail: a tail of the last segment that holds no valid entry (a header cut short, a
//!   header whose payload runs past the end of the file, garbage) is truncated, as are bad
//!   entries at the end of the newest commit. None of it was ever acked.
//! - Corrupt middle: bytes that do not parse are skipped by scanning forward for the next magic
//!   whose header CRC checks, so valid entries after them are kept. The region is counted and
//!   logged, never deleted. A bad entry of the newest commit that is followed by good ones has
//!   its magic zeroed so that later scans treat it as such a region.
//! - Corrupt entries never count as stored: they are not in the dedup index (a resend is stored
//!   again) and [`export`] never returns them.
//! - Before serving, open fsyncs every segment and both directories, so a chunk that survived a
//!   process crash only in the page cache cannot be answered `Duplicate` and then lost to a
//!   power cut.
//! - Limits: bit rot in the payload of an older entry is found by [`export`] (skipped and
//!   counted), not at open; its key stays in the index. If the process dies after an fsync
//!   error but before any later commit, the failed commit is the newest one at restart; when
//!   its bytes read back intact they are kept (and fsynced again at open), although the kernel
//!   may already have dropped them from the disk's view (the "fsyncgate" window).
//!
//! # Codemap
//!
//! - `format`: the byte layout above (the only code that encodes or decodes it).
//! - `index`: the in-memory dedup index.
//! - `scan`: reading segments back, resync after damage, the commit chain.
//! - `writer`: [`Store`] (open, recovery, group commit).
//! - `direct`: a commit's bytes written past the page cache.
//! - `handle`: [`StoreHandle`], the thread that owns the store and batches requests.
//! - `export`: [`export`].

mod direct;
mod export;
pub mod format;
mod handle;
mod index;
mod scan;
mod writer;

use std::io;
use std::path::PathBuf;

use bytes::Bytes;
use edge_proto::Codec;

pub use export::{ExportFilter, ExportReport, ExportedChunk, export};
pub(crate) use handle::StatsCell;
pub use handle::{BatchLimits, StoreHandle, StoreStatsView};
pub use writer::Store;

/// Default size at which a segment is rolled: 256 MiB.
pub const DEFAULT_SEGMENT_MAX_BYTES: u64 = 256 << 20;

/// Default of [`StoreOptions::max_index_gaps_per_device`]. The gaps an agent's parallel
/// uploads leave close as its chunks arrive; each run of chunks a full spool dropped leaves one
/// for good. 65,536 is far above that, and bounds the ranges one device can make the index hold
/// past one per stream (a range is two `u64`s in a B-tree node).
pub const DEFAULT_MAX_INDEX_GAPS_PER_DEVICE: u64 = 65_536;

/// Default of [`StoreOptions::max_index_streams_per_device`]: ten times what an agent's spool
/// takes by default (`spool.max_streams`, 10,000), for the spools a device goes through
/// (replaced cards, files moved aside, copies on other machines), each with streams of its own.
pub const DEFAULT_MAX_INDEX_STREAMS_PER_DEVICE: u64 = 100_000;

/// How to open a [`Store`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreOptions {
    /// Directory that holds `LOCK` and `segments/`; created if missing.
    pub data_dir: PathBuf,
    /// A new segment is started before an entry would take the current one past this size.
    pub segment_max_bytes: u64,
    /// Write each commit's whole blocks with `O_DIRECT`, past the page cache (the default);
    /// `false` writes everything through it. Where the file system refuses `O_DIRECT`, the
    /// store writes through the page cache whatever this says.
    pub direct_writes: bool,
    /// Gaps one device may make the in-memory dedup index hold, over all of its spools and
    /// streams: ranges of a stream's stored seqs past its first. A chunk that would open one
    /// more (a seq with neither neighbour stored, in a stream that has others) is refused
    /// ([`StoreFailure::IndexFull`], answered "retry later"), while chunks that start a
    /// stream, extend a range or join two are still stored. Counted from what open rebuilt; a
    /// device already past it keeps what it has.
    pub max_index_gaps_per_device: u64,
    /// Streams one device may make the in-memory dedup index hold, over all of its spools: each
    /// costs an entry whatever its seqs. A chunk that would start one more is refused
    /// ([`StoreFailure::TooManyStreams`], answered "retry later"); the device's known streams
    /// are still stored. Counted from what open rebuilt; a device already past it keeps what
    /// it has.
    pub max_index_streams_per_device: u64,
}

impl StoreOptions {
    /// Options with the defaults for everything but the directory.
    pub fn new(data_dir: impl Into<PathBuf>) -> Self {
        Self {
            data_dir: data_dir.into(),
            segment_max_bytes: DEFAULT_SEGMENT_MAX_BYTES,
            direct_writes: true,
            max_index_gaps_per_device: DEFAULT_MAX_INDEX_GAPS_PER_DEVICE,
            max_index_streams_per_device: DEFAULT_MAX_INDEX_STREAMS_PER_DEVICE,
        }
    }
}

/// The dedup key of a chunk.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ChunkKey {
    /// Device identity (from its certificate).
    pub device: String,
    /// Spool id: random per agent spool, so a wiped spool never collides with old seqs.
    pub spool: [u8; 16],
    /// Stream name.
    pub stream: String,
    /// Per-stream sequence number.
    pub seq: u64,
}

/// A chunk as received from an agent, checked by the server, ready to persist.
#[derive(Debug, Clone)]
pub struct IncomingChunk {
    /// Dedup key.
    pub key: ChunkKey,
    /// Records in the payload.
    pub records: u32,
    /// Payload codec.
    pub codec: Codec,
    /// Payload size once decoded.
    pub raw_len: u32,
    /// CRC32C of `payload` as announced by the agent; the store rejects the chunk if the
    /// payload's own ([`Payload::crc32c`]) differs.
    pub checksum: u32,
    /// When the agent created the chunk (ms since the Unix epoch, agent clock).
    pub created_ms: u64,
    /// Payload as received on the wire.
    pub payload: Payload,
}

/// A chunk payload and its CRC-32C, computed once, when the payload is made: whoever holds a
/// `Payload` holds bytes and a checksum that match, so the server's verification and the
/// store's share one pass over the bytes (two passes were 6.6 % of the server's CPU while
/// receiving).
#[derive(Debug, Clone)]
pub struct Payload {
    bytes: Bytes,
    crc32c: u32,
}

impl Payload {
    /// Takes the bytes and computes their CRC-32C.
    pub fn new(bytes: Bytes) -> Self {
        let crc32c = edge_proto::crc32c(&bytes);
        Payload { bytes, crc32c }
    }

    /// The CRC-32C of the bytes.
    pub fn crc32c(&self) -> u32 {
        self.crc32c
    }

    /// The bytes, shared (no copy).
    pub fn to_bytes(&self) -> Bytes {
        self.bytes.clone()
    }
}

impl std::ops::Deref for Payload {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        &self.bytes
    }
}

impl From<Vec<u8>> for Payload {
    fn from(bytes: Vec<u8>) -> Self {
        Payload::new(bytes.into())
    }
}

/// What happened to one chunk of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PersistOutcome {
    /// Written and fsynced by this call.
    Stored,
    /// The key was already durably stored (before or earlier in this batch).
    Duplicate,
    /// Not stored.
    Failed(StoreFailure),
}

impl PersistOutcome {
    /// Whether the chunk is durably stored, i.e. the server may ack it.
    pub fn is_durable(&self) -> bool {
        matches!(self, Self::Stored | Self::Duplicate)
    }
}

/// Why a chunk was not stored. For every variant but [`StoreFailure::Rejected`] the server
/// answers "retry later".
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreFailure {
    /// The disk (or quota) is full: `ENOSPC` or `EDQUOT`.
    #[error("disk full")]
    DiskFull,
    /// Any other I/O error, or the store thread is gone.
    #[error("store I/O error: {0}")]
    Io(String),
    /// The file system is read-only (`EROFS`).
    #[error("file system is read-only")]
    ReadOnly,
    /// The sink is out of reach or refused the write for a reason that may pass (the JetStream
    /// sink: NATS down, no PubAck in time, the stream full). The server answers "retry later".
    #[error("sink unavailable: {0}")]
    Unavailable(String),
    /// The chunk itself can never be stored: its payload does not match its checksum, a name is
    /// longer than 4096 bytes, or the payload is 4 GiB or more. Retrying the same bytes fails
    /// the same way.
    #[error("chunk rejected: {0}")]
    Rejected(String),
    /// Storing the chunk would open a gap past [`StoreOptions::max_index_gaps_per_device`]
    /// in its device's part of the dedup index: neither of its seq's neighbours is stored, in a
    /// stream that has other seqs. The server answers "retry later" (overloaded): the agent
    /// keeps the chunk, and it is stored once a neighbour is, or the cap is raised.
    #[error(
        "the device's dedup index holds {gaps} gaps, store.max_index_gaps_per_device is {max}: a seq with neither neighbour stored is refused"
    )]
    IndexFull {
        /// The device's gaps now.
        gaps: u64,
        /// The cap.
        max: u64,
    },
    /// Storing the chunk would start a stream past [`StoreOptions::max_index_streams_per_device`]
    /// for its device. The server answers "retry later" (overloaded): the agent keeps the
    /// chunk, and it is stored once the cap is raised.
    #[error(
        "the device has {streams} streams in the dedup index, store.max_index_streams_per_device is {max}: a chunk of a new stream is refused"
    )]
    TooManyStreams {
        /// The device's streams now.
        streams: u64,
        /// The cap.
        max: u64,
    },
}

impl StoreFailure {
    /// Classifies an I/O error.
    pub fn from_io(e: &io::Error) -> Self {
        match e.raw_os_error() {
            Some(libc::ENOSPC | libc::EDQUOT) => Self::DiskFull,
            Some(libc::EROFS) => Self::ReadOnly,
            _ => Self::Io(e.to_string()),
        }
    }
}

/// What [`Store::open`] found and repaired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    /// Segment files present (empty and damaged ones included).
    pub segments: u32,
    /// Chunks in the dedup index after recovery.
    pub chunks: u64,
    /// Payload bytes of those chunks.
    pub bytes: u64,
    /// Bytes cut off torn tails.
    pub truncated_bytes: u64,
    /// Damaged places: unparseable regions, entries of the newest commit whose payload CRC
    /// failed, segments whose header is unreadable.
    pub corrupt_entries: u64,
    /// Bytes in unparseable regions and unreadable segments (left on disk).
    pub corrupt_bytes: u64,
    /// Entries left on disk by commits that failed (ignored).
    pub abandoned_entries: u64,
    /// Entries of the newest commit whose payload was read and checked.
    pub verified_entries: u64,
    /// Valid entries whose key was already stored by an earlier entry (the first one counts).
    pub duplicate_entries: u64,
    /// Segments ignored because neither copy of their header is valid.
    pub unreadable_segments: u32,
}

/// Errors opening or reading a store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// An I/O error on a file or directory of the store.
    #[error("I/O error on {}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// Another process (or another `Store` in this one) holds the lock on the data directory.
    #[error("data directory {} is locked by another store", .0.display())]
    Locked(PathBuf),
    /// The [`export`] callback returned an error.
    #[error("export consumer failed: {0}")]
    Sink(#[source] io::Error),
}

/// Counters of a running store.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Chunks stored (recovered at open plus stored since).
    pub chunks: u64,
    /// Payload bytes of those chunks.
    pub bytes: u64,
    /// Segment files in the directory.
    pub segments: u32,
    /// Number of the segment being appended to (0: none yet).
    pub active_segment: u64,
    /// Chunks answered `Duplicate` since open.
    pub duplicates: u64,
    /// Chunks answered `Stored` since open.
    pub stored: u64,
    /// Chunks answered `Failed` since open (rejections included).
    pub failed: u64,
    /// Calls to [`Store::persist`] (batches).
    pub batches: u64,
    /// Commits that succeeded.
    pub commits: u64,
    /// Commits that failed.
    pub failed_commits: u64,
    /// `fdatasync` calls on segment files by persist (the group-commit figure).
    pub fsyncs: u64,
    /// fsync calls on the segments directory by persist.
    pub dir_fsyncs: u64,
    /// Bytes persist wrote to segments with `O_DIRECT`, past the page cache (the start of a
    /// commit's first block, written again, included).
    pub direct_bytes: u64,
    /// `(device, spool, stream)` triples in the dedup index.
    pub streams: u64,
    /// Seq ranges in the dedup index (1 per gapless stream).
    pub index_ranges: u64,
    /// Chunks refused since open because their device's part of the dedup index is full: of
    /// gaps ([`StoreFailure::IndexFull`]) or of streams ([`StoreFailure::TooManyStreams`]);
    /// counted in `failed` too.
    pub index_refused: u64,
    /// Agents' floors that changed the dedup index since open (a `Floor` frame: no seq of the
    /// stream below it will come as new data any more).
    pub index_floors: u64,
    /// The failure of the most recent commit, `None` once a commit succeeds again.
    pub last_failure: Option<StoreFailure>,
    /// Requests waiting for the store thread (filled by [`StoreHandle::stats`] only).
    pub queued: u64,
    /// How long the store thread has been in its current batch (writes and fsyncs); `None`
    /// while it waits for work, and for a sink without a store thread (filled by
    /// [`StoreHandle::stats`] only).
    pub busy: Option<std::time::Duration>,
}
