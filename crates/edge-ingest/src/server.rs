//! The QUIC server: accepts agents, runs the `edge/1` server session for each, and turns every
//! chunk stream into a durable store write followed by an ack.
//!
//! Per connection:
//! 1. the device identity comes from the client certificate (TLS already verified the chain);
//! 2. the agent opens the control bi-stream and says Hello; the session answers Welcome. Chunk
//!    streams that arrive before the Hello (an agent may send chunks right behind it) wait, at
//!    most `max_in_flight` of them, and are read once the Hello is in. A Hello closes the
//!    device's earlier connections from the same spool (the agent gave them up; after an
//!    address change without migration they would hold the device's payload budget until
//!    their idle timeout);
//! 3. each uni-stream carries one chunk: header, payload, FIN. The payload is read into memory
//!    under a server-wide byte budget (so a thousand trickling streams cannot exhaust memory),
//!    checked (length, checksum, record framing), handed to the store's group committer, and
//!    acked on the control stream only once the store reports it durable (or a duplicate).
//!
//! A protocol violation closes the connection with the session's error code; other agents are
//! unaffected. So does an agent that leaves its acks unread past `ack_backlog_limit`, with
//! `ProtocolViolation`. Shutdown sends GoAway, lets chunks in flight finish within a grace
//! period, then closes the endpoint politely.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::{Duration, Instant, SystemTime};

use bytes::BytesMut;
use edge_proto::server::{ServerEvent, ServerSession};
use edge_proto::{
    AckStatus, ChunkHeader, Codec, ErrorCode, Limits, ProtoError, RejectReason, RetryReason, STOP_ANSWERED, StreamName,
};
use edge_transport::tls::RevocationList;
use edge_transport::{ServerTls, Tuning};
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{debug, error, info, warn};

use crate::sink::Sink;
use crate::store::{ChunkKey, IncomingChunk, Payload, PersistOutcome, StoreFailure, StoreStatsView};

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
    /// Most TLS handshakes in progress at once. From half of it on, a client whose address is
    /// not yet validated is first sent a QUIC Retry (a spoofed source never comes back, and a
    /// real one costs the server nothing until it does); at the limit new attempts are refused.
    /// Each pending handshake costs a task and its buffered Initials; completed connections do
    /// not count.
    pub max_pending_handshakes: u32,
    /// Longest a TLS handshake may take; a client that stops half-way frees its slot then.
    pub tls_handshake_timeout: Duration,
    /// Re-read the client CA and CRLs while running (see [`RevocationWatch`]); `None` keeps the
    /// revocation state of the TLS config the endpoint was built with.
    pub revocation: Option<RevocationWatch>,
    /// How often live connections are checked for a device certificate that expired since
    /// their handshake (where TLS checked it); those are closed with `Unauthorized`.
    pub certificate_sweep: Duration,
    /// Longest a chunk's payload may go without a byte arriving, while it holds its share of
    /// the memory budget: then it is answered `Retry(Overloaded)`, as one too slow overall is.
    pub payload_stall: Duration,
}

impl Default for ServerOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 4433)),
            limits: Limits::default(),
            max_in_flight: 64,
            memory_budget: 512 << 20,
            shutdown_grace: Duration::from_secs(10),
            max_pending_handshakes: DEFAULT_MAX_PENDING_HANDSHAKES,
            tls_handshake_timeout: Duration::from_secs(10),
            revocation: None,
            certificate_sweep: Duration::from_secs(30),
            payload_stall: Duration::from_secs(30),
        }
    }
}

/// Default of [`ServerOptions::max_pending_handshakes`]: a reconnect wave of a few hundred
/// agents completes at full speed (a handshake takes about a millisecond of CPU), while a flood
/// of half-open handshakes holds at most this many tasks.
pub const DEFAULT_MAX_PENDING_HANDSHAKES: u32 = 256;

/// Revocation while running: the server re-reads the client CA and the CRLs when their files
/// change (checked every `interval`, and on SIGHUP when `on_sighup`), then
///
/// 1. installs a new TLS config built from `tls` on the endpoint, so new handshakes are
///    verified against the new CRLs (this also drops every resumption ticket, so a revoked
///    device cannot resume past the new list), and
/// 2. closes every live connection whose client certificate the new list revokes, with the
///    application close code [`ErrorCode::Revoked`] and a log line naming the device.
///
/// Every new connection is also checked against the current list once its handshake is done
/// (resumed sessions skip the TLS client-certificate check). A file set that does not load
/// (unreadable, half-written, not signed by a client CA, past its `nextUpdate`) is refused
/// with an error log and the previous list and TLS config stay in force; the server tries it
/// again at every check until it loads.
#[derive(Debug, Clone)]
pub struct RevocationWatch {
    /// The TLS files: `client_ca` and `crls` are watched; all of them are re-read on a change.
    pub tls: ServerTls,
    /// Transport settings for the rebuilt server config.
    pub tuning: Tuning,
    /// `server.allow_migration`, applied to the rebuilt server config.
    pub allow_migration: bool,
    /// How often the files' metadata is checked.
    pub interval: Duration,
    /// Also check at once on SIGHUP (the daemon's reload signal).
    pub on_sighup: bool,
}

impl RevocationWatch {
    /// Default check period: a revocation takes effect within this long without a SIGHUP.
    pub const DEFAULT_INTERVAL: Duration = Duration::from_secs(10);
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
    /// Chunk streams that arrived before their connection's Hello and waited for it.
    pub early_chunk_streams_total: AtomicU64,
    /// TLS handshakes in progress now (see [`ServerOptions::max_pending_handshakes`]).
    pub handshakes_pending: AtomicU64,
    /// Connection attempts refused because too many handshakes were pending.
    pub handshakes_refused_total: AtomicU64,
    /// Connection attempts answered with a QUIC Retry (address validation under load).
    pub handshakes_retried_total: AtomicU64,
    /// Connections closed because their device certificate is revoked (at accept or later).
    pub revoked_closed_total: AtomicU64,
    /// Connections closed because a newer connection of the same agent (device and spool)
    /// said Hello, including one whose own late Hello found a newer connection there.
    pub superseded_total: AtomicU64,
    /// Revocation lists loaded while running (not counting the one at start).
    pub crl_reloads_total: AtomicU64,
    /// Revocation file sets refused while running (each distinct bad state counted once).
    pub crl_reload_failures_total: AtomicU64,
    /// The earliest `nextUpdate` of the CRLs in force, in Unix seconds (0: none).
    pub crl_next_update_unix: AtomicU64,
    /// Payload received → store durable, per durable chunk (for `/metrics`).
    pub persist_latency: crate::metrics::PersistLatency,
    /// Devices connected now, with their connections (for `status`).
    pub devices: ConnectedDevices,
    /// Samples of the stored totals over the last minute, taken by the server's sampler task
    /// (for the rates of `status`).
    pub rates: RateWindow,
}

impl ServerCounters {
    /// The stored totals now, with the store's batch count, as a [`RateWindow`] sample.
    pub fn sample(&self, store_batches: u64, at: Instant) -> Sample {
        Sample {
            at,
            chunks: self.chunks_stored_total.load(Ordering::Relaxed),
            records: self.records_stored_total.load(Ordering::Relaxed),
            bytes: self.bytes_stored_total.load(Ordering::Relaxed),
            store_batches,
        }
    }
}

/// Devices with at least one open connection (TLS handshake done, device id known), each with
/// its connections. A device leaves the map when its last connection ends.
#[derive(Debug, Default)]
pub struct ConnectedDevices {
    /// device → connection id → connection.
    map: Mutex<BTreeMap<String, BTreeMap<u64, ConnInfo>>>,
    next_id: AtomicU64,
}

#[derive(Debug)]
struct ConnInfo {
    since_ms: u64,
    remote: SocketAddr,
    stored: Arc<ConnStored>,
}

/// What one connection stored (first-time stores only, like the `*_stored_total` counters).
#[derive(Debug, Default)]
pub struct ConnStored {
    pub chunks: AtomicU64,
    pub records: AtomicU64,
    pub bytes: AtomicU64,
}

/// One connected device as `status` shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct DeviceStatus {
    /// Device id from the client certificate.
    pub device: String,
    /// Connections open now.
    pub connections: u32,
    /// Unix milliseconds when the oldest open connection was accepted.
    pub since_ms: u64,
    /// Remote address of the newest open connection.
    pub remote: String,
    /// Chunks, records and payload bytes stored over the open connections.
    pub chunks_stored: u64,
    pub records_stored: u64,
    pub bytes_stored: u64,
}

/// Registration of one connection in [`ConnectedDevices`]; dropping it removes the connection.
#[derive(Debug)]
pub struct DeviceConnection<'a> {
    devices: &'a ConnectedDevices,
    device: String,
    id: u64,
    stored: Arc<ConnStored>,
}

impl DeviceConnection<'_> {
    /// The counters of this connection's stored chunks.
    pub fn stored(&self) -> Arc<ConnStored> {
        self.stored.clone()
    }
}

impl Drop for DeviceConnection<'_> {
    fn drop(&mut self) {
        let mut map = self.devices.lock();
        if let Some(conns) = map.get_mut(&self.device) {
            conns.remove(&self.id);
            if conns.is_empty() {
                map.remove(&self.device);
            }
        }
    }
}

impl ConnectedDevices {
    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, BTreeMap<u64, ConnInfo>>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Registers a connection of `device` from `remote`, accepted at `since_ms`.
    pub fn connect(&self, device: &str, remote: SocketAddr, since_ms: u64) -> DeviceConnection<'_> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let stored = Arc::new(ConnStored::default());
        self.lock()
            .entry(device.to_owned())
            .or_default()
            .insert(id, ConnInfo { since_ms, remote, stored: stored.clone() });
        DeviceConnection { devices: self, device: device.to_owned(), id, stored }
    }

    /// The connected devices, sorted by device id.
    pub fn snapshot(&self) -> Vec<DeviceStatus> {
        self.lock()
            .iter()
            .map(|(device, conns)| {
                let sum = |f: fn(&ConnStored) -> &AtomicU64| {
                    conns.values().map(|c| f(&c.stored).load(Ordering::Relaxed)).sum::<u64>()
                };
                DeviceStatus {
                    device: device.clone(),
                    connections: u32::try_from(conns.len()).unwrap_or(u32::MAX),
                    since_ms: conns.values().map(|c| c.since_ms).min().unwrap_or(0),
                    // Ids grow with time: the last entry is the newest connection.
                    remote: conns.values().next_back().map(|c| c.remote.to_string()).unwrap_or_default(),
                    chunks_stored: sum(|s| &s.chunks),
                    records_stored: sum(|s| &s.records),
                    bytes_stored: sum(|s| &s.bytes),
                }
            })
            .collect()
    }
}

/// One sample of the stored totals (see [`ServerCounters::sample`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub at: Instant,
    pub chunks: u64,
    pub records: u64,
    pub bytes: u64,
    /// Store batches finished ([`StoreStats::batches`](crate::store::StoreStats::batches)).
    pub store_batches: u64,
}

/// Per-second rates of stored chunks, records and bytes.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Rates {
    pub chunks_per_s: f64,
    pub records_per_s: f64,
    pub bytes_per_s: f64,
    /// Seconds the rates are averaged over (up to 60; less just after start).
    pub window_s: f64,
}

/// The last [`RateWindow::LEN`] samples, one every [`RateWindow::INTERVAL`]: with the live
/// totals as the newest point they span the last minute.
#[derive(Debug, Default)]
pub struct RateWindow {
    samples: Mutex<VecDeque<Sample>>,
}

impl RateWindow {
    /// Sampling period.
    pub const INTERVAL: Duration = Duration::from_secs(5);
    /// Samples kept: 12 intervals, 60 s.
    pub const LEN: usize = 13;

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<Sample>> {
        self.samples.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a sample, dropping the oldest beyond [`RateWindow::LEN`].
    pub fn push(&self, sample: Sample) {
        let mut samples = self.lock();
        while samples.len() >= Self::LEN {
            samples.pop_front();
        }
        samples.push_back(sample);
    }

    /// Rates from the oldest sample kept to `now` (zero before the first sample, or when `now`
    /// is not later than it).
    pub fn rates(&self, now: Sample) -> Rates {
        let oldest = self.lock().front().copied();
        let window = oldest.map_or(Duration::ZERO, |o| now.at.saturating_duration_since(o.at));
        match oldest {
            Some(o) if window >= Duration::from_millis(1) => {
                let secs = window.as_secs_f64();
                let rate = |new: u64, old: u64| new.saturating_sub(old) as f64 / secs;
                Rates {
                    chunks_per_s: rate(now.chunks, o.chunks),
                    records_per_s: rate(now.records, o.records),
                    bytes_per_s: rate(now.bytes, o.bytes),
                    window_s: secs,
                }
            }
            _ => Rates { chunks_per_s: 0.0, records_per_s: 0.0, bytes_per_s: 0.0, window_s: 0.0 },
        }
    }

    /// How long the store has finished no batch, as far as the samples tell: the time since
    /// the oldest sample with `now`'s batch count (zero if none has it).
    pub fn store_idle(&self, now: Sample) -> Duration {
        self.lock()
            .iter()
            .find(|s| s.store_batches == now.store_batches)
            .map_or(Duration::ZERO, |s| now.at.saturating_duration_since(s.at))
    }
}

/// A running server. Dropping it does not stop it; call [`Server::shutdown`].
#[derive(Debug)]
pub struct Server {
    local_addr: SocketAddr,
    cancel: CancellationToken,
    done: tokio::task::JoinHandle<()>,
    sampler: tokio::task::JoinHandle<()>,
    counters: Arc<ServerCounters>,
}

impl Server {
    /// Binds and starts serving on the given endpoint.
    ///
    /// With [`ServerOptions::revocation`], the CRLs are loaded and checked first; a set that
    /// does not load is an error (the TLS config built from the same files would refuse every
    /// device or miss revocations).
    pub fn start(endpoint: quinn::Endpoint, sink: impl Into<Sink>, opts: ServerOptions) -> std::io::Result<Self> {
        let store = sink.into();
        let local_addr = endpoint.local_addr()?;
        let (revoked, watch_state) = match &opts.revocation {
            Some(w) => {
                let state = FileState::of(&w.tls);
                let list = RevocationList::load(&w.tls.client_ca, &w.tls.crls)
                    .map_err(|e| std::io::Error::other(format!("loading the revocation lists (tls.crls): {e}")))?;
                (list, Some(state))
            }
            None => (RevocationList::default(), None),
        };
        let cancel = CancellationToken::new();
        let counters = Arc::new(ServerCounters::default());
        counters.crl_next_update_unix.store(next_update_gauge(&revoked), Ordering::Relaxed);
        let sampler = tokio::spawn(sample_rates(counters.clone(), store.stats_view(), cancel.clone()));
        let permits = usize::try_from(opts.memory_budget >> 10).unwrap_or(usize::MAX).min(Semaphore::MAX_PERMITS);
        let shared = Arc::new(Shared {
            store,
            opts,
            budget: Arc::new(Semaphore::new(permits)),
            budget_kib: permits,
            counters: counters.clone(),
            cancel: cancel.clone(),
            revoked: RwLock::new(Arc::new(revoked)),
            live: LiveConnections::default(),
            device_budgets: Mutex::default(),
        });
        if let (Some(watch), Some(state)) = (shared.opts.revocation.clone(), watch_state) {
            // Registered here, not in the task, so a SIGHUP sent once `start` returned is
            // never missed (nor, with no handler yet, fatal).
            let hangup = if watch.on_sighup {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        warn!(error = %e, "cannot listen for SIGHUP; revocation lists are reloaded on file changes only");
                        None
                    }
                }
            } else {
                None
            };
            tokio::spawn(watch_revocations(endpoint.clone(), shared.clone(), watch, state, hangup));
        }
        tokio::spawn(expire_connections(shared.clone()));
        let done = tokio::spawn(accept_loop(endpoint, shared));
        Ok(Self { local_addr, cancel, done, sampler, counters })
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
        if let Err(e) = self.sampler.await {
            warn!(error = %e, "rate sampler ended abnormally");
        }
    }
}

/// Samples the stored totals every [`RateWindow::INTERVAL`] until `cancel`.
async fn sample_rates(counters: Arc<ServerCounters>, store: StoreStatsView, cancel: CancellationToken) {
    let mut tick = tokio::time::interval(RateWindow::INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = cancel.cancelled() => break,
            _ = tick.tick() => counters.rates.push(counters.sample(store.get().batches, Instant::now())),
        }
    }
}

#[derive(Debug)]
struct Shared {
    store: Sink,
    opts: ServerOptions,
    /// Payload memory budget in KiB permits.
    budget: Arc<Semaphore>,
    /// The permits `budget` was created with.
    budget_kib: usize,
    counters: Arc<ServerCounters>,
    cancel: CancellationToken,
    /// The revocation list in force (see [`RevocationWatch`]).
    revoked: RwLock<Arc<RevocationList>>,
    /// Connections past their handshake, so a new revocation list can close them.
    live: LiveConnections,
    /// Each device's share of `budget`, held by its connections (see [`Shared::device_budget`]).
    device_budgets: Mutex<DeviceBudgets>,
}

/// The payload budgets of the devices with a connection open.
#[derive(Debug, Default)]
struct DeviceBudgets {
    by_device: HashMap<String, std::sync::Weak<Semaphore>>,
    /// The map is swept of devices whose connections all ended once it reaches this size.
    sweep_at: usize,
}

impl Shared {
    fn revocation_list(&self) -> Arc<RevocationList> {
        self.revoked.read().unwrap_or_else(PoisonError::into_inner).clone()
    }

    /// The payload budget of `device`, `kib` permits, shared by all of its connections: one
    /// device certificate opening many connections gets no more of the server's memory than one
    /// connection would, so it cannot starve the other devices. (An agent uses one connection
    /// at a time; after an address change without migration its old one would linger until its
    /// idle timeout, holding permits: its Hello on the new one closes it, `LiveGuard::hello`.)
    fn device_budget(&self, device: &str, kib: usize) -> Arc<Semaphore> {
        let mut budgets = self.device_budgets.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(budget) = budgets.by_device.get(device).and_then(std::sync::Weak::upgrade) {
            return budget;
        }
        if budgets.by_device.len() >= budgets.sweep_at {
            budgets.by_device.retain(|_, b| b.strong_count() > 0);
            budgets.sweep_at = (budgets.by_device.len() * 2).max(64);
        }
        let budget = Arc::new(Semaphore::new(kib));
        budgets.by_device.insert(device.to_owned(), Arc::downgrade(&budget));
        budget
    }
}

/// Connections whose handshake completed, with their peer certificate.
#[derive(Debug, Default)]
struct LiveConnections {
    map: Mutex<HashMap<u64, LiveConn>>,
    next_id: AtomicU64,
}

#[derive(Debug)]
struct LiveConn {
    device: String,
    cert: Vec<u8>,
    /// The certificate's notAfter.
    valid_until: SystemTime,
    conn: quinn::Connection,
    /// The spool its agent named in Hello; `None` before.
    spool: Option<[u8; 16]>,
}

/// Removes its connection from [`LiveConnections`] when dropped.
struct LiveGuard<'a> {
    live: &'a LiveConnections,
    id: u64,
}

impl LiveGuard<'_> {
    /// Records the spool the connection's agent named in Hello. One agent keeps one connection,
    /// so the device's connections from the same spool that it started before this one are
    /// connections it gave up: they are returned, to be closed. After an address change without
    /// migration the old one lingers until its idle timeout, holding the device's share of the
    /// payload budget in chunk streams that will never finish, and the new one would wait for
    /// it. `Err(())` when a newer connection from the same spool already said Hello (this one's
    /// Hello came late, on a path the agent left): this one is the one to close.
    fn hello(&self, spool: [u8; 16]) -> Result<Vec<quinn::Connection>, ()> {
        let mut map = self.live.lock();
        let Some(device) = map.get_mut(&self.id).map(|c| {
            c.spool = Some(spool);
            c.device.clone()
        }) else {
            return Ok(Vec::new());
        };
        let same = |c: &LiveConn| c.device == device && c.spool == Some(spool);
        if map.iter().any(|(&id, c)| id > self.id && same(c)) {
            return Err(());
        }
        Ok(map.iter().filter(|&(&id, c)| id < self.id && same(c)).map(|(_, c)| c.conn.clone()).collect())
    }
}

impl Drop for LiveGuard<'_> {
    fn drop(&mut self) {
        self.live.lock().remove(&self.id);
    }
}

impl LiveConnections {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, LiveConn>> {
        self.map.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A number for a connection, taken when its first packet is accepted: connections a client
    /// starts one after the other get increasing numbers, whichever handshake ends first.
    fn next(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// Registers connection `id` (from [`LiveConnections::next`]).
    fn insert(
        &self,
        id: u64,
        device: &str,
        cert: Vec<u8>,
        valid_until: SystemTime,
        conn: &quinn::Connection,
    ) -> LiveGuard<'_> {
        self.lock()
            .insert(id, LiveConn { device: device.to_owned(), cert, valid_until, conn: conn.clone(), spool: None });
        LiveGuard { live: self, id }
    }
}

/// Closes, every [`ServerOptions::certificate_sweep`], the connections whose device certificate
/// expired since their handshake: TLS checks it there only, and a connection, or a session
/// resumed from it (see `serve_connection`), can outlive it. Until the server is cancelled.
async fn expire_connections(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(shared.opts.certificate_sweep);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = shared.cancel.cancelled() => break,
            _ = tick.tick() => {
                let now = SystemTime::now();
                for c in shared.live.lock().values() {
                    if c.valid_until < now && c.conn.close_reason().is_none() {
                        shared.counters.auth_failures_total.fetch_add(1, Ordering::Relaxed);
                        warn!(device = %c.device, remote = %c.conn.remote_address(), "device certificate expired; closing its connection");
                        c.conn.close(ErrorCode::Unauthorized.to_u32().into(), expired_reason(&c.device).as_bytes());
                    }
                }
            }
        }
    }
}

/// The close reason of a connection whose device certificate is not valid now.
fn expired_reason(device: &str) -> String {
    format!("certificate of device {device} is not valid now")
}

/// Closes `conn` if `list` revokes its certificate; returns whether it did.
fn close_if_revoked(
    shared: &Shared,
    list: &RevocationList,
    device: &str,
    cert: &[u8],
    conn: &quinn::Connection,
) -> bool {
    let Some(serial) = list.revoked_serial(cert) else {
        return false;
    };
    shared.counters.revoked_closed_total.fetch_add(1, Ordering::Relaxed);
    warn!(%device, %serial, remote = %conn.remote_address(), "device certificate revoked; closing its connection");
    conn.close(ErrorCode::Revoked.to_u32().into(), format!("certificate of device {device} revoked").as_bytes());
    true
}

/// Counts a pending TLS handshake for as long as it lives.
struct PendingHandshake(Arc<ServerCounters>);

impl PendingHandshake {
    fn new(counters: Arc<ServerCounters>) -> Self {
        counters.handshakes_pending.fetch_add(1, Ordering::Relaxed);
        Self(counters)
    }
}

impl Drop for PendingHandshake {
    fn drop(&mut self) {
        self.0.handshakes_pending.fetch_sub(1, Ordering::Relaxed);
    }
}

/// What the accept loop does with a new connection attempt, given the handshakes pending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admission {
    Accept,
    /// Ask the client to prove its address first (QUIC Retry).
    Retry,
    Refuse,
}

fn admission(pending: u64, max: u32, address_validated: bool, may_retry: bool) -> Admission {
    let max = u64::from(max.max(1));
    if pending >= max {
        Admission::Refuse
    } else if pending >= max.div_ceil(2) && !address_validated && may_retry {
        Admission::Retry
    } else {
        Admission::Accept
    }
}

enum HandshakeEnd {
    Failed(quinn::ConnectionError),
    TimedOut,
}

/// Runs the TLS handshake of `incoming` to completion, or closes it after `timeout`.
///
/// The `Connection` handle is taken at once (`Connecting::into_0rtt`, which on a server always
/// succeeds) only so that a handshake past its deadline can be closed: dropping a `Connecting`
/// does not end the connection (quinn's driver keeps it until the idle timeout), so a flood of
/// half-open handshakes would otherwise hold quinn state far longer than its slot. Nothing
/// reads or writes the connection, nor reads its identity, before `established` resolves.
async fn complete_handshake(incoming: quinn::Incoming, timeout: Duration) -> Result<quinn::Connection, HandshakeEnd> {
    let connecting = incoming.accept().map_err(HandshakeEnd::Failed)?;
    let (conn, established) = match connecting.into_0rtt() {
        Ok(pair) => pair,
        // Not possible on a server; fall back to waiting without a handle.
        Err(connecting) => {
            return match tokio::time::timeout(timeout, connecting).await {
                Ok(r) => r.map_err(HandshakeEnd::Failed),
                Err(_elapsed) => Err(HandshakeEnd::TimedOut),
            };
        }
    };
    let done = async {
        tokio::select! {
            _ = established => conn.close_reason(),
            e = conn.closed() => Some(e),
        }
    };
    match tokio::time::timeout(timeout, done).await {
        Ok(None) => Ok(conn),
        Ok(Some(e)) => Err(HandshakeEnd::Failed(e)),
        Err(_elapsed) => {
            conn.close(ErrorCode::HandshakeTimeout.to_u32().into(), b"TLS handshake timeout");
            Err(HandshakeEnd::TimedOut)
        }
    }
}

// 0-RTT: the TLS config accepts early data (see `edge_transport`'s crate docs). This server
// takes 0.5-RTT connection handles only to close stalled handshakes (`complete_handshake`) and
// acts on nothing before the handshake is complete; quinn buffers the streams a client opened
// in 0-RTT until then. So no application data is acted on before the client has proved it
// holds the session's keys, and a replayed first flight, which cannot finish the handshake,
// never reaches `serve_connection`. A legitimate resend of a chunk (the client's 0-RTT rejected and
// sent again in 1-RTT) is harmless: chunks are deduplicated by (device, spool, stream, seq)
// before they are acked, and Hello only names the spool.
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
        let counters = &shared.counters;
        let pending = counters.handshakes_pending.load(Ordering::Relaxed);
        let remote = incoming.remote_address();
        match admission(
            pending,
            shared.opts.max_pending_handshakes,
            incoming.remote_address_validated(),
            incoming.may_retry(),
        ) {
            Admission::Refuse => {
                counters.handshakes_refused_total.fetch_add(1, Ordering::Relaxed);
                debug!(%remote, pending, "too many handshakes pending; connection refused");
                incoming.refuse();
                continue;
            }
            Admission::Retry => {
                counters.handshakes_retried_total.fetch_add(1, Ordering::Relaxed);
                debug!(%remote, pending, "handshakes pending; validating the client address first");
                if let Err(e) = incoming.retry() {
                    e.into_incoming().refuse();
                }
                continue;
            }
            Admission::Accept => {}
        }
        let slot = PendingHandshake::new(counters.clone());
        let shared = shared.clone();
        let id = shared.live.next();
        tracker.spawn(async move {
            let handshake = complete_handshake(incoming, shared.opts.tls_handshake_timeout).await;
            drop(slot);
            match handshake {
                Ok(conn) => serve_connection(id, conn, shared).await,
                Err(HandshakeEnd::Failed(e)) => {
                    shared.counters.auth_failures_total.fetch_add(1, Ordering::Relaxed);
                    info!(%remote, error = %e, "handshake failed");
                }
                Err(HandshakeEnd::TimedOut) => {
                    shared.counters.auth_failures_total.fetch_add(1, Ordering::Relaxed);
                    info!(%remote, timeout = ?shared.opts.tls_handshake_timeout, "handshake timed out");
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

/// Metadata of the watched TLS files (client CA and CRLs), to notice a change cheaply: length,
/// modification time and inode (a file replaced by rename gets a new one). `None` for a file
/// that cannot be read now.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileState(Vec<Option<(u64, std::time::SystemTime, u64)>>);

impl FileState {
    fn of(tls: &ServerTls) -> Self {
        use std::os::unix::fs::MetadataExt;
        let files = std::iter::once(&tls.client_ca).chain(&tls.crls);
        Self(
            files
                .map(|p| std::fs::metadata(p).ok().and_then(|m| Some((m.len(), m.modified().ok()?, m.ino()))))
                .collect(),
        )
    }
}

/// The CRLs' earliest `nextUpdate` for [`ServerCounters::crl_next_update_unix`].
fn next_update_gauge(list: &RevocationList) -> u64 {
    list.next_update_unix().and_then(|t| u64::try_from(t).ok()).unwrap_or(0)
}

/// How long before a CRL's `nextUpdate` the server warns that it needs re-issuing.
const CRL_WARN_BEFORE: Duration = Duration::from_secs(24 * 3600);

/// The log lines about the CRLs' earliest `nextUpdate`, each once per `nextUpdate`: a warning a
/// day before it, an error once it passed. rustls refuses every device certificate of the
/// CRL's CA from then on (`UnknownCA`), and a list that does not change is not read again: only
/// a new CRL helps.
#[derive(Debug, Default)]
struct CrlExpiry {
    warned: Option<i64>,
    expired: Option<i64>,
}

/// What [`CrlExpiry::check`] logged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CrlAlarm {
    Soon,
    Expired,
}

impl CrlExpiry {
    fn check(&mut self, next_update: Option<(i64, &str)>, now: std::time::SystemTime) -> Option<CrlAlarm> {
        let (at, crl) = next_update?;
        let when = u64::try_from(at).map_or_else(
            |_| at.to_string(),
            |secs| humantime::format_rfc3339_seconds(std::time::UNIX_EPOCH + Duration::from_secs(secs)).to_string(),
        );
        let now =
            now.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| i64::try_from(d.as_secs()).unwrap_or(i64::MAX));
        let left = at.saturating_sub(now);
        if left <= 0 {
            if self.expired != Some(at) {
                self.expired = Some(at);
                error!(
                    %crl,
                    next_update = %when,
                    "a revocation list (tls.crls) is past its nextUpdate: every device certificate of its CA is refused at the handshake until a new CRL is written in its place (`edge-ingest pki crl` re-issues one)"
                );
                return Some(CrlAlarm::Expired);
            }
        } else if u64::try_from(left).is_ok_and(|l| l <= CRL_WARN_BEFORE.as_secs()) && self.warned != Some(at) {
            self.warned = Some(at);
            warn!(
                %crl,
                next_update = %when,
                seconds_left = left,
                "a revocation list (tls.crls) reaches its nextUpdate within a day; past it every device certificate of its CA is refused at the handshake: write a new CRL in its place (`edge-ingest pki crl` re-issues one)"
            );
            return Some(CrlAlarm::Soon);
        }
        None
    }
}

/// Reloads the revocation state when its files change or on SIGHUP (see [`RevocationWatch`]).
async fn watch_revocations(
    endpoint: quinn::Endpoint,
    shared: Arc<Shared>,
    watch: RevocationWatch,
    mut seen: FileState,
    mut hangup: Option<tokio::signal::unix::Signal>,
) {
    let mut tick = tokio::time::interval(watch.interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.reset(); // The first check is one interval after start, not at once.
    // The file state whose load failed last, so each bad state is reported once while it is
    // retried at every check (a file caught half-written loads at the next one).
    let mut failed: Option<FileState> = None;
    let mut expiry = CrlExpiry::default();
    loop {
        let forced = tokio::select! {
            () = shared.cancel.cancelled() => break,
            _ = tick.tick() => false,
            Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => std::future::pending().await } } => true,
        };
        let next_update = {
            let list = shared.revoked.read().unwrap_or_else(PoisonError::into_inner);
            list.next_update_unix().zip(list.next_update_origin().map(ToString::to_string))
        };
        let _logged = expiry.check(next_update.as_ref().map(|(t, o)| (*t, o.as_str())), std::time::SystemTime::now());
        let now = FileState::of(&watch.tls);
        if !forced && now == seen && failed.is_none() {
            continue;
        }
        let tls = watch.tls.clone();
        let tuning = watch.tuning.clone();
        let loaded = tokio::task::spawn_blocking(move || {
            let list = RevocationList::load(&tls.client_ca, &tls.crls)?;
            // Built only once the list is known good; a failure here keeps the old TLS config
            // but still applies the list (the post-handshake check enforces it).
            let config = edge_transport::server_config(&tls, &tuning);
            Ok::<_, edge_transport::tls::RevocationError>((list, config))
        })
        .await;
        match loaded {
            Ok(Ok((list, config))) => {
                seen = now;
                failed = None;
                match config {
                    Ok(mut config) => {
                        config.migration(watch.allow_migration);
                        endpoint.set_server_config(Some(config));
                    }
                    Err(e) => {
                        error!(error = %e, "TLS config not rebuilt after a revocation list change; new handshakes use the previous CRLs, the new list is enforced after them")
                    }
                }
                let list = Arc::new(list);
                *shared.revoked.write().unwrap_or_else(PoisonError::into_inner) = list.clone();
                shared.counters.crl_next_update_unix.store(next_update_gauge(&list), Ordering::Relaxed);
                shared.counters.crl_reloads_total.fetch_add(1, Ordering::Relaxed);
                info!(crls = list.crl_count(), revoked = list.len(), "revocation lists reloaded");
                // Close outside the lock: `close` only queues a CONNECTION_CLOSE, but the
                // connection tasks take the same lock when they end.
                let live: Vec<(String, Vec<u8>, quinn::Connection)> =
                    shared.live.lock().values().map(|c| (c.device.clone(), c.cert.clone(), c.conn.clone())).collect();
                for (device, cert, conn) in live {
                    close_if_revoked(&shared, &list, &device, &cert, &conn);
                }
            }
            Ok(Err(e)) => {
                if forced || failed.as_ref() != Some(&now) {
                    // Logged before counted: whoever sees the count also finds the log line.
                    error!(error = %e, "revocation lists not reloaded; the previous list stays in force");
                    shared.counters.crl_reload_failures_total.fetch_add(1, Ordering::Relaxed);
                }
                failed = Some(now);
            }
            Err(e) => error!(error = %e, "revocation reload task failed"),
        }
    }
}

/// The per-connection state shared by the control task and chunk tasks.
struct ConnState {
    session: ServerSession,
    /// Bytes waiting to be written on the control stream.
    outbox: Outbox,
    /// The refusals on this connection that vouch for the agent's floors.
    refused: Refusals,
}

/// Per stream, the highest seq answered `Retry(Overloaded)` or `Retry(Limit)` on one
/// connection, for at most [`Floors::MAX_STREAMS`] streams. An agent sends its stream's floor
/// when a chunk is answered `Retry(Overloaded)`, and the floor is the lowest seq it may still
/// send, that chunk's at most. A floor above every refused seq (an agent's bug) would make the
/// store count seqs never sent as stored, and answer the chunks that carry them `Duplicate`:
/// such a floor is not vouched for.
#[derive(Debug, Default)]
struct Refusals {
    top: HashMap<StreamName, u64>,
    /// A refusal of a stream past the bound was not noted: floors of unnoted streams are
    /// taken as they come, as before the check.
    untracked: bool,
}

impl Refusals {
    /// Whether a floor of `seq` for `stream` follows a refusal on this connection.
    fn vouch(&self, stream: &StreamName, seq: u64) -> bool {
        match self.top.get(stream) {
            Some(&refused) => seq <= refused,
            None => self.untracked,
        }
    }

    /// Notes that `seq` of `stream` was answered a `Retry` an agent answers with a floor
    /// (`Overloaded`; an agent of protocol version 3 or later is told `Limit` where an older
    /// one is told `Overloaded`, and both are noted).
    fn note(&mut self, stream: &StreamName, seq: u64) {
        let full = self.top.len() >= Floors::MAX_STREAMS;
        match self.top.get_mut(stream) {
            Some(top) => *top = (*top).max(seq),
            None if full => self.untracked = true,
            None => {
                self.top.insert(stream.clone(), seq);
            }
        }
    }
}

impl ConnState {
    fn flush(&mut self) {
        while let Some(bytes) = self.session.poll_transmit() {
            self.outbox.queue(bytes);
        }
    }
}

/// The control stream's queue to its writer task, with the bytes in it counted and bounded (see
/// [`ack_backlog_limit`]).
struct Outbox {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    /// Bytes handed to `tx` that the writer has not yet written into the stream's QUIC send
    /// buffer (added here, subtracted by the writer once `write_all` returns).
    queued: Arc<AtomicUsize>,
    /// The most `queued` may reach.
    limit: usize,
    /// Cancelled when `queued` would pass `limit`: the agent does not read its control stream,
    /// and the connection task closes the connection.
    overflow: CancellationToken,
}

impl Outbox {
    fn queue(&self, bytes: Vec<u8>) {
        if self.overflow.is_cancelled() {
            // The connection is being closed; these bytes would never be read.
            return;
        }
        let len = bytes.len();
        if self.queued.load(Ordering::Acquire).saturating_add(len) > self.limit {
            self.overflow.cancel();
            return;
        }
        self.queued.fetch_add(len, Ordering::AcqRel);
        // The receiver lives as long as the connection; a send error means it is closing.
        let _closing = self.tx.send(bytes);
    }
}

/// Control-stream bytes queued per chunk the agent may have in flight, past which the server
/// takes the agent for one that does not read its acks (see [`ack_backlog_limit`]).
const ACK_BACKLOG_PER_CHUNK: usize = 1024;
/// Control-stream bytes a connection may always have queued, however small its `max_in_flight`.
const ACK_BACKLOG_MIN: usize = 64 * 1024;

/// The most bytes of acks (and Welcome, GoAway) a connection may have waiting for its agent to
/// read them before the server closes it (`ProtocolViolation`, counted in
/// `protocol_errors_total`).
///
/// `ServerSession::ack` frees a chunk's in-flight slot as soon as its ack is queued, not when the
/// agent reads it, and the control writer waits for the agent's flow-control window. So an agent
/// that never reads its control stream could keep sending chunks (cheap ones, even rejected:
/// the connection stays open) and grow the queue of acks without bound. An agent that reads its
/// acks never comes near the limit: it sends a chunk only while its window of `max_in_flight`
/// unanswered chunks has room, and gets room back only by reading an ack, so it never has more
/// than `max_in_flight` acks unread wherever they wait (this queue, QUIC's buffers, its own),
/// besides one Welcome and one GoAway. An ack frame is at most 79 bytes (5 of frame header, a
/// stream name of at most 64 bytes and its length, `seq`, status) and a Welcome at most 271, so
/// 1 KiB per chunk in flight, and at least 64 KiB, is over ten times what such an agent can
/// leave unread. Closing loses nothing: chunks stored stay stored, and the agent offers every
/// chunk it has no ack for again on its next connection (a stored one is then a `Duplicate`).
fn ack_backlog_limit(max_in_flight: u32) -> usize {
    usize::try_from(max_in_flight.max(1))
        .unwrap_or(usize::MAX)
        .saturating_mul(ACK_BACKLOG_PER_CHUNK)
        .max(ACK_BACKLOG_MIN)
}

/// Serves connection number `id` (see [`LiveConnections::next`]).
async fn serve_connection(id: u64, conn: quinn::Connection, shared: Arc<Shared>) {
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
    // Registered before the check, so a list swapped in meanwhile is applied by either this
    // check or the reloader's sweep.
    let cert = edge_transport::peer::peer_certificate(&conn).map(|c| c.to_vec()).unwrap_or_default();
    // TLS checked the validity period at the handshake, but a resumed session asks for no
    // certificate: it carries the one of its first handshake, expired since or not.
    let valid_until = match edge_transport::certificate_valid_until(&cert, SystemTime::now()) {
        Ok(t) => t,
        Err(e) => {
            shared.counters.auth_failures_total.fetch_add(1, Ordering::Relaxed);
            warn!(%device, %remote, error = %e, "device certificate not valid now (a resumed TLS session); closing");
            conn.close(ErrorCode::Unauthorized.to_u32().into(), expired_reason(&device).as_bytes());
            return;
        }
    };
    let live = shared.live.insert(id, &device, cert.clone(), valid_until, &conn);
    if close_if_revoked(&shared, &shared.revocation_list(), &device, &cert, &conn) {
        shared.counters.auth_failures_total.fetch_add(1, Ordering::Relaxed);
        return;
    }
    shared.counters.connections_total.fetch_add(1, Ordering::Relaxed);
    shared.counters.connections_open.fetch_add(1, Ordering::Relaxed);
    let registration = shared.counters.devices.connect(&device, remote, crate::status::now_ms());
    let result = run_connection(&conn, &device, &shared, registration.stored(), &live).await;
    drop(registration);
    shared.counters.connections_open.fetch_sub(1, Ordering::Relaxed);
    match result {
        Ok(()) => debug!(%device, %remote, "connection ended"),
        Err(ConnEnd::Protocol(e)) => {
            shared.counters.protocol_errors_total.fetch_add(1, Ordering::Relaxed);
            warn!(%device, %remote, code = %e.code(), error = %e, "protocol violation, closing connection");
            conn.close(e.code().to_u32().into(), e.to_string().as_bytes());
        }
        Err(ConnEnd::AcksUnread { queued, limit }) => {
            shared.counters.protocol_errors_total.fetch_add(1, Ordering::Relaxed);
            warn!(%device, %remote, queued, limit, "the agent does not read its acks, closing connection");
            let reason = format!("the agent does not read its acks ({queued} bytes of them queued)");
            conn.close(ErrorCode::ProtocolViolation.to_u32().into(), reason.as_bytes());
        }
        Err(ConnEnd::Lost(e)) => info!(%device, %remote, error = %e, "connection lost"),
    }
}

enum ConnEnd {
    Protocol(ProtoError),
    /// The control stream's queue passed [`ack_backlog_limit`]: the agent does not read it.
    AcksUnread {
        queued: usize,
        limit: usize,
    },
    Lost(String),
}

impl From<ProtoError> for ConnEnd {
    fn from(e: ProtoError) -> Self {
        ConnEnd::Protocol(e)
    }
}

async fn run_connection(
    conn: &quinn::Connection,
    device: &str,
    shared: &Arc<Shared>,
    stored: Arc<ConnStored>,
    live: &LiveGuard<'_>,
) -> Result<(), ConnEnd> {
    let limits = shared.opts.limits.clone();
    // One deadline for the whole handshake, counted from the connection's start.
    let deadline = tokio::time::Instant::now() + limits.handshake_timeout;
    // Chunk streams that arrive before the Hello wait here and are read once it is in: an agent
    // may open them right behind its Hello (QUIC does not order streams against each other),
    // within the limits of an earlier Welcome. At most `max_in_flight` of them, as after it.
    let max_held = shared.opts.max_in_flight.max(1);
    let mut held: Vec<quinn::RecvStream> = Vec::new();
    let (mut ctl_send, mut ctl_recv) = loop {
        tokio::select! {
            biased;
            r = conn.accept_bi() => break r.map_err(|e| ConnEnd::Lost(e.to_string()))?,
            r = conn.accept_uni() => hold(&mut held, max_held, r, &shared.counters)?,
            () = tokio::time::sleep_until(deadline) => {
                return Err(ProtoError::HandshakeTimeout.into());
            }
        }
    };
    // Unbounded, so that queueing an ack never waits on the agent; what it holds is bounded by
    // `ack_backlog_limit` instead (the connection is closed past it).
    let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let queued = Arc::new(AtomicUsize::new(0));
    let backlog_limit = ack_backlog_limit(shared.opts.max_in_flight);
    let overflow = CancellationToken::new();
    let state = Arc::new(Mutex::new(ConnState {
        session: ServerSession::new(device.to_owned(), limits.clone(), shared.opts.max_in_flight, Instant::now()),
        outbox: Outbox { tx: out_tx, queued: queued.clone(), limit: backlog_limit, overflow: overflow.clone() },
        refused: Refusals::default(),
    }));

    // Control writer: the only task that writes to the control stream.
    let written = queued.clone();
    let mut writer = tokio::spawn(async move {
        while let Some(bytes) = out_rx.recv().await {
            if ctl_send.write_all(&bytes).await.is_err() {
                break;
            }
            written.fetch_sub(bytes.len(), Ordering::AcqRel);
        }
        let _already_closed = ctl_send.finish();
    });

    // Handshake: read until the session has seen Hello.
    let mut early_floors = Vec::new();
    let spool_id = {
        let mut buf = vec![0u8; 4096];
        loop {
            let n = tokio::select! {
                biased;
                r = ctl_recv.read(&mut buf) => r.map_err(|e| ConnEnd::Lost(e.to_string()))?,
                r = conn.accept_uni() => {
                    hold(&mut held, max_held, r, &shared.counters)?;
                    continue;
                }
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
                match ev {
                    ServerEvent::Hello { spool_id, agent, version } => {
                        info!(%device, spool = %hex(&spool_id), %agent, version, early_chunks = held.len(), "agent connected");
                        hello = Some(spool_id);
                    }
                    // Only after the Hello (the session sees to it), which may share a read:
                    // applied once this connection stands (below).
                    ServerEvent::Floor { stream, seq } => early_floors.push((stream, seq)),
                }
            }
            if let Some(id) = hello {
                break id;
            }
        }
    };
    let Ok(older) = live.hello(spool_id) else {
        info!(%device, spool = %hex(&spool_id), remote = %conn.remote_address(), "closing this connection: the agent has a newer one");
        shared.counters.superseded_total.fetch_add(1, Ordering::Relaxed);
        conn.close(ErrorCode::NoError.to_u32().into(), SUPERSEDED);
        return Err(ConnEnd::Lost("superseded by a newer connection of the same agent".into()));
    };
    for old in older {
        info!(%device, spool = %hex(&spool_id), old = %old.remote_address(), new = %conn.remote_address(), "closing the agent's older connection: superseded by this one");
        shared.counters.superseded_total.fetch_add(1, Ordering::Relaxed);
        old.close(ErrorCode::NoError.to_u32().into(), SUPERSEDED);
    }
    let cancel = shared.cancel.clone();
    let chunk_tasks = TaskTracker::new();
    // A device may hold at most an eighth of the server-wide budget (and always one
    // maximum-size chunk), over all of its connections, so one agent cannot starve the others.
    let device_kib = (shared.opts.memory_budget / 8).max(u64::from(limits.max_chunk_payload)).div_ceil(1024);
    let device_kib = usize::try_from(device_kib).unwrap_or(usize::MAX).min(Semaphore::MAX_PERMITS);
    let device_budget = shared.device_budget(device, device_kib);
    // The most one chunk takes from either budget (see `chunk_permits`).
    let max_chunk_kib = u32::try_from(device_kib.min(shared.budget_kib)).unwrap_or(u32::MAX);
    let (fail_tx, mut fail_rx) = mpsc::unbounded_channel::<ProtoError>();
    let ctx = || ChunkCtx {
        device: device.to_owned(),
        stored: stored.clone(),
        device_budget: device_budget.clone(),
        max_chunk_kib,
        spool_id,
        state: state.clone(),
        shared: shared.clone(),
        fail: fail_tx.clone(),
    };
    // The chunks that came before the Hello, in the order they arrived.
    for recv in held {
        chunk_tasks.spawn(handle_chunk_stream(recv, ctx()));
    }
    let mut floors = Floors::default();
    for (stream, seq) in early_floors {
        // Behind the Hello, before any answer: vouched for by no refusal.
        if !lock(&state).refused.vouch(&stream, seq) {
            warn!(%device, %stream, seq, "floor sent before any chunk of its stream was answered retry on this connection; ignored");
            continue;
        }
        if floors.raise(&stream, seq) {
            shared.store.raise_floor(device, spool_id, stream.as_str(), seq).await;
        }
    }
    let result = loop {
        let mut buf = [0u8; 1024];
        tokio::select! {
            () = cancel.cancelled() => {
                lock(&state).session.go_away(ErrorCode::ShuttingDown);
                lock(&state).flush();
                break Ok(());
            }
            Some(e) = fail_rx.recv() => break Err(ConnEnd::Protocol(e)),
            () = overflow.cancelled() => {
                break Err(ConnEnd::AcksUnread { queued: queued.load(Ordering::Acquire), limit: backlog_limit });
            }
            r = ctl_recv.read(&mut buf) => match r {
                // After the Hello the agent sends only floors; anything else is a violation
                // that the session turns into an error, which closes the connection.
                Ok(Some(n)) => {
                    let mut raised = Vec::new();
                    {
                        let mut st = lock(&state);
                        st.session.handle_control_bytes(Instant::now(), &buf[..n])?;
                        st.flush();
                        while let Some(ev) = st.session.poll_event() {
                            let ServerEvent::Floor { stream, seq } = ev else { continue };
                            if !st.refused.vouch(&stream, seq) {
                                warn!(%device, %stream, seq, refused = ?st.refused.top.get(&stream), "floor above every seq of its stream answered retry on this connection; ignored");
                            } else if floors.raise(&stream, seq) {
                                raised.push((stream, seq));
                            }
                        }
                    }
                    // Each floor is waited for, so a connection has at most one in the store
                    // thread's queue: an agent sending floor after rising floor is held back
                    // by the store, not queued without bound.
                    for (stream, seq) in raised {
                        shared.store.raise_floor(device, spool_id, stream.as_str(), seq).await;
                    }
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(ConnEnd::Lost(e.to_string())),
            },
            r = conn.accept_uni() => match r {
                Ok(recv) => {
                    chunk_tasks.spawn(handle_chunk_stream(recv, ctx()));
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

/// The floors a connection passed to the sink, so that only a higher one per stream goes on,
/// for at most [`Floors::MAX_STREAMS`] streams: a floor costs the store thread a queued message,
/// and a device repeating them must not flood it. (Rising floors pass; the connection waits for
/// each to be applied before it reads on, so they are never more than one in the queue.) One
/// dropped is harmless: the agent sends it again on a later refusal or connection.
#[derive(Debug, Default)]
struct Floors(HashMap<StreamName, u64>);

impl Floors {
    const MAX_STREAMS: usize = 4096;

    /// Whether `seq` is a new floor of `stream` to pass on.
    fn raise(&mut self, stream: &StreamName, seq: u64) -> bool {
        let full = self.0.len() >= Self::MAX_STREAMS;
        match self.0.get_mut(stream) {
            Some(last) if *last >= seq => false,
            Some(last) => {
                *last = seq;
                true
            }
            None if full => false,
            None => {
                self.0.insert(stream.clone(), seq);
                true
            }
        }
    }
}

/// Keeps a chunk stream that arrived before the Hello, at most `max` of them.
fn hold(
    held: &mut Vec<quinn::RecvStream>,
    max: u32,
    accepted: Result<quinn::RecvStream, quinn::ConnectionError>,
    counters: &ServerCounters,
) -> Result<(), ConnEnd> {
    let recv = accepted.map_err(|e| ConnEnd::Lost(e.to_string()))?;
    if held.len() >= max as usize {
        return Err(ProtoError::TooManyInFlight { max }.into());
    }
    counters.early_chunk_streams_total.fetch_add(1, Ordering::Relaxed);
    held.push(recv);
    Ok(())
}

struct ChunkCtx {
    device: String,
    /// This connection's stored totals (for `status`).
    stored: Arc<ConnStored>,
    /// This device's share of the payload memory budget (KiB permits), shared by its
    /// connections.
    device_budget: Arc<Semaphore>,
    /// The most permits one chunk takes from either budget: the smaller one's size.
    max_chunk_kib: u32,
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
    // 1. Header: read until it decodes; the decoder refuses oversized declared lengths. A
    //    header trickled byte by byte (slowloris) must arrive within the fixed allowance; the
    //    stream is then stopped, so it holds no task or stream slot for longer.
    let mut head = BytesMut::with_capacity(256);
    let max_head = limits.max_chunk_header as usize + 16;
    let header_deadline = tokio::time::Instant::now() + PAYLOAD_ALLOWANCE;
    let (header, consumed) = loop {
        if let Some(found) = ChunkHeader::decode(&head, limits)? {
            break found;
        }
        if head.len() > max_head {
            return Err(ProtoError::FrameTooLarge { len: head.len() as u64, max: max_head as u64 }.into());
        }
        let read = recv.read_chunk(max_head.saturating_sub(head.len()).max(1), true);
        match tokio::time::timeout_at(header_deadline, read).await {
            Ok(Ok(Some(c))) => head.extend_from_slice(&c.bytes),
            Ok(Ok(None)) => return Err(ChunkEnd::Stream("stream finished inside the chunk header".into())),
            Ok(Err(e)) => return Err(ChunkEnd::Stream(e.to_string())),
            Err(_elapsed) => {
                let _gone = recv.stop(0u32.into());
                return Err(ChunkEnd::Stream(format!("chunk header incomplete after {PAYLOAD_ALLOWANCE:?}")));
            }
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

    // 2. Payload, under two memory budgets: this device's share, waited for (a greedy or
    //    stalled device only slows itself), and the server-wide budget, waited for briefly
    //    before the agent is told to retry later. The payload must then arrive at a minimum
    //    rate on the whole, and with no pause of `payload_stall`, so a stalled stream cannot
    //    hold its budget for long. The permits cover what the chunk holds until it is
    //    answered, its decoded copy too where the sink makes one.
    let payload_len = header.payload_len as usize;
    let kib = chunk_permits(&header, sink_decodes(&ctx.shared.store), ctx.max_chunk_kib);
    let Ok(_device_permit) = ctx.device_budget.clone().acquire_many_owned(kib).await else {
        return Err(ChunkEnd::Stream("connection closing".into()));
    };
    let _permit = match tokio::time::timeout(OVERLOAD_WAIT, ctx.shared.budget.clone().acquire_many_owned(kib)).await {
        Ok(Ok(p)) => p,
        Ok(Err(_closed)) => return Err(ChunkEnd::Stream("server shutting down".into())),
        Err(_elapsed) => {
            let _gone = recv.stop(STOP_ANSWERED.into());
            debug!(device = %ctx.device, stream = %key_stream, seq, "memory budget exhausted; asking the agent to retry");
            return send_ack(ctx, &key_stream, seq, AckStatus::Retry(RetryReason::Overloaded));
        }
    };
    // One byte of room past the announced length, so a longer stream shows as one (and fails
    // verification) without reading the rest of it. The budget above already counts these bytes.
    let mut payload = BytesMut::with_capacity(payload_len + 1);
    payload.extend_from_slice(&head[consumed..]);
    // One timer for the whole payload: a timeout per read registered and removed a timer for
    // every packet's worth of data, 8 % of the server's CPU while receiving. (`read_chunk`
    // rather than `read_buf`: the same one copy, and quinn's reassembly heap cost a third as
    // much in the profiles.)
    // The same one timer checks for a pause: it fires every `payload_stall` (or at the
    // deadline), and the payload must have grown since it last fired.
    let deadline = tokio::time::Instant::now() + payload_deadline(payload_len);
    let stall = ctx.shared.opts.payload_stall.max(Duration::from_millis(10));
    let too_slow = tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + stall));
    tokio::pin!(too_slow);
    let mut grown_from = payload.len();
    while payload.len() <= payload_len {
        let room = payload_len + 1 - payload.len();
        tokio::select! {
            biased;
            read = recv.read_chunk(room, true) => match read {
                Ok(Some(c)) => payload.extend_from_slice(&c.bytes),
                Ok(None) => break,
                Err(e) => return Err(ChunkEnd::Stream(e.to_string())),
            },
            () = &mut too_slow => {
                let now = tokio::time::Instant::now();
                let paused = payload.len() == grown_from;
                if now < deadline && !paused {
                    grown_from = payload.len();
                    too_slow.as_mut().reset(deadline.min(now + stall));
                    continue;
                }
                let _gone = recv.stop(STOP_ANSWERED.into());
                let why = if paused { "no payload byte for a while" } else { "too slow" };
                warn!(device = %ctx.device, stream = %key_stream, seq, received = payload.len(), payload_len, stall = ?stall, "chunk payload {why}; asking the agent to retry");
                return send_ack(ctx, &key_stream, seq, AckStatus::Retry(RetryReason::Overloaded));
            }
        }
    }
    // Its CRC-32C is computed here, once, for this check and the store's.
    let payload = Payload::new(payload.freeze());
    let received = Instant::now();

    // 3. Verify: exact length, checksum, record framing.
    let status = if let Err(e) = header.verify_payload_summary(payload.len(), payload.crc32c()) {
        warn!(device = %ctx.device, stream = %key_stream, seq, error = %e, "chunk failed verification");
        AckStatus::Rejected(e.reject_reason().unwrap_or(RejectReason::Malformed))
    } else if let Err(e) = edge_proto::records::check_payload(header.codec, &payload, header.raw_len, header.records) {
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
                let s = &ctx.stored;
                s.chunks.fetch_add(1, Ordering::Relaxed);
                s.records.fetch_add(u64::from(header.records), Ordering::Relaxed);
                s.bytes.fetch_add(payload.len() as u64, Ordering::Relaxed);
                AckStatus::Stored
            }
            PersistOutcome::Duplicate => {
                ctx.shared.counters.chunks_duplicate_total.fetch_add(1, Ordering::Relaxed);
                AckStatus::Duplicate
            }
            PersistOutcome::Failed(f) => {
                let status = match f {
                    StoreFailure::DiskFull
                    | StoreFailure::Io(_)
                    | StoreFailure::ReadOnly
                    | StoreFailure::Unavailable(_) => AckStatus::Retry(RetryReason::SinkUnavailable),
                    StoreFailure::Rejected(_) => AckStatus::Rejected(RejectReason::Malformed),
                    // The device's own doing: the agent keeps the chunk and slows down.
                    StoreFailure::IndexFull { .. } => AckStatus::Retry(RetryReason::Overloaded),
                    // Until an operator raises the cap; the session tells an agent older than
                    // the reason "overloaded".
                    StoreFailure::TooManyStreams { .. } => AckStatus::Retry(RetryReason::Limit),
                };
                if matches!(f, StoreFailure::IndexFull { .. } | StoreFailure::TooManyStreams { .. }) {
                    // Logged by the store once per device.
                    debug!(device = %ctx.device, stream = %key_stream, seq, failure = %f, "store refused chunk");
                } else {
                    warn!(device = %ctx.device, stream = %key_stream, seq, failure = ?f, "store could not persist chunk");
                }
                status
            }
        }
    };
    send_ack(ctx, &key_stream, seq, status)
}

/// Whether `sink` holds a compressed chunk decoded, beside its payload, until it answers: the
/// JetStream sink publishes decoded records (decoded whole, up to `Limits::max_raw_len`), the
/// file store keeps the payload as it came (its check decodes through a small buffer).
fn sink_decodes(sink: &Sink) -> bool {
    match sink {
        Sink::Files(_) => false,
        Sink::JetStream(_) => true,
    }
}

/// The KiB permits a chunk takes from both memory budgets, from its header alone: its payload
/// buffer (`payload_len`, at least 1 KiB), and, when the sink decodes it (`sink_decodes`) and
/// it is compressed, its decoded copy too (`raw_len` bytes, held beside the payload until the
/// sink answers).
///
/// The decoded case is clamped to `max_kib`, the size of the smaller budget (usually the
/// device's share, which is at least one `max_chunk_payload`, and no more than the server's
/// budget since the config requires `memory_budget >= max_chunk_bytes`). So a chunk whose
/// decoded size is more than that still proceeds, as a maximum-size payload always can: it
/// takes all of it, and so is alone on its device's connections while it is held. What it
/// decodes past its permits is bounded by `Limits::max_raw_len`, one such chunk per device at a
/// time.
/// The payload's own permits are never clamped, as before.
fn chunk_permits(header: &ChunkHeader, sink_decodes: bool, max_kib: u32) -> u32 {
    let payload_kib = header.payload_len.div_ceil(1024).max(1);
    if !sink_decodes || header.codec == Codec::None {
        return payload_kib;
    }
    let held = (u64::from(header.payload_len) + u64::from(header.raw_len)).div_ceil(1024);
    u32::try_from(held).unwrap_or(u32::MAX).min(max_kib).max(payload_kib)
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
    if let AckStatus::Retry(RetryReason::Overloaded | RetryReason::Limit) = status {
        st.refused.note(stream, seq);
    }
    st.flush();
    Ok(())
}

/// The close reason of a connection its agent replaced (see `LiveGuard::hello`).
const SUPERSEDED: &[u8] = edge_proto::SUPERSEDED_REASON;

/// How long the server waits for server-wide memory before answering `Retry(Overloaded)`.
const OVERLOAD_WAIT: Duration = Duration::from_secs(1);
/// Slowest payload rate tolerated (bytes per second), on top of a fixed allowance.
const MIN_PAYLOAD_RATE: u64 = 16 * 1024;
const PAYLOAD_ALLOWANCE: Duration = Duration::from_secs(10);

/// Time allowed for a payload of `len` bytes to arrive.
fn payload_deadline(len: usize) -> Duration {
    PAYLOAD_ALLOWANCE + Duration::from_secs(len as u64 / MIN_PAYLOAD_RATE)
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

/// A spool id from its 32 hex digits (either case), as [`hex`] writes it; the error names what
/// is wrong with `text`.
pub fn parse_spool_id(text: &str) -> Result<[u8; 16], String> {
    let digits = text.as_bytes();
    if digits.len() != 32 {
        return Err(format!("spool id {text:?} is {} characters; it is 32 hex digits", digits.len()));
    }
    let mut id = [0u8; 16];
    for (byte, pair) in id.iter_mut().zip(digits.chunks_exact(2)) {
        // `from_str_radix` alone would take a sign ("+f").
        let pair = std::str::from_utf8(pair)
            .ok()
            .filter(|p| p.bytes().all(|b| b.is_ascii_hexdigit()))
            .and_then(|p| u8::from_str_radix(p, 16).ok());
        *byte = pair.ok_or_else(|| format!("spool id {text:?} is not 32 hex digits"))?;
    }
    Ok(id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refusals_vouch_for_floors_up_to_the_refused_seq_and_past_their_bound_for_all() {
        let name = |s: &str| StreamName::new(s).expect("valid name");
        let mut r = Refusals::default();
        assert!(!r.vouch(&name("a"), 0), "nothing refused yet");
        r.note(&name("a"), 7);
        r.note(&name("a"), 5);
        assert!(r.vouch(&name("a"), 7) && r.vouch(&name("a"), 1));
        assert!(!r.vouch(&name("a"), 8), "above the highest refused seq");
        assert!(!r.vouch(&name("b"), 1), "another stream");
        for i in 1..Floors::MAX_STREAMS {
            r.note(&name(&format!("s{i}")), 1);
        }
        assert!(!r.vouch(&name("b"), 1), "at the bound, every refusal still noted");
        r.note(&name("past-the-bound"), 3);
        assert!(r.vouch(&name("b"), 100), "one refusal not noted: an unnoted stream's floor is taken");
        assert!(!r.vouch(&name("a"), 8), "a noted stream is still checked");
    }

    #[test]
    fn a_crl_near_or_past_its_next_update_is_logged_once_each() {
        let at = |secs: u64| std::time::UNIX_EPOCH + Duration::from_secs(secs);
        let day = CRL_WARN_BEFORE.as_secs();
        let next = 10 * day;
        let mut e = CrlExpiry::default();
        assert_eq!(e.check(None, at(next)), None, "no CRL, nothing to say");
        let next_i = i64::try_from(next).expect("i64");
        let crl = |t: i64| Some((t, "file /etc/edge-ingest/tls/crl.pem"));
        assert_eq!(e.check(crl(next_i), at(next - day - 1)), None, "more than a day left");
        assert_eq!(e.check(crl(next_i), at(next - day)), Some(CrlAlarm::Soon));
        assert_eq!(e.check(crl(next_i), at(next - 1)), None, "said once");
        assert_eq!(e.check(crl(next_i), at(next)), Some(CrlAlarm::Expired));
        assert_eq!(e.check(crl(next_i), at(next + day)), None, "said once");
        // A new list that is about to expire too.
        assert_eq!(e.check(crl(next_i + 60), at(next + 1)), Some(CrlAlarm::Soon));
    }

    #[test]
    fn a_connection_passes_on_only_higher_floors_for_a_bounded_number_of_streams() {
        let name = |s: &str| StreamName::new(s).expect("valid name");
        let mut f = Floors::default();
        assert!(f.raise(&name("a"), 5));
        assert!(!f.raise(&name("a"), 5), "the same floor again");
        assert!(!f.raise(&name("a"), 3), "a lower one");
        assert!(f.raise(&name("a"), 9));
        for i in 1..Floors::MAX_STREAMS {
            assert!(f.raise(&name(&format!("s{i}")), 1));
        }
        assert!(!f.raise(&name("one-too-many"), 1), "past the bound: dropped");
        assert!(f.raise(&name("a"), 10), "a known stream still moves");
    }

    #[test]
    fn handshakes_are_accepted_then_address_validated_then_refused() {
        // Below half the limit everyone is accepted.
        assert_eq!(admission(0, 256, false, true), Admission::Accept);
        assert_eq!(admission(127, 256, false, true), Admission::Accept);
        // From half of it, unvalidated addresses are asked to retry; validated ones pass.
        assert_eq!(admission(128, 256, false, true), Admission::Retry);
        assert_eq!(admission(128, 256, true, false), Admission::Accept);
        // quinn cannot Retry a Retry: then the attempt is accepted while there is room.
        assert_eq!(admission(200, 256, false, false), Admission::Accept);
        // At the limit, everyone is refused.
        assert_eq!(admission(256, 256, true, false), Admission::Refuse);
        assert_eq!(admission(9, 1, false, true), Admission::Refuse);
        assert_eq!(admission(0, 0, false, true), Admission::Accept, "0 is treated as 1");
    }

    #[test]
    fn a_device_is_listed_while_any_of_its_connections_is_open() {
        let devices = ConnectedDevices::default();
        let a: SocketAddr = "10.0.0.1:1000".parse().expect("addr");
        let b: SocketAddr = "10.0.0.2:2000".parse().expect("addr");
        let first = devices.connect("gw-1", a, 100);
        first.stored().chunks.fetch_add(2, Ordering::Relaxed);
        let second = devices.connect("gw-1", b, 200);
        second.stored().records.fetch_add(7, Ordering::Relaxed);
        let other = devices.connect("gw-0", a, 300);
        let snap = devices.snapshot();
        assert_eq!(snap.iter().map(|d| d.device.as_str()).collect::<Vec<_>>(), ["gw-0", "gw-1"]);
        let gw1 = &snap[1];
        assert_eq!((gw1.connections, gw1.since_ms, gw1.remote.as_str()), (2, 100, "10.0.0.2:2000"));
        assert_eq!((gw1.chunks_stored, gw1.records_stored), (2, 7));
        drop(first);
        let snap = devices.snapshot();
        assert_eq!((snap[1].connections, snap[1].since_ms, snap[1].chunks_stored), (1, 200, 0));
        drop(second);
        drop(other);
        assert!(devices.snapshot().is_empty());
    }

    fn header(codec: Codec, payload_len: u32, raw_len: u32) -> ChunkHeader {
        ChunkHeader {
            stream: StreamName::new("s").expect("valid name"),
            seq: 0,
            records: 1,
            raw_len,
            payload_len,
            codec,
            checksum: 0,
            created_ms: 0,
        }
    }

    #[test]
    fn a_compressed_chunk_takes_its_decoded_size_too_where_the_sink_decodes_it() {
        let max = 1 << 20; // KiB: a budget far above these chunks.
        let zstd = header(Codec::Zstd, 10 * 1024, 4 << 20);
        // The JetStream sink holds the payload and its decoded copy until JetStream answers.
        assert_eq!(chunk_permits(&zstd, true, max), 10 + 4096);
        // The file store keeps the payload as it came.
        assert_eq!(chunk_permits(&zstd, false, max), 10);
        // An uncompressed payload is published as it is: nothing is decoded.
        let plain = header(Codec::None, 5000, 5000);
        assert_eq!(chunk_permits(&plain, true, max), 5);
        assert_eq!(chunk_permits(&plain, false, max), 5);
        // Rounded up, and at least 1 KiB even when empty.
        assert_eq!(chunk_permits(&header(Codec::Zstd, 1, 1024), true, max), 2);
        assert_eq!(chunk_permits(&header(Codec::None, 0, 0), true, max), 1);
    }

    #[test]
    fn a_decoded_size_over_the_budget_is_clamped_to_it_but_never_below_the_payload() {
        let limits = Limits::default();
        let most = header(Codec::Zstd, limits.max_chunk_payload, limits.max_raw_len);
        // 32 MiB + 64 MiB against a 32 MiB budget: all of it, so the chunk can still proceed.
        assert_eq!(chunk_permits(&most, true, 32 * 1024), 32 * 1024);
        assert_eq!(chunk_permits(&header(Codec::Zstd, 100, 1 << 20), true, 512), 512);
        // The payload's own permits are never clamped (the file sink is unchanged).
        assert_eq!(chunk_permits(&most, true, 1024), 32 * 1024);
        assert_eq!(chunk_permits(&most, false, 1024), 32 * 1024);
    }

    #[test]
    fn the_ack_backlog_limit_is_far_above_what_an_agent_reading_its_acks_leaves_unread() {
        // Largest ack frame: a 64-byte stream name; largest Welcome: a 255-byte device name.
        let name = StreamName::new(&"s".repeat(64)).expect("valid name");
        let mut ack = Vec::new();
        edge_proto::ControlFrame::Ack { stream: name, seq: u64::MAX, status: AckStatus::Stored }.encode(&mut ack);
        let mut welcome = Vec::new();
        edge_proto::ControlFrame::Welcome {
            version: edge_proto::VERSION,
            device: "d".repeat(255),
            max_chunk_payload: u32::MAX,
            max_in_flight: u32::MAX,
        }
        .encode(&mut welcome);
        let mut go_away = Vec::new();
        edge_proto::ControlFrame::GoAway { code: ErrorCode::ShuttingDown }.encode(&mut go_away);
        assert_eq!((ack.len(), welcome.len()), (79, 271));
        for max_in_flight in [0, 1, 8, 64, 1024, u32::MAX] {
            let unread = max_in_flight.max(1) as usize * ack.len() + welcome.len() + go_away.len();
            let limit = ack_backlog_limit(max_in_flight);
            assert!(limit >= 10 * unread.min(usize::MAX / 10), "{max_in_flight}: {limit} vs {unread}");
        }
        assert_eq!(ack_backlog_limit(1), 64 * 1024);
        assert_eq!(ack_backlog_limit(256), 256 * 1024);
    }

    fn sample(at: Instant, secs: u64, chunks: u64, batches: u64) -> Sample {
        Sample {
            at: at + Duration::from_secs(secs),
            chunks,
            records: chunks * 10,
            bytes: chunks * 100,
            store_batches: batches,
        }
    }

    #[test]
    fn rates_span_the_oldest_of_the_last_thirteen_samples() {
        let t0 = Instant::now();
        let w = RateWindow::default();
        assert_eq!(w.rates(sample(t0, 0, 5, 0)).window_s, 0.0, "no sample yet");
        for i in 0..20 {
            w.push(sample(t0, i * 5, i * 10, 1));
        }
        // Kept: samples 7..=19 (35 s..95 s); now is 100 s with 200 chunks.
        let r = w.rates(sample(t0, 100, 200, 1));
        assert_eq!(r.window_s, 65.0);
        assert!((r.chunks_per_s - 130.0 / 65.0).abs() < 1e-9, "{r:?}");
        assert!((r.records_per_s - 10.0 * r.chunks_per_s).abs() < 1e-9, "{r:?}");
        assert!((r.bytes_per_s - 100.0 * r.chunks_per_s).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn the_store_is_idle_since_the_oldest_sample_with_the_same_batch_count() {
        let t0 = Instant::now();
        let w = RateWindow::default();
        for (i, batches) in [1, 2, 3, 3, 3].into_iter().enumerate() {
            w.push(sample(t0, i as u64 * 5, 0, batches));
        }
        assert_eq!(w.store_idle(sample(t0, 25, 0, 3)), Duration::from_secs(15));
        assert_eq!(w.store_idle(sample(t0, 25, 0, 4)), Duration::ZERO);
    }

    #[test]
    fn a_spool_id_reads_back_from_its_hex_and_bad_text_is_named() {
        let id: [u8; 16] = std::array::from_fn(|i| (i as u8).wrapping_mul(37));
        assert_eq!(parse_spool_id(&hex(&id)), Ok(id));
        assert_eq!(parse_spool_id(&hex(&id).to_uppercase()), Ok(id));
        let short = parse_spool_id("abc").expect_err("too short");
        assert!(short.contains("\"abc\"") && short.contains("3 characters"), "{short}");
        let signed = format!("+f{}", &hex(&id)[2..]);
        assert!(parse_spool_id(&signed).expect_err("a sign").contains("not 32 hex digits"));
        assert!(parse_spool_id(&"é".repeat(16)).is_err());
    }
}
