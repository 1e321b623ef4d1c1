//! The gateway's own link going down and coming back. The agent runs in a network namespace of
//! the test's own (`ip netns`), whose only way out is one end of a veth pair; the ingest listens
//! on the other end, outside. Taking the agent's end down is what a modem losing its bearer or
//! a pulled cable looks like from the gateway: routes gone, sends refused, and an rtnetlink
//! notification when it comes back. Needs root and iproute2 (as CI has).
//!
//! The intake is a Unix socket, so the test pushes records and reads `status` from outside the
//! namespace while the link is down.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use anyhow::Context;
use edge_testkit::{Daemon, bin, report};

use crate::common::{READY_TIMEOUT, World, push, readings, rewrite, set_backoff, status_json, wait_json};

const INGEST_CONNECTIONS: &str = "edge_ingest_connections_total";

fn ip(args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new("ip").args(args).output().context("running ip (iproute2)")?;
    anyhow::ensure!(
        out.status.success(),
        "ip {} failed: {} (these tests need root and iproute2 for network namespaces)",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr).trim()
    );
    Ok(())
}

/// A network namespace joined to ours by a veth pair with a /30 between the two ends; deleted
/// (with the pair) on drop.
struct Link {
    ns: String,
    gw_if: String,
    host_ip: Ipv4Addr,
}

impl Link {
    fn create() -> anyhow::Result<Link> {
        static N: AtomicU32 = AtomicU32::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let ns = format!("edge-link-{pid}-{n}");
        let (host_if, gw_if) = (format!("el{pid}h{n}"), format!("el{pid}g{n}"));
        // A /30 of its own per process (pids below 2^20 map to distinct ones) and link.
        let k = (pid & 0xF_FFFF) * 4 + (n % 4) * 0x40_0000;
        let base = u32::from(Ipv4Addr::new(10, 64, 0, 0)) + (k & 0x3F_FFFC);
        let (host_ip, gw_ip) = (Ipv4Addr::from(base + 1), Ipv4Addr::from(base + 2));
        ip(&["netns", "add", &ns])?;
        let link = Link { ns, gw_if, host_ip };
        ip(&["link", "add", &host_if, "type", "veth", "peer", "name", &link.gw_if, "netns", &link.ns])?;
        ip(&["addr", "add", &format!("{host_ip}/30"), "dev", &host_if])?;
        ip(&["link", "set", &host_if, "up"])?;
        ip(&["-n", &link.ns, "addr", "add", &format!("{gw_ip}/30"), "dev", &link.gw_if])?;
        ip(&["-n", &link.ns, "link", "set", "lo", "up"])?;
        link.set(true)?;
        Ok(link)
    }

    /// Takes the gateway's end of the link up or down.
    fn set(&self, up: bool) -> anyhow::Result<()> {
        ip(&["-n", &self.ns, "link", "set", &self.gw_if, if up { "up" } else { "down" }])
    }
}

impl Drop for Link {
    fn drop(&mut self) {
        // Deleting the namespace deletes its end of the pair, and with it ours.
        let _ = ip(&["netns", "del", &self.ns]);
    }
}

/// What one outage showed.
struct Outage {
    /// The link's return → the ingest's second connection.
    reconnect: Duration,
    /// Backoff waits the agent ended because of the network (`network_wakeups_total`).
    wakeups: u64,
    /// Connection attempts the agent made from the link going down to the reconnection.
    attempts: u64,
    figures: serde_json::Value,
}

/// Starts the ingest outside and the agent inside a [`Link`] (with `backoff_min`, `backoff_max`
/// and `upload_extra` in its `[upload]` section), delivers records before, takes the link down for `outage` (at least
/// until the agent noticed: its idle timeout), pushes records during it, brings it back, and
/// checks that every record was stored exactly once.
fn link_outage(device: &str, backoff: (&str, &str), upload_extra: &str, outage: Duration) -> anyhow::Result<Outage> {
    let world = World::new(device, upload_extra)?;
    let link = Link::create()?;
    // Both daemons meet on the link instead of loopback.
    rewrite(
        &world.ingest_config,
        "[server]\nlisten = \"127.0.0.1:",
        &format!("[server]\nlisten = \"{}:", link.host_ip),
    )?;
    rewrite(&world.agent_config, "server = \"127.0.0.1:", &format!("server = \"{}:", link.host_ip))?;
    let (min, max) = backoff;
    set_backoff(&world, min, max)?;
    let _ingest = world.start_ingest()?;
    let cfg = world.agent_config.to_string_lossy().into_owned();
    let agent_bin = bin("edge-uploader")?.to_string_lossy().into_owned();
    let mut agent = Daemon::spawn(
        "agent",
        Path::new("ip"),
        &["netns", "exec", &link.ns, &agent_bin, "run", "--config", &cfg],
        world.path(),
        &[],
    )?;
    agent.wait_ready(READY_TIMEOUT)?;

    let before = readings("link.before", 20);
    push(&world, "link.before", &before)?;
    wait_json(
        "the records before the outage acked",
        || status_json(&world),
        |_, d| d["upload"]["records_acked_total"] == 20,
    )?;

    link.set(false)?;
    let down = Instant::now();
    let during = readings("link.during", 200);
    push(&world, "link.during", &during)?;
    let lost = wait_json(
        "the agent noticing the link is gone",
        || status_json(&world),
        |_, d| d["upload"]["connected"] == false,
    )?;
    let attempts_at_loss = lost["upload"]["connect_attempts_total"].as_u64().context("connect_attempts_total")?;
    // The outage itself, not a synchronisation: how long the gateway stays cut off.
    std::thread::sleep(outage.saturating_sub(down.elapsed()));
    let (_, doc) = status_json(&world)?;
    let attempts_before_up = doc["upload"]["connect_attempts_total"].as_u64().context("connect_attempts_total")?;
    anyhow::ensure!(doc["upload"]["connected"] == false, "connected while the link was down: {doc}");

    link.set(true)?;
    let up = Instant::now();
    let deadline = up + Duration::from_secs(90);
    loop {
        let connections = World::scrape(world.ingest_metrics)?.get(INGEST_CONNECTIONS).copied().unwrap_or(0.0);
        if connections >= 2.0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the agent did not reconnect within 90 s of the link's return");
        std::thread::sleep(Duration::from_millis(20));
    }
    let reconnect = up.elapsed();
    let doc = wait_json(
        "every record acked and the spool empty",
        || status_json(&world),
        |_, d| d["upload"]["records_acked_total"] == 220 && d["spool"]["total_bytes"] == 0,
    )?;
    let wakeups = doc["upload"]["network_wakeups_total"].as_u64().context("network_wakeups_total")?;
    let attempts =
        doc["upload"]["connect_attempts_total"].as_u64().context("connect_attempts_total")? - attempts_at_loss;
    anyhow::ensure!(agent.terminate(Duration::from_secs(30))?.success(), "agent exit; log: {}", agent.tail_log());

    for (stream, sent) in [("link.before", &before), ("link.during", &during)] {
        let stored: Vec<String> =
            world.export_raw(stream)?.into_iter().map(|r| String::from_utf8_lossy(&r).into_owned()).collect();
        anyhow::ensure!(&stored == sent, "{stream}: {} stored of {} sent, or not in order", stored.len(), sent.len());
    }
    let figures = serde_json::json!({
        "backoff_min": min, "backoff_max": max, "upload": upload_extra.replace('\n', "; "), "outage_seconds": down.elapsed().as_secs_f64() - up.elapsed().as_secs_f64(),
        "link_up_to_connected_seconds": reconnect.as_secs_f64(), "network_wakeups": wakeups,
        "attempts_during_outage": attempts_before_up - attempts_at_loss, "records": 220, "stored_exactly_once": true,
    });
    Ok(Outage { reconnect, wakeups, attempts, figures })
}

#[test]
fn a_link_coming_back_ends_the_agents_backoff_wait() -> anyhow::Result<()> {
    // A backoff of 30 s flat: after the connection is lost, the agent's next attempt is at
    // least 15 s away unless something ends the wait. No probes, so only the watch can.
    let o =
        link_outage("gw-link-01", ("30s", "30s"), "connect_timeout = \"1s\"\nprobe_interval = \"0s\"", Duration::ZERO)?;
    report("link_outage_wakes_the_agent", &o.figures)?;
    anyhow::ensure!(o.wakeups >= 1, "the link's return did not end a backoff wait: {}", o.figures);
    anyhow::ensure!(
        o.reconnect < Duration::from_secs(15),
        "reconnected {:?} after the link's return, no sooner than the backoff allowed: {}",
        o.reconnect,
        o.figures
    );
    anyhow::ensure!(o.attempts >= 1, "{}", o.figures);
    Ok(())
}

/// The default backoff (200 ms to 30 s) through a 90 s outage of the link, three times with
/// the watch and three times without it (`watch_network = false`, the agent before it), in
/// turn: how long after the link's return the agent connects. Probes are off in both, so the
/// watch alone is measured (`network::an_ingest_back_after_an_outage_answers_a_probe_and_the_agent_reconnects_at_once`
/// has them). Figures in RELIABILITY.md and BENCHMARKS.md.
#[test]
#[ignore = "long tier"]
fn a_90s_link_outage_with_the_default_backoff_with_and_without_the_watch() -> anyhow::Result<()> {
    let outage = Duration::from_secs(90);
    let mut figures = serde_json::Map::new();
    for watch in [true, false] {
        figures.insert(format!("watch_{watch}_link_up_to_connected_seconds"), serde_json::json!([]));
    }
    for rep in 0..3 {
        for watch in [true, false] {
            let device = format!("gw-link-{rep}{}", u8::from(watch));
            let extra = format!("watch_network = {watch}\nprobe_interval = \"0s\"");
            let o = link_outage(&device, ("200ms", "30s"), &extra, outage)?;
            if watch {
                anyhow::ensure!(o.wakeups >= 1, "the link's return did not end a backoff wait: {}", o.figures);
            } else {
                anyhow::ensure!(o.wakeups == 0, "woken without the watch: {}", o.figures);
            }
            eprintln!("watch_network = {watch}: connected {:?} after the link's return", o.reconnect);
            if let Some(serde_json::Value::Array(list)) =
                figures.get_mut(&format!("watch_{watch}_link_up_to_connected_seconds"))
            {
                list.push(serde_json::json!((o.reconnect.as_secs_f64() * 100.0).round() / 100.0));
            }
        }
    }
    figures.insert("outage_seconds".into(), serde_json::json!(outage.as_secs()));
    figures.insert("records_each_time".into(), serde_json::json!(220));
    figures.insert("stored_exactly_once".into(), serde_json::json!(true));
    report("link_outage_90s_default_backoff", &serde_json::Value::Object(figures))?;
    Ok(())
}
