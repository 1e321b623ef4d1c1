//! The agent the intake tests run against: real sockets and a real SQLite spool in a temporary
//! directory, and an ingest address where nothing listens, so uploads never succeed and
//! everything accepted stays in the spool where the test can count it or read it back.

use std::time::Duration;

use edge_uploader::agent::Agent;
use edge_uploader::config::{Config, RawConfig, validate};

/// Starts an agent whose files live in the returned directory (`intake.sock`, `spool.db`,
/// `tls/`); `tweak` adjusts the configuration before it is validated.
pub async fn offline_agent(device: &str, tweak: impl FnOnce(&mut RawConfig)) -> (tempfile::TempDir, Agent, Config) {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = edge_transport::pki::InMemoryPki::generate(&["localhost"]).expect("pki");
    let dev = pki.write_device_files(device, &dir.path().join("tls")).expect("device files");
    let mut raw = RawConfig::default();
    raw.intake.socket = dir.path().join("intake.sock");
    raw.spool.path = dir.path().join("spool.db");
    // Nothing listens here.
    raw.upload.server = "127.0.0.1:9".into();
    raw.upload.server_name = Some("localhost".into());
    raw.upload.ca = dev.ca_cert;
    raw.upload.cert = dev.cert;
    raw.upload.key = dev.key;
    raw.upload.backoff_max = Duration::from_secs(1);
    tweak(&mut raw);
    let config = validate(raw, None).expect("valid config");
    let agent = Agent::start(&config).await.expect("agent starts");
    (dir, agent, config)
}

/// Every record of the spool at `dir/spool.db`, per stream in order (the agent must be stopped).
pub fn read_spool(dir: &std::path::Path) -> std::collections::BTreeMap<String, Vec<Vec<u8>>> {
    let (mut spool, _) = edge_spool::Spool::open(edge_spool::SpoolOptions::new(dir.join("spool.db"))).expect("reopens");
    spool.seal_all(u64::MAX).expect("seals");
    let mut reader = spool.reader().expect("reader");
    let mut out = std::collections::BTreeMap::<String, Vec<Vec<u8>>>::new();
    for meta in reader.sealed_after(None, usize::MAX).expect("lists") {
        let payload = reader.read(&meta).expect("reads");
        let records = edge_proto::records::split_records(&payload, meta.records).expect("framed");
        out.entry(meta.stream.clone()).or_default().extend(records.into_iter().map(<[u8]>::to_vec));
    }
    out
}
