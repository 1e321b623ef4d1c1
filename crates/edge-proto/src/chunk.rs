//! The chunk header that starts every chunk uni-stream.
//!
//! # Layout
//!
//! Integers are little-endian. The stream carries a 6-byte prefix, the header body, then exactly
//! `payload_len` payload bytes, then the stream finishes:
//!
//! ```text
//! +--------------+-------------------+---------------------------+----------------------+
//! | magic "EDGC" | header_len u16le  | header body[header_len]   | payload[payload_len] |
//! +--------------+-------------------+---------------------------+----------------------+
//! ```
//!
//! Header body, in order (35 to 98 bytes):
//!
//! | field        | type | meaning |
//! |--------------|------|---------|
//! | `stream_len` | u8   | 1..=64 |
//! | `stream`     | `[u8; stream_len]` | `[A-Za-z0-9_.-]`, see [`StreamName`] |
//! | `seq`        | u64  | sequence number of the chunk in its stream; `(stream, seq)` is the dedup key |
//! | `records`    | u32  | number of records in the raw payload |
//! | `raw_len`    | u32  | length of the raw (decompressed) payload |
//! | `payload_len`| u32  | length of the payload on the wire |
//! | `codec`      | u8   | 0 = none, 1 = zstd ([`Codec`]) |
//! | `checksum`   | u32  | crc32c (Castagnoli) of the wire payload |
//! | `created_ms` | u64  | Unix milliseconds of the chunk's first record; informational |
//!
//! # Validation
//!
//! [`ChunkHeader::decode`] refuses a `header_len` over `Limits::max_chunk_header` from the prefix
//! alone, before waiting for or reading the body, and refuses a wrong magic from the first bytes.
//! The body must be consumed exactly. The decoded header must then pass
//! [`ChunkHeader::validate`]: `payload_len`, `raw_len` and `records` within their limits, codec
//! `None` implies `payload_len == raw_len`, and `records * 4 <= raw_len` (each record has a 4-byte
//! length prefix). The payload is checked separately by [`ChunkHeader::verify_payload`].

use crate::error::ProtoError;
use crate::name::{MAX_STREAM_NAME_LEN, StreamName};
use crate::records::RECORD_OVERHEAD;
use crate::wire::{Reader, put_short_str, put_u16, put_u32, put_u64};
use crate::{Codec, Limits};

/// The 4 bytes every chunk stream starts with.
pub const CHUNK_MAGIC: [u8; 4] = *b"EDGC";
/// Bytes before the header body: the magic and `header_len: u16`.
pub const CHUNK_PREFIX_LEN: usize = 6;

/// The application error code of a `STOP_SENDING` with which the server stops a chunk stream it
/// has accepted and answers on the control stream (a `Retry` when the payload came too slowly or
/// memory ran out): the chunk's [`Ack`](crate::ControlFrame::Ack) follows, and the agent must
/// wait for it before it offers the chunk again on the same connection. Any other code means the
/// server did not accept the chunk and no ack for it will come on this connection.
pub const STOP_ANSWERED: u32 = 1;

/// Metadata of one chunk, sent before its payload on the chunk's own uni-stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkHeader {
    /// The record stream the chunk belongs to.
    pub stream: StreamName,
    /// Sequence number within `stream`; `(device, stream, seq)` is the server's dedup key.
    pub seq: u64,
    /// Number of records in the raw payload.
    pub records: u32,
    /// Length of the raw (decompressed) payload.
    pub raw_len: u32,
    /// Length of the payload on the wire.
    pub payload_len: u32,
    /// Compression of the wire payload.
    pub codec: Codec,
    /// crc32c of the wire payload.
    pub checksum: u32,
    /// Unix milliseconds when the chunk's first record was spooled; informational only.
    pub created_ms: u64,
}

impl ChunkHeader {
    /// Appends the stream prefix (magic, header length, header body) to `out`; the payload
    /// follows it on the stream.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&CHUNK_MAGIC);
        let len_at = out.len();
        put_u16(out, 0); // Patched below, once the body length is known.
        let body_start = out.len();
        put_short_str(out, self.stream.as_str(), MAX_STREAM_NAME_LEN);
        put_u64(out, self.seq);
        put_u32(out, self.records);
        put_u32(out, self.raw_len);
        put_u32(out, self.payload_len);
        out.push(self.codec.to_u8());
        put_u32(out, self.checksum);
        put_u64(out, self.created_ms);
        // The body is at most 98 bytes: the stream name is the only variable field (<= 64).
        let body_len = u16::try_from(out.len() - body_start).unwrap_or(u16::MAX);
        out[len_at..body_start].copy_from_slice(&body_len.to_le_bytes());
    }

    /// The number of bytes [`encode`](Self::encode) appends.
    pub fn encoded_len(&self) -> usize {
        CHUNK_PREFIX_LEN + 1 + self.stream.len() + 8 + 4 + 4 + 4 + 1 + 4 + 8
    }

    /// Decodes a header from the start of a chunk stream.
    ///
    /// `Ok(None)` means more bytes are needed. Otherwise returns the header and the number of
    /// bytes it used; the payload starts at that offset. A wrong magic or a `header_len` over
    /// `limits.max_chunk_header` is refused as soon as those bytes are present, and the decoded
    /// header is checked with [`validate`](Self::validate).
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(ChunkHeader, usize)>, ProtoError> {
        let magic_seen = buf.len().min(CHUNK_MAGIC.len());
        if buf[..magic_seen] != CHUNK_MAGIC[..magic_seen] {
            return Err(ProtoError::BadMagic);
        }
        let Some(prefix) = buf.first_chunk::<CHUNK_PREFIX_LEN>() else {
            return Ok(None);
        };
        let header_len = u16::from_le_bytes([prefix[4], prefix[5]]);
        if u32::from(header_len) > limits.max_chunk_header {
            return Err(ProtoError::FrameTooLarge { len: header_len.into(), max: limits.max_chunk_header.into() });
        }
        let Some(body) = buf[CHUNK_PREFIX_LEN..].get(..usize::from(header_len)) else {
            return Ok(None);
        };
        let header = Self::decode_body(body)?;
        header.validate(limits)?;
        Ok(Some((header, CHUNK_PREFIX_LEN + usize::from(header_len))))
    }

    fn decode_body(body: &[u8]) -> Result<Self, ProtoError> {
        let mut r = Reader::new(body);
        let stream = StreamName::from_bytes(r.short_bytes("stream", MAX_STREAM_NAME_LEN)?)?;
        let seq = r.u64("seq")?;
        let records = r.u32("records")?;
        let raw_len = r.u32("raw_len")?;
        let payload_len = r.u32("payload_len")?;
        let codec = r.u8("codec")?;
        let codec = Codec::from_u8(codec).ok_or(ProtoError::UnknownCodec(codec))?;
        let checksum = r.u32("checksum")?;
        let created_ms = r.u64("created_ms")?;
        r.finish("chunk header")?;
        Ok(Self { stream, seq, records, raw_len, payload_len, codec, checksum, created_ms })
    }

    /// Checks the declared sizes against `limits` and against each other (see the module docs).
    pub fn validate(&self, limits: &Limits) -> Result<(), ProtoError> {
        if self.payload_len > limits.max_chunk_payload {
            return Err(ProtoError::PayloadTooLarge { len: self.payload_len, max: limits.max_chunk_payload });
        }
        if self.raw_len > limits.max_raw_len {
            return Err(ProtoError::RawTooLarge { len: self.raw_len, max: limits.max_raw_len });
        }
        if self.records > limits.max_records_per_chunk {
            return Err(ProtoError::TooManyRecords { records: self.records, max: limits.max_records_per_chunk });
        }
        if self.codec == Codec::None && self.payload_len != self.raw_len {
            return Err(ProtoError::RawLenMismatch { raw_len: self.raw_len, payload_len: self.payload_len });
        }
        if u64::from(self.records) * RECORD_OVERHEAD as u64 > u64::from(self.raw_len) {
            return Err(ProtoError::RecordsExceedRawLen { records: self.records, raw_len: self.raw_len });
        }
        Ok(())
    }

    /// Checks that `payload` (the wire bytes after the header) has the declared length and
    /// checksum. Does not decompress or split records: see [`crate::records`].
    pub fn verify_payload(&self, payload: &[u8]) -> Result<(), ProtoError> {
        self.verify_payload_summary(payload.len(), crate::crc32c(payload))
    }

    /// As [`ChunkHeader::verify_payload`], for a caller that already has the payload's length
    /// and CRC-32C (computed from the bytes, not taken from the peer).
    pub fn verify_payload_summary(&self, len: usize, computed: u32) -> Result<(), ProtoError> {
        if len != self.payload_len as usize {
            return Err(ProtoError::PayloadLength { expected: self.payload_len, found: len });
        }
        if computed != self.checksum {
            return Err(ProtoError::ChecksumMismatch { expected: self.checksum, computed });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorCode;
    use crate::records::encode_record;

    fn header_for(payload: &[u8], records: u32) -> ChunkHeader {
        ChunkHeader {
            stream: StreamName::new("sensors.temp").expect("valid name"),
            seq: 7,
            records,
            raw_len: payload.len() as u32,
            payload_len: payload.len() as u32,
            codec: Codec::None,
            checksum: crate::crc32c(payload),
            created_ms: 1_700_000_000_000,
        }
    }

    fn sample_payload() -> Vec<u8> {
        let mut p = Vec::new();
        encode_record(&mut p, b"{\"t\":1}");
        encode_record(&mut p, b"{\"t\":2}");
        p
    }

    #[test]
    fn header_round_trips_and_reports_bytes_used() {
        let payload = sample_payload();
        let header = header_for(&payload, 2);
        let mut buf = Vec::new();
        header.encode(&mut buf);
        assert_eq!(buf.len(), header.encoded_len());
        buf.extend_from_slice(&payload);
        let (back, used) = ChunkHeader::decode(&buf, &Limits::default()).expect("valid").expect("complete");
        assert_eq!(back, header);
        assert_eq!(&buf[used..], &payload[..]);
        back.verify_payload(&buf[used..]).expect("payload matches");
    }

    #[test]
    fn header_has_the_documented_layout() {
        let header = ChunkHeader {
            stream: StreamName::new("s").expect("valid name"),
            seq: 1,
            records: 2,
            raw_len: 8,
            payload_len: 5,
            codec: Codec::Zstd,
            checksum: 0xdead_beef,
            created_ms: 3,
        };
        let mut buf = Vec::new();
        header.encode(&mut buf);
        #[rustfmt::skip]
        let expected = [
            b'E', b'D', b'G', b'C', 35, 0,
            1, b's',
            1, 0, 0, 0, 0, 0, 0, 0,
            2, 0, 0, 0,
            8, 0, 0, 0,
            5, 0, 0, 0,
            1,
            0xef, 0xbe, 0xad, 0xde,
            3, 0, 0, 0, 0, 0, 0, 0,
        ];
        assert_eq!(buf, expected);
    }

    #[test]
    fn every_proper_prefix_needs_more_bytes() {
        let header = header_for(&sample_payload(), 2);
        let mut buf = Vec::new();
        header.encode(&mut buf);
        for cut in 0..buf.len() {
            assert_eq!(ChunkHeader::decode(&buf[..cut], &Limits::default()), Ok(None), "cut {cut}");
        }
    }

    #[test]
    fn a_wrong_magic_is_refused_from_the_first_byte() {
        assert_eq!(ChunkHeader::decode(b"X", &Limits::default()), Err(ProtoError::BadMagic));
        assert_eq!(ChunkHeader::decode(b"EDGX", &Limits::default()), Err(ProtoError::BadMagic));
        assert_eq!(ChunkHeader::decode(b"EDG", &Limits::default()), Ok(None));
    }

    #[test]
    fn an_oversized_header_length_is_refused_before_its_body_arrives() {
        let buf = [b'E', b'D', b'G', b'C', 0xff, 0xff];
        let err = ChunkHeader::decode(&buf, &Limits::default()).expect_err("too large");
        assert_eq!(err, ProtoError::FrameTooLarge { len: 0xffff, max: 1024 });
        assert_eq!(err.code(), ErrorCode::FrameTooLarge);
    }

    #[test]
    fn headers_over_the_limits_are_refused() {
        let limits = Limits::default();
        let base = header_for(&sample_payload(), 2);
        let decode = |h: &ChunkHeader| {
            let mut buf = Vec::new();
            h.encode(&mut buf);
            ChunkHeader::decode(&buf, &limits).map(|_| ())
        };
        let big = ChunkHeader { payload_len: u32::MAX, raw_len: u32::MAX, ..base.clone() };
        assert_eq!(decode(&big), Err(ProtoError::PayloadTooLarge { len: u32::MAX, max: limits.max_chunk_payload }));
        let raw = ChunkHeader { codec: Codec::Zstd, raw_len: u32::MAX, ..base.clone() };
        assert_eq!(decode(&raw), Err(ProtoError::RawTooLarge { len: u32::MAX, max: limits.max_raw_len }));
        let many = ChunkHeader { records: u32::MAX, ..base.clone() };
        assert_eq!(decode(&many), Err(ProtoError::TooManyRecords { records: u32::MAX, max: 1 << 20 }));
        let mismatch = ChunkHeader { raw_len: 3, ..base.clone() };
        assert_eq!(decode(&mismatch), Err(ProtoError::RawLenMismatch { raw_len: 3, payload_len: 22 }));
        let crowded = ChunkHeader { records: 6, ..base.clone() };
        assert_eq!(decode(&crowded), Err(ProtoError::RecordsExceedRawLen { records: 6, raw_len: 22 }));
        assert!(decode(&base).is_ok());
    }

    #[test]
    fn unknown_codec_and_trailing_bytes_are_malformed() {
        let mut buf = Vec::new();
        header_for(&sample_payload(), 2).encode(&mut buf);
        let codec_at = CHUNK_PREFIX_LEN + 1 + 12 + 8 + 4 + 4 + 4;
        let mut bad = buf.clone();
        bad[codec_at] = 9;
        assert_eq!(ChunkHeader::decode(&bad, &Limits::default()), Err(ProtoError::UnknownCodec(9)));
        let mut long = buf.clone();
        long[4] += 1;
        long.push(0);
        assert_eq!(
            ChunkHeader::decode(&long, &Limits::default()),
            Err(ProtoError::TrailingBytes { frame: "chunk header", extra: 1 })
        );
    }

    #[test]
    fn payload_length_and_checksum_are_verified() {
        let payload = sample_payload();
        let header = header_for(&payload, 2);
        assert_eq!(header.verify_payload(&payload[1..]), Err(ProtoError::PayloadLength { expected: 22, found: 21 }));
        let mut flipped = payload.clone();
        flipped[5] ^= 1;
        let err = header.verify_payload(&flipped).expect_err("bad checksum");
        assert!(matches!(err, ProtoError::ChecksumMismatch { .. }), "{err:?}");
        assert_eq!(err.reject_reason(), Some(crate::RejectReason::BadChecksum));
    }
}
