//! The intake's answers, against a real agent (real Unix socket, real SQLite spool) whose ingest
//! server is unreachable, so everything accepted stays in the spool where the test can count it.

use bytes::Bytes;
use edge_uploader::agent::Agent;
use edge_uploader::client::IntakeClient;
use edge_uploader::config::RawConfig;

mod common;

struct Fixture {
    _dir: tempfile::TempDir,
    agent: Agent,
    client: IntakeClient,
}

async fn start(tweak: impl FnOnce(&mut RawConfig)) -> Fixture {
    let (dir, agent, config) = common::offline_agent("intake-test", tweak).await;
    let client = IntakeClient::new(&config.intake.socket);
    Fixture { _dir: dir, agent, client }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ndjson_lines_become_records_and_the_answer_counts_them() {
    let mut f = start(|_| {}).await;
    let r = f
        .client
        .post("temperature", "application/x-ndjson", Bytes::from_static(b"{\"t\":1}\n{\"t\":2}\r\n\n{\"t\":3}"))
        .await
        .expect("post");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["records"], 3);
    assert_eq!(r.body["bytes"], 21);
    let r = f
        .client
        .post("vibration", "application/octet-stream", Bytes::from_static(b"\x00\x01\n\x02"))
        .await
        .expect("post");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["records"], 1);
    assert_eq!(r.body["bytes"], 4);
    let s = f.agent.spool_stats();
    assert_eq!(s.open_bytes + s.sealed_bytes, 21 + 4 + 4 * 4, "payload plus 4 bytes of framing per record");
    f.agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_a_named_error_and_store_nothing() {
    let mut f = start(|raw| {
        raw.intake.max_record_bytes = bytesize::ByteSize::b(10);
        raw.intake.max_request_bytes = bytesize::ByteSize::b(100);
    })
    .await;
    let cases: [(&str, &str, &[u8], u16, &str); 6] = [
        ("bad/name", "application/x-ndjson", b"{}", 404, ""),
        ("bad%21name", "application/x-ndjson", b"{}", 400, "bad_stream_name"),
        ("s", "application/x-ndjson", b"\n\n", 400, "empty_body"),
        ("s", "text/plain", b"x", 415, "unsupported_content_type"),
        ("s", "application/x-ndjson", b"short\nthis line is too long\n", 413, "record_too_large"),
        ("s", "application/octet-stream", &[b'x'; 101], 413, "request_too_large"),
    ];
    for (stream, ctype, body, status, error) in cases {
        let r = f.client.post(stream, ctype, Bytes::copy_from_slice(body)).await.expect("post");
        assert_eq!(r.status, status, "{stream:?} {ctype}: {}", r.body);
        if !error.is_empty() {
            assert_eq!(r.body["error"], error, "{}", r.body);
            assert!(r.body["detail"].as_str().is_some_and(|d| !d.is_empty()), "{}", r.body);
        }
    }
    let s = f.agent.spool_stats();
    assert_eq!(s.total_bytes, 0, "a refused request stores none of its records");
    assert_eq!(f.agent.intake().records_total.load(std::sync::atomic::Ordering::Relaxed), 0);
    f.agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_answers_507_with_retry_after_and_keeps_earlier_records() {
    let mut f = start(|raw| {
        raw.spool.max_bytes = bytesize::ByteSize::kib(4);
        raw.spool.chunk_target = bytesize::ByteSize::kib(1);
    })
    .await;
    let record = Bytes::from(vec![b'a'; 1000]);
    let mut accepted = 0u64;
    let mut refused = None;
    for _ in 0..10 {
        let r = f.client.post("s", "application/octet-stream", record.clone()).await.expect("post");
        match r.status {
            200 => accepted += 1,
            507 => {
                refused = Some(r);
                break;
            }
            other => panic!("unexpected {other}: {}", r.body),
        }
    }
    let refused = refused.expect("the spool fills up within 10 KB");
    assert_eq!(refused.body["error"], "spool_full");
    assert_eq!(refused.retry_after, Some(5));
    assert_eq!(accepted, 4, "four 1004-byte framed records fit in 4 KiB");
    let s = f.agent.spool_stats();
    assert_eq!(s.total_bytes, accepted * 1004);
    f.agent.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_far_larger_than_the_read_buffer_is_stored_intact_and_the_connection_kept() {
    let mut f = start(|_| {}).await;
    // 3.6 MB of lines of varying length: over 50 times the connection's read buffer, with
    // lines cut at every read boundary.
    let lines: Vec<Vec<u8>> =
        (0..4000).map(|i| format!("{{\"i\":{i},\"pad\":\"{}\"}}", "p".repeat(i * 7 % 1800)).into_bytes()).collect();
    let body: Vec<u8> = lines.iter().flat_map(|l| l.iter().copied().chain(std::iter::once(b'\n'))).collect();
    assert!(body.len() > 50 * edge_uploader::intake::HTTP_READ_BUFFER, "{} bytes", body.len());
    let r = f.client.post("big", "application/x-ndjson", Bytes::from(body)).await.expect("post");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["records"], 4000);
    // The same connection serves the next request.
    let r = f.client.post("big", "application/x-ndjson", Bytes::from_static(b"{\"last\":1}")).await.expect("post");
    assert_eq!(r.status, 200, "{}", r.body);
    f.agent.shutdown().await;
    let mut want = lines;
    want.push(b"{\"last\":1}".to_vec());
    assert_eq!(common::read_spool(f._dir.path()).get("big"), Some(&want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_refuses_new_requests() {
    let f = start(|_| {}).await;
    let socket = f._dir.path().join("intake.sock");
    f.agent.shutdown().await;
    let mut c = IntakeClient::new(&socket);
    assert!(
        c.post("s", "application/x-ndjson", Bytes::from_static(b"{}")).await.is_err(),
        "socket is gone after shutdown"
    );
}
