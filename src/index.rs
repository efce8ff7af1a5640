//! `BlockIndex`: the lock-free content-key -> (slot, generation) hash index.
//!
//! Every query of the host tier goes through here: an engine admitting a request asks for the longest
//! run of its prefix's block keys (about 43 keys for a long prompt) that the tier holds; every save
//! inserts one key per block, and every eviction removes one. Reads far outnumber writes and must never
//! wait, not even while the table grows.
//!
//! # Layout
//!
//! ```text
//!  BlockIndex { root ─┐ (own cache line), len: [stripe; 32] (one padded line each) }
//!                     v
//!  Table { buckets: [Atomic<Entry>; 2^k], mask, limit   (read-only header, own line)
//!          used (own line), credit: [stripe; 32] (one line each),
//!          migration: next ─> Table (only while migrating), counters (own line) }
//!             │
//!             v
//!  Entry { key: ContentKey, value: SlotRef }   (heap-allocated, 16-byte aligned, immutable once published)
//! ```
//!
//! Open addressing with linear probing from [`ContentKey::hash64`] over a power-of-two array of
//! `crossbeam_epoch::Atomic<Entry>`. A bucket holds a pointer plus four tag bits (an `Entry` is
//! 16-byte aligned, so the low 4 bits of its address are free): bit 0 is `MOVED`, and bits 1-3 are a
//! 3-bit hash fragment when the pointer is an entry, or the `TOMBSTONE` value when it is null:
//!
//! | bucket word             | meaning                                                          |
//! |-------------------------|------------------------------------------------------------------|
//! | `null`                  | empty: ends every probe chain; the only state an insert may fill |
//! | `ptr \| frag`           | live entry whose hash has top 3 bits `frag`                       |
//! | `null \| TOMBSTONE`     | removed; probes walk past it; never reused (keeps chains intact) |
//! | `x \| MOVED`            | `x` frozen by a migration: no writer may change it again         |
//!
//! The fragment (the top bits of the hash, independent of the low bits that pick the bucket) lets a
//! probe skip 7 of 8 entries of other keys without dereferencing them: a lookup's cache misses are
//! then its bucket and its own entry, rarely a neighbour's. It is written with the entry pointer by
//! the insert CAS and kept by the freeze and by the copy into the next table, so it is always the
//! fragment of the entry it sits beside.
//!
//! Each bucket only moves forward: `null -> ptr -> null|TOMBSTONE`, and `null` or `ptr -> x|MOVED`. A
//! bucket never becomes empty again, which is what makes the probe chains race-free: the first empty
//! bucket on a key's probe path is the only place that key can be inserted, so two racing inserts of
//! one key meet at the same bucket and exactly one CAS wins (two saves of one key move bytes once).
//!
//! A table's *load* is bounded by `used`, the reservations granted for inserts: every bucket that
//! went non-empty (live entries plus tombstones) was filled by an insert holding a reservation taken
//! before its CAS. `used` never exceeds `limit = buckets / 2` (it only grows by CASes that check the
//! limit), and the non-empty buckets plus in-flight reservations plus unspent credit add up to at
//! most `used`, so a table always keeps at least half of its buckets empty and every probe ends
//! within a few buckets (and provably within one pass). A reservation that finds no room fails and
//! starts a migration instead.
//!
//! Reservations are taken in batches so that inserts on different cores do not fight over one
//! counter: a thread first spends its *stripe's* credit (a padded counter written by that thread
//! alone unless more than 32 threads share the stripes); when it has none it CASes `used` up by a
//! batch (`limit / 128`, between 1 and 64), keeps one and credits the rest to its stripe; when `used`
//! is at the limit it takes leftover credit from the other stripes before giving up, so a table
//! migrates only when every granted bucket is spent or in flight (or, in a narrow race, granted to a
//! thread that has not yet credited the rest of its batch: an early migration, harmless since the
//! next table is sized from the live count). An insert that gives its
//! reservation back (the key was present) returns it as credit. Credit dies with its table; the next
//! table starts with `used` equal to the live count it was sized for.
//!
//! # Migration (growth, shrink, and purging tombstones)
//!
//! Saves insert and evictions remove all the time, so even a table whose live count is constant fills
//! with tombstones; the same migration that grows the table also purges them. It runs in three steps
//! over chunks of 1024 buckets (4 under loom), each chunk claimed by an atomic counter so every writer
//! that arrives helps:
//!
//! 1. **Freeze.** Each bucket is CASed from `x` to `x|MOVED` (keeping the pointer), counting live
//!    entries. Tombstones are left as they are: no writer ever changes one. A frozen table is an
//!    immutable snapshot: writers' CASes on it fail.
//! 2. **Size.** The thread that freezes the last chunk knows the exact live count `n` and allocates
//!    `next` with `max(initial buckets, next_pow2(4 n))` buckets: it grows, keeps its size, or shrinks,
//!    never below the size chosen by [`BlockIndex::with_capacity`]. Sizing after the freeze (rather than
//!    when the migration starts, as a design that allocates `next` first would) means inserts racing
//!    the start can never overfill `next`; the price is that helpers wait for this one allocation.
//! 3. **Copy.** The *same entry pointers* (entries are shared, never copied) are CASed into the empty
//!    buckets of `next`; tombstones are dropped. The thread finishing the last chunk swaps `root` from
//!    the old table to `next` and `defer_destroy`s the old table, which frees its bucket array only,
//!    never the entries it points to.
//!
//! **Progress.** Readers never wait and never help: a reader treats `x|MOVED` exactly as `x`, so a
//! reader walking a frozen table reads a consistent snapshot. Writers that meet a migration (a started
//! freeze, a `MOVED` bucket, or a failed reservation) help finish it and retry in the new table; once
//! every chunk has been claimed they spin (with [`crate::sync::spin_loop`]) until the last claimer
//! finishes. So growth is lock-free for readers and *helping* (not lock-free) for writers: a writer can
//! wait for a migrator that was descheduled in the middle of a chunk. Chunks are small (1024 bucket
//! CASes, tens of µs), so that wait is short unless the migrator is preempted.
//!
//! # Why a reader's stale answer during a migration is safe for kvtier
//!
//! A reader that loaded the old root just before the swap may keep reading the frozen snapshot while
//! writers already work in `next`. It can therefore return a value removed a moment ago, or miss one
//! inserted a moment ago, but only for writes concurrent with that reader and a migration. Both are
//! harmless here:
//!
//! - *Missed insert*: a cache miss; the engine prefills instead. The host tier is a cache.
//! - *Removed value*: the index is never the final word. A query pins the slot with
//!   `SlotControl::pin(slot, generation)`, which succeeds only on a `READY` slot of that generation.
//!   Eviction removes the index entry (`remove_if`) *before* it bumps the slot's generation in
//!   `SlotControl::release`, so any reference still found in a snapshot carries an old generation once
//!   the slot can be reused, and the pin fails with `Stale`. No reader ever reads another block's bytes.
//!
//! Writers never act on a snapshot: `insert_if_absent` and `remove_if` treat any `MOVED` bucket as
//! "help and retry", so they are linearizable (each at its successful CAS or at the unfrozen bucket
//! read that decides its answer).
//!
//! # Memory ordering
//!
//! - **Publication.** An entry is written completely before the insert CAS (`AcqRel`), and every
//!   bucket load is `Acquire`, so a reader that sees the pointer sees the key and value. Entries are
//!   never mutated after publication.
//! - **Migration.** Freeze CASes are `AcqRel`; each freezer adds its live count to `frozen_live` and
//!   then increments `freeze_done` (`AcqRel` RMWs form one release sequence), so the last freezer sees
//!   every count and every frozen bucket. It publishes `next` with a `Release` store; copiers load it
//!   with `Acquire`, copy with `AcqRel` CASes, and increment `copy_done` (`AcqRel`); the last copier's
//!   root CAS (`AcqRel`) therefore happens after every copied pointer, and a reader's `Acquire` root
//!   load sees a complete table. The chain also carries the original inserts' `Release`, so entry
//!   contents are visible through `next` too.
//! - **Counters.** `len`, `used` and the credits are plain counters updated with `Relaxed` RMWs:
//!   atomicity alone makes the reservation bound exact (every grant is a CAS from the current value,
//!   every credit unit is taken by a decrement-if-positive CAS, so no unit is spent twice). `len` is
//!   striped: an insert increments its thread's stripe before the CAS that publishes the entry
//!   (decrements it if that CAS fails), and a remove decrements its own thread's stripe, which may be
//!   another one, so stripes are wrapping counts and only their sum is meaningful. Since a remover
//!   must first `Acquire`-load the entry, the true sum never goes below zero; [`BlockIndex::len`]
//!   reads the stripes one by one, may see a removal without its insert, and clamps at zero.
//! - **False sharing.** Every operation reads `root` and the table header, so both sit in cache lines
//!   that are written only by a migration; counters written by inserts and removes live in separate
//!   padded lines, one per thread for the stripes. A read-mostly workload's writes therefore never
//!   invalidate a line that the readers on other cores need.
//! - **Reclamation.** Removal CASes `ptr -> null|TOMBSTONE` and `defer_destroy`s the entry; a retired
//!   table array is `defer_destroy`ed after the root swap. Both are unreachable from `root` by then
//!   (an entry removed from `next` is in a retired table at most, which was unlinked before), so
//!   crossbeam-epoch frees them only after every thread pinned at that time has unpinned. Each
//!   operation holds one guard for its whole duration; [`IndexReader`] holds one across a batch.
//!
//! # Model checking
//!
//! Under `cfg(loom)` the atomics come from loom (through [`crate::sync`] and crossbeam-epoch's `loom`
//! feature) and the models in `loom-tests/index.rs` check racing inserts of one key, removal against a
//! lookup with reclamation, growth under a reader, removal racing a migration, and two writers helping
//! one two-chunk migration, and batched load reservations racing. A use-after-free of an entry is not reliably visible to loom
//! (freed memory may still hold the right bytes), so under loom an entry is not freed when retired:
//! its destructor clears a loom `alive` flag and leaks the allocation, and every read of an entry checks
//! the flag. A read that races the destructor then fails in every explored interleaving where the
//! destructor runs first, whatever the freed memory would have held. Under loom there are 2 stripes
//! (a model thread's stripe is its loom thread number) and batches of at most 2, so a model of two
//! threads exercises batched grants, credit and stealing (`batched_reservations_race`).
//! The feature `seeded-bug-index-early-unpin` makes [`BlockIndex::get`] unpin before reading
//! the entry's value; the models must catch it.

use crate::key::ContentKey;
use crate::slot::SlotId;
use crate::sync::{spin_loop, AtomicUsize, Ordering};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use crossbeam_utils::CachePadded;
use std::fmt;

/// Where a block lives: its slot and the slot generation it was saved under.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Hash)]
pub struct SlotRef {
    /// Host slot.
    pub slot: SlotId,
    /// Slot generation at reservation.
    pub generation: u64,
}

/// Tag bit: the bucket was frozen by a migration (with a null or an entry pointer).
const MOVED: usize = 0b0001;
/// Tag value (with a null pointer only): the bucket's entry was removed.
const TOMBSTONE: usize = 0b0010;
/// Tag bits (with an entry pointer only): the entry's hash fragment, see [`fragment`].
const FRAG_MASK: usize = 0b1110;

/// The hash fragment stored in the tag bits of a bucket that holds an entry with hash `h`: the top 3
/// bits of `h` (the bucket index uses the low bits), so a probe skips 7 of 8 non-matching entries
/// without dereferencing them.
#[inline]
fn fragment(h: u64) -> usize {
    ((h >> 61) as usize) << 1
}

/// Counter stripes (a power of two): `len` and each table's load reservations are split over this
/// many cache-line-padded counters, one per thread (threads share a stripe only beyond this count).
#[cfg(not(loom))]
const STRIPES: usize = 32;
/// Counter stripes (a power of two); two under loom, so a two-thread model uses both.
#[cfg(loom)]
const STRIPES: usize = 2;

/// Largest batch of load reservations a stripe takes from its table's global count at once.
#[cfg(not(loom))]
const MAX_BATCH: usize = 64;
/// Largest batch of load reservations a stripe takes at once; two under loom so models exercise the
/// batching, the credit and the stealing paths.
#[cfg(loom)]
const MAX_BATCH: usize = 2;

/// Reservation batch for a table whose load limit is `limit`: small enough that all stripes together
/// can hold at most a quarter of the limit as unspent credit, at least 1.
fn batch_for(limit: usize) -> usize {
    #[cfg(not(loom))]
    let b = limit / (4 * STRIPES);
    #[cfg(loom)]
    let b = limit / 2;
    b.clamp(1, MAX_BATCH)
}

/// This thread's counter stripe, `< STRIPES`: assigned round-robin on a thread's first call, so up to
/// [`STRIPES`] threads each write their own cache lines.
#[cfg(not(loom))]
#[inline]
fn stripe() -> usize {
    use std::cell::Cell;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    std::thread_local! {
        static STRIPE: Cell<usize> = const { Cell::new(usize::MAX) };
    }
    STRIPE.with(|s| {
        let mut v = s.get();
        if v == usize::MAX {
            v = NEXT.fetch_add(1, Ordering::Relaxed) & (STRIPES - 1);
            s.set(v);
        }
        v
    })
}

/// This thread's counter stripe under loom: the loom thread number (0 for the model's main thread,
/// then 1, 2, ... in spawn order) modulo [`STRIPES`], deterministic in every explored execution and
/// without adding atomics to the model.
#[cfg(loom)]
fn stripe() -> usize {
    let id = format!("{:?}", loom::thread::current().id());
    let n: usize = id.trim_start_matches("ThreadId(").trim_end_matches(')').parse().unwrap_or(0);
    n & (STRIPES - 1)
}

/// `STRIPES` zeroed, padded counters.
fn striped_counters() -> Box<[CachePadded<AtomicUsize>]> {
    (0..STRIPES).map(|_| CachePadded::new(AtomicUsize::new(0))).collect()
}

/// Smallest bucket array (a table always keeps half its buckets empty, so this holds 2 entries).
const MIN_BUCKETS: usize = 4;

/// Buckets per migration work unit: several threads help by claiming chunks. Under loom, tiny, so a
/// two-chunk table lets the models interleave helpers.
#[cfg(not(loom))]
const MIGRATION_CHUNK: usize = 1024;
/// Buckets per migration work unit: several threads help by claiming chunks. Under loom, tiny, so a
/// two-chunk table lets the models interleave helpers.
#[cfg(loom)]
const MIGRATION_CHUNK: usize = 4;

/// One key -> value pair. Heap-allocated once, immutable once published, shared by an old and a new
/// table during a migration, freed exactly once (by the remover's deferred destructor or by
/// [`BlockIndex`]'s `Drop`). Aligned to 16 bytes (its size is 32) so a bucket has 4 tag bits, and so
/// the allocator's ordinary `malloc` path (16-byte aligned) serves it.
#[repr(align(16))]
struct Entry {
    key: ContentKey,
    value: SlotRef,
    /// Under loom: cleared (instead of freeing) when the entry is reclaimed; see the module docs.
    #[cfg(loom)]
    alive: crate::sync::AtomicBool,
}

// The four tag bits must fit below the alignment of `Entry` (crossbeam would silently drop them).
const _: () = assert!(std::mem::align_of::<Entry>() > (MOVED | TOMBSTONE | FRAG_MASK));

impl Entry {
    fn new(key: ContentKey, value: SlotRef) -> Self {
        Entry {
            key,
            value,
            #[cfg(loom)]
            alive: crate::sync::AtomicBool::new(true),
        }
    }

    /// The key (under loom, also checks the entry was not reclaimed).
    #[inline]
    fn key(&self) -> ContentKey {
        let k = self.key;
        self.check_alive();
        k
    }

    /// The value (under loom, also checks the entry was not reclaimed).
    #[inline]
    fn value(&self) -> SlotRef {
        let v = self.value;
        self.check_alive();
        v
    }

    #[inline]
    fn check_alive(&self) {
        #[cfg(loom)]
        assert!(self.alive.load(Ordering::Acquire), "use after free: read of a reclaimed index entry");
    }
}

/// Hands a removed entry to the epoch collector.
///
/// # Safety
/// `p` must be a non-null entry pointer that was just unlinked by this thread's successful CAS (so it
/// is retired exactly once) and is no longer reachable from the live table.
unsafe fn retire_entry(guard: &Guard, p: Shared<'_, Entry>) {
    #[cfg(not(loom))]
    // SAFETY: the caller unlinked `p` (exactly once) and it is unreachable from `root`; threads that
    // could still hold it are pinned, and crossbeam runs the destructor only after they unpin.
    unsafe {
        guard.defer_destroy(p)
    };
    #[cfg(loom)]
    {
        let addr = p.as_raw() as usize;
        // SAFETY: same argument; under loom the "destructor" only clears `alive` and leaks the box so
        // that a late read is detected instead of being undefined behaviour (see module docs).
        unsafe {
            guard.defer_unchecked(move || {
                let e = &*(addr as *const Entry);
                assert!(e.alive.swap(false, Ordering::AcqRel), "index entry reclaimed twice");
            })
        };
    }
}

/// One bucket array plus its migration state.
///
/// Field placement is about cache lines: the read-only header (`buckets`, `mask`, ...) is read by
/// every operation, so nothing that is written often may share its line. The global load count and
/// the per-stripe credits are written by inserts and sit in their own padded lines; the migration
/// counters, written only while migrating, in another.
struct Table {
    buckets: Box<[Atomic<Entry>]>,
    /// `buckets.len() - 1` (the length is a power of two).
    mask: usize,
    /// Most non-empty buckets allowed (`buckets / 2`).
    limit: usize,
    /// Reservations a stripe takes from `used` at once ([`batch_for`]).
    batch: usize,
    /// Buckets granted for inserts, `<= limit` at all times: non-empty buckets (live + tombstones)
    /// plus in-flight reservations plus the unspent `credit` of every stripe.
    used: CachePadded<AtomicUsize>,
    /// Per stripe: granted (counted in `used`) but not yet spent reservations.
    credit: Box<[CachePadded<AtomicUsize>]>,
    /// Migration state, written only while migrating.
    mig: CachePadded<Migration>,
}

/// A table's migration progress (see the module docs, "Migration").
struct Migration {
    /// The table being filled by a migration of this one; null until the freeze phase ends.
    next: Atomic<Table>,
    /// Freeze chunks claimed so far; non-zero means a migration has started.
    freeze_claimed: AtomicUsize,
    /// Freeze chunks finished.
    freeze_done: AtomicUsize,
    /// Live entries seen by the freeze.
    frozen_live: AtomicUsize,
    /// Copy chunks claimed.
    copy_claimed: AtomicUsize,
    /// Copy chunks finished.
    copy_done: AtomicUsize,
}

impl Table {
    /// A table of `n` (a power of two, at least [`MIN_BUCKETS`]) empty buckets, with `used` preset to
    /// the number of entries a migration will copy in.
    fn new(n: usize, used: usize) -> Self {
        debug_assert!(n.is_power_of_two() && n >= MIN_BUCKETS);
        debug_assert!(used <= n / 2);
        Table {
            buckets: (0..n).map(|_| Atomic::null()).collect(),
            mask: n - 1,
            limit: n / 2,
            batch: batch_for(n / 2),
            used: CachePadded::new(AtomicUsize::new(used)),
            credit: striped_counters(),
            mig: CachePadded::new(Migration {
                next: Atomic::null(),
                freeze_claimed: AtomicUsize::new(0),
                freeze_done: AtomicUsize::new(0),
                frozen_live: AtomicUsize::new(0),
                copy_claimed: AtomicUsize::new(0),
                copy_done: AtomicUsize::new(0),
            }),
        }
    }

    /// Bucket `i` of the probe sequence of hash `h`.
    #[inline]
    fn bucket(&self, h: u64, i: usize) -> &Atomic<Entry> {
        let idx = (h as usize).wrapping_add(i) & self.mask;
        debug_assert!(idx < self.buckets.len());
        // SAFETY: `mask == buckets.len() - 1` and the length is a power of two, so `idx < len`.
        unsafe { self.buckets.get_unchecked(idx) }
    }

    #[inline]
    fn chunks(&self) -> usize {
        self.buckets.len().div_ceil(MIGRATION_CHUNK)
    }

    #[inline]
    fn chunk_range(&self, c: usize) -> std::ops::Range<usize> {
        let start = c * MIGRATION_CHUNK;
        start..(start + MIGRATION_CHUNK).min(self.buckets.len())
    }

    #[inline]
    fn migration_started(&self) -> bool {
        self.mig.freeze_claimed.load(Ordering::Acquire) != 0
    }

    /// Takes one unit of credit from stripe `s`; false if it has none.
    #[inline]
    fn take_credit(&self, s: usize) -> bool {
        let c = &self.credit[s];
        let mut cur = c.load(Ordering::Relaxed);
        while cur > 0 {
            match c.compare_exchange_weak(cur, cur - 1, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return true,
                Err(now) => {
                    cur = now;
                    spin_loop();
                }
            }
        }
        false
    }

    /// Reserves one empty bucket for an insert by the thread of stripe `s`; false (and nothing
    /// reserved) when the table is full.
    ///
    /// The fast path spends the stripe's own credit (one RMW on a line only this thread writes).
    /// Otherwise it grants itself up to `batch` reservations from `used` by a CAS that never passes
    /// `limit` (keeping one, crediting the rest to its stripe); when `used` is at the limit it takes
    /// credit left over by other stripes before reporting the table full, so a table migrates only
    /// when every granted bucket is spent or in flight.
    #[inline]
    fn reserve(&self, s: usize) -> bool {
        if self.take_credit(s) {
            return true;
        }
        let mut g = self.used.load(Ordering::Relaxed);
        while g < self.limit {
            let take = (self.limit - g).min(self.batch);
            match self.used.compare_exchange_weak(g, g + take, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => {
                    if take > 1 {
                        self.credit[s].fetch_add(take - 1, Ordering::Relaxed);
                    }
                    return true;
                }
                Err(now) => {
                    g = now;
                    spin_loop();
                }
            }
        }
        self.steal_credit(s)
    }

    /// The table is at its limit: takes a unit of another stripe's unspent credit, if any.
    #[cold]
    fn steal_credit(&self, s: usize) -> bool {
        (1..STRIPES).any(|d| self.take_credit((s + d) & (STRIPES - 1)))
    }

    /// Returns an unused reservation (taken by stripe `s`) as that stripe's credit.
    #[inline]
    fn unreserve(&self, s: usize) {
        self.credit[s].fetch_add(1, Ordering::Relaxed);
    }

    /// Looks `key` up, reading through `MOVED` marks (a frozen table is a consistent snapshot).
    #[inline]
    fn find<'g>(&'g self, key: &ContentKey, guard: &'g Guard) -> Option<&'g Entry> {
        let h = key.hash64();
        let frag = fragment(h);
        for i in 0..=self.mask {
            let cur = self.bucket(h, i).load(Ordering::Acquire, guard);
            if cur.is_null() {
                if cur.tag() & TOMBSTONE != 0 {
                    continue;
                }
                // Empty (frozen or not): the end of the chain.
                return None;
            }
            if cur.tag() & FRAG_MASK != frag {
                // Another key's entry (its fragment differs): skip it without dereferencing.
                continue;
            }
            // SAFETY: a non-null bucket pointer is a published entry; `guard` was pinned before `root`
            // (hence this table and bucket) was loaded, so the entry cannot be reclaimed before the
            // guard drops (module docs, "Reclamation").
            let e = unsafe { cur.deref() };
            if e.key() == *key {
                return Some(e);
            }
        }
        None
    }

    /// Freezes the buckets of chunk `c`; returns the live entries seen.
    fn freeze_chunk(&self, c: usize, guard: &Guard) -> usize {
        let mut live = 0;
        for b in &self.buckets[self.chunk_range(c)] {
            let mut cur = b.load(Ordering::Acquire, guard);
            loop {
                // Already frozen, or a tombstone: no writer ever changes a tombstone (inserts fill only
                // empty buckets, removals CAS only live pointers), so it needs no mark.
                if cur.tag() & MOVED != 0 || (cur.is_null() && cur.tag() & TOMBSTONE != 0) {
                    break;
                }
                match b.compare_exchange(
                    cur,
                    cur.with_tag(cur.tag() | MOVED),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                    guard,
                ) {
                    Ok(_) => break,
                    Err(e) => {
                        cur = e.current;
                        spin_loop();
                    }
                }
            }
            if !cur.is_null() {
                live += 1;
            }
        }
        live
    }

    /// Copies the live entries of frozen chunk `c` into `next`.
    fn copy_chunk(&self, c: usize, next: &Table, guard: &Guard) {
        for b in &self.buckets[self.chunk_range(c)] {
            let cur = b.load(Ordering::Acquire, guard);
            debug_assert!(cur.tag() & (MOVED | TOMBSTONE) != 0, "copying an unfrozen bucket");
            if cur.is_null() {
                continue;
            }
            // The same pointer with its hash fragment, without the MOVED mark.
            let p = cur.with_tag(cur.tag() & FRAG_MASK);
            // SAFETY: a frozen live bucket's entry cannot be removed until the root swap (writers
            // never change a MOVED bucket and `next` is not yet reachable), so it is alive.
            let h = unsafe { p.deref() }.key().hash64();
            next.place(h, p, guard);
        }
    }

    /// Puts an entry that is known to be absent into the first empty bucket of its chain (migration
    /// only: no other writer touches this table yet, only other copiers).
    fn place(&self, h: u64, p: Shared<'_, Entry>, guard: &Guard) {
        for i in 0..=self.mask {
            let b = self.bucket(h, i);
            if b.load(Ordering::Relaxed, guard).is_null()
                && b.compare_exchange(Shared::null(), p, Ordering::AcqRel, Ordering::Acquire, guard).is_ok()
            {
                return;
            }
        }
        unreachable!("migration target table is full: it was sized for the frozen live count");
    }
}

/// The lock-free block index: [`ContentKey`] -> [`SlotRef`].
///
/// Lookups (`get`, [`IndexReader::get`]) never wait, even during growth; `insert_if_absent` and
/// `remove_if` are lock-free except that they help (and may wait for) an in-progress migration. See
/// the module docs for the design, the ordering argument and why stale reads during a migration are
/// safe. Memory: 8 bytes per bucket plus one 32-byte heap entry per live key, plus about 8 KiB of
/// padded counter stripes for the index and for each table; the table keeps between
/// 1/4 and 1/2 of its buckets non-empty after a migration (so 16-32 bytes of buckets per live key).
pub struct BlockIndex {
    /// The current table, alone in its cache line: read by every operation, written only by a
    /// migration's root swap.
    root: CachePadded<Atomic<Table>>,
    /// Live entries (plus in-flight inserts), striped per thread: each stripe is a wrapping count
    /// (a stripe may go "negative" when a thread removes what another inserted); their wrapping sum
    /// is the count.
    len: Box<[CachePadded<AtomicUsize>]>,
    /// Bucket count chosen by `with_capacity`: migrations never shrink below it.
    min_buckets: usize,
}

impl BlockIndex {
    /// An index sized for about `expected` live entries without growing: `next_pow2(4 * expected)`
    /// buckets (at least 4), so it holds `expected` entries plus as many tombstones before the first
    /// migration. Migrations never shrink the table below this size.
    ///
    /// # Panics
    /// If `4 * expected` buckets overflow `usize` (like `Vec::with_capacity`).
    pub fn with_capacity(expected: usize) -> Self {
        let n = expected
            .checked_mul(4)
            .and_then(usize::checked_next_power_of_two)
            .expect("BlockIndex capacity overflows usize")
            .max(MIN_BUCKETS);
        BlockIndex { root: CachePadded::new(Atomic::new(Table::new(n, 0))), len: striped_counters(), min_buckets: n }
    }

    /// [`BlockIndex::with_capacity`] without the panic: the largest capacity is bounded by the
    /// bucket array's size in bytes.
    ///
    /// # Errors
    /// [`crate::error::IndexError::CapacityTooLarge`].
    pub fn try_with_capacity(expected: usize) -> Result<Self, crate::error::IndexError> {
        let max = (isize::MAX as usize / 64) / 4;
        if expected > max {
            return Err(crate::error::IndexError::CapacityTooLarge { requested: expected, max });
        }
        Ok(Self::with_capacity(expected))
    }

    /// Bucket count for a table receiving `live` entries: a quarter full, never below the initial size.
    fn table_size(&self, live: usize) -> usize {
        live.saturating_mul(4).checked_next_power_of_two().unwrap_or(usize::MAX / 2 + 1).max(self.min_buckets)
    }

    #[inline]
    fn root<'g>(&self, guard: &'g Guard) -> (Shared<'g, Table>, &'g Table) {
        let t = self.root.load(Ordering::Acquire, guard);
        // SAFETY: `root` is never null (set in `with_capacity`, only ever swapped to a non-null
        // `next`), and a table swapped out is destroyed only after every guard pinned before the swap
        // (such as `guard`, pinned before this load) is dropped.
        (t, unsafe { t.deref() })
    }

    /// Inserts `key -> value` unless `key` is present.
    ///
    /// Returns `Ok(())` when inserted, or `Err(existing)` with the value already stored for `key` (the
    /// index is unchanged). Of several racing inserts of one key exactly one returns `Ok`; the others
    /// return its value. May help (and wait for) a migration.
    pub fn insert_if_absent(&self, key: ContentKey, value: SlotRef) -> Result<(), SlotRef> {
        let guard = epoch::pin();
        let h = key.hash64();
        let frag = fragment(h);
        let s = stripe();
        // Allocated at the first empty bucket, reused across retries, freed if never published.
        let mut new: Option<Owned<Entry>> = None;
        'retry: loop {
            let (t_sh, t) = self.root(&guard);
            if t.migration_started() {
                self.help_migrate(t_sh, &guard);
                continue 'retry;
            }
            let mut reserved = false;
            let mut i = 0;
            while i <= t.mask {
                let b = t.bucket(h, i);
                let cur = b.load(Ordering::Acquire, &guard);
                if cur.tag() & MOVED != 0 {
                    if reserved {
                        t.unreserve(s);
                    }
                    self.help_migrate(t_sh, &guard);
                    continue 'retry;
                }
                if cur.is_null() {
                    if cur.tag() & TOMBSTONE != 0 {
                        i += 1;
                        continue;
                    }
                    // Empty: the first empty bucket of the chain, so `key` is absent; claim it.
                    if !reserved {
                        if !t.reserve(s) {
                            self.help_migrate(t_sh, &guard);
                            continue 'retry;
                        }
                        reserved = true;
                    }
                    let entry = new.take().unwrap_or_else(|| Owned::new(Entry::new(key, value)).with_tag(frag));
                    self.len[s].fetch_add(1, Ordering::Relaxed);
                    match b.compare_exchange(Shared::null(), entry, Ordering::AcqRel, Ordering::Acquire, &guard) {
                        Ok(_) => return Ok(()),
                        Err(e) => {
                            // Lost the bucket: look at what won it (same `i`).
                            self.len[s].fetch_sub(1, Ordering::Relaxed);
                            new = Some(e.new);
                            spin_loop();
                            continue;
                        }
                    }
                }
                if cur.tag() & FRAG_MASK != frag {
                    // Another key's entry (see `Table::find`).
                    i += 1;
                    continue;
                }
                // SAFETY: published entry, protected by `guard` (see `Table::find`).
                let e = unsafe { cur.deref() };
                if e.key() == key {
                    if reserved {
                        t.unreserve(s);
                    }
                    return Err(e.value());
                }
                i += 1;
            }
            unreachable!("index probe found no empty bucket: the load limit keeps half the table empty");
        }
    }

    /// Looks `key` up: `Some(value)` if present. Never waits. Pins the epoch once per call; for a batch
    /// of keys use [`BlockIndex::reader`].
    pub fn get(&self, key: &ContentKey) -> Option<SlotRef> {
        let guard = epoch::pin();
        let (_, t) = self.root(&guard);
        #[cfg(not(feature = "seeded-bug-index-early-unpin"))]
        {
            t.find(key, &guard).map(Entry::value)
        }
        #[cfg(feature = "seeded-bug-index-early-unpin")]
        {
            // SEEDED BUG (loom must catch it): unpin before reading the value, so a concurrent
            // removal's deferred destructor may already have run.
            let raw: *const Entry = t.find(key, &guard).map_or(std::ptr::null(), |e| e as *const Entry);
            drop(guard);
            // SAFETY: none: this is the seeded use-after-free.
            (!raw.is_null()).then(|| unsafe { (*raw).value() })
        }
    }

    /// Removes `key` only if it maps to `expected` (same slot and generation). Returns true if this
    /// call removed it; false if `key` is absent, maps to another value, or a racing call removed it
    /// first. May help (and wait for) a migration. The entry is reclaimed once no reader can hold it.
    pub fn remove_if(&self, key: &ContentKey, expected: SlotRef) -> bool {
        let guard = epoch::pin();
        let h = key.hash64();
        let frag = fragment(h);
        'retry: loop {
            let (t_sh, t) = self.root(&guard);
            for i in 0..=t.mask {
                let b = t.bucket(h, i);
                let cur = b.load(Ordering::Acquire, &guard);
                if cur.tag() & MOVED != 0 {
                    self.help_migrate(t_sh, &guard);
                    continue 'retry;
                }
                if cur.is_null() {
                    if cur.tag() & TOMBSTONE != 0 {
                        continue;
                    }
                    return false;
                }
                if cur.tag() & FRAG_MASK != frag {
                    continue;
                }
                // SAFETY: published entry, protected by `guard` (see `Table::find`).
                let e = unsafe { cur.deref() };
                if e.key() != *key {
                    continue;
                }
                if e.value() != expected {
                    return false;
                }
                let tomb = Shared::null().with_tag(TOMBSTONE);
                return match b.compare_exchange(cur, tomb, Ordering::AcqRel, Ordering::Acquire, &guard) {
                    Ok(_) => {
                        self.len[stripe()].fetch_sub(1, Ordering::Relaxed);
                        // SAFETY: our CAS unlinked `cur` from the live table (the only table writers
                        // change), so we retire it exactly once.
                        unsafe { retire_entry(&guard, cur) };
                        true
                    }
                    // A bucket holding an entry only becomes a tombstone (someone else removed it:
                    // false) or frozen (retry in the next table).
                    Err(err) if err.current.tag() & MOVED != 0 => {
                        spin_loop();
                        self.help_migrate(t_sh, &guard);
                        continue 'retry;
                    }
                    Err(_) => false,
                };
            }
            unreachable!("index probe found no empty bucket: the load limit keeps half the table empty");
        }
    }

    /// Helps migrate table `t_sh` (starting the migration if needed) and returns once `root` no
    /// longer points at it.
    #[cold]
    fn help_migrate(&self, t_sh: Shared<'_, Table>, guard: &Guard) {
        // SAFETY: `t_sh` was loaded from `root` under `guard`, which keeps it allocated.
        let t = unsafe { t_sh.deref() };
        let chunks = t.chunks();
        // Phase 1: freeze.
        while t.mig.freeze_claimed.load(Ordering::Acquire) < chunks {
            let c = t.mig.freeze_claimed.fetch_add(1, Ordering::AcqRel);
            if c >= chunks {
                break;
            }
            let live = t.freeze_chunk(c, guard);
            t.mig.frozen_live.fetch_add(live, Ordering::AcqRel);
            if t.mig.freeze_done.fetch_add(1, Ordering::AcqRel) + 1 == chunks {
                // Last freezer: every count and frozen bucket happens-before this point.
                let live = t.mig.frozen_live.load(Ordering::Acquire);
                let next = Owned::new(Table::new(self.table_size(live), live));
                t.mig.next.store(next, Ordering::Release);
            }
        }
        // Phase 2: wait for `next` (allocated by the last freezer).
        let next_sh = loop {
            let n = t.mig.next.load(Ordering::Acquire, guard);
            if !n.is_null() {
                break n;
            }
            spin_loop();
        };
        // SAFETY: `next` is non-null and outlives `t` (it becomes the root, or is retired after `t`).
        let next = unsafe { next_sh.deref() };
        // Phase 3: copy.
        while t.mig.copy_claimed.load(Ordering::Acquire) < chunks {
            let c = t.mig.copy_claimed.fetch_add(1, Ordering::AcqRel);
            if c >= chunks {
                break;
            }
            t.copy_chunk(c, next, guard);
            if t.mig.copy_done.fetch_add(1, Ordering::AcqRel) + 1 == chunks {
                // Last copier: every copied pointer happens-before the swap.
                let swapped = self.root.compare_exchange(t_sh, next_sh, Ordering::AcqRel, Ordering::Acquire, guard);
                assert!(swapped.is_ok(), "index root changed during its migration");
                // SAFETY: `t` is now unreachable from `root`; dropping it frees its bucket array only
                // (`Atomic` has no destructor), never the entries it shares with `next`.
                unsafe { guard.defer_destroy(t_sh) };
            }
        }
        // Phase 4: wait for the last copier's swap.
        while self.root.load(Ordering::Acquire, guard) == t_sh {
            spin_loop();
        }
    }

    /// A read handle that pins the epoch once for a batch of lookups (a ~43-key prefix query pays one
    /// pin instead of 43). Hold it only for the batch: while it lives, memory retired by removals and
    /// migrations cannot be reclaimed. Not `Send` (the pin belongs to this thread).
    pub fn reader(&self) -> IndexReader<'_> {
        IndexReader { index: self, guard: epoch::pin() }
    }

    /// Live entries. Exact when no insert or remove is in flight; otherwise it may briefly count an
    /// insert that is about to lose its race, or miss operations that land on stripes while they are
    /// summed. Costs one load per stripe (32 cache lines): meant for statistics, not hot paths.
    pub fn len(&self) -> usize {
        let sum = self.len.iter().fold(0usize, |acc, c| acc.wrapping_add(c.load(Ordering::Relaxed)));
        // A sum taken while operations run may see a removal but not the insert it follows.
        (sum as isize).max(0) as usize
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Buckets in the current table (a power of two). At most half of them are non-empty (live
    /// entries plus tombstones); a migration resizes to `max(initial, next_pow2(4 * len))`.
    pub fn capacity(&self) -> usize {
        let guard = epoch::pin();
        self.root(&guard).1.buckets.len()
    }
}

impl fmt::Debug for BlockIndex {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let guard = epoch::pin();
        let (_, t) = self.root(&guard);
        f.debug_struct("BlockIndex")
            .field("len", &self.len())
            .field("capacity", &t.buckets.len())
            .field("used", &t.used.load(Ordering::Relaxed))
            .field("migrating", &t.migration_started())
            .finish()
    }
}

impl Drop for BlockIndex {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no other thread can reach this index, so nothing is concurrently
        // loaded or retired through it.
        let guard = unsafe { epoch::unprotected() };
        let root = self.root.load(Ordering::Relaxed, guard);
        // SAFETY: `root` is never null.
        let t = unsafe { root.deref() };
        // Every entry still referenced is in `root` (frozen or not): a migration's `next` holds only
        // pointers also present in its frozen source, and retired tables never own entries. Removed
        // entries were handed to the collector already. So freeing `root`'s pointers frees each live
        // entry exactly once.
        for b in t.buckets.iter() {
            let cur = b.load(Ordering::Relaxed, guard);
            if !cur.is_null() {
                // SAFETY: a non-null bucket pointer is an entry allocated by `Owned::new` and owned by
                // the index (never retired: retired entries were replaced by a tombstone first).
                drop(unsafe { cur.into_owned() });
            }
        }
        let next = t.mig.next.load(Ordering::Relaxed, guard);
        if !next.is_null() {
            // A migration was interrupted (only possible after a panic): free `next`'s array only.
            // SAFETY: allocated by `Owned::new`, unreachable from anywhere else.
            drop(unsafe { next.into_owned() });
        }
        // SAFETY: the root table was allocated by `Owned::new` and is owned by the index.
        drop(unsafe { root.into_owned() });
    }
}

/// A batch lookup handle: one epoch pin for many [`IndexReader::get`] calls (see
/// [`BlockIndex::reader`]).
pub struct IndexReader<'a> {
    index: &'a BlockIndex,
    guard: epoch::Guard,
}

impl IndexReader<'_> {
    /// Looks `key` up: `Some(value)` if present. Never waits. Each call reads the current root, so a
    /// long batch follows migrations.
    #[inline]
    pub fn get(&self, key: &ContentKey) -> Option<SlotRef> {
        let (_, t) = self.index.root(&self.guard);
        t.find(key, &self.guard).map(Entry::value)
    }
}

impl fmt::Debug for IndexReader<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IndexReader").field("index", self.index).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::{AtomicBool, AtomicUsize, Ordering};
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn k(i: u64) -> ContentKey {
        ContentKey::from_words(i, i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
    }

    fn v(slot: u32, generation: u64) -> SlotRef {
        SlotRef { slot: SlotId(slot), generation }
    }

    #[test]
    fn index_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<BlockIndex>();
        check::<SlotRef>();
    }

    #[test]
    fn insert_get_remove_semantics() {
        let ix = BlockIndex::with_capacity(16);
        assert!(ix.is_empty());
        assert_eq!(ix.capacity(), 64);
        assert_eq!(ix.get(&k(1)), None);
        assert_eq!(ix.insert_if_absent(k(1), v(7, 3)), Ok(()));
        assert_eq!(ix.insert_if_absent(k(2), v(8, 0)), Ok(()));
        assert_eq!(ix.len(), 2);
        assert_eq!(ix.get(&k(1)), Some(v(7, 3)));
        assert_eq!(ix.get(&k(2)), Some(v(8, 0)));
        // Wrong generation, wrong slot, absent key: nothing removed.
        assert!(!ix.remove_if(&k(1), v(7, 4)));
        assert!(!ix.remove_if(&k(1), v(6, 3)));
        assert!(!ix.remove_if(&k(3), v(7, 3)));
        assert_eq!(ix.get(&k(1)), Some(v(7, 3)));
        assert_eq!(ix.len(), 2);
        // Right value: removed once.
        assert!(ix.remove_if(&k(1), v(7, 3)));
        assert!(!ix.remove_if(&k(1), v(7, 3)));
        assert_eq!(ix.get(&k(1)), None);
        assert_eq!(ix.get(&k(2)), Some(v(8, 0)));
        assert_eq!(ix.len(), 1);
        // Re-insert after removal (past the tombstone) with a new generation.
        assert_eq!(ix.insert_if_absent(k(1), v(7, 4)), Ok(()));
        assert_eq!(ix.get(&k(1)), Some(v(7, 4)));
        assert_eq!(ix.len(), 2);
        let r = ix.reader();
        assert_eq!(r.get(&k(1)), Some(v(7, 4)));
        assert_eq!(r.get(&k(2)), Some(v(8, 0)));
        assert_eq!(r.get(&k(9)), None);
    }

    #[test]
    fn insert_present_returns_existing() {
        let ix = BlockIndex::with_capacity(4);
        assert_eq!(ix.insert_if_absent(k(5), v(1, 10)), Ok(()));
        assert_eq!(ix.insert_if_absent(k(5), v(2, 20)), Err(v(1, 10)));
        assert_eq!(ix.insert_if_absent(k(5), v(1, 10)), Err(v(1, 10)));
        assert_eq!(ix.get(&k(5)), Some(v(1, 10)));
        assert_eq!(ix.len(), 1);
    }

    #[test]
    fn grows_from_tiny_capacity_and_keeps_every_key() {
        let ix = BlockIndex::with_capacity(0);
        assert_eq!(ix.capacity(), MIN_BUCKETS);
        const N: u64 = 20_000;
        for i in 0..N {
            assert_eq!(ix.insert_if_absent(k(i), v(i as u32, i * 3)), Ok(()), "key {i}");
        }
        assert_eq!(ix.len(), N as usize);
        // Quarter full right after a migration, at most half full before the next one.
        let cap = ix.capacity();
        assert!(cap.is_power_of_two() && cap >= 2 * N as usize && cap <= 8 * N as usize, "capacity {cap}");
        for i in 0..N {
            assert_eq!(ix.get(&k(i)), Some(v(i as u32, i * 3)), "key {i}");
        }
        for i in N..N + 1000 {
            assert_eq!(ix.get(&k(i)), None);
        }
        for i in 0..N {
            assert_eq!(ix.insert_if_absent(k(i), v(0, 0)), Err(v(i as u32, i * 3)));
        }
    }

    #[test]
    fn churn_keeps_len_exact_and_capacity_bounded() {
        // 32 live keys, 200k insert/remove cycles: tombstones must be purged by same-size rehashes.
        let ix = BlockIndex::with_capacity(64);
        assert_eq!(ix.capacity(), 256);
        const LIVE: u64 = 32;
        for i in 0..LIVE {
            ix.insert_if_absent(k(i), v(i as u32, 0)).unwrap();
        }
        for i in LIVE..200_000 {
            let old = i - LIVE;
            assert!(ix.remove_if(&k(old), v(old as u32, 0)));
            assert_eq!(ix.insert_if_absent(k(i), v(i as u32, 0)), Ok(()));
            assert_eq!(ix.len(), LIVE as usize);
            assert_eq!(ix.capacity(), 256, "at cycle {i}");
        }
        for i in 200_000 - LIVE..200_000 {
            assert_eq!(ix.get(&k(i)), Some(v(i as u32, 0)));
        }
        assert_eq!(ix.get(&k(200_000 - LIVE - 1)), None);
    }

    #[test]
    fn shrinks_back_to_initial_size() {
        let ix = BlockIndex::with_capacity(8);
        assert_eq!(ix.capacity(), 32);
        for i in 0..10_000 {
            ix.insert_if_absent(k(i), v(1, i)).unwrap();
        }
        assert!(ix.capacity() >= 16_384);
        for i in 0..10_000 {
            assert!(ix.remove_if(&k(i), v(1, i)));
        }
        assert_eq!(ix.len(), 0);
        // The next migration (triggered when tombstones + new entries reach half) sizes from the live
        // count, so after enough inserts the table is back at its initial size.
        let mut i = 10_000;
        while ix.capacity() != 32 {
            ix.insert_if_absent(k(i), v(2, i)).unwrap();
            assert!(ix.remove_if(&k(i), v(2, i)));
            i += 1;
            assert!(i < 100_000, "never shrank");
        }
        assert!(ix.is_empty());
        assert_eq!(ix.insert_if_absent(k(1), v(3, 3)), Ok(()));
        assert_eq!(ix.get(&k(1)), Some(v(3, 3)));
    }

    #[test]
    fn debug_shows_len_and_capacity() {
        let ix = BlockIndex::with_capacity(1);
        ix.insert_if_absent(k(1), v(1, 1)).unwrap();
        let s = format!("{ix:?}");
        assert!(s.starts_with("BlockIndex { len: 1, capacity: 4,"), "{s}");
    }

    #[test]
    fn concurrent_inserts_of_same_keys_have_one_winner() {
        const T: u32 = 4;
        const N: u64 = 5_000;
        let ix = BlockIndex::with_capacity(1); // grows many times while threads race
        let wins: Vec<Vec<(u64, Result<(), SlotRef>)>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..T)
                .map(|t| {
                    let ix = &ix;
                    s.spawn(move || (0..N).map(|i| (i, ix.insert_if_absent(k(i), v(t, i)))).collect::<Vec<_>>())
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert_eq!(ix.len(), N as usize);
        for i in 0..N {
            let stored = ix.get(&k(i)).expect("present");
            let winners: Vec<u32> = (0..T).filter(|&t| wins[t as usize][i as usize].1.is_ok()).collect();
            assert_eq!(winners.len(), 1, "key {i}: winners {winners:?}");
            assert_eq!(stored, v(winners[0], i));
            for t in 0..T {
                if t != winners[0] {
                    assert_eq!(wins[t as usize][i as usize].1, Err(stored), "loser sees the winner's value");
                }
            }
        }
    }

    #[test]
    fn readers_during_growth_find_old_keys_and_never_a_wrong_value() {
        const PRE: u64 = 500;
        const NEW: u64 = 40_000;
        let ix = BlockIndex::with_capacity(1);
        for i in 0..PRE {
            ix.insert_if_absent(k(i), v(i as u32, i + 1)).unwrap();
        }
        let done = AtomicBool::new(false);
        let rounds = AtomicUsize::new(0);
        std::thread::scope(|s| {
            for w in 0..2u64 {
                let (ix, done) = (&ix, &done);
                s.spawn(move || {
                    for i in (PRE + w..PRE + NEW).step_by(2) {
                        ix.insert_if_absent(k(i), v(i as u32, i + 1)).unwrap();
                    }
                    done.store(true, Ordering::Release);
                });
            }
            for r in 0..2 {
                let (ix, done, rounds) = (&ix, &done, &rounds);
                s.spawn(move || {
                    let mut probe = PRE;
                    loop {
                        let finished = done.load(Ordering::Acquire);
                        if r == 0 {
                            for i in 0..PRE {
                                assert_eq!(ix.get(&k(i)), Some(v(i as u32, i + 1)), "pre-inserted key {i}");
                            }
                        } else {
                            let rd = ix.reader();
                            for i in 0..PRE {
                                assert_eq!(rd.get(&k(i)), Some(v(i as u32, i + 1)), "pre-inserted key {i}");
                            }
                        }
                        for _ in 0..PRE {
                            if let Some(got) = ix.get(&k(probe)) {
                                assert_eq!(got, v(probe as u32, probe + 1), "concurrently inserted key {probe}");
                            }
                            probe = if probe + 1 == PRE + NEW { PRE } else { probe + 1 };
                        }
                        rounds.fetch_add(1, Ordering::Relaxed);
                        if finished {
                            break;
                        }
                    }
                });
            }
        });
        assert!(rounds.load(Ordering::Relaxed) >= 2);
        assert_eq!(ix.len(), (PRE + NEW) as usize);
        for i in 0..PRE + NEW {
            assert_eq!(ix.get(&k(i)), Some(v(i as u32, i + 1)));
        }
    }

    #[test]
    fn concurrent_churn_keeps_len_exact() {
        // Each thread owns a disjoint key range and cycles insert/remove far beyond the capacity, while
        // the other threads force migrations (same-size rehashes) that every writer must help with.
        const T: u64 = 4;
        const LIVE: u64 = 16;
        const CYCLES: u64 = 20_000;
        let ix = BlockIndex::with_capacity(8);
        std::thread::scope(|s| {
            for t in 0..T {
                let ix = &ix;
                s.spawn(move || {
                    let base = t << 40;
                    for i in 0..CYCLES {
                        assert_eq!(ix.insert_if_absent(k(base + i), v(t as u32, i)), Ok(()));
                        if i >= LIVE {
                            let old = i - LIVE;
                            assert!(ix.remove_if(&k(base + old), v(t as u32, old)));
                            assert_eq!(ix.get(&k(base + old)), None);
                        }
                        assert_eq!(ix.get(&k(base + i)), Some(v(t as u32, i)));
                    }
                });
            }
        });
        assert_eq!(ix.len(), (T * LIVE) as usize);
        // Live count at any migration is at most T * (LIVE + 1), so at most next_pow2(4 * 68) buckets.
        assert!(ix.capacity() <= 512, "capacity {}", ix.capacity());
        for t in 0..T {
            for i in 0..CYCLES {
                let want = (i >= CYCLES - LIVE).then_some(v(t as u32, i));
                assert_eq!(ix.get(&k((t << 40) + i)), want);
            }
        }
    }

    #[test]
    fn batched_reservations_fill_the_table_exactly() {
        // 512 buckets: limit 256, batches of 2. Another thread's insert leaves one unit of credit on
        // its stripe; this thread's 255 inserts must use it rather than migrate early.
        let ix = BlockIndex::with_capacity(128);
        assert_eq!(ix.capacity(), 512);
        std::thread::scope(|s| {
            s.spawn(|| ix.insert_if_absent(k(0), v(0, 0)).unwrap());
        });
        for i in 1..256 {
            assert_eq!(ix.insert_if_absent(k(i), v(1, i)), Ok(()));
        }
        assert_eq!(ix.capacity(), 512);
        assert_eq!(ix.len(), 256);
        assert_eq!(ix.insert_if_absent(k(256), v(1, 256)), Ok(()));
        assert_eq!(ix.capacity(), 1024);
        assert_eq!(ix.len(), 257);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u8, u32, u8),
        Remove(u8, u32, u8),
        Get(u8),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => (0u8..48, 0u32..4, 0u8..3).prop_map(|(key, s, g)| Op::Insert(key, s, g)),
            2 => (0u8..48, 0u32..4, 0u8..3).prop_map(|(key, s, g)| Op::Remove(key, s, g)),
            2 => (0u8..48).prop_map(Op::Get),
        ]
    }

    proptest! {
        #[test]
        fn matches_std_hashmap(cap in 0usize..8, ops in proptest::collection::vec(op(), 1..600)) {
            let ix = BlockIndex::with_capacity(cap);
            let mut model: HashMap<u8, SlotRef> = HashMap::new();
            for o in ops {
                match o {
                    Op::Insert(key, s, g) => {
                        let val = v(s, g as u64);
                        let want = match model.get(&key) {
                            Some(&old) => Err(old),
                            None => {
                                model.insert(key, val);
                                Ok(())
                            }
                        };
                        prop_assert_eq!(ix.insert_if_absent(k(key as u64), val), want);
                    }
                    Op::Remove(key, s, g) => {
                        let val = v(s, g as u64);
                        let want = model.get(&key) == Some(&val);
                        if want {
                            model.remove(&key);
                        }
                        prop_assert_eq!(ix.remove_if(&k(key as u64), val), want);
                    }
                    Op::Get(key) => prop_assert_eq!(ix.get(&k(key as u64)), model.get(&key).copied()),
                }
                prop_assert_eq!(ix.len(), model.len());
            }
            let rd = ix.reader();
            for key in 0u8..48 {
                prop_assert_eq!(rd.get(&k(key as u64)), model.get(&key).copied());
            }
        }
    }
}
