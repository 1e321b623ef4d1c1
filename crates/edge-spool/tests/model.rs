//! Model test: random action sequences (append, seal, read, ack, quarantine, limit changes,
//! reopen) run against the real spool and an obviously correct in-memory model side by side;
//! after every action the sealed chunks (metadata and bytes), sequence numbers and counters of
//! both must be equal.
//!
//! Case count: 48 by default (fast in debug builds); set `PROPTEST_CASES` for longer runs.
//! Failing cases are persisted in `proptest-regressions/model.txt` (commit that file).

use std::collections::{BTreeMap, VecDeque};
use std::time::Duration;

use edge_spool::{
    AckReport, AppendOutcome, AppendRequest, Batch, ChunkId, ChunkMeta, Durability, FullPolicy, Spool, SpoolError,
    SpoolOptions, SpoolReader, SpoolStats, StreamStats,
};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

const STREAMS: [&str; 3] = ["alpha", "beta", "gamma"];
const TARGET: u64 = 200;
const LINGER_MS: u64 = 50;

#[derive(Debug, Clone)]
enum Action {
    /// One group commit; each inner vec is a request of (stream index, data, records).
    Append(Vec<Vec<(usize, Vec<u8>, u32)>>),
    SealAll,
    SealDue,
    /// Move the clock by this many ms (negative: the clock went backwards).
    Tick(i64),
    /// The uploader takes the next sealed chunk after its cursor and reads it.
    ReadNext,
    /// Ack one or two of the chunks read so far (by position, modulo), possibly twice.
    Ack(usize, Option<usize>),
    /// Ack an id that never existed.
    AckUnknown(u8),
    /// Quarantine the live chunk at this position (modulo), or an unknown id if none.
    Quarantine(usize),
    SetLimits(u64, bool),
    Reopen,
}

fn action() -> impl Strategy<Value = Action> {
    let batch = (0..STREAMS.len(), prop::collection::vec(any::<u8>(), 0..120), 0u32..5);
    let request = prop::collection::vec(batch, 0..4);
    prop_oneof![
        8 => prop::collection::vec(request, 1..4).prop_map(Action::Append),
        2 => Just(Action::SealAll),
        3 => Just(Action::SealDue),
        4 => (-20i64..80).prop_map(Action::Tick),
        5 => Just(Action::ReadNext),
        4 => (any::<usize>(), prop::option::of(any::<usize>()))
            .prop_map(|(a, b)| Action::Ack(a, b)),
        1 => any::<u8>().prop_map(Action::AckUnknown),
        1 => any::<usize>().prop_map(Action::Quarantine),
        1 => (300u64..3_000, any::<bool>()).prop_map(|(m, d)| Action::SetLimits(m, d)),
        2 => Just(Action::Reopen),
    ]
}

#[derive(Debug, Clone, PartialEq)]
struct MBatch {
    data: Vec<u8>,
    records: u32,
    ms: u64,
}

#[derive(Debug, Clone, PartialEq)]
struct MChunk {
    id: i64,
    stream: String,
    seq: u64,
    data: Vec<u8>,
    records: u32,
    first_ms: u64,
    sealed_ms: u64,
}

#[derive(Debug, Default)]
struct MStream {
    next_seq: u64,
    open: Vec<MBatch>,
    /// Live sealed chunks of this stream, oldest first.
    chunks: VecDeque<MChunk>,
}

/// The obviously correct model.
#[derive(Debug, Default)]
struct Model {
    streams: BTreeMap<String, MStream>,
    quarantined: Vec<MChunk>,
    next_chunk_id: i64,
    dropped_chunks: u64,
    dropped_records: u64,
    max_bytes: u64,
    drop_oldest: bool,
}

impl Model {
    fn open_bytes(&self) -> u64 {
        self.streams.values().flat_map(|s| &s.open).map(|b| b.data.len() as u64).sum()
    }

    fn total_bytes(&self) -> u64 {
        let sealed: u64 = self.streams.values().flat_map(|s| &s.chunks).map(|c| c.data.len() as u64).sum();
        sealed + self.open_bytes()
    }

    /// All live chunks in sealing (id) order.
    fn chunks(&self) -> Vec<&MChunk> {
        let mut all: Vec<&MChunk> = self.streams.values().flat_map(|s| &s.chunks).collect();
        all.sort_by_key(|c| c.id);
        all
    }

    fn seal(&mut self, name: &str, now: u64) -> bool {
        let s = self.streams.get_mut(name).expect("model: sealing a known stream");
        if s.open.is_empty() {
            return false;
        }
        let open = std::mem::take(&mut s.open);
        let chunk = MChunk {
            id: self.next_chunk_id,
            stream: name.to_string(),
            seq: s.next_seq,
            data: open.iter().flat_map(|b| b.data.iter().copied()).collect(),
            records: open.iter().map(|b| b.records).sum(),
            first_ms: open.iter().map(|b| b.ms).min().expect("model: open is not empty"),
            sealed_ms: now,
        };
        self.next_chunk_id += 1;
        s.next_seq += 1;
        s.chunks.push_back(chunk);
        true
    }

    fn append(&mut self, reqs: &[Vec<(usize, Vec<u8>, u32)>], now: u64) -> Vec<AppendOutcome> {
        let mut out = Vec::new();
        for req in reqs {
            let bytes: u64 = req.iter().map(|(_, d, _)| d.len() as u64).sum();
            let fits = if bytes > self.max_bytes {
                false
            } else if self.total_bytes() + bytes <= self.max_bytes {
                true
            } else if !self.drop_oldest || self.open_bytes() + bytes > self.max_bytes {
                false
            } else {
                while self.total_bytes() + bytes > self.max_bytes {
                    let oldest = self.chunks()[0].stream.clone();
                    let c = self.streams.get_mut(&oldest).and_then(|s| s.chunks.pop_front());
                    let c = c.expect("model: a sealed chunk exists while over the limit");
                    self.dropped_chunks += 1;
                    self.dropped_records += u64::from(c.records);
                }
                true
            };
            if !fits {
                out.push(AppendOutcome::Full);
                continue;
            }
            for (i, data, records) in req {
                let name = STREAMS[*i];
                let s = self
                    .streams
                    .entry(name.to_string())
                    .or_insert_with(|| MStream { next_seq: 1, ..MStream::default() });
                s.open.push(MBatch { data: data.clone(), records: *records, ms: now });
                if s.open.iter().map(|b| b.data.len() as u64).sum::<u64>() >= TARGET {
                    self.seal(name, now);
                }
            }
            out.push(AppendOutcome::Accepted);
        }
        out
    }

    fn seal_due(&mut self, now: u64) -> u32 {
        let due: Vec<String> = self
            .streams
            .iter()
            .filter(|(_, s)| s.open.iter().map(|b| b.ms).min().is_some_and(|t| now < t || now - t >= LINGER_MS))
            .map(|(n, _)| n.clone())
            .collect();
        due.iter().filter(|n| self.seal(n, now)).count() as u32
    }

    fn seal_all(&mut self, now: u64) -> u32 {
        let names: Vec<String> = self.streams.keys().cloned().collect();
        names.iter().filter(|n| self.seal(n, now)).count() as u32
    }

    /// Removes a live chunk; true if it was there.
    fn take(&mut self, id: i64) -> Option<MChunk> {
        for s in self.streams.values_mut() {
            if let Some(pos) = s.chunks.iter().position(|c| c.id == id) {
                return s.chunks.remove(pos);
            }
        }
        None
    }

    fn stats(&self) -> SpoolStats {
        let mut st = SpoolStats {
            dropped_chunks: self.dropped_chunks,
            dropped_records: self.dropped_records,
            quarantined_chunks: self.quarantined.len() as u64,
            ..SpoolStats::default()
        };
        for (name, s) in &self.streams {
            let sealed_bytes: u64 = s.chunks.iter().map(|c| c.data.len() as u64).sum();
            let open_bytes: u64 = s.open.iter().map(|b| b.data.len() as u64).sum();
            let oldest = s.open.iter().map(|b| b.ms).chain(s.chunks.iter().map(|c| c.first_ms)).min();
            st.sealed_chunks += s.chunks.len() as u64;
            st.sealed_bytes += sealed_bytes;
            st.open_bytes += open_bytes;
            st.open_records += s.open.iter().map(|b| u64::from(b.records)).sum::<u64>();
            st.oldest_ms = match (st.oldest_ms, oldest) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            st.streams.push(StreamStats {
                name: name.clone(),
                next_seq: s.next_seq,
                sealed_chunks: s.chunks.len() as u64,
                bytes: sealed_bytes + open_bytes,
                oldest_ms: oldest,
            });
        }
        st.total_bytes = st.sealed_bytes + st.open_bytes;
        st
    }
}

/// The system under test plus the uploader-side state a real agent would keep.
struct Real {
    _dir: tempfile::TempDir,
    opts: SpoolOptions,
    spool: Spool,
    reader: SpoolReader,
    cursor: Option<ChunkId>,
    read: Vec<ChunkId>,
}

impl Real {
    /// Closes both connections, then opens the spool again; the uploader forgets what it read.
    fn reopen(self) -> (Real, edge_spool::OpenReport) {
        let Real { _dir, opts, spool, reader, .. } = self;
        drop(reader);
        drop(spool);
        let (spool, report) = Spool::open(opts.clone()).expect("reopen");
        let reader = spool.reader().expect("reader");
        (Real { _dir, opts, spool, reader, cursor: None, read: Vec::new() }, report)
    }
}

fn check(real: &mut Real, model: &Model) -> Result<(), TestCaseError> {
    prop_assert_eq!(real.spool.stats(), model.stats());
    let metas = real.reader.sealed_after(None, usize::MAX).expect("list");
    let want: Vec<ChunkMeta> = model
        .chunks()
        .iter()
        .map(|c| ChunkMeta {
            id: ChunkId(c.id),
            stream: c.stream.clone(),
            seq: c.seq,
            records: c.records,
            bytes: c.data.len() as u64,
            first_ms: c.first_ms,
            sealed_ms: c.sealed_ms,
        })
        .collect();
    prop_assert_eq!(&metas, &want);
    for (meta, chunk) in metas.iter().zip(model.chunks()) {
        prop_assert_eq!(&real.reader.read(meta).expect("read"), &chunk.data);
    }
    let q = real.reader.quarantined().expect("quarantined");
    let mut want_q: Vec<i64> = model.quarantined.iter().map(|c| c.id).collect();
    want_q.sort_unstable();
    prop_assert_eq!(q.iter().map(|q| q.meta.id.0).collect::<Vec<_>>(), want_q);
    Ok(())
}

fn run(actions: Vec<Action>, durability: Durability) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut opts = SpoolOptions::new(dir.path().join("spool.db"));
    opts.durability = durability;
    opts.max_bytes = 1_500;
    opts.full_policy = FullPolicy::Reject;
    opts.chunk_target_bytes = TARGET;
    opts.linger = Duration::from_millis(LINGER_MS);
    let (spool, report) = Spool::open(opts.clone()).expect("open");
    prop_assert!(report.created);
    let id = spool.id();
    let reader = spool.reader().expect("reader");
    let mut real = Real { _dir: dir, opts, spool, reader, cursor: None, read: Vec::new() };
    let mut model = Model { next_chunk_id: 1, max_bytes: 1_500, ..Model::default() };
    let mut now: u64 = 1_000_000;

    for action in actions {
        match action {
            Action::Append(reqs) => {
                let real_reqs: Vec<AppendRequest> = reqs
                    .iter()
                    .map(|r| AppendRequest {
                        batches: r
                            .iter()
                            .map(|(i, data, records)| Batch {
                                stream: STREAMS[*i].into(),
                                data: data.clone(),
                                records: *records,
                            })
                            .collect(),
                    })
                    .collect();
                let got = real.spool.append(&real_reqs, now).expect("append");
                prop_assert_eq!(got, model.append(&reqs, now));
            }
            Action::SealAll => {
                prop_assert_eq!(real.spool.seal_all(now).expect("seal_all"), model.seal_all(now));
            }
            Action::SealDue => {
                prop_assert_eq!(real.spool.seal_due(now).expect("seal_due"), model.seal_due(now));
            }
            Action::Tick(dt) => now = now.saturating_add_signed(dt),
            Action::ReadNext => {
                let next = real.reader.sealed_after(real.cursor, 1).expect("sealed_after");
                let want = model.chunks().into_iter().find(|c| real.cursor.is_none_or(|k| c.id > k.0)).cloned();
                prop_assert_eq!(next.first().map(|m| m.id.0), want.as_ref().map(|c| c.id));
                if let (Some(meta), Some(chunk)) = (next.first(), want) {
                    prop_assert_eq!(real.reader.read(meta).expect("read"), chunk.data);
                    real.cursor = Some(meta.id);
                    real.read.push(meta.id);
                }
            }
            Action::Ack(a, b) => {
                if real.read.is_empty() {
                    continue;
                }
                let mut ids = vec![real.read[a % real.read.len()]];
                if let Some(b) = b {
                    ids.push(real.read[b % real.read.len()]);
                }
                let mut want = AckReport::default();
                for id in &ids {
                    if model.take(id.0).is_some() {
                        want.acked += 1;
                    } else {
                        want.unknown += 1;
                    }
                }
                prop_assert_eq!(real.spool.ack(&ids).expect("ack"), want);
            }
            Action::AckUnknown(k) => {
                let id = ChunkId(model.next_chunk_id + i64::from(k));
                prop_assert_eq!(real.spool.ack(&[id]).expect("ack"), AckReport { acked: 0, unknown: 1 });
            }
            Action::Quarantine(pick) => {
                let live = model.chunks();
                if live.is_empty() {
                    let id = ChunkId(model.next_chunk_id + 5);
                    prop_assert!(matches!(real.spool.quarantine(id, "model"), Err(SpoolError::ChunkGone(_))));
                } else {
                    let id = live[pick % live.len()].id;
                    real.spool.quarantine(ChunkId(id), "model").expect("quarantine");
                    let c = model.take(id).expect("model: chunk is live");
                    model.quarantined.push(c);
                }
            }
            Action::SetLimits(max, drop_oldest) => {
                let policy = if drop_oldest { FullPolicy::DropOldest } else { FullPolicy::Reject };
                real.spool.set_limits(max, policy, real.opts.max_streams);
                real.opts.max_bytes = max;
                real.opts.full_policy = policy;
                model.max_bytes = max;
                model.drop_oldest = drop_oldest;
            }
            Action::Reopen => {
                let (reopened, report) = real.reopen();
                real = reopened;
                prop_assert!(!report.created);
                prop_assert_eq!(report.quarantined, None);
                prop_assert_eq!(real.spool.id(), id);
                let open: usize = model.streams.values().map(|s| s.open.len()).sum();
                // Rows, not batches: a commit's batches for one stream share a row.
                prop_assert_eq!(report.open_batches > 0, open > 0);
                prop_assert!(report.open_batches <= open as u64);
                prop_assert_eq!(report.sealed_chunks, model.chunks().len() as u64);
            }
        }
        check(&mut real, &model)?;
    }
    Ok(())
}

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(48);
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/model.txt"))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn spool_matches_the_model_under_random_actions(
        actions in prop::collection::vec(action(), 1..60),
        full in any::<bool>(),
    ) {
        run(actions, if full { Durability::Full } else { Durability::Normal })?;
    }
}
