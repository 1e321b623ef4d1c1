//! The two physical baselines, each as a pair of processes (the bench re-executes itself in a
//! server and a client role):
//!
//! * raw quinn: one connection, one uni-stream per message written with `write_chunk(Bytes)`
//!   and finished, GSO and MTU discovery on, the certificates, TLS configs (ring, TLS 1.3,
//!   mutual auth, ALPN) and `Tuning` of `edge-transport`, exactly as the daemons use them;
//! * TLS 1.3 over TCP: tokio-rustls with the same provider (so the same cipher suite is
//!   negotiated), the same certificates, TCP_NODELAY, messages written back to back.
//!
//! The server times from the end of the handshake until it has read every byte; each side
//! reports the CPU seconds it spent in that interval (from `/proc/self/stat`).
//!
//! The client sends distinct bytes, as the agent does: its messages are consecutive slices of
//! one random buffer as long as the run (up to [`MAX_SOURCE`]), made before it connects. Until
//! `Source::OneBuffer` was split off, every message was the same 10 KiB (or 512 KiB) buffer,
//! which stayed in the CPU's caches and made the sender about a fifth cheaper than sending
//! bytes that come from memory; that variant is still measured, for comparison.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::sys;

/// Longest source buffer of a client: 1 GiB, beyond which its messages start over.
pub const MAX_SOURCE: u64 = 1 << 30;

/// Where a client's messages come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Consecutive slices of one random buffer as long as the run: every byte sent is a new one.
    Distinct,
    /// The same random buffer of one message's length, sent again and again.
    OneBuffer,
}

impl Source {
    /// The buffer a client sends `total` bytes from, `msg_size` bytes at a time.
    fn buffer(self, total: u64, msg_size: usize) -> Bytes {
        let len = match self {
            Source::Distinct => usize::try_from(total.min(MAX_SOURCE)).unwrap_or(usize::MAX).max(msg_size),
            Source::OneBuffer => msg_size,
        };
        message(len)
    }
}

/// Consecutive `msg_size` slices of `source`, starting over at its start when one would not fit.
struct Slices {
    source: Bytes,
    at: usize,
}

impl Slices {
    fn next(&mut self, n: usize) -> Bytes {
        if self.at + n > self.source.len() {
            self.at = 0;
        }
        let s = self.source.slice(self.at..self.at + n);
        self.at += n;
        s
    }
}

/// The transport tuning both parties of a raw quinn baseline use: `edge-transport`'s default,
/// or the default with one knob changed (`edge-bench sweep`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TransportVariant {
    /// `Tuning::default()`, as the daemons use it.
    Default,
    /// No UDP GSO: one `sendmsg` per packet.
    GsoOff,
    /// No path MTU discovery: 1200-byte packets.
    MtuDiscoveryOff,
    /// The kernel's default UDP socket buffers instead of 4 MiB.
    KernelSocketBuffers,
    /// quinn's default stream and send windows (1.25 MB, 10 MB) instead of 16 and 64 MiB.
    QuinnWindows,
    /// quinn's BBR instead of Cubic as the sender's congestion controller (`edge-bench
    /// uplink`; not in the loopback sweep, where no controller limits anything).
    Bbr,
    /// The sender asks the receiver (by the ACK-frequency extension) to ACK once more than 3
    /// ack-eliciting packets have arrived instead of every second packet.
    AckThreshold3,
    /// The same, more than 10 packets.
    AckThreshold10,
    /// The same, more than 30 packets.
    AckThreshold30,
}

impl TransportVariant {
    /// The variants of the loopback sweep.
    pub const ALL: [TransportVariant; 8] = [
        TransportVariant::Default,
        TransportVariant::GsoOff,
        TransportVariant::MtuDiscoveryOff,
        TransportVariant::KernelSocketBuffers,
        TransportVariant::QuinnWindows,
        TransportVariant::AckThreshold3,
        TransportVariant::AckThreshold10,
        TransportVariant::AckThreshold30,
    ];

    pub fn tuning(self) -> edge_transport::Tuning {
        let t = edge_transport::Tuning::default();
        match self {
            TransportVariant::Default => t,
            TransportVariant::GsoOff => edge_transport::Tuning { segmentation_offload: false, ..t },
            TransportVariant::MtuDiscoveryOff => edge_transport::Tuning { mtu_discovery: false, ..t },
            TransportVariant::KernelSocketBuffers => edge_transport::Tuning { socket_buffer_bytes: 0, ..t },
            TransportVariant::QuinnWindows => {
                edge_transport::Tuning { stream_receive_window: 1_250_000, send_window: 10_000_000, ..t }
            }
            TransportVariant::Bbr => {
                edge_transport::Tuning { congestion_controller: edge_transport::CongestionController::Bbr, ..t }
            }
            TransportVariant::AckThreshold3 => edge_transport::Tuning { ack_eliciting_threshold: Some(3), ..t },
            TransportVariant::AckThreshold10 => edge_transport::Tuning { ack_eliciting_threshold: Some(10), ..t },
            TransportVariant::AckThreshold30 => edge_transport::Tuning { ack_eliciting_threshold: Some(30), ..t },
        }
    }

    /// The name on the command line and in the sweep's rows.
    pub fn name(self) -> &'static str {
        match self {
            TransportVariant::Default => "default",
            TransportVariant::GsoOff => "gso-off",
            TransportVariant::MtuDiscoveryOff => "mtu-discovery-off",
            TransportVariant::KernelSocketBuffers => "kernel-socket-buffers",
            TransportVariant::QuinnWindows => "quinn-windows",
            TransportVariant::Bbr => "bbr",
            TransportVariant::AckThreshold3 => "ack-threshold3",
            TransportVariant::AckThreshold10 => "ack-threshold10",
            TransportVariant::AckThreshold30 => "ack-threshold30",
        }
    }
}

/// Which baseline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    Quic,
    Tls,
}

/// What a role process prints on its last line, after `RESULT `.
#[derive(Debug, Serialize, Deserialize)]
pub struct RoleResult {
    pub bytes: u64,
    pub seconds: f64,
    pub cpu_s: f64,
    pub detail: String,
}

/// One measured baseline run.
#[derive(Debug, Clone, Copy)]
pub struct Baseline {
    pub mb_s: f64,
    pub sender_cpu_s_per_gib: f64,
    pub receiver_cpu_s_per_gib: f64,
    /// Through a shaping proxy: the UDP payload bytes the client sent towards the server
    /// (including what the path then dropped).
    pub bytes_sent_up: Option<u64>,
}

/// PKI files shared by all baseline runs.
#[derive(Debug, Clone)]
pub struct Pki {
    pub server: edge_transport::ServerTls,
    pub device: edge_transport::pki::DevicePaths,
}

impl Pki {
    pub fn write(dir: &Path) -> anyhow::Result<Pki> {
        let pki = edge_transport::pki::InMemoryPki::generate(&["localhost", "127.0.0.1"])?;
        let server = pki.write_server_files(&dir.join("server"))?.server_tls();
        let device = pki.write_device_files("bench-device", &dir.join("device"))?;
        Ok(Pki { server, device })
    }

    fn from_dir(dir: &Path) -> Pki {
        Pki {
            server: edge_transport::ServerTls {
                cert: dir.join("server/server.pem"),
                key: dir.join("server/server.key"),
                client_ca: dir.join("server/ca.pem"),
                crls: Vec::new(),
            },
            device: edge_transport::pki::DevicePaths {
                cert: dir.join("device/device.pem"),
                key: dir.join("device/device.key"),
                ca_cert: dir.join("device/ca.pem"),
            },
        }
    }
}

/// Runs one baseline: spawns the server role, then the client role, and combines their results.
pub async fn run(
    kind: Kind,
    pki_dir: &Path,
    total: u64,
    msg_size: usize,
    source: Source,
    variant: TransportVariant,
    via: Option<edge_testkit::netem::NetemConfig>,
) -> anyhow::Result<Baseline> {
    let exe = std::env::current_exe()?;
    let k = match kind {
        Kind::Quic => "quic",
        Kind::Tls => "tls",
    };
    let mut server = tokio::process::Command::new(&exe)
        .args(["role", "server", "--kind", k, "--pki"])
        .arg(pki_dir)
        .args(["--bytes", &total.to_string(), "--transport", variant.name()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("spawning the baseline server role")?;
    let mut lines = BufReader::new(server.stdout.take().context("server stdout")?).lines();
    let port_line = lines.next_line().await?.context("server role exited before printing its port")?;
    let port: u16 = port_line.strip_prefix("PORT ").context("expected PORT line")?.trim().parse()?;
    // With a path, the client goes through a shaping proxy in front of the server.
    let proxy = match via {
        Some(config) => Some(crate::uplink::Proxy::start(SocketAddr::from(([127, 0, 0, 1], port)), config).await?),
        None => None,
    };
    let port = proxy.as_ref().map_or(port, |p| p.addr().port());
    let mut client = tokio::process::Command::new(&exe);
    client.args(["role", "client", "--kind", k, "--pki"]).arg(pki_dir).args([
        "--bytes",
        &total.to_string(),
        "--msg-size",
        &msg_size.to_string(),
        "--port",
        &port.to_string(),
        "--transport",
        variant.name(),
    ]);
    if source == Source::OneBuffer {
        client.arg("--one-buffer");
    }
    let client = client
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .context("spawning the baseline client role")?;
    let client_out = tokio::time::timeout(std::time::Duration::from_secs(120), client.wait_with_output())
        .await
        .context("baseline client timed out")??;
    let mut server_result = None;
    while let Some(line) = lines.next_line().await? {
        if let Some(json) = line.strip_prefix("RESULT ") {
            server_result = Some(serde_json::from_str::<RoleResult>(json)?);
        }
    }
    let _ = server.wait().await;
    let server_result = server_result.context("the server role printed no RESULT")?;
    let client_text = String::from_utf8_lossy(&client_out.stdout);
    let client_result: RoleResult = client_text
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .map(serde_json::from_str)
        .transpose()?
        .context("the client role printed no RESULT")?;
    if server_result.bytes < total {
        bail!("baseline server received {} of {} bytes", server_result.bytes, total);
    }
    let gib = total as f64 / (1u64 << 30) as f64;
    Ok(Baseline {
        mb_s: total as f64 / server_result.seconds / 1e6,
        sender_cpu_s_per_gib: client_result.cpu_s / gib,
        receiver_cpu_s_per_gib: server_result.cpu_s / gib,
        bytes_sent_up: proxy.map(|p| p.handle().stats().to_server.received_bytes),
    })
}

/// One party of a baseline, as the `role` subcommand describes it.
#[derive(Debug, Clone, Copy)]
pub struct Role {
    pub server: bool,
    pub kind: Kind,
    pub bytes: u64,
    pub msg_size: usize,
    /// The server's port (client only).
    pub port: u16,
    pub source: Source,
    pub variant: TransportVariant,
}

/// Entry point of the `role` subcommand (runs in its own process, one current-thread runtime,
/// so each party has at most one core, as the daemons' hot paths do).
pub fn role(r: Role, pki_dir: &Path) -> anyhow::Result<()> {
    let Role { server, kind, bytes, msg_size, port, source, variant } = r;
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let pki = Pki::from_dir(pki_dir);
    let result = rt.block_on(async {
        match (server, kind) {
            (true, Kind::Quic) => quic_server(&pki, bytes, variant.tuning()).await,
            (false, Kind::Quic) => quic_client(&pki, bytes, msg_size, port, source, variant.tuning()).await,
            (true, Kind::Tls) => tls_server(&pki, bytes).await,
            (false, Kind::Tls) => tls_client(&pki, bytes, msg_size, port, source).await,
        }
    })?;
    println!("RESULT {}", serde_json::to_string(&result)?);
    Ok(())
}

pub(crate) fn message(msg_size: usize) -> Bytes {
    use rand::RngCore;
    let mut v = vec![0u8; msg_size];
    rand::rng().fill_bytes(&mut v);
    Bytes::from(v)
}

async fn quic_server(pki: &Pki, total: u64, tuning: edge_transport::Tuning) -> anyhow::Result<RoleResult> {
    let config = edge_transport::server_config(&pki.server, &tuning)?;
    let endpoint = edge_transport::server_endpoint("127.0.0.1:0".parse()?, config, &tuning)?;
    println!("PORT {}", endpoint.local_addr()?.port());
    use std::io::Write;
    std::io::stdout().flush()?;
    let incoming = endpoint.accept().await.context("endpoint closed")?;
    let conn = incoming.await?;
    let start = Instant::now();
    let cpu0 = sys::self_cpu_seconds()?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<u64>();
    let mut received = 0u64;
    loop {
        tokio::select! {
            stream = conn.accept_uni() => {
                let mut recv = stream?;
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while let Ok(Some(chunk)) = recv.read_chunk(usize::MAX, false).await {
                        n += chunk.bytes.len() as u64;
                    }
                    let _ = tx.send(n);
                });
            }
            Some(n) = rx.recv() => {
                received += n;
                if received >= total {
                    break;
                }
            }
        }
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu_s = sys::self_cpu_seconds()? - cpu0;
    // How often the receiver acknowledged: what the ACK-frequency variants of the sweep change.
    let stats = conn.stats();
    eprintln!(
        "raw quinn receiver: {} ACK frames sent, {} packets received",
        stats.frame_tx.acks, stats.udp_rx.datagrams
    );
    conn.close(0u32.into(), b"done");
    endpoint.wait_idle().await;
    Ok(RoleResult { bytes: received, seconds, cpu_s, detail: String::new() })
}

async fn quic_client(
    pki: &Pki,
    total: u64,
    msg_size: usize,
    port: u16,
    source: Source,
    tuning: edge_transport::Tuning,
) -> anyhow::Result<RoleResult> {
    let config = edge_transport::client_config(&pki.device.client_tls("localhost"), &tuning)?;
    let endpoint = edge_transport::client_endpoint("127.0.0.1:0".parse()?, &tuning)?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    // Made before connecting: the server's clock starts at the handshake.
    let mut msgs = Slices { source: source.buffer(total, msg_size), at: 0 };
    let conn = endpoint.connect_with(config, addr, "localhost")?.await?;
    let start = Instant::now();
    let cpu0 = sys::self_cpu_seconds()?;
    let mut sent = 0u64;
    while sent < total {
        let mut s = conn.open_uni().await?;
        let n = msg_size.min((total - sent) as usize);
        s.write_chunk(msgs.next(n)).await?;
        s.finish()?;
        sent += n as u64;
    }
    let reason = conn.closed().await;
    let seconds = start.elapsed().as_secs_f64();
    let cpu_s = sys::self_cpu_seconds()? - cpu0;
    endpoint.wait_idle().await;
    Ok(RoleResult { bytes: sent, seconds, cpu_s, detail: format!("{reason}") })
}

fn rustls_server_config(pki: &Pki) -> anyhow::Result<rustls::ServerConfig> {
    let certs: Vec<CertificateDer<'static>> =
        CertificateDer::pem_file_iter(&pki.server.cert)?.collect::<Result<_, _>>()?;
    let key = PrivateKeyDer::from_pem_file(&pki.server.key)?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(&pki.server.client_ca)? {
        roots.add(ca?)?;
    }
    let provider = edge_transport::crypto_provider();
    let verifier =
        rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_single_cert(certs, key)?;
    Ok(config)
}

async fn tls_server(pki: &Pki, total: u64) -> anyhow::Result<RoleResult> {
    let mut config = rustls_server_config(pki)?;
    config.alpn_protocols = vec![edge_transport::ALPN.to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    println!("PORT {}", listener.local_addr()?.port());
    use std::io::Write;
    std::io::stdout().flush()?;
    let (tcp, _) = listener.accept().await?;
    tcp.set_nodelay(true)?;
    let mut tls = acceptor.accept(tcp).await?;
    let suite = tls.get_ref().1.negotiated_cipher_suite().map(|s| format!("{:?}", s.suite())).unwrap_or_default();
    let start = Instant::now();
    let cpu0 = sys::self_cpu_seconds()?;
    let mut buf = vec![0u8; 256 * 1024];
    let mut received = 0u64;
    while received < total {
        let n = tls.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        received += n as u64;
    }
    let seconds = start.elapsed().as_secs_f64();
    let cpu_s = sys::self_cpu_seconds()? - cpu0;
    let _ = tls.shutdown().await;
    Ok(RoleResult { bytes: received, seconds, cpu_s, detail: suite })
}

async fn tls_client(pki: &Pki, total: u64, msg_size: usize, port: u16, source: Source) -> anyhow::Result<RoleResult> {
    let cert = std::fs::read_to_string(&pki.device.cert)?;
    let key = std::fs::read_to_string(&pki.device.key)?;
    let ca = std::fs::read_to_string(&pki.device.ca_cert)?;
    let config = edge_transport::rustls_client_config_from_pem(&cert, &key, &ca)?;
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let mut msgs = Slices { source: source.buffer(total, msg_size), at: 0 };
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
    tcp.set_nodelay(true)?;
    let mut tls = connector.connect(ServerName::try_from("localhost")?, tcp).await?;
    let start = Instant::now();
    let cpu0 = sys::self_cpu_seconds()?;
    let mut sent = 0u64;
    while sent < total {
        let n = msg_size.min((total - sent) as usize);
        tls.write_all(&msgs.next(n)).await?;
        sent += n as u64;
    }
    tls.flush().await?;
    // Wait for the server's close so the CPU covers the whole transfer.
    let mut rest = Vec::new();
    let _ = tls.read_to_end(&mut rest).await;
    let seconds = start.elapsed().as_secs_f64();
    let cpu_s = sys::self_cpu_seconds()? - cpu0;
    let suite = tls.get_ref().1.negotiated_cipher_suite().map(|s| format!("{:?}", s.suite())).unwrap_or_default();
    Ok(RoleResult { bytes: sent, seconds, cpu_s, detail: suite })
}

/// Reconnect figures: milliseconds from `connect()` until the first 10 KiB chunk on a new
/// connection is acknowledged by the server's QUIC stack (`SendStream::stopped`), medians over
/// `n` connections each.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct Reconnect {
    pub full_ms: f64,
    pub resumed_ms: f64,
    pub zero_rtt_written_ms: f64,
    pub zero_rtt_acked_ms: f64,
    pub zero_rtt_accepted: u32,
    pub n: u32,
}

/// Runs the reconnect measurement between a server and a client process.
pub async fn reconnect(pki_dir: &Path, n: u32) -> anyhow::Result<Reconnect> {
    let exe = std::env::current_exe()?;
    let mut server = tokio::process::Command::new(&exe)
        .args(["role", "handshake-server", "--kind", "quic", "--bytes", "0", "--pki"])
        .arg(pki_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()?;
    let mut lines = BufReader::new(server.stdout.take().context("server stdout")?).lines();
    let port_line = lines.next_line().await?.context("handshake server printed no port")?;
    let port: u16 = port_line.strip_prefix("PORT ").context("expected PORT line")?.trim().parse()?;
    let out = tokio::process::Command::new(&exe)
        .args(["role", "handshake-client", "--kind", "quic", "--pki"])
        .arg(pki_dir)
        .args(["--bytes", &n.to_string(), "--port", &port.to_string()])
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .output()
        .await?;
    let _ = server.kill().await;
    let text = String::from_utf8_lossy(&out.stdout);
    let json = text.lines().find_map(|l| l.strip_prefix("RESULT ")).context("handshake client printed no RESULT")?;
    Ok(serde_json::from_str(json)?)
}

/// Entry point of the handshake roles (`--bytes` carries the connection count for the client).
pub fn handshake_role(server: bool, pki_dir: &Path, n: u64, port: u16) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    let pki = Pki::from_dir(pki_dir);
    rt.block_on(async {
        if server { handshake_server(&pki).await } else { handshake_client(&pki, n as u32, port).await }
    })
}

async fn handshake_server(pki: &Pki) -> anyhow::Result<()> {
    let tuning = edge_transport::Tuning::default();
    let config = edge_transport::server_config(&pki.server, &tuning)?;
    let endpoint = edge_transport::server_endpoint("127.0.0.1:0".parse()?, config, &tuning)?;
    println!("PORT {}", endpoint.local_addr()?.port());
    use std::io::Write;
    std::io::stdout().flush()?;
    while let Some(incoming) = endpoint.accept().await {
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok(mut s) = conn.accept_uni().await {
                tokio::spawn(async move { while let Ok(Some(_)) = s.read_chunk(usize::MAX, false).await {} });
            }
        });
    }
    Ok(())
}

async fn handshake_client(pki: &Pki, n: u32, port: u16) -> anyhow::Result<()> {
    let tuning = edge_transport::Tuning::default();
    let tls = pki.device.client_tls("localhost");
    let endpoint = edge_transport::client_endpoint("127.0.0.1:0".parse()?, &tuning)?;
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse()?;
    let msg = message(10 * 1024);
    let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
    // Full handshakes: a fresh config (and so an empty session store) per connection.
    let mut full = Vec::new();
    for i in 0..n + 5 {
        let config = edge_transport::client_config(&tls, &tuning)?;
        let t = Instant::now();
        let conn = endpoint.connect_with(config, addr, "localhost")?.await?;
        let mut s = conn.open_uni().await?;
        s.write_chunk(msg.clone()).await?;
        s.finish()?;
        let _ = s.stopped().await;
        if i >= 5 {
            full.push(ms(t));
        }
        conn.close(0u32.into(), b"");
    }
    // Resumed: one shared config, as the agent keeps across reconnects; 1-RTT with a ticket.
    let shared = edge_transport::client_config(&tls, &tuning)?;
    let mut resumed = Vec::new();
    for i in 0..n + 5 {
        let t = Instant::now();
        let conn = endpoint.connect_with(shared.clone(), addr, "localhost")?.await?;
        let mut s = conn.open_uni().await?;
        s.write_chunk(msg.clone()).await?;
        s.finish()?;
        let _ = s.stopped().await;
        if i >= 5 {
            resumed.push(ms(t));
        }
        // Keep the connection a moment so the next ticket arrives before closing.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        conn.close(0u32.into(), b"");
    }
    // 0-RTT: the chunk goes out with the first flight.
    let mut written = Vec::new();
    let mut acked = Vec::new();
    let mut accepted = 0u32;
    for i in 0..n + 5 {
        let t = Instant::now();
        let connecting = endpoint.connect_with(shared.clone(), addr, "localhost")?;
        let (conn, zero) = match connecting.into_0rtt() {
            Ok((conn, zero)) => (conn, Some(zero)),
            Err(connecting) => (connecting.await?, None),
        };
        let mut s = conn.open_uni().await?;
        s.write_chunk(msg.clone()).await?;
        s.finish()?;
        let w = ms(t);
        let ok = match zero {
            Some(z) => z.await,
            None => false,
        };
        let _ = s.stopped().await;
        if i >= 5 {
            written.push(w);
            acked.push(ms(t));
            accepted += u32::from(ok);
        }
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        conn.close(0u32.into(), b"");
    }
    endpoint.wait_idle().await;
    let med = |v: &[f64]| sys::Stat::of(v).map_or(f64::NAN, |s| s.median);
    let r = Reconnect {
        full_ms: med(&full),
        resumed_ms: med(&resumed),
        zero_rtt_written_ms: med(&written),
        zero_rtt_acked_ms: med(&acked),
        zero_rtt_accepted: accepted,
        n,
    };
    println!("RESULT {}", serde_json::to_string(&r)?);
    Ok(())
}

/// Where the baseline PKI lives for a run.
pub fn pki_dir(work: &Path) -> PathBuf {
    work.join("pki")
}
