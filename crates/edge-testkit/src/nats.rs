//! NATS JetStream for the tests of the JetStream sink: the machine's server (127.0.0.1:4222, or
//! `EDGE_TEST_NATS_URL`), a stream name of the test's own, reading a stream back message by
//! message, and a private `nats-server` process for tests that must stop NATS.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use async_nats::jetstream;

/// The NATS server the tests use: `EDGE_TEST_NATS_URL`, or the machine's JetStream server.
pub fn url() -> String {
    std::env::var("EDGE_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into())
}

/// A stream name and subject prefix no other test (or run) uses: `tag`, the process id and a
/// random suffix.
pub fn unique(tag: &str) -> (String, String) {
    let n: u32 = rand::random();
    let stream = format!("EDGE_TEST_{}_{}_{n:08x}", tag.to_ascii_uppercase(), std::process::id());
    let prefix = format!("edgetest.{}.{}.{n:08x}", tag.to_ascii_lowercase(), std::process::id());
    (stream, prefix)
}

/// A JetStream context on `url`, on a server that holds [`ANCHOR`].
pub async fn context(url: &str) -> anyhow::Result<jetstream::Context> {
    let client = async_nats::connect(url).await.with_context(|| format!("connecting to NATS at {url}"))?;
    let js = jetstream::new(client);
    ensure_anchor(&js).await?;
    Ok(js)
}

/// A stream the tests create on every server they use and never delete. nats-server removes
/// an account's directory of streams with its last stream, and a stream created meanwhile by
/// a test running beside it fails ("error creating store for stream", 10049: the server logs
/// `mkdir .../streams: no such file or directory`). While this one exists, no test deletes
/// the last stream.
pub const ANCHOR: &str = "EDGE_TEST_ANCHOR";

async fn ensure_anchor(js: &jetstream::Context) -> anyhow::Result<()> {
    let config = jetstream::stream::Config {
        name: ANCHOR.into(),
        subjects: vec!["edgetest-anchor.none".into()],
        storage: jetstream::stream::StorageType::File,
        max_messages: 1,
        ..jetstream::stream::Config::default()
    };
    // Creating it can itself meet the race above, once per server.
    let mut attempt = 0;
    loop {
        match js.get_or_create_stream(config.clone()).await {
            Ok(_) => return Ok(()),
            Err(_) if attempt < 20 => {
                attempt += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("creating stream {ANCHOR}")),
        }
    }
}

/// Deletes `stream` (no error if it is gone).
pub async fn delete_stream(js: &jetstream::Context, stream: &str) {
    let _ = js.delete_stream(stream).await;
}

/// One stored message, as the sink wrote it.
#[derive(Debug, Clone)]
pub struct Stored {
    pub sequence: u64,
    pub subject: String,
    pub headers: BTreeMap<String, String>,
    pub payload: bytes::Bytes,
}

impl Stored {
    /// A header's value (`""` when missing).
    pub fn header(&self, name: &str) -> &str {
        self.headers.get(name).map_or("", String::as_str)
    }

    /// The records of the message body (length-prefixed, as `edge_proto::records` frames them).
    pub fn records(&self) -> anyhow::Result<Vec<Vec<u8>>> {
        edge_proto::records::RecordIter::new(&self.payload)
            .map(|r| r.map(<[u8]>::to_vec).map_err(|e| anyhow::anyhow!("message {}: {e}", self.sequence)))
            .collect()
    }
}

/// Where a message belongs in its agent stream: spool id, chunk sequence number, part.
type Place = (String, u64, u32);

/// The records of every agent stream found in `msgs` (by `Edge-Stream`), each stream's in the
/// agent's order: by spool, chunk sequence number and part, whatever order JetStream got them in.
pub fn records_by_stream(msgs: &[Stored]) -> anyhow::Result<BTreeMap<String, Vec<Vec<u8>>>> {
    let mut keyed: BTreeMap<String, Vec<(Place, &Stored)>> = BTreeMap::new();
    for m in msgs {
        let seq = m.header("Edge-Seq").parse().with_context(|| format!("message {}: Edge-Seq", m.sequence))?;
        let part = m
            .header("Edge-Part")
            .split_once('/')
            .and_then(|(i, _)| i.parse().ok())
            .with_context(|| format!("message {}: Edge-Part", m.sequence))?;
        keyed
            .entry(m.header("Edge-Stream").to_owned())
            .or_default()
            .push(((m.header("Edge-Spool").to_owned(), seq, part), m));
    }
    let mut out = BTreeMap::new();
    for (stream, mut v) in keyed {
        v.sort_by(|a, b| a.0.cmp(&b.0));
        let mut recs = Vec::new();
        for (_, m) in v {
            recs.extend(m.records()?);
        }
        out.insert(stream, recs);
    }
    Ok(out)
}

/// Checks every stream of `workload` against what JetStream holds, as
/// [`crate::workload::check_store`] does against a file store.
pub fn check_stream_contents(
    workload: &crate::workload::Workload,
    msgs: &[Stored],
    sent: &[Vec<crate::workload::Sent>],
) -> anyhow::Result<crate::workload::Report> {
    let by_stream = records_by_stream(msgs)?;
    let mut total = crate::workload::Report::default();
    for (i, name) in workload.streams.iter().enumerate() {
        let stored = by_stream.get(name).map_or(&[][..], Vec::as_slice);
        total.add(&crate::workload::check_stream(workload, i, sent.get(i).map_or(&[][..], Vec::as_slice), stored));
    }
    Ok(total)
}

/// Every message of `stream`, in stream order.
pub async fn messages(js: &jetstream::Context, stream: &str) -> anyhow::Result<Vec<Stored>> {
    let mut s = js.get_stream(stream).await.with_context(|| format!("stream {stream}"))?;
    let state = s.info().await.context("stream info")?.state.clone();
    let mut out = Vec::new();
    if state.messages == 0 {
        return Ok(out);
    }
    for seq in state.first_sequence..=state.last_sequence {
        let Ok(m) = s.get_raw_message(seq).await else { continue };
        let headers = m
            .headers
            .iter()
            .map(|(k, v)| (k.to_string(), v.iter().map(|v| v.as_str()).collect::<Vec<_>>().join(",")))
            .collect();
        out.push(Stored { sequence: seq, subject: m.subject.to_string(), headers, payload: m.payload });
    }
    Ok(out)
}

/// A `nats-server` of the test's own with JetStream, on a free port, stopped when dropped.
#[derive(Debug)]
pub struct PrivateServer {
    child: Child,
    pub port: u16,
}

impl PrivateServer {
    /// Starts `nats-server -js` on `port` (0: a free one) with its store in `dir`, and waits until
    /// it accepts connections.
    pub fn start(port: u16, dir: &Path) -> anyhow::Result<Self> {
        Self::start_with(port, dir, &[])
    }

    /// [`PrivateServer::start`] with more `nats-server` arguments (e.g. `--tlsverify ...`).
    pub fn start_with(port: u16, dir: &Path, extra: &[&str]) -> anyhow::Result<Self> {
        let port = if port == 0 { crate::free_tcp_port()? } else { port };
        let child = Command::new(server_binary())
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(dir)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting nats-server (Debian package nats-server)")?;
        let server = PrivateServer { child, port };
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            if Instant::now() > deadline {
                bail!("nats-server did not listen on port {port} within 10 s");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(server)
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits for it.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The `nats-server` binary: `EDGE_TEST_NATS_SERVER`, else the one on `PATH` or in `/usr/sbin`.
fn server_binary() -> String {
    if let Ok(p) = std::env::var("EDGE_TEST_NATS_SERVER") {
        return p;
    }
    if Path::new("/usr/sbin/nats-server").exists() { "/usr/sbin/nats-server".into() } else { "nats-server".into() }
}
