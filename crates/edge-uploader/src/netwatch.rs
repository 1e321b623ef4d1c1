//! The gateway's own network, watched through rtnetlink, so that the uploader does not sleep
//! through the return of its path.
//!
//! While the ingest is unreachable the uploader's backoff grows to `upload.backoff_max` (30 s by
//! default), which spreads a fleet's reconnections when an ingest comes back. When the outage
//! was the gateway's own link (a modem dropping its bearer, a cable pulled), the kernel says
//! when the path may be back: a link comes up, a default route appears. The watch counts those
//! events and the uploader ends its backoff wait at the next one, so it connects a moment after
//! the link is back instead of up to `backoff_max` later. Each gateway's link is its own, so
//! this does not bunch a fleet's attempts together the way a shared short backoff would.
//!
//! Only a path's appearance counts: a link going from not running to running (per interface
//! index; the first message about an interface that is running counts too) and a unicast
//! default route being added. Links going down, addresses and every other route are ignored,
//! so wireless statistics, neighbour churn and the like do not wake the uploader. Nothing but
//! the messages' fixed headers is read.

use std::collections::HashMap;

use netlink_sys::protocols::NETLINK_ROUTE;
use netlink_sys::{AsyncSocket, AsyncSocketExt, SocketAddr, TokioSocket};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

/// What the uploader holds: the number of path events seen so far, as a watch.
#[derive(Debug, Clone)]
pub struct NetEvents {
    rx: watch::Receiver<u64>,
}

impl NetEvents {
    /// A source fed by hand (tests, and callers without a watch of their own): every
    /// `send_modify` on the sender is one event.
    pub fn manual() -> (watch::Sender<u64>, NetEvents) {
        let (tx, rx) = watch::channel(0);
        (tx, NetEvents { rx })
    }

    /// Forgets the events seen so far: [`changed`](Self::changed) waits for the next one.
    pub fn mark_seen(&mut self) {
        self.rx.mark_unchanged();
    }

    /// Resolves at the first event since the last [`mark_seen`](Self::mark_seen); never if the
    /// watch has stopped.
    pub async fn changed(&mut self) {
        if self.rx.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// rtnetlink multicast groups: links, IPv4 and IPv6 routes.
const GROUPS: u32 = (libc::RTMGRP_LINK | libc::RTMGRP_IPV4_ROUTE | libc::RTMGRP_IPV6_ROUTE) as u32;

/// Large enough for any one datagram of link or route notifications.
const RECV_BUF: usize = 64 * 1024;

/// Opens the rtnetlink socket and spawns the task that reads it until `cancel`. Fails if the socket cannot be opened (a sandbox without `AF_NETLINK`); the
/// uploader then simply waits out its backoff.
pub fn spawn(cancel: CancellationToken) -> std::io::Result<NetEvents> {
    let mut socket = TokioSocket::new(NETLINK_ROUTE)?;
    socket.socket_mut().bind(&SocketAddr::new(0, GROUPS))?;
    let (tx, rx) = watch::channel(0u64);
    tokio::spawn(async move {
        let mut links = HashMap::new();
        let mut buf = Vec::with_capacity(RECV_BUF);
        loop {
            buf.clear();
            let received = tokio::select! {
                () = cancel.cancelled() => break,
                r = socket.recv(&mut buf) => r,
            };
            let events = match received {
                Ok(()) => path_events(&buf, &mut links),
                // The kernel dropped notifications that did not fit the socket's buffer; one of
                // them may have been the path's return.
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => 1,
                Err(e) => {
                    warn!(error = %e, "network watch stopped; reconnecting on the backoff alone");
                    break;
                }
            };
            if events > 0 {
                debug!(events, "a link came up or a default route appeared");
                tx.send_modify(|n| *n += events);
            }
        }
    });
    Ok(NetEvents { rx })
}

const NLMSG_HDRLEN: usize = 16;

fn ne_u16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn ne_u32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

/// Path events in one datagram of rtnetlink messages. `links` holds whether each interface
/// index was last seen running, for the interfaces that exist. A malformed message ends the datagram's reading.
fn path_events(datagram: &[u8], links: &mut HashMap<u32, bool>) -> u64 {
    const RUNNING: u32 = (libc::IFF_UP | libc::IFF_RUNNING) as u32;
    let mut events = 0;
    let mut rest = datagram;
    while let (Some(len), Some(kind)) = (ne_u32(rest, 0), ne_u16(rest, 4)) {
        let len = len as usize;
        if len < NLMSG_HDRLEN || len > rest.len() {
            break;
        }
        let body = &rest[NLMSG_HDRLEN..len];
        match kind {
            // struct ifinfomsg: family, pad, type (u16), index (i32), flags (u32), change (u32).
            libc::RTM_NEWLINK | libc::RTM_DELLINK => {
                if let (Some(index), Some(flags)) = (ne_u32(body, 4), ne_u32(body, 8)) {
                    if kind == libc::RTM_DELLINK {
                        // Forgotten, so interfaces that come and go (containers' veths) do not
                        // grow the map.
                        links.remove(&index);
                    } else {
                        let running = flags & RUNNING == RUNNING;
                        if links.insert(index, running) != Some(true) && running {
                            events += 1;
                        }
                    }
                }
            }
            // struct rtmsg: family, dst_len, src_len, tos, table, protocol, scope, type.
            libc::RTM_NEWROUTE => {
                if let (Some(&dst_len), Some(&table), Some(&kind)) = (body.get(1), body.get(4), body.get(7))
                    && dst_len == 0
                    && kind == libc::RTN_UNICAST
                    && table != libc::RT_TABLE_LOCAL
                {
                    events += 1;
                }
            }
            _ => {}
        }
        // Messages are 4-byte aligned within a datagram.
        rest = rest.get(len.next_multiple_of(4)..).unwrap_or_default();
    }
    events
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(kind: u16, body: &[u8]) -> Vec<u8> {
        let len = (NLMSG_HDRLEN + body.len()) as u32;
        let mut m = Vec::new();
        m.extend_from_slice(&len.to_ne_bytes());
        m.extend_from_slice(&kind.to_ne_bytes());
        m.extend_from_slice(&[0; 10]);
        m.extend_from_slice(body);
        while m.len() % 4 != 0 {
            m.push(0);
        }
        m
    }

    fn link(kind: u16, index: u32, flags: i32) -> Vec<u8> {
        let mut b = vec![0u8; 4];
        b.extend_from_slice(&index.to_ne_bytes());
        b.extend_from_slice(&(flags as u32).to_ne_bytes());
        b.extend_from_slice(&0u32.to_ne_bytes());
        // An attribute after the fixed header, as the kernel sends (IFLA_IFNAME "wwan0").
        b.extend_from_slice(&[10, 0, 3, 0, b'w', b'w', b'a', b'n', b'0', 0]);
        msg(kind, &b)
    }

    fn route(dst_len: u8, table: u8, kind: u8) -> Vec<u8> {
        msg(libc::RTM_NEWROUTE, &[libc::AF_INET as u8, dst_len, 0, 0, table, 4, 0, kind, 0, 0, 0, 0])
    }

    const UP: i32 = libc::IFF_UP | libc::IFF_RUNNING;

    #[test]
    fn a_link_counts_when_it_starts_running_not_while_it_runs() {
        let mut links = HashMap::new();
        assert_eq!(path_events(&link(libc::RTM_NEWLINK, 3, libc::IFF_UP), &mut links), 0, "up, no carrier");
        assert_eq!(path_events(&link(libc::RTM_NEWLINK, 3, UP), &mut links), 1, "carrier came");
        assert_eq!(path_events(&link(libc::RTM_NEWLINK, 3, UP), &mut links), 0, "still running");
        assert_eq!(path_events(&link(libc::RTM_NEWLINK, 3, 0), &mut links), 0, "went down");
        assert_eq!(path_events(&link(libc::RTM_NEWLINK, 3, UP), &mut links), 1, "back");
        assert_eq!(path_events(&link(libc::RTM_DELLINK, 3, UP), &mut links), 0, "removed");
        assert!(links.is_empty(), "a removed interface is forgotten");
        assert_eq!(path_events(&link(libc::RTM_NEWLINK, 3, UP), &mut links), 1, "a new interface");
        assert_eq!(path_events(&link(libc::RTM_NEWLINK, 4, UP), &mut links), 1, "first news of another one");
    }

    #[test]
    fn only_unicast_default_routes_outside_the_local_table_count() {
        let mut links = HashMap::new();
        assert_eq!(path_events(&route(0, libc::RT_TABLE_MAIN, libc::RTN_UNICAST), &mut links), 1);
        assert_eq!(path_events(&route(24, libc::RT_TABLE_MAIN, libc::RTN_UNICAST), &mut links), 0);
        assert_eq!(path_events(&route(0, libc::RT_TABLE_LOCAL, libc::RTN_UNICAST), &mut links), 0);
        assert_eq!(path_events(&route(0, libc::RT_TABLE_MAIN, libc::RTN_UNREACHABLE), &mut links), 0);
    }

    #[test]
    fn several_messages_in_one_datagram_are_all_read() {
        let mut links = HashMap::new();
        let mut d = link(libc::RTM_NEWLINK, 7, UP);
        d.extend(msg(libc::RTM_NEWADDR, &[0; 8]));
        d.extend(route(0, libc::RT_TABLE_MAIN, libc::RTN_UNICAST));
        assert_eq!(path_events(&d, &mut links), 2);
    }

    #[test]
    fn malformed_datagrams_end_the_reading_without_a_panic() {
        let mut links = HashMap::new();
        let good = route(0, libc::RT_TABLE_MAIN, libc::RTN_UNICAST);
        assert_eq!(path_events(&[], &mut links), 0);
        assert_eq!(path_events(&good[..10], &mut links), 0, "shorter than a header");
        assert_eq!(path_events(&good[..good.len() - 4], &mut links), 0, "shorter than its length");
        let mut zero = good.clone();
        zero[..4].copy_from_slice(&0u32.to_ne_bytes());
        assert_eq!(path_events(&zero, &mut links), 0, "a zero length must not loop");
        let mut huge = good.clone();
        huge[..4].copy_from_slice(&u32::MAX.to_ne_bytes());
        assert_eq!(path_events(&huge, &mut links), 0);
        // A link message too short for its fixed header is skipped, and the next one read.
        let mut d = msg(libc::RTM_NEWLINK, &[0; 6]);
        d.extend(good);
        assert_eq!(path_events(&d, &mut links), 1);
    }
}
