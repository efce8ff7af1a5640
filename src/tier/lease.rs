//! Leases: the pins a query takes on the blocks it found, settled exactly once.
//!
//! [`crate::HostTier::query`] returns a [`Lease`] over the longest run of leading keys whose blocks
//! are ready, each pinned so eviction cannot take it. A lease **settles exactly once**, and settling
//! drops its pins:
//!
//! - **consumed**: every restore from the lease takes one use; the lease settles when the last
//!   use is taken by a restore that was submitted *and no other restore's use is still pending*
//!   (taken, not yet submitted: such a use comes back if its submission fails, and the rank's retry
//!   is then served, as documented for backend errors). A lease has one use by default;
//!   [`crate::HostTier::query_shared`] makes a lease with one use per rank, so several data-parallel
//!   ranks can each restore the same blocks (one rank consuming the lease never makes another fail);
//! - **released**: [`Lease::release`] settles at once, whatever uses are left;
//! - **dropped**: when the last clone of the lease is dropped unsettled, it settles (RAII), so a
//!   forgotten lease never pins host memory past its owner;
//! - **expired**: with [`crate::TierConfig::lease_ttl`] set, the tier settles a lease that outlived
//!   it (a restore from it then fails with [`TierError::LeaseExpired`]).
//!
//! Whichever of these happens first settles; the others find it settled (one CAS decides).
//!
//! A lease holds **at most one pin per slot**: the query stops at the first key repeated in its
//! keys (a content key is a lineage hash, so a repeat cannot continue the prefix), and leases
//! together hold at most `SlotWord::LEASE_PINS` pins of a slot (the query stops
//! at a slot that has them), so restores from leases already held always find pins left.
//!
//! A restore ([`crate::Rank::restore`]) first takes its **own pins** on the blocks it copies, then
//! one use of the lease (`Lease::begin_restore`): while a use is left the lease is unsettled,
//! so its pins still hold the blocks and the restore's pins cannot fail; a restore that finds no use
//! left drops its pins and fails with [`TierError::LeaseSettled`]. Its pins then keep the slots for
//! the whole copy, whatever happens to the lease.

use crate::error::TierError;
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::slab::slot::{PinError, SlotId};
use crate::source::BlockSource;
use crate::sync::{Arc, AtomicU8, Ordering};
use crate::tier::core::Core;
pub(crate) use crate::tier::expiry::LeasedBlock;
use crate::tier::expiry::{uses_word, LeaseState, Settled, TAKEN};
use crate::tier::pins::SlotPins;
use crate::tier::stats::add;
use std::fmt;

/// A lease as its tier's flavour holds it ([`super::Flavor`]).
pub(crate) enum LeaseOf {
    /// A lease of an in-process tier: this process holds the pins.
    InProcess(InProcessLease),
    /// A lease of a connected tier: the daemon holds the pins; this process has the blocks as the
    /// daemon leased them and the daemon's lease (dropping it tells the daemon).
    #[cfg(all(feature = "remote", not(loom)))]
    Connected {
        blocks: Vec<LeasedBlock>,
        remote: crate::remote::client::RemoteLease,
        /// Per leased block, where the daemon's query found it (empty when every block was
        /// resident on the daemon's host pool).
        sources: Vec<BlockSource>,
    },
}

/// A lease of an in-process tier: its core and its settle state (which the core's lease clock may
/// hold too). Dropped unsettled, it settles.
pub(crate) struct InProcessLease {
    pub(super) core: Arc<Core>,
    state: Arc<LeaseState>,
    /// Per leased block, where it came from (empty when every block was resident on the host).
    sources: Vec<BlockSource>,
}

impl Drop for InProcessLease {
    fn drop(&mut self) {
        self.settle(Settled::Dropped);
    }
}

impl InProcessLease {
    fn settle(&self, how: Settled) -> bool {
        self.state.settle(self.core.control(), &self.core.counters, how)
    }
}

/// Finds a key repeated in a query: a linear scan of the blocks leased so far while they are few, a
/// hash set (one allocation per query) beyond.
struct RepeatCheck {
    set: Option<std::collections::HashSet<ContentKey>>,
    /// The most entries the set can need: the query's keys, at most the pool's slots.
    room: usize,
}

impl RepeatCheck {
    const LINEAR: usize = 32;

    /// True if `key` is among `blocks`, the blocks leased so far (each key of which went through
    /// this call, so the set, once built, holds them all).
    fn repeated(&mut self, key: &ContentKey, blocks: &[LeasedBlock]) -> bool {
        if self.set.is_none() && blocks.len() < Self::LINEAR {
            return blocks.iter().any(|b| b.key == *key);
        }
        let set = self.set.get_or_insert_with(|| {
            // Sized once for the rest of the query (at most one entry per slot of the pool).
            let mut set = std::collections::HashSet::with_capacity(self.room);
            set.extend(blocks.iter().map(|b| b.key));
            set
        });
        !set.insert(*key)
    }
}

/// The blocks [`Lease::acquire_with`] has pinned so far, each with one lease pin: unpinned on
/// drop (an unwind out of a lower source or a promotion) unless taken into the lease.
struct PinnedSoFar<'a> {
    core: &'a Core,
    blocks: Vec<LeasedBlock>,
}

impl PinnedSoFar<'_> {
    /// The blocks, now the lease's to unpin.
    fn into_lease(mut self) -> Vec<LeasedBlock> {
        std::mem::take(&mut self.blocks)
    }
}

impl Drop for PinnedSoFar<'_> {
    fn drop(&mut self) {
        // Seeded bug (tests only): `acquire-unwind-keeps-pins` leaves the pins of an unwound
        // acquisition in place.
        if crate::seeded::seeded("acquire-unwind-keeps-pins") {
            return;
        }
        for b in &self.blocks {
            self.core.unpin(b.slot.slot);
        }
    }
}

/// A set of pinned ready blocks, in key order (see the module docs). Cloning shares the lease.
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
/// let keys: Vec<_> = (0..3).map(|i| tier.namespace().trace_page_key(7, i)).collect();
/// rank.save(&keys[..2], &[0, 1], WaitFor::Nothing)?.handle.wait()?;
/// let lease = tier.query(&keys); // pins the resident prefix: 2 of the 3 blocks
/// assert_eq!((lease.len(), lease.uses_left(), lease.is_settled()), (2, 1, false));
/// assert!(lease.release()); // settles it now: the pins go
/// let lease = tier.query_shared(&keys, 2); // one restore for each of two ranks
/// assert_eq!(lease.uses_left(), 2);
/// # drop(lease);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
#[must_use = "a lease dropped at once settles and lets its blocks go: restore from it, or share it"]
pub struct Lease {
    inner: Arc<LeaseOf>,
}

/// The `lower` tier of [`Lease::acquire_with`] (a peer fetch): given the keys after the blocks
/// leased so far and those blocks, it appends blocks already pinned once for the lease and returns
/// how many, or its error.
pub(crate) type LowerTier<'a, E> = dyn FnMut(&[ContentKey], &mut Vec<LeasedBlock>) -> Result<usize, E> + 'a;

impl Lease {
    /// Pins the longest ready prefix of `keys` and returns a lease with `uses` restores allowed
    /// (what [`crate::HostTier::query`] and [`crate::HostTier::query_shared`] do). `uses == 0`, or
    /// no leading key ready, gives a lease that is settled from birth.
    pub(crate) fn acquire(core: &Arc<Core>, keys: &[ContentKey], uses: u32) -> Lease {
        match Self::acquire_with::<std::convert::Infallible>(core, keys, uses, None, true) {
            (lease, None) => lease,
            (_, Some(never)) => match never {},
        }
    }

    /// [`Lease::acquire`], then, where the host and SSD run ended at a key this instance lacks,
    /// `lower` (a peer fetch) may continue it: given the keys after the blocks leased so far and
    /// those blocks, it appends blocks already pinned once for this lease and returns how many.
    /// After a run it brought, the host and SSD run go on, then `lower` again, until a step adds
    /// nothing. An error of `lower` ends the lease at the blocks leased before it and is returned
    /// beside it (the caller drops the lease to let them go). `record` counts the acquisition as
    /// a query in the tier's counters (a continuation of a query already counted does not).
    pub(crate) fn acquire_with<E>(
        core: &Arc<Core>,
        keys: &[ContentKey],
        uses: u32,
        lower: Option<&mut LowerTier<'_, E>>,
        record: bool,
    ) -> (Lease, Option<E>) {
        // Every block pinned so far is unpinned if `lower` (a peer's transport) or a promotion
        // panics before the lease owns them.
        let mut pinned = PinnedSoFar { core, blocks: Vec::new() };
        let blocks = &mut pinned.blocks;
        // Where each leased block came from (empty while all are host blocks).
        let mut sources: Vec<BlockSource> = Vec::new();
        let mut lower = lower;
        let mut failed = None;
        let mut lowered = false;
        loop {
            let before = blocks.len();
            let mut missing;
            loop {
                missing = Self::lease_host_run(core, keys, blocks);
                // Where the host run ended at a key the host does not hold, the SSD tier may
                // continue it (not at a repeated key, a block being written or evicted, or a full
                // pin count); after the blocks it promotes, the host may hold the next ones again.
                // Outside the index reader: a promotion reads the drive.
                let Some(ssd) = core.ssd().filter(|_| missing && uses > 0) else { break };
                let host_end = blocks.len();
                let n = ssd.promote(core, &keys[host_end..], blocks);
                if n == 0 {
                    break;
                }
                sources.resize(host_end, BlockSource::Host);
                sources.resize(host_end + n, BlockSource::Ssd);
            }
            // Then the lower source (a peer) for the keys after that; after the blocks it brings,
            // the host (or the SSD tier) may hold the next ones again: a fetched run ends at a
            // key this instance already holds, and the lease goes on from there.
            // After a run `lower` brought, it is asked again only if the host or SSD run after it
            // added blocks (a run it ended itself would end at the same key again).
            let again = !lowered || blocks.len() > before;
            let Some(lower) = lower.as_mut().filter(|_| again && missing && uses > 0 && blocks.len() < keys.len())
            else {
                break;
            };
            lowered = true;
            let end = blocks.len();
            match lower(&keys[end..], blocks) {
                Ok(n) if n > 0 => {
                    sources.resize(end, BlockSource::Host);
                    sources.resize(end + n, BlockSource::Peer);
                }
                Ok(_) => break,
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
            // Seeded bug (tests only): `peer-run-not-continued` ends the lease after one fetched
            // run, even where this instance holds the blocks after it.
            if crate::seeded::seeded("peer-run-not-continued") {
                break;
            }
        }
        let blocks = pinned.into_lease();
        let all_host = sources.is_empty();
        sources.resize(if all_host { 0 } else { blocks.len() }, BlockSource::Host);
        if record {
            core.counters.record_query(keys.len(), blocks.len());
        }
        let empty = blocks.is_empty();
        let state = Arc::new(LeaseState { blocks, uses: uses_word(uses), settled: AtomicU8::new(0) });
        add(&core.counters.live_leases, 1);
        let lease = Lease {
            inner: Arc::new(LeaseOf::InProcess(InProcessLease { core: core.clone(), state: state.clone(), sources })),
        };
        if empty || uses == 0 {
            state.settle(core.control(), &core.counters, Settled::Consumed);
        } else {
            core.leases.register(&state);
        }
        (lease, failed)
    }

    /// Gives this lease's blocks the sources `earlier` (an earlier lease of the same query, on a
    /// prefix of the same keys) recorded for them where this one says `Host`: a block the
    /// earlier step promoted or fetched was resident by the time this lease was taken. Only for
    /// a lease no clone of exists yet (a no-op otherwise, and for connected leases).
    #[cfg(all(feature = "peers", not(loom)))]
    pub(crate) fn inherit_sources(&mut self, earlier: &Lease) {
        let n = self.len().min(earlier.len());
        if (0..n).all(|i| earlier.source(i) == Some(BlockSource::Host)) {
            return;
        }
        let Some(LeaseOf::InProcess(l)) = Arc::get_mut(&mut self.inner) else { return };
        let len = l.state.blocks.len();
        if l.sources.is_empty() {
            l.sources.resize(len, BlockSource::Host);
        }
        for i in 0..n {
            if l.sources[i] == BlockSource::Host && earlier.blocks()[i].key == l.state.blocks[i].key {
                l.sources[i] = earlier.source(i).unwrap_or(BlockSource::Host);
            }
        }
    }

    /// Pins the run of `keys` after `blocks` (the blocks leased so far) whose blocks the host holds
    /// ready, appending them. Returns true if the run ended at a key the host does not hold.
    ///
    /// The keys go in windows of [`Lease::LOOKUP_WINDOW`]: each window's index buckets, then the
    /// entries they hold, are prefetched before its lookups, and every block found has its slot
    /// word and policy state prefetched before the pins, so the window's cache misses overlap (a
    /// pool of a million slots misses the caches at each of those steps). A lookup only reads: a
    /// block found, then evicted before its pin, fails the pin and ends the run, as it would
    /// between a lookup and a pin made one after the other.
    fn lease_host_run(core: &Arc<Core>, keys: &[ContentKey], blocks: &mut Vec<LeasedBlock>) -> bool {
        let reader = core.index().reader();
        let mut seen = RepeatCheck { set: None, room: keys.len().min(core.pool().capacity() as usize) };
        let mut found: Vec<SlotRef> = Vec::with_capacity(Self::LOOKUP_WINDOW.min(keys.len()));
        for window in keys[blocks.len()..].chunks(Self::LOOKUP_WINDOW) {
            for k in window {
                reader.prefetch(k);
            }
            for k in window {
                reader.prefetch_entry(k);
            }
            found.clear();
            for k in window {
                let Some(r) = reader.get(k) else { break };
                core.control().prefetch(r.slot);
                core.policy().prefetch(r.slot, k.hash64());
                found.push(r);
            }
            for (k, &r) in window.iter().zip(&found) {
                // A content key is a lineage hash: a key repeated in one prompt is no longer its
                // prefix. The lease stops at the first repeated key, so it holds at most one pin
                // per slot (one query can never take a slot's pins from others).
                if !crate::seeded::seeded("lease-pins-repeated-key") && seen.repeated(k, blocks) {
                    return false;
                }
                if core.pin_for_lease(r.slot, r.generation).is_err() {
                    return false;
                }
                core.policy().on_hit(r.slot);
                if let Some(ssd) = core.ssd() {
                    ssd.on_hit(r.slot, r.generation, *k);
                }
                blocks.push(LeasedBlock { key: *k, slot: r });
            }
            if found.len() < window.len() {
                return true;
            }
        }
        false
    }

    /// Keys looked up together by [`Lease::lease_host_run`]: enough to overlap many cache misses,
    /// few enough that the processor can track every prefetch of a window at once and that a
    /// run ending early does not load much it will not read.
    const LOOKUP_WINDOW: usize = 16;

    /// A lease of a connected tier: `blocks` as the daemon leased them, `remote` its handle there,
    /// `sources` where the daemon found each block (empty: all on its host pool; else one per
    /// block, checked by the connection).
    #[cfg(all(feature = "remote", not(loom)))]
    pub(crate) fn connected(
        blocks: Vec<LeasedBlock>,
        remote: crate::remote::client::RemoteLease,
        sources: Vec<BlockSource>,
    ) -> Lease {
        Lease { inner: Arc::new(LeaseOf::Connected { blocks, remote, sources }) }
    }

    /// Per leased block, where it came from; empty when every block was resident on the host
    /// (the form the daemon's protocol carries).
    pub(crate) fn sources(&self) -> &[BlockSource] {
        match_flavor!(self.of(), LeaseOf::InProcess(l) => &l.sources, LeaseOf::Connected { sources, .. } => sources)
    }

    /// The lease as its tier's flavour holds it.
    pub(crate) fn of(&self) -> &LeaseOf {
        &self.inner
    }

    /// The in-process lease, or `None` for a lease of a connected tier (whose daemon restores it).
    fn in_process(&self) -> Option<&InProcessLease> {
        match_flavor!(self.of(), LeaseOf::InProcess(l) => Some(l), LeaseOf::Connected { .. } => None)
    }

    /// Number of leased blocks: the length of the resident prefix the query found.
    pub fn len(&self) -> usize {
        self.blocks().len()
    }

    /// True if the query found no leading resident block.
    pub fn is_empty(&self) -> bool {
        self.blocks().is_empty()
    }

    /// Leased blocks the query read from the SSD tier (promoted into host slots); the others were
    /// resident on the host or fetched from a peer. [`Lease::is_promoted`] says which. 0 without
    /// an SSD tier. For a lease of a connected tier, the blocks the daemon's query promoted.
    pub fn promoted(&self) -> usize {
        self.count_from(BlockSource::Ssd)
    }

    /// Leased blocks fetched from a peer's pool (feature `peers`). For a lease of a connected
    /// tier, the blocks the daemon fetched from its peers for this query (`kvtierd --peer`).
    pub fn from_peer(&self) -> usize {
        self.count_from(BlockSource::Peer)
    }

    fn count_from(&self, source: BlockSource) -> usize {
        self.sources().iter().filter(|&&s| s == source).count()
    }

    /// True if leased block `i` (an index into [`Lease::blocks`]) was read from the SSD tier by
    /// this lease's query; false if it was resident on the host, came from a peer, or `i` is out
    /// of range.
    pub fn is_promoted(&self, i: usize) -> bool {
        self.source(i) == Some(BlockSource::Ssd)
    }

    /// Where leased block `i` (an index into [`Lease::blocks`]) came from; `None` if `i` is out of
    /// range. For a connected tier, where the daemon's query found it: its host pool, its SSD
    /// tier, or one of its peers.
    pub fn source(&self, i: usize) -> Option<BlockSource> {
        if i >= self.len() {
            return None;
        }
        Some(self.sources().get(i).copied().unwrap_or(BlockSource::Host))
    }

    /// The leased blocks, in key order.
    pub fn blocks(&self) -> &[LeasedBlock] {
        match_flavor!(self.of(), LeaseOf::InProcess(l) => &l.state.blocks, LeaseOf::Connected { blocks, .. } => blocks)
    }

    /// The host slots of the leased blocks, in key order.
    pub fn slots(&self) -> impl Iterator<Item = SlotId> + '_ {
        self.blocks().iter().map(|b| b.slot.slot)
    }

    /// True once the lease has settled (consumed, released, dropped or expired); its pins are gone.
    /// (A connected tier asks its daemon; a lost connection counts as settled.)
    pub fn is_settled(&self) -> bool {
        match_flavor!(self.of(),
            LeaseOf::InProcess(l) => l.state.is_settled(),
            LeaseOf::Connected { remote, .. } => remote.info().settled,
        )
    }

    /// True if the tier settled the lease because it outlived [`crate::TierConfig::lease_ttl`].
    pub fn is_expired(&self) -> bool {
        match_flavor!(self.of(),
            LeaseOf::InProcess(l) => l.state.how() == Settled::Expired,
            LeaseOf::Connected { remote, .. } => remote.info().expired,
        )
    }

    /// Restores this lease still allows (0 once settled).
    pub fn uses_left(&self) -> u32 {
        match_flavor!(self.of(),
            LeaseOf::InProcess(l) => if l.state.is_settled() { 0 } else { l.state.uses.load(Ordering::Acquire) as u32 },
            LeaseOf::Connected { remote, .. } => remote.info().uses_left,
        )
    }

    /// Settles the lease now, dropping its pins. Restores already submitted keep their own pins
    /// and complete normally. Returns true if this call settled it (false if it already was).
    pub fn release(self) -> bool {
        match_flavor!(self.of(),
            LeaseOf::InProcess(l) => l.settle(Settled::Released),
            LeaseOf::Connected { remote, .. } => remote.release(),
        )
    }

    /// The lease side of a restore of the first `n` blocks: takes the restore's own pins on them,
    /// then one use of the lease. The returned hold keeps both; [`RestoreHold::submitted`] keeps
    /// the use (settling the lease if it was the last), dropping the hold unsubmitted gives the
    /// use back. [`crate::Rank::restore`] calls exactly this.
    ///
    /// # Errors
    /// [`TierError::LeaseTooShort`] if `n > len()`; [`TierError::ForeignLease`] for a lease of a
    /// connected tier (its daemon takes a restore's pins); [`TierError::LeaseSettled`] /
    /// [`TierError::LeaseExpired`] if no use is left; [`TierError::TooManyPins`] if a slot's pin
    /// count is full (the lease stays usable).
    pub(crate) fn begin_restore(&self, n: usize) -> Result<RestoreHold, TierError> {
        if n > self.len() {
            return Err(TierError::LeaseTooShort { asked: n, held: self.len() });
        }
        let l = self.in_process().ok_or(TierError::ForeignLease)?;
        let blocks = &self.blocks()[..n];
        // Seeded bug (model checking only): the old order, a use taken before the pins, lets a
        // rank that holds a use fail to pin because another rank settled and the block was evicted.
        let use_first = crate::seeded::seeded("restore-use-before-pin");
        if use_first && !l.take_use() {
            return Err(l.settled_error());
        }
        let pins = SlotPins::take(&l.core, blocks.iter().map(|b| b.slot)).map_err(|(i, e)| match e {
            PinError::Overflow => TierError::TooManyPins { slot: blocks[i].slot.slot.0 },
            // Only a settled lease lets its blocks go: the use check below would fail too.
            PinError::Stale | PinError::NotReady => l.settled_error(),
        })?;
        if !use_first && !l.take_use() {
            drop(pins);
            return Err(l.settled_error());
        }
        Ok(RestoreHold { lease: self.clone(), pins: Some(pins), submitted: false })
    }

    /// Uses up one restore of the lease without copying anything (a zero-page restore; a lease of
    /// a connected tier is its daemon's to use up).
    pub(crate) fn consume_without_copy(&self) {
        if let Some(l) = self.in_process() {
            if l.take_use() {
                l.keep_use();
            }
        }
    }
}

impl InProcessLease {
    fn settled_error(&self) -> TierError {
        if self.state.how() == Settled::Expired {
            TierError::LeaseExpired
        } else {
            TierError::LeaseSettled
        }
    }

    /// Takes one use without settling (`left - 1`, `taken + 1`): false if none is left or the
    /// lease is settled. The use is then either kept ([`InProcessLease::keep_use`]) or given back
    /// ([`InProcessLease::give_back_use`]).
    fn take_use(&self) -> bool {
        let uses = &self.state.uses;
        let mut cur = uses.load(Ordering::Acquire);
        loop {
            if cur as u32 == 0 || self.state.is_settled() {
                return false;
            }
            match uses.compare_exchange_weak(cur, cur - 1 + TAKEN, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(a) => {
                    cur = a;
                    crate::sync::spin_loop();
                }
            }
        }
    }

    /// A taken use is kept (its copy was submitted): `taken - 1`; the lease is consumed if that
    /// was the last use and no other taken use may still come back.
    fn keep_use(&self) {
        let after = self.state.uses.fetch_sub(TAKEN, Ordering::AcqRel) - TAKEN;
        // Seeded bug (tests and model checking only): the old rule, consumed as soon as no use is
        // left to take, although a taken use may still come back. `restore-use-before-pin`
        // plants the old code whole (that order and this rule): with the rule above alone, a use
        // taken before the pins is no longer a fault, since the taken use keeps the lease (and
        // its pins) until the hold is submitted or given back.
        let after = if crate::seeded::seeded("use-returned-to-settled-lease")
            || crate::seeded::seeded("restore-use-before-pin")
        {
            after as u32 as u64
        } else {
            after
        };
        // Seeded bug (model checking only): the first rank's restore settles a shared lease.
        let last = after == 0 || crate::seeded::seeded("lease-first-consume-settles");
        if last {
            self.settle(Settled::Consumed);
        }
    }

    /// A taken use comes back (its restore was not submitted): `left + 1`, `taken - 1`. The
    /// lease cannot have been consumed meanwhile (a taken use holds that off).
    fn give_back_use(&self) {
        self.state.uses.fetch_sub(TAKEN - 1, Ordering::AcqRel);
    }
}

/// A restore's hold on a lease: its own pins on the blocks it copies and one use of the lease
/// (see [`Lease::begin_restore`]). It holds a handle on the lease, so the tier daemon can keep a
/// hold between a remote rank's messages.
pub(crate) struct RestoreHold {
    lease: Lease,
    pins: Option<SlotPins>,
    submitted: bool,
}

impl RestoreHold {
    /// The in-process lease held ([`Lease::begin_restore`] gives holds on no other).
    fn held(&self) -> &InProcessLease {
        self.lease.in_process().expect("a restore hold is taken on an in-process lease")
    }

    /// The pinned slots, in key order.
    pub(crate) fn slots(&self) -> &[SlotId] {
        self.pins.as_ref().map_or(&[], |p| p.slots())
    }

    /// Hands the pins to the copy (they must be held until it has finished).
    pub(crate) fn take_pins(&mut self) -> SlotPins {
        self.pins.take().expect("restore pins taken once")
    }

    /// The copy was submitted: the use stays taken, and the lease settles if it was the last.
    pub(crate) fn submitted(mut self) {
        self.submitted = true;
        self.held().keep_use();
    }
}

impl Drop for RestoreHold {
    fn drop(&mut self) {
        if !self.submitted {
            // Not submitted: pins first, then the use goes back.
            drop(self.pins.take());
            self.held().give_back_use();
        }
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Lease");
        d.field("blocks", &self.len()).field("uses_left", &self.uses_left());
        match_flavor!(self.of(),
            LeaseOf::InProcess(l) => d.field("settled", &l.state.how()),
            LeaseOf::Connected { .. } => d.field("settled", &self.is_settled()),
        );
        d.finish()
    }
}
