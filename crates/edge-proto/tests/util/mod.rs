//! An in-memory connection between a `ClientSession` and a `ServerSession`, on a virtual clock.
//!
//! Modelled on quinn-proto's `tests/util.rs`: [`Pair`] owns both sessions, the current virtual
//! time, and the link, whose properties are plain fields (one-way latency, extra jitter for chunk
//! streams, black-holed directions). [`Pair::step`] moves bytes and fires timers;
//! [`Pair::drive`] steps until nothing is left to do, and panics after a bounded number of steps
//! so a livelock fails instead of hanging.
//!
//! The link behaves like one QUIC connection:
//! - control bytes form one ordered stream per direction, cut into random-sized pieces;
//! - each chunk is its own stream: chunks due in the same step are delivered in shuffled order,
//!   and jitter lets later chunks overtake earlier ones; the server side decodes the header from
//!   growing random-sized prefixes, as bytes trickle in;
//! - when a session fails, its close (code) reaches the peer one latency later, unless that
//!   direction is black-holed.
//!
//! All randomness comes from one RNG seeded from the test's name, so a failure replays exactly.

#![allow(dead_code)] // Not every test binary uses every helper.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use edge_proto::client::{ClientEvent, ClientSession};
use edge_proto::records::encode_record;
use edge_proto::server::{ServerEvent, ServerSession};
use edge_proto::{AckStatus, ChunkHeader, Codec, ErrorCode, Limits, ProtoError, StreamName};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

/// Expands to the path of the enclosing function, e.g. `session::handshake_completes`.
#[macro_export]
macro_rules! test_name {
    () => {{
        fn f() {}
        let name = std::any::type_name_of_val(&f);
        name.strip_suffix("::f").unwrap_or(name)
    }};
}

/// Most steps [`Pair::drive`] takes before declaring a livelock.
const MAX_STEPS: usize = 100_000;

/// Settings fixed when the pair is built.
#[derive(Debug, Clone)]
pub struct PairConfig {
    pub limits: Limits,
    /// `max_in_flight` the server advertises.
    pub max_in_flight: u32,
    /// One-way latency of every byte.
    pub latency: Duration,
    /// Extra random delay, up to this much, added to each chunk stream.
    pub jitter: Duration,
}

impl Default for PairConfig {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            max_in_flight: 64,
            latency: Duration::from_millis(20),
            jitter: Duration::from_millis(15),
        }
    }
}

/// A piece of a control stream, or a connection close, in flight.
#[derive(Debug)]
enum Delivery {
    Bytes(Vec<u8>),
    Close(ErrorCode),
}

/// One side's failure, as the pair saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The side's own session returned this error.
    Local(ProtoError),
    /// The peer closed the connection with this code.
    Peer(ErrorCode),
}

/// The client and server sessions joined by a simulated link.
pub struct Pair {
    pub client: ClientSession,
    pub server: ServerSession,
    pub limits: Limits,
    /// When the pair was built; the virtual clock's origin.
    pub start: Instant,
    /// Current virtual time; only `step` advances it.
    pub time: Instant,
    /// One-way latency of every byte.
    pub latency: Duration,
    /// Extra random delay, up to this much, added to each chunk stream.
    pub jitter: Duration,
    /// Drop everything the client sends (control bytes, chunks, close).
    pub drop_to_server: bool,
    /// Drop everything the server sends.
    pub drop_to_client: bool,
    /// The seed of `rng`, printed so a failure can be replayed.
    pub seed: u64,
    rng: StdRng,
    to_server: VecDeque<(Instant, Delivery)>,
    to_client: VecDeque<(Instant, Delivery)>,
    /// Chunk streams in flight to the server: arrival time and the stream's bytes.
    chunks: Vec<(Instant, Vec<u8>)>,
    /// Everything the client session emitted, with the time it was polled.
    pub client_events: Vec<(Instant, ClientEvent)>,
    /// Everything the server session emitted, with the time it was polled.
    pub server_events: Vec<(Instant, ServerEvent)>,
    pub client_failure: Option<Failure>,
    pub server_failure: Option<Failure>,
    /// Virtual time elapsed when each side failed.
    pub client_failed_after: Option<Duration>,
    pub server_failed_after: Option<Duration>,
    /// Chunks the server accepted and verified, waiting for the test (the sink) to ack them.
    pub accepted: Vec<ChunkHeader>,
}

impl Pair {
    /// A pair with the default configuration.
    pub fn new(name: &str) -> Self {
        Self::with_config(name, PairConfig::default())
    }

    /// A pair whose RNG is seeded from `name` (the test's name).
    pub fn with_config(name: &str, config: PairConfig) -> Self {
        let seed = fnv1a(name.as_bytes());
        println!("pair for {name}: seed {seed:#018x}");
        // The one read of a real clock: an arbitrary origin for virtual time.
        let start = Instant::now();
        let client = ClientSession::new([0x5a; 16], "edge-uploader/test pair".into(), config.limits.clone(), start);
        let server = ServerSession::new("device-under-test".into(), config.limits.clone(), config.max_in_flight, start);
        Self {
            client,
            server,
            limits: config.limits,
            start,
            time: start,
            latency: config.latency,
            jitter: config.jitter,
            drop_to_server: false,
            drop_to_client: false,
            seed,
            rng: StdRng::seed_from_u64(seed),
            to_server: VecDeque::new(),
            to_client: VecDeque::new(),
            chunks: Vec::new(),
            client_events: Vec::new(),
            server_events: Vec::new(),
            client_failure: None,
            server_failure: None,
            client_failed_after: None,
            server_failed_after: None,
            accepted: Vec::new(),
        }
    }

    /// Virtual time elapsed since the pair was built.
    pub fn elapsed(&self) -> Duration {
        self.time - self.start
    }

    /// Steps until nothing is left to do.
    ///
    /// # Panics
    /// After `MAX_STEPS` steps: the sessions are livelocked.
    pub fn drive(&mut self) {
        for _ in 0..MAX_STEPS {
            if !self.step() {
                return;
            }
        }
        panic!("pair did not settle within {MAX_STEPS} steps (seed {:#018x})", self.seed);
    }

    /// Does one round of work; returns `false` when nothing is left to do.
    ///
    /// A round moves pending output onto the link and delivers whatever is due. If neither
    /// happened, it advances the clock to the next arrival or session deadline and fires the
    /// timers that are due.
    pub fn step(&mut self) -> bool {
        let mut progress = self.flush();
        progress |= self.deliver_control();
        progress |= self.deliver_chunks();
        if progress {
            return true;
        }
        let next = [
            self.to_server.front().map(|(at, _)| *at),
            self.to_client.front().map(|(at, _)| *at),
            self.chunks.iter().map(|(at, _)| *at).min(),
            self.client_alive().then(|| self.client.poll_timeout()).flatten(),
            self.server_alive().then(|| self.server.poll_timeout()).flatten(),
        ]
        .into_iter()
        .flatten()
        .min();
        let Some(next) = next else { return false };
        self.time = self.time.max(next);
        self.fire_timers();
        true
    }

    pub fn client_alive(&self) -> bool {
        self.client_failure.is_none()
    }

    pub fn server_alive(&self) -> bool {
        self.server_failure.is_none()
    }

    // === Application actions ===

    /// Sends a valid chunk of a few random records, as the agent's uploader would.
    pub fn send_chunk(&mut self, stream: &StreamName, seq: u64) -> Result<(), ProtoError> {
        let mut payload = Vec::new();
        let records = self.rng.random_range(1..=5u32);
        for _ in 0..records {
            let len = self.rng.random_range(0..64usize);
            let record: Vec<u8> = (0..len).map(|_| self.rng.random()).collect();
            encode_record(&mut payload, &record);
        }
        let len = u32::try_from(payload.len()).expect("a few small records");
        let header = ChunkHeader {
            stream: stream.clone(),
            seq,
            records,
            raw_len: len,
            payload_len: len,
            codec: Codec::None,
            checksum: edge_proto::crc32c(&payload),
            created_ms: 1_700_000_000_000 + seq,
        };
        self.send_raw_chunk(&header, &payload)
    }

    /// Registers `header`'s key with the client and puts the header and `payload` on a new
    /// chunk stream, as given (so tests can send a payload that does not match its header).
    pub fn send_raw_chunk(&mut self, header: &ChunkHeader, payload: &[u8]) -> Result<(), ProtoError> {
        self.client.chunk_sent(&header.stream, header.seq)?;
        let mut bytes = Vec::new();
        header.encode(&mut bytes);
        bytes.extend_from_slice(payload);
        let at = self.time + self.latency + self.random_jitter();
        if !self.drop_to_server {
            self.chunks.push((at, bytes));
        }
        Ok(())
    }

    /// Puts raw bytes on a new chunk stream, bypassing the client session, arriving after `delay`.
    pub fn inject_chunk_stream(&mut self, bytes: Vec<u8>, delay: Duration) {
        self.chunks.push((self.time + delay, bytes));
    }

    /// Puts raw bytes on the client's control stream, after what it already sent.
    pub fn inject_control_to_server(&mut self, bytes: Vec<u8>) {
        self.to_server.push_back((self.time + self.latency, Delivery::Bytes(bytes)));
    }

    /// Puts raw bytes on the server's control stream, after what it already sent.
    pub fn inject_control_to_client(&mut self, bytes: Vec<u8>) {
        self.to_client.push_back((self.time + self.latency, Delivery::Bytes(bytes)));
    }

    /// The sink makes up to `n` accepted chunks, picked at random, durable or not: acks each with
    /// `status(header)`. Returns how many were acked.
    pub fn ack_some(&mut self, n: usize, mut status: impl FnMut(&ChunkHeader) -> AckStatus) -> usize {
        self.accepted.shuffle(&mut self.rng);
        let n = n.min(self.accepted.len());
        let picked: Vec<ChunkHeader> = self.accepted.drain(..n).collect();
        for h in &picked {
            self.server.ack(&h.stream, h.seq, status(h)).expect("accepted chunks can be acked");
        }
        n
    }

    /// Acks every accepted chunk, in random order.
    pub fn ack_all(&mut self, status: impl FnMut(&ChunkHeader) -> AckStatus) -> usize {
        self.ack_some(usize::MAX, status)
    }

    /// A random number in `range`, from the pair's seeded RNG.
    pub fn random_range(&mut self, range: std::ops::Range<usize>) -> usize {
        self.rng.random_range(range)
    }

    /// The client's acks, in arrival order.
    pub fn client_acks(&self) -> Vec<(StreamName, u64, AckStatus)> {
        self.client_events
            .iter()
            .filter_map(|(_, e)| match e {
                ClientEvent::Ack { stream, seq, status } => Some((stream.clone(), *seq, *status)),
                _ => None,
            })
            .collect()
    }

    // === Link ===

    fn random_jitter(&mut self) -> Duration {
        let max = u64::try_from(self.jitter.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(self.rng.random_range(0..=max))
    }

    /// Moves both sessions' output onto the link; returns whether there was any.
    fn flush(&mut self) -> bool {
        let mut progress = false;
        let at = self.time + self.latency;
        while let Some(bytes) = self.client.poll_transmit() {
            progress = true;
            if !self.drop_to_server {
                let pieces = split_randomly(&mut self.rng, bytes);
                self.to_server.extend(pieces.into_iter().map(|p| (at, Delivery::Bytes(p))));
            }
        }
        while let Some(bytes) = self.server.poll_transmit() {
            progress = true;
            if !self.drop_to_client {
                let pieces = split_randomly(&mut self.rng, bytes);
                self.to_client.extend(pieces.into_iter().map(|p| (at, Delivery::Bytes(p))));
            }
        }
        progress |= self.poll_events();
        progress
    }

    fn poll_events(&mut self) -> bool {
        let mut progress = false;
        while let Some(e) = self.client.poll_event() {
            self.client_events.push((self.time, e));
            progress = true;
        }
        while let Some(e) = self.server.poll_event() {
            self.server_events.push((self.time, e));
            progress = true;
        }
        progress
    }

    fn deliver_control(&mut self) -> bool {
        let mut progress = false;
        while self.to_server.front().is_some_and(|(at, _)| *at <= self.time) {
            let Some((_, delivery)) = self.to_server.pop_front() else {
                break;
            };
            progress = true;
            if !self.server_alive() {
                continue;
            }
            match delivery {
                Delivery::Bytes(bytes) => {
                    if let Err(e) = self.server.handle_control_bytes(self.time, &bytes) {
                        self.fail_server(e);
                    }
                }
                Delivery::Close(code) => {
                    self.server_failure = Some(Failure::Peer(code));
                    self.server_failed_after = Some(self.elapsed());
                }
            }
        }
        while self.to_client.front().is_some_and(|(at, _)| *at <= self.time) {
            let Some((_, delivery)) = self.to_client.pop_front() else {
                break;
            };
            progress = true;
            if !self.client_alive() {
                continue;
            }
            match delivery {
                Delivery::Bytes(bytes) => {
                    if let Err(e) = self.client.handle_control_bytes(self.time, &bytes) {
                        self.fail_client(e);
                    }
                }
                Delivery::Close(code) => {
                    self.client_failure = Some(Failure::Peer(code));
                    self.client_failed_after = Some(self.elapsed());
                }
            }
        }
        progress
    }

    /// Delivers the chunk streams that are due, in shuffled order, as the server driver would
    /// handle them: decode the header as bytes trickle in, accept, verify, and reject bad
    /// payloads at once. Valid chunks wait in `accepted` for the test to ack them.
    fn deliver_chunks(&mut self) -> bool {
        let now = self.time;
        let (mut due, later): (Vec<_>, Vec<_>) = self.chunks.drain(..).partition(|(at, _)| *at <= now);
        self.chunks = later;
        if due.is_empty() {
            return false;
        }
        due.shuffle(&mut self.rng);
        for (_, bytes) in due {
            if !self.server_alive() {
                break;
            }
            if let Err(e) = self.receive_chunk(&bytes) {
                self.fail_server(e);
            }
        }
        true
    }

    fn receive_chunk(&mut self, bytes: &[u8]) -> Result<(), ProtoError> {
        let mut have = 0;
        let (header, used) = loop {
            if have == bytes.len() {
                // The stream finished inside the header: a driver would drop the stream.
                return Ok(());
            }
            have += self.rng.random_range(1..=bytes.len() - have);
            if let Some(found) = ChunkHeader::decode(&bytes[..have], &self.limits)? {
                break found;
            }
        };
        self.server.accept_chunk(&header)?;
        match header.verify_payload(&bytes[used..]) {
            Ok(()) => self.accepted.push(header),
            Err(e) => {
                let reason = e.reject_reason().expect("payload errors have a reject reason");
                self.server.ack(&header.stream, header.seq, AckStatus::Rejected(reason))?;
            }
        }
        Ok(())
    }

    /// Calls `handle_timeout` on each live side whose deadline has come, as a driver's timer would.
    fn fire_timers(&mut self) {
        let now = self.time;
        if self.client_alive()
            && self.client.poll_timeout().is_some_and(|t| t <= now)
            && let Err(e) = self.client.handle_timeout(now)
        {
            self.fail_client(e);
        }
        if self.server_alive()
            && self.server.poll_timeout().is_some_and(|t| t <= now)
            && let Err(e) = self.server.handle_timeout(now)
        {
            self.fail_server(e);
        }
    }

    fn fail_client(&mut self, e: ProtoError) {
        if !self.drop_to_server {
            self.to_server.push_back((self.time + self.latency, Delivery::Close(e.code())));
        }
        self.client_failure = Some(Failure::Local(e));
        self.client_failed_after = Some(self.elapsed());
    }

    fn fail_server(&mut self, e: ProtoError) {
        if !self.drop_to_client {
            self.to_client.push_back((self.time + self.latency, Delivery::Close(e.code())));
        }
        self.server_failure = Some(Failure::Local(e));
        self.server_failed_after = Some(self.elapsed());
    }
}

/// Cuts `bytes` into pieces of random sizes, at least one byte each.
fn split_randomly(rng: &mut StdRng, mut bytes: Vec<u8>) -> Vec<Vec<u8>> {
    let mut pieces = Vec::new();
    while !bytes.is_empty() {
        let take = rng.random_range(1..=bytes.len());
        let rest = bytes.split_off(take);
        pieces.push(bytes);
        bytes = rest;
    }
    pieces
}

/// 64-bit FNV-1a: a stable hash, so a test's seed does not change between Rust versions.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}
