//! Shared set-up for the system tests: a working directory with certificates and config files,
//! and helpers to start the two daemons.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
pub use edge_testkit::free_tcp_port;
use edge_testkit::{Daemon, PkiFixture, bin, free_udp_port};

/// How long a daemon may take to report READY.
pub const READY_TIMEOUT: Duration = Duration::from_secs(30);

/// One test's world: directory, certificates, configs.
pub struct World {
    pub dir: tempfile::TempDir,
    pub agent_config: PathBuf,
    pub ingest_config: PathBuf,
    /// The agent's `/metrics` address (a free loopback port, so tests can run side by side).
    pub agent_metrics: SocketAddr,
    /// The ingest server's `/metrics` address.
    pub ingest_metrics: SocketAddr,
    /// The certificate files the two configs name.
    pub pki: PkiFixture,
}

impl World {
    /// Certificates for `device`, an ingest config and an agent config pointing at it.
    /// `agent_extra` lands inside the agent's `[upload]` section and may open later sections
    /// (except `[metrics]`, which is written here).
    pub fn new(device: &str, agent_extra: &str) -> anyhow::Result<World> {
        // EDGE_TEST_KEEP=1 keeps the directory (logs, spool, store) for a post-mortem.
        let keep = std::env::var_os("EDGE_TEST_KEEP").is_some();
        let dir = tempfile::Builder::new().prefix("edge-system-").disable_cleanup(keep).tempdir()?;
        if keep {
            eprintln!("world kept at {}", dir.path().display());
        }
        let port = free_udp_port()?;
        let agent_metrics = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let ingest_metrics = SocketAddr::from(([127, 0, 0, 1], free_tcp_port()?));
        let pki = PkiFixture::generate(&dir.path().join("pki"), &[device])?;
        let d = dir.path();
        let ingest_config = d.join("edge-ingest.toml");
        std::fs::write(
            &ingest_config,
            format!(
                "[metrics]\nlisten = \"{ingest_metrics}\"\n\n\
                 [server]\nlisten = \"127.0.0.1:{port}\"\nshutdown_grace = \"2s\"\n\n\
                 [tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n\n\
                 [store]\ndata_dir = {:?}\n",
                pki.server.cert,
                pki.server.key,
                pki.server.client_ca,
                d.join("ingest"),
            ),
        )?;
        let dev = &pki.devices[0].1;
        let agent_config = d.join("edge-uploader.toml");
        std::fs::write(
            &agent_config,
            format!(
                "[metrics]\nlisten = \"{agent_metrics}\"\n\n\
                 [intake]\nsocket = {:?}\n\n\
                 [spool]\npath = {:?}\nmax_bytes = \"4GiB\"\nlinger = \"20ms\"\n\n\
                 [upload]\nserver = \"127.0.0.1:{port}\"\nserver_name = \"localhost\"\nca = {:?}\ncert = {:?}\nkey = {:?}\n\
                 backoff_min = \"50ms\"\nbackoff_max = \"1s\"\n{agent_extra}\n",
                d.join("agent/intake.sock"),
                d.join("agent/spool.db"),
                dev.ca,
                dev.cert,
                dev.key,
            ),
        )?;
        Ok(World { dir, agent_config, ingest_config, agent_metrics, ingest_metrics, pki })
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn intake_socket(&self) -> PathBuf {
        self.path().join("agent/intake.sock")
    }

    pub fn data_dir(&self) -> PathBuf {
        self.path().join("ingest")
    }

    /// Starts the ingest server and waits for READY.
    pub fn start_ingest(&self) -> anyhow::Result<Daemon> {
        let cfg = self.ingest_config.to_string_lossy().into_owned();
        let mut d = Daemon::spawn("ingest", &bin("edge-ingest")?, &["run", "--config", &cfg], self.path(), &[])?;
        d.wait_ready(READY_TIMEOUT)?;
        Ok(d)
    }

    /// Starts the agent and waits for READY.
    pub fn start_agent(&self) -> anyhow::Result<Daemon> {
        let cfg = self.agent_config.to_string_lossy().into_owned();
        let mut d = Daemon::spawn("agent", &bin("edge-uploader")?, &["run", "--config", &cfg], self.path(), &[])?;
        d.wait_ready(READY_TIMEOUT)?;
        Ok(d)
    }

    /// `GET /metrics` from a daemon, parsed into `series → value` (series as written, labels
    /// included, e.g. `edge_ingest_chunks_total{result="stored"}`).
    pub fn scrape(addr: SocketAddr) -> anyhow::Result<BTreeMap<String, f64>> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let (head, body) = response.split_once("\r\n\r\n").context("no end of headers in the answer")?;
        anyhow::ensure!(head.starts_with("HTTP/1.1 200"), "GET /metrics from {addr}: {head}");
        anyhow::ensure!(
            head.to_ascii_lowercase().contains("content-type: text/plain; version=0.0.4"),
            "not the Prometheus text format: {head}"
        );
        let mut series = BTreeMap::new();
        for line in body.lines().filter(|l| !l.is_empty() && !l.starts_with('#')) {
            let (name, value) = line.rsplit_once(' ').with_context(|| format!("bad sample line {line:?}"))?;
            let value = value.parse().with_context(|| format!("bad value in {line:?}"))?;
            anyhow::ensure!(series.insert(name.to_owned(), value).is_none(), "series {name} appears twice");
        }
        Ok(series)
    }

    /// Runs `edge-ingest export --format raw` and splits the output into records.
    pub fn export_raw(&self, stream: &str) -> anyhow::Result<Vec<Vec<u8>>> {
        let data_dir = self.data_dir().to_string_lossy().into_owned();
        let out = std::process::Command::new(bin("edge-ingest")?)
            .args(["export", "--data-dir", &data_dir, "--stream", stream, "--format", "raw"])
            .output()?;
        anyhow::ensure!(out.status.success(), "export failed: {}", String::from_utf8_lossy(&out.stderr));
        let mut recs = Vec::new();
        let mut rest = &out.stdout[..];
        while !rest.is_empty() {
            anyhow::ensure!(rest.len() >= 4, "export output truncated");
            let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
            anyhow::ensure!(rest.len() >= 4 + len, "export output truncated inside a record");
            recs.push(rest[4..4 + len].to_vec());
            rest = &rest[4 + len..];
        }
        Ok(recs)
    }
}

/// Runs `binary args...` with `NO_COLOR` and parses its stdout as JSON; returns the exit code too.
pub fn json_output(binary: &str, args: &[&str]) -> anyhow::Result<(i32, serde_json::Value)> {
    let out = std::process::Command::new(edge_testkit::bin(binary)?).args(args).env("NO_COLOR", "1").output()?;
    let doc = serde_json::from_slice(&out.stdout).map_err(|e| {
        anyhow::anyhow!("{binary} {args:?} did not print JSON ({e}): {}", String::from_utf8_lossy(&out.stdout))
    })?;
    Ok((out.status.code().unwrap_or(-1), doc))
}

/// `edge-uploader status --json` for the world's agent, with its exit code.
pub fn status_json(world: &World) -> anyhow::Result<(i32, serde_json::Value)> {
    let cfg = world.agent_config.to_string_lossy().into_owned();
    json_output("edge-uploader", &["status", "--json", "--config", &cfg])
}

/// Replaces `from`, which must occur exactly once, with `to` in the file at `path`.
pub fn rewrite(path: &Path, from: &str, to: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)?;
    anyhow::ensure!(text.matches(from).count() == 1, "{from:?} not once in {}", path.display());
    std::fs::write(path, text.replace(from, to))?;
    Ok(())
}

/// Sets the world's agent's reconnect backoff (`upload.backoff_min` and `backoff_max`).
pub fn set_backoff(world: &World, min: &str, max: &str) -> anyhow::Result<()> {
    rewrite(
        &world.agent_config,
        "backoff_min = \"50ms\"\nbackoff_max = \"1s\"\n",
        &format!("backoff_min = \"{min}\"\nbackoff_max = \"{max}\"\n"),
    )
}

/// `edge-uploader push` of `records` (NDJSON lines) to `stream` through the world's agent.
pub fn push(world: &World, stream: &str, records: &[String]) -> anyhow::Result<()> {
    let input = world.path().join(format!("{stream}.ndjson"));
    std::fs::write(&input, records.iter().map(|r| format!("{r}\n")).collect::<String>())?;
    let cfg = world.agent_config.to_string_lossy().into_owned();
    let out = std::process::Command::new(bin("edge-uploader")?)
        .args(["push", "--stream", stream, &input.to_string_lossy(), "--config", &cfg])
        .output()?;
    anyhow::ensure!(out.status.success(), "push to {stream}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

/// `n` sensor readings of `stream`, each a JSON object.
pub fn readings(stream: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{{\"stream\":\"{stream}\",\"i\":{i},\"celsius\":{}.5}}", 20 + i % 7)).collect()
}

/// Polls `probe` until `pred` holds, for up to a minute (the state lives in another process).
pub fn wait_json(
    what: &str,
    probe: impl Fn() -> anyhow::Result<(i32, serde_json::Value)>,
    pred: impl Fn(i32, &serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let (code, doc) = probe()?;
        if pred(code, &doc) {
            return Ok(doc);
        }
        anyhow::ensure!(std::time::Instant::now() < deadline, "never saw {what}: exit {code}, {doc}");
        std::thread::sleep(Duration::from_millis(100));
    }
}
