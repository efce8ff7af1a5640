//! 2Q with probationary admission (see [`super::PolicyKind::TwoQ`]).

use super::order::VictimOrder;
use super::{EvictionPolicy, InsertInfo, Ranking, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU64, AtomicU8, AtomicUsize, Ordering};

/// Queue of a slot: no block (absent), the probationary FIFO, the main LRU.
const ABSENT: u8 = 0;
const PROBATION: u8 = 1;
const MAIN: u8 = 2;

/// An offset above every tick (ticks stay below 2^62 for centuries of references), so one bucket
/// of the victim order goes wholly after the other.
const LAST: i64 = 1 << 62;

/// 2Q (Johnson and Shasha, VLDB'94) as a probationary admission queue: a new block enters a FIFO
/// of probation; its second use promotes it to the main LRU; a block evicted from probation leaves
/// its key hash in a ghost table, and a block whose key the ghost remembers enters main directly.
/// Victims come from probation while it holds more than its target (10% of the pool, at least 1
/// slot), else from main (each falls back on the other, so every resident block stays reachable).
///
/// Both queues are buckets of one [`VictimOrder`] keyed by a tick: the insert tick in probation
/// (FIFO order: a hit there promotes instead of refreshing), the last touch in main (LRU order). A
/// selection costs O(n log capacity); inserts, hits and removals are lock-free (the queue of a
/// slot is one atomic, the ghost a direct-mapped array of atomics).
pub(crate) struct TwoQ {
    ticks: Box<[AtomicU64]>,
    queue: Box<[AtomicU8]>,
    key_hash: Box<[AtomicU64]>,
    ghost: Box<[AtomicU64]>,
    clock: AtomicU64,
    /// Blocks in probation now (exact: each move out of `PROBATION` is one CAS or swap).
    probation: AtomicUsize,
    probation_target: usize,
    residency: Residency,
    order: VictimOrder,
}

impl TwoQ {
    /// A 2Q for `capacity` slots: probation target 10% of them (at least 1); a ghost of
    /// `capacity` rounded up to a power of two entries (2Q's A1out holds about half the pool's
    /// worth of keys; a direct-mapped table needs room for collisions).
    pub(crate) fn new(capacity: u32) -> Self {
        let ghost = (capacity.max(1) as usize).next_power_of_two();
        TwoQ {
            ticks: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            queue: crate::sync::table(capacity as usize, |_| AtomicU8::new(ABSENT)),
            key_hash: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            ghost: crate::sync::table(ghost, |_| AtomicU64::new(0)),
            clock: AtomicU64::new(1),
            probation: AtomicUsize::new(0),
            probation_target: (capacity as usize / 10).max(1),
            residency: Residency::new(capacity),
            order: VictimOrder::new(capacity, 2),
        }
    }

    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::Relaxed)
    }

    /// The ghost's entry for a key hash and the tag stored there (0 means empty).
    fn ghost_entry(&self, key_hash: u64) -> (&AtomicU64, u64) {
        let tag = key_hash.max(1);
        (&self.ghost[(tag as usize) & (self.ghost.len() - 1)], tag)
    }

    /// Blocks in probation now (for tests).
    #[cfg(all(test, not(loom)))]
    fn in_probation(&self) -> usize {
        self.probation.load(Ordering::Relaxed)
    }
}

impl EvictionPolicy for TwoQ {
    fn name(&self) -> &'static str {
        "2q"
    }
    fn prefetch(&self, slot: SlotId, key_hash: u64) {
        let i = slot.index();
        crate::sync::prefetch_read(self.ghost_entry(key_hash).0);
        crate::sync::prefetch_read(&self.key_hash[i]);
        crate::sync::prefetch_read(&self.ticks[i]);
        crate::sync::prefetch_read(&self.queue[i]);
        self.residency.prefetch(slot);
    }
    fn on_insert(&self, slot: SlotId, info: InsertInfo) {
        let i = slot.index();
        self.key_hash[i].store(info.key_hash, Ordering::Relaxed);
        let (g, tag) = self.ghost_entry(info.key_hash);
        // A key evicted from probation and seen again is a second use: it enters main.
        let remembered = g.compare_exchange(tag, 0, Ordering::Relaxed, Ordering::Relaxed).is_ok();
        let q = if remembered { MAIN } else { PROBATION };
        if q == PROBATION {
            self.probation.fetch_add(1, Ordering::Relaxed);
        }
        self.ticks[i].store(self.tick(), Ordering::Relaxed);
        self.queue[i].store(q, Ordering::Release);
        self.residency.insert(slot);
        self.order.mark(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        let i = slot.index();
        // The second use promotes. A hit on a slot with no block fails the CAS and changes
        // nothing. (Seeded bug, tests only: `two-q-no-promotion` keeps hit blocks in probation.)
        let promoted = !crate::seeded::seeded("two-q-no-promotion")
            && self.queue[i].compare_exchange(PROBATION, MAIN, Ordering::AcqRel, Ordering::Relaxed).is_ok();
        if promoted {
            self.probation.fetch_sub(1, Ordering::Relaxed);
        }
        if self.queue[i].load(Ordering::Relaxed) == MAIN {
            self.ticks[i].store(self.tick(), Ordering::Relaxed);
        }
        // A promotion changes the slot's bucket. The victim order's lazy entries may only be
        // stale towards later places within a bucket; the old probation entry, ranked after all
        // of main in a main-first pass, would hold the block back in insert order. The mark gives
        // it an entry in main at its new tick (after the store above, so the entry is current).
        // (Seeded bug, tests only: `two-q-promotion-unmarked` leaves the order to find out.)
        if promoted && !crate::seeded::seeded("two-q-promotion-unmarked") {
            self.order.mark(slot);
        }
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        self.select_ranked(n, &Ranking::plain(&|s| evictable(s).then_some(0)), out);
    }
    /// Probation first for as many victims as it holds above its target, then main first; in each
    /// call the other queue is the fallback, so liveness is the victim order's. Chains
    /// ([`Ranking::chain`]) are not used: 2Q ranks by its queues alone.
    fn select_ranked(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        let place = |s: usize| {
            let bucket = u8::from(self.queue[s].load(Ordering::Acquire) == MAIN);
            (bucket, self.ticks[s].load(Ordering::Relaxed) as i64)
        };
        let start = out.len();
        let excess = self.probation.load(Ordering::Relaxed).saturating_sub(self.probation_target);
        let first = n.min(excess);
        if first > 0 {
            self.order.select(first, ranking, &self.residency, place, |b| if b == 0 { 0 } else { LAST }, out);
        }
        let rest = n - (out.len() - start);
        if rest > 0 {
            self.order.select(rest, ranking, &self.residency, place, |b| if b == 0 { LAST } else { 0 }, out);
        }
    }
    fn on_cancel(&self, slot: SlotId) {
        self.residency.cancel(slot);
        self.order.mark(slot);
    }
    fn on_reclass(&self, slot: SlotId) {
        self.order.mark(slot);
    }
    fn on_remove(&self, slot: SlotId) {
        let i = slot.index();
        if self.queue[i].swap(ABSENT, Ordering::AcqRel) == PROBATION {
            self.probation.fetch_sub(1, Ordering::Relaxed);
            // Evicted on probation: remember the key, so its next save is its second use.
            let (g, tag) = self.ghost_entry(self.key_hash[i].load(Ordering::Relaxed));
            g.store(tag, Ordering::Relaxed);
        }
        self.residency.remove(slot);
    }
}

impl std::fmt::Debug for TwoQ {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TwoQ")
            .field("probation", &self.probation.load(Ordering::Relaxed))
            .field("probation_target", &self.probation_target)
            .field("residency", &self.residency)
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn insert(p: &TwoQ, s: u32, key: u64) {
        p.on_insert(SlotId(s), InsertInfo::new(key, None));
    }

    fn evict_one(p: &TwoQ) -> SlotId {
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out.len(), 1, "a full pool has a victim");
        p.on_remove(out[0]);
        out[0]
    }

    #[test]
    fn a_block_used_twice_outlives_a_flood_of_blocks_used_once() {
        // 20 slots: probation target 2. Blocks 0..4 are used twice (promoted to main); then a
        // stream of blocks used once passes through the other slots.
        let p = TwoQ::new(20);
        for s in 0..20 {
            insert(&p, s, 1000 + s as u64);
        }
        for s in 0..4 {
            p.on_hit(SlotId(s));
        }
        assert_eq!(p.in_probation(), 16, "the blocks used twice were promoted");
        for k in 0..200u64 {
            let v = evict_one(&p);
            assert!(v.0 >= 4, "flood block {k} evicted block {} that was used twice", v.0);
            insert(&p, v.0, 5000 + k);
        }
        // Probation is drawn down to its target, and its oldest goes first (FIFO).
        assert_eq!(p.in_probation(), 16, "every flood block enters probation");
    }

    #[test]
    fn probation_is_a_fifo_and_main_an_lru() {
        let p = TwoQ::new(10); // target 1
        for s in 0..4 {
            insert(&p, s, 100 + s as u64);
        }
        // A hit on 0 promotes it; 1 stays in probation (a hit there is its second use too, so
        // only slot 0 is hit). Probation holds 1, 2, 3: above its target, so it goes first, oldest
        // first.
        p.on_hit(SlotId(0));
        let mut out = vec![];
        p.select_victims(2, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(1), SlotId(2)]);
        for &s in &out {
            p.on_remove(s);
        }
        // Probation at its target (slot 3): main goes first now, then probation.
        insert(&p, 1, 200);
        p.on_hit(SlotId(1)); // main: 0 (older), 1 (newer)
        out.clear();
        p.select_victims(3, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0), SlotId(1), SlotId(3)]);
    }

    #[test]
    fn main_evicts_promoted_blocks_in_lru_order_not_insert_order() {
        // Promotion moves a block between buckets of the victim order; the order must be told,
        // or the block's stale probation entry (insert order) ranks it in main.
        let p = TwoQ::new(10); // target 1
        for s in 0..10 {
            insert(&p, s, 300 + s as u64);
        }
        assert_eq!(evict_one(&p), SlotId(0), "probation above its target: its oldest goes");
        for s in 1..9 {
            p.on_hit(SlotId(s)); // promoted: main holds 1..8, probation 9 (at its target)
        }
        p.on_hit(SlotId(1)); // 1 is main's most recent now
        let mut out = vec![];
        p.select_victims(2, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(2), SlotId(3)], "main's least recently used go first");
    }

    #[test]
    fn a_key_evicted_from_probation_comes_back_into_main() {
        let p = TwoQ::new(10);
        insert(&p, 0, 42);
        assert_eq!(p.in_probation(), 1);
        let v = evict_one(&p);
        assert_eq!(v, SlotId(0));
        assert_eq!(p.in_probation(), 0);
        insert(&p, 3, 42);
        assert_eq!(p.in_probation(), 0, "the ghost remembered key 42: its block enters main");
        insert(&p, 4, 43);
        assert_eq!(p.in_probation(), 1);
    }

    #[test]
    fn hits_on_empty_or_evicted_slots_leave_the_counts_exact() {
        let p = TwoQ::new(8);
        p.on_hit(SlotId(5));
        insert(&p, 5, 1);
        assert_eq!(evict_one(&p), SlotId(5));
        p.on_hit(SlotId(5));
        assert_eq!(p.in_probation(), 0);
        let mut out = vec![];
        p.select_victims(4, &|_| true, &mut out);
        assert!(out.is_empty());
    }
}
