//! The record-stream intake against a real agent (real Unix socket and TCP port, real SQLite
//! spool) whose ingest server is unreachable, so everything accepted stays in the spool where the
//! test can read it back.

use std::time::Duration;

use edge_proto::StreamName;
use edge_proto::intake::Reply;
use edge_uploader::agent::Agent;
use edge_uploader::client::RecordStreamClient;
use edge_uploader::config::{Config, RawConfig};

mod common;

struct Fixture {
    dir: tempfile::TempDir,
    agent: Agent,
    config: Config,
}

async fn start(tweak: impl FnOnce(&mut RawConfig)) -> Fixture {
    let (dir, agent, config) = common::offline_agent("record-stream-test", tweak).await;
    Fixture { dir, agent, config }
}

impl Fixture {
    async fn client(&self) -> RecordStreamClient<tokio::net::UnixStream> {
        let path = self.config.intake.stream_socket.as_ref().expect("on by default");
        RecordStreamClient::connect(path).await.expect("connects")
    }

    /// Stops the agent and reads every record of the spool back, per stream in order.
    async fn stop_and_read(self) -> std::collections::BTreeMap<String, Vec<Vec<u8>>> {
        self.agent.shutdown().await;
        common::read_spool(self.dir.path())
    }
}

fn name(s: &str) -> StreamName {
    StreamName::new(s).expect("valid name")
}

fn record(stream: &str, i: usize) -> Vec<u8> {
    format!("{stream}-{i:05}-{}", "x".repeat(i % 300)).into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_records_are_acked_cumulatively_and_stored_once_in_order() {
    let f = start(|raw| raw.spool.chunk_target = bytesize::ByteSize::kib(16)).await;
    let mut c = f.client().await;
    let (a, b) = (name("alpha"), name("beta"));
    // Two streams interleaved, sent in pieces without waiting for any answer.
    for i in 0..3000 {
        let (s, n) = if i % 3 == 0 { (&b, "beta") } else { (&a, "alpha") };
        c.record(s, &record(n, i));
        if i % 250 == 0 {
            c.flush().await.expect("writes");
        }
    }
    c.flush().await.expect("writes");
    let mut acked = 0;
    while acked < 3000 {
        match c.reply().await.expect("answers") {
            Some(Reply::Ack { committed }) => {
                assert!(committed > acked, "acks only grow: {committed} after {acked}");
                acked = committed;
            }
            other => panic!("expected acks up to 3000, got {other:?} after {acked}"),
        }
    }
    assert_eq!(c.finish().await.expect("finishes"), Reply::Ack { committed: 3000 });
    let intake = f.agent.intake().records_total.load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(intake, 3000);
    let stored = f.stop_and_read().await;
    let want_alpha: Vec<Vec<u8>> = (0..3000).filter(|i| i % 3 != 0).map(|i| record("alpha", i)).collect();
    let want_beta: Vec<Vec<u8>> = (0..3000).filter(|i| i % 3 == 0).map(|i| record("beta", i)).collect();
    assert_eq!(stored.get("alpha"), Some(&want_alpha));
    assert_eq!(stored.get("beta"), Some(&want_beta));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_beyond_the_gathering_cap_are_acked_without_more_bytes_or_the_end_of_the_stream() {
    // A cap below the default, so that the bound on memory below is the configured one.
    let cap = 192usize << 10;
    let f = start(|raw| raw.intake.stream_pending_bytes = bytesize::ByteSize::b(cap as u64)).await;
    assert!(cap < edge_uploader::record_stream::PENDING_CAP);
    let counters = f.agent.intake().clone();
    let mut c = f.client().await;
    // Far more than one connection gathers per commit, in one write; then only wait. Frames the
    // agent holds unframed at its cap must be framed after the commit, not after the next read.
    let record = vec![b'r'; 10 << 10];
    let n = (8 * cap / record.len()) as u64;
    // Numbered, so the order across batches (an append spans several) is checked below.
    let numbered = |i: u64| {
        let mut r = record.clone();
        r[..8].copy_from_slice(&i.to_le_bytes());
        r
    };
    for i in 0..n {
        c.record(&name("s"), &numbered(i));
    }
    c.flush().await.expect("writes");
    let mut acked = 0;
    while acked < n {
        match tokio::time::timeout(Duration::from_secs(30), c.reply()).await {
            Ok(Ok(Some(Reply::Ack { committed }))) => acked = committed,
            other => panic!("expected acks up to {n}, got {other:?} after {acked}"),
        }
    }
    assert_eq!(c.finish().await.expect("finishes"), Reply::Ack { committed: n });
    // And the same ended at once: at the end of the stream, frames still unframed at the cap
    // are complete frames, not a cut-off one.
    // Several connections at once make the commits slower than the reads, as in service.
    for _ in 0..3 {
        let mut producers = tokio::task::JoinSet::new();
        for k in 0..4 {
            let mut c = f.client().await;
            let record = record.clone();
            producers.spawn(async move {
                for _ in 0..n {
                    c.record(&name(&format!("p{k}")), &record);
                }
                c.finish().await.expect("finishes")
            });
        }
        while let Some(reply) = producers.join_next().await {
            assert_eq!(reply.expect("producer"), Reply::Ack { committed: n });
        }
    }
    let stored = f.stop_and_read().await;
    assert_eq!(stored.get("s").map(Vec::len), Some(n as usize));
    assert!(stored["s"].iter().zip(0..n).all(|(r, i)| *r == numbered(i)), "stream s stored out of order");
    for k in 0..4 {
        assert_eq!(stored.get(&format!("p{k}")).map(Vec::len), Some(3 * n as usize));
    }
    // What the connections held stayed within their bounds: per connection a receive buffer of
    // at most two reads, and one gathering and one committing append of at most the cap and a
    // record. (Reserving receive room with a whole read still unframed grew each connection's
    // buffer by doubling, to megabytes.)
    use edge_uploader::record_stream::READ_SIZE;
    let frame = record.len() + edge_proto::records::RECORD_OVERHEAD;
    let per_connection = 2 * READ_SIZE + 2 * (cap + frame);
    let peak = counters.stream_buffer_peak_bytes.load(std::sync::atomic::Ordering::Relaxed);
    assert!(peak > 0, "the connections' memory is counted");
    assert!(
        peak <= 4 * per_connection as u64,
        "4 connections held {peak} bytes at their peak; bound {}",
        4 * per_connection
    );
    // And every connection gave its share back when it ended.
    assert_eq!(counters.stream_buffer_bytes.load(std::sync::atomic::Ordering::Relaxed), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_connections_share_one_gathering_budget_and_lose_nothing() {
    // The budget for all connections is one connection's own cap, so that the connections
    // contend for it from the first commit on: without it, eight connections could hold sixteen
    // times as much (one gathering and one committing append each).
    let cap = 64usize << 10;
    let f = start(|raw| {
        raw.intake.stream_pending_bytes = bytesize::ByteSize::b(cap as u64);
        raw.intake.stream_pending_total_bytes = bytesize::ByteSize::b(cap as u64);
    })
    .await;
    assert_eq!(f.agent.stream_budget().cap(), cap);
    let (connections, n) = (8u64, 200u64);
    fn numbered(k: u64, i: u64) -> Vec<u8> {
        let mut r = vec![b'r'; 10 << 10];
        r[..16].copy_from_slice(&[k.to_le_bytes(), i.to_le_bytes()].concat());
        r
    }
    let mut producers = tokio::task::JoinSet::new();
    for k in 0..connections {
        let mut c = f.client().await;
        producers.spawn(async move {
            for i in 0..n {
                c.record(&name(&format!("p{k}")), &numbered(k, i));
            }
            c.finish().await.expect("finishes")
        });
    }
    while let Some(reply) = tokio::time::timeout(Duration::from_secs(60), producers.join_next()).await.expect("in time")
    {
        assert_eq!(reply.expect("producer"), Reply::Ack { committed: n });
    }
    // The batch buffers of all connections took at most the budget and one record, at once;
    // with their receive buffers (two reads at most each), that is all they held. And all of
    // it was given back.
    let frame = (10 << 10) + edge_proto::records::RECORD_OVERHEAD;
    let budget = f.agent.stream_budget();
    assert!(budget.peak() >= frame, "the batch buffers are charged");
    let bound = cap + frame + edge_uploader::record_stream::BATCH_OVERHEAD;
    assert!(
        budget.peak() <= bound,
        "the connections' batch buffers took {} bytes at once; bound {bound}",
        budget.peak()
    );
    assert_eq!(budget.used(), 0, "every connection gave its charge back");
    let held = f.agent.intake().stream_buffer_peak_bytes.load(std::sync::atomic::Ordering::Relaxed);
    let held_bound = connections as usize * 2 * edge_uploader::record_stream::READ_SIZE + bound;
    assert!(held <= held_bound as u64, "the connections held {held} bytes at their peak; bound {held_bound}");
    let stored = f.stop_and_read().await;
    for k in 0..connections {
        let got = &stored[&format!("p{k}")];
        assert_eq!(got.len() as u64, n, "stream p{k}");
        assert!(got.iter().zip(0..n).all(|(r, i)| *r == numbered(k, i)), "stream p{k} stored out of order");
    }
}

/// Producers that go away without reading a single ack, some with an append in the spool's
/// hands: each connection's stored records are a prefix of what it sent, in order, and the
/// budget and the gauge come back to zero, once the spool answered the last of those appends
/// (their charge stays with them until then, not until their connection ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn producers_that_vanish_mid_commit_leave_a_prefix_and_their_charges_come_back() {
    let cap = 64usize << 10;
    let f = start(|raw| {
        raw.intake.stream_pending_bytes = bytesize::ByteSize::b(cap as u64);
        raw.intake.stream_pending_total_bytes = bytesize::ByteSize::b(2 * cap as u64);
    })
    .await;
    fn numbered(k: u64, i: u64) -> Vec<u8> {
        let mut r = vec![b'v'; 4 << 10];
        r[..16].copy_from_slice(&[k.to_le_bytes(), i.to_le_bytes()].concat());
        r
    }
    let (connections, n) = (12u64, 100u64);
    for k in 0..connections {
        let mut c = f.client().await;
        for i in 0..n {
            c.record(&name(&format!("v{k}")), &numbered(k, i));
        }
        // Part of it may not go out: the agent stops reading at its caps.
        let _ = tokio::time::timeout(Duration::from_millis(50), c.flush()).await;
        drop(c);
    }
    let budget = f.agent.stream_budget();
    let counters = f.agent.intake();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while budget.used() != 0 || counters.stream_buffer_bytes.load(std::sync::atomic::Ordering::Relaxed) != 0 {
        assert!(std::time::Instant::now() < deadline, "charges never came back: budget {}", budget.used());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let frame = (4 << 10) + edge_proto::records::RECORD_OVERHEAD;
    let bound = 2 * cap + frame + edge_uploader::record_stream::BATCH_OVERHEAD;
    assert!(budget.peak() <= bound, "peak {} past the budget and a record", budget.peak());
    let stored = f.stop_and_read().await;
    for k in 0..connections {
        let got = stored.get(&format!("v{k}")).map_or(&[][..], Vec::as_slice);
        assert!(got.len() as u64 <= n, "stream v{k}: {} records", got.len());
        assert!(got.iter().zip(0..).all(|(r, i)| *r == numbered(k, i)), "stream v{k} is not a prefix of what was sent");
    }
}

/// Sends `good` valid records, then `bad` bytes, and returns the agent's last answer.
async fn refused(f: &Fixture, good: usize, bad: &[u8]) -> Reply {
    let mut c = f.client().await;
    for i in 0..good {
        c.record(&name("s"), &record("s", i));
    }
    c.raw(bad);
    c.finish().await.expect("an answer")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_named_and_the_records_before_it_are_kept() {
    let f = start(|raw| raw.intake.max_record_bytes = bytesize::ByteSize::b(400)).await;
    let mut big = vec![0x02];
    big.extend_from_slice(&401u32.to_le_bytes());
    big.extend_from_slice(&[b'x'; 401]);
    let cases: [(usize, Vec<u8>, u16, &str); 5] = [
        (3, big, 413, "record 4 is 401 bytes; intake.max_record_bytes = 400"),
        (2, [0x01, 3, 0, 0, 0, b'a', b'/', b'b'].to_vec(), 400, "stream \"a/b\" (before record 3)"),
        (1, [0x07, 0, 0, 0, 0].to_vec(), 400, "unknown frame type 0x07"),
        (0, [0x02, 1, 0, 0, 0, b'x'].to_vec(), 400, "record 1 comes before any Stream frame"),
        (4, [0x02, 9, 0, 0, 0, b'x'].to_vec(), 400, "the connection ended inside a frame"),
    ];
    let mut kept = 0;
    for (good, bad, status, detail) in cases {
        // The case of a record before any Stream frame sends no Stream frame at all.
        let reply = refused(&f, good, &bad).await;
        let Reply::Error { committed, status: got, detail: said } = reply else {
            panic!("expected an error for {detail:?}, got {reply:?}")
        };
        assert_eq!((committed, got), (good as u64, status), "{said}");
        assert!(said.contains(detail), "{said:?} should name {detail:?}");
        kept += good;
    }
    // HTTP on the wrong socket is told where to go.
    let mut http =
        tokio::net::UnixStream::connect(f.config.intake.stream_socket.as_ref().expect("on")).await.expect("connects");
    tokio::io::AsyncWriteExt::write_all(&mut http, b"POST /v1/streams/s HTTP/1.1\r\n\r\n").await.expect("writes");
    let mut answer = Vec::new();
    tokio::io::AsyncReadExt::read_to_end(&mut http, &mut answer).await.expect("reads");
    let (reply, _) = edge_proto::intake::parse_reply(&answer).expect("valid").expect("complete");
    assert!(
        matches!(&reply, Reply::Error { committed: 0, status: 400, detail } if detail.contains("looks like HTTP")),
        "{reply:?}"
    );
    let stored = f.stop_and_read().await;
    assert_eq!(stored.get("s").map(Vec::len), Some(kept), "exactly the records before each bad frame");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_spool_ends_the_connection_with_507_and_what_is_stored_is_what_was_acked() {
    let f = start(|raw| {
        raw.spool.max_bytes = bytesize::ByteSize::kib(8);
        raw.spool.chunk_target = bytesize::ByteSize::kib(1);
    })
    .await;
    let mut c = f.client().await;
    for _ in 0..40 {
        c.record(&name("s"), &[b'a'; 1000]);
        // One at a time, so each append is one record and the spool fills record by record.
        c.flush().await.expect("writes");
        match c.reply().await.expect("answers") {
            Some(Reply::Ack { .. }) => {}
            Some(Reply::Error { committed, status, detail }) => {
                assert_eq!(status, 507, "{detail}");
                assert!(detail.contains("spool is full"), "{detail}");
                assert_eq!(f.agent.spool_stats().total_bytes, committed * 1004, "stored = acked");
                assert!(committed > 0);
                let stored = f.stop_and_read().await;
                assert_eq!(stored.get("s").map(Vec::len), Some(committed as usize));
                return;
            }
            None => panic!("closed without an answer"),
        }
    }
    panic!("the spool never filled");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_past_spool_max_streams_ends_the_connection_with_422_and_keeps_the_records_before() {
    let f = start(|raw| raw.spool.max_streams = 1).await;
    let mut c = f.client().await;
    for i in 0..3 {
        c.record(&name("known"), &record("known", i));
    }
    c.flush().await.expect("writes");
    assert_eq!(c.reply().await.expect("answers"), Some(Reply::Ack { committed: 3 }));
    c.record(&name("new"), &record("new", 0));
    c.flush().await.expect("writes");
    match c.reply().await.expect("answers") {
        Some(Reply::Error { committed: 3, status: 422, detail }) => {
            assert!(detail.contains("spool.max_streams") && detail.contains("stream \"new\""), "{detail}");
        }
        other => panic!("expected a 422 after 3 records, got {other:?}"),
    }
    let stored = f.stop_and_read().await;
    assert_eq!(stored.get("known").map(Vec::len), Some(3));
    assert!(!stored.contains_key("new"), "nothing of the refused stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_answers_503_with_the_committed_count() {
    let f = start(|_| {}).await;
    let mut c = f.client().await;
    for i in 0..5 {
        c.record(&name("s"), &record("s", i));
    }
    c.flush().await.expect("writes");
    assert_eq!(c.reply().await.expect("answers"), Some(Reply::Ack { committed: 5 }));
    let stop = tokio::spawn(f.agent.shutdown());
    match c.reply().await.expect("answers") {
        Some(Reply::Error { committed: 5, status: 503, detail }) => {
            assert!(detail.contains("shutting down"), "{detail}")
        }
        other => panic!("expected 503 with 5 committed, got {other:?}"),
    }
    stop.await.expect("shutdown completes");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tcp_port_speaks_the_same_protocol() {
    // Port 0: the agent binds and keeps whatever port the kernel gives it, so nothing can take it
    // between a pick and the bind.
    let f = start(|raw| raw.intake.stream_tcp = Some("127.0.0.1:0".into())).await;
    let addr = f.agent.stream_tcp_addr().expect("stream_tcp bound");
    assert_ne!(addr.port(), 0);
    let io = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let mut c = RecordStreamClient::new(io);
    for i in 0..10 {
        c.record(&name("t"), &record("t", i));
    }
    assert_eq!(c.finish().await.expect("answers"), Reply::Ack { committed: 10 });
    // A refusal reaches the producer over TCP too, though it keeps sending.
    let io = tokio::net::TcpStream::connect(addr).await.expect("connects");
    let mut c = RecordStreamClient::new(io);
    c.raw(&[0x07, 0, 0, 0, 0]);
    c.raw(&vec![0u8; 256 << 10]);
    let reply = c.finish().await.expect("answers");
    assert!(matches!(reply, Reply::Error { committed: 0, status: 400, .. }), "{reply:?}");
    let stored = f.stop_and_read().await;
    assert_eq!(stored.get("t").map(Vec::len), Some(10));
}

/// Sends `rounds` records of `stream`, each after the one before it is committed, reading nothing.
async fn one_commit_per_record(
    f: &Fixture,
    c: &mut RecordStreamClient<tokio::net::UnixStream>,
    stream: &str,
    rounds: u64,
) {
    let committed = || f.agent.intake().records_total.load(std::sync::atomic::Ordering::Relaxed);
    for i in 0..rounds {
        c.record(&name(stream), &record(stream, i as usize));
        tokio::time::timeout(Duration::from_secs(30), c.flush())
            .await
            .unwrap_or_else(|_| panic!("round {i}: the agent stopped reading"))
            .expect("writes");
        let polling = async {
            while committed() <= i {
                tokio::time::sleep(Duration::from_micros(200)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(30), polling)
            .await
            .unwrap_or_else(|_| panic!("round {i}: record {} was never committed", i + 1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producer_that_never_reads_its_acks_is_never_held_back_by_them() {
    // One commit, and so one ack, per round. Each ack the producer leaves unread takes room in
    // the socket far beyond its 13 bytes, so without coalescing them the agent would block in
    // writing one after a few hundred rounds, stop reading, and the producer would hang.
    let f = start(|_| {}).await;
    let mut c = f.client().await;
    let rounds = 2000u64;
    one_commit_per_record(&f, &mut c, "ff", rounds).await;
    // Now it reads: whatever acks were written are cumulative, and the last counts everything.
    assert_eq!(c.finish().await.expect("finishes"), Reply::Ack { committed: rounds });
    let stored = f.stop_and_read().await;
    let want: Vec<Vec<u8>> = (0..rounds as usize).map(|i| record("ff", i)).collect();
    assert_eq!(stored.get("ff"), Some(&want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_does_not_wait_for_a_producer_that_reads_nothing() {
    // Enough unread acks that the socket has no room for the agent's last frame.
    let f = start(|_| {}).await;
    let mut c = f.client().await;
    let rounds = 600u64;
    one_commit_per_record(&f, &mut c, "quiet", rounds).await;
    let dir = f.dir;
    tokio::time::timeout(Duration::from_secs(20), f.agent.shutdown())
        .await
        .expect("shutdown ends though the producer reads nothing");
    drop(c);
    let want: Vec<Vec<u8>> = (0..rounds as usize).map(|i| record("quiet", i)).collect();
    assert_eq!(common::read_spool(dir.path()).get("quiet"), Some(&want), "every committed record is kept");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_connection_gives_its_receive_buffer_back_and_goes_on_as_before() {
    use edge_uploader::record_stream::{QUIET_AFTER, QUIET_BUFFER};
    use std::sync::atomic::Ordering::Relaxed;
    let f = start(|_| {}).await;
    let counters = f.agent.intake().clone();
    let held = || counters.stream_buffer_bytes.load(Relaxed);
    let mut c = f.client().await;
    // One large record grows the connection's receive buffer past one read.
    let large = vec![b'L'; 300 << 10];
    c.record(&name("q"), &large);
    c.flush().await.expect("writes");
    assert_eq!(c.reply().await.expect("answers"), Some(Reply::Ack { committed: 1 }));
    let grown = held();
    assert!(grown > edge_uploader::record_stream::READ_SIZE as u64, "the buffer grew for the record: {grown} bytes");
    // Then the producer is quiet: within two periods the buffer is down to the small one.
    let shrunk = async {
        while held() > QUIET_BUFFER as u64 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(QUIET_AFTER * 2 + Duration::from_secs(5), shrunk)
        .await
        .unwrap_or_else(|_| panic!("a quiet connection still holds {} bytes", held()));
    // The connection goes on: small records and another large one, acked and stored in order.
    for i in 0..50 {
        c.record(&name("q"), &record("q", i));
    }
    c.record(&name("q"), &large);
    assert_eq!(c.finish().await.expect("finishes"), Reply::Ack { committed: 52 });
    // The connection's task gives its share back as it ends, just after its last answer.
    let released = async {
        while held() != 0 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), released)
        .await
        .unwrap_or_else(|_| panic!("a finished connection still holds {} bytes", held()));
    assert_eq!(held(), 0);
    let stored = f.stop_and_read().await;
    let mut want = vec![large.clone()];
    want.extend((0..50).map(|i| record("q", i)));
    want.push(large);
    assert_eq!(stored.get("q"), Some(&want));
}
