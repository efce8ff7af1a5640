//! Load grants (the bound that keeps half of a table empty) and the striped counters they and
//! the live count use.
//!
//! A table's *load* is bounded by `used`, the grants given for inserts: every bucket that
//! went non-empty (live entries plus tombstones) was filled by an insert holding a grant taken
//! before its CAS. `used` never exceeds `limit = buckets / 2` (it only grows by CASes that check the
//! limit), and the non-empty buckets plus in-flight grants plus unspent credit add up to at
//! most `used`, so a table always keeps at least half of its buckets empty and every probe ends
//! within a few buckets (and provably within one pass). A grant request that finds no room fails and
//! starts a migration instead.
//!
//! Grants are taken in batches so that inserts on different cores do not fight over one
//! counter: a thread first spends its *stripe's* credit (a padded counter written by that thread
//! alone unless more than `STRIPES` threads share the stripes); when it has none it CASes `used` up by
//! a batch (`limit / BATCH_DIVISOR`, between 1 and `MAX_BATCH`), keeps one and credits the rest to
//! its stripe; when `used` is at the limit it takes leftover credit from the other stripes before
//! giving up, so a table migrates only when every granted bucket is spent or in flight (or, in a
//! narrow race, granted to a thread that has not yet credited the rest of its batch: an early
//! migration, harmless since the next table is sized from the live count). An insert that gives its
//! grant back (the key was present) returns it as credit. Credit dies with its table; the next
//! table starts with `used` equal to the live count it was sized for.
//!
//! The live count is striped the same way ([`LiveCount`]): an insert increments its thread's stripe,
//! a remove decrements its own thread's stripe (which may be another one), so stripes are wrapping
//! counts and only their sum is meaningful.
//!
//! All counters here use `Relaxed` RMWs: atomicity alone makes the grant bound exact (every
//! grant is a CAS from the current value, every credit unit is taken by a decrement-if-positive CAS,
//! so no unit is spent twice). The constants are in the `shim` module (they are smaller under loom).

use super::shim::{BATCH_DIVISOR, MAX_BATCH, STRIPES};
use crate::sync::{spin_loop, AtomicUsize, Ordering};
use crossbeam_utils::CachePadded;

/// [`STRIPES`] zeroed counters, each in its own cache line.
fn striped_counters() -> Box<[CachePadded<AtomicUsize>]> {
    (0..STRIPES).map(|_| CachePadded::new(AtomicUsize::new(0))).collect()
}

/// A table's load grants: `used` (granted, `<= limit`) and the per-stripe unspent credit.
pub(super) struct LoadGrants {
    /// Most non-empty buckets allowed (`buckets / 2`). Read-only.
    pub(super) limit: usize,
    /// LoadGrants a stripe takes from `used` at once. Read-only.
    batch: usize,
    /// Buckets granted for inserts, `<= limit` at all times: non-empty buckets (live + tombstones)
    /// plus in-flight grants plus the unspent `credit` of every stripe.
    pub(super) used: CachePadded<AtomicUsize>,
    /// Per stripe: granted (counted in `used`) but not yet spent grants.
    credit: Box<[CachePadded<AtomicUsize>]>,
}

impl LoadGrants {
    /// The load grants of a table whose load limit is `limit`, `used` of them already granted.
    pub(super) fn new(limit: usize, used: usize) -> Self {
        LoadGrants {
            limit,
            batch: (limit / BATCH_DIVISOR).clamp(1, MAX_BATCH),
            used: CachePadded::new(AtomicUsize::new(used)),
            credit: striped_counters(),
        }
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

    /// Grants one empty bucket to an insert by the thread of stripe `s`; false (and nothing
    /// granted) when the table is full.
    ///
    /// The fast path spends the stripe's own credit (one RMW on a line only this thread writes).
    /// Otherwise it takes up to `batch` grants from `used` by a CAS that never passes
    /// `limit` (keeping one, crediting the rest to its stripe); when `used` is at the limit it takes
    /// credit left over by other stripes before reporting the table full, so a table migrates only
    /// when every granted bucket is spent or in flight.
    #[inline]
    pub(super) fn take(&self, s: usize) -> bool {
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

    /// Returns an unused grant (taken by stripe `s`) as that stripe's credit.
    #[inline]
    pub(super) fn give_back(&self, s: usize) {
        self.credit[s].fetch_add(1, Ordering::Relaxed);
    }
}

/// The index's live count, striped per thread: each stripe is a wrapping count (a stripe may go
/// "negative" when a thread removes what another inserted); their wrapping sum is the count.
pub(super) struct LiveCount(Box<[CachePadded<AtomicUsize>]>);

impl LiveCount {
    pub(super) fn new() -> Self {
        LiveCount(striped_counters())
    }

    /// Counts an insert on stripe `s` (done before the CAS that publishes the entry).
    #[inline]
    pub(super) fn inc(&self, s: usize) {
        self.0[s].fetch_add(1, Ordering::Relaxed);
    }

    /// Uncounts on stripe `s` (a removal, or an insert whose CAS lost).
    #[inline]
    pub(super) fn dec(&self, s: usize) {
        self.0[s].fetch_sub(1, Ordering::Relaxed);
    }

    /// The sum of the stripes, read one by one. Since a remover must first `Acquire`-load the entry
    /// it removes, the true sum never goes below zero; a sum taken while operations run may still see
    /// a removal without the insert it follows, so it is clamped at zero.
    pub(super) fn sum(&self) -> usize {
        let sum = self.0.iter().fold(0usize, |acc, c| acc.wrapping_add(c.load(Ordering::Relaxed)));
        (sum as isize).max(0) as usize
    }
}
