//! `chunk_header`: arbitrary bytes into the chunk header parser.
//!
//! Two inputs in one: the bytes as they are (the start of a chunk stream), and the same bytes
//! read as header *fields* (a structured header with a valid stream name), so that the rarer
//! valid headers are reached without the fuzzer having to guess a magic and a length.
//!
//! Asserts, for every input:
//! - no panic;
//! - a decoded header re-encodes to exactly the bytes it was decoded from (the layout is
//!   canonical: `encode(decode(x)) == x`), `encoded_len` is the number of bytes used, and the
//!   header passes `validate`;
//! - every proper prefix of a decodable header needs more bytes (`Ok(None)`), and bytes after it
//!   do not change it;
//! - an error stays the same error when more bytes follow (decisions are made from the bytes
//!   seen, never from how many arrived), and carries a peer close code;
//! - an encoded structured header decodes back to itself exactly when `validate` accepts it,
//!   and to `validate`'s error otherwise.

use edge_proto::{CHUNK_PREFIX_LEN, ChunkHeader, Codec, ErrorCode, Limits, StreamName};

/// Runs one input; panics if a property is broken.
pub fn run(data: &[u8]) {
    let limits = Limits::default();
    raw_bytes(data, &limits);
    if let Some(header) = structured(data) {
        let mut buf = Vec::new();
        header.encode(&mut buf);
        assert_eq!(buf.len(), header.encoded_len());
        match (header.validate(&limits), ChunkHeader::decode(&buf, &limits)) {
            (Ok(()), Ok(Some((back, used)))) => {
                assert_eq!(back, header);
                assert_eq!(used, buf.len());
            }
            (Err(want), Err(got)) => assert_eq!(got, want),
            (v, d) => panic!("validate says {v:?} but decode says {d:?} for {header:?}"),
        }
        raw_bytes(&buf, &limits);
    }
}

fn raw_bytes(data: &[u8], limits: &Limits) {
    match ChunkHeader::decode(data, limits) {
        Ok(Some((header, used))) => {
            assert!(used <= data.len());
            assert_eq!(used, header.encoded_len());
            let mut again = Vec::new();
            header.encode(&mut again);
            assert_eq!(again, &data[..used], "{header:?} does not re-encode to its bytes");
            assert_eq!(header.validate(limits), Ok(()));
            for cut in 0..used {
                assert_eq!(ChunkHeader::decode(&data[..cut], limits), Ok(None), "prefix of {cut} bytes");
            }
            let mut longer = data[..used].to_vec();
            longer.extend_from_slice(b"payload");
            assert_eq!(ChunkHeader::decode(&longer, limits), Ok(Some((header.clone(), used))));
            // The payload check never panics, whatever follows the header.
            let _ = header.verify_payload(&data[used..]);
        }
        Ok(None) => {
            // Only a prefix of something longer: more bytes must be able to matter.
            let declared = data.get(4..CHUNK_PREFIX_LEN).map_or(0, |l| usize::from(u16::from_le_bytes([l[0], l[1]])));
            assert!(data.len() < CHUNK_PREFIX_LEN + declared, "{} bytes and still incomplete", data.len());
        }
        Err(e) => {
            assert!(
                matches!(e.code(), ErrorCode::ProtocolViolation | ErrorCode::FrameTooLarge),
                "header error {e:?} has code {}",
                e.code()
            );
            let mut longer = data.to_vec();
            longer.extend_from_slice(&[0; 64]);
            assert_eq!(ChunkHeader::decode(&longer, limits), Err(e), "more bytes changed the error");
        }
    }
}

/// Reads header fields from `data`: `stream_len: u8` (folded into 1..=64), that many name bytes
/// (mapped into the name alphabet), then the fixed fields in wire order.
fn structured(data: &[u8]) -> Option<ChunkHeader> {
    const ALPHABET: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-";
    let (&len, rest) = data.split_first()?;
    let len = usize::from(len) % 64 + 1;
    let (name, rest) = rest.split_at_checked(len)?;
    let name: String = name.iter().map(|b| char::from(ALPHABET[usize::from(*b) % ALPHABET.len()])).collect();
    let stream = StreamName::new(&name).ok()?;
    let mut r = rest;
    let mut take = |n: usize| -> Option<u64> {
        let (head, tail) = r.split_at_checked(n)?;
        r = tail;
        let mut b = [0u8; 8];
        b[..n].copy_from_slice(head);
        Some(u64::from_le_bytes(b))
    };
    let seq = take(8)?;
    let records = take(4)? as u32;
    let raw_len = take(4)? as u32;
    let payload_len = take(4)? as u32;
    let codec = if take(1)? & 1 == 0 { Codec::None } else { Codec::Zstd };
    let checksum = take(4)? as u32;
    let created_ms = take(8)?;
    Some(ChunkHeader { stream, seq, records, raw_len, payload_len, codec, checksum, created_ms })
}

/// Seed inputs: a valid header (with and without payload), its fields, and broken variants.
#[allow(dead_code)] // Used by the corpus generator and the regression tests, not the fuzz target.
pub fn seeds() -> Vec<Vec<u8>> {
    let payload = b"\x03\0\0\0abc\x01\0\0\0d";
    let header = ChunkHeader {
        stream: StreamName::new("sensors.temp").expect("valid name"),
        seq: 7,
        records: 2,
        raw_len: payload.len() as u32,
        payload_len: payload.len() as u32,
        codec: Codec::None,
        checksum: crc32c::crc32c(payload),
        created_ms: 1_700_000_000_000,
    };
    let mut valid = Vec::new();
    header.encode(&mut valid);
    let mut with_payload = valid.clone();
    with_payload.extend_from_slice(payload);
    let mut out = vec![valid.clone(), with_payload, b"EDGC".to_vec(), b"EDGC\xff\xff".to_vec(), b"EDGX".to_vec()];
    let mut long = valid.clone();
    long[4] += 1;
    long.push(0);
    out.push(long);
    let mut bad_codec = valid.clone();
    bad_codec[CHUNK_PREFIX_LEN + 1 + 12 + 20] = 9;
    out.push(bad_codec);
    // The same header as structured fields (stream_len byte 11 -> 12 name bytes).
    out.push(valid[CHUNK_PREFIX_LEN..].iter().enumerate().map(|(i, b)| if i == 0 { 11 } else { *b }).collect());
    out
}
