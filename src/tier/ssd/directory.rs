//! [`DiskSlots`]: what the SSD tier holds, slot by slot, built from the host tier's own parts.
//!
//! Every disk slot has a slot word ([`SlotControl`]: `FREE -> WRITING -> READY -> EVICTING`, pins,
//! generation), exactly as a host slot does; free disk slots sit on a [`FreeList`]; a
//! [`BlockIndex`] maps each content key to its disk slot and the slot word's generation. So a
//! promotion pins a disk slot the way a query pins a host slot, and the slot cannot be evicted
//! and rewritten under its read; an index entry whose slot was reused fails to pin (`Stale`).
//!
//! Victims are chosen by [`DiskLru`], an intrusive doubly linked list of the `READY` slots in
//! recency order: insert, touch, remove and pop are O(1) whatever the slot count (a 4 TB drive of
//! GLM-5.2 blocks is 1.2 M slots), unlike the host pool's scan-based policies.
//!
//! Each slot also records the **file generation** its trailer was written with: a counter over the
//! whole tier that only grows (a reopened tier continues from the largest generation its scan
//! found), so a trailer names one write of one block, never a later one.

use crate::index::{BlockIndex, SlotRef};
use crate::key::ContentKey;
use crate::slab::freelist::FreeList;
use crate::slab::slot::{PinError, SlotControl, SlotId, SlotState};
use crate::sync::{lock, AtomicU64, Mutex, Ordering};

/// No slot (the list's end marker).
const NIL: u32 = u32::MAX;

/// A disk block pinned for a read: its disk slot (global over the tier's files), the slot word's
/// generation and the file generation its trailer carries.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct DiskRef {
    /// The disk slot, numbered over every file of the tier.
    pub slot: u32,
    /// The slot word's generation when it was pinned or taken.
    pub generation: u64,
    /// The generation written in (or to be written in) the slot's trailer.
    pub file_generation: u64,
}

/// Recency order of the `READY` disk slots (see the module docs). Not synchronised: the caller
/// holds the mutex around it.
struct DiskLru {
    prev: Vec<u32>,
    next: Vec<u32>,
    listed: Vec<bool>,
    /// Least recently used.
    head: u32,
    /// Most recently used.
    tail: u32,
    len: usize,
}

impl DiskLru {
    fn new(n: u32) -> Self {
        DiskLru {
            prev: vec![NIL; n as usize],
            next: vec![NIL; n as usize],
            listed: crate::sync::table(n as usize, |_| false).into_vec(),
            head: NIL,
            tail: NIL,
            len: 0,
        }
    }

    /// Appends `s` as the most recently used (it must not be listed).
    fn push_back(&mut self, s: u32) {
        debug_assert!(!self.listed[s as usize], "disk slot {s} listed twice");
        let i = s as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail == NIL {
            self.head = s;
        } else {
            self.next[self.tail as usize] = s;
        }
        self.tail = s;
        self.listed[i] = true;
        self.len += 1;
    }

    /// Unlinks `s`; false if it was not listed.
    fn remove(&mut self, s: u32) -> bool {
        let i = s as usize;
        if !self.listed[i] {
            return false;
        }
        let (p, n) = (self.prev[i], self.next[i]);
        if p == NIL {
            self.head = n;
        } else {
            self.next[p as usize] = n;
        }
        if n == NIL {
            self.tail = p;
        } else {
            self.prev[n as usize] = p;
        }
        self.listed[i] = false;
        self.len -= 1;
        true
    }

    /// Makes `s` the most recently used, if it is listed.
    fn touch(&mut self, s: u32) {
        if self.remove(s) {
            self.push_back(s);
        }
    }
}

/// The disk slots of an SSD tier (see the module docs).
pub struct DiskSlots {
    words: SlotControl,
    free: FreeList,
    index: BlockIndex,
    /// The key of the block in each slot (two words), written by the slot's owner while `WRITING`.
    keys: Box<[[AtomicU64; 2]]>,
    /// The file generation of each slot's trailer, written with the key.
    file_generation: Box<[AtomicU64]>,
    /// Recency order; also serialises victim claims.
    lru: Mutex<DiskLru>,
    next_file_generation: AtomicU64,
}

/// A block found by the trailer scan of a reopened file, to be made `READY` again.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Recovered {
    /// The disk slot, numbered over every file of the tier.
    pub slot: u32,
    /// The block's content key.
    pub key: ContentKey,
    /// The generation its trailer carries.
    pub file_generation: u64,
}

impl DiskSlots {
    /// `n` disk slots holding the `recovered` blocks (each slot at most once; a key found in two
    /// slots keeps the first and leaves the other free), every other slot free. Returns the slots
    /// and how many recovered blocks were dropped as duplicates.
    pub fn new(n: u32, recovered: &[Recovered]) -> (Self, usize) {
        let slots = DiskSlots {
            words: SlotControl::new(n),
            free: FreeList::new(n),
            index: BlockIndex::with_capacity(n as usize),
            keys: crate::sync::table(n as usize, |_| [AtomicU64::new(0), AtomicU64::new(0)]),
            file_generation: crate::sync::table(n as usize, |_| AtomicU64::new(0)),
            lru: Mutex::new(DiskLru::new(n)),
            next_file_generation: AtomicU64::new(1),
        };
        // Take every id off the free list, then give back those the scan found no block in.
        let mut used = vec![false; n as usize];
        let mut duplicates = 0;
        let mut newest = 0;
        for r in recovered {
            newest = newest.max(r.file_generation);
        }
        while slots.free.pop().is_some() {}
        for r in recovered {
            if used[r.slot as usize] {
                continue;
            }
            let g = slots.words.reserve(SlotId(r.slot));
            slots.set_key(r.slot, &r.key, r.file_generation);
            if slots.index.insert_if_absent(r.key, SlotRef { slot: SlotId(r.slot), generation: g }).is_err() {
                slots.words.release(SlotId(r.slot));
                duplicates += 1;
                continue;
            }
            slots.words.commit(SlotId(r.slot), g);
            lock(&slots.lru).push_back(r.slot);
            used[r.slot as usize] = true;
        }
        // Free slots go back lowest id last, so the lowest id is popped first.
        for s in (0..n).rev() {
            if !used[s as usize] {
                slots.free.push(s);
            }
        }
        slots.next_file_generation.store(newest + 1, Ordering::Relaxed);
        (slots, duplicates)
    }

    fn set_key(&self, slot: u32, key: &ContentKey, file_generation: u64) {
        let (lo, hi) = key.words();
        let k = &self.keys[slot as usize];
        k[0].store(lo, Ordering::Relaxed);
        k[1].store(hi, Ordering::Relaxed);
        self.file_generation[slot as usize].store(file_generation, Ordering::Relaxed);
    }

    /// The key recorded for the block in disk slot `slot` (meaningful while the slot is owned,
    /// pinned or ready).
    pub fn key_of(&self, slot: u32) -> ContentKey {
        let k = &self.keys[slot as usize];
        ContentKey::from_words(k[0].load(Ordering::Relaxed), k[1].load(Ordering::Relaxed))
    }

    /// Number of disk slots.
    pub fn capacity(&self) -> u32 {
        self.words.len()
    }

    /// Blocks held (`READY` slots).
    #[allow(clippy::len_without_is_empty)]
    pub fn len(&self) -> usize {
        lock(&self.lru).len
    }

    /// True if a `READY` block of `key` is on disk now (does not pin it).
    pub fn contains(&self, key: &ContentKey) -> bool {
        self.index.get(key).is_some_and(|r| {
            let w = self.words.load(r.slot);
            w.state() == SlotState::Ready && w.generation() == r.generation
        })
    }

    /// Pins the `READY` block of `key` for a read, or `None` if there is none.
    pub fn pin(&self, key: &ContentKey) -> Option<DiskRef> {
        let r = self.index.get(key)?;
        match self.words.pin(r.slot, r.generation) {
            Ok(_) => Some(DiskRef {
                slot: r.slot.0,
                generation: r.generation,
                file_generation: self.file_generation[r.slot.index()].load(Ordering::Relaxed),
            }),
            Err(PinError::Stale | PinError::NotReady | PinError::Overflow) => None,
        }
    }

    /// Drops a pin taken by [`DiskSlots::pin`]; `used` makes the block the most recently used.
    pub fn unpin(&self, d: DiskRef, used: bool) {
        if used {
            lock(&self.lru).touch(d.slot);
        }
        self.words.unpin(SlotId(d.slot));
    }

    /// Takes a slot for a new block: a free one, else the least recently used unpinned block is
    /// evicted (its index entry goes before its generation is bumped). The slot is `WRITING`,
    /// owned by the caller, with `key` recorded and a fresh file generation. Returns the slot,
    /// the file generation to write and the key evicted, if any; `None` when every slot is pinned
    /// or being written.
    pub fn take(&self, key: &ContentKey) -> Option<(DiskRef, Option<ContentKey>)> {
        let (slot, evicted) = match self.free.pop() {
            Some(s) => (s, None),
            None => self.evict_one()?,
        };
        let generation = self.words.reserve(SlotId(slot));
        let file_generation = self.next_file_generation.fetch_add(1, Ordering::Relaxed);
        self.set_key(slot, key, file_generation);
        Some((DiskRef { slot, generation, file_generation }, evicted))
    }

    /// Evicts the least recently used unpinned block: returns its (now free, owned) slot and key.
    fn evict_one(&self) -> Option<(u32, Option<ContentKey>)> {
        let mut lru = lock(&self.lru);
        // A pinned block (a read in flight) is moved to the back; each is passed over once.
        for _ in 0..lru.len {
            let s = lru.head;
            if s == NIL {
                break;
            }
            match self.words.begin_evict(SlotId(s)) {
                Some(g) => {
                    lru.remove(s);
                    let key = self.key_of(s);
                    let removed = self.index.remove_if(&key, SlotRef { slot: SlotId(s), generation: g });
                    debug_assert!(removed, "ready disk slot {s} had no index entry");
                    self.words.release(SlotId(s));
                    return Some((s, Some(key)));
                }
                None => lru.touch(s),
            }
        }
        None
    }

    /// Publishes a block written into a slot from [`DiskSlots::take`]: index entry, then `READY`.
    /// Returns false (the slot freed) if the index already holds the key.
    pub fn commit(&self, d: DiskRef, key: ContentKey) -> bool {
        if self.index.insert_if_absent(key, SlotRef { slot: SlotId(d.slot), generation: d.generation }).is_err() {
            self.abort(d);
            return false;
        }
        self.words.commit(SlotId(d.slot), d.generation);
        lock(&self.lru).push_back(d.slot);
        true
    }

    /// Gives back a slot from [`DiskSlots::take`] whose write failed (never indexed).
    pub fn abort(&self, d: DiskRef) {
        self.words.release(SlotId(d.slot));
        self.free.push(d.slot);
    }

    /// Drops the block of a pinned slot whose read failed verification: the pin goes, and the
    /// block is evicted unless another read pinned it meanwhile (that read fails too, and drops
    /// it then). When it is dropped now, `erase(slot)` runs while the slot is still owned (out of
    /// the index and the recency list, not yet free, so no demotion can be writing it): the tier
    /// clears the slot's trailer on disk there, so that a restart does not find the block again.
    /// Returns true if it was dropped now.
    pub fn drop_unverified(&self, d: DiskRef, erase: impl FnOnce(u32)) -> bool {
        let mut lru = lock(&self.lru);
        self.words.unpin(SlotId(d.slot));
        let Some(g) = self.words.begin_evict(SlotId(d.slot)) else { return false };
        if g != d.generation {
            self.words.cancel_evict(SlotId(d.slot), g);
            return false;
        }
        lru.remove(d.slot);
        let key = self.key_of(d.slot);
        let removed = self.index.remove_if(&key, SlotRef { slot: SlotId(d.slot), generation: g });
        debug_assert!(removed, "ready disk slot {} had no index entry", d.slot);
        drop(lru);
        // The slot is EVICTING and ours: the erase's write (I/O) goes without the list's lock.
        // A panic in it leaves the slot withheld (EVICTING), never free under a write.
        erase(d.slot);
        self.words.release(SlotId(d.slot));
        self.free.push(d.slot);
        true
    }

    /// Free slots now.
    #[cfg(test)]
    pub(crate) fn free_count(&self) -> usize {
        self.free.len()
    }
}

impl std::fmt::Debug for DiskSlots {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskSlots").field("capacity", &self.capacity()).field("blocks", &self.len()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(i: u64) -> ContentKey {
        ContentKey::from_words(i, !i)
    }

    fn write(slots: &DiskSlots, i: u64) -> (DiskRef, Option<ContentKey>) {
        let (d, ev) = slots.take(&key(i)).expect("a slot");
        assert!(slots.commit(d, key(i)));
        (d, ev)
    }

    #[test]
    fn the_least_recently_used_unpinned_block_is_evicted_and_its_entry_goes() {
        let (slots, dup) = DiskSlots::new(3, &[]);
        assert_eq!(dup, 0);
        for i in 0..3 {
            assert_eq!(write(&slots, i).1, None);
        }
        // Touch block 0 (a read), pin block 1 (a read in flight): block 2 is the victim.
        let d0 = slots.pin(&key(0)).unwrap();
        slots.unpin(d0, true);
        let d1 = slots.pin(&key(1)).unwrap();
        assert_eq!(write(&slots, 3).1, Some(key(2)));
        assert!(!slots.contains(&key(2)) && slots.pin(&key(2)).is_none());
        // Block 1 is still pinned: block 0 goes next, then 3.
        assert_eq!(write(&slots, 4).1, Some(key(0)));
        slots.unpin(d1, false);
        assert_eq!(write(&slots, 5).1, Some(key(1)));
        assert_eq!(slots.len(), 3);
        // File generations only grow.
        assert!(slots.pin(&key(5)).unwrap().file_generation > 5);
    }

    #[test]
    fn recovered_blocks_are_ready_and_their_slots_leave_the_free_list() {
        let rec = [
            Recovered { slot: 2, key: key(7), file_generation: 40 },
            Recovered { slot: 0, key: key(7), file_generation: 41 },
            Recovered { slot: 1, key: key(8), file_generation: 9 },
        ];
        let (slots, dup) = DiskSlots::new(4, &rec);
        assert_eq!((dup, slots.len(), slots.free_count()), (1, 2, 2));
        let d = slots.pin(&key(7)).unwrap();
        assert_eq!((d.slot, d.file_generation), (2, 40));
        slots.unpin(d, false);
        // A new write continues past the newest generation found.
        let (d, ev) = write(&slots, 9);
        assert_eq!((d.file_generation, ev), (42, None));
        assert!(d.slot == 0 || d.slot == 3);
    }

    #[test]
    fn an_unverified_block_is_dropped_unless_another_read_holds_it() {
        let (slots, _) = DiskSlots::new(2, &[]);
        write(&slots, 1);
        let a = slots.pin(&key(1)).unwrap();
        let b = slots.pin(&key(1)).unwrap();
        let mut erased = Vec::new();
        assert!(!slots.drop_unverified(a, |s| erased.push(s)));
        assert!(slots.contains(&key(1)) && erased.is_empty(), "a block another read holds is kept");
        assert!(slots.drop_unverified(b, |s| erased.push(s)));
        assert_eq!(erased, [b.slot], "the dropped slot is erased once, while still owned");
        assert!(!slots.contains(&key(1)));
        assert_eq!(slots.free_count(), 2);
    }
}
