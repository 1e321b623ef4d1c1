//! `ack_handling`: drives `edge_proto::client::ClientSession` with fuzzer-chosen server frames,
//! raw bytes, clock ticks and local commands, after a valid Hello, against a small model.
//!
//! The input is a program: each operation is one byte (the opcode, taken modulo the number of
//! operations) followed by the argument bytes that operation reads. Stream names come from a set
//! of three and sequence numbers from 0..8, so acks hit both known and unknown chunks, in and out
//! of order, twice, before and after the Welcome and the GoAway.
//!
//! Asserts, after every operation:
//! - no panic, and no arithmetic overflow (targets are built with debug assertions);
//! - the first transmit is a Hello and nothing is ever transmitted again;
//! - every `Ack` event is for a chunk the driver registered with `chunk_sent` (in flight or
//!   abandoned) and not yet acked: no chunk is considered acked that was not sent, or acked twice
//!   per send;
//! - `in_flight()` equals the model's count (so it never underflows or leaks) and never exceeds
//!   the Welcome's `max_in_flight`; `can_open_chunk`, `is_drained`, `is_connected` agree with
//!   the model;
//! - the bytes buffered for an incomplete frame stay under the frame limit;
//! - a handler error closes the session with that error's code and every later input is refused
//!   with `Closed`; local misuse (`chunk_sent` refused) leaves the session as it was;
//! - a whole Ack frame fed to a connected session with a clean decoder is accepted exactly when
//!   its chunk is in flight or abandoned, and is otherwise `UnknownChunk`.

use std::collections::HashSet;
use std::time::{Duration, Instant};

use edge_proto::client::{ClientEvent, ClientSession};
use edge_proto::{AckStatus, ControlFrame, ErrorCode, FRAME_HEADER_LEN, Limits, ProtoError, StreamName};

const STREAMS: [&str; 3] = ["a", "temp.x", "Z_9-"];

type Key = (StreamName, u64);

/// What the session should look like.
#[derive(Debug, Default)]
struct Model {
    /// `max_in_flight` from the accepted Welcome.
    window: Option<u32>,
    go_away: Option<ErrorCode>,
    closed: Option<ErrorCode>,
    in_flight: HashSet<Key>,
    abandoned: HashSet<Key>,
    /// Raw bytes were fed, so frame boundaries are no longer known.
    misaligned: bool,
}

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn bytes(&mut self, n: usize) -> &[u8] {
        let (head, rest) = self.0.split_at(n.min(self.0.len()));
        self.0 = rest;
        head
    }
    fn key(&mut self) -> Option<Key> {
        let b = self.byte()?;
        let stream = StreamName::new(STREAMS[usize::from(b >> 4) % STREAMS.len()]).expect("valid name");
        Some((stream, u64::from(b & 7)))
    }
}

/// Runs one input; panics if a property is broken.
pub fn run(data: &[u8]) {
    let limits = Limits { max_control_frame: 256, ..Limits::default() };
    let bound = FRAME_HEADER_LEN + limits.max_control_frame as usize;
    let t0 = Instant::now();
    let mut now = t0;
    let mut s = ClientSession::new([9; 16], "fuzz".into(), limits.clone(), now);
    let hello = s.poll_transmit().expect("a new session transmits its Hello");
    let (frame, used) = ControlFrame::decode(&hello, &limits).expect("valid Hello").expect("complete Hello");
    assert!(matches!(frame, ControlFrame::Hello { version: edge_proto::VERSION, .. }) && used == hello.len());
    let mut m = Model::default();
    let mut input = Input(data);

    while let Some(op) = input.byte() {
        // `buffered_len() == 0` is not enough: a complete header is held parsed, not as bytes.
        let clean = !m.misaligned && s.buffered_len() == 0;
        let result = match op % 9 {
            // A Welcome, sometimes invalid (version, zero limits).
            0 => {
                let b = input.byte().unwrap_or(0);
                let welcome = ControlFrame::Welcome {
                    version: if b & 0x80 != 0 { edge_proto::VERSION + 1 } else { edge_proto::VERSION },
                    device: "dev".into(),
                    max_chunk_payload: u32::from(b & 0x40 == 0),
                    max_in_flight: u32::from(b & 7),
                };
                feed(&mut s, now, &welcome)
            }
            // An Ack for a chunk from the small key space, with any status byte.
            1 => {
                let Some(key) = input.key() else { break };
                let status = AckStatus::from_u8(input.byte().unwrap_or(0)).unwrap_or(AckStatus::Stored);
                let known = m.in_flight.contains(&key) || m.abandoned.contains(&key);
                let ack = ControlFrame::Ack { stream: key.0.clone(), seq: key.1, status };
                let r = feed(&mut s, now, &ack);
                if clean && m.closed.is_none() {
                    match (&r, m.window.is_some(), known) {
                        (Ok(()), true, true) => {}
                        (Err(ProtoError::UnknownChunk { stream, seq }), true, false) => {
                            assert_eq!((stream, *seq), (&key.0, key.1));
                        }
                        (Err(ProtoError::UnexpectedFrame { frame: "Ack", .. }), false, _) => {}
                        other => panic!("ack for {key:?} (known: {known}, model {m:?}) gave {other:?}"),
                    }
                }
                r
            }
            // A GoAway with any known code.
            2 => {
                let code = ErrorCode::from_u32(u32::from(input.byte().unwrap_or(0)) % 9).expect("codes 0..=8 exist");
                feed(&mut s, now, &ControlFrame::GoAway { code })
            }
            // The driver registers a chunk.
            3 => {
                let Some(key) = input.key() else { break };
                let could = s.can_open_chunk();
                let before = s.in_flight();
                match s.chunk_sent(&key.0, key.1) {
                    Ok(()) => {
                        assert!(could, "chunk_sent accepted while can_open_chunk was false");
                        assert!(m.in_flight.insert(key.clone()), "{key:?} accepted twice");
                        m.abandoned.remove(&key);
                    }
                    Err(e) => {
                        assert_eq!(e.code(), m.closed.unwrap_or(ErrorCode::Internal));
                        assert_eq!(s.in_flight(), before, "a refused chunk_sent changed the session");
                        if could && m.closed.is_none() {
                            assert_eq!(e, ProtoError::AlreadyInFlight { stream: key.0.clone(), seq: key.1 });
                        }
                    }
                }
                Ok(())
            }
            // The driver gives up on a chunk.
            4 => {
                let Some(key) = input.key() else { break };
                let was = s.chunk_abandoned(&key.0, key.1);
                assert_eq!(was, m.in_flight.remove(&key), "chunk_abandoned disagrees about {key:?}");
                if was {
                    m.abandoned.insert(key);
                }
                Ok(())
            }
            // Raw bytes, possibly a partial or malformed frame.
            5 => {
                let n = usize::from(input.byte().unwrap_or(0) % 40);
                let raw = input.bytes(n).to_vec();
                m.misaligned |= !raw.is_empty();
                s.handle_control_bytes(now, &raw)
            }
            // The clock moves on (up to ~17 s) and the timer fires if armed.
            6 => {
                now += Duration::from_millis(u64::from(input.byte().unwrap_or(0)) * 67);
                let due = s.poll_timeout().is_some_and(|t| now >= t);
                let r = s.handle_timeout(now);
                if m.closed.is_none() {
                    assert_eq!(r.is_err(), due, "handle_timeout at {:?}", now - t0);
                }
                r
            }
            // Frames a server must never send: a Hello.
            7 => {
                let hello =
                    ControlFrame::Hello { version: edge_proto::VERSION, spool_id: [0; 16], agent: String::new() };
                feed(&mut s, now, &hello)
            }
            // Several Acks in one buffer cut at a chosen point: out of order, duplicated.
            _ => {
                let mut buf = Vec::new();
                for _ in 0..input.byte().unwrap_or(0) % 4 + 1 {
                    let Some((stream, seq)) = input.key() else { break };
                    ControlFrame::Ack { stream, seq, status: AckStatus::Duplicate }.encode(&mut buf);
                }
                let cut = usize::from(input.byte().unwrap_or(0)) % (buf.len() + 1);
                let first = s.handle_control_bytes(now, &buf[..cut]);
                drain(&mut s, &mut m);
                match first {
                    Ok(()) => s.handle_control_bytes(now, &buf[cut..]),
                    Err(e) => Err(e),
                }
            }
        };
        drain(&mut s, &mut m);
        // Local commands (3, 4) never close the session; the timer (6) is a no-op once closed.
        let local = matches!(op % 9, 3 | 4);
        match (result, m.closed) {
            (Ok(()), None) => {}
            (Ok(()), Some(_)) => assert!(local || op % 9 == 6, "a closed session accepted input"),
            (Err(e), Some(code)) => assert_eq!(e, ProtoError::Closed { code }),
            (Err(e), None) => {
                assert!(!local, "a local command returned {e:?}");
                assert_ne!(e.code(), ErrorCode::Internal, "a peer input gave a local error: {e:?}");
                assert_eq!(s.close_code(), Some(e.code()), "an error must close the session");
                m.closed = Some(e.code());
            }
        }
        check(&mut s, &m, bound);
    }
}

fn feed(s: &mut ClientSession, now: Instant, frame: &ControlFrame) -> Result<(), ProtoError> {
    let mut buf = Vec::new();
    frame.encode(&mut buf);
    s.handle_control_bytes(now, &buf)
}

/// Applies the session's events to the model, asserting each is allowed.
fn drain(s: &mut ClientSession, m: &mut Model) {
    while let Some(ev) = s.poll_event() {
        match ev {
            ClientEvent::Connected { max_in_flight, max_chunk_payload, .. } => {
                assert!(m.window.is_none(), "connected twice");
                assert!(max_in_flight > 0 && max_chunk_payload > 0);
                m.window = Some(max_in_flight);
            }
            ClientEvent::Ack { stream, seq, .. } => {
                let key = (stream, seq);
                assert!(m.window.is_some(), "ack event before Connected");
                assert!(
                    m.in_flight.remove(&key) || m.abandoned.remove(&key),
                    "ack event for {key:?}, which was not sent or was already acked"
                );
            }
            ClientEvent::GoAway { code } => {
                assert!(m.go_away.is_none(), "GoAway reported twice");
                m.go_away = Some(code);
            }
        }
    }
}

fn check(s: &mut ClientSession, m: &Model, bound: usize) {
    assert_eq!(s.poll_transmit(), None, "the client transmits nothing after its Hello");
    assert_eq!(s.in_flight(), m.in_flight.len(), "in-flight count drifted from the model {m:?}");
    for (stream, seq) in &m.in_flight {
        assert!(s.is_in_flight(stream, *seq));
    }
    assert!(s.buffered_len() <= bound);
    assert_eq!(s.go_away_code(), m.go_away);
    assert_eq!(s.close_code(), m.closed);
    if let Some(window) = m.window {
        assert!(s.in_flight() <= window as usize, "{} in flight, window {window}", s.in_flight());
    }
    let open = m.closed.is_none() && m.go_away.is_none() && m.window.is_some_and(|w| m.in_flight.len() < w as usize);
    assert_eq!(s.can_open_chunk(), open);
    assert_eq!(s.is_connected(), m.window.is_some() && m.closed.is_none());
    assert_eq!(s.is_drained(), m.go_away.is_some() && m.in_flight.is_empty());
    if m.closed.is_some() {
        assert_eq!(s.poll_timeout(), None);
    }
}

/// Seed programs: handshake, sends, acks in and out of order, duplicates, GoAway, timeouts.
#[allow(dead_code)] // Used by the corpus generator and the regression tests, not the fuzz target.
pub fn seeds() -> Vec<Vec<u8>> {
    vec![
        // Welcome(window 4), send a/0 a/1, ack a/1 then a/0, ack a/0 again (unknown).
        vec![0, 4, 3, 0x00, 3, 0x01, 1, 0x01, 0, 1, 0x00, 0x01, 1, 0x00, 0],
        // Welcome(window 2), send 3 (third refused), GoAway, acks drain it.
        vec![0, 2, 3, 0x10, 3, 0x11, 3, 0x12, 2, 6, 1, 0x10, 0x12, 1, 0x11, 0x20],
        // Ack before Welcome.
        vec![1, 0x00, 0],
        // Abandon then late ack; several acks in one buffer cut in the middle.
        vec![0, 3, 3, 0x21, 3, 0x22, 4, 0x21, 8, 2, 0x21, 0x22, 9],
        // Handshake timeout, then a Welcome after close.
        vec![6, 200, 6, 200, 0, 1],
        // Invalid Welcomes and a raw partial frame.
        vec![0, 0x81, 5, 3, 0x03, 0x0b, 0],
        vec![0, 0x40],
        // Server Hello after Welcome.
        vec![0, 1, 7],
    ]
}
