//! [`Store`]: open with recovery, and group-commit persist.
//!
//! The contract is written in the parent module; this file implements it. The order of
//! operations in [`Store::persist`] is the durability argument: dedup check, one write, one
//! `fdatasync` (plus the directory fsync for a new segment), and only then the index update.

use std::collections::hash_map::{Entry, RandomState};
use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::hash::BuildHasher;
use std::io::{self, IoSlice, Seek, SeekFrom, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use super::direct::{self, DirectBuf};
use super::format::{self, EntryFields, LOCK_FILE, MAX_NAME_LEN, SEGMENT_HEADER_LEN, SEGMENTS_DIR, SegmentHeader};
use super::index::DedupIndex;
use super::scan::{self, CommitResolver, EntryMeta, Reader, SegmentHead};
use super::{
    ChunkKey, IncomingChunk, PersistOutcome, RecoveryReport, StoreError, StoreFailure, StoreOptions, StoreStats,
};

/// The file sink: owns the data directory (under an exclusive lock) while open.
///
/// Single-threaded by design: one writer, batches in, outcomes out. Share it through
/// [`super::StoreHandle`].
#[derive(Debug)]
pub struct Store {
    opts: StoreOptions,
    segments_dir: PathBuf,
    /// The `segments` directory, kept open for fsync.
    dir: File,
    /// Holds the flock for as long as the store lives.
    _lock: File,
    active: Option<ActiveSegment>,
    next_segment: u64,
    next_commit: u64,
    /// Newest commit known durable; written into every entry as `prev_commit`.
    last_good_commit: u64,
    index: DedupIndex,
    stats: StoreStats,
    /// Whether segments are written with `O_DIRECT` ([`direct`]): from the options, and
    /// turned off for good when the file system refuses it.
    direct: bool,
    /// The aligned buffer of the direct writes, made at the first one.
    direct_buf: Option<DirectBuf>,
    /// Devices refused for a full dedup index since open: each is logged the first time only.
    index_full_devices: HashSet<String>,
    /// Devices logged at their cap on streams (once per device until restart).
    streams_full_devices: HashSet<String>,
    pub(super) faults: Faults,
}

/// The segment being appended to.
#[derive(Debug)]
struct ActiveSegment {
    number: u64,
    path: PathBuf,
    file: File,
    /// The same file opened with `O_DIRECT`, when the store writes direct and the file system
    /// lets it.
    direct: Option<File>,
    salt: u64,
    /// Bytes written and fsynced (the file has exactly this length between commits).
    len: u64,
    /// Created by this process and its directory entry not yet fsynced.
    created: bool,
    /// Disk blocks are reserved up to here, past `len` (see [`reserve_ahead`]); `u64::MAX`
    /// once the file system refused, so this segment is not asked again.
    reserved: u64,
}

/// An entry to write: index into the batch, and its payload CRC.
#[derive(Debug, Clone, Copy)]
struct Planned {
    idx: usize,
    crc: u32,
    len: u64,
}

impl Store {
    /// Opens (creating if needed) the store in `opts.data_dir`, recovers it and rebuilds the
    /// dedup index.
    ///
    /// Takes an exclusive `flock` on `<data_dir>/LOCK` ([`StoreError::Locked`] if held), scans
    /// all segments, truncates a torn tail, verifies the newest commit, then fsyncs every
    /// segment and the directories before returning.
    pub fn open(opts: StoreOptions) -> Result<(Store, RecoveryReport), StoreError> {
        let data_dir = opts.data_dir.clone();
        create_dir_all_synced(&data_dir)?;
        let lock = lock_data_dir(&data_dir)?;
        let segments_dir = data_dir.join(SEGMENTS_DIR);
        match fs::create_dir(&segments_dir) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(io_at(&segments_dir)(e)),
        }
        let listing = scan::list_segments(&segments_dir)?;
        let mut rec = Recovery::default();
        let mut segs: Vec<OpenSegment> = Vec::with_capacity(listing.len());
        let mut resolver = CommitResolver::<(usize, EntryMeta)>::default();
        let last_idx = listing.len().checked_sub(1);

        for (idx, (number, path)) in listing.into_iter().enumerate() {
            let file = OpenOptions::new().read(true).write(true).open(&path).map_err(io_at(&path))?;
            let len = file.metadata().map_err(io_at(&path))?.len();
            let mut seg = OpenSegment { number, path, file: None, len, salt: None, cut: None };
            let mut reader = Reader::new(&file, len);
            match scan::read_segment_head(&mut reader).map_err(io_at(&seg.path))? {
                SegmentHead::Empty => {}
                SegmentHead::Invalid if Some(idx) == last_idx && len <= SEGMENT_HEADER_LEN => {
                    tracing::warn!(path = %seg.path.display(), len, "segment header torn at creation; truncating");
                    seg.cut = Some(0);
                }
                SegmentHead::Invalid => {
                    tracing::error!(path = %seg.path.display(), len, "segment header unreadable; segment ignored and left in place");
                    rec.report.unreadable_segments += 1;
                    rec.report.corrupt_entries += 1;
                    rec.report.corrupt_bytes += len;
                }
                SegmentHead::Valid(h) => {
                    if h.number != number {
                        tracing::warn!(path = %seg.path.display(), header_number = h.number, "segment header number differs from file name");
                    }
                    seg.salt = Some(h.salt);
                    let summary = scan::scan_entries(&mut reader, h.salt, |meta| {
                        let (c, p) = (meta.header.fields.commit, meta.header.fields.prev_commit);
                        resolver.push(c, p, (idx, meta), &mut |(_, m): (usize, EntryMeta)| rec.accept(&m));
                    })
                    .map_err(io_at(&seg.path))?;
                    for &(start, end) in &summary.corrupt {
                        tracing::error!(path = %seg.path.display(), start, end, "corrupt region skipped");
                    }
                    rec.report.corrupt_entries += summary.corrupt.len() as u64;
                    rec.report.corrupt_bytes += summary.corrupt_bytes();
                    if let Some(tail) = summary.tail {
                        if Some(idx) == last_idx {
                            seg.cut = Some(tail);
                        } else {
                            tracing::error!(path = %seg.path.display(), start = tail, end = len, "unparseable tail in an older segment; left in place");
                            rec.report.corrupt_entries += 1;
                            rec.report.corrupt_bytes += len - tail;
                        }
                    }
                }
            }
            if Some(idx) == last_idx {
                seg.file = Some(file);
            } else {
                // Made durable now and closed, so a store of thousands of segments does not
                // hold thousands of descriptors; the newest commit's segment is reopened below
                // if it needs repair.
                file.sync_data().map_err(io_at(&seg.path))?;
            }
            segs.push(seg);
        }

        rec.report.abandoned_entries = resolver.abandoned();
        let max_commit = resolver.max_commit();
        rec.settle_newest(resolver.into_unconfirmed(), &mut segs)?;

        for seg in &mut segs {
            if let Some(cut) = seg.cut.filter(|&c| c < seg.len) {
                tracing::warn!(path = %seg.path.display(), from = cut, bytes = seg.len - cut, "truncating torn tail");
                seg.file()?.set_len(cut).map_err(io_at(&seg.path))?;
                rec.report.truncated_bytes += seg.len - cut;
                seg.len = cut;
            }
            // The last segment, and any segment repaired above.
            if let Some(file) = &seg.file {
                file.sync_data().map_err(io_at(&seg.path))?;
            }
        }
        File::open(&segments_dir).and_then(|d| d.sync_all()).map_err(io_at(&segments_dir))?;
        // At every open, not only when `segments/` was created now: a run that created it may
        // have stopped before it synced the name.
        File::open(&data_dir).and_then(|d| d.sync_all()).map_err(io_at(&data_dir))?;
        let dir = File::open(&segments_dir).map_err(io_at(&segments_dir))?;

        let next_segment = segs.last().map_or(1, |s| s.number + 1);
        let segment_count = segs.len();
        let active = segs.pop().and_then(|s| s.into_active(opts.segment_max_bytes, opts.direct_writes));

        let mut report = rec.report;
        report.segments = u32::try_from(segment_count).unwrap_or(u32::MAX);
        report.chunks = rec.index.chunks();
        report.bytes = rec.bytes;
        tracing::info!(
            dir = %data_dir.display(),
            segments = report.segments,
            chunks = report.chunks,
            bytes = report.bytes,
            truncated_bytes = report.truncated_bytes,
            corrupt_entries = report.corrupt_entries,
            abandoned_entries = report.abandoned_entries,
            "store recovered"
        );

        let stats = StoreStats {
            chunks: report.chunks,
            bytes: report.bytes,
            segments: report.segments,
            active_segment: active.as_ref().map_or(0, |a| a.number),
            streams: rec.index.streams(),
            index_ranges: rec.index.ranges(),
            ..StoreStats::default()
        };
        let direct = opts.direct_writes;
        let store = Store {
            opts,
            segments_dir,
            dir,
            _lock: lock,
            active,
            next_segment,
            next_commit: max_commit.max(rec.max_indexed_commit) + 1,
            last_good_commit: rec.max_indexed_commit,
            index: rec.index,
            stats,
            direct,
            direct_buf: None,
            index_full_devices: HashSet::new(),
            streams_full_devices: HashSet::new(),
            faults: Faults::new(),
        };
        Ok((store, report))
    }

    /// Persists a batch: dedups (against the store and within the batch), appends every new
    /// chunk in one commit (two if the batch crosses a segment roll), fsyncs, then marks the
    /// keys stored. Returns one outcome per chunk, in input order.
    pub fn persist(&mut self, batch: Vec<IncomingChunk>) -> Vec<PersistOutcome> {
        self.stats.batches += 1;
        let mut outcomes: Vec<Option<PersistOutcome>> = vec![None; batch.len()];
        let mut first_of: HashMap<&ChunkKey, usize> = HashMap::new();
        let mut repeats: Vec<(usize, usize)> = Vec::new();
        let mut plan: Vec<Planned> = Vec::new();
        // For a device within a batch of its cap: what the planned keys change in its gap
        // count, and the planned keys and their streams, by which the next key's neighbours and
        // stream are found (the count once the batch is in the index).
        let mut delta: HashMap<&str, i64> = HashMap::new();
        let mut planned: HashSet<(&str, &[u8; 16], &str, u64)> = HashSet::new();
        let mut planned_streams: HashSet<(&str, &[u8; 16], &str)> = HashSet::new();
        // For a device within a batch of its cap on streams: the streams the batch starts.
        let mut new_streams: HashSet<(&str, &[u8; 16], &str)> = HashSet::new();
        let mut new_per_device: HashMap<&str, u64> = HashMap::new();
        for (idx, chunk) in batch.iter().enumerate() {
            let crc = match validate(chunk) {
                Ok(crc) => crc,
                Err(reason) => {
                    tracing::warn!(device = %chunk.key.device, stream = %chunk.key.stream, seq = chunk.key.seq, %reason, "chunk rejected by store");
                    outcomes[idx] = Some(PersistOutcome::Failed(StoreFailure::Rejected(reason)));
                    continue;
                }
            };
            if self.index.contains(&chunk.key) {
                outcomes[idx] = Some(PersistOutcome::Duplicate);
                continue;
            }
            match first_of.entry(&chunk.key) {
                Entry::Occupied(first) => repeats.push((idx, *first.get())),
                Entry::Vacant(slot) => {
                    let k = &chunk.key;
                    let device = k.device.as_str();
                    // A batch starts at most one stream per key: a device that many below its
                    // cap on streams (every device, as a rule) needs no count at all.
                    let streams = self.index.device_streams(device);
                    let max = self.opts.max_index_streams_per_device;
                    let key_stream = (device, &k.spool, k.stream.as_str());
                    if streams.saturating_add(batch.len() as u64) >= max
                        && !new_streams.contains(&key_stream)
                        && !self.index.has_stream(device, &k.spool, &k.stream)
                    {
                        let streams = streams.saturating_add(new_per_device.get(device).copied().unwrap_or(0));
                        if streams >= max {
                            if self.streams_full_devices.insert(k.device.clone()) {
                                tracing::warn!(
                                    device,
                                    stream = %k.stream,
                                    seq = k.seq,
                                    streams,
                                    max,
                                    "device has as many streams as store.max_index_streams_per_device allows: its chunks of a new stream are answered retry and stay in its agent's spool (raise the cap if the device is honest); logged once per device until restart"
                                );
                            }
                            self.stats.index_refused += 1;
                            outcomes[idx] = Some(PersistOutcome::Failed(StoreFailure::TooManyStreams { streams, max }));
                            // A repeat of the key later in the batch takes this answer.
                            slot.insert(idx);
                            continue;
                        }
                        new_streams.insert(key_stream);
                        *new_per_device.entry(device).or_insert(0) += 1;
                    }
                    let stored = self.index.device_gaps(device);
                    let max = self.opts.max_index_gaps_per_device;
                    // A batch opens at most one gap per key: a device that many below its cap
                    // (every device, as a rule) needs no count at all.
                    if stored.saturating_add(batch.len() as u64) >= max {
                        let (spool, stream) = (&k.spool, k.stream.as_str());
                        let here = |seq: Option<u64>| {
                            seq.is_some_and(|seq| {
                                planned.contains(&(device, spool, stream, seq))
                                    || self.index.contains_parts(device, spool, stream, seq)
                            })
                        };
                        // A stream's first key opens no gap; a later one opens one, extends a
                        // range or joins two.
                        let known = planned_streams.contains(&(device, spool, stream))
                            || self.index.has_stream(device, spool, stream);
                        let change = if known {
                            1 - i64::from(here(k.seq.checked_sub(1))) - i64::from(here(k.seq.checked_add(1)))
                        } else {
                            0
                        };
                        let gaps = stored.saturating_add_signed(delta.get(device).copied().unwrap_or(0));
                        if change > 0 && gaps >= max {
                            if self.index_full_devices.insert(k.device.clone()) {
                                tracing::warn!(
                                    device,
                                    stream,
                                    seq = k.seq,
                                    gaps,
                                    max,
                                    "device's dedup index is full: its chunks that leave a gap on both sides in a stream are answered retry until a neighbour is stored (raise store.max_index_gaps_per_device if the device is honest); logged once per device until restart"
                                );
                            }
                            self.stats.index_refused += 1;
                            outcomes[idx] = Some(PersistOutcome::Failed(StoreFailure::IndexFull { gaps, max }));
                            // A repeat of the key later in the batch takes this answer, and is
                            // not counted again.
                            slot.insert(idx);
                            continue;
                        }
                        *delta.entry(device).or_insert(0) += change;
                        planned.insert((device, spool, stream, k.seq));
                        planned_streams.insert((device, spool, stream));
                    }
                    slot.insert(idx);
                    let len = (format::entry_header_len(&chunk.key) + chunk.payload.len()) as u64;
                    plan.push(Planned { idx, crc, len });
                }
            }
        }

        let mut rest = plan.as_slice();
        while !rest.is_empty() {
            let take = self.fit(rest);
            let (now, later) = rest.split_at(take);
            match self.commit(&batch, now) {
                Ok(()) => {
                    for p in now {
                        outcomes[p.idx] = Some(PersistOutcome::Stored);
                    }
                    rest = later;
                }
                Err(failure) => {
                    for p in rest {
                        outcomes[p.idx] = Some(PersistOutcome::Failed(failure.clone()));
                    }
                    rest = &[];
                }
            }
        }
        // A repeat inside the batch is durable exactly when its first copy is.
        for (idx, first) in repeats {
            outcomes[idx] = Some(match &outcomes[first] {
                Some(PersistOutcome::Failed(f)) => PersistOutcome::Failed(f.clone()),
                _ => PersistOutcome::Duplicate,
            });
        }
        let outcomes: Vec<PersistOutcome> = outcomes
            .into_iter()
            .map(|o| o.expect("every chunk got an outcome: rejected, duplicate, planned or repeat"))
            .collect();
        for o in &outcomes {
            match o {
                PersistOutcome::Stored => self.stats.stored += 1,
                PersistOutcome::Duplicate => self.stats.duplicates += 1,
                PersistOutcome::Failed(_) => self.stats.failed += 1,
            }
        }
        outcomes
    }

    /// Applies an agent's floor to the dedup index: every seq of `(device, spool, stream)`
    /// below `floor` counts as stored from now on, stored or not, so a copy of one is answered
    /// `Duplicate` (see `index`). The agent sends it for the chunks it dropped or quarantined,
    /// which will never come, and whose gaps would otherwise count against the device's cap
    /// for good, or be opened by the next chunk after them. Returns `None` if the floor changed
    /// nothing, else the gaps it closed. Not written down: after a restart the gaps are back
    /// until the agent's next floor.
    pub fn raise_floor(&mut self, device: &str, spool: &[u8; 16], stream: &str, floor: u64) -> Option<u64> {
        let closed = self.index.raise_floor(device, spool, stream, floor)?;
        tracing::debug!(device, stream, floor, closed, "agent's floor raised in the dedup index");
        self.stats.index_floors += 1;
        self.stats.index_ranges = self.index.ranges();
        Some(closed)
    }

    /// Current counters.
    pub fn stats(&self) -> StoreStats {
        self.stats.clone()
    }

    /// The options the store was opened with.
    pub fn options(&self) -> &StoreOptions {
        &self.opts
    }

    /// Whether `key` is durably stored, or below its agent's floor for the stream (see
    /// [`Store::raise_floor`]).
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.index.contains(key)
    }

    /// How many of `plan`'s entries go into the next commit; rolls the segment first when the
    /// current one is full. Always at least one.
    fn fit(&mut self, plan: &[Planned]) -> usize {
        let max = self.opts.segment_max_bytes;
        if let Some(seg) = &self.active {
            let has_entries = seg.len > SEGMENT_HEADER_LEN;
            if has_entries && seg.len.saturating_add(plan[0].len) > max {
                self.roll();
            }
        }
        let mut used = self.active.as_ref().map_or(SEGMENT_HEADER_LEN, |s| s.len.max(SEGMENT_HEADER_LEN));
        let mut take = 0;
        for p in plan {
            if take > 0 && used.saturating_add(p.len) > max {
                break;
            }
            used = used.saturating_add(p.len);
            take += 1;
        }
        take
    }

    /// Stops appending to the active segment; the next commit creates a new one.
    fn roll(&mut self) {
        if let Some(seg) = self.active.take() {
            tracing::debug!(segment = seg.number, len = seg.len, "segment rolled");
            // Also after a refusal (`u64::MAX`): a full disk may have granted part of it.
            if seg.reserved > seg.len {
                release_reserved(&seg.file, seg.len, &seg.path);
            }
            crate::crash_point!("ingest::segment::rolled");
        }
    }

    /// Writes and fsyncs one commit. On error, cleans up and leaves no active segment.
    fn commit(&mut self, batch: &[IncomingChunk], entries: &[Planned]) -> Result<(), StoreFailure> {
        let commit = self.next_commit;
        self.next_commit += 1;
        if self.active.is_none()
            && let Err(e) = self.create_segment()
        {
            return Err(self.fail(commit, &e, "creating segment"));
        }
        crate::crash_point!("ingest::commit::segment_ready");
        let seg = self.active.as_mut().expect("an active segment exists: created just above when missing");
        let start_len = seg.len;
        let stored_ms = now_ms();

        let mut headers = Vec::with_capacity(entries.len() * 128 + SEGMENT_HEADER_LEN as usize);
        if start_len == 0 {
            headers.extend_from_slice(&SegmentHeader { number: seg.number, salt: seg.salt }.encode());
        }
        let mut ends = Vec::with_capacity(entries.len());
        for p in entries {
            let chunk = &batch[p.idx];
            let fields = EntryFields {
                commit,
                prev_commit: self.last_good_commit,
                records: chunk.records,
                codec: chunk.codec,
                raw_len: chunk.raw_len,
                // `validate` rejected payloads of 4 GiB and more.
                payload_len: chunk.payload.len() as u32,
                payload_crc: p.crc,
                created_ms: chunk.created_ms,
                stored_ms,
            };
            format::encode_entry_header(&mut headers, seg.salt, &chunk.key, &fields);
            ends.push(headers.len());
        }
        let mut slices = Vec::with_capacity(entries.len() * 2 + 1);
        let mut from = 0;
        if start_len == 0 {
            slices.push(IoSlice::new(&headers[..SEGMENT_HEADER_LEN as usize]));
            from = SEGMENT_HEADER_LEN as usize;
        }
        for (p, &end) in entries.iter().zip(&ends) {
            slices.push(IoSlice::new(&headers[from..end]));
            slices.push(IoSlice::new(&batch[p.idx].payload));
            from = end;
        }
        let total: u64 = slices.iter().map(|s| s.len() as u64).sum();
        reserve_ahead(seg, start_len + total, self.opts.segment_max_bytes);

        let prepared =
            seg.file.seek(SeekFrom::Start(start_len)).and_then(|_| self.faults.before_write(&mut seg.file, &slices));
        if let Err(e) = prepared {
            return Err(self.fail(commit, &e, "writing"));
        }
        let mut direct_written = false;
        if let Some(file) = &seg.direct {
            let buf = self.direct_buf.get_or_insert_with(|| DirectBuf::new(direct::CAPACITY));
            match self.faults.before_direct().and_then(|()| buf.write(file, &seg.file, seg.number, start_len, &slices))
            {
                Ok(w) => {
                    self.stats.direct_bytes += w.direct;
                    direct_written = true;
                }
                Err(e) if direct::is_refusal(&e) => {
                    // Part of the commit may be written already: all of it is written again
                    // below, through the page cache, from its first byte.
                    tracing::warn!(path = %seg.path.display(), error = %e, "the file system refuses this store's O_DIRECT writes; writing through the page cache from now on");
                    self.direct = false;
                    self.direct_buf = None;
                    seg.direct = None;
                }
                Err(e) => return Err(self.fail(commit, &e, "writing")),
            }
        }
        if !direct_written && let Err(e) = write_all_vectored(&mut seg.file, &mut slices) {
            return Err(self.fail(commit, &e, "writing"));
        }
        crate::crash_point!("ingest::commit::written");
        self.stats.fsyncs += 1;
        let synced = self.faults.before_sync().and_then(|()| seg.file.sync_data());
        if let Err(e) = synced {
            return Err(self.fail(commit, &e, "fdatasync"));
        }
        crate::crash_point!("ingest::commit::fdatasynced");
        if seg.created {
            self.stats.dir_fsyncs += 1;
            let dir_synced = self.faults.before_dir_sync().and_then(|()| self.dir.sync_all());
            if let Err(e) = dir_synced {
                return Err(self.fail(commit, &e, "fsync of segments directory"));
            }
            seg.created = false;
        }
        if !direct_written {
            drop_from_page_cache(&seg.file, start_len, total);
        }

        seg.len = start_len + total;
        self.last_good_commit = commit;
        for p in entries {
            let chunk = &batch[p.idx];
            if self.index.insert(&chunk.key) {
                self.stats.chunks += 1;
                self.stats.bytes += chunk.payload.len() as u64;
            }
        }
        crate::crash_point!("ingest::commit::indexed");
        self.stats.commits += 1;
        self.stats.last_failure = None;
        self.stats.streams = self.index.streams();
        self.stats.index_ranges = self.index.ranges();
        Ok(())
    }

    fn create_segment(&mut self) -> io::Result<()> {
        let number = self.next_segment;
        // A number is never tried twice, even if creating it failed.
        self.next_segment += 1;
        let path = self.segments_dir.join(format::segment_file_name(number));
        self.faults.before_create()?;
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        let direct = if self.direct { direct::open(&path) } else { None };
        self.stats.segments += 1;
        self.stats.active_segment = number;
        tracing::debug!(segment = number, "segment created");
        self.active =
            Some(ActiveSegment { number, path, file, direct, salt: random_salt(), len: 0, created: true, reserved: 0 });
        Ok(())
    }

    /// Handles a failed commit: truncates (or removes) what it wrote, drops the segment so the
    /// next commit starts a new one, and classifies the error.
    fn fail(&mut self, commit: u64, e: &io::Error, during: &str) -> StoreFailure {
        let failure = StoreFailure::from_io(e);
        tracing::error!(commit, error = %e, during, "store commit failed; nothing in it is reported stored");
        self.stats.failed_commits += 1;
        self.stats.last_failure = Some(failure.clone());
        let Some(seg) = self.active.take() else {
            return failure;
        };
        if self.faults.keep_failed_bytes() {
            return failure;
        }
        if seg.len == 0 {
            // Created by this commit: nothing in it was ever durable.
            drop(seg.file);
            match fs::remove_file(&seg.path) {
                Ok(()) => self.stats.segments = self.stats.segments.saturating_sub(1),
                Err(e) => {
                    tracing::warn!(path = %seg.path.display(), error = %e, "could not remove the segment of a failed commit")
                }
            }
        } else {
            // Best effort: if this fails too, the next commit's prev_commit still marks this
            // commit as failed for recovery and export.
            let cut = seg.file.set_len(seg.len).and_then(|()| seg.file.sync_data());
            if let Err(e) = cut {
                tracing::warn!(path = %seg.path.display(), error = %e, "could not truncate the segment of a failed commit");
            }
        }
        failure
    }
}

/// Takes the exclusive lock on `<data_dir>/LOCK`.
#[allow(
    clippy::incompatible_msrv,
    reason = "File::try_lock is stable since 1.89; the toolchain is 1.95 (workspace rust-version needs a bump)"
)]
fn lock_data_dir(data_dir: &Path) -> Result<File, StoreError> {
    let path = data_dir.join(LOCK_FILE);
    let file =
        OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(io_at(&path))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(fs::TryLockError::WouldBlock) => Err(StoreError::Locked(data_dir.to_path_buf())),
        Err(fs::TryLockError::Error(e)) => Err(StoreError::Io { path, source: e }),
    }
}

/// Checks what the store itself relies on and returns the payload CRC.
fn validate(chunk: &IncomingChunk) -> Result<u32, String> {
    if chunk.key.device.len() > MAX_NAME_LEN || chunk.key.stream.len() > MAX_NAME_LEN {
        return Err(format!("device id or stream name longer than {MAX_NAME_LEN} bytes"));
    }
    if u32::try_from(chunk.payload.len()).is_err() {
        return Err("payload of 4 GiB or more".into());
    }
    let crc = chunk.payload.crc32c();
    if crc != chunk.checksum {
        return Err(format!("payload checksum {crc:08x} differs from the announced {:08x}", chunk.checksum));
    }
    Ok(crc)
}

fn write_all_vectored(file: &mut File, mut slices: &mut [IoSlice<'_>]) -> io::Result<()> {
    while !slices.is_empty() {
        match file.write_vectored(slices) {
            Ok(0) => {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "segment write wrote nothing"));
            }
            Ok(n) => IoSlice::advance_slices(&mut slices, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Drops the pages of `len` bytes at `offset`, just made durable, from the page cache: after
/// a commit written through it (direct writes, [`direct`], leave nothing there to drop).
///
/// Nothing in the ingest reads them back soon: the dedup index is in memory, and export and
/// the start-up scan read segments long after. Kept, they would only fill the page cache
/// with data written once. Dropped at once, their pages go back to the kernel's free lists
/// while still warm and the next commits' writes reuse them. That matters most on a virtual
/// machine that hands free memory back to its host (a balloon with free page reporting, as
/// on the machines our benchmarks run on): there a page the guest has not touched for a few
/// seconds costs a host fault on first write, and copying a growing store into such pages
/// was about a third of the ingest's CPU (`BENCHMARKS.md`, "Where the time goes").
///
/// The range starts at the page boundary below `offset` (4 KiB; the kernel rounds up to its
/// own page size if that is larger), so the page the previous commit left partial goes too
/// once this commit has filled it: every byte before `offset` is durable already. The kernel
/// drops only whole pages: the partial page at the end stays cached, so the next commit's
/// write into it does not read it back from disk. Advice only: an error changes nothing
/// that was stored, and is logged at trace level only.
fn drop_from_page_cache(file: &File, offset: u64, len: u64) {
    let from = offset - offset % 4096;
    if let Some(len) = std::num::NonZeroU64::new(len + (offset - from))
        && let Err(e) = rustix::fs::fadvise(file, from, Some(len), rustix::fs::Advice::DontNeed)
    {
        tracing::trace!(error = %e, "posix_fadvise(DONTNEED) of a committed range failed");
    }
}

/// Disk blocks are reserved for the active segment this many bytes ahead of its writes (up to
/// `segment_max_bytes`), with `fallocate(FALLOC_FL_KEEP_SIZE)`, once per step rather than block
/// by block as each commit's writeback would allocate them. On ext4 this took about a sixth
/// off the store thread's CPU per GiB stored (`BENCHMARKS.md`, "Done and tried since the
/// `a54f6d1` run", 4).
const RESERVE_STEP: u64 = 16 << 20;

/// Reserves the active segment's disk blocks up to `RESERVE_STEP` past `end` (at least to
/// `end`, at most to `max` unless `end` is past it) when `end` goes past what is reserved.
///
/// `FALLOC_FL_KEEP_SIZE` leaves the file's length alone, so the length stays the end of the
/// last commit and recovery, export and the scan see nothing new. A file system that cannot
/// (tmpfs before Linux 3.5, some FUSE and network file systems) or a full disk only means the
/// blocks are allocated as before: the write that follows reports a full disk itself. The
/// reservation is given back when the segment is rolled ([`release_reserved`]).
fn reserve_ahead(seg: &mut ActiveSegment, end: u64, max: u64) {
    if end <= seg.reserved {
        return;
    }
    let to = end.saturating_add(RESERVE_STEP).min(max).max(end);
    let from = seg.len.max(seg.reserved);
    match rustix::fs::fallocate(&seg.file, rustix::fs::FallocateFlags::KEEP_SIZE, from, to - from) {
        Ok(()) => seg.reserved = to,
        Err(e) => {
            tracing::debug!(segment = seg.number, error = %e, "could not reserve disk blocks ahead; they are allocated as written");
            seg.reserved = u64::MAX;
        }
    }
}

/// Gives back the blocks reserved past a segment's end: truncating to its own length frees
/// what `FALLOC_FL_KEEP_SIZE` allocated beyond it, and changes no byte. Should it fail, those
/// blocks stay allocated (and unread) until the segment is deleted.
fn release_reserved(file: &File, len: u64, path: &Path) {
    if let Err(e) = file.set_len(len) {
        tracing::warn!(path = %path.display(), error = %e, "could not give back the disk blocks reserved past the segment's end");
    }
}

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// A salt nobody outside this process can predict: SipHash keyed from the OS RNG.
fn random_salt() -> u64 {
    RandomState::new().hash_one((now_ms(), std::process::id()))
}

/// `create_dir_all` whose creations are durable: the parent of each directory it created is
/// fsynced, top down, before it returns. Segments in a data directory whose own name a power cut
/// can take would go with it, acknowledged chunks and all.
fn create_dir_all_synced(dir: &Path) -> Result<(), StoreError> {
    let mut missing = Vec::new();
    let mut at = dir;
    while !at.as_os_str().is_empty() {
        match fs::symlink_metadata(at) {
            Ok(_) => break,
            Err(e) if e.kind() == io::ErrorKind::NotFound => missing.push(at),
            Err(e) => return Err(io_at(at)(e)),
        }
        let Some(parent) = at.parent() else { break };
        at = parent;
    }
    fs::create_dir_all(dir).map_err(io_at(dir))?;
    fn parent_of(d: &Path) -> &Path {
        d.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
    }
    for created in missing.iter().rev() {
        let parent = parent_of(created);
        File::open(parent).and_then(|d| d.sync_all()).map_err(io_at(parent))?;
    }
    if missing.is_empty() {
        // A run that created `dir` may have stopped before it synced the name: once more, at
        // every start, best effort (the parent is not ours, and may not be readable).
        let parent = parent_of(dir);
        if let Err(e) = File::open(parent).and_then(|d| d.sync_all()) {
            tracing::debug!(dir = %parent.display(), error = %e, "could not fsync the data directory's parent");
        }
    }
    Ok(())
}

fn io_at(path: &Path) -> impl Fn(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.to_path_buf(), source }
}

/// A segment during open.
#[derive(Debug)]
struct OpenSegment {
    number: u64,
    path: PathBuf,
    /// Open for the last segment and for segments being repaired; closed otherwise.
    file: Option<File>,
    len: u64,
    /// `Some` when the header is valid.
    salt: Option<u64>,
    /// Truncate to this length before serving.
    cut: Option<u64>,
}

impl OpenSegment {
    /// The file, opened read-write if it was closed.
    fn file(&mut self) -> Result<&File, StoreError> {
        if self.file.is_none() {
            let file = OpenOptions::new().read(true).write(true).open(&self.path).map_err(io_at(&self.path))?;
            self.file = Some(file);
        }
        Ok(self.file.as_ref().expect("the file was opened just above when it was closed"))
    }

    /// The last segment keeps being appended to if it is empty or has a valid header and room.
    fn into_active(self, max: u64, direct_writes: bool) -> Option<ActiveSegment> {
        let salt = match (self.len, self.salt) {
            (0, _) => random_salt(),
            (_, Some(salt)) if self.len < max => salt,
            _ => {
                // Not appended to again: blocks the last run reserved past its end go back.
                if let Some(file) = &self.file {
                    release_reserved(file, self.len, &self.path);
                }
                return None;
            }
        };
        let file = self.file?;
        let direct = if direct_writes { direct::open(&self.path) } else { None };
        Some(ActiveSegment {
            number: self.number,
            path: self.path,
            file,
            direct,
            salt,
            len: self.len,
            created: false,
            // Whatever the last run reserved is found again by the next `fallocate`, which
            // allocates only what is missing.
            reserved: 0,
        })
    }
}

/// Index and report being rebuilt by open.
#[derive(Debug, Default)]
struct Recovery {
    index: DedupIndex,
    report: RecoveryReport,
    bytes: u64,
    max_indexed_commit: u64,
}

impl Recovery {
    fn accept(&mut self, meta: &EntryMeta) {
        if self.index.insert(&meta.header.key) {
            self.bytes += u64::from(meta.header.fields.payload_len);
        } else {
            self.report.duplicate_entries += 1;
        }
        self.max_indexed_commit = self.max_indexed_commit.max(meta.header.fields.commit);
    }

    /// Verifies the payloads of the unconfirmed (newest) commit. Good entries are indexed;
    /// bad ones at the end of their segment are cut, bad ones followed by a good one get their
    /// magic zeroed.
    fn settle_newest(&mut self, newest: Vec<(usize, EntryMeta)>, segs: &mut [OpenSegment]) -> Result<(), StoreError> {
        let mut buf = Vec::new();
        let mut checked: Vec<(usize, EntryMeta, bool)> = Vec::with_capacity(newest.len());
        for (seg_idx, meta) in newest {
            let seg = &mut segs[seg_idx];
            let verified = scan::verify_payload(seg.file()?, &meta, &mut buf);
            let ok = verified.map_err(io_at(&seg.path))?;
            self.report.verified_entries += 1;
            checked.push((seg_idx, meta, ok));
        }
        for i in 0..checked.len() {
            let (seg_idx, ref meta, ok) = checked[i];
            if ok {
                self.accept(meta);
                continue;
            }
            self.report.corrupt_entries += 1;
            let seg = &mut segs[seg_idx];
            let good_after = checked[i + 1..].iter().any(|(s, m, ok)| *s == seg_idx && *ok && m.offset > meta.offset);
            if good_after {
                tracing::error!(path = %seg.path.display(), offset = meta.offset, "newest commit has an entry with a bad payload; invalidating it");
                seg.file()?.write_all_at(&[0u8; 8], meta.offset).map_err(io_at(&seg.path))?;
            } else {
                tracing::warn!(path = %seg.path.display(), offset = meta.offset, "newest commit ends in a torn entry");
                seg.cut = Some(seg.cut.map_or(meta.offset, |c| c.min(meta.offset)));
            }
        }
        Ok(())
    }
}

/// Fault injection for the unit tests (a no-op outside `cfg(test)`).
#[cfg(not(test))]
#[derive(Debug, Default)]
pub(super) struct Faults;

#[cfg(not(test))]
impl Faults {
    fn new() -> Self {
        Faults
    }
    #[inline]
    fn before_create(&mut self) -> io::Result<()> {
        Ok(())
    }
    #[inline]
    fn before_write(&mut self, _: &mut File, _: &[IoSlice<'_>]) -> io::Result<()> {
        Ok(())
    }
    #[inline]
    fn before_direct(&mut self) -> io::Result<()> {
        Ok(())
    }
    #[inline]
    fn before_sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    #[inline]
    fn before_dir_sync(&mut self) -> io::Result<()> {
        Ok(())
    }
    #[inline]
    fn keep_failed_bytes(&self) -> bool {
        false
    }
}

/// Fault injection for the unit tests: each armed fault fires once.
#[cfg(test)]
#[derive(Debug, Default)]
pub(super) struct Faults {
    /// Fail creating the next segment with this errno.
    pub create: Option<i32>,
    /// Write this many bytes of the next commit, then fail with this errno.
    pub write: Option<(usize, i32)>,
    /// Fail the next direct write with this errno, before it writes anything.
    pub direct: Option<i32>,
    /// Fail the next fdatasync with this errno (after the write went through).
    pub sync: Option<i32>,
    /// Fail the next directory fsync with this errno.
    pub dir_sync: Option<i32>,
    /// Leave a failed commit's bytes in place (as if truncating had failed).
    pub keep_failed_bytes: bool,
}

#[cfg(test)]
impl Faults {
    fn new() -> Self {
        Self::default()
    }
    fn before_create(&mut self) -> io::Result<()> {
        self.create.take().map_or(Ok(()), |errno| Err(io::Error::from_raw_os_error(errno)))
    }
    fn before_write(&mut self, file: &mut File, slices: &[IoSlice<'_>]) -> io::Result<()> {
        let Some((n, errno)) = self.write.take() else {
            return Ok(());
        };
        let all: Vec<u8> = slices.iter().flat_map(|s| s.iter().copied()).collect();
        file.write_all(&all[..n.min(all.len())])?;
        Err(io::Error::from_raw_os_error(errno))
    }
    fn before_direct(&mut self) -> io::Result<()> {
        self.direct.take().map_or(Ok(()), |errno| Err(io::Error::from_raw_os_error(errno)))
    }
    fn before_sync(&mut self) -> io::Result<()> {
        self.sync.take().map_or(Ok(()), |errno| Err(io::Error::from_raw_os_error(errno)))
    }
    fn before_dir_sync(&mut self) -> io::Result<()> {
        self.dir_sync.take().map_or(Ok(()), |errno| Err(io::Error::from_raw_os_error(errno)))
    }
    fn keep_failed_bytes(&self) -> bool {
        self.keep_failed_bytes
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::store::{ExportFilter, export};

    fn chunk(seq: u64, body: &[u8]) -> IncomingChunk {
        let mut payload = Vec::new();
        payload.extend_from_slice(&(body.len() as u32).to_le_bytes());
        payload.extend_from_slice(body);
        IncomingChunk {
            key: ChunkKey { device: "dev".into(), spool: [1; 16], stream: "s".into(), seq },
            records: 1,
            codec: edge_proto::Codec::None,
            raw_len: payload.len() as u32,
            checksum: edge_proto::crc32c(&payload),
            created_ms: 1,
            payload: payload.into(),
        }
    }

    fn open(dir: &Path) -> (Store, RecoveryReport) {
        Store::open(StoreOptions::new(dir)).expect("open store")
    }

    fn exported_seqs(dir: &Path) -> (Vec<u64>, crate::store::ExportReport) {
        let mut seqs = Vec::new();
        let report = export(dir, &ExportFilter::default(), |c| {
            seqs.push(c.key.seq);
            Ok(())
        })
        .expect("export");
        (seqs, report)
    }

    fn segment_len(dir: &Path, number: u64) -> u64 {
        fs::metadata(dir.join(SEGMENTS_DIR).join(format::segment_file_name(number))).expect("segment exists").len()
    }

    /// Chunks whose payloads hold their own seq in every byte, of the given body lengths.
    fn patterned(from: u64, lens: &[usize]) -> Vec<IncomingChunk> {
        lens.iter().zip(from..).map(|(&len, seq)| chunk(seq, &vec![seq as u8; len])).collect()
    }

    /// Every chunk exported, as `(seq, its records concatenated)`, and the export's report.
    fn exported(dir: &Path) -> (Vec<(u64, Vec<u8>)>, crate::store::ExportReport) {
        let mut chunks = Vec::new();
        let report = export(dir, &ExportFilter::default(), |c| {
            chunks.push((c.key.seq, c.records.concat()));
            Ok(())
        })
        .expect("export");
        (chunks, report)
    }

    #[test]
    fn a_device_at_its_index_cap_gets_retry_for_new_gaps_only_and_the_count_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let capped = |dir: &Path| {
            let opts = StoreOptions { max_index_gaps_per_device: 3, ..StoreOptions::new(dir) };
            Store::open(opts).expect("open store").0
        };
        let of = |device: &str, stream: &str, seq: u64| {
            let mut c = chunk(seq, b"x");
            c.key.device = device.into();
            c.key.stream = stream.into();
            c
        };
        let full = |gaps| PersistOutcome::Failed(StoreFailure::IndexFull { gaps, max: 3 });
        use PersistOutcome::{Duplicate, Stored};
        let mut store = capped(dir.path());
        // Seq 1 starts the stream, 3, 5 and 7 open three gaps; in the same batch, 9 would be a
        // fourth.
        let out = store.persist([1, 3, 5, 7, 9].map(|seq| of("d", "s", seq)).to_vec());
        assert_eq!(out, vec![Stored, Stored, Stored, Stored, full(3)]);
        // At the cap: a repeat is still a duplicate, a seq next to a range is stored, so is a
        // new stream's first seq, a new gap in either stream is refused (a repeat of it in the
        // batch too, counted once), and another device is not affected.
        let out = store.persist(vec![
            of("d", "s", 3),
            of("d", "s", 8),
            of("d", "t", 1),
            of("d", "t", 5),
            of("d", "s", 11),
            of("e", "s", 9),
            of("d", "s", 11),
        ]);
        assert_eq!(out, vec![Duplicate, Stored, Stored, full(3), full(3), Stored, full(3)]);
        assert_eq!(store.stats().index_refused, 3, "9 before, 5 and 11 now");
        assert_eq!(store.stats().last_failure, None, "a device's cap is no failure of the store");
        drop(store);

        // The count is rebuilt at open: still full. Filling the gap at 2 joins two ranges,
        // after which a new gap fits.
        let mut store = capped(dir.path());
        assert_eq!(store.persist(vec![of("d", "s", 11)]), vec![full(3)]);
        assert_eq!(store.persist(vec![of("d", "s", 2)]), vec![Stored]);
        assert_eq!(store.persist(vec![of("d", "s", 11)]), vec![Stored]);
        assert_eq!(store.stats().index_ranges, 6, "d: 1..=3, 5, 7..=8, 11 and t's 1; e: 9");
        let (mut seqs, _) = exported_seqs(dir.path());
        seqs.sort_unstable();
        assert_eq!(seqs, [1, 1, 2, 3, 5, 7, 8, 9, 11], "every stored chunk and no refused one");

        // Within a batch, keys are counted against those before them: consecutive seqs open
        // no gap, and a seq that joins two ranges lets a new gap in after it.
        let seqs = |from: u64, to: u64| (from..=to).map(|seq| of("f", "s", seq)).collect::<Vec<_>>();
        let mut batch = seqs(10, 14);
        batch.extend([20, 30, 40].map(|seq| of("f", "s", seq)));
        assert!(store.persist(batch).iter().all(|o| *o == Stored), "a new stream and three gaps");
        assert_eq!(store.persist(seqs(50, 51)), vec![full(3), full(3)], "51's neighbour was refused");
        let mut batch = seqs(15, 19);
        batch.push(of("f", "s", 60));
        assert!(store.persist(batch).iter().all(|o| *o == Stored), "19 joined 10..=18 and 20");
        assert_eq!(store.persist(seqs(70, 70)), vec![full(3)]);
    }

    #[test]
    fn a_device_at_its_cap_on_streams_gets_retry_for_new_streams_only_and_the_count_survives_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let capped = |dir: &Path, max: u64| {
            let opts = StoreOptions { max_index_streams_per_device: max, ..StoreOptions::new(dir) };
            Store::open(opts).expect("open store").0
        };
        let of = |device: &str, spool: u8, stream: &str, seq: u64| {
            let mut c = chunk(seq, b"x");
            c.key.device = device.into();
            c.key.spool = [spool; 16];
            c.key.stream = stream.into();
            c
        };
        let full = |streams| PersistOutcome::Failed(StoreFailure::TooManyStreams { streams, max: 3 });
        use PersistOutcome::{Duplicate, Stored};
        let mut store = capped(dir.path(), 3);
        // Three streams over two spools; in the same batch, a fourth is refused, and a later
        // key of a stream the batch started is not a new one.
        let out = store.persist(vec![
            of("d", 1, "a", 1),
            of("d", 1, "b", 1),
            of("d", 2, "a", 1),
            of("d", 1, "a", 2),
            of("d", 1, "c", 1),
        ]);
        assert_eq!(out, vec![Stored, Stored, Stored, Stored, full(3)]);
        // At the cap: the known streams go on, a repeat is a duplicate, a new stream is refused
        // (a repeat of it in the batch too, counted once), and another device is not affected.
        let out = store.persist(vec![
            of("d", 1, "a", 3),
            of("d", 2, "a", 1),
            of("d", 2, "b", 1),
            of("e", 1, "c", 1),
            of("d", 2, "b", 1),
        ]);
        assert_eq!(out, vec![Stored, Duplicate, full(3), Stored, full(3)]);
        assert_eq!(store.stats().index_refused, 2, "c before, spool 2's b now");
        assert_eq!(store.stats().last_failure, None, "a device's cap is no failure of the store");
        drop(store);

        // The count is rebuilt at open: still full; a raised cap lets the refused chunks in.
        let mut store = capped(dir.path(), 3);
        assert_eq!(store.persist(vec![of("d", 1, "c", 1)]), vec![full(3)]);
        drop(store);
        let mut store = capped(dir.path(), 5);
        assert_eq!(store.persist(vec![of("d", 1, "c", 1), of("d", 2, "b", 1)]), vec![Stored, Stored]);
        assert_eq!(store.stats().streams, 6, "d: five, e: one");
        let (mut seqs, _) = exported_seqs(dir.path());
        seqs.sort_unstable();
        assert_eq!(seqs, [1, 1, 1, 1, 1, 1, 2, 3], "every stored chunk and no refused one");
    }

    #[test]
    fn an_agents_floor_closes_its_gaps_at_the_cap_and_is_learned_again_after_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let capped = |dir: &Path| {
            let opts = StoreOptions { max_index_gaps_per_device: 2, ..StoreOptions::new(dir) };
            Store::open(opts).expect("open store").0
        };
        let of = |stream: &str, seq: u64| {
            let mut c = chunk(seq, b"x");
            c.key.stream = stream.into();
            c
        };
        let full = || PersistOutcome::Failed(StoreFailure::IndexFull { gaps: 2, max: 2 });
        use PersistOutcome::{Duplicate, Stored};
        let (device, spool) = {
            let k = of("s", 0).key;
            (k.device, k.spool)
        };
        let mut store = capped(dir.path());
        // Seqs 2, 3 and 4 dropped by the agent's full spool, 6 quarantined: two gaps, the cap.
        assert!(store.persist([1, 5, 7].map(|seq| of("s", seq)).to_vec()).iter().all(|o| *o == Stored));
        assert_eq!(store.persist(vec![of("s", 9)]), vec![full()], "8 still to come: a third gap");
        assert_eq!(store.raise_floor(&device, &spool, "s", 8), Some(2), "below 8 nothing more will come");
        assert_eq!(store.stats().index_floors, 1);
        assert_eq!(store.stats().index_ranges, 1);
        assert_eq!(store.persist(vec![of("s", 9)]), vec![Stored], "room for the gap at 8 now");
        assert_eq!(store.persist(vec![of("s", 3), of("s", 8)]), vec![Duplicate, Stored], "3 is below the floor");
        assert_eq!(store.raise_floor(&device, &spool, "other", 8), None, "no such stream: nothing to close");
        drop(store);

        // Floors are not written down: the gaps are back after a restart, until the next one.
        let mut store = capped(dir.path());
        assert_eq!(store.stats().index_ranges, 3, "1, 5 and 7..=9");
        assert_eq!(store.persist(vec![of("s", 11)]), vec![full()]);
        assert_eq!(store.raise_floor(&device, &spool, "s", 10), Some(2));
        assert_eq!(store.persist(vec![of("s", 11)]), vec![Stored]);
        let (mut seqs, _) = exported_seqs(dir.path());
        seqs.sort_unstable();
        assert_eq!(seqs, [1, 5, 7, 8, 9, 11], "stored chunks only: a floor stores nothing");
    }

    /// Whether the file system under `dir` takes `O_DIRECT` (the tests of the direct path say
    /// so and skip where it does not).
    fn direct_capable(dir: &Path) -> bool {
        let probe = dir.join("direct-probe");
        fs::write(&probe, b"").expect("probe file");
        let ok = direct::open(&probe).is_some();
        fs::remove_file(&probe).expect("remove probe");
        if !ok {
            eprintln!("skipped: the file system of {} refuses O_DIRECT", dir.display());
        }
        ok
    }

    #[test]
    fn direct_commits_of_every_size_read_back_byte_for_byte_also_across_restarts() {
        let dir = tempfile::tempdir().expect("tempdir");
        if !direct_capable(dir.path()) {
            return;
        }
        let mut all = Vec::new();
        let mut seq = 1;
        // Each round reopens the store, so its first commit reads the partial last block back
        // from the file; within a round the buffer carries it from commit to commit.
        for round in [&[100, 5000, 40_000][..], &[3, 70_000], &[2_000_000, 10], &[4096 - 4 - 113]] {
            let (mut store, _) = open(dir.path());
            let before = store.stats().direct_bytes;
            for &len in round {
                let batch = patterned(seq, &[len, len / 3 + 1]);
                seq += 2;
                assert_eq!(store.persist(batch.clone()), vec![PersistOutcome::Stored; 2]);
                all.extend(batch.into_iter().map(|c| (c.key.seq, c.payload[4..].to_vec())));
            }
            let stats = store.stats();
            if round.iter().any(|&len| len > 8192) {
                assert!(stats.direct_bytes > before, "whole blocks went direct in round {round:?}: {stats:?}");
            }
            let seg = store.active.as_ref().expect("active segment");
            assert_eq!(segment_len(dir.path(), seg.number), seg.len, "the file ends where the last commit does");
        }
        let (_, report) = open(dir.path());
        assert_eq!((report.truncated_bytes, report.corrupt_entries), (0, 0));
        let (chunks, report) = exported(dir.path());
        assert_eq!(chunks, all);
        assert_eq!((report.corrupt, report.corrupt_bytes, report.tail_bytes), (0, 0, 0));
    }

    #[test]
    fn a_file_system_refusing_direct_writes_gets_them_through_the_page_cache_and_loses_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        if !direct_capable(dir.path()) {
            return;
        }
        let (mut store, _) = open(dir.path());
        assert_eq!(store.persist(patterned(1, &[20_000])), vec![PersistOutcome::Stored]);
        let direct_before = store.stats().direct_bytes;
        assert!(direct_before > 0);
        store.faults.direct = Some(libc::EINVAL);
        let batch = patterned(2, &[30_000, 7]);
        assert_eq!(store.persist(batch), vec![PersistOutcome::Stored; 2], "the refusal is not a failure");
        assert_eq!(store.persist(patterned(4, &[50_000])), vec![PersistOutcome::Stored]);
        let stats = store.stats();
        assert_eq!(stats.direct_bytes, direct_before, "no direct write after the refusal");
        assert_eq!((stats.failed_commits, stats.segments), (0, 1));
        drop(store);
        let (chunks, _) = exported(dir.path());
        assert_eq!(chunks.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
        assert!(chunks.iter().all(|(seq, p)| p.iter().all(|&b| b == *seq as u8)));
    }

    #[test]
    fn a_failed_direct_write_fails_its_commit_and_the_next_one_lands_intact() {
        let dir = tempfile::tempdir().expect("tempdir");
        if !direct_capable(dir.path()) {
            return;
        }
        let (mut store, _) = open(dir.path());
        assert_eq!(store.persist(patterned(1, &[10_000])), vec![PersistOutcome::Stored]);
        let good_len = segment_len(dir.path(), 1);
        store.faults.direct = Some(libc::ENOSPC);
        assert_eq!(store.persist(patterned(2, &[10_000])), vec![PersistOutcome::Failed(StoreFailure::DiskFull)]);
        assert_eq!(segment_len(dir.path(), 1), good_len);
        assert_eq!(store.persist(patterned(2, &[10_000, 9_000])), vec![PersistOutcome::Stored; 2]);
        assert!(store.stats().direct_bytes > 0);
        drop(store);
        let (_, report) = open(dir.path());
        assert_eq!((report.chunks, report.truncated_bytes, report.corrupt_entries), (3, 0, 0));
        let (chunks, _) = exported(dir.path());
        assert_eq!(chunks.iter().map(|(s, _)| *s).collect::<Vec<_>>(), vec![1, 2, 3]);
        assert!(chunks.iter().all(|(seq, p)| p.iter().all(|&b| b == *seq as u8)));
    }

    #[test]
    fn with_direct_writes_off_nothing_goes_direct() {
        let dir = tempfile::tempdir().expect("tempdir");
        let opts = StoreOptions { direct_writes: false, ..StoreOptions::new(dir.path()) };
        let (mut store, _) = Store::open(opts).expect("open");
        assert_eq!(store.persist(patterned(1, &[100_000])), vec![PersistOutcome::Stored]);
        assert_eq!(store.stats().direct_bytes, 0);
        assert!(store.active.as_ref().is_some_and(|s| s.direct.is_none()));
    }

    #[test]
    fn enospc_during_a_write_is_disk_full_the_partial_entry_is_cut_and_a_later_persist_succeeds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        assert_eq!(store.persist(vec![chunk(1, b"a")]), vec![PersistOutcome::Stored]);
        let good_len = segment_len(dir.path(), 1);

        store.faults.write = Some((50, libc::ENOSPC));
        let out = store.persist(vec![chunk(2, b"b"), chunk(3, b"c")]);
        assert_eq!(out, vec![PersistOutcome::Failed(StoreFailure::DiskFull); 2]);
        assert_eq!(segment_len(dir.path(), 1), good_len, "partial write truncated away");
        assert_eq!(store.stats().last_failure, Some(StoreFailure::DiskFull));
        assert!(!store.contains(&chunk(2, b"b").key));

        assert_eq!(store.persist(vec![chunk(2, b"b")]), vec![PersistOutcome::Stored]);
        assert_eq!(store.stats().active_segment, 2, "the next batch went to a new segment");
        assert_eq!(store.stats().last_failure, None);
        drop(store);
        let (_, report) = open(dir.path());
        assert_eq!(report.chunks, 2);
        assert_eq!(report.truncated_bytes, 0);
        assert_eq!(exported_seqs(dir.path()).0, vec![1, 2]);
    }

    #[test]
    fn a_failed_fsync_never_reports_stored_and_the_next_batch_uses_a_new_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        assert_eq!(store.persist(vec![chunk(1, b"a")]), vec![PersistOutcome::Stored]);
        store.faults.sync = Some(libc::EIO);
        let out = store.persist(vec![chunk(2, b"b")]);
        assert!(matches!(&out[..], [PersistOutcome::Failed(StoreFailure::Io(_))]), "{out:?}");
        assert!(store.active.is_none(), "the segment whose fsync failed is not written to again");
        assert_eq!(store.persist(vec![chunk(2, b"b")]), vec![PersistOutcome::Stored]);
        let stats = store.stats();
        assert_eq!((stats.commits, stats.failed_commits, stats.segments), (2, 1, 2));
    }

    #[test]
    fn a_repeat_of_a_failed_chunk_in_the_same_batch_is_not_reported_durable() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store.faults.sync = Some(libc::EIO);
        let out = store.persist(vec![chunk(1, b"a"), chunk(1, b"a")]);
        assert!(out.iter().all(|o| !o.is_durable()), "{out:?}");
        assert_eq!(
            store.persist(vec![chunk(1, b"a"), chunk(1, b"a")]),
            vec![PersistOutcome::Stored, PersistOutcome::Duplicate]
        );
    }

    #[test]
    fn entries_of_a_failed_commit_left_on_disk_are_ignored_once_a_later_commit_succeeds() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        assert_eq!(store.persist(vec![chunk(1, b"a")]), vec![PersistOutcome::Stored]);
        let good_len = segment_len(dir.path(), 1);
        store.faults.sync = Some(libc::EIO);
        store.faults.keep_failed_bytes = true;
        assert!(!store.persist(vec![chunk(2, b"b")])[0].is_durable());
        assert!(segment_len(dir.path(), 1) > good_len, "the failed entry is still in the file");
        store.faults.keep_failed_bytes = false;
        assert_eq!(store.persist(vec![chunk(3, b"c")]), vec![PersistOutcome::Stored]);
        drop(store);

        let (mut store, report) = open(dir.path());
        assert_eq!(report.abandoned_entries, 1);
        assert_eq!(report.chunks, 2);
        assert_eq!(store.persist(vec![chunk(2, b"b")]), vec![PersistOutcome::Stored], "seq 2 was never stored");
        drop(store);
        let (seqs, report) = exported_seqs(dir.path());
        assert_eq!(seqs, vec![1, 2, 3]);
        assert_eq!(report.abandoned, 1);
        assert_eq!(report.duplicate_entries, 0);
    }

    #[test]
    fn a_failed_directory_fsync_removes_the_new_segment_and_fails_the_batch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store.faults.dir_sync = Some(libc::EIO);
        assert!(!store.persist(vec![chunk(1, b"a")])[0].is_durable());
        assert_eq!(scan::list_segments(&dir.path().join(SEGMENTS_DIR)).expect("list").len(), 0);
        assert_eq!(store.persist(vec![chunk(1, b"a")]), vec![PersistOutcome::Stored]);
        assert_eq!(store.stats().segments, 1);
        assert_eq!(store.stats().dir_fsyncs, 2);
    }

    #[test]
    fn a_read_only_file_system_is_reported_as_such() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        store.faults.create = Some(libc::EROFS);
        assert_eq!(store.persist(vec![chunk(1, b"a")]), vec![PersistOutcome::Failed(StoreFailure::ReadOnly)]);
        assert_eq!(store.persist(vec![chunk(1, b"a")]), vec![PersistOutcome::Stored]);
    }

    #[test]
    fn a_crash_before_the_fsync_of_a_new_segment_leaves_nothing_that_counts() {
        // Simulate the state a power cut can leave: the segment header torn at creation.
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut store, _) = open(dir.path());
        assert_eq!(store.persist(vec![chunk(1, b"a")]), vec![PersistOutcome::Stored]);
        drop(store);
        let torn = dir.path().join(SEGMENTS_DIR).join(format::segment_file_name(2));
        fs::write(&torn, &SegmentHeader { number: 2, salt: 9 }.encode()[..20]).expect("write torn header");
        let (mut store, report) = open(dir.path());
        assert_eq!(report.truncated_bytes, 20);
        assert_eq!(report.chunks, 1);
        assert_eq!(store.persist(vec![chunk(2, b"b")]), vec![PersistOutcome::Stored]);
        drop(store);
        assert_eq!(exported_seqs(dir.path()).0, vec![1, 2]);
    }

    /// Bytes of `path` in the page cache, as util-linux's `fincore` reports them.
    fn cached_bytes(path: &Path) -> u64 {
        let out = std::process::Command::new("fincore")
            .args(["--bytes", "--noheadings", "--output", "RES"])
            .arg(path)
            .output()
            .expect("fincore (util-linux) runs");
        assert!(out.status.success(), "fincore failed: {}", String::from_utf8_lossy(&out.stderr));
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim().parse().unwrap_or_else(|e| panic!("fincore printed {text:?}: {e}"))
    }

    /// A temporary directory on the disk file system under `target/`: `/tmp` may be tmpfs,
    /// whose pages cannot be dropped and whose `fallocate` is not a disk's.
    fn disk_tempdir() -> tempfile::TempDir {
        let base = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/test-tmp");
        fs::create_dir_all(&base).expect("create target/test-tmp");
        tempfile::tempdir_in(&base).expect("tempdir")
    }

    #[test]
    fn committed_bytes_leave_the_page_cache_but_the_partial_last_page_and_every_entry_stay_readable() {
        // Through the page cache and dropped from it after the commit; then written direct,
        // where they never enter it.
        for direct_writes in [false, true] {
            committed_bytes_leave_the_page_cache(direct_writes);
        }
    }

    fn committed_bytes_leave_the_page_cache(direct_writes: bool) {
        let dir = disk_tempdir();
        let (mut store, _) =
            Store::open(StoreOptions { direct_writes, ..StoreOptions::new(dir.path()) }).expect("open");
        let big = vec![0x5a; 256 << 10];
        let batch: Vec<IncomingChunk> = (1..=8).map(|seq| chunk(seq, &big)).collect();
        assert_eq!(store.persist(batch), vec![PersistOutcome::Stored; 8]);
        let path = dir.path().join(SEGMENTS_DIR).join(format::segment_file_name(1));
        let len = segment_len(dir.path(), 1);
        assert!(len > 2 << 20, "{len}");
        let cached = cached_bytes(&path);
        // The whole pages of the commit are gone; only its partial last page may remain.
        assert!(
            cached <= 4096,
            "{cached} of the segment's {len} bytes still cached after the commit (direct: {direct_writes})"
        );
        assert_eq!(store.stats().direct_bytes > 0, direct_writes && direct_capable(dir.path()));
        // The next commit appends into that last page: nothing before it may change.
        assert_eq!(store.persist(vec![chunk(9, &big)]), vec![PersistOutcome::Stored]);
        // It filled that page, which went with the rest of the second commit.
        let cached = cached_bytes(&path);
        assert!(cached <= 4096, "{cached} of the segment's {} bytes still cached", segment_len(dir.path(), 1));
        drop(store);
        let (seqs, report) = exported_seqs(dir.path());
        assert_eq!(seqs, (1..=9).collect::<Vec<_>>());
        assert_eq!((report.corrupt, report.corrupt_regions), (0, 0), "{report:?}");
        let (_, reopened) = open(dir.path());
        assert_eq!(reopened.chunks, 9);
        assert_eq!(reopened.truncated_bytes, 0);
    }

    /// Bytes of disk `path` holds (`st_blocks`), past its length too.
    fn allocated_bytes(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(path).expect("segment exists").blocks() * 512
    }

    #[test]
    fn disk_blocks_are_reserved_ahead_of_the_active_segment_and_given_back_when_it_is_done() {
        let dir = disk_tempdir();
        let max = 4 << 20;
        let opts = |max| StoreOptions { segment_max_bytes: max, ..StoreOptions::new(dir.path()) };
        let seg = |n| dir.path().join(SEGMENTS_DIR).join(format::segment_file_name(n));
        let (mut store, _) = Store::open(opts(max)).expect("open store");
        let body = vec![0x5a; 100 << 10];
        assert_eq!(store.persist(vec![chunk(1, &body)]), vec![PersistOutcome::Stored]);
        let len = segment_len(dir.path(), 1);
        let reserved = store.active.as_ref().expect("active segment").reserved;
        if reserved == u64::MAX {
            // The file system under target/ cannot: the segment is written as before.
            assert!(allocated_bytes(&seg(1)) < len + (1 << 20), "nothing reserved, nothing held");
        } else {
            assert_eq!(reserved, max, "reserved up to the segment's maximum, as it is below one step");
            let held = allocated_bytes(&seg(1));
            assert!(held >= max, "{held} bytes held for a segment reserved to {max}");
        }
        // The length is the end of the last commit, so the next run finds nothing new.
        drop(store);
        let (mut store, report) = Store::open(opts(max)).expect("reopen store");
        assert_eq!((report.chunks, report.truncated_bytes), (1, 0), "{report:?}");
        assert_eq!(segment_len(dir.path(), 1), len);
        // Filling the segment rolls it (at about 3.1 MiB: a fourth chunk of 1.5 MiB does not
        // fit), and what was reserved past its end goes back.
        let large = vec![0xa5; 3 << 19];
        let batch: Vec<IncomingChunk> = (2..=5).map(|seq| chunk(seq, &large)).collect();
        assert!(store.persist(batch).iter().all(PersistOutcome::is_durable));
        let last = store.stats().active_segment;
        assert_eq!(last, 2, "{:?}", store.stats());
        let full = segment_len(dir.path(), 1);
        assert!(full < max - (512 << 10), "segment 1 rolled at {full} bytes");
        assert!(
            allocated_bytes(&seg(1)) < full + (64 << 10),
            "segment 1 holds {} bytes for {full}",
            allocated_bytes(&seg(1))
        );
        drop(store);
        // A segment the next run will not append to (here: reopened with a smaller maximum)
        // gives its reservation back at open.
        let last_len = fs::metadata(seg(last)).expect("last segment").len();
        let (store, _) = Store::open(opts(last_len)).expect("reopen with a smaller maximum");
        assert!(store.active.is_none(), "the last segment is full for this maximum");
        assert!(
            allocated_bytes(&seg(last)) < last_len + (64 << 10),
            "segment {last} holds {} bytes for {last_len}",
            allocated_bytes(&seg(last))
        );
        drop(store);
        let (seqs, report) = exported_seqs(dir.path());
        assert_eq!(seqs, (1..=5).collect::<Vec<_>>());
        assert_eq!((report.corrupt, report.corrupt_regions), (0, 0), "{report:?}");
    }
}
