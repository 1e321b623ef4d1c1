//! The fault-injecting proxy (`edge_testkit::netem`) against plain UDP sockets: each fault does
//! what it says, counted by the proxy and observed by the receiving socket.
//!
//! Packets carry their sequence number, so the receiver can tell which were lost, duplicated,
//! reordered or corrupted. Senders pace themselves on the proxy's receive counter, so the
//! kernel never drops anything the proxy was not told to drop.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use edge_testkit::netem::{Faults, Loss, Netem, NetemConfig, NetemHandle, Stats, Which};
use tokio::net::UdpSocket;
use tokio::sync::{Mutex, mpsc};
use tokio::time::Instant;

const DEADLINE: Duration = Duration::from_secs(20);
const LEN: usize = 64;
const FILL: u8 = 0xA5;

type Arrival = (Vec<u8>, SocketAddr, Instant);

struct Rig {
    proxy: Netem,
    handle: NetemHandle,
    client: UdpSocket,
    /// The server socket, for answers; what it receives arrives in `inbox`.
    server: Arc<UdpSocket>,
    inbox: Mutex<mpsc::UnboundedReceiver<Arrival>>,
}

async fn rig(config: NetemConfig, seed: u64) -> Rig {
    let server = Arc::new(UdpSocket::bind("127.0.0.1:0").await.expect("bind server"));
    let upstream = server.local_addr().expect("server addr");
    // The server reads all the time, so its kernel buffer never overflows.
    let (tx, inbox) = mpsc::unbounded_channel();
    let reader = server.clone();
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        while let Ok((n, from)) = reader.recv_from(&mut buf).await {
            if tx.send((buf[..n].to_vec(), from, Instant::now())).is_err() {
                break;
            }
        }
    });
    let proxy = Netem::start("127.0.0.1:0".parse().expect("addr"), upstream, config, seed).await.expect("start proxy");
    let client = UdpSocket::bind("127.0.0.1:0").await.expect("bind client");
    client.connect(proxy.local_addr()).await.expect("connect client");
    let handle = proxy.handle();
    Rig { proxy, handle, client, server, inbox: Mutex::new(inbox) }
}

fn packet(seq: u64) -> Vec<u8> {
    let mut p = vec![FILL; LEN];
    p[..8].copy_from_slice(&seq.to_le_bytes());
    p
}

/// Polls `cond` on the proxy's counters until it holds (the proxy runs in other tasks).
async fn wait_stats(h: &NetemHandle, what: &str, cond: impl Fn(&Stats) -> bool) -> Stats {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let s = h.stats();
        if cond(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "never saw {what}: {s:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

impl Rig {
    /// Sends packets `0..n` from the client, in bursts of 50 paced on the proxy's receive
    /// counter.
    async fn send(&self, n: u64) {
        let base = self.handle.stats().to_server.received_packets;
        for seq in 0..n {
            self.client.send(&packet(seq)).await.expect("send");
            if seq % 50 == 49 {
                wait_stats(&self.handle, "the proxy receiving the burst", |s| {
                    s.to_server.received_packets > base + seq
                })
                .await;
            }
        }
        wait_stats(&self.handle, "the proxy receiving everything", |s| s.to_server.received_packets >= base + n).await;
    }

    /// Everything the server receives until it got as many packets as the proxy forwarded
    /// (after the proxy has nothing queued: forwarded + dropped = received + duplicated).
    async fn server_gets(&self) -> Vec<(Vec<u8>, SocketAddr, Instant)> {
        let s = wait_stats(&self.handle, "the proxy settling", |s| {
            let d = &s.to_server;
            d.forwarded_packets + d.dropped() == d.received_packets + d.duplicated
        })
        .await;
        let want = s.to_server.forwarded_packets as usize;
        let mut got = Vec::new();
        while got.len() < want {
            got.push(self.next().await);
        }
        got
    }

    /// The next packet the server received.
    async fn next(&self) -> Arrival {
        let mut inbox = self.inbox.lock().await;
        tokio::time::timeout(DEADLINE, inbox.recv()).await.expect("a packet reaches the server").expect("reader alive")
    }
}

fn seq_of(p: &[u8]) -> u64 {
    u64::from_le_bytes(p[..8].try_into().expect("8 bytes"))
}

fn up(f: Faults) -> NetemConfig {
    NetemConfig { to_server: f, to_client: Faults::default() }
}

#[tokio::test]
async fn uniform_loss_drops_its_share_and_the_seed_fixes_which_packets() {
    let mut runs = Vec::new();
    for _ in 0..2 {
        let r = rig(up(Faults { loss: Loss::uniform(0.2), ..Faults::default() }), 7).await;
        r.send(2000).await;
        let got = r.server_gets().await;
        let s = r.handle.stats().to_server;
        assert_eq!(s.received_packets, 2000);
        assert_eq!(s.dropped_loss + got.len() as u64, 2000, "every packet is forwarded or counted lost");
        // Binomial(2000, 0.2): mean 400, sd about 18.
        assert!((300..500).contains(&s.dropped_loss), "{s:?}");
        let delivered: Vec<u64> = got.iter().map(|(p, ..)| seq_of(p)).collect();
        runs.push(delivered);
        r.proxy.shutdown().await;
    }
    assert_eq!(runs[0], runs[1], "the same seed loses the same packets");
}

#[tokio::test]
async fn bursty_loss_comes_in_bursts() {
    let r = rig(up(Faults { loss: Loss::bursty(0.1, 5.0), ..Faults::default() }), 11).await;
    r.send(4000).await;
    let got = r.server_gets().await;
    let delivered: HashSet<u64> = got.iter().map(|(p, ..)| seq_of(p)).collect();
    let lost: Vec<u64> = (0..4000).filter(|i| !delivered.contains(i)).collect();
    let bursts = lost.windows(2).filter(|w| w[1] != w[0] + 1).count() + usize::from(!lost.is_empty());
    let mean_burst = lost.len() as f64 / bursts.max(1) as f64;
    let s = r.handle.stats().to_server;
    assert_eq!(s.dropped_loss, lost.len() as u64);
    assert!((200..700).contains(&lost.len()), "about 10 % lost: {}", lost.len());
    assert!(mean_burst > 2.5, "losses come in bursts (mean {mean_burst:.2}, uniform would give about 1.1)");
}

#[tokio::test]
async fn duplication_sends_extra_copies() {
    let r = rig(up(Faults { duplicate: 0.1, ..Faults::default() }), 3).await;
    r.send(2000).await;
    let got = r.server_gets().await;
    let s = r.handle.stats().to_server;
    assert!((120..300).contains(&s.duplicated), "{s:?}");
    assert_eq!(got.len() as u64, 2000 + s.duplicated);
    let distinct: HashSet<u64> = got.iter().map(|(p, ..)| seq_of(p)).collect();
    assert_eq!(distinct.len(), 2000, "no packet lost, some twice");
}

#[tokio::test]
async fn bit_flips_change_exactly_one_bit_of_the_counted_packets() {
    let r = rig(up(Faults { flip: 0.1, ..Faults::default() }), 5).await;
    r.send(2000).await;
    let got = r.server_gets().await;
    let s = r.handle.stats().to_server;
    let mut damaged = 0u64;
    for (p, ..) in &got {
        // The sequence number itself may be hit: compare the fill bytes, and the sequence
        // number against the range that was sent.
        let fill_bits: u32 = p[8..].iter().map(|b| (b ^ FILL).count_ones()).sum();
        let seq_bad = seq_of(p) >= 2000;
        assert!(fill_bits <= 1, "one bit at most per packet");
        if fill_bits == 1 || seq_bad {
            damaged += 1;
        }
    }
    assert_eq!(got.len(), 2000);
    assert!((120..300).contains(&s.corrupted), "{s:?}");
    // A flip in a high bit of the sequence number is visible; a low one may give another valid
    // number, so the receiver can see at most as many as were flipped, and nearly all.
    assert!(damaged <= s.corrupted && damaged + s.corrupted / 4 >= s.corrupted, "{damaged} seen, {s:?}");
}

#[tokio::test]
async fn blackhole_drops_everything_until_switched_off() {
    let r = rig(NetemConfig::default(), 1).await;
    r.handle.blackhole(Which::Both, true);
    r.send(300).await;
    let s = wait_stats(&r.handle, "all dropped", |s| s.to_server.dropped_blackhole == 300).await;
    assert_eq!(s.to_server.forwarded_packets, 0);
    r.handle.blackhole(Which::Both, false);
    r.client.send(&packet(9999)).await.expect("send");
    let (p, ..) = r.next().await;
    assert_eq!(seq_of(&p), 9999, "the first packet through is the one sent after the blackhole");
}

#[tokio::test]
async fn one_way_blackhole_blocks_only_answers() {
    let r = rig(NetemConfig::default(), 1).await;
    r.handle.blackhole(Which::ToClient, true);
    r.client.send(&packet(1)).await.expect("send");
    let mut buf = [0u8; 256];
    let (p, from, _) = r.next().await;
    r.server.send_to(&p, from).await.expect("answer");
    wait_stats(&r.handle, "the answer blackholed", |s| s.to_client.dropped_blackhole == 1).await;
    r.handle.blackhole(Which::ToClient, false);
    r.server.send_to(&packet(2), from).await.expect("answer");
    let n = tokio::time::timeout(DEADLINE, r.client.recv(&mut buf)).await.expect("answer arrives").expect("recv");
    assert_eq!(seq_of(&buf[..n]), 2);
}

#[tokio::test]
async fn rebind_changes_the_source_address_the_server_sees() {
    let r = rig(NetemConfig::default(), 1).await;
    let mut buf = [0u8; 256];
    let mut seen = Vec::new();
    for (i, rebind) in [None, Some(None), Some(Some(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))))].into_iter().enumerate() {
        if let Some(ip) = rebind {
            let new = r.handle.rebind(ip).await.expect("rebind");
            assert_eq!(new.len(), 1, "one client, one new upstream socket");
        }
        r.client.send(&packet(i as u64)).await.expect("send");
        let (p, from, _) = r.next().await;
        assert_eq!(seq_of(&p), i as u64);
        // The answer goes back through the new socket to the same client.
        r.server.send_to(&p, from).await.expect("echo");
        let m = tokio::time::timeout(DEADLINE, r.client.recv(&mut buf)).await.expect("echo arrives").expect("recv");
        assert_eq!(seq_of(&buf[..m]), i as u64);
        let sessions = r.handle.sessions().await.expect("sessions");
        assert_eq!(sessions, vec![(r.client.local_addr().expect("addr"), from)]);
        seen.push(from);
    }
    assert_ne!(seen[0].port(), seen[1].port(), "rebind moves to a new port");
    assert_eq!(seen[1].ip(), seen[0].ip());
    assert_eq!(seen[2].ip(), IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)), "rebind to a new address");
    assert_eq!(r.handle.stats().rebinds, 2);
    assert_eq!(r.handle.stats().sessions, 1, "still the same client");
}

#[tokio::test]
async fn delay_holds_every_packet_at_least_its_delay_and_jitter_reorders() {
    for (delay, jitter) in [(50, 0), (50, 10)] {
        let f =
            Faults { delay: Duration::from_millis(delay), jitter: Duration::from_millis(jitter), ..Faults::default() };
        let r = rig(up(f), 9).await;
        let mut sent_at = Vec::new();
        for seq in 0..200u64 {
            sent_at.push(Instant::now());
            r.client.send(&packet(seq)).await.expect("send");
        }
        wait_stats(&r.handle, "all received", |s| s.to_server.received_packets == 200).await;
        let got = r.server_gets().await;
        assert_eq!(got.len(), 200);
        let floor = Duration::from_millis(delay - jitter);
        for (p, _, at) in &got {
            let took = at.duration_since(sent_at[seq_of(p) as usize]);
            assert!(took >= floor, "packet {} took {took:?}, below {floor:?}", seq_of(p));
        }
        let inversions = got.windows(2).filter(|w| seq_of(&w[1].0) < seq_of(&w[0].0)).count();
        if jitter == 0 {
            assert_eq!(inversions, 0, "a fixed delay keeps the order");
        } else {
            assert!(inversions > 0, "±{jitter} ms of jitter on back-to-back packets reorders some");
        }
        assert_eq!(r.handle.stats().to_server.delayed, 200);
    }
}

#[tokio::test]
async fn explicit_reordering_holds_back_a_share_of_packets() {
    let f = Faults { reorder: 0.2, reorder_gap: Duration::from_millis(20), ..Faults::default() };
    let r = rig(up(f), 13).await;
    r.send(500).await;
    let got = r.server_gets().await;
    let s = r.handle.stats().to_server;
    assert_eq!(got.len(), 500, "reordering loses nothing");
    assert!((50..160).contains(&s.reordered), "{s:?}");
    let inversions = got.windows(2).filter(|w| seq_of(&w[1].0) < seq_of(&w[0].0)).count();
    assert!(inversions > 0, "held-back packets arrive after later ones");
}

#[tokio::test]
async fn rate_limit_paces_and_drops_beyond_its_queue() {
    let f =
        Faults { rate: Some(100_000), rate_burst: 2_000, rate_queue: Duration::from_millis(100), ..Faults::default() };
    let r = rig(up(f), 1).await;
    let big = vec![FILL; 1000];
    let start = Instant::now();
    for _ in 0..100 {
        r.client.send(&big).await.expect("send");
    }
    wait_stats(&r.handle, "all received", |s| s.to_server.received_packets == 100).await;
    let got = r.server_gets().await;
    let s = r.handle.stats().to_server;
    assert!(s.dropped_rate > 0, "a burst of 100 kB into a 100 kB/s link with a 100 ms queue overflows: {s:?}");
    assert_eq!(got.len() as u64 + s.dropped_rate, 100);
    // What passed beyond the bucket's depth left no faster than the rate.
    let last = got.last().map(|g| g.2).expect("some passed");
    let floor = Duration::from_secs_f64((s.forwarded_bytes.saturating_sub(2_000 + 1_000)) as f64 / 100_000.0);
    assert!(last.duration_since(start) >= floor, "{:?} < {floor:?}", last.duration_since(start));
}

#[tokio::test]
async fn faults_change_while_running_and_shutdown_frees_the_port() {
    let r = rig(NetemConfig::default(), 1).await;
    r.send(100).await;
    assert_eq!(r.server_gets().await.len(), 100);
    r.handle.update(Which::ToServer, |f| f.loss = Loss::uniform(1.0));
    r.send(100).await;
    let s = wait_stats(&r.handle, "100 % loss applied", |s| s.to_server.dropped_loss == 100).await;
    assert_eq!(s.to_server.forwarded_packets, 100);
    let addr = r.proxy.local_addr();
    r.proxy.shutdown().await;
    std::net::UdpSocket::bind(addr).expect("the listen port is free after shutdown");
    assert!(r.handle.rebind(None).await.is_err(), "a stopped proxy says so");
}
