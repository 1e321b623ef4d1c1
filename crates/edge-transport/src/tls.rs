//! Mutual-TLS configurations for both ends, as quinn configs: loading PEM (from files or
//! memory), the rustls server and client configs, and their wrapping into QUIC configs with
//! the transport from [`Tuning`].
//!
//! The TLS choices and why they are safe are described in the crate documentation: TLS 1.3
//! only, the *ring* provider passed explicitly, mandatory client certificates verified against
//! the client CA (+ CRLs, whose expiry is enforced), ALPN [`ALPN`] only,
//! resumption and 0-RTT on because chunk uploads are idempotent and deduplicated durably.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use quinn::crypto::rustls::{QuicClientConfig, QuicServerConfig};
use rustls::RootCertStore;
use rustls::client::Resumption;
use rustls::pki_types::pem::{self, PemObject};
use rustls::pki_types::{CertificateDer, CertificateRevocationListDer, PrivateKeyDer, ServerName};
use rustls::server::{ServerSessionMemoryCache, VerifierBuilderError, WebPkiClientVerifier};

use crate::{ALPN, PemOrigin, TransportError, Tuning, crypto_provider};

/// Resumption sessions the server remembers (per server config). Each entry holds the client
/// certificate chain of the original handshake, about 2 KiB with our certificates. Tickets
/// are single-use, so this bounds how many agents can resume after a reconnect wave.
const SERVER_SESSION_CACHE_ENTRIES: usize = 4096;

/// Resumption sessions the agent remembers. It talks to one server name, but a few spare
/// slots cost nothing and let it hold tickets for a fallback name.
const CLIENT_SESSION_CACHE_ENTRIES: usize = 32;

/// Files for the ingest server's TLS identity and its view of clients.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTls {
    /// PEM certificate chain presented to agents, leaf first.
    pub cert: PathBuf,
    /// PEM private key of the leaf (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM certificates of the CA(s) that issue device certificates.
    pub client_ca: PathBuf,
    /// PEM CRLs issued by the client CA(s). Optional; when given, a revoked device is refused,
    /// a CRL past its `nextUpdate` makes every handshake fail (it is enforced), and a device
    /// whose issuer has no CRL in the list is refused as of unknown status.
    pub crls: Vec<PathBuf>,
}

/// Files for the agent's TLS identity and its view of the server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTls {
    /// PEM device certificate chain, leaf first; the leaf's subject CN is the device id.
    pub cert: PathBuf,
    /// PEM private key of the device certificate.
    pub key: PathBuf,
    /// PEM certificates of the CA(s) that issue the server certificate.
    pub server_ca: PathBuf,
    /// The name the server certificate must be valid for (DNS name or IP literal). It is not
    /// part of the quinn config: pass it to `Endpoint::connect_with`. [`client_config`]
    /// checks that it is well formed.
    pub server_name: String,
}

/// Builds the ingest server's QUIC config from files.
///
/// TLS 1.3 only, *ring*, mandatory client certificates verified against `tls.client_ca`
/// (and `tls.crls`), ALPN [`ALPN`], stateful resumption, 0-RTT accepted
/// (`max_early_data_size = u32::MAX`), transport from [`Tuning::server_transport`] (one
/// bidirectional stream, `max_concurrent_uni_streams` chunk streams), migration allowed.
pub fn server_config(tls: &ServerTls, tuning: &Tuning) -> Result<quinn::ServerConfig, TransportError> {
    let cert = Pem::from_file("server certificate chain", &tls.cert)?;
    let key = Pem::from_file("server private key", &tls.key)?;
    let client_ca = Pem::from_file("client CA certificates", &tls.client_ca)?;
    let crls =
        tls.crls.iter().map(|path| Pem::from_file("client CA revocation list", path)).collect::<Result<Vec<_>, _>>()?;
    build_server_config(&cert, &key, &client_ca, &crls, tuning)
}

/// Like [`server_config`], from PEM text in memory and without CRLs.
pub fn server_config_from_pem(
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
    tuning: &Tuning,
) -> Result<quinn::ServerConfig, TransportError> {
    server_config_from_pem_with_crls(cert_pem, key_pem, client_ca_pem, &[], tuning)
}

/// Like [`server_config`], from PEM text in memory, with CRLs (each entry may hold several).
pub fn server_config_from_pem_with_crls(
    cert_pem: &str,
    key_pem: &str,
    client_ca_pem: &str,
    crl_pems: &[&str],
    tuning: &Tuning,
) -> Result<quinn::ServerConfig, TransportError> {
    let cert = Pem::from_memory("server certificate chain", "cert_pem", cert_pem);
    let key = Pem::from_memory("server private key", "key_pem", key_pem);
    let client_ca = Pem::from_memory("client CA certificates", "client_ca_pem", client_ca_pem);
    let crls: Vec<Pem> =
        crl_pems.iter().map(|text| Pem::from_memory("client CA revocation list", "crl_pems", text)).collect();
    build_server_config(&cert, &key, &client_ca, &crls, tuning)
}

/// Builds the agent's QUIC config from files.
///
/// TLS 1.3 only, *ring*, the device certificate as client identity, the server verified
/// against `tls.server_ca` (serverAuth EKU, name checked at connect time against the name
/// passed to `connect_with`), ALPN [`ALPN`], a resumption store and early data
/// enabled (0-RTT is used only when the caller opts in with `Connecting::into_0rtt`), and the
/// transport from [`Tuning::client_transport`] (the server may open no streams).
///
/// Reuse the returned config for reconnects: the resumption store lives in it.
pub fn client_config(tls: &ClientTls, tuning: &Tuning) -> Result<quinn::ClientConfig, TransportError> {
    quic_client_config(rustls_client_config(tls)?, tuning)
}

/// The rustls half of [`client_config`], for a caller that keeps it to make a config with an
/// empty session store later ([`without_sessions`]) without reading the files again.
pub fn rustls_client_config(tls: &ClientTls) -> Result<rustls::ClientConfig, TransportError> {
    check_server_name(&tls.server_name)?;
    let cert = Pem::from_file("device certificate chain", &tls.cert)?;
    let key = Pem::from_file("device private key", &tls.key)?;
    let server_ca = Pem::from_file("server CA certificates", &tls.server_ca)?;
    build_rustls_client_config(&cert, &key, &server_ca)
}

/// A copy of `config` with a new, empty resumption store: the first handshake made with it is
/// a full one, showing the client certificate.
pub fn without_sessions(config: &rustls::ClientConfig) -> rustls::ClientConfig {
    let mut fresh = config.clone();
    fresh.resumption = Resumption::in_memory_sessions(CLIENT_SESSION_CACHE_ENTRIES);
    fresh
}

/// Like [`client_config`], from PEM text in memory. The server name is given to
/// `Endpoint::connect_with`.
pub fn client_config_from_pem(
    cert_pem: &str,
    key_pem: &str,
    server_ca_pem: &str,
    tuning: &Tuning,
) -> Result<quinn::ClientConfig, TransportError> {
    let rustls_config = rustls_client_config_from_pem(cert_pem, key_pem, server_ca_pem)?;
    quic_client_config(rustls_config, tuning)
}

/// The rustls half of [`client_config_from_pem`], for callers (benchmarks, negative tests)
/// that need to adjust it before wrapping it with [`quic_client_config`].
pub fn rustls_client_config_from_pem(
    cert_pem: &str,
    key_pem: &str,
    server_ca_pem: &str,
) -> Result<rustls::ClientConfig, TransportError> {
    let cert = Pem::from_memory("device certificate chain", "cert_pem", cert_pem);
    let key = Pem::from_memory("device private key", "key_pem", key_pem);
    let server_ca = Pem::from_memory("server CA certificates", "server_ca_pem", server_ca_pem);
    build_rustls_client_config(&cert, &key, &server_ca)
}

/// Wraps a rustls client config for QUIC and attaches [`Tuning::client_transport`].
pub fn quic_client_config(tls: rustls::ClientConfig, tuning: &Tuning) -> Result<quinn::ClientConfig, TransportError> {
    let transport = tuning.client_transport()?;
    let quic = QuicClientConfig::try_from(tls)?;
    let mut config = quinn::ClientConfig::new(Arc::new(quic));
    config.transport_config(Arc::new(transport));
    Ok(config)
}

fn build_server_config(
    cert: &Pem,
    key: &Pem,
    client_ca: &Pem,
    crls: &[Pem],
    tuning: &Tuning,
) -> Result<quinn::ServerConfig, TransportError> {
    let transport = tuning.server_transport()?;
    let chain = cert.certificates()?;
    let key_der = key.private_key()?;
    let roots = client_ca.root_store()?;
    let crl_ders = crls.iter().map(Pem::crls).collect::<Result<Vec<_>, _>>()?;

    let provider = crypto_provider();
    let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots.clone()), Arc::clone(&provider))
        .with_crls(crl_ders.iter().flatten().cloned())
        .enforce_revocation_expiration()
        .build()
        .map_err(|source| verifier_error(source, client_ca, &roots, crls, &crl_ders))?;

    let mut tls = rustls::ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| TransportError::Rustls { context: "TLS 1.3-only protocol selection", source })?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, key_der)
        .map_err(|source| TransportError::BadIdentity { cert: cert.origin.clone(), key: key.origin.clone(), source })?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    // Stateful tickets: rustls accepts early data only without a stateless ticketer, and a
    // stateful ticket can be redeemed once, which blunts replays of a captured first flight.
    tls.session_storage = ServerSessionMemoryCache::new(SERVER_SESSION_CACHE_ENTRIES);
    // QUIC allows only 0 or u32::MAX; u32::MAX turns 0-RTT on. Safe because uploads are
    // idempotent and deduplicated durably by the server (see the crate docs).
    tls.max_early_data_size = u32::MAX;

    let quic = QuicServerConfig::try_from(tls)?;
    let mut config = quinn::ServerConfig::with_crypto(Arc::new(quic));
    config.transport_config(Arc::new(transport));
    config.migration(true);
    Ok(config)
}

/// Names the culprit of a verifier build failure: a specific CRL if one is unusable on its
/// own, otherwise the client CA.
fn verifier_error(
    source: VerifierBuilderError,
    client_ca: &Pem,
    roots: &RootCertStore,
    crls: &[Pem],
    crl_ders: &[Vec<CertificateRevocationListDer<'static>>],
) -> TransportError {
    if matches!(source, VerifierBuilderError::InvalidCrl(_)) {
        for (pem, ders) in crls.iter().zip(crl_ders) {
            let alone = WebPkiClientVerifier::builder_with_provider(Arc::new(roots.clone()), crypto_provider())
                .with_crls(ders.iter().cloned())
                .build();
            if let Err(source) = alone {
                return TransportError::BadCrl { origin: pem.origin.clone(), source };
            }
        }
    }
    TransportError::ClientVerifier { origin: client_ca.origin.clone(), source }
}

fn build_rustls_client_config(cert: &Pem, key: &Pem, server_ca: &Pem) -> Result<rustls::ClientConfig, TransportError> {
    let chain = cert.certificates()?;
    let key_der = key.private_key()?;
    let roots = server_ca.root_store()?;
    let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(|source| TransportError::Rustls { context: "TLS 1.3-only protocol selection", source })?
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key_der)
        .map_err(|source| TransportError::BadIdentity { cert: cert.origin.clone(), key: key.origin.clone(), source })?;
    tls.alpn_protocols = vec![ALPN.to_vec()];
    tls.resumption = Resumption::in_memory_sessions(CLIENT_SESSION_CACHE_ENTRIES);
    tls.enable_early_data = true;
    Ok(tls)
}

fn check_server_name(name: &str) -> Result<(), TransportError> {
    ServerName::try_from(name)
        .map(drop)
        .map_err(|source| TransportError::InvalidServerName { name: name.to_owned(), source })
}

/// PEM text together with where it came from and what it should contain.
struct Pem {
    what: &'static str,
    origin: PemOrigin,
    text: Vec<u8>,
}

impl Pem {
    fn from_file(what: &'static str, path: &Path) -> Result<Self, TransportError> {
        let text =
            std::fs::read(path).map_err(|source| TransportError::ReadFile { what, path: path.to_owned(), source })?;
        Ok(Self { what, origin: PemOrigin::File(path.to_owned()), text })
    }

    fn from_memory(what: &'static str, argument: &'static str, text: &str) -> Self {
        Self { what, origin: PemOrigin::Memory(argument), text: text.as_bytes().to_vec() }
    }

    fn pem_error(&self, err: pem::Error) -> TransportError {
        TransportError::Pem { what: self.what, origin: self.origin.clone(), detail: err.to_string() }
    }

    /// Every `CERTIFICATE` block, in order; at least one.
    fn certificates(&self) -> Result<Vec<CertificateDer<'static>>, TransportError> {
        let certs =
            CertificateDer::pem_slice_iter(&self.text).collect::<Result<Vec<_>, _>>().map_err(|e| self.pem_error(e))?;
        if certs.is_empty() {
            return Err(TransportError::NoCertificate { what: self.what, origin: self.origin.clone() });
        }
        Ok(certs)
    }

    /// The first private key block.
    fn private_key(&self) -> Result<PrivateKeyDer<'static>, TransportError> {
        match PrivateKeyDer::from_pem_slice(&self.text) {
            Ok(key) => Ok(key),
            Err(pem::Error::NoItemsFound) => {
                Err(TransportError::NoPrivateKey { what: self.what, origin: self.origin.clone() })
            }
            Err(e) => Err(self.pem_error(e)),
        }
    }

    /// Every certificate as a trust anchor; at least one.
    fn root_store(&self) -> Result<RootCertStore, TransportError> {
        let mut roots = RootCertStore::empty();
        for (index, cert) in self.certificates()?.into_iter().enumerate() {
            roots.add(cert).map_err(|source| TransportError::BadCertificate {
                what: self.what,
                origin: self.origin.clone(),
                index,
                source,
            })?;
        }
        Ok(roots)
    }

    /// Every `X509 CRL` block; at least one.
    fn crls(&self) -> Result<Vec<CertificateRevocationListDer<'static>>, TransportError> {
        let crls = CertificateRevocationListDer::pem_slice_iter(&self.text)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| self.pem_error(e))?;
        if crls.is_empty() {
            return Err(TransportError::NoCrl { what: self.what, origin: self.origin.clone() });
        }
        Ok(crls)
    }
}

/// Why a set of CRLs was refused by [`RevocationList::load`]: the server keeps its previous
/// list rather than run with one that would refuse every device or miss revocations.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RevocationError {
    /// A file could not be read, or is not PEM with at least one CRL / certificate in it.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The DER inside a PEM block is not a CRL.
    #[error("certificate revocation list #{index} in {origin} does not parse: {detail}")]
    Parse {
        /// Where the CRL came from.
        origin: PemOrigin,
        /// Zero-based position of the CRL in its PEM text.
        index: usize,
        /// The parser's complaint.
        detail: String,
    },
    /// No client CA has the CRL's issuer as its subject, or the CRL's signature verifies with the
    /// key of none of the client CAs so named: it is not ours, or it was tampered with.
    #[error("certificate revocation list #{index} in {origin} is not signed by a client CA: {detail}")]
    NotIssuedByClientCa {
        /// Where the CRL came from.
        origin: PemOrigin,
        /// Zero-based position of the CRL in its PEM text.
        index: usize,
        /// What did not match.
        detail: String,
    },
    /// The CRL is past its `nextUpdate`; rustls would refuse every device with it
    /// (`enforce_revocation_expiration`).
    #[error("certificate revocation list #{index} in {origin} expired at {next_update} (nextUpdate)")]
    Expired {
        /// Where the CRL came from.
        origin: PemOrigin,
        /// Zero-based position of the CRL in its PEM text.
        index: usize,
        /// The CRL's `nextUpdate`, as text.
        next_update: String,
    },
}

/// The revoked device certificates named by a set of CRLs, for checks outside the TLS
/// handshake: rustls consults its CRLs only when a handshake verifies a client certificate,
/// so a device revoked while connected, or one resuming a session (resumption skips client
/// certificate verification), must be checked by the server against this list.
///
/// [`RevocationList::load`] accepts only CRLs that parse, are signed by one of the client CAs
/// and are not past their `nextUpdate`; the caller keeps its previous list on error, so a
/// half-written or foreign file never replaces a good list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RevocationList {
    /// (issuer name as raw DER, serial number as raw bytes) of every revoked certificate.
    revoked: std::collections::BTreeSet<(Vec<u8>, Vec<u8>)>,
    /// CRLs the list was built from.
    crls: usize,
    /// The earliest `nextUpdate` among them, in Unix seconds, and where that CRL came from.
    next_update: Option<(i64, PemOrigin)>,
}

impl RevocationList {
    /// Loads and checks the CRL files against the client CA file (see [`ServerTls`]).
    pub fn load(client_ca: &Path, crls: &[PathBuf]) -> Result<Self, RevocationError> {
        let ca = Pem::from_file("client CA certificates", client_ca)?;
        let crls =
            crls.iter().map(|path| Pem::from_file("client CA revocation list", path)).collect::<Result<Vec<_>, _>>()?;
        Self::build(&ca, &crls)
    }

    /// Like [`RevocationList::load`], from PEM text in memory (each entry may hold several CRLs).
    pub fn from_pem(client_ca_pem: &str, crl_pems: &[&str]) -> Result<Self, RevocationError> {
        let ca = Pem::from_memory("client CA certificates", "client_ca_pem", client_ca_pem);
        let crls: Vec<Pem> =
            crl_pems.iter().map(|text| Pem::from_memory("client CA revocation list", "crl_pems", text)).collect();
        Self::build(&ca, &crls)
    }

    fn build(ca: &Pem, crls: &[Pem]) -> Result<Self, RevocationError> {
        let ca_ders = ca.certificates()?;
        let mut cas = Vec::with_capacity(ca_ders.len());
        for (index, der) in ca_ders.iter().enumerate() {
            let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).map_err(|e| TransportError::Pem {
                what: ca.what,
                origin: ca.origin.clone(),
                detail: format!("certificate #{index}: {e}"),
            })?;
            cas.push(cert);
        }
        let now = x509_parser::time::ASN1Time::now();
        let mut list = Self::default();
        for pem in crls {
            for (index, der) in pem.crls()?.iter().enumerate() {
                let (_, crl) = x509_parser::parse_x509_crl(der.as_ref()).map_err(|e| RevocationError::Parse {
                    origin: pem.origin.clone(),
                    index,
                    detail: e.to_string(),
                })?;
                let not_ours =
                    |detail: String| RevocationError::NotIssuedByClientCa { origin: pem.origin.clone(), index, detail };
                // Several client CAs may share the CRL's issuer name (an outside CA rolled over
                // under the same name): the CRL is theirs if the key of any of them verifies it.
                let mut failures = Vec::new();
                let mut verified = false;
                for ca in cas.iter().filter(|ca| ca.subject().as_raw() == crl.issuer().as_raw()) {
                    match crl.verify_signature(ca.public_key()) {
                        Ok(()) => {
                            verified = true;
                            break;
                        }
                        Err(e) => failures.push(e.to_string()),
                    }
                }
                if !verified {
                    return Err(not_ours(match failures.as_slice() {
                        [] => format!("no client CA is named {:?}", crl.issuer().to_string()),
                        [e] => format!("its signature does not verify with the CA's key: {e}"),
                        many => format!(
                            "its signature verifies with the key of none of the {} client CAs named {:?}: {}",
                            many.len(),
                            crl.issuer().to_string(),
                            many.join("; ")
                        ),
                    }));
                }
                if let Some(next) = crl.next_update()
                    && next <= now
                {
                    return Err(RevocationError::Expired {
                        origin: pem.origin.clone(),
                        index,
                        next_update: next.to_string(),
                    });
                }
                if let Some(next) = crl.next_update() {
                    let at = next.timestamp();
                    if list.next_update.as_ref().is_none_or(|(t, _)| at < *t) {
                        list.next_update = Some((at, pem.origin.clone()));
                    }
                }
                for revoked in crl.iter_revoked_certificates() {
                    list.revoked.insert((crl.issuer().as_raw().to_vec(), revoked.raw_serial().to_vec()));
                }
                list.crls += 1;
            }
        }
        Ok(list)
    }

    /// Revoked certificates listed.
    pub fn len(&self) -> usize {
        self.revoked.len()
    }

    /// Whether no certificate is revoked.
    pub fn is_empty(&self) -> bool {
        self.revoked.is_empty()
    }

    /// CRLs the list was built from.
    pub fn crl_count(&self) -> usize {
        self.crls
    }

    /// The earliest `nextUpdate` of the CRLs, in Unix seconds: from then on rustls refuses
    /// every device certificate with this list (`enforce_revocation_expiration`) until a newer
    /// one is in place. `None` when no CRL has one.
    pub fn next_update_unix(&self) -> Option<i64> {
        self.next_update.as_ref().map(|(t, _)| *t)
    }

    /// Where the CRL of [`RevocationList::next_update_unix`] came from.
    pub fn next_update_origin(&self) -> Option<&PemOrigin> {
        self.next_update.as_ref().map(|(_, origin)| origin)
    }

    /// The serial number (lowercase hex) of `cert_der` if this list revokes it; `None` if it
    /// does not, or if the DER does not parse (the TLS handshake already verified it).
    pub fn revoked_serial(&self, cert_der: &[u8]) -> Option<String> {
        let (_, cert) = x509_parser::parse_x509_certificate(cert_der).ok()?;
        let key = (cert.issuer().as_raw().to_vec(), cert.raw_serial().to_vec());
        self.revoked.contains(&key).then(|| cert.raw_serial().iter().map(|b| format!("{b:02x}")).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::InMemoryPki;

    fn pki() -> InMemoryPki {
        InMemoryPki::generate(&["localhost"]).expect("generate PKI")
    }

    #[test]
    fn server_config_builds_from_memory() {
        let pki = pki();
        server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, &Tuning::default())
            .expect("server config");
    }

    #[test]
    fn client_rustls_config_offers_alpn_a_client_certificate_and_early_data() {
        let pki = pki();
        let (cert, key) = pki.issue_device("dev-1").expect("device");
        let tls = rustls_client_config_from_pem(&cert, &key, &pki.ca_pem).expect("client config");
        assert_eq!(tls.alpn_protocols, vec![ALPN.to_vec()]);
        assert!(tls.enable_early_data);
        assert!(tls.client_auth_cert_resolver.has_certs());
    }

    #[test]
    fn missing_key_in_pem_is_reported_naming_the_argument() {
        let pki = pki();
        let err = server_config_from_pem(&pki.server_cert_pem, &pki.server_cert_pem, &pki.ca_pem, &Tuning::default())
            .expect_err("a certificate is not a key");
        match err {
            TransportError::NoPrivateKey { origin, .. } => {
                assert_eq!(origin, PemOrigin::Memory("key_pem"));
            }
            other => panic!("expected NoPrivateKey, got {other}"),
        }
    }

    #[test]
    fn empty_client_ca_is_reported_as_no_certificate() {
        let pki = pki();
        let err = server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, "", &Tuning::default())
            .expect_err("no CA");
        assert!(
            matches!(err, TransportError::NoCertificate { origin: PemOrigin::Memory("client_ca_pem"), .. }),
            "{err}"
        );
    }

    #[test]
    fn key_of_another_certificate_is_refused_naming_both_inputs() {
        let pki = pki();
        let (_, device_key) = pki.issue_device("dev-1").expect("device");
        let err = server_config_from_pem(&pki.server_cert_pem, &device_key, &pki.ca_pem, &Tuning::default())
            .expect_err("mismatched key");
        assert!(matches!(err, TransportError::BadIdentity { .. }), "{err}");
        assert!(err.to_string().contains("cert_pem"), "{err}");
        assert!(err.to_string().contains("key_pem"), "{err}");
    }

    #[test]
    fn missing_file_is_reported_with_its_path() {
        let tls = ServerTls {
            cert: PathBuf::from("/nonexistent/edge/server.pem"),
            key: PathBuf::from("/nonexistent/edge/server.key"),
            client_ca: PathBuf::from("/nonexistent/edge/ca.pem"),
            crls: Vec::new(),
        };
        let err = server_config(&tls, &Tuning::default()).expect_err("missing file");
        match &err {
            TransportError::ReadFile { path, what, .. } => {
                assert_eq!(path, &tls.cert);
                assert_eq!(*what, "server certificate chain");
            }
            other => panic!("expected ReadFile, got {other}"),
        }
        assert!(err.to_string().contains("/nonexistent/edge/server.pem"));
    }

    #[test]
    fn garbage_crl_is_reported_naming_its_origin() {
        let pki = pki();
        let garbage = "-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n";
        let err = server_config_from_pem_with_crls(
            &pki.server_cert_pem,
            &pki.server_key_pem,
            &pki.ca_pem,
            &[garbage],
            &Tuning::default(),
        )
        .expect_err("garbage CRL");
        assert!(matches!(err, TransportError::BadCrl { origin: PemOrigin::Memory("crl_pems"), .. }), "{err}");
    }

    fn der(cert_pem: &str) -> Vec<u8> {
        CertificateDer::from_pem_slice(cert_pem.as_bytes()).expect("certificate PEM").to_vec()
    }

    fn in_a_day() -> std::time::SystemTime {
        std::time::SystemTime::now() + std::time::Duration::from_secs(86_400)
    }

    #[test]
    fn revocation_list_names_exactly_the_revoked_certificates() {
        let pki = pki();
        let (revoked, _) = pki.issue_device("dev-revoked").expect("device");
        let (kept, _) = pki.issue_device("dev-kept").expect("device");
        let crl = pki.crl_pem(&[&revoked], in_a_day()).expect("crl");
        let list = RevocationList::from_pem(&pki.ca_pem, &[&crl]).expect("valid CRL");
        assert_eq!((list.len(), list.crl_count()), (1, 1));
        assert!(list.revoked_serial(&der(&revoked)).is_some_and(|s| !s.is_empty()));
        assert_eq!(list.revoked_serial(&der(&kept)), None);
        assert_eq!(list.revoked_serial(b"garbage"), None);
        assert!(RevocationList::from_pem(&pki.ca_pem, &[]).expect("no CRLs").is_empty());
    }

    #[test]
    fn revocation_list_refuses_a_crl_of_another_ca() {
        let pki = pki();
        let other = InMemoryPki::generate(&["localhost"]).expect("other PKI");
        let (cert, _) = other.issue_device("dev-1").expect("device");
        let crl = other.crl_pem(&[&cert], in_a_day()).expect("crl");
        let err = RevocationList::from_pem(&pki.ca_pem, &[&crl]).expect_err("foreign CRL");
        assert!(matches!(err, RevocationError::NotIssuedByClientCa { index: 0, .. }), "{err}");
    }

    #[test]
    fn revocation_list_knows_the_earliest_next_update_of_its_crls() {
        let pki = pki();
        let now = std::time::SystemTime::now();
        let at = |days: u64| now + std::time::Duration::from_secs(days * 86_400);
        let unix = |t: std::time::SystemTime| {
            i64::try_from(t.duration_since(std::time::UNIX_EPOCH).expect("after 1970").as_secs()).expect("i64")
        };
        let week = pki.crl_pem_with_validity(&[], now, at(7)).expect("crl");
        let day = pki.crl_pem_with_validity(&[], now, at(1)).expect("crl");
        let list = RevocationList::from_pem(&pki.ca_pem, &[&week, &day]).expect("valid CRLs");
        // ASN.1 times are whole seconds.
        let got = list.next_update_unix().expect("a nextUpdate");
        assert!((unix(at(1)) - got).abs() <= 1, "{got} against {}", unix(at(1)));
        assert_eq!(list.next_update_origin(), Some(&PemOrigin::Memory("crl_pems")));
        assert_eq!(RevocationList::from_pem(&pki.ca_pem, &[]).expect("no CRLs").next_update_unix(), None);
    }

    #[test]
    fn revocation_list_refuses_an_expired_crl() {
        let pki = pki();
        let long_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(10 * 86_400);
        let crl =
            pki.crl_pem_with_validity(&[], long_ago, long_ago + std::time::Duration::from_secs(86_400)).expect("crl");
        let err = RevocationList::from_pem(&pki.ca_pem, &[&crl]).expect_err("expired CRL");
        assert!(matches!(err, RevocationError::Expired { .. }), "{err}");
    }

    #[test]
    fn revocation_list_refuses_garbage_and_truncated_files() {
        let pki = pki();
        let crl = pki.crl_pem(&[], in_a_day()).expect("crl");
        let garbage = "-----BEGIN X509 CRL-----\nAAAA\n-----END X509 CRL-----\n";
        let err = RevocationList::from_pem(&pki.ca_pem, &[garbage]).expect_err("garbage");
        assert!(matches!(err, RevocationError::Parse { .. }), "{err}");
        let err = RevocationList::from_pem(&pki.ca_pem, &[&crl[..crl.len() / 2]]).expect_err("half a file");
        assert!(matches!(err, RevocationError::Transport(_)), "{err}");
        let err = RevocationList::from_pem(&pki.ca_pem, &[""]).expect_err("empty file");
        assert!(matches!(err, RevocationError::Transport(TransportError::NoCrl { .. })), "{err}");
    }

    /// A CA made with rcgen directly (the PKI module gives every CA a name of its own): all
    /// of them are named alike, as an outside CA rolled over under the same name.
    fn same_name_ca() -> (String, rcgen::Issuer<'static, rcgen::KeyPair>) {
        let key = rcgen::KeyPair::generate().expect("CA key");
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(rcgen::DnType::OrganizationName, "Outside Org");
        params.distinguished_name.push(rcgen::DnType::CommonName, "Outside Device CA");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let cert = params.self_signed(&key).expect("CA certificate");
        (cert.pem(), rcgen::Issuer::new(params, key))
    }

    fn device_of(ca: &rcgen::Issuer<'static, rcgen::KeyPair>, device: &str, serial: &[u8]) -> String {
        let key = rcgen::KeyPair::generate().expect("device key");
        let mut params = rcgen::CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(rcgen::DnType::CommonName, device);
        params.serial_number = Some(rcgen::SerialNumber::from_slice(serial));
        params.signed_by(&key, ca).expect("device certificate").pem()
    }

    fn crl_of(ca: &rcgen::Issuer<'static, rcgen::KeyPair>, revoked_serials: &[&[u8]]) -> String {
        let params = rcgen::CertificateRevocationListParams {
            this_update: rcgen::date_time_ymd(2020, 1, 1),
            next_update: rcgen::date_time_ymd(2100, 1, 1),
            crl_number: rcgen::SerialNumber::from_slice(&[1]),
            issuing_distribution_point: None,
            revoked_certs: revoked_serials
                .iter()
                .map(|serial| rcgen::RevokedCertParams {
                    serial_number: rcgen::SerialNumber::from_slice(serial),
                    revocation_time: rcgen::date_time_ymd(2020, 1, 1),
                    reason_code: None,
                    invalidity_date: None,
                })
                .collect(),
            key_identifier_method: rcgen::KeyIdMethod::Sha256,
        };
        params.signed_by(ca).expect("CRL").pem().expect("CRL PEM")
    }

    #[test]
    fn revocation_list_accepts_a_crl_of_any_client_ca_sharing_its_issuer_name() {
        let (first_pem, first) = same_name_ca();
        let (second_pem, second) = same_name_ca();
        let (_, stranger) = same_name_ca();
        let client_ca = format!("{first_pem}{second_pem}");
        let revoked = device_of(&second, "dev-revoked", &[0x11, 0x22, 0x33]);
        let kept = device_of(&second, "dev-kept", &[0x44, 0x55, 0x66]);

        // Signed by the second CA of that name: the first one's key does not verify it.
        let crl = crl_of(&second, &[&[0x11, 0x22, 0x33]]);
        let list = RevocationList::from_pem(&client_ca, &[&crl]).expect("CRL of the second same-name CA");
        assert_eq!((list.len(), list.crl_count()), (1, 1));
        assert_eq!(list.revoked_serial(&der(&revoked)).as_deref(), Some("112233"));
        assert_eq!(list.revoked_serial(&der(&kept)), None);

        // Either order of the CA file, and a CRL from each CA at once.
        let reversed = format!("{second_pem}{first_pem}");
        let both = RevocationList::from_pem(&reversed, &[&crl, &crl_of(&first, &[])]).expect("CRLs of both CAs");
        assert_eq!((both.len(), both.crl_count()), (1, 2));

        // Signed by a third CA of the same name that is not a client CA: still refused.
        let foreign = crl_of(&stranger, &[&[0x11, 0x22, 0x33]]);
        let err = RevocationList::from_pem(&client_ca, &[&foreign]).expect_err("CRL of neither CA");
        match &err {
            RevocationError::NotIssuedByClientCa { index: 0, detail, .. } => {
                assert!(detail.contains("none of the 2 client CAs"), "{err}");
            }
            other => panic!("expected NotIssuedByClientCa, got {other}"),
        }
        let err = RevocationList::from_pem(&first_pem, &[&crl]).expect_err("CRL of a CA not in the file");
        assert!(matches!(err, RevocationError::NotIssuedByClientCa { index: 0, .. }), "{err}");
    }

    #[test]
    fn malformed_server_name_is_refused_naming_the_field() {
        let pki = pki();
        let dir = tempfile::tempdir().expect("tempdir");
        let files = pki.write_device_files("dev-1", dir.path()).expect("device files");
        let tls = ClientTls {
            cert: files.cert,
            key: files.key,
            server_ca: files.ca_cert,
            server_name: "not a host name!".to_owned(),
        };
        let err = client_config(&tls, &Tuning::default()).expect_err("bad server name");
        assert!(matches!(err, TransportError::InvalidServerName { .. }), "{err}");
        assert!(err.to_string().contains("server_name"), "{err}");
    }
}
