//! The slot control word: one 64-bit atomic per host slot packing state, pin count and generation.
//!
//! ```text
//!  63                                   24 23                  3 2      0
//! +---------------------------------------+---------------------+--------+
//! |          generation (40 bits)         |  pins (21 bits)     | state  |
//! +---------------------------------------+---------------------+--------+
//! ```
//!
//! State machine (every transition is one CAS on the word, see `docs/design.md`):
//!
//! ```text
//!   FREE(g) --reserve--> WRITING(g) --commit--> READY(g, pins) --begin_evict (pins==0)--> EVICTING(g)
//!      ^                     |  abort                                                        |
//!      +---------------------+-------------------------- release (g+1) ----------------------+
//! ```
//!
//! - `pin(slot, g)` succeeds only on `READY` with generation `g`, so a lookup that raced an eviction
//!   and a reuse fails by generation instead of reading another block's bytes.
//! - `begin_evict` succeeds only on `READY` with zero pins; afterwards no pin can succeed, so the
//!   evictor owns the slot exclusively until it releases it with the generation bumped.
//! - A `WRITING` slot is invisible to queries (pin fails) and cannot be evicted.
//!
//! 64 bits (not 128) because loom models only 64-bit atomics.

use crate::sync::{AtomicU64, Ordering};
use std::fmt;

/// Index of a host slot in the pool (`0..capacity`).
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct SlotId(pub(crate) u32);

impl SlotId {
    /// The slot of index `index` (a slot of a pool of capacity `c` has `index < c`; a pool's
    /// methods refuse a larger one with an out-of-range error).
    #[inline]
    pub const fn new(index: u32) -> Self {
        SlotId(index)
    }

    /// The index as a `u32`.
    #[inline]
    pub const fn get(self) -> u32 {
        self.0
    }

    /// The id as a `usize` index.
    #[inline]
    pub fn index(self) -> usize {
        self.0 as usize
    }
}

/// Lifecycle state of a host slot.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
#[repr(u8)]
pub enum SlotState {
    /// On the free list; holds no block.
    Free = 0,
    /// Reserved by a save whose copy is in flight; invisible to queries, never evicted.
    Writing = 1,
    /// Holds a complete block; visible to queries; evictable when unpinned.
    Ready = 2,
    /// Claimed by an evictor; its index entry is being removed.
    Evicting = 3,
}

/// A decoded slot control word (a plain value; see [`SlotControl`] for the atomics).
#[derive(Copy, Clone, PartialEq, Eq)]
pub struct SlotWord(u64);

impl SlotWord {
    const STATE_BITS: u32 = 3;
    const PIN_BITS: u32 = 21;
    const GEN_SHIFT: u32 = Self::STATE_BITS + Self::PIN_BITS;
    const STATE_MASK: u64 = (1 << Self::STATE_BITS) - 1;
    /// Largest pin count a slot can hold (2^21 - 1).
    pub const MAX_PINS: u32 = (1 << Self::PIN_BITS) - 1;
    /// The most pins leases may hold on one slot together (each lease holds at most one per slot):
    /// the last quarter of [`SlotWord::MAX_PINS`] is kept for the restores' own pins and the saves'
    /// plan pins, so no number of leases makes a restore from a lease already held fail
    /// [`PinError::Overflow`] unless a quarter of a million restores of the slot are in flight.
    pub const LEASE_PINS: u32 = Self::MAX_PINS - (Self::MAX_PINS >> 2);
    /// Generations wrap modulo 2^40.
    pub const GEN_MASK: u64 = (1 << (64 - Self::GEN_SHIFT)) - 1;

    /// Packs a word. `pins <= MAX_PINS`; `generation` is taken modulo 2^40.
    #[inline]
    pub fn new(state: SlotState, pins: u32, generation: u64) -> Self {
        debug_assert!(pins <= Self::MAX_PINS);
        SlotWord(
            ((generation & Self::GEN_MASK) << Self::GEN_SHIFT) | ((pins as u64) << Self::STATE_BITS) | state as u64,
        )
    }
    /// The raw 64-bit value.
    #[inline]
    pub fn raw(self) -> u64 {
        self.0
    }
    /// Decodes a raw value.
    #[inline]
    pub fn from_raw(raw: u64) -> Self {
        SlotWord(raw)
    }
    /// The state field.
    #[inline]
    pub fn state(self) -> SlotState {
        match self.0 & Self::STATE_MASK {
            0 => SlotState::Free,
            1 => SlotState::Writing,
            2 => SlotState::Ready,
            3 => SlotState::Evicting,
            s => unreachable!("corrupt slot word: state {s}"),
        }
    }
    /// The pin count.
    #[inline]
    pub fn pins(self) -> u32 {
        ((self.0 >> Self::STATE_BITS) & Self::MAX_PINS as u64) as u32
    }
    /// The generation (40 bits).
    #[inline]
    pub fn generation(self) -> u64 {
        self.0 >> Self::GEN_SHIFT
    }
    fn with_pins(self, pins: u32) -> Self {
        Self::new(self.state(), pins, self.generation())
    }
}

impl fmt::Debug for SlotWord {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}(pins={}, gen={})", self.state(), self.pins(), self.generation())
    }
}

/// Why a pin was refused.
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
pub enum PinError {
    /// The slot was reused: its generation differs from the one the caller looked up.
    Stale,
    /// The slot is not `READY` (still being written, being evicted, or free).
    NotReady,
    /// The pin count is at [`SlotWord::MAX_PINS`].
    Overflow,
}

/// The control words of every slot of a pool, with the named transitions of the state machine.
///
/// All transitions are lock-free CAS loops. Orderings: transitions that publish a block
/// (`commit`) or hand a slot to a new owner (`release`) are `Release`; transitions that take
/// ownership or a pin (`pin`, `begin_evict`) are `Acquire` (`reserve` is `AcqRel`), so the bytes
/// written by the previous owner happen-before the new owner's reads.
pub struct SlotControl {
    words: Box<[AtomicU64]>,
}

impl SlotControl {
    /// `n` slots, all `FREE` with generation 0.
    pub fn new(n: u32) -> Self {
        let words = crate::sync::table(n as usize, |_| AtomicU64::new(SlotWord::new(SlotState::Free, 0, 0).raw()));
        SlotControl { words }
    }

    /// Number of slots.
    #[inline]
    pub fn len(&self) -> u32 {
        self.words.len() as u32
    }

    /// True when there are no slots.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Starts loading `slot`'s word into the caches (a prefetch, `sync::prefetch_read`): a batch of
    /// pins or commits of slots spread over a large pool overlaps its cache misses this way.
    #[inline]
    pub fn prefetch(&self, slot: SlotId) {
        crate::sync::prefetch_read(&self.words[slot.index()]);
    }

    /// A snapshot of one slot's word.
    #[inline]
    pub fn load(&self, slot: SlotId) -> SlotWord {
        SlotWord(self.words[slot.index()].load(Ordering::Acquire))
    }

    fn update<F>(&self, slot: SlotId, success: Ordering, mut f: F) -> Result<(SlotWord, SlotWord), SlotWord>
    where
        F: FnMut(SlotWord) -> Option<SlotWord>,
    {
        let w = &self.words[slot.index()];
        let mut cur = SlotWord(w.load(Ordering::Acquire));
        loop {
            let next = match f(cur) {
                Some(n) => n,
                None => return Err(cur),
            };
            match w.compare_exchange_weak(cur.0, next.0, success, Ordering::Acquire) {
                Ok(_) => return Ok((cur, next)),
                Err(actual) => {
                    cur = SlotWord(actual);
                    crate::sync::spin_loop();
                }
            }
        }
    }

    /// `FREE(g) -> WRITING(g)`: the caller (a save that popped the slot from the free list) owns it.
    /// Returns the generation `g` to record in the index.
    ///
    /// Panics if the slot is not free: the free list handed out a slot it did not own (broken
    /// invariant).
    pub fn reserve(&self, slot: SlotId) -> u64 {
        match self.update(slot, Ordering::AcqRel, |w| {
            (w.state() == SlotState::Free).then(|| SlotWord::new(SlotState::Writing, 0, w.generation()))
        }) {
            Ok((_, n)) => n.generation(),
            Err(w) => panic!("slot {} handed out while {:?}", slot.0, w),
        }
    }

    /// `WRITING(g) -> READY(g, 0)`: the save's copy completed; the block becomes visible.
    pub fn commit(&self, slot: SlotId, generation: u64) {
        self.commit_with_pins(slot, generation, 0);
    }

    /// `WRITING(g) -> READY(g, 1)`: [`SlotControl::commit`] with one pin already taken for the
    /// committer (a promotion publishes a block its query's lease holds from the first instant it
    /// is visible, so no evictor can take it in between).
    pub fn commit_pinned(&self, slot: SlotId, generation: u64) {
        self.commit_with_pins(slot, generation, 1);
    }

    /// `WRITING(g) -> READY(g, pins)`. Panics if the slot is not `WRITING` with `generation`.
    fn commit_with_pins(&self, slot: SlotId, generation: u64, pins: u32) {
        let r = self.update(slot, Ordering::Release, |w| {
            (w.state() == SlotState::Writing && w.generation() == generation)
                .then(|| SlotWord::new(SlotState::Ready, pins, generation))
        });
        if let Err(w) = r {
            panic!("commit of slot {} gen {generation} found {:?}", slot.0, w);
        }
    }

    /// Pins a `READY` slot of generation `generation`. Returns the pin count after the pin (1 means
    /// the slot went from unpinned to pinned).
    ///
    /// # Errors
    /// [`PinError::Stale`] if the generation differs, [`PinError::NotReady`] if the slot is not
    /// `READY`, [`PinError::Overflow`] at [`SlotWord::MAX_PINS`].
    pub fn pin(&self, slot: SlotId, generation: u64) -> Result<u32, PinError> {
        self.pin_up_to(slot, generation, SlotWord::MAX_PINS)
    }

    /// [`SlotControl::pin`], refusing ([`PinError::Overflow`]) once the slot holds `limit` pins
    /// (`limit <= MAX_PINS`): leases stop below the maximum so restores always find pins left
    /// (see [`SlotWord::LEASE_PINS`]).
    ///
    /// # Errors
    /// As [`SlotControl::pin`].
    pub fn pin_up_to(&self, slot: SlotId, generation: u64, limit: u32) -> Result<u32, PinError> {
        let limit = limit.min(SlotWord::MAX_PINS);
        let mut why = PinError::NotReady;
        let r = self.update(slot, Ordering::Acquire, |w| {
            let gen_ok =
                w.generation() == (generation & SlotWord::GEN_MASK) || crate::seeded::seeded("stale-generation");
            if !gen_ok {
                why = PinError::Stale;
                None
            } else if w.state() != SlotState::Ready
                && !(crate::seeded::seeded("pin-writing") && w.state() == SlotState::Writing)
            {
                // (Seeded bug, model checking only: `pin-writing` lets a query pin a slot
                // whose save has not committed.)
                why = PinError::NotReady;
                None
            } else if w.pins() >= limit {
                why = PinError::Overflow;
                None
            } else {
                Some(w.with_pins(w.pins() + 1))
            }
        });
        r.map(|(_, n)| n.pins()).map_err(|_| why)
    }

    /// Drops one pin. Returns the pin count after (0 means the slot became unpinned).
    ///
    /// Panics if the slot has no pin (an unbalanced unpin is a broken invariant).
    pub fn unpin(&self, slot: SlotId) -> u32 {
        match self.update(slot, Ordering::Release, |w| (w.pins() > 0).then(|| w.with_pins(w.pins() - 1))) {
            Ok((_, n)) => n.pins(),
            Err(w) => panic!("unpin of unpinned slot {}: {:?}", slot.0, w),
        }
    }

    /// `READY(g, 0) -> EVICTING(g)`: claims an unpinned ready slot for eviction. Returns `g`, or
    /// `None` if the slot is pinned, not ready, or changed meanwhile.
    pub fn begin_evict(&self, slot: SlotId) -> Option<u64> {
        self.update(slot, Ordering::Acquire, |w| {
            let unpinned = w.pins() == 0 || crate::seeded::seeded("evict-pinned");
            (w.state() == SlotState::Ready && unpinned).then(|| SlotWord::new(SlotState::Evicting, 0, w.generation()))
        })
        .ok()
        .map(|(_, n)| n.generation())
    }

    /// `EVICTING(g) -> READY(g, 0)`: the evictor gives a claimed slot back untouched (a save that
    /// could not get all its slots evicts nothing). The block was never unindexed, so it is visible
    /// again at once.
    ///
    /// Panics if the slot is not `EVICTING` with generation `generation` (only its claimant may).
    pub fn cancel_evict(&self, slot: SlotId, generation: u64) {
        let r = self.update(slot, Ordering::Release, |w| {
            (w.state() == SlotState::Evicting && w.generation() == generation)
                .then(|| SlotWord::new(SlotState::Ready, 0, generation))
        });
        if let Err(w) = r {
            panic!("cancel_evict of slot {} gen {generation} found {:?}", slot.0, w);
        }
    }

    /// `EVICTING(g)` or `WRITING(g)` `-> FREE(g+1)`: the owner (an evictor, or a save that aborted)
    /// gives the slot back. The generation bump makes every index entry or lease that still names
    /// `(slot, g)` fail to pin. The caller then returns the slot to the free list.
    ///
    /// Panics if the slot is in another state (only its exclusive owner may release it).
    pub fn release(&self, slot: SlotId) -> u64 {
        match self.update(slot, Ordering::Release, |w| {
            matches!(w.state(), SlotState::Evicting | SlotState::Writing)
                .then(|| SlotWord::new(SlotState::Free, 0, (w.generation() + 1) & SlotWord::GEN_MASK))
        }) {
            Ok((_, n)) => n.generation(),
            Err(w) => panic!("release of slot {} found {:?}", slot.0, w),
        }
    }
}

impl fmt::Debug for SlotControl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SlotControl").field("slots", &self.len()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn word_packs_and_unpacks() {
        let w = SlotWord::new(SlotState::Ready, 5, 123_456_789);
        assert_eq!(w.state(), SlotState::Ready);
        assert_eq!(w.pins(), 5);
        assert_eq!(w.generation(), 123_456_789);
        let m = SlotWord::new(SlotState::Evicting, SlotWord::MAX_PINS, SlotWord::GEN_MASK);
        assert_eq!(
            (m.state(), m.pins(), m.generation()),
            (SlotState::Evicting, SlotWord::MAX_PINS, SlotWord::GEN_MASK)
        );
    }

    #[test]
    fn lifecycle_and_generation() {
        let c = SlotControl::new(2);
        let s = SlotId(1);
        let g = c.reserve(s);
        assert_eq!(g, 0);
        assert_eq!(c.pin(s, g), Err(PinError::NotReady), "a slot being written is invisible");
        assert_eq!(c.begin_evict(s), None, "a slot being written is never evicted");
        c.commit(s, g);
        assert_eq!(c.pin(s, g), Ok(1));
        assert_eq!(c.begin_evict(s), None, "a pinned slot is never evicted");
        assert_eq!(c.unpin(s), 0);
        assert_eq!(c.begin_evict(s), Some(0));
        assert_eq!(c.pin(s, 0), Err(PinError::NotReady));
        assert_eq!(c.release(s), 1);
        let g2 = c.reserve(s);
        c.commit(s, g2);
        assert_eq!(c.pin(s, 0), Err(PinError::Stale), "a stale lookup fails by generation");
        assert_eq!(c.pin(s, 1), Ok(1));
    }

    #[test]
    #[should_panic(expected = "unpin of unpinned")]
    fn unbalanced_unpin_panics() {
        let c = SlotControl::new(1);
        c.unpin(SlotId(0));
    }
}
