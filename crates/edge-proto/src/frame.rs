//! Control frames on the bidirectional control stream, and their incremental decoder.
//!
//! # Layout
//!
//! Every frame is a 5-byte header followed by its body; integers are little-endian:
//!
//! ```text
//! +---------+----------------+------------------+
//! | type u8 | body_len u32le | body[body_len]   |
//! +---------+----------------+------------------+
//! ```
//!
//! `body_len` must not exceed `Limits::max_control_frame`; the decoder refuses a larger declared
//! length before buffering any of the body. Bodies must be consumed exactly: trailing bytes are an
//! error. Strings are `len: u8` + UTF-8 bytes.
//!
//! | type | frame   | body fields, in order |
//! |------|---------|-----------------------|
//! | 0x01 | Hello   | `version: u16`, `spool_id: [u8; 16]`, `agent_len: u8` (≤ 128), `agent` |
//! | 0x02 | Welcome | `version: u16`, `max_chunk_payload: u32`, `max_in_flight: u32`, `device_len: u8` (≤ 255), `device` |
//! | 0x03 | Ack     | `stream_len: u8` (1..=64), `stream` (`[A-Za-z0-9_.-]`), `seq: u64`, `status: u8` |
//! | 0x04 | GoAway  | `code: u32` (an [`ErrorCode`]) |
//! | 0x05 | Floor   | `stream_len: u8` (1..=64), `stream`, `seq: u64` (version 2 on, agent → server) |
//!
//! Any other type byte (0x00 included) is an error, detected from the header alone.
//!
//! The ack `status` byte is `kind << 4 | reason`:
//!
//! | byte | status |
//! |------|--------|
//! | 0x00 | Stored |
//! | 0x01 | Duplicate |
//! | 0x10 / 0x11 / 0x12 / 0x13 | Retry: SinkUnavailable / Overloaded / ShuttingDown / Limit (version 3 on) |
//! | 0x20 / 0x21 / 0x22 / 0x23 | Rejected: BadChecksum / TooLarge / Malformed / BadRecords |
//!
//! `version` is the first field of Hello in every protocol version, so a server can always read
//! it: a Hello whose version is not one of [`MIN_VERSION`]`..=`[`VERSION`] and whose rest does
//! not parse with this layout decodes as [`ProtoError::UnsupportedVersion`] rather than as a
//! malformed frame.
//!
//! # Encoding strings over their limit
//!
//! `ControlFrame::encode` is infallible: an `agent` longer than [`MAX_AGENT_LEN`] or a `device`
//! longer than [`MAX_DEVICE_LEN`] is cut to the limit on a UTF-8 char boundary. The sessions cut
//! them when they are created, so what they send is what they report.

use std::collections::VecDeque;

use crate::error::{ErrorCode, ProtoError};
use crate::name::{MAX_STREAM_NAME_LEN, StreamName};
use crate::wire::{Reader, put_short_str, put_u16, put_u32, put_u64};
use crate::{Limits, MIN_VERSION, VERSION};

/// Bytes of the frame header: `type: u8` and `body_len: u32`.
pub const FRAME_HEADER_LEN: usize = 5;
/// Longest `agent` string in a Hello, in bytes.
pub const MAX_AGENT_LEN: usize = 128;
/// Longest `device` string in a Welcome, in bytes.
pub const MAX_DEVICE_LEN: usize = 255;

const TYPE_HELLO: u8 = 0x01;
const TYPE_WELCOME: u8 = 0x02;
const TYPE_ACK: u8 = 0x03;
const TYPE_GO_AWAY: u8 = 0x04;
const TYPE_FLOOR: u8 = 0x05;

/// The server's answer to one chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckStatus {
    /// The chunk is durable in the sink; the agent may delete it.
    Stored,
    /// The chunk was already durable (a resend); the agent may delete it.
    Duplicate,
    /// The chunk was not stored; the agent should send it again later.
    Retry(RetryReason),
    /// The server will never accept these bytes; the agent should quarantine the chunk.
    Rejected(RejectReason),
}

/// Why the server asks for a chunk to be sent again later.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryReason {
    /// The sink could not persist the chunk (disk full, I/O error, JetStream down, …).
    SinkUnavailable,
    /// The server is over its memory or concurrency budget.
    Overloaded,
    /// The server is shutting down.
    ShuttingDown,
    /// A limit of the server's on what one device may hold refuses the chunk (a new stream
    /// past the cap on its streams): the same chunk is refused until an operator raises the
    /// limit, while the device's other chunks are not. Protocol version 3 on
    /// ([`LIMIT_VERSION`](crate::LIMIT_VERSION)); an agent of an older version is answered
    /// [`RetryReason::Overloaded`] instead.
    Limit,
}

/// Why the server will never accept a chunk's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    /// The payload's crc32c does not match the header.
    BadChecksum,
    /// The chunk exceeds the server's limits.
    TooLarge,
    /// The payload does not match its header (length, codec, decompression).
    Malformed,
    /// The payload does not split into the announced records.
    BadRecords,
}

impl AckStatus {
    /// The wire byte of this status (see the module docs).
    pub fn to_u8(self) -> u8 {
        match self {
            Self::Stored => 0x00,
            Self::Duplicate => 0x01,
            Self::Retry(r) => {
                0x10 | match r {
                    RetryReason::SinkUnavailable => 0,
                    RetryReason::Overloaded => 1,
                    RetryReason::ShuttingDown => 2,
                    RetryReason::Limit => 3,
                }
            }
            Self::Rejected(r) => {
                0x20 | match r {
                    RejectReason::BadChecksum => 0,
                    RejectReason::TooLarge => 1,
                    RejectReason::Malformed => 2,
                    RejectReason::BadRecords => 3,
                }
            }
        }
    }

    /// Parses a wire byte; `None` if unknown.
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            0x00 => Self::Stored,
            0x01 => Self::Duplicate,
            0x10 => Self::Retry(RetryReason::SinkUnavailable),
            0x11 => Self::Retry(RetryReason::Overloaded),
            0x12 => Self::Retry(RetryReason::ShuttingDown),
            0x13 => Self::Retry(RetryReason::Limit),
            0x20 => Self::Rejected(RejectReason::BadChecksum),
            0x21 => Self::Rejected(RejectReason::TooLarge),
            0x22 => Self::Rejected(RejectReason::Malformed),
            0x23 => Self::Rejected(RejectReason::BadRecords),
            _ => return None,
        })
    }

    /// Whether the chunk is durable on the server, so the agent may delete it.
    pub fn is_durable(self) -> bool {
        matches!(self, Self::Stored | Self::Duplicate)
    }
}

/// A frame on the control stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ControlFrame {
    /// Agent → server, first frame.
    Hello {
        /// The protocol version the agent speaks.
        version: u16,
        /// The agent's spool identity, stable across restarts.
        spool_id: [u8; 16],
        /// Free-form agent description, at most [`MAX_AGENT_LEN`] bytes, e.g.
        /// `"edge-uploader/0.1.0 host"`.
        agent: String,
    },
    /// Server → agent, answer to Hello.
    Welcome {
        /// The protocol version the server speaks; equals the Hello's.
        version: u16,
        /// The device identity the server derived from the client certificate.
        device: String,
        /// Largest chunk payload the server accepts.
        max_chunk_payload: u32,
        /// Most chunks the agent may have in flight (sent, not yet acked) at once.
        max_in_flight: u32,
    },
    /// Server → agent, the outcome of one chunk.
    Ack {
        /// The chunk's stream.
        stream: StreamName,
        /// The chunk's sequence number within its stream.
        seq: u64,
        /// What the server did with it.
        status: AckStatus,
    },
    /// Server → agent: open no new chunk streams, wait for the acks in flight, reconnect.
    GoAway {
        /// Why the server is going away.
        code: ErrorCode,
    },
    /// Agent → server, version 2 on: no chunk of `stream` from this spool with a seq below
    /// `seq` will be sent as new data any more. Each one is stored, or was dropped or
    /// quarantined by the agent, so the server may count them all as stored (a later copy of
    /// one is a duplicate) and close the gaps they leave in its dedup index.
    Floor {
        /// The stream.
        stream: StreamName,
        /// The lowest seq of `stream` the agent may still send as new data.
        seq: u64,
    },
}

impl ControlFrame {
    /// A short name for logs and errors.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Hello { .. } => "Hello",
            Self::Welcome { .. } => "Welcome",
            Self::Ack { .. } => "Ack",
            Self::GoAway { .. } => "GoAway",
            Self::Floor { .. } => "Floor",
        }
    }

    /// Appends the encoded frame (header and body) to `out`.
    ///
    /// Strings over their limit are cut (see the module docs); nothing else can fail.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        let ty = match self {
            Self::Hello { .. } => TYPE_HELLO,
            Self::Welcome { .. } => TYPE_WELCOME,
            Self::Ack { .. } => TYPE_ACK,
            Self::GoAway { .. } => TYPE_GO_AWAY,
            Self::Floor { .. } => TYPE_FLOOR,
        };
        out.push(ty);
        put_u32(out, 0); // Patched below, once the body length is known.
        match self {
            Self::Hello { version, spool_id, agent } => {
                put_u16(out, *version);
                out.extend_from_slice(spool_id);
                put_short_str(out, agent, MAX_AGENT_LEN);
            }
            Self::Welcome { version, device, max_chunk_payload, max_in_flight } => {
                put_u16(out, *version);
                put_u32(out, *max_chunk_payload);
                put_u32(out, *max_in_flight);
                put_short_str(out, device, MAX_DEVICE_LEN);
            }
            Self::Ack { stream, seq, status } => {
                put_short_str(out, stream.as_str(), MAX_STREAM_NAME_LEN);
                put_u64(out, *seq);
                out.push(status.to_u8());
            }
            Self::GoAway { code } => put_u32(out, code.to_u32()),
            Self::Floor { stream, seq } => {
                put_short_str(out, stream.as_str(), MAX_STREAM_NAME_LEN);
                put_u64(out, *seq);
            }
        }
        // Every body is at most a few hundred bytes (bounded string fields), far below u32::MAX.
        let body_len = u32::try_from(out.len() - start - FRAME_HEADER_LEN).unwrap_or(u32::MAX);
        out[start + 1..start + FRAME_HEADER_LEN].copy_from_slice(&body_len.to_le_bytes());
    }

    /// Decodes one frame from the start of a contiguous buffer.
    ///
    /// `Ok(None)` means more bytes are needed; otherwise returns the frame and the bytes it used.
    /// A declared body length over `limits.max_control_frame` is refused from the header alone.
    pub fn decode(buf: &[u8], limits: &Limits) -> Result<Option<(Self, usize)>, ProtoError> {
        let Some(head) = buf.first_chunk::<FRAME_HEADER_LEN>() else {
            if let Some(&ty) = buf.first() {
                check_type(ty)?;
            }
            return Ok(None);
        };
        let (ty, len) = parse_header(head, limits.max_control_frame)?;
        let Some(body) = buf[FRAME_HEADER_LEN..].get(..len) else {
            return Ok(None);
        };
        Ok(Some((decode_body(ty, body)?, FRAME_HEADER_LEN + len)))
    }
}

fn check_type(ty: u8) -> Result<(), ProtoError> {
    match ty {
        TYPE_HELLO | TYPE_WELCOME | TYPE_ACK | TYPE_GO_AWAY | TYPE_FLOOR => Ok(()),
        other => Err(ProtoError::UnknownFrameType(other)),
    }
}

/// Checks a frame header; returns the type and the body length.
fn parse_header(head: &[u8; FRAME_HEADER_LEN], max: u32) -> Result<(u8, usize), ProtoError> {
    let ty = head[0];
    check_type(ty)?;
    let len = u32::from_le_bytes([head[1], head[2], head[3], head[4]]);
    if len > max {
        return Err(ProtoError::FrameTooLarge { len: u64::from(len), max: u64::from(max) });
    }
    // `len <= max: u32`, and usize is at least 32 bits on every target we build for.
    Ok((ty, len as usize))
}

fn decode_body(ty: u8, body: &[u8]) -> Result<ControlFrame, ProtoError> {
    let mut r = Reader::new(body);
    let frame = match ty {
        TYPE_HELLO => {
            let version = r.u16("version")?;
            match decode_hello_rest(r, version) {
                Ok(frame) => frame,
                Err(_) if !(MIN_VERSION..=VERSION).contains(&version) => {
                    return Err(ProtoError::UnsupportedVersion { version });
                }
                Err(e) => return Err(e),
            }
        }
        TYPE_WELCOME => {
            let version = r.u16("version")?;
            let max_chunk_payload = r.u32("max_chunk_payload")?;
            let max_in_flight = r.u32("max_in_flight")?;
            let device = r.short_str("device", MAX_DEVICE_LEN)?.to_owned();
            r.finish("Welcome")?;
            ControlFrame::Welcome { version, device, max_chunk_payload, max_in_flight }
        }
        TYPE_ACK => {
            let stream = StreamName::from_bytes(r.short_bytes("stream", MAX_STREAM_NAME_LEN)?)?;
            let seq = r.u64("seq")?;
            let raw = r.u8("status")?;
            let status = AckStatus::from_u8(raw).ok_or(ProtoError::UnknownAckStatus(raw))?;
            r.finish("Ack")?;
            ControlFrame::Ack { stream, seq, status }
        }
        TYPE_GO_AWAY => {
            let raw = r.u32("code")?;
            let code = ErrorCode::from_u32(raw).ok_or(ProtoError::UnknownErrorCode(raw))?;
            r.finish("GoAway")?;
            ControlFrame::GoAway { code }
        }
        TYPE_FLOOR => {
            let stream = StreamName::from_bytes(r.short_bytes("stream", MAX_STREAM_NAME_LEN)?)?;
            let seq = r.u64("seq")?;
            r.finish("Floor")?;
            ControlFrame::Floor { stream, seq }
        }
        other => return Err(ProtoError::UnknownFrameType(other)),
    };
    Ok(frame)
}

fn decode_hello_rest(mut r: Reader<'_>, version: u16) -> Result<ControlFrame, ProtoError> {
    let spool_id = r.array::<16>("spool_id")?;
    let agent = r.short_str("agent", MAX_AGENT_LEN)?.to_owned();
    r.finish("Hello")?;
    Ok(ControlFrame::Hello { version, spool_id, agent })
}

/// Turns control-stream bytes, fed in pieces of any size, into frames.
///
/// Frames are decoded as soon as their last byte is pushed, so the only raw bytes held are those
/// of the one incomplete frame: [`buffered_len`](Self::buffered_len) never exceeds
/// `FRAME_HEADER_LEN + limits.max_control_frame`, and a declared length over the limit is refused
/// from the 5-byte header, before any of the body is buffered.
///
/// The first error is sticky: once [`next_frame`](Self::next_frame) has handed out the frames
/// that preceded the bad one, it returns that error forever, and later input is discarded.
#[derive(Debug)]
pub struct FrameDecoder {
    max_frame: u32,
    /// Header bytes of the next frame, while fewer than `FRAME_HEADER_LEN` have arrived.
    head: [u8; FRAME_HEADER_LEN],
    head_filled: usize,
    /// Type and declared body length of the frame being read, once its header is complete.
    current: Option<(u8, usize)>,
    /// Body bytes of the current frame received so far; grows only as bytes arrive.
    body: Vec<u8>,
    /// Decoded frames not yet returned by `next_frame`.
    ready: VecDeque<ControlFrame>,
    /// The error that stopped decoding, returned after `ready` drains.
    failed: Option<ProtoError>,
}

impl FrameDecoder {
    /// A decoder enforcing `limits.max_control_frame`.
    pub fn new(limits: &Limits) -> Self {
        Self {
            max_frame: limits.max_control_frame,
            head: [0; FRAME_HEADER_LEN],
            head_filled: 0,
            current: None,
            body: Vec::new(),
            ready: VecDeque::new(),
            failed: None,
        }
    }

    /// Feeds bytes read from the control stream, in order. Never fails: errors surface from
    /// [`next_frame`](Self::next_frame) after the frames before them.
    pub fn push(&mut self, mut bytes: &[u8]) {
        while self.failed.is_none() {
            match self.current {
                None => {
                    if bytes.is_empty() {
                        return;
                    }
                    if self.head_filled == 0 {
                        // Fail on an unknown type at once, not after four more bytes.
                        if let Err(e) = check_type(bytes[0]) {
                            self.fail(e);
                            return;
                        }
                    }
                    let take = (FRAME_HEADER_LEN - self.head_filled).min(bytes.len());
                    self.head[self.head_filled..self.head_filled + take].copy_from_slice(&bytes[..take]);
                    self.head_filled += take;
                    bytes = &bytes[take..];
                    if self.head_filled < FRAME_HEADER_LEN {
                        return;
                    }
                    self.head_filled = 0;
                    match parse_header(&self.head, self.max_frame) {
                        Ok(ty_len) => self.current = Some(ty_len),
                        Err(e) => self.fail(e),
                    }
                }
                Some((ty, len)) => {
                    let take = (len - self.body.len()).min(bytes.len());
                    self.body.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    if self.body.len() < len {
                        return;
                    }
                    self.current = None;
                    match decode_body(ty, &self.body) {
                        Ok(frame) => self.ready.push_back(frame),
                        Err(e) => self.fail(e),
                    }
                    self.body.clear();
                }
            }
        }
    }

    /// The next decoded frame: `Ok(None)` if more bytes are needed, `Err` once the input was bad.
    pub fn next_frame(&mut self) -> Result<Option<ControlFrame>, ProtoError> {
        if let Some(frame) = self.ready.pop_front() {
            return Ok(Some(frame));
        }
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(None),
        }
    }

    /// Raw bytes held for the incomplete frame; at most `FRAME_HEADER_LEN + max_control_frame`.
    pub fn buffered_len(&self) -> usize {
        self.head_filled + self.body.len()
    }

    /// Decoded frames waiting for [`next_frame`](Self::next_frame).
    pub fn pending_frames(&self) -> usize {
        self.ready.len()
    }

    /// Whether the decoder stopped on an error.
    pub fn is_failed(&self) -> bool {
        self.failed.is_some()
    }

    fn fail(&mut self, e: ProtoError) {
        self.failed = Some(e);
        self.current = None;
        self.head_filled = 0;
        self.body = Vec::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> StreamName {
        StreamName::new(s).expect("test names are valid")
    }

    fn samples() -> Vec<ControlFrame> {
        vec![
            ControlFrame::Hello { version: VERSION, spool_id: [7; 16], agent: "edge-uploader/0.1.0 host".into() },
            ControlFrame::Hello { version: 9, spool_id: [0; 16], agent: String::new() },
            ControlFrame::Welcome {
                version: VERSION,
                device: "dev-1".into(),
                max_chunk_payload: 1 << 25,
                max_in_flight: 64,
            },
            ControlFrame::Ack { stream: name("temp"), seq: 42, status: AckStatus::Stored },
            ControlFrame::Ack { stream: name("t.x-y_z"), seq: u64::MAX, status: AckStatus::Duplicate },
            ControlFrame::Ack { stream: name("a"), seq: 0, status: AckStatus::Retry(RetryReason::Overloaded) },
            ControlFrame::Ack { stream: name("b"), seq: 1, status: AckStatus::Rejected(RejectReason::BadRecords) },
            ControlFrame::GoAway { code: ErrorCode::ShuttingDown },
            ControlFrame::Floor { stream: name("temp"), seq: 17 },
            ControlFrame::Floor { stream: name("z"), seq: u64::MAX },
        ]
    }

    fn encode_all(frames: &[ControlFrame]) -> Vec<u8> {
        let mut out = Vec::new();
        for f in frames {
            f.encode(&mut out);
        }
        out
    }

    fn drain(dec: &mut FrameDecoder) -> Vec<ControlFrame> {
        let mut out = Vec::new();
        while let Some(f) = dec.next_frame().expect("valid input") {
            out.push(f);
        }
        out
    }

    #[test]
    fn every_frame_round_trips() {
        let limits = Limits::default();
        for frame in samples() {
            let mut buf = Vec::new();
            frame.encode(&mut buf);
            let (back, used) = ControlFrame::decode(&buf, &limits).expect("valid").expect("complete");
            assert_eq!(back, frame);
            assert_eq!(used, buf.len());
        }
    }

    #[test]
    fn hello_has_the_documented_layout() {
        let frame = ControlFrame::Hello { version: 1, spool_id: [0xaa; 16], agent: "ab".into() };
        let mut buf = Vec::new();
        frame.encode(&mut buf);
        let mut expected = vec![0x01, 21, 0, 0, 0, 1, 0];
        expected.extend_from_slice(&[0xaa; 16]);
        expected.extend_from_slice(&[2, b'a', b'b']);
        assert_eq!(buf, expected);
    }

    #[test]
    fn ack_and_go_away_have_the_documented_layout() {
        let mut buf = Vec::new();
        ControlFrame::Ack { stream: name("s"), seq: 0x0102, status: AckStatus::Retry(RetryReason::ShuttingDown) }
            .encode(&mut buf);
        assert_eq!(buf, [0x03, 11, 0, 0, 0, 1, b's', 2, 1, 0, 0, 0, 0, 0, 0, 0x12]);
        buf.clear();
        ControlFrame::GoAway { code: ErrorCode::Revoked }.encode(&mut buf);
        assert_eq!(buf, [0x04, 4, 0, 0, 0, 8, 0, 0, 0]);
    }

    #[test]
    fn a_stream_fed_one_byte_at_a_time_gives_the_same_frames() {
        let frames = samples();
        let bytes = encode_all(&frames);
        let mut dec = FrameDecoder::new(&Limits::default());
        let mut got = Vec::new();
        for b in &bytes {
            dec.push(std::slice::from_ref(b));
            got.extend(drain(&mut dec));
        }
        assert_eq!(got, frames);
        assert_eq!(dec.buffered_len(), 0);
    }

    #[test]
    fn a_stream_fed_all_at_once_gives_the_same_frames() {
        let frames = samples();
        let mut dec = FrameDecoder::new(&Limits::default());
        dec.push(&encode_all(&frames));
        assert_eq!(dec.pending_frames(), frames.len());
        assert_eq!(drain(&mut dec), frames);
    }

    #[test]
    fn an_oversized_declared_length_is_refused_from_the_header() {
        let limits = Limits::default();
        let mut dec = FrameDecoder::new(&limits);
        let mut bytes = vec![TYPE_HELLO];
        bytes.extend_from_slice(&u32::MAX.to_le_bytes());
        bytes.extend_from_slice(&[0; 1000]);
        dec.push(&bytes);
        let err = dec.next_frame().expect_err("too large");
        assert_eq!(err, ProtoError::FrameTooLarge { len: u64::from(u32::MAX), max: 16 * 1024 });
        assert_eq!(err.code(), ErrorCode::FrameTooLarge);
        assert_eq!(dec.buffered_len(), 0);
        // Sticky, and later input is ignored.
        dec.push(&encode_all(&samples()));
        assert_eq!(dec.next_frame(), Err(err));
        assert_eq!(
            ControlFrame::decode(&bytes[..5], &limits).map(|_| ()),
            Err(ProtoError::FrameTooLarge { len: u64::from(u32::MAX), max: 16 * 1024 })
        );
    }

    #[test]
    fn frames_before_a_bad_one_are_still_delivered() {
        let good = samples();
        let mut bytes = encode_all(&good[..2]);
        bytes.push(0x7f);
        let mut dec = FrameDecoder::new(&Limits::default());
        dec.push(&bytes);
        assert_eq!(dec.next_frame(), Ok(Some(good[0].clone())));
        assert_eq!(dec.next_frame(), Ok(Some(good[1].clone())));
        assert_eq!(dec.next_frame(), Err(ProtoError::UnknownFrameType(0x7f)));
    }

    #[test]
    fn malformed_bodies_are_errors_with_codes() {
        let limits = Limits::default();
        let cases: Vec<(Vec<u8>, ProtoError)> = vec![
            (vec![0x00, 0, 0, 0, 0], ProtoError::UnknownFrameType(0)),
            (vec![0x04, 3, 0, 0, 0, 6, 0, 0], ProtoError::Truncated { field: "code" }),
            (vec![0x04, 4, 0, 0, 0, 99, 0, 0, 0], ProtoError::UnknownErrorCode(99)),
            (vec![0x04, 5, 0, 0, 0, 6, 0, 0, 0, 0], ProtoError::TrailingBytes { frame: "GoAway", extra: 1 }),
            (
                vec![0x03, 11, 0, 0, 0, 1, b'/', 0, 0, 0, 0, 0, 0, 0, 0, 0],
                ProtoError::InvalidStreamName(crate::NameError::InvalidByte { byte: b'/', offset: 0 }),
            ),
            (vec![0x03, 11, 0, 0, 0, 1, b's', 0, 0, 0, 0, 0, 0, 0, 0, 0x33], ProtoError::UnknownAckStatus(0x33)),
            (vec![0x03, 1, 0, 0, 0, 65], ProtoError::StringTooLong { field: "stream", len: 65, max: 64 }),
            (
                vec![0x02, 13, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0xff, 0xfe],
                ProtoError::InvalidUtf8 { field: "device" },
            ),
        ];
        for (bytes, expected) in cases {
            let got = ControlFrame::decode(&bytes, &limits).map(|_| ());
            assert_eq!(got, Err(expected.clone()), "{bytes:x?}");
            assert_eq!(expected.code(), ErrorCode::ProtocolViolation);
            let mut dec = FrameDecoder::new(&limits);
            dec.push(&bytes);
            assert_eq!(dec.next_frame(), Err(expected));
        }
    }

    #[test]
    fn a_future_hello_layout_reads_as_unsupported_version() {
        // The version after ours with a body this version cannot parse.
        let next = VERSION + 1;
        let bytes = [0x01, 3, 0, 0, 0, next.to_le_bytes()[0], next.to_le_bytes()[1], 0xee];
        let err = ControlFrame::decode(&bytes, &Limits::default()).expect_err("unsupported");
        assert_eq!(err, ProtoError::UnsupportedVersion { version: next });
        assert_eq!(err.code(), ErrorCode::UnsupportedVersion);
        // The same body with a version we speak is simply malformed.
        for version in MIN_VERSION..=VERSION {
            let bytes = [0x01, 3, 0, 0, 0, version.to_le_bytes()[0], 0, 0xee];
            let err = ControlFrame::decode(&bytes, &Limits::default()).expect_err("malformed");
            assert_eq!(err.code(), ErrorCode::ProtocolViolation, "version {version}");
        }
    }

    #[test]
    fn strings_over_their_limit_are_cut_when_encoded() {
        let frame = ControlFrame::Hello { version: 1, spool_id: [0; 16], agent: "ü".repeat(100) };
        let mut buf = Vec::new();
        frame.encode(&mut buf);
        let (back, _) = ControlFrame::decode(&buf, &Limits::default()).expect("valid").expect("complete");
        let ControlFrame::Hello { agent, .. } = back else { panic!("not a Hello: {back:?}") };
        assert_eq!(agent, "ü".repeat(64));
    }

    #[test]
    fn every_ack_status_round_trips_through_its_byte() {
        for v in 0..=u8::MAX {
            if let Some(s) = AckStatus::from_u8(v) {
                assert_eq!(s.to_u8(), v);
            }
        }
        assert!(AckStatus::Stored.is_durable() && AckStatus::Duplicate.is_durable());
        assert!(!AckStatus::Retry(RetryReason::Overloaded).is_durable());
        assert_eq!(AckStatus::from_u8(0x13), Some(AckStatus::Retry(RetryReason::Limit)));
    }
}
