//! A small certificate authority for edge-uploader deployments and tests.
//!
//! One CA (ECDSA P-256, path length 0) issues both the ingest server certificate (EKU
//! serverAuth, SANs from [`InitOptions::server_names`]) and the device certificates (EKU
//! clientAuth, subject CN = device id). The EKUs keep the two apart: a device certificate
//! cannot serve, and the server certificate cannot log in as a device.
//!
//! # On-disk layout
//!
//! | file | content | mode |
//! |---|---|---|
//! | `ca.pem` / `ca.key` | CA certificate / its PKCS#8 key | 0644 / 0600 |
//! | `server.pem` / `server.key` | server certificate / key | 0644 / 0600 |
//! | `device.pem` / `device.key` / `ca.pem` | device certificate / key / CA copy (per device dir) | 0644 / 0600 / 0644 |
//!
//! Directories are created with mode 0700 when missing (existing ones are left alone). Each
//! file is written to a temporary name, synced and renamed into place, so a crash never
//! leaves a half-written key; a key never exists on disk with wider permissions than 0600.
//!
//! Certificates are backdated by one hour so agents with a slightly slow clock accept them.
//! Serial numbers are derived from the subject key (rcgen's default), so every certificate
//! with a fresh key gets a fresh serial, which CRLs refer to.
//!
//! # Device ids
//!
//! A device id matches `[A-Za-z0-9_.-]{1,64}` and is neither `.` nor `..` (ids end up in file
//! names on the server). [`validate_device_id`] is the single definition; the server applies
//! it again to the CN it reads from a peer certificate.

use std::fmt;
use std::fs::{self, DirBuilder, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, CertificateRevocationListParams, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyIdMethod, KeyPair, KeyUsagePurpose, RevokedCertParams, SanType, SerialNumber,
};
use rustls::pki_types::ServerName;
use x509_parser::certificate::X509Certificate;

use crate::tls::{ClientTls, ServerTls};

/// Converts a `SystemTime` into the date-time type rcgen's parameters use. A macro rather than
/// a function because that type belongs to the `time` crate, which this crate does not depend
/// on and therefore cannot name; inference finds it at each use site.
macro_rules! rcgen_time {
    ($t:expr, $field:expr) => {{
        let epoch = rcgen::date_time_ymd(1970, 1, 1);
        let converted = match $t.duration_since(UNIX_EPOCH) {
            Ok(after) => after.try_into().ok().and_then(|d| epoch.checked_add(d)),
            Err(before) => before.duration().try_into().ok().and_then(|d| epoch.checked_sub(d)),
        };
        converted.ok_or_else(|| PkiError::InvalidValidity {
            field: $field,
            reason: "the date is outside the range X.509 can encode".into(),
        })
    }};
}

/// File name of the CA certificate.
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the CA private key.
pub const CA_KEY_FILE: &str = "ca.key";
/// File name of the server certificate.
pub const SERVER_CERT_FILE: &str = "server.pem";
/// File name of the server private key.
pub const SERVER_KEY_FILE: &str = "server.key";
/// File name of a device certificate.
pub const DEVICE_CERT_FILE: &str = "device.pem";
/// File name of a device private key.
pub const DEVICE_KEY_FILE: &str = "device.key";

/// Default lifetime of the CA and server certificates made by [`init`], in days.
pub const DEFAULT_VALIDITY_DAYS: u32 = 3650;
/// Lifetime of device certificates made by [`InMemoryPki::issue_device`], in days.
pub const DEFAULT_DEVICE_VALIDITY_DAYS: u32 = 365;
/// Upper bound for any `validity_days` argument (100 years).
pub const MAX_VALIDITY_DAYS: u32 = 36_500;
/// Longest device id.
pub const MAX_DEVICE_ID_LEN: usize = 64;

const BACKDATE: Duration = Duration::from_secs(3600);
const DAY: Duration = Duration::from_secs(86_400);
const ORGANIZATION: &str = "edge-uploader";
const CA_COMMON_NAME: &str = "edge-uploader CA";
/// Contains a space on purpose: it can never be mistaken for a device id.
const SERVER_COMMON_NAME: &str = "edge-ingest server";
const KEY_MODE: u32 = 0o600;
const CERT_MODE: u32 = 0o644;
const DIR_MODE: u32 = 0o700;

/// Options of [`init`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitOptions {
    /// Names the server certificate is valid for: DNS names and/or IP literals, each becoming
    /// a SAN. Default `["localhost", "127.0.0.1", "::1"]`.
    pub server_names: Vec<String>,
    /// Lifetime of the CA and the server certificate, in days (1..=36500). Default 3650.
    pub validity_days: u32,
    /// Replace an existing CA. Every certificate issued by the old CA stops working.
    pub force: bool,
}

impl Default for InitOptions {
    fn default() -> Self {
        Self {
            server_names: vec!["localhost".into(), "127.0.0.1".into(), "::1".into()],
            validity_days: DEFAULT_VALIDITY_DAYS,
            force: false,
        }
    }
}

/// Files written by [`init`] or [`InMemoryPki::write_all`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PkiPaths {
    /// `ca.pem`.
    pub ca_cert: PathBuf,
    /// `ca.key` (0600).
    pub ca_key: PathBuf,
    /// `server.pem`.
    pub server_cert: PathBuf,
    /// `server.key` (0600).
    pub server_key: PathBuf,
}

impl PkiPaths {
    /// The server TLS files: this server identity, trusting this CA for clients, no CRLs.
    pub fn server_tls(&self) -> ServerTls {
        ServerTls {
            cert: self.server_cert.clone(),
            key: self.server_key.clone(),
            client_ca: self.ca_cert.clone(),
            crls: Vec::new(),
        }
    }
}

/// Files written by [`InMemoryPki::write_server_files`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerPaths {
    /// `server.pem`.
    pub cert: PathBuf,
    /// `server.key` (0600).
    pub key: PathBuf,
    /// `ca.pem`: the CA that issues device certificates.
    pub client_ca: PathBuf,
}

impl ServerPaths {
    /// The server TLS files, without CRLs.
    pub fn server_tls(&self) -> ServerTls {
        ServerTls {
            cert: self.cert.clone(),
            key: self.key.clone(),
            client_ca: self.client_ca.clone(),
            crls: Vec::new(),
        }
    }
}

/// Files written for one device by [`issue_device`] or [`InMemoryPki::write_device_files`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevicePaths {
    /// `device.pem`.
    pub cert: PathBuf,
    /// `device.key` (0600).
    pub key: PathBuf,
    /// `ca.pem`: the CA copy the agent uses to verify the server.
    pub ca_cert: PathBuf,
}

impl DevicePaths {
    /// The agent TLS files, verifying the server as `server_name`.
    pub fn client_tls(&self, server_name: impl Into<String>) -> ClientTls {
        ClientTls {
            cert: self.cert.clone(),
            key: self.key.clone(),
            server_ca: self.ca_cert.clone(),
            server_name: server_name.into(),
        }
    }
}

/// Errors of the PKI helpers. Each names the input at fault.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PkiError {
    /// The device id does not match `[A-Za-z0-9_.-]{1,64}` (or is `.`/`..`).
    #[error("invalid device id {id:?}: {reason}")]
    InvalidDeviceId {
        /// The rejected id.
        id: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A server name is neither a valid DNS name nor an IP literal.
    #[error("invalid server name {name:?}: {reason}")]
    InvalidServerName {
        /// The rejected name.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// `server_names` is empty.
    #[error("server_names is empty; the server certificate needs at least one name")]
    NoServerNames,
    /// A validity argument is out of range.
    #[error("invalid {field}: {reason}")]
    InvalidValidity {
        /// The argument, e.g. "validity_days".
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// `init` found an existing CA and `force` was not set.
    #[error("a CA already exists at {}; refusing to overwrite it without force", .path.display())]
    CaExists {
        /// The existing CA file.
        path: PathBuf,
    },
    /// A file or directory operation failed.
    #[error("cannot {action} {}: {source}", .path.display())]
    Io {
        /// What was being done, e.g. "read", "create directory".
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: io::Error,
    },
    /// The CA certificate or key cannot be used to issue certificates.
    #[error("unusable CA ({}): {reason}", .path.display())]
    InvalidCa {
        /// The CA file at fault.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A certificate given for revocation cannot be used.
    #[error("cannot revoke the certificate in {origin}: {reason}")]
    InvalidRevocation {
        /// Where the certificate came from.
        origin: String,
        /// What is wrong with it.
        reason: String,
    },
    /// rcgen failed to generate a key, certificate or CRL.
    #[error("cannot generate the {what}: {source}")]
    Generate {
        /// What was being generated, e.g. "device certificate for \"dev-1\"".
        what: String,
        /// rcgen's reason.
        #[source]
        source: rcgen::Error,
    },
}

/// Checks that `id` is a valid device id: 1 to 64 characters from `A-Z a-z 0-9 _ . -`, and
/// not `.` or `..`. The error names the id and the first offending character.
pub fn validate_device_id(id: &str) -> Result<(), PkiError> {
    let reject = |reason: String| Err(PkiError::InvalidDeviceId { id: id.to_owned(), reason });
    if id.is_empty() {
        return reject("it is empty".into());
    }
    if let Some(bad) = id.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-'))) {
        return reject(format!("it contains {bad:?}; only A-Z a-z 0-9 _ . - are allowed"));
    }
    if id.len() > MAX_DEVICE_ID_LEN {
        return reject(format!("it is {} characters long; at most {MAX_DEVICE_ID_LEN} are allowed", id.len()));
    }
    if id == "." || id == ".." {
        return reject("`.` and `..` are reserved path components".into());
    }
    Ok(())
}

/// Creates a CA and a server certificate in `dir`: `ca.pem`, `ca.key`, `server.pem`,
/// `server.key` (keys 0600; `dir` created 0700 if missing).
///
/// Refuses with [`PkiError::CaExists`] when `ca.pem` or `ca.key` already exists, unless
/// `opts.force` is set.
pub fn init(dir: &Path, opts: &InitOptions) -> Result<PkiPaths, PkiError> {
    let names: Vec<&str> = opts.server_names.iter().map(String::as_str).collect();
    // Validate everything before touching the disk.
    let validity = validity_from_days("validity_days", opts.validity_days)?;
    server_params(&names, validity)?;
    let paths = pki_paths(dir);
    if !opts.force {
        for existing in [&paths.ca_cert, &paths.ca_key] {
            if existing.exists() {
                return Err(PkiError::CaExists { path: existing.clone() });
            }
        }
    }
    let pki = InMemoryPki::generate_with_validity(&names, validity)?;
    pki.write_all(dir)
}

/// Issues a device certificate with the CA in `ca_dir` and writes `device.pem`, `device.key`
/// (0600) and a copy of `ca.pem` to `out_dir` (created 0700 if missing). Existing device files
/// in `out_dir` are replaced (re-issuing is how a device certificate is rotated).
pub fn issue_device(ca_dir: &Path, device: &str, out_dir: &Path, validity_days: u32) -> Result<DevicePaths, PkiError> {
    validate_device_id(device)?;
    let (not_before, not_after) = validity_from_days("validity_days", validity_days)?;
    let ca = Ca::load(ca_dir)?;
    let (cert_pem, key_pem) = ca.issue_device(device, not_before, not_after)?;
    write_device(out_dir, &cert_pem, &key_pem, &ca.cert_pem)
}

/// Writes to `out` a CRL signed by the CA in `ca_dir` that revokes the certificates in the
/// PEM files `revoked`, valid (its `nextUpdate`) for `validity_days`. The server enforces
/// `nextUpdate`, so the CRL must be re-issued before then.
pub fn write_crl(ca_dir: &Path, revoked: &[PathBuf], out: &Path, validity_days: u32) -> Result<PathBuf, PkiError> {
    let (_, next_update) = validity_from_days("validity_days", validity_days)?;
    let ca = Ca::load(ca_dir)?;
    write_crl_of(&ca, revoked, out, next_update)?;
    Ok(out.to_owned())
}

/// Writes to `out` a CRL signed by `ca` revoking the certificates in the PEM files `certs`;
/// returns how many it revokes.
fn write_crl_of(ca: &Ca, certs: &[PathBuf], out: &Path, next_update: SystemTime) -> Result<usize, PkiError> {
    let mut texts = Vec::with_capacity(certs.len());
    for path in certs {
        texts.push((format!("file {}", path.display()), read_text(path)?));
    }
    let crl = ca.crl(&texts, SystemTime::now(), next_update)?;
    write_file(out, crl.as_bytes(), CERT_MODE)?;
    Ok(texts.len())
}

/// The CRL [`revoke`] and [`reissue_crl`] write in the CA directory.
pub const CRL_FILE: &str = "crl.pem";
/// The directory in the CA directory where [`revoke`] keeps a copy of every revoked
/// certificate, named by serial number; [`reissue_crl`] builds the CRL from it.
pub const REVOKED_DIR: &str = "revoked";
/// How long a CRL written by [`revoke`] and [`reissue_crl`] is valid by default.
pub const DEFAULT_CRL_VALIDITY_DAYS: u32 = 30;

/// What [`revoke`] and [`reissue_crl`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CrlWritten {
    /// `<ca_dir>/crl.pem`.
    pub crl: PathBuf,
    /// Certificates it revokes: every one ever revoked with this CA directory.
    pub revoked: usize,
    /// Of those, how many this call added (a certificate revoked twice counts once).
    pub added: usize,
}

/// Revokes the device certificates in the PEM files `certs`, each checked to be issued by the
/// CA in `ca_dir`: keeps a copy of each in `<ca_dir>/revoked/`, then writes `<ca_dir>/crl.pem`
/// revoking every certificate kept there, valid for `validity_days` (the server refuses a CRL
/// past its `nextUpdate`: re-issue it in time with [`reissue_crl`]). Nothing is written if any
/// certificate is refused. The ingest server reloads the CRL when the file changes.
pub fn revoke(ca_dir: &Path, certs: &[PathBuf], validity_days: u32) -> Result<CrlWritten, PkiError> {
    let (_, next_update) = validity_from_days("validity_days", validity_days)?;
    let ca = Ca::load(ca_dir)?;
    let mut checked = Vec::with_capacity(certs.len());
    for path in certs {
        let text = read_text(path)?;
        let serial = ca.issued_serial(&format!("file {}", path.display()), &text)?;
        checked.push((serial, text));
    }
    let dir = ca_dir.join(REVOKED_DIR);
    ensure_dir(&dir)?;
    let mut added = 0;
    for (serial, text) in checked {
        let hex: String = serial.iter().map(|b| format!("{b:02x}")).collect();
        let kept = dir.join(format!("{hex}.pem"));
        if !kept.exists() {
            write_file(&kept, text.as_bytes(), CERT_MODE)?;
            added += 1;
        }
    }
    let mut written = write_revoked_crl(&ca, ca_dir, next_update)?;
    written.added = added;
    Ok(written)
}

/// Writes `<ca_dir>/crl.pem` again from the certificates kept in `<ca_dir>/revoked/`, valid for
/// `validity_days`: run it before the current CRL's `nextUpdate` (a cron job or timer).
pub fn reissue_crl(ca_dir: &Path, validity_days: u32) -> Result<CrlWritten, PkiError> {
    let (_, next_update) = validity_from_days("validity_days", validity_days)?;
    let ca = Ca::load(ca_dir)?;
    write_revoked_crl(&ca, ca_dir, next_update)
}

fn write_revoked_crl(ca: &Ca, ca_dir: &Path, next_update: SystemTime) -> Result<CrlWritten, PkiError> {
    let dir = ca_dir.join(REVOKED_DIR);
    let mut certs = Vec::new();
    match fs::read_dir(&dir) {
        Ok(entries) => {
            for entry in entries {
                let path = entry.map_err(|source| PkiError::Io { action: "list", path: dir.clone(), source })?.path();
                if path.extension().is_some_and(|e| e == "pem") {
                    certs.push(path);
                }
            }
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(source) => return Err(PkiError::Io { action: "list", path: dir, source }),
    }
    certs.sort();
    let out = ca_dir.join(CRL_FILE);
    let revoked = write_crl_of(ca, &certs, &out, next_update)?;
    Ok(CrlWritten { crl: out, revoked, added: 0 })
}

/// A CA, server identity and device issuer held in memory, for tests and the demo.
///
/// `Debug` leaves out the private keys.
pub struct InMemoryPki {
    /// The CA certificate (PEM); both ends trust it.
    pub ca_pem: String,
    /// The server certificate (PEM), issued by the CA.
    pub server_cert_pem: String,
    /// The server private key (PKCS#8 PEM).
    pub server_key_pem: String,
    ca: Ca,
}

impl fmt::Debug for InMemoryPki {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InMemoryPki")
            .field("ca_pem", &self.ca_pem)
            .field("server_cert_pem", &self.server_cert_pem)
            .field("server_key_pem", &"[elided]")
            .finish_non_exhaustive()
    }
}

impl InMemoryPki {
    /// A fresh CA and a server certificate valid for `server_names` (DNS names and/or IP
    /// literals), both valid for [`DEFAULT_VALIDITY_DAYS`].
    pub fn generate(server_names: &[&str]) -> Result<Self, PkiError> {
        let validity = validity_from_days("validity_days", DEFAULT_VALIDITY_DAYS)?;
        Self::generate_with_validity(server_names, validity)
    }

    fn generate_with_validity(
        server_names: &[&str],
        (not_before, not_after): (SystemTime, SystemTime),
    ) -> Result<Self, PkiError> {
        let ca = Ca::generate(not_before, not_after)?;
        let (server_cert_pem, server_key_pem) = ca.issue_server(server_names, (not_before, not_after))?;
        Ok(Self { ca_pem: ca.cert_pem.clone(), server_cert_pem, server_key_pem, ca })
    }

    /// The CA private key (PKCS#8 PEM), e.g. to persist the CA.
    pub fn ca_key_pem(&self) -> &str {
        &self.ca.key_pem
    }

    /// A device certificate and key (PEM) for `device`, valid from an hour ago for
    /// [`DEFAULT_DEVICE_VALIDITY_DAYS`].
    pub fn issue_device(&self, device: &str) -> Result<(String, String), PkiError> {
        validate_device_id(device)?;
        let (not_before, not_after) = validity_from_days("validity_days", DEFAULT_DEVICE_VALIDITY_DAYS)?;
        self.ca.issue_device(device, not_before, not_after)
    }

    /// A device certificate and key (PEM) valid exactly from `not_before` to `not_after`;
    /// tests use it for expired and not-yet-valid certificates.
    pub fn issue_device_with_validity(
        &self,
        device: &str,
        not_before: SystemTime,
        not_after: SystemTime,
    ) -> Result<(String, String), PkiError> {
        validate_device_id(device)?;
        if not_after <= not_before {
            return Err(PkiError::InvalidValidity {
                field: "not_after",
                reason: "must be later than not_before".into(),
            });
        }
        self.ca.issue_device(device, not_before, not_after)
    }

    /// A CRL (PEM) signed by the CA revoking the given certificates (PEM), valid until
    /// `next_update`.
    pub fn crl_pem(&self, revoked_cert_pems: &[&str], next_update: SystemTime) -> Result<String, PkiError> {
        let now = SystemTime::now();
        if next_update <= now {
            return Err(PkiError::InvalidValidity { field: "next_update", reason: "must be in the future".into() });
        }
        self.crl_pem_with_validity(revoked_cert_pems, now, next_update)
    }

    /// A CRL (PEM) with explicit `thisUpdate` and `nextUpdate`; tests use it for expired CRLs.
    pub fn crl_pem_with_validity(
        &self,
        revoked_cert_pems: &[&str],
        this_update: SystemTime,
        next_update: SystemTime,
    ) -> Result<String, PkiError> {
        if next_update <= this_update {
            return Err(PkiError::InvalidValidity {
                field: "next_update",
                reason: "must be later than this_update".into(),
            });
        }
        let certs: Vec<(String, String)> = revoked_cert_pems
            .iter()
            .enumerate()
            .map(|(i, pem)| (format!("revoked_cert_pems[{i}]"), (*pem).to_owned()))
            .collect();
        self.ca.crl(&certs, this_update, next_update)
    }

    /// Writes `server.pem`, `server.key` (0600) and `ca.pem` to `dir` (created 0700 if
    /// missing): what the ingest server needs.
    pub fn write_server_files(&self, dir: &Path) -> Result<ServerPaths, PkiError> {
        ensure_dir(dir)?;
        let paths = ServerPaths {
            cert: dir.join(SERVER_CERT_FILE),
            key: dir.join(SERVER_KEY_FILE),
            client_ca: dir.join(CA_CERT_FILE),
        };
        write_file(&paths.key, self.server_key_pem.as_bytes(), KEY_MODE)?;
        write_file(&paths.cert, self.server_cert_pem.as_bytes(), CERT_MODE)?;
        write_file(&paths.client_ca, self.ca_pem.as_bytes(), CERT_MODE)?;
        Ok(paths)
    }

    /// Issues a certificate for `device` and writes `device.pem`, `device.key` (0600) and
    /// `ca.pem` to `dir` (created 0700 if missing): what an agent needs.
    pub fn write_device_files(&self, device: &str, dir: &Path) -> Result<DevicePaths, PkiError> {
        let (cert_pem, key_pem) = self.issue_device(device)?;
        write_device(dir, &cert_pem, &key_pem, &self.ca_pem)
    }

    /// Writes the full [`init`] layout (`ca.pem`, `ca.key`, `server.pem`, `server.key`) to
    /// `dir`, replacing existing files; [`issue_device`] can then use `dir` as its CA.
    pub fn write_all(&self, dir: &Path) -> Result<PkiPaths, PkiError> {
        ensure_dir(dir)?;
        let paths = pki_paths(dir);
        write_file(&paths.ca_key, self.ca.key_pem.as_bytes(), KEY_MODE)?;
        write_file(&paths.ca_cert, self.ca_pem.as_bytes(), CERT_MODE)?;
        write_file(&paths.server_key, self.server_key_pem.as_bytes(), KEY_MODE)?;
        write_file(&paths.server_cert, self.server_cert_pem.as_bytes(), CERT_MODE)?;
        Ok(paths)
    }
}

/// A CA able to sign: its certificate, its key, and rcgen's issuer view of both.
struct Ca {
    cert_pem: String,
    key_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

impl Ca {
    fn generate(not_before: SystemTime, not_after: SystemTime) -> Result<Self, PkiError> {
        let key = generate_key("CA key")?;
        let mut params = CertificateParams::default();
        // A per-CA suffix (from the key identifier) keeps two CAs from sharing a name: with
        // equal names a foreign certificate looks like ours with a bad signature, and
        // operators cannot tell the CAs apart during a rollover.
        let key_id: String = params.key_identifier(&key).iter().take(4).map(|b| format!("{b:02x}")).collect();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::OrganizationName, ORGANIZATION);
        params.distinguished_name.push(DnType::CommonName, format!("{CA_COMMON_NAME} {key_id}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        set_validity(&mut params, not_before, not_after)?;
        let cert =
            params.self_signed(&key).map_err(|source| PkiError::Generate { what: "CA certificate".into(), source })?;
        Ok(Self { cert_pem: cert.pem(), key_pem: key.serialize_pem(), issuer: Issuer::new(params, key) })
    }

    /// Loads `ca.pem` and `ca.key` from `dir` and checks they belong together, that the
    /// certificate is a CA and that it is currently valid.
    fn load(dir: &Path) -> Result<Self, PkiError> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let cert_pem = read_text(&cert_path)?;
        let key_pem = read_text(&key_path)?;
        let invalid = |path: &Path, reason: String| PkiError::InvalidCa { path: path.to_owned(), reason };
        let key =
            KeyPair::from_pem(&key_pem).map_err(|e| invalid(&key_path, format!("not a usable private key: {e}")))?;

        let (_, pem) = x509_parser::pem::parse_x509_pem(cert_pem.as_bytes())
            .map_err(|e| invalid(&cert_path, format!("not a PEM certificate: {e}")))?;
        let cert = pem.parse_x509().map_err(|e| invalid(&cert_path, format!("not a valid X.509 certificate: {e}")))?;
        if !cert.is_ca() {
            return Err(invalid(&cert_path, "the certificate is not a CA (basicConstraints cA is not set)".into()));
        }
        if cert.public_key().raw != rcgen::PublicKeyData::subject_public_key_info(&key).as_slice() {
            return Err(invalid(&key_path, format!("this key does not belong to {}", cert_path.display())));
        }
        if !cert.validity().is_valid() {
            return Err(invalid(
                &cert_path,
                format!(
                    "the CA certificate is not valid now (valid from {} to {})",
                    cert.validity().not_before,
                    cert.validity().not_after
                ),
            ));
        }
        let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)
            .map_err(|e| invalid(&cert_path, format!("rcgen cannot sign with it: {e}")))?;
        Ok(Self { cert_pem, key_pem, issuer })
    }

    fn issue_server(
        &self,
        names: &[&str],
        (not_before, not_after): (SystemTime, SystemTime),
    ) -> Result<(String, String), PkiError> {
        let mut params = server_params(names, (not_before, not_after))?;
        set_validity(&mut params, not_before, not_after)?;
        self.sign(params, "server certificate".into())
    }

    fn issue_device(
        &self,
        device: &str,
        not_before: SystemTime,
        not_after: SystemTime,
    ) -> Result<(String, String), PkiError> {
        validate_device_id(device)?;
        let mut params = CertificateParams::default();
        params.distinguished_name = rcgen::DistinguishedName::new();
        params.distinguished_name.push(DnType::OrganizationName, ORGANIZATION);
        params.distinguished_name.push(DnType::CommonName, device);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        params.use_authority_key_identifier_extension = true;
        set_validity(&mut params, not_before, not_after)?;
        self.sign(params, format!("device certificate for {device:?}"))
    }

    /// Signs `params` with a fresh key; returns (certificate PEM, key PEM).
    fn sign(&self, params: CertificateParams, what: String) -> Result<(String, String), PkiError> {
        let key = generate_key(&format!("key of the {what}"))?;
        let cert = params.signed_by(&key, &self.issuer).map_err(|source| PkiError::Generate { what, source })?;
        Ok((cert.pem(), key.serialize_pem()))
    }

    /// A CRL revoking `certs` (pairs of origin description and PEM text), revoked as of
    /// `this_update`.
    fn crl(
        &self,
        certs: &[(String, String)],
        this_update: SystemTime,
        next_update: SystemTime,
    ) -> Result<String, PkiError> {
        let mut revoked = Vec::with_capacity(certs.len());
        for (origin, text) in certs {
            let serial = self.issued_serial(origin, text)?;
            revoked.push(RevokedCertParams {
                serial_number: SerialNumber::from_slice(&serial),
                revocation_time: rcgen_time!(this_update, "this_update")?,
                reason_code: None,
                invalidity_date: None,
            });
        }
        // Monotonic enough for a CRL number: successive CRLs are seconds apart at least.
        let crl_number = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        let params = CertificateRevocationListParams {
            this_update: rcgen_time!(this_update, "this_update")?,
            next_update: rcgen_time!(next_update, "next_update")?,
            crl_number: SerialNumber::from_slice(&crl_number.to_be_bytes()),
            issuing_distribution_point: None,
            revoked_certs: revoked,
            key_identifier_method: KeyIdMethod::Sha256,
        };
        let crl = params
            .signed_by(&self.issuer)
            .map_err(|source| PkiError::Generate { what: "certificate revocation list".into(), source })?;
        crl.pem().map_err(|source| PkiError::Generate {
            what: "PEM encoding of the certificate revocation list".into(),
            source,
        })
    }

    /// The serial number (big-endian bytes) of the PEM certificate `text`, after checking that
    /// this CA issued it. `origin` names the certificate in the error.
    fn issued_serial(&self, origin: &str, text: &str) -> Result<Vec<u8>, PkiError> {
        let fail = |reason: String| PkiError::InvalidRevocation { origin: origin.to_owned(), reason };
        let (_, pem) = x509_parser::pem::parse_x509_pem(text.as_bytes())
            .map_err(|e| fail(format!("not a PEM certificate: {e}")))?;
        let cert = pem.parse_x509().map_err(|e| fail(format!("not a valid X.509 certificate: {e}")))?;
        self.check_issued(&cert).map_err(fail)?;
        Ok(cert.serial.to_bytes_be())
    }

    /// Checks that this CA issued `cert`: issuer name equal to our subject and the signature
    /// verifying under our key. The error says which check failed.
    fn check_issued(&self, cert: &X509Certificate<'_>) -> Result<(), String> {
        let (_, pem) = x509_parser::pem::parse_x509_pem(self.cert_pem.as_bytes())
            .map_err(|e| format!("the CA certificate does not parse: {e}"))?;
        let ca = pem.parse_x509().map_err(|e| format!("the CA certificate does not parse: {e}"))?;
        if cert.issuer().as_raw() != ca.subject().as_raw() {
            return Err(format!(
                "it was issued by {:?}, not by this CA ({:?})",
                cert.issuer().to_string(),
                ca.subject().to_string()
            ));
        }
        cert.verify_signature(Some(ca.public_key()))
            .map_err(|e| format!("its signature does not verify with this CA's key: {e}"))
    }
}

fn set_validity(params: &mut CertificateParams, not_before: SystemTime, not_after: SystemTime) -> Result<(), PkiError> {
    params.not_before = rcgen_time!(not_before, "not_before")?;
    params.not_after = rcgen_time!(not_after, "not_after")?;
    Ok(())
}

/// Server certificate parameters (without validity); names the first bad server name.
fn server_params(
    names: &[&str],
    (not_before, not_after): (SystemTime, SystemTime),
) -> Result<CertificateParams, PkiError> {
    if names.is_empty() {
        return Err(PkiError::NoServerNames);
    }
    let mut params = CertificateParams::default();
    for name in names {
        // Accept exactly what an agent can later connect to: rustls' notion of a server name.
        let san = match ServerName::try_from(*name) {
            Ok(ServerName::IpAddress(ip)) => SanType::IpAddress(std::net::IpAddr::from(ip)),
            Ok(ServerName::DnsName(dns)) => {
                let ia5 = rcgen::string::Ia5String::try_from(dns.as_ref()).map_err(|source| {
                    PkiError::InvalidServerName { name: (*name).to_owned(), reason: source.to_string() }
                })?;
                SanType::DnsName(ia5)
            }
            Ok(_) | Err(_) => {
                return Err(PkiError::InvalidServerName {
                    name: (*name).to_owned(),
                    reason: "neither a DNS name nor an IP address".into(),
                });
            }
        };
        params.subject_alt_names.push(san);
    }
    params.distinguished_name = rcgen::DistinguishedName::new();
    params.distinguished_name.push(DnType::OrganizationName, ORGANIZATION);
    params.distinguished_name.push(DnType::CommonName, SERVER_COMMON_NAME);
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    params.use_authority_key_identifier_extension = true;
    // Check the dates convert now, so `init` fails before writing anything.
    set_validity(&mut params, not_before, not_after)?;
    Ok(params)
}

/// (now - 1 h, now + days) after checking `days` is in 1..=MAX_VALIDITY_DAYS.
fn validity_from_days(field: &'static str, days: u32) -> Result<(SystemTime, SystemTime), PkiError> {
    if days == 0 || days > MAX_VALIDITY_DAYS {
        return Err(PkiError::InvalidValidity {
            field,
            reason: format!("{days} days is outside 1..={MAX_VALIDITY_DAYS}"),
        });
    }
    let now = SystemTime::now();
    let not_before = now.checked_sub(BACKDATE).unwrap_or(now);
    let not_after = now.checked_add(DAY * days).ok_or_else(|| PkiError::InvalidValidity {
        field,
        reason: format!("{days} days from now is not representable"),
    })?;
    Ok((not_before, not_after))
}

fn generate_key(what: &str) -> Result<KeyPair, PkiError> {
    KeyPair::generate().map_err(|source| PkiError::Generate { what: what.to_owned(), source })
}

fn pki_paths(dir: &Path) -> PkiPaths {
    PkiPaths {
        ca_cert: dir.join(CA_CERT_FILE),
        ca_key: dir.join(CA_KEY_FILE),
        server_cert: dir.join(SERVER_CERT_FILE),
        server_key: dir.join(SERVER_KEY_FILE),
    }
}

fn write_device(dir: &Path, cert_pem: &str, key_pem: &str, ca_pem: &str) -> Result<DevicePaths, PkiError> {
    ensure_dir(dir)?;
    let paths = DevicePaths {
        cert: dir.join(DEVICE_CERT_FILE),
        key: dir.join(DEVICE_KEY_FILE),
        ca_cert: dir.join(CA_CERT_FILE),
    };
    write_file(&paths.key, key_pem.as_bytes(), KEY_MODE)?;
    write_file(&paths.cert, cert_pem.as_bytes(), CERT_MODE)?;
    write_file(&paths.ca_cert, ca_pem.as_bytes(), CERT_MODE)?;
    Ok(paths)
}

fn read_text(path: &Path) -> Result<String, PkiError> {
    fs::read_to_string(path).map_err(|source| PkiError::Io { action: "read", path: path.to_owned(), source })
}

/// Creates `dir` (and missing parents) with mode 0700; an existing directory is left as is.
fn ensure_dir(dir: &Path) -> Result<(), PkiError> {
    DirBuilder::new().recursive(true).mode(DIR_MODE).create(dir).map_err(|source| PkiError::Io {
        action: "create directory",
        path: dir.to_owned(),
        source,
    })
}

/// Writes `contents` to `path` atomically with `mode`: a temporary sibling created with that
/// mode (so a key is never readable by others, whatever the umask), synced, renamed over
/// `path`, and the directory synced.
fn write_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), PkiError> {
    let io_err = |action: &'static str, path: &Path| {
        let path = path.to_owned();
        move |source| PkiError::Io { action, path, source }
    };
    let file_name = path
        .file_name()
        .ok_or_else(|| PkiError::Io {
            action: "write",
            path: path.to_owned(),
            source: io::Error::new(io::ErrorKind::InvalidInput, "the path has no file name"),
        })?
        .to_string_lossy();
    let tmp = path.with_file_name(format!(".{file_name}.tmp"));
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("remove stale temporary file", &tmp)(e)),
    }
    let mut file =
        OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp).map_err(io_err("create", &tmp))?;
    // The umask may have narrowed the mode; make it exact.
    file.set_permissions(Permissions::from_mode(mode)).map_err(io_err("set permissions of", &tmp))?;
    file.write_all(contents).map_err(io_err("write", &tmp))?;
    file.sync_all().map_err(io_err("sync", &tmp))?;
    drop(file);
    fs::rename(&tmp, path).map_err(io_err("rename into place", path))?;
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        fs::File::open(parent).and_then(|d| d.sync_all()).map_err(io_err("sync directory", parent))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode_of(path: &Path) -> u32 {
        fs::metadata(path).expect("metadata").permissions().mode() & 0o777
    }

    #[test]
    fn device_ids_follow_the_documented_grammar() {
        for ok in ["a", "dev-1", "Sensor_7.site-3", &"x".repeat(64), "..."] {
            validate_device_id(ok).unwrap_or_else(|e| panic!("{ok:?} should be valid: {e}"));
        }
        for bad in ["", "has space", "slash/", "ümlaut", &"x".repeat(65), ".", "..", "a\nb"] {
            let err = validate_device_id(bad).expect_err(bad);
            match &err {
                PkiError::InvalidDeviceId { id, .. } => assert_eq!(id, bad),
                other => panic!("expected InvalidDeviceId, got {other}"),
            }
            assert!(err.to_string().contains(&format!("{bad:?}")), "{err}");
        }
    }

    #[test]
    fn init_writes_keys_0600_in_a_0700_directory_and_refuses_to_overwrite() {
        let root = tempfile::tempdir().expect("tempdir");
        let dir = root.path().join("pki");
        let paths = init(&dir, &InitOptions::default()).expect("init");
        assert_eq!(mode_of(&dir), 0o700);
        assert_eq!(mode_of(&paths.ca_key), 0o600);
        assert_eq!(mode_of(&paths.server_key), 0o600);
        assert_eq!(mode_of(&paths.ca_cert), 0o644);
        let first_ca = fs::read_to_string(&paths.ca_cert).expect("ca.pem");

        let err = init(&dir, &InitOptions::default()).expect_err("CA exists");
        assert!(matches!(&err, PkiError::CaExists { path } if path == &paths.ca_cert), "{err}");
        assert_eq!(fs::read_to_string(&paths.ca_cert).expect("ca.pem"), first_ca);

        let forced = InitOptions { force: true, ..InitOptions::default() };
        init(&dir, &forced).expect("forced init");
        assert_ne!(fs::read_to_string(&paths.ca_cert).expect("ca.pem"), first_ca);
        assert_eq!(mode_of(&paths.ca_key), 0o600);
    }

    #[test]
    fn init_rejects_a_bad_server_name_naming_it_before_writing() {
        let root = tempfile::tempdir().expect("tempdir");
        let opts = InitOptions { server_names: vec!["localhost".into(), "bad name!".into()], ..InitOptions::default() };
        let err = init(root.path(), &opts).expect_err("bad name");
        assert!(matches!(&err, PkiError::InvalidServerName { name, .. } if name == "bad name!"), "{err}");
        assert!(!root.path().join(CA_CERT_FILE).exists());
    }

    #[test]
    fn init_rejects_zero_validity() {
        let root = tempfile::tempdir().expect("tempdir");
        let opts = InitOptions { validity_days: 0, ..InitOptions::default() };
        let err = init(root.path(), &opts).expect_err("zero days");
        assert!(matches!(err, PkiError::InvalidValidity { field: "validity_days", .. }), "{err}");
    }

    #[test]
    fn issue_device_refuses_an_invalid_device_id_naming_it() {
        let root = tempfile::tempdir().expect("tempdir");
        init(root.path(), &InitOptions::default()).expect("init");
        let err = issue_device(root.path(), "bad/id", &root.path().join("dev"), 30).expect_err("invalid id");
        assert!(matches!(&err, PkiError::InvalidDeviceId { id, .. } if id == "bad/id"), "{err}");
        assert!(!root.path().join("dev").exists(), "nothing written");
    }

    #[test]
    fn issue_device_without_a_ca_names_the_missing_file() {
        let root = tempfile::tempdir().expect("tempdir");
        let err = issue_device(root.path(), "dev-1", &root.path().join("dev"), 30).expect_err("no CA");
        assert!(matches!(&err, PkiError::Io { path, .. } if path == &root.path().join(CA_CERT_FILE)), "{err}");
    }

    #[test]
    fn issue_device_with_a_mismatched_ca_key_is_refused() {
        let root = tempfile::tempdir().expect("tempdir");
        init(root.path(), &InitOptions::default()).expect("init");
        let other = InMemoryPki::generate(&["localhost"]).expect("other pki");
        fs::write(root.path().join(CA_KEY_FILE), other.ca_key_pem()).expect("swap key");
        let err = issue_device(root.path(), "dev-1", &root.path().join("dev"), 30).expect_err("mismatched key");
        assert!(matches!(&err, PkiError::InvalidCa { path, .. } if path == &root.path().join(CA_KEY_FILE)), "{err}");
    }

    #[test]
    fn crl_refuses_a_certificate_from_another_ca() {
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        let other = InMemoryPki::generate(&["localhost"]).expect("other pki");
        let (foreign, _) = other.issue_device("dev-1").expect("device");
        let err = pki.crl_pem(&[&foreign], SystemTime::now() + DAY).expect_err("foreign cert");
        assert!(
            matches!(&err, PkiError::InvalidRevocation { origin, .. } if origin == "revoked_cert_pems[0]"),
            "{err}"
        );
    }

    #[test]
    fn write_crl_revokes_device_files_issued_by_the_ca() {
        let root = tempfile::tempdir().expect("tempdir");
        init(root.path(), &InitOptions::default()).expect("init");
        let dev = issue_device(root.path(), "dev-1", &root.path().join("dev"), 30).expect("device");
        let out = root.path().join("crl.pem");
        write_crl(root.path(), std::slice::from_ref(&dev.cert), &out, 7).expect("crl");
        let text = fs::read_to_string(&out).expect("crl file");
        assert!(text.starts_with("-----BEGIN X509 CRL-----"), "{text}");
    }

    #[test]
    fn debug_output_elides_private_keys() {
        let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
        let shown = format!("{pki:?}");
        assert!(!shown.contains("PRIVATE KEY"), "{shown}");
    }
}
