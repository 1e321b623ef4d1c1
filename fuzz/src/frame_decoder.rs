//! `frame_decoder`: arbitrary bytes, cut into arbitrary pieces, into the control-frame decoder.
//!
//! Input layout: `data[0]` picks the frame limit (high bit set: the default 16 KiB, otherwise
//! `data[0]` bytes, so small limits are exercised too), `data[1]` seeds the piece sizes, and the
//! rest is the control stream.
//!
//! Asserts, for every input:
//! - no panic (a panic is the fuzzer's crash);
//! - the bytes held for an incomplete frame never exceed `FRAME_HEADER_LEN + limit`, after every
//!   push: a declared length is checked before its body is buffered;
//! - feeding the stream in pieces gives exactly the frames and the error that decoding the
//!   contiguous buffer with `ControlFrame::decode` gives;
//! - every decoded frame re-encodes to exactly the bytes it was decoded from (the layout is
//!   canonical);
//! - every error carries a peer close code (`ProtocolViolation`, `FrameTooLarge` or
//!   `UnsupportedVersion`, never `Internal`/`NoError`), and is sticky.

use edge_proto::{ControlFrame, ErrorCode, FRAME_HEADER_LEN, FrameDecoder, Limits, ProtoError};

/// Runs one input; panics if a property is broken.
pub fn run(data: &[u8]) {
    let [limit_byte, split_seed, stream @ ..] = data else {
        return;
    };
    let limits = if limit_byte & 0x80 != 0 {
        Limits::default()
    } else {
        Limits { max_control_frame: u32::from(*limit_byte), ..Limits::default() }
    };
    let bound = FRAME_HEADER_LEN + limits.max_control_frame as usize;

    // Reference: contiguous decoding, frame after frame.
    let mut expected = Vec::new();
    let mut offset = 0;
    let expected_end = loop {
        match ControlFrame::decode(&stream[offset..], &limits) {
            Ok(Some((frame, used))) => {
                assert!(used >= FRAME_HEADER_LEN && used <= bound, "frame of {used} bytes, bound {bound}");
                let mut again = Vec::new();
                frame.encode(&mut again);
                assert_eq!(again, &stream[offset..offset + used], "{frame:?} does not re-encode to its bytes");
                expected.push(frame);
                offset += used;
            }
            Ok(None) => break Ok(stream.len() - offset),
            Err(e) => {
                check_error(&e);
                break Err(e);
            }
        }
    };

    // Incremental decoding, in pieces of 1..=32 bytes drawn from the seed.
    let mut dec = FrameDecoder::new(&limits);
    let mut got = Vec::new();
    let mut rng = u32::from(*split_seed) | 0x100;
    let mut rest = stream;
    let mut got_err = None;
    while !rest.is_empty() {
        rng ^= rng << 13;
        rng ^= rng >> 17;
        rng ^= rng << 5;
        let n = (rng % 32 + 1) as usize;
        let (piece, tail) = rest.split_at(n.min(rest.len()));
        rest = tail;
        dec.push(piece);
        assert!(dec.buffered_len() <= bound, "buffered {} > bound {bound}", dec.buffered_len());
        loop {
            match dec.next_frame() {
                Ok(Some(frame)) => got.push(frame),
                Ok(None) => break,
                Err(e) => {
                    if let Some(first) = &got_err {
                        assert_eq!(first, &e, "the first error is sticky");
                    }
                    got_err = Some(e);
                    break;
                }
            }
        }
    }
    assert_eq!(got, expected, "pieces and contiguous decoding disagree");
    match expected_end {
        Ok(pending) => {
            assert_eq!(got_err, None);
            // A complete header is kept parsed (type and length), not as bytes.
            let held = if pending >= FRAME_HEADER_LEN { pending - FRAME_HEADER_LEN } else { pending };
            assert_eq!(dec.buffered_len(), held, "the incomplete frame's bytes are held, no more");
        }
        Err(e) => {
            assert_eq!(got_err.as_ref(), Some(&e), "pieces and contiguous decoding disagree on the error");
            assert!(dec.is_failed());
            assert_eq!(dec.buffered_len(), 0, "a failed decoder holds nothing");
            // Sticky: more input changes nothing.
            dec.push(stream);
            assert_eq!(dec.next_frame(), Err(e));
            assert_eq!(dec.buffered_len(), 0);
        }
    }
}

fn check_error(e: &ProtoError) {
    assert!(
        matches!(e.code(), ErrorCode::ProtocolViolation | ErrorCode::FrameTooLarge | ErrorCode::UnsupportedVersion),
        "decoder error {e:?} has code {}",
        e.code()
    );
    assert!(!e.to_string().is_empty());
}

/// Seed inputs: each valid frame type, frames glued together, truncated and oversized frames.
#[allow(dead_code)] // Used by the corpus generator and the regression tests, not the fuzz target.
pub fn seeds() -> Vec<Vec<u8>> {
    use edge_proto::{AckStatus, RejectReason, RetryReason, StreamName};
    let name = |s: &str| StreamName::new(s).expect("seed names are valid");
    let frames = [
        ControlFrame::Hello { version: 1, spool_id: [7; 16], agent: "edge-uploader/0.1.0 host".into() },
        ControlFrame::Hello { version: 2, spool_id: [0; 16], agent: String::new() },
        ControlFrame::Welcome { version: 1, device: "dev-1".into(), max_chunk_payload: 1 << 25, max_in_flight: 64 },
        ControlFrame::Ack { stream: name("temp"), seq: 42, status: AckStatus::Stored },
        ControlFrame::Ack { stream: name("a.b-c_d"), seq: u64::MAX, status: AckStatus::Duplicate },
        ControlFrame::Ack { stream: name("s"), seq: 3, status: AckStatus::Retry(RetryReason::Overloaded) },
        ControlFrame::Ack { stream: name("s"), seq: 4, status: AckStatus::Rejected(RejectReason::BadRecords) },
        ControlFrame::GoAway { code: ErrorCode::ShuttingDown },
        ControlFrame::Floor { stream: name("temp"), seq: 41 },
    ];
    let mut out = Vec::new();
    let mut all = Vec::new();
    for f in &frames {
        let mut one = Vec::new();
        f.encode(&mut one);
        all.extend_from_slice(&one);
        let mut seed = vec![0x80, 7];
        seed.extend_from_slice(&one);
        out.push(seed.clone());
        seed.truncate(seed.len() - 1);
        out.push(seed);
    }
    let mut seed = vec![0xff, 1];
    seed.extend_from_slice(&all);
    out.push(seed);
    // A small limit, an oversized declared length, an unknown type, a bad UTF-8 device.
    out.push([&[16u8, 3][..], &all].concat());
    out.push(vec![0x80, 0, 0x01, 0xff, 0xff, 0xff, 0xff, 0]);
    out.push(vec![0x80, 0, 0x7f]);
    out.push(vec![0x80, 0, 0x02, 13, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0xff, 0xfe]);
    out
}
