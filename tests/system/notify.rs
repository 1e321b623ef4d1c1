//! systemd readiness protocol: both daemons, run with `NOTIFY_SOCKET` pointing at a socket of
//! the test and a watchdog interval, send READY=1, then WATCHDOG=1, then STOPPING=1 on SIGTERM,
//! in that order, and exit 0.

use std::time::Duration;

use edge_testkit::{Daemon, bin};

use crate::common::{READY_TIMEOUT, World};

fn check_sequence(name: &str, mut daemon: Daemon) -> anyhow::Result<()> {
    daemon.wait_notify("READY=1", READY_TIMEOUT)?;
    // WATCHDOG_USEC=400000 asks for a ping at least every 0.4 s; the daemons ping at half that.
    daemon.wait_notify("WATCHDOG=1", Duration::from_secs(10))?;
    daemon.wait_notify("WATCHDOG=1", Duration::from_secs(10))?;
    let status = daemon.terminate(Duration::from_secs(30))?;
    assert!(status.success(), "{name} exit after SIGTERM: {status}");
    // Everything sent after the last WATCHDOG we consumed: STOPPING=1 must be among it, and no
    // READY=1 after it.
    let rest = daemon.drain_notify();
    let stopping = rest.iter().position(|m| m.lines().any(|l| l == "STOPPING=1"));
    let Some(at) = stopping else { anyhow::bail!("{name} sent no STOPPING=1; got {rest:?}") };
    assert!(!rest[at..].iter().any(|m| m.contains("READY=1")), "{name}: READY after STOPPING: {rest:?}");
    Ok(())
}

#[test]
fn both_daemons_send_ready_then_watchdog_then_stopping() -> anyhow::Result<()> {
    let world = World::new("gw-notify-01", "")?;
    let watchdog = [("WATCHDOG_USEC", "400000")];
    let ingest_cfg = world.ingest_config.to_string_lossy().into_owned();
    let ingest =
        Daemon::spawn("ingest", &bin("edge-ingest")?, &["run", "--config", &ingest_cfg], world.path(), &watchdog)?;
    check_sequence("edge-ingest", ingest)?;
    let agent_cfg = world.agent_config.to_string_lossy().into_owned();
    let agent =
        Daemon::spawn("agent", &bin("edge-uploader")?, &["run", "--config", &agent_cfg], world.path(), &watchdog)?;
    check_sequence("edge-uploader", agent)
}
