//! SIGHUP reloads what can change at run time; an invalid new file is refused and the running
//! configuration stays in force, on both daemons.

use std::process::Command;
use std::time::{Duration, Instant};

use edge_testkit::bin;

use crate::common::World;

fn settings(world: &World) -> anyhow::Result<serde_json::Value> {
    // By socket, not by config: the test breaks the config file on purpose.
    let socket = world.intake_socket().to_string_lossy().into_owned();
    let out = Command::new(bin("edge-uploader")?).args(["status", "--json", "--socket", &socket]).output()?;
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(doc["settings"].clone())
}

#[test]
fn sighup_applies_a_valid_config_and_refuses_a_broken_one() -> anyhow::Result<()> {
    let world = World::new("gw-reload-01", "max_in_flight = 32\n")?;
    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let before = settings(&world)?;
    assert_eq!(before["max_in_flight"], 32, "{before}");
    assert_eq!(before["spool_max_bytes"], 4u64 << 30, "{before}");

    // A valid change: applied without a restart.
    let original = std::fs::read_to_string(&world.agent_config)?;
    let changed = original
        .replace(
            "max_in_flight = 32",
            "max_in_flight = 8\nmax_in_flight_bytes = \"1MiB\"\ncongestion_controller = \"bbr\"",
        )
        .replace("max_bytes = \"4GiB\"", "max_bytes = \"2GiB\"\nfull_policy = \"drop_oldest\"");
    std::fs::write(&world.agent_config, &changed)?;
    agent.signal("HUP")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    let after = loop {
        let s = settings(&world)?;
        if s["max_in_flight"] == 8 {
            break s;
        }
        anyhow::ensure!(Instant::now() < deadline, "reload not applied: {s}");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(after["max_in_flight_bytes"], 1u64 << 20, "{after}");
    assert_eq!(after["spool_max_bytes"], 2u64 << 30, "{after}");
    assert_eq!(after["spool_full_policy"], "drop_oldest", "{after}");
    // A key that needs a restart is named in the warning that says so.
    agent.wait_log("upload.congestion_controller", Duration::from_secs(30))?;
    agent.wait_log("take effect at the next restart", Duration::from_secs(30))?;

    // A broken file: refused, logged, the daemon keeps running with what it had.
    std::fs::write(&world.agent_config, format!("{changed}\n[spool]\nmax_byte = \"1GiB\"\n"))?;
    agent.signal("HUP")?;
    agent.wait_log("configuration reload refused", Duration::from_secs(30))?;
    let still = settings(&world)?;
    assert_eq!(still, after, "settings changed although the reload was refused");

    // The ingest server survives SIGHUP too (valid, then broken).
    ingest.signal("HUP")?;
    ingest.wait_log("configuration reloaded", Duration::from_secs(30))?;
    let ingest_cfg = std::fs::read_to_string(&world.ingest_config)?;
    std::fs::write(&world.ingest_config, format!("{ingest_cfg}\n[store]\nsegment_max = 1\n"))?;
    ingest.signal("HUP")?;
    ingest.wait_log("configuration reload refused", Duration::from_secs(30))?;

    // Both still serve: restore the agent's file so its shutdown is clean, and stop both politely.
    std::fs::write(&world.agent_config, &changed)?;
    assert!(agent.terminate(Duration::from_secs(30))?.success(), "agent died after the refused reload");
    assert!(ingest.terminate(Duration::from_secs(30))?.success(), "ingest died after the refused reload");
    Ok(())
}
