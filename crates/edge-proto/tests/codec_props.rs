//! Property tests of the wire codecs: round-trips for arbitrary frames and headers, and arbitrary
//! or mutated bytes into the decoders, which must never panic and never hold more than the limit.

use edge_proto::{
    AckStatus, CHUNK_MAGIC, CHUNK_PREFIX_LEN, ChunkHeader, Codec, ControlFrame, ErrorCode, FRAME_HEADER_LEN,
    FrameDecoder, Limits, RejectReason, RetryReason, StreamName,
};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

fn stream_name() -> impl Strategy<Value = StreamName> {
    "[A-Za-z0-9_.-]{1,64}".prop_filter_map("`.` and `..` are not names", |s| StreamName::new(&s).ok())
}

fn ack_status() -> impl Strategy<Value = AckStatus> {
    prop_oneof![
        Just(AckStatus::Stored),
        Just(AckStatus::Duplicate),
        Just(AckStatus::Retry(RetryReason::SinkUnavailable)),
        Just(AckStatus::Retry(RetryReason::Overloaded)),
        Just(AckStatus::Retry(RetryReason::ShuttingDown)),
        Just(AckStatus::Rejected(RejectReason::BadChecksum)),
        Just(AckStatus::Rejected(RejectReason::TooLarge)),
        Just(AckStatus::Rejected(RejectReason::Malformed)),
        Just(AckStatus::Rejected(RejectReason::BadRecords)),
    ]
}

fn error_code() -> impl Strategy<Value = ErrorCode> {
    (0u32..=8).prop_map(|v| ErrorCode::from_u32(v).expect("0..=8 are codes"))
}

fn control_frame() -> impl Strategy<Value = ControlFrame> {
    prop_oneof![
        // At most 32 chars of at most 4 bytes: within the 128-byte agent limit.
        (any::<u16>(), any::<[u8; 16]>(), "\\PC{0,32}")
            .prop_map(|(version, spool_id, agent)| { ControlFrame::Hello { version, spool_id, agent } }),
        (any::<u16>(), "\\PC{0,63}", any::<u32>(), any::<u32>()).prop_map(
            |(version, device, max_chunk_payload, max_in_flight)| ControlFrame::Welcome {
                version,
                device,
                max_chunk_payload,
                max_in_flight
            }
        ),
        (stream_name(), any::<u64>(), ack_status())
            .prop_map(|(stream, seq, status)| { ControlFrame::Ack { stream, seq, status } }),
        error_code().prop_map(|code| ControlFrame::GoAway { code }),
        (stream_name(), any::<u64>()).prop_map(|(stream, seq)| ControlFrame::Floor { stream, seq }),
    ]
}

/// Headers that pass `validate` under the default limits.
fn chunk_header() -> impl Strategy<Value = ChunkHeader> {
    let limits = Limits::default();
    prop_oneof![
        (Just(Codec::None), 0..=limits.max_chunk_payload.min(limits.max_raw_len)),
        (Just(Codec::Zstd), 0..=limits.max_raw_len),
    ]
    .prop_flat_map(move |(codec, raw_len)| {
        let max_records = (raw_len / 4).min(limits.max_records_per_chunk);
        let payload_len = match codec {
            Codec::None => Just(raw_len).boxed(),
            Codec::Zstd => (0..=limits.max_chunk_payload).boxed(),
        };
        (Just(codec), Just(raw_len), 0..=max_records, payload_len)
    })
    .prop_flat_map(|(codec, raw_len, records, payload_len)| {
        (stream_name(), any::<u64>(), any::<u32>(), any::<u64>()).prop_map(
            move |(stream, seq, checksum, created_ms)| ChunkHeader {
                stream,
                seq,
                records,
                raw_len,
                payload_len,
                codec,
                checksum,
                created_ms,
            },
        )
    })
}

/// Splits `bytes` at the given cut points (taken modulo the length), in order.
fn pieces<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut points: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    points.sort_unstable();
    let mut out = Vec::new();
    let mut start = 0;
    for p in points.into_iter().chain(std::iter::once(bytes.len())) {
        out.push(&bytes[start..p]);
        start = p;
    }
    out
}

/// Control-stream-like input: frame headers with plausible and implausible types and lengths,
/// followed by random bodies, so decoding gets past the first byte.
fn control_noise() -> impl Strategy<Value = Vec<u8>> {
    prop::collection::vec(
        (0u8..6, prop_oneof![0u32..200, any::<u32>()], prop::collection::vec(any::<u8>(), 0..200)),
        0..8,
    )
    .prop_map(|parts| {
        let mut out = Vec::new();
        for (ty, len, body) in parts {
            out.push(ty);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&body);
        }
        out
    })
}

fn chunk_noise() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        prop::collection::vec(any::<u8>(), 0..200),
        (any::<u16>(), prop::collection::vec(any::<u8>(), 0..200)).prop_map(|(len, body)| {
            let mut out = CHUNK_MAGIC.to_vec();
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(&body);
            out
        }),
    ]
}

proptest! {
    // Failures are saved under the crate's `proptest-regressions/` (cargo runs tests from the
    // package root) and replayed first on the next run.
    #![proptest_config(ProptestConfig {
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/codec_props.txt"))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn any_control_frame_round_trips(frame in control_frame()) {
        let mut buf = Vec::new();
        frame.encode(&mut buf);
        let decoded = ControlFrame::decode(&buf, &Limits::default());
        prop_assert_eq!(decoded, Ok(Some((frame, buf.len()))));
    }

    #[test]
    fn frames_fed_in_any_pieces_decode_to_the_same_frames(
        frames in prop::collection::vec(control_frame(), 0..12),
        cuts in prop::collection::vec(any::<usize>(), 0..40),
    ) {
        let mut buf = Vec::new();
        for f in &frames {
            f.encode(&mut buf);
        }
        let mut dec = FrameDecoder::new(&Limits::default());
        let mut got = Vec::new();
        for piece in pieces(&buf, &cuts) {
            dec.push(piece);
            while let Some(f) = dec.next_frame().expect("valid frames") {
                got.push(f);
            }
        }
        prop_assert_eq!(got, frames);
        prop_assert_eq!(dec.buffered_len(), 0);
    }

    #[test]
    fn any_chunk_header_round_trips(header in chunk_header(), payload_start in any::<[u8; 8]>()) {
        let mut buf = Vec::new();
        header.encode(&mut buf);
        prop_assert_eq!(buf.len(), header.encoded_len());
        let len = buf.len();
        buf.extend_from_slice(&payload_start);
        prop_assert_eq!(ChunkHeader::decode(&buf, &Limits::default()), Ok(Some((header, len))));
        for cut in 0..len {
            prop_assert_eq!(ChunkHeader::decode(&buf[..cut], &Limits::default()), Ok(None));
        }
    }

    #[test]
    fn arbitrary_control_bytes_never_panic_or_overbuffer(
        bytes in prop_oneof![control_noise(), prop::collection::vec(any::<u8>(), 0..600)],
        cuts in prop::collection::vec(any::<usize>(), 0..20),
        max_control_frame in prop_oneof![0u32..300, Just(16 * 1024)],
    ) {
        let limits = Limits { max_control_frame, ..Limits::default() };
        let bound = FRAME_HEADER_LEN + max_control_frame as usize;
        let mut dec = FrameDecoder::new(&limits);
        for piece in pieces(&bytes, &cuts) {
            dec.push(piece);
            prop_assert!(dec.buffered_len() <= bound, "{} > {}", dec.buffered_len(), bound);
            while let Ok(Some(_)) = dec.next_frame() {}
        }
        // The contiguous decoder agrees on where the first frame ends, or fails the same way.
        match ControlFrame::decode(&bytes, &limits) {
            Ok(Some((_, used))) => prop_assert!(used <= bytes.len() && used <= bound),
            Ok(None) => prop_assert!(bytes.len() < bound),
            Err(e) => prop_assert!(matches!(
                e.code(),
                ErrorCode::ProtocolViolation | ErrorCode::FrameTooLarge | ErrorCode::UnsupportedVersion
            )),
        }
    }

    #[test]
    fn mutated_control_frames_never_panic(
        frames in prop::collection::vec(control_frame(), 1..6),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..6),
    ) {
        let mut buf = Vec::new();
        for f in &frames {
            f.encode(&mut buf);
        }
        for (at, x) in flips {
            let i = at % buf.len();
            buf[i] ^= x;
        }
        let mut dec = FrameDecoder::new(&Limits::default());
        dec.push(&buf);
        while let Ok(Some(_)) = dec.next_frame() {}
        prop_assert!(dec.buffered_len() <= FRAME_HEADER_LEN + 16 * 1024);
    }

    #[test]
    fn arbitrary_chunk_bytes_never_panic_or_ask_for_more_than_the_limit(
        bytes in chunk_noise(),
        max_chunk_header in prop_oneof![0u32..120, Just(1024)],
    ) {
        let limits = Limits { max_chunk_header, ..Limits::default() };
        match ChunkHeader::decode(&bytes, &limits) {
            Ok(None) => prop_assert!(bytes.len() < CHUNK_PREFIX_LEN + max_chunk_header as usize),
            Ok(Some((header, used))) => {
                // Decoding is strict, so the header re-encodes to exactly the bytes it came from.
                let mut again = Vec::new();
                header.encode(&mut again);
                prop_assert_eq!(&again[..], &bytes[..used]);
            }
            Err(e) => prop_assert!(matches!(e.code(), ErrorCode::ProtocolViolation | ErrorCode::FrameTooLarge)),
        }
    }

    #[test]
    fn mutated_chunk_headers_never_panic(
        header in chunk_header(),
        flips in prop::collection::vec((any::<usize>(), any::<u8>()), 1..4),
    ) {
        let mut buf = Vec::new();
        header.encode(&mut buf);
        for (at, x) in flips {
            let i = at % buf.len();
            buf[i] ^= x;
        }
        if let Ok(Some((h, used))) = ChunkHeader::decode(&buf, &Limits::default()) {
            prop_assert!(used <= buf.len());
            prop_assert!(h.validate(&Limits::default()).is_ok());
        }
    }
}
