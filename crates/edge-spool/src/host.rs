//! Which machine a spool file belongs to, so that a copy of it on another machine takes an
//! identity of its own.
//!
//! The ingest deduplicates by `(device, spool id, stream, seq)`. Two gateways that run from
//! copies of one disk image and share a device certificate would also share the spool id in
//! that image, and number their chunks from the same `next_seq`: the second gateway's chunks
//! would be answered `Duplicate` and deleted unsent, its records lost. So the spool records
//! the identity of the machine it runs on (the agent passes `/etc/machine-id`,
//! [`SpoolOptions::host_id`](crate::SpoolOptions::host_id)) in `meta.host_id`, and an open on a
//! machine with another identity draws a new spool id before anything is sent: the records
//! the copy accepts from then on can no longer collide with those of the machine it was copied
//! from. The chunks the copy brought along go out under the new id too, so those the other
//! machine delivered as well are stored twice: a duplicate at rest, never a loss.
//!
//! A spool without the row (created before it existed, or opened without a host id) adopts
//! the identity it is opened with, and so does one whose row fails its checksum: the row can
//! only tell a copy apart from then on. Moving the disk itself to new hardware keeps
//! `/etc/machine-id` with it, and the spool id.

use rusqlite::types::Value;
use rusqlite::{Connection, OptionalExtension, TransactionBehavior};

use crate::error::ctx;
use crate::schema::{META_HOST_ID, META_ROW_CRC, META_SPOOL_ID};
use crate::{SpoolError, SpoolId};

/// What the `meta.host_id` row holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Stored {
    /// No row.
    Absent,
    /// A host identity that passed its checksum.
    Intact(String),
    /// A value that is not a checked host identity: what is wrong with it.
    Damaged(String),
}

/// The row's value: the identity's bytes, then their checksum (4 bytes, little-endian).
fn value(host: &str) -> Vec<u8> {
    let mut v = Vec::with_capacity(host.len() + 4);
    v.extend_from_slice(host.as_bytes());
    v.extend_from_slice(&crate::rowcrc::host_id(META_HOST_ID, host.as_bytes()).to_le_bytes());
    v
}

/// Reads `meta.host_id` (`spool check` too).
pub(crate) fn read(conn: &Connection) -> Result<Stored, SpoolError> {
    let v: Option<Value> = conn
        .query_row("SELECT value FROM meta WHERE key = ?1", [META_HOST_ID], |r| r.get(0))
        .optional()
        .map_err(ctx("reading the host id"))?;
    Ok(match v {
        None => Stored::Absent,
        Some(Value::Blob(b)) if b.len() > 4 => {
            let (host, crc) = b.split_at(b.len() - 4);
            let crc = u32::from_le_bytes(crc.try_into().unwrap_or_default());
            match std::str::from_utf8(host) {
                Ok(h) if crc == crate::rowcrc::host_id(META_HOST_ID, host) => Stored::Intact(h.to_owned()),
                _ => Stored::Damaged(format!("the host id ({} bytes) fails its checksum", host.len())),
            }
        }
        Some(other) => Stored::Damaged(format!("the host id holds {other:?}, not a checked identity")),
    })
}

/// What [`Spool::open`](crate::Spool::open) found of the machine the file belongs to
/// ([`OpenReport::host`](crate::OpenReport::host)).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum HostCheck {
    /// Opened without a host id: nothing checked, nothing written.
    #[default]
    Unchecked,
    /// The file names this host already.
    Same,
    /// The file named no host (or a damaged one), and names this one now.
    Adopted {
        /// What was wrong with the row, if it was damaged rather than absent.
        damaged: Option<String>,
    },
    /// The file was made on another host: it has a new spool id and names this host now.
    Moved {
        /// The host the file named.
        from: String,
        /// The spool id it had there.
        old_id: SpoolId,
        /// The id it has now.
        new_id: SpoolId,
    },
}

/// Compares the file's host with `host` (an empty one counts as none) and records `host`,
/// drawing a new spool id when the file names another host. The new id is committed with
/// `synchronous = FULL` whatever the spool's durability: a new id that a power cut took back
/// would be drawn again at the next open, and the chunks sent under the first one stored
/// twice. Recording a host where none (or a damaged one) was is optional: a failure is logged
/// and reported as [`HostCheck::Unchecked`].
///
/// # Errors
/// [`SpoolError::Inconsistent`] when the meta values fail their checksum (the caller moves the
/// file aside, as for any open that finds them damaged), SQLite errors otherwise.
pub(crate) fn settle(conn: &mut Connection, host: Option<&str>) -> Result<HostCheck, SpoolError> {
    let Some(host) = host.filter(|h| !h.is_empty()) else { return Ok(HostCheck::Unchecked) };
    let (from, old_id) = match read(conn)? {
        Stored::Intact(h) if h == host => return Ok(HostCheck::Same),
        Stored::Intact(from) => {
            let meta = crate::schema::read_verified_meta(conn)?;
            let old_id = SpoolId(meta.spool_id.as_slice().try_into().map_err(|_| {
                SpoolError::Inconsistent(format!("spool id has {} bytes, expected 16", meta.spool_id.len()))
            })?);
            (from, old_id)
        }
        absent_or_damaged => {
            let damaged = match absent_or_damaged {
                Stored::Damaged(why) => Some(why),
                _ => None,
            };
            // Optional: a row a failed write (a full disk) or a power cut leaves out is written
            // at the next open, and a spool that cannot be written now must still open, to drain.
            return Ok(match write(conn, Some(host), None) {
                Ok(()) => HostCheck::Adopted { damaged },
                Err(e) => {
                    tracing::warn!(error = %e, "the spool could not record the machine it runs on; it checks again at the next open");
                    HostCheck::Unchecked
                }
            });
        }
    };
    let new_id = SpoolId::random();
    write_new_id(conn, Some(host), new_id)?;
    Ok(HostCheck::Moved { from, old_id, new_id })
}

/// Commits `new_id` as the spool id (and `host` as its machine, if given) with
/// `synchronous = FULL`, then puts the connection's level back.
pub(crate) fn write_new_id(conn: &mut Connection, host: Option<&str>, new_id: SpoolId) -> Result<(), SpoolError> {
    let sync: i64 = conn.pragma_query_value(None, "synchronous", |r| r.get(0)).map_err(ctx("reading synchronous"))?;
    conn.pragma_update(None, "synchronous", "FULL").map_err(ctx("setting synchronous"))?;
    let done = write(conn, host, Some(new_id));
    // After the transaction, committed or rolled back: the level cannot change inside one. The
    // new id stands once committed: a level left at FULL only makes commits slower, and an
    // error here would leave the caller with the old id and the file with the new one.
    if let Err(e) = conn.pragma_update(None, "synchronous", sync) {
        tracing::warn!(error = %e, "the spool's synchronous level could not be set back after a new spool id; commits stay FULL");
    }
    done
}

/// One transaction: with `host` the host row, with `new_id` the spool id and the meta checksum
/// over it.
fn write(conn: &mut Connection, host: Option<&str>, new_id: Option<SpoolId>) -> Result<(), SpoolError> {
    let tx =
        conn.transaction_with_behavior(TransactionBehavior::Immediate).map_err(ctx("beginning the host id update"))?;
    if let Some(id) = new_id {
        let mut meta = crate::schema::read_verified_meta(&tx)?;
        meta.spool_id = id.0.to_vec();
        tx.execute("UPDATE meta SET value = ?2 WHERE key = ?1", (META_SPOOL_ID, &meta.spool_id))
            .map_err(ctx("writing the new spool id"))?;
        tx.execute("UPDATE meta SET value = ?2 WHERE key = ?1", (META_ROW_CRC, meta.crc()))
            .map_err(ctx("updating the meta checksum"))?;
    }
    if let Some(host) = host {
        tx.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)", (META_HOST_ID, value(host)))
            .map_err(ctx("writing the host id"))?;
    }
    tx.commit().map_err(ctx("committing the host id"))
}
