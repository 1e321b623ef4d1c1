//! Schema (DDL), connection pragmas and `PRAGMA user_version` migrations.
//!
//! Each migration runs in its own `IMMEDIATE` transaction together with the `user_version`
//! bump, so a crash leaves the file at the old or the new version, never in between.

use std::time::Duration;

use rusqlite::{Connection, OpenFlags, TransactionBehavior};

use crate::error::ctx;
use crate::{Durability, SpoolError, SpoolId};

/// The newest schema version this build writes and understands.
pub(crate) const SCHEMA_VERSION: i64 = 1;

/// How long a connection waits for a lock held by another connection.
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Upper bound SQLite keeps the WAL at after a checkpoint (bytes).
const JOURNAL_SIZE_LIMIT: i64 = 64 << 20;

/// Version 1: the tables described in the crate docs.
const V1: &str = "
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value NOT NULL
) WITHOUT ROWID;

CREATE TABLE streams (
    id       INTEGER PRIMARY KEY,
    name     TEXT NOT NULL UNIQUE,
    next_seq INTEGER NOT NULL CHECK (next_seq >= 1)
);

CREATE TABLE chunks (
    id         INTEGER PRIMARY KEY AUTOINCREMENT,
    stream_id  INTEGER NOT NULL,
    seq        INTEGER NOT NULL,
    records    INTEGER NOT NULL,
    bytes      INTEGER NOT NULL,
    first_ms   INTEGER NOT NULL,
    sealed_ms  INTEGER NOT NULL,
    quarantine TEXT,
    UNIQUE (stream_id, seq)
);
CREATE INDEX chunks_live_first ON chunks (stream_id, first_ms) WHERE quarantine IS NULL;

CREATE TABLE batches (
    id        INTEGER PRIMARY KEY,
    stream_id INTEGER NOT NULL,
    chunk_id  INTEGER,
    data      BLOB NOT NULL,
    records   INTEGER NOT NULL,
    crc32c    INTEGER NOT NULL,
    commit_ms INTEGER NOT NULL
);
CREATE INDEX batches_open ON batches (stream_id) WHERE chunk_id IS NULL;
CREATE INDEX batches_sealed ON batches (chunk_id) WHERE chunk_id IS NOT NULL;

INSERT INTO meta (key, value) VALUES ('dropped_chunks', 0), ('dropped_records', 0);
";

/// Meta keys.
pub(crate) const META_SPOOL_ID: &str = "spool_id";
pub(crate) const META_DROPPED_CHUNKS: &str = "dropped_chunks";
pub(crate) const META_DROPPED_RECORDS: &str = "dropped_records";

/// What [`migrate`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Migrated {
    /// The file had no schema; version 1 was created with a fresh spool id.
    Created,
    /// The file had a spool schema, now at [`SCHEMA_VERSION`].
    Existing,
    /// `user_version` is 0 but the file has tables: some other database.
    Foreign,
}

/// Pragmas of the writer connection. Must run outside a transaction.
pub(crate) fn configure_writer(conn: &Connection, durability: Durability) -> Result<(), SpoolError> {
    conn.busy_timeout(BUSY_TIMEOUT).map_err(ctx("setting busy_timeout"))?;
    let mode: String =
        conn.pragma_update_and_check(None, "journal_mode", "WAL", |r| r.get(0)).map_err(ctx("switching to WAL"))?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(SpoolError::sqlite("switching to WAL", rusqlite::Error::InvalidQuery));
    }
    let sync = match durability {
        Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    };
    conn.pragma_update(None, "synchronous", sync).map_err(ctx("setting synchronous"))?;
    conn.pragma_update(None, "journal_size_limit", JOURNAL_SIZE_LIMIT).map_err(ctx("setting journal_size_limit"))?;
    conn.pragma_update(None, "foreign_keys", "OFF").map_err(ctx("setting foreign_keys"))?;
    conn.set_prepared_statement_cache_capacity(32);
    Ok(())
}

/// Opens a read-only connection for a [`SpoolReader`](crate::SpoolReader).
pub(crate) fn open_reader(path: &std::path::Path) -> Result<Connection, SpoolError> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(ctx("opening the reader connection"))?;
    conn.busy_timeout(BUSY_TIMEOUT).map_err(ctx("setting busy_timeout"))?;
    conn.set_prepared_statement_cache_capacity(16);
    Ok(conn)
}

/// Runs `PRAGMA quick_check`; `Ok(None)` when it says "ok", else the first problems it lists.
pub(crate) fn quick_check(conn: &Connection) -> Result<Option<String>, SpoolError> {
    let mut lines = Vec::new();
    conn.pragma_query(None, "quick_check", |r| {
        if lines.len() < 8 {
            lines.push(r.get::<_, String>(0)?);
        }
        Ok(())
    })
    .map_err(ctx("running quick_check"))?;
    if lines.len() == 1 && lines[0] == "ok" { Ok(None) } else { Ok(Some(lines.join("; "))) }
}

/// `PRAGMA user_version` and the number of schema objects, read without writing.
pub(crate) fn inspect(conn: &Connection) -> Result<(i64, i64), SpoolError> {
    let version: i64 =
        conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(ctx("reading user_version"))?;
    let objects: i64 =
        conn.query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0)).map_err(ctx("inspecting the schema"))?;
    Ok((version, objects))
}

/// Brings the schema to [`SCHEMA_VERSION`].
pub(crate) fn migrate(conn: &mut Connection) -> Result<Migrated, SpoolError> {
    let mut created = false;
    loop {
        let version: i64 =
            conn.pragma_query_value(None, "user_version", |r| r.get(0)).map_err(ctx("reading user_version"))?;
        match version {
            SCHEMA_VERSION => {
                return Ok(if created { Migrated::Created } else { Migrated::Existing });
            }
            v if v > SCHEMA_VERSION => {
                return Err(SpoolError::UnsupportedSchema { found: v, supported: SCHEMA_VERSION });
            }
            v if v < 0 => return Ok(Migrated::Foreign),
            0 => {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(ctx("starting the schema migration"))?;
                let tables: i64 = tx
                    .query_row("SELECT count(*) FROM sqlite_schema", [], |r| r.get(0))
                    .map_err(ctx("inspecting the schema"))?;
                if tables > 0 {
                    return Ok(Migrated::Foreign);
                }
                tx.execute_batch(V1).map_err(ctx("creating schema version 1"))?;
                tx.execute("INSERT INTO meta (key, value) VALUES (?1, ?2)", (META_SPOOL_ID, &SpoolId::random().0[..]))
                    .map_err(ctx("writing the spool id"))?;
                tx.pragma_update(None, "user_version", 1).map_err(ctx("setting user_version"))?;
                tx.commit().map_err(ctx("committing schema version 1"))?;
                created = true;
            }
            // Future migrations go here: `1 => { ...; user_version = 2 }`.
            v => {
                return Err(SpoolError::Unrecoverable {
                    path: conn.path().unwrap_or_default().into(),
                    detail: format!("no migration from schema version {v}"),
                });
            }
        }
    }
}
