//! The writer: [`Spool`] owns the single write connection and the in-memory counters.
//!
//! Every public write is one `BEGIN IMMEDIATE` ... `COMMIT` transaction that works on a clone of
//! the counters; the clone replaces the live counters only after `COMMIT` returned. On any error
//! the transaction is rolled back (by `Transaction`'s drop, or by SQLite itself for `SQLITE_FULL`
//! and I/O errors) and the counters are untouched, so the spool stays usable.

use std::collections::{BTreeSet, VecDeque};

use rusqlite::{OptionalExtension, Transaction, TransactionBehavior};

use crate::error::ctx;
use crate::journal;
use crate::lock::SpoolLock;
use crate::reader::SpoolReader;
use crate::recovery;
use crate::reserve::Reserve;
use crate::rowcrc::{self, BatchRow, ChunkRow, SegRef};
use crate::schema::{META_DROPPED_CHUNKS, META_DROPPED_RECORDS, META_ROW_CRC, META_SEGMENTS_SYNCED};
use crate::segment::{SegmentUse, SegmentWriter};
use crate::state::{self, Counted, OpenBatches, State, StreamState, min_opt};
use crate::walsync::{SegmentSyncs, Visible, WalSync};
use crate::{
    AckReport, AppendOutcome, AppendRequest, Batch, ChunkId, ChunkMeta, CommitReport, FullPolicy, OpenReport, SealWhat,
    SpoolError, SpoolId, SpoolOptions, SpoolStats, len_u64,
};

/// The durable spool; the single writer of its file. `Send`, not `Sync`: put it behind a mutex
/// or on a dedicated thread.
#[derive(Debug)]
pub struct Spool {
    conn: rusqlite::Connection,
    id: SpoolId,
    opts: SpoolOptions,
    state: State,
    reserve: Reserve,
    segments: SegmentWriter,
    /// The newest chunk id readers may list (see `walsync.rs`).
    visible: Visible,
    /// Deferred segment syncs (from [`Spool::defer_wal_sync`]).
    syncs: Option<SegmentSyncs>,
    /// With deferred segment syncs: per committed segment write not yet known to be synced,
    /// its number and the newest batch id it holds, oldest first.
    unsynced: VecDeque<(u64, i64)>,
    /// The newest batch id whose bytes are known to be durable (with deferred segment syncs).
    known_synced: i64,
    /// Under [`Durability::Normal`](crate::Durability::Normal): chunks sealed without a commit
    /// record wait for a sync of the WAL (one failed), and readers do not list them.
    seals_unsynced: bool,
    /// What the uploader has in flight, spared by `DropOldest` while it can be.
    in_flight: crate::ChunksInFlight,
    /// How far `DropOldest`'s drops are committed and durable.
    drops: crate::DropMarks,
    /// The first of those syncs that failed: no later one is trusted (see `sync_normal_seals`).
    wal_sync_failed: Option<String>,
    /// Whether the WAL's directory was synced once its file existed (under `Normal`).
    wal_dir_synced: bool,
    /// Unit tests: the next writer transaction fails at `COMMIT`, after its segment write.
    #[cfg(test)]
    fail_next_commit: bool,
    /// Unit tests: syncs of the WAL under `Normal` fail.
    #[cfg(test)]
    fail_wal_syncs: bool,
    /// Held for as long as this writer lives (`lock.rs`); declared last, so released after
    /// the connection and the segment files are closed.
    _lock: SpoolLock,
}

impl Spool {
    /// Opens the spool at `opts.path`, creating the file (and its parent directory) if missing.
    ///
    /// A file that is not a SQLite database, fails `PRAGMA quick_check`, or is not a spool is
    /// moved aside as `<path>.corrupt-<unix-seconds>` (with its `-wal`/`-shm`), logged with
    /// `tracing::error!`, and replaced by a fresh spool with a new [`SpoolId`]; see
    /// [`OpenReport::quarantined`]. Counters are loaded from the database, so accounting is right
    /// after a restart.
    ///
    /// # Errors
    /// [`SpoolError::Locked`] while another process (or another `Spool`) has the file open;
    /// [`SpoolError::UnsupportedSchema`] for a file from a newer version (left untouched);
    /// [`SpoolError::Io`] / [`SpoolError::Sqlite`] when the file cannot be opened at all (locks,
    /// permissions); [`SpoolError::Unrecoverable`] if even a fresh file is unusable.
    pub fn open(opts: SpoolOptions) -> Result<(Spool, OpenReport), SpoolError> {
        // Before anything is read: recovery may move a damaged file aside, and replay writes.
        let lock = SpoolLock::acquire(&opts.path)?;
        let (opened, quarantined) = recovery::open(&opts)?;
        let report = OpenReport {
            created: opened.created,
            quarantined,
            open_batches: opened.state.open_batches(),
            sealed_chunks: opened.state.sealed_chunks(),
            unsynced_records_dropped: opened.unsynced.records,
            replayed_records: opened.replayed.records,
            host: opened.host.clone(),
        };
        match &report.host {
            crate::HostCheck::Moved { from, old_id, new_id } => tracing::warn!(
                path = %opts.path.display(),
                from_host = %from,
                this_host = opts.host_id.as_deref().unwrap_or_default(),
                %old_id,
                %new_id,
                "the spool file was last opened on another machine (a copied disk image): it has a new spool id, so \
                 that its records cannot collide with the other machine's at the ingest; the chunks it brought along \
                 that the other machine delivered too will be stored twice"
            ),
            crate::HostCheck::Adopted { damaged: Some(why) } => tracing::warn!(
                path = %opts.path.display(),
                %why,
                "the spool's record of its machine was damaged; it names this machine again"
            ),
            _ => {}
        }
        tracing::info!(
            path = %opts.path.display(),
            spool_id = %opened.id,
            created = report.created,
            open_batches = report.open_batches,
            sealed_chunks = report.sealed_chunks,
            unsynced_records_dropped = report.unsynced_records_dropped,
            replayed_records = report.replayed_records,
            "spool opened"
        );
        let reserve = Reserve::open(recovery::with_suffix(&opts.path, "-reserve"), opts.disk_reserve_bytes);
        if opts.durability == crate::Durability::Normal {
            // Before the segments are cut to, and deleted by, what the index says (below): under
            // `NORMAL` the last run's commits may be in the WAL alone (a process crash leaves
            // them in the page cache), and a power cut after a durable cut and before them
            // would bring back an index whose commit records the cut took, and seals that replay
            // could not restore. (Under `FULL` open's lost-tail check commits with a sync of
            // the WAL first.)
            let _ = checkpoint_truncate(&opened.conn);
            let wal = recovery::with_suffix(&opts.path, "-wal");
            sync_wal_file(&wal, &opts.path).map_err(|source| SpoolError::Io { path: wal, source })?;
        }
        crate::crash_point!("spool::open::before_segments");
        // Where the commit records end in the newest segment; after a lost tail was dropped,
        // records of dropped commits may lie before that end: a new segment is started instead.
        let tail = opened.replayed.tail.filter(|_| opened.unsynced == crate::unsynced::Dropped::default());
        let segments = SegmentWriter::open(
            &opts.path,
            opts.segment_target_bytes,
            &opened.state.segments,
            opened.created,
            opts.durability,
            tail,
        )?;
        let mut spool = Spool {
            conn: opened.conn,
            id: opened.id,
            opts,
            state: opened.state,
            reserve,
            segments,
            visible: Visible::default(),
            syncs: None,
            unsynced: VecDeque::new(),
            known_synced: 0,
            seals_unsynced: false,
            in_flight: crate::ChunksInFlight::default(),
            drops: crate::DropMarks::default(),
            wal_sync_failed: None,
            wal_dir_synced: false,
            #[cfg(test)]
            fail_next_commit: false,
            #[cfg(test)]
            fail_wal_syncs: false,
            _lock: lock,
        };
        if spool.opts.durability == crate::Durability::Normal {
            // The last run's seals may still be in the WAL alone (a process crash leaves them
            // in the page cache): durable before they are sent again.
            spool.visible.set(0);
            spool.seals_unsynced = spool.newest_chunk().is_some();
            // Written again first, into the main file, which the checkpoint syncs: after a
            // write-back that failed in an earlier process, the WAL's pages may be in the cache,
            // marked clean, and not on disk, and a sync of the WAL would write nothing (the error
            // was that process's). Where the checkpoint cannot complete (a reader, a full disk),
            // the sync of the WAL below is what vouches for the seals.
            if spool.seals_unsynced && !spool.checkpoint_truncate() {
                tracing::warn!(path = %spool.opts.path.display(), "the spool's WAL could not be checkpointed at open; its seals are made durable by a sync of the WAL alone");
            }
            spool.sync_normal_seals();
            // A spool whose WAL cannot be synced at open would hold everything unsent: refused,
            // for a later start (`Restart=`) to try again.
            if let Some(e) = spool.wal_sync_failed.take() {
                let path = recovery::with_suffix(&spool.opts.path, "-wal");
                return Err(SpoolError::Io { path, source: std::io::Error::other(e) });
            }
        }
        // Every drop so far is durable: committed under `FULL`, or synced by the open.
        spool.drops = crate::DropMarks::at(u64::try_from(spool.state.meta.dropped_chunks).unwrap_or(0));
        Ok((spool, report))
    }

    /// The identity drawn when this file was created, or when open found it had been copied
    /// from another machine ([`HostCheck::Moved`](crate::HostCheck::Moved)).
    pub fn id(&self) -> SpoolId {
        self.id
    }

    /// Gives the spool a new random [`SpoolId`], committed with `synchronous = FULL`, and
    /// returns it: for an agent that learned that another uses this id (a copy of the file on
    /// another machine that kept this one's machine id too). Chunks and sequence numbers stay;
    /// the ingest knows them under the new id from the next connection on. Returns the new id.
    ///
    /// # Errors
    /// SQLite errors (a full disk among them); the id is then unchanged.
    pub fn rekey(&mut self) -> Result<SpoolId, SpoolError> {
        let new_id = SpoolId::random();
        crate::host::write_new_id(&mut self.conn, None, new_id)?;
        self.state.meta.spool_id = new_id.0.to_vec();
        self.id = new_id;
        Ok(new_id)
    }

    /// The options in force (including limits changed by [`Spool::set_limits`]).
    pub fn options(&self) -> &SpoolOptions {
        &self.opts
    }

    /// Applies one writer iteration in ONE transaction (one `COMMIT`, one fsync under
    /// [`Durability::Full`](crate::Durability::Full)): first the acks (so the space they free
    /// is there for the appends), then the appends, then the seals `seal` asks for. Returns only
    /// after `COMMIT` at the configured durability.
    ///
    /// Appends behave as in [`Spool::append`] (per-request all-or-nothing, capacity checked per
    /// request in order, sealing by size), acks as in [`Spool::ack`], seals as in
    /// [`Spool::seal_due`] / [`Spool::seal_all`], evaluated after the appends.
    ///
    /// Failure isolation: when the transaction fails (e.g. [`SpoolError::DiskFull`] because of
    /// the appends) or the appends are refused beforehand (the disk reserve is in use), the acks
    /// and seals are committed again on their own, with the disk-reserve headroom that acks get,
    /// and the error is reported in [`CommitReport::appends`]: no request was stored.
    ///
    /// # Errors
    /// When even the acks and seals alone could not be committed. Then nothing of the call was
    /// stored, acked or sealed.
    pub fn commit(
        &mut self,
        appends: &[AppendRequest],
        acks: &[ChunkId],
        seal: SealWhat,
        now_ms: u64,
    ) -> Result<CommitReport, SpoolError> {
        let together = if appends.is_empty() {
            // Acks and seals alone must work on a full disk too: data stuck in open batches is
            // never uploaded, and only acks free space.
            self.with_headroom(|s| s.commit_once(&[], acks, seal, now_ms))
        } else {
            self.append_gate(now_ms).and_then(|()| self.commit_once(appends, acks, seal, now_ms))
        };
        let err = match together {
            Ok((outcomes, acks, sealed)) => return Ok(CommitReport { appends: Ok(outcomes), acks, sealed }),
            Err(e) if appends.is_empty() => return Err(e),
            Err(e) => e,
        };
        if matches!(err, SpoolError::DiskFull) {
            // A large WAL may be what fills the disk; shrinking it costs nothing if it works.
            self.checkpoint_truncate();
        }
        let (_, acks, sealed) = self.with_headroom(|s| s.commit_once(&[], acks, seal, now_ms))?;
        Ok(CommitReport { appends: Err(err), acks, sealed })
    }

    /// Stores the requests in one transaction (group commit) and returns one outcome per
    /// request, in order. Returns only after `COMMIT` at the configured durability.
    ///
    /// Capacity is checked per request, in order: see [`FullPolicy`]. A request whose bytes
    /// exceed `max_bytes` is always [`AppendOutcome::Full`]. After each batch, a stream whose open
    /// bytes reach `chunk_target_bytes` is sealed, so a chunk holds at most about the target
    /// plus one batch; before a batch that would take it past `chunk_max_records`, too.
    ///
    /// # Errors
    /// On `Err` nothing of the call was stored ([`SpoolError::DiskFull`] when the disk is full).
    pub fn append(&mut self, reqs: &[AppendRequest], now_ms: u64) -> Result<Vec<AppendOutcome>, SpoolError> {
        self.commit(reqs, &[], SealWhat::Nothing, now_ms)?.appends
    }

    /// Seals every stream whose oldest open batch is at least `linger` old at `now_ms` (or
    /// whose oldest batch lies in the future of `now_ms`: the clock went backwards, and waiting
    /// for it to catch up could hold data for hours; or whose open batches have no time: their
    /// rows are damaged). Returns the number of chunks sealed.
    ///
    /// # Errors
    /// On `Err` nothing was sealed.
    pub fn seal_due(&mut self, now_ms: u64) -> Result<u32, SpoolError> {
        Ok(sealed_count(&self.commit(&[], &[], SealWhat::Due, now_ms)?))
    }

    /// Seals every stream that has open batches (e.g. at shutdown). Returns the chunks sealed.
    ///
    /// # Errors
    /// On `Err` nothing was sealed.
    pub fn seal_all(&mut self, now_ms: u64) -> Result<u32, SpoolError> {
        Ok(sealed_count(&self.commit(&[], &[], SealWhat::All, now_ms)?))
    }

    /// Deletes the acknowledged chunks and their batches in one transaction. Ids not in the
    /// spool (already acked, dropped, quarantined, unknown) are counted in
    /// [`AckReport::unknown`], not treated as errors.
    ///
    /// # Errors
    /// On `Err` nothing was deleted; the chunks will be offered again, which is safe.
    pub fn ack(&mut self, chunks: &[ChunkId]) -> Result<AckReport, SpoolError> {
        Ok(self.commit(&[], chunks, SealWhat::Nothing, 0)?.acks)
    }

    /// Refuses appends while the disk reserve is in use and cannot be written back: producer
    /// data must not take the acks' headroom. (Free pages inside the database file are no
    /// excuse since version 4: payload goes to segment files, which need the file system's
    /// space.)
    fn append_gate(&mut self, now_ms: u64) -> Result<(), SpoolError> {
        if !self.reserve.is_present() {
            self.segments.drop_spares();
            self.checkpoint_truncate();
            if !self.reserve.try_restore(now_ms) {
                return Err(SpoolError::DiskFull);
            }
        }
        Ok(())
    }

    /// One transaction: acks, appends, seals. Does nothing (no transaction) when there is
    /// nothing to do.
    fn commit_once(
        &mut self,
        reqs: &[AppendRequest],
        acks: &[ChunkId],
        seal: SealWhat,
        now_ms: u64,
    ) -> Result<(Vec<AppendOutcome>, AckReport, Vec<ChunkMeta>), SpoolError> {
        let linger_ms = u64::try_from(self.opts.linger.as_millis()).unwrap_or(u64::MAX);
        if reqs.is_empty() && acks.is_empty() && seal_names(&self.state, seal, linger_ms, now_ms).is_empty() {
            return Ok((Vec::new(), AckReport::default(), Vec::new()));
        }
        let target = if reqs.is_empty() { None } else { Some(self.segments.prepare()?) };
        let result = self.commit_tx(reqs, acks, seal, now_ms, target);
        let (st, done) = match result {
            Ok(r) => r,
            Err(e) => {
                self.segments.abandon();
                // A segment retired by the failure may hold no rows.
                self.segments.collect(std::iter::empty(), &self.state.segments, self.reserve.is_present());
                self.drops.rolled_back(u64::try_from(self.state.meta.dropped_chunks).unwrap_or(0));
                return Err(e);
            }
        };
        self.segments.committed();
        // Seals in a commit that appended nothing, so without a commit record: durable only
        // with the WAL.
        let unrecorded_seals = st.next_batch_id == self.state.next_batch_id && !done.2.is_empty();
        if let Some(syncs) = &self.syncs
            && unrecorded_seals
        {
            // After `COMMIT`, so that a sync already running does not take the need.
            syncs.need_wal();
        }
        // Drops are in no commit record either: durable only with the WAL.
        if st.meta.dropped_chunks > self.state.meta.dropped_chunks {
            let total = u64::try_from(st.meta.dropped_chunks).unwrap_or(0);
            match &self.syncs {
                Some(syncs) => syncs.need_wal(),
                None if self.opts.durability == crate::Durability::Full => self.drops.durable(total),
                None => {}
            }
        }
        if self.syncs.is_some() && st.next_batch_id > self.state.next_batch_id {
            self.unsynced.push_back((self.segments.last_write(), st.next_batch_id.saturating_sub(1)));
        }
        // Segments whose last row this commit deleted.
        self.segments.collect(self.state.segments.keys(), &st.segments, self.reserve.is_present());
        self.state = st;
        if self.syncs.is_none() && self.opts.durability == crate::Durability::Normal {
            self.seals_unsynced |= unrecorded_seals;
            if self.seals_unsynced {
                self.sync_normal_seals();
            } else {
                self.visible.set(self.newest_chunk().map_or(0, |c| c.0));
            }
        }
        Ok(done)
    }

    /// Under [`Durability::Normal`](crate::Durability::Normal), `COMMIT` does not sync the WAL.
    /// A chunk sealed by a commit without a commit record (seals on their own: linger, shutdown)
    /// and sent before the WAL reached the disk could be stored by the ingest and then rolled
    /// back by a power cut: sealed again under the same sequence number, with records accepted
    /// after the restart, it would be taken for the duplicate and those records lost. So such
    /// seals are made durable with a sync of the WAL before readers list them (and before the
    /// caller hands them over: [`Spool::seals_wait_for_sync`]). Seals in a commit record are
    /// durable at `COMMIT`, with the segment's sync. After a failed sync no later one is
    /// trusted: the chunks sealed since stay unlisted until the next open syncs again.
    fn sync_normal_seals(&mut self) {
        if self.wal_sync_failed.is_some() {
            // Linux may drop the dirty pages of a failed write-back and report the error once:
            // a later successful sync would prove nothing. What was sealed since stays unlisted
            // in this process; the next start syncs the WAL again.
            self.seals_unsynced = true;
            return;
        }
        let wal = recovery::with_suffix(&self.opts.path, "-wal");
        #[cfg(test)]
        let simulated = self.fail_wal_syncs;
        #[cfg(not(test))]
        let simulated = false;
        // The reliability tests' way to fail a real process's sync (`failpoints` builds only).
        #[cfg(feature = "failpoints")]
        let simulated = simulated || fail::eval("spool::normal_wal_sync", |_| ()).is_some();
        let synced = if simulated {
            Err(std::io::Error::other("WAL sync failed (simulated)"))
        } else {
            match std::fs::File::open(&wal) {
                // The WAL's name too, once: SQLite syncs the directory of a WAL it created only
                // in a sync of its own, which under `NORMAL` waits for the first checkpoint.
                Ok(f) => f.sync_data().and_then(|()| {
                    if !self.wal_dir_synced {
                        crate::segment::sync_dir(&self.opts.path).map_err(std::io::Error::other)?;
                        self.wal_dir_synced = true;
                    }
                    Ok(())
                }),
                // No WAL: everything is in the main file, synced by the checkpoint that removed it.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
                Err(e) => Err(e),
            }
        };
        match synced {
            Ok(()) => {
                self.seals_unsynced = false;
                self.visible.set(self.newest_chunk().map_or(0, |c| c.0));
            }
            Err(e) => {
                tracing::error!(wal = %wal.display(), error = %e, "could not fsync the spool's WAL: the chunks sealed from now on are not sent by this process (a failed sync may have lost writes without saying so again); the next open writes the WAL into the main file again");
                self.wal_sync_failed = Some(e.to_string());
                self.seals_unsynced = true;
            }
        }
    }

    /// How far this spool's drops are committed and durable (see
    /// [`DropMarks`](crate::DropMarks)). Under `FULL` without deferred syncs a drop is durable
    /// at its `COMMIT`, and marked so; with them, whoever runs the [`WalSync`] marks it once a
    /// sync after its commit returned (the commit asks that sync to include the WAL); under
    /// [`Durability::Normal`](crate::Durability::Normal) only the next open makes it durable,
    /// and the spool marks nothing: its owner decides what it waits for.
    pub fn drop_marks(&self) -> crate::DropMarks {
        self.drops.clone()
    }

    /// The set of chunks in flight the uploader keeps up to date, shared with this spool (see
    /// [`ChunksInFlight`](crate::ChunksInFlight)).
    pub fn chunks_in_flight(&self) -> crate::ChunksInFlight {
        self.in_flight.clone()
    }

    /// The error of the WAL sync that failed under [`Durability::Normal`](crate::Durability::Normal),
    /// if one did: from then on this process sends nothing sealed (see
    /// [`Spool::seals_wait_for_sync`]); the next open writes the WAL into the main file again.
    pub fn wal_sync_failed(&self) -> Option<&str> {
        self.wal_sync_failed.as_deref()
    }

    /// Whether chunks sealed so far wait for a sync of the WAL before they may be sent (under
    /// [`Durability::Normal`](crate::Durability::Normal), once one failed: until the next open;
    /// readers do not list them meanwhile). Always `false` with `Full`, and with
    /// [`Spool::defer_wal_sync`], whose [`WalSync`] the caller waits for instead.
    pub fn seals_wait_for_sync(&self) -> bool {
        self.seals_unsynced
    }

    /// The transaction of [`Spool::commit_once`]: returns the counters to swap in. The
    /// appended batches are written, back to back, to segment `target` (segment, offset)
    /// before the index rows are committed.
    #[allow(clippy::type_complexity)]
    fn commit_tx(
        &mut self,
        reqs: &[AppendRequest],
        acks: &[ChunkId],
        seal: SealWhat,
        now_ms: u64,
        target: Option<(i64, u64)>,
    ) -> Result<(State, (Vec<AppendOutcome>, AckReport, Vec<ChunkMeta>)), SpoolError> {
        let linger_ms = u64::try_from(self.opts.linger.as_millis()).unwrap_or(u64::MAX);
        let mut st = self.state.clone();
        let first_new_stream = st.next_stream_id;
        let mut chunk_rows = Vec::new();
        let segments = &mut self.segments;
        let tx = begin(&mut self.conn)?;
        let mut touched = BTreeSet::new();
        let mut report = AckReport::default();
        for &id in acks {
            match delete_chunk(&tx, &mut st, id, Unchecked::Trusted)? {
                Some(deleted) => {
                    report.acked += 1;
                    touched.insert(deleted.stream_id);
                }
                None => report.unknown += 1,
            }
        }
        let mut sealed = Vec::new();
        let mut outcomes = Vec::with_capacity(reqs.len());
        let mut dropped = Dropped::default();
        // The batches this call appends to a stream, back to back, become one row (see
        // `PendingRow`): a row per request would cost a B-tree cell, an index entry and their
        // pages for every 10 KiB request.
        let mut pending = PendingRow::new(target);
        for req in reqs {
            // Before `make_room`, which may drop chunks for it.
            if new_streams(&st, req) > self.opts.max_streams.saturating_sub(st.streams.len() as u64) {
                outcomes.push(AppendOutcome::TooManyStreams);
                continue;
            }
            if !make_room(&tx, &mut st, &self.opts, req.bytes(), &self.in_flight, &mut dropped)? {
                outcomes.push(AppendOutcome::Full);
                continue;
            }
            for batch in &req.batches {
                if pending.stream.as_deref().is_some_and(|s| s != batch.stream) {
                    pending.flush(&tx, &mut st, now_ms)?;
                }
                let stream = stream_entry(&tx, &mut st, &batch.stream)?;
                // Saturating, here and below: a damaged open batch row may be counted as anything
                // up to `u64::MAX` (`state::sum_open_batches`); the stream is then sealed at once.
                if stream.open_records > 0
                    && stream.open_records.saturating_add(u64::from(batch.records))
                        > u64::from(self.opts.chunk_max_records)
                {
                    // A chunk over the ingest's record limit could never be delivered.
                    pending.flush(&tx, &mut st, now_ms)?;
                    sealed.extend(seal_stream(&tx, &mut st, &batch.stream, now_ms, &mut chunk_rows)?);
                }
                let stream = stream_entry(&tx, &mut st, &batch.stream)?;
                let before = Counted::of(stream);
                stream.open_records = stream.open_records.saturating_add(u64::from(batch.records));
                stream.open_bytes = stream.open_bytes.saturating_add(len_u64(&batch.data));
                stream.oldest_open_ms = min_opt(stream.oldest_open_ms, Some(now_ms));
                let full = stream.open_bytes >= self.opts.chunk_target_bytes;
                let after = Counted::of(stream);
                st.recount(&before, &after);
                pending.push(batch);
                if full {
                    pending.flush(&tx, &mut st, now_ms)?;
                    sealed.extend(seal_stream(&tx, &mut st, &batch.stream, now_ms, &mut chunk_rows)?);
                }
            }
            outcomes.push(AppendOutcome::Accepted);
        }
        pending.flush(&tx, &mut st, now_ms)?;
        for name in seal_names(&st, seal, linger_ms, now_ms) {
            sealed.extend(seal_stream(&tx, &mut st, &name, now_ms, &mut chunk_rows)?);
        }
        if dropped.chunks > 0 {
            for (key, n) in [(META_DROPPED_CHUNKS, dropped.chunks), (META_DROPPED_RECORDS, dropped.records)] {
                tx.prepare_cached("UPDATE meta SET value = value + ?2 WHERE key = ?1")
                    .and_then(|mut s| s.execute((key, sql_u64(n))))
                    .map_err(ctx("counting dropped chunks"))?;
            }
            st.meta.dropped_chunks = st.meta.dropped_chunks.saturating_add(sql_u64(dropped.chunks));
            st.meta.dropped_records = st.meta.dropped_records.saturating_add(sql_u64(dropped.records));
            tx.prepare_cached("UPDATE meta SET value = ?2 WHERE key = ?1")
                .and_then(|mut s| s.execute((META_ROW_CRC, st.meta.crc())))
                .map_err(ctx("updating the meta checksum"))?;
            touched.extend(&dropped.streams);
        }
        refresh_oldest_sealed(&tx, &mut st, &touched)?;
        settle_segments(&tx, &mut st)?;
        if let Some(syncs) = &self.syncs {
            // The newest batch whose bytes a completed sync covers, for open to check from. It
            // moves at most once per sync (a `meta` page in that commit's WAL frames), and keeps
            // the batches open checks to those of the last sync or two: above the mark, bytes
            // that fail their CRC are taken for a lost write, not for damage (`unsynced.rs`).
            let synced_write = syncs.synced_write();
            while let Some(&(write, batch)) = self.unsynced.front()
                && write <= synced_write
            {
                self.known_synced = self.known_synced.max(batch);
                self.unsynced.pop_front();
            }
            if st.segments_synced_through.is_some_and(|m| m < self.known_synced) {
                tx.prepare_cached("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)")
                    .and_then(|mut s| s.execute((META_SEGMENTS_SYNCED, crate::unsynced::mark_value(self.known_synced))))
                    .map_err(ctx("recording how far the segments are synced"))?;
                st.segments_synced_through = Some(self.known_synced);
            }
        }
        if pending.len > 0 {
            // The commit record around the payload (`journal.rs`): the rows this commit adds.
            let record = journal::Record {
                streams: st.names.range(first_new_stream..).map(|(id, name)| (*id, name.clone())).collect(),
                batches: std::mem::take(&mut pending.rows),
                chunks: chunk_rows,
            };
            let target = pending.target.map_or(0, |(segment, _)| segment);
            let prefix = journal::prefix(target, pending.len, journal::trailer_len(&record));
            let trailer = journal::trailer(&prefix, &record);
            let mut parts = Vec::with_capacity(pending.parts.len() + 2);
            parts.push(&prefix[..]);
            parts.extend_from_slice(&pending.parts);
            parts.push(&trailer);
            segments.write(&parts)?;
        }
        if !reqs.is_empty() {
            crate::crash_point!("spool::append::before_commit");
        }
        if !acks.is_empty() {
            crate::crash_point!("spool::ack::before_commit");
        }
        if !sealed.is_empty() {
            crate::crash_point!("spool::seal::before_commit");
        }
        if dropped.chunks > 0 {
            self.drops.committing(u64::try_from(st.meta.dropped_chunks).unwrap_or(0));
        }
        // Before `COMMIT`: a debug build that finds the counters astray commits nothing.
        st.check_counts();
        #[cfg(test)]
        if std::mem::take(&mut self.fail_next_commit) {
            return Err(SpoolError::Inconsistent("COMMIT failed (simulated)".into()));
        }
        tx.commit().map_err(ctx("committing a writer transaction"))?;
        if !reqs.is_empty() {
            crate::crash_point!("spool::append::after_commit");
        }
        if !acks.is_empty() {
            crate::crash_point!("spool::ack::after_commit");
        }
        if !sealed.is_empty() {
            crate::crash_point!("spool::seal::after_commit");
        }
        if dropped.chunks > 0 {
            tracing::warn!(
                chunks = dropped.chunks,
                records = dropped.records,
                max_bytes = self.opts.max_bytes,
                "spool full: dropped the oldest chunks to make room"
            );
        }
        if report.unknown > 0 {
            tracing::debug!(acked = report.acked, unknown = report.unknown, "ack for chunks not in the spool");
        }
        Ok((st, (outcomes, report, sealed)))
    }

    /// Takes a chunk out of circulation, keeping its rows for inspection: it is never offered
    /// again by [`SpoolReader::sealed_after`], acks for it count as unknown, and its bytes no
    /// longer count against `max_bytes`. Quarantining an already quarantined chunk is a no-op.
    ///
    /// # Errors
    /// [`SpoolError::ChunkGone`] if the chunk is not in the spool.
    ///
    /// With deferred syncs ([`Spool::defer_wal_sync`]) the quarantine is durable only once the
    /// next [`WalSync::sync`] returns (it syncs the WAL): a power cut before that brings the
    /// chunk back, to be sent again.
    pub fn quarantine(&mut self, chunk: ChunkId, reason: &str) -> Result<(), SpoolError> {
        self.with_headroom(|s| s.quarantine_once(chunk, reason))
    }

    fn quarantine_once(&mut self, chunk: ChunkId, reason: &str) -> Result<(), SpoolError> {
        let mut st = self.state.clone();
        let tx = begin(&mut self.conn)?;
        // `bytes` as stored: the row is not checked here (it is likely damaged: see `counted`).
        let row: Option<(i64, i64, bool)> = tx
            .prepare_cached("SELECT stream_id, bytes, quarantine IS NOT NULL FROM chunks WHERE id = ?1")
            .and_then(|mut s| s.query_row([chunk.0], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?))).optional())
            .map_err(ctx("looking up a chunk to quarantine"))?;
        let (stream_id, bytes) = match row {
            None => return Err(SpoolError::ChunkGone(chunk)),
            Some((_, _, true)) => return Ok(()),
            Some((stream_id, bytes, false)) => (stream_id, bytes),
        };
        reindex_damaged_rows(&tx, chunk, st.meta.legacy_batches_through)?;
        tx.prepare_cached("UPDATE chunks SET quarantine = ?2 WHERE id = ?1")
            .and_then(|mut s| s.execute((chunk.0, reason)))
            .map_err(ctx("quarantining a chunk"))?;
        let stream = stream_by_id(&mut st, stream_id)?;
        let before = Counted::of(stream);
        stream.sealed_chunks = stream.sealed_chunks.saturating_sub(1);
        stream.sealed_bytes = stream.sealed_bytes.saturating_sub(counted(bytes));
        let after = Counted::of(stream);
        st.recount(&before, &after);
        st.quarantined_chunks += 1;
        refresh_oldest_sealed(&tx, &mut st, &BTreeSet::from([stream_id]))?;
        st.check_counts();
        crate::crash_point!("spool::quarantine::before_commit");
        tx.commit().map_err(ctx("committing a quarantine"))?;
        crate::crash_point!("spool::quarantine::after_commit");
        // In no commit record: durable only with the WAL. After `COMMIT`, so that a sync
        // already running does not take the need.
        if let Some(syncs) = &self.syncs {
            syncs.need_wal();
        }
        self.state = st;
        tracing::warn!(chunk = chunk.0, reason, "chunk quarantined");
        Ok(())
    }

    /// Deletes every quarantined chunk and its batches. Returns how many chunks were deleted.
    ///
    /// # Errors
    /// On `Err` nothing was deleted.
    pub fn purge_quarantined(&mut self) -> Result<u64, SpoolError> {
        self.with_headroom(Spool::purge_quarantined_once)
    }

    fn purge_quarantined_once(&mut self) -> Result<u64, SpoolError> {
        let mut st = self.state.clone();
        let tx = begin(&mut self.conn)?;
        let ranges: Vec<(i64, (i64, i64, i64))> = tx
            .prepare("SELECT id, stream_id, first_batch, last_batch FROM chunks WHERE quarantine IS NOT NULL")
            .and_then(|mut s| s.query_map([], |r| Ok((r.get(0)?, (r.get(1)?, r.get(2)?, r.get(3)?))))?.collect())
            .map_err(ctx("listing quarantined chunks"))?;
        // Often quarantined for a damaged row: deleted within their neighbours, not by the row.
        for (id, range) in ranges {
            let range = checked_range(&tx, &st, ChunkId(id), range, Neighbours::Live)?;
            delete_batches(&tx, &mut st, range)?;
        }
        let n = tx
            .execute("DELETE FROM chunks WHERE quarantine IS NOT NULL", [])
            .map_err(ctx("purging quarantined chunks"))?;
        settle_segments(&tx, &mut st)?;
        st.quarantined_chunks = 0;
        st.check_counts();
        tx.commit().map_err(ctx("committing a purge"))?;
        self.segments.collect(self.state.segments.keys(), &st.segments, self.reserve.is_present());
        self.state = st;
        Ok(n as u64)
    }

    /// Changes the capacity limits at run time (config reload). They apply from the next
    /// [`Spool::append`]; lowering `max_bytes` evicts nothing by itself. Not persisted: the
    /// options passed to the next [`Spool::open`] apply after a restart.
    pub fn set_limits(&mut self, max_bytes: u64, full_policy: FullPolicy, max_streams: u64) {
        self.opts.max_bytes = max_bytes;
        self.opts.full_policy = full_policy;
        self.opts.max_streams = max_streams;
    }

    /// The bytes of the open (not yet sealed) batches of `stream`, from memory (no I/O); 0 for
    /// a stream the spool does not know. `u64::MAX` from an open that found a damaged row
    /// (a negative length, say) among them until they are sealed: their size is then not
    /// known, and bytes a caller kept of what it appended since are not all of them (the
    /// chunk is read, and its damage found, instead).
    pub fn open_bytes(&self, stream: &str) -> u64 {
        self.state.streams.get(stream).map_or(0, |s| if s.open_damaged { u64::MAX } else { s.open_bytes })
    }

    /// The bytes of every stream's open batches, from memory (no I/O).
    pub fn total_open_bytes(&self) -> u64 {
        self.state.open_bytes()
    }

    /// Counters, from memory (no I/O). True to disk after every call. A pass over every
    /// stream: see [`Spool::snapshot`] for each commit.
    pub fn stats(&self) -> SpoolStats {
        self.state.stats()
    }

    /// What [`Spool::stats`] is made from, taken in O(1) whatever the number of streams: for a
    /// writer that publishes the counters after every commit and lets readers make the
    /// statistics when they ask.
    pub fn snapshot(&self) -> crate::Snapshot {
        self.state.snapshot()
    }

    /// Opens a second, read-only connection to the same file, for the uploader.
    ///
    /// # Errors
    /// When SQLite cannot open the file.
    pub fn reader(&self) -> Result<SpoolReader, SpoolError> {
        SpoolReader::open(&self.opts.path, self.state.meta.legacy_batches_through, self.visible.clone())
    }

    /// The id of the newest chunk ever sealed in this file (acked or not), from memory; `None`
    /// before the first seal.
    pub fn newest_chunk(&self) -> Option<ChunkId> {
        let newest = self.state.next_chunk_id.saturating_sub(1);
        (newest > 0).then_some(ChunkId(newest))
    }

    /// Takes the WAL's sync off the commit path, for [`Durability::Full`](crate::Durability::Full)
    /// (with `Normal` there is no sync to move, and this returns `None`).
    ///
    /// From this call on, the connection runs `synchronous=NORMAL`: a write returns once its
    /// transaction is in the WAL, **before it is durable**, and the returned [`WalSync`] makes
    /// it durable: for a commit that appends, by syncing the segment that holds its bytes and
    /// its commit record (open adds its rows back from the record if the WAL lost them); for
    /// seals made without appends, by syncing the WAL. The caller must not act on a commit
    /// (answer a producer, send what it sealed) before a [`WalSync::sync`] that started after
    /// the commit returned `Ok`. Readers from
    /// [`Spool::reader`] list chunks only up to the `sealed_through` of the last good sync, and
    /// payload segments are deleted only after a sync of the WAL of their own (else a power
    /// cut could bring back rows that point into a deleted file). Everything committed so far
    /// is synced here, so every chunk in the file now is visible.
    ///
    /// # Errors
    /// When the pragma cannot be set or the WAL cannot be synced; the spool is then unchanged
    /// (still `synchronous=FULL`).
    pub fn defer_wal_sync(&mut self) -> Result<Option<WalSync>, SpoolError> {
        if self.opts.durability != crate::Durability::Full {
            return Ok(None);
        }
        // Every batch's bytes are durable now (synced with their commit, or checked and synced
        // by open): the mark starts at the newest batch, in a commit `FULL` makes durable.
        let mark = self.state.next_batch_id.saturating_sub(1);
        self.conn
            .execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)",
                (META_SEGMENTS_SYNCED, crate::unsynced::mark_value(mark)),
            )
            .map_err(ctx("recording how far the segments are synced"))?;
        self.state.segments_synced_through = Some(mark);
        self.known_synced = mark;
        let syncs = SegmentSyncs::default();
        let mut sync = WalSync::open(recovery::with_suffix(&self.opts.path, "-wal"), self.visible.clone())?
            .with_segments(self.opts.path.clone(), syncs.clone())?;
        // Commits before this call were synced by `FULL`, or made under `Normal` by an earlier
        // run: sync once, the WAL included, then every chunk in the file is durable.
        syncs.need_wal();
        sync.sync(None)?;
        self.conn.pragma_update(None, "synchronous", "NORMAL").map_err(ctx("setting synchronous"))?;
        self.segments.sync_wal_before_delete(true);
        self.segments.defer_syncs(syncs.clone());
        self.syncs = Some(syncs);
        self.visible.set(self.newest_chunk().map_or(0, |c| c.0));
        Ok(Some(sync))
    }

    /// With deferred syncs ([`Spool::defer_wal_sync`]), after the [`WalSync`]'s last sync (at
    /// shutdown): when every payload byte written is durable, moves the synced-segments mark
    /// to the newest batch, so that the next open checks nothing and a batch damaged while the
    /// agent was stopped is found as damage when its chunk is read (quarantined, as without
    /// deferred syncs), not taken for a lost write. Does nothing otherwise.
    ///
    /// # Errors
    /// When the mark cannot be written; the next open then checks the batches above the old one.
    pub fn mark_synced(&mut self) -> Result<(), SpoolError> {
        let Some(syncs) = &self.syncs else { return Ok(()) };
        if syncs.synced_write() < self.segments.last_write() {
            return Ok(());
        }
        let newest = self.state.next_batch_id.saturating_sub(1);
        if self.state.segments_synced_through.is_none_or(|m| m >= newest) {
            return Ok(());
        }
        self.conn
            .execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)",
                (META_SEGMENTS_SYNCED, crate::unsynced::mark_value(newest)),
            )
            .map_err(ctx("recording how far the segments are synced"))?;
        self.state.segments_synced_through = Some(newest);
        self.known_synced = newest;
        self.unsynced.clear();
        Ok(())
    }

    /// Runs a write that frees (or must not be blocked by a lack of) disk space. On
    /// `SQLITE_FULL` from the file system, releases the disk reserve, checkpoints the WAL into
    /// the main file and truncates it, then tries once more. While the reserve is released,
    /// every such write is followed by a truncating checkpoint, so the WAL does not regrow into
    /// the space the reserve needs to come back.
    fn with_headroom<T>(&mut self, mut op: impl FnMut(&mut Self) -> Result<T, SpoolError>) -> Result<T, SpoolError> {
        let mut result = op(self);
        if matches!(result, Err(SpoolError::DiskFull)) {
            // Without a reserve to release, the checkpoint alone may still free the WAL's space.
            self.reserve.release();
            self.segments.drop_spares();
            self.checkpoint_truncate();
            result = op(self);
        }
        if !self.reserve.is_present() && result.is_ok() {
            self.checkpoint_truncate();
        }
        result
    }

    /// `PRAGMA wal_checkpoint(TRUNCATE)`, best effort: copies the WAL into the main file and
    /// cuts the WAL to zero bytes. Fails harmlessly (logged at debug) when a reader holds an old
    /// snapshot or the main file cannot grow.
    ///
    /// A truncating checkpoint waits for every reader through the busy handler. On a full disk
    /// one commit may run it up to four times, and a long reader (a `spool check` of a large
    /// spool) would make each wait the whole [`crate::schema::BUSY_TIMEOUT`] while producers and acks
    /// stand still; so it waits [`crate::schema::CHECKPOINT_WAIT`] at most and gives up.
    ///
    /// Returns whether it completed.
    fn checkpoint_truncate(&mut self) -> bool {
        checkpoint_truncate(&self.conn)
    }

    /// How many times the disk reserve was released because the file system was full.
    pub fn disk_reserve_releases(&self) -> u64 {
        self.reserve.releases
    }

    /// Test access to the raw connection (e.g. to impose `max_page_count`).
    #[cfg(test)]
    pub(crate) fn conn(&self) -> &rusqlite::Connection {
        &self.conn
    }

    /// Unit tests: payload segment writes fail with `ENOSPC` (with `max_page_count` for the
    /// index, a full disk).
    #[cfg(test)]
    pub(crate) fn simulate_full_segments(&mut self, full: bool) {
        self.segments.simulate_full = full;
    }
}

/// What DropOldest evicted during one `append`.
#[derive(Debug, Default)]
struct Dropped {
    chunks: u64,
    records: u64,
    streams: BTreeSet<i64>,
}

/// A deleted chunk row.
struct DeletedChunk {
    stream_id: i64,
    records: u64,
}

/// The streams `what` asks to seal, given the counters: those with open batches (`All`), or
/// those whose oldest open batch is at least `linger_ms` old at `now_ms`, lies in its future
/// or has no time (`Due`).
fn seal_names(st: &State, what: SealWhat, linger_ms: u64, now_ms: u64) -> Vec<String> {
    let due = |s: &StreamState| match what {
        SealWhat::Nothing => false,
        // Open batches without a time (damaged rows: `state::sum_open_batches`) cannot wait out
        // `linger`: due at once, as a time in the future is, rather than open until the next
        // append to the stream.
        SealWhat::Due => s.oldest_open_ms.map_or(s.open_batches > 0, |t| now_ms < t || now_ms - t >= linger_ms),
        SealWhat::All => s.open_batches > 0,
    };
    if what == SealWhat::Nothing {
        return Vec::new();
    }
    // Only the streams with open batches (or an open time) can be due, whatever the spool
    // holds besides; in name order, as the streams are.
    let mut names: Vec<String> = st
        .open
        .iter()
        .filter_map(|id| st.names.get(id))
        .filter(|name| st.streams.get(name.as_str()).is_some_and(due))
        .cloned()
        .collect();
    names.sort_unstable();
    names
}

/// The batches one commit appends to one stream, back to back, gathered into one `batches` row:
/// their data concatenated (each batch is whole framed records, so the row is too), their
/// records summed, one CRC-32C over the row. Flushed when the next batch is for another
/// stream, before the stream is sealed, and at the end of the appends, so batch ids stay in
/// append order per stream and a seal always sees every open byte in rows.
///
/// The rows of one commit lie back to back in `parts` (the batches themselves, in order),
/// which go to segment `target` at its offset before the rows are committed.
#[derive(Debug)]
struct PendingRow<'a> {
    stream: Option<String>,
    /// `(segment, offset of the first part)`: where the commit's bytes go. `None` for a commit
    /// without appends.
    target: Option<(i64, u64)>,
    parts: Vec<&'a [u8]>,
    /// Bytes in `parts`.
    len: u64,
    /// The rows inserted, for the commit record.
    rows: Vec<BatchRow>,
    /// Where the current row starts, counted from the first part.
    row_start: u64,
    records: u64,
    crc: u32,
}

impl<'a> PendingRow<'a> {
    /// `target` is where the commit's record starts: its payload follows the record's prefix.
    fn new(target: Option<(i64, u64)>) -> Self {
        let target = target.map(|(segment, offset)| (segment, offset + journal::PREFIX));
        PendingRow {
            stream: None,
            target,
            parts: Vec::new(),
            len: 0,
            rows: Vec::new(),
            row_start: 0,
            records: 0,
            crc: 0,
        }
    }

    fn push(&mut self, batch: &'a Batch) {
        if self.stream.is_none() {
            self.stream = Some(batch.stream.clone());
        }
        self.parts.push(&batch.data);
        self.len += len_u64(&batch.data);
        self.records += u64::from(batch.records);
        self.crc = crate::crc::crc32c_append(self.crc, &batch.data);
    }

    /// Inserts the row, if any, and counts it as one open batch of its stream and as a row
    /// of its segment.
    fn flush(&mut self, tx: &Transaction<'_>, st: &mut State, now_ms: u64) -> Result<(), SpoolError> {
        let Some(name) = self.stream.take() else { return Ok(()) };
        let Some((segment, base)) = self.target else {
            return Err(SpoolError::Inconsistent("appending without a payload segment".into()));
        };
        let batch_id = st.next_batch_id;
        let stream = stream_entry(tx, st, &name)?;
        let len = self.len - self.row_start;
        let seg = SegRef { segment, offset: sql_u64(base + self.row_start), len: sql_u64(len) };
        let row = BatchRow {
            id: batch_id,
            stream_id: stream.id,
            records: sql_u64(self.records),
            crc32c: i64::from(self.crc),
            commit_ms: sql_u64(now_ms),
            seg: Some(seg),
        };
        tx.prepare_cached(
            "INSERT INTO batches (id, stream_id, records, crc32c, commit_ms, row_crc, segment, seg_offset, seg_len, data)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, X'')",
        )
        .and_then(|mut s| {
            s.execute((
                row.id,
                row.stream_id,
                row.records,
                row.crc32c,
                row.commit_ms,
                row.crc(),
                seg.segment,
                seg.offset,
                seg.len,
            ))
        })
        .map_err(ctx("inserting a batch"))?;
        let before = Counted::of(stream);
        stream.open_batches += 1;
        let after = Counted::of(stream);
        st.recount(&before, &after);
        st.next_batch_id = batch_id.saturating_add(1);
        self.rows.push(row);
        let used = st.segments.entry(segment).or_default();
        used.add_row(batch_id);
        used.end = used.end.max(base + self.len);
        self.row_start = self.len;
        self.records = 0;
        self.crc = 0;
        Ok(())
    }
}

fn begin(conn: &mut rusqlite::Connection) -> Result<Transaction<'_>, SpoolError> {
    conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(ctx("beginning a write transaction"))
}

/// SQLite stores integers as i64; times and counts beyond i64::MAX do not occur, so clamp.
fn sql_u64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// A chunk row's size or record count as the counters take it. Rows are read unchecked where
/// chunks leave the counters (ack, eviction, quarantine) and where they are loaded
/// (`State::load`): a damaged value (one flipped top bit makes it negative) counts 0, the same
/// in each place, rather than failing the write (an eviction failing on the oldest chunk would
/// fail every append) or the open. The read finds the damage by the row's checksum.
fn counted(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

/// The streams `req` names that the spool does not know yet (each counted once).
fn new_streams(st: &State, req: &AppendRequest) -> u64 {
    let mut new: Vec<&str> = Vec::new();
    for b in &req.batches {
        if !st.streams.contains_key(b.stream.as_str()) && !new.contains(&b.stream.as_str()) {
            new.push(&b.stream);
        }
    }
    new.len() as u64
}

/// Decides whether a request of `bytes` fits, evicting the oldest sealed chunks under
/// DropOldest. Evicts nothing if the request could not fit even with every sealed chunk gone.
fn make_room(
    tx: &Transaction<'_>,
    st: &mut State,
    opts: &SpoolOptions,
    bytes: u64,
    in_flight: &crate::ChunksInFlight,
    dropped: &mut Dropped,
) -> Result<bool, SpoolError> {
    let max = opts.max_bytes;
    if bytes > max {
        return Ok(false);
    }
    if st.total_bytes().saturating_add(bytes) <= max {
        return Ok(true);
    }
    if opts.full_policy == FullPolicy::Reject || st.open_bytes().saturating_add(bytes) > max {
        return Ok(false);
    }
    let sending = in_flight.snapshot();
    while st.total_bytes().saturating_add(bytes) > max {
        // The oldest chunks, as many as are in flight and one more: the oldest not in flight is
        // among them, or else every one is in flight and the oldest goes.
        let oldest: Vec<i64> = tx
            .prepare_cached("SELECT id FROM chunks WHERE quarantine IS NULL ORDER BY id LIMIT ?1")
            .and_then(|mut s| {
                s.query_map([i64::try_from(sending.len()).unwrap_or(i64::MAX).saturating_add(1)], |r| r.get(0))?
                    .collect()
            })
            .map_err(ctx("finding the oldest chunk"))?;
        let spare = oldest.iter().find(|id| sending.binary_search(id).is_err()).or(oldest.first());
        let Some(&id) = spare else {
            // The counters say sealed bytes exist but no chunk row does.
            return Err(SpoolError::Inconsistent("sealed byte counter is positive but no sealed chunk exists".into()));
        };
        let Some(deleted) = delete_chunk(tx, st, ChunkId(id), Unchecked::Bound)? else {
            return Err(SpoolError::Inconsistent(format!("chunk {id} vanished while dropping")));
        };
        dropped.chunks += 1;
        dropped.records += deleted.records;
        dropped.streams.insert(deleted.stream_id);
    }
    Ok(true)
}

/// Rebuilds the indexes of `chunks` (or `batches`) when the chunk's row (or a batch row in its
/// range) fails its checksum. A changed indexed value (`stream_id`, `seq`, `first_ms`) leaves
/// the row's index entries under the old value; SQLite's later updates and deletes of the row
/// then miss them, and the stale entries fail `quick_check` at the next open, which moves the
/// whole file aside (found by the `spool_recovery` fuzz target). Runs only on damage, before the
/// chunk is quarantined; `REINDEX batches` reads every batch row's page, so it is not done
/// otherwise.
fn reindex_damaged_rows(tx: &Transaction<'_>, chunk: ChunkId, legacy_batches_through: i64) -> Result<(), SpoolError> {
    let row = chunk_row(tx, chunk).map_err(ctx("checking a chunk row before quarantine"))?;
    let Some((c, stored)) = row else { return Ok(()) };
    if stored != Some(c.crc()) {
        tracing::warn!(chunk = chunk.0, "chunk row fails its checksum; rebuilding the indexes of `chunks`");
        tx.execute_batch("REINDEX chunks").map_err(ctx("rebuilding the indexes of chunks"))?;
    }
    // Every batch in the id range, of any stream: a changed stream_id is found by its checksum.
    let mut stmt = tx
        .prepare_cached(
            "SELECT id, stream_id, records, crc32c, commit_ms, row_crc, segment, seg_offset, seg_len
             FROM batches WHERE id BETWEEN ?1 AND ?2",
        )
        .map_err(ctx("checking batch rows before quarantine"))?;
    let mut rows = stmt.query((c.first_batch, c.last_batch)).map_err(ctx("checking batch rows before quarantine"))?;
    let mut damaged = false;
    while let Some(r) = rows.next().map_err(ctx("checking batch rows before quarantine"))? {
        let ok = (|| -> Option<bool> {
            let get = |i| r.get::<_, i64>(i).ok();
            let opt = |i| r.get::<_, Option<i64>>(i).ok();
            let seg = SegRef::from_columns((opt(6)?, opt(7)?, opt(8)?)).ok()?;
            let row = BatchRow {
                id: get(0)?,
                stream_id: get(1)?,
                records: get(2)?,
                crc32c: get(3)?,
                commit_ms: get(4)?,
                seg,
            };
            Some(row.ok(opt(5)?, legacy_batches_through))
        })();
        if ok != Some(true) {
            damaged = true;
            break;
        }
    }
    drop(rows);
    if damaged {
        tracing::warn!(chunk = chunk.0, "a batch row fails its checksum; rebuilding the indexes of `batches`");
        tx.execute_batch("REINDEX batches").map_err(ctx("rebuilding the indexes of batches"))?;
    }
    Ok(())
}

/// How [`delete_chunk`] takes the batch range of a chunk's row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unchecked {
    /// As it is: an acked chunk, whose row was checked when it was read to be sent.
    Trusted,
    /// Checked first, and within its neighbours if it fails ([`checked_range`]): a chunk
    /// dropped unread, by the cap.
    Bound,
}

/// Deletes a live (not quarantined) chunk and its batches, updating the counters except the
/// per-stream oldest time (see [`refresh_oldest_sealed`]). `None` if there is no such chunk.
fn delete_chunk(
    tx: &Transaction<'_>,
    st: &mut State,
    id: ChunkId,
    range: Unchecked,
) -> Result<Option<DeletedChunk>, SpoolError> {
    let row: Option<(i64, i64, i64, i64, i64)> = tx
        .prepare_cached(
            "SELECT stream_id, records, bytes, first_batch, last_batch FROM chunks
             WHERE id = ?1 AND quarantine IS NULL",
        )
        .and_then(|mut s| {
            s.query_row([id.0], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))).optional()
        })
        .map_err(ctx("looking up a chunk"))?;
    let Some((stream_id, records, bytes, first_batch, last_batch)) = row else {
        return Ok(None);
    };
    let batches = match range {
        Unchecked::Trusted => (stream_id, first_batch, last_batch),
        // Quarantined neighbours count: their batches are kept for inspection.
        Unchecked::Bound => checked_range(tx, st, id, (stream_id, first_batch, last_batch), Neighbours::All)?,
    };
    delete_batches(tx, st, batches)?;
    tx.prepare_cached("DELETE FROM chunks WHERE id = ?1")
        .and_then(|mut s| s.execute([id.0]))
        .map_err(ctx("deleting a chunk"))?;
    let stream = stream_by_id(st, stream_id)?;
    let before = Counted::of(stream);
    stream.sealed_chunks = stream.sealed_chunks.saturating_sub(1);
    stream.sealed_bytes = stream.sealed_bytes.saturating_sub(counted(bytes));
    let after = Counted::of(stream);
    st.recount(&before, &after);
    Ok(Some(DeletedChunk { stream_id, records: counted(records) }))
}

/// Chunk `id`'s row as stored, unchecked, and its stored checksum; `None` when there is none.
fn chunk_row(tx: &Transaction<'_>, id: ChunkId) -> rusqlite::Result<Option<(ChunkRow, Option<i64>)>> {
    tx.prepare_cached(
        "SELECT id, stream_id, seq, records, bytes, first_ms, sealed_ms, first_batch, last_batch, row_crc
         FROM chunks WHERE id = ?1",
    )
    .and_then(|mut s| s.query_row([id.0], |r| Ok((ChunkRow::from_row(r, 0)?, r.get(9)?))).optional())
}

/// Which of a stream's other chunks bound a damaged row's range ([`checked_range`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Neighbours {
    /// Every one: a chunk dropped by the cap keeps its quarantined neighbours' batches.
    All,
    /// Those not in quarantine: a purge deletes the quarantined ones all together.
    Live,
}

/// The batches of chunk `id` (`range`: stream, first and last batch id, as its row gives
/// them) for a row no one checked before its chunk is deleted (dropped by the cap unread,
/// purged from quarantine, where a damaged row is often the reason it is there). A row that
/// passes its checksum is taken as it is. One that fails is bounded by what its stream's other
/// rows say: above the last batch of the stream's chunk before it, below the first of the one
/// after it (of `neighbours`), and not past the stream's `sealed_through`, above which its
/// batches are open, in no chunk yet. So a damaged row deletes no other chunk's batches and no
/// open batch (records answered to their producers), at worst leaving some of its own behind.
fn checked_range(
    tx: &Transaction<'_>,
    st: &State,
    id: ChunkId,
    (stream_id, first, last): (i64, i64, i64),
    neighbours: Neighbours,
) -> Result<(i64, i64, i64), SpoolError> {
    // The row `range` came from, in this transaction: passing its checksum, it is that range.
    let row = chunk_row(tx, id).map_err(ctx("checking a chunk row before deleting its batches"))?;
    if row.is_some_and(|(c, stored)| stored == Some(c.crc())) {
        return Ok((stream_id, first, last));
    }
    tracing::warn!(chunk = id.0, "chunk row fails its checksum: its batches are deleted within its neighbours'");
    let live = if neighbours == Neighbours::Live { " AND quarantine IS NULL" } else { "" };
    let neighbour = |sql: String| -> Result<Option<i64>, SpoolError> {
        tx.prepare_cached(&sql)
            .and_then(|mut s| s.query_row((stream_id, id.0), |r| r.get(0)).optional())
            .map_err(ctx("bounding a chunk's batches by its neighbours"))
    };
    let before = neighbour(format!(
        "SELECT last_batch FROM chunks WHERE id < ?2 AND stream_id = ?1{live} ORDER BY id DESC LIMIT 1"
    ))?;
    let after = neighbour(format!(
        "SELECT first_batch FROM chunks WHERE id > ?2 AND stream_id = ?1{live} ORDER BY id LIMIT 1"
    ))?;
    // A stream the counters do not know has no batches either (its rows would have named it).
    let sealed_through =
        st.names.get(&stream_id).and_then(|name| st.streams.get(name)).map_or(i64::MIN, |s| s.sealed_through);
    let first = first.max(before.map_or(i64::MIN, |b| b.saturating_add(1)));
    let last = last.min(after.map_or(i64::MAX, |a| a.saturating_sub(1))).min(sealed_through);
    Ok((stream_id, first, last))
}

/// Deletes the batches of a chunk: those of stream `.0` with ids in `.1..=.2`, and takes their
/// bytes off their segments' live counts (see [`settle_segments`]).
fn delete_batches(
    tx: &Transaction<'_>,
    st: &mut State,
    (stream_id, first, last): (i64, i64, i64),
) -> Result<(), SpoolError> {
    let mut stmt = tx
        .prepare_cached("DELETE FROM batches WHERE stream_id = ?1 AND id BETWEEN ?2 AND ?3 RETURNING segment")
        .map_err(ctx("deleting a chunk's batches"))?;
    let mut rows = stmt.query((stream_id, first, last)).map_err(ctx("deleting a chunk's batches"))?;
    while let Some(r) = rows.next().map_err(ctx("deleting a chunk's batches"))? {
        // A damaged value only makes the count wrong; `settle_segments` asks the rows anyway.
        let Ok(Some(segment)) = r.get::<_, Option<i64>>(0) else { continue };
        if let Some(used) = st.segments.get_mut(&segment) {
            used.rows = used.rows.saturating_sub(1);
        }
    }
    Ok(())
}

/// Takes segments no row points into out of the map, once the rows confirm it; they are
/// deleted after the commit. The count alone could be wrong after damage to a row (a changed
/// `segment`), and deleting a segment a row still points into would lose its data.
fn settle_segments(tx: &Transaction<'_>, st: &mut State) -> Result<(), SpoolError> {
    let empty: Vec<(i64, SegmentUse)> =
        st.segments.iter().filter(|(_, u)| u.rows == 0).map(|(id, u)| (*id, *u)).collect();
    for (id, used) in empty {
        // Only the id range its rows were given: the rows of one segment are a small run of
        // `batches`, and counting over the whole table made every emptied segment cost a scan
        // of the backlog (seconds in all for a drain of 4 GiB of 10 KiB batches).
        let rows: u64 = tx
            .prepare_cached("SELECT count(*) FROM batches WHERE id BETWEEN ?2 AND ?3 AND segment = ?1")
            .and_then(|mut s| s.query_row((id, used.first_batch, used.last_batch), |r| r.get(0)))
            .map_err(ctx("asking whether a payload segment is still used"))?;
        if rows == 0 {
            st.segments.remove(&id);
        } else {
            tracing::warn!(
                segment = id,
                rows,
                "payload segment counted empty but rows still point into it; keeping it"
            );
            if let Some(used) = st.segments.get_mut(&id) {
                used.rows = rows;
            }
        }
    }
    Ok(())
}

/// Re-reads the oldest sealed time of the given streams after chunks were removed. A negative
/// time (a damaged row) is no time, as in `State::load`.
fn refresh_oldest_sealed(tx: &Transaction<'_>, st: &mut State, stream_ids: &BTreeSet<i64>) -> Result<(), SpoolError> {
    for &sid in stream_ids {
        let oldest: Option<i64> = tx
            .prepare_cached(
                "SELECT min(first_ms) FROM chunks WHERE stream_id = ?1 AND quarantine IS NULL AND first_ms >= 0",
            )
            .and_then(|mut s| s.query_row([sid], |r| r.get(0)))
            .map_err(ctx("finding a stream's oldest chunk"))?;
        stream_by_id(st, sid)?.oldest_sealed_ms = oldest.and_then(|ms| u64::try_from(ms).ok());
    }
    Ok(())
}

/// The counters of stream `name`, inserting its `streams` row on first use.
fn stream_entry<'s>(tx: &Transaction<'_>, st: &'s mut State, name: &str) -> Result<&'s mut StreamState, SpoolError> {
    if !st.streams.contains_key(name) {
        let mut id = st.next_stream_id;
        // Batch or chunk rows may carry an id no stream row has (a damaged row, tolerated at
        // open, left for `spool check`): a new stream given that id would inherit them.
        // Streams are created rarely, and each probe is an index lookup.
        loop {
            let taken: bool = tx
                .prepare_cached(
                    "SELECT EXISTS (SELECT 1 FROM batches WHERE stream_id = ?1)
                         OR EXISTS (SELECT 1 FROM chunks WHERE stream_id = ?1)",
                )
                .and_then(|mut s| s.query_row([id], |r| r.get(0)))
                .map_err(ctx("looking for a free stream id"))?;
            if !taken {
                break;
            }
            tracing::warn!(stream_id = id, "rows refer to a stream id that has no stream row; not reusing it");
            id = id.checked_add(1).ok_or_else(|| SpoolError::Inconsistent("no stream id left".into()))?;
        }
        tx.prepare_cached(
            "INSERT INTO streams (id, name, next_seq, sealed_through, row_crc) VALUES (?1, ?2, 1, 0, ?3)",
        )
        .and_then(|mut s| s.execute((id, name, rowcrc::stream(id, name, 1, 0))))
        .map_err(ctx("inserting a stream"))?;
        st.next_stream_id = id.saturating_add(1);
        st.names.insert(id, name.to_owned());
        st.streams.insert(name.to_owned(), StreamState { id, next_seq: 1, ..StreamState::default() });
    }
    st.streams.get_mut(name).ok_or_else(|| SpoolError::Inconsistent(format!("stream {name:?} missing after insert")))
}

fn stream_by_id(st: &mut State, id: i64) -> Result<&mut StreamState, SpoolError> {
    let missing = || SpoolError::Inconsistent(format!("stream id {id} is not in the counters"));
    let name = st.names.get(&id).ok_or_else(missing)?;
    st.streams.get_mut(name).ok_or_else(missing)
}

/// Seals the open batches of stream `name` into one chunk with the stream's next seq. Returns
/// the chunk, or `None` if the stream had no open batches. The chunk's sizes come from the rows
/// themselves.
fn seal_stream(
    tx: &Transaction<'_>,
    st: &mut State,
    name: &str,
    now_ms: u64,
    rows: &mut Vec<ChunkRow>,
) -> Result<Option<ChunkMeta>, SpoolError> {
    let chunk_id = st.next_chunk_id;
    let Some(stream) = st.streams.get_mut(name) else {
        return Ok(None);
    };
    // Counted as at open, so that the counters kept since then match (checked below).
    let open = state::sum_open_batches(tx, stream.id, stream.sealed_through)?;
    let (Some(first_batch), Some(last_batch)) = (open.first_batch, open.last_batch) else {
        return Ok(None);
    };
    let OpenBatches { batches, records, bytes, .. } = open;
    // No open batch with a time it can hold (damaged rows, quarantined when the chunk is
    // read): the chunk's time is the seal's, the latest its batches can be from.
    let first_ms = open.oldest_ms.unwrap_or(now_ms);
    let seq = stream.next_seq;
    let row = ChunkRow {
        id: chunk_id,
        stream_id: stream.id,
        seq: sql_u64(seq),
        records: sql_u64(records),
        bytes: sql_u64(bytes),
        first_ms: sql_u64(first_ms),
        sealed_ms: sql_u64(now_ms),
        first_batch,
        last_batch,
    };
    tx.prepare_cached(
        "INSERT INTO chunks (id, stream_id, seq, records, bytes, first_ms, sealed_ms, first_batch, last_batch, row_crc)
         VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10)",
    )
    .and_then(|mut s| {
        s.execute((
            row.id,
            row.stream_id,
            row.seq,
            row.records,
            row.bytes,
            row.first_ms,
            row.sealed_ms,
            row.first_batch,
            row.last_batch,
            row.crc(),
        ))
    })
    .map_err(ctx("inserting a chunk"))?;
    rows.push(row);
    crate::crash_point!("spool::seal::chunk_row_written");
    // The batches themselves are not touched: the chunk row names their range, and moving
    // `sealed_through` past it closes the stream's open set.
    let next_seq = sql_u64(seq + 1);
    tx.prepare_cached("UPDATE streams SET next_seq = ?1, sealed_through = ?2, row_crc = ?3 WHERE id = ?4")
        .and_then(|mut s| {
            s.execute((next_seq, last_batch, rowcrc::stream(stream.id, name, next_seq, last_batch), stream.id))
        })
        .map_err(ctx("advancing a stream's sequence"))?;
    let before = Counted::of(stream);
    stream.next_seq = seq + 1;
    stream.sealed_through = last_batch;
    stream.sealed_chunks += 1;
    // As the row holds it (a sum of damaged lengths past i64 is clamped there): ack, eviction
    // and quarantine take the chunk out of the counters by the row's value.
    let stored_bytes = counted(row.bytes);
    stream.sealed_bytes = stream.sealed_bytes.saturating_add(stored_bytes);
    stream.oldest_sealed_ms = min_opt(stream.oldest_sealed_ms, Some(first_ms));
    // Every open batch of the stream now belongs to the chunk.
    debug_assert_eq!(
        (stream.open_batches, stream.open_records, stream.open_bytes),
        (batches, records, bytes),
        "in-memory open counters of {name:?} must equal the rows"
    );
    stream.open_batches = 0;
    stream.open_records = 0;
    stream.open_bytes = 0;
    stream.oldest_open_ms = None;
    stream.open_damaged = false;
    let after = Counted::of(stream);
    st.recount(&before, &after);
    st.next_chunk_id = chunk_id.saturating_add(1);
    Ok(Some(ChunkMeta {
        id: ChunkId(chunk_id),
        stream: name.to_owned(),
        seq,
        records: u32::try_from(records).unwrap_or(u32::MAX),
        bytes: stored_bytes,
        first_ms,
        sealed_ms: now_ms,
    }))
}

/// The number of chunks a commit sealed, as the `seal_*` calls return it.
fn sealed_count(report: &CommitReport) -> u32 {
    u32::try_from(report.sealed.len()).unwrap_or(u32::MAX)
}

/// `PRAGMA wal_checkpoint(TRUNCATE)` on `conn`, waiting for readers at most
/// `CHECKPOINT_WAIT`: whether it completed (everything in the main file, synced, and the WAL
/// emptied).
fn checkpoint_truncate(conn: &rusqlite::Connection) -> bool {
    if let Err(e) = conn.busy_timeout(crate::schema::CHECKPOINT_WAIT) {
        tracing::debug!(error = %e, "WAL checkpoint skipped: setting its busy timeout failed");
        return false;
    }
    let r = conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |r| {
        Ok((r.get::<_, i64>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?))
    });
    if let Err(e) = conn.busy_timeout(crate::schema::BUSY_TIMEOUT) {
        // sqlite3_busy_timeout cannot fail on an open connection; were it to, the next
        // writes would give up on a lock at once and say so, losing nothing.
        tracing::warn!(error = %e, "restoring the spool's busy timeout failed");
    }
    match r {
        Ok((0, _, _)) => true,
        Ok((busy, log, done)) => {
            tracing::debug!(busy, log, done, "WAL checkpoint did not complete");
            false
        }
        Err(e) => {
            tracing::debug!(error = %e, "WAL checkpoint failed");
            false
        }
    }
}

/// Syncs the spool's WAL file `wal`, and the directory of `spool` (SQLite syncs the name of a
/// WAL it created only in a sync of its own, which under `NORMAL` waits for a checkpoint). No
/// WAL is nothing to sync: its content is in the main file, synced by the checkpoint that
/// removed it.
fn sync_wal_file(wal: &std::path::Path, spool: &std::path::Path) -> std::io::Result<()> {
    match std::fs::File::open(wal) {
        Ok(f) => {
            f.sync_data()?;
            crate::segment::sync_dir(spool).map_err(std::io::Error::other)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tempfile::TempDir;

    use super::*;
    use crate::{Batch, Durability};

    fn batch(stream: &str, data: &[u8]) -> Batch {
        Batch { stream: stream.into(), data: data.to_vec(), records: 1 }
    }

    fn req(batches: Vec<Batch>) -> AppendRequest {
        AppendRequest { batches }
    }

    /// Options for a spool in a fresh temp dir; big chunks so nothing seals by size unless a
    /// test asks for it.
    fn setup() -> (TempDir, SpoolOptions) {
        let dir = tempfile::tempdir().expect("temp dir");
        let opts = SpoolOptions::new(dir.path().join("spool.db"));
        (dir, opts)
    }

    fn open(opts: &SpoolOptions) -> (Spool, OpenReport) {
        Spool::open(opts.clone()).expect("open spool")
    }

    fn all_sealed(spool: &Spool) -> Vec<crate::ChunkMeta> {
        spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list")
    }

    fn read(spool: &Spool, meta: &crate::ChunkMeta) -> Result<Vec<u8>, SpoolError> {
        spool.reader().expect("reader").read(meta)
    }

    fn count(spool: &Spool, sql: &str) -> i64 {
        spool.conn().query_row(sql, [], |r| r.get(0)).expect("count query")
    }

    #[test]
    fn accepted_append_is_visible_after_reopen() {
        let (_dir, opts) = setup();
        let (mut spool, report) = open(&opts);
        assert!(report.created);
        let out = spool
            .append(&[req(vec![batch("a", b"one")]), req(vec![batch("a", b"two"), batch("b", b"x")])], 1_000)
            .expect("append");
        assert_eq!(out, vec![AppendOutcome::Accepted; 2]);
        let before = spool.stats();
        drop(spool);

        let (mut spool, report) = open(&opts);
        assert!(!report.created);
        assert_eq!(report.quarantined, None);
        // One row per stream per commit: "one" and "two" share a row.
        assert_eq!(report.open_batches, 2);
        assert_eq!(report.sealed_chunks, 0);
        assert_eq!(spool.stats(), before);
        assert_eq!(spool.seal_all(2_000).expect("seal"), 2);
        let chunks = all_sealed(&spool);
        assert_eq!(read(&spool, &chunks[0]).expect("read a"), b"onetwo");
        assert_eq!(read(&spool, &chunks[1]).expect("read b"), b"x");
        assert_eq!((chunks[0].records, chunks[0].first_ms, chunks[0].sealed_ms), (2, 1_000, 2_000));
    }

    #[test]
    fn append_seals_a_stream_once_its_open_bytes_reach_the_target() {
        let (_dir, mut opts) = setup();
        opts.chunk_target_bytes = 100;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[1; 60]), batch("b", &[2; 99])])], 10).expect("append");
        assert!(all_sealed(&spool).is_empty());
        spool.append(&[req(vec![batch("a", &[3; 40])])], 20).expect("append");
        let chunks = all_sealed(&spool);
        assert_eq!(chunks.len(), 1);
        let c = &chunks[0];
        assert_eq!((c.stream.as_str(), c.seq, c.bytes, c.records, c.first_ms, c.sealed_ms), ("a", 1, 100, 2, 10, 20));
        let stats = spool.stats();
        assert_eq!((stats.sealed_bytes, stats.open_bytes, stats.total_bytes), (100, 99, 199));
    }

    #[test]
    fn a_chunk_holds_at_most_the_target_plus_one_batch() {
        let (_dir, mut opts) = setup();
        opts.chunk_target_bytes = 100;
        let (mut spool, _) = open(&opts);
        let batches = (0..10u8).map(|i| batch("a", &[i; 40])).collect();
        spool.append(&[req(batches)], 1).expect("append");
        let sizes: Vec<u64> = all_sealed(&spool).iter().map(|c| c.bytes).collect();
        assert_eq!(sizes, vec![120, 120, 120]);
        assert_eq!(spool.stats().open_bytes, 40);
    }

    #[test]
    fn a_chunk_never_holds_more_records_than_the_limit() {
        let (_dir, mut opts) = setup();
        opts.chunk_max_records = 10;
        let (mut spool, _) = open(&opts);
        let many = |n: u32| Batch { stream: "a".into(), data: vec![7; n as usize], records: n };
        // 4 + 4 fit, a third 4 would make 12: the open chunk is sealed before it. A batch of
        // exactly the limit goes alone.
        spool.append(&[req(vec![many(4), many(4), many(4)])], 1).expect("append");
        spool.append(&[req(vec![many(2)])], 2).expect("append");
        spool.append(&[req(vec![many(10), many(1)])], 3).expect("append");
        spool.seal_all(4).expect("seal");
        let records: Vec<u32> = all_sealed(&spool).iter().map(|c| c.records).collect();
        assert_eq!(records, vec![8, 6, 10, 1]);
        assert!(records.iter().all(|&r| r <= opts.chunk_max_records));
    }

    #[test]
    fn seal_due_seals_only_streams_whose_oldest_batch_is_older_than_linger() {
        let (_dir, mut opts) = setup();
        opts.linger = Duration::from_millis(50);
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"1")])], 1_000).expect("append");
        spool.append(&[req(vec![batch("b", b"2")])], 1_030).expect("append");
        spool.append(&[req(vec![batch("a", b"3")])], 1_040).expect("append");
        assert_eq!(spool.seal_due(1_049).expect("seal"), 0);
        assert_eq!(spool.seal_due(1_050).expect("seal"), 1);
        assert_eq!(spool.seal_due(1_079).expect("seal"), 0);
        assert_eq!(spool.seal_due(1_080).expect("seal"), 1);
        assert_eq!(spool.seal_due(9_999).expect("seal"), 0, "nothing open any more");
        let chunks = all_sealed(&spool);
        let got: Vec<_> = chunks.iter().map(|c| (c.stream.as_str(), c.first_ms, c.sealed_ms, c.bytes)).collect();
        assert_eq!(got, vec![("a", 1_000, 1_050, 2), ("b", 1_030, 1_080, 1)]);
    }

    #[test]
    fn seal_due_seals_when_the_clock_went_backwards() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"1")])], 5_000).expect("append");
        assert_eq!(spool.seal_due(4_000).expect("seal"), 1);
    }

    #[test]
    fn sequence_numbers_are_gapless_per_stream_and_never_reused_after_ack_and_reopen() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        for t in 0..3 {
            spool.append(&[req(vec![batch("a", b"a")])], t).expect("append");
            spool.seal_all(t).expect("seal");
        }
        spool.append(&[req(vec![batch("b", b"b")])], 5).expect("append");
        spool.seal_all(5).expect("seal");
        let chunks = all_sealed(&spool);
        let seqs: Vec<_> = chunks.iter().map(|c| (c.stream.as_str(), c.seq)).collect();
        assert_eq!(seqs, vec![("a", 1), ("a", 2), ("a", 3), ("b", 1)]);
        let ids: Vec<ChunkId> = chunks.iter().map(|c| c.id).collect();
        assert_eq!(spool.ack(&ids).expect("ack").acked, 4);
        drop(spool);

        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"a"), batch("b", b"b")])], 9).expect("append");
        spool.seal_all(9).expect("seal");
        let seqs: Vec<_> = all_sealed(&spool).iter().map(|c| (c.stream.clone(), c.seq)).collect();
        assert_eq!(seqs, vec![("a".to_string(), 4), ("b".to_string(), 2)]);
        let next: Vec<_> = spool.stats().streams.iter().map(|s| (s.name.clone(), s.next_seq)).collect();
        assert_eq!(next, vec![("a".to_string(), 5), ("b".to_string(), 3)]);
    }

    #[test]
    fn chunk_ids_are_not_reused_after_the_newest_chunk_is_acked() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"a")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        let first = all_sealed(&spool)[0].id;
        spool.ack(&[first]).expect("ack");
        drop(spool);
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"a")])], 2).expect("append");
        spool.seal_all(2).expect("seal");
        assert!(all_sealed(&spool)[0].id > first);
    }

    #[test]
    fn a_batch_appended_after_the_newest_chunk_was_acked_is_open_not_taken_for_sealed() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("b", b"b1")])], 1).expect("append");
        spool.append(&[req(vec![batch("a", b"a1")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        let ids: Vec<ChunkId> = all_sealed(&spool).iter().map(|c| c.id).collect();
        spool.ack(&ids).expect("ack: the batch table is now empty");
        spool.append(&[req(vec![batch("a", b"a2")])], 2).expect("append");
        assert_eq!(spool.stats().open_bytes, 2);
        drop(spool);
        let (mut spool, report) = open(&opts);
        assert_eq!(report.open_batches, 1);
        spool.append(&[req(vec![batch("a", b"a3")])], 3).expect("append after reopen");
        assert_eq!(spool.seal_all(3).expect("seal"), 1);
        let chunks = all_sealed(&spool);
        assert_eq!((chunks.len(), chunks[0].seq), (1, 2));
        assert_eq!(read(&spool, &chunks[0]).expect("read"), b"a2a3");
    }

    #[test]
    fn sealing_writes_only_small_rows_not_the_batches_again() {
        let (dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[5; 200_000])])], 1).expect("append");
        let wal = || std::fs::metadata(dir.path().join("spool.db-wal")).expect("wal").len();
        let before = wal();
        assert_eq!(spool.seal_all(2).expect("seal"), 1);
        let written = wal() - before;
        assert!(written < 32 << 10, "sealing a 200 kB batch wrote {written} bytes of WAL");
        assert_eq!(read(&spool, &all_sealed(&spool)[0]).expect("read"), vec![5; 200_000]);
    }

    /// Commit frames in the WAL file from byte `from` on (each transaction ends with one).
    fn wal_commits(dir: &TempDir, from: usize) -> (usize, usize) {
        let wal = std::fs::read(dir.path().join("spool.db-wal")).expect("wal");
        let page = u32::from_be_bytes(wal[8..12].try_into().expect("4 bytes")) as usize;
        let mut commits = 0;
        let mut at = from.max(32);
        while at + 24 + page <= wal.len() {
            if wal[at + 4..at + 8] != [0; 4] {
                commits += 1;
            }
            at += 24 + page;
        }
        (commits, wal.len())
    }

    #[test]
    fn commit_appends_acks_and_seals_in_one_transaction_and_counts_what_it_sealed() {
        let (dir, mut opts) = setup();
        opts.chunk_target_bytes = 100;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[1; 100]), batch("b", &[2; 10])])], 1).expect("append");
        let first = all_sealed(&spool);
        assert_eq!(first.len(), 1);
        let (_, wal_len) = wal_commits(&dir, 0);
        let reqs = [req(vec![batch("c", &[3; 5])]), req(vec![batch("a", &[4; 5])])];
        let r = spool.commit(&reqs, &[first[0].id, ChunkId(999)], SealWhat::All, 2).expect("commit");
        assert_eq!(r.appends.expect("appends"), vec![AppendOutcome::Accepted; 2]);
        assert_eq!(r.acks, AckReport { acked: 1, unknown: 1 });
        assert_eq!(r.sealed.len(), 3, "a, b and c were sealed although the chunk count grew by only 2");
        assert_eq!(wal_commits(&dir, wal_len).0, 1, "one transaction, one commit frame");
        let chunks = all_sealed(&spool);
        let got: Vec<_> = chunks.iter().map(|c| (c.stream.as_str(), c.seq, c.bytes)).collect();
        assert_eq!(got, vec![("a", 2, 5), ("b", 1, 10), ("c", 1, 5)]);
        let stats = spool.stats();
        assert_eq!((stats.sealed_chunks, stats.open_bytes, stats.total_bytes), (3, 0, 20));
        drop(spool);
        assert_eq!(open(&opts).0.stats(), stats);
    }

    #[test]
    fn commit_with_nothing_to_do_writes_nothing() {
        let (dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"x")])], 1_000).expect("append");
        let (_, wal_len) = wal_commits(&dir, 0);
        let r = spool.commit(&[], &[], SealWhat::Due, 1_001).expect("commit");
        assert_eq!((r.appends.expect("appends").len(), r.acks, r.sealed.len()), (0, AckReport::default(), 0));
        assert_eq!(wal_commits(&dir, 0).1, wal_len);
    }

    #[test]
    fn commit_keeps_the_acks_and_seals_when_the_appends_fill_the_disk() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[1; 3_000])])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        spool.append(&[req(vec![batch("b", &[2; 50])])], 2).expect("append");
        let acked = all_sealed(&spool)[0].id;
        let pages = count(&spool, "PRAGMA page_count");
        spool.conn().pragma_update(None, "max_page_count", pages).expect("cap pages");
        spool.simulate_full_segments(true);
        let big = [req(vec![batch("c", &[3; 100_000])])];
        let r = spool.commit(&big, &[acked], SealWhat::All, 3).expect("acks and seals still commit");
        assert!(matches!(r.appends, Err(SpoolError::DiskFull)), "{:?}", r.appends);
        assert_eq!((r.acks.acked, r.sealed.len()), (1, 1));
        let chunks = all_sealed(&spool);
        assert_eq!((chunks.len(), chunks[0].stream.as_str(), chunks[0].bytes), (1, "b", 50));
        let stats = spool.stats();
        assert_eq!((stats.total_bytes, stats.open_bytes), (50, 0), "nothing of the appends was stored");
        spool.conn().pragma_update(None, "max_page_count", 1_000_000).expect("uncap");
        spool.simulate_full_segments(false);
        drop(spool);
        assert_eq!(open(&opts).0.stats(), stats);
    }

    #[test]
    fn a_long_reader_does_not_hold_a_commit_on_a_full_disk_for_the_busy_timeout() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[1; 3_000])])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        let acked = all_sealed(&spool)[0].id;
        // A reader in the middle of a long read (a `spool check` of a large spool): its read
        // transaction blocks every truncating checkpoint until it ends.
        let reader = rusqlite::Connection::open(&opts.path).expect("reader");
        reader.execute_batch("BEGIN").expect("begin");
        let n: i64 = reader.query_row("SELECT count(*) FROM chunks", [], |r| r.get(0)).expect("read");
        assert_eq!(n, 1);
        let pages = count(&spool, "PRAGMA page_count");
        spool.conn().pragma_update(None, "max_page_count", pages).expect("cap pages");
        spool.simulate_full_segments(true);
        let started = std::time::Instant::now();
        let r = spool.commit(&[req(vec![batch("c", &[3; 100_000])])], &[acked], SealWhat::All, 3).expect("acks commit");
        let waited = started.elapsed();
        assert!(matches!(r.appends, Err(SpoolError::DiskFull)), "{:?}", r.appends);
        assert_eq!(r.acks.acked, 1);
        // Up to four checkpoints ran behind the reader; each waiting out the busy timeout, the
        // commit would take at least 5 s, all of it with producers and acks standing still.
        assert!(waited < crate::schema::BUSY_TIMEOUT, "the commit waited {waited:?} for the reader");
        // Ordinary writes wait for locks as long as before.
        assert_eq!(count(&spool, "PRAGMA busy_timeout"), 5_000);
        drop(reader);
        spool.conn().pragma_update(None, "max_page_count", 1_000_000).expect("uncap");
        spool.simulate_full_segments(false);
    }

    #[test]
    fn under_normal_seals_without_a_commit_record_are_listed_only_after_a_wal_sync_or_checkpoint() {
        let (_dir, mut opts) = setup();
        opts.durability = Durability::Normal;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"one")])], 1).expect("append");
        spool.fail_wal_syncs = true;
        // A seal on its own: no commit record, durable only with the WAL, whose sync fails.
        assert_eq!(spool.seal_all(2).expect("seal"), 1);
        assert!(spool.seals_wait_for_sync());
        assert!(spool.wal_sync_failed().is_some_and(|e| e.contains("simulated")), "{:?}", spool.wal_sync_failed());
        assert!(all_sealed(&spool).is_empty(), "a chunk listed before its seal was durable");
        // A commit whose seal is in its record does not list the earlier one either.
        spool.commit(&[req(vec![batch("b", b"two")])], &[], SealWhat::All, 3).expect("commit");
        assert!(all_sealed(&spool).is_empty());
        // A later sync that works proves nothing (a failed write-back may have dropped pages
        // and said so once): still unlisted.
        spool.fail_wal_syncs = false;
        spool.append(&[req(vec![batch("c", b"three")])], 4).expect("append");
        assert!(spool.seals_wait_for_sync());
        assert!(all_sealed(&spool).is_empty());
        // The process stops without a clean close (which would checkpoint the WAL): the seals
        // are in the WAL alone.
        let wal = crate::recovery::with_suffix(&opts.path, "-wal");
        crash(spool, _dir.path());
        assert!(std::fs::metadata(&wal).expect("wal").len() > 0);
        // The next open writes the WAL into the main file and syncs that (a sync of the WAL
        // would vouch for nothing after a failed write-back): every chunk is listed.
        let (spool, _) = open(&opts);
        assert_eq!(std::fs::metadata(&wal).map_or(0, |m| m.len()), 0, "the WAL was checkpointed at open");
        assert!(!spool.seals_wait_for_sync());
        assert_eq!(spool.wal_sync_failed(), None);
        let listed: Vec<_> = all_sealed(&spool).into_iter().map(|c| (c.stream, c.seq)).collect();
        assert_eq!(listed, [("a".to_owned(), 1), ("b".to_owned(), 1)]);
    }

    #[test]
    fn read_payload_returns_the_crc32c_of_the_whole_payload() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        let batches = vec![batch("a", b"first batch"), batch("a", b""), batch("a", &[9; 5_000]), batch("a", b"z")];
        spool.append(&[req(batches)], 1).expect("append");
        spool.seal_all(1).expect("seal");
        let chunk = &all_sealed(&spool)[0];
        let payload = spool.reader().expect("reader").read_payload(chunk).expect("read");
        assert_eq!(payload.len(), 5_012);
        assert_eq!(payload.crc32c, crate::crc::crc32c(&payload.data));
        assert_ne!(payload.crc32c, 0);
    }

    #[test]
    fn ack_of_unknown_or_repeated_ids_is_counted_not_an_error() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"a")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        let id = all_sealed(&spool)[0].id;
        let report = spool.ack(&[id, id, ChunkId(9_999)]).expect("ack");
        assert_eq!(report, AckReport { acked: 1, unknown: 2 });
        assert_eq!(spool.ack(&[id]).expect("ack"), AckReport { acked: 0, unknown: 1 });
        assert_eq!(spool.ack(&[]).expect("ack"), AckReport::default());
    }

    #[test]
    fn ack_deletes_the_chunk_and_its_batches_and_a_later_read_reports_chunk_gone() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"a"), batch("a", b"b")]), req(vec![batch("b", b"c")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        let chunks = all_sealed(&spool);
        let mut reader = spool.reader().expect("reader");
        spool.ack(&[chunks[0].id]).expect("ack");
        assert!(matches!(reader.read(&chunks[0]), Err(SpoolError::ChunkGone(id)) if id == chunks[0].id));
        assert_eq!(reader.read(&chunks[1]).expect("other chunk"), b"c");
        assert_eq!(count(&spool, "SELECT count(*) FROM batches"), 1);
        assert_eq!(count(&spool, "SELECT count(*) FROM chunks"), 1);
        let stats = spool.stats();
        assert_eq!((stats.sealed_chunks, stats.sealed_bytes, stats.total_bytes), (1, 1, 1));
    }

    #[test]
    fn restart_reoffers_unacked_chunks_unchanged() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"payload")])], 1).expect("append");
        spool.seal_all(2).expect("seal");
        let sent = all_sealed(&spool);
        let bytes = read(&spool, &sent[0]).expect("read");
        drop(spool); // crash before the ack is processed
        let (spool, report) = open(&opts);
        assert_eq!(report.sealed_chunks, 1);
        let again = all_sealed(&spool);
        assert_eq!(again, sent);
        assert_eq!(read(&spool, &again[0]).expect("read"), bytes);
    }

    #[test]
    fn reject_policy_answers_full_and_stores_nothing_when_the_request_does_not_fit() {
        let (_dir, mut opts) = setup();
        opts.max_bytes = 100;
        let (mut spool, _) = open(&opts);
        assert_eq!(spool.append(&[req(vec![batch("a", &[0; 80])])], 1).expect("append"), vec![AppendOutcome::Accepted]);
        spool.seal_all(1).expect("seal");
        let full = spool.append(&[req(vec![batch("a", &[0; 10]), batch("b", &[0; 11])])], 2).expect("append");
        assert_eq!(full, vec![AppendOutcome::Full]);
        assert_eq!(spool.append(&[req(vec![batch("a", &[0; 20])])], 3).expect("append"), vec![AppendOutcome::Accepted]);
        let stats = spool.stats();
        assert_eq!((stats.total_bytes, stats.dropped_chunks), (100, 0));
        assert_eq!(count(&spool, "SELECT count(*) FROM batches"), 2);
        assert_eq!(count(&spool, "SELECT count(*) FROM streams"), 1, "a Full request creates no stream");
    }

    #[test]
    fn a_request_larger_than_max_bytes_is_full_under_both_policies() {
        for policy in [FullPolicy::Reject, FullPolicy::DropOldest] {
            let (_dir, mut opts) = setup();
            opts.max_bytes = 100;
            opts.full_policy = policy;
            let (mut spool, _) = open(&opts);
            spool.append(&[req(vec![batch("a", &[0; 10])])], 1).expect("append");
            spool.seal_all(1).expect("seal");
            let out = spool.append(&[req(vec![batch("a", &[0; 60]), batch("a", &[0; 41])])], 2).expect("append");
            assert_eq!(out, vec![AppendOutcome::Full], "{policy:?}");
            assert_eq!(spool.stats().sealed_chunks, 1, "{policy:?}: nothing evicted for a hopeless request");
        }
    }

    #[test]
    fn a_drop_is_marked_durable_at_commit_under_full_and_only_by_the_syncer_with_deferred_syncs() {
        let three = |s: &str| Batch { stream: s.into(), data: vec![7; 30], records: 3 };
        for deferred in [false, true] {
            let (_dir, mut opts) = setup();
            opts.max_bytes = 100;
            opts.chunk_target_bytes = 30;
            opts.full_policy = FullPolicy::DropOldest;
            let (mut spool, _) = open(&opts);
            let sync = if deferred { spool.defer_wal_sync().expect("defer") } else { None };
            let marks = spool.drop_marks();
            spool.append(&[req(vec![three("a")]), req(vec![three("b")]), req(vec![three("a")])], 1).expect("append");
            assert!(marks.all_durable(), "nothing dropped yet");
            spool.append(&[req(vec![batch("c", &[1; 40])])], 2).expect("append");
            assert_eq!(spool.stats().dropped_chunks, 1);
            if deferred {
                assert!(!marks.all_durable(), "dropped and visible, not durable before the WAL's sync");
                sync.expect("full defers").sync(None).expect("sync");
                assert!(!marks.all_durable(), "the syncer marks it, not the sync");
                marks.durable(1);
            }
            assert!(marks.all_durable(), "deferred: {deferred}");
            drop(spool);
            let (spool, _) = open(&opts);
            assert!(spool.drop_marks().all_durable(), "an open starts with every drop durable");
        }
    }

    /// A transaction that was to drop chunks and failed leaves no drop to wait for: floors are
    /// not withheld by drops that never happened.
    #[test]
    fn a_failed_commit_that_was_to_drop_leaves_every_drop_durable() {
        let three = |s: &str| Batch { stream: s.into(), data: vec![7; 30], records: 3 };
        let (_dir, mut opts) = setup();
        opts.max_bytes = 100;
        opts.chunk_target_bytes = 30;
        opts.full_policy = FullPolicy::DropOldest;
        let (mut spool, _) = open(&opts);
        let marks = spool.drop_marks();
        spool.append(&[req(vec![three("a")]), req(vec![three("b")]), req(vec![three("a")])], 1).expect("append");
        spool.fail_next_commit = true;
        assert!(spool.append(&[req(vec![batch("c", &[1; 40])])], 2).is_err(), "the commit fails");
        assert_eq!(spool.stats().dropped_chunks, 0, "nothing was dropped");
        assert!(marks.all_durable(), "no drop to wait for");
        spool.append(&[req(vec![batch("c", &[1; 40])])], 3).expect("append");
        assert_eq!(spool.stats().dropped_chunks, 1);
        assert!(marks.all_durable(), "FULL without deferred syncs: durable at commit");
    }

    #[test]
    fn drop_oldest_evicts_the_oldest_sealed_chunks_and_counts_them_durably() {
        let (_dir, mut opts) = setup();
        opts.max_bytes = 100;
        opts.chunk_target_bytes = 30;
        opts.full_policy = FullPolicy::DropOldest;
        let (mut spool, _) = open(&opts);
        let three = |s| Batch { stream: s, data: vec![7; 30], records: 3 };
        spool
            .append(&[req(vec![three("a".into())]), req(vec![three("b".into())]), req(vec![three("a".into())])], 1)
            .expect("append");
        let before = all_sealed(&spool);
        assert_eq!(before.len(), 3);
        let out = spool.append(&[req(vec![batch("c", &[1; 40])])], 2).expect("append");
        assert_eq!(out, vec![AppendOutcome::Accepted]);
        let after = all_sealed(&spool);
        assert_eq!(after.len(), 3, "one evicted, one new");
        assert_eq!(after[0].id, before[1].id, "the oldest went first");
        let stats = spool.stats();
        assert_eq!((stats.dropped_chunks, stats.dropped_records, stats.total_bytes), (1, 3, 100));
        assert!(matches!(read(&spool, &before[0]), Err(SpoolError::ChunkGone(_))));
        drop(spool);
        let (spool, _) = open(&opts);
        let stats = spool.stats();
        assert_eq!((stats.dropped_chunks, stats.dropped_records), (1, 3));
    }

    #[test]
    fn drop_oldest_spares_the_chunks_in_flight_while_another_can_go() {
        let (_dir, mut opts) = setup();
        opts.max_bytes = 100;
        opts.chunk_target_bytes = 30;
        opts.full_policy = FullPolicy::DropOldest;
        let (mut spool, _) = open(&opts);
        let three = |s: &str| Batch { stream: s.into(), data: vec![7; 30], records: 3 };
        spool.append(&[req(vec![three("a")]), req(vec![three("b")]), req(vec![three("a")])], 1).expect("append");
        let before: Vec<ChunkId> = all_sealed(&spool).iter().map(|c| c.id).collect();
        // The two oldest are on their way to the server.
        spool.chunks_in_flight().set([before[0], before[1]]);
        spool.append(&[req(vec![batch("c", &[1; 40])])], 2).expect("append");
        let after: Vec<ChunkId> = all_sealed(&spool).iter().map(|c| c.id).collect();
        assert_eq!(&after[..2], &before[..2], "the chunks in flight were evicted");
        assert!(!after.contains(&before[2]), "the oldest chunk not in flight went");
        // Every chunk in flight: the oldest goes, as without the set.
        spool.chunks_in_flight().set(after.clone());
        spool.append(&[req(vec![batch("d", &[1; 30])])], 3).expect("append");
        let last: Vec<ChunkId> = all_sealed(&spool).iter().map(|c| c.id).collect();
        assert!(!last.contains(&after[0]) && last.contains(&after[1]), "{last:?} from {after:?}");
        assert_eq!(spool.stats().dropped_chunks, 2);
    }

    #[test]
    fn drop_oldest_evicts_nothing_when_open_batches_alone_leave_no_room() {
        let (_dir, mut opts) = setup();
        opts.max_bytes = 100;
        opts.full_policy = FullPolicy::DropOldest;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[0; 50])])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        spool.append(&[req(vec![batch("a", &[0; 40])])], 2).expect("append");
        let out = spool.append(&[req(vec![batch("a", &[0; 70])])], 3).expect("append");
        assert_eq!(out, vec![AppendOutcome::Full]);
        let stats = spool.stats();
        assert_eq!((stats.sealed_chunks, stats.dropped_chunks, stats.total_bytes), (1, 0, 90));
    }

    #[test]
    fn a_full_request_in_a_group_stores_none_of_its_batches_while_the_others_are_accepted() {
        let (_dir, mut opts) = setup();
        opts.max_bytes = 100;
        let (mut spool, _) = open(&opts);
        let reqs = [
            req(vec![batch("a", &[1; 30]), batch("a", &[2; 30])]),
            req(vec![batch("a", &[3; 30]), batch("a", &[4; 30])]),
            req(vec![batch("a", &[5; 10])]),
        ];
        let out = spool.append(&reqs, 1).expect("append");
        assert_eq!(out, vec![AppendOutcome::Accepted, AppendOutcome::Full, AppendOutcome::Accepted]);
        spool.seal_all(1).expect("seal");
        let chunks = all_sealed(&spool);
        let mut want = vec![1; 30];
        want.extend([2; 30]);
        want.extend([5; 10]);
        assert_eq!(read(&spool, &chunks[0]).expect("read"), want);
        assert_eq!(chunks[0].records, 3);
    }

    #[test]
    fn quarantined_chunk_is_never_offered_again_and_not_counted_in_total_bytes() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"bad")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        spool.append(&[req(vec![batch("a", b"good")])], 2).expect("append");
        spool.seal_all(2).expect("seal");
        let chunks = all_sealed(&spool);
        spool.quarantine(chunks[0].id, "server rejected it").expect("quarantine");
        spool.quarantine(chunks[0].id, "again").expect("quarantine twice is a no-op");
        assert!(matches!(spool.quarantine(ChunkId(777), "x"), Err(SpoolError::ChunkGone(ChunkId(777)))));
        assert_eq!(all_sealed(&spool), vec![chunks[1].clone()]);
        let stats = spool.stats();
        assert_eq!((stats.quarantined_chunks, stats.sealed_chunks, stats.total_bytes), (1, 1, 4));
        assert_eq!(stats.oldest_ms, Some(2));
        assert_eq!(spool.ack(&[chunks[0].id]).expect("ack"), AckReport { acked: 0, unknown: 1 });
        let q = spool.reader().expect("reader").quarantined().expect("list");
        assert_eq!((q.len(), q[0].meta.id, q[0].reason.as_str()), (1, chunks[0].id, "server rejected it"));
        assert_eq!(read(&spool, &chunks[0]).expect("still readable for inspection"), b"bad");
        drop(spool);

        let (mut spool, report) = open(&opts);
        assert_eq!(report.sealed_chunks, 1);
        assert_eq!(spool.stats().quarantined_chunks, 1);
        assert_eq!(all_sealed(&spool).len(), 1);
        assert_eq!(spool.purge_quarantined().expect("purge"), 1);
        assert_eq!(spool.stats().quarantined_chunks, 0);
        assert_eq!(count(&spool, "SELECT count(*) FROM batches"), 1);
    }

    #[test]
    fn a_new_file_gets_a_new_spool_id_and_reopening_keeps_it() {
        let (_dir, opts) = setup();
        let (spool, report) = open(&opts);
        assert!(report.created);
        let id = spool.id();
        drop(spool);
        let (spool, report) = open(&opts);
        assert!(!report.created);
        assert_eq!(spool.id(), id);
        drop(spool);
        std::fs::remove_file(&opts.path).expect("remove spool file");
        let (spool, report) = open(&opts);
        assert!(report.created);
        assert_ne!(spool.id(), id);
        assert_eq!(spool.id().to_string().len(), 32);
    }

    fn host(opts: &SpoolOptions, host: Option<&str>) -> SpoolOptions {
        SpoolOptions { host_id: host.map(str::to_owned), ..opts.clone() }
    }

    #[test]
    fn a_copy_of_the_file_on_another_machine_gets_a_new_id_and_keeps_its_chunks_and_seqs() {
        let (dir, base) = setup();
        let on_a = host(&base, Some("aaaa"));
        let (mut spool, report) = open(&on_a);
        assert_eq!((report.created, &report.host), (true, &crate::HostCheck::Adopted { damaged: None }));
        let first = spool.id();
        spool.append(&[req(vec![batch("s", b"one")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        drop(spool);
        let (spool, report) = open(&on_a);
        assert_eq!((spool.id(), &report.host), (first, &crate::HostCheck::Same));
        drop(spool);

        // The disk image copied to another machine: the same files, another machine id.
        let copy = dir.path().join("copy");
        std::fs::create_dir(&copy).expect("dir");
        for f in std::fs::read_dir(dir.path()).expect("list") {
            let f = f.expect("entry").path();
            if f.is_file() && !f.ends_with("spool.db-lock") {
                std::fs::copy(&f, copy.join(f.file_name().expect("name"))).expect("copy");
            }
        }
        let on_b = host(&SpoolOptions { path: copy.join("spool.db"), ..base.clone() }, Some("bbbb"));
        let (mut spool, report) = open(&on_b);
        let crate::HostCheck::Moved { from, old_id, new_id } = &report.host else {
            panic!("expected a move, got {:?}", report.host)
        };
        assert_eq!((from.as_str(), *old_id, spool.id()), ("aaaa", first, *new_id));
        assert_ne!(spool.id(), first);
        assert!(!report.created && report.quarantined.is_none());
        let chunks = all_sealed(&spool);
        assert_eq!(chunks.iter().map(|c| c.seq).collect::<Vec<_>>(), vec![1], "the chunk it brought along");
        assert_eq!(read(&spool, &chunks[0]).expect("read"), b"one");
        spool.append(&[req(vec![batch("s", b"two")])], 2).expect("append");
        spool.seal_all(2).expect("seal");
        assert_eq!(all_sealed(&spool).iter().map(|c| c.seq).collect::<Vec<_>>(), vec![1, 2], "seqs go on");
        let copied = spool.id();
        drop(spool);
        let (spool, report) = open(&on_b);
        assert_eq!((spool.id(), &report.host), (copied, &crate::HostCheck::Same), "the new id is kept");
        drop(spool);
        let (spool, report) = open(&host(&on_b, None));
        assert_eq!((spool.id(), &report.host), (copied, &crate::HostCheck::Unchecked));
        drop(spool);

        // The original, on its own machine, keeps its id.
        let (spool, report) = open(&on_a);
        assert_eq!((spool.id(), &report.host), (first, &crate::HostCheck::Same));
        assert!(crate::check(&on_b.path).expect("check").damaged_rows.is_empty());
    }

    #[test]
    fn a_new_id_from_a_move_survives_commits_that_rewrite_the_meta_checksum() {
        let (_dir, mut opts) = setup();
        opts.max_bytes = 100;
        opts.chunk_target_bytes = 30;
        opts.full_policy = FullPolicy::DropOldest;
        let (spool, _) = open(&host(&opts, Some("a")));
        drop(spool);
        let on_b = host(&opts, Some("b"));
        let (mut spool, report) = open(&on_b);
        assert!(matches!(report.host, crate::HostCheck::Moved { .. }), "{:?}", report.host);
        let id = spool.id();
        // Drops rewrite the meta counters and the checksum over them and the spool id.
        let three = |s: &str| req(vec![Batch { stream: s.into(), data: vec![7; 30], records: 3 }]);
        spool.append(&[three("a"), three("b"), three("a")], 1).expect("append");
        spool.append(&[req(vec![batch("c", &[1; 40])])], 2).expect("append");
        assert_eq!(spool.stats().dropped_chunks, 1);
        drop(spool);
        let (spool, report) = open(&on_b);
        assert!(!report.created && report.quarantined.is_none(), "{report:?}");
        assert_eq!((spool.id(), spool.stats().dropped_chunks), (id, 1));
    }

    #[test]
    fn a_rekeyed_spool_keeps_its_chunks_and_seqs_and_opens_with_the_new_id() {
        for durability in [Durability::Full, Durability::Normal] {
            let (_dir, mut opts) = setup();
            opts.durability = durability;
            opts.max_bytes = 100;
            opts.chunk_target_bytes = 30;
            opts.full_policy = FullPolicy::DropOldest;
            let opts = host(&opts, Some("a"));
            let (mut spool, _) = open(&opts);
            let deferred = spool.defer_wal_sync().expect("defer");
            spool.append(&[req(vec![batch("s", b"one")])], 1).expect("append");
            spool.seal_all(1).expect("seal");
            let old = spool.id();
            let new = spool.rekey().expect("rekey");
            assert_ne!(new, old);
            assert_eq!(spool.id(), new);
            // A later commit rewrites the meta checksum over the new id (drops do).
            let three = |s: &str| req(vec![Batch { stream: s.into(), data: vec![7; 30], records: 3 }]);
            spool.append(&[three("a"), three("b"), three("a"), three("b")], 2).expect("append");
            assert!(spool.stats().dropped_chunks > 0, "{durability:?}");
            spool.append(&[req(vec![batch("s", b"two")])], 3).expect("append");
            spool.seal_all(3).expect("seal");
            if let Some(mut sync) = deferred {
                sync.sync(None).expect("sync");
            }
            drop(spool);
            let (spool, report) = open(&opts);
            assert!(!report.created && report.quarantined.is_none(), "{durability:?}: {report:?}");
            assert_eq!((spool.id(), &report.host), (new, &crate::HostCheck::Same), "{durability:?}");
            let seqs: Vec<u64> = all_sealed(&spool).iter().filter(|c| c.stream == "s").map(|c| c.seq).collect();
            assert_eq!(seqs.last(), Some(&2), "{durability:?}: the stream's seqs went on: {seqs:?}");
        }
    }

    #[test]
    fn a_spool_without_a_machine_adopts_the_first_it_is_opened_on() {
        let (_dir, opts) = setup();
        let (spool, report) = open(&opts);
        assert_eq!(report.host, crate::HostCheck::Unchecked);
        drop(spool);
        let (spool, report) = open(&host(&opts, Some("")));
        assert_eq!(report.host, crate::HostCheck::Unchecked, "an empty id is none");
        assert_eq!(count(&spool, "SELECT count(*) FROM meta WHERE key = 'host_id'"), 0, "nothing written");
        let id = spool.id();
        drop(spool);
        let (spool, report) = open(&host(&opts, Some("a")));
        assert_eq!((spool.id(), &report.host), (id, &crate::HostCheck::Adopted { damaged: None }));
        drop(spool);
        // The new id is committed with FULL, and the spool's own durability is back after it.
        let normal = SpoolOptions { durability: Durability::Normal, ..host(&opts, Some("b")) };
        let (spool, report) = open(&normal);
        assert!(matches!(report.host, crate::HostCheck::Moved { .. }), "{:?}", report.host);
        assert_ne!(spool.id(), id);
        assert_eq!(count(&spool, "PRAGMA synchronous"), 1, "NORMAL");
    }

    #[test]
    fn a_damaged_machine_row_is_reported_by_check_and_adopted_again_without_a_new_id() {
        let (_dir, opts) = setup();
        let on_a = host(&opts, Some("a"));
        let (spool, _) = open(&on_a);
        let id = spool.id();
        // One flipped bit in the identity: it fails its checksum.
        spool.conn().execute("UPDATE meta SET value = X'6005060708' WHERE key = 'host_id'", []).expect("damage");
        drop(spool);
        let damaged = crate::check(&opts.path).expect("check").damaged_rows;
        assert!(damaged.len() == 1 && damaged[0].contains("host id"), "{damaged:?}");
        let (spool, report) = open(&host(&opts, Some("b")));
        assert!(matches!(&report.host, crate::HostCheck::Adopted { damaged: Some(why) } if why.contains("checksum")));
        assert_eq!(spool.id(), id, "a damaged row tells no copy apart");
        drop(spool);
        assert!(crate::check(&opts.path).expect("check").damaged_rows.is_empty());
        let (spool, report) = open(&host(&opts, Some("b")));
        assert_eq!((spool.id(), &report.host), (id, &crate::HostCheck::Same));
    }

    #[test]
    fn disk_full_rolls_back_keeps_counters_true_and_leaves_the_spool_usable() {
        let (_dir, mut opts) = setup();
        opts.chunk_target_bytes = 1_000;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[1; 600])])], 1).expect("append");
        let before = spool.stats();
        let pages = count(&spool, "PRAGMA page_count");
        spool.conn().pragma_update(None, "max_page_count", pages).expect("cap pages");
        spool.simulate_full_segments(true);
        let err = spool.append(&[req(vec![batch("a", &[2; 600]), batch("b", &[3; 50_000])])], 2).expect_err("no room");
        assert!(matches!(err, SpoolError::DiskFull), "{err:?}");
        assert_eq!(spool.stats(), before);
        assert!(spool.conn().is_autocommit(), "transaction rolled back");
        spool.conn().pragma_update(None, "max_page_count", 1_000_000).expect("uncap");
        spool.simulate_full_segments(false);
        spool.append(&[req(vec![batch("a", &[2; 600])])], 3).expect("append after space returned");
        let chunks = all_sealed(&spool);
        assert_eq!((chunks.len(), chunks[0].bytes, chunks[0].seq), (1, 1_200, 1));
        let now = spool.stats();
        drop(spool);
        let (spool, _) = open(&opts);
        assert_eq!(spool.stats(), now);
    }

    #[test]
    fn stats_are_rebuilt_from_disk_on_reopen() {
        let (_dir, mut opts) = setup();
        opts.chunk_target_bytes = 50;
        opts.max_bytes = 400;
        opts.full_policy = FullPolicy::DropOldest;
        let (mut spool, _) = open(&opts);
        for t in 0..20u64 {
            let stream = ["a", "b", "c"][(t % 3) as usize];
            spool
                .append(&[req(vec![Batch { stream: stream.into(), data: vec![t as u8; 37], records: 2 }])], 100 + t)
                .expect("append");
        }
        let ids: Vec<ChunkId> = all_sealed(&spool).iter().map(|c| c.id).take(2).collect();
        spool.ack(&ids[..1]).expect("ack");
        spool.quarantine(ids[1], "test").expect("quarantine");
        let stats = spool.stats();
        assert!(stats.dropped_chunks > 0 && stats.open_bytes > 0 && stats.sealed_chunks > 0, "{stats:?}");
        drop(spool);
        let (spool, _) = open(&opts);
        assert_eq!(spool.stats(), stats);
    }

    #[test]
    fn durability_setting_selects_the_synchronous_pragma_and_wal() {
        for (durability, want) in [(Durability::Full, 2), (Durability::Normal, 1)] {
            let (_dir, mut opts) = setup();
            opts.durability = durability;
            let (spool, _) = open(&opts);
            assert_eq!(count(&spool, "PRAGMA synchronous"), want);
            let mode: String = spool.conn().query_row("PRAGMA journal_mode", [], |r| r.get(0)).expect("mode");
            assert_eq!(mode, "wal");
            assert_eq!(count(&spool, "PRAGMA user_version"), crate::schema::SCHEMA_VERSION);
        }
    }

    #[test]
    fn deferring_the_wal_sync_switches_full_to_normal_and_normal_has_nothing_to_defer() {
        let (_dir, mut opts) = setup();
        opts.durability = Durability::Normal;
        let (mut spool, _) = open(&opts);
        assert!(spool.defer_wal_sync().expect("defer").is_none());
        assert_eq!(count(&spool, "PRAGMA synchronous"), 1);

        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        assert!(spool.defer_wal_sync().expect("defer").is_some());
        assert_eq!(count(&spool, "PRAGMA synchronous"), 1, "the sync thread syncs instead of COMMIT");
    }

    /// A quarantine has no commit record in a segment: under a deferred sync only the WAL's
    /// sync makes it durable, and the next sync must do it even with no payload written.
    #[test]
    fn a_quarantine_under_a_deferred_sync_has_the_next_sync_sync_the_wal() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"rejected")])], 1).expect("append");
        spool.seal_all(2).expect("seal");
        let chunk = spool.newest_chunk().expect("a chunk");
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        let syncs = spool.syncs.clone().expect("deferred syncs");
        sync.sync(Some(chunk)).expect("sync");
        assert!(!syncs.wal_needed(), "the sync took the need of the deferral");

        spool.quarantine(chunk, "rejected by server").expect("quarantine");
        assert!(syncs.wal_needed(), "the quarantine is in the WAL only");
        sync.sync(None).expect("sync");
        assert!(!syncs.wal_needed());
        assert_eq!(spool.stats().quarantined_chunks, 1);
    }

    #[test]
    fn readers_list_a_chunk_sealed_under_a_deferred_sync_only_after_a_sync_covers_it() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"before")])], 1).expect("append");
        spool.seal_all(2).expect("seal");
        let mut reader = spool.reader().expect("reader made before the deferral");
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        // What was sealed before the deferral is durable, and listed.
        let first = spool.newest_chunk().expect("a chunk");
        let ids =
            |r: &mut SpoolReader| r.sealed_after(None, 10).expect("list").iter().map(|c| c.id).collect::<Vec<_>>();
        assert_eq!(ids(&mut reader), vec![first]);

        spool.append(&[req(vec![batch("a", b"after")])], 3).expect("append");
        spool.seal_all(4).expect("seal");
        let second = spool.newest_chunk().expect("a chunk");
        assert!(second > first);
        // Committed (the writer's counters say so) but not durable yet: not listed, by any
        // reader, old or new.
        assert_eq!(spool.stats().sealed_chunks, 2);
        assert_eq!(ids(&mut reader), vec![first]);
        assert_eq!(ids(&mut spool.reader().expect("reader")), vec![first]);

        sync.sync(Some(second)).expect("sync");
        assert_eq!(ids(&mut reader), vec![first, second]);
        // A sync that covers fewer chunks never hides one again.
        sync.sync(Some(first)).expect("sync");
        assert_eq!(ids(&mut reader), vec![first, second]);
    }

    /// What a power cut leaves of [`deferred_tail`]'s segment: its bytes up to the sync.
    fn lose_unsynced_bytes(seg: &std::path::Path, synced: u64) {
        std::fs::OpenOptions::new().write(true).open(seg).expect("segment").set_len(synced).expect("cut");
    }

    /// Under deferred syncs: "first" appended and synced, then "second" and "third" (sealed
    /// into one chunk with "first") committed without a sync of their segment bytes. Returns
    /// the spool, closed, and the one segment's path and its length at the sync.
    fn deferred_tail(opts: &SpoolOptions) -> (std::path::PathBuf, u64) {
        let (mut spool, _) = open(opts);
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        spool.append(&[req(vec![batch("a", b"first")])], 1).expect("append");
        sync.sync(None).expect("sync");
        let synced = std::fs::metadata(crate::segment::path(&opts.path, segment_files(opts)[0])).expect("len").len();
        // This commit records that "first" is synced; nothing syncs it or the next one.
        spool.append(&[req(vec![batch("a", b"second")])], 2).expect("append");
        spool.commit(&[req(vec![batch("a", b"third")])], &[], SealWhat::All, 3).expect("commit");
        assert_eq!(spool.stats().sealed_chunks, 1);
        let mark = crate::unsynced::read_mark(spool.conn()).expect("mark").mark.expect("an intact mark");
        let first_batch: i64 =
            spool.conn().query_row("SELECT min(id) FROM batches", [], |r| r.get(0)).expect("first batch");
        assert_eq!(mark, first_batch, "the mark covers the synced batch only");
        drop((spool, sync));
        let segs = segment_files(opts);
        assert_eq!(segs.len(), 1);
        (crate::segment::path(&opts.path, segs[0]), synced)
    }

    /// The segment file and offset of the bytes of the `n`th batch row (by id, from 0).
    fn batch_bytes_at(opts: &SpoolOptions, n: i64) -> (std::path::PathBuf, u64) {
        let conn = rusqlite::Connection::open(&opts.path).expect("open");
        let (seg, off): (i64, i64) = conn
            .query_row("SELECT segment, seg_offset FROM batches ORDER BY id LIMIT 1 OFFSET ?1", [n], |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .expect("batch");
        (crate::segment::path(&opts.path, seg), u64::try_from(off).expect("offset"))
    }

    #[test]
    fn a_power_cut_that_lost_unsynced_segment_bytes_drops_their_rows_and_reopens_the_chunk() {
        let (_dir, opts) = setup();
        let (seg, synced) = deferred_tail(&opts);
        // What a power cut leaves: the WAL's commits, the segment only as far as its last sync.
        lose_unsynced_bytes(&seg, synced);
        // `spool check` before the agent starts again: a lost tail, not damage.
        let checked = crate::check(&opts.path).expect("check");
        let tail = checked.lost_tail.clone().expect("a lost tail");
        assert_eq!((tail.batches, tail.records), (2, 2), "{checked:?}");
        assert!(!checked.has_damage(), "{checked:?}");
        let (mut spool, report) = open(&opts);
        assert_eq!(report.unsynced_records_dropped, 2);
        assert_eq!((report.open_batches, report.sealed_chunks), (1, 0), "the chunk is gone, \"first\" open again");
        assert_eq!(count(&spool, "SELECT count(*) FROM meta WHERE key = 'segments_synced_through'"), 0);
        // The chunk over the lost batches was never sent: its sequence number is used again.
        spool.append(&[req(vec![batch("a", b"again")])], 4).expect("append");
        spool.seal_all(5).expect("seal");
        let chunks = all_sealed(&spool);
        assert_eq!(chunks.len(), 1);
        assert_eq!((chunks[0].seq, chunks[0].records), (1, 2));
        assert_eq!(read(&spool, &chunks[0]).expect("read"), b"firstagain");
        assert!(!crate::check(&opts.path).expect("check").has_damage());
    }

    #[test]
    fn unsynced_segment_bytes_that_survived_are_kept_and_the_mark_is_removed() {
        let (_dir, opts) = setup();
        let (seg, _) = deferred_tail(&opts);
        // Written again at open, not only synced (after a failed sync their pages may be clean
        // in the cache and not on disk): the write moves the file's modification time.
        let epoch = std::time::SystemTime::UNIX_EPOCH;
        std::fs::File::options().write(true).open(&seg).expect("segment").set_modified(epoch).expect("set mtime");
        let (spool, report) = open(&opts);
        let modified = std::fs::metadata(&seg).expect("segment").modified().expect("mtime");
        assert!(modified > epoch, "the bytes above the mark were not written again");
        assert_eq!(report.unsynced_records_dropped, 0);
        assert_eq!(count(&spool, "SELECT count(*) FROM meta WHERE key = 'segments_synced_through'"), 0);
        let chunks = all_sealed(&spool);
        assert_eq!((chunks.len(), chunks[0].seq, chunks[0].records), (1, 1, 3));
        assert_eq!(read(&spool, &chunks[0]).expect("read"), b"firstsecondthird");
    }

    /// Damages the synced-segments mark's row (closed spool): one bit of its value, or of its key.
    fn damage_mark(opts: &SpoolOptions, key: bool) {
        let conn = rusqlite::Connection::open(&opts.path).expect("db");
        if key {
            conn.execute("UPDATE meta SET key = 'segments_synce$_through' WHERE key = ?1", [META_SEGMENTS_SYNCED])
                .expect("damage the key");
            return;
        }
        let mut v: Vec<u8> = conn
            .query_row("SELECT value FROM meta WHERE key = ?1", [META_SEGMENTS_SYNCED], |r| r.get(0))
            .expect("the mark");
        v[0] ^= 1;
        conn.execute("UPDATE meta SET value = ?2 WHERE key = ?1", (META_SEGMENTS_SYNCED, v)).expect("damage the value");
    }

    #[test]
    fn a_damaged_mark_key_or_value_is_found_by_check_and_removed_at_open() {
        for key in [false, true] {
            let (_dir, opts) = setup();
            deferred_tail(&opts);
            damage_mark(&opts, key);
            let checked = crate::check(&opts.path).expect("check");
            assert!(checked.has_damage(), "key {key}: {checked:?}");
            let what = if key { "never writes" } else { "fails its checksum" };
            assert!(checked.damaged_rows.iter().any(|r| r.contains(what)), "key {key}: {checked:?}");
            let (spool, report) = open(&opts);
            assert_eq!(report.unsynced_records_dropped, 0);
            assert_eq!(count(&spool, "SELECT count(*) FROM meta WHERE key LIKE 'segments%'"), 0, "key {key}");
            let chunks = all_sealed(&spool);
            assert_eq!(read(&spool, &chunks[0]).expect("read"), b"firstsecondthird");
            drop(spool);
            let checked = crate::check(&opts.path).expect("check");
            assert!(!checked.has_damage(), "key {key}, after open: {checked:?}");
        }
    }

    #[test]
    fn a_stray_meta_row_beside_an_intact_mark_is_removed_and_the_mark_still_drops_a_lost_tail() {
        let (_dir, opts) = setup();
        let (seg, synced) = deferred_tail(&opts);
        lose_unsynced_bytes(&seg, synced);
        let conn = rusqlite::Connection::open(&opts.path).expect("db");
        conn.execute("INSERT INTO meta (key, value) VALUES ('dropped_chunkr', 0)", []).expect("a stray row");
        drop(conn);
        let checked = crate::check(&opts.path).expect("check");
        assert!(checked.damaged_rows.iter().any(|r| r.contains("dropped_chunkr")), "{checked:?}");
        assert_eq!(checked.lost_tail.map(|t| t.records), Some(2), "the intact mark still finds the lost tail");
        let (spool, report) = open(&opts);
        assert_eq!(report.unsynced_records_dropped, 2);
        assert_eq!(count(&spool, "SELECT count(*) FROM meta WHERE key = 'dropped_chunkr'"), 0);
        drop(spool);
        assert!(!crate::check(&opts.path).expect("check").has_damage());
    }

    #[test]
    fn a_mark_written_as_a_plain_integer_by_an_earlier_build_is_still_honoured() {
        let (_dir, opts) = setup();
        let (seg, synced) = deferred_tail(&opts);
        lose_unsynced_bytes(&seg, synced);
        let conn = rusqlite::Connection::open(&opts.path).expect("db");
        conn.execute("UPDATE meta SET value = (SELECT min(id) FROM batches) WHERE key = ?1", [META_SEGMENTS_SYNCED])
            .expect("an integer mark");
        drop(conn);
        assert!(!crate::check(&opts.path).expect("check").has_damage());
        let (_spool, report) = open(&opts);
        assert_eq!(report.unsynced_records_dropped, 2);
    }

    #[test]
    fn with_a_damaged_mark_a_lost_write_is_not_dropped_at_open_but_found_when_read() {
        let (_dir, opts) = setup();
        let (seg, synced) = deferred_tail(&opts);
        lose_unsynced_bytes(&seg, synced);
        damage_mark(&opts, false);
        // Nothing is taken for a lost write from a mark that cannot be trusted: below the real
        // one, a batch that fails is damage, and dropping from it could drop answered records.
        assert_eq!(crate::check(&opts.path).expect("check").lost_tail, None);
        let (spool, report) = open(&opts);
        assert_eq!(report.unsynced_records_dropped, 0);
        let chunks = all_sealed(&spool);
        assert_eq!((chunks.len(), chunks[0].records), (1, 3));
        assert!(matches!(read(&spool, &chunks[0]), Err(SpoolError::Corrupt { .. })), "reading finds the lost bytes");
    }

    #[test]
    fn a_lost_tail_rewinds_a_stream_only_by_chunk_rows_that_pass_their_checksum() {
        // Chunk seq 1 sent and acked (the server holds seq 1), then chunk seq 2 sealed over a
        // batch whose bytes a power cut lost. Open drops both and takes the stream's next
        // sequence number back to the dropped chunk's, from its row: a damaged row said -1
        // (which broke the CHECK on `next_seq`, and so every open) or 1 (the server holds 1:
        // new data would be answered Duplicate and deleted).
        let cases = [
            ("", 2),
            ("UPDATE chunks SET seq = -1", 3),
            ("UPDATE chunks SET seq = 1", 3),
            ("UPDATE chunks SET sealed_ms = sealed_ms + 1", 3),
        ];
        for (damage, next) in cases {
            let (dir, opts) = setup();
            let (mut spool, _) = open(&opts);
            let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
            spool.append(&[req(vec![batch("a", b"a1")])], 1).expect("append");
            spool.seal_all(2).expect("seal");
            sync.sync(None).expect("sync");
            let synced =
                std::fs::metadata(crate::segment::path(&opts.path, segment_files(&opts)[0])).expect("len").len();
            let sent = spool.newest_chunk().expect("chunk seq 1");
            assert_eq!(spool.ack(&[sent]).expect("ack").acked, 1);
            spool.append(&[req(vec![batch("a", b"a2")])], 3).expect("append");
            spool.seal_all(4).expect("seal");
            drop((spool, sync));
            lose_unsynced_bytes(&crate::segment::path(&opts.path, segment_files(&opts)[0]), synced);
            if !damage.is_empty() {
                let conn = rusqlite::Connection::open(&opts.path).expect("db");
                assert_eq!(conn.execute(damage, []).expect("damage"), 1, "{damage}");
            }
            let (mut spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("{damage}: open: {e:?}"));
            assert!(report.quarantined.is_none(), "{damage}: {report:?}");
            assert!(
                std::fs::read_dir(dir.path()).expect("dir").all(|e| !e
                    .expect("entry")
                    .file_name()
                    .to_string_lossy()
                    .contains(".corrupt-"))
            );
            assert_eq!((report.unsynced_records_dropped, report.sealed_chunks), (1, 0), "{damage}");
            assert_eq!(spool.stats().streams[0].next_seq, next, "{damage}");
            spool.append(&[req(vec![batch("a", b"a3")])], 5).expect("append");
            spool.seal_all(6).expect("seal");
            let chunks = all_sealed(&spool);
            assert_eq!(chunks.iter().map(|c| c.seq).collect::<Vec<_>>(), [next], "{damage}");
            assert_eq!(read(&spool, &chunks[0]).expect("read"), b"a3", "{damage}");
            drop(spool);
            let (_spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("{damage}: reopen: {e:?}"));
            assert!(report.quarantined.is_none(), "{damage}: {report:?}");
        }
    }

    #[test]
    fn a_lost_batch_drops_the_later_batches_of_other_streams_too() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        spool.append(&[req(vec![batch("a", b"a1"), batch("b", b"b1")])], 1).expect("append");
        sync.sync(None).expect("sync");
        spool.append(&[req(vec![batch("a", b"a2")])], 2).expect("append");
        spool.commit(&[req(vec![batch("b", b"b2")])], &[], SealWhat::All, 3).expect("commit");
        drop((spool, sync));
        let (seg, a2) = batch_bytes_at(&opts, 2);
        // "a2" lost, "b2" (written after it) on disk: b2's commit was not answered either.
        let f = std::fs::OpenOptions::new().write(true).open(&seg).expect("segment");
        std::os::unix::fs::FileExt::write_all_at(&f, b"XX", a2).expect("damage a2");
        let (mut spool, report) = open(&opts);
        assert_eq!(report.unsynced_records_dropped, 2);
        assert_eq!((report.open_batches, report.sealed_chunks), (2, 0));
        spool.seal_all(4).expect("seal");
        let mut payloads: Vec<_> =
            all_sealed(&spool).iter().map(|c| (c.stream.clone(), c.seq, read(&spool, c).expect("read"))).collect();
        payloads.sort();
        assert_eq!(payloads, vec![("a".into(), 1, b"a1".to_vec()), ("b".into(), 1, b"b1".to_vec())]);
    }

    /// The index (database and WAL) as it is now: what a power cut leaves of it when the
    /// WAL's last sync was now.
    fn index_image(opts: &SpoolOptions) -> Vec<(std::path::PathBuf, Vec<u8>)> {
        ["", "-wal"]
            .iter()
            .map(|suffix| {
                let p = recovery::with_suffix(&opts.path, suffix);
                let bytes = std::fs::read(&p).expect("index file");
                (p, bytes)
            })
            .collect()
    }

    fn restore(opts: &SpoolOptions, image: &[(std::path::PathBuf, Vec<u8>)]) {
        for (p, bytes) in image {
            std::fs::write(p, bytes).expect("restore");
        }
        let _gone = std::fs::remove_file(recovery::with_suffix(&opts.path, "-shm"));
    }

    /// Under deferred syncs: `data` appended to stream "a" and synced, then the index's image
    /// taken (see [`index_image`]).
    #[allow(clippy::type_complexity)]
    fn synced_then_image(opts: &SpoolOptions, data: &[u8]) -> (Spool, WalSync, Vec<(std::path::PathBuf, Vec<u8>)>) {
        let (mut spool, _) = open(opts);
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        spool.append(&[req(vec![batch("a", data)])], 1).expect("append");
        sync.sync(None).expect("sync");
        let image = index_image(opts);
        (spool, sync, image)
    }

    #[allow(clippy::type_complexity)]
    fn chunks_and_payloads(spool: &Spool) -> Vec<(crate::ChunkMeta, Vec<u8>)> {
        all_sealed(spool).into_iter().map(|c| (c.clone(), read(spool, &c).expect("read"))).collect()
    }

    #[test]
    fn commits_the_wal_lost_in_a_power_cut_come_back_from_their_commit_records() {
        let (_dir, opts) = setup();
        let (mut spool, mut sync, image) = synced_then_image(&opts, b"first");
        spool.append(&[req(vec![batch("a", b"second"), batch("b", b"a new stream")])], 2).expect("append");
        spool.commit(&[req(vec![batch("a", b"third")])], &[], SealWhat::All, 3).expect("commit");
        sync.sync(spool.newest_chunk()).expect("sync");
        let before = chunks_and_payloads(&spool);
        assert_eq!(before.len(), 2);
        drop((spool, sync));
        // The WAL's last commits are lost; the segment's bytes, synced, are not.
        restore(&opts, &image);
        let checked = crate::check(&opts.path).expect("check");
        assert_eq!(
            checked.replayable,
            Some(crate::Replayable { commits: 2, records: 3, chunks: 2 }),
            "`spool check` before the agent starts again: what open adds back, not damage"
        );
        assert!(!checked.has_damage(), "{checked:?}");
        let (mut spool, report) = open(&opts);
        assert_eq!(report.replayed_records, 3);
        assert_eq!(crate::check(&opts.path).expect("check").replayable, None);
        assert_eq!(chunks_and_payloads(&spool), before, "the same chunks: ids, sequence numbers, times, bytes");
        assert_eq!(report.open_batches, 0);
        assert!(!crate::check(&opts.path).expect("check").has_damage());

        // The writer goes on after the replayed records: the next loss is replayed as well.
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        let image = index_image(&opts);
        spool.append(&[req(vec![batch("b", b"fourth")])], 4).expect("append");
        sync.sync(None).expect("sync");
        drop((spool, sync));
        restore(&opts, &image);
        let (mut spool, report) = open(&opts);
        assert_eq!((report.replayed_records, report.open_batches), (1, 1));
        spool.seal_all(5).expect("seal");
        let b: Vec<_> = chunks_and_payloads(&spool).into_iter().filter(|(c, _)| c.stream == "b").collect();
        assert_eq!(
            b.iter().map(|(c, p)| (c.seq, p.as_slice())).collect::<Vec<_>>(),
            [(1, &b"a new stream"[..]), (2, b"fourth")]
        );
        assert_eq!(segment_files(&opts).len(), 1, "one segment throughout");
    }

    #[test]
    fn under_normal_durability_commits_the_wal_lost_come_back_from_their_records_too() {
        let (_dir, mut opts) = setup();
        opts.durability = Durability::Normal;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"first")])], 1).expect("append");
        let image = index_image(&opts);
        spool.commit(&[req(vec![batch("a", b"second")])], &[], SealWhat::All, 2).expect("commit");
        let before = chunks_and_payloads(&spool);
        drop(spool);
        restore(&opts, &image);
        let (spool, report) = open(&opts);
        assert_eq!(report.replayed_records, 1);
        assert_eq!(chunks_and_payloads(&spool), before);
    }

    #[test]
    fn the_record_of_a_commit_that_failed_at_commit_is_voided_and_never_replayed() {
        let (_dir, opts) = setup();
        let (mut spool, mut sync, image) = synced_then_image(&opts, b"a1");
        // Its bytes and record are written, its COMMIT fails: the producer is told so.
        spool.fail_next_commit = true;
        spool.append(&[req(vec![batch("a", b"failed")])], 2).expect_err("COMMIT fails");
        // The next commit reuses the failed one's batch id; both are lost from the WAL.
        spool.append(&[req(vec![batch("a", b"good")])], 3).expect("append");
        sync.sync(None).expect("sync");
        drop((spool, sync));
        restore(&opts, &image);
        let (mut spool, report) = open(&opts);
        assert_eq!((report.replayed_records, report.open_batches), (1, 2));
        spool.seal_all(4).expect("seal");
        assert_eq!(chunks_and_payloads(&spool)[0].1, b"a1good", "the answered commit, not the failed one");
    }

    #[test]
    fn when_a_failed_commits_record_cannot_be_voided_appends_are_refused_until_a_restart() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"a1")])], 1).expect("append");
        spool.fail_next_commit = true;
        spool.segments.fail_next_void = true;
        spool.append(&[req(vec![batch("a", b"failed")])], 2).expect_err("COMMIT fails");
        // The next commit would reuse the failed one's ids while its record can still be
        // replayed: refused, with the reason.
        let err = spool.append(&[req(vec![batch("a", b"refused")])], 3).expect_err("appends are refused");
        let reason = std::error::Error::source(&err).map(ToString::to_string).unwrap_or_default();
        assert!(reason.contains("voiding the record of a failed commit"), "{err}: {reason}");
        assert_eq!(spool.stats().open_bytes, 2, "nothing of the refused append was kept");
        drop(spool);
        // After a restart the failed commit, whose outcome its producer could not know, is
        // back from its intact record, and appends go on behind it.
        let (mut spool, report) = open(&opts);
        assert_eq!(report.replayed_records, 1);
        spool.append(&[req(vec![batch("a", b"a3")])], 4).expect("append after the restart");
        spool.seal_all(5).expect("seal");
        assert_eq!(chunks_and_payloads(&spool)[0].1, b"a1faileda3");
    }

    #[test]
    fn a_commit_record_after_a_lost_seal_is_not_replayed() {
        let (_dir, opts) = setup();
        let (mut spool, sync, image) = synced_then_image(&opts, b"a1");
        // A seal on its own has no commit record; the next commit's record seals chunk 2.
        assert_eq!(spool.seal_all(2).expect("seal"), 1);
        spool.commit(&[req(vec![batch("a", b"a2")])], &[], SealWhat::All, 3).expect("commit");
        drop((spool, sync));
        // Both lost from the WAL (their sync had not ended: neither was answered or sent).
        restore(&opts, &image);
        let (mut spool, report) = open(&opts);
        assert_eq!((report.replayed_records, report.open_batches, report.sealed_chunks), (0, 1, 0));
        spool.append(&[req(vec![batch("a", b"a3")])], 4).expect("append");
        spool.seal_all(5).expect("seal");
        let chunks = chunks_and_payloads(&spool);
        assert_eq!(chunks.len(), 1);
        assert_eq!((chunks[0].0.seq, chunks[0].1.as_slice()), (1, &b"a1a3"[..]));
        assert!(!crate::check(&opts.path).expect("check").has_damage());
    }

    #[test]
    fn after_a_lost_tail_was_dropped_the_commits_in_the_next_segment_are_replayed_past_the_stale_records() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        spool.append(&[req(vec![batch("a", b"a1")])], 1).expect("append");
        sync.sync(None).expect("sync");
        spool.append(&[req(vec![batch("a", b"a2")])], 2).expect("append");
        spool.append(&[req(vec![batch("a", b"b2")])], 3).expect("append");
        drop((spool, sync));
        // "a2" lost in a power cut; "b2", written after it, survived but was never answered.
        let (seg, a2) = batch_bytes_at(&opts, 1);
        let f = std::fs::OpenOptions::new().write(true).open(&seg).expect("segment");
        std::os::unix::fs::FileExt::write_all_at(&f, b"XX", a2).expect("damage a2");
        let (mut spool, report) = open(&opts);
        assert_eq!(report.unsynced_records_dropped, 2);
        // The next commit reuses a2's batch id, in a new segment; then the WAL loses it.
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        let image = index_image(&opts);
        spool.append(&[req(vec![batch("a", b"a3")])], 4).expect("append");
        sync.sync(None).expect("sync");
        assert_eq!(segment_files(&opts), vec![1, 2]);
        drop((spool, sync));
        restore(&opts, &image);
        let (mut spool, report) = open(&opts);
        assert_eq!((report.replayed_records, report.open_batches), (1, 2), "a3 back, not b2");
        spool.seal_all(5).expect("seal");
        let chunks = chunks_and_payloads(&spool);
        assert_eq!(chunks.iter().map(|(c, p)| (c.seq, p.as_slice())).collect::<Vec<_>>(), [(1, &b"a1a3"[..])]);
    }

    #[test]
    fn a_segment_whose_records_break_off_before_its_last_row_is_not_continued() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"one")])], 1).expect("append");
        spool.append(&[req(vec![batch("a", b"two")])], 2).expect("append");
        drop(spool);
        // The second record's prefix damaged: its rows are in the index, its record unreadable,
        // so a record written after it could never be read back.
        let (seg, two) = batch_bytes_at(&opts, 1);
        let f = std::fs::OpenOptions::new().write(true).open(&seg).expect("segment");
        std::os::unix::fs::FileExt::write_all_at(&f, b"X", two - journal::PREFIX).expect("damage the magic");
        let (mut spool, report) = open(&opts);
        assert_eq!((report.replayed_records, report.open_batches), (0, 2));
        spool.append(&[req(vec![batch("a", b"three")])], 3).expect("append");
        assert_eq!(segment_files(&opts).len(), 2, "the next record starts a new segment");
        spool.seal_all(4).expect("seal");
        assert_eq!(chunks_and_payloads(&spool)[0].1, b"onetwothree");
    }

    #[test]
    fn a_segment_whose_records_stop_short_of_its_rows_is_not_continued() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"one")])], 1).expect("append");
        drop(spool);
        // As a segment written before commit records (or damaged there) reads.
        let (seg, _) = batch_bytes_at(&opts, 0);
        let f = std::fs::OpenOptions::new().write(true).open(&seg).expect("segment");
        std::os::unix::fs::FileExt::write_all_at(&f, b"XXXX", 0).expect("damage the record's prefix");
        let (mut spool, report) = open(&opts);
        assert_eq!((report.replayed_records, report.open_batches), (0, 1));
        spool.append(&[req(vec![batch("a", b"two")])], 2).expect("append");
        assert_eq!(segment_files(&opts).len(), 2, "the next record starts a new segment");
        spool.seal_all(3).expect("seal");
        let chunks = chunks_and_payloads(&spool);
        assert_eq!(chunks[0].1, b"onetwo");
    }

    #[test]
    fn a_spool_that_never_deferred_has_no_mark_and_nothing_is_checked() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"bytes")])], 1).expect("append");
        assert_eq!(count(&spool, "SELECT count(*) FROM meta WHERE key = 'segments_synced_through'"), 0);
        drop(spool);
        let (_, report) = open(&opts);
        assert_eq!((report.unsynced_records_dropped, report.open_batches), (0, 1));
    }

    #[test]
    fn after_a_clean_shutdown_damage_in_the_last_commits_is_damage_not_a_lost_write() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        let mut sync = spool.defer_wal_sync().expect("defer").expect("full defers");
        spool.append(&[req(vec![batch("a", b"first")])], 1).expect("append");
        spool.commit(&[req(vec![batch("a", b"second")])], &[], SealWhat::All, 2).expect("commit");
        // Not synced yet: the mark stays where it is.
        spool.mark_synced().expect("mark");
        let mark =
            |spool: &Spool| crate::unsynced::read_mark(spool.conn()).expect("mark").mark.expect("an intact mark");
        assert_eq!(mark(&spool), 0);
        // The last sync, as at shutdown: then the mark covers every batch.
        sync.sync(None).expect("sync");
        spool.mark_synced().expect("mark");
        assert_eq!(mark(&spool), count(&spool, "SELECT max(id) FROM batches"));
        drop((spool, sync));
        // A byte of "second" damaged while the agent was stopped.
        let (seg, second) = batch_bytes_at(&opts, 1);
        let f = std::fs::OpenOptions::new().write(true).open(&seg).expect("segment");
        std::os::unix::fs::FileExt::write_all_at(&f, b"X", second + 1).expect("damage");
        let (spool, report) = open(&opts);
        assert_eq!(report.unsynced_records_dropped, 0, "nothing is taken for a lost write");
        let chunks = all_sealed(&spool);
        assert_eq!((chunks.len(), chunks[0].records), (1, 2), "the chunk is still there");
        assert!(matches!(read(&spool, &chunks[0]), Err(SpoolError::Corrupt { .. })), "and reading it finds the damage");
    }

    #[test]
    fn newest_chunk_counts_acked_chunks_too() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        assert_eq!(spool.newest_chunk(), None);
        spool.append(&[req(vec![batch("a", b"x")])], 1).expect("append");
        spool.seal_all(2).expect("seal");
        let id = spool.newest_chunk().expect("a chunk");
        spool.ack(&[id]).expect("ack");
        assert_eq!(spool.newest_chunk(), Some(id));
    }

    #[test]
    fn set_limits_applies_from_the_next_append() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[0; 50])])], 1).expect("append");
        spool.set_limits(60, FullPolicy::DropOldest, 10);
        assert_eq!((spool.options().max_bytes, spool.options().full_policy), (60, FullPolicy::DropOldest));
        assert_eq!(spool.append(&[req(vec![batch("a", &[0; 20])])], 2).expect("append"), vec![AppendOutcome::Full]);
        spool.set_limits(100, FullPolicy::Reject, 10);
        assert_eq!(spool.append(&[req(vec![batch("a", &[0; 20])])], 3).expect("append"), vec![AppendOutcome::Accepted]);
    }

    #[test]
    fn a_request_naming_a_stream_past_max_streams_is_refused_whole_and_known_streams_stay_usable() {
        let (_dir, mut opts) = setup();
        opts.max_streams = 2;
        opts.full_policy = FullPolicy::DropOldest;
        let (mut spool, _) = open(&opts);
        use AppendOutcome::{Accepted, TooManyStreams};
        // In one commit: the second request makes two streams, the third would make a third
        // (its batch for a known stream is not stored either), the fourth uses known ones.
        let out = spool
            .append(
                &[
                    req(vec![batch("a", b"1")]),
                    req(vec![batch("a", b"2"), batch("b", b"3")]),
                    req(vec![batch("b", b"4"), batch("c", b"5")]),
                    req(vec![batch("b", b"6"), batch("a", b"7")]),
                ],
                1,
            )
            .expect("append");
        assert_eq!(out, vec![Accepted, Accepted, TooManyStreams, Accepted]);
        spool.seal_all(2).expect("seal");
        let stats = spool.stats();
        let names: Vec<&str> = stats.streams.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["a", "b"]);
        // Records 1, 2, 3, 6 and 7: nothing of the refused request.
        assert_eq!((stats.sealed_chunks, stats.open_records, stats.total_bytes), (2, 0, 5));
        // Acked and gone, a stream is still known: a new one is still refused.
        let (mut reader, mut ids) = (spool.reader().expect("reader"), Vec::new());
        for m in reader.sealed_after(None, 10).expect("read") {
            ids.push(m.id);
        }
        spool.ack(&ids).expect("ack");
        assert_eq!(spool.append(&[req(vec![batch("d", b"8")])], 3).expect("append"), vec![TooManyStreams]);
        // Raised at run time (a reload), it applies from the next append.
        spool.set_limits(opts.max_bytes, opts.full_policy, 3);
        assert_eq!(spool.append(&[req(vec![batch("d", b"8")])], 4).expect("append"), vec![Accepted]);
        assert_eq!(spool.stats().streams.len(), 3);
    }

    #[test]
    fn open_creates_the_missing_parent_directory() {
        let dir = tempfile::tempdir().expect("temp dir");
        let opts = SpoolOptions::new(dir.path().join("a/b/spool.db"));
        let (_spool, report) = open(&opts);
        assert!(report.created);
        assert!(opts.path.exists());
    }

    #[test]
    fn empty_calls_and_empty_requests_are_harmless() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        assert!(spool.append(&[], 1).expect("append").is_empty());
        assert_eq!(spool.append(&[req(vec![])], 1).expect("append"), vec![AppendOutcome::Accepted]);
        assert_eq!(spool.seal_all(1).expect("seal"), 0);
        assert_eq!(spool.seal_due(1).expect("seal"), 0);
        assert_eq!(spool.stats(), SpoolStats::default());
    }

    #[test]
    fn a_reader_sees_chunks_sealed_after_it_was_opened() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        let mut reader = spool.reader().expect("reader");
        assert!(reader.sealed_after(None, 10).expect("list").is_empty());
        spool.append(&[req(vec![batch("a", b"1")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        spool.append(&[req(vec![batch("a", b"2")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        let first = reader.sealed_after(None, 1).expect("list");
        assert_eq!(first.len(), 1);
        let next = reader.sealed_after(Some(first[0].id), 10).expect("list");
        assert_eq!((next.len(), next[0].seq), (1, 2));
    }

    #[test]
    fn spool_and_reader_are_send() {
        fn assert_send<T: Send>() {}
        assert_send::<Spool>();
        assert_send::<SpoolReader>();
        assert_send::<SpoolError>();
    }

    fn segment_files(opts: &SpoolOptions) -> Vec<i64> {
        crate::segment::list(&opts.path).expect("list segments").into_iter().map(|(id, _)| id).collect()
    }

    #[test]
    fn segments_roll_over_and_are_deleted_once_their_chunks_are_acked() {
        let (_dir, mut opts) = setup();
        // Each 300-byte commit is a record of 404 to 476 bytes (32-byte prefix; a 72-byte
        // trailer per batch row and per chunk sealed, 13 more for a new stream).
        opts.segment_target_bytes = 1_500;
        opts.chunk_target_bytes = 600;
        let (mut spool, _) = open(&opts);
        for i in 0..10u8 {
            spool.append(&[req(vec![batch("a", &[i; 300])])], u64::from(i)).expect("append");
        }
        // Four commits per segment (the fourth crosses its target).
        assert_eq!(segment_files(&opts), vec![1, 2, 3]);
        let chunks = all_sealed(&spool);
        assert_eq!(chunks.len(), 5);
        let mut reader = spool.reader().expect("reader");
        for (i, c) in chunks.iter().enumerate() {
            let mut want = vec![2 * i as u8; 300];
            want.extend_from_slice(&[2 * i as u8 + 1; 300]);
            assert_eq!(reader.read(c).expect("read"), want);
        }
        // Segment 1 holds the first two chunks: acking one keeps it, acking both deletes it,
        // or rather keeps its file as the spare.
        let inode = |p: &std::path::Path| std::os::unix::fs::MetadataExt::ino(&std::fs::metadata(p).expect("stat"));
        let seg1 = inode(&crate::segment::path(&opts.path, 1));
        spool.ack(&[chunks[0].id]).expect("ack");
        assert_eq!(segment_files(&opts), vec![1, 2, 3]);
        spool.ack(&[chunks[1].id]).expect("ack");
        assert_eq!(segment_files(&opts), vec![2, 3]);
        let spare = crate::segment::spare_path(&opts.path, 0);
        assert_eq!(inode(&spare), seg1);
        // The active segment, all dead and over a quarter full, goes too (unlinked: there is
        // a spare already); the next commit starts a new one, in the spare's file.
        spool.ack(&[chunks[2].id, chunks[3].id, chunks[4].id]).expect("ack");
        assert_eq!(segment_files(&opts), Vec::<i64>::new());
        spool.append(&[req(vec![batch("a", &[7; 10])])], 20).expect("append");
        assert_eq!(segment_files(&opts), vec![4]);
        assert_eq!(inode(&crate::segment::path(&opts.path, 4)), seg1);
        assert!(!spare.exists());
        // A small dead active segment is kept and written on.
        spool.seal_all(21).expect("seal");
        let last = all_sealed(&spool).remove(0);
        assert_eq!(reader.read(&last).expect("read over old bytes"), vec![7; 10]);
        spool.ack(&[last.id]).expect("ack");
        spool.append(&[req(vec![batch("a", &[8; 10])])], 22).expect("append");
        assert_eq!(segment_files(&opts), vec![4]);
        // Two records of a 10-byte batch: prefix, payload and a 72-byte trailer each.
        assert_eq!(spool.segments.active_end(), Some((4, 2 * (journal::PREFIX + 10 + 72))));
        spool.seal_all(23).expect("seal");
        let last = all_sealed(&spool).remove(0);
        assert_eq!(reader.read(&last).expect("read"), vec![8; 10]);
        drop(reader);
        let stats = spool.stats();
        drop(spool);
        assert_eq!(open(&opts).0.stats(), stats);
    }

    #[test]
    fn a_segment_counted_empty_by_mistake_is_kept_while_rows_from_before_and_after_a_reopen_use_it() {
        let (_dir, mut opts) = setup();
        // 900 bytes in all: one segment, and over a quarter of it, so it goes once dead.
        opts.segment_target_bytes = 3_000;
        opts.chunk_target_bytes = 100_000;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", &[1; 300])])], 1).expect("append");
        spool.append(&[req(vec![batch("b", &[2; 300])])], 2).expect("append");
        drop(spool);
        // The reopened spool continues segment 1: its range must cover rows of both lives.
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("c", &[3; 300])])], 3).expect("append");
        assert_eq!(segment_files(&opts), vec![1]);
        spool.seal_all(4).expect("seal");
        let chunks = all_sealed(&spool);
        assert_eq!(chunks.len(), 3);
        // A counter that went wrong must not delete the file: the rows are counted again.
        spool.state.segments.get_mut(&1).expect("segment 1 in use").rows = 0;
        spool.ack(&[chunks[2].id]).expect("ack");
        assert_eq!(segment_files(&opts), vec![1]);
        assert_eq!(spool.state.segments[&1].rows, 2, "recounted from the rows of segment 1");
        let mut reader = spool.reader().expect("reader");
        assert_eq!(reader.read(&chunks[0]).expect("read"), vec![1; 300]);
        // The rows gone, the segment goes.
        spool.ack(&[chunks[0].id, chunks[1].id]).expect("ack");
        assert_eq!(segment_files(&opts), Vec::<i64>::new());
    }

    #[test]
    fn open_cuts_an_unfinished_commit_and_deletes_unreferenced_segments() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"kept")])], 1).expect("append");
        drop(spool);
        // A commit that wrote its bytes and died before the index commit, and a segment created
        // for a commit that never happened.
        let seg1 = crate::segment::path(&opts.path, 1);
        assert_eq!(journal::payloads(&seg1, 1), b"kept");
        let mut bytes = std::fs::read(&seg1).expect("segment 1");
        bytes.extend_from_slice(b"torn tail");
        std::fs::write(&seg1, &bytes).expect("tail");
        std::fs::write(crate::segment::path(&opts.path, 9), b"never committed").expect("stray segment");
        let (mut spool, report) = open(&opts);
        assert!(report.quarantined.is_none());
        assert_eq!(journal::payloads(&seg1, 1), b"kept", "the torn tail is cut");
        assert_eq!(segment_files(&opts), vec![1]);
        // New bytes continue where the committed ones end.
        spool.append(&[req(vec![batch("a", b"+more")])], 2).expect("append");
        spool.seal_all(3).expect("seal");
        assert_eq!(read(&spool, &all_sealed(&spool)[0]).expect("read"), b"kept+more");
        assert_eq!(journal::payloads(&seg1, 1), b"kept+more");
    }

    #[test]
    fn a_disk_full_segment_write_stores_nothing_and_retires_the_segment() {
        let (_dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"one")])], 1).expect("append");
        spool.simulate_full_segments(true);
        let err = spool.append(&[req(vec![batch("a", b"lost")])], 2).expect_err("disk full");
        assert!(matches!(err, SpoolError::DiskFull), "{err:?}");
        // Retired: it takes no more bytes, so acking its chunks will delete it and give its
        // space back on a disk that stays full.
        let err = spool.append(&[req(vec![batch("a", b"lost")])], 2).expect_err("disk full");
        assert!(matches!(err, SpoolError::DiskFull), "{err:?}");
        assert_eq!(segment_files(&opts), vec![1, 2]);
        assert_eq!(journal::payloads(&crate::segment::path(&opts.path, 1), 1), b"one");
        spool.simulate_full_segments(false);
        spool.append(&[req(vec![batch("a", b"two")])], 3).expect("append");
        spool.seal_all(4).expect("seal");
        let chunk = all_sealed(&spool).remove(0);
        assert_eq!(read(&spool, &chunk).expect("read"), b"onetwo");
        assert_eq!(journal::payloads(&crate::segment::path(&opts.path, 2), 2), b"two");
        spool.ack(&[chunk.id]).expect("ack");
        assert_eq!(segment_files(&opts), vec![2], "the retired segment went with its last chunk");
    }

    /// A spool with 1,000-byte segments whose first segment, emptied by an ack, is now the
    /// spare: stream "a" acked (1,200 bytes in segment 1), stream "b" open with "x" (segment 2).
    fn spool_with_a_spare() -> (TempDir, SpoolOptions, Spool, std::path::PathBuf) {
        let (dir, mut opts) = setup();
        opts.segment_target_bytes = 1_000;
        let (mut spool, _) = open(&opts);
        for i in 0..4u8 {
            spool.append(&[req(vec![batch("a", &[i; 300])])], u64::from(i)).expect("append");
        }
        spool.seal_all(5).expect("seal");
        spool.append(&[req(vec![batch("b", b"x")])], 6).expect("append");
        let first = all_sealed(&spool).remove(0);
        spool.ack(&[first.id]).expect("ack");
        let spare = crate::segment::spare_path(&opts.path, 0);
        (dir, opts, spool, spare)
    }

    #[test]
    fn a_full_disk_deletes_the_spare_segment_and_dead_segments_are_then_unlinked() {
        let (_dir, _opts, mut spool, spare) = spool_with_a_spare();
        assert!(spare.exists(), "segment 1 kept as the spare");
        // A full disk: the spare's space is given back at once.
        spool.simulate_full_segments(true);
        let err = spool.append(&[req(vec![batch("a", b"lost")])], 7).expect_err("disk full");
        assert!(matches!(err, SpoolError::DiskFull), "{err:?}");
        assert!(!spare.exists(), "the spare is deleted when the disk is full");
        spool.simulate_full_segments(false);
    }

    #[test]
    fn segments_without_their_database_are_moved_aside_not_deleted() {
        let (dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"orphaned bytes")])], 1).expect("append");
        drop(spool);
        std::fs::remove_file(&opts.path).expect("remove database");
        let _ = std::fs::remove_file(crate::recovery::with_suffix(&opts.path, "-wal"));
        let (_spool, report) = open(&opts);
        assert!(report.created);
        assert!(segment_files(&opts).is_empty());
        let kept: Vec<_> = std::fs::read_dir(dir.path())
            .expect("dir")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains(".orphan-"))
            .collect();
        assert_eq!(kept.len(), 1, "{kept:?}");
        assert_eq!(journal::payloads(&dir.path().join(&kept[0]), 1), b"orphaned bytes");
    }

    #[test]
    fn a_second_writer_is_refused_before_it_touches_the_file_and_the_first_goes_on() {
        let (dir, opts) = setup();
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"first")])], 1).expect("append");
        let files = |d: &std::path::Path| {
            let mut v: Vec<_> = std::fs::read_dir(d)
                .expect("dir")
                .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                .collect();
            v.sort();
            v
        };
        let before = files(dir.path());
        match Spool::open(opts.clone()) {
            Err(e @ SpoolError::Locked { .. }) => {
                let text = e.to_string();
                assert!(text.contains(&format!("in use by process {}", std::process::id())), "{text}");
                assert!(text.contains(&opts.path.display().to_string()), "{text}");
            }
            other => panic!("a second writer must be refused, got {:?}", other.map(|(_, r)| r)),
        }
        assert_eq!(files(dir.path()), before, "the refused open created or moved nothing");
        spool.append(&[req(vec![batch("a", b"second")])], 2).expect("the first writer goes on");
        spool.seal_all(3).expect("seal");
        let chunk = all_sealed(&spool).remove(0);
        assert_eq!(read(&spool, &chunk).expect("read"), b"firstsecond");
        drop(spool);
        let (spool, report) = open(&opts);
        assert_eq!(report.sealed_chunks, 1, "open once the first writer is gone");
        drop(spool);
    }

    /// What a process crash leaves of `spool`: nothing closed cleanly (no checkpoint, no final
    /// sync), but its lock released, as the kernel closes a dead process's files (a lock of
    /// another file in `dir` is leaked in its place).
    fn crash(mut spool: Spool, dir: &std::path::Path) {
        let other = crate::lock::SpoolLock::acquire(&dir.join("elsewhere.db")).expect("lock");
        drop(std::mem::replace(&mut spool._lock, other));
        std::mem::forget(spool);
    }

    #[test]
    fn the_spare_survives_a_restart_and_is_reused_but_a_new_database_deletes_it() {
        let (_dir, opts, spool, spare) = spool_with_a_spare();
        assert!(spare.exists());
        // A crash (no clean close): the spare is still there and still the spare.
        crash(spool, _dir.path());
        let (mut spool, _) = open(&opts);
        assert!(spare.exists());
        assert_eq!(segment_files(&opts), vec![2]);
        // Segment 2 is small and continued; fill it so the next commit needs a new segment.
        spool.append(&[req(vec![batch("b", &[9; 1_000])])], 7).expect("append");
        spool.append(&[req(vec![batch("b", b"y")])], 8).expect("append");
        assert!(!spare.exists(), "the new segment was renamed from the spare");
        assert_eq!(segment_files(&opts), vec![2, 3]);
        spool.seal_all(9).expect("seal");
        let mut want = b"x".to_vec();
        want.extend_from_slice(&[9; 1_000]);
        want.extend_from_slice(b"y");
        let chunk = all_sealed(&spool).remove(0);
        assert_eq!(read(&spool, &chunk).expect("read over the spare's old bytes"), want);
        // Segment 2 emptied becomes the spare; after a restart the next segment takes it.
        spool.ack(&[chunk.id]).expect("ack");
        assert!(spare.exists());
        drop(spool);
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("c", b"z")])], 10).expect("append");
        assert!(!spare.exists());
        spool.seal_all(11).expect("seal");
        let chunk = all_sealed(&spool).remove(0);
        assert_eq!(read(&spool, &chunk).expect("read"), b"z");
        drop(spool);
        // A database created anew has no use for a spare: it holds acked bytes only.
        std::fs::write(&spare, b"dead bytes").expect("plant a spare");
        std::fs::remove_file(&opts.path).expect("remove database");
        let _ = std::fs::remove_file(crate::recovery::with_suffix(&opts.path, "-wal"));
        let (_spool, report) = open(&opts);
        assert!(report.created);
        assert!(!spare.exists(), "a new database deletes the spare");
    }

    #[test]
    fn disk_usage_counts_the_database_and_segments_but_not_the_reserve_or_moved_aside_files() {
        let (dir, mut opts) = setup();
        opts.segment_target_bytes = 64 << 10;
        let (mut spool, _) = open(&opts);
        let empty = crate::disk_usage(&opts.path).expect("usage");
        assert!(empty > 0, "the database takes blocks");
        for i in 0..4u8 {
            spool.append(&[req(vec![batch("a", &[i; 40 << 10])])], u64::from(i)).expect("append");
        }
        let full = crate::disk_usage(&opts.path).expect("usage");
        assert!(full >= empty + (160 << 10), "segments counted: {empty} then {full}");
        // Files that are not the spool's own are not counted.
        std::fs::write(dir.path().join("spool.db.corrupt-1"), vec![1u8; 100 << 10]).expect("moved-aside file");
        std::fs::write(dir.path().join("other.db"), vec![1u8; 100 << 10]).expect("another file");
        let reserve = crate::recovery::with_suffix(&opts.path, "-reserve");
        assert!(reserve.exists(), "the reserve is there and not counted");
        assert_eq!(crate::disk_usage(&opts.path).expect("usage"), full);
        // Acked, the segments go (but for the spare and the active one), and so does their space.
        spool.seal_all(5).expect("seal");
        let ids: Vec<ChunkId> = all_sealed(&spool).iter().map(|c| c.id).collect();
        spool.ack(&ids).expect("ack");
        let after = crate::disk_usage(&opts.path).expect("usage");
        assert!(after < full, "{after} < {full}");
    }

    #[test]
    fn a_missing_segment_makes_its_chunks_corrupt_and_the_rest_still_flows() {
        let (_dir, mut opts) = setup();
        opts.segment_target_bytes = 1;
        let (mut spool, _) = open(&opts);
        spool.append(&[req(vec![batch("a", b"first")])], 1).expect("append");
        spool.seal_all(1).expect("seal");
        spool.append(&[req(vec![batch("a", b"second")])], 2).expect("append");
        spool.seal_all(2).expect("seal");
        drop(spool);
        std::fs::remove_file(crate::segment::path(&opts.path, 1)).expect("lose segment 1");
        let (mut spool, report) = open(&opts);
        assert!(report.quarantined.is_none());
        let chunks = all_sealed(&spool);
        let err = read(&spool, &chunks[0]).expect_err("missing");
        assert!(matches!(&err, SpoolError::Corrupt { detail, .. } if detail.contains("missing")), "{err:?}");
        assert_eq!(read(&spool, &chunks[1]).expect("read"), b"second");
        let audit = crate::check(&opts.path).expect("check");
        assert_eq!(audit.damaged_chunks.len(), 1, "{audit:?}");
        spool.quarantine(chunks[0].id, "missing segment").expect("quarantine");
        spool.ack(&[chunks[1].id]).expect("ack");
        assert_eq!(spool.purge_quarantined().expect("purge"), 1);
        assert_eq!(spool.stats().total_bytes, 0);
    }
}
