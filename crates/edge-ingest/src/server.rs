//! The QUIC server: accepts agents, runs the `edge/1` server session for each, and turns every
//! chunk stream into a durable store write followed by an ack.
//!
//! Per connection:
//! 1. the device identity comes from the client certificate (TLS already verified the chain);
//! 2. the agent opens the control bi-stream and says Hello; the session answers Welcome;
//! 3. each uni-stream carries one chunk: header, payload, FIN. The payload is read into memory
//!    under a server-wide byte budget (so a thousand trickling streams cannot exhaust memory),
//!    checked (length, checksum, record framing), handed to the store's group committer, and
//!    acked on the control stream only once the store reports it durable (or a duplicate).
//!
//! A protocol violation closes the connection with the session's error code; other agents are
//! unaffected. Shutdown sends GoAway, lets chunks in flight finish within a grace period, then
//! closes the endpoint politely.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use edge_proto::server::{ServerEvent, ServerSession};
use edge_proto::{AckStatus, ChunkHeader, ErrorCode, Limits, ProtoError, RejectReason, RetryReason, StreamName};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, info, warn};

use crate::store::{ChunkKey, IncomingChunk, PersistOutcome, StoreFailure, StoreHandle};

/// What the server needs to run; built from the validated config or by tests.
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// UDP address to listen on.
    pub listen: SocketAddr,
    /// Protocol limits (frame sizes, handshake timeout).
    pub limits: Limits,
    /// How many chunks one agent may have in flight (announced in Welcome).
    pub max_in_flight: u32,
    /// Bytes of chunk payload held in memory across all connections before new streams wait.
    pub memory_budget: u64,
    /// How long shutdown waits for chunks in flight.
    pub shutdown_grace: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 4433)),
            limits: Limits::default(),
            max_in_flight: 64,
            memory_budget: 512 << 20,
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

/// Counters the server keeps; read by metrics and `status`.
#[derive(Debug, Default)]
pub struct ServerCounters {
    /// Connections accepted after a successful handshake.
    pub connections_total: AtomicU64,
    /// Connections currently open.
    pub connections_open: AtomicU64,
    /// Handshakes that failed (TLS, identity).
    pub auth_failures_total: AtomicU64,
    /// Chunks stored for the first time.
    pub chunks_stored_total: AtomicU64,
    /// Chunks answered as duplicates.
    pub chunks_duplicate_total: AtomicU64,
    /// Chunks rejected for good.
    pub chunks_rejected_total: AtomicU64,
    /// Chunks answered "retry later" (store failure, shutdown).
    pub chunks_retry_total: AtomicU64,
    /// Records in stored chunks.
    pub records_stored_total: AtomicU64,
    /// Wire payload bytes of stored chunks.
    pub bytes_stored_total: AtomicU64,
    /// Connections closed for a protocol violation.
    pub protocol_errors_total: AtomicU64,
    /// Payload received → store durable, per durable chunk (for `/metrics`).
    pub persist_latency: crate::metrics::PersistLatency,
}

/// A running server. Dropping it does not stop it; call [`Server::shutdown`].
#[derive(Debug)]
pub struct Server {
    local_addr: SocketAddr,
    cancel: CancellationToken,
    done: tokio::task::JoinHandle<()>,
    counters: Arc<ServerCounters>,
}

impl Server {
    /// Binds and starts serving on the given endpoint.
    pub fn start(endpoint: quinn::Endpoint, store: StoreHandle, opts: ServerOptions) -> std::io::Result<Self> {
        let local_addr = endpoint.local_addr()?;
        let cancel = CancellationToken::new();
        let counters = Arc::new(ServerCounters::default());
        let shared = Arc::new(Shared {
            store,
            opts,
            budget: Arc::new(Semaphore::new(0)),
            counters: counters.clone(),
            cancel: cancel.clone(),
        });
        let permits =
            usize::try_from(shared.opts.memory_budget >> 10).unwrap_or(usize::MAX).min(Semaphore::MAX_PERMITS);
        shared.budget.add_permits(permits);
        let done = tokio::spawn(accept_loop(endpoint, shared));
        Ok(Self { local_addr, cancel, done, counters })
    }

    /// The bound UDP address (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Live counters.
    pub fn counters(&self) -> Arc<ServerCounters> {
        self.counters.clone()
    }

    /// Graceful stop: GoAway, wait for chunks in flight (bounded by the grace period), close.
    pub async fn shutdown(self) {
        self.cancel.cancel();
        if let Err(e) = self.done.await {
            warn!(error = %e, "server task ended abnormally");
        }
    }
}

#[derive(Debug)]
struct Shared {
    store: StoreHandle,
    opts: ServerOptions,
    /// Payload memory budget in KiB permits.
    budget: Arc<Semaphore>,
    counters: Arc<ServerCounters>,
    cancel: CancellationToken,
}

async fn accept_loop(endpoint: quinn::Endpoint, shared: Arc<Shared>) {
    let tracker = TaskTracker::new();
    loop {
        let incoming = tokio::select! {
            () = shared.cancel.cancelled() => break,
            inc = endpoint.accept() => match inc {
                Some(inc) => inc,
                None => break,
            },
        };
        let shared = shared.clone();
        tracker.spawn(async move {
            let remote = incoming.remote_address();
            match incoming.await {
                Ok(conn) => serve_connection(conn, shared).await,
                Err(e) => {
                    shared.counters.auth_failures_total.fetch_add(1, Ordering::Relaxed);
                    info!(%remote, error = %e, "handshake failed");
                }
            }
        });
    }
    tracker.close();
    let grace = shared.opts.shutdown_grace;
    if tokio::time::timeout(grace + Duration::from_secs(1), tracker.wait()).await.is_err() {
        warn!(?grace, "connections still busy after the grace period; closing them");
    }
    endpoint.close(ErrorCode::ShuttingDown.to_u32().into(), b"shutting down");
    endpoint.wait_idle().await;
}

/// The per-connection state shared by the control task and chunk tasks.
struct ConnState {
    session: ServerSession,
    /// Bytes waiting to be written on the control stream.
    outbox: mpsc::UnboundedSender<Vec<u8>>,
}

impl ConnState {
    fn flush(&mut self) {
        while let Some(bytes) = self.session.poll_transmit() {
            // The receiver lives as long as the connection; a send error means it is closing.
            let _closing = self.outbox.send(bytes);
        }
    }
}

async fn serve_connection(conn: quinn::Connection, shared: Arc<Shared>) {
    let remote = conn.remote_address();
    let device = match edge_transport::peer_device_id(&conn) {
        Ok(d) => d,
        Err(e) => {
            shared.counters.auth_failures_total.fetch_add(1, Ordering::Relaxed);
            warn!(%remote, error = %e, "client certificate carries no valid device id");
            conn.close(ErrorCode::Unauthorized.to_u32().into(), b"no device identity");
            return;
        }
    };
    shared.counters.connections_total.fetch_add(1, Ordering::Relaxed);
    shared.counters.connections_open.fetch_add(1, Ordering::Relaxed);
    let result = run_connection(&conn, &device, &shared).await;
    shared.counters.connections_open.fetch_sub(1, Ordering::Relaxed);
    match result {
        Ok(()) => debug!(%device, %remote, "connection ended"),
        Err(ConnEnd::Protocol(e)) => {
            shared.counters.protocol_errors_total.fetch_add(1, Ordering::Relaxed);
            warn!(%device, %remote, code = %e.code(), error = %e, "protocol violation, closing connection");
            conn.close(e.code().to_u32().into(), e.to_string().as_bytes());
        }
        Err(ConnEnd::Lost(e)) => info!(%device, %remote, error = %e, "connection lost"),
    }
}

enum ConnEnd {
    Protocol(ProtoError),
    Lost(String),
}

impl From<ProtoError> for ConnEnd {
    fn from(e: ProtoError) -> Self {
        ConnEnd::Protocol(e)
    }
}

async fn run_connection(conn: &quinn::Connection, device: &str, shared: &Arc<Shared>) -> Result<(), ConnEnd> {
    let limits = shared.opts.limits.clone();
    // One deadline for the whole handshake, counted from the connection's start. A chunk stream
    // opened before Hello is a violation (an honest agent waits for Welcome).
    let deadline = tokio::time::Instant::now() + limits.handshake_timeout;
    let early_chunk = || ProtoError::UnexpectedFrame { frame: "chunk stream", reason: "opened before Hello" };
    // `biased`: a chunk stream that is already there when Hello arrives came first.
    let (mut ctl_send, mut ctl_recv) = tokio::select! {
        biased;
        _ = conn.accept_uni() => return Err(early_chunk().into()),
        r = conn.accept_bi() => r.map_err(|e| ConnEnd::Lost(e.to_string()))?,
        () = tokio::time::sleep_until(deadline) => {
            return Err(ProtoError::HandshakeTimeout.into());
        }
    };
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let state = Arc::new(Mutex::new(ConnState {
        session: ServerSession::new(device.to_owned(), limits.clone(), shared.opts.max_in_flight, Instant::now()),
        outbox: out_tx,
    }));

    // Control writer: the only task that writes to the control stream.
    let mut writer = tokio::spawn(async move {
        while let Some(bytes) = out_rx.recv().await {
            if ctl_send.write_all(&bytes).await.is_err() {
                break;
            }
        }
        let _already_closed = ctl_send.finish();
    });

    // Handshake: read until the session has seen Hello.
    let spool_id = {
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tokio::select! {
                biased;
                _ = conn.accept_uni() => return Err(early_chunk().into()),
                r = ctl_recv.read(&mut buf) => r.map_err(|e| ConnEnd::Lost(e.to_string()))?,
                () = tokio::time::sleep_until(deadline) => return Err(ProtoError::HandshakeTimeout.into()),
            };
            let Some(n) = n else {
                return Err(ConnEnd::Lost("control stream closed before Hello".into()));
            };
            let mut st = lock(&state);
            st.session.handle_control_bytes(Instant::now(), &buf[..n])?;
            st.flush();
            let mut hello = None;
            while let Some(ev) = st.session.poll_event() {
                // Hello is the only server event; a new variant must be handled here.
                let ServerEvent::Hello { spool_id, agent } = ev;
                info!(%device, spool = %hex(&spool_id), %agent, "agent connected");
                hello = Some(spool_id);
            }
            if let Some(id) = hello {
                break id;
            }
        }
    };

    let cancel = shared.cancel.clone();
    let chunk_tasks = TaskTracker::new();
    // A connection may hold at most an eighth of the server-wide budget (and always one
    // maximum-size chunk), so one agent cannot starve the others.
    let conn_kib = (shared.opts.memory_budget / 8).max(u64::from(limits.max_chunk_payload)).div_ceil(1024);
    let conn_budget =
        Arc::new(Semaphore::new(usize::try_from(conn_kib).unwrap_or(usize::MAX).min(Semaphore::MAX_PERMITS)));
    let (fail_tx, mut fail_rx) = mpsc::unbounded_channel::<ProtoError>();
    let result = loop {
        let mut buf = [0u8; 1024];
        tokio::select! {
            () = cancel.cancelled() => {
                lock(&state).session.go_away(ErrorCode::ShuttingDown);
                lock(&state).flush();
                break Ok(());
            }
            Some(e) = fail_rx.recv() => break Err(ConnEnd::Protocol(e)),
            r = ctl_recv.read(&mut buf) => match r {
                // The agent sends nothing after Hello today; anything it does send goes through
                // the session so violations close the connection.
                Ok(Some(n)) => {
                    let mut st = lock(&state);
                    st.session.handle_control_bytes(Instant::now(), &buf[..n])?;
                    st.flush();
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(ConnEnd::Lost(e.to_string())),
            },
            r = conn.accept_uni() => match r {
                Ok(recv) => {
                    let ctx = ChunkCtx {
                        device: device.to_owned(),
                        conn_budget: conn_budget.clone(),
                        spool_id,
                        state: state.clone(),
                        shared: shared.clone(),
                        fail: fail_tx.clone(),
                    };
                    chunk_tasks.spawn(handle_chunk_stream(recv, ctx));
                }
                Err(e) => break Err(ConnEnd::Lost(e.to_string())),
            },
        }
    };
    chunk_tasks.close();
    if result.is_ok() {
        // Orderly end (shutdown, or the agent finished its control stream). Chunks in flight
        // complete and are acked; the agent, told to go away, closes once it has its acks. The
        // whole sequence is bounded by the grace period.
        let deadline = tokio::time::Instant::now() + shared.opts.shutdown_grace;
        let _late = tokio::time::timeout_at(deadline, chunk_tasks.wait()).await;
        // Dropping the last state handle closes the outbox, so the writer flushes and finishes.
        drop(state);
        let _late = tokio::time::timeout_at(deadline, &mut writer).await;
        let _late = tokio::time::timeout_at(deadline, conn.closed()).await;
        conn.close(ErrorCode::NoError.to_u32().into(), b"bye");
    } else {
        drop(state);
    }
    writer.abort();
    result
}

struct ChunkCtx {
    device: String,
    /// This connection's share of the payload memory budget (KiB permits).
    conn_budget: Arc<Semaphore>,
    spool_id: [u8; 16],
    state: Arc<Mutex<ConnState>>,
    shared: Arc<Shared>,
    fail: mpsc::UnboundedSender<ProtoError>,
}

async fn handle_chunk_stream(mut recv: quinn::RecvStream, ctx: ChunkCtx) {
    match receive_chunk(&mut recv, &ctx).await {
        Ok(()) => {}
        Err(ChunkEnd::Protocol(e)) => {
            let _conn_closing = ctx.fail.send(e);
        }
        Err(ChunkEnd::Stream(e)) => debug!(device = %ctx.device, error = %e, "chunk stream ended early"),
    }
}

enum ChunkEnd {
    Protocol(ProtoError),
    Stream(String),
}

impl From<ProtoError> for ChunkEnd {
    fn from(e: ProtoError) -> Self {
        ChunkEnd::Protocol(e)
    }
}

async fn receive_chunk(recv: &mut quinn::RecvStream, ctx: &ChunkCtx) -> Result<(), ChunkEnd> {
    let limits = &ctx.shared.opts.limits;
    // 1. Header: read until it decodes; the decoder refuses oversized declared lengths.
    let mut head = BytesMut::with_capacity(256);
    let max_head = limits.max_chunk_header as usize + 16;
    let (header, consumed) = loop {
        if let Some(found) = ChunkHeader::decode(&head, limits)? {
            break found;
        }
        if head.len() > max_head {
            return Err(ProtoError::FrameTooLarge { len: head.len() as u64, max: max_head as u64 }.into());
        }
        match recv.read_chunk(max_head.saturating_sub(head.len()).max(1), true).await {
            Ok(Some(c)) => head.extend_from_slice(&c.bytes),
            Ok(None) => return Err(ChunkEnd::Stream("stream finished inside the chunk header".into())),
            Err(e) => return Err(ChunkEnd::Stream(e.to_string())),
        }
    };
    lock(&ctx.state).session.accept_chunk(&header)?;
    let header_key = (header.stream.clone(), header.seq);
    let result = process_chunk(recv, ctx, header, head, consumed).await;
    if let Err(ChunkEnd::Stream(_)) = &result {
        // No ack will come for it on this connection; free its window slot.
        lock(&ctx.state).session.chunk_abandoned(&header_key.0, header_key.1);
    }
    result
}

async fn process_chunk(
    recv: &mut quinn::RecvStream,
    ctx: &ChunkCtx,
    header: ChunkHeader,
    head: BytesMut,
    consumed: usize,
) -> Result<(), ChunkEnd> {
    let key_stream = header.stream.clone();
    let seq = header.seq;

    // 2. Payload, under two memory budgets: this connection's share, waited for (a greedy or
    //    stalled connection only slows itself), and the server-wide budget, waited for briefly
    //    before the agent is told to retry later. The payload must then arrive at a minimum
    //    rate, so a stalled stream cannot hold its budget forever.
    let payload_len = header.payload_len as usize;
    let kib = u32::try_from(payload_len.div_ceil(1024).max(1)).unwrap_or(u32::MAX);
    let Ok(_conn_permit) = ctx.conn_budget.clone().acquire_many_owned(kib).await else {
        return Err(ChunkEnd::Stream("connection closing".into()));
    };
    let _permit = match tokio::time::timeout(OVERLOAD_WAIT, ctx.shared.budget.clone().acquire_many_owned(kib)).await {
        Ok(Ok(p)) => p,
        Ok(Err(_closed)) => return Err(ChunkEnd::Stream("server shutting down".into())),
        Err(_elapsed) => {
            let _gone = recv.stop(0u32.into());
            debug!(device = %ctx.device, stream = %key_stream, seq, "memory budget exhausted; asking the agent to retry");
            return send_ack(ctx, &key_stream, seq, AckStatus::Retry(RetryReason::Overloaded));
        }
    };
    let deadline = tokio::time::Instant::now() + payload_deadline(payload_len);
    let mut payload = BytesMut::with_capacity(payload_len.min(1 << 20));
    payload.extend_from_slice(&head[consumed..]);
    while payload.len() <= payload_len {
        let chunk = tokio::time::timeout_at(deadline, recv.read_chunk(payload_len + 1 - payload.len(), true)).await;
        match chunk {
            Ok(Ok(Some(c))) => payload.extend_from_slice(&c.bytes),
            Ok(Ok(None)) => break,
            Ok(Err(e)) => return Err(ChunkEnd::Stream(e.to_string())),
            Err(_elapsed) => {
                let _gone = recv.stop(0u32.into());
                warn!(device = %ctx.device, stream = %key_stream, seq, received = payload.len(), payload_len, "chunk payload too slow; asking the agent to retry");
                return send_ack(ctx, &key_stream, seq, AckStatus::Retry(RetryReason::Overloaded));
            }
        }
    }
    let payload: Bytes = payload.freeze();
    let received = Instant::now();

    // 3. Verify: exact length, checksum, record framing.
    let status = if let Err(e) = header.verify_payload(&payload) {
        warn!(device = %ctx.device, stream = %key_stream, seq, error = %e, "chunk failed verification");
        AckStatus::Rejected(e.reject_reason().unwrap_or(RejectReason::Malformed))
    } else if let Err(e) = check_records(&header, &payload) {
        warn!(device = %ctx.device, stream = %key_stream, seq, error = %e, "chunk records are malformed");
        AckStatus::Rejected(RejectReason::BadRecords)
    } else {
        // 4. Persist (group commit) and map the outcome to an ack.
        let incoming = IncomingChunk {
            key: ChunkKey {
                device: ctx.device.clone(),
                spool: ctx.spool_id,
                stream: key_stream.as_str().to_owned(),
                seq,
            },
            records: header.records,
            codec: header.codec,
            raw_len: header.raw_len,
            checksum: header.checksum,
            created_ms: header.created_ms,
            payload: payload.clone(),
        };
        let outcome = ctx.shared.store.persist(incoming).await;
        if outcome.is_durable() {
            ctx.shared.counters.persist_latency.observe(received.elapsed());
        }
        match outcome {
            PersistOutcome::Stored => {
                let c = &ctx.shared.counters;
                c.chunks_stored_total.fetch_add(1, Ordering::Relaxed);
                c.records_stored_total.fetch_add(u64::from(header.records), Ordering::Relaxed);
                c.bytes_stored_total.fetch_add(payload.len() as u64, Ordering::Relaxed);
                AckStatus::Stored
            }
            PersistOutcome::Duplicate => {
                ctx.shared.counters.chunks_duplicate_total.fetch_add(1, Ordering::Relaxed);
                AckStatus::Duplicate
            }
            PersistOutcome::Failed(f) => {
                warn!(device = %ctx.device, stream = %key_stream, seq, failure = ?f, "store could not persist chunk");
                match f {
                    StoreFailure::DiskFull | StoreFailure::Io(_) | StoreFailure::ReadOnly => {
                        AckStatus::Retry(RetryReason::SinkUnavailable)
                    }
                    StoreFailure::Rejected(_) => AckStatus::Rejected(RejectReason::Malformed),
                }
            }
        }
    };
    send_ack(ctx, &key_stream, seq, status)
}

/// Queues the ack for one chunk on the control stream.
fn send_ack(ctx: &ChunkCtx, stream: &StreamName, seq: u64, status: AckStatus) -> Result<(), ChunkEnd> {
    let counters = &ctx.shared.counters;
    match status {
        AckStatus::Rejected(_) => counters.chunks_rejected_total.fetch_add(1, Ordering::Relaxed),
        AckStatus::Retry(_) => counters.chunks_retry_total.fetch_add(1, Ordering::Relaxed),
        AckStatus::Stored | AckStatus::Duplicate => 0,
    };
    let mut st = lock(&ctx.state);
    st.session.ack(stream, seq, status)?;
    st.flush();
    Ok(())
}

/// How long the server waits for server-wide memory before answering `Retry(Overloaded)`.
const OVERLOAD_WAIT: Duration = Duration::from_secs(1);
/// Slowest payload rate tolerated (bytes per second), on top of a fixed allowance.
const MIN_PAYLOAD_RATE: u64 = 16 * 1024;
const PAYLOAD_ALLOWANCE: Duration = Duration::from_secs(10);

/// Time allowed for a payload of `len` bytes to arrive.
fn payload_deadline(len: usize) -> Duration {
    PAYLOAD_ALLOWANCE + Duration::from_secs(len as u64 / MIN_PAYLOAD_RATE)
}

/// Checks that the payload splits into exactly the announced records.
fn check_records(header: &ChunkHeader, payload: &[u8]) -> Result<(), edge_proto::records::RecordError> {
    let raw = edge_proto::records::decode_payload(header.codec, payload, header.raw_len)?;
    let mut count: u32 = 0;
    for r in edge_proto::records::RecordIter::new(&raw) {
        r?;
        count = count.saturating_add(1);
    }
    if count != header.records {
        return Err(edge_proto::records::RecordError::CountMismatch { expected: header.records, found: count });
    }
    Ok(())
}

fn lock(state: &Mutex<ConnState>) -> std::sync::MutexGuard<'_, ConnState> {
    // A panic while holding this lock is a bug in this file; the state is still consistent
    // enough to finish closing the connection, so recover the guard instead of cascading.
    state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Lowercase hex of a spool id.
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _infallible = write!(s, "{b:02x}");
    }
    s
}
