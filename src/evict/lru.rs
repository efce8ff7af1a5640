//! Exact LRU with lock-free recency updates (see [`super::PolicyKind::Lru`]).

use super::order::VictimOrder;
use super::{EvictionPolicy, InsertInfo, Ranking, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU64, Ordering};

/// Exact LRU: a global tick per insert or hit, victims by lowest tick. Selection pops the lowest
/// ticks from a [`VictimOrder`] (one heap per preference class; a hit only stores its tick, and a
/// stale entry is re-pushed when the selection reaches it): O(n log capacity). With chain-aware
/// ranking ([`Ranking::chain`]: a block ranks by the newest tick of its resident subtree) it
/// scans the slot array instead, O(capacity).
pub(crate) struct Lru {
    ticks: Box<[AtomicU64]>,
    clock: AtomicU64,
    residency: Residency,
    pub(super) order: VictimOrder,
}

impl Lru {
    /// An LRU for `capacity` slots.
    pub(crate) fn new(capacity: u32) -> Self {
        Lru {
            ticks: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
            clock: AtomicU64::new(1),
            residency: Residency::new(capacity),
            order: VictimOrder::new(capacity, 1),
        }
    }

    fn touch(&self, slot: SlotId) {
        let t = self.clock.fetch_add(1, Ordering::Relaxed);
        self.ticks[slot.index()].store(t, Ordering::Relaxed);
    }

    /// Slot `s`'s place in the victim order: one bucket, keyed by its last tick.
    fn place(&self, s: usize) -> (u8, i64) {
        (0, self.ticks[s].load(Ordering::Relaxed) as i64)
    }
}

impl Lru {
    /// The selection by a scan of every slot (what the victim order replaces): the reference the
    /// order's tests compare it with.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn select_by_scan(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        self.residency.propose_lowest_ranked(n, ranking, |s| self.ticks[s].load(Ordering::Relaxed), out);
    }
}

impl EvictionPolicy for Lru {
    fn name(&self) -> &'static str {
        "lru"
    }
    fn on_insert(&self, slot: SlotId, _info: InsertInfo) {
        self.touch(slot);
        self.residency.insert(slot);
        self.order.mark(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        self.touch(slot)
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        self.select_ranked(n, &Ranking::plain(&|s| evictable(s).then_some(0)), out);
    }
    fn select_ranked(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        if ranking.chain.is_some() {
            return self.residency.propose_lowest_ranked(n, ranking, |s| self.ticks[s].load(Ordering::Relaxed), out);
        }
        self.order.select(n, ranking, &self.residency, |s| self.place(s), |_| 0, out);
    }
    fn file_pending(&self, ranking: &Ranking<'_>) {
        // With chain-aware ranking the selection scans: the order is not used.
        if ranking.chain.is_none() {
            self.order.file_marks(ranking, &self.residency, |s| self.place(s));
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
        self.residency.remove(slot);
    }
}

impl std::fmt::Debug for Lru {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lru").field("residency", &self.residency).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn picks_the_oldest_evictable_in_order() {
        let p = Lru::new(4);
        for s in [2, 0, 3, 1] {
            p.on_insert(SlotId(s), InsertInfo::default());
        }
        p.on_hit(SlotId(2));
        let mut out = vec![];
        p.select_victims(2, &|s| s != SlotId(0), &mut out);
        assert_eq!(out, vec![SlotId(3), SlotId(1)]);
        p.on_cancel(SlotId(3));
        p.on_cancel(SlotId(1));
        out.clear();
        p.select_victims(10, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0), SlotId(3), SlotId(1), SlotId(2)]);
    }
}
