//! `edge-ingest status` against a real server: exit 3 and `"running": false` when nothing
//! answers, exit 0 with no devices when idle, and a connected agent listed with what it stored;
//! and exit 1 (degraded) for a server that accepts the connection and never answers.

use std::process::{Command, Output};
use std::time::Duration;

use edge_testkit::bin;

use crate::common::{World, json_output, wait_json};

const DEVICE: &str = "gw-istatus-01";

fn ingest_status(world: &World, args: &[&str]) -> anyhow::Result<Output> {
    let cfg = world.ingest_config.to_string_lossy().into_owned();
    let mut all = vec!["status", "--config", &cfg];
    all.extend(args);
    Ok(Command::new(bin("edge-ingest")?).args(&all).env("NO_COLOR", "1").output()?)
}

fn status_json(world: &World) -> anyhow::Result<(i32, serde_json::Value)> {
    let cfg = world.ingest_config.to_string_lossy().into_owned();
    json_output("edge-ingest", &["status", "--config", &cfg, "--json"])
}

fn wait_status(
    world: &World,
    what: &str,
    pred: impl Fn(i32, &serde_json::Value) -> bool,
) -> anyhow::Result<serde_json::Value> {
    wait_json(what, || status_json(world), pred)
}

#[test]
fn ingest_status_shows_not_running_idle_and_a_connected_device() -> anyhow::Result<()> {
    let world = World::new(DEVICE, "")?;

    // Nothing listens on the configured metrics address: exit 3, in text and in JSON.
    let out = ingest_status(&world, &[])?;
    assert_eq!(out.status.code(), Some(3), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not running"));
    let (code, doc) = status_json(&world)?;
    assert_eq!((code, &doc["running"]), (3, &serde_json::Value::Bool(false)), "{doc}");
    assert_eq!(doc["addr"], world.ingest_metrics.to_string(), "the address comes from the config: {doc}");

    // Running, no agent: healthy, no devices.
    let mut ingest = world.start_ingest()?;
    let (code, doc) = status_json(&world)?;
    assert_eq!(code, 0, "{doc}");
    assert_eq!(doc["version"], 1);
    assert_eq!(doc["running"], true);
    assert_eq!(doc["connections"], 0, "{doc}");
    assert_eq!(doc["devices"], serde_json::json!([]), "{doc}");
    assert_eq!(doc["sink"]["healthy"], true, "{doc}");
    assert_eq!(doc["healthy"], true, "{doc}");
    // `--addr` wins over the config.
    let addr = world.ingest_metrics.to_string();
    let out = Command::new(bin("edge-ingest")?).args(["status", "--json", "--addr", &addr]).output()?;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));

    // An agent connects and uploads three records: it is listed with what it stored.
    let mut agent = world.start_agent()?;
    let input = world.path().join("readings.ndjson");
    std::fs::write(&input, "{\"t\":1}\n{\"t\":2}\n{\"t\":3}\n")?;
    let cfg = world.agent_config.to_string_lossy().into_owned();
    let out = Command::new(bin("edge-uploader")?)
        .args(["push", "--stream", "temperature", "--config", &cfg, &input.to_string_lossy()])
        .output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let doc = wait_status(&world, "the device with its three records", |code, d| {
        code == 0 && d["totals"]["records"] == 3 && d["devices"][0]["records_stored"] == 3
    })?;
    assert_eq!(doc["connections"], 1, "{doc}");
    let dev = &doc["devices"][0];
    assert_eq!(dev["device"], DEVICE, "{doc}");
    assert_eq!(dev["connections"], 1, "{doc}");
    assert_eq!(dev["chunks_stored"], doc["totals"]["stored"], "{doc}");
    assert!(doc["totals"]["stored"].as_u64().is_some_and(|n| n >= 1), "{doc}");
    assert_eq!(doc["sink"]["chunks"], doc["totals"]["stored"], "a fresh store holds exactly what was stored: {doc}");
    assert!(dev["remote"].as_str().is_some_and(|r| r.starts_with("127.0.0.1:")), "{doc}");
    assert!(dev["since_ms"].as_u64().is_some_and(|ms| ms > 0), "{doc}");
    assert!(doc["rates"]["records_per_s"].as_f64().is_some_and(|r| r > 0.0), "{doc}");

    let out = ingest_status(&world, &[])?;
    assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("healthy") && text.contains(DEVICE) && !text.contains('\x1b'), "{text}");

    // The device leaves the list when its connection ends.
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    wait_status(&world, "no devices once the agent stopped", |code, d| {
        code == 0 && d["devices"] == serde_json::json!([]) && d["connections"] == 0
    })?;
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    Ok(())
}

#[test]
fn ingest_status_of_a_server_that_accepts_and_never_answers_is_degraded() -> anyhow::Result<()> {
    // A hung server: the kernel completes the connection into the listen backlog, and nothing
    // answers. The listener stays open (and unaccepted) until the end of the test.
    let hung = std::net::TcpListener::bind("127.0.0.1:0")?;
    let addr = hung.local_addr()?.to_string();
    let out = Command::new(bin("edge-ingest")?).args(["status", "--addr", &addr]).env("NO_COLOR", "1").output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(
        stderr,
        format!(
            "edge-ingest: degraded\n  ! the server on {addr} accepted the connection but did not answer within 5s: it may \
             be stuck\n"
        )
    );
    let (code, doc) = json_output("edge-ingest", &["status", "--json", "--addr", &addr])?;
    assert_eq!(code, 1, "{doc}");
    assert_eq!(
        (&doc["running"], &doc["answered"], &doc["healthy"]),
        (&true.into(), &false.into(), &false.into()),
        "{doc}"
    );
    assert!(doc["degraded_reasons"][0].as_str().is_some_and(|r| r.contains("did not answer within 5s")), "{doc}");
    drop(hung);
    Ok(())
}
