//! [`FreeList`]: a lock-free free list of slot ids (`0..capacity`), the allocator under
//! [`crate::HostPool`].
//!
//! # Layout
//!
//! The list is a set of *shards*, each a Treiber stack, plus one count of the ids a pop may take,
//! `avail`. A stack's head is one 64-bit word:
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
//! a time, so one array serves every shard. Shards and `avail` sit on their own cache lines.
//!
//! A thread pushes to and pops from its *home* shard (its [`crate::sync::thread_number`] modulo the
//! shard count) and, when that is empty, steals from the others in order. With one shard per core
//! (the default: next power of two at or above the available parallelism, capped at 16) threads
//! rarely touch the same head word. Callers that know a better spread (a rank number) use
//! [`FreeList::pop_near`] / [`FreeList::push_near`].
//!
//! # Exact pops: a `None` means the list was empty
//!
//! A sweep over the shards alone cannot tell "empty" from "missed": while it visits the shards one by
//! one, an id can be pushed to a shard it has already visited and another one taken from a shard it
//! has not reached, so it sees every shard empty although the list never was. For the pool that is a
//! save which evicts a ready block while a slot is free. So a pop first *reserves* an id from
//! `avail`, the count of ids on the stacks that no pop has claimed yet:
//!
//! - `push(i)`: put `i` on a stack (the head CAS), *then* increment `avail`.
//! - `pop`: decrement `avail` if it is positive (a CAS loop); if it is 0, return `None`. Otherwise the
//!   pop holds a reservation and sweeps the shards, again and again if need be, until it takes an id.
//!
//! Write `P` for the ids on the stacks, `U` for the pushes whose head CAS has landed but whose
//! increment has not, and `R` for the pops that reserved but have not taken an id yet. Every step
//! keeps `avail = P - U - R` (a landing adds to `P` and `U`, its increment moves one from `U` to
//! `avail`; a reservation moves one from `avail` to `R`, a take removes one from `P` and from `R`),
//! and `avail` never goes below 0, so `P >= R + U >= R` at every instant:
//!
//! - **A reserved pop finds an id.** While it holds its reservation `R >= 1`, so some stack holds an
//!   id at every instant. A sweep that sees every shard empty therefore raced with other threads'
//!   successful head CASes (the id it was heading for was taken, or moved to a shard already visited),
//!   so the pop sweeps again; pops and pushes stay lock-free (a sweep fails only when another operation
//!   succeeded), though a reserved pop is not wait-free.
//! - **`None` is linearizable emptiness.** Linearize a push at its increment and a pop at its
//!   successful reservation, or, for `None`, at the CAS `0 -> 0` that confirms `avail == 0` (a
//!   read-modify-write reads the latest value in `avail`'s modification order, so a stale plain load
//!   cannot make a pop give up). Each point lies inside its call, and in that order the list is a
//!   count of available ids equal to `avail`; a `None` pop sees it at 0. So a pop returns `None` only
//!   if, at an instant during the call, every id whose push had completed was claimed by a pop in
//!   progress: in particular never while an id that no one else is taking sits on the list throughout
//!   the call. Ids are interchangeable (any free slot serves a save), so a reserved pop may take an
//!   id whose push has landed but not been counted yet, leaving the counted one on its stack for the
//!   next pop: a relabelling of equal ids, not a miss.
//!
//! `avail` is one more counter write per push and per pop, as the per-shard lengths it replaces were,
//! but on a line that every thread writes (see `cargo bench --bench slab` for what that costs).
//!
//! The seeded bug `freelist-missed-pop` (`src/seeded.rs`) brings the miss back (a pop that
//! finds nothing in one sweep gives its reservation back and returns `None`); the loom model
//! `pop_racing_push_and_pop_finds_an_id` fails with it.
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
//! it only installs `i` on top of the head it saw. The reservation does not touch the heads, so it
//! changes nothing here.
//!
//! The seeded bug `freelist-aba` removes the tag increment;
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
//! - `avail`: a push's increment is a `Release` RMW after its landing CAS, and a pop's reservation an
//!   `Acquire` RMW before its sweep. All RMWs on `avail` continue the release sequence of every
//!   earlier increment, so a reserved pop's sweep sees (at least) every landing that was counted
//!   before its reservation. The counting argument itself needs only atomicity: each unit is taken
//!   by exactly one decrement-if-positive CAS.
//!
//! Every CAS retry, and every repeated sweep, calls [`crate::sync::spin_loop`] (under loom it yields
//! to other threads).
//!
//! # Guarantees
//!
//! - An id popped is owned by the caller until it pushes it back; no other pop returns it meanwhile.
//! - `pop` returns `None` only if the list was empty at an instant during the call (above).
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
}

/// A lock-free list of free slot ids `0..capacity`. See the module docs for the design, why a pop
/// that returns `None` is exact, the ABA argument and the memory orderings.
pub struct FreeList {
    shards: Box<[CachePadded<Shard>]>,
    /// `shards.len() - 1` (the shard count is a power of two).
    shard_mask: usize,
    /// Ids on the stacks that no pop has reserved, minus pushes not yet counted (module docs).
    avail: CachePadded<AtomicUsize>,
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
        let next: Box<[AtomicU32]> = crate::sync::table(n as usize, |_| AtomicU32::new(0));
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
            heads.push(CachePadded::new(Shard { head: AtomicU64::new(pack(0, top)) }));
        }
        FreeList {
            shards: heads.into_boxed_slice(),
            shard_mask: shards - 1,
            avail: CachePadded::new(AtomicUsize::new(n as usize)),
            next,
            #[cfg(debug_assertions)]
            listed: crate::sync::table(n as usize, |_| crate::sync::AtomicBool::new(true)),
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

    /// Ids a pop could reserve now: exact when no other thread is pushing or popping. Under
    /// concurrency it leaves out ids whose push has not been counted yet and ids already reserved
    /// by a pop in progress.
    pub fn len(&self) -> usize {
        self.avail.load(Ordering::Relaxed)
    }

    /// True when [`FreeList::len`] is 0 (same caveat under concurrency).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pops a free id, starting at the calling thread's home shard and stealing from the others
    /// when it is empty. `None` only if the list was empty at an instant during the call (module
    /// docs).
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
        if !self.reserve() {
            return None;
        }
        // Reserved: some stack holds an id for this pop at every instant (module docs), so a sweep
        // that finds none raced with other threads' CASes and is repeated.
        let home = hint & self.shard_mask;
        loop {
            for k in 0..self.shards.len() {
                let s = (home + k) & self.shard_mask;
                if let Some(id) = self.pop_shard(s) {
                    return Some(id);
                }
            }
            if crate::seeded::seeded("freelist-missed-pop") {
                // Seeded bug: the old single sweep; give the reservation back and report empty.
                self.avail.fetch_add(1, Ordering::Release);
                return None;
            }
            crate::sync::spin_loop();
        }
    }

    /// Takes one unit of `avail` if it is positive; false if an RMW read it as 0.
    #[inline]
    fn reserve(&self) -> bool {
        let mut n = self.avail.load(Ordering::Relaxed);
        loop {
            if n == 0 {
                // Confirm with an RMW: it reads the latest value in `avail`'s modification order,
                // which makes the `None` linearizable (module docs).
                match self.avail.compare_exchange(0, 0, Ordering::Acquire, Ordering::Relaxed) {
                    Ok(_) => return false,
                    Err(now) => n = now,
                }
                continue;
            }
            match self.avail.compare_exchange_weak(n, n - 1, Ordering::Acquire, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => {
                    n = now;
                    crate::sync::spin_loop();
                }
            }
        }
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
        let link = &self.next[id as usize];
        let mut head = shard.head.load(Ordering::Relaxed);
        loop {
            let (tag, top) = unpack(head);
            link.store(top, Ordering::Relaxed);
            match shard.head.compare_exchange_weak(head, pack(tag, id + 1), Ordering::Release, Ordering::Relaxed) {
                Ok(_) => break,
                Err(actual) => {
                    head = actual;
                    crate::sync::spin_loop();
                }
            }
        }
        // Counted only once it is on a stack, so a pop that reserves it will find an id.
        self.avail.fetch_add(1, Ordering::Release);
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
            // Seeded bug: the tag stays, so a head that went i -> ... -> i again looks unchanged.
            let new_tag = if crate::seeded::seeded("freelist-aba") { tag } else { tag.wrapping_add(1) };
            match shard.head.compare_exchange_weak(head, pack(new_tag, below), Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => {
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

/// The calling thread's home-shard hint: its [`crate::sync::thread_number`].
#[cfg(not(loom))]
#[inline]
fn home_hint() -> usize {
    crate::sync::thread_number()
}

/// Under loom every thread's home is shard 0, so the tier models' state spaces do not grow with the
/// shard count; models spread threads with [`FreeList::pop_near`] / [`FreeList::push_near`].
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

    /// 4 threads each hold at most one of 5 ids and move ids between shards (pop near their home,
    /// push to another shard), so at every instant at least one id is on the list: no pop may
    /// return `None`. (A single-sweep pop can miss here: an id pushed to a shard the sweep has passed
    /// while the last other one is taken from a shard ahead of it; loom_freelist proves the case.)
    #[test]
    fn pop_never_misses_while_an_id_is_listed() {
        const T: usize = 4;
        let f = FreeList::with_shards(T as u32 + 1, 4);
        let misses = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for t in 0..T {
                let (f, misses) = (&f, &misses);
                s.spawn(move || {
                    // Under Miri (ci/miri.sh) fewer rounds: every step is interpreted.
                    for round in 0..if cfg!(miri) { 200 } else { 200_000usize } {
                        match f.pop_near(t) {
                            Some(id) => f.push_near(t + 1 + round % 3, id),
                            None => {
                                misses.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                });
            }
        });
        assert_eq!(misses.load(Ordering::Relaxed), 0, "pops that found nothing while an id was listed");
        assert_eq!(f.len(), T + 1);
    }

    #[test]
    fn len_counts_pushes_and_pops() {
        let f = FreeList::with_shards(3, 2);
        assert_eq!(f.len(), 3);
        let a = f.pop_near(1).unwrap();
        let b = f.pop_near(1).unwrap();
        assert_eq!(f.len(), 1);
        f.push_near(0, a);
        assert_eq!(f.len(), 2);
        f.push_near(1, b);
        assert_eq!(f.len(), 3);
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
                        for round in 0..if cfg!(miri) { 150 } else { 20_000usize } {
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
