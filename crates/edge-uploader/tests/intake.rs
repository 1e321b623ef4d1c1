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
async fn a_stream_past_spool_max_streams_is_refused_by_name_and_known_streams_go_on() {
    let mut f = start(|raw| raw.spool.max_streams = 2).await;
    for stream in ["a", "b"] {
        let r = f.client.post(stream, "application/x-ndjson", Bytes::from_static(b"{}")).await.expect("post");
        assert_eq!(r.status, 200, "{}", r.body);
    }
    let r = f.client.post("c", "application/x-ndjson", Bytes::from_static(b"{}")).await.expect("post");
    assert_eq!(r.status, 422, "{}", r.body);
    assert_eq!(r.body["error"], "too_many_streams");
    let detail = r.body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("\"c\"") && detail.contains("spool.max_streams"), "names the stream and the key: {detail}");
    let r = f.client.post("a", "application/x-ndjson", Bytes::from_static(b"{}")).await.expect("post");
    assert_eq!(r.status, 200, "a known stream goes on: {}", r.body);
    let s = f.agent.spool_stats();
    let names: Vec<&str> = s.streams.iter().map(|st| st.name.as_str()).collect();
    assert_eq!(names, ["a", "b"]);
    assert_eq!(s.total_bytes, 3 * (2 + 4), "three records of \"{{}}\" and their framing; nothing of \"c\"");
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

/// Polls `cond` (a gauge the agent updates as it goes) until it holds, for at most 30 s.
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let polling = async {
        while !cond() {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(30), polling).await.unwrap_or_else(|_| panic!("{what}"));
}

/// A request written by hand, so that its body can be held back part-way.
struct RawRequest {
    io: tokio::net::UnixStream,
}

impl RawRequest {
    /// Connects and sends the head (with `Content-Length: len`, or chunked for `None`).
    async fn start(socket: &std::path::Path, stream: &str, len: Option<usize>) -> Self {
        use tokio::io::AsyncWriteExt;
        let mut io = tokio::net::UnixStream::connect(socket).await.expect("connects");
        let framing = len.map_or("Transfer-Encoding: chunked".to_owned(), |n| format!("Content-Length: {n}"));
        let head = format!(
            "POST /v1/streams/{stream} HTTP/1.1\r\nHost: agent\r\nContent-Type: application/x-ndjson\r\n{framing}\r\n\r\n"
        );
        io.write_all(head.as_bytes()).await.expect("head");
        RawRequest { io }
    }

    async fn send(&mut self, bytes: &[u8]) {
        use tokio::io::AsyncWriteExt;
        self.io.write_all(bytes).await.expect("body");
    }

    /// Sends `bytes` as one chunk of a chunked body (an empty one ends the body).
    async fn send_chunk(&mut self, bytes: &[u8]) {
        let chunk = [format!("{:x}\r\n", bytes.len()).as_bytes(), bytes, b"\r\n"].concat();
        self.send(&chunk).await;
    }

    /// Posts `body` as one chunked body on a connection of its own and reads the answer.
    async fn post_chunked(socket: &std::path::Path, stream: &str, body: &[u8]) -> (u16, serde_json::Value) {
        let mut r = RawRequest::start(socket, stream, None).await;
        r.send_chunk(body).await;
        r.send_chunk(b"").await;
        r.answer().await
    }

    /// The status and JSON body of the answer, which must come within 30 s.
    async fn answer(self) -> (u16, serde_json::Value) {
        tokio::time::timeout(std::time::Duration::from_secs(30), self.read_answer()).await.expect("an answer in time")
    }

    async fn read_answer(mut self) -> (u16, serde_json::Value) {
        use tokio::io::AsyncReadExt;
        let mut got = Vec::new();
        loop {
            let mut buf = [0u8; 4096];
            let n = self.io.read(&mut buf).await.expect("reads the answer");
            assert!(n > 0, "the connection closed before a whole answer: {:?}", String::from_utf8_lossy(&got));
            got.extend_from_slice(&buf[..n]);
            let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
            let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
            let len: usize = head
                .lines()
                .find_map(|l| l.strip_prefix("content-length:"))
                .and_then(|v| v.trim().parse().ok())
                .expect("the answer has a Content-Length");
            if got.len() >= end + 4 + len {
                let status = head[9..12].parse().expect("a status code");
                return (status, serde_json::from_slice(&got[end + 4..end + 4 + len]).expect("a JSON body"));
            }
        }
    }
}

/// An agent whose request budget and largest request are both `budget` bytes (records of at
/// most 1 KiB); `tweak` adjusts the rest.
async fn start_with_request_budget(budget: usize, tweak: impl FnOnce(&mut RawConfig)) -> Fixture {
    start(|raw| {
        raw.intake.max_record_bytes = bytesize::ByteSize::kib(1);
        raw.intake.max_request_bytes = bytesize::ByteSize::b(budget as u64);
        raw.intake.request_pending_total_bytes = bytesize::ByteSize::b(budget as u64);
        tweak(raw);
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_share_one_budget_wait_for_room_and_lose_nothing() {
    // Room for two of the six 128 KiB bodies at once.
    let budget = 256usize << 10;
    let f = start_with_request_budget(budget, |_| {}).await;
    let socket = f._dir.path().join("intake.sock");
    let counters = f.agent.intake();
    let waiting = || counters.requests_waiting.load(std::sync::atomic::Ordering::Relaxed);
    let line = |k: usize, i: usize| format!("{{\"p\":{k},\"i\":{i:04},\"pad\":\"{}\"}}", "x".repeat(105)).into_bytes();
    let body = |k: usize| -> Vec<u8> { (0..1000).flat_map(|i| [line(k, i), b"\n".to_vec()].concat()).collect() };
    let len = body(0).len();
    assert!(2 * len <= budget && 3 * len > budget, "two bodies of {len} bytes fit, three do not");

    // Six requests send their head and half their body; two fit and read, four wait.
    let mut requests = Vec::new();
    for k in 0..6 {
        let mut r = RawRequest::start(&socket, &format!("p{k}"), Some(len)).await;
        r.send(&body(k)[..len / 2]).await;
        requests.push(r);
    }
    wait_until("four requests wait for room", || waiting() == 4).await;
    // The two requests admitted claim their whole bodies; the first waiting does not fit.
    assert_eq!(f.agent.request_budget().used(), 2 * len);
    // A body sent without a length claims a first step; first come, first served, it waits
    // behind the others.
    let mut chunked = RawRequest::start(&socket, "chunked", None).await;
    chunked.send(b"a\r\n{\"last\":1}\r\n").await;
    wait_until("the chunked request waits too", || waiting() == 5).await;
    // A body declared over intake.max_request_bytes is refused at once: none of it is sent.
    let (status, answer) = RawRequest::start(&socket, "huge", Some(10 << 30)).await.answer().await;
    assert_eq!((status, answer["error"].as_str()), (413, Some("request_too_large")), "{answer}");

    for (k, r) in requests.iter_mut().enumerate() {
        r.send(&body(k)[len / 2..]).await;
    }
    chunked.send(b"0\r\n\r\n").await;
    for r in requests {
        let (status, answer) = r.answer().await;
        assert_eq!((status, answer["records"].as_u64()), (200, Some(1000)), "{answer}");
    }
    let (status, answer) = chunked.answer().await;
    assert_eq!((status, answer["records"].as_u64()), (200, Some(1)), "{answer}");

    // Never more than the budget claimed, and the records framed at once were at most two
    // bodies' worth: a body with a Content-Length is framed into buffers sized for it (its
    // 1000 lines framed three bytes longer each), and the one-record chunked body takes one
    // first buffer of 64 KiB. Without the budget, six requests would frame at once.
    let budget_peak = f.agent.request_budget().peak();
    assert!(budget_peak <= budget, "{budget_peak} bytes claimed at once");
    let held = counters.request_buffer_peak_bytes.load(std::sync::atomic::Ordering::Relaxed);
    println!("the requests held at most {held} bytes at once; each body is {len} bytes");
    let framed = len + 3 * 1000 + 1;
    assert!(held >= len as u64, "the framed records are counted: {held}");
    assert!(held <= (2 * framed + (64 << 10)) as u64, "the requests held {held} bytes at their peak");
    assert_eq!(counters.request_buffer_bytes.load(std::sync::atomic::Ordering::Relaxed), 0, "all given back");
    assert_eq!((f.agent.request_budget().used(), waiting()), (0, 0));
    f.agent.shutdown().await;
    let stored = common::read_spool(f._dir.path());
    for k in 0..6 {
        let want: Vec<Vec<u8>> = (0..1000).map(|i| line(k, i)).collect();
        assert_eq!(stored.get(&format!("p{k}")), Some(&want), "stream p{k}");
    }
    assert_eq!(stored.get("chunked"), Some(&vec![b"{\"last\":1}".to_vec()]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chunked_body_claims_what_it_sends_so_other_requests_are_not_held_behind_it() {
    use std::sync::atomic::Ordering::Relaxed;
    // The default budget (8 MiB) and largest request (64 MiB).
    let f = start(|_| {}).await;
    let socket = f._dir.path().join("intake.sock");
    let counters = f.agent.intake();
    let line = |k: usize, i: usize| format!("{{\"p\":{k},\"i\":{i:05},\"pad\":\"{}\"}}", "x".repeat(200)).into_bytes();
    let lines = |k: usize, n: std::ops::Range<usize>| -> Vec<u8> {
        n.flat_map(|i| [line(k, i), b"\n".to_vec()].concat()).collect()
    };

    // A producer streams a body without a length and pauses part-way.
    let mut open = RawRequest::start(&socket, "open", None).await;
    open.send_chunk(&lines(0, 0..10)).await;
    wait_until("the open request is framing", || counters.request_buffer_bytes.load(Relaxed) > 0).await;
    // It claims a first step, not intake.max_request_bytes (more than the whole budget).
    assert_eq!(f.agent.request_budget().used(), edge_uploader::intake::CHUNKED_FIRST_CLAIM);

    // Requests with and without a length are read and answered while it is open.
    let sized_body = lines(1, 0..100);
    let mut sized = RawRequest::start(&socket, "sized", Some(sized_body.len())).await;
    sized.send(&sized_body).await;
    let (status, answer) = sized.answer().await;
    assert_eq!((status, answer["records"].as_u64()), (200, Some(100)), "{answer}");
    let (status, answer) = RawRequest::post_chunked(&socket, "other", &lines(2, 0..100)).await;
    assert_eq!((status, answer["records"].as_u64()), (200, Some(100)), "{answer}");

    // The open body goes on, past its first claim (about 2 MiB more), and ends.
    for part in 1..100 {
        open.send_chunk(&lines(0, part * 100..part * 100 + 100)).await;
    }
    open.send_chunk(b"").await;
    let (status, answer) = open.answer().await;
    assert_eq!((status, answer["records"].as_u64()), (200, Some(9910)), "{answer}");
    let peak = f.agent.request_budget().peak();
    let body = lines(0, 0..10).len() + lines(0, 100..10000).len();
    assert!(peak >= body && peak <= 4 * body, "{peak} bytes claimed at the peak for a body of {body}");
    assert_eq!((f.agent.request_budget().used(), counters.requests_waiting.load(Relaxed)), (0, 0));
    f.agent.shutdown().await;
    let stored = common::read_spool(f._dir.path());
    let want = |k: usize, n: std::ops::Range<usize>| -> Vec<Vec<u8>> { n.map(|i| line(k, i)).collect() };
    assert_eq!(stored.get("sized"), Some(&want(1, 0..100)));
    assert_eq!(stored.get("other"), Some(&want(2, 0..100)));
    assert_eq!(stored.get("open"), Some(&[want(0, 0..10), want(0, 100..10000)].concat()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunked_bodies_that_outgrow_the_budget_together_the_younger_gives_way_and_loses_nothing() {
    use std::sync::atomic::Ordering::Relaxed;
    let budget = 256usize << 10;
    let f = start_with_request_budget(budget, |_| {}).await;
    let socket = f._dir.path().join("intake.sock");
    let counters = f.agent.intake();
    let line = |k: usize, i: usize| format!("{{\"p\":{k},\"i\":{i:03},\"pad\":\"{}\"}}", "x".repeat(980)).into_bytes();
    let lines = |k: usize, n: std::ops::Range<usize>| -> Vec<u8> {
        n.flat_map(|i| [line(k, i), b"\n".to_vec()].concat()).collect()
    };
    let part = lines(0, 0..100).len();
    assert!(
        part > budget / 4 && 2 * part < budget,
        "each half of a body ({part} bytes) grows its claim to a quarter of the budget, not more"
    );

    // Two bodies sent without a length each take half the budget: their first step, then twice it.
    let mut older = RawRequest::start(&socket, "older", None).await;
    older.send_chunk(&lines(0, 0..100)).await;
    wait_until("the older body has half the budget", || f.agent.request_budget().used() == budget / 2).await;
    let mut younger = RawRequest::start(&socket, "younger", None).await;
    younger.send_chunk(&lines(1, 0..100)).await;
    wait_until("both bodies claim the budget", || f.agent.request_budget().used() == budget).await;
    // The older one needs more and waits for the younger one, which needs more too: it gives way.
    older.send_chunk(&lines(0, 100..200)).await;
    wait_until("the older body waits to grow", || counters.requests_waiting.load(Relaxed) == 1).await;
    younger.send_chunk(&lines(1, 100..200)).await;
    let (status, answer) = younger.answer().await;
    assert_eq!((status, answer["error"].as_str()), (503, Some("request_budget_full")), "{answer}");
    assert!(answer["detail"].as_str().is_some_and(|d| d.contains("Content-Length")), "{answer}");
    older.send_chunk(b"").await;
    let (status, answer) = older.answer().await;
    assert_eq!((status, answer["records"].as_u64()), (200, Some(200)), "{answer}");

    // Its producer sends it again, and it is stored once.
    let (status, answer) = RawRequest::post_chunked(&socket, "younger", &lines(1, 0..200)).await;
    assert_eq!((status, answer["records"].as_u64()), (200, Some(200)), "{answer}");
    let budget_peak = f.agent.request_budget().peak();
    assert!(budget_peak <= budget, "{budget_peak} bytes claimed at once");
    assert_eq!((f.agent.request_budget().used(), counters.requests_waiting.load(Relaxed)), (0, 0));
    f.agent.shutdown().await;
    let stored = common::read_spool(f._dir.path());
    let want = |k: usize| -> Vec<Vec<u8>> { (0..200).map(|i| line(k, i)).collect() };
    assert_eq!(stored.get("older"), Some(&want(0)));
    assert_eq!(stored.get("younger"), Some(&want(1)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_is_refused_after_the_idle_timeout_and_the_request_waiting_goes_on() {
    let budget = 64usize << 10;
    let f =
        start_with_request_budget(budget, |raw| raw.intake.request_idle_timeout = std::time::Duration::from_secs(1))
            .await;
    let socket = f._dir.path().join("intake.sock");
    let counters = f.agent.intake();
    // A producer claims the whole budget, sends part of its body and stalls.
    let mut stalled = RawRequest::start(&socket, "stalled", Some(budget)).await;
    stalled.send(b"{\"sent\":1}\n").await;
    wait_until("the stalled request is framing", || {
        counters.request_buffer_bytes.load(std::sync::atomic::Ordering::Relaxed) > 0
    })
    .await;
    let next_body = b"{\"next\":1}\n";
    let mut next = RawRequest::start(&socket, "next", Some(next_body.len())).await;
    next.send(next_body).await;
    wait_until("the next request waits for room", || {
        counters.requests_waiting.load(std::sync::atomic::Ordering::Relaxed) == 1
    })
    .await;
    let (status, answer) = stalled.answer().await;
    assert_eq!((status, answer["error"].as_str()), (408, Some("body_timeout")), "{answer}");
    assert!(answer["detail"].as_str().is_some_and(|d| d.contains("intake.request_idle_timeout")), "{answer}");
    let (status, answer) = next.answer().await;
    assert_eq!((status, answer["records"].as_u64()), (200, Some(1)), "{answer}");
    f.agent.shutdown().await;
    let stored = common::read_spool(f._dir.path());
    assert_eq!(stored.get("stalled"), None, "a refused request stores none of its records");
    assert_eq!(stored.get("next"), Some(&vec![b"{\"next\":1}".to_vec()]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_limit_wait_until_one_closes_and_a_quiet_http_one_gives_its_slot_back() {
    use std::sync::atomic::Ordering::Relaxed;
    use tokio::io::AsyncReadExt;
    let mut f = start(|raw| {
        raw.intake.max_connections = 2;
        raw.intake.request_idle_timeout = std::time::Duration::from_secs(1);
    })
    .await;
    let dir = f._dir.path().to_owned();
    let counters = f.agent.intake();
    let open = || counters.connections.load(Relaxed);
    let waits = || counters.connection_limit_waits_total.load(Relaxed);
    let stream = edge_proto::StreamName::new("s").expect("a valid name");

    // Slot 1: a record-stream producer, quiet between its records.
    let mut producer =
        edge_uploader::client::RecordStreamClient::connect(dir.join(edge_uploader::config::DEFAULT_STREAM_SOCKET))
            .await
            .expect("connects");
    producer.record(&stream, b"first");
    producer.flush().await.expect("sends");
    assert!(matches!(
        producer.reply().await.expect("an answer"),
        Some(edge_proto::intake::Reply::Ack { committed: 1 })
    ));
    // Slot 2: an HTTP connection that never sends a request.
    let mut quiet = tokio::net::UnixStream::connect(dir.join("intake.sock")).await.expect("connects");
    wait_until("both connections are open", || open() == 2).await;

    // A third producer's request is not served while both slots are taken.
    let socket = dir.join("intake.sock");
    let third = tokio::spawn(async move {
        let mut c = IntakeClient::new(&socket);
        let r = c.post("s", "application/x-ndjson", Bytes::from_static(b"{\"third\":1}")).await;
        (r, c)
    });
    wait_until("the intake stops accepting at the limit", || waits() >= 1).await;
    assert_eq!(open(), 2, "never more connections than the limit");
    assert!(!third.is_finished(), "the third request waits");
    assert_eq!(counters.records_total.load(Relaxed), 1);
    // `edge-uploader status` says the agent is there but does not answer, not that it is not
    // running.
    let status = edge_uploader::status::fetch(&dir.join("intake.sock"), std::time::Duration::from_millis(300)).await;
    assert!(
        matches!(&status, edge_uploader::status::Fetched::NoAnswer(why) if why.contains("intake.max_connections")),
        "{status:?}"
    );

    // The quiet connection is closed after request_idle_timeout, and its slot serves the third.
    let mut byte = [0u8; 1];
    let n = tokio::time::timeout(std::time::Duration::from_secs(30), quiet.read(&mut byte))
        .await
        .expect("the agent closes a connection that sends no request")
        .unwrap_or(0);
    assert_eq!(n, 0, "closed without an answer");
    let (r, client) =
        tokio::time::timeout(std::time::Duration::from_secs(30), third).await.expect("in time").expect("joins");
    let r = r.expect("post");
    assert_eq!(r.status, 200, "{}", r.body);

    // The record-stream producer kept its slot through all of it.
    producer.record(&stream, b"second");
    producer.flush().await.expect("sends");
    assert!(matches!(
        producer.reply().await.expect("an answer"),
        Some(edge_proto::intake::Reply::Ack { committed: 2 })
    ));
    drop(client);
    drop(producer);
    wait_until("the slots are given back as connections close", || open() == 0).await;
    assert_eq!(counters.records_total.load(Relaxed), 3);
    let _ = f.client.get_json("/v1/status").await.expect("served again");
    f.agent.shutdown().await;
    let stored = common::read_spool(&dir);
    assert_eq!(stored.get("s").map(Vec::len), Some(3), "{stored:?}");
}
