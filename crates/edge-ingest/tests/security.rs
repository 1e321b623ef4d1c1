//! Security checks against a real ingest server: each test shows one property an attacker
//! cannot break.
//!
//! Everything is real, as in `rogue_client.rs`: an in-process [`Server`] on 127.0.0.1 over QUIC
//! with mutual TLS, a file store in a temporary directory judged by its export, certificates
//! from the crate's PKI helpers. Handshake refusals are checked by TLS alert on the client and
//! by the server's counters (nothing stored, no connection counted); attacks after the
//! handshake by the application close code. An honest agent keeps uploading alongside and must
//! have everything stored exactly once.
//!
//! `rogue_client.rs` already shows every malformed or oversized frame closing the connection
//! with its code; here the same attacks are repeated with declared lengths of 4 GiB to show
//! that nothing of the declared size is allocated, which it does not measure.
//!
//! No test sleeps to synchronise: waits are for events (acks, closes, counters polled with a
//! deadline), each bounded so a hang fails the test. Figures go to `edge_testkit::report`.
//!
//! The test identities, chunks, honest agent and export checks are shared with `rogue_client.rs`,
//! in `common/mod.rs`.

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use common::{
    Agent, Exported, HONEST, HONEST_SPOOL, HONEST_STREAM, ROGUE, ROGUE_SPOOL, SERVER_NAME, TestChunk,
    assert_closed_with, assert_exported_once, bounded, chunk, chunk_of, honest_chunks, localhost, new_pki, shut_down,
    start_server_with, write_unless_closed,
};
use edge_ingest::server::{RevocationWatch, Server, ServerCounters, ServerOptions};
use edge_ingest::store::{ExportReport, StoreHandle};
use edge_proto::client::ClientSession;
use edge_proto::{AckStatus, ChunkHeader, Codec, ErrorCode, Limits, StreamName, VERSION};
use edge_testkit::Tier;
use edge_transport::pki::InMemoryPki;
use edge_transport::{
    ALPN, ServerTls, Tuning, client_config_from_pem, client_endpoint, crypto_provider, quic_client_config,
    server_config, server_config_from_pem, server_endpoint, tls_alert,
};
use quinn::rustls;
use quinn::{ConnectionError, Endpoint, VarInt};
use rustls::AlertDescription;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;
use tempfile::TempDir;
use tokio::net::UdpSocket;

/// Upper bound of every wait in these tests (used by [`bounded`]).
const BOUND: Duration = Duration::from_secs(25);
const DAY: Duration = Duration::from_secs(86_400);

// === The rig: PKI, server, store, client endpoint ===

struct Rig {
    pki: Arc<InMemoryPki>,
    server: Server,
    /// A handle on the server's endpoint, to see its open connections.
    server_endpoint: Endpoint,
    store: StoreHandle,
    data: TempDir,
    client: Endpoint,
}

/// Options with the defaults and short shutdown.
fn options() -> ServerOptions {
    ServerOptions { shutdown_grace: Duration::from_secs(2), ..ServerOptions::default() }
}

impl Rig {
    /// A server trusting `pki`'s CA, without CRLs.
    async fn start(opts: ServerOptions) -> Rig {
        let pki = new_pki();
        let config = server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, &Tuning::default())
            .expect("server config");
        Rig::start_with(pki, config, opts).await
    }

    async fn start_with(pki: InMemoryPki, config: quinn::ServerConfig, opts: ServerOptions) -> Rig {
        let tuning = Tuning::default();
        let endpoint = server_endpoint(localhost(), config, &tuning).expect("server endpoint");
        let (server, store, data) = start_server_with(endpoint.clone(), opts, |_| {});
        let client = client_endpoint(localhost(), &tuning).expect("client endpoint");
        Rig { pki: Arc::new(pki), server, server_endpoint: endpoint, store, data, client }
    }

    fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// A client config for a new certificate of `device`.
    fn device(&self, device: &str) -> quinn::ClientConfig {
        let (cert, key) = self.pki.issue_device(device).expect("issue device certificate");
        client_config_from_pem(&cert, &key, &self.pki.ca_pem, &Tuning::default()).expect("client config")
    }

    /// Starts a handshake with `config`, expecting the server under `server_name`.
    async fn dial(
        &self,
        config: &quinn::ClientConfig,
        server_name: &str,
    ) -> Result<quinn::Connection, ConnectionError> {
        let connecting = self.client.connect_with(config.clone(), self.addr(), server_name).expect("start connecting");
        bounded("handshake", connecting).await
    }

    /// Connects `device` (a new certificate) and completes Hello/Welcome.
    async fn agent(&self, device: &str, spool: [u8; 16]) -> Agent {
        let config = self.device(device);
        bounded("agent connects", async {
            let conn = self.dial(&config, SERVER_NAME).await.expect("mutual TLS handshake succeeds");
            Agent::connect(&conn, spool, "security-test").await
        })
        .await
    }

    fn counters(&self) -> Arc<ServerCounters> {
        self.server.counters()
    }

    /// Shuts the server and the store down and returns everything the store exports.
    async fn finish(self) -> (Vec<Exported>, ExportReport) {
        self.client.close(VarInt::from_u32(0), b"test over");
        shut_down(self.server, self.store, self.data.path()).await
    }
}

/// Polls `cond` until it holds; fails the test after [`BOUND`].
async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    bounded(what, async {
        while !cond() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
}

fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// Resident set size of this process (server and clients alike), in bytes.
fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .expect("VmRSS in /proc/self/status");
    kib * 1024
}

// === Handshake refusals (1-4, 7) ===

/// How a refused handshake ended on the client: the handshake error, or, when the TLS 1.3
/// client finished before the server checked its certificate, the close that followed.
async fn client_ending(result: Result<quinn::Connection, ConnectionError>) -> ConnectionError {
    match result {
        Ok(conn) => bounded("server closes the refused connection", conn.closed()).await,
        Err(e) => e,
    }
}

/// The server refused the handshake with `alert`, counted it, and served no connection for it;
/// an honest agent stores before and after, and the refused device stored nothing.
/// `config` builds the attacker's client config from the rig's PKI.
async fn assert_refused_at_handshake(
    config: impl FnOnce(&InMemoryPki) -> quinn::ClientConfig,
    refused_device: &str,
    alert: AlertDescription,
) {
    let rig = Rig::start(options()).await;
    let mut honest = rig.agent(HONEST, HONEST_SPOOL).await;
    honest.upload_stored("before", &honest_chunks(0..2)).await;

    let config = config(&rig.pki);
    let err = client_ending(rig.dial(&config, SERVER_NAME).await).await;
    assert!(matches!(err, ConnectionError::ConnectionClosed(_)), "the server closed the handshake: {err:?}");
    assert_eq!(tls_alert(&err), Some(alert), "{err}");
    let counters = rig.counters();
    wait_until("the refusal is counted", || load(&counters.auth_failures_total) == 1).await;
    assert_eq!(load(&counters.connections_total), 1, "only the honest connection was served");
    assert!(
        counters.devices.snapshot().iter().all(|d| d.device != refused_device),
        "the refused device never shows as connected"
    );

    honest.upload_stored("after", &honest_chunks(2..4)).await;
    honest.close();
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_chunks(0..4));
    assert_exported_once(&exported, refused_device, ROGUE_SPOOL, &[]);
}

fn device_config(pki: &InMemoryPki, cert: &str, key: &str) -> quinn::ClientConfig {
    client_config_from_pem(cert, key, &pki.ca_pem, &Tuning::default()).expect("client config")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_without_a_certificate_is_refused_at_the_handshake() {
    let anonymous = |pki: &InMemoryPki| {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(pki.ca_pem.as_bytes()).expect("CA PEM")).expect("CA root");
        let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        quic_client_config(tls, &Tuning::default()).expect("anonymous client config")
    };
    assert_refused_at_handshake(anonymous, ROGUE, AlertDescription::CertificateRequired).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_from_an_unknown_ca_is_refused_at_the_handshake_even_naming_a_known_device() {
    // The stranger's certificate names the honest device: the CN means nothing without the CA.
    let stranger = |pki: &InMemoryPki| {
        let other = new_pki();
        let (cert, key) = other.issue_device(HONEST).expect("foreign device");
        device_config(pki, &cert, &key)
    };
    assert_refused_at_handshake(stranger, "none", AlertDescription::UnknownCA).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_device_certificate_is_refused_at_the_handshake() {
    let expired = |pki: &InMemoryPki| {
        let now = SystemTime::now();
        let (cert, key) = pki.issue_device_with_validity(ROGUE, now - 10 * DAY, now - DAY).expect("expired device");
        device_config(pki, &cert, &key)
    };
    assert_refused_at_handshake(expired, ROGUE, AlertDescription::CertificateExpired).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_not_yet_valid_device_certificate_is_refused_at_the_handshake() {
    let future = |pki: &InMemoryPki| {
        let now = SystemTime::now();
        let (cert, key) = pki.issue_device_with_validity(ROGUE, now + DAY, now + 10 * DAY).expect("future device");
        device_config(pki, &cert, &key)
    };
    assert_refused_at_handshake(future, ROGUE, AlertDescription::CertificateExpired).await;
}

/// A resumed TLS 1.3 handshake asks for no client certificate: the session carries the one of
/// its first handshake. A device whose certificate expired since must not get in by resuming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_resumed_after_the_device_certificate_expired_is_closed() {
    let rig = Rig::start(options()).await;
    let now = SystemTime::now();
    let expiry = now + Duration::from_secs(3);
    let (cert, key) = rig.pki.issue_device_with_validity(ROGUE, now - DAY, expiry).expect("short-lived device");
    let config = device_config(&rig.pki, &cert, &key);
    let conn = rig.dial(&config, SERVER_NAME).await.expect("valid for now");
    let mut rogue = bounded("hello", Agent::connect(&conn, ROGUE_SPOOL, "security-test")).await;
    let stored = [chunk_of("s", 0, "valid", 2, 0)];
    rogue.upload_stored("while the certificate is valid", &stored).await;
    rogue.close();
    // The certificate's end is a time on the clock, not an event: wait past it (X.509 times
    // have whole seconds).
    let left = expiry.duration_since(SystemTime::now()).unwrap_or_default();
    tokio::time::sleep(left + Duration::from_millis(1100)).await;

    let resumed = rig.dial(&config, SERVER_NAME).await.expect("a resumed handshake, which needs no certificate");
    let err = bounded("the server closes the resumed connection", resumed.closed()).await;
    assert_closed_with("the resumed connection", &err, ErrorCode::Unauthorized);
    let counters = rig.counters();
    wait_until("the refusal is counted", || load(&counters.auth_failures_total) == 1).await;
    assert_eq!(load(&counters.connections_total), 1, "only the connection made while valid was served");
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &stored);
}

/// TLS checks a certificate at the handshake only; a connection that lives on past it is closed
/// by the server's sweep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_outlives_its_device_certificate_is_closed() {
    let rig = Rig::start(ServerOptions { certificate_sweep: Duration::from_millis(100), ..options() }).await;
    let now = SystemTime::now();
    let expiry = now + Duration::from_secs(2);
    let (cert, key) = rig.pki.issue_device_with_validity(ROGUE, now - DAY, expiry).expect("short-lived device");
    let conn = rig.dial(&device_config(&rig.pki, &cert, &key), SERVER_NAME).await.expect("valid for now");
    let mut rogue = bounded("hello", Agent::connect(&conn, ROGUE_SPOOL, "security-test")).await;
    let stored = [chunk_of("s", 0, "valid", 2, 0)];
    rogue.upload_stored("while the certificate is valid", &stored).await;

    let err = bounded("the server closes the connection", conn.closed()).await;
    // X.509 times have whole seconds: the certificate ends at most a second before `expiry`.
    assert!(SystemTime::now() + Duration::from_secs(1) >= expiry, "closed before the certificate expired");
    assert_closed_with("the connection past its certificate", &err, ErrorCode::Unauthorized);
    assert_eq!(load(&rig.counters().auth_failures_total), 1);
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &stored);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agent_refuses_a_server_whose_certificate_lacks_the_expected_name() {
    let rig = Rig::start(options()).await;
    let config = rig.device(HONEST);
    let err = client_ending(rig.dial(&config, "ingest.example.com").await).await;
    match &err {
        ConnectionError::TransportError(e) => {
            assert_eq!(tls_alert(&err), Some(AlertDescription::BadCertificate), "{err}");
            assert!(e.reason.contains("not valid for name"), "{err}");
        }
        other => panic!("expected the client to refuse the server locally, got {other:?}"),
    }
    // The server saw the client's alert: a failed handshake, no connection, nothing stored.
    let counters = rig.counters();
    wait_until("the failed handshake is counted", || load(&counters.auth_failures_total) == 1).await;
    assert_eq!(load(&counters.connections_total), 0);
    let (exported, _) = rig.finish().await;
    assert!(exported.is_empty());
}

// === Identity claims (6) ===

/// What the protocol lets a client claim: in Hello, a spool id and a free-form agent string;
/// in a chunk header, a stream and a sequence number. None of it is an identity: the server
/// names the device from the certificate (Welcome says so) and keys storage and dedup by
/// (certificate device, spool, stream, seq), so a device cannot write into, or shadow, another
/// device's data even when it reuses that device's spool id and chunk keys.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_claiming_another_identity_is_stored_under_its_certificate_identity_only() {
    let rig = Rig::start(options()).await;
    let mut honest = rig.agent(HONEST, HONEST_SPOOL).await;
    assert_eq!(honest.device, HONEST);
    let honest_first = honest_chunks(0..2);
    honest.upload_stored("honest upload", &honest_first).await;

    // The rogue claims the honest spool id and names itself after the honest device.
    let rogue_conn = rig.dial(&rig.device(ROGUE), SERVER_NAME).await.expect("the rogue's certificate is valid");
    let mut rogue = bounded("rogue hello", Agent::connect(&rogue_conn, HONEST_SPOOL, HONEST)).await;
    assert_eq!(rogue.device, ROGUE, "Welcome names the certificate identity, not the claim");
    let devices: Vec<String> = rig.counters().devices.snapshot().into_iter().map(|d| d.device).collect();
    assert_eq!(devices, [HONEST, ROGUE], "each connection is listed under its certificate");

    // Forged chunks under the honest device's keys: two it already stored, two it will send.
    let forged: Vec<TestChunk> = (0..4).map(|seq| chunk_of(HONEST_STREAM, seq, "forged", 3, 0)).collect();
    let statuses = bounded("forged chunks are acked", rogue.upload(&forged)).await;
    assert_eq!(statuses, [AckStatus::Stored; 4], "stored as the rogue's own data, never as a duplicate of another's");

    // The honest device's next chunks were not pre-empted by the forged copies of their keys.
    let honest_next = honest_chunks(2..4);
    honest.upload_stored("honest upload after the forgery", &honest_next).await;
    let counters = rig.counters();
    assert_eq!(load(&counters.chunks_duplicate_total), 0);
    rogue.close();
    honest.close();

    let (exported, report) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &[honest_first, honest_next].concat());
    assert_exported_once(&exported, ROGUE, HONEST_SPOOL, &forged);
    assert_eq!(report.duplicate_entries, 0);
}

// === Revocation (5) ===

/// Captured log output of this test process (the server logs through `tracing`).
fn logs() -> &'static Mutex<Vec<u8>> {
    static LOGS: OnceLock<Mutex<Vec<u8>>> = OnceLock::new();
    LOGS.get_or_init(|| Mutex::new(Vec::new()))
}

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        logs().lock().unwrap_or_else(std::sync::PoisonError::into_inner).extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture_logs() {
    let _already = tracing_subscriber::fmt()
        .with_writer(|| LogWriter)
        .with_ansi(false)
        .with_max_level(tracing_subscriber::filter::LevelFilter::INFO)
        .try_init();
}

/// The first captured log line containing every one of `needles`.
fn log_line(needles: &[&str]) -> Option<String> {
    let text = String::from_utf8_lossy(&logs().lock().unwrap_or_else(std::sync::PoisonError::into_inner)).into_owned();
    text.lines().find(|l| needles.iter().all(|n| l.contains(n))).map(str::to_owned)
}

const VICTIM: &str = "victim-1";
const VICTIM_SPOOL: [u8; 16] = [0x77; 16];

/// A server whose TLS files live in a directory, with a CRL file it watches.
struct RevocationRig {
    rig: Rig,
    _tls_dir: TempDir,
    crl: std::path::PathBuf,
    victim_cert: String,
    victim: quinn::ClientConfig,
}

impl RevocationRig {
    /// `revoked_at_start`: whether the first CRL already revokes the victim.
    async fn start(revoked_at_start: bool, interval: Duration, on_sighup: bool) -> RevocationRig {
        capture_logs();
        let pki = new_pki();
        let tls_dir = tempfile::tempdir().expect("temp dir");
        let files = pki.write_server_files(tls_dir.path()).expect("server files");
        let (victim_cert, victim_key) = pki.issue_device(VICTIM).expect("victim certificate");
        let crl = tls_dir.path().join("devices.crl.pem");
        let revoked: &[&str] = if revoked_at_start { &[&victim_cert] } else { &[] };
        std::fs::write(&crl, pki.crl_pem(revoked, SystemTime::now() + 7 * DAY).expect("CRL")).expect("write CRL");
        let tls = ServerTls { crls: vec![crl.clone()], ..files.server_tls() };
        let tuning = Tuning::default();
        let config = server_config(&tls, &tuning).expect("server config from files");
        let opts = ServerOptions {
            revocation: Some(RevocationWatch { tls, tuning, allow_migration: true, interval, on_sighup }),
            ..options()
        };
        let victim = device_config(&pki, &victim_cert, &victim_key);
        let rig = Rig::start_with(pki, config, opts).await;
        RevocationRig { rig, _tls_dir: tls_dir, crl, victim_cert, victim }
    }

    /// Replaces the CRL file atomically (write, then rename), as an operator's tool would.
    fn publish(&self, revoked: &[&str]) {
        let pem = self.rig.pki.crl_pem(revoked, SystemTime::now() + 7 * DAY).expect("CRL");
        let tmp = self.crl.with_extension("tmp");
        std::fs::write(&tmp, pem).expect("write the new CRL");
        std::fs::rename(&tmp, &self.crl).expect("install the new CRL");
    }

    async fn victim_agent(&self) -> Agent {
        let conn = self.rig.dial(&self.victim, SERVER_NAME).await.expect("the victim is not revoked yet");
        bounded("victim hello", Agent::connect(&conn, VICTIM_SPOOL, "victim")).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_device_is_refused_at_the_handshake() {
    let rr = RevocationRig::start(true, RevocationWatch::DEFAULT_INTERVAL, false).await;
    let err = client_ending(rr.rig.dial(&rr.victim, SERVER_NAME).await).await;
    assert_eq!(tls_alert(&err), Some(AlertDescription::CertificateRevoked), "{err}");
    let counters = rr.rig.counters();
    wait_until("the refusal is counted", || load(&counters.auth_failures_total) == 1).await;
    let mut honest = rr.rig.agent(HONEST, HONEST_SPOOL).await;
    honest.upload_stored("honest upload", &honest_chunks(0..2)).await;
    honest.close();
    assert_eq!(load(&counters.connections_total), 1, "only the honest device got a connection");
    let (exported, _) = rr.rig.finish().await;
    assert_exported_once(&exported, VICTIM, VICTIM_SPOOL, &[]);
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_chunks(0..2));
}

/// The revocation arrives while the device is connected: once the CRL file changes, the server
/// closes that connection with `Revoked` and logs the device; a bad CRL file before it is
/// refused and changes nothing; the device cannot come back; others are unaffected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_device_revoked_while_connected_is_closed_with_the_revoked_code_and_a_bad_crl_is_refused() {
    let rr = RevocationRig::start(false, Duration::from_millis(50), false).await;
    let counters = rr.rig.counters();
    let mut honest = rr.rig.agent(HONEST, HONEST_SPOOL).await;
    let mut victim = rr.victim_agent().await;
    let victim_chunks: Vec<TestChunk> = (0..4).map(|seq| chunk("victim.data", seq)).collect();
    victim.upload_stored("victim before", &victim_chunks[..2]).await;

    // A half-written CRL file (as a non-atomic copy leaves it) is refused; the old list stays.
    let good = rr.rig.pki.crl_pem(&[&rr.victim_cert], SystemTime::now() + 7 * DAY).expect("CRL");
    std::fs::write(&rr.crl, &good[..good.len() / 2]).expect("write half a CRL");
    wait_until("the bad CRL is refused", || load(&counters.crl_reload_failures_total) == 1).await;
    assert!(log_line(&["revocation lists not reloaded"]).is_some(), "the refusal is logged");
    victim.upload_stored("victim after the bad CRL", &victim_chunks[2..]).await;
    assert_eq!(load(&counters.crl_reloads_total), 0);

    // The real revocation: the victim's live connection is closed, the honest one is not.
    let started = Instant::now();
    rr.publish(&[&rr.victim_cert]);
    let closed = bounded("the revoked connection is closed", victim.conn.closed()).await;
    let close_latency = started.elapsed();
    assert_closed_with("revoked while connected", &closed, ErrorCode::Revoked);
    if let ConnectionError::ApplicationClosed(close) = &closed {
        assert!(String::from_utf8_lossy(&close.reason).contains(VICTIM), "the reason names the device");
    }
    let line = log_line(&["device certificate revoked", VICTIM]).expect("a log line names the revoked device");
    assert!(line.contains("WARN"), "{line}");
    assert_eq!((load(&counters.crl_reloads_total), load(&counters.revoked_closed_total)), (1, 1));
    honest.upload_stored("honest after the revocation", &honest_chunks(0..3)).await;

    // The new CRL is in the TLS config too: the victim is refused at its next handshake.
    let err = client_ending(rr.rig.dial(&rr.victim, SERVER_NAME).await).await;
    assert_eq!(tls_alert(&err), Some(AlertDescription::CertificateRevoked), "{err}");
    honest.close();
    edge_testkit::report(
        "security_revoked_while_connected",
        &serde_json::json!({"close_after_crl_write_ms": close_latency.as_millis(), "check_interval_ms": 50}),
    )
    .expect("report");
    let (exported, _) = rr.rig.finish().await;
    assert_exported_once(&exported, VICTIM, VICTIM_SPOOL, &victim_chunks);
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_chunks(0..3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_applies_a_new_revocation_at_once() {
    // The periodic check is an hour away: only the signal can trigger the reload.
    let rr = RevocationRig::start(false, Duration::from_secs(3600), true).await;
    let victim = rr.victim_agent().await;
    rr.publish(&[&rr.victim_cert]);
    let status =
        std::process::Command::new("kill").args(["-HUP", &std::process::id().to_string()]).status().expect("run kill");
    assert!(status.success());
    let closed = bounded("the revoked connection is closed", victim.conn.closed()).await;
    assert_closed_with("revoked on SIGHUP", &closed, ErrorCode::Revoked);
    assert_eq!(load(&rr.rig.counters().crl_reloads_total), 1);
    rr.rig.finish().await;
}

// === Declared lengths are never allocated (8) ===

/// Opens a connection with `config`, completes Hello (unless the attack is on the control
/// stream), writes `bytes` and returns how the server closed the connection. Streams stay open.
async fn declare(
    client: Endpoint,
    server: SocketAddr,
    config: quinn::ClientConfig,
    on_control: bool,
    bytes: Vec<u8>,
) -> ConnectionError {
    let conn = client.connect_with(config, server, SERVER_NAME).expect("connect").await.expect("handshake");
    let (mut send, _recv, _agent) = if on_control {
        let (send, recv) = conn.open_bi().await.expect("control stream");
        (send, Some(recv), None)
    } else {
        // A spool per declaration: they run at once, and a Hello closes the device's earlier
        // connections from the same spool.
        static NEXT: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);
        let mut spool = ROGUE_SPOOL;
        spool[0] = NEXT.fetch_add(1, Ordering::Relaxed);
        let agent = Agent::connect(&conn, spool, "rogue").await;
        (conn.open_uni().await.expect("chunk stream"), None, Some(agent))
    };
    write_unless_closed(&mut send, &bytes).await;
    conn.closed().await
}

/// Headers declaring 4 GiB (control frame body, chunk payload, chunk raw length) are refused
/// from the length field alone, with `FrameTooLarge`, before any of it is allocated: the
/// process's resident memory grows by far less than one such declaration, though dozens are
/// made at once. A zstd bomb (256 MiB of zeros in a few KiB, declared as 1 MiB raw) is
/// rejected with its decompression bounded by the declared raw length.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declared_four_gib_lengths_are_refused_without_allocating_them() {
    let rig = Rig::start(options()).await;
    let mut honest = rig.agent(HONEST, HONEST_SPOOL).await;
    honest.upload_stored("warm-up", &honest_chunks(0..4)).await;
    let rogue = rig.device(ROGUE);
    // Built before the baseline so its own buffers do not count.
    let bomb = {
        let zeros = std::io::Read::take(std::io::repeat(0), 256 << 20);
        let payload = zstd::stream::encode_all(zeros, 3).expect("compress the bomb");
        let raw_len = 1 << 20;
        let header = ChunkHeader {
            stream: StreamName::new("rogue.bomb").expect("name"),
            seq: 0,
            records: 1,
            raw_len,
            payload_len: u32::try_from(payload.len()).expect("a few KiB"),
            codec: Codec::Zstd,
            checksum: edge_proto::crc32c(&payload),
            created_ms: 0,
        };
        TestChunk { header, payload, records: Vec::new() }
    };
    let rss_before = rss_bytes();

    let four_gib = u32::MAX;
    let mut control = vec![0x01];
    control.extend_from_slice(&four_gib.to_le_bytes());
    control.extend_from_slice(&VERSION.to_le_bytes());
    control.extend_from_slice(&[0xab; 64]);
    let header = |payload_len: u32, raw_len: u32, codec: Codec| {
        let h = ChunkHeader { payload_len, raw_len, codec, ..chunk("rogue.big", 0).header };
        let mut bytes = Vec::new();
        h.encode(&mut bytes);
        bytes.extend_from_slice(&[0u8; 4096]);
        bytes
    };
    let attacks: Vec<(&'static str, bool, Vec<u8>)> = vec![
        ("control frame of 4 GiB", true, control),
        ("chunk payload of 4 GiB", false, header(four_gib, four_gib, Codec::None)),
        ("zstd chunk of 4 GiB raw", false, header(4096, four_gib, Codec::Zstd)),
    ];
    const REPEAT: usize = 12;
    let mut storm = tokio::task::JoinSet::new();
    for (what, on_control, bytes) in &attacks {
        for _ in 0..REPEAT {
            let fut = declare(rig.client.clone(), rig.addr(), rogue.clone(), *on_control, bytes.clone());
            let what = *what;
            storm.spawn(async move { (what, fut.await) });
        }
    }
    let mut seq = 4;
    let mut closes = Vec::new();
    while closes.len() < attacks.len() * REPEAT {
        let batch = honest_chunks(seq..seq + 1);
        seq += 1;
        let (joined, ()) = tokio::join!(
            bounded("an attack ends", storm.join_next()),
            honest.upload_stored("upload during the attacks", &batch)
        );
        closes.push(joined.expect("an attack is pending").expect("the attack task does not panic"));
    }
    for (what, closed) in &closes {
        assert_closed_with(what, closed, ErrorCode::FrameTooLarge);
    }

    let bomb_conn = rig.dial(&rogue, SERVER_NAME).await.expect("handshake");
    let mut bomber = bounded("bomber hello", Agent::connect(&bomb_conn, ROGUE_SPOOL, "rogue")).await;
    let statuses = bounded("the bomb is answered", bomber.upload(std::slice::from_ref(&bomb))).await;
    assert!(matches!(statuses[..], [AckStatus::Rejected(_)]), "the bomb is rejected: {statuses:?}");
    let rss_after = rss_bytes();
    let growth = rss_after.saturating_sub(rss_before);
    let declared: u64 = (attacks.len() * REPEAT) as u64 * u64::from(four_gib) + (256 << 20);
    edge_testkit::report(
        "security_declared_lengths",
        &serde_json::json!({
            "attacks": attacks.len() * REPEAT + 1,
            "declared_bytes": declared,
            "rss_before_bytes": rss_before,
            "rss_after_bytes": rss_after,
            "rss_growth_bytes": growth,
        }),
    )
    .expect("report");
    // One 4 GiB allocation would be thousands of MiB; the allowance covers the connections'
    // own buffers and allocator noise.
    assert!(growth < 64 << 20, "resident memory grew by {} MiB", growth >> 20);
    let counters = rig.counters();
    assert_eq!(load(&counters.protocol_errors_total), (attacks.len() * REPEAT) as u64);
    assert_eq!(load(&counters.chunks_rejected_total), 1, "the bomb");
    bomber.close();
    honest.close();
    let (exported, _) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_chunks(0..seq));
    assert_exported_once(&exported, ROGUE, ROGUE_SPOOL, &[]);
}

// === A UDP relay that records a client's first flight ===

/// Long-header packet types in a datagram (QUIC v1: 0 Initial, 1 0-RTT, 2 Handshake, 3 Retry),
/// walking coalesced packets; stops at a short-header packet or anything it cannot parse.
fn long_header_types(datagram: &[u8]) -> Vec<u8> {
    fn varint(b: &[u8]) -> Option<(usize, usize)> {
        let first = *b.first()?;
        let len = 1usize << (first >> 6);
        let mut v = u64::from(first & 0x3f);
        for byte in b.get(1..len)? {
            v = (v << 8) | u64::from(*byte);
        }
        Some((usize::try_from(v).ok()?, len))
    }
    let mut types = Vec::new();
    let mut rest = datagram;
    while let Some(&first) = rest.first() {
        if first & 0x80 == 0 {
            break;
        }
        let ty = (first >> 4) & 0x03;
        types.push(ty);
        let parsed = (|| {
            let mut i = 5; // flags + version
            i += 1 + usize::from(*rest.get(i)?); // DCID
            i += 1 + usize::from(*rest.get(i)?); // SCID
            if ty == 0 {
                let (token, n) = varint(rest.get(i..)?)?;
                i += n + token;
            }
            let (len, n) = varint(rest.get(i..)?)?;
            rest.get(i + n + len..)
        })();
        match (ty, parsed) {
            (3, _) | (_, None) => break,
            (_, Some(next)) => rest = next,
        }
    }
    types
}

/// What the relay saw from the client.
#[derive(Default)]
struct Flight {
    /// Client datagrams sent before the relay let the server's answer through.
    datagrams: Vec<Vec<u8>>,
    /// Bytes of 0-RTT packets among them.
    zero_rtt_bytes: usize,
}

/// A relay between clients and the server on loopback. Client datagrams are forwarded at once
/// and, until [`Relay::release`], recorded. Server datagrams are held until released (so the
/// client's first flight is all it can send before the server answers), or dropped for good
/// in blackhole mode (clients that never complete a handshake).
struct Relay {
    front: SocketAddr,
    flight: Arc<Mutex<Flight>>,
    release: Arc<tokio::sync::Notify>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    async fn start(server: SocketAddr, blackhole: bool) -> Relay {
        let front = UdpSocket::bind(localhost()).await.expect("relay front");
        let back = UdpSocket::bind(localhost()).await.expect("relay back");
        let front_addr = front.local_addr().expect("relay address");
        let flight = Arc::new(Mutex::new(Flight::default()));
        let released = Arc::new(AtomicBool::new(false));
        let release = Arc::new(tokio::sync::Notify::new());
        let (f, r, n) = (flight.clone(), released.clone(), release.clone());
        let task = tokio::spawn(async move {
            let mut client: Option<SocketAddr> = None;
            let mut held: Vec<Vec<u8>> = Vec::new();
            let (mut up, mut down) = (vec![0u8; 65_536], vec![0u8; 65_536]);
            loop {
                tokio::select! {
                    got = front.recv_from(&mut up) => {
                        let Ok((len, from)) = got else { break };
                        client = Some(from);
                        let d = &up[..len];
                        if !r.load(Ordering::SeqCst) {
                            let mut fl = f.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                            if long_header_types(d).contains(&1) {
                                fl.zero_rtt_bytes += len;
                            }
                            fl.datagrams.push(d.to_vec());
                        }
                        let _lost = back.send_to(d, server).await;
                    }
                    got = back.recv_from(&mut down) => {
                        let Ok((len, _)) = got else { break };
                        if blackhole {
                            continue;
                        }
                        if r.load(Ordering::SeqCst) {
                            if let Some(c) = client {
                                let _lost = front.send_to(&down[..len], c).await;
                            }
                        } else {
                            held.push(down[..len].to_vec());
                        }
                    }
                    () = n.notified(), if !r.load(Ordering::SeqCst) => {
                        r.store(true, Ordering::SeqCst);
                        if let Some(c) = client {
                            for d in held.drain(..) {
                                let _lost = front.send_to(&d, c).await;
                            }
                        }
                    }
                }
            }
        });
        Relay { front: front_addr, flight, release, task }
    }

    /// Lets the server's datagrams through from now on (the held ones first).
    fn release(&self) {
        self.release.notify_one();
    }

    fn flight(&self) -> std::sync::MutexGuard<'_, Flight> {
        self.flight.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

// === 0-RTT replay (11) ===

/// An agent resumes its session and sends Hello and a chunk as 0-RTT data; the relay records
/// that first flight, which is then replayed 100 times from new source ports, after the
/// original connection is gone (and a few times while it is live). The chunk is stored once:
/// a replay cannot finish the handshake (the ticket is single-use and the attacker lacks the
/// keys), and the server acts on no stream data before the handshake completes. Each replay
/// costs one pending handshake, freed by the TLS handshake timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replayed_0rtt_first_flight_stores_nothing_twice() {
    const REPLAYS: usize = 100;
    let opts = ServerOptions { tls_handshake_timeout: Duration::from_secs(2), ..options() };
    let rig = Rig::start(opts).await;
    let config = rig.device(HONEST);
    let counters = rig.counters();

    // 1. A full handshake, so the client config holds a resumption ticket.
    let first = rig.dial(&config, SERVER_NAME).await.expect("first handshake");
    let agent = bounded("first hello", Agent::connect(&first, HONEST_SPOOL, "replay-test")).await;
    agent.close();
    wait_until("the first connection is gone", || rig.server_endpoint.open_connections() == 0).await;

    // 2. Resume through the relay with Hello and a chunk in 0-RTT; the relay holds the
    //    server's answer until the whole chunk went out as 0-RTT packets.
    let relay = Relay::start(rig.addr(), false).await;
    let early = chunk_of("replay.data", 0, "early", 8, 512);
    let connecting = rig.client.connect_with(config.clone(), relay.front, SERVER_NAME).expect("connect");
    let (conn, accepted) = connecting.into_0rtt().unwrap_or_else(|_| panic!("the ticket allows 0-RTT"));
    let (mut send, recv) = conn.open_bi().await.expect("control stream in 0-RTT");
    let mut session = ClientSession::new(HONEST_SPOOL, "replay-test".into(), Limits::default(), Instant::now());
    while let Some(bytes) = session.poll_transmit() {
        send.write_all(&bytes).await.expect("Hello in 0-RTT");
    }
    let mut uni = conn.open_uni().await.expect("chunk stream in 0-RTT");
    uni.write_all(&early.wire()).await.expect("chunk in 0-RTT");
    uni.finish().expect("finish");
    let wire_len = early.wire().len();
    wait_until("the chunk left as 0-RTT", || relay.flight().zero_rtt_bytes > wire_len).await;
    relay.release();
    assert!(bounded("0-RTT verdict", accepted).await, "the server accepted the 0-RTT data");
    let mut agent = Agent { conn: conn.clone(), send, recv, session, device: String::new(), acks: HashMap::new() };
    bounded("welcome", async {
        while !agent.session.is_connected() {
            agent.read_control().await;
        }
    })
    .await;
    agent.session.chunk_sent(&early.header.stream, early.header.seq).expect("window");
    let ack = bounded("ack of the 0-RTT chunk", async {
        loop {
            if let Some(status) = agent.acks.remove(&early.key()) {
                break status;
            }
            agent.read_control().await;
        }
    })
    .await;
    assert_eq!(ack, AckStatus::Stored);
    let flight: Vec<Vec<u8>> = relay.flight().datagrams.clone();
    let zero_rtt_datagrams = flight.iter().filter(|d| long_header_types(d).contains(&1)).count();

    // 3. Replays: a few while the original connection lives, then REPLAYS after it is gone.
    let replay = |n: usize| {
        let flight = flight.clone();
        let server = rig.addr();
        async move {
            let mut answered = 0;
            let mut sockets = Vec::new();
            for _ in 0..n {
                let socket = UdpSocket::bind(localhost()).await.expect("replay socket");
                for d in &flight {
                    socket.send_to(d, server).await.expect("replay");
                }
                sockets.push(socket);
            }
            // A replay that starts a handshake gets the server's answer on its socket. quinn
            // routes Initials by their destination connection id, so replays that arrive while
            // an earlier copy's handshake is pending join it (from another address, ignored).
            let deadline = tokio::time::Instant::now() + Duration::from_secs(1);
            for socket in &sockets {
                let mut buf = [0u8; 2048];
                if tokio::time::timeout_at(deadline, socket.recv_from(&mut buf)).await.is_ok() {
                    answered += 1;
                }
            }
            answered
        }
    };
    let answered_live = replay(10).await;
    agent.close();
    wait_until("the 0-RTT connection is gone", || rig.server_endpoint.open_connections() == 0).await;
    let failures_before = load(&counters.auth_failures_total);
    let answered = replay(REPLAYS).await;
    assert!(answered >= 1, "the replayed flight reached the server's handshake");
    wait_until("every replayed handshake is abandoned", || {
        load(&counters.auth_failures_total) >= failures_before + answered as u64
            && load(&counters.handshakes_pending) == 0
    })
    .await;

    // 4. Healthy: a new connection uploads; the 0-RTT chunk exists exactly once.
    let mut honest = rig.agent(HONEST, HONEST_SPOOL).await;
    honest.upload_stored("after the replays", &honest_chunks(0..2)).await;
    let stored = load(&counters.chunks_stored_total);
    let duplicates = load(&counters.chunks_duplicate_total);
    edge_testkit::report(
        "security_0rtt_replay",
        &serde_json::json!({
            "first_flight_datagrams": flight.len(),
            "zero_rtt_datagrams": zero_rtt_datagrams,
            "replays_while_live": 10,
            "replays_while_live_answered": answered_live,
            "replays_after_close": REPLAYS,
            "replays_after_close_answered": answered,
            "chunks_stored": stored,
            "duplicates_acked": duplicates,
            "connections_total": load(&counters.connections_total),
        }),
    )
    .expect("report");
    assert_eq!(duplicates, 0, "no replayed chunk reached the store");
    assert_eq!(stored, 3, "the 0-RTT chunk once, and two honest chunks");
    assert_eq!(load(&counters.connections_total), 3, "no replay became a connection");
    honest.close();
    let (exported, report) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &[vec![early], honest_chunks(0..2)].concat());
    assert_eq!(report.duplicate_entries, 0);
}

// === Handshake flood (10) ===

/// Whether the server refused the connection attempt (`Incoming::refuse`).
fn is_refused(e: &ConnectionError) -> bool {
    matches!(e, ConnectionError::ConnectionClosed(c) if c.error_code == quinn::TransportErrorCode::CONNECTION_REFUSED)
}

/// Many concurrent handshake attempts while an honest agent uploads: hundreds of clients whose
/// Initials are real but which never see the server's answer (a blackhole relay: half-open
/// handshakes, as from spoofed sources), plus anonymous clients that complete the exchange and
/// are refused for lack of a certificate. The server bounds the handshakes it holds
/// (`max_pending_handshakes`; unvalidated addresses get a Retry from half of it), stays up,
/// lets a new honest connection in during the flood, and stores every honest chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handshake_flood_keeps_pending_handshakes_bounded_and_honest_data_flowing() {
    const MAX_PENDING: u32 = 64;
    let tier = Tier::current();
    let half_open = tier.pick(600, 3000);
    let anonymous = tier.pick(100, 400);
    let opts = ServerOptions {
        max_pending_handshakes: MAX_PENDING,
        tls_handshake_timeout: Duration::from_secs(2),
        ..options()
    };
    // Some closed half-open handshakes stay in quinn's connection table until the idle timeout
    // (30 s by default; see the report); a short one keeps this test quick.
    let pki = new_pki();
    let tuning = Tuning {
        max_idle_timeout: Duration::from_secs(5),
        keep_alive_interval: Duration::from_secs(1),
        ..Tuning::default()
    };
    let config =
        server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, &tuning).expect("server config");
    let rig = Rig::start_with(pki, config, opts).await;
    let counters = rig.counters();
    let mut honest = rig.agent(HONEST, HONEST_SPOOL).await;
    honest.upload_stored("before the flood", &honest_chunks(0..4)).await;
    let rss_before = rss_bytes();

    // Watch the pending handshakes throughout.
    let max_seen = Arc::new(AtomicU64::new(0));
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (counters, max_seen, watching) = (counters.clone(), max_seen.clone(), watching.clone());
        tokio::spawn(async move {
            while watching.load(Ordering::Relaxed) {
                max_seen.fetch_max(load(&counters.handshakes_pending), Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        })
    };

    // Half-open handshakes: real Initials through a relay that drops every answer.
    let relay = Relay::start(rig.addr(), true).await;
    let flood_endpoint = client_endpoint(localhost(), &Tuning::default()).expect("flood endpoint");
    let flood_config = rig.device(ROGUE);
    let half_open_attempts: Vec<quinn::Connecting> = (0..half_open)
        .map(|_| flood_endpoint.connect_with(flood_config.clone(), relay.front, SERVER_NAME).expect("connect"))
        .collect();

    // Anonymous clients, all at once.
    let anonymous_config = {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(CertificateDer::from_pem_slice(rig.pki.ca_pem.as_bytes()).expect("CA PEM")).expect("CA root");
        let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .expect("TLS 1.3")
            .with_root_certificates(roots)
            .with_no_client_auth();
        tls.alpn_protocols = vec![ALPN.to_vec()];
        quic_client_config(tls, &Tuning::default()).expect("anonymous client config")
    };
    let mut anons = tokio::task::JoinSet::new();
    for _ in 0..anonymous {
        let connecting =
            flood_endpoint.connect_with(anonymous_config.clone(), rig.addr(), SERVER_NAME).expect("connect");
        anons.spawn(async move {
            match connecting.await {
                Ok(conn) => conn.closed().await,
                Err(e) => e,
            }
        });
    }

    // During the flood: the connected agent keeps storing, and a new honest connection gets in
    // (retrying like an agent when refused).
    honest.upload_stored("during the flood", &honest_chunks(4..12)).await;
    let started = Instant::now();
    let newcomer_config = rig.device("honest-2");
    let mut refused_newcomer = 0;
    let newcomer = bounded("a new honest connection during the flood", async {
        loop {
            match rig.dial(&newcomer_config, SERVER_NAME).await {
                Ok(conn) => break conn,
                Err(e) if is_refused(&e) => {
                    refused_newcomer += 1;
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("the honest newcomer failed: {e}"),
            }
        }
    })
    .await;
    let newcomer_connect = started.elapsed();
    let mut newcomer = bounded("newcomer hello", Agent::connect(&newcomer, [0x22; 16], "newcomer")).await;
    newcomer.upload_stored("newcomer during the flood", &honest_chunks(0..4)).await;
    honest.upload_stored("still during the flood", &honest_chunks(12..16)).await;

    let mut anonymous_refused = 0;
    while let Some(ended) = bounded("anonymous clients end", anons.join_next()).await {
        match ended.expect("anonymous task") {
            e if tls_alert(&e) == Some(AlertDescription::CertificateRequired) => anonymous_refused += 1,
            e if is_refused(&e) || matches!(e, ConnectionError::TimedOut) => {}
            other => panic!("unexpected end of an anonymous client: {other:?}"),
        }
    }
    drop(half_open_attempts);
    flood_endpoint.close(VarInt::from_u32(0), b"flood over");
    wait_until("the flood drains", || load(&counters.handshakes_pending) == 0).await;
    watching.store(false, Ordering::Relaxed);
    watcher.await.expect("watcher");
    // quinn's own state of the abandoned attempts goes too (within the idle timeout).
    let drain = Instant::now();
    wait_until("quinn forgets the flood", || rig.server_endpoint.open_connections() <= 2).await;
    let quinn_drain = drain.elapsed();
    let rss_growth = rss_bytes().saturating_sub(rss_before);

    let figures = serde_json::json!({
        "half_open_attempts": half_open,
        "anonymous_attempts": anonymous,
        "anonymous_refused_by_tls": anonymous_refused,
        "max_pending_handshakes": MAX_PENDING,
        "max_pending_seen": load(&max_seen),
        "handshakes_retried": load(&counters.handshakes_retried_total),
        "handshakes_refused": load(&counters.handshakes_refused_total),
        "handshakes_failed": load(&counters.auth_failures_total),
        "newcomer_connect_ms": newcomer_connect.as_millis(),
        "newcomer_refusals": refused_newcomer,
        "rss_growth_bytes": rss_growth,
        "quinn_state_drained_ms": quinn_drain.as_millis(),
        "honest_chunks_stored": load(&counters.chunks_stored_total),
    });
    edge_testkit::report("security_handshake_flood", &figures).expect("report");
    assert!(load(&max_seen) <= u64::from(MAX_PENDING), "pending handshakes stayed bounded: {figures}");
    assert!(load(&counters.handshakes_retried_total) > 0, "address validation engaged: {figures}");
    assert_eq!(load(&counters.connections_total), 2, "only the honest agents got connections: {figures}");

    // After the flood: business as usual.
    honest.upload_stored("after the flood", &honest_chunks(16..20)).await;
    newcomer.close();
    honest.close();
    let (exported, report) = rig.finish().await;
    assert_exported_once(&exported, HONEST, HONEST_SPOOL, &honest_chunks(0..20));
    assert_exported_once(&exported, "honest-2", [0x22; 16], &honest_chunks(0..4));
    assert_eq!(exported.len(), 24);
    assert_eq!(report.duplicate_entries, 0);
}

// === Slowloris (9) ===

/// A slowloris attacker: one connection with every chunk stream the server allows, each
/// trickling a byte at a time. 64 (the in-flight window) carry valid headers declaring the
/// largest payload; the rest trickle a header they never finish. Runs until aborted.
async fn slowloris(conn: quinn::Connection, streams: usize, tick: Duration) {
    let _agent = Agent::connect(&conn, ROGUE_SPOOL, "slowloris").await;
    let window = Limits::default().max_chunk_payload;
    let mut payload_streams = Vec::new();
    let mut header_streams = Vec::new();
    for seq in 0..streams as u64 {
        let h = ChunkHeader { raw_len: window, payload_len: window, records: 1, ..chunk("slow.loris", seq).header };
        let mut wire = Vec::new();
        h.encode(&mut wire);
        let Ok(mut send) = conn.open_uni().await else { return };
        if seq < 64 {
            wire.push(0);
            let _ = send.write_all(&wire).await;
            payload_streams.push(send);
        } else {
            let _ = send.write_all(&wire[..3]).await;
            header_streams.push((send, wire, 3usize));
        }
    }
    loop {
        tokio::time::sleep(tick).await;
        for send in &mut payload_streams {
            let _ = send.write_all(&[0]).await;
        }
        for (send, wire, sent) in &mut header_streams {
            // Never the last header byte: the header stays incomplete.
            if *sent + 1 < wire.len() {
                let _ = send.write_all(&wire[*sent..*sent + 1]).await;
                *sent += 1;
            }
        }
    }
}

/// Honest goodput under a slowloris attack on the same server, measured against the same
/// agent without the attacker in alternating phases (so drift of a noisy host hits both).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slowloris_client_leaves_honest_agents_most_of_their_goodput() {
    let tier = Tier::current();
    let rounds = tier.pick(3, 6);
    let batches_per_phase = tier.pick(12, 64);
    const BATCH: u64 = 16;
    let rig = Rig::start(options()).await;
    let counters = rig.counters();
    let mut honest = rig.agent(HONEST, HONEST_SPOOL).await;
    let rogue = rig.device(ROGUE);
    let streams = Tuning::default().max_concurrent_uni_streams as usize;

    let mut seq = 0u64;
    let mut uploaded = Vec::new();
    let (mut base, mut attacked) = ((0u64, Duration::ZERO), (0u64, Duration::ZERO));
    let mut phases = Vec::new();
    for _round in 0..rounds {
        for under_attack in [false, true] {
            let attacker = if under_attack {
                let conn = rig.dial(&rogue, SERVER_NAME).await.expect("attacker handshake");
                let task = tokio::spawn(slowloris(conn.clone(), streams, Duration::from_millis(100)));
                // The attack is on once its streams are open and trickling.
                wait_until("the attacker opened its streams", || conn.stats().frame_tx.stream > streams as u64 + 64)
                    .await;
                Some((conn, task))
            } else {
                None
            };
            let started = Instant::now();
            let mut bytes = 0u64;
            for _ in 0..batches_per_phase {
                let batch: Vec<TestChunk> =
                    (seq..seq + BATCH).map(|s| chunk_of("honest.bulk", s, "bulk", 4, 64 << 10)).collect();
                seq += BATCH;
                honest.upload_stored("honest batch", &batch).await;
                bytes += batch.iter().map(|c| c.payload.len() as u64).sum::<u64>();
                uploaded.extend(batch.into_iter().map(|c| (c.header.seq, c.records.len())));
            }
            let elapsed = started.elapsed();
            let rate = bytes as f64 / elapsed.as_secs_f64();
            phases.push(serde_json::json!({"attack": under_attack, "bytes": bytes, "secs": elapsed.as_secs_f64(), "bytes_per_s": rate}));
            let total = if under_attack { &mut attacked } else { &mut base };
            total.0 += bytes;
            total.1 += elapsed;
            if let Some((conn, task)) = attacker {
                assert!(conn.close_reason().is_none(), "the slowloris connection is tolerated, not closed");
                task.abort();
                conn.close(VarInt::from_u32(0), b"phase over");
            }
        }
    }
    let rate = |(b, t): (u64, Duration)| b as f64 / t.as_secs_f64();
    let ratio = rate(attacked) / rate(base);
    edge_testkit::report(
        "security_slowloris",
        &serde_json::json!({
            "attacker_streams": streams,
            "trickle_interval_ms": 100,
            "baseline_bytes_per_s": rate(base),
            "attacked_bytes_per_s": rate(attacked),
            "goodput_ratio": ratio,
            "phases": phases,
        }),
    )
    .expect("report");
    // The issue's bar (80 %) is asserted on the long tier's longer phases; the quick tier's
    // sub-second phases on a shared 2-core host only guard against starvation.
    let bar = tier.pick(0.5, 0.8);
    assert!(ratio >= bar, "honest goodput under attack is {:.0} % of the baseline", ratio * 100.0);
    assert_eq!(load(&counters.chunks_stored_total), seq, "every honest chunk stored");
    honest.close();
    let (exported, report) = rig.finish().await;
    let honest_stored = exported.iter().filter(|e| e.key.device == HONEST).count() as u64;
    assert_eq!(honest_stored, seq);
    assert!(exported.iter().all(|e| e.key.device != ROGUE), "the slowloris stored nothing");
    assert_eq!(report.duplicate_entries, 0);
}
