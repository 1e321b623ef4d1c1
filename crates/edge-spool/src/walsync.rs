//! The syncs, taken off the writer's path: under [`Durability::Full`](crate::Durability::Full)
//! the writer may run `synchronous=NORMAL`, write each commit's payload bytes without syncing
//! them, and hand each commit to a [`WalSync`] on another thread, which makes it durable (see
//! [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync)). A commit that appends is durable
//! once its segment bytes are: they hold its commit record, from which open adds its rows back
//! if the WAL lost them (`journal.rs`). So most rounds are one `fdatasync` of the segments
//! written since the last. The WAL is synced too, while a thread of its own, `edge-spool-seg`,
//! syncs the segments beside it, when a commit without a record made rows that must be durable
//! (seals on their own), and at least every [`WAL_AT_LEAST_EVERY`] or
//! [`WAL_AT_LEAST_PER_BYTES`] of records, which bounds what open may have to replay. On a
//! gateway's flash, where a sync takes milliseconds and the card serves one at a time, that is
//! what a producer waits for.
//!
//! Under `NORMAL` a commit is visible to every connection as soon as `COMMIT` returns, before
//! it is durable. A chunk read and sent in that window could be stored by the server and then
//! be rolled back by a power cut: sealed again under the same sequence number with other
//! records, it would be deduplicated away. So readers see chunks only up to the *visible*
//! watermark, the newest chunk id a completed sync covers ([`SpoolReader::sealed_after`]
//! filters by it).
//!
//! The segment bytes of a commit are not durable when its rows are committed either, and the
//! sync of the WAL may make the rows durable first (it syncs every commit in the file, also
//! those that came after the segments' sync started). So commits record in `meta`
//! (`segments_synced_through`) a batch id at or below the newest whose bytes a completed sync
//! covers, and open checks the bytes of every batch above it ([`crate::unsynced`]).
//!
//! [`SpoolReader::sealed_after`]: crate::SpoolReader::sealed_after

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError, mpsc};

use crate::{ChunkId, SpoolError};

/// The newest chunk id readers may list; `i64::MAX` while every commit is durable when it
/// returns. Shared by the writer, its [`WalSync`] and every reader made by
/// [`Spool::reader`](crate::Spool::reader).
#[derive(Debug, Clone)]
pub(crate) struct Visible(Arc<AtomicI64>);

impl Default for Visible {
    fn default() -> Self {
        Visible(Arc::new(AtomicI64::new(i64::MAX)))
    }
}

impl Visible {
    pub(crate) fn get(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }

    pub(crate) fn set(&self, through: i64) {
        self.0.store(through, Ordering::Release);
    }

    fn raise(&self, through: i64) {
        self.0.fetch_max(through, Ordering::AcqRel);
    }
}

/// Payload segments written and not yet synced, shared by the writer (which registers each
/// write) and its [`WalSync`] (whose segment thread syncs them while the WAL is synced). Writes
/// are numbered by the writer from 1. Whichever thread comes first syncs what is registered;
/// another that needs the same writes durable waits for it instead of syncing them again.
#[derive(Debug, Clone, Default)]
pub(crate) struct SegmentSyncs(Arc<SyncsShared>);

#[derive(Debug, Default)]
struct SyncsShared {
    state: Mutex<SyncsState>,
    /// Signalled when a sync ends.
    ended: Condvar,
}

#[derive(Debug, Default)]
struct SyncsState {
    /// The segments written since the last sync took them, by id.
    files: Vec<(i64, Arc<File>)>,
    /// The number of the newest write registered.
    registered: u64,
    /// The number of the newest write that a completed sync covers (0: none yet).
    synced: u64,
    /// A sync has taken `files` and not ended yet.
    running: bool,
    /// A commit since the last sync of the WAL has rows that no commit record holds (seals on
    /// their own): the next sync must sync the WAL too.
    wal_needed: bool,
    /// Payload bytes registered since the WAL's last sync: what a power cut could leave for
    /// open to replay from the commit records.
    since_wal: u64,
    /// The first sync that failed, with the segment it failed on: nothing after it is durable
    /// (see [`WalSync`]'s `failed`).
    failed: Option<(PathBuf, String)>,
}

impl SegmentSyncs {
    fn lock(&self) -> std::sync::MutexGuard<'_, SyncsState> {
        self.0.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Write number `write` put `bytes` bytes into segment `id` (`file`), not synced.
    pub(crate) fn register(&self, id: i64, file: &Arc<File>, write: u64, bytes: u64) {
        let mut st = self.lock();
        st.since_wal = st.since_wal.saturating_add(bytes);
        if !st.files.iter().any(|(i, _)| *i == id) {
            st.files.push((id, Arc::clone(file)));
        }
        st.registered = st.registered.max(write);
    }

    /// A commit without a commit record made rows that must be durable: the next
    /// [`WalSync::sync`] syncs the WAL.
    pub(crate) fn need_wal(&self) {
        self.lock().wal_needed = true;
    }

    /// Whether a commit since the WAL's last sync needs the next sync to sync it.
    #[cfg(test)]
    pub(crate) fn wal_needed(&self) -> bool {
        self.lock().wal_needed
    }

    /// Whether the next sync must sync the WAL too: a commit needs it, or the commit records
    /// since its last sync hold `limit` bytes or more.
    fn wal_due(&self, limit: u64) -> bool {
        let st = self.lock();
        st.wal_needed || st.since_wal >= limit
    }

    /// The WAL's sync is starting: what was due is covered by it.
    fn wal_syncing(&self) {
        let mut st = self.lock();
        st.wal_needed = false;
        st.since_wal = 0;
    }

    /// The number of the newest write whose bytes are durable.
    pub(crate) fn synced_write(&self) -> u64 {
        self.lock().synced
    }

    /// The number of the newest write registered, when some registered write is not known to
    /// be durable (not synced yet, or its sync failed); `None` when there is nothing to sync.
    fn unsynced_through(&self) -> Option<u64> {
        let st = self.lock();
        (st.registered > st.synced).then_some(st.registered)
    }

    /// Returns once writes 1 to `target` are durable: synced here, or by a sync another
    /// thread is running.
    ///
    /// # Errors
    /// [`SpoolError::Io`] naming the segment when a sync failed, now or before.
    fn sync_through(&self, db: &Path, target: u64) -> Result<(), SpoolError> {
        let mut st = self.lock();
        loop {
            if let Some((path, first)) = &st.failed {
                let detail = format!("a sync of this payload segment failed ({first}); nothing since is durable");
                return Err(SpoolError::Io { path: path.clone(), source: std::io::Error::other(detail) });
            }
            if st.synced >= target {
                return Ok(());
            }
            if st.running {
                st = self.0.ended.wait(st).unwrap_or_else(PoisonError::into_inner);
                continue;
            }
            let files = std::mem::take(&mut st.files);
            let through = st.registered;
            st.running = true;
            drop(st);
            let result = files.iter().try_for_each(|(id, file)| file.sync_data().map_err(|e| (*id, e)));
            st = self.lock();
            st.running = false;
            match result {
                Ok(()) => st.synced = st.synced.max(through),
                Err((id, e)) => st.failed = Some((crate::segment::path(db, id), e.to_string())),
            }
            self.0.ended.notify_all();
        }
    }
}

/// With deferred segment syncs, the WAL is synced at least this often...
pub(crate) const WAL_AT_LEAST_EVERY: std::time::Duration = std::time::Duration::from_secs(1);
/// ... and whenever the commit records written since its last sync hold this many bytes: after
/// a power cut, open replays at most about this much.
pub(crate) const WAL_AT_LEAST_PER_BYTES: u64 = 64 << 20;

/// Makes the writer's commits durable after the fact; made by
/// [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync). `Send`: it is meant for a thread of
/// its own.
///
/// It holds the WAL open, as the writer's connection does: SQLite keeps one WAL file for as
/// long as a connection is open (a checkpoint rewinds or truncates it, never replaces it), and
/// this value must not outlive the [`Spool`](crate::Spool) it came from.
#[derive(Debug)]
pub struct WalSync {
    wal: PathBuf,
    file: File,
    visible: Visible,
    /// Set when the writer's segment syncs are deferred too.
    segments: Option<Segments>,
    /// When the WAL was last synced: with segments, a sync that needs only theirs still syncs
    /// the WAL after [`WAL_AT_LEAST_EVERY`], to keep what open may replay short.
    wal_synced_at: std::time::Instant,
    /// [`WAL_AT_LEAST_EVERY`] (tests change it).
    wal_every: std::time::Duration,
    /// The first sync that failed. Linux may drop the dirty pages of a failed write-back and
    /// report the error once: a later successful `fdatasync` would prove nothing, so a failure
    /// stays a failure for the life of this value.
    failed: Option<String>,
}

/// The payload segments a [`WalSync`] makes durable with the WAL, and the thread
/// (`edge-spool-seg`) that syncs them while the WAL is synced.
#[derive(Debug)]
struct Segments {
    db: PathBuf,
    syncs: SegmentSyncs,
    /// Tells the thread to sync writes 1 to the number sent; `None` once it is gone (the
    /// syncs are then made after the WAL's, one after the other).
    helper: Option<mpsc::Sender<u64>>,
    join: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Segments {
    fn drop(&mut self) {
        self.helper = None;
        if let Some(join) = self.join.take()
            && join.join().is_err()
        {
            tracing::error!("the spool's segment sync thread panicked");
        }
    }
}

impl WalSync {
    /// Opens the WAL file `wal`.
    pub(crate) fn open(wal: PathBuf, visible: Visible) -> Result<Self, SpoolError> {
        match File::open(&wal) {
            Ok(file) => Ok(WalSync {
                wal,
                file,
                visible,
                segments: None,
                wal_synced_at: std::time::Instant::now(),
                wal_every: WAL_AT_LEAST_EVERY,
                failed: None,
            }),
            Err(source) => Err(SpoolError::Io { path: wal, source }),
        }
    }

    /// Makes every [`WalSync::sync`] also make the payload segments of the spool at `db`
    /// registered in `syncs` durable, on a thread started here, while it syncs the WAL.
    ///
    /// # Errors
    /// [`SpoolError::Io`] when the thread cannot be started.
    pub(crate) fn with_segments(mut self, db: PathBuf, syncs: SegmentSyncs) -> Result<Self, SpoolError> {
        let (tx, rx) = mpsc::channel::<u64>();
        let (thread_db, thread_syncs) = (db.clone(), syncs.clone());
        let join = std::thread::Builder::new()
            .name("edge-spool-seg".into())
            .spawn(move || {
                while let Ok(target) = rx.recv() {
                    // A failure is kept in `syncs`, where the WAL's thread finds it.
                    let _failed = thread_syncs.sync_through(&thread_db, target);
                }
            })
            .map_err(|source| SpoolError::Io { path: db.clone(), source })?;
        self.segments = Some(Segments { db, syncs, helper: Some(tx), join: Some(join) });
        Ok(self)
    }

    /// `fdatasync`s the WAL and, at the same time on a thread of its own, the payload segments
    /// written by the commits that returned before this call (when the writer defers their
    /// syncs). Every commit that returned before this call is durable once it returns `Ok`;
    /// then readers may list chunks up to `sealed_through` (the newest chunk id those commits
    /// sealed, from [`Spool::newest_chunk`](crate::Spool::newest_chunk) after them).
    ///
    /// # Errors
    /// [`SpoolError::Io`] when a segment or the WAL cannot be synced, and on every call after
    /// such a failure: the commits since the last good sync may be lost in a power cut.
    pub fn sync(&mut self, sealed_through: Option<ChunkId>) -> Result<(), SpoolError> {
        if let Some(first) = &self.failed {
            let detail = format!("an earlier fsync of the WAL failed ({first}); nothing since is durable");
            return Err(SpoolError::Io { path: self.wal.clone(), source: std::io::Error::other(detail) });
        }
        // One sync per commit: a commit that appends is durable once its segment bytes are,
        // since its commit record there brings back its rows if the WAL loses them
        // (`journal.rs`). The WAL is synced too when a commit without a record needs it (a seal
        // on its own) and now and then, to keep the replay short.
        let wal_due = self.segments.as_ref().is_none_or(|s| s.syncs.wal_due(WAL_AT_LEAST_PER_BYTES))
            || self.wal_synced_at.elapsed() >= self.wal_every;
        if let Some(s) = self.segments.as_ref().filter(|_| !wal_due) {
            if let Some(target) = s.syncs.unsynced_through()
                && let Err(e) = s.syncs.sync_through(&s.db, target)
            {
                self.failed = Some(e.to_string());
                return Err(e);
            }
            if let Some(c) = sealed_through {
                self.visible.raise(c.0);
            }
            return Ok(());
        }
        // The segments' sync beside the WAL's, so a commit waits for the slower of the two, not
        // for both in turn. The WAL's may then make rows durable before their bytes: open finds
        // such rows after a power cut (`unsynced.rs`), and nobody was answered for them.
        // Commits that wrote no payload bytes since the last sync (seals, acks) wake no thread.
        self.wal_synced_at = std::time::Instant::now();
        if let Some(s) = &self.segments {
            s.syncs.wal_syncing();
        }
        let target = self.segments.as_mut().and_then(|s| {
            let target = s.syncs.unsynced_through()?;
            if s.helper.as_ref().is_some_and(|h| h.send(target).is_err()) {
                s.helper = None;
            }
            Some(target)
        });
        if let Err(e) = self.file.sync_data() {
            self.failed = Some(e.to_string());
            return Err(SpoolError::Io { path: self.wal.clone(), source: e });
        }
        if let (Some(s), Some(target)) = (&self.segments, target)
            && let Err(e) = s.syncs.sync_through(&s.db, target)
        {
            self.failed = Some(e.to_string());
            return Err(e);
        }
        if let Some(c) = sealed_through {
            self.visible.raise(c.0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_sync_stays_failed_and_raises_no_watermark() {
        let dir = tempfile::tempdir().expect("temp dir");
        let wal = dir.path().join("spool.db-wal");
        std::fs::write(&wal, b"frames").expect("write");
        let visible = Visible::default();
        visible.set(3);
        let mut sync = WalSync::open(wal.clone(), visible.clone()).expect("open");
        sync.sync(Some(ChunkId(4))).expect("sync");
        assert_eq!(visible.get(), 4);

        // A file that cannot be synced (a pipe: EINVAL), as a failing disk would fail it.
        let (pipe, _writer) = std::io::pipe().expect("pipe");
        let good = std::mem::replace(&mut sync.file, File::from(std::os::fd::OwnedFd::from(pipe)));
        let err = sync.sync(Some(ChunkId(5))).expect_err("a pipe cannot be synced");
        assert!(err.to_string().contains("spool.db-wal"), "names the file: {err}");
        assert_eq!(visible.get(), 4);
        // The file could be synced again, but what the failed sync should have made durable
        // may be lost: no later sync succeeds.
        sync.file = good;
        assert!(sync.sync(Some(ChunkId(5))).is_err());
        assert_eq!(visible.get(), 4);
        // A new WalSync (a restart) syncs.
        WalSync::open(wal, visible.clone()).expect("open").sync(Some(ChunkId(5))).expect("sync");
        assert_eq!(visible.get(), 5);
    }

    /// A [`WalSync`] with segments in `dir` (the spool `spool.db`, segment 7 created), the
    /// watermark at 0.
    fn with_segment(dir: &tempfile::TempDir) -> (PathBuf, Arc<File>, SegmentSyncs, WalSync, Visible) {
        let db = dir.path().join("spool.db");
        let wal = dir.path().join("spool.db-wal");
        std::fs::write(&wal, b"frames").expect("write");
        let seg = Arc::new(File::create(crate::segment::path(&db, 7)).expect("segment"));
        let syncs = SegmentSyncs::default();
        let visible = Visible::default();
        visible.set(0);
        let sync = WalSync::open(wal, visible.clone())
            .expect("open")
            .with_segments(db.clone(), syncs.clone())
            .expect("thread");
        (db, seg, syncs, sync, visible)
    }

    /// Makes `sync`'s WAL a pipe, which cannot be synced: a round that syncs it fails. And
    /// the WAL is not due by time during the test.
    fn unsyncable_wal(sync: &mut WalSync) {
        let (pipe, _writer) = std::io::pipe().expect("pipe");
        sync.file = File::from(std::os::fd::OwnedFd::from(pipe));
        sync.wal_every = std::time::Duration::from_secs(3600);
    }

    #[test]
    fn a_sync_covers_the_registered_segment_writes_and_a_failed_one_names_the_segment() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (db, seg, syncs, mut sync, _) = with_segment(&dir);
        sync.sync(None).expect("nothing registered");
        assert_eq!(syncs.synced_write(), 0);
        syncs.register(7, &seg, 1, 1);
        syncs.register(7, &seg, 2, 1);
        sync.sync(None).expect("sync");
        assert_eq!(syncs.synced_write(), 2, "covers every write registered before it began");
        assert!(syncs.lock().files.is_empty(), "and takes the files");

        // A segment that cannot be synced (a pipe: EINVAL), as a failing disk would fail it.
        let (pipe, _writer) = std::io::pipe().expect("pipe");
        syncs.register(8, &Arc::new(File::from(std::os::fd::OwnedFd::from(pipe))), 3, 1);
        let err = sync.sync(None).expect_err("a pipe cannot be synced");
        assert!(err.to_string().contains(&crate::segment::path(&db, 8).display().to_string()), "{err}");
        assert_eq!(syncs.synced_write(), 2);
        syncs.register(7, &seg, 4, 1);
        assert!(sync.sync(None).is_err(), "stays failed");
        assert_eq!(syncs.synced_write(), 2);
    }

    #[test]
    fn a_sync_the_other_thread_runs_is_waited_for_not_run_twice() {
        let dir = tempfile::tempdir().expect("temp dir");
        let db = dir.path().join("spool.db");
        let syncs = SegmentSyncs::default();
        // The writer has taken write 1's files and is syncing them; a file left registered
        // that cannot be synced (a pipe) shows whether the waiting side syncs on its own.
        let (pipe, _writer) = std::io::pipe().expect("pipe");
        syncs.register(8, &Arc::new(File::from(std::os::fd::OwnedFd::from(pipe))), 1, 1);
        syncs.lock().running = true;
        let waiter = {
            let syncs = syncs.clone();
            let db = db.clone();
            std::thread::spawn(move || syncs.sync_through(&db, 1))
        };
        {
            let mut st = syncs.lock();
            st.running = false;
            st.synced = 1;
            syncs.0.ended.notify_all();
        }
        waiter.join().expect("no panic").expect("the writer's sync covered write 1");
        assert_eq!(syncs.synced_write(), 1);
        // Write 2 is the waiting side's to sync: it fails on the pipe, and names it.
        syncs.register(8, &Arc::new(File::open(dir.path()).expect("dir")), 2, 1);
        let err = syncs.sync_through(&db, 2).expect_err("the pipe cannot be synced");
        assert!(err.to_string().contains(&crate::segment::path(&db, 8).display().to_string()), "{err}");
        assert!(syncs.sync_through(&db, 2).is_err(), "stays failed");
    }

    #[test]
    fn a_round_syncs_the_wal_only_when_a_commit_without_a_record_or_the_records_since_need_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (_, seg, syncs, mut sync, visible) = with_segment(&dir);
        unsyncable_wal(&mut sync);
        syncs.register(7, &seg, 1, 10);
        sync.sync(Some(ChunkId(3))).expect("a round with commit records syncs the segments only");
        assert_eq!((syncs.synced_write(), visible.get()), (1, 3));
        syncs.register(7, &seg, 2, WAL_AT_LEAST_PER_BYTES);
        assert!(sync.sync(None).is_err(), "64 MiB of records since the WAL's last sync: it is synced too");

        let dir = tempfile::tempdir().expect("temp dir");
        let (_, _, syncs, mut sync, _) = with_segment(&dir);
        unsyncable_wal(&mut sync);
        sync.sync(None).expect("nothing to sync");
        syncs.need_wal();
        assert!(sync.sync(None).is_err(), "a seal on its own needs the WAL's sync");
    }

    #[test]
    fn a_missing_wal_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let err = WalSync::open(dir.path().join("spool.db-wal"), Visible::default()).expect_err("no file");
        assert!(err.to_string().contains("spool.db-wal"), "{err}");
    }
}
