//! QUIC endpoints on UDP sockets we create ourselves (via socket2) so the socket buffers can be
//! sized before quinn takes the socket over.
//!
//! 4 MiB `SO_RCVBUF`/`SO_SNDBUF` removed the kernel UDP drops seen with the 208 KiB default;
//! each drop costs a whole GSO batch and makes the congestion controller back off. The kernel
//! silently caps the request at `net.core.rmem_max` / `wmem_max`, so we read the sizes back
//! and warn with the granted size when they fall short.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;

use quinn::{Endpoint, EndpointConfig, TokioRuntime};
use socket2::{Domain, Protocol, Socket, Type};

use crate::{TransportError, Tuning};

/// A bound UDP socket and the buffer sizes the kernel actually granted.
#[derive(Debug)]
pub struct BoundSocket {
    /// The socket, bound, not yet handed to quinn.
    pub socket: UdpSocket,
    /// Effective `SO_RCVBUF` in bytes (Linux reports twice the usable size; this is halved
    /// back so it is comparable with the request).
    pub recv_buffer_bytes: usize,
    /// Effective `SO_SNDBUF` in bytes, likewise.
    pub send_buffer_bytes: usize,
}

/// Creates the ingest server's endpoint on `listen` with `config`.
///
/// The socket gets [`Tuning::socket_buffer_bytes`] of send and receive buffer. An IPv6
/// wildcard address also accepts IPv4 where the OS allows dual-stack sockets.
///
/// # Panics
///
/// Must be called from within a Tokio runtime (quinn registers the socket with it).
pub fn server_endpoint(
    listen: SocketAddr,
    config: quinn::ServerConfig,
    tuning: &Tuning,
) -> Result<Endpoint, TransportError> {
    let bound = bind_udp_socket(listen, tuning)?;
    Endpoint::new(EndpointConfig::default(), Some(config), bound.socket, Arc::new(TokioRuntime))
        .map_err(|source| TransportError::Socket { op: "register with the runtime", addr: listen, source })
}

/// Like [`server_endpoint`], with the stateless-reset key derived from `secret` (the server's
/// private key file) instead of a random one.
///
/// A QUIC server answers a packet of a connection it does not know with a stateless reset,
/// which the peer accepts only if its token was made with the key of the server that issued the
/// connection ID (RFC 9000, section 10.3). With a random key per process, a restarted ingest
/// server cannot make valid resets, so every agent sits on its dead connection until its idle
/// timeout (10 s by default) before it reconnects. With the same key across restarts, the new
/// process resets the old connections at their next packet and the agents reconnect at once.
/// The connection-id generator's key (quinn embeds a keyed hash in every connection id and drops
/// packets whose id does not check) is derived the same way. Both come from a SHA-256 of a label
/// and the secret: they reveal nothing of the secret, and a deployment that rotates the server
/// key simply gets new ones.
pub fn server_endpoint_with_reset_secret(
    listen: SocketAddr,
    config: quinn::ServerConfig,
    tuning: &Tuning,
    secret: &[u8],
) -> Result<Endpoint, TransportError> {
    let bound = bind_udp_socket(listen, tuning)?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    ctx.update(b"edge-ingest stateless reset key v1\0");
    ctx.update(secret);
    let derived = ctx.finish();
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, derived.as_ref());
    let mut endpoint_config = EndpointConfig::new(Arc::new(key));
    // quinn's connection ids carry a hash keyed per process, and a packet whose id does not
    // check is dropped before any reset is considered: the key comes from the secret too.
    let mut cid_key = [0u8; 8];
    cid_key.copy_from_slice(&derived.as_ref()[..8]);
    let cid_key = u64::from_le_bytes(cid_key);
    endpoint_config.cid_generator(move || Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key)));
    Endpoint::new(endpoint_config, Some(config), bound.socket, Arc::new(TokioRuntime))
        .map_err(|source| TransportError::Socket { op: "register with the runtime", addr: listen, source })
}

/// Creates the agent's endpoint bound to `bind` (usually `0.0.0.0:0` or `[::]:0`).
///
/// It has no default client config: pass the one from [`client_config`](crate::client_config)
/// to `Endpoint::connect_with`, or install it with `Endpoint::set_default_client_config`.
///
/// # Panics
///
/// Must be called from within a Tokio runtime (quinn registers the socket with it).
pub fn client_endpoint(bind: SocketAddr, tuning: &Tuning) -> Result<Endpoint, TransportError> {
    let bound = bind_udp_socket(bind, tuning)?;
    Endpoint::new(EndpointConfig::default(), None, bound.socket, Arc::new(TokioRuntime))
        .map_err(|source| TransportError::Socket { op: "register with the runtime", addr: bind, source })
}

/// Creates a UDP socket with the buffer sizes from `tuning` and binds it to `addr`.
///
/// Logs a warning naming the granted size when the kernel grants less than requested.
pub fn bind_udp_socket(addr: SocketAddr, tuning: &Tuning) -> Result<BoundSocket, TransportError> {
    let socket_error = |op: &'static str| move |source| TransportError::Socket { op, addr, source };
    if i32::try_from(tuning.socket_buffer_bytes).is_err() {
        return Err(TransportError::InvalidTuning {
            field: "socket_buffer_bytes",
            value: tuning.socket_buffer_bytes.to_string(),
            reason: "must fit the kernel's int (< 2 GiB)",
        });
    }
    let socket =
        Socket::new(Domain::for_address(addr), Type::DGRAM, Some(Protocol::UDP)).map_err(socket_error("create"))?;
    if addr.is_ipv6()
        && let Err(e) = socket.set_only_v6(false)
    {
        tracing::debug!(%addr, error = %e, "UDP socket stays IPv6-only");
    }
    let requested = tuning.socket_buffer_bytes;
    if requested > 0 {
        socket.set_recv_buffer_size(requested).map_err(socket_error("set SO_RCVBUF on"))?;
        socket.set_send_buffer_size(requested).map_err(socket_error("set SO_SNDBUF on"))?;
    }
    let recv_buffer_bytes = effective(socket.recv_buffer_size().map_err(socket_error("read SO_RCVBUF of"))?);
    let send_buffer_bytes = effective(socket.send_buffer_size().map_err(socket_error("read SO_SNDBUF of"))?);
    if requested > 0 && recv_buffer_bytes < requested {
        tracing::warn!(
            %addr,
            requested,
            granted = recv_buffer_bytes,
            "kernel capped the UDP receive buffer; raise net.core.rmem_max to avoid packet drops"
        );
    }
    if requested > 0 && send_buffer_bytes < requested {
        tracing::warn!(
            %addr,
            requested,
            granted = send_buffer_bytes,
            "kernel capped the UDP send buffer; raise net.core.wmem_max"
        );
    }
    socket.bind(&addr.into()).map_err(socket_error("bind"))?;
    Ok(BoundSocket { socket: socket.into(), recv_buffer_bytes, send_buffer_bytes })
}

/// Linux doubles the requested buffer size to account for bookkeeping and reports the doubled
/// value; halve it so it compares with what was requested.
fn effective(reported: usize) -> usize {
    if cfg!(target_os = "linux") { reported / 2 } else { reported }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn socket_is_bound_to_an_ephemeral_port_with_buffers() {
        let tuning = Tuning { socket_buffer_bytes: 1024 * 1024, ..Tuning::default() };
        let bound = bind_udp_socket("127.0.0.1:0".parse().expect("addr"), &tuning).expect("bind");
        let local = bound.socket.local_addr().expect("local addr");
        assert_ne!(local.port(), 0, "bound to an ephemeral port");
        assert!(bound.recv_buffer_bytes > 0);
        assert!(bound.send_buffer_bytes > 0);
    }

    #[test]
    fn zero_buffer_size_keeps_the_kernel_default() {
        let tuning = Tuning { socket_buffer_bytes: 0, ..Tuning::default() };
        let bound = bind_udp_socket("127.0.0.1:0".parse().expect("addr"), &tuning).expect("bind");
        assert!(bound.recv_buffer_bytes > 0);
    }

    #[test]
    fn binding_an_address_in_use_names_the_address() {
        let tuning = Tuning::default();
        let first = bind_udp_socket("127.0.0.1:0".parse().expect("addr"), &tuning).expect("bind");
        let taken = first.socket.local_addr().expect("local addr");
        let err = bind_udp_socket(taken, &tuning).expect_err("address in use");
        match err {
            TransportError::Socket { op, addr, .. } => {
                assert_eq!(op, "bind");
                assert_eq!(addr, taken);
            }
            other => panic!("expected Socket error, got {other}"),
        }
    }
}
