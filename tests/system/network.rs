//! The real agent and ingest server with the fault-injecting proxy (`edge_testkit::netem`)
//! between them: loss with delay and reordering, blackholes, flapping, address changes with and
//! without QUIC migration, and lost acknowledgements. Every run ends with the export holding
//! exactly the acknowledged records, each once.
//!
//! The agent's `[upload] server` points at the proxy; the proxy forwards to the ingest server.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use edge_testkit::netem::{Faults, Loss, Netem, NetemConfig, NetemHandle, Which};
use edge_testkit::workload::{self, ProducerOptions, Progress, Report, Sent, Workload};
use edge_testkit::{Daemon, Tier, report};
use edge_uploader::client::IntakeClient;
use rand::{Rng, SeedableRng};

use crate::common::World;

const STORED: &str = "edge_ingest_chunks_total{result=\"stored\"}";
const DUPLICATE: &str = "edge_ingest_chunks_total{result=\"duplicate\"}";
const INGEST_BYTES: &str = "edge_ingest_bytes_total";
const INGEST_CONNECTIONS: &str = "edge_ingest_connections_total";
const AGENT_RECONNECTS: &str = "edge_uploader_reconnects_total";
const AGENT_CONNECTED: &str = "edge_uploader_connected";
const AGENT_IN_FLIGHT: &str = "edge_uploader_chunks_in_flight";
const ACK_LATENCY: &str = "edge_uploader_chunk_upload_latency_seconds";

/// Real daemons with the proxy in between.
struct Net {
    world: World,
    rt: tokio::runtime::Runtime,
    proxy: Option<Netem>,
    net: NetemHandle,
    ingest: Daemon,
    agent: Daemon,
}

impl Net {
    /// A world whose agent talks to the ingest server through the proxy. `ingest_server_extra`
    /// lands in the ingest's `[server]` section.
    fn start(device: &str, faults: NetemConfig, seed: u64, ingest_server_extra: &str) -> anyhow::Result<Net> {
        Self::start_with(device, faults, seed, ingest_server_extra, "", "")
    }

    /// [`Net::start`], with `agent_upload_extra` in the agent's `[upload]` section and
    /// `agent_spool_extra` in its `[spool]` section.
    fn start_with(
        device: &str,
        faults: NetemConfig,
        seed: u64,
        ingest_server_extra: &str,
        agent_upload_extra: &str,
        agent_spool_extra: &str,
    ) -> anyhow::Result<Net> {
        let world = World::new(device, agent_upload_extra)?;
        if !agent_spool_extra.is_empty() {
            let text = std::fs::read_to_string(&world.agent_config)?;
            anyhow::ensure!(text.contains("[spool]\n"), "generated agent config has no [spool] section");
            std::fs::write(
                &world.agent_config,
                text.replacen("[spool]\n", &format!("[spool]\n{agent_spool_extra}\n"), 1),
            )?;
        }
        let ingest_text = std::fs::read_to_string(&world.ingest_config)?;
        let server_line = ingest_text
            .split("[server]\nlisten = \"")
            .nth(1)
            .and_then(|rest| rest.split('"').next())
            .context("no [server] listen in the generated ingest config")?;
        let upstream: SocketAddr = server_line.parse()?;
        let ingest_text = ingest_text.replacen(
            "[server]\n",
            &format!(
                "[server]\n{}",
                if ingest_server_extra.is_empty() { String::new() } else { format!("{ingest_server_extra}\n") }
            ),
            1,
        );
        std::fs::write(&world.ingest_config, ingest_text)?;
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
        let proxy = rt.block_on(Netem::start(SocketAddr::from(([127, 0, 0, 1], 0)), upstream, faults, seed))?;
        let net = proxy.handle();
        let agent_text = std::fs::read_to_string(&world.agent_config)?;
        let old = format!("server = \"{upstream}\"");
        anyhow::ensure!(agent_text.contains(&old), "generated agent config has no {old}");
        std::fs::write(&world.agent_config, agent_text.replace(&old, &format!("server = \"{}\"", proxy.local_addr())))?;
        let ingest = world.start_ingest()?;
        let agent = world.start_agent()?;
        Ok(Net { world, rt, proxy: Some(proxy), net, ingest, agent })
    }

    /// One producer per stream of `w`, `records` records each in batches of up to 20, all at
    /// once; what each sent.
    fn produce(&self, w: &Arc<Workload>, records: u64) -> anyhow::Result<Vec<Vec<Sent>>> {
        let tasks: Vec<_> = (0..w.streams.len())
            .map(|s| {
                let opts = ProducerOptions { total: Some(records), max_batch: 20, ..ProducerOptions::new(s) };
                self.rt.spawn(workload::produce(w.clone(), self.world.intake_socket(), opts, Progress::default()))
            })
            .collect();
        let mut sent = Vec::new();
        for t in tasks {
            sent.push(self.rt.block_on(t)??);
        }
        Ok(sent)
    }

    /// `edge-uploader status --json`, by the intake socket.
    fn status(&self) -> anyhow::Result<serde_json::Value> {
        let socket = self.world.intake_socket().to_string_lossy().into_owned();
        Ok(crate::common::json_output("edge-uploader", &["status", "--json", "--socket", &socket])?.1)
    }

    fn ingest_metric(&self, name: &str) -> anyhow::Result<f64> {
        Ok(World::scrape(self.world.ingest_metrics)?.get(name).copied().unwrap_or(0.0))
    }

    fn agent_metrics(&self) -> anyhow::Result<BTreeMap<String, f64>> {
        World::scrape(self.world.agent_metrics)
    }

    /// Polls an ingest metric until `pred` holds; returns its value.
    fn wait_ingest(&self, name: &str, timeout: Duration, pred: impl Fn(f64) -> bool) -> anyhow::Result<f64> {
        let deadline = Instant::now() + timeout;
        loop {
            let v = self.ingest_metric(name)?;
            if pred(v) {
                return Ok(v);
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{name} = {v} never met the condition within {timeout:?}; proxy {:?}; agent log:\n{}",
                self.net.stats(),
                self.agent.tail_log()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the agent's spool is empty and nothing is in flight.
    fn drain(&self, timeout: Duration) -> anyhow::Result<()> {
        let socket = self.world.intake_socket();
        self.rt.block_on(async {
            let mut client = IntakeClient::new(&socket);
            let deadline = Instant::now() + timeout;
            loop {
                let s = client.get_json("/v1/status").await?.body;
                if s["spool"]["sealed_chunks"] == 0 && s["spool"]["open_bytes"] == 0 && s["upload"]["in_flight"] == 0 {
                    return Ok(());
                }
                anyhow::ensure!(Instant::now() < deadline, "agent did not drain within {timeout:?}: {s}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    }

    /// Stops both daemons and the proxy, then checks the store against what was acknowledged.
    fn finish(mut self, workloads: &[(&Workload, &[Vec<Sent>])]) -> anyhow::Result<Report> {
        let a = self.agent.terminate(Duration::from_secs(30))?;
        let i = self.ingest.terminate(Duration::from_secs(30))?;
        anyhow::ensure!(a.success() && i.success(), "exit after SIGTERM: agent {a}, ingest {i}");
        if let Some(p) = self.proxy.take() {
            self.rt.block_on(p.shutdown());
        }
        let mut total = Report::default();
        for (w, sent) in workloads {
            total.add(&workload::check_store(w, &self.world.data_dir(), sent)?);
        }
        Ok(total)
    }
}

/// A producer sending `batch` records every `every` until stopped, so there is always fresh
/// data (and the spool stays small during long outages). Same bookkeeping as
/// `workload::produce`: 200 → acked, no answer → unknown outcome, 503/507 → same records again.
async fn trickle(
    w: Arc<Workload>,
    socket: PathBuf,
    stream: usize,
    every: Duration,
    batch: u64,
    progress: Progress,
) -> anyhow::Result<Vec<Sent>> {
    let name = w.streams.get(stream).context("no such stream")?.clone();
    let mut client = IntakeClient::new(&socket);
    let mut sent = Vec::new();
    let mut next = 0;
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    while !progress.stop.load(Ordering::Relaxed) {
        tick.tick().await;
        let body = w.ndjson(stream, next, batch);
        loop {
            match client.post(&name, "application/x-ndjson", body.clone()).await {
                Ok(r) if r.status == 200 => {
                    anyhow::ensure!(r.records() == batch, "intake acknowledged {} of {batch}", r.records());
                    sent.push(Sent { first: next, count: batch, acked: true });
                    progress.acked.fetch_add(batch, Ordering::Relaxed);
                    break;
                }
                Ok(r) if r.status == 503 || r.status == 507 => {
                    progress.refused.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(r) => anyhow::bail!("intake answered {}: {}", r.status, r.body),
                Err(_) => {
                    sent.push(Sent { first: next, count: batch, acked: false });
                    break;
                }
            }
        }
        next += batch;
        progress.sent.fetch_add(batch, Ordering::Relaxed);
    }
    Ok(sent)
}

/// A trickle on every stream of `w`; `stop()` ends it and returns what was sent per stream.
struct Trickle {
    progress: Progress,
    tasks: Vec<tokio::task::JoinHandle<anyhow::Result<Vec<Sent>>>>,
}

impl Trickle {
    fn start(net: &Net, w: &Arc<Workload>, every: Duration, batch: u64) -> Trickle {
        let progress = Progress::default();
        let tasks = (0..w.streams.len())
            .map(|s| net.rt.spawn(trickle(w.clone(), net.world.intake_socket(), s, every, batch, progress.clone())))
            .collect();
        Trickle { progress, tasks }
    }

    fn stop(self, net: &Net) -> anyhow::Result<Vec<Vec<Sent>>> {
        self.progress.stop.store(true, Ordering::Relaxed);
        let mut out = Vec::new();
        for t in self.tasks {
            out.push(net.rt.block_on(t)??);
        }
        Ok(out)
    }
}

/// The 99th percentile of a Prometheus histogram from the difference of two scrapes, as the
/// upper bound of the bucket it falls in: a number of seconds, `"> {largest bound}"` when it is
/// past every finite bucket, `null` without observations.
fn p99(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, name: &str) -> serde_json::Value {
    match p99_bound(before, after, name) {
        Some(le) if le.is_finite() => serde_json::json!(le),
        Some(_) => {
            let prefix = format!("{name}_bucket{{le=\"");
            let largest = after
                .keys()
                .filter_map(|k| k.strip_prefix(&prefix)?.strip_suffix("\"}")?.parse::<f64>().ok())
                .fold(0.0, f64::max);
            serde_json::json!(format!("> {largest}"))
        }
        None => serde_json::Value::Null,
    }
}

fn p99_bound(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>, name: &str) -> Option<f64> {
    let prefix = format!("{name}_bucket{{le=\"");
    let mut buckets: Vec<(f64, f64)> = after
        .iter()
        .filter_map(|(k, v)| {
            let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
            let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
            Some((le, v - before.get(k).copied().unwrap_or(0.0)))
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets.iter().find(|(_, c)| *c >= 0.99 * total).map(|(le, _)| *le)
}

fn faults(loss: f64) -> Faults {
    Faults {
        loss: Loss::uniform(loss),
        delay: Duration::from_millis(50),
        jitter: Duration::from_millis(10),
        reorder: 0.01,
        reorder_gap: Duration::from_millis(20),
        ..Faults::default()
    }
}

/// `upload.congestion_controller = "bbr"` (opt-in) changes how fast the agent sends, not what
/// arrives: under loss and reordering every record is stored once and in order.
#[test]
fn the_bbr_congestion_controller_delivers_every_record_once_under_loss() -> anyhow::Result<()> {
    let tier = Tier::current();
    let records = tier.pick(100, 1000);
    let config = NetemConfig::symmetric(Faults { loss: Loss::uniform(0.02), ..faults(0.02) });
    let net = Net::start_with("gw-net-bbr", config, 0xBB2, "", "congestion_controller = \"bbr\"\n", "")?;
    let w = Arc::new(Workload::new(0xBB2).with_streams(&["bbr.a", "bbr.b"]).with_sizes(200, 16 * 1024));
    let sent = net.produce(&w, records)?;
    net.drain(Duration::from_secs(tier.pick(120, 600)))?;
    let status = net.status()?;
    anyhow::ensure!(status["connection"]["congestion_controller"] == "bbr", "status: {status}");
    let lost = net.agent_metrics()?.get("edge_uploader_quic_lost_packets_total").copied().unwrap_or(0.0);
    let proxy = net.net.stats();
    let result = net.finish(&[(&w, &sent)])?;
    anyhow::ensure!(proxy.to_server.dropped_loss > 0, "the proxy dropped nothing: {proxy:?}");
    anyhow::ensure!(lost > 0.0, "QUIC declared no packet lost");
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    anyhow::ensure!(result.acked == records * 2, "all records acknowledged: {result:?}");
    Ok(())
}

/// `spool.compression = "zstd"`: chunks cross a lossy, reordering path compressed (fewer bytes
/// written to the streams than the records hold, `edge_uploader_upload_wire_bytes_total`), and
/// the ingest stores exactly the records accepted, each once, byte for byte.
#[test]
fn zstd_chunks_arrive_whole_and_once_under_loss() -> anyhow::Result<()> {
    let tier = Tier::current();
    let records = tier.pick(100, 2000);
    let config = NetemConfig::symmetric(Faults { loss: Loss::uniform(0.02), ..faults(0.02) });
    let net = Net::start_with("gw-net-zstd", config, 0x25D, "", "", "compression = \"zstd\"\nzstd_level = 3")?;
    let w = Arc::new(Workload::new(0x25D).with_streams(&["zstd.a", "zstd.b"]).with_sizes(100, 8 * 1024));
    let sent = net.produce(&w, records)?;
    net.drain(Duration::from_secs(tier.pick(120, 600)))?;
    let m = net.agent_metrics()?;
    let raw = m.get("edge_uploader_upload_bytes_total{result=\"stored\"}").copied().unwrap_or(0.0);
    let wire = m.get("edge_uploader_upload_wire_bytes_total").copied().unwrap_or(0.0);
    let status = net.status()?;
    anyhow::ensure!(status["upload"]["wire_bytes_total"].as_f64() == Some(wire), "status: {status}");
    let proxy = net.net.stats();
    let result = net.finish(&[(&w, &sent)])?;
    anyhow::ensure!(proxy.to_server.dropped_loss > 0, "the proxy dropped nothing: {proxy:?}");
    // The records are printable random bytes: zstd's entropy stage alone shrinks them by
    // about a fifth, so compressed chunks show as fewer bytes on the wire than stored.
    anyhow::ensure!(raw > 0.0 && wire > 0.0 && wire < 0.9 * raw, "wire {wire} bytes for {raw} bytes stored");
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    anyhow::ensure!(result.acked == records * 2, "all records acknowledged: {result:?}");
    Ok(())
}

#[test]
fn goodput_and_ack_latency_under_loss_with_delay_and_reordering() -> anyhow::Result<()> {
    let tier = Tier::current();
    let levels: Vec<f64> = tier.pick(vec![0.01, 0.10], vec![0.01, 0.05, 0.10, 0.20]);
    // Small in the quick tier: at 100 ms RTT with jitter-induced reordering QUIC moves only tens
    // of KB/s (see the report), and the quick test must stay short.
    let (records, max_record) = tier.pick((40, 4000), (300, 16 * 1024));
    // Uncompressed, so that goodput counts record bytes and compares across runs (the server
    // counts bytes as received); zstd under loss has a test of its own.
    let net = Net::start_with(
        "gw-net-loss",
        NetemConfig::symmetric(faults(levels[0])),
        0x1055,
        "",
        "",
        "compression = \"none\"",
    )?;
    let mut figures = Vec::new();
    let mut checks: Vec<(Workload, Vec<Vec<Sent>>)> = Vec::new();
    for (n, &loss) in levels.iter().enumerate() {
        net.net.set(NetemConfig::symmetric(faults(loss)));
        // Fresh stream names per level: the checker holds each level's streams to its workload.
        let names: Vec<String> = (0..2).map(|s| format!("loss{n}.s{s}")).collect();
        let names: Vec<&str> = names.iter().map(String::as_str).collect();
        let w = Arc::new(Workload::new(0x1055 + n as u64).with_streams(&names).with_sizes(200, max_record));
        let metrics_before = net.agent_metrics()?;
        let bytes_before = net.ingest_metric(INGEST_BYTES)?;
        let proxy_before = net.net.stats();
        let start = Instant::now();
        let sent = net.produce(&w, records)?;
        net.drain(Duration::from_secs(tier.pick(120, 1200)))?;
        let elapsed = start.elapsed();
        let stored_bytes = net.ingest_metric(INGEST_BYTES)? - bytes_before;
        let ack_p99 = p99(&metrics_before, &net.agent_metrics()?, ACK_LATENCY);
        let proxy = net.net.stats();
        let dropped = (proxy.to_server.dropped() + proxy.to_client.dropped())
            - (proxy_before.to_server.dropped() + proxy_before.to_client.dropped());
        let fig = serde_json::json!({
            "loss": loss,
            "stored_bytes": stored_bytes,
            "seconds": elapsed.as_secs_f64(),
            "goodput_mb_per_s": stored_bytes / 1e6 / elapsed.as_secs_f64(),
            "ack_latency_p99_le_seconds": ack_p99,
            "packets_dropped_by_proxy": dropped,
        });
        eprintln!("loss level: {fig}");
        anyhow::ensure!(stored_bytes > 0.0, "nothing stored at {loss} loss");
        anyhow::ensure!(dropped > 0, "the proxy dropped nothing at {loss} loss");
        figures.push(fig);
        checks.push((Arc::unwrap_or_clone(w), sent));
    }
    let proxy = net.net.stats();
    let refs: Vec<(&Workload, &[Vec<Sent>])> = checks.iter().map(|(w, s)| (w, s.as_slice())).collect();
    let result = net.finish(&refs)?;
    report(
        "network_loss_goodput",
        &serde_json::json!({
            "delay": "50ms ± 10ms each way", "reorder": "1 % held back 20 ms",
            "levels": figures, "proxy": proxy, "check": result.to_json(),
        }),
    )?;
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    anyhow::ensure!(result.acked == records * 2 * levels.len() as u64, "all records acknowledged: {result:?}");
    Ok(())
}

#[test]
fn next_chunk_is_stored_promptly_after_a_blackhole_heals() -> anyhow::Result<()> {
    let tier = Tier::current();
    let outages: Vec<Duration> = tier.pick(
        vec![Duration::from_secs(3)],
        vec![Duration::from_secs(10), Duration::from_secs(60), Duration::from_secs(300)],
    );
    let net = Net::start("gw-net-blackhole", NetemConfig::default(), 0xB1AC, "")?;
    let w = Arc::new(Workload::new(0xB1AC).with_streams(&["bh.a", "bh.b"]).with_sizes(100, 4000));
    let trickle = Trickle::start(&net, &w, Duration::from_millis(20), 10);
    let mut figures = Vec::new();
    for outage in &outages {
        // Traffic flows before the outage.
        let base = net.ingest_metric(STORED)?;
        net.wait_ingest(STORED, Duration::from_secs(30), |v| v > base + 3.0)?;
        net.net.blackhole(Which::Both, true);
        let reconnects_before = net.agent_metrics()?.get(AGENT_RECONNECTS).copied().unwrap_or(0.0);
        std::thread::sleep(*outage);
        let before = net.ingest_metric(STORED)?;
        net.net.blackhole(Which::Both, false);
        let healed = Instant::now();
        net.wait_ingest(STORED, Duration::from_secs(120), |v| v > before)?;
        let recovery = healed.elapsed();
        let reconnects = net.agent_metrics()?.get(AGENT_RECONNECTS).copied().unwrap_or(0.0) - reconnects_before;
        let fig = serde_json::json!({
            "blackhole_seconds": outage.as_secs_f64(),
            "heal_to_next_stored_seconds": recovery.as_secs_f64(),
            "agent_reconnects": reconnects,
        });
        eprintln!("blackhole: {fig}");
        figures.push(fig);
    }
    let sent = trickle.stop(&net)?;
    net.drain(Duration::from_secs(120))?;
    let proxy = net.net.stats();
    let result = net.finish(&[(&w, &sent)])?;
    report(
        "network_blackhole_recovery",
        &serde_json::json!({"outages": figures, "proxy": proxy, "check": result.to_json()}),
    )?;
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    anyhow::ensure!(result.acked > 0, "nothing acknowledged");
    Ok(())
}

/// `VmRSS` in KiB and the number of open fds of a process.
fn rss_and_fds(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("no VmRSS in /proc/PID/status")?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))?.count() as u64;
    Ok((rss, fds))
}

fn flapping(total: Duration, name: &str) -> anyhow::Result<()> {
    let net = Net::start("gw-net-flap", NetemConfig::default(), 0xF1A9, "")?;
    let pid = net.agent.pid().context("agent not running")?;
    let w = Arc::new(Workload::new(0xF1A9).with_streams(&["flap.a", "flap.b"]).with_sizes(100, 4000));
    let trickle = Trickle::start(&net, &w, Duration::from_millis(20), 10);
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xF1A9);
    let start = Instant::now();
    let mut samples: Vec<(f64, u64, u64)> = Vec::new();
    let mut next_flip = Instant::now();
    let mut down = false;
    let mut flips = 0u32;
    // Outages and good spells of 0.5-8 s (some longer than the keep-alive, none past the idle
    // timeout), sampled every 250 ms.
    while start.elapsed() < total {
        if Instant::now() >= next_flip {
            down = !down;
            flips += 1;
            net.net.blackhole(Which::Both, down);
            next_flip = Instant::now() + Duration::from_millis(rng.random_range(500..8000));
        }
        let (rss, fds) = rss_and_fds(pid)?;
        samples.push((start.elapsed().as_secs_f64(), rss, fds));
        std::thread::sleep(Duration::from_millis(250));
    }
    net.net.blackhole(Which::Both, false);
    let sent = trickle.stop(&net)?;
    net.drain(Duration::from_secs(120))?;
    let (rss_end, fds_end) = rss_and_fds(pid)?;
    let q = samples.len() / 4;
    let max = |s: &[(f64, u64, u64)], f: fn(&(f64, u64, u64)) -> u64| s.iter().map(f).max().unwrap_or(0);
    let (first, last) = (&samples[..q.max(1)], &samples[samples.len() - q.max(1)..]);
    let rss_first = max(first, |s| s.1);
    let rss_last = max(last, |s| s.1);
    let fds_first = max(first, |s| s.2);
    let fds_last = max(last, |s| s.2);
    let proxy = net.net.stats();
    let reconnects = net.agent_metrics()?.get(AGENT_RECONNECTS).copied().unwrap_or(0.0);
    let result = net.finish(&[(&w, &sent)])?;
    let series: Vec<_> =
        samples.iter().step_by((samples.len() / 40).max(1)).map(|s| serde_json::json!([s.0, s.1, s.2])).collect();
    report(
        name,
        &serde_json::json!({
            "seconds": total.as_secs_f64(), "flips": flips, "agent_reconnects": reconnects,
            "rss_kib": {"first_quarter_max": rss_first, "last_quarter_max": rss_last, "after_drain": rss_end},
            "fds": {"first_quarter_max": fds_first, "last_quarter_max": fds_last, "after_drain": fds_end},
            "series_t_rss_kib_fds": series, "proxy": proxy, "check": result.to_json(),
        }),
    )?;
    anyhow::ensure!(flips >= 4, "too few flaps: {flips}");
    anyhow::ensure!(rss_last <= rss_first * 3 / 2 + 16 * 1024, "agent RSS grew: {rss_first} KiB → {rss_last} KiB");
    anyhow::ensure!(fds_last <= fds_first * 3 / 2 + 8, "agent fds grew: {fds_first} → {fds_last}");
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    Ok(())
}

#[test]
fn flapping_link_keeps_agent_memory_and_fds_flat() -> anyhow::Result<()> {
    flapping(Duration::from_secs(20), "network_flapping_quick")
}

#[test]
#[ignore = "long tier"]
fn flapping_link_for_ten_minutes_keeps_agent_memory_and_fds_flat() -> anyhow::Result<()> {
    flapping(Duration::from_secs(600), "network_flapping_10min")
}

/// New source addresses in turn: a new port, then 127.0.0.2, 127.0.0.3, back to 127.0.0.1...
fn rebind_target(i: usize) -> Option<IpAddr> {
    match i % 3 {
        0 => None,
        1 => Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))),
        _ => Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3))),
    }
}

#[test]
fn connection_migrates_across_address_changes() -> anyhow::Result<()> {
    let tier = Tier::current();
    let (rebinds, every) = tier.pick((3, Duration::from_secs(2)), (10, Duration::from_secs(30)));
    let net = Net::start("gw-net-migrate", NetemConfig::default(), 0x316, "")?;
    let w = Arc::new(Workload::new(0x316).with_streams(&["mig.a", "mig.b"]).with_sizes(100, 4000));
    let trickle = Trickle::start(&net, &w, Duration::from_millis(20), 10);
    let mut addrs = Vec::new();
    for i in 0..rebinds {
        let base = net.ingest_metric(STORED)?;
        net.wait_ingest(STORED, Duration::from_secs(30), |v| v > base + 3.0)?;
        std::thread::sleep(every);
        let new = net.rt.block_on(net.net.rebind(rebind_target(i)))?;
        anyhow::ensure!(new.len() == 1, "one agent, one upstream socket: {new:?}");
        addrs.push(new[0].to_string());
        // Chunks keep being stored from the new address.
        let at = net.ingest_metric(STORED)?;
        net.wait_ingest(STORED, Duration::from_secs(30), |v| v > at + 3.0)?;
    }
    let sent = trickle.stop(&net)?;
    net.drain(Duration::from_secs(60))?;
    let connections = net.ingest_metric(INGEST_CONNECTIONS)?;
    let reconnects = net.agent_metrics()?.get(AGENT_RECONNECTS).copied().unwrap_or(-1.0);
    let proxy = net.net.stats();
    let result = net.finish(&[(&w, &sent)])?;
    report(
        "network_migration",
        &serde_json::json!({
            "rebinds": rebinds, "every_seconds": every.as_secs_f64(), "upstream_addresses": addrs,
            "ingest_connections_total": connections, "agent_reconnects": reconnects,
            "proxy": proxy, "check": result.to_json(),
        }),
    )?;
    anyhow::ensure!(connections == 1.0, "the connection migrated instead of reconnecting: {connections} connections");
    anyhow::ensure!(reconnects == 0.0, "agent reconnected {reconnects} times");
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    Ok(())
}

#[test]
fn refused_migration_makes_the_agent_reconnect_without_loss() -> anyhow::Result<()> {
    let tier = Tier::current();
    let rebinds: u32 = tier.pick(1, 3);
    let net = Net::start("gw-net-nomig", NetemConfig::default(), 0x317, "allow_migration = false")?;
    let w = Arc::new(Workload::new(0x317).with_streams(&["nomig.a", "nomig.b"]).with_sizes(100, 4000));
    let trickle = Trickle::start(&net, &w, Duration::from_millis(20), 10);
    let mut recoveries = Vec::new();
    for i in 0..rebinds {
        let base = net.ingest_metric(STORED)?;
        net.wait_ingest(STORED, Duration::from_secs(30), |v| v > base + 3.0)?;
        let connections = net.ingest_metric(INGEST_CONNECTIONS)?;
        let moved = Instant::now();
        net.rt.block_on(net.net.rebind(rebind_target(i as usize)))?;
        // The server ignores the moved client; the agent notices only when its connection
        // times out, then connects afresh from the new address.
        net.wait_ingest(INGEST_CONNECTIONS, Duration::from_secs(90), |v| v > connections)?;
        let reconnected = moved.elapsed();
        let at = net.ingest_metric(STORED)?;
        net.wait_ingest(STORED, Duration::from_secs(30), |v| v > at)?;
        recoveries.push(serde_json::json!({
            "rebind_to_new_connection_seconds": reconnected.as_secs_f64(),
            "rebind_to_next_stored_seconds": moved.elapsed().as_secs_f64(),
        }));
    }
    let sent = trickle.stop(&net)?;
    net.drain(Duration::from_secs(60))?;
    let connections = net.ingest_metric(INGEST_CONNECTIONS)?;
    let reconnects = net.agent_metrics()?.get(AGENT_RECONNECTS).copied().unwrap_or(-1.0);
    let proxy = net.net.stats();
    let result = net.finish(&[(&w, &sent)])?;
    report(
        "network_migration_refused",
        &serde_json::json!({
            "rebinds": rebinds, "recoveries": recoveries, "ingest_connections_total": connections,
            "agent_reconnects": reconnects, "proxy": proxy, "check": result.to_json(),
        }),
    )?;
    anyhow::ensure!(connections == f64::from(rebinds + 1), "one new connection per move: {connections}");
    anyhow::ensure!(reconnects == f64::from(rebinds), "agent reconnects: {reconnects}");
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    Ok(())
}

#[test]
fn lost_acks_make_the_agent_resend_and_the_ingest_deduplicate() -> anyhow::Result<()> {
    let net = Net::start("gw-net-acks", NetemConfig::default(), 0xACC, "")?;
    let w = Arc::new(Workload::new(0xACC).with_streams(&["acks.a", "acks.b"]).with_sizes(100, 4000));
    let trickle = Trickle::start(&net, &w, Duration::from_millis(20), 10);
    let base = net.ingest_metric(STORED)?;
    net.wait_ingest(STORED, Duration::from_secs(30), |v| v > base + 10.0)?;
    // Only answers are dropped: chunks still reach the ingest and are stored, their acks never
    // reach the agent, and the agent's connection times out for lack of anything received.
    // Without QUIC ACKs the agent can send only what its congestion window leaves, so the cut
    // comes once everything in flight is acked (and the window grew over the ten chunks
    // before): the next chunk then has the whole window. Cut after six chunks, whatever was in
    // flight, one CI run saw no chunk reach the ingest whole before the connection timed out.
    let deadline = Instant::now() + Duration::from_secs(30);
    while net.agent_metrics()?.get(AGENT_IN_FLIGHT).copied().unwrap_or(0.0) > 0.0 {
        anyhow::ensure!(Instant::now() < deadline, "the agent never had all its chunks acked");
        std::thread::sleep(Duration::from_millis(2));
    }
    net.net.blackhole(Which::ToClient, true);
    let cut = Instant::now();
    let at_cut = net.ingest_metric(STORED)?;
    net.wait_ingest(STORED, Duration::from_secs(30), |v| v > at_cut)?;
    let deadline = Instant::now() + Duration::from_secs(90);
    while net.agent_metrics()?.get(AGENT_CONNECTED).copied().unwrap_or(0.0) > 0.0 {
        anyhow::ensure!(Instant::now() < deadline, "the agent never noticed its connection died");
        std::thread::sleep(Duration::from_millis(100));
    }
    let dead_after = cut.elapsed();
    let stored_unacked = net.ingest_metric(STORED)? - at_cut;
    net.net.blackhole(Which::ToClient, false);
    let duplicates = net.wait_ingest(DUPLICATE, Duration::from_secs(60), |v| v > 0.0)?;
    let sent = trickle.stop(&net)?;
    net.drain(Duration::from_secs(60))?;
    let duplicates = net.ingest_metric(DUPLICATE)?.max(duplicates);
    let proxy = net.net.stats();
    let result = net.finish(&[(&w, &sent)])?;
    report(
        "network_lost_acks",
        &serde_json::json!({
            "connection_dead_after_seconds": dead_after.as_secs_f64(),
            "chunks_stored_while_acks_lost": stored_unacked,
            "duplicates_offered": duplicates,
            "proxy": proxy, "check": result.to_json(),
        }),
    )?;
    anyhow::ensure!(duplicates > 0.0, "no chunk offered twice");
    anyhow::ensure!(result.duplicates_stored == 0, "duplicates stored: {result:?}");
    anyhow::ensure!(result.is_exact(), "store not exact: {result:?}");
    Ok(())
}

/// The ingest killed and started again a while later, with the agent's backoff at 30 s flat:
/// the agent's attempts get no answer, so its wait probes the server every second, and the
/// restarted server's answer ends the wait long before the backoff would.
#[test]
fn an_ingest_back_after_an_outage_answers_a_probe_and_the_agent_reconnects_at_once() -> anyhow::Result<()> {
    use crate::common::{push, readings, set_backoff, status_json, wait_json};
    let world = World::new("gw-net-probe", "connect_timeout = \"1s\"\nprobe_interval = \"1s\"\nwatch_network = false")?;
    set_backoff(&world, "30s", "30s")?;
    let mut ingest = world.start_ingest()?;
    let agent = world.start_agent()?;
    let before = readings("probe.before", 20);
    push(&world, "probe.before", &before)?;
    wait_json("the first records acked", || status_json(&world), |_, d| d["upload"]["records_acked_total"] == 20)?;

    ingest.kill9()?;
    let during = readings("probe.during", 200);
    push(&world, "probe.during", &during)?;
    // The connection ends at the agent's idle timeout (the server went silent), so the 30 s wait
    // that follows probes.
    let probing = wait_json(
        "the agent probing the server",
        || status_json(&world),
        |_, d| d["upload"]["connected"] == false && d["upload"]["probes_sent_total"].as_u64() >= Some(1),
    )?;
    let attempts = probing["upload"]["connect_attempts_total"].as_u64().context("connect_attempts_total")?;
    ingest = world.start_ingest()?;
    let back = Instant::now();
    let doc = wait_json(
        "the agent connected to the restarted ingest",
        || status_json(&world),
        |_, d| d["upload"]["connected"] == true,
    )?;
    let reconnect = back.elapsed();
    let doc = wait_json(
        "every record acked and the spool empty",
        || status_json(&world),
        |_, d| d["upload"]["records_acked_total"] == 220 && d["spool"]["total_bytes"] == 0,
    )
    .map_err(|e| e.context(format!("connected: {doc}")))?;
    let wakeups = doc["upload"]["probe_wakeups_total"].as_u64().context("probe_wakeups_total")?;
    let attempts_after = doc["upload"]["connect_attempts_total"].as_u64().context("connect_attempts_total")? - attempts;
    let probes = doc["upload"]["probes_sent_total"].as_u64().context("probes_sent_total")?;
    drop(agent);
    drop(ingest);
    for (stream, sent) in [("probe.before", &before), ("probe.during", &during)] {
        let stored: Vec<String> =
            world.export_raw(stream)?.into_iter().map(|r| String::from_utf8_lossy(&r).into_owned()).collect();
        anyhow::ensure!(&stored == sent, "{stream}: {} stored of {} sent, or not in order", stored.len(), sent.len());
    }
    let figures = serde_json::json!({
        "backoff": "30s flat", "probe_interval_seconds": 1, "ingest_ready_to_connected_seconds": reconnect.as_secs_f64(),
        "probe_wakeups": wakeups, "probes_sent": probes, "attempts_after_the_restart": attempts_after,
        "records": 220, "stored_exactly_once": true,
    });
    report("ingest_outage_probe", &figures)?;
    anyhow::ensure!(wakeups == 1, "not one wait ended by a probe's answer: {figures}");
    anyhow::ensure!(attempts_after == 1, "one attempt, the one the answer started: {figures}");
    // The status is polled every 100 ms and the probe goes out every second: about a second
    // and a half at most, against at least 15 s (less the ingest's start) for the backoff.
    anyhow::ensure!(reconnect < Duration::from_secs(8), "connected {reconnect:?} after the ingest was back: {figures}");
    Ok(())
}

#[test]
fn a_restarted_ingest_resets_its_predecessors_connections_so_agents_reconnect_at_once() -> anyhow::Result<()> {
    use crate::crash_loop::{Producers, agent_status, chunks_acked, drain, runtime, wait_status};
    let world = World::new("gw-net-restart", "")?;
    let socket = world.intake_socket();
    let mut ingest = world.start_ingest()?;
    let agent = world.start_agent()?;
    let rt = runtime()?;
    let w = Arc::new(Workload::new(0x5E5E7).with_sizes(10, 1000));
    let producers = Producers::start(&rt, &w, &socket, 5);
    rt.block_on(wait_status(&socket, "a first acked chunk", Duration::from_secs(60), |s| chunks_acked(s) > 0))?;
    ingest.kill9()?;
    let restarted = Instant::now();
    ingest = world.start_ingest()?;
    // The new process holds the same stateless-reset key (derived from tls.key), so the agent's
    // next packet on the old connection is answered with a reset it accepts. With a random key
    // per process the agent would only give up on the connection at its idle timeout, logging
    // "timed out", never "reset by peer".
    agent.wait_log("reset by peer", Duration::from_secs(30)).map_err(|e| e.context(agent.tail_log()))?;
    let acked_before = chunks_acked(&rt.block_on(agent_status(&socket))?);
    rt.block_on(wait_status(&socket, "a chunk acked by the new process", Duration::from_secs(60), |s| {
        chunks_acked(s) > acked_before
    }))?;
    let reconnected = restarted.elapsed();
    let sent = producers.stop(&rt)?;
    rt.block_on(drain(&socket, Duration::from_secs(60)))?;
    let check = workload::check_store(&w, &world.data_dir(), &sent)?;
    report(
        "ingest_restart_stateless_reset",
        &serde_json::json!({"restart_to_next_chunk_acked_seconds": reconnected.as_secs_f64(), "check": check.to_json()}),
    )?;
    drop(ingest);
    anyhow::ensure!(check.is_exact(), "store not exact: {check:?}");
    Ok(())
}
