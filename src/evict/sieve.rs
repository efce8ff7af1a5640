//! SIEVE (see [`super::PolicyKind::Sieve`]).

use super::queue::{Fifo, InsertLog, NIL};
use super::{EvictionPolicy, InsertInfo, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU8, Mutex, Ordering};

/// SIEVE: one insertion-ordered queue, a visited byte per slot set by hits (lock-free), and a hand
/// that walks from the oldest block towards the newest. Inserts go through the lock-free
/// insert log; the queue and the hand are private to the selector. A proposed block stays in
/// place (skipped by the hand) until the tier cancels the proposal (it is offered again from where
/// it stands) or removes it (it is unlinked).
pub(crate) struct Sieve {
    visited: Box<[AtomicU8]>,
    residency: Residency,
    log: InsertLog,
    state: Mutex<SieveState>,
}

struct SieveState {
    queue: Fifo,
    hand: u32,
    log_head: u64,
}

impl Sieve {
    /// A SIEVE for `capacity` slots.
    pub(crate) fn new(capacity: u32) -> Self {
        Sieve {
            visited: crate::sync::table(capacity as usize, |_| AtomicU8::new(0)),
            residency: Residency::new(capacity),
            log: InsertLog::new(capacity),
            state: Mutex::new(SieveState { queue: Fifo::new(capacity), hand: NIL, log_head: 0 }),
        }
    }
}

impl Sieve {
    /// Two laps from the hand: the first may only clear visited bytes, the second offers every
    /// block still unvisited; proposed and pinned blocks are passed over in place. Returns how many
    /// it proposed (at most `n`).
    fn walk(&self, st: &mut SieveState, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) -> usize {
        let mut found = 0;
        let mut steps = 2 * st.queue.len;
        while found < n && steps > 0 {
            steps -= 1;
            let s = if st.hand == NIL || !st.queue.contains(st.hand) { st.queue.oldest } else { st.hand };
            st.hand = st.queue.newer(s);
            let slot = SlotId(s);
            if !evictable(slot) || !self.residency.offerable(slot) {
                continue;
            }
            if self.visited[s as usize].swap(0, Ordering::Relaxed) != 0 {
                continue;
            }
            self.residency.propose(slot);
            out.push(slot);
            found += 1;
        }
        found
    }
}

impl EvictionPolicy for Sieve {
    fn name(&self) -> &'static str {
        "sieve"
    }
    fn on_insert(&self, slot: SlotId, _info: InsertInfo) {
        self.visited[slot.index()].store(0, Ordering::Relaxed);
        self.residency.insert(slot);
        self.log.push(slot);
    }
    fn prefetch(&self, slot: SlotId, _key_hash: u64) {
        crate::sync::prefetch_read(&self.visited[slot.index()]);
        self.residency.prefetch(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        let v = &self.visited[slot.index()];
        if v.load(Ordering::Relaxed) == 0 {
            v.store(1, Ordering::Relaxed);
        }
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        let mut guard = crate::sync::lock(&self.state);
        let st = &mut *guard;
        let residency = &self.residency;
        // A logged slot is queued unless it already is (found by a recovery) or is no longer
        // resident (recovered, then evicted).
        let unqueued = |q: &Fifo, s: u32| residency.offerable(SlotId(s)) && !q.contains(s);
        self.log.drain(&mut st.log_head, |s| {
            if unqueued(&st.queue, s) {
                st.queue.push_newest(s);
            }
        });
        let mut found = self.walk(st, n, evictable, out);
        if found < n && self.log.behind(st.log_head) {
            let queue = &mut st.queue;
            let mut missed = Vec::new();
            self.log.recover(residency.capacity(), |s| unqueued(queue, s), |s| missed.push(s));
            if !missed.is_empty() {
                for s in missed {
                    queue.push_newest(s);
                }
                found += self.walk(st, n - found, evictable, out);
            }
        }
        let _ = found;
    }
    fn on_cancel(&self, slot: SlotId) {
        self.residency.cancel(slot);
    }
    fn on_remove(&self, slot: SlotId) {
        let mut st = crate::sync::lock(&self.state);
        self.residency.remove(slot);
        if st.hand == slot.0 {
            st.hand = st.queue.newer(slot.0);
        }
        st.queue.unlink(slot.0);
    }
}

impl std::fmt::Debug for Sieve {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sieve").field("residency", &self.residency).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::contract_tests::select_and_evict;
    use super::*;

    fn info(h: u64) -> InsertInfo {
        InsertInfo::new(h, None)
    }

    #[test]
    fn evicts_unvisited_in_place_and_keeps_its_hand() {
        let p = Sieve::new(4);
        for s in 0..4 {
            p.on_insert(SlotId(s), info(s as u64));
        }
        p.on_hit(SlotId(0));
        p.on_hit(SlotId(2));
        // Hand at the oldest (0): visited, cleared; 1 is evicted.
        assert_eq!(select_and_evict(&p, 1, &|_| true), vec![SlotId(1)]);
        // The hand continues at 2 (visited, cleared), evicts 3, wraps to 0 (cleared before).
        assert_eq!(select_and_evict(&p, 2, &|_| true), vec![SlotId(3), SlotId(0)]);
        assert_eq!(select_and_evict(&p, 5, &|_| true), vec![SlotId(2)]);
    }

    #[test]
    fn a_cancelled_proposal_is_offered_again_in_place() {
        let p = Sieve::new(3);
        for s in 0..3 {
            p.on_insert(SlotId(s), info(s as u64));
        }
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(0)]);
        p.on_cancel(SlotId(0));
        // The hand moved past 0; it wraps back to it after 1 and 2.
        assert_eq!(select_and_evict(&p, 3, &|_| true), vec![SlotId(1), SlotId(2), SlotId(0)]);
    }

    /// Issue 19 item 10: a commit half-way into the insert log (its position claimed, not yet
    /// written) must not hide a block committed after it: the selection recovers it. Seeded bug
    /// `insert-log-hole`.
    #[test]
    fn a_commit_half_way_into_the_log_does_not_hide_a_later_one() {
        let p = Sieve::new(4);
        p.on_insert(SlotId(0), info(0));
        // Another rank's commit of slot 1: resident, its log position claimed but not written.
        p.residency.insert(SlotId(1));
        let hole = p.log.claim_unwritten();
        p.on_insert(SlotId(2), info(2));
        let ready = |s: SlotId| s.0 != 1; // slot 1 is not ready yet
        assert_eq!(select_and_evict(&p, 2, &ready), vec![SlotId(0), SlotId(2)], "the block behind the hole is offered");
        // The late write lands: slot 1 is queued once, and nothing is queued twice.
        p.log.write_at(hole, SlotId(1));
        assert_eq!(select_and_evict(&p, 4, &|_| true), vec![SlotId(1)]);
    }
}
