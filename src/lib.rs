//! # kvtier
//!
//! A host-memory tier for LLM inference engines' KV caches. See `README.md` and `docs/design.md`.
#![warn(missing_docs)]

pub mod copy;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod evict;
pub mod freelist;
pub mod geometry;
pub mod guard;
pub mod handle;
pub mod index;
pub mod key;
pub mod lease;
pub mod pattern;
pub mod pool;
pub mod slot;
pub mod sync;
pub mod tier;

pub use copy::{Completion, CopyBackend, CopyPair, Direction, EngineArenas, WaitFor};
pub use error::{CopyError, Error, GeometryError, PoolError, TierError};
pub use evict::PolicyKind;
pub use geometry::{ArenaBinding, ArenaSpec, Geometry, Placement};
pub use handle::CopyHandle;
pub use index::{BlockIndex, SlotRef};
pub use key::{ContentKey, Namespace};
pub use lease::Lease;
pub use pool::{Backing, BackingChoice, HostPool, PoolConfig, PoolRegion};
pub use slot::{SlotId, SlotState, SlotWord};
pub use tier::{Fit, HostTier, Rank, SaveHint, SaveOptions, SaveTicket, TierConfig, TierStats};

/// The README's example, compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
