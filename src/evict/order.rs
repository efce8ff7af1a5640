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
use crate::sync::{AtomicU32, AtomicU8, AtomicUsize, Mutex, Ordering};
use crossbeam_utils::CachePadded;

/// No slot.
const NIL: u32 = u32::MAX;

/// Heads of a [`MarkStack`]: pushes from different threads go to different heads (a save of 43
/// blocks pushes 43 marks from its commit, so one head would be a cache line every committing core
/// writes). Two: the victim order keeps one stack per shard, so a commit's marks are spread over
/// the shards already, and a filing or a lone selection reads every head of every shard (eight
/// heads a shard made those reads 64 cache lines written by other cores). Two under loom too, so a
/// two-thread model pushes to both.
const MARK_HEADS: usize = 2;

/// A lock-free multi-producer stack of slots, each at most once, taken whole by one consumer
/// (the victim order's marks; exported through `internals` for its loom model). It is
/// [`MARK_HEADS`] lists sharing one link array: a slot is in at most one of them (its flag), and a
/// thread pushes onto the head of its own number. A push is one swap and a CAS loop; the consumer
/// swaps each head out, so no node it walks is ever pushed again before it has read the node's link
/// (a slot is pushed again only after the consumer cleared its flag, which it does after reading
/// the link).
pub struct MarkStack {
    heads: Box<[CachePadded<AtomicU32>]>,
    next: Box<[AtomicU32]>,
    queued: Box<[AtomicU8]>,
}

impl MarkStack {
    /// An empty stack for slots `0..capacity`.
    pub fn new(capacity: u32) -> Self {
        // Numbers the building thread before the stack is shared (see `crate::sync::thread_number`:
        // under loom a first numbering would add a synchronisation edge a real build lacks).
        let _ = crate::sync::thread_number();
        MarkStack {
            heads: (0..MARK_HEADS).map(|_| CachePadded::new(AtomicU32::new(NIL))).collect(),
            next: crate::sync::table(capacity as usize, |_| AtomicU32::new(NIL)),
            queued: crate::sync::table(capacity as usize, |_| AtomicU8::new(0)),
        }
    }

    /// Pushes `slot` unless it is in the stack already (any thread, never waits for another).
    pub fn push(&self, slot: SlotId) {
        if self.queued[slot.index()].swap(1, Ordering::AcqRel) != 0 {
            return;
        }
        let head = &self.heads[crate::sync::thread_number() % MARK_HEADS];
        let mut h = head.load(Ordering::Relaxed);
        loop {
            self.next[slot.index()].store(h, Ordering::Relaxed);
            // Release: the link and whatever the pusher wrote before are visible to the consumer.
            // A strong CAS: it fails only when another push moved the head (progress was made).
            match head.compare_exchange(h, slot.0, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => h = now,
            }
        }
    }

    /// True if no push is pending (a read of each head: it may miss a push racing it, which the
    /// next look finds).
    pub fn is_empty(&self) -> bool {
        self.heads.iter().all(|h| h.load(Ordering::Relaxed) == NIL)
    }

    /// Takes every slot pushed so far (one consumer at a time), newest first within each head.
    pub fn drain(&self, mut f: impl FnMut(SlotId)) {
        for head in self.heads.iter() {
            self.drain_list(head.swap(NIL, Ordering::Acquire), &mut f);
        }
    }

    /// Walks one list taken from a head, clearing each slot's flag once its link is read.
    fn drain_list(&self, mut h: u32, f: &mut impl FnMut(SlotId)) {
        while h != NIL {
            let s = h;
            // Seeded bug (model checking only): `mark-stack-flag-early` lets the slot be pushed
            // again before its link is read, so a re-push can cut the rest of the list off.
            if crate::seeded::seeded("mark-stack-flag-early") {
                self.queued[s as usize].store(0, Ordering::Release);
                h = self.next[s as usize].load(Ordering::Relaxed);
                f(SlotId(s));
                continue;
            }
            h = self.next[s as usize].load(Ordering::Relaxed);
            // After the link is read: the slot may be pushed again from here on. A swap, not a
            // store: a push that found the flag set returned at once, trusting this drain to see
            // what it wrote before (a cancel's RESIDENT). The acquiring read of its swap's value
            // makes that write visible to `f`; a plain store could let `f` read the old state (a
            // store-buffering race), and the slot would never be offered again.
            // (Seeded bug, model checking only: `mark-stack-clear-unordered` stores instead.)
            if crate::seeded::seeded("mark-stack-clear-unordered") {
                self.queued[s as usize].store(0, Ordering::Release);
            } else {
                self.queued[s as usize].swap(0, Ordering::AcqRel);
            }
            f(SlotId(s));
        }
    }
}

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

impl std::fmt::Debug for MarkStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MarkStack").field("capacity", &self.next.len()).finish()
    }
}

impl std::fmt::Debug for VictimOrder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VictimOrder").field("buckets", &self.buckets).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::{ChainView, EvictionPolicy, InsertInfo, Lru, PrefixLfu, Ranking};
    use crate::slab::slot::SlotId;

    /// A xorshift stream for the random operations.
    fn rng(seed: u64) -> impl FnMut(u64) -> u64 {
        let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        move |m| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m.max(1)
        }
    }

    /// An LRU of `cap` slots, every one inserted (slot `s` at tick `s + 1`).
    fn filled_lru(cap: u32) -> Lru {
        let p = Lru::new(cap);
        for s in 0..cap {
            p.on_insert(SlotId(s), InsertInfo::default());
        }
        p
    }

    /// The tier's preference order as these tests model it: a resident, unpinned slot has its
    /// class (of 3); a pinned one is filed by its base class, the same. With `forest`, chains:
    /// `forest[s]` is the block slot `s`'s block continues, counted as the tier's chain view
    /// counts it (a parent while resident; children while resident, pinned ones included).
    fn ranked_in<R>(
        resident: &[bool],
        pinned: &[bool],
        class: &[u8],
        forest: Option<&[Option<u32>]>,
        f: impl FnOnce(&Ranking<'_>) -> R,
    ) -> R {
        struct Chains<'a> {
            forest: &'a [Option<u32>],
            resident: &'a [bool],
        }
        impl ChainView for Chains<'_> {
            fn parent(&self, slot: SlotId) -> Option<SlotId> {
                self.forest[slot.index()].filter(|&p| self.resident[p as usize]).map(SlotId)
            }
            fn depth(&self, slot: SlotId) -> u32 {
                let mut d = 0;
                let mut s = slot.index();
                while let Some(p) = self.forest[s] {
                    d += 1;
                    s = p as usize;
                }
                d
            }
            fn resident_children(&self, slot: SlotId) -> Option<u32> {
                let n = (0..self.forest.len()).filter(|&t| self.resident[t] && self.forest[t] == Some(slot.0)).count();
                Some(n as u32)
            }
        }
        let chains = forest.map(|forest| Chains { forest, resident });
        let class_of = |t: SlotId| (resident[t.index()] && !pinned[t.index()]).then_some(class[t.index()]);
        let base_class = |t: SlotId| class[t.index()];
        let chain = chains.as_ref().map(|c| c as &dyn ChainView);
        f(&Ranking {
            classes: 3,
            class_of: &class_of,
            base_class: Some(&base_class),
            empty: None,
            chain,
            beside_others: false,
        })
    }

    /// Drives two instances of one policy through the same random inserts, hits, pins, class
    /// changes (announced with `on_reclass` when a class falls, as the tier does), cancels and
    /// evictions; one selects through its victim order, the other by a scan of every slot. Every
    /// selection must propose the same slots in the same order.
    fn same_as_scan<P: EvictionPolicy>(
        make: impl Fn() -> P,
        scan: impl Fn(&P, usize, &Ranking<'_>, &mut Vec<SlotId>),
        cap: u32,
        seed: u64,
    ) {
        same_as_scan_in(make, scan, cap, seed, false)
    }

    /// [`same_as_scan`], with `chains`: under a random forest of chains fixed for the run (the
    /// tier's chain view as [`ranked_in`] models it).
    fn same_as_scan_in<P: EvictionPolicy>(
        make: impl Fn() -> P,
        scan: impl Fn(&P, usize, &Ranking<'_>, &mut Vec<SlotId>),
        cap: u32,
        seed: u64,
        chains: bool,
    ) {
        let (order, reference) = (make(), make());
        let mut rnd = rng(seed);
        let forest: Vec<Option<u32>> =
            (0..cap as u64).map(|s| (chains && s > 0 && rnd(4) != 0).then(|| rnd(s) as u32)).collect();
        let forest = chains.then_some(&forest[..]);
        let mut resident = vec![false; cap as usize];
        let mut pinned = vec![false; cap as usize];
        let mut class = vec![0u8; cap as usize];
        let mut key = 0u64;
        for step in 0..4000 {
            let s = rnd(cap as u64) as usize;
            let slot = SlotId(s as u32);
            match rnd(10) {
                0 | 1 if !resident[s] => {
                    key += 1;
                    let info = InsertInfo::new(key % 23, Some(rnd(12) as u32));
                    order.on_insert(slot, info);
                    reference.on_insert(slot, info);
                    resident[s] = true;
                }
                2..=4 => {
                    order.on_hit(slot);
                    reference.on_hit(slot);
                }
                5 => pinned[s] = !pinned[s],
                6 => {
                    let c = rnd(3) as u8;
                    if c < class[s] {
                        order.on_reclass(slot);
                    }
                    class[s] = c;
                }
                // A commit's filing of the marks so far (the tier's call after every save), with
                // the classes of this moment.
                7 if rnd(2) == 0 => ranked_in(&resident, &pinned, &class, forest, |r| order.file_pending(r)),
                _ => {
                    let n = 1 + rnd(4) as usize;
                    let (mut a, mut b) = (vec![], vec![]);
                    ranked_in(&resident, &pinned, &class, forest, |r| {
                        order.select_ranked(n, r, &mut a);
                        scan(&reference, n, r, &mut b);
                    });
                    assert_eq!(a, b, "{} seed {seed} step {step}: the victim order and the scan differ", order.name());
                    for v in a {
                        if rnd(3) == 0 {
                            order.on_cancel(v);
                            reference.on_cancel(v);
                        } else {
                            order.on_remove(v);
                            reference.on_remove(v);
                            resident[v.index()] = false;
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn the_victim_order_proposes_what_a_scan_of_every_slot_would() {
        for seed in 1..=12 {
            same_as_scan(|| Lru::new(24), |p, n, r, out| p.select_by_scan(n, r, out), 24, seed);
            same_as_scan(|| PrefixLfu::new(8), |p, n, r, out| p.select_by_scan(n, r, out), 8, seed);
            same_as_scan(|| PrefixLfu::adaptive(16), |p, n, r, out| p.select_by_scan(n, r, out), 16, seed);
        }
    }

    /// Chain-aware LRU from its victim order (leaves by tick, then interior blocks, a proposal
    /// exposing its parent) against its reference, a scan that proposes one block at a time.
    #[test]
    fn chain_aware_lru_selects_as_its_leaf_scan() {
        for seed in 1..=24 {
            same_as_scan_in(|| Lru::new(24), |p, n, r, out| p.select_by_leaf_scan(n, r, out), 24, seed, true);
        }
    }

    /// A commit's filing: the marks of the blocks inserted so far become heap entries at once, so
    /// the next selection drains none (the first selection after a pool fills files nothing).
    #[test]
    fn a_commit_files_the_marks_so_far_and_the_selection_finds_none_left() {
        let cap = 64u32;
        let all = |_: SlotId| Some(0u8);
        let lru = Lru::new(cap);
        let lfu = PrefixLfu::adaptive(cap);
        for s in 0..cap {
            lru.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s % 8)));
            lfu.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s % 8)));
        }
        assert_eq!((lru.order.entries(), lfu.order.entries()), (0, 0), "inserts only mark");
        lru.file_pending(&Ranking::plain(&all));
        lfu.file_pending(&Ranking::plain(&all));
        assert_eq!((lru.order.entries(), lfu.order.entries()), (cap as usize, cap as usize), "every mark is filed");
        let mut left = 0;
        for sh in lru.order.shards.iter().chain(lfu.order.shards.iter()) {
            sh.marks.drain(|_| left += 1);
        }
        assert_eq!(left, 0, "no mark is left for the selection");
        // Nothing left for the selection to file; it proposes what it would have.
        let mut out = vec![];
        lru.select_ranked(2, &Ranking::plain(&all), &mut out);
        assert_eq!(out, vec![SlotId(0), SlotId(1)], "the least recently inserted");
    }

    /// Filings alone (no selection: a pool not yet full, with hints given and withdrawn on its
    /// blocks) must not let retired entries grow without bound. Seeded bug `filing-skips-compaction`.
    #[test]
    fn filings_alone_do_not_let_retired_entries_pile_up() {
        let cap = 64u32;
        let p = filled_lru(cap);
        let all = |_: SlotId| Some(0u8);
        let bound = 2 * cap as usize + 1024 + cap as usize;
        for round in 0..400 {
            for s in 0..cap / 2 {
                p.on_reclass(SlotId(s));
            }
            p.file_pending(&Ranking::plain(&all));
            assert!(p.order.entries() <= bound, "round {round}: {} entries for {cap} slots", p.order.entries());
        }
    }

    /// A filing never waits for the order: while a selection (here, this thread) holds it, a
    /// commit's filing returns at once and leaves the marks, which the next selection files.
    /// Seeded bug `filing-blocks`.
    #[test]
    fn a_filing_never_waits_for_the_order_and_leaves_its_marks_to_the_holder() {
        let p = filled_lru(8);
        let held = p.order.hold_all();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::scope(|sc| {
            sc.spawn(|| {
                let all = |_: SlotId| Some(0u8);
                p.file_pending(&Ranking::plain(&all));
                tx.send(()).unwrap();
            });
            let returned = rx.recv_timeout(std::time::Duration::from_secs(10));
            drop(held);
            returned.expect("the filing returned while the order was held");
        });
        assert_eq!(p.order.entries(), 0, "nothing filed while the order was held");
        let all = |_: SlotId| Some(0u8);
        let mut out = vec![];
        p.select_ranked(8, &Ranking::plain(&all), &mut out);
        assert_eq!(out.len(), 8, "the selection filed the marks the filing left");
    }

    #[test]
    fn retired_entries_do_not_pile_up() {
        // Half the blocks are hit and re-placed before every selection: each re-placement retires
        // the slot's entry, which (its key above every victim's) no selection ever pops.
        let cap = 64u32;
        let p = filled_lru(cap);
        let all = |_: SlotId| Some(0u8);
        for round in 0..400 {
            for s in 0..cap / 2 {
                p.on_hit(SlotId(s));
                p.on_reclass(SlotId(s));
            }
            let mut out = vec![];
            p.select_ranked(1, &Ranking::plain(&all), &mut out);
            assert_eq!(out.len(), 1);
            p.on_cancel(out[0]);
            let bound = 2 * cap as usize + 1024 + cap as usize;
            assert!(p.order.entries() <= bound, "round {round}: {} entries for {cap} slots", p.order.entries());
        }
    }

    /// Selections running at once (beside others: the tier's shared eviction lock) search disjoint shards: none
    /// proposes a slot another has proposed (the residency check panics on a second proposal),
    /// each gets its victims while every shard has some, a cancelled proposal is offered again,
    /// and a selection that then runs alone proposes every resident slot. Seeded bug
    /// `lone-selection-takes-one-shard` (a lone selection searches its own shard only).
    #[test]
    fn selections_at_once_never_share_a_slot_and_a_lone_one_reaches_every_slot() {
        let cap = 4096u32;
        let all = |_: SlotId| Some(0u8);
        for p in [Box::new(filled_lru(cap)) as Box<dyn EvictionPolicy>, {
            let p = PrefixLfu::new(cap);
            for s in 0..cap {
                p.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s % 8)));
            }
            Box::new(p)
        }] {
            assert!(p.concurrent_selection(), "{}", p.name());
            std::thread::scope(|sc| {
                for t in 0..8u64 {
                    let p = &p;
                    sc.spawn(move || {
                        let mut next = rng(t + 1);
                        for round in 0..200 {
                            let mut out = vec![];
                            let beside = Ranking { beside_others: true, ..Ranking::plain(&all) };
                            p.select_ranked(16, &beside, &mut out);
                            assert_eq!(out.len(), 16, "{} thread {t} round {round}", p.name());
                            let mut seen = out.clone();
                            seen.sort();
                            seen.dedup();
                            assert_eq!(seen.len(), 16, "distinct proposals");
                            for s in out {
                                if next(2) == 0 {
                                    p.on_cancel(s);
                                } else {
                                    // Evicted, and a new block saved into the slot.
                                    p.on_remove(s);
                                    p.on_insert(s, InsertInfo::new(next(1 << 20), Some(0)));
                                }
                            }
                        }
                    });
                }
            });
            let mut out = vec![];
            p.select_ranked(cap as usize, &Ranking::plain(&all), &mut out);
            assert_eq!(out.len(), cap as usize, "{}: a lone selection reaches every slot", p.name());
        }
    }

    /// A selection beside others (another selection counted as running) searches only its share
    /// of the shards and proposes only slots of the classes it is offered: when its shards hold
    /// none, it proposes nothing (the tier then selects again alone), even though other shards
    /// hold offered slots; alone, the same ranking reaches them.
    #[test]
    fn a_selection_beside_others_searches_only_its_share_of_the_shards() {
        let cap = 64u32;
        let p = filled_lru(cap);
        let k = super::ORDER_SHARDS;
        let home = crate::sync::thread_number() % k;
        // Class 0 outside the shards this selection takes (its own and the next k/2 - 1), class 1
        // inside them; only class 0 is offered.
        let share = k / 2;
        let mine = |s: SlotId| (0..share).any(|i| (home + i) % k == s.index() % k);
        let class_of = |s: SlotId| if mine(s) { None } else { Some(0u8) };
        let base = |s: SlotId| if mine(s) { 1u8 } else { 0 };
        let r = Ranking {
            classes: 1,
            class_of: &class_of,
            base_class: Some(&base),
            empty: None,
            chain: None,
            beside_others: true,
        };
        p.order.selectors.store(1, std::sync::atomic::Ordering::Relaxed);
        let mut out = vec![];
        p.select_ranked(4, &r, &mut out);
        p.order.selectors.store(0, std::sync::atomic::Ordering::Relaxed);
        assert!(out.iter().all(|s| !mine(*s)), "beside others, a slot it is not offered was proposed: {out:?}");
        assert!(out.is_empty(), "its shards hold no slot it is offered: {out:?}");
        // Alone, the same ranking reaches the class-0 slots in the other shards.
        let alone = Ranking { beside_others: false, ..r };
        p.select_ranked(4, &alone, &mut out);
        assert_eq!(out.len(), 4);
        assert!(out.iter().all(|s| !mine(*s)));
    }
}
