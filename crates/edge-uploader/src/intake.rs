//! Local intake: HTTP/1.1 on a Unix socket (and optionally on a loopback TCP port).
//!
//! `POST /v1/streams/{stream}` with `application/x-ndjson` (one record per non-empty line) or
//! `application/octet-stream` (the body is one record). The answer is 200 with
//! `{"records": N, "bytes": B}` only after the records are committed to the spool. Errors carry
//! a JSON body `{"error": "...", "detail": "..."}`:
//!
//! | status | when |
//! |---|---|
//! | 400 | bad stream name, empty body, body not valid for its type |
//! | 408 | the body sent nothing for `request_idle_timeout` |
//! | 413 | a record over `max_record_bytes`, or a body over `max_request_bytes` |
//! | 415 | a content type other than the two above |
//! | 422 | the stream is new and the spool knows `spool.max_streams` already |
//! | 503 | the agent is shutting down, or a body without a length gave way (see [`RequestBudget`]); the latter with `Retry-After` |
//! | 507 | the spool is full (policy `reject`) or its disk is; with `Retry-After` |
//!
//! A rejected request stores none of its records: the request is one all-or-nothing append.
//!
//! Memory across requests is bounded whatever their number: before its body is read, a request
//! claims its size from one [`RequestBudget`] (`intake.request_pending_total_bytes`; a body
//! without a length claims what it has sent, as it arrives) and holds the claim until its
//! answer, so the bodies being read, framed and committed together are at most the budget, or
//! one request larger than it running alone. A request waiting for room
//! reads nothing: its producer is held back by the socket. A body that stops arriving for
//! `intake.request_idle_timeout` is refused and its claim ends, so the requests waiting never
//! wait on a producer that stalled.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::extract::{DefaultBodyLimit, Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use edge_proto::StreamName;
use edge_proto::records::{RECORD_OVERHEAD, encode_record};
use edge_spool::{AppendRequest, Batch};
use http_body_util::BodyExt;
use hyper::body::Body as _;
use serde_json::json;

use crate::spool_task::{AppendFailure, SpoolHandle};

/// Seconds a producer is told to wait when the spool is full.
const RETRY_AFTER_SECS: &str = "5";

/// Intake limits and wiring.
#[derive(Debug)]
pub struct Intake {
    pub spool: SpoolHandle,
    pub max_record_bytes: usize,
    pub max_request_bytes: usize,
    /// Records a record-stream connection gathers while its previous append commits
    /// (`intake.stream_pending_bytes`).
    pub stream_pending_bytes: usize,
    /// What all record-stream connections together gather and commit
    /// (`intake.stream_pending_total_bytes`).
    pub stream_budget: crate::record_stream::PendingBudget,
    /// What all HTTP requests being read, framed or committed claim together
    /// (`intake.request_pending_total_bytes`).
    pub request_budget: RequestBudget,
    /// How long a request's body may send nothing before the request is refused, and how long
    /// an HTTP connection may take to send a request's head (`intake.request_idle_timeout`).
    pub request_idle_timeout: std::time::Duration,
    /// The producer connections all intake sockets serve at once (`intake.max_connections`).
    pub connections: ConnectionLimit,
    /// Target size of one batch (the spool's chunk target), so large requests split into chunks.
    pub batch_target: usize,
    /// Cleared when shutdown begins: requests then get 503.
    pub accepting: AtomicBool,
    pub counters: Arc<IntakeCounters>,
    /// Upload state, reported by `GET /v1/status`.
    pub upload: Arc<crate::uploader::UploadCounters>,
    /// The settings a reload can change, as now in force, reported by `GET /v1/status`.
    pub settings: std::sync::Mutex<serde_json::Value>,
    /// Counter history for the rates `GET /v1/status` reports.
    pub rates: crate::status::RateWindow,
    /// The machine id and spool id of the machine the spool file was copied from, when its open
    /// at this start found it had been (`edge_spool::HostCheck::Moved`).
    pub spool_copied_from: Option<(String, edge_spool::SpoolId)>,
}

impl Intake {
    /// The counters the rate window tracks: intake records and bytes, acked records and bytes.
    pub fn rate_counters(&self) -> [u64; 4] {
        [
            self.counters.records_total.load(Ordering::Relaxed),
            self.counters.bytes_total.load(Ordering::Relaxed),
            self.upload.records_acked_total.load(Ordering::Relaxed),
            self.upload.bytes_acked(),
        ]
    }

    /// Records the reloadable settings in force.
    pub fn set_settings(&self, config: &crate::config::Config) {
        let policy = match config.spool.full_policy {
            edge_spool::FullPolicy::Reject => "reject",
            edge_spool::FullPolicy::DropOldest => "drop_oldest",
        };
        *crate::lock(&self.settings) = json!({
            "log_level": config.log_level,
            "spool_max_bytes": config.spool.max_bytes,
            "spool_full_policy": policy,
            "spool_max_streams": config.spool.max_streams,
            "max_in_flight": config.upload.max_in_flight,
            "max_in_flight_bytes": config.upload.max_in_flight_bytes,
        });
    }
}

/// What intake accepted and refused, for `GET /v1/status`, metrics and the demo.
#[derive(Debug, Default)]
pub struct IntakeCounters {
    pub records_total: AtomicU64,
    pub bytes_total: AtomicU64,
    pub requests_rejected_total: AtomicU64,
    /// Memory the record-stream connections hold now: the capacity of their receive buffers
    /// and of the batch buffers of the records they gather or are committing.
    pub stream_buffer_bytes: AtomicU64,
    /// The highest [`stream_buffer_bytes`](Self::stream_buffer_bytes) since start.
    pub stream_buffer_peak_bytes: AtomicU64,
    /// Memory the HTTP requests hold now: the capacity of the buffers their records are framed
    /// into, from framing to the end of their commit.
    pub request_buffer_bytes: AtomicU64,
    /// The highest [`request_buffer_bytes`](Self::request_buffer_bytes) since start.
    pub request_buffer_peak_bytes: AtomicU64,
    /// HTTP requests waiting for room in [`Intake::request_budget`]: before their body is read,
    /// or, sent without a length, for more of it.
    pub requests_waiting: AtomicU64,
    /// Producer connections open now, on all intake sockets.
    pub connections: AtomicU64,
    /// Times a connection an intake socket accepted found [`Intake::connections`] full and
    /// waited, the socket accepting nothing more, until a connection closed.
    pub connection_limit_waits_total: AtomicU64,
    /// The same events by stream and by reason, for `/metrics`.
    pub metrics: crate::metrics::IntakeMetrics,
}

impl IntakeCounters {
    /// Counts a committed request: the totals here and the per-stream counters in one place.
    pub(crate) fn accepted(&self, stream: &str, records: u64, bytes: u64) {
        self.records_total.fetch_add(records, Ordering::Relaxed);
        self.bytes_total.fetch_add(bytes, Ordering::Relaxed);
        self.metrics.accepted(stream, records, bytes);
    }

    /// Counts a refused request.
    pub(crate) fn rejected(&self, reason: Rejection) {
        self.requests_rejected_total.fetch_add(1, Ordering::Relaxed);
        self.metrics.rejected(reason);
    }

    /// A record-stream connection's held memory changed from `old` to `new` bytes.
    pub(crate) fn stream_buffer(&self, old: usize, new: usize) {
        held_changed(&self.stream_buffer_bytes, &self.stream_buffer_peak_bytes, old, new);
    }

    /// An HTTP request's held memory changed from `old` to `new` bytes.
    pub(crate) fn request_buffer(&self, old: usize, new: usize) {
        held_changed(&self.request_buffer_bytes, &self.request_buffer_peak_bytes, old, new);
    }
}

fn held_changed(now: &AtomicU64, peak: &AtomicU64, old: usize, new: usize) {
    if new >= old {
        let added = (new - old) as u64;
        let after = now.fetch_add(added, Ordering::Relaxed) + added;
        peak.fetch_max(after, Ordering::Relaxed);
    } else {
        now.fetch_sub((old - new) as u64, Ordering::Relaxed);
    }
}

/// The default of `intake.request_pending_total_bytes`: room for a few large bodies at once, as
/// the record stream's gathering budget. A sweep of 2 to 64 MiB (BENCHMARKS.md, "Done and tried
/// since the `a54f6d1` run", 37) found no load it held back at 8 MiB, while 64 producers of
/// 4 MiB requests stored 1.4 times as fast as at 64 MiB, at 42 MiB peak RSS instead of 102.
pub const REQUEST_PENDING_TOTAL: usize = 8 << 20;

/// What a body sent without a `Content-Length` claims first (the size of its first batch
/// buffer); it claims more as it arrives, doubling, up to `intake.max_request_bytes`.
pub const CHUNKED_FIRST_CLAIM: usize = 64 << 10;

/// What the HTTP requests being read, framed or committed claim together, in body bytes
/// (`intake.request_pending_total_bytes`).
///
/// A request with a `Content-Length` claims its whole body before it reads any of it (never
/// more than the budget: a request larger than the budget waits for all of it and runs alone).
/// A body sent without one claims [`CHUNKED_FIRST_CLAIM`] and then, before it frames what
/// would take it past its claim, twice its claim or what it has read, whichever is more (at
/// most `intake.max_request_bytes` and the budget): so a producer streaming a body holds the
/// room of what it has sent, not of the largest body allowed. Claims are admitted in the order
/// they came, and one that finds no room waits unread.
///
/// Every wait ends. A request admitted waits only for its producer and the spool, unless it
/// needs more room: such growing claims are served before any new request, the oldest first.
/// Should every claim holding room be waiting to grow, none would end, so the youngest of them
/// gives way: its room goes back, and its request is refused with 503 and `Retry-After`,
/// storing none of its records. Since the oldest is never the one that gives way, it always
/// goes on, and a claim alone can always grow.
///
/// The memory a claim stands for is its body framed: the records' bytes and four bytes of
/// framing each ([`IntakeCounters::request_buffer_bytes`] counts it), at most two and a half
/// times the body for NDJSON of one-byte lines, about the body itself for records of 100 bytes
/// or more.
#[derive(Debug)]
pub struct RequestBudget {
    cap: usize,
    state: std::sync::Mutex<BudgetState>,
    /// Woken whenever the budget admits, grows or refuses a claim; each waiter then looks at its
    /// own.
    changed: tokio::sync::Notify,
}

#[derive(Debug, Default)]
struct BudgetState {
    used: usize,
    peak: usize,
    /// The next claim's ticket: tickets are handed out in the order requests come, so the
    /// lowest is the oldest.
    next: u64,
    claims: std::collections::HashMap<u64, ClaimState>,
    /// Tickets waiting to be admitted, oldest first.
    queue: std::collections::VecDeque<u64>,
    /// Tickets holding room and waiting for more.
    growing: std::collections::BTreeSet<u64>,
    /// Claims holding room and not waiting: each of them ends on its own.
    running: usize,
}

#[derive(Debug)]
struct ClaimState {
    held: usize,
    phase: Phase,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting to be admitted with this many bytes.
    Queued(usize),
    Running,
    /// Holding room and waiting for this many bytes more.
    Growing(usize),
    /// Gave way to an older claim; it holds nothing.
    GaveWay,
}

impl BudgetState {
    /// Admits and grows what now fits, growing claims first, and makes the youngest growing
    /// claim give way while all claims holding room wait to grow. Whether anything changed.
    fn dispatch(&mut self, cap: usize) -> bool {
        let mut changed = false;
        loop {
            if let Some(&oldest) = self.growing.first() {
                let Some(c) = self.claims.get_mut(&oldest) else { unreachable!("a growing ticket has a claim") };
                let Phase::Growing(more) = c.phase else { unreachable!("a growing ticket is growing") };
                // A claim alone grows whatever it asks (it never asks past the budget).
                if self.used + more <= cap || self.used == c.held {
                    c.held += more;
                    c.phase = Phase::Running;
                    self.used += more;
                    self.running += 1;
                    self.growing.remove(&oldest);
                } else if self.running == 0 && self.growing.len() > 1 {
                    let Some(youngest) = self.growing.pop_last() else { unreachable!("two growing") };
                    let Some(c) = self.claims.get_mut(&youngest) else { unreachable!("a growing ticket has a claim") };
                    self.used -= c.held;
                    c.held = 0;
                    c.phase = Phase::GaveWay;
                } else {
                    // Claims running will end and give room back; nothing new is admitted
                    // before the growing claims have theirs.
                    break;
                }
            } else if let Some(&first) = self.queue.front() {
                let Some(c) = self.claims.get_mut(&first) else { unreachable!("a queued ticket has a claim") };
                let Phase::Queued(bytes) = c.phase else { unreachable!("a queued ticket is queued") };
                if self.used + bytes > cap {
                    break;
                }
                c.held = bytes;
                c.phase = Phase::Running;
                self.used += bytes;
                self.running += 1;
                self.queue.pop_front();
            } else {
                break;
            }
            changed = true;
        }
        self.peak = self.peak.max(self.used);
        changed
    }
}

/// A request's share of [`RequestBudget`], given back when it is dropped.
#[derive(Debug)]
pub(crate) struct Claim<'a> {
    budget: &'a RequestBudget,
    ticket: u64,
    /// What it holds (it changes only in [`Claim::grow_to`]).
    held: usize,
}

/// A claim that had to give way to older claims (see [`RequestBudget`]).
#[derive(Debug)]
pub(crate) struct GaveWay;

impl RequestBudget {
    /// A budget of `cap` bytes.
    pub fn new(cap: usize) -> Self {
        RequestBudget { cap, state: Default::default(), changed: tokio::sync::Notify::new() }
    }

    /// The budget in bytes.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Bytes claimed now.
    pub fn used(&self) -> usize {
        crate::lock(&self.state).used
    }

    /// The most bytes claimed at once since start.
    pub fn peak(&self) -> usize {
        crate::lock(&self.state).peak
    }

    /// Claims `bytes` (at most the budget), waiting for room first come, first served; counted
    /// in `counters.requests_waiting` while it waits.
    pub(crate) async fn claim(&self, bytes: usize, counters: &IntakeCounters) -> Claim<'_> {
        let bytes = bytes.min(self.cap);
        let (claim, admitted) = {
            let mut st = crate::lock(&self.state);
            let ticket = st.next;
            st.next += 1;
            st.claims.insert(ticket, ClaimState { held: 0, phase: Phase::Queued(bytes) });
            st.queue.push_back(ticket);
            // Every earlier change was dispatched, so this can admit only the new claim, and
            // only if nothing was waiting: no one else to wake.
            st.dispatch(self.cap);
            let admitted = st.claims.get(&ticket).is_some_and(|c| c.phase == Phase::Running);
            (Claim { budget: self, ticket, held: bytes }, admitted)
        };
        if !admitted {
            // Dropped while waiting (the producer went away), the claim leaves the queue.
            let admitted = self.wait(claim.ticket, counters).await;
            debug_assert!(admitted, "a claim that holds nothing never gives way");
        }
        claim
    }

    /// Waits until `ticket` runs (true) or gave way (false), counted in
    /// `counters.requests_waiting` if it has to wait at all.
    async fn wait(&self, ticket: u64, counters: &IntakeCounters) -> bool {
        let mut waiting = None;
        loop {
            let changed = self.changed.notified();
            tokio::pin!(changed);
            // Registered before the look at the state, so no change between the two is missed.
            changed.as_mut().enable();
            match crate::lock(&self.state).claims.get(&ticket).map(|c| c.phase) {
                Some(Phase::Running) | None => return true,
                Some(Phase::GaveWay) => return false,
                Some(Phase::Queued(_) | Phase::Growing(_)) => {}
            }
            waiting.get_or_insert_with(|| Waiting::new(&counters.requests_waiting));
            changed.await;
        }
    }
}

/// Counts a request waiting for room, down again on every way out, a producer that goes away
/// while waiting too.
struct Waiting<'a>(&'a AtomicU64);

impl<'a> Waiting<'a> {
    fn new(n: &'a AtomicU64) -> Self {
        n.fetch_add(1, Ordering::Relaxed);
        Waiting(n)
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Claim<'_> {
    /// The bytes this claim holds.
    pub(crate) fn held(&self) -> usize {
        self.held
    }

    /// Grows the claim to `total` bytes (at most the budget), waiting for room as
    /// [`RequestBudget`] says; `Err(GaveWay)` if it had to give way, holding nothing then.
    pub(crate) async fn grow_to(&mut self, total: usize, counters: &IntakeCounters) -> Result<(), GaveWay> {
        let budget = self.budget;
        let more = total.min(budget.cap).saturating_sub(self.held);
        if more == 0 {
            return Ok(());
        }
        let grown = {
            let mut st = crate::lock(&budget.state);
            let Some(c) = st.claims.get_mut(&self.ticket) else {
                unreachable!("a claim is in the state until dropped")
            };
            debug_assert_eq!(c.phase, Phase::Running, "only a running claim grows");
            c.phase = Phase::Growing(more);
            st.running -= 1;
            st.growing.insert(self.ticket);
            if st.dispatch(budget.cap) {
                budget.changed.notify_waiters();
            }
            st.claims.get(&self.ticket).is_some_and(|c| c.phase == Phase::Running)
        };
        if grown || budget.wait(self.ticket, counters).await {
            self.held += more;
            Ok(())
        } else {
            self.held = 0;
            Err(GaveWay)
        }
    }
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.budget.release(self.ticket);
    }
}

impl Claim<'_> {
    /// The claim, now held by `intake` (whose [`Intake::request_budget`] it is in) rather than
    /// borrowed: for the spool thread to keep with the request until it answers it
    /// ([`crate::spool_task::SpoolHandle::submit`]), whether or not the producer still waits.
    pub(crate) fn into_owned(self, intake: Arc<Intake>) -> OwnedClaim {
        debug_assert!(std::ptr::eq(self.budget, &intake.request_budget), "a claim of this intake's budget");
        let ticket = self.ticket;
        std::mem::forget(self);
        OwnedClaim { intake, ticket }
    }
}

/// A [`Claim`] that owns its way to the budget; released when dropped.
pub(crate) struct OwnedClaim {
    intake: Arc<Intake>,
    ticket: u64,
}

impl Drop for OwnedClaim {
    fn drop(&mut self) {
        self.intake.request_budget.release(self.ticket);
    }
}

impl RequestBudget {
    /// Gives back what the claim `ticket` holds, and takes it out of line.
    fn release(&self, ticket: u64) {
        let mut st = crate::lock(&self.state);
        let Some(c) = st.claims.remove(&ticket) else { return };
        st.used -= c.held;
        match c.phase {
            Phase::Queued(_) => st.queue.retain(|&t| t != ticket),
            Phase::Running => st.running -= 1,
            Phase::Growing(_) => {
                st.growing.remove(&ticket);
            }
            Phase::GaveWay => {}
        }
        if st.dispatch(self.cap) {
            self.changed.notify_waiters();
        }
    }
}

/// The default of `intake.max_connections`.
pub const MAX_CONNECTIONS: u32 = 128;

/// The producer connections all intake sockets serve at once (`intake.max_connections`): HTTP
/// and record stream, Unix and TCP together.
///
/// A connection a socket accepts is served once it has a slot, so at the limit each socket
/// holds one accepted connection unread and accepts nothing more until a connection closes:
/// new producers wait in the socket's listen backlog (their connect or their first request
/// does not complete) and nothing is refused. What every connection holds
/// however quiet it is (a record-stream connection's 64 KiB receive buffer, an HTTP
/// connection's read buffer, a task and a descriptor) is so bounded by the limit, and the
/// descriptors never run out for the spool's own files. An HTTP connection gives its slot back
/// once it sends no request head for `intake.request_idle_timeout`; a record-stream connection
/// keeps it while it is open, since a producer at a sensor's pace is quiet most of the time.
#[derive(Debug)]
pub struct ConnectionLimit {
    max: u32,
    slots: Arc<tokio::sync::Semaphore>,
    /// When the limit was last logged, so a producer that keeps it full logs once a minute.
    warned: std::sync::Mutex<Option<std::time::Instant>>,
}

impl ConnectionLimit {
    /// How often a limit that stays reached is logged again.
    const WARN_EVERY: std::time::Duration = std::time::Duration::from_secs(60);

    /// A limit of `max` connections (at least one).
    pub fn new(max: u32) -> Self {
        let max = max.max(1);
        ConnectionLimit {
            max,
            slots: Arc::new(tokio::sync::Semaphore::new(max as usize)),
            warned: std::sync::Mutex::new(None),
        }
    }

    /// A slot for a connection a socket accepted, waiting (first come, first served across the
    /// sockets) while every slot is taken; counted in `counters.connections` until
    /// the slot is dropped.
    async fn slot(&self, counters: &Arc<IntakeCounters>) -> ConnectionSlot {
        let permit = match self.slots.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                counters.connection_limit_waits_total.fetch_add(1, Ordering::Relaxed);
                self.warn(counters);
                // The semaphore is never closed, so the wait ends only with a slot.
                self.slots.clone().acquire_owned().await.expect("the connection limit is never closed")
            }
        };
        counters.connections.fetch_add(1, Ordering::Relaxed);
        ConnectionSlot { _permit: permit, counters: counters.clone() }
    }

    /// The next connection `listener` accepts, with its slot; `None` once `cancel` fires.
    /// Accept errors are handled inside `Listener::accept` (logged, and a pause when out of
    /// descriptors), as for `axum::serve`.
    pub(crate) async fn accept<L: axum::serve::Listener>(
        &self,
        listener: &mut L,
        counters: &Arc<IntakeCounters>,
        cancel: &tokio_util::sync::CancellationToken,
    ) -> Option<(L::Io, ConnectionSlot)> {
        let (io, _) = tokio::select! {
            () = cancel.cancelled() => return None,
            accepted = listener.accept() => accepted,
        };
        tokio::select! {
            () = cancel.cancelled() => None,
            slot = self.slot(counters) => Some((io, slot)),
        }
    }

    fn warn(&self, counters: &IntakeCounters) {
        let now = std::time::Instant::now();
        let mut warned = crate::lock(&self.warned);
        if warned.is_none_or(|at| now.duration_since(at) >= Self::WARN_EVERY) {
            *warned = Some(now);
            tracing::warn!(
                max_connections = self.max,
                open = counters.connections.load(Ordering::Relaxed),
                "intake.max_connections reached: new producer connections wait in the socket's backlog until one closes"
            );
        }
    }
}

/// A connection's slot in [`ConnectionLimit`], given back when the connection ends.
#[derive(Debug)]
pub(crate) struct ConnectionSlot {
    _permit: tokio::sync::OwnedSemaphorePermit,
    counters: Arc<IntakeCounters>,
}

impl Drop for ConnectionSlot {
    fn drop(&mut self) {
        self.counters.connections.fetch_sub(1, Ordering::Relaxed);
    }
}

/// One connection's or request's share of a held-memory gauge of [`IntakeCounters`], given
/// back when it is dropped.
pub(crate) struct HeldShare {
    counters: Arc<IntakeCounters>,
    /// [`IntakeCounters::stream_buffer`] or [`IntakeCounters::request_buffer`].
    changed: fn(&IntakeCounters, usize, usize),
    bytes: usize,
}

impl HeldShare {
    /// A share of [`IntakeCounters::stream_buffer_bytes`].
    pub(crate) fn stream(counters: Arc<IntakeCounters>) -> Self {
        HeldShare { counters, changed: IntakeCounters::stream_buffer, bytes: 0 }
    }

    /// A share of [`IntakeCounters::request_buffer_bytes`].
    pub(crate) fn request(counters: Arc<IntakeCounters>) -> Self {
        HeldShare { counters, changed: IntakeCounters::request_buffer, bytes: 0 }
    }

    pub(crate) fn set(&mut self, bytes: usize) {
        if bytes != self.bytes {
            (self.changed)(&self.counters, self.bytes, bytes);
            self.bytes = bytes;
        }
    }
}

impl Drop for HeldShare {
    fn drop(&mut self) {
        self.set(0);
    }
}

/// Why a request was refused: the `error` code of the answer, and the `reason` label of
/// `edge_uploader_intake_rejected_total` (a closed set, so the label stays bounded).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    ShuttingDown,
    BadStreamName,
    UnsupportedContentType,
    RequestTooLarge,
    BadBody,
    EmptyBody,
    RecordTooLarge,
    SpoolFull,
    TooManyStreams,
    StorageError,
    BodyTimeout,
    RequestBudgetFull,
}

impl Rejection {
    /// Every reason, so the metric can show each one at 0 before it first happens.
    pub const ALL: [Rejection; 12] = [
        Rejection::ShuttingDown,
        Rejection::BadStreamName,
        Rejection::UnsupportedContentType,
        Rejection::RequestTooLarge,
        Rejection::BadBody,
        Rejection::EmptyBody,
        Rejection::RecordTooLarge,
        Rejection::SpoolFull,
        Rejection::TooManyStreams,
        Rejection::StorageError,
        Rejection::BodyTimeout,
        Rejection::RequestBudgetFull,
    ];

    /// The code as it appears in the JSON answer and in the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Rejection::ShuttingDown => "shutting_down",
            Rejection::BadStreamName => "bad_stream_name",
            Rejection::UnsupportedContentType => "unsupported_content_type",
            Rejection::RequestTooLarge => "request_too_large",
            Rejection::BadBody => "bad_body",
            Rejection::EmptyBody => "empty_body",
            Rejection::RecordTooLarge => "record_too_large",
            Rejection::SpoolFull => "spool_full",
            Rejection::TooManyStreams => "too_many_streams",
            Rejection::StorageError => "storage_error",
            Rejection::BodyTimeout => "body_timeout",
            Rejection::RequestBudgetFull => "request_budget_full",
        }
    }
}

/// The HTTP routes.
pub fn router(intake: Arc<Intake>) -> Router {
    Router::new()
        .route("/v1/streams/{stream}", post(post_records))
        .route("/v1/status", get(status))
        .layer(DefaultBodyLimit::disable())
        .with_state(intake)
}

/// `GET /v1/status` alone, for the metrics listener: it answers there whatever the intake
/// sockets' connection slots are doing, so `edge-uploader status` can still see the agent when
/// every `intake.max_connections` slot is taken. It does not keep the intake alive (the
/// metrics listener outlives the agent's shutdown, whose spool thread ends only once the
/// intake is gone): once it is, it answers 503.
pub fn status_router(intake: &Arc<Intake>) -> Router {
    let intake = Arc::downgrade(intake);
    Router::new().route(
        "/v1/status",
        get(move || {
            let intake = intake.upgrade();
            async move {
                match intake {
                    Some(intake) => axum::Json(status_json(&intake)).into_response(),
                    None => error(StatusCode::SERVICE_UNAVAILABLE, Rejection::ShuttingDown, "the agent has stopped"),
                }
            }
        }),
    )
}

/// Read buffer of an HTTP connection at most, in bytes (hyper's `max_buf_size`; its minimum is
/// 8 KiB).
pub const HTTP_READ_BUFFER: usize = 64 << 10;

/// Serves the HTTP routes on `listener` until `cancel` fires, then lets each connection finish
/// the request it is on (and close instead of keeping alive) and returns once all have closed.
/// Each connection takes a slot of [`Intake::connections`] before it is served, and is closed
/// when it sends no complete request head for [`Intake::request_idle_timeout`] (from its start,
/// or from the answer before), so a quiet or stalled producer never keeps its slot for good.
///
/// hyper directly rather than `axum::serve`, for the read buffer: hyper's default lets a
/// connection's buffer grow to about 410 KiB, and growing it while it holds unread bytes
/// doubled it, to 0.8 MiB per connection that sends large requests (a heap profile with 1 MiB
/// requests from 8 producers: 7 of the agent's 22 MB). The body is framed as it arrives, so a
/// larger buffer only means fewer, larger reads.
pub async fn serve<L: axum::serve::Listener>(
    mut listener: L,
    intake: Arc<Intake>,
    cancel: tokio_util::sync::CancellationToken,
) {
    let router = router(intake.clone());
    let connections = tokio_util::task::TaskTracker::new();
    while let Some((io, slot)) = intake.connections.accept(&mut listener, &intake.counters, &cancel).await {
        let service = hyper_util::service::TowerToHyperService::new(router.clone());
        let cancel = cancel.clone();
        let head_timeout = intake.request_idle_timeout;
        connections.spawn(async move {
            let _slot = slot;
            let mut builder = hyper::server::conn::http1::Builder::new();
            builder
                .max_buf_size(HTTP_READ_BUFFER)
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(head_timeout);
            let conn = builder.serve_connection(hyper_util::rt::TokioIo::new(io), service);
            tokio::pin!(conn);
            let result = tokio::select! {
                r = conn.as_mut() => r,
                () = cancel.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(error = %e, "intake connection ended with an error");
            }
        });
    }
    connections.close();
    connections.wait().await;
}

/// Every refusal goes through here; the reason rides along in the response extensions so
/// `post_records` can count it.
fn error(status: StatusCode, reason: Rejection, detail: impl Into<String>) -> Response {
    let mut resp = (status, axum::Json(json!({ "error": reason.as_str(), "detail": detail.into() }))).into_response();
    resp.extensions_mut().insert(reason);
    resp
}

/// `GET /v1/status`: spool and upload state as JSON (`"version": 1`).
async fn status(State(intake): State<Arc<Intake>>) -> Response {
    axum::Json(status_json(&intake)).into_response()
}

/// The status document shared by the HTTP route and the CLI.
pub fn status_json(intake: &Intake) -> serde_json::Value {
    let s = intake.spool.stats();
    let u = &intake.upload;
    let (p50, p99) = {
        let l = crate::lock(&u.latency_ms);
        (l.quantile(0.5), l.quantile(0.99))
    };
    let last_error = crate::lock(&u.last_error).clone();
    let settings = crate::lock(&intake.settings).clone();
    let session = crate::lock(&u.session).clone();
    let now = crate::status::now_ms();
    let rates = intake.rates.rates(now, intake.rate_counters());
    let rtt = u.metrics.rtt_seconds();
    json!({
        "version": 1,
        "connection": {
            "server": session.server,
            "remote": session.remote,
            "since_ms": (session.since_ms > 0).then_some(session.since_ms),
            "rtt_ms": (rtt > 0.0).then_some(rtt * 1000.0),
            "congestion_controller": session.congestion_controller,
        },
        "rates": rates.map(|r| json!({
            "window_s": r.window_s,
            "intake_records_per_s": r.per_s[0],
            "intake_bytes_per_s": r.per_s[1],
            "acked_records_per_s": r.per_s[2],
            "acked_bytes_per_s": r.per_s[3],
        })),
        "drain_eta_s": rates.and_then(|r| crate::status::drain_eta_s(s.total_bytes, &r)),
        "settings": settings,
        "spool": {
            "id": intake.spool.id().to_string(),
            "copied_from": intake.spool_copied_from.as_ref().map(|(machine, id)| json!({
                "machine_id": machine, "spool_id": id.to_string(),
            })),
            "sealed_chunks": s.sealed_chunks,
            "sealed_bytes": s.sealed_bytes,
            "open_bytes": s.open_bytes,
            "open_records": s.open_records,
            "total_bytes": s.total_bytes,
            "disk_bytes": intake.spool.disk_bytes(),
            "oldest_ms": s.oldest_ms,
            "dropped_records": s.dropped_records,
            "dropped_chunks": s.dropped_chunks,
            "quarantined_chunks": s.quarantined_chunks,
            "busy": intake.spool.busy().map(|(kind, d)| json!({"doing": kind.doing(), "ms": d.as_millis() as u64})),
            "streams": s.streams.iter().map(|st| json!({
                "name": st.name, "next_seq": st.next_seq, "sealed_chunks": st.sealed_chunks,
                "bytes": st.bytes, "oldest_ms": st.oldest_ms,
            })).collect::<Vec<_>>(),
        },
        "intake": {
            "records_total": intake.counters.records_total.load(Ordering::Relaxed),
            "bytes_total": intake.counters.bytes_total.load(Ordering::Relaxed),
            "requests_rejected_total": intake.counters.requests_rejected_total.load(Ordering::Relaxed),
        },
        "upload": {
            "connected": u.connected.load(Ordering::Relaxed),
            "connects_total": u.connects_total.load(Ordering::Relaxed),
            "connect_attempts_total": u.connect_attempts_total.load(Ordering::Relaxed),
            "superseded_total": u.superseded_total.load(Ordering::Relaxed),
            "last_superseded_ms": Some(u.last_superseded_ms.load(Ordering::Relaxed)).filter(|&ms| ms > 0),
            "spool_rekeyed": crate::lock(&u.rekeyed).as_ref().map(|(old, at)| json!({"old_id": old, "at_ms": at})),
            "network_wakeups_total": u.network_wakeups_total.load(Ordering::Relaxed),
            "probes_sent_total": u.probes_sent_total.load(Ordering::Relaxed),
            "probe_wakeups_total": u.probe_wakeups_total.load(Ordering::Relaxed),
            "floors_sent_total": u.floors_sent_total.load(Ordering::Relaxed),
            "in_flight": u.in_flight.load(Ordering::Relaxed),
            "chunks_acked_total": u.chunks_acked(),
            "chunks_duplicate_total": u.duplicate.chunks(),
            "chunks_retry_total": u.retry.chunks(),
            "chunks_rejected_total": u.rejected.chunks(),
            "records_acked_total": u.records_acked_total.load(Ordering::Relaxed),
            "bytes_acked_total": u.bytes_acked(),
            "wire_bytes_total": u.wire_bytes_total.load(Ordering::Relaxed),
            "latency_p50_ms": p50,
            "latency_p99_ms": p99,
            "last_error": last_error,
        },
    })
}

async fn post_records(
    State(intake): State<Arc<Intake>>,
    Path(stream): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let resp = handle(&intake, &stream, &headers, body).await;
    if let Some(&reason) = resp.extensions().get::<Rejection>() {
        intake.counters.rejected(reason);
    }
    resp
}

async fn handle(intake: &Arc<Intake>, stream: &str, headers: &HeaderMap, body: Body) -> Response {
    if !intake.accepting.load(Ordering::Acquire) {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            Rejection::ShuttingDown,
            "the agent is shutting down; retry later",
        );
    }
    let stream = match StreamName::new(stream) {
        Ok(s) => s,
        Err(e) => return error(StatusCode::BAD_REQUEST, Rejection::BadStreamName, format!("{stream:?}: {e}")),
    };
    let ctype = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("application/x-ndjson");
    let mime = ctype.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let ndjson = match mime.as_str() {
        "application/x-ndjson" | "application/ndjson" | "application/jsonl" => true,
        "application/octet-stream" => false,
        other => {
            return error(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                Rejection::UnsupportedContentType,
                format!("{other:?}; use application/x-ndjson or application/octet-stream"),
            );
        }
    };
    // A body declared too large is refused before any of it is read or waits for room.
    let declared = body.size_hint().exact().map(|n| usize::try_from(n).unwrap_or(usize::MAX));
    if declared.is_some_and(|n| n > intake.max_request_bytes) {
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::RequestTooLarge,
            format!("body exceeds intake.max_request_bytes = {}", intake.max_request_bytes),
        );
    }
    // Held to the answer: the claim covers the body from its first byte read to its commit. A
    // body without a length claims a first step and more as it arrives.
    let first = declared.unwrap_or(CHUNKED_FIRST_CLAIM.min(intake.max_request_bytes));
    let mut claim = intake.request_budget.claim(first, &intake.counters).await;
    let mut read = 0usize;
    // The body is framed into batches as it arrives: a large request is held once, framed, and
    // never as a whole raw body beside its framed copy.
    let mut framer = Framer::new(stream.as_str(), ndjson, intake.max_record_bytes, intake.batch_target);
    if let Some(n) = declared {
        framer.expect(n);
    }
    let mut held = HeldShare::request(intake.counters.clone());
    let mut body = http_body_util::Limited::new(body, intake.max_request_bytes);
    loop {
        // A producer that stops sending its body holds its claim: it is refused after the idle
        // timeout, so those waiting for room wait on no stalled producer for longer.
        let Ok(next) = tokio::time::timeout(intake.request_idle_timeout, body.frame()).await else {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                Rejection::BodyTimeout,
                format!(
                    "the body sent nothing for {} (intake.request_idle_timeout)",
                    humantime::format_duration(intake.request_idle_timeout)
                ),
            );
        };
        let Some(frame) = next else { break };
        let frame = match frame {
            Ok(f) => f,
            Err(e) => {
                if e.downcast_ref::<http_body_util::LengthLimitError>().is_some() {
                    return error(
                        StatusCode::PAYLOAD_TOO_LARGE,
                        Rejection::RequestTooLarge,
                        format!("body exceeds intake.max_request_bytes = {}", intake.max_request_bytes),
                    );
                }
                return error(StatusCode::BAD_REQUEST, Rejection::BadBody, format!("could not read the body: {e}"));
            }
        };
        let Ok(data) = frame.into_data() else { continue };
        read = read.saturating_add(data.len());
        if declared.is_none() && read > claim.held() {
            let total = read.max(claim.held().saturating_mul(2)).min(intake.max_request_bytes);
            if claim.grow_to(total, &intake.counters).await.is_err() {
                let mut resp = error(
                    StatusCode::SERVICE_UNAVAILABLE,
                    Rejection::RequestBudgetFull,
                    "bodies sent without a Content-Length together outgrew intake.request_pending_total_bytes \
                     and this one gave way to an older one; none of its records were stored; retry, \
                     or send a Content-Length",
                );
                resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
                return resp;
            }
        }
        if let Err(e) = framer.push(&data) {
            return framer_error(&e, intake.max_record_bytes);
        }
        held.set(framer.held());
    }
    let (batches, n, payload_bytes) = match framer.finish() {
        Ok(done) => done,
        Err(e) => return framer_error(&e, intake.max_record_bytes),
    };
    // The last line, framed by `finish`, may have started a buffer of its own.
    held.set(batches.iter().map(|b| b.data.capacity()).sum());

    // The claim and the gauge's share go with the request: hyper drops this future when its
    // producer goes away, but the buffers wait in the spool thread's queue until it answers.
    // The gauge's share first (a tuple drops in order): the claim's room may be taken at once.
    let charge = (held, claim.into_owned(Arc::clone(intake)));
    match intake.spool.submit(AppendRequest { batches }, charge).await {
        Ok(()) => {
            intake.counters.accepted(stream.as_str(), n, payload_bytes);
            (StatusCode::OK, axum::Json(json!({ "records": n, "bytes": payload_bytes }))).into_response()
        }
        Err(f @ (AppendFailure::Full | AppendFailure::DiskFull)) => {
            let mut resp = error(StatusCode::INSUFFICIENT_STORAGE, Rejection::SpoolFull, f.to_string());
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static(RETRY_AFTER_SECS));
            resp
        }
        Err(f @ AppendFailure::TooManyStreams) => {
            error(StatusCode::UNPROCESSABLE_ENTITY, Rejection::TooManyStreams, format!("stream {stream:?}: {f}"))
        }
        Err(AppendFailure::Closed) => {
            error(StatusCode::SERVICE_UNAVAILABLE, Rejection::ShuttingDown, "the spool is closed")
        }
        Err(f @ AppendFailure::Storage(_)) => {
            error(StatusCode::INTERNAL_SERVER_ERROR, Rejection::StorageError, f.to_string())
        }
    }
}

fn framer_error(e: &FrameError, max_record_bytes: usize) -> Response {
    match *e {
        FrameError::Empty => error(StatusCode::BAD_REQUEST, Rejection::EmptyBody, "the request carries no records"),
        FrameError::RecordTooLarge { index, len } => error(
            StatusCode::PAYLOAD_TOO_LARGE,
            Rejection::RecordTooLarge,
            format!("record {index} is {len} bytes; intake.max_record_bytes = {max_record_bytes}"),
        ),
    }
}

/// Why a body could not be framed.
#[derive(Debug, PartialEq, Eq)]
enum FrameError {
    /// No record in the body (empty, or NDJSON with only blank lines).
    Empty,
    /// Record `index` (from 1) is over the limit; `len` is its length, or as much of it as was
    /// read before the request was refused.
    RecordTooLarge { index: u64, len: usize },
}

/// The capacity of an append's next batch buffer, after one of `last` bytes (0: the first):
/// 64 KiB, then twice the last, never over `batch_target`.
///
/// A batch's buffer is not grown once it holds records (see [`fits`]): growing a buffer of
/// hundreds of KiB copies it, and in a profile of the record-stream intake those copies were
/// as many samples as framing the records themselves. A full buffer is closed as a batch and
/// the next one starts, larger, so a large append takes few batches; the spool stores the
/// batches one commit appends to one stream as one row whatever their number.
pub(crate) fn next_batch_capacity(last: usize, batch_target: usize) -> usize {
    const FIRST: usize = 64 << 10;
    if last == 0 { FIRST } else { last.saturating_mul(2) }.min(batch_target).max(1)
}

/// Whether a framed record of `framed` bytes goes into the batch buffer `cur` without growing
/// it or taking the batch over `batch_target`.
pub(crate) fn fits(cur: &Vec<u8>, framed: usize, batch_target: usize) -> bool {
    let after = cur.len().saturating_add(framed);
    after <= batch_target && after <= cur.capacity()
}

/// Frames a request body into spool batches of about `batch_target` bytes as its pieces arrive.
///
/// NDJSON: every non-empty line is a record (a trailing `\r` is not part of it); a line may span
/// any number of pieces. Octet-stream: the whole body is one record, in one batch whatever its
/// size. A record over `max_record`
/// is refused as soon as it is seen to be, without reading the rest of the body.
struct Framer {
    stream: String,
    ndjson: bool,
    max_record: usize,
    batch_target: usize,
    batches: Vec<Batch>,
    /// The capacity of the buffers in `batches`.
    batches_capacity: usize,
    cur: Vec<u8>,
    cur_records: u32,
    /// The capacity given to the last batch's buffer (see [`next_batch_capacity`]).
    last_capacity: usize,
    records: u64,
    payload_bytes: u64,
    /// NDJSON: the start of a line whose end has not arrived yet.
    partial: Vec<u8>,
    /// NDJSON: the body's declared length, if it has one, and the bytes of it whose lines were
    /// framed (or skipped) so far, newlines included: what is left of the body then sizes
    /// the next batch buffer (see [`Framer::rest_framed`]).
    declared: Option<usize>,
    lines_bytes: usize,
}

impl Framer {
    fn new(stream: &str, ndjson: bool, max_record: usize, batch_target: usize) -> Self {
        Framer {
            stream: stream.to_owned(),
            ndjson,
            max_record,
            batch_target,
            batches: Vec::new(),
            batches_capacity: 0,
            cur: Vec::new(),
            cur_records: 0,
            last_capacity: 0,
            records: 0,
            payload_bytes: 0,
            partial: Vec::new(),
            declared: None,
            lines_bytes: 0,
        }
    }

    /// The body will be `len` bytes: an octet-stream record's buffer is sized for it at once
    /// rather than grown (and copied) as the body arrives, and an NDJSON body's batch buffers
    /// for what is left of it (see [`Framer::rest_framed`]) rather than by the doubling steps
    /// of a body of unknown length.
    fn expect(&mut self, len: usize) {
        if self.ndjson {
            self.declared = Some(len);
        } else if self.cur.capacity() == 0 {
            self.cur.reserve_exact(RECORD_OVERHEAD + len.min(self.max_record + 1));
        }
    }

    /// NDJSON with a declared length: about what the rest of the body takes framed, from the
    /// line of `line_len` bytes being framed now on. Its lines are taken to be as long as this
    /// one, each framed three bytes longer than it is with its newline (a length prefix for
    /// the newline), and one more byte for a last line without one. A guess too small only
    /// closes the buffer early: the next one is sized again from where the body is then.
    fn rest_framed(&self, line_len: usize) -> Option<usize> {
        let rest = self.declared?.saturating_sub(self.lines_bytes);
        let lines = rest.div_ceil(line_len.saturating_add(1)).max(1);
        Some(rest.saturating_add(lines.saturating_mul(RECORD_OVERHEAD - 1)).saturating_add(1))
    }

    /// The memory the framed records and the unfinished line take: the capacity of their buffers.
    fn held(&self) -> usize {
        self.batches_capacity + self.cur.capacity() + self.partial.capacity()
    }

    fn push(&mut self, mut piece: &[u8]) -> Result<(), FrameError> {
        if !self.ndjson {
            // The one record is built in place behind its length prefix, patched at the end.
            if self.cur.is_empty() {
                self.cur.extend_from_slice(&[0; RECORD_OVERHEAD]);
            }
            self.cur.extend_from_slice(piece);
            let len = self.cur.len() - RECORD_OVERHEAD;
            if len > self.max_record {
                return Err(FrameError::RecordTooLarge { index: 1, len });
            }
            return Ok(());
        }
        while let Some(end) = memchr::memchr(b'\n', piece) {
            if self.partial.is_empty() {
                self.line(&piece[..end])?;
            } else {
                let mut line = std::mem::take(&mut self.partial);
                line.extend_from_slice(&piece[..end]);
                self.line(&line)?;
                // Keep the allocation for the next line that spans pieces.
                line.clear();
                self.partial = line;
            }
            piece = &piece[end + 1..];
        }
        self.partial.extend_from_slice(piece);
        // A line already over the limit before its end arrived is refused now. One byte of
        // slack: the line may still end in "\r\n".
        if self.partial.len() > self.max_record + 1 {
            return Err(FrameError::RecordTooLarge { index: self.records + 1, len: self.partial.len() });
        }
        Ok(())
    }

    fn line(&mut self, line: &[u8]) -> Result<(), FrameError> {
        let raw = line.len();
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let framed = if line.is_empty() { Ok(()) } else { self.record(line, raw) };
        // The line and its newline (the last line may have none: that only leaves one byte
        // over, and nothing follows it).
        self.lines_bytes = self.lines_bytes.saturating_add(raw + 1);
        framed
    }

    /// Frames the record `r`, which came from a line of `raw` bytes (its `\r` included).
    fn record(&mut self, r: &[u8], raw: usize) -> Result<(), FrameError> {
        if r.len() > self.max_record {
            return Err(FrameError::RecordTooLarge { index: self.records + 1, len: r.len() });
        }
        let framed = r.len() + RECORD_OVERHEAD;
        if self.cur_records > 0 && !fits(&self.cur, framed, self.batch_target) {
            self.batches_capacity += self.cur.capacity();
            self.batches.push(Batch {
                stream: self.stream.clone(),
                data: std::mem::take(&mut self.cur),
                records: self.cur_records,
            });
            self.cur_records = 0;
        }
        if self.cur.capacity() == 0 {
            self.last_capacity = match self.rest_framed(raw) {
                // The body's length is known, and its claim covers all of it already.
                Some(rest) => rest.min(self.batch_target).max(1),
                None => next_batch_capacity(self.last_capacity, self.batch_target),
            };
            self.cur.reserve_exact(framed.max(self.last_capacity));
        }
        encode_record(&mut self.cur, r);
        self.cur_records += 1;
        self.records += 1;
        self.payload_bytes += r.len() as u64;
        Ok(())
    }

    /// The batches, the number of records and their payload bytes.
    fn finish(mut self) -> Result<(Vec<Batch>, u64, u64), FrameError> {
        if self.ndjson {
            let last = std::mem::take(&mut self.partial);
            self.line(&last)?;
        } else if self.cur.len() > RECORD_OVERHEAD {
            let len = self.cur.len() - RECORD_OVERHEAD;
            let prefix = u32::try_from(len).map_err(|_| FrameError::RecordTooLarge { index: 1, len })?;
            self.cur[..RECORD_OVERHEAD].copy_from_slice(&prefix.to_le_bytes());
            self.cur_records = 1;
            self.records = 1;
            self.payload_bytes = len as u64;
        } else {
            self.cur.clear();
        }
        if self.records == 0 {
            return Err(FrameError::Empty);
        }
        if self.cur_records > 0 {
            self.batches.push(Batch { stream: self.stream, data: self.cur, records: self.cur_records });
        }
        Ok((self.batches, self.records, self.payload_bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(
        ndjson: bool,
        pieces: &[&[u8]],
        max_record: usize,
        target: usize,
    ) -> Result<(Vec<Batch>, u64, u64), FrameError> {
        let mut f = Framer::new("s", ndjson, max_record, target);
        for p in pieces {
            f.push(p)?;
        }
        f.finish()
    }

    fn records(batches: &[Batch]) -> Vec<Vec<u8>> {
        batches
            .iter()
            .flat_map(|b| edge_proto::records::split_records(&b.data, b.records).expect("valid framing"))
            .map(<[u8]>::to_vec)
            .collect()
    }

    #[test]
    fn ndjson_lines_split_anywhere_across_pieces_give_the_same_records() {
        let body = b"alpha\r\n\nbeta\ngamma-delta\r\n\n\nepsilon";
        let want: Vec<Vec<u8>> =
            ["alpha", "beta", "gamma-delta", "epsilon"].iter().map(|s| s.as_bytes().to_vec()).collect();
        for cut1 in 0..=body.len() {
            for cut2 in cut1..=body.len() {
                let (batches, n, bytes) =
                    frame(true, &[&body[..cut1], &body[cut1..cut2], &body[cut2..]], 100, 1 << 20).expect("frames");
                assert_eq!(records(&batches), want, "cut at {cut1} and {cut2}");
                assert_eq!((n, bytes), (4, 27));
                assert_eq!(batches.len(), 1);
            }
        }
    }

    #[test]
    fn batches_stay_near_the_target_and_keep_the_order() {
        let body: Vec<u8> = (0..100).flat_map(|i| format!("record-{i:03}\n").into_bytes()).collect();
        let (batches, n, _) = frame(true, &[&body], 100, 64).expect("frames");
        assert_eq!(n, 100);
        assert!(batches.iter().all(|b| b.data.len() <= 64 && b.records > 0), "{batches:?}");
        let want: Vec<Vec<u8>> = (0..100).map(|i| format!("record-{i:03}").into_bytes()).collect();
        assert_eq!(records(&batches), want);
    }

    #[test]
    fn a_large_body_takes_batches_of_growing_size_none_of_them_grown_in_place() {
        // 20,000 lines of 100 bytes (2 MB) against a 512 KiB target: buffers of 64, 128, 256
        // and then 512 KiB, each filled without being reallocated.
        let body: Vec<u8> = (0..20_000).flat_map(|i| format!("{i:099}\n").into_bytes()).collect();
        let (batches, n, _) = frame(true, &[&body[..777_777], &body[777_777..]], 1000, 512 << 10).expect("frames");
        assert_eq!(n, 20_000);
        let capacities: Vec<usize> = batches.iter().map(|b| b.data.capacity()).collect();
        assert_eq!(capacities[..4], [64 << 10, 128 << 10, 256 << 10, 512 << 10], "{capacities:?}");
        assert!(capacities[4..].iter().all(|&c| c == 512 << 10), "{capacities:?}");
        // Full but for less than one record.
        for b in &batches[..batches.len() - 1] {
            assert!(b.data.capacity() - b.data.len() < 104, "{} of {}", b.data.len(), b.data.capacity());
        }
        let want: Vec<Vec<u8>> = (0..20_000).map(|i| format!("{i:099}").into_bytes()).collect();
        assert_eq!(records(&batches), want);
    }

    /// Frames an NDJSON body whose length was declared, as a request with `Content-Length` is.
    fn frame_declared(pieces: &[&[u8]], max_record: usize, target: usize) -> (Vec<Batch>, u64) {
        let mut f = Framer::new("s", true, max_record, target);
        f.expect(pieces.iter().map(|p| p.len()).sum());
        for p in pieces {
            f.push(p).expect("push");
        }
        let (batches, n, _) = f.finish().expect("frames");
        (batches, n)
    }

    #[test]
    fn a_declared_ndjson_body_gets_buffers_sized_for_it_not_the_doubling_steps() {
        // Ten records of 10 KiB: one buffer of their framed size (plus a few bytes), against
        // 64 KiB and then 128 KiB for the same body of unknown length.
        let record = vec![b'x'; 10 << 10];
        let body: Vec<u8> = (0..10).flat_map(|_| [record.as_slice(), b"\n"].concat()).collect();
        let framed = 10 * (record.len() + RECORD_OVERHEAD);
        let (batches, n) = frame_declared(&[&body[..3333], &body[3333..]], 1 << 20, 512 << 10);
        assert_eq!((n, batches.len(), batches[0].data.len()), (10, 1, framed));
        assert!(batches[0].data.capacity() - framed <= 64, "capacity {}", batches[0].data.capacity());
        let (unknown, _, _) = frame(true, &[&body], 1 << 20, 512 << 10).expect("frames");
        let capacities: Vec<usize> = unknown.iter().map(|b| b.data.capacity()).collect();
        assert_eq!(capacities, [64 << 10, 128 << 10]);
        assert_eq!(records(&batches), records(&unknown));

        // 2 MB of 100-byte lines against a 512 KiB target: full target-sized buffers, then
        // one sized for the rest; none with more than a record's worth of room left.
        let body: Vec<u8> = (0..20_000).flat_map(|i| format!("{i:099}\n").into_bytes()).collect();
        let (batches, n) = frame_declared(&[&body[..777_777], &body[777_777..]], 1000, 512 << 10);
        assert_eq!(n, 20_000);
        assert!(batches.iter().all(|b| b.data.capacity() <= 512 << 10), "{batches:?}");
        for b in &batches {
            assert!(b.data.capacity() - b.data.len() < 104, "{} of {}", b.data.len(), b.data.capacity());
        }
        let want: Vec<Vec<u8>> = (0..20_000).map(|i| format!("{i:099}").into_bytes()).collect();
        assert_eq!(records(&batches), want);
    }

    #[test]
    fn a_declared_body_whose_lines_shrink_closes_its_first_buffer_early_and_loses_nothing() {
        // The first line, 1,000 bytes ending in CRLF, sizes the first buffer for about five
        // such lines; an empty line and 2,000 one-byte lines follow, which it cannot hold.
        let mut body = vec![b'L'; 1000];
        body.extend_from_slice(b"\r\n\n");
        for i in 0..2000 {
            body.extend_from_slice(format!("{}\n", i % 10).as_bytes());
        }
        let (batches, n) = frame_declared(&[&body], 2000, 1 << 20);
        assert_eq!(n, 2001);
        assert!(batches.len() >= 2, "{}", batches.len());
        let framed = 1000 + 2000 + 2001 * RECORD_OVERHEAD;
        let (len, capacity): (usize, usize) =
            batches.iter().fold((0, 0), |(l, c), b| (l + b.data.len(), c + b.data.capacity()));
        assert_eq!(len, framed);
        assert!(capacity < 2 * framed, "{capacity} bytes of buffers for {framed}");
        let mut want = vec![vec![b'L'; 1000]];
        want.extend((0..2000).map(|i| format!("{}", i % 10).into_bytes()));
        assert_eq!(records(&batches), want);
    }

    #[test]
    fn an_oversized_line_is_refused_before_its_end_arrives() {
        let mut f = Framer::new("s", true, 10, 1 << 20);
        f.push(b"ok\n0123456").expect("under the limit so far");
        assert_eq!(f.push(b"789ab"), Err(FrameError::RecordTooLarge { index: 2, len: 12 }));
        // Exactly the limit, with "\r\n" split across pieces, is fine.
        let (batches, n, _) = frame(true, &[b"0123456789\r", b"\n"], 10, 1 << 20).expect("at the limit");
        assert_eq!((records(&batches), n), (vec![b"0123456789".to_vec()], 1));
        assert_eq!(
            frame(true, &[b"0123456789x"], 10, 1 << 20).map(|r| r.1),
            Err(FrameError::RecordTooLarge { index: 1, len: 11 })
        );
    }

    #[test]
    fn octet_stream_bodies_are_one_record_whatever_their_pieces() {
        let (batches, n, bytes) = frame(false, &[b"ab\n", b"", b"c\r\n"], 10, 4).expect("frames");
        assert_eq!((records(&batches), n, bytes), (vec![b"ab\nc\r\n".to_vec()], 1, 6));
        assert_eq!(
            frame(false, &[b"0123", b"456789x"], 10, 1 << 20).map(|r| r.1),
            Err(FrameError::RecordTooLarge { index: 1, len: 11 })
        );
    }

    #[test]
    fn bodies_without_records_are_empty() {
        assert_eq!(frame(true, &[b"\n\r\n", b"\n"], 10, 64).map(|r| r.1), Err(FrameError::Empty));
        assert_eq!(frame(true, &[], 10, 64).map(|r| r.1), Err(FrameError::Empty));
        assert_eq!(frame(false, &[b""], 10, 64).map(|r| r.1), Err(FrameError::Empty));
    }

    /// A budget and counters that live for the test, so claims can move into spawned tasks.
    fn budget(cap: usize) -> (&'static RequestBudget, &'static IntakeCounters) {
        (Box::leak(Box::new(RequestBudget::new(cap))), Box::leak(Box::default()))
    }

    async fn until_waiting(counters: &IntakeCounters, n: u64) {
        let waiting = async {
            while counters.requests_waiting.load(Ordering::Relaxed) != n {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(std::time::Duration::from_secs(10), waiting)
            .await
            .unwrap_or_else(|_| panic!("{n} claims waiting"));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_growing_claim_goes_before_a_request_that_came_earlier() {
        let (b, counters) = budget(100);
        let mut first = b.claim(50, counters).await;
        let second = b.claim(50, counters).await;
        let queued = tokio::spawn(async move { b.claim(45, counters).await.held() });
        until_waiting(counters, 1).await;
        let grown = tokio::spawn(async move {
            let r = first.grow_to(95, counters).await;
            (r.is_ok(), first)
        });
        until_waiting(counters, 2).await;
        drop(second);
        // The growing claim takes the room; the request queued before it grows still waits.
        let (ok, first) = grown.await.expect("the growing task");
        assert!(ok);
        assert_eq!((first.held(), b.used()), (95, 95));
        until_waiting(counters, 1).await;
        drop(first);
        assert_eq!(queued.await.expect("the queued task"), 45);
        assert_eq!((b.used(), b.peak()), (0, 100));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn when_every_claim_waits_to_grow_the_youngest_gives_way_and_the_oldest_goes_on() {
        let (b, counters) = budget(100);
        let mut older = b.claim(50, counters).await;
        let mut younger = b.claim(50, counters).await;
        let grown = tokio::spawn(async move {
            let r = older.grow_to(70, counters).await;
            (r.is_ok(), older)
        });
        until_waiting(counters, 1).await;
        // The younger one asks for more too: no claim could end, so it gives way at once.
        let gave_way = tokio::time::timeout(std::time::Duration::from_secs(10), younger.grow_to(70, counters)).await;
        assert!(matches!(gave_way, Ok(Err(GaveWay))), "{gave_way:?}");
        assert_eq!(younger.held(), 0);
        let (ok, older) = grown.await.expect("the growing task");
        assert!(ok);
        assert_eq!((older.held(), b.used()), (70, 70));
        drop(younger);
        assert_eq!(b.used(), 70);
        drop(older);
        assert_eq!(b.used(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_dropped_while_it_waits_gives_its_place_and_its_room_back() {
        let (b, counters) = budget(100);
        let all = b.claim(100, counters).await;
        let queued = tokio::spawn(async move { b.claim(10, counters).await.held() });
        until_waiting(counters, 1).await;
        queued.abort();
        until_waiting(counters, 0).await;
        drop(all);
        // Nothing left in the queue: a claim of the whole budget is admitted at once.
        let mut half = b.claim(50, counters).await;
        let other = b.claim(50, counters).await;
        assert_eq!(b.used(), 100);
        let growing = tokio::spawn(async move { half.grow_to(80, counters).await.is_ok() });
        until_waiting(counters, 1).await;
        growing.abort();
        until_waiting(counters, 0).await;
        // The growing claim went with its task: what it held is back, and one alone grows.
        let mut other = other;
        assert_eq!(b.used(), 50);
        assert!(other.grow_to(100, counters).await.is_ok());
        assert_eq!(b.used(), 100);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_claims_growing_at_random_all_end_and_never_hold_more_than_the_budget() {
        let (b, counters) = budget(1000);
        let mut tasks = tokio::task::JoinSet::new();
        for k in 0..200u64 {
            tasks.spawn(async move {
                // A small LCG per task: the sizes and steps differ, the run is the same each time.
                let mut x = k.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let mut next = move |n: u64| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    (x >> 33) % n
                };
                let sized = next(2) == 0;
                let mut claim = b.claim(if sized { 1 + next(600) as usize } else { 64 }, counters).await;
                if !sized {
                    for _ in 0..next(5) {
                        let total = claim.held() * 2 + next(100) as usize;
                        if claim.grow_to(total, counters).await.is_err() {
                            return false;
                        }
                    }
                }
                for _ in 0..next(4) {
                    tokio::task::yield_now().await;
                }
                drop(claim);
                true
            });
        }
        let all = async {
            let mut gave_way = 0;
            while let Some(done) = tasks.join_next().await {
                gave_way += usize::from(!done.expect("a claim task"));
            }
            gave_way
        };
        let gave_way = tokio::time::timeout(std::time::Duration::from_secs(30), all).await.expect("every claim ends");
        assert!(gave_way < 200, "{gave_way} of 200 gave way");
        assert!(b.peak() <= 1000, "{} claimed at once", b.peak());
        assert_eq!((b.used(), counters.requests_waiting.load(Ordering::Relaxed)), (0, 0));
    }
}
