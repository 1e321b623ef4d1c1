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
/// The connection-id generator's key (quinn embeds a hash keyed with it in every connection id
/// and drops packets whose id does not check, before any reset is considered) must survive the
/// restart too, so it also comes from the secret. The two keys are derived independently, each
/// as a SHA-256 of its own label and the secret: neither is made of bytes
/// of the other, and neither gives away the secret. The connection-id key is to be taken as
/// public: quinn's id check is FxHash, not a keyed PRF, so the ids on the wire can give that key
/// away; it only lets the server drop ids it never issued. The reset key is used for nothing
/// else. A deployment that rotates the server key simply gets new keys.
pub fn server_endpoint_with_reset_secret(
    listen: SocketAddr,
    config: quinn::ServerConfig,
    tuning: &Tuning,
    secret: &[u8],
) -> Result<Endpoint, TransportError> {
    let bound = bind_udp_socket(listen, tuning)?;
    let (reset_key, cid_key) = derive_keys(secret);
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &reset_key);
    let mut endpoint_config = EndpointConfig::new(Arc::new(key));
    endpoint_config.cid_generator(move || Box::new(quinn_proto::HashedConnectionIdGenerator::from_key(cid_key)));
    Endpoint::new(endpoint_config, Some(config), bound.socket, Arc::new(TokioRuntime))
        .map_err(|source| TransportError::Socket { op: "register with the runtime", addr: listen, source })
}

/// Label of the stateless-reset key (HMAC-SHA256 key of the reset tokens).
const RESET_KEY_LABEL: &[u8] = b"edge-ingest stateless reset key v1\0";

/// Label of the connection-id generator's key.
const CID_KEY_LABEL: &[u8] = b"edge-ingest connection id key v1\0";

/// The stateless-reset key and the connection-id generator's key of
/// [`server_endpoint_with_reset_secret`], both derived from `secret` alone, so a restarted server
/// with the same secret gets the same pair.
///
/// Each is a SHA-256 of its own label and the secret, so the connection-id key, which the ids on
/// the wire may reveal, says nothing of the reset key. The reset key is derived as in earlier
/// releases. The connection-id key is not: it used to be the first 8 bytes of the reset key. So
/// a process of this version cannot reset the connections of an earlier-version process it
/// replaces (their ids no longer check, so their packets are dropped unanswered): across that
/// one upgrade the agents reconnect at their idle timeout instead of at once.
fn derive_keys(secret: &[u8]) -> ([u8; 32], u64) {
    let digest = |label: &[u8]| {
        let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
        ctx.update(label);
        ctx.update(secret);
        let mut out = [0u8; 32];
        out.copy_from_slice(ctx.finish().as_ref());
        out
    };
    let reset_key = digest(RESET_KEY_LABEL);
    let cid_digest = digest(CID_KEY_LABEL);
    let mut cid_key = [0u8; 8];
    cid_key.copy_from_slice(&cid_digest[..8]);
    (reset_key, u64::from_le_bytes(cid_key))
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

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    #[test]
    fn derived_keys_are_deterministic_and_the_cid_key_is_not_bytes_of_the_reset_key() {
        let (reset, cid) = derive_keys(b"test secret");
        assert_eq!(derive_keys(b"test secret"), (reset, cid), "same secret, same keys (a restart)");
        let (other_reset, other_cid) = derive_keys(b"another secret");
        assert_ne!(other_reset, reset, "the reset key depends on the secret");
        assert_ne!(other_cid, cid, "the cid key depends on the secret");
        // The cid key may leak through the ids on the wire: none of its 8 bytes, in either
        // order, may be a window of the reset key.
        for cid_bytes in [cid.to_le_bytes(), cid.to_be_bytes()] {
            assert!(
                !reset.windows(cid_bytes.len()).any(|w| w == cid_bytes),
                "cid key {} is a slice of the reset key {}",
                hex(&cid_bytes),
                hex(&reset)
            );
        }
        // Known answers (`printf '<label>\0test secret' | sha256sum`): the reset key must stay
        // what earlier releases derived, and neither key may change silently, or a restart onto
        // a new release could not reset its predecessor's connections.
        assert_eq!(hex(&reset), "a966163cc70258e53e94d928deacab01473b1163a8f157ee0d28c24aa4c14ba6");
        assert_eq!(hex(&cid.to_le_bytes()), "9e1a9246c7674254");
    }

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
