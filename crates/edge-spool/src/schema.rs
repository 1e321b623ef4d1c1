//! Schema (DDL), connection pragmas and `PRAGMA user_version` migrations.
//!
//! Each migration runs in its own `IMMEDIATE` transaction together with the `user_version`
//! bump, so a crash leaves the file at the old or the new version, never in between.
//!
//! Version 2 records chunk membership as a batch-id range in `chunks` instead of a `chunk_id`
//! in every batch row, so sealing never rewrites a batch. The migration from version 1
//! ([`V1_TO_V2`]) touches only `chunks`, `streams` and indexes: batch rows, which hold nearly
//! all the bytes, are left as they are (a rewrite would need as much free disk as the spool
//! holds, on gateways that are often short of it). So a migrated file keeps v1's
//! `batches.chunk_id` column and its column order; version 2 never reads or writes that column.
//!
//! Version 3 adds a `row_crc` to every `streams`, `chunks` and `batches` row
//! and a `row_crc` over the `meta` values (see `rowcrc.rs`). Its migration ([`migrate_2_to_3`])
//! computes them for `streams`, `chunks` and `meta`, and for the same reason leaves existing
//! batch rows without one: `meta.legacy_batches_through` marks them.
//!
//! Version 4 (the current one) keeps new batches' bytes in append-only segment files (see
//! `segment.rs`): `batches.segment`, `seg_offset`, `seg_len` say where, and `data` is empty. Its
//! migration ([`V3_TO_V4`]) only adds the three columns; existing rows keep their bytes inline.

use std::time::Duration;

use rusqlite::{Connection, OpenFlags, OptionalExtension, TransactionBehavior};

use crate::error::ctx;
use crate::rowcrc::{self, ChunkRow, MetaValues};
use crate::{Durability, SpoolError, SpoolId};

/// The newest schema version this build writes and understands.
pub(crate) const SCHEMA_VERSION: i64 = 4;

/// A batch row's payload length in SQL: its segment bytes, or its inline `data` (rows written
/// before version 4).
pub(crate) const BATCH_LEN: &str = "CASE WHEN segment IS NULL THEN length(data) ELSE seg_len END";

/// How long a connection waits for a lock held by another connection.
pub(crate) const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a best-effort truncating checkpoint waits for readers to move off an old snapshot.
pub(crate) const CHECKPOINT_WAIT: Duration = Duration::from_millis(100);

/// Upper bound SQLite keeps the WAL at after a checkpoint (bytes).
const JOURNAL_SIZE_LIMIT: i64 = 64 << 20;

/// Version 4, as created for a new file: the tables described in the crate docs. `data` is the
/// last column of `batches`, so reading the other columns never follows a blob's overflow pages
/// (from version 4 it is an empty blob: the bytes are in segment files). `meta` gets its
/// `spool_id` and `row_crc` rows from [`migrate`].
const V4: &str = "
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value NOT NULL
) WITHOUT ROWID;

CREATE TABLE streams (
    id             INTEGER PRIMARY KEY,
    name           TEXT NOT NULL UNIQUE,
    next_seq       INTEGER NOT NULL CHECK (next_seq >= 1),
    sealed_through INTEGER NOT NULL DEFAULT 0,
    row_crc        INTEGER
);

CREATE TABLE chunks (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    stream_id   INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    records     INTEGER NOT NULL,
    bytes       INTEGER NOT NULL,
    first_ms    INTEGER NOT NULL,
    sealed_ms   INTEGER NOT NULL,
    quarantine  TEXT,
    first_batch INTEGER NOT NULL,
    last_batch  INTEGER NOT NULL,
    row_crc     INTEGER,
    UNIQUE (stream_id, seq)
);
CREATE INDEX chunks_live_first ON chunks (stream_id, first_ms) WHERE quarantine IS NULL;

CREATE TABLE batches (
    id        INTEGER PRIMARY KEY,
    stream_id INTEGER NOT NULL,
    records   INTEGER NOT NULL,
    crc32c    INTEGER NOT NULL,
    commit_ms INTEGER NOT NULL,
    row_crc   INTEGER,
    segment    INTEGER,
    seg_offset INTEGER,
    seg_len    INTEGER,
    data      BLOB NOT NULL
);
CREATE INDEX batches_stream ON batches (stream_id, id);

INSERT INTO meta (key, value) VALUES ('dropped_chunks', 0), ('dropped_records', 0), ('legacy_batches_through', 0);
";

/// Version 3, as version 3 of this crate created it: kept to build version-3 files in the
/// migration tests.
#[cfg(test)]
pub(crate) const V3: &str = "
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value NOT NULL
) WITHOUT ROWID;

CREATE TABLE streams (
    id             INTEGER PRIMARY KEY,
    name           TEXT NOT NULL UNIQUE,
    next_seq       INTEGER NOT NULL CHECK (next_seq >= 1),
    sealed_through INTEGER NOT NULL DEFAULT 0,
    row_crc        INTEGER
);

CREATE TABLE chunks (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    stream_id   INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    records     INTEGER NOT NULL,
    bytes       INTEGER NOT NULL,
    first_ms    INTEGER NOT NULL,
    sealed_ms   INTEGER NOT NULL,
    quarantine  TEXT,
    first_batch INTEGER NOT NULL,
    last_batch  INTEGER NOT NULL,
    row_crc     INTEGER,
    UNIQUE (stream_id, seq)
);
CREATE INDEX chunks_live_first ON chunks (stream_id, first_ms) WHERE quarantine IS NULL;

CREATE TABLE batches (
    id        INTEGER PRIMARY KEY,
    stream_id INTEGER NOT NULL,
    records   INTEGER NOT NULL,
    crc32c    INTEGER NOT NULL,
    commit_ms INTEGER NOT NULL,
    row_crc   INTEGER,
    data      BLOB NOT NULL
);
CREATE INDEX batches_stream ON batches (stream_id, id);

INSERT INTO meta (key, value) VALUES ('dropped_chunks', 0), ('dropped_records', 0), ('legacy_batches_through', 0);
";

/// Version 2, as version 2 of this crate created it: kept to build version-2 files in the
/// migration tests.
#[cfg(test)]
pub(crate) const V2: &str = "
CREATE TABLE meta (
    key   TEXT PRIMARY KEY,
    value NOT NULL
) WITHOUT ROWID;

CREATE TABLE streams (
    id             INTEGER PRIMARY KEY,
    name           TEXT NOT NULL UNIQUE,
    next_seq       INTEGER NOT NULL CHECK (next_seq >= 1),
    sealed_through INTEGER NOT NULL DEFAULT 0
);

CREATE TABLE chunks (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    stream_id   INTEGER NOT NULL,
    seq         INTEGER NOT NULL,
    records     INTEGER NOT NULL,
    bytes       INTEGER NOT NULL,
    first_ms    INTEGER NOT NULL,
    sealed_ms   INTEGER NOT NULL,
    quarantine  TEXT,
    first_batch INTEGER NOT NULL,
    last_batch  INTEGER NOT NULL,
    UNIQUE (stream_id, seq)
);
CREATE INDEX chunks_live_first ON chunks (stream_id, first_ms) WHERE quarantine IS NULL;

CREATE TABLE batches (
    id        INTEGER PRIMARY KEY,
    stream_id INTEGER NOT NULL,
    records   INTEGER NOT NULL,
    crc32c    INTEGER NOT NULL,
    commit_ms INTEGER NOT NULL,
    data      BLOB NOT NULL
);
CREATE INDEX batches_stream ON batches (stream_id, id);

INSERT INTO meta (key, value) VALUES ('dropped_chunks', 0), ('dropped_records', 0);
";

/// Version 1 to 2, in place. In version 1 a chunk's batches are exactly its stream's batches
/// carrying its `chunk_id`, and a seal took every open batch of the stream; a batch's id is
/// greater than that of every batch that existed when it was inserted. So a chunk's batches
/// are contiguous among its stream's batches (`first_batch..=last_batch` of its stream), every
/// sealed batch of a stream precedes its open ones, and `sealed_through` is the last batch of
/// the stream's newest chunk (or just below its oldest open batch). A chunk whose batch rows
/// are gone gets an empty range (1..=0), which reads as corrupt, as it did in version 1.
const V1_TO_V2: &str = "
ALTER TABLE chunks ADD COLUMN first_batch INTEGER NOT NULL DEFAULT 1;
ALTER TABLE chunks ADD COLUMN last_batch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE streams ADD COLUMN sealed_through INTEGER NOT NULL DEFAULT 0;
UPDATE chunks SET
    first_batch = coalesce((SELECT min(b.id) FROM batches b WHERE b.chunk_id = chunks.id), 1),
    last_batch = coalesce((SELECT max(b.id) FROM batches b WHERE b.chunk_id = chunks.id), 0);
UPDATE streams SET sealed_through = coalesce(
    (SELECT max(c.last_batch) FROM chunks c WHERE c.stream_id = streams.id AND c.last_batch >= c.first_batch),
    (SELECT min(b.id) - 1 FROM batches b WHERE b.stream_id = streams.id AND b.chunk_id IS NULL),
    0);
DROP INDEX batches_open;
DROP INDEX batches_sealed;
CREATE INDEX batches_stream ON batches (stream_id, id);
";

/// Version 1, as version 1 of this crate created it: kept to build version-1 files in the
/// migration tests.
#[cfg(test)]
pub(crate) const V1: &str = "
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
pub(crate) const META_LEGACY_BATCHES: &str = "legacy_batches_through";
pub(crate) const META_ROW_CRC: &str = "row_crc";
/// With deferred segment syncs: the newest batch id whose payload bytes a completed sync
/// covered when the last commit was built (see `unsynced.rs`). Absent otherwise. Not in the
/// meta checksum (it moves with the commits): its value carries a checksum of its own.
pub(crate) const META_SEGMENTS_SYNCED: &str = "segments_synced_through";
/// The identity of the machine the file was last opened on (`host.rs`). Absent until the
/// spool is opened with one. Not in the meta checksum: its value carries a checksum of its own.
pub(crate) const META_HOST_ID: &str = "host_id";
/// Every key a `meta` row can have (schema version 3 on); any other is a damaged key.
pub(crate) const META_KEYS: [&str; 7] = [
    META_SPOOL_ID,
    META_DROPPED_CHUNKS,
    META_DROPPED_RECORDS,
    META_LEGACY_BATCHES,
    META_ROW_CRC,
    META_SEGMENTS_SYNCED,
    META_HOST_ID,
];

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
                tx.execute_batch(V4).map_err(ctx("creating schema version 4"))?;
                let meta = MetaValues { spool_id: SpoolId::random().0.to_vec(), ..MetaValues::default() };
                tx.execute(
                    "INSERT INTO meta (key, value) VALUES (?1, ?2), (?3, ?4)",
                    (META_SPOOL_ID, &meta.spool_id, META_ROW_CRC, meta.crc()),
                )
                .map_err(ctx("writing the spool id"))?;
                tx.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(ctx("setting user_version"))?;
                tx.commit().map_err(ctx("committing schema version 4"))?;
                created = true;
            }
            1 => {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(ctx("starting the migration from version 1"))?;
                tx.execute_batch(V1_TO_V2).map_err(ctx("migrating schema version 1 to 2"))?;
                tx.pragma_update(None, "user_version", 2).map_err(ctx("setting user_version"))?;
                tx.commit().map_err(ctx("committing the migration from version 1"))?;
                tracing::info!("spool schema migrated from version 1 to 2");
            }
            2 => {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(ctx("starting the migration from version 2"))?;
                migrate_2_to_3(&tx)?;
                tx.pragma_update(None, "user_version", 3).map_err(ctx("setting user_version"))?;
                tx.commit().map_err(ctx("committing the migration from version 2"))?;
                tracing::info!("spool schema migrated from version 2 to 3 (row checksums)");
            }
            3 => {
                let tx = conn
                    .transaction_with_behavior(TransactionBehavior::Immediate)
                    .map_err(ctx("starting the migration from version 3"))?;
                tx.execute_batch(V3_TO_V4).map_err(ctx("migrating schema version 3 to 4"))?;
                tx.pragma_update(None, "user_version", 4).map_err(ctx("setting user_version"))?;
                tx.commit().map_err(ctx("committing the migration from version 3"))?;
                tracing::info!("spool schema migrated from version 3 to 4 (payload segment files)");
            }
            // Future migrations go here: `4 => { ...; user_version = 5 }`.
            v => {
                return Err(SpoolError::Unrecoverable {
                    path: conn.path().unwrap_or_default().into(),
                    detail: format!("no migration from schema version {v}"),
                });
            }
        }
    }
}

/// Version 3 to 4, in place: the location columns of a batch in a segment file. Existing rows
/// keep their bytes in `data` (all three columns NULL) and their checksums (a row with its data
/// inline is summed as in version 3), so nothing is rewritten.
const V3_TO_V4: &str = "
ALTER TABLE batches ADD COLUMN segment INTEGER;
ALTER TABLE batches ADD COLUMN seg_offset INTEGER;
ALTER TABLE batches ADD COLUMN seg_len INTEGER;
";

/// Version 2 to 3, in place: a `row_crc` column in `streams`, `chunks` and `batches`, computed
/// for every stream and chunk row; batch rows keep a NULL one (see the module docs), and
/// `meta.legacy_batches_through` names the last of them. The rows are read as they are: a
/// version-2 file has no checksums that could tell whether they were damaged before.
fn migrate_2_to_3(tx: &rusqlite::Transaction<'_>) -> Result<(), SpoolError> {
    tx.execute_batch(
        "ALTER TABLE streams ADD COLUMN row_crc INTEGER;
         ALTER TABLE chunks ADD COLUMN row_crc INTEGER;
         ALTER TABLE batches ADD COLUMN row_crc INTEGER;",
    )
    .map_err(ctx("adding the row_crc columns"))?;
    let streams: Vec<(i64, String, i64, i64)> = {
        let mut stmt = tx
            .prepare("SELECT id, name, next_seq, sealed_through FROM streams")
            .map_err(ctx("reading streams to migrate"))?;
        let rows = stmt
            .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))
            .map_err(ctx("reading streams to migrate"))?;
        rows.collect::<Result<_, _>>().map_err(ctx("reading streams to migrate"))?
    };
    for (id, name, next_seq, sealed_through) in streams {
        tx.execute(
            "UPDATE streams SET row_crc = ?1 WHERE id = ?2",
            (rowcrc::stream(id, &name, next_seq, sealed_through), id),
        )
        .map_err(ctx("writing a stream's row_crc"))?;
    }
    let chunks: Vec<ChunkRow> = {
        let mut stmt = tx
            .prepare(
                "SELECT id, stream_id, seq, records, bytes, first_ms, sealed_ms, first_batch, last_batch FROM chunks",
            )
            .map_err(ctx("reading chunks to migrate"))?;
        let rows = stmt.query_map([], |r| ChunkRow::from_row(r, 0)).map_err(ctx("reading chunks to migrate"))?;
        rows.collect::<Result<_, _>>().map_err(ctx("reading chunks to migrate"))?
    };
    for c in chunks {
        tx.execute("UPDATE chunks SET row_crc = ?1 WHERE id = ?2", (c.crc(), c.id))
            .map_err(ctx("writing a chunk's row_crc"))?;
    }
    let legacy: i64 = tx
        .query_row("SELECT coalesce(max(id), 0) FROM batches", [], |r| r.get(0))
        .map_err(ctx("finding the last batch"))?;
    tx.execute("INSERT INTO meta (key, value) VALUES (?1, ?2)", (META_LEGACY_BATCHES, legacy))
        .map_err(ctx("writing legacy_batches_through"))?;
    let meta = read_meta(tx)?;
    tx.execute("INSERT INTO meta (key, value) VALUES (?1, ?2)", (META_ROW_CRC, meta.crc()))
        .map_err(ctx("writing the meta row_crc"))?;
    Ok(())
}

/// The `meta` values the meta checksum covers. A missing row reads as
/// [`SpoolError::Inconsistent`] (one flipped bit in its key is enough, and `quick_check` does
/// not see it), so `open` moves the file aside instead of refusing to start (found by the
/// `spool_recovery` fuzz target).
pub(crate) fn read_meta(conn: &Connection) -> Result<MetaValues, SpoolError> {
    let get = |key: &str| -> Result<rusqlite::types::Value, SpoolError> {
        conn.query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
            .map_err(ctx("reading meta"))?
            .ok_or_else(|| SpoolError::Inconsistent(format!("meta row {key:?} is missing")))
    };
    let int = |key: &str| -> Result<i64, SpoolError> {
        match get(key)? {
            rusqlite::types::Value::Integer(v) if v >= 0 => Ok(v),
            other => Err(SpoolError::Inconsistent(format!("meta row {key:?} holds {other:?}, not a count"))),
        }
    };
    let spool_id = match get(META_SPOOL_ID)? {
        rusqlite::types::Value::Blob(b) => b,
        other => return Err(SpoolError::Inconsistent(format!("meta row \"spool_id\" holds {other:?}, not a blob"))),
    };
    Ok(MetaValues {
        spool_id,
        dropped_chunks: int(META_DROPPED_CHUNKS)?,
        dropped_records: int(META_DROPPED_RECORDS)?,
        legacy_batches_through: int(META_LEGACY_BATCHES)?,
    })
}

/// Reads the `meta` values and checks them against the meta row checksum.
pub(crate) fn read_verified_meta(conn: &Connection) -> Result<MetaValues, SpoolError> {
    let meta = read_meta(conn)?;
    let stored: Option<i64> = conn
        .query_row("SELECT value FROM meta WHERE key = ?1", [META_ROW_CRC], |r| r.get(0))
        .optional()
        .map_err(ctx("reading the meta row_crc"))?;
    let computed = meta.crc();
    if stored != Some(computed) {
        return Err(SpoolError::Inconsistent(format!(
            "meta values fail their checksum (stored {stored:?}, computed {computed}): spool id, \
             dropped counters or legacy mark damaged"
        )));
    }
    Ok(meta)
}

#[cfg(test)]
mod tests {
    //! Migration from version 1, on files written with version 1's DDL and statements.

    use rusqlite::Connection;

    use super::*;
    use crate::{AppendRequest, Batch, ChunkId, ChunkMeta, Spool, SpoolOptions};

    /// A version-1 file, written with the statements version 1 of the spool used.
    struct V1File {
        conn: Connection,
    }

    impl V1File {
        fn create(path: &std::path::Path) -> V1File {
            let conn = Connection::open(path).expect("open");
            conn.pragma_update(None, "journal_mode", "WAL").expect("wal");
            conn.execute_batch(V1).expect("v1 schema");
            conn.execute("INSERT INTO meta (key, value) VALUES (?1, ?2)", (META_SPOOL_ID, &[7u8; 16][..]))
                .expect("spool id");
            conn.pragma_update(None, "user_version", 1).expect("user_version");
            V1File { conn }
        }

        fn append(&self, stream: &str, data: &[u8], ms: i64) {
            self.conn
                .execute("INSERT OR IGNORE INTO streams (name, next_seq) VALUES (?1, 1)", [stream])
                .expect("stream");
            self.conn
                .execute(
                    "INSERT INTO batches (stream_id, chunk_id, data, records, crc32c, commit_ms)
                     VALUES ((SELECT id FROM streams WHERE name = ?1), NULL, ?2, 1, ?3, ?4)",
                    (stream, data, crate::crc::crc32c(data), ms),
                )
                .expect("batch");
        }

        /// Version 1's `seal_stream`; returns the chunk id.
        fn seal(&self, stream: &str, ms: i64) -> i64 {
            let sid: i64 =
                self.conn.query_row("SELECT id FROM streams WHERE name = ?1", [stream], |r| r.get(0)).expect("sid");
            self.conn
                .execute(
                    "INSERT INTO chunks (stream_id, seq, records, bytes, first_ms, sealed_ms)
                     SELECT ?1, (SELECT next_seq FROM streams WHERE id = ?1), count(*), sum(length(data)),
                            min(commit_ms), ?2
                     FROM batches WHERE stream_id = ?1 AND chunk_id IS NULL",
                    (sid, ms),
                )
                .expect("chunk");
            let chunk = self.conn.last_insert_rowid();
            self.conn
                .execute("UPDATE batches SET chunk_id = ?1 WHERE stream_id = ?2 AND chunk_id IS NULL", (chunk, sid))
                .expect("assign");
            self.conn.execute("UPDATE streams SET next_seq = next_seq + 1 WHERE id = ?1", [sid]).expect("seq");
            chunk
        }

        fn ack(&self, chunk: i64) {
            self.conn.execute("DELETE FROM batches WHERE chunk_id = ?1", [chunk]).expect("ack batches");
            self.conn.execute("DELETE FROM chunks WHERE id = ?1", [chunk]).expect("ack chunk");
        }

        /// A chunk's payload as version 1 read it.
        fn payload(&self, chunk: i64) -> Vec<u8> {
            let mut stmt = self.conn.prepare("SELECT data FROM batches WHERE chunk_id = ?1 ORDER BY id").expect("prep");
            let rows = stmt.query_map([chunk], |r| r.get::<_, Vec<u8>>(0)).expect("query");
            rows.flat_map(|r| r.expect("row")).collect()
        }
    }

    fn meta(spool: &Spool, id: i64) -> ChunkMeta {
        let mut all = spool.reader().expect("reader").sealed_after(None, usize::MAX).expect("list");
        let q = spool.reader().expect("reader").quarantined().expect("quarantined");
        all.extend(q.into_iter().map(|q| q.meta));
        all.into_iter().find(|m| m.id == ChunkId(id)).expect("chunk listed")
    }

    /// The batches `export_quarantined` hands over, by chunk id.
    fn exported(path: &std::path::Path) -> Vec<(i64, Vec<u8>)> {
        let mut got = Vec::new();
        let salvage = crate::export_quarantined(path, crate::Selection::default(), &mut |c, data, _| {
            got.push((c.id, data.to_vec()));
            Ok(())
        })
        .expect("export");
        // Versions 1 and 2 keep the id without a checksum: it is read as it is.
        assert!(salvage.spool_id.is_some(), "the spool id of {}", path.display());
        let chunks = salvage.chunks;
        assert!(chunks.iter().all(crate::SalvagedChunk::complete), "{chunks:?}");
        got
    }

    fn one(stream: &str, data: &[u8]) -> AppendRequest {
        AppendRequest { batches: vec![Batch { stream: stream.into(), data: data.to_vec(), records: 1 }] }
    }

    #[test]
    fn a_version_1_file_is_migrated_in_place_and_reads_back_byte_identical() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("spool.db");
        let v1 = V1File::create(&path);
        // Two streams interleaved, an acked chunk, a quarantined one, and an open batch whose id
        // version 1 reused after the newest chunk was acked (rowid = largest id + 1).
        v1.append("a", b"a1", 10);
        v1.append("b", b"b1", 11);
        v1.append("a", b"a2", 12);
        let a_first = v1.seal("a", 13);
        v1.append("b", b"b2", 14);
        v1.append("a", b"a3", 15);
        let b_first = v1.seal("b", 16);
        v1.append("a", b"a4", 17);
        let a_second = v1.seal("a", 18);
        v1.ack(a_first);
        v1.conn.execute("UPDATE chunks SET quarantine = 'bad' WHERE id = ?1", [a_second]).expect("quarantine");
        v1.append("c", b"c1", 19);
        v1.append("a", b"a5", 20);
        let a_third = v1.seal("a", 21);
        let reused: i64 = v1.conn.query_row("SELECT max(id) FROM batches", [], |r| r.get(0)).expect("max id");
        v1.ack(a_third);
        v1.append("a", b"a6", 22);
        let a6: i64 = v1.conn.query_row("SELECT max(id) FROM batches", [], |r| r.get(0)).expect("max id");
        assert_eq!(a6, reused, "version 1 reused the id of an acked batch");
        v1.append("c", b"c2", 23);
        let c_first = v1.seal("c", 24);
        v1.append("c", b"c3", 25);
        let before: Vec<(i64, Vec<u8>)> = [b_first, a_second, c_first].iter().map(|&c| (c, v1.payload(c))).collect();
        drop(v1);
        let audit = crate::check(&path).expect("check a version-1 file");
        assert!(!audit.has_damage() && audit.chunks == 3 && audit.batches == 8, "{audit:?}");
        // The quarantined chunk's records, from the file as version 1 wrote it (no row checksums,
        // batches by chunk id) and again once migrated.
        let quarantined = vec![(a_second, b"a3".to_vec()), (a_second, b"a4".to_vec())];
        assert_eq!(exported(&path), quarantined);

        let opts = SpoolOptions::new(&path);
        let (mut spool, report) = Spool::open(opts.clone()).expect("open migrates");
        assert!(!report.created && report.quarantined.is_none(), "{report:?}");
        assert_eq!((report.open_batches, report.sealed_chunks), (2, 2));
        let version: i64 = spool.conn().pragma_query_value(None, "user_version", |r| r.get(0)).expect("version");
        assert_eq!(version, SCHEMA_VERSION);
        let mut reader = spool.reader().expect("reader");
        for (id, bytes) in &before {
            assert_eq!(&reader.read(&meta(&spool, *id)).expect("read migrated chunk"), bytes, "chunk {id}");
        }
        let stats = spool.stats();
        assert_eq!((stats.sealed_bytes, stats.open_bytes, stats.quarantined_chunks), (8, 4, 1));
        let audit = crate::check(&path).expect("check the migrated file");
        assert!(!audit.has_damage() && audit.chunks == 3 && audit.batches == 8, "{audit:?}");
        assert_eq!(exported(&path), quarantined);

        // Open batches seal into the right chunks, and sequence numbers continue.
        spool.append(&[one("a", b"a7"), one("b", b"b3")], 30).expect("append after migration");
        assert_eq!(spool.seal_all(31).expect("seal"), 3);
        let chunks = reader.sealed_after(Some(ChunkId(c_first)), usize::MAX).expect("list");
        let got: Vec<(String, u64, Vec<u8>)> =
            chunks.iter().map(|m| (m.stream.clone(), m.seq, reader.read(m).expect("read"))).collect();
        let want = [("a", 4, &b"a6a7"[..]), ("b", 2, b"b3"), ("c", 2, b"c3")];
        let want: Vec<(String, u64, Vec<u8>)> = want.iter().map(|(s, q, d)| (s.to_string(), *q, d.to_vec())).collect();
        assert_eq!(got, want);
        // Acks delete exactly their ranges; nothing else moves.
        spool.ack(&[ChunkId(b_first)]).expect("ack");
        assert_eq!(reader.read(&meta(&spool, c_first)).expect("read"), b"c1c2");
        let stats = spool.stats();
        drop(reader);
        drop(spool);
        let (spool, _) = Spool::open(opts).expect("reopen");
        assert_eq!(spool.stats(), stats);
    }

    #[test]
    fn a_version_2_file_gets_row_checksums_and_its_batches_are_marked_legacy() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("spool.db");
        {
            // As version 2 wrote them: a stream with a sealed chunk of two batches and an open one.
            let conn = Connection::open(&path).expect("open");
            conn.pragma_update(None, "journal_mode", "WAL").expect("wal");
            conn.execute_batch(V2).expect("v2 schema");
            conn.execute("INSERT INTO meta (key, value) VALUES (?1, ?2)", (META_SPOOL_ID, &[9u8; 16][..]))
                .expect("spool id");
            conn.execute("INSERT INTO streams (id, name, next_seq, sealed_through) VALUES (1, 'a', 2, 2)", [])
                .expect("stream");
            for (id, data, ms) in [(1, &b"a1"[..], 10), (2, b"a2", 11), (3, b"a3", 12)] {
                conn.execute(
                    "INSERT INTO batches (id, stream_id, records, crc32c, commit_ms, data) VALUES (?1, 1, 1, ?2, ?3, ?4)",
                    (id, crate::crc::crc32c(data), ms, data),
                )
                .expect("batch");
            }
            conn.execute(
                "INSERT INTO chunks (stream_id, seq, records, bytes, first_ms, sealed_ms, first_batch, last_batch)
                 VALUES (1, 1, 2, 4, 10, 11, 1, 2)",
                [],
            )
            .expect("chunk");
            conn.pragma_update(None, "user_version", 2).expect("user_version");
            conn.execute("UPDATE chunks SET quarantine = 'rejected by server: test' WHERE id = 1", [])
                .expect("quarantine");
        }
        // The quarantined chunk's records as version 2 holds them (by range, no row checksums),
        // and once migrated (legacy batches, without a row checksum under the legacy mark).
        let quarantined = vec![(1, b"a1".to_vec()), (1, b"a2".to_vec())];
        assert_eq!(exported(&path), quarantined);
        let opts = SpoolOptions::new(&path);
        let (mut spool, report) = Spool::open(opts.clone()).expect("open migrates");
        assert!(!report.created && report.quarantined.is_none(), "{report:?}");
        assert_eq!(spool.id(), SpoolId([9u8; 16]));
        let version: i64 = spool.conn().pragma_query_value(None, "user_version", |r| r.get(0)).expect("version");
        assert_eq!(version, SCHEMA_VERSION);
        let legacy: i64 = spool
            .conn()
            .query_row("SELECT value FROM meta WHERE key = ?1", [META_LEGACY_BATCHES], |r| r.get(0))
            .expect("legacy mark");
        assert_eq!(legacy, 3);
        assert_eq!(exported(&path), quarantined);
        let mut reader = spool.reader().expect("reader");
        assert_eq!(reader.read(&meta(&spool, 1)).expect("migrated chunk reads"), b"a1a2");
        // The open batch seals with a new one into a chunk whose rows all carry checksums.
        spool.append(&[one("a", b"a4")], 20).expect("append");
        assert_eq!(spool.seal_all(21).expect("seal"), 1);
        let new = reader.sealed_after(Some(ChunkId(1)), 1).expect("list").remove(0);
        assert_eq!((new.seq, reader.read(&new).expect("read")), (2, b"a3a4".to_vec()));
        let audit = crate::check(&path).expect("check");
        assert!(!audit.has_damage() && audit.chunks == 2 && audit.batches == 4, "{audit:?}");
        let unchecked: i64 = spool
            .conn()
            .query_row("SELECT count(*) FROM batches WHERE row_crc IS NULL", [], |r| r.get(0))
            .expect("count");
        assert_eq!(unchecked, 3, "only the batches written before version 3 lack a checksum");
        drop(reader);
        drop(spool);
        let (_spool, report) = Spool::open(opts).expect("reopen");
        assert!(report.quarantined.is_none(), "{report:?}");
    }

    #[test]
    fn a_version_3_file_keeps_its_inline_batches_and_new_ones_go_to_segments() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("spool.db");
        {
            // As version 3 wrote them: a sealed chunk of two batches and an open one, checksummed.
            let conn = Connection::open(&path).expect("open");
            conn.pragma_update(None, "journal_mode", "WAL").expect("wal");
            conn.execute_batch(V3).expect("v3 schema");
            let meta = MetaValues { spool_id: vec![5; 16], ..MetaValues::default() };
            conn.execute(
                "INSERT INTO meta (key, value) VALUES (?1, ?2), (?3, ?4)",
                (META_SPOOL_ID, &meta.spool_id, META_ROW_CRC, meta.crc()),
            )
            .expect("meta");
            conn.execute(
                "INSERT INTO streams (id, name, next_seq, sealed_through, row_crc) VALUES (1, 'a', 2, 2, ?1)",
                [rowcrc::stream(1, "a", 2, 2)],
            )
            .expect("stream");
            for (id, data, ms) in [(1, &b"a1"[..], 10), (2, b"a2", 11), (3, b"a3", 12)] {
                let crc = i64::from(crate::crc::crc32c(data));
                let row = rowcrc::BatchRow { id, stream_id: 1, records: 1, crc32c: crc, commit_ms: ms, seg: None };
                conn.execute(
                    "INSERT INTO batches (id, stream_id, records, crc32c, commit_ms, row_crc, data)
                     VALUES (?1, 1, 1, ?2, ?3, ?4, ?5)",
                    (id, crc, ms, row.crc(), data),
                )
                .expect("batch");
            }
            let c = ChunkRow {
                id: 1,
                stream_id: 1,
                seq: 1,
                records: 2,
                bytes: 4,
                first_ms: 10,
                sealed_ms: 11,
                first_batch: 1,
                last_batch: 2,
            };
            conn.execute(
                "INSERT INTO chunks (id, stream_id, seq, records, bytes, first_ms, sealed_ms, first_batch, last_batch, row_crc)
                 VALUES (1, 1, 1, 2, 4, 10, 11, 1, 2, ?1)",
                [c.crc()],
            )
            .expect("chunk");
            conn.pragma_update(None, "user_version", 3).expect("user_version");
        }
        let mut opts = SpoolOptions::new(&path);
        opts.segment_target_bytes = 2;
        let (mut spool, report) = Spool::open(opts.clone()).expect("open migrates");
        assert!(!report.created && report.quarantined.is_none(), "{report:?}");
        assert_eq!(spool.id(), SpoolId([5u8; 16]));
        let version: i64 = spool.conn().pragma_query_value(None, "user_version", |r| r.get(0)).expect("version");
        assert_eq!(version, 4);
        assert!(crate::segment::list(&path).expect("list").is_empty(), "migration writes no segment");
        let mut reader = spool.reader().expect("reader");
        assert_eq!(reader.read(&meta(&spool, 1)).expect("migrated chunk reads"), b"a1a2");
        // The open inline batch seals with two new ones (in segment files) into one chunk.
        spool.append(&[one("a", b"a4")], 20).expect("append");
        spool.append(&[one("a", b"a5a5")], 21).expect("append");
        assert_eq!(spool.seal_all(22).expect("seal"), 1);
        let segments = crate::segment::list(&path).expect("list");
        assert_eq!(segments.len(), 2, "2-byte segments: a new one after the first commit filled it");
        let new = reader.sealed_after(Some(ChunkId(1)), 1).expect("list").remove(0);
        assert_eq!((new.seq, reader.read(&new).expect("read")), (2, b"a3a4a5a5".to_vec()));
        let audit = crate::check(&path).expect("check");
        assert!(!audit.has_damage() && audit.chunks == 2 && audit.batches == 5 && audit.bytes == 12, "{audit:?}");
        // Acking the mixed chunk deletes both segments (the active one is all dead).
        spool.ack(&[ChunkId(1), new.id]).expect("ack");
        assert!(crate::segment::list(&path).expect("list").is_empty());
        drop(reader);
        drop(spool);
        let (spool, report) = Spool::open(opts).expect("reopen");
        assert!(report.quarantined.is_none(), "{report:?}");
        assert_eq!(spool.stats().total_bytes, 0);
    }
}
