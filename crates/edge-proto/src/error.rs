//! Error codes on the wire and the crate's error type.
//!
//! [`ErrorCode`] is the `u32` application error code of a QUIC connection close (and of a
//! `GoAway` frame, encoded as `code: u32` little-endian). [`ProtoError`] is what every decoder and
//! session method returns; [`ProtoError::code`] says which close code the driver should use.
//!
//! Errors fall in three groups, and the variant docs say which:
//! - *peer errors*: the peer sent something invalid; the session is closed and the driver closes
//!   the connection with [`ProtoError::code`];
//! - *chunk errors*: one chunk's bytes are bad ([`ProtoError::reject_reason`] is `Some`); the
//!   server may answer with an `Ack` of status `Rejected` instead of closing;
//! - *local errors*: the caller misused the API (code [`ErrorCode::Internal`]); the session is left
//!   as it was.

use std::fmt;

use crate::frame::RejectReason;
use crate::name::{NameError, StreamName};

/// Application error code carried by a QUIC connection close or a `GoAway` frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorCode {
    /// Orderly close.
    NoError = 0,
    /// The peer broke the protocol: malformed or unexpected frame, unknown chunk, …
    ProtocolViolation = 1,
    /// A declared length exceeds a limit.
    FrameTooLarge = 2,
    /// The agent speaks a protocol version the server does not.
    UnsupportedVersion = 3,
    /// The peer's identity is not allowed.
    Unauthorized = 4,
    /// A bug or local failure on the closing side.
    Internal = 5,
    /// The closing side is shutting down.
    ShuttingDown = 6,
    /// The Hello/Welcome exchange did not finish in time.
    HandshakeTimeout = 7,
    /// The peer's certificate or device was revoked.
    Revoked = 8,
}

impl ErrorCode {
    /// The wire value of this code.
    pub fn to_u32(self) -> u32 {
        self as u32
    }

    /// Parses a wire value; `None` for an unknown code.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::NoError,
            1 => Self::ProtocolViolation,
            2 => Self::FrameTooLarge,
            3 => Self::UnsupportedVersion,
            4 => Self::Unauthorized,
            5 => Self::Internal,
            6 => Self::ShuttingDown,
            7 => Self::HandshakeTimeout,
            8 => Self::Revoked,
            _ => return None,
        })
    }

    /// A short snake_case name, as shown by `Display`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NoError => "no_error",
            Self::ProtocolViolation => "protocol_violation",
            Self::FrameTooLarge => "frame_too_large",
            Self::UnsupportedVersion => "unsupported_version",
            Self::Unauthorized => "unauthorized",
            Self::Internal => "internal",
            Self::ShuttingDown => "shutting_down",
            Self::HandshakeTimeout => "handshake_timeout",
            Self::Revoked => "revoked",
        }
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<ErrorCode> for u32 {
    fn from(code: ErrorCode) -> Self {
        code.to_u32()
    }
}

/// Everything that can go wrong in decoding or in a session.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProtoError {
    // --- Limits (peer errors, code `FrameTooLarge`) ---
    /// A control frame or chunk header declares a length over its limit. Nothing of that length
    /// was buffered.
    #[error("declared length {len} exceeds the limit of {max} bytes")]
    FrameTooLarge { len: u64, max: u64 },
    /// A chunk header declares a payload over `Limits::max_chunk_payload` (chunk error).
    #[error("chunk payload of {len} bytes exceeds the limit of {max}")]
    PayloadTooLarge { len: u32, max: u32 },
    /// A chunk header declares a raw length over `Limits::max_raw_len` (chunk error).
    #[error("chunk raw length of {len} bytes exceeds the limit of {max}")]
    RawTooLarge { len: u32, max: u32 },
    /// A chunk header declares more records than `Limits::max_records_per_chunk` (chunk error).
    #[error("chunk of {records} records exceeds the limit of {max}")]
    TooManyRecords { records: u32, max: u32 },

    // --- Malformed input (peer errors, code `ProtocolViolation`) ---
    /// A chunk stream does not start with the magic `EDGC`.
    #[error("chunk stream does not start with the magic EDGC")]
    BadMagic,
    /// A control frame has an unknown type byte.
    #[error("unknown control frame type {0:#04x}")]
    UnknownFrameType(u8),
    /// A chunk header names an unknown codec.
    #[error("unknown codec {0}")]
    UnknownCodec(u8),
    /// An `Ack` frame carries an unknown status byte.
    #[error("unknown ack status {0:#04x}")]
    UnknownAckStatus(u8),
    /// A `GoAway` frame carries an unknown error code.
    #[error("unknown error code {0}")]
    UnknownErrorCode(u32),
    /// A frame or header body ends inside `field`.
    #[error("body truncated inside field `{field}`")]
    Truncated { field: &'static str },
    /// A frame or header body has bytes after its last field.
    #[error("{extra} unexpected bytes after the end of {frame}")]
    TrailingBytes { frame: &'static str, extra: usize },
    /// A string field is not UTF-8.
    #[error("field `{field}` is not valid UTF-8")]
    InvalidUtf8 { field: &'static str },
    /// A string field is longer than its limit.
    #[error("field `{field}` is {len} bytes, the limit is {max}")]
    StringTooLong { field: &'static str, len: usize, max: usize },
    /// A stream name on the wire is not a valid [`StreamName`].
    #[error("invalid stream name: {0}")]
    InvalidStreamName(#[from] NameError),
    /// A chunk header with codec `None` declares different raw and payload lengths (chunk error).
    #[error("uncompressed chunk declares raw_len {raw_len} but payload_len {payload_len}")]
    RawLenMismatch { raw_len: u32, payload_len: u32 },
    /// A chunk header declares more records than its raw length can frame (chunk error).
    #[error("{records} records cannot fit in {raw_len} raw bytes")]
    RecordsExceedRawLen { records: u32, raw_len: u32 },
    /// A payload is not the length its header declared (chunk error).
    #[error("payload is {found} bytes, header declared {expected}")]
    PayloadLength { expected: u32, found: usize },
    /// A payload's crc32c differs from its header's checksum (chunk error).
    #[error("payload checksum {computed:#010x} differs from header checksum {expected:#010x}")]
    ChecksumMismatch { expected: u32, computed: u32 },

    // --- Session rules (peer errors) ---
    /// The agent's Hello carries a version the server does not speak (code `UnsupportedVersion`).
    #[error("unsupported protocol version {version}, this side speaks {} to {}", crate::MIN_VERSION, crate::VERSION)]
    UnsupportedVersion { version: u16 },
    /// The server's Welcome carries a version other than ours (code `ProtocolViolation`).
    #[error("server welcomed us with version {version}, we sent {sent}")]
    WelcomeVersionMismatch { version: u16, sent: u16 },
    /// A Welcome advertises a zero limit (code `ProtocolViolation`).
    #[error("invalid Welcome: {reason}")]
    InvalidWelcome { reason: &'static str },
    /// A frame the protocol does not allow in the current state (code `ProtocolViolation`).
    #[error("unexpected {frame} frame {reason}")]
    UnexpectedFrame { frame: &'static str, reason: &'static str },
    /// The server acked a chunk that is not in flight (code `ProtocolViolation`).
    #[error("ack for chunk {stream}/{seq}, which is not in flight")]
    UnknownChunk { stream: StreamName, seq: u64 },
    /// A chunk stream arrived before the agent's Hello (code `ProtocolViolation`).
    #[error("chunk {stream}/{seq} arrived before Hello")]
    ChunkBeforeHello { stream: StreamName, seq: u64 },
    /// The agent sent a chunk that is already in flight on this connection (code
    /// `ProtocolViolation`).
    #[error("chunk {stream}/{seq} is already in flight on this connection")]
    DuplicateChunk { stream: StreamName, seq: u64 },
    /// The agent has more chunks in flight than the Welcome allowed (code `ProtocolViolation`).
    #[error("more than {max} chunks in flight")]
    TooManyInFlight { max: u32 },
    /// The handshake did not complete before `Limits::handshake_timeout` (code
    /// `HandshakeTimeout`).
    #[error("handshake timed out")]
    HandshakeTimeout,
    /// The session was already closed by an earlier error with this code; it accepts no input.
    #[error("session already closed ({code})")]
    Closed { code: ErrorCode },

    // --- Local API misuse (code `Internal`, session unchanged) ---
    /// `chunk_sent` before the Welcome.
    #[error("session is not connected")]
    NotConnected,
    /// `chunk_sent` after the server's GoAway.
    #[error("server asked us to go away ({code}); no new chunks")]
    Draining { code: ErrorCode },
    /// `chunk_sent` with the window of `max_in_flight` chunks already full.
    #[error("{max} chunks already in flight")]
    WindowFull { max: u32 },
    /// `chunk_sent` for a chunk that is already in flight.
    #[error("chunk {stream}/{seq} is already in flight")]
    AlreadyInFlight { stream: StreamName, seq: u64 },
    /// `ack` for a chunk that was not accepted or was already acked.
    #[error("chunk {stream}/{seq} was not accepted or was already acked")]
    NotAccepted { stream: StreamName, seq: u64 },
}

impl ProtoError {
    /// The code to close the connection with (or, for local errors, `Internal`).
    pub fn code(&self) -> ErrorCode {
        match self {
            Self::FrameTooLarge { .. }
            | Self::PayloadTooLarge { .. }
            | Self::RawTooLarge { .. }
            | Self::TooManyRecords { .. } => ErrorCode::FrameTooLarge,
            Self::BadMagic
            | Self::UnknownFrameType(_)
            | Self::UnknownCodec(_)
            | Self::UnknownAckStatus(_)
            | Self::UnknownErrorCode(_)
            | Self::Truncated { .. }
            | Self::TrailingBytes { .. }
            | Self::InvalidUtf8 { .. }
            | Self::StringTooLong { .. }
            | Self::InvalidStreamName(_)
            | Self::RawLenMismatch { .. }
            | Self::RecordsExceedRawLen { .. }
            | Self::PayloadLength { .. }
            | Self::ChecksumMismatch { .. }
            | Self::WelcomeVersionMismatch { .. }
            | Self::InvalidWelcome { .. }
            | Self::UnexpectedFrame { .. }
            | Self::UnknownChunk { .. }
            | Self::ChunkBeforeHello { .. }
            | Self::DuplicateChunk { .. }
            | Self::TooManyInFlight { .. } => ErrorCode::ProtocolViolation,
            Self::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            Self::HandshakeTimeout => ErrorCode::HandshakeTimeout,
            Self::Closed { code } => *code,
            Self::NotConnected
            | Self::Draining { .. }
            | Self::WindowFull { .. }
            | Self::AlreadyInFlight { .. }
            | Self::NotAccepted { .. } => ErrorCode::Internal,
        }
    }

    /// For an error about one chunk's bytes, the reason to put in a `Rejected` ack; `None` for
    /// connection-level and local errors.
    ///
    /// A server that knows the chunk's key (its header decoded) may answer such an error with
    /// `AckStatus::Rejected(reason)` and keep the connection, since resending the same bytes can
    /// never succeed.
    pub fn reject_reason(&self) -> Option<RejectReason> {
        match self {
            Self::PayloadTooLarge { .. } | Self::RawTooLarge { .. } | Self::TooManyRecords { .. } => {
                Some(RejectReason::TooLarge)
            }
            Self::ChecksumMismatch { .. } => Some(RejectReason::BadChecksum),
            Self::PayloadLength { .. } | Self::RawLenMismatch { .. } | Self::RecordsExceedRawLen { .. } => {
                Some(RejectReason::Malformed)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_code_round_trips_through_u32() {
        for v in 0..=8 {
            let code = ErrorCode::from_u32(v).expect("codes 0..=8 are defined");
            assert_eq!(code.to_u32(), v);
            assert_eq!(u32::from(code), v);
        }
        assert_eq!(ErrorCode::from_u32(9), None);
        assert_eq!(ErrorCode::from_u32(u32::MAX), None);
    }

    #[test]
    fn error_codes_display_as_snake_case_names() {
        assert_eq!(ErrorCode::ProtocolViolation.to_string(), "protocol_violation");
        assert_eq!(ErrorCode::HandshakeTimeout.to_string(), "handshake_timeout");
    }

    #[test]
    fn errors_map_to_their_close_codes() {
        assert_eq!(ProtoError::FrameTooLarge { len: 1, max: 0 }.code(), ErrorCode::FrameTooLarge);
        assert_eq!(ProtoError::BadMagic.code(), ErrorCode::ProtocolViolation);
        assert_eq!(ProtoError::UnsupportedVersion { version: 2 }.code(), ErrorCode::UnsupportedVersion);
        assert_eq!(ProtoError::HandshakeTimeout.code(), ErrorCode::HandshakeTimeout);
        assert_eq!(ProtoError::Closed { code: ErrorCode::Revoked }.code(), ErrorCode::Revoked);
        assert_eq!(ProtoError::NotConnected.code(), ErrorCode::Internal);
    }

    #[test]
    fn only_chunk_errors_have_a_reject_reason() {
        let bad_sum = ProtoError::ChecksumMismatch { expected: 1, computed: 2 };
        assert_eq!(bad_sum.reject_reason(), Some(RejectReason::BadChecksum));
        let big = ProtoError::PayloadTooLarge { len: 2, max: 1 };
        assert_eq!(big.reject_reason(), Some(RejectReason::TooLarge));
        assert_eq!(ProtoError::BadMagic.reject_reason(), None);
        assert_eq!(ProtoError::HandshakeTimeout.reject_reason(), None);
    }
}
