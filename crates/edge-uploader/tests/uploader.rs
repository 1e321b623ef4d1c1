//! The uploader against scripted servers: a real quinn endpoint with the test's in-memory PKI
//! plays the ingest side just far enough to provoke one behaviour. Tests await events (a
//! connection, a stream, the uploader's end) and never sleep; every wait is bounded so a
//! regression fails instead of hanging.

use std::collections::HashSet;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use edge_proto::server::ServerSession;
use edge_proto::{AckStatus, ChunkHeader, Limits};
use edge_spool::{AppendOutcome, AppendRequest, Batch, ChunkId, Spool, SpoolOptions};
use edge_transport::Tuning;
use edge_transport::pki::InMemoryPki;
use edge_uploader::config::Compression;
use edge_uploader::spool_task::{ReaderHandle, SpoolHandle, SpoolThread};
use edge_uploader::uploader::{UploadCounters, UploaderOptions};
use tokio_util::sync::CancellationToken;

const DEVICE: &str = "uploader-test";
const STREAM: &str = "s";

async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not happen within 30 s"))
}

fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A running uploader's task.
type Uploading = tokio::task::JoinHandle<anyhow::Result<()>>;

/// The agent side: a spool with one sealed chunk, and the device's TLS client config.
struct AgentSide {
    dir: tempfile::TempDir,
    spool: SpoolHandle,
    reader: ReaderHandle,
    thread: SpoolThread,
    client_config: quinn::ClientConfig,
    /// What the uploader tells the spool it has in flight.
    in_flight: edge_spool::ChunksInFlight,
}

impl AgentSide {
    /// A spool holding one sealed chunk of at least `bytes` payload bytes on [`STREAM`].
    fn new(pki: &InMemoryPki, bytes: usize) -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let (mut spool, _report) = Spool::open(SpoolOptions::new(dir.path().join("spool.db"))).expect("open spool");
        let (mut data, mut records) = (Vec::new(), 0);
        while data.len() < bytes {
            edge_proto::records::encode_record(&mut data, &[b'x'; 1000]);
            records += 1;
        }
        let req = AppendRequest { batches: vec![Batch { stream: STREAM.into(), data, records }] };
        assert_eq!(spool.append(&[req], 1).expect("append"), vec![AppendOutcome::Accepted]);
        assert_eq!(spool.seal_all(1).expect("seal"), 1, "one chunk sealed");
        let reader = ReaderHandle::new(spool.reader().expect("reader"));
        let in_flight = spool.chunks_in_flight();
        let (spool, thread) = SpoolHandle::spawn(spool).expect("spool thread");
        let (cert, key) = pki.issue_device(DEVICE).expect("device certificate");
        let client_config = edge_transport::client_config_from_pem(&cert, &key, &pki.ca_pem, &Tuning::default())
            .expect("client config");
        AgentSide { dir, spool, reader, thread, client_config, in_flight }
    }

    fn options(&self, server: SocketAddr) -> UploaderOptions {
        UploaderOptions {
            server: server.to_string(),
            server_name: "localhost".into(),
            tls: Arc::new(edge_uploader::client_tls::ClientTls::fixed(self.client_config.clone())),
            bind: localhost(),
            max_in_flight: Arc::new(AtomicU32::new(8)),
            max_in_flight_bytes: Arc::new(AtomicU64::new(4 << 20)),
            backoff_min: Duration::from_millis(10),
            backoff_max: Duration::from_millis(50),
            compression: Compression::None,
            limits: Limits::default(),
            drain_grace: Duration::from_secs(20),
            tuning: Tuning::default(),
            connect_timeout: Duration::from_secs(5),
            early_chunks: true,
            network: None,
            probe_interval: None,
        }
    }

    /// Starts the uploader with `opts` against this side's spool.
    fn spawn(&self, opts: UploaderOptions) -> (Arc<UploadCounters>, CancellationToken, Uploading) {
        let counters = Arc::new(UploadCounters::default());
        let cancel = CancellationToken::new();
        let uploader = tokio::spawn(edge_uploader::uploader::run(
            opts,
            self.spool.clone(),
            self.reader.clone(),
            counters.clone(),
            cancel.clone(),
        ));
        (counters, cancel, uploader)
    }

    /// Stops the spool thread and lists the sealed chunks left in the file.
    fn sealed_left(self) -> usize {
        self.left().0
    }

    /// Stops the spool thread and counts the sealed chunks left in the file and the quarantined
    /// ones.
    fn left(self) -> (usize, u64) {
        let AgentSide { dir, spool, reader, thread, .. } = self;
        drop((spool, reader));
        thread.join();
        let (spool, _report) = Spool::open(SpoolOptions::new(dir.path().join("spool.db"))).expect("reopen spool");
        let sealed = spool.reader().expect("reader").sealed_after(None, 100).expect("list").len();
        (sealed, spool.stats().quarantined_chunks)
    }
}

fn server(pki: &InMemoryPki, tuning: &Tuning, addr: SocketAddr) -> quinn::Endpoint {
    let config = edge_transport::server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, tuning)
        .expect("server config");
    edge_transport::server_endpoint(addr, config, tuning).expect("server endpoint")
}

/// Accepts the agent's control stream and answers its Hello.
async fn welcome(conn: &quinn::Connection) -> (quinn::SendStream, ServerSession) {
    let (mut send, mut recv) = bounded("control stream", conn.accept_bi()).await.expect("control stream");
    let mut session = ServerSession::new(DEVICE.into(), Limits::default(), 16, Instant::now());
    let mut buf = vec![0u8; 4096];
    while !session.is_established() {
        let n = bounded("Hello", recv.read(&mut buf)).await.expect("read control").expect("control stream open");
        session.handle_control_bytes(Instant::now(), &buf[..n]).expect("valid Hello");
    }
    flush(&mut send, &mut session).await;
    // The agent sends nothing more on it; keep the receive side open by leaking it into a task.
    tokio::spawn(async move {
        let mut buf = [0u8; 64];
        while let Ok(Some(_)) = recv.read(&mut buf).await {}
    });
    (send, session)
}

async fn flush(send: &mut quinn::SendStream, session: &mut ServerSession) {
    while let Some(bytes) = session.poll_transmit() {
        send.write_all(&bytes).await.expect("write control");
    }
}

/// One agent with one sealed chunk, its uploader running, connected to a scripted server.
struct Rig {
    agent: AgentSide,
    _endpoint: quinn::Endpoint,
    conn: quinn::Connection,
    counters: Arc<UploadCounters>,
    cancel: CancellationToken,
    uploader: Uploading,
}

impl Rig {
    /// The sealed chunk holds at least `chunk_bytes`; the server runs with `tuning`.
    async fn start(chunk_bytes: usize, tuning: &Tuning) -> Self {
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        let agent = AgentSide::new(&pki, chunk_bytes);
        let endpoint = server(&pki, tuning, localhost());
        let addr = endpoint.local_addr().expect("server address");
        let (counters, cancel, uploader) = agent.spawn(agent.options(addr));
        let conn = bounded("connection", async { endpoint.accept().await.expect("endpoint open").await })
            .await
            .expect("handshake");
        Rig { agent, _endpoint: endpoint, conn, counters, cancel, uploader }
    }

    /// A 256 KiB chunk and a server whose stream window is 64 KiB: the agent cannot have
    /// finished the chunk's stream when the server stops it, so the stop always reaches it.
    async fn for_stops() -> Self {
        Rig::start(256 << 10, &Tuning { stream_receive_window: 64 << 10, ..Tuning::default() }).await
    }

    /// Takes the chunk offered again on a new stream and acks it `Stored`, then shuts the
    /// uploader down (it drains: it returns only once the ack was processed) and checks that
    /// the one chunk was stored over the one connection and left the spool.
    async fn store_the_resent_chunk(self, ctl: &mut quinn::SendStream, session: &mut ServerSession) {
        let mut again = bounded("the chunk offered again", self.conn.accept_uni()).await.expect("chunk stream");
        let bytes = bounded("chunk bytes", again.read_to_end(1 << 20)).await.expect("whole chunk");
        let (header, consumed) =
            ChunkHeader::decode(&bytes, &Limits::default()).expect("valid header").expect("complete header");
        assert_eq!((header.stream.as_str(), header.seq), (STREAM, 1));
        assert_eq!(bytes.len() - consumed, header.payload_len as usize, "the whole payload came");
        session.accept_chunk(&header).expect("within the window and not in flight any more");
        session.ack(&header.stream, header.seq, AckStatus::Stored).expect("ack");
        flush(ctl, session).await;

        self.cancel.cancel();
        bounded("uploader end", self.uploader).await.expect("uploader task").expect("uploader ran");
        assert_eq!(self.counters.connects_total.load(Ordering::Relaxed), 1, "one connection throughout");
        assert_eq!(self.counters.stored.chunks(), 1);
        assert_eq!(self.agent.sealed_left(), 0, "the acked chunk left the spool");
    }
}

#[tokio::test]
async fn a_chunk_whose_stream_the_server_stopped_is_sent_again_on_the_same_connection() {
    let rig = Rig::for_stops().await;
    let conn = rig.conn.clone();
    let (mut ctl, mut session) = welcome(&conn).await;

    let mut first = bounded("first chunk stream", conn.accept_uni()).await.expect("chunk stream");
    first.stop(7u32.into()).expect("stop the stream");
    drop(first);

    // The connection lives on; the same chunk must come again on a new stream.
    rig.store_the_resent_chunk(&mut ctl, &mut session).await;
}

/// The spool learns which chunks are in flight (`drop_oldest` spares them while it can), and
/// that none is once the connection ended.
#[tokio::test]
async fn the_spool_is_told_which_chunks_are_in_flight() {
    let rig = Rig::start(1000, &Tuning::default()).await;
    let conn = rig.conn.clone();
    let (mut ctl, mut session) = welcome(&conn).await;
    let mut stream = bounded("the chunk", conn.accept_uni()).await.expect("chunk stream");
    assert!(rig.agent.in_flight.contains(ChunkId(1)), "a chunk on its way is not in the spool's set");
    let bytes = bounded("chunk bytes", stream.read_to_end(1 << 20)).await.expect("whole chunk");
    let (header, _) = ChunkHeader::decode(&bytes, &Limits::default()).expect("valid header").expect("complete");
    session.accept_chunk(&header).expect("in the window");
    session.ack(&header.stream, header.seq, AckStatus::Stored).expect("ack");
    flush(&mut ctl, &mut session).await;
    rig.cancel.cancel();
    bounded("uploader end", rig.uploader).await.expect("uploader task").expect("uploader ran");
    assert_eq!(rig.counters.stored.chunks(), 1);
    assert!(!rig.agent.in_flight.contains(ChunkId(1)), "an acked chunk is still in the spool's set");
}

#[tokio::test]
async fn a_chunk_stopped_with_stop_answered_waits_for_its_ack_before_it_is_sent_again() {
    let rig = Rig::for_stops().await;
    let conn = rig.conn.clone();
    let (mut ctl, mut session) = welcome(&conn).await;

    // The ingest's slow-payload path: accept the chunk, stop its stream with STOP_ANSWERED, and
    // answer Retry on the control stream, here late (as on a lossy link).
    let mut first = bounded("first chunk stream", conn.accept_uni()).await.expect("chunk stream");
    let mut head = Vec::new();
    let header = loop {
        let got = bounded("chunk header", first.read_chunk(4096, true)).await.expect("read").expect("open");
        head.extend_from_slice(&got.bytes);
        if let Some((header, _)) = ChunkHeader::decode(&head, &Limits::default()).expect("valid header") {
            break header;
        }
    };
    session.accept_chunk(&header).expect("chunk within the window");
    first.stop(edge_proto::STOP_ANSWERED.into()).expect("stop the stream");
    drop(first);

    // Until the ack comes, the agent must not offer the chunk again: the server still has it in
    // flight, and a second stream for it would be a protocol violation. Its retry backoff is
    // 10–50 ms, so a second stream would come well within this window.
    let early = tokio::time::timeout(Duration::from_secs(1), conn.accept_uni()).await;
    assert!(early.is_err(), "the agent sent the chunk again before its ack: {early:?}");
    session.ack(&header.stream, header.seq, AckStatus::Retry(edge_proto::RetryReason::Overloaded)).expect("ack");
    flush(&mut ctl, &mut session).await;

    rig.store_the_resent_chunk(&mut ctl, &mut session).await;
}

/// The destination connection id of the next QUIC v1 Initial packet that reaches `socket`.
async fn next_initial(socket: &tokio::net::UdpSocket) -> Vec<u8> {
    let mut buf = vec![0u8; 2048];
    loop {
        let (n, _from) = socket.recv_from(&mut buf).await.expect("receive");
        if let Some(dcid) = initial_dcid(&buf[..n]) {
            return dcid.to_vec();
        }
    }
}

/// The destination connection id of a QUIC v1 Initial packet, `None` for anything else.
fn initial_dcid(datagram: &[u8]) -> Option<&[u8]> {
    let (&first, rest) = datagram.split_first()?;
    // Long header, packet type Initial (0b00), version 1.
    if first & 0x80 == 0 || (first >> 4) & 0b11 != 0 || rest.get(..4)? != [0, 0, 0, 1] {
        return None;
    }
    let len = usize::from(*rest.get(4)?);
    rest.get(5..5 + len)
}

#[tokio::test]
async fn after_an_outage_the_agent_connects_within_two_fresh_attempts() {
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    let agent = AgentSide::new(&pki, 1000);
    // The outage: the server's address answers nothing. The test reads what arrives there.
    let blackhole = tokio::net::UdpSocket::bind(localhost()).await.expect("bind blackhole");
    let addr = blackhole.local_addr().expect("blackhole address");
    let mut opts = agent.options(addr);
    opts.connect_timeout = Duration::from_secs(1);
    let (counters, cancel, uploader) = agent.spawn(opts);

    // Each attempt is a new connection with its own destination connection id; an attempt
    // left to run would only retransmit its Initial (same id) with a growing interval.
    let mut attempts_seen: HashSet<Vec<u8>> = HashSet::new();
    bounded("three abandoned connection attempts", async {
        while attempts_seen.len() < 3 {
            attempts_seen.insert(next_initial(&blackhole).await);
        }
    })
    .await;

    // The server comes back on the same address.
    let before = counters.connect_attempts_total.load(Ordering::Relaxed);
    assert!(before >= 3, "the agent counted {before} attempts, the wire showed {}", attempts_seen.len());
    drop(blackhole);
    let endpoint = server(&pki, &Tuning::default(), addr);
    let conn = bounded("a connection after the outage", async {
        loop {
            // An Initial of an abandoned attempt may still be in flight; its handshake fails.
            if let Ok(conn) = endpoint.accept().await.expect("endpoint open").await {
                break conn;
            }
        }
    })
    .await;
    let after = counters.connect_attempts_total.load(Ordering::Relaxed);
    // The attempt under way when the server came back either reaches it or is abandoned
    // after connect_timeout; the next one finds the server unless it started just before the
    // server did and lost its first Initial.
    assert!(after - before <= 2, "{} attempts after the server came back", after - before);

    cancel.cancel();
    conn.close(0u32.into(), b"test over");
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
    assert_eq!(counters.connects_total.load(Ordering::Relaxed), 1);
}

#[tokio::test]
async fn a_link_coming_up_ends_the_backoff_wait() {
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    let agent = AgentSide::new(&pki, 1000);
    let blackhole = tokio::net::UdpSocket::bind(localhost()).await.expect("bind blackhole");
    let addr = blackhole.local_addr().expect("blackhole address");
    let (net, events) = edge_uploader::netwatch::NetEvents::manual();
    let mut opts = agent.options(addr);
    opts.connect_timeout = Duration::from_secs(1);
    // Without the wake-up the second attempt would come 5 to 10 minutes after the first.
    opts.backoff_min = Duration::from_secs(600);
    opts.backoff_max = Duration::from_secs(600);
    opts.network = Some(events);
    let (counters, cancel, uploader) = agent.spawn(opts);
    let first = bounded("the first attempt", next_initial(&blackhole)).await;
    // The link comes up while the first attempt still runs: the wait after it ends at once.
    net.send_modify(|n| *n += 1);
    bounded("a second attempt, right after the first one failed", async {
        while next_initial(&blackhole).await == first {}
    })
    .await;
    assert_eq!(counters.network_wakeups_total.load(Ordering::Relaxed), 1);
    assert_eq!(counters.connect_attempts_total.load(Ordering::Relaxed), 2);
    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
}

/// The next probe (`edge_uploader::probe`) that arrives at `socket`: its sender and datagram.
async fn next_probe(socket: &tokio::net::UdpSocket) -> (SocketAddr, Vec<u8>) {
    let mut buf = vec![0u8; 2048];
    loop {
        let (n, from) = socket.recv_from(&mut buf).await.expect("receive");
        if buf[..n].get(1..5) == Some(&edge_uploader::probe::RESERVED_VERSION.to_be_bytes()[..]) {
            assert_eq!(n, edge_uploader::probe::PROBE_BYTES, "a probe is a full-size datagram");
            return (from, buf[..n].to_vec());
        }
    }
}

/// A Version Negotiation answering `probe`, as a server lays it out: the probe's IDs swapped,
/// QUIC version 1 listed.
fn version_negotiation(probe: &[u8]) -> Vec<u8> {
    let dcid = &probe[6..14];
    let scid = &probe[15..23];
    let mut a = vec![0xc0, 0, 0, 0, 0, 8];
    a.extend_from_slice(scid);
    a.push(8);
    a.extend_from_slice(dcid);
    a.extend_from_slice(&1u32.to_be_bytes());
    a
}

/// Options whose backoff alone would keep a second attempt 5 to 10 minutes away, with 1 s
/// attempts and a probe every second.
fn probing(agent: &AgentSide, addr: SocketAddr) -> UploaderOptions {
    let mut opts = agent.options(addr);
    opts.connect_timeout = Duration::from_secs(1);
    opts.backoff_min = Duration::from_secs(600);
    opts.backoff_max = Duration::from_secs(600);
    opts.probe_interval = Some(Duration::from_secs(1));
    opts
}

#[tokio::test]
async fn a_server_answering_a_probe_ends_the_backoff_wait() {
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    let agent = AgentSide::new(&pki, 1000);
    // The server is down and its address answers nothing.
    let blackhole = tokio::net::UdpSocket::bind(localhost()).await.expect("bind blackhole");
    let addr = blackhole.local_addr().expect("blackhole address");
    let (counters, cancel, uploader) = agent.spawn(probing(&agent, addr));
    bounded("the first attempt", next_initial(&blackhole)).await;
    // The attempt got no answer: the wait after it probes, from a socket of its own.
    let (from, _probe) = bounded("a probe", next_probe(&blackhole)).await;
    assert_ne!(from.port(), 0);
    assert_eq!(counters.connect_attempts_total.load(Ordering::Relaxed), 1, "no attempt but the first");
    // The server comes back on the same address: a real quinn endpoint answers the next probe,
    // and the attempt that follows connects.
    drop(blackhole);
    let endpoint = server(&pki, &Tuning::default(), addr);
    let conn = bounded("a connection long before the backoff's 5 minutes", async {
        loop {
            if let Ok(conn) = endpoint.accept().await.expect("endpoint open").await {
                break conn;
            }
        }
    })
    .await;
    assert_eq!(counters.probe_wakeups_total.load(Ordering::Relaxed), 1);
    assert!(counters.probes_sent_total.load(Ordering::Relaxed) >= 2, "the unanswered probe and the answered one");
    assert_eq!(counters.connect_attempts_total.load(Ordering::Relaxed), 2);
    cancel.cancel();
    conn.close(0u32.into(), b"test over");
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
}

#[tokio::test]
async fn a_server_that_answers_probes_but_not_handshakes_gets_the_backoff_alone() {
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    let agent = AgentSide::new(&pki, 1000);
    // Something at the server's address answers probes and swallows Initials.
    let odd = tokio::net::UdpSocket::bind(localhost()).await.expect("bind");
    let addr = odd.local_addr().expect("address");
    let (counters, cancel, uploader) = agent.spawn(probing(&agent, addr));
    bounded("the first attempt", next_initial(&odd)).await;
    let (from, probe) = bounded("a probe", next_probe(&odd)).await;
    odd.send_to(&version_negotiation(&probe), from).await.expect("answer the probe");
    bounded("the attempt the answer started", next_initial(&odd)).await;
    assert_eq!(counters.probe_wakeups_total.load(Ordering::Relaxed), 1);
    // That attempt gets no answer either (1 s): from then on the 10-minute backoff alone.
    let sent = bounded("the second attempt's end", async {
        while !counters.last_error().is_some_and(|e| e.contains("no handshake")) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        counters.probes_sent_total.load(Ordering::Relaxed)
    })
    .await;
    // An observation window of three probe intervals, in which a probe would have gone out
    // (the second attempt's resent Initials may still arrive; they are not probes).
    let quiet = tokio::time::timeout(Duration::from_secs(3), next_probe(&odd)).await;
    if let Ok((from, _)) = quiet {
        panic!("a probe arrived from {from} after probing should have stopped");
    }
    assert_eq!(counters.probes_sent_total.load(Ordering::Relaxed), sent);
    assert_eq!(counters.connect_attempts_total.load(Ordering::Relaxed), 2);
    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
}

#[tokio::test]
async fn a_refusing_server_is_not_probed() {
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    let agent = AgentSide::new(&pki, 1000);
    let endpoint = server(&pki, &Tuning::default(), localhost());
    let addr = endpoint.local_addr().expect("server address");
    let (counters, cancel, uploader) = agent.spawn(probing(&agent, addr));
    // The server answers the attempt with a refusal: something answered, so no probing.
    bounded("the attempt", endpoint.accept()).await.expect("endpoint open").refuse();
    bounded("the refusal reaching the agent", async {
        while counters.last_error().is_none() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let error = counters.last_error().unwrap_or_default();
    assert!(!error.contains("no handshake"), "{error}");
    // Three probe intervals, in which a probe would have been sent.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(counters.probes_sent_total.load(Ordering::Relaxed), 0);
    assert_eq!(counters.connect_attempts_total.load(Ordering::Relaxed), 1);
    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
}

/// Takes the next chunk stream whole, checks its payload against its header's length and
/// CRC-32C, acks it `Stored`, and returns the payload.
async fn store_next_chunk(
    conn: &quinn::Connection,
    ctl: &mut quinn::SendStream,
    session: &mut ServerSession,
) -> Vec<u8> {
    let mut stream = bounded("a chunk stream", conn.accept_uni()).await.expect("chunk stream");
    let bytes = bounded("chunk bytes", stream.read_to_end(4 << 20)).await.expect("whole chunk");
    let (header, consumed) =
        ChunkHeader::decode(&bytes, &Limits::default()).expect("valid header").expect("complete header");
    let payload = bytes[consumed..].to_vec();
    assert_eq!(payload.len(), header.payload_len as usize, "the whole payload came");
    assert_eq!(edge_proto::crc32c(&payload), header.checksum, "chunk {} checksum", header.seq);
    session.accept_chunk(&header).expect("within the window");
    session.ack(&header.stream, header.seq, AckStatus::Stored).expect("ack");
    flush(ctl, session).await;
    payload
}

/// `n` framed records of `size` bytes in a buffer of `capacity` bytes, as the intake hands them.
fn records(n: u32, size: usize, capacity: usize, seed: u8) -> Batch {
    let mut data = Vec::with_capacity(capacity);
    for r in 0..n {
        let body: Vec<u8> = (0..size).map(|i| (i as u8).wrapping_mul(seed).wrapping_add(r as u8)).collect();
        edge_proto::records::encode_record(&mut data, &body);
    }
    Batch { stream: STREAM.into(), data, records: n }
}

#[tokio::test]
async fn chunks_sealed_while_the_uploader_keeps_up_are_sent_from_memory_as_the_spool_holds_them() {
    let Rig { agent, _endpoint, conn, counters, cancel, uploader } = Rig::start(10 << 10, &Tuning::default()).await;
    let (mut ctl, mut session) = welcome(&conn).await;

    // The chunk sealed before the agent started is read from the spool.
    store_next_chunk(&conn, &mut ctl, &mut session).await;
    assert_eq!(counters.chunks_from_memory.load(Ordering::Relaxed), 0);
    // Having read the spool through, the uploader follows the seals.
    bounded("the uploader following the seals", async {
        while !agent.spool.handoff().following() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;

    // Chunks of several shapes: one full buffer, small records in mostly empty buffers (shrunk
    // when kept), and records appended in two commits (one chunk, or two if the idle uploader
    // had the first commit sealed at once).
    let shapes: Vec<Vec<Vec<Batch>>> = vec![
        vec![vec![records(10, 10_000, 0, 3)]],
        vec![vec![records(1, 10_000, 64 << 10, 5), records(1, 3_000, 64 << 10, 7), records(2, 100, 64 << 10, 9)]],
        vec![vec![records(3, 5_000, 0, 11)], vec![records(1, 20_000, 64 << 10, 13), records(4, 7, 0, 17)]],
    ];
    let mut chunks = 1;
    for commits in shapes {
        let mut expected = Vec::new();
        for batches in commits {
            expected.extend(batches.iter().flat_map(|b| b.data.iter().copied()));
            agent.spool.append(AppendRequest { batches }).await.expect("append");
        }
        agent.spool.seal_all().await;
        let mut got = Vec::new();
        while got.len() < expected.len() {
            got.extend(store_next_chunk(&conn, &mut ctl, &mut session).await);
            chunks += 1;
        }
        assert_eq!(got, expected, "the chunks carry the appended records in order");
        assert_eq!(
            counters.chunks_from_memory.load(Ordering::Relaxed),
            chunks - 1,
            "every chunk since the first from memory"
        );
    }

    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
    assert_eq!(counters.stored.chunks(), chunks);
    assert_eq!(agent.sealed_left(), 0, "every acked chunk left the spool");
}

/// A seal handed over after the uploader read its chunk from the spool (the sync that makes a
/// seal durable lets readers list the chunk before the seal is handed over) is not sent again.
#[tokio::test]
async fn a_chunk_handed_over_after_it_was_read_from_the_spool_is_not_sent_again() {
    let Rig { agent, _endpoint, conn, counters, cancel, uploader } = Rig::start(10 << 10, &Tuning::default()).await;
    let (mut ctl, mut session) = welcome(&conn).await;
    let first = store_next_chunk(&conn, &mut ctl, &mut session).await;
    bounded("the ack taken and the seals followed", async {
        while counters.stored.chunks() < 1 || !agent.spool.handoff().following() {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
    })
    .await;
    // The late hand-over of chunk 1, with its bytes, then a new chunk.
    let meta = edge_spool::ChunkMeta {
        id: ChunkId(1),
        stream: STREAM.into(),
        seq: 1,
        records: 1,
        bytes: first.len() as u64,
        first_ms: 1,
        sealed_ms: 1,
    };
    let crc32c = edge_proto::crc32c(&first);
    let late = edge_uploader::handoff::Payload::from(edge_spool::ChunkPayload { data: first, crc32c });
    agent.spool.handoff().sealed(vec![(meta, Some(late))]);
    agent.spool.append(AppendRequest { batches: vec![records(1, 1_000, 0, 3)] }).await.expect("append");
    agent.spool.seal_all().await;
    let mut stream = bounded("the next chunk stream", conn.accept_uni()).await.expect("chunk stream");
    let bytes = bounded("chunk bytes", stream.read_to_end(1 << 20)).await.expect("whole chunk");
    let (header, _) = ChunkHeader::decode(&bytes, &Limits::default()).expect("valid header").expect("complete");
    assert_eq!(header.seq, 2, "chunk 1 was sent again");
    session.accept_chunk(&header).expect("in the window");
    session.ack(&header.stream, header.seq, AckStatus::Stored).expect("ack");
    flush(&mut ctl, &mut session).await;
    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
    assert_eq!(counters.stored.chunks(), 2);
    assert_eq!(agent.sealed_left(), 0);
}

/// Records that came while the agent was disconnected wait in open batches (no chunk is sealed
/// by `linger` while none could be sent); the reconnection seals them and sends them right
/// behind its Hello, before the server has answered it.
#[tokio::test]
async fn records_that_came_during_an_outage_go_behind_the_next_hello() {
    let Rig { agent, _endpoint: endpoint, conn, counters, cancel, uploader } =
        Rig::start(10 << 10, &Tuning::default()).await;
    let (mut ctl, mut session) = welcome(&conn).await;
    store_next_chunk(&conn, &mut ctl, &mut session).await;
    // The ack reached the spool (the chunk is gone), then the connection ends.
    let deadline = Instant::now() + Duration::from_secs(30);
    while agent.spool.stats().sealed_chunks != 0 {
        assert!(Instant::now() < deadline, "the ack never reached the spool");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    conn.close(0u32.into(), b"outage");
    // The uploader noticed: it takes no seals now. (Its next attempt waits in the server's
    // queue until accepted below.)
    while counters.connected.load(Ordering::Acquire) {
        assert!(Instant::now() < deadline, "the uploader never noticed the closed connection");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let req = AppendRequest { batches: vec![records(3, 100, 300, 7)] };
    agent.spool.append(req).await.expect("append during the outage");
    assert_eq!(agent.spool.stats().sealed_chunks, 0, "not sealed while no connection takes chunks");

    let conn = bounded("a new connection", async { endpoint.accept().await.expect("endpoint open").await })
        .await
        .expect("handshake");
    let early = next_chunk_header(&conn).await;
    assert_eq!(
        (early.stream.as_str(), early.seq, early.records),
        (STREAM, 2, 3),
        "the outage's records, before the Welcome"
    );

    cancel.cancel();
    conn.close(0u32.into(), b"done");
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
}

/// Reads the next chunk stream whole and returns its header.
async fn next_chunk_header(conn: &quinn::Connection) -> ChunkHeader {
    let mut stream = bounded("a chunk stream", conn.accept_uni()).await.expect("chunk stream");
    let bytes = bounded("chunk bytes", stream.read_to_end(4 << 20)).await.expect("whole chunk");
    let (header, _) = ChunkHeader::decode(&bytes, &Limits::default()).expect("valid header").expect("complete header");
    header
}

/// A server that took the agent's Welcome once lets it send its first chunks right behind the
/// next connection's Hello: here the chunk stream of the second connection comes before the
/// server answers that Hello at all. A connection that ends before any ack after such chunks
/// (here closed with ProtocolViolation, as a server that does not take them would) makes the
/// next connection wait for its Welcome again.
#[tokio::test]
async fn a_reconnection_sends_its_first_chunk_before_the_welcome_unless_the_last_such_one_failed() {
    let Rig { agent, _endpoint: endpoint, conn, counters, cancel, uploader } =
        Rig::start(10 << 10, &Tuning::default()).await;
    let accept = || async {
        bounded("a new connection", async { endpoint.accept().await.expect("endpoint open").await })
            .await
            .expect("handshake")
    };

    // 1. A fresh agent knows no limits: it waits for the Welcome, then sends the chunk, which
    // the server reads and leaves unacked: the connection ends.
    let (_ctl, _session) = welcome(&conn).await;
    assert_eq!(next_chunk_header(&conn).await.seq, 1);
    conn.close(0u32.into(), b"gone before the ack");

    // 2. The reconnection sends the chunk again, before any Welcome. The server refuses it.
    let conn = accept().await;
    let early = next_chunk_header(&conn).await;
    assert_eq!((early.stream.as_str(), early.seq), (STREAM, 1), "the unacked chunk, before the Welcome");
    conn.close(edge_proto::ErrorCode::ProtocolViolation.to_u32().into(), b"chunk stream before Hello");

    // 3. The next connection waits for the Welcome: nothing comes before the server answers.
    let conn = accept().await;
    let (mut ctl, mut recv) = bounded("control stream", conn.accept_bi()).await.expect("control stream");
    let mut session = ServerSession::new(DEVICE.into(), Limits::default(), 16, Instant::now());
    let mut buf = vec![0u8; 4096];
    while !session.is_established() {
        let n = bounded("Hello", recv.read(&mut buf)).await.expect("read control").expect("control stream open");
        session.handle_control_bytes(Instant::now(), &buf[..n]).expect("valid Hello");
    }
    // The other steps above wait for events; this one shows an absence, within a bound far
    // above what the chunk took to come in step 2.
    let before_welcome = tokio::time::timeout(Duration::from_secs(1), conn.accept_uni()).await;
    assert!(before_welcome.is_err(), "a chunk came before the Welcome: {before_welcome:?}");
    flush(&mut ctl, &mut session).await;
    store_next_chunk(&conn, &mut ctl, &mut session).await;

    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
    assert_eq!(counters.connects_total.load(Ordering::Relaxed), 3);
    assert_eq!(counters.stored.chunks(), 1);
    assert_eq!(agent.sealed_left(), 0, "the acked chunk left the spool");
}

/// A chunk of more records than the ingest takes (one a spool sealed under a larger
/// `spool.chunk_target` than the agent allows now) is quarantined rather than sent: the ingest
/// would close the connection over its header, on every connection, and nothing behind it would
/// ever be delivered.
#[tokio::test]
async fn a_chunk_of_more_records_than_the_ingest_takes_is_quarantined_and_the_next_one_goes() {
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    // One sealed chunk of 11 records of 1000 bytes.
    let agent = AgentSide::new(&pki, 10 << 10);
    let endpoint = server(&pki, &Tuning::default(), localhost());
    let mut opts = agent.options(endpoint.local_addr().expect("server address"));
    opts.limits.max_records_per_chunk = 5;
    let (counters, cancel, uploader) = agent.spawn(opts);
    let conn = bounded("connection", async { endpoint.accept().await.expect("endpoint open").await })
        .await
        .expect("handshake");
    let (mut ctl, mut session) = welcome(&conn).await;
    let behind = records(3, 100, 0, 7);
    let expected = behind.data.clone();
    agent.spool.append(AppendRequest { batches: vec![behind] }).await.expect("append");
    agent.spool.seal_all().await;

    let got = store_next_chunk(&conn, &mut ctl, &mut session).await;
    assert_eq!(got, expected, "the first chunk to come is the one within the limit");
    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
    assert_eq!(counters.stored.chunks(), 1);
    assert_eq!(agent.left(), (0, 1), "the stored chunk left the spool, the other one is quarantined");
}

/// Accepts the agent's control stream and reads its Hello; returns the streams and its version.
async fn hello_version(conn: &quinn::Connection) -> (quinn::SendStream, quinn::RecvStream, u16) {
    let (send, mut recv) = bounded("control stream", conn.accept_bi()).await.expect("control stream");
    let mut got = Vec::new();
    let mut buf = vec![0u8; 4096];
    loop {
        if let Some((frame, _)) = edge_proto::ControlFrame::decode(&got, &Limits::default()).expect("a valid frame") {
            let edge_proto::ControlFrame::Hello { version, .. } = frame else { panic!("not a Hello: {frame:?}") };
            return (send, recv, version);
        }
        let n = bounded("Hello", recv.read(&mut buf)).await.expect("read control").expect("control stream open");
        got.extend_from_slice(&buf[..n]);
    }
}

/// An ingest older than the agent closes its connection with `UnsupportedVersion`: the next
/// connection speaks the version before, refused again the one before that, and is welcomed in
/// it; the one after that tries the newest again (the ingest may have been upgraded meanwhile).
#[tokio::test]
async fn an_agent_refused_for_its_version_speaks_the_older_one_next_and_the_newest_after_that() {
    use edge_proto::{ErrorCode, MIN_VERSION, VERSION};
    let Rig { agent: _agent, _endpoint: endpoint, conn, counters, cancel, uploader } =
        Rig::start(1000, &Tuning::default()).await;
    let accept = || async {
        bounded("a new connection", async { endpoint.accept().await.expect("endpoint open").await })
            .await
            .expect("handshake")
    };
    let (_send, _recv, version) = hello_version(&conn).await;
    assert_eq!(version, VERSION, "the first Hello speaks the newest version");
    conn.close(ErrorCode::UnsupportedVersion.to_u32().into(), b"unsupported protocol version");

    // Each refusal: the version before, down to the oldest.
    let mut conn = accept().await;
    for older in (MIN_VERSION + 1..VERSION).rev() {
        let (_send, _recv, version) = hello_version(&conn).await;
        assert_eq!(version, older, "refused: the next Hello speaks the version before");
        conn.close(ErrorCode::UnsupportedVersion.to_u32().into(), b"unsupported protocol version");
        conn = accept().await;
    }
    let (mut send, mut recv, version) = hello_version(&conn).await;
    assert_eq!(version, MIN_VERSION, "refused: the next Hello speaks the older version");
    // Welcomed in it (this server speaks both), the agent stores its chunk.
    let hello = {
        let mut h = Vec::new();
        edge_proto::ControlFrame::Hello { version, spool_id: [0; 16], agent: "a".into() }.encode(&mut h);
        h
    };
    let mut session = ServerSession::new(DEVICE.into(), Limits::default(), 16, Instant::now());
    session.handle_control_bytes(Instant::now(), &hello).expect("version 1 is spoken");
    flush(&mut send, &mut session).await;
    tokio::spawn(async move {
        let mut buf = [0u8; 64];
        while let Ok(Some(_)) = recv.read(&mut buf).await {}
    });
    store_next_chunk(&conn, &mut send, &mut session).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    while counters.stored.chunks() != 1 {
        assert!(Instant::now() < deadline, "the ack of version 1 never reached the agent");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    conn.close(0u32.into(), b"outage");

    let conn = accept().await;
    let (_send, _recv, version) = hello_version(&conn).await;
    assert_eq!(version, VERSION, "after a connection in the older version, the newest again");
    cancel.cancel();
    conn.close(0u32.into(), b"done");
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
}

/// Every log line at info level and above, as written.
fn logs() -> &'static std::sync::Mutex<Vec<u8>> {
    static LOGS: std::sync::OnceLock<std::sync::Mutex<Vec<u8>>> = std::sync::OnceLock::new();
    LOGS.get_or_init(std::sync::Mutex::default)
}

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        logs().lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The log lines containing `needle`.
fn log_lines(needle: &str) -> usize {
    let text = String::from_utf8_lossy(&logs().lock().unwrap_or_else(std::sync::PoisonError::into_inner)).into_owned();
    text.lines().filter(|l| l.contains(needle)).count()
}

/// An ingest that refuses the device's certificate (here, of a CA it does not trust) ends each
/// connection right after the agent's side of the handshake completed, with the TLS alert. The
/// agent warns of it once, not at every retry, and not as a mere "connection ended".
#[tokio::test]
async fn a_refused_device_certificate_is_warned_of_once_not_at_every_retry() {
    let _already = tracing_subscriber::fmt()
        .with_writer(|| LogWriter)
        .with_ansi(false)
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .try_init();
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    let agent = AgentSide::new(&pki, 1000);
    // The server's certificate is one the agent trusts; the devices it trusts are another CA's.
    let other = InMemoryPki::generate(&["localhost"]).expect("another pki");
    let config = edge_transport::server_config_from_pem(
        &pki.server_cert_pem,
        &pki.server_key_pem,
        &other.ca_pem,
        &Tuning::default(),
    )
    .expect("server config");
    let endpoint = edge_transport::server_endpoint(localhost(), config, &Tuning::default()).expect("server endpoint");
    let addr = endpoint.local_addr().expect("server address");
    let (attempts, mut attempted) = tokio::sync::mpsc::unbounded_channel();
    let server = tokio::spawn(async move {
        while let Some(incoming) = endpoint.accept().await {
            let _ = attempts.send(());
            // The server's side of the handshake fails on the device's certificate.
            assert!(incoming.await.is_err(), "a device certificate of an untrusted CA was accepted");
        }
    });
    let (counters, cancel, uploader) = agent.spawn(agent.options(addr));
    // The agent starts an attempt only once it has dealt with the end of the one before: after
    // the fourth begins, three refusals were handled.
    for n in 1..=4 {
        bounded(&format!("connection attempt {n}"), attempted.recv()).await.expect("server running");
    }
    cancel.cancel();
    bounded("uploader end", uploader).await.expect("uploader task").expect("uploader ran");
    server.abort();
    assert!(counters.connects_total.load(Ordering::Relaxed) >= 3, "the client's handshakes completed");
    assert_eq!(log_lines("the TLS handshake was refused"), 1, "warned of once");
    assert_eq!(log_lines("connection ended"), 0, "the repeats are debug lines");
    assert!(counters.last_error().is_some_and(|e| !e.is_empty()), "status names the error");
}
