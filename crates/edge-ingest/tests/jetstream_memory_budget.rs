//! The server's payload memory budget with the JetStream sink, which holds a compressed chunk
//! decoded (up to `Limits::max_raw_len`) beside its payload until JetStream has acknowledged
//! every part: such a chunk takes its decoded size from the budget too, at most the whole budget.
//!
//! Everything is real: an in-process [`Server`] over QUIC with mutual TLS, agents driving a real
//! `ClientSession` (`common/mod.rs`), and the machine's NATS JetStream (127.0.0.1:4222, or
//! `EDGE_TEST_NATS_URL`) with a stream of the test's own that it deletes. No test sleeps to
//! synchronise; every wait is for an ack and bounded by [`bounded`].

// Not every helper of `common` is used here.
#[allow(dead_code)]
mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{Agent, SERVER_NAME, TestChunk, bounded, chunk, localhost, new_pki};
use edge_ingest::jetstream::{JetStreamOptions, JetStreamSink};
use edge_ingest::server::{Server, ServerOptions};
use edge_proto::records::encode_record;
use edge_proto::{AckStatus, ChunkHeader, Codec, Limits, RetryReason, StreamName};
use edge_testkit::nats;
use edge_transport::{Tuning, client_config_from_pem, client_endpoint, server_config_from_pem, server_endpoint};

/// Upper bound of every wait in these tests (used by [`bounded`]).
const BOUND: Duration = Duration::from_secs(30);
/// The server's whole payload memory budget, and its largest chunk payload: the least the config
/// allows, which makes one connection's share the whole budget.
const BUDGET: u32 = 1 << 20;
/// The decoded size of the slow agent's chunk: four times the budget.
const RAW: usize = 4 << 20;

/// A zstd chunk of `RAW` bytes of records (1,020 bytes each, a few KiB compressed), and its
/// records.
fn compressed_chunk(stream: &str, seq: u64) -> (TestChunk, Vec<Vec<u8>>) {
    let records: Vec<Vec<u8>> =
        (0..RAW / 1024).map(|i| vec![b'a' + u8::try_from(i % 26).expect("< 26"); 1020]).collect();
    let mut raw = Vec::with_capacity(RAW);
    for r in &records {
        encode_record(&mut raw, r);
    }
    assert_eq!(raw.len(), RAW);
    let payload = edge_proto::records::compress_payload(&raw, 3).expect("compress");
    assert!(payload.len() < 64 * 1024, "compressible: {} bytes", payload.len());
    let header = ChunkHeader {
        stream: StreamName::new(stream).expect("valid name"),
        seq,
        records: u32::try_from(records.len()).expect("small"),
        raw_len: u32::try_from(RAW).expect("small"),
        payload_len: u32::try_from(payload.len()).expect("small"),
        codec: Codec::Zstd,
        checksum: edge_proto::crc32c(&payload),
        created_ms: 1_700_000_000_000,
    };
    (TestChunk { header, payload, records: Vec::new() }, records)
}

/// A slow agent's compressed chunk, whose payload has not all arrived, holds the whole budget
/// (its decoded size is four times it, clamped to it): another agent's chunk finds no room and
/// is answered `Retry(Overloaded)`. Once the slow payload is complete, the chunk, decoded to
/// four times the budget, is still stored, and the other agent's chunk after it.
///
/// Before compressed chunks were charged their decoded size, the slow chunk held 6 KiB (its
/// payload) of the budget, and the other agent's chunks went on while it would hold 4 MiB more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_compressed_chunk_holds_its_decoded_size_of_the_budget_with_the_jetstream_sink() {
    let (stream, prefix) = nats::unique("budget");
    let js = nats::context(&nats::url()).await.expect("NATS with JetStream at EDGE_TEST_NATS_URL or 127.0.0.1:4222");
    let sink = JetStreamSink::start(JetStreamOptions {
        servers: vec![nats::url()],
        stream: stream.clone(),
        subject_prefix: prefix.clone(),
        ..JetStreamOptions::default()
    })
    .await
    .expect("sink");
    // Its first set-up may be refused for a moment and retried: the test is about what comes after.
    tokio::time::timeout(Duration::from_secs(30), sink.ready()).await.expect("stream set up within 30 s");

    let pki = new_pki();
    let tuning = Tuning::default();
    let server_config =
        server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, &tuning).expect("server config");
    let endpoint = server_endpoint(localhost(), server_config, &tuning).expect("server endpoint");
    let opts = ServerOptions {
        listen: endpoint.local_addr().expect("bound address"),
        limits: Limits { max_chunk_payload: BUDGET, ..Limits::default() },
        memory_budget: u64::from(BUDGET),
        shutdown_grace: Duration::from_secs(2),
        ..ServerOptions::default()
    };
    let server = Server::start(endpoint, sink.clone(), opts).expect("start server");
    let client = client_endpoint(localhost(), &tuning).expect("client endpoint");
    let agent = |device: &'static str, spool: [u8; 16]| {
        let (cert, key) = pki.issue_device(device).expect("issue device certificate");
        let config = client_config_from_pem(&cert, &key, &pki.ca_pem, &tuning).expect("client config");
        let connecting = client.connect_with(config, server.local_addr(), SERVER_NAME).expect("start connecting");
        async move {
            let conn = bounded("the handshake", connecting).await.expect("mutual TLS handshake succeeds");
            bounded("the Hello", Agent::connect(&conn, spool, device)).await
        }
    };
    let mut quick = agent("gw-quick", [0x51; 16]).await;
    let mut slow = agent("gw-slow", [0x52; 16]).await;
    let small = |seq: u64| chunk("quick.s", seq);
    quick.upload_stored("a small chunk through JetStream", &[small(0)]).await;

    // All of the slow chunk but its last byte: the server takes its permits before it reads the
    // payload, then waits for the rest.
    let (big, big_records) = compressed_chunk("slow.big", 1);
    slow.session.chunk_sent(&big.header.stream, big.header.seq).expect("window has room");
    let mut uni = slow.conn.open_uni().await.expect("open a chunk stream");
    let wire = big.wire();
    let (head, last) = wire.split_at(wire.len() - 1);
    uni.write_all(head).await.expect("write all but the last byte");

    // The slow chunk's header reaches the server before the first of these (or the next) does.
    let mut seq = 1;
    let overloaded = loop {
        assert!(seq <= 20, "no small chunk was refused for memory while the slow chunk should hold the whole budget");
        let statuses = bounded("a small chunk is answered", quick.upload(&[small(seq)])).await;
        match statuses[..] {
            [AckStatus::Stored] => seq += 1,
            [AckStatus::Retry(RetryReason::Overloaded)] => break small(seq),
            _ => panic!("small chunk {seq}: {statuses:?}"),
        }
    };

    uni.write_all(last).await.expect("write the last byte");
    uni.finish().expect("finish the chunk stream once");
    let status = bounded("the slow chunk is answered", async {
        loop {
            if let Some(status) = slow.acks.remove(&big.key()) {
                break status;
            }
            slow.read_control().await;
        }
    })
    .await;
    assert_eq!(status, AckStatus::Stored, "a chunk decoding to more than the whole budget is still stored");
    quick.upload_stored("the refused chunk again, with the budget free", std::slice::from_ref(&overloaded)).await;
    assert_eq!(server.counters().chunks_retry_total.load(Ordering::Relaxed), 1);

    let msgs = bounded("read the stream back", nats::messages(&js, &stream)).await.expect("read back");
    nats::delete_stream(&js, &stream).await;
    let mut slow_parts: Vec<(u32, Vec<Vec<u8>>)> = msgs
        .iter()
        .filter(|m| m.header("Edge-Device") == "gw-slow")
        .map(|m| {
            let part = m.header("Edge-Part").split('/').next().and_then(|n| n.parse().ok()).expect("Edge-Part i/n");
            (part, m.records().expect("framed"))
        })
        .collect();
    slow_parts.sort_by_key(|(part, _)| *part);
    let slow_records: Vec<Vec<u8>> = slow_parts.into_iter().flat_map(|(_, records)| records).collect();
    assert_eq!(slow_records.len(), big_records.len());
    assert!(slow_records == big_records, "the slow chunk's records, in order");
    let quick_chunks = msgs.iter().filter(|m| m.header("Edge-Device") == "gw-quick").count();
    assert_eq!(quick_chunks, usize::try_from(seq).expect("small") + 1, "each small chunk once");
    quick.close();
    slow.close();
    bounded("server shutdown", server.shutdown()).await;
    sink.shutdown().await;
}
