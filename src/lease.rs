//! Leases: the pins a query takes on the blocks it found, settled exactly once.
//!
//! [`crate::HostTier::query`] returns a [`Lease`] over the longest run of leading keys whose blocks
//! are ready, each pinned so eviction cannot take it. A lease **settles exactly once**, and settling
//! drops its pins:
//!
//! - **consumed**: every restore from the lease consumes one use; the lease settles when the last
//!   use is consumed. A lease has one use by default; [`crate::HostTier::query_shared`] makes a lease
//!   with one use per rank, so several data-parallel ranks can each restore the same blocks (one
//!   rank consuming the lease never makes the others fail);
//! - **released**: [`Lease::release`] settles at once, whatever uses are left;
//! - **dropped**: when the last clone of the lease is dropped unsettled, it settles (RAII), so a
//!   forgotten lease never pins host memory past its owner.
//!
//! Whichever of these happens first settles; the others find it settled (an atomic swap decides).
//! A restore takes its own guard pins *before* it consumes a use, so a lease that settles while its
//! copy is in flight never frees a slot under the copy.

use crate::guard::SlotPins;
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::slot::SlotId;
use crate::sync::{Arc, AtomicBool, AtomicU32, Ordering};
use crate::tier::Core;
use std::fmt;

/// One leased block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LeasedBlock {
    /// The block's content key.
    pub key: ContentKey,
    /// Where it lives (pinned while the lease is unsettled).
    pub slot: SlotRef,
}

pub(crate) struct LeaseInner {
    pub(crate) core: Arc<Core>,
    blocks: Vec<LeasedBlock>,
    uses_left: AtomicU32,
    settled: AtomicBool,
}

impl LeaseInner {
    /// Settles the lease if nobody has, dropping its pins; returns true if this call settled it.
    /// The atomic swap is what makes settling exactly-once under races.
    fn settle(&self) -> bool {
        #[cfg(not(feature = "seeded-bug-lease-double-settle"))]
        let first = !self.settled.swap(true, Ordering::AcqRel);
        // Seeded bug (model checking only): check-then-act instead of one swap.
        #[cfg(feature = "seeded-bug-lease-double-settle")]
        let first = !self.settled.load(Ordering::Acquire) && {
            self.settled.store(true, Ordering::Release);
            true
        };
        if first {
            for b in &self.blocks {
                self.core.unpin(b.slot.slot);
            }
        }
        first
    }
}

impl Drop for LeaseInner {
    fn drop(&mut self) {
        self.settle();
    }
}

/// A set of pinned ready blocks, in key order (see the module docs). Cloning shares the lease.
#[derive(Clone)]
pub struct Lease {
    inner: Arc<LeaseInner>,
}

impl Lease {
    pub(crate) fn new(core: &Arc<Core>, blocks: Vec<LeasedBlock>, pins: SlotPins, uses: u32) -> Self {
        debug_assert_eq!(blocks.len(), pins.len());
        let empty = blocks.is_empty();
        // The lease owns the pins from here on and drops them in `settle`.
        let _ = pins.into_raw();
        let inner =
            LeaseInner { core: core.clone(), blocks, uses_left: AtomicU32::new(uses), settled: AtomicBool::new(false) };
        let lease = Lease { inner: Arc::new(inner) };
        if empty || uses == 0 {
            lease.inner.settle();
        }
        lease
    }

    pub(crate) fn core(&self) -> &Arc<Core> {
        &self.inner.core
    }

    /// Number of leased blocks: the length of the resident prefix the query found.
    pub fn len(&self) -> usize {
        self.inner.blocks.len()
    }

    /// True if the query found no leading resident block.
    pub fn is_empty(&self) -> bool {
        self.inner.blocks.is_empty()
    }

    /// The leased blocks, in key order.
    pub fn blocks(&self) -> &[LeasedBlock] {
        &self.inner.blocks
    }

    /// The host slots of the leased blocks, in key order.
    pub fn slots(&self) -> impl Iterator<Item = SlotId> + '_ {
        self.inner.blocks.iter().map(|b| b.slot.slot)
    }

    /// True once the lease has settled (consumed, released or dropped); its pins are gone.
    pub fn is_settled(&self) -> bool {
        self.inner.settled.load(Ordering::Acquire)
    }

    /// Restores this lease still allows (0 once settled).
    pub fn uses_left(&self) -> u32 {
        if self.is_settled() {
            0
        } else {
            self.inner.uses_left.load(Ordering::Acquire)
        }
    }

    /// Settles the lease now, dropping its pins. Restores already submitted keep their own guards
    /// and complete normally. Returns true if this call settled it (false if it already was).
    pub fn release(self) -> bool {
        self.inner.settle()
    }

    /// Consumes one use; settles the lease when it was the last. Returns false if none was left.
    ///
    /// Model-test hook (a restore consumes after taking its guards); not a stable API.
    #[doc(hidden)]
    pub fn consume(&self) -> bool {
        if !self.take_use() {
            return false;
        }
        self.settle_if_used_up();
        true
    }

    /// Takes one use without settling: false if none is left or the lease is settled. A restore
    /// takes its use before it submits, so two ranks racing for the last use cannot both copy;
    /// it gives the use back ([`Lease::return_use`]) if the submission fails.
    pub(crate) fn take_use(&self) -> bool {
        let mut cur = self.inner.uses_left.load(Ordering::Acquire);
        loop {
            if cur == 0 || self.is_settled() {
                return false;
            }
            match self.inner.uses_left.compare_exchange_weak(cur, cur - 1, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(a) => {
                    cur = a;
                    crate::sync::spin_loop();
                }
            }
        }
    }

    /// Gives back a use taken by [`Lease::take_use`] whose restore was never submitted.
    pub(crate) fn return_use(&self) {
        self.inner.uses_left.fetch_add(1, Ordering::AcqRel);
    }

    /// Settles the lease if its last use has been taken (the restore that took it holds its own
    /// guards by now).
    pub(crate) fn settle_if_used_up(&self) {
        // Seeded bug (model checking only): the first rank's restore settles a shared lease.
        let last = self.inner.uses_left.load(Ordering::Acquire) == 0
            || cfg!(feature = "seeded-bug-lease-first-consume-settles");
        if last {
            self.inner.settle();
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("blocks", &self.len())
            .field("uses_left", &self.uses_left())
            .field("settled", &self.is_settled())
            .finish()
    }
}
