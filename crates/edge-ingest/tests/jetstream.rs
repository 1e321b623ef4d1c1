//! The JetStream sink against a real NATS JetStream server: the machine's (127.0.0.1:4222, or
//! `EDGE_TEST_NATS_URL`), with a stream of each test's own that the test deletes, and a private
//! `nats-server` where NATS must go away.

use std::time::Duration;

use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy, RetentionPolicy, StorageType};
use edge_ingest::jetstream::{Held, JetStreamError, JetStreamOptions, JetStreamSink, lookup};
use edge_ingest::store::{ChunkKey, IncomingChunk, Payload, PersistOutcome, StoreFailure};
use edge_proto::Codec;
use edge_proto::records::encode_record;
use edge_testkit::nats;

fn opts(stream: &str, prefix: &str) -> JetStreamOptions {
    JetStreamOptions {
        servers: vec![nats::url()],
        stream: stream.into(),
        subject_prefix: prefix.into(),
        ..JetStreamOptions::default()
    }
}

fn chunk(device: &str, stream: &str, seq: u64, records: &[Vec<u8>]) -> IncomingChunk {
    let mut payload = Vec::new();
    for r in records {
        encode_record(&mut payload, r);
    }
    let raw_len = u32::try_from(payload.len()).expect("small");
    let checksum = edge_proto::crc32c(&payload);
    IncomingChunk {
        key: ChunkKey { device: device.into(), spool: [7; 16], stream: stream.into(), seq },
        records: u32::try_from(records.len()).expect("small"),
        codec: Codec::None,
        raw_len,
        checksum,
        created_ms: 1_700_000_000_000,
        payload: Payload::from(payload),
    }
}

/// A stream made by an operator with the settings the sink needs (one message per subject,
/// discard new per subject, limits retention, file storage).
fn operators_stream(stream: &str, prefix: &str) -> StreamConfig {
    StreamConfig {
        name: stream.into(),
        subjects: vec![format!("{prefix}.>")],
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        discard: DiscardPolicy::New,
        discard_new_per_subject: true,
        max_messages_per_subject: 1,
        ..StreamConfig::default()
    }
}

/// Starts a sink and waits until its stream is set up: a first attempt that NATS refused for a
/// moment is retried in the background, and these tests are about what comes after.
async fn started(o: JetStreamOptions) -> JetStreamSink {
    let sink = JetStreamSink::start(o).await.expect("sink");
    tokio::time::timeout(Duration::from_secs(30), sink.ready()).await.expect("stream set up within 30 s");
    sink
}

fn records(n: usize, size: usize, tag: u8) -> Vec<Vec<u8>> {
    (0..n).map(|i| vec![tag.wrapping_add(u8::try_from(i % 200).expect("small")); size]).collect()
}

#[tokio::test]
async fn a_chunk_is_stored_once_whichever_ingest_server_receives_it() {
    let (stream, prefix) = nats::unique("once");
    let js = nats::context(&nats::url()).await.expect("NATS with JetStream at EDGE_TEST_NATS_URL or 127.0.0.1:4222");
    // Two sinks, two connections: two ingest servers of one tier.
    let a = started(opts(&stream, &prefix)).await;
    let b = started(opts(&stream, &prefix)).await;
    let recs = records(5, 100, 1);
    let c = chunk("gw.01", "temp.c", 42, &recs);
    assert_eq!(a.persist(c.clone()).await, PersistOutcome::Stored);
    assert_eq!(b.persist(c.clone()).await, PersistOutcome::Duplicate);
    assert_eq!(a.persist(c.clone()).await, PersistOutcome::Duplicate);
    // `edge-ingest stored` finds it by the names as they are (escaped in the subject as
    // `publish` escapes them), by its spool or by any spool, and nothing at another seq.
    let o = opts(&stream, &prefix);
    let whole = Held { parts: 1, found: vec![1], records: Some(5) };
    let spool = "07".repeat(16);
    assert_eq!(
        lookup(&o, "gw.01", "temp.c", Some(&c.key.spool), 42).await.expect("lookup"),
        vec![(spool.clone(), whole.clone())]
    );
    assert_eq!(lookup(&o, "gw.01", "temp.c", None, 42).await.expect("lookup"), vec![(spool, whole)]);
    assert_eq!(lookup(&o, "gw.01", "temp.c", None, 43).await.expect("lookup"), vec![]);
    assert_eq!(lookup(&o, "gw%2E01", "temp.c", None, 42).await.expect("lookup"), vec![], "no unescaped match");

    let msgs = nats::messages(&js, &stream).await.expect("read back");
    nats::delete_stream(&js, &stream).await;
    assert_eq!(msgs.len(), 1, "{msgs:?}");
    let m = &msgs[0];
    assert_eq!(m.subject, format!("{prefix}.gw%2E01.temp%2Ec.{}.42.1", "07".repeat(16)));
    assert_eq!(m.header("Edge-Device"), "gw.01");
    assert_eq!(m.header("Edge-Stream"), "temp.c");
    assert_eq!(m.header("Edge-Seq"), "42");
    assert_eq!(m.header("Edge-Part"), "1/1");
    assert_eq!(m.header("Edge-Records"), "5");
    assert_eq!(m.records().expect("framed"), recs);
    let stats = a.stats_view().get();
    assert_eq!((stats.stored, stats.duplicates, stats.failed), (1, 1, 0));
}

#[tokio::test]
async fn a_resend_after_the_dedup_window_is_still_a_duplicate() {
    let (stream, prefix) = nats::unique("window");
    let js = nats::context(&nats::url()).await.expect("NATS");
    // The operator's stream, with a dedup window far shorter than an agent's outage can be.
    js.create_stream(StreamConfig {
        duplicate_window: Duration::from_millis(100),
        ..operators_stream(&stream, &prefix)
    })
    .await
    .expect("create stream");
    let sink = started(opts(&stream, &prefix)).await;
    let c = chunk("gw-02", "s", 1, &records(3, 10, 9));
    assert_eq!(sink.persist(c.clone()).await, PersistOutcome::Stored);
    // Waits out the server's own timer: nothing of ours to await.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let again = sink.persist(c).await;
    let msgs = nats::messages(&js, &stream).await.expect("read back");
    nats::delete_stream(&js, &stream).await;
    assert_eq!(again, PersistOutcome::Duplicate);
    assert_eq!(msgs.len(), 1);
}

#[tokio::test]
async fn a_large_chunk_is_cut_into_parts_and_a_partial_resend_completes_it() {
    let (stream, prefix) = nats::unique("parts");
    let js = nats::context(&nats::url()).await.expect("NATS");
    let mut o = opts(&stream, &prefix);
    o.max_message_bytes = 1024;
    let sink = started(o).await;
    // 10 records of 300 bytes: 304 framed, three per part, so four parts.
    let recs = records(10, 300, 3);
    let c = chunk("gw-03", "big", 7, &recs);
    // As if another server had died after publishing part 1 only (3 records of 304 bytes framed
    // fit in 1024): the message it would have published.
    let mut part1 = Vec::new();
    for r in &recs[..3] {
        encode_record(&mut part1, r);
    }
    let id = format!("gw-03.big.{}.7.1", "07".repeat(16));
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", id.as_str());
    headers.insert("Edge-Part", "1/4");
    js.publish_with_headers(format!("{prefix}.{id}"), headers, part1.into())
        .await
        .expect("publish")
        .await
        .expect("ack");
    // `edge-ingest stored` sees the one part, and that it is one of four.
    let o = opts(&stream, &prefix);
    let held = |found: Vec<(String, Held)>| found.into_iter().map(|(_, h)| h).collect::<Vec<_>>();
    let one = held(lookup(&o, "gw-03", "big", Some(&c.key.spool), 7).await.expect("lookup"));
    // The hand-made part 1 has no Edge-Records header: the records are not counted.
    assert_eq!(one, vec![Held { parts: 4, found: vec![1], records: None }]);
    assert!(!one[0].whole());
    assert_eq!(sink.persist(c.clone()).await, PersistOutcome::Stored, "parts 2 to 4 are new");
    assert_eq!(sink.persist(c.clone()).await, PersistOutcome::Duplicate, "all four are stored now");
    let all = held(lookup(&o, "gw-03", "big", Some(&c.key.spool), 7).await.expect("lookup"));
    assert_eq!(all, vec![Held { parts: 4, found: vec![1, 2, 3, 4], records: None }]);
    assert!(all[0].whole());
    assert_eq!(lookup(&o, "gw-03", "big", Some(&c.key.spool), 8).await.expect("lookup"), vec![]);
    let after = nats::messages(&js, &stream).await.expect("read back");
    nats::delete_stream(&js, &stream).await;
    assert_eq!(after.len(), 4, "each part exactly once");
    let mut parts: Vec<_> =
        after.iter().map(|m| (m.header("Edge-Part").to_owned(), m.records().expect("framed"))).collect();
    parts.sort();
    let all: Vec<Vec<u8>> = parts.into_iter().flat_map(|(_, r)| r).collect();
    assert_eq!(all, recs);
}

/// A chunk of more parts than async-nats lets wait for their acknowledgement (5,000 by
/// default) goes in rounds: published all at once, it waited for ever for a slot its own
/// unawaited parts held.
#[tokio::test]
async fn a_chunk_of_more_parts_than_acks_may_be_pending_is_stored_in_rounds() {
    let (stream, prefix) = nats::unique("rounds");
    let js = nats::context(&nats::url()).await.expect("NATS");
    let mut o = opts(&stream, &prefix);
    o.max_message_bytes = 1024;
    let sink = started(o).await;
    // One record of 800 bytes (804 framed) per part.
    let recs = records(5_100, 800, 9);
    let c = chunk("gw-05", "many", 1, &recs);
    let stored = tokio::time::timeout(Duration::from_secs(120), sink.persist(c.clone())).await;
    let again = match &stored {
        Ok(_) => Some(tokio::time::timeout(Duration::from_secs(120), sink.persist(c)).await),
        Err(_) => None,
    };
    let held = nats::messages(&js, &stream).await.expect("read back").len();
    nats::delete_stream(&js, &stream).await;
    assert_eq!(stored.expect("stored within 2 minutes, not stuck"), PersistOutcome::Stored);
    assert_eq!(again.and_then(Result::ok), Some(PersistOutcome::Duplicate));
    assert_eq!(held, 5_100, "each part exactly once");
}

/// The part a chunk's records land in depends on `max_message_bytes`, so servers of one tier
/// must agree on it: a resend cut at another size would find subjects taken by other records
/// (losing some, doubling others). The stream records the first server's setting; a server with
/// another one refuses to start, a stream made without the record gets it.
#[tokio::test]
async fn servers_that_would_cut_a_chunk_differently_cannot_share_a_stream() {
    let (stream, prefix) = nats::unique("cut");
    let js = nats::context(&nats::url()).await.expect("NATS");
    let mut small = opts(&stream, &prefix);
    small.max_message_bytes = 1024;
    let first = started(small.clone()).await;
    let mut large = opts(&stream, &prefix);
    large.max_message_bytes = 2048;
    let refused = JetStreamSink::start(large.clone()).await.map(|_| ()).expect_err("another cut is refused");
    JetStreamSink::start(small).await.map(|_| ()).expect("the same cut is welcome");
    first.shutdown().await;
    nats::delete_stream(&js, &stream).await;
    let JetStreamError::CutMismatch { pinned, configured, .. } = &refused else { panic!("{refused}") };
    assert_eq!((*pinned, *configured), (1024, 2048));
    let text = refused.to_string();
    assert!(text.contains("sink.jetstream.max_message_bytes") && text.contains("1024"), "{text}");
    assert!(!refused.is_transient(), "only the operator can fix it");

    // A stream created by hand (or by an edge-ingest from before the record) gets it from the
    // first server that sets it up, and holds the next ones to it.
    let (stream, prefix) = nats::unique("cutlater");
    js.create_stream(StreamConfig { description: Some("the operator's".into()), ..operators_stream(&stream, &prefix) })
        .await
        .expect("create stream");
    let first = started(opts(&stream, &prefix)).await;
    let mut other = opts(&stream, &prefix);
    other.max_message_bytes = 4096;
    let refused = JetStreamSink::start(other).await.map(|_| ()).expect_err("held to the first cut");
    let description = js.get_stream(&stream).await.expect("stream").cached_info().config.description.clone();
    first.shutdown().await;
    nats::delete_stream(&js, &stream).await;
    assert!(matches!(refused, JetStreamError::CutMismatch { configured: 4096, .. }), "{refused}");
    let default_cut = JetStreamOptions::default().max_message_bytes;
    assert_eq!(
        description.as_deref(),
        Some(format!("the operator's (edge-ingest:max_message_bytes={default_cut})").as_str())
    );
}

#[tokio::test]
async fn a_stream_that_would_forget_what_it_stored_is_refused_by_setting() {
    let (stream, prefix) = nats::unique("refused");
    let js = nats::context(&nats::url()).await.expect("NATS");
    js.create_stream(StreamConfig {
        name: stream.clone(),
        subjects: vec![format!("{prefix}.>")],
        retention: RetentionPolicy::WorkQueue,
        ..StreamConfig::default()
    })
    .await
    .expect("create stream");
    let err = JetStreamSink::start(opts(&stream, &prefix)).await.expect_err("refused");
    nats::delete_stream(&js, &stream).await;
    let JetStreamError::Misconfigured { problems, .. } = &err else { panic!("{err}") };
    assert!(problems.contains("retention"), "{err}");
    assert!(problems.contains("max_msgs_per_subject"), "{err}");
    assert!(problems.contains("discard"), "{err}");
}

#[tokio::test]
async fn a_corrupt_payload_is_rejected_and_nothing_is_published() {
    let (stream, prefix) = nats::unique("corrupt");
    let js = nats::context(&nats::url()).await.expect("NATS");
    let sink = started(opts(&stream, &prefix)).await;
    let mut c = chunk("gw-04", "s", 1, &records(2, 10, 0));
    c.checksum ^= 1;
    let outcome = sink.persist(c).await;
    let msgs = nats::messages(&js, &stream).await.expect("read back");
    nats::delete_stream(&js, &stream).await;
    assert!(matches!(outcome, PersistOutcome::Failed(StoreFailure::Rejected(_))), "{outcome:?}");
    assert!(msgs.is_empty());
}

#[tokio::test]
async fn with_nats_down_chunks_are_answered_retry_until_it_comes_back() {
    let dir = tempfile::tempdir().expect("tempdir");
    let port = edge_testkit::free_tcp_port().expect("port");
    let (stream, prefix) = nats::unique("down");
    let mut o = opts(&stream, &prefix);
    o.servers = vec![format!("nats://127.0.0.1:{port}")];
    o.connect_timeout = Duration::from_millis(300);
    o.ack_timeout = Duration::from_secs(2);
    // Nothing listens yet: the sink starts anyway and answers "unavailable".
    let sink = JetStreamSink::start(o).await.expect("starts without NATS");
    let c = chunk("gw-05", "s", 1, &records(4, 50, 5));
    let outcome = sink.persist(c.clone()).await;
    assert!(matches!(outcome, PersistOutcome::Failed(StoreFailure::Unavailable(_))), "{outcome:?}");
    assert!(sink.stats_view().get().last_failure.is_some());

    let server = nats::PrivateServer::start(port, dir.path()).expect("nats-server");
    // The client reconnects and the sink sets the stream up on its own; wait for that state.
    tokio::time::timeout(Duration::from_secs(30), sink.ready()).await.expect("sink ready 30 s after NATS came up");
    assert_eq!(sink.persist(c.clone()).await, PersistOutcome::Stored);
    assert!(sink.stats_view().get().last_failure.is_none());

    // NATS killed: the next chunk is answered "unavailable", not lost and not hanging forever.
    let url = server.url();
    let js = nats::context(&url).await.expect("private NATS");
    let msgs = nats::messages(&js, &stream).await.expect("read back");
    assert_eq!(msgs.len(), 1);
    server.kill();
    let outcome = sink.persist(chunk("gw-05", "s", 2, &records(1, 5, 0))).await;
    assert!(matches!(outcome, PersistOutcome::Failed(StoreFailure::Unavailable(_))), "{outcome:?}");
}

#[tokio::test]
async fn over_tls_the_sink_needs_the_ca_and_a_client_certificate_the_server_accepts() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = edge_transport::pki::InMemoryPki::generate(&["localhost", "127.0.0.1"]).expect("pki");
    let server = pki.write_server_files(&dir.path().join("server")).expect("server files");
    let client = pki.write_device_files("ingest-1", &dir.path().join("client")).expect("client files");
    let path = |p: &std::path::Path| p.to_str().expect("utf-8 path").to_owned();
    let (cert, key, ca) = (path(&server.cert), path(&server.key), path(&server.client_ca));
    let args = ["--tlsverify", "--tlscert", &cert, "--tlskey", &key, "--tlscacert", &ca];
    let nats_server = nats::PrivateServer::start_with(0, &dir.path().join("js"), &args).expect("nats-server with TLS");
    let (stream, prefix) = nats::unique("tls");
    let mut o = opts(&stream, &prefix);
    o.servers = vec![format!("tls://localhost:{}", nats_server.port)];
    o.tls_ca = Some(client.ca_cert.clone());
    o.connect_timeout = Duration::from_secs(3);

    // Without a client certificate the server refuses the handshake: nothing is acked.
    let refused = JetStreamSink::start(o.clone()).await.expect("starts, waiting for NATS");
    let c = chunk("gw-06", "s", 1, &records(2, 20, 1));
    assert!(matches!(refused.persist(c.clone()).await, PersistOutcome::Failed(StoreFailure::Unavailable(_))));
    refused.shutdown().await;

    o.tls_client = Some((client.cert.clone(), client.key.clone()));
    let sink = JetStreamSink::start(o).await.expect("sink over TLS");
    assert!(sink.is_ready(), "stream set up over TLS at start");
    assert_eq!(sink.persist(c).await, PersistOutcome::Stored);
}

/// A record larger than the NATS server's `max_payload` leaves room for (a record is never cut
/// between messages): the chunk is answered Retry, naming the setting to raise, and nothing of
/// it is stored, so that no other record of the chunk is stored without it.
#[tokio::test]
async fn a_record_over_the_servers_max_payload_is_retried_and_names_the_setting() {
    let (stream, prefix) = nats::unique("maxpayload");
    let js = nats::context(&nats::url()).await.expect("NATS");
    let sink = started(opts(&stream, &prefix)).await;
    // One byte more than the room the server's max_payload leaves beside the headers (with
    // NATS's default of 1 MiB, less than the agent's default largest record).
    let client = async_nats::connect(nats::url()).await.expect("NATS client");
    let room =
        client.server_info().max_payload - edge_ingest::jetstream::HEADER_ROOM - edge_proto::records::RECORD_OVERHEAD;
    let big = vec![7u8; room + 1];
    let c = chunk("gw-09", "s", 1, &[b"small".to_vec(), big]);
    let outcome = sink.persist(c).await;
    let msgs = nats::messages(&js, &stream).await.expect("read back");
    nats::delete_stream(&js, &stream).await;
    match outcome {
        PersistOutcome::Failed(StoreFailure::Unavailable(why)) => {
            assert!(why.contains("max_payload") && why.contains("raise it"), "{why}");
        }
        other => panic!("expected Retry (Unavailable), got {other:?}"),
    }
    assert!(msgs.is_empty(), "parts of the chunk were stored: {msgs:?}");
    assert!(sink.stats_view().get().last_failure.is_some(), "the sink reports the failure");
}
