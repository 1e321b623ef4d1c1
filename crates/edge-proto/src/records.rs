//! Record framing inside a chunk payload.
//!
//! A chunk's raw (uncompressed) payload is a plain concatenation of records, each written as a
//! 4-byte little-endian length followed by that many bytes. There is no header and no padding, so
//! two framed batches concatenated are again a valid payload: the spool relies on this to build a
//! chunk from the batches that intake committed, without copying records one by one.

use crate::Codec;

/// Bytes of framing added to each record.
pub const RECORD_OVERHEAD: usize = 4;

/// Why a payload could not be split into records.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RecordError {
    /// The payload ends inside a length prefix or inside a record.
    #[error("payload truncated at byte {offset}: record needs {needed} more bytes")]
    Truncated { offset: usize, needed: usize },
    /// The number of records differs from what the chunk header announced.
    #[error("payload holds {found} records, header announced {expected}")]
    CountMismatch { expected: u32, found: u32 },
    /// The payload could not be decompressed.
    #[error("payload could not be decompressed: {0}")]
    Decompress(String),
    /// The decompressed payload is not the announced size.
    #[error("decompressed payload is {found} bytes, header announced {expected}")]
    RawLenMismatch { expected: u32, found: usize },
}

/// Appends one framed record to `out`.
///
/// # Panics
/// Never for records under 4 GiB; callers enforce a record size limit far below that.
pub fn encode_record(out: &mut Vec<u8>, record: &[u8]) {
    let len = u32::try_from(record.len()).expect("record size limit is far below 4 GiB");
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(record);
}

/// Size of `record` once framed.
pub fn framed_len(record: &[u8]) -> usize {
    record.len() + RECORD_OVERHEAD
}

/// Iterates over the records of a raw payload, borrowing from it.
///
/// Yields `Err` once (and then stops) if the payload is truncated.
#[derive(Debug, Clone)]
pub struct RecordIter<'a> {
    buf: &'a [u8],
    offset: usize,
    failed: bool,
}

impl<'a> RecordIter<'a> {
    /// Starts iterating over `payload`.
    pub fn new(payload: &'a [u8]) -> Self {
        Self { buf: payload, offset: 0, failed: false }
    }
}

impl<'a> Iterator for RecordIter<'a> {
    type Item = Result<&'a [u8], RecordError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.failed || self.offset == self.buf.len() {
            return None;
        }
        let rest = &self.buf[self.offset..];
        let Some(len_bytes) = rest.get(..RECORD_OVERHEAD) else {
            self.failed = true;
            return Some(Err(RecordError::Truncated { offset: self.offset, needed: RECORD_OVERHEAD - rest.len() }));
        };
        let mut len = [0u8; 4];
        len.copy_from_slice(len_bytes);
        let len = u32::from_le_bytes(len) as usize;
        let body = &rest[RECORD_OVERHEAD..];
        if body.len() < len {
            self.failed = true;
            return Some(Err(RecordError::Truncated { offset: self.offset, needed: len - body.len() }));
        }
        self.offset += RECORD_OVERHEAD + len;
        Some(Ok(&body[..len]))
    }
}

/// Splits a raw payload into records and checks the count against the header.
pub fn split_records(payload: &[u8], expected: u32) -> Result<Vec<&[u8]>, RecordError> {
    let records = RecordIter::new(payload).collect::<Result<Vec<_>, _>>()?;
    let found = u32::try_from(records.len()).unwrap_or(u32::MAX);
    if found != expected {
        return Err(RecordError::CountMismatch { expected, found });
    }
    Ok(records)
}

/// Turns a wire payload into the raw payload, decompressing if `codec` says so.
///
/// `raw_len` is the size the header announced; decompression never produces more than that, so
/// a small malicious payload cannot expand into an unbounded allocation.
pub fn decode_payload(codec: Codec, wire: &[u8], raw_len: u32) -> Result<std::borrow::Cow<'_, [u8]>, RecordError> {
    match codec {
        Codec::None => {
            if wire.len() != raw_len as usize {
                return Err(RecordError::RawLenMismatch { expected: raw_len, found: wire.len() });
            }
            Ok(std::borrow::Cow::Borrowed(wire))
        }
        Codec::Zstd => {
            let raw = decompress_bounded(wire, raw_len as usize)?;
            if raw.len() != raw_len as usize {
                return Err(RecordError::RawLenMismatch { expected: raw_len, found: raw.len() });
            }
            Ok(std::borrow::Cow::Owned(raw))
        }
    }
}

/// First output buffer of [`decompress_bounded`], before the payload has shown how much it
/// really expands.
const FIRST_OUTPUT: usize = 64 * 1024;

/// Decompresses `wire`, keeping at most `raw_len + 1` output bytes (one more than announced, so
/// an over-long payload is detected) without trusting `raw_len` for the allocation.
///
/// The output buffer starts small and at most doubles as bytes actually come out, so memory is
/// proportional to what the payload really decompresses to. Decompressing in one call into a
/// buffer of `raw_len` bytes would let a peer make the server allocate `max_raw_len` (64 MiB) for
/// a few bytes of payload, outside the payload memory budget, once per chunk in flight.
fn decompress_bounded(wire: &[u8], raw_len: usize) -> Result<Vec<u8>, RecordError> {
    use std::io::Read;
    let decompress_err = |e: std::io::Error| RecordError::Decompress(e.to_string());
    let limit = raw_len.saturating_add(1);
    let mut decoder = zstd::stream::read::Decoder::with_buffer(wire).map_err(decompress_err)?;
    let mut out = vec![0u8; limit.min(FIRST_OUTPUT.max(wire.len().saturating_mul(4)))];
    let mut filled = 0;
    loop {
        if filled == out.len() {
            if out.len() >= limit {
                break;
            }
            let grown = out.len().saturating_mul(2).min(limit);
            out.resize(grown, 0);
        }
        match decoder.read(&mut out[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(decompress_err(e)),
        }
    }
    out.truncate(filled);
    Ok(out)
}

/// Compresses a raw payload for the wire with zstd at `level`.
pub fn compress_payload(raw: &[u8], level: i32) -> std::io::Result<Vec<u8>> {
    zstd::bulk::compress(raw, level)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framed_batches_concatenate_into_one_payload() {
        let mut a = Vec::new();
        encode_record(&mut a, b"one");
        encode_record(&mut a, b"");
        let mut b = Vec::new();
        encode_record(&mut b, b"three");
        a.extend_from_slice(&b);
        let recs = split_records(&a, 3).expect("valid payload");
        assert_eq!(recs, vec![&b"one"[..], &b""[..], &b"three"[..]]);
    }

    #[test]
    fn truncated_payload_is_an_error_not_a_panic() {
        let mut a = Vec::new();
        encode_record(&mut a, b"hello");
        for cut in 0..a.len() {
            let r = split_records(&a[..cut], 1);
            if cut == 0 {
                assert_eq!(r, Err(RecordError::CountMismatch { expected: 1, found: 0 }));
            } else {
                assert!(matches!(r, Err(RecordError::Truncated { .. })), "cut {cut}: {r:?}");
            }
        }
    }

    #[test]
    fn zstd_round_trip_and_bomb_is_bounded() {
        let mut raw = Vec::new();
        for i in 0..100u32 {
            encode_record(&mut raw, format!("{{\"t\":{i}}}").as_bytes());
        }
        let wire = compress_payload(&raw, 3).expect("compress");
        let back = decode_payload(Codec::Zstd, &wire, raw.len() as u32).expect("decode");
        assert_eq!(&*back, &raw[..]);
        // Announcing a smaller raw length than the real one must fail, not allocate more.
        assert!(decode_payload(Codec::Zstd, &wire, 10).is_err());
    }

    #[test]
    fn announced_raw_len_is_checked_against_what_really_comes_out() {
        let raw = vec![7u8; 300_000];
        let wire = compress_payload(&raw, 1).expect("compress");
        // Bigger than the first output buffer, so the buffer grows on the way.
        assert_eq!(&*decode_payload(Codec::Zstd, &wire, 300_000).expect("exact length"), &raw[..]);
        assert_eq!(
            decode_payload(Codec::Zstd, &wire, 64 << 20),
            Err(RecordError::RawLenMismatch { expected: 64 << 20, found: 300_000 })
        );
        assert_eq!(
            decode_payload(Codec::Zstd, &wire, 299_999),
            Err(RecordError::RawLenMismatch { expected: 299_999, found: 300_000 })
        );
        // Two frames back to back decode as their concatenation; garbage after a frame does not.
        let mut two = wire.clone();
        two.extend_from_slice(&wire);
        assert_eq!(decode_payload(Codec::Zstd, &two, 600_000).map(|r| r.len()), Ok(600_000));
        let mut trailing = wire.clone();
        trailing.extend_from_slice(b"junk");
        assert!(matches!(decode_payload(Codec::Zstd, &trailing, 300_000), Err(RecordError::Decompress(_))));
        let cut = decode_payload(Codec::Zstd, &wire[..wire.len() - 3], 300_000);
        assert!(matches!(cut, Err(RecordError::Decompress(_) | RecordError::RawLenMismatch { .. })), "{cut:?}");
    }
}
