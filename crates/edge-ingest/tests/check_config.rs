//! `edge-ingest check-config`: the TLS files are read and parsed as `run` reads them, so a key
//! that does not load is a configuration error (exit 78, which systemd does not restart),
//! naming the file.

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_edge-ingest");

fn check(config: &std::path::Path) -> (i32, String) {
    let out = Command::new(BIN).args(["check-config", "--config"]).arg(config).output().expect("run edge-ingest");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

#[test]
fn a_server_key_that_does_not_load_is_a_configuration_error_naming_the_file() {
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
    let (code, text) = check(&config);
    assert_eq!(code, 0, "the config as written is valid: {text}");

    std::fs::write(&tls.key, "not a private key\n").expect("spoil the key");
    let (code, text) = check(&config);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains(&tls.key.display().to_string()), "names the key file: {text}");
}
