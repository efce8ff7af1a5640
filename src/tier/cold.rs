//! Cold marks and the eviction log: what a [`crate::HybridTier`] uses to make one group's eviction
//! follow another's (eviction across cache groups, docs/design.md).
//!
//! - A **cold mark** puts a ready block in the first preference class, the one chain-aware
//!   ranking gives orphans: it is evicted before every block that is neither cold nor an orphan,
//!   and otherwise in its policy's order. A mark names the block's generation, so a block that
//!   leaves takes its mark with it (a reused slot never inherits one); it is a preference only:
//!   a cold block that is pinned is not taken, and the last class still holds every block
//!   (liveness is the policy's own). Marks are set and cleared by the tier's owner
//!   ([`crate::tier::core::Core::mark_cold`]), never by eviction.
//! - The **eviction log** records the key of every block the core evicts (a save's capacity
//!   eviction or an asked-for one), for its owner to read and empty
//!   ([`crate::tier::core::Core::take_evicted`]). It holds at most its capacity of keys: past that,
//!   the keys are counted as lost and dropped (the owner then misses some departures: preferences
//!   it does not update, nothing it serves).
//!
//! Counting: [`ColdMarks::count`] is the number of marks whose block may still be ready, so a
//! selection skips the first class when it is 0 and no orphan is counted either. A mark is counted
//! when it is set and uncounted when it is cleared or its block is evicted; a mark set while its
//! block was leaving is taken back by whichever of the two sees the other (both sides are
//! sequentially consistent), so the count never keeps a departed block except through a block
//! that leaves without eviction after being marked (none does: only ready blocks are marked, and
//! a ready block leaves only by eviction).

use crate::key::ContentKey;
use crate::slab::slot::SlotId;
use crate::sync::{AtomicU64, AtomicUsize, Mutex, Ordering};

/// What [`crate::tier::core::Core::mark_cold`] found.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum ColdOutcome {
    /// The block is ready and marked (or was already).
    Marked,
    /// The block is being written: it can be marked once it is ready.
    Writing,
    /// No block of the key (or it is leaving, or cold marks are off).
    Absent,
}

/// No mark.
const NONE: u64 = 0;

/// The mark word of a block of `generation` (never [`NONE`]).
#[inline]
fn mark_of(generation: u64) -> u64 {
    generation.wrapping_add(1).max(1)
}

/// One cold mark per slot (see the module docs).
pub(crate) struct ColdMarks {
    marks: Box<[AtomicU64]>,
    count: AtomicUsize,
}

impl ColdMarks {
    pub(crate) fn new(capacity: u32) -> Self {
        ColdMarks { marks: crate::sync::table(capacity as usize, |_| AtomicU64::new(NONE)), count: AtomicUsize::new(0) }
    }

    /// Marks the block of `generation` in `slot`; true if it was not marked. The caller checks,
    /// after this returns, that the slot still holds that generation, and calls
    /// [`ColdMarks::clear`] if not.
    pub(crate) fn set(&self, slot: SlotId, generation: u64) -> bool {
        let m = mark_of(generation);
        let prev = self.marks[slot.index()].swap(m, Ordering::SeqCst);
        if prev == m {
            return false;
        }
        self.count.fetch_add(1, Ordering::SeqCst);
        if prev != NONE {
            // The mark of an earlier block of the slot, left because its block's departure ran
            // before it was set: uncounted now (it was counted when set).
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
        true
    }

    /// Clears the mark of the block of `generation` in `slot`, if it is there; true if it was.
    pub(crate) fn clear(&self, slot: SlotId, generation: u64) -> bool {
        let cleared = self.marks[slot.index()]
            .compare_exchange(mark_of(generation), NONE, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok();
        if cleared {
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
        cleared
    }

    /// True if the block of `generation` in `slot` is marked.
    #[inline]
    pub(crate) fn is_cold(&self, slot: SlotId, generation: u64) -> bool {
        self.marks[slot.index()].load(Ordering::Relaxed) == mark_of(generation)
    }

    /// Marks that may name a ready block (see the module docs).
    pub(crate) fn count(&self) -> usize {
        self.count.load(Ordering::SeqCst)
    }
}

/// The keys of evicted blocks, in eviction order, up to a capacity (see the module docs).
pub(crate) struct EvictionLog {
    keys: Mutex<Vec<ContentKey>>,
    capacity: usize,
    lost: AtomicU64,
}

impl EvictionLog {
    pub(crate) fn new(capacity: usize) -> Self {
        EvictionLog { keys: Mutex::new(Vec::new()), capacity: capacity.max(1), lost: AtomicU64::new(0) }
    }

    /// Records an evicted block's key (dropped and counted as lost when the log is full).
    pub(crate) fn push(&self, key: ContentKey) {
        let mut keys = crate::sync::lock(&self.keys);
        if keys.len() < self.capacity {
            keys.push(key);
        } else {
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Moves every recorded key to `out` (in eviction order); the log is empty afterwards.
    pub(crate) fn take(&self, out: &mut Vec<ContentKey>) {
        out.append(&mut crate::sync::lock(&self.keys));
    }

    /// Keys dropped because the log was full.
    pub(crate) fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }
}
