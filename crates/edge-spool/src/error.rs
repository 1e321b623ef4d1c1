//! The one error type of the crate, [`SpoolError`], and the mapping from SQLite errors.

use std::path::PathBuf;

use rusqlite::ErrorCode;

use crate::ChunkId;

/// Everything that can go wrong in the spool.
///
/// After any error the [`Spool`](crate::Spool) is still usable: the failed transaction was
/// rolled back and the in-memory counters were left as they were.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum SpoolError {
    /// SQLite failed; `context` says what the spool was doing. Nothing of the call was committed.
    #[error("spool database error while {context}")]
    Sqlite {
        /// What the spool was doing, e.g. "inserting a batch".
        context: &'static str,
        /// The SQLite error.
        #[source]
        source: rusqlite::Error,
    },
    /// The disk (or SQLite's page limit) is full (`SQLITE_FULL`). The transaction was rolled back;
    /// nothing of the call was stored. Retry once space is freed (e.g. by acks).
    #[error("spool disk is full; the transaction was rolled back")]
    DiskFull,
    /// A chunk failed a consistency check (batch CRC-32C, sizes); its bytes were not returned.
    /// The caller should [`quarantine`](crate::Spool::quarantine) it.
    #[error("chunk {chunk} is corrupt: {detail}")]
    Corrupt {
        /// The chunk.
        chunk: ChunkId,
        /// What did not match.
        detail: String,
    },
    /// The chunk is no longer in the spool (acked, dropped by `DropOldest`, or purged).
    #[error("chunk {0} is no longer in the spool")]
    ChunkGone(ChunkId),
    /// A file-system operation (creating the directory, moving a corrupt file aside) failed.
    #[error("spool I/O error on {}", path.display())]
    Io {
        /// The path involved.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Another process (or another [`Spool`](crate::Spool) of this one) has the spool open.
    /// Nothing was read or changed.
    #[error("spool {} is in use by {}; it has one writer at a time (stop the agent first)", path.display(),
        holder.map_or_else(|| "another process".to_owned(), |pid| format!("process {pid}")))]
    Locked {
        /// The database path.
        path: PathBuf,
        /// The holder's process id, as it wrote it in the lock file (when readable).
        holder: Option<u32>,
    },
    /// The file was written by a newer version of this crate. It is left untouched.
    #[error("spool schema version {found} is newer than the supported version {supported}")]
    UnsupportedSchema {
        /// `PRAGMA user_version` of the file.
        found: i64,
        /// The newest version this build knows.
        supported: i64,
    },
    /// The database passed SQLite's own checks but breaks a spool invariant (e.g. a row that
    /// references a stream that does not exist). At open this leads to quarantine.
    #[error("spool database is inconsistent: {0}")]
    Inconsistent(String),
    /// The database was still unusable after the bad file had been moved aside and a new one
    /// created (the file system itself is failing).
    #[error("spool database {} is unusable even after quarantine: {detail}", path.display())]
    Unrecoverable {
        /// The database path.
        path: PathBuf,
        /// What failed.
        detail: String,
    },
}

impl SpoolError {
    /// Wraps a SQLite error, turning `SQLITE_FULL` into [`SpoolError::DiskFull`].
    pub(crate) fn sqlite(context: &'static str, source: rusqlite::Error) -> Self {
        if sqlite_code(&source) == Some(ErrorCode::DiskFull) {
            SpoolError::DiskFull
        } else {
            SpoolError::Sqlite { context, source }
        }
    }

    /// True for errors that mean "the database file is damaged, not a database, or holds values
    /// our schema cannot have". Lock, permission and I/O errors are not corruption: a file is
    /// never moved aside because of them. Public so the uploader can quarantine a chunk whose
    /// pages SQLite itself finds damaged, instead of failing the whole upload loop on it.
    pub fn is_corruption(&self) -> bool {
        match self {
            SpoolError::Sqlite { source, .. } => match source {
                rusqlite::Error::SqliteFailure(f, _) => {
                    matches!(f.code, ErrorCode::DatabaseCorrupt | ErrorCode::NotADatabase)
                }
                rusqlite::Error::IntegralValueOutOfRange(..)
                | rusqlite::Error::FromSqlConversionFailure(..)
                | rusqlite::Error::InvalidColumnType(..) => true,
                _ => false,
            },
            SpoolError::Inconsistent(_) => true,
            _ => false,
        }
    }
}

/// The primary SQLite result code of an error, if it came from SQLite.
pub(crate) fn sqlite_code(e: &rusqlite::Error) -> Option<ErrorCode> {
    match e {
        rusqlite::Error::SqliteFailure(f, _) => Some(f.code),
        _ => None,
    }
}

/// `map_err` helper: `.map_err(ctx("inserting a batch"))`.
pub(crate) fn ctx(context: &'static str) -> impl FnOnce(rusqlite::Error) -> SpoolError {
    move |e| SpoolError::sqlite(context, e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failure(code: i32) -> rusqlite::Error {
        rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(code), None)
    }

    #[test]
    fn sqlite_full_maps_to_disk_full() {
        let e = SpoolError::sqlite("x", failure(rusqlite::ffi::SQLITE_FULL));
        assert!(matches!(e, SpoolError::DiskFull));
    }

    #[test]
    fn corrupt_and_notadb_count_as_corruption_but_busy_does_not() {
        assert!(SpoolError::sqlite("x", failure(rusqlite::ffi::SQLITE_CORRUPT)).is_corruption());
        assert!(SpoolError::sqlite("x", failure(rusqlite::ffi::SQLITE_NOTADB)).is_corruption());
        assert!(!SpoolError::sqlite("x", failure(rusqlite::ffi::SQLITE_BUSY)).is_corruption());
    }
}
