//! `edge-uploader status`: asks the running agent for its state and prints it for people (or as
//! JSON), with an exit code scripts can use: 0 healthy, 1 degraded, 3 not running, 4 unknown
//! (the socket could not be asked, as when permission is denied, and no metrics listener
//! answered for it).

use std::io::IsTerminal;
use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde_json::Value;

use crate::client::IntakeClient;

/// Exit code: the agent runs and uploads.
pub const EXIT_HEALTHY: u8 = 0;
/// Exit code: the agent runs but is disconnected, or its backlog is older than the threshold.
pub const EXIT_DEGRADED: u8 = 1;
/// Exit code: no agent answers on the socket (LSB convention for "not running").
pub const EXIT_NOT_RUNNING: u8 = 3;
/// Exit code: whether the agent runs cannot be told (LSB "unknown"): the socket could not be
/// asked (permission denied, say) and no metrics listener answered in its place.
pub const EXIT_UNKNOWN: u8 = 4;

/// Wall-clock unix milliseconds (the agent reports ages as timestamps).
pub fn now_ms() -> u64 {
    u64::try_from(
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis()).unwrap_or(0),
    )
    .unwrap_or(u64::MAX)
}

/// Counters sampled every few seconds, so `status` can show rates over the last minute.
#[derive(Debug, Default)]
pub struct RateWindow {
    samples: std::sync::Mutex<std::collections::VecDeque<(u64, [u64; 4])>>,
}

/// Per-second rates over the window: intake records, intake bytes, acked records, acked bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Rates {
    pub window_s: f64,
    pub per_s: [f64; 4],
}

impl RateWindow {
    /// How far back rates look.
    pub const WINDOW_MS: u64 = 60_000;
    /// How often the agent samples.
    pub const PERIOD: Duration = Duration::from_secs(5);

    /// Adds a sample of the four counters taken at `now_ms`; keeps one window of history.
    pub fn sample(&self, now_ms: u64, values: [u64; 4]) {
        let mut s = crate::lock(&self.samples);
        s.push_back((now_ms, values));
        while s.len() > 2 && s.get(1).is_some_and(|(t, _)| now_ms.saturating_sub(*t) >= Self::WINDOW_MS) {
            s.pop_front();
        }
    }

    /// Rates between the oldest sample in the window and `current` at `now_ms`.
    pub fn rates(&self, now_ms: u64, current: [u64; 4]) -> Option<Rates> {
        let s = crate::lock(&self.samples);
        let &(t0, v0) = s.front()?;
        let dt = now_ms.checked_sub(t0).filter(|dt| *dt > 0)? as f64 / 1000.0;
        let mut per_s = [0.0; 4];
        for (i, r) in per_s.iter_mut().enumerate() {
            *r = current[i].saturating_sub(v0[i]) as f64 / dt;
        }
        Some(Rates { window_s: dt, per_s })
    }
}

/// Seconds until the backlog is gone at the current rates; `None` when it is not shrinking.
pub fn drain_eta_s(backlog_bytes: u64, rates: &Rates) -> Option<f64> {
    if backlog_bytes == 0 {
        return Some(0.0);
    }
    let net = rates.per_s[3] - rates.per_s[1];
    (net > 0.0).then(|| backlog_bytes as f64 / net)
}

/// How long `edge-uploader status` waits for the agent's answer.
pub const FETCH_TIMEOUT: Duration = Duration::from_secs(5);

/// What asking the agent gave.
#[derive(Debug)]
pub enum Fetched {
    /// Its status document.
    Answer(Value),
    /// Nothing listens on the socket (no socket file, or nobody accepts on it).
    NotRunning,
    /// Something listens but gave no status document: why, for the operator.
    NoAnswer(String),
    /// The socket could not be asked, which says nothing of whether the agent runs (permission
    /// denied on the socket or its directory, say): why, for the operator.
    Unreachable(String),
}

/// What a failed `connect` to the intake socket at `socket` means. Only a missing socket (or
/// directory) and a refused connection show that no agent listens there.
pub fn connect_failed(socket: &Path, e: &std::io::Error, timeout: Duration) -> Fetched {
    use std::io::ErrorKind;
    match e.kind() {
        // The socket's backlog is full: the agent is there, and has not accepted for a while.
        ErrorKind::WouldBlock => Fetched::NoAnswer(busy(socket, timeout)),
        ErrorKind::NotFound | ErrorKind::ConnectionRefused | ErrorKind::NotADirectory => Fetched::NotRunning,
        // The socket's directory (/run/edge-uploader, 0750) or the socket itself is closed to
        // this user: the agent may well run behind it.
        ErrorKind::PermissionDenied => Fetched::Unreachable(format!(
            "permission denied on {}: run as root or as a member of the group that owns it",
            socket.display()
        )),
        _ => Fetched::Unreachable(format!("connecting to {}: {e}", socket.display())),
    }
}

fn busy(socket: &Path, timeout: Duration) -> String {
    format!(
        "the agent accepts connections on {} but did not answer within {}: every intake.max_connections slot may be \
         taken (edge_uploader_intake_connections on /metrics), or the agent is stuck",
        socket.display(),
        humantime::format_duration(timeout)
    )
}

/// Asks the agent behind `socket`, waiting at most `timeout` for its answer.
///
/// An agent whose intake serves `intake.max_connections` connections already serves this one
/// only once another closes: that is `NoAnswer`, not `NotRunning`.
pub async fn fetch(socket: &Path, timeout: Duration) -> Fetched {
    let busy = || busy(socket, timeout);
    let stream = match tokio::time::timeout(timeout, tokio::net::UnixStream::connect(socket)).await {
        Ok(Ok(stream)) => stream,
        Ok(Err(e)) => return connect_failed(socket, &e, timeout),
        Err(_) => return Fetched::NoAnswer(busy()),
    };
    let asked = async {
        let mut client = IntakeClient::on(stream).await?;
        client.get_json("/v1/status").await
    };
    match tokio::time::timeout(timeout, asked).await {
        Err(_) => Fetched::NoAnswer(busy()),
        Ok(Err(e)) => Fetched::NoAnswer(format!(
            "the agent on {} did not answer: {}",
            socket.display(),
            edge_telemetry::logging::error_chain(e.as_ref())
        )),
        Ok(Ok(resp)) if resp.status == 200 => Fetched::Answer(resp.body),
        Ok(Ok(resp)) => Fetched::NoAnswer(format!(
            "the agent on {} answered {} to GET /v1/status: {}",
            socket.display(),
            resp.status,
            resp.body
        )),
    }
}

/// Asks the agent's metrics listener at `addr` for its status document, within `timeout`:
/// what `edge-uploader status` shows when the intake socket does not answer ([`Fetched::NoAnswer`]),
/// since that listener is not under `intake.max_connections`, or cannot be asked
/// ([`Fetched::Unreachable`]), since it needs no permission on the socket. `Err` says why there
/// is none.
pub async fn fetch_metrics(addr: std::net::SocketAddr, timeout: Duration) -> Result<Value, String> {
    let asked = async {
        let stream = tokio::net::TcpStream::connect(addr).await.with_context(|| format!("connecting to {addr}"))?;
        let mut client = IntakeClient::on_tcp(stream).await?;
        client.get_json("/v1/status").await
    };
    match tokio::time::timeout(timeout, asked).await {
        Err(_) => {
            Err(format!("the metrics listener {addr} did not answer within {}", humantime::format_duration(timeout)))
        }
        Ok(Err(e)) => Err(format!("the metrics listener {addr}: {}", edge_telemetry::logging::error_chain(e.as_ref()))),
        Ok(Ok(resp)) if resp.status == 200 && resp.body["version"] == 1 => Ok(resp.body),
        Ok(Ok(resp)) => Err(format!("the metrics listener {addr} answered {} to GET /v1/status", resp.status)),
    }
}

/// The spool counts as full from this share of `spool.max_bytes`: a request fits only while the
/// spool's bytes and its own stay within the cap, so a spool at the cap stops short of it by
/// less than a request.
pub const SPOOL_FULL_RATIO: f64 = 0.95;

/// A spool thread at one commit or fsync this long makes the agent degraded: producers and acks
/// wait for it, and on a healthy disk it takes milliseconds.
pub const SPOOL_BUSY_DEGRADED: Duration = edge_telemetry::notify::STUCK_AFTER;

/// How long after the ingest last closed a connection for another agent's with this one's
/// certificate and spool id the agent counts as degraded: two such gateways take turns, each
/// closing the other's connection as it reconnects, within seconds to minutes.
pub const SHARED_SPOOL_DEGRADED: Duration = Duration::from_secs(15 * 60);

/// Why the agent is degraded, if it is, from its status document: disconnected (with the last
/// error, which says why); its backlog older than `max_backlog_age`; the spool at its cap; a
/// spool thread stuck in one commit or fsync for [`SPOOL_BUSY_DEGRADED`]; another agent with
/// this one's certificate and spool id within [`SHARED_SPOOL_DEGRADED`].
///
/// The agent's `last_error` is set when a connection or an attempt fails and never cleared, so
/// while connected it is the error of an earlier, ended connection: shown, not a reason.
pub fn degraded_reasons(status: &Value, max_backlog_age: Duration, now_ms: u64) -> Vec<String> {
    let (up, sp) = (&status["upload"], &status["spool"]);
    let mut reasons = Vec::new();
    if up["connected"] != true {
        reasons.push(match up["last_error"].as_str() {
            Some(e) => format!("not connected to the ingest server (last error: {e})"),
            None => "not connected to the ingest server".to_owned(),
        });
    }
    if let Some(oldest) = sp["oldest_ms"].as_u64() {
        let age = Duration::from_millis(now_ms.saturating_sub(oldest));
        if age > max_backlog_age {
            reasons.push(format!("oldest unacknowledged data is {} old", humantime::format_duration(round(age))));
        }
    }
    if let Some(at) = up["last_superseded_ms"].as_u64()
        && Duration::from_millis(now_ms.saturating_sub(at)) < SHARED_SPOOL_DEGRADED
    {
        let ago = humantime::format_duration(round(Duration::from_millis(now_ms.saturating_sub(at))));
        reasons.push(match up["spool_rekeyed"]["old_id"].as_str() {
            Some(old) => format!(
                "another gateway used this agent's device certificate and spool id {old}: the ingest closed this \
                 agent's connection for its newer one {ago} ago; the spool has a new id since, but until then the \
                 ingest took the two gateways' chunks with the same sequence numbers for one another's"
            ),
            None => format!(
                "another gateway uses this agent's device certificate and spool id: the ingest closed this agent's \
                 connection for its newer one {ago} ago, and takes the two gateways' chunks with the same sequence \
                 numbers for one another's"
            ),
        });
    }
    let settings = &status["settings"];
    if let (Some(total), Some(max)) = (sp["total_bytes"].as_u64(), settings["spool_max_bytes"].as_u64())
        && max > 0
        && total as f64 >= max as f64 * SPOOL_FULL_RATIO
    {
        let what = match settings["spool_full_policy"].as_str() {
            Some("drop_oldest") => "to make room, the oldest chunks not yet uploaded are deleted",
            Some("reject") => "producers whose records do not fit are refused (HTTP 507)",
            _ => "records that do not fit are refused or older ones deleted, by spool.full_policy",
        };
        reasons.push(format!(
            "the spool is full: {} of spool.max_bytes = {} ({:.0}%); {what}",
            bytesize::ByteSize::b(total),
            bytesize::ByteSize::b(max),
            total as f64 * 100.0 / max as f64,
        ));
    }
    if let Some(ms) = sp["busy"]["ms"].as_u64()
        && Duration::from_millis(ms) >= SPOOL_BUSY_DEGRADED
    {
        reasons.push(format!(
            "the spool has been in {} for {}: producers and acks wait (a disk that does not answer?)",
            sp["busy"]["doing"].as_str().unwrap_or("one operation"),
            humantime::format_duration(Duration::from_secs(ms / 1000)),
        ));
    }
    reasons
}

/// What the operator should know that is not a state the agent is in now, and so not a reason
/// for `degraded`: both last as long as the spool file (the agent keeps quarantined chunks for
/// inspection, `spool export-quarantined`, until `spool purge-quarantined`, and counts dropped
/// records since the spool was created), and a status that stayed degraded for them could not
/// say when something new goes wrong.
pub fn notes(status: &Value) -> Vec<String> {
    let sp = &status["spool"];
    let mut notes = Vec::new();
    if let Some(n) = sp["quarantined_chunks"].as_u64().filter(|n| *n > 0) {
        notes.push(format!(
            "{n} chunk{} in quarantine in the spool (found corrupt, or rejected by the ingest server): never uploaded; \
             `edge-uploader spool export-quarantined` prints their records, and `edge-uploader spool \
             purge-quarantined` deletes them with the agent stopped",
            plural(n)
        ));
    }
    if let Some(n) = sp["dropped_records"].as_u64().filter(|n| *n > 0) {
        let chunks = sp["dropped_chunks"].as_u64().map_or(String::new(), |c| format!(" in {c} chunk{}", plural(c)));
        notes.push(format!(
            "{n} record{}{chunks} deleted unsent to make room under spool.full_policy = \"drop_oldest\" \
             (counted since the spool was created)",
            plural(n),
        ));
    }
    // The spool file came from another machine: it took a new id at this start.
    if let Some(from) = sp["copied_from"].as_object() {
        notes.push(format!(
            "the spool file was last opened on another machine (machine id {}, spool id {}), as a copied disk image \
             is: it took a new spool id when the agent started, so that its records cannot collide with that \
             machine's; chunks it brought along that the other machine sent too are stored twice",
            from.get("machine_id").and_then(Value::as_str).unwrap_or("?"),
            from.get("spool_id").and_then(Value::as_str).unwrap_or("?"),
        ));
    }
    // Another agent with this certificate and spool id: a lasting state until one of the two
    // changes, whose effect (records taken for one another's) is done by then.
    if let Some(n) = status["upload"]["superseded_total"].as_u64().filter(|n| *n > 0) {
        notes.push(format!(
            "the ingest closed {n} connection{} of this agent since it started for a newer one with the same device \
             certificate and spool id, which this agent did not open: another gateway used both (a disk image copied \
             with its machine id?), and the ingest took the two gateways' chunks with the same sequence numbers for \
             one another's{}; give each gateway its own machine id (spool.machine_id_file)",
            plural(n),
            match status["upload"]["spool_rekeyed"]["old_id"].as_str() {
                Some(old) => format!(" until the spool gave up the id {old} for a new one"),
                None => String::new(),
            }
        ));
    }
    // Near the cap on streams: a producer that names a new stream is refused (a lasting state
    // of the spool, which never forgets a stream, so a note rather than a reason).
    if let (Some(streams), Some(max)) =
        (sp["streams"].as_array().map(|s| s.len() as u64), status["settings"]["spool_max_streams"].as_u64())
        && max > 0
        && streams as f64 >= max as f64 * SPOOL_FULL_RATIO
    {
        notes.push(format!(
            "the spool knows {streams} streams, spool.max_streams is {max}: {}",
            if streams >= max {
                "requests naming a new stream are refused (HTTP 422, too_many_streams)"
            } else {
                "at the cap, requests naming a new stream are refused (HTTP 422, too_many_streams)"
            }
        ));
    }
    notes
}

fn plural(n: u64) -> &'static str {
    if n == 1 { "" } else { "s" }
}

fn round(d: Duration) -> Duration {
    Duration::from_secs(d.as_secs())
}

/// Renders the status document for a terminal.
pub fn render(status: &Value, reasons: &[String], now_ms: u64) -> String {
    let color = std::io::stdout().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let paint = |code: &str, text: &str| if color { format!("\x1b[{code}m{text}\x1b[0m") } else { text.to_owned() };
    let up = &status["upload"];
    let sp = &status["spool"];
    let mut out = String::new();
    let state = if reasons.is_empty() { paint("32", "healthy") } else { paint("33", "degraded") };
    out.push_str(&format!("edge-uploader: {state}\n"));
    for r in reasons {
        out.push_str(&format!("  ! {r}\n"));
    }
    for n in notes(status) {
        out.push_str(&format!("  note: {n}\n"));
    }
    // Asked on the metrics listener because this user may not open the socket: not the agent's
    // problem, so a note rather than a reason.
    if let Some(e) = status["intake_socket_error"].as_str() {
        out.push_str(&format!(
            "  note: {e}; this status came from the metrics listener {}\n",
            status["answered_on"].as_str().unwrap_or("?")
        ));
    }
    let conn = &status["connection"];
    let since = conn["since_ms"].as_u64().map_or("-".to_owned(), |t| {
        format!("{} ago", humantime::format_duration(round(Duration::from_millis(now_ms.saturating_sub(t)))))
    });
    out.push_str(&format!(
        "connection: {} to {} ({}) since {since}, rtt {} ms, {}  (connects {}, in flight {})\n",
        if up["connected"] == true { paint("32", "connected") } else { paint("31", "disconnected") },
        conn["server"].as_str().unwrap_or("?"),
        conn["remote"].as_str().unwrap_or("-"),
        conn["rtt_ms"].as_f64().map_or("-".to_owned(), |r| format!("{r:.1}")),
        conn["congestion_controller"].as_str().unwrap_or("-"),
        up["connects_total"],
        up["in_flight"],
    ));
    // Disconnected: what the agent does about it, its attempts and the probes and path events
    // that ended backoff waits early (absent from an older agent's status: not shown).
    if up["connected"] != true
        && let Some(attempts) = up["connect_attempts_total"].as_u64()
    {
        out.push_str(&format!(
            "reconnecting: {attempts} attempts, {} probes sent ({} answered), {} network changes seen, since start\n",
            opt(&up["probes_sent_total"]),
            opt(&up["probe_wakeups_total"]),
            opt(&up["network_wakeups_total"]),
        ));
    }
    let r = &status["rates"];
    if let Some(w) = r["window_s"].as_f64() {
        out.push_str(&format!(
            "rates (last {w:.0} s): in {:.0} rec/s {:.2} MB/s, uploaded {:.0} rec/s {:.2} MB/s; drain eta {}\n",
            r["intake_records_per_s"].as_f64().unwrap_or(0.0),
            r["intake_bytes_per_s"].as_f64().unwrap_or(0.0) / 1e6,
            r["acked_records_per_s"].as_f64().unwrap_or(0.0),
            r["acked_bytes_per_s"].as_f64().unwrap_or(0.0) / 1e6,
            status["drain_eta_s"].as_f64().map_or("not draining".to_owned(), |s| {
                humantime::format_duration(Duration::from_secs(s.ceil() as u64)).to_string()
            }),
        ));
    }
    let age = sp["oldest_ms"].as_u64().map_or("-".to_owned(), |o| {
        humantime::format_duration(round(Duration::from_millis(now_ms.saturating_sub(o)))).to_string()
    });
    out.push_str(&format!(
        "spool: {} sealed chunks, {} records not sealed yet, {} bytes total ({} on disk), oldest unacked {age}, dropped {} records, quarantined {} chunks\n",
        sp["sealed_chunks"], opt(&sp["open_records"]), sp["total_bytes"], opt(&sp["disk_bytes"]), sp["dropped_records"], sp["quarantined_chunks"],
    ));
    out.push_str(&format!(
        "uploaded: {} chunks, {} records, {} bytes ({} sent on the wire); latency p50 {} ms, p99 {} ms\n",
        up["chunks_acked_total"],
        up["records_acked_total"],
        up["bytes_acked_total"],
        opt(&up["wire_bytes_total"]),
        opt(&up["latency_p50_ms"]),
        opt(&up["latency_p99_ms"]),
    ));
    // What else the ingest answered, and the floors that closed its gaps over chunks the spool
    // dropped or quarantined (absent from an older agent's status: not shown).
    if let Some(duplicate) = up["chunks_duplicate_total"].as_u64() {
        out.push_str(&format!(
            "answers: {duplicate} chunks duplicate (stored before), {} retry later, {} rejected (quarantined); {} floors sent\n",
            opt(&up["chunks_retry_total"]),
            opt(&up["chunks_rejected_total"]),
            opt(&up["floors_sent_total"]),
        ));
    }
    if let Some(e) = up["last_error"].as_str() {
        out.push_str(&format!("last error: {e}\n"));
    }
    if let Some(streams) = sp["streams"].as_array().filter(|s| !s.is_empty()) {
        out.push_str(&format!("{:<24} {:>10} {:>14} {:>12}\n", "stream", "next seq", "backlog bytes", "chunks"));
        // A spool may know thousands of streams: past `STREAM_ROWS`, the rows are those with
        // the most backlog, still in name order, and a line says how many are left out.
        let mut shown: Vec<&Value> = streams.iter().collect();
        if shown.len() > STREAM_ROWS {
            shown.sort_by_key(|s| std::cmp::Reverse(s["bytes"].as_u64().unwrap_or(0)));
            shown.truncate(STREAM_ROWS);
            shown.sort_by_key(|s| s["name"].as_str().unwrap_or_default());
        }
        for s in &shown {
            out.push_str(&format!(
                "{:<24} {:>10} {:>14} {:>12}\n",
                s["name"].as_str().unwrap_or("?"),
                // As strings: a JSON value's `Display` ignores the width.
                s["next_seq"].to_string(),
                s["bytes"].to_string(),
                s["sealed_chunks"].to_string()
            ));
        }
        if streams.len() > shown.len() {
            out.push_str(&format!(
                "... and {} more streams with less backlog (--json lists them all)\n",
                streams.len() - shown.len()
            ));
        }
    }
    out
}

/// Stream rows the human output shows at most (`--json` lists every stream).
const STREAM_ROWS: usize = 50;

fn opt(v: &Value) -> String {
    if v.is_null() { "-".to_owned() } else { v.to_string() }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn doc(connected: bool, oldest_ms: Option<u64>) -> Value {
        json!({
            "version": 1,
            "spool": {"sealed_chunks": 2, "total_bytes": 10, "oldest_ms": oldest_ms, "dropped_records": 0,
                      "quarantined_chunks": 0, "streams": [{"name": "t", "next_seq": 3, "bytes": 10, "sealed_chunks": 2}]},
            "connection": {"server": "ingest:4433", "remote": "10.0.0.1:4433", "since_ms": 0, "rtt_ms": 1.5,
                           "congestion_controller": "cubic"},
            "rates": {"window_s": 60.0, "intake_records_per_s": 10.0, "intake_bytes_per_s": 1000.0,
                      "acked_records_per_s": 20.0, "acked_bytes_per_s": 2000.0},
            "drain_eta_s": 5.0,
            "settings": {"spool_max_bytes": 1000, "spool_full_policy": "reject"},
            "upload": {"connected": connected, "connects_total": 1, "in_flight": 0, "chunks_acked_total": 5,
                       "records_acked_total": 50, "bytes_acked_total": 500, "latency_p50_ms": 3, "latency_p99_ms": null,
                       "last_error": null},
        })
    }

    #[test]
    fn a_connected_agent_with_fresh_backlog_is_healthy() {
        assert!(degraded_reasons(&doc(true, Some(99_000)), Duration::from_secs(60), 100_000).is_empty());
        assert!(degraded_reasons(&doc(true, None), Duration::from_secs(60), 100_000).is_empty());
    }

    #[test]
    fn disconnection_and_old_backlog_are_degraded_with_reasons() {
        let r = degraded_reasons(&doc(false, Some(0)), Duration::from_secs(60), 120_000);
        assert_eq!(r.len(), 2, "{r:?}");
        assert!(r[0].contains("not connected"));
        assert!(r[1].contains("2m"), "{r:?}");
    }

    #[test]
    fn a_spool_thread_stuck_in_one_commit_for_10_s_is_degraded_and_a_short_one_is_not() {
        let now = 100_000;
        let reasons = |d: &Value| degraded_reasons(d, Duration::from_secs(60), now);
        let mut d = doc(true, Some(99_000));
        d["spool"]["busy"] = json!({"doing": "one commit (thread edge-spool)", "ms": 9_999});
        assert!(reasons(&d).is_empty(), "{:?}", reasons(&d));
        d["spool"]["busy"] = json!({"doing": "one commit (thread edge-spool)", "ms": 12_345});
        assert_eq!(
            reasons(&d),
            [
                "the spool has been in one commit (thread edge-spool) for 12s: producers and acks wait (a disk that does \
              not answer?)"
            ]
        );
    }

    #[test]
    fn a_full_spool_is_degraded_and_quarantine_and_drops_are_notes() {
        let now = 100_000;
        let age = Duration::from_secs(60);
        let reasons = |d: &Value| degraded_reasons(d, age, now);

        // Quarantine and drops last as long as the spool file: shown, never a reason.
        let mut q = doc(true, Some(99_000));
        q["spool"]["quarantined_chunks"] = json!(2);
        q["spool"]["dropped_records"] = json!(1);
        q["spool"]["dropped_chunks"] = json!(1);
        assert!(reasons(&q).is_empty(), "{:?}", reasons(&q));
        let n = notes(&q);
        assert_eq!(
            n,
            [
                "2 chunks in quarantine in the spool (found corrupt, or rejected by the ingest server): never uploaded; \
                 `edge-uploader spool export-quarantined` prints their records, and `edge-uploader spool \
                 purge-quarantined` deletes them with the agent stopped",
                "1 record in 1 chunk deleted unsent to make room under spool.full_policy = \"drop_oldest\" \
                 (counted since the spool was created)"
            ]
        );
        let text = render(&q, &[], now);
        assert!(text.starts_with("edge-uploader: healthy\n"), "{text}");
        for note in &n {
            assert!(text.contains(&format!("  note: {note}\n")), "{note:?} not in {text}");
        }

        // 950 of 1000 bytes: at the cap, as near as a request's size.
        let mut full = doc(true, Some(99_000));
        full["spool"]["total_bytes"] = json!(950);
        let r = reasons(&full);
        assert_eq!(r.len(), 1, "{r:?}");
        assert!(r[0].starts_with("the spool is full: 950 B of spool.max_bytes = 1000 B (95%)"), "{r:?}");
        assert!(r[0].contains("refused (HTTP 507)"), "{r:?}");
        full["settings"]["spool_full_policy"] = json!("drop_oldest");
        assert!(reasons(&full)[0].contains("the oldest chunks not yet uploaded are deleted"), "{full}");
        full["spool"]["total_bytes"] = json!(949);
        assert!(reasons(&full).is_empty(), "below 95%: {:?}", reasons(&full));
        // An older agent without settings: nothing to compare with, no reason.
        full["spool"]["total_bytes"] = json!(1000);
        full["settings"] = Value::Null;
        assert!(reasons(&full).is_empty(), "{full}");

        // Every reason at once, in a stable order, printed as listed.
        let mut all = doc(false, Some(0));
        all["upload"]["last_error"] = json!("connect to ingest:4433: timed out");
        all["spool"]["total_bytes"] = json!(1000);
        let r = reasons(&all);
        assert_eq!(r.len(), 3, "{r:?}");
        assert_eq!(r[0], "not connected to the ingest server (last error: connect to ingest:4433: timed out)");
        assert!(r[1].starts_with("oldest unacknowledged data is") && r[2].starts_with("the spool is full"), "{r:?}");
        let text = render(&all, &r, now);
        assert!(text.starts_with("edge-uploader: degraded\n"), "{text}");
        for reason in &r {
            assert!(text.contains(&format!("  ! {reason}\n")), "{reason:?} not in {text}");
        }
    }

    #[test]
    fn a_last_error_of_an_ended_connection_is_shown_but_not_a_reason_while_connected() {
        let mut d = doc(true, Some(99_000));
        d["upload"]["last_error"] = json!("connection lost: timed out");
        let r = degraded_reasons(&d, Duration::from_secs(60), 100_000);
        assert!(r.is_empty(), "{r:?}");
        assert!(render(&d, &r, 100_000).contains("last error: connection lost: timed out"));
    }

    #[test]
    fn only_a_missing_socket_or_a_refused_connection_is_not_running() {
        use std::io::{Error, ErrorKind};
        let socket = Path::new("/run/edge-uploader/intake.sock");
        let t = FETCH_TIMEOUT;
        let denied = connect_failed(socket, &Error::from(ErrorKind::PermissionDenied), t);
        let Fetched::Unreachable(why) = denied else { panic!("{denied:?}") };
        assert_eq!(
            why,
            "permission denied on /run/edge-uploader/intake.sock: run as root or as a member of the group that owns it"
        );
        let odd = connect_failed(socket, &Error::other("out of buffers"), t);
        assert!(matches!(&odd, Fetched::Unreachable(why) if why.contains("out of buffers")), "{odd:?}");
        let busy = connect_failed(socket, &Error::from(ErrorKind::WouldBlock), t);
        assert!(matches!(&busy, Fetched::NoAnswer(why) if why.contains("intake.max_connections")), "{busy:?}");
        for kind in [ErrorKind::NotFound, ErrorKind::ConnectionRefused, ErrorKind::NotADirectory] {
            let f = connect_failed(socket, &Error::from(kind), t);
            assert!(matches!(f, Fetched::NotRunning), "{kind:?}: {f:?}");
        }
    }

    #[tokio::test]
    async fn fetch_says_not_running_for_a_missing_or_stale_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("missing.sock");
        let f = fetch(&missing, FETCH_TIMEOUT).await;
        assert!(matches!(f, Fetched::NotRunning), "{f:?}");
        // A socket file left behind by an agent that is gone: the connection is refused.
        let stale = dir.path().join("stale.sock");
        drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
        let f = fetch(&stale, FETCH_TIMEOUT).await;
        assert!(matches!(f, Fetched::NotRunning), "{f:?}");
    }

    #[test]
    fn a_status_read_on_the_metrics_listener_for_lack_of_permission_says_so_in_a_note() {
        let mut d = doc(true, Some(99_000));
        d["intake_socket_error"] = json!("permission denied on /run/edge-uploader/intake.sock: run as root");
        d["answered_on"] = json!("127.0.0.1:9171");
        let text = render(&d, &[], 100_000);
        assert!(text.starts_with("edge-uploader: healthy\n  note: permission denied on /run/edge-uploader/intake.sock: run as root; this status came from the metrics listener 127.0.0.1:9171\n"), "{text}");
    }

    #[test]
    fn rates_cover_the_last_minute_and_the_eta_follows_the_net_drain() {
        let w = RateWindow::default();
        assert_eq!(w.rates(1000, [0; 4]), None);
        for t in 0..=30u64 {
            // 5 s apart: 100 records and 1000 bytes in, 200 and 3000 out per step.
            w.sample(t * 5000, [t * 100, t * 1000, t * 200, t * 3000]);
        }
        let r = w.rates(150_000, [3000, 30_000, 6000, 90_000]).expect("rates");
        assert!((r.window_s - 60.0).abs() < 5.1, "{r:?}");
        assert!((r.per_s[0] - 20.0).abs() < 0.01 && (r.per_s[3] - 600.0).abs() < 0.01, "{r:?}");
        assert_eq!(drain_eta_s(4000, &r), Some(10.0), "net 400 B/s drains 4000 B in 10 s");
        let growing = Rates { window_s: 60.0, per_s: [0.0, 500.0, 0.0, 100.0] };
        assert_eq!(drain_eta_s(4000, &growing), None);
        assert_eq!(drain_eta_s(0, &growing), Some(0.0));
    }

    #[test]
    fn human_output_has_one_row_per_stream_and_no_colour_off_a_tty() {
        let text = render(&doc(true, Some(0)), &[], 1000);
        assert!(text.contains("healthy"));
        assert!(!text.contains('\x1b'), "tests do not run on a TTY: {text:?}");
        assert!(text.lines().any(|l| l.starts_with("t ") && l.contains(" 3 ")), "{text}");
        assert!(text.contains("p99 - ms"), "{text}");
        assert!(text.contains("to ingest:4433 (10.0.0.1:4433)") && text.contains("rtt 1.5 ms"), "{text}");
        assert!(text.contains("rates (last 60 s)") && text.contains("drain eta 5s"), "{text}");
        assert!(!text.contains("reconnecting:"), "connected: {text}");
        assert!(!text.contains("answers:"), "an older agent's status: {text}");

        let mut d = doc(true, Some(0));
        d["upload"]["chunks_duplicate_total"] = json!(4);
        d["upload"]["chunks_retry_total"] = json!(9);
        d["upload"]["chunks_rejected_total"] = json!(1);
        d["upload"]["floors_sent_total"] = json!(2);
        let text = render(&d, &[], 1000);
        assert!(
            text.contains(
                "answers: 4 chunks duplicate (stored before), 9 retry later, 1 rejected (quarantined); 2 floors sent"
            ),
            "{text}"
        );
    }

    #[test]
    fn with_many_streams_the_human_output_shows_those_with_the_most_backlog_and_counts_the_rest() {
        let mut d = doc(true, Some(0));
        let streams: Vec<Value> = (0..STREAM_ROWS as u64 + 7)
            .map(|i| json!({"name": format!("s{i:03}"), "next_seq": 1, "bytes": i, "sealed_chunks": 0}))
            .collect();
        d["spool"]["streams"] = json!(streams);
        let text = render(&d, &[], 1000);
        let rows: Vec<&str> = text.lines().filter(|l| l.starts_with("s0")).collect();
        assert_eq!(rows.len(), STREAM_ROWS, "{text}");
        assert!(rows[0].starts_with("s007 ") && rows[STREAM_ROWS - 1].starts_with("s056 "), "{rows:?}");
        assert!(text.contains("... and 7 more streams with less backlog (--json lists them all)"), "{text}");
        // Columns line up: the numbers are right-aligned under their headings.
        let header = text.lines().find(|l| l.starts_with("stream ")).expect("a header");
        assert_eq!(rows[0].len(), header.len(), "{header:?} / {:?}", rows[0]);
    }

    #[test]
    fn a_spool_near_or_at_its_cap_on_streams_gets_a_note() {
        let mut d = doc(true, Some(0));
        assert!(notes(&d).is_empty(), "one stream, no cap given: {:?}", notes(&d));
        d["settings"]["spool_max_streams"] = json!(20);
        assert!(notes(&d).is_empty(), "1 of 20");
        let streams: Vec<Value> = (0..19).map(|i| json!({"name": format!("s{i}"), "bytes": 0})).collect();
        d["spool"]["streams"] = json!(streams);
        let n = notes(&d);
        assert!(
            n.len() == 1 && n[0].contains("knows 19 streams, spool.max_streams is 20") && n[0].contains("at the cap"),
            "{n:?}"
        );
        d["settings"]["spool_max_streams"] = json!(19);
        let n = notes(&d);
        assert!(n.len() == 1 && n[0].contains("new stream are refused (HTTP 422"), "{n:?}");
        assert!(degraded_reasons(&d, Duration::from_secs(60), 1000).is_empty(), "a note, not a reason");
    }

    #[test]
    fn a_spool_copied_from_another_machine_gets_a_note_naming_it() {
        let mut d = doc(true, Some(0));
        d["spool"]["copied_from"] = Value::Null;
        assert!(notes(&d).is_empty(), "{:?}", notes(&d));
        d["spool"]["copied_from"] = json!({"machine_id": "0123abcd", "spool_id": "77ff"});
        let n = notes(&d);
        assert!(
            n.len() == 1 && n[0].contains("machine id 0123abcd, spool id 77ff") && n[0].contains("new spool id"),
            "{n:?}"
        );
        assert!(render(&d, &[], 1000).contains("machine id 0123abcd"));
        assert!(degraded_reasons(&d, Duration::from_secs(60), 1000).is_empty(), "a note, not a reason");
    }

    #[test]
    fn connections_closed_for_another_agent_with_our_spool_get_a_note() {
        let mut d = doc(true, Some(0));
        d["upload"]["superseded_total"] = json!(0);
        assert!(notes(&d).is_empty(), "{:?}", notes(&d));
        d["upload"]["superseded_total"] = json!(2);
        let n = notes(&d);
        assert!(n.len() == 1 && n[0].contains("closed 2 connections") && n[0].contains("another gateway"), "{n:?}");
        // Degraded while the last one is recent.
        let now = 10_000_000;
        d["spool"]["oldest_ms"] = json!(now);
        d["upload"]["last_superseded_ms"] = json!(now - 60_000);
        let r = degraded_reasons(&d, Duration::from_secs(3600), now);
        assert!(r.len() == 1 && r[0].contains("another gateway uses") && r[0].contains("1m ago"), "{r:?}");
        d["upload"]["spool_rekeyed"] = json!({"old_id": "abcd", "at_ms": now - 60_000});
        let r = degraded_reasons(&d, Duration::from_secs(3600), now);
        assert!(r.len() == 1 && r[0].contains("spool id abcd") && r[0].contains("has a new id since"), "{r:?}");
        assert!(notes(&d)[0].contains("gave up the id abcd"), "{:?}", notes(&d));
        d["upload"]["last_superseded_ms"] = json!(now - SHARED_SPOOL_DEGRADED.as_millis() as u64);
        assert!(degraded_reasons(&d, Duration::from_secs(3600), now).is_empty(), "long enough ago: a note only");
    }

    #[test]
    fn a_disconnected_agent_shows_how_it_tries_to_reconnect() {
        let mut d = doc(false, Some(0));
        d["upload"]["connect_attempts_total"] = json!(7);
        d["upload"]["probes_sent_total"] = json!(12);
        d["upload"]["probe_wakeups_total"] = json!(1);
        d["upload"]["network_wakeups_total"] = json!(0);
        let text = render(&d, &[], 1000);
        assert!(
            text.contains("reconnecting: 7 attempts, 12 probes sent (1 answered), 0 network changes seen"),
            "{text}"
        );
        // An older agent's status has none of these: no line rather than a wrong one.
        let text = render(&doc(false, Some(0)), &[], 1000);
        assert!(!text.contains("reconnecting:"), "{text}");
    }
}
