//! The error type of the TLS configuration and endpoint functions, and [`PemOrigin`], which
//! says where a piece of PEM came from so every error names its bad input.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Where a PEM document came from: a file, or a named in-memory argument.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PemOrigin {
    /// Read from this file.
    File(PathBuf),
    /// Passed in memory as the argument with this name (e.g. `client_ca_pem`).
    Memory(&'static str),
}

impl fmt::Display for PemOrigin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => write!(f, "file {}", path.display()),
            Self::Memory(name) => write!(f, "in-memory argument `{name}`"),
        }
    }
}

/// Errors from building TLS/QUIC configurations and endpoints.
///
/// Every variant names the input at fault: the file (or in-memory argument) and what it was
/// supposed to contain, the tuning field, or the socket address.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// A PEM file could not be read.
    #[error("cannot read {what} from {}: {source}", .path.display())]
    ReadFile {
        /// What the file should contain, e.g. "server certificate chain".
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },

    /// The PEM text is malformed.
    #[error("{what} in {origin} is not valid PEM: {detail}")]
    Pem {
        /// What the input should contain.
        what: &'static str,
        /// Where it came from.
        origin: PemOrigin,
        /// The parser's complaint.
        detail: String,
    },

    /// The PEM text holds no `CERTIFICATE` block.
    #[error("no certificate found in {what} ({origin})")]
    NoCertificate {
        /// What the input should contain.
        what: &'static str,
        /// Where it came from.
        origin: PemOrigin,
    },

    /// The PEM text holds no private key block (PKCS#8, PKCS#1 or SEC1).
    #[error("no private key found in {what} ({origin}); expected a PKCS#8, PKCS#1 or SEC1 PEM block")]
    NoPrivateKey {
        /// What the input should contain.
        what: &'static str,
        /// Where it came from.
        origin: PemOrigin,
    },

    /// The PEM text holds no `X509 CRL` block.
    #[error("no certificate revocation list found in {what} ({origin})")]
    NoCrl {
        /// What the input should contain.
        what: &'static str,
        /// Where it came from.
        origin: PemOrigin,
    },

    /// A certificate cannot be used as a trust anchor.
    #[error("{what} ({origin}): certificate #{index} is not usable as a trust anchor: {source}")]
    BadCertificate {
        /// What the input should contain.
        what: &'static str,
        /// Where it came from.
        origin: PemOrigin,
        /// Zero-based position of the certificate in the PEM text.
        index: usize,
        /// rustls' reason.
        #[source]
        source: rustls::Error,
    },

    /// A CRL could not be parsed or used.
    #[error("certificate revocation list in {origin} is not usable: {source}")]
    BadCrl {
        /// Where the CRL came from.
        origin: PemOrigin,
        /// rustls' reason.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },

    /// The certificate chain and private key do not form a usable identity (bad key encoding,
    /// unsupported algorithm, or the key does not belong to the leaf certificate).
    #[error("certificate chain ({cert}) and private key ({key}) are not a usable pair: {source}")]
    BadIdentity {
        /// Where the certificate chain came from.
        cert: PemOrigin,
        /// Where the key came from.
        key: PemOrigin,
        /// rustls' reason.
        #[source]
        source: rustls::Error,
    },

    /// The client certificate verifier could not be built over the client CA.
    #[error("cannot build the client certificate verifier over {origin}: {source}")]
    ClientVerifier {
        /// Where the client CA came from.
        origin: PemOrigin,
        /// rustls' reason.
        #[source]
        source: rustls::server::VerifierBuilderError,
    },

    /// `ClientTls::server_name` is neither a DNS name nor an IP address literal.
    #[error("invalid server_name {name:?}: {source}")]
    InvalidServerName {
        /// The rejected value.
        name: String,
        /// The parser's reason.
        #[source]
        source: rustls::pki_types::InvalidDnsNameError,
    },

    /// rustls refused a configuration step.
    #[error("rustls rejected the {context}: {source}")]
    Rustls {
        /// The step that failed.
        context: &'static str,
        /// rustls' reason.
        #[source]
        source: rustls::Error,
    },

    /// The TLS configuration lacks what QUIC needs for its initial packets.
    #[error("TLS configuration is not usable for QUIC: {0}")]
    Quic(#[from] quinn::crypto::rustls::NoInitialCipherSuite),

    /// A [`Tuning`](crate::Tuning) field is out of range.
    #[error("invalid tuning: {field} = {value}: {reason}")]
    InvalidTuning {
        /// The field name.
        field: &'static str,
        /// The rejected value, formatted.
        value: String,
        /// Why it is rejected.
        reason: &'static str,
    },

    /// Creating, configuring or binding the UDP socket failed.
    #[error("cannot {op} the UDP socket for {addr}: {source}")]
    Socket {
        /// The step that failed, e.g. "bind".
        op: &'static str,
        /// The address the socket was for.
        addr: SocketAddr,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_file_error_names_the_path_and_the_content() {
        let err = TransportError::ReadFile {
            what: "client CA certificates",
            path: PathBuf::from("/etc/edge/ca.pem"),
            source: io::Error::from(io::ErrorKind::NotFound),
        };
        let text = err.to_string();
        assert!(text.contains("/etc/edge/ca.pem"), "{text}");
        assert!(text.contains("client CA certificates"), "{text}");
    }

    #[test]
    fn memory_origin_names_the_argument() {
        assert_eq!(PemOrigin::Memory("key_pem").to_string(), "in-memory argument `key_pem`");
    }
}
