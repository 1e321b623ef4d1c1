//! SIGHUP reloads what can change at run time; an invalid new file is refused and the running
//! configuration stays in force, on both daemons. A device certificate renewed on disk is used
//! from the agent's next connection, without a restart or a reload.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use edge_testkit::bin;
use edge_transport::pki::InMemoryPki;

use crate::common::{World, push, readings, status_json, wait_json};

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

    // A file that parses, with device TLS files that do not load: refused as a whole, the
    // change beside them too.
    let bad_key = world.path().join("not-a-key.pem");
    std::fs::write(&bad_key, "not a private key\n")?;
    let key_line =
        changed.lines().skip_while(|l| *l != "[upload]").find(|l| l.starts_with("key = ")).context("upload.key")?;
    let tls_broken =
        changed.replace(key_line, &format!("key = {bad_key:?}")).replace("max_in_flight = 8", "max_in_flight = 4");
    std::fs::write(&world.agent_config, &tls_broken)?;
    agent.signal("HUP")?;
    agent.wait_log("the device TLS files do not load", Duration::from_secs(30))?;
    let still = settings(&world)?;
    assert_eq!(still, after, "settings changed although the reload was refused for its TLS files");

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

/// Replaces `path` as provisioning tools do: a new file renamed over the old one.
fn replace(path: &Path, text: &str) -> anyhow::Result<()> {
    let tmp = path.with_extension("renewed");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

#[test]
fn a_device_certificate_renewed_on_disk_is_used_from_the_next_connection_without_a_restart() -> anyhow::Result<()> {
    let device = "gw-renew-01";
    let world = World::new(device, "")?;
    // The world's files from a CA whose key the test keeps, the device's certificate ending
    // in 15 s.
    let pki = InMemoryPki::generate(&["localhost", "127.0.0.1"])?;
    let server_dir = world.pki.server.cert.parent().expect("server dir");
    pki.write_server_files(server_dir)?;
    let files = world.pki.devices[0].1.clone();
    let now = SystemTime::now();
    let expiry = now + Duration::from_secs(15);
    let (cert, key) = pki.issue_device_with_validity(device, now - Duration::from_secs(3600), expiry)?;
    replace(&files.cert, &cert)?;
    replace(&files.key, &key)?;
    replace(&files.ca, &pki.ca_pem)?;

    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let first = readings("renewal", 6);
    push(&world, "renewal", &first[..3])?;
    wait_json("the first records acked", || status_json(&world), |_, d| d["upload"]["records_acked_total"] == 3)?;

    // The ingest goes away and the certificate expires meanwhile (X.509 times have whole
    // seconds; the end is a time on the clock, not an event).
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    let left = expiry.duration_since(SystemTime::now()).unwrap_or_default();
    std::thread::sleep(left + Duration::from_millis(1100));
    // Renewed on disk, as a provisioning tool does it; the agent is neither restarted nor told.
    let (cert, key) = pki.issue_device(device)?;
    replace(&files.cert, &cert)?;
    replace(&files.key, &key)?;

    let mut ingest = world.start_ingest()?;
    push(&world, "renewal", &first[3..])?;
    wait_json(
        "every record acked over a connection with the renewed certificate",
        || status_json(&world),
        |_, d| d["upload"]["records_acked_total"] == 6,
    )?;
    agent.wait_log("device TLS files read", Duration::from_secs(5))?;
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    let want: Vec<Vec<u8>> = first.into_iter().map(String::into_bytes).collect();
    assert_eq!(world.export_raw("renewal")?, want);
    Ok(())
}
