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
//!  Table { buckets: [Atomic<Entry>; 2^k], mask          (read-only header)
//!          load: limit, batch (read-only), used (own line), credit: [stripe; 32] (one line each)
//!          mig: next ─> Table (only while migrating), counters (own line) }
//!             │
//!             v
//!  Entry { key: ContentKey, value: SlotRef }   (heap-allocated, 16-byte aligned, immutable once published)
//! ```
//!
//! The design in four parts, each in its own file of this module:
//!
//! - **Table and probing** (`table.rs`): open addressing with linear probing from
//!   [`ContentKey::hash64`]. A bucket word is a pointer plus four tag bits: empty, a live entry with a
//!   3-bit hash fragment (so a probe skips most other keys' entries without dereferencing them), a
//!   tombstone, or any of these frozen (`MOVED`) by a migration. A bucket only moves forward (empty ->
//!   entry -> tombstone; anything -> frozen) and never becomes empty again, so the first empty bucket
//!   on a key's probe path is the only place that key can be inserted: two racing inserts of one key
//!   meet at one bucket and exactly one CAS wins.
//! - **Load grants** (`load.rs`): an insert takes a grant of a bucket before its CAS, from a
//!   count that never passes half the buckets, so a table keeps at least half of its buckets empty
//!   and every probe ends within a few buckets. LoadGrants are granted to per-thread stripes in
//!   batches, and the live count is striped the same way, so inserts on different cores write
//!   different cache lines.
//! - **Migration** (`migrate.rs`): a grant request that finds the table full freezes it and copies its
//!   live entries (the same pointers) into a new table sized for the live count: this grows, shrinks
//!   and purges tombstones. Every writer that arrives helps; readers never help and never wait.
//! - **The loom shim** (`shim.rs`): everything that differs in a model-checking build.
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
//! - **Migration.** Freeze and copy CASes are `AcqRel`, and the chunk counters are `AcqRel` RMWs
//!   (one release sequence each), so the last freezer sees every frozen bucket and the live count,
//!   publishes `next` with `Release`, and the last copier's root CAS (`AcqRel`) happens after every
//!   copied pointer: a reader's `Acquire` root load sees a complete table. The chain also carries the
//!   original inserts' `Release`, so entry contents are visible through `next` too (`migrate.rs`
//!   walks through each edge).
//! - **Counters.** `len`, `used` and the credits are plain counters updated with `Relaxed` RMWs:
//!   atomicity alone makes the grant bound exact (every grant is a CAS from the current value,
//!   every credit unit is taken by a decrement-if-positive CAS, so no unit is spent twice). An insert
//!   increments its thread's `len` stripe before the CAS that publishes the entry (decrements it if
//!   that CAS fails), and a remove decrements its own thread's stripe. Since a remover must first
//!   `Acquire`-load the entry, the true sum never goes below zero; [`BlockIndex::len`] reads the
//!   stripes one by one, may see a removal without its insert, and clamps at zero.
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
//! Under `cfg(loom)` the atomics come from loom (through the crate's `sync` module and crossbeam-epoch's `loom`
//! feature), and `shim.rs` shrinks the stripes, batches and migration chunks so that two-thread
//! models reach every path, and turns a reclaimed entry into a detectable "use after free" instead of
//! freed memory. The models in `loom-tests/index.rs` check racing inserts of one key, removal against
//! a lookup with reclamation, growth under a reader, removal racing a migration, two writers helping
//! one two-chunk migration, and batched load grants racing. The seeded bug
//! `index-early-unpin` (`src/seeded.rs`) makes [`BlockIndex::get`] unpin before reading the
//! entry's value; `remove_races_get_with_reclamation` must catch it.

mod load;
mod migrate;
mod shim;
mod table;
#[cfg(all(test, not(loom)))]
mod tests;

use crate::error::IndexError;
use crate::key::ContentKey;
use crate::slab::slot::SlotId;
use crate::sync::{spin_loop, Ordering};
use crossbeam_epoch::{self as epoch, Atomic, Guard, Owned, Shared};
use crossbeam_utils::CachePadded;
use load::LiveCount;
use std::fmt;
use table::{fragment, Entry, Table, FRAG_MASK, MAX_BUCKETS, MIN_BUCKETS, MOVED, TOMBSTONE};

/// Where a block lives: its slot and the slot generation it was saved under.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Hash)]
pub struct SlotRef {
    /// Host slot.
    pub slot: SlotId,
    /// Slot generation at the write reservation.
    pub generation: u64,
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
    /// Live entries (plus in-flight inserts), striped per thread.
    len: LiveCount,
    /// Bucket count chosen by `with_capacity`: migrations never shrink below it.
    min_buckets: usize,
}

impl BlockIndex {
    /// An index sized for about `expected` live entries without growing: `next_pow2(4 * expected)`
    /// buckets (at least 4, 8 bytes each), so it holds `expected` entries plus as many tombstones
    /// before the first migration. Migrations never shrink the table below this size.
    ///
    /// # Errors
    /// - [`IndexError::CapacityTooLarge`] if `expected` exceeds the largest capacity whose bucket
    ///   array fits in one allocation (`isize::MAX` bytes): 2^57 entries on a 64-bit target.
    /// - [`IndexError::OutOfMemory`] if the bucket array cannot be allocated.
    pub fn try_with_capacity(expected: usize) -> Result<Self, IndexError> {
        let max = MAX_BUCKETS / 4;
        if expected > max {
            return Err(IndexError::CapacityTooLarge { requested: expected, max });
        }
        // No overflow: 4 * expected <= MAX_BUCKETS, a power of two.
        let n = (4 * expected).next_power_of_two().max(MIN_BUCKETS);
        let table = Table::try_new(n, 0).map_err(|_| IndexError::OutOfMemory {
            requested: expected,
            bytes: (n * std::mem::size_of::<Atomic<Entry>>()) as u64,
        })?;
        // Numbers this thread before the index is shared (under loom, see `sync::thread_number`).
        shim::stripe();
        Ok(BlockIndex { root: CachePadded::new(Atomic::new(table)), len: LiveCount::new(), min_buckets: n })
    }

    /// [`BlockIndex::try_with_capacity`] for sizes known to be valid (the tier's slot count, tests).
    ///
    /// # Panics
    /// If `try_with_capacity` fails: `expected` above 2^57 (64-bit) or the bucket array cannot be
    /// allocated. Callers pass validated sizes, so a panic here is a broken invariant.
    pub fn with_capacity(expected: usize) -> Self {
        Self::try_with_capacity(expected).unwrap_or_else(|e| panic!("BlockIndex::with_capacity: {e}"))
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
        let s = shim::stripe();
        // Allocated at the first empty bucket, reused across retries, freed if never published.
        let mut new: Option<Owned<Entry>> = None;
        'retry: loop {
            let (t_sh, t) = self.root(&guard);
            if t.migration_started() {
                self.help_migrate(t_sh, &guard);
                continue 'retry;
            }
            let mut granted = false;
            let mut i = 0;
            while i <= t.mask {
                let b = t.bucket(h, i);
                let cur = b.load(Ordering::Acquire, &guard);
                if cur.tag() & MOVED != 0 {
                    if granted {
                        t.load.give_back(s);
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
                    if !granted {
                        if !t.load.take(s) {
                            self.help_migrate(t_sh, &guard);
                            continue 'retry;
                        }
                        granted = true;
                    }
                    let entry = new.take().unwrap_or_else(|| Owned::new(Entry::new(key, value)).with_tag(frag));
                    self.len.inc(s);
                    match b.compare_exchange(Shared::null(), entry, Ordering::AcqRel, Ordering::Acquire, &guard) {
                        Ok(_) => return Ok(()),
                        Err(e) => {
                            // Lost the bucket: look at what won it (same `i`).
                            self.len.dec(s);
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
                    if granted {
                        t.load.give_back(s);
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
        if !crate::seeded::seeded("index-early-unpin") {
            t.find(key, &guard).map(Entry::value)
        } else {
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
                        self.len.dec(shim::stripe());
                        // SAFETY: our CAS unlinked `cur` from the live table (the only table writers
                        // change), so we retire it exactly once.
                        unsafe { shim::retire_entry(&guard, cur, |e: &Entry| &e.alive) };
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
        self.len.sum()
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
            .field("used", &t.load.used.load(Ordering::Relaxed))
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

    /// Starts loading the first bucket of `key`'s probe path into the processor's caches
    /// (a prefetch, `sync::prefetch_read`) without waiting: call it for every key of a batch before
    /// their [`IndexReader::get`]s, so the batch's cache misses overlap. A hint only: it changes no
    /// answer.
    #[inline]
    pub fn prefetch(&self, key: &ContentKey) {
        let (_, t) = self.index.root(&self.guard);
        crate::sync::prefetch_read(t.bucket(key.hash64(), 0));
    }

    /// Starts loading the entry the first bucket of `key`'s probe path holds, when its hash
    /// fragment matches `key`'s: the second step of a batch's lookups, after
    /// [`IndexReader::prefetch`] of every key (this one reads the bucket). A hint only.
    #[inline]
    pub fn prefetch_entry(&self, key: &ContentKey) {
        let (_, t) = self.index.root(&self.guard);
        t.prefetch_entry(key, &self.guard);
    }
}

impl fmt::Debug for IndexReader<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("IndexReader").field("index", self.index).finish()
    }
}
