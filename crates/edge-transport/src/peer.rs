//! What we learn about the peer of a connection: the device identity from the client
//! certificate ([`peer_device_id`]) and, when a handshake failed, the TLS alert behind it
//! ([`tls_alert`]).
//!
//! The device id is the subject common name of the verified leaf certificate, checked against
//! the same grammar [`crate::pki::validate_device_id`] enforces when
//! issuing. Nothing the client sends on a stream can change it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::AlertDescription;
use rustls::pki_types::CertificateDer;

use crate::pki::{self, PkiError};

/// Why a connection's device identity could not be determined.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum IdentityError {
    /// quinn has no peer identity: the handshake is not complete (0.5-RTT), or the peer sent
    /// no certificate (impossible on a server built by this crate).
    #[error("the peer has no identity yet: handshake incomplete or no client certificate")]
    NoPeerIdentity,
    /// The identity is not a rustls certificate chain (another crypto backend).
    #[error("the peer identity is not a rustls certificate chain")]
    UnexpectedIdentityType,
    /// The peer's certificate chain is empty.
    #[error("the peer certificate chain is empty")]
    EmptyChain,
    /// The leaf certificate does not parse as X.509.
    #[error("the peer leaf certificate is not valid X.509: {0}")]
    Parse(String),
    /// The leaf's subject has no common name.
    #[error("the peer leaf certificate subject has no common name (CN)")]
    NoCommonName,
    /// The leaf's subject has more than one common name, so the identity is ambiguous.
    #[error("the peer leaf certificate subject has {0} common names; exactly one is required")]
    MultipleCommonNames(usize),
    /// The common name is not a text string.
    #[error("the peer leaf certificate common name is not a text string: {0}")]
    CommonNameEncoding(String),
    /// The common name is text but not a valid device id.
    #[error("the peer leaf certificate common name is not a valid device id: {0}")]
    InvalidDeviceId(#[source] PkiError),
    /// The leaf certificate is not valid at this time (expired, or not yet valid).
    #[error("the peer leaf certificate is valid from {not_before} to {not_after}, not now")]
    NotValidNow { not_before: String, not_after: String },
}

/// The device id of the peer of `conn`: the subject CN of its verified leaf certificate.
///
/// On the server, call it after the handshake completed (`Incoming`/`Connecting` resolved,
/// or `Connection::authenticated` resolved when 0.5-RTT is in use). Resumed connections carry
/// the chain of their original handshake, so they work too.
pub fn peer_device_id(conn: &quinn::Connection) -> Result<String, IdentityError> {
    device_id_from_cert_der(peer_certificate(conn)?.as_ref())
}

/// The verified leaf certificate of the peer of `conn` (DER), for checks after the handshake
/// such as [`RevocationList::revoked_serial`](crate::tls::RevocationList::revoked_serial).
/// Same preconditions as [`peer_device_id`].
pub fn peer_certificate(conn: &quinn::Connection) -> Result<CertificateDer<'static>, IdentityError> {
    let identity = conn.peer_identity().ok_or(IdentityError::NoPeerIdentity)?;
    let chain =
        identity.downcast::<Vec<CertificateDer<'static>>>().map_err(|_| IdentityError::UnexpectedIdentityType)?;
    chain.first().cloned().ok_or(IdentityError::EmptyChain)
}

/// The device id in a DER certificate: its single subject CN, validated as a device id.
pub fn device_id_from_cert_der(der: &[u8]) -> Result<String, IdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| IdentityError::Parse(e.to_string()))?;
    let names: Vec<_> = cert.subject().iter_common_name().collect();
    let name = match names.as_slice() {
        [] => return Err(IdentityError::NoCommonName),
        [one] => one,
        many => return Err(IdentityError::MultipleCommonNames(many.len())),
    };
    let id = name.as_str().map_err(|e| IdentityError::CommonNameEncoding(e.to_string()))?;
    pki::validate_device_id(id).map_err(IdentityError::InvalidDeviceId)?;
    Ok(id.to_owned())
}

/// When the leaf certificate `der` stops being valid (its notAfter), or
/// [`IdentityError::NotValidNow`] when it is not valid at `now`.
///
/// The TLS handshake checks the validity period, but a resumed session asks for no certificate:
/// it carries the one of its first handshake, so a device whose certificate expired since could
/// go on resuming. A server checks this after every handshake, and closes a connection that
/// outlives its certificate.
pub fn certificate_valid_until(der: &[u8], now: SystemTime) -> Result<SystemTime, IdentityError> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| IdentityError::Parse(e.to_string()))?;
    let validity = cert.validity();
    let not_before = from_unix(validity.not_before.timestamp());
    let not_after = from_unix(validity.not_after.timestamp());
    if now < not_before || now > not_after {
        return Err(IdentityError::NotValidNow {
            not_before: validity.not_before.to_string(),
            not_after: validity.not_after.to_string(),
        });
    }
    Ok(not_after)
}

/// Seconds since the Unix epoch as a `SystemTime` (X.509 times, years 0 to 9999, all fit on
/// Linux; one that did not would read as the epoch).
fn from_unix(secs: i64) -> SystemTime {
    let offset = Duration::from_secs(secs.unsigned_abs());
    let t = if secs >= 0 { UNIX_EPOCH.checked_add(offset) } else { UNIX_EPOCH.checked_sub(offset) };
    t.unwrap_or(UNIX_EPOCH)
}

/// The TLS alert that ended a connection during the handshake, if any.
///
/// QUIC carries TLS alerts as CRYPTO_ERROR transport codes `0x100 + alert`. This works on both
/// sides: the side that detected the problem sees a local `TransportError`, the other side a
/// `ConnectionClosed` from the peer. For example a server refusing a client without
/// certificate reports [`AlertDescription::CertificateRequired`], an unknown client CA
/// [`AlertDescription::UnknownCA`], an expired or not-yet-valid certificate
/// [`AlertDescription::CertificateExpired`], a revoked one
/// [`AlertDescription::CertificateRevoked`], and an ALPN mismatch
/// [`AlertDescription::NoApplicationProtocol`].
pub fn tls_alert(err: &quinn::ConnectionError) -> Option<AlertDescription> {
    let code = match err {
        quinn::ConnectionError::TransportError(e) => e.code,
        quinn::ConnectionError::ConnectionClosed(close) => close.error_code,
        _ => return None,
    };
    let raw = u64::from(code);
    if (0x100..=0x1ff).contains(&raw) { u8::try_from(raw - 0x100).ok().map(AlertDescription::from) } else { None }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki::InMemoryPki;

    fn der_of(pem_text: &str) -> Vec<u8> {
        use rustls::pki_types::pem::PemObject;
        CertificateDer::from_pem_slice(pem_text.as_bytes()).expect("certificate PEM").to_vec()
    }

    #[test]
    fn device_id_is_the_subject_common_name() {
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        let (cert, _) = pki.issue_device("sensor-7.a_b").expect("device");
        assert_eq!(device_id_from_cert_der(&der_of(&cert)).expect("device id"), "sensor-7.a_b");
    }

    #[test]
    fn certificate_whose_common_name_is_not_a_device_id_is_refused() {
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        // The server certificate's CN contains a space, which no device id may contain.
        let err = device_id_from_cert_der(&der_of(&pki.server_cert_pem)).expect_err("not a device");
        assert!(matches!(err, IdentityError::InvalidDeviceId(_)), "{err}");
    }

    #[test]
    fn a_certificate_is_valid_only_within_its_period() {
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        let (cert, _) = pki.issue_device("sensor-8").expect("device");
        let der = der_of(&cert);
        let now = SystemTime::now();
        let until = certificate_valid_until(&der, now).expect("valid now");
        assert!(until > now + Duration::from_secs(86_400), "issued for more than a day");
        let after = until + Duration::from_secs(1);
        let err = certificate_valid_until(&der, after).expect_err("expired");
        assert!(matches!(err, IdentityError::NotValidNow { .. }), "{err}");
        let before = now - Duration::from_secs(10 * 365 * 86_400);
        assert!(matches!(certificate_valid_until(&der, before), Err(IdentityError::NotValidNow { .. })));
        assert!(matches!(certificate_valid_until(b"junk", now), Err(IdentityError::Parse(_))));
    }

    #[test]
    fn garbage_is_not_a_certificate() {
        let err = device_id_from_cert_der(b"not a certificate").expect_err("garbage");
        assert!(matches!(err, IdentityError::Parse(_)), "{err}");
    }

    #[test]
    fn crypto_error_codes_map_to_tls_alerts() {
        let closed = quinn::ConnectionError::ConnectionClosed(quinn::ConnectionClose {
            error_code: quinn::TransportErrorCode::crypto(116),
            frame_type: None,
            reason: Vec::new().into(),
        });
        assert_eq!(tls_alert(&closed), Some(AlertDescription::CertificateRequired));
        assert_eq!(tls_alert(&quinn::ConnectionError::TimedOut), None);
    }
}
