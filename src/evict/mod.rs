//! Eviction policies: which unpinned ready blocks to free when the pool is full.
//!
//! The tier owns the mechanism (`READY(pins 0) -> EVICTING` by CAS, index removal, generation bump;
//! see `docs/design.md`); a policy only *proposes* victims and, for [`crate::Fit::Prefix`] saves,
//! may refuse to admit a block.
//!
//! # The contract between the tier and a policy
//!
//! A policy sees each slot go through three states of its own (kept by [`Residency`], shared by every
//! built-in policy, which checks each transition and panics on a broken one):
//!
//! ```text
//!            on_insert                 select_victims
//!   ABSENT ------------> RESIDENT --------------------> PROPOSED
//!     ^                     ^                               |
//!     |                     +---------- on_cancel ----------+
//!     +------------------------------- on_remove -----------+
//! ```
//!
//! - [`EvictionPolicy::on_insert`]: a block became ready in an `ABSENT` slot (its save committed). It
//!   is called *before* the block becomes evictable, so a selection never sees the slot with the
//!   previous occupant's state.
//! - [`EvictionPolicy::on_hit`]: a query pinned the block, or a save found it resident. A *hint*:
//!   it may arrive for any slot at any time (a save's refresh is not pinned and may race an
//!   eviction), so it must never corrupt the policy's structures.
//! - [`EvictionPolicy::select_victims`]: called with the tier's eviction lock held (one selector at
//!   a time; for a policy whose [`EvictionPolicy::concurrent_selection`] is true, its shared side:
//!   selections may then run at once, and only one that runs alone must reach every slot). Appends up to `n` *distinct* `RESIDENT` slots for which `evictable` is true, best victim
//!   first; each becomes `PROPOSED`. A `PROPOSED` slot is never proposed again until it is cancelled.
//! - For **every** proposed slot the tier later calls exactly one of
//!   [`EvictionPolicy::on_cancel`] (the block stays resident: the claim CAS found it pinned, or the
//!   save it was for could not get all its slots; the slot is `RESIDENT` again, in its place or
//!   re-queued) or [`EvictionPolicy::on_remove`] (the block was evicted; the slot is `ABSENT`).
//!   `on_cancel` comes under the eviction lock (its shared side for a concurrent selector); `on_remove` comes from the finish of a claim,
//!   *without* it, so it may run while another thread selects: a policy synchronises what it
//!   touches there itself (atomics, or its own lock).
//!   Several selections may run before the proposals of the first are settled (a save that needs
//!   more victims after some claims failed).
//! - [`EvictionPolicy::select_ranked`]: the selection the tier actually calls, with its preference
//!   order ([`Ranking`]): classes that must go first (orphaned chain blocks) or last (blocks of
//!   hinted keys), and the chains of resident blocks. The provided method turns it into
//!   `select_victims` calls, one per class; the contract and liveness below hold for it as they do
//!   for `select_victims`.
//! - [`EvictionPolicy::file_pending`]: after a save's commit, without the eviction lock, on the
//!   committing thread: a policy may file what it learnt lazily (LRU and the prefix-LFU family
//!   file their victim order's marks, if its mutex is free); it never blocks.
//! - [`EvictionPolicy::admit`]: lock-free admission check on the save path.
//!
//! **Liveness** (invariant I8 in `docs/invariants.md`): whatever interleaving of insert, hit,
//! select, cancel and remove came before, and whatever the queues hold (pinned blocks at the head
//! included), a call `select_victims(n, evictable)` that runs alone proposes `min(n, k)` slots,
//! where `k` is the number of `RESIDENT` slots that `evictable` accepts (one that runs beside
//! others, [`Ranking::beside_others`], may propose fewer; the tier then selects again alone). No resident, ready, unpinned block is ever
//! out of reach. Every built-in policy is checked for it (unit tests below, the loom model
//! `loom_policy`, the tier state machine).
//!
//! Per-slot policy state lives in atomics so `on_hit` (the query path) never waits.

mod clock;
mod heap;
mod lru;
mod minisim;
mod order;
mod prefix_lfu;
mod probation;
mod queue;
mod residency;
mod s3fifo;
mod sieve;
mod two_q;

pub(crate) use clock::Clock;
pub(crate) use lru::Lru;
pub use order::MarkStack;
pub(crate) use prefix_lfu::PrefixLfu;
pub(crate) use residency::Residency;
pub(crate) use s3fifo::S3Fifo;
pub(crate) use sieve::Sieve;
pub(crate) use two_q::TwoQ;

use crate::slab::slot::SlotId;
use std::fmt;
use std::str::FromStr;

/// A victim-selection policy. See the module docs for the contract every implementation keeps.
pub trait EvictionPolicy: Send + Sync + fmt::Debug {
    /// Short name for reports (`lru`, `clock`).
    fn name(&self) -> &'static str;
    /// A block became ready in `slot` (`ABSENT -> RESIDENT`); `info` carries its key hash and, when
    /// the saver knew it, its depth in the prompt.
    fn on_insert(&self, slot: SlotId, info: InsertInfo);
    /// A hint that a call about the block of key hash `key_hash` in `slot` comes soon: its
    /// [`EvictionPolicy::on_insert`], [`EvictionPolicy::on_hit`] or [`EvictionPolicy::on_remove`]
    /// (the tier gives it for every block of a batch before the batch's loop: a save's commits, a
    /// query's hits, the finish of a save's claimed victims). A policy whose per-key or per-slot
    /// state lives in tables too large for the processor's caches may start loading what those
    /// calls touch (a prefetch, `sync::prefetch_read`), so the batch's cache misses overlap
    /// instead of following one another. Changes no state; the default does nothing.
    fn prefetch(&self, slot: SlotId, key_hash: u64) {
        let _ = (slot, key_hash);
    }
    /// The block in `slot` was hit by a query or found resident by a save (a recency hint; may
    /// arrive for any slot at any time).
    fn on_hit(&self, slot: SlotId);
    /// Appends up to `n` distinct victim candidates to `out`, best first, choosing only `RESIDENT`
    /// slots for which `evictable` returns true; each becomes `PROPOSED`.
    fn select_victims(&self, n: usize, evictable: &dyn Fn(SlotId) -> bool, out: &mut Vec<SlotId>);
    /// [`EvictionPolicy::select_victims`] under the tier's preference order ([`Ranking`]): every
    /// proposed slot of class `c` comes before any of class `c + 1`, in the policy's own order
    /// within a class (chain-aware, see [`Ranking::chain`]). Liveness is the same as
    /// `select_victims`': `min(n, k)` proposals, `k` being the `RESIDENT` slots with a class.
    ///
    /// The provided method asks `select_victims` once per class, lowest first, until `n` are
    /// proposed, skipping the classes [`Ranking::empty`] names (it does not use
    /// [`Ranking::chain`]); the scan-based policies override it with one
    /// pass ranked by `(class, chain score)`.
    fn select_ranked(&self, n: usize, ranking: &Ranking<'_>, out: &mut Vec<SlotId>) {
        let (classes, class_of) = (ranking.classes, ranking.class_of);
        let start = out.len();
        if classes <= 1 {
            self.select_victims(n, &|s| class_of(s).is_some(), out);
            return;
        }
        // `lo`: the lowest class no pass has offered yet.
        let mut lo = 0;
        for c in 0..classes {
            let got = out.len() - start;
            if got >= n {
                break;
            }
            // The last pass takes every class left, so a class number out of range is still offered.
            let last = c + 1 == classes;
            // A class the tier says is empty costs no pass (a walk of the whole queue otherwise);
            // should it hold a slot after all, the next pass offers it with its own class.
            if !last && ranking.empty.is_some_and(|e| e(c)) {
                continue;
            }
            self.select_victims(
                n - got,
                &|s| class_of(s).is_some_and(|k| (lo..=c).contains(&k) || (last && k > c)),
                out,
            );
            lo = c + 1;
        }
    }
    /// True if [`EvictionPolicy::select_ranked`] may run on several threads at once (the tier then
    /// selects under the shared side of its eviction lock). Such a policy keeps the contract for
    /// concurrent selections (no slot proposed twice; `on_cancel` may come beside another
    /// selection), and its liveness for a selection that runs alone; one that runs beside others
    /// may propose fewer than `min(n, k)`, and the tier then selects again under the exclusive
    /// lock, alone, before it refuses a save. The built-in LRU and prefix-LFU family (one victim
    /// order in shards) say true; the default is false: one selector at a time.
    fn concurrent_selection(&self) -> bool {
        false
    }
    /// A proposed slot was not evicted (`PROPOSED -> RESIDENT`): it must be offered again by later
    /// selections.
    fn on_cancel(&self, slot: SlotId);
    /// A proposed slot was evicted (`PROPOSED -> ABSENT`).
    fn on_remove(&self, slot: SlotId);
    /// The tier lowered the preference class of resident `slot` ([`Ranking::class_of`]): a hint on
    /// its key was withdrawn or expired, or its disk copy was written. A policy that keeps its
    /// candidates by class re-places the slot; may arrive for any slot at any time, like
    /// [`EvictionPolicy::on_hit`]. Must be lock-free. The default ignores it.
    fn on_reclass(&self, slot: SlotId) {
        let _ = slot;
    }
    /// A block that continued `parent`'s block left the tier (evicted, aborted or quarantined),
    /// after its `resident_children` count ([`ChainView::resident_children`]) fell: `parent` may
    /// be a leaf of its chain now. A policy that orders by chain place re-places it (chain-aware
    /// LRU); may name a slot whose block has left since. Must be lock-free. The default ignores it.
    fn on_child_removed(&self, parent: SlotId) {
        let _ = parent;
    }
    /// A save's blocks were committed (each had its [`EvictionPolicy::on_insert`] and is `READY`
    /// now): a policy that files what it learns lazily, at its next selection, may file it now,
    /// on the committing thread and outside the eviction lock, if that costs no waiting. `ranking` is
    /// the tier's full preference order (as a selection's, with every class). Called without the
    /// eviction lock, concurrently with selections, hits and other commits; must never block.
    /// The default does nothing.
    fn file_pending(&self, ranking: &Ranking<'_>) {
        let _ = ranking;
    }
    /// Admission: may a missing block with `info` take a slot? Called on the save path
    /// ([`crate::Fit::Prefix`] saves only) once per missing key, in prompt order, before any slot
    /// is taken; from the first refusal on, no key of the batch is saved (a prefix hit cannot reach
    /// past a gap), but later keys are still shown so the policy can count them. Must be lock-free.
    /// The default admits everything.
    fn admit(&self, info: InsertInfo) -> bool {
        let _ = info;
        true
    }
}

/// The tier's preference order for one selection ([`EvictionPolicy::select_ranked`]).
#[derive(Copy, Clone)]
pub struct Ranking<'a> {
    /// Number of classes (`class_of` returns values below it).
    pub classes: u8,
    /// `None` for a slot that may not be taken now (pinned, not ready), else its class: lower
    /// classes are evicted first.
    pub class_of: &'a dyn Fn(SlotId) -> Option<u8>,
    /// The class a slot that `class_of` refuses would have once it may be taken (unpinned and
    /// ready), so a policy that keeps its candidates by class files it where it will belong.
    /// `None`: class 0.
    pub base_class: Option<&'a dyn Fn(SlotId) -> u8>,
    /// True for a class the tier knows holds no slot now (the orphan classes while no block is
    /// an orphan): a policy may skip looking for it. `None`: any class may hold slots.
    pub empty: Option<&'a dyn Fn(u8) -> bool>,
    /// With chain-aware eviction, the chains of resident blocks. A policy that ranks by a score
    /// then ranks each block by the best score in its subtree (itself and every resident block
    /// that continues it) and, on ties, deeper blocks first: a chain goes from its tail, when its
    /// most valuable block is the least valuable left, and a prefix shared by valuable chains is
    /// kept with them.
    pub chain: Option<&'a dyn ChainView>,
    /// True when other selections may run at once (the tier's shared eviction lock, for a
    /// policy with [`EvictionPolicy::concurrent_selection`]): a sharded policy may then search
    /// only the part it can get without waiting. False: this selection runs alone and must reach
    /// every slot (the liveness contract).
    pub beside_others: bool,
}

impl<'a> Ranking<'a> {
    /// One class: every slot for which `evictable` is true; no chains.
    pub fn plain(evictable: &'a dyn Fn(SlotId) -> Option<u8>) -> Self {
        Ranking { classes: 1, class_of: evictable, base_class: None, empty: None, chain: None, beside_others: false }
    }
}

/// What the tier knows of chains (see [`Ranking::chain`]).
pub trait ChainView {
    /// The block that `slot`'s block continues, if it is still resident (being written, ready or
    /// being evicted).
    fn parent(&self, slot: SlotId) -> Option<SlotId>;
    /// The prompt depth of `slot`'s block (`u32::MAX` if unknown): a block is deeper than its
    /// parent.
    fn depth(&self, slot: SlotId) -> u32;
    /// How many resident blocks (being written, ready or being evicted) continue `slot`'s block:
    /// those whose [`ChainView::parent`] is `slot`. `None` if this view does not count them (the
    /// default); a view that counts them lets chain-aware LRU select from its victim order, in
    /// O(n log capacity), instead of scanning every slot.
    fn resident_children(&self, slot: SlotId) -> Option<u32> {
        let _ = slot;
        None
    }
}

/// What a policy learns about a block when it becomes ready.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InsertInfo {
    /// [`crate::ContentKey::hash64`] of the block's key (lets a policy remember keys it evicted).
    pub key_hash: u64,
    /// The block's position in its prompt (0 = the first page), if the saver passed
    /// [`crate::SaveOptions::prefix_depth`]. A prefix hit on page `d` needs pages `0..d` resident.
    pub depth: Option<u32>,
    /// The prompt depth at which the save that stored this block began
    /// ([`crate::SaveOptions::prefix_depth`]): the blocks before it were resident (an engine saves
    /// what its query missed) or saved earlier. A later turn of a conversation resumes deeper.
    pub resumed_at: Option<u32>,
    /// The resident block this one continues in its prompt (the chain link the tier recorded, see
    /// [`crate::TierConfig::chain_aware`]), if known when the block became ready.
    pub parent: Option<SlotId>,
    /// For [`EvictionPolicy::admit`] only: how many keys of the save this block belongs to are
    /// missing (the pages the save would place), if the tier counted them. `None` elsewhere.
    pub save_missing: Option<u32>,
}

impl InsertInfo {
    /// Insert information for a block whose key hashes to `key_hash`, at prompt depth `depth`.
    pub fn new(key_hash: u64, depth: Option<u32>) -> Self {
        InsertInfo { key_hash, depth, resumed_at: None, parent: None, save_missing: None }
    }

    /// Sets [`InsertInfo::resumed_at`].
    pub fn resumed_at(mut self, depth: Option<u32>) -> Self {
        self.resumed_at = depth;
        self
    }

    /// Sets [`InsertInfo::save_missing`].
    pub fn save_missing(mut self, n: Option<u32>) -> Self {
        self.save_missing = n;
        self
    }

    /// Sets [`InsertInfo::parent`].
    pub fn parent(mut self, parent: Option<SlotId>) -> Self {
        self.parent = parent;
        self
    }
}

/// The built-in policies. [`PolicyKind::default`] ([`PolicyKind::AdaptiveLfu`]) is the one default
/// of the crate: the tier configuration and the command line use it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub enum PolicyKind {
    /// Least recently used, exact: every insert and hit takes a tick from one global counter, and
    /// victims are the unpinned ready blocks with the smallest ticks. With chain-aware eviction
    /// ([`crate::TierConfig::chain_aware`]) a block ranks by the newest tick in its chain's resident
    /// subtree, deeper blocks first on ties (`Ranking::chain`): a chain goes whole, from its tail,
    /// in the order of its last use, instead of losing its head first. The baseline every other
    /// policy is measured against (`docs/benchmarks.md`).
    Lru,
    /// CLOCK (second chance) over the slot array: a hit sets a reference bit; the hand clears set
    /// bits and proposes the first unpinned ready slot whose bit is clear.
    Clock,
    /// SIEVE (Zhang et al., NSDI'24): one insertion-ordered queue and a visited bit; the hand walks
    /// from the oldest block towards the newest, clearing visited bits, and evicts the first
    /// unvisited block in place (survivors are not moved).
    Sieve,
    /// S3-FIFO (Yang et al., SOSP'23): new blocks enter a small FIFO (10% of the pool); a block hit
    /// while there moves to the main FIFO, the others are evicted and their key hashes kept in a
    /// ghost table; a block whose key is in the ghost enters the main FIFO directly. The main FIFO
    /// reinserts blocks with a non-zero 2-bit frequency (decrementing it).
    S3Fifo,
    /// 2Q (Johnson and Shasha, VLDB'94) as probationary admission: a new block enters a
    /// probationary FIFO; its second use (a hit there, or a save of a key evicted from probation,
    /// which a ghost table of key hashes remembers) moves it to the main LRU. A new block evicts
    /// from probation once probation holds 10% of the pool, else from main. A prefix save places
    /// at most as many pages not in the ghost as the free slots plus probation's blocks (or its
    /// 10%, if more); the rest are refused and go to the ghost: a request larger than the pool
    /// keeps its head and passes through probation without flushing blocks used twice. Ignores
    /// chains.
    TwoQ,
    /// Prefix-aware frequency-weighted recency: the score of a block is its last-touch tick plus
    /// `8 x capacity` ticks per reference its key has had (a 4-bit count-min history that survives
    /// eviction and is halved every `64 x capacity` references), minus twice its prompt depth, so
    /// blocks of keys seen again outlive blocks seen once and a chain loses its tail before its
    /// head. Victims are the lowest scores.
    PrefixLfu,
    /// [`PolicyKind::PrefixLfu`] with a TinyLFU-style doorkeeper on admission: a missing block whose
    /// key has no reference in the policy's history is not saved, only counted, so it is admitted
    /// when it is seen again (the rest of that save is dropped with it: a chain with a gap is worth
    /// nothing past the gap). Ageing rounds the halved counters up, so a key once seen is never
    /// forgotten.
    PrefixTinyLfu,
    /// [`PolicyKind::PrefixLfu`] whose frequency weight is not a constant but learned online from
    /// the workload by miniature simulations (Waldspurger et al., *Cache Modeling and Optimization
    /// using Miniature Simulations*, USENIX ATC'17): the references of a fixed sample of keys (by
    /// key hash, about 512 blocks' worth) are replayed through eight small caches that rank with the
    /// same score and weights of 0, 1, 2, 4, 8, 16, 32 and 64 capacities of ticks per reference;
    /// after every `capacity` references the policy takes the weight of the mini cache with the
    /// most hits recently (each period counting 7/8 of the next). Weight 0 is LRU order, so the
    /// policy starts as LRU and returns to it on workloads where frequency does not pay. Costs one
    /// try-lock and eight small-cache updates per reference of a sampled key (a reference that
    /// finds the mini caches busy is skipped, so a query never waits).
    ///
    /// With probationary admission: a block is on probation from its save until its first hit.
    /// A prefix save whose missing pages are more than 3/4 of the pool places at most as many as
    /// the free slots plus the blocks on probation (or 10% of the pool, if more); the rest are
    /// refused (and counted in the history). A request larger than the pool keeps its head and
    /// does not flush the blocks that were used again.
    ///
    /// The default: on every trace and pool size of the validation table (`docs/benchmarks.md`:
    /// both halves of the conversation trace, its sample, two synthetic workloads) it is never
    /// below LRU, and it has the highest mean ratio to LRU of the policies that never are
    /// (`docs/design.md` says why).
    #[default]
    AdaptiveLfu,
}

impl PolicyKind {
    /// All built-in policies, for `--policy` help, comparisons and the proofs that must cover each.
    pub const ALL: &'static [PolicyKind] = &[
        PolicyKind::Lru,
        PolicyKind::Clock,
        PolicyKind::Sieve,
        PolicyKind::S3Fifo,
        PolicyKind::TwoQ,
        PolicyKind::PrefixLfu,
        PolicyKind::PrefixTinyLfu,
        PolicyKind::AdaptiveLfu,
    ];

    /// A policy instance for a pool of `capacity` slots.
    pub fn build(self, capacity: u32) -> Box<dyn EvictionPolicy> {
        match self {
            PolicyKind::Lru => Box::new(Lru::new(capacity)),
            PolicyKind::Clock => Box::new(Clock::new(capacity)),
            PolicyKind::Sieve => Box::new(Sieve::new(capacity)),
            PolicyKind::S3Fifo => Box::new(S3Fifo::new(capacity)),
            PolicyKind::TwoQ => Box::new(TwoQ::new(capacity)),
            PolicyKind::PrefixLfu => Box::new(PrefixLfu::new(capacity)),
            PolicyKind::PrefixTinyLfu => Box::new(PrefixLfu::with_doorkeeper(capacity)),
            PolicyKind::AdaptiveLfu => Box::new(PrefixLfu::adaptive(capacity)),
        }
    }

    /// The policy's name (what [`PolicyKind::from_str`] parses).
    pub fn name(self) -> &'static str {
        match self {
            PolicyKind::Lru => "lru",
            PolicyKind::Clock => "clock",
            PolicyKind::Sieve => "sieve",
            PolicyKind::S3Fifo => "s3fifo",
            PolicyKind::TwoQ => "2q",
            PolicyKind::PrefixLfu => "prefix-lfu",
            PolicyKind::PrefixTinyLfu => "prefix-tinylfu",
            PolicyKind::AdaptiveLfu => "adaptive-lfu",
        }
    }
}

impl fmt::Display for PolicyKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// An unknown policy name.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown policy `{name}` (known: {known})")]
pub struct UnknownPolicy {
    /// The name given.
    pub name: String,
    /// The known names, comma-separated.
    pub known: String,
}

impl FromStr for PolicyKind {
    type Err = UnknownPolicy;
    fn from_str(s: &str) -> Result<Self, UnknownPolicy> {
        PolicyKind::ALL.iter().copied().find(|p| p.name() == s).ok_or_else(|| UnknownPolicy {
            name: s.to_string(),
            known: PolicyKind::ALL.iter().map(|p| p.name()).collect::<Vec<_>>().join(", "),
        })
    }
}

impl std::fmt::Debug for Ranking<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ranking").field("classes", &self.classes).field("chain", &self.chain.is_some()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod contract_tests;
