//! The agent's side of a connection: a sans-IO state machine.
//!
//! [`ClientSession`] speaks the control stream (Hello and Floor out; Welcome, Ack and GoAway in) and keeps
//! the set of chunks in flight, so that an ack for a chunk it never sent is caught. It does not
//! see chunk payloads: the driver encodes a [`ChunkHeader`](crate::ChunkHeader) and the payload on
//! a uni-stream of its own, after registering the chunk with
//! [`chunk_sent`](ClientSession::chunk_sent).
//!
//! States: *handshaking* (Hello queued, waiting for Welcome, deadline armed) → *connected*
//! (Welcome received; may be *draining* after a GoAway) → *closed* (after any error). A closed
//! session refuses all input with [`ProtoError::Closed`] and transmits nothing more.
//!
//! A session [resumed](ClientSession::resume) with the limits of an earlier Welcome from the same
//! server may register chunks while still handshaking, within those limits: the driver sends
//! them right behind the Hello instead of a round trip later, and the server, which holds chunk
//! streams that arrive before the Hello, reads them once it has the Hello. The Welcome then sets
//! the limits as usual.

use std::collections::{HashSet, VecDeque};
use std::time::Instant;

use crate::error::{ErrorCode, ProtoError};
use crate::frame::{AckStatus, ControlFrame, FrameDecoder, MAX_AGENT_LEN};
use crate::name::StreamName;
use crate::wire::truncate_str;
use crate::{FLOOR_VERSION, Limits, VERSION};

/// Something the driver of a [`ClientSession`] should act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientEvent {
    /// The server's Welcome arrived: chunks may be sent.
    Connected {
        /// The device identity the server derived from our certificate.
        device: String,
        /// Largest chunk payload the server accepts.
        max_chunk_payload: u32,
        /// Most chunks the server lets us have in flight.
        max_in_flight: u32,
    },
    /// The server's answer for a chunk we sent.
    Ack {
        /// The chunk's stream.
        stream: StreamName,
        /// The chunk's sequence number.
        seq: u64,
        /// What the server did with it.
        status: AckStatus,
    },
    /// The server is draining: open no new chunk streams, wait for the acks in flight
    /// ([`ClientSession::is_drained`]), then reconnect.
    GoAway {
        /// Why the server is going away.
        code: ErrorCode,
    },
}

/// The limits of a Welcome, kept to send chunks before the next session's Welcome
/// ([`ClientSession::resume`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EarlyLimits {
    /// Most chunks in flight before the Welcome.
    pub max_in_flight: u32,
    /// Largest chunk payload to send before the Welcome.
    pub max_chunk_payload: u32,
}

/// The agent's protocol state for one connection.
///
/// Methods fall into four kinds, as in quinn-proto's `Connection`:
/// - getters (`&self`): [`is_connected`](Self::is_connected),
///   [`can_open_chunk`](Self::can_open_chunk), [`in_flight`](Self::in_flight), …;
/// - handlers of input from the network or the clock, named `handle_*`:
///   [`handle_control_bytes`](Self::handle_control_bytes), [`handle_timeout`](Self::handle_timeout);
/// - mutators for commands from the application: [`chunk_sent`](Self::chunk_sent),
///   [`chunk_abandoned`](Self::chunk_abandoned);
/// - pollers of output, named `poll_*`: [`poll_transmit`](Self::poll_transmit),
///   [`poll_event`](Self::poll_event), [`poll_timeout`](Self::poll_timeout).
///
/// # Polling order
///
/// After creating the session and after every `handle_*` or mutator call, the driver:
/// 1. writes every buffer from [`poll_transmit`](Self::poll_transmit) to the control stream, in
///    order (the first one carries the Hello);
/// 2. handles every [`poll_event`](Self::poll_event) until `None`;
/// 3. re-arms its timer to [`poll_timeout`](Self::poll_timeout) (none means no timer), and calls
///    [`handle_timeout`](Self::handle_timeout) when it fires.
///
/// A `handle_*` error means the session is closed: the driver closes the connection with
/// [`ProtoError::code`] as the application error code.
///
/// To send a chunk: check [`can_open_chunk`](Self::can_open_chunk), call
/// [`chunk_sent`](Self::chunk_sent) *before* writing the header, then open the uni-stream. If the
/// stream fails before the server could have read the whole chunk, call
/// [`chunk_abandoned`](Self::chunk_abandoned) and do not send that key again on this connection.
#[derive(Debug)]
pub struct ClientSession {
    /// The version of our Hello, which the Welcome must repeat.
    version: u16,
    state: State,
    /// Set by the first GoAway; from then on no new chunk may be registered.
    go_away: Option<ErrorCode>,
    decoder: FrameDecoder,
    /// Chunks registered by `chunk_sent` whose ack has not arrived.
    in_flight: HashSet<(StreamName, u64)>,
    /// Chunks given up by the driver; a late ack for one is still surfaced, not a violation.
    abandoned: HashSet<(StreamName, u64)>,
    /// Encoded frames not yet handed to the driver.
    transmit: Vec<u8>,
    events: VecDeque<ClientEvent>,
}

#[derive(Debug)]
enum State {
    /// Hello queued; waiting for Welcome until `deadline` (`None` if it would overflow).
    /// Chunks may be registered within `early`, if the session was resumed.
    Handshaking { deadline: Option<Instant>, early: Option<EarlyLimits> },
    /// Welcome received.
    Connected { device: String, max_chunk_payload: u32, max_in_flight: u32 },
    /// An error ended the session.
    Closed { code: ErrorCode },
}

impl ClientSession {
    /// Starts a session and queues the Hello.
    ///
    /// `agent` is cut to [`MAX_AGENT_LEN`] bytes on a char boundary. The handshake must complete
    /// by `now + limits.handshake_timeout`.
    pub fn new(spool_id: [u8; 16], agent: String, limits: Limits, now: Instant) -> Self {
        Self::with_version(spool_id, agent, limits, now, None, VERSION)
    }

    /// Starts a session like [`new`](Self::new) that may register chunks before the Welcome,
    /// within `early`: the limits of the last Welcome from the same server. The Welcome
    /// replaces them.
    pub fn resume(spool_id: [u8; 16], agent: String, limits: Limits, now: Instant, early: EarlyLimits) -> Self {
        Self::with_version(spool_id, agent, limits, now, Some(early), VERSION)
    }

    /// Starts a session like [`new`](Self::new) (with `early`, like [`resume`](Self::resume))
    /// that speaks protocol `version`: [`VERSION`], or an older one, down to
    /// [`MIN_VERSION`](crate::MIN_VERSION), to an older server that closed a connection with
    /// [`ErrorCode::UnsupportedVersion`]. The Welcome must repeat it.
    pub fn with_version(
        spool_id: [u8; 16],
        agent: String,
        limits: Limits,
        now: Instant,
        early: Option<EarlyLimits>,
        version: u16,
    ) -> Self {
        let mut agent = agent;
        agent.truncate(truncate_str(&agent, MAX_AGENT_LEN).len());
        let mut transmit = Vec::new();
        ControlFrame::Hello { version, spool_id, agent }.encode(&mut transmit);
        Self {
            version,
            state: State::Handshaking { deadline: now.checked_add(limits.handshake_timeout), early },
            go_away: None,
            decoder: FrameDecoder::new(&limits),
            in_flight: HashSet::new(),
            abandoned: HashSet::new(),
            transmit,
            events: VecDeque::new(),
        }
    }

    // === Getters ===

    /// Whether the Welcome arrived and the session has not failed (it may be draining).
    pub fn is_connected(&self) -> bool {
        matches!(self.state, State::Connected { .. })
    }

    /// Whether a new chunk may be sent now: connected (or resumed and handshaking), no GoAway
    /// received, and fewer than the Welcome's `max_in_flight` chunks (before it, the early
    /// limit's) in flight. When true, [`chunk_sent`](Self::chunk_sent) succeeds for any key not
    /// already in flight.
    pub fn can_open_chunk(&self) -> bool {
        self.window().is_some_and(|max| self.go_away.is_none() && self.in_flight.len() < max as usize)
    }

    /// The window chunks may be registered in now: the Welcome's, or before it the early one.
    fn window(&self) -> Option<u32> {
        match self.state {
            State::Connected { max_in_flight, .. } => Some(max_in_flight),
            State::Handshaking { early: Some(early), .. } => Some(early.max_in_flight),
            _ => None,
        }
    }

    /// Number of chunks sent and not yet acked.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Whether `(stream, seq)` is in flight.
    pub fn is_in_flight(&self, stream: &StreamName, seq: u64) -> bool {
        self.in_flight.contains(&(stream.clone(), seq))
    }

    /// The GoAway code, once the server sent one.
    pub fn go_away_code(&self) -> Option<ErrorCode> {
        self.go_away
    }

    /// Whether a GoAway arrived and every chunk in flight has been acked: time to reconnect.
    pub fn is_drained(&self) -> bool {
        self.go_away.is_some() && self.in_flight.is_empty()
    }

    /// The device identity from the Welcome.
    pub fn device(&self) -> Option<&str> {
        match &self.state {
            State::Connected { device, .. } => Some(device),
            _ => None,
        }
    }

    /// The server's `max_chunk_payload` from the Welcome.
    pub fn max_chunk_payload(&self) -> Option<u32> {
        match self.state {
            State::Connected { max_chunk_payload, .. } => Some(max_chunk_payload),
            _ => None,
        }
    }

    /// The server's `max_in_flight` from the Welcome.
    pub fn max_in_flight(&self) -> Option<u32> {
        match self.state {
            State::Connected { max_in_flight, .. } => Some(max_in_flight),
            _ => None,
        }
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
    /// Frames complete in `bytes` are processed in order; events they cause are queued even if a
    /// later frame is bad. On error the session is closed.
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

    /// Fires the handshake deadline: without a Welcome by then, the session closes with
    /// [`ProtoError::HandshakeTimeout`]. Does nothing before the deadline or in another state.
    pub fn handle_timeout(&mut self, now: Instant) -> Result<(), ProtoError> {
        match self.state {
            State::Handshaking { deadline: Some(deadline), .. } if now >= deadline => {
                Err(self.close(ProtoError::HandshakeTimeout))
            }
            _ => Ok(()),
        }
    }

    fn handle_frame(&mut self, _now: Instant, frame: ControlFrame) -> Result<(), ProtoError> {
        match frame {
            ControlFrame::Welcome { version, device, max_chunk_payload, max_in_flight } => {
                if !matches!(self.state, State::Handshaking { .. }) {
                    return Err(ProtoError::UnexpectedFrame { frame: "Welcome", reason: "after Welcome" });
                }
                if version != self.version {
                    return Err(ProtoError::WelcomeVersionMismatch { version, sent: self.version });
                }
                if max_in_flight == 0 {
                    return Err(ProtoError::InvalidWelcome { reason: "max_in_flight is 0" });
                }
                if max_chunk_payload == 0 {
                    return Err(ProtoError::InvalidWelcome { reason: "max_chunk_payload is 0" });
                }
                self.state = State::Connected { device: device.clone(), max_chunk_payload, max_in_flight };
                self.events.push_back(ClientEvent::Connected { device, max_chunk_payload, max_in_flight });
            }
            ControlFrame::Ack { stream, seq, status } => {
                if !self.is_connected() {
                    return Err(ProtoError::UnexpectedFrame { frame: "Ack", reason: "before Welcome" });
                }
                let key = (stream, seq);
                if !self.in_flight.remove(&key) && !self.abandoned.remove(&key) {
                    let (stream, seq) = key;
                    return Err(ProtoError::UnknownChunk { stream, seq });
                }
                let (stream, seq) = key;
                self.events.push_back(ClientEvent::Ack { stream, seq, status });
            }
            ControlFrame::GoAway { code } => {
                if self.go_away.is_none() {
                    self.go_away = Some(code);
                    self.events.push_back(ClientEvent::GoAway { code });
                }
            }
            ControlFrame::Hello { .. } => {
                return Err(ProtoError::UnexpectedFrame { frame: "Hello", reason: "from the server" });
            }
            ControlFrame::Floor { .. } => {
                return Err(ProtoError::UnexpectedFrame { frame: "Floor", reason: "from the server" });
            }
        }
        Ok(())
    }

    // === Mutators ===

    /// Queues a [`ControlFrame::Floor`]: no seq of `stream` below `seq` will be sent as new
    /// data any more (each one was acked, or dropped or quarantined by the agent). Returns
    /// whether it was queued: `false` on a session of protocol version 1, which has no Floor
    /// (the server then keeps the gaps). Fails if the session is closed or not yet connected.
    pub fn floor(&mut self, stream: &StreamName, seq: u64) -> Result<bool, ProtoError> {
        self.check_open()?;
        if !self.is_connected() {
            return Err(ProtoError::NotConnected);
        }
        if self.version < FLOOR_VERSION {
            return Ok(false);
        }
        ControlFrame::Floor { stream: stream.clone(), seq }.encode(&mut self.transmit);
        Ok(true)
    }

    /// Registers a chunk as in flight; call it before writing the chunk's stream.
    ///
    /// Fails, leaving the session unchanged, if the session is closed, not yet connected (and
    /// not resumed), draining after a GoAway, at its `max_in_flight` window, or if the key is
    /// already in flight.
    pub fn chunk_sent(&mut self, stream: &StreamName, seq: u64) -> Result<(), ProtoError> {
        self.check_open()?;
        let Some(max_in_flight) = self.window() else {
            return Err(ProtoError::NotConnected);
        };
        if let Some(code) = self.go_away {
            return Err(ProtoError::Draining { code });
        }
        if self.in_flight.len() >= max_in_flight as usize {
            return Err(ProtoError::WindowFull { max: max_in_flight });
        }
        let key = (stream.clone(), seq);
        if self.in_flight.contains(&key) {
            return Err(ProtoError::AlreadyInFlight { stream: stream.clone(), seq });
        }
        self.abandoned.remove(&key);
        self.in_flight.insert(key);
        Ok(())
    }

    /// Gives up on a chunk in flight whose stream failed; frees its slot in the window.
    ///
    /// Returns whether it was in flight. The server may still have received it: a later ack for
    /// it is surfaced as a normal [`ClientEvent::Ack`], not treated as a violation.
    pub fn chunk_abandoned(&mut self, stream: &StreamName, seq: u64) -> bool {
        let key = (stream.clone(), seq);
        if self.in_flight.remove(&key) {
            self.abandoned.insert(key);
            true
        } else {
            false
        }
    }

    // === Pollers ===

    /// Bytes to write on the control stream, all pending frames coalesced; `None` when there is
    /// nothing to send.
    pub fn poll_transmit(&mut self) -> Option<Vec<u8>> {
        if self.transmit.is_empty() { None } else { Some(std::mem::take(&mut self.transmit)) }
    }

    /// The next event for the driver.
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// When [`handle_timeout`](Self::handle_timeout) must next be called; `None` for never.
    pub fn poll_timeout(&self) -> Option<Instant> {
        match self.state {
            State::Handshaking { deadline, .. } => deadline,
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
    use std::time::Duration;

    use super::*;
    use crate::frame::RetryReason;

    fn name(s: &str) -> StreamName {
        StreamName::new(s).expect("test names are valid")
    }

    fn welcome(max_in_flight: u32) -> Vec<u8> {
        let mut out = Vec::new();
        ControlFrame::Welcome { version: VERSION, device: "dev".into(), max_chunk_payload: 1024, max_in_flight }
            .encode(&mut out);
        out
    }

    fn encode(frame: ControlFrame) -> Vec<u8> {
        let mut out = Vec::new();
        frame.encode(&mut out);
        out
    }

    fn connected(max_in_flight: u32) -> (ClientSession, Instant) {
        let now = Instant::now();
        let mut c = ClientSession::new([1; 16], "test".into(), Limits::default(), now);
        c.poll_transmit().expect("Hello is queued");
        c.handle_control_bytes(now, &welcome(max_in_flight)).expect("Welcome is valid");
        assert!(matches!(c.poll_event(), Some(ClientEvent::Connected { max_in_flight: m, .. }) if m == max_in_flight));
        (c, now)
    }

    #[test]
    fn new_session_queues_hello_and_arms_the_handshake_deadline() {
        let now = Instant::now();
        let mut c = ClientSession::new([3; 16], "agent".into(), Limits::default(), now);
        let bytes = c.poll_transmit().expect("Hello");
        let (frame, _) = ControlFrame::decode(&bytes, &Limits::default()).expect("valid").expect("complete");
        assert_eq!(frame, ControlFrame::Hello { version: VERSION, spool_id: [3; 16], agent: "agent".into() });
        assert_eq!(c.poll_transmit(), None);
        assert_eq!(c.poll_timeout(), Some(now + Duration::from_secs(10)));
        assert!(!c.is_connected() && !c.can_open_chunk());
    }

    #[test]
    fn window_and_duplicates_are_enforced_locally() {
        let (mut c, _) = connected(2);
        c.chunk_sent(&name("a"), 1).expect("room");
        assert_eq!(c.chunk_sent(&name("a"), 1), Err(ProtoError::AlreadyInFlight { stream: name("a"), seq: 1 }));
        c.chunk_sent(&name("a"), 2).expect("room");
        assert!(!c.can_open_chunk());
        assert_eq!(c.chunk_sent(&name("a"), 3), Err(ProtoError::WindowFull { max: 2 }));
        assert_eq!(c.in_flight(), 2);
        assert!(c.is_connected());
    }

    #[test]
    fn a_resumed_session_sends_within_the_early_limits_until_the_welcome_sets_its_own() {
        let now = Instant::now();
        let early = EarlyLimits { max_in_flight: 2, max_chunk_payload: 1024 };
        let mut c = ClientSession::resume([1; 16], "a".into(), Limits::default(), now, early);
        assert!(c.poll_transmit().is_some(), "the Hello is queued as for a new session");
        assert!(!c.is_connected() && c.can_open_chunk());
        c.chunk_sent(&name("a"), 1).expect("room before the Welcome");
        c.chunk_sent(&name("a"), 2).expect("room before the Welcome");
        assert_eq!(c.chunk_sent(&name("a"), 3), Err(ProtoError::WindowFull { max: 2 }));
        // An ack before the Welcome is still a violation: the server answers Hello first.
        let ack = encode(ControlFrame::Ack { stream: name("a"), seq: 1, status: AckStatus::Stored });
        let mut early_ack = ClientSession::resume([1; 16], "a".into(), Limits::default(), now, early);
        early_ack.chunk_sent(&name("a"), 1).expect("room");
        assert!(early_ack.handle_control_bytes(now, &ack).is_err());
        // The Welcome's window replaces the early one; the early chunks stay in flight.
        c.handle_control_bytes(now, &welcome(3)).expect("Welcome");
        assert!(matches!(c.poll_event(), Some(ClientEvent::Connected { max_in_flight: 3, .. })));
        assert_eq!(c.in_flight(), 2);
        c.chunk_sent(&name("a"), 3).expect("the Welcome's window has room");
        c.handle_control_bytes(now, &ack).expect("ack of an early chunk");
        assert!(matches!(c.poll_event(), Some(ClientEvent::Ack { seq: 1, .. })));
        assert_eq!(c.poll_timeout(), None, "no handshake deadline once connected");
    }

    #[test]
    fn chunk_sent_before_welcome_is_refused() {
        let mut c = ClientSession::new([1; 16], "a".into(), Limits::default(), Instant::now());
        assert_eq!(c.chunk_sent(&name("a"), 1), Err(ProtoError::NotConnected));
        assert_eq!(ProtoError::NotConnected.code(), ErrorCode::Internal);
    }

    #[test]
    fn an_abandoned_chunk_frees_its_slot_and_a_late_ack_is_not_a_violation() {
        let (mut c, now) = connected(1);
        c.chunk_sent(&name("a"), 1).expect("room");
        assert!(c.chunk_abandoned(&name("a"), 1));
        assert!(!c.chunk_abandoned(&name("a"), 1));
        assert!(c.can_open_chunk());
        let ack = encode(ControlFrame::Ack { stream: name("a"), seq: 1, status: AckStatus::Stored });
        c.handle_control_bytes(now, &ack).expect("late ack is fine");
        assert!(matches!(c.poll_event(), Some(ClientEvent::Ack { seq: 1, .. })));
        // But only once.
        let err = c.handle_control_bytes(now, &ack).expect_err("second ack");
        assert_eq!(err, ProtoError::UnknownChunk { stream: name("a"), seq: 1 });
    }

    #[test]
    fn a_second_welcome_or_a_hello_closes_the_session() {
        let (mut c, now) = connected(4);
        let err = c.handle_control_bytes(now, &welcome(4)).expect_err("second Welcome");
        assert_eq!(err.code(), ErrorCode::ProtocolViolation);
        assert_eq!(c.close_code(), Some(ErrorCode::ProtocolViolation));
        assert_eq!(c.handle_control_bytes(now, &[]), Err(ProtoError::Closed { code: ErrorCode::ProtocolViolation }));

        let (mut c, now) = connected(4);
        let hello = encode(ControlFrame::Hello { version: VERSION, spool_id: [0; 16], agent: String::new() });
        assert_eq!(c.handle_control_bytes(now, &hello).map_err(|e| e.code()), Err(ErrorCode::ProtocolViolation));
    }

    #[test]
    fn a_session_of_the_older_version_is_welcomed_in_it_and_sends_no_floor() {
        let now = Instant::now();
        let older = crate::MIN_VERSION;
        let mut c = ClientSession::with_version([1; 16], "a".into(), Limits::default(), now, None, older);
        let hello = c.poll_transmit().expect("Hello");
        let (frame, _) = ControlFrame::decode(&hello, &Limits::default()).expect("valid").expect("complete");
        assert!(matches!(frame, ControlFrame::Hello { version, .. } if version == older), "{frame:?}");
        let s = StreamName::new("t").expect("valid name");
        assert_eq!(c.floor(&s, 3), Err(ProtoError::NotConnected), "no Floor before the Welcome");
        let w = encode(ControlFrame::Welcome {
            version: older,
            device: "d".into(),
            max_chunk_payload: 1024,
            max_in_flight: 8,
        });
        c.handle_control_bytes(now, &w).expect("Welcome of our version");
        assert_eq!(c.floor(&s, 3), Ok(false), "version 1 has no Floor");
        assert_eq!(c.poll_transmit(), None);

        let mut c = ClientSession::new([1; 16], "a".into(), Limits::default(), now);
        c.poll_transmit().expect("Hello");
        c.handle_control_bytes(now, &welcome(8)).expect("Welcome");
        assert_eq!(c.floor(&s, 3), Ok(true));
        let bytes = c.poll_transmit().expect("Floor");
        let (frame, _) = ControlFrame::decode(&bytes, &Limits::default()).expect("valid").expect("complete");
        assert_eq!(frame, ControlFrame::Floor { stream: s, seq: 3 });
    }

    #[test]
    fn a_welcome_with_another_version_or_zero_limits_is_a_violation() {
        let now = Instant::now();
        for (version, mcp, mif) in [(VERSION - 1, 1024, 8), (VERSION + 1, 1024, 8), (VERSION, 1024, 0), (VERSION, 0, 8)]
        {
            let mut c = ClientSession::new([1; 16], "a".into(), Limits::default(), now);
            let w = encode(ControlFrame::Welcome {
                version,
                device: "d".into(),
                max_chunk_payload: mcp,
                max_in_flight: mif,
            });
            let err = c.handle_control_bytes(now, &w).expect_err("invalid Welcome");
            assert_eq!(err.code(), ErrorCode::ProtocolViolation, "{err}");
            assert_eq!(c.poll_event(), None);
        }
    }

    #[test]
    fn go_away_before_welcome_is_allowed_and_reported_once() {
        let now = Instant::now();
        let mut c = ClientSession::new([1; 16], "a".into(), Limits::default(), now);
        let g = encode(ControlFrame::GoAway { code: ErrorCode::ShuttingDown });
        c.handle_control_bytes(now, &g).expect("GoAway is allowed");
        c.handle_control_bytes(now, &g).expect("a repeat is ignored");
        assert_eq!(c.poll_event(), Some(ClientEvent::GoAway { code: ErrorCode::ShuttingDown }));
        assert_eq!(c.poll_event(), None);
        assert!(c.is_drained());
        assert_eq!(c.go_away_code(), Some(ErrorCode::ShuttingDown));
    }

    #[test]
    fn acks_surface_every_status() {
        let (mut c, now) = connected(8);
        c.chunk_sent(&name("s"), 5).expect("room");
        let status = AckStatus::Retry(RetryReason::SinkUnavailable);
        c.handle_control_bytes(now, &encode(ControlFrame::Ack { stream: name("s"), seq: 5, status }))
            .expect("known chunk");
        assert_eq!(c.poll_event(), Some(ClientEvent::Ack { stream: name("s"), seq: 5, status }));
        assert_eq!(c.in_flight(), 0);
    }

    #[test]
    fn the_handshake_deadline_fires_only_when_due() {
        let now = Instant::now();
        let mut c = ClientSession::new([1; 16], "a".into(), Limits::default(), now);
        let deadline = c.poll_timeout().expect("armed");
        c.handle_timeout(deadline - Duration::from_millis(1)).expect("not yet");
        assert_eq!(c.handle_timeout(deadline), Err(ProtoError::HandshakeTimeout));
        assert_eq!(c.poll_timeout(), None);
        assert_eq!(c.close_code(), Some(ErrorCode::HandshakeTimeout));
    }
}
