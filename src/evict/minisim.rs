//! Miniature simulations that tune [`super::PolicyKind::AdaptiveLfu`]'s frequency weight online
//! (the method of Waldspurger, Saemundsson, Ahmad and Park, *Cache Modeling and Optimization using
//! Miniature Simulations*, USENIX ATC'17: a spatially sampled reference stream replayed through
//! scaled-down caches, one per candidate parameter, picks the parameter for the real cache).
//!
//! A fixed fraction of the keys (chosen by key hash, so a sampled key is sampled at every
//! reference) is replayed through [`WEIGHTS`]`.len()` small caches of `SAMPLE_SLOTS` entries, each
//! ranking by the same score as the real policy (last reference + `weight x references`, the
//! reference count read from the real policy's history) with its own weight. Each tuning period
//! the real policy adopts the weight of the mini cache with the most hits over the recent periods
//! (each period's hits count 7/8 of the one after it); ties go to the smaller weight. Weight 0 is plain LRU, so where
//! frequency does not pay the policy falls back to recency.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

/// Keys are already well-mixed 64-bit hashes: the map uses them as they are.
#[derive(Default)]
struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ b as u64;
        }
    }
    fn write_u64(&mut self, x: u64) {
        self.0 = x;
    }
}

type KeyMap<V> = HashMap<u64, V, BuildHasherDefault<KeyHasher>>;

/// Candidate weights, in capacities of ticks per reference (a tick is one insert or hit).
pub(crate) const WEIGHTS: [u64; 8] = [0, 1, 2, 4, 8, 16, 32, 64];

/// Entries per mini cache (the whole cache when it is smaller).
pub(crate) const SAMPLE_SLOTS: u64 = 512;

/// One scaled-down cache: keys with their last reference, and a lazy min-heap of scores.
struct Mini {
    weight: i64,
    clock: i64,
    /// Key -> (version, depth of nothing: scores change only at references).
    entries: KeyMap<u32>,
    /// (score, key, version): entries whose version is stale are skipped.
    heap: BinaryHeap<Reverse<(i64, u64, u32)>>,
    /// Hits since the last tuning, and decayed over the recent tuning periods.
    hits: u64,
    score: f64,
}

impl Mini {
    fn reference(&mut self, key: u64, count: u8, capacity: usize) {
        self.clock += 1;
        let score = self.clock + self.weight * count as i64;
        if let Some(v) = self.entries.get_mut(&key) {
            *v = v.wrapping_add(1);
            self.hits += 1;
            self.heap.push(Reverse((score, key, *v)));
        } else {
            while self.entries.len() >= capacity {
                let Some(Reverse((_, k, v))) = self.heap.pop() else { break };
                if self.entries.get(&k) == Some(&v) {
                    self.entries.remove(&k);
                }
            }
            self.entries.insert(key, 0);
            self.heap.push(Reverse((score, key, 0)));
        }
        if self.heap.len() > 4 * capacity + 64 {
            // Drop stale heap entries.
            let live = &self.entries;
            let kept: Vec<_> = self.heap.drain().filter(|Reverse((_, k, v))| live.get(k) == Some(v)).collect();
            self.heap = kept.into();
        }
    }
}

/// The mini caches of one policy and the weight they chose.
pub(crate) struct Tuner {
    minis: Vec<Mini>,
    capacity: usize,
    /// A key is sampled when `hash >> 32` is below this.
    threshold: u64,
}

impl Tuner {
    /// Mini caches for a policy of `capacity` slots.
    pub(crate) fn new(capacity: u32) -> Self {
        let c = capacity.max(1) as u64;
        let m = c.min(SAMPLE_SLOTS);
        Tuner {
            minis: WEIGHTS
                .iter()
                .map(|&w| Mini {
                    weight: (w * m) as i64,
                    clock: 0,
                    entries: KeyMap::with_capacity_and_hasher(m as usize + 1, Default::default()),
                    heap: BinaryHeap::new(),
                    hits: 0,
                    score: 0.0,
                })
                .collect(),
            capacity: m as usize,
            threshold: ((m as u128) << 32).div_ceil(c as u128) as u64,
        }
    }

    /// True if references to the key with hash `h` are replayed.
    #[inline]
    pub(crate) fn sampled(threshold: u64, h: u64) -> bool {
        (h >> 32) < threshold
    }

    /// The sampling threshold (see [`Tuner::sampled`]).
    pub(crate) fn threshold(&self) -> u64 {
        self.threshold
    }

    /// Replays one reference of a sampled key whose history count is now `count`.
    pub(crate) fn reference(&mut self, h: u64, count: u8) {
        for m in &mut self.minis {
            m.reference(h, count, self.capacity);
        }
    }

    /// Ends a tuning period: returns the chosen weight (in capacities of ticks per reference).
    pub(crate) fn choose(&mut self) -> u64 {
        let mut best = (f64::MIN, 0);
        for (i, m) in self.minis.iter_mut().enumerate() {
            m.score = m.score * 0.875 + m.hits as f64;
            m.hits = 0;
            if m.score > best.0 {
                best = (m.score, i);
            }
        }
        WEIGHTS[best.1]
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A hot set referenced again and again between long scans of keys used once: only a weight
    /// above 0 keeps the hot set through a scan, and the tuner finds it.
    #[test]
    fn frequency_wins_over_scans() {
        let mut t = Tuner::new(64); // small: every key is sampled
        assert_eq!(t.threshold(), 1 << 32);
        let mut fresh = 1_000_000u64;
        for round in 0..40u8 {
            for k in 0..32u64 {
                t.reference(k, round.min(15));
            }
            for _ in 0..100 {
                t.reference(fresh, 1);
                fresh += 1;
            }
        }
        assert!(t.choose() > 0);
    }

    /// Keys that were popular once and are never used again, then a working set that fits: the old
    /// counts would keep the dead keys; recency alone (weight 0) is best, and ties go to it.
    #[test]
    fn recency_wins_when_old_popularity_is_dead() {
        let mut t = Tuner::new(64);
        for k in 0..60u64 {
            t.reference(k, 15);
        }
        for _ in 0..50 {
            for k in 0..40u64 {
                t.reference(1000 + k, 1);
            }
        }
        let hits: Vec<u64> = t.minis.iter().map(|m| m.hits).collect();
        assert!(hits[0] > hits[1] && hits[1] > hits[7], "{hits:?}");
        assert_eq!(t.choose(), 0);
    }
}
