//! The spool writer thread: the only owner of the writing SQLite connection.
//!
//! Intake requests and upload acks arrive on a channel. The thread takes everything queued at
//! that moment and commits it in one transaction (group commit), so a thousand small concurrent
//! producer requests cost one fsync, not a thousand. The same transaction records the acks and
//! seals the chunks whose linger expired (`Spool::commit`): one fsync per iteration. Acks with
//! nothing else to commit wait up to `ACK_LINGER` for company. The thread wakes the uploader
//! whenever a commit sealed at least one chunk.
//!
//! Under `durability = "full"` no fsync is on that thread: the spool runs
//! `synchronous=NORMAL` and writes each commit's payload bytes without syncing them, and a
//! second thread, `edge-spool-sync`, makes every commit queued when it starts durable
//! ([`edge_spool::WalSync`]) while the writer builds the next transaction: one `fdatasync` of
//! the payload segments, which hold each commit's record, and the WAL's too (beside it, on a
//! third thread, `edge-spool-seg`) when a seal on its own needs it and about once a second (on
//! a gateway's flash a sync takes milliseconds). Only after that sync round is a commit
//! *settled*: producers get their answers,
//! `seal_all` callers return, the chunks it sealed become visible to the spool's readers and
//! are handed to the uploader, and the uploader is woken. A failed sync answers every
//! outstanding request with an error and ends the process (status 74): nothing committed since
//! the last good sync can be promised any more, and a restart reopens the spool from what is on
//! disk.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use edge_spool::{
    AppendOutcome, AppendRequest, ChunkId, ChunkMeta, ChunkPayload, FullPolicy, SealWhat, Snapshot, Spool, SpoolError,
    SpoolId, SpoolReader, SpoolStats, WalSync,
};
use prometheus::Histogram;
use tokio::sync::{Notify, oneshot, watch};
use tracing::{error, warn};

use crate::handoff::{Handoff, Payload, Retained};

/// Largest amount of request bytes put in one transaction.
const MAX_GROUP_BYTES: u64 = 64 << 20;

/// How long acks alone wait for company before they get a commit (and an fsync) of their own.
/// An ack is not a promise to anyone: a crash before its commit only means the chunk is sent
/// again and the server answers Duplicate. Draining at full speed, a commit per ack was a
/// sixth of the agent's CPU.
const ACK_LINGER: Duration = Duration::from_millis(10);

/// Acks that get a commit at once, however young.
const ACK_GROUP: usize = 64;
/// How long acks alone wait after a commit failed before they are tried again (appends and
/// seals still take them along at once).
const ACK_RETRY: Duration = Duration::from_secs(1);

/// The exit status after a failed sync of the spool (`EX_IOERR`): under `Full` at once, under
/// `Normal` after an orderly stop ([`SpoolHandle::sync_failed`]).
pub const EXIT_SYNC_FAILED: i32 = 74;

/// Under `durability = "normal"`, a sync of the spool's WAL failed: the agent stops in order and
/// exits with [`EXIT_SYNC_FAILED`], so that the next start syncs the WAL and sends what this
/// process could not vouch for.
#[derive(Debug, thiserror::Error)]
#[error(
    "could not fsync the spool's WAL ({0}): stopped, for the next start to sync it again and send what was sealed since"
)]
pub struct SyncFailed(pub String);

/// Why an append did not go through.
#[derive(Debug, Clone, thiserror::Error)]
pub enum AppendFailure {
    /// The spool is at its configured size and the policy is `reject`, or nothing can be dropped.
    #[error("spool is full")]
    Full,
    /// The disk under the spool is full.
    #[error("disk under the spool is full")]
    DiskFull,
    /// The request names a stream the spool does not know, and it knows `spool.max_streams`
    /// already.
    #[error(
        "the spool knows as many streams as spool.max_streams allows and the request names a new one: use a known \
         stream, or raise spool.max_streams (a spool never forgets a stream)"
    )]
    TooManyStreams,
    /// The spool thread has stopped (shutdown).
    #[error("spool is closed")]
    Closed,
    /// Any other storage error.
    #[error("spool error: {0}")]
    Storage(String),
}

enum Cmd {
    /// A new spool id (`Spool::rekey`).
    Rekey {
        reply: oneshot::Sender<Result<SpoolId, String>>,
    },
    Append {
        req: AppendRequest,
        bytes: u64,
        reply: Reply,
    },
    /// Acks wait in [`SpoolHandle`]'s `pending_acks`: this only wakes the thread.
    AcksPending,
    Quarantine {
        id: ChunkId,
        reason: String,
    },
    SetLimits {
        max_bytes: u64,
        policy: FullPolicy,
        max_streams: u64,
    },
    SealAll {
        reply: oneshot::Sender<()>,
    },
}

/// Handle to the spool thread; cheap to clone.
#[derive(Debug, Clone)]
pub struct SpoolHandle {
    tx: mpsc::Sender<Cmd>,
    stats: Arc<Mutex<Snapshot>>,
    sealed: Arc<Notify>,
    /// Set by the uploader while it is connected with nothing in flight and nothing left to
    /// send (see [`SpoolHandle::set_uploader_idle`]).
    uploader_idle: Arc<AtomicBool>,
    /// Acks handed over and not committed yet. Only the ack that finds it empty, and the one
    /// that fills a group, wake the spool thread (a wake-up per ack cost the thread two context
    /// switches per chunk in a drain); the thread takes them all when it commits.
    pending_acks: Arc<Mutex<Vec<ChunkId>>>,
    id: Arc<Mutex<SpoolId>>,
    /// The spool database's path, for [`SpoolHandle::disk_bytes`].
    path: Arc<std::path::Path>,
    /// Sealed chunks handed to the uploader in memory (see `handoff.rs`).
    handoff: Arc<Handoff>,
    /// See [`crate::metrics::SPOOL_COMMIT_SECONDS`].
    commit_seconds: Histogram,
    busy: Arc<Busy>,
    /// The chunks the uploader has in flight, read by the spool's `DropOldest` eviction.
    in_flight: edge_spool::ChunksInFlight,
    /// Set once, by the spool thread, when a WAL sync failed under `Normal`.
    sync_failed: watch::Receiver<Option<String>>,
    /// How far the spool's drops are durable (see [`SpoolHandle::removals_durable`]).
    drops: edge_spool::DropMarks,
    /// How far the quarantines asked for are durable (see [`SpoolHandle::removals_durable`]).
    quarantines: Arc<QuarantineMarks>,
}

/// The quarantines asked of the spool thread ([`SpoolHandle::quarantine`]) and how many of
/// them are durably done, counted since the spool thread started. A quarantine is its own
/// transaction, and with deferred syncs durable only once the sync thread has synced the WAL
/// after it: a power cut before that brings the chunk back as one to send.
#[derive(Debug, Default)]
struct QuarantineMarks {
    /// Raised by the handle before the command goes to the spool thread.
    asked: AtomicU64,
    /// Raised once the commit of a quarantine is durable: the number of quarantines done (or
    /// found done already, or of a chunk the spool no longer has) by then. One that failed is
    /// never counted, which withholds floors until the next start.
    durable: AtomicU64,
}

impl QuarantineMarks {
    fn all_durable(&self) -> bool {
        // `asked` first: it is raised before the spool thread can see the command, and
        // `durable` only grows.
        let asked = self.asked.load(Ordering::SeqCst);
        asked <= self.durable.load(Ordering::SeqCst)
    }
}

/// Joins the spool thread when the last handle is gone.
#[derive(Debug)]
pub struct SpoolThread {
    join: Option<JoinHandle<()>>,
}

impl SpoolThread {
    /// Waits for the thread to commit what it has and exit. All handles must be dropped first.
    pub fn join(mut self) {
        if let Some(j) = self.join.take()
            && j.join().is_err()
        {
            error!("spool thread panicked");
        }
    }
}

impl SpoolHandle {
    /// Starts the thread owning `spool` (and, under [`edge_spool::Durability::Full`], the
    /// thread that syncs its WAL: see the module doc).
    ///
    /// # Errors
    /// When a thread cannot be started, or the spool cannot defer its WAL sync.
    pub fn spawn(mut spool: Spool) -> std::io::Result<(SpoolHandle, SpoolThread)> {
        let wal_sync = spool.defer_wal_sync().map_err(std::io::Error::other)?;
        let (tx, rx) = mpsc::channel();
        let stats = Arc::new(Mutex::new(spool.snapshot()));
        let sealed = Arc::new(Notify::new());
        let id = spool.id();
        let uploader_idle = Arc::new(AtomicBool::new(false));
        let pending_acks = Arc::new(Mutex::new(Vec::new()));
        let path: Arc<std::path::Path> = Arc::from(spool.options().path.as_path());
        let handoff = Arc::new(Handoff::default());
        let commit_seconds = crate::metrics::spool_commit_histogram();
        let busy = Arc::new(Busy::new());
        let (sync_failed_tx, sync_failed) = watch::channel(None);
        let drops = spool.drop_marks();
        let quarantines = Arc::new(QuarantineMarks::default());
        let handle = SpoolHandle {
            drops: drops.clone(),
            quarantines: quarantines.clone(),
            in_flight: spool.chunks_in_flight(),
            tx,
            stats: stats.clone(),
            sealed: sealed.clone(),
            uploader_idle: uploader_idle.clone(),
            pending_acks: pending_acks.clone(),
            id: Arc::new(Mutex::new(id)),
            path,
            handoff: handoff.clone(),
            commit_seconds: commit_seconds.clone(),
            busy: busy.clone(),
            sync_failed,
        };
        let settler =
            Settler { sealed, handoff, settling: Arc::new(AtomicU64::new(0)), commit_seconds, drops, quarantines };
        let syncer = match wal_sync {
            Some(wal) => Some(Syncer::spawn(wal, settler.clone(), busy.clone())?),
            None => None,
        };
        let shared = Shared { stats, uploader_idle, pending_acks, settler, busy, sync_failed: sync_failed_tx };
        let join = std::thread::Builder::new()
            .name("edge-spool".into())
            .spawn(move || writer_loop(spool, rx, shared, syncer))?;
        Ok((handle, SpoolThread { join: Some(join) }))
    }

    /// Whether every chunk the spool dropped (`drop_oldest`) so far, and every chunk the
    /// uploader asked to quarantine ([`SpoolHandle::quarantine`]), is durably out of
    /// circulation. A drop or a quarantine is visible at once but durable only with the next
    /// sync of the WAL, which the sync thread marks: a power cut before it brings the chunk
    /// back, to be sent again. Only when this holds may the uploader tell the server that a
    /// stream's chunks below its floor will never come: a chunk brought back would be answered
    /// duplicate and deleted, records and all (for a quarantined chunk, the copy kept for
    /// `spool export-quarantined`). Under `durability = "normal"` a commit is marked when it
    /// returns, as it is answered: a power cut may lose any of them there.
    pub fn removals_durable(&self) -> bool {
        self.quarantines.all_durable() && self.drops.all_durable()
    }

    /// The spool's identity, sent to the server in Hello.
    pub fn id(&self) -> SpoolId {
        *crate::lock(&self.id)
    }

    /// Gives the spool a new id (`edge_spool::Spool::rekey`), durable before it returns, for
    /// the uploader's next connection: after another agent turned out to use this one.
    ///
    /// # Errors
    /// The spool's, when the new id cannot be committed (the id is then unchanged), or the
    /// spool thread is gone.
    pub async fn rekey(&self) -> anyhow::Result<SpoolId> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Cmd::Rekey { reply }).map_err(|_| anyhow::anyhow!("the spool thread has stopped"))?;
        let new = rx.await.map_err(|_| anyhow::anyhow!("the spool thread has stopped"))?.map_err(anyhow::Error::msg)?;
        *crate::lock(&self.id) = new;
        Ok(new)
    }

    /// Appends one producer request; resolves after the group commit that included it.
    pub async fn append(&self, req: AppendRequest) -> Result<(), AppendFailure> {
        self.submit(req, ()).await
    }

    /// Hands one producer request to the spool thread now, in order with every other request
    /// submitted before it; the future resolves after the group commit that included it.
    ///
    /// `charge` is what the intake holds for the request's buffers (its share of a memory
    /// budget): the spool thread keeps it with the request and drops it when it answers, or
    /// drops, the request. Not when the future is dropped: a producer that goes away leaves its
    /// request in the spool thread's queue, buffers and all, and their memory is counted until
    /// they are gone.
    pub fn submit<C: Send + 'static>(
        &self,
        req: AppendRequest,
        charge: C,
    ) -> impl Future<Output = Result<(), AppendFailure>> + Send + 'static + use<C> {
        let bytes = req.batches.iter().map(|b| b.data.len() as u64).sum();
        let (tx, rx) = oneshot::channel();
        let reply = Reply { tx, charge: Box::new(charge) };
        let sent = self.tx.send(Cmd::Append { req, bytes, reply });
        async move {
            sent.map_err(|_| AppendFailure::Closed)?;
            rx.await.map_err(|_| AppendFailure::Closed)?
        }
    }

    /// Deletes acknowledged chunks (batched with whatever else is queued).
    pub fn ack(&self, ids: Vec<ChunkId>) {
        let wake = {
            let mut pending = crate::lock(&self.pending_acks);
            let before = pending.len();
            pending.extend(ids);
            before == 0 || (before < ACK_GROUP && pending.len() >= ACK_GROUP)
        };
        if wake && self.tx.send(Cmd::AcksPending).is_err() {
            warn!("spool closed before an ack could be recorded; the chunk will be offered again");
        }
    }

    /// Sets a chunk aside for good (the server refuses its bytes, or they are corrupt).
    /// [`SpoolHandle::removals_durable`] is false from now until the quarantine is durable.
    pub fn quarantine(&self, id: ChunkId, reason: String) {
        // Before the command: whoever sees the chunk out of its window sees this too.
        self.quarantines.asked.fetch_add(1, Ordering::SeqCst);
        let _closed = self.tx.send(Cmd::Quarantine { id, reason });
    }

    /// Tells the spool which chunks are in flight: under `drop_oldest` it evicts the oldest
    /// chunk not among them first (see [`edge_spool::ChunksInFlight`]).
    pub fn set_in_flight(&self, ids: impl IntoIterator<Item = ChunkId>) {
        self.in_flight.set(ids);
    }

    /// Applies new capacity limits at run time.
    pub fn set_limits(&self, max_bytes: u64, policy: FullPolicy, max_streams: u64) {
        let _closed = self.tx.send(Cmd::SetLimits { max_bytes, policy, max_streams });
    }

    /// Resolves once a sync of the WAL failed under `durability = "normal"`, with its error.
    /// Nothing sealed since is sent by this process (Linux may drop the pages of a failed
    /// write-back and say so once; no later sync vouches for them), so the agent stops and
    /// lets the next start sync the WAL again: [`SyncFailed`]. Under `Full` a failed sync
    /// ends the process on the sync thread instead. Never resolves while the syncs work.
    pub async fn sync_failed(&self) -> String {
        let mut rx = self.sync_failed.clone();
        match rx.wait_for(Option::is_some).await {
            Ok(failed) => failed.clone().unwrap_or_default(),
            // The spool thread is gone without a failure: nothing will fail any more.
            Err(_) => std::future::pending().await,
        }
    }

    /// Seals every open batch now (used by the demo's final drain and by shutdown).
    pub async fn seal_all(&self) {
        let (reply, rx) = oneshot::channel();
        if self.tx.send(Cmd::SealAll { reply }).is_ok() {
            let _closed = rx.await;
        }
    }

    /// The statistics as of the latest group commit (its snapshot is refreshed after every
    /// one; the statistics are made here, a pass over the streams, not on the spool thread).
    pub fn stats(&self) -> SpoolStats {
        let snapshot = crate::lock(&self.stats).clone();
        snapshot.stats()
    }

    /// A read-only view of the statistics for observers (the metrics collector). Unlike a
    /// handle it does not keep the spool thread running, so shutdown is not held up by it.
    pub fn stats_view(&self) -> SpoolStatsView {
        SpoolStatsView {
            stats: self.stats.clone(),
            path: self.path.clone(),
            commit_seconds: self.commit_seconds.clone(),
            busy: self.busy.clone(),
        }
    }

    /// Disk space the spool's files take now (see [`edge_spool::disk_usage`]); `None` when the
    /// directory cannot be read.
    pub fn disk_bytes(&self) -> Option<u64> {
        disk_bytes(&self.path)
    }

    /// The spool thread that has been at its current work the longest, and for how long;
    /// `None` while both wait for work (see [`Busy`]).
    pub fn busy(&self) -> Option<(SpoolThreadKind, Duration)> {
        self.busy.longest()
    }

    /// The queue of sealed chunks handed to the uploader in memory.
    pub fn handoff(&self) -> &Handoff {
        &self.handoff
    }

    /// Resolves when new chunks were sealed since the last call.
    pub async fn sealed(&self) {
        self.sealed.notified().await;
    }

    /// Wakes waiters of [`SpoolHandle::sealed`] (after a reconnect, to re-scan).
    /// Tells the spool thread whether the uploader is idle: connected, nothing in flight,
    /// nothing sealed left to send. While it is, every commit seals the open batches at once
    /// instead of waiting for the chunk target or `linger`, so a record reaches the server
    /// about one commit after it was accepted (Nagle's rule: wait only while something is in
    /// flight). Under load the uploader is never idle, and chunks fill up as before.
    pub fn set_uploader_idle(&self, idle: bool) {
        self.uploader_idle.store(idle, Ordering::Relaxed);
    }

    pub fn wake(&self) {
        self.sealed.notify_one();
    }
}

/// See [`SpoolHandle::stats_view`].
#[derive(Debug, Clone)]
pub struct SpoolStatsView {
    stats: Arc<Mutex<Snapshot>>,
    path: Arc<std::path::Path>,
    commit_seconds: Histogram,
    busy: Arc<Busy>,
}

impl SpoolStatsView {
    /// As [`SpoolHandle::busy`].
    pub fn busy(&self) -> Option<(SpoolThreadKind, Duration)> {
        self.busy.longest()
    }

    /// The statistics as of the latest group commit, as [`SpoolHandle::stats`].
    pub fn get(&self) -> SpoolStats {
        let snapshot = crate::lock(&self.stats).clone();
        snapshot.stats()
    }

    /// As [`SpoolHandle::disk_bytes`].
    pub fn disk_bytes(&self) -> Option<u64> {
        disk_bytes(&self.path)
    }

    /// The spool thread's commit times ([`crate::metrics::SPOOL_COMMIT_SECONDS`]).
    pub fn commit_seconds(&self) -> &Histogram {
        &self.commit_seconds
    }
}

/// A directory listing and a `stat` per spool file: cheap enough for a scrape or a status
/// request, too dear for every commit, so it is not part of [`SpoolStats`].
fn disk_bytes(path: &std::path::Path) -> Option<u64> {
    match edge_spool::disk_usage(path) {
        Ok(n) => Some(n),
        Err(e) => {
            warn!(error = %e, "could not measure the spool's disk use");
            None
        }
    }
}

fn now_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0),
    )
    .unwrap_or(u64::MAX)
}

/// Whether open batches are sealed by size only, not by `linger`: while a chunk sealed now
/// would not be sent soon (the uploader is disconnected, reads a backlog from the spool, or has
/// chunks queued that it has not taken), sealing a slow stream every `linger` would only cut its
/// records into many small chunks that wait all the same, each compressed on its own and sent
/// as a stream of its own: hours of an outage would become hundreds of thousands of chunks of a
/// few hundred bytes. The open batches are as durable as sealed chunks, and are sealed by
/// `linger` again as soon as the uploader takes seals. Not while they hold an eighth of
/// `spool.max_bytes` or more: only sealed chunks can be dropped to make room.
///
/// Chunks sealed by commits that are not settled yet count as chunks the uploader has not
/// taken.
fn held_back(spool: &Spool, handoff: &Handoff, settling: &AtomicU64) -> bool {
    let waiting = settling.load(Ordering::Acquire) > 0 || !handoff.wants_seals();
    waiting && spool.total_open_bytes() < spool.options().max_bytes / 8
}

/// What the spool thread shares with the handles.
struct Shared {
    stats: Arc<Mutex<Snapshot>>,
    uploader_idle: Arc<AtomicBool>,
    pending_acks: Arc<Mutex<Vec<ChunkId>>>,
    settler: Settler,
    busy: Arc<Busy>,
    sync_failed: watch::Sender<Option<String>>,
}

/// How long each spool thread has been at what it is doing now: the writer at one iteration (a
/// commit, a quarantine), the sync thread at one sync round. Both come back within
/// milliseconds on a healthy disk; one that does not (a flash card that stopped answering, an
/// fsync that never returns) stops every producer and every ack while the runtime, and the
/// watchdog ping it sends, carry on. The agent withholds that ping and `status` says degraded
/// (see [`SpoolHandle::busy`]).
#[derive(Debug)]
pub struct Busy {
    base: Instant,
    /// Milliseconds since `base`, plus one, when the thread started; 0 while it waits for work.
    writer: AtomicU64,
    sync: AtomicU64,
}

/// Which spool thread [`SpoolHandle::busy`] is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpoolThreadKind {
    /// `edge-spool`: commits (appends, acks, seals), quarantines.
    Writer,
    /// `edge-spool-sync`: the fsyncs of the WAL and the payload segments.
    Sync,
}

impl SpoolThreadKind {
    /// What the thread is doing while busy, for messages.
    pub fn doing(self) -> &'static str {
        match self {
            SpoolThreadKind::Writer => "one commit (thread edge-spool)",
            SpoolThreadKind::Sync => "one fsync of the WAL and payload segments (thread edge-spool-sync)",
        }
    }
}

impl Busy {
    fn new() -> Busy {
        Busy { base: Instant::now(), writer: AtomicU64::new(0), sync: AtomicU64::new(0) }
    }

    fn slot(&self, kind: SpoolThreadKind) -> &AtomicU64 {
        match kind {
            SpoolThreadKind::Writer => &self.writer,
            SpoolThreadKind::Sync => &self.sync,
        }
    }

    /// Milliseconds since `base`, plus one (0 means idle).
    fn now(&self) -> u64 {
        u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1
    }

    fn start(&self, kind: SpoolThreadKind) {
        self.slot(kind).store(self.now(), Ordering::Relaxed);
    }

    fn idle(&self, kind: SpoolThreadKind) {
        self.slot(kind).store(0, Ordering::Relaxed);
    }

    /// The thread busy the longest, and for how long; `None` while both wait for work.
    fn longest(&self) -> Option<(SpoolThreadKind, Duration)> {
        let now = self.now();
        [SpoolThreadKind::Writer, SpoolThreadKind::Sync]
            .into_iter()
            .filter_map(|k| match self.slot(k).load(Ordering::Relaxed) {
                0 => None,
                at => Some((k, Duration::from_millis(now.saturating_sub(at)))),
            })
            .max_by_key(|(_, d)| *d)
    }
}

/// The answer to one append, and what its producer holds until then ([`SpoolHandle::submit`]).
struct Reply {
    tx: oneshot::Sender<Result<(), AppendFailure>>,
    charge: Box<dyn Send>,
}

impl Reply {
    /// Answers: the charge goes first, so the producer that reads the answer finds its budget
    /// back.
    fn send(self, answer: Result<(), AppendFailure>) {
        let Reply { tx, charge } = self;
        drop(charge);
        let _gone = tx.send(answer);
    }
}

/// What one commit promised, kept until it is durable.
struct Settle {
    replies: Vec<Reply>,
    answer: Result<Vec<AppendOutcome>, AppendFailure>,
    seal_waiters: Vec<oneshot::Sender<()>>,
    /// The chunks sealed (each one, with or without its bytes), for the handoff.
    handed: Vec<(ChunkMeta, Option<Payload>)>,
    /// The newest chunk id in the file after the commit.
    sealed_through: Option<ChunkId>,
    /// When the spool thread began the commit.
    started: Instant,
    /// The spool's dropped-chunk total after the commit, if the commit dropped chunks: durable
    /// once the commit is (see [`SpoolHandle::removals_durable`]).
    drops_through: Option<u64>,
    /// The quarantines done by the spool thread through this commit, if any since the last
    /// settle: durable once the commit is (a quarantine is a transaction of its own, before it).
    quarantines_through: Option<u64>,
}

impl Settle {
    /// Whether anyone waits for this commit to be settled: a producer, a `seal_all` caller, or
    /// the uploader for the chunks it sealed. A commit of acks alone, or of nothing (a tick
    /// with nothing due), is made durable by the next sync, or never needs to be: an ack lost
    /// in a power cut only costs a duplicate.
    fn awaited(&self) -> bool {
        !self.replies.is_empty()
            || !self.seal_waiters.is_empty()
            || !self.handed.is_empty()
            || self.drops_through.is_some()
            || self.quarantines_through.is_some()
    }
}

/// Settles commits: answers, hands over and wakes, once they are durable.
#[derive(Clone)]
struct Settler {
    sealed: Arc<Notify>,
    handoff: Arc<Handoff>,
    /// Chunks sealed by commits not settled yet (see [`held_back`]).
    settling: Arc<AtomicU64>,
    commit_seconds: Histogram,
    drops: edge_spool::DropMarks,
    quarantines: Arc<QuarantineMarks>,
}

impl Settler {
    /// `durable` is `Err` when the commit may be lost: its producers get the error, and
    /// nothing it sealed is handed over.
    fn settle(&self, s: Settle, durable: Result<(), &AppendFailure>) {
        let Settle {
            replies,
            answer,
            seal_waiters,
            handed,
            sealed_through: _,
            started,
            drops_through,
            quarantines_through,
        } = s;
        if let (Ok(()), Some(total)) = (durable, drops_through) {
            self.drops.durable(total);
        }
        if let (Ok(()), Some(done)) = (durable, quarantines_through) {
            self.quarantines.durable.fetch_max(done, Ordering::SeqCst);
        }
        self.commit_seconds.observe(started.elapsed().as_secs_f64());
        let sealed_count = handed.len() as u64;
        let sealed_any = !handed.is_empty();
        let answer = match durable {
            Ok(()) => {
                // Before the answers and the wake-up: a `seal_all` caller or a woken uploader
                // finds the chunks queued.
                if !handed.is_empty() {
                    self.handoff.sealed(handed);
                }
                answer
            }
            Err(failure) => {
                self.handoff.stop();
                Err(failure.clone())
            }
        };
        self.settling.fetch_sub(sealed_count, Ordering::AcqRel);
        match &answer {
            Ok(outcomes) => {
                for (reply, outcome) in replies.into_iter().zip(outcomes) {
                    let r = match outcome {
                        AppendOutcome::Accepted => Ok(()),
                        AppendOutcome::Full => Err(AppendFailure::Full),
                        AppendOutcome::TooManyStreams => Err(AppendFailure::TooManyStreams),
                    };
                    reply.send(r);
                }
            }
            Err(failure) => {
                if !replies.is_empty() {
                    warn!(error = %failure, requests = replies.len(), "group commit failed; producers get an error and nothing is stored");
                }
                for reply in replies {
                    reply.send(Err(failure.clone()));
                }
            }
        }
        for w in seal_waiters {
            let _gone = w.send(());
        }
        // Wake the uploader for every chunk sealed, not for a net growth of the sealed count:
        // acks in the same commit may delete as many chunks as were sealed.
        if sealed_any && durable.is_ok() {
            self.sealed.notify_one();
        }
    }
}

/// The `edge-spool-sync` thread: makes the commits queued durable, then settles them.
struct Syncer {
    tx: mpsc::Sender<Settle>,
    join: JoinHandle<()>,
}

impl Syncer {
    fn spawn(mut wal: WalSync, settler: Settler, busy: Arc<Busy>) -> std::io::Result<Syncer> {
        let (tx, rx) = mpsc::channel::<Settle>();
        let join = std::thread::Builder::new().name("edge-spool-sync".into()).spawn(move || {
            while let Ok(first) = rx.recv() {
                // One sync for every commit queued by now: each returned before the sync starts.
                let mut group = vec![first];
                group.extend(rx.try_iter());
                let through = group.iter().filter_map(|s| s.sealed_through).max();
                busy.start(SpoolThreadKind::Sync);
                let synced = wal.sync(through);
                busy.idle(SpoolThreadKind::Sync);
                let synced = synced.map_err(|e| {
                    let failure = AppendFailure::Storage(edge_telemetry::logging::error_chain(&e));
                    error!(error = %failure, "could not fsync the spool's WAL or payload segments: the last commits may not survive a power cut; exiting");
                    failure
                });
                let failed = synced.is_err();
                for s in group {
                    settler.settle(s, synced.as_ref().map(|_| ()));
                }
                if failed {
                    // Whatever is queued still gets its error; then no further promise is made.
                    for s in rx.try_iter() {
                        settler.settle(s, synced.as_ref().map(|_| ()));
                    }
                    std::process::exit(EXIT_SYNC_FAILED);
                }
            }
        })?;
        Ok(Syncer { tx, join })
    }
}

fn writer_loop(mut spool: Spool, rx: mpsc::Receiver<Cmd>, shared: Shared, syncer: Option<Syncer>) {
    let Shared { stats, uploader_idle, pending_acks, settler, busy, sync_failed } = shared;
    let Settler { sealed, handoff, settling, .. } = settler.clone();
    let mut retained = Retained::default();
    let mut dropped_chunks = spool.snapshot().dropped_chunks();
    // Quarantines done (see `QuarantineMarks::durable`), and how many of them a settle carries.
    let mut quarantined = 0u64;
    let mut quarantines_settled = 0u64;
    let tick = (spool.options().linger / 2).clamp(Duration::from_millis(1), Duration::from_millis(50));
    let mut appends: Vec<(AppendRequest, Reply)> = Vec::new();
    // When the thread first saw the acks now in `pending_acks`.
    let mut acks_since: Option<Instant> = None;
    // After a commit failed: acks alone wait until then before they are tried again.
    let mut acks_retry_at: Option<Instant> = None;
    let mut seal_waiters: Vec<oneshot::Sender<()>> = Vec::new();
    let mut open = true;
    if spool.stats().sealed_chunks > 0 {
        sealed.notify_one();
    }
    while open {
        let mut group_bytes = 0u64;
        let mut take = |cmd: Cmd, spool: &mut Spool, group_bytes: &mut u64| match cmd {
            Cmd::Append { req, bytes, reply } => {
                *group_bytes += bytes;
                appends.push((req, reply));
            }
            Cmd::AcksPending => {}
            Cmd::Quarantine { id, reason } => match spool.quarantine(id, &reason) {
                // Gone: dropped, whose own mark covers it.
                Ok(()) | Err(edge_spool::SpoolError::ChunkGone(_)) => quarantined += 1,
                Err(e) => {
                    error!(chunk = id.0, error = %e, "could not quarantine chunk; it stays in the spool, sent again after a reconnection, and no stream's floor goes to the server until the agent restarts");
                }
            },
            Cmd::SetLimits { max_bytes, policy, max_streams } => spool.set_limits(max_bytes, policy, max_streams),
            Cmd::SealAll { reply } => seal_waiters.push(reply),
            Cmd::Rekey { reply } => {
                let _gone = reply.send(spool.rekey().map_err(|e| e.to_string()));
            }
        };
        let backing_off = acks_retry_at.map(|t| t.saturating_duration_since(Instant::now())).filter(|d| !d.is_zero());
        let wait = match (backing_off, acks_since) {
            (Some(left), _) => tick.min(left),
            (None, Some(t)) => tick.min(ACK_LINGER.saturating_sub(t.elapsed())),
            (None, None) => tick,
        };
        busy.idle(SpoolThreadKind::Writer);
        let got = rx.recv_timeout(wait);
        busy.start(SpoolThreadKind::Writer);
        match got {
            Ok(cmd) => take(cmd, &mut spool, &mut group_bytes),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => open = false,
        }
        while group_bytes < MAX_GROUP_BYTES {
            match rx.try_recv() {
                Ok(cmd) => take(cmd, &mut spool, &mut group_bytes),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        let acks = crate::lock(&pending_acks).len();
        if acks == 0 {
            acks_since = None;
        } else {
            let since = *acks_since.get_or_insert_with(Instant::now);
            // Acks alone, few and young: wait for more, or for appends to ride with. (Seals
            // that fall due meanwhile wait at most `ACK_LINGER` too.)
            let alone = appends.is_empty() && seal_waiters.is_empty() && quarantined == quarantines_settled;
            let young = acks < ACK_GROUP && since.elapsed() < ACK_LINGER;
            let backing_off = acks_retry_at.is_some_and(|t| Instant::now() < t);
            if open && alone && (young || backing_off) {
                continue;
            }
            acks_since = None;
        }
        let started = Instant::now();
        let now = now_ms();
        let (reqs, replies): (Vec<_>, Vec<_>) = std::mem::take(&mut appends).into_iter().unzip();
        let ids = std::mem::take(&mut *crate::lock(&pending_acks));
        let early = uploader_idle.load(Ordering::Relaxed);
        let seal = if !seal_waiters.is_empty() || !open || early {
            SealWhat::All
        } else if held_back(&spool, &handoff, &settling) {
            SealWhat::Nothing
        } else {
            SealWhat::Due
        };
        // Batches are kept only for an uploader that follows the seals: one that is behind or
        // disconnected reads the spool anyway (and a stream is tracked again from its next
        // seal on, once it follows).
        if handoff.following() {
            retained.track(&reqs, &spool);
        } else {
            retained.clear();
        }
        // One transaction, one fsync: acks, appends, seals.
        let (answer, sealed_now) = match spool.commit(&reqs, &ids, seal, now) {
            Ok(report) => {
                acks_retry_at = None;
                (report.appends.map_err(append_failure), report.sealed)
            }
            Err(e) => {
                // Nothing was committed. The acks go back in line for the next commit: the
                // uploader has moved past their chunks and would offer them again only after a
                // reconnection, and they hold the space a full disk needs back. Open batches
                // are sealed next time.
                warn!(error = %e, chunks = ids.len(), "writer commit failed: no acks, seals or appends recorded; the acks go into the next commit");
                if !ids.is_empty() {
                    let mut pending = crate::lock(&pending_acks);
                    let later = std::mem::replace(&mut *pending, ids);
                    pending.extend(later);
                    acks_retry_at = Some(Instant::now() + ACK_RETRY);
                }
                (Err(append_failure(e)), Vec::new())
            }
        };
        // Publish the new state before answering, so a producer that got its 200 never sees
        // statistics from before its own commit.
        let dropped_before = std::mem::replace(&mut dropped_chunks, publish(&spool, &stats));
        // The committed batches are kept for the chunks they will be sealed into, and the
        // chunks sealed now are handed to the uploader if it follows (once settled).
        let accepted = answer.as_deref().unwrap_or_default();
        let mut handed = retained.committed(reqs, accepted, &sealed_now, &spool);
        if !handed.is_empty() && spool.seals_wait_for_sync() {
            // `durability = "normal"` after a failed sync of the WAL: these seals may not be
            // durable, and are not to be sent by this process. The uploader reads the spool,
            // which does not list them; the next start syncs the WAL and lists them.
            handed.clear();
            handoff.stop();
        }
        if let Some(e) = spool.wal_sync_failed()
            && sync_failed.borrow().is_none()
        {
            sync_failed.send_replace(Some(e.to_owned()));
        }
        settling.fetch_add(handed.len() as u64, Ordering::AcqRel);
        if dropped_chunks != dropped_before {
            // The cap dropped chunks the handoff may hold: the uploader reads the spool again.
            // At once, not once the commit settles: a dropped chunk is not to be sent.
            handoff.stop();
        }
        if early && !sealed_now.is_empty() {
            // The uploader has work now (once the commit settles); it says when it is idle
            // again. Cleared here, not at the settling, lest the commits meanwhile seal early too.
            uploader_idle.store(false, Ordering::Relaxed);
        }
        let settle = Settle {
            replies,
            answer,
            seal_waiters: std::mem::take(&mut seal_waiters),
            handed,
            sealed_through: spool.newest_chunk(),
            started,
            drops_through: (dropped_chunks != dropped_before).then_some(dropped_chunks),
            quarantines_through: (quarantined != quarantines_settled).then_some(quarantined),
        };
        quarantines_settled = quarantined;
        if !settle.awaited() {
            continue;
        }
        match &syncer {
            Some(syncer) => {
                if let Err(mpsc::SendError(settle)) = syncer.tx.send(settle) {
                    // The sync thread is gone only if it exited the process; settle anyway.
                    settler.settle(settle, Err(&AppendFailure::Storage("the spool's sync thread has stopped".into())));
                }
            }
            // Every commit was durable when it returned (`FULL` without deferred syncs), or is
            // answered as it returns (`durability = "normal"`).
            None => settler.settle(settle, Ok(())),
        }
    }
    busy.idle(SpoolThreadKind::Writer);
    if let Some(Syncer { tx, join }) = syncer {
        // The sync thread settles what is queued, then ends; the spool closes after it.
        drop(tx);
        if join.join().is_err() {
            error!("spool sync thread panicked");
        }
    }
    // Everything is synced now: the next open need not check the last commits' bytes.
    if let Err(e) = spool.mark_synced() {
        warn!(error = %e, "could not record that the spool's segments are synced; the next start checks the last commits' bytes");
    }
}

fn append_failure(e: SpoolError) -> AppendFailure {
    match e {
        SpoolError::DiskFull => AppendFailure::DiskFull,
        other => AppendFailure::Storage(other.to_string()),
    }
}

/// The uploader's read side: a second connection used from blocking tasks.
#[derive(Debug, Clone)]
pub struct ReaderHandle {
    reader: Arc<Mutex<SpoolReader>>,
}

impl ReaderHandle {
    /// Wraps a reader connection.
    pub fn new(reader: SpoolReader) -> Self {
        Self { reader: Arc::new(Mutex::new(reader)) }
    }

    /// Sealed chunks after `after`, with their payloads and the payloads' CRC-32C (or the read
    /// error for each).
    pub async fn next(
        &self,
        after: Option<ChunkId>,
        limit: usize,
    ) -> Result<Vec<(edge_spool::ChunkMeta, Result<ChunkPayload, SpoolError>)>, SpoolError> {
        let reader = self.reader.clone();
        tokio::task::spawn_blocking(move || {
            let mut r = crate::lock(&reader);
            let metas = r.sealed_after(after, limit)?;
            Ok(metas
                .into_iter()
                .map(|m| {
                    let data = r.read_payload(&m);
                    (m, data)
                })
                .collect())
        })
        .await
        .unwrap_or_else(|join| {
            Err(SpoolError::Io { path: "reader task".into(), source: std::io::Error::other(join.to_string()) })
        })
    }
}

/// Replaces the shared snapshot of the counters with the spool's current one (O(1), however
/// many streams); returns the count of chunks the cap has dropped so far.
fn publish(spool: &Spool, stats: &Mutex<Snapshot>) -> u64 {
    let now = spool.snapshot();
    let dropped = now.dropped_chunks();
    *crate::lock(stats) = now;
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;
    use edge_spool::{Batch, SpoolOptions};

    fn spawn(dir: &std::path::Path) -> (SpoolHandle, SpoolThread) {
        let mut opts = SpoolOptions::new(dir.join("spool.db"));
        // Neither the size nor the linger rule can seal anything during the test.
        opts.linger = Duration::from_secs(3600);
        opts.chunk_target_bytes = 64 << 20;
        let (spool, _) = Spool::open(opts).expect("open spool");
        SpoolHandle::spawn(spool).expect("spawn spool thread")
    }

    /// A spool thread whose linger never seals anything during a test, and a reader.
    fn spawn_with_reader(dir: &std::path::Path) -> (SpoolHandle, SpoolThread, edge_spool::SpoolReader) {
        let mut opts = SpoolOptions::new(dir.join("spool.db"));
        opts.linger = Duration::from_secs(3600);
        let (spool, _) = Spool::open(opts).expect("open spool");
        let reader = spool.reader().expect("reader");
        let (handle, thread) = SpoolHandle::spawn(spool).expect("spawn spool thread");
        (handle, thread, reader)
    }

    /// Waits (10 s at most) until the spool's statistics satisfy `done`.
    async fn until(handle: &SpoolHandle, what: &str, done: impl Fn(&SpoolStats) -> bool) {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while !done(&handle.stats()) {
            assert!(std::time::Instant::now() < deadline, "{what}: never happened; {:?}", handle.stats());
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Waits (10 s at most) until every sealed chunk is acked and committed.
    async fn until_no_sealed_chunks(handle: &SpoolHandle) {
        until(handle, "acks committed", |s| s.sealed_chunks == 0).await;
    }

    fn request() -> AppendRequest {
        AppendRequest { batches: vec![Batch { stream: "s".into(), data: vec![0, 0, 0, 1, 7], records: 1 }] }
    }

    /// A commit that fails records nothing, acks included; they must go into the next commit
    /// (the uploader, already past their chunks, would offer them again only after a
    /// reconnection).
    #[tokio::test]
    async fn acks_a_failed_commit_could_not_record_go_into_the_next_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, thread, mut reader) = spawn_with_reader(dir.path());
        handle.append(request()).await.expect("append");
        handle.seal_all().await;
        let chunk = reader.sealed_after(None, 10).expect("list")[0].id;

        // Another connection holds SQLite's write lock: every commit of the spool thread waits
        // out its busy timeout and fails, recording nothing.
        let blocker = rusqlite::Connection::open(dir.path().join("spool.db")).expect("second connection");
        blocker.execute_batch("BEGIN IMMEDIATE").expect("take the write lock");
        handle.ack(vec![chunk]);
        assert!(handle.append(request()).await.is_err(), "a commit under another's write lock fails");
        assert_eq!(handle.stats().sealed_chunks, 1, "the ack was not recorded");

        blocker.execute_batch("ROLLBACK").expect("release the write lock");
        handle.append(request()).await.expect("append once the lock is free");
        assert_eq!(handle.stats().sealed_chunks, 0, "the next commit recorded the ack");
        drop(handle);
        thread.join();
    }

    /// What a producer's request holds (its share of an intake budget) is kept by the spool
    /// thread with the request and dropped when it answers it, before the answer: not when the
    /// producer's future is dropped, for the request's buffers are still in the spool thread's
    /// hands then.
    #[tokio::test]
    async fn a_requests_charge_is_held_until_the_spool_answers_it_not_until_its_producer_leaves() {
        /// Sends on its channel when dropped.
        struct Dropped(Option<oneshot::Sender<()>>);
        impl Drop for Dropped {
            fn drop(&mut self) {
                let _ = self.0.take().map(|tx| tx.send(()));
            }
        }
        /// Holds up whoever drops it until the test opens it.
        struct Gate(std::sync::mpsc::Receiver<()>);
        impl Drop for Gate {
            fn drop(&mut self) {
                let _ = self.0.recv();
            }
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, thread) = spawn(dir.path());
        let (open, gate) = std::sync::mpsc::channel();
        let first = handle.submit(request(), Gate(gate));
        let (tx, mut gone) = oneshot::channel();
        // Its producer went away at once.
        drop(handle.submit(request(), Dropped(Some(tx))));
        // Answers go out in order, and the first one's charge holds them up: the second charge
        // can only have been dropped with its future.
        assert!(gone.try_recv().is_err(), "the charge of a request still in the spool's hands was dropped");
        open.send(()).expect("the gate is waiting");
        first.await.expect("the first append");
        gone.await.expect("the second request's charge is dropped once it is answered");

        // Dropped before the answer: the producer that reads it finds its room given back.
        let (tx, mut gone) = oneshot::channel();
        handle.submit(request(), Dropped(Some(tx))).await.expect("append");
        assert!(gone.try_recv().is_ok(), "the charge is dropped before the answer");
        drop(handle);
        thread.join();
    }

    /// A quarantine the uploader asked for withholds floors (`removals_durable`) from the ask
    /// until the sync thread made its commit durable: not only until the spool thread ran it.
    #[tokio::test]
    async fn a_quarantine_withholds_floors_from_the_ask_until_its_commit_is_durable() {
        /// Says it is being dropped, then holds up the thread dropping it until the test opens it.
        struct Gate(Option<oneshot::Sender<()>>, std::sync::mpsc::Receiver<()>);
        impl Drop for Gate {
            fn drop(&mut self) {
                let _ = self.0.take().map(|tx| tx.send(()));
                let _ = self.1.recv();
            }
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, thread, mut reader) = spawn_with_reader(dir.path());
        handle.append(request()).await.expect("append");
        handle.seal_all().await;
        let chunk = reader.sealed_after(None, 10).expect("list")[0].id;
        assert!(handle.removals_durable());

        // The sync thread settles a commit and stops there, at the request's charge.
        let (open, gate) = std::sync::mpsc::channel();
        let (dropping, settling) = oneshot::channel();
        let first = handle.submit(request(), Gate(Some(dropping), gate));
        settling.await.expect("the sync thread settles the append");

        handle.quarantine(chunk, "rejected by server".into());
        assert!(!handle.removals_durable(), "asked, not done");
        until(&handle, "quarantined", |s| s.quarantined_chunks == 1).await;
        assert!(!handle.removals_durable(), "committed, not synced");
        // Of a chunk the spool no longer has: nothing to undo once synced.
        handle.quarantine(ChunkId(777), "rejected by server".into());

        open.send(()).expect("the gate is waiting");
        first.await.expect("the first append");
        // Settled in order: the quarantines' commits before this one's.
        handle.append(request()).await.expect("append");
        assert!(handle.removals_durable(), "both quarantines are durable once a later commit is");
        drop(handle);
        thread.join();
    }

    #[tokio::test]
    async fn an_idle_uploader_gets_each_commit_sealed_at_once_and_a_busy_one_waits_for_linger() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, thread) = spawn(dir.path());

        // Busy (the default): the record waits in an open batch.
        handle.append(request()).await.expect("append");
        assert_eq!((handle.stats().sealed_chunks, handle.stats().open_records), (0, 1));

        // Idle: the commit that carries the next record seals everything open, in the same
        // transaction, so the chunk exists when the producer has its answer.
        handle.set_uploader_idle(true);
        handle.append(request()).await.expect("append");
        assert_eq!((handle.stats().sealed_chunks, handle.stats().open_records), (1, 0));

        // The uploader has work now: until it says it is idle again, records wait again.
        handle.append(request()).await.expect("append");
        assert_eq!((handle.stats().sealed_chunks, handle.stats().open_records), (1, 1));

        drop(handle);
        thread.join();
    }

    fn spawn_due_at_once(dir: &std::path::Path, max_bytes: u64) -> (SpoolHandle, SpoolThread) {
        let mut opts = SpoolOptions::new(dir.join("spool.db"));
        // Every open batch is due at every commit, unless held back.
        opts.linger = Duration::ZERO;
        opts.max_bytes = max_bytes;
        let (spool, _) = Spool::open(opts).expect("open spool");
        SpoolHandle::spawn(spool).expect("spawn spool thread")
    }

    fn counts(handle: &SpoolHandle) -> (u64, u64) {
        (handle.stats().sealed_chunks, handle.stats().open_records)
    }

    #[tokio::test]
    async fn open_batches_are_sealed_by_linger_only_while_the_uploader_takes_seals() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, thread) = spawn_due_at_once(dir.path(), 1 << 30);

        // No uploader follows the seals (disconnected): records stay in open batches, however
        // old they are.
        for _ in 0..3 {
            handle.append(request()).await.expect("append");
        }
        assert_eq!(counts(&handle), (0, 3));

        // An uploader that has sent everything sealed: the next commit seals what is due.
        let handoff = handle.handoff();
        assert!(handoff.follow(handoff.generation()));
        handle.append(request()).await.expect("append");
        assert_eq!(counts(&handle), (1, 0));

        // That chunk waits in the queue, not taken yet: records wait for it.
        handle.append(request()).await.expect("append");
        assert_eq!(counts(&handle), (1, 1));

        // Taken: sealed again.
        assert!(matches!(handoff.next(), crate::handoff::Next::Chunk(..)));
        handle.append(request()).await.expect("append");
        assert_eq!(counts(&handle), (2, 0));

        // The connection ends: held back again.
        handoff.stop();
        handle.append(request()).await.expect("append");
        assert_eq!(counts(&handle), (2, 1));

        drop(handle);
        thread.join();
    }

    #[test]
    fn seals_not_settled_yet_hold_back_the_next_like_chunks_the_uploader_has_not_taken() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (spool, _) = Spool::open(SpoolOptions::new(dir.path().join("spool.db"))).expect("open spool");
        let handoff = Handoff::default();
        assert!(handoff.follow(handoff.generation()));
        let settling = AtomicU64::new(0);
        assert!(!held_back(&spool, &handoff, &settling), "following, nothing queued, nothing settling");
        settling.store(1, Ordering::Release);
        assert!(held_back(&spool, &handoff, &settling), "a chunk is about to be queued");
    }

    #[tokio::test]
    async fn open_batches_holding_an_eighth_of_the_cap_are_sealed_by_linger_all_the_same() {
        let dir = tempfile::tempdir().expect("tempdir");
        // An eighth of the cap is 6 bytes, more than one request's 5: only sealed chunks can be
        // dropped to make room, so open batches that large are not held back.
        let (handle, thread) = spawn_due_at_once(dir.path(), 48);
        handle.append(request()).await.expect("append");
        assert_eq!(counts(&handle), (0, 1), "5 bytes open: held back (no uploader takes seals)");
        // 10 bytes open: the next tick's commit seals them (maybe before the producer has its
        // answer, which waits for the WAL's sync while the spool thread goes on).
        handle.append(request()).await.expect("append");
        until(&handle, "sealed", |s| (s.sealed_chunks, s.open_records) == (1, 0)).await;

        drop(handle);
        thread.join();
    }

    #[tokio::test]
    async fn only_commits_someone_waits_for_are_synced_and_timed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut opts = SpoolOptions::new(dir.path().join("spool.db"));
        // A tick every millisecond; no uploader follows, so nothing is due for sealing.
        opts.linger = Duration::from_millis(2);
        let (spool, _) = Spool::open(opts).expect("open spool");
        let mut reader = spool.reader().expect("reader");
        let (handle, thread) = SpoolHandle::spawn(spool).expect("spawn spool thread");
        let commits = handle.stats_view().commit_seconds().clone();

        handle.append(request()).await.expect("append");
        assert_eq!(commits.get_sample_count(), 1, "the producer's commit");
        handle.seal_all().await;
        assert_eq!(commits.get_sample_count(), 2, "the seal_all caller's commit");
        let chunks = reader.sealed_after(None, usize::MAX).expect("list");
        assert_eq!(chunks.len(), 1);

        // An ack alone, then dozens of ticks with nothing to do: no one waits for them, so none
        // gets a sync of its own (an idle agent would otherwise fsync a thousand times a second).
        handle.ack(vec![chunks[0].id]);
        until_no_sealed_chunks(&handle).await;
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_eq!(commits.get_sample_count(), 2);

        drop(handle);
        thread.join();
    }

    #[tokio::test]
    async fn acks_handed_over_one_by_one_are_all_committed() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, thread, mut reader) = spawn_with_reader(dir.path());
        // More chunks than one ack group, one stream each so that every seal makes a chunk.
        let n = ACK_GROUP + 6;
        for i in 0..n {
            let batch = Batch { stream: format!("s{i}"), data: vec![0, 0, 0, 1, 7], records: 1 };
            handle.append(AppendRequest { batches: vec![batch] }).await.expect("append");
        }
        handle.seal_all().await;
        let chunks = reader.sealed_after(None, usize::MAX).expect("list");
        assert_eq!(chunks.len(), n);

        // The first ack wakes the thread, the next ones wait in the queue; the 64th wakes it again.
        for c in &chunks {
            handle.ack(vec![c.id]);
        }
        until_no_sealed_chunks(&handle).await;
        assert!(reader.sealed_after(None, usize::MAX).expect("list").is_empty());
        assert!(crate::lock(&handle.pending_acks).is_empty());

        drop(handle);
        thread.join();
    }

    #[tokio::test]
    async fn chunks_dropped_by_the_cap_end_the_uploaders_following() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut opts = SpoolOptions::new(dir.path().join("spool.db"));
        opts.linger = Duration::from_secs(3600);
        opts.chunk_target_bytes = 8 << 10;
        opts.max_bytes = 64 << 10;
        opts.full_policy = FullPolicy::DropOldest;
        let (spool, _) = Spool::open(opts).expect("open spool");
        let (handle, thread) = SpoolHandle::spawn(spool).expect("spawn spool thread");
        let handoff = handle.handoff();
        handoff.set_room(u64::MAX);
        assert!(handoff.follow(handoff.generation()));

        // Each append seals a chunk, queued for the follower; past 64 KiB the oldest are dropped.
        let append_10k = || {
            let batch = Batch { stream: "s".into(), data: vec![0; 10 << 10], records: 1 };
            handle.append(AppendRequest { batches: vec![batch] })
        };
        for _ in 0..4 {
            append_10k().await.expect("append");
        }
        assert!(handoff.following() && handoff.queued_bytes() > 0);
        for _ in 0..8 {
            append_10k().await.expect("append");
        }
        assert!(handle.stats().dropped_chunks > 0);
        // Queued chunks may be among the dropped ones: the uploader goes back to the spool.
        assert!(!handoff.following());
        assert_eq!(handoff.queued_bytes(), 0);

        drop(handle);
        thread.join();
    }

    #[tokio::test]
    async fn an_ack_with_nothing_else_to_commit_is_committed_after_its_linger() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (handle, thread, mut reader) = spawn_with_reader(dir.path());
        handle.append(request()).await.expect("append");
        handle.seal_all().await;
        let chunks = reader.sealed_after(None, usize::MAX).expect("list");
        assert_eq!((chunks.len(), handle.stats().sealed_chunks), (1, 1));

        // No appends, seals or further acks follow: the held ack must still reach the spool.
        handle.ack(vec![chunks[0].id]);
        until_no_sealed_chunks(&handle).await;
        assert!(reader.sealed_after(None, usize::MAX).expect("list").is_empty());

        drop(handle);
        thread.join();
    }
}
