//! The uploader: keeps one QUIC connection to the ingest server and up to `max_in_flight`
//! chunks (and about `max_in_flight_bytes` of payload) on parallel uni-streams, deletes a chunk
//! from the spool only after its ack, and reconnects with exponential backoff and jitter. A
//! backoff wait ends early when the gateway's link comes back (`netwatch`) or, after attempts
//! that got no answer, when the server answers a probe (`probe`).
//!
//! Per connection:
//! 1. open the control bi-stream, run the client session's handshake (Hello → Welcome). From
//!    the second connection to the same server on, the first chunks (up to [`EARLY_BYTES`],
//!    within the last Welcome's limits) go right behind the Hello instead of a round trip
//!    later, after the Welcome; the server holds chunk streams that arrive before the Hello;
//! 2. a control task feeds control bytes to the session and hands each ack to the task waiting
//!    for it;
//! 3. the scheduler reads sealed chunks from the spool in sealing order, one at a time and only
//!    while both the chunk and the byte budget have room, and starts one send task per chunk:
//!    open a uni-stream, write header and payload with `write_chunk`, finish, await the ack.
//!    Chunks answered `Retry`, and chunks whose stream failed while the connection lives on,
//!    are offered again, by id, after a backoff;
//! 4. when the connection ends, every chunk that was not acked is simply still in the spool:
//!    the next connection starts scanning from the oldest sealed chunk again.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use bytes::Bytes;
use edge_proto::client::{ClientEvent, ClientSession, EarlyLimits};
use edge_proto::{
    AckStatus, ChunkHeader, Codec, ErrorCode, Limits, MIN_VERSION, RetryReason, STOP_ANSWERED, StreamName, VERSION,
};
use edge_spool::{ChunkId, ChunkMeta, SpoolError};
use rand::Rng;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use crate::compress::{Compressed, Compressor};
use crate::config::Compression;
use crate::handoff::{Next, Payload};
use crate::netwatch::NetEvents;
use crate::spool_task::{ReaderHandle, SpoolHandle};

/// Chunk payload bytes at most sent before the Welcome, behind the Hello of a connection to a
/// server whose limits an earlier Welcome told (always at least one chunk). The congestion
/// window of a new connection (about 12 KB) lets little more go in the first round trip; the
/// rest waits in quinn, and the Welcome opens the whole window a round trip later anyway.
pub const EARLY_BYTES: u64 = 1 << 20;

/// How the quarantine reason of a chunk whose bytes failed their checksum when read begins.
/// Such a chunk may have been sent before its bytes went bad (from memory, or read earlier, with
/// the answer lost): `spool export-quarantined` warns that the ingest may hold it.
pub const QUARANTINE_CORRUPT: &str = "corrupt in spool";
/// The same for a chunk SQLite could not read.
pub const QUARANTINE_UNREADABLE: &str = "unreadable in spool";
/// In the quarantine reason of a chunk larger than the ingest takes; an ingest whose limit was
/// lowered may hold it from before.
pub const OVER_SERVER_LIMIT: &str = "over the server's limit";

/// How long after a path event (a link up, a default route; see `netwatch`) the uploader tries
/// again, drawn at random: the rest of a link's set-up (address, routes) usually lands within
/// moments and its notifications come in bursts, and gateways whose links come back together
/// (a cell's outage ending) should not all knock at once.
pub const NETWORK_SETTLE: std::ops::RangeInclusive<Duration> = Duration::from_millis(100)..=Duration::from_secs(1);

/// Everything the uploader needs, already validated.
#[derive(Debug, Clone)]
pub struct UploaderOptions {
    /// `host:port` of the ingest server; resolved at every attempt.
    pub server: String,
    /// Name checked against the server certificate.
    pub server_name: String,
    /// The TLS configuration, read again from its files when they change (`client_tls`).
    pub tls: Arc<crate::client_tls::ClientTls>,
    pub bind: SocketAddr,
    /// Chunks in flight at most; shared so a configuration reload applies to a live connection.
    pub max_in_flight: Arc<std::sync::atomic::AtomicU32>,
    /// Payload bytes in flight at most (read from the spool and not yet acked), applied
    /// together with `max_in_flight`; shared for the same reason.
    pub max_in_flight_bytes: Arc<AtomicU64>,
    /// Bound on one connection attempt (resolve and handshake); a fresh attempt follows after
    /// the backoff, rather than the stale one retransmitting its Initial ever more slowly.
    pub connect_timeout: Duration,
    pub backoff_min: Duration,
    pub backoff_max: Duration,
    pub compression: Compression,
    pub limits: Limits,
    /// How long shutdown waits for acks of chunks in flight.
    pub drain_grace: Duration,
    pub tuning: edge_transport::Tuning,
    /// Send the first chunks of a reconnection right behind its Hello, within the last
    /// Welcome's limits (see [`EARLY_BYTES`]). The daemon always does; off only to measure
    /// what it is worth (`edge-bench reconnect`).
    pub early_chunks: bool,
    /// Links coming up and default routes appearing on the gateway (`upload.watch_network`):
    /// each ends a backoff wait early. `None`: the backoff alone.
    pub network: Option<NetEvents>,
    /// After an attempt or a connection that got no answer, probe the server this often while
    /// the backoff waits (`upload.probe_interval`, see `probe`); an answer ends the wait.
    /// `None`: never.
    pub probe_interval: Option<Duration>,
}

/// Live upload state, read by `GET /v1/status`, the demo and (at scrape time) `/metrics`.
#[derive(Debug, Default)]
pub struct UploadCounters {
    pub connected: AtomicBool,
    /// The current (or last) connection, for `status`.
    pub session: Mutex<SessionInfo>,
    pub connects_total: AtomicU64,
    /// Connections the ingest closed for a newer one with this agent's device certificate and
    /// spool id, which this agent did not open: another gateway shares both.
    pub superseded_total: AtomicU64,
    /// When the last of those was closed (unix ms; 0: never).
    pub last_superseded_ms: AtomicU64,
    /// The spool id given up after the last of those, and when (unix ms); `None` when the last
    /// attempt to give it up failed.
    pub rekeyed: Mutex<Option<(String, u64)>>,
    /// Connection attempts started (each bounded by `connect_timeout`).
    pub connect_attempts_total: AtomicU64,
    /// Backoff waits ended early because a link came up or a default route appeared.
    pub network_wakeups_total: AtomicU64,
    /// Probes sent while the backoff waited (`upload.probe_interval`).
    pub probes_sent_total: AtomicU64,
    /// Backoff waits ended early because the server answered a probe.
    pub probe_wakeups_total: AtomicU64,
    /// Floors sent to the server (a stream's lowest seq still to come, after a chunk of it was
    /// answered retry, overloaded).
    pub floors_sent_total: AtomicU64,
    /// The latest connection attempt and how far it got.
    pub attempt: Mutex<Option<Arc<AttemptTimes>>>,
    /// Chunks the server answered `Stored`.
    pub stored: AckCounter,
    /// Chunks the server answered `Duplicate` (it had them already).
    pub duplicate: AckCounter,
    /// Chunks the server answered `Retry`; they are offered again later.
    pub retry: AckCounter,
    /// Chunks the server answered `Rejected`; they were quarantined.
    pub rejected: AckCounter,
    /// Records in chunks answered `Stored` or `Duplicate`.
    pub records_acked_total: AtomicU64,
    /// Chunks found corrupt when read from the spool; quarantined, never sent.
    pub spool_corrupt_chunks: AtomicU64,
    /// Chunks sent as the spool thread handed them over, without reading them back from the
    /// spool (see `handoff.rs`).
    pub chunks_from_memory: AtomicU64,
    /// Bytes put on the wire for chunk payloads.
    pub wire_bytes_total: AtomicU64,
    /// Chunks sent and waiting for their ack.
    pub in_flight: AtomicU64,
    /// Their payload bytes.
    pub in_flight_bytes: AtomicU64,
    pub last_error: Mutex<Option<String>>,
    /// End-to-end latency samples (oldest record's commit → ack), milliseconds; exact quantiles
    /// for `status` and the demo. `/metrics` has the same observations as histograms.
    pub latency_ms: Mutex<LatencySamples>,
    /// Latency histograms and QUIC path figures, for `/metrics`.
    pub metrics: crate::metrics::UploadMetrics,
}

/// Where the agent is connected, for `status`.
#[derive(Debug, Default, Clone)]
pub struct SessionInfo {
    /// The configured server (`host:port`).
    pub server: String,
    /// The address of the current connection; `None` while disconnected.
    pub remote: Option<String>,
    /// When the connection state last changed (unix ms).
    pub since_ms: u64,
    /// The congestion controller of the agent's connections (`upload.congestion_controller`).
    pub congestion_controller: &'static str,
}

/// When a connection attempt started and when it reached each step on the way to its first
/// durable ack: the time a reconnect costs before data flows again (`edge-bench`'s agent
/// reconnect case reads it; `/metrics` has the session step as a histogram).
#[derive(Debug)]
pub struct AttemptTimes {
    /// The attempt started: before resolving the server's name.
    pub started: Instant,
    /// The server's Welcome arrived: the session is established and chunks may go.
    pub established: OnceLock<Instant>,
    /// The first chunk's bytes were all handed to QUIC.
    pub first_sent: OnceLock<Instant>,
    /// The first chunk was acked as durable (Stored or Duplicate).
    pub first_acked: OnceLock<Instant>,
}

impl AttemptTimes {
    fn start() -> Arc<Self> {
        Arc::new(Self {
            started: Instant::now(),
            established: OnceLock::new(),
            first_sent: OnceLock::new(),
            first_acked: OnceLock::new(),
        })
    }

    /// How long after the attempt started `step` happened; `None` if it has not.
    pub fn after_start(&self, step: &OnceLock<Instant>) -> Option<Duration> {
        step.get().map(|t| t.saturating_duration_since(self.started))
    }

    /// Marks `step` now, unless it happened already. Called for every chunk sent and acked,
    /// so only the first call reads the clock.
    fn mark(step: &OnceLock<Instant>) {
        if step.get().is_none() {
            // A racing first call may have set it meanwhile; either instant will do.
            let _first = step.set(Instant::now());
        }
    }
}

/// Chunks answered with one ack status, and their raw payload bytes (record framing included,
/// before compression).
#[derive(Debug, Default)]
pub struct AckCounter {
    pub chunks: AtomicU64,
    pub bytes: AtomicU64,
}

impl AckCounter {
    fn add(&self, meta: &ChunkMeta) {
        self.chunks.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(meta.bytes, Ordering::Relaxed);
    }

    /// Chunks counted so far.
    pub fn chunks(&self) -> u64 {
        self.chunks.load(Ordering::Relaxed)
    }

    /// Bytes counted so far.
    pub fn bytes(&self) -> u64 {
        self.bytes.load(Ordering::Relaxed)
    }
}

impl UploadCounters {
    fn set_session(&self, opts: &UploaderOptions, remote: Option<String>) {
        let mut s = crate::lock(&self.session);
        *s = SessionInfo {
            server: opts.server.clone(),
            remote,
            since_ms: now_ms(),
            congestion_controller: opts.tuning.congestion_controller.name(),
        };
    }

    fn set_error(&self, e: impl Into<String>) {
        *crate::lock(&self.last_error) = Some(e.into());
    }

    /// The latest error of a connection or an attempt.
    pub fn last_error(&self) -> Option<String> {
        crate::lock(&self.last_error).clone()
    }

    /// Chunks the server holds durably on our behalf: answered `Stored` or `Duplicate`.
    pub fn chunks_acked(&self) -> u64 {
        self.stored.chunks() + self.duplicate.chunks()
    }

    /// Raw payload bytes of those chunks.
    pub fn bytes_acked(&self) -> u64 {
        self.stored.bytes() + self.duplicate.bytes()
    }

    /// Counts a chunk the server holds durably, with its latencies.
    fn acked(&self, meta: &ChunkMeta, duplicate: bool) {
        if duplicate { &self.duplicate } else { &self.stored }.add(meta);
        self.records_acked_total.fetch_add(u64::from(meta.records), Ordering::Relaxed);
        let now = now_ms();
        let lat = now.saturating_sub(meta.first_ms);
        crate::lock(&self.latency_ms).record(u32::try_from(lat).unwrap_or(u32::MAX));
        self.metrics.acked(meta, now);
    }
}

/// A bounded reservoir of latency samples with exact quantiles over what it holds.
#[derive(Debug, Default)]
pub struct LatencySamples {
    samples: Vec<u32>,
    seen: u64,
}

impl LatencySamples {
    const CAP: usize = 100_000;

    /// Records one sample, keeping a uniform reservoir once full.
    pub fn record(&mut self, ms: u32) {
        self.seen += 1;
        if self.samples.len() < Self::CAP {
            self.samples.push(ms);
        } else {
            let j = rand::rng().random_range(0..self.seen);
            if let Some(slot) = usize::try_from(j).ok().and_then(|j| self.samples.get_mut(j)) {
                *slot = ms;
            }
        }
    }

    /// The `q` quantile (0..=1) in milliseconds, `None` before any sample.
    pub fn quantile(&self, q: f64) -> Option<u32> {
        if self.samples.is_empty() {
            return None;
        }
        let mut v = self.samples.clone();
        v.sort_unstable();
        let idx = ((v.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
        v.get(idx).copied()
    }
}

fn now_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0),
    )
    .unwrap_or(u64::MAX)
}

/// Runs until `cancel` fires, then drains chunks in flight for up to `drain_grace`.
pub async fn run(
    mut opts: UploaderOptions,
    spool: SpoolHandle,
    reader: ReaderHandle,
    counters: Arc<UploadCounters>,
    cancel: CancellationToken,
) -> anyhow::Result<()> {
    counters.set_session(&opts, None);
    let endpoint = edge_transport::client_endpoint(opts.bind, &opts.tuning)?;
    let mut backoff = Backoff::new(opts.backoff_min, opts.backoff_max);
    // The last handshake refusal logged as a warning since the last session: the same one
    // again goes to debug.
    let mut refusal_logged: Option<String> = None;
    // The limits of the last Welcome, to send the first chunks of the next connection before
    // its own.
    let learned: Mutex<Option<EarlyLimits>> = Mutex::new(None);
    // Streams the server refused for a limit on this device (`RetryReason::Limit`), kept from
    // one connection to the next: their chunks are held back on arrival, not sent to be
    // refused, until one of them is stored.
    let limited: Mutex<std::collections::HashSet<String>> = Mutex::new(std::collections::HashSet::new());
    let compressor = match opts.compression {
        Compression::Zstd(level) => Some(Arc::new(Compressor::per_core(level))),
        Compression::None => None,
    };
    let mut network = opts.network.take();
    // Whether the backoff wait may probe the server (`probe`): after an attempt or a connection
    // that got no answer, unless the attempt a probe's answer started got none either (then the
    // backoff alone, until a connection succeeds: a server that answers probes but not
    // handshakes is not helped by more attempts).
    let mut probe_allowed = true;
    let mut woken_by = Wake::Backoff;
    // The protocol version of the next Hello: after the server closed a connection for its
    // version, the next one speaks the version before it (down to `MIN_VERSION`); after a
    // connection it did not refuse, the newest again (the server may have been upgraded).
    let mut version = VERSION;
    while !cancel.is_cancelled() {
        // Only what happens from now on can bring back a path this attempt did not have.
        if let Some(n) = network.as_mut() {
            n.mark_seen();
        }
        counters.connect_attempts_total.fetch_add(1, Ordering::Relaxed);
        let attempt_started = tokio::time::Instant::now();
        let times = AttemptTimes::start();
        *crate::lock(&counters.attempt) = Some(times.clone());
        // Dropping an unfinished attempt closes it, so it stops sending.
        let attempt = tokio::select! {
            () = cancel.cancelled() => break,
            r = tokio::time::timeout(opts.connect_timeout, connect(&endpoint, &opts)) => r.unwrap_or_else(|_| {
                Err(AttemptTimedOut(opts.connect_timeout).into())
            }),
        };
        let mut silent = matches!(&attempt, Err(e) if got_no_answer(e));
        if silent && woken_by == Wake::Probe {
            probe_allowed = false;
            info!(server = %opts.server, "the server answered a probe but not the attempt that followed; probing stops until a connection succeeds");
        }
        match attempt {
            Ok(conn) => {
                probe_allowed = true;
                counters.connects_total.fetch_add(1, Ordering::Relaxed);
                counters.connected.store(true, Ordering::Release);
                counters.set_session(&opts, Some(conn.remote_address().to_string()));
                info!(server = %opts.server, remote = %conn.remote_address(), "connected to ingest");
                let sampler = crate::metrics::QuicSampler::spawn(conn.clone(), counters.clone());
                let result = Connection {
                    conn: &conn,
                    opts: &opts,
                    spool: &spool,
                    reader: &reader,
                    counters: &counters,
                    cancel: &cancel,
                    times: &times,
                    learned: &learned,
                    limited: &limited,
                    compressor: compressor.as_ref(),
                    version,
                }
                .run()
                .await;
                let refused = version > MIN_VERSION && closed_for_version(conn.close_reason().as_ref());
                if refused {
                    let older = version - 1;
                    warn!(server = %opts.server, version, older, "the ingest does not speak this protocol version: the next connection speaks the one before (upgrade the ingest: before version 2 it cannot be told about dropped chunks, before version 3 it answers a chunk past a device's limit as if it were overloaded)");
                    version = older;
                } else {
                    version = VERSION;
                }
                sampler.stop().await;
                counters.connected.store(false, Ordering::Release);
                counters.set_session(&opts, None);
                // A TLS 1.3 client's handshake completes before the server has checked its
                // certificate: a refused one ends the connection here, with the alert.
                let refusal = conn.close_reason().as_ref().and_then(tls_alert);
                match result {
                    Ok(progress) => {
                        refusal_logged = None;
                        if progress {
                            backoff.reset();
                        }
                        conn.close(ErrorCode::NoError.to_u32().into(), b"bye");
                    }
                    Err(e) => {
                        silent = e.went_silent();
                        match refusal {
                            Some(alert) if refusal_logged.as_deref() == Some(alert.as_str()) => {
                                debug!(server = %opts.server, error = %e, "connection ended");
                            }
                            Some(alert) => {
                                warn!(server = %opts.server, error = %e, "{REFUSED}");
                                refusal_logged = Some(alert);
                            }
                            None => {
                                refusal_logged = None;
                                warn!(server = %opts.server, error = %e, "connection ended");
                            }
                        }
                        counters.set_error(e.to_string());
                        if closed_as_superseded(conn.close_reason().as_ref()) {
                            counters.superseded_total.fetch_add(1, Ordering::Relaxed);
                            counters.last_superseded_ms.store(crate::status::now_ms(), Ordering::Relaxed);
                            let old = spool.id();
                            // Its own id from now on: the next connection no longer closes the
                            // other gateway's, nor do their chunks collide any more.
                            match spool.rekey().await {
                                Ok(new) => {
                                    *crate::lock(&counters.rekeyed) = Some((old.to_string(), crate::status::now_ms()));
                                    error!(
                                        server = %opts.server,
                                        old_spool = %old,
                                        new_spool = %new,
                                        "the ingest closed this connection for a newer one with this device certificate \
                                         and spool id, which this agent did not open: another gateway uses both (a disk \
                                         image copied with its machine id?). Until now the ingest took the two gateways' \
                                         chunks with the same sequence numbers for one another's and kept one of each; \
                                         this spool has a new id from now on. Give each gateway its own machine id \
                                         (spool.machine_id_file)"
                                    );
                                }
                                Err(e) => {
                                    // No new id: status must not say there is one.
                                    *crate::lock(&counters.rekeyed) = None;
                                    error!(
                                    server = %opts.server,
                                    spool = %old,
                                    error = %e,
                                    "the ingest closed this connection for a newer one with this device certificate \
                                     and spool id, which this agent did not open: another gateway uses both, and the \
                                     ingest takes the two gateways' chunks with the same sequence numbers for one \
                                     another's; the spool could not take a new id"
                                    );
                                }
                            }
                        }
                        if closed_for_certificate(conn.close_reason().as_ref()) {
                            // Resuming would carry the same certificate again: the next
                            // handshake is a full one, with the files as they are now.
                            opts.tls.forget_sessions();
                        }
                        if let ConnError::Protocol(p) = &e {
                            conn.close(p.code().to_u32().into(), p.to_string().as_bytes());
                        } else if e.made_progress() {
                            backoff.reset();
                        }
                    }
                }
            }
            Err(e) => {
                // A refused certificate (revoked, expired, of a CA the other side does not
                // trust) is not going to heal by waiting, unlike a server that is away: the
                // operator hears of it, once per reason.
                match e.downcast_ref::<quinn::ConnectionError>().and_then(tls_alert) {
                    Some(alert) if refusal_logged.as_deref() != Some(alert.as_str()) => {
                        warn!(server = %opts.server, error = %e, "{REFUSED}");
                        refusal_logged = Some(alert);
                    }
                    _ => debug!(server = %opts.server, error = %e, "connect failed"),
                }
                counters.set_error(format!("connect to {}: {e}", opts.server));
            }
        }
        if cancel.is_cancelled() {
            break;
        }
        let delay = backoff.next_delay();
        debug!(?delay, "reconnecting after backoff");
        let until = tokio::time::Instant::now() + delay;
        // The server hears from the agent at least every probe interval while it is silent: the
        // first probe goes out one interval after the attempt started (at once if the attempt
        // took longer, as it does when the server is down and connect_timeout is the longer).
        let probing = opts
            .probe_interval
            .filter(|_| silent && probe_allowed)
            .map(|every| Probing { first: (attempt_started + every).max(tokio::time::Instant::now()), every });
        woken_by = tokio::select! {
            () = cancel.cancelled() => break,
            () = tokio::time::sleep_until(until) => Wake::Backoff,
            () = network_changed(network.as_mut()) => Wake::Network,
            server = probe_answered(&opts, probing, &counters.probes_sent_total) => {
                counters.probe_wakeups_total.fetch_add(1, Ordering::Relaxed);
                info!(server = %opts.server, %server, "the server answers again; reconnecting now rather than after the backoff");
                Wake::Probe
            }
        };
        if woken_by == Wake::Network {
            // A link came up or a default route appeared since the attempt started: the path
            // may be back. Wait a moment (see `NETWORK_SETTLE`), then try.
            counters.network_wakeups_total.fetch_add(1, Ordering::Relaxed);
            let settle = Duration::from_micros(
                rand::rng()
                    .random_range(NETWORK_SETTLE.start().as_micros() as u64..=NETWORK_SETTLE.end().as_micros() as u64),
            );
            info!(server = %opts.server, ?settle, "the gateway's network changed; reconnecting now rather than after the backoff");
            // Never later than the backoff would have tried anyway.
            let at = (tokio::time::Instant::now() + settle).min(until);
            tokio::select! {
                () = cancel.cancelled() => break,
                () = tokio::time::sleep_until(at) => {}
            }
        }
    }
    // Polite close: let the peer learn we are gone rather than time us out. Connections were
    // closed with a reason above; this also abandons a handshake still in progress.
    endpoint.close(ErrorCode::NoError.to_u32().into(), b"agent stopping");
    let _ = tokio::time::timeout(Duration::from_secs(2), endpoint.wait_idle()).await;
    Ok(())
}

/// What ended a backoff wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wake {
    /// The wait ran out.
    Backoff,
    /// A path event on the gateway (`netwatch`).
    Network,
    /// The server answered a probe (`probe`).
    Probe,
}

/// Resolves at the next path event; never without a watch.
async fn network_changed(network: Option<&mut NetEvents>) {
    match network {
        Some(n) => n.changed().await,
        None => std::future::pending().await,
    }
}

/// When a backoff wait probes the server.
#[derive(Debug, Clone, Copy)]
struct Probing {
    first: tokio::time::Instant,
    every: Duration,
}

/// Resolves with the server's address when it answers a probe; never without `probing`.
async fn probe_answered(opts: &UploaderOptions, probing: Option<Probing>, sent: &AtomicU64) -> SocketAddr {
    match probing {
        Some(p) => crate::probe::until_answered(|| resolve(opts), opts.bind.ip(), p.first, p.every, sent).await,
        None => std::future::pending().await,
    }
}

/// Whether a failed attempt got no answer at all (our bound on it ran out, or quinn's idle
/// timeout did), as when the server or the path to it is down; not a refusal, a failed
/// handshake or a failed name lookup, which mean something answered.
fn got_no_answer(e: &anyhow::Error) -> bool {
    e.is::<AttemptTimedOut>()
        || matches!(e.downcast_ref::<quinn::ConnectionError>(), Some(quinn::ConnectionError::TimedOut))
}

/// A connection attempt that ran past `connect_timeout`.
#[derive(Debug, thiserror::Error)]
#[error("no handshake within {}", humantime::format_duration(*.0))]
struct AttemptTimedOut(Duration);

/// The server's address for the next attempt (and probe): its name resolved now, the first
/// address of the family of `upload.bind` if there is one.
async fn resolve(opts: &UploaderOptions) -> anyhow::Result<SocketAddr> {
    let addrs: Vec<SocketAddr> = tokio::net::lookup_host(&opts.server).await?.collect();
    let want_v4 = opts.bind.is_ipv4();
    addrs
        .iter()
        .find(|a| a.is_ipv4() == want_v4)
        .or_else(|| addrs.first())
        .copied()
        .ok_or_else(|| anyhow::anyhow!("{} resolved to no address", opts.server))
}

async fn connect(endpoint: &quinn::Endpoint, opts: &UploaderOptions) -> anyhow::Result<quinn::Connection> {
    let addr = resolve(opts).await?;
    let connecting = endpoint.connect_with(opts.tls.for_connect(), addr, &opts.server_name)?;
    Ok(connecting.await?)
}

/// What the agent logs (once per alert) when a TLS handshake is refused.
const REFUSED: &str = "the TLS handshake was refused; retrying with backoff, but this needs the certificates fixed (see edge-uploader status)";

/// The TLS alert that ended a connection, from either side (a QUIC `CRYPTO_ERROR`, codes 0x100
/// to 0x1ff), as text; `None` for every other end (a timeout, an unreachable server, a close by
/// the application). The server's refusal of the device certificate comes after the client's
/// handshake completed, as the connection's close reason.
fn tls_alert(e: &quinn::ConnectionError) -> Option<String> {
    let code = match e {
        quinn::ConnectionError::ConnectionClosed(close) => close.error_code,
        quinn::ConnectionError::TransportError(te) => te.code,
        _ => return None,
    };
    (0x100..0x200).contains(&u64::from(code)).then(|| code.to_string())
}

/// Whether the server closed the connection for the protocol version of our Hello.
fn closed_for_version(reason: Option<&quinn::ConnectionError>) -> bool {
    let Some(quinn::ConnectionError::ApplicationClosed(close)) = reason else { return false };
    let code = u32::try_from(close.error_code.into_inner()).ok().and_then(ErrorCode::from_u32);
    code == Some(ErrorCode::UnsupportedVersion)
}

/// Whether the server closed the connection for a newer one of the same device and spool id,
/// which this agent did not open: it holds one connection at a time.
fn closed_as_superseded(reason: Option<&quinn::ConnectionError>) -> bool {
    let Some(quinn::ConnectionError::ApplicationClosed(close)) = reason else { return false };
    close.error_code.into_inner() == u64::from(ErrorCode::NoError.to_u32())
        && close.reason.as_ref() == edge_proto::SUPERSEDED_REASON
}

/// Whether the server closed the connection for the device certificate: expired since the
/// handshake (`Unauthorized`), or revoked.
fn closed_for_certificate(reason: Option<&quinn::ConnectionError>) -> bool {
    let Some(quinn::ConnectionError::ApplicationClosed(close)) = reason else { return false };
    let code = u32::try_from(close.error_code.into_inner()).ok().and_then(ErrorCode::from_u32);
    matches!(code, Some(ErrorCode::Unauthorized | ErrorCode::Revoked))
}

/// Exponential backoff with full jitter.
#[derive(Debug)]
struct Backoff {
    min: Duration,
    max: Duration,
    cur: Duration,
}

impl Backoff {
    fn new(min: Duration, max: Duration) -> Self {
        Self { min, max, cur: min }
    }

    fn reset(&mut self) {
        self.cur = self.min;
    }

    fn next_delay(&mut self) -> Duration {
        let cap = self.cur;
        self.cur = (self.cur * 2).min(self.max);
        let lo = self.min.as_micros().min(cap.as_micros()) as u64;
        let hi = cap.as_micros() as u64;
        Duration::from_micros(rand::rng().random_range(lo / 2..=hi.max(lo / 2)))
    }
}

/// Why a connection ended.
#[derive(Debug, thiserror::Error)]
enum ConnError {
    #[error("protocol error: {0}")]
    Protocol(#[from] edge_proto::ProtoError),
    #[error("connection lost: {0}")]
    Lost(#[from] quinn::ConnectionError),
    #[error("control stream: {0}")]
    Control(String),
    #[error("spool: {0}")]
    Spool(#[from] SpoolError),
    #[error("connection lost after progress: {0}")]
    LostAfterProgress(quinn::ConnectionError),
    /// A chunk's send task ended without its outcome (it panicked): which chunk it was is gone
    /// with it, so the connection ends, and the next one offers every unacked chunk again.
    #[error("a chunk's send task failed: {0}")]
    SendTask(String),
}

impl ConnError {
    fn made_progress(&self) -> bool {
        matches!(self, ConnError::LostAfterProgress(_))
    }

    /// The server stopped answering (quinn's idle timeout ran out), as when it or the path to
    /// it goes down.
    fn went_silent(&self) -> bool {
        matches!(
            self,
            ConnError::Lost(quinn::ConnectionError::TimedOut)
                | ConnError::LostAfterProgress(quinn::ConnectionError::TimedOut)
        )
    }
}

type AckKey = (StreamName, u64);

struct CtlState {
    session: ClientSession,
    waiters: HashMap<AckKey, tokio::sync::oneshot::Sender<AckStatus>>,
    goaway: bool,
}

struct Connection<'a> {
    conn: &'a quinn::Connection,
    opts: &'a UploaderOptions,
    spool: &'a SpoolHandle,
    reader: &'a ReaderHandle,
    counters: &'a Arc<UploadCounters>,
    cancel: &'a CancellationToken,
    times: &'a Arc<AttemptTimes>,
    learned: &'a Mutex<Option<EarlyLimits>>,
    /// Streams the server refused for a limit (see `run`).
    limited: &'a Mutex<std::collections::HashSet<String>>,
    /// `None`: chunks go out as stored (`spool.compression = "none"`).
    compressor: Option<&'a Arc<Compressor>>,
    /// The protocol version of the Hello: [`VERSION`], or one below the version the server
    /// refused on the connection before (down to [`MIN_VERSION`]).
    version: u16,
}

enum SendOutcome {
    Acked(AckStatus),
    /// No ack will come on this connection (its stream failed, or the connection went away);
    /// the chunk stays in the spool and is offered again.
    Lost(String),
    /// The chunk cannot be sent as stored (bad stream name in the spool).
    Unsendable(String),
}

impl<'a> Connection<'a> {
    /// Shows the chunks and bytes in flight (see [`InFlight::publish`]), and tells the handoff
    /// how many more bytes the budget allows.
    fn publish(&self, in_flight: &InFlight) {
        in_flight.publish(self.counters);
        self.spool.set_in_flight(in_flight.chunks.keys().copied());
        let budget = self.opts.max_in_flight_bytes.load(Ordering::Relaxed);
        self.spool.handoff().set_room(budget.saturating_sub(in_flight.bytes));
    }

    /// The first sealed chunk after `after`, read from the spool, with its payload or the read
    /// error; none if there is none.
    async fn read(&self, after: Option<ChunkId>) -> Result<Vec<(ChunkMeta, Result<Payload, SpoolError>)>, SpoolError> {
        let fetched = self.reader.next(after, 1).await?;
        Ok(fetched.into_iter().map(|(meta, data)| (meta, data.map(Payload::from))).collect())
    }

    /// Runs the connection until it ends. Returns `Ok(true)` if at least one chunk was acked on
    /// it.
    async fn run(self) -> Result<bool, ConnError> {
        // Whether chunks went before the Welcome and none has been acked since.
        let mut sent_early = false;
        let result = self.serve(&mut sent_early).await;
        // Disconnected: data waits for the chunk target or `linger` again, and the next
        // connection starts from the spool.
        self.spool.set_uploader_idle(false);
        self.spool.handoff().stop();
        InFlight::default().publish(self.counters);
        self.spool.set_in_flight([]);
        if sent_early && result.is_err() {
            // The chunks sent before the Welcome may be what ended it (the server's limits
            // changed, or it does not take chunks before the Hello): the next connection waits
            // for its Welcome, and learns the limits again.
            debug!(server = %self.opts.server, "connection ended before any ack; the next one waits for the Welcome");
            *crate::lock(self.learned) = None;
        }
        result
    }

    /// The payload of a chunk read for sending, or `None` if it is not to be sent: gone from
    /// the spool meanwhile, or corrupt (then quarantined).
    fn admit(&self, meta: &ChunkMeta, data: Result<Payload, SpoolError>) -> Result<Option<Payload>, ConnError> {
        let max_records = self.opts.limits.max_records_per_chunk;
        if meta.records > max_records {
            // Only a spool sealed under an older, larger `spool.chunk_target` holds one: the
            // ingest would close the connection over its header, on every connection.
            error!(chunk = meta.id.0, stream = %meta.stream, seq = meta.seq, records = meta.records, max_records, "chunk holds more records than the ingest takes; quarantined, it will not be uploaded");
            self.spool
                .quarantine(meta.id, format!("{} records, over the protocol's limit of {max_records}", meta.records));
            return Ok(None);
        }
        match data {
            Ok(d) => Ok(Some(d)),
            Err(SpoolError::ChunkGone(_)) => Ok(None),
            Err(SpoolError::Corrupt { chunk, detail }) => {
                error!(chunk = chunk.0, stream = %meta.stream, seq = meta.seq, records = meta.records, bytes = meta.bytes, %detail, "spool chunk is corrupt; quarantined, it will not be uploaded");
                self.counters.spool_corrupt_chunks.fetch_add(1, Ordering::Relaxed);
                self.spool.quarantine(chunk, format!("{QUARANTINE_CORRUPT}: {detail}"));
                Ok(None)
            }
            // Damage SQLite itself found in this chunk's pages: failing the whole upload loop
            // would hit the same pages after every reconnect.
            Err(e) if e.is_corruption() => {
                error!(chunk = meta.id.0, stream = %meta.stream, seq = meta.seq, records = meta.records, bytes = meta.bytes, error = %e, "spool chunk is unreadable (database damage); quarantined, it will not be uploaded");
                self.counters.spool_corrupt_chunks.fetch_add(1, Ordering::Relaxed);
                self.spool.quarantine(meta.id, format!("{QUARANTINE_UNREADABLE}: {e}"));
                Ok(None)
            }
            Err(e) => Err(e.into()),
        }
    }

    fn spawn_send(
        &self,
        tasks: &mut JoinSet<(ChunkMeta, SendOutcome)>,
        state: &Arc<Mutex<CtlState>>,
        meta: ChunkMeta,
        raw: Payload,
        max_chunk_payload: u32,
    ) {
        tasks.spawn(send_chunk(
            self.conn.clone(),
            state.clone(),
            meta,
            raw,
            max_chunk_payload,
            self.compressor.cloned(),
            self.counters.clone(),
            self.times.clone(),
        ));
    }

    /// Tells the server `stream`'s floor ([`floor_of`]) on the control stream; nothing on a
    /// session of protocol version 1, which has no such frame.
    async fn send_floor(
        &self,
        state: &Mutex<CtlState>,
        ctl_send: &mut quinn::SendStream,
        stream: &str,
        floor: u64,
    ) -> Result<(), ConnError> {
        // The name was valid when the chunk was sent: only such chunks are answered.
        let Ok(name) = StreamName::new(stream) else { return Ok(()) };
        let bytes = {
            let mut st = crate::lock(state);
            if !st.session.floor(&name, floor)? {
                return Ok(());
            }
            st.session.poll_transmit()
        };
        if let Some(bytes) = bytes {
            debug!(stream, floor, "telling the server no seq below the floor will come");
            self.counters.floors_sent_total.fetch_add(1, Ordering::Relaxed);
            ctl_send
                .write_all(&bytes)
                .await
                .map_err(|e| ConnError::Control(edge_telemetry::logging::error_chain(&e)))?;
        }
        Ok(())
    }

    async fn serve(&self, sent_early: &mut bool) -> Result<bool, ConnError> {
        let (mut ctl_send, mut ctl_recv) = self.conn.open_bi().await?;
        let agent = format!("edge-uploader/{}", env!("CARGO_PKG_VERSION"));
        let early = if self.opts.early_chunks { *crate::lock(self.learned) } else { None };
        let (id, limits, now) = (self.spool.id().0, self.opts.limits.clone(), Instant::now());
        let session = ClientSession::with_version(id, agent, limits, now, early, self.version);
        let state = Arc::new(Mutex::new(CtlState { session, waiters: HashMap::new(), goaway: false }));
        loop {
            let hello = crate::lock(&state).session.poll_transmit();
            let Some(bytes) = hello else { break };
            ctl_send
                .write_all(&bytes)
                .await
                .map_err(|e| ConnError::Control(edge_telemetry::logging::error_chain(&e)))?;
        }
        let mut tasks: JoinSet<(ChunkMeta, SendOutcome)> = JoinSet::new();
        let mut in_flight = InFlight::default();
        // The floor last sent per stream on this connection.
        let mut floors_sent: HashMap<String, u64> = HashMap::new();
        let mut cursor: Option<ChunkId> = None;
        // While no connection could take chunks, the spool thread sealed by size only: the
        // records that came meanwhile are sealed now, so they can go in this first flight.
        self.spool.seal_all().await;
        if let Some(e) = early {
            // The first chunks in sealing order, right behind the Hello, within the last
            // Welcome's limits and `EARLY_BYTES`.
            let window = self.opts.max_in_flight.load(Ordering::Relaxed).clamp(1, e.max_in_flight.max(1)) as usize;
            let budget = self.opts.max_in_flight_bytes.load(Ordering::Relaxed).min(EARLY_BYTES);
            while in_flight.has_room(window, budget) {
                let Some((meta, data)) = self.read(cursor).await?.into_iter().next() else { break };
                let Some(raw) = self.admit(&meta, data)? else {
                    cursor = Some(meta.id);
                    continue;
                };
                if raw.len() as u64 > u64::from(e.max_chunk_payload) {
                    // Over the last Welcome's limit: this one waits for the Welcome, which
                    // says whether it is still the limit (the cursor stays before it).
                    break;
                }
                cursor = Some(meta.id);
                in_flight.insert(&meta, raw.len() as u64);
                self.spawn_send(&mut tasks, &state, meta, raw, e.max_chunk_payload);
            }
            *sent_early = !tasks.is_empty();
            self.publish(&in_flight);
        }
        // Handshake. Acks of chunks sent before the Welcome may come right behind it.
        let deadline = tokio::time::Instant::now() + self.opts.limits.handshake_timeout;
        let mut buf = vec![0u8; 4096];
        let (server_in_flight, max_chunk_payload) = loop {
            let n = tokio::select! {
                r = ctl_recv.read(&mut buf) => r.map_err(|e| ConnError::Control(edge_telemetry::logging::error_chain(&e)))?,
                () = tokio::time::sleep_until(deadline) => return Err(edge_proto::ProtoError::HandshakeTimeout.into()),
            };
            let Some(n) = n else { return Err(ConnError::Control("server closed the control stream".into())) };
            let mut welcome = None;
            {
                let mut st = crate::lock(&state);
                st.session.handle_control_bytes(Instant::now(), &buf[..n])?;
                while let Some(ev) = st.session.poll_event() {
                    match ev {
                        ClientEvent::Connected { device, max_in_flight, max_chunk_payload } => {
                            info!(%device, max_in_flight, max_chunk_payload, early_chunks = in_flight.len(), "session established");
                            welcome = Some((max_in_flight, max_chunk_payload));
                        }
                        ClientEvent::GoAway { code } => {
                            return Err(ConnError::Control(format!("server going away: {code}")));
                        }
                        ClientEvent::Ack { stream, seq, status } => {
                            if let Some(w) = st.waiters.remove(&(stream, seq)) {
                                let _gone = w.send(status);
                            }
                        }
                    }
                }
            }
            if let Some((max_in_flight, max_chunk_payload)) = welcome {
                AttemptTimes::mark(&self.times.established);
                if let Some(took) = self.times.after_start(&self.times.established) {
                    self.counters.metrics.session_established(took);
                }
                *crate::lock(self.learned) = Some(EarlyLimits { max_in_flight, max_chunk_payload });
                break (max_in_flight, max_chunk_payload);
            }
        };
        // The server's limit caps ours; ours may change at run time (configuration reload).
        let window = || self.opts.max_in_flight.load(Ordering::Relaxed).clamp(1, server_in_flight.max(1)) as usize;
        let goaway = Arc::new(tokio::sync::Notify::new());

        // Control reader: acks and GoAway.
        let ctl_state = state.clone();
        let ctl_goaway = goaway.clone();
        let mut control = tokio::spawn(async move {
            let mut buf = vec![0u8; 16 * 1024];
            let result: Result<(), ConnError> = loop {
                match ctl_recv.read(&mut buf).await {
                    Ok(Some(n)) => {
                        let mut st = crate::lock(&ctl_state);
                        if let Err(e) = st.session.handle_control_bytes(Instant::now(), &buf[..n]) {
                            break Err(e.into());
                        }
                        while let Some(ev) = st.session.poll_event() {
                            match ev {
                                ClientEvent::Ack { stream, seq, status } => {
                                    if let Some(w) = st.waiters.remove(&(stream, seq)) {
                                        let _gone = w.send(status);
                                    }
                                }
                                ClientEvent::GoAway { code } => {
                                    info!(%code, "server asked us to go away");
                                    st.goaway = true;
                                    ctl_goaway.notify_one();
                                }
                                ClientEvent::Connected { .. } => {}
                            }
                        }
                    }
                    Ok(None) => break Err(ConnError::Control("server finished the control stream".into())),
                    Err(e) => break Err(ConnError::Control(edge_telemetry::logging::error_chain(&e))),
                }
            };
            // Wake every sender: their acks will not come on this connection.
            crate::lock(&ctl_state).waiters.clear();
            result
        });

        // Chunks handed back on this connection (answered Retry, or lost) to offer again, lowest id
        // first. All of them are at or before `cursor` and none is in flight, so reading them
        // never reads a payload that is already on its way. Each with its stream and seq, for
        // `floor_of`.
        let mut redo: BTreeMap<ChunkId, (String, u64)> = BTreeMap::new();
        let mut progress = false;
        let mut drain_deadline: Option<tokio::time::Instant> = None;
        let mut retry_at: Option<tokio::time::Instant> = None;
        // Chunks of streams a limit of the server's on this device refused (`RetryReason::Limit`:
        // a new stream past its cap), lowest id first, with their stream and seq: refused, or
        // read after their stream was and held back unsent. They hold no room in the window
        // and stop nothing else: once every `backoff_max` the lowest of each stream is offered
        // again, and once one of a stream is stored the rest of it follows.
        let mut parked: BTreeMap<ChunkId, (String, u64)> = BTreeMap::new();
        let mut parked_until: Option<tokio::time::Instant> = None;
        let mut retry_backoff = Backoff::new(self.opts.backoff_min, self.opts.backoff_max);
        let mut exhausted = false;
        // Chunks in flight the server's answers allow, within the configured window: halved on
        // every Retry(Overloaded), grown by one per stored chunk. On a slow or lossy link all
        // chunks in flight share its bandwidth, and each must still reach the server at its
        // minimum payload rate: a full window of slow chunks would all be answered Retry, again
        // and again, and nothing would ever be stored.
        let mut allowed = usize::MAX;
        let end: Result<(), ConnError> = loop {
            if drain_deadline.is_none() && (self.cancel.is_cancelled() || crate::lock(&state).goaway) {
                drain_deadline = Some(tokio::time::Instant::now() + self.opts.drain_grace);
            }
            let draining = drain_deadline.is_some();
            if draining && tasks.is_empty() {
                break Ok(());
            }
            // Fill the window, one chunk per read: both budgets are checked before each payload
            // is read, and a payload is read only for a chunk that is then sent.
            let room = in_flight.has_room(window().min(allowed), self.opts.max_in_flight_bytes.load(Ordering::Relaxed));
            if !draining && retry_at.is_none() && room && (!redo.is_empty() || !exhausted) {
                // Offered again (after a Retry, a lost stream or a limit), or read as new.
                let mut reoffer = false;
                let fetched = if let Some((id, _)) = redo.pop_first() {
                    reoffer = true;
                    let mut fetched = self.read(Some(ChunkId(id.0.saturating_sub(1)))).await?;
                    // Anything else means the chunk left the spool meanwhile (dropped by the
                    // cap): the read of the chunk after it was in vain, and is discarded.
                    fetched.retain(|(meta, _)| meta.id == id);
                    fetched
                } else {
                    match self.spool.handoff().next() {
                        // Read from the spool already: the sync that made its seal durable let
                        // readers list it before the seal was handed over, and this uploader's
                        // read and `follow` fell in between. Sending it again would only cost a
                        // duplicate (or, acked meanwhile, count it twice).
                        Next::Chunk(meta, _) if cursor.is_some_and(|c| meta.id <= c) => {
                            debug!(chunk = meta.id.0, "chunk handed over after it was read from the spool; skipped");
                            Vec::new()
                        }
                        // Sealed since the uploader last found the spool read through, handed
                        // over in memory: the front of the queue is the next chunk after `cursor`.
                        Next::Chunk(meta, Some(payload)) => {
                            cursor = Some(meta.id);
                            self.counters.chunks_from_memory.fetch_add(1, Ordering::Relaxed);
                            vec![(meta, Ok(payload))]
                        }
                        Next::Chunk(meta, None) => {
                            let id = meta.id;
                            cursor = Some(id);
                            let mut fetched = self.read(Some(ChunkId(id.0.saturating_sub(1)))).await?;
                            fetched.retain(|(meta, _)| meta.id == id);
                            fetched
                        }
                        Next::CaughtUp => {
                            exhausted = true;
                            Vec::new()
                        }
                        Next::Spool => {
                            // Taken before the read: if nothing is sealed in between, a read
                            // that finds nothing more has seen every seal before it.
                            let generation = self.spool.handoff().generation();
                            let fetched = self.read(cursor).await?;
                            match fetched.last() {
                                Some((meta, _)) => cursor = Some(meta.id),
                                None => {
                                    exhausted = true;
                                    self.publish(&in_flight);
                                    self.spool.handoff().follow(generation);
                                }
                            }
                            fetched
                        }
                    }
                };
                for (meta, data) in fetched {
                    if in_flight.contains(meta.id) {
                        continue;
                    }
                    // A new chunk of a stream refused for a limit is held back unsent: the
                    // stream's lowest chunk is offered again on the timer.
                    if !reoffer && crate::lock(self.limited).contains(&meta.stream) {
                        parked.insert(meta.id, (meta.stream.clone(), meta.seq));
                        parked_until.get_or_insert(tokio::time::Instant::now() + self.opts.backoff_max);
                        continue;
                    }
                    let Some(raw) = self.admit(&meta, data)? else { continue };
                    if raw.len() as u64 > u64::from(max_chunk_payload) && self.compressor.is_none() {
                        // Sending it would only get the connection closed, again and again. (A
                        // compressed chunk is measured after compression, by its send task.)
                        error!(chunk = meta.id.0, stream = %meta.stream, seq = meta.seq, bytes = raw.len(), max_chunk_payload, "chunk is larger than the server accepts; quarantined");
                        self.spool.quarantine(
                            meta.id,
                            format!("{} bytes, {OVER_SERVER_LIMIT} of {max_chunk_payload}", raw.len()),
                        );
                        continue;
                    }
                    in_flight.insert(&meta, raw.len() as u64);
                    self.publish(&in_flight);
                    self.spawn_send(&mut tasks, &state, meta, raw, max_chunk_payload);
                }
                continue;
            }
            // Nothing in flight and nothing to send: let the spool seal what producers commit
            // now rather than after `linger` (see `SpoolHandle::set_uploader_idle`).
            self.spool.set_uploader_idle(
                !draining && exhausted && redo.is_empty() && retry_at.is_none() && in_flight.len() == 0,
            );
            tokio::select! {
                () = self.cancel.cancelled(), if !draining => {}
                () = goaway.notified(), if !draining => {}
                () = async { if let Some(t) = drain_deadline { tokio::time::sleep_until(t).await } }, if draining => {
                    warn!(in_flight = in_flight.len(), "drain grace period over; unacked chunks stay in the spool");
                    break Ok(());
                }
                () = self.spool.sealed(), if !draining && exhausted => { exhausted = false; }
                () = async { if let Some(t) = retry_at { tokio::time::sleep_until(t).await } }, if retry_at.is_some() => {
                    retry_at = None;
                }
                () = async { if let Some(t) = parked_until { tokio::time::sleep_until(t).await } }, if parked_until.is_some() && !draining => {
                    parked_until = None;
                    let mut streams = std::collections::HashSet::new();
                    unpark(&mut parked, &mut redo, |stream| streams.insert(stream.to_owned()));
                    // Armed again by the refusal of what was offered, or here, should that
                    // have left the spool meanwhile (dropped, quarantined) with more behind it.
                    if !parked.is_empty() {
                        parked_until = Some(tokio::time::Instant::now() + self.opts.backoff_max);
                    }
                }
                r = &mut control => {
                    let e = match r {
                        Ok(Err(e)) => e,
                        Ok(Ok(())) => ConnError::Control("control task ended".into()),
                        Err(join) => ConnError::Control(join.to_string()),
                    };
                    break Err(e);
                }
                e = self.conn.closed() => break Err(e.into()),
                Some(joined) = tasks.join_next() => {
                    // The window holds a slot for its chunk, which no outcome will free.
                    let (meta, outcome) = match joined {
                        Ok(done) => done,
                        Err(e) => break Err(ConnError::SendTask(e.to_string())),
                    };
                    in_flight.remove(meta.id);
                    self.publish(&in_flight);
                    match outcome {
                        SendOutcome::Acked(status @ (AckStatus::Stored | AckStatus::Duplicate)) => {
                            allowed = allowed.min(window()).saturating_add(1);
                            progress = true;
                            *sent_early = false;
                            retry_backoff.reset();
                            // Counted before the spool learns of the ack, so whoever sees the
                            // spool drained also sees the counters complete.
                            self.counters.acked(&meta, status == AckStatus::Duplicate);
                            AttemptTimes::mark(&self.times.first_acked);
                            self.spool.ack(vec![meta.id]);
                            // The limit let this stream in (raised, or this stream was known):
                            // the rest of it goes now.
                            if crate::lock(self.limited).remove(&meta.stream) {
                                info!(stream = %meta.stream, "the server stores the stream again; its chunks held back go now");
                                unpark(&mut parked, &mut redo, |stream| stream == meta.stream);
                            }
                        }
                        SendOutcome::Acked(AckStatus::Retry(RetryReason::Limit)) => {
                            self.counters.retry.add(&meta);
                            if crate::lock(self.limited).insert(meta.stream.clone()) {
                                warn!(stream = %meta.stream, seq = meta.seq, every = ?self.opts.backoff_max, "the server refuses this stream for a limit on this device (its streams at the ingest's cap): its chunks are held back and offered again, one at a time, until the limit is raised; other streams go on");
                            }
                            parked.insert(meta.id, (meta.stream.clone(), meta.seq));
                            parked_until.get_or_insert(tokio::time::Instant::now() + self.opts.backoff_max);
                        }
                        SendOutcome::Acked(AckStatus::Retry(reason)) => {
                            if reason == RetryReason::Overloaded {
                                allowed = (allowed.min(window()) / 2).max(1);
                            }
                            self.counters.retry.add(&meta);
                            let delay = retry_backoff.next_delay();
                            warn!(stream = %meta.stream, seq = meta.seq, ?reason, ?delay, "server asked to retry the chunk later");
                            redo.insert(meta.id, (meta.stream.clone(), meta.seq));
                            retry_at.get_or_insert(tokio::time::Instant::now() + delay);
                            // An ingest at this device's cap of gaps refuses a chunk with no
                            // neighbour stored: if the chunks below it were dropped or
                            // quarantined here, no neighbour ever comes. The stream's floor
                            // tells it so, and it closes those gaps. Not while a drop or a
                            // quarantine may still be undone by a power cut (`removals_durable`):
                            // a chunk brought back would be answered duplicate, and lost
                            // uncounted.
                            if reason == RetryReason::Overloaded
                                && self.spool.removals_durable()
                                && let Some(floor) = floor_of(&meta.stream, &in_flight, &redo, &parked)
                                && floors_sent.get(&meta.stream).is_none_or(|&sent| sent < floor)
                            {
                                floors_sent.insert(meta.stream.clone(), floor);
                                if let Err(e) = self.send_floor(&state, &mut ctl_send, &meta.stream, floor).await {
                                    break Err(e);
                                }
                            }
                        }
                        SendOutcome::Acked(AckStatus::Rejected(reason)) => {
                            self.counters.rejected.add(&meta);
                            error!(stream = %meta.stream, seq = meta.seq, ?reason, "server rejected the chunk for good; quarantined");
                            self.spool.quarantine(meta.id, format!("rejected by server: {reason:?}"));
                        }
                        SendOutcome::Unsendable(why) => {
                            error!(stream = %meta.stream, seq = meta.seq, %why, "chunk cannot be sent; quarantined");
                            self.spool.quarantine(meta.id, why);
                        }
                        SendOutcome::Lost(why) => {
                            // Only this stream may have failed (the server stopped it) while the
                            // connection lives on, and the cursor is past the chunk: offer it
                            // again by id after a backoff, as for a Retry. If the connection is
                            // going, the loop ends first and the next one rescans anyway.
                            let delay = retry_backoff.next_delay();
                            debug!(stream = %meta.stream, seq = meta.seq, %why, ?delay, "chunk not acked on this connection; offering it again");
                            redo.insert(meta.id, (meta.stream.clone(), meta.seq));
                            retry_at.get_or_insert(tokio::time::Instant::now() + delay);
                        }
                    }
                }
            }
        };
        tasks.abort_all();
        control.abort();
        match end {
            Ok(()) => Ok(progress),
            Err(ConnError::Lost(e)) if progress => Err(ConnError::LostAfterProgress(e)),
            Err(e) => Err(e),
        }
    }
}

/// The chunks in flight on one connection and their payload bytes, held against both limits.
#[derive(Debug, Default)]
struct InFlight {
    /// Per chunk its payload bytes, and its stream and seq (for [`floor_of`]).
    chunks: HashMap<ChunkId, (u64, (String, u64))>,
    bytes: u64,
}

impl InFlight {
    /// Whether another chunk may be read and sent: fewer than `max_chunks` chunks and fewer than
    /// `max_bytes` bytes are in flight. With nothing in flight always, so a chunk bigger than the
    /// byte budget still goes, alone. The bytes in flight thus stay below `max_bytes` plus one
    /// chunk.
    fn has_room(&self, max_chunks: usize, max_bytes: u64) -> bool {
        self.chunks.is_empty() || (self.chunks.len() < max_chunks && self.bytes < max_bytes)
    }

    fn contains(&self, id: ChunkId) -> bool {
        self.chunks.contains_key(&id)
    }

    fn insert(&mut self, meta: &ChunkMeta, bytes: u64) {
        if let Some((old, _)) = self.chunks.insert(meta.id, (bytes, (meta.stream.clone(), meta.seq))) {
            self.bytes -= old;
        }
        self.bytes += bytes;
    }

    fn remove(&mut self, id: ChunkId) {
        if let Some((bytes, _)) = self.chunks.remove(&id) {
            self.bytes -= bytes;
        }
    }

    fn len(&self) -> usize {
        self.chunks.len()
    }

    /// Shows the chunks and bytes in flight in the counters `status` and `/metrics` read (one
    /// uploader connection at a time, so they are this connection's).
    fn publish(&self, counters: &UploadCounters) {
        counters.in_flight.store(self.chunks.len() as u64, Ordering::Relaxed);
        counters.in_flight_bytes.store(self.bytes, Ordering::Relaxed);
    }
}

/// Moves the parked chunks `pick` takes, asked in id order with each chunk's stream, to `redo`.
fn unpark(
    parked: &mut BTreeMap<ChunkId, (String, u64)>,
    redo: &mut BTreeMap<ChunkId, (String, u64)>,
    mut pick: impl FnMut(&str) -> bool,
) {
    let ids: Vec<ChunkId> = parked.iter().filter(|(_, (stream, _))| pick(stream)).map(|(id, _)| *id).collect();
    for id in ids {
        if let Some(key) = parked.remove(&id) {
            redo.insert(id, key);
        }
    }
}

/// The floor of `stream` on this connection: its lowest seq among the chunks in flight and
/// those handed back to be offered again, now or after a limit (`parked`). The spool is read
/// in sealing order, in which each stream's seqs grow, so every chunk of the stream below it
/// was read on this connection and then acked, or left the spool (dropped by its cap, or
/// quarantined), and none of them will be sent as new data again. A scan of the window: this
/// runs only when the server refuses a chunk.
fn floor_of(
    stream: &str,
    in_flight: &InFlight,
    redo: &BTreeMap<ChunkId, (String, u64)>,
    parked: &BTreeMap<ChunkId, (String, u64)>,
) -> Option<u64> {
    in_flight
        .chunks
        .values()
        .map(|(_, key)| key)
        .chain(redo.values())
        .chain(parked.values())
        .filter(|(s, _)| s == stream)
        .map(|&(_, seq)| seq)
        .min()
}

#[allow(clippy::too_many_arguments)]
async fn send_chunk(
    conn: quinn::Connection,
    state: Arc<Mutex<CtlState>>,
    meta: ChunkMeta,
    raw: Payload,
    max_chunk_payload: u32,
    compressor: Option<Arc<Compressor>>,
    counters: Arc<UploadCounters>,
    times: Arc<AttemptTimes>,
) -> (ChunkMeta, SendOutcome) {
    let outcome =
        send_chunk_inner(&conn, &state, &meta, raw, max_chunk_payload, compressor.as_ref(), &counters, &times).await;
    (meta, outcome)
}

#[allow(clippy::too_many_arguments)]
async fn send_chunk_inner(
    conn: &quinn::Connection,
    state: &Mutex<CtlState>,
    meta: &ChunkMeta,
    raw: Payload,
    max_chunk_payload: u32,
    compressor: Option<&Arc<Compressor>>,
    counters: &UploadCounters,
    times: &AttemptTimes,
) -> SendOutcome {
    let stream = match StreamName::new(&meta.stream) {
        Ok(s) => s,
        Err(e) => return SendOutcome::Unsendable(format!("stream name {:?} in spool: {e}", meta.stream)),
    };
    let Ok(raw_len) = u32::try_from(raw.len()) else {
        return SendOutcome::Unsendable(format!("chunk of {} bytes is over 4 GiB", raw.len()));
    };
    // Uncompressed, the payload's CRC-32C is the one the spool checked while reading it (or
    // one over the pieces handed over in memory), and its pieces go out as they are.
    let compressed = match compressor {
        // Over the server's limit as it is: only compressed can it go.
        Some(c) if raw.len() as u64 > u64::from(max_chunk_payload) => c.chunk_always(&meta.stream, &raw).await,
        Some(c) => c.chunk(&meta.stream, &raw).await,
        None => Compressed::Skipped,
    };
    let (codec, checksum, mut payload) = match compressed {
        Compressed::Smaller(c) => {
            // Not needed any more: a chunk sent again is read again (by id), and holding both
            // would keep more than the in-flight byte budget in memory.
            drop(raw);
            (Codec::Zstd, edge_proto::crc32c(&c), vec![Bytes::from(c)])
        }
        Compressed::NotSmaller | Compressed::Skipped => (Codec::None, raw.crc32c(), raw.parts),
    };
    let wire: usize = payload.iter().map(Bytes::len).sum();
    if wire as u64 > u64::from(max_chunk_payload) {
        // Sending it would only get the connection closed, again and again.
        return SendOutcome::Unsendable(format!(
            "{wire} bytes on the wire ({raw_len} uncompressed), {OVER_SERVER_LIMIT} of {max_chunk_payload}"
        ));
    }
    let header = ChunkHeader {
        stream: stream.clone(),
        seq: meta.seq,
        records: meta.records,
        raw_len,
        payload_len: u32::try_from(wire).unwrap_or(u32::MAX),
        codec,
        checksum,
        created_ms: meta.first_ms,
    };
    let rx = {
        let mut st = crate::lock(state);
        if let Err(e) = st.session.chunk_sent(&stream, meta.seq) {
            return SendOutcome::Lost(e.to_string());
        }
        let (tx, rx) = tokio::sync::oneshot::channel();
        st.waiters.insert((stream, meta.seq), tx);
        rx
    };
    let mut head = Vec::with_capacity(64);
    header.encode(&mut head);
    let mut pieces = Vec::with_capacity(1 + payload.len());
    pieces.push(Bytes::from(head));
    pieces.append(&mut payload);
    let sent = async {
        let mut s = conn.open_uni().await.map_err(quinn::WriteError::ConnectionLost)?;
        s.set_priority(chunk_priority(meta.id)).map_err(|_closed| quinn::WriteError::ClosedStream)?;
        s.write_all_chunks(&mut pieces).await?;
        s.finish().map_err(|_closed| quinn::WriteError::ClosedStream)?;
        Ok::<quinn::SendStream, quinn::WriteError>(s)
    }
    .await;
    let abandon = |why: String| {
        let mut st = crate::lock(state);
        st.session.chunk_abandoned(&header.stream, meta.seq);
        st.waiters.remove(&(header.stream.clone(), meta.seq));
        SendOutcome::Lost(why)
    };
    let mut rx = rx;
    // Whether the server stopped the stream, and with which code. The whole chunk may be
    // buffered before the server stops the stream, so once written, `stopped` tells a stop apart
    // from the server having every byte (`None`, after which only the ack decides).
    let stop = match sent {
        Ok(s) => {
            counters.wire_bytes_total.fetch_add(wire as u64, Ordering::Relaxed);
            AttemptTimes::mark(&times.first_sent);
            tokio::select! {
                r = &mut rx => return ack_outcome(r),
                st = s.stopped() => match st {
                    Ok(Some(code)) => Some(code),
                    Ok(None) | Err(_) => None,
                },
            }
        }
        Err(quinn::WriteError::Stopped(code)) => Some(code),
        Err(e) => return abandon(e.to_string()),
    };
    match stop {
        // Stopped after the server accepted it: its ack (a Retry) is on its way. Offering the
        // chunk again before that ack arrives would put the same key in flight twice on this
        // connection, and the late ack would answer the new attempt.
        Some(code) if code.into_inner() == u64::from(STOP_ANSWERED) => ack_outcome(rx.await),
        Some(code) => abandon(format!("server stopped the chunk stream (code {code})")),
        None => ack_outcome(rx.await),
    }
}

/// The send priority of a chunk's stream: the older the chunk (the lower its id), the higher.
///
/// quinn sends the stream of highest priority first, and queues a stream with lost data to
/// resend behind every other pending stream *of the same priority*. With one priority for all,
/// a chunk whose packet was lost waits for the rest of the chunks in flight to be sent whole
/// before its gap is filled, so on a lossy uplink the chunks in flight can all complete at the
/// end together. Ordered by age, the oldest chunk's resends go first and chunks arrive whole
/// one after another. Measured apart from the congestion controller (`edge-bench uplink
/// --mib 32` at 0.5 % loss, BENCHMARKS.md "Over a shaped uplink"), it changed neither the
/// drain nor the time to the first ack; it is kept because it costs nothing measurable and
/// orders resends by what the spool waits for.
/// The order wraps every 2^30 chunks, which only reorders the window in flight at that moment.
fn chunk_priority(id: ChunkId) -> i32 {
    // Masked to 30 bits: the value fits an i32 whatever the id.
    -i32::try_from(id.0 & 0x3FFF_FFFF).unwrap_or(0)
}

fn ack_outcome(acked: Result<AckStatus, tokio::sync::oneshot::error::RecvError>) -> SendOutcome {
    match acked {
        Ok(status) => SendOutcome::Acked(status),
        Err(_) => SendOutcome::Lost("connection ended before the ack".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_tls_alert_is_a_refusal_logged_as_a_warning() {
        let closed = |code: quinn::TransportErrorCode| {
            quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
                error_code: code,
                frame_type: None,
                reason: bytes::Bytes::new(),
            })
        };
        // The server refused the device's certificate (`unknown_ca`, `certificate_revoked`).
        let unknown_ca = tls_alert(&closed(quinn::TransportErrorCode::crypto(48))).expect("a refusal");
        let revoked = tls_alert(&closed(quinn::TransportErrorCode::crypto(44))).expect("a refusal");
        assert_ne!(unknown_ca, revoked, "each reason is logged once");

        assert_eq!(tls_alert(&closed(quinn::TransportErrorCode::PROTOCOL_VIOLATION)), None);
        assert_eq!(tls_alert(&closed(quinn::TransportErrorCode::CONNECTION_REFUSED)), None);
        assert_eq!(tls_alert(&quinn::ConnectionError::TimedOut), None);
    }

    #[test]
    fn only_a_close_for_the_certificate_makes_the_agent_forget_its_sessions() {
        let closed = |code: ErrorCode| {
            quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
                error_code: code.to_u32().into(),
                reason: bytes::Bytes::from_static(b"why"),
            })
        };
        assert!(closed_for_certificate(Some(&closed(ErrorCode::Unauthorized))));
        assert!(closed_for_certificate(Some(&closed(ErrorCode::Revoked))));
        assert!(!closed_for_certificate(Some(&closed(ErrorCode::NoError))));
        assert!(!closed_for_certificate(Some(&closed(ErrorCode::ProtocolViolation))));
        assert!(!closed_for_certificate(Some(&quinn::ConnectionError::TimedOut)));
        assert!(!closed_for_certificate(None));
    }

    #[test]
    fn only_the_servers_superseded_close_counts_as_another_agent_with_our_spool() {
        let closed = |code: ErrorCode, why: &'static [u8]| {
            quinn::ConnectionError::ApplicationClosed(quinn::ApplicationClose {
                error_code: code.to_u32().into(),
                reason: bytes::Bytes::from_static(why),
            })
        };
        assert!(closed_as_superseded(Some(&closed(ErrorCode::NoError, edge_proto::SUPERSEDED_REASON))));
        assert!(!closed_as_superseded(Some(&closed(ErrorCode::NoError, b"bye"))));
        assert!(!closed_as_superseded(Some(&closed(ErrorCode::Internal, edge_proto::SUPERSEDED_REASON))));
        assert!(!closed_as_superseded(Some(&quinn::ConnectionError::TimedOut)));
        assert!(!closed_as_superseded(None));
    }

    #[test]
    fn older_chunks_get_higher_send_priority() {
        assert!(chunk_priority(ChunkId(1)) > chunk_priority(ChunkId(2)));
        assert!(chunk_priority(ChunkId(1_000_000)) > chunk_priority(ChunkId(1_000_001)));
        assert_eq!(chunk_priority(ChunkId(0x4000_0000)), 0);
        assert_eq!(chunk_priority(ChunkId(i64::MAX)), -0x3FFF_FFFF);
    }

    #[test]
    fn backoff_grows_to_the_cap_and_resets() {
        let mut b = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
        let mut last_cap = Duration::ZERO;
        for _ in 0..10 {
            let d = b.next_delay();
            assert!(d <= Duration::from_secs(1), "{d:?} over the cap");
            last_cap = b.cur;
        }
        assert_eq!(last_cap, Duration::from_secs(1));
        b.reset();
        assert!(b.next_delay() <= Duration::from_millis(100));
    }

    #[test]
    fn in_flight_room_needs_both_budgets_but_always_admits_one_chunk() {
        let mut f = InFlight::default();
        let meta = |id| ChunkMeta {
            id: ChunkId(id),
            stream: "s".into(),
            seq: id as u64,
            records: 1,
            bytes: 0,
            first_ms: 0,
            sealed_ms: 0,
        };
        // Nothing in flight: a chunk goes even if the byte budget is smaller than it.
        assert!(f.has_room(1, 1));
        f.insert(&meta(1), 10 << 20);
        assert!(!f.has_room(32, 8 << 20), "10 MiB in flight is over an 8 MiB budget");
        f.remove(ChunkId(1));
        assert!(f.has_room(32, 8 << 20));
        for id in 1..=7 {
            f.insert(&meta(id), 512 << 10);
        }
        assert!(f.has_room(32, 4 << 20), "3.5 MiB of 4 MiB: room for one more");
        f.insert(&meta(8), 512 << 10);
        assert!(!f.has_room(32, 4 << 20), "4 MiB of 4 MiB: no room");
        assert!(!f.has_room(8, 1 << 30), "8 of 8 chunks: no room");
        // Re-inserting a chunk does not count its bytes twice; removing frees them.
        f.insert(&meta(8), 512 << 10);
        assert_eq!(f.bytes, 4 << 20);
        f.remove(ChunkId(8));
        f.remove(ChunkId(8));
        assert_eq!((f.len(), f.bytes), (7, 7 * (512 << 10)));
        assert!(f.has_room(8, 4 << 20));
    }

    #[test]
    fn latency_quantiles_come_from_the_samples() {
        let mut s = LatencySamples::default();
        assert_eq!(s.quantile(0.5), None);
        for ms in 1..=100 {
            s.record(ms);
        }
        assert_eq!(s.quantile(0.0), Some(1));
        assert_eq!(s.quantile(1.0), Some(100));
        let p50 = s.quantile(0.5).expect("samples");
        assert!((50..=51).contains(&p50), "{p50}");
    }
}
