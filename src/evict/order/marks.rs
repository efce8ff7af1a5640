//! [`MarkStack`]: the victim order's mark stack, a lock-free multi-producer stack of slots taken
//! whole by one consumer.

use crate::slab::slot::SlotId;
use crate::sync::{AtomicU32, AtomicU8, Ordering};
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

impl std::fmt::Debug for MarkStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MarkStack").field("capacity", &self.next.len()).finish()
    }
}
