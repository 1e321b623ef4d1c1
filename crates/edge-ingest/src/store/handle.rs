//! [`StoreHandle`]: a thread named `edge-store` owns the [`Store`]; async callers queue chunks
//! and await their outcome.
//!
//! Group commit: the thread blocks for the first request, then takes everything already queued
//! (up to [`BatchLimits`]) into one [`Store::persist`] call, so concurrent chunks from every
//! connection share one fsync. No timer: under load batches grow by themselves while the
//! previous fsync runs, and a lone chunk is written at once.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use super::{IncomingChunk, PersistOutcome, Store, StoreFailure, StoreStats};

/// Upper bounds of one batch taken by the store thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most chunks in one batch.
    pub max_chunks: usize,
    /// Most payload bytes in one batch (a single larger chunk still goes alone).
    pub max_bytes: usize,
}

impl Default for BatchLimits {
    fn default() -> Self {
        Self { max_chunks: 128, max_bytes: 64 << 20 }
    }
}

/// Cheap to clone, `Send + Sync` access to a [`Store`] running on its own thread.
///
/// Shutdown: [`StoreHandle::shutdown`] lets the thread finish what was queued before it, joins
/// it and so releases the directory lock before returning. Dropping the last clone without
/// calling it also stops the thread after the queued requests, but nobody waits for it.
#[derive(Debug, Clone)]
pub struct StoreHandle {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    tx: mpsc::UnboundedSender<Msg>,
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

#[derive(Debug)]
struct Shared {
    stats: Mutex<StoreStats>,
    queued: AtomicU64,
    running: AtomicBool,
    /// Since when the thread is in one [`Store::persist`] call, as milliseconds after `epoch`
    /// plus one; 0 while it waits for work.
    busy_since: AtomicU64,
    epoch: Instant,
}

impl Default for Shared {
    fn default() -> Self {
        Shared {
            stats: Mutex::default(),
            queued: AtomicU64::new(0),
            running: AtomicBool::new(false),
            busy_since: AtomicU64::new(0),
            epoch: Instant::now(),
        }
    }
}

impl Shared {
    fn mark_busy(&self, busy: bool) {
        let since = if busy { u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX - 1) + 1 } else { 0 };
        self.busy_since.store(since, Ordering::Relaxed);
    }

    fn busy(&self) -> Option<Duration> {
        match self.busy_since.load(Ordering::Relaxed) {
            0 => None,
            since => Some(self.epoch.elapsed().saturating_sub(Duration::from_millis(since - 1))),
        }
    }
}

#[derive(Debug)]
enum Msg {
    Persist(IncomingChunk, oneshot::Sender<PersistOutcome>),
    /// An agent's floor for one of its streams ([`Store::raise_floor`]).
    Floor(Floor),
    Shutdown,
}

/// An agent's floor, queued for the store thread.
#[derive(Debug)]
struct Floor {
    device: String,
    spool: [u8; 16],
    stream: String,
    seq: u64,
    /// Told once the floor is applied.
    applied: oneshot::Sender<()>,
}

impl StoreHandle {
    /// Moves `store` onto a new thread named `edge-store` with the default [`BatchLimits`].
    ///
    /// # Panics
    /// If the OS cannot start a thread, like [`std::thread::spawn`]; see [`Self::try_spawn`].
    pub fn spawn(store: Store) -> StoreHandle {
        Self::try_spawn(store, BatchLimits::default()).expect("the OS refused to start the edge-store thread")
    }

    /// Like [`Self::spawn`] with explicit limits, returning the error if the thread cannot start.
    pub fn try_spawn(store: Store, limits: BatchLimits) -> std::io::Result<StoreHandle> {
        let (tx, rx) = mpsc::unbounded_channel();
        let shared = Arc::new(Shared { stats: Mutex::new(store.stats()), ..Shared::default() });
        shared.running.store(true, Ordering::SeqCst);
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("edge-store".into())
            .spawn(move || run(store, rx, &thread_shared, limits, None))?;
        Ok(StoreHandle { inner: Arc::new(Inner { tx, shared, thread: Mutex::new(Some(thread)) }) })
    }

    /// Queues `chunk` for the next group commit and waits for its outcome.
    ///
    /// If the store thread is gone (shut down or panicked) the outcome is `Failed(Io)`. Dropping
    /// the future does not cancel the write; the chunk may still be stored.
    pub async fn persist(&self, chunk: IncomingChunk) -> PersistOutcome {
        let (tx, rx) = oneshot::channel();
        self.inner.shared.queued.fetch_add(1, Ordering::Relaxed);
        if self.inner.tx.send(Msg::Persist(chunk, tx)).is_err() {
            self.inner.shared.queued.fetch_sub(1, Ordering::Relaxed);
            return PersistOutcome::Failed(StoreFailure::Io("store thread has stopped".into()));
        }
        rx.await.unwrap_or_else(|_| {
            PersistOutcome::Failed(StoreFailure::Io("store thread stopped before answering".into()))
        })
    }

    /// Queues an agent's floor for `(device, spool, stream)` ([`Store::raise_floor`]) and
    /// waits until it is applied. The store thread applies it after the chunks queued before it
    /// are persisted, so that none of those is answered `Duplicate` by the floor instead. The
    /// wait keeps each caller to one floor in the queue: floors are sent by a peer, and the
    /// queue has no bound of its own.
    pub async fn raise_floor(&self, device: &str, spool: [u8; 16], stream: &str, seq: u64) {
        let (applied, done) = oneshot::channel();
        let floor = Floor { device: device.to_owned(), spool, stream: stream.to_owned(), seq, applied };
        // A stopped thread applies nothing, and answers nothing either.
        if self.inner.tx.send(Msg::Floor(floor)).is_ok() {
            let _ = done.await;
        }
    }

    /// Counters as of the last finished batch, plus the queue length. No round trip to the
    /// store thread.
    pub fn stats(&self) -> StoreStats {
        let mut stats = self.inner.shared.stats.lock().unwrap_or_else(PoisonError::into_inner).clone();
        stats.queued = self.inner.shared.queued.load(Ordering::Relaxed);
        stats.busy = self.inner.shared.busy();
        stats
    }

    /// A read-only view of the statistics for observers (the metrics collector). Unlike a
    /// handle it does not keep the store thread running.
    pub fn stats_view(&self) -> StoreStatsView {
        StoreStatsView(Arc::clone(&self.inner.shared))
    }

    /// Whether the store thread is still running.
    pub fn is_running(&self) -> bool {
        self.inner.shared.running.load(Ordering::SeqCst)
    }

    /// Stops the store thread after the requests queued before this call and waits for it (a
    /// batch in progress takes one fsync, milliseconds). Requests queued afterwards, from
    /// other clones, fail with `Failed(Io)`. Blocking: from async code call it through
    /// `tokio::task::spawn_blocking`. Calling it on several clones is harmless.
    pub fn shutdown(self) {
        // An error means the thread is already gone, which is what we want.
        let _ = self.inner.tx.send(Msg::Shutdown);
        let thread = self.inner.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(thread) = thread
            && thread.join().is_err()
        {
            tracing::error!("edge-store thread panicked");
        }
    }
}

/// See [`StoreHandle::stats_view`].
#[derive(Debug, Clone)]
pub struct StoreStatsView(Arc<Shared>);

impl StoreStatsView {
    /// How long the store thread has been in its current batch (writes and fsyncs), or `None`
    /// while it waits for work. Always `None` for a JetStream sink, whose publishes time out.
    pub fn busy(&self) -> Option<Duration> {
        self.0.busy()
    }

    /// Counters as of the last finished batch, plus the queue length, as [`StoreHandle::stats`].
    pub fn get(&self) -> StoreStats {
        let mut stats = self.0.stats.lock().unwrap_or_else(PoisonError::into_inner).clone();
        stats.queued = self.0.queued.load(Ordering::Relaxed);
        stats.busy = self.0.busy();
        stats
    }

    /// Whether the store thread is still running, as [`StoreHandle::is_running`].
    pub fn is_running(&self) -> bool {
        self.0.running.load(Ordering::SeqCst)
    }
}

/// Statistics kept by a sink that has no store thread (the JetStream sink), in the same shape,
/// so that `/metrics` and `/v1/status` read every sink through one [`StoreStatsView`].
#[derive(Debug, Clone)]
pub(crate) struct StatsCell(Arc<Shared>);

impl StatsCell {
    /// Empty statistics, marked running.
    pub(crate) fn new() -> Self {
        let shared = Shared::default();
        shared.running.store(true, Ordering::SeqCst);
        StatsCell(Arc::new(shared))
    }

    /// Changes the statistics under their lock.
    pub(crate) fn update(&self, f: impl FnOnce(&mut StoreStats)) {
        f(&mut self.0.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// Requests waiting for the sink (reported as [`StoreStats::queued`]).
    pub(crate) fn queued(&self) -> &AtomicU64 {
        &self.0.queued
    }

    /// Marks the sink stopped (or running again).
    pub(crate) fn set_running(&self, running: bool) {
        self.0.running.store(running, Ordering::SeqCst);
    }

    /// A read-only view for observers.
    pub(crate) fn view(&self) -> StoreStatsView {
        StoreStatsView(Arc::clone(&self.0))
    }
}

/// Marks the thread stopped however it exits (panics included).
struct RunningGuard<'a>(&'a Shared);

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        self.0.mark_busy(false);
        self.0.running.store(false, Ordering::SeqCst);
    }
}

fn run(
    mut store: Store,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    shared: &Shared,
    limits: BatchLimits,
    start_gate: Option<std::sync::mpsc::Receiver<()>>,
) {
    let _guard = RunningGuard(shared);
    if let Some(gate) = start_gate {
        // Tests queue requests before the thread takes the first one. A dropped sender opens
        // the gate too.
        let _ = gate.recv();
    }
    let mut carry: Option<(IncomingChunk, oneshot::Sender<PersistOutcome>)> = None;
    // Floors that came while a batch was gathered: applied once it is persisted.
    let mut floors: Vec<Floor> = Vec::new();
    let apply = |store: &mut Store, f: Floor| {
        if store.raise_floor(&f.device, &f.spool, &f.stream, f.seq).is_some() {
            *shared.stats.lock().unwrap_or_else(PoisonError::into_inner) = store.stats();
        }
        let _ = f.applied.send(());
    };
    loop {
        let first = match carry.take() {
            Some(req) => req,
            None => match rx.blocking_recv() {
                Some(Msg::Persist(chunk, reply)) => {
                    shared.queued.fetch_sub(1, Ordering::Relaxed);
                    (chunk, reply)
                }
                Some(Msg::Floor(f)) => {
                    apply(&mut store, f);
                    continue;
                }
                Some(Msg::Shutdown) | None => break,
            },
        };
        let mut bytes = first.0.payload.len();
        let mut chunks = vec![first.0];
        let mut replies = vec![first.1];
        let mut stop = false;
        while chunks.len() < limits.max_chunks {
            match rx.try_recv() {
                Ok(Msg::Persist(chunk, reply)) => {
                    shared.queued.fetch_sub(1, Ordering::Relaxed);
                    if bytes.saturating_add(chunk.payload.len()) > limits.max_bytes {
                        carry = Some((chunk, reply));
                        break;
                    }
                    bytes += chunk.payload.len();
                    chunks.push(chunk);
                    replies.push(reply);
                }
                Ok(Msg::Floor(f)) => floors.push(f),
                Ok(Msg::Shutdown) => {
                    stop = true;
                    break;
                }
                Err(_) => break,
            }
        }
        shared.mark_busy(true);
        let outcomes = store.persist(chunks);
        shared.mark_busy(false);
        *shared.stats.lock().unwrap_or_else(PoisonError::into_inner) = store.stats();
        crate::crash_point!("ingest::persist::before_acks");
        for (reply, outcome) in replies.into_iter().zip(outcomes) {
            // The caller may have gone away (connection closed); the chunk is stored anyway.
            let _ = reply.send(outcome);
        }
        for f in floors.drain(..) {
            apply(&mut store, f);
        }
        if stop {
            break;
        }
    }
    tracing::debug!("edge-store thread stopping");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ChunkKey, PersistOutcome, StoreOptions};

    fn chunk(seq: u64) -> IncomingChunk {
        let mut payload = Vec::new();
        payload.extend_from_slice(&5u32.to_le_bytes());
        payload.extend_from_slice(b"hello");
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

    fn spawn_gated(store: Store, limits: BatchLimits) -> (StoreHandle, std::sync::mpsc::Sender<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let (gate_tx, gate_rx) = std::sync::mpsc::channel();
        let shared = Arc::new(Shared { stats: Mutex::new(store.stats()), ..Shared::default() });
        shared.running.store(true, Ordering::SeqCst);
        let thread_shared = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name("edge-store".into())
            .spawn(move || run(store, rx, &thread_shared, limits, Some(gate_rx)))
            .expect("test can start a thread");
        (StoreHandle { inner: Arc::new(Inner { tx, shared, thread: Mutex::new(Some(thread)) }) }, gate_tx)
    }

    #[test]
    fn queued_requests_are_taken_in_batches_bounded_by_count_and_bytes() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(StoreOptions::new(dir.path())).expect("open");
        let limits = BatchLimits { max_chunks: 128, max_bytes: 9 * 100 };
        let (handle, gate) = spawn_gated(store, limits);
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let outcomes = rt.block_on(async {
            let mut tasks = tokio::task::JoinSet::new();
            for seq in 1..=200 {
                let h = handle.clone();
                tasks.spawn(async move { h.persist(chunk(seq)).await });
            }
            // Let every task queue its chunk, then let the store thread start.
            while handle.stats().queued < 200 {
                tokio::task::yield_now().await;
            }
            gate.send(()).expect("store thread waits at the gate");
            tasks.join_all().await
        });
        assert!(outcomes.iter().all(|o| *o == PersistOutcome::Stored), "{outcomes:?}");
        let stats = handle.stats();
        // Each chunk has a 9-byte payload: 100 fit the byte bound, so 100 + 100.
        assert_eq!(stats.fsyncs, 2);
        assert_eq!(stats.batches, 2);
        assert_eq!(stats.queued, 0);
        handle.shutdown();
    }

    /// A floor is waited for until the store thread has applied it, after the chunks queued
    /// before it: the connection that sent it reads no further floor meanwhile, so a peer
    /// sending floor after floor has one in the queue, not one per frame.
    #[test]
    fn a_floor_returns_once_applied_after_the_chunks_queued_before_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(StoreOptions::new(dir.path())).expect("open");
        let (handle, gate) = spawn_gated(store, BatchLimits::default());
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        rt.block_on(async {
            let h = handle.clone();
            let first = tokio::spawn(async move { h.persist(chunk(1)).await });
            while handle.stats().queued < 1 {
                tokio::task::yield_now().await;
            }
            let mut floor = std::pin::pin!(handle.raise_floor("dev", [1; 16], "s", 5));
            for _ in 0..100 {
                let pending =
                    std::future::poll_fn(|cx| std::task::Poll::Ready(floor.as_mut().poll(cx).is_pending())).await;
                assert!(pending, "the store thread has applied nothing yet");
                tokio::task::yield_now().await;
            }
            gate.send(()).expect("store thread waits at the gate");
            floor.await;
            assert_eq!(first.await.expect("task"), PersistOutcome::Stored, "chunk 1 was persisted before the floor");
            // Below the floor, seq 3 counts as stored now.
            assert_eq!(handle.persist(chunk(3)).await, PersistOutcome::Duplicate);
        });
        handle.shutdown();
    }

    #[test]
    fn the_handle_can_be_shared_across_tasks_and_threads() {
        fn assert_shareable<T: Send + Sync + Clone + 'static>() {}
        assert_shareable::<StoreHandle>();
    }

    #[test]
    fn persist_after_shutdown_fails_instead_of_hanging() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(StoreOptions::new(dir.path())).expect("open");
        let handle = StoreHandle::spawn(store);
        let other = handle.clone();
        handle.shutdown();
        assert!(!other.is_running());
        let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
        let outcome = rt.block_on(other.persist(chunk(1)));
        assert!(matches!(outcome, PersistOutcome::Failed(StoreFailure::Io(_))), "{outcome:?}");
        // The lock was released by the joined thread.
        Store::open(StoreOptions::new(dir.path())).expect("reopen after shutdown");
    }
}
