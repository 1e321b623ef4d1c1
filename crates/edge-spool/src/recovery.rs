//! Opening the database file: quick check, migration, loading counters, and moving a bad file
//! aside so the agent never wedges on it.
//!
//! A file is moved aside only for *corruption* (not a database, `quick_check` failures, rows
//! our schema cannot hold or that fail their row checksums, a foreign SQLite database, a missing
//! spool id, a header that makes SQLite open a writable file read-only). Lock, permission and
//! I/O errors are returned to the caller instead: they say nothing about the file's contents.
//!
//! Sidecars (`-wal`, `-shm`, `-journal`) and payload segments are renamed *before* the main file. A crash between
//! the renames then leaves either the old database without its WAL (checked again at the next
//! open) or no database at all, never a fresh database next to a stale WAL.

use std::ffi::OsString;
use std::fs;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension};

use crate::error::ctx;
use crate::schema::{self, META_SPOOL_ID, Migrated};
use crate::segment;
use crate::state::State;
use crate::{SpoolError, SpoolId, SpoolOptions};

/// A ready writer connection and what was loaded from it.
#[derive(Debug)]
pub(crate) struct Opened {
    pub conn: Connection,
    pub id: SpoolId,
    pub state: State,
    pub created: bool,
    /// The commits added back from the payload segments' commit records.
    pub replayed: crate::journal::Replayed,
    /// What the check of the batches above the synced-segments mark dropped.
    pub unsynced: crate::unsynced::Dropped,
    /// What the check of the file's machine found (`host.rs`).
    pub host: crate::HostCheck,
}

/// The outcome of one attempt to open the file.
enum Attempt {
    Ready(Box<Opened>),
    /// The file is bad; the reason.
    Bad(String),
}

/// Opens (creating or replacing as needed) the spool at `opts.path`. Returns where a bad file
/// was moved, if one was.
pub(crate) fn open(opts: &SpoolOptions) -> Result<(Opened, Option<PathBuf>), SpoolError> {
    let path = opts.path.as_path();
    if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
        crate::segment::create_dir_all_synced(parent)?;
    }
    let detail = match attempt(opts)? {
        Attempt::Ready(o) => return Ok((*o, None)),
        Attempt::Bad(detail) => detail,
    };
    let moved = move_aside(path)?;
    tracing::error!(
        path = %path.display(),
        moved_to = %moved.display(),
        %detail,
        "spool database is corrupt; moved it aside and created a new spool with a new identity"
    );
    match attempt(opts)? {
        Attempt::Ready(o) => Ok((*o, Some(moved))),
        Attempt::Bad(detail) => Err(SpoolError::Unrecoverable { path: path.to_owned(), detail }),
    }
}

/// One attempt; the connection is closed before a `Bad` result is returned.
fn attempt(opts: &SpoolOptions) -> Result<Attempt, SpoolError> {
    match try_open(opts) {
        Ok(a) => Ok(a),
        Err(e) if e.is_corruption() || is_schema_mismatch(&e) => Ok(Attempt::Bad(error_chain(&e))),
        Err(e) => Err(e),
    }
}

/// SQLite's generic `SQLITE_ERROR` while opening, e.g. "no such column: value" after one flipped
/// byte in the schema text, which `quick_check` does not read (found by the `spool_recovery` fuzz
/// target): our fixed statements do not fit the file, so it is not a spool we can use. Lock,
/// permission, I/O and full-disk failures have codes of their own and are still returned.
fn is_schema_mismatch(e: &SpoolError) -> bool {
    match e {
        SpoolError::Sqlite { source: rusqlite::Error::SqlInputError { error, .. }, .. }
        | SpoolError::Sqlite { source: rusqlite::Error::SqliteFailure(error, _), .. } => {
            error.code == rusqlite::ErrorCode::Unknown
        }
        _ => false,
    }
}

fn try_open(opts: &SpoolOptions) -> Result<Attempt, SpoolError> {
    let mut conn = Connection::open(&opts.path).map_err(ctx("opening the database"))?;
    conn.busy_timeout(schema::BUSY_TIMEOUT).map_err(ctx("setting busy_timeout"))?;
    if let Some(problems) = schema::quick_check(&conn)? {
        return Ok(Attempt::Bad(format!("quick_check: {problems}")));
    }
    // Decide what the file is before writing anything to it (even the WAL switch is a write).
    let (version, tables) = schema::inspect(&conn)?;
    // A header whose write-format version is above 2 makes SQLite open the file read-only
    // (found by the `spool_recovery` fuzz target). The spool would open, then refuse every
    // append and ack. On a read-only file system or file mode, that is not the file's fault.
    if conn.is_readonly(rusqlite::MAIN_DB).map_err(ctx("asking whether the file is writable"))? {
        if fs::OpenOptions::new().write(true).open(&opts.path).is_ok() {
            return Ok(Attempt::Bad("SQLite opens the file read-only: its header forbids writing".into()));
        }
        return Err(SpoolError::sqlite(
            "opening the database for writing",
            rusqlite::Error::SqliteFailure(rusqlite::ffi::Error::new(rusqlite::ffi::SQLITE_READONLY), None),
        ));
    }
    if version > schema::SCHEMA_VERSION {
        return Err(SpoolError::UnsupportedSchema { found: version, supported: schema::SCHEMA_VERSION });
    }
    if version < 0 || (version == 0 && tables > 0) {
        return Ok(Attempt::Bad(format!(
            "a SQLite database that is not an edge spool \
             (user_version {version}, {tables} schema objects)"
        )));
    }
    schema::configure_writer(&conn, opts.durability)?;
    crate::crash_point!("spool::open::before_migrate");
    let created = match schema::migrate(&mut conn)? {
        Migrated::Created => true,
        Migrated::Existing => false,
        Migrated::Foreign => {
            return Ok(Attempt::Bad("a SQLite database that is not an edge spool (user_version 0 with tables)".into()));
        }
    };
    crate::crash_point!("spool::open::after_migrate");
    if let Some(problems) = repair_indexes(&conn)? {
        return Ok(Attempt::Bad(format!("integrity_check after REINDEX: {problems}")));
    }
    let raw: Option<Vec<u8>> = conn
        .query_row("SELECT value FROM meta WHERE key = ?1", [META_SPOOL_ID], |r| r.get(0))
        .optional()
        .map_err(ctx("reading the spool id"))?;
    // A missing row is a file with no spool id: moved aside like any other (fuzz: spool_recovery).
    let Some(raw) = raw else {
        return Ok(Attempt::Bad("the spool id row is missing".into()));
    };
    let Ok(bytes) = <[u8; 16]>::try_from(raw.as_slice()) else {
        return Ok(Attempt::Bad(format!("spool id has {} bytes, expected 16", raw.len())));
    };
    let mut state = State::load(&conn)?;
    // A new file's segments belong to a database that is gone: nothing to replay into it.
    let replayed = if created {
        crate::journal::Replayed::default()
    } else {
        crate::journal::replay(&mut conn, &state, &opts.path)?
    };
    let unsynced = crate::unsynced::drop_lost_tail(&mut conn, &opts.path)?;
    // After the replay and the lost tail, which leave the meta values alone; before anything
    // is read from the file to be sent.
    let host = crate::host::settle(&mut conn, opts.host_id.as_deref())?;
    let id = match &host {
        crate::HostCheck::Moved { new_id, .. } => *new_id,
        _ => SpoolId(bytes),
    };
    if replayed.commits > 0 || unsynced != crate::unsynced::Dropped::default() || id != SpoolId(bytes) {
        // `state.meta` holds the spool id the meta checksum is computed over.
        state = State::load(&conn)?;
    }
    Ok(Attempt::Ready(Box::new(Opened { conn, id, state, created, replayed, unsynced, host })))
}

/// `quick_check` does not compare index entries with their rows. The full check of each table
/// costs little (since schema version 4 a batch row is a few dozen bytes; `quick_check` has
/// read every page already), and a damaged index entry is
/// repaired from the rows (`REINDEX`): left alone, a later update or delete of its row misses
/// it, and the stale entry makes the file malformed at the next open, which moves the whole
/// file aside (found by the `spool_recovery` fuzz target, in `chunks` on schema 3 and in
/// `batches` on schema 4). Damaged rows are the row checksums' business. Returns the problems
/// that remain after the repair, if any.
fn repair_indexes(conn: &Connection) -> Result<Option<String>, SpoolError> {
    for table in ["streams", "chunks", "batches"] {
        let problems = table_check(conn, table)?;
        if problems.is_empty() {
            continue;
        }
        tracing::warn!(table, problems = %problems.join("; "), "spool index damaged; rebuilding it from the rows");
        match conn.execute_batch(&format!("REINDEX {table}")) {
            Ok(()) => {}
            // Rows that break a UNIQUE index (a changed `seq` equal to another chunk's): the
            // index cannot be rebuilt, and the file is damage, not an error to start on.
            Err(rusqlite::Error::SqliteFailure(e, msg)) if e.code == rusqlite::ErrorCode::ConstraintViolation => {
                return Ok(Some(format!("REINDEX {table}: {}", msg.unwrap_or_else(|| e.to_string()))));
            }
            Err(e) => return Err(SpoolError::sqlite("rebuilding a damaged index", e)),
        }
        let left = table_check(conn, table)?;
        if !left.is_empty() {
            return Ok(Some(left.join("; ")));
        }
    }
    Ok(None)
}

/// `PRAGMA integrity_check(table)`: the table's b-tree and its indexes; empty when "ok".
fn table_check(conn: &Connection, table: &str) -> Result<Vec<String>, SpoolError> {
    let mut stmt = conn.prepare(&format!("PRAGMA integrity_check({table})")).map_err(ctx("running integrity_check"))?;
    let rows = stmt.query_map([], |r| r.get::<_, String>(0)).map_err(ctx("running integrity_check"))?;
    let mut lines: Vec<String> = rows.take(8).collect::<Result<_, _>>().map_err(ctx("running integrity_check"))?;
    if lines.len() == 1 && lines[0] == "ok" {
        lines.clear();
    }
    Ok(lines)
}

/// Renames `path` and its sidecars to `<path>.corrupt-<unix-seconds>[-n]` (sidecars keep their
/// suffix, so SQLite finds the WAL next to the moved file) and returns the new main path.
fn move_aside(path: &Path) -> Result<PathBuf, SpoolError> {
    let secs = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let target = (0u32..)
        .map(|n| {
            let tag = if n == 0 { format!(".corrupt-{secs}") } else { format!(".corrupt-{secs}-{n}") };
            with_suffix(path, &tag)
        })
        .find(|t| !t.exists() && !with_suffix(t, "-wal").exists())
        .unwrap_or_else(|| with_suffix(path, ".corrupt"));
    for sidecar in ["-wal", "-shm", "-journal"] {
        let from = with_suffix(path, sidecar);
        if from.exists() {
            rename(&from, &with_suffix(&target, sidecar))?;
        }
    }
    // The payload segments go with their index, under the same names (`spool check` on the
    // moved file finds them there).
    for (id, from) in segment::list(path)? {
        rename(&from, &segment::path(&target, id))?;
    }
    if path.exists() {
        rename(path, &target)?;
    }
    // Best effort: if the renames are lost in a power cut, the next open finds the same bad
    // file and moves it again.
    if let Err(e) = segment::sync_dir(path) {
        tracing::warn!(error = %e, "could not fsync the spool directory");
    }
    Ok(target)
}

fn rename(from: &Path, to: &Path) -> Result<(), SpoolError> {
    fs::rename(from, to).map_err(|source| SpoolError::Io { path: from.to_owned(), source })
}

/// `path` with `suffix` appended to its last component (`a/spool.db` + `-wal`).
pub(crate) fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut s: OsString = path.as_os_str().to_owned();
    s.push(suffix);
    PathBuf::from(s)
}

/// `error: cause: cause` on one line, for logs and reports.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        out.push_str(": ");
        out.push_str(&s.to_string());
        src = s.source();
    }
    out
}
