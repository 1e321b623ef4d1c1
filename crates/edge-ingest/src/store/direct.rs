//! Segment writes past the page cache: a commit's whole blocks go to the disk with `O_DIRECT`
//! from one reused, aligned buffer; only its partial last block goes through the page cache.
//!
//! Written through the page cache, every byte is copied into it and the kernel then writes
//! those pages back at the commit's `fdatasync`, page by page (buffer heads, writeback tags,
//! one bio per run of pages), and the store drops them again. Written direct, the bytes are
//! copied once into [`DirectBuf`] and the disk reads them from there. On the machine of our
//! benchmarks, 1 MiB commits cost a third less CPU per GiB written direct
//! (`crates/edge-bench/scripts/direct_writes.c`), and the ingest spent a third less CPU per GiB
//! received through the agent's record stream (`BENCHMARKS.md`, "Done and tried since the
//! `a54f6d1` run", 28).
//!
//! A direct write must start and end on a block boundary, while entries follow each other
//! byte by byte. So a commit is written as:
//! - its first block begins with what the previous commit left in that block: those bytes,
//!   already durable, are written again unchanged (the buffer keeps them from the previous
//!   commit; after open or a failure they are read back from the file);
//! - every whole block direct, in pieces of at most the buffer's size;
//! - the partial last block, if any, with an ordinary `pwrite` through the page cache, which
//!   leaves the file's length exactly at the end of the commit, as the on-disk format wants:
//!   no padding is ever written. A later direct write over that page makes the kernel drop it
//!   from the cache first.
//!
//! The `fdatasync` that follows covers both kinds of write. A file system that refuses
//! `O_DIRECT` at open, or a write whose alignment it refuses (`EINVAL`, a block larger than
//! 4 KiB), makes the store write through the page cache from then on.

use std::fs::File;
use std::io::{self, IoSlice};
use std::os::unix::fs::FileExt;
use std::path::Path;

/// The alignment of direct writes, in the file and in memory: a multiple of every logical
/// block size up to 4 KiB.
pub(super) const BLOCK: usize = 4096;

/// Default size of the aligned buffer: a commit larger than this is written in pieces.
pub(super) const CAPACITY: usize = 1 << 20;

/// Opens `path` for writing with `O_DIRECT`, or `None` where the file system refuses it (the
/// reason is logged at debug level).
pub(super) fn open(path: &Path) -> Option<File> {
    use rustix::fs::{Mode, OFlags};
    match rustix::fs::open(path, OFlags::WRONLY | OFlags::DIRECT | OFlags::CLOEXEC, Mode::empty()) {
        Ok(fd) => Some(File::from(fd)),
        Err(e) => {
            tracing::debug!(path = %path.display(), error = %e, "segment cannot be opened with O_DIRECT; writing through the page cache");
            None
        }
    }
}

/// The reused, aligned buffer of the direct writes, with the bytes of the active segment's
/// partial last block at its start.
#[derive(Debug)]
pub(super) struct DirectBuf {
    mem: Vec<u8>,
    /// Offset in `mem` of its first byte aligned to [`BLOCK`].
    start: usize,
    /// Usable bytes from `start`: a multiple of [`BLOCK`].
    capacity: usize,
    /// `(segment, offset, n)`: the first `n` bytes of the buffer are those of that segment's
    /// block at `offset`, as written by the last commit. `None` after a failure.
    carry: Option<(u64, u64, usize)>,
}

/// What [`DirectBuf::write`] wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Written {
    /// Bytes written with `O_DIRECT`, the rewritten start of the first block included.
    pub direct: u64,
    /// Bytes of the partial last block written through the page cache.
    pub buffered: u64,
}

impl DirectBuf {
    /// A buffer of `capacity` bytes (rounded up to a whole block).
    pub(super) fn new(capacity: usize) -> Self {
        let capacity = capacity.max(BLOCK).div_ceil(BLOCK) * BLOCK;
        let mem = vec![0u8; capacity + BLOCK];
        let start = mem.as_ptr().align_offset(BLOCK);
        DirectBuf { mem, start, capacity, carry: None }
    }

    /// Writes `slices` at `at` in segment `segment`, whose bytes before `at` are all written:
    /// whole blocks through `direct`, the partial last block through `buffered`.
    ///
    /// On error some of the bytes may be written; the caller truncates them away and must not
    /// rely on this buffer's copy of the last block any more (it is forgotten here).
    pub(super) fn write(
        &mut self,
        direct: &File,
        buffered: &File,
        segment: u64,
        at: u64,
        slices: &[IoSlice<'_>],
    ) -> io::Result<Written> {
        let carry = self.carry.take();
        let block_start = at - at % BLOCK as u64;
        let mut fill = (at - block_start) as usize;
        let (start, capacity) = (self.start, self.capacity);
        let buf = &mut self.mem[start..start + capacity];
        if fill > 0 && carry != Some((segment, block_start, fill)) {
            buffered.read_exact_at(&mut buf[..fill], block_start)?;
        }
        let mut written = Written::default();
        let mut pos = block_start;
        for slice in slices {
            let mut rest: &[u8] = slice;
            while !rest.is_empty() {
                let n = rest.len().min(capacity - fill);
                buf[fill..fill + n].copy_from_slice(&rest[..n]);
                fill += n;
                rest = &rest[n..];
                if fill == capacity {
                    write_all_direct(direct, &buf[..capacity], pos)?;
                    pos += capacity as u64;
                    written.direct += capacity as u64;
                    fill = 0;
                }
            }
        }
        let whole = fill - fill % BLOCK;
        if whole > 0 {
            write_all_direct(direct, &buf[..whole], pos)?;
            pos += whole as u64;
            written.direct += whole as u64;
        }
        let tail = fill - whole;
        if tail > 0 {
            buffered.write_all_at(&buf[whole..fill], pos)?;
            buf.copy_within(whole..fill, 0);
            written.buffered = tail as u64;
        }
        self.carry = Some((segment, pos, tail));
        Ok(written)
    }
}

/// `pwrite`s all of `bytes` at `at` through an `O_DIRECT` descriptor. A short write (a full
/// disk) is continued; should its count not be block-aligned, the next write fails with
/// `EINVAL` and the commit with it.
fn write_all_direct(file: &File, mut bytes: &[u8], mut at: u64) -> io::Result<()> {
    while !bytes.is_empty() {
        match file.write_at(bytes, at) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "segment write wrote nothing")),
            Ok(n) => {
                bytes = &bytes[n..];
                at += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Whether `e` is the refusal of a direct write's alignment (or of direct writes at all).
pub(super) fn is_refusal(e: &io::Error) -> bool {
    e.raw_os_error() == Some(rustix::io::Errno::INVAL.raw_os_error())
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;

    use super::*;

    fn files(path: &Path) -> Option<(File, File)> {
        let buffered =
            OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).expect("create");
        open(path).map(|direct| (direct, buffered))
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn commits_of_every_shape_land_byte_for_byte_and_the_file_ends_where_they_do() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("seg");
        let Some((direct, buffered)) = files(&path) else {
            eprintln!("skipped: the file system of {} refuses O_DIRECT", dir.path().display());
            return;
        };
        // A buffer of two blocks, so commits also cross it.
        let mut buf = DirectBuf::new(2 * BLOCK);
        let mut expected = Vec::new();
        // Lengths: inside one block, ending on a boundary, crossing several, larger than the
        // buffer, one byte.
        for (i, len) in [100, 3996, 4096, 5000, 3 * BLOCK + 17, 9 * BLOCK, 1, 8191].into_iter().enumerate() {
            let a = pattern(len / 2, i as u8);
            let b = pattern(len - len / 2, 100 + i as u8);
            let at = expected.len() as u64;
            let w = buf.write(&direct, &buffered, 1, at, &[IoSlice::new(&a), IoSlice::new(&b)]).expect("write");
            expected.extend_from_slice(&a);
            expected.extend_from_slice(&b);
            let end = expected.len() as u64;
            assert_eq!(w.buffered, end % BLOCK as u64, "only the partial last block is buffered (commit {i})");
            assert_eq!(w.direct + w.buffered, end - (at - at % BLOCK as u64), "commit {i}");
            assert_eq!(buffered.metadata().expect("stat").len(), end, "the file ends at the commit's end");
            assert_eq!(std::fs::read(&path).expect("read"), expected, "commit {i}");
        }
    }

    #[test]
    fn the_first_block_is_read_back_when_the_buffer_does_not_hold_it() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("seg");
        let Some((direct, buffered)) = files(&path) else {
            eprintln!("skipped: the file system of {} refuses O_DIRECT", dir.path().display());
            return;
        };
        let head = pattern(1234, 7);
        buffered.write_all_at(&head, 0).expect("head");
        // A fresh buffer (as after open), then a buffer that held another segment's block.
        let mut buf = DirectBuf::new(CAPACITY);
        let body = pattern(3 * BLOCK, 9);
        buf.write(&direct, &buffered, 1, head.len() as u64, &[IoSlice::new(&body)]).expect("write");
        let more = pattern(2 * BLOCK + 5, 11);
        let at = (head.len() + body.len()) as u64;
        buf.carry = Some((2, at - at % BLOCK as u64, (at % BLOCK as u64) as usize));
        buf.mem[buf.start..buf.start + BLOCK].fill(0xEE);
        buf.write(&direct, &buffered, 1, at, &[IoSlice::new(&more)]).expect("write");
        let expected: Vec<u8> = [head, body, more].concat();
        assert_eq!(std::fs::read(&path).expect("read"), expected);
    }

    #[test]
    fn the_buffer_is_aligned_and_whole_blocks() {
        let buf = DirectBuf::new(5000);
        assert_eq!(buf.capacity, 2 * BLOCK);
        assert_eq!(buf.mem[buf.start..].as_ptr() as usize % BLOCK, 0);
        assert!(buf.start + buf.capacity <= buf.mem.len());
    }
}
