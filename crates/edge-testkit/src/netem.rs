//! A userspace UDP proxy that injects network faults between the agent and the ingest server.
//!
//! The proxy listens on one address. For every client address it sees, it opens an *upstream
//! socket* of its own, forwards the client's datagrams from it to the upstream server, and relays
//! the server's answers back to that client. Each direction (client → server, server → client)
//! has its own [`Faults`]: uniform or bursty (Gilbert–Elliott) loss, a rate limit (token bucket),
//! delay with jitter, explicit reordering, duplication, bit flips and a blackhole switch.
//!
//! Why a userspace proxy and not `tc netem`: tests run unprivileged, in parallel, on loopback,
//! and must be reproducible. Every random decision comes from a seeded RNG, so a fixed seed and
//! a fixed packet sequence give the same verdicts.
//!
//! Delivery is scheduled per packet: a packet leaves at `arrival (+ rate-limit queueing) +
//! delay ± jitter (+ reorder gap)`, so jitter reorders packets naturally, as on a real path.
//! Packets that need no holding are sent straight from the receive buffer (no copy, no timer),
//! so a proxy with no faults set costs one `recv` and one `send` per datagram.
//!
//! [`NetemHandle::rebind`] replaces every upstream socket by a new one (new source port, and
//! optionally a new source address such as `127.0.0.2`), so the server sees the client move,
//! the way a NAT rebinding or a change of uplink looks to it.
//!
//! Faults can be changed while the proxy runs through the cloneable [`NetemHandle`], which also
//! reads the per-direction counters ([`Stats`]).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::str::FromStr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use tokio::net::UdpSocket;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// Largest datagram relayed (the UDP maximum).
const MAX_DATAGRAM: usize = 65_536;
/// Socket buffers of the proxy's sockets: as large as the agent's, so the kernel does not drop
/// what the proxy was not told to drop.
const SOCKET_BUFFER_BYTES: usize = 4 << 20;

/// Errors of the proxy and of parsing fault settings.
#[derive(Debug, thiserror::Error)]
pub enum NetemError {
    #[error("binding {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("the proxy has stopped")]
    Stopped,
    #[error("{what} {input:?}: {reason}")]
    Parse { what: &'static str, input: String, reason: String },
}

fn parse_err(what: &'static str, input: &str, reason: impl Into<String>) -> NetemError {
    NetemError::Parse { what, input: input.to_owned(), reason: reason.into() }
}

/// How packets are lost.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Default)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Loss {
    /// No loss.
    #[default]
    None,
    /// Each packet lost independently with probability `p`.
    Uniform { p: f64 },
    /// Gilbert–Elliott: a two-state Markov chain. In the good state a packet is lost with
    /// probability `loss_good`, in the bad state with `loss_bad`; after each packet the chain
    /// moves good → bad with probability `p` and bad → good with probability `r`. Bursts have a
    /// mean length of `1 / r` packets.
    GilbertElliott { p: f64, r: f64, loss_good: f64, loss_bad: f64 },
}

impl Loss {
    /// Uniform loss of `p` (0..=1).
    pub fn uniform(p: f64) -> Loss {
        if p <= 0.0 { Loss::None } else { Loss::Uniform { p: p.min(1.0) } }
    }

    /// Bursty loss averaging `avg` (0..1) with bursts of `mean_burst` packets on average
    /// (every packet of a burst is lost, none outside one).
    pub fn bursty(avg: f64, mean_burst: f64) -> Loss {
        if avg <= 0.0 {
            return Loss::None;
        }
        let avg = avg.min(0.999);
        let r = 1.0 / mean_burst.max(1.0);
        // Stationary share of the bad state is p / (p + r) = avg.
        let p = (avg * r / (1.0 - avg)).min(1.0);
        Loss::GilbertElliott { p, r, loss_good: 0.0, loss_bad: 1.0 }
    }

    /// The long-run loss probability.
    pub fn average(&self) -> f64 {
        match *self {
            Loss::None => 0.0,
            Loss::Uniform { p } => p,
            Loss::GilbertElliott { p, r, loss_good, loss_bad } => {
                if p + r <= 0.0 {
                    loss_good
                } else {
                    let bad = p / (p + r);
                    bad * loss_bad + (1.0 - bad) * loss_good
                }
            }
        }
    }
}

/// The faults applied to one direction.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Faults {
    pub loss: Loss,
    /// Base one-way delay added to every packet.
    pub delay: Duration,
    /// Each packet's delay is drawn uniformly from `delay ± jitter` (never below zero).
    pub jitter: Duration,
    /// Probability that a packet is held back by an extra `reorder_gap`, so later ones overtake it.
    pub reorder: f64,
    pub reorder_gap: Duration,
    /// Probability that a packet is sent twice (the copy gets its own delay draw).
    pub duplicate: f64,
    /// Probability that one random bit of a packet is flipped.
    pub flip: f64,
    /// Rate limit in bytes per second (token bucket); `None` is unlimited.
    pub rate: Option<u64>,
    /// Bucket depth in bytes: how much may pass at once after a quiet period.
    pub rate_burst: u64,
    /// A packet that would wait longer than this in the rate limiter's queue is dropped (a
    /// bottleneck link's buffer), so the limit cannot build an unbounded backlog.
    pub rate_queue: Duration,
    /// Drop everything.
    pub blackhole: bool,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            loss: Loss::None,
            delay: Duration::ZERO,
            jitter: Duration::ZERO,
            reorder: 0.0,
            reorder_gap: Duration::from_millis(20),
            duplicate: 0.0,
            flip: 0.0,
            rate: None,
            rate_burst: 64 * 1024,
            rate_queue: Duration::from_millis(200),
            blackhole: false,
        }
    }
}

impl Faults {
    /// True when a packet can never need holding back (the fast path sends it at once).
    fn immediate(&self) -> bool {
        self.delay.is_zero() && self.jitter.is_zero() && self.reorder <= 0.0 && self.rate.is_none()
    }
}

/// Faults of both directions.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct NetemConfig {
    /// Client → server.
    pub to_server: Faults,
    /// Server → client.
    pub to_client: Faults,
}

impl NetemConfig {
    /// The same faults both ways.
    pub fn symmetric(f: Faults) -> Self {
        Self { to_server: f.clone(), to_client: f }
    }
}

/// Which direction(s) a change applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Which {
    ToServer,
    ToClient,
    Both,
}

/// Counters of one direction.
#[derive(Debug, Default)]
struct DirCounters {
    received_packets: AtomicU64,
    received_bytes: AtomicU64,
    forwarded_packets: AtomicU64,
    forwarded_bytes: AtomicU64,
    dropped_loss: AtomicU64,
    dropped_blackhole: AtomicU64,
    dropped_rate: AtomicU64,
    duplicated: AtomicU64,
    corrupted: AtomicU64,
    delayed: AtomicU64,
    reordered: AtomicU64,
    send_errors: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

impl DirCounters {
    fn snapshot(&self) -> DirStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        DirStats {
            received_packets: g(&self.received_packets),
            received_bytes: g(&self.received_bytes),
            forwarded_packets: g(&self.forwarded_packets),
            forwarded_bytes: g(&self.forwarded_bytes),
            dropped_loss: g(&self.dropped_loss),
            dropped_blackhole: g(&self.dropped_blackhole),
            dropped_rate: g(&self.dropped_rate),
            duplicated: g(&self.duplicated),
            corrupted: g(&self.corrupted),
            delayed: g(&self.delayed),
            reordered: g(&self.reordered),
            send_errors: g(&self.send_errors),
        }
    }
}

/// A snapshot of one direction's counters. Duplicates count as extra forwarded packets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct DirStats {
    pub received_packets: u64,
    pub received_bytes: u64,
    pub forwarded_packets: u64,
    pub forwarded_bytes: u64,
    /// Lost to the loss model.
    pub dropped_loss: u64,
    /// Lost to the blackhole switch.
    pub dropped_blackhole: u64,
    /// Dropped because the rate limiter's queue was full.
    pub dropped_rate: u64,
    pub duplicated: u64,
    pub corrupted: u64,
    /// Packets held back by a non-zero delay draw or the rate limiter.
    pub delayed: u64,
    /// Packets held back by the explicit reorder gap.
    pub reordered: u64,
    pub send_errors: u64,
}

impl DirStats {
    /// Every packet dropped, whatever the reason.
    pub fn dropped(&self) -> u64 {
        self.dropped_loss + self.dropped_blackhole + self.dropped_rate
    }
}

/// A snapshot of all counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    pub to_server: DirStats,
    pub to_client: DirStats,
    /// Client addresses seen.
    pub sessions: u64,
    /// Rebinds done.
    pub rebinds: u64,
}

#[derive(Debug, Default)]
struct Shared {
    to_server: DirCounters,
    to_client: DirCounters,
    sessions: AtomicU64,
    rebinds: AtomicU64,
}

enum Command {
    Rebind { ip: Option<IpAddr>, reply: oneshot::Sender<Result<Vec<SocketAddr>, NetemError>> },
    Sessions { reply: oneshot::Sender<Vec<(SocketAddr, SocketAddr)>> },
}

/// Controls a running proxy; cheap to clone, usable from any task or thread.
#[derive(Debug, Clone)]
pub struct NetemHandle {
    config: Arc<watch::Sender<NetemConfig>>,
    commands: mpsc::Sender<Command>,
    shared: Arc<Shared>,
    listen: SocketAddr,
    upstream: SocketAddr,
}

impl std::fmt::Debug for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Command::Rebind { ip, .. } => write!(f, "Rebind({ip:?})"),
            Command::Sessions { .. } => f.write_str("Sessions"),
        }
    }
}

impl NetemHandle {
    /// The address clients send to.
    pub fn local_addr(&self) -> SocketAddr {
        self.listen
    }

    /// The server the proxy forwards to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// The current configuration.
    pub fn config(&self) -> NetemConfig {
        self.config.borrow().clone()
    }

    /// Replaces the whole configuration; takes effect from the next packet.
    pub fn set(&self, config: NetemConfig) {
        self.config.send_replace(config);
    }

    /// Changes the faults of `which` direction(s) in place.
    pub fn update(&self, which: Which, change: impl Fn(&mut Faults)) {
        self.config.send_modify(|c| {
            if matches!(which, Which::ToServer | Which::Both) {
                change(&mut c.to_server);
            }
            if matches!(which, Which::ToClient | Which::Both) {
                change(&mut c.to_client);
            }
        });
    }

    /// Switches the blackhole of `which` direction(s).
    pub fn blackhole(&self, which: Which, on: bool) {
        self.update(which, |f| f.blackhole = on);
    }

    /// Replaces every upstream socket by a new one on a fresh port, bound to `ip` if given
    /// (and for all later clients too), so the server sees each client come from a new
    /// address. Returns the new upstream addresses.
    pub async fn rebind(&self, ip: Option<IpAddr>) -> Result<Vec<SocketAddr>, NetemError> {
        let (reply, rx) = oneshot::channel();
        self.commands.send(Command::Rebind { ip, reply }).await.map_err(|_| NetemError::Stopped)?;
        rx.await.map_err(|_| NetemError::Stopped)?
    }

    /// `(client address, upstream socket address)` of every client seen.
    pub async fn sessions(&self) -> Result<Vec<(SocketAddr, SocketAddr)>, NetemError> {
        let (reply, rx) = oneshot::channel();
        self.commands.send(Command::Sessions { reply }).await.map_err(|_| NetemError::Stopped)?;
        rx.await.map_err(|_| NetemError::Stopped)
    }

    /// The counters now.
    pub fn stats(&self) -> Stats {
        Stats {
            to_server: self.shared.to_server.snapshot(),
            to_client: self.shared.to_client.snapshot(),
            sessions: self.shared.sessions.load(Ordering::Relaxed),
            rebinds: self.shared.rebinds.load(Ordering::Relaxed),
        }
    }
}

/// A running proxy. Dropping it stops it (tasks aborted); [`Netem::shutdown`] stops it and
/// waits until every socket is closed.
#[derive(Debug)]
pub struct Netem {
    handle: NetemHandle,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<()>>,
}

impl Netem {
    /// Binds `listen` and starts relaying to `upstream` on the current tokio runtime. `seed`
    /// makes every fault decision reproducible.
    pub async fn start(
        listen: SocketAddr,
        upstream: SocketAddr,
        config: NetemConfig,
        seed: u64,
    ) -> Result<Netem, NetemError> {
        let socket = Arc::new(bind_udp(listen)?);
        let listen = socket.local_addr().map_err(|source| NetemError::Bind { addr: listen, source })?;
        let (config_tx, config_rx) = watch::channel(config);
        let (cmd_tx, cmd_rx) = mpsc::channel(16);
        let (stop, stop_rx) = watch::channel(false);
        let shared = Arc::new(Shared::default());
        // Upstream sockets bind the loopback address for a loopback server, so their local
        // address is exactly what the server sees; any address otherwise.
        let bind_ip = match upstream.ip() {
            ip if ip.is_loopback() => ip,
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let front = Front {
            socket,
            upstream,
            bind_ip,
            seed,
            config: config_rx,
            commands: cmd_rx,
            stop: stop_rx,
            shared: shared.clone(),
            sessions: HashMap::new(),
            shaper: Shaper::new(seed),
            queue: Queue::default(),
            generation: 0,
        };
        let task = tokio::spawn(front.run());
        let handle = NetemHandle { config: Arc::new(config_tx), commands: cmd_tx, shared, listen, upstream };
        Ok(Netem { handle, stop, task: Some(task) })
    }

    pub fn handle(&self) -> NetemHandle {
        self.handle.clone()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.handle.listen
    }

    /// Stops relaying, drops queued packets and closes every socket.
    pub async fn shutdown(mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for Netem {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

/// A UDP socket with large kernel buffers.
fn bind_udp(addr: SocketAddr) -> Result<UdpSocket, NetemError> {
    let err = |source| NetemError::Bind { addr, source };
    let domain = socket2::Domain::for_address(addr);
    let s = socket2::Socket::new(domain, socket2::Type::DGRAM, Some(socket2::Protocol::UDP)).map_err(err)?;
    // Best effort: the kernel caps these at net.core.{r,w}mem_max.
    let _ = s.set_recv_buffer_size(SOCKET_BUFFER_BYTES);
    let _ = s.set_send_buffer_size(SOCKET_BUFFER_BYTES);
    s.set_nonblocking(true).map_err(err)?;
    s.bind(&addr.into()).map_err(err)?;
    UdpSocket::from_std(s.into()).map_err(err)
}

/// What to do with one packet.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Plan {
    Drop,
    /// Send at `at` (now or earlier: at once), and a copy at `dup` if duplicated.
    Deliver {
        at: Instant,
        dup: Option<Instant>,
    },
}

/// The per-direction fault state: RNG, Gilbert–Elliott state, rate-limiter clock.
struct Shaper {
    rng: StdRng,
    bad: bool,
    /// Theoretical arrival time of the token bucket (GCRA form).
    tat: Option<Instant>,
}

impl Shaper {
    fn new(seed: u64) -> Self {
        Self { rng: StdRng::seed_from_u64(seed), bad: false, tat: None }
    }

    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && (p >= 1.0 || self.rng.random_bool(p))
    }

    fn lost(&mut self, loss: &Loss) -> bool {
        match *loss {
            Loss::None => false,
            Loss::Uniform { p } => self.chance(p),
            Loss::GilbertElliott { p, r, loss_good, loss_bad } => {
                let lost = if self.bad { self.chance(loss_bad) } else { self.chance(loss_good) };
                self.bad = if self.bad { !self.chance(r) } else { self.chance(p) };
                lost
            }
        }
    }

    fn delay(&mut self, f: &Faults) -> Duration {
        if f.jitter.is_zero() {
            return f.delay;
        }
        let j = f.jitter.as_nanos() as i128;
        let d = f.delay.as_nanos() as i128 + self.rng.random_range(-j..=j);
        Duration::from_nanos(d.max(0) as u64)
    }

    /// Decides the fate of `pkt` (possibly flipping a bit of it) and counts it.
    fn plan(&mut self, f: &Faults, now: Instant, pkt: &mut [u8], c: &DirCounters) -> Plan {
        bump(&c.received_packets, 1);
        bump(&c.received_bytes, pkt.len() as u64);
        if f.blackhole {
            bump(&c.dropped_blackhole, 1);
            return Plan::Drop;
        }
        if self.lost(&f.loss) {
            bump(&c.dropped_loss, 1);
            return Plan::Drop;
        }
        if !pkt.is_empty() && self.chance(f.flip) {
            let bit = self.rng.random_range(0..pkt.len() * 8);
            pkt[bit / 8] ^= 1 << (bit % 8);
            bump(&c.corrupted, 1);
        }
        if f.immediate() {
            let dup = self.chance(f.duplicate).then_some(now);
            if dup.is_some() {
                bump(&c.duplicated, 1);
            }
            return Plan::Deliver { at: now, dup };
        }
        let mut depart = now;
        if let Some(rate) = f.rate.filter(|r| *r > 0) {
            let cost = Duration::from_secs_f64(pkt.len() as f64 / rate as f64);
            let burst = Duration::from_secs_f64(f.rate_burst as f64 / rate as f64);
            let tat = self.tat.map_or(now, |t| t.max(now));
            let new_tat = tat + cost;
            depart = new_tat.checked_sub(burst).map_or(now, |t| t.max(now));
            if depart.duration_since(now) > f.rate_queue {
                bump(&c.dropped_rate, 1);
                return Plan::Drop;
            }
            self.tat = Some(new_tat);
        }
        let mut at = depart + self.delay(f);
        if self.chance(f.reorder) {
            at += f.reorder_gap;
            bump(&c.reordered, 1);
        }
        if at > now {
            bump(&c.delayed, 1);
        }
        let dup = if self.chance(f.duplicate) {
            bump(&c.duplicated, 1);
            Some(depart + self.delay(f))
        } else {
            None
        };
        Plan::Deliver { at, dup }
    }
}

/// A packet waiting for its departure time.
struct Pending {
    at: Instant,
    seq: u64,
    data: Bytes,
}

impl PartialEq for Pending {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Pending {}
impl PartialOrd for Pending {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Pending {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.at, self.seq).cmp(&(o.at, o.seq))
    }
}

/// Packets of one direction ordered by departure time (ties in arrival order), each tagged with
/// the client it belongs to.
#[derive(Default)]
struct Queue {
    heap: BinaryHeap<Reverse<(Pending, SocketAddr)>>,
    seq: u64,
}

impl Queue {
    fn push(&mut self, at: Instant, data: Bytes, client: SocketAddr) {
        self.seq += 1;
        self.heap.push(Reverse((Pending { at, seq: self.seq, data }, client)));
    }

    fn next_at(&self) -> Option<Instant> {
        self.heap.peek().map(|Reverse((p, _))| p.at)
    }

    fn pop_due(&mut self, now: Instant) -> Option<(Bytes, SocketAddr)> {
        if self.next_at()? > now {
            return None;
        }
        self.heap.pop().map(|Reverse((p, c))| (p.data, c))
    }
}

/// Sleeps until `at`, or forever when nothing is queued.
async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

async fn send(socket: &UdpSocket, data: &[u8], to: SocketAddr, c: &DirCounters) {
    match socket.send_to(data, to).await {
        Ok(n) => {
            bump(&c.forwarded_packets, 1);
            bump(&c.forwarded_bytes, n as u64);
        }
        Err(_) => bump(&c.send_errors, 1),
    }
}

struct Session {
    upstream: Arc<UdpSocket>,
    back: JoinHandle<()>,
}

/// The client-facing task: receives from clients, shapes and forwards to the server, owns the
/// sessions and executes commands.
struct Front {
    socket: Arc<UdpSocket>,
    upstream: SocketAddr,
    bind_ip: IpAddr,
    seed: u64,
    config: watch::Receiver<NetemConfig>,
    commands: mpsc::Receiver<Command>,
    stop: watch::Receiver<bool>,
    shared: Arc<Shared>,
    sessions: HashMap<SocketAddr, Session>,
    shaper: Shaper,
    queue: Queue,
    /// Bumped on every new upstream socket, to give each return path its own RNG stream.
    generation: u64,
}

impl Front {
    async fn run(mut self) {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let mut faults = self.config.borrow_and_update().to_server.clone();
        loop {
            tokio::select! {
                biased;
                _ = self.stop.changed() => break,
                Some(cmd) = self.commands.recv() => self.command(cmd),
                () = sleep_until(self.queue.next_at()) => {
                    let now = Instant::now();
                    while let Some((data, client)) = self.queue.pop_due(now) {
                        // Sent from the session's socket of *now*: a rebind moves queued packets too.
                        if let Some(s) = self.sessions.get(&client) {
                            send(&s.upstream, &data, self.upstream, &self.shared.to_server).await;
                        }
                    }
                }
                r = self.socket.recv_from(&mut buf) => {
                    let Ok((n, client)) = r else { continue };
                    if self.config.has_changed().unwrap_or(false) {
                        faults = self.config.borrow_and_update().to_server.clone();
                    }
                    if !self.sessions.contains_key(&client) && self.open_session(client).is_err() {
                        bump(&self.shared.to_server.send_errors, 1);
                        continue;
                    }
                    let now = Instant::now();
                    let pkt = &mut buf[..n];
                    let Plan::Deliver { at, dup } = self.shaper.plan(&faults, now, pkt, &self.shared.to_server) else {
                        continue;
                    };
                    for at in std::iter::once(at).chain(dup) {
                        if at <= now {
                            if let Some(s) = self.sessions.get(&client) {
                                send(&s.upstream, pkt, self.upstream, &self.shared.to_server).await;
                            }
                        } else {
                            self.queue.push(at, Bytes::copy_from_slice(pkt), client);
                        }
                    }
                }
            }
        }
        for (_, s) in self.sessions.drain() {
            s.back.abort();
            let _ = s.back.await;
        }
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Rebind { ip, reply } => {
                if let Some(ip) = ip {
                    self.bind_ip = ip;
                }
                let _ = reply.send(self.rebind_all());
            }
            Command::Sessions { reply } => {
                let list =
                    self.sessions.iter().filter_map(|(c, s)| s.upstream.local_addr().ok().map(|u| (*c, u))).collect();
                let _ = reply.send(list);
            }
        }
    }

    fn rebind_all(&mut self) -> Result<Vec<SocketAddr>, NetemError> {
        let clients: Vec<SocketAddr> = self.sessions.keys().copied().collect();
        // Bind every new socket before touching any session, so a failure changes nothing.
        let mut fresh = Vec::new();
        for _ in &clients {
            fresh.push(Arc::new(bind_udp(SocketAddr::new(self.bind_ip, 0))?));
        }
        let mut out = Vec::new();
        for (client, socket) in clients.into_iter().zip(fresh) {
            if let Ok(a) = socket.local_addr() {
                out.push(a);
            }
            let back = self.spawn_back(client, socket.clone());
            if let Some(old) = self.sessions.insert(client, Session { upstream: socket, back }) {
                // Answers still heading to the old port are lost, as behind a NAT rebinding.
                old.back.abort();
            }
        }
        self.shared.rebinds.fetch_add(1, Ordering::Relaxed);
        Ok(out)
    }

    fn open_session(&mut self, client: SocketAddr) -> Result<(), NetemError> {
        let socket = Arc::new(bind_udp(SocketAddr::new(self.bind_ip, 0))?);
        let back = self.spawn_back(client, socket.clone());
        self.sessions.insert(client, Session { upstream: socket, back });
        self.shared.sessions.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn spawn_back(&mut self, client: SocketAddr, upstream: Arc<UdpSocket>) -> JoinHandle<()> {
        self.generation += 1;
        let back = Back {
            upstream,
            front: self.socket.clone(),
            server: self.upstream,
            client,
            config: self.config.clone(),
            stop: self.stop.clone(),
            shared: self.shared.clone(),
            shaper: Shaper::new(self.seed ^ 0x5EED_BACC_0000_0000 ^ self.generation),
        };
        tokio::spawn(back.run())
    }
}

/// The return path of one session: server → client through one upstream socket.
struct Back {
    upstream: Arc<UdpSocket>,
    front: Arc<UdpSocket>,
    server: SocketAddr,
    client: SocketAddr,
    config: watch::Receiver<NetemConfig>,
    stop: watch::Receiver<bool>,
    shared: Arc<Shared>,
    shaper: Shaper,
}

impl Back {
    async fn run(mut self) {
        let mut buf = vec![0u8; MAX_DATAGRAM];
        let mut queue = Queue::default();
        let mut faults = self.config.borrow_and_update().to_client.clone();
        let c = &self.shared.to_client;
        loop {
            tokio::select! {
                biased;
                _ = self.stop.changed() => break,
                () = sleep_until(queue.next_at()) => {
                    let now = Instant::now();
                    while let Some((data, client)) = queue.pop_due(now) {
                        send(&self.front, &data, client, c).await;
                    }
                }
                r = self.upstream.recv_from(&mut buf) => {
                    // Only the server's answers are relayed; strays to this port are ignored.
                    let Ok((n, from)) = r else { continue };
                    if from != self.server {
                        continue;
                    }
                    if self.config.has_changed().unwrap_or(false) {
                        faults = self.config.borrow_and_update().to_client.clone();
                    }
                    let now = Instant::now();
                    let pkt = &mut buf[..n];
                    let Plan::Deliver { at, dup } = self.shaper.plan(&faults, now, pkt, c) else { continue };
                    for at in std::iter::once(at).chain(dup) {
                        if at <= now {
                            send(&self.front, pkt, self.client, c).await;
                        } else {
                            queue.push(at, Bytes::copy_from_slice(pkt), self.client);
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Parsing of human-written settings (CLI flags and stdin commands).

/// `5%`, `0.5%` or a fraction `0.05` → probability 0..=1.
pub fn parse_probability(s: &str) -> Result<f64, NetemError> {
    let t = s.trim();
    let (num, scale) = match t.strip_suffix('%') {
        Some(n) => (n.trim(), 100.0),
        None => (t, 1.0),
    };
    let v: f64 = num
        .parse()
        .map_err(|_| parse_err("probability", s, "expected a percentage like 5% or a fraction like 0.05"))?;
    let p = v / scale;
    if !(0.0..=1.0).contains(&p) || !p.is_finite() {
        return Err(parse_err("probability", s, "must be between 0% and 100%"));
    }
    Ok(p)
}

/// `50ms`, `1.5s`, `200us`, `2m`, or `0` → duration.
pub fn parse_duration(s: &str) -> Result<Duration, NetemError> {
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| parse_err("duration", s, "expected a number with a unit, like 50ms or 2s"))?;
    let secs = match unit.trim() {
        "us" | "µs" => v / 1e6,
        "ms" => v / 1e3,
        "s" => v,
        "m" | "min" => v * 60.0,
        "" => return Err(parse_err("duration", s, "missing unit (us, ms, s, m)")),
        u => return Err(parse_err("duration", s, format!("unknown unit {u:?} (us, ms, s, m)"))),
    };
    Duration::try_from_secs_f64(secs).map_err(|_| parse_err("duration", s, "out of range"))
}

/// `1MB/s`, `500KiB/s`, `10Mbit/s`, `125000` (bytes per second) → bytes per second.
pub fn parse_rate(s: &str) -> Result<u64, NetemError> {
    let t = s.trim();
    let body = t.strip_suffix("/s").unwrap_or(t).trim();
    let split = body.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(body.len());
    let (num, unit) = body.split_at(split);
    let v: f64 = num.parse().map_err(|_| parse_err("rate", s, "expected a rate like 1MB/s, 500KiB/s or 10Mbit/s"))?;
    let factor = match unit.trim() {
        "" | "B" => 1.0,
        "kB" | "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        "kbit" | "Kbit" => 1e3 / 8.0,
        "Mbit" => 1e6 / 8.0,
        "Gbit" => 1e9 / 8.0,
        u => {
            return Err(parse_err(
                "rate",
                s,
                format!("unknown unit {u:?} (B, kB, MB, GB, KiB, MiB, GiB, kbit, Mbit, Gbit)"),
            ));
        }
    };
    let r = v * factor;
    if !(r >= 1.0 && r.is_finite()) {
        return Err(parse_err("rate", s, "must be at least 1 byte per second"));
    }
    Ok(r as u64)
}

/// `avg%,burst` (e.g. `5%,4`: 5 % loss in bursts of 4 packets on average) → bursty loss.
pub fn parse_bursty_loss(s: &str) -> Result<Loss, NetemError> {
    let (avg, burst) = s
        .split_once(',')
        .ok_or_else(|| parse_err("bursty loss", s, "expected AVG,BURST like 5%,4 (5 % loss in bursts of 4 packets)"))?;
    let avg = parse_probability(avg)?;
    let burst: f64 = burst
        .trim()
        .parse()
        .ok()
        .filter(|b: &f64| *b >= 1.0 && b.is_finite())
        .ok_or_else(|| parse_err("bursty loss", s, "the mean burst length must be a number of packets >= 1"))?;
    if avg >= 1.0 {
        return Err(parse_err("bursty loss", s, "the average must be below 100%"));
    }
    Ok(Loss::bursty(avg, burst))
}

/// The setting names [`apply_setting`] knows, for help texts.
pub const SETTINGS: &str = "loss P | burst-loss AVG,BURST | delay D | jitter D | reorder P | reorder-gap D | \
dup P | flip P | rate R|off | rate-burst BYTES | rate-queue D | blackhole on|off";

/// Sets one fault by name from text, as typed by a person: `loss 5%`, `delay 50ms`,
/// `rate 1MB/s`, `rate off`, `blackhole on`. The error names the key or the value.
pub fn apply_setting(f: &mut Faults, key: &str, value: &str) -> Result<(), NetemError> {
    match key {
        "loss" => f.loss = Loss::uniform(parse_probability(value)?),
        "burst-loss" => f.loss = parse_bursty_loss(value)?,
        "delay" => f.delay = parse_duration(value)?,
        "jitter" => f.jitter = parse_duration(value)?,
        "reorder" => f.reorder = parse_probability(value)?,
        "reorder-gap" => f.reorder_gap = parse_duration(value)?,
        "dup" | "duplicate" => f.duplicate = parse_probability(value)?,
        "flip" => f.flip = parse_probability(value)?,
        "rate" => f.rate = if value.trim() == "off" { None } else { Some(parse_rate(value)?) },
        "rate-burst" => {
            f.rate_burst =
                value.trim().parse().map_err(|_| parse_err("rate-burst", value, "expected a number of bytes"))?
        }
        "rate-queue" => f.rate_queue = parse_duration(value)?,
        "blackhole" => {
            f.blackhole = match value.trim() {
                "on" | "true" | "1" => true,
                "off" | "false" | "0" => false,
                _ => return Err(parse_err("blackhole", value, "expected on or off")),
            }
        }
        _ => return Err(parse_err("setting", key, format!("unknown; known settings: {SETTINGS}"))),
    }
    Ok(())
}

impl FromStr for Which {
    type Err = NetemError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "both" => Ok(Which::Both),
            "up" | "to-server" | "c2s" => Ok(Which::ToServer),
            "down" | "to-client" | "s2c" => Ok(Which::ToClient),
            _ => Err(parse_err("direction", s, "expected up, down or both")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_parse_and_bad_ones_name_the_input() {
        assert_eq!(parse_probability("5%").ok(), Some(0.05));
        assert_eq!(parse_probability("0.2").ok(), Some(0.2));
        assert!(parse_probability("150%").is_err());
        assert_eq!(parse_duration("50ms").ok(), Some(Duration::from_millis(50)));
        assert_eq!(parse_duration("1.5s").ok(), Some(Duration::from_millis(1500)));
        assert_eq!(parse_rate("1MB/s").ok(), Some(1_000_000));
        assert_eq!(parse_rate("8Mbit/s").ok(), Some(1_000_000));
        assert_eq!(parse_rate("1KiB/s").ok(), Some(1024));
        let e = parse_duration("50 parsecs").expect_err("bad unit").to_string();
        assert!(e.contains("50 parsecs") && e.contains("unit"), "{e}");
        let e = parse_rate("fast").expect_err("no number").to_string();
        assert!(e.contains("\"fast\""), "{e}");
    }

    #[test]
    fn bursty_loss_has_the_requested_average() {
        let l = Loss::bursty(0.05, 4.0);
        assert!((l.average() - 0.05).abs() < 1e-9, "{l:?}");
        let c = DirCounters::default();
        let mut s = Shaper::new(1);
        let f = Faults { loss: l, ..Faults::default() };
        let now = Instant::now();
        let mut lost = 0;
        let mut bursts = 0;
        let mut prev = false;
        for _ in 0..100_000 {
            let d = s.plan(&f, now, &mut [0u8; 10], &c) == Plan::Drop;
            lost += u32::from(d);
            bursts += u32::from(d && !prev);
            prev = d;
        }
        let rate = f64::from(lost) / 100_000.0;
        assert!((0.04..0.06).contains(&rate), "loss {rate}");
        let mean_burst = f64::from(lost) / f64::from(bursts);
        assert!((3.0..5.0).contains(&mean_burst), "mean burst {mean_burst}");
    }

    #[test]
    fn rate_limit_spaces_packets_and_drops_beyond_the_queue() {
        let c = DirCounters::default();
        let mut s = Shaper::new(1);
        let f =
            Faults { rate: Some(100_000), rate_burst: 0, rate_queue: Duration::from_millis(100), ..Faults::default() };
        let now = Instant::now();
        let mut last = now;
        let mut sent = 0;
        for _ in 0..50 {
            match s.plan(&f, now, &mut [0u8; 1000], &c) {
                Plan::Deliver { at, .. } => {
                    assert!(at >= last);
                    last = at;
                    sent += 1;
                }
                Plan::Drop => {}
            }
        }
        // 1000 bytes at 100 kB/s = 10 ms each; a 100 ms queue holds 10 of them.
        assert_eq!(sent, 10);
        assert_eq!(c.snapshot().dropped_rate, 40);
        assert_eq!(last.duration_since(now), Duration::from_millis(100));
    }
}
