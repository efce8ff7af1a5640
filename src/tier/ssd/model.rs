//! [`SsdModel`]: the SSD tier's disk directory and admission without files, for simulators.
//!
//! `kvtier simulate --ssd` drives this instead of modelling the drive itself, so its hit ratios are
//! those of the tier's own victim order (the disk directory's recency list, whatever the host
//! policy) and of its own admission ([`Admission`], fixed or [`SsdAdmit::Auto`]).

use super::admit::{Admission, SsdAdmit};
use super::directory::DiskSlots;
use super::take_disk_slot;
use crate::key::ContentKey;

/// What [`SsdModel::demote`] did with a block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Demotion {
    /// Written to a disk slot; the block of the key given was evicted for it, if any.
    Written(Option<ContentKey>),
    /// The drive holds the key already (nothing written).
    Present,
    /// Every disk slot was pinned or being written (the tier drops such a demotion).
    Dropped,
}

/// An SSD tier of `capacity` disk slots without files: the tier's disk directory
/// (`DiskSlots`, reached through `kvtier::internals`: slot words, index, recency list) and its
/// [`Admission`].
/// Blocks have no bytes; a promotion is a hit.
pub struct SsdModel {
    slots: DiskSlots,
    admission: Admission,
    evictions: u64,
}

impl std::fmt::Debug for SsdModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SsdModel")
            .field("capacity", &self.capacity())
            .field("blocks", &self.slots.len())
            .field("admission", &self.admission)
            .field("evictions", &self.evictions)
            .finish()
    }
}

impl SsdModel {
    /// A drive of `disk_slots` slots (at least 1) admitting by `admit`.
    pub fn new(disk_slots: u32, admit: SsdAdmit) -> Self {
        let (slots, _) = DiskSlots::new(disk_slots.max(1), &[]);
        SsdModel { slots, admission: Admission::new(admit, disk_slots), evictions: 0 }
    }

    /// Disk slots.
    pub fn capacity(&self) -> u32 {
        self.slots.capacity()
    }

    /// The admission (rule, current threshold), shared with the tier's code.
    pub fn admission(&self) -> &Admission {
        &self.admission
    }

    /// True if the drive holds `key`.
    pub fn contains(&self, key: &ContentKey) -> bool {
        self.slots.contains(key)
    }

    /// The leading run of `keys` the drive holds, each made the most recently used, as a
    /// promotion that reads them does. Returns its length in blocks.
    pub fn promote(&self, keys: &[ContentKey]) -> usize {
        let mut n = 0;
        for k in keys {
            let Some(d) = self.slots.pin(k) else { break };
            self.slots.unpin(d, true);
            n += 1;
        }
        n
    }

    /// Writes the block of `key` to a disk slot as the demotion thread does (evicting the least
    /// recently used block when the drive is full, which the admission learns of).
    pub fn demote(&mut self, key: &ContentKey) -> Demotion {
        if self.slots.contains(key) {
            return Demotion::Present;
        }
        let Some((d, evicted)) = take_disk_slot(&self.slots, &self.admission, key) else {
            return Demotion::Dropped;
        };
        if evicted.is_some() {
            self.evictions += 1;
        }
        let written = self.slots.commit(d, *key);
        debug_assert!(written, "the model's key was absent a moment ago");
        Demotion::Written(evicted)
    }

    /// Blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}
