//! A connection that begins during an outage, over real QUIC through the proxy: its first
//! Initial is dropped, quinn sends it again after the probe timeout, the path is back by then,
//! and the first copy is declared lost. With the agent's congestion controller
//! (`edge_transport::congestion`) that loss does not count as congestion and the connection
//! starts with its full initial window, in slow start; with quinn's plain Cubic it starts from
//! 70 % of it, in congestion avoidance.

use std::net::SocketAddr;
use std::time::Duration;

use edge_testkit::netem::{Netem, NetemConfig, Which};
use edge_transport::Tuning;
use edge_transport::pki::InMemoryPki;

/// Cubic's initial window for 1200-byte datagrams (ten of them).
const INITIAL_WINDOW: u64 = 12_000;

/// Connects through a proxy that drops everything towards the server until it has dropped the
/// first packet (the client's Initial); returns the client's path statistics once connected.
async fn connect_through_an_outage(tuning: &Tuning) -> quinn::PathStats {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = InMemoryPki::generate(&["localhost"]).expect("pki");
    let paths = pki.write_all(dir.path()).expect("pki files");
    let device = pki.write_device_files("outage-device", &dir.path().join("device")).expect("device files");
    let server_config = edge_transport::server_config(&paths.server_tls(), tuning).expect("server config");
    let server =
        edge_transport::server_endpoint(SocketAddr::from(([127, 0, 0, 1], 0)), server_config, tuning).expect("server");
    let upstream = server.local_addr().expect("server addr");
    let accept = tokio::spawn(async move {
        let conn = server.accept().await.expect("incoming").await.expect("server handshake");
        conn.closed().await;
    });
    let proxy =
        Netem::start(SocketAddr::from(([127, 0, 0, 1], 0)), upstream, NetemConfig::default(), 7).await.expect("proxy");
    let handle = proxy.handle();
    handle.blackhole(Which::ToServer, true);

    let client =
        edge_transport::client_endpoint(SocketAddr::from(([127, 0, 0, 1], 0)), tuning).expect("client endpoint");
    let config = edge_transport::client_config(&device.client_tls("localhost"), tuning).expect("client config");
    let connecting = client.connect_with(config, proxy.local_addr(), "localhost").expect("connect");
    // The outage ends once the first Initial is gone; its copy follows at the probe timeout.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while handle.stats().to_server.dropped_blackhole == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the proxy never saw the Initial");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    handle.blackhole(Which::ToServer, false);
    let conn = tokio::time::timeout(Duration::from_secs(10), connecting)
        .await
        .expect("no handshake within 10 s")
        .expect("handshake");
    let stats = conn.stats().path;
    conn.close(0u32.into(), b"done");
    client.wait_idle().await;
    accept.await.expect("server task");
    stats
}

#[tokio::test]
async fn a_connection_whose_first_initial_was_lost_in_an_outage_starts_with_its_whole_window() {
    let ours = connect_through_an_outage(&Tuning::default()).await;
    assert!(ours.lost_packets >= 1 && ours.congestion_events >= 1, "the first Initial was not declared lost: {ours:?}");
    assert!(ours.cwnd >= INITIAL_WINDOW, "the outage's loss shrank the window: {ours:?}");

    // Quinn's plain Cubic, for contrast: the same loss leaves slow start at 70 % of the window.
    let plain = connect_through_an_outage(&Tuning { outage_tolerant_congestion: false, ..Tuning::default() }).await;
    assert!(plain.congestion_events >= 1, "{plain:?}");
    assert!(plain.cwnd < INITIAL_WINDOW, "plain Cubic kept its window: {plain:?}");
}
