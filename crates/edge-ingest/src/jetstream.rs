//! The JetStream sink: the scale-out alternative to the file store. Every ingest server of a
//! tier writes verified chunks into one NATS JetStream stream, and JetStream itself, not a
//! table of ours, remembers what is stored, so an agent may deliver to any ingest server of the
//! tier, and resend there after a crash or a lost ack, without a record being stored twice.
//!
//! # Messages
//!
//! A chunk becomes one message, or several *parts* when its records do not fit in
//! [`JetStreamOptions::max_message_bytes`]: a chunk is cut only between records, and the cut
//! depends on nothing but the chunk's records and that setting, so a resend cuts the same parts
//! as long as every server of the tier has the same setting, at every moment. A resend cut
//! otherwise would find some subjects taken by parts of other records: it would lose records, or
//! store them twice. So the stream records the setting, in its description
//! (`edge-ingest:max_message_bytes=<bytes>`, written by the server that creates the stream, or
//! added to a stream that lacks it by the first server to set it up), and a server with another
//! setting refuses to start, naming both. (Two servers of different settings that both find the
//! mark missing at the same instant could each write theirs; the stream keeps the last, and the
//! server whose mark was overwritten finds out at its next start.)
//!
//! - Subject: `<prefix>.<device>.<stream>.<spool>.<seq>.<part>`: the device id and stream name
//!   with every byte outside `[A-Za-z0-9_-]` written as `%XX` (so `.` cannot split a token),
//!   the spool id in 32 hex digits, `seq` and `part` (from 1) in decimal. A consumer takes a
//!   device's stream with `<prefix>.<device>.<stream>.>`.
//! - Body: the part's records, decoded (never zstd), each a 4-byte little-endian length and its
//!   bytes (`edge_proto::records`), the layout of `edge-ingest export --format raw`.
//! - Headers: `Nats-Msg-Id` (the subject's tokens after the prefix), `Edge-Device`,
//!   `Edge-Stream`, `Edge-Spool`, `Edge-Seq`, `Edge-Part` (`i/n`), `Edge-Records` and
//!   `Edge-Created-Ms` (the agent's clock when it made the chunk).
//!
//! # Exactly once
//!
//! The stream holds at most one message per subject and refuses a second one
//! (`max_msgs_per_subject = 1`, `discard = new`, `discard_new_per_subject = true`), and every
//! part has a subject of its own, so a part is stored once however often it is published, by
//! whichever ingest server, however long after the first time: not only within JetStream's
//! `Nats-Msg-Id` window, which is time-bounded (2 minutes by default). A publish refused for
//! that reason, or answered `duplicate`, counts as already stored. A chunk is acked `Stored`
//! (or `Duplicate`) only once JetStream has acknowledged every part; any other answer, or none
//! within [`JetStreamOptions::ack_timeout`], makes it `Retry`, and the resend stores only the
//! parts that were missing.
//!
//! The sink creates the stream when it does not exist (file storage, limits retention,
//! [`JetStreamOptions::replicas`]), and refuses to start on an existing stream whose settings
//! would break the above (a work-queue or interest stream deletes what consumers took, and with
//! it the memory of what was stored).
//!
//! What JetStream's acknowledgement means is JetStream's: a stream of one replica on a server
//! with the default `sync_interval` acknowledges before its `fsync`. Run the servers with
//! `sync_interval: always` for the same promise as the file sink (three replicas survive the
//! loss of one server, not a power cut of the site), which the sink cannot see from the client:
//! it warns at set-up about a stream of one replica. A message that leaves the stream (its
//! `max_age`, a purge) takes its dedup with it, and a chunk resent after that is stored again:
//! the sink warns about a `max_age` too. Every publish names the stream it expects
//! (`Nats-Expected-Stream`), and an acknowledgement from another is a failure, so a stream set
//! up by hand over the same subjects cannot take the chunks. A stream deleted while the sink
//! writes is created again, empty, with an error in the log: what it held is gone.
//!
//! A chunk takes one permit per part from a bound over the whole sink
//! (4,096 parts), all at once, and awaits every acknowledgement of a round before
//! it publishes the next: async-nats lets 5,000 acknowledgements be pending, and chunks each
//! holding some while waiting for more would wait for ever.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use async_nats::jetstream::context::{GetStreamErrorKind, PublishError, PublishErrorKind};
use async_nats::jetstream::stream::{Config as StreamConfig, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::{HeaderMap, jetstream};
use bytes::Bytes;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::server::hex;
use crate::store::{ChunkKey, IncomingChunk, PersistOutcome, StatsCell, StoreFailure, StoreStatsView};

/// Bytes reserved for a message's headers (and subject) inside the server's `max_payload`.
pub const HEADER_ROOM: usize = 4096;

/// The server-side reason JetStream gives when `discard_new_per_subject` refuses a message.
const PER_SUBJECT_LIMIT: &str = "maximum messages per subject exceeded";

/// JetStream's error code for "stream not found".
const STREAM_NOT_FOUND: u64 = 10059;

/// How often the sink tries again to set up the stream while NATS is out of reach.
const SETUP_RETRY: Duration = Duration::from_secs(2);

/// Parts published and not yet acknowledged, over every chunk of the sink: below async-nats's
/// bound on acknowledgements pending (5,000 by default), so a publish never waits for one of
/// its slots. Its slot is held by a part's acknowledgement until that is awaited, and chunks
/// each waiting for a slot while holding others' unawaited would wait for ever.
const MAX_PARTS_IN_FLIGHT: u32 = 4096;

/// Where and how the sink writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JetStreamOptions {
    /// NATS server URLs (`nats://host:port`, `tls://host:port`; user and password may be given in
    /// the URL). The client connects to one and fails over to the others.
    pub servers: Vec<String>,
    /// The JetStream stream's name.
    pub stream: String,
    /// First subject tokens; the stream takes `<prefix>.>`.
    pub subject_prefix: String,
    /// Replicas of the stream when the sink creates it (an existing stream keeps its own).
    pub replicas: usize,
    /// Most record bytes in one message; a larger chunk is cut into parts. With its headers a
    /// message must fit in the server's `max_payload`, which the sink checks at start.
    pub max_message_bytes: usize,
    /// How long a publish may wait for JetStream's acknowledgement.
    pub ack_timeout: Duration,
    /// How long start-up waits for NATS before serving anyway (answering `Retry` until it comes).
    pub connect_timeout: Duration,
    /// TLS to NATS: the CA (PEM) that signs the servers' certificates. Set, TLS is required.
    pub tls_ca: Option<PathBuf>,
    /// TLS client certificate and key (PEM) for servers that verify clients.
    pub tls_client: Option<(PathBuf, PathBuf)>,
}

impl Default for JetStreamOptions {
    fn default() -> Self {
        Self {
            servers: vec!["nats://127.0.0.1:4222".into()],
            stream: "EDGE".into(),
            subject_prefix: "edge".into(),
            replicas: 1,
            // NATS's default max_payload (1 MiB) less the header room: the shipped 512 KiB
            // chunk target gives chunks of up to about 1000 KiB, one message each.
            max_message_bytes: (1 << 20) - HEADER_ROOM,
            ack_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            tls_ca: None,
            tls_client: None,
        }
    }
}

/// Why the sink cannot start.
#[derive(Debug, thiserror::Error)]
pub enum JetStreamError {
    /// The options are unusable (a server URL that does not parse).
    #[error("{0}")]
    Options(String),
    /// The stream exists with settings that break exactly-once storage.
    #[error("JetStream stream {stream:?} cannot be used: {problems}")]
    Misconfigured { stream: String, problems: String },
    /// The stream's parts are cut at another `max_message_bytes` than this server's.
    #[error(
        "JetStream stream {stream:?} holds chunks cut into parts of at most {pinned} record bytes (its description \
         says so), but this server's sink.jetstream.max_message_bytes is {configured}: an agent resending a chunk \
         to servers that cut it differently would lose or double records; set max_message_bytes to {pinned} B, \
         or write to a new stream"
    )]
    CutMismatch { stream: String, pinned: usize, configured: usize },
    /// The NATS server's `max_payload` is too small for `max_message_bytes`.
    #[error(
        "the NATS server's max_payload is {server} bytes, less than sink.jetstream.max_message_bytes ({configured}) \
         plus {HEADER_ROOM} bytes for headers; raise max_payload on the server or lower max_message_bytes"
    )]
    MaxPayload { server: usize, configured: usize },
    /// A JetStream request failed (the server answered with an error).
    #[error("JetStream: {0}")]
    Request(String),
}

impl JetStreamError {
    /// Whether retrying later may help (the server was unreachable or answered with an error);
    /// `false` for settings only the operator can change.
    pub fn is_transient(&self) -> bool {
        matches!(self, Self::Request(_))
    }
}

/// The sink: cheap to clone, shared by every chunk task of the server.
#[derive(Debug, Clone)]
pub struct JetStreamSink {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    client: async_nats::Client,
    js: jetstream::Context,
    opts: JetStreamOptions,
    stats: StatsCell,
    /// Set once the stream was found or created with the right settings.
    /// Whether the stream is set up; watched by [`JetStreamSink::ready`].
    ready: watch::Sender<bool>,
    cancel: CancellationToken,
    /// [`MAX_PARTS_IN_FLIGHT`]: a chunk takes one permit per part it publishes at a time, all
    /// at once.
    parts: Arc<tokio::sync::Semaphore>,
    /// The stream was set up once: finding it missing later means it was deleted.
    was_set_up: std::sync::atomic::AtomicBool,
}

impl JetStreamSink {
    /// Connects and sets up the stream.
    ///
    /// When NATS does not answer within [`JetStreamOptions::connect_timeout`], the sink starts
    /// anyway: it answers every chunk "unavailable" (the agents retry) and sets the stream up in
    /// the background as soon as NATS answers. A stream with the wrong settings, or a server
    /// whose `max_payload` is too small, is an error at start.
    pub async fn start(opts: JetStreamOptions) -> Result<Self, JetStreamError> {
        let (addrs, connect) = connect_options(&opts)?;
        let client = connect
            .retry_on_initial_connect()
            .connect(addrs)
            .await
            .map_err(|e| JetStreamError::Request(format!("connecting to {}: {e}", shown(&opts.servers))))?;
        let mut js = jetstream::new(client.clone());
        js.set_timeout(opts.ack_timeout);
        let sink = JetStreamSink {
            inner: Arc::new(Inner {
                client,
                js,
                opts,
                stats: StatsCell::new(),
                ready: watch::Sender::new(false),
                cancel: CancellationToken::new(),
                parts: Arc::new(tokio::sync::Semaphore::new(MAX_PARTS_IN_FLIGHT as usize)),
                was_set_up: std::sync::atomic::AtomicBool::new(false),
            }),
        };
        match tokio::time::timeout(sink.inner.opts.connect_timeout, sink.inner.set_up()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) if !e.is_transient() => return Err(e),
            Ok(Err(e)) => sink.inner.wait_for_nats(e.to_string()),
            Err(_) => sink.inner.wait_for_nats(format!(
                "no answer from NATS at {} within {:?}",
                shown(&sink.inner.opts.servers),
                sink.inner.opts.connect_timeout
            )),
        }
        Ok(sink)
    }

    /// Publishes `chunk` and waits for JetStream's acknowledgements; see the module docs.
    pub async fn persist(&self, chunk: IncomingChunk) -> PersistOutcome {
        let inner = &self.inner;
        inner.stats.queued().fetch_add(1, Ordering::Relaxed);
        let result = inner.publish(&chunk).await;
        inner.stats.queued().fetch_sub(1, Ordering::Relaxed);
        let outcome = match result {
            Ok(true) => PersistOutcome::Stored,
            Ok(false) => PersistOutcome::Duplicate,
            Err(f) => PersistOutcome::Failed(f),
        };
        inner.stats.update(|s| {
            s.batches += 1;
            match &outcome {
                PersistOutcome::Stored => {
                    s.stored += 1;
                    s.chunks += 1;
                    s.bytes += chunk.payload.len() as u64;
                    s.last_failure = None;
                }
                PersistOutcome::Duplicate => {
                    s.duplicates += 1;
                    s.last_failure = None;
                }
                PersistOutcome::Failed(f) => {
                    s.failed += 1;
                    s.failed_commits += 1;
                    s.last_failure = Some(f.clone());
                }
            }
        });
        outcome
    }

    /// Statistics in the file store's shape (for `/metrics` and `/v1/status`).
    pub fn stats_view(&self) -> StoreStatsView {
        self.inner.stats.view()
    }

    /// Whether the stream is set up and the client connected.
    pub fn is_ready(&self) -> bool {
        *self.inner.ready.borrow() && self.inner.client.connection_state() == async_nats::connection::State::Connected
    }

    /// Waits until the stream is set up: at once if [`JetStreamSink::start`] did, else when the
    /// background set-up succeeds (never, if the stream stays misconfigured or the sink is shut
    /// down first). For embedders and
    /// tests that want to know chunks will be published, not answered Retry.
    pub async fn ready(&self) {
        let mut rx = self.inner.ready.subscribe();
        // The sender lives as long as `self`: `wait_for` cannot fail while it is borrowed.
        let _ = rx.wait_for(|&ready| ready).await;
    }

    /// Stops the background set-up, flushes what was published and closes the connection.
    pub async fn shutdown(self) {
        self.inner.cancel.cancel();
        // Not connected: nothing can be flushed, and waiting would only delay the stop.
        if self.inner.client.connection_state() == async_nats::connection::State::Connected
            && tokio::time::timeout(self.inner.opts.ack_timeout, self.inner.client.flush()).await.is_err()
        {
            warn!("NATS flush at shutdown timed out");
        }
        self.inner.stats.set_running(false);
    }
}

impl Inner {
    /// Finds or creates the stream and checks its settings and the server's `max_payload`.
    async fn set_up(&self) -> Result<(), JetStreamError> {
        let opts = &self.opts;
        let config = match self.js.get_stream(&opts.stream).await {
            Ok(stream) => stream.cached_info().config.clone(),
            Err(e) => match e.kind() {
                GetStreamErrorKind::JetStream(js) if js.error_code().0 == STREAM_NOT_FOUND => {
                    let created = self
                        .js
                        .create_stream(wanted_config(opts))
                        .await
                        .map_err(|e| JetStreamError::Request(format!("creating stream {:?}: {e}", opts.stream)))?;
                    if self.was_set_up.load(Ordering::Relaxed) {
                        tracing::error!(stream = %opts.stream, "the JetStream stream was deleted while this server wrote to it, and is created again, empty: the chunks it held are gone, and an agent resending one of them has it stored again");
                    } else {
                        info!(stream = %opts.stream, subjects = ?created.cached_info().config.subjects, "JetStream stream created");
                    }
                    created.cached_info().config.clone()
                }
                _ => return Err(JetStreamError::Request(format!("looking up stream {:?}: {e}", opts.stream))),
            },
        };
        let problems = config_problems(&config, opts);
        if !problems.is_empty() {
            return Err(JetStreamError::Misconfigured { stream: opts.stream.clone(), problems: problems.join("; ") });
        }
        let caveats = config_caveats(&config);
        match pinned_cut(config.description.as_deref()) {
            Some(Ok(pinned)) if pinned == opts.max_message_bytes => {}
            Some(Ok(pinned)) => {
                return Err(JetStreamError::CutMismatch {
                    stream: opts.stream.clone(),
                    pinned,
                    configured: opts.max_message_bytes,
                });
            }
            Some(Err(mark)) => {
                return Err(JetStreamError::Misconfigured {
                    stream: opts.stream.clone(),
                    problems: format!("its description's {mark:?} does not give a number of bytes"),
                });
            }
            None => {
                // A stream made by hand or by an older edge-ingest: record this server's cut.
                let mark = cut_mark(opts.max_message_bytes);
                let mut pinned = config;
                pinned.description = Some(match pinned.description.as_deref() {
                    Some(d) if !d.is_empty() => format!("{d} ({mark})"),
                    _ => mark.clone(),
                });
                self.js.update_stream(&pinned).await.map_err(|e| {
                    JetStreamError::Request(format!("recording {mark} in stream {:?}: {e}", opts.stream))
                })?;
                info!(stream = %opts.stream, %mark, "JetStream stream now records how chunks are cut into parts");
            }
        }
        let server = self.client.server_info().max_payload;
        if server < opts.max_message_bytes.saturating_add(HEADER_ROOM) {
            return Err(JetStreamError::MaxPayload { server, configured: opts.max_message_bytes });
        }
        // A message carries each record with its length prefix.
        let default_record = edge_proto::DEFAULT_MAX_RECORD_BYTES as usize;
        let needed = default_record + edge_proto::records::RECORD_OVERHEAD + HEADER_ROOM;
        if server < needed {
            // A record is never cut: a chunk holding one larger than the room is answered Retry
            // (nothing lost, the sink reported unhealthy) until `max_payload` is raised.
            let largest = server.saturating_sub(HEADER_ROOM + edge_proto::records::RECORD_OVERHEAD);
            warn!(
                max_payload = server,
                largest_record = largest,
                "the NATS server's max_payload leaves room for records of up to {largest} bytes, and agents accept records of up to {default_record} bytes by default (intake.max_record_bytes): a chunk holding a larger record is answered Retry until max_payload is raised to {needed} bytes or more",
            );
        }
        // Once per process, once set up: not again at every retry of a set-up that fails later
        // on, nor after every NATS outage.
        if !self.was_set_up.swap(true, Ordering::Relaxed) {
            for caveat in caveats {
                warn!(stream = %opts.stream, "{caveat}");
            }
        }
        self.ready.send_replace(true);
        info!(stream = %opts.stream, prefix = %opts.subject_prefix, "JetStream sink ready");
        Ok(())
    }

    /// Marks the sink unavailable and retries [`Inner::set_up`] in the background until it
    /// works (or the sink shuts down).
    fn wait_for_nats(self: &Arc<Self>, why: String) {
        warn!(reason = %why, "JetStream sink not ready; chunks are answered Retry until it is");
        self.stats.update(|s| s.last_failure = Some(StoreFailure::Unavailable(why)));
        let inner = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    () = inner.cancel.cancelled() => return,
                    () = tokio::time::sleep(SETUP_RETRY) => {}
                }
                match inner.set_up().await {
                    Ok(()) => {
                        inner.stats.update(|s| s.last_failure = None);
                        return;
                    }
                    Err(e) => {
                        if !e.is_transient() {
                            tracing::error!(error = %e, "JetStream sink cannot start; fix the stream or the server");
                        }
                        inner.stats.update(|s| s.last_failure = Some(StoreFailure::Unavailable(e.to_string())));
                    }
                }
            }
        });
    }

    /// Publishes every part of `chunk`. `Ok(true)`: at least one part was new; `Ok(false)`:
    /// all of them were stored before.
    async fn publish(self: &Arc<Self>, chunk: &IncomingChunk) -> Result<bool, StoreFailure> {
        if !*self.ready.borrow() {
            return Err(StoreFailure::Unavailable(format!(
                "JetStream stream {:?} is not set up yet",
                self.opts.stream
            )));
        }
        if self.client.connection_state() != async_nats::connection::State::Connected {
            return Err(StoreFailure::Unavailable("not connected to NATS".into()));
        }
        if chunk.payload.crc32c() != chunk.checksum {
            return Err(StoreFailure::Rejected(format!(
                "payload CRC32C {:#010x} does not match the announced {:#010x}",
                chunk.payload.crc32c(),
                chunk.checksum
            )));
        }
        let raw: Bytes = match edge_proto::records::decode_payload(chunk.codec, &chunk.payload, chunk.raw_len) {
            Ok(Cow::Borrowed(_)) => chunk.payload.to_bytes(),
            Ok(Cow::Owned(v)) => Bytes::from(v),
            Err(e) => return Err(StoreFailure::Rejected(format!("payload does not decode: {e}"))),
        };
        let parts = split_parts(&raw, self.opts.max_message_bytes)
            .map_err(|e| StoreFailure::Rejected(format!("records do not parse: {e}")))?;
        let server_max = self.client.server_info().max_payload;
        if let Some(big) = parts.iter().find(|p| p.range.len() + HEADER_ROOM > server_max) {
            return Err(StoreFailure::Unavailable(format!(
                "a record of {} bytes does not fit in the NATS server's max_payload ({server_max} bytes); raise it",
                big.range.len()
            )));
        }
        let key = &chunk.key;
        let spool = hex(&key.spool);
        let id = message_id(key);
        let total = parts.len();
        // Every permit a round of parts needs, taken at once: a chunk never holds some while
        // waiting for more. A chunk of more parts than the bound goes in rounds.
        let round = total.min(MAX_PARTS_IN_FLIGHT as usize);
        let permits = u32::try_from(round).unwrap_or(MAX_PARTS_IN_FLIGHT);
        let _permits = tokio::time::timeout(self.opts.ack_timeout, self.parts.acquire_many(permits))
            .await
            .map_err(|_| {
                StoreFailure::Unavailable(format!("{MAX_PARTS_IN_FLIGHT} parts await JetStream's acknowledgement"))
            })?
            .map_err(|_| StoreFailure::Unavailable("the JetStream sink is closing".into()))?;
        let mut new = false;
        let mut failure = None;
        let mut acks = Vec::with_capacity(round);
        for (i, part) in parts.into_iter().enumerate() {
            let n = i + 1;
            let msg_id = format!("{id}.{n}");
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", msg_id.as_str());
            // Stored in our stream or refused: never acknowledged by another stream that took
            // the subject over (one made by hand under another name).
            headers.insert("Nats-Expected-Stream", self.opts.stream.as_str());
            headers.insert("Edge-Device", key.device.as_str());
            headers.insert("Edge-Stream", key.stream.as_str());
            headers.insert("Edge-Spool", spool.as_str());
            headers.insert("Edge-Seq", key.seq.to_string().as_str());
            headers.insert("Edge-Part", format!("{n}/{total}").as_str());
            headers.insert("Edge-Records", part.records.to_string().as_str());
            headers.insert("Edge-Created-Ms", chunk.created_ms.to_string().as_str());
            let subject = format!("{}.{msg_id}", self.opts.subject_prefix);
            match self.js.publish_with_headers(subject, headers, raw.slice(part.range)).await {
                Ok(ack) => acks.push(ack),
                Err(e) => {
                    failure.get_or_insert(StoreFailure::Unavailable(format!("publishing to JetStream: {e}")));
                    break;
                }
            }
            if acks.len() == round || n == total {
                self.await_acks(&mut acks, &mut new, &mut failure).await;
                if failure.is_some() {
                    break;
                }
            }
        }
        // Every acknowledgement is awaited, also after a failure, so none is left pending.
        self.await_acks(&mut acks, &mut new, &mut failure).await;
        match failure {
            Some(f) => Err(f),
            None => Ok(new),
        }
    }

    /// Awaits every acknowledgement in `acks`: `new` when a part was new; the first failure.
    async fn await_acks(
        self: &Arc<Self>,
        acks: &mut Vec<jetstream::context::PublishAckFuture>,
        new: &mut bool,
        failure: &mut Option<StoreFailure>,
    ) {
        for ack in acks.drain(..) {
            match ack.await {
                Ok(ack) if ack.stream != self.opts.stream => {
                    failure.get_or_insert(StoreFailure::Unavailable(format!(
                        "JetStream acknowledged a part for stream {:?}, not {:?}",
                        ack.stream, self.opts.stream
                    )));
                }
                Ok(ack) => *new |= !ack.duplicate,
                Err(e) if stored_before(&e) => {}
                Err(e) => {
                    if e.kind() == PublishErrorKind::StreamNotFound {
                        // Deleted under us: set it up again before the next chunk.
                        if self.ready.send_replace(false) {
                            self.wait_for_nats(format!("stream {:?} disappeared", self.opts.stream));
                        }
                    }
                    failure.get_or_insert(StoreFailure::Unavailable(format!("JetStream did not store a part: {e}")));
                }
            }
        }
    }
}

/// The server addresses and the connection options (TLS) of `opts`, shared by the sink and
/// [`lookup`].
fn connect_options(
    opts: &JetStreamOptions,
) -> Result<(Vec<async_nats::ServerAddr>, async_nats::ConnectOptions), JetStreamError> {
    let addrs = opts
        .servers
        .iter()
        .map(|s| s.parse::<async_nats::ServerAddr>().map_err(|e| JetStreamError::Options(format!("{s:?}: {e}"))))
        .collect::<Result<Vec<_>, _>>()?;
    let mut connect = async_nats::ConnectOptions::new().name("edge-ingest").connection_timeout(opts.connect_timeout);
    if let Some(ca) = &opts.tls_ca {
        connect = connect.add_root_certificates(ca.clone()).require_tls(true);
    }
    if let Some((cert, key)) = &opts.tls_client {
        connect = connect.add_client_certificate(cert.clone(), key.clone());
    }
    Ok((addrs, connect))
}

/// The subject tokens of a chunk after the prefix, without the part: `<device>.<stream>.<spool>.<seq>`.
fn message_id(key: &ChunkKey) -> String {
    chunk_tokens(&key.device, &key.stream, &hex(&key.spool), key.seq)
}

/// `<device>.<stream>.<spool>.<seq>` with the names escaped and `spool` as given (32 hex digits,
/// or `*` in a filter): the one place the subject layout is written, for [`message_id`] and
/// [`lookup`].
fn chunk_tokens(device: &str, stream: &str, spool: &str, seq: u64) -> String {
    format!("{}.{}.{spool}.{seq}", token(device), token(stream))
}

/// What the stream holds of one chunk ([`lookup`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Held {
    /// Parts the chunk was cut into, as its stored parts' `Edge-Part` headers say.
    pub parts: usize,
    /// The numbers of the parts stored (from 1), ascending.
    pub found: Vec<usize>,
    /// Records in the stored parts, as their `Edge-Records` headers say; `None` when a part
    /// has no such header (a message this sink did not publish).
    pub records: Option<u64>,
}

impl Held {
    /// Whether every part of the chunk is stored.
    pub fn whole(&self) -> bool {
        self.parts > 0 && self.found.len() == self.parts
    }
}

/// Which parts of the chunk `(device, stream, spool, seq)` the stream of `opts` holds, by spool
/// id (32 hex digits, ascending; every spool's chunk of that seq when `spool` is `None`; none
/// when nothing is stored): a read, for `edge-ingest stored`. Connects once, within
/// `opts.connect_timeout`, and does not wait for NATS beyond that.
pub async fn lookup(
    opts: &JetStreamOptions,
    device: &str,
    stream: &str,
    spool: Option<&[u8; 16]>,
    seq: u64,
) -> Result<Vec<(String, Held)>, JetStreamError> {
    use futures_util::TryStreamExt as _;
    let (addrs, connect) = connect_options(opts)?;
    let client = connect
        .connect(addrs)
        .await
        .map_err(|e| JetStreamError::Request(format!("connecting to {}: {e}", shown(&opts.servers))))?;
    let mut js = jetstream::new(client);
    js.set_timeout(opts.ack_timeout);
    let js_stream = js
        .get_stream(&opts.stream)
        .await
        .map_err(|e| JetStreamError::Request(format!("stream {:?}: {e}", opts.stream)))?;
    let spool_token = spool.map_or_else(|| "*".to_owned(), |s| hex(s));
    let filter = format!("{}.{}.*", opts.subject_prefix, chunk_tokens(device, stream, &spool_token, seq));
    let subjects: Vec<(String, usize)> = js_stream
        .info_with_subjects(&filter)
        .await
        .map_err(|e| JetStreamError::Request(format!("listing the subjects {filter}: {e}")))?
        .try_collect()
        .await
        .map_err(|e| JetStreamError::Request(format!("listing the subjects {filter}: {e}")))?;
    let mut by_spool: std::collections::BTreeMap<String, Held> = std::collections::BTreeMap::new();
    for (subject, _) in subjects {
        // `<prefix>.<device>.<stream>.<spool>.<seq>.<part>`: the tokens are escaped, so the
        // last three are the spool, the seq and the part.
        let mut tail = subject.rsplitn(4, '.');
        let (Some(part), Some(_seq), Some(spool)) = (tail.next(), tail.next(), tail.next()) else {
            continue;
        };
        let Ok(n) = part.parse::<usize>() else {
            continue;
        };
        let msg = js_stream
            .get_last_raw_message_by_subject(&subject)
            .await
            .map_err(|e| JetStreamError::Request(format!("reading {subject}: {e}")))?;
        let header = |name: &str| msg.headers.get(name).map(|v| v.as_str().to_owned());
        let total = header("Edge-Part").and_then(|p| p.split_once('/').and_then(|(_, t)| t.parse::<usize>().ok()));
        let Some(total) = total else {
            return Err(JetStreamError::Request(format!("{subject} has no Edge-Part header of the form n/total")));
        };
        let held = by_spool.entry(spool.to_owned()).or_insert(Held { parts: 0, found: Vec::new(), records: Some(0) });
        held.parts = held.parts.max(total);
        let records = header("Edge-Records").and_then(|r| r.parse::<u64>().ok());
        held.records = held.records.zip(records).map(|(a, b)| a + b);
        held.found.push(n);
    }
    Ok(by_spool
        .into_iter()
        .map(|(spool, mut held)| {
            held.found.sort_unstable();
            (spool, held)
        })
        .collect())
}

/// Whether a publish was refused because the stream already holds a message on its subject.
fn stored_before(e: &PublishError) -> bool {
    e.kind() == PublishErrorKind::Other
        && std::error::Error::source(e)
            .and_then(|s| s.downcast_ref::<jetstream::Error>())
            .is_some_and(|js| js.to_string().contains(PER_SUBJECT_LIMIT))
}

/// The stream the sink creates when none exists.
fn wanted_config(opts: &JetStreamOptions) -> StreamConfig {
    StreamConfig {
        name: opts.stream.clone(),
        description: Some(format!(
            "edge-uploader chunks, written by edge-ingest, one message per chunk part ({})",
            cut_mark(opts.max_message_bytes)
        )),
        subjects: vec![format!("{}.>", opts.subject_prefix)],
        storage: StorageType::File,
        retention: RetentionPolicy::Limits,
        discard: DiscardPolicy::New,
        discard_new_per_subject: true,
        max_messages_per_subject: 1,
        num_replicas: opts.replicas,
        ..StreamConfig::default()
    }
}

/// What a stream's description says about how chunks are cut into parts.
const CUT_MARK: &str = "edge-ingest:max_message_bytes=";

/// The mark for chunks cut at `max_message_bytes`.
fn cut_mark(max_message_bytes: usize) -> String {
    format!("{CUT_MARK}{max_message_bytes}")
}

/// The cut a stream's description records: `None` without a mark, `Err(mark)` for a mark whose
/// number does not parse.
fn pinned_cut(description: Option<&str>) -> Option<Result<usize, String>> {
    let (_, after) = description?.split_once(CUT_MARK)?;
    let digits = after.split(|c: char| !c.is_ascii_digit()).next().unwrap_or("");
    Some(digits.parse().map_err(|_| format!("{CUT_MARK}{}", after.chars().take(20).collect::<String>())))
}

/// What in an existing stream's settings breaks exactly-once storage.
fn config_problems(config: &StreamConfig, opts: &JetStreamOptions) -> Vec<String> {
    let mut problems = Vec::new();
    let wanted = format!("{}.>", opts.subject_prefix);
    if !config.subjects.iter().any(|s| *s == wanted || s == ">") {
        problems.push(format!("its subjects {:?} do not include {wanted:?}", config.subjects));
    }
    if config.max_messages_per_subject != 1 {
        problems.push(format!("max_msgs_per_subject is {}, must be 1", config.max_messages_per_subject));
    }
    if config.discard != DiscardPolicy::New || !config.discard_new_per_subject {
        problems.push("discard must be \"new\" with discard_new_per_subject true".into());
    }
    if config.retention != RetentionPolicy::Limits {
        problems.push(format!("retention is {:?}, must be limits", config.retention));
    }
    if config.storage != StorageType::File {
        problems.push("storage is memory, must be file".into());
    }
    problems
}

/// What in an existing stream's settings weakens the promise without breaking exactly-once
/// storage outright: logged as a warning at each set-up.
fn config_caveats(config: &StreamConfig) -> Vec<String> {
    let mut caveats = Vec::new();
    if config.num_replicas <= 1 {
        caveats.push(
            "the stream has one replica: unless its NATS server runs with `sync_interval: always` (which the \
             sink cannot see), JetStream acknowledges a part before its fsync, and a power cut of that server \
             can lose chunks the agents have deleted"
                .to_owned(),
        );
    }
    if !config.max_age.is_zero() {
        caveats.push(format!(
            "the stream's max_age is {:?}: a message that ages out takes its deduplication with it, and a chunk \
             resent after that (an agent offline longer) is stored again",
            config.max_age
        ));
    }
    caveats
}

/// One message's share of a chunk: a range of whole records.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Part {
    range: std::ops::Range<usize>,
    records: u32,
}

/// Cuts a raw payload into parts of at most `max` bytes, between records; a record larger
/// than `max` is a part of its own.
fn split_parts(raw: &[u8], max: usize) -> Result<Vec<Part>, edge_proto::records::RecordError> {
    let mut parts = Vec::new();
    let mut start = 0;
    let mut end = 0;
    let mut records = 0u32;
    for record in edge_proto::records::RecordIter::new(raw) {
        let len = edge_proto::records::framed_len(record?);
        if records > 0 && end - start + len > max {
            parts.push(Part { range: start..end, records });
            start = end;
            records = 0;
        }
        end += len;
        records += 1;
    }
    if records > 0 || parts.is_empty() {
        parts.push(Part { range: start..end, records });
    }
    Ok(parts)
}

/// The server URLs as logs show them: without credentials, comma-separated.
pub fn shown(servers: &[String]) -> String {
    servers.iter().map(|s| without_credentials(s)).collect::<Vec<_>>().join(", ")
}

/// A server URL without the user and password it may carry, for status and logs.
pub fn without_credentials(url: &str) -> String {
    match (url.split_once("://"), url.rsplit_once('@')) {
        (Some((scheme, _)), Some((_, host))) => format!("{scheme}://{host}"),
        (None, Some((_, host))) => host.to_owned(),
        _ => url.to_owned(),
    }
}

/// A name as one subject token: bytes outside `[A-Za-z0-9_-]` as `%XX`.
pub fn token(name: &str) -> Cow<'_, str> {
    let plain = |b: u8| b.is_ascii_alphanumeric() || b == b'_' || b == b'-';
    if name.bytes().all(plain) {
        return Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len() + 8);
    for b in name.bytes() {
        if plain(b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use edge_proto::records::encode_record;

    fn payload(sizes: &[usize]) -> Vec<u8> {
        let mut out = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            encode_record(&mut out, &vec![u8::try_from(i % 251).expect("small"); n]);
        }
        out
    }

    #[test]
    fn a_chunk_that_fits_is_one_part() {
        let raw = payload(&[10, 20, 30]);
        assert_eq!(split_parts(&raw, 1 << 20).expect("parses"), vec![Part { range: 0..raw.len(), records: 3 }]);
    }

    #[test]
    fn parts_are_cut_between_records_and_cover_the_chunk() {
        let raw = payload(&[100, 100, 100, 100, 100]);
        // 104 bytes per framed record, at most two per part.
        let parts = split_parts(&raw, 250).expect("parses");
        assert_eq!(parts.iter().map(|p| p.records).collect::<Vec<_>>(), vec![2, 2, 1]);
        assert_eq!(parts[0].range, 0..208);
        assert_eq!(parts[2].range.end, raw.len());
        assert!(parts.windows(2).all(|w| w[0].range.end == w[1].range.start));
    }

    #[test]
    fn a_record_over_the_limit_is_a_part_of_its_own() {
        let raw = payload(&[10, 500, 10]);
        let parts = split_parts(&raw, 100).expect("parses");
        assert_eq!(parts.iter().map(|p| p.records).collect::<Vec<_>>(), vec![1, 1, 1]);
        assert_eq!(parts[1].range.len(), 504);
    }

    #[test]
    fn a_truncated_payload_is_an_error() {
        let mut raw = payload(&[10, 10]);
        raw.pop();
        assert!(split_parts(&raw, 1 << 20).is_err());
    }

    #[test]
    fn the_cut_a_description_records_is_read_back() {
        let ours = wanted_config(&JetStreamOptions { max_message_bytes: 4096, ..JetStreamOptions::default() });
        assert_eq!(pinned_cut(ours.description.as_deref()), Some(Ok(4096)));
        assert_eq!(pinned_cut(Some("made by hand (edge-ingest:max_message_bytes=1044480)")), Some(Ok(1_044_480)));
        assert_eq!(pinned_cut(Some("made by hand")), None);
        assert_eq!(pinned_cut(None), None);
        assert!(matches!(pinned_cut(Some("edge-ingest:max_message_bytes=lots")), Some(Err(_))));
    }

    #[test]
    fn credentials_are_left_out_of_server_urls_shown() {
        assert_eq!(without_credentials("nats://u:secret@nats-1:4222"), "nats://nats-1:4222");
        assert_eq!(without_credentials("u:secret@nats-1:4222"), "nats-1:4222");
        assert_eq!(without_credentials("tls://nats-1:4222"), "tls://nats-1:4222");
    }

    #[test]
    fn tokens_escape_everything_a_subject_treats_specially() {
        assert_eq!(token("gw-01_a"), "gw-01_a");
        assert_eq!(token("site.a"), "site%2Ea");
        assert_eq!(token("a b*>%"), "a%20b%2A%3E%25");
        // Distinct names stay distinct.
        assert_ne!(token("a.b"), token("a%2Eb"));
    }

    #[test]
    fn an_existing_stream_is_checked_setting_by_setting() {
        let opts = JetStreamOptions::default();
        assert!(config_problems(&wanted_config(&opts), &opts).is_empty());
        let loose = StreamConfig {
            subjects: vec!["other.>".into()],
            retention: RetentionPolicy::WorkQueue,
            ..StreamConfig::default()
        };
        let problems = config_problems(&loose, &opts);
        assert_eq!(problems.len(), 4, "{problems:?}");
        assert!(problems[0].contains("edge.>"), "{problems:?}");
    }

    #[test]
    fn one_replica_and_a_max_age_are_warned_of() {
        let opts = JetStreamOptions { replicas: 3, ..JetStreamOptions::default() };
        assert_eq!(config_caveats(&wanted_config(&opts)), Vec::<String>::new());
        let one = wanted_config(&JetStreamOptions::default());
        let caveats = config_caveats(&one);
        assert_eq!(caveats.len(), 1, "{caveats:?}");
        assert!(caveats[0].contains("sync_interval: always"), "{caveats:?}");
        let aging = StreamConfig { max_age: Duration::from_secs(86_400), num_replicas: 3, ..one };
        let caveats = config_caveats(&aging);
        assert_eq!(caveats.len(), 1, "{caveats:?}");
        assert!(caveats[0].contains("max_age is 86400s"), "{caveats:?}");
    }
}
