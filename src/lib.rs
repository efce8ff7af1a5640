//! # kvtier
//!
//! A host-memory tier for LLM inference engines' KV caches. See `README.md` and `docs/design.md`.
//!
//! An engine builds one [`HostTier`] (the pinned host pool, the content index, eviction), attaches
//! one [`Rank`] per GPU with that GPU's copy backend, saves sealed blocks (GPU -> host), queries
//! keys for a [`Lease`] on the resident prefix, and restores it (host -> GPU).
#![warn(missing_docs, missing_debug_implementations)]
#![cfg_attr(docsrs, feature(doc_cfg))]

pub mod backend;
pub mod copy;
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub mod cuda;
pub mod error;
pub mod evict;
pub mod geometry;
pub mod index;
pub mod key;
#[cfg(feature = "remote")]
#[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
pub mod remote;
#[cfg(feature = "remote")]
#[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
pub mod server;
pub mod slab;
pub(crate) mod sync;
pub mod tier;

pub use copy::{
    Completion, CopyBackend, CopyEvent, CopyPair, Direction, EngineArenas, LayerGroups, LayerReadiness, WaitFor,
};
pub use error::{CopyError, Error, GeometryError, IndexError, Limit, LimitsError, PoolError, TierError};
pub use evict::PolicyKind;
pub use geometry::{ArenaBinding, ArenaSpec, Geometry, Placement};
pub use index::{BlockIndex, SlotRef};
pub use key::{ContentKey, Namespace};
#[cfg(feature = "remote")]
#[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
pub use remote::{ConnectOptions, LeaseToken};
pub use slab::SlotId;
pub use slab::{Backing, BackingChoice, HostPool, PoolConfig, PoolRegion, SharedPoolLayout};
pub use tier::handle::CopyHandle;
pub use tier::lease::Lease;
pub use tier::{Fit, HintId, HostTier, Rank, RankLoad, SaveOptions, SaveTicket, TierConfig, TierStats};

/// Internals for kvtier's own tests, loom models and benchmarks. **Not a stable API**: anything
/// here may change in any release. Models and tests call these so that they exercise the very
/// functions production calls.
#[doc(hidden)]
pub mod testing {
    pub use crate::slab::freelist::{FreeList, MAX_SHARDS};
    pub use crate::slab::slot::{PinError, SlotControl, SlotState, SlotWord};
    pub use crate::tier::pins::{SlotPins, WriteReservation};
    /// The std/loom synchronisation switch (`--cfg loom` selects loom's).
    pub mod sync {
        pub use crate::sync::*;
    }
    pub use crate::tier::chain::ChainClass;
    pub use crate::tier::core::{Core, KeyState, Reserved};
    pub use crate::tier::evictor::{Claims, Want};
    pub use crate::tier::save_plan::SavePlan;
    pub use crate::tier::AuditReport;
    use crate::{ContentKey, HostTier, Lease, TierError};

    /// The slot control words of `pool`.
    pub fn control(pool: &crate::HostPool) -> &SlotControl {
        pool.control()
    }

    /// The shared core of `tier`.
    pub fn core(tier: &HostTier) -> &crate::sync::Arc<Core> {
        tier.core()
    }

    /// A lease on the longest ready prefix of `keys` with `uses` restores (what
    /// [`HostTier::query_shared`] does).
    pub fn query(core: &crate::sync::Arc<Core>, keys: &[ContentKey], uses: u32) -> Lease {
        Lease::acquire(core, keys, uses)
    }

    /// The tier daemon's [`Core::audit`] of its tier over `keys`, asked through the connected tier
    /// `tier` ([`HostTier::connect`]). The inner `Err` names the first violated invariant.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] for an in-process tier (audit [`core`] instead);
    /// [`TierError::Disconnected`].
    #[cfg(feature = "remote")]
    pub fn remote_audit(tier: &HostTier, keys: &[ContentKey]) -> Result<Result<AuditReport, String>, TierError> {
        crate::tier::connected::audit(tier.remote().ok_or(TierError::ForeignLease)?, keys)
    }

    /// The lease side of a restore of `n` blocks whose submission fails (a page out of range, a
    /// backend error), as [`crate::Rank::restore`] runs it: the restore's own pins, a use of the
    /// lease, then the hold is dropped unsubmitted (pins dropped, the use given back).
    ///
    /// # Errors
    /// As [`crate::Rank::restore`]'s lease errors (before the submission).
    pub fn restore_failing_submission(lease: &Lease, n: usize) -> Result<(), TierError> {
        let hold = lease.begin_restore(n)?;
        // The backend refused the batch: the hold is dropped unsubmitted, as in `Rank::restore`.
        drop(hold);
        Ok(())
    }

    /// The lease side of a restore of `n` blocks, in the order [`crate::Rank::restore`] runs it:
    /// take the restore's own pins, then a use of the lease; submit (settling the lease if that was
    /// its last use); then the copy (`copy`, given the pinned slots) runs while the pins are held,
    /// and they drop when it has finished.
    ///
    /// # Errors
    /// As [`crate::Rank::restore`]'s lease errors.
    pub fn restore_with<R>(lease: &Lease, n: usize, copy: impl FnOnce(&[crate::SlotId]) -> R) -> Result<R, TierError> {
        let mut hold = lease.begin_restore(n)?;
        let pins = hold.take_pins();
        hold.submitted();
        let r = copy(pins.slots());
        drop(pins);
        Ok(r)
    }
}

/// The README's example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
