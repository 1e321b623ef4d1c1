//! Payload segment files (schema version 4): append-only files next to the database that hold
//! the batches' bytes, SQLite keeping only the index (`batches.segment`, `seg_offset`,
//! `seg_len`).
//!
//! A segment is `<path>-seg-<id>` (ten digits), in the database's directory. The writer appends
//! a commit's bytes, framed as its commit record (`journal.rs`: a prefix, the batches, a
//! trailer listing the commit's rows), to the *active* segment at its committed end, `fdatasync`s it, and only then
//! commits the index rows that point at them; so a committed row never points at bytes that
//! were not durable, whichever the durability of the index commit. A commit that fails leaves
//! its bytes past the committed end, where the next commit overwrites them and the next open
//! cuts them off. Bytes below the committed end are never written again while a row points at
//! them.
//!
//! With deferred syncs ([`SegmentWriter::defer_syncs`], from
//! [`Spool::defer_wal_sync`](crate::Spool::defer_wal_sync)) the write is not synced: it is
//! registered, and the [`WalSync`](crate::WalSync) syncs it, before anyone is answered. A
//! committed row may then point at bytes a power cut loses; open finds and drops such rows
//! ([`crate::unsynced`]). And the rows of a commit whose bytes were synced may be lost with the
//! WAL; open adds them back from the commit record (`journal.rs`).
//!
//! A segment is deleted once no row points into it and it is not the active one, after the
//! commit that deleted its last rows. A crash in between leaves a file that no row references:
//! [`SegmentWriter::open`] deletes it, and cuts each referenced segment back to the end of its
//! last row, or of the newest one's last commit record (the bytes of a commit that did not
//! finish).
//!
//! A deleted segment is *recycled* rather than unlinked when it can be: renamed to
//! `<path>-seg-spare-<n>` (at most [`SPARES`] of them), and renamed again to the next new
//! segment's name, whose bytes then overwrite its old ones from offset 0. An `fdatasync` after
//! an overwrite of blocks the file system already holds flushes only data, while one after an
//! append also commits the file system's journal (block allocation, file size): on the
//! machines measured it took half the time and half the CPU (`BENCHMARKS.md`). The old bytes
//! past the committed end are dead, as after a failed commit: no row points at them. While the
//! disk reserve is released (a full file system), segments are deleted instead, and spares are
//! deleted too, so their space goes back at once.
//!
//! Segments pin disk space until every chunk in them is acked: a quarantined chunk keeps its
//! segment until it is purged. `max_bytes` counts live payload bytes, not segment files (nor
//! the spare).

use std::collections::{BTreeMap, BTreeSet};
use std::fs::{self, File, OpenOptions};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::recovery::with_suffix;
use crate::walsync::SegmentSyncs;
use crate::{Durability, SpoolError};

/// What the index says about one segment: the rows that still point into it, the end of its
/// last row, and the smallest and largest batch id that ever pointed into it (since open).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentUse {
    pub rows: u64,
    pub end: u64,
    /// Every row that points into the segment has an id in `first_batch..=last_batch`: rows
    /// are never renumbered or moved, so the bounds only widen (empty: `first > last`). They
    /// let the check that a segment is unused read its own rows, not the whole table.
    pub first_batch: i64,
    pub last_batch: i64,
}

impl Default for SegmentUse {
    fn default() -> Self {
        SegmentUse { rows: 0, end: 0, first_batch: i64::MAX, last_batch: i64::MIN }
    }
}

impl SegmentUse {
    /// Counts a new row `id` pointing into the segment.
    pub(crate) fn add_row(&mut self, id: i64) {
        self.rows += 1;
        self.first_batch = self.first_batch.min(id);
        self.last_batch = self.last_batch.max(id);
    }
}

/// The path of segment `id` of the spool at `db`.
pub(crate) fn path(db: &Path, id: i64) -> PathBuf {
    with_suffix(db, &format!("-seg-{id:010}"))
}

/// Deleted segments kept for reuse at most (see the module docs). One is enough for a spool
/// that drains as fast as it fills: the active segment, once dead, is recycled into the next.
pub(crate) const SPARES: usize = 1;

/// The path of spare segment file `n` of the spool at `db`.
pub(crate) fn spare_path(db: &Path, n: usize) -> PathBuf {
    with_suffix(db, &format!("-seg-spare-{n}"))
}

/// The directory holding the spool at `db` (its segments, sidecars and reserve).
pub(crate) fn dir_of(db: &Path) -> &Path {
    db.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// The segment files of the spool at `db`: `(id, path)`, by id.
pub(crate) fn list(db: &Path) -> Result<Vec<(i64, PathBuf)>, SpoolError> {
    let dir = dir_of(db).to_owned();
    let Some(name) = db.file_name().and_then(|n| n.to_str()) else { return Ok(Vec::new()) };
    let prefix = format!("{name}-seg-");
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(SpoolError::Io { path: dir, source }),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| SpoolError::Io { path: dir.clone(), source })?;
        let file_name = entry.file_name();
        let Some(id) = file_name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .filter(|digits| !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|digits| digits.parse::<i64>().ok())
        else {
            continue;
        };
        out.push((id, entry.path()));
    }
    out.sort();
    Ok(out)
}

/// Disk space the files of the spool at `db` take: the database with its `-wal` and `-shm`,
/// its payload segments and the spare, from their allocated blocks. Not counted: the disk
/// reserve (a fixed ballast) and files moved aside (`.corrupt-…`, `.orphan-…`).
///
/// # Errors
/// The directory cannot be read.
pub fn disk_usage(db: &Path) -> Result<u64, SpoolError> {
    use std::os::unix::fs::MetadataExt;
    let dir = dir_of(db).to_owned();
    let Some(name) = db.file_name().and_then(|n| n.to_str()) else { return Ok(0) };
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
        Err(source) => return Err(SpoolError::Io { path: dir, source }),
    };
    let seg_prefix = format!("{name}-seg-");
    let mut total = 0u64;
    for entry in entries {
        let entry = entry.map_err(|source| SpoolError::Io { path: dir.clone(), source })?;
        let file_name = entry.file_name();
        let Some(n) = file_name.to_str() else { continue };
        let ours = n == name || n == format!("{name}-wal") || n == format!("{name}-shm") || n.starts_with(&seg_prefix);
        if !ours {
            continue;
        }
        // A file deleted between the listing and the stat (a segment emptied meanwhile) counts 0.
        if let Ok(m) = entry.metadata() {
            total = total.saturating_add(m.blocks().saturating_mul(512));
        }
    }
    Ok(total)
}

/// `create_dir_all` whose creations are durable: the parent of each directory it created is
/// fsynced, top down, before it returns. A spool made in a directory whose own name a power cut
/// can take would go with it, acknowledged records and all.
pub(crate) fn create_dir_all_synced(dir: &Path) -> Result<(), SpoolError> {
    fn io(path: &Path) -> impl Fn(std::io::Error) -> SpoolError + '_ {
        move |source| SpoolError::Io { path: path.to_owned(), source }
    }
    let mut missing = Vec::new();
    let mut at = dir;
    while !at.as_os_str().is_empty() {
        match std::fs::symlink_metadata(at) {
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => missing.push(at),
            Err(e) => return Err(io(at)(e)),
        }
        let Some(parent) = at.parent() else { break };
        at = parent;
    }
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    for created in missing.iter().rev() {
        let parent = dir_of(created);
        File::open(parent).and_then(|d| d.sync_all()).map_err(io(parent))?;
    }
    if missing.is_empty() {
        // A run that created `dir` may have stopped before it synced the name: once more, at
        // every start, best effort (the parent is not ours, and may not be readable).
        let parent = dir_of(dir);
        if let Err(e) = File::open(parent).and_then(|d| d.sync_all()) {
            tracing::debug!(dir = %parent.display(), error = %e, "could not fsync the spool directory's parent");
        }
    }
    Ok(())
}

/// `fsync` of the directory holding `db`, so a created, renamed or deleted name is durable.
pub(crate) fn sync_dir(db: &Path) -> Result<(), SpoolError> {
    let dir = dir_of(db);
    File::open(dir).and_then(|d| d.sync_all()).map_err(|source| SpoolError::Io { path: dir.to_owned(), source })
}

/// An I/O error from a segment file; `ENOSPC` and `EDQUOT` are [`SpoolError::DiskFull`].
pub(crate) fn io_error(path: &Path, source: io::Error) -> SpoolError {
    match source.raw_os_error() {
        Some(code) if code == rustix::io::Errno::NOSPC.raw_os_error() => SpoolError::DiskFull,
        Some(code) if code == rustix::io::Errno::DQUOT.raw_os_error() => SpoolError::DiskFull,
        _ => SpoolError::Io { path: path.to_owned(), source },
    }
}

/// The segment being appended to.
#[derive(Debug)]
struct Active {
    id: i64,
    /// Shared with the [`SegmentSyncs`] while a deferred sync is due.
    file: Arc<File>,
    /// Bytes committed: the end of the last row that points into this segment.
    end: u64,
}

/// The writer's side: the active segment and the next id.
#[derive(Debug)]
pub(crate) struct SegmentWriter {
    db: PathBuf,
    /// A new segment is started when the active one holds at least this many bytes.
    target: u64,
    active: Option<Active>,
    next_id: i64,
    /// Bytes written past `active.end` by a commit not yet known to have committed.
    pending: u64,
    /// Those bytes were written (and fdatasynced, unless syncs are deferred): only the index
    /// commit is outstanding, and if it fails they are stepped over, never overwritten.
    pending_durable: bool,
    /// Deferred syncs: each write is registered here instead of synced.
    deferred: Option<SegmentSyncs>,
    /// Writes made, numbered from 1 (for [`SegmentSyncs`]).
    writes: u64,
    /// Segments no longer written to; each is deleted once no row points into it.
    retired: BTreeSet<i64>,
    /// Spare files (deleted segments kept for reuse), at most [`SPARES`].
    spares: Vec<PathBuf>,
    /// `synchronous=NORMAL` (configured, or deferred syncs): a commit is not durable when it
    /// returns, so the WAL is fsynced before segments are deleted, lest a power cut bring back
    /// rows that point into them.
    sync_wal_before_delete: bool,
    /// Set when a failed commit's record could not be voided: appends are refused from then
    /// on (the reason).
    broken: Option<String>,
    /// Unit tests: every write fails as on a full file system.
    #[cfg(test)]
    pub(crate) simulate_full: bool,
    /// Unit tests: the next void of a failed commit's record fails.
    #[cfg(test)]
    pub(crate) fail_next_void: bool,
}

impl SegmentWriter {
    /// Deletes segment files no row references (`used`, from the index), cuts referenced ones
    /// back to the end of their last row, and continues the newest one if it has room and its
    /// commit records reach its last row: `tail`, from [`crate::journal::replay`], is where they
    /// end, and where the next record goes (a segment whose records stop short of its rows is
    /// not continued, so that every later record can be read back from offset 0).
    ///
    /// For a spool file that was just `created`, segment files are not deleted but moved aside
    /// as `<path>.orphan-<unix-seconds>-seg-<id>`: they belong to a database that is gone, and
    /// their bytes are all that is left of it.
    pub(crate) fn open(
        db: &Path,
        target: u64,
        used: &BTreeMap<i64, SegmentUse>,
        created: bool,
        durability: Durability,
        tail: Option<(i64, u64)>,
    ) -> Result<SegmentWriter, SpoolError> {
        let files = list(db)?;
        let mut next_id = used.keys().max().copied().unwrap_or(0);
        let mut changed_names = false;
        let mut present = BTreeMap::new();
        for (id, file) in files {
            next_id = next_id.max(id);
            if used.contains_key(&id) {
                present.insert(id, file);
                continue;
            }
            if created {
                let secs =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                let to = with_suffix(db, &format!(".orphan-{secs}-seg-{id:010}"));
                tracing::error!(
                    segment = %file.display(),
                    moved_to = %to.display(),
                    "a payload segment file without its spool database; moved it aside"
                );
                fs::rename(&file, &to).map_err(|source| SpoolError::Io { path: file.clone(), source })?;
            } else {
                tracing::info!(segment = %file.display(), "removing a payload segment no row references");
                fs::remove_file(&file).map_err(|source| SpoolError::Io { path: file.clone(), source })?;
            }
            changed_names = true;
        }
        let mut spares = Vec::new();
        for n in 0..SPARES {
            let p = spare_path(db, n);
            if !p.exists() {
                continue;
            }
            if created {
                // A spare holds only bytes that were acked; a new spool has no use for them.
                fs::remove_file(&p).map_err(|source| SpoolError::Io { path: p.clone(), source })?;
                changed_names = true;
            } else {
                spares.push(p);
            }
        }
        if changed_names {
            sync_dir(db)?;
        }
        let last = used.keys().next_back().copied();
        let mut active = None;
        for (id, u) in used {
            let Some(file) = present.get(id) else {
                tracing::error!(
                    segment = %path(db, *id).display(),
                    rows = u.rows,
                    "a payload segment file is missing; its chunks will be quarantined when read"
                );
                continue;
            };
            let len = fs::metadata(file).map_err(|e| io_error(file, e))?.len();
            if len < u.end {
                tracing::error!(
                    segment = %file.display(),
                    len,
                    expected = u.end,
                    "a payload segment file is shorter than its rows say; its chunks will be quarantined when read"
                );
                // Not continued either: new bytes must land exactly at `end`.
                continue;
            }
            // The records' end, when they reach past the last row (the last record's trailer).
            let chained = tail.filter(|(t, e)| t == id && *e >= u.end && *e <= len);
            let end = chained.map_or(u.end, |(_, e)| e);
            let continued = Some(*id) == last && end < target && chained.is_some();
            if len == end && !continued {
                continue;
            }
            let f = OpenOptions::new().read(true).write(true).open(file).map_err(|e| io_error(file, e))?;
            if len > end {
                // The bytes of a commit that did not finish.
                f.set_len(end).map_err(|e| io_error(file, e))?;
                f.sync_data().map_err(|e| io_error(file, e))?;
            }
            if continued {
                active = Some(Active { id: *id, file: Arc::new(f), end });
            }
        }
        let w = SegmentWriter {
            db: db.to_owned(),
            target,
            active,
            next_id: next_id.saturating_add(1),
            pending: 0,
            pending_durable: false,
            deferred: None,
            writes: 0,
            retired: BTreeSet::new(),
            spares,
            sync_wal_before_delete: durability == Durability::Normal,
            broken: None,
            #[cfg(test)]
            simulate_full: false,
            #[cfg(test)]
            fail_next_void: false,
        };
        Ok(w)
    }

    /// The segment and offset the next commit's bytes go to, starting a new segment (created,
    /// its name made durable) when there is none or the active one is full.
    pub(crate) fn prepare(&mut self) -> Result<(i64, u64), SpoolError> {
        if let Some(a) = &self.active
            && a.end < self.target
        {
            return Ok((a.id, a.end));
        }
        let id = self.next_id;
        let p = path(&self.db, id);
        // An id above every referenced one: a file by that name is a leftover (an unlink or a
        // failed commit's creation), never data. A spare keeps its bytes (dead: they are
        // overwritten from offset 0, and no row points past what was written).
        let recycled = self.spares.pop().is_some_and(|spare| match fs::rename(&spare, &p) {
            Ok(()) => true,
            Err(e) => {
                tracing::debug!(spare = %spare.display(), error = %e, "could not reuse a spare payload segment");
                false
            }
        });
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(!recycled)
            .open(&p)
            .map_err(|e| io_error(&p, e))?;
        sync_dir(&self.db)?;
        self.next_id = id.saturating_add(1);
        if let Some(old) = self.active.replace(Active { id, file: Arc::new(file), end: 0 }) {
            self.retired.insert(old.id);
        }
        Ok((id, 0))
    }

    /// Writes `parts`, back to back, at the active segment's committed end and `fdatasync`s
    /// them (or, with deferred syncs, registers them to be synced). The bytes count only after
    /// [`SegmentWriter::committed`]; until then the next write or open overwrites or cuts them.
    pub(crate) fn write(&mut self, parts: &[&[u8]]) -> Result<(), SpoolError> {
        let Some(a) = &mut self.active else {
            return Err(SpoolError::Inconsistent("segment write without an active segment".into()));
        };
        let p = path(&self.db, a.id);
        if let Some(reason) = &self.broken {
            return Err(SpoolError::Io { path: p, source: io::Error::other(reason.clone()) });
        }
        self.pending = parts.iter().map(|d| crate::len_u64(d)).sum();
        self.pending_durable = false;
        #[cfg(test)]
        let full = self.simulate_full;
        #[cfg(not(test))]
        let full = false;
        let result = if full {
            Err(io::Error::from_raw_os_error(rustix::io::Errno::NOSPC.raw_os_error()))
        } else {
            write_all_vectored_at(&a.file, parts, a.end)
        };
        let deferred = self.deferred.as_ref();
        let result = result.and_then(|()| {
            crate::crash_point!("spool::segment::written");
            if deferred.is_some() { Ok(()) } else { a.file.sync_data() }
        });
        let Err(e) = result else {
            self.pending_durable = true;
            self.writes += 1;
            if let Some(syncs) = deferred {
                syncs.register(a.id, &a.file, self.writes, self.pending);
            }
            return Ok(());
        };
        let err = io_error(&p, e);
        self.abandon();
        if matches!(err, SpoolError::DiskFull) {
            self.drop_spares();
        }
        if matches!(err, SpoolError::DiskFull)
            && let Some(a) = self.active.take_if(|a| a.end > 0)
        {
            // Its dead bytes would stay until it filled up, which a full disk never lets it do:
            // retired, it is deleted once its chunks are acked, and the next commit starts a
            // new segment.
            self.retired.insert(a.id);
        }
        Err(err)
    }

    /// From now on, writes are not synced but registered in `syncs` for a
    /// [`WalSync`](crate::WalSync) to sync.
    pub(crate) fn defer_syncs(&mut self, syncs: SegmentSyncs) {
        self.deferred = Some(syncs);
    }

    /// The number of the last successful write (0: none yet), as registered with deferred
    /// syncs.
    pub(crate) fn last_write(&self) -> u64 {
        self.writes
    }

    /// The index commit that points at the last written bytes succeeded.
    pub(crate) fn committed(&mut self) {
        if let Some(a) = &mut self.active {
            a.end += self.pending;
        }
        self.pending = 0;
        self.pending_durable = false;
    }

    /// The commit failed. When its bytes never became durable, gives back their disk blocks
    /// (best effort; the next write overwrites them anyway, and the next open cuts them). When
    /// only the index commit failed, they are stepped over instead, never overwritten: after an
    /// I/O error during `COMMIT`, SQLite cannot tell whether the transaction is in the WAL, and
    /// if it is, its rows point at these bytes after a restart. (If it is not, the next open
    /// cuts them when they are the segment's tail; otherwise they stay as dead bytes.)
    pub(crate) fn abandon(&mut self) {
        if self.pending == 0 {
            return;
        }
        let pending = std::mem::take(&mut self.pending);
        let Some(a) = &mut self.active else { return };
        if std::mem::take(&mut self.pending_durable) {
            // Its commit record must not bring the commit back at the next open if the rows
            // are not in the WAL: the next commit reuses its batch ids. Synced (or registered)
            // like a write, so it is durable before the next commit is.
            #[cfg(test)]
            let simulated = std::mem::take(&mut self.fail_next_void);
            #[cfg(not(test))]
            let simulated = false;
            let void = if simulated {
                Err(io::Error::other("voiding failed (simulated)"))
            } else {
                crate::journal::void(&a.file, a.end)
            };
            let voided = void.and_then(|()| match &self.deferred {
                Some(syncs) => {
                    self.writes += 1;
                    syncs.register(a.id, &a.file, self.writes, 0);
                    Ok(())
                }
                None => a.file.sync_data(),
            });
            if let Err(e) = voided {
                // Replay could bring the failed commit back and take the next one, which reuses
                // its ids, for one already in the index: no more appends until a restart.
                tracing::error!(segment = a.id, error = %e, "could not void a failed commit's record; refusing appends until restart");
                self.broken = Some(format!("voiding the record of a failed commit at offset {} failed: {e}", a.end));
            }
            a.end += pending;
        } else if let Err(e) = a.file.set_len(a.end) {
            tracing::debug!(segment = a.id, error = %e, "could not cut back a failed commit's bytes");
        }
    }

    /// After a commit: deletes the segments that were `used` before it (or retired) and that no
    /// row points into now (`used_now`). The active segment is retired first when no row points
    /// into it and it holds at least a quarter of the target: its bytes are all dead, and
    /// keeping them until it fills would hold that much disk for nothing (a spool that drains
    /// as fast as it fills would never give it back).
    ///
    /// With `recycle` (the disk reserve is in place), a dead segment may become the spare
    /// instead of being unlinked.
    pub(crate) fn collect<'a>(
        &mut self,
        used_before: impl Iterator<Item = &'a i64>,
        used_now: &BTreeMap<i64, SegmentUse>,
        recycle: bool,
    ) {
        if let Some(a) = self.active.take_if(|a| !used_now.contains_key(&a.id) && a.end >= self.target / 4) {
            self.retired.insert(a.id);
        }
        let active = self.active_id();
        let dead: BTreeSet<i64> = used_before
            .copied()
            .chain(self.retired.iter().copied())
            .filter(|id| !used_now.contains_key(id) && Some(*id) != active)
            .collect();
        if dead.is_empty() {
            return;
        }
        if self.sync_wal_before_delete {
            let wal = with_suffix(&self.db, "-wal");
            if let Err(e) = File::open(&wal).and_then(|f| f.sync_data())
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(wal = %wal.display(), error = %e, "could not fsync the WAL; payload segments kept for now");
                self.retired.extend(dead);
                return;
            }
        }
        self.retired.retain(|id| !dead.contains(id));
        if !recycle {
            self.drop_spares();
        }
        self.remove(dead, recycle);
    }

    /// Whether the WAL is fsynced before dead segments are deleted: needed whenever a commit
    /// may return before it is durable.
    pub(crate) fn sync_wal_before_delete(&mut self, on: bool) {
        self.sync_wal_before_delete = on;
    }

    /// Deletes the spare segment files (their space is needed: the disk is full).
    pub(crate) fn drop_spares(&mut self) {
        for p in self.spares.drain(..) {
            match fs::remove_file(&p) {
                Ok(()) => tracing::debug!(spare = %p.display(), "spare payload segment deleted"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(spare = %p.display(), error = %e, "could not delete a spare payload segment"),
            }
        }
    }

    /// A dead segment is worth keeping as the spare when it holds at least a quarter of the
    /// target: a smaller one saves little of the next segment's file growth.
    fn worth_recycling(&self, p: &Path) -> bool {
        fs::metadata(p).is_ok_and(|m| m.len() >= self.target / 4)
    }

    /// The active segment and its committed end.
    #[cfg(test)]
    pub(crate) fn active_end(&self) -> Option<(i64, u64)> {
        self.active.as_ref().map(|a| (a.id, a.end))
    }

    /// The id of the active segment, if any.
    fn active_id(&self) -> Option<i64> {
        self.active.as_ref().map(|a| a.id)
    }

    /// Deletes segment files no row references any more. Best effort: a failure is logged, and
    /// the next open deletes what is left. The directory is not fsynced: a name that comes back
    /// after a power cut is unreferenced, and the next open deletes it.
    fn remove(&mut self, ids: BTreeSet<i64>, recycle: bool) {
        for id in ids {
            let p = path(&self.db, id);
            if recycle && self.spares.len() < SPARES && self.worth_recycling(&p) {
                let spare = (0..SPARES).map(|n| spare_path(&self.db, n)).find(|sp| !self.spares.contains(sp));
                if let Some(spare) = spare {
                    match fs::rename(&p, &spare) {
                        Ok(()) => {
                            tracing::debug!(segment = id, "payload segment emptied and kept as the spare");
                            self.spares.push(spare);
                            continue;
                        }
                        Err(e) => {
                            tracing::debug!(segment = id, error = %e, "could not keep a payload segment as spare")
                        }
                    }
                }
            }
            match fs::remove_file(&p) {
                Ok(()) => tracing::debug!(segment = id, "payload segment emptied and deleted"),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    tracing::warn!(segment = %p.display(), error = %e, "could not delete an empty payload segment")
                }
            }
        }
    }
}

/// Read side: open segment files by id, kept open while one chunk is read (each segment is
/// opened once per chunk, not once per batch) and closed after it (see
/// [`SpoolReader::read_payload`](crate::SpoolReader::read_payload)).
#[derive(Debug)]
pub(crate) struct SegmentFiles {
    db: PathBuf,
    /// Each open file with its size when last asked.
    open: BTreeMap<i64, (File, u64)>,
}

/// Segment handles a reader keeps open at most.
const OPEN_SEGMENTS: usize = 16;

impl SegmentFiles {
    pub(crate) fn new(db: &Path) -> SegmentFiles {
        SegmentFiles { db: db.to_owned(), open: BTreeMap::new() }
    }

    /// Appends `len` bytes at `offset` of segment `id` to `out`. On error `out` is unchanged.
    /// The error says what went wrong, for a [`SpoolError::Corrupt`] detail; `Err(None)` means
    /// the file does not exist. A range past the end of the file is an error before anything
    /// is allocated for it: `offset` and `len` may come from a row not checked yet (`spool
    /// check` reads before it checks), and a damaged length of 2^50 must not abort the process.
    pub(crate) fn read_into(
        &mut self,
        id: i64,
        offset: u64,
        len: u64,
        out: &mut Vec<u8>,
    ) -> Result<(), Option<String>> {
        let p = path(&self.db, id);
        let size_of =
            |f: &File| f.metadata().map(|m| m.len()).map_err(|e| Some(format!("segment {}: {e}", p.display())));
        if !self.open.contains_key(&id) {
            let f = match File::open(&p) {
                Ok(f) => f,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(None),
                Err(e) => return Err(Some(format!("segment {}: {e}", p.display()))),
            };
            let size = size_of(&f)?;
            if self.open.len() >= OPEN_SEGMENTS {
                // The oldest segments are the first to be emptied and deleted.
                self.open.pop_first();
            }
            self.open.insert(id, (f, size));
        }
        let Some((f, size)) = self.open.get_mut(&id) else { return Err(Some("segment handle vanished".into())) };
        // Nothing to read is never past the end (an empty batch's row need not have a record
        // around it in the file).
        let end = offset.checked_add(len);
        if len > 0 && end.is_none_or(|end| end > *size) {
            // The active segment grows: ask again before calling it damage.
            *size = size_of(f)?;
            if end.is_none_or(|end| end > *size) {
                return Err(Some(format!(
                    "segment {id}: {len} bytes at {offset} reach past the end of the file ({size} bytes)"
                )));
            }
        }
        let f = &*f;
        let len = usize::try_from(len).map_err(|_| Some(format!("segment {id}: length {len} too large")))?;
        match append_at(f, offset, len, out) {
            Ok(()) => Ok(()),
            Err(e) => {
                let size = f.metadata().map(|m| m.len()).unwrap_or(0);
                Err(Some(format!("segment {id}: reading {len} bytes at {offset} (file has {size}): {e}")))
            }
        }
    }

    /// Closes every handle.
    pub(crate) fn close_all(&mut self) {
        self.open.clear();
    }
}

/// Appends the `len` bytes of `f` at `offset` to `out`, or nothing on error. The bytes are read
/// straight into `out`'s spare capacity: zero-filling it first (`resize`, then `read_exact_at`)
/// was an eighth of the reader's time in a drain profile.
#[allow(unsafe_code)]
fn append_at(f: &File, offset: u64, len: usize, out: &mut Vec<u8>) -> io::Result<()> {
    let start = out.len();
    let end = start.checked_add(len).ok_or_else(|| io::Error::other("length overflows"))?;
    out.reserve(len);
    while out.len() < end {
        let at = offset + crate::len_u64(&out[start..]);
        let room = end - out.len();
        let n = match rustix::io::pread(f, &mut out.spare_capacity_mut()[..room], at) {
            Ok((read, _)) => read.len(),
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                out.truncate(start);
                return Err(e.into());
            }
        };
        if n == 0 {
            out.truncate(start);
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        // SAFETY: `pread` initialised the first `n` bytes of the spare capacity, and
        // `n <= room`, so the new length stays within what `reserve` made room for.
        unsafe { out.set_len(out.len() + n) };
    }
    Ok(())
}

/// Most slices one `pwritev` takes (`IOV_MAX` on Linux).
const MAX_IOVECS: usize = 1024;

/// Writes every byte of `parts`, back to back, at `offset`: one `pwritev` per `MAX_IOVECS`
/// parts, continued after a short write. The parts are the producers' batches themselves, so a
/// commit's bytes are not first copied into one buffer.
fn write_all_vectored_at(file: &File, parts: &[&[u8]], mut offset: u64) -> io::Result<()> {
    let mut slices: Vec<io::IoSlice<'_>> =
        parts.iter().filter(|p| !p.is_empty()).map(|p| io::IoSlice::new(p)).collect();
    let mut rest = &mut slices[..];
    while !rest.is_empty() {
        let n = rest.len().min(MAX_IOVECS);
        match rustix::io::pwritev(file, &rest[..n], offset) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "segment write wrote nothing")),
            Ok(written) => {
                offset += written as u64;
                io::IoSlice::advance_slices(&mut rest, written);
            }
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn append_at_appends_exactly_the_range_or_nothing() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("seg");
        let bytes: Vec<u8> = (0..=255).collect();
        std::fs::write(&p, &bytes).expect("write");
        let f = File::open(&p).expect("open");

        let mut out = vec![7, 7];
        append_at(&f, 3, 5, &mut out).expect("in range");
        assert_eq!(out, [7, 7, 3, 4, 5, 6, 7]);
        append_at(&f, 250, 6, &mut out).expect("up to the end");
        assert_eq!(out[7..], [250, 251, 252, 253, 254, 255]);

        let before = out.clone();
        let e = append_at(&f, 250, 7, &mut out).expect_err("one byte past the end");
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        assert_eq!(out, before, "a failed read leaves nothing behind");
        append_at(&f, 0, 0, &mut out).expect("nothing to read");
        assert_eq!(out, before);
    }

    #[test]
    fn a_range_past_the_end_is_refused_before_anything_is_read_and_a_grown_file_is_seen() {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = dir.path().join("spool.db");
        let bytes: Vec<u8> = (0..100).collect();
        std::fs::write(path(&db, 1), &bytes).expect("write");
        let mut files = SegmentFiles::new(&db);
        let mut out = Vec::new();
        files.read_into(1, 90, 10, &mut out).expect("in range");
        assert_eq!(out, bytes[90..]);
        // A damaged length: refused with nothing allocated for it.
        for (offset, len) in [(90, 1 << 50), (90, 11), (u64::MAX, 1)] {
            let detail = files.read_into(1, offset, len, &mut out).expect_err("past the end").expect("a detail");
            assert!(detail.contains("past the end of the file (100 bytes)"), "{detail}");
        }
        assert_eq!(out, bytes[90..]);
        assert!(out.capacity() < 1 << 20, "{}", out.capacity());
        files.read_into(1, 1_000, 0, &mut out).expect("nothing to read is never past the end");
        // The active segment grows while a reader holds it open.
        let f = OpenOptions::new().append(true).open(path(&db, 1)).expect("open");
        std::io::Write::write_all(&mut &f, &[7; 50]).expect("append");
        files.read_into(1, 140, 10, &mut out).expect("the grown part");
        assert_eq!(out[10..], [7; 10]);
        assert_eq!(files.read_into(2, 0, 1, &mut out), Err(None), "a missing file");
    }

    #[test]
    fn vectored_writes_put_every_part_back_to_back_past_the_iovec_limit() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("seg");
        std::fs::write(&p, [9u8; 5]).expect("write");
        let f = OpenOptions::new().read(true).write(true).open(&p).expect("open");
        // More parts than one pwritev takes, of uneven sizes, some empty.
        let owned: Vec<Vec<u8>> = (0..2 * MAX_IOVECS + 7).map(|i| vec![(i % 251) as u8; i % 5]).collect();
        let parts: Vec<&[u8]> = owned.iter().map(Vec::as_slice).collect();
        write_all_vectored_at(&f, &parts, 3).expect("write");

        let want: Vec<u8> = [9, 9, 9].into_iter().chain(owned.concat()).collect();
        assert_eq!(std::fs::read(&p).expect("read"), want, "bytes before the offset kept, then every part in order");
        write_all_vectored_at(&f, &[], 0).expect("nothing to write");
        assert_eq!(std::fs::read(&p).expect("read"), want);
    }
}
