//! `HostTier`: the facade an engine calls. One tier (pool, index, eviction) is shared by every rank;
//! each rank attaches its own copy backend (device and GPU arenas) and gets a [`Rank`].
//!
//! ```text
//!   engine rank 0 --save/restore--> Rank 0 (backend: GPU 0 arenas) --+
//!   engine rank 1 --save/restore--> Rank 1 (backend: GPU 1 arenas) --+--> Core: HostPool + BlockIndex
//!   any thread ----query-----------> HostTier --------------------------+     + EvictionPolicy + stats
//! ```
//!
//! Flows (see `docs/design.md` for the invariants):
//! - **save** ([`Rank::save`]): keys already resident are refreshed (no copy), keys in flight are
//!   skipped, the rest get slots (evicting if the pool is full), are inserted into the index as
//!   `WRITING` (invisible to queries; a concurrent save of the same key finds the entry and copies
//!   nothing), and are copied GPU -> host in one batch. When the copy completes the rank's
//!   completion thread commits them `READY`.
//! - **query** ([`HostTier::query`]): pins the longest run of leading keys that are ready and returns
//!   a [`Lease`] on them.
//! - **restore** ([`Rank::restore`]): takes guard pins on the leased slots, submits the host -> GPU
//!   batch, consumes one use of the lease; the guards drop when the copy completes.

use crate::copy::{CopyBackend, CopyPair, Direction, WaitFor};
use crate::error::{CopyError, Error, TierError};
use crate::evict::{EvictionPolicy, InsertInfo, PolicyKind};
use crate::geometry::Geometry;
use crate::guard::{Reserved, SlotPins, WriteReservation};
use crate::handle::{CopyHandle, HandleShared};
use crate::index::{BlockIndex, SlotRef};
use crate::key::{ContentKey, Namespace};
use crate::lease::{Lease, LeasedBlock};
use crate::pool::{HostPool, PoolConfig};
use crate::slot::{PinError, SlotControl, SlotId, SlotState};
use crate::sync::{Arc, AtomicBool, AtomicU32, AtomicU64, Mutex, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// Tier construction options.
#[derive(Clone, Debug)]
pub struct TierConfig {
    /// Block layout shared by every rank.
    pub geometry: Geometry,
    /// Host pool options (`pool.bytes` decides the capacity in slots).
    pub pool: PoolConfig,
    /// Eviction policy.
    pub policy: PolicyKind,
    /// Expected number of resident blocks for sizing the index (default: the pool's capacity).
    pub index_capacity: Option<usize>,
}

impl TierConfig {
    /// A configuration with a `pool_bytes` pool (backing chosen automatically) and LRU eviction.
    pub fn new(geometry: Geometry, pool_bytes: u64) -> Self {
        TierConfig {
            geometry,
            pool: PoolConfig { bytes: pool_bytes, ..Default::default() },
            policy: PolicyKind::Lru,
            index_capacity: None,
        }
    }

    /// [`TierConfig::new`] with a 4 GiB pool.
    pub fn default_for(geometry: Geometry) -> Self {
        Self::new(geometry, 4 << 30)
    }
}

/// How [`Rank::save_with`] handles a batch that does not fit.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum Fit {
    /// Save every missing key or none: if they cannot all fit, fail with
    /// [`TierError::CannotFit`] before evicting anything.
    #[default]
    AllOrNothing,
    /// Save the longest leading run of missing keys that fits and that the eviction policy admits
    /// ([`crate::evict::EvictionPolicy::admit`]); report the rest as dropped.
    Prefix,
}

/// Options for [`Rank::save_with`].
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveOptions {
    /// What to do when the batch does not fit.
    pub fit: Fit,
}

/// Hints for the eviction policy about a save ([`Rank::save_hinted`]); they never change what is
/// saved.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct SaveHint {
    /// Depth of `keys[0]` in its prompt (0 = the prompt's first page), so `keys[i]` is at depth
    /// `prefix_depth + i`. A prefix-aware policy ([`PolicyKind::PrefixLfu`]) evicts a chain's tail
    /// before its head.
    pub prefix_depth: Option<u32>,
}

/// What a save did.
#[derive(Debug)]
pub struct SaveTicket {
    /// Indices (into the keys given) of the blocks being copied, in order.
    pub saving: Vec<usize>,
    /// Keys already resident: nothing copied, recency refreshed.
    pub resident: usize,
    /// Keys being saved by another save right now: nothing copied.
    pub in_flight: usize,
    /// Missing keys not saved because they did not fit or the policy did not admit them (or one
    /// before them) ([`Fit::Prefix`] only).
    pub dropped: usize,
    /// Completes when the copied blocks are committed and visible to queries.
    pub handle: CopyHandle,
}

/// A snapshot of the tier's counters. Block counts are blocks (pages across all arenas); bytes are
/// payload bytes (blocks x [`Geometry::block_bytes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct TierStats {
    /// Queries answered.
    pub queries: u64,
    /// Blocks found by queries (leased).
    pub hit_blocks: u64,
    /// Keys queried but not leased (not resident, or after the first miss).
    pub miss_blocks: u64,
    /// Blocks whose save copy completed and which became ready.
    pub saved_blocks: u64,
    /// Save keys skipped because they were resident (recency refreshed).
    pub save_skipped_resident: u64,
    /// Save keys skipped because another save of them was in flight.
    pub save_skipped_in_flight: u64,
    /// Save keys dropped by [`Fit::Prefix`] because they did not fit or were not admitted.
    pub save_dropped: u64,
    /// Saves refused whole ([`TierError::CannotFit`] or [`TierError::PoolExhausted`]).
    pub saves_refused: u64,
    /// Blocks whose save copy failed (never made visible).
    pub save_failed_blocks: u64,
    /// Blocks restored (copy completed).
    pub restored_blocks: u64,
    /// Blocks whose restore copy failed.
    pub restore_failed_blocks: u64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Payload bytes copied GPU -> host by completed saves.
    pub bytes_saved: u64,
    /// Payload bytes copied host -> GPU by completed restores.
    pub bytes_restored: u64,
    /// Slots with at least one pin (lease or restore guard).
    pub pinned_slots: u64,
    /// Slots holding a ready block.
    pub ready_slots: u64,
    /// Slots reserved by saves in flight.
    pub writing_slots: u64,
    /// Slots on the free list.
    pub free_slots: u64,
    /// Slots in the pool.
    pub capacity: u64,
    /// Entries in the index.
    pub index_entries: u64,
}

#[derive(Default)]
struct Counters {
    queries: AtomicU64,
    hit_blocks: AtomicU64,
    miss_blocks: AtomicU64,
    saved_blocks: AtomicU64,
    save_skipped_resident: AtomicU64,
    save_skipped_in_flight: AtomicU64,
    save_dropped: AtomicU64,
    saves_refused: AtomicU64,
    save_failed_blocks: AtomicU64,
    restored_blocks: AtomicU64,
    restore_failed_blocks: AtomicU64,
    evictions: AtomicU64,
    bytes_saved: AtomicU64,
    bytes_restored: AtomicU64,
    // Gauges: updated with wrapping add/sub, read as signed and clamped (a pin and an unpin of one
    // slot may publish their +1/-1 in either order).
    pinned_slots: AtomicU64,
    ready_slots: AtomicU64,
    writing_slots: AtomicU64,
}

impl Counters {
    fn done(&self, dir: Direction) -> &AtomicU64 {
        match dir {
            Direction::Save => &self.saved_blocks,
            Direction::Restore => &self.restored_blocks,
        }
    }
    fn bytes(&self, dir: Direction) -> &AtomicU64 {
        match dir {
            Direction::Save => &self.bytes_saved,
            Direction::Restore => &self.bytes_restored,
        }
    }
    fn failed(&self, dir: Direction) -> &AtomicU64 {
        match dir {
            Direction::Save => &self.save_failed_blocks,
            Direction::Restore => &self.restore_failed_blocks,
        }
    }
}

fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}
fn sub(c: &AtomicU64, n: u64) {
    c.fetch_sub(n, Ordering::Relaxed);
}
fn gauge(c: &AtomicU64) -> u64 {
    (c.load(Ordering::Relaxed) as i64).max(0) as u64
}

/// Slot counts by state, from [`Core::audit`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct AuditReport {
    /// `FREE` slots.
    pub free: usize,
    /// `WRITING` slots.
    pub writing: usize,
    /// `READY` slots.
    pub ready: usize,
    /// `EVICTING` slots (0 when quiescent).
    pub evicting: usize,
    /// Slots with at least one pin.
    pub pinned: usize,
}

/// The shared state behind a [`HostTier`]: pool, index, policy, per-slot keys and counters.
pub struct Core {
    geometry: Geometry,
    pool: HostPool,
    index: BlockIndex,
    policy: Box<dyn EvictionPolicy>,
    /// The key of the block in each slot (two words), written by the slot's owner while `WRITING`
    /// and read by the evictor after it won `READY -> EVICTING`; the slot word's CASes order them.
    slot_keys: Box<[[AtomicU64; 2]]>,
    /// Prompt depth of the block in each slot ([`SaveHint::prefix_depth`]; `u32::MAX` = unknown),
    /// written with the key.
    slot_depth: Box<[AtomicU32]>,
    counters: Counters,
    evict_lock: Mutex<()>,
    shutting_down: AtomicBool,
    next_rank: AtomicU32,
}

impl Core {
    /// Builds the shared state over an existing pool (used by [`HostTier::new`] and by model tests).
    pub fn new(geometry: Geometry, pool: HostPool, policy: PolicyKind, index_capacity: Option<usize>) -> Self {
        let cap = pool.capacity();
        Core {
            index: BlockIndex::with_capacity(index_capacity.unwrap_or(cap as usize)),
            policy: policy.build(cap),
            slot_keys: (0..cap).map(|_| [AtomicU64::new(0), AtomicU64::new(0)]).collect(),
            slot_depth: (0..cap).map(|_| AtomicU32::new(u32::MAX)).collect(),
            counters: Counters::default(),
            evict_lock: Mutex::new(()),
            shutting_down: AtomicBool::new(false),
            next_rank: AtomicU32::new(0),
            geometry,
            pool,
        }
    }

    fn control(&self) -> &SlotControl {
        self.pool.control()
    }

    /// The pool.
    pub fn pool(&self) -> &HostPool {
        &self.pool
    }

    /// The index.
    pub fn index(&self) -> &BlockIndex {
        &self.index
    }

    pub(crate) fn pin(&self, slot: SlotId, generation: u64) -> Result<(), PinError> {
        if self.control().pin(slot, generation)? == 1 {
            add(&self.counters.pinned_slots, 1);
        }
        Ok(())
    }

    pub(crate) fn unpin(&self, slot: SlotId) {
        if self.control().unpin(slot) == 0 {
            sub(&self.counters.pinned_slots, 1);
        }
    }

    fn set_slot_key(&self, slot: SlotId, key: &ContentKey) {
        let (lo, hi) = key.words();
        let k = &self.slot_keys[slot.index()];
        k[0].store(lo, Ordering::Relaxed);
        k[1].store(hi, Ordering::Relaxed);
    }

    fn slot_key(&self, slot: SlotId) -> ContentKey {
        let k = &self.slot_keys[slot.index()];
        ContentKey::from_words(k[0].load(Ordering::Relaxed), k[1].load(Ordering::Relaxed))
    }

    /// Reserves `slot` (just taken from the pool or freed by eviction, owned by the caller) for
    /// `key`: `FREE -> WRITING`, records the key and its prefix `depth` (`u32::MAX`: unknown), inserts
    /// the index entry. Returns true and adds the block to `reservation` if this call's entry won;
    /// false if another save of `key` holds the entry (the slot is then released and returned to the
    /// free list).
    ///
    /// Model-test hook (used by `Rank::save_with` and the loom models); not a stable API.
    #[doc(hidden)]
    pub fn reserve_block(&self, key: ContentKey, slot: SlotId, depth: u32, reservation: &mut WriteReservation) -> bool {
        let generation = self.control().reserve(slot);
        self.set_slot_key(slot, &key);
        self.slot_depth[slot.index()].store(depth, Ordering::Relaxed);
        add(&self.counters.writing_slots, 1);
        match self.index.insert_if_absent(key, SlotRef { slot, generation }) {
            Ok(()) => {
                reservation.push(Reserved { key, slot, generation });
                true
            }
            Err(_) => {
                // Another save of this key won the race: give the slot back.
                self.control().release(slot);
                self.pool.free(slot);
                sub(&self.counters.writing_slots, 1);
                false
            }
        }
    }

    pub(crate) fn commit_reserved(&self, r: Reserved) {
        // The policy learns about the block before it becomes evictable, so a selection never sees it
        // with the previous occupant's state.
        let depth = self.slot_depth[r.slot.index()].load(Ordering::Relaxed);
        self.policy
            .on_insert(r.slot, InsertInfo { key_hash: r.key.hash64(), depth: (depth != u32::MAX).then_some(depth) });
        self.control().commit(r.slot, r.generation);
        sub(&self.counters.writing_slots, 1);
        add(&self.counters.ready_slots, 1);
    }

    pub(crate) fn abort_reserved(&self, r: Reserved) {
        // Index entry first, then the generation bump, then the free list.
        let removed = self.index.remove_if(&r.key, SlotRef { slot: r.slot, generation: r.generation });
        debug_assert!(removed, "reserved block {:?} lost its index entry", r.key);
        self.control().release(r.slot);
        self.pool.free(r.slot);
        sub(&self.counters.writing_slots, 1);
    }

    fn evictable(&self, slot: SlotId) -> bool {
        let w = self.control().load(slot);
        w.state() == SlotState::Ready && w.pins() == 0
    }

    /// Slots a save could obtain now: free plus ready-and-unpinned (a snapshot).
    pub fn available_slots(&self) -> usize {
        let evictable = gauge(&self.counters.ready_slots).saturating_sub(gauge(&self.counters.pinned_slots));
        self.pool.free_count() + evictable as usize
    }

    /// Claims up to `n` more unpinned ready victims chosen by the policy (`READY -> EVICTING`), appending
    /// `(slot, generation)` to `claims`. A claimed block is invisible to new pins but still indexed and
    /// intact, so a claim can be given back ([`Core::cancel_evictions`]) or completed
    /// ([`Core::finish_evictions`]). The caller holds the eviction lock.
    fn claim_victims(&self, n: usize, claims: &mut Vec<(SlotId, u64)>) {
        let start = claims.len();
        let mut cands = Vec::new();
        for _round in 0..3 {
            let have = claims.len() - start;
            if have >= n {
                break;
            }
            cands.clear();
            self.policy.select_victims(n - have, &|s| self.evictable(s), &mut cands);
            if cands.is_empty() {
                break;
            }
            for &s in &cands {
                if claims.len() - start >= n {
                    break;
                }
                // The CAS refuses a slot that was pinned since selection: never evict a pinned block.
                let Some(generation) = self.control().begin_evict(s) else { continue };
                sub(&self.counters.ready_slots, 1);
                claims.push((s, generation));
            }
        }
    }

    /// Completes claimed evictions: each index entry is removed before the slot's generation is
    /// bumped (so even a reader holding the old entry fails to pin); the freed slots (not on the free
    /// list) are appended to `out`.
    fn finish_evictions(&self, claims: &[(SlotId, u64)], out: &mut Vec<SlotId>) {
        for &(s, generation) in claims {
            let key = self.slot_key(s);
            let removed = self.index.remove_if(&key, SlotRef { slot: s, generation });
            debug_assert!(removed, "ready block in slot {} had no index entry", s.0);
            self.policy.on_remove(s);
            self.control().release(s);
            add(&self.counters.evictions, 1);
            out.push(s);
        }
    }

    /// Gives claimed victims back untouched (`EVICTING -> READY`): their blocks stay resident.
    fn cancel_evictions(&self, claims: &[(SlotId, u64)]) {
        for &(s, generation) in claims {
            self.control().cancel_evict(s, generation);
            add(&self.counters.ready_slots, 1);
        }
    }

    /// Evicts up to `n` unpinned ready blocks chosen by the policy and appends their (now free,
    /// generation-bumped, not on the free list) slots to `out`. Returns how many were evicted.
    ///
    /// Model-test hook (the loom models call it directly); not a stable API.
    #[doc(hidden)]
    pub fn evict_into(&self, n: usize, out: &mut Vec<SlotId>) -> usize {
        let _serialise = self.evict_lock.lock().expect("evict lock");
        let mut claims = Vec::new();
        self.claim_victims(n, &mut claims);
        self.finish_evictions(&claims, out);
        claims.len()
    }

    /// Takes `n` slots for a save, all or none: free ones first, then evicting. Eviction is
    /// two-phase under the eviction lock: victims are only claimed until the save is sure to get all
    /// `n` slots, so a save that cannot be satisfied (other threads pinned or took slots since its fit
    /// check) gives every claim back and evicts nothing (invariant I7, also under concurrency).
    ///
    /// # Errors
    /// [`TierError::PoolExhausted`] (free slots taken are returned to the free list, claimed blocks
    /// stay resident).
    ///
    /// Model-test hook (the loom models call it directly); not a stable API.
    #[doc(hidden)]
    pub fn acquire_slots(&self, n: usize) -> Result<Vec<SlotId>, TierError> {
        let mut got = Vec::with_capacity(n);
        let fill = |got: &mut Vec<SlotId>, target: usize| {
            while got.len() < target {
                match self.pool.alloc() {
                    Some(s) => got.push(s),
                    None => break,
                }
            }
        };
        fill(&mut got, n);
        if got.len() == n {
            return Ok(got);
        }
        let _serialise = self.evict_lock.lock().expect("evict lock");
        let mut claims = Vec::new();
        let mut stalls = 0;
        while got.len() + claims.len() < n && stalls < 4 {
            let before = got.len() + claims.len();
            self.claim_victims(n - before, &mut claims);
            fill(&mut got, n - claims.len());
            if got.len() + claims.len() == before {
                stalls += 1;
            }
        }
        if got.len() + claims.len() < n {
            self.cancel_evictions(&claims);
            let have = got.len() + claims.len();
            for s in got {
                self.pool.free(s);
            }
            return Err(TierError::PoolExhausted { needed: n, got: have });
        }
        self.finish_evictions(&claims, &mut got);
        Ok(got)
    }

    /// Pins the longest ready prefix of `keys` and returns a lease with `uses` uses (what
    /// [`HostTier::query_shared`] does).
    ///
    /// Model-test hook (the loom models call it directly); not a stable API.
    #[doc(hidden)]
    pub fn query(core: &Arc<Core>, keys: &[ContentKey], uses: u32) -> Lease {
        let this = &**core;
        let mut pins = SlotPins::empty(core);
        let mut blocks = Vec::new();
        {
            let reader = this.index.reader();
            for k in keys {
                let Some(r) = reader.get(k) else { break };
                if this.pin(r.slot, r.generation).is_err() {
                    break;
                }
                pins.push_pinned(r.slot);
                this.policy.on_hit(r.slot);
                blocks.push(LeasedBlock { key: *k, slot: r });
            }
        }
        add(&this.counters.queries, 1);
        add(&this.counters.hit_blocks, blocks.len() as u64);
        add(&this.counters.miss_blocks, (keys.len() - blocks.len()) as u64);
        Lease::new(core, blocks, pins, uses)
    }

    /// Checks the tier's structural invariants; meant for quiescent moments (tests, fuzzing,
    /// debugging), it reads every slot word and walks the index keys it is given.
    ///
    /// Checked: every key in `resident_keys` that the index holds maps to a distinct slot (no slot
    /// owned twice) whose word has the entry's generation and is `READY` or `WRITING`; the number of
    /// `READY` + `WRITING` slots equals the index's entry count; pinned slots are all `READY`; the
    /// free-list count equals the number of `FREE` slots.
    ///
    /// # Errors
    /// A description of the first violated invariant.
    pub fn audit(&self, resident_keys: &[ContentKey]) -> Result<AuditReport, String> {
        use bitvec::prelude::*;
        let cap = self.pool.capacity() as usize;
        let mut owned: BitVec = bitvec![0; cap];
        let mut rep = AuditReport::default();
        for k in resident_keys {
            let Some(r) = self.index.get(k) else { continue };
            if owned.replace(r.slot.index(), true) {
                return Err(format!("slot {} is named by two index entries", r.slot.0));
            }
            let w = self.control().load(r.slot);
            if w.generation() != r.generation || !matches!(w.state(), SlotState::Ready | SlotState::Writing) {
                return Err(format!("key {k} maps to slot {} gen {} but the slot is {w:?}", r.slot.0, r.generation));
            }
            if self.slot_key(r.slot) != *k {
                return Err(format!(
                    "slot {} holds key {} but the index maps {k} to it",
                    r.slot.0,
                    self.slot_key(r.slot)
                ));
            }
        }
        for s in 0..cap as u32 {
            let w = self.control().load(SlotId(s));
            match w.state() {
                SlotState::Free => rep.free += 1,
                SlotState::Writing => rep.writing += 1,
                SlotState::Ready => rep.ready += 1,
                SlotState::Evicting => rep.evicting += 1,
            }
            if w.pins() > 0 {
                rep.pinned += 1;
                if w.state() != SlotState::Ready {
                    return Err(format!("slot {s} is pinned but {w:?}"));
                }
            }
        }
        if rep.ready + rep.writing != self.index.len() {
            return Err(format!(
                "{} ready + {} writing slots but {} index entries",
                rep.ready,
                rep.writing,
                self.index.len()
            ));
        }
        if rep.free != self.pool.free_count() {
            return Err(format!("{} free slots but the free list holds {}", rep.free, self.pool.free_count()));
        }
        Ok(rep)
    }

    fn stats(&self) -> TierStats {
        let c = &self.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        TierStats {
            queries: l(&c.queries),
            hit_blocks: l(&c.hit_blocks),
            miss_blocks: l(&c.miss_blocks),
            saved_blocks: l(&c.saved_blocks),
            save_skipped_resident: l(&c.save_skipped_resident),
            save_skipped_in_flight: l(&c.save_skipped_in_flight),
            save_dropped: l(&c.save_dropped),
            saves_refused: l(&c.saves_refused),
            save_failed_blocks: l(&c.save_failed_blocks),
            restored_blocks: l(&c.restored_blocks),
            restore_failed_blocks: l(&c.restore_failed_blocks),
            evictions: l(&c.evictions),
            bytes_saved: l(&c.bytes_saved),
            bytes_restored: l(&c.bytes_restored),
            pinned_slots: gauge(&c.pinned_slots),
            ready_slots: gauge(&c.ready_slots),
            writing_slots: gauge(&c.writing_slots),
            free_slots: self.pool.free_count() as u64,
            capacity: self.pool.capacity() as u64,
            index_entries: self.index.len() as u64,
        }
    }
}

/// The host tier: a shared handle (cloning is cheap and shares the tier).
#[derive(Clone)]
pub struct HostTier {
    core: Arc<Core>,
}

impl HostTier {
    /// Maps the pool and builds the index and the eviction policy.
    ///
    /// # Errors
    /// [`Error::Pool`] if the pool cannot be mapped (see [`HostPool::new`]).
    pub fn new(config: TierConfig) -> Result<Self, Error> {
        let pool = HostPool::new(config.geometry.slot_bytes(), &config.pool)?;
        Ok(HostTier { core: Arc::new(Core::new(config.geometry, pool, config.policy, config.index_capacity)) })
    }

    /// Attaches one rank's copy backend (its device and GPU arenas) and returns its [`Rank`].
    ///
    /// # Errors
    /// [`TierError::Copy`] with [`CopyError::Mismatch`] if the backend's geometry has another model,
    /// page size, slot size or chunk layout than the tier's; errors from [`CopyBackend::bind_pool`];
    /// [`TierError::ShuttingDown`].
    pub fn attach(&self, mut backend: Box<dyn CopyBackend>) -> Result<Rank, TierError> {
        if self.core.shutting_down.load(Ordering::Acquire) {
            return Err(TierError::ShuttingDown);
        }
        // Same slot layout required; the tensor-parallel shard may differ (its keys differ anyway).
        let (bg, tg) = (backend.geometry(), &self.core.geometry);
        if bg.model() != tg.model()
            || bg.page_tokens() != tg.page_tokens()
            || bg.slot_bytes() != tg.slot_bytes()
            || bg.chunk_offsets() != tg.chunk_offsets()
        {
            return Err(TierError::Copy(CopyError::Mismatch(format!(
                "backend geometry `{}` does not match the tier's `{}`",
                backend.geometry().model(),
                self.core.geometry.model()
            ))));
        }
        backend.bind_pool(&self.core.pool)?;
        let id = self.core.next_rank.fetch_add(1, Ordering::Relaxed);
        Ok(Rank::start(self.core.clone(), std::sync::Arc::from(backend), id))
    }

    /// Pins the longest run of leading `keys` whose blocks are ready and returns a one-use lease on
    /// them (see [`Lease`]). Hits refresh the blocks' recency.
    pub fn query(&self, keys: &[ContentKey]) -> Lease {
        Core::query(&self.core, keys, 1)
    }

    /// [`HostTier::query`] with `uses` restores allowed (one per rank that will restore), so every
    /// data-parallel rank can restore the same blocks from one lease. `uses == 0` returns a lease
    /// that is already settled (it pins nothing).
    pub fn query_shared(&self, keys: &[ContentKey], uses: u32) -> Lease {
        Core::query(&self.core, keys, uses)
    }

    /// True if `key`'s block is ready (does not pin or refresh it).
    pub fn contains(&self, key: &ContentKey) -> bool {
        self.core.index.get(key).is_some_and(|r| {
            let w = self.core.control().load(r.slot);
            w.state() == SlotState::Ready && w.generation() == r.generation
        })
    }

    /// Evicts up to `n` unpinned ready blocks by the policy and returns how many it freed.
    pub fn evict(&self, n: usize) -> usize {
        let mut slots = Vec::new();
        let freed = self.core.evict_into(n, &mut slots);
        for s in slots {
            self.core.pool.free(s);
        }
        freed
    }

    /// Live counters.
    pub fn stats(&self) -> TierStats {
        self.core.stats()
    }

    /// The block layout.
    pub fn geometry(&self) -> &Geometry {
        &self.core.geometry
    }

    /// The namespace folded into this tier's content keys.
    pub fn namespace(&self) -> Namespace {
        self.core.geometry.namespace()
    }

    /// The host pool (capacity, backing).
    pub fn pool(&self) -> &HostPool {
        &self.core.pool
    }

    /// Slots in the pool.
    pub fn capacity(&self) -> u32 {
        self.core.pool.capacity()
    }

    /// The eviction policy's name.
    pub fn policy_name(&self) -> &'static str {
        self.core.policy.name()
    }

    /// Stops accepting saves, restores and attaches (queries still answer). In-flight copies
    /// complete normally; drain each rank with [`Rank::shutdown`].
    pub fn shutdown(&self) {
        self.core.shutting_down.store(true, Ordering::Release);
    }

    /// The shared core (for model tests and benchmarks).
    pub fn core(&self) -> &Arc<Core> {
        &self.core
    }
}

type Finish = Box<dyn FnOnce(&Result<(), CopyError>) + Send>;

struct Job {
    completion: Box<dyn crate::copy::Completion>,
    finish: Finish,
    handle: std::sync::Arc<HandleShared>,
}

/// In-flight accounting of one rank.
#[derive(Default)]
struct InFlight {
    save_gpu_pages: AtomicU64,
    restore_slots: AtomicU64,
    batches: std::sync::Mutex<u64>,
    idle: std::sync::Condvar,
}

impl InFlight {
    /// GPU pages read by saves (save) or host slots pinned by restores (restore) in flight.
    fn load(&self, dir: Direction) -> &AtomicU64 {
        match dir {
            Direction::Save => &self.save_gpu_pages,
            Direction::Restore => &self.restore_slots,
        }
    }
    fn begin(&self) {
        *self.batches.lock().expect("in-flight lock") += 1;
    }
    fn end(&self) {
        let mut b = self.batches.lock().expect("in-flight lock");
        *b -= 1;
        if *b == 0 {
            self.idle.notify_all();
        }
    }
}

/// Live load of one rank, for admission control.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct RankLoad {
    /// GPU pages read by saves in flight: they must not be reused until their save completes.
    pub save_gpu_pages: u64,
    /// Host slots pinned by this rank's restores in flight.
    pub restore_slots: u64,
    /// Batches in flight (saves and restores).
    pub batches: u64,
}

/// One rank's handle: saves and restores through its copy backend. Dropping it drains its in-flight
/// copies first (blocking); use [`Rank::shutdown`] for a deadline.
pub struct Rank {
    core: Arc<Core>,
    backend: std::sync::Arc<dyn CopyBackend>,
    id: u32,
    save_tx: std::sync::Mutex<Option<mpsc::Sender<Job>>>,
    restore_tx: std::sync::Mutex<Option<mpsc::Sender<Job>>>,
    threads: Vec<std::thread::JoinHandle<()>>,
    inflight: std::sync::Arc<InFlight>,
}

impl Rank {
    fn start(core: Arc<Core>, backend: std::sync::Arc<dyn CopyBackend>, id: u32) -> Self {
        let inflight = std::sync::Arc::new(InFlight::default());
        let mut threads = Vec::new();
        let mut spawn = |what: &str| {
            let (tx, rx) = mpsc::channel::<Job>();
            let inf = inflight.clone();
            let t = std::thread::Builder::new()
                .name(format!("kvtier-r{id}-{what}"))
                .spawn(move || {
                    // Completions of one direction finish in submission order (one stream each).
                    while let Ok(mut job) = rx.recv() {
                        let r = job.completion.wait();
                        (job.finish)(&r);
                        drop(job.completion);
                        job.handle.complete(&r);
                        inf.end();
                    }
                })
                .expect("spawning a completion thread");
            threads.push(t);
            tx
        };
        let save_tx = spawn("save");
        let restore_tx = spawn("restore");
        Rank {
            core,
            backend,
            id,
            save_tx: std::sync::Mutex::new(Some(save_tx)),
            restore_tx: std::sync::Mutex::new(Some(restore_tx)),
            threads,
            inflight,
        }
    }

    /// This rank's id (attach order, from 0).
    pub fn id(&self) -> u32 {
        self.id
    }

    /// The namespace of this rank's keys (its geometry's, which includes its tensor-parallel shard).
    pub fn namespace(&self) -> Namespace {
        self.backend.geometry().namespace()
    }

    /// The copy backend's name.
    pub fn backend_name(&self) -> &'static str {
        self.backend.name()
    }

    /// What this rank has in flight now.
    pub fn load(&self) -> RankLoad {
        RankLoad {
            save_gpu_pages: self.inflight.save_gpu_pages.load(Ordering::Relaxed),
            restore_slots: self.inflight.restore_slots.load(Ordering::Relaxed),
            batches: *self.inflight.batches.lock().expect("in-flight lock"),
        }
    }

    fn check_open(&self) -> Result<(), TierError> {
        if self.core.shutting_down.load(Ordering::Acquire) {
            Err(TierError::ShuttingDown)
        } else {
            Ok(())
        }
    }

    /// Submits `batch` to the backend in direction `dir` and queues its completion: when the copy
    /// has finished, the completion thread runs `settle(ok)` (commit or abort a save's reservation,
    /// drop a restore's guards), updates the counters and this rank's load, then completes the
    /// handle. Nothing `settle` owns is released before the copy has finished.
    ///
    /// # Safety
    /// The backend contract for `batch` ([`CopyBackend`]): `settle` must own the slots' reservation
    /// (save) or pins (restore), and the caller must own the GPU pages until the handle completes.
    unsafe fn launch(
        &self,
        dir: Direction,
        batch: &[CopyPair],
        wait: WaitFor,
        settle: Box<dyn FnOnce(bool) + Send>,
    ) -> Result<CopyHandle, TierError> {
        let n = batch.len() as u64;
        let core = &self.core;
        // SAFETY: forwarded: the caller upholds the backend contract for `batch`.
        let submitted = unsafe {
            match dir {
                Direction::Save => self.backend.save(batch, wait),
                Direction::Restore => self.backend.restore(batch, wait),
            }
        };
        let completion = submitted.inspect_err(|_| add(core.counters.failed(dir), n))?;
        let bytes = n * core.geometry.block_bytes();
        let handle = HandleShared::new(batch.len(), bytes);
        self.inflight.load(dir).fetch_add(n, Ordering::Relaxed);
        let core2 = core.clone();
        let inf = self.inflight.clone();
        let finish: Finish = Box::new(move |r| {
            let c = &core2.counters;
            settle(r.is_ok());
            match r {
                Ok(()) => {
                    add(c.done(dir), n);
                    add(c.bytes(dir), bytes);
                }
                Err(e) => {
                    tracing::warn!("{dir:?} of {n} blocks failed: {e}");
                    add(c.failed(dir), n);
                }
            }
            inf.load(dir).fetch_sub(n, Ordering::Relaxed);
        });
        let mut job = Job { completion, finish, handle: handle.clone() };
        let tx = if dir == Direction::Restore { &self.restore_tx } else { &self.save_tx };
        self.inflight.begin();
        let sent = match tx.lock().expect("rank sender lock").as_ref() {
            Some(tx) => tx.send(job).map_err(|e| e.0),
            None => Err(job),
        };
        if let Err(j) = sent {
            // The completion threads are gone (shutdown raced us): finish synchronously; the copy
            // was submitted, so wait for it before releasing anything.
            job = j;
            let r = job.completion.wait();
            (job.finish)(&r);
            job.handle.complete(&r);
            self.inflight.end();
        }
        Ok(CopyHandle::new(handle))
    }

    /// Saves with [`Fit::AllOrNothing`]; see [`Rank::save_with`].
    ///
    /// # Errors
    /// As [`Rank::save_with`].
    pub fn save(&self, keys: &[ContentKey], gpu_pages: &[u64], wait: WaitFor) -> Result<SaveTicket, TierError> {
        self.save_with(keys, gpu_pages, wait, SaveOptions::default())
    }

    /// Saves the blocks in GPU pages `gpu_pages[i]` under `keys[i]` (GPU -> host, one batch, after
    /// `wait`). Resident keys are refreshed and skipped, keys in flight skipped; the ticket says
    /// which are copied. The GPU pages must not be rewritten until the ticket's handle completes
    /// ([`Rank::load`] counts them).
    ///
    /// # Errors
    /// [`TierError::LengthMismatch`]; [`TierError::Copy`] with [`CopyError::PageOutOfRange`] for a
    /// page id outside the arenas (nothing saved); [`TierError::CannotFit`] (all-or-nothing, nothing
    /// evicted) or [`TierError::PoolExhausted`]; [`TierError::ShuttingDown`]; backend errors (the
    /// reserved slots are released, nothing becomes visible).
    pub fn save_with(
        &self,
        keys: &[ContentKey],
        gpu_pages: &[u64],
        wait: WaitFor,
        opts: SaveOptions,
    ) -> Result<SaveTicket, TierError> {
        self.save_hinted(keys, gpu_pages, wait, opts, SaveHint::default())
    }

    /// [`Rank::save_with`] with hints for the eviction policy (see [`SaveHint`]).
    ///
    /// # Errors
    /// As [`Rank::save_with`].
    pub fn save_hinted(
        &self,
        keys: &[ContentKey],
        gpu_pages: &[u64],
        wait: WaitFor,
        opts: SaveOptions,
        hint: SaveHint,
    ) -> Result<SaveTicket, TierError> {
        self.check_open()?;
        if keys.len() != gpu_pages.len() {
            return Err(TierError::LengthMismatch { keys: keys.len(), pages: gpu_pages.len() });
        }
        let pages = self.core.geometry.pages();
        if let Some(&p) = gpu_pages.iter().find(|&&p| p >= pages) {
            return Err(CopyError::PageOutOfRange { page: p, pages }.into());
        }
        let core = &self.core;
        let c = &core.counters;
        let (mut resident, mut in_flight) = (0usize, 0usize);
        let mut missing = Vec::new();
        {
            let reader = core.index.reader();
            for (i, k) in keys.iter().enumerate() {
                if let Some(r) = reader.get(k) {
                    let w = core.control().load(r.slot);
                    if w.generation() == r.generation {
                        match w.state() {
                            SlotState::Ready => {
                                core.policy.on_hit(r.slot);
                                resident += 1;
                                continue;
                            }
                            SlotState::Writing => {
                                in_flight += 1;
                                continue;
                            }
                            _ => {}
                        }
                    }
                }
                missing.push(i);
            }
        }
        add(&c.save_skipped_resident, resident as u64);
        // Admission (Fit::Prefix only): every missing key is shown to the policy in order; from its
        // first refusal on nothing is saved (a prefix hit cannot reach past the gap).
        // Depth of keys[i] in its prompt, when the caller said where keys[0] sits.
        let depth_of = |i: usize| hint.prefix_depth.map(|d| d.saturating_add(i as u32).min(u32::MAX - 1));
        let mut refused = 0;
        if opts.fit == Fit::Prefix {
            let mut cut = None;
            for (j, &i) in missing.iter().enumerate() {
                if !core.policy.admit(InsertInfo { key_hash: keys[i].hash64(), depth: depth_of(i) }) && cut.is_none() {
                    cut = Some(j);
                }
            }
            if let Some(j) = cut {
                refused = missing.len() - j;
                missing.truncate(j);
            }
        }
        let need = missing.len();
        let avail = core.available_slots();
        let take = match opts.fit {
            Fit::AllOrNothing if need > avail => {
                add(&c.save_skipped_in_flight, in_flight as u64);
                add(&c.saves_refused, 1);
                return Err(TierError::CannotFit {
                    needed: need,
                    available: avail,
                    capacity: core.pool.capacity() as usize,
                });
            }
            Fit::AllOrNothing => need,
            Fit::Prefix => need.min(avail),
        };
        let dropped = need - take + refused;
        missing.truncate(take);
        let slots = core.acquire_slots(take).inspect_err(|_| {
            add(&c.save_skipped_in_flight, in_flight as u64);
            add(&c.saves_refused, 1);
        })?;
        let mut reservation = WriteReservation::new(core);
        let mut saving = Vec::with_capacity(take);
        let mut batch = Vec::with_capacity(take);
        for (&i, slot) in missing.iter().zip(slots) {
            if core.reserve_block(keys[i], slot, depth_of(i).unwrap_or(u32::MAX), &mut reservation) {
                saving.push(i);
                batch.push(CopyPair::new(gpu_pages[i], slot.0));
            } else {
                in_flight += 1;
            }
        }
        add(&c.save_skipped_in_flight, in_flight as u64);
        add(&c.save_dropped, dropped as u64);
        if batch.is_empty() {
            return Ok(SaveTicket { saving, resident, in_flight, dropped, handle: CopyHandle::ready() });
        }
        // SAFETY: every slot in `batch` is WRITING and owned by `reservation`, which the settle closure
        // owns until the copy has finished (the reservation holds the core, so the pool outlives the
        // copy); GPU pages are the caller's, who may not rewrite them before the handle completes.
        let handle = unsafe {
            self.launch(
                Direction::Save,
                &batch,
                wait,
                Box::new(move |ok| if ok { reservation.commit() } else { drop(reservation) }),
            )
        }?;
        Ok(SaveTicket { saving, resident, in_flight, dropped, handle })
    }

    /// Restores the first `gpu_pages.len()` blocks of `lease` into GPU pages `gpu_pages[i]` (host ->
    /// GPU, one batch, after `wait`) and consumes one use of the lease. The copy holds its own pins,
    /// so the lease may settle (or be dropped) while it runs. The GPU pages hold the bytes once the
    /// returned handle completes.
    ///
    /// An empty `gpu_pages` copies nothing and returns a completed handle (it still uses up one
    /// restore of an unsettled lease, and is not an error on a settled one).
    ///
    /// # Errors
    /// [`TierError::ForeignLease`]; [`TierError::LeaseTooShort`]; [`TierError::LeaseSettled`] if the
    /// lease was already settled; [`TierError::TooManyPins`] if a slot's pin count is at
    /// [`crate::SlotWord::MAX_PINS`]; [`TierError::Copy`] for out-of-range or repeated GPU pages
    /// (nothing copied, the lease stays usable) and backend errors; [`TierError::ShuttingDown`].
    pub fn restore(&self, lease: &Lease, gpu_pages: &[u64], wait: WaitFor) -> Result<CopyHandle, TierError> {
        self.check_open()?;
        if !Arc::ptr_eq(lease.core(), &self.core) {
            return Err(TierError::ForeignLease);
        }
        let n = gpu_pages.len();
        if n > lease.len() {
            return Err(TierError::LeaseTooShort { asked: n, held: lease.len() });
        }
        if n == 0 {
            // Nothing to copy (an empty lease is settled from birth): a no-op that still uses up
            // one restore of a non-empty lease.
            lease.consume();
            return Ok(CopyHandle::ready());
        }
        // Take this restore's use first: two ranks racing for a lease's last use cannot both copy.
        if !lease.take_use() {
            return Err(TierError::LeaseSettled);
        }
        let core = &self.core;
        let guards = SlotPins::take(core, lease.blocks()[..n].iter().map(|b| b.slot)).map_err(|(i, e)| {
            lease.return_use();
            match e {
                PinError::Overflow => TierError::TooManyPins { slot: lease.blocks()[i].slot.slot.0 },
                // The lease settled (released) since the use was taken and its block was evicted or reused.
                PinError::Stale | PinError::NotReady => TierError::LeaseSettled,
            }
        })?;
        let batch: Vec<CopyPair> =
            gpu_pages.iter().zip(lease.blocks()).map(|(&p, b)| CopyPair::new(p, b.slot.slot.0)).collect();
        // SAFETY: every slot in `batch` is READY and pinned by `guards`, which the settle closure owns
        // until the copy has finished; the caller owns the GPU pages until the handle completes.
        let handle = unsafe { self.launch(Direction::Restore, &batch, wait, Box::new(move |_| drop(guards))) }
            .inspect_err(|_| lease.return_use())?;
        // Guards are held: settling the lease now cannot free a slot under the copy.
        lease.settle_if_used_up();
        Ok(handle)
    }

    /// Blocks until this rank has nothing in flight, or `timeout` passes.
    ///
    /// # Errors
    /// [`TierError::DrainTimeout`] with the batches still in flight.
    pub fn drain(&self, timeout: Duration) -> Result<(), TierError> {
        let deadline = Instant::now() + timeout;
        let mut b = self.inflight.batches.lock().expect("in-flight lock");
        while *b > 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(TierError::DrainTimeout { in_flight: *b });
            }
            b = self.inflight.idle.wait_timeout(b, deadline - now).expect("in-flight lock").0;
        }
        Ok(())
    }

    /// Teardown in the safe order: stop accepting work on this rank, drain in-flight copies, then
    /// release the backend. If copies are still in flight at `timeout`, the rank's backend, its
    /// arenas and the tier's pool are deliberately leaked (never freed under a live copy) and
    /// [`TierError::DrainTimeout`] is returned.
    ///
    /// # Errors
    /// [`TierError::DrainTimeout`].
    pub fn shutdown(mut self, timeout: Duration) -> Result<(), TierError> {
        self.close();
        match self.drain(timeout) {
            Ok(()) => {
                self.join();
                Ok(())
            }
            Err(e) => {
                tracing::error!("rank {} teardown: {e}; leaking its backend and the pool", self.id);
                std::mem::forget(self.core.clone());
                std::mem::forget(self.backend.clone());
                self.threads.clear(); // detach
                std::mem::forget(self);
                Err(e)
            }
        }
    }

    fn close(&self) {
        self.save_tx.lock().expect("rank sender lock").take();
        self.restore_tx.lock().expect("rank sender lock").take();
    }

    fn join(&mut self) {
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        self.close();
        self.join();
    }
}

impl std::fmt::Debug for Rank {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rank").field("id", &self.id).field("backend", &self.backend.name()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::copy::host::HostArenas;
    use crate::copy::EngineArenas;
    use crate::geometry::ArenaSpec;
    use crate::pool::BackingChoice;
    use crate::slot::SlotWord;

    #[test]
    fn a_restore_at_the_pin_limit_reports_too_many_pins_and_keeps_the_lease() {
        let g = Geometry::new("pin-test", 16, vec![ArenaSpec::packed("a", 256, 4)]).unwrap();
        let mut cfg = TierConfig::new(g.clone(), 2 * g.slot_bytes());
        cfg.pool.backing = BackingChoice::Plain;
        let tier = HostTier::new(cfg).unwrap();
        let arenas = Arc::new(HostArenas::new(&g).unwrap());
        let rank = tier.attach(arenas.backend().unwrap()).unwrap();
        let k = [tier.namespace().trace_page_key(7, 0)];
        arenas.fill(&[0], &k).unwrap();
        rank.save(&k, &[0], WaitFor::Nothing).unwrap().handle.wait().unwrap();
        let lease = tier.query(&k);
        let r = lease.blocks()[0].slot;
        // The lease holds one pin; take the rest up to the limit.
        for _ in 1..SlotWord::MAX_PINS {
            tier.core().pin(r.slot, r.generation).unwrap();
        }
        let e = rank.restore(&lease, &[1], WaitFor::Nothing).unwrap_err();
        assert!(matches!(e, TierError::TooManyPins { slot } if slot == r.slot.0), "{e:?}");
        assert_eq!(lease.uses_left(), 1, "a refused restore leaves the lease usable");
        for _ in 1..SlotWord::MAX_PINS {
            tier.core().unpin(r.slot);
        }
        rank.restore(&lease, &[1], WaitFor::Nothing).unwrap().wait().unwrap();
        arenas.verify(&[1], &k).unwrap();
        assert_eq!(tier.stats().pinned_slots, 0);
    }
}
