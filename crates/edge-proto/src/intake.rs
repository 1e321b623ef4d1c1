//! The agent's record-stream intake: a local protocol for producers that send many records,
//! pipelined, each acknowledged once it is durable in the spool.
//!
//! This is not part of `edge/1` (agent to ingest); it is what a producer speaks to the agent on
//! `intake.stream_socket`. Like HTTP `POST`, a record is acknowledged only after the spool's
//! commit; unlike it, the producer does not wait for one answer before sending the next record.
//!
//! # Byte layout
//!
//! All integers are little-endian. The producer opens with [`MAGIC`] (`b"EREC"` and the version
//! byte, 1), then sends frames `type: u8 | body_len: u32 | body`:
//!
//! | type | frame  | body |
//! |------|--------|------|
//! | 0x01 | Stream | the stream name for the records that follow (1 to 64 bytes of `[A-Za-z0-9_.-]`) |
//! | 0x02 | Record | one record, 1 byte to the agent's `intake.max_record_bytes` |
//!
//! The agent answers with frames of the same shape:
//!
//! | type | frame | body |
//! |------|-------|------|
//! | 0x81 | Ack   | `committed: u64`: how many of this connection's records are durable, counted from the first |
//! | 0x82 | Error | `committed: u64, status: u16, detail` (UTF-8, the rest of the body) |
//!
//! Records are committed in the order sent, and acknowledgements are cumulative: `committed = n`
//! means records 1 to `n` of the connection are in the spool and none after them is. An Error
//! frame is the agent's last word on the connection: the records after its `committed` are not
//! stored, so a producer resends them from record `committed + 1` (after fixing what the
//! `status`, an HTTP status code with the intake's meaning, names: 400 a malformed frame or stream
//! name, 413 a record over the limit, 503 the agent stopping, 507 the spool or its disk full, 500
//! a storage error). A producer that shuts down its sending side gets an Ack for everything it
//! sent, then the end of the stream.

use thiserror::Error;

use crate::name::{MAX_STREAM_NAME_LEN, StreamName};

/// What a producer sends first: `b"EREC"` and the protocol version, 1.
pub const MAGIC: [u8; 5] = *b"EREC\x01";

/// Frame type: the stream of the records that follow.
pub const STREAM: u8 = 0x01;
/// Frame type: one record.
pub const RECORD: u8 = 0x02;
/// Frame type (agent to producer): records committed so far.
pub const ACK: u8 = 0x81;
/// Frame type (agent to producer): the connection ends with an error.
pub const ERROR: u8 = 0x82;

/// Bytes before a frame's body: type and body length.
pub const FRAME_HEADER: usize = 5;

/// Longest `detail` in an Error frame.
pub const MAX_DETAIL_LEN: usize = 1024;

/// Appends a Stream frame.
///
/// # Panics
/// If `name` is longer than [`MAX_STREAM_NAME_LEN`] (a caller's bug: names come from
/// [`StreamName`]).
pub fn put_stream(out: &mut Vec<u8>, name: &StreamName) {
    put_frame(out, STREAM, name.as_str().as_bytes());
}

/// Appends a Record frame.
///
/// # Panics
/// If the record is 4 GiB or more, far over any agent's limit.
pub fn put_record(out: &mut Vec<u8>, record: &[u8]) {
    put_frame(out, RECORD, record);
}

/// Appends an Ack frame.
pub fn put_ack(out: &mut Vec<u8>, committed: u64) {
    put_frame(out, ACK, &committed.to_le_bytes());
}

/// Appends an Error frame; `detail` is cut to [`MAX_DETAIL_LEN`] bytes at a character boundary.
pub fn put_error(out: &mut Vec<u8>, committed: u64, status: u16, detail: &str) {
    let detail = crate::wire::truncate_str(detail, MAX_DETAIL_LEN);
    let mut body = Vec::with_capacity(10 + detail.len());
    body.extend_from_slice(&committed.to_le_bytes());
    body.extend_from_slice(&status.to_le_bytes());
    body.extend_from_slice(detail.as_bytes());
    put_frame(out, ERROR, &body);
}

fn put_frame(out: &mut Vec<u8>, kind: u8, body: &[u8]) {
    let len = u32::try_from(body.len()).expect("frame bodies are under 4 GiB");
    out.reserve(FRAME_HEADER + body.len());
    out.push(kind);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(body);
}

/// A producer's frame, borrowed from the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProducerFrame<'a> {
    Stream(&'a [u8]),
    Record(&'a [u8]),
}

/// Why a producer's bytes are refused. Each names what was wrong; the record number counts the
/// connection's records from 1.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum IntakeFrameError {
    #[error("the connection does not start with the record-stream preamble \"EREC\\x01\"{hint}")]
    BadMagic { hint: &'static str },
    #[error("protocol version {0} is not supported; this agent speaks version 1")]
    BadVersion(u8),
    #[error("unknown frame type 0x{0:02x}")]
    UnknownType(u8),
    #[error("stream frame of {0} bytes; a stream name is 1 to {MAX_STREAM_NAME_LEN} bytes")]
    StreamFrameLength(u32),
    #[error("record {index} is {len} bytes; intake.max_record_bytes = {max}")]
    RecordTooLarge { index: u64, len: u64, max: usize },
    #[error("record {index} is empty")]
    EmptyRecord { index: u64 },
}

/// Checks the preamble once [`MAGIC`]`.len()` bytes (or fewer, at the end of the connection)
/// are in `buf`; `Ok(false)` while more are needed.
pub fn check_magic(buf: &[u8]) -> Result<bool, IntakeFrameError> {
    let n = buf.len().min(4);
    if buf[..n] != MAGIC[..n] {
        let hint = if buf.starts_with(b"POST") || buf.starts_with(b"GET") || buf.starts_with(b"PUT") {
            "; it looks like HTTP, which the agent serves on intake.socket"
        } else {
            ""
        };
        return Err(IntakeFrameError::BadMagic { hint });
    }
    match buf.get(4) {
        None => Ok(false),
        Some(1) => Ok(true),
        Some(&v) => Err(IntakeFrameError::BadVersion(v)),
    }
}

/// Parses one producer frame from the start of `buf`: `Ok(None)` while it is incomplete,
/// otherwise the frame and the bytes it took. `next_record` is the number the next Record
/// frame would have (for errors). A Record over `max_record` is refused from its header alone,
/// before its body arrives.
pub fn parse_producer_frame(
    buf: &[u8],
    max_record: usize,
    next_record: u64,
) -> Result<Option<(ProducerFrame<'_>, usize)>, IntakeFrameError> {
    let Some(header) = buf.get(..FRAME_HEADER) else { return Ok(None) };
    let kind = header[0];
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]);
    match kind {
        STREAM if len == 0 || len as usize > MAX_STREAM_NAME_LEN => {
            return Err(IntakeFrameError::StreamFrameLength(len));
        }
        RECORD if len == 0 => return Err(IntakeFrameError::EmptyRecord { index: next_record }),
        RECORD if u64::from(len) > max_record as u64 => {
            return Err(IntakeFrameError::RecordTooLarge { index: next_record, len: u64::from(len), max: max_record });
        }
        STREAM | RECORD => {}
        other => return Err(IntakeFrameError::UnknownType(other)),
    }
    let end = FRAME_HEADER + len as usize;
    let Some(body) = buf.get(FRAME_HEADER..end) else { return Ok(None) };
    let frame = if kind == STREAM { ProducerFrame::Stream(body) } else { ProducerFrame::Record(body) };
    Ok(Some((frame, end)))
}

/// An agent's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Ack { committed: u64 },
    Error { committed: u64, status: u16, detail: String },
}

/// Why an agent's answer could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("malformed answer from the agent: {0}")]
pub struct ReplyError(&'static str);

/// Parses one answer from the start of `buf`: `Ok(None)` while it is incomplete.
pub fn parse_reply(buf: &[u8]) -> Result<Option<(Reply, usize)>, ReplyError> {
    let Some(header) = buf.get(..FRAME_HEADER) else { return Ok(None) };
    let len = u32::from_le_bytes([header[1], header[2], header[3], header[4]]) as usize;
    let max = match header[0] {
        ACK => 8,
        ERROR => 10 + MAX_DETAIL_LEN,
        _ => return Err(ReplyError("unknown frame type")),
    };
    if len > max || len < 8 || (header[0] == ERROR && len < 10) || (header[0] == ACK && len != 8) {
        return Err(ReplyError("bad frame length"));
    }
    let Some(body) = buf.get(FRAME_HEADER..FRAME_HEADER + len) else { return Ok(None) };
    let mut committed = [0u8; 8];
    committed.copy_from_slice(&body[..8]);
    let committed = u64::from_le_bytes(committed);
    let reply = if header[0] == ACK {
        Reply::Ack { committed }
    } else {
        Reply::Error {
            committed,
            status: u16::from_le_bytes([body[8], body[9]]),
            detail: String::from_utf8_lossy(&body[10..]).into_owned(),
        }
    };
    Ok(Some((reply, FRAME_HEADER + len)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> StreamName {
        StreamName::new(s).expect("valid")
    }

    #[test]
    fn frames_round_trip_split_at_every_byte() {
        let mut bytes = Vec::new();
        put_stream(&mut bytes, &name("temp"));
        put_record(&mut bytes, b"21.5");
        put_record(&mut bytes, &[7; 300]);
        let want = [ProducerFrame::Stream(b"temp"), ProducerFrame::Record(b"21.5"), ProducerFrame::Record(&[7; 300])];
        let mut at = 0;
        for w in want {
            for cut in at..at + 5 {
                assert_eq!(parse_producer_frame(&bytes[at..cut], 1000, 1), Ok(None), "cut at {cut}");
            }
            let (frame, used) = parse_producer_frame(&bytes[at..], 1000, 1).expect("valid").expect("complete");
            assert_eq!(frame, w);
            assert_eq!(parse_producer_frame(&bytes[at..at + used - 1], 1000, 1), Ok(None));
            at += used;
        }
        assert_eq!(at, bytes.len());
    }

    #[test]
    fn a_record_over_the_limit_is_refused_from_its_header() {
        let mut bytes = Vec::new();
        put_record(&mut bytes, &[1; 11]);
        assert_eq!(
            parse_producer_frame(&bytes[..FRAME_HEADER], 10, 17),
            Err(IntakeFrameError::RecordTooLarge { index: 17, len: 11, max: 10 })
        );
        assert_eq!(
            IntakeFrameError::RecordTooLarge { index: 17, len: 11, max: 10 }.to_string(),
            "record 17 is 11 bytes; intake.max_record_bytes = 10"
        );
    }

    #[test]
    fn bad_frames_are_named() {
        assert_eq!(parse_producer_frame(&[9, 0, 0, 0, 0], 10, 1), Err(IntakeFrameError::UnknownType(9)));
        assert_eq!(parse_producer_frame(&[STREAM, 0, 0, 0, 0], 10, 1), Err(IntakeFrameError::StreamFrameLength(0)));
        assert_eq!(parse_producer_frame(&[STREAM, 65, 0, 0, 0], 10, 1), Err(IntakeFrameError::StreamFrameLength(65)));
        assert_eq!(parse_producer_frame(&[RECORD, 0, 0, 0, 0], 10, 3), Err(IntakeFrameError::EmptyRecord { index: 3 }));
    }

    #[test]
    fn the_preamble_is_checked_as_it_arrives() {
        assert_eq!(check_magic(b""), Ok(false));
        assert_eq!(check_magic(b"ER"), Ok(false));
        assert_eq!(check_magic(b"EREC"), Ok(false));
        assert_eq!(check_magic(b"EREC\x01"), Ok(true));
        assert_eq!(check_magic(b"EREC\x02"), Err(IntakeFrameError::BadVersion(2)));
        let http = check_magic(b"POST /v1/streams/a HTTP/1.1").expect_err("not the protocol");
        assert!(http.to_string().contains("looks like HTTP"), "{http}");
        assert!(matches!(check_magic(b"X"), Err(IntakeFrameError::BadMagic { hint: "" })));
    }

    #[test]
    fn replies_round_trip_and_bad_ones_are_refused() {
        let mut bytes = Vec::new();
        put_ack(&mut bytes, 42);
        put_error(&mut bytes, 43, 413, "record 44 is too large");
        let (a, n) = parse_reply(&bytes).expect("valid").expect("complete");
        assert_eq!(a, Reply::Ack { committed: 42 });
        assert_eq!(parse_reply(&bytes[n..bytes.len() - 1]), Ok(None));
        let (e, m) = parse_reply(&bytes[n..]).expect("valid").expect("complete");
        assert_eq!(e, Reply::Error { committed: 43, status: 413, detail: "record 44 is too large".into() });
        assert_eq!(n + m, bytes.len());
        assert!(parse_reply(&[ACK, 9, 0, 0, 0]).is_err());
        assert!(parse_reply(&[0x33, 8, 0, 0, 0]).is_err());
        let mut long = Vec::new();
        put_error(&mut long, 0, 500, &"x".repeat(5000));
        let (Reply::Error { detail, .. }, _) = parse_reply(&long).expect("valid").expect("complete") else {
            panic!("an error")
        };
        assert_eq!(detail.len(), MAX_DETAIL_LEN);
    }
}
