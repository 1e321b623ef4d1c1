//! The agent's reconnect: how long a new connection takes before data flows again, with a full
//! handshake, and after an outage with the chunk sent after the Welcome or right behind the
//! Hello.
//!
//! The uploader of `edge-uploader` (the library the daemon runs, the same code) runs in this
//! process against the `edge-ingest` daemon, through the userspace UDP proxy of `edge-testkit`
//! with a fixed one-way delay, so that round trips show. The chunk is one sealed record of 10 KiB
//! unless `edge-bench reconnect --record` says otherwise. The times are the uploader's own, from
//! the start of the connection attempt ([`AttemptTimes`](edge_uploader::uploader::AttemptTimes)):
//! session established (the server's Welcome), the first chunk handed to QUIC, that chunk acked
//! as durable.
//!
//! * **Full handshake**: a new uploader for every connection, each with a fresh client
//!   configuration, so it holds no TLS ticket and knows no Welcome: its chunk waits for the
//!   Welcome.
//! * **Reconnected**: one uploader, as in the daemon, reconnecting after an outage: the proxy
//!   drops everything, a chunk is sealed, the connection times out (idle timeout 400 ms here),
//!   the proxy lets packets through again and the uploader reconnects, resuming the TLS session
//!   with the ticket of the connection before. It sends the chunk after the Welcome, as before
//!   `UploaderOptions::early_chunks`, or right behind the Hello, as the daemon does.

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

/// How the agent's connection starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Handshake {
    /// No ticket, no earlier Welcome: a full TLS 1.3 handshake with both certificates, and the
    /// chunk after the Welcome.
    Full,
    /// A reconnection (TLS resumed) that sends its chunk after the Welcome.
    AfterWelcome,
    /// A reconnection (TLS resumed) that sends its chunk right behind the Hello.
    BehindHello,
}

impl Handshake {
    pub const ALL: [Handshake; 3] = [Handshake::Full, Handshake::AfterWelcome, Handshake::BehindHello];

    pub fn label(self) -> &'static str {
        match self {
            Handshake::Full => "full handshake",
            Handshake::AfterWelcome => "reconnected, chunk after the Welcome",
            Handshake::BehindHello => "reconnected, chunk behind the Hello",
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

/// The idle timeout of the reconnected cases' connections: how long the outage lasts at least.
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
        let mut out = Vec::with_capacity(n);
        if mode == Handshake::Full {
            let tuning = Tuning::default();
            for i in 0..warmup + n {
                let config = edge_transport::client_config(&self.tls, &tuning)?;
                let dir = dir.join(format!("full-{i}"));
                let agent = Uploader::start(&dir, self.proxy.local_addr(), config, &tuning, true, record).await?;
                let (steps, _) =
                    agent.acked_after(None).await.with_context(|| format!("full handshake, connection {}", i + 1))?;
                agent.stop().await?;
                if i >= warmup {
                    out.push(steps);
                }
            }
            return Ok(out);
        }
        let tuning =
            Tuning { max_idle_timeout: IDLE_TIMEOUT, keep_alive_interval: IDLE_TIMEOUT / 4, ..Tuning::default() };
        let config = edge_transport::client_config(&self.tls, &tuning)?;
        let early = mode == Handshake::BehindHello;
        let dir = dir.join(if early { "behind-hello" } else { "after-welcome" });
        let agent = Uploader::start(&dir, self.proxy.local_addr(), config, &tuning, early, record).await?;
        let mut last = agent.acked_after(None).await.context("the first connection")?.1;
        let proxy = self.proxy.handle();
        for i in 0..warmup + n {
            // The outage: nothing passes; the chunk sealed now waits in the spool.
            proxy.blackhole(Which::Both, true);
            agent.seal_one(record).await?;
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
        agent.stop().await?;
        Ok(out)
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
    /// A new spool in `dir` with one sealed chunk of one `record`-byte record, and an uploader
    /// sending it to `server`.
    async fn start(
        dir: &Path,
        server: SocketAddr,
        client_config: quinn::ClientConfig,
        tuning: &Tuning,
        early_chunks: bool,
        record: usize,
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
            tls: Arc::new(edge_uploader::client_tls::ClientTls::fixed(client_config)),
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
            early_chunks,
            network: None,
            probe_interval: None,
        };
        let agent = Uploader {
            spool: spool.clone(),
            reader: reader.clone(),
            thread,
            counters: counters.clone(),
            cancel: cancel.clone(),
            // Started below, once the chunk is sealed, so that it is there from the first
            // attempt on.
            task: tokio::spawn(async { Ok(()) }),
        };
        agent.seal_one(record).await?;
        let task = tokio::spawn(edge_uploader::uploader::run(opts, spool, reader, counters, cancel));
        Ok(Uploader { task, ..agent })
    }

    /// Commits one `record`-byte record and seals it into a chunk.
    async fn seal_one(&self, record: usize) -> anyhow::Result<()> {
        let mut data = Vec::with_capacity(record + 16);
        edge_proto::records::encode_record(&mut data, &crate::baseline::message(record));
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
