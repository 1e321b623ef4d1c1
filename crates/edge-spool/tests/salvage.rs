//! `export_quarantined`: a quarantined chunk whose own row, or its stream's row, is damaged, or
//! whose batches do not add up to its row, hands over nothing (the batches it names may be
//! another chunk's), a failing output stops the export, and a selection takes one stream or one
//! chunk.

use edge_spool::{AppendRequest, Batch, ExportError, Selection, Spool, SpoolOptions, export_quarantined};

/// Two chunks of stream `s`, two batches each; both quarantined. Returns their ids.
fn two_quarantined(spool: &mut Spool) -> Vec<i64> {
    for (i, rec) in [b"one", b"two", b"thr", b"fou"].iter().enumerate() {
        let req = AppendRequest { batches: vec![Batch { stream: "s".into(), data: rec.to_vec(), records: 1 }] };
        spool.append(&[req], i as u64).expect("append");
        if i % 2 == 1 {
            spool.seal_all(i as u64).expect("seal");
        }
    }
    let chunks = spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list");
    assert_eq!(chunks.len(), 2);
    for c in &chunks {
        spool.quarantine(c.id, "test").expect("quarantine");
    }
    chunks.iter().map(|c| c.id.0).collect()
}

/// A new spool in a temporary directory with [`two_quarantined`] in it: the directory (kept
/// alive), the file, the spool and the chunks' ids.
fn two_quarantined_in_a_new_spool() -> (tempfile::TempDir, std::path::PathBuf, Spool, Vec<i64>) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("spool.db");
    let (mut spool, _) = Spool::open(SpoolOptions::new(path.clone())).expect("open");
    let ids = two_quarantined(&mut spool);
    (dir, path, spool, ids)
}

#[test]
fn a_chunk_whose_row_fails_its_checksum_hands_over_none_of_the_batches_it_names() {
    // The first chunk's row now names the second chunk's batches too: under its old checksum.
    let (ids, chunks, got) =
        export_after("UPDATE chunks SET last_batch = (SELECT max(last_batch) FROM chunks) WHERE id = ?1");
    assert_eq!(chunks.len(), 2);
    assert!(!chunks[0].complete() && chunks[0].batches == 0, "{:?}", chunks[0]);
    assert!(chunks[0].problems[0].starts_with("its chunk row fails its checksum"), "{:?}", chunks[0]);
    assert!(chunks[1].complete(), "{:?}", chunks[1]);
    assert_eq!((chunks[1].batches, chunks[1].exported_records, chunks[1].exported_bytes), (2, 2, 6));
    assert_eq!(got, vec![(ids[1], b"thr".to_vec(), 1), (ids[1], b"fou".to_vec(), 1)]);
}

#[test]
fn an_output_that_fails_stops_the_export_with_its_error() {
    let (_dir, path, _spool, _) = two_quarantined_in_a_new_spool();
    let mut calls = 0;
    let err = export_quarantined(&path, Selection { stream: Some("s"), seq: None }, &mut |_, _, _| {
        calls += 1;
        Err(std::io::Error::new(std::io::ErrorKind::BrokenPipe, "reader went away"))
    })
    .expect_err("the output failed");
    assert!(matches!(&err, ExportError::Output(e) if e.kind() == std::io::ErrorKind::BrokenPipe), "{err:?}");
    assert_eq!(calls, 1, "nothing more was read after the failure");
    // Another stream's name: nothing in quarantine there.
    let none =
        export_quarantined(&path, Selection { stream: Some("t"), seq: None }, &mut |_, _, _| Ok(())).expect("export");
    assert!(none.chunks.is_empty());
}

#[test]
fn a_selection_by_seq_exports_that_chunk_only_and_the_spool_id_comes_with_it() {
    let (_dir, path, spool, _) = two_quarantined_in_a_new_spool();
    let id = spool.id();
    drop(spool);
    let mut got = Vec::new();
    let second = export_quarantined(&path, Selection { stream: Some("s"), seq: Some(2) }, &mut |c, data, _| {
        got.push((c.seq, data.to_vec()));
        Ok(())
    })
    .expect("export");
    assert_eq!(second.spool_id, Some(id));
    assert_eq!(second.chunks.iter().map(|c| c.seq).collect::<Vec<_>>(), vec![2]);
    assert_eq!(got, vec![(2, b"thr".to_vec()), (2, b"fou".to_vec())]);
    let none =
        export_quarantined(&path, Selection { stream: None, seq: Some(3) }, &mut |_, _, _| Ok(())).expect("export");
    assert!(none.chunks.is_empty(), "{none:?}");
    // A damaged meta row: the id is not vouched for, and the chunks still export.
    let raw = rusqlite::Connection::open(&path).expect("raw connection");
    raw.execute("UPDATE meta SET value = zeroblob(16) WHERE key = 'spool_id'", []).expect("damage");
    drop(raw);
    let all = export_quarantined(&path, Selection::default(), &mut |_, _, _| Ok(())).expect("export");
    assert_eq!((all.spool_id, all.chunks.len()), (None, 2));
}

/// The chunks' ids, what the export says of each, and the batches it handed over (chunk, data,
/// records).
type Exported = (Vec<i64>, Vec<edge_spool::SalvagedChunk>, Vec<(i64, Vec<u8>, i64)>);

/// Damages the spool behind its back with `sql`, then exports everything.
fn export_after(sql: &str) -> Exported {
    let (_dir, path, spool, ids) = two_quarantined_in_a_new_spool();
    drop(spool);
    let raw = rusqlite::Connection::open(&path).expect("raw connection");
    assert_eq!(raw.execute(sql, [ids[0]]).expect("damage"), 1, "{sql}");
    drop(raw);
    let mut got = Vec::new();
    let chunks = export_quarantined(&path, Selection::default(), &mut |c, data, records| {
        got.push((c.id, data.to_vec(), records));
        Ok(())
    })
    .expect("export")
    .chunks;
    (ids, chunks, got)
}

#[test]
fn a_chunk_whose_stream_row_fails_its_checksum_hands_over_nothing() {
    // Both chunks are of the one stream: neither name is known to be theirs.
    let (_, chunks, got) = export_after(
        "UPDATE streams SET next_seq = next_seq + 1 WHERE id = (SELECT stream_id FROM chunks WHERE id = ?1)",
    );
    assert!(got.is_empty(), "{got:?}");
    for c in &chunks {
        assert!(!c.complete() && c.batches == 0, "{c:?}");
        assert!(c.problems.iter().any(|p| p.starts_with("the row of its stream fails its checksum")), "{c:?}");
    }
}

#[test]
fn a_chunk_whose_batches_do_not_add_up_to_its_row_hands_over_none_of_them() {
    // One of the first chunk's two batches is gone: the other checks out on its own, but the
    // chunk's row says two records.
    let (ids, chunks, got) =
        export_after("DELETE FROM batches WHERE id = (SELECT first_batch FROM chunks WHERE id = ?1)");
    assert!(!chunks[0].complete() && chunks[0].batches == 0, "{:?}", chunks[0]);
    assert!(
        chunks[0].problems.iter().any(|p| p.contains("may not all be its own, so none is exported")),
        "{:?}",
        chunks[0]
    );
    assert_eq!(got, vec![(ids[1], b"thr".to_vec(), 1), (ids[1], b"fou".to_vec(), 1)]);
}
