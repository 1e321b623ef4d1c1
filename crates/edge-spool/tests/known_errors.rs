//! Known-error cases for the spool, each a named way a file on disk goes bad (garbage, truncation,
//! a flipped byte, a stale WAL, a foreign or newer database) and what the spool must do about it:
//! detect, quarantine, keep running, never serve bad bytes.

use std::fs;
use std::path::{Path, PathBuf};

use edge_spool::{AppendRequest, Batch, ChunkMeta, Spool, SpoolError, SpoolOptions};
use rusqlite::Connection;
use tempfile::TempDir;

mod util;

fn setup() -> (TempDir, SpoolOptions) {
    let dir = tempfile::tempdir().expect("temp dir");
    let opts = SpoolOptions::new(dir.path().join("spool.db"));
    (dir, opts)
}

/// Deterministic pseudo-random bytes (xorshift), so failures replay.
fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn append_one(spool: &mut Spool, stream: &str, data: Vec<u8>, now_ms: u64) {
    let req = AppendRequest { batches: vec![Batch { stream: stream.into(), data, records: 1 }] };
    spool.append(&[req], now_ms).expect("append");
}

fn sealed(spool: &Spool) -> Vec<ChunkMeta> {
    spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list")
}

/// Files in the spool's directory whose names contain `.corrupt-`.
fn quarantined_files(dir: &Path) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = fs::read_dir(dir)
        .expect("read dir")
        .map(|e| e.expect("dir entry").path())
        .filter(|p| {
            let name = p.to_string_lossy();
            name.contains(".corrupt-") && !name.ends_with("-wal") && !name.ends_with("-shm") && !name.contains("-seg-")
        })
        .collect();
    out.sort();
    out
}

/// Builds a spool with `n` sealed chunks of 1 KiB each and closes it.
fn spool_with_chunks(opts: &SpoolOptions, n: u64) -> edge_spool::SpoolId {
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    for i in 0..n {
        append_one(&mut spool, "s", noise(i + 1, 1024), i);
        spool.seal_all(i).expect("seal");
    }
    spool.id()
}

#[test]
fn garbage_file_is_quarantined_and_replaced_by_a_fresh_spool() {
    let (dir, opts) = setup();
    let junk = noise(42, 8192);
    fs::write(&opts.path, &junk).expect("write junk");

    let (mut spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.created);
    let moved = report.quarantined.expect("reported as quarantined");
    assert_eq!(fs::read(&moved).expect("moved file"), junk, "the bad file is kept intact");
    assert!(moved.to_string_lossy().starts_with(&format!("{}.corrupt-", opts.path.display())));
    assert_eq!(quarantined_files(dir.path()), vec![moved]);
    append_one(&mut spool, "s", b"works".to_vec(), 1);
    assert_eq!(spool.seal_all(1).expect("seal"), 1);
}

#[test]
fn two_quarantines_in_the_same_second_keep_both_files() {
    let (dir, opts) = setup();
    for seed in [1, 2] {
        drop(Spool::open(opts.clone()).expect("open"));
        fs::remove_file(&opts.path).expect("remove");
        fs::write(&opts.path, noise(seed, 4096)).expect("write junk");
        let (_spool, report) = Spool::open(opts.clone()).expect("open");
        assert!(report.quarantined.is_some());
    }
    assert_eq!(quarantined_files(dir.path()).len(), 2);
}

#[test]
fn truncated_database_file_is_quarantined() {
    let (dir, opts) = setup();
    let old_id = spool_with_chunks(&opts, 200);
    assert!(!opts.path.with_extension("db-wal").exists(), "closing checkpointed the WAL");
    let len = fs::metadata(&opts.path).expect("metadata").len();
    let file = fs::OpenOptions::new().write(true).open(&opts.path).expect("open file");
    file.set_len(len / 2).expect("truncate");
    drop(file);

    let (spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.created);
    assert!(report.quarantined.is_some());
    assert_ne!(spool.id(), old_id, "a replaced spool gets a new identity");
    assert_eq!(report.sealed_chunks, 0);
    assert_eq!(quarantined_files(dir.path()).len(), 1);
}

#[test]
fn flipped_byte_in_a_batch_is_reported_as_corrupt_by_read_and_can_be_quarantined() {
    let (_dir, opts) = setup();
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    append_one(&mut spool, "s", noise(7, 300), 1);
    append_one(&mut spool, "s", noise(8, 300), 2);
    spool.seal_all(3).expect("seal");
    append_one(&mut spool, "s", noise(9, 300), 4);
    spool.seal_all(5).expect("seal");
    let chunks = sealed(&spool);

    // Flip one bit of the second batch of the first chunk in its segment file, behind the
    // spool's back.
    util::flip_in_batch(&opts.path, chunks[0].id, 1, 123, 0x10);

    let report = edge_spool::check(&opts.path).expect("check");
    assert_eq!(report.damaged_chunks.len(), 1, "{report:?}");
    assert!(report.damaged_chunks[0].detail.contains("crc32c"), "{report:?}");
    let mut reader = spool.reader().expect("reader");
    match reader.read(&chunks[0]) {
        Err(SpoolError::Corrupt { chunk, detail }) => {
            assert_eq!(chunk, chunks[0].id);
            assert!(detail.contains("crc32c"), "{detail}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert_eq!(reader.read(&chunks[1]).expect("the other chunk is fine"), noise(9, 300));

    spool.quarantine(chunks[0].id, "crc mismatch").expect("quarantine");
    assert_eq!(sealed(&spool), vec![chunks[1].clone()]);
    let stats = spool.stats();
    assert_eq!((stats.quarantined_chunks, stats.total_bytes), (1, 300));
}

#[test]
fn chunk_whose_batch_rows_vanished_is_reported_as_corrupt() {
    let (_dir, opts) = setup();
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    append_one(&mut spool, "s", b"first".to_vec(), 1);
    append_one(&mut spool, "s", b"second".to_vec(), 1);
    spool.seal_all(1).expect("seal");
    let chunk = sealed(&spool).remove(0);
    let raw = Connection::open(&opts.path).expect("raw connection");
    raw.execute("DELETE FROM batches WHERE id = (SELECT max(id) FROM batches)", []).expect("delete");
    drop(raw);
    let err = spool.reader().expect("reader").read(&chunk).expect_err("short chunk");
    assert!(matches!(err, SpoolError::Corrupt { .. }), "{err:?}");
}

#[test]
fn stale_wal_without_its_database_does_not_resurrect_old_data() {
    let (dir, opts) = setup();
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    append_one(&mut spool, "s", b"old".to_vec(), 1);
    let wal = dir.path().join("spool.db-wal");
    let saved = fs::read(&wal).expect("WAL exists while the spool is open");
    assert!(!saved.is_empty());
    drop(spool);
    fs::remove_file(&opts.path).expect("remove db");
    fs::write(&wal, saved).expect("put the stale WAL back");

    let (spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.created);
    assert_eq!(report.open_batches, 0);
    assert_eq!(spool.stats().total_bytes, 0);
}

#[test]
fn empty_file_is_treated_as_a_new_spool() {
    let (dir, opts) = setup();
    fs::write(&opts.path, b"").expect("touch");
    let (_spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.created);
    assert_eq!(report.quarantined, None);
    assert!(quarantined_files(dir.path()).is_empty());
}

#[test]
fn foreign_sqlite_database_is_moved_aside_not_reused() {
    let (dir, opts) = setup();
    let raw = Connection::open(&opts.path).expect("raw connection");
    raw.execute_batch("CREATE TABLE photos (id INTEGER PRIMARY KEY, jpeg BLOB);").expect("schema");
    drop(raw);
    let (_spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.created);
    let moved = report.quarantined.expect("moved aside");
    let raw = Connection::open(&moved).expect("moved file is still a database");
    let n: i64 = raw.query_row("SELECT count(*) FROM photos", [], |r| r.get(0)).expect("table kept");
    let mode: String = raw.query_row("PRAGMA journal_mode", [], |r| r.get(0)).expect("mode");
    assert_eq!((n, mode.as_str()), (0, "delete"), "the foreign file was not modified");
    drop(raw);
    assert_eq!(quarantined_files(dir.path()).len(), 1);
}

#[test]
fn newer_schema_version_is_refused_and_the_file_left_in_place() {
    let (dir, opts) = setup();
    spool_with_chunks(&opts, 1);
    let raw = Connection::open(&opts.path).expect("raw connection");
    raw.pragma_update(None, "user_version", 99).expect("bump version");
    drop(raw);
    match Spool::open(opts.clone()) {
        Err(SpoolError::UnsupportedSchema { found: 99, supported: 4 }) => {}
        other => panic!("expected UnsupportedSchema, got {:?}", other.map(|(_, r)| r)),
    }
    assert!(opts.path.exists());
    assert!(quarantined_files(dir.path()).is_empty());
}

#[test]
fn spool_id_of_the_wrong_length_gets_the_file_quarantined() {
    let (_dir, opts) = setup();
    let old = spool_with_chunks(&opts, 1);
    let raw = Connection::open(&opts.path).expect("raw connection");
    raw.execute("UPDATE meta SET value = x'0102' WHERE key = 'spool_id'", []).expect("damage id");
    drop(raw);
    let (spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.quarantined.is_some());
    assert_ne!(spool.id(), old);
}

/// One value of a row changed behind the spool's back, as a flipped bit would change it.
fn damage(opts: &SpoolOptions, sql: &str) {
    let raw = Connection::open(&opts.path).expect("raw connection");
    assert_eq!(raw.execute(sql, []).expect("damage"), 1, "{sql}");
}

#[test]
fn a_changed_value_in_a_chunk_or_batch_row_makes_the_chunk_corrupt_on_read() {
    // Values outside the payload: the sequence number the server dedups by, the stream, the
    // batch range, the times sent as metadata, and a batch's own columns.
    let cases = [
        "UPDATE chunks SET seq = seq + 8",
        "UPDATE chunks SET first_ms = first_ms + 1024",
        "UPDATE chunks SET sealed_ms = sealed_ms + 1",
        "UPDATE chunks SET first_batch = first_batch + 1",
        "UPDATE batches SET commit_ms = commit_ms + 1 WHERE id = (SELECT min(id) FROM batches)",
        "UPDATE batches SET records = records + 1 WHERE id = (SELECT max(id) FROM batches)",
        "UPDATE batches SET row_crc = NULL WHERE id = (SELECT max(id) FROM batches)",
    ];
    for sql in cases {
        let (_dir, opts) = setup();
        let (mut spool, _) = Spool::open(opts.clone()).expect("open");
        append_one(&mut spool, "s", b"first".to_vec(), 1);
        append_one(&mut spool, "s", b"second".to_vec(), 2);
        spool.seal_all(3).expect("seal");
        let listed_before = sealed(&spool).remove(0);
        damage(&opts, sql);
        // Listed before or after the damage, the chunk does not read.
        for chunk in [listed_before.clone(), sealed(&spool).remove(0)] {
            let err = spool.reader().expect("reader").read(&chunk).expect_err(sql);
            assert!(matches!(err, SpoolError::Corrupt { .. }), "{sql}: {err:?}");
        }
        let report = edge_spool::check(&opts.path).expect("check");
        assert_eq!(report.damaged_chunks.len(), 1, "{sql}: {report:?}");
        spool.quarantine(listed_before.id, "test").expect("quarantine");
        append_one(&mut spool, "s", b"later".to_vec(), 4);
        spool.seal_all(5).expect("the spool keeps working");
        let next = sealed(&spool).remove(0);
        assert_eq!(spool.reader().expect("reader").read(&next).expect("later chunk reads"), b"later");
    }
}

#[test]
fn a_changed_stream_row_or_meta_value_gets_the_file_moved_aside() {
    // A lower next_seq would reuse sequence numbers the server holds (new data answered
    // Duplicate and deleted); a changed sealed_through would seal batches twice or never; a
    // changed spool id would store everything again under a new identity.
    let cases = [
        "UPDATE streams SET next_seq = next_seq - 1",
        "UPDATE streams SET sealed_through = sealed_through - 1",
        "UPDATE streams SET name = 't'",
        "UPDATE meta SET value = x'000102030405060708090a0b0c0d0e0f' WHERE key = 'spool_id'",
        "UPDATE meta SET value = value + 1 WHERE key = 'dropped_records'",
        "UPDATE meta SET value = 7 WHERE key = 'legacy_batches_through'",
    ];
    for sql in cases {
        let (dir, opts) = setup();
        let old = spool_with_chunks(&opts, 2);
        damage(&opts, sql);
        let report = edge_spool::check(&opts.path).expect("check");
        assert!(report.has_damage() && report.damaged_rows.len() == 1, "{sql}: {report:?}");
        let (spool, opened) = Spool::open(opts.clone()).expect("open");
        assert!(opened.quarantined.is_some(), "{sql}: {opened:?}");
        assert_ne!(spool.id(), old, "{sql}");
        assert_eq!(quarantined_files(dir.path()).len(), 1, "{sql}");
    }
}

#[test]
fn row_checksums_survive_reopen_drops_and_quarantines() {
    let (_dir, mut opts) = setup();
    opts.max_bytes = 4096;
    opts.full_policy = edge_spool::FullPolicy::DropOldest;
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    for i in 0..12 {
        append_one(&mut spool, if i % 2 == 0 { "a" } else { "b" }, noise(i + 7, 700), i);
        spool.seal_all(i).expect("seal");
    }
    let stats = spool.stats();
    assert!(stats.dropped_chunks > 0, "the cap dropped chunks: {stats:?}");
    let victim = sealed(&spool).remove(0);
    spool.quarantine(victim.id, "test").expect("quarantine");
    drop(spool);
    let report = edge_spool::check(&opts.path).expect("check");
    assert!(!report.has_damage(), "{report:?}");
    let (spool, opened) = Spool::open(opts).expect("reopen");
    assert!(opened.quarantined.is_none(), "{opened:?}");
    assert_eq!(spool.stats().dropped_chunks, stats.dropped_chunks);
    let mut reader = spool.reader().expect("reader");
    for chunk in sealed(&spool) {
        reader.read(&chunk).expect("every chunk reads");
    }
}

#[test]
fn a_header_that_forbids_writing_gets_the_file_moved_aside() {
    // Byte 18 of a SQLite file is its write-format version; above 2, SQLite opens the file
    // read-only, and the spool could not write a byte (found by the spool_recovery fuzz target).
    let (dir, opts) = setup();
    let old = spool_with_chunks(&opts, 2);
    let mut bytes = fs::read(&opts.path).expect("read");
    assert_eq!(bytes[18], 2, "a WAL-mode file");
    bytes[18] = 3;
    fs::write(&opts.path, &bytes).expect("write");
    let (mut spool, report) = Spool::open(opts.clone()).expect("moved aside, not refused");
    let moved = report.quarantined.expect("reported as quarantined");
    assert_eq!(fs::read(&moved).expect("moved file")[18], 3, "the bad file is kept as it was");
    assert_ne!(spool.id(), old);
    assert_eq!(quarantined_files(dir.path()).len(), 1);
    append_one(&mut spool, "s", b"works".to_vec(), 1);
    assert_eq!(spool.seal_all(1).expect("seal"), 1);
}

#[test]
fn a_chunks_index_that_disagrees_with_its_rows_is_rebuilt_at_open() {
    // A row changed behind its index's back, as a flipped index entry leaves them: the partial
    // index is hidden from SQLite while the row changes, so its entry keeps the old value.
    let (dir, opts) = setup();
    spool_with_chunks(&opts, 3);
    let raw = Connection::open(&opts.path).expect("raw connection");
    raw.execute_batch(
        "PRAGMA writable_schema = ON;
         UPDATE sqlite_schema SET sql = replace(sql, 'quarantine IS NULL', 'quarantine IS NULL AND 0')
           WHERE name = 'chunks_live_first';",
    )
    .expect("neuter index");
    drop(raw);
    let raw = Connection::open(&opts.path).expect("raw connection");
    raw.execute("UPDATE chunks SET first_ms = first_ms + 5 WHERE id = 1", []).expect("change row");
    raw.execute_batch(
        "PRAGMA writable_schema = ON;
         UPDATE sqlite_schema SET sql = replace(sql, 'quarantine IS NULL AND 0', 'quarantine IS NULL')
           WHERE name = 'chunks_live_first';",
    )
    .expect("restore index");
    drop(raw);
    let before = edge_spool::check(&opts.path).expect("check");
    assert!(!before.integrity.is_empty(), "the index disagrees with its rows: {before:?}");
    let (spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.quarantined.is_none(), "rebuilt, not moved aside: {report:?}");
    drop(spool);
    let after = edge_spool::check(&opts.path).expect("check");
    assert!(after.integrity.is_empty(), "{after:?}");
    assert!(quarantined_files(dir.path()).is_empty());
}

/// One flipped top bit in a chunk row: a value SQLite holds but the row's type does not (a
/// negative sequence number, time or size, a record count past `u32`). Applied to the oldest of
/// two sealed chunks.
const OUT_OF_RANGE: [&str; 6] = [
    "UPDATE chunks SET seq = -1 WHERE id = (SELECT min(id) FROM chunks)",
    "UPDATE chunks SET sealed_ms = -1 WHERE id = (SELECT min(id) FROM chunks)",
    "UPDATE chunks SET first_ms = -1 WHERE id = (SELECT min(id) FROM chunks)",
    "UPDATE chunks SET records = 1 << 40 WHERE id = (SELECT min(id) FROM chunks)",
    "UPDATE chunks SET bytes = -5 WHERE id = (SELECT min(id) FROM chunks)",
    "UPDATE chunks SET bytes = -(1 << 40) WHERE id = (SELECT min(id) FROM chunks)",
];

#[test]
fn an_out_of_range_value_in_a_chunk_row_is_quarantined_on_read_and_stops_nothing_else() {
    for sql in OUT_OF_RANGE {
        let (dir, opts) = setup();
        spool_with_chunks(&opts, 2);
        damage(&opts, sql);
        // The open neither fails nor moves the file aside: the row is damage to one chunk.
        let (mut spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("{sql}: open: {e:?}"));
        assert!(report.quarantined.is_none(), "{sql}: {report:?}");
        assert!(quarantined_files(dir.path()).is_empty(), "{sql}");
        assert_eq!(report.sealed_chunks, 2, "{sql}");
        // The listing goes on past the damaged row, so the uploader can read (and quarantine)
        // it and send what comes after.
        let mut reader = spool.reader().expect("reader");
        let listed = reader.sealed_after(None, 10).unwrap_or_else(|e| panic!("{sql}: listing: {e:?}"));
        assert_eq!(listed.len(), 2, "{sql}: {listed:?}");
        let (damaged, healthy) = (listed[0].clone(), listed[1].clone());
        assert_eq!((healthy.stream.as_str(), healthy.seq, healthy.records, healthy.bytes), ("s", 2, 1, 1024), "{sql}");
        match reader.read(&damaged) {
            Err(SpoolError::Corrupt { chunk, .. }) => assert_eq!(chunk, damaged.id, "{sql}"),
            other => panic!("{sql}: expected Corrupt, got {other:?}"),
        }
        // Chunks after it are sent and acked while it is still live (the ack re-reads the
        // stream's oldest time, over the damaged row too).
        assert_eq!(reader.read(&healthy).expect("the healthy chunk reads"), noise(2, 1024), "{sql}");
        assert_eq!(spool.ack(&[healthy.id]).unwrap_or_else(|e| panic!("{sql}: ack: {e:?}")).acked, 1, "{sql}");
        assert_eq!(reader.sealed_after(None, 10).expect("listing").len(), 1, "{sql}");
        spool.quarantine(damaged.id, "test").unwrap_or_else(|e| panic!("{sql}: quarantine: {e:?}"));
        assert_eq!(reader.sealed_after(None, 10).expect("listing"), vec![], "{sql}");
        let stats = spool.stats();
        assert_eq!((stats.sealed_chunks, stats.total_bytes, stats.quarantined_chunks), (0, 0, 1), "{sql}: {stats:?}");
        // The quarantined row stops nothing at the next open either.
        drop((reader, spool));
        let (spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("{sql}: reopen: {e:?}"));
        assert!(report.quarantined.is_none(), "{sql}: {report:?}");
        assert_eq!(spool.stats().quarantined_chunks, 1, "{sql}");
        let quarantined = spool.reader().expect("reader").quarantined().expect("quarantined chunks");
        assert_eq!(quarantined.iter().map(|q| q.meta.id).collect::<Vec<_>>(), vec![damaged.id], "{sql}");
    }
}

#[test]
fn drop_oldest_evicts_a_chunk_whose_row_holds_an_out_of_range_value() {
    for sql in OUT_OF_RANGE {
        let (dir, mut opts) = setup();
        spool_with_chunks(&opts, 2);
        damage(&opts, sql);
        // Room for the two chunks and nothing more: appends evict the oldest chunks.
        opts.max_bytes = 2048;
        opts.full_policy = edge_spool::FullPolicy::DropOldest;
        let (mut spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("{sql}: open: {e:?}"));
        assert!(report.quarantined.is_none(), "{sql}: {report:?}");
        // Listed past the damaged row, so that only the eviction is put to the test here.
        let newest = spool.newest_chunk().expect("two chunks");
        let damaged = edge_spool::ChunkId(newest.0 - 1);
        let listed = spool.reader().expect("reader").sealed_after(Some(damaged), 10).expect("listing");
        let healthy = listed[0].clone();
        assert_eq!((healthy.id, healthy.seq), (newest, 2), "{sql}");
        let ids = |spool: &Spool| sealed(spool).iter().map(|c| c.id).collect::<Vec<_>>();
        let append = |spool: &mut Spool, n: u64| {
            let req = AppendRequest { batches: vec![Batch { stream: "s".into(), data: noise(n, 1024), records: 1 }] };
            let outcomes = spool.append(&[req], 10 + n).unwrap_or_else(|e| panic!("{sql}: append {n}: {e:?}"));
            assert_eq!(outcomes, vec![edge_spool::AppendOutcome::Accepted], "{sql}");
        };
        append(&mut spool, 3);
        if sql.contains("bytes") {
            // A negative size counts 0: the chunk takes no room in the counters, so this
            // append evicted nothing; the next one evicts it first (it frees nothing counted),
            // then the healthy one.
            assert_eq!((spool.stats().dropped_chunks, ids(&spool)), (0, vec![damaged, newest]), "{sql}");
            append(&mut spool, 4);
            assert_eq!((spool.stats().dropped_chunks, ids(&spool)), (2, vec![]), "{sql}");
        } else {
            assert_eq!(spool.stats().dropped_chunks, 1, "{sql}");
            assert_eq!(sealed(&spool), vec![healthy.clone()], "{sql}: the damaged chunk went, the healthy one stays");
            assert_eq!(spool.reader().expect("reader").read(&healthy).expect("read"), noise(2, 1024), "{sql}");
        }
        assert!(quarantined_files(dir.path()).is_empty(), "{sql}");
    }
}

#[test]
fn check_reports_a_batch_length_past_its_segment_as_damage_without_reading_it() {
    // A damaged `seg_len` of 2^50: reserving that much before the row's checksum is checked
    // aborted the process, in the tool that audits damage.
    let (_dir, opts) = setup();
    spool_with_chunks(&opts, 2);
    damage(&opts, "UPDATE batches SET seg_len = 1 << 50 WHERE id = (SELECT min(id) FROM batches)");
    let report = edge_spool::check(&opts.path).expect("check");
    assert_eq!(report.damaged_chunks.len(), 1, "{report:?}");
    let damaged = &report.damaged_chunks[0];
    assert_eq!((damaged.seq, damaged.bad_batches), (1, 1), "{report:?}");
    assert!(damaged.detail.contains("past the end"), "{report:?}");
    assert!(report.damaged_open_batches.is_empty() && report.read_error.is_none(), "{report:?}");
    // The agent's reader finds the same damage.
    let (spool, _) = Spool::open(opts.clone()).expect("open");
    let chunks = sealed(&spool);
    let mut reader = spool.reader().expect("reader");
    assert!(matches!(reader.read(&chunks[0]), Err(SpoolError::Corrupt { .. })));
    assert_eq!(reader.read(&chunks[1]).expect("the other chunk reads"), noise(2, 1024));
}

#[test]
fn check_sums_damaged_batch_lengths_without_overflowing() {
    // Three rows claiming i64::MAX bytes each: more than a u64 holds in all.
    let (_dir, opts) = setup();
    spool_with_chunks(&opts, 3);
    let raw = Connection::open(&opts.path).expect("raw connection");
    assert_eq!(raw.execute("UPDATE batches SET seg_len = 9223372036854775807", []).expect("damage"), 3);
    drop(raw);
    let report = edge_spool::check(&opts.path).expect("check");
    assert_eq!(report.damaged_chunks.len(), 3, "{report:?}");
    assert_eq!(report.bytes, u64::MAX, "{report:?}");
}

/// Puts a directory where payload segment `id` of the spool at `db` is: opening it for reading
/// still works, every read fails (`EISDIR`), as reads of a file on a failing disk fail with
/// `EIO`. An entry inside gives it a size above a record's prefix on any file system.
fn make_segment_unreadable(db: &Path, id: u32) -> PathBuf {
    let seg = PathBuf::from(format!("{}-seg-{id:010}", db.display()));
    fs::remove_file(&seg).expect("remove the segment file");
    fs::create_dir(&seg).expect("a directory in its place");
    fs::write(seg.join("x".repeat(200)), b"").expect("an entry");
    seg
}

/// Options whose segments take one commit of 16 KiB each.
fn small_segments() -> (TempDir, SpoolOptions) {
    let (dir, mut opts) = setup();
    opts.segment_target_bytes = 4096;
    (dir, opts)
}

#[test]
fn a_read_error_in_the_newest_segment_at_open_leaves_its_chunks_to_be_quarantined() {
    // The commit records of the newest segment are read at every open (`journal.rs`): a read
    // error there failed the open as an I/O error, and the agent restarted into it forever.
    let (dir, opts) = small_segments();
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    append_one(&mut spool, "s", noise(1, 16 << 10), 1);
    spool.seal_all(1).expect("seal");
    append_one(&mut spool, "s", noise(2, 16 << 10), 2);
    spool.seal_all(2).expect("seal");
    drop(spool);
    let seg = make_segment_unreadable(&opts.path, 2);

    let (mut spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("open: {e:?}"));
    assert!(report.quarantined.is_none(), "{report:?}");
    assert!(quarantined_files(dir.path()).is_empty());
    assert_eq!((report.sealed_chunks, report.replayed_records, report.unsynced_records_dropped), (2, 0, 0));
    let chunks = sealed(&spool);
    assert_eq!(chunks.len(), 2);
    let mut reader = spool.reader().expect("reader");
    assert_eq!(reader.read(&chunks[0]).expect("the chunk in the readable segment"), noise(1, 16 << 10));
    match reader.read(&chunks[1]) {
        Err(SpoolError::Corrupt { chunk, .. }) => assert_eq!(chunk, chunks[1].id),
        other => panic!("expected Corrupt, got {other:?}"),
    }
    spool.quarantine(chunks[1].id, "unreadable").expect("quarantine");
    // The writer goes on in a new segment, not in the unreadable one.
    append_one(&mut spool, "s", noise(3, 100), 3);
    spool.seal_all(3).expect("seal");
    let chunks = sealed(&spool);
    assert_eq!(chunks.iter().map(|c| c.seq).collect::<Vec<_>>(), [1, 3]);
    assert_eq!(reader.read(&chunks[1]).expect("the new chunk"), noise(3, 100));
    assert!(seg.is_dir(), "left as it was");
}

#[test]
fn a_read_error_in_the_check_of_unsynced_batches_is_damage_not_a_lost_write() {
    // With deferred syncs, open reads the batches above the synced-segments mark (`unsynced.rs`).
    // A read error there failed the open; taken for a lost write it would drop that batch and
    // every later one, which may have been answered.
    let (dir, mut opts) = setup();
    opts.segment_target_bytes = 64 << 10;
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    let mut sync = spool.defer_wal_sync().expect("defer").expect("full durability defers");
    let commit = |spool: &mut Spool, n: u64, len: usize| {
        let req = AppendRequest { batches: vec![Batch { stream: "s".into(), data: noise(n, len), records: 1 }] };
        let seal = if n == 1 { edge_spool::SealWhat::Nothing } else { edge_spool::SealWhat::All };
        assert!(spool.commit(&[req], &[], seal, n).expect("commit").appends.is_ok());
    };
    // Batch 1 in segment 1, synced; batch 2 in segment 1 (filling it) and batch 3 in segment
    // 2, not: a crash, and both are checked at the next open (the mark says batch 1).
    commit(&mut spool, 1, 32 << 10);
    sync.sync(None).expect("sync");
    commit(&mut spool, 2, 40 << 10);
    commit(&mut spool, 3, 16 << 10);
    drop((spool, sync));
    // Segment 1 fails; segment 2 is the newest, whose commit records open reads.
    make_segment_unreadable(&opts.path, 1);

    let (spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("open: {e:?}"));
    assert!(report.quarantined.is_none(), "{report:?}");
    assert!(quarantined_files(dir.path()).is_empty());
    assert_eq!((report.sealed_chunks, report.unsynced_records_dropped), (2, 0), "nothing dropped: {report:?}");
    let chunks = sealed(&spool);
    assert_eq!(chunks.iter().map(|c| (c.seq, c.records)).collect::<Vec<_>>(), [(1, 2), (2, 1)]);
    let mut reader = spool.reader().expect("reader");
    assert!(matches!(reader.read(&chunks[0]), Err(SpoolError::Corrupt { .. })));
    assert_eq!(reader.read(&chunks[1]).expect("the later batch is kept"), noise(3, 16 << 10));
}

/// One flipped top bit in the row of an open (not yet sealed) batch, the only one in the file:
/// a negative record count, time or length, or a count whose sum with the next batch's is past
/// what SQLite's `sum` holds.
const OPEN_BATCH_OUT_OF_RANGE: [&str; 4] = [
    "UPDATE batches SET records = -1",
    "UPDATE batches SET commit_ms = -1",
    "UPDATE batches SET seg_len = -1",
    "UPDATE batches SET records = 9223372036854775807",
];

/// A spool with one open batch of 1 KiB in stream "s" (appended at time 1), closed.
fn spool_with_an_open_batch(opts: &SpoolOptions) {
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    append_one(&mut spool, "s", noise(1, 1024), 1);
    assert_eq!(spool.stats().open_records, 1);
}

#[test]
fn an_out_of_range_value_in_an_open_batch_row_fails_neither_the_open_nor_the_commits() {
    // The open batch sums were read as unsigned (and summed with `sum`, which fails past
    // i64): one damaged open batch row moved the whole file aside at open, and the same sums
    // read by every seal would have failed every commit.
    for sql in OPEN_BATCH_OUT_OF_RANGE {
        let (dir, opts) = setup();
        spool_with_an_open_batch(&opts);
        damage(&opts, sql);
        let (mut spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("{sql}: open: {e:?}"));
        assert!(report.quarantined.is_none() && !report.created, "{sql}: {report:?}");
        assert!(quarantined_files(dir.path()).is_empty(), "{sql}");
        assert_eq!((report.open_batches, report.sealed_chunks), (1, 0), "{sql}");
        // What the open batches hold is not known (a value that cannot be): the agent must not
        // take the bytes it appends from now on for all of them (and send a chunk from memory
        // without reading it). A count past the chunk limit is a count.
        let unknown = !sql.contains("records = 9");
        assert_eq!(spool.open_bytes("s"), if unknown { u64::MAX } else { 1024 }, "{sql}");
        // Appends and seals go on; the chunk over the damaged batch is sealed (the seal
        // checks the counters kept in memory against the rows) and reads as corrupt.
        append_one(&mut spool, "s", noise(2, 1024), 2);
        assert_eq!(spool.open_bytes("s"), if unknown { u64::MAX } else { 1024 }, "{sql}");
        assert_eq!(spool.seal_all(3).unwrap_or_else(|e| panic!("{sql}: seal: {e:?}")), 1, "{sql}");
        assert_eq!(spool.open_bytes("s"), 0, "{sql}");
        append_one(&mut spool, "s", noise(3, 1024), 4);
        assert_eq!(spool.open_bytes("s"), 1024, "{sql}");
        assert_eq!(spool.seal_all(5).unwrap_or_else(|e| panic!("{sql}: seal: {e:?}")), 1, "{sql}");
        let chunks = sealed(&spool);
        // A record count past the chunk limit seals the damaged batch on its own, before the
        // next batch joins it.
        let (seqs, later) = if sql.contains("records = 9") {
            (vec![1, 2, 3], vec![noise(2, 1024), noise(3, 1024)])
        } else {
            (vec![1, 2], vec![noise(3, 1024)])
        };
        assert_eq!(chunks.iter().map(|c| c.seq).collect::<Vec<_>>(), seqs, "{sql}");
        let mut reader = spool.reader().expect("reader");
        match reader.read(&chunks[0]) {
            Err(SpoolError::Corrupt { chunk, .. }) => assert_eq!(chunk, chunks[0].id, "{sql}"),
            other => panic!("{sql}: expected Corrupt, got {other:?}"),
        }
        for (chunk, data) in chunks[1..].iter().zip(later) {
            assert_eq!(reader.read(chunk).expect("a later chunk reads"), data, "{sql}");
        }
        // What the writer counted is what the next open loads from the rows.
        let counted = spool.stats();
        drop((reader, spool));
        let (mut spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("{sql}: reopen: {e:?}"));
        assert!(report.quarantined.is_none(), "{sql}: {report:?}");
        assert_eq!(spool.stats(), counted, "{sql}");
        spool.quarantine(chunks[0].id, "test").unwrap_or_else(|e| panic!("{sql}: quarantine: {e:?}"));
        let healthy = chunks[1..].iter().map(|c| c.id).collect::<Vec<_>>();
        let acked = spool.ack(&healthy).unwrap_or_else(|e| panic!("{sql}: ack: {e:?}")).acked;
        assert_eq!(acked as usize, healthy.len(), "{sql}");
        let stats = spool.stats();
        assert_eq!((stats.sealed_chunks, stats.total_bytes, stats.quarantined_chunks), (0, 0, 1), "{sql}: {stats:?}");
    }
}

#[test]
fn an_open_batch_whose_time_is_damaged_is_due_at_once_and_seals_on_its_own() {
    // A negative time is no time: the batch cannot wait out `linger`, and left open it would
    // wait for the next append to its stream; its chunk is quarantined when read.
    let (dir, mut opts) = setup();
    opts.linger = std::time::Duration::from_secs(3600);
    spool_with_an_open_batch(&opts);
    damage(&opts, "UPDATE batches SET commit_ms = -1");
    let (mut spool, report) = Spool::open(opts.clone()).expect("open");
    assert!(report.quarantined.is_none(), "{report:?}");
    assert_eq!(spool.stats().oldest_ms, None);
    assert_eq!(spool.seal_due(2).expect("seal"), 1, "due although its linger has not passed");
    let chunks = sealed(&spool);
    assert_eq!((chunks.len(), chunks[0].seq, chunks[0].first_ms), (1, 1, 2), "{chunks:?}");
    assert!(matches!(spool.reader().expect("reader").read(&chunks[0]), Err(SpoolError::Corrupt { .. })));
    assert!(quarantined_files(dir.path()).is_empty());
}

#[test]
fn an_open_batch_length_past_every_sum_opens_and_leaves_the_counters_with_its_chunk() {
    // `seg_offset + seg_len` past i64 is a float in SQLite: reading it as the segment's end
    // failed the open. The length counts as it reads (as a chunk row's size does), until the
    // chunk over it is quarantined; nothing of it may stay in the counters after that.
    let (dir, opts) = setup();
    spool_with_an_open_batch(&opts);
    damage(&opts, "UPDATE batches SET seg_len = 9223372036854775807");
    let (mut spool, report) = Spool::open(opts.clone()).unwrap_or_else(|e| panic!("open: {e:?}"));
    assert!(report.quarantined.is_none() && report.open_batches == 1, "{report:?}");
    assert!(quarantined_files(dir.path()).is_empty());
    assert_eq!(spool.seal_all(2).expect("seal"), 1);
    let damaged = sealed(&spool).remove(0);
    assert!(matches!(spool.reader().expect("reader").read(&damaged), Err(SpoolError::Corrupt { .. })));
    spool.quarantine(damaged.id, "test").expect("quarantine");
    let stats = spool.stats();
    assert_eq!((stats.sealed_chunks, stats.total_bytes), (0, 0), "{stats:?}");
    append_one(&mut spool, "s", noise(2, 1024), 3);
    assert_eq!(spool.seal_all(4).expect("seal"), 1);
    let chunks = sealed(&spool);
    assert_eq!((chunks.len(), chunks[0].seq), (1, 2), "{chunks:?}");
    assert_eq!(spool.reader().expect("reader").read(&chunks[0]).expect("read"), noise(2, 1024));
    let counted = spool.stats();
    drop(spool);
    let (spool, _) = Spool::open(opts.clone()).expect("reopen");
    assert_eq!(spool.stats(), counted);
}

/// A chunk row whose batch range a bit flip widened, dropped unread by the cap or purged from
/// quarantine, takes no other chunk's batches and none of the open ones (records answered to
/// their producers) with it: the range is bounded by the stream's neighbouring chunks and by
/// its open batches.
#[test]
fn a_widened_batch_range_in_a_damaged_row_deletes_no_other_records() {
    let widen = [
        "UPDATE chunks SET last_batch = last_batch + 1000 WHERE id = (SELECT min(id) FROM chunks)",
        "UPDATE chunks SET first_batch = first_batch - 1000, last_batch = last_batch + 1000 \
         WHERE id = (SELECT min(id) + 1 FROM chunks)",
    ];
    for (case, sql) in widen.iter().enumerate() {
        let (_dir, mut opts) = setup();
        spool_with_chunks(&opts, 3);
        damage(&opts, sql);
        opts.max_bytes = 4096;
        opts.full_policy = edge_spool::FullPolicy::DropOldest;
        let (mut spool, _) = Spool::open(opts.clone()).expect("open");
        // An open batch of the same stream: answered, not sealed.
        append_one(&mut spool, "s", noise(9, 512), 10);
        let before = sealed(&spool);
        let damaged = before[case].clone();
        // Makes room by dropping the oldest chunk (the damaged one in case 0).
        append_one(&mut spool, "t", noise(10, 1024), 11);
        if case == 1 {
            // The damaged row is the second oldest: it is dropped next.
            append_one(&mut spool, "t", noise(11, 1024), 12);
        }
        let after = sealed(&spool);
        assert!(!after.iter().any(|c| c.id == damaged.id), "{sql}: the damaged chunk was dropped");
        let mut reader = spool.reader().expect("reader");
        for c in after.iter().filter(|c| c.stream == "s") {
            assert_eq!(reader.read(c).expect("an intact neighbour reads whole"), noise(c.seq, 1024), "{sql}");
        }
        assert_eq!(spool.open_bytes("s"), 512, "{sql}");
        spool.seal_all(20).expect("seal");
        let open = sealed(&spool).into_iter().find(|c| c.stream == "s" && c.records == 1 && c.seq > 3);
        let open = open.unwrap_or_else(|| panic!("{sql}: the open batch was sealed"));
        assert_eq!(reader.read(&open).expect("the open batch is whole"), noise(9, 512), "{sql}");
    }
}

/// The same damage on a quarantined chunk: the purge deletes its batches within its neighbours.
#[test]
fn purging_a_quarantined_chunk_with_a_widened_range_keeps_its_neighbours() {
    let (_dir, opts) = setup();
    spool_with_chunks(&opts, 3);
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    let chunks = sealed(&spool);
    spool.quarantine(chunks[1].id, "test").expect("quarantine");
    drop(spool);
    damage(
        &opts,
        "UPDATE chunks SET first_batch = first_batch - 1000, last_batch = last_batch + 1000 WHERE quarantine IS NOT NULL",
    );
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    append_one(&mut spool, "s", noise(9, 512), 10);
    assert_eq!(spool.purge_quarantined().expect("purge"), 1);
    let mut reader = spool.reader().expect("reader");
    for c in [&chunks[0], &chunks[2]] {
        assert_eq!(reader.read(c).expect("a neighbour reads whole"), noise(c.seq, 1024));
    }
    spool.seal_all(20).expect("seal");
    let open = sealed(&spool).into_iter().find(|c| c.seq == 4).expect("the open batch, sealed");
    assert_eq!(reader.read(&open).expect("the open batch is whole"), noise(9, 512));
}

/// Two quarantined chunks, the second's row damaged into the first's range: the purge deletes
/// the batches of both, leaving none that belongs to no chunk (bytes on disk no counter counts).
#[test]
fn purging_a_damaged_row_beside_an_intact_one_leaves_no_orphan_batches() {
    let (_dir, opts) = setup();
    spool_with_chunks(&opts, 3);
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    let chunks = sealed(&spool);
    spool.quarantine(chunks[0].id, "test").expect("quarantine");
    spool.quarantine(chunks[1].id, "test").expect("quarantine");
    drop(spool);
    damage(&opts, &format!("UPDATE chunks SET first_batch = first_batch - 1 WHERE id = {}", chunks[1].id.0));
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    assert_eq!(spool.purge_quarantined().expect("purge"), 2);
    let mut reader = spool.reader().expect("reader");
    assert_eq!(reader.read(&chunks[2]).expect("the live chunk reads whole"), noise(3, 1024));
    drop((reader, spool));
    let raw = Connection::open(&opts.path).expect("raw connection");
    let orphans: i64 = raw
        .query_row(
            "SELECT count(*) FROM batches b WHERE NOT EXISTS \
             (SELECT 1 FROM chunks c WHERE c.stream_id = b.stream_id AND b.id BETWEEN c.first_batch AND c.last_batch)",
            [],
            |r| r.get(0),
        )
        .expect("count");
    assert_eq!(orphans, 0, "batches left that belong to no chunk");
}
