//! Reading segments back: header scan with resync, and the commit chain that tells which
//! entries belong to commits that failed.
//!
//! Shared by [`super::Store::open`] (which then repairs) and [`super::export`] (which never
//! writes). Scanning reads entry headers and seeks over payloads; payloads are read only by
//! [`verify_payload`]. Nothing here panics on any file content.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use super::StoreError;
use super::format::{self, ENTRY_MAGIC, ENTRY_PREFIX_LEN, EntryHeader, SEGMENT_HEADER_LEN, SegmentHeader};

/// Bytes read at a time when scanning headers: small entries share one read, large payloads
/// are skipped by seeking.
const WINDOW: usize = 16 * 1024;
/// Bytes read at a time when checking a payload CRC.
const VERIFY_BUF: usize = 1 << 20;

/// Segment files in `segments_dir`, sorted by number. A missing directory has none; files with
/// other names are logged and ignored.
pub fn list_segments(segments_dir: &Path) -> Result<Vec<(u64, PathBuf)>, StoreError> {
    let io_err = |source| StoreError::Io { path: segments_dir.to_path_buf(), source };
    let entries = match fs::read_dir(segments_dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io_err(e)),
    };
    let mut out = Vec::new();
    for entry in entries {
        let entry = entry.map_err(io_err)?;
        let name = entry.file_name();
        let is_file = entry.file_type().map_err(io_err)?.is_file();
        match name.to_str().and_then(format::parse_segment_file_name) {
            Some(n) if is_file => out.push((n, entry.path())),
            _ => {
                tracing::warn!(path = %entry.path().display(), "ignoring unexpected entry in segments directory")
            }
        }
    }
    out.sort_unstable_by_key(|(n, _)| *n);
    Ok(out)
}

/// Buffered positional reads over one segment file of a known length.
#[derive(Debug)]
pub struct Reader<'f> {
    file: &'f File,
    len: u64,
    buf: Vec<u8>,
    buf_start: u64,
}

impl<'f> Reader<'f> {
    /// Reads `file` as if it were `len` bytes long.
    pub fn new(file: &'f File, len: u64) -> Self {
        Self { file, len, buf: Vec::new(), buf_start: 0 }
    }

    /// Length of the file as scanned (shrinks if the file turns out shorter).
    pub fn len(&self) -> u64 {
        self.len
    }

    /// `n` bytes at `off`, or `None` if the file ends first.
    pub fn get(&mut self, off: u64, n: usize) -> io::Result<Option<&[u8]>> {
        let Some(end) = off.checked_add(n as u64) else {
            return Ok(None);
        };
        if end > self.len {
            return Ok(None);
        }
        let buf_end = self.buf_start + self.buf.len() as u64;
        if !(off >= self.buf_start && end <= buf_end) {
            let want = (self.len - off).min(n.max(WINDOW) as u64) as usize;
            self.buf.resize(want, 0);
            let mut filled = 0;
            while filled < want {
                match self.file.read_at(&mut self.buf[filled..], off + filled as u64) {
                    Ok(0) => break,
                    Ok(k) => filled += k,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        self.buf.clear();
                        return Err(e);
                    }
                }
            }
            self.buf.truncate(filled);
            self.buf_start = off;
            if filled < want {
                // The file is shorter than its length said (a concurrent truncate).
                self.len = off + filled as u64;
            }
            if filled < n {
                return Ok(None);
            }
        }
        let at = (off - self.buf_start) as usize;
        Ok(Some(&self.buf[at..at + n]))
    }
}

/// State of a segment's header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentHead {
    /// The file is empty.
    Empty,
    /// At least one copy of the header is valid.
    Valid(SegmentHeader),
    /// Neither copy is valid (or the file is shorter than the header).
    Invalid,
}

/// Reads and checks the segment header.
pub fn read_segment_head(reader: &mut Reader<'_>) -> io::Result<SegmentHead> {
    if reader.len() == 0 {
        return Ok(SegmentHead::Empty);
    }
    Ok(match reader.get(0, SEGMENT_HEADER_LEN as usize)? {
        Some(bytes) => SegmentHeader::decode(bytes).map_or(SegmentHead::Invalid, SegmentHead::Valid),
        None => SegmentHead::Invalid,
    })
}

/// One valid entry found by the scan.
#[derive(Debug, Clone)]
pub struct EntryMeta {
    /// Offset of the entry's magic.
    pub offset: u64,
    /// Offset of its payload.
    pub payload_offset: u64,
    /// Decoded header.
    pub header: EntryHeader,
}

impl EntryMeta {
    /// Offset just past the payload.
    pub fn end(&self) -> u64 {
        self.payload_offset + u64::from(self.header.fields.payload_len)
    }
}

/// What the scan found besides the entries.
#[derive(Debug, Default, Clone)]
pub struct ScanSummary {
    /// Valid entries found.
    pub entries: u64,
    /// Unparseable regions followed by a valid entry: `(start, end)`.
    pub corrupt: Vec<(u64, u64)>,
    /// Start of a region that runs to the end of the file and holds no valid entry: a torn or
    /// garbage tail.
    pub tail: Option<u64>,
}

impl ScanSummary {
    /// Bytes in corrupt regions.
    pub fn corrupt_bytes(&self) -> u64 {
        self.corrupt.iter().map(|(s, e)| e - s).sum()
    }
}

enum Probe {
    Valid(EntryMeta),
    /// Valid header whose payload runs past the end of the file.
    Torn,
    Invalid,
}

fn probe(reader: &mut Reader<'_>, off: u64, salt: u64) -> io::Result<Probe> {
    let Some(prefix) = reader.get(off, ENTRY_PREFIX_LEN)? else {
        return Ok(Probe::Invalid);
    };
    let total = match format::entry_header_total_len(prefix) {
        Ok(t) => t,
        Err(_) => return Ok(Probe::Invalid),
    };
    let Some(bytes) = reader.get(off, total)? else {
        return Ok(Probe::Invalid);
    };
    let header = match format::decode_entry_header(bytes, salt) {
        Ok(h) => h,
        Err(_) => return Ok(Probe::Invalid),
    };
    let payload_offset = off + total as u64;
    let meta = EntryMeta { offset: off, payload_offset, header };
    if meta.end() > reader.len() {
        return Ok(Probe::Torn);
    }
    Ok(Probe::Valid(meta))
}

/// Offset of the next valid (or torn) entry at or after `from`, found by searching for the
/// magic and checking the header at each hit.
fn resync(reader: &mut Reader<'_>, from: u64, salt: u64) -> io::Result<Option<u64>> {
    let magic_len = ENTRY_MAGIC.len();
    let mut pos = from;
    while pos + magic_len as u64 <= reader.len() {
        let n = (reader.len() - pos).min(WINDOW as u64) as usize;
        let Some(window) = reader.get(pos, n)? else {
            return Ok(None);
        };
        let hit = window.windows(magic_len).position(|w| w == ENTRY_MAGIC);
        match hit {
            Some(i) => {
                let at = pos + i as u64;
                match probe(reader, at, salt)? {
                    Probe::Valid(_) | Probe::Torn => return Ok(Some(at)),
                    Probe::Invalid => pos = at + 1,
                }
            }
            // Keep the last `magic_len - 1` bytes: a magic may straddle two windows.
            None => pos += (n + 1).saturating_sub(magic_len).max(1) as u64,
        }
    }
    Ok(None)
}

/// Scans the entries of a segment with a valid header, calling `on_entry` for each valid
/// entry in file order.
///
/// An invalid header starts a resync: the bytes up to the next valid header are a corrupt
/// region. A region with no valid header after it, or a valid header whose payload runs past
/// the end of the file, is the tail.
pub fn scan_entries(
    reader: &mut Reader<'_>,
    salt: u64,
    mut on_entry: impl FnMut(EntryMeta),
) -> io::Result<ScanSummary> {
    let mut summary = ScanSummary::default();
    let mut pos = SEGMENT_HEADER_LEN;
    while pos < reader.len() {
        match probe(reader, pos, salt)? {
            Probe::Valid(meta) => {
                pos = meta.end();
                summary.entries += 1;
                on_entry(meta);
            }
            Probe::Torn => {
                summary.tail = Some(pos);
                break;
            }
            Probe::Invalid => match resync(reader, pos + 1, salt)? {
                Some(next) => {
                    summary.corrupt.push((pos, next));
                    pos = next;
                }
                None => {
                    summary.tail = Some(pos);
                    break;
                }
            },
        }
    }
    Ok(summary)
}

/// Whether the payload of `meta` matches its CRC. Read errors other than a short file are
/// returned.
pub fn verify_payload(file: &File, meta: &EntryMeta, buf: &mut Vec<u8>) -> io::Result<bool> {
    let len = u64::from(meta.header.fields.payload_len);
    buf.resize(VERIFY_BUF.min(len as usize), 0);
    let mut crc = 0u32;
    let mut done = 0u64;
    while done < len {
        let n = (len - done).min(VERIFY_BUF as u64) as usize;
        match file.read_exact_at(&mut buf[..n], meta.payload_offset + done) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(false),
            Err(e) => return Err(e),
        }
        crc = edge_proto::crc32c_append(crc, &buf[..n]);
        done += n as u64;
    }
    Ok(crc == meta.header.fields.payload_crc)
}

/// Sorts entries into commits that succeeded and commits that failed, from the
/// `(commit, prev_commit)` pair every entry carries.
///
/// An entry of commit `c` with `prev_commit = p` proves that every commit `<= p` was durable
/// (confirmed) and every commit strictly between `p` and `c` failed (abandoned). Entries whose
/// commit is not confirmed yet are held; at the end only the newest commit can be left
/// unconfirmed: it may have been in flight when the process stopped.
#[derive(Debug)]
pub struct CommitResolver<T> {
    pending: BTreeMap<u64, Vec<T>>,
    confirmed_upto: u64,
    /// Failed commit ranges: `lo -> hi`, every commit with `lo < c < hi` failed.
    gaps: BTreeMap<u64, u64>,
    max_commit: u64,
    abandoned: u64,
}

impl<T> Default for CommitResolver<T> {
    fn default() -> Self {
        Self { pending: BTreeMap::new(), confirmed_upto: 0, gaps: BTreeMap::new(), max_commit: 0, abandoned: 0 }
    }
}

impl<T> CommitResolver<T> {
    /// Feeds one entry (in file order); `confirmed` receives every item whose commit is now
    /// known durable.
    pub fn push(&mut self, commit: u64, prev_commit: u64, item: T, confirmed: &mut impl FnMut(T)) {
        self.max_commit = self.max_commit.max(commit);
        if prev_commit < commit {
            if prev_commit > self.confirmed_upto {
                let newer = self.pending.split_off(&(prev_commit + 1));
                let now_confirmed = std::mem::replace(&mut self.pending, newer);
                now_confirmed.into_values().flatten().for_each(&mut *confirmed);
                self.confirmed_upto = prev_commit;
            }
            if commit - prev_commit > 1 {
                let failed: Vec<u64> = self.pending.range(prev_commit + 1..commit).map(|(&c, _)| c).collect();
                for c in failed {
                    self.abandoned += self.pending.remove(&c).map_or(0, |v| v.len() as u64);
                }
                let hi = self.gaps.entry(prev_commit).or_insert(commit);
                *hi = (*hi).max(commit);
            }
        }
        if self.in_gap(commit) {
            self.abandoned += 1;
        } else if commit <= self.confirmed_upto {
            confirmed(item);
        } else {
            self.pending.entry(commit).or_default().push(item);
        }
    }

    fn in_gap(&self, commit: u64) -> bool {
        self.gaps.range(..commit).any(|(_, &hi)| commit < hi)
    }

    /// Newest commit id seen (0 if none).
    pub fn max_commit(&self) -> u64 {
        self.max_commit
    }

    /// Entries dropped because their commit failed.
    pub fn abandoned(&self) -> u64 {
        self.abandoned
    }

    /// The items not confirmed by any later commit, in commit order (normally the newest commit
    /// only).
    pub fn into_unconfirmed(self) -> Vec<T> {
        self.pending.into_values().flatten().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(entries: &[(u64, u64)]) -> (Vec<u64>, Vec<u64>, u64) {
        let mut r = CommitResolver::default();
        let mut confirmed = Vec::new();
        for &(c, p) in entries {
            r.push(c, p, c, &mut |x| confirmed.push(x));
        }
        let abandoned = r.abandoned();
        (confirmed, r.into_unconfirmed(), abandoned)
    }

    #[test]
    fn a_chain_of_good_commits_confirms_all_but_the_newest() {
        let (confirmed, pending, abandoned) = run(&[(1, 0), (1, 0), (2, 1), (3, 2)]);
        assert_eq!(confirmed, vec![1, 1, 2]);
        assert_eq!(pending, vec![3]);
        assert_eq!(abandoned, 0);
    }

    #[test]
    fn commits_skipped_by_a_later_prev_pointer_are_abandoned() {
        // Commit 2 failed (its bytes stayed on disk), commit 3 was written with prev = 1.
        let (confirmed, pending, abandoned) = run(&[(1, 0), (2, 1), (2, 1), (3, 1), (4, 3)]);
        assert_eq!(confirmed, vec![1, 3]);
        assert_eq!(pending, vec![4]);
        assert_eq!(abandoned, 2);
    }

    #[test]
    fn a_failed_newest_commit_stays_unconfirmed() {
        let (confirmed, pending, _) = run(&[(1, 0), (2, 1)]);
        assert_eq!(confirmed, vec![1]);
        assert_eq!(pending, vec![2]);
    }

    #[test]
    fn entries_of_a_known_failed_commit_seen_late_are_abandoned() {
        let (confirmed, pending, abandoned) = run(&[(1, 0), (5, 1), (3, 1)]);
        assert_eq!(confirmed, vec![1]);
        assert_eq!(pending, vec![5]);
        assert_eq!(abandoned, 1);
    }
}
