//! [`Residency`]: which slots a policy holds, and in which state of the policy contract (see the
//! parent module): `ABSENT`, `RESIDENT`, `PROPOSED`. Every transition is checked; a wrong one is a
//! broken invariant of the tier (it called the policy out of order) and panics with the slot and
//! both states, whichever policy it happened in.

use crate::slot::SlotId;
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
pub struct Residency {
    state: Box<[AtomicU8]>,
}

impl Residency {
    /// Every slot of `0..capacity` absent.
    pub fn new(capacity: u32) -> Self {
        Residency { state: (0..capacity).map(|_| AtomicU8::new(ABSENT)).collect() }
    }

    /// Slots tracked.
    pub fn capacity(&self) -> u32 {
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
    pub fn insert(&self, slot: SlotId) {
        self.transition(slot, ABSENT, RESIDENT, "on_insert");
    }

    /// A selection proposes `slot`: `RESIDENT -> PROPOSED`.
    pub fn propose(&self, slot: SlotId) {
        self.transition(slot, RESIDENT, PROPOSED, "select_victims");
    }

    /// `on_cancel`: `PROPOSED -> RESIDENT`.
    pub fn cancel(&self, slot: SlotId) {
        self.transition(slot, PROPOSED, RESIDENT, "on_cancel");
    }

    /// `on_remove`: `PROPOSED -> ABSENT`.
    pub fn remove(&self, slot: SlotId) {
        self.transition(slot, PROPOSED, ABSENT, "on_remove");
    }

    /// True if `slot` is resident and not proposed: a selection may offer it.
    #[inline]
    pub fn offerable(&self, slot: SlotId) -> bool {
        self.state[slot.index()].load(Ordering::Relaxed) == RESIDENT
    }

    /// True if `slot` is proposed (a claim is pending).
    #[inline]
    pub fn is_proposed(&self, slot: SlotId) -> bool {
        self.state[slot.index()].load(Ordering::Relaxed) == PROPOSED
    }

    /// Resident slots (proposed ones included); for tests and reports.
    pub fn resident(&self) -> usize {
        self.state.iter().filter(|s| s.load(Ordering::Relaxed) != ABSENT).count()
    }
}

impl std::fmt::Debug for Residency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Residency").field("capacity", &self.capacity()).field("resident", &self.resident()).finish()
    }
}

impl Residency {
    /// The selection of the scan-based policies (LRU, prefix-LFU): proposes the `n` offerable,
    /// evictable slots with the lowest `score`, lowest first (ties by slot id). O(capacity).
    pub fn propose_lowest<S: Ord + Copy>(
        &self,
        n: usize,
        evictable: &dyn Fn(SlotId) -> bool,
        score: impl Fn(usize) -> S,
        out: &mut Vec<SlotId>,
    ) {
        if n == 0 {
            return;
        }
        // `evictable` first: its slot-word load acquires the commit that followed `on_insert`.
        let mut cands: Vec<(S, u32)> = (0..self.capacity())
            .filter(|&s| evictable(SlotId(s)) && self.offerable(SlotId(s)))
            .map(|s| (score(s as usize), s))
            .collect();
        if cands.len() > n {
            cands.select_nth_unstable(n - 1);
            cands.truncate(n);
        }
        cands.sort_unstable();
        for (_, s) in cands {
            self.propose(SlotId(s));
            out.push(SlotId(s));
        }
    }
}
