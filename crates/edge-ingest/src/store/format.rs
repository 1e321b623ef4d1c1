//! Byte layout of segment files: the segment header and the entry header.
//!
//! The layout itself is documented in the parent module (`store/mod.rs`); this file is the only
//! code that encodes or decodes it. Decoding never panics on any input: every length read from
//! disk is bounded before it is used.

use edge_proto::Codec;

use super::ChunkKey;

/// Subdirectory of the data directory that holds the segment files.
pub const SEGMENTS_DIR: &str = "segments";
/// Lock file in the data directory (exclusive `flock` while a [`super::Store`] is open).
pub const LOCK_FILE: &str = "LOCK";
/// File name suffix of a segment.
pub const SEGMENT_SUFFIX: &str = ".seg";
/// Number of decimal digits in a segment file name.
pub const SEGMENT_NAME_DIGITS: usize = 20;

/// First bytes of each copy of the segment header (format version 1).
pub const SEGMENT_MAGIC: [u8; 8] = *b"EDGSEG\x00\x01";
/// Size of one copy of the segment header (28 bytes used, 4 bytes zero padding).
pub const SEGMENT_HEADER_COPY_LEN: usize = 32;
/// Size of the segment header: two identical copies.
pub const SEGMENT_HEADER_LEN: u64 = 2 * SEGMENT_HEADER_COPY_LEN as u64;

/// First bytes of every entry (format version 1).
pub const ENTRY_MAGIC: [u8; 8] = [0xED, b'G', b'E', b'C', b'H', b'N', b'K', 0x01];
/// Magic plus the `u32` body length.
pub const ENTRY_PREFIX_LEN: usize = 12;
/// The header CRC after the body.
pub const ENTRY_CRC_LEN: usize = 4;
/// Size of the header body without the two names.
pub const BODY_FIXED_LEN: usize = 8 + 8 + 16 + 8 + 4 + 1 + 4 + 4 + 4 + 8 + 8 + 2 + 2;
/// Longest device id or stream name the store accepts, in bytes.
pub const MAX_NAME_LEN: usize = 4096;
/// Longest header body that can be valid.
pub const MAX_BODY_LEN: usize = BODY_FIXED_LEN + 2 * MAX_NAME_LEN;

/// File name of segment `number`: 20 zero-padded digits and `.seg`.
pub fn segment_file_name(number: u64) -> String {
    format!("{number:020}{SEGMENT_SUFFIX}")
}

/// Parses a segment file name; `None` for anything else.
pub fn parse_segment_file_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(SEGMENT_SUFFIX)?;
    if digits.len() != SEGMENT_NAME_DIGITS || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// CRC32C of `bytes`, seeded with the segment salt.
///
/// The salt is random per segment and never leaves the server, so bytes that a device put in a
/// payload cannot be crafted to pass as an entry header when recovery scans for the magic.
pub fn salted_crc(salt: u64, bytes: &[u8]) -> u32 {
    edge_proto::crc32c_append(edge_proto::crc32c(&salt.to_le_bytes()), bytes)
}

/// The header at the start of every non-empty segment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Segment number, equal to the one in the file name.
    pub number: u64,
    /// Seed of every entry header CRC in this segment.
    pub salt: u64,
}

impl SegmentHeader {
    /// Both copies, ready to write at offset 0.
    pub fn encode(&self) -> [u8; SEGMENT_HEADER_LEN as usize] {
        let mut copy = [0u8; SEGMENT_HEADER_COPY_LEN];
        copy[..8].copy_from_slice(&SEGMENT_MAGIC);
        copy[8..16].copy_from_slice(&self.number.to_le_bytes());
        copy[16..24].copy_from_slice(&self.salt.to_le_bytes());
        let crc = edge_proto::crc32c(&copy[..24]);
        copy[24..28].copy_from_slice(&crc.to_le_bytes());
        let mut out = [0u8; SEGMENT_HEADER_LEN as usize];
        out[..SEGMENT_HEADER_COPY_LEN].copy_from_slice(&copy);
        out[SEGMENT_HEADER_COPY_LEN..].copy_from_slice(&copy);
        out
    }

    /// Decodes the first valid copy in `bytes` (the first [`SEGMENT_HEADER_LEN`] bytes of a file).
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        bytes.chunks_exact(SEGMENT_HEADER_COPY_LEN).take(2).find_map(Self::decode_copy)
    }

    fn decode_copy(copy: &[u8]) -> Option<Self> {
        if copy.get(..8)? != SEGMENT_MAGIC {
            return None;
        }
        let crc = u32::from_le_bytes(copy.get(24..28)?.try_into().ok()?);
        if edge_proto::crc32c(copy.get(..24)?) != crc {
            return None;
        }
        Some(Self {
            number: u64::from_le_bytes(copy.get(8..16)?.try_into().ok()?),
            salt: u64::from_le_bytes(copy.get(16..24)?.try_into().ok()?),
        })
    }
}

/// Everything in an entry header except the two names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryFields {
    /// Commit (group commit attempt) that wrote this entry; starts at 1, strictly increasing.
    pub commit: u64,
    /// Newest commit known durable when this entry was written (0: none). Every commit id
    /// strictly between `prev_commit` and `commit` failed and must be ignored.
    pub prev_commit: u64,
    /// Number of records in the payload.
    pub records: u32,
    /// Payload codec.
    pub codec: Codec,
    /// Size of the payload once decoded.
    pub raw_len: u32,
    /// Size of the payload as stored (as received on the wire).
    pub payload_len: u32,
    /// CRC32C (unsalted) of the stored payload: the same value the wire carries.
    pub payload_crc: u32,
    /// When the agent created the chunk (ms since the Unix epoch, agent clock).
    pub created_ms: u64,
    /// When the server wrote the entry (ms since the Unix epoch, server clock).
    pub stored_ms: u64,
}

/// A decoded entry header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryHeader {
    /// Dedup key of the chunk.
    pub key: ChunkKey,
    /// Everything else.
    pub fields: EntryFields,
}

/// Why bytes at an offset are not a valid entry header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// Fewer bytes than the header needs (or than its length field announces).
    Short,
    /// No entry magic.
    Magic,
    /// The body length is outside what a valid header can have.
    Length,
    /// The header CRC does not match.
    Crc,
    /// CRC matched but the content is inconsistent (name lengths, UTF-8, codec).
    Content,
}

/// Total header size (prefix, body, CRC) of an entry with these names.
pub fn entry_header_len(key: &ChunkKey) -> usize {
    ENTRY_PREFIX_LEN + BODY_FIXED_LEN + key.device.len() + key.stream.len() + ENTRY_CRC_LEN
}

/// Appends the header of one entry to `out`.
///
/// The caller has checked that both names are at most [`MAX_NAME_LEN`] bytes.
pub fn encode_entry_header(out: &mut Vec<u8>, salt: u64, key: &ChunkKey, f: &EntryFields) {
    let start = out.len();
    let body_len = BODY_FIXED_LEN + key.device.len() + key.stream.len();
    out.extend_from_slice(&ENTRY_MAGIC);
    // MAX_BODY_LEN fits in u32 and u16 holds MAX_NAME_LEN, both checked by the caller.
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&f.commit.to_le_bytes());
    out.extend_from_slice(&f.prev_commit.to_le_bytes());
    out.extend_from_slice(&key.spool);
    out.extend_from_slice(&key.seq.to_le_bytes());
    out.extend_from_slice(&f.records.to_le_bytes());
    out.push(f.codec.to_u8());
    out.extend_from_slice(&f.raw_len.to_le_bytes());
    out.extend_from_slice(&f.payload_len.to_le_bytes());
    out.extend_from_slice(&f.payload_crc.to_le_bytes());
    out.extend_from_slice(&f.created_ms.to_le_bytes());
    out.extend_from_slice(&f.stored_ms.to_le_bytes());
    out.extend_from_slice(&(key.device.len() as u16).to_le_bytes());
    out.extend_from_slice(&(key.stream.len() as u16).to_le_bytes());
    out.extend_from_slice(key.device.as_bytes());
    out.extend_from_slice(key.stream.as_bytes());
    let crc = salted_crc(salt, &out[start..]);
    out.extend_from_slice(&crc.to_le_bytes());
}

/// Reads the body length from the first [`ENTRY_PREFIX_LEN`] bytes at an entry offset and
/// returns the total header size to read next.
pub fn entry_header_total_len(prefix: &[u8]) -> Result<usize, HeaderError> {
    let magic = prefix.get(..8).ok_or(HeaderError::Short)?;
    if magic != ENTRY_MAGIC {
        return Err(HeaderError::Magic);
    }
    let body_len = read_u32(prefix, 8).ok_or(HeaderError::Short)? as usize;
    if !(BODY_FIXED_LEN..=MAX_BODY_LEN).contains(&body_len) {
        return Err(HeaderError::Length);
    }
    Ok(ENTRY_PREFIX_LEN + body_len + ENTRY_CRC_LEN)
}

/// Decodes a whole entry header (`bytes` holds exactly [`entry_header_total_len`] bytes).
pub fn decode_entry_header(bytes: &[u8], salt: u64) -> Result<EntryHeader, HeaderError> {
    let total = entry_header_total_len(bytes)?;
    if bytes.len() < total {
        return Err(HeaderError::Short);
    }
    let crc_at = total - ENTRY_CRC_LEN;
    let stored_crc = read_u32(bytes, crc_at).ok_or(HeaderError::Short)?;
    if salted_crc(salt, &bytes[..crc_at]) != stored_crc {
        return Err(HeaderError::Crc);
    }
    let body = &bytes[ENTRY_PREFIX_LEN..crc_at];
    let bad = HeaderError::Content;
    let mut spool = [0u8; 16];
    spool.copy_from_slice(body.get(16..32).ok_or(bad)?);
    let device_len = read_u16(body, 73).ok_or(bad)? as usize;
    let stream_len = read_u16(body, 75).ok_or(bad)? as usize;
    if BODY_FIXED_LEN + device_len + stream_len != body.len() {
        return Err(bad);
    }
    let names = &body[BODY_FIXED_LEN..];
    let device = std::str::from_utf8(&names[..device_len]).map_err(|_| bad)?;
    let stream = std::str::from_utf8(&names[device_len..]).map_err(|_| bad)?;
    let codec = Codec::from_u8(*body.get(44).ok_or(bad)?).ok_or(bad)?;
    let fields = EntryFields {
        commit: read_u64(body, 0).ok_or(bad)?,
        prev_commit: read_u64(body, 8).ok_or(bad)?,
        records: read_u32(body, 40).ok_or(bad)?,
        codec,
        raw_len: read_u32(body, 45).ok_or(bad)?,
        payload_len: read_u32(body, 49).ok_or(bad)?,
        payload_crc: read_u32(body, 53).ok_or(bad)?,
        created_ms: read_u64(body, 57).ok_or(bad)?,
        stored_ms: read_u64(body, 65).ok_or(bad)?,
    };
    Ok(EntryHeader {
        key: ChunkKey {
            device: device.to_owned(),
            spool,
            stream: stream.to_owned(),
            seq: read_u64(body, 32).ok_or(bad)?,
        },
        fields,
    })
}

fn read_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(device: &str, stream: &str, seq: u64) -> ChunkKey {
        ChunkKey { device: device.into(), spool: [7; 16], stream: stream.into(), seq }
    }

    fn fields() -> EntryFields {
        EntryFields {
            commit: 9,
            prev_commit: 7,
            records: 3,
            codec: Codec::Zstd,
            raw_len: 1234,
            payload_len: 567,
            payload_crc: 0xDEAD_BEEF,
            created_ms: 1_700_000_000_000,
            stored_ms: 1_700_000_000_123,
        }
    }

    #[test]
    fn entry_header_round_trips_with_its_salt_only() {
        let k = key("dev-1", "metrics", 42);
        let mut buf = Vec::new();
        encode_entry_header(&mut buf, 99, &k, &fields());
        assert_eq!(buf.len(), entry_header_len(&k));
        assert_eq!(entry_header_total_len(&buf), Ok(buf.len()));
        let h = decode_entry_header(&buf, 99).expect("valid header");
        assert_eq!(h.key, k);
        assert_eq!(h.fields, fields());
        assert_eq!(decode_entry_header(&buf, 100), Err(HeaderError::Crc));
    }

    #[test]
    fn every_single_bit_flip_in_an_entry_header_is_detected() {
        let mut buf = Vec::new();
        encode_entry_header(&mut buf, 5, &key("d", "s", 1), &fields());
        for byte in 0..buf.len() {
            for bit in 0..8 {
                let mut b = buf.clone();
                b[byte] ^= 1 << bit;
                assert!(decode_entry_header(&b, 5).is_err(), "flip at {byte}:{bit} went unnoticed");
            }
        }
    }

    #[test]
    fn segment_header_survives_the_loss_of_one_copy() {
        let h = SegmentHeader { number: 3, salt: 0x1234_5678_9ABC_DEF0 };
        let mut b = h.encode();
        assert_eq!(SegmentHeader::decode(&b), Some(h));
        b[10] ^= 0xFF;
        assert_eq!(SegmentHeader::decode(&b), Some(h));
        b[SEGMENT_HEADER_COPY_LEN + 10] ^= 0xFF;
        assert_eq!(SegmentHeader::decode(&b), None);
    }

    #[test]
    fn segment_file_names_are_twenty_digits() {
        assert_eq!(segment_file_name(12), "00000000000000000012.seg");
        assert_eq!(parse_segment_file_name("00000000000000000012.seg"), Some(12));
        assert_eq!(parse_segment_file_name("12.seg"), None);
        assert_eq!(parse_segment_file_name("0000000000000000001x.seg"), None);
        assert_eq!(parse_segment_file_name("00000000000000000012.tmp"), None);
    }

    proptest::proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(bytes in proptest::collection::vec(proptest::num::u8::ANY, 0..400)) {
            let _ = entry_header_total_len(&bytes);
            let _ = decode_entry_header(&bytes, 1);
            let _ = SegmentHeader::decode(&bytes);
        }
    }
}
