//! Exact LRU with lock-free recency updates (see [`super::PolicyKind::Lru`]).

use super::order::VictimOrder;
use super::{ChainView, EvictionPolicy, InsertInfo, Ranking, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU64, Ordering};
use std::cell::RefCell;
use std::collections::HashMap;

/// True if `chain` counts resident children (slot 0 asked: a view counts for every slot or none).
fn counts_children(chain: &dyn ChainView) -> bool {
    chain.resident_children(SlotId(0)).is_some()
}

/// Exact LRU: a global tick per insert or hit, victims by lowest tick. Selection pops the lowest
/// ticks from a [`VictimOrder`] (one heap per preference class and bucket; a hit only stores its
/// tick, and a stale entry is re-pushed when the selection reaches it): O(n log capacity).
///
/// With chain-aware ranking ([`Ranking::chain`]: a block ranks by the newest tick of its resident
/// subtree, deeper first on ties) the order keeps **leaves** (blocks no resident block continues,
/// bucket 0) apart from **interior** blocks (bucket 1, after every leaf of their class), each by
/// its own tick, and a proposal exposes its parent: once a block's last resident child is
/// proposed, the parent is a leaf of this selection, filed by its own tick; a child that leaves
/// later (its eviction finished after another selection filed the parent, an aborted or
/// quarantined save) re-files its parent ([`EvictionPolicy::on_child_removed`]). Ticks grow along
/// a prompt (a query touches its prefix in order, a save commits after it), so the lowest leaf is
/// the chain with the oldest newest tick, and its parent, exposed, is lower than everything else
/// left when it was last touched with that chain: the chain goes whole, from its tail, as the
/// subtree rank orders it (a parent hit since on its own, a prefix other prompts share, is filed
/// by that newer tick, as the subtree rank ranks it), in O(n log capacity) (the unit test
/// `chain_aware_lru_selects_as_its_leaf_scan` and, through the tier against the subtree-rank
/// model, `chain_aware_lru_through_the_tier_equals_its_model` in the CLI's tests). Where the two
/// differ: a block with a resident child that cannot be taken now (pinned, being written) or that
/// is in a later class waits behind every leaf of its own class instead of ranking by that
/// child's tick; and a block whose children are taken first, in an earlier class, then ranks by
/// its own tick, not by the blocks past them. A [`super::ChainView`] that does not count children
/// ([`super::ChainView::resident_children`] `None`) gets the subtree rank by a scan of every slot,
/// O(capacity).
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
            ticks: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            clock: AtomicU64::new(1),
            residency: Residency::new(capacity),
            order: VictimOrder::new(capacity, INTERIOR as usize + 1),
        }
    }

    fn touch(&self, slot: SlotId) {
        let t = self.clock.fetch_add(1, Ordering::Relaxed);
        self.ticks[slot.index()].store(t, Ordering::Relaxed);
    }

    /// Slot `s`'s place in the victim order without chains: bucket 0, keyed by its last tick.
    fn place(&self, s: usize) -> (u8, i64) {
        (0, self.ticks[s].load(Ordering::Relaxed) as i64)
    }

    /// Slot `s`'s place with chains: bucket [`INTERIOR`] while more resident blocks continue it
    /// than `proposed` (the running selection's proposals among them), else 0 (a leaf); keyed by
    /// its last tick.
    fn chain_place(&self, chain: &dyn ChainView, s: usize, proposed: u32) -> (u8, i64) {
        let children = chain.resident_children(SlotId(s as u32)).unwrap_or(0);
        // (Seeded bug, tests only: `interior-as-leaf` files every block as a leaf: plain LRU.)
        let bucket = if children > proposed && !crate::seeded::seeded("interior-as-leaf") { INTERIOR } else { 0 };
        (bucket, self.ticks[s].load(Ordering::Relaxed) as i64)
    }

    /// The chain-aware selection from the victim order (see [`Lru`]).
    fn select_chained(&self, n: usize, ranking: &Ranking<'_>, chain: &dyn ChainView, out: &mut Vec<SlotId>) {
        // Per parent, its children proposed by this selection (few: one per chain it reaches).
        let proposed: RefCell<HashMap<u32, u32>> = RefCell::default();
        let place = |s: usize| self.chain_place(chain, s, proposed.borrow().get(&(s as u32)).copied().unwrap_or(0));
        let exposed = |s: SlotId| {
            let p = chain.parent(s)?;
            *proposed.borrow_mut().entry(p.0).or_insert(0) += 1;
            Some(p)
        };
        // Seeded bug (tests only): `interior-withheld` never offers an interior block, so a save is
        // refused while an unpinned block that a resident one continues could be evicted.
        if crate::seeded::seeded("interior-withheld") {
            let class_of = |s: SlotId| (ranking.class_of)(s).filter(|_| place(s.index()).0 != INTERIOR);
            let withheld = Ranking { class_of: &class_of, ..*ranking };
            return self.order.select_exposing(n, &withheld, &self.residency, place, interior_offset, exposed, out);
        }
        self.order.select_exposing(n, ranking, &self.residency, place, interior_offset, exposed, out);
    }
}

/// The bucket of interior blocks (a resident block continues them) under chain-aware ranking.
const INTERIOR: u8 = 1;

/// Interior blocks come after every leaf of their class: ticks stay far below this offset.
fn interior_offset(bucket: u8) -> i64 {
    if bucket == INTERIOR {
        1 << 62
    } else {
        0
    }
}

impl Lru {
    /// The selection by a scan of every slot (what the victim order replaces): the reference the
    /// order's tests compare it with.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn select_by_scan(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        self.residency.propose_lowest_ranked(n, ranking, |s| self.ticks[s].load(Ordering::Relaxed), out);
    }

    /// Chain-aware selection by scans (the reference of [`Lru::select_chained`]): `n` times, the
    /// offerable slot with a class and the lowest `(class, interior, tick, slot)` is proposed,
    /// where a slot is interior while more resident blocks continue it than were proposed so far.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn select_by_leaf_scan(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        let chain = ranking.chain.expect("a chain-aware ranking");
        let mut proposed: HashMap<u32, u32> = HashMap::new();
        for _ in 0..n {
            let best = (0..self.ticks.len() as u32)
                .filter(|&s| self.residency.offerable(SlotId(s)))
                .filter_map(|s| {
                    let c = (ranking.class_of)(SlotId(s))?;
                    let children = chain.resident_children(SlotId(s)).unwrap_or(0);
                    let interior = children > proposed.get(&s).copied().unwrap_or(0);
                    Some((c, interior, self.ticks[s as usize].load(Ordering::Relaxed), s))
                })
                .min();
            let Some((_, _, _, s)) = best else { return };
            self.residency.propose(SlotId(s));
            out.push(SlotId(s));
            if let Some(p) = chain.parent(SlotId(s)) {
                *proposed.entry(p.0).or_insert(0) += 1;
            }
        }
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
    fn prefetch(&self, slot: SlotId, _key_hash: u64) {
        crate::sync::prefetch_read(&self.ticks[slot.index()]);
        self.residency.prefetch(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        self.touch(slot)
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        self.select_ranked(n, &Ranking::plain(&|s| evictable(s).then_some(0)), out);
    }
    fn select_ranked(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        match ranking.chain {
            Some(chain) if counts_children(chain) => self.select_chained(n, ranking, chain, out),
            Some(_) => self.residency.propose_lowest_ranked(n, ranking, |s| self.ticks[s].load(Ordering::Relaxed), out),
            None => self.order.select(n, ranking, &self.residency, |s| self.place(s), |_| 0, out),
        }
    }
    fn file_pending(&self, ranking: &Ranking<'_>) {
        match ranking.chain {
            Some(chain) if counts_children(chain) => {
                self.order.file_marks(ranking, &self.residency, |s| self.chain_place(chain, s, 0))
            }
            // A chain view without counts: the selection scans, the order is not used.
            Some(_) => {}
            None => self.order.file_marks(ranking, &self.residency, |s| self.place(s)),
        }
    }
    fn concurrent_selection(&self) -> bool {
        // The victim order's shards let selections run at once (see `VictimOrder::select`).
        true
    }
    fn on_cancel(&self, slot: SlotId) {
        self.residency.cancel(slot);
        self.order.mark(slot);
    }
    fn on_reclass(&self, slot: SlotId) {
        self.order.mark(slot);
    }
    fn on_child_removed(&self, parent: SlotId) {
        // Interior -> leaf is a fall of its place: announced, as the order's lazy entries need.
        self.order.mark(parent);
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
