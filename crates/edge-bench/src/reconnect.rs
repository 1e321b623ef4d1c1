//! The agent's reconnect: how long a new connection takes before data flows again, with a full
//! handshake and with a resumed one.
//!
//! The uploader of `edge-uploader` (the library the daemon runs, the same code) runs in this
//! process against the `edge-ingest` daemon, through the userspace UDP proxy of `edge-testkit`
//! with a fixed one-way delay, so that round trips show. Every repetition is a new connection
//! (a new uploader with its own endpoint) that sends one sealed chunk of one record (10 KiB
//! unless `edge-bench reconnect --record` says otherwise) and stops once it is acked. The
//! times are the uploader's own, from the start of its connection attempt
//! ([`AttemptTimes`](edge_uploader::uploader::AttemptTimes)): session established (the
//! server's Welcome), the chunk handed to QUIC, the chunk acked as durable.
//!
//! Full handshakes use a fresh client configuration each time, so the agent has no ticket;
//! resumed ones share one, as the agent does across reconnects, so each uses a ticket of the
//! connection before.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use edge_spool::{AppendOutcome, AppendRequest, Batch, Spool, SpoolOptions};
use edge_testkit::netem::{Faults, Netem, NetemConfig};
use edge_transport::{ClientTls, Tuning};
use edge_uploader::config::Compression;
use edge_uploader::spool_task::{ReaderHandle, SpoolHandle};
use edge_uploader::uploader::{UploadCounters, UploaderOptions};
use tokio_util::sync::CancellationToken;

use crate::world::World;

/// How the agent's TLS session starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    /// No ticket: a full TLS 1.3 handshake with both certificates.
    Full,
    /// With the ticket of the connection before (1-RTT).
    Resumed,
}

impl Handshake {
    pub fn label(self) -> &'static str {
        match self {
            Handshake::Full => "full handshake",
            Handshake::Resumed => "resumed",
        }
    }
}

/// Milliseconds from the attempt's start to each step.
#[derive(Debug, Clone, Copy)]
pub struct Steps {
    pub established_ms: f64,
    pub sent_ms: f64,
    pub acked_ms: f64,
}

/// The ingest of `world` (running) behind a proxy that delays each packet by `delay` each way.
pub struct DelayedPath {
    proxy: Netem,
    tls: ClientTls,
}

impl DelayedPath {
    pub async fn new(world: &World, delay: Duration) -> anyhow::Result<DelayedPath> {
        let upstream = SocketAddr::from(([127, 0, 0, 1], world.ingest_port));
        let faults = Faults { delay, ..Faults::default() };
        let proxy = Netem::start(SocketAddr::from(([127, 0, 0, 1], 0)), upstream, NetemConfig::symmetric(faults), 1)
            .await
            .context("starting the UDP proxy")?;
        let tls = world.device.client_tls("localhost");
        Ok(DelayedPath { proxy, tls })
    }

    /// `n` connections of one kind after `warmup` unrecorded ones; each sends and acks one
    /// chunk of one `record`-byte record.
    pub async fn connections(
        &self,
        dir: &Path,
        mode: Handshake,
        record: usize,
        warmup: usize,
        n: usize,
    ) -> anyhow::Result<Vec<Steps>> {
        let tuning = Tuning::default();
        let shared = edge_transport::client_config(&self.tls, &tuning)?;
        let mut out = Vec::with_capacity(n);
        for i in 0..warmup + n {
            let config = match mode {
                Handshake::Full => edge_transport::client_config(&self.tls, &tuning)?,
                Handshake::Resumed => shared.clone(),
            };
            let steps = one(&dir.join(format!("conn-{i}")), self.proxy.local_addr(), config, &tuning, record)
                .await
                .with_context(|| format!("{} connection {}", mode.label(), i + 1))?;
            if i >= warmup {
                out.push(steps);
            }
        }
        Ok(out)
    }

    pub async fn shutdown(self) {
        self.proxy.shutdown().await;
    }
}

/// One new connection through `server` that uploads one sealed chunk from a fresh spool in `dir`.
async fn one(
    dir: &Path,
    server: SocketAddr,
    client_config: quinn::ClientConfig,
    tuning: &Tuning,
    record: usize,
) -> anyhow::Result<Steps> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir)?;
    let (mut spool, _report) = Spool::open(SpoolOptions::new(dir.join("spool.db")))?;
    let mut data = Vec::with_capacity(record + 16);
    edge_proto::records::encode_record(&mut data, &crate::baseline::message(record));
    let req = AppendRequest { batches: vec![Batch { stream: "reconnect".into(), data, records: 1 }] };
    anyhow::ensure!(spool.append(&[req], 1)? == vec![AppendOutcome::Accepted], "the spool refused the record");
    anyhow::ensure!(spool.seal_all(1)? == 1, "no chunk sealed");
    let reader = ReaderHandle::new(spool.reader()?);
    let (spool, thread) = SpoolHandle::spawn(spool)?;
    let counters = Arc::new(UploadCounters::default());
    let cancel = CancellationToken::new();
    let opts = UploaderOptions {
        server: server.to_string(),
        server_name: "localhost".into(),
        client_config,
        bind: SocketAddr::from(([127, 0, 0, 1], 0)),
        max_in_flight: Arc::new(AtomicU32::new(32)),
        max_in_flight_bytes: Arc::new(AtomicU64::new(8 << 20)),
        connect_timeout: Duration::from_secs(3),
        backoff_min: Duration::from_millis(20),
        backoff_max: Duration::from_millis(100),
        compression: Compression::None,
        limits: edge_proto::Limits::default(),
        drain_grace: Duration::from_secs(5),
        tuning: tuning.clone(),
    };
    let uploader = tokio::spawn(edge_uploader::uploader::run(
        opts,
        spool.clone(),
        reader.clone(),
        counters.clone(),
        cancel.clone(),
    ));
    // The uploader stamps each step itself; polling only notices that the last one happened.
    let deadline = Instant::now() + Duration::from_secs(20);
    let times = loop {
        let attempt = counters.attempt.lock().unwrap_or_else(PoisonError::into_inner).clone();
        if let Some(t) = attempt.filter(|t| t.first_acked.get().is_some()) {
            break t;
        }
        if Instant::now() > deadline || uploader.is_finished() {
            cancel.cancel();
            let last = counters.last_error.lock().unwrap_or_else(PoisonError::into_inner).clone();
            anyhow::bail!("the chunk was not acked within 20 s (last error: {last:?})");
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    };
    cancel.cancel();
    uploader.await.context("uploader task")?.context("uploader")?;
    anyhow::ensure!(
        counters.connects_total.load(std::sync::atomic::Ordering::Relaxed) == 1,
        "more than one connection"
    );
    drop((spool, reader));
    thread.join();
    let ms = |step| times.after_start(step).map_or(f64::NAN, |d: Duration| d.as_secs_f64() * 1e3);
    Ok(Steps {
        established_ms: ms(&times.established),
        sent_ms: ms(&times.first_sent),
        acked_ms: ms(&times.first_acked),
    })
}
