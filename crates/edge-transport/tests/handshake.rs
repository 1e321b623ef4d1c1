//! End-to-end tests of the mutual-TLS QUIC setup: a real quinn server and client over
//! 127.0.0.1 (ephemeral ports), certificates made in the test with the crate's PKI helpers.
//!
//! Every refusal is checked on the side that detects it (a local `TransportError` carrying
//! the TLS alert and rustls' reason) and, where the other side learns of it, on that side too
//! (a `ConnectionClosed` carrying the same alert). No test sleeps; each handshake is bounded
//! by a timeout so a regression fails instead of hanging.

use std::future::Future;
use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, SystemTime};

use edge_transport::pki::{self, InMemoryPki, InitOptions, PkiError};
use edge_transport::{
    ALPN, Tuning, client_config, client_config_from_pem, client_endpoint, crypto_provider, peer_device_id,
    quic_client_config, rustls_client_config_from_pem, server_config, server_config_from_pem,
    server_config_from_pem_with_crls, server_endpoint, tls_alert,
};
use quinn::{ConnectionError, Endpoint};
use rustls::AlertDescription;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

const DAY: Duration = Duration::from_secs(86_400);
const SERVER_NAME: &str = "localhost";

/// Fails the test instead of hanging when a handshake never finishes.
async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 20 s"))
}

fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn pki() -> InMemoryPki {
    InMemoryPki::generate(&[SERVER_NAME, "127.0.0.1"]).expect("generate PKI")
}

fn server(pki: &InMemoryPki, crls: &[&str]) -> Endpoint {
    let config = server_config_from_pem_with_crls(
        &pki.server_cert_pem,
        &pki.server_key_pem,
        &pki.ca_pem,
        crls,
        &Tuning::default(),
    )
    .expect("server config");
    server_endpoint(localhost(), config, &Tuning::default()).expect("server endpoint")
}

fn device_config(pki: &InMemoryPki, cert: &str, key: &str) -> quinn::ClientConfig {
    client_config_from_pem(cert, key, &pki.ca_pem, &Tuning::default()).expect("client config")
}

/// Both ends of one handshake attempt. The client endpoint is kept so its connection lives.
struct Attempt {
    server: Result<quinn::Connection, ConnectionError>,
    client: Result<quinn::Connection, ConnectionError>,
    _client_endpoint: Endpoint,
}

async fn attempt(server: &Endpoint, config: quinn::ClientConfig, server_name: &str) -> Attempt {
    let client_endpoint = client_endpoint(localhost(), &Tuning::default()).expect("client endpoint");
    let addr = server.local_addr().expect("server address");
    let connecting = client_endpoint.connect_with(config, addr, server_name).expect("start connecting");
    let accept = async {
        let incoming = server.accept().await.expect("server endpoint is open");
        incoming.await
    };
    let (server, client) = bounded("handshake", async { tokio::join!(accept, connecting) }).await;
    Attempt { server, client, _client_endpoint: client_endpoint }
}

/// How a side's connection ended: its handshake error, or, if the handshake looked complete
/// from that side (a TLS 1.3 client finishes before the server has checked its certificate),
/// the error that closed it afterwards.
async fn ending(side: Result<quinn::Connection, ConnectionError>) -> ConnectionError {
    match side {
        Ok(conn) => bounded("connection close", conn.closed()).await,
        Err(e) => e,
    }
}

/// Asserts the side that refused saw a local TLS failure with `alert` whose reason contains
/// `reason` (rustls' wording of the error kind).
fn assert_refused_locally(err: &ConnectionError, alert: AlertDescription, reason: &str) {
    match err {
        ConnectionError::TransportError(e) => {
            assert_eq!(tls_alert(err), Some(alert), "{err}");
            assert!(e.reason.contains(reason), "expected {reason:?} in: {err}");
        }
        other => panic!("expected a local TLS failure ({alert:?}), got: {other:?}"),
    }
}

/// Asserts the other side was told by its peer, with `alert`.
fn assert_closed_by_peer(err: &ConnectionError, alert: AlertDescription) {
    assert!(
        matches!(err, ConnectionError::ConnectionClosed(_)),
        "expected a CONNECTION_CLOSE from the peer ({alert:?}), got: {err:?}"
    );
    assert_eq!(tls_alert(err), Some(alert), "{err}");
}

/// The server refused the client: check both ends.
async fn assert_server_refused(attempt: Attempt, alert: AlertDescription, reason: &str) {
    let server_err = ending(attempt.server).await;
    assert_refused_locally(&server_err, alert, reason);
    let client_err = ending(attempt.client).await;
    assert_closed_by_peer(&client_err, alert);
}

#[tokio::test]
async fn mtls_handshake_succeeds_and_peer_device_id_is_the_certificate_cn() {
    let pki = pki();
    let server = server(&pki, &[]);
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    let attempt = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    let server_conn = attempt.server.expect("server side established");
    let client_conn = attempt.client.expect("client side established");

    assert_eq!(peer_device_id(&server_conn).expect("device id"), "sensor-42");
    let negotiated = server_conn
        .handshake_data()
        .and_then(|d| d.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
        .expect("rustls handshake data");
    assert_eq!(negotiated.protocol.as_deref(), Some(ALPN));
    assert_eq!(negotiated.server_name.as_deref(), Some(SERVER_NAME));
    // The agent does not learn a device id from the server: the server certificate's CN is
    // not a device id.
    assert!(peer_device_id(&client_conn).is_err());
}

#[tokio::test]
async fn client_without_a_certificate_is_refused_with_certificate_required() {
    let pki = pki();
    let server = server(&pki, &[]);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(pki.ca_pem.as_bytes()).expect("CA PEM")).expect("CA root");
    let mut tls = rustls::ClientConfig::builder_with_provider(crypto_provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_no_client_auth();
    tls.alpn_protocols = vec![ALPN.to_vec()];
    let config = quic_client_config(tls, &Tuning::default()).expect("anonymous client config");

    let attempt = attempt(&server, config, SERVER_NAME).await;
    assert_server_refused(attempt, AlertDescription::CertificateRequired, "peer sent no certificates").await;
}

#[tokio::test]
async fn client_certificate_from_an_unknown_ca_is_refused_with_unknown_ca() {
    let pki = pki();
    let server = server(&pki, &[]);
    let stranger = InMemoryPki::generate(&[SERVER_NAME]).expect("foreign PKI");
    let (cert, key) = stranger.issue_device("sensor-42").expect("foreign device");
    // Trusts the right server CA, but presents a certificate the server's CA never issued.
    let attempt = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    assert_server_refused(attempt, AlertDescription::UnknownCA, "UnknownIssuer").await;
}

#[tokio::test]
async fn expired_device_certificate_is_refused() {
    let pki = pki();
    let server = server(&pki, &[]);
    let now = SystemTime::now();
    let (cert, key) = pki.issue_device_with_validity("sensor-42", now - 10 * DAY, now - DAY).expect("expired device");
    let attempt = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    assert_server_refused(attempt, AlertDescription::CertificateExpired, "certificate expired").await;
}

#[tokio::test]
async fn not_yet_valid_device_certificate_is_refused() {
    let pki = pki();
    let server = server(&pki, &[]);
    let now = SystemTime::now();
    let (cert, key) = pki.issue_device_with_validity("sensor-42", now + DAY, now + 10 * DAY).expect("future device");
    let attempt = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    assert_server_refused(attempt, AlertDescription::CertificateExpired, "certificate not valid yet").await;
}

#[tokio::test]
async fn server_certificate_used_as_a_client_certificate_is_refused_for_its_purpose() {
    let pki = pki();
    let server = server(&pki, &[]);
    // Signed by the right CA, but its EKU is serverAuth only.
    let config = device_config(&pki, &pki.server_cert_pem, &pki.server_key_pem);
    let attempt = attempt(&server, config, SERVER_NAME).await;
    assert_server_refused(
        attempt,
        AlertDescription::UnsupportedCertificate,
        "does not allow extended key usage for client authentication",
    )
    .await;
}

#[tokio::test]
async fn wrong_server_name_is_refused_by_the_client() {
    let pki = pki();
    let server = server(&pki, &[]);
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    let attempt = attempt(&server, device_config(&pki, &cert, &key), "ingest.example.com").await;
    let client_err = ending(attempt.client).await;
    assert_refused_locally(
        &client_err,
        AlertDescription::BadCertificate,
        "certificate not valid for name \"ingest.example.com\"",
    );
    let server_err = ending(attempt.server).await;
    assert_closed_by_peer(&server_err, AlertDescription::BadCertificate);
}

#[tokio::test]
async fn server_certificate_from_an_unknown_ca_is_refused_by_the_client() {
    let pki = pki();
    let impostor = InMemoryPki::generate(&[SERVER_NAME]).expect("impostor PKI");
    // The impostor server trusts our devices but presents a certificate from its own CA.
    let config =
        server_config_from_pem(&impostor.server_cert_pem, &impostor.server_key_pem, &pki.ca_pem, &Tuning::default())
            .expect("impostor server config");
    let server = server_endpoint(localhost(), config, &Tuning::default()).expect("endpoint");
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    let attempt = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    let client_err = ending(attempt.client).await;
    assert_refused_locally(&client_err, AlertDescription::UnknownCA, "UnknownIssuer");
    let server_err = ending(attempt.server).await;
    assert_closed_by_peer(&server_err, AlertDescription::UnknownCA);
}

#[tokio::test]
async fn wrong_alpn_is_refused_with_no_application_protocol() {
    let pki = pki();
    let server = server(&pki, &[]);
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    let mut tls = rustls_client_config_from_pem(&cert, &key, &pki.ca_pem).expect("client tls");
    tls.alpn_protocols = vec![b"edge/2".to_vec()];
    let config = quic_client_config(tls, &Tuning::default()).expect("client config");
    let attempt = attempt(&server, config, SERVER_NAME).await;
    assert_server_refused(attempt, AlertDescription::NoApplicationProtocol, "peer doesn't support any known protocol")
        .await;
}

#[tokio::test]
async fn missing_alpn_is_refused_with_no_application_protocol() {
    let pki = pki();
    let server = server(&pki, &[]);
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    let mut tls = rustls_client_config_from_pem(&cert, &key, &pki.ca_pem).expect("client tls");
    tls.alpn_protocols.clear();
    let config = quic_client_config(tls, &Tuning::default()).expect("client config");
    let attempt = attempt(&server, config, SERVER_NAME).await;
    assert_server_refused(attempt, AlertDescription::NoApplicationProtocol, "peer doesn't support any known protocol")
        .await;
}

#[tokio::test]
async fn revoked_device_certificate_is_refused_and_others_are_still_accepted() {
    let pki = pki();
    let (revoked_cert, revoked_key) = pki.issue_device("sensor-revoked").expect("device");
    let (good_cert, good_key) = pki.issue_device("sensor-good").expect("device");
    let crl = pki.crl_pem(&[&revoked_cert], SystemTime::now() + 7 * DAY).expect("CRL");
    let server = server(&pki, &[&crl]);

    let refused = attempt(&server, device_config(&pki, &revoked_cert, &revoked_key), SERVER_NAME).await;
    assert_server_refused(refused, AlertDescription::CertificateRevoked, "Revoked").await;

    let accepted = attempt(&server, device_config(&pki, &good_cert, &good_key), SERVER_NAME).await;
    let conn = accepted.server.expect("unrevoked device is accepted");
    assert_eq!(peer_device_id(&conn).expect("device id"), "sensor-good");
}

#[tokio::test]
async fn crl_past_its_next_update_makes_the_server_refuse_devices() {
    let pki = pki();
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    let now = SystemTime::now();
    // Revokes nothing, but is stale: the server enforces nextUpdate rather than trusting an
    // outdated list.
    let stale = pki.crl_pem_with_validity(&[], now - 10 * DAY, now - DAY).expect("stale CRL");
    let server = server(&pki, &[&stale]);
    let attempt = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    // rustls reports revocation-status problems with the unknown_ca alert.
    assert_server_refused(attempt, AlertDescription::UnknownCA, "certificate revocation list expired").await;
}

#[tokio::test]
async fn device_of_a_trusted_ca_without_a_crl_is_refused_as_unknown_revocation_status() {
    // The server trusts two CAs (a rollover) but has a CRL for the first only.
    let pki = pki();
    let second = InMemoryPki::generate(&[SERVER_NAME]).expect("second CA");
    let crl = pki.crl_pem(&[], SystemTime::now() + 7 * DAY).expect("CRL");
    let both_cas = format!("{}{}", pki.ca_pem, second.ca_pem);
    let config = server_config_from_pem_with_crls(
        &pki.server_cert_pem,
        &pki.server_key_pem,
        &both_cas,
        &[&crl],
        &Tuning::default(),
    )
    .expect("server config");
    let server = server_endpoint(localhost(), config, &Tuning::default()).expect("endpoint");

    let (cert, key) = second.issue_device("sensor-42").expect("device of the second CA");
    let refused = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    assert_server_refused(refused, AlertDescription::UnknownCA, "UnknownRevocationStatus").await;

    let (cert, key) = pki.issue_device("sensor-43").expect("device of the first CA");
    let accepted = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    accepted.server.expect("device covered by a CRL is accepted");
}

#[tokio::test]
async fn bytes_sent_on_a_uni_stream_with_write_chunk_arrive_intact() {
    let pki = pki();
    let server = server(&pki, &[]);
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    let attempt = attempt(&server, device_config(&pki, &cert, &key), SERVER_NAME).await;
    let server_conn = attempt.server.expect("server side");
    let client_conn = attempt.client.expect("client side");

    // Several streams, one larger than the 16 MiB stream window would need to be split
    // across window updates only if it were bigger; 3 MiB with a recognisable pattern each.
    let payloads: Vec<Vec<u8>> =
        (0..4u8).map(|stream| (0..3 * 1024 * 1024u32).map(|i| (i.wrapping_mul(31) as u8) ^ stream).collect()).collect();
    let send = {
        let payloads = payloads.clone();
        async move {
            for payload in payloads {
                let mut stream = client_conn.open_uni().await.expect("open uni");
                stream.write_chunk(payload.into()).await.expect("write_chunk");
                stream.finish().expect("finish");
                stream.stopped().await.expect("peer read everything");
            }
            client_conn
        }
    };
    let receive = async {
        let mut received = Vec::new();
        for _ in 0..payloads.len() {
            let mut stream = server_conn.accept_uni().await.expect("accept uni");
            received.push(stream.read_to_end(8 * 1024 * 1024).await.expect("read stream"));
        }
        received
    };
    let (_client_conn, received) = bounded("transfer", async { tokio::join!(send, receive) }).await;
    assert_eq!(received.len(), payloads.len());
    for (got, sent) in received.iter().zip(&payloads) {
        assert!(got == sent, "stream content differs ({} vs {} bytes)", got.len(), sent.len());
    }
}

#[tokio::test]
async fn resumed_connection_uses_0rtt_and_keeps_the_device_identity() {
    let pki = pki();
    let server = server(&pki, &[]);
    let (cert, key) = pki.issue_device("sensor-42").expect("device");
    // One config for both connections: the resumption store lives in it.
    let config = device_config(&pki, &cert, &key);
    let client_endpoint = client_endpoint(localhost(), &Tuning::default()).expect("client endpoint");
    let addr = server.local_addr().expect("server address");

    // First connection: full handshake, then a round trip on the control stream so the
    // session ticket (sent right after the handshake) has arrived before we close.
    let first = async {
        let conn = client_endpoint
            .connect_with(config.clone(), addr, SERVER_NAME)
            .expect("connect")
            .await
            .expect("first handshake");
        let (mut send, mut recv) = conn.open_bi().await.expect("open control stream");
        send.write_all(b"ping").await.expect("write");
        send.finish().expect("finish");
        let echoed = recv.read_to_end(16).await.expect("echo");
        assert_eq!(echoed, b"ping");
        conn.close(0u32.into(), b"done");
    };
    let echo = async {
        let conn = server.accept().await.expect("open").await.expect("first server handshake");
        let (mut send, mut recv) = conn.accept_bi().await.expect("control stream");
        let data = recv.read_to_end(16).await.expect("read");
        send.write_all(&data).await.expect("echo");
        send.finish().expect("finish");
        // Wait for the client's close so no state is left half-done.
        conn.closed().await
    };
    bounded("first connection", async { tokio::join!(first, echo) }).await;

    // Second connection: resumes with early data; a chunk stream sent in 0-RTT arrives.
    let second = async {
        let connecting = client_endpoint.connect_with(config.clone(), addr, SERVER_NAME).expect("connect");
        let (conn, accepted) = connecting.into_0rtt().unwrap_or_else(|_| panic!("a resumption ticket allows 0-RTT"));
        let mut stream = conn.open_uni().await.expect("open uni in 0-RTT");
        stream.write_chunk(b"early chunk".to_vec().into()).await.expect("write");
        stream.finish().expect("finish");
        assert!(accepted.await, "server accepted the 0-RTT data");
        conn
    };
    let serve = async {
        let conn = server.accept().await.expect("open").await.expect("resumed handshake");
        let device = peer_device_id(&conn).expect("device id of a resumed connection");
        let mut stream = conn.accept_uni().await.expect("accept uni");
        let data = stream.read_to_end(64).await.expect("read");
        (device, data)
    };
    let (_conn, (device, data)) = bounded("resumed connection", async { tokio::join!(second, serve) }).await;
    assert_eq!(device, "sensor-42");
    assert_eq!(data, b"early chunk");
}

#[tokio::test]
async fn pki_init_and_issue_device_files_are_accepted_end_to_end() {
    let root = tempfile::tempdir().expect("tempdir");
    let ca_dir = root.path().join("ca");
    let device_dir = root.path().join("devices").join("sensor-7");

    let paths = pki::init(&ca_dir, &InitOptions::default()).expect("init");
    let device = pki::issue_device(&ca_dir, "sensor-7", &device_dir, 30).expect("issue device");
    for key in [&paths.ca_key, &paths.server_key, &device.key] {
        let mode = std::fs::metadata(key).expect("key metadata").permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{}", key.display());
    }
    let dir_mode = std::fs::metadata(&device_dir).expect("dir").permissions().mode() & 0o777;
    assert_eq!(dir_mode, 0o700);

    let err = pki::init(&ca_dir, &InitOptions::default()).expect_err("CA exists");
    assert!(matches!(err, PkiError::CaExists { .. }), "{err}");

    let server_config = server_config(&paths.server_tls(), &Tuning::default()).expect("server config");
    let server = server_endpoint(localhost(), server_config, &Tuning::default()).expect("endpoint");
    for name in ["localhost", "127.0.0.1"] {
        let client_config = client_config(&device.client_tls(name), &Tuning::default()).expect("client config");
        let attempt = attempt(&server, client_config, name).await;
        let conn = attempt.server.expect("server side established");
        attempt.client.expect("client side established");
        assert_eq!(peer_device_id(&conn).expect("device id"), "sensor-7");
    }
}

#[tokio::test]
async fn revocation_written_by_write_crl_is_enforced_from_files() {
    let root = tempfile::tempdir().expect("tempdir");
    let ca_dir = root.path().join("ca");
    let paths = pki::init(&ca_dir, &InitOptions::default()).expect("init");
    let device = pki::issue_device(&ca_dir, "sensor-7", &root.path().join("dev"), 30).expect("device");
    let crl = pki::write_crl(&ca_dir, std::slice::from_ref(&device.cert), &ca_dir.join("crl.pem"), 7).expect("CRL");
    let mut tls = paths.server_tls();
    tls.crls.push(crl);
    let server = server_endpoint(
        localhost(),
        server_config(&tls, &Tuning::default()).expect("server config"),
        &Tuning::default(),
    )
    .expect("endpoint");
    let config = client_config(&device.client_tls(SERVER_NAME), &Tuning::default()).expect("client");
    let attempt = attempt(&server, config, SERVER_NAME).await;
    assert_server_refused(attempt, AlertDescription::CertificateRevoked, "Revoked").await;
}

#[tokio::test]
async fn revoke_keeps_every_revoked_certificate_and_its_crl_is_enforced() {
    let root = tempfile::tempdir().expect("tempdir");
    let ca_dir = root.path().join("ca");
    let paths = pki::init(&ca_dir, &InitOptions::default()).expect("init");
    let revoked = pki::issue_device(&ca_dir, "sensor-7", &root.path().join("dev7"), 30).expect("device 7");
    let kept = pki::issue_device(&ca_dir, "sensor-8", &root.path().join("dev8"), 30).expect("device 8");
    let other_ca = root.path().join("other-ca");
    pki::init(&other_ca, &InitOptions::default()).expect("other CA");
    let foreign = pki::issue_device(&other_ca, "sensor-8", &root.path().join("foreign"), 30).expect("foreign");

    let w = pki::revoke(&ca_dir, std::slice::from_ref(&revoked.cert), 7).expect("revoke");
    assert_eq!((w.added, w.revoked, w.crl.clone()), (1, 1, ca_dir.join(pki::CRL_FILE)));
    let again = pki::revoke(&ca_dir, std::slice::from_ref(&revoked.cert), 7).expect("revoke again");
    assert_eq!((again.added, again.revoked), (0, 1), "a certificate revoked twice counts once");
    // One certificate of another CA refuses the whole call, naming its file; nothing is kept.
    let err = pki::revoke(&ca_dir, &[kept.cert.clone(), foreign.cert.clone()], 7).expect_err("foreign certificate");
    assert!(matches!(&err, PkiError::InvalidRevocation { origin, .. } if origin.contains("foreign")), "{err}");
    assert_eq!(std::fs::read_dir(ca_dir.join(pki::REVOKED_DIR)).expect("revoked dir").count(), 1);
    assert_eq!(pki::reissue_crl(&ca_dir, 7).expect("reissue").revoked, 1);

    let mut tls = paths.server_tls();
    tls.crls.push(w.crl);
    let server = server_endpoint(
        localhost(),
        server_config(&tls, &Tuning::default()).expect("server config"),
        &Tuning::default(),
    )
    .expect("endpoint");
    let config = client_config(&revoked.client_tls(SERVER_NAME), &Tuning::default()).expect("client");
    assert_server_refused(attempt(&server, config, SERVER_NAME).await, AlertDescription::CertificateRevoked, "Revoked")
        .await;
    let config = client_config(&kept.client_tls(SERVER_NAME), &Tuning::default()).expect("client");
    let attempt = attempt(&server, config, SERVER_NAME).await;
    let conn = attempt.server.expect("a device not revoked still connects");
    assert_eq!(peer_device_id(&conn).expect("device id"), "sensor-8");
}

#[test]
fn invalid_device_id_is_refused_naming_it() {
    let pki = pki();
    let err = pki.issue_device("../../etc").expect_err("invalid id");
    assert!(matches!(&err, PkiError::InvalidDeviceId { id, .. } if id == "../../etc"), "{err}");
    assert!(err.to_string().contains("\"../../etc\""), "{err}");
}

/// Records the length of every TLS secret a connection derives. TLS 1.3's SHA-256 suites
/// (AES-128-GCM, ChaCha20-Poly1305) derive 32-byte secrets, AES-256-GCM-SHA384 48-byte ones:
/// quinn does not tell which suite a connection negotiated, its key log does.
#[derive(Debug, Default)]
struct SecretLengths(std::sync::Mutex<Vec<usize>>);

impl rustls::KeyLog for SecretLengths {
    fn log(&self, _label: &str, _client_random: &[u8], secret: &[u8]) {
        self.0.lock().expect("key log lock").push(secret.len());
    }
}

/// Connects a client with the given rustls config to `server` and returns the lengths of the
/// secrets it derived (at least the handshake and traffic secrets, all of one length).
async fn negotiated_secret_length(server: &Endpoint, mut tls: rustls::ClientConfig) -> usize {
    let log = std::sync::Arc::new(SecretLengths::default());
    tls.key_log = log.clone();
    let config = quic_client_config(tls, &Tuning::default()).expect("client config");
    let attempt = attempt(server, config, SERVER_NAME).await;
    attempt.server.expect("server side established");
    attempt.client.expect("client side established");
    let lengths = log.0.lock().expect("key log lock").clone();
    assert!(lengths.len() >= 4, "the client logged only {lengths:?}");
    assert!(lengths.iter().all(|&len| len == lengths[0]), "secrets of different lengths: {lengths:?}");
    lengths[0]
}

/// The ingest takes the cipher suite the agent prefers, so the agent's order (AES-128-GCM or
/// ChaCha20-Poly1305 first, by CPU) is what every connection uses: a client that offers
/// AES-256-GCM first gets it, though our own order never puts it first, and our own client
/// never ends up with it.
#[tokio::test]
async fn the_server_follows_the_clients_cipher_suite_order() {
    use rustls::CipherSuite::TLS13_AES_256_GCM_SHA384;
    let pki = pki();
    let server = server(&pki, &[]);
    let (cert, key) = pki.issue_device("sensor-42").expect("device");

    let ours = rustls_client_config_from_pem(&cert, &key, &pki.ca_pem).expect("client tls");
    assert_eq!(negotiated_secret_length(&server, ours).await, 32, "our client negotiated a SHA-384 suite");

    let mut provider = (*crypto_provider()).clone();
    provider.cipher_suites.sort_by_key(|suite| suite.suite() != TLS13_AES_256_GCM_SHA384);
    assert_eq!(provider.cipher_suites[0].suite(), TLS13_AES_256_GCM_SHA384);
    let mut roots = rustls::RootCertStore::empty();
    roots.add(CertificateDer::from_pem_slice(pki.ca_pem.as_bytes()).expect("CA PEM")).expect("CA root");
    let chain = CertificateDer::pem_slice_iter(cert.as_bytes()).collect::<Result<Vec<_>, _>>().expect("device PEM");
    let key_der = rustls::pki_types::PrivateKeyDer::from_pem_slice(key.as_bytes()).expect("device key PEM");
    let mut aes256_first = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(provider))
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("TLS 1.3")
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key_der)
        .expect("client identity");
    aes256_first.alpn_protocols = vec![ALPN.to_vec()];
    assert_eq!(
        negotiated_secret_length(&server, aes256_first).await,
        48,
        "the server did not take the client's first suite"
    );
}
