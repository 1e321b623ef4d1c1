//! `edge-ingest status`: the server's state for operators.
//!
//! Server side, [`router`] serves `GET /v1/status` on the metrics listener (`[metrics] listen`,
//! so status is unavailable when metrics are disabled): the connected devices, the store rates
//! over the last minute, the answer totals and the sink (store) health, as one JSON object with
//! `"version": 1` built by [`document`].
//!
//! Client side, [`fetch`] asks for it with a plain HTTP/1.1 GET, [`degraded_reasons`] decides
//! health and [`render`] prints it for people. Exit codes: 0 healthy, 1 degraded (the sink is
//! unhealthy, see [`sink_problems`], or the server accepts the connection but does not answer
//! in time), 3 not running (nothing answers), 4 unknown (status disabled, or the answer is not
//! an edge-ingest status).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::routing::get;
use serde_json::{Value, json};

use crate::server::ServerCounters;
use crate::store::{StoreStats, StoreStatsView};

/// Exit code: the server runs and its sink is healthy.
pub const EXIT_HEALTHY: u8 = 0;
/// Exit code: the server runs but its sink is unhealthy, or it accepts the status connection
/// but does not answer in time.
pub const EXIT_DEGRADED: u8 = 1;
/// Exit code: nothing answers on the status address (LSB "not running").
pub const EXIT_NOT_RUNNING: u8 = 3;
/// Exit code: the state cannot be told (LSB "unknown"): status disabled, a bad address, or
/// something that is not edge-ingest answered.
pub const EXIT_UNKNOWN: u8 = 4;

/// The default status address: the default `[metrics] listen`.
pub const DEFAULT_ADDR: &str = "127.0.0.1:9172";
/// Requests queued for the store with no batch finished for this long: the queue is stuck.
pub const QUEUE_STUCK_AFTER: Duration = Duration::from_secs(30);
/// Bound on the whole status request (connect, send, answer).
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// Wall-clock unix milliseconds.
pub fn now_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0),
    )
    .unwrap_or(u64::MAX)
}

// ---------------------------------------------------------------------------------------------
// Server side

#[derive(Debug, Clone)]
struct StatusState {
    counters: Arc<ServerCounters>,
    store: StoreStatsView,
    sink: Arc<serde_json::Map<String, Value>>,
}

/// `GET /v1/status`, to be served next to `/metrics` (see
/// [`MetricsServer::start_with`](edge_telemetry::metrics::MetricsServer::start_with)).
/// `sink` says which sink this is (`{"kind": "files", ...}`); its keys are added to the
/// document's `sink` object.
pub fn router(counters: Arc<ServerCounters>, store: StoreStatsView, sink: serde_json::Map<String, Value>) -> Router {
    Router::new().route("/v1/status", get(serve)).with_state(StatusState { counters, store, sink: Arc::new(sink) })
}

async fn serve(State(st): State<StatusState>) -> axum::Json<Value> {
    let mut doc = document(&st.counters, || st.store.get(), st.store.is_running(), Instant::now());
    if let Some(sink) = doc["sink"].as_object_mut() {
        sink.extend(st.sink.iter().map(|(k, v)| (k.clone(), v.clone())));
    }
    axum::Json(doc)
}

/// Why the sink (the store) is unhealthy; empty when healthy. A failure is reported while it is
/// the outcome of the most recent commit (the store clears it when a commit succeeds again).
pub fn sink_problems(stats: &StoreStats, running: bool, idle: Duration) -> Vec<String> {
    let mut problems = Vec::new();
    if !running {
        problems.push("the sink has stopped".to_owned());
    }
    if let Some(f) = &stats.last_failure {
        problems.push(format!("the last write to the sink failed: {f}"));
    }
    if let Some(busy) = stats.busy.filter(|d| *d >= edge_telemetry::notify::STUCK_AFTER) {
        problems.push(format!(
            "the store has been in one batch of writes and fsyncs for {}: chunks wait for the disk",
            humantime::format_duration(Duration::from_secs(busy.as_secs()))
        ));
    }
    if stats.queued > 0 && idle >= QUEUE_STUCK_AFTER {
        problems.push(format!(
            "{} chunks wait for the store, which finished no batch for {}",
            stats.queued,
            humantime::format_duration(Duration::from_secs(idle.as_secs()))
        ));
    }
    problems
}

/// The status document (`"version": 1`). `stats` reads the sink's statistics; it is called
/// after the counters are read: the store updates its statistics before it answers, and the
/// counters move only on an answer, so the sink's figures then cover at least what the totals
/// count (a status read between the two could otherwise show a chunk stored that the sink had
/// not).
pub fn document(
    counters: &ServerCounters,
    stats: impl FnOnce() -> StoreStats,
    store_running: bool,
    now: Instant,
) -> Value {
    use std::sync::atomic::Ordering::Relaxed;
    let totals = json!({
        "stored": counters.chunks_stored_total.load(Relaxed),
        "duplicate": counters.chunks_duplicate_total.load(Relaxed),
        "rejected": counters.chunks_rejected_total.load(Relaxed),
        "retry": counters.chunks_retry_total.load(Relaxed),
        "records": counters.records_stored_total.load(Relaxed),
        "bytes": counters.bytes_stored_total.load(Relaxed),
        "protocol_errors": counters.protocol_errors_total.load(Relaxed),
        "auth_failures": counters.auth_failures_total.load(Relaxed),
        "superseded": counters.superseded_total.load(Relaxed),
    });
    let devices = counters.devices.snapshot();
    let stats = stats();
    let sample = counters.sample(stats.batches, now);
    let rates = counters.rates.rates(sample);
    let problems = sink_problems(&stats, store_running, counters.rates.store_idle(sample));
    json!({
        "version": 1,
        "running": true,
        "server_version": env!("CARGO_PKG_VERSION"),
        "connections": counters.connections_open.load(Relaxed),
        "connections_total": counters.connections_total.load(Relaxed),
        "devices": devices,
        "rates": rates,
        "totals": totals,
        "sink": {
            "healthy": problems.is_empty(),
            "problems": problems,
            "last_failure": stats.last_failure.as_ref().map(ToString::to_string),
            "segments": stats.segments,
            "chunks": stats.chunks,
            "bytes": stats.bytes,
            "fsyncs": stats.fsyncs,
            "index_ranges": stats.index_ranges,
            "index_refused": stats.index_refused,
            "index_floors": stats.index_floors,
            "queued": stats.queued,
            "busy_ms": stats.busy.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        },
    })
}

// ---------------------------------------------------------------------------------------------
// Client side

/// Environment override of `[metrics] listen`, as the daemon reads it.
pub const LISTEN_ENV: &str = "EDGE_INGEST__METRICS__LISTEN";

/// Where the packaged unit reads environment overrides from (`EnvironmentFile=`).
pub const SERVICE_ENV_FILE: &str = "/etc/default/edge-ingest";

/// The status address from the environment or the config file's `[metrics] listen` (or the
/// default): `None` when it is empty, i.e. metrics and status are disabled. Only that key is
/// read, so neither the TLS files nor the rest of the file need to be valid; an unreadable file
/// means the default. For the packaged config (no `--config`, or the default path) the
/// environment is the one the service sees: [`SERVICE_ENV_FILE`]'s overrides under this
/// process's own.
pub fn addr_from_config(config: Option<&Path>) -> Option<String> {
    addr_from(config, Path::new(SERVICE_ENV_FILE))
}

fn addr_from(config: Option<&Path>, env_file: &Path) -> Option<String> {
    let packaged = Path::new(crate::config::DEFAULT_CONFIG_PATH);
    let service = edge_telemetry::service_env::for_packaged_config(
        config,
        packaged,
        env_file,
        crate::config::ENV_PREFIX,
        "edge-ingest",
    );
    let from_env = match service {
        Some(mut vars) => vars.remove(LISTEN_ENV),
        None => std::env::var(LISTEN_ENV).ok(),
    };
    let listen = from_env.or_else(|| {
        let path = config.unwrap_or(packaged);
        let text = std::fs::read_to_string(path).ok()?;
        let table: toml::Table = toml::from_str(&text).ok()?;
        table.get("metrics")?.get("listen")?.as_str().map(str::to_owned)
    });
    let listen = listen.unwrap_or_else(|| DEFAULT_ADDR.to_owned());
    let listen = listen.trim();
    (!listen.is_empty()).then(|| listen.to_owned())
}

/// Resolves `HOST:PORT`; an unspecified address (`0.0.0.0`, `[::]`) means this host's loopback.
pub fn resolve(addr: &str) -> Result<SocketAddr, String> {
    let mut found = addr.to_socket_addrs().map_err(|e| format!("{addr:?} is not a HOST:PORT address: {e}"))?;
    let a = found.next().ok_or_else(|| format!("{addr:?} resolves to no address"))?;
    Ok(edge_telemetry::metrics::local_addr_of(a))
}

/// What asking for the status gave.
#[derive(Debug)]
pub enum Fetched {
    /// A status document.
    Status(Value),
    /// Nothing answers (connection refused or not accepted in time).
    NotRunning(String),
    /// The connection was accepted but no answer came in time: the server is there and stuck
    /// (a hung process keeps accepting into its listen backlog). Why, for the operator.
    NoAnswer(String),
    /// Something answered, but not with an edge-ingest status document.
    Unknown(String),
}

/// `GET /v1/status` from `addr`, within `timeout` overall.
pub fn fetch(addr: SocketAddr, timeout: Duration) -> Fetched {
    let deadline = Instant::now() + timeout;
    let mut stream = match TcpStream::connect_timeout(&addr, timeout) {
        Ok(s) => s,
        Err(e) => return Fetched::NotRunning(e.to_string()),
    };
    let raw = match exchange(&mut stream, addr, deadline) {
        Ok(raw) => raw,
        // Silent, or an HTTP answer that stopped coming: stuck. Something else that spoke first
        // and then waited (an SSH banner, say) is not edge-ingest.
        Err((e, got)) if timed_out(&e) && (got.is_empty() || got.starts_with(b"HTTP/")) => {
            let what = if got.is_empty() { "did not answer" } else { "did not finish its answer" };
            return Fetched::NoAnswer(format!(
                "the server on {addr} accepted the connection but {what} within {}: it may be stuck",
                humantime::format_duration(timeout)
            ));
        }
        Err((e, got)) if timed_out(&e) => {
            return Fetched::Unknown(format!(
                "{addr} answered something other than HTTP: {:?}",
                String::from_utf8_lossy(&got[..got.len().min(64)])
            ));
        }
        Err((e, _)) => return Fetched::Unknown(format!("reading the answer from {addr}: {e}")),
    };
    match parse_response(&raw) {
        Ok((200, body)) => match serde_json::from_slice::<Value>(&body) {
            Ok(doc) if doc["version"] == 1 => Fetched::Status(doc),
            Ok(doc) => Fetched::Unknown(format!("unsupported status document version {}", doc["version"])),
            Err(e) => Fetched::Unknown(format!("the answer is not JSON: {e}")),
        },
        Ok((404, _)) => Fetched::Unknown(format!("{addr} has no /v1/status (not edge-ingest, or an older version)")),
        Ok((code, _)) => Fetched::Unknown(format!("{addr} answered HTTP {code}")),
        Err(e) => Fetched::Unknown(format!("{addr} answered something other than HTTP: {e}")),
    }
}

/// A socket timeout (`WouldBlock` on Unix) or the deadline of [`exchange`].
fn timed_out(e: &std::io::Error) -> bool {
    matches!(e.kind(), std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock)
}

/// Sends the request and reads the answer until the server closes, by `deadline`. On `Err`,
/// what had arrived.
fn exchange(stream: &mut TcpStream, addr: SocketAddr, deadline: Instant) -> Result<Vec<u8>, (std::io::Error, Vec<u8>)> {
    let left = || deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(1));
    let req =
        format!("GET /v1/status HTTP/1.1\r\nHost: {addr}\r\nAccept: application/json\r\nConnection: close\r\n\r\n");
    stream.set_write_timeout(Some(left())).and_then(|()| stream.write_all(req.as_bytes())).map_err(|e| (e, vec![]))?;
    let mut out = Vec::new();
    let mut buf = [0u8; 16 * 1024];
    loop {
        if Instant::now() >= deadline {
            return Err((std::io::Error::new(std::io::ErrorKind::TimedOut, "no complete answer in time"), out));
        }
        match stream.set_read_timeout(Some(left())).and_then(|()| stream.read(&mut buf)) {
            Ok(0) => return Ok(out),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(e) => return Err((e, out)),
        }
        if out.len() > 64 << 20 {
            return Err((std::io::Error::other("answer larger than 64 MiB"), out));
        }
    }
}

/// Splits an HTTP/1.1 response into its status code and body (chunked bodies decoded).
pub fn parse_response(raw: &[u8]) -> Result<(u16, Vec<u8>), String> {
    let end = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or("no end of headers")?;
    let head = std::str::from_utf8(&raw[..end]).map_err(|_| "headers are not UTF-8")?;
    let body = &raw[end + 4..];
    let mut lines = head.split("\r\n");
    let status = lines.next().unwrap_or_default();
    let code = status
        .strip_prefix("HTTP/1.")
        .and_then(|s| s.split(' ').nth(1))
        .and_then(|c| c.parse::<u16>().ok())
        .ok_or_else(|| format!("bad status line {status:?}"))?;
    let header = |name: &str| {
        lines.clone().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_ascii_lowercase())
        })
    };
    if header("transfer-encoding").is_some_and(|v| v.contains("chunked")) {
        return Ok((code, dechunk(body)?));
    }
    match header("content-length").map(|v| v.parse::<usize>()) {
        Some(Ok(len)) if body.len() >= len => Ok((code, body[..len].to_vec())),
        Some(Ok(len)) => Err(format!("body cut short: {} of {len} bytes", body.len())),
        Some(Err(_)) => Err("bad content-length".to_owned()),
        None => Ok((code, body.to_vec())),
    }
}

fn dechunk(mut body: &[u8]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    loop {
        let eol = body.windows(2).position(|w| w == b"\r\n").ok_or("chunk size line cut short")?;
        let size = std::str::from_utf8(&body[..eol]).ok().and_then(|s| s.split(';').next()).unwrap_or_default();
        let size = usize::from_str_radix(size.trim(), 16).map_err(|_| format!("bad chunk size {size:?}"))?;
        body = &body[eol + 2..];
        if size == 0 {
            return Ok(out);
        }
        let data = body.get(..size).ok_or("chunk cut short")?;
        out.extend_from_slice(data);
        body = body.get(size + 2..).ok_or("chunk cut short")?;
    }
}

/// Why the server is degraded, if it is: the sink's problems as the server reported them.
pub fn degraded_reasons(doc: &Value) -> Vec<String> {
    let sink = &doc["sink"];
    if sink["healthy"] == true {
        return Vec::new();
    }
    let reasons: Vec<String> =
        sink["problems"].as_array().into_iter().flatten().filter_map(|p| p.as_str().map(str::to_owned)).collect();
    if reasons.is_empty() { vec!["the sink is unhealthy".to_owned()] } else { reasons }
}

/// Colour for a terminal, never with `NO_COLOR` set.
pub fn use_color() -> bool {
    use std::io::IsTerminal;
    std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none()
}

/// Renders the status document for people.
pub fn render(doc: &Value, reasons: &[String], now_ms: u64, color: bool) -> String {
    let paint = |code: &str, text: &str| if color { format!("\x1b[{code}m{text}\x1b[0m") } else { text.to_owned() };
    let num = |v: &Value| v.as_u64().unwrap_or(0);
    let bytes = |v: &Value| bytesize::ByteSize::b(num(v)).to_string();
    let mut out = String::new();
    let state = if reasons.is_empty() { paint("32", "healthy") } else { paint("33", "degraded") };
    out.push_str(&format!("edge-ingest: {state}\n"));
    for r in reasons {
        out.push_str(&format!("  ! {r}\n"));
    }
    let devices = doc["devices"].as_array().map_or(&[][..], Vec::as_slice);
    let superseded = num(&doc["totals"]["superseded"]);
    out.push_str(&format!(
        "connections: {} open ({} accepted{}), {} device{}\n",
        num(&doc["connections"]),
        num(&doc["connections_total"]),
        if superseded > 0 { format!(", {superseded} superseded by a newer one of their agent") } else { String::new() },
        devices.len(),
        if devices.len() == 1 { "" } else { "s" },
    ));
    let r = &doc["rates"];
    let rate = |v: &Value| v.as_f64().unwrap_or(0.0);
    out.push_str(&format!(
        "rates (last {:.0} s): {:.1} chunks/s, {:.1} records/s, {}/s\n",
        rate(&r["window_s"]),
        rate(&r["chunks_per_s"]),
        rate(&r["records_per_s"]),
        // Whole bytes: fractions of a byte per second are noise.
        bytesize::ByteSize::b(rate(&r["bytes_per_s"]).round() as u64),
    ));
    let t = &doc["totals"];
    out.push_str(&format!(
        "chunks: {} stored ({} records, {}), {} duplicate, {} rejected, {} retry; {} protocol errors, {} auth failures\n",
        num(&t["stored"]),
        num(&t["records"]),
        bytes(&t["bytes"]),
        num(&t["duplicate"]),
        num(&t["rejected"]),
        num(&t["retry"]),
        num(&t["protocol_errors"]),
        num(&t["auth_failures"]),
    ));
    let s = &doc["sink"];
    let health = if s["healthy"] == true { paint("32", "healthy") } else { paint("31", "unhealthy") };
    if s["kind"] == "jetstream" {
        out.push_str(&format!(
            "sink: JetStream stream {} on {}, {health}, {} chunks stored since start, {}, {} queued\n",
            s["stream"].as_str().unwrap_or("?"),
            s["servers"].as_array().into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join(", "),
            num(&s["chunks"]),
            bytes(&s["bytes"]),
            num(&s["queued"]),
        ));
    } else {
        let refused = num(&s["index_refused"]);
        let floors = num(&s["index_floors"]);
        out.push_str(&format!(
            "sink: {health}, {} segments, {} chunks, {}, {} fsyncs, {} queued; dedup index {} ranges{}{}\n",
            num(&s["segments"]),
            num(&s["chunks"]),
            bytes(&s["bytes"]),
            num(&s["fsyncs"]),
            num(&s["queued"]),
            num(&s["index_ranges"]),
            if refused > 0 { format!(", {refused} chunks refused at a device's cap") } else { String::new() },
            if floors > 0 { format!(", {floors} agents' floors applied") } else { String::new() },
        ));
    }
    if let Some(f) = s["last_failure"].as_str() {
        out.push_str(&format!("last sink failure: {f}\n"));
    }
    if !devices.is_empty() {
        out.push_str(&format!(
            "{:<24} {:>5} {:>16} {:<24} {:>8} {:>10}\n",
            "device", "conns", "connected for", "remote", "chunks", "records"
        ));
        for d in devices {
            let age = Duration::from_secs(now_ms.saturating_sub(num(&d["since_ms"])) / 1000);
            out.push_str(&format!(
                "{:<24} {:>5} {:>16} {:<24} {:>8} {:>10}\n",
                d["device"].as_str().unwrap_or("?"),
                num(&d["connections"]),
                humantime::format_duration(age).to_string(),
                d["remote"].as_str().unwrap_or("?"),
                num(&d["chunks_stored"]),
                num(&d["records_stored"]),
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::StoreFailure;
    use std::sync::atomic::Ordering::Relaxed;

    fn counters_with_a_device() -> Arc<ServerCounters> {
        let c = Arc::new(ServerCounters::default());
        c.connections_open.store(1, Relaxed);
        c.connections_total.store(3, Relaxed);
        c.chunks_stored_total.store(4, Relaxed);
        c.records_stored_total.store(40, Relaxed);
        c
    }

    #[test]
    fn the_document_has_version_devices_rates_totals_and_sink() {
        let c = counters_with_a_device();
        let reg = c.devices.connect("gw-7", "10.1.2.3:4444".parse().expect("addr"), 1_000);
        reg.stored().chunks.fetch_add(4, Relaxed);
        let t0 = Instant::now();
        c.rates.push(c.sample(1, t0));
        c.chunks_stored_total.store(14, Relaxed);
        let stats = StoreStats {
            segments: 2,
            chunks: 14,
            fsyncs: 9,
            index_ranges: 3,
            index_refused: 5,
            index_floors: 6,
            ..StoreStats::default()
        };
        c.superseded_total.store(2, Relaxed);
        let doc = document(&c, || stats.clone(), true, t0 + Duration::from_secs(5));
        assert_eq!(doc["version"], 1);
        assert_eq!(doc["connections"], 1);
        assert_eq!(doc["devices"][0]["device"], "gw-7");
        assert_eq!(doc["devices"][0]["connections"], 1);
        assert_eq!(doc["devices"][0]["since_ms"], 1_000);
        assert_eq!(doc["devices"][0]["remote"], "10.1.2.3:4444");
        assert_eq!(doc["devices"][0]["chunks_stored"], 4);
        assert_eq!(doc["rates"]["chunks_per_s"], 2.0);
        assert_eq!(doc["rates"]["window_s"], 5.0);
        assert_eq!(doc["totals"]["stored"], 14);
        assert_eq!(doc["sink"]["healthy"], true);
        assert_eq!(doc["sink"]["segments"], 2);
        assert_eq!(doc["sink"]["index_ranges"], 3);
        assert_eq!(doc["sink"]["index_refused"], 5);
        assert_eq!(doc["sink"]["index_floors"], 6);
        assert_eq!(doc["totals"]["superseded"], 2);
        assert!(doc["sink"]["last_failure"].is_null());
        assert!(degraded_reasons(&doc).is_empty());
        drop(reg);
        let doc = document(&c, || stats.clone(), true, t0);
        assert_eq!(doc["devices"], json!([]));
    }

    #[test]
    fn a_failed_last_commit_a_stuck_queue_or_a_stopped_store_is_degraded() {
        let ok = StoreStats::default();
        assert!(sink_problems(&ok, true, Duration::from_secs(3600)).is_empty(), "idle without a queue is fine");
        let failed = StoreStats { last_failure: Some(StoreFailure::DiskFull), ..StoreStats::default() };
        assert_eq!(sink_problems(&failed, true, Duration::ZERO), ["the last write to the sink failed: disk full"]);
        let queued = StoreStats { queued: 5, ..StoreStats::default() };
        assert!(sink_problems(&queued, true, Duration::from_secs(29)).is_empty());
        let stuck = sink_problems(&queued, true, QUEUE_STUCK_AFTER);
        assert!(stuck[0].contains("5 chunks wait") && stuck[0].contains("30s"), "{stuck:?}");
        assert_eq!(sink_problems(&ok, false, Duration::ZERO), ["the sink has stopped"]);
        let slow = StoreStats { busy: Some(Duration::from_millis(9_999)), ..StoreStats::default() };
        assert!(sink_problems(&slow, true, Duration::ZERO).is_empty(), "a slow commit is not a stuck one");
        let hung = StoreStats { busy: Some(Duration::from_secs(12)), ..StoreStats::default() };
        assert_eq!(
            sink_problems(&hung, true, Duration::ZERO),
            ["the store has been in one batch of writes and fsyncs for 12s: chunks wait for the disk"]
        );
        assert_eq!(
            document(&ServerCounters::default(), || hung.clone(), true, Instant::now())["sink"]["busy_ms"],
            12_000
        );

        let c = ServerCounters::default();
        let doc = document(&c, || failed.clone(), true, Instant::now());
        assert_eq!(doc["sink"]["healthy"], false);
        assert_eq!(doc["sink"]["last_failure"], "disk full");
        assert_eq!(degraded_reasons(&doc), ["the last write to the sink failed: disk full"]);
        assert_eq!(degraded_reasons(&json!({"sink": {"healthy": false}})), ["the sink is unhealthy"]);
    }

    #[test]
    fn human_output_lists_devices_and_paints_only_when_asked() {
        let c = counters_with_a_device();
        let _reg = c.devices.connect("gw-7", "10.1.2.3:4444".parse().expect("addr"), 1_000);
        let doc = document(&c, StoreStats::default, true, Instant::now());
        let text = render(&doc, &[], 62_000, false);
        assert!(text.starts_with("edge-ingest: healthy\n"), "{text}");
        assert!(!text.contains('\x1b'), "{text}");
        let row = text.lines().find(|l| l.starts_with("gw-7 ")).expect("a row for the device");
        assert!(row.contains("1m 1s") && row.contains("10.1.2.3:4444"), "{row}");
        assert!(text.contains("1 open (3 accepted), 1 device\n"), "{text}");
        assert!(text.contains("; dedup index 0 ranges\n"), "nothing refused, nothing said: {text}");
        c.superseded_total.store(4, Relaxed);
        let stats = StoreStats { index_ranges: 70_000, index_refused: 12, index_floors: 3, ..StoreStats::default() };
        let text = render(&document(&c, || stats, true, Instant::now()), &[], 62_000, false);
        assert!(text.contains("1 open (3 accepted, 4 superseded by a newer one of their agent), 1 device\n"), "{text}");
        assert!(
            text.contains(
                "; dedup index 70000 ranges, 12 chunks refused at a device's cap, 3 agents' floors applied\n"
            ),
            "{text}"
        );
        let painted = render(&doc, &["the sink is unhealthy".to_owned()], 62_000, true);
        assert!(painted.contains("\x1b[33mdegraded\x1b[0m") && painted.contains("  ! the sink is unhealthy"));
    }

    #[test]
    fn responses_are_parsed_with_length_or_chunks() {
        let plain = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
        assert_eq!(parse_response(plain), Ok((200, b"{}".to_vec())));
        let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\n{\"a\r\n4\r\n\":1}\r\n0\r\n\r\n";
        assert_eq!(parse_response(chunked), Ok((200, b"{\"a\":1}".to_vec())));
        assert_eq!(parse_response(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n"), Ok((404, vec![])));
        assert!(parse_response(b"SSH-2.0-OpenSSH\r\n").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\ncontent-length: 9\r\n\r\n{}").is_err());
    }

    #[test]
    fn addresses_come_from_the_config_key_only_and_unspecified_means_loopback() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = dir.path().join("edge-ingest.toml");
        // Not a valid config (unknown key, missing TLS files): only metrics.listen matters.
        std::fs::write(&cfg, "[metrics]\nlisten = \"0.0.0.0:9999\"\n[nonsense]\nx = 1\n").expect("write");
        assert_eq!(addr_from_config(Some(&cfg)).as_deref(), Some("0.0.0.0:9999"));
        assert_eq!(resolve("0.0.0.0:9999"), Ok(SocketAddr::from(([127, 0, 0, 1], 9999))));
        std::fs::write(&cfg, "[metrics]\nlisten = \"\"\n").expect("write");
        assert_eq!(addr_from_config(Some(&cfg)), None, "empty: status disabled");
        assert_eq!(addr_from_config(Some(&dir.path().join("missing.toml"))).as_deref(), Some(DEFAULT_ADDR));
        assert!(resolve("no port").is_err());
    }

    #[test]
    fn the_units_environment_file_moves_the_packaged_services_address_only() {
        let dir = tempfile::tempdir().expect("tempdir");
        let env_file = dir.path().join("edge-ingest");
        std::fs::write(&env_file, format!("{LISTEN_ENV}=127.0.0.1:9444\n")).expect("write");
        let cfg = dir.path().join("edge-ingest.toml");
        std::fs::write(&cfg, "[metrics]\nlisten = \"127.0.0.1:9555\"\n").expect("write");
        assert_eq!(addr_from(Some(&cfg), &env_file).as_deref(), Some("127.0.0.1:9555"), "not the packaged config");
        let packaged = Path::new(crate::config::DEFAULT_CONFIG_PATH);
        assert_eq!(addr_from(Some(packaged), &env_file).as_deref(), Some("127.0.0.1:9444"));
        assert_eq!(addr_from(None, &env_file).as_deref(), Some("127.0.0.1:9444"));
    }

    /// A listener that accepts one connection, writes `says` on it and then neither answers nor
    /// closes until the returned sender is dropped.
    fn accepting_server(says: &'static [u8]) -> (SocketAddr, std::sync::mpsc::Sender<()>, std::thread::JoinHandle<()>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (release, hold) = std::sync::mpsc::channel::<()>();
        let server = std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().expect("accept");
            conn.write_all(says).expect("write");
            // Blocks until the test is done with the connection.
            let _ = hold.recv();
        });
        (addr, release, server)
    }

    #[test]
    fn a_server_that_accepts_and_never_answers_is_degraded_not_unknown() {
        let timeout = Duration::from_millis(300);
        let (addr, release, server) = accepting_server(b"");
        let f = fetch(addr, timeout);
        let Fetched::NoAnswer(why) = &f else { panic!("{f:?}") };
        assert_eq!(
            why,
            &format!("the server on {addr} accepted the connection but did not answer within 300ms: it may be stuck")
        );
        drop(release);
        server.join().expect("server");

        // An answer that starts and stops coming: stuck too.
        let (addr, release, server) = accepting_server(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{");
        let f = fetch(addr, timeout);
        assert!(matches!(&f, Fetched::NoAnswer(why) if why.contains("did not finish its answer")), "{f:?}");
        drop(release);
        server.join().expect("server");

        // Something else that speaks first and then waits for its own protocol: not edge-ingest.
        let (addr, release, server) = accepting_server(b"SSH-2.0-OpenSSH_9.6\r\n");
        let f = fetch(addr, timeout);
        assert!(
            matches!(&f, Fetched::Unknown(why) if why.contains("other than HTTP") && why.contains("SSH-2.0")),
            "{f:?}"
        );
        drop(release);
        server.join().expect("server");
    }

    #[tokio::test]
    async fn fetch_tells_not_running_from_a_status_and_from_something_else() {
        // Below the kernel's ephemeral range: no outgoing connection can take it meanwhile.
        let closed = SocketAddr::from(([127, 0, 0, 1], edge_testkit::free_tcp_port().expect("free port")));
        let f = tokio::task::spawn_blocking(move || fetch(closed, FETCH_TIMEOUT)).await.expect("join");
        assert!(matches!(f, Fetched::NotRunning(_)), "{f:?}");

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let dir = tempfile::tempdir().expect("tempdir");
        let (store, _) = crate::store::Store::open(crate::store::StoreOptions::new(dir.path())).expect("store");
        let store = crate::store::StoreHandle::spawn(store);
        let counters = counters_with_a_device();
        let server = edge_telemetry::metrics::MetricsServer::start_with(
            Some(listener),
            prometheus::Registry::new(),
            router(counters, store.stats_view(), json!({"kind": "files"}).as_object().cloned().unwrap_or_default()),
        );
        let f = tokio::task::spawn_blocking(move || fetch(addr, FETCH_TIMEOUT)).await.expect("join");
        let Fetched::Status(doc) = f else { panic!("{f:?}") };
        assert_eq!((doc["version"].as_u64(), doc["totals"]["stored"].as_u64()), (Some(1), Some(4)), "{doc}");
        assert_eq!(doc["sink"]["healthy"], true, "{doc}");
        server.stop().await;

        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let other = edge_telemetry::metrics::MetricsServer::start(Some(listener), prometheus::Registry::new());
        let f = tokio::task::spawn_blocking(move || fetch(addr, FETCH_TIMEOUT)).await.expect("join");
        assert!(matches!(&f, Fetched::Unknown(why) if why.contains("no /v1/status")), "{f:?}");
        other.stop().await;
        tokio::task::spawn_blocking(move || store.shutdown()).await.expect("join");
    }
}
