//! Row checksums (schema version 3): a CRC-32C over the columns of each `streams`, `chunks` and
//! `batches` row, and one over the `meta` values, stored in the row (`row_crc`) or in `meta`.
//!
//! A batch's `crc32c` covers its data only, and SQLite checks the structure of its b-trees,
//! not the values in them. So before version 3 one flipped bit in a stream's `next_seq` could
//! make a later chunk reuse a sequence number the server already holds (the server would
//! answer `Duplicate`, and the chunk would be deleted unsent), and one in a chunk's `seq` or
//! in the spool id could do the same or store data twice. With these checksums every value the
//! agent relies on is verified where it is used: stream rows and `meta` when the spool opens,
//! chunk and batch rows whenever a chunk is read, and everything by `spool check`.
//!
//! Each checksum starts with the table's name, so a row cannot pass as another table's, and
//! covers the row's id, so a row cannot pass under another id. Not covered: a chunk's
//! `quarantine` text (set once the chunk is out of circulation; it is a message for people).

/// Builds one checksum from a table name and the row's values, in a fixed order.
struct RowCrc(u32);

impl RowCrc {
    fn new(table: &str) -> Self {
        Self(crate::crc::crc32c(table.as_bytes()))
    }

    fn int(mut self, v: i64) -> Self {
        self.0 = crate::crc::crc32c_append(self.0, &v.to_le_bytes());
        self
    }

    /// Length first, so `("ab", "c")` and `("a", "bc")` differ.
    fn bytes(self, b: &[u8]) -> Self {
        let mut s = self.int(i64::try_from(b.len()).unwrap_or(i64::MAX));
        s.0 = crate::crc::crc32c_append(s.0, b);
        s
    }

    fn finish(self) -> i64 {
        i64::from(self.0)
    }
}

/// `streams.row_crc`.
pub(crate) fn stream(id: i64, name: &str, next_seq: i64, sealed_through: i64) -> i64 {
    RowCrc::new("streams").int(id).bytes(name.as_bytes()).int(next_seq).int(sealed_through).finish()
}

/// The checksum inside the synced-segments mark's value (`unsynced.rs`): over the key and the
/// batch id, so a mark cannot pass under another key or with another id.
pub(crate) fn synced_mark(key: &str, mark: i64) -> u32 {
    RowCrc::new("meta").bytes(key.as_bytes()).int(mark).0
}

/// The checksum inside the host id's value (`host.rs`): over the key and the identity's bytes.
pub(crate) fn host_id(key: &str, host: &[u8]) -> u32 {
    RowCrc::new("meta").bytes(key.as_bytes()).bytes(host).0
}

/// The columns of a `chunks` row that `chunks.row_crc` covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ChunkRow {
    pub id: i64,
    pub stream_id: i64,
    pub seq: i64,
    pub records: i64,
    pub bytes: i64,
    pub first_ms: i64,
    pub sealed_ms: i64,
    pub first_batch: i64,
    pub last_batch: i64,
}

impl ChunkRow {
    /// The nine columns starting at `at`, in the field order above.
    pub(crate) fn from_row(r: &rusqlite::Row<'_>, at: usize) -> rusqlite::Result<ChunkRow> {
        Ok(ChunkRow {
            id: r.get(at)?,
            stream_id: r.get(at + 1)?,
            seq: r.get(at + 2)?,
            records: r.get(at + 3)?,
            bytes: r.get(at + 4)?,
            first_ms: r.get(at + 5)?,
            sealed_ms: r.get(at + 6)?,
            first_batch: r.get(at + 7)?,
            last_batch: r.get(at + 8)?,
        })
    }

    /// `chunks.row_crc`.
    pub(crate) fn crc(&self) -> i64 {
        RowCrc::new("chunks")
            .int(self.id)
            .int(self.stream_id)
            .int(self.seq)
            .int(self.records)
            .int(self.bytes)
            .int(self.first_ms)
            .int(self.sealed_ms)
            .int(self.first_batch)
            .int(self.last_batch)
            .finish()
    }
}

/// Where a batch's bytes are, from schema version 4: `len` bytes at `offset` of segment file
/// `segment` (see `segment.rs`). A row without one holds its bytes in `data`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegRef {
    pub segment: i64,
    pub offset: i64,
    pub len: i64,
}

impl SegRef {
    /// The three columns `segment`, `seg_offset`, `seg_len` as read: all NULL is `Ok(None)`
    /// (data in the row), all set is a reference, anything else is damage.
    pub(crate) fn from_columns(cols: (Option<i64>, Option<i64>, Option<i64>)) -> Result<Option<SegRef>, String> {
        match cols {
            (None, None, None) => Ok(None),
            (Some(segment), Some(offset), Some(len)) if segment > 0 && offset >= 0 && len >= 0 => {
                Ok(Some(SegRef { segment, offset, len }))
            }
            other => Err(format!("segment columns (segment, seg_offset, seg_len) = {other:?} are not a location")),
        }
    }
}

/// The columns of a `batches` row that `batches.row_crc` covers: every column but `data`,
/// which `crc32c` covers (and `crc32c` is covered here, so a flip there is told apart from
/// damaged data only by the check's wording).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchRow {
    pub id: i64,
    pub stream_id: i64,
    pub records: i64,
    pub crc32c: i64,
    pub commit_ms: i64,
    pub seg: Option<SegRef>,
}

impl BatchRow {
    /// `batches.row_crc`. A row with its data in the row is summed as in version 3, so rows
    /// written before version 4 keep their checksums.
    pub(crate) fn crc(&self) -> i64 {
        let c = RowCrc::new("batches")
            .int(self.id)
            .int(self.stream_id)
            .int(self.records)
            .int(self.crc32c)
            .int(self.commit_ms);
        match self.seg {
            None => c.finish(),
            Some(s) => c.int(s.segment).int(s.offset).int(s.len).finish(),
        }
    }

    /// Whether the stored `row_crc` matches. Batches up to `legacy_batches_through` were
    /// written before version 3 and may have none.
    pub(crate) fn ok(&self, stored: Option<i64>, legacy_batches_through: i64) -> bool {
        match stored {
            Some(crc) => crc == self.crc(),
            None => self.id <= legacy_batches_through && self.seg.is_none(),
        }
    }
}

/// The `meta` values a row checksum covers, kept in the row `row_crc`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(crate) struct MetaValues {
    pub spool_id: Vec<u8>,
    pub dropped_chunks: i64,
    pub dropped_records: i64,
    /// Batches with an id up to this one were written before version 3 and may have no
    /// `row_crc` (a migration does not rewrite batch rows, which hold nearly all the bytes).
    pub legacy_batches_through: i64,
}

impl MetaValues {
    pub(crate) fn crc(&self) -> i64 {
        RowCrc::new("meta")
            .bytes(&self.spool_id)
            .int(self.dropped_chunks)
            .int(self.dropped_records)
            .int(self.legacy_batches_through)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_covered_value_and_the_table_change_the_checksum() {
        let base = stream(3, "temperature", 17, 900);
        for other in [
            stream(4, "temperature", 17, 900),
            stream(3, "temperaturf", 17, 900),
            stream(3, "temperature", 16, 900),
            stream(3, "temperature", 17, 901),
        ] {
            assert_ne!(base, other);
        }
        let c = ChunkRow {
            id: 1,
            stream_id: 2,
            seq: 3,
            records: 4,
            bytes: 5,
            first_ms: 6,
            sealed_ms: 7,
            first_batch: 8,
            last_batch: 9,
        };
        let fields: [fn(&mut ChunkRow) -> &mut i64; 9] = [
            |c| &mut c.id,
            |c| &mut c.stream_id,
            |c| &mut c.seq,
            |c| &mut c.records,
            |c| &mut c.bytes,
            |c| &mut c.first_ms,
            |c| &mut c.sealed_ms,
            |c| &mut c.first_batch,
            |c| &mut c.last_batch,
        ];
        for f in fields {
            let mut flipped = c;
            *f(&mut flipped) ^= 1 << 40;
            assert_ne!(flipped.crc(), c.crc(), "{flipped:?}");
        }
        let b = BatchRow { id: 1, stream_id: 2, records: 3, crc32c: 4, commit_ms: 5, seg: None };
        assert_ne!(b.crc(), BatchRow { commit_ms: 4, ..b }.crc());
        // Version 3's formula for a row with its data inline.
        assert_eq!(b.crc(), RowCrc::new("batches").int(1).int(2).int(3).int(4).int(5).finish());
        let s = BatchRow { seg: Some(SegRef { segment: 1, offset: 0, len: 10 }), ..b };
        assert_ne!(s.crc(), b.crc());
        for other in [
            SegRef { segment: 2, offset: 0, len: 10 },
            SegRef { segment: 1, offset: 1, len: 10 },
            SegRef { segment: 1, offset: 0, len: 11 },
        ] {
            assert_ne!(BatchRow { seg: Some(other), ..b }.crc(), s.crc());
        }
        // A legacy row may lack a checksum; a segment row never may.
        assert!(b.ok(None, 1));
        assert!(!s.ok(None, 1));
        assert!(!b.ok(None, 0));
        // The same numbers in another table do not pass.
        assert_ne!(RowCrc::new("streams").int(1).finish(), RowCrc::new("batches").int(1).finish());
        let m = MetaValues { spool_id: vec![7; 16], ..MetaValues::default() };
        let mut n = m.clone();
        n.spool_id[15] ^= 0x80;
        assert_ne!(m.crc(), n.crc());
    }
}
