//! Reading chunks back: a chunk whose batch rows are interleaved with another stream's in the
//! segment (several runs of bytes, several `pread`s) reads back whole, with the CRC-32C of the
//! whole payload, and a bad byte in any run is named by its batch.

use edge_spool::{AppendRequest, Batch, ChunkMeta, Spool, SpoolError, SpoolOptions, SpoolReader};

mod util;

fn bytes(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
}

/// A spool whose two streams were appended in turn, one commit each, so that in the segment
/// every row of `a` lies between two rows of `b`; both sealed.
struct Interleaved {
    opts: SpoolOptions,
    _spool: Spool,
    _dir: tempfile::TempDir,
    reader: SpoolReader,
    /// The chunk of `a`, then the chunk of `b`.
    chunks: Vec<ChunkMeta>,
    /// What each stream was given.
    a: Vec<u8>,
    b: Vec<u8>,
}

fn interleaved() -> Interleaved {
    let dir = tempfile::tempdir().expect("temp dir");
    let opts = SpoolOptions::new(dir.path().join("spool.db"));
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for i in 0..5u8 {
        for (stream, want, seed) in [("a", &mut a, i), ("b", &mut b, 100 + i)] {
            let data = bytes(seed, 1000 + usize::from(i) * 17);
            want.extend_from_slice(&data);
            let req = AppendRequest { batches: vec![Batch { stream: stream.into(), data, records: 1 }] };
            spool.append(&[req], u64::from(i)).expect("append");
        }
    }
    spool.seal_all(10).expect("seal");
    let mut reader = spool.reader().expect("reader");
    let chunks = reader.sealed_after(None, usize::MAX).expect("list");
    assert_eq!(chunks.iter().map(|c| c.stream.as_str()).collect::<Vec<_>>(), ["a", "b"]);
    Interleaved { opts, _spool: spool, _dir: dir, reader, chunks, a, b }
}

#[test]
fn interleaved_rows_read_back_whole_with_the_payload_crc() {
    // Whole, not destructured: the temporary directory must outlive the reads.
    let mut t = interleaved();
    let chunks = t.chunks.clone();
    for (meta, want) in chunks.iter().zip([&t.a, &t.b]) {
        let payload = t.reader.read_payload(meta).expect("read");
        assert_eq!(&payload.data, want, "stream {}", meta.stream);
        assert_eq!(payload.crc32c, crc32c::crc32c(want), "stream {}", meta.stream);
        assert_eq!(meta.records, 5);
    }
    // Listing with a limit stops there, and resumes after the cursor.
    let first = t.reader.sealed_after(None, 1).expect("list one");
    assert_eq!(first, chunks[..1]);
    assert_eq!(t.reader.sealed_after(Some(first[0].id), 5).expect("rest"), chunks[1..]);
}

#[test]
fn a_bad_byte_in_a_later_run_is_named_by_its_batch() {
    let mut t = interleaved();
    let (opts, chunks) = (t.opts.clone(), t.chunks.clone());

    // The fourth row of stream `a`: its own run, after three others.
    let batch = util::flip_in_batch(&opts.path, chunks[0].id, 3, 500, 0x01);

    match t.reader.read_payload(&chunks[0]) {
        Err(SpoolError::Corrupt { chunk, detail }) => {
            assert_eq!(chunk, chunks[0].id);
            assert!(detail.starts_with(&format!("batch {batch}: crc32c")), "{detail}");
        }
        other => panic!("expected Corrupt, got {other:?}"),
    }
    assert_eq!(t.reader.read(&chunks[1]).expect("the other stream is fine"), t.b);
}
