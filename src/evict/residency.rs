//! [`Residency`]: which slots a policy holds, and in which state of the policy contract (see the
//! parent module): `ABSENT`, `RESIDENT`, `PROPOSED`. Every transition is checked; a wrong one is a
//! broken invariant of the tier (it called the policy out of order) and panics with the slot and
//! both states, whichever policy it happened in.

use super::Ranking;
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU8, Ordering};

const ABSENT: u8 = 0;
const RESIDENT: u8 = 1;
const PROPOSED: u8 = 2;

fn state_name(s: u8) -> &'static str {
    match s {
        ABSENT => "absent",
        RESIDENT => "resident",
        PROPOSED => "proposed",
        _ => "corrupt",
    }
}

/// Per-slot policy-contract state (one byte per slot). Shared by every built-in policy.
pub(crate) struct Residency {
    state: Box<[AtomicU8]>,
}

impl Residency {
    /// Every slot of `0..capacity` absent.
    pub(crate) fn new(capacity: u32) -> Self {
        Residency { state: crate::sync::table(capacity as usize, |_| AtomicU8::new(ABSENT)) }
    }

    /// Slots tracked.
    pub(crate) fn capacity(&self) -> u32 {
        self.state.len() as u32
    }

    fn transition(&self, slot: SlotId, from: u8, to: u8, call: &str) {
        let prev = self.state[slot.index()].swap(to, Ordering::Relaxed);
        assert!(
            prev == from,
            "eviction policy contract broken: {call}(slot {}) found it {}, expected {}",
            slot.0,
            state_name(prev),
            state_name(from)
        );
    }

    /// `on_insert`: `ABSENT -> RESIDENT`.
    pub(crate) fn insert(&self, slot: SlotId) {
        self.transition(slot, ABSENT, RESIDENT, "on_insert");
    }

    /// Starts loading `slot`'s state byte into the caches ([`crate::sync::prefetch_read`]; see
    /// [`super::EvictionPolicy::prefetch`]).
    #[inline]
    pub(crate) fn prefetch(&self, slot: SlotId) {
        crate::sync::prefetch_read(&self.state[slot.index()]);
    }

    /// A selection proposes `slot`: `RESIDENT -> PROPOSED`.
    pub(crate) fn propose(&self, slot: SlotId) {
        self.transition(slot, RESIDENT, PROPOSED, "select_victims");
    }

    /// A selection that may race another proposes `slot` if it is still `RESIDENT` (`RESIDENT ->
    /// PROPOSED` by CAS); false if another selection proposed it first or it left.
    pub(crate) fn try_propose(&self, slot: SlotId) -> bool {
        self.state[slot.index()].compare_exchange(RESIDENT, PROPOSED, Ordering::Relaxed, Ordering::Relaxed).is_ok()
    }

    /// `on_cancel`: `PROPOSED -> RESIDENT`.
    pub(crate) fn cancel(&self, slot: SlotId) {
        self.transition(slot, PROPOSED, RESIDENT, "on_cancel");
    }

    /// `on_remove`: `PROPOSED -> ABSENT`.
    pub(crate) fn remove(&self, slot: SlotId) {
        self.transition(slot, PROPOSED, ABSENT, "on_remove");
    }

    /// True if `slot` is resident and not proposed: a selection may offer it.
    #[inline]
    pub(crate) fn offerable(&self, slot: SlotId) -> bool {
        self.state[slot.index()].load(Ordering::Relaxed) == RESIDENT
    }

    /// Resident slots (proposed ones included); for tests and reports.
    pub(crate) fn resident(&self) -> usize {
        self.state.iter().filter(|s| s.load(Ordering::Relaxed) != ABSENT).count()
    }
}

impl std::fmt::Debug for Residency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Residency").field("capacity", &self.capacity()).field("resident", &self.resident()).finish()
    }
}

impl Residency {
    /// The scan selection (LRU with chain-aware ranking; the reference of the victim order's
    /// tests), under the tier's preference order
    /// ([`super::EvictionPolicy::select_ranked`]): the `n` offerable slots with a class, lowest
    /// `(class, score)` first (ties by slot id). With [`Ranking::chain`], a slot's score is the
    /// highest score of its resident subtree, ties going to the deeper block. One pass over the
    /// slots (two with chains), O(capacity).
    pub(crate) fn propose_lowest_ranked<S: Ord + Copy>(
        &self,
        n: usize,
        ranking: &Ranking<'_>,
        score: impl Fn(usize) -> S,
        out: &mut Vec<SlotId>,
    ) {
        if n == 0 {
            return;
        }
        let class_of = ranking.class_of;
        let Some(chain) = ranking.chain else {
            // `class_of` first: its slot-word load acquires the commit that followed `on_insert`.
            let mut cands: Vec<(u8, S, u32)> = (0..self.capacity())
                .filter_map(|s| {
                    let c = class_of(SlotId(s))?;
                    self.offerable(SlotId(s)).then(|| (c, score(s as usize), s))
                })
                .collect();
            return self.propose_best(n, &mut cands, out);
        };
        // Every offerable slot's score (pinned ones included: they keep their prefix), then each
        // score raised to the best of its subtree, deepest blocks first.
        let cap = self.capacity() as usize;
        let mut eff: Vec<Option<S>> = (0..cap).map(|s| self.offerable(SlotId(s as u32)).then(|| score(s))).collect();
        let order =
            deepest_first((0..cap as u32).filter(|&s| eff[s as usize].is_some()), |s| chain.depth(SlotId(s)), cap);
        for &(_, s) in &order {
            let Some(v) = eff[s as usize] else { continue };
            if let Some(p) = chain.parent(SlotId(s)) {
                if let Some(pv) = eff.get_mut(p.index()).and_then(|e| e.as_mut()) {
                    if *pv < v {
                        *pv = v;
                    }
                }
            }
        }
        let mut cands: Vec<(u8, S, std::cmp::Reverse<u32>, u32)> = order
            .iter()
            .filter_map(|&(d, s)| {
                let c = class_of(SlotId(s))?;
                Some((c, eff[s as usize]?, std::cmp::Reverse(d), s))
            })
            .collect();
        self.propose_best(n, &mut cands, out);
    }

    /// Proposes the `n` smallest of `cands` (whose last field is the slot), smallest first.
    fn propose_best<T: Ord + Copy + LastSlot>(&self, n: usize, cands: &mut Vec<T>, out: &mut Vec<SlotId>) {
        if cands.len() > n {
            cands.select_nth_unstable(n - 1);
            cands.truncate(n);
        }
        cands.sort_unstable();
        for c in cands.iter() {
            let s = SlotId(c.slot());
            // A CAS, not `propose`: two scans running at once (a policy with
            // `concurrent_selection`) may both have picked `s`; the one that loses skips it.
            if self.try_propose(s) {
                out.push(s);
            }
        }
    }
}

/// `(depth, slot)` of `slots`, deepest first (unknown depths, `u32::MAX`, first too; ties by slot
/// id, highest first). A counting sort when the depths are below `4 x cap`, else a comparison sort.
fn deepest_first(slots: impl Iterator<Item = u32>, depth: impl Fn(u32) -> u32, cap: usize) -> Vec<(u32, u32)> {
    let mut v: Vec<(u32, u32)> = slots.map(|s| (depth(s), s)).collect();
    let known_max = v.iter().map(|&(d, _)| d).filter(|&d| d != u32::MAX).max().unwrap_or(0) as usize;
    if known_max >= 4 * cap.max(1) {
        v.sort_unstable_by(|a, b| b.cmp(a));
        return v;
    }
    // Bucket `known_max + 1` holds the unknown depths; buckets are emitted from the highest.
    let key = |d: u32| if d == u32::MAX { known_max + 1 } else { d as usize };
    let mut start = vec![0usize; known_max + 3];
    for &(d, _) in &v {
        start[known_max + 1 - key(d) + 1] += 1;
    }
    for i in 1..start.len() {
        start[i] += start[i - 1];
    }
    let mut out = vec![(0, 0); v.len()];
    // Slots were collected in increasing order; filling each bucket from its end keeps the highest
    // slot first, as the comparison sort does.
    for &(d, s) in v.iter().rev() {
        let b = known_max + 1 - key(d);
        out[start[b]] = (d, s);
        start[b] += 1;
    }
    out
}

/// The slot of a selection candidate tuple (its last field).
trait LastSlot {
    fn slot(&self) -> u32;
}

impl<S> LastSlot for (u8, S, u32) {
    fn slot(&self) -> u32 {
        self.2
    }
}

impl<S> LastSlot for (u8, S, std::cmp::Reverse<u32>, u32) {
    fn slot(&self) -> u32 {
        self.3
    }
}
