//! The record-stream intake: producers send records pipelined on one connection, and the agent
//! acknowledges them cumulatively after each spool commit (wire format in
//! [`edge_proto::intake`]).
//!
//! One task per connection. While one append of the connection is being committed, the records
//! that keep arriving are framed into the next; when the commit is done the agent answers with
//! the connection's committed count and submits what gathered meanwhile, as one all-or-nothing
//! append. So the producer never waits for a commit to send, a connection has at most one
//! append in the spool thread's queue, and what is durable is always a prefix of what was sent:
//! after a failed append nothing later of the connection is submitted, and the Error frame's
//! count tells the producer where to resume.
//!
//! Acks never hold a connection back: while one is still being written (its producer reads
//! slowly, or not at all), later commits only make the next one due, and it is written with
//! the count of that moment. So a producer that never reads its acks still has its records
//! read and committed, and what waits to be written is at most one frame.
//!
//! Memory per connection is bounded: records are framed into batch buffers, and a record that
//! needs a new buffer takes its capacity from the connection's own cap
//! ([`Intake::stream_pending_bytes`], `intake.stream_pending_bytes`), which it may cross by at
//! most itself. At the cap the agent stops framing and reading, so the receive buffer holds at
//! most the unframed rest of one read and one incomplete frame. What waits there is framed as
//! soon as the commit makes room, without waiting for more bytes: the producer may be waiting
//! for exactly those records' ack.
//!
//! Memory across connections is bounded too, whatever their number: the same capacity is taken
//! from one [`PendingBudget`] (`intake.stream_pending_total_bytes`), at most what is left of it
//! (at least the record), with what a batch costs beside its buffer ([`BATCH_OVERHEAD`]), so
//! all connections' batches together take at most the budget and one record. An append
//! submitted to the spool keeps its charge until the spool thread answers it, whether or not
//! its producer is still there: its buffers are in the spool thread's queue until then. A
//! connection that finds the budget spent stops framing and reading until a commit gives some
//! back. That cannot wait forever: every byte taken is in an append that is
//! committing or, on a connection with no commit running, is submitted at once, and commits end
//! without the intake.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::serve::Listener;
use bytes::{Buf, BytesMut};
use edge_proto::StreamName;
use edge_proto::intake::{self as wire, IntakeFrameError, ProducerFrame};
use edge_proto::records::{RECORD_OVERHEAD, encode_record};
use edge_spool::{AppendRequest, Batch};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::debug;

use crate::intake::{HeldShare, Intake, Rejection, fits, next_batch_capacity};
use crate::spool_task::AppendFailure;

/// The default of `intake.stream_pending_bytes`: records gathered per connection while its
/// previous append commits, as the capacity of the buffers they are framed into; reading pauses
/// at this size. A connection carries
/// at most about this much per commit, so where a commit takes milliseconds (an SD card's or
/// eMMC's sync) it also bounds the connection's rate (BENCHMARKS.md, "Done and tried since the
/// `a54f6d1` run", 17).
pub const PENDING_CAP: usize = 1 << 20;

/// The default of `intake.stream_pending_total_bytes`: what all record-stream connections
/// together gather and commit, as the capacity of those buffers. As much as four connections at the default
/// [`PENDING_CAP`] hold (one append gathering and one committing each).
pub const PENDING_TOTAL: usize = 8 << 20;

/// The capacity of the batch buffers that all record-stream connections gather and commit
/// records in, against `intake.stream_pending_total_bytes`.
#[derive(Debug)]
pub struct PendingBudget {
    cap: usize,
    used: AtomicUsize,
    /// The highest `used` since start.
    peak: AtomicUsize,
    /// Woken when a commit gives bytes back.
    freed: Notify,
}

impl PendingBudget {
    pub fn new(cap: usize) -> Self {
        PendingBudget { cap, used: AtomicUsize::new(0), peak: AtomicUsize::new(0), freed: Notify::new() }
    }

    /// `intake.stream_pending_total_bytes`.
    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The bytes of buffers charged now, by all connections.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// The highest [`used`](Self::used) since start.
    pub fn peak(&self) -> usize {
        self.peak.load(Ordering::Relaxed)
    }

    /// Whether a connection may take a new batch buffer.
    fn has_room(&self) -> bool {
        self.used() < self.cap
    }

    /// Takes `want` bytes, or what is left of the cap if less, but at least `at_least`; `None`
    /// if nothing is left. Taken at once, so that connections taking together go over the cap
    /// by at most one `at_least` between them: the take that crosses it.
    fn take(&self, want: usize, at_least: usize) -> Option<usize> {
        let mut used = self.used();
        loop {
            let room = self.cap.checked_sub(used).filter(|&r| r > 0)?;
            let n = want.min(room).max(at_least);
            match self.used.compare_exchange_weak(used, used + n, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    self.peak.fetch_max(used + n, Ordering::Relaxed);
                    return Some(n);
                }
                Err(now) => used = now,
            }
        }
    }

    fn charge(&self, bytes: usize) {
        let now = self.used.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.peak.fetch_max(now, Ordering::Relaxed);
    }

    fn give_back(&self, bytes: usize) {
        if bytes > 0 {
            self.used.fetch_sub(bytes, Ordering::Relaxed);
            self.freed.notify_waiters();
        }
    }
}

/// Bytes asked of the socket per read. The receive buffer holds at most twice this, or one
/// incomplete record and this, whichever is more.
pub const READ_SIZE: usize = 64 << 10;

/// Accepts record-stream connections until `cancel` fires. Accept errors are handled as for
/// the HTTP intake (axum's `Listener`: logged, and a pause when out of descriptors).
/// Each connection is served once it has a slot of [`Intake::connections`], and keeps it until
/// it closes.
pub async fn serve<L: Listener>(mut listener: L, intake: Arc<Intake>, cancel: CancellationToken, tasks: TaskTracker) {
    while let Some((io, slot)) = intake.connections.accept(&mut listener, &intake.counters, &cancel).await {
        let (intake, cancel) = (intake.clone(), cancel.clone());
        tasks.spawn(async move {
            let _slot = slot;
            serve_connection(io, intake, cancel).await;
        });
    }
}

/// Why the agent ends a connection with an Error frame.
#[derive(Debug)]
struct Refusal {
    status: u16,
    reason: Rejection,
    detail: String,
}

impl Refusal {
    fn frame(e: &IntakeFrameError) -> Self {
        let reason = match e {
            IntakeFrameError::RecordTooLarge { .. } => Rejection::RecordTooLarge,
            _ => Rejection::BadBody,
        };
        let status = if reason == Rejection::RecordTooLarge { 413 } else { 400 };
        Refusal { status, reason, detail: e.to_string() }
    }

    fn spool(f: &AppendFailure) -> Self {
        match f {
            AppendFailure::Full | AppendFailure::DiskFull => {
                Refusal { status: 507, reason: Rejection::SpoolFull, detail: format!("{f}; retry later") }
            }
            AppendFailure::TooManyStreams => {
                Refusal { status: 422, reason: Rejection::TooManyStreams, detail: f.to_string() }
            }
            AppendFailure::Closed => {
                Refusal { status: 503, reason: Rejection::ShuttingDown, detail: "the spool is closed".into() }
            }
            AppendFailure::Storage(_) => {
                Refusal { status: 500, reason: Rejection::StorageError, detail: f.to_string() }
            }
        }
    }

    fn shutting_down() -> Self {
        Refusal {
            status: 503,
            reason: Rejection::ShuttingDown,
            detail: "the agent is shutting down; the records after the committed count are not stored, send them again later".into(),
        }
    }
}

type Commit = Pin<Box<dyn Future<Output = Result<(), AppendFailure>> + Send>>;

/// The records of one append, framed into batches of one stream each.
#[derive(Default)]
struct Gathered {
    batches: Vec<Batch>,
    cur: Vec<u8>,
    cur_stream: String,
    cur_records: u32,
    /// The capacity given to the last batch's buffer (see [`next_batch_capacity`]).
    last_capacity: usize,
    records: u64,
    /// The capacity of all its batches' buffers: what it holds, and is charged for.
    reserved: usize,
}

impl Gathered {
    /// Whether a framed record of `framed` bytes for `stream` goes into the current batch's
    /// buffer as it is.
    fn fits(&self, stream: &StreamName, framed: usize, batch_target: usize) -> bool {
        self.cur_records > 0 && self.cur_stream == stream.as_str() && fits(&self.cur, framed, batch_target)
    }

    /// Whether a record for `stream` ends the current batch by changing streams.
    fn switches(&self, stream: &StreamName) -> bool {
        self.cur_records > 0 && self.cur_stream != stream.as_str()
    }

    /// The capacity a new batch's buffer for `stream` would have (see [`next_batch_capacity`]):
    /// after a batch that filled up, larger; after a change of streams, the first size again.
    fn next_capacity(&self, stream: &StreamName, batch_target: usize) -> usize {
        let last = if self.switches(stream) { 0 } else { self.last_capacity };
        next_batch_capacity(last, batch_target)
    }

    /// Frames `record` into the current batch or, where it does not [`fit`](Self::fits), into
    /// a new batch whose buffer has `capacity` bytes (at least the framed record). Returns what
    /// that took (the buffer's capacity and [`BATCH_OVERHEAD`]), and what the batch it ended
    /// gave back.
    ///
    /// A batch ended by a change of streams keeps only its bytes: a producer that interleaves
    /// streams record by record would otherwise hold a buffer of the first size per record, and
    /// reach its cap after a few records.
    fn push(&mut self, stream: &StreamName, record: &[u8], batch_target: usize, capacity: usize) -> (usize, usize) {
        let framed = record.len() + RECORD_OVERHEAD;
        let (mut reserved, mut given_back) = (0, 0);
        if !self.fits(stream, framed, batch_target) {
            if self.switches(stream) {
                let before = self.cur.capacity();
                self.cur.shrink_to_fit();
                given_back = before - self.cur.capacity();
                self.reserved -= given_back;
            }
            self.close_batch();
            stream.as_str().clone_into(&mut self.cur_stream);
            self.last_capacity = capacity.max(framed);
            self.cur.reserve_exact(self.last_capacity);
            reserved = self.cur.capacity() + BATCH_OVERHEAD;
            self.reserved += reserved;
        }
        encode_record(&mut self.cur, record);
        self.cur_records += 1;
        self.records += 1;
        (reserved, given_back)
    }

    fn close_batch(&mut self) {
        if self.cur_records > 0 {
            self.batches.push(Batch {
                stream: std::mem::take(&mut self.cur_stream),
                data: std::mem::take(&mut self.cur),
                records: self.cur_records,
            });
            self.cur_records = 0;
        }
    }
}

/// What a batch costs beside its buffer, charged with it: its `Batch` in the gathering's list
/// (56 bytes, in a list that doubles: 112), its stream's name (up to 64 bytes), and its
/// counters' entry at submission (40 bytes and the name again: 104). A producer that changes
/// streams at every record makes a batch per record, and without this would hold several times
/// the bytes it is charged for.
pub const BATCH_OVERHEAD: usize = 320;

/// An append being committed: its commit, its records, and per stream its records and payload
/// bytes (for the counters). The capacity of its batches' buffers stays charged to the budget
/// until the spool thread answers it ([`SubmittedCharge`]).
struct Committing {
    commit: Commit,
    records: u64,
    per_stream: Vec<(String, u64, u64)>,
}

/// The charge of an append handed to the spool thread: its batches' buffers, in the budget and
/// in the gauge of what connections hold, until the spool thread answers the append or drops
/// it ([`crate::spool_task::SpoolHandle::submit`]). Not until the connection ends: the buffers
/// wait in the spool thread's queue whether or not their producer is still there, and a
/// producer that went away and came back must not find their room given back twice over.
struct SubmittedCharge {
    intake: Arc<Intake>,
    bytes: usize,
    held: HeldShare,
}

impl Drop for SubmittedCharge {
    fn drop(&mut self) {
        // The gauge first: another connection may take the bytes back at once.
        self.held.set(0);
        self.intake.stream_budget.give_back(self.bytes);
    }
}

/// Serves one producer connection to its end; errors are reported to the producer and logged at
/// debug level (a producer going away is not the agent's problem).
pub async fn serve_connection<S>(mut io: S, intake: Arc<Intake>, cancel: CancellationToken)
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let mut parser = Parser::new(intake);
    if let Err(e) = run(&mut io, &mut parser, &cancel).await {
        debug!(error = %e, records = parser.received, committed = parser.committed, "record-stream connection ended");
    }
}

async fn run<S>(io: &mut S, p: &mut Parser, cancel: &CancellationToken) -> std::io::Result<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send,
{
    let (mut rd, mut wr) = tokio::io::split(io);
    let mut rbuf = BytesMut::with_capacity(READ_SIZE);
    // What is left to write is `wbuf[written..]`. Acks are cumulative: while one waits to be
    // written (its producer reads slowly, or never), the commits that end only make the next
    // one due, and it carries the count of when it is written. So the connection never waits
    // for its producer to read, and what waits to be written stays one frame.
    let mut wbuf = Vec::with_capacity(64);
    let mut written = 0;
    let mut ack_due = false;
    let mut committing: Option<Committing> = None;
    let mut refusal: Option<Refusal> = None;
    let mut eof = false;
    // The receive buffer's part of the gauge; the parser keeps the part of its batch buffers.
    let mut held = HeldShare::stream(p.intake.counters.clone());
    // A producer at a sensor's pace is quiet most of the time: once its connection holds no
    // unframed byte and has read none for a whole `QUIET_AFTER`, the receive buffer (grown to
    // a read or to its largest record) is given back. The timer is reset once per period, not
    // per read, so a busy connection pays nothing for it.
    let quiet = tokio::time::sleep(QUIET_AFTER);
    tokio::pin!(quiet);
    let mut read_since_check = false;
    let intake = p.intake.clone();
    if !p.intake.accepting.load(Ordering::Acquire) {
        refusal = Some(Refusal::shutting_down());
    }
    loop {
        // Frame what is buffered, as far as the cap and the budget allow: frames left in the
        // buffer are framed here once a commit has made room, whether or not more bytes come
        // (a producer waiting for their ack sends none). `stop` is what the connection then
        // waits for.
        let mut stop = Stop::NeedBytes;
        if refusal.is_none() && !rbuf.is_empty() {
            match p.parse(&mut rbuf) {
                Err(r) => refusal = Some(r),
                Ok(s) => stop = s,
            }
            if eof && stop == Stop::NeedBytes && !rbuf.is_empty() && refusal.is_none() {
                // Everything complete is framed; what is left was cut off.
                refusal = Some(p.ended_inside_a_frame(rbuf.len()));
            }
        }
        if committing.is_none() && p.gathered.records > 0 {
            committing = Some(p.submit());
            // The gathering starts afresh: frame what the buffer still holds before reading.
            continue;
        }
        let stopped = eof || refusal.is_some();
        // At the end of the stream, complete frames may still wait unframed for the budget.
        let unframed_at_end = eof && refusal.is_none() && !rbuf.is_empty();
        if stopped && !unframed_at_end && committing.is_none() {
            break;
        }
        // Framing stopped at the connection's own cap: its commit is running (what it gathered
        // was submitted above) and makes room when it ends. At the budget: a commit of any
        // connection does, and the wait for it is registered before the budget is looked at
        // again, so a commit that ends in between still wakes it.
        let can_read = !stopped && stop == Stop::NeedBytes;
        let freed = intake.stream_budget.freed.notified();
        tokio::pin!(freed);
        let waiting = (!stopped || unframed_at_end) && stop == Stop::Budget;
        if waiting {
            freed.as_mut().enable();
            if intake.stream_budget.has_room() {
                continue;
            }
        }
        if can_read && rbuf.capacity() - rbuf.len() < FRAME_SLACK {
            // Here, after framing, the buffer holds at most one incomplete frame, so `reserve`
            // moves it to the front of the allocation it has instead of growing it. Reserving
            // right after a read, with a whole read unframed, grew the buffer (by doubling,
            // offset included) to megabytes per connection.
            rbuf.reserve(READ_SIZE);
        }
        held.set(rbuf.capacity());
        let may_shrink = can_read && rbuf.is_empty() && rbuf.capacity() > QUIET_BUFFER;
        if ack_due && written == wbuf.len() {
            wbuf.clear();
            written = 0;
            wire::put_ack(&mut wbuf, p.committed);
            ack_due = false;
        }
        tokio::select! {
            done = async { committing.as_mut().expect("guarded by the condition").commit.as_mut().await }, if committing.is_some() => {
                let c = committing.take().expect("was committing");
                match done {
                    Ok(()) => {
                        p.committed += c.records;
                        for (stream, n, bytes) in &c.per_stream {
                            p.intake.counters.accepted(stream, *n, *bytes);
                        }
                        ack_due = true;
                    }
                    Err(f) => {
                        // Nothing gathered after a failed append may be stored, or the durable
                        // records would not be a prefix of those sent.
                        let dropped = std::mem::take(&mut p.gathered).reserved;
                        p.give_back(dropped);
                        let mut r = Refusal::spool(&f);
                        if matches!(f, AppendFailure::TooManyStreams) {
                            // Which of them is new the spool does not say; the producer knows.
                            let names: Vec<String> = c.per_stream.iter().map(|(s, _, _)| format!("{s:?}")).collect();
                            r.detail = format!("{} (the refused records are of stream {})", r.detail, names.join(", "));
                        }
                        refusal = Some(r);
                    }
                }
            }
            () = &mut freed, if waiting => {}
            n = wr.write(&wbuf[written..]), if written < wbuf.len() => {
                match n? {
                    0 => return Err(std::io::ErrorKind::WriteZero.into()),
                    n => written += n,
                }
            }
            read = rd.read_buf(&mut rbuf), if can_read => {
                if read? == 0 {
                    eof = true;
                }
                read_since_check = true;
            }
            () = &mut quiet, if may_shrink => {
                if !read_since_check {
                    // The next read lands in a small buffer, which grows again (to one read)
                    // as soon as it holds part of a frame.
                    rbuf = BytesMut::with_capacity(QUIET_BUFFER);
                }
                read_since_check = false;
                quiet.as_mut().reset(tokio::time::Instant::now() + QUIET_AFTER);
            }
            () = cancel.cancelled(), if !stopped => {
                // What was read is still committed; the producer learns how much.
                refusal = Some(Refusal::shutting_down());
            }
        }
    }
    // The last frame carries the latest count; an ack not yet begun is superseded by it, the
    // rest of one begun is finished first.
    if written == 0 {
        wbuf.clear();
    } else {
        wbuf.drain(..written);
    }
    if let Some(r) = refusal {
        p.intake.counters.rejected(r.reason);
        wire::put_error(&mut wbuf, p.committed, r.status, &r.detail);
        last_words(&mut wr, &wbuf, cancel).await?;
        // Read on for a moment before closing: closing a TCP socket with unread bytes resets
        // the connection, which can discard the Error frame before the producer reads it.
        let linger = async {
            let mut discarded = 0;
            rbuf.clear();
            while discarded < LINGER_BYTES {
                match rd.read_buf(&mut rbuf).await {
                    Ok(n) if n > 0 => discarded += n,
                    _ => break,
                }
                rbuf.clear();
            }
        };
        // At shutdown the agent does not wait long for producers that keep their side open.
        let _ = tokio::time::timeout(if cancel.is_cancelled() { LINGER_AT_SHUTDOWN } else { LINGER }, linger).await;
        return Ok(());
    }
    // The last word on a connection the producer ended: everything it sent is committed.
    wire::put_ack(&mut wbuf, p.committed);
    last_words(&mut wr, &wbuf, cancel).await
}

/// Writes a connection's last frames and shuts its sending side down. At shutdown the agent
/// waits at most [`LINGER_AT_SHUTDOWN`] for a producer that reads nothing.
async fn last_words<W: AsyncWrite + Unpin>(
    wr: &mut W,
    bytes: &[u8],
    cancel: &CancellationToken,
) -> std::io::Result<()> {
    let write = async {
        wr.write_all(bytes).await?;
        wr.shutdown().await
    };
    let given_up = async {
        cancel.cancelled().await;
        tokio::time::sleep(LINGER_AT_SHUTDOWN).await;
    };
    tokio::select! {
        r = write => r,
        () = given_up => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "the producer read nothing at shutdown")),
    }
}

/// How long, and for how many bytes, a refused connection is read on before it is closed.
const LINGER: std::time::Duration = std::time::Duration::from_secs(2);
const LINGER_BYTES: usize = 16 << 20;
const LINGER_AT_SHUTDOWN: std::time::Duration = std::time::Duration::from_millis(200);

/// Why [`Parser::parse`] stopped framing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// Every complete frame is framed; what is left in the buffer is at most part of one.
    NeedBytes,
    /// A record needs a new batch buffer and the connection's gathering is at
    /// `intake.stream_pending_bytes`: its commit, running, makes room.
    OwnCap,
    /// A record needs a new batch buffer and the budget is spent: any commit makes room.
    Budget,
}

/// A connection's state apart from its socket.
struct Parser {
    intake: Arc<Intake>,
    greeted: bool,
    stream: Option<StreamName>,
    /// Records parsed from the connection so far (the next one is `received + 1`).
    received: u64,
    committed: u64,
    gathered: Gathered,
    /// The buffers' capacity of this connection's gathering append, charged to
    /// [`Intake::stream_budget`]; at its submission the charge goes with it
    /// ([`SubmittedCharge`]), and what is still gathering is given back when the connection
    /// ends.
    charged: usize,
    /// `charged` in the gauge of what connections hold. It is lowered before the budget gets
    /// bytes back, which another connection may take at once: the gauge never counts them twice.
    charged_held: HeldShare,
}

impl Parser {
    fn new(intake: Arc<Intake>) -> Self {
        let charged_held = HeldShare::stream(intake.counters.clone());
        Parser {
            intake,
            greeted: false,
            stream: None,
            received: 0,
            committed: 0,
            gathered: Gathered::default(),
            charged: 0,
            charged_held,
        }
    }

    /// Gives back the charge of a gathering that was dropped.
    fn give_back(&mut self, bytes: usize) {
        self.charged -= bytes;
        self.charged_held.set(self.charged);
        self.intake.stream_budget.give_back(bytes);
    }

    /// The error for a connection that ended with part of a frame unread.
    fn ended_inside_a_frame(&self, unread: usize) -> Refusal {
        let detail = if self.greeted {
            format!("the connection ended inside a frame ({unread} bytes of it arrived)")
        } else {
            "the connection ended inside the preamble".to_owned()
        };
        Refusal { status: 400, reason: Rejection::BadBody, detail }
    }

    /// Frames the complete frames in `rbuf` into the gathered append, until a record needs a
    /// new batch buffer that the connection's cap or the budget has no room for; says where it
    /// stopped.
    fn parse(&mut self, rbuf: &mut BytesMut) -> Result<Stop, Refusal> {
        if !self.greeted {
            if !wire::check_magic(rbuf).map_err(|e| Refusal::frame(&e))? {
                return Ok(Stop::NeedBytes);
            }
            rbuf.advance(wire::MAGIC.len());
            self.greeted = true;
        }
        let max_record = self.intake.max_record_bytes;
        let batch_target = self.intake.batch_target;
        let (own_cap, budget) = (self.intake.stream_pending_bytes, &self.intake.stream_budget);
        loop {
            let (frame, used) = match wire::parse_producer_frame(rbuf, max_record, self.received + 1) {
                Ok(Some(parsed)) => parsed,
                Ok(None) => return Ok(Stop::NeedBytes),
                Err(e) => return Err(Refusal::frame(&e)),
            };
            match frame {
                ProducerFrame::Stream(name) => {
                    let Some(name) = std::str::from_utf8(name).ok().and_then(|s| StreamName::new(s).ok()) else {
                        return Err(Refusal {
                            status: 400,
                            reason: Rejection::BadStreamName,
                            detail: format!(
                                "stream {:?} (before record {}): a name is 1 to 64 bytes of [A-Za-z0-9_.-], not . or ..",
                                String::from_utf8_lossy(name),
                                self.received + 1
                            ),
                        });
                    };
                    self.stream = Some(name);
                }
                ProducerFrame::Record(record) => {
                    let Some(stream) = &self.stream else {
                        return Err(Refusal {
                            status: 400,
                            reason: Rejection::BadStreamName,
                            detail: format!("record {} comes before any Stream frame", self.received + 1),
                        });
                    };
                    // A record that fits the buffer it goes into takes nothing more. One that
                    // needs a new buffer takes its capacity from the connection's cap and from
                    // the budget, each of which it may cross by at most the record; what is
                    // left of them sizes the buffer.
                    let framed = record.len() + RECORD_OVERHEAD;
                    let mut capacity = 0;
                    if !self.gathered.fits(stream, framed, batch_target) {
                        let own_left = own_cap.saturating_sub(self.gathered.reserved);
                        if own_left == 0 {
                            return Ok(Stop::OwnCap);
                        }
                        let want = self.gathered.next_capacity(stream, batch_target).min(own_left);
                        let Some(taken) = budget.take(want + BATCH_OVERHEAD, framed + BATCH_OVERHEAD) else {
                            return Ok(Stop::Budget);
                        };
                        capacity = taken;
                    }
                    self.received += 1;
                    let buffer = capacity.saturating_sub(BATCH_OVERHEAD);
                    let (reserved, given_back) = self.gathered.push(stream, record, batch_target, buffer);
                    if reserved > capacity {
                        // The allocator's rounding, if `Vec` reports it.
                        budget.charge(reserved - capacity);
                    }
                    self.charged += reserved;
                    self.charged -= given_back;
                    self.charged_held.set(self.charged);
                    budget.give_back(given_back);
                }
            }
            rbuf.advance(used);
        }
    }

    /// Submits what was gathered as one append.
    fn submit(&mut self) -> Committing {
        let mut gathered = std::mem::take(&mut self.gathered);
        gathered.close_batch();
        let per_stream = gathered
            .batches
            .iter()
            .map(|b| {
                let records = u64::from(b.records);
                (b.stream.clone(), records, b.data.len() as u64 - records * RECORD_OVERHEAD as u64)
            })
            .collect();
        // The charge moves from the connection's share to the append's: lowered here first, so
        // the gauge never counts it twice.
        self.charged -= gathered.reserved;
        self.charged_held.set(self.charged);
        let mut held = HeldShare::stream(self.intake.counters.clone());
        held.set(gathered.reserved);
        let charge = SubmittedCharge { intake: self.intake.clone(), bytes: gathered.reserved, held };
        let commit = Box::pin(self.intake.spool.submit(AppendRequest { batches: gathered.batches }, charge));
        Committing { commit, records: gathered.records, per_stream }
    }
}

impl Drop for Parser {
    fn drop(&mut self) {
        // A connection that ends with an append gathering (its producer went away, or a write
        // failed) gives its charge back with it; one committing has it given back when the
        // spool thread is done with it.
        let charged = self.charged;
        self.give_back(charged);
    }
}

/// Spare room below which the receive buffer grows before the next read.
const FRAME_SLACK: usize = 4096;

/// How long a connection with nothing unframed reads nothing before its receive buffer shrinks
/// to [`QUIET_BUFFER`] (it does after one to two of these).
pub const QUIET_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// The receive buffer of a quiet connection: one read's worth of small records, and no more
/// than [`FRAME_SLACK`], so that the first read after a quiet spell does not grow it at once.
pub const QUIET_BUFFER: usize = FRAME_SLACK;

#[cfg(test)]
mod tests {
    use super::*;

    /// Frames `n` records of `len` bytes, the streams taken in turn, as `Parser::parse` does
    /// with no cap: returns the gathering.
    fn gather(streams: &[&str], n: usize, len: usize) -> Gathered {
        let streams: Vec<StreamName> = streams.iter().map(|s| StreamName::new(s).expect("valid")).collect();
        let (mut g, target, record) = (Gathered::default(), 512 << 10, vec![7u8; len]);
        let mut held = 0;
        for i in 0..n {
            let stream = &streams[i % streams.len()];
            let framed = len + RECORD_OVERHEAD;
            let capacity = if g.fits(stream, framed, target) { 0 } else { g.next_capacity(stream, target) };
            let (reserved, given_back) = g.push(stream, record.as_slice(), target, capacity);
            held = held + reserved - given_back;
            assert_eq!(held, g.reserved, "what push reports is what the gathering holds");
        }
        g
    }

    #[test]
    fn batches_ended_by_a_change_of_streams_keep_only_their_bytes() {
        // Record by record on two streams: every batch holds one record, and only that.
        let framed = 1000 + RECORD_OVERHEAD;
        let g = gather(&["a", "b"], 100, 1000);
        assert_eq!(g.records, 100);
        assert_eq!(
            g.reserved,
            99 * framed + next_batch_capacity(0, 512 << 10) + 100 * BATCH_OVERHEAD,
            "100 interleaved records of {framed} framed bytes: 99 closed batches of one record, one open buffer"
        );
        // One stream: buffers grow by doubling, as before.
        let g = gather(&["a"], 100, 1000);
        assert_eq!(g.batches.len(), 1, "64 KiB, then a second buffer of 128 KiB");
        assert_eq!(g.reserved, (64 << 10) + (128 << 10) + 2 * BATCH_OVERHEAD);
    }

    /// Records of one byte, each on another stream than the one before: every record is a
    /// batch, and each is charged what its batch costs beside its byte.
    #[test]
    fn a_batch_per_record_is_charged_what_the_batch_costs() {
        let n = 1000;
        let g = gather(&["a", "b"], n, 1);
        assert_eq!(g.batches.len(), n - 1);
        assert!(g.reserved >= n * BATCH_OVERHEAD, "{} bytes charged for {n} batches", g.reserved);
        // What they cost beside their bytes: the list of batches and the names.
        let list = g.batches.capacity() * std::mem::size_of::<Batch>();
        let names: usize = g.batches.iter().map(|b| b.stream.capacity()).sum();
        assert!(
            list + names <= (n - 1) * BATCH_OVERHEAD,
            "the overhead covers the list ({list}) and the names ({names})"
        );
    }
}
