//! Helpers shared by `rogue_client.rs` and `security.rs`: the test identities, chunks, the honest
//! agent driving a real [`ClientSession`], starting and stopping a server with a file store, and
//! judging what the store exports.
//!
//! Every wait is bounded by [`bounded`], with the `BOUND` the including test file defines at its
//! root, so a hang fails the test.

use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::path::Path;
use std::time::Instant;

use edge_ingest::server::{Server, ServerOptions};
use edge_ingest::store::{ChunkKey, ExportFilter, ExportReport, Store, StoreHandle, StoreOptions, export};
use edge_proto::client::{ClientEvent, ClientSession};
use edge_proto::records::encode_record;
use edge_proto::{AckStatus, ChunkHeader, Codec, ErrorCode, Limits, StreamName};
use edge_transport::pki::InMemoryPki;
use quinn::{ConnectionError, Endpoint, RecvStream, SendStream, VarInt, WriteError};
use tempfile::TempDir;

use crate::BOUND;

pub const SERVER_NAME: &str = "localhost";
pub const HONEST: &str = "honest-1";
pub const ROGUE: &str = "rogue-1";
pub const HONEST_SPOOL: [u8; 16] = [0x11; 16];
pub const ROGUE_SPOOL: [u8; 16] = [0x66; 16];
pub const HONEST_STREAM: &str = "honest.metrics";

/// 127.0.0.1 with an ephemeral port.
pub fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

/// A new in-memory CA with a server certificate for [`SERVER_NAME`] and 127.0.0.1.
pub fn new_pki() -> InMemoryPki {
    InMemoryPki::generate(&[SERVER_NAME, "127.0.0.1"]).expect("generate PKI")
}

// === Chunks ===

/// A chunk as the agent sends it, and the records the export must give back.
#[derive(Debug, Clone)]
pub struct TestChunk {
    pub header: ChunkHeader,
    pub payload: Vec<u8>,
    pub records: Vec<Vec<u8>>,
}

impl TestChunk {
    /// Header then payload: the whole uni-stream.
    pub fn wire(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.header.encode(&mut out);
        out.extend_from_slice(&self.payload);
        out
    }

    pub fn key(&self) -> (StreamName, u64) {
        (self.header.stream.clone(), self.header.seq)
    }
}

/// A valid, uncompressed chunk of `records` records of about `record_len` bytes each.
pub fn chunk_of(stream: &str, seq: u64, tag: &str, records: usize, record_len: usize) -> TestChunk {
    let records: Vec<Vec<u8>> = (0..records)
        .map(|i| {
            let mut r = format!("{tag}:{stream}/{seq}#{i}:").into_bytes();
            r.resize(record_len.max(r.len()), b'x');
            r
        })
        .collect();
    let mut payload = Vec::new();
    for r in &records {
        encode_record(&mut payload, r);
    }
    let len = u32::try_from(payload.len()).expect("test payloads fit a u32");
    let header = ChunkHeader {
        stream: StreamName::new(stream).expect("test stream names are valid"),
        seq,
        records: u32::try_from(records.len()).expect("few records"),
        raw_len: len,
        payload_len: len,
        codec: Codec::None,
        checksum: edge_proto::crc32c(&payload),
        created_ms: 1_700_000_000_000 + seq,
    };
    TestChunk { header, payload, records }
}

/// A small chunk of three records derived from its key.
pub fn chunk(stream: &str, seq: u64) -> TestChunk {
    chunk_of(stream, seq, "rec", 3, 0)
}

pub fn honest_chunks(seqs: std::ops::Range<u64>) -> Vec<TestChunk> {
    seqs.map(|seq| chunk(HONEST_STREAM, seq)).collect()
}

// === The honest agent ===

/// An agent driving a real [`ClientSession`] over the control bi-stream, one uni-stream per chunk.
pub struct Agent {
    pub conn: quinn::Connection,
    pub send: SendStream,
    pub recv: RecvStream,
    pub session: ClientSession,
    /// The device the server named in its Welcome.
    pub device: String,
    /// Acks received and not yet claimed by [`Agent::upload`].
    pub acks: HashMap<(StreamName, u64), AckStatus>,
}

impl Agent {
    /// Opens the control stream, sends the session's Hello (naming the agent `agent`) and reads
    /// until the Welcome.
    pub async fn connect(conn: &quinn::Connection, spool_id: [u8; 16], agent: &str) -> Agent {
        let (send, recv) = conn.open_bi().await.expect("open the control stream");
        let session = ClientSession::new(spool_id, agent.into(), Limits::default(), Instant::now());
        let mut agent = Agent { conn: conn.clone(), send, recv, session, device: String::new(), acks: HashMap::new() };
        agent.flush().await;
        while !agent.session.is_connected() {
            agent.read_control().await;
        }
        agent
    }

    pub async fn flush(&mut self) {
        while let Some(bytes) = self.session.poll_transmit() {
            self.send.write_all(&bytes).await.expect("write to the control stream");
        }
    }

    /// Reads one piece of the control stream into the session and files the acks.
    pub async fn read_control(&mut self) {
        let mut buf = [0u8; 4096];
        let n = match self.recv.read(&mut buf).await {
            Ok(Some(n)) => n,
            Ok(None) => panic!("the server finished the control stream"),
            Err(e) => panic!("the control stream failed: {e}"),
        };
        self.session.handle_control_bytes(Instant::now(), &buf[..n]).expect("the server speaks edge/1");
        while let Some(event) = self.session.poll_event() {
            match event {
                ClientEvent::Connected { device, .. } => self.device = device,
                ClientEvent::Ack { stream, seq, status } => {
                    self.acks.insert((stream, seq), status);
                }
                ClientEvent::GoAway { code } => panic!("unexpected GoAway ({code})"),
            }
        }
    }

    /// Sends every chunk on its own uni-stream (all in flight at once), then waits for each ack.
    pub async fn upload(&mut self, chunks: &[TestChunk]) -> Vec<AckStatus> {
        for c in chunks {
            self.session.chunk_sent(&c.header.stream, c.header.seq).expect("window has room");
            let mut uni = self.conn.open_uni().await.expect("open a chunk stream");
            uni.write_chunk(c.wire().into()).await.expect("write the chunk");
            uni.finish().expect("finish the chunk stream once");
        }
        let mut statuses = Vec::with_capacity(chunks.len());
        for c in chunks {
            statuses.push(self.answer(&c.key()).await);
        }
        statuses
    }

    /// Reads the control stream until the chunk `key` is answered; returns its status.
    pub async fn answer(&mut self, key: &(StreamName, u64)) -> AckStatus {
        loop {
            if let Some(status) = self.acks.remove(key) {
                return status;
            }
            self.read_control().await;
        }
    }

    /// Uploads and asserts that every chunk was acked `Stored`.
    pub async fn upload_stored(&mut self, what: &str, chunks: &[TestChunk]) {
        let statuses = bounded(what, self.upload(chunks)).await;
        assert_eq!(statuses, vec![AckStatus::Stored; chunks.len()], "{what}: every chunk is stored");
    }

    pub fn close(self) {
        self.conn.close(VarInt::from_u32(ErrorCode::NoError.to_u32()), b"done");
    }
}

// === Server and store ===

/// A file store in a new temporary directory, with its default options changed by `store`, and
/// a server on `endpoint` storing into it.
pub fn start_server_with(
    endpoint: Endpoint,
    opts: ServerOptions,
    store: impl FnOnce(&mut StoreOptions),
) -> (Server, StoreHandle, TempDir) {
    let data = tempfile::tempdir().expect("temp dir");
    let mut store_opts = StoreOptions::new(data.path());
    store(&mut store_opts);
    let (store, _recovery) = Store::open(store_opts).expect("open store");
    let store = StoreHandle::spawn(store);
    let opts = ServerOptions { listen: endpoint.local_addr().expect("bound address"), ..opts };
    let server = Server::start(endpoint, store.clone(), opts).expect("start server");
    (server, store, data)
}

/// Shuts the server and the store down and returns everything the store in `data` exports.
pub async fn shut_down(server: Server, store: StoreHandle, data: &Path) -> (Vec<Exported>, ExportReport) {
    bounded("server shutdown", server.shutdown()).await;
    bounded("store shutdown", tokio::task::spawn_blocking(move || store.shutdown()))
        .await
        .expect("store shutdown does not panic");
    export_all(data)
}

/// One exported chunk, owned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exported {
    pub key: ChunkKey,
    pub records: Vec<Vec<u8>>,
}

pub fn export_all(dir: &Path) -> (Vec<Exported>, ExportReport) {
    let mut out = Vec::new();
    let report = export(dir, &ExportFilter::default(), |c| {
        out.push(Exported { key: c.key.clone(), records: c.records.iter().map(|r| r.to_vec()).collect() });
        Ok(())
    })
    .expect("export the store");
    (out, report)
}

/// Asserts that `device` has exactly `expected` in the export, once each, with their records.
pub fn assert_exported_once(exported: &[Exported], device: &str, spool: [u8; 16], expected: &[TestChunk]) {
    let mut got: Vec<Exported> = exported.iter().filter(|e| e.key.device == device).cloned().collect();
    got.sort_by(|a, b| (&a.key.stream, a.key.seq).cmp(&(&b.key.stream, b.key.seq)));
    let mut want: Vec<Exported> = expected
        .iter()
        .map(|c| Exported {
            key: ChunkKey { device: device.into(), spool, stream: c.header.stream.as_str().into(), seq: c.header.seq },
            records: c.records.clone(),
        })
        .collect();
    want.sort_by(|a, b| (&a.key.stream, a.key.seq).cmp(&(&b.key.stream, b.key.seq)));
    assert_eq!(got, want, "exported chunks of {device}");
}

// === Waits and closes ===

/// Fails the test instead of hanging: `fut` must finish within the including file's `BOUND`.
pub async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(BOUND, fut).await.unwrap_or_else(|_| panic!("{what} did not finish within {BOUND:?}"))
}

/// Asserts that the server closed the connection with exactly `expected`.
pub fn assert_closed_with(what: &str, err: &ConnectionError, expected: ErrorCode) {
    match err {
        ConnectionError::ApplicationClosed(close) => {
            let got = u32::try_from(close.error_code.into_inner()).ok().and_then(ErrorCode::from_u32);
            assert_eq!(
                close.error_code,
                VarInt::from_u32(expected.to_u32()),
                "{what}: closed with {got:?} ({}), expected {expected:?}; reason {:?}",
                close.error_code,
                String::from_utf8_lossy(&close.reason),
            );
        }
        other => panic!("{what}: expected an application close with {expected:?}, got {other:?}"),
    }
}

/// Writes `bytes`; the server may already have closed the connection, which the caller observes
/// through `Connection::closed`.
pub async fn write_unless_closed(send: &mut SendStream, bytes: &[u8]) {
    match send.write_all(bytes).await {
        Ok(()) | Err(WriteError::ConnectionLost(_)) => {}
        Err(e) => panic!("writing the rogue bytes failed: {e}"),
    }
}
