//! Tier and save options: [`TierConfig`], [`SaveOptions`], [`Fit`].

use crate::evict::PolicyKind;
use crate::geometry::Geometry;
use crate::pool::{BackingChoice, PoolConfig};
use std::time::Duration;

/// Tier construction options. Build with [`TierConfig::new`] and the `with_*` methods.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TierConfig {
    /// Block layout shared by every rank.
    pub geometry: Geometry,
    /// Host pool options (`pool.bytes` decides the capacity in slots).
    pub pool: PoolConfig,
    /// Eviction policy (default: [`PolicyKind::default`]).
    pub policy: PolicyKind,
    /// Expected number of resident blocks for sizing the index (default: the pool's capacity).
    pub index_capacity: Option<usize>,
    /// Time after which an unsettled lease is settled by the tier itself (default: never). An
    /// engine that forgets a lease then pins host memory for at most this long; restores already
    /// submitted from it keep their own pins and complete normally. Expired leases are settled
    /// when a save finds the pool short of slots and by [`crate::HostTier::expire_leases`];
    /// a restore from an expired lease fails with [`crate::TierError::LeaseExpired`].
    pub lease_ttl: Option<Duration>,
}

impl TierConfig {
    /// A configuration with a `pool_bytes` pool (backing chosen automatically), the default
    /// eviction policy and no lease time-to-live.
    pub fn new(geometry: Geometry, pool_bytes: u64) -> Self {
        TierConfig {
            geometry,
            pool: PoolConfig::new(pool_bytes),
            policy: PolicyKind::default(),
            index_capacity: None,
            lease_ttl: None,
        }
    }

    /// Sets the eviction policy.
    pub fn with_policy(mut self, policy: PolicyKind) -> Self {
        self.policy = policy;
        self
    }

    /// Sets every pool option (its `bytes` replaces the size given to [`TierConfig::new`]).
    pub fn with_pool(mut self, pool: PoolConfig) -> Self {
        self.pool = pool;
        self
    }

    /// Sets the pool's backing (hugetlb, THP, plain, or automatic).
    pub fn with_backing(mut self, backing: BackingChoice) -> Self {
        self.pool.backing = backing;
        self
    }

    /// Sizes the index for `blocks` resident blocks.
    pub fn with_index_capacity(mut self, blocks: usize) -> Self {
        self.index_capacity = Some(blocks);
        self
    }

    /// Sets the lease time-to-live (see [`TierConfig::lease_ttl`]).
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = Some(ttl);
        self
    }
}

/// How a save handles a batch that does not fit.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Fit {
    /// Save every missing key or none: if they cannot all fit, fail with
    /// [`crate::TierError::CannotFit`] before evicting anything.
    #[default]
    AllOrNothing,
    /// Save the longest leading run of missing keys that fits and that the eviction policy admits
    /// ([`crate::evict::EvictionPolicy::admit`]); report the rest as dropped. Never fails for lack
    /// of slots: under concurrency it saves the prefix it could get slots for.
    Prefix,
}

/// Options for [`crate::Rank::save_with`]. Build with [`SaveOptions::new`] and the setters.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SaveOptions {
    /// What to do when the batch does not fit.
    pub fit: Fit,
    /// Depth of `keys[0]` in its prompt (0 = the prompt's first page), so `keys[i]` is at depth
    /// `prefix_depth + i`. A prefix-aware policy ([`PolicyKind::PrefixLfu`]) evicts a chain's tail
    /// before its head. A hint for the eviction policy only; it never changes what is saved.
    pub prefix_depth: Option<u32>,
}

impl SaveOptions {
    /// All-or-nothing, no depth hint.
    pub fn new() -> Self {
        SaveOptions::default()
    }

    /// Sets how a batch that does not fit is handled.
    pub fn fit(mut self, fit: Fit) -> Self {
        self.fit = fit;
        self
    }

    /// Sets the prompt depth of the first key.
    pub fn prefix_depth(mut self, depth: u32) -> Self {
        self.prefix_depth = Some(depth);
        self
    }

    /// The depth of `keys[i]`, if known (saturating below `u32::MAX`, which means unknown).
    pub(crate) fn depth_of(&self, i: usize) -> Option<u32> {
        self.prefix_depth.map(|d| d.saturating_add(i.min(u32::MAX as usize) as u32).min(u32::MAX - 1))
    }
}
