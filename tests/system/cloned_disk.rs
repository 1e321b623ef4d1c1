//! A disk image copied to a second gateway after the agent ran on it: both gateways share the
//! device certificate and a copy of one spool file. Each gateway's own records must all be
//! stored; the copy takes a new spool id because its machine id differs.

use std::path::{Path, PathBuf};
use std::time::Duration;

use edge_testkit::{Daemon, bin, free_tcp_port};

use crate::common::{READY_TIMEOUT, World, json_output, readings, rewrite, wait_json};

const MACHINE_A: &str = "0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a0a";
const MACHINE_B: &str = "0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b0b";

/// `edge-uploader push` of `records` to `stream` through the agent of `config`.
fn push(config: &Path, dir: &Path, stream: &str, records: &[String]) -> anyhow::Result<()> {
    let input = dir.join(format!("{}.ndjson", records.first().map_or("none", |r| &r[..r.len().min(12)])));
    std::fs::write(&input, records.iter().map(|r| format!("{r}\n")).collect::<String>())?;
    let out = std::process::Command::new(bin("edge-uploader")?)
        .args(["push", "--stream", stream, &input.to_string_lossy(), "--config", &config.to_string_lossy()])
        .output()?;
    anyhow::ensure!(out.status.success(), "push to {stream}: {}", String::from_utf8_lossy(&out.stderr));
    Ok(())
}

fn status(config: &Path) -> anyhow::Result<(i32, serde_json::Value)> {
    json_output("edge-uploader", &["status", "--json", "--config", &config.to_string_lossy()])
}

fn drained(config: &Path, records: u64) -> anyhow::Result<serde_json::Value> {
    wait_json(
        "the spool drained",
        || status(config),
        |_, d| d["spool"]["total_bytes"] == 0 && d["upload"]["records_acked_total"] == records,
    )
}

/// Points the world's agent at a machine id file `name` in the world's directory, holding `id`.
fn set_machine_id(world: &World, name: &str, id: &str) -> anyhow::Result<()> {
    std::fs::write(world.path().join(name), format!("{id}\n"))?;
    rewrite(
        &world.agent_config,
        "linger = \"20ms\"\n",
        &format!("linger = \"20ms\"\nmachine_id_file = {:?}\n", world.path().join(name)),
    )
}

/// Copies the world's agent's spool (stopped) to a second gateway in `agent-b/`: a config of
/// its own with its own metrics port and the machine id file `machine_id_file`, the same
/// certificate. Returns the second gateway's config.
fn copy_to_second_gateway(world: &World, machine_id_file: &str) -> anyhow::Result<PathBuf> {
    let dir = world.path();
    std::fs::create_dir(dir.join("agent-b"))?;
    for f in std::fs::read_dir(dir.join("agent"))? {
        let f = f?.path();
        let name = f.file_name().unwrap_or_default().to_string_lossy().into_owned();
        if f.is_file() && name.starts_with("spool.db") && !name.ends_with("-lock") {
            std::fs::copy(&f, dir.join("agent-b").join(&name))?;
        }
    }
    let machine_id_a = format!("{:?}", dir.join("machine-id-a"));
    let config_b = dir.join("edge-uploader-b.toml");
    let text = std::fs::read_to_string(&world.agent_config)?
        .replace(&dir.join("agent/").to_string_lossy().into_owned(), &dir.join("agent-b/").to_string_lossy())
        .replace(&world.agent_metrics.to_string(), &format!("127.0.0.1:{}", free_tcp_port()?))
        .replace(&machine_id_a, &format!("{:?}", dir.join(machine_id_file)));
    std::fs::write(&config_b, text)?;
    Ok(config_b)
}

/// Starts the second gateway's agent and waits for READY.
fn start_second(world: &World, config_b: &Path) -> anyhow::Result<Daemon> {
    let cfg = config_b.to_string_lossy().into_owned();
    let mut agent = Daemon::spawn("agent-b", &bin("edge-uploader")?, &["run", "--config", &cfg], world.path(), &[])?;
    agent.wait_ready(READY_TIMEOUT)?;
    Ok(agent)
}

#[test]
fn a_spool_copied_to_another_machine_takes_a_new_id_and_no_record_of_either_machine_is_lost() -> anyhow::Result<()> {
    let world = World::new("gw-1", "")?;
    let dir = world.path();
    set_machine_id(&world, "machine-id-a", MACHINE_A)?;
    std::fs::write(dir.join("machine-id-b"), format!("{MACHINE_B}\n"))?;

    // The image's agent accepts records while no ingest is reachable, and stops.
    let mut agent = world.start_agent()?;
    let before = readings("before", 40);
    push(&world.agent_config, dir, "s", &before)?;
    assert!(agent.terminate(Duration::from_secs(30))?.success());

    // The disk is copied to a second gateway: the same certificate and spool, another machine id.
    let config_b = copy_to_second_gateway(&world, "machine-id-b")?;

    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let mut agent_b = start_second(&world, &config_b)?;
    agent_b.wait_log("a new spool id", Duration::from_secs(10))?;

    // Each gateway's records after the copy go to the same stream, numbered alike by both.
    let (after_a, after_b) = (readings("after-a", 30), readings("after-b", 30));
    push(&world.agent_config, dir, "s", &after_a)?;
    push(&config_b, dir, "s", &after_b)?;
    let doc_a = drained(&world.agent_config, 70)?;
    let doc_b = drained(&config_b, 70)?;

    // The copy names the machine and the spool it came from; the original names none.
    assert_eq!(doc_a["spool"]["copied_from"], serde_json::Value::Null, "{doc_a}");
    assert_eq!(doc_b["spool"]["copied_from"]["machine_id"], MACHINE_A, "{doc_b}");
    assert_eq!(doc_b["spool"]["copied_from"]["spool_id"], doc_a["spool"]["id"], "{doc_b}");
    assert_ne!(doc_b["spool"]["id"], doc_a["spool"]["id"], "{doc_b}");
    for d in [&doc_a, &doc_b] {
        assert_eq!(d["upload"]["superseded_total"], 0, "two spool ids: neither closes the other's connection: {d}");
    }
    let text = std::process::Command::new(bin("edge-uploader")?)
        .args(["status", "--config", &config_b.to_string_lossy()])
        .output()?;
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains(&format!("machine id {MACHINE_A}")), "{text}");

    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(agent_b.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    let stored: Vec<String> =
        world.export_raw("s")?.into_iter().map(|r| String::from_utf8_lossy(&r).into_owned()).collect();
    let times = |r: &String| stored.iter().filter(|s| *s == r).count();
    // Every record either gateway accepted after the copy is stored once; none was taken for
    // a resend of the other's.
    for r in after_a.iter().chain(&after_b) {
        assert_eq!(times(r), 1, "{r}: {} records stored", stored.len());
    }
    // Those the image held are stored by both: a duplicate at rest, never a loss.
    for r in &before {
        assert_eq!(times(r), 2, "{r}");
    }
    assert_eq!(stored.len(), 2 * before.len() + after_a.len() + after_b.len());
    Ok(())
}

/// The same copy on a gateway that also has the image's machine id: the spool cannot tell, and
/// the two agents share a spool id. The first agent's connection is closed for the second's
/// newer one, which it did not open: it says so (counted, degraded, logged) and gives its spool
/// a new id, after which the two no longer collide and every record of each is stored.
#[test]
fn an_agent_that_finds_another_with_its_spool_id_takes_a_new_one() -> anyhow::Result<()> {
    let world = World::new("gw-1", "")?;
    let dir = world.path();
    set_machine_id(&world, "machine-id-a", MACHINE_A)?;
    let mut agent = world.start_agent()?;
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    // The copy keeps the machine id file (and so the id).
    let config_b = copy_to_second_gateway(&world, "machine-id-a")?;

    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let first = wait_json(
        "the first agent connected",
        || status(&world.agent_config),
        |_, d| d["upload"]["connected"] == true,
    )?;
    let shared_id = first["spool"]["id"].clone();
    let mut agent_b = start_second(&world, &config_b)?;

    // The first agent's connection is closed for the second's: degraded, and a new id.
    let doc_a = wait_json(
        "the first agent sees the second and takes a new id",
        || status(&world.agent_config),
        |code, d| {
            code == 1
                && d["upload"]["connected"] == true
                && d["upload"]["superseded_total"] == 1
                && d["degraded_reasons"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r.as_str().is_some_and(|r| r.contains("another gateway used"))))
        },
    )?;
    assert_eq!(doc_a["upload"]["spool_rekeyed"]["old_id"], shared_id, "{doc_a}");
    assert_ne!(doc_a["spool"]["id"], shared_id, "{doc_a}");
    agent.wait_log("this spool has a new id from now on", Duration::from_secs(10))?;
    let metrics = crate::common::World::scrape(world.agent_metrics)?;
    assert_eq!(metrics.get("edge_uploader_connections_superseded_total"), Some(&1.0), "{metrics:?}");

    // From then on the two gateways' records no longer collide.
    let (after_a, after_b) = (readings("after-a", 30), readings("after-b", 30));
    push(&world.agent_config, dir, "s", &after_a)?;
    push(&config_b, dir, "s", &after_b)?;
    let doc_a = drained(&world.agent_config, 30)?;
    let doc_b = drained(&config_b, 30)?;
    assert_eq!(doc_b["spool"]["id"], shared_id, "the second keeps the id: {doc_b}");
    assert_eq!(doc_b["upload"]["superseded_total"], 0, "nothing closed the second one's connection: {doc_b}");
    assert_eq!(doc_a["upload"]["superseded_total"], 1, "once: {doc_a}");
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(agent_b.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    let stored: Vec<String> =
        world.export_raw("s")?.into_iter().map(|r| String::from_utf8_lossy(&r).into_owned()).collect();
    for r in after_a.iter().chain(&after_b) {
        assert_eq!(stored.iter().filter(|s| *s == r).count(), 1, "{r}: {} records stored", stored.len());
    }
    assert_eq!(stored.len(), after_a.len() + after_b.len());
    Ok(())
}
