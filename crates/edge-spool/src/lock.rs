//! One writer per spool file, across processes.
//!
//! [`Spool`](crate::Spool) keeps the file's accounting and the payload segments' write
//! positions in memory, so a second process writing the same file (a second agent started by
//! hand with another config, a maintenance command while the agent runs) would append over the
//! first one's segment bytes and commit against counters it never saw. `open` therefore takes
//! an exclusive `flock` on `<path>-lock` and holds it for the life of the `Spool`; the kernel
//! drops it when the process dies, SIGKILL and power cuts included, so nothing has to be
//! cleaned up after a crash.
//!
//! A file of its own rather than the database: SQLite takes POSIX record locks on the
//! database, and where `flock` is emulated with record locks (NFS) the two would collide. The
//! lock file is never deleted (deleting a lock file lets two processes lock two different
//! files). It holds the holder's process id, for the error message only.

use std::fs::{File, OpenOptions, TryLockError};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::SpoolError;
use crate::recovery::with_suffix;

/// The exclusive lock on a spool file; released when dropped (or when the process exits).
#[derive(Debug)]
pub(crate) struct SpoolLock {
    _file: File,
}

impl SpoolLock {
    /// Takes the lock of the spool at `db`, without waiting, creating the directory and the
    /// lock file when missing.
    ///
    /// # Errors
    /// [`SpoolError::Locked`] when another open file description holds it (another process, or
    /// another `Spool` of this one); [`SpoolError::Io`] when the lock file cannot be opened or
    /// the file system refuses locks.
    pub(crate) fn acquire(db: &Path) -> Result<SpoolLock, SpoolError> {
        if let Some(parent) = db.parent().filter(|p| !p.as_os_str().is_empty()) {
            crate::segment::create_dir_all_synced(parent)?;
        }
        let path = lock_path(db);
        let io = |source| SpoolError::Io { path: path.clone(), source };
        // Read-only where it may not be written (left by a run as another user): `flock` needs
        // no write access, and the pid is for messages only.
        let mut file = match OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => File::open(&path).map_err(io)?,
            other => other.map_err(io)?,
        };
        match file.try_lock() {
            Ok(()) => {}
            Err(TryLockError::WouldBlock) => {
                let mut holder = String::new();
                // Best effort: the holder may be between truncating and writing its id.
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim().parse::<u32>().ok();
                return Err(SpoolError::Locked { path: db.to_owned(), holder });
            }
            Err(TryLockError::Error(e)) => return Err(io(e)),
        }
        // The id is for the message of whoever is refused next; failing to write it does not
        // weaken the lock.
        let _ = file
            .set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(format!("{}\n", std::process::id()).as_bytes()));
        Ok(SpoolLock { _file: file })
    }
}

/// `<db>-lock`, next to the database's `-wal`, `-shm` and `-reserve`.
pub(crate) fn lock_path(db: &Path) -> PathBuf {
    with_suffix(db, "-lock")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_second_holder_is_refused_with_the_first_ones_pid_until_the_first_is_dropped() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("spool.db");
        let first = SpoolLock::acquire(&db).expect("first");
        match SpoolLock::acquire(&db) {
            Err(SpoolError::Locked { path, holder }) => {
                assert_eq!(path, db);
                assert_eq!(holder, Some(std::process::id()));
            }
            other => panic!("expected Locked, got {other:?}"),
        }
        drop(first);
        SpoolLock::acquire(&db).expect("free again once dropped");
        assert!(lock_path(&db).is_file(), "the lock file is kept");
    }
}
