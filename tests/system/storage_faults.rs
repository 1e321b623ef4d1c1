//! Storage faults on both sides, with the real daemons: the agent's spool file damaged (bit
//! flips and truncation) and the spool's file system full; the ingest's file system full.
//!
//! Every run ends with the workload checker: nothing acknowledged to a producer is lost or
//! stored twice, except records the run itself destroyed on purpose (damaged spool chunks),
//! which must equal what the agent reports and quarantines.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::Context;
use edge_testkit::workload::{ProducerOptions, Progress, Sent, Workload, check_store, produce};
use edge_testkit::{Tier, report};
use edge_uploader::client::IntakeClient;
use rand::{Rng, SeedableRng};

use crate::common::{World, json_output};

/// A tmpfs mounted on `dir` (created if missing), unmounted on drop.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// `None` (with a message on stderr) when mounting is not possible here (not root).
    fn mount(dir: &Path, size: &str) -> Option<Tmpfs> {
        std::fs::create_dir_all(dir).ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: `mount -t tmpfs` on {} failed (not root?)", dir.display());
            return None;
        }
        Some(Tmpfs { dir: dir.to_owned() })
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// A file system of `kind` made in a sparse image file and loop-mounted on `dir`, unmounted
/// on drop.
struct LoopFs {
    dir: PathBuf,
}

impl LoopFs {
    /// `Ok(None)` (with a message on stderr) when this machine cannot: no `mkfs.<kind>`, or
    /// mounting is not possible (not root). Under CI (`CI` set) a missing `mkfs` is an error:
    /// `.ci/run` installs xfsprogs and btrfs-progs.
    fn mount(kind: &str, image: &Path, dir: &Path) -> anyhow::Result<Option<LoopFs>> {
        let mkfs = format!("mkfs.{kind}");
        let found = Command::new(&mkfs).arg("-V").output().is_ok();
        if !found {
            anyhow::ensure!(std::env::var_os("CI").is_none(), "{mkfs} not found; .ci/run installs it");
            eprintln!("SKIPPED: {mkfs} not found");
            return Ok(None);
        }
        // 512 MiB, sparse: XFS takes no less than 300 MB.
        std::fs::File::create(image)?.set_len(512 << 20)?;
        let made = Command::new(&mkfs).args(["-q", "-f"]).arg(image).status()?;
        anyhow::ensure!(made.success(), "{mkfs} {} failed: {made}", image.display());
        std::fs::create_dir_all(dir)?;
        let ok = Command::new("mount").args(["-o", "loop"]).arg(image).arg(dir).status().is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: `mount -o loop` of a {kind} image on {} failed (not root?)", dir.display());
            return Ok(None);
        }
        Ok(Some(LoopFs { dir: dir.to_owned() }))
    }
}

impl Drop for LoopFs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.dir).status();
    }
}

/// Edits the agent config: `[spool]` settings go after the `linger` line the world writes.
fn spool_settings(world: &World, extra: &str) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(&world.agent_config)?;
    let text = text.replacen("linger = \"20ms\"\n", &format!("linger = \"20ms\"\n{extra}\n"), 1);
    std::fs::write(&world.agent_config, text)?;
    Ok(())
}

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?)
}

/// Runs one producer per stream of `workload` for `per_stream` records each; returns the logs.
fn produce_all(
    rt: &tokio::runtime::Runtime,
    workload: &Arc<Workload>,
    socket: &Path,
    per_stream: u64,
    max_batch: u64,
) -> anyhow::Result<Vec<Vec<Sent>>> {
    let tasks: Vec<_> = (0..workload.streams.len())
        .map(|s| {
            let mut opts = ProducerOptions::new(s);
            opts.total = Some(per_stream);
            opts.max_batch = max_batch;
            rt.spawn(produce(workload.clone(), socket.to_owned(), opts, Progress::default()))
        })
        .collect();
    tasks.into_iter().map(|t| rt.block_on(t)?).collect()
}

/// Waits until the agent reports an empty spool and nothing in flight.
fn drain(rt: &tokio::runtime::Runtime, socket: &Path, timeout: Duration) -> anyhow::Result<serde_json::Value> {
    rt.block_on(async {
        let mut client = IntakeClient::new(socket);
        let deadline = Instant::now() + timeout;
        loop {
            let s = client.get_json("/v1/status").await?.body;
            if s["spool"]["sealed_chunks"] == 0 && s["spool"]["open_bytes"] == 0 && s["upload"]["in_flight"] == 0 {
                return Ok(s);
            }
            anyhow::ensure!(Instant::now() < deadline, "agent did not drain: {s}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
}

fn spool_check(path: &Path) -> anyhow::Result<(i32, serde_json::Value)> {
    json_output("edge-uploader", &["spool", "check", "--spool", &path.to_string_lossy(), "--json"])
}

/// Every table of a spool file as text rows, to tell a flip that changed data from one that
/// landed in unused bytes. `None` if SQLite cannot read it at all.
fn logical_dump(path: &Path) -> Option<Vec<String>> {
    let conn = rusqlite::Connection::open_with_flags(path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY).ok()?;
    let mut out = Vec::new();
    for sql in [
        "SELECT key, quote(value) FROM meta ORDER BY key",
        "SELECT id, name, next_seq, sealed_through FROM streams ORDER BY id",
        "SELECT id, stream_id, seq, records, bytes, first_ms, sealed_ms, quote(quarantine), first_batch, last_batch
         FROM chunks ORDER BY id",
        "SELECT id, stream_id, hex(data), records, crc32c, commit_ms, segment, seg_offset, seg_len FROM batches
         ORDER BY id",
    ] {
        let mut stmt = conn.prepare(sql).ok()?;
        let n = stmt.column_count();
        let rows = stmt
            .query_map([], |r| {
                let cols: Result<Vec<String>, _> =
                    (0..n).map(|i| r.get::<_, rusqlite::types::Value>(i).map(|v| format!("{v:?}"))).collect();
                cols.map(|c| c.join("|"))
            })
            .ok()?;
        for row in rows {
            out.push(row.ok()?);
        }
    }
    Some(out)
}

/// The payload segment files of the spool at `db` (`<db>-seg-<id>`), by name; not the spare
/// (`<db>-seg-spare-<n>`), whose bytes are dead.
fn segment_files(db: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let name = db.file_name().context("spool file name")?.to_string_lossy().into_owned();
    let dir = db.parent().context("spool directory")?;
    let prefix = format!("{name}-seg-");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)?
        .filter_map(Result::ok)
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .strip_prefix(&prefix)
                .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
        })
        .map(|e| e.path())
        .collect();
    out.sort();
    Ok(out)
}

/// `path` with `suffix` appended to its file name.
fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// Offsets in `bytes` where a workload record's header starts (`wl:<seed>:`).
fn record_offsets(bytes: &[u8], seed: u64) -> Vec<usize> {
    let needle = format!("wl:{seed:x}:").into_bytes();
    bytes.windows(needle.len()).enumerate().filter(|(_, w)| *w == needle.as_slice()).map(|(i, _)| i).collect()
}

/// A stopped agent's spool with sealed chunks of `workload`, made by the real agent (no ingest
/// running, so nothing leaves). Returns the producer logs.
fn build_spool(world: &World, workload: &Arc<Workload>, per_stream: u64) -> anyhow::Result<Vec<Vec<Sent>>> {
    let rt = rt()?;
    let mut agent = world.start_agent()?;
    let sent = produce_all(&rt, workload, &world.intake_socket(), per_stream, 20)?;
    let status = agent.terminate(Duration::from_secs(30))?;
    anyhow::ensure!(status.success(), "agent exit: {status}");
    Ok(sent)
}

const SPOOL_SEED: u64 = 0x5F00_1001;

#[test]
fn spool_check_finds_every_injected_flip_and_truncation() -> anyhow::Result<()> {
    let tier = Tier::current();
    let world = World::new("gw-sf-check", "")?;
    spool_settings(&world, "chunk_target = \"16KiB\"")?;
    let workload = Arc::new(Workload::new(SPOOL_SEED).with_sizes(16, 1500));
    build_spool(&world, &workload, tier.pick(150, 1500))?;
    let spool = world.path().join("agent/spool.db");
    anyhow::ensure!(!world.path().join("agent/spool.db-wal").exists(), "the agent left a WAL behind");
    let pristine = std::fs::read(&spool)?;
    let pristine_dump = logical_dump(&spool).context("pristine spool unreadable")?;
    let (code, doc) = spool_check(&spool)?;
    assert_eq!(code, 0, "pristine spool is clean: {doc}");
    assert!(doc["chunks"].as_u64().unwrap_or(0) >= 5, "too few chunks to damage: {doc}");
    // The payload is in segment files (schema version 4); the database holds the index.
    let segments: Vec<(String, Vec<u8>)> = segment_files(&spool)?
        .iter()
        .map(|p| {
            let suffix = p.file_name().unwrap_or_default().to_string_lossy().trim_start_matches("spool.db").to_owned();
            Ok((suffix, std::fs::read(p)?))
        })
        .collect::<anyhow::Result<_>>()?;
    anyhow::ensure!(!segments.is_empty(), "the spool has no payload segment files");
    anyhow::ensure!(
        record_offsets(&pristine, SPOOL_SEED).is_empty(),
        "record bytes found in the database file: payload should be in segments"
    );
    // (segment index, offset of a record, its length)
    let wl = &*workload;
    let offsets: Vec<(usize, usize, usize)> = segments
        .iter()
        .enumerate()
        .flat_map(|(i, (_, bytes))| {
            record_offsets(bytes, SPOOL_SEED).into_iter().filter_map(move |o| {
                let (stream, index) = wl.identify(&bytes[o..])?;
                Some((i, o, wl.record(stream, index).len()))
            })
        })
        .collect();
    anyhow::ensure!(!offsets.is_empty(), "no record bytes found in the segment files");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xF1_1B5);
    let rounds = tier.pick(40, 400);
    let victim = world.path().join("victim.db");
    // kind → (injected, detected)
    let mut tally: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    let (mut anywhere_harmless, mut anywhere_missed) = (0u64, 0u64);
    for round in 0..rounds {
        let mut bytes = pristine.clone();
        let mut segs = segments.clone();
        let kind = match round % 4 {
            0 => {
                // A bit inside one record's bytes (of a live batch: nothing is acked without an
                // ingest), never past its end: what follows a commit's last record is its commit
                // record's trailer, which holds no payload.
                let (i, start, len) = offsets[rng.random_range(0..offsets.len())];
                let seg = &mut segs[i].1;
                let at = rng.random_range(start..(start + len.min(64)).min(seg.len()));
                seg[at] ^= 1 << rng.random_range(0..8);
                "payload_bit_flip"
            }
            1 => {
                let len = rng.random_range(0..bytes.len());
                bytes.truncate(len);
                "truncation"
            }
            2 => {
                let i = rng.random_range(0..segs.len());
                let len = rng.random_range(0..segs[i].1.len());
                segs[i].1.truncate(len);
                "segment_truncation"
            }
            _ => {
                let at = rng.random_range(0..bytes.len());
                bytes[at] ^= 1 << rng.random_range(0..8);
                "db_bit_flip_anywhere"
            }
        };
        for (suffix, seg) in &segs {
            std::fs::write(with_suffix(&victim, suffix), seg)?;
        }
        std::fs::write(&victim, &bytes)?;
        let (code, doc) = spool_check(&victim)?;
        assert!(code == 0 || code == 1, "spool check exit {code}: {doc}");
        let detected = code == 1;
        let entry = tally.entry(kind).or_default();
        entry.0 += 1;
        if detected {
            entry.1 += 1;
        }
        match kind {
            "payload_bit_flip" => {
                assert!(detected, "round {round}: payload flip not detected: {doc}");
                assert_eq!(doc["damaged_chunks"].as_array().map_or(0, Vec::len), 1, "exactly one chunk: {doc}");
            }
            "truncation" => assert!(detected, "round {round}: truncation to {} bytes not detected: {doc}", bytes.len()),
            "segment_truncation" => assert!(detected, "round {round}: segment truncation not detected: {doc}"),
            _ if !detected => {
                // Not detected: fine only if the flip changed no data (unused bytes of a page).
                if logical_dump(&victim).as_ref() == Some(&pristine_dump) {
                    anywhere_harmless += 1;
                } else {
                    anywhere_missed += 1;
                    let now = logical_dump(&victim).unwrap_or_default();
                    // Rows changed, their ends (where the unchecked columns are).
                    let changed: Vec<_> = now
                        .iter()
                        .filter(|row| !pristine_dump.contains(row))
                        .take(3)
                        .map(|row| &row[row.len().saturating_sub(120)..])
                        .collect();
                    eprintln!("round {round}: a flip changed data that no check covers: {changed:?}");
                }
            }
            _ => {}
        }
    }
    // Since schema version 3 every value has a checksum: a flip that changes data and goes
    // unseen is a gap in the checks.
    assert_eq!(anywhere_missed, 0, "flips changed data without being detected");
    let figures = serde_json::json!({
        "tier": tier.name(),
        "spool_bytes": pristine.len(),
        "segment_bytes": segments.iter().map(|(_, b)| b.len()).sum::<usize>(),
        "chunks": doc["chunks"],
        "seed": 0xF1_1B5,
        "injections": tally.iter().map(|(k, (i, d))| (k.to_string(), serde_json::json!({"injected": i, "detected": d}))).collect::<serde_json::Map<_, _>>(),
        "anywhere_undetected_harmless": anywhere_harmless,
        "anywhere_undetected_data_changed": anywhere_missed,
    });
    report("storage_faults_spool_check", &figures)?;
    eprintln!("{figures:#}");
    Ok(())
}

#[test]
fn corrupt_spool_chunks_are_quarantined_never_sent_and_the_agent_keeps_working() -> anyhow::Result<()> {
    let tier = Tier::current();
    let world = World::new("gw-sf-quarantine", "")?;
    spool_settings(&world, "chunk_target = \"16KiB\"")?;
    let old = Arc::new(Workload::new(SPOOL_SEED).with_sizes(16, 1500));
    let sent_old = build_spool(&world, &old, tier.pick(150, 1500))?;
    let spool = world.path().join("agent/spool.db");

    // Flip one bit in the records of `flips` different places (seeded), in the payload
    // segment files.
    let files = segment_files(&spool)?;
    let mut segs: Vec<Vec<u8>> = files.iter().map(std::fs::read).collect::<Result<_, _>>()?;
    let offsets: Vec<(usize, usize)> = segs
        .iter()
        .enumerate()
        .flat_map(|(i, bytes)| record_offsets(bytes, SPOOL_SEED).into_iter().map(move |o| (i, o)))
        .collect();
    anyhow::ensure!(!offsets.is_empty(), "no record bytes found in the segment files");
    let mut rng = rand::rngs::StdRng::seed_from_u64(0xBAD_C0DE);
    let flips = tier.pick(3, 12);
    for _ in 0..flips {
        let (i, start) = offsets[rng.random_range(0..offsets.len())];
        let at = rng.random_range(start..(start + 64).min(segs[i].len()));
        segs[i][at] ^= 1 << rng.random_range(0..8);
    }
    for (file, bytes) in files.iter().zip(&segs) {
        std::fs::write(file, bytes)?;
    }
    let (code, check) = spool_check(&spool)?;
    assert_eq!(code, 1, "damage found: {check}");
    let damaged_chunks = check["damaged_chunks"].as_array().map_or(0, Vec::len) as u64;
    let damaged_records = check["damaged_records"].as_u64().context("damaged_records")?;
    assert!(damaged_chunks >= 1 && damaged_records >= 1);

    // The agent starts on the damaged file, with the ingest up: it must quarantine the damaged
    // chunks (loudly), upload everything else, and take and deliver new data.
    let _ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let rt = rt()?;
    // Other stream names, so each checker sees only its own workload's records.
    let new = Arc::new(
        Workload::new(SPOOL_SEED + 1).with_streams(&["after.temperature", "after.vibration"]).with_sizes(16, 1500),
    );
    let sent_new = produce_all(&rt, &new, &world.intake_socket(), tier.pick(100, 1000), 20)?;
    drain(&rt, &world.intake_socket(), Duration::from_secs(120))?;
    agent.wait_log("spool chunk is corrupt", Duration::from_secs(5))?;
    let m = World::scrape(world.agent_metrics)?;
    let corrupt_metric = m.get("edge_uploader_spool_corrupt_chunks_total").copied().unwrap_or(-1.0);
    assert_eq!(corrupt_metric, damaged_chunks as f64, "metric counts each damaged chunk once");
    assert_eq!(m.get("edge_uploader_spool_quarantined_chunks").copied(), Some(damaged_chunks as f64));

    // Salvage, with the agent running: the records of every batch of the quarantined chunks that
    // checks out are exported and pushed again as new records. Then exactly the records of the
    // damaged batches are missing.
    let salvageable: u64 = check["damaged_chunks"]
        .as_array()
        .map_or(0, |a| a.iter().filter_map(|c| c["salvageable_records"].as_u64()).sum());
    let mut salvaged = 0u64;
    let mut asked = 0u64;
    for stream in &old.streams {
        // The agent's config: the report's lookup commands then name the device, from its
        // certificate.
        let out = Command::new(edge_testkit::bin("edge-uploader")?)
            .args(["spool", "export-quarantined", "--config", &world.agent_config.to_string_lossy()])
            .args(["--stream", stream, "--format", "raw"])
            .output()?;
        let err = String::from_utf8_lossy(&out.stderr);
        let records = edge_proto::records::RecordIter::new(&out.stdout).collect::<Result<Vec<_>, _>>()?.len() as u64;
        // 1: the stream has damaged batches, named on stderr; 0: none of its chunks is damaged.
        let quarantined_here = err.contains("(quarantined: ");
        assert_eq!(out.status.code(), Some(if quarantined_here { 1 } else { 0 }), "{err}");
        assert!(err.contains(&format!("exported {records} records of ")), "{err}");
        // The agent quarantined them for bytes that went bad in its spool: the report warns that
        // a chunk sent before that may be at the ingest already.
        assert_eq!(quarantined_here, err.contains("(quarantined: corrupt in spool: "), "{err}");
        assert!(!quarantined_here || err.contains("the agent may have sent it before"), "{err}");
        // Each such chunk comes with the command that asks the ingest, which is run here as
        // printed, with this world's ingest config. The flips came before the agent ever read
        // the chunks, so none of them is stored; the same command for a chunk of the stream that
        // was delivered finds it, so the key it prints (device, spool id) is the one sent under.
        let quarantined: Vec<String> = err
            .lines()
            .filter_map(|l| l.split_once(&format!("(stream {stream}, seq ")).and_then(|(_, r)| r.split_once(')')))
            .map(|(seq, _)| seq.to_owned())
            .collect();
        for line in err.lines().filter_map(|l| l.trim_start().strip_prefix("edge-ingest stored ")) {
            assert!(line.contains(&format!("--device=gw-sf-quarantine --stream={stream} --spool=")), "{line}");
            let mut args: Vec<String> = line.split_whitespace().map(str::to_owned).collect();
            let at = args.iter().position(|a| a == "--config").context("--config in the command")? + 1;
            args[at] = world.ingest_config.to_string_lossy().into_owned();
            let ask = |args: &[String]| -> anyhow::Result<(Option<i32>, String)> {
                let out = Command::new(edge_testkit::bin("edge-ingest")?).arg("stored").args(args).output()?;
                let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
                Ok((out.status.code(), said))
            };
            let (code, said) = ask(&args)?;
            assert_eq!(code, Some(1), "{line}: {said}");
            assert!(said.contains("not stored in "), "{said}");
            let delivered = (1..).map(|s: u64| s.to_string()).find(|s| !quarantined.contains(s)).context("a seq")?;
            let seq = args.iter().position(|a| a.starts_with("--seq=")).context("--seq= in the command")?;
            args[seq] = format!("--seq={delivered}");
            let (code, said) = ask(&args)?;
            assert_eq!(code, Some(0), "seq {delivered} of {stream} was delivered: {said}");
            asked += 1;
        }
        if records == 0 {
            continue;
        }
        salvaged += records;
        let file = world.path().join(format!("salvaged-{stream}.bin"));
        std::fs::write(&file, &out.stdout)?;
        let push = Command::new(edge_testkit::bin("edge-uploader")?)
            .args(["push", "--socket", &world.intake_socket().to_string_lossy(), "--stream", stream, "--framed"])
            .arg(&file)
            .output()?;
        let said = String::from_utf8_lossy(&push.stdout);
        assert!(push.status.success(), "{said}{}", String::from_utf8_lossy(&push.stderr));
        assert!(said.contains(&format!("accepted {records} records")), "{said}");
    }
    assert_eq!(salvaged, salvageable, "every batch spool check called salvageable was exported");
    assert!(asked > 0 || salvaged == 0, "every chunk with records to salvage came with a lookup command");
    assert!(salvaged > 0 || damaged_records == 0, "the flips left no batch to salvage; the seed should be changed");
    drain(&rt, &world.intake_socket(), Duration::from_secs(120))?;
    agent.terminate(Duration::from_secs(30))?;

    let old_report = check_store(&old, &world.data_dir(), &sent_old)?;
    let new_report = check_store(&new, &world.data_dir(), &sent_new)?;
    assert_eq!(
        old_report.lost,
        damaged_records - salvaged,
        "missing = exactly the records of the damaged batches: {old_report:?}"
    );
    assert_eq!(old_report.duplicates_stored + old_report.corrupted + old_report.unexpected, 0, "{old_report:?}");
    assert!(new_report.is_exact(), "new data after the damage: {new_report:?}");
    // After the agent quarantined them, the check lists them as known damage and exits 0.
    let (code, after) = spool_check(&spool)?;
    assert_eq!(code, 0, "quarantined damage only: {after}");
    assert_eq!(after["quarantined_damaged"].as_array().map_or(0, Vec::len) as u64, damaged_chunks);

    let figures = serde_json::json!({
        "tier": tier.name(),
        "bit_flips_injected": flips,
        "damaged_chunks_found_by_check": damaged_chunks,
        "damaged_records_found_by_check": damaged_records,
        "records_salvaged_from_quarantine": salvaged,
        "agent_corrupt_chunks_metric": corrupt_metric,
        "old_data": old_report.to_json(),
        "new_data": new_report.to_json(),
    });
    report("storage_faults_spool_quarantine", &figures)?;
    eprintln!("{figures:#}");
    Ok(())
}

/// Starts one endless producer per stream; returns their tasks and progress handles.
/// One producer per stream of `workload`, each sending `per_stream` records (`None`: until
/// stopped).
fn start_producers(
    rt: &tokio::runtime::Runtime,
    workload: &Arc<Workload>,
    socket: &Path,
    per_stream: Option<u64>,
) -> Vec<(tokio::task::JoinHandle<anyhow::Result<Vec<Sent>>>, Progress)> {
    (0..workload.streams.len())
        .map(|s| {
            let mut opts = ProducerOptions::new(s);
            opts.total = per_stream;
            opts.max_batch = 30;
            opts.retry_pause = Duration::from_millis(100);
            let progress = Progress::default();
            let task = rt.spawn(produce(workload.clone(), socket.to_owned(), opts, progress.clone()));
            (task, progress)
        })
        .collect()
}

fn total(ps: &[(tokio::task::JoinHandle<anyhow::Result<Vec<Sent>>>, Progress)], f: fn(&Progress) -> u64) -> u64 {
    ps.iter().map(|(_, p)| f(p)).sum()
}

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> anyhow::Result<bool>) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !cond()? {
        anyhow::ensure!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

fn metric(addr: std::net::SocketAddr, series: &str) -> anyhow::Result<f64> {
    Ok(World::scrape(addr)?.get(series).copied().unwrap_or(0.0))
}

/// The server's chunk limit holds for what goes on the wire: a chunk larger than the limit
/// that zstd shrinks below it is sent and stored, and only one still over it after compression
/// is quarantined, with a reason that says so.
#[test]
fn a_chunk_over_the_servers_limit_is_measured_after_compression() -> anyhow::Result<()> {
    let world = World::new("gw-limit-01", "")?;
    crate::common::rewrite(&world.ingest_config, "[server]\n", "[server]\nmax_chunk_bytes = \"64KiB\"\n")?;
    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    // 200 KiB of JSON that compresses to a few KiB, and 100 KiB that does not compress.
    let compressible = format!("{{\"stream\":\"big\",\"text\":\"{}\"}}", "temperature ok; ".repeat(12_800));
    let noise: String = {
        let mut x = 0x9E37_79B9_7F4A_7C15_u64;
        (0..100 * 1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                char::from(b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"[(x % 64) as usize])
            })
            .collect()
    };
    let incompressible = format!("{{\"stream\":\"noise\",\"text\":\"{noise}\"}}");
    crate::common::push(&world, "big", std::slice::from_ref(&compressible))?;
    crate::common::push(&world, "noise", &[incompressible])?;
    let doc = crate::common::wait_json(
        "one chunk stored and one quarantined",
        || crate::common::status_json(&world),
        |_, d| d["spool"]["quarantined_chunks"] == 1 && d["upload"]["records_acked_total"] == 1,
    )?;
    assert_eq!(doc["upload"]["chunks_acked_total"], 1, "{doc}");
    let stored = world.export_raw("big")?;
    assert_eq!(stored, [compressible.into_bytes()], "the compressible record stored once");
    assert!(world.export_raw("noise")?.is_empty());
    agent.wait_log("bytes on the wire", Duration::from_secs(5))?;
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    Ok(())
}

#[test]
fn agent_disk_full_answers_507_then_recovers_once_uploads_free_the_spool() -> anyhow::Result<()> {
    let world = World::new("gw-sf-agentfull", "")?;
    spool_settings(&world, "chunk_target = \"64KiB\"")?;
    // The spool's own cap (4 GiB) is far away: the file system (24 MiB, 8 of them the spool's
    // disk reserve) fills first, so this is SQLITE_FULL from ENOSPC.
    let Some(_fs) = Tmpfs::mount(&world.path().join("agent"), "24m") else { return Ok(()) };
    let mut agent = world.start_agent()?;
    let rt = rt()?;
    let workload = Arc::new(Workload::new(0xD15C_F011).with_sizes(200, 4000));
    let producers = start_producers(&rt, &workload, &world.intake_socket(), None);

    // No ingest yet: the spool fills the file system and intake refuses with 507.
    wait_for("a 507", Duration::from_secs(90), || Ok(total(&producers, |p| p.refused.load(Ordering::Relaxed)) > 0))?;
    let acked_at_full = total(&producers, |p| p.acked.load(Ordering::Relaxed));
    // A probe on a stream of its own (whatever it stores is not checked): a 512 KiB request
    // cannot slip into the last free pages the way a tiny one can.
    let line = format!("{}\n", "x".repeat(2047));
    let body = bytes::Bytes::from(line.repeat(256));
    let probe = rt.block_on(async {
        let mut client = IntakeClient::new(world.intake_socket());
        let mut last = None;
        for _ in 0..20 {
            let r = client.post("probe", "application/x-ndjson", body.clone()).await?;
            if r.status == 507 {
                return Ok::<_, anyhow::Error>(r);
            }
            last = Some(r);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::bail!("intake on a full disk never answered 507: {:?}", last.map(|r| (r.status, r.body)))
    })?;
    assert_eq!(probe.body["error"], "spool_full", "JSON body names the reason: {}", probe.body);
    assert_eq!(probe.body["detail"], "disk under the spool is full", "{}", probe.body);
    let full_since = Instant::now();
    std::thread::sleep(Duration::from_secs(2));
    let acked_while_full = total(&producers, |p| p.acked.load(Ordering::Relaxed)) - acked_at_full;

    // The ingest comes up: uploads and acks must free the spool even though its file system is
    // full, and intake must accept again.
    let mut ingest = world.start_ingest()?;
    let ingest_up = Instant::now();
    let full_before_ingest = ingest_up.duration_since(full_since);
    wait_for("intake to accept again", Duration::from_secs(90), || {
        Ok(total(&producers, |p| p.acked.load(Ordering::Relaxed)) > acked_at_full + acked_while_full + 100)
    })?;
    let recovered_after = ingest_up.elapsed();
    let refused = total(&producers, |p| p.refused.load(Ordering::Relaxed));
    for (_, p) in &producers {
        p.stop.store(true, Ordering::Relaxed);
    }
    let mut sent = Vec::new();
    for (task, _) in producers {
        sent.push(rt.block_on(task)??);
    }
    drain(&rt, &world.intake_socket(), Duration::from_secs(120))?;
    agent.terminate(Duration::from_secs(30))?;
    ingest.terminate(Duration::from_secs(30))?;
    let r = check_store(&workload, &world.data_dir(), &sent)?;
    assert!(r.is_exact() && r.lost == 0 && r.duplicates_stored == 0, "{r:?}");
    assert!(r.acked > acked_at_full, "records were acknowledged after the recovery: {r:?}");
    let figures = serde_json::json!({
        "fault_layer": "tmpfs size=24m under the spool (real ENOSPC); disk reserve 8 MiB (default)",
        "acked_before_full": acked_at_full,
        "acked_while_full_without_ingest": acked_while_full,
        "refused_507": refused,
        "full_for_s_before_ingest": full_before_ingest.as_secs_f64(),
        "recovered_s_after_ingest_up": recovered_after.as_secs_f64(),
        "check": r.to_json(),
    });
    report("storage_faults_agent_disk_full", &figures)?;
    eprintln!("{figures:#}");
    Ok(())
}

#[test]
fn agent_drop_oldest_drops_and_counts_exactly_what_is_missing() -> anyhow::Result<()> {
    let world = World::new("gw-sf-drop", "")?;
    let text = std::fs::read_to_string(&world.agent_config)?;
    std::fs::write(
        &world.agent_config,
        text.replacen(
            "max_bytes = \"4GiB\"",
            "max_bytes = \"1MiB\"\nfull_policy = \"drop_oldest\"\nchunk_target = \"32KiB\"",
            1,
        ),
    )?;
    let mut agent = world.start_agent()?;
    let rt = rt()?;
    let workload = Arc::new(Workload::new(0xD20B).with_sizes(100, 2000));
    // About 3 MiB through a 1 MiB spool with no ingest: the oldest chunks must go.
    let sent = produce_all(&rt, &workload, &world.intake_socket(), Tier::current().pick(1000, 5000), 30)?;
    let dropped_metric = metric(world.agent_metrics, "edge_uploader_dropped_records_total{reason=\"spool_full\"}")?;
    assert!(dropped_metric > 0.0, "nothing was dropped");
    let mut ingest = world.start_ingest()?;
    drain(&rt, &world.intake_socket(), Duration::from_secs(120))?;
    let dropped_after = metric(world.agent_metrics, "edge_uploader_dropped_records_total{reason=\"spool_full\"}")?;
    agent.terminate(Duration::from_secs(30))?;
    ingest.terminate(Duration::from_secs(30))?;
    let r = check_store(&workload, &world.data_dir(), &sent)?;
    assert_eq!(r.lost as f64, dropped_after, "missing records = the agent's dropped count: {r:?}");
    assert_eq!(r.duplicates_stored + r.corrupted + r.unexpected + r.partial_requests, 0, "{r:?}");
    let figures = serde_json::json!({
        "max_bytes": "1MiB", "full_policy": "drop_oldest",
        "dropped_records_metric": dropped_after,
        "check": r.to_json(),
    });
    report("storage_faults_agent_drop_oldest", &figures)?;
    eprintln!("{figures:#}");
    Ok(())
}

#[test]
fn ingest_disk_full_never_acks_backs_off_and_stores_everything_once_space_returns() -> anyhow::Result<()> {
    let world = World::new("gw-sf-ingestfull", "")?;
    // Another tenant takes all but 2 MiB of the file system; deleting it is "space returns".
    // The file system must then hold everything the producers sent in the meantime (tens of
    // MiB), or "full" simply goes on, with nothing wrong in the agent or the ingest.
    let Some(fs) = Tmpfs::mount(&world.data_dir(), "96m") else { return Ok(()) };
    let tenant = fs.dir.join("other-tenant");
    std::fs::write(&tenant, vec![7u8; 94 << 20])?;
    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let rt = rt()?;
    let workload = Arc::new(Workload::new(0x1C_F011).with_sizes(200, 4000));
    // A fixed amount, not "until space returns": how much that is depends on the machine's
    // speed, and on a quiet machine it came near or past what the 96 MiB file system holds. It
    // then stayed full for good and the drain timed out with the ingest rightly answering Retry.
    // 3 streams x 10,000 records of 1.3 KB on average (log-uniform 200..4000 B) is about 38 MB,
    // 20 times the 2 MiB left free, so the disk is full long before they finish.
    let per_stream = 10_000;
    let producers = start_producers(&rt, &workload, &world.intake_socket(), Some(per_stream));
    let retry_series = "edge_ingest_chunks_total{result=\"retry\"}";
    wait_for("the ingest to answer retry", Duration::from_secs(90), || {
        Ok(metric(world.ingest_metrics, retry_series)? > 0.0)
    })?;
    // The full period: count chunk attempts answered retry over a fixed window.
    let window = Duration::from_secs(5);
    let r0 = metric(world.ingest_metrics, retry_series)?;
    let s0 = metric(world.ingest_metrics, "edge_ingest_chunks_total{result=\"stored\"}")?;
    std::thread::sleep(window);
    let retries_in_window = metric(world.ingest_metrics, retry_series)? - r0;
    let stored_in_window = metric(world.ingest_metrics, "edge_ingest_chunks_total{result=\"stored\"}")? - s0;
    // Schedule: every retry round resends at most max_in_flight (32) chunks, and rounds are at
    // least backoff_min/2 (25 ms, full jitter) apart.
    let bound = 32.0 * (window.as_secs_f64() / 0.025 + 1.0);
    assert!(retries_in_window <= bound, "retry storm: {retries_in_window} attempts in {window:?} (bound {bound})");

    std::fs::remove_file(&tenant)?;
    let space_back = Instant::now();
    for (_, p) in &producers {
        p.stop.store(true, Ordering::Relaxed);
    }
    let mut sent = Vec::new();
    for (task, _) in producers {
        sent.push(rt.block_on(task)??);
    }
    drain(&rt, &world.intake_socket(), Duration::from_secs(120))?;
    let drained_after = space_back.elapsed();
    agent.terminate(Duration::from_secs(30))?;
    ingest.terminate(Duration::from_secs(30))?;
    // A restart must find no torn segment in its way, and export must read everything.
    let mut ingest = world.start_ingest()?;
    ingest.terminate(Duration::from_secs(30))?;
    let r = check_store(&workload, &world.data_dir(), &sent)?;
    assert!(r.is_exact() && r.lost == 0 && r.duplicates_stored == 0, "{r:?}");
    let figures = serde_json::json!({
        "fault_layer": "tmpfs size=96m as data_dir, 94 MiB of it taken by another file (real ENOSPC)",
        "retry_answers_in_window": retries_in_window,
        "stored_in_window": stored_in_window,
        "window_s": window.as_secs_f64(),
        "retry_bound_from_schedule": bound,
        "backoff": {"min_ms": 50, "max_ms": 1000, "max_in_flight": 32},
        "drained_s_after_space_returned": drained_after.as_secs_f64(),
        "check": r.to_json(),
    });
    report("storage_faults_ingest_disk_full", &figures)?;
    eprintln!("{figures:#}");
    Ok(())
}

/// The ingest's direct writes (`store/direct.rs`) were built and measured on ext4; ingest
/// machines often run XFS, and btrfs checksums what it writes. On each, the real daemons store
/// a workload of records from 100 B to 20 KB (commits of every length, so whole and partial
/// blocks, carried first blocks, segment rolls at 1 MiB), then a restart recovers the store,
/// and export must hold every record exactly once, with `O_DIRECT` in use (not the fallback).
#[test]
fn ingest_direct_writes_store_everything_exactly_once_on_xfs_and_btrfs() -> anyhow::Result<()> {
    let tier = Tier::current();
    let mut figures = serde_json::Map::new();
    for kind in ["xfs", "btrfs"] {
        let world = World::new(&format!("gw-sf-{kind}"), "")?;
        let Some(_fs) = LoopFs::mount(kind, &world.path().join(format!("{kind}.img")), &world.data_dir())? else {
            return Ok(());
        };
        let cfg = std::fs::read_to_string(&world.ingest_config)?;
        std::fs::write(&world.ingest_config, format!("{cfg}segment_max_bytes = \"1MiB\"\n"))?;
        let mut ingest = world.start_ingest()?;
        let mut agent = world.start_agent()?;
        let rt = rt()?;
        let workload = Arc::new(Workload::new(0xD1_5EC7).with_sizes(100, 20_000));
        let sent = produce_all(&rt, &workload, &world.intake_socket(), tier.pick(1_000, 10_000), 20)?;
        drain(&rt, &world.intake_socket(), Duration::from_secs(120))?;
        let direct = metric(world.ingest_metrics, "edge_ingest_store_direct_bytes_total")?;
        let stored = metric(world.ingest_metrics, "edge_ingest_bytes_total")?;
        agent.terminate(Duration::from_secs(30))?;
        ingest.terminate(Duration::from_secs(30))?;
        // A restart scans and recovers every segment the direct writes left.
        let mut ingest = world.start_ingest()?;
        ingest.terminate(Duration::from_secs(30))?;
        let r = check_store(&workload, &world.data_dir(), &sent)?;
        assert!(r.is_exact() && r.lost == 0 && r.duplicates_stored == 0, "{kind}: {r:?}");
        assert!(direct > 0.0, "{kind}: no byte went with O_DIRECT (the store fell back to the page cache)");
        figures.insert(
            kind.into(),
            serde_json::json!({"check": r.to_json(), "direct_bytes": direct, "stored_bytes": stored}),
        );
    }
    let figures = serde_json::Value::Object(figures);
    report("storage_faults_ingest_file_systems", &figures)?;
    eprintln!("{figures:#}");
    Ok(())
}

/// An agent whose full spool dropped a run of chunks, at an ingest where its device already has
/// as many gaps in the dedup index as `store.max_index_gaps_per_device` allows: the first chunk
/// after the dropped run would open one more gap, and no neighbour below it will ever come. The
/// agent's floor (protocol version 2) tells the ingest so, the ingest closes the gap, and the
/// backlog drains. Without the floor the agent retried that chunk forever.
#[test]
fn an_agent_whose_full_spool_dropped_chunks_drains_at_an_ingest_at_its_devices_gap_cap() -> anyhow::Result<()> {
    use edge_ingest::store::{ChunkKey, IncomingChunk, Payload, Store, StoreOptions};

    let device = "gw-sf-floor";
    let world = World::new(device, "")?;
    crate::common::rewrite(
        &world.agent_config,
        "max_bytes = \"4GiB\"",
        "max_bytes = \"1MiB\"\nfull_policy = \"drop_oldest\"\nchunk_target = \"32KiB\"",
    )?;
    let text = std::fs::read_to_string(&world.ingest_config)?;
    std::fs::write(&world.ingest_config, format!("{text}max_index_gaps_per_device = 1024\n"))?;
    let metrics = |addr| World::scrape(addr);
    let value = |m: &BTreeMap<String, f64>, series: &str| m.get(series).copied().unwrap_or(0.0);

    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let rt = rt()?;
    // Distinct, incompressible records of about 1 KB, so the spool fills by their count.
    let record = |i: usize| {
        let mut x = (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let noise: String = (0..120)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                format!("{:08x}", x as u32)
            })
            .collect();
        format!("{{\"i\":{i},\"noise\":\"{noise}\"}}")
    };
    let first: Vec<String> = (0..20).map(record).collect();
    crate::common::push(&world, "t", &first)?;
    drain(&rt, &world.intake_socket(), Duration::from_secs(60))?;
    ingest.terminate(Duration::from_secs(30))?;

    // About 3 MB through the 1 MiB spool with the ingest down: the oldest chunks go.
    let later: Vec<String> = (20..3020).map(record).collect();
    for part in later.chunks(250) {
        crate::common::push(&world, "t", part)?;
    }
    let dropped = value(&metrics(world.agent_metrics)?, "edge_uploader_dropped_records_total{reason=\"spool_full\"}");
    assert!(dropped > 0.0, "the spool dropped nothing");

    // Meanwhile the device filled its part of the ingest's index from another spool: 1025
    // ranges in one stream, 1024 gaps, the cap.
    {
        let (mut store, _) = Store::open(StoreOptions::new(world.data_dir()))?;
        let filler = (0..1025u64)
            .map(|i| {
                let payload = Payload::new(bytes::Bytes::from_static(&[1, 0, 0, 0, b'x']));
                IncomingChunk {
                    key: ChunkKey { device: device.into(), spool: [0xEE; 16], stream: "filler".into(), seq: 1 + 2 * i },
                    records: 1,
                    codec: edge_proto::Codec::None,
                    raw_len: 5,
                    checksum: payload.crc32c(),
                    created_ms: 1,
                    payload,
                }
            })
            .collect();
        let out = store.persist(filler);
        assert!(out.iter().all(|o| o.is_durable()), "{out:?}");
    }

    let restarted = Instant::now();
    let mut ingest = world.start_ingest()?;
    let status = drain(&rt, &world.intake_socket(), Duration::from_secs(60))
        .context("the agent must drain past the dropped run")?;
    let ingest_metrics = metrics(world.ingest_metrics)?;
    let refused = value(&ingest_metrics, "edge_ingest_store_index_refused_total");
    let floors_applied = value(&ingest_metrics, "edge_ingest_store_index_floors_total");
    let floors = value(&metrics(world.agent_metrics)?, "edge_uploader_floors_sent_total");
    let dropped = status["spool"]["dropped_records"].as_f64().context("dropped_records in the status")?;
    agent.terminate(Duration::from_secs(30))?;
    ingest.terminate(Duration::from_secs(30))?;
    assert!(refused > 0.0, "the first chunk after the dropped run met the cap");
    assert!(floors_applied >= 1.0 && floors >= 1.0, "floors applied {floors_applied}, sent {floors}; {status}");

    let stored = world.export_raw("t")?;
    let distinct: std::collections::HashSet<&Vec<u8>> = stored.iter().collect();
    assert_eq!(distinct.len(), stored.len(), "a record stored twice");
    assert_eq!(stored.len() as f64, 3020.0 - dropped, "stored = pushed - dropped");
    for want in [&first[0], &first[19], &later[later.len() - 1]] {
        assert!(distinct.contains(&want.as_bytes().to_vec()), "{want:.40} is missing");
    }
    eprintln!(
        "dropped {dropped}, refused {refused}, floors sent {floors}, applied {floors_applied}; drained {:?} after the restart",
        restarted.elapsed()
    );
    Ok(())
}

/// An ingest whose cap on a device's streams (`store.max_index_streams_per_device`) refuses a new
/// stream: it answers `Retry(Limit)` (protocol version 3), and the agent holds that stream's
/// chunks back without slowing the others, whose records go on being stored. Once the cap is
/// raised (an ingest restart), the held-back stream is stored too, every record once.
#[test]
fn a_stream_refused_at_the_ingests_cap_is_held_back_while_the_devices_other_streams_go_on() -> anyhow::Result<()> {
    use crate::common::{push, readings, status_json, wait_json};

    let world = World::new("gw-sf-streams", "")?;
    let text = std::fs::read_to_string(&world.ingest_config)?;
    std::fs::write(&world.ingest_config, format!("{text}max_index_streams_per_device = 1\n"))?;
    let mut ingest = world.start_ingest()?;
    let mut agent = world.start_agent()?;
    let acked = |n: u64| move |_: i32, d: &serde_json::Value| d["upload"]["records_acked_total"] == n;

    let first = readings("a", 10);
    push(&world, "a", &first)?;
    wait_json("the first stream stored", || status_json(&world), acked(10))?;
    let held = readings("b", 10);
    push(&world, "b", &held)?;
    wait_json(
        "the second stream refused",
        || status_json(&world),
        |_, d| d["upload"]["chunks_retry_total"].as_u64().is_some_and(|n| n > 0),
    )?;
    agent.wait_log("its chunks are held back", Duration::from_secs(10))?;
    // Each time the held-back chunk has been offered again (every backoff_max, 1 s here) and
    // refused, the first stream takes more records, and stores them.
    let retries = |d: &serde_json::Value| d["upload"]["chunks_retry_total"].as_u64().unwrap_or(0);
    let mut seen = retries(&status_json(&world)?.1);
    let mut more = Vec::new();
    for round in 0..4u64 {
        let doc = wait_json("the held-back chunk offered again", || status_json(&world), |_, d| retries(d) > seen)?;
        seen = retries(&doc);
        let records: Vec<String> =
            readings("a", 10).into_iter().map(|r| r.replace("\"i\":", &format!("\"round\":{round},\"i\":"))).collect();
        push(&world, "a", &records)?;
        more.extend(records);
        wait_json("the first stream stored again", || status_json(&world), acked(20 + 10 * round))?;
    }
    assert!(ingest.terminate(Duration::from_secs(30))?.success());

    // The cap raised: the held-back stream is stored on the next connection.
    std::fs::write(&world.ingest_config, format!("{text}max_index_streams_per_device = 2\n"))?;
    let mut ingest = world.start_ingest()?;
    wait_json(
        "everything stored",
        || status_json(&world),
        |_, d| d["upload"]["records_acked_total"] == 60 && d["spool"]["total_bytes"] == 0,
    )?;
    assert!(agent.terminate(Duration::from_secs(30))?.success());
    assert!(ingest.terminate(Duration::from_secs(30))?.success());
    let stored = |stream: &str| -> anyhow::Result<Vec<String>> {
        Ok(world.export_raw(stream)?.into_iter().map(|r| String::from_utf8_lossy(&r).into_owned()).collect())
    };
    let mut a = first.clone();
    a.extend(more);
    assert_eq!(stored("a")?, a, "every record of the first stream once, in order");
    assert_eq!(stored("b")?, held, "and of the held-back one");
    Ok(())
}
