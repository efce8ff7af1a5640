//! Tier and save options: [`TierConfig`], [`SaveOptions`], [`Fit`].

use crate::evict::PolicyKind;
use crate::geometry::Geometry;
use crate::key::ContentKey;
use crate::slab::pool::{BackingChoice, PoolConfig};
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
    /// Chain-aware victims (default: on). Saves that say their keys form a chain
    /// ([`SaveOptions::prefix_depth`], [`SaveOptions::parent`]) link each block to the one before it;
    /// eviction then takes orphaned blocks (whose predecessor is gone: no query can reach them)
    /// first, then the rest, in the policy's order weighed by each chain's subtree scores
    /// (`crate::evict::Ranking::chain`), so a chain goes from its tail.
    /// Off, the policy's order alone decides (the classic policies, e.g. plain LRU).
    pub chain_aware: bool,
    /// Expected number of resident blocks for sizing the index (default: the pool's capacity).
    pub index_capacity: Option<usize>,
    /// Time after which an unsettled lease is settled by the tier itself (default: never). An
    /// engine that forgets a lease then pins host memory for at most this long; restores already
    /// submitted from it keep their own pins and complete normally. Expired leases are settled
    /// when a save finds the pool short of slots and by [`crate::HostTier::expire_leases`];
    /// a restore from an expired lease fails with [`crate::TierError::LeaseExpired`].
    pub lease_ttl: Option<Duration>,
    /// An SSD tier under the host pool (default: none). Host blocks its admission takes
    /// ([`crate::SsdConfig::admit`]) are demoted to its files in the background, and a
    /// query whose host prefix ends at a key the SSD tier holds continues it from there
    /// (promotion; see [`crate::HostTier::query`]). An in-process tier's own.
    pub ssd: Option<super::ssd::SsdConfig>,
    /// Admission that protects the engine's queue (default: on). On, a [`Fit::Prefix`] save never
    /// evicts a block of a hinted key ([`crate::HostTier::hint`]: a queued request will look it
    /// up): it keeps the leading run of its missing keys that fits in free slots and unhinted
    /// victims, and reports the rest as dropped. A save of more blocks than that room (a request
    /// larger than the pool's unhinted part) then keeps its head instead of flushing the queue's
    /// prefixes. [`Fit::AllOrNothing`] saves are not affected: they take hinted blocks last, so
    /// such a save is never refused while an unpinned block could be evicted. Without live hints
    /// it changes nothing. Off, prefix saves take hinted blocks last, like all-or-nothing ones.
    ///
    /// On by default because of the policy table in `docs/benchmarks.md`: with hints for a
    /// 64-request queue, protection raises the default policy's page hit ratio up to 3.8x at
    /// 1,244 GLM-5.2 slots (0.042 to 0.159 on long agentic sessions) and never lowers it.
    pub protect_hinted: bool,
    /// The event log's capacity in events (default: none, no log). With a log the tier records
    /// every block it stores and evicts, on the host and on its SSD tier, for an owner that
    /// announces them ([`crate::HostTier::take_events`]; `docs/vllm.md`, KV events). An owner
    /// that drains it every few milliseconds needs room for the blocks a burst saves and
    /// evicts in that time; past the capacity, events are dropped and counted.
    pub events: Option<usize>,
}

impl TierConfig {
    /// A configuration with a `pool_bytes` pool (backing chosen automatically), the default
    /// eviction policy and no lease time-to-live.
    pub fn new(geometry: Geometry, pool_bytes: u64) -> Self {
        TierConfig {
            geometry,
            pool: PoolConfig::new(pool_bytes),
            policy: PolicyKind::default(),
            chain_aware: true,
            index_capacity: None,
            lease_ttl: None,
            ssd: None,
            protect_hinted: true,
            events: None,
        }
    }

    /// Sets the eviction policy.
    pub fn with_policy(mut self, policy: PolicyKind) -> Self {
        self.policy = policy;
        self
    }

    /// Turns chain-aware victims on or off (see [`TierConfig::chain_aware`]).
    pub fn with_chain_aware(mut self, on: bool) -> Self {
        self.chain_aware = on;
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

    /// Puts an SSD tier under the host pool (see [`TierConfig::ssd`]).
    pub fn with_ssd(mut self, ssd: super::ssd::SsdConfig) -> Self {
        self.ssd = Some(ssd);
        self
    }

    /// Turns queue-protecting admission on or off (see [`TierConfig::protect_hinted`]).
    pub fn with_protect_hinted(mut self, on: bool) -> Self {
        self.protect_hinted = on;
        self
    }

    /// Enables the event log with room for `capacity` events (see [`TierConfig::events`]).
    pub fn with_events(mut self, capacity: usize) -> Self {
        self.events = Some(capacity);
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
    /// (`crate::evict::EvictionPolicy::admit`); report the rest as dropped. Never fails for lack
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
    /// before its head. Setting it also says that the keys are consecutive blocks of one prompt,
    /// so chain-aware eviction ([`TierConfig::chain_aware`]) links `keys[i]` to `keys[i - 1]`. A hint
    /// for eviction only; it never changes what is saved.
    pub prefix_depth: Option<u32>,
    /// The key of the block just before `keys[0]` in its prompt (the last block the engine found
    /// resident or saved earlier), so chain-aware eviction links `keys[0]` to it; it also says the
    /// keys form a chain, as [`SaveOptions::prefix_depth`] does. A hint for eviction only.
    pub parent: Option<ContentKey>,
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

    /// Sets the key of the block before the first key (see [`SaveOptions::parent`]).
    pub fn parent(mut self, key: ContentKey) -> Self {
        self.parent = Some(key);
        self
    }

    /// True if the keys are consecutive blocks of one prompt (a depth or a parent was given).
    pub(crate) fn is_chain(&self) -> bool {
        self.prefix_depth.is_some() || self.parent.is_some()
    }

    /// The depth of `keys[i]`, if known (saturating below `u32::MAX`, which means unknown).
    pub(crate) fn depth_of(&self, i: usize) -> Option<u32> {
        self.prefix_depth.map(|d| d.saturating_add(i.min(u32::MAX as usize) as u32).min(u32::MAX - 1))
    }
}
