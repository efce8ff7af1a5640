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
use crate::slot::{PinError, SlotId};
use crate::sync::Arc;
use crate::tier::Core;

/// One pin on each slot of a set (see the module docs).
pub struct SlotPins {
    core: Arc<Core>,
    slots: Vec<SlotId>,
}

impl SlotPins {
    /// Pins every `(slot, generation)` of `refs`, in order. On the first failure the pins already
    /// taken are dropped and `(index, why)` is returned.
    pub(crate) fn take(core: &Arc<Core>, refs: impl IntoIterator<Item = SlotRef>) -> Result<Self, (usize, PinError)> {
        let mut pins = SlotPins { core: core.clone(), slots: Vec::new() };
        for (i, r) in refs.into_iter().enumerate() {
            core.pin(r.slot, r.generation).map_err(|e| (i, e))?;
            pins.slots.push(r.slot);
        }
        Ok(pins)
    }

    /// An empty set whose slots are added with [`SlotPins::push_pinned`].
    pub(crate) fn empty(core: &Arc<Core>) -> Self {
        SlotPins { core: core.clone(), slots: Vec::new() }
    }

    /// Adds a slot the caller has already pinned; this set now owns that pin.
    pub(crate) fn push_pinned(&mut self, slot: SlotId) {
        self.slots.push(slot);
    }

    /// Gives up ownership of the pins without dropping them; the caller must unpin each returned
    /// slot exactly once (the lease does, when it settles).
    pub(crate) fn into_raw(mut self) -> Vec<SlotId> {
        std::mem::take(&mut self.slots)
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

/// A reserved, not yet visible block: key, slot and the generation recorded in the index.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Reserved {
    pub key: ContentKey,
    pub slot: SlotId,
    pub generation: u64,
}

/// A save's reserved slots (see the module docs).
pub struct WriteReservation {
    core: Arc<Core>,
    entries: Vec<Reserved>,
}

impl WriteReservation {
    pub(crate) fn new(core: &Arc<Core>) -> Self {
        WriteReservation { core: core.clone(), entries: Vec::new() }
    }

    pub(crate) fn push(&mut self, r: Reserved) {
        self.entries.push(r);
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
        for r in std::mem::take(&mut self.entries) {
            self.core.commit_reserved(r);
        }
    }
}

impl Drop for WriteReservation {
    fn drop(&mut self) {
        for r in std::mem::take(&mut self.entries) {
            self.core.abort_reserved(r);
        }
    }
}
