//! CLOCK / second chance (see [`super::PolicyKind::Clock`]).

use super::{EvictionPolicy, InsertInfo, Residency};
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU8, AtomicUsize, Ordering};

/// CLOCK over the slot array: a hit sets a reference byte (lock-free); the hand clears set bytes and
/// proposes slots whose byte is clear. Two laps visit every slot twice, so every offerable,
/// evictable slot is reachable in one selection.
pub(crate) struct Clock {
    referenced: Box<[AtomicU8]>,
    hand: AtomicUsize,
    residency: Residency,
}

impl Clock {
    /// A CLOCK for `capacity` slots.
    pub(crate) fn new(capacity: u32) -> Self {
        Clock {
            referenced: crate::sync::table(capacity as usize, |_| AtomicU8::new(0)),
            hand: AtomicUsize::new(0),
            residency: Residency::new(capacity),
        }
    }
}

impl EvictionPolicy for Clock {
    fn name(&self) -> &'static str {
        "clock"
    }
    fn on_insert(&self, slot: SlotId, _info: InsertInfo) {
        self.referenced[slot.index()].store(0, Ordering::Relaxed);
        self.residency.insert(slot);
    }
    fn prefetch(&self, slot: SlotId, _key_hash: u64) {
        crate::sync::prefetch_read(&self.referenced[slot.index()]);
        self.residency.prefetch(slot);
    }
    fn on_hit(&self, slot: SlotId) {
        self.referenced[slot.index()].store(1, Ordering::Relaxed);
    }
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>) {
        let cap = self.referenced.len();
        if cap == 0 || n == 0 {
            return;
        }
        let mut hand = self.hand.load(Ordering::Relaxed) % cap;
        let mut found = 0;
        // Two full laps: the first may only clear reference bytes.
        for _ in 0..2 * cap {
            let s = SlotId(hand as u32);
            hand = (hand + 1) % cap;
            if !evictable(s) || !self.residency.offerable(s) {
                continue;
            }
            if self.referenced[s.index()].swap(0, Ordering::Relaxed) != 0 {
                continue;
            }
            self.residency.propose(s);
            out.push(s);
            found += 1;
            if found == n {
                break;
            }
        }
        self.hand.store(hand, Ordering::Relaxed);
    }
    fn on_cancel(&self, slot: SlotId) {
        self.residency.cancel(slot);
    }
    fn on_remove(&self, slot: SlotId) {
        self.referenced[slot.index()].store(0, Ordering::Relaxed);
        self.residency.remove(slot);
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Clock").field("residency", &self.residency).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn gives_a_second_chance() {
        let p = Clock::new(3);
        for s in 0..3 {
            p.on_insert(SlotId(s), InsertInfo::default());
        }
        p.on_hit(SlotId(0));
        let mut out = vec![];
        p.select_victims(1, &|_| true, &mut out);
        assert_eq!(out, vec![SlotId(1)]);
        p.on_remove(SlotId(1));
        out.clear();
        p.select_victims(2, &|s| s != SlotId(2), &mut out);
        assert_eq!(out, vec![SlotId(0)], "slot 0's byte was cleared by the first sweep; slot 1 is gone");
    }
}
