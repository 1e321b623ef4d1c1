//! Sealed chunks handed from the spool thread to the uploader in memory, so that an uploader
//! that keeps up does not read back from the spool what the spool thread wrote moments before.
//!
//! The spool stays the only source of truth: every chunk handed over here is committed and
//! sealed in the spool first, is deleted only by the uploader's ack as before, and its bytes
//! are the very buffers the spool thread wrote to the segment file. What this module saves is
//! the read back: the `pread` out of the page cache, the batch rows, the CRC-32C check of the
//! spool's copy and the hop through the blocking pool, for each chunk sent live.
//!
//! Two halves:
//!
//! * [`Retained`], owned by the spool thread: the bytes of each *tracked* stream's open
//!   batches, moved out of the committed append requests (each buffer shrunk to its length, so
//!   a 10 KiB record does not keep the intake's 64 KiB batch buffer alive), kept only while the
//!   uploader follows. A stream is tracked from a commit before which it had nothing open,
//!   and stays tracked while the retained bytes equal its open bytes in the spool, checked
//!   after every commit. When a tracked stream is sealed, the chunk's bytes are the retained
//!   parts up to the chunk's length. Untracked streams (open batches from before a restart or
//!   from before the uploader followed, the memory cap reached) seal chunks without bytes;
//!   those are read from the spool.
//! * [`Handoff`], shared by the spool thread and the uploader: a queue of the chunks sealed
//!   since the uploader said it had read everything sealed ([`Handoff::follow`]). While the
//!   uploader follows, every seal is queued, in id order, so the queue's front is always the
//!   next sealed chunk after the uploader's cursor. The queue holds chunk bytes only within
//!   the room the uploader's in-flight byte budget leaves ([`Handoff::set_room`]), so what is
//!   queued and what is in flight together stay within `upload.max_in_flight_bytes`: a chunk
//!   that does not fit is queued without its bytes (the uploader reads it by id). A seal past
//!   [`QUEUED_CHUNKS_CAP`] chunks ends the following, and the uploader reads the rest from the
//!   spool, as it does after a reconnect.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;

use bytes::{Bytes, BytesMut};
use edge_spool::{AppendOutcome, AppendRequest, ChunkMeta, ChunkPayload, Spool};

/// At most this many chunks wait in the queue; a seal beyond it ends the following (the
/// uploader is behind, and reads the spool as after a reconnect).
pub const QUEUED_CHUNKS_CAP: usize = 1024;

/// At most this many bytes of open batches are retained, over all streams. A stream whose next
/// batch would go over it is no longer tracked (its next chunk is read from the spool).
pub const RETAINED_BYTES_CAP: usize = 8 << 20;

/// A chunk's payload as the uploader sends it: one or more pieces, back to back.
#[derive(Debug, Clone)]
pub struct Payload {
    /// The pieces, in order; their concatenation is the chunk's payload.
    pub parts: Vec<Bytes>,
    len: usize,
    crc32c: Option<u32>,
}

impl Payload {
    pub(crate) fn from_parts(parts: Vec<Bytes>) -> Self {
        let len = parts.iter().map(Bytes::len).sum();
        Payload { parts, len, crc32c: None }
    }

    /// Payload bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the payload has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// CRC-32C of the payload: the one the spool checked the bytes against when it read them,
    /// or computed over the pieces for a payload handed over in memory.
    pub fn crc32c(&self) -> u32 {
        self.crc32c.unwrap_or_else(|| self.parts.iter().fold(0, |crc, p| edge_proto::crc32c_append(crc, p)))
    }

    /// The payload in one buffer (a copy only when there are several pieces).
    pub fn contiguous(&self) -> Bytes {
        match self.parts.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            parts => {
                let mut all = BytesMut::with_capacity(self.len);
                for p in parts {
                    all.extend_from_slice(p);
                }
                all.freeze()
            }
        }
    }
}

impl From<ChunkPayload> for Payload {
    fn from(p: ChunkPayload) -> Self {
        let len = p.data.len();
        Payload { parts: vec![Bytes::from(p.data)], len, crc32c: Some(p.crc32c) }
    }
}

/// The open batches of one tracked stream.
#[derive(Debug, Default)]
struct Open {
    parts: VecDeque<Bytes>,
    /// Open bytes retained (the spool's open bytes of the stream, while it is tracked).
    bytes: usize,
}

impl Open {
    /// Retains `data`, moving its buffer (shrunk to its length first: jemalloc shrinks a large
    /// allocation in place, so the batch buffer the intake sized for more records than came
    /// gives its unused pages back without a copy).
    fn push(&mut self, mut data: Vec<u8>) {
        data.shrink_to_fit();
        self.bytes += data.len();
        self.parts.push_back(Bytes::from(data));
    }

    /// Cuts the first `n` retained bytes off, or `None` if fewer are retained.
    fn take(&mut self, n: usize) -> Option<Vec<Bytes>> {
        if n > self.bytes {
            return None;
        }
        let mut out = Vec::new();
        let mut left = n;
        while left > 0 {
            let front = self.parts.front_mut()?;
            if front.len() <= left {
                left -= front.len();
                out.extend(self.parts.pop_front());
            } else {
                // The seal fell inside a piece (sealed by size in the middle of a commit).
                out.push(front.split_to(left));
                left = 0;
            }
        }
        self.bytes -= n;
        Some(out)
    }
}

/// The spool thread's half: the open batches of tracked streams. See the module doc.
#[derive(Debug, Default)]
pub struct Retained {
    streams: HashMap<String, Open>,
    /// Retained over all streams, held under [`RETAINED_BYTES_CAP`].
    bytes: usize,
}

impl Retained {
    /// Before a commit: every stream the requests append to that has no open batch in the spool
    /// is tracked from now on (its retained bytes, none, are exactly its open bytes).
    pub fn track(&mut self, reqs: &[AppendRequest], spool: &Spool) {
        for b in reqs.iter().flat_map(|r| &r.batches) {
            if !self.streams.contains_key(&b.stream) && spool.open_bytes(&b.stream) == 0 {
                self.streams.insert(b.stream.clone(), Open::default());
            }
        }
    }

    /// After a commit: takes the batches of the accepted requests (in order), then cuts the
    /// chunks `sealed` (in order) off the front of their streams' bytes. Returns each sealed
    /// chunk with its payload, or without one for a stream that is not tracked. Finally drops
    /// the streams whose retained bytes no longer equal their open bytes in the spool.
    pub fn committed(
        &mut self,
        reqs: Vec<AppendRequest>,
        outcomes: &[AppendOutcome],
        sealed: &[ChunkMeta],
        spool: &Spool,
    ) -> Vec<(ChunkMeta, Option<Payload>)> {
        let mut touched: Vec<String> = Vec::new();
        for (req, outcome) in reqs.into_iter().zip(outcomes) {
            if *outcome != AppendOutcome::Accepted {
                continue;
            }
            for b in req.batches {
                let Some(open) = self.streams.get_mut(&b.stream) else { continue };
                if self.bytes + b.data.len() > RETAINED_BYTES_CAP {
                    self.untrack(&b.stream);
                    continue;
                }
                self.bytes += b.data.len();
                open.push(b.data);
                if touched.last() != Some(&b.stream) {
                    touched.push(b.stream);
                }
            }
        }
        let mut out = Vec::with_capacity(sealed.len());
        for meta in sealed {
            let len = usize::try_from(meta.bytes).unwrap_or(usize::MAX);
            match self.streams.get_mut(&meta.stream).and_then(|open| open.take(len)) {
                Some(parts) => {
                    self.bytes -= len;
                    out.push((meta.clone(), Some(Payload::from_parts(parts))));
                }
                None => {
                    self.untrack(&meta.stream);
                    out.push((meta.clone(), None));
                }
            }
            touched.push(meta.stream.clone());
        }
        for name in touched {
            let exact = self.streams.get(&name).map(|open| open.bytes as u64 == spool.open_bytes(&name));
            if exact == Some(false) {
                self.untrack(&name);
            }
        }
        out
    }

    /// Stops tracking every stream (the uploader does not follow).
    pub fn clear(&mut self) {
        self.streams.clear();
        self.bytes = 0;
    }

    fn untrack(&mut self, stream: &str) {
        if let Some(open) = self.streams.remove(stream) {
            self.bytes -= open.bytes;
        }
    }

    /// Bytes retained over all streams.
    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

/// What the uploader sends next, as far as the handoff knows.
#[derive(Debug)]
pub enum Next {
    /// The next sealed chunk after the uploader's cursor, with its payload, or without one
    /// (read it from the spool by id).
    Chunk(ChunkMeta, Option<Payload>),
    /// Following, and nothing sealed since the last chunk taken.
    CaughtUp,
    /// Not following: read from the spool after the cursor.
    Spool,
}

#[derive(Debug, Default)]
struct State {
    /// Seals reported so far (a generation: [`Handoff::follow`] compares it).
    seals: u64,
    following: bool,
    queue: VecDeque<(ChunkMeta, Option<Payload>)>,
    queued_bytes: usize,
    /// What the uploader's in-flight byte budget has left (see [`Handoff::set_room`]).
    room: usize,
}

/// The queue between the spool thread and the uploader. See the module doc.
#[derive(Debug, Default)]
pub struct Handoff {
    state: Mutex<State>,
}

impl Handoff {
    /// The seals so far. Taken before the uploader reads the spool, and passed to
    /// [`Handoff::follow`] if that read found nothing more.
    pub fn generation(&self) -> u64 {
        crate::lock(&self.state).seals
    }

    /// The uploader has sent everything that was sealed at `generation`: from now on, queue
    /// every seal for it. Refused (returns false) if anything was sealed since, which the read
    /// may have missed.
    pub fn follow(&self, generation: u64) -> bool {
        let mut st = crate::lock(&self.state);
        st.following = st.seals == generation;
        st.following
    }

    /// Takes the next chunk, if the handoff knows it.
    pub fn next(&self) -> Next {
        let mut st = crate::lock(&self.state);
        match st.queue.pop_front() {
            Some((meta, payload)) => {
                st.queued_bytes -= payload.as_ref().map_or(0, Payload::len);
                Next::Chunk(meta, payload)
            }
            None if st.following => Next::CaughtUp,
            None => Next::Spool,
        }
    }

    /// Ends the following and empties the queue: the uploader's connection ended, or the spool
    /// thread saw chunks deleted other than by acks (the cap dropped the oldest), which queued
    /// chunks may be among. The uploader then reads the spool after its cursor.
    pub fn stop(&self) {
        let mut st = crate::lock(&self.state);
        st.following = false;
        st.queue.clear();
        st.queued_bytes = 0;
    }

    /// The uploader: its in-flight byte budget has `bytes` left. Chunk bytes are queued only
    /// within it.
    pub fn set_room(&self, bytes: u64) {
        crate::lock(&self.state).room = usize::try_from(bytes).unwrap_or(usize::MAX);
    }

    /// Spool thread: chunks were sealed (in id order, all of one commit). Queued while the
    /// uploader follows: with their bytes while those fit in the room its in-flight budget
    /// leaves, without them otherwise; the first past [`QUEUED_CHUNKS_CAP`] ends the following.
    pub fn sealed(&self, chunks: Vec<(ChunkMeta, Option<Payload>)>) {
        let mut st = crate::lock(&self.state);
        st.seals += chunks.len() as u64;
        if !st.following {
            return;
        }
        for (meta, mut payload) in chunks {
            if st.queue.len() >= QUEUED_CHUNKS_CAP {
                // What is queued stays: the uploader takes it, then reads the spool after it.
                st.following = false;
                return;
            }
            let len = payload.as_ref().map_or(0, Payload::len);
            if st.queued_bytes + len > st.room {
                payload = None;
            } else {
                st.queued_bytes += len;
            }
            st.queue.push_back((meta, payload));
        }
    }

    /// Whether the uploader follows: every seal is queued for it.
    pub fn following(&self) -> bool {
        crate::lock(&self.state).following
    }

    /// Whether a chunk sealed now would be the uploader's next: it follows the seals and has
    /// taken every chunk queued for it.
    pub fn wants_seals(&self) -> bool {
        let st = crate::lock(&self.state);
        st.following && st.queue.is_empty()
    }

    /// Bytes of sealed chunks waiting in the queue.
    pub fn queued_bytes(&self) -> usize {
        crate::lock(&self.state).queued_bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edge_spool::{Batch, SealWhat, SpoolOptions};
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn meta(id: i64, bytes: u64) -> ChunkMeta {
        ChunkMeta {
            id: edge_spool::ChunkId(id),
            stream: "s".into(),
            seq: id as u64,
            records: 1,
            bytes,
            first_ms: 0,
            sealed_ms: 0,
        }
    }

    fn payload(len: usize) -> Option<Payload> {
        Some(Payload::from_parts(vec![Bytes::from(vec![7u8; len])]))
    }

    /// A batch of `records` framed records of `size` bytes each, in a buffer of `capacity`
    /// (at least what they need), every byte depending on `seed`.
    fn batch(stream: &str, records: u32, size: usize, capacity: usize, seed: u8) -> Batch {
        let mut data = Vec::with_capacity(capacity);
        for r in 0..records {
            let body: Vec<u8> =
                (0..size).map(|i| seed.wrapping_add(r as u8).wrapping_mul(31).wrapping_add(i as u8)).collect();
            edge_proto::records::encode_record(&mut data, &body);
        }
        Batch { stream: stream.into(), data, records }
    }

    #[test]
    fn handed_over_payloads_are_byte_for_byte_what_the_spool_reads_back() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut opts = SpoolOptions::new(dir.path().join("spool.db"));
        opts.chunk_target_bytes = 64 << 10;
        opts.linger = std::time::Duration::from_secs(3600);
        let (mut spool, _) = Spool::open(opts).expect("open spool");
        let mut reader = spool.reader().expect("reader");
        let mut retained = Retained::default();
        let mut rng = StdRng::seed_from_u64(0x5eed_4a4d);
        let (mut with_bytes, mut without, mut acked) = (0, 0, Vec::new());
        for round in 0..300u32 {
            let mut reqs = Vec::new();
            for _ in 0..rng.random_range(0..4) {
                let batches = (0..rng.random_range(1..3))
                    .map(|_| {
                        let stream = ["a", "b", "c"][rng.random_range(0..3)];
                        let (records, size) = (rng.random_range(1..6), rng.random_range(1..9000));
                        // Some buffers mostly empty (shrunk when retained), some full.
                        let need = records as usize * (size + 4);
                        let capacity = if rng.random_bool(0.5) { need } else { need * 4 + 65536 };
                        batch(stream, records, size, capacity, round as u8)
                    })
                    .collect();
                reqs.push(AppendRequest { batches });
            }
            let seal = match rng.random_range(0..10) {
                0 => SealWhat::All,
                1 => SealWhat::Due,
                _ => SealWhat::Nothing,
            };
            let acks = std::mem::take(&mut acked);
            retained.track(&reqs, &spool);
            let report = spool.commit(&reqs, &acks, seal, u64::from(round)).expect("commit");
            let outcomes = report.appends.expect("appends");
            for (meta, payload) in retained.committed(reqs, &outcomes, &report.sealed, &spool) {
                let listed = reader.sealed_after(Some(edge_spool::ChunkId(meta.id.0 - 1)), 1).expect("list");
                assert_eq!(
                    listed,
                    std::slice::from_ref(&meta),
                    "the sealing report's chunk is the one the spool lists"
                );
                let from_disk = reader.read_payload(&meta).expect("read back");
                match payload {
                    Some(p) => {
                        with_bytes += 1;
                        assert_eq!(p.len() as u64, meta.bytes);
                        assert_eq!(p.contiguous().as_ref(), from_disk.data.as_slice(), "chunk {:?}", meta.id);
                        assert_eq!(p.crc32c(), from_disk.crc32c);
                    }
                    None => without += 1,
                }
                acked.push(meta.id);
            }
            // Every tracked stream holds exactly its open bytes.
            for (name, open) in &retained.streams {
                assert_eq!(open.bytes as u64, spool.open_bytes(name), "stream {name} after round {round}");
            }
            assert!(retained.bytes() <= RETAINED_BYTES_CAP);
        }
        // Every stream starts empty, so none is ever untracked here: all chunks had their bytes.
        assert!(with_bytes > 100, "{with_bytes} chunks handed over");
        assert_eq!(without, 0);
    }

    #[test]
    fn a_stream_with_open_batches_from_before_is_read_from_the_spool_until_it_had_nothing_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut opts = SpoolOptions::new(dir.path().join("spool.db"));
        opts.linger = std::time::Duration::from_secs(3600);
        let (mut spool, _) = Spool::open(opts).expect("open spool");
        // Open bytes the retention never saw (as after a restart).
        let before = AppendRequest { batches: vec![batch("s", 2, 100, 0, 1)] };
        spool.append(&[before], 0).expect("append");

        let mut retained = Retained::default();
        let mut commit = |retained: &mut Retained, reqs: Vec<AppendRequest>, seal| {
            retained.track(&reqs, &spool);
            let report = spool.commit(&reqs, &[], seal, 1).expect("commit");
            let outcomes = report.appends.expect("appends");
            retained.committed(reqs, &outcomes, &report.sealed, &spool)
        };
        let more = || vec![AppendRequest { batches: vec![batch("s", 1, 50, 0, 2)] }];
        let handed = commit(&mut retained, more(), SealWhat::All);
        assert_eq!(handed.len(), 1);
        assert!(handed[0].1.is_none(), "the chunk holds bytes from before: read it from the spool");
        // Nothing open now: the next batches are retained from their first byte.
        let handed = commit(&mut retained, more(), SealWhat::All);
        assert_eq!(handed.len(), 1);
        assert_eq!(handed[0].1.as_ref().map(Payload::len), Some(54));
    }

    #[test]
    fn a_stream_over_the_memory_cap_is_no_longer_retained() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut opts = SpoolOptions::new(dir.path().join("spool.db"));
        opts.linger = std::time::Duration::from_secs(3600);
        opts.chunk_target_bytes = 64 << 20;
        let (mut spool, _) = Spool::open(opts).expect("open spool");
        let mut retained = Retained::default();
        let reqs = vec![AppendRequest { batches: vec![batch("s", 1, RETAINED_BYTES_CAP / 2, 0, 3)] }; 3];
        retained.track(&reqs, &spool);
        let report = spool.commit(&reqs, &[], SealWhat::All, 1).expect("commit");
        let outcomes = report.appends.expect("appends");
        let handed = retained.committed(reqs, &outcomes, &report.sealed, &spool);
        assert_eq!((handed.len(), handed[0].1.is_none()), (1, true));
        assert_eq!(retained.bytes(), 0, "nothing is held for an untracked stream");
    }

    #[test]
    fn following_is_refused_when_a_seal_came_after_the_generation_was_taken() {
        let h = Handoff::default();
        let g = h.generation();
        h.sealed(vec![(meta(1, 10), payload(10))]);
        assert!(!h.follow(g), "chunk 1 may not have been seen by the read");
        assert!(matches!(h.next(), Next::Spool));
        assert!(h.follow(h.generation()));
        assert!(matches!(h.next(), Next::CaughtUp));
    }

    fn taken(h: &Handoff) -> Vec<(i64, bool)> {
        std::iter::from_fn(|| match h.next() {
            Next::Chunk(m, p) => Some((m.id.0, p.is_some())),
            _ => None,
        })
        .collect()
    }

    #[test]
    fn a_follower_gets_every_seal_in_order_and_the_bytes_that_fit_its_budget() {
        let h = Handoff::default();
        assert!(h.follow(h.generation()));
        const ROOM: usize = 4 << 20;
        h.set_room(ROOM as u64);
        h.sealed(vec![(meta(1, 10), payload(10)), (meta(2, 0), None)]);
        let big = ROOM - 10;
        h.sealed(vec![(meta(3, big as u64), payload(big)), (meta(4, 1), payload(1))]);
        assert_eq!(h.queued_bytes(), 10 + big);
        assert_eq!(taken(&h), [(1, true), (2, false), (3, true), (4, false)], "chunk 4's bytes did not fit");
        assert!(matches!(h.next(), Next::CaughtUp));
        assert_eq!(h.queued_bytes(), 0);
    }

    #[test]
    fn a_seal_past_the_chunk_cap_ends_the_following() {
        let h = Handoff::default();
        assert!(h.follow(h.generation()));
        h.set_room(u64::MAX);
        h.sealed((1..=QUEUED_CHUNKS_CAP as i64).map(|id| (meta(id, 1), payload(1))).collect());
        assert_eq!(h.queued_bytes(), QUEUED_CHUNKS_CAP);
        h.sealed(vec![(meta(QUEUED_CHUNKS_CAP as i64 + 1, 1), payload(1))]);
        assert!(!h.following());
        assert_eq!(taken(&h).len(), QUEUED_CHUNKS_CAP, "what was queued is still handed over");
        assert!(matches!(h.next(), Next::Spool), "then the uploader reads the spool after the last one");
    }

    #[test]
    fn stopping_empties_the_queue() {
        let h = Handoff::default();
        assert!(h.follow(h.generation()));
        h.set_room(100);
        h.sealed(vec![(meta(1, 10), payload(10))]);
        h.stop();
        assert!(matches!(h.next(), Next::Spool));
        assert_eq!(h.queued_bytes(), 0);
    }
}
