//! The WAL's sync, taken off the writer's path: under [`Durability::Full`](crate::Durability::Full)
//! the writer may run `synchronous=NORMAL` and hand each commit to a [`WalSync`] on another
//! thread, which `fdatasync`s `-wal` while the writer builds the next transaction (see
//! [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync)).
//!
//! Under `NORMAL` a commit is visible to every connection as soon as `COMMIT` returns, before
//! it is durable. A chunk read and sent in that window could be stored by the server and then
//! be rolled back by a power cut: sealed again under the same sequence number with other
//! records, it would be deduplicated away. So readers see chunks only up to the *visible*
//! watermark, the newest chunk id a completed sync covers ([`SpoolReader::sealed_after`]
//! filters by it).
//!
//! [`SpoolReader::sealed_after`]: crate::SpoolReader::sealed_after

use std::fs::File;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

use crate::{ChunkId, SpoolError};

/// The newest chunk id readers may list; `i64::MAX` while every commit is durable when it
/// returns. Shared by the writer, its [`WalSync`] and every reader made by
/// [`Spool::reader`](crate::Spool::reader).
#[derive(Debug, Clone)]
pub(crate) struct Visible(Arc<AtomicI64>);

impl Default for Visible {
    fn default() -> Self {
        Visible(Arc::new(AtomicI64::new(i64::MAX)))
    }
}

impl Visible {
    pub(crate) fn get(&self) -> i64 {
        self.0.load(Ordering::Acquire)
    }

    pub(crate) fn set(&self, through: i64) {
        self.0.store(through, Ordering::Release);
    }

    fn raise(&self, through: i64) {
        self.0.fetch_max(through, Ordering::AcqRel);
    }
}

/// Makes the writer's commits durable after the fact; made by
/// [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync). `Send`: it is meant for a thread of
/// its own.
///
/// It holds the WAL open, as the writer's connection does: SQLite keeps one WAL file for as
/// long as a connection is open (a checkpoint rewinds or truncates it, never replaces it), and
/// this value must not outlive the [`Spool`](crate::Spool) it came from.
#[derive(Debug)]
pub struct WalSync {
    wal: PathBuf,
    file: File,
    visible: Visible,
    /// The first sync that failed. Linux may drop the dirty pages of a failed write-back and
    /// report the error once: a later successful `fdatasync` would prove nothing, so a failure
    /// stays a failure for the life of this value.
    failed: Option<String>,
}

impl WalSync {
    /// Opens the WAL file `wal`.
    pub(crate) fn open(wal: PathBuf, visible: Visible) -> Result<Self, SpoolError> {
        match File::open(&wal) {
            Ok(file) => Ok(WalSync { wal, file, visible, failed: None }),
            Err(source) => Err(SpoolError::Io { path: wal, source }),
        }
    }

    /// `fdatasync`s the WAL. Every commit that returned before this call is durable once it
    /// returns `Ok`; then readers may list chunks up to `sealed_through` (the newest chunk id
    /// those commits sealed, from [`Spool::newest_chunk`](crate::Spool::newest_chunk) after
    /// them).
    ///
    /// # Errors
    /// [`SpoolError::Io`] when the WAL cannot be synced, and on every call after such a
    /// failure: the commits since the last good sync may be lost in a power cut.
    pub fn sync(&mut self, sealed_through: Option<ChunkId>) -> Result<(), SpoolError> {
        if let Some(first) = &self.failed {
            let detail = format!("an earlier fsync of the WAL failed ({first}); nothing since is durable");
            return Err(SpoolError::Io { path: self.wal.clone(), source: std::io::Error::other(detail) });
        }
        if let Err(e) = self.file.sync_data() {
            self.failed = Some(e.to_string());
            return Err(SpoolError::Io { path: self.wal.clone(), source: e });
        }
        if let Some(c) = sealed_through {
            self.visible.raise(c.0);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_sync_stays_failed_and_raises_no_watermark() {
        let dir = tempfile::tempdir().expect("temp dir");
        let wal = dir.path().join("spool.db-wal");
        std::fs::write(&wal, b"frames").expect("write");
        let visible = Visible::default();
        visible.set(3);
        let mut sync = WalSync::open(wal.clone(), visible.clone()).expect("open");
        sync.sync(Some(ChunkId(4))).expect("sync");
        assert_eq!(visible.get(), 4);

        // A file that cannot be synced (a pipe: EINVAL), as a failing disk would fail it.
        let (pipe, _writer) = std::io::pipe().expect("pipe");
        let good = std::mem::replace(&mut sync.file, File::from(std::os::fd::OwnedFd::from(pipe)));
        let err = sync.sync(Some(ChunkId(5))).expect_err("a pipe cannot be synced");
        assert!(err.to_string().contains("spool.db-wal"), "names the file: {err}");
        assert_eq!(visible.get(), 4);
        // The file could be synced again, but what the failed sync should have made durable
        // may be lost: no later sync succeeds.
        sync.file = good;
        assert!(sync.sync(Some(ChunkId(5))).is_err());
        assert_eq!(visible.get(), 4);
        // A new WalSync (a restart) syncs.
        WalSync::open(wal, visible.clone()).expect("open").sync(Some(ChunkId(5))).expect("sync");
        assert_eq!(visible.get(), 5);
    }

    #[test]
    fn a_missing_wal_is_an_error_naming_it() {
        let dir = tempfile::tempdir().expect("temp dir");
        let err = WalSync::open(dir.path().join("spool.db-wal"), Visible::default()).expect_err("no file");
        assert!(err.to_string().contains("spool.db-wal"), "{err}");
    }
}
