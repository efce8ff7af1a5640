//! Everything the index does differently under loom (`--cfg loom`), in one place.
//!
//! The rest of the index is the same code in both builds; it takes its atomics from [`crate::sync`]
//! (std or loom) and its epoch from crossbeam-epoch (whose `loom` feature switches it to loom's
//! atomics). What differs is listed here:
//!
//! | item                   | normal build                     | loom build                              |
//! |------------------------|----------------------------------|-----------------------------------------|
//! | [`STRIPES`]            | 32                               | 2 (a two-thread model uses both)        |
//! | [`MAX_BATCH`]          | 64                               | 2                                       |
//! | [`BATCH_DIVISOR`]      | `4 * STRIPES`                    | 2 (tiny tables still batch)             |
//! | [`MIGRATION_CHUNK`]    | 1024 buckets                     | 4 (a two-chunk table has two helpers)   |
//! | [`stripe`]             | per-thread number mod `STRIPES`  | the same, numbered per loom execution   |
//! | [`Liveness`]           | nothing (zero-sized)             | a loom `alive` flag in every entry      |
//! | [`retire_entry`]       | `defer_destroy` (frees the entry)| clears `alive` and leaks the entry      |
//!
//! Why the entry is leaked under loom: a use-after-free of an entry is not reliably visible to loom
//! (freed memory may still hold the right bytes). So under loom a retired entry's "destructor" only
//! clears its `alive` flag, and every read of an entry checks the flag ([`Liveness::check`]). A read
//! that races the destructor then fails in every explored interleaving where the destructor runs
//! first, whatever the freed memory would have held.

use crossbeam_epoch::{Guard, Shared};

/// Counter stripes (a power of two): `len` and each table's load grants are split over this
/// many cache-line-padded counters, one per thread (threads share a stripe only beyond this count).
#[cfg(not(loom))]
pub(super) const STRIPES: usize = 32;
/// Counter stripes (a power of two); two under loom, so a two-thread model uses both.
#[cfg(loom)]
pub(super) const STRIPES: usize = 2;

/// Largest batch of load grants a stripe takes from its table's global count at once.
#[cfg(not(loom))]
pub(super) const MAX_BATCH: usize = 64;
/// Largest batch of load grants a stripe takes at once; two under loom so models exercise the
/// batching, the credit and the stealing paths.
#[cfg(loom)]
pub(super) const MAX_BATCH: usize = 2;

/// A table with load limit `limit` grants batches of `limit / BATCH_DIVISOR` (clamped to
/// `1..=MAX_BATCH`): all stripes together then hold at most a quarter of the limit as unspent credit.
#[cfg(not(loom))]
pub(super) const BATCH_DIVISOR: usize = 4 * STRIPES;
/// Under loom, `limit / 2`, so the models' 4- and 8-bucket tables still grant batches of 2.
#[cfg(loom)]
pub(super) const BATCH_DIVISOR: usize = 2;

/// Buckets per migration work unit: several threads help by claiming chunks.
#[cfg(not(loom))]
pub(super) const MIGRATION_CHUNK: usize = 1024;
/// Buckets per migration work unit; tiny under loom, so a two-chunk table lets the models
/// interleave helpers.
#[cfg(loom)]
pub(super) const MIGRATION_CHUNK: usize = 4;

/// This thread's counter stripe, `< STRIPES`: the thread's number ([`crate::sync::thread_number`],
/// assigned from a counter on first use) modulo [`STRIPES`]. Up to `STRIPES` threads therefore each
/// write their own cache lines. Under loom the numbering restarts in every explored execution (see
/// `thread_number`), so a model's stripes are deterministic.
#[inline]
pub(super) fn stripe() -> usize {
    crate::sync::thread_number() & (STRIPES - 1)
}

/// An entry's liveness: nothing in a normal build.
#[cfg(not(loom))]
pub(super) struct Liveness;

#[cfg(not(loom))]
impl Liveness {
    /// A live entry's flag.
    #[inline(always)]
    pub(super) fn new() -> Self {
        Liveness
    }

    /// Checks the entry was not reclaimed (a no-op: the epoch guard is the protection).
    #[inline(always)]
    pub(super) fn check(&self) {}
}

/// An entry's liveness under loom: cleared (instead of freeing the entry) when it is reclaimed.
#[cfg(loom)]
pub(super) struct Liveness(crate::sync::AtomicBool);

#[cfg(loom)]
impl Liveness {
    /// A live entry's flag.
    pub(super) fn new() -> Self {
        Liveness(crate::sync::AtomicBool::new(true))
    }

    /// Panics if the entry was reclaimed: a read that the epoch did not protect.
    pub(super) fn check(&self) {
        assert!(self.0.load(crate::sync::Ordering::Acquire), "use after free: read of a reclaimed index entry");
    }
}

/// Hands a removed entry to the epoch collector; `liveness` finds the entry's flag (used under
/// loom only).
///
/// # Safety
/// `p` must be a non-null entry pointer that was just unlinked by this thread's successful CAS (so it
/// is retired exactly once) and is no longer reachable from the live table.
#[cfg_attr(not(loom), allow(unused_variables))]
pub(super) unsafe fn retire_entry<T>(guard: &Guard, p: Shared<'_, T>, liveness: fn(&T) -> &Liveness) {
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
        // that a late read is detected instead of being undefined behaviour (module docs).
        unsafe {
            guard.defer_unchecked(move || {
                let e = &*(addr as *const T);
                let was = liveness(e).0.swap(false, crate::sync::Ordering::AcqRel);
                assert!(was, "index entry reclaimed twice");
            })
        };
    }
}
