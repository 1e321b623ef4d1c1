//! Prometheus metrics of the ingest server: every metric name, a collector that reads the
//! server's counters and the store's statistics when scraped, and the `/metrics` HTTP server
//! (the plumbing shared with the agent is in [`edge_telemetry::metrics`]).
//!
//! Conventions: names start with `edge_ingest_`; base units (seconds, bytes); counters end in
//! `_total`; histograms carry no labels; `result` is a closed set. The process collector adds the
//! standard, unprefixed `process_*` metrics.
//!
//! Each quantity is counted once: the atomics of [`ServerCounters`] (also read by tests and
//! tools) and the store's [`StoreStats`](crate::store::StoreStats) are the only bookkeeping, and
//! [`LiveCollector`] reads them at scrape time. Only the persist latency histogram, which
//! nothing else keeps, is a prometheus handle ([`PersistLatency`], inside `ServerCounters`).
//!
//! `main` creates one [`Registry`], [`register`]s everything into it and serves it with
//! [`MetricsServer`]. Servers started by tests or the agent's demo register nothing.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use anyhow::Context;
use edge_telemetry::metrics::{Live, LiveCollector};
pub use edge_telemetry::metrics::{MetricsServer, encode};
use prometheus::proto::MetricFamily;
use prometheus::{Histogram, HistogramOpts, Registry};
use tokio::net::TcpListener;

use crate::server::ServerCounters;
use crate::store::StoreStatsView;

/// Prefix of every metric of this daemon.
pub const PREFIX: &str = "edge_ingest_";

/// Agent connections open now.
pub const CONNECTIONS: &str = "edge_ingest_connections";
/// Agent connections accepted.
pub const CONNECTIONS_TOTAL: &str = "edge_ingest_connections_total";
/// Chunks by the answer given (`result`).
pub const CHUNKS_TOTAL: &str = "edge_ingest_chunks_total";
/// Records in stored chunks.
pub const RECORDS_TOTAL: &str = "edge_ingest_records_total";
/// Payload bytes of stored chunks.
pub const BYTES_TOTAL: &str = "edge_ingest_bytes_total";
/// Histogram: payload received → store durable.
pub const PERSIST_LATENCY_SECONDS: &str = "edge_ingest_persist_latency_seconds";
/// Handshakes refused (TLS, identity).
pub const AUTH_FAILURES_TOTAL: &str = "edge_ingest_auth_failures_total";
/// Connections closed for a protocol violation.
pub const PROTOCOL_ERRORS_TOTAL: &str = "edge_ingest_protocol_errors_total";
/// Chunk streams that arrived before their connection's Hello and waited for it.
pub const EARLY_CHUNK_STREAMS_TOTAL: &str = "edge_ingest_early_chunk_streams_total";
/// `fdatasync` calls of the store's group commits.
pub const STORE_FSYNCS_TOTAL: &str = "edge_ingest_store_fsyncs_total";
/// Bytes the store's commits wrote with `O_DIRECT`, past the page cache.
pub const STORE_DIRECT_BYTES_TOTAL: &str = "edge_ingest_store_direct_bytes_total";

/// Seconds the store thread has spent in its current batch (0 while it waits for work).
pub const STORE_BUSY_SECONDS: &str = "edge_ingest_store_busy_seconds";
/// Seq ranges in the store's in-memory dedup index.
pub const STORE_INDEX_RANGES: &str = "edge_ingest_store_index_ranges";
/// Chunks answered "retry" because their device's part of the dedup index is full.
pub const STORE_INDEX_REFUSED_TOTAL: &str = "edge_ingest_store_index_refused_total";
/// Agents' floors that changed the dedup index.
pub const STORE_INDEX_FLOORS_TOTAL: &str = "edge_ingest_store_index_floors_total";
/// Connections closed because a newer connection of the same agent said Hello.
pub const CONNECTIONS_SUPERSEDED_TOTAL: &str = "edge_ingest_connections_superseded_total";
/// The earliest `nextUpdate` of the revocation lists in force, in Unix seconds (0: none).
pub const CRL_NEXT_UPDATE: &str = "edge_ingest_crl_next_update_timestamp_seconds";

/// Every metric name above.
pub const ALL: [&str; 17] = [
    CONNECTIONS,
    CONNECTIONS_TOTAL,
    CHUNKS_TOTAL,
    RECORDS_TOTAL,
    BYTES_TOTAL,
    PERSIST_LATENCY_SECONDS,
    AUTH_FAILURES_TOTAL,
    PROTOCOL_ERRORS_TOTAL,
    EARLY_CHUNK_STREAMS_TOTAL,
    STORE_FSYNCS_TOTAL,
    STORE_DIRECT_BYTES_TOTAL,
    STORE_BUSY_SECONDS,
    STORE_INDEX_RANGES,
    STORE_INDEX_REFUSED_TOTAL,
    STORE_INDEX_FLOORS_TOTAL,
    CONNECTIONS_SUPERSEDED_TOTAL,
    CRL_NEXT_UPDATE,
];

/// Histogram buckets in seconds, 1 ms to 30 s in 1-2.5-5 steps (the agent uses the same).
pub const LATENCY_BUCKETS: [f64; 15] =
    [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0];

/// Time from a chunk's payload being received to the store reporting it durable (verification,
/// queueing for the store thread, write and fsync).
#[derive(Debug, Clone)]
pub struct PersistLatency(Histogram);

impl Default for PersistLatency {
    fn default() -> Self {
        let opts = HistogramOpts::new(
            PERSIST_LATENCY_SECONDS,
            "Time from a chunk's payload being fully received to the store answering it durable (Stored or \
             Duplicate): verification, store queue, write and fsync.",
        )
        .buckets(LATENCY_BUCKETS.to_vec());
        Self(Histogram::with_opts(opts).expect("constant name and help, increasing buckets"))
    }
}

impl PersistLatency {
    /// Records one durable chunk.
    pub fn observe(&self, elapsed: Duration) {
        self.0.observe(elapsed.as_secs_f64());
    }

    /// Chunks observed so far.
    pub fn count(&self) -> u64 {
        self.0.get_sample_count()
    }
}

/// Registers every ingest metric in `registry`: the persist histogram, a collector over the
/// server counters and the store statistics, and (on Linux) the process collector.
pub fn register(registry: &Registry, counters: Arc<ServerCounters>, store: StoreStatsView) -> prometheus::Result<()> {
    registry.register(Box::new(counters.persist_latency.0.clone()))?;
    registry.register(Box::new(LiveCollector::new(&LIVE_ALL, move || live_families(&counters, &store))?))?;
    #[cfg(target_os = "linux")]
    registry.register(Box::new(prometheus::process_collector::ProcessCollector::for_self()))?;
    Ok(())
}

const LIVE_CONNECTIONS: Live = Live::gauge(CONNECTIONS, "Agent connections open now (identity verified).");
const LIVE_CONNECTIONS_TOTAL: Live =
    Live::counter(CONNECTIONS_TOTAL, "Agent connections accepted with a verified device identity since start.");
const LIVE_CHUNKS: Live = Live::counter(
    CHUNKS_TOTAL,
    "Chunks by the answer sent: stored (durable now), duplicate (durable before), rejected (never \
           storable), retry (store unavailable).",
)
.labelled("result");
const LIVE_RECORDS: Live =
    Live::counter(RECORDS_TOTAL, "Records in chunks answered stored (duplicates not counted again).");
const LIVE_BYTES: Live = Live::counter(
    BYTES_TOTAL,
    "Payload bytes of chunks answered stored, as received (compressed if the agent compressed).",
);
const LIVE_AUTH_FAILURES: Live = Live::counter(
    AUTH_FAILURES_TOTAL,
    "Connections refused during the handshake: TLS failure or no valid device identity.",
);
const LIVE_PROTOCOL_ERRORS: Live =
    Live::counter(PROTOCOL_ERRORS_TOTAL, "Agent connections closed for a protocol violation.");
const LIVE_EARLY_CHUNK_STREAMS: Live = Live::counter(
    EARLY_CHUNK_STREAMS_TOTAL,
    "Chunk streams that arrived before their connection's Hello and waited for it (agents send their first \
           chunks right behind the Hello on reconnect).",
);
const LIVE_FSYNCS: Live = Live::counter(
    STORE_FSYNCS_TOTAL,
    "fdatasync calls on segment files by the store's group commits (one per commit, shared by every chunk \
           in it).",
);
const LIVE_DIRECT_BYTES: Live = Live::counter(
    STORE_DIRECT_BYTES_TOTAL,
    "Bytes the store's commits wrote to segment files with O_DIRECT, past the page cache (each commit's \
           whole 4 KiB blocks, the start of its first block written again included). Stays 0 with \
           store.direct_writes off, or where the file system refused O_DIRECT: then every byte goes through \
           the page cache.",
);
const LIVE_STORE_BUSY: Live = Live::gauge(
    STORE_BUSY_SECONDS,
    "Seconds the store thread has spent in its current batch of writes and fdatasync (0 while it waits \
           for work; milliseconds on a healthy disk). Chunks wait for it meanwhile; from 10 s `edge-ingest \
           status` is degraded, and from half of WatchdogSec, 10 s at least, the daemon withholds its \
           watchdog ping. Always 0 with the JetStream sink.",
);
const LIVE_INDEX_RANGES: Live = Live::gauge(
    STORE_INDEX_RANGES,
    "Seq ranges in the file store's in-memory dedup index, over every device, spool and stream: one per \
           gapless stream, one more per gap (what the index costs in memory). Always 0 with the JetStream \
           sink.",
);
const LIVE_INDEX_REFUSED: Live = Live::counter(
    STORE_INDEX_REFUSED_TOTAL,
    "Chunks answered retry (overloaded) because storing them would open a gap past \
           store.max_index_gaps_per_device in their device's part of the dedup index (a seq with neither \
           neighbour stored), or start a stream past store.max_index_streams_per_device. The store logs each \
           such device once per cap. An agent's gaps come from its parallel uploads, which close, and from \
           runs of chunks its full spool dropped, one each, until its floor closes them \
           (edge_ingest_store_index_floors_total).",
);
const LIVE_INDEX_FLOORS: Live = Live::counter(
    STORE_INDEX_FLOORS_TOTAL,
    "Agents' floors that changed the file store's dedup index: an agent answered retry at its device's \
           cap tells the ingest that no seq of the stream below a mark will come any more (chunks its full \
           spool dropped or it quarantined), and the seqs below it count as stored, which closes their gaps \
           or keeps the next chunk from opening one. Not kept across restarts. Always 0 with the JetStream \
           sink.",
);
const LIVE_SUPERSEDED: Live = Live::counter(
    CONNECTIONS_SUPERSEDED_TOTAL,
    "Connections closed because a newer connection of the same agent (device and spool) said Hello: an \
           agent that reconnected after an address change, or two gateways sharing one spool and certificate \
           (a cloned disk), which replace each other at every reconnect; the log names the device.",
);
const LIVE_CRL_NEXT_UPDATE: Live = Live::gauge(
    CRL_NEXT_UPDATE,
    "The earliest nextUpdate of the revocation lists in force (tls.crls), in Unix seconds; 0 without \
           CRLs. From then on every device's handshake is refused until a newer CRL is written in its place \
           (`edge-ingest pki crl` re-issues one); the log warns a day before.",
);
const LIVE_ALL: [&Live; 16] = [
    &LIVE_CONNECTIONS,
    &LIVE_CONNECTIONS_TOTAL,
    &LIVE_CHUNKS,
    &LIVE_RECORDS,
    &LIVE_BYTES,
    &LIVE_AUTH_FAILURES,
    &LIVE_PROTOCOL_ERRORS,
    &LIVE_EARLY_CHUNK_STREAMS,
    &LIVE_FSYNCS,
    &LIVE_DIRECT_BYTES,
    &LIVE_STORE_BUSY,
    &LIVE_INDEX_RANGES,
    &LIVE_INDEX_REFUSED,
    &LIVE_INDEX_FLOORS,
    &LIVE_SUPERSEDED,
    &LIVE_CRL_NEXT_UPDATE,
];

/// The [`LIVE_ALL`] families from the server counters and the store statistics, at scrape time.
fn live_families(c: &ServerCounters, store: &StoreStatsView) -> Vec<MetricFamily> {
    let n = |a: &std::sync::atomic::AtomicU64| a.load(Relaxed) as f64;
    let st = store.get();
    vec![
        LIVE_CONNECTIONS.family(&[("", n(&c.connections_open))]),
        LIVE_CONNECTIONS_TOTAL.family(&[("", n(&c.connections_total))]),
        LIVE_CHUNKS.family(&[
            ("stored", n(&c.chunks_stored_total)),
            ("duplicate", n(&c.chunks_duplicate_total)),
            ("rejected", n(&c.chunks_rejected_total)),
            ("retry", n(&c.chunks_retry_total)),
        ]),
        LIVE_RECORDS.family(&[("", n(&c.records_stored_total))]),
        LIVE_BYTES.family(&[("", n(&c.bytes_stored_total))]),
        LIVE_AUTH_FAILURES.family(&[("", n(&c.auth_failures_total))]),
        LIVE_PROTOCOL_ERRORS.family(&[("", n(&c.protocol_errors_total))]),
        LIVE_EARLY_CHUNK_STREAMS.family(&[("", n(&c.early_chunk_streams_total))]),
        LIVE_FSYNCS.family(&[("", st.fsyncs as f64)]),
        LIVE_DIRECT_BYTES.family(&[("", st.direct_bytes as f64)]),
        LIVE_STORE_BUSY.family(&[("", st.busy.map_or(0.0, |d| d.as_secs_f64()))]),
        LIVE_INDEX_RANGES.family(&[("", st.index_ranges as f64)]),
        LIVE_INDEX_REFUSED.family(&[("", st.index_refused as f64)]),
        LIVE_INDEX_FLOORS.family(&[("", st.index_floors as f64)]),
        LIVE_SUPERSEDED.family(&[("", n(&c.superseded_total))]),
        LIVE_CRL_NEXT_UPDATE.family(&[("", n(&c.crl_next_update_unix))]),
    ]
}

/// Binds the metrics listener (`None` when metrics are disabled); see [`edge_telemetry::metrics::bind`].
pub async fn bind(listen: Option<SocketAddr>) -> anyhow::Result<Option<TcpListener>> {
    edge_telemetry::metrics::bind(listen).await.context("metrics.listen")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{Store, StoreHandle, StoreOptions};

    fn rig() -> (tempfile::TempDir, StoreHandle, Arc<ServerCounters>, Registry) {
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = Store::open(StoreOptions::new(dir.path())).expect("store");
        let store = StoreHandle::spawn(store);
        let counters = Arc::new(ServerCounters::default());
        let registry = Registry::new();
        register(&registry, counters.clone(), store.stats_view()).expect("register");
        (dir, store, counters, registry)
    }

    fn sample(registry: &Registry, series: &str) -> Option<f64> {
        let text = encode(registry).expect("encode");
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .find_map(|l| l.rsplit_once(' ').filter(|(k, _)| *k == series).map(|(_, v)| v.parse().expect("value")))
    }

    #[test]
    fn every_family_has_the_prefix_and_counters_end_in_total() {
        let (_dir, store, _counters, registry) = rig();
        let text = encode(&registry).expect("encode");
        let families: Vec<(&str, &str)> =
            text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split_once(' ')).collect();
        for (name, kind) in &families {
            assert!(
                name.starts_with(PREFIX) || name.starts_with("process_"),
                "{name} has neither the {PREFIX} prefix nor the standard process_ one"
            );
            assert_eq!(name.ends_with("_total"), *kind == "counter", "{name} is a {kind}: only counters end in _total");
        }
        for name in ALL {
            assert!(families.iter().any(|(n, _)| *n == name), "{name} is not exported; got {families:?}");
        }
        assert!(families.contains(&(PERSIST_LATENCY_SECONDS, "histogram")));
        assert!(families.contains(&(CONNECTIONS, "gauge")));
        if cfg!(target_os = "linux") {
            assert!(families.iter().any(|(n, _)| *n == "process_resident_memory_bytes"), "{families:?}");
        }
        store.shutdown();
    }

    #[test]
    fn scrapes_read_the_counters_of_the_moment() {
        let (_dir, store, counters, registry) = rig();
        assert_eq!(sample(&registry, &format!("{CHUNKS_TOTAL}{{result=\"stored\"}}")), Some(0.0));
        counters.chunks_stored_total.store(7, Relaxed);
        counters.chunks_retry_total.store(2, Relaxed);
        counters.connections_open.store(1, Relaxed);
        counters.superseded_total.store(3, Relaxed);
        counters.persist_latency.observe(Duration::from_millis(3));
        assert_eq!(sample(&registry, &format!("{CHUNKS_TOTAL}{{result=\"stored\"}}")), Some(7.0));
        assert_eq!(sample(&registry, &format!("{CHUNKS_TOTAL}{{result=\"retry\"}}")), Some(2.0));
        assert_eq!(sample(&registry, CONNECTIONS), Some(1.0));
        assert_eq!(sample(&registry, CONNECTIONS_SUPERSEDED_TOTAL), Some(3.0));
        assert_eq!(sample(&registry, STORE_INDEX_REFUSED_TOTAL), Some(0.0));
        assert_eq!(sample(&registry, STORE_INDEX_FLOORS_TOTAL), Some(0.0));
        assert_eq!(sample(&registry, &format!("{PERSIST_LATENCY_SECONDS}_bucket{{le=\"0.005\"}}")), Some(1.0));
        assert_eq!(sample(&registry, &format!("{PERSIST_LATENCY_SECONDS}_bucket{{le=\"0.0025\"}}")), Some(0.0));
        assert_eq!(sample(&registry, STORE_FSYNCS_TOTAL), Some(0.0));
        assert_eq!(sample(&registry, STORE_DIRECT_BYTES_TOTAL), Some(0.0));
        store.shutdown();
    }
}
