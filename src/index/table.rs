//! The bucket array: entries, the tag bits of a bucket word, and linear probing.
//!
//! A [`Table`] is a power-of-two array of `crossbeam_epoch::Atomic<Entry>`, probed linearly from
//! [`ContentKey::hash64`]. A bucket holds a pointer plus four tag bits (an [`Entry`] is 16-byte
//! aligned, so the low 4 bits of its address are free): bit 0 is [`MOVED`], and bits 1-3 are a 3-bit
//! hash fragment when the pointer is an entry, or the [`TOMBSTONE`] value when it is null:
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
//! The load bound (module `load`) keeps at least half of the buckets empty, so every probe ends
//! within a few buckets, and provably within one pass.

use super::load::LoadGrants;
use super::shim::Liveness;
use super::SlotRef;
use crate::key::ContentKey;
use crate::sync::{AtomicUsize, Ordering};
use crossbeam_epoch::{Atomic, Guard, Shared};
use crossbeam_utils::CachePadded;
use std::collections::TryReserveError;

/// Tag bit: the bucket was frozen by a migration (with a null or an entry pointer).
pub(super) const MOVED: usize = 0b0001;
/// Tag value (with a null pointer only): the bucket's entry was removed.
pub(super) const TOMBSTONE: usize = 0b0010;
/// Tag bits (with an entry pointer only): the entry's hash fragment, see [`fragment`].
pub(super) const FRAG_MASK: usize = 0b1110;

/// The hash fragment stored in the tag bits of a bucket that holds an entry with hash `h`: the top 3
/// bits of `h` (the bucket index uses the low bits), so a probe skips 7 of 8 non-matching entries
/// without dereferencing them.
#[inline]
pub(super) fn fragment(h: u64) -> usize {
    ((h >> 61) as usize) << 1
}

/// Smallest bucket array (a table always keeps half its buckets empty, so this holds 2 entries).
pub(super) const MIN_BUCKETS: usize = 4;

/// Largest bucket array: the largest power of two whose bytes fit in `isize::MAX` (Rust's limit on
/// one allocation), 2^59 buckets on a 64-bit target.
pub(super) const MAX_BUCKETS: usize =
    1 << (usize::BITS - 1 - (isize::MAX as usize / std::mem::size_of::<Atomic<Entry>>()).leading_zeros());

/// One key -> value pair. Heap-allocated once, immutable once published, shared by an old and a new
/// table during a migration, freed exactly once (by the remover's deferred destructor or by
/// `BlockIndex`'s `Drop`). Aligned to 16 bytes (its size is 32) so a bucket has 4 tag bits, and so
/// the allocator's ordinary `malloc` path (16-byte aligned) serves it.
#[repr(align(16))]
pub(super) struct Entry {
    key: ContentKey,
    value: SlotRef,
    /// Zero-sized in a normal build; under loom, the flag that catches a read after reclamation.
    pub(super) alive: Liveness,
}

// The four tag bits must fit below the alignment of `Entry` (crossbeam would silently drop them).
const _: () = assert!(std::mem::align_of::<Entry>() > (MOVED | TOMBSTONE | FRAG_MASK));

impl Entry {
    pub(super) fn new(key: ContentKey, value: SlotRef) -> Self {
        Entry { key, value, alive: Liveness::new() }
    }

    /// The key (under loom, also checks the entry was not reclaimed).
    #[inline]
    pub(super) fn key(&self) -> ContentKey {
        let k = self.key;
        self.alive.check();
        k
    }

    /// The value (under loom, also checks the entry was not reclaimed).
    #[inline]
    pub(super) fn value(&self) -> SlotRef {
        let v = self.value;
        self.alive.check();
        v
    }
}

/// A table's migration progress (the steps are in `migrate.rs`).
pub(super) struct Migration {
    /// The table being filled by a migration of this one; null until the freeze phase ends.
    pub(super) next: Atomic<Table>,
    /// Freeze chunks claimed so far; non-zero means a migration has started.
    pub(super) freeze_claimed: AtomicUsize,
    /// Freeze chunks finished.
    pub(super) freeze_done: AtomicUsize,
    /// Live entries seen by the freeze.
    pub(super) frozen_live: AtomicUsize,
    /// Copy chunks claimed.
    pub(super) copy_claimed: AtomicUsize,
    /// Copy chunks finished.
    pub(super) copy_done: AtomicUsize,
}

impl Migration {
    pub(super) fn new() -> Self {
        Migration {
            next: Atomic::null(),
            freeze_claimed: AtomicUsize::new(0),
            freeze_done: AtomicUsize::new(0),
            frozen_live: AtomicUsize::new(0),
            copy_claimed: AtomicUsize::new(0),
            copy_done: AtomicUsize::new(0),
        }
    }
}

/// One bucket array plus its load grants and migration state.
///
/// Field placement is about cache lines: the read-only header (`buckets`, `mask`, and the limit and
/// batch size at the head of `load`) is read by every operation, so nothing that is written often may
/// share its line. The load counters are written by inserts and sit in their own padded lines; the
/// migration state, written only while migrating, in another.
pub(super) struct Table {
    pub(super) buckets: Box<[Atomic<Entry>]>,
    /// `buckets.len() - 1` (the length is a power of two).
    pub(super) mask: usize,
    /// LoadGrants for inserts: the bound that keeps half of the buckets empty.
    pub(super) load: LoadGrants,
    /// Migration state, written only while migrating.
    pub(super) mig: CachePadded<Migration>,
}

impl Table {
    /// A table of `n` (a power of two, `MIN_BUCKETS..=MAX_BUCKETS`) empty buckets, with `used` load
    /// grants already given (the entries a migration will copy in). Aborts if the allocation
    /// fails, like `Vec`.
    pub(super) fn new(n: usize, used: usize) -> Self {
        Self::with_buckets((0..n).map(|_| Atomic::null()).collect(), used)
    }

    /// [`Table::new`], reporting a failed allocation instead of aborting.
    pub(super) fn try_new(n: usize, used: usize) -> Result<Self, TryReserveError> {
        let mut buckets = Vec::new();
        buckets.try_reserve_exact(n)?;
        buckets.extend((0..n).map(|_| Atomic::null()));
        Ok(Self::with_buckets(buckets.into_boxed_slice(), used))
    }

    fn with_buckets(buckets: Box<[Atomic<Entry>]>, used: usize) -> Self {
        let n = buckets.len();
        debug_assert!(n.is_power_of_two() && (MIN_BUCKETS..=MAX_BUCKETS).contains(&n));
        debug_assert!(used <= n / 2);
        Table { buckets, mask: n - 1, load: LoadGrants::new(n / 2, used), mig: CachePadded::new(Migration::new()) }
    }

    /// Bucket `i` of the probe sequence of hash `h`.
    #[inline]
    pub(super) fn bucket(&self, h: u64, i: usize) -> &Atomic<Entry> {
        let idx = (h as usize).wrapping_add(i) & self.mask;
        debug_assert!(idx < self.buckets.len());
        // SAFETY: `mask == buckets.len() - 1` and the length is a power of two, so `idx < len`.
        unsafe { self.buckets.get_unchecked(idx) }
    }

    /// Looks `key` up, reading through `MOVED` marks (a frozen table is a consistent snapshot).
    #[inline]
    pub(super) fn find<'g>(&'g self, key: &ContentKey, guard: &'g Guard) -> Option<&'g Entry> {
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
            // guard drops (module docs of `index`, "Reclamation").
            let e = unsafe { cur.deref() };
            if e.key() == *key {
                return Some(e);
            }
        }
        None
    }

    /// Starts loading the entry that the first bucket of `key`'s probe path holds, if that bucket
    /// holds an entry whose hash fragment matches (most likely `key`'s own): reads the bucket (call
    /// it after a prefetch of it) and prefetches what its pointer names, without dereferencing it.
    #[inline]
    pub(super) fn prefetch_entry(&self, key: &ContentKey, guard: &Guard) {
        let h = key.hash64();
        let cur = self.bucket(h, 0).load(Ordering::Acquire, guard);
        if !cur.is_null() && cur.tag() & FRAG_MASK == fragment(h) {
            crate::sync::prefetch_read(cur.as_raw());
        }
    }

    /// Puts an entry that is known to be absent into the first empty bucket of its chain (migration
    /// only: no other writer touches this table yet, only other copiers).
    pub(super) fn place(&self, h: u64, p: Shared<'_, Entry>, guard: &Guard) {
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
