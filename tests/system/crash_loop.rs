//! Producers push records of random sizes on three streams through the agent's Unix socket
//! while the agent is killed with SIGKILL and restarted again and again (during intake and
//! upload), and the ingest server too. After the drain, the store must hold exactly the records
//! that were acknowledged to the producers, each once, in order per stream
//! (`edge_testkit::workload::check_store`).
//!
//! A request whose answer was lost to a kill has an unknown outcome: its records may be stored
//! (committed just before the kill) or not, but all or none of them, and never twice.
//!
//! After every agent kill, before the restart, the spool file is opened read-only and
//! `PRAGMA integrity_check` must answer `ok`: a crash may lose an uncommitted transaction, never
//! damage the file.
//!
//! This module also holds the helpers the other crash tests (`crash_points`, `power_cut`)
//! share: starting daemons with extra environment, the spool integrity check, producers, drain.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use edge_testkit::workload::{self, ProducerOptions, Progress, Sent, Workload};
use edge_testkit::{Daemon, Tier, bin};
use edge_uploader::client::IntakeClient;
use rand::{Rng, SeedableRng};

use crate::common::World;

/// The spool file of a [`World`]'s agent.
pub fn spool_path(world: &World) -> PathBuf {
    world.path().join("agent/spool.db")
}

/// Starts the agent with extra environment (e.g. `FAILPOINTS`, `LD_PRELOAD`) without waiting.
pub fn spawn_agent(world: &World, envs: &[(&str, &str)]) -> anyhow::Result<Daemon> {
    let cfg = world.agent_config.to_string_lossy().into_owned();
    Daemon::spawn("agent", &bin("edge-uploader")?, &["run", "--config", &cfg], world.path(), envs)
}

/// Opens the spool file read-only (no checkpoint on close, so the crashed state is looked at,
/// not changed) and runs `PRAGMA integrity_check`.
pub fn integrity_check(spool: &Path) -> anyhow::Result<()> {
    use rusqlite::OpenFlags;
    let conn = rusqlite::Connection::open_with_flags(spool, OpenFlags::SQLITE_OPEN_READ_ONLY)
        .with_context(|| format!("opening {} read-only", spool.display()))?;
    conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_NO_CKPT_ON_CLOSE, true)?;
    let rows: Vec<String> = conn
        .prepare("PRAGMA integrity_check")?
        .query_map([], |r| r.get(0))?
        .collect::<Result<_, _>>()
        .context("running PRAGMA integrity_check")?;
    anyhow::ensure!(rows == ["ok"], "integrity_check of {}: {rows:?}", spool.display());
    Ok(())
}

/// The agent's `GET /v1/status` document.
pub async fn agent_status(socket: &Path) -> anyhow::Result<serde_json::Value> {
    Ok(IntakeClient::new(socket).get_json("/v1/status").await?.body)
}

/// Chunks the running agent process has seen acknowledged (stored or duplicate).
pub fn chunks_acked(status: &serde_json::Value) -> u64 {
    let u = &status["upload"];
    u["chunks_acked_total"].as_u64().unwrap_or(0) + u["chunks_duplicate_total"].as_u64().unwrap_or(0)
}

/// Polls the agent's status until `pred` holds (bounded); returns the document.
pub async fn wait_status(
    socket: &Path,
    what: &str,
    timeout: Duration,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + timeout;
    loop {
        let last = agent_status(socket).await;
        if let Ok(s) = &last
            && pred(s)
        {
            return last;
        }
        anyhow::ensure!(Instant::now() < deadline, "agent never reached {what}: {last:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether the agent's status shows an empty spool and nothing in flight.
fn drained(s: &serde_json::Value) -> bool {
    s["spool"]["sealed_chunks"] == 0 && s["spool"]["open_bytes"] == 0 && s["upload"]["in_flight"] == 0
}

/// Waits until the agent reports an empty spool and nothing in flight. Fails when `timeout`
/// passes without a chunk acknowledged: a large backlog that drains steadily may take longer
/// (the long tier builds gigabytes of it), a stalled uploader may not.
pub async fn drain(socket: &Path, timeout: Duration) -> anyhow::Result<()> {
    let mut acked = 0;
    loop {
        let s = wait_status(socket, "an empty spool", timeout, |s| drained(s) || chunks_acked(s) > acked)
            .await
            .map_err(|e| {
                // Seen in this battery: sealed chunks left in the spool, nothing in flight,
                // connected, no producer traffic: the uploader was never told about the last seals.
                e.context("drain: if sealed_chunks > 0 with in_flight = 0 while connected, the uploader missed a seal")
            })?;
        if drained(&s) {
            return Ok(());
        }
        acked = chunks_acked(&s);
    }
}

/// One producer per stream of the workload, running until stopped.
pub struct Producers {
    pub progress: Progress,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<Vec<Sent>>>>,
}

impl Producers {
    pub fn start(rt: &tokio::runtime::Runtime, workload: &Arc<Workload>, socket: &Path, max_batch: u64) -> Self {
        Self::start_with(rt, workload, socket, max_batch, false)
    }

    /// As [`Producers::start`]; with `record_stream` the producers use the record-stream socket
    /// next to `socket` instead of HTTP.
    pub fn start_with(
        rt: &tokio::runtime::Runtime,
        workload: &Arc<Workload>,
        socket: &Path,
        max_batch: u64,
        record_stream: bool,
    ) -> Self {
        let progress = Progress::default();
        let tasks = (0..workload.streams.len())
            .map(|stream| {
                let opts = ProducerOptions { max_batch, ..ProducerOptions::new(stream) };
                if record_stream {
                    let socket = socket.with_file_name(edge_uploader::config::DEFAULT_STREAM_SOCKET);
                    rt.spawn(workload::produce_stream(workload.clone(), socket, opts, progress.clone()))
                } else {
                    rt.spawn(workload::produce(workload.clone(), socket.to_path_buf(), opts, progress.clone()))
                }
            })
            .collect();
        Self { progress, tasks }
    }

    /// Records acknowledged so far.
    pub fn acked(&self) -> u64 {
        self.progress.acked.load(Ordering::Relaxed)
    }

    /// Waits (bounded) until at least `n` more records than `from` were acknowledged.
    pub fn wait_acked(&self, from: u64, n: u64, timeout: Duration, log: impl Fn() -> String) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while self.acked() < from + n {
            anyhow::ensure!(Instant::now() < deadline, "producers made no progress; log:\n{}", log());
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    /// Stops the producers after their current request and returns each stream's request log.
    pub fn stop(self, rt: &tokio::runtime::Runtime) -> anyhow::Result<Vec<Vec<Sent>>> {
        self.progress.stop.store(true, Ordering::Relaxed);
        self.tasks.into_iter().map(|t| rt.block_on(t)?).collect()
    }
}

/// Quantiles of a list of durations, in milliseconds.
pub fn summary_ms(samples: &[Duration]) -> serde_json::Value {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
    ms.sort_by(f64::total_cmp);
    let q = |p: f64| ms.get(((ms.len() as f64 - 1.0) * p).round() as usize).copied();
    serde_json::json!({ "n": ms.len(), "p50": q(0.5), "p99": q(0.99), "max": ms.last() })
}

pub fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

#[test]
fn acknowledged_records_survive_repeated_sigkill_exactly_once_in_order() -> anyhow::Result<()> {
    crash_loop("crash_loop", "gw-crash-01", false)
}

/// The same with producers on the record-stream intake: what an Ack or Error frame counted as
/// committed survives, and a connection broken by a kill stored a prefix of its unanswered
/// records, each at most once.
#[test]
fn record_stream_acks_survive_repeated_sigkill_exactly_once_in_order() -> anyhow::Result<()> {
    crash_loop("crash_loop_record_stream", "gw-crash-02", true)
}

fn crash_loop(report_name: &str, device: &str, record_stream: bool) -> anyhow::Result<()> {
    let tier = Tier::current();
    let agent_kills: u32 = tier.pick(6, 200);
    // Every `ingest_every`-th cycle also kills the ingest server (while the agent uploads).
    let ingest_every: u32 = tier.pick(3, 2);
    let world = World::new(device, "")?;
    let socket = world.intake_socket();
    let spool = spool_path(&world);
    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;

    let rt = runtime()?;
    let workload = Arc::new(Workload::new(0xC0FFEE).with_sizes(1, tier.pick(16, 64) * 1024));
    let producers = Producers::start_with(&rt, &workload, &socket, 100, record_stream);

    let mut rng = rand::rngs::StdRng::seed_from_u64(0xC0FFEE);
    let (mut kills, mut ingest_kills, mut integrity_checks) = (0u32, 0u32, 0u32);
    let (mut to_ready, mut to_first_ack, mut ingest_to_ready) = (Vec::new(), Vec::new(), Vec::new());
    let mut ready_at = Instant::now();
    while kills < agent_kills {
        // Upload works again: the first chunk of this agent process is acknowledged.
        rt.block_on(wait_status(&socket, "a first acked chunk", Duration::from_secs(60), |s| chunks_acked(s) > 0))?;
        to_first_ack.push(ready_at.elapsed());
        // Intake works again: the producers got answers from this process, for a while.
        let records = rng.random_range(tier.pick(2000..8000, 200..2000));
        producers.wait_acked(producers.acked(), records, Duration::from_secs(60), || agent.tail_log())?;
        if (kills + 1) % ingest_every == 0 {
            std::thread::sleep(Duration::from_millis(rng.random_range(0..200)));
            ingest.kill9()?;
            ingest_kills += 1;
            let t = Instant::now();
            ingest = world.start_ingest()?;
            ingest_to_ready.push(t.elapsed());
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..200)));
        agent.kill9()?;
        kills += 1;
        integrity_check(&spool).with_context(|| format!("after agent kill {kills}"))?;
        integrity_checks += 1;
        let t = Instant::now();
        agent = world.start_agent()?;
        ready_at = Instant::now();
        to_ready.push(ready_at - t);
    }
    let sent = producers.stop(&rt)?;
    rt.block_on(drain(&socket, Duration::from_secs(300))).map_err(|e| e.context(agent.tail_log()))?;
    let agent_exit = agent.terminate(Duration::from_secs(30))?;
    let ingest_exit = ingest.terminate(Duration::from_secs(30))?;
    assert!(agent_exit.success(), "agent exit after SIGTERM: {agent_exit}");
    assert!(ingest_exit.success(), "ingest exit after SIGTERM: {ingest_exit}");

    let report = workload::check_store(&workload, &world.data_dir(), &sent)?;
    let requests: usize = sent.iter().map(Vec::len).sum();
    let unknown: usize = sent.iter().flatten().filter(|r| !r.acked).count();
    edge_testkit::report(
        report_name,
        &serde_json::json!({
            "agent_sigkill_cycles": kills,
            "ingest_sigkill_cycles": ingest_kills,
            "spool_integrity_checks_ok": integrity_checks,
            "requests": requests,
            "requests_unknown_outcome": unknown,
            "restart_to_ready_ms": summary_ms(&to_ready),
            "ready_to_first_chunk_acked_ms": summary_ms(&to_first_ack),
            "ingest_restart_to_ready_ms": summary_ms(&ingest_to_ready),
            "check": report.to_json(),
        }),
    )?;
    assert!(report.is_exact(), "store differs from what was acknowledged: {report:?}");
    assert_eq!(report.out_of_order, 0, "records out of order: {report:?}");
    assert!(kills == agent_kills && ingest_kills >= 1 && integrity_checks == kills);
    assert!(report.acked >= 50 * u64::from(kills), "too few records acknowledged: {report:?}");
    Ok(())
}
