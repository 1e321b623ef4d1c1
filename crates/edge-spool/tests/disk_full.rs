//! The file system under the spool fills up (a real `ENOSPC` from a small tmpfs, not the spool's
//! own `max_bytes` cap): appends fail with `DiskFull` and store nothing, acks and quarantines
//! still go through or fail cleanly, and once space returns the same `Spool` works again and
//! the file passes `quick_check` at the next open.
//!
//! Needs root for `mount -t tmpfs`; without it the test says SKIPPED on stderr and returns
//! (SQLite's `max_page_count` is no stand-in here: it never fails a checkpoint, which is exactly
//! what wedged the spool on a real full file system before the disk reserve existed).

use std::path::Path;
use std::process::Command;

use edge_spool::{AppendOutcome, AppendRequest, Batch, ChunkId, Spool, SpoolError, SpoolOptions};

/// A tmpfs of `size` mounted on a fresh directory, unmounted on drop.
struct Tmpfs {
    dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Tmpfs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Tmpfs { dir })
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

fn noise(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn req(stream: &str, seed: u64, len: usize) -> AppendRequest {
    AppendRequest { batches: vec![Batch { stream: stream.into(), data: noise(seed, len), records: 1 }] }
}

fn sealed_ids(spool: &Spool) -> Vec<ChunkId> {
    spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list").into_iter().map(|m| m.id).collect()
}

/// Appends 32 KiB requests until the file system refuses one; returns how many went in and
/// checks the refusal is `DiskFull` and stored nothing.
fn append_until_full(spool: &mut Spool, seed: &mut u64) -> u64 {
    let mut accepted = 0u64;
    loop {
        let before = spool.stats().total_bytes;
        *seed += 1;
        match spool.append(&[req("s", *seed, 32 << 10)], *seed * 10_000) {
            Ok(o) => {
                assert_eq!(o, vec![AppendOutcome::Accepted]);
                accepted += 1;
            }
            Err(SpoolError::DiskFull) => {
                assert_eq!(spool.stats().total_bytes, before, "a refused append stored nothing");
                return accepted;
            }
            Err(e) => panic!("append on a filling disk: expected DiskFull, got {e:?}"),
        }
        assert!(accepted < 10_000, "the file system never filled up");
    }
}

#[test]
fn enospc_under_the_spool_fails_appends_cleanly_and_acks_still_free_space() {
    let Some(fs) = Tmpfs::mount("32m") else {
        eprintln!("SKIPPED: `mount -t tmpfs` failed (not root?); this test needs a real full file system");
        return;
    };
    // Another tenant of the file system; deleting it later is "space returns", enough for the
    // reserve to come back (it needs its own size plus a WAL's worth free).
    let tenant = fs.path().join("other-tenant");
    std::fs::write(&tenant, vec![1u8; 6 << 20]).expect("tenant file");
    let path = fs.path().join("spool.db");
    let mut opts = SpoolOptions::new(&path);
    opts.chunk_target_bytes = 64 << 10;
    let (mut spool, _) = Spool::open(opts.clone()).expect("open");
    assert_eq!(std::fs::metadata(fs.path().join("spool.db-reserve")).expect("reserve").len(), opts.disk_reserve_bytes);

    // Phase 1: the file system fills up; appends fail cleanly, again and again.
    let mut seed = 0;
    let first = append_until_full(&mut spool, &mut seed);
    assert!(first > 10, "only {first} requests fit");
    // Each refusal cuts the WAL back (a checkpoint), and payload segments may take the space
    // it gave back; the space the WAL regrows into shrinks (measured: 80, 29, 10, 4, 1, 1
    // requests), until none is left.
    let mut after_checkpoint = 0;
    let mut last = first;
    for round in 0.. {
        let n = append_until_full(&mut spool, &mut seed);
        if n == 0 {
            break;
        }
        assert!(n <= last && round < 20, "round {round}: {n} more requests after {last}: the disk does not fill up");
        after_checkpoint += n;
        last = n;
    }
    for _ in 0..3 {
        assert_eq!(append_until_full(&mut spool, &mut seed), 0, "still full");
    }

    // Phase 2: sealing and acks must still commit on the full file system (they used to fail
    // with SQLITE_FULL forever: nothing could ever be deleted).
    spool.seal_all(1).expect("seal on a full disk");
    let ids = sealed_ids(&spool);
    let r = spool.ack(&ids).expect("ack on a full disk");
    assert_eq!(r.acked as usize, ids.len());
    assert_eq!(spool.stats().total_bytes, 0);
    assert!(spool.disk_reserve_releases() >= 1, "the reserve was used");

    // Phase 3: the freed pages inside the file take new data although the file system has no
    // room for the reserve yet.
    let second = append_until_full(&mut spool, &mut seed);
    assert!(second > 10, "after the acks only {second} requests fit");

    // Phase 4: space returns (the other tenant goes away); acks free the spool, the reserve
    // comes back, appends go on.
    std::fs::remove_file(&tenant).expect("remove tenant");
    spool.seal_all(2).expect("seal");
    let ids = sealed_ids(&spool);
    spool.ack(&ids).expect("ack");
    let o = spool.append(&[req("s", 1, 32 << 10)], u64::MAX / 2).expect("append after space returned");
    assert_eq!(o, vec![AppendOutcome::Accepted]);
    assert_eq!(std::fs::metadata(fs.path().join("spool.db-reserve")).expect("reserve").len(), opts.disk_reserve_bytes);
    let stats = spool.stats();
    drop(spool);

    // The file is sound and the counters on disk equal those in memory.
    let (spool, report) = Spool::open(opts).expect("reopen");
    assert!(report.quarantined.is_none(), "file was moved aside: {report:?}");
    assert_eq!(spool.stats(), stats);
    eprintln!(
        "requests of 32 KiB accepted: {first} until full, {after_checkpoint} more after the WAL checkpoint, \
         {second} after acking everything"
    );
}
