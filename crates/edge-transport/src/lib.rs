//! edge-transport: the QUIC endpoints, the mutual-TLS configuration and the PKI helpers that
//! connect an edge agent to the ingest server.
//!
//! # What lives here
//!
//! | module | owns |
//! |---|---|
//! | [`tuning`] | [`Tuning`]: the quinn transport knobs that matter, with measured defaults |
//! | [`congestion`] | the agent's congestion controller: Cubic (or quinn's BBR, by [`Tuning::congestion_controller`]) that does not count losses from before the path answered |
//! | [`tls`] | [`server_config`] / [`client_config`]: rustls + quinn configs for mutual TLS |
//! | [`endpoint`] | [`server_endpoint`] / [`client_endpoint`]: UDP sockets with sized buffers |
//! | [`peer`] | [`peer_device_id`]: the device identity taken from the client certificate |
//! | [`pki`] | a small CA: `init`, `issue_device`, CRLs, and an in-memory variant for tests |
//! | [`error`] | [`TransportError`], the error type of the configuration and endpoint functions |
//!
//! This crate holds no business policy: it does not know what a chunk is. The only protocol
//! fact it knows is the ALPN identifier [`ALPN`].
//!
//! # TLS choices
//!
//! * **TLS 1.3 only.** QUIC (RFC 9001) is defined over TLS 1.3; offering anything older would
//!   be dead configuration. Pinning the version explicitly also keeps a future change of rustls
//!   defaults from widening what we accept.
//! * **ring, chosen explicitly.** Every rustls and quinn object is built from
//!   [`crypto_provider`] via the `*_with_provider` constructors. Nothing here calls
//!   `CryptoProvider::install_default` or relies on a process-wide default, so the result does
//!   not depend on which other crates happen to be linked in (a second provider linked in by a
//!   dependency would otherwise make the default ambiguous and panic at first use).
//! * **Mandatory client authentication.** The server verifies the client chain with
//!   `WebPkiClientVerifier` over the configured client CA (plus CRLs). Anonymous clients are
//!   refused with a `certificate_required` alert; the clientAuth EKU is enforced; a revoked
//!   certificate is refused, and so is a CRL past its `nextUpdate`
//!   (`enforce_revocation_expiration`). The device identity is the leaf's subject CN
//!   ([`peer_device_id`]); clients never get to name themselves.
//! * **The cipher suite this CPU is fastest at.** [`crypto_provider`] offers the three TLS 1.3
//!   suites in an order fit for the machine it runs on: AES-128-GCM first where the CPU has AES
//!   and carry-less multiply instructions (x86 AES-NI and PCLMULQDQ, the ARMv8 crypto
//!   extension), ChaCha20-Poly1305 first where it has not (a Raspberry Pi 4, many gateway
//!   SoCs), where software AES-GCM costs several times as much per byte. The server follows the
//!   client's order (rustls's default; `tests/handshake.rs` checks it), so the gateway, the
//!   constrained end, picks. All three are accepted on both ends, so any pair of machines
//!   agrees on one; QUIC's Initial packets use AES-128-GCM whatever is negotiated (RFC 9001).
//!   The agent logs the order it offers when it starts.
//! * **Strict ALPN.** Both ends offer only [`ALPN`]; a peer with another or no ALPN fails the
//!   handshake with `no_application_protocol`.
//! * **Resumption and 0-RTT on.** The server keeps a bounded in-memory session cache
//!   (stateful TLS 1.3 tickets; rustls accepts early data only with stateful resumption) and
//!   sets `max_early_data_size = u32::MAX`, the only non-zero value QUIC allows. The client
//!   keeps a resumption store and enables early data; 0-RTT is used only where the agent opts
//!   in with `Connecting::into_0rtt`.
//!
//!   Why 0-RTT is safe here: 0-RTT data can be replayed by anyone who captured it. Our
//!   tickets live only in the memory of the server process that issued them and are redeemed
//!   once, so a captured first flight is accepted at most once, and never by another instance
//!   or after a restart. But an attacker who races the real client can get its copy accepted
//!   first; the client's own 0-RTT is then rejected (its streams fail with `ZeroRttRejected`)
//!   and the agent must resend in 1-RTT, so the server sees the same data twice. That is harmless only because of the application layer:
//!   every chunk upload is idempotent (it carries its own `(device, stream, seq)` identity)
//!   and the server deduplicates on that identity durably before it acknowledges, so a chunk
//!   is stored at most once and a replayed control message yields at most a duplicate ack.
//!   Nothing non-idempotent may ever be sent in 0-RTT.
//!
//!   A resumed session carries the client certificate chain of its full handshake, so
//!   [`peer_device_id`] works on resumed connections. A server that accepts 0.5-RTT
//!   connections (`Connecting::into_0rtt` on the server) must not trust the identity before
//!   `Connection::authenticated` resolves. The session cache belongs to one server config:
//!   installing a new config (for example after a CRL reload via `Endpoint::set_server_config`)
//!   invalidates every ticket, so a revoked device cannot resume its way past a new CRL.
//!   A CRL is checked only at handshake; closing live connections of a revoked device is the
//!   caller's job.

//! # Performance choices
//!
//! See [`Tuning`]: GSO stays on, MTU discovery stays on, UDP socket buffers are 4 MiB, the
//! per-stream and send windows are sized for WAN bandwidth-delay products, and the
//! connection-level receive window is bounded (quinn's default is unbounded). Senders should
//! use `SendStream::write_chunk(Bytes)` rather than `write_all`, which saves about a quarter of
//! the sender's CPU.

pub mod congestion;
pub mod endpoint;
pub mod error;
pub mod peer;
pub mod pki;
pub mod tls;
pub mod tuning;

use std::sync::{Arc, OnceLock};

pub use endpoint::{BoundSocket, bind_udp_socket, client_endpoint, server_endpoint, server_endpoint_with_reset_secret};
pub use error::{PemOrigin, TransportError};
pub use peer::{IdentityError, certificate_valid_until, device_id_from_cert_der, peer_device_id, tls_alert};
pub use tls::{
    ClientTls, ServerTls, client_config, client_config_from_pem, quic_client_config, rustls_client_config,
    rustls_client_config_from_pem, server_config, server_config_from_pem, server_config_from_pem_with_crls,
    without_sessions,
};
pub use tuning::{CongestionController, Tuning};

/// The ALPN protocol identifier both ends must agree on: version 1 of the edge upload protocol.
///
/// Defined here rather than taken from `edge-proto` so that this crate does not depend on the
/// protocol crate; the two must stay equal.
pub const ALPN: &[u8] = b"edge/1";

/// The rustls crypto provider used for every TLS object this crate builds: *ring*, with its
/// cipher suites in [`cipher_suite_preference`]'s order for this CPU.
///
/// The provider is constructed once and shared. It is passed explicitly to every rustls
/// builder; the process-wide default provider is neither read nor installed.
pub fn crypto_provider() -> Arc<rustls::crypto::CryptoProvider> {
    static PROVIDER: OnceLock<Arc<rustls::crypto::CryptoProvider>> = OnceLock::new();
    Arc::clone(PROVIDER.get_or_init(|| {
        let mut provider = rustls::crypto::ring::default_provider();
        order_cipher_suites(&mut provider.cipher_suites, cpu_has_aes_instructions());
        Arc::new(provider)
    }))
}

/// The TLS 1.3 cipher suites in the order this crate offers them, given whether the CPU has
/// AES instructions: AES-128-GCM, AES-256-GCM, ChaCha20-Poly1305 if it has, ChaCha20-Poly1305
/// first if not. AES-256 comes after AES-128 because it costs more rounds per block for a
/// margin TLS 1.3's 128-bit suites do not need.
pub fn cipher_suite_preference(aes_instructions: bool) -> [rustls::CipherSuite; 3] {
    use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256};
    if aes_instructions {
        [TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256]
    } else {
        [TLS13_CHACHA20_POLY1305_SHA256, TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384]
    }
}

/// Whether this CPU has the instructions that make AES-GCM fast: AES rounds and carry-less
/// multiplication (x86: AES-NI and PCLMULQDQ; AArch64: the crypto extension's AES, which Rust
/// detects together with PMULL). Other architectures are taken to have none.
pub fn cpu_has_aes_instructions() -> bool {
    #[cfg(any(target_arch = "x86", target_arch = "x86_64"))]
    {
        std::arch::is_x86_feature_detected!("aes") && std::arch::is_x86_feature_detected!("pclmulqdq")
    }
    #[cfg(target_arch = "aarch64")]
    {
        std::arch::is_aarch64_feature_detected!("aes")
    }
    #[cfg(not(any(target_arch = "x86", target_arch = "x86_64", target_arch = "aarch64")))]
    {
        false
    }
}

/// Checks that the TLS file at `path`, named by the config key `key`, is a regular file this
/// process can see, for the configs' validation: the error names the key and the file, and says
/// whether it is missing, not a regular file, or out of reach (a directory this user may not
/// search, which `Path::is_file` would call missing).
///
/// # Errors
/// The message for the operator.
pub fn check_regular_file(key: &str, path: &std::path::Path) -> Result<(), String> {
    match std::fs::metadata(path) {
        Ok(m) if m.is_file() => Ok(()),
        Ok(_) => Err(format!("{key}: {} is not a regular file", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(format!("{key}: file {} does not exist", path.display()))
        }
        Err(e) => Err(format!("{key}: file {}: {e}", path.display())),
    }
}

/// Puts the suites of [`cipher_suite_preference`] first, in its order; the rest (TLS 1.2's,
/// never offered since only TLS 1.3 is enabled) keep their order behind them.
fn order_cipher_suites(suites: &mut [rustls::SupportedCipherSuite], aes_instructions: bool) {
    let preference = cipher_suite_preference(aes_instructions);
    suites.sort_by_key(|s| preference.iter().position(|p| *p == s.suite()).unwrap_or(preference.len()));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crypto_provider_is_ring_with_tls13_suites() {
        let provider = crypto_provider();
        assert!(
            provider.cipher_suites.iter().any(|s| s.suite() == rustls::CipherSuite::TLS13_AES_128_GCM_SHA256),
            "QUIC needs TLS13_AES_128_GCM_SHA256 for its initial packets"
        );
        // The same Arc is handed out every time: one provider per process.
        assert!(Arc::ptr_eq(&provider, &crypto_provider()));
    }

    #[test]
    fn cipher_suites_are_offered_in_the_order_for_the_cpu() {
        use rustls::CipherSuite::{TLS13_AES_128_GCM_SHA256, TLS13_AES_256_GCM_SHA384, TLS13_CHACHA20_POLY1305_SHA256};
        for aes in [true, false] {
            let mut suites = rustls::crypto::ring::default_provider().cipher_suites;
            let before = suites.len();
            order_cipher_suites(&mut suites, aes);
            assert_eq!(suites.len(), before, "ordering drops no suite");
            let tls13: Vec<_> = suites.iter().map(|s| s.suite()).take(3).collect();
            assert_eq!(tls13, cipher_suite_preference(aes));
        }
        assert_eq!(cipher_suite_preference(true)[0], TLS13_AES_128_GCM_SHA256);
        assert_eq!(cipher_suite_preference(false)[0], TLS13_CHACHA20_POLY1305_SHA256);
        assert_eq!(cipher_suite_preference(true)[1], TLS13_AES_256_GCM_SHA384);
        // The shared provider follows this machine's answer.
        let first = crypto_provider().cipher_suites[0].suite();
        assert_eq!(first, cipher_suite_preference(cpu_has_aes_instructions())[0]);
    }

    #[test]
    fn alpn_is_edge_v1() {
        assert_eq!(ALPN, b"edge/1");
    }
}
