//! `spool_recovery`: a small valid spool file, damaged by fuzzer-chosen mutations, then
//! `Spool::open`.
//!
//! The template is built once per process with `edge_spool::Spool` itself: two streams, sealed
//! chunks (one acked), open batches. Two snapshots are kept: the main file and `-wal` copied
//! while the writer is still open (as a crash leaves them, the WAL holding the latest commits),
//! and the main file after a clean close (checkpointed, no WAL).
//!
//! Input: `data[0]` picks the snapshot (bit 0), whether mutations go to the main file or the
//! payload segment file (bits 1 to 3 equal to 0b011) and the machine the file is opened on
//! (bit 4: the one the template was made on, or another, which gives it a new spool id), then
//! a program of mutations, each an opcode byte and its
//! arguments: flip a byte, overwrite a byte, overwrite a 4-byte big-endian field (SQLite headers
//! are big-endian), truncate, append garbage, delete the segment file, delete the WAL. Each
//! targets the WAL when bit 7 of the opcode is set. Positions are 3 bytes, folded into the
//! file's length.
//!
//! Asserts, for every input:
//! - no panic and no hang (libFuzzer's `-timeout` catches a hang);
//! - `Spool::open` either opens, or fails with `UnsupportedSchema` (a flipped `user_version`),
//!   the only error the recovery contract allows for a damaged file on a healthy file system;
//! - when the file was moved aside, the report names a path that exists;
//! - an opened spool can list, read (a `Corrupt` chunk is quarantined), append, seal, ack and
//!   purge without panicking, its stats stay self-consistent, and it opens again after that,
//!   on the same machine with the same spool id.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use edge_spool::{AppendRequest, Batch, Durability, Spool, SpoolError, SpoolOptions};

/// The two snapshots: `(main file, wal)` taken while open, the main file after close; and the
/// payload segment file, the same in both (it is written before each commit and never again).
struct Template {
    open: (Vec<u8>, Vec<u8>),
    closed: Vec<u8>,
    segment: Vec<u8>,
}

/// The template's one payload segment file, next to `spool.db`.
const SEGMENT: &str = "spool.db-seg-0000000001";

/// The machine the template is made on.
const MADE_ON: &str = "machine-a";

fn options(path: &Path, host: &str) -> SpoolOptions {
    let mut o = SpoolOptions::new(path);
    o.host_id = Some(host.to_owned());
    o.durability = Durability::Normal;
    o.chunk_target_bytes = 64;
    o.max_bytes = 1 << 20;
    o
}

fn batch(stream: &str, fill: u8, records: u32) -> Batch {
    let mut data = Vec::new();
    for i in 0..records {
        let rec = vec![fill.wrapping_add(i as u8); 7 + i as usize];
        data.extend_from_slice(&(rec.len() as u32).to_le_bytes());
        data.extend_from_slice(&rec);
    }
    Batch { stream: stream.into(), data, records }
}

/// A directory for scratch files: `/dev/shm` when there is one (each iteration writes a few
/// files; RAM keeps that fast), else the system temp dir.
pub fn scratch_dir() -> tempfile::TempDir {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    tempfile::Builder::new().prefix("edge-fuzz-").tempdir_in(base).expect("creating a scratch directory")
}

fn template() -> &'static Template {
    static T: OnceLock<Template> = OnceLock::new();
    T.get_or_init(|| {
        let dir = scratch_dir();
        let path = dir.path().join("spool.db");
        let (mut spool, _) = Spool::open(options(&path, MADE_ON)).expect("creating the template spool");
        for t in 0..6u8 {
            let req = AppendRequest { batches: vec![batch("temp", t, 3), batch("hum.x", t ^ 0x55, 2)] };
            spool.append(&[req], 1_000 + u64::from(t)).expect("appending to the template");
        }
        spool.seal_all(2_000).expect("sealing the template");
        let chunks = spool.reader().expect("reader").sealed_after(None, 100).expect("listing the template");
        let first = chunks.first().expect("the template has chunks").id;
        spool.ack(&[first]).expect("acking in the template");
        let req = AppendRequest { batches: vec![batch("temp", 0xee, 1)] };
        spool.append(&[req], 3_000).expect("an open batch in the template");
        let db = std::fs::read(&path).expect("reading the template");
        let wal = std::fs::read(dir.path().join("spool.db-wal")).expect("reading the template WAL");
        drop(spool);
        let closed = std::fs::read(&path).expect("reading the closed template");
        let segment = std::fs::read(dir.path().join(SEGMENT)).expect("reading the template's segment");
        Template { open: (db, wal), closed, segment }
    })
}

struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> Option<u8> {
        let (&b, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(b)
    }
    fn pos(&mut self, len: usize) -> Option<usize> {
        let v = u32::from_le_bytes([self.byte()?, self.byte()?, self.byte()?, 0]) as usize;
        Some(if len == 0 { 0 } else { v % len })
    }
}

/// The files a mutation program left, and the machine to open them on.
struct Mutated {
    db: Vec<u8>,
    wal: Option<Vec<u8>>,
    segment: Option<Vec<u8>>,
    host: &'static str,
}

/// Applies the mutation program to the template's files.
fn mutate(data: &[u8]) -> Mutated {
    let t = template();
    let mut input = Input(data);
    let first = input.byte().unwrap_or(0);
    let (mut db, mut wal) = match first {
        b if b & 1 == 1 => (t.closed.clone(), None),
        _ => (t.open.0.clone(), Some(t.open.1.clone())),
    };
    let mut segment = Some(t.segment.clone());
    // Bits 1 to 3 of the first byte equal to 0b011: mutations that do not target the WAL target
    // the segment file (a pattern none of the regression inputs found before segments has).
    let on_segment = (first >> 1) & 0b111 == 0b011;
    let host = if first & 0x10 == 0 { MADE_ON } else { "machine-b" };
    let mut ops = 0;
    while let Some(op) = input.byte() {
        ops += 1;
        if ops > 64 {
            break;
        }
        let file = match (wal.as_mut(), segment.as_mut()) {
            (Some(wal), _) if op & 0x80 != 0 => wal,
            (_, Some(seg)) if on_segment => seg,
            _ => &mut db,
        };
        match op & 0x7f {
            0..=39 => {
                let Some(p) = input.pos(file.len()) else { break };
                let x = input.byte().unwrap_or(1).max(1);
                if let Some(b) = file.get_mut(p) {
                    *b ^= x;
                }
            }
            40..=59 => {
                let Some(p) = input.pos(file.len()) else { break };
                let v = input.byte().unwrap_or(0);
                if let Some(b) = file.get_mut(p) {
                    *b = v;
                }
            }
            60..=79 => {
                let Some(p) = input.pos(file.len()) else { break };
                let v = input.pos(1 << 24).unwrap_or(0) as u32 | u32::from(input.byte().unwrap_or(0)) << 24;
                let end = (p + 4).min(file.len());
                file[p..end].copy_from_slice(&v.to_be_bytes()[..end - p]);
            }
            80..=99 => {
                let Some(p) = input.pos(file.len() + 1) else { break };
                file.truncate(p);
            }
            100..=119 => {
                let n = usize::from(input.byte().unwrap_or(0)) * 16;
                let fill = input.byte().unwrap_or(0);
                file.extend(std::iter::repeat_n(fill, n));
            }
            120..=123 => segment = None,
            _ => wal = None,
        }
    }
    Mutated { db, wal, segment, host }
}

/// Runs one input; panics if a property is broken.
pub fn run(data: &[u8]) {
    let Mutated { db, wal, segment, host } = mutate(data);
    let dir = scratch_dir();
    let path = dir.path().join("spool.db");
    std::fs::write(&path, &db).expect("writing the damaged file");
    if let Some(wal) = &wal {
        std::fs::write(dir.path().join("spool.db-wal"), wal).expect("writing the damaged WAL");
    }
    if let Some(segment) = &segment {
        std::fs::write(dir.path().join(SEGMENT), segment).expect("writing the damaged segment");
    }
    let (mut spool, report) = match Spool::open(options(&path, host)) {
        Ok(opened) => opened,
        Err(SpoolError::UnsupportedSchema { found, supported }) => {
            assert!(found > supported);
            assert!(path.exists(), "a newer-schema file must be left in place");
            return;
        }
        Err(e) => panic!("a damaged file must be moved aside or opened, not refused: {e:?}"),
    };
    if let Some(moved) = &report.quarantined {
        assert!(moved.exists(), "moved-aside file {} does not exist", moved.display());
        assert!(report.created, "a quarantined file is replaced by a new spool");
    }
    exercise(&mut spool);
    let id = spool.id();
    drop(spool);
    let (mut again, report) = Spool::open(options(&path, host)).expect("a spool we opened and used must open again");
    assert_eq!(report.quarantined, None, "the file we wrote was moved aside on reopen");
    assert_eq!(report.host, edge_spool::HostCheck::Same, "the first open recorded this machine");
    assert_eq!(again.id(), id, "the same machine, the same spool id");
    exercise(&mut again);
}

fn exercise(spool: &mut Spool) {
    check_stats(spool);
    let Ok(mut reader) = spool.reader() else { return };
    let chunks = match reader.sealed_after(None, 1000) {
        Ok(c) => c,
        Err(e) => {
            assert!(!e.to_string().is_empty());
            Vec::new()
        }
    };
    let mut good = Vec::new();
    for meta in &chunks {
        match reader.read(meta) {
            Ok(bytes) => {
                assert_eq!(bytes.len() as u64, meta.bytes, "read {} bytes of chunk {meta:?}", bytes.len());
                good.push(meta.id);
            }
            Err(SpoolError::Corrupt { chunk, .. }) => {
                assert_eq!(chunk, meta.id);
                let _ = spool.quarantine(chunk, "fuzz: corrupt");
            }
            Err(e) => assert!(!e.to_string().is_empty()),
        }
    }
    check_stats(spool);
    let _ = spool.append(&[AppendRequest { batches: vec![batch("temp", 1, 2), batch("new", 2, 1)] }], 5_000);
    let _ = spool.seal_all(6_000);
    check_stats(spool);
    if let Some(first) = good.first() {
        let _ = spool.ack(&[*first]);
    }
    let _ = spool.purge_quarantined();
    check_stats(spool);
}

fn check_stats(spool: &Spool) {
    let s = spool.stats();
    assert_eq!(s.total_bytes, s.sealed_bytes + s.open_bytes, "{s:?}");
    assert_eq!(s.streams.iter().map(|st| st.sealed_chunks).sum::<u64>(), s.sealed_chunks, "{s:?}");
}

/// Seed programs: no damage, each snapshot, a flipped header byte, a truncated WAL, garbage.
#[allow(dead_code)] // Used by the corpus generator and the regression tests, not the fuzz target.
pub fn seeds() -> Vec<Vec<u8>> {
    vec![
        vec![0],
        vec![1],
        // Flip the page-size byte of the header; flip user_version (offset 60..64).
        vec![0, 0, 16, 0, 0, 0x40],
        vec![1, 0, 63, 0, 0, 0x02],
        // Truncate the WAL in its middle; truncate the main file to 100 bytes.
        vec![0, 0x80 | 80, 0x00, 0x80, 0x00],
        vec![1, 80, 100, 0, 0],
        // Garbage after the main file; no WAL at all.
        vec![0, 100, 64, 0xaa],
        vec![0, 127],
        // Overwrite a 4-byte field in the middle of the WAL.
        vec![0, 0x80 | 60, 0x20, 0x10, 0x00, 0xff, 0xff, 0xff, 0x7f],
        // The payload segment: a flipped byte, cut short, garbage after it, deleted.
        vec![0b0110, 0, 40, 0, 0, 0x01],
        vec![0b0111, 80, 50, 0, 0],
        vec![0b0110, 100, 8, 0x55],
        vec![0b0111, 120],
        // Opened on another machine: a new spool id, from either snapshot and with the WAL cut.
        vec![0x10],
        vec![0x11],
        vec![0x10, 0x80 | 80, 0x00, 0x80, 0x00],
    ]
}
