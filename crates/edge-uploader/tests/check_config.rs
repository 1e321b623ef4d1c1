//! `edge-uploader check-config`: exit 0 on a valid file, 78 on a broken one, and the message
//! names the offending key (and the file and line where the parser knows them).

use std::path::Path;
use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_edge-uploader");

struct Files {
    dir: tempfile::TempDir,
    tls: String,
}

fn files() -> Files {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = edge_transport::pki::InMemoryPki::generate(&["localhost"]).expect("pki");
    let dev = pki.write_device_files("cfg-test", &dir.path().join("tls")).expect("device files");
    let tls = format!("ca = {:?}\ncert = {:?}\nkey = {:?}\n", dev.ca_cert, dev.cert, dev.key);
    Files { dir, tls }
}

fn check(path: &Path, envs: &[(&str, &str)]) -> (i32, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(["check-config", "--config"]).arg(path);
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run edge-uploader");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.code().unwrap_or(-1), text)
}

fn write(f: &Files, name: &str, body: &str) -> std::path::PathBuf {
    let p = f.dir.path().join(name);
    std::fs::write(&p, body).expect("write config");
    p
}

#[test]
fn a_valid_config_passes_with_exit_0() {
    let f = files();
    let p = write(&f, "ok.toml", &format!("[upload]\nserver = \"ingest.example.com:4433\"\n{}", f.tls));
    let (code, text) = check(&p, &[]);
    assert_eq!(code, 0, "{text}");
    assert!(text.contains("config ok"), "{text}");
}

#[test]
fn broken_configs_exit_78_and_name_the_key() {
    let f = files();
    let cases: [(&str, String, &[&str]); 21] = [
        ("no streams", format!("[spool]\nmax_streams = 0\n[upload]\n{}", f.tls), &["spool.max_streams", "got 0"]),
        ("unknown key", format!("[spool]\nmax_byte = \"1GiB\"\n[upload]\n{}", f.tls), &["max_byte", "line 2"]),
        ("wrong type", format!("[upload]\nmax_in_flight = \"lots\"\n{}", f.tls), &["max_in_flight", "line 2"]),
        ("bad duration", format!("[spool]\nlinger = \"soon\"\n[upload]\n{}", f.tls), &["linger", "soon"]),
        (
            "missing certificate file",
            format!("[upload]\n{}", f.tls.replace("device.pem", "missing.pem")),
            &["upload.cert", "missing.pem"],
        ),
        ("bad address", format!("[intake]\ntcp = \"localhost:http\"\n[upload]\n{}", f.tls), &["intake.tcp"]),
        ("bad server", format!("[upload]\nserver = \"no-port\"\n{}", f.tls), &["upload.server"]),
        (
            "bad server beside a server name",
            format!("[upload]\nserver = \"ingest.example.com\"\nserver_name = \"ingest.example.com\"\n{}", f.tls),
            &["upload.server: expected host:port"],
        ),
        (
            "server name that no certificate can carry",
            format!("[upload]\nserver_name = \"not a name\"\n{}", f.tls),
            &["upload.server_name", "\"not a name\""],
        ),
        (
            "record-stream gathering below its floor",
            format!("[intake]\nstream_pending_bytes = \"1KiB\"\n[upload]\n{}", f.tls),
            &["intake.stream_pending_bytes", "4 KiB", "1.0 KiB"],
        ),
        (
            "record-stream budget below one connection's gathering",
            format!("[intake]\nstream_pending_total_bytes = \"512KiB\"\n[upload]\n{}", f.tls),
            &["intake.stream_pending_total_bytes", "intake.stream_pending_bytes (1.0 MiB)", "512.0 KiB"],
        ),
        (
            "HTTP request budget below its floor",
            format!("[intake]\nrequest_pending_total_bytes = \"1KiB\"\n[upload]\n{}", f.tls),
            &["intake.request_pending_total_bytes", "64 KiB..=1 GiB", "1.0 KiB"],
        ),
        (
            "zero idle timeout",
            format!("[intake]\nrequest_idle_timeout = \"0s\"\n[upload]\n{}", f.tls),
            &["intake.request_idle_timeout", "1s..=1h", "0s"],
        ),
        (
            "no connections",
            format!("[intake]\nmax_connections = 0\n[upload]\n{}", f.tls),
            &["intake.max_connections", "1..=16384", "got 0"],
        ),
        (
            "more connections than the unit's descriptors allow",
            format!("[intake]\nmax_connections = 20000\n[upload]\n{}", f.tls),
            &["intake.max_connections", "1..=16384", "got 20000", "65536"],
        ),
        (
            "request limit below the record limit",
            format!("[intake]\nmax_record_bytes = \"2MiB\"\nmax_request_bytes = \"1MiB\"\n[upload]\n{}", f.tls),
            &["intake.max_request_bytes (1.0 MiB)", "intake.max_record_bytes (2.0 MiB)"],
        ),
        (
            "chunks that could pass the ingest's record limit",
            format!("[spool]\nchunk_target = \"8MiB\"\n[upload]\n{}", f.tls),
            &["spool.chunk_target", "1 B..=4 MiB", "8.0 MiB"],
        ),
        (
            "zero byte budget",
            format!("[upload]\nmax_in_flight_bytes = \"0B\"\n{}", f.tls),
            &["upload.max_in_flight_bytes"],
        ),
        ("zero connect timeout", format!("[upload]\nconnect_timeout = \"0s\"\n{}", f.tls), &["upload.connect_timeout"]),
        (
            "probe interval below a second",
            format!("[upload]\nprobe_interval = \"200ms\"\n{}", f.tls),
            &["upload.probe_interval", "200ms", "\"0s\""],
        ),
        (
            "unknown congestion controller",
            format!("[upload]\ncongestion_controller = \"reno\"\n{}", f.tls),
            &["upload.congestion_controller", "reno", "bbr"],
        ),
    ];
    for (what, body, needles) in cases {
        let p = write(&f, "broken.toml", &body);
        let (code, text) = check(&p, &[]);
        assert_eq!(code, 78, "{what}: {text}");
        for n in needles {
            assert!(text.contains(n), "{what}: message does not mention {n:?}: {text}");
        }
        assert!(text.contains("broken.toml"), "{what}: does not name the file: {text}");
    }
}

#[test]
fn a_missing_config_file_named_explicitly_is_an_error() {
    let (code, text) = check(Path::new("/nonexistent/edge-uploader.toml"), &[]);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("/nonexistent/edge-uploader.toml"), "{text}");
}

#[test]
fn environment_overrides_apply_and_are_validated() {
    let f = files();
    let p = write(&f, "ok.toml", &format!("[upload]\n{}", f.tls));
    let (code, text) = check(&p, &[("EDGE_UPLOADER__SPOOL__FULL_POLICY", "drop_oldest")]);
    assert_eq!(code, 0, "{text}");
    let (code, text) = check(&p, &[("EDGE_UPLOADER__SPOOL__FULL_POLICY", "keep_everything")]);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("spool.full_policy"), "{text}");
    // A value that does not parse is blamed on the variable, not on the file, which is fine.
    let (code, text) = check(&p, &[("EDGE_UPLOADER__SPOOL__MAX_BYTES", "lots")]);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains("environment overrides (EDGE_UPLOADER__SPOOL__MAX_BYTES)"), "{text}");
    assert!(!text.contains("ok.toml"), "{text}");
}

/// The TLS files are read and parsed as `run` reads them: a key that is not one (or one the
/// account cannot read) is a configuration error, exit 78, naming the file, not a failure at
/// start that systemd would restart for ever.
#[test]
fn tls_files_that_do_not_load_are_a_configuration_error_naming_the_file() {
    let f = files();
    let key = f.dir.path().join("tls").join("device.key");
    std::fs::write(&key, "not a private key\n").expect("spoil the key");
    let p = write(&f, "badkey.toml", &format!("[upload]\n{}", f.tls));
    let (code, text) = check(&p, &[]);
    assert_eq!(code, 78, "{text}");
    assert!(text.contains(&key.display().to_string()), "names the key file: {text}");
}
