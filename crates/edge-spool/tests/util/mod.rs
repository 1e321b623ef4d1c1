//! Helpers shared by the spool's integration tests.

use std::fs;
use std::path::{Path, PathBuf};

use edge_spool::ChunkId;
use rusqlite::Connection;

/// XORs `mask` into byte `at` of the `nth` (from 0) batch row of `chunk`, in its payload segment
/// file, behind the spool's back. Returns that batch's id.
pub fn flip_in_batch(db: &Path, chunk: ChunkId, nth: u32, at: usize, mask: u8) -> i64 {
    let raw = Connection::open(db).expect("raw connection");
    let (batch, segment, offset): (i64, i64, u64) = raw
        .query_row(
            "SELECT b.id, b.segment, b.seg_offset FROM batches b JOIN chunks c
             ON b.stream_id = c.stream_id AND b.id BETWEEN c.first_batch AND c.last_batch
             WHERE c.id = ?1 ORDER BY b.id LIMIT 1 OFFSET ?2",
            (chunk.0, nth),
            |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
        )
        .expect("batch row");
    drop(raw);
    let seg_path = PathBuf::from(format!("{}-seg-{segment:010}", db.display()));
    let mut seg = fs::read(&seg_path).expect("segment file");
    seg[usize::try_from(offset).expect("offset") + at] ^= mask;
    fs::write(&seg_path, &seg).expect("flip");
    batch
}
