//! Crash points: the process dies (`abort()`, SIGABRT: a real crash, no unwinding, no
//! destructors) between two steps of a multi-step change on disk, at a named `fail` point, then
//! restarts, and nothing acknowledged may be lost or stored twice.
//!
//! The points are one-line `fail_point!`s in `edge-spool` (append, seal, ack, quarantine, open)
//! and in `edge-ingest`'s store (segment ready, written, fdatasynced, indexed, before the acks,
//! roll-over), compiled only with the `failpoints` feature. The test build gets that feature
//! through `edge-testkit`'s dev-dependencies (`cargo build --workspace --all-targets` unifies
//! it); `cargo build --release -p edge-uploader` does not. A daemon reads `FAILPOINTS` at start;
//! this test sets `<point>=<n>*off->return`, so the daemon crashes at hit `n + 1` (`n` drawn
//! from a seeded generator). Points on the spool's open run at the first hit, after a SIGKILL
//! that left a spool of random size.
//!
//! Every crash is checked to be *that* crash: the daemon logged `failpoint <name>: crashing` and
//! died of SIGABRT. A renamed or unreachable point therefore fails the test instead of passing
//! silently. After every agent crash the spool must pass `PRAGMA integrity_check`; after all
//! crashes of a point the agent drains and the checker compares the store with what the
//! producers were told.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use bytes::Bytes;
use edge_testkit::workload::{self, Workload};
use edge_testkit::{Daemon, Tier, bin};
use edge_uploader::client::IntakeClient;
use rand::{Rng, SeedableRng};

use crate::common::{READY_TIMEOUT, World};
use crate::crash_loop::{Producers, drain, integrity_check, runtime, spool_path};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Target {
    Agent,
    Ingest,
}

#[derive(Clone, Copy, Debug)]
enum Trigger {
    /// Crash at hit `n + 1`, `n` uniform in `0..max`.
    Hits(u32),
    /// Crash at the first hit, during the start-up after a SIGKILL.
    AtOpen,
}

#[derive(Clone, Copy, Debug)]
struct Point {
    name: &'static str,
    target: Target,
    trigger: Trigger,
}

const fn agent(name: &'static str, max: u32) -> Point {
    Point { name, target: Target::Agent, trigger: Trigger::Hits(max) }
}

const fn ingest(name: &'static str, max: u32) -> Point {
    Point { name, target: Target::Ingest, trigger: Trigger::Hits(max) }
}

/// Chunks the agent makes stay below this; the quarantine points get bigger ones on purpose.
const SERVER_MAX_CHUNK: &str = "256KiB";
/// A stream whose one record is larger than the server accepts: its chunks are quarantined.
const OVERSIZE_STREAM: &str = "oversize";

/// Starts `binary` with core dumps off (many deliberate aborts must not fill the disk).
fn spawn_no_core(
    world: &World,
    name: &str,
    binary: &str,
    config: &Path,
    envs: &[(&str, &str)],
) -> anyhow::Result<Daemon> {
    let exe = bin(binary)?.to_string_lossy().into_owned();
    let cfg = config.to_string_lossy().into_owned();
    Daemon::spawn(
        name,
        Path::new("/bin/sh"),
        &["-c", "ulimit -c 0; exec \"$0\" \"$@\"", &exe, "run", "--config", &cfg],
        world.path(),
        envs,
    )
}

fn start(world: &World, target: Target, envs: &[(&str, &str)]) -> anyhow::Result<Daemon> {
    let mut d = match target {
        Target::Agent => spawn_no_core(world, "agent", "edge-uploader", &world.agent_config, envs)?,
        Target::Ingest => spawn_no_core(world, "ingest", "edge-ingest", &world.ingest_config, envs)?,
    };
    d.wait_ready(READY_TIMEOUT)?;
    Ok(d)
}

/// Inserts `line` at the top of `[section]` of a TOML file written by [`World::new`].
fn set_in_section(path: &Path, section: &str, line: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)?;
    let header = format!("[{section}]\n");
    anyhow::ensure!(text.contains(&header), "no [{section}] in {}", path.display());
    std::fs::write(path, text.replacen(&header, &format!("{header}{line}\n"), 1))?;
    Ok(())
}

fn hits_logged(daemon: &Daemon, point: &str) -> usize {
    let needle = format!("failpoint {point}: crashing");
    std::fs::read_to_string(daemon.log_path()).unwrap_or_default().matches(&needle).count()
}

/// Waits until `daemon` exits and checks it was the abort at `point`.
fn wait_crash(daemon: &mut Daemon, point: &str, hits_before: usize, timeout: Duration) -> anyhow::Result<()> {
    // `wait_notify` fails with the exit status once the process is gone; nothing sends this.
    let err = match daemon.wait_notify("NO-SUCH-NOTIFICATION", timeout) {
        Ok(()) => anyhow::bail!("impossible notification"),
        Err(e) => format!("{e:#}"),
    };
    anyhow::ensure!(err.contains("exited with"), "{point} was not reached within {timeout:?}: {err}");
    let status = err.split("exited with").nth(1).and_then(|s| s.split(" before").next()).unwrap_or("");
    anyhow::ensure!(status.contains("SIGABRT"), "died of something else than the crash point {point}: {err}");
    let hits = hits_logged(daemon, point);
    anyhow::ensure!(hits == hits_before + 1, "{point}: {hits_before} → {hits} crash lines in the log: {err}");
    Ok(())
}

/// What the crashes of one point left.
struct Outcome {
    crashes: u32,
    hit_numbers: Vec<u32>,
    integrity_checks: u32,
    check: workload::Report,
}

/// Runs `crashes` crashes at `point` in a world of its own, then drains and checks the store.
fn crash_at(point: Point, crashes: u32, seed: u64) -> anyhow::Result<Outcome> {
    let world = World::new("gw-points-01", "")?;
    set_in_section(&world.ingest_config, "server", &format!("max_chunk_bytes = \"{SERVER_MAX_CHUNK}\""))?;
    set_in_section(&world.ingest_config, "store", "segment_max_bytes = \"1MiB\"")?;
    set_in_section(&world.agent_config, "spool", "chunk_target = \"64KiB\"")?;
    let socket = world.intake_socket();
    let rt = runtime()?;
    let workload = Arc::new(Workload::new(seed).with_sizes(1, 8 * 1024));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let mut ingest = start(&world, Target::Ingest, &[])?;
    let mut agent = start(&world, Target::Agent, &[])?;
    let producers = Producers::start(&rt, &workload, &socket, 50);
    // The quarantine points need chunks the server refuses: one oversized record now and then.
    let oversize = point.name.contains("quarantine").then(|| {
        let socket = socket.clone();
        let stop = producers.progress.stop.clone();
        rt.spawn(async move {
            // Bytes zstd cannot shrink below the server's limit: the agent measures a chunk as
            // it goes on the wire.
            let mut x = 0x2545_F491_4F6C_DD1D_u64;
            let noise: Vec<u8> = (0..300 * 1024)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect();
            let body = Bytes::from(noise);
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _outcome =
                    IntakeClient::new(&socket).post(OVERSIZE_STREAM, "application/octet-stream", body.clone()).await;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    });

    let mut out =
        Outcome { crashes: 0, hit_numbers: Vec::new(), integrity_checks: 0, check: workload::Report::default() };
    for _ in 0..crashes {
        let (n, fp) = match point.trigger {
            Trigger::Hits(max) => {
                // Quick tier: early hits, so the backlog (and the drain) stays small.
                let n = rng.random_range(0..Tier::current().pick(max.min(8), max));
                (n, format!("{}={n}*off->return", point.name))
            }
            Trigger::AtOpen => (0, format!("{}=return", point.name)),
        };
        out.hit_numbers.push(n + 1);
        let envs = [("FAILPOINTS", fp.as_str())];
        match (point.target, point.trigger) {
            (Target::Agent, Trigger::AtOpen) => {
                if out.crashes > 0 {
                    agent = start(&world, Target::Agent, &[])?;
                }
                // A spool of random size, left by a SIGKILL, then a crash while opening it.
                producers.wait_acked(producers.acked(), rng.random_range(1..500), Duration::from_secs(60), || {
                    agent.tail_log()
                })?;
                agent.kill9()?;
                integrity_check(&spool_path(&world))?;
                out.integrity_checks += 1;
                let before = hits_logged(&agent, point.name);
                let mut crashing = spawn_no_core(&world, "agent", "edge-uploader", &world.agent_config, &envs)?;
                wait_crash(&mut crashing, point.name, before, Duration::from_secs(60))?;
                agent = crashing;
            }
            (Target::Agent, Trigger::Hits(_)) => {
                agent.kill9()?;
                let before = hits_logged(&agent, point.name);
                agent = spawn_no_core(&world, "agent", "edge-uploader", &world.agent_config, &envs)?;
                wait_crash(&mut agent, point.name, before, Duration::from_secs(90))?;
            }
            (Target::Ingest, _) => {
                ingest.kill9()?;
                let before = hits_logged(&ingest, point.name);
                ingest = spawn_no_core(&world, "ingest", "edge-ingest", &world.ingest_config, &envs)?;
                wait_crash(&mut ingest, point.name, before, Duration::from_secs(90))?;
            }
        }
        if point.target == Target::Agent {
            integrity_check(&spool_path(&world)).with_context(|| format!("after the crash at {}", point.name))?;
            out.integrity_checks += 1;
        }
        out.crashes += 1;
    }
    // Clean restarts, then drain everything and compare.
    match point.target {
        Target::Agent => {
            agent.kill9()?;
            agent = start(&world, Target::Agent, &[])?;
        }
        Target::Ingest => {
            ingest.kill9()?;
            ingest = start(&world, Target::Ingest, &[])?;
        }
    }
    producers.wait_acked(producers.acked(), 20, Duration::from_secs(60), || agent.tail_log())?;
    let sent = producers.stop(&rt)?;
    if let Some(task) = oversize {
        rt.block_on(task)?;
    }
    rt.block_on(drain(&socket, Duration::from_secs(120))).map_err(|e| e.context(agent.tail_log()))?;
    let agent_exit = agent.terminate(Duration::from_secs(30))?;
    let ingest_exit = ingest.terminate(Duration::from_secs(30))?;
    anyhow::ensure!(agent_exit.success() && ingest_exit.success(), "exits after SIGTERM: {agent_exit}, {ingest_exit}");
    out.check = workload::check_store(&workload, &world.data_dir(), &sent)?;
    if point.name.contains("quarantine") {
        // The point was reached through real quarantines: the agent kept those chunks aside.
        let quarantined = workload::export_raw(&world.data_dir(), OVERSIZE_STREAM)?;
        anyhow::ensure!(quarantined.is_empty(), "oversized records reached the store: {}", quarantined.len());
    }
    Ok(out)
}

/// Crashes at every point of `points` (a world each), reports and asserts.
fn run(report_name: &str, points: &[Point], seed: u64) -> anyhow::Result<()> {
    let crashes = Tier::current().pick(1, 20);
    let mut figures = serde_json::Map::new();
    let mut failures = Vec::new();
    for (k, point) in points.iter().enumerate() {
        let o = crash_at(*point, crashes, seed ^ (k as u64 + 1).wrapping_mul(0x9E37_79B9))
            .with_context(|| format!("crash point {}", point.name))?;
        figures.insert(
            point.name.to_owned(),
            serde_json::json!({
                "crashes": o.crashes,
                "crash_at_hit": o.hit_numbers,
                "spool_integrity_checks_ok": o.integrity_checks,
                "acked": o.check.acked,
                "lost": o.check.lost,
                "duplicates_stored": o.check.duplicates_stored,
                "check": o.check.to_json(),
            }),
        );
        if !o.check.is_exact() || o.check.out_of_order != 0 {
            failures.push(format!("{}: {:?}", point.name, o.check));
        }
        anyhow::ensure!(o.crashes == crashes, "{}: {} crashes of {crashes}", point.name, o.crashes);
    }
    edge_testkit::report(report_name, &serde_json::json!({ "seed": seed, "points": figures }))?;
    anyhow::ensure!(failures.is_empty(), "stores differ from what was acknowledged: {failures:#?}");
    Ok(())
}

#[test]
fn crash_points_spool_append() -> anyhow::Result<()> {
    run(
        "crash_points_spool_append",
        &[
            agent("spool::segment::written", 30),
            agent("spool::append::before_commit", 30),
            agent("spool::append::after_commit", 30),
        ],
        0xA99E,
    )
}

#[test]
fn crash_points_spool_seal() -> anyhow::Result<()> {
    run(
        "crash_points_spool_seal",
        &[
            agent("spool::seal::chunk_row_written", 30),
            agent("spool::seal::before_commit", 30),
            agent("spool::seal::after_commit", 30),
        ],
        0x5EA1,
    )
}

#[test]
fn crash_points_spool_ack() -> anyhow::Result<()> {
    run(
        "crash_points_spool_ack",
        &[agent("spool::ack::before_commit", 30), agent("spool::ack::after_commit", 30)],
        0xAC4,
    )
}

#[test]
fn crash_points_spool_quarantine() -> anyhow::Result<()> {
    run(
        "crash_points_spool_quarantine",
        &[agent("spool::quarantine::before_commit", 4), agent("spool::quarantine::after_commit", 4)],
        0x0A4A,
    )
}

#[test]
fn crash_points_spool_open() -> anyhow::Result<()> {
    run(
        "crash_points_spool_open",
        &[
            Point { name: "spool::open::before_migrate", target: Target::Agent, trigger: Trigger::AtOpen },
            Point { name: "spool::open::after_migrate", target: Target::Agent, trigger: Trigger::AtOpen },
            Point { name: "spool::open::before_segments", target: Target::Agent, trigger: Trigger::AtOpen },
        ],
        0x0BE4,
    )
}

#[test]
fn crash_points_ingest_commit() -> anyhow::Result<()> {
    run(
        "crash_points_ingest_commit",
        &[
            ingest("ingest::commit::segment_ready", 30),
            ingest("ingest::commit::written", 30),
            ingest("ingest::commit::fdatasynced", 30),
            ingest("ingest::commit::indexed", 30),
        ],
        0x1C0,
    )
}

#[test]
fn crash_points_ingest_acks_and_roll() -> anyhow::Result<()> {
    run(
        "crash_points_ingest_acks_and_roll",
        &[ingest("ingest::persist::before_acks", 30), ingest("ingest::segment::rolled", 3)],
        0x4011,
    )
}
