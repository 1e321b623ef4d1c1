//! Prometheus metrics of the agent: every metric name, the handles updated where things happen,
//! a collector that reads live state when scraped, and the `/metrics` HTTP server (the plumbing
//! shared with the ingest server is in [`edge_telemetry::metrics`]).
//!
//! Conventions: names start with `edge_uploader_`; values are in base units (seconds, bytes);
//! counters end in `_total`; histograms carry no labels; every label has a bounded set of values:
//! `stream` takes at most [`MAX_STREAM_LABELS`] distinct values (later streams are counted under
//! [`OTHER_STREAM`]), `result` and `reason` are closed sets. The process collector adds the
//! standard, unprefixed `process_*` metrics.
//!
//! Each quantity is counted once. What `GET /v1/status` and the demo read too stays in the
//! atomics of [`UploadCounters`] and [`IntakeCounters`](crate::intake::IntakeCounters), and the
//! spool's figures stay in its statistics snapshot; [`LiveCollector`] turns them into metric
//! families at scrape time. Only what nothing else keeps (per-stream and per-reason counts,
//! latency histograms, QUIC path figures) lives in prometheus handles.
//!
//! The daemon creates one [`Registry`], [`register`]s everything into it and serves it with
//! [`MetricsServer`]. Agents started by tests or the demo count the same way but register nothing.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use edge_spool::ChunkMeta;
use edge_telemetry::metrics::{Live, LiveCollector};
pub use edge_telemetry::metrics::{MetricsServer, encode};
use prometheus::proto::MetricFamily;
use prometheus::{Gauge, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::intake::{IntakeCounters, Rejection};
use crate::spool_task::SpoolStatsView;
use crate::uploader::UploadCounters;

/// Prefix of every metric of this daemon.
pub const PREFIX: &str = "edge_uploader_";

/// Records committed by the intake, by `stream`.
pub const INTAKE_RECORDS_TOTAL: &str = "edge_uploader_intake_records_total";
/// Record bytes committed by the intake, by `stream`.
pub const INTAKE_BYTES_TOTAL: &str = "edge_uploader_intake_bytes_total";
/// Intake requests refused, by `reason`.
pub const INTAKE_REJECTED_TOTAL: &str = "edge_uploader_intake_rejected_total";
/// Memory held by record-stream connections (receive buffers, records gathered and committing).
pub const INTAKE_STREAM_BUFFER_BYTES: &str = "edge_uploader_intake_stream_buffer_bytes";
/// Memory held by HTTP requests (their records framed, to the end of their commit).
pub const INTAKE_REQUEST_BUFFER_BYTES: &str = "edge_uploader_intake_request_buffer_bytes";
/// HTTP requests waiting for room in `intake.request_pending_total_bytes` before their body is read.
pub const INTAKE_REQUESTS_WAITING: &str = "edge_uploader_intake_requests_waiting";
/// Producer connections open on the intake sockets.
pub const INTAKE_CONNECTIONS: &str = "edge_uploader_intake_connections";
/// Times the intake stopped accepting at `intake.max_connections` until a connection closed.
pub const INTAKE_CONNECTION_LIMIT_WAITS_TOTAL: &str = "edge_uploader_intake_connection_limit_waits_total";
/// Bytes held in the spool.
pub const SPOOL_BYTES: &str = "edge_uploader_spool_bytes";
/// Sealed chunks waiting for an ack.
pub const SPOOL_CHUNKS: &str = "edge_uploader_spool_chunks";
/// Streams the spool knows (never forgotten; capped by `spool.max_streams`).
pub const SPOOL_STREAMS: &str = "edge_uploader_spool_streams";
/// Disk space the spool's files take.
pub const SPOOL_DISK_BYTES: &str = "edge_uploader_spool_disk_bytes";
/// Age of the oldest record not yet acked.
pub const SPOOL_OLDEST_UNACKED_AGE_SECONDS: &str = "edge_uploader_spool_oldest_unacked_age_seconds";
/// Chunk bytes by the server's answer (`result`).
pub const UPLOAD_BYTES_TOTAL: &str = "edge_uploader_upload_bytes_total";
/// Chunks by the server's answer (`result`).
pub const UPLOAD_CHUNKS_TOTAL: &str = "edge_uploader_upload_chunks_total";
/// Histogram: chunk sealed → durable ack.
pub const CHUNK_UPLOAD_LATENCY_SECONDS: &str = "edge_uploader_chunk_upload_latency_seconds";
/// Histogram: intake commit of a chunk's oldest record → durable ack.
pub const END_TO_END_LATENCY_SECONDS: &str = "edge_uploader_end_to_end_latency_seconds";
/// Chunks sent and waiting for their ack.
pub const CHUNKS_IN_FLIGHT: &str = "edge_uploader_chunks_in_flight";
/// 1 while connected to the ingest server.
pub const CONNECTED: &str = "edge_uploader_connected";
/// Connections established after the first one.
pub const RECONNECTS_TOTAL: &str = "edge_uploader_reconnects_total";
/// Connections the ingest closed for a newer one with this agent's certificate and spool id,
/// which this agent did not open: another gateway shares both.
pub const CONNECTIONS_SUPERSEDED_TOTAL: &str = "edge_uploader_connections_superseded_total";
/// Connection attempts started, successful or not.
pub const CONNECT_ATTEMPTS_TOTAL: &str = "edge_uploader_connect_attempts_total";
/// Reconnect backoff waits ended early by the gateway's network (a link up, a default route).
pub const NETWORK_WAKEUPS_TOTAL: &str = "edge_uploader_network_wakeups_total";
/// Probes sent to the server while it did not answer connection attempts.
pub const PROBES_SENT_TOTAL: &str = "edge_uploader_probes_sent_total";
/// Reconnect backoff waits ended early by an answered probe.
pub const PROBE_WAKEUPS_TOTAL: &str = "edge_uploader_probe_wakeups_total";
/// Floors sent to the ingest: a stream's lowest seq still to come.
pub const FLOORS_SENT_TOTAL: &str = "edge_uploader_floors_sent_total";
/// Histogram: connection attempt started → session established (the server's Welcome).
pub const CONNECT_SECONDS: &str = "edge_uploader_connect_seconds";
/// Chunk payload bytes sent and waiting for their ack.
pub const BYTES_IN_FLIGHT: &str = "edge_uploader_bytes_in_flight";
/// QUIC round-trip time.
pub const QUIC_RTT_SECONDS: &str = "edge_uploader_quic_rtt_seconds";
/// QUIC packets lost.
pub const QUIC_LOST_PACKETS_TOTAL: &str = "edge_uploader_quic_lost_packets_total";
/// QUIC congestion window.
pub const QUIC_CONGESTION_WINDOW_BYTES: &str = "edge_uploader_quic_congestion_window_bytes";
/// Records deleted from the spool without being sent, by `reason`.
pub const DROPPED_RECORDS_TOTAL: &str = "edge_uploader_dropped_records_total";
/// Chunks found corrupt in the spool (checksum or SQLite damage) and quarantined, never sent.
pub const SPOOL_CORRUPT_CHUNKS_TOTAL: &str = "edge_uploader_spool_corrupt_chunks_total";
/// Chunks held in quarantine in the spool (corrupt, or refused by the server).
pub const SPOOL_QUARANTINED_CHUNKS: &str = "edge_uploader_spool_quarantined_chunks";
/// Chunks sent as the spool thread handed them over, not read back from the spool.
pub const UPLOAD_CHUNKS_FROM_MEMORY_TOTAL: &str = "edge_uploader_upload_chunks_from_memory_total";
/// Chunk payload bytes written to the ingest's streams, after compression, every attempt.
pub const UPLOAD_WIRE_BYTES_TOTAL: &str = "edge_uploader_upload_wire_bytes_total";
/// Histogram: a spool commit that producers or seals wait for, from its start to settled.
pub const SPOOL_COMMIT_SECONDS: &str = "edge_uploader_spool_commit_seconds";
/// How long the spool thread busy the longest has been at its current commit or fsync.
pub const SPOOL_BUSY_SECONDS: &str = "edge_uploader_spool_busy_seconds";

/// Every metric name above.
pub const ALL: [&str; 38] = [
    INTAKE_RECORDS_TOTAL,
    INTAKE_BYTES_TOTAL,
    INTAKE_REJECTED_TOTAL,
    INTAKE_STREAM_BUFFER_BYTES,
    INTAKE_REQUEST_BUFFER_BYTES,
    INTAKE_REQUESTS_WAITING,
    INTAKE_CONNECTIONS,
    INTAKE_CONNECTION_LIMIT_WAITS_TOTAL,
    SPOOL_BYTES,
    SPOOL_DISK_BYTES,
    SPOOL_CHUNKS,
    SPOOL_STREAMS,
    SPOOL_OLDEST_UNACKED_AGE_SECONDS,
    SPOOL_BUSY_SECONDS,
    UPLOAD_BYTES_TOTAL,
    UPLOAD_CHUNKS_TOTAL,
    CHUNK_UPLOAD_LATENCY_SECONDS,
    END_TO_END_LATENCY_SECONDS,
    CHUNKS_IN_FLIGHT,
    CONNECTED,
    RECONNECTS_TOTAL,
    CONNECTIONS_SUPERSEDED_TOTAL,
    CONNECT_ATTEMPTS_TOTAL,
    NETWORK_WAKEUPS_TOTAL,
    PROBES_SENT_TOTAL,
    PROBE_WAKEUPS_TOTAL,
    FLOORS_SENT_TOTAL,
    CONNECT_SECONDS,
    BYTES_IN_FLIGHT,
    QUIC_RTT_SECONDS,
    QUIC_LOST_PACKETS_TOTAL,
    QUIC_CONGESTION_WINDOW_BYTES,
    DROPPED_RECORDS_TOTAL,
    SPOOL_CORRUPT_CHUNKS_TOTAL,
    SPOOL_QUARANTINED_CHUNKS,
    UPLOAD_CHUNKS_FROM_MEMORY_TOTAL,
    UPLOAD_WIRE_BYTES_TOTAL,
    SPOOL_COMMIT_SECONDS,
];

/// Distinct `stream` label values before further streams are folded into [`OTHER_STREAM`].
pub const MAX_STREAM_LABELS: usize = 64;
/// The `stream` label value of every stream past the first [`MAX_STREAM_LABELS`].
pub const OTHER_STREAM: &str = "other";

/// Histogram buckets in seconds, 1 ms to 30 s in 1-2.5-5 steps, then up to 5 min: on a slow or
/// lossy uplink, and after an outage, chunks wait minutes for their ack.
pub const LATENCY_BUCKETS: [f64; 18] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0];

/// Buckets of [`SPOOL_COMMIT_SECONDS`] in seconds, 100 µs to 10 s, 1-2.5-5 steps: a commit and
/// its syncs are far quicker than a chunk's trip to the server, and as slow as the disk.
pub const COMMIT_BUCKETS: [f64; 16] =
    [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// The histogram behind [`SPOOL_COMMIT_SECONDS`]; the spool thread observes it.
pub(crate) fn spool_commit_histogram() -> Histogram {
    Histogram::with_opts(
        HistogramOpts::new(
            SPOOL_COMMIT_SECONDS,
            "Time from the start of a spool commit that appends records or seals chunks to the moment it is settled: \
             committed and, with durability = \"full\", the WAL fsynced after it. What producers wait for once the \
             spool thread takes their requests.",
        )
        .buckets(COMMIT_BUCKETS.to_vec()),
    )
    .expect("constant name and help, increasing buckets")
}

/// How often the QUIC path figures are sampled while connected.
pub const QUIC_SAMPLE_PERIOD: Duration = Duration::from_secs(1);

/// Per-stream and per-reason intake counts (the totals are atomics in `IntakeCounters`).
#[derive(Debug)]
pub struct IntakeMetrics {
    records: IntCounterVec,
    bytes: IntCounterVec,
    rejected: IntCounterVec,
    /// Streams that have their own label value; at most [`MAX_STREAM_LABELS`].
    streams: Mutex<HashSet<String>>,
}

impl Default for IntakeMetrics {
    fn default() -> Self {
        let records = counter_vec(
            INTAKE_RECORDS_TOTAL,
            "Records the intake committed to the spool, by stream (streams past the first 64 are counted as \"other\").",
            "stream",
        );
        let bytes = counter_vec(
            INTAKE_BYTES_TOTAL,
            "Record bytes the intake committed to the spool (without framing), by stream.",
            "stream",
        );
        let rejected = counter_vec(
            INTAKE_REJECTED_TOTAL,
            "Intake requests refused as a whole, by reason (the error code of the answer).",
            "reason",
        );
        for reason in Rejection::ALL {
            rejected.with_label_values(&[reason.as_str()]);
        }
        Self { records, bytes, rejected, streams: Mutex::new(HashSet::new()) }
    }
}

impl IntakeMetrics {
    /// Counts a committed request.
    pub fn accepted(&self, stream: &str, records: u64, bytes: u64) {
        let label = self.stream_label(stream);
        self.records.with_label_values(&[label]).inc_by(records);
        self.bytes.with_label_values(&[label]).inc_by(bytes);
    }

    /// Counts a refused request.
    pub fn rejected(&self, reason: Rejection) {
        self.rejected.with_label_values(&[reason.as_str()]).inc();
    }

    /// The stream's own name while there is room for it, [`OTHER_STREAM`] after that.
    fn stream_label<'a>(&self, stream: &'a str) -> &'a str {
        let mut seen = crate::lock(&self.streams);
        if seen.contains(stream) {
            return stream;
        }
        if seen.len() < MAX_STREAM_LABELS {
            seen.insert(stream.to_owned());
            return stream;
        }
        OTHER_STREAM
    }

    fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.records.clone()))?;
        registry.register(Box::new(self.bytes.clone()))?;
        registry.register(Box::new(self.rejected.clone()))
    }
}

/// Latency histograms and QUIC path figures (the ack counts are atomics in `UploadCounters`).
#[derive(Debug)]
pub struct UploadMetrics {
    chunk_latency: Histogram,
    end_to_end_latency: Histogram,
    connect: Histogram,
    quic_rtt: Gauge,
    quic_lost: IntCounter,
    quic_cwnd: IntGauge,
}

impl Default for UploadMetrics {
    fn default() -> Self {
        Self {
            chunk_latency: latency_histogram(
                CHUNK_UPLOAD_LATENCY_SECONDS,
                "Time from sealing a chunk to the server's durable ack of it (Stored or Duplicate).",
            ),
            end_to_end_latency: latency_histogram(
                END_TO_END_LATENCY_SECONDS,
                "Time from the intake commit of a chunk's oldest record to the server's durable ack of the chunk.",
            ),
            connect: latency_histogram(
                CONNECT_SECONDS,
                "Time from the start of a connection attempt (name resolution, QUIC handshake) to the session established by the server's Welcome, over the attempts that got there.",
            ),
            quic_rtt: Gauge::new(
                QUIC_RTT_SECONDS,
                "Smoothed round-trip time of the QUIC connection, sampled every second (kept while disconnected).",
            )
            .expect("constant name and help are valid"),
            quic_lost: IntCounter::new(QUIC_LOST_PACKETS_TOTAL, "QUIC packets declared lost, over all connections.")
                .expect("constant name and help are valid"),
            quic_cwnd: IntGauge::new(
                QUIC_CONGESTION_WINDOW_BYTES,
                "Congestion window of the QUIC connection, sampled every second (kept while disconnected).",
            )
            .expect("constant name and help are valid"),
        }
    }
}

impl UploadMetrics {
    /// Observes the latencies of a chunk the server acked as durable at `now_ms`.
    pub fn acked(&self, meta: &ChunkMeta, now_ms: u64) {
        self.chunk_latency.observe(ms_to_secs(now_ms.saturating_sub(meta.sealed_ms)));
        self.end_to_end_latency.observe(ms_to_secs(now_ms.saturating_sub(meta.first_ms)));
    }

    /// Observes a connection attempt that reached an established session after `took`.
    pub fn session_established(&self, took: Duration) {
        self.connect.observe(took.as_secs_f64());
    }

    /// The last sampled round-trip time in seconds (0 before the first sample).
    pub fn rtt_seconds(&self) -> f64 {
        self.quic_rtt.get()
    }

    /// Reads the connection's path statistics; `last_lost` is the loss count already added.
    fn sample_path(&self, conn: &quinn::Connection, last_lost: &mut u64) {
        let stats = conn.stats();
        self.quic_rtt.set(conn.rtt().as_secs_f64());
        self.quic_cwnd.set(i64::try_from(stats.path.cwnd).unwrap_or(i64::MAX));
        let lost = stats.path.lost_packets;
        self.quic_lost.inc_by(lost.saturating_sub(*last_lost));
        *last_lost = lost.max(*last_lost);
    }

    fn register(&self, registry: &Registry) -> prometheus::Result<()> {
        registry.register(Box::new(self.chunk_latency.clone()))?;
        registry.register(Box::new(self.end_to_end_latency.clone()))?;
        registry.register(Box::new(self.connect.clone()))?;
        registry.register(Box::new(self.quic_rtt.clone()))?;
        registry.register(Box::new(self.quic_lost.clone()))?;
        registry.register(Box::new(self.quic_cwnd.clone()))
    }
}

/// Samples one connection's path statistics every [`QUIC_SAMPLE_PERIOD`] until stopped.
#[derive(Debug)]
pub struct QuicSampler {
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl QuicSampler {
    /// Starts sampling `conn` at once.
    pub fn spawn(conn: quinn::Connection, counters: Arc<UploadCounters>) -> Self {
        let stop = CancellationToken::new();
        let stopped = stop.clone();
        let task = tokio::spawn(async move {
            let mut last_lost = 0;
            let mut tick = tokio::time::interval(QUIC_SAMPLE_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    () = stopped.cancelled() => break,
                    _ = tick.tick() => counters.metrics.sample_path(&conn, &mut last_lost),
                }
            }
            // Losses up to the end of the connection count too.
            counters.metrics.sample_path(&conn, &mut last_lost);
        });
        Self { stop, task }
    }

    /// Takes a last sample and stops.
    pub async fn stop(self) {
        self.stop.cancel();
        if let Err(e) = self.task.await {
            warn!(error = %e, "QUIC metrics sampler failed");
        }
    }
}

/// Registers every agent metric in `registry`: the handles in the counters, a collector over
/// the spool statistics and the upload atomics, and (on Linux) the process collector.
pub fn register(
    registry: &Registry,
    spool: SpoolStatsView,
    intake: &Arc<IntakeCounters>,
    upload: &Arc<UploadCounters>,
) -> prometheus::Result<()> {
    intake.metrics.register(registry)?;
    upload.metrics.register(registry)?;
    registry.register(Box::new(spool.commit_seconds().clone()))?;
    let (intake, upload) = (intake.clone(), upload.clone());
    registry.register(Box::new(LiveCollector::new(&LIVE_ALL, move || live_families(&spool, &intake, &upload))?))?;
    #[cfg(target_os = "linux")]
    registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
    Ok(())
}

const LIVE_STREAM_BUFFER: Live = Live::gauge(
    INTAKE_STREAM_BUFFER_BYTES,
    "Memory the record-stream intake's connections hold: their receive buffers and the buffers of the records each gathers \
           while its previous append commits (per connection at most about intake.stream_pending_bytes gathered and as much committing, \
           all connections' record buffers together at most intake.stream_pending_total_bytes and a record).",
);
const LIVE_REQUEST_BUFFER: Live = Live::gauge(
    INTAKE_REQUEST_BUFFER_BYTES,
    "Memory the HTTP intake's requests hold: the buffers their records are framed into, from the first byte read to the end \
           of their commit (the bodies of all requests together at most intake.request_pending_total_bytes, or one larger request alone).",
);
const LIVE_REQUESTS_WAITING: Live = Live::gauge(
    INTAKE_REQUESTS_WAITING,
    "HTTP intake requests waiting for room in intake.request_pending_total_bytes before their body is read, \
           or for more of a body sent without Content-Length (their producers are held back; a lasting non-zero value means the budget or the spool's commits limit the intake).",
);
const LIVE_CONNECTIONS: Live = Live::gauge(
    INTAKE_CONNECTIONS,
    "Producer connections open on the intake sockets, HTTP and record stream together (at most intake.max_connections).",
);
const LIVE_CONNECTION_LIMIT_WAITS: Live = Live::counter(
    INTAKE_CONNECTION_LIMIT_WAITS_TOTAL,
    "Times an intake socket found intake.max_connections connections open and stopped accepting until one closed \
           (new producers wait in the socket's backlog meanwhile; a producer that leaks connections, or a limit too low).",
);
const LIVE_SPOOL_BYTES: Live = Live::gauge(
    SPOOL_BYTES,
    "Payload bytes in the spool: open batches and sealed chunks, record framing included, quarantine excluded.",
);
const LIVE_SPOOL_DISK_BYTES: Live = Live::gauge(
    SPOOL_DISK_BYTES,
    "Disk space the spool's files take, from their allocated blocks at scrape time: the database, its WAL, \
           the payload segment files (whole, dead bytes of partly acked segments included) and the spare \
           segment; not the disk reserve. Can exceed edge_uploader_spool_bytes and spool.max_bytes.",
);
const LIVE_SPOOL_BUSY: Live = Live::gauge(
    SPOOL_BUSY_SECONDS,
    "How long the spool thread busy the longest (the writer in one commit, or the sync thread in one fsync) has \
           been at it, at scrape time; 0 while both wait for work. Milliseconds on a healthy disk; seconds mean \
           producers and acks wait on a disk that does not answer (status is degraded from 10 s, the watchdog \
           ping withheld from half of WatchdogSec).",
);
const LIVE_SPOOL_CHUNKS: Live =
    Live::gauge(SPOOL_CHUNKS, "Sealed chunks in the spool waiting for the server's ack (quarantine excluded).");
const LIVE_SPOOL_STREAMS: Live = Live::gauge(
    SPOOL_STREAMS,
    "Streams the spool knows. A stream is never forgotten (its sequence numbers go on); at spool.max_streams, \
     requests naming a new one are refused (intake reason too_many_streams).",
);
const LIVE_OLDEST_AGE: Live = Live::gauge(
    SPOOL_OLDEST_UNACKED_AGE_SECONDS,
    "Age of the oldest record in the spool, i.e. not yet acked by the server; 0 when the spool is empty.",
);
const LIVE_DROPPED: Live = Live::counter(
    DROPPED_RECORDS_TOTAL,
    "Records deleted from the spool without being sent, by reason (spool_full: evicted by \
           full_policy = \"drop_oldest\"). Kept in the spool, so it survives restarts.",
)
.labelled("reason");
const LIVE_UPLOAD_CHUNKS: Live = Live::counter(
    UPLOAD_CHUNKS_TOTAL,
    "Chunks by the server's answer: stored, duplicate (the server had it already), retry (offered again \
           later), rejected (quarantined).",
)
.labelled("result");
const LIVE_UPLOAD_BYTES: Live = Live::counter(
    UPLOAD_BYTES_TOTAL,
    "Chunk payload bytes (record framing included, before compression) by the server's answer.",
)
.labelled("result");
const LIVE_IN_FLIGHT: Live = Live::gauge(CHUNKS_IN_FLIGHT, "Chunks sent to the server and waiting for their ack.");
const LIVE_CONNECTED: Live =
    Live::gauge(CONNECTED, "1 while a QUIC connection to the ingest server is up, 0 otherwise.");
const LIVE_SUPERSEDED: Live = Live::counter(
    CONNECTIONS_SUPERSEDED_TOTAL,
    "Connections the ingest server closed for a newer one with this agent's device certificate and spool id, \
     which this agent did not open: another gateway used both (a cloned disk image), and the ingest took the \
     two gateways' chunks with the same sequence numbers for one another's until this agent gave its spool a \
     new id, which it does at once unless the spool cannot be written (the log says which).",
);
const LIVE_RECONNECTS: Live =
    Live::counter(RECONNECTS_TOTAL, "Connections to the ingest server established after the first one since start.");
const LIVE_CONNECT_ATTEMPTS: Live = Live::counter(
    CONNECT_ATTEMPTS_TOTAL,
    "Connection attempts to the ingest server since start, successful or not (each bounded by upload.connect_timeout).",
);
const LIVE_NETWORK_WAKEUPS: Live = Live::counter(
    NETWORK_WAKEUPS_TOTAL,
    "Reconnect backoff waits ended early since start because a link came up or a default route appeared \
           on the gateway (upload.watch_network): the agent tried again a moment later instead of at the end \
           of the wait.",
);
const LIVE_PROBES_SENT: Live = Live::counter(
    PROBES_SENT_TOTAL,
    "Probes (1,200-byte datagrams) sent to the ingest server since start while a reconnect backoff waited \
           after attempts that got no answer (upload.probe_interval).",
);
const LIVE_PROBE_WAKEUPS: Live = Live::counter(
    PROBE_WAKEUPS_TOTAL,
    "Reconnect backoff waits ended early since start because the ingest server answered a probe \
           (upload.probe_interval): the agent tried again at once instead of at the end of the wait.",
);
const LIVE_FLOORS_SENT: Live = Live::counter(
    FLOORS_SENT_TOTAL,
    "Floors sent to the ingest since start: after a chunk was answered retry (overloaded), the \
           lowest seq of its stream still to come, so that an ingest at the device's cap of gaps in its dedup \
           index closes the gaps of chunks this agent dropped (spool full) or quarantined. None to an ingest \
           of protocol version 1.",
);
const LIVE_BYTES_IN_FLIGHT: Live = Live::gauge(
    BYTES_IN_FLIGHT,
    "Chunk payload bytes sent to the server and waiting for their ack (held below upload.max_in_flight_bytes plus one chunk).",
);
const LIVE_CORRUPT: Live = Live::counter(
    SPOOL_CORRUPT_CHUNKS_TOTAL,
    "Chunks whose bytes failed their checksum (or whose pages SQLite found damaged) when read for upload; \
           each was quarantined and never sent. Counted since start; `edge-uploader spool check` lists them.",
);
const LIVE_QUARANTINED: Live = Live::gauge(
    SPOOL_QUARANTINED_CHUNKS,
    "Chunks held in quarantine in the spool (corrupt, or refused by the server), kept for inspection.",
);
const LIVE_FROM_MEMORY: Live = Live::counter(
    UPLOAD_CHUNKS_FROM_MEMORY_TOTAL,
    "Chunks sent as the spool thread handed them over when it sealed them, without reading them back \
           from the spool (the uploader keeps up). The other chunks sent were read from the spool (a backlog, \
           a reconnect).",
);
const LIVE_WIRE_BYTES: Live = Live::counter(
    UPLOAD_WIRE_BYTES_TOTAL,
    "Chunk payload bytes written to the server's streams as sent, after compression (spool.compression), \
           counted on every attempt, so a chunk sent again counts again. Against \
           edge_uploader_upload_bytes_total it shows what compression saves on the uplink.",
);
const LIVE_ALL: [&Live; 28] = [
    &LIVE_STREAM_BUFFER,
    &LIVE_REQUEST_BUFFER,
    &LIVE_REQUESTS_WAITING,
    &LIVE_CONNECTIONS,
    &LIVE_CONNECTION_LIMIT_WAITS,
    &LIVE_SPOOL_BYTES,
    &LIVE_SPOOL_DISK_BYTES,
    &LIVE_SPOOL_CHUNKS,
    &LIVE_SPOOL_STREAMS,
    &LIVE_OLDEST_AGE,
    &LIVE_SPOOL_BUSY,
    &LIVE_DROPPED,
    &LIVE_UPLOAD_CHUNKS,
    &LIVE_UPLOAD_BYTES,
    &LIVE_IN_FLIGHT,
    &LIVE_CONNECTED,
    &LIVE_RECONNECTS,
    &LIVE_SUPERSEDED,
    &LIVE_CONNECT_ATTEMPTS,
    &LIVE_NETWORK_WAKEUPS,
    &LIVE_PROBES_SENT,
    &LIVE_PROBE_WAKEUPS,
    &LIVE_FLOORS_SENT,
    &LIVE_BYTES_IN_FLIGHT,
    &LIVE_CORRUPT,
    &LIVE_QUARANTINED,
    &LIVE_FROM_MEMORY,
    &LIVE_WIRE_BYTES,
];

/// The [`LIVE_ALL`] families from the spool statistics and the intake and upload atomics, at
/// scrape time.
fn live_families(spool: &SpoolStatsView, intake: &IntakeCounters, u: &UploadCounters) -> Vec<MetricFamily> {
    use std::sync::atomic::Ordering::Relaxed;
    let s = spool.get();
    let age = s.oldest_ms.map_or(0.0, |t| ms_to_secs(now_ms().saturating_sub(t)));
    let results = |f: fn(&crate::uploader::AckCounter) -> u64| {
        [
            ("stored", f(&u.stored) as f64),
            ("duplicate", f(&u.duplicate) as f64),
            ("retry", f(&u.retry) as f64),
            ("rejected", f(&u.rejected) as f64),
        ]
    };
    vec![
        LIVE_STREAM_BUFFER.family(&[("", intake.stream_buffer_bytes.load(Relaxed) as f64)]),
        LIVE_REQUEST_BUFFER.family(&[("", intake.request_buffer_bytes.load(Relaxed) as f64)]),
        LIVE_REQUESTS_WAITING.family(&[("", intake.requests_waiting.load(Relaxed) as f64)]),
        LIVE_CONNECTIONS.family(&[("", intake.connections.load(Relaxed) as f64)]),
        LIVE_CONNECTION_LIMIT_WAITS.family(&[("", intake.connection_limit_waits_total.load(Relaxed) as f64)]),
        LIVE_SPOOL_BYTES.family(&[("", s.total_bytes as f64)]),
        LIVE_SPOOL_DISK_BYTES.family(&[("", spool.disk_bytes().map_or(f64::NAN, |n| n as f64))]),
        LIVE_SPOOL_CHUNKS.family(&[("", s.sealed_chunks as f64)]),
        LIVE_SPOOL_STREAMS.family(&[("", s.streams.len() as f64)]),
        LIVE_OLDEST_AGE.family(&[("", age)]),
        LIVE_SPOOL_BUSY.family(&[("", spool.busy().map_or(0.0, |(_, d)| d.as_secs_f64()))]),
        LIVE_DROPPED.family(&[("spool_full", s.dropped_records as f64)]),
        LIVE_UPLOAD_CHUNKS.family(&results(crate::uploader::AckCounter::chunks)),
        LIVE_UPLOAD_BYTES.family(&results(crate::uploader::AckCounter::bytes)),
        LIVE_IN_FLIGHT.family(&[("", u.in_flight.load(Relaxed) as f64)]),
        LIVE_CONNECTED.family(&[("", if u.connected.load(Relaxed) { 1.0 } else { 0.0 })]),
        LIVE_RECONNECTS.family(&[("", u.connects_total.load(Relaxed).saturating_sub(1) as f64)]),
        LIVE_SUPERSEDED.family(&[("", u.superseded_total.load(Relaxed) as f64)]),
        LIVE_CONNECT_ATTEMPTS.family(&[("", u.connect_attempts_total.load(Relaxed) as f64)]),
        LIVE_NETWORK_WAKEUPS.family(&[("", u.network_wakeups_total.load(Relaxed) as f64)]),
        LIVE_PROBES_SENT.family(&[("", u.probes_sent_total.load(Relaxed) as f64)]),
        LIVE_PROBE_WAKEUPS.family(&[("", u.probe_wakeups_total.load(Relaxed) as f64)]),
        LIVE_FLOORS_SENT.family(&[("", u.floors_sent_total.load(Relaxed) as f64)]),
        LIVE_BYTES_IN_FLIGHT.family(&[("", u.in_flight_bytes.load(Relaxed) as f64)]),
        LIVE_CORRUPT.family(&[("", u.spool_corrupt_chunks.load(Relaxed) as f64)]),
        LIVE_QUARANTINED.family(&[("", s.quarantined_chunks as f64)]),
        LIVE_FROM_MEMORY.family(&[("", u.chunks_from_memory.load(Relaxed) as f64)]),
        LIVE_WIRE_BYTES.family(&[("", u.wire_bytes_total.load(Relaxed) as f64)]),
    ]
}

/// Binds the metrics listener (`None` when metrics are disabled); see [`edge_telemetry::metrics::bind`].
pub async fn bind(listen: Option<SocketAddr>) -> anyhow::Result<Option<TcpListener>> {
    edge_telemetry::metrics::bind(listen).await.context("metrics.listen")
}

fn counter_vec(name: &str, help: &str, label: &str) -> IntCounterVec {
    IntCounterVec::new(Opts::new(name, help), &[label]).expect("constant name, help and label are valid")
}

fn latency_histogram(name: &str, help: &str) -> Histogram {
    Histogram::with_opts(HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()))
        .expect("constant name and help, increasing buckets")
}

fn ms_to_secs(ms: u64) -> f64 {
    ms as f64 / 1000.0
}

fn now_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0),
    )
    .unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::spool_task::SpoolHandle;

    /// A registry with every agent metric over a real (empty) spool.
    struct Rig {
        _dir: tempfile::TempDir,
        registry: Registry,
        intake: Arc<IntakeCounters>,
        upload: Arc<UploadCounters>,
        spool: Option<SpoolHandle>,
        thread: Option<crate::spool_task::SpoolThread>,
    }

    impl Rig {
        fn new() -> Rig {
            let dir = tempfile::tempdir().expect("tempdir");
            let (spool, _) =
                edge_spool::Spool::open(edge_spool::SpoolOptions::new(dir.path().join("spool.db"))).expect("spool");
            let (spool, thread) = SpoolHandle::spawn(spool).expect("spool thread");
            let registry = Registry::new();
            let intake = Arc::new(IntakeCounters::default());
            let upload = Arc::new(UploadCounters::default());
            register(&registry, spool.stats_view(), &intake, &upload).expect("register");
            Rig { _dir: dir, registry, intake, upload, spool: Some(spool), thread: Some(thread) }
        }

        /// `(name, type)` of every family, from the text encoding.
        fn families(&self) -> Vec<(String, String)> {
            let text = encode(&self.registry).expect("encode");
            text.lines()
                .filter_map(|l| l.strip_prefix("# TYPE "))
                .map(|l| {
                    let (name, kind) = l.split_once(' ').expect("# TYPE name kind");
                    (name.to_owned(), kind.to_owned())
                })
                .collect()
        }

        fn sample(&self, series: &str) -> Option<f64> {
            let text = encode(&self.registry).expect("encode");
            text.lines()
                .filter(|l| !l.starts_with('#'))
                .find_map(|l| l.rsplit_once(' ').filter(|(k, _)| *k == series).map(|(_, v)| v.parse().expect("value")))
        }
    }

    impl Drop for Rig {
        fn drop(&mut self) {
            drop(self.spool.take());
            if let Some(t) = self.thread.take() {
                t.join();
            }
        }
    }

    #[test]
    fn every_family_has_the_prefix_and_counters_end_in_total() {
        let rig = Rig::new();
        rig.intake.metrics.accepted("temperature", 1, 10);
        let families = rig.families();
        for (name, kind) in &families {
            assert!(
                name.starts_with(PREFIX) || name.starts_with("process_"),
                "{name} has neither the {PREFIX} prefix nor the standard process_ one"
            );
            assert_eq!(name.ends_with("_total"), kind == "counter", "{name} is a {kind}: only counters end in _total");
        }
        for name in ALL {
            assert!(families.iter().any(|(n, _)| n == name), "{name} is not exported; got {families:?}");
            let unit = name.trim_end_matches("_total");
            if ["latency", "_age", "_rtt"].iter().any(|t| name.contains(t)) {
                assert!(unit.ends_with("_seconds"), "{name} measures time: base unit seconds");
            }
        }
        if cfg!(target_os = "linux") {
            assert!(families.iter().any(|(n, _)| n == "process_resident_memory_bytes"), "{families:?}");
        }
        let kind = |n: &str| families.iter().find(|(f, _)| f == n).map(|(_, k)| k.as_str());
        assert_eq!(kind(CHUNK_UPLOAD_LATENCY_SECONDS), Some("histogram"));
        assert_eq!(kind(END_TO_END_LATENCY_SECONDS), Some("histogram"));
        assert_eq!(kind(SPOOL_COMMIT_SECONDS), Some("histogram"));
        assert_eq!(kind(CONNECTED), Some("gauge"));
    }

    #[test]
    fn stream_labels_are_capped_and_later_streams_count_as_other() {
        let rig = Rig::new();
        for i in 0..MAX_STREAM_LABELS + 6 {
            rig.intake.metrics.accepted(&format!("s{i}"), 2, 20);
        }
        rig.intake.metrics.accepted("s0", 1, 10);
        let text = encode(&rig.registry).expect("encode");
        let series = text.lines().filter(|l| l.starts_with(INTAKE_RECORDS_TOTAL)).count();
        assert_eq!(series, MAX_STREAM_LABELS + 1);
        assert_eq!(rig.sample(&format!("{INTAKE_RECORDS_TOTAL}{{stream=\"{OTHER_STREAM}\"}}")), Some(12.0));
        assert_eq!(rig.sample(&format!("{INTAKE_BYTES_TOTAL}{{stream=\"s0\"}}")), Some(30.0));
    }

    #[test]
    fn live_families_read_the_counters_at_scrape_time() {
        let rig = Rig::new();
        assert_eq!(rig.sample(&format!("{INTAKE_REJECTED_TOTAL}{{reason=\"spool_full\"}}")), Some(0.0));
        assert_eq!(rig.sample(CONNECTED), Some(0.0));
        assert_eq!(rig.sample(RECONNECTS_TOTAL), Some(0.0));
        assert_eq!(rig.sample(BYTES_IN_FLIGHT), Some(0.0));
        assert_eq!(rig.sample(INTAKE_STREAM_BUFFER_BYTES), Some(0.0));
        assert_eq!(rig.sample(INTAKE_REQUEST_BUFFER_BYTES), Some(0.0));
        assert_eq!(rig.sample(INTAKE_REQUESTS_WAITING), Some(0.0));
        assert_eq!(rig.sample(INTAKE_CONNECTIONS), Some(0.0));
        assert_eq!(rig.sample(INTAKE_CONNECTION_LIMIT_WAITS_TOTAL), Some(0.0));
        rig.upload.connected.store(true, Ordering::Relaxed);
        rig.upload.connects_total.store(3, Ordering::Relaxed);
        rig.upload.connect_attempts_total.store(7, Ordering::Relaxed);
        rig.upload.superseded_total.store(6, Ordering::Relaxed);
        rig.upload.network_wakeups_total.store(2, Ordering::Relaxed);
        rig.upload.probes_sent_total.store(9, Ordering::Relaxed);
        rig.upload.probe_wakeups_total.store(4, Ordering::Relaxed);
        rig.upload.in_flight_bytes.store(4096, Ordering::Relaxed);
        rig.intake.stream_buffer(0, 3 << 20);
        rig.intake.stream_buffer(1 << 20, 0);
        rig.intake.request_buffer(0, 5 << 10);
        rig.intake.requests_waiting.store(2, Ordering::Relaxed);
        rig.intake.connections.store(7, Ordering::Relaxed);
        rig.intake.connection_limit_waits_total.store(3, Ordering::Relaxed);
        rig.upload.stored.chunks.store(5, Ordering::Relaxed);
        rig.upload.stored.bytes.store(500, Ordering::Relaxed);
        rig.upload.retry.chunks.store(1, Ordering::Relaxed);
        rig.intake.metrics.rejected(Rejection::SpoolFull);
        let meta = ChunkMeta {
            id: edge_spool::ChunkId(1),
            stream: "s".into(),
            seq: 1,
            records: 1,
            bytes: 10,
            first_ms: 1_000,
            sealed_ms: 1_500,
        };
        rig.upload.metrics.acked(&meta, 1_520);
        assert_eq!(rig.sample(CONNECTED), Some(1.0));
        assert_eq!(rig.sample(RECONNECTS_TOTAL), Some(2.0));
        assert_eq!(rig.sample(CONNECT_ATTEMPTS_TOTAL), Some(7.0));
        assert_eq!(rig.sample(CONNECTIONS_SUPERSEDED_TOTAL), Some(6.0));
        assert_eq!(rig.sample(NETWORK_WAKEUPS_TOTAL), Some(2.0));
        assert_eq!(rig.sample(PROBES_SENT_TOTAL), Some(9.0));
        assert_eq!(rig.sample(PROBE_WAKEUPS_TOTAL), Some(4.0));
        assert_eq!(rig.sample(FLOORS_SENT_TOTAL), Some(0.0));
        assert_eq!(rig.sample(BYTES_IN_FLIGHT), Some(4096.0));
        assert_eq!(rig.sample(INTAKE_STREAM_BUFFER_BYTES), Some(f64::from(2 << 20)));
        assert_eq!(rig.intake.stream_buffer_peak_bytes.load(Ordering::Relaxed), 3 << 20);
        assert_eq!(rig.sample(INTAKE_REQUEST_BUFFER_BYTES), Some(f64::from(5 << 10)));
        assert_eq!(rig.sample(INTAKE_REQUESTS_WAITING), Some(2.0));
        assert_eq!(rig.sample(INTAKE_CONNECTIONS), Some(7.0));
        assert_eq!(rig.sample(INTAKE_CONNECTION_LIMIT_WAITS_TOTAL), Some(3.0));
        assert_eq!(rig.sample(&format!("{UPLOAD_CHUNKS_TOTAL}{{result=\"stored\"}}")), Some(5.0));
        assert_eq!(rig.sample(&format!("{UPLOAD_BYTES_TOTAL}{{result=\"stored\"}}")), Some(500.0));
        assert_eq!(rig.sample(&format!("{UPLOAD_CHUNKS_TOTAL}{{result=\"retry\"}}")), Some(1.0));
        assert_eq!(rig.sample(&format!("{UPLOAD_CHUNKS_TOTAL}{{result=\"duplicate\"}}")), Some(0.0));
        assert_eq!(rig.sample(&format!("{INTAKE_REJECTED_TOTAL}{{reason=\"spool_full\"}}")), Some(1.0));
        assert_eq!(rig.sample(&format!("{CHUNK_UPLOAD_LATENCY_SECONDS}_bucket{{le=\"0.025\"}}")), Some(1.0));
        assert_eq!(rig.sample(&format!("{CHUNK_UPLOAD_LATENCY_SECONDS}_bucket{{le=\"0.01\"}}")), Some(0.0));
        assert_eq!(rig.sample(&format!("{END_TO_END_LATENCY_SECONDS}_sum")), Some(0.52));
        assert_eq!(rig.sample(SPOOL_BYTES), Some(0.0));
        assert_eq!(rig.sample(SPOOL_OLDEST_UNACKED_AGE_SECONDS), Some(0.0));
        // The empty spool's database file takes blocks on disk: more than nothing is reported.
        assert!(rig.sample(SPOOL_DISK_BYTES).is_some_and(|v| v > 0.0), "{:?}", rig.sample(SPOOL_DISK_BYTES));
    }

    #[test]
    fn latency_buckets_rise_from_one_millisecond_to_five_minutes() {
        assert_eq!(LATENCY_BUCKETS.first(), Some(&0.001));
        assert_eq!(LATENCY_BUCKETS.last(), Some(&300.0));
        assert!(LATENCY_BUCKETS.windows(2).all(|w| w[0] < w[1]));
    }
}
