//! The durability and export contract of `edge_ingest::store`, checked bullet by bullet
//! through the public API plus byte-level damage to the segment files.

use std::fs;
use std::path::{Path, PathBuf};

use edge_ingest::store::{
    ChunkKey, ExportFilter, ExportReport, IncomingChunk, PersistOutcome, Store, StoreError, StoreFailure, StoreHandle,
    StoreOptions, export, format,
};
use edge_proto::Codec;

const SPOOL_A: [u8; 16] = [0xA; 16];
const SPOOL_B: [u8; 16] = [0xB; 16];

fn key(device: &str, spool: [u8; 16], stream: &str, seq: u64) -> ChunkKey {
    ChunkKey { device: device.into(), spool, stream: stream.into(), seq }
}

fn framed(records: &[Vec<u8>]) -> Vec<u8> {
    let mut out = Vec::new();
    for r in records {
        out.extend_from_slice(&(r.len() as u32).to_le_bytes());
        out.extend_from_slice(r);
    }
    out
}

/// Records derived from the key, so the checker needs no log of what was sent.
fn records_for(k: &ChunkKey, n: usize, size: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("{}/{}/{}#{i}:", k.device, k.stream, k.seq).into_bytes().repeat(size)).collect()
}

fn chunk_with(k: ChunkKey, records: &[Vec<u8>], codec: Codec) -> IncomingChunk {
    let raw = framed(records);
    let payload = match codec {
        Codec::None => raw.clone(),
        Codec::Zstd => zstd::bulk::compress(&raw, 3).expect("zstd compresses"),
    };
    IncomingChunk {
        records: records.len() as u32,
        codec,
        raw_len: raw.len() as u32,
        checksum: edge_proto::crc32c(&payload),
        created_ms: 1_700_000_000_000 + k.seq,
        payload: payload.into(),
        key: k,
    }
}

fn chunk(k: ChunkKey) -> IncomingChunk {
    let records = records_for(&k, 3, 2);
    chunk_with(k, &records, Codec::None)
}

fn open(dir: &Path) -> Store {
    Store::open(StoreOptions::new(dir)).expect("open store").0
}

fn persist_one(store: &mut Store, c: IncomingChunk) -> PersistOutcome {
    store.persist(vec![c]).pop().expect("one outcome per chunk")
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    key: ChunkKey,
    records: Vec<Vec<u8>>,
    segment: u64,
    offset: u64,
}

fn export_all(dir: &Path, filter: &ExportFilter) -> (Vec<Seen>, ExportReport) {
    let mut seen = Vec::new();
    let report = export(dir, filter, |c| {
        seen.push(Seen {
            key: c.key.clone(),
            records: c.records.iter().map(|r| r.to_vec()).collect(),
            segment: c.segment,
            offset: c.offset,
        });
        Ok(())
    })
    .expect("export");
    (seen, report)
}

fn keys(seen: &[Seen]) -> Vec<ChunkKey> {
    seen.iter().map(|s| s.key.clone()).collect()
}

fn segment_path(dir: &Path, number: u64) -> PathBuf {
    dir.join(format::SEGMENTS_DIR).join(format::segment_file_name(number))
}

/// Where an exported chunk's payload starts in its segment.
fn payload_offset(s: &Seen) -> u64 {
    s.offset + format::entry_header_len(&s.key) as u64
}

#[test]
fn persist_then_reopen_keeps_data_and_dedups_a_resend() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (key("dev", SPOOL_A, "s", 1), key("dev", SPOOL_A, "s", 2));
    let mut store = open(dir.path());
    assert_eq!(store.persist(vec![chunk(a.clone()), chunk(b.clone())]), vec![PersistOutcome::Stored; 2]);
    drop(store);

    let (mut store, report) = Store::open(StoreOptions::new(dir.path())).expect("reopen");
    assert_eq!((report.chunks, report.truncated_bytes, report.corrupt_entries), (2, 0, 0));
    assert_eq!(report.bytes, (chunk(a.clone()).payload.len() + chunk(b.clone()).payload.len()) as u64);
    assert_eq!(persist_one(&mut store, chunk(a.clone())), PersistOutcome::Duplicate);
    assert_eq!(store.stats().chunks, 2);

    let (seen, report) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(keys(&seen), vec![a.clone(), b]);
    assert_eq!(seen[0].records, records_for(&a, 3, 2));
    assert_eq!((report.chunks, report.records, report.corrupt), (2, 6, 0));
}

#[test]
fn duplicate_inside_one_batch_is_stored_once() {
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (key("dev", SPOOL_A, "s", 1), key("dev", SPOOL_A, "s", 2));
    let mut store = open(dir.path());
    let out = store.persist(vec![chunk(a.clone()), chunk(a.clone()), chunk(b.clone())]);
    assert_eq!(out, vec![PersistOutcome::Stored, PersistOutcome::Duplicate, PersistOutcome::Stored]);
    let stats = store.stats();
    assert_eq!((stats.chunks, stats.duplicates, stats.fsyncs), (2, 1, 1));
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(keys(&seen), vec![a, b]);
}

#[test]
fn out_of_order_seqs_are_each_stored_once_and_export_in_seq_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path());
    for seq in [5, 1, 3, 2, 4] {
        assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", seq))), PersistOutcome::Stored);
    }
    assert_eq!(store.stats().index_ranges, 1, "seqs 1..=5 merged into one range");
    let resend: Vec<_> = (1..=5).map(|seq| chunk(key("dev", SPOOL_A, "s", seq))).collect();
    assert_eq!(store.persist(resend.clone()), vec![PersistOutcome::Duplicate; 5]);
    drop(store);
    let mut store = open(dir.path());
    assert_eq!(store.persist(resend), vec![PersistOutcome::Duplicate; 5]);
    assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 7))), PersistOutcome::Stored);
    assert_eq!(store.stats().index_ranges, 2);
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(seen.iter().map(|s| s.key.seq).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5, 7]);
}

#[test]
fn torn_tail_is_truncated_earlier_entries_survive_and_the_torn_key_is_stored_again() {
    let probe = tempfile::tempdir().expect("tempdir");
    let c_key = key("dev", SPOOL_A, "s", 3);
    let entry_len = format::entry_header_len(&c_key) + chunk(c_key.clone()).payload.len();
    let header_len = format::entry_header_len(&c_key);
    drop(probe);
    // Cut inside the magic, the length, the body, the header CRC, and the payload.
    for torn in [1, 7, 11, 12, 40, header_len - 1, header_len, header_len + 1, entry_len - 1] {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut store = open(dir.path());
        for seq in 1..=3 {
            assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", seq))), PersistOutcome::Stored);
        }
        drop(store);
        let (seen, _) = export_all(dir.path(), &ExportFilter::default());
        let c = &seen[2];
        // Replace the last entry with its first `torn` bytes: what a crash mid-write leaves.
        let path = segment_path(dir.path(), c.segment);
        let bytes = fs::read(&path).expect("read segment");
        assert_eq!(bytes.len() as u64, c.offset + entry_len as u64);
        let torn_bytes = bytes[c.offset as usize..c.offset as usize + torn].to_vec();
        let mut damaged = bytes[..c.offset as usize].to_vec();
        damaged.extend_from_slice(&torn_bytes);
        fs::write(&path, &damaged).expect("write torn segment");

        let (mut store, report) = Store::open(StoreOptions::new(dir.path())).expect("reopen");
        assert_eq!(report.truncated_bytes, torn as u64, "cut {torn}");
        assert_eq!(report.chunks, 2, "cut {torn}");
        assert_eq!(fs::metadata(&path).expect("segment").len(), c.offset, "cut {torn}");
        assert_eq!(persist_one(&mut store, chunk(c_key.clone())), PersistOutcome::Stored, "cut {torn}");
        assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 1))), PersistOutcome::Duplicate);
        drop(store);
        let (seen, report) = export_all(dir.path(), &ExportFilter::default());
        assert_eq!(seen.iter().map(|s| s.key.seq).collect::<Vec<_>>(), vec![1, 2, 3], "cut {torn}");
        assert_eq!((report.corrupt, report.tail_bytes, report.corrupt_regions), (0, 0, 0), "cut {torn}");
    }
}

#[test]
fn a_flipped_payload_byte_in_a_middle_entry_is_skipped_by_export_counted_and_later_entries_still_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path());
    for seq in 1..=3 {
        assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", seq))), PersistOutcome::Stored);
    }
    drop(store);
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    let path = segment_path(dir.path(), seen[1].segment);
    let mut bytes = fs::read(&path).expect("read segment");
    bytes[payload_offset(&seen[1]) as usize + 5] ^= 0x10;
    fs::write(&path, &bytes).expect("write damaged segment");

    let (seen, report) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(seen.iter().map(|s| s.key.seq).collect::<Vec<_>>(), vec![1, 3]);
    assert_eq!((report.corrupt, report.decode_errors, report.chunks), (1, 0, 2));
    // The header is intact, so recovery keeps all entries in place (payloads of older commits
    // are not read at open).
    let (_, recovery) = Store::open(StoreOptions::new(dir.path())).expect("reopen");
    assert_eq!((recovery.chunks, recovery.truncated_bytes), (3, 0));
}

#[test]
fn a_torn_entry_inside_the_newest_commit_is_not_counted_stored_and_later_entries_survive() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ks: Vec<_> = (1..=3).map(|seq| key("dev", SPOOL_A, "s", seq)).collect();
    let mut store = open(dir.path());
    assert_eq!(store.persist(ks.iter().cloned().map(chunk).collect()), vec![PersistOutcome::Stored; 3]);
    drop(store);
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    let path = segment_path(dir.path(), seen[1].segment);
    let mut bytes = fs::read(&path).expect("read segment");
    bytes[payload_offset(&seen[1]) as usize] ^= 0x01;
    fs::write(&path, &bytes).expect("write damaged segment");

    let (mut store, report) = Store::open(StoreOptions::new(dir.path())).expect("reopen");
    assert_eq!((report.verified_entries, report.corrupt_entries, report.chunks), (3, 1, 2));
    assert_eq!(persist_one(&mut store, chunk(ks[1].clone())), PersistOutcome::Stored);
    assert_eq!(persist_one(&mut store, chunk(ks[2].clone())), PersistOutcome::Duplicate);
    drop(store);

    let (mut store, report) = Store::open(StoreOptions::new(dir.path())).expect("reopen again");
    assert_eq!((report.chunks, report.duplicate_entries, report.corrupt_entries), (3, 0, 1));
    assert_eq!(persist_one(&mut store, chunk(ks[1].clone())), PersistOutcome::Duplicate);
    drop(store);
    let (seen, report) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(keys(&seen), ks);
    assert_eq!((report.corrupt, report.corrupt_regions, report.duplicate_entries), (0, 1, 0));
}

#[test]
fn garbage_in_the_middle_of_a_segment_does_not_hide_the_entries_after_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path());
    for seq in 1..=3 {
        assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", seq))), PersistOutcome::Stored);
    }
    drop(store);
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    let path = segment_path(dir.path(), seen[0].segment);
    let bytes = fs::read(&path).expect("read segment");
    // Garbage that even contains the entry magic, spliced in before seq 2 and before seq 1.
    let mut garbage = b"\xFFnot an entry ".repeat(20);
    garbage.extend_from_slice(&bytes[seen[2].offset as usize..seen[2].offset as usize + 30]);
    garbage.extend_from_slice(&[0u8; 100]);
    let (o1, o2) = (seen[0].offset as usize, seen[1].offset as usize);
    let mut damaged = bytes[..o1].to_vec();
    damaged.extend_from_slice(&garbage);
    damaged.extend_from_slice(&bytes[o1..o2]);
    damaged.extend_from_slice(&garbage);
    damaged.extend_from_slice(&bytes[o2..]);
    fs::write(&path, &damaged).expect("write damaged segment");

    let (mut store, report) = Store::open(StoreOptions::new(dir.path())).expect("reopen");
    assert_eq!((report.chunks, report.corrupt_entries, report.truncated_bytes), (3, 2, 0));
    assert_eq!(report.corrupt_bytes, 2 * garbage.len() as u64);
    assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 2))), PersistOutcome::Duplicate);
    assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 4))), PersistOutcome::Stored);
    drop(store);
    let (seen, report) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(seen.iter().map(|s| s.key.seq).collect::<Vec<_>>(), vec![1, 2, 3, 4]);
    assert_eq!(seen[1].records, records_for(&key("dev", SPOOL_A, "s", 2), 3, 2));
    assert_eq!((report.corrupt_regions, report.corrupt_bytes), (2, 2 * garbage.len() as u64));
}

#[test]
fn segments_roll_at_the_size_limit_and_export_reads_across_them_in_order() {
    let dir = tempfile::tempdir().expect("tempdir");
    let max = 1024;
    let opts = StoreOptions { segment_max_bytes: max, ..StoreOptions::new(dir.path()) };
    let (mut store, _) = Store::open(opts.clone()).expect("open");
    // One batch that spans several segments, then single chunks, then one bigger than a segment.
    let batch: Vec<_> = (1..=10).rev().map(|seq| chunk(key("dev", SPOOL_A, "s", seq))).collect();
    assert_eq!(store.persist(batch), vec![PersistOutcome::Stored; 10]);
    for seq in 11..=15 {
        assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", seq))), PersistOutcome::Stored);
    }
    let big_key = key("dev", SPOOL_A, "s", 16);
    let big_records = records_for(&big_key, 4, 100);
    assert_eq!(persist_one(&mut store, chunk_with(big_key.clone(), &big_records, Codec::None)), PersistOutcome::Stored);
    let stats = store.stats();
    assert!(stats.segments >= 4, "{stats:?}");
    assert_eq!(stats.fsyncs, stats.commits);
    drop(store);

    let files: Vec<_> = fs::read_dir(dir.path().join(format::SEGMENTS_DIR))
        .expect("segments dir")
        .map(|e| e.expect("dir entry").path())
        .collect();
    assert_eq!(files.len() as u32, stats.segments);
    let oversized: Vec<_> = files.iter().filter(|p| fs::metadata(p).expect("meta").len() > max).collect();
    assert_eq!(oversized.len(), 1, "only the segment holding the big chunk exceeds the limit");

    let (seen, report) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(seen.iter().map(|s| s.key.seq).collect::<Vec<_>>(), (1..=16).collect::<Vec<_>>());
    assert_eq!(report.segments, stats.segments);
    assert_eq!(seen[15].records, big_records);
    let mut by_position: Vec<_> = seen.iter().map(|s| (s.segment, s.offset)).collect();
    by_position.sort_unstable();
    by_position.dedup();
    assert_eq!(by_position.len(), 16);

    let (mut store, report) = Store::open(opts).expect("reopen");
    assert_eq!(report.chunks, 16);
    assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 3))), PersistOutcome::Duplicate);
}

#[test]
fn export_orders_by_device_then_spool_appearance_then_stream_then_seq_and_filters() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut store = open(dir.path());
    let written = [
        key("dev-b", SPOOL_B, "zeta", 2),
        key("dev-a", SPOOL_B, "zeta", 1),
        key("dev-a", SPOOL_A, "alpha", 9),
        key("dev-b", SPOOL_B, "alpha", 1),
        key("dev-a", SPOOL_B, "alpha", 3),
        key("dev-a", SPOOL_A, "alpha", 2),
        key("dev-b", SPOOL_B, "zeta", 1),
    ];
    for k in &written {
        assert_eq!(persist_one(&mut store, chunk(k.clone())), PersistOutcome::Stored);
    }
    drop(store);
    // SPOOL_B appears first in the segments, so it comes before SPOOL_A for every device.
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(
        keys(&seen),
        vec![
            key("dev-a", SPOOL_B, "alpha", 3),
            key("dev-a", SPOOL_B, "zeta", 1),
            key("dev-a", SPOOL_A, "alpha", 2),
            key("dev-a", SPOOL_A, "alpha", 9),
            key("dev-b", SPOOL_B, "alpha", 1),
            key("dev-b", SPOOL_B, "zeta", 1),
            key("dev-b", SPOOL_B, "zeta", 2),
        ]
    );

    let only_b = ExportFilter { device: Some("dev-b".into()), stream: None, ..ExportFilter::default() };
    let (seen, report) = export_all(dir.path(), &only_b);
    assert!(seen.iter().all(|s| s.key.device == "dev-b") && seen.len() == 3, "{seen:?}");
    assert_eq!(report.chunks, 3);
    let only_zeta = ExportFilter { device: None, stream: Some("zeta".into()), ..ExportFilter::default() };
    let (seen, _) = export_all(dir.path(), &only_zeta);
    assert_eq!(
        seen.iter().map(|s| (s.key.device.as_str(), s.key.seq)).collect::<Vec<_>>(),
        vec![("dev-a", 1), ("dev-b", 1), ("dev-b", 2)]
    );
    let both = ExportFilter { device: Some("dev-a".into()), stream: Some("alpha".into()), ..ExportFilter::default() };
    let (seen, _) = export_all(dir.path(), &both);
    assert_eq!(seen.len(), 3);
    let none = ExportFilter { device: Some("dev-c".into()), stream: None, ..ExportFilter::default() };
    assert_eq!(export_all(dir.path(), &none).0, vec![]);
    // One chunk by its whole key: the spool and the seq narrow as the device and stream do.
    let one =
        ExportFilter { device: Some("dev-a".into()), stream: Some("alpha".into()), spool: Some(SPOOL_A), seq: Some(9) };
    let (seen, report) = export_all(dir.path(), &one);
    assert_eq!(seen.iter().map(|s| s.key.clone()).collect::<Vec<_>>(), vec![key("dev-a", SPOOL_A, "alpha", 9)]);
    assert_eq!(report.chunks, 1);
    let other_spool = ExportFilter { spool: Some(SPOOL_B), ..one.clone() };
    assert_eq!(export_all(dir.path(), &other_spool).0, vec![]);
    let any_spool = ExportFilter { spool: None, seq: Some(1), ..ExportFilter::default() };
    assert_eq!(export_all(dir.path(), &any_spool).0.len(), 3);
}

#[test]
fn zstd_payload_round_trips_through_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let k = key("dev", SPOOL_A, "s", 1);
    let records = records_for(&k, 50, 20);
    let c = chunk_with(k.clone(), &records, Codec::Zstd);
    assert!(c.payload.len() < c.raw_len as usize / 4, "payload is compressed");
    let mut store = open(dir.path());
    assert_eq!(persist_one(&mut store, c), PersistOutcome::Stored);
    let mut got = Vec::new();
    let report = export(dir.path(), &ExportFilter::default(), |c| {
        assert_eq!(c.codec, Codec::Zstd);
        got = c.records.iter().map(|r| r.to_vec()).collect();
        Ok(())
    })
    .expect("export while the store is open");
    assert_eq!(got, records);
    assert_eq!(report.records, 50);
}

#[test]
fn a_payload_that_does_not_decode_is_skipped_and_counted_by_export() {
    let dir = tempfile::tempdir().expect("tempdir");
    let k = key("dev", SPOOL_A, "s", 1);
    let records = records_for(&k, 2, 1);
    let mut c = chunk(k);
    c.records = 5; // The header announces more records than the payload holds.
    let mut store = open(dir.path());
    assert_eq!(
        store.persist(vec![c, chunk_with(key("dev", SPOOL_A, "s", 2), &records, Codec::None)]),
        vec![PersistOutcome::Stored; 2]
    );
    let (seen, report) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(seen.len(), 1);
    assert_eq!((report.corrupt, report.decode_errors), (1, 1));
}

#[test]
fn a_chunk_whose_payload_does_not_match_its_checksum_is_rejected() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut c = chunk(key("dev", SPOOL_A, "s", 1));
    c.checksum ^= 1;
    let mut store = open(dir.path());
    assert!(matches!(persist_one(&mut store, c), PersistOutcome::Failed(StoreFailure::Rejected(_))));
    assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 1))), PersistOutcome::Stored);
}

#[test]
fn a_second_open_on_a_locked_dir_fails_with_locked() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = open(dir.path());
    match Store::open(StoreOptions::new(dir.path())) {
        Err(StoreError::Locked(p)) => assert_eq!(p, dir.path()),
        other => panic!("expected Locked, got {other:?}"),
    }
    drop(store);
    open(dir.path());
}

#[test]
fn store_handle_group_commits_concurrent_persists() {
    let dir = tempfile::tempdir().expect("tempdir");
    let handle = StoreHandle::spawn(open(dir.path()));
    let rt = tokio::runtime::Builder::new_current_thread().build().expect("runtime");
    let run = |handle: StoreHandle| {
        rt.block_on(async move {
            // On a current-thread runtime none of the tasks runs before the first await below,
            // so all 200 requests are queued in one go.
            let mut tasks = tokio::task::JoinSet::new();
            for seq in 1..=200 {
                let h = handle.clone();
                tasks.spawn(async move { h.persist(chunk(key("dev", SPOOL_A, "s", seq))).await });
            }
            tasks.join_all().await
        })
    };
    let outcomes = run(handle.clone());
    assert!(outcomes.iter().all(|o| *o == PersistOutcome::Stored), "{outcomes:?}");
    let stats = handle.stats();
    assert_eq!(stats.chunks, 200);
    assert!(stats.fsyncs < 200, "{stats:?}");
    let outcomes = run(handle.clone());
    assert!(outcomes.iter().all(|o| *o == PersistOutcome::Duplicate), "{outcomes:?}");
    handle.shutdown();
    let (_, report) = Store::open(StoreOptions::new(dir.path())).expect("reopen after shutdown");
    assert_eq!(report.chunks, 200);
}

#[test]
fn a_persist_that_cannot_create_its_segment_fails_and_a_later_persist_succeeds() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A limit of one byte makes every commit start a new segment.
    let opts = StoreOptions { segment_max_bytes: 1, ..StoreOptions::new(dir.path()) };
    let (mut store, _) = Store::open(opts.clone()).expect("open");
    assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 1))), PersistOutcome::Stored);
    // Occupy the path of the next segment with a directory.
    fs::create_dir(segment_path(dir.path(), 2)).expect("block segment 2");
    let out = persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 2)));
    assert!(matches!(out, PersistOutcome::Failed(StoreFailure::Io(_))), "{out:?}");
    assert!(store.stats().last_failure.is_some());
    assert_eq!(persist_one(&mut store, chunk(key("dev", SPOOL_A, "s", 2))), PersistOutcome::Stored);
    let stats = store.stats();
    assert_eq!((stats.failed_commits, stats.commits, stats.last_failure), (1, 2, None));
    drop(store);
    // The stray directory is ignored at reopen and by export.
    let (_, report) = Store::open(opts).expect("reopen");
    assert_eq!(report.chunks, 2);
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(seen.iter().map(|s| s.segment).collect::<Vec<_>>(), vec![1, 3]);
}

#[test]
fn a_torn_newest_commit_is_repaired_even_when_an_empty_segment_follows_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ks: Vec<_> = (1..=3).map(|seq| key("dev", SPOOL_A, "s", seq)).collect();
    let mut store = open(dir.path());
    assert_eq!(store.persist(ks.iter().cloned().map(chunk).collect()), vec![PersistOutcome::Stored; 3]);
    drop(store);
    let (seen, _) = export_all(dir.path(), &ExportFilter::default());
    let path = segment_path(dir.path(), 1);
    let mut bytes = fs::read(&path).expect("read segment");
    bytes[payload_offset(&seen[1]) as usize] ^= 0x01;
    fs::write(&path, &bytes).expect("write damaged segment");
    // A crash right after creating the next segment file, before anything was written to it.
    fs::write(segment_path(dir.path(), 2), b"").expect("create empty segment");

    let (mut store, report) = Store::open(StoreOptions::new(dir.path())).expect("reopen");
    assert_eq!((report.segments, report.corrupt_entries, report.chunks), (2, 1, 2));
    assert_eq!(persist_one(&mut store, chunk(ks[1].clone())), PersistOutcome::Stored);
    assert_eq!(store.stats().active_segment, 2, "the empty segment is reused");
    drop(store);
    let (seen, report) = export_all(dir.path(), &ExportFilter::default());
    assert_eq!(keys(&seen), ks);
    assert_eq!(seen.iter().map(|s| s.segment).collect::<Vec<_>>(), vec![1, 2, 1]);
    assert_eq!((report.corrupt, report.corrupt_regions), (0, 1));
}

/// Writes seqs 1..=6 in three batches and returns the single segment's path.
fn three_batches(dir: &Path) -> PathBuf {
    let mut store = open(dir);
    for pair in [[1, 2], [3, 4], [5, 6]] {
        let batch = pair.iter().map(|&seq| chunk(key("dev", SPOOL_A, "s", seq))).collect();
        assert_eq!(store.persist(batch), vec![PersistOutcome::Stored; 2]);
    }
    segment_path(dir, 1)
}

#[derive(Debug, Clone)]
enum Damage {
    FlipBit { at: usize, bit: u8 },
    Truncate { at: usize },
    Splice { at: usize, garbage: Vec<u8> },
}

fn damage_strategy() -> impl proptest::strategy::Strategy<Value = Vec<Damage>> {
    use proptest::prelude::*;
    let one = prop_oneof![
        (any::<usize>(), 0u8..8).prop_map(|(at, bit)| Damage::FlipBit { at, bit }),
        any::<usize>().prop_map(|at| Damage::Truncate { at }),
        (any::<usize>(), proptest::collection::vec(any::<u8>(), 1..64))
            .prop_map(|(at, garbage)| Damage::Splice { at, garbage }),
    ];
    proptest::collection::vec(one, 1..4)
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]

    #[test]
    fn damaged_segments_never_panic_and_never_export_wrong_or_repeated_chunks(damage in damage_strategy()) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = three_batches(dir.path());
        let mut bytes = fs::read(&path).expect("read segment");
        for d in &damage {
            match d {
                Damage::FlipBit { at, bit } if !bytes.is_empty() => {
                    let at = at % bytes.len();
                    bytes[at] ^= 1 << bit;
                }
                Damage::Truncate { at } => bytes.truncate(at % (bytes.len() + 1)),
                Damage::Splice { at, garbage } => {
                    let at = at % (bytes.len() + 1);
                    bytes.splice(at..at, garbage.iter().copied());
                }
                Damage::FlipBit { .. } => {}
            }
        }
        fs::write(&path, &bytes).expect("write damaged segment");

        let (mut store, _) = Store::open(StoreOptions::new(dir.path())).expect("open never fails on damage");
        let check = |dir: &Path| {
            let (seen, _) = export_all(dir, &ExportFilter::default());
            let mut ks = keys(&seen);
            for s in &seen {
                assert_eq!(s.records, records_for(&s.key, 3, 2), "exported bytes are what was sent");
            }
            ks.dedup();
            assert_eq!(ks.len(), seen.len(), "no key exported twice");
        };
        check(dir.path());
        // Every resend ends durable, and the store stays consistent afterwards.
        let resend: Vec<_> = (1..=6).map(|seq| chunk(key("dev", SPOOL_A, "s", seq))).collect();
        assert!(store.persist(resend).iter().all(PersistOutcome::is_durable));
        drop(store);
        check(dir.path());
        Store::open(StoreOptions::new(dir.path())).expect("reopen after repair");
    }

    #[test]
    fn a_torn_tail_anywhere_loses_nothing_once_the_agent_resends(cut in 0usize..10_000) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = three_batches(dir.path());
        let len = fs::metadata(&path).expect("segment").len() as usize;
        let file = fs::OpenOptions::new().write(true).open(&path).expect("open segment");
        file.set_len((cut % (len + 1)) as u64).expect("truncate");
        drop(file);

        let (mut store, _) = Store::open(StoreOptions::new(dir.path())).expect("open");
        let resend: Vec<_> = (1..=6).map(|seq| chunk(key("dev", SPOOL_A, "s", seq))).collect();
        assert!(store.persist(resend).iter().all(PersistOutcome::is_durable));
        drop(store);
        let (seen, report) = export_all(dir.path(), &ExportFilter::default());
        assert_eq!(seen.iter().map(|s| s.key.seq).collect::<Vec<_>>(), (1..=6).collect::<Vec<_>>());
        assert_eq!((report.corrupt, report.corrupt_regions, report.tail_bytes), (0, 0, 0));
    }
}
