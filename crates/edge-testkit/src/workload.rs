//! Workload generator and checker for the reliability battery.
//!
//! Records are deterministic from `(seed, stream, index)` and self-describing: each starts with
//! a printable header naming its seed, stream and index, so the checker can tell a lost record
//! from a duplicate, an unexpected one (not from this workload) and a corrupted one (header
//! readable, content differs from what the generator makes). Records never contain a newline,
//! so they travel as NDJSON through the intake.
//!
//! The producer side keeps, per request, whether the intake acknowledged it. A request whose
//! answer was lost (the agent died mid-request) has an unknown outcome: its records may be
//! stored or not, but all or none, and never twice. The checker holds the store to exactly that.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// A deterministic workload: which streams, what records.
#[derive(Debug, Clone)]
pub struct Workload {
    pub seed: u64,
    pub streams: Vec<String>,
    /// Record bodies are log-uniform between `min_record` and `max_record` bytes (header aside).
    pub min_record: usize,
    pub max_record: usize,
}

impl Workload {
    /// Three streams, records of 1 byte to 64 KiB.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            streams: vec!["temperature".into(), "vibration".into(), "camera.meta".into()],
            min_record: 1,
            max_record: 64 * 1024,
        }
    }

    pub fn with_streams(mut self, streams: &[&str]) -> Self {
        self.streams = streams.iter().map(|s| (*s).to_owned()).collect();
        self
    }

    pub fn with_sizes(mut self, min: usize, max: usize) -> Self {
        self.min_record = min.max(1);
        self.max_record = max.max(self.min_record);
        self
    }

    /// Record `index` of stream number `stream`.
    pub fn record(&self, stream: usize, index: u64) -> Vec<u8> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(
            self.seed ^ (stream as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ index.wrapping_mul(0xD6E8_FEB8_6659_FD93),
        );
        let lo = (self.min_record as f64).ln();
        let hi = (self.max_record as f64).ln();
        let len = if hi > lo { rng.random_range(lo..=hi).exp() as usize } else { self.min_record };
        let len = len.clamp(self.min_record, self.max_record);
        let mut out = format!("wl:{:x}:{stream}:{index}:", self.seed).into_bytes();
        out.extend((0..len).map(|_| rng.random_range(b'!'..=b'~')));
        out
    }

    /// The header of a record, if it is one of ours: `(stream, index)`.
    pub fn identify(&self, record: &[u8]) -> Option<(usize, u64)> {
        let text = std::str::from_utf8(record.get(..record.len().min(64))?).ok()?;
        let mut parts = text.splitn(5, ':');
        (parts.next()? == "wl").then_some(())?;
        (u64::from_str_radix(parts.next()?, 16).ok()? == self.seed).then_some(())?;
        let stream: usize = parts.next()?.parse().ok()?;
        let index: u64 = parts.next()?.parse().ok()?;
        parts.next()?;
        (stream < self.streams.len()).then_some((stream, index))
    }

    /// NDJSON body of records `first..first + count` of `stream`.
    pub fn ndjson(&self, stream: usize, first: u64, count: u64) -> Bytes {
        let mut body = Vec::new();
        for i in first..first + count {
            body.extend_from_slice(&self.record(stream, i));
            body.push(b'\n');
        }
        Bytes::from(body)
    }
}

/// One request as the producer saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Sent {
    pub first: u64,
    pub count: u64,
    /// The intake answered 200 for these records.
    pub acked: bool,
}

/// Shared counters and switches of a running producer.
#[derive(Debug, Clone, Default)]
pub struct Progress {
    /// Records sent (acknowledged or of unknown outcome).
    pub sent: Arc<AtomicU64>,
    /// Records acknowledged by the intake.
    pub acked: Arc<AtomicU64>,
    /// Answers 503/507 (refused as a whole; the producer retries the same records).
    pub refused: Arc<AtomicU64>,
    /// Set to stop the producer after its current request.
    pub stop: Arc<AtomicBool>,
}

/// How one producer behaves.
#[derive(Debug, Clone)]
pub struct ProducerOptions {
    pub stream: usize,
    /// Records to send; `None` runs until `progress.stop`.
    pub total: Option<u64>,
    /// Records per request, uniform in `1..=max_batch`.
    pub max_batch: u64,
    /// Pause after a refusal or a failed request (the agent may be restarting).
    pub retry_pause: Duration,
}

impl ProducerOptions {
    pub fn new(stream: usize) -> Self {
        Self { stream, total: None, max_batch: 200, retry_pause: Duration::from_millis(50) }
    }
}

/// Pushes records of one stream through the intake socket and returns what happened to each
/// request. A refused request (503, 507) is retried with the same records; a request that
/// failed without an answer is logged as unknown and the producer moves on.
pub async fn produce(
    workload: Arc<Workload>,
    socket: PathBuf,
    opts: ProducerOptions,
    progress: Progress,
) -> anyhow::Result<Vec<Sent>> {
    let name = workload.streams.get(opts.stream).context("no such stream")?.clone();
    let mut rng = rand::rngs::StdRng::seed_from_u64(workload.seed ^ opts.stream as u64);
    let mut client = edge_uploader::client::IntakeClient::new(&socket);
    let mut sent = Vec::new();
    let mut next = 0u64;
    let mut failures_in_a_row = 0u32;
    loop {
        if progress.stop.load(Ordering::Relaxed) {
            break;
        }
        let left = opts.total.map_or(u64::MAX, |t| t - next);
        if left == 0 {
            break;
        }
        let count = rng.random_range(1..=opts.max_batch.max(1)).min(left);
        let body = workload.ndjson(opts.stream, next, count);
        loop {
            match client.post(&name, "application/x-ndjson", body.clone()).await {
                Ok(r) if r.status == 200 => {
                    anyhow::ensure!(r.records() == count, "intake acknowledged {} of {count} records", r.records());
                    sent.push(Sent { first: next, count, acked: true });
                    progress.acked.fetch_add(count, Ordering::Relaxed);
                    failures_in_a_row = 0;
                    break;
                }
                Ok(r) if r.status == 503 || r.status == 507 => {
                    progress.refused.fetch_add(1, Ordering::Relaxed);
                    if progress.stop.load(Ordering::Relaxed) {
                        return Ok(sent);
                    }
                    tokio::time::sleep(opts.retry_pause).await;
                }
                Ok(r) => anyhow::bail!("intake answered {}: {}", r.status, r.body),
                Err(e) => {
                    // No answer: the outcome is unknown. Log it and go on with new records.
                    sent.push(Sent { first: next, count, acked: false });
                    failures_in_a_row += 1;
                    anyhow::ensure!(failures_in_a_row < 2000, "intake unreachable for too long: {e:#}");
                    tokio::time::sleep(opts.retry_pause).await;
                    break;
                }
            }
        }
        next += count;
        progress.sent.fetch_add(count, Ordering::Relaxed);
    }
    Ok(sent)
}

/// Pushes records of one stream through the record-stream socket, one connection at a time:
/// a burst of records (uniform in `1..=max_batch`) written at once, then the acknowledgements
/// read until all of them are committed. Records an Ack or Error covered are logged as
/// acknowledged. Records an Error frame left uncommitted are not stored (the protocol says so),
/// and are sent again with the same indices on the next connection: were any of them stored,
/// the checker would find it twice. Records without an answer (the connection broke) are
/// logged one by one as of unknown outcome, since the agent commits a connection's records as a
/// prefix, not as a whole burst.
pub async fn produce_stream(
    workload: Arc<Workload>,
    socket: PathBuf,
    opts: ProducerOptions,
    progress: Progress,
) -> anyhow::Result<Vec<Sent>> {
    use edge_proto::intake::Reply;
    let name = workload.streams.get(opts.stream).context("no such stream")?.clone();
    let name = edge_proto::StreamName::new(&name)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(workload.seed ^ opts.stream as u64);
    let mut sent = Vec::new();
    let mut next = 0u64;
    let mut failures_in_a_row = 0u32;
    let done = |next: u64| opts.total.is_some_and(|t| next >= t) || progress.stop.load(Ordering::Relaxed);
    while !done(next) {
        let mut client = match edge_uploader::client::RecordStreamClient::connect(&socket).await {
            Ok(c) => c,
            Err(e) => {
                failures_in_a_row += 1;
                anyhow::ensure!(failures_in_a_row < 2000, "record-stream socket unreachable for too long: {e:#}");
                tokio::time::sleep(opts.retry_pause).await;
                continue;
            }
        };
        // Index of the connection's first record; `committed` counts from it.
        let first = next;
        let mut committed = 0u64;
        let end: Result<(), Option<u16>> = loop {
            if done(next) {
                break Ok(());
            }
            let count = rng.random_range(1..=opts.max_batch.max(1)).min(opts.total.map_or(u64::MAX, |t| t - next));
            for i in next..next + count {
                client.record(&name, &workload.record(opts.stream, i));
            }
            next += count;
            if client.flush().await.is_err() {
                break Err(None);
            }
            let target = next - first;
            let outcome = loop {
                match client.reply().await {
                    Ok(Some(Reply::Ack { committed: c })) => {
                        progress.acked.fetch_add(c - committed, Ordering::Relaxed);
                        committed = c;
                        if c == target {
                            break Ok(());
                        }
                    }
                    Ok(Some(Reply::Error { committed: c, status, detail })) => {
                        progress.acked.fetch_add(c - committed, Ordering::Relaxed);
                        committed = c;
                        anyhow::ensure!(
                            status == 503 || status == 507,
                            "record-stream intake answered {status}: {detail}"
                        );
                        break Err(Some(status));
                    }
                    Ok(None) | Err(_) => break Err(None),
                }
            };
            if outcome.is_err() {
                break outcome;
            }
        };
        if committed > 0 {
            sent.push(Sent { first, count: committed, acked: true });
            failures_in_a_row = 0;
        }
        match end {
            Ok(()) => {
                let _ = client.finish().await;
            }
            // Refused: the rest is not stored; send it again.
            Err(Some(_)) => {
                progress.refused.fetch_add(1, Ordering::Relaxed);
                next = first + committed;
                tokio::time::sleep(opts.retry_pause).await;
            }
            // No answer for the rest: unknown, each record on its own.
            Err(None) => {
                for i in first + committed..next {
                    sent.push(Sent { first: i, count: 1, acked: false });
                }
                failures_in_a_row += 1;
                anyhow::ensure!(failures_in_a_row < 2000, "record-stream connections keep breaking");
                tokio::time::sleep(opts.retry_pause).await;
            }
        }
        progress.sent.store(next, Ordering::Relaxed);
    }
    Ok(sent)
}

/// What the checker found, for one stream or summed over all.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Report {
    /// Records acknowledged to producers.
    pub acked: u64,
    /// Records found in the store (all kinds).
    pub stored: u64,
    /// Acknowledged records missing from the store.
    pub lost: u64,
    /// Extra copies of records of this workload in the store.
    pub duplicates_stored: u64,
    /// Stored records that are not from this workload, or were never sent.
    pub unexpected: u64,
    /// Stored records whose header is ours but whose content is not what was sent.
    pub corrupted: u64,
    /// Records of requests with unknown outcome that were stored (allowed, whole requests only).
    pub uncertain_stored: u64,
    /// Requests of unknown outcome stored only in part (must be 0: a request is atomic).
    pub partial_requests: u64,
    /// Records stored out of order within their stream.
    pub out_of_order: u64,
}

impl Report {
    /// True when nothing acknowledged is lost and nothing is stored twice, wrong or torn.
    pub fn is_exact(&self) -> bool {
        self.lost == 0
            && self.duplicates_stored == 0
            && self.unexpected == 0
            && self.corrupted == 0
            && self.partial_requests == 0
    }

    pub fn add(&mut self, o: &Report) {
        self.acked += o.acked;
        self.stored += o.stored;
        self.lost += o.lost;
        self.duplicates_stored += o.duplicates_stored;
        self.unexpected += o.unexpected;
        self.corrupted += o.corrupted;
        self.uncertain_stored += o.uncertain_stored;
        self.partial_requests += o.partial_requests;
        self.out_of_order += o.out_of_order;
    }

    pub fn to_json(&self) -> serde_json::Value {
        serde_json::to_value(self).unwrap_or(serde_json::Value::Null)
    }
}

/// Checks the records stored for stream number `stream` against what its producer saw.
pub fn check_stream(workload: &Workload, stream: usize, sent: &[Sent], stored: &[Vec<u8>]) -> Report {
    let mut report = Report { stored: stored.len() as u64, ..Report::default() };
    // index → times seen (only for records of this stream).
    let mut seen: HashMap<u64, u64> = HashMap::new();
    let mut last_index: Option<u64> = None;
    for rec in stored {
        match workload.identify(rec) {
            Some((s, i)) if s == stream => {
                if workload.record(s, i) != *rec {
                    report.corrupted += 1;
                    continue;
                }
                let n = seen.entry(i).or_insert(0);
                *n += 1;
                if *n > 1 {
                    report.duplicates_stored += 1;
                } else if last_index.is_some_and(|l| i < l) {
                    report.out_of_order += 1;
                }
                last_index = Some(last_index.map_or(i, |l| l.max(i)));
            }
            _ => report.unexpected += 1,
        }
    }
    let mut known = 0u64;
    for req in sent {
        let present = (req.first..req.first + req.count).filter(|i| seen.contains_key(i)).count() as u64;
        known += req.count;
        if req.acked {
            report.acked += req.count;
            report.lost += req.count - present;
        } else {
            report.uncertain_stored += present;
            if present != 0 && present != req.count {
                report.partial_requests += 1;
            }
        }
    }
    // Stored records of this stream that no request covered.
    let covered: u64 = sent.iter().map(|r| r.first + r.count).max().unwrap_or(0);
    report.unexpected += seen.keys().filter(|&&i| i >= covered).count() as u64;
    debug_assert!(known >= covered || sent.is_empty());
    report
}

/// Checks every stream of `workload` against an ingest store through `edge-ingest export`.
pub fn check_store(workload: &Workload, data_dir: &Path, sent: &[Vec<Sent>]) -> anyhow::Result<Report> {
    let mut total = Report::default();
    for (stream, name) in workload.streams.iter().enumerate() {
        let stored = export_raw(data_dir, name)?;
        let r = check_stream(workload, stream, sent.get(stream).map_or(&[][..], Vec::as_slice), &stored);
        total.add(&r);
    }
    Ok(total)
}

/// The records stored for `stream`, from `edge-ingest export --format raw`.
pub fn export_raw(data_dir: &Path, stream: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let out = std::process::Command::new(crate::bin("edge-ingest")?)
        .arg("export")
        .arg("--data-dir")
        .arg(data_dir)
        .args(["--stream", stream, "--format", "raw"])
        .output()?;
    anyhow::ensure!(out.status.success(), "export failed: {}", String::from_utf8_lossy(&out.stderr));
    let mut recs = Vec::new();
    let mut rest = &out.stdout[..];
    while !rest.is_empty() {
        anyhow::ensure!(rest.len() >= 4, "export output truncated");
        let len = u32::from_le_bytes([rest[0], rest[1], rest[2], rest[3]]) as usize;
        anyhow::ensure!(rest.len() >= 4 + len, "export output truncated inside a record");
        recs.push(rest[4..4 + len].to_vec());
        rest = &rest[4 + len..];
    }
    Ok(recs)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sent(first: u64, count: u64, acked: bool) -> Sent {
        Sent { first, count, acked }
    }

    #[test]
    fn records_are_deterministic_identifiable_and_newline_free() {
        let w = Workload::new(7);
        let r = w.record(1, 42);
        assert_eq!(r, w.record(1, 42));
        assert_ne!(r, w.record(1, 43));
        assert!(!r.contains(&b'\n'));
        assert_eq!(w.identify(&r), Some((1, 42)));
        assert_eq!(Workload::new(8).identify(&r), None, "another seed's record is not ours");
    }

    #[test]
    fn checker_counts_each_kind_of_damage() {
        let w = Workload::new(1).with_sizes(10, 100);
        let log = [sent(0, 3, true), sent(3, 2, false), sent(5, 2, false), sent(7, 1, true)];
        let rec = |i| w.record(0, i);
        let mut bad = rec(7);
        let last = bad.len() - 1;
        bad[last] ^= 1;
        // 0,1,2 stored; 3 and 4 of the unknown request stored whole; 5 of the next one only in
        // part; 1 twice; 7 corrupted (so lost); one stranger; one record never sent.
        let stored = vec![rec(0), rec(1), rec(1), rec(2), rec(3), rec(4), rec(5), bad, b"x".to_vec(), rec(99)];
        let r = check_stream(&w, 0, &log, &stored);
        assert_eq!(r.acked, 4);
        assert_eq!(r.lost, 1);
        assert_eq!(r.duplicates_stored, 1);
        assert_eq!(r.corrupted, 1);
        assert_eq!(r.unexpected, 2);
        assert_eq!(r.uncertain_stored, 3);
        assert_eq!(r.partial_requests, 1);
        assert!(!r.is_exact());
    }

    #[test]
    fn checker_accepts_an_exact_store() {
        let w = Workload::new(3).with_sizes(1, 50);
        let log = [sent(0, 5, true), sent(5, 5, false), sent(10, 5, true)];
        let stored: Vec<_> = (0..5).chain(10..15).map(|i| w.record(2, i)).collect();
        let r = check_stream(&w, 2, &log, &stored);
        assert!(r.is_exact(), "{r:?}");
        assert_eq!((r.acked, r.stored, r.out_of_order), (10, 10, 0));
    }
}
