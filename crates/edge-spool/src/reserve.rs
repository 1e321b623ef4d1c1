//! Disk headroom: a ballast file next to the database (`<path>-reserve`) that the spool deletes
//! when the file system itself is full, so the writes that *free* space can still commit.
//!
//! Why it is needed: in WAL mode every write, a `DELETE` included, appends pages to `-wal`, and
//! the WAL is reset only after a checkpoint copied it into the main file, which may have to grow
//! the main file. Once the file system is full (`ENOSPC` → `SQLITE_FULL`), neither can happen:
//! acks and seals fail like appends, nothing is ever deleted, and the spool stays full forever
//! even though the server has stored everything (measured on an 8 MiB tmpfs: after the first
//! `SQLITE_FULL`, every later ack failed too). With the ballast, an ack, seal or quarantine that
//! hits `SQLITE_FULL` deletes the ballast, runs `wal_checkpoint(TRUNCATE)` and tries again.
//!
//! Appends never use the headroom: while the ballast is missing, an append first tries to write
//! it again ([`Reserve::try_restore`], at most once per [`RESTORE_EVERY_MS`], and only when the
//! file system has room for it plus [`WAL_MARGIN`], so the restored ballast does not take the
//! WAL's last blocks) and is refused with `DiskFull` when that fails. So producer data never
//! eats the space that acks need. Acks give space back by deleting payload segment files (see
//! `segment.rs`), so a drained spool on a file system that someone else filled gets its
//! ballast back as soon as the file system has room for it. (Up to version 3, payload bytes
//! lived in the database and acks left free pages inside it; appends could reuse those. Since
//! version 4 new payload needs the file system's space, and free pages are no excuse.)
//!
//! The ballast is written with real bytes (not `set_len`), because a sparse file reserves
//! nothing. A size of 0 disables the mechanism.

use std::fs::{self, File};
use std::io::{self, Write};
use std::path::PathBuf;

/// Minimum time between two attempts to write the ballast again while it is missing.
pub(crate) const RESTORE_EVERY_MS: u64 = 1000;

/// Free space the file system must keep beyond the ballast before it is written back: about
/// what the WAL grows to between two automatic checkpoints (1000 pages of 4 KiB).
pub(crate) const WAL_MARGIN: u64 = 4 << 20;

/// The ballast file and its state.
#[derive(Debug)]
pub(crate) struct Reserve {
    path: PathBuf,
    size: u64,
    /// The ballast is on disk at full size.
    present: bool,
    /// `now_ms` of the last failed restore attempt.
    last_attempt_ms: Option<u64>,
    /// Times the ballast was released for a space-freeing write (for tests and logs).
    pub(crate) releases: u64,
}

impl Reserve {
    /// Makes sure the ballast exists at `size` bytes (best effort: on a full disk it stays
    /// missing and appends are refused until it can be written).
    pub(crate) fn open(path: PathBuf, size: u64) -> Reserve {
        let mut r = Reserve { path, size, present: false, last_attempt_ms: None, releases: 0 };
        if size == 0 {
            let _ = fs::remove_file(&r.path);
            r.present = true;
            return r;
        }
        if fs::metadata(&r.path).is_ok_and(|m| m.len() == size) {
            r.present = true;
        } else if let Err(e) = r.write() {
            tracing::warn!(path = %r.path.display(), bytes = size, error = %e,
                "could not write the spool's disk reserve; appends are refused until it fits");
        }
        r
    }

    /// Whether the ballast is in place, or could be written again now (tried at most once per
    /// [`RESTORE_EVERY_MS`] of `now_ms`).
    pub(crate) fn try_restore(&mut self, now_ms: u64) -> bool {
        if self.present {
            return true;
        }
        if self.last_attempt_ms.is_some_and(|t| now_ms >= t && now_ms - t < RESTORE_EVERY_MS) {
            return false;
        }
        if !self.room_for_ballast_and_wal() {
            self.last_attempt_ms = Some(now_ms);
            return false;
        }
        match self.write() {
            Ok(()) => {
                tracing::info!(path = %self.path.display(), "disk space is back: spool disk reserve restored");
                true
            }
            Err(_) => {
                self.last_attempt_ms = Some(now_ms);
                false
            }
        }
    }

    /// Whether the ballast is in place (always true when disabled).
    pub(crate) fn is_present(&self) -> bool {
        self.present
    }

    /// Deletes the ballast to give a space-freeing write room. Returns false if there was
    /// nothing to release (disabled or already released).
    pub(crate) fn release(&mut self) -> bool {
        if !self.present || self.size == 0 {
            return false;
        }
        if let Err(e) = fs::remove_file(&self.path)
            && e.kind() != io::ErrorKind::NotFound
        {
            tracing::error!(path = %self.path.display(), error = %e, "could not delete the spool's disk reserve");
            return false;
        }
        self.present = false;
        self.last_attempt_ms = None;
        self.releases += 1;
        tracing::warn!(path = %self.path.display(), bytes = self.size,
            "file system under the spool is full: released the disk reserve so acks can free space");
        true
    }

    /// Whether the file system has room for the ballast plus [`WAL_MARGIN`] for the WAL that
    /// keeps the spool working. Restoring into the last free blocks would only take them from
    /// the WAL, so the next write fails and releases the ballast again, over and over. True when
    /// the file system cannot say (the write then decides).
    fn room_for_ballast_and_wal(&self) -> bool {
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => std::path::Path::new("."),
        };
        match rustix::fs::statvfs(dir) {
            Ok(st) => st.f_bavail.saturating_mul(st.f_frsize) >= self.size.saturating_add(WAL_MARGIN),
            Err(_) => true,
        }
    }

    /// Writes the ballast with real bytes and fsyncs it; removes a partial file on failure.
    fn write(&mut self) -> io::Result<()> {
        let result = (|| {
            let mut f = File::create(&self.path)?;
            let block = vec![0u8; 64 << 10];
            let mut left = self.size;
            while left > 0 {
                let n = usize::try_from(left.min(block.len() as u64)).unwrap_or(block.len());
                f.write_all(&block[..n])?;
                left -= n as u64;
            }
            f.sync_all()
        })();
        match result {
            Ok(()) => {
                self.present = true;
                Ok(())
            }
            Err(e) => {
                let _ = fs::remove_file(&self.path);
                Err(e)
            }
        }
    }
}
