//! `edge-bench spool`: the spool's own cost, in process, against the floor of the same durable
//! work done with a plain append-only file.
//!
//! The agent's profile (BENCHMARKS.md) puts half of its CPU in the kernel, writing and reading
//! spool pages. This case isolates that part, with no HTTP and no QUIC, so it can be measured
//! and compared across designs:
//!
//! * **spool (page size N)**: `edge-spool` at `durability = full`, 512 KiB chunks, on a file
//!   created with SQLite page size N (the shipped spool uses SQLite's default, 4096). Write
//!   phase: requests of one record each, `per_commit` requests per [`Spool::commit`] (one
//!   transaction and one WAL fsync, as the agent's writer thread does under load). Read phase:
//!   every sealed chunk read with [`SpoolReader::read_payload`] (CRC-checked) and acked, 32 acks
//!   per commit, as the uploader does.
//! * **append-only file**: the same bytes and the same CRC-32C per record written with one
//!   `write` and one `fdatasync` per group commit, then read back in 512 KiB `pread`s with the
//!   CRC-32C of each read, then the file deleted. No index, no crash recovery: the floor any
//!   durable spool design pays on this machine.
//! * **spool (page size N, S streams)** (`--streams`): the first page size's variant on a spool
//!   that knows S − 1 other streams, idle (one record each, sealed and acked before the
//!   phases): what a spool's commits cost by the number of streams it holds, as a multiple of
//!   the same variant with one stream.
//!
//! Everything runs on the calling thread; CPU is this process's `utime + stime`, written bytes
//! its `write_bytes` (`/proc/self/io`).

use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use edge_proto::records::encode_record;
use edge_spool::{AppendOutcome, AppendRequest, Batch, ChunkId, SealWhat, Spool, SpoolOptions};

use crate::sys;

const GIB: f64 = (1u64 << 30) as f64;
const CHUNK: u64 = 512 << 10;

/// What to run.
#[derive(Debug, Clone)]
pub struct Opts {
    pub mib: u64,
    pub record: usize,
    pub per_commit: usize,
    pub page_sizes: Vec<u32>,
    /// Streams the spool knows; counts past 1 are variants at the first page size.
    pub streams: Vec<u64>,
    pub reps: usize,
}

/// One phase of one variant.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Sample {
    pub variant: String,
    pub phase: &'static str,
    pub cpu_s_per_gib: f64,
    pub mb_per_s: f64,
    pub written_per_byte: f64,
    /// With `--streams`: how much the process's resident set grew while the idle streams were
    /// made, per stream (bytes; SQLite's page cache, at most its default 2 MB, included). Only
    /// the first repetition's is worth reading: later ones reuse memory the earlier spools freed
    /// and the allocator kept, and grow less or not at all.
    pub rss_per_idle_stream: Option<f64>,
}

struct Meter {
    cpu: f64,
    written: u64,
    start: Instant,
}

impl Meter {
    fn start() -> anyhow::Result<Meter> {
        Ok(Meter { cpu: sys::self_cpu_seconds()?, written: self_write_bytes()?, start: Instant::now() })
    }

    fn sample(self, variant: &str, phase: &'static str, bytes: u64) -> anyhow::Result<Sample> {
        let secs = self.start.elapsed().as_secs_f64();
        let cpu = sys::self_cpu_seconds()? - self.cpu;
        let written = self_write_bytes()?.saturating_sub(self.written);
        Ok(Sample {
            variant: variant.to_owned(),
            phase,
            cpu_s_per_gib: cpu / (bytes as f64 / GIB),
            mb_per_s: bytes as f64 / 1e6 / secs,
            written_per_byte: written as f64 / bytes as f64,
            rss_per_idle_stream: None,
        })
    }
}

fn self_write_bytes() -> anyhow::Result<u64> {
    sys::write_bytes(std::process::id())
}

/// Deterministic, incompressible-looking record bytes.
fn record(len: usize, n: u64) -> Vec<u8> {
    let mut x = n.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x.to_le_bytes()[0]
        })
        .collect()
}

/// Runs every variant `reps` times, printing progress to stderr.
pub fn run(opts: &Opts, dir: &Path) -> anyhow::Result<Vec<Sample>> {
    let mut out = Vec::new();
    let total = opts.mib << 20;
    let records = total / opts.record as u64;
    // A few distinct records, reused: generating bytes must not be what is measured.
    let pool: Vec<Vec<u8>> = (0..64).map(|n| record(opts.record, n)).collect();
    let first_page = opts.page_sizes.first().copied().unwrap_or(4096);
    let variants: Vec<(u32, u64)> = opts
        .page_sizes
        .iter()
        .map(|&page| (page, 1))
        .chain(opts.streams.iter().filter(|&&n| n > 1).map(|&n| (first_page, n)))
        .collect();
    for rep in 0..opts.reps {
        for &(page, streams) in &variants {
            let variant = variant_name(page, streams);
            let d = dir.join(format!("spool-{page}-{streams}"));
            let _ = std::fs::remove_dir_all(&d);
            std::fs::create_dir_all(&d)?;
            let [w, r] = spool_once(&d.join("spool.db"), page, streams, &pool, records, opts.per_commit, &variant)?;
            progress(rep, &w, &r);
            out.extend([w, r]);
            std::fs::remove_dir_all(&d)?;
        }
        let variant = "append-only file".to_owned();
        let [w, r] = file_once(&dir.join("segment"), &pool, records, opts.per_commit, &variant)?;
        progress(rep, &w, &r);
        out.extend([w, r]);
    }
    Ok(out)
}

fn variant_name(page: u32, streams: u64) -> String {
    if streams > 1 { format!("spool, page size {page}, {streams} streams") } else { format!("spool, page size {page}") }
}

fn progress(rep: usize, w: &Sample, r: &Sample) {
    eprintln!(
        "[spool rep {}] {}: write {:.2} CPU-s/GiB {:.0} MB/s wear {:.2}; read+ack {:.2} CPU-s/GiB {:.0} MB/s",
        rep + 1,
        w.variant,
        w.cpu_s_per_gib,
        w.mb_per_s,
        w.written_per_byte,
        r.cpu_s_per_gib,
        r.mb_per_s
    );
}

fn spool_once(
    path: &Path,
    page: u32,
    streams: u64,
    pool: &[Vec<u8>],
    records: u64,
    per_commit: usize,
    variant: &str,
) -> anyhow::Result<[Sample; 2]> {
    {
        // The page size of a SQLite file is fixed when its first page is written: create the
        // file with it, in WAL mode, before the spool opens it and writes its schema.
        let conn = rusqlite::Connection::open(path)?;
        conn.pragma_update(None, "page_size", page)?;
        let mode: String = conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0))?;
        anyhow::ensure!(mode.eq_ignore_ascii_case("wal"), "journal_mode {mode}");
    }
    let mut opts = SpoolOptions::new(path);
    opts.chunk_target_bytes = CHUNK;
    opts.max_bytes = u64::MAX / 2;
    // `--streams` past the agent's default cap measures the spool, not the cap.
    opts.max_streams = u64::MAX;
    let (mut spool, _report) = Spool::open(opts).context("opening the spool")?;
    let got: u32 = rusqlite::Connection::open(path)?.pragma_query_value(None, "page_size", |r| r.get(0))?;
    anyhow::ensure!(got == page, "page size {got}, wanted {page}");
    let bytes = records * pool[0].len() as u64;
    let rss = sys::rss_bytes(std::process::id())?;
    idle_streams(&mut spool, streams.saturating_sub(1))?;
    let grown = sys::rss_bytes(std::process::id())?.saturating_sub(rss);

    let meter = Meter::start()?;
    let mut n = 0u64;
    while n < records {
        let reqs: Vec<AppendRequest> = (0..per_commit as u64)
            .take_while(|i| n + i < records)
            .map(|i| {
                let mut data = Vec::with_capacity(pool[0].len() + 4);
                encode_record(&mut data, &pool[((n + i) % pool.len() as u64) as usize]);
                AppendRequest { batches: vec![Batch { stream: "bench".into(), data, records: 1 }] }
            })
            .collect();
        n += reqs.len() as u64;
        // As the agent's writer asks (a linger seal that finds nothing due here).
        let report = spool.commit(&reqs, &[], SealWhat::Due, 1)?;
        anyhow::ensure!(report.appends?.iter().all(|o| *o == AppendOutcome::Accepted), "append refused");
    }
    spool.commit(&[], &[], SealWhat::All, 1)?;
    let mut write = meter.sample(variant, "write", bytes)?;
    if streams > 1 {
        write.rss_per_idle_stream = Some(grown as f64 / (streams - 1) as f64);
    }

    let meter = Meter::start()?;
    let mut reader = spool.reader()?;
    let mut after = None;
    let mut read = 0u64;
    loop {
        let metas = reader.sealed_after(after, 32)?;
        let Some(last) = metas.last() else { break };
        after = Some(last.id);
        let mut acks: Vec<ChunkId> = Vec::with_capacity(metas.len());
        for m in &metas {
            read += reader.read_payload(m)?.data.len() as u64;
            acks.push(m.id);
        }
        spool.commit(&[], &acks, SealWhat::Nothing, 1)?;
    }
    let read_ack = meter.sample(variant, "read+ack", bytes)?;
    anyhow::ensure!(read == bytes + 4 * records, "read {read} bytes back, wrote {bytes} + framing");
    Ok([write, read_ack])
}

/// Gives the spool `n` streams besides the one under test, with one record each, sealed and
/// acked: streams a spool never forgets (their sequence numbers go on), with nothing to send.
fn idle_streams(spool: &mut Spool, n: u64) -> anyhow::Result<()> {
    let mut made = 0u64;
    while made < n {
        let reqs: Vec<AppendRequest> = (made..n.min(made + 1000))
            .map(|i| {
                let mut data = Vec::new();
                encode_record(&mut data, b"idle");
                AppendRequest { batches: vec![Batch { stream: format!("idle-{i:08}"), data, records: 1 }] }
            })
            .collect();
        made += reqs.len() as u64;
        let report = spool.commit(&reqs, &[], SealWhat::All, 1)?;
        anyhow::ensure!(report.appends?.iter().all(|o| *o == AppendOutcome::Accepted), "append refused");
        let acks: Vec<ChunkId> = report.sealed.iter().map(|m| m.id).collect();
        spool.commit(&[], &acks, SealWhat::Nothing, 1)?;
    }
    anyhow::ensure!(spool.stats().streams.len() as u64 == n, "{n} idle streams made");
    Ok(())
}

fn file_once(
    path: &Path,
    pool: &[Vec<u8>],
    records: u64,
    per_commit: usize,
    variant: &str,
) -> anyhow::Result<[Sample; 2]> {
    let bytes = records * pool[0].len() as u64;
    let meter = Meter::start()?;
    let mut file = std::fs::OpenOptions::new().create(true).truncate(true).write(true).read(true).open(path)?;
    let mut crcs = Vec::with_capacity(usize::try_from(records).unwrap_or(0));
    let mut buf = Vec::with_capacity(per_commit * (pool[0].len() + 4));
    let mut n = 0u64;
    while n < records {
        buf.clear();
        for i in (0..per_commit as u64).take_while(|i| n + i < records) {
            let r = &pool[((n + i) % pool.len() as u64) as usize];
            crcs.push(edge_proto::crc32c(r));
            encode_record(&mut buf, r);
        }
        n += per_commit as u64;
        file.write_all(&buf)?;
        file.sync_data()?;
    }
    let write = meter.sample(variant, "write", bytes)?;

    let meter = Meter::start()?;
    let len = file.metadata()?.len();
    let mut off = 0u64;
    let mut crc = 0u32;
    while off < len {
        let mut chunk = vec![0u8; usize::try_from(CHUNK.min(len - off))?];
        file.read_exact_at(&mut chunk, off)?;
        crc = edge_proto::crc32c_append(crc, &chunk);
        off += chunk.len() as u64;
    }
    drop(file);
    std::fs::remove_file(path)?;
    let read = meter.sample(variant, "read+ack", bytes)?;
    anyhow::ensure!(off == bytes + 4 * records && crc != 0 && !crcs.is_empty(), "read {off} bytes back");
    Ok([write, read])
}

/// The Markdown table: medians [min-max] per variant and phase, and each spool variant's CPU
/// per GiB as a multiple of the append-only file's in the same phase.
pub fn markdown(samples: &[Sample], opts: &Opts, command: &str) -> String {
    let mut md = format!(
        "`{command}`: {} MiB of {}-byte records, {} per commit, {} repetitions (median [min-max])\n\n\
         | variant | phase | CPU-s/GiB | × file | MB/s | bytes written per byte |\n|---|---|---|---|---|---|\n",
        opts.mib, opts.record, opts.per_commit, opts.reps
    );
    let mut variants: Vec<&str> = Vec::new();
    for s in samples {
        if !variants.contains(&s.variant.as_str()) {
            variants.push(&s.variant);
        }
    }
    let pick = |v: &str, phase: &str, f: fn(&Sample) -> f64| -> Option<sys::Stat> {
        let xs: Vec<f64> = samples.iter().filter(|s| s.variant == v && s.phase == phase).map(f).collect();
        sys::Stat::of(&xs)
    };
    for phase in ["write", "read+ack"] {
        let floor = pick("append-only file", phase, |s| s.cpu_s_per_gib).map(|s| s.median);
        for v in &variants {
            let (Some(cpu), Some(mbs), Some(wear)) = (
                pick(v, phase, |s| s.cpu_s_per_gib),
                pick(v, phase, |s| s.mb_per_s),
                pick(v, phase, |s| s.written_per_byte),
            ) else {
                continue;
            };
            let ratio = floor.map_or("–".to_owned(), |f| format!("{:.2}", cpu.median / f));
            md.push_str(&format!(
                "| {v} | {phase} | {} | {ratio} | {} | {} |\n",
                cpu.show(2),
                mbs.show(0),
                wear.show(2)
            ));
        }
    }
    let first_page = opts.page_sizes.first().copied().unwrap_or(4096);
    let many: Vec<u64> = opts.streams.iter().copied().filter(|&n| n > 1).collect();
    if !many.is_empty() {
        let one = variant_name(first_page, 1);
        md.push_str(&format!(
            "\nBy the streams the spool knows (page size {first_page}; medians of this run, as multiples of one \
             stream's; the resident set's growth while the idle streams were made, per stream, SQLite's page \
             cache included, the largest of the repetitions: later ones reuse memory the allocator kept):\n\n| streams | phase | CPU-s/GiB ÷ 1 stream's | MB/s ÷ 1 stream's | RSS growth per idle \
             stream, bytes |\n|---|---|---|---|---|\n"
        ));
        for phase in ["write", "read+ack"] {
            for &n in &many {
                let v = variant_name(first_page, n);
                let ratio = |f: fn(&Sample) -> f64| match (pick(&v, phase, f), pick(&one, phase, f)) {
                    (Some(a), Some(b)) if b.median > 0.0 => format!("{:.2}", a.median / b.median),
                    _ => "–".to_owned(),
                };
                let rss: Vec<f64> = samples
                    .iter()
                    .filter(|s| s.variant == v && s.phase == phase)
                    .filter_map(|s| s.rss_per_idle_stream)
                    .collect();
                let rss = sys::Stat::of(&rss).map_or("–".to_owned(), |s| format!("{:.0}", s.max));
                md.push_str(&format!(
                    "| {n} | {phase} | {} | {} | {rss} |\n",
                    ratio(|s| s.cpu_s_per_gib),
                    ratio(|s| s.mb_per_s)
                ));
            }
        }
    }
    md
}
