//! `edge-ingest check-config`: the TLS files are read and parsed as `run` reads them, so a key
//! that does not load is a configuration error (exit 78, which systemd does not restart),
//! naming the file.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_edge-ingest");

fn check(config: &std::path::Path) -> (i32, String) {
    check_with(config, &[])
}

fn check_with(config: &std::path::Path, envs: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["check-config", "--config"]).arg(config);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run edge-ingest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

/// A valid config in a temp dir, with freshly generated server TLS files.
fn valid_config() -> (tempfile::TempDir, edge_transport::pki::ServerPaths, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = edge_transport::pki::InMemoryPki::generate(&["localhost"]).expect("pki");
    let tls = pki.write_server_files(&dir.path().join("tls")).expect("server files");
    let config = dir.path().join("edge-ingest.toml");
    let body = format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\n[store]\ndata_dir = {:?}\n",
        tls.cert,
        tls.key,
        tls.client_ca,
        dir.path().join("data")
    );
    std::fs::write(&config, body).expect("write config");
    (dir, tls, config)
}

#[test]
fn a_server_key_that_does_not_load_is_a_configuration_error_naming_the_file() {
    let (_dir, tls, config) = valid_config();
    let (code, text) = check(&config);
    assert_eq!(code, 0, "the config as written is valid: {text}");

    std::fs::write(&tls.key, "not a private key\n").expect("spoil the key");
    let (code, text) = check(&config);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains(&tls.key.display().to_string()), "names the key file: {text}");
}

/// Every key can be set from the environment, lists too: comma-separated.
#[test]
fn list_keys_take_comma_separated_values_from_the_environment() {
    let (dir, tls, config) = valid_config();
    let missing = dir.path().join("no-such-crl.pem");
    let crls = format!("{},{}", tls.client_ca.display(), missing.display());
    let (code, text) = check_with(&config, &[("EDGE_INGEST__TLS__CRLS", &crls)]);
    assert_eq!(code, 78, "{text}");
    assert!(
        text.contains("tls.crls") && text.contains(&missing.display().to_string()),
        "the second file of the list: {text}"
    );
    let servers = [
        ("EDGE_INGEST__SINK__KIND", "jetstream"),
        ("EDGE_INGEST__SINK__JETSTREAM__SERVERS", "nats://a:4222,nats://b:4222"),
    ];
    let (code, text) = check_with(&config, &servers);
    assert_eq!(code, 0, "two NATS servers: {text}");
    let (code, text) = check_with(
        &config,
        &[("EDGE_INGEST__STORE__DIRECT_WRITES", "false"), ("EDGE_INGEST__SINK__JETSTREAM__STREAM", "1234")],
    );
    assert_eq!(code, 0, "a boolean, and a name made of digits: {text}");
}

/// The dedup index's cap per device: a number from the file or the environment, refused below
/// its minimum with the key's name.
#[test]
fn the_index_cap_per_device_is_checked_with_its_name() {
    let (_dir, _tls, config) = valid_config();
    let key = "EDGE_INGEST__STORE__MAX_INDEX_GAPS_PER_DEVICE";
    let (code, text) = check_with(&config, &[(key, "1000000")]);
    assert_eq!(code, 0, "{text}");
    for bad in ["10", "many", "-1"] {
        let (code, text) = check_with(&config, &[(key, bad)]);
        assert_eq!(code, 78, "{bad}: {text}");
        assert!(text.contains("max_index_gaps_per_device"), "{bad}: names the key: {text}");
    }
    let body = std::fs::read_to_string(&config).expect("read config");
    std::fs::write(&config, format!("{body}max_index_gaps_per_device = 1023\n")).expect("write config");
    let (code, text) = check(&config);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("store.max_index_gaps_per_device") && text.contains("1024"), "{text}");
}

/// The cap on a device's streams: at least 1, refused with the key's name.
#[test]
fn the_stream_cap_per_device_is_checked_with_its_name() {
    let (_dir, _tls, config) = valid_config();
    let key = "EDGE_INGEST__STORE__MAX_INDEX_STREAMS_PER_DEVICE";
    let (code, text) = check_with(&config, &[(key, "1")]);
    assert_eq!(code, 0, "{text}");
    for bad in ["0", "many", "-1"] {
        let (code, text) = check_with(&config, &[(key, bad)]);
        assert_eq!(code, 78, "{bad}: {text}");
        assert!(text.contains("max_index_streams_per_device"), "{bad}: names the key: {text}");
    }
}

/// A value the environment got wrong is blamed on the environment, by the variable's name, not
/// on the config file, which is fine.
#[test]
fn an_override_that_does_not_parse_is_named_not_the_file() {
    let (_dir, _tls, config) = valid_config();
    let key = "EDGE_INGEST__SERVER__MAX_IN_FLIGHT";
    let (code, text) = check_with(&config, &[(key, "lots")]);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains(key) && text.contains("environment overrides"), "names the variable: {text}");
    assert!(!text.contains(&config.display().to_string()), "does not blame the file: {text}");
}

/// A shutdown grace longer than the packaged unit's stop timeout allows is valid (a drop-in may
/// raise the timeout) but comes with a note that says what to raise.
#[test]
fn a_shutdown_grace_past_the_units_stop_timeout_comes_with_a_note() {
    let (_dir, _tls, config) = valid_config();
    let key = "EDGE_INGEST__SERVER__SHUTDOWN_GRACE";
    let (code, text) = check_with(&config, &[(key, "10s")]);
    assert_eq!(code, 0, "{text}");
    assert!(!text.contains("note:"), "the default leaves room: {text}");
    let (code, text) = check_with(&config, &[(key, "60s")]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("note: server.shutdown_grace (1m)") && text.contains("TimeoutStopSec"), "{text}");
}

/// A `[tls]` file that is missing is named as missing; one in a directory this user may not
/// enter is named with the reason, not called missing.
#[test]
fn a_missing_or_unreachable_tls_file_is_named_with_the_reason() {
    let (dir, tls, config) = valid_config();
    std::fs::remove_file(&tls.cert).expect("remove the certificate");
    let (code, text) = check(&config);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("tls.cert") && text.contains("does not exist"), "{text}");
    let (code, text) = check_with(&config, &[("EDGE_INGEST__TLS__CERT", &dir.path().display().to_string())]);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("tls.cert") && text.contains("is not a regular file"), "a directory: {text}");
}

/// A CRL past its `nextUpdate` (rustls would refuse every device with it) or signed by another
/// CA parses, but is refused by `check-config` and by `run` as a configuration error naming the
/// file: exit 78, which systemd does not restart.
#[test]
fn a_crl_past_its_next_update_or_of_another_ca_is_a_configuration_error_naming_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = edge_transport::pki::InMemoryPki::generate(&["localhost"]).expect("pki");
    let tls = pki.write_server_files(&dir.path().join("tls")).expect("server files");
    let crl = dir.path().join("tls/revoked.pem");
    let config = dir.path().join("edge-ingest.toml");
    let body = format!(
        "[tls]\ncert = {:?}\nkey = {:?}\nclient_ca = {:?}\ncrls = [{:?}]\n[store]\ndata_dir = {:?}\n\
         [metrics]\nlisten = \"\"\n[server]\nlisten = \"127.0.0.1:0\"\n",
        tls.cert,
        tls.key,
        tls.client_ca,
        crl,
        dir.path().join("data")
    );
    std::fs::write(&config, body).expect("write config");
    let now = std::time::SystemTime::now();
    let day = std::time::Duration::from_secs(86_400);
    std::fs::write(&crl, pki.crl_pem_with_validity(&[], now, now + day).expect("crl")).expect("write crl");
    let (code, text) = check(&config);
    assert_eq!(code, 0, "a CRL valid for a day: {text}");

    std::fs::write(&crl, pki.crl_pem_with_validity(&[], now - 10 * day, now - 9 * day).expect("crl"))
        .expect("write crl");
    let (code, text) = check(&config);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("tls.crls") && text.contains(&crl.display().to_string()), "names the file: {text}");
    assert!(text.contains("expired"), "says why: {text}");
    let out = Command::new(BIN).args(["run", "--config"]).arg(&config).output().expect("run edge-ingest");
    let text = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(78), "run refuses to start: {text}");
    assert!(text.contains(&crl.display().to_string()), "names the file: {text}");

    let other = edge_transport::pki::InMemoryPki::generate(&["localhost"]).expect("another pki");
    std::fs::write(&crl, other.crl_pem(&[], now + day).expect("crl")).expect("write crl");
    let (code, text) = check(&config);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("not signed by a client CA"), "says why: {text}");
}
