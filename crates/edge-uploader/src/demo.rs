//! `edge-uploader demo`: the whole product on one machine in one command.
//!
//! Generates a CA, a server and a device certificate; starts an ingest server and an agent on
//! loopback; runs producers that push synthetic sensor data through the agent's Unix socket
//! (small JSON temperature readings in NDJSON batches, 4 KiB binary vibration frames, occasional
//! 256 KiB blobs); shows progress; drains; stops both sides politely; then reads everything back
//! through the ingest export path and checks that every record the intake acknowledged arrived
//! exactly once with the same bytes.

use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use edge_ingest::server::{Server, ServerOptions};
use edge_ingest::store::{ExportFilter, Store, StoreHandle, StoreOptions};
use rand::{Rng, SeedableRng};
use serde::Serialize;

use crate::agent::Agent;
use crate::client::IntakeClient;
use crate::config::{RawConfig, validate};

/// Demo options from the command line.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Stop producing after this many records (across all streams).
    pub records: Option<u64>,
    /// Stop producing after this long.
    pub duration: Option<Duration>,
    /// Working directory (kept afterwards); a temporary one otherwise. Its `pki/`, `ingest/` and
    /// `agent/` subdirectories are removed at start; nothing else in it is touched.
    pub dir: Option<PathBuf>,
    /// Print the final summary as JSON on stdout.
    pub json: bool,
}

/// The final summary.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub records_sent: u64,
    pub records_stored: u64,
    pub duplicates_stored: u64,
    pub records_missing: u64,
    pub records_corrupt: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub throughput_mb_s: f64,
    pub records_per_s: f64,
    pub latency_p50_ms: Option<u32>,
    pub latency_p99_ms: Option<u32>,
    pub chunks_acked: u64,
    /// Chunk bytes the agent sent to the ingest, after compression.
    pub wire_bytes: u64,
    pub dir: String,
}

const TEMPERATURE: &str = "temperature";
const VIBRATION: &str = "vibration";
const BLOBS: &str = "blobs";
const TEMPERATURE_BATCH: u64 = 500;
const VIBRATION_FRAME: usize = 4096;
const BLOB_SIZE: usize = 256 * 1024;
const VIBRATION_PRODUCERS: u64 = 8;

/// Deterministic content of record `i` of `stream`; the checker regenerates it.
fn record_bytes(stream: &str, i: u64) -> Vec<u8> {
    match stream {
        TEMPERATURE => {
            let celsius = 15.0 + (i % 200) as f64 / 10.0;
            format!("{{\"sensor\":\"t-{}\",\"i\":{i},\"celsius\":{celsius:.1}}}", i % 16).into_bytes()
        }
        _ => {
            let len = if stream == VIBRATION { VIBRATION_FRAME } else { BLOB_SIZE };
            let mut v = vec![0u8; len];
            v[..8].copy_from_slice(&i.to_le_bytes());
            let mut rng = rand::rngs::StdRng::seed_from_u64(i ^ (len as u64).rotate_left(32));
            rng.fill(&mut v[8..]);
            v
        }
    }
}

/// Index carried inside a record, to find where it belongs.
fn record_index(stream: &str, rec: &[u8]) -> Option<u64> {
    if stream == TEMPERATURE {
        let s = std::str::from_utf8(rec).ok()?;
        let start = s.find("\"i\":")? + 4;
        let end = s[start..].find(',')? + start;
        s[start..end].parse().ok()
    } else {
        Some(u64::from_le_bytes(rec.get(..8)?.try_into().ok()?))
    }
}

struct Plan {
    temperature: u64,
    vibration: u64,
    blobs: u64,
}

impl Plan {
    fn for_records(n: u64) -> Plan {
        let blobs = n / 1000;
        let vibration = n / 10;
        Plan { temperature: n - blobs - vibration, vibration, blobs }
    }
}

/// Runs the demo; returns the summary (the caller decides the exit code).
pub async fn run(opts: DemoOptions) -> anyhow::Result<Summary> {
    let (dir, _tmp) = match &opts.dir {
        Some(d) => {
            std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
            (d.clone(), None)
        }
        None => {
            let t =
                tempfile::Builder::new().prefix("edge-demo-").tempdir().context("creating a temporary directory")?;
            (t.path().to_path_buf(), Some(t))
        }
    };
    let stop_after = match (opts.records, opts.duration) {
        (None, None) => (Some(100_000), None),
        other => other,
    };
    // Every run starts from scratch so the final check sees only this run's records.
    for sub in ["pki", "ingest", "agent"] {
        let p = dir.join(sub);
        if p.exists() {
            std::fs::remove_dir_all(&p).with_context(|| format!("clearing {} from an earlier run", p.display()))?;
        }
    }
    eprintln!("edge-uploader demo in {}{}", dir.display(), if _tmp.is_some() { " (temporary)" } else { "" });

    // Certificates.
    let pki = edge_transport::pki::InMemoryPki::generate(&["localhost", "127.0.0.1"])?;
    let server_files = pki.write_server_files(&dir.join("pki/server"))?;
    let device_files = pki.write_device_files("demo-gateway-01", &dir.join("pki/device"))?;

    // Ingest server.
    let data_dir = dir.join("ingest");
    let (store, _report) = Store::open(StoreOptions::new(&data_dir)).context("opening the ingest store")?;
    let store = StoreHandle::spawn(store);
    let tuning = edge_transport::Tuning::default();
    let server_config = edge_transport::server_config(&server_files.server_tls(), &tuning)?;
    let endpoint = edge_transport::server_endpoint("127.0.0.1:0".parse()?, server_config, &tuning)?;
    let server = Server::start(endpoint, store.clone(), ServerOptions::default())?;
    let port = server.local_addr().port();

    // Agent.
    let spool_path = dir.join("agent/spool.db");
    let mut raw = RawConfig::default();
    raw.intake.socket = dir.join("agent/intake.sock");
    raw.spool.path = spool_path;
    raw.spool.max_bytes = bytesize::ByteSize::gib(4);
    raw.upload.server = format!("127.0.0.1:{port}");
    raw.upload.server_name = Some("localhost".into());
    raw.upload.ca = device_files.ca_cert.clone();
    raw.upload.cert = device_files.cert.clone();
    raw.upload.key = device_files.key.clone();
    raw.upload.backoff_min = Duration::from_millis(50);
    let config = validate(raw, None)?;
    let agent = Agent::start(&config).await?;

    // Producers.
    let started = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicU64::new(0));
    let sent_bytes = Arc::new(AtomicU64::new(0));
    let plan = stop_after.0.map(Plan::for_records);
    let deadline = stop_after.1.map(|d| started + d);
    let socket = config.intake.socket.clone();
    let mut producers = tokio::task::JoinSet::new();
    let acked: Arc<std::sync::Mutex<HashMap<&'static str, Vec<u64>>>> = Arc::default();
    let ctx = Producer {
        socket: socket.clone(),
        stop: stop.clone(),
        sent: sent.clone(),
        sent_bytes: sent_bytes.clone(),
        deadline,
        acked: acked.clone(),
    };
    producers.spawn(ctx.clone().run(TEMPERATURE, 0, 1, plan.as_ref().map(|p| p.temperature)));
    for k in 0..VIBRATION_PRODUCERS {
        producers.spawn(ctx.clone().run(VIBRATION, k, VIBRATION_PRODUCERS, plan.as_ref().map(|p| p.vibration)));
    }
    producers.spawn(ctx.clone().run(BLOBS, 0, 1, plan.as_ref().map(|p| p.blobs)));

    // Progress until the producers finish and the spool is drained.
    let mut last = (Instant::now(), 0u64, 0u64);
    let mut producing = true;
    let mut tick = tokio::time::interval(Duration::from_millis(1000));
    tick.tick().await;
    loop {
        tokio::select! {
            joined = producers.join_next(), if producing => match joined {
                Some(Ok(Ok(()))) => {}
                Some(Ok(Err(e))) => { stop.store(true, Ordering::Release); return Err(e.context("producer failed")); }
                Some(Err(e)) => return Err(anyhow::anyhow!("producer task: {e}")),
                None => {
                    producing = false;
                    agent.spool().seal_all().await;
                }
            },
            _ = tick.tick() => {
                let now = Instant::now();
                let s = sent.load(Ordering::Relaxed);
                let b = sent_bytes.load(Ordering::Relaxed);
                let dt = now.duration_since(last.0).as_secs_f64().max(1e-3);
                let st = agent.spool_stats();
                let up = agent.upload();
                eprintln!(
                    "[{:6.1}s] accepted {:>9} rec {:>9.0} rec/s {:>7.1} MB/s | acked {:>9} rec | backlog {:>5} chunks {:>8.1} MB | {}",
                    started.elapsed().as_secs_f64(),
                    s,
                    (s - last.1) as f64 / dt,
                    (b - last.2) as f64 / dt / 1e6,
                    up.records_acked_total.load(Ordering::Relaxed),
                    st.sealed_chunks,
                    (st.sealed_bytes + st.open_bytes) as f64 / 1e6,
                    if up.connected.load(Ordering::Relaxed) { "connected" } else { "disconnected" },
                );
                let _ = std::io::stderr().flush();
                last = (now, s, b);
                if !producing {
                    // Seal stragglers; the check below stops once nothing is left.
                    agent.spool().seal_all().await;
                }
            }
        }
        if !producing {
            let st = agent.spool_stats();
            if st.sealed_chunks == 0 && st.open_bytes == 0 && up_idle(&agent) {
                break;
            }
        }
    }
    let seconds = started.elapsed().as_secs_f64();
    let (p50, p99) = {
        let l = crate::lock(&agent.upload().latency_ms);
        (l.quantile(0.5), l.quantile(0.99))
    };
    let chunks_acked = agent.upload().chunks_acked();
    let wire_bytes = agent.upload().wire_bytes_total.load(Ordering::Relaxed);
    agent.shutdown().await;
    server.shutdown().await;
    drop(store);

    // Verify through the export path.
    let acked = std::mem::take(&mut *crate::lock(&acked));
    let check = verify(&data_dir, &acked)?;
    let records_sent = sent.load(Ordering::Relaxed);
    let bytes = sent_bytes.load(Ordering::Relaxed);
    Ok(Summary {
        records_sent,
        records_stored: check.stored,
        duplicates_stored: check.duplicates,
        records_missing: check.missing,
        records_corrupt: check.corrupt,
        bytes,
        seconds,
        throughput_mb_s: bytes as f64 / seconds / 1e6,
        records_per_s: records_sent as f64 / seconds,
        latency_p50_ms: p50,
        latency_p99_ms: p99,
        chunks_acked,
        wire_bytes,
        dir: if _tmp.is_some() { String::new() } else { dir.display().to_string() },
    })
}

fn up_idle(agent: &Agent) -> bool {
    agent.upload().in_flight.load(Ordering::Relaxed) == 0
}

#[derive(Clone)]
struct Producer {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    sent: Arc<AtomicU64>,
    sent_bytes: Arc<AtomicU64>,
    deadline: Option<Instant>,
    acked: Arc<std::sync::Mutex<HashMap<&'static str, Vec<u64>>>>,
}

impl Producer {
    /// Sends records `k, k + step, k + 2 step, ...` below `total` of `stream`.
    async fn run(self, stream: &'static str, k: u64, step: u64, total: Option<u64>) -> anyhow::Result<()> {
        let mut client = IntakeClient::new(&self.socket);
        let mut i = k;
        let mut mine = Vec::new();
        loop {
            if self.stop.load(Ordering::Acquire) || self.deadline.is_some_and(|d| Instant::now() >= d) {
                break;
            }
            if total.is_some_and(|t| i >= t) {
                break;
            }
            let (ctype, body, indices) = if stream == TEMPERATURE {
                let end = total.map_or(i + TEMPERATURE_BATCH, |t| t.min(i + TEMPERATURE_BATCH));
                let mut body = Vec::with_capacity(80 * (end - i) as usize);
                for j in i..end {
                    body.extend_from_slice(&record_bytes(stream, j));
                    body.push(b'\n');
                }
                ("application/x-ndjson", body, (i..end).collect::<Vec<_>>())
            } else {
                ("application/octet-stream", record_bytes(stream, i), vec![i])
            };
            let len = body.len() as u64 - if stream == TEMPERATURE { indices.len() as u64 } else { 0 };
            let body = Bytes::from(body);
            loop {
                let resp = client.post(stream, ctype, body.clone()).await?;
                match resp.status {
                    200 => break,
                    507 | 503 => tokio::time::sleep(Duration::from_millis(100)).await,
                    s => anyhow::bail!("intake answered {s}: {}", resp.body),
                }
            }
            self.sent.fetch_add(indices.len() as u64, Ordering::Relaxed);
            self.sent_bytes.fetch_add(len, Ordering::Relaxed);
            i = if stream == TEMPERATURE { indices.last().copied().unwrap_or(i) + 1 } else { i + step };
            mine.extend(indices);
        }
        crate::lock(&self.acked).entry(stream).or_default().extend(mine);
        Ok(())
    }
}

struct Check {
    stored: u64,
    duplicates: u64,
    missing: u64,
    corrupt: u64,
}

fn verify(data_dir: &Path, acked: &HashMap<&'static str, Vec<u64>>) -> anyhow::Result<Check> {
    let mut seen: HashMap<String, HashMap<u64, u32>> = HashMap::new();
    let mut corrupt = 0u64;
    edge_ingest::store::export(data_dir, &ExportFilter::default(), |chunk| {
        let stream = chunk.key.stream.clone();
        let counts = seen.entry(stream.clone()).or_default();
        for rec in &chunk.records {
            match record_index(&stream, rec) {
                Some(i) if record_bytes(&stream, i) == *rec => *counts.entry(i).or_default() += 1,
                _ => corrupt += 1,
            }
        }
        Ok(())
    })
    .context("exporting from the ingest store")?;
    let mut stored = 0;
    let mut duplicates = 0;
    let mut missing = 0;
    for counts in seen.values() {
        for &n in counts.values() {
            stored += 1;
            duplicates += u64::from(n.saturating_sub(1));
        }
    }
    for (stream, indices) in acked {
        let counts = seen.get(*stream);
        for i in indices {
            if counts.and_then(|c| c.get(i)).is_none() {
                missing += 1;
            }
        }
    }
    Ok(Check { stored, duplicates, missing, corrupt })
}

/// Prints the summary for people.
pub fn print_human(s: &Summary) {
    println!(
        "demo finished: {} records accepted, {} stored, {} duplicates, {} missing, {} corrupt\n\
         {:.1} MB in {:.1} s = {:.1} MB/s ({:.0} records/s), {} chunks, {:.1} MB on the wire; latency intake→ack p50 {} ms, p99 {} ms\n\
         {}",
        s.records_sent,
        s.records_stored,
        s.duplicates_stored,
        s.records_missing,
        s.records_corrupt,
        s.bytes as f64 / 1e6,
        s.seconds,
        s.throughput_mb_s,
        s.records_per_s,
        s.chunks_acked,
        s.wire_bytes as f64 / 1e6,
        s.latency_p50_ms.map_or("-".into(), |v| v.to_string()),
        s.latency_p99_ms.map_or("-".into(), |v| v.to_string()),
        if s.dir.is_empty() {
            "the temporary directory was removed; pass --dir to keep the data".to_owned()
        } else {
            format!("data kept in {}", s.dir)
        },
    );
}
