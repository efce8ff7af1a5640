//! [`SsdModel`]: the SSD tier's disk directory and admission without files, for simulators.
//!
//! `kvtier simulate --ssd` drives this instead of modelling the drive itself, so its hit ratios are
//! those of the tier's own victim order (the disk directory's recency list, whatever the host
//! policy) and of its own admission ([`Admission`], fixed or [`SsdAdmit::Auto`]).
//!
//! The host tier a simulator builds with `HostTier::over_ssd_model` has the model as its lower tier,
//! as a tier with an SSD tier has the SSD tier: the model marks the host blocks it holds a copy of
//! (written by [`SsdModel::demote`], or promoted: [`SsdModel::mark_host_copy`]) with the SSD tier's
//! own marks, and the host's victim selection (the core's, unchanged) takes those clean blocks
//! before the dirty ones, as it does over a real drive.

use super::admit::{Admission, SsdAdmit};
use super::directory::DiskSlots;
use super::take_disk_slot;
use super::CleanMarks;
use crate::key::ContentKey;
use crate::slab::slot::SlotId;
use crate::tier::core::{Core, LowerTier};
use crate::tier::expiry::LeasedBlock;
use std::sync::Arc;

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
    /// The marks of the last [`SsdModel::lower_tier`], if any.
    marks: Option<Arc<CleanMarks>>,
    /// The core of the host tier built over them and the marks its core reads, if any.
    host: Option<(Arc<Core>, Arc<CleanMarks>)>,
}

/// The lower tier of a host tier built over the model (`HostTier::over_ssd_model`): the model's clean marks. Its
/// hooks only keep the marks (a reserved slot holds a new, dirty block); the simulator counts a
/// block's uses and promotes by saving, itself.
struct ModelLower(Arc<CleanMarks>);

impl std::fmt::Debug for ModelLower {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ModelLower")
    }
}

impl LowerTier for ModelLower {
    fn on_reserve(&self, slot: SlotId) {
        self.0.clear(slot);
    }
    fn on_commit(&self, _slot: SlotId, _generation: u64, _key: ContentKey) {}
    fn on_hit(&self, _slot: SlotId, _generation: u64, _key: ContentKey) {}
    fn is_clean(&self, slot: SlotId, generation: u64) -> bool {
        self.0.is_clean(slot, generation)
    }
    fn promote(&self, _core: &Arc<Core>, _keys: &[ContentKey], _blocks: &mut Vec<LeasedBlock>) -> usize {
        0
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
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
        SsdModel { slots, admission: Admission::new(admit, disk_slots), evictions: 0, marks: None, host: None }
    }

    /// The lower tier of a host tier over this drive (`HostTier::over_ssd_model`) of `host_slots`
    /// slots: fresh clean marks, which the model keeps from then on (a later call replaces them).
    pub(crate) fn lower_tier(&mut self, host_slots: u32) -> Box<dyn LowerTier> {
        let marks = Arc::new(CleanMarks::new(host_slots));
        self.marks = Some(marks.clone());
        self.host = None;
        Box::new(ModelLower(marks))
    }

    /// The core of the host tier built over [`SsdModel::lower_tier`]'s lower tier.
    pub(crate) fn set_host(&mut self, core: Arc<Core>) {
        self.host = self.marks.clone().map(|m| (core, m));
    }

    /// Records that the host block of `key` (of the tier built over the model) has a copy
    /// on the drive, as a promotion's commit and the demotion thread do: the host's policy
    /// re-places it among the clean blocks. Returns false if there is no such tier, the host
    /// does not hold `key`, or the drive does not.
    pub fn mark_host_copy(&self, key: &ContentKey) -> bool {
        let Some((core, marks)) = &self.host else { return false };
        // Seeded bug (tests only): the host never learns of the drive's copies (its victims are
        // the host-only run's).
        if crate::seeded::seeded("sim-ssd-host-unmarked") || !self.slots.contains(key) {
            return false;
        }
        let Some(r) = core.find_block(key) else { return false };
        // As the tier: a block marked already is not demoted again, nor re-placed.
        if !marks.is_clean(r.slot, r.generation) {
            marks.mark(r.slot, r.generation);
            core.policy.on_reclass(r.slot);
        }
        true
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
    /// recently used block when the drive is full, which the admission learns of). With a host
    /// tier over the model, its block of `key` is marked clean (also when the drive
    /// held `key` already), and a host block whose copy was evicted is dirty again.
    pub fn demote(&mut self, key: &ContentKey) -> Demotion {
        if self.slots.contains(key) {
            self.mark_host_copy(key);
            return Demotion::Present;
        }
        let Some((d, evicted)) = take_disk_slot(&self.slots, &self.admission, key) else {
            return Demotion::Dropped;
        };
        if let Some(old) = evicted {
            self.evictions += 1;
            if let Some((core, marks)) = &self.host {
                marks.forget(core, &old);
            }
        }
        let written = self.slots.commit(d, *key);
        debug_assert!(written, "the model's key was absent a moment ago");
        self.mark_host_copy(key);
        Demotion::Written(evicted)
    }

    /// Blocks evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }
}
