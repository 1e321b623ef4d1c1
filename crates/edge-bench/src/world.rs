//! The real daemons as child processes: certificates, config files, start/stop, Prometheus
//! scraping, and the intake producers.
//!
//! Both daemons are the release binaries next to the bench binary (`target/release/`), started
//! with generated config files on loopback. Everything the bench learns about them comes from
//! outside: their `/metrics` endpoints, `/proc/<pid>/{stat,status,io}`, and the HTTP answers
//! the intake gives the producers.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use bytes::Bytes;

use crate::sys;

/// The two daemon binaries.
#[derive(Debug, Clone)]
pub struct Bins {
    pub agent: PathBuf,
    pub ingest: PathBuf,
}

impl Bins {
    /// The release binaries next to this executable; checks they exist and are fresh.
    pub fn locate(allow_stale: bool) -> anyhow::Result<Bins> {
        let exe = std::env::current_exe()?;
        let dir = exe.parent().context("bench binary has no directory")?;
        let bins = Bins { agent: dir.join("edge-uploader"), ingest: dir.join("edge-ingest") };
        // crates/edge-bench/ -> workspace root, as compiled in.
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        // The crates each binary is built from (its own and the workspace crates it links).
        let ingest_crates = ["edge-ingest", "edge-proto", "edge-transport", "edge-telemetry"];
        let agent_crates =
            ["edge-uploader", "edge-ingest", "edge-spool", "edge-transport", "edge-proto", "edge-telemetry"];
        for (bin, crates) in [(&bins.agent, &agent_crates[..]), (&bins.ingest, &ingest_crates[..])] {
            if !bin.is_file() {
                bail!("{} does not exist: run `cargo build --release --workspace` first", bin.display());
            }
            if !allow_stale {
                let srcs: Vec<PathBuf> = crates.iter().map(|c| root.join("crates").join(c).join("src")).collect();
                let srcs: Vec<&Path> = srcs.iter().map(PathBuf::as_path).collect();
                sys::check_fresh(bin, &srcs)?;
            }
        }
        Ok(bins)
    }
}

/// A running daemon; killed when dropped.
#[derive(Debug)]
pub struct Daemon {
    pub child: Child,
    pub name: &'static str,
}

impl Daemon {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Fails if the process has exited.
    pub fn check_alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            bail!("{} exited early: {status}", self.name);
        }
        Ok(())
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Knobs of one world.
#[derive(Debug, Clone)]
pub struct WorldOptions {
    pub spool_max_bytes: u64,
    pub chunk_target: String,
    pub max_in_flight: u32,
    pub max_in_flight_bytes: String,
    pub durability: &'static str,
    /// `spool.linger`: how long an open batch may wait for more records (group commits).
    pub linger: String,
    /// `spool.compression` and `spool.zstd_level`. Off unless a case says otherwise (the agent's
    /// default is zstd): most cases send one request body again and again, which zstd would
    /// shrink far more than real records, and their baselines move the bytes uncompressed.
    pub compression: &'static str,
    pub zstd_level: i32,
    /// Name of a sweep variant; empty for the default configuration.
    pub label: String,
    /// The ingest writes to this JetStream stream instead of its file store.
    pub jetstream: Option<JetStreamTarget>,
    /// `upload.congestion_controller`.
    pub congestion_controller: edge_transport::CongestionController,
    /// The agent's own reconnect backoff (`upload.backoff_min` and `backoff_max` left to their
    /// defaults, 200 ms to 30 s) instead of the bench's 20 to 100 ms, which keeps the cases
    /// that start the ingest after the agent from timing the backoff.
    pub default_backoff: bool,
    /// `upload.probe_interval` (e.g. `"5s"`, `"0s"` for none); `None` leaves the agent's
    /// default and writes no key, so daemons from before the key still run.
    pub probe_interval: Option<String>,
    /// `intake.request_pending_total_bytes` (e.g. `"1GiB"`); `None` leaves the agent's default
    /// and writes no key, so daemons from before the key still run.
    pub request_pending_total: Option<String>,
    /// `intake.max_connections`; `None` leaves the agent's default and writes no key.
    pub max_connections: Option<u32>,
}

/// A JetStream stream for the ingest's JetStream sink (`edge-bench sink`).
#[derive(Debug, Clone)]
pub struct JetStreamTarget {
    /// The NATS server's TCP port on 127.0.0.1.
    pub port: u16,
    /// A stream name of this run's own; the bench deletes the stream afterwards.
    pub stream: String,
    /// The NATS server's pid, when the bench knows it, for its CPU.
    pub server_pid: Option<u32>,
}

impl JetStreamTarget {
    /// A fresh stream name on the server at `port`.
    pub fn fresh(port: u16, server_pid: Option<u32>) -> Self {
        Self { port, stream: format!("EDGEBENCHSINK{:08x}", rand::random::<u32>()), server_pid }
    }
}

impl Default for WorldOptions {
    fn default() -> Self {
        Self {
            spool_max_bytes: 8 << 30,
            chunk_target: "512KiB".into(),
            max_in_flight: 32,
            max_in_flight_bytes: "8MiB".into(),
            durability: "full",
            linger: "20ms".into(),
            compression: "none",
            zstd_level: 3,
            label: String::new(),
            jetstream: None,
            congestion_controller: edge_transport::CongestionController::default(),
            default_backoff: false,
            probe_interval: None,
            request_pending_total: None,
            max_connections: None,
        }
    }
}

/// One agent and one ingest server with their files under `dir`.
#[derive(Debug)]
pub struct World {
    pub dir: PathBuf,
    bins: Bins,
    agent_config: PathBuf,
    ingest_config: PathBuf,
    pub socket: PathBuf,
    pub agent_metrics: u16,
    pub ingest_metrics: u16,
    /// The ingest's QUIC port on 127.0.0.1.
    pub ingest_port: u16,
    /// The agent's TLS files (device certificate and key, the CA that verifies the server).
    pub device: edge_transport::pki::DevicePaths,
    pub agent: Option<Daemon>,
    pub ingest: Option<Daemon>,
    /// A command the agent is run under (e.g. `valgrind --tool=callgrind ...`); empty: none.
    pub agent_wrapper: Vec<String>,
}

impl World {
    pub fn new(bins: &Bins, dir: &Path, opts: &WorldOptions) -> anyhow::Result<World> {
        if dir.exists() {
            std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
        }
        std::fs::create_dir_all(dir)?;
        let pki = edge_transport::pki::InMemoryPki::generate(&["localhost", "127.0.0.1"])?;
        let server = pki.write_server_files(&dir.join("pki/server"))?;
        let device = pki.write_device_files("bench-gateway", &dir.join("pki/device"))?;
        let port = sys::free_udp_port()?;
        let agent_metrics = sys::free_tcp_port()?;
        let ingest_metrics = sys::free_tcp_port()?;
        let socket = dir.join("agent/intake.sock");
        std::fs::create_dir_all(dir.join("agent"))?;
        std::fs::create_dir_all(dir.join("ingest"))?;
        let q = |p: &Path| format!("{:?}", p.display().to_string());
        let ingest_toml = format!(
            "[server]\nlisten = \"127.0.0.1:{port}\"\n\n[tls]\ncert = {}\nkey = {}\nclient_ca = {}\n\n\
             [store]\ndata_dir = {}\n\n[metrics]\nlisten = \"127.0.0.1:{ingest_metrics}\"\n\n[log]\nlevel = \"warn\"\n",
            q(&server.cert),
            q(&server.key),
            q(&server.client_ca),
            q(&dir.join("ingest/data")),
        );
        let ingest_toml = match &opts.jetstream {
            None => ingest_toml,
            Some(js) => format!(
                "{ingest_toml}\n[sink]\nkind = \"jetstream\"\n\n[sink.jetstream]\nservers = [\"nats://127.0.0.1:{}\"]\n\
                 stream = \"{}\"\nsubject_prefix = \"{}\"\n",
                js.port,
                js.stream,
                js.stream.to_lowercase(),
            ),
        };
        let mut backoff = if opts.default_backoff {
            String::new()
        } else {
            "backoff_min = \"20ms\"\nbackoff_max = \"100ms\"\n".into()
        };
        if let Some(p) = &opts.probe_interval {
            backoff.push_str(&format!("probe_interval = \"{p}\"\n"));
        }
        let mut intake_extra = opts
            .request_pending_total
            .as_ref()
            .map_or(String::new(), |b| format!("request_pending_total_bytes = \"{b}\"\n"));
        if let Some(n) = opts.max_connections {
            intake_extra.push_str(&format!("max_connections = {n}\n"));
        }
        let agent_toml = format!(
            "[intake]\nsocket = {}\n{intake_extra}\n[spool]\npath = {}\nmax_bytes = {}\ndurability = \"{}\"\nchunk_target = \"{}\"\n\
             linger = \"{}\"\ncompression = \"{}\"\nzstd_level = {}\n\n\
             [upload]\nserver = \"127.0.0.1:{port}\"\nserver_name = \"localhost\"\nca = {}\ncert = {}\nkey = {}\n\
             max_in_flight = {}\nmax_in_flight_bytes = \"{}\"\n{backoff}{}\n\
             [metrics]\nlisten = \"127.0.0.1:{agent_metrics}\"\n\n[log]\nlevel = \"warn\"\n",
            q(&socket),
            q(&dir.join("agent/spool.db")),
            opts.spool_max_bytes,
            opts.durability,
            opts.chunk_target,
            opts.linger,
            opts.compression,
            opts.zstd_level,
            q(&device.ca_cert),
            q(&device.cert),
            q(&device.key),
            opts.max_in_flight,
            opts.max_in_flight_bytes,
            // Written only when it is not the default, so the bench still drives daemons
            // built before the key existed (A/B runs against an older commit).
            match opts.congestion_controller {
                edge_transport::CongestionController::Cubic => String::new(),
                c => format!("congestion_controller = \"{}\"\n", c.name()),
            },
        );
        let agent_config = dir.join("agent.toml");
        let ingest_config = dir.join("ingest.toml");
        std::fs::write(&agent_config, agent_toml)?;
        std::fs::write(&ingest_config, ingest_toml)?;
        Ok(World {
            dir: dir.to_path_buf(),
            bins: bins.clone(),
            agent_config,
            ingest_config,
            socket,
            agent_metrics,
            ingest_metrics,
            ingest_port: port,
            device,
            agent: None,
            ingest: None,
            agent_wrapper: Vec::new(),
        })
    }

    /// Points the agent (before it starts) at `addr` instead of the ingest, e.g. a proxy in
    /// front of it.
    pub fn route_agent_via(&self, addr: std::net::SocketAddr) -> anyhow::Result<()> {
        let toml = std::fs::read_to_string(&self.agent_config)?;
        let direct = format!("server = \"127.0.0.1:{}\"", self.ingest_port);
        anyhow::ensure!(toml.contains(&direct), "the agent's configuration has no line {direct}");
        std::fs::write(&self.agent_config, toml.replace(&direct, &format!("server = \"{addr}\"")))?;
        Ok(())
    }

    fn spawn(&self, bin: &Path, config: &Path, name: &'static str) -> anyhow::Result<Daemon> {
        let log = std::fs::File::create(self.dir.join(format!("{name}.log")))?;
        let mut cmd = match (name, self.agent_wrapper.split_first()) {
            ("edge-uploader", Some((first, rest))) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            _ => Command::new(bin),
        };
        let child = cmd
            .arg("run")
            .arg("--config")
            .arg(config)
            .env_remove("NOTIFY_SOCKET")
            .env_remove("RUST_LOG")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        Ok(Daemon { child, name })
    }

    /// Starts the ingest server and waits until its metrics endpoint answers.
    pub fn start_ingest(&mut self) -> anyhow::Result<()> {
        let mut d = self.spawn(&self.bins.ingest, &self.ingest_config, "edge-ingest")?;
        wait_until(Duration::from_secs(30), || {
            d.check_alive()?;
            Ok(scrape(self.ingest_metrics).is_ok())
        })
        .with_context(|| format!("edge-ingest did not come up; see {}/edge-ingest.log", self.dir.display()))?;
        self.ingest = Some(d);
        Ok(())
    }

    /// Starts the agent and waits until its metrics endpoint and intake socket answer.
    pub fn start_agent(&mut self) -> anyhow::Result<()> {
        let mut d = self.spawn(&self.bins.agent, &self.agent_config, "edge-uploader")?;
        let socket = self.socket.clone();
        wait_until(Duration::from_secs(60), || {
            d.check_alive()?;
            Ok(scrape(self.agent_metrics).is_ok() && std::os::unix::net::UnixStream::connect(&socket).is_ok())
        })
        .with_context(|| format!("edge-uploader did not come up; see {}/edge-uploader.log", self.dir.display()))?;
        self.agent = Some(d);
        Ok(())
    }

    pub fn agent_pid(&self) -> anyhow::Result<u32> {
        Ok(self.agent.as_ref().context("agent not running")?.pid())
    }

    pub fn ingest_pid(&self) -> anyhow::Result<u32> {
        Ok(self.ingest.as_ref().context("ingest not running")?.pid())
    }

    /// Agent metrics now.
    pub fn agent_scrape(&self) -> anyhow::Result<Metrics> {
        scrape(self.agent_metrics)
    }

    /// Ingest metrics now.
    pub fn ingest_scrape(&self) -> anyhow::Result<Metrics> {
        scrape(self.ingest_metrics)
    }

    /// Waits until the agent's spool is empty and the ingest has stored at least `records`
    /// records (not payload bytes, which zstd makes fewer); returns the instant it saw that,
    /// within about 3 ms.
    ///
    /// Each scrape costs the scraped daemon CPU that the case measures (it formats every metric
    /// family): at one every 5 ms they were 3.8 % of the ingest's samples in a 1 GiB drain.
    /// So the ingest is asked again after a third of the time the rest should take at the rate
    /// seen so far (2 to 100 ms): a few dozen scrapes per case, and still one every 2 ms at
    /// the end.
    pub fn wait_drained(&mut self, records: u64, timeout: Duration) -> anyhow::Result<Instant> {
        let started = Instant::now();
        let deadline = started + timeout;
        // (ingest records, when they last moved): a stall is reported after 20 s without progress.
        let mut last_progress = (-1.0f64, Instant::now());
        // The ingest's count when the wait began, for the rate.
        let mut first: Option<f64> = None;
        loop {
            // The agent's metrics are scraped only once the ingest has everything (or for an
            // error message): every scrape costs the measured agent CPU (it reads /proc and
            // formats every family), and a real Prometheus scrapes every 15 s, not every 5 ms.
            // Records, not payload bytes: with zstd on, the payload the ingest counts is compressed.
            let stored = self.ingest_scrape()?.sum("edge_ingest_records_total");
            let stalled = stored == last_progress.0 && last_progress.1.elapsed() > Duration::from_secs(20);
            let late = Instant::now() > deadline;
            if stored != last_progress.0 {
                last_progress = (stored, Instant::now());
            }
            if stored >= records as f64 || stalled || late {
                let a = self.agent_scrape()?;
                let (spool_bytes, spool_chunks) =
                    (a.sum("edge_uploader_spool_bytes"), a.sum("edge_uploader_spool_chunks"));
                if spool_bytes == 0.0 && spool_chunks == 0.0 && stored >= records as f64 {
                    return Ok(Instant::now());
                }
                if stalled {
                    bail!(
                        "upload stalled: no progress for 20 s with {spool_chunks} sealed chunks ({spool_bytes} bytes) \
                         in the spool, {} chunks in flight, connected = {}; ingest stored {stored} of {records} \
                         records",
                        a.sum("edge_uploader_chunks_in_flight"),
                        a.sum("edge_uploader_connected"),
                    );
                }
                if late {
                    bail!(
                        "not drained after {timeout:?}: spool {spool_bytes} bytes, {spool_chunks} chunks; ingest \
                         stored {stored} of {records} records"
                    );
                }
            }
            if let Some(d) = self.agent.as_mut() {
                d.check_alive()?;
            }
            if let Some(d) = self.ingest.as_mut() {
                d.check_alive()?;
            }
            let from = *first.get_or_insert(stored);
            std::thread::sleep(next_poll(stored - from, started.elapsed(), records as f64 - stored));
        }
    }

    /// Stops the agent with SIGTERM (so a profiler wrapping it writes its output) and waits.
    pub fn stop_agent_politely(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let Some(mut d) = self.agent.take() else { return Ok(()) };
        Command::new("kill").arg("-TERM").arg(d.pid().to_string()).status()?;
        let deadline = Instant::now() + timeout;
        while d.child.try_wait()?.is_none() {
            if Instant::now() > deadline {
                bail!("the agent did not exit within {timeout:?} of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// Removes the world's files (spool, store).
    pub fn cleanup(mut self) {
        self.agent = None;
        self.ingest = None;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn wait_until(timeout: Duration, mut f: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    loop {
        if f()? {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A Prometheus text exposition, as `(series, value)` pairs.
#[derive(Debug, Default)]
pub struct Metrics {
    series: Vec<(String, f64)>,
}

impl Metrics {
    /// Sum over every series of metric `name` (any labels).
    pub fn sum(&self, name: &str) -> f64 {
        self.series
            .iter()
            .filter(|(s, _)| s == name || s.strip_prefix(name).is_some_and(|r| r.starts_with('{')))
            .map(|(_, v)| v)
            .sum()
    }

    /// Cumulative buckets `(le, count)` of histogram `name`, sorted by `le`.
    pub fn buckets(&self, name: &str) -> Vec<(f64, f64)> {
        let prefix = format!("{name}_bucket{{");
        let mut out: Vec<(f64, f64)> = self
            .series
            .iter()
            .filter_map(|(s, v)| {
                let labels = s.strip_prefix(&prefix)?;
                let le = labels.split("le=\"").nth(1)?.split('"').next()?;
                let le = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((le, *v))
            })
            .collect();
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        out
    }
}

/// Quantile `q` of the histogram that is `after - before` (cumulative buckets), by linear
/// interpolation inside the bucket, as Prometheus' `histogram_quantile` does. `None` without
/// observations.
pub fn quantile(before: &[(f64, f64)], after: &[(f64, f64)], q: f64) -> Option<f64> {
    let delta: Vec<(f64, f64)> =
        after.iter().map(|(le, c)| (*le, c - before.iter().find(|(l, _)| l == le).map_or(0.0, |(_, b)| *b))).collect();
    let total = delta.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for (le, c) in &delta {
        if *c >= rank {
            if le.is_infinite() {
                return Some(prev.0);
            }
            let width = c - prev.1;
            let frac = if width > 0.0 { (rank - prev.1) / width } else { 1.0 };
            return Some(prev.0 + (le - prev.0) * frac);
        }
        prev = (*le, *c);
    }
    None
}

/// `GET /metrics` from a daemon on 127.0.0.1.
pub fn scrape(port: u16) -> anyhow::Result<Metrics> {
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b).context("no HTTP body")?;
    if !text.starts_with("HTTP/1.1 200") {
        bail!("metrics answered {}", text.lines().next().unwrap_or_default());
    }
    let series = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (name, value) = l.rsplit_once(' ')?;
            Some((name.to_owned(), value.parse().ok()?))
        })
        .collect();
    Ok(Metrics { series })
}

/// How producers load the intake.
#[derive(Debug, Clone)]
pub struct Load {
    /// Concurrent producer connections (each one request in flight).
    pub producers: usize,
    /// Distinct streams the producers write to (producer `k` writes stream `k % streams`).
    pub streams: usize,
    /// Bytes per record.
    pub record: usize,
    /// Records per request: 1 posts `application/octet-stream`, more post NDJSON.
    pub per_request: usize,
    /// Stop after this long...
    pub duration: Option<Duration>,
    /// ...or once this many record bytes were accepted.
    pub bytes: Option<u64>,
    /// Total offered rate in record bytes per second (paced per producer); `None` = flat out.
    pub rate: Option<f64>,
    /// `Some(w)`: the producers use the record-stream intake instead of HTTP, one record per
    /// frame, at most `w` records sent and not yet acknowledged per producer (`per_request` and
    /// `rate` are then unused).
    pub window: Option<usize>,
    /// HTTP producers: each request's records are the next ones of a pool of at least 4 MiB
    /// of distinct records ([`Bodies`]) instead of one body sent again and again, so a chunk
    /// never holds the same record twice and zstd shrinks it only as far as such bytes go
    /// (printable random bytes: to about 0.82, by entropy alone).
    pub distinct: bool,
    /// HTTP producers send their bodies chunked (`Transfer-Encoding: chunked`, one chunk per
    /// body), as clients that stream a body of unknown length do, instead of with a
    /// `Content-Length`.
    pub chunked: bool,
}

/// What the producers got acknowledged.
#[derive(Debug, Clone, Copy, Default)]
pub struct Produced {
    pub records: u64,
    pub bytes: u64,
    pub seconds: f64,
    pub refused: u64,
}

/// How long [`World::wait_drained`] waits before it asks again: a third of the time `left`
/// records take at the rate `done` records in `elapsed` show, between 2 and 100 ms (5 ms before any
/// progress, 2 ms once nothing is left to store but the agent's spool is not empty yet).
fn next_poll(done: f64, elapsed: Duration, left: f64) -> Duration {
    const MIN: Duration = Duration::from_millis(2);
    const MAX: Duration = Duration::from_millis(100);
    if left <= 0.0 {
        return MIN;
    }
    if done <= 0.0 || elapsed.is_zero() {
        return Duration::from_millis(5);
    }
    let rest = left / (done / elapsed.as_secs_f64());
    Duration::try_from_secs_f64(rest / 3.0).unwrap_or(MAX).clamp(MIN, MAX)
}

/// Runs the producers until the load's end; every count is of records answered 200, which
/// the agent sends only after the durable commit.
pub async fn produce(socket: &Path, load: &Load) -> anyhow::Result<Produced> {
    if let Some(window) = load.window {
        return produce_stream(&socket.with_file_name("records.sock"), load, window).await;
    }
    let records = Arc::new(AtomicU64::new(0));
    let bytes = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let bodies = Bodies::new(load);
    let start = Instant::now();
    let ctype = if load.per_request == 1 { "application/octet-stream" } else { "application/x-ndjson" };
    let req_bytes = (load.record * load.per_request) as u64;
    let mut set = tokio::task::JoinSet::new();
    for k in 0..load.producers {
        let socket = socket.to_path_buf();
        let (records, bytes, refused, stop) = (records.clone(), bytes.clone(), refused.clone(), stop.clone());
        let mut bodies = bodies.clone();
        bodies.start_at(k, load.producers);
        let load = load.clone();
        let stream = format!("bench-{}", k % load.streams.max(1));
        set.spawn(async move {
            let mut client = IntakeConn::new(&socket, load.chunked);
            let interval = load.rate.map(|r| Duration::from_secs_f64(req_bytes as f64 * load.producers as f64 / r));
            // Stagger paced producers over one interval so requests do not arrive in waves.
            let mut next =
                Instant::now() + interval.map_or(Duration::ZERO, |i| i.mul_f64(k as f64 / load.producers as f64));
            loop {
                if stop.load(Ordering::Relaxed) || load.duration.is_some_and(|d| start.elapsed() >= d) {
                    break;
                }
                if let Some(i) = interval {
                    tokio::time::sleep_until(next.into()).await;
                    next += i;
                }
                let body = bodies.next();
                let (status, answer) = client.post(&stream, ctype, &body).await?;
                match status {
                    200 => {
                        bodies.advance();
                        records.fetch_add(load.per_request as u64, Ordering::Relaxed);
                        let total = bytes.fetch_add(req_bytes, Ordering::Relaxed) + req_bytes;
                        if load.bytes.is_some_and(|b| total >= b) {
                            stop.store(true, Ordering::Relaxed);
                        }
                    }
                    503 | 507 => {
                        refused.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                    s => bail!("intake answered {s}: {}", String::from_utf8_lossy(&answer)),
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(Produced {
        records: records.load(Ordering::Relaxed),
        bytes: bytes.load(Ordering::Relaxed),
        seconds: start.elapsed().as_secs_f64(),
        refused: refused.load(Ordering::Relaxed),
    })
}

/// Records made anew for every request, unlike [`produce`]'s bodies, which are sent again and
/// again (so a chunk of them compresses far better than real records would).
#[derive(Debug, Clone, Copy)]
pub enum Fresh {
    /// `per_request` sensor readings as one NDJSON request: they compress about as real
    /// telemetry does.
    Readings { per_request: usize },
    /// One record of `len` random bytes per request (`application/octet-stream`): data that
    /// does not compress, like images or files compressed already.
    Random { len: usize },
}

impl Fresh {
    /// The next request body and the records it holds.
    fn next_body(&self, readings: &mut Readings) -> (Bytes, &'static str, usize) {
        match *self {
            Fresh::Readings { per_request } => {
                let mut body = Vec::with_capacity(per_request * 140);
                for _ in 0..per_request {
                    readings.next_into(&mut body);
                }
                (Bytes::from(body), "application/x-ndjson", per_request)
            }
            Fresh::Random { len } => {
                use rand::RngCore;
                let mut body = vec![0u8; len];
                readings.rng.fill_bytes(&mut body);
                (Bytes::from(body), "application/octet-stream", 1)
            }
        }
    }

    /// Record bytes in a body of `records` records: NDJSON's newlines are not record bytes.
    fn record_bytes(&self, body: usize, records: usize) -> usize {
        match self {
            Fresh::Readings { .. } => body - records,
            Fresh::Random { .. } => body,
        }
    }
}

/// Producers of [`Fresh`] records, one request after another (producer `k` on stream
/// `sensors-{k % 4}`) until `bytes` record bytes are accepted.
pub async fn produce_fresh(socket: &Path, producers: usize, fresh: Fresh, bytes: u64) -> anyhow::Result<Produced> {
    let start = Instant::now();
    let accepted = Arc::new(AtomicU64::new(0));
    let mut set = tokio::task::JoinSet::new();
    for k in 0..producers {
        let socket = socket.to_path_buf();
        let accepted = accepted.clone();
        set.spawn(async move {
            let mut client = IntakeConn::new(&socket, false);
            let mut device = Readings::new(k);
            let (mut records, mut refused) = (0u64, 0u64);
            let stream = format!("sensors-{}", k % 4);
            while accepted.load(Ordering::Relaxed) < bytes {
                let (body, ctype, n) = fresh.next_body(&mut device);
                refused += client.post_until_accepted(&stream, ctype, &body).await?;
                records += n as u64;
                accepted.fetch_add(fresh.record_bytes(body.len(), n) as u64, Ordering::Relaxed);
            }
            anyhow::Ok((records, refused))
        });
    }
    let (mut records, mut refused) = (0, 0);
    while let Some(r) = set.join_next().await {
        let (n, r) = r??;
        records += n;
        refused += r;
    }
    Ok(Produced { records, bytes: accepted.load(Ordering::Relaxed), seconds: start.elapsed().as_secs_f64(), refused })
}

/// Devices that send at a sensor's pace instead of flat out: `devices` producers (producer `k`
/// on stream `sensors-{k % 4}`), each posting `per_request` fresh readings every `every` until
/// `duration` has passed. A request the intake refuses is sent again after 5 ms.
pub async fn produce_paced(
    socket: &Path,
    devices: usize,
    per_request: usize,
    every: Duration,
    duration: Duration,
) -> anyhow::Result<Produced> {
    let start = Instant::now();
    let end = tokio::time::Instant::now() + duration;
    let fresh = Fresh::Readings { per_request };
    let mut set = tokio::task::JoinSet::new();
    for k in 0..devices {
        let socket = socket.to_path_buf();
        set.spawn(async move {
            let mut client = IntakeConn::new(&socket, false);
            let mut device = Readings::new(k);
            let stream = format!("sensors-{}", k % 4);
            let (mut records, mut bytes, mut refused) = (0u64, 0u64, 0u64);
            // Staggered over one interval, so the devices' requests do not arrive in waves.
            let first = tokio::time::Instant::now() + every.mul_f64(k as f64 / devices as f64);
            let mut tick = tokio::time::interval_at(first, every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            while tick.tick().await < end {
                let (body, ctype, n) = fresh.next_body(&mut device);
                refused += client.post_until_accepted(&stream, ctype, &body).await?;
                records += n as u64;
                bytes += fresh.record_bytes(body.len(), n) as u64;
            }
            anyhow::Ok((records, bytes, refused))
        });
    }
    let mut got = Produced::default();
    while let Some(r) = set.join_next().await {
        let (records, bytes, refused) = r??;
        got.records += records;
        got.bytes += bytes;
        got.refused += refused;
    }
    got.seconds = start.elapsed().as_secs_f64();
    Ok(got)
}

/// One gateway's readings: 16 sensors of four kinds, each a random walk, read in turn every
/// 250 ms; one JSON object per reading, about 130 bytes.
struct Readings {
    device: String,
    values: [f64; 16],
    seq: u64,
    rng: rand::rngs::StdRng,
}

impl Readings {
    const KINDS: [(&'static str, &'static str, f64, f64); 4] = [
        ("temperature", "C", 21.0, 0.05),
        ("humidity", "%", 45.0, 0.2),
        ("pressure", "hPa", 1013.0, 0.1),
        ("supply", "V", 24.0, 0.01),
    ];

    fn new(k: usize) -> Self {
        use rand::SeedableRng;
        let values = std::array::from_fn(|i| Self::KINDS[i % 4].2);
        Self { device: format!("gw-{k:04}"), values, seq: 0, rng: rand::rngs::StdRng::seed_from_u64(k as u64) }
    }

    fn next_into(&mut self, out: &mut Vec<u8>) {
        use rand::Rng;
        use std::io::Write as _;
        let i = (self.seq % 16) as usize;
        let (kind, unit, _, step) = Self::KINDS[i % 4];
        self.values[i] += self.rng.random_range(-1.0..=1.0) * step * 10.0;
        let ts = 1_795_000_000_000 + self.seq * 250 + self.rng.random_range(0..20);
        // Writing into a Vec cannot fail.
        let _ = writeln!(
            out,
            r#"{{"ts":{ts},"device":"{}","sensor":"{kind}-{i:02}","value":{:.2},"unit":"{unit}","seq":{}}}"#,
            self.device, self.values[i], self.seq
        );
        self.seq += 1;
    }
}

/// The record-stream producers: each connection sends its stream's records back to back,
/// never more than `window` unacknowledged, and counts what the cumulative acks confirm.
async fn produce_stream(path: &Path, load: &Load, window: usize) -> anyhow::Result<Produced> {
    use edge_proto::intake::{self as wire, Reply};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let acked_records = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let start = Instant::now();
    let record = request_body(load.record, 1);
    let mut set = tokio::task::JoinSet::new();
    for k in 0..load.producers {
        let io =
            tokio::net::UnixStream::connect(path).await.with_context(|| format!("connecting to {}", path.display()))?;
        let (mut rd, mut wr) = io.into_split();
        let (acked_records, stop, record, load) = (acked_records.clone(), stop.clone(), record.clone(), load.clone());
        let total = acked_records.clone();
        let stream = edge_proto::StreamName::new(&format!("bench-{}", k % load.streams.max(1)))?;
        // The reader publishes the connection's committed count; the writer waits on it.
        let (ack_tx, mut ack_rx) = tokio::sync::watch::channel(0u64);
        let reader = tokio::spawn(async move {
            let mut buf = Vec::with_capacity(4096);
            let mut last = 0u64;
            loop {
                while let Some((reply, used)) = wire::parse_reply(&buf)? {
                    buf.drain(..used);
                    match reply {
                        Reply::Ack { committed } => {
                            acked_records.fetch_add(committed - last, Ordering::Relaxed);
                            last = committed;
                            let _ = ack_tx.send(committed);
                        }
                        Reply::Error { committed, status, detail } => {
                            bail!("record-stream intake refused after {committed} records: {status} {detail}")
                        }
                    }
                }
                if rd.read_buf(&mut buf).await? == 0 {
                    return anyhow::Ok(last);
                }
            }
        });
        set.spawn(async move {
            let mut out = Vec::with_capacity(256 << 10);
            out.extend_from_slice(&wire::MAGIC);
            wire::put_stream(&mut out, &stream);
            let mut sent = 0u64;
            loop {
                if stop.load(Ordering::Relaxed) || load.duration.is_some_and(|d| start.elapsed() >= d) {
                    break;
                }
                let acked = *ack_rx.borrow_and_update();
                let room = (window as u64).saturating_sub(sent - acked);
                if room == 0 {
                    if ack_rx.changed().await.is_err() {
                        break;
                    }
                    continue;
                }
                // Up to 256 KiB per write, as a client with a write buffer would send.
                let n = room.min(((256 << 10) / (load.record + wire::FRAME_HEADER)).max(1) as u64);
                for _ in 0..n {
                    wire::put_record(&mut out, &record);
                }
                wr.write_all(&out).await?;
                out.clear();
                sent += n;
                if load.bytes.is_some_and(|b| total.load(Ordering::Relaxed) * load.record as u64 >= b) {
                    stop.store(true, Ordering::Relaxed);
                }
            }
            wr.shutdown().await?;
            let committed = reader.await??;
            anyhow::ensure!(committed == sent, "the agent acknowledged {committed} of {sent} records");
            anyhow::Ok(())
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    let records = acked_records.load(Ordering::Relaxed);
    Ok(Produced { records, bytes: records * load.record as u64, seconds: start.elapsed().as_secs_f64(), refused: 0 })
}

/// A minimal HTTP/1.1 keep-alive client for the intake socket: one request at a time,
/// `Content-Length` framing both ways (the intake answers with small JSON bodies). Written
/// here so the bench does not link the agent's code, and so its own cost stays visible and
/// small: one `write` of headers and body, one buffered read of the answer.
struct IntakeConn {
    path: PathBuf,
    conn: Option<tokio::io::BufReader<tokio::net::UnixStream>>,
    head: Vec<u8>,
    /// Bodies go as one chunk of a chunked body instead of with a `Content-Length`.
    chunked: bool,
}

impl IntakeConn {
    fn new(path: &Path, chunked: bool) -> Self {
        Self { path: path.to_path_buf(), conn: None, head: Vec::with_capacity(256), chunked }
    }

    /// Posts `body` until the intake accepts it, 5 ms after each refusal (503 full, 507 disk
    /// full); returns the refusals. Any other answer is an error.
    async fn post_until_accepted(&mut self, stream: &str, ctype: &str, body: &Bytes) -> anyhow::Result<u64> {
        let mut refused = 0;
        loop {
            let (status, answer) = self.post(stream, ctype, body).await?;
            match status {
                200 => return Ok(refused),
                503 | 507 => {
                    refused += 1;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                s => bail!("intake answered {s}: {}", String::from_utf8_lossy(&answer)),
            }
        }
    }

    async fn post(&mut self, stream: &str, ctype: &str, body: &Bytes) -> anyhow::Result<(u16, Vec<u8>)> {
        use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
        if self.conn.is_none() {
            let s = tokio::net::UnixStream::connect(&self.path)
                .await
                .with_context(|| format!("connecting to {}", self.path.display()))?;
            self.conn = Some(tokio::io::BufReader::with_capacity(16 * 1024, s));
        }
        let conn = self.conn.as_mut().context("intake connection")?;
        self.head.clear();
        write!(self.head, "POST /v1/streams/{stream} HTTP/1.1\r\nHost: localhost\r\nContent-Type: {ctype}\r\n")?;
        if self.chunked {
            write!(self.head, "Transfer-Encoding: chunked\r\n\r\n{:x}\r\n", body.len())?;
        } else {
            write!(self.head, "Content-Length: {}\r\n\r\n", body.len())?;
        }
        let chunked = self.chunked;
        let result: anyhow::Result<(u16, Vec<u8>, bool)> = async {
            conn.get_mut().write_all(&self.head).await?;
            conn.get_mut().write_all(body).await?;
            if chunked {
                conn.get_mut().write_all(b"\r\n0\r\n\r\n").await?;
            }
            let mut line = String::new();
            conn.read_line(&mut line).await?;
            let status: u16 = line.split_whitespace().nth(1).context("no HTTP status line")?.parse()?;
            let mut len = 0usize;
            let mut close = false;
            loop {
                line.clear();
                if conn.read_line(&mut line).await? == 0 {
                    bail!("intake closed the connection");
                }
                let l = line.trim_end();
                if l.is_empty() {
                    break;
                }
                if let Some((k, v)) = l.split_once(':') {
                    if k.eq_ignore_ascii_case("content-length") {
                        len = v.trim().parse()?;
                    } else if k.eq_ignore_ascii_case("connection") && v.trim().eq_ignore_ascii_case("close") {
                        close = true;
                    } else if k.eq_ignore_ascii_case("transfer-encoding") {
                        bail!("chunked answers are not supported by the bench client");
                    }
                }
            }
            let mut answer = vec![0u8; len];
            conn.read_exact(&mut answer).await?;
            Ok((status, answer, close))
        }
        .await;
        match result {
            Ok((status, answer, close)) => {
                if close {
                    self.conn = None;
                }
                Ok((status, answer))
            }
            Err(e) => {
                self.conn = None;
                Err(e)
            }
        }
    }
}

/// The request bodies of one HTTP producer: one body again and again, or ([`Load::distinct`])
/// successive slices of a shared pool of records, each producer starting at its own place.
#[derive(Debug, Clone)]
struct Bodies {
    /// `per_request` records as one body, or the pool (records newline-separated).
    pool: Bytes,
    record: usize,
    per_request: usize,
    /// Records in the pool (1 body's worth when not distinct).
    records: usize,
    /// Index of the next request's first record.
    at: usize,
}

impl Bodies {
    const POOL_BYTES: usize = 4 << 20;

    fn new(load: &Load) -> Self {
        let per_request = load.per_request.max(1);
        let records =
            if load.distinct { (Self::POOL_BYTES / (load.record + 1)).max(4 * per_request) } else { per_request };
        // A pool holds at least four records, so they are newline-separated and NDJSON bodies
        // cut from it keep their newlines.
        let pool = request_body(load.record, records);
        Bodies { pool, record: load.record, per_request, records, at: 0 }
    }

    /// Producer `k` of `n` starts its own share of the way into the pool.
    fn start_at(&mut self, k: usize, n: usize) {
        if self.records > self.per_request {
            self.at = (self.records - self.per_request) * k / n.max(1);
        }
    }

    /// The body of the next request (the same again until [`Bodies::advance`]).
    fn next(&self) -> Bytes {
        if self.records == self.per_request {
            return self.pool.clone();
        }
        let stride = self.record + 1;
        let from = self.at * stride;
        // One record: its bytes without the newline (octet-stream); several: each line's.
        let to = if self.per_request == 1 { from + self.record } else { from + self.per_request * stride };
        self.pool.slice(from..to)
    }

    /// Moves on to the next records, wrapping at the end of the pool.
    fn advance(&mut self) {
        if self.records > self.per_request {
            self.at += self.per_request;
            if self.at + self.per_request > self.records {
                self.at = 0;
            }
        }
    }
}

/// A request body of `n` records of `len` bytes: printable, pseudo-random, newline-separated
/// when `n > 1`. The producers of a case send one such body again and again, so with zstd on
/// a chunk of them compresses far better than real records would (`sweep`'s zstd rows).
fn request_body(len: usize, n: usize) -> Bytes {
    use rand::Rng;
    let mut rng = rand::rng();
    let mut v = Vec::with_capacity((len + 1) * n);
    for _ in 0..n {
        for _ in 0..len {
            v.push(rng.random_range(b'!'..=b'~'));
        }
        if n > 1 {
            v.push(b'\n');
        }
    }
    Bytes::from(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantile_interpolates_inside_the_bucket() {
        let before = vec![(0.001, 0.0), (0.01, 0.0), (f64::INFINITY, 0.0)];
        let after = vec![(0.001, 50.0), (0.01, 100.0), (f64::INFINITY, 100.0)];
        let p50 = quantile(&before, &after, 0.5).expect("observations");
        assert!((p50 - 0.001).abs() < 1e-12);
        let p99 = quantile(&before, &after, 0.99).expect("observations");
        assert!(p99 > 0.009 && p99 <= 0.01, "{p99}");
        assert!(quantile(&after, &after, 0.5).is_none());
    }

    #[test]
    fn distinct_bodies_never_repeat_within_a_chunk_and_keep_their_framing() {
        let load = |record, per_request| Load {
            producers: 4,
            streams: 1,
            record,
            per_request,
            duration: None,
            bytes: None,
            rate: None,
            window: None,
            distinct: true,
            chunked: false,
        };
        for (record, per_request) in [(10 * 1024, 1), (100, 10), (100 * 1024, 1)] {
            let mut b = Bodies::new(&load(record, per_request));
            b.start_at(1, 4);
            let mut seen = std::collections::HashSet::new();
            // Well over a 512 KiB chunk's worth of requests.
            for _ in 0..(1 << 20) / (record * per_request) {
                let body = b.next();
                if per_request == 1 {
                    assert_eq!(body.len(), record);
                    assert!(!body.contains(&b'\n'));
                } else {
                    assert_eq!(body.len(), per_request * (record + 1));
                    assert_eq!(body.iter().filter(|&&c| c == b'\n').count(), per_request);
                }
                assert!(seen.insert(body), "a body repeated within 1 MiB");
                b.advance();
            }
        }
        // Not distinct: the one body, always.
        let mut same = Bodies::new(&Load { distinct: false, ..load(10, 3) });
        let first = same.next();
        same.advance();
        assert_eq!(same.next(), first);
    }

    #[test]
    fn metrics_sum_over_labels() {
        let m = Metrics {
            series: vec![
                ("a_total{result=\"stored\"}".into(), 2.0),
                ("a_total{result=\"dup\"}".into(), 3.0),
                ("a_total_other".into(), 7.0),
            ],
        };
        assert_eq!(m.sum("a_total"), 5.0);
    }

    #[test]
    fn polls_slow_down_far_from_the_end_and_speed_up_near_it() {
        let ms = Duration::from_millis;
        // 100 MB in 1 s, 900 MB to go: 9 s left, capped at 100 ms.
        assert_eq!(next_poll(100e6, ms(1000), 900e6), ms(100));
        // 30 MB to go at 100 MB/s: 300 ms left, a third of it.
        assert_eq!(next_poll(100e6, ms(1000), 30e6), ms(100));
        assert_eq!(next_poll(100e6, ms(1000), 15e6), ms(50));
        // Near the end, and once everything is stored: the floor.
        assert_eq!(next_poll(100e6, ms(1000), 0.1e6), ms(2));
        assert_eq!(next_poll(100e6, ms(1000), 0.0), ms(2));
        // No progress yet: no rate to go by.
        assert_eq!(next_poll(0.0, ms(1000), 1e9), ms(5));
        assert_eq!(next_poll(1e6, Duration::ZERO, 1e9), ms(5));
    }

    #[test]
    fn readings_are_json_lines_that_differ_and_compress_like_telemetry() {
        let mut r = Readings::new(3);
        let mut body = Vec::new();
        for _ in 0..1000 {
            r.next_into(&mut body);
        }
        let lines: Vec<&[u8]> = body.split(|b| *b == b'\n').filter(|l| !l.is_empty()).collect();
        assert_eq!(lines.len(), 1000);
        for l in &lines {
            let v: serde_json::Value = serde_json::from_slice(l).expect("each line is JSON");
            assert_eq!(v["device"], "gw-0003");
        }
        assert_ne!(lines[0], lines[16], "the same sensor's next reading differs");
        let ratio = body.len() as f64 / zstd::bulk::compress(&body, 3).expect("zstd").len() as f64;
        eprintln!("zstd level 3 ratio of 1000 readings: {ratio:.2}");
        assert!((2.0..20.0).contains(&ratio), "zstd ratio {ratio}");
    }

    #[test]
    fn request_bodies_are_framed_as_asked() {
        let b = request_body(10, 3);
        assert_eq!(b.len(), 33);
        assert_eq!(b.iter().filter(|c| **c == b'\n').count(), 3);
        assert_eq!(request_body(10, 1).len(), 10);
    }
}
