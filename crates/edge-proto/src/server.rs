//! The ingest server's side of a connection: a sans-IO state machine.
//!
//! [`ServerSession`] speaks the control stream (Hello and Floor in; Welcome, Ack and GoAway out) and keeps
//! the set of chunks accepted and not yet acked, so that a chunk before Hello, a chunk sent twice
//! at once, or more chunks than the Welcome allowed are caught. (A chunk *stream* may arrive
//! before the Hello: the driver holds it and hands its chunk in once the Hello is in.) It does not see payloads: the
//! driver reads each uni-stream, decodes its [`ChunkHeader`] with the same [`Limits`], calls
//! [`accept_chunk`](ServerSession::accept_chunk), reads and persists the payload, then calls
//! [`ack`](ServerSession::ack) once the sink says the chunk is durable.
//!
//! States: *awaiting Hello* (deadline armed) → *established* (Welcome queued; may be *going away*
//! after [`go_away`](ServerSession::go_away)) → *closed* (after any error). A closed session
//! refuses all input with [`ProtoError::Closed`] and transmits nothing more.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use crate::chunk::ChunkHeader;
use crate::error::{ErrorCode, ProtoError};
use crate::frame::{AckStatus, ControlFrame, FrameDecoder, MAX_DEVICE_LEN};
use crate::name::StreamName;
use crate::wire::truncate_str;
use crate::{FLOOR_VERSION, LIMIT_VERSION, Limits, MIN_VERSION, RetryReason, VERSION};

/// Something the driver of a [`ServerSession`] should act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServerEvent {
    /// The agent's valid Hello arrived; the Welcome is queued.
    Hello {
        /// The agent's spool identity.
        spool_id: [u8; 16],
        /// The agent's self-description (at most 128 bytes of UTF-8).
        agent: String,
        /// The protocol version the agent speaks, which the Welcome repeats.
        version: u16,
    },
    /// The agent's [`ControlFrame::Floor`]: no seq of `stream` below `seq` will come from its
    /// spool as new data any more.
    Floor {
        /// The stream.
        stream: StreamName,
        /// The lowest seq the agent may still send as new data.
        seq: u64,
    },
}

/// The server's protocol state for one connection.
///
/// Methods fall into four kinds, as in quinn-proto's `Connection`:
/// - getters (`&self`): [`spool_id`](Self::spool_id), [`in_flight`](Self::in_flight), …;
/// - handlers of input from the network or the clock, named `handle_*`:
///   [`handle_control_bytes`](Self::handle_control_bytes), [`handle_timeout`](Self::handle_timeout);
/// - mutators: [`accept_chunk`](Self::accept_chunk) (input from a chunk stream),
///   [`ack`](Self::ack), [`chunk_abandoned`](Self::chunk_abandoned) and
///   [`go_away`](Self::go_away) (commands from the application);
/// - pollers of output, named `poll_*`: [`poll_transmit`](Self::poll_transmit),
///   [`poll_event`](Self::poll_event), [`poll_timeout`](Self::poll_timeout).
///
/// # Polling order
///
/// After every `handle_*` or mutator call, the driver:
/// 1. writes every buffer from [`poll_transmit`](Self::poll_transmit) to the control stream, in
///    order (the Welcome, then acks and GoAway);
/// 2. handles every [`poll_event`](Self::poll_event) until `None`;
/// 3. re-arms its timer to [`poll_timeout`](Self::poll_timeout) (none means no timer), and calls
///    [`handle_timeout`](Self::handle_timeout) when it fires.
///
/// An error from `handle_*` or [`accept_chunk`](Self::accept_chunk) means the session is closed:
/// the driver closes the connection with [`ProtoError::code`]. Errors from
/// [`ack`](Self::ack) are local (code `Internal`) and leave the session as it was.
#[derive(Debug)]
pub struct ServerSession {
    /// Sent in the Welcome; already cut to [`MAX_DEVICE_LEN`].
    device: String,
    limits: Limits,
    /// Sent in the Welcome and enforced by `accept_chunk`; at least 1.
    max_in_flight: u32,
    state: State,
    /// Set by the first `go_away`.
    going_away: Option<ErrorCode>,
    decoder: FrameDecoder,
    /// Chunks accepted and not yet acked or abandoned.
    in_flight: HashSet<(StreamName, u64)>,
    /// Encoded frames not yet handed to the driver.
    transmit: Vec<u8>,
    events: VecDeque<ServerEvent>,
}

#[derive(Debug)]
enum State {
    /// Waiting for the Hello until `deadline` (`None` if it would overflow).
    AwaitingHello { deadline: Option<Instant> },
    /// Hello received, Welcome queued.
    Established { spool_id: [u8; 16], version: u16 },
    /// An error ended the session.
    Closed { code: ErrorCode },
}

impl ServerSession {
    /// Starts a session for an authenticated `device`; the Hello must arrive by
    /// `now + limits.handshake_timeout`.
    ///
    /// `device` is cut to [`MAX_DEVICE_LEN`] bytes on a char boundary, and `max_in_flight` is
    /// raised to 1 if 0 (a Welcome with 0 would deadlock the agent).
    pub fn new(device: String, limits: Limits, max_in_flight: u32, now: Instant) -> Self {
        let mut device = device;
        device.truncate(truncate_str(&device, MAX_DEVICE_LEN).len());
        Self {
            device,
            decoder: FrameDecoder::new(&limits),
            state: State::AwaitingHello { deadline: now.checked_add(limits.handshake_timeout) },
            limits,
            max_in_flight: max_in_flight.max(1),
            going_away: None,
            in_flight: HashSet::new(),
            transmit: Vec::new(),
            events: VecDeque::new(),
        }
    }

    // === Getters ===

    /// The agent's spool identity, once its Hello arrived.
    pub fn spool_id(&self) -> Option<[u8; 16]> {
        match self.state {
            State::Established { spool_id, .. } => Some(spool_id),
            _ => None,
        }
    }

    /// The protocol version of the agent's Hello, once it arrived.
    pub fn version(&self) -> Option<u16> {
        match self.state {
            State::Established { version, .. } => Some(version),
            _ => None,
        }
    }

    /// Whether the Hello arrived and the session has not failed.
    pub fn is_established(&self) -> bool {
        matches!(self.state, State::Established { .. })
    }

    /// Whether [`go_away`](Self::go_away) was called.
    pub fn is_going_away(&self) -> bool {
        self.going_away.is_some()
    }

    /// Number of chunks accepted and not yet acked.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether `(stream, seq)` was accepted and not yet acked.
    pub fn is_in_flight(&self, stream: &StreamName, seq: u64) -> bool {
        self.in_flight.contains(&(stream.clone(), seq))
    }

    /// Raw control-stream bytes held for an incomplete frame; never more than
    /// `FRAME_HEADER_LEN + limits.max_control_frame` (see [`FrameDecoder`]).
    pub fn buffered_len(&self) -> usize {
        self.decoder.buffered_len()
    }

    /// The code the session closed with, if an error ended it.
    pub fn close_code(&self) -> Option<ErrorCode> {
        match self.state {
            State::Closed { code } => Some(code),
            _ => None,
        }
    }

    // === Handlers ===

    /// Feeds bytes read from the control stream, in pieces of any size.
    ///
    /// The first frame must be a Hello with a version from [`MIN_VERSION`] to [`VERSION`];
    /// anything else closes the session (a Hello of another version with
    /// [`ProtoError::UnsupportedVersion`], queueing nothing). On a valid Hello the Welcome, of
    /// the Hello's version, is queued and [`ServerEvent::Hello`] emitted. After it the agent
    /// may send [`ControlFrame::Floor`] (version 2 on; [`ServerEvent::Floor`]); any other frame
    /// from the agent is a violation.
    pub fn handle_control_bytes(&mut self, now: Instant, bytes: &[u8]) -> Result<(), ProtoError> {
        self.check_open()?;
        self.decoder.push(bytes);
        loop {
            let frame = match self.decoder.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(()),
                Err(e) => return Err(self.close(e)),
            };
            if let Err(e) = self.handle_frame(now, frame) {
                return Err(self.close(e));
            }
        }
    }

    /// Fires the handshake deadline: without a Hello by then, the session closes with
    /// [`ProtoError::HandshakeTimeout`]. Does nothing before the deadline or in another state.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), ProtoError> {
        match self.state {
            State::AwaitingHello { deadline: Some(deadline) } if now >= deadline => {
                Err(self.close(ProtoError::HandshakeTimeout))
            }
            _ => Ok(()),
        }
    }

    fn handle_frame(&mut self, _now: Instant, frame: ControlFrame) -> Result<(), ProtoError> {
        match frame {
            ControlFrame::Hello { version, spool_id, agent } => {
                if !matches!(self.state, State::AwaitingHello { .. }) {
                    return Err(ProtoError::UnexpectedFrame { frame: "Hello", reason: "after Hello" });
                }
                if !(MIN_VERSION..=VERSION).contains(&version) {
                    return Err(ProtoError::UnsupportedVersion { version });
                }
                self.state = State::Established { spool_id, version };
                ControlFrame::Welcome {
                    version,
                    device: self.device.clone(),
                    max_chunk_payload: self.limits.max_chunk_payload,
                    max_in_flight: self.max_in_flight,
                }
                .encode(&mut self.transmit);
                self.events.push_back(ServerEvent::Hello { spool_id, agent, version });
                Ok(())
            }
            ControlFrame::Floor { stream, seq } => match self.state {
                State::Established { version, .. } if version >= FLOOR_VERSION => {
                    self.events.push_back(ServerEvent::Floor { stream, seq });
                    Ok(())
                }
                State::Established { .. } => {
                    Err(ProtoError::UnexpectedFrame { frame: "Floor", reason: "in protocol version 1" })
                }
                _ => Err(ProtoError::UnexpectedFrame { frame: "Floor", reason: "before Hello" }),
            },
            other => Err(ProtoError::UnexpectedFrame { frame: other.name(), reason: "from the agent" }),
        }
    }

    // === Mutators ===

    /// Registers a chunk whose header arrived on a uni-stream.
    ///
    /// Closes the session with a violation if the Hello has not arrived, if the header breaks
    /// [`Limits`], if the same `(stream, seq)` is already in flight on this connection, or if the
    /// agent exceeds the Welcome's `max_in_flight`. Chunks keep being accepted after
    /// [`go_away`](Self::go_away): the agent may have opened them before it saw the GoAway.
    pub fn accept_chunk(&mut self, header: &ChunkHeader) -> Result<(), ProtoError> {
        self.check_open()?;
        if let Err(e) = self.check_chunk(header) {
            return Err(self.close(e));
        }
        self.in_flight.insert((header.stream.clone(), header.seq));
        Ok(())
    }

    fn check_chunk(&self, header: &ChunkHeader) -> Result<(), ProtoError> {
        if !self.is_established() {
            return Err(ProtoError::ChunkBeforeHello { stream: header.stream.clone(), seq: header.seq });
        }
        header.validate(&self.limits)?;
        if self.in_flight.contains(&(header.stream.clone(), header.seq)) {
            return Err(ProtoError::DuplicateChunk { stream: header.stream.clone(), seq: header.seq });
        }
        if self.in_flight.len() >= self.max_in_flight as usize {
            return Err(ProtoError::TooManyInFlight { max: self.max_in_flight });
        }
        Ok(())
    }

    /// Queues the Ack for an accepted chunk and removes it from in flight.
    ///
    /// Call it only once the chunk's fate is final: durable (`Stored`/`Duplicate`), or refused
    /// (`Retry`/`Rejected`). Fails with [`ProtoError::NotAccepted`] (code `Internal`, session
    /// unchanged) if the chunk is not in flight, or [`ProtoError::Closed`] after an error.
    ///
    /// The chunk's slot in the window is free again once its Ack is *queued*, not once the agent
    /// has read it: an agent that never reads its control stream can keep sending chunks, so the
    /// driver must bound the bytes it holds for it (the ingest server closes such a connection).
    pub fn ack(&mut self, stream: &StreamName, seq: u64, status: AckStatus) -> Result<(), ProtoError> {
        self.check_open()?;
        if !self.in_flight.remove(&(stream.clone(), seq)) {
            return Err(ProtoError::NotAccepted { stream: stream.clone(), seq });
        }
        // An agent older than the reason does not know it: "overloaded" is what it was told
        // before, and acts on.
        let status = match status {
            AckStatus::Retry(RetryReason::Limit) if self.version().is_none_or(|v| v < LIMIT_VERSION) => {
                AckStatus::Retry(RetryReason::Overloaded)
            }
            other => other,
        };
        ControlFrame::Ack { stream: stream.clone(), seq, status }.encode(&mut self.transmit);
        Ok(())
    }

    /// Forgets an accepted chunk without acking it, e.g. because the agent reset its stream.
    /// Returns whether it was in flight. The agent learns nothing; it resends on a later
    /// connection.
    pub fn chunk_abandoned(&mut self, stream: &StreamName, seq: u64) -> bool {
        self.in_flight.remove(&(stream.clone(), seq))
    }

    /// Queues a GoAway: the agent should open no new chunk streams, collect the acks of those in
    /// flight, and reconnect. Only the first call has an effect; none after an error.
    pub fn go_away(&mut self, code: ErrorCode) {
        if self.going_away.is_some() || self.close_code().is_some() {
            return;
        }
        self.going_away = Some(code);
        ControlFrame::GoAway { code }.encode(&mut self.transmit);
    }

    // === Pollers ===

    /// Bytes to write on the control stream, all pending frames coalesced; `None` when there is
    /// nothing to send.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        if self.transmit.is_empty() { None } else { Some(std::mem::take(&mut self.transmit)) }
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<ServerEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called; `None` for never.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::AwaitingHello { deadline } => deadline,
            _ => None,
        }
    }

    fn check_open(&self) -> Result<(), ProtoError> {
        match self.state {
            State::Closed { code } => Err(ProtoError::Closed { code }),
            _ => Ok(()),
        }
    }

    /// Closes the session on `e` and returns it for the caller to propagate.
    fn close(&mut self, e: ProtoError) -> ProtoError {
        self.state = State::Closed { code: e.code() };
        self.transmit.clear();
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Codec;
    use crate::frame::RejectReason;

    fn name(s: &str) -> StreamName {
        StreamName::new(s).expect("test names are valid")
    }

    fn encode(frame: ControlFrame) -> Vec<u8> {
        let mut out = Vec::new();
        frame.encode(&mut out);
        out
    }

    fn hello(version: u16) -> Vec<u8> {
        encode(ControlFrame::Hello { version, spool_id: [9; 16], agent: "edge-uploader/0.1.0 h".into() })
    }

    fn header(stream: &str, seq: u64) -> ChunkHeader {
        ChunkHeader {
            stream: name(stream),
            seq,
            records: 0,
            raw_len: 0,
            payload_len: 0,
            codec: Codec::None,
            checksum: 0,
            created_ms: 0,
        }
    }

    fn established(max_in_flight: u32) -> (ServerSession, Instant) {
        let now = Instant::now();
        let mut s = ServerSession::new("dev".into(), Limits::default(), max_in_flight, now);
        s.handle_control_bytes(now, &hello(VERSION)).expect("valid Hello");
        s.poll_transmit().expect("Welcome");
        (s, now)
    }

    #[test]
    fn a_valid_hello_queues_welcome_and_emits_an_event() {
        let now = Instant::now();
        let mut s = ServerSession::new("dev-7".into(), Limits::default(), 32, now);
        assert!(s.poll_timeout().is_some());
        s.handle_control_bytes(now, &hello(VERSION)).expect("valid Hello");
        let bytes = s.poll_transmit().expect("Welcome");
        let (frame, _) = ControlFrame::decode(&bytes, &Limits::default()).expect("valid").expect("complete");
        assert_eq!(
            frame,
            ControlFrame::Welcome {
                version: VERSION,
                device: "dev-7".into(),
                max_chunk_payload: Limits::default().max_chunk_payload,
                max_in_flight: 32,
            }
        );
        assert_eq!(
            s.poll_event(),
            Some(ServerEvent::Hello { spool_id: [9; 16], agent: "edge-uploader/0.1.0 h".into(), version: VERSION })
        );
        assert_eq!(s.spool_id(), Some([9; 16]));
        assert_eq!(s.version(), Some(VERSION));
        assert_eq!(s.poll_timeout(), None);
    }

    #[test]
    fn an_agent_of_the_older_version_is_welcomed_in_its_version_and_may_not_send_floors() {
        let now = Instant::now();
        let mut s = ServerSession::new("dev".into(), Limits::default(), 8, now);
        s.handle_control_bytes(now, &hello(MIN_VERSION)).expect("the older version is spoken");
        let bytes = s.poll_transmit().expect("Welcome");
        let (frame, _) = ControlFrame::decode(&bytes, &Limits::default()).expect("valid").expect("complete");
        let ControlFrame::Welcome { version, .. } = frame else { panic!("not a Welcome: {frame:?}") };
        assert_eq!(version, MIN_VERSION);
        assert_eq!(s.version(), Some(MIN_VERSION));
        let floor = encode(ControlFrame::Floor { stream: name("t"), seq: 5 });
        let err = s.handle_control_bytes(now, &floor).expect_err("no Floor in version 1");
        assert_eq!(err, ProtoError::UnexpectedFrame { frame: "Floor", reason: "in protocol version 1" });
        assert_eq!(s.close_code(), Some(ErrorCode::ProtocolViolation));
    }

    #[test]
    fn a_floor_after_the_hello_is_an_event_and_before_it_a_violation() {
        let (mut s, now) = established(8);
        s.poll_event().expect("Hello event");
        s.handle_control_bytes(now, &encode(ControlFrame::Floor { stream: name("t"), seq: 5 })).expect("Floor");
        assert_eq!(s.poll_event(), Some(ServerEvent::Floor { stream: name("t"), seq: 5 }));
        assert_eq!(s.poll_transmit(), None, "a Floor is not answered");

        let mut early = ServerSession::new("dev".into(), Limits::default(), 8, now);
        let floor = encode(ControlFrame::Floor { stream: name("t"), seq: 5 });
        let err = early.handle_control_bytes(now, &floor).expect_err("Floor before Hello");
        assert_eq!(err, ProtoError::UnexpectedFrame { frame: "Floor", reason: "before Hello" });
    }

    #[test]
    fn a_hello_of_another_version_closes_without_sending_anything() {
        let now = Instant::now();
        let mut s = ServerSession::new("dev".into(), Limits::default(), 8, now);
        let next = VERSION + 1;
        assert_eq!(s.handle_control_bytes(now, &hello(next)), Err(ProtoError::UnsupportedVersion { version: next }));
        assert_eq!(s.poll_transmit(), None);
        assert_eq!(s.poll_event(), None);
        assert_eq!(s.close_code(), Some(ErrorCode::UnsupportedVersion));
    }

    #[test]
    fn a_second_hello_or_a_server_frame_from_the_agent_is_a_violation() {
        let (mut s, now) = established(8);
        let err = s.handle_control_bytes(now, &hello(VERSION)).expect_err("duplicate Hello");
        assert_eq!(err.code(), ErrorCode::ProtocolViolation);

        for frame in [
            ControlFrame::GoAway { code: ErrorCode::NoError },
            ControlFrame::Ack { stream: name("a"), seq: 1, status: AckStatus::Stored },
            ControlFrame::Welcome { version: 1, device: "x".into(), max_chunk_payload: 1, max_in_flight: 1 },
        ] {
            let (mut s, now) = established(8);
            let err = s.handle_control_bytes(now, &encode(frame)).expect_err("not from an agent");
            assert!(matches!(err, ProtoError::UnexpectedFrame { .. }), "{err:?}");
        }
    }

    #[test]
    fn a_chunk_key_in_flight_twice_is_a_violation() {
        let (mut s, _) = established(8);
        s.accept_chunk(&header("a", 1)).expect("first");
        assert_eq!(s.accept_chunk(&header("a", 1)), Err(ProtoError::DuplicateChunk { stream: name("a"), seq: 1 }));
        assert_eq!(s.close_code(), Some(ErrorCode::ProtocolViolation));
    }

    #[test]
    fn the_same_key_may_come_again_after_its_ack() {
        let (mut s, _) = established(8);
        s.accept_chunk(&header("a", 1)).expect("first");
        s.ack(&name("a"), 1, AckStatus::Rejected(RejectReason::Malformed)).expect("accepted");
        s.accept_chunk(&header("a", 1)).expect("resend after the ack");
        assert_eq!(s.in_flight(), 1);
    }

    #[test]
    fn more_chunks_than_the_welcome_allowed_is_a_violation() {
        let (mut s, _) = established(2);
        s.accept_chunk(&header("a", 1)).expect("1");
        s.accept_chunk(&header("a", 2)).expect("2");
        assert_eq!(s.accept_chunk(&header("a", 3)), Err(ProtoError::TooManyInFlight { max: 2 }));
    }

    #[test]
    fn acking_an_unaccepted_chunk_is_a_local_error() {
        let (mut s, _) = established(2);
        let err = s.ack(&name("a"), 1, AckStatus::Stored).expect_err("never accepted");
        assert_eq!(err, ProtoError::NotAccepted { stream: name("a"), seq: 1 });
        assert_eq!(err.code(), ErrorCode::Internal);
        assert_eq!(s.close_code(), None);
        assert_eq!(s.poll_transmit(), None);
    }

    #[test]
    fn a_limit_is_answered_as_overloaded_to_an_agent_older_than_the_reason() {
        let ack_of = |version: u16| {
            let now = Instant::now();
            let mut s = ServerSession::new("dev".into(), Limits::default(), 2, now);
            s.handle_control_bytes(now, &hello(version)).expect("valid Hello");
            s.poll_transmit().expect("Welcome");
            s.accept_chunk(&header("a", 1)).expect("room");
            s.ack(&name("a"), 1, AckStatus::Retry(RetryReason::Limit)).expect("ack");
            let bytes = s.poll_transmit().expect("the ack");
            ControlFrame::decode(&bytes, &Limits::default()).expect("valid").expect("complete").0
        };
        let ack = |status| ControlFrame::Ack { stream: name("a"), seq: 1, status };
        assert_eq!(ack_of(LIMIT_VERSION), ack(AckStatus::Retry(RetryReason::Limit)));
        assert_eq!(ack_of(LIMIT_VERSION - 1), ack(AckStatus::Retry(RetryReason::Overloaded)));
        assert_eq!(ack_of(MIN_VERSION), ack(AckStatus::Retry(RetryReason::Overloaded)));
    }

    #[test]
    fn an_abandoned_chunk_is_forgotten_without_an_ack() {
        let (mut s, _) = established(1);
        s.accept_chunk(&header("a", 1)).expect("room");
        assert!(s.chunk_abandoned(&name("a"), 1));
        assert_eq!(s.in_flight(), 0);
        assert_eq!(s.poll_transmit(), None);
        s.accept_chunk(&header("a", 1)).expect("room again");
    }

    #[test]
    fn go_away_is_sent_once() {
        let (mut s, _) = established(2);
        s.go_away(ErrorCode::ShuttingDown);
        s.go_away(ErrorCode::Internal);
        let bytes = s.poll_transmit().expect("GoAway");
        assert_eq!(bytes, encode(ControlFrame::GoAway { code: ErrorCode::ShuttingDown }));
        assert!(s.is_going_away());
    }

    #[test]
    fn device_names_over_the_limit_are_cut() {
        let now = Instant::now();
        let mut s = ServerSession::new("d".repeat(300), Limits::default(), 0, now);
        s.handle_control_bytes(now, &hello(VERSION)).expect("valid Hello");
        let bytes = s.poll_transmit().expect("Welcome");
        let (frame, _) = ControlFrame::decode(&bytes, &Limits::default()).expect("valid").expect("complete");
        let ControlFrame::Welcome { device, max_in_flight, .. } = frame else { panic!("not a Welcome: {frame:?}") };
        assert_eq!(device.len(), MAX_DEVICE_LEN);
        assert_eq!(max_in_flight, 1);
    }
}
