//! # kvtier
//!
//! A host-memory tier for LLM inference engines' KV caches. See `README.md` and `docs/design.md`.
//!
//! An engine builds one [`HostTier`] (the pinned host pool, the content index, eviction), attaches
//! one [`Rank`] per GPU with that GPU's copy backend, saves sealed blocks (GPU -> host), queries
//! keys for a [`Lease`] on the resident prefix, and restores it (host -> GPU).
//!
//! ```
//! use kvtier::{ArenaSpec, EngineArenas, Geometry, HostTier, MemcpyArenas, TierConfig, WaitFor};
//!
//! // 16 tokens a page; two arenas (K and V) of 4 KiB pages, 16 GPU pages each; one block is page
//! // p of every arena (8 KiB here).
//! let geometry =
//!     Geometry::new("demo", 16, vec![ArenaSpec::packed("k", 4096, 16), ArenaSpec::packed("v", 4096, 16)])?;
//! let tier = HostTier::new(TierConfig::new(geometry.clone(), 64 * geometry.slot_bytes()))?;
//! // A host stand-in for the GPU arenas (with a GPU: `CudaBackend`, feature `cuda`).
//! let gpu = std::sync::Arc::new(MemcpyArenas::new(&geometry)?);
//! let rank = tier.attach(gpu.backend()?)?;
//! let keys: Vec<_> = (0..4).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
//! gpu.fill(&[0, 1, 2, 3], &keys)?; // the "prefill" writes pages 0..4
//! rank.save(&keys, &[0, 1, 2, 3], WaitFor::Nothing)?.handle.wait()?; // GPU -> host
//! let lease = tier.query(&keys); // the resident prefix, pinned until restored or dropped
//! assert_eq!(lease.len(), 4);
//! rank.restore(&lease, &[8, 9, 10, 11], WaitFor::Nothing)?.wait()?; // host -> GPU
//! gpu.verify(&[8, 9, 10, 11], &keys)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! ## Features
//!
//! None is on by default: the default build has only the data structures' own dependencies.
//!
//! - `cuda`: the CUDA copy backend (`CudaBackend`): hand-written gather/scatter kernels built
//!   with NVRTC at run time; cudarc loads the driver at run time, so it builds without CUDA.
//! - `remote`: the tier daemon's client (`HostTier::connect`) and server (`Server`).
//! - `peers`: blocks fetched from another instance's host pool (`PeerServer`, `PeerClient`) over
//!   a byte mover (`PeerTransport`); enables `remote`.
//! - `serde`: `serde::Serialize` on statistics and reports ([`TierStats`], ...).
//! - `metrics`: the tier's metrics in a `prometheus-client` registry.
//! - `nixl`: `NixlTransport`, the `PeerTransport` that reads blocks from another instance's host
//!   pool through NIXL (its runtime is loaded at run time).
//! - `internals`: kvtier's own tests, models and benches only; not a stable API.
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
// Items that only `internals` re-exports (for kvtier's own tests, models and benches) are unused
// and unreachable in a build without it; the lints hold on the build with it (CI checks that one
// with `-D warnings`).
#![cfg_attr(not(feature = "internals"), allow(dead_code, unused_imports, unreachable_pub))]
#![cfg_attr(docsrs, feature(doc_cfg))]

// Every module is private: the public surface is the one `pub use` block below (docs/design.md
// lists it), so every public type has exactly one path.
mod backend;
mod copy;
#[cfg(feature = "cuda")]
mod cuda;
mod disk;
mod error;
mod evict;
mod geometry;
mod hybrid;
mod index;
mod key;
#[cfg(feature = "metrics")]
mod metrics;
#[cfg(all(feature = "peers", not(loom)))]
mod peer;
#[cfg(all(feature = "remote", not(loom)))]
mod remote;
mod secret;
mod seeded;
#[cfg(all(feature = "remote", not(loom)))]
mod server;
mod size;
mod slab;
mod source;
mod sync;
mod tier;

pub use backend::BackendKind;
pub use copy::fault::{FaultSite, FaultyBackend, PanicSite, SubmitPanics, SubmitPanicsHandle};
pub use copy::host::{MemcpyArenas, MemcpyBackend};
pub use copy::null::NullBackend;
pub use copy::pattern;
pub use copy::{
    Completion, CopyBackend, CopyEvent, CopyPair, Direction, Done, EngineArenas, LayerCopy, LayerGroups,
    LayerReadiness, WaitFor,
};
#[cfg(feature = "cuda")]
#[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
pub use cuda::{
    cuda_available, cudarc, device_count, driver_error, CopyMode, CudaArenas, CudaBackend, CudaOptions, EngineStream,
    Isolation, PatternJob, SmPartition,
};
pub use disk::{DiskError, IoPreference};
pub use error::{CopyError, Error, GeometryError, IndexError, Limit, LimitsError, PoolError, SizeError, TierError};
pub use evict::{PolicyKind, UnknownPolicy};
pub use geometry::{ArenaBinding, ArenaSpec, Geometry, Placement, COPY_ALIGN, MAX_ARENAS, SLOT_CHUNK_ALIGN};
pub use hybrid::{
    CacheGroup, GroupKind, GroupPages, HybridConfig, HybridLayout, HybridLease, HybridRank, HybridRestore, HybridSave,
    HybridTier, MAX_GROUPS,
};
pub use index::{BlockIndex, IndexReader, SlotRef};
pub use key::{ContentKey, Namespace};
#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub use metrics::{prometheus_client, Health, PoolHealth};
#[cfg(all(feature = "nixl", not(loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "nixl")))]
pub use peer::nixl::{nixl_sys, NixlTransport};
#[cfg(all(feature = "peers", not(loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "peers")))]
pub use peer::{
    unique_agent_name, BlockRead, PeerClient, PeerError, PeerFetch, PeerLimits, PeerSecret, PeerServer,
    PeerServerStats, PeerSet, PeerSetFetch, PeerTransport, ReadDone, TransportError, TransportPeer,
};
#[cfg(all(feature = "remote", not(loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
pub use remote::{default_socket_path, ClientStats, ConnectOptions, LeaseToken};
pub use secret::{read_secret_file, secrets_equal, SecretFileError, MIN_SECRET_BYTES};
#[cfg(all(feature = "remote", not(loom)))]
#[cfg_attr(docsrs, doc(cfg(feature = "remote")))]
pub use server::{Limits, Server, ServerConfig};
pub use size::{parse_bytes, parse_ssd_file};
pub use slab::{
    hugetlb_free_pages, Backing, BackingChoice, HostPool, PoolConfig, PoolRegion, SharedPoolLayout, SlotId,
    HUGE_PAGE_BYTES, MAX_SLOTS, POOL_SEALS,
};
pub use source::BlockSource;
pub use sync::wait_spin;
pub use tier::events::{EventMedium, TierEvent};
pub use tier::handle::CopyHandle;
pub use tier::lease::Lease;
pub use tier::ssd::admit::{Admission, BadSsdAdmit, SsdAdmit};
#[cfg(not(loom))]
pub use tier::ssd::model::{Demotion, SsdModel};
pub use tier::ssd::{SsdConfig, SsdFile, SsdStats};
pub use tier::{
    AuditReport, EvictionLockStats, Fit, HintId, HostTier, Rank, RankLoad, SaveOptions, SaveTicket, TierConfig,
    TierStats, HINTED_KEY_BYTES, HINT_BYTES, MAX_HINT_TTL,
};

/// Internals for kvtier's own tests, loom models, benchmarks and fuzz targets (feature
/// `internals`, off by default). **Not a stable API**: anything here may change in any release.
/// Models and tests call these so that they exercise the very functions production calls.
#[cfg(feature = "internals")]
#[doc(hidden)]
pub mod internals {
    pub use crate::copy::layers::copy_layers;
    pub use crate::copy::{check_pages_and_keys, validate_batch};
    pub use crate::evict::{ChainView, EvictionPolicy, InsertInfo, MarkStack, Ranking};
    #[cfg(all(feature = "remote", not(loom)))]
    pub use crate::remote::proto;
    /// The peer control protocol's messages and frames.
    #[cfg(all(feature = "peers", not(loom)))]
    pub mod peer_proto {
        /// The hello's proofs (a raw test client computes its own).
        pub use crate::peer::auth::{mac, nonce, Role};
        pub use crate::peer::proto::*;
    }
    #[cfg(all(feature = "remote", not(loom)))]
    pub use crate::server::drive_session;
    /// The kernels' descriptors and raw driver access (benchmarks and GPU tests).
    #[cfg(feature = "cuda")]
    pub mod cuda {
        pub use crate::cuda::desc;
        pub use crate::cuda::describe_driver_error;
        pub use crate::cuda::raw::*;
    }
    pub use crate::slab::freelist::{FreeList, MAX_SHARDS};
    pub use crate::slab::slot::{PinError, SlotControl, SlotState, SlotWord};
    pub use crate::tier::pins::{SlotPins, WriteReservation};
    /// The std/loom synchronisation switch (`--cfg loom` selects loom's).
    pub mod sync {
        pub use crate::sync::*;
    }
    pub use crate::tier::chain::ChainClass;
    pub use crate::tier::cold::ColdOutcome;
    pub use crate::tier::core::{Core, KeyState, Reserved};
    pub use crate::tier::evictor::{Claims, EvictReason, Want};
    pub use crate::tier::save_plan::SavePlan;
    pub use crate::tier::AuditReport;
    /// The SSD tier's disk slot files.
    pub mod disk {
        pub use crate::disk::*;
    }
    /// The SSD tier's disk slots and the host-side steps of demotion and promotion.
    pub mod ssd {
        pub use crate::tier::ssd::{pin_for_demotion, reserve_promotion, DiskRef, DiskSlots, HostPin, Job, Recovered};
    }
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
    #[cfg(all(feature = "remote", not(loom)))]
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

/// The examples of the feature pages (the SSD tier, the daemon, hybrid models), compiled (and the
/// ones not marked `no_run` run) as doctests, like the README's.
#[cfg(doctest)]
#[doc = include_str!("../docs/ssd.md")]
pub struct SsdDocDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/daemon.md")]
pub struct DaemonDocDoctests;

#[cfg(doctest)]
#[doc = include_str!("../docs/hybrid.md")]
pub struct HybridDocDoctests;
