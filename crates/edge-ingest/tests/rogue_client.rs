//! A rogue client that sends malformed and oversized frames is refused with the exact close code
//! the protocol names, while the server keeps serving other agents.
//!
//! Everything is real: an in-process [`Server`] on 127.0.0.1 (ephemeral port) over QUIC with
//! mutual TLS, a file store in a temporary directory, and two device certificates from one
//! in-memory CA. The honest agent (`honest-1`) speaks `edge/1` through a real
//! [`ClientSession`]; the rogue (`rogue-1`, one fresh connection per attack) writes hand-made
//! bytes. The honest agent uploads before, during (concurrently with) and after the attacks, and
//! the store's export is the judge of what was persisted.
//!
//! No test sleeps to synchronise: each waits for an event (an ack, `Connection::closed`,
//! `SendStream::stopped`), and every wait is bounded by [`bounded`] so a hang fails the test.
//!
//! The test identities, chunks, honest agent and export checks are shared with `security.rs`, in
//! `common/mod.rs`.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::{
    Agent, Exported, HONEST, HONEST_SPOOL, ROGUE, ROGUE_SPOOL, SERVER_NAME, assert_closed_with, assert_exported_once,
    bounded, chunk, chunk_of, honest_chunks, localhost, new_pki, shut_down, start_server_with, write_unless_closed,
};
use edge_ingest::server::{Server, ServerCounters, ServerOptions};
use edge_ingest::store::{ExportReport, StoreHandle, StoreOptions};
use edge_proto::client::{ClientSession, EarlyLimits};
use edge_proto::{
    AckStatus, CHUNK_MAGIC, ChunkHeader, ControlFrame, ErrorCode, Limits, RejectReason, RetryReason, VERSION,
};
use edge_transport::{Tuning, client_config_from_pem, client_endpoint, server_config_from_pem, server_endpoint};
use quinn::{ConnectionError, Endpoint, RecvStream, SendStream, VarInt};
use tempfile::TempDir;

/// Short, so the timeout cases finish quickly; long enough for an honest Hello on a busy host.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_millis(500);
/// Upper bound of every wait in these tests (used by [`bounded`]).
const BOUND: Duration = Duration::from_secs(20);
/// How the test agents name themselves in Hello.
const AGENT: &str = "rogue-client-test";

// === The rogue's repertoire ===

/// One misbehaviour, each sent on its own connection with the rogue's certificate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Attack {
    /// Control frame header declaring a 1 GiB Hello body.
    OneGibControlFrame,
    /// Control frame of type 0x7f.
    UnknownFrameType,
    /// An HTTP request on the control stream.
    HttpGarbage,
    /// A version-1 Hello whose body ends inside `spool_id`.
    TruncatedHello,
    /// A Welcome, a frame only the server may send.
    WelcomeFromAgent,
    /// Two valid Hellos in a row.
    SecondHello,
    /// A well-formed Hello announcing the version after ours.
    FutureVersionHello,
    /// A Hello of the version after ours whose body this version cannot parse.
    FutureLayoutHello,
    /// After the handshake, a chunk stream that does not start with `EDGC`.
    BadChunkMagic,
    /// After the handshake, a chunk header declaring `max_chunk_payload + 1` payload bytes.
    OversizedChunkPayload,
    /// After the handshake, a chunk prefix with `header_len = max_chunk_header + 1`.
    OversizedChunkHeader,
    /// After the handshake, a chunk prefix with `header_len = u16::MAX`.
    MaxChunkHeaderLen,
    /// TLS handshake, then nothing at all: no control stream.
    SilentClient,
    /// Control stream opened with the first 3 bytes of a Hello, then nothing.
    StalledHello,
}

impl Attack {
    const ALL: [Attack; 14] = [
        Attack::OneGibControlFrame,
        Attack::UnknownFrameType,
        Attack::HttpGarbage,
        Attack::TruncatedHello,
        Attack::WelcomeFromAgent,
        Attack::SecondHello,
        Attack::FutureVersionHello,
        Attack::FutureLayoutHello,
        Attack::BadChunkMagic,
        Attack::OversizedChunkPayload,
        Attack::OversizedChunkHeader,
        Attack::MaxChunkHeaderLen,
        Attack::SilentClient,
        Attack::StalledHello,
    ];

    /// The spool an attack names once past Hello: one per attack, for they run at once, and a
    /// Hello closes the device's earlier connections from the same spool.
    fn spool(self) -> [u8; 16] {
        let at = Attack::ALL.iter().position(|&a| a == self).expect("in ALL");
        let mut spool = ROGUE_SPOOL;
        spool[0] = u8::try_from(at).expect("few attacks");
        spool
    }

    /// The close code `edge-proto` assigns to what the server detects (see `ProtoError::code`).
    fn expected_code(self) -> ErrorCode {
        match self {
            // `FrameDecoder` refuses the declared body length from the 5-byte header.
            Attack::OneGibControlFrame => ErrorCode::FrameTooLarge,
            // UnknownFrameType(0x7f), UnknownFrameType(b'G'), Truncated, UnexpectedFrame x2.
            Attack::UnknownFrameType
            | Attack::HttpGarbage
            | Attack::TruncatedHello
            | Attack::WelcomeFromAgent
            | Attack::SecondHello => ErrorCode::ProtocolViolation,
            // The session's version check, and the decoder's "unparseable future Hello" rule.
            Attack::FutureVersionHello | Attack::FutureLayoutHello => ErrorCode::UnsupportedVersion,
            // `ChunkHeader::decode`: BadMagic.
            Attack::BadChunkMagic => ErrorCode::ProtocolViolation,
            // `ChunkHeader::validate`: PayloadTooLarge, whose code is FrameTooLarge. The server
            // closes rather than answering `Rejected(TooLarge)`.
            Attack::OversizedChunkPayload => ErrorCode::FrameTooLarge,
            // `ChunkHeader::decode` refuses `header_len` from the 6-byte prefix.
            Attack::OversizedChunkHeader | Attack::MaxChunkHeaderLen => ErrorCode::FrameTooLarge,
            Attack::SilentClient | Attack::StalledHello => ErrorCode::HandshakeTimeout,
        }
    }

    /// Connects, misbehaves, and returns the connection with every stream still open, so that
    /// nothing but the server's reaction can end it.
    async fn launch(self, dialer: &Dialer) -> (quinn::Connection, Held) {
        let conn = dialer.connect().await;
        let mut held = Held::default();
        match self {
            Attack::OneGibControlFrame => {
                let mut frame = vec![0x01];
                frame.extend_from_slice(&(1u32 << 30).to_le_bytes());
                frame.extend_from_slice(&VERSION.to_le_bytes());
                frame.extend_from_slice(&ROGUE_SPOOL);
                held.control(&conn, &frame).await;
            }
            Attack::UnknownFrameType => held.control(&conn, &[0x7f, 4, 0, 0, 0, 1, 2, 3, 4]).await,
            Attack::HttpGarbage => held.control(&conn, b"GET / HTTP/1.1\r\nHost: ingest\r\n\r\n").await,
            Attack::TruncatedHello => {
                let mut frame = vec![0x01, 10, 0, 0, 0];
                frame.extend_from_slice(&VERSION.to_le_bytes());
                frame.extend_from_slice(&[0xaa; 8]);
                held.control(&conn, &frame).await;
            }
            Attack::WelcomeFromAgent => {
                let welcome = ControlFrame::Welcome {
                    version: VERSION,
                    device: ROGUE.into(),
                    max_chunk_payload: u32::MAX,
                    max_in_flight: u32::MAX,
                };
                held.control(&conn, &encode(&welcome)).await;
            }
            Attack::SecondHello => {
                let mut frames = hello(VERSION);
                frames.extend_from_slice(&hello(VERSION));
                held.control(&conn, &frames).await;
            }
            Attack::FutureVersionHello => held.control(&conn, &hello(VERSION + 1)).await,
            Attack::FutureLayoutHello => {
                let [lo, hi] = (VERSION + 1).to_le_bytes();
                held.control(&conn, &[0x01, 3, 0, 0, 0, lo, hi, 0xee]).await;
            }
            Attack::BadChunkMagic => {
                held.agent = Some(Agent::connect(&conn, self.spool(), AGENT).await);
                let mut bytes = b"EDGX".to_vec();
                bytes.extend_from_slice(&chunk("rogue.magic", 0).wire()[4..]);
                held.uni(&conn, &bytes).await;
            }
            Attack::OversizedChunkPayload => {
                held.agent = Some(Agent::connect(&conn, self.spool(), AGENT).await);
                let too_big = Limits::default().max_chunk_payload + 1;
                let header = ChunkHeader { raw_len: too_big, payload_len: too_big, ..chunk("rogue.big", 0).header };
                let mut bytes = Vec::new();
                header.encode(&mut bytes);
                bytes.extend_from_slice(&[0u8; 4096]);
                held.uni(&conn, &bytes).await;
            }
            Attack::OversizedChunkHeader | Attack::MaxChunkHeaderLen => {
                held.agent = Some(Agent::connect(&conn, self.spool(), AGENT).await);
                let header_len = if self == Attack::MaxChunkHeaderLen {
                    u16::MAX
                } else {
                    u16::try_from(Limits::default().max_chunk_header + 1).expect("default limit fits a u16")
                };
                let mut bytes = CHUNK_MAGIC.to_vec();
                bytes.extend_from_slice(&header_len.to_le_bytes());
                bytes.extend_from_slice(&[0x42; 64]);
                held.uni(&conn, &bytes).await;
            }
            Attack::SilentClient => {}
            Attack::StalledHello => held.control(&conn, &hello(VERSION)[..3]).await,
        }
        (conn, held)
    }

    /// Launches the attack and returns how the server ended the connection.
    async fn run(self, dialer: &Dialer) -> ConnectionError {
        let (conn, held) = bounded(&format!("{self:?}: connect and misbehave"), self.launch(dialer)).await;
        let closed = bounded(&format!("{self:?}: server closes the connection"), conn.closed()).await;
        drop(held);
        closed
    }
}

/// Streams an attack keeps open until the server reacts.
#[derive(Default)]
struct Held {
    agent: Option<Agent>,
    sends: Vec<SendStream>,
    recvs: Vec<RecvStream>,
}

impl Held {
    /// Opens the control stream and writes `bytes` on it.
    async fn control(&mut self, conn: &quinn::Connection, bytes: &[u8]) {
        let (mut send, recv) = conn.open_bi().await.expect("the server allows one control stream");
        write_unless_closed(&mut send, bytes).await;
        self.sends.push(send);
        self.recvs.push(recv);
    }

    /// Opens a chunk stream and writes `bytes` on it, without finishing it.
    async fn uni(&mut self, conn: &quinn::Connection, bytes: &[u8]) {
        let mut send = conn.open_uni().await.expect("the server allows chunk streams");
        write_unless_closed(&mut send, bytes).await;
        self.sends.push(send);
    }
}

// === The rig: PKI, server, store, client endpoint ===

/// How one device reaches the server.
#[derive(Clone)]
struct Dialer {
    endpoint: Endpoint,
    server: SocketAddr,
    config: quinn::ClientConfig,
}

impl Dialer {
    async fn connect(&self) -> quinn::Connection {
        let connecting =
            self.endpoint.connect_with(self.config.clone(), self.server, SERVER_NAME).expect("start connecting");
        connecting.await.expect("mutual TLS handshake succeeds")
    }
}

struct Rig {
    server: Server,
    store: StoreHandle,
    data: TempDir,
    honest: Dialer,
    rogue: Dialer,
}

impl Rig {
    async fn start() -> Rig {
        Rig::start_tuned(&Tuning::default(), &Tuning::default()).await
    }

    /// The server's transport from `server_tuning`, the rogue's from `rogue_tuning` (the honest
    /// agent's and the endpoints' sockets from the defaults).
    async fn start_tuned(server_tuning: &Tuning, rogue_tuning: &Tuning) -> Rig {
        Rig::start_with(server_tuning, rogue_tuning, |_| {}).await
    }

    /// [`Rig::start_tuned`] with the store's options changed by `store`.
    async fn start_with(server_tuning: &Tuning, rogue_tuning: &Tuning, store: impl FnOnce(&mut StoreOptions)) -> Rig {
        Rig::start_full(server_tuning, rogue_tuning, store, |_| {}).await
    }

    /// [`Rig::start_with`], with the server's options changed by `server` too.
    async fn start_full(
        server_tuning: &Tuning,
        rogue_tuning: &Tuning,
        store: impl FnOnce(&mut StoreOptions),
        server: impl FnOnce(&mut ServerOptions),
    ) -> Rig {
        let pki = new_pki();
        let tuning = Tuning::default();
        let server_config =
            server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, server_tuning)
                .expect("server config");
        let endpoint = server_endpoint(localhost(), server_config, &tuning).expect("server endpoint");
        let mut opts = ServerOptions {
            limits: Limits { handshake_timeout: HANDSHAKE_TIMEOUT, ..Limits::default() },
            shutdown_grace: Duration::from_secs(2),
            ..ServerOptions::default()
        };
        server(&mut opts);
        let (server, store, data) = start_server_with(endpoint, opts, store);
        let client = client_endpoint(localhost(), &tuning).expect("client endpoint");
        let dialer = |device: &str, tuning: &Tuning| {
            let (cert, key) = pki.issue_device(device).expect("issue device certificate");
            let config = client_config_from_pem(&cert, &key, &pki.ca_pem, tuning).expect("client config");
            Dialer { endpoint: client.clone(), server: server.local_addr(), config }
        };
        let honest = dialer(HONEST, &tuning);
        let rogue = dialer(ROGUE, rogue_tuning);
        Rig { server, store, data, honest, rogue }
    }

    async fn honest_agent(&self) -> Agent {
        bounded("honest agent connects", async {
            let conn = self.honest.connect().await;
            Agent::connect(&conn, HONEST_SPOOL, AGENT).await
        })
        .await
    }

    fn counters(&self) -> std::sync::Arc<ServerCounters> {
        self.server.counters()
    }

    /// Shuts the server and the store down and returns everything the store exports.
    async fn finish(self) -> (Vec<Exported>, ExportReport) {
        let result = shut_down(self.server, self.store, self.data.path()).await;
        self.honest.endpoint.close(VarInt::from_u32(0), b"test over");
        result
    }
}

fn encode(frame: &ControlFrame) -> Vec<u8> {
    let mut out = Vec::new();
    frame.encode(&mut out);
    out
}

fn hello(version: u16) -> Vec<u8> {
    encode(&ControlFrame::Hello { version, spool_id: ROGUE_SPOOL, agent: "rogue/0.0".into() })
}

// === Tests ===

/// One attack against a fresh server, with the honest agent uploading before, concurrently with,
/// and after it.
async fn attack_is_closed_while_the_honest_agent_keeps_storing(attack: Attack) {
    let rig = Rig::start().await;
    let mut agent = rig.honest_agent().await;
    let (before, during, after) = (honest_chunks(0..3), honest_chunks(3..6), honest_chunks(6..9));
    agent.upload_stored("upload before the attack", &before).await;

    let (closed, ()) = tokio::join!(attack.run(&rig.rogue), agent.upload_stored("upload during the attack", &during));
    assert_closed_with(&format!("{attack:?}"), &closed, attack.expected_code());

    agent.upload_stored("upload after the attack", &after).await;
    let counters = rig.counters();
    assert_eq!(counters.protocol_errors_total.load(Ordering::Relaxed), 1, "one rogue connection closed");
    assert_eq!(counters.chunks_stored_total.load(Ordering::Relaxed), 9);
    assert_eq!(counters.chunks_rejected_total.load(Ordering::Relaxed), 0);
    assert_eq!(counters.auth_failures_total.load(Ordering::Relaxed), 0);
    agent.close();

    let (exported, report) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &[before, during, after].concat());
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[]);
    assert_eq!(report.duplicate_entries, 0, "each chunk was written once");
    assert_eq!(report.corrupt, 0);
}

macro_rules! attack_tests {
    ($($name:ident => $attack:expr;)*) => {$(
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $name() {
            attack_is_closed_while_the_honest_agent_keeps_storing($attack).await;
        }
    )*};
}

attack_tests! {
    a_control_frame_declaring_one_gib_is_closed_with_frame_too_large => Attack::OneGibControlFrame;
    an_unknown_control_frame_type_is_closed_with_protocol_violation => Attack::UnknownFrameType;
    http_garbage_on_the_control_stream_is_closed_with_protocol_violation => Attack::HttpGarbage;
    a_truncated_hello_is_closed_with_protocol_violation => Attack::TruncatedHello;
    a_welcome_sent_by_the_agent_is_closed_with_protocol_violation => Attack::WelcomeFromAgent;
    a_second_hello_is_closed_with_protocol_violation => Attack::SecondHello;
    a_hello_with_an_unsupported_version_is_closed_with_unsupported_version => Attack::FutureVersionHello;
    a_future_hello_layout_is_closed_with_unsupported_version => Attack::FutureLayoutHello;
    a_chunk_header_with_bad_magic_is_closed_with_protocol_violation => Attack::BadChunkMagic;
    a_chunk_payload_over_the_limit_is_closed_with_frame_too_large_and_not_stored => Attack::OversizedChunkPayload;
    a_chunk_header_len_over_the_limit_is_closed_with_frame_too_large => Attack::OversizedChunkHeader;
    a_chunk_header_len_of_u16_max_is_closed_with_frame_too_large => Attack::MaxChunkHeaderLen;
    a_client_that_never_opens_the_control_stream_is_closed_with_handshake_timeout => Attack::SilentClient;
    a_hello_that_never_completes_is_closed_with_handshake_timeout => Attack::StalledHello;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_with_a_wrong_checksum_is_rejected_and_the_connection_stays_usable() {
    let rig = Rig::start().await;
    let mut honest = rig.honest_agent().await;
    let mut rogue = bounded("rogue connects", async {
        let conn = rig.rogue.connect().await;
        Agent::connect(&conn, ROGUE_SPOOL, AGENT).await
    })
    .await;
    let good = chunk("rogue.checksum", 0);
    let mut bad = good.clone();
    bad.payload[5] ^= 0xff; // Inside the first record; the header keeps the good checksum.

    let honest_batch = honest_chunks(0..3);
    let (statuses, ()) = tokio::join!(
        bounded("bad chunk is acked", rogue.upload(std::slice::from_ref(&bad))),
        honest.upload_stored("honest upload", &honest_batch)
    );
    assert_eq!(statuses, [AckStatus::Rejected(RejectReason::BadChecksum)]);

    // Same connection, same key, right bytes: stored, not a duplicate, so the rejected copy
    // never reached the store or its dedup index.
    let statuses = bounded("good chunk is acked", rogue.upload(std::slice::from_ref(&good))).await;
    assert_eq!(statuses, [AckStatus::Stored]);
    assert!(rogue.conn.close_reason().is_none(), "the connection is still open");

    let counters = rig.counters();
    assert_eq!(counters.chunks_rejected_total.load(Ordering::Relaxed), 1);
    assert_eq!(counters.chunks_stored_total.load(Ordering::Relaxed), 4);
    assert_eq!(counters.protocol_errors_total.load(Ordering::Relaxed), 0);
    rogue.close();
    honest.close();

    let (exported, report) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[good]);
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_batch);
    assert_eq!(report.duplicate_entries, 0);
}

/// Opens a chunk stream for `c` on `conn`, writes it whole and finishes it, and waits until the
/// server's QUIC stack has acknowledged every byte of it (not that the server read it).
async fn send_chunk_acked(conn: &quinn::Connection, c: &common::TestChunk) {
    let mut uni = conn.open_uni().await.expect("open a chunk stream");
    uni.write_all(&c.wire()).await.expect("write the chunk");
    uni.finish().expect("finish the chunk stream once");
    let stopped = bounded("the chunk's bytes are acknowledged", uni.stopped()).await;
    assert_eq!(stopped.ok(), Some(None), "the server took the stream's bytes without stopping it");
}

/// An agent may send chunks right behind its Hello, within the limits of an earlier Welcome, and
/// QUIC does not order streams against each other: chunk streams that reach the server before
/// the Hello wait for it and are stored once it comes. Here the Hello is sent only after the
/// server's QUIC stack has every byte of the chunks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_streams_sent_before_hello_wait_for_it_and_are_stored() {
    let rig = Rig::start().await;
    let conn = bounded("agent connects", rig.rogue.connect()).await;
    let early = [chunk("early", 0), chunk("early", 1), chunk("early", 2)];
    let limits = EarlyLimits { max_in_flight: 64, max_chunk_payload: Limits::default().max_chunk_payload };
    let mut session = ClientSession::resume(ROGUE_SPOOL, AGENT.into(), Limits::default(), Instant::now(), limits);
    for c in &early {
        session.chunk_sent(&c.header.stream, c.header.seq).expect("within the early limits");
        send_chunk_acked(&conn, c).await;
    }
    let (send, recv) = conn.open_bi().await.expect("open the control stream");
    let mut agent = Agent { conn: conn.clone(), send, recv, session, device: String::new(), acks: HashMap::new() };
    agent.flush().await;
    let statuses = bounded("early chunks are acked", async {
        let mut statuses = Vec::new();
        for c in &early {
            while !agent.acks.contains_key(&c.key()) {
                agent.read_control().await;
            }
            statuses.extend(agent.acks.remove(&c.key()));
        }
        statuses
    })
    .await;
    assert_eq!(statuses, [AckStatus::Stored; 3]);
    assert_eq!(agent.device, ROGUE, "the Welcome came first");
    // The connection goes on as any other.
    agent.upload_stored("a chunk after the Welcome", &[chunk("early", 3)]).await;
    assert_eq!(rig.counters().protocol_errors_total.load(Ordering::Relaxed), 0);
    agent.close();

    let (exported, report) = rig.finish().await;
    let all: Vec<_> = (0..4).map(|seq| chunk("early", seq)).collect();
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &all);
    assert_eq!(report.duplicate_entries, 0);
}

/// Chunk streams with no Hello at all are held, not stored, and the connection ends at the
/// handshake deadline as one without any stream does. (Before chunk streams could wait for the
/// Hello, the server closed with `ProtocolViolation` on the first one.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunk_streams_without_a_hello_are_held_until_the_handshake_timeout_and_not_stored() {
    let rig = Rig::start().await;
    let conn = bounded("rogue connects", rig.rogue.connect()).await;
    for seq in 0..2 {
        send_chunk_acked(&conn, &chunk("rogue.early", seq)).await;
    }
    let closed = bounded("server closes at its handshake deadline", conn.closed()).await;
    assert_closed_with("chunks and no Hello", &closed, ErrorCode::HandshakeTimeout);
    let counters = rig.counters();
    assert_eq!(counters.early_chunk_streams_total.load(Ordering::Relaxed), 2, "both were held");
    assert_eq!(counters.chunks_stored_total.load(Ordering::Relaxed), 0);

    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[]);
}

/// The server holds at most its `max_in_flight` chunk streams before the Hello; one more is a
/// protocol violation, as it would be after the Welcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_chunk_streams_before_hello_than_max_in_flight_is_a_protocol_violation() {
    let rig = Rig::start().await;
    let max = ServerOptions::default().max_in_flight;
    let conn = bounded("rogue connects", rig.rogue.connect()).await;
    let mut held = Held::default();
    for seq in 0..=u64::from(max) {
        held.uni(&conn, &chunk("rogue.flood", seq).wire()).await;
    }
    let closed = bounded("server refuses the extra stream", conn.closed()).await;
    assert_closed_with("one chunk stream over max_in_flight before Hello", &closed, ErrorCode::ProtocolViolation);
    let counters = rig.counters();
    assert_eq!(counters.early_chunk_streams_total.load(Ordering::Relaxed), u64::from(max));
    assert_eq!(counters.protocol_errors_total.load(Ordering::Relaxed), 1);
    drop(held);

    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_attack_at_once_is_refused_while_an_honest_agent_keeps_storing() {
    let rig = Rig::start().await;
    let mut honest = rig.honest_agent().await;
    let mut uploaded = honest_chunks(0..4);
    honest.upload_stored("upload before the storm", &uploaded).await;

    // Every attack on its own connection, all at once, plus a rogue whose chunk is rejected.
    let mut storm = tokio::task::JoinSet::new();
    for attack in Attack::ALL {
        let dialer = rig.rogue.clone();
        storm.spawn(async move { (attack, attack.run(&dialer).await) });
    }
    let checksum_rogue = {
        let dialer = rig.rogue.clone();
        tokio::spawn(async move {
            let conn = dialer.connect().await;
            // A spool of its own: the attacks' Hellos would close a connection from theirs.
            let mut spool = ROGUE_SPOOL;
            spool[0] = 0xcc;
            let mut rogue = Agent::connect(&conn, spool, AGENT).await;
            let mut bad = chunk("rogue.checksum", 7);
            bad.header.checksum ^= 1;
            let statuses = rogue.upload(&[bad]).await;
            rogue.close();
            statuses
        })
    };
    // Upload a small batch alongside each attack's end, until every attack has been answered.
    let mut next_seq = 4;
    let mut closes = Vec::new();
    while closes.len() < Attack::ALL.len() {
        let batch = honest_chunks(next_seq..next_seq + 2);
        next_seq += 2;
        let (joined, ()) = tokio::join!(
            bounded("an attack ends", storm.join_next()),
            honest.upload_stored("upload during the storm", &batch)
        );
        closes.push(joined.expect("an attack is still running").expect("the attack task does not panic"));
        uploaded.extend(batch);
    }
    let statuses = bounded("checksum rogue", checksum_rogue).await.expect("the checksum rogue does not panic");
    assert_eq!(statuses, [AckStatus::Rejected(RejectReason::BadChecksum)]);
    for (attack, closed) in &closes {
        assert_closed_with(&format!("{attack:?}"), closed, attack.expected_code());
    }
    let after = honest_chunks(next_seq..next_seq + 4);
    honest.upload_stored("upload after the storm", &after).await;
    uploaded.extend(after);

    let counters = rig.counters();
    assert_eq!(
        counters.protocol_errors_total.load(Ordering::Relaxed),
        Attack::ALL.len() as u64,
        "every rogue connection closed for a violation is counted once"
    );
    assert_eq!(counters.chunks_rejected_total.load(Ordering::Relaxed), 1);
    assert_eq!(counters.chunks_stored_total.load(Ordering::Relaxed), uploaded.len() as u64);
    assert_eq!(counters.auth_failures_total.load(Ordering::Relaxed), 0);
    honest.close();

    let (exported, report) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &uploaded);
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[]);
    assert_eq!(report.duplicate_entries, 0, "each chunk was written once");
    assert_eq!(report.corrupt, 0);
}

/// A rogue that declares maximum-size payloads and then stalls must not starve other agents.
///
/// A connection that opens `memory_budget / max_chunk_payload + 1` maximum-size chunk streams
/// (17 with the defaults) and then stalls can hold only its own share of the payload memory
/// budget, so another agent's chunks are still received and acked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_stalling_max_size_chunks_does_not_starve_other_agents() {
    let rig = Rig::start().await;
    let mut honest = rig.honest_agent().await;
    let (conn, _rogue) = bounded("rogue connects", async {
        let conn = rig.rogue.connect().await;
        let rogue = Agent::connect(&conn, ROGUE_SPOOL, AGENT).await;
        (conn, rogue)
    })
    .await;
    let opts = ServerOptions::default();
    let max = opts.limits.max_chunk_payload;
    let stalled = opts.memory_budget / u64::from(max) + 1;
    let mut held = Held::default();
    for seq in 0..stalled {
        // A valid header: one record of `max` bytes; only the header is ever sent.
        let header = ChunkHeader { raw_len: max, payload_len: max, records: 1, ..chunk("rogue.stall", seq).header };
        let mut bytes = Vec::new();
        header.encode(&mut bytes);
        bounded("rogue opens a stalled chunk stream", held.uni(&conn, &bytes)).await;
    }
    // A healthy server acks a small chunk in milliseconds; allow far more before calling it
    // starved. The first uploads may still overtake the rogue's headers.
    for seq in 0..20 {
        let batch = honest_chunks(seq..seq + 1);
        match tokio::time::timeout(Duration::from_secs(5), honest.upload(&batch)).await {
            Ok(statuses) => assert_eq!(statuses, [AckStatus::Stored], "honest chunk {seq}"),
            Err(_) => panic!("honest chunk {seq} got no ack within 5 s while {stalled} rogue chunk streams stall"),
        }
    }
    drop(held);
    honest.close();
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_chunks(0..20));
}

/// The same rogue spreading its stalled chunks over many connections of its one certificate
/// (an eighth of the server's budget is a device's share, over all of its connections): the
/// honest agent is not starved either.
#[tokio::test]
async fn a_rogue_stalling_chunks_over_many_connections_does_not_starve_other_agents() {
    let rig = Rig::start().await;
    let mut honest = rig.honest_agent().await;
    let opts = ServerOptions::default();
    let max = opts.limits.max_chunk_payload;
    // Each connection alone may hold a device's share: two maximum-size chunks. Nine of them
    // would hold more than the whole server's budget.
    let per_conn = (opts.memory_budget / 8 / u64::from(max)).max(1);
    let conns = 9;
    assert!(conns * per_conn * u64::from(max) > opts.memory_budget);
    let mut held = Vec::new();
    for c in 0..conns {
        // A spool of its own per connection: a Hello from the same spool closes the
        // connections before it (see the test below).
        let mut spool = ROGUE_SPOOL;
        spool[0] = u8::try_from(c).expect("few connections");
        let (conn, rogue) = bounded("rogue connects", async {
            let conn = rig.rogue.connect().await;
            let rogue = Agent::connect(&conn, spool, AGENT).await;
            (conn, rogue)
        })
        .await;
        let mut streams = Held::default();
        for seq in 0..per_conn {
            let header = ChunkHeader {
                raw_len: max,
                payload_len: max,
                records: 1,
                ..chunk("rogue.stall", c * 100 + seq).header
            };
            let mut bytes = Vec::new();
            header.encode(&mut bytes);
            bounded("rogue opens a stalled chunk stream", streams.uni(&conn, &bytes)).await;
        }
        held.push((conn, rogue, streams));
    }
    for seq in 0..20 {
        let batch = honest_chunks(seq..seq + 1);
        match tokio::time::timeout(Duration::from_secs(5), honest.upload(&batch)).await {
            Ok(statuses) => assert_eq!(statuses, [AckStatus::Stored], "honest chunk {seq}"),
            Err(_) => panic!("honest chunk {seq} got no ack within 5 s while {conns} rogue connections stall"),
        }
    }
    drop(held);
    honest.close();
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_chunks(0..20));
}

/// An agent's new connection (after an address change without migration, say) closes its
/// earlier one from the same spool, whose chunk streams stalled after their headers and hold the
/// device's whole share of the payload budget: the new connection's chunk is stored at once,
/// not answered `Retry` until the old one's idle timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_connection_of_an_agent_closes_its_old_one_and_gets_the_devices_budget() {
    let rig = Rig::start().await;
    let connect = || async {
        let conn = rig.rogue.connect().await;
        let agent = Agent::connect(&conn, ROGUE_SPOOL, AGENT).await;
        (conn, agent)
    };
    let (old, _old_agent) = bounded("the agent connects", connect()).await;
    let opts = ServerOptions::default();
    let max = opts.limits.max_chunk_payload;
    let share = (opts.memory_budget / 8 / u64::from(max)).max(1);
    let mut stalled = Held::default();
    for seq in 0..share {
        let header = ChunkHeader { raw_len: max, payload_len: max, records: 1, ..chunk("agent.stalled", seq).header };
        let mut bytes = Vec::new();
        header.encode(&mut bytes);
        bounded("a chunk stream stalls after its header", stalled.uni(&old, &bytes)).await;
    }
    let (_new, mut agent) = bounded("the agent connects again", connect()).await;
    let closed = bounded("the old connection closed", old.closed()).await;
    assert!(
        matches!(&closed, ConnectionError::ApplicationClosed(c) if c.reason.as_ref() == b"superseded by a newer connection of the same agent"),
        "{closed:?}"
    );
    assert_eq!(rig.counters().superseded_total.load(Ordering::Relaxed), 1);
    let fresh = chunk("agent.after", 0);
    agent.upload_stored("the new connection's chunk", std::slice::from_ref(&fresh)).await;
    drop(stalled);
    agent.close();
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[fresh]);
}

/// A device that numbers its chunks sparsely opens gaps in its part of the dedup index until it
/// reaches the store's cap; from there its chunks that would open one more (neither neighbour
/// stored) are answered Retry(Overloaded) and not stored, on a connection that stays open,
/// while its chunks that start a stream or join its ranges are stored and another device is not
/// affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_numbering_sparsely_is_refused_new_gaps_at_its_index_cap() {
    const CAP: u64 = 4;
    let rig = Rig::start_with(&Tuning::default(), &Tuning::default(), |o| o.max_index_gaps_per_device = CAP).await;
    let mut honest = rig.honest_agent().await;
    let mut rogue = bounded("rogue connects", async {
        let conn = rig.rogue.connect().await;
        Agent::connect(&conn, ROGUE_SPOOL, AGENT).await
    })
    .await;
    // Seq 0 starts the stream, every other seq after it opens a gap: CAP of them.
    let sparse: Vec<_> = (0..=CAP).map(|i| chunk("rogue.sparse", 2 * i)).collect();
    rogue.upload_stored("a chunk every other seq, up to the cap", &sparse).await;
    let (beyond, other_gap) = (chunk("rogue.sparse", 2 * CAP + 2), chunk("rogue.other", 5));
    let other_first = chunk("rogue.other", 0);
    rogue.upload_stored("a new stream's first chunk", std::slice::from_ref(&other_first)).await;
    let retry = AckStatus::Retry(RetryReason::Overloaded);
    let past_cap = [beyond.clone(), other_gap];
    let honest_batch = honest_chunks(0..CAP + 2);
    let (statuses, ()) = tokio::join!(
        bounded("chunks past the cap", rogue.upload(&past_cap)),
        honest.upload_stored("honest upload", &honest_batch)
    );
    assert_eq!(statuses, [retry, retry]);
    // Seq 1 joins two of the device's ranges: stored, and there is room again.
    let joining = chunk("rogue.sparse", 1);
    rogue.upload_stored("a chunk that fills a gap", std::slice::from_ref(&joining)).await;
    rogue.upload_stored("the refused chunk again", std::slice::from_ref(&beyond)).await;
    assert!(rogue.conn.close_reason().is_none(), "the connection is still open");
    assert_eq!(rig.counters().chunks_retry_total.load(Ordering::Relaxed), 2);
    assert_eq!(rig.store.stats().index_refused, 2);
    rogue.close();
    honest.close();

    let (exported, _) = rig.finish().await;
    let mut stored = sparse;
    stored.extend([other_first, joining, beyond]);
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &stored);
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_batch);
}

/// A device that names a new stream per chunk reaches the store's cap on streams; from there its
/// chunks of new streams are answered Retry(Limit) and not stored, on a connection that
/// stays open, while its known streams go on and another device is not affected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_naming_a_stream_per_chunk_is_refused_new_streams_at_its_cap() {
    const CAP: u64 = 4;
    let rig = Rig::start_with(&Tuning::default(), &Tuning::default(), |o| o.max_index_streams_per_device = CAP).await;
    let mut honest = rig.honest_agent().await;
    let mut rogue = bounded("rogue connects", async {
        let conn = rig.rogue.connect().await;
        Agent::connect(&conn, ROGUE_SPOOL, AGENT).await
    })
    .await;
    let streams: Vec<_> = (0..CAP).map(|i| chunk(&format!("rogue.s{i}"), 0)).collect();
    rogue.upload_stored("one chunk in each of CAP streams", &streams).await;
    let retry = AckStatus::Retry(RetryReason::Limit);
    let past_cap = [chunk("rogue.new", 0), chunk("rogue.newer", 0)];
    let honest_batch = honest_chunks(0..CAP + 2);
    let (statuses, ()) = tokio::join!(
        bounded("chunks of new streams past the cap", rogue.upload(&past_cap)),
        honest.upload_stored("honest upload", &honest_batch)
    );
    assert_eq!(statuses, [retry, retry]);
    let known = chunk("rogue.s0", 1);
    rogue.upload_stored("a known stream's next chunk", std::slice::from_ref(&known)).await;
    assert!(rogue.conn.close_reason().is_none(), "the connection is still open");
    assert_eq!(rig.counters().chunks_retry_total.load(Ordering::Relaxed), 2);
    assert_eq!(rig.store.stats().index_refused, 2);
    rogue.close();
    honest.close();

    let (exported, _) = rig.finish().await;
    let mut stored = streams;
    stored.push(known);
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &stored);
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_batch);
}

/// A Hello that comes on an older connection after a newer one's (late, on a path the agent has
/// left) closes that older connection, not the agent's live one, which goes on storing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_hello_on_an_older_connection_closes_that_one_not_the_newer() {
    let rig = Rig::start().await;
    let old = bounded("an older connection", rig.rogue.connect()).await;
    let (new, mut agent) = bounded("the agent's connection", async {
        let conn = rig.rogue.connect().await;
        let agent = Agent::connect(&conn, ROGUE_SPOOL, AGENT).await;
        (conn, agent)
    })
    .await;
    let mut late = Held::default();
    bounded("the late Hello", late.control(&old, &hello(VERSION))).await;
    let closed = bounded("the older connection closed", old.closed()).await;
    assert!(
        matches!(&closed, ConnectionError::ApplicationClosed(c) if c.reason.as_ref() == b"superseded by a newer connection of the same agent"),
        "{closed:?}"
    );
    assert_eq!(rig.counters().superseded_total.load(Ordering::Relaxed), 1);
    let live = chunk("agent.live", 0);
    agent.upload_stored("the newer connection's chunk", std::slice::from_ref(&live)).await;
    assert!(new.close_reason().is_none(), "{:?}", new.close_reason());
    drop(late);
    agent.close();
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[live]);
}

/// An agent that does its Hello and then never reads its control stream, while it keeps sending
/// cheap chunks (empty, with a wrong checksum: answered `Rejected`, the connection stays open),
/// is closed with `ProtocolViolation` once the acks waiting for it pass the server's limit
/// (`ack_backlog_limit`: 64 KiB with the default `max_in_flight` of 64), instead of growing the
/// server's memory for as long as it goes on. The chunk it had stored stays stored, and the
/// honest agent is not disturbed.
///
/// The rogue gives the server a flow-control window of 1 KiB on its control stream, so the
/// server's writes wait after 1 KiB and the rest queues. The server lets an agent have 8 chunk
/// streams open (it frees a stream once it has answered its chunk), so the rogue never has more
/// chunks in flight than the Welcome allows and only the backlog can end its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_never_reads_its_acks_is_closed_once_they_pass_the_limit() {
    /// The server's limit with `ServerOptions::default().max_in_flight` (64 x 1 KiB).
    const BACKLOG_LIMIT: usize = 64 * 1024;
    const WINDOW: usize = 1024;
    const STREAM: &str = "rogue.does-not-read.acks.padded.to.the.longest.stream.name.xxxxx";
    assert_eq!(ServerOptions::default().max_in_flight, 64);
    let server_tuning = Tuning { max_concurrent_uni_streams: 8, ..Tuning::default() };
    let rogue_tuning = Tuning { stream_receive_window: WINDOW as u64, ..Tuning::default() };
    let rig = Rig::start_tuned(&server_tuning, &rogue_tuning).await;
    let mut honest = rig.honest_agent().await;
    let before = honest_chunks(0..3);
    honest.upload_stored("upload before the rogue", &before).await;

    let flood = |seq: u64| {
        let mut c = chunk_of(STREAM, seq, "", 0, 0);
        c.header.checksum = edge_proto::crc32c(&[]) ^ 1;
        c
    };
    let mut ack = Vec::new();
    ControlFrame::Ack {
        stream: flood(1).header.stream,
        seq: 1,
        status: AckStatus::Rejected(RejectReason::BadChecksum),
    }
    .encode(&mut ack);
    assert_eq!(ack.len(), 79, "the longest ack frame");
    // Acks the server has queued, past the window, when it passes its limit; the rogue may be a
    // few chunk streams ahead of the server. Twice that is the most the test lets it send.
    let to_limit = (BACKLOG_LIMIT + WINDOW).div_ceil(ack.len()) + 1;
    let most = 2 * to_limit;

    let conn = bounded("rogue connects", rig.rogue.connect()).await;
    // Kept open and never read.
    let (mut control, _unread) = conn.open_bi().await.expect("open the control stream");
    write_unless_closed(&mut control, &hello(VERSION)).await;
    let kept = chunk("rogue.kept", 0);
    let (sent, closed) = bounded("the rogue floods until the server closes its connection", async {
        let mut sent = 0;
        let mut wire = kept.wire();
        loop {
            if sent == most {
                // Not closed yet: the server may still be reading the last chunks.
                return (sent, conn.closed().await);
            }
            let opened = tokio::select! {
                biased;
                closed = conn.closed() => return (sent, closed),
                opened = conn.open_uni() => opened,
            };
            let Ok(mut uni) = opened else { return (sent, conn.closed().await) };
            write_unless_closed(&mut uni, &wire).await;
            let _closed = uni.finish();
            sent += 1;
            wire = flood(sent as u64).wire();
        }
    })
    .await;
    assert_closed_with("a rogue that never reads its acks", &closed, ErrorCode::ProtocolViolation);
    let ConnectionError::ApplicationClosed(close) = &closed else { unreachable!("checked above") };
    let reason = String::from_utf8_lossy(&close.reason);
    assert!(reason.contains("does not read its acks"), "close reason: {reason}");
    assert!(
        sent > BACKLOG_LIMIT / ack.len() && sent < most,
        "the server closed after {sent} chunks; expected between {} and {most}",
        BACKLOG_LIMIT / ack.len()
    );

    let after = honest_chunks(3..6);
    honest.upload_stored("upload after the rogue", &after).await;
    let counters = rig.counters();
    assert_eq!(counters.protocol_errors_total.load(Ordering::Relaxed), 1, "the rogue's connection");
    let rejected = counters.chunks_rejected_total.load(Ordering::Relaxed);
    assert!(rejected as usize >= BACKLOG_LIMIT / ack.len() && (rejected as usize) < sent, "{rejected} of {sent}");
    honest.close();
    drop(control);

    let (exported, report) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &[before, after].concat());
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[kept]);
    assert_eq!(report.duplicate_entries, 0);
}

/// An agent sends its stream's floor when a chunk is answered Retry, and the floor is that
/// chunk's seq at most. A floor no refusal on the connection vouches for (an agent's bug) would
/// make the store count seqs never sent as stored, and answer them Duplicate: it is ignored,
/// and a floor under a refused seq is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_above_every_refused_seq_of_its_stream_is_ignored() {
    let rig = Rig::start_with(&Tuning::default(), &Tuning::default(), |o| o.max_index_gaps_per_device = 1).await;
    let mut rogue = bounded("rogue connects", async {
        let conn = rig.rogue.connect().await;
        Agent::connect(&conn, ROGUE_SPOOL, AGENT).await
    })
    .await;
    let stream = edge_proto::StreamName::new("rogue.floor").expect("name");
    let floor = |agent: &mut Agent, seq: u64| {
        assert_eq!(agent.session.floor(&stream, seq), Ok(true), "floor queued");
    };
    // Before any refusal: nothing vouches for it.
    floor(&mut rogue, 1_000);
    bounded("flush", rogue.flush()).await;
    let first = [chunk("rogue.floor", 0), chunk("rogue.floor", 2)];
    rogue.upload_stored("the stream's start and its one gap", &first).await;
    let refused = chunk("rogue.floor", 4);
    let statuses = bounded("a chunk past the cap", rogue.upload(std::slice::from_ref(&refused))).await;
    assert_eq!(statuses, [AckStatus::Retry(RetryReason::Overloaded)]);
    // Above the refused seq: ignored. At it: applied, in order, after the other.
    floor(&mut rogue, 100);
    floor(&mut rogue, 4);
    bounded("flush", rogue.flush()).await;
    bounded("the floor at the refused seq applied", async {
        while rig.store.stats().index_floors == 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    assert_eq!(rig.store.stats().index_floors, 1, "one floor applied, the other two ignored");
    // Seqs 4 and 6 were never stored: with a floor of 1,000 or 100 they would be answered
    // Duplicate, and their records lost.
    let after = [refused, chunk("rogue.floor", 6)];
    rogue.upload_stored("the refused chunk again, and one past it", &after).await;
    rogue.close();

    let (exported, _) = rig.finish().await;
    let mut stored = first.to_vec();
    stored.extend(after);
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &stored);
}

/// A chunk whose payload stops coming, on a connection kept alive, holds its share of the
/// memory budget only for `payload_stall`, not until its deadline for the whole payload (ten
/// seconds and a second per 16 KiB: 74 s for this one): it is answered Retry, and the rest of
/// the payload, if it came, would not be read. A chunk that keeps coming, slowly, is read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunk_whose_payload_stops_coming_is_answered_retry_after_the_stall_limit() {
    let rig = Rig::start_full(
        &Tuning::default(),
        &Tuning::default(),
        |_| {},
        |o| {
            o.payload_stall = Duration::from_millis(300);
        },
    )
    .await;
    let (conn, mut rogue) = bounded("rogue connects", async {
        let conn = rig.rogue.connect().await;
        let rogue = Agent::connect(&conn, ROGUE_SPOOL, AGENT).await;
        (conn, rogue)
    })
    .await;
    let len: u32 = 1 << 20;
    let header = ChunkHeader { raw_len: len, payload_len: len, records: 1, ..chunk("rogue.pause", 0).header };
    let mut bytes = Vec::new();
    header.encode(&mut bytes);
    bytes.extend_from_slice(&len.saturating_sub(4).to_le_bytes());
    bytes.extend_from_slice(&[7; 1000]);
    rogue.session.chunk_sent(&header.stream, header.seq).expect("window has room");
    let mut held = Held::default();
    bounded("a chunk stream that stops after 1,004 payload bytes", held.uni(&conn, &bytes)).await;
    let key = (header.stream.clone(), header.seq);
    let status = bounded("the answer to the stalled chunk", rogue.answer(&key)).await;
    assert_eq!(status, AckStatus::Retry(RetryReason::Overloaded));
    assert_eq!(rig.counters().chunks_retry_total.load(Ordering::Relaxed), 1);

    // Slow but steady: a piece every 100 ms, under the stall limit, is read to the end.
    let slow = chunk_of("rogue.slow", 0, "slow", 4, 1000);
    rogue.session.chunk_sent(&slow.header.stream, slow.header.seq).expect("window has room");
    let wire = slow.wire();
    let mut send = conn.open_uni().await.expect("chunk stream");
    for piece in wire.chunks(wire.len() / 5 + 1) {
        send.write_all(piece).await.expect("write a piece");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    send.finish().expect("finish");
    let status = bounded("the answer to the slow chunk", rogue.answer(&slow.key())).await;
    assert_eq!(status, AckStatus::Stored, "slow pieces inside the stall limit");
    drop(held);
    rogue.close();
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[slow]);
}
