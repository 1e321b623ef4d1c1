//! The `edge/1` protocol between an edge agent and the ingest server.
//!
//! This crate is the protocol's single source of truth: wire encodings, limits, and the two
//! sans-IO session state machines. It does no I/O and never reads a clock: bytes come in through
//! `handle_*` methods, bytes and events go out through `poll_*` methods, and time is always an
//! argument (`now: Instant`). The drivers in `edge-transport`, `edge-uploader` and `edge-ingest`
//! pump these machines over quinn streams; the tests pump them over an in-memory pair.
//!
//! # Connection shape
//!
//! A connection is QUIC with ALPN [`ALPN`] and mutual TLS. The agent (client) opens one
//! bidirectional *control stream* and sends [`ControlFrame::Hello`]; the server answers
//! [`ControlFrame::Welcome`]. The agent sends each chunk on its own unidirectional
//! stream, a [`ChunkHeader`] followed by the payload, many in parallel, so chunks arrive in any
//! order. It sends them after the Welcome, or, within the limits of an earlier Welcome from the
//! same server, right behind its Hello ([`ClientSession::resume`](client::ClientSession::resume)):
//! QUIC does not order streams against each other, so the server holds chunk streams that arrive
//! before the Hello (at most its `max_in_flight`, within the handshake deadline) and reads them
//! once the Hello is in. The session machines still see every chunk after the Hello. The server answers each chunk with one [`ControlFrame::Ack`] on the control stream, only
//! once the chunk is durable (or with a retry or reject status). A server that stops reading an
//! accepted chunk's stream does so with code [`STOP_ANSWERED`] and still sends its Ack; any other
//! stop code means the chunk was not accepted. [`ControlFrame::GoAway`] tells the
//! agent to open no new chunk streams, wait for the acks of those in flight, and reconnect.
//!
//! # Versions
//!
//! The agent names its version in the Hello; the server answers a version it speaks
//! ([`MIN_VERSION`]`..=`[`VERSION`]) with a Welcome of the same version, and closes the connection
//! with [`ErrorCode::UnsupportedVersion`] otherwise, so that an agent newer than its server can
//! connect again with an older version. Version 2 adds [`ControlFrame::Floor`]: the agent tells
//! the server that no seq of a stream below a mark will come as new data any more (chunks it
//! dropped or quarantined), so the server's dedup index can close those gaps.
//!
//! # Byte layouts
//!
//! All integers are little-endian. Strings are UTF-8, prefixed by a `u8` byte length, and have a
//! per-field limit ([`MAX_AGENT_LEN`], [`MAX_DEVICE_LEN`], [`MAX_STREAM_NAME_LEN`]).
//!
//! Control frames (module [`frame`]): `type: u8 | body_len: u32 | body`.
//!
//! | type | frame   | body |
//! |------|---------|------|
//! | 0x01 | Hello   | `version: u16, spool_id: [u8; 16], agent_len: u8, agent` |
//! | 0x02 | Welcome | `version: u16, max_chunk_payload: u32, max_in_flight: u32, device_len: u8, device` |
//! | 0x03 | Ack     | `stream_len: u8, stream, seq: u64, status: u8` |
//! | 0x04 | GoAway  | `code: u32` |
//! | 0x05 | Floor   | `stream_len: u8, stream, seq: u64` (version 2 on, agent → server) |
//!
//! Chunk stream prefix (module [`chunk`]): `magic: b"EDGC" | header_len: u16 | header`, where the
//! header is `stream_len: u8, stream, seq: u64, records: u32, raw_len: u32, payload_len: u32,
//! codec: u8, checksum: u32, created_ms: u64`; `payload_len` payload bytes follow. The payload
//! itself is record framing (module [`records`]), possibly zstd-compressed.
//!
//! Every length field is checked against [`Limits`] before anything of that length is buffered or
//! allocated; malformed input becomes a [`ProtoError`] carrying an [`ErrorCode`], never a panic.
//!
//! # Modules
//!
//! - [`frame`]: control frames, ack statuses, and the incremental [`FrameDecoder`].
//! - [`chunk`]: the chunk header on each uni-stream.
//! - [`name`]: validated [`StreamName`]s.
//! - [`error`]: [`ErrorCode`] (the QUIC close code) and [`ProtoError`].
//! - [`client`] / [`server`]: the session state machines of the agent and the ingest server.
//! - [`records`]: record framing inside a chunk payload.

use std::time::Duration;

pub mod checksum;
pub mod chunk;
pub mod client;
pub mod error;
pub mod frame;
pub mod intake;
pub mod name;
pub mod records;
pub mod server;
mod wire;

pub use checksum::{crc32c, crc32c_append};
pub use chunk::{CHUNK_MAGIC, CHUNK_PREFIX_LEN, ChunkHeader, STOP_ANSWERED};
pub use error::{ErrorCode, ProtoError};
pub use frame::{
    AckStatus, ControlFrame, FRAME_HEADER_LEN, FrameDecoder, MAX_AGENT_LEN, MAX_DEVICE_LEN, RejectReason, RetryReason,
};
pub use name::{MAX_STREAM_NAME_LEN, NameError, StreamName};

/// The ALPN protocol identifier negotiated in the TLS handshake.
pub const ALPN: &[u8] = b"edge/1";

/// The newest protocol version, the one the agent sends in its `Hello` first.
pub const VERSION: u16 = 3;

/// The oldest protocol version the server still speaks (the agent steps down to it one version
/// per refusal from an older server): version 1 has no [`ControlFrame::Floor`].
pub const MIN_VERSION: u16 = 1;

/// The first version with [`ControlFrame::Floor`].
pub const FLOOR_VERSION: u16 = 2;

/// The first version whose agents are answered [`RetryReason::Limit`].
pub const LIMIT_VERSION: u16 = 3;

/// The reason text of the close (code [`ErrorCode::NoError`]) with which the server ends an
/// agent's connection when a newer one of the same device and spool id says Hello. An agent
/// holds one connection at a time and drops it before it opens the next, so an agent that
/// reads this on its live connection knows that another agent uses its certificate and spool
/// id (a cloned gateway).
pub const SUPERSEDED_REASON: &[u8] = b"superseded by a newer connection of the same agent";

/// Compression of a chunk payload on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Codec {
    /// Payload is the raw record framing.
    None = 0,
    /// Payload is the raw record framing compressed with zstd.
    Zstd = 1,
}

impl Codec {
    /// The wire value of this codec.
    pub fn to_u8(self) -> u8 {
        self as u8
    }

    /// Parses a wire value; `None` for an unknown codec.
    pub fn from_u8(v: u8) -> Option<Self> {
        match v {
            0 => Some(Self::None),
            1 => Some(Self::Zstd),
            _ => None,
        }
    }
}

/// The agent's default `intake.max_record_bytes`: the largest record a producer may send unless
/// the operator changes it. The ingest's JetStream sink checks its NATS server's `max_payload`
/// against it at start (one record must fit in one message).
pub const DEFAULT_MAX_RECORD_BYTES: u32 = 1 << 20;

/// Limits a peer enforces on what it receives, and the handshake deadline.
///
/// Both sessions and both decoders take these; a declared length over a limit is refused before
/// anything of that length is read or allocated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    /// Largest control frame body, in bytes. Default 16 KiB.
    pub max_control_frame: u32,
    /// Largest chunk header body (after the magic and length prefix), in bytes. Default 1 KiB.
    pub max_chunk_header: u32,
    /// Largest chunk payload on the wire, in bytes. Default 32 MiB.
    pub max_chunk_payload: u32,
    /// Largest raw (decompressed) chunk payload, in bytes. Default 64 MiB.
    pub max_raw_len: u32,
    /// Most records in one chunk. Default 2^20.
    pub max_records_per_chunk: u32,
    /// Time from session creation to a completed Hello/Welcome exchange. Default 10 s.
    pub handshake_timeout: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_control_frame: 16 * 1024,
            max_chunk_header: 1024,
            max_chunk_payload: 32 * 1024 * 1024,
            max_raw_len: 64 * 1024 * 1024,
            max_records_per_chunk: 1 << 20,
            handshake_timeout: Duration::from_secs(10),
        }
    }
}
