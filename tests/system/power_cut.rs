//! Power cuts: a record acknowledged to a producer survives the loss of every write that was
//! not fsynced.
//!
//! The real agent runs with `tests/powercut/powercut.c` preloaded (`LD_PRELOAD`; built here
//! with the system C compiler into the target directory). The shim keeps a *durable image* of
//! the spool's directory: a file's content enters the image only when the file is fsynced
//! (`fsync`/`fdatasync`), a name only when the directory is fsynced. The agent is killed with
//! SIGKILL at random moments while producers push; then the spool directory is replaced by the
//! image (what a power cut leaves), the file must pass `PRAGMA integrity_check`, and the agent
//! restarts on it. After the last cut it drains, and the store must hold every acknowledged
//! record once.
//!
//! With `[spool] durability = "full"` (the default) nothing acknowledged may be lost: an answered
//! commit's segment bytes, its commit record with them, are in the image, and its rows may not
//! be (the WAL is synced about once a second), so each restart's `spool opened` line is read for
//! the records added back from commit records and those of a lost tail dropped. With
//! `"normal"` SQLite does not fsync the WAL at each commit, and the test measures what a power
//! cut costs: acknowledged records and requests lost, and the commits the WAL held beyond the
//! durable image at each cut.
//!
//! The ingest gets the same treatment (`ingest_power_cuts`): the shim watches its segments
//! directory, and it is cut while the agent uploads. The agent deletes a chunk once the ingest
//! acknowledged it, so a chunk the ingest acknowledged and a cut took would be lost for good:
//! every record acknowledged to a producer must be in the store once at the end.

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use anyhow::Context;
use edge_testkit::workload::{self, Sent, Workload};
use edge_testkit::{Daemon, Tier, bin};
use rand::{Rng, SeedableRng};

use crate::common::{READY_TIMEOUT, World, push, readings, status_json, wait_json};
use crate::crash_loop::{Producers, drain, integrity_check, runtime, spawn_agent, spool_path, summary_ms};

/// Builds the shim once per test process: `<target>/<profile>/powercut/libpowercut.so`.
fn shim() -> anyhow::Result<PathBuf> {
    static BUILT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    BUILT
        .get_or_init(|| {
            let build = || -> anyhow::Result<PathBuf> {
                let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/powercut/powercut.c");
                let dir = bin("edge-uploader")?.parent().context("target dir")?.join("powercut");
                std::fs::create_dir_all(&dir)?;
                let out = dir.join("libpowercut.so");
                // Tests run in parallel processes: build under a private name, then rename.
                let tmp = dir.join(format!("libpowercut.so.{}", std::process::id()));
                let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
                let status = std::process::Command::new(&cc)
                    .args(["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o"])
                    .arg(&tmp)
                    .arg(&src)
                    .arg("-ldl")
                    .status()
                    .with_context(|| format!("running {cc} (a C compiler is needed for the power-cut shim)"))?;
                anyhow::ensure!(status.success(), "{cc} failed on {}", src.display());
                std::fs::rename(&tmp, &out)?;
                Ok(out)
            };
            build().map_err(|e| format!("{e:#}"))
        })
        .clone()
        .map_err(|e| anyhow::anyhow!(e))
}

/// One watched directory and its durable image.
struct PowerCut {
    dir: PathBuf,
    image: PathBuf,
}

impl PowerCut {
    fn new(dir: &Path, image: &Path) -> anyhow::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let cut = Self { dir: dir.canonicalize()?, image: image.to_path_buf() };
        cut.reset_image()?;
        Ok(cut)
    }

    fn envs(&self, shim: &Path) -> Vec<(String, String)> {
        vec![
            ("LD_PRELOAD".into(), shim.display().to_string()),
            ("POWERCUT_DIR".into(), self.dir.display().to_string()),
            ("POWERCUT_IMAGE".into(), self.image.display().to_string()),
        ]
    }

    /// The image becomes the directory as it is now (after a restart everything on disk is
    /// durable).
    fn reset_image(&self) -> anyhow::Result<()> {
        let _absent = std::fs::remove_dir_all(&self.image);
        std::fs::create_dir_all(self.image.join("ino"))?;
        let mut listing = String::new();
        for (name, meta) in regular_files(&self.dir)? {
            std::fs::copy(self.dir.join(&name), self.image.join("ino").join(meta.ino().to_string()))?;
            listing.push_str(&format!("{} {name}\n", meta.ino()));
        }
        std::fs::write(self.image.join("dir"), listing)?;
        Ok(())
    }

    /// What a power cut leaves: every durable name with the durable content of its inode, or
    /// empty when that inode was never fsynced. Names not durable are absent.
    fn durable_files(&self) -> anyhow::Result<BTreeMap<String, Vec<u8>>> {
        let listing = std::fs::read_to_string(self.image.join("dir")).unwrap_or_default();
        let mut files = BTreeMap::new();
        for line in listing.lines() {
            let (ino, name) = line.split_once(' ').context("bad image listing")?;
            let content = std::fs::read(self.image.join("ino").join(ino)).unwrap_or_default();
            files.insert(name.to_owned(), content);
        }
        Ok(files)
    }

    /// Replaces the directory's regular files by the durable image (the process is dead).
    fn cut(&self) -> anyhow::Result<()> {
        let durable = self.durable_files()?;
        for (name, _) in regular_files(&self.dir)? {
            std::fs::remove_file(self.dir.join(name))?;
        }
        for (name, content) in durable {
            std::fs::write(self.dir.join(name), content)?;
        }
        self.reset_image()
    }
}

fn regular_files(dir: &Path) -> anyhow::Result<Vec<(String, std::fs::Metadata)>> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let meta = e.metadata()?;
        if meta.file_type().is_file() {
            out.push((e.file_name().to_string_lossy().into_owned(), meta));
        }
    }
    Ok(out)
}

/// Commit frames of the current WAL generation (frames up to the first whose salt differs from
/// the header's), and that salt.
fn wal_commits(wal: &[u8]) -> (u64, u64, Option<[u8; 8]>) {
    if wal.len() < 32 {
        return (0, 0, None);
    }
    let page = u32::from_be_bytes([wal[8], wal[9], wal[10], wal[11]]) as usize;
    let salt: [u8; 8] = wal[16..24].try_into().unwrap_or([0; 8]);
    let mut commits = 0;
    let mut at = 32;
    while page > 0 && at + 24 + page <= wal.len() {
        let frame = &wal[at..at + 24];
        if frame[8..16] != salt {
            break;
        }
        if frame[4..8] != [0, 0, 0, 0] {
            commits += 1;
        }
        at += 24 + page;
    }
    // The bytes of the current WAL generation's frames: a WAL file is reused after a
    // checkpoint, so its length says nothing about how many of its frames are current.
    (commits, at as u64 - 32, Some(salt))
}

/// Starts the agent under the shim and waits for READY.
fn start_agent(world: &World, cut: &PowerCut, shim: &Path) -> anyhow::Result<Daemon> {
    let envs = cut.envs(shim);
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let mut agent = spawn_agent(world, &envs)?;
    agent.wait_ready(READY_TIMEOUT)?;
    Ok(agent)
}

/// What the agent's spool did at its last open, from its `spool opened` log line: records added
/// back from commit records, and records of a lost tail dropped.
fn spool_open_counts(agent: &Daemon) -> anyhow::Result<(u64, u64)> {
    let log = std::fs::read_to_string(agent.log_path())?;
    let line = log.lines().rev().find(|l| l.contains("spool opened")).context("no `spool opened` line in the log")?;
    let field = |name: &str| -> anyhow::Result<u64> {
        let at = line.find(&format!("{name}=")).with_context(|| format!("no {name} in {line:?}"))? + name.len() + 1;
        let digits: String = line[at..].chars().take_while(char::is_ascii_digit).collect();
        digits.parse().with_context(|| format!("{name} in {line:?}"))
    };
    Ok((field("replayed_records")?, field("unsynced_records_dropped")?))
}

/// Acknowledged requests with at least one record missing from the store.
fn lost_requests(workload: &Workload, data_dir: &Path, sent: &[Vec<Sent>]) -> anyhow::Result<u64> {
    let mut lost = 0;
    for (stream, name) in workload.streams.iter().enumerate() {
        let stored: HashSet<u64> = workload::export_raw(data_dir, name)?
            .iter()
            .filter_map(|r| workload.identify(r))
            .filter(|(s, _)| *s == stream)
            .map(|(_, i)| i)
            .collect();
        let requests = sent.get(stream).map_or(&[][..], Vec::as_slice);
        lost +=
            requests.iter().filter(|r| r.acked && (r.first..r.first + r.count).any(|i| !stored.contains(&i))).count()
                as u64;
    }
    Ok(lost)
}

/// After the last cut: a few more records, then the producers stop, the agent drains, and both
/// daemons must exit cleanly on SIGTERM. Returns what the producers sent.
fn wind_down(
    rt: &tokio::runtime::Runtime,
    producers: Producers,
    mut agent: Daemon,
    mut ingest: Daemon,
    socket: &Path,
) -> anyhow::Result<Vec<Vec<Sent>>> {
    producers.wait_acked(producers.acked(), 20, Duration::from_secs(60), || agent.tail_log())?;
    let sent = producers.stop(rt)?;
    rt.block_on(drain(socket, Duration::from_secs(120))).map_err(|e| e.context(agent.tail_log()))?;
    let agent_exit = agent.terminate(Duration::from_secs(30))?;
    let ingest_exit = ingest.terminate(Duration::from_secs(30))?;
    anyhow::ensure!(agent_exit.success() && ingest_exit.success(), "exits after SIGTERM: {agent_exit}, {ingest_exit}");
    Ok(sent)
}

/// Runs `cuts` power cuts with the given spool durability; returns the figures and the check.
fn power_cuts(durability: &str, cuts: u32, seed: u64) -> anyhow::Result<(serde_json::Value, workload::Report)> {
    let shim = shim()?;
    let world = World::new("gw-power-01", "")?;
    let config = std::fs::read_to_string(&world.agent_config)?;
    std::fs::write(
        &world.agent_config,
        config.replacen("[spool]\n", &format!("[spool]\ndurability = \"{durability}\"\n"), 1),
    )?;
    let spool = spool_path(&world);
    let cut = PowerCut::new(spool.parent().context("spool dir")?, &world.path().join("durable-image"))?;
    let socket = world.intake_socket();
    let rt = runtime()?;
    let workload = Arc::new(Workload::new(seed).with_sizes(1, 4 * 1024));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);

    let ingest = world.start_ingest()?;
    let mut agent = start_agent(&world, &cut, &shim)?;
    let producers = Producers::start(&rt, &workload, &socket, 50);
    let (mut unsynced_commits, mut wal_bytes_lost, mut restarts) = (Vec::new(), 0u64, Vec::new());
    let (mut replayed, mut dropped) = (Vec::new(), Vec::new());
    for _ in 0..cuts {
        producers
            .wait_acked(producers.acked(), rng.random_range(20..2000), Duration::from_secs(60), || agent.tail_log())?;
        std::thread::sleep(Duration::from_millis(rng.random_range(0..100)));
        agent.kill9()?;
        // What the WAL held that the durable image does not.
        let real_wal = std::fs::read(spool.with_file_name("spool.db-wal")).unwrap_or_default();
        let durable = cut.durable_files()?;
        let image_wal = durable.get("spool.db-wal").cloned().unwrap_or_default();
        let (real, real_bytes, real_salt) = wal_commits(&real_wal);
        let (kept, kept_bytes, kept_salt) = wal_commits(&image_wal);
        if real_salt == kept_salt {
            unsynced_commits.push(real.saturating_sub(kept));
            wal_bytes_lost += real_bytes.saturating_sub(kept_bytes);
        } else {
            unsynced_commits.push(real);
            wal_bytes_lost += real_bytes;
        }
        cut.cut()?;
        integrity_check(&spool).context("the spool after a power cut")?;
        let t = std::time::Instant::now();
        agent = start_agent(&world, &cut, &shim)?;
        restarts.push(t.elapsed());
        let (r, d) = spool_open_counts(&agent)?;
        replayed.push(r);
        dropped.push(d);
    }
    let sent = wind_down(&rt, producers, agent, ingest, &socket)?;

    let check = workload::check_store(&workload, &world.data_dir(), &sent)?;
    let requests_acked = sent.iter().flatten().filter(|r| r.acked).count();
    let figures = serde_json::json!({
        "durability": durability,
        "power_cuts": cuts,
        "spool_integrity_checks_ok": cuts,
        "records_acked": check.acked,
        "records_acked_lost": check.lost,
        "requests_acked": requests_acked,
        "requests_acked_lost": lost_requests(&workload, &world.data_dir(), &sent)?,
        "wal_commits_not_durable_at_cut": unsynced_commits,
        "wal_commits_not_durable_total": unsynced_commits.iter().sum::<u64>(),
        "wal_bytes_not_durable_total": wal_bytes_lost,
        "records_replayed_from_commit_records_at_open": replayed,
        "records_replayed_total": replayed.iter().sum::<u64>(),
        "records_of_lost_tails_dropped_at_open": dropped,
        "records_of_lost_tails_dropped_total": dropped.iter().sum::<u64>(),
        "restart_to_ready_ms": summary_ms(&restarts),
        "check": check.to_json(),
    });
    Ok((figures, check))
}

/// Starts the ingest under the shim and waits for READY.
fn start_ingest(world: &World, cut: &PowerCut, shim: &Path) -> anyhow::Result<Daemon> {
    let envs = cut.envs(shim);
    let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let cfg = world.ingest_config.to_string_lossy().into_owned();
    let mut ingest = Daemon::spawn("ingest", &bin("edge-ingest")?, &["run", "--config", &cfg], world.path(), &envs)?;
    ingest.wait_ready(READY_TIMEOUT)?;
    Ok(ingest)
}

/// Runs `cuts` power cuts of the ingest (its segments directory under the shim, 1 MiB
/// segments so that cuts also land around rolls) while the agent uploads.
fn ingest_power_cuts(cuts: u32, seed: u64) -> anyhow::Result<(serde_json::Value, workload::Report)> {
    let shim = shim()?;
    let world = World::new("gw-power-ingest", "")?;
    // `[store]` is the ingest config's last section.
    let config = std::fs::read_to_string(&world.ingest_config)?;
    std::fs::write(&world.ingest_config, format!("{config}segment_max_bytes = \"1MiB\"\n"))?;
    let cut = PowerCut::new(&world.data_dir().join("segments"), &world.path().join("durable-image"))?;
    let socket = world.intake_socket();
    let rt = runtime()?;
    let workload = Arc::new(Workload::new(seed).with_sizes(1, 16 * 1024));
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let stored = |world: &World| -> anyhow::Result<f64> {
        Ok(World::scrape(world.ingest_metrics)?
            .get("edge_ingest_chunks_total{result=\"stored\"}")
            .copied()
            .unwrap_or(0.0))
    };

    let mut ingest = start_ingest(&world, &cut, &shim)?;
    let mut agent = spawn_agent(&world, &[])?;
    agent.wait_ready(READY_TIMEOUT)?;
    let producers = Producers::start(&rt, &workload, &socket, 50);
    let (mut acked_by_ingest, mut durable_bytes) = (Vec::new(), Vec::new());
    for _ in 0..cuts {
        // Some chunks acknowledged by this run of the ingest (its counter starts at 0), then
        // a cut at a random moment after.
        let want = f64::from(rng.random_range(1..40u32));
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while stored(&world)? < want {
            anyhow::ensure!(
                std::time::Instant::now() < deadline,
                "the ingest stored nothing; log:\n{}",
                ingest.tail_log()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(rng.random_range(0..100)));
        acked_by_ingest.push(stored(&world)?);
        ingest.kill9()?;
        // The shim saw the ingest's syncs: what they made durable is what the cut keeps.
        let durable: usize = cut.durable_files()?.values().map(Vec::len).sum();
        anyhow::ensure!(durable > 0, "nothing in the durable image after stored chunks: the shim saw no sync");
        durable_bytes.push(durable);
        cut.cut()?;
        ingest = start_ingest(&world, &cut, &shim)?;
    }
    let sent = wind_down(&rt, producers, agent, ingest, &socket)?;
    let check = workload::check_store(&workload, &world.data_dir(), &sent)?;
    let figures = serde_json::json!({
        "power_cuts": cuts,
        "chunks_acked_by_the_ingest_before_each_cut": acked_by_ingest,
        "durable_segment_bytes_at_each_cut": durable_bytes,
        "segment_max_bytes": "1MiB",
        "records_acked": check.acked,
        "records_acked_lost": check.lost,
        "check": check.to_json(),
    });
    Ok((figures, check))
}

#[test]
fn power_cut_ingest_loses_nothing_it_acknowledged() -> anyhow::Result<()> {
    let cuts = Tier::current().pick(3, 40);
    let (figures, check) = ingest_power_cuts(cuts, 0x1C_E5)?;
    edge_testkit::report("power_cut_ingest", &figures)?;
    assert!(check.is_exact(), "records the ingest acknowledged lost or damaged by its power cuts: {check:?}");
    assert_eq!(check.out_of_order, 0, "{check:?}");
    assert!(check.acked > 0);
    Ok(())
}

#[test]
fn power_cut_full_durability_loses_nothing_acknowledged() -> anyhow::Result<()> {
    let cuts = Tier::current().pick(3, 40);
    let (figures, check) = power_cuts("full", cuts, 0xF011)?;
    edge_testkit::report("power_cut_full", &figures)?;
    assert!(check.is_exact(), "acknowledged records lost or damaged by power cuts: {check:?}");
    assert_eq!(check.out_of_order, 0, "{check:?}");
    assert!(check.acked > 0);
    Ok(())
}

#[test]
fn power_cut_normal_durability_loss_window() -> anyhow::Result<()> {
    let cuts = Tier::current().pick(3, 40);
    let (figures, check) = power_cuts("normal", cuts, 0x404A)?;
    edge_testkit::report("power_cut_normal", &figures)?;
    // Losing acknowledged records is what `normal` trades for speed, and is measured above;
    // nothing may be stored twice, torn or foreign even so.
    assert_eq!(
        (check.duplicates_stored, check.unexpected, check.corrupted, check.partial_requests),
        (0, 0, 0, 0),
        "{check:?}"
    );
    assert!(check.acked > 0);
    Ok(())
}

/// With `durability = "normal"` a power cut may take the last commits, never records accepted
/// after it. A chunk sealed in a commit of its own (by `linger`, while the ingest is away), then
/// sent and stored, must not be sealed again under its sequence number with other records: the
/// ingest would take that chunk for the duplicate, and those records would be lost.
#[test]
fn power_cut_normal_durability_never_seals_a_sent_sequence_number_again() -> anyhow::Result<()> {
    let shim = shim()?;
    let world = World::new("gw-power-02", "")?;
    let config = std::fs::read_to_string(&world.agent_config)?;
    std::fs::write(&world.agent_config, config.replacen("[spool]\n", "[spool]\ndurability = \"normal\"\n", 1))?;
    let spool = spool_path(&world);
    let cut = PowerCut::new(spool.parent().context("spool dir")?, &world.path().join("durable-image"))?;
    let status = |what: &str, pred: &dyn Fn(&serde_json::Value) -> bool| {
        wait_json(what, || status_json(&world), |_, d| pred(&d["spool"]))
    };
    let empty = |s: &serde_json::Value| s["sealed_chunks"] == 0 && s["open_records"] == 0 && s["total_bytes"] == 0;

    // A spool that has been through a clean stop: its file is durable (a new one may be lost
    // whole by a power cut under `normal`, and replaced by one with another identity).
    let mut agent = start_agent(&world, &cut, &shim)?;
    anyhow::ensure!(agent.terminate(Duration::from_secs(30))?.success(), "agent exit");
    cut.cut()?;
    // The ingest is away: the records stay open until the agent connects, when they are sealed
    // in a commit of their own, then sent and stored.
    let mut agent = start_agent(&world, &cut, &shim)?;
    push(&world, "cut", &readings("cut", 3))?;
    let mut ingest = world.start_ingest()?;
    status("the chunk acknowledged", &empty)?;
    anyhow::ensure!(ingest.terminate(Duration::from_secs(30))?.success(), "ingest exit");
    agent.kill9()?;
    cut.cut()?;
    integrity_check(&spool).context("the spool after a power cut")?;

    // Records accepted after the cut, while the ingest is away again.
    let mut agent = start_agent(&world, &cut, &shim)?;
    let after: Vec<String> = (0..3).map(|i| format!("{{\"stream\":\"cut\",\"after_the_cut\":{i}}}")).collect();
    push(&world, "cut", &after)?;
    let mut ingest = world.start_ingest()?;
    status("every chunk acknowledged", &empty)?;
    let stored = world.export_raw("cut")?;
    for record in &after {
        assert!(
            stored.iter().any(|r| r == record.as_bytes()),
            "{record} was accepted after the power cut and is not stored: {} records stored",
            stored.len()
        );
    }
    anyhow::ensure!(agent.terminate(Duration::from_secs(30))?.success(), "agent exit");
    anyhow::ensure!(ingest.terminate(Duration::from_secs(30))?.success(), "ingest exit");
    Ok(())
}

/// Under `durability = "normal"` a failed sync of the WAL (a failpoint in the real agent) at
/// open fails the start; later, at the seal made when the agent connects, it leaves chunks this
/// process cannot vouch for: the agent stops in order with exit status 74 instead of holding
/// them unsent, and the next start, which syncs the WAL first, sends every record it had
/// accepted, once.
#[test]
fn a_failed_wal_sync_under_normal_durability_stops_the_agent_and_the_next_start_sends_all() -> anyhow::Result<()> {
    let world = World::new("gw-power-04", "")?;
    let config = std::fs::read_to_string(&world.agent_config)?;
    std::fs::write(&world.agent_config, config.replacen("[spool]\n", "[spool]\ndurability = \"normal\"\n", 1))?;
    // A WAL that cannot be synced at open: the start fails, naming it.
    let mut agent = spawn_agent(&world, &[("FAILPOINTS", "spool::normal_wal_sync=return")])?;
    let status = agent.wait_exit(Duration::from_secs(60))?;
    let log = std::fs::read_to_string(agent.log_path())?;
    assert!(
        !status.success() && log.contains("spool.db-wal"),
        "agent start with a WAL sync failing: {status}; log:\n{log}"
    );
    // The ingest is away: the records stay open until the agent connects and seals them in a
    // commit of their own, whose WAL sync fails (the one at open goes through).
    let mut agent = spawn_agent(&world, &[("FAILPOINTS", "spool::normal_wal_sync=1*off->return")])?;
    agent.wait_ready(READY_TIMEOUT)?;
    push(&world, "walsync", &readings("walsync", 3))?;
    let mut ingest = world.start_ingest()?;
    let status = agent.wait_exit(Duration::from_secs(60))?;
    let log = std::fs::read_to_string(agent.log_path())?;
    assert_eq!(status.code(), Some(74), "agent exit after a failed WAL sync: {status}; log:\n{log}");
    assert!(log.contains("could not fsync the spool's WAL") && log.contains("stopped"), "log:\n{log}");
    let mut agent = world.start_agent()?;
    wait_json(
        "every record acknowledged",
        || status_json(&world),
        |_, d| d["spool"]["sealed_chunks"] == 0 && d["spool"]["open_records"] == 0 && d["spool"]["total_bytes"] == 0,
    )?;
    assert_eq!(world.export_raw("walsync")?.len(), 3, "each accepted record stored once");
    anyhow::ensure!(agent.terminate(Duration::from_secs(30))?.success(), "agent exit");
    anyhow::ensure!(ingest.terminate(Duration::from_secs(30))?.success(), "ingest exit");
    Ok(())
}

/// A directory a daemon creates for its state, with missing parents, has its name fsynced in its
/// parent before anything is acknowledged: a power cut would otherwise take the spool (or the
/// ingest's segments) with the directory, acknowledged records and all. The shim logs every
/// directory fsynced by each daemon.
#[test]
fn state_directories_a_daemon_creates_are_durable_names() -> anyhow::Result<()> {
    let shim = shim()?;
    let world = World::new("gw-power-03", "")?;
    let root = world.path().canonicalize()?;
    let agent_config = std::fs::read_to_string(&world.agent_config)?;
    let spool = root.join("a-new/spool/spool.db");
    std::fs::write(
        &world.agent_config,
        agent_config.replacen(&format!("{:?}", world.path().join("agent/spool.db")), &format!("{spool:?}"), 1),
    )?;
    let ingest_config = std::fs::read_to_string(&world.ingest_config)?;
    let data_dir = root.join("i-new/store/data");
    std::fs::write(
        &world.ingest_config,
        ingest_config.replacen(&format!("{:?}", world.data_dir()), &format!("{data_dir:?}"), 1),
    )?;
    let run = |name: &str, bin_name: &str, config: &Path| -> anyhow::Result<(Daemon, PathBuf)> {
        let log = root.join(format!("{name}.dirsyncs"));
        let envs = [("LD_PRELOAD", shim.display().to_string()), ("POWERCUT_DIRSYNCS", log.display().to_string())];
        let envs: Vec<(&str, &str)> = envs.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let cfg = config.to_string_lossy().into_owned();
        let mut d = Daemon::spawn(name, &bin(bin_name)?, &["run", "--config", &cfg], world.path(), &envs)?;
        d.wait_ready(READY_TIMEOUT)?;
        Ok((d, log))
    };
    let (mut ingest, ingest_log) = run("ingest", "edge-ingest", &world.ingest_config)?;
    let (mut agent, agent_log) = run("agent", "edge-uploader", &world.agent_config)?;
    push(&world, "dirs", &readings("dirs", 3))?;
    wait_json("the records acknowledged", || status_json(&world), |_, d| d["upload"]["records_acked_total"] == 3)?;
    anyhow::ensure!(agent.terminate(Duration::from_secs(30))?.success(), "agent exit");
    anyhow::ensure!(ingest.terminate(Duration::from_secs(30))?.success(), "ingest exit");
    for (name, log, created) in [
        ("edge-uploader", &agent_log, &["a-new", "a-new/spool"][..]),
        ("edge-ingest", &ingest_log, &["i-new", "i-new/store", "i-new/store/data"][..]),
    ] {
        let synced: HashSet<PathBuf> = std::fs::read_to_string(log)
            .with_context(|| format!("{name} fsynced no directory"))?
            .lines()
            .map(PathBuf::from)
            .collect();
        for dir in created.iter() {
            let parent = root.join(dir).parent().context("parent")?.to_owned();
            assert!(
                synced.contains(&parent),
                "{name} created {dir} and never fsynced {}, the directory holding its name; synced: {synced:?}",
                parent.display()
            );
        }
    }
    Ok(())
}

/// The shim is honest: unsynced writes, and names whose directory was not fsynced, are not in
/// the image; synced content is.
#[test]
fn power_cut_shim_keeps_only_what_was_fsynced() -> anyhow::Result<()> {
    let shim = shim()?;
    let tmp = tempfile::tempdir()?;
    let cut = PowerCut::new(&tmp.path().join("d"), &tmp.path().join("image"))?;
    let script = "printf unsynced > a; printf synced > b; sync b; sync \"$POWERCUT_DIR\"; \
                  printf more >> b; printf c > c; sync c; printf d > d; sync -d d";
    let mut cmd = std::process::Command::new("/bin/sh");
    cmd.args(["-c", script]).current_dir(&cut.dir);
    for (k, v) in cut.envs(&shim) {
        cmd.env(k, v);
    }
    let status = cmd.status()?;
    anyhow::ensure!(status.success(), "script under the shim failed: {status}");
    // The live directory has everything.
    assert_eq!(std::fs::read(cut.dir.join("b"))?, b"syncedmore");
    assert_eq!(std::fs::read(cut.dir.join("c"))?, b"c");
    let image = cut.durable_files()?;
    let names: Vec<&str> = image.keys().map(String::as_str).collect();
    // c and d were synced (fsync, fdatasync) but their names never were: gone.
    assert_eq!(names, ["a", "b"], "durable names");
    assert_eq!(image["a"], b"", "a's name was synced, its content never");
    assert_eq!(image["b"], b"synced", "the append after the fsync is lost");
    // d's content reached the image through fdatasync even though its name did not.
    let ino = std::fs::metadata(cut.dir.join("d"))?.ino();
    assert_eq!(std::fs::read(cut.image.join("ino").join(ino.to_string()))?, b"d");
    cut.cut()?;
    let after: Vec<String> = regular_files(&cut.dir)?.into_iter().map(|(n, _)| n).collect();
    assert_eq!(after.len(), 2, "{after:?}");
    assert_eq!(std::fs::read(cut.dir.join("b"))?, b"synced");
    Ok(())
}
