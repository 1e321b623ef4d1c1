//! Chunk compression at send time (`spool.compression = "zstd"`).
//!
//! The spool keeps chunks as the producers sent them, and each is compressed when it is sent:
//!
//! * **Off the runtime's workers.** zstd goes over every byte of a chunk, so compressing one
//!   takes far longer than a runtime task should run without yielding, and would hold up
//!   whatever else the worker runs: intake requests, acks, the connection's driver. Chunks are
//!   compressed on the blocking pool, at most one per core at a time ([`Compressor::new`]; the
//!   permit goes with the work, so a send task dropped mid-compression does not free it early),
//!   so the zstd contexts alive at once, and their memory, stay bounded whatever the number of
//!   chunks in flight.
//! * **Contexts kept.** A zstd context holds match-finding tables sized for its level; one is
//!   kept per permit and reused rather than allocated and freed for every chunk.
//! * **Streams that do not compress are not asked every time.** Images, or files compressed
//!   already, leave zstd nothing to save but still cost it a pass over every byte. After a chunk
//!   of a stream saved less than [`MIN_SAVING`] of its size, that stream's next 1, then 2, 4 ...
//!   up to [`MAX_SKIP`] chunks go out as they are without being tried, and the one after is
//!   tried again: a stream whose data starts to compress is noticed within `MAX_SKIP` chunks,
//!   and one that never does is tried on about one chunk in `MAX_SKIP`.
//!
//! What the chunks cost on the wire is `edge_uploader_upload_wire_bytes_total`, against
//! `edge_uploader_upload_bytes_total` before compression.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use tokio::sync::Semaphore;

use crate::handoff::Payload;
use crate::lock;

/// A chunk that saves less than this share of its size is counted as not compressing.
pub const MIN_SAVING: f64 = 1.0 / 16.0;
/// The most chunks of a stream sent without trying, after a run of chunks that did not compress.
pub const MAX_SKIP: u32 = 64;
/// Streams whose skips are remembered; past it the memory is forgotten (every stream is tried
/// again), so a producer inventing stream names cannot grow it without bound.
const MAX_STREAMS: usize = 4096;

/// What became of one chunk.
#[derive(Debug, PartialEq, Eq)]
pub enum Compressed {
    /// Compressed, and smaller than the chunk: send these bytes.
    Smaller(Vec<u8>),
    /// Tried, and not smaller (or zstd failed): send the chunk as it is.
    NotSmaller,
    /// Not tried: the stream's last chunks did not compress.
    Skipped,
}

/// The agent's chunk compressor: zstd at one level, shared by every send task.
#[derive(Debug)]
pub struct Compressor {
    level: i32,
    permits: Arc<Semaphore>,
    contexts: Mutex<Vec<Context>>,
    streams: Mutex<HashMap<String, Skip>>,
}

/// A zstd compression context (`zstd::bulk::Compressor` is not `Debug`).
struct Context(zstd::bulk::Compressor<'static>);

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("zstd context")
    }
}

/// A stream's chunks to send without trying, and how many the next run will be.
#[derive(Debug, Default, Clone, Copy)]
struct Skip {
    left: u32,
    run: u32,
}

impl Compressor {
    /// zstd at `level`, compressing at most `parallel` chunks at once (at least one).
    pub fn new(level: i32, parallel: usize) -> Self {
        Compressor {
            level,
            permits: Arc::new(Semaphore::new(parallel.max(1))),
            contexts: Mutex::new(Vec::new()),
            streams: Mutex::new(HashMap::new()),
        }
    }

    /// One permit per core the process may run on.
    pub fn per_core(level: i32) -> Self {
        Self::new(level, std::thread::available_parallelism().map_or(1, usize::from))
    }

    /// Compresses a chunk of `stream` on the blocking pool (or skips it, see the module docs).
    pub async fn chunk(self: &Arc<Self>, stream: &str, raw: &Payload) -> Compressed {
        if !self.take_turn(stream) {
            return Compressed::Skipped;
        }
        self.compress(stream, raw).await
    }

    /// Like [`Compressor::chunk`], but tries even a stream whose chunks are being skipped: for
    /// a chunk that cannot be sent uncompressed (over the server's limit).
    pub async fn chunk_always(self: &Arc<Self>, stream: &str, raw: &Payload) -> Compressed {
        self.compress(stream, raw).await
    }

    async fn compress(self: &Arc<Self>, stream: &str, raw: &Payload) -> Compressed {
        // The semaphore is never closed.
        let Ok(permit) = self.permits.clone().acquire_owned().await else { return Compressed::NotSmaller };
        let me = self.clone();
        let parts = raw.clone();
        let stream = stream.to_owned();
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            me.compress_now(&stream, &parts.contiguous())
        })
        .await
        .unwrap_or(Compressed::NotSmaller)
    }

    /// Compresses `raw` on this thread and notes for `stream` whether it compressed.
    fn compress_now(&self, stream: &str, raw: &Bytes) -> Compressed {
        let ctx = lock(&self.contexts).pop();
        let Some(mut ctx) = ctx.or_else(|| zstd::bulk::Compressor::new(self.level).ok().map(Context)) else {
            return Compressed::NotSmaller;
        };
        let out = ctx.0.compress(raw).ok();
        lock(&self.contexts).push(ctx);
        let saved = out.as_ref().map_or(0.0, |c| 1.0 - c.len() as f64 / raw.len().max(1) as f64);
        self.note(stream, saved >= MIN_SAVING);
        match out {
            Some(c) if c.len() < raw.len() => Compressed::Smaller(c),
            _ => Compressed::NotSmaller,
        }
    }

    /// Whether `stream`'s next chunk is to be tried; counts it against the stream's skip if not.
    fn take_turn(&self, stream: &str) -> bool {
        match lock(&self.streams).get_mut(stream) {
            Some(s) if s.left > 0 => {
                s.left -= 1;
                false
            }
            _ => true,
        }
    }

    fn note(&self, stream: &str, compressed: bool) {
        let mut streams = lock(&self.streams);
        if compressed {
            streams.remove(stream);
            return;
        }
        if streams.len() >= MAX_STREAMS && !streams.contains_key(stream) {
            streams.clear();
        }
        let s = streams.entry(stream.to_owned()).or_default();
        s.run = (s.run * 2).clamp(1, MAX_SKIP);
        s.left = s.run;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use edge_proto::Codec;
    use rand::{RngCore, SeedableRng};

    fn readings(n: usize) -> Payload {
        let mut v = Vec::new();
        for i in 0..n {
            v.extend_from_slice(
                format!("{{\"sensor\":\"t-{:02}\",\"value\":{}.{}}}\n", i % 16, 20 + i % 7, i % 10).as_bytes(),
            );
        }
        // Two pieces, as a chunk handed over from memory can be.
        let half = v.len() / 2;
        let b = Bytes::from(v);
        Payload::from_parts(vec![b.slice(..half), b.slice(half..)])
    }

    fn random(seed: u64, len: usize) -> Payload {
        let mut v = vec![0u8; len];
        rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
        Payload::from_parts(vec![Bytes::from(v)])
    }

    #[tokio::test]
    async fn compressible_chunks_shrink_and_decode_to_the_same_bytes() {
        let c = Arc::new(Compressor::new(3, 2));
        let raw = readings(5000);
        let Compressed::Smaller(wire) = c.chunk("s", &raw).await else { panic!("readings did not compress") };
        assert!(wire.len() * 4 < raw.len(), "{} of {}", wire.len(), raw.len());
        let back = edge_proto::records::decode_payload(Codec::Zstd, &wire, raw.len() as u32).expect("decodes");
        assert_eq!(&back[..], &raw.contiguous()[..]);
        // The context is kept for the next chunk.
        assert_eq!(lock(&c.contexts).len(), 1);
        assert!(matches!(c.chunk("s", &raw).await, Compressed::Smaller(_)));
        assert_eq!(lock(&c.contexts).len(), 1);
    }

    #[tokio::test]
    async fn a_stream_that_does_not_compress_is_tried_ever_more_rarely_and_others_are_not_affected() {
        let c = Arc::new(Compressor::new(1, 1));
        let mut tried = Vec::new();
        for i in 0..300u64 {
            match c.chunk("images", &random(i, 4096)).await {
                Compressed::Smaller(_) => panic!("random bytes compressed"),
                Compressed::NotSmaller => tried.push(i),
                Compressed::Skipped => {}
            }
            // Another stream's chunks are tried every time.
            assert!(matches!(c.chunk("readings", &readings(200)).await, Compressed::Smaller(_)));
        }
        // Tried, then skipped 1, 2, 4, ... 64, 64 ...: 0, 2, 5, 10, 19, 36, 69, 134, 199, 264.
        assert_eq!(tried, [0, 2, 5, 10, 19, 36, 69, 134, 199, 264]);
    }

    #[tokio::test]
    async fn a_stream_that_starts_compressing_is_noticed_within_the_longest_skip() {
        let c = Arc::new(Compressor::new(1, 1));
        for i in 0..200 {
            c.chunk("mixed", &random(i, 4096)).await;
        }
        let mut sent_raw = 0;
        while !matches!(c.chunk("mixed", &readings(200)).await, Compressed::Smaller(_)) {
            sent_raw += 1;
            assert!(sent_raw <= MAX_SKIP, "still not tried after {sent_raw} compressible chunks");
        }
        // From then on every chunk of it is tried.
        for _ in 0..5 {
            assert!(matches!(c.chunk("mixed", &readings(200)).await, Compressed::Smaller(_)));
        }
    }

    #[tokio::test]
    async fn a_chunk_that_must_shrink_is_tried_on_a_stream_being_skipped() {
        let c = Arc::new(Compressor::new(1, 1));
        assert!(matches!(c.chunk("mixed", &random(1, 4096)).await, Compressed::NotSmaller));
        // The stream's next chunk would be skipped; one over the server's limit is tried.
        assert!(matches!(c.chunk_always("mixed", &readings(200)).await, Compressed::Smaller(_)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn at_most_one_context_per_permit_whatever_the_chunks_at_once() {
        let c = Arc::new(Compressor::new(3, 2));
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..32 {
            let c = c.clone();
            tasks.spawn(async move { c.chunk(&format!("s{}", i % 4), &readings(3000)).await });
        }
        while let Some(r) = tasks.join_next().await {
            assert!(matches!(r.expect("task"), Compressed::Smaller(_)));
        }
        let kept = lock(&c.contexts).len();
        assert!((1..=2).contains(&kept), "{kept} contexts kept for 2 permits");
    }

    #[test]
    fn the_remembered_streams_are_bounded() {
        let c = Compressor::new(1, 1);
        for i in 0..MAX_STREAMS + 10 {
            c.note(&format!("s{i}"), false);
        }
        assert!(lock(&c.streams).len() <= MAX_STREAMS);
    }
}
