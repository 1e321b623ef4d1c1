//! In-memory dedup index: which `(device, spool, stream, seq)` keys are stored.
//!
//! Per `(device, spool, stream)` the stored seqs are kept as a set of disjoint, non-adjacent
//! inclusive ranges. A stream whose seqs are gapless (the spool numbers them `1, 2, 3, ...`)
//! costs one range however long it gets; seqs that arrive out of order from parallel uploads
//! cost one range per gap until the gap fills, then the ranges merge again. The first range is
//! the "low watermark"; the ranges above it are the sparse part.
//!
//! The index is rebuilt from the segment headers at open and grows while the store runs, after
//! the fsync that made each key durable. An agent's floor ([`DedupIndex::raise_floor`], from its
//! `Floor` frame: no seq of the stream below it will come as new data any more) adds the seqs
//! below it, stored or not, and so closes the gaps the agent's dropped and quarantined chunks
//! left; floors are not written down, and after a restart the agent's next floor closes them
//! again. The ranges past each stream's first (its
//! gaps) are counted per device ([`DedupIndex::device_gaps`]), so that the store can refuse a
//! device whose keys would open more than a cap of them (`StoreOptions::max_index_gaps_per_device`)
//! before it writes them. The streams of each device, over all of its spools, are counted too
//! ([`DedupIndex::device_streams`]): each costs the index an entry whatever its seqs, so the
//! store refuses a device's chunk that would start one past a cap of them
//! (`StoreOptions::max_index_streams_per_device`).

use std::collections::{BTreeMap, HashMap};

use super::ChunkKey;

/// Stored seqs of one stream, as disjoint inclusive ranges `start -> end`.
#[derive(Debug, Clone, Default)]
pub struct SeqSet {
    ranges: BTreeMap<u64, u64>,
}

impl SeqSet {
    /// Whether `seq` is in the set.
    pub fn contains(&self, seq: u64) -> bool {
        self.ranges.range(..=seq).next_back().is_some_and(|(_, &end)| end >= seq)
    }

    /// Adds `seq`; `false` if it was already there.
    pub fn insert(&mut self, seq: u64) -> bool {
        if self.contains(seq) {
            return false;
        }
        // The range below ends before `seq` (else `contains` had been true), so `end + 1` cannot
        // overflow; it touches `seq` only when it ends right at `seq - 1`.
        let below =
            self.ranges.range(..seq).next_back().map(|(&start, &end)| (start, end)).filter(|&(_, end)| end + 1 == seq);
        let above = seq.checked_add(1).and_then(|next| self.ranges.get(&next).map(|&end| (next, end)));
        match (below, above) {
            (Some((start, _)), Some((next, end))) => {
                self.ranges.remove(&next);
                self.ranges.insert(start, end);
            }
            (Some((start, _)), None) => {
                self.ranges.insert(start, seq);
            }
            (None, Some((next, end))) => {
                self.ranges.remove(&next);
                self.ranges.insert(seq, end);
            }
            (None, None) => {
                self.ranges.insert(seq, seq);
            }
        }
        true
    }

    /// Adds every seq below `floor` if the set has a range that starts at or below it: the
    /// ranges that start there merge into one from 0. Returns whether the set changed. A set
    /// whose every range starts above `floor` is left alone, for a range below its first
    /// would only add one (the seqs below a stream's first range open no gap).
    pub fn raise_floor(&mut self, floor: u64) -> bool {
        let Some(last) = floor.checked_sub(1) else { return false };
        if self.ranges.get(&0).is_some_and(|&end| end >= last) {
            return false;
        }
        // A range that starts at `floor` itself is adjacent to `0..=last`.
        let touched: Vec<(u64, u64)> = self.ranges.range(..=floor).map(|(&s, &e)| (s, e)).collect();
        if touched.is_empty() {
            return false;
        }
        let end = touched.iter().fold(last, |end, &(_, e)| end.max(e));
        for (start, _) in touched {
            self.ranges.remove(&start);
        }
        self.ranges.insert(0, end);
        true
    }

    /// Number of ranges (1 for a gapless stream): the memory this set costs.
    pub fn range_count(&self) -> usize {
        self.ranges.len()
    }
}

/// The stored seqs of one device, over its spools and streams, and their gaps.
#[derive(Debug, Default)]
struct DeviceIndex {
    spools: HashMap<[u8; 16], HashMap<String, SeqSet>>,
    /// Ranges past the first of each stream.
    gaps: u64,
    /// `(spool, stream)` pairs.
    streams: u64,
}

/// The dedup index over all stored chunks.
#[derive(Debug, Default)]
pub struct DedupIndex {
    devices: HashMap<String, DeviceIndex>,
    chunks: u64,
    streams: u64,
    ranges: u64,
}

impl DedupIndex {
    /// Whether `key` is stored.
    pub fn contains(&self, key: &ChunkKey) -> bool {
        self.contains_parts(&key.device, &key.spool, &key.stream, key.seq)
    }

    /// [`DedupIndex::contains`] for a key given by its parts.
    pub fn contains_parts(&self, device: &str, spool: &[u8; 16], stream: &str, seq: u64) -> bool {
        self.seqs(device, spool, stream).is_some_and(|set| set.contains(seq))
    }

    /// Whether any seq of `(device, spool, stream)` is stored.
    pub fn has_stream(&self, device: &str, spool: &[u8; 16], stream: &str) -> bool {
        self.seqs(device, spool, stream).is_some()
    }

    fn seqs(&self, device: &str, spool: &[u8; 16], stream: &str) -> Option<&SeqSet> {
        self.devices.get(device).and_then(|d| d.spools.get(spool)).and_then(|streams| streams.get(stream))
    }

    /// Seq ranges of `device` past the first of each of its streams: the gaps in what it
    /// stored, over all of its spools.
    pub fn device_gaps(&self, device: &str) -> u64 {
        self.devices.get(device).map_or(0, |d| d.gaps)
    }

    /// Streams of `device`, over all of its spools.
    pub fn device_streams(&self, device: &str) -> u64 {
        self.devices.get(device).map_or(0, |d| d.streams)
    }

    /// Records `key` as stored; `false` if it already was.
    pub fn insert(&mut self, key: &ChunkKey) -> bool {
        let device = match self.devices.get_mut(key.device.as_str()) {
            Some(d) => d,
            None => self.devices.entry(key.device.clone()).or_default(),
        };
        let streams = device.spools.entry(key.spool).or_default();
        let set = match streams.get_mut(key.stream.as_str()) {
            Some(s) => s,
            None => {
                self.streams += 1;
                device.streams += 1;
                streams.entry(key.stream.clone()).or_default()
            }
        };
        let before = set.range_count() as u64;
        let added = set.insert(key.seq);
        if added {
            self.chunks += 1;
            // An insert adds a range, extends one, or merges two: the count moves by +1, 0 or -1.
            let after = set.range_count() as u64;
            self.ranges = self.ranges + after - before;
            // A new stream's first range is no gap: `before` is 0 and `after` 1 for it.
            device.gaps = device.gaps + after.saturating_sub(1) - before.saturating_sub(1);
        }
        added
    }

    /// Applies an agent's floor for one of its streams ([`SeqSet::raise_floor`]): every seq
    /// below `floor` counts as stored from now on. Returns `None` if that changed nothing,
    /// else the gaps it closed (0 when the floor only extends the stream's first range, so that
    /// the next key does not open a gap). A stream the index does not know is left alone: its
    /// first key opens no gap anyway.
    pub fn raise_floor(&mut self, device: &str, spool: &[u8; 16], stream: &str, floor: u64) -> Option<u64> {
        let d = self.devices.get_mut(device)?;
        let set = d.spools.get_mut(spool).and_then(|streams| streams.get_mut(stream))?;
        let before = set.range_count() as u64;
        if !set.raise_floor(floor) {
            return None;
        }
        // Ranges merge into the first one: the count falls or stays, and stays at least 1.
        let closed = before - set.range_count() as u64;
        self.ranges -= closed;
        d.gaps -= closed;
        Some(closed)
    }

    /// Number of keys stored.
    pub fn chunks(&self) -> u64 {
        self.chunks
    }

    /// Number of `(device, spool, stream)` triples.
    pub fn streams(&self) -> u64 {
        self.streams
    }

    /// Total number of seq ranges over all streams (memory indicator).
    pub fn ranges(&self) -> u64 {
        self.ranges
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn gapless_seqs_cost_one_range_whatever_the_start() {
        let mut s = SeqSet::default();
        for seq in 1..=10_000 {
            assert!(s.insert(seq));
        }
        assert_eq!(s.range_count(), 1);
        assert!(!s.insert(5_000));
        assert!(!s.contains(0));
        assert!(s.contains(10_000));
    }

    #[test]
    fn out_of_order_seqs_merge_once_the_gaps_fill() {
        let mut s = SeqSet::default();
        for seq in [5, 3, 1, 4] {
            assert!(s.insert(seq));
        }
        assert_eq!(s.range_count(), 2);
        assert!(s.insert(2));
        assert_eq!(s.range_count(), 1);
        assert!(s.insert(u64::MAX));
        assert!(s.insert(u64::MAX - 1));
        assert!(s.contains(u64::MAX));
        assert_eq!(s.range_count(), 2);
    }

    #[test]
    fn index_keys_differ_by_every_component() {
        let mut idx = DedupIndex::default();
        let k = ChunkKey { device: "d".into(), spool: [1; 16], stream: "s".into(), seq: 1 };
        assert!(idx.insert(&k));
        assert!(!idx.insert(&k));
        for other in [
            ChunkKey { device: "e".into(), ..k.clone() },
            ChunkKey { spool: [2; 16], ..k.clone() },
            ChunkKey { stream: "t".into(), ..k.clone() },
            ChunkKey { seq: 2, ..k.clone() },
        ] {
            assert!(!idx.contains(&other));
            assert!(idx.insert(&other));
        }
        assert_eq!(idx.chunks(), 5);
        assert_eq!(idx.streams(), 4);
        // d: stream s in spools 1 and 2, stream t in spool 1; e: one.
        assert_eq!((idx.device_streams("d"), idx.device_streams("e"), idx.device_streams("f")), (3, 1, 0));
        assert_eq!(idx.ranges(), 4, "seq 2 extended the first stream's range");
        let k3 = ChunkKey { seq: 3, ..k.clone() };
        let k5 = ChunkKey { seq: 5, ..k.clone() };
        idx.insert(&k5);
        assert_eq!(idx.ranges(), 5);
        idx.insert(&k3);
        idx.insert(&ChunkKey { seq: 4, ..k.clone() });
        assert_eq!(idx.ranges(), 4, "seqs 1..=5 merged back into one range");
        assert_eq!(idx.device_gaps("d"), 0, "every stream of d is one range");
        idx.insert(&ChunkKey { seq: 9, ..k });
        assert_eq!(idx.device_gaps("d"), 1, "seq 9 leaves a gap after 1..=5");
        assert_eq!(idx.device_gaps("e"), 0);
        assert_eq!(idx.device_gaps("nobody"), 0);
        assert!(idx.has_stream("d", &[1; 16], "s") && !idx.has_stream("d", &[1; 16], "u"));
    }

    #[test]
    fn a_floor_closes_the_gaps_below_it_and_counts_them() {
        let mut idx = DedupIndex::default();
        let key = |stream: &str, seq| ChunkKey { device: "d".into(), spool: [1; 16], stream: stream.into(), seq };
        // Stream s: 3, 5, 7, 9..=10 (three gaps); stream t: 20 (none).
        for seq in [3, 5, 7, 9, 10] {
            idx.insert(&key("s", seq));
        }
        idx.insert(&key("t", 20));
        assert_eq!((idx.device_gaps("d"), idx.ranges()), (3, 5));
        assert_eq!(idx.raise_floor("d", &[1; 16], "s", 6), Some(1), "3 and 5 merge below 6; 7 stays apart");
        assert!(idx.contains(&key("s", 0)) && idx.contains(&key("s", 4)) && !idx.contains(&key("s", 6)));
        assert_eq!((idx.device_gaps("d"), idx.ranges()), (2, 4));
        assert_eq!(idx.raise_floor("d", &[1; 16], "s", 9), Some(2), "a range starting at the floor joins it");
        assert_eq!((idx.device_gaps("d"), idx.ranges()), (0, 2));
        assert!(idx.contains(&key("s", 8)) && idx.contains(&key("s", 10)) && !idx.contains(&key("s", 11)));
        assert_eq!(idx.raise_floor("d", &[1; 16], "s", 5), None, "a lower floor changes nothing");
        assert_eq!(idx.raise_floor("d", &[1; 16], "s", 15), Some(0), "extends the one range: no gap closed");
        assert!(idx.contains(&key("s", 14)) && !idx.contains(&key("s", 15)));
        assert_eq!(idx.raise_floor("d", &[1; 16], "t", 10), None, "below a stream's first range: left alone");
        assert!(!idx.contains(&key("t", 0)));
        assert_eq!(idx.raise_floor("d", &[1; 16], "unknown", 10), None);
        assert_eq!(idx.raise_floor("d", &[2; 16], "s", 10), None, "another spool's stream");
        assert_eq!(idx.raise_floor("e", &[1; 16], "s", 10), None, "another device's");
        assert!(!idx.has_stream("d", &[1; 16], "unknown"), "a floor adds no stream");
        assert_eq!(idx.chunks(), 6, "a floor stores no key");
    }

    proptest! {
        #[test]
        fn seq_set_with_floors_agrees_with_a_btreeset(ops in proptest::collection::vec((any::<bool>(), 0u64..64), 0..200)) {
            let mut real = SeqSet::default();
            let mut model = BTreeSet::new();
            for (floor, n) in ops {
                if floor {
                    // Only a set with a seq at or below the floor takes it.
                    let takes = model.first().is_some_and(|&first| first <= n);
                    let before = model.len();
                    if takes {
                        model.extend(0..n);
                    }
                    prop_assert_eq!(real.raise_floor(n), model.len() != before);
                } else {
                    prop_assert_eq!(real.insert(n), model.insert(n));
                }
                for probe in 0..66 {
                    prop_assert_eq!(real.contains(probe), model.contains(&probe));
                }
                let runs = model.iter().zip(model.iter().skip(1)).filter(|&(a, b)| a + 1 != *b).count()
                    + usize::from(!model.is_empty());
                prop_assert_eq!(real.range_count(), runs);
            }
        }

        #[test]
        fn seq_set_agrees_with_a_btreeset(seqs in proptest::collection::vec(0u64..64, 0..200)) {
            let mut real = SeqSet::default();
            let mut model = BTreeSet::new();
            for seq in seqs {
                prop_assert_eq!(real.insert(seq), model.insert(seq));
                for probe in 0..66 {
                    prop_assert_eq!(real.contains(probe), model.contains(&probe));
                }
            }
            let runs = model.iter().zip(model.iter().skip(1)).filter(|&(a, b)| a + 1 != *b).count()
                + usize::from(!model.is_empty());
            prop_assert_eq!(real.range_count(), runs);
        }
    }
}
