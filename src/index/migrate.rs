//! Migration: growth, shrink and purging tombstones, by freezing a table and copying its live
//! entries into a new one that several writers fill together.
//!
//! Saves insert and evictions remove all the time, so even a table whose live count is constant fills
//! with tombstones; the same migration that grows the table also purges them. It runs in three steps
//! over chunks of `MIGRATION_CHUNK` buckets (1024; 4 under loom), each chunk claimed by an atomic
//! counter so every writer that arrives helps:
//!
//! 1. **Freeze.** Each bucket is CASed from `x` to `x|MOVED` (keeping the pointer), counting live
//!    entries. Tombstones are left as they are: no writer ever changes one. A frozen table is an
//!    immutable snapshot: writers' CASes on it fail.
//! 2. **Size.** The thread that freezes the last chunk knows the exact live count `n` and allocates
//!    `next` with `max(initial buckets, next_pow2(4 n))` buckets: it grows, keeps its size, or shrinks,
//!    never below the size chosen by `BlockIndex::with_capacity`. Sizing after the freeze (rather than
//!    when the migration starts, as a design that allocates `next` first would) means inserts racing
//!    the start can never overfill `next`; the price is that helpers wait for this one allocation.
//! 3. **Copy.** The *same entry pointers* (entries are shared, never copied) are CASed into the empty
//!    buckets of `next`; tombstones are dropped. The thread finishing the last chunk swaps `root` from
//!    the old table to `next` and `defer_destroy`s the old table, which frees its bucket array only,
//!    never the entries it points to.
//!
//! **Progress.** Readers never wait and never help: a reader treats `x|MOVED` exactly as `x`, so a
//! reader walking a frozen table reads a consistent snapshot. Writers that meet a migration (a started
//! freeze, a `MOVED` bucket, or a refused load grant) help finish it and retry in the new table; once
//! every chunk has been claimed they spin (with [`crate::sync::spin_loop`]) until the last claimer
//! finishes. So growth is lock-free for readers and *helping* (not lock-free) for writers: a writer can
//! wait for a migrator that was descheduled in the middle of a chunk. Chunks are small (1024 bucket
//! CASes, tens of µs), so that wait is short unless the migrator is preempted.
//!
//! **Ordering.** Freeze CASes are `AcqRel`; each freezer adds its live count to `frozen_live` and then
//! increments `freeze_done` (`AcqRel` RMWs form one release sequence), so the last freezer sees every
//! count and every frozen bucket. It publishes `next` with a `Release` store; copiers load it with
//! `Acquire`, copy with `AcqRel` CASes, and increment `copy_done` (`AcqRel`); the last copier's root
//! CAS (`AcqRel`) therefore happens after every copied pointer, and a reader's `Acquire` root load
//! sees a complete table. The chain also carries the original inserts' `Release`, so entry contents
//! are visible through `next` too.

use super::shim::MIGRATION_CHUNK;
use super::table::{Table, FRAG_MASK, MAX_BUCKETS, MOVED, TOMBSTONE};
use super::BlockIndex;
use crate::sync::{spin_loop, Ordering};
use crossbeam_epoch::{Guard, Owned, Shared};

impl Table {
    #[inline]
    fn chunks(&self) -> usize {
        self.buckets.len().div_ceil(MIGRATION_CHUNK)
    }

    #[inline]
    fn chunk_range(&self, c: usize) -> std::ops::Range<usize> {
        let start = c * MIGRATION_CHUNK;
        start..(start + MIGRATION_CHUNK).min(self.buckets.len())
    }

    /// True once a writer has started migrating this table (it must help, not write here).
    #[inline]
    pub(super) fn migration_started(&self) -> bool {
        self.mig.freeze_claimed.load(Ordering::Acquire) != 0
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
}

impl BlockIndex {
    /// Bucket count for a table receiving `live` entries: a quarter full, never below the initial
    /// size nor above `MAX_BUCKETS`.
    fn table_size(&self, live: usize) -> usize {
        live.saturating_mul(4).checked_next_power_of_two().unwrap_or(MAX_BUCKETS).min(MAX_BUCKETS).max(self.min_buckets)
    }

    /// Helps migrate table `t_sh` (starting the migration if needed) and returns once `root` no
    /// longer points at it.
    #[cold]
    pub(super) fn help_migrate(&self, t_sh: Shared<'_, Table>, guard: &Guard) {
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
}
