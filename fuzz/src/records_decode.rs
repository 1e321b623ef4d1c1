//! `records_decode`: arbitrary payloads through `edge_proto::records::decode_payload` and the
//! record framing, the way the ingest server checks a chunk.
//!
//! Input: `data[0]` bit 0 picks the codec, bit 1 asks the target to zstd-compress the rest first
//! (so that valid zstd frames are common) and `data[0] >> 2` is then a byte to flip in the frame
//! (0: none); `data[1..5]` is `raw_len` as a little-endian offset from the true length (so both
//! exact and wrong announcements occur); `data[5]` is the announced record count; the rest is
//! the payload. `raw_len` and `records` first pass `ChunkHeader::validate` with the default
//! limits, as on the server; inputs it refuses stop there.
//!
//! Asserts, for every input:
//! - no panic; and, in a build with a sanitizer (`cargo fuzz run -s address`, which gives
//!   libFuzzer the malloc hooks `-malloc_limit_mb` needs), no allocation of the announced
//!   `raw_len` before the payload has shown it decompresses to that size;
//! - a decoded payload has exactly `raw_len` bytes, and for codec `None` is the wire bytes;
//! - `split_records` and `RecordIter` agree, the records re-frame to exactly the raw payload,
//!   and a count mismatch is reported with both counts;
//! - a payload compressed with `compress_payload` decodes back to itself;
//! - `check_payload` (the server's check, which never holds the raw payload whole) concludes
//!   what decoding and splitting conclude: the same error, or for a zstd error a zstd error,
//!   unless it refuses a frame for the window it asks for.

use edge_proto::records::{
    RecordError, RecordIter, check_payload, compress_payload, decode_payload, encode_record, split_records,
};
use edge_proto::{ChunkHeader, Codec, Limits, StreamName};

/// Runs one input; panics if a property is broken.
pub fn run(data: &[u8]) {
    let Some((head, rest)) = data.split_at_checked(6) else { return };
    let codec = if head[0] & 1 == 0 { Codec::None } else { Codec::Zstd };
    let mut wire = rest.to_vec();
    let mut true_len = rest.len();
    if head[0] & 2 != 0 {
        wire = compress_payload(rest, 1).expect("zstd compresses any input");
        let back = decode_payload(Codec::Zstd, &wire, rest.len() as u32).expect("a compressed payload decodes");
        assert_eq!(&*back, rest);
        let flip = usize::from(head[0] >> 2);
        if flip != 0 && !wire.is_empty() {
            let at = flip % wire.len();
            wire[at] ^= 0xa5;
        }
        true_len = rest.len();
    }
    let delta = i32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    // Mostly small offsets (exact, off by a few), sometimes anything.
    let raw_len = if delta.unsigned_abs() < 1 << 24 {
        (true_len as i64 + i64::from(delta % 8)).clamp(0, i64::from(u32::MAX)) as u32
    } else {
        delta as u32
    };
    let records = u32::from(head[5]);
    let limits = Limits::default();
    let header = ChunkHeader {
        stream: StreamName::new("fuzz").expect("valid name"),
        seq: 1,
        records,
        raw_len,
        payload_len: wire.len() as u32,
        codec,
        checksum: crc32c::crc32c(&wire),
        created_ms: 0,
    };
    if header.validate(&limits).is_err() {
        return;
    }
    let checked = check_payload(codec, &wire, raw_len, records);
    let reference = decode_payload(codec, &wire, raw_len).and_then(|raw| split_records(&raw, records).map(drop));
    match (&reference, &checked) {
        (Err(RecordError::Decompress(_)), Err(RecordError::Decompress(_))) => {}
        // The check's bound on the window a frame may ask for, which decoding alone lacks.
        (_, Err(RecordError::Decompress(m))) if m.contains("too much memory") => {}
        _ => assert_eq!(checked, reference, "check_payload differs from decoding and splitting"),
    }
    let raw = match decode_payload(codec, &wire, raw_len) {
        Ok(raw) => raw,
        Err(e) => {
            assert!(matches!(e, RecordError::Decompress(_) | RecordError::RawLenMismatch { .. }), "{e:?}");
            assert!(!e.to_string().is_empty());
            return;
        }
    };
    assert_eq!(raw.len(), raw_len as usize, "decoded length differs from the announced raw_len");
    if codec == Codec::None {
        assert_eq!(&*raw, &wire[..]);
    }
    let iter: Vec<_> = RecordIter::new(&raw).collect();
    match split_records(&raw, records) {
        Ok(recs) => {
            assert_eq!(recs.len(), records as usize);
            let mut again = Vec::new();
            for r in &recs {
                encode_record(&mut again, r);
            }
            assert_eq!(again, &*raw, "records do not re-frame to the payload");
            assert!(iter.iter().all(Result::is_ok));
        }
        Err(RecordError::CountMismatch { expected, found }) => {
            assert_eq!(expected, records);
            assert_ne!(found, records);
            assert_eq!(found as usize, iter.len());
        }
        Err(RecordError::Truncated { offset, needed }) => {
            assert!(needed > 0 && offset < raw.len());
            assert!(matches!(iter.last(), Some(Err(RecordError::Truncated { .. }))));
            assert_eq!(iter.iter().filter(|r| r.is_err()).count(), 1, "the iterator stops after its error");
        }
        Err(e) => panic!("split_records gave {e:?}"),
    }
}

/// Seed inputs: framed records raw and compressed, exact and wrong lengths, a truncated record.
#[allow(dead_code)] // Used by the corpus generator and the regression tests, not the fuzz target.
pub fn seeds() -> Vec<Vec<u8>> {
    let mut recs = Vec::new();
    for i in 0..5u8 {
        encode_record(&mut recs, &vec![b'a' + i; usize::from(i) * 3]);
    }
    let with = |h: [u8; 6], body: &[u8]| [&h[..], body].concat();
    let z = compress_payload(&recs, 3).expect("compress");
    vec![
        with([0, 0, 0, 0, 0, 5], &recs),
        with([2, 0, 0, 0, 0, 5], &recs),
        with([1, 0, 0, 0, 0, 5], &z),
        with([1, 1, 0, 0, 0, 5], &z),
        with([1, 0, 0, 0, 0x40, 5], &z),
        with([2 | (7 << 2), 0, 0, 0, 0, 5], &recs),
        with([0, 0, 0, 0, 0, 4], &recs),
        with([0, 0, 0, 0, 0, 1], &[9, 0, 0, 0, 1, 2]),
        with([1, 0, 0, 0, 0, 0], b"\x28\xb5\x2f\xfd"),
    ]
}
