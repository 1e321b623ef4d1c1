//! [`export`]: reads every stored chunk back, in a stable order, without taking the lock.
//!
//! Read-only and lock-free, so it works while a server appends to the same directory. It scans
//! headers like recovery does, builds an in-memory map of where each chunk is, then reads the
//! payloads in output order and checks each CRC before decoding. It never writes, so a torn
//! tail is reported, not cut. While a server runs, the newest commit may still be in flight: its
//! chunks are exported if their bytes check out.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use edge_proto::Codec;
use edge_proto::records::{decode_payload, split_records};

use super::format::SEGMENTS_DIR;
use super::scan::{self, CommitResolver, EntryMeta, Reader, SegmentHead};
use super::{ChunkKey, StoreError};

/// Which chunks [`export`] returns; `None` matches everything.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportFilter {
    /// Only this device.
    pub device: Option<String>,
    /// Only this stream.
    pub stream: Option<String>,
    /// Only this spool id.
    pub spool: Option<[u8; 16]>,
    /// Only this sequence number.
    pub seq: Option<u64>,
}

impl ExportFilter {
    fn matches(&self, key: &ChunkKey) -> bool {
        self.device.as_deref().is_none_or(|d| d == key.device)
            && self.stream.as_deref().is_none_or(|s| s == key.stream)
            && self.spool.is_none_or(|s| s == key.spool)
            && self.seq.is_none_or(|s| s == key.seq)
    }
}

/// One stored chunk, handed to the [`export`] callback.
#[derive(Debug)]
pub struct ExportedChunk<'a> {
    /// Dedup key.
    pub key: &'a ChunkKey,
    /// The records, decoded and split.
    pub records: Vec<&'a [u8]>,
    /// Codec the payload was stored with.
    pub codec: Codec,
    /// Size of the decoded payload.
    pub raw_len: u32,
    /// When the agent created the chunk (agent clock, ms).
    pub created_ms: u64,
    /// When the server stored it (server clock, ms).
    pub stored_ms: u64,
    /// Segment number holding the entry.
    pub segment: u64,
    /// Offset of the entry in that segment.
    pub offset: u64,
}

/// What [`export`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExportReport {
    /// Segment files read.
    pub segments: u32,
    /// Chunks handed to the callback.
    pub chunks: u64,
    /// Records in them.
    pub records: u64,
    /// Stored (wire) payload bytes of them.
    pub bytes: u64,
    /// Entries skipped because their payload CRC failed or the payload did not decode.
    pub corrupt: u64,
    /// Of `corrupt`, those whose CRC was fine but whose payload did not decode or split.
    pub decode_errors: u64,
    /// Unparseable regions (including unreadable segment headers), skipped.
    pub corrupt_regions: u64,
    /// Bytes in those regions.
    pub corrupt_bytes: u64,
    /// Bytes at the end of the last segment that hold no complete entry (torn, or being
    /// written right now).
    pub tail_bytes: u64,
    /// Entries of failed commits, ignored.
    pub abandoned: u64,
    /// Further valid copies of a key already exported, skipped.
    pub duplicate_entries: u64,
}

/// Where an entry is and what its header says, minus the key.
#[derive(Debug, Clone)]
struct Loc {
    seg: usize,
    offset: u64,
    payload_offset: u64,
    payload_len: u32,
    payload_crc: u32,
    codec: Codec,
    raw_len: u32,
    records: u32,
    created_ms: u64,
    stored_ms: u64,
}

impl Loc {
    fn new(seg: usize, meta: &EntryMeta) -> Self {
        let f = &meta.header.fields;
        Loc {
            seg,
            offset: meta.offset,
            payload_offset: meta.payload_offset,
            payload_len: f.payload_len,
            payload_crc: f.payload_crc,
            codec: f.codec,
            raw_len: f.raw_len,
            records: f.records,
            created_ms: f.created_ms,
            stored_ms: f.stored_ms,
        }
    }
}

type Streams = BTreeMap<String, BTreeMap<u64, Vec<Loc>>>;

/// Chunks found so far, grouped for output order.
#[derive(Debug, Default)]
struct Catalog {
    devices: BTreeMap<String, HashMap<[u8; 16], Streams>>,
    /// Order in which each spool id first appeared in the segments.
    spool_order: HashMap<[u8; 16], usize>,
}

impl Catalog {
    fn add(&mut self, filter: &ExportFilter, seg: usize, meta: EntryMeta) {
        if !filter.matches(&meta.header.key) {
            return;
        }
        let loc = Loc::new(seg, &meta);
        let key = meta.header.key;
        let spools = match self.devices.get_mut(key.device.as_str()) {
            Some(s) => s,
            None => self.devices.entry(key.device).or_default(),
        };
        let streams = spools.entry(key.spool).or_default();
        let seqs = match streams.get_mut(key.stream.as_str()) {
            Some(s) => s,
            None => streams.entry(key.stream).or_default(),
        };
        seqs.entry(key.seq).or_default().push(loc);
    }
}

/// Reads every stored chunk of `data_dir` that passes `filter` and hands it to `f`.
///
/// Order: device (byte-wise lexicographic), then spool id in order of first appearance in the
/// segments, then stream (lexicographic), then seq ascending. Each stored key is returned once
/// (the first copy whose bytes check out). Entries whose payload CRC fails, or whose payload
/// does not decode into the announced records, are skipped, logged and counted in
/// [`ExportReport::corrupt`]. Entries of failed commits are never returned.
///
/// Needs no lock and never writes. Memory: one small location record per matching chunk.
/// An error from `f` stops the export with [`StoreError::Sink`].
pub fn export(
    data_dir: &Path,
    filter: &ExportFilter,
    mut f: impl FnMut(ExportedChunk<'_>) -> io::Result<()>,
) -> Result<ExportReport, StoreError> {
    let io_at = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StoreError::Io { path, source }
    };
    fs::metadata(data_dir).map_err(io_at(data_dir))?;
    let listing = scan::list_segments(&data_dir.join(SEGMENTS_DIR))?;
    let mut report = ExportReport { segments: u32::try_from(listing.len()).unwrap_or(u32::MAX), ..Default::default() };
    // Number and path of each listed segment, indexed like `listing`.
    let mut segments: Vec<(u64, PathBuf)> = Vec::with_capacity(listing.len());
    let mut catalog = Catalog::default();
    let mut resolver = CommitResolver::<(usize, EntryMeta)>::default();
    let last_idx = listing.len().checked_sub(1);

    for (idx, (number, path)) in listing.into_iter().enumerate() {
        let file = match File::open(&path) {
            Ok(file) => file,
            // Removed between listing and opening: a server dropping the segment of a failed
            // commit. Nothing durable was in it.
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                segments.push((number, path));
                continue;
            }
            Err(e) => return Err(io_at(&path)(e)),
        };
        let len = file.metadata().map_err(io_at(&path))?.len();
        let mut reader = Reader::new(&file, len);
        match scan::read_segment_head(&mut reader).map_err(io_at(&path))? {
            SegmentHead::Empty => {}
            SegmentHead::Invalid if Some(idx) == last_idx && len <= super::format::SEGMENT_HEADER_LEN => {
                report.tail_bytes += len;
            }
            SegmentHead::Invalid => {
                tracing::error!(path = %path.display(), len, "segment header unreadable; segment skipped");
                report.corrupt_regions += 1;
                report.corrupt_bytes += len;
            }
            SegmentHead::Valid(h) => {
                let summary = scan::scan_entries(&mut reader, h.salt, |meta| {
                    let order = catalog.spool_order.len();
                    catalog.spool_order.entry(meta.header.key.spool).or_insert(order);
                    let (c, p) = (meta.header.fields.commit, meta.header.fields.prev_commit);
                    resolver.push(c, p, (idx, meta), &mut |(seg, m)| catalog.add(filter, seg, m));
                })
                .map_err(io_at(&path))?;
                for &(start, end) in &summary.corrupt {
                    tracing::error!(path = %path.display(), start, end, "corrupt region skipped");
                }
                report.corrupt_regions += summary.corrupt.len() as u64;
                report.corrupt_bytes += summary.corrupt_bytes();
                if let Some(tail) = summary.tail {
                    let tail_len = reader.len().saturating_sub(tail);
                    if Some(idx) == last_idx {
                        report.tail_bytes += tail_len;
                    } else {
                        tracing::error!(path = %path.display(), start = tail, "unparseable tail in an older segment skipped");
                        report.corrupt_regions += 1;
                        report.corrupt_bytes += tail_len;
                    }
                }
            }
        }
        segments.push((number, path));
    }
    report.abandoned = resolver.abandoned();
    for (seg, meta) in resolver.into_unconfirmed() {
        catalog.add(filter, seg, meta);
    }

    let mut buf = Vec::new();
    // One segment open at a time: chunks of one stream are mostly in the same segment.
    let mut open: Option<(usize, File)> = None;
    let spool_order = catalog.spool_order;
    for (device, spools) in catalog.devices {
        let mut spools: Vec<_> = spools.into_iter().collect();
        spools.sort_by_key(|(spool, _)| spool_order.get(spool).copied().unwrap_or(usize::MAX));
        for (spool, streams) in spools {
            for (stream, seqs) in streams {
                let mut key = ChunkKey { device: device.clone(), spool, stream, seq: 0 };
                for (seq, locs) in seqs {
                    key.seq = seq;
                    let mut done = false;
                    for loc in locs {
                        if done {
                            report.duplicate_entries += 1;
                            continue;
                        }
                        let (number, path) = &segments[loc.seg];
                        if open.as_ref().is_none_or(|(idx, _)| *idx != loc.seg) {
                            open = match File::open(path) {
                                Ok(file) => Some((loc.seg, file)),
                                Err(e) if e.kind() == io::ErrorKind::NotFound => None,
                                Err(e) => return Err(io_at(path)(e)),
                            };
                        }
                        buf.resize(loc.payload_len as usize, 0);
                        let read = match &open {
                            Some((_, file)) => file.read_exact_at(&mut buf, loc.payload_offset),
                            None => Err(io::ErrorKind::NotFound.into()),
                        };
                        match read {
                            Ok(()) => {}
                            Err(e) if matches!(e.kind(), io::ErrorKind::UnexpectedEof | io::ErrorKind::NotFound) => {
                                tracing::warn!(path = %path.display(), offset = loc.offset, "entry vanished during export (segment truncated or removed)");
                                report.corrupt += 1;
                                continue;
                            }
                            Err(e) => return Err(io_at(path)(e)),
                        }
                        if edge_proto::crc32c(&buf) != loc.payload_crc {
                            tracing::error!(path = %path.display(), offset = loc.offset, device = %key.device, stream = %key.stream, seq, "payload checksum mismatch; chunk skipped");
                            report.corrupt += 1;
                            continue;
                        }
                        let decoded = decode_payload(loc.codec, &buf, loc.raw_len);
                        let records = match &decoded {
                            Ok(raw) => split_records(raw, loc.records),
                            Err(e) => Err(e.clone()),
                        };
                        let records = match records {
                            Ok(records) => records,
                            Err(e) => {
                                tracing::error!(path = %path.display(), offset = loc.offset, device = %key.device, stream = %key.stream, seq, error = %e, "payload does not decode; chunk skipped");
                                report.corrupt += 1;
                                report.decode_errors += 1;
                                continue;
                            }
                        };
                        report.chunks += 1;
                        report.records += records.len() as u64;
                        report.bytes += u64::from(loc.payload_len);
                        f(ExportedChunk {
                            key: &key,
                            records,
                            codec: loc.codec,
                            raw_len: loc.raw_len,
                            created_ms: loc.created_ms,
                            stored_ms: loc.stored_ms,
                            segment: *number,
                            offset: loc.offset,
                        })
                        .map_err(StoreError::Sink)?;
                        done = true;
                    }
                }
            }
        }
    }
    Ok(report)
}
