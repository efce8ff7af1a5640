//! Chain-aware victims: which resident blocks continue which, so eviction takes a chain from its
//! tail and drops orphaned suffixes first ([`crate::TierConfig::chain_aware`]).
//!
//! A query restores only the leading run of resident blocks, so a block whose predecessor in its
//! prompt is gone is worth nothing until that predecessor is saved again (an **orphan**), and evicting
//! a chain's head wastes every block after it. The tier records, per slot:
//!
//! - a **parent link**: the `(slot, generation)` of the block before it in its prompt, set when a
//!   save that knows its keys form a chain ([`crate::SaveOptions::prefix_depth`] or
//!   [`crate::SaveOptions::parent`]) reserves the block, or finds it resident with its link dead
//!   (the prefix was evicted and is being saved again: the suffix is re-attached);
//! - a **resident-children count**, tagged with the slot's generation: how many blocks link to it.
//!
//! At selection the tier puts each unpinned ready block in one of two classes: **orphans** (the
//! parent's slot no longer holds the linked generation) first, then the rest; and passes them to
//! the policy ([`crate::evict::EvictionPolicy::select_ranked`]), which orders the rest by its own
//! order weighed by the chains' subtree scores ([`crate::evict::Ranking::chain`]: a chain goes from
//! its tail). [`ChainClass`] names where a block stands (orphan, leaf, interior) for audits and
//! models; leaves and interior blocks share one class. The last class holds everything, so
//! liveness is the policy's own.
//!
//! Concurrency: a link is only written for a block the writer owns (`WRITING`, reserved by its save)
//! or pins (resident, pinned by its save's plan), by one CAS, and the parent's count is incremented
//! only by the CAS winner and only while the count's tag matches the parent's generation; a block
//! that leaves (evicted under the eviction lock, aborted, quarantined) takes its link back by a swap
//! and decrements the count under the same tag check. A stale tag means the parent slot was reused:
//! the count then belongs to the new block and is left alone. Every mistake a race could still make
//! (a count read mid-update) changes only the preference, never what may be evicted.

use crate::index::SlotRef;
use crate::slab::slot::{SlotControl, SlotId};
use crate::sync::{AtomicU64, Ordering};

/// No parent link.
const NONE: u64 = u64::MAX;

/// A link (or a count's tag) names a generation by its low 32 bits: a slot would have to be reused
/// 2^32 times between a link and its check for a stale one to look live, and even that would only
/// change a preference.
#[inline]
fn tag(generation: u64) -> u64 {
    generation & 0xffff_ffff
}

#[inline]
fn pack(r: SlotRef) -> u64 {
    (tag(r.generation) << 32) | r.slot.0 as u64
}

/// Where a block stands in its chain (lower is evicted first).
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum ChainClass {
    /// Its parent was evicted: no query can reach it.
    Orphan = 0,
    /// Nothing resident links to it: the deepest block of its chain.
    Leaf = 1,
    /// A resident block continues it.
    Interior = 2,
}

/// Preference classes chain-awareness adds: orphans, then the rest (leaves and interior blocks
/// are ordered by the policy's subtree scores, see [`crate::evict::Ranking::chain`]).
pub(crate) const CHAIN_CLASSES: u8 = 2;

/// Parent links and resident-children counts of every slot (see the module docs).
pub(crate) struct Chains {
    /// `tag(parent generation) << 32 | parent slot`, or [`NONE`].
    parent: Box<[AtomicU64]>,
    /// `tag(own generation) << 32 | resident children`.
    children: Box<[AtomicU64]>,
}

impl Chains {
    pub(crate) fn new(capacity: u32) -> Self {
        Chains {
            parent: (0..capacity).map(|_| AtomicU64::new(NONE)).collect(),
            children: (0..capacity).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// `slot` was just reserved with `generation` (its owner's): no parent, no children.
    pub(crate) fn reset(&self, slot: SlotId, generation: u64) {
        self.parent[slot.index()].store(NONE, Ordering::Relaxed);
        self.children[slot.index()].store(tag(generation) << 32, Ordering::Relaxed);
    }

    /// True if the link word `w` names a block that still exists (writing, ready or being evicted).
    fn live(control: &SlotControl, w: u64) -> bool {
        w != NONE && tag(control.load(SlotId(w as u32)).generation()) == w >> 32
    }

    /// Links `child` (owned or pinned by the caller) under `parent`, unless it already has a live
    /// link. Returns true if this call linked it.
    pub(crate) fn link(&self, control: &SlotControl, child: SlotId, parent: SlotRef) -> bool {
        if child == parent.slot {
            return false;
        }
        let cell = &self.parent[child.index()];
        let cur = cell.load(Ordering::Relaxed);
        if Self::live(control, cur) {
            return false;
        }
        if cell.compare_exchange(cur, pack(parent), Ordering::Relaxed, Ordering::Relaxed).is_err() {
            return false; // another save linked it meanwhile
        }
        self.adjust(parent.slot, parent.generation, true);
        true
    }

    /// `slot`'s block leaves (evicted, aborted or quarantined): its link is taken back and its
    /// live parent loses a child.
    pub(crate) fn unlink(&self, slot: SlotId) {
        let w = self.parent[slot.index()].swap(NONE, Ordering::Relaxed);
        if w != NONE {
            self.adjust(SlotId(w as u32), w >> 32, false);
        }
    }

    /// Adds or removes one child of `slot` if its count is still tagged with `generation`.
    fn adjust(&self, slot: SlotId, generation: u64, up: bool) {
        let cell = &self.children[slot.index()];
        let mut cur = cell.load(Ordering::Relaxed);
        loop {
            if cur >> 32 != tag(generation) {
                return; // the slot was reused: the count belongs to another block
            }
            let n = cur & 0xffff_ffff;
            let next = match (up, n) {
                (true, _) => cur + u64::from(n < 0xffff_ffff),
                (false, 0) => return,
                (false, _) => cur - 1,
            };
            match cell.compare_exchange_weak(cur, next, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return,
                Err(now) => cur = now,
            }
            crate::sync::spin_loop();
        }
    }

    /// True if `slot` links to a parent that is gone (what victim ranking needs).
    #[inline]
    pub(crate) fn is_orphan(&self, control: &SlotControl, slot: SlotId) -> bool {
        let p = self.parent[slot.index()].load(Ordering::Relaxed);
        p != NONE && !Self::live(control, p)
    }

    /// Where `slot` (ready with `generation`) stands in its chain.
    pub(crate) fn class(&self, control: &SlotControl, slot: SlotId, generation: u64) -> ChainClass {
        let p = self.parent[slot.index()].load(Ordering::Relaxed);
        if p != NONE && !Self::live(control, p) {
            return ChainClass::Orphan;
        }
        let c = self.children[slot.index()].load(Ordering::Relaxed);
        if c >> 32 != tag(generation) || c & 0xffff_ffff == 0 {
            ChainClass::Leaf
        } else {
            ChainClass::Interior
        }
    }

    /// The resident children counted for `slot` holding `generation` (for tests and audits).
    pub(crate) fn children(&self, slot: SlotId, generation: u64) -> u32 {
        let c = self.children[slot.index()].load(Ordering::Relaxed);
        if c >> 32 == tag(generation) {
            c as u32
        } else {
            0
        }
    }

    /// The live parent link of `slot`, if any.
    pub(crate) fn parent(&self, control: &SlotControl, slot: SlotId) -> Option<SlotId> {
        let p = self.parent[slot.index()].load(Ordering::Relaxed);
        Self::live(control, p).then_some(SlotId(p as u32))
    }
}
