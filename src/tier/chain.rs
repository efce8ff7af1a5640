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
//! **Child lists** (for the victim order: a block that becomes an orphan is announced to the policy,
//! [`crate::evict::EvictionPolicy::on_reclass`]): per linked parent `(slot, generation)`, the
//! slots that link to it, in one of 64 mutex-guarded stripes (by parent slot). A link adds the
//! child to its parent's list after its CAS; an unlink removes it (O(1): each child keeps its
//! position); a parent that leaves takes its whole list ([`Chains::take_children`]) and every child
//! that still links to it is an orphan. A link that races its parent's departure may add a child
//! to a list already taken: that child is not announced (its unlink still removes it, so nothing
//! leaks), and it goes in its policy order instead of first.
//!
//! Concurrency: a link is only written for a block the writer owns (`WRITING`, reserved by its save)
//! or pins (resident, pinned by its save's plan), by one CAS, and the parent's count is incremented
//! only by the CAS winner and only while the count's tag matches the parent's generation; a block
//! that leaves (evicted under the eviction lock, aborted, quarantined) takes its link back by a swap
//! and decrements the count under the same tag check. A stale tag means the parent slot was reused:
//! the count then belongs to the new block and is left alone. Every mistake a race could still make
//! (a count read mid-update) changes only the preference, never what may be evicted.

use crate::index::SlotRef;
use crate::key::FoldHashing;
use crate::slab::slot::{SlotControl, SlotId};
use crate::sync::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Mutex, Ordering};
use crossbeam_utils::CachePadded;
use std::collections::HashMap;

/// One stripe's child lists: `pack(parent) -> children`.
type ChildLists = HashMap<u64, Vec<u32>, FoldHashing>;

/// Stripes of the child lists.
const STRIPES: usize = 64;

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
    /// Child lists: `pack(parent) -> children`, striped by parent slot.
    lists: Box<[CachePadded<Mutex<ChildLists>>]>,
    /// Each child's position in its parent's list (read and written under that list's stripe).
    pos: Box<[AtomicU32]>,
    /// Per slot, 1 while the block is counted in `orphans`.
    counted: Box<[AtomicU8]>,
    /// Orphans announced by [`Chains::take_children`] and still orphaned (not unlinked, not
    /// re-attached): when 0, no selection needs an orphan pass ([`Chains::orphans`]).
    orphans: AtomicUsize,
}

impl Chains {
    pub(crate) fn new(capacity: u32) -> Self {
        Chains {
            parent: crate::sync::table(capacity as usize, |_| AtomicU64::new(NONE)),
            children: crate::sync::table(capacity as usize, |_| AtomicU64::new(0)),
            lists: (0..STRIPES).map(|_| CachePadded::new(Mutex::new(ChildLists::default()))).collect(),
            pos: crate::sync::table(capacity as usize, |_| AtomicU32::new(0)),
            counted: crate::sync::table(capacity as usize, |_| AtomicU8::new(0)),
            orphans: AtomicUsize::new(0),
        }
    }

    /// Orphans counted now: every block that became one when its parent left, less those that
    /// left or were re-attached since. An orphan whose link raced its parent's departure is not
    /// counted (nor announced). While this is 0, the orphan classes hold nothing a selection must
    /// look for.
    pub(crate) fn orphans(&self) -> usize {
        self.orphans.load(Ordering::Acquire)
    }

    /// `slot` is no longer an orphan (it left or was re-attached): uncounted.
    fn uncount(&self, slot: SlotId) {
        if self.counted[slot.index()].swap(0, Ordering::AcqRel) != 0 {
            self.orphans.fetch_sub(1, Ordering::AcqRel);
        }
    }

    fn stripe(&self, parent: u64) -> &Mutex<ChildLists> {
        &self.lists[(parent as u32 as usize) % STRIPES]
    }

    /// Adds `child` to the list of the parent packed as `w`.
    fn list_add(&self, w: u64, child: SlotId) {
        let mut lists = crate::sync::lock(self.stripe(w));
        let v = lists.entry(w).or_default();
        self.pos[child.index()].store(v.len() as u32, Ordering::Relaxed);
        v.push(child.0);
    }

    /// Removes `child` from the list of the parent packed as `w`, if it is there.
    fn list_remove(&self, w: u64, child: SlotId) {
        let mut lists = crate::sync::lock(self.stripe(w));
        let Some(v) = lists.get_mut(&w) else { return };
        let at = self.pos[child.index()].load(Ordering::Relaxed) as usize;
        let i = if v.get(at) == Some(&child.0) { Some(at) } else { v.iter().position(|&c| c == child.0) };
        if let Some(i) = i {
            v.swap_remove(i);
            if let Some(&moved) = v.get(i) {
                self.pos[moved as usize].store(i as u32, Ordering::Relaxed);
            }
        }
        if v.is_empty() {
            lists.remove(&w);
        }
    }

    /// Starts loading `slot`'s parent link into the caches ([`crate::sync::prefetch_read`]): an
    /// eviction's [`Chains::unlink`] reads and swaps it.
    #[inline]
    pub(crate) fn prefetch_link(&self, slot: SlotId) {
        crate::sync::prefetch_read(&self.parent[slot.index()]);
    }

    /// `parent` has left (its generation is bumped): calls `orphaned` for each block that still
    /// links to it, and forgets its list. O(its children).
    pub(crate) fn take_children(&self, parent: SlotRef, mut orphaned: impl FnMut(SlotId)) {
        let w = pack(parent);
        let Some(v) = crate::sync::lock(self.stripe(w)).remove(&w) else { return };
        for c in v {
            if self.parent[c as usize].load(Ordering::Relaxed) == w {
                // Seeded bug (tests only): `orphans-uncounted` leaves the orphan count at 0.
                if self.counted[c as usize].swap(1, Ordering::AcqRel) == 0
                    && !crate::seeded::seeded("orphans-uncounted")
                {
                    self.orphans.fetch_add(1, Ordering::AcqRel);
                }
                // The child may have left (or been re-attached) since the link was read: then its
                // own `uncount` may have run before the flag was set, so take the count back here
                // (whichever of the two clears the flag decrements; the swap that read the other's
                // write orders its link change before this load).
                if self.parent[c as usize].load(Ordering::Acquire) != w {
                    self.uncount(SlotId(c));
                    continue;
                }
                // Seeded bug (tests only): `orphans-unannounced` never tells the policy of new orphans.
                if !crate::seeded::seeded("orphans-unannounced") {
                    orphaned(SlotId(c));
                }
            }
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
        if cur != NONE {
            // A dead link replaced (the block is re-attached): out of the old parent's list, and no
            // longer an orphan.
            self.list_remove(cur, child);
            self.uncount(child);
        }
        self.adjust(parent.slot, parent.generation, true);
        self.list_add(pack(parent), child);
        true
    }

    /// `slot`'s block leaves (evicted, aborted or quarantined): its link is taken back and its
    /// live parent loses a child. Returns the slot the link named (its block may have left since:
    /// the caller's announcement of it is then a harmless re-filing of whatever holds the slot).
    pub(crate) fn unlink(&self, slot: SlotId) -> Option<SlotId> {
        let w = self.parent[slot.index()].swap(NONE, Ordering::Relaxed);
        if w == NONE {
            return None;
        }
        self.adjust(SlotId(w as u32), w >> 32, false);
        self.list_remove(w, slot);
        self.uncount(slot);
        Some(SlotId(w as u32))
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

    /// The resident children counted for `slot` holding `generation` (chain-aware LRU's leaves,
    /// [`crate::evict::ChainView::resident_children`]; tests and audits).
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
