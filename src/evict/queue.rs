//! Queue building blocks of the FIFO-family policies (SIEVE, S3-FIFO): a lock-free log of inserts
//! that the selector drains, and an intrusive doubly linked FIFO over slot ids.

use crate::slab::slot::SlotId;
use crate::sync::{AtomicU64, Ordering};

/// `u32::MAX`: no slot (end of a queue).
pub(crate) const NIL: u32 = u32::MAX;

/// A lock-free multi-producer log of slots that became ready, drained in order by the (single)
/// victim selector. Entry `p` lives at `ring[p % len]` as `(p as u32) << 32 | slot`; the consumer
/// takes entry `head` only once its position tag matches, so a producer that has claimed a position
/// but not yet written it simply ends the drain early (its slot is offered from the next selection
/// on).
///
/// Bound: an entry stays unconsumed only while its slot is resident and not yet in a queue, so that
/// slot cannot be proposed, evicted and inserted again: at most `capacity` entries are ever pending,
/// and `len = 2 x capacity` (rounded up to a power of two) positions never overwrite one.
pub(crate) struct InsertLog {
    ring: Box<[AtomicU64]>,
    mask: u64,
    tail: AtomicU64,
}

impl InsertLog {
    pub(crate) fn new(capacity: u32) -> Self {
        let len = (2 * capacity.max(1) as u64).next_power_of_two();
        // Initial tags are one lap behind every position, so no entry looks written.
        let ring = (0..len).map(|i| AtomicU64::new((i.wrapping_sub(len) as u32 as u64) << 32)).collect();
        InsertLog { ring, mask: len - 1, tail: AtomicU64::new(0) }
    }

    /// Claims the next position without writing it: a producer stopped between its claim and its
    /// write, for tests of the drain.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn claim_unwritten(&self) -> u64 {
        self.tail.fetch_add(1, Ordering::Relaxed)
    }

    /// Writes `slot` at position `p` claimed by [`InsertLog::claim_unwritten`] (the stopped
    /// producer resumes), for tests.
    #[cfg(all(test, not(loom)))]
    pub(crate) fn write_at(&self, p: u64, slot: SlotId) {
        self.ring[(p & self.mask) as usize].store(((p as u32 as u64) << 32) | slot.0 as u64, Ordering::Release);
    }

    /// Appends `slot` (lock-free; any thread).
    pub(crate) fn push(&self, slot: SlotId) {
        let p = self.tail.fetch_add(1, Ordering::Relaxed);
        // Release: the per-slot state written before the push is visible to the drain.
        self.ring[(p & self.mask) as usize].store(((p as u32 as u64) << 32) | slot.0 as u64, Ordering::Release);
    }

    /// True if entries from `head` on have been claimed by producers: some may be written behind
    /// one that is not yet (its producer is between its claim and its write), so [`InsertLog::drain`]
    /// stopped short of them. The selector then recovers them from the policy's residency
    /// ([`InsertLog::recover`]).
    pub(crate) fn behind(&self, head: u64) -> bool {
        self.tail.load(Ordering::Acquire) != head
    }

    /// Offers `f` every slot of `0..capacity` that `resident_unqueued` accepts: the recovery of a
    /// selection that found too few victims while the log was [`InsertLog::behind`]. Each
    /// insertion makes its slot resident *before* it is logged, and the slot's block becomes
    /// evictable only after, so every committed block the drain could not reach is found here.
    /// Entries drained later name slots already queued, which the drain's caller skips. O(capacity),
    /// and only when a selection falls short.
    pub(crate) fn recover(&self, capacity: u32, resident_unqueued: impl Fn(u32) -> bool, mut f: impl FnMut(u32)) {
        // Seeded bug (model checking only): no recovery, a committed block written behind a
        // producer that has not written yet is not offered.
        if crate::seeded::seeded("insert-log-hole") {
            return;
        }
        for s in 0..capacity {
            if resident_unqueued(s) {
                f(s);
            }
        }
    }

    /// Calls `f` for every entry from `*head` on that has been written, advancing `*head`
    /// (the selector only).
    pub(crate) fn drain(&self, head: &mut u64, mut f: impl FnMut(u32)) {
        loop {
            let e = self.ring[(*head & self.mask) as usize].load(Ordering::Acquire);
            if (e >> 32) as u32 != *head as u32 {
                return;
            }
            f(e as u32);
            *head += 1;
        }
    }
}

/// An intrusive doubly linked FIFO over slot ids (selector-private). Queuing a slot twice or
/// unlinking one that is not queued panics: either would corrupt the links.
pub(crate) struct Fifo {
    newer: Vec<u32>,
    older: Vec<u32>,
    member: Vec<bool>,
    pub(crate) newest: u32,
    pub(crate) oldest: u32,
    pub(crate) len: usize,
}

impl Fifo {
    pub(crate) fn new(capacity: u32) -> Self {
        let c = capacity as usize;
        Fifo {
            newer: vec![NIL; c],
            older: vec![NIL; c],
            member: crate::sync::table(c, |_| false).into_vec(),
            newest: NIL,
            oldest: NIL,
            len: 0,
        }
    }

    /// True if `s` is queued here.
    pub(crate) fn contains(&self, s: u32) -> bool {
        self.member[s as usize]
    }

    /// The next newer slot after `s` (NIL at the newest end).
    pub(crate) fn newer(&self, s: u32) -> u32 {
        self.newer[s as usize]
    }

    pub(crate) fn push_newest(&mut self, s: u32) {
        let i = s as usize;
        assert!(!self.member[i], "eviction queue corrupted: slot {s} queued twice");
        self.older[i] = self.newest;
        self.newer[i] = NIL;
        if self.newest != NIL {
            self.newer[self.newest as usize] = s;
        } else {
            self.oldest = s;
        }
        self.newest = s;
        self.member[i] = true;
        self.len += 1;
    }

    pub(crate) fn unlink(&mut self, s: u32) {
        let i = s as usize;
        assert!(self.member[i], "eviction queue corrupted: slot {s} unlinked but not queued");
        let (o, n) = (self.older[i], self.newer[i]);
        if o != NIL {
            self.newer[o as usize] = n;
        } else {
            self.oldest = n;
        }
        if n != NIL {
            self.older[n as usize] = o;
        } else {
            self.newest = o;
        }
        self.member[i] = false;
        self.len -= 1;
    }

    pub(crate) fn pop_oldest(&mut self) -> Option<u32> {
        let s = self.oldest;
        (s != NIL).then(|| {
            self.unlink(s);
            s
        })
    }
}
