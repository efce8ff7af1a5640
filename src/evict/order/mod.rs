//! [`VictimOrder`]: the incremental victim order of the score-ranked policies (LRU, the prefix-LFU
//! family), so a selection costs O(n log capacity) instead of a scan of every slot.
//!
//! # Structure
//!
//! Every resident slot the selector has learnt of has one **entry** `(key, slot, stamp)` in one
//! binary min-heap, chosen by its **class** (the tier's preference class, [`Ranking::class_of`];
//! [`Ranking::base_class`] for a slot that is pinned or not yet ready) and its **bucket** (a part
//! of the policy's score kept out of the key: prefix-LFU's history count, whose weight the tuner
//! changes at run time). A slot's score is `key + offset(bucket)`; the selection takes entries by
//! `(class, score, slot)`, lowest first: the order of the scan it replaces.
//!
//! Entries are **lazy**: a hit does not touch the heaps (the query path stays lock-free), so an
//! entry's key may be older than the slot's. That is exact as long as a slot's true key never
//! falls below its entry's: LRU's tick and prefix-LFU's `tick - 2 x depth` only grow. A popped
//! entry is checked against the slot's present key, bucket and class; a stale one is pushed again
//! where it belongs and the search goes on. Every change that can *lower* a slot's place (a new
//! block, a cancelled proposal, a history count that fell after ageing, a class the tier lowered:
//! a hint withdrawn, a disk copy written, a parent evicted) is announced by
//! [`VictimOrder::mark`], a lock-free push on the **mark stack**, drained by the next selection or,
//! sooner, by a committing thread that finds the order free ([`VictimOrder::file_marks`]); each
//! drained slot gets a fresh entry and a new stamp, which retires any entry it had. A change
//! that is missed (an orphan whose link raced its parent's eviction, a hint that expires with no
//! later hint call) only delays the block to its old class: every block stays reachable.
//!
//! # Shards
//!
//! The heaps and the mark stack are split into [`ORDER_SHARDS`] shards by slot (slot `s` in shard
//! `s % ORDER_SHARDS`), each behind its own mutex, so that selections can run at once: the tier
//! lets them (the shared side of its eviction lock) for a policy whose
//! [`super::EvictionPolicy::concurrent_selection`] is true. A selection that runs alone
//! ([`Ranking::beside_others`] false, or no other selection running) locks every shard and takes,
//! at each step, the best entry of all of them (each shard's best kept as one number): exactly the
//! order one heap over every slot would give. One beside others takes only the shards it finds
//! free, up to its share, and
//! proposes the best of those: an approximation of the order (a shard holds every eighth slot,
//! whichever blocks they hold, so the best of a shard are among the best few of the whole), and
//! never a slot another selection holds, since a slot is only ever in its own shard.
//!
//! # Liveness
//!
//! A resident slot is always in its shard's mark stack, in one of its shard's heaps, or proposed.
//! A selection drains the stacks of the shards it holds, then pops until it has `n` proposals or
//! every heap it holds is empty; entries of slots that are pinned or not ready are set aside and
//! put back unchanged when it ends. So a selection that runs alone (every shard) proposes
//! `min(n, k)` slots (the contract of [`super::EvictionPolicy::select_victims`]); one beside
//! others may propose fewer, and the tier then selects again alone before it refuses a save.
//!
//! # Cost
//!
//! A selection of `n` victims pops about `n` entries plus the stale ones it meets (each hit since
//! a block's entry was pushed costs at most one re-push, when the entry is reached) and the pinned
//! ones at the front; each pop is O(log capacity) plus a look at the top of each bucket's heap of
//! the lowest class that has entries. Retired entries are dropped when popped; when they outnumber
//! the slots, the heaps are rebuilt without them by the drain that finds them so (a selection's or a
//! filing's; O(capacity), at most once per `capacity` marks).

use super::heap::QuadHeap;
use super::{Ranking, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicUsize, Mutex, Ordering};
use crossbeam_utils::CachePadded;

mod marks;
#[cfg(all(test, not(loom)))]
mod tests;

pub use marks::MarkStack;

/// One heap entry: ordered by `(key, slot)` (the stamp only tells a live entry from a retired one).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Entry {
    key: i64,
    slot: u32,
    stamp: u32,
}

/// Shards of a [`VictimOrder`]: slot `s` belongs to shard `s % ORDER_SHARDS`. Two under loom, so
/// a two-thread model can select in both at once.
#[cfg(not(loom))]
pub(crate) const ORDER_SHARDS: usize = 8;
#[cfg(loom)]
pub(crate) const ORDER_SHARDS: usize = 2;

/// One shard's heaps. Its slots are `shard + k x ORDER_SHARDS`; the per-slot arrays are indexed by
/// the slot's **local** number `k` (`slot / ORDER_SHARDS`); an entry names its slot by its global
/// number, so entries of different shards compare as one order would.
struct State {
    /// `heaps[class * buckets + bucket]`.
    heaps: Vec<QuadHeap<Entry>>,
    /// Per local slot, the stamp of its live entry.
    stamp: Box<[u32]>,
    /// Entries in the heaps, live and retired.
    entries: usize,
    /// Entries set aside by the running selection (pinned, not ready): `(heap, entry)`.
    aside: Vec<(usize, Entry)>,
}

/// The local number of `s` in its shard.
#[inline]
fn local(s: SlotId) -> usize {
    s.index() / ORDER_SHARDS
}

/// The shard of `s`.
#[inline]
fn shard_of(s: SlotId) -> usize {
    s.index() % ORDER_SHARDS
}

impl State {
    /// A fresh entry for `s` in heap `heap` with `key`; retires any other entry of `s`.
    fn push_entry(&mut self, buckets: usize, s: SlotId, heap: usize, key: i64) {
        if self.heaps.len() <= heap {
            self.heaps.resize_with((heap / buckets + 1) * buckets, QuadHeap::default);
        }
        let stamp = self.stamp[local(s)].wrapping_add(1);
        self.stamp[local(s)] = stamp;
        self.heaps[heap].push(Entry { key, slot: s.0, stamp });
        self.entries += 1;
    }

    /// True if `e` is the live entry of its slot.
    #[inline]
    fn live(&self, e: &Entry) -> bool {
        self.stamp[local(SlotId(e.slot))] == e.stamp
    }
}

/// The heap of `class` and `bucket` (buckets past the last share the last).
#[inline]
fn heap_index(buckets: usize, class: u8, bucket: u8) -> usize {
    class as usize * buckets + (bucket as usize).min(buckets - 1)
}

/// One shard: its marks and its heaps, each slot of the shard in at most one of them.
struct Shard {
    marks: MarkStack,
    state: Mutex<State>,
}

/// The incremental victim order (see the module docs).
pub(crate) struct VictimOrder {
    buckets: usize,
    shards: Box<[CachePadded<Shard>]>,
    /// Selections running now (each counts itself while it runs): how many shards a new one takes.
    selectors: AtomicUsize,
}

/// Counts a selection out of [`VictimOrder::selectors`] when it ends (an unwind included).
struct Selecting<'a>(&'a AtomicUsize);

impl Drop for Selecting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The best entry of one held shard: its rank ([`rank`]) and the heap it tops.
type Top = (u128, usize);

/// No entry: ranks after every real one.
const NO_TOP: Top = (u128::MAX, usize::MAX);

/// `(class, score, slot)` as one number with the same order (the score's sign bit flipped so it
/// orders as unsigned): the selection compares its shards' best entries by it at every pop.
#[inline]
fn rank(class: usize, score: i64, slot: u32) -> u128 {
    ((class as u128) << 96) | ((((score as u64) ^ (1 << 63)) as u128) << 32) | slot as u128
}

impl VictimOrder {
    /// An order for `capacity` slots whose scores have `buckets` buckets (1 to 256).
    pub(crate) fn new(capacity: u32, buckets: usize) -> Self {
        assert!((1..=256).contains(&buckets), "a victim order has 1 to 256 buckets, not {buckets}");
        let shards = (0..ORDER_SHARDS)
            .map(|i| {
                // Slots i, i + K, i + 2K, ... below `capacity`.
                let n = (capacity as usize + ORDER_SHARDS - 1 - i) / ORDER_SHARDS;
                CachePadded::new(Shard {
                    marks: MarkStack::new(n as u32),
                    state: Mutex::new(State {
                        heaps: Vec::new(),
                        stamp: crate::sync::table(n, |_| 0),
                        entries: 0,
                        aside: Vec::new(),
                    }),
                })
            })
            .collect();
        VictimOrder { buckets, shards, selectors: AtomicUsize::new(0) }
    }

    /// `slot`'s place may have fallen (or it has none yet): the next selection of its shard, or
    /// the next [`VictimOrder::file_marks`] to find the shard free, places it afresh. Lock-free.
    pub(crate) fn mark(&self, slot: SlotId) {
        self.shards[shard_of(slot)].marks.push(SlotId(local(slot) as u32));
    }

    /// Files the slots marked so far where they belong now, in every shard that no selection or
    /// other filing holds (a held shard is skipped at once: its holder, or the next selection,
    /// files them). Called by the tier after a save's commit, so the marks of its blocks are
    /// filed outside the eviction lock, on the committing thread, and the selection under the
    /// lock finds few or none: no selection files a whole pool's worth after the pool has filled.
    /// `ranking` is the tier's full preference order (only `class_of` and `base_class` are read);
    /// `place` as in [`VictimOrder::select`]. O(marks x log capacity).
    pub(crate) fn file_marks(&self, ranking: &Ranking<'_>, residency: &Residency, place: impl Fn(usize) -> (u8, i64)) {
        // Seeded bug (tests only): `marks-filed-only-by-selections` leaves every mark to the next
        // selection.
        if crate::seeded::seeded("marks-filed-only-by-selections") {
            return;
        }
        for (i, shard) in self.shards.iter().enumerate() {
            // A shard with no marks is not locked (a commit's blocks are in a few shards).
            if shard.marks.is_empty() {
                continue;
            }
            // Seeded bug (tests only): `filing-blocks` waits for the shard's mutex instead of trying it.
            let guard = if crate::seeded::seeded("filing-blocks") {
                Some(crate::sync::lock(&shard.state))
            } else {
                crate::sync::try_lock(&shard.state)
            };
            let Some(mut guard) = guard else { continue };
            self.drain_marks(i, &mut guard, ranking, residency, &place);
            // Filings alone (a pool not yet full, hints given and withdrawn on its blocks) must
            // bound the retired entries too, without a selection. (Seeded bug, tests only:
            // `filing-skips-compaction` leaves it to the selections.)
            if !crate::seeded::seeded("filing-skips-compaction") {
                Self::bound_retired(&mut guard, residency);
            }
        }
    }

    /// Drains shard `shard`'s marks into its heaps (the caller holds its state): each offerable
    /// slot marked gets a fresh entry where it belongs now.
    fn drain_marks(
        &self,
        shard: usize,
        st: &mut State,
        ranking: &Ranking<'_>,
        residency: &Residency,
        place: &impl Fn(usize) -> (u8, i64),
    ) {
        // Seeded bug (tests only): marks are never drained, so new blocks are never offered.
        if crate::seeded::seeded("victim-order-marks-lost") {
            return;
        }
        let buckets = self.buckets;
        let marks = &self.shards[shard].marks;
        // A shard with no marks costs reads of its heads, not writes (a selection alone drains
        // every shard, most of them with no marks since the last commit's filing).
        if marks.is_empty() {
            return;
        }
        marks.drain(|l| {
            let s = SlotId((l.index() * ORDER_SHARDS + shard) as u32);
            if residency.offerable(s) {
                let (bucket, key) = place(s.index());
                // A slot the tier does not offer now (pinned, or its commit not yet published: a
                // commit's filing can meet another save's block between its `on_insert` and its
                // `READY`) is filed where it will belong, by its base class.
                let class = match (ranking.class_of)(s) {
                    Some(c) => c,
                    // Seeded bug (tests and model checking): `filing-drops-unready` drops it
                    // instead, so it is never offered (in every drain: a selection's too).
                    None if crate::seeded::seeded("filing-drops-unready") => return,
                    None => ranking.base_class.map_or(0, |f| f(s)),
                };
                st.push_entry(buckets, s, heap_index(buckets, class, bucket), key);
            }
        });
    }

    /// Rebuilds a shard's heaps without their retired entries once these outnumber its slots
    /// (after every drain, a selection's or a filing's: O(shard's slots), at most once per that
    /// many marks). The slack is split over the shards, so the whole order holds at most
    /// `2 x capacity + 1,024` entries plus those pushed since the last drain.
    fn bound_retired(st: &mut State, residency: &Residency) {
        if st.entries > 2 * st.stamp.len() + 1024 / ORDER_SHARDS {
            Self::compact(st, residency);
        }
    }

    /// Proposes up to `n` offerable slots with a class, lowest `(class, key + offset(bucket),
    /// slot)` first, each made `PROPOSED` in `residency`. `place(slot)` is the slot's present
    /// `(bucket, key)`; `offset(bucket)` must not change during the call.
    ///
    /// Which shards it searches: a selection that runs alone ([`Ranking::beside_others`] false:
    /// the tier's exclusive eviction lock), or that finds no other selection running, takes every
    /// shard, waiting for each, and so gets exactly the order of one heap over all slots (a single
    /// saving thread always does). One beside others (the shared side) that finds `r > 0` others
    /// running takes the shards it can get without waiting, from its own (the thread's number)
    /// on, up to `ORDER_SHARDS / (r + 1)` (waiting for its own only when none was free):
    /// concurrent selections search disjoint shards and each proposes the best of its shards, an
    /// approximation of the order, never a slot twice.
    pub(crate) fn select(
        &self,
        n: usize,
        ranking: &Ranking<'_>,
        residency: &Residency,
        place: impl Fn(usize) -> (u8, i64),
        offset: impl Fn(u8) -> i64,
        out: &mut Vec<SlotId>,
    ) {
        self.select_exposing(n, ranking, residency, place, offset, |_| None, out)
    }

    /// The shards this selection searches (see [`VictimOrder::select`]), locked, with their
    /// numbers. Alone (`beside_others` false, or no other selection running: `running` 0), it
    /// waits for each shard in turn, in shard order: a filing or a selection beside others holds
    /// one for a bounded time and never waits while it holds one, so no two threads wait for each
    /// other. Beside others, it takes the free shards it finds, from its own on, up to its share,
    /// and waits (for its own) only when it found none free.
    fn take_shards(&self, beside_others: bool, running: usize) -> Vec<(usize, crate::sync::MutexGuard<'_, State>)> {
        let k = self.shards.len();
        let home = crate::sync::thread_number() % k;
        let mut held = Vec::with_capacity(k);
        // Seeded bug (tests only): `lone-selection-takes-one-shard` searches only its own shard
        // even when it runs alone, so a lone selector's victims are not the order's.
        if crate::seeded::seeded("lone-selection-takes-one-shard") {
            held.push((home, crate::sync::lock(&self.shards[home].state)));
            return held;
        }
        if !beside_others || running == 0 {
            // In shard order, so that even two selections that both take every shard cannot
            // wait for each other.
            for j in 0..k {
                held.push((j, crate::sync::lock_spinning(&self.shards[j].state)));
            }
            return held;
        }
        let share = (k / (running + 1)).max(1);
        for i in 0..k {
            if held.len() >= share {
                break;
            }
            let j = (home + i) % k;
            if let Some(g) = crate::sync::try_lock(&self.shards[j].state) {
                held.push((j, g));
            }
        }
        if held.is_empty() {
            held.push((home, crate::sync::lock_spinning(&self.shards[home].state)));
        }
        held
    }

    /// The best entry of a shard's heaps: the lowest class with entries, and in it the bucket
    /// whose top has the lowest `(key + offset, slot)`.
    fn best(heaps: &[QuadHeap<Entry>], buckets: usize, offset: &impl Fn(u8) -> i64) -> Top {
        for (c, hs) in heaps.chunks(buckets).enumerate() {
            let top = hs
                .iter()
                .enumerate()
                .filter_map(|(b, h)| h.peek().map(|e| (rank(c, e.key.saturating_add(offset(b as u8)), e.slot), b)))
                .min();
            if let Some((r, b)) = top {
                return (r, c * buckets + b);
            }
        }
        NO_TOP
    }

    /// [`VictimOrder::select`] where a proposal can lower another slot's place at once:
    /// `exposed(s)`, called after each proposal `s`, names a slot whose place may have fallen
    /// because `s` is proposed (chain-aware LRU: the parent of a block, which becomes a leaf when
    /// its last child is proposed; `place` reads what the proposals so far changed). That slot,
    /// if offerable, gets a fresh entry where it belongs now, so this same selection can take it
    /// (when its shard is one this selection holds; else it is marked, for its shard's next drain).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn select_exposing(
        &self,
        n: usize,
        ranking: &Ranking<'_>,
        residency: &Residency,
        place: impl Fn(usize) -> (u8, i64),
        offset: impl Fn(u8) -> i64,
        mut exposed: impl FnMut(SlotId) -> Option<SlotId>,
        out: &mut Vec<SlotId>,
    ) {
        let running = self.selectors.fetch_add(1, Ordering::AcqRel);
        let _selecting = Selecting(&self.selectors);
        let mut held = self.take_shards(ranking.beside_others, running);
        let buckets = self.buckets;
        let class_of = ranking.class_of;
        let base = |s: SlotId| ranking.base_class.map_or(0, |f| f(s));
        let heap_of = |class: u8, bucket: u8| heap_index(buckets, class, bucket);
        // Where in `held` each shard is (`usize::MAX`: not held).
        let mut held_at = [usize::MAX; ORDER_SHARDS];
        for (i, (j, st)) in held.iter_mut().enumerate() {
            held_at[*j] = i;
            self.drain_marks(*j, st, ranking, residency, &place);
            Self::bound_retired(st, residency);
        }
        let mut tops = [NO_TOP; ORDER_SHARDS];
        for (t, (_, st)) in tops.iter_mut().zip(held.iter()) {
            *t = Self::best(&st.heaps, buckets, &offset);
        }
        let mut found = 0;
        while found < n {
            // The shard whose best entry is the best of all held.
            let (mut i, mut top) = (0, tops[0]);
            for (j, t) in tops.iter().enumerate().skip(1) {
                if t.0 < top.0 {
                    (i, top) = (j, *t);
                }
            }
            if top.0 == u128::MAX {
                break;
            }
            // Beside others, the tier offers only the lowest classes (`Core::with_ranking`): once
            // no held entry of those is left, stop instead of popping through the rest, all set
            // aside (the tier then selects again alone). (A selection alone pops on: a class out
            // of range is still offered there, as `select_ranked`'s contract has it.)
            if ranking.beside_others && (top.0 >> 96) >= ranking.classes as u128 {
                break;
            }
            let h = top.1;
            let st = &mut *held[i].1;
            let Some(e) = st.heaps[h].pop() else { break };
            st.entries -= 1;
            let s = SlotId(e.slot);
            // A retired entry, or a slot proposed or evicted since (a cancel or insert marks it
            // again), is dropped; any other is proposed, set aside or filed where it belongs now.
            if st.live(&e) && residency.offerable(s) {
                let (bucket, key) = place(s.index());
                match class_of(s) {
                    Some(c) if heap_of(c, bucket) == h && key == e.key => {
                        residency.propose(s);
                        out.push(s);
                        found += 1;
                        // (Seeded bug, tests only: `exposed-not-refiled` leaves the exposed slot
                        // where it was, so a chain loses one block per selection instead of going
                        // whole.)
                        if let Some(p) = exposed(s).filter(|_| !crate::seeded::seeded("exposed-not-refiled")) {
                            if residency.offerable(p) {
                                match held_at[shard_of(p)] {
                                    usize::MAX => self.mark(p),
                                    pi => {
                                        let pst = &mut *held[pi].1;
                                        let (pb, pk) = place(p.index());
                                        let ph = heap_of(class_of(p).unwrap_or_else(|| base(p)), pb);
                                        pst.push_entry(buckets, p, ph, pk);
                                        if pi != i {
                                            tops[pi] = Self::best(&pst.heaps, buckets, &offset);
                                        }
                                    }
                                }
                            }
                        }
                    }
                    Some(c) => st.push_entry(buckets, s, heap_of(c, bucket), key),
                    None => {
                        let b = heap_of(base(s), bucket);
                        if b == h && key == e.key {
                            st.aside.push((h, e));
                        } else {
                            st.push_entry(buckets, s, b, key);
                        }
                    }
                }
            }
            tops[i] = Self::best(&held[i].1.heaps, buckets, &offset);
        }
        for (_, st) in held.iter_mut() {
            for (h, e) in std::mem::take(&mut st.aside) {
                st.heaps[h].push(e);
                st.entries += 1;
            }
        }
    }

    /// Drops every retired entry and every entry of a slot no longer offerable.
    fn compact(st: &mut State, residency: &Residency) {
        let stamp = &st.stamp;
        let mut entries = 0;
        for h in st.heaps.iter_mut() {
            // Seeded bug (tests only): `victim-order-stale-entries` keeps retired entries, so
            // they pile up without bound.
            h.retain(|e| {
                (stamp[local(SlotId(e.slot))] == e.stamp || crate::seeded::seeded("victim-order-stale-entries"))
                    && residency.offerable(SlotId(e.slot))
            });
            entries += h.len();
        }
        st.entries = entries;
    }

    /// Entries held, live and retired, over every shard (for tests).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn entries(&self) -> usize {
        self.shards.iter().map(|s| crate::sync::lock(&s.state).entries).sum()
    }

    /// Locks every shard (for tests: an order held by a selection).
    #[cfg(all(test, not(loom)))]
    pub(crate) fn hold_all(&self) -> impl Sized + '_ {
        self.shards.iter().map(|s| crate::sync::lock(&s.state)).collect::<Vec<_>>()
    }
}

impl std::fmt::Debug for VictimOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VictimOrder").field("buckets", &self.buckets).finish()
    }
}
