//! The operator's commands against real daemons: `edge-uploader status` (text, `--json`, exit
//! codes 0 healthy / 1 degraded / 3 not running / 4 unknown, degraded when the agent accepts but
//! cannot answer on its socket, with its state from the metrics listener, and never "not
//! running" for a user the socket is closed to) and `edge-uploader push`; the cipher suite
//! order the agent logs when it starts; and a second agent refused the spool the first one has.

use std::process::{Command, Output};
use std::time::Duration;

use anyhow::Context;
use edge_testkit::{Daemon, bin};

use crate::common::{READY_TIMEOUT, World, free_tcp_port, json_output, rewrite, status_json, wait_json};

fn uploader(world: &World, args: &[&str]) -> anyhow::Result<Output> {
    let cfg = world.agent_config.to_string_lossy().into_owned();
    let mut all = args.to_vec();
    all.extend(["--config", &cfg]);
    Ok(Command::new(bin("edge-uploader")?).args(&all).env("NO_COLOR", "1").output()?)
}

fn wait_status(
    world: &World,
    what: &str,
    pred: impl Fn(i32, &serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    wait_json(what, || status_json(world), pred)
}

#[test]
fn status_reports_not_running_degraded_and_healthy_with_its_exit_codes() -> anyhow::Result<()> {
    let world = World::new("gw-cli-01", "")?;

    // No agent: exit 3, in text and in JSON.
    let out = uploader(&world, &["status"])?;
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not running"));
    let (code, doc) = status_json(&world)?;
    assert_eq!((code, &doc["running"]), (3, &serde_json::Value::Bool(false)), "{doc}");

    // Agent without a server: running but disconnected, so degraded (exit 1).
    let mut agent = world.start_agent()?;
    let (code, doc) = status_json(&world)?;
    assert_eq!(code, 1, "{doc}");
    assert_eq!(doc["version"], 1);
    assert_eq!(doc["upload"]["connected"], false);
    assert!(doc["connection"]["server"].as_str().is_some_and(|s| s.starts_with("127.0.0.1:")), "{doc}");
    assert!(doc["connection"]["remote"].is_null(), "{doc}");
    assert!(doc["degraded_reasons"][0].as_str().is_some_and(|r| r.contains("not connected")), "{doc}");

    // Environment overrides apply to `status` as they do to the agent: pointed at another socket
    // and no metrics listener, it finds no agent there.
    let cfg = world.agent_config.to_string_lossy().into_owned();
    let out = Command::new(bin("edge-uploader")?)
        .args(["status", "--config", &cfg])
        .env("EDGE_UPLOADER__INTAKE__SOCKET", world.path().join("nowhere.sock"))
        .env("EDGE_UPLOADER__METRICS__LISTEN", "")
        .output()?;
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("nowhere.sock"), "{}", String::from_utf8_lossy(&out.stderr));

    // The agent logs the cipher suites it offers, first the one this CPU is fastest at.
    agent.wait_log("TLS 1.3 cipher suites offered in this order", Duration::from_secs(10))?;
    let first = edge_transport::cipher_suite_preference(edge_transport::cpu_has_aes_instructions())[0];
    let log = std::fs::read_to_string(agent.log_path())?;
    assert!(
        log.lines().any(|l| l.contains("cipher suites offered") && l.contains(&format!("suites=[{first:?},"))),
        "{}",
        agent.tail_log()
    );

    // Data pushed while disconnected waits in the spool and shows up per stream.
    let input = world.path().join("readings.ndjson");
    std::fs::write(&input, "{\"t\":1}\n{\"t\":2}\n{\"t\":3}\n")?;
    let out = uploader(&world, &["push", "--stream", "temperature", &input.to_string_lossy()])?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("accepted 3 records"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    // No uploader can send them, so they are not sealed into a chunk yet (a producer this slow
    // would otherwise make one chunk per `linger`).
    let doc = wait_status(&world, "the pushed records in the spool", |_, d| d["spool"]["open_records"] == 3)?;
    assert_eq!(doc["spool"]["sealed_chunks"], 0, "{doc}");
    assert_eq!(doc["spool"]["streams"][0]["name"], "temperature", "{doc}");
    let text = uploader(&world, &["status"])?;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("0 sealed chunks, 3 records not sealed yet"), "{text}");
    assert!(text.contains("reconnecting: ") && text.contains(" attempts, "), "{text}");

    // With the server up, the backlog drains and the agent is healthy (exit 0). Drained means
    // nothing left in the spool at all: right after connecting, before the new connection seals
    // them, the records are still open and there are no sealed chunks either.
    let mut ingest = world.start_ingest()?;
    let doc = wait_status(&world, "healthy and drained", |code, d| {
        code == 0 && d["spool"]["total_bytes"] == 0 && d["upload"]["records_acked_total"] == 3
    })?;
    assert_eq!(doc["upload"]["records_acked_total"], 3, "{doc}");
    assert!(doc["connection"]["remote"].as_str().is_some_and(|s| s.starts_with("127.0.0.1:")), "{doc}");
    assert!(doc["connection"]["since_ms"].as_u64().is_some(), "{doc}");
    let text = uploader(&world, &["status"])?;
    assert_eq!(text.status.code(), Some(0));
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("healthy") && text.contains("temperature") && !text.contains('\x1b'), "{text}");
    assert!(text.contains("connection: connected to 127.0.0.1:"), "{text}");
    assert!(!text.contains("reconnecting:"), "{text}");

    // A bad stream name is refused before anything is sent, naming it.
    let out = uploader(&world, &["push", "--stream", "bad name", &input.to_string_lossy()])?;
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("\"bad name\""), "{}", String::from_utf8_lossy(&out.stderr));

    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    assert_eq!(
        world.export_raw("temperature")?,
        vec![b"{\"t\":1}".to_vec(), b"{\"t\":2}".to_vec(), b"{\"t\":3}".to_vec()]
    );
    Ok(())
}

#[test]
fn status_of_an_agent_with_every_connection_slot_taken_is_degraded_not_not_running() -> anyhow::Result<()> {
    let world = World::new("gw-cli-02", "")?;
    rewrite(&world.agent_config, "[intake]\n", "[intake]\nmax_connections = 1\n")?;
    let mut agent = world.start_agent()?;

    // A producer that connects and sends nothing takes the only slot (for up to
    // intake.request_idle_timeout, 30 s), so the agent accepts status's connection but serves
    // it only once that one closes.
    let quiet = std::os::unix::net::UnixStream::connect(world.intake_socket())?;
    // The metrics listener the config names is outside the limit: status shows the agent's
    // own document from there, degraded by the socket's silence.
    let out = uploader(&world, &["status"])?;
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
    assert!(stdout.contains("degraded") && stdout.contains("intake.max_connections"), "{stdout}");
    assert!(stdout.contains("from the metrics listener") && stdout.contains("connection:"), "{stdout}");
    let (code, doc) = status_json(&world)?;
    assert_eq!(code, 1, "{doc}");
    assert_eq!(
        (&doc["version"], &doc["intake_socket_answered"], &doc["healthy"]),
        (&1.into(), &false.into(), &false.into()),
        "{doc}"
    );
    assert!(doc["spool"].is_object() && doc["answered_on"].is_string(), "{doc}");
    assert!(doc["degraded_reasons"][0].as_str().is_some_and(|r| r.contains("did not answer within 5s")), "{doc}");
    // Asked on a socket given by hand, status knows no metrics listener for it: the agent
    // accepts but does not answer, which is degraded, not "not running".
    let socket = world.intake_socket().to_string_lossy().into_owned();
    let out = uploader(&world, &["status", "--socket", &socket])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("degraded") && stderr.contains("intake.max_connections"), "{stderr}");
    assert!(!stderr.contains("not running"), "{stderr}");
    let (code, doc) = json_output("edge-uploader", &["status", "--json", "--socket", &socket])?;
    assert_eq!(code, 1, "{doc}");
    assert_eq!(
        (&doc["running"], &doc["answered"], &doc["healthy"]),
        (&true.into(), &false.into(), &false.into()),
        "{doc}"
    );
    assert!(doc["degraded_reasons"][0].as_str().is_some_and(|r| r.contains("did not answer within 5s")), "{doc}");

    // Once the producer closes, the connections status gave up on are served and closed in
    // turn, and the next one gets the agent's own answer (degraded: it has no server).
    drop(quiet);
    let doc = wait_status(&world, "an answer", |_, d| d.get("answered").is_none() && d.get("spool").is_some())?;
    assert_eq!(doc["version"], 1, "{doc}");
    assert!(doc["degraded_reasons"][0].as_str().is_some_and(|r| r.contains("not connected")), "{doc}");
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    Ok(())
}

/// `edge-uploader status args...` as an operator who may not open the agent's socket, with a
/// copy of the agent's config that operator can read in `config_dir`. As root (which no
/// permission stops), the command runs as nobody (65534), who cannot enter the world's 0700
/// directory; otherwise the socket's mode is 000 for the run.
fn uploader_without_socket_access(
    world: &World,
    config_dir: &std::path::Path,
    args: &[&str],
) -> anyhow::Result<Output> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::os::unix::process::CommandExt;
    let cfg = config_dir.join("edge-uploader.toml");
    std::fs::copy(&world.agent_config, &cfg)?;
    std::fs::set_permissions(config_dir, std::fs::Permissions::from_mode(0o755))?;
    std::fs::set_permissions(&cfg, std::fs::Permissions::from_mode(0o644))?;
    let cfg = cfg.to_string_lossy().into_owned();
    let mut all = args.to_vec();
    all.extend(["--config", &cfg]);
    let mut cmd = Command::new(bin("edge-uploader")?);
    cmd.args(&all).env("NO_COLOR", "1");
    let socket = world.intake_socket();
    let root = std::fs::metadata(world.path())?.uid() == 0;
    let mode = std::fs::metadata(&socket)?.permissions();
    if root {
        cmd.uid(65534).gid(65534);
    } else {
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o000))?;
    }
    let out = cmd.output();
    if !root {
        std::fs::set_permissions(&socket, mode)?;
    }
    Ok(out?)
}

#[test]
fn status_for_a_user_the_socket_is_closed_to_says_permission_denied_never_not_running() -> anyhow::Result<()> {
    let world = World::new("gw-cli-03", "")?;
    let config_dir = tempfile::Builder::new().prefix("edge-status-cfg-").tempdir()?;
    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    wait_status(&world, "the agent healthy", |code, d| code == 0 && d["upload"]["connected"] == true)?;
    let socket = world.intake_socket().to_string_lossy().into_owned();
    let denied = format!("permission denied on {socket}: run as root or as a member of the group that owns it");

    // The config names the metrics listener, which needs no permission on the socket: the
    // agent's own state from there, healthy, with the socket's refusal as a note, not a reason.
    let out = uploader_without_socket_access(&world, config_dir.path(), &["status"])?;
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0), "{stdout}{stderr}");
    assert!(stdout.starts_with("edge-uploader: healthy\n"), "{stdout}");
    assert!(
        stdout
            .contains(&format!("  note: {denied}; this status came from the metrics listener {}", world.agent_metrics)),
        "{stdout}"
    );
    assert!(!stdout.contains("not running") && !stderr.contains("not running"), "{stdout}{stderr}");
    let out = uploader_without_socket_access(&world, config_dir.path(), &["status", "--json"])?;
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(0), "{doc}");
    assert_eq!(
        (&doc["healthy"], &doc["intake_socket_answered"], &doc["intake_socket_error"]),
        (&true.into(), &false.into(), &denied.clone().into()),
        "{doc}"
    );
    assert_eq!(doc["answered_on"], world.agent_metrics.to_string(), "{doc}");
    assert_eq!(doc["degraded_reasons"], serde_json::json!([]), "{doc}");

    // With the socket given by hand there is no metrics listener to ask: unknown (exit 4),
    // not "not running".
    let out = uploader_without_socket_access(&world, config_dir.path(), &["status", "--socket", &socket])?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert_eq!(stderr.trim_end(), format!("edge-uploader: status unknown: {denied}"));
    let out = uploader_without_socket_access(&world, config_dir.path(), &["status", "--json", "--socket", &socket])?;
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    assert_eq!(out.status.code(), Some(4), "{doc}");
    assert_eq!((&doc["running"], &doc["error"]), (&serde_json::Value::Null, &denied.into()), "{doc}");

    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    Ok(())
}

#[test]
fn a_second_agent_on_the_same_spool_is_refused_naming_the_first_which_goes_on() -> anyhow::Result<()> {
    let world = World::new("gw-cli-05", "")?;
    let mut first = world.start_agent()?;
    let pid = first.pid().context("first agent's pid")?;
    crate::common::push(&world, "temperature", &crate::common::readings("temperature", 3))?;
    wait_status(&world, "the pushed records in the spool", |_, d| d["spool"]["open_records"] == 3)?;

    // Another config naming the same spool, with its own socket and metrics port, as an
    // operator's `edge-uploader run` by hand next to the service would.
    let second = world.path().join("second.toml");
    std::fs::copy(&world.agent_config, &second)?;
    rewrite(&second, "agent/intake.sock", "second.sock")?;
    rewrite(&second, &world.agent_metrics.to_string(), &format!("127.0.0.1:{}", free_tcp_port()?))?;
    let cfg = second.to_string_lossy().into_owned();
    let mut other = Daemon::spawn("agent2", &bin("edge-uploader")?, &["run", "--config", &cfg], world.path(), &[])?;
    let refused = other.wait_ready(READY_TIMEOUT).expect_err("a second writer of the spool must not start");
    let log = std::fs::read_to_string(other.log_path())?;
    assert!(log.contains(&format!("is in use by process {pid}")), "{refused:#}");
    assert!(!world.path().join("second.sock").exists(), "{log}");

    // The first agent never noticed: what it holds is delivered, once.
    let mut ingest = world.start_ingest()?;
    wait_status(&world, "drained", |code, d| code == 0 && d["upload"]["records_acked_total"] == 3)?;
    assert!(first.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    let want: Vec<Vec<u8>> = crate::common::readings("temperature", 3).into_iter().map(String::into_bytes).collect();
    assert_eq!(world.export_raw("temperature")?, want);
    Ok(())
}
