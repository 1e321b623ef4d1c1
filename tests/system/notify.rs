//! systemd readiness protocol: both daemons, run with `NOTIFY_SOCKET` pointing at a socket of
//! the test and a watchdog interval, send READY=1, then WATCHDOG=1, then STOPPING=1 on SIGTERM,
//! in that order, and exit 0; a reload and a stop sent the moment READY arrives are obeyed. The
//! agent withholds WATCHDOG=1 while its spool has been stuck in one commit for a ping interval
//! and at least 10 s, and says so in `status`; the ingest does the same for its store.

use std::time::Duration;

use edge_testkit::{Daemon, bin};

use crate::common::{READY_TIMEOUT, World, json_output, push, readings, status_json, wait_json};
use crate::crash_loop::spawn_agent;

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

#[test]
fn a_spool_stuck_in_one_commit_withholds_the_watchdog_ping_and_makes_status_degraded() -> anyhow::Result<()> {
    let world = World::new("gw-notify-02", "")?;
    // The first commit with records sleeps 18 s on the spool's writer thread, as on a disk that
    // stopped answering; the runtime, and the loop that pings, carry on meanwhile.
    let envs = [("WATCHDOG_USEC", "1000000"), ("FAILPOINTS", "spool::append::before_commit=1*sleep(18000)")];
    let mut agent = spawn_agent(&world, &envs)?;
    agent.wait_ready(READY_TIMEOUT)?;
    agent.wait_notify("WATCHDOG=1", Duration::from_secs(10))?;
    let records = readings("stuck", 3);
    let pings =
        |agent: &mut Daemon| agent.drain_notify().iter().filter(|m| m.lines().any(|l| l == "WATCHDOG=1")).count();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let producer = s.spawn(|| push(&world, "stuck", &records));
        let busy_for = |ms: u64| move |_: i32, d: &serde_json::Value| d["spool"]["busy"]["ms"].as_u64() >= Some(ms);
        // A ping interval of 0.5 s, but a commit slow for less than the 10 s at which the spool
        // counts as stuck withholds nothing: a short WatchdogSec must not restart the agent over
        // one slow fsync.
        wait_json("the commit stuck for 2 s", || status_json(&world), busy_for(2_000))?;
        agent.drain_notify();
        wait_json("the commit stuck for 8 s", || status_json(&world), busy_for(8_000))?;
        assert!(pings(&mut agent) > 0, "the ping was withheld for a commit slow for less than 10 s");
        let doc = wait_json(
            "status degraded by the stuck commit",
            || status_json(&world),
            |code, d| {
                code == 1
                    && d["degraded_reasons"].as_array().is_some_and(|r| {
                        r.iter().any(|r| r.as_str().is_some_and(|r| r.starts_with("the spool has been in one commit")))
                    })
            },
        )?;
        assert!(doc["spool"]["busy"]["ms"].as_u64() >= Some(10_000), "{doc}");
        // From 10 s on, every ping is withheld (a check runs each 0.5 s).
        wait_json("the commit stuck for 11 s", || status_json(&world), busy_for(11_000))?;
        agent.drain_notify();
        wait_json("the commit stuck for 14 s", || status_json(&world), busy_for(14_000))?;
        assert_eq!(pings(&mut agent), 0, "watchdog pings while the spool was stuck");
        agent.wait_log("withholding the watchdog ping", Duration::from_secs(5))?;
        producer.join().map_err(|_| anyhow::anyhow!("producer panicked"))??;
        Ok(())
    })?;
    // Once the commit returns, the records are stored and the pings come again.
    agent.wait_notify("WATCHDOG=1", Duration::from_secs(10))?;
    agent.wait_log("the spool thread is back", Duration::from_secs(5))?;
    let (_, doc) = status_json(&world)?;
    assert_eq!(doc["spool"]["open_records"], 3, "{doc}");
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    Ok(())
}

#[test]
fn a_store_stuck_in_one_commit_withholds_the_ingests_watchdog_ping_and_makes_status_degraded() -> anyhow::Result<()> {
    let world = World::new("gw-notify-03", "")?;
    // The store's first commit sleeps 18 s between its write and its fdatasync, as on a disk that
    // stopped answering; the server's runtime, and the loop that pings, carry on meanwhile.
    let envs = [("WATCHDOG_USEC", "1000000"), ("FAILPOINTS", "ingest::commit::written=1*sleep(18000)")];
    let cfg = world.ingest_config.to_string_lossy().into_owned();
    let mut ingest = Daemon::spawn("ingest", &bin("edge-ingest")?, &["run", "--config", &cfg], world.path(), &envs)?;
    ingest.wait_ready(READY_TIMEOUT)?;
    ingest.wait_notify("WATCHDOG=1", Duration::from_secs(10))?;
    let mut agent = world.start_agent()?;
    push(&world, "stuck", &readings("stuck", 3))?;
    let status = || json_output("edge-ingest", &["status", "--config", &cfg, "--json"]);
    let busy_for = |ms: u64| move |_: i32, d: &serde_json::Value| d["sink"]["busy_ms"].as_u64() >= Some(ms);
    let pings = |d: &mut Daemon| d.drain_notify().iter().filter(|m| m.lines().any(|l| l == "WATCHDOG=1")).count();
    // Below 10 s a slow commit withholds nothing.
    wait_json("the commit stuck for 2 s", status, busy_for(2_000))?;
    ingest.drain_notify();
    wait_json("the commit stuck for 8 s", status, busy_for(8_000))?;
    assert!(pings(&mut ingest) > 0, "the ping was withheld for a commit slow for less than 10 s");
    let doc = wait_json("status degraded by the stuck commit", status, |code, d| {
        code == 1
            && d["sink"]["problems"].as_array().is_some_and(|p| {
                p.iter().any(|p| p.as_str().is_some_and(|p| p.starts_with("the store has been in one batch")))
            })
    })?;
    assert!(doc["sink"]["busy_ms"].as_u64() >= Some(10_000), "{doc}");
    // From 10 s on, every ping is withheld (a check runs each 0.5 s).
    wait_json("the commit stuck for 11 s", status, busy_for(11_000))?;
    ingest.drain_notify();
    wait_json("the commit stuck for 14 s", status, busy_for(14_000))?;
    assert_eq!(pings(&mut ingest), 0, "watchdog pings while the store was stuck");
    ingest.wait_log("withholding the watchdog ping", Duration::from_secs(5))?;
    // Once the commit returns, the chunk is stored and answered, and the pings come again.
    ingest.wait_notify("WATCHDOG=1", Duration::from_secs(10))?;
    ingest.wait_log("the store is back", Duration::from_secs(5))?;
    wait_json(
        "the records delivered",
        || status_json(&world),
        |_, d| {
            d["spool"]["sealed_chunks"] == 0
                && d["spool"]["open_records"] == 0
                && d["upload"]["records_acked_total"] == 3
        },
    )?;
    assert_eq!(world.export_raw("stuck")?.len(), 3, "each record stored once");
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    Ok(())
}

/// A supervisor may reload or stop a daemon the moment READY arrives. Both daemons are held 2 s
/// just after sending READY (a failpoint) and sent SIGHUP in that window: each reloads once
/// released; SIGTERM then stops it in order, exit 0. Were the handlers installed after READY,
/// SIGHUP's default action would have ended the process.
#[test]
fn a_reload_and_a_stop_sent_on_ready_are_obeyed() -> anyhow::Result<()> {
    let world = World::new("gw-notify-04", "")?;
    let ingest_cfg = world.ingest_config.to_string_lossy().into_owned();
    let agent_cfg = world.agent_config.to_string_lossy().into_owned();
    for (name, bin_name, cfg, failpoint) in [
        ("edge-ingest", "edge-ingest", &ingest_cfg, "ingest::ready=1*sleep(2000)"),
        ("edge-uploader", "edge-uploader", &agent_cfg, "agent::ready=1*sleep(2000)"),
    ] {
        let envs = [("FAILPOINTS", failpoint)];
        let mut daemon = Daemon::spawn(name, &bin(bin_name)?, &["run", "--config", cfg], world.path(), &envs)?;
        daemon.wait_ready(READY_TIMEOUT)?;
        daemon.signal("HUP")?;
        daemon.wait_log("configuration reloaded", Duration::from_secs(30))?;
        let status = daemon.terminate(Duration::from_secs(30))?;
        let log = std::fs::read_to_string(daemon.log_path())?;
        assert!(status.success(), "{name} exit after SIGHUP and SIGTERM on READY: {status}; log:\n{log}");
        assert!(log.contains("stopped"), "{name} did not stop in order; log:\n{log}");
    }
    Ok(())
}
