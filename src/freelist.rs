//! [`FreeList`]: a lock-free free list of slot ids (`0..capacity`), the allocator under
//! [`crate::HostPool`].
//!
//! # Layout
//!
//! The list is a set of *shards*, each a Treiber stack. A stack's head is one 64-bit word:
//!
//! ```text
//!  63                        32 31                         0
//! +----------------------------+----------------------------+
//! |        ABA tag (32 bits)   |  top index + 1 (0 = empty) |
//! +----------------------------+----------------------------+
//! ```
//!
//! The links live in one shared array `next: [AtomicU32; capacity]`: `next[i]` is the index + 1 of
//! the element below `i` in whichever stack `i` is on (0 = bottom). An id is on at most one stack at
//! a time, so one array serves every shard. Shards sit on their own cache lines.
//!
//! A thread pushes to and pops from its *home* shard (a per-thread number, assigned once from a
//! counter, modulo the shard count) and, when that is empty, steals from the others in order. With
//! one shard per core (the default: next power of two at or above the available parallelism,
//! capped at 16) threads rarely touch the same head word. Callers that know a better spread (a rank
//! number) use [`FreeList::pop_near`] / [`FreeList::push_near`].
//!
//! # The ABA argument
//!
//! `pop` reads `head = (tag, i)`, then `next[i] = j`, then CASes `head` from `(tag, i)` to
//! `(tag + 1, j)`. Without the tag the classic ABA failure is: thread A reads `(i, next = j)` and
//! stalls; thread B pops `i`, pops `j` and pushes `i` back (now `next[i]` is something else); A's CAS
//! still sees top `i` and installs `j` as the top although B owns `j`. The next pop hands `j` to a
//! second owner. With the tag, every successful pop increments it, and a push keeps it; so the head
//! word can only return to a value it had before after 2^32 pops (wrap-around) in the window
//! between one thread's load and its CAS. Between A's load and A's CAS any pop changes the tag, and
//! a push alone changes the top index; to get the top index back to `i` a pop is needed. Hence an
//! equal head word means *no* pop or push happened in between, so `next[i]` read by A is still the
//! element below `i` and A's CAS is correct. (A `next[i]` value read while `i` was being popped and
//! re-pushed elsewhere may be stale, but then the tag differs and the CAS fails; the links are
//! atomics, so such a read is not a data race.) Push needs no tag change: it dereferences nothing,
//! it only installs `i` on top of the head it saw.
//!
//! The seeded bug `--cfg kvtier_seeded_bug="freelist-aba"` removes the tag increment;
//! `loom-tests/freelist.rs` finds the double hand-out above.
//!
//! # Memory orderings
//!
//! - `push(i)`: store `next[i]` (Relaxed), then CAS the head with `Release`. Everything the freeing
//!   thread did before (its writes into the slot, its `SlotControl::release`) happens-before the
//!   next owner's pop.
//! - `pop`: load the head with `Acquire` (and `Acquire` on CAS failure, whose returned value is used
//!   for the next attempt), so the `next[i]` written by the push that published `i` is visible; CAS
//!   success is `AcqRel` (it continues the release sequence of the pushes below it, which later pops
//!   acquire).
//! - The per-shard length counter is Relaxed: it is incremented *before* the push CAS and
//!   decremented *after* the pop CAS, so (the push happening-before the pop of the same element)
//!   a shard's counter never goes below zero. [`FreeList::len`] sums the shards: approximate while
//!   other threads push and pop, exact when they are quiescent.
//!
//! Every CAS retry calls [`crate::sync::spin_loop`] (under loom it yields to other threads).
//!
//! # Guarantees
//!
//! - An id popped is owned by the caller until it pushes it back; no other pop returns it meanwhile.
//! - On one thread (or with no concurrent operation), `pop` returns `None` only if the list is
//!   empty. Under concurrency a `None` means every shard was seen empty at some moment of the sweep;
//!   an id pushed to an already-visited shard during the sweep can be missed.
//! - Debug builds keep a per-id "on the list" flag and panic on a double push (double free).

use crate::sync::{AtomicU32, AtomicU64, AtomicUsize, Ordering};
use crossbeam_utils::CachePadded;

/// Most shards [`FreeList::new`] creates.
pub const MAX_SHARDS: usize = 16;

const INDEX_MASK: u64 = 0xFFFF_FFFF;

#[inline]
fn pack(tag: u32, top_plus_one: u32) -> u64 {
    ((tag as u64) << 32) | top_plus_one as u64
}

#[inline]
fn unpack(word: u64) -> (u32, u32) {
    ((word >> 32) as u32, (word & INDEX_MASK) as u32)
}

/// One Treiber stack.
struct Shard {
    /// `tag << 32 | (top index + 1)`; 0 in the low half means empty.
    head: AtomicU64,
    /// Ids on this stack (see the module docs for why it never underflows).
    len: AtomicUsize,
}

/// A lock-free list of free slot ids `0..capacity`. See the module docs for the design, the ABA
/// argument and the memory orderings.
pub struct FreeList {
    shards: Box<[CachePadded<Shard>]>,
    /// `shards.len() - 1` (the shard count is a power of two).
    shard_mask: usize,
    /// `next[i]`: index + 1 of the id below `i` on its stack (0 = bottom).
    next: Box<[AtomicU32]>,
    /// Debug builds: `true` while the id is on the list (double-free detection).
    #[cfg(debug_assertions)]
    listed: Box<[crate::sync::AtomicBool]>,
    capacity: u32,
}

impl FreeList {
    /// Largest capacity: ids are stored as `index + 1` in 32 bits.
    pub const MAX_CAPACITY: u32 = u32::MAX;

    /// A list holding every id of `0..n`, with the default shard count (next power of two at or
    /// above [`std::thread::available_parallelism`], at most [`MAX_SHARDS`], at most the power of
    /// two at or above `n`, at least 1).
    pub fn new(n: u32) -> Self {
        let par = std::thread::available_parallelism().map_or(1, |p| p.get());
        Self::with_shards(n, par)
    }

    /// A list holding every id of `0..n` with `shards` shards, rounded up to a power of two and
    /// clamped to `1..=`[`MAX_SHARDS`] and to the power of two at or above `n` (tests and loom
    /// models pick 1 or 2).
    ///
    /// Ids are dealt out in contiguous runs: shard `s` holds `s*n/S .. (s+1)*n/S`, lowest id on top.
    pub fn with_shards(n: u32, shards: usize) -> Self {
        let cap_by_n = (n.max(1) as usize).next_power_of_two();
        let shards = shards.clamp(1, MAX_SHARDS).next_power_of_two().min(cap_by_n).min(MAX_SHARDS);
        let next: Box<[AtomicU32]> = (0..n).map(|_| AtomicU32::new(0)).collect();
        let mut heads = Vec::with_capacity(shards);
        for s in 0..shards {
            let lo = (s as u64 * n as u64 / shards as u64) as u32;
            let hi = ((s as u64 + 1) * n as u64 / shards as u64) as u32;
            // Link lo -> lo+1 -> ... -> hi-1 -> bottom. Not yet shared: Relaxed is enough, the list
            // is published to other threads by whatever shares `self` (Arc, scoped spawn).
            for i in lo..hi {
                let below = if i + 1 < hi { i + 2 } else { 0 };
                next[i as usize].store(below, Ordering::Relaxed);
            }
            let top = if lo < hi { lo + 1 } else { 0 };
            heads.push(CachePadded::new(Shard {
                head: AtomicU64::new(pack(0, top)),
                len: AtomicUsize::new((hi - lo) as usize),
            }));
        }
        FreeList {
            shards: heads.into_boxed_slice(),
            shard_mask: shards - 1,
            next,
            #[cfg(debug_assertions)]
            listed: (0..n).map(|_| crate::sync::AtomicBool::new(true)).collect(),
            capacity: n,
        }
    }

    /// Number of ids (`n` given at construction).
    #[inline]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Number of shards (a power of two, `1..=`[`MAX_SHARDS`]).
    #[inline]
    pub fn shards(&self) -> usize {
        self.shards.len()
    }

    /// Ids on the list: exact when no other thread is pushing or popping, approximate otherwise
    /// (it may briefly count an id whose push has not landed yet or whose pop has already landed).
    pub fn len(&self) -> usize {
        self.shards.iter().map(|s| s.len.load(Ordering::Relaxed)).sum()
    }

    /// True when [`FreeList::len`] is 0 (same caveat under concurrency).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pops a free id, starting at the calling thread's home shard and stealing from the others
    /// when it is empty. `None` when every shard was seen empty (see the module docs).
    #[inline]
    pub fn pop(&self) -> Option<u32> {
        self.pop_near(home_hint())
    }

    /// Pushes `id` back on the calling thread's home shard. The caller must own `id` (it popped it
    /// and has not pushed it since).
    ///
    /// Panics if `id >= capacity()`; debug builds also panic if `id` is already on the list.
    #[inline]
    pub fn push(&self, id: u32) {
        self.push_near(home_hint(), id)
    }

    /// [`FreeList::pop`] starting at shard `hint % shards()` (for callers with their own spread,
    /// e.g. a rank number, and for loom models, where every thread's default home is shard 0).
    pub fn pop_near(&self, hint: usize) -> Option<u32> {
        let home = hint & self.shard_mask;
        for k in 0..self.shards.len() {
            let s = (home + k) & self.shard_mask;
            if let Some(id) = self.pop_shard(s) {
                return Some(id);
            }
        }
        None
    }

    /// [`FreeList::push`] onto shard `hint % shards()`. Same contract and panics.
    pub fn push_near(&self, hint: usize, id: u32) {
        assert!(id < self.capacity, "free-list push of id {id}, capacity is {}", self.capacity);
        #[cfg(debug_assertions)]
        {
            let was = self.listed[id as usize].swap(true, Ordering::Relaxed);
            assert!(!was, "free-list push of id {id} which is already free (double free)");
        }
        let shard = &self.shards[hint & self.shard_mask];
        // Counted before it lands, so the shard's counter never underflows (module docs).
        shard.len.fetch_add(1, Ordering::Relaxed);
        let link = &self.next[id as usize];
        let mut head = shard.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(head);
            link.store(top, Ordering::Relaxed);
            match shard.head.compare_exchange_weak(head, pack(tag, id + 1), Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return,
                Err(actual) => {
                    head = actual;
                    crate::sync::spin_loop();
                }
            }
        }
    }

    /// One pop attempt loop on shard `s`: `None` only when the shard is seen empty.
    fn pop_shard(&self, s: usize) -> Option<u32> {
        let shard = &self.shards[s];
        let mut head = shard.head.load(Ordering::Acquire);
        loop {
            let (tag, top) = unpack(head);
            if top == 0 {
                return None;
            }
            let id = top - 1;
            let below = self.next[id as usize].load(Ordering::Relaxed);
            #[cfg(not(kvtier_seeded_bug = "freelist-aba"))]
            let new_tag = tag.wrapping_add(1);
            // Seeded bug: the tag stays, so a head that went i -> ... -> i again looks unchanged.
            #[cfg(kvtier_seeded_bug = "freelist-aba")]
            let new_tag = tag;
            match shard.head.compare_exchange_weak(head, pack(new_tag, below), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
                    shard.len.fetch_sub(1, Ordering::Relaxed);
                    #[cfg(debug_assertions)]
                    {
                        let was = self.listed[id as usize].swap(false, Ordering::Relaxed);
                        assert!(was, "free list handed out id {id} which was not on the list");
                    }
                    return Some(id);
                }
                Err(actual) => {
                    head = actual;
                    crate::sync::spin_loop();
                }
            }
        }
    }
}

impl std::fmt::Debug for FreeList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FreeList")
            .field("capacity", &self.capacity)
            .field("shards", &self.shards.len())
            .field("len", &self.len())
            .finish()
    }
}

/// The calling thread's home-shard hint: a number assigned once per thread from a global counter.
#[cfg(not(loom))]
#[inline]
fn home_hint() -> usize {
    use crate::sync::AtomicUsize as Counter;
    static NEXT_THREAD: Counter = Counter::new(0);
    std::thread_local! {
        static HOME: usize = NEXT_THREAD.fetch_add(1, Ordering::Relaxed);
    }
    HOME.with(|h| *h)
}

/// Under loom every thread's home is shard 0 (a global counter would make the model's executions
/// differ); models spread threads with [`FreeList::pop_near`] / [`FreeList::push_near`].
#[cfg(loom)]
#[inline]
fn home_hint() -> usize {
    0
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::AtomicBool;
    use std::collections::HashSet;

    #[test]
    fn packs_tag_and_index() {
        assert_eq!(unpack(pack(7, 42)), (7, 42));
        assert_eq!(unpack(pack(u32::MAX, u32::MAX)), (u32::MAX, u32::MAX));
        assert_eq!(pack(1, 0), 1 << 32);
    }

    #[test]
    fn shard_counts() {
        assert_eq!(FreeList::with_shards(100, 3).shards(), 4);
        assert_eq!(FreeList::with_shards(100, 64).shards(), MAX_SHARDS);
        assert_eq!(FreeList::with_shards(100, 0).shards(), 1);
        assert_eq!(FreeList::with_shards(3, 16).shards(), 4);
        assert_eq!(FreeList::with_shards(1, 16).shards(), 1);
        assert_eq!(FreeList::with_shards(0, 16).shards(), 1);
        let d = FreeList::new(1000).shards();
        assert!(d.is_power_of_two() && d <= MAX_SHARDS);
    }

    #[test]
    fn every_id_once_then_none() {
        for shards in [1, 2, 4, 16] {
            let f = FreeList::with_shards(37, shards);
            assert_eq!((f.capacity(), f.len()), (37, 37));
            let mut seen = HashSet::new();
            for k in 0..37 {
                let id = f.pop().expect("an id while not empty");
                assert!(id < 37 && seen.insert(id), "id {id} twice");
                assert_eq!(f.len(), 36 - k);
            }
            assert_eq!(f.pop(), None);
            assert!(f.is_empty());
            f.push(5);
            assert_eq!(f.len(), 1);
            assert_eq!(f.pop(), Some(5));
            assert_eq!(f.pop(), None);
        }
    }

    #[test]
    fn single_shard_is_lifo_from_zero() {
        let f = FreeList::with_shards(4, 1);
        assert_eq!([f.pop(), f.pop()], [Some(0), Some(1)]);
        f.push(0);
        assert_eq!([f.pop(), f.pop(), f.pop(), f.pop()], [Some(0), Some(2), Some(3), None]);
    }

    #[test]
    fn steals_from_other_shards() {
        let f = FreeList::with_shards(8, 4); // shard s holds 2s, 2s+1
        let got: Vec<u32> = (0..8).map(|_| f.pop_near(2).unwrap()).collect();
        assert_eq!(got, [4, 5, 6, 7, 0, 1, 2, 3]);
        assert_eq!(f.pop_near(1), None);
        f.push_near(3, 1);
        assert_eq!(f.pop_near(0), Some(1));
    }

    #[test]
    fn empty_list() {
        let f = FreeList::new(0);
        assert_eq!((f.capacity(), f.len(), f.pop()), (0, 0, None));
    }

    #[test]
    #[should_panic(expected = "capacity is 4")]
    fn push_out_of_range_panics() {
        FreeList::with_shards(4, 1).push(4);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "double free")]
    fn double_push_panics_in_debug() {
        FreeList::with_shards(4, 1).push(2);
    }

    /// 4 threads pop and push; a per-id owner flag proves no id has two owners at once, and every
    /// id is back at the end.
    #[test]
    fn concurrent_pop_push_single_owner() {
        const N: u32 = 64;
        for shards in [1, 4] {
            let f = FreeList::with_shards(N, shards);
            let owned: Vec<AtomicBool> = (0..N).map(|_| AtomicBool::new(false)).collect();
            std::thread::scope(|s| {
                for t in 0..4usize {
                    let (f, owned) = (&f, &owned);
                    s.spawn(move || {
                        let mut held = Vec::new();
                        for round in 0..20_000usize {
                            if held.len() < 8 && (round + t) % 3 != 0 {
                                if let Some(id) = f.pop() {
                                    assert!(!owned[id as usize].swap(true, Ordering::AcqRel), "id {id} two owners");
                                    held.push(id);
                                }
                            } else if let Some(id) = held.pop() {
                                owned[id as usize].store(false, Ordering::Release);
                                f.push_near(t + round, id);
                            }
                        }
                        for id in held {
                            owned[id as usize].store(false, Ordering::Release);
                            f.push(id);
                        }
                    });
                }
            });
            assert_eq!(f.len(), N as usize);
            let mut all: Vec<u32> = std::iter::from_fn(|| f.pop()).collect();
            all.sort_unstable();
            assert_eq!(all, (0..N).collect::<Vec<_>>());
        }
    }
}
