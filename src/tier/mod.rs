//! [`HostTier`]: the facade an engine calls. One tier (pool, index, eviction) is shared by every
//! rank; each rank attaches its own copy backend (device and GPU arenas) and gets a [`Rank`].
//!
//! ```text
//!   engine rank 0 --save/restore--> Rank 0 (backend: GPU 0 arenas) --+
//!   engine rank 1 --save/restore--> Rank 1 (backend: GPU 1 arenas) --+--> Core: HostPool + BlockIndex
//!   any thread ----query-----------> HostTier --------------------------+     + EvictionPolicy + stats
//! ```
//!
//! Files, bottom up: `expiry` (a lease's settle state and the lease time-to-live clock), `saving`
//! (the keys being saved), `chain` (parent links and children counts for chain-aware victims),
//! `hints` (scheduler hints), `core` (shared state, slot-level steps, victim classes), `evictor`
//! (two-phase eviction: claims), `save_plan` (the save plan, chain links), `pins` (RAII pins and
//! write reservations), `prepare` (a save's tier side: plan, fit, acquire, reserve), `lease`
//! (leases), `handle` (completion handles), `stats` (counters), `config` (options), `rank` (saves,
//! restores, completion threads), `connected` (the connected tier, feature `remote`), this file
//! (the facade).
//!
//! Flows (see `docs/design.md` for the invariants):
//! - **save** ([`Rank::save_with`]): planned, fitted to the slots it can get (free first, then
//!   eviction), reserved `WRITING` in the index (invisible to queries), copied GPU -> host in one
//!   batch; the rank's completion thread commits the blocks `READY` after the copy completed.
//! - **query** ([`HostTier::query`]): pins the longest run of leading keys that are ready and
//!   returns a [`Lease`] on them.
//! - **restore** ([`Rank::restore`]): takes its own pins on the leased slots, then a use of the
//!   lease, and submits the host -> GPU batch; its pins drop when the copy completes.

/// A `match` on where a tier lives ([`Flavor`]), or on a pair of such things (a rank's tier and
/// a lease's): the first arm is the in-process one; every further arm is compiled with feature
/// `remote` only. This macro is the one place that feature splits the tier's code paths, so the
/// flavours' arms sit side by side in each method and nowhere else.
macro_rules! match_flavor {
    ($on:expr, $local:pat => $l:expr $(, $remote:pat => $r:expr)* $(,)?) => {{
        // Without `remote` the match has one arm, which clippy would have written as a `let`.
        #[allow(clippy::infallible_destructuring_match)]
        let matched = match $on {
            $local => $l,
            $(
                #[cfg(all(feature = "remote", not(loom)))]
                $remote => $r,
            )*
        };
        matched
    }};
}

pub(crate) mod chain;
pub(crate) mod cold;
mod config;
#[cfg(all(feature = "remote", not(loom)))]
pub(crate) mod connected;
pub(crate) mod core;
pub(crate) mod events;
pub(crate) mod evictor;
pub(crate) mod expiry;
pub(crate) mod handle;
mod hints;
pub(crate) mod lease;
pub(crate) mod pins;
pub(crate) mod prepare;
mod rank;
pub(crate) mod save_plan;
mod saving;
pub(crate) mod ssd;
pub(crate) mod stats;

pub use config::{Fit, SaveOptions, TierConfig};
pub use hints::{HintId, HINTED_KEY_BYTES, HINT_BYTES, MAX_HINT_TTL};
pub use rank::{Rank, RankLoad, SaveTicket};
pub use stats::{AuditReport, EvictionLockStats, TierStats};

use self::core::Core;
use crate::copy::CopyBackend;
use crate::error::{CopyError, Error, TierError};
use crate::geometry::Geometry;
use crate::key::{ContentKey, Namespace};
use crate::slab::pool::HostPool;
use crate::slab::slot::SlotState;
use crate::sync::Arc;
use crate::tier::events::TierEvent;
use crate::tier::lease::Lease;

/// Where a tier lives, the one switch between the two flavours of [`HostTier`] (its ranks and
/// leases follow their tier's): in this process, or in the tier daemon this process is connected
/// to. Cloning shares the tier.
#[derive(Clone)]
pub(crate) enum Flavor {
    /// In this process: the core holds the pool, the index, the policy, the leases and the counters.
    InProcess(TierHandle),
    /// In the tier daemon ([`HostTier::connect`]), which owns the state machine: this process holds
    /// the connection, the daemon's geometry and policy, and its own mapping of the shared pool.
    #[cfg(all(feature = "remote", not(loom)))]
    Connected(std::sync::Arc<connected::ConnectedTier>),
}

/// A handle on an in-process tier's core, shared by the [`HostTier`] handles and the [`Rank`]s:
/// when the last one goes, the threads the tier owns (the SSD tier's demotion thread) are stopped
/// and joined before the drop returns, so no thread of the tier holds its core, or its files and
/// their locks, past that point. Leases and guards hold the core itself (`Arc<Core>`): the core
/// and its files go with the last of everything, on the thread that drops it.
#[derive(Clone)]
pub(crate) struct TierHandle(Arc<Handles>);

/// What the handles share: the core; its drop is the last handle's.
struct Handles {
    core: Arc<Core>,
}

impl TierHandle {
    fn new(core: Core) -> Self {
        TierHandle(Arc::new(Handles { core: Arc::new(core) }))
    }
}

impl std::ops::Deref for TierHandle {
    type Target = Arc<Core>;
    fn deref(&self) -> &Arc<Core> {
        &self.0.core
    }
}

impl Drop for Handles {
    fn drop(&mut self) {
        // Seeded bug (tests only): the demotion thread is left to notice on its own, holding the
        // core (and the SSD files' locks) for as long as the job it is writing.
        if crate::seeded::seeded("ssd-drop-leaves-worker") {
            return;
        }
        if let Some(ssd) = ssd::SsdTier::of(&self.core) {
            ssd.stop_worker();
        }
    }
}

impl Flavor {
    /// The block layout.
    pub(crate) fn geometry(&self) -> &Geometry {
        match_flavor!(self, Flavor::InProcess(core) => core.geometry(), Flavor::Connected(d) => &d.geometry)
    }

    /// The pool (a connected tier's: this process's mapping of the daemon's).
    pub(crate) fn pool(&self) -> &HostPool {
        match_flavor!(self, Flavor::InProcess(core) => core.pool(), Flavor::Connected(d) => &d.pool)
    }

    /// True once [`HostTier::shutdown`] was called on this tier (a connected tier: on this handle
    /// or one of its clones).
    pub(crate) fn is_shutting_down(&self) -> bool {
        match_flavor!(self,
            Flavor::InProcess(core) => core.is_shutting_down(),
            Flavor::Connected(d) => d.is_shutting_down(),
        )
    }

    /// Counts a copy of `blocks` blocks (`bytes` bytes) that ended `ok` or not, with its
    /// queue-to-completion `latency` if it completed, in an in-process tier's counters (a connected
    /// tier's daemon counts the copies its ranks report).
    pub(crate) fn record_copy(
        &self,
        dir: crate::copy::Direction,
        blocks: u64,
        bytes: u64,
        ok: bool,
        latency: Option<std::time::Duration>,
    ) {
        match_flavor!(self,
            Flavor::InProcess(core) => core.counters.record_copy(dir, blocks, bytes, ok, latency),
            Flavor::Connected(_) => (),
        )
    }
}

/// The host tier: a shared handle (cloning is cheap and shares the tier).
#[derive(Clone)]
pub struct HostTier {
    flavor: Flavor,
}

impl HostTier {
    /// Maps the pool and builds the index and the eviction policy.
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool cannot be mapped (see [`HostPool::new`]); [`Error::Tier`] with
    /// [`TierError::Index`] if the index cannot be sized as asked.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvtier::{ArenaSpec, Geometry, HostTier, TierConfig};
    ///
    /// // One arena of 4 KiB pages, 8 GPU pages per rank, 16 tokens a page; a 1 MiB host pool.
    /// let geometry = Geometry::new("doc", 16, vec![ArenaSpec::packed("kv", 4096, 8)])?;
    /// let tier = HostTier::new(TierConfig::new(geometry, 1 << 20))?;
    /// assert!(tier.stats().capacity > 0); // slots of one block each
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn new(config: TierConfig) -> Result<Self, Error> {
        let pool = HostPool::new(config.geometry.slot_bytes(), &config.pool)?;
        Self::over_pool(config, pool)
    }

    /// [`HostTier::new`] with the pool in shared memory (a memfd, see [`HostPool::new_shared`]),
    /// so other processes can map its slots: what the tier daemon serves.
    ///
    /// # Errors
    /// As [`HostTier::new`].
    pub fn new_shared(config: TierConfig) -> Result<Self, Error> {
        let pool = HostPool::new_shared(config.geometry.slot_bytes(), &config.pool)?;
        Self::over_pool(config, pool)
    }

    /// [`HostTier::new`] with the core adjusted by `adjust` before it is shared (what a hybrid
    /// tier's groups enable: cold marks, the eviction log).
    pub(crate) fn new_adjusted(config: TierConfig, adjust: impl FnOnce(Core) -> Core) -> Result<Self, Error> {
        let pool = HostPool::new(config.geometry.slot_bytes(), &config.pool)?;
        Self::build(config, pool, adjust)
    }

    fn over_pool(config: TierConfig, pool: HostPool) -> Result<Self, Error> {
        Self::build(config, pool, |c| c)
    }

    fn build(config: TierConfig, pool: HostPool, adjust: impl FnOnce(Core) -> Core) -> Result<Self, Error> {
        let ssd = match &config.ssd {
            Some(ssd) => Some(ssd::SsdTier::open(ssd, &config.geometry, pool.capacity())?),
            None => None,
        };
        let mut core = Core::new(config.geometry, pool, config.policy, config.index_capacity, config.lease_ttl)?
            .with_chain_aware(config.chain_aware)
            .with_protect_hinted(config.protect_hinted);
        if let Some(capacity) = config.events {
            core = core.with_event_log(capacity);
        }
        if let Some(ssd) = ssd {
            core = core.with_ssd(Box::new(ssd));
        }
        let tier = HostTier::from_core(adjust(core));
        #[cfg(not(loom))]
        ssd::demote::start(tier.core())
            .map_err(|source| Error::Thread { what: "starting the demotion thread", source })?;
        // Built whole: from here on a drop keeps the SSD files (before, an error removed those made).
        if let Some(ssd) = ssd::SsdTier::of(tier.core()) {
            ssd.keep_files();
        }
        Ok(tier)
    }

    /// A tier of `config` (its [`TierConfig::ssd`] ignored) over `model`, a drive without files,
    /// for simulators: the model is its lower tier as an SSD tier is, and marks the host blocks it
    /// holds a copy of, so the tier's victim selection takes them before the others as it does
    /// over a real drive. A query never promotes from the model (the simulator does, by saving).
    ///
    /// # Errors
    /// As [`HostTier::new`].
    #[cfg(not(loom))]
    pub fn over_ssd_model(mut config: TierConfig, model: &mut ssd::model::SsdModel) -> Result<Self, Error> {
        config.ssd = None;
        let tier = Self::new_adjusted(config, |core| {
            let lower = model.lower_tier(core.pool().capacity());
            core.with_ssd(lower)
        })?;
        model.set_host(tier.core().clone());
        Ok(tier)
    }

    pub(crate) fn from_core(core: Core) -> Self {
        HostTier { flavor: Flavor::InProcess(TierHandle::new(core)) }
    }

    /// What the SSD tier holds and has done, or `None` without one. A connected tier asks its
    /// daemon for the daemon's SSD tier's figures (`None` also when the daemon cannot answer: see
    /// [`HostTier::try_ssd_stats`]).
    pub fn ssd_stats(&self) -> Option<ssd::SsdStats> {
        self.try_ssd_stats().ok().flatten()
    }

    /// [`HostTier::ssd_stats`], with a connected tier's failure to reach its daemon as an error.
    ///
    /// # Errors
    /// A connected tier's transport or protocol errors.
    pub fn try_ssd_stats(&self) -> Result<Option<ssd::SsdStats>, TierError> {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => Ok(ssd::SsdTier::of(core).map(|s| s.stats())),
            Flavor::Connected(d) => d.ssd_stats(),
        )
    }

    /// Moves the events recorded since the last call to `out`, oldest first: every block the tier
    /// stored or evicted, on the host and on its SSD tier ([`TierEvent`]); returns how many
    /// events the log has dropped so far because it was full. Nothing is recorded without
    /// [`TierConfig::events`], and a connected tier records nothing (its daemon publishes its
    /// own: `kvtierd --kv-events`).
    pub fn take_events(&self, out: &mut Vec<TierEvent>) -> u64 {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.take_events(out),
            Flavor::Connected(_) => 0,
        )
    }

    /// Waits until every demotion queued so far is written to the SSD tier (or skipped, or
    /// failed); returns at once without an SSD tier. For a clean shutdown that keeps the most on
    /// disk, and for tests.
    pub fn flush_demotions(&self) {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => if let Some(s) = ssd::SsdTier::of(core) { s.flush() },
            Flavor::Connected(_) => {},
        )
    }

    /// Attaches one rank's copy backend (its device and GPU arenas) and returns its [`Rank`].
    ///
    /// # Errors
    /// [`TierError::GeometryMismatch`] if the backend's geometry has another model, page size, slot
    /// size or chunk layout than the tier's (a tensor-parallel shard may differ: its keys differ
    /// anyway); errors from [`CopyBackend::bind_pool`]; [`TierError::ShuttingDown`].
    ///
    /// # Examples
    ///
    /// ```
    /// use kvtier::{MemcpyArenas, ArenaSpec, EngineArenas, Geometry, HostTier, TierConfig};
    /// use std::sync::Arc;
    ///
    /// let geometry = Geometry::new("doc", 16, vec![ArenaSpec::packed("kv", 4096, 8)])?;
    /// let tier = HostTier::new(TierConfig::new(geometry.clone(), 1 << 20))?;
    /// // Host memory stands in for a GPU's arenas; on a GPU: kvtier::CudaArenas.
    /// let arenas = Arc::new(MemcpyArenas::new(&geometry)?);
    /// let rank = tier.attach(arenas.backend()?)?; // one rank per GPU
    /// # let _ = rank;
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn attach(&self, mut backend: Box<dyn CopyBackend>) -> Result<Rank, TierError> {
        if self.flavor.is_shutting_down() {
            return Err(TierError::ShuttingDown);
        }
        let (bg, tg) = (backend.geometry(), self.flavor.geometry());
        if bg.model() != tg.model()
            || bg.page_tokens() != tg.page_tokens()
            || bg.slot_bytes() != tg.slot_bytes()
            || bg.chunk_offsets() != tg.chunk_offsets()
        {
            return Err(TierError::GeometryMismatch { backend: bg.model().to_string(), tier: tg.model().to_string() });
        }
        backend.bind_pool(self.flavor.pool()).map_err(|e: CopyError| TierError::Copy(e))?;
        let id = match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.next_rank_id(),
            Flavor::Connected(d) => d.conn.attach()?,
        );
        Ok(Rank::start(self.flavor.clone(), std::sync::Arc::from(backend), id))
    }

    /// Pins the longest run of leading `keys` whose blocks are ready and returns a one-use lease on
    /// them (see [`Lease`]). Hits refresh the blocks' recency. The run also ends at the first key
    /// that repeats an earlier one (a lease pins each slot once), and at a block whose slot already
    /// holds the most pins leases may take (`SlotWord::LEASE_PINS`).
    ///
    /// # Examples
    ///
    /// ```
    /// # use kvtier::{MemcpyArenas, ArenaSpec, EngineArenas, Geometry, HostTier, TierConfig, WaitFor};
    /// # use std::sync::Arc;
    /// # let geometry = Geometry::new("doc", 16, vec![ArenaSpec::packed("kv", 4096, 8)])?;
    /// # let tier = HostTier::new(TierConfig::new(geometry.clone(), 1 << 20))?;
    /// # let arenas = Arc::new(MemcpyArenas::new(&geometry)?);
    /// # let rank = tier.attach(arenas.backend()?)?;
    /// let keys: Vec<_> = (0..4).map(|i| tier.namespace().trace_page_key(7, i)).collect();
    /// rank.save(&keys[..2], &[0, 1], WaitFor::Nothing)?.handle.wait()?;
    /// let lease = tier.query(&keys); // the two leading blocks are resident: a lease on them
    /// assert_eq!(lease.len(), 2);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn query(&self, keys: &[ContentKey]) -> Lease {
        self.query_shared(keys, 1)
    }

    /// [`HostTier::query`] with `uses` restores allowed (one per rank that will restore), so every
    /// data-parallel rank can restore the same blocks from one lease. `uses == 0` returns a lease
    /// that is already settled (it pins nothing).
    ///
    /// A connected tier whose daemon is gone answers with an empty lease (a miss: the engine
    /// prefills); [`HostTier::try_query_shared`] reports the error instead.
    pub fn query_shared(&self, keys: &[ContentKey], uses: u32) -> Lease {
        self.try_query_shared(keys, uses).unwrap_or_else(|_| {
            match_flavor!(&self.flavor,
                Flavor::InProcess(core) => Lease::acquire(core, &[], uses),
                Flavor::Connected(d) => d.settled_lease(),
            )
        })
    }

    /// [`HostTier::query_shared`], reporting a lost daemon connection.
    ///
    /// # Errors
    /// [`TierError::Disconnected`] (connected tiers only; an in-process tier always answers).
    pub fn try_query_shared(&self, keys: &[ContentKey], uses: u32) -> Result<Lease, TierError> {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => Ok(Lease::acquire(core, keys, uses)),
            Flavor::Connected(d) => d.query(keys, uses),
        )
    }

    /// True if `key`'s block is ready (does not pin or refresh it).
    pub fn contains(&self, key: &ContentKey) -> bool {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.index().get(key).is_some_and(|r| {
                let w = core.control().load(r.slot);
                w.state() == SlotState::Ready && w.generation() == r.generation
            }),
            Flavor::Connected(d) => d.conn.contains(key).unwrap_or(false),
        )
    }

    /// Scheduler hint: the engine's queued requests will look up `keys` within `ttl`. Until the
    /// hint is withdrawn ([`HostTier::withdraw_hint`]) or `ttl` has passed (capped at
    /// [`MAX_HINT_TTL`]), eviction takes none of these keys' blocks while an unhinted block is
    /// evictable; a hinted block is still evicted when nothing else can be (a hint never makes a
    /// save fail). Keys not resident yet are protected from the moment a save stores them. Several
    /// hints may name a key: it stays hinted until the last of them ends. Costs one lock and one
    /// index lookup per key; victim selection reads one word per candidate while any hint is live.
    ///
    /// On a connected tier (`HostTier::connect`, feature `remote`) the hint goes to the daemon's tier; if the daemon
    /// is gone or refuses the hint (its bounds: hints and keys per connection, hint bytes over all
    /// connections) the hint is lost (a hint is advice, never an error here), the refusal is logged
    /// (`tracing`, warn) and the id returned, 0, withdraws nothing. [`HostTier::try_hint`] returns
    /// the refusal instead.
    pub fn hint(&self, keys: &[ContentKey], ttl: std::time::Duration) -> HintId {
        self.try_hint(keys, ttl).unwrap_or_else(|e| {
            tracing::warn!("a hint on {} keys was not given: {e}", keys.len());
            HintId::from_number(0)
        })
    }

    /// [`HostTier::hint`], refused with a typed error rather than lost.
    ///
    /// # Errors
    /// [`TierError::LimitExceeded`]: the hint is over a bound: the table's budget of bytes
    /// ([`crate::Limit::HintBytes`]: a daemon's `Limits::hint_bytes` over all its connections; an
    /// in-process tier's hints are unbounded), or on a connected tier the connection's hints or
    /// hinted keys ([`crate::Limit::HintsPerConnection`], [`crate::Limit::HintKeysPerConnection`])
    /// or the keys of one request. On a connected tier also [`TierError::Disconnected`] (the
    /// daemon is gone). Nothing is hinted.
    pub fn try_hint(&self, keys: &[ContentKey], ttl: std::time::Duration) -> Result<HintId, TierError> {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.try_hint(keys, ttl),
            Flavor::Connected(d) => {
                let r = d.conn.hint(keys, ttl);
                // Seeded bug (tests only): `hint-refusal-silent` answers a refused hint with id 0.
                let r = if crate::seeded::seeded("hint-refusal-silent") { r.or(Ok(0)) } else { r };
                r.map(HintId::from_number)
            }
        )
    }

    /// Withdraws a hint (the request was admitted or dropped). Returns false if it had already been
    /// withdrawn or had expired (or, on a connected tier, if the daemon is gone).
    pub fn withdraw_hint(&self, id: HintId) -> bool {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.withdraw_hint(id),
            Flavor::Connected(d) => d.conn.withdraw_hint(id.get()).unwrap_or(false),
        )
    }

    /// Hints given and neither withdrawn nor found expired yet (expiry is noticed by the next
    /// `hint` or `withdraw_hint`).
    pub fn live_hints(&self) -> usize {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.hints.live(),
            Flavor::Connected(d) => d.conn.live_hints().unwrap_or(0),
        )
    }

    /// Evicts up to `n` unpinned ready blocks by the policy and returns how many it freed (at most
    /// the pool's capacity: a larger `n`, `usize::MAX` included, means "every evictable block" and
    /// allocates nothing sized by `n`). Never panics; pinned and half-written blocks stay.
    pub fn evict(&self, n: usize) -> usize {
        let core = match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core,
            Flavor::Connected(d) => return d.conn.evict(n).unwrap_or(0),
        );
        let n = if crate::seeded::seeded("evict-unclamped") { n } else { n.min(self.capacity() as usize) };
        let mut slots = Vec::with_capacity(n.min(1024));
        let freed = core.evict_into(n, &mut slots);
        for s in slots {
            core.pool().free(s);
        }
        freed
    }

    /// Settles every lease older than [`TierConfig::lease_ttl`] now (saves do it themselves when
    /// the pool is short of slots); returns how many it settled. A no-op without a TTL.
    pub fn expire_leases(&self) -> usize {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.expire_leases(),
            Flavor::Connected(d) => d.conn.expire_leases().unwrap_or(0),
        )
    }

    /// Live counters (a connected tier's daemon's; all zero once its connection is lost).
    pub fn stats(&self) -> TierStats {
        self.try_stats().unwrap_or_default()
    }

    /// How this tier's eviction lock was used: how often saves, SSD promotions and
    /// [`HostTier::evict`] took it, and how long they waited for it and held it (see
    /// [`EvictionLockStats`]: `held_ns / holds` is the serial cost of a save that evicts). `None`
    /// for a connected tier (the lock is the daemon's: its metrics endpoint reports it).
    pub fn eviction_lock_stats(&self) -> Option<EvictionLockStats> {
        self.in_process_core().map(|core| core.eviction_lock_stats())
    }

    /// [`HostTier::stats`], reporting a lost daemon connection.
    ///
    /// # Errors
    /// [`TierError::Disconnected`] (connected tiers only).
    pub fn try_stats(&self) -> Result<TierStats, TierError> {
        match_flavor!(&self.flavor, Flavor::InProcess(core) => Ok(core.stats()), Flavor::Connected(d) => d.stats())
    }

    /// The block layout.
    pub fn geometry(&self) -> &Geometry {
        self.flavor.geometry()
    }

    /// The namespace folded into this tier's content keys.
    pub fn namespace(&self) -> Namespace {
        self.flavor.geometry().namespace()
    }

    /// The host pool (capacity, backing). For a connected tier, this process's mapping of the
    /// daemon's pool: its free list is not the daemon's (use [`HostTier::stats`]).
    pub fn pool(&self) -> &HostPool {
        self.flavor.pool()
    }

    /// Slots in the pool.
    pub fn capacity(&self) -> u32 {
        self.flavor.pool().capacity()
    }

    /// The eviction policy's name.
    pub fn policy_name(&self) -> &'static str {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.policy().name(),
            Flavor::Connected(d) => d.policy.name(),
        )
    }

    /// Stops accepting saves, restores and attaches (queries still answer). In-flight copies
    /// complete normally; drain each rank with [`Rank::shutdown`]. For a connected tier this stops
    /// this handle (and its clones) only, not the daemon.
    pub fn shutdown(&self) {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core.begin_shutdown(),
            Flavor::Connected(d) => d.begin_shutdown(),
        )
    }

    /// The core of an in-process tier; `None` for a connected tier.
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn in_process_core(&self) -> Option<&Arc<Core>> {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => Some(&**core),
            Flavor::Connected(_) => None,
        )
    }

    /// The core of an in-process tier (the tier daemon serves one, tests inspect one).
    ///
    /// # Panics
    /// For a connected tier, which has no core: its state lives in the daemon.
    pub(crate) fn core(&self) -> &Arc<Core> {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => core,
            Flavor::Connected(_) => panic!("a connected tier has no core: its state lives in the tier daemon"),
        )
    }
}

impl std::fmt::Debug for HostTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match_flavor!(&self.flavor,
            Flavor::InProcess(core) => f.debug_struct("HostTier").field("core", &**core).finish(),
            Flavor::Connected(d) => f.debug_struct("HostTier").field("connected", d).finish(),
        )
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
