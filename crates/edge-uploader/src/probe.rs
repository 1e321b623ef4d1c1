//! A cheap test of whether the ingest server answers again, for the uploader's backoff wait
//! after attempts that got no answer at all (`upload.probe_interval`).
//!
//! A connection attempt costs the server a TLS handshake (signatures, certificate checks) and
//! the fleet's backoff exists to spread those out. A QUIC server answers a datagram that names
//! a version it does not speak with a Version Negotiation packet (RFC 9000, 6.1; RFC 8999),
//! without keeping any state or doing any crypto. So, while the uploader waits, it sends such a
//! datagram now and then from a socket of its own; an answer that echoes the probe's random
//! connection IDs and lists QUIC version 1 proves that the server is up and the path carries
//! its datagrams both ways, and ends the wait.
//!
//! The probe has to be a datagram of at least 1,200 bytes: servers must not answer shorter ones
//! (RFC 9000, 5.2.2), so that a spoofed source cannot make them amplify. The answer is a few
//! dozen bytes.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use rand::Rng;
use tokio::net::UdpSocket;
use tracing::debug;

/// Size of a probe: the smallest datagram a QUIC server answers when it does not know the
/// version (RFC 9000, 14.1).
pub const PROBE_BYTES: usize = 1200;

/// The version the probe names: of the form `0x?a?a?a?a`, which RFC 9000 (15) reserves so that
/// no server ever speaks it and every server answers it with Version Negotiation.
pub const RESERVED_VERSION: u32 = 0x1a2a_3a4a;

/// QUIC version 1 (RFC 9000), the one the agent connects with.
const QUIC_V1: u32 = 1;

/// Length of the probe's connection IDs: 16 random bytes in all, which an off-path sender cannot
/// guess.
const CID_LEN: usize = 8;

/// The random connection IDs one probing period sends in every probe, so that an answer to any
/// of its probes (a late one included) counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProbeIds {
    pub dcid: [u8; CID_LEN],
    pub scid: [u8; CID_LEN],
}

impl ProbeIds {
    pub fn random() -> Self {
        let mut rng = rand::rng();
        Self { dcid: rng.random(), scid: rng.random() }
    }
}

/// The probe datagram: a long header naming [`RESERVED_VERSION`], the two connection IDs, and
/// zeros up to [`PROBE_BYTES`].
pub fn packet(ids: &ProbeIds) -> Vec<u8> {
    let mut p = Vec::with_capacity(PROBE_BYTES);
    // Long header form and the fixed bit; the type bits mean nothing in an unknown version.
    p.push(0xc0);
    p.extend_from_slice(&RESERVED_VERSION.to_be_bytes());
    p.push(CID_LEN as u8);
    p.extend_from_slice(&ids.dcid);
    p.push(CID_LEN as u8);
    p.extend_from_slice(&ids.scid);
    p.resize(PROBE_BYTES, 0);
    p
}

/// Whether `datagram` is a Version Negotiation packet answering a probe of `ids` (its
/// destination ID is the probe's source ID and the other way round) from a server that speaks
/// QUIC version 1. Anything else, however malformed, is not.
pub fn is_answer(datagram: &[u8], ids: &ProbeIds) -> bool {
    let Some((&first, rest)) = datagram.split_first() else { return false };
    if first & 0x80 == 0 {
        return false;
    }
    let Some((version, rest)) = rest.split_first_chunk::<4>() else { return false };
    if u32::from_be_bytes(*version) != 0 {
        return false;
    }
    let Some((dcid, rest)) = cid(rest) else { return false };
    let Some((scid, versions)) = cid(rest) else { return false };
    if dcid != ids.scid || scid != ids.dcid || versions.is_empty() || versions.len() % 4 != 0 {
        return false;
    }
    versions.chunks_exact(4).any(|v| v == QUIC_V1.to_be_bytes())
}

/// A length-prefixed connection ID and what follows it.
fn cid(buf: &[u8]) -> Option<(&[u8], &[u8])> {
    let (&len, rest) = buf.split_first()?;
    let len = usize::from(len);
    (rest.len() >= len).then(|| rest.split_at(len))
}

/// Sends a probe to the server every `interval`, the first one at `first` (at once if that has
/// passed), from a socket bound to `bind_ip`, and resolves with the server's address at the
/// first answer. Failures (no socket, no route, an ICMP error, a stray datagram) only wait for
/// the next probe; the caller bounds the whole by the backoff's wait. `resolve` is asked for the
/// server's address until it gives one. Every probe sent adds one to `sent`.
pub async fn until_answered<F, Fut>(
    resolve: F,
    bind_ip: IpAddr,
    first: tokio::time::Instant,
    interval: Duration,
    sent: &AtomicU64,
) -> SocketAddr
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<SocketAddr>>,
{
    let ids = ProbeIds::random();
    let probe = packet(&ids);
    let mut tick = tokio::time::interval_at(first, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut socket: Option<(UdpSocket, SocketAddr)> = None;
    // Room for any answer; one that fills it is not a Version Negotiation of ours anyway.
    let mut buf = vec![0u8; 1500];
    loop {
        tokio::select! {
            _ = tick.tick() => {
                if socket.is_none() {
                    match open(&resolve, bind_ip).await {
                        Ok(s) => socket = Some(s),
                        Err(e) => {
                            debug!(error = %e, "probe: no socket to the server yet");
                            continue;
                        }
                    }
                }
                if let Some((s, server)) = &socket {
                    match s.send(&probe).await {
                        Ok(_) => {
                            sent.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => debug!(%server, error = %e, "probe: send failed"),
                    }
                }
            }
            r = recv(socket.as_ref().map(|(s, _)| s), &mut buf) => match r {
                Ok(n) if is_answer(&buf[..n], &ids) => {
                    if let Some((_, server)) = socket {
                        return server;
                    }
                }
                Ok(n) => debug!(bytes = n, "probe: a datagram that is not an answer; ignored"),
                // An ICMP error for an earlier probe (port unreachable: the host is up, the
                // server is not): the next probe will tell.
                Err(e) => debug!(error = %e, "probe: no answer"),
            },
        }
    }
}

/// A UDP socket on `bind_ip`, connected to the server's address (so only its datagrams arrive
/// and ICMP errors are reported).
async fn open<F, Fut>(resolve: &F, bind_ip: IpAddr) -> anyhow::Result<(UdpSocket, SocketAddr)>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<SocketAddr>>,
{
    let server = resolve().await?;
    let socket = UdpSocket::bind(SocketAddr::new(bind_ip, 0)).await?;
    socket.connect(server).await?;
    Ok((socket, server))
}

async fn recv(socket: Option<&UdpSocket>, buf: &mut [u8]) -> std::io::Result<usize> {
    match socket {
        Some(s) => s.recv(buf).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Version Negotiation answering `ids`, as a server lays it out.
    fn answer(ids: &ProbeIds, versions: &[u32]) -> Vec<u8> {
        let mut a = vec![0x80 | 0x4a, 0, 0, 0, 0, CID_LEN as u8];
        a.extend_from_slice(&ids.scid);
        a.push(CID_LEN as u8);
        a.extend_from_slice(&ids.dcid);
        for v in versions {
            a.extend_from_slice(&v.to_be_bytes());
        }
        a
    }

    #[test]
    fn the_probe_is_a_full_size_long_header_of_a_reserved_version() {
        let ids = ProbeIds::random();
        let p = packet(&ids);
        assert_eq!(p.len(), PROBE_BYTES);
        assert_eq!(p[0] & 0xc0, 0xc0, "long header, fixed bit");
        let version = u32::from_be_bytes([p[1], p[2], p[3], p[4]]);
        assert_eq!(version & 0x0f0f_0f0f, 0x0a0a_0a0a, "reserved pattern 0x?a?a?a?a: {version:#x}");
        assert_eq!(&p[5..6 + CID_LEN], [&[CID_LEN as u8][..], &ids.dcid].concat());
        assert_eq!(&p[6 + CID_LEN..7 + 2 * CID_LEN], [&[CID_LEN as u8][..], &ids.scid].concat());
        assert_ne!(ProbeIds::random(), ids, "fresh IDs each time");
    }

    #[test]
    fn only_a_version_negotiation_echoing_the_ids_and_listing_v1_is_an_answer() {
        let ids = ProbeIds::random();
        assert!(is_answer(&answer(&ids, &[0x0a1a_2a3a, 1]), &ids));
        assert!(!is_answer(&answer(&ids, &[0xff00_001d]), &ids), "no version 1");
        assert!(!is_answer(&answer(&ids, &[]), &ids), "no versions");
        let other = ProbeIds::random();
        assert!(!is_answer(&answer(&other, &[1]), &ids), "another probe's IDs");
        let swapped = ProbeIds { dcid: ids.scid, scid: ids.dcid };
        assert!(!is_answer(&answer(&swapped, &[1]), &ids), "IDs not swapped back");
        let mut not_vn = answer(&ids, &[1]);
        not_vn[4] = 1;
        assert!(!is_answer(&not_vn, &ids), "a version that is not 0");
        let mut short = answer(&ids, &[1]);
        short[0] = 0x40;
        assert!(!is_answer(&short, &ids), "short header");
        let mut ragged = answer(&ids, &[1]);
        ragged.push(0);
        assert!(!is_answer(&ragged, &ids), "versions not a multiple of 4 bytes");
        let mut long_cid = answer(&ids, &[1]);
        long_cid[5] = 255;
        assert!(!is_answer(&long_cid, &ids), "a CID length past the end");
        let full = answer(&ids, &[1]);
        for n in 0..full.len() {
            assert!(!is_answer(&full[..n], &ids), "truncated to {n} bytes");
        }
        assert!(!is_answer(&packet(&ids), &ids), "our own probe reflected");
    }

    #[tokio::test]
    async fn probing_goes_on_through_stray_datagrams_until_a_true_answer() {
        let server = UdpSocket::bind("127.0.0.1:0").await.expect("bind");
        let addr = server.local_addr().expect("address");
        let sent = AtomicU64::new(0);
        let responder = async {
            let mut buf = vec![0u8; 2048];
            let mut probes = Vec::new();
            // Answers the first probe with junk, the second with another probe's IDs, the third
            // properly.
            loop {
                let (n, from) = server.recv_from(&mut buf).await.expect("receive");
                assert_eq!(n, PROBE_BYTES);
                assert_eq!(buf[1..5], RESERVED_VERSION.to_be_bytes());
                let ids =
                    ProbeIds { dcid: buf[6..14].try_into().expect("8"), scid: buf[15..23].try_into().expect("8") };
                probes.push(ids);
                let reply = match probes.len() {
                    1 => b"not quic".to_vec(),
                    2 => answer(&ProbeIds::random(), &[1]),
                    _ => answer(&ids, &[1]),
                };
                server.send_to(&reply, from).await.expect("reply");
                if probes.len() == 3 {
                    return probes;
                }
            }
        };
        let now = tokio::time::Instant::now();
        let probing = until_answered(|| async { Ok(addr) }, addr.ip(), now, Duration::from_millis(50), &sent);
        let (answered, probes) =
            tokio::time::timeout(Duration::from_secs(30), async { tokio::join!(probing, responder) })
                .await
                .expect("answered within 30 s");
        assert_eq!(answered, addr);
        // A fourth may have gone out if the machine stalled for the interval before the answer.
        assert!(sent.load(Ordering::Relaxed) >= 3, "{sent:?}");
        assert!(probes.windows(2).all(|w| w[0] == w[1]), "one pair of IDs for the whole wait: {probes:?}");
    }
}
