//! Both daemons' `/metrics` against the truth: a producer pushes a known number of records and
//! bytes on two streams through the agent's intake socket, waits for the agent to report its
//! spool drained, then scrapes both endpoints. What the agent says it took in, what it says the
//! server stored and what the server says it stored must all agree with what was sent.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use edge_uploader::client::IntakeClient;

use crate::common::World;

/// Streams and how many records each gets.
const STREAMS: [(&str, u64); 2] = [("temperature", 2_500), ("vibration", 900)];
/// Records per intake request.
const PER_REQUEST: u64 = 100;
/// Bytes of framing the spool and the wire add to each record (a `u32` length).
const FRAMING: u64 = 4;

/// Record `i` of `stream`: one JSON line of 30 to 430 bytes.
fn record(stream: &str, i: u64) -> Vec<u8> {
    let pad = "x".repeat(usize::try_from(i * 37 % 400).unwrap_or(0));
    format!(r#"{{"stream":"{stream}","i":{i},"pad":"{pad}"}}"#).into_bytes()
}

/// Polls the agent's status until its spool is drained (nothing open, nothing sealed, nothing
/// in flight), for up to two minutes; returns that status.
async fn drained(client: &mut IntakeClient) -> anyhow::Result<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let s = client.get_json("/v1/status").await?.body;
        if s["spool"]["sealed_chunks"] == 0 && s["spool"]["open_bytes"] == 0 && s["upload"]["in_flight"] == 0 {
            return Ok(s);
        }
        anyhow::ensure!(Instant::now() < deadline, "agent did not drain: {s}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn counters_of_both_daemons_agree_with_what_was_sent_and_stored() -> anyhow::Result<()> {
    let world = World::new("gw-metrics-01", "")?;
    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;

    let (sent, status) = rt.block_on(async {
        let mut client = IntakeClient::new(world.intake_socket());
        // One refused request: counted by its reason, stores nothing.
        let refused = client.post("temperature", "text/csv", Bytes::from_static(b"a,b\n")).await?;
        anyhow::ensure!(refused.status == 415, "text/csv was not refused: {} {}", refused.status, refused.body);

        // The two streams interleaved, request by request.
        let mut sent: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
        let mut next = [0u64; STREAMS.len()];
        while next.iter().zip(STREAMS).any(|(n, (_, total))| *n < total) {
            for (k, (stream, total)) in STREAMS.into_iter().enumerate() {
                let first = next[k];
                let count = PER_REQUEST.min(total - first);
                if count == 0 {
                    continue;
                }
                let mut body = Vec::new();
                let mut bytes = 0;
                for i in first..first + count {
                    let r = record(stream, i);
                    bytes += r.len() as u64;
                    body.extend_from_slice(&r);
                    body.push(b'\n');
                }
                let r = client.post(stream, "application/x-ndjson", Bytes::from(body)).await?;
                anyhow::ensure!(r.status == 200, "intake answered {}: {}", r.status, r.body);
                anyhow::ensure!(r.records() == count && r.body["bytes"] == bytes, "intake counted {}", r.body);
                let e = sent.entry(stream).or_default();
                e.0 += count;
                e.1 += bytes;
                next[k] += count;
            }
        }

        Ok((sent, drained(&mut client).await?))
    })?;

    let a = World::scrape(world.agent_metrics).context("scraping the agent")?;
    let i = World::scrape(world.ingest_metrics).context("scraping the ingest server")?;
    let get = |m: &BTreeMap<String, f64>, series: &str| -> anyhow::Result<u64> {
        let v = m.get(series).copied().with_context(|| format!("{series} is not exported"))?;
        anyhow::ensure!(v >= 0.0 && v.fract() == 0.0, "{series} = {v} is not a count");
        Ok(v as u64)
    };
    let records_sent: u64 = sent.values().map(|(r, _)| r).sum();
    let bytes_sent: u64 = sent.values().map(|(_, b)| b).sum();

    // Intake: per stream exactly what was sent, one refusal with its reason.
    for (stream, (records, bytes)) in &sent {
        assert_eq!(get(&a, &format!("edge_uploader_intake_records_total{{stream=\"{stream}\"}}"))?, *records);
        assert_eq!(get(&a, &format!("edge_uploader_intake_bytes_total{{stream=\"{stream}\"}}"))?, *bytes);
    }
    assert_eq!(status["intake"]["records_total"], records_sent, "status and metrics count the same: {status}");
    assert_eq!(get(&a, "edge_uploader_intake_rejected_total{reason=\"unsupported_content_type\"}")?, 1);
    assert_eq!(get(&a, "edge_uploader_intake_rejected_total{reason=\"spool_full\"}")?, 0);
    assert_eq!(get(&a, "edge_uploader_dropped_records_total{reason=\"spool_full\"}")?, 0);

    // A clean run: one connection, no retries, rejections or duplicates on either side.
    assert_eq!(get(&a, "edge_uploader_connected")?, 1);
    assert_eq!(get(&a, "edge_uploader_reconnects_total")?, 0);
    for result in ["duplicate", "retry", "rejected"] {
        assert_eq!(get(&a, &format!("edge_uploader_upload_chunks_total{{result=\"{result}\"}}"))?, 0, "{result}");
        assert_eq!(get(&i, &format!("edge_ingest_chunks_total{{result=\"{result}\"}}"))?, 0, "{result}");
    }
    assert_eq!(get(&i, "edge_ingest_connections")?, 1);
    assert_eq!(get(&i, "edge_ingest_connections_total")?, 1);
    assert_eq!(get(&i, "edge_ingest_auth_failures_total")?, 0);
    assert_eq!(get(&i, "edge_ingest_protocol_errors_total")?, 0);

    // What the agent saw acked is what the server stored: chunks, records, bytes.
    let chunks = get(&a, "edge_uploader_upload_chunks_total{result=\"stored\"}")?;
    assert!(chunks >= 2, "two streams make at least two chunks, got {chunks}");
    assert_eq!(get(&i, "edge_ingest_chunks_total{result=\"stored\"}")?, chunks);
    assert_eq!(get(&i, "edge_ingest_records_total")?, records_sent);
    let framed = bytes_sent + FRAMING * records_sent;
    assert_eq!(get(&a, "edge_uploader_upload_bytes_total{result=\"stored\"}")?, framed);
    // zstd is on by default: the server counts chunk bytes as they came off the wire, as the
    // agent counts them when it writes them (a clean run: no chunk was sent twice).
    let wire = get(&a, "edge_uploader_upload_wire_bytes_total")?;
    assert_eq!(get(&i, "edge_ingest_bytes_total")?, wire, "agent and server count the same bytes on the wire");
    assert!(
        wire > 0 && wire < framed / 2,
        "the default compression sent {wire} bytes for {framed} framed record bytes"
    );
    assert_eq!(status["upload"]["wire_bytes_total"], wire, "status and metrics count the same: {status}");
    // Every accepted request waited for a spool commit, timed once per commit (a group commit
    // answers many requests; a commit that only seals counts too).
    let commits = get(&a, "edge_uploader_spool_commit_seconds_count")?;
    assert!((1..=records_sent + chunks).contains(&commits), "{commits} spool commits timed");

    // Nothing left behind.
    assert_eq!(get(&a, "edge_uploader_spool_bytes")?, 0);
    assert_eq!(get(&a, "edge_uploader_spool_chunks")?, 0);
    assert_eq!(get(&a, "edge_uploader_spool_oldest_unacked_age_seconds")?, 0);
    assert_eq!(get(&a, "edge_uploader_chunks_in_flight")?, 0);

    // One histogram observation per chunk.
    for (m, h) in [
        (&a, "edge_uploader_chunk_upload_latency_seconds"),
        (&a, "edge_uploader_end_to_end_latency_seconds"),
        (&i, "edge_ingest_persist_latency_seconds"),
    ] {
        assert_eq!(get(m, &format!("{h}_count"))?, chunks, "{h}");
        assert_eq!(get(m, &format!("{h}_bucket{{le=\"+Inf\"}}"))?, chunks, "{h}");
        assert!(m[&format!("{h}_sum")] > 0.0, "{h}: some time passed");
    }

    // The one connection's attempt reached its session once.
    assert_eq!(get(&a, "edge_uploader_connect_seconds_count")?, 1);
    assert!(a["edge_uploader_connect_seconds_sum"] > 0.0, "the handshake took some time");

    // Group commit: at least one fsync, never more than one per chunk.
    let fsyncs = get(&i, "edge_ingest_store_fsyncs_total")?;
    assert!((1..=chunks).contains(&fsyncs), "{fsyncs} fsyncs for {chunks} chunks");

    // QUIC path figures were sampled; process metrics are there.
    assert!(a["edge_uploader_quic_rtt_seconds"] > 0.0, "rtt sampled");
    assert!(get(&a, "edge_uploader_quic_congestion_window_bytes")? > 0, "cwnd sampled");
    get(&a, "edge_uploader_quic_lost_packets_total")?;
    for m in [&a, &i] {
        assert!(get(m, "process_resident_memory_bytes")? > 0);
    }
    eprintln!("{records_sent} records, {bytes_sent} bytes, {chunks} chunks, {fsyncs} fsyncs: metrics agree");

    let agent_exit = agent.terminate(Duration::from_secs(30))?;
    let ingest_exit = ingest.terminate(Duration::from_secs(30))?;
    assert!(agent_exit.success(), "agent exit after SIGTERM: {agent_exit}");
    assert!(ingest_exit.success(), "ingest exit after SIGTERM: {ingest_exit}");
    Ok(())
}

/// A slow producer during an outage: one record every 30 ms, slower than `linger` (20 ms),
/// with the ingest down. The records wait in open batches rather than being sealed one chunk
/// each by `linger`: once the ingest is up they go in one chunk (before, the outage's records
/// went in one chunk per record, each compressed on its own). Nothing is lost or doubled.
#[test]
fn records_that_trickle_in_during_an_outage_go_up_in_one_chunk() -> anyhow::Result<()> {
    const RECORDS: u64 = 25;
    let world = World::new("gw-outage-01", "")?;
    let mut agent = world.start_agent()?;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let mut client = IntakeClient::new(world.intake_socket());
    let held = rt.block_on(async {
        for i in 0..RECORDS {
            let mut body = record("trickle", i);
            body.push(b'\n');
            let r = client.post("trickle", "application/x-ndjson", Bytes::from(body)).await?;
            anyhow::ensure!(r.status == 200, "intake answered {}: {}", r.status, r.body);
            // The producer's pace (not a wait for an event): each record comes after the
            // previous one's open batch has passed `linger`.
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
        Ok(client.get_json("/v1/status").await?.body)
    })?;
    assert_eq!(held["spool"]["sealed_chunks"], 0, "nothing sealed while no uploader could send it: {held}");
    assert_eq!(held["spool"]["open_records"], RECORDS, "every record kept in open batches: {held}");

    let mut ingest = world.start_ingest()?;
    rt.block_on(drained(&mut client))?;
    let a = World::scrape(world.agent_metrics).context("scraping the agent")?;
    assert_eq!(a.get("edge_uploader_upload_chunks_total{result=\"stored\"}").copied(), Some(1.0), "one chunk");
    let stored = world.export_raw("trickle")?;
    let expected: Vec<Vec<u8>> = (0..RECORDS).map(|i| record("trickle", i)).collect();
    assert_eq!(stored, expected, "every record stored once, in order");

    let agent_exit = agent.terminate(Duration::from_secs(30))?;
    let ingest_exit = ingest.terminate(Duration::from_secs(30))?;
    assert!(agent_exit.success(), "agent exit after SIGTERM: {agent_exit}");
    assert!(ingest_exit.success(), "ingest exit after SIGTERM: {ingest_exit}");
    Ok(())
}
