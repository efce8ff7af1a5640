//! Guards: RAII ownership of slots held by in-flight copies and by leases.
//!
//! - [`SlotPins`]: one pin on each of a set of `READY` slots. Leases hold one; every restore takes
//!   its own for the duration of its copy, so a lease that is released or dropped while its copy is
//!   in flight never lets the slot be evicted under the copy. Dropping it unpins.
//! - [`WriteReservation`]: a save's `WRITING` slots and their index entries. `commit` publishes
//!   them (`WRITING -> READY`) after the copy completed; dropping it uncommitted (copy failed, save
//!   abandoned) removes the index entries *first*, then bumps the generation and frees the slots, so
//!   no entry ever names a free or reused slot with a matching generation.

use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::slab::slot::{PinError, SlotId};
use crate::sync::Arc;
use crate::tier::core::{Core, Reserved};

/// One pin on each slot of a set (see the module docs).
#[derive(Debug)]
pub struct SlotPins {
    core: Arc<Core>,
    slots: Vec<SlotId>,
}

impl SlotPins {
    /// Pins every `(slot, generation)` of `refs`, in order. On the first failure the pins already
    /// taken are dropped and `(index, why)` is returned.
    ///
    /// A restore takes its pins through [`crate::Lease`]'s restore claim, which calls this.
    pub fn take(core: &Arc<Core>, refs: impl IntoIterator<Item = SlotRef>) -> Result<Self, (usize, PinError)> {
        let mut pins = SlotPins { core: core.clone(), slots: Vec::new() };
        for (i, r) in refs.into_iter().enumerate() {
            // Seeded bug (model checking only): the guard "borrows" the lease's pin instead of taking
            // its own, so a lease settled while its copy is in flight lets the slot be evicted.
            if crate::seeded::seeded("guard-borrows-lease-pin") {
                let w = core.pool().control().load(r.slot);
                if w.generation() != r.generation || w.state() != crate::slab::slot::SlotState::Ready {
                    return Err((i, PinError::Stale));
                }
                continue;
            }
            core.pin(r.slot, r.generation).map_err(|e| (i, e))?;
            pins.slots.push(r.slot);
        }
        Ok(pins)
    }

    /// Keeps these pins for good (never unpinned): for slots a copy may still be reading after
    /// its outcome became unknown (counted in [`crate::TierStats::quarantined_slots`]).
    pub(crate) fn quarantine(mut self) {
        self.core.record_quarantined_pins(self.slots.len());
        self.slots.clear();
    }

    /// The pinned slots, in order.
    pub fn slots(&self) -> &[SlotId] {
        &self.slots
    }

    /// Number of pins held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// True when no pin is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }
}

impl Drop for SlotPins {
    fn drop(&mut self) {
        for &s in &self.slots {
            self.core.unpin(s);
        }
    }
}

/// A save's reserved slots (see the module docs).
#[derive(Debug)]
pub struct WriteReservation {
    core: Arc<Core>,
    entries: Vec<Reserved>,
}

impl WriteReservation {
    /// An empty reservation.
    pub fn new(core: &Arc<Core>) -> Self {
        WriteReservation { core: core.clone(), entries: Vec::new() }
    }

    /// Reserves `slot` (owned by the caller: fresh from the free list or from eviction) for `key`
    /// at prompt `depth` (`u32::MAX`: unknown) and adds it to this reservation. Returns false, with
    /// the slot back on the free list, if another save holds `key`'s index entry.
    pub fn reserve(&mut self, key: ContentKey, slot: SlotId, depth: u32) -> bool {
        self.reserve_at(key, slot, depth, u32::MAX)
    }

    /// [`WriteReservation::reserve`] for a block of a save that began at prompt depth `resumed`
    /// (`u32::MAX`: unknown; see [`crate::evict::InsertInfo::resumed_at`]).
    pub fn reserve_at(&mut self, key: ContentKey, slot: SlotId, depth: u32, resumed: u32) -> bool {
        match self.core.reserve_slot_at(key, slot, depth, resumed) {
            Some(r) => {
                self.entries.push(r);
                true
            }
            None => false,
        }
    }

    /// The reserved blocks, in reservation order.
    pub fn entries(&self) -> &[Reserved] {
        &self.entries
    }

    /// Number of reserved slots.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing is reserved.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Publishes every reserved block (`WRITING -> READY`): they become visible to queries and
    /// evictable. Call only after the copy into the slots has completed.
    pub fn commit(mut self) {
        // Start every block's policy state loading first, so the batch's cache misses overlap.
        for r in &self.entries {
            self.core.policy.prefetch(r.slot, r.key.hash64());
        }
        for r in std::mem::take(&mut self.entries) {
            self.core.commit_reserved(r);
        }
        // Seeded bug (tests only): `commit-files-nothing` leaves the blocks to the next selection.
        if !crate::seeded::seeded("commit-files-nothing") {
            self.core.file_pending();
        }
    }
}

impl WriteReservation {
    /// Publishes the first `n` reserved blocks `READY` with one pin each, held by the caller (a
    /// promotion's lease), calling `before` on each just before it becomes visible; the rest are
    /// aborted (index entries first). Returns the published blocks.
    pub fn commit_leading_pinned(mut self, n: usize, mut before: impl FnMut(&Reserved)) -> Vec<Reserved> {
        let mut entries = std::mem::take(&mut self.entries);
        let rest = entries.split_off(n.min(entries.len()));
        for r in &entries {
            before(r);
            // Seeded bug (model checking only): the old order, commit then pin, leaves a window in
            // which an evictor takes the block before its lease holds it.
            if crate::seeded::seeded("promotion-commit-unpinned") {
                self.core.commit_reserved(*r);
                let _ = self.core.pin(r.slot, r.generation);
                continue;
            }
            self.core.commit_reserved_pinned(*r);
        }
        for r in rest {
            self.core.abort_reserved(r);
        }
        entries
    }
}

impl WriteReservation {
    /// Withholds every reserved slot for good (the copy's outcome is unknown): the index entries
    /// go, the slots stay `WRITING` and are never reused.
    pub(crate) fn quarantine(mut self) {
        for r in std::mem::take(&mut self.entries) {
            self.core.quarantine_reserved(r);
        }
    }

    /// [`WriteReservation::quarantine`], returning the quarantined blocks for
    /// [`Core::release_quarantined`] once their copy is known to have stopped.
    #[cfg(all(feature = "peers", not(loom)))]
    pub(crate) fn quarantine_entries(mut self) -> Vec<Reserved> {
        let entries = std::mem::take(&mut self.entries);
        for r in &entries {
            self.core.quarantine_reserved(*r);
        }
        entries
    }
}

impl Drop for WriteReservation {
    fn drop(&mut self) {
        for r in std::mem::take(&mut self.entries) {
            self.core.abort_reserved(r);
        }
    }
}
