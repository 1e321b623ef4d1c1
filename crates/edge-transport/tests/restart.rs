//! A server endpoint made with `server_endpoint_with_reset_secret` and restarted with the same
//! secret resets its predecessor's connections at their next packet, so agents reconnect at
//! once instead of at their idle timeout; with another secret it cannot.
//!
//! The first server runs on a Tokio runtime of its own, which is dropped to end it the way a
//! SIGKILL does: its tasks are dropped without being polled again, so it sends nothing (no
//! CONNECTION_CLOSE) and its UDP socket is closed. The next server binds the same address.
//! Each wait is bounded so a regression fails instead of hanging.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use edge_transport::pki::InMemoryPki;
use edge_transport::{
    Tuning, client_config_from_pem, client_endpoint, server_config_from_pem, server_endpoint_with_reset_secret,
};
use quinn::ConnectionError;
use tokio::runtime::Runtime;

const SERVER_NAME: &str = "localhost";

/// Short enough that the control case (no valid reset) ends at the idle timeout quickly; no
/// keep-alives, so the only packet the client sends after the restart is the test's own.
fn tuning() -> Tuning {
    Tuning { keep_alive_interval: Duration::ZERO, max_idle_timeout: Duration::from_secs(3), ..Tuning::default() }
}

fn localhost() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], 0))
}

fn runtime() -> Runtime {
    tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().expect("runtime")
}

/// Fails the test instead of hanging.
async fn bounded<T>(what: &str, fut: impl Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), fut)
        .await
        .unwrap_or_else(|_| panic!("{what} did not finish within 20 s"))
}

/// Connects a device to a server made with the PKI's server key as secret, ends that server
/// as a crash would, starts a new one on the same address with `new_secret` (`None`: the same
/// secret), sends a stream on the old connection and returns how that connection ended.
fn old_connection_after_a_restart(new_secret: Option<&[u8]>) -> ConnectionError {
    let pki = InMemoryPki::generate(&[SERVER_NAME]).expect("generate PKI");
    // What the ingest daemon passes: the bytes of its tls.key file.
    let secret = pki.server_key_pem.as_bytes();
    let server_config = || {
        server_config_from_pem(&pki.server_cert_pem, &pki.server_key_pem, &pki.ca_pem, &tuning())
            .expect("server config")
    };
    let (cert, key) = pki.issue_device("dev-1").expect("device");
    let client_config = client_config_from_pem(&cert, &key, &pki.ca_pem, &tuning()).expect("client config");

    let client_rt = runtime();
    let client = {
        let _entered = client_rt.enter();
        client_endpoint(localhost(), &tuning()).expect("client endpoint")
    };

    let old_rt = runtime();
    let old = {
        let _entered = old_rt.enter();
        server_endpoint_with_reset_secret(localhost(), server_config(), &tuning(), secret).expect("first server")
    };
    let addr = old.local_addr().expect("server address");
    let (read_tx, read_rx) = tokio::sync::oneshot::channel();
    old_rt.spawn(async move {
        let conn = old.accept().await.expect("endpoint open").await.expect("server handshake");
        let mut stream = conn.accept_uni().await.expect("accept uni");
        let hello = stream.read_to_end(64).await.expect("read stream");
        read_tx.send(hello).expect("the test waits for it");
        // Hold the endpoint and the connection until the runtime is dropped.
        let _alive = (old, conn);
        std::future::pending::<()>().await;
    });
    let conn = client_rt.block_on(bounded("connection to the first server", async {
        let conn = client.connect_with(client_config, addr, SERVER_NAME).expect("connect").await.expect("handshake");
        let mut stream = conn.open_uni().await.expect("open uni");
        stream.write_all(b"hello").await.expect("write");
        stream.finish().expect("finish");
        assert_eq!(read_rx.await.expect("server read the stream"), b"hello");
        conn
    }));

    drop(old_rt);
    let new_rt = runtime();
    let _new = {
        let _entered = new_rt.enter();
        server_endpoint_with_reset_secret(addr, server_config(), &tuning(), new_secret.unwrap_or(secret))
            .expect("second server on the same address")
    };
    client_rt.block_on(bounded("end of the old connection", async {
        let mut stream = conn.open_uni().await.expect("open uni on the old connection");
        // Its fate is what `closed` reports; the write itself may see the reset first.
        let _ = stream.write_all(&[0x5a; 512]).await;
        conn.closed().await
    }))
}

#[test]
fn a_server_restarted_with_the_same_secret_resets_its_predecessors_connections() {
    let ended = old_connection_after_a_restart(None);
    assert!(matches!(ended, ConnectionError::Reset), "expected a stateless reset, got: {ended:?}");
}

#[test]
fn a_server_restarted_with_another_secret_cannot_reset_them_and_they_time_out() {
    let ended = old_connection_after_a_restart(Some(b"another server key"));
    assert!(matches!(ended, ConnectionError::TimedOut), "expected the idle timeout, got: {ended:?}");
}
