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

/// Checks a wire payload the way a receiver must before it stores it: it decodes to exactly
/// `raw_len` bytes that hold exactly `expected` framed records. The result is that of
/// [`decode_payload`] followed by [`split_records`] (the same errors, found in the same order;
/// zstd's messages may differ, and a frame is refused for the window bound below), but the raw
/// payload is never kept whole: a compressed one goes through a buffer of
/// [`CHECK_BUFFER`] bytes, with a zstd context kept per thread. Decompressing each chunk
/// into a buffer of its own cost the receiver a context, a window and up to the chunk's raw
/// size in fresh memory per chunk.
///
/// A zstd frame may ask for a window of at most 8 MiB, or twice the announced raw size if that
/// is more (zstd's own limit is 128 MiB): a frame of a few bytes cannot make the kept context
/// grow beyond that. zstd shrinks the window of a frame whose size it knows to that size, as
/// [`compress_payload`] does.
pub fn check_payload(codec: Codec, wire: &[u8], raw_len: u32, expected: u32) -> Result<(), RecordError> {
    let mut walk = Walk::default();
    match codec {
        Codec::None => {
            if wire.len() != raw_len as usize {
                return Err(RecordError::RawLenMismatch { expected: raw_len, found: wire.len() });
            }
            walk.feed(wire);
        }
        Codec::Zstd => {
            let mut walk_zstd = |c: &mut Checker| c.walk_zstd(wire, raw_len as usize, &mut walk);
            let found = CHECKER
                .try_with(|kept| match &mut *kept.borrow_mut() {
                    Some(c) => walk_zstd(c),
                    none => walk_zstd(none.insert(Checker::new()?)),
                })
                // This thread is exiting: a context for this payload alone.
                .unwrap_or_else(|_| walk_zstd(&mut Checker::new()?))?;
            if found != raw_len as usize {
                return Err(RecordError::RawLenMismatch { expected: raw_len, found });
            }
        }
    }
    walk.finish(expected)
}

/// Bytes decompressed at a time by [`check_payload`].
pub const CHECK_BUFFER: usize = 128 * 1024;

/// The window a frame may ask for when [`check_payload`] decompresses it, as a power of two, if
/// twice the raw size is less.
const CHECK_WINDOW_LOG: u32 = 23;

/// zstd's own bound on the window a frame may ask for (`ZSTD_WINDOWLOG_LIMIT_DEFAULT`), which
/// [`check_payload`] never loosens.
const ZSTD_WINDOW_LOG_LIMIT: u32 = 27;

thread_local! {
    static CHECKER: std::cell::RefCell<Option<Checker>> = const { std::cell::RefCell::new(None) };
}

/// A zstd decompression context and the buffer it decompresses into, kept by a thread.
struct Checker {
    ctx: zstd::zstd_safe::DCtx<'static>,
    buf: Box<[u8]>,
}

impl Checker {
    fn new() -> Result<Self, RecordError> {
        let ctx = zstd::zstd_safe::DCtx::try_create()
            .ok_or_else(|| RecordError::Decompress("cannot allocate a zstd context".into()))?;
        Ok(Checker { ctx, buf: vec![0; CHECK_BUFFER].into_boxed_slice() })
    }

    /// Decompresses `wire` through `walk`, stopping one byte past `raw_len`; returns the bytes
    /// it produced.
    fn walk_zstd(&mut self, wire: &[u8], raw_len: usize, walk: &mut Walk) -> Result<usize, RecordError> {
        use std::io::Read;
        use zstd::zstd_safe::{DParameter, ResetDirective};
        let zstd_err = |code: usize| RecordError::Decompress(zstd::zstd_safe::get_error_name(code).to_owned());
        // A context left inside a frame by an earlier payload's error starts afresh.
        self.ctx.reset(ResetDirective::SessionOnly).map_err(zstd_err)?;
        // The least power of two over `raw_len`: at most twice it.
        let raw_log = usize::BITS - raw_len.leading_zeros();
        self.ctx
            .set_parameter(DParameter::WindowLogMax(raw_log.clamp(CHECK_WINDOW_LOG, ZSTD_WINDOW_LOG_LIMIT)))
            .map_err(zstd_err)?;
        let mut decoder = zstd::stream::read::Decoder::with_context(wire, &mut self.ctx);
        let limit = raw_len.saturating_add(1);
        let mut found = 0;
        while found < limit {
            let room = (limit - found).min(self.buf.len());
            match decoder.read(&mut self.buf[..room]) {
                Ok(0) => break,
                Ok(n) => {
                    walk.feed(&self.buf[..n]);
                    found += n;
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(RecordError::Decompress(e.to_string())),
            }
        }
        Ok(found)
    }
}

/// The record framing of a raw payload read piece by piece: counts the records and notices
/// one cut off at the end.
#[derive(Debug, Default)]
struct Walk {
    /// Bytes fed so far.
    at: usize,
    /// Where the record being read starts.
    start: usize,
    records: u32,
    /// The length prefix read so far, `have` bytes of it.
    prefix: [u8; RECORD_OVERHEAD],
    have: usize,
    /// Bytes of the current record's body still to come.
    left: usize,
}

impl Walk {
    fn feed(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let n = if self.left > 0 {
                let n = self.left.min(bytes.len());
                self.left -= n;
                n
            } else {
                if self.have == 0 {
                    self.start = self.at;
                }
                let n = (RECORD_OVERHEAD - self.have).min(bytes.len());
                self.prefix[self.have..self.have + n].copy_from_slice(&bytes[..n]);
                self.have += n;
                if self.have == RECORD_OVERHEAD {
                    self.left = u32::from_le_bytes(self.prefix) as usize;
                    self.have = 0;
                    self.records = self.records.saturating_add(1);
                }
                n
            };
            self.at += n;
            bytes = &bytes[n..];
        }
    }

    fn finish(self, expected: u32) -> Result<(), RecordError> {
        if self.have > 0 {
            return Err(RecordError::Truncated { offset: self.start, needed: RECORD_OVERHEAD - self.have });
        }
        if self.left > 0 {
            return Err(RecordError::Truncated { offset: self.start, needed: self.left });
        }
        if self.records != expected {
            return Err(RecordError::CountMismatch { expected, found: self.records });
        }
        Ok(())
    }
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

    /// What the receiver concluded before [`check_payload`]: the payload decoded whole, then split.
    fn reference(codec: Codec, wire: &[u8], raw_len: u32, expected: u32) -> Result<(), RecordError> {
        let raw = decode_payload(codec, wire, raw_len)?;
        split_records(&raw, expected).map(drop)
    }

    /// The same result; zstd's messages may differ with the pieces it is read in.
    fn assert_same(codec: Codec, wire: &[u8], raw_len: u32, expected: u32) {
        let checked = check_payload(codec, wire, raw_len, expected);
        match (reference(codec, wire, raw_len, expected), checked) {
            (Err(RecordError::Decompress(_)), Err(RecordError::Decompress(_))) => {}
            (want, got) => assert_eq!(got, want, "codec {codec:?}, raw_len {raw_len}, expected {expected}"),
        }
    }

    fn framed(records: &[Vec<u8>]) -> Vec<u8> {
        let mut raw = Vec::new();
        for r in records {
            encode_record(&mut raw, r);
        }
        raw
    }

    #[test]
    fn a_checked_payload_reads_as_the_decoded_one_through_every_error() {
        let raw = framed(&[b"one".to_vec(), Vec::new(), vec![b'x'; 200_000], b"four".to_vec()]);
        for codec in [Codec::None, Codec::Zstd] {
            let wire = if codec == Codec::Zstd { compress_payload(&raw, 3).expect("compress") } else { raw.clone() };
            let len = raw.len() as u32;
            assert_eq!(check_payload(codec, &wire, len, 4), Ok(()));
            for (raw_len, expected) in [(len, 3), (len, 5), (len - 1, 4), (len + 1, 4), (0, 0), (10, 4)] {
                assert_same(codec, &wire, raw_len, expected);
            }
            // Cut inside a length prefix, inside a record's body, and at a record's end.
            for cut in [1, 3, 5, 7, 9, 100, 200_000, raw.len() - 5, raw.len() - 1] {
                let raw = &raw[..cut];
                let wire =
                    if codec == Codec::Zstd { compress_payload(raw, 1).expect("compress") } else { raw.to_vec() };
                for expected in [0, 2, 3, 4] {
                    assert_same(codec, &wire, raw.len() as u32, expected);
                }
            }
        }
        assert_eq!(
            check_payload(Codec::None, &raw[..9], 9, 2),
            Err(RecordError::Truncated { offset: 7, needed: 2 }),
            "two bytes of the second record's prefix are missing"
        );
    }

    #[test]
    fn a_corrupt_frame_fails_alone_and_the_kept_context_checks_the_next_one() {
        let raw = framed(&vec![vec![b'r'; 1000]; 300]);
        let wire = compress_payload(&raw, 3).expect("compress");
        let len = raw.len() as u32;
        let mut trailing = wire.clone();
        trailing.extend_from_slice(b"junk");
        let mut two = wire.clone();
        two.extend_from_slice(&wire);
        for (bad, raw_len) in [(&wire[..wire.len() - 3], len), (&trailing[..], len), (&wire[..wire.len() / 2], len)] {
            assert_same(Codec::Zstd, bad, raw_len, 300);
            assert!(check_payload(Codec::Zstd, bad, raw_len, 300).is_err());
            assert_eq!(check_payload(Codec::Zstd, &wire, len, 300), Ok(()), "after a failed payload");
        }
        assert_eq!(check_payload(Codec::Zstd, &two, 2 * len, 600), Ok(()), "frames back to back");
        for at in (0..wire.len()).step_by(7) {
            let mut flipped = wire.clone();
            flipped[at] ^= 0xa5;
            assert_same(Codec::Zstd, &flipped, len, 300);
        }
    }

    #[test]
    fn a_frame_asking_for_a_window_far_over_its_size_is_refused_by_the_check() {
        use std::io::Write;
        let raw = framed(&[b"small".to_vec()]);
        // A streaming encoder that does not know the size keeps the window it is told: 128 MiB.
        let mut e = zstd::stream::Encoder::new(Vec::new(), 3).expect("encoder");
        e.window_log(27).expect("window log");
        e.write_all(&raw).expect("write");
        let wire = e.finish().expect("finish");
        assert_eq!(decode_payload(Codec::Zstd, &wire, raw.len() as u32).as_deref(), Ok(&raw[..]));
        match check_payload(Codec::Zstd, &wire, raw.len() as u32, 1) {
            Err(RecordError::Decompress(m)) => assert!(m.contains("memory"), "{m}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        // Up to 8 MiB is taken whatever the size: a window of 2 MiB (zstd level 3 streaming).
        let mut e = zstd::stream::Encoder::new(Vec::new(), 3).expect("encoder");
        e.window_log(21).expect("window log");
        e.write_all(&raw).expect("write");
        assert_eq!(check_payload(Codec::Zstd, &e.finish().expect("finish"), raw.len() as u32, 1), Ok(()));
        // A chunk compressed as the agent does, of 16 MiB, whose window is its size.
        let big = framed(&vec![vec![b'b'; 1 << 20]; 16]);
        let wire = compress_payload(&big, 1).expect("compress");
        assert_eq!(check_payload(Codec::Zstd, &wire, big.len() as u32, 16), Ok(()));
    }

    proptest::proptest! {
        #[test]
        fn the_walk_reads_records_cut_into_any_pieces_as_a_whole(
            records in proptest::collection::vec(proptest::collection::vec(proptest::prelude::any::<u8>(), 0..40), 0..20),
            cut in 0usize..1000,
            pieces in proptest::collection::vec(1usize..13, 1..200),
            extra in 0u32..3,
        ) {
            let raw = framed(&records);
            let raw = &raw[..cut.min(raw.len())];
            let mut walk = Walk::default();
            let mut rest = raw;
            for p in pieces.iter().cycle() {
                if rest.is_empty() {
                    break;
                }
                let (piece, tail) = rest.split_at((*p).min(rest.len()));
                walk.feed(piece);
                rest = tail;
            }
            let expected = (records.len() as u32 + extra).saturating_sub(1);
            proptest::prop_assert_eq!(walk.finish(expected), split_records(raw, expected).map(drop));
        }
    }
}
