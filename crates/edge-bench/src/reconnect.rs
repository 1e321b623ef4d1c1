//! The agent's reconnect: how long a new connection takes before data flows again, with a full
//! handshake, a resumed one, and a resumed one sending 0-RTT data.
//!
//! The uploader of `edge-uploader` (the library the daemon runs, the same code) runs in this
//! process against the `edge-ingest` daemon, through the userspace UDP proxy of `edge-testkit`
//! with a fixed one-way delay, so that round trips show. The times are the uploader's own, from
//! the start of the connection attempt ([`AttemptTimes`](edge_uploader::uploader::AttemptTimes)):
//! session established (the server's Welcome), the first chunk handed to QUIC, that chunk acked
//! as durable. The chunk is one sealed 10 KiB record.
//!
//! * **Full handshake**: a new uploader for every connection, each with a fresh client
//!   configuration, so it holds no ticket.
//! * **Resumed, 1-RTT and 0-RTT**: one uploader, as in the daemon, reconnecting after an outage:
//!   the proxy drops everything, a chunk is sealed, the connection times out (idle timeout
//!   400 ms here), the proxy lets packets through again and the uploader reconnects with the
//!   ticket of the connection before. With 0-RTT off its Hello and the chunk wait for the
//!   handshake; with it on both go in the first flight.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use anyhow::Context;
use edge_spool::{AppendRequest, Batch, Spool, SpoolOptions};
use edge_testkit::netem::{Faults, Netem, NetemConfig, Which};
use edge_transport::{ClientTls, Tuning};
use edge_uploader::config::Compression;
use edge_uploader::spool_task::{ReaderHandle, SpoolHandle, SpoolThread};
use edge_uploader::uploader::{AttemptTimes, UploadCounters, UploaderOptions};
use tokio_util::sync::CancellationToken;

use crate::world::World;

/// How the agent's TLS session starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    /// No ticket: a full TLS 1.3 handshake with both certificates.
    Full,
    /// With the ticket of the connection before, 0-RTT off (1-RTT).
    Resumed,
    /// With the ticket, the Hello and the chunk as 0-RTT data in the first flight.
    ZeroRtt,
}

impl Handshake {
    pub const ALL: [Handshake; 3] = [Handshake::Full, Handshake::Resumed, Handshake::ZeroRtt];

    pub fn label(self) -> &'static str {
        match self {
            Handshake::Full => "full handshake",
            Handshake::Resumed => "resumed 1-RTT",
            Handshake::ZeroRtt => "resumed 0-RTT",
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

/// The idle timeout of the resumed cases' connections: how long the outage lasts at least.
const IDLE_TIMEOUT: Duration = Duration::from_millis(400);

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

    /// `n` connections of one kind after `warmup` unrecorded ones.
    pub async fn connections(
        &self,
        dir: &Path,
        mode: Handshake,
        warmup: usize,
        n: usize,
    ) -> anyhow::Result<Vec<Steps>> {
        match mode {
            Handshake::Full => {
                let tuning = Tuning::default();
                let mut out = Vec::with_capacity(n);
                for i in 0..warmup + n {
                    let config = edge_transport::client_config(&self.tls, &tuning)?;
                    let agent = Uploader::start(
                        &dir.join(format!("full-{i}")),
                        self.proxy.local_addr(),
                        config,
                        &tuning,
                        false,
                    )?;
                    agent.seal_one().await?;
                    let (steps, _) = agent
                        .acked_after(None)
                        .await
                        .with_context(|| format!("full handshake, connection {}", i + 1))?;
                    agent.stop().await?;
                    if i >= warmup {
                        out.push(steps);
                    }
                }
                Ok(out)
            }
            Handshake::Resumed | Handshake::ZeroRtt => {
                let tuning = Tuning {
                    max_idle_timeout: IDLE_TIMEOUT,
                    keep_alive_interval: IDLE_TIMEOUT / 4,
                    ..Tuning::default()
                };
                let config = edge_transport::client_config(&self.tls, &tuning)?;
                let dir = dir.join(if mode == Handshake::ZeroRtt { "zero-rtt" } else { "resumed" });
                let agent =
                    Uploader::start(&dir, self.proxy.local_addr(), config, &tuning, mode == Handshake::ZeroRtt)?;
                agent.seal_one().await?;
                let mut last = agent.acked_after(None).await.context("the first connection")?.1;
                let proxy = self.proxy.handle();
                let mut out = Vec::with_capacity(n);
                for i in 0..warmup + n {
                    // The outage: nothing passes; the chunk sealed now waits in the spool.
                    proxy.blackhole(Which::Both, true);
                    agent.seal_one().await?;
                    let lost = agent.wait(|c| !c.connected.load(Ordering::Acquire)).await;
                    // Over before the uploader's next attempt, which follows after its backoff.
                    proxy.blackhole(Which::Both, false);
                    lost.context("the connection did not time out in the outage")?;
                    let (steps, attempt) = agent
                        .acked_after(Some(&last))
                        .await
                        .with_context(|| format!("{}, reconnection {}", mode.label(), i + 1))?;
                    last = attempt;
                    if i >= warmup {
                        out.push(steps);
                    }
                }
                let (accepted, rejected) = (
                    agent.counters.zero_rtt_accepted_total.load(Ordering::Relaxed),
                    agent.counters.zero_rtt_rejected_total.load(Ordering::Relaxed),
                );
                let expected = if mode == Handshake::ZeroRtt { (warmup + n) as u64 } else { 0 };
                agent.stop().await?;
                anyhow::ensure!(
                    (accepted, rejected) == (expected, 0),
                    "{}: 0-RTT accepted on {accepted} and rejected on {rejected} reconnections, expected {expected} and 0",
                    mode.label()
                );
                Ok(out)
            }
        }
    }

    pub async fn shutdown(self) {
        self.proxy.shutdown().await;
    }
}

/// An uploader in this process with a spool of its own.
struct Uploader {
    spool: SpoolHandle,
    reader: ReaderHandle,
    thread: SpoolThread,
    counters: Arc<UploadCounters>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Uploader {
    fn start(
        dir: &Path,
        server: SocketAddr,
        client_config: quinn::ClientConfig,
        tuning: &Tuning,
        zero_rtt: bool,
    ) -> anyhow::Result<Uploader> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir)?;
        let (spool, _report) = Spool::open(SpoolOptions::new(dir.join("spool.db")))?;
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
            zero_rtt,
        };
        let task = tokio::spawn(edge_uploader::uploader::run(
            opts,
            spool.clone(),
            reader.clone(),
            counters.clone(),
            cancel.clone(),
        ));
        Ok(Uploader { spool, reader, thread, counters, cancel, task })
    }

    /// Commits one 10 KiB record and seals it into a chunk.
    async fn seal_one(&self) -> anyhow::Result<()> {
        let mut data = Vec::with_capacity(10 * 1024 + 16);
        edge_proto::records::encode_record(&mut data, &crate::baseline::message(10 * 1024));
        let req = AppendRequest { batches: vec![Batch { stream: "reconnect".into(), data, records: 1 }] };
        self.spool.append(req).await.map_err(|e| anyhow::anyhow!("the spool refused the record: {e:?}"))?;
        self.spool.seal_all().await;
        Ok(())
    }

    /// Waits (up to 20 s) until `done` holds of the counters.
    async fn wait(&self, done: impl Fn(&UploadCounters) -> bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !done(&self.counters) {
            if Instant::now() > deadline || self.task.is_finished() {
                let last = self.counters.last_error.lock().unwrap_or_else(PoisonError::into_inner).clone();
                anyhow::bail!("gave up after 20 s (the uploader's last error: {last:?})");
            }
            // The uploader stamps each step itself; this only notices that it happened.
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        Ok(())
    }

    /// The steps of the first attempt after `before` whose first chunk was acked.
    async fn acked_after(&self, before: Option<&Arc<AttemptTimes>>) -> anyhow::Result<(Steps, Arc<AttemptTimes>)> {
        let latest = || self.counters.attempt.lock().unwrap_or_else(PoisonError::into_inner).clone();
        self.wait(|_| {
            latest().is_some_and(|t| before.is_none_or(|b| !Arc::ptr_eq(b, &t)) && t.first_acked.get().is_some())
        })
        .await?;
        let times = latest().context("no attempt")?;
        let ms = |step| times.after_start(step).map_or(f64::NAN, |d: Duration| d.as_secs_f64() * 1e3);
        let steps = Steps {
            established_ms: ms(&times.established),
            sent_ms: ms(&times.first_sent),
            acked_ms: ms(&times.first_acked),
        };
        Ok((steps, times))
    }

    async fn stop(self) -> anyhow::Result<()> {
        self.cancel.cancel();
        self.task.await.context("uploader task")?.context("uploader")?;
        drop((self.spool, self.reader));
        self.thread.join();
        Ok(())
    }
}
