//! The eviction mechanism: two-phase eviction under the eviction lock.
//!
//! The policy proposes victims; the tier **claims** each with `begin_evict`
//! (`READY(pins 0) -> EVICTING`, refused on any pin that arrived since), holding the claims in a
//! [`Claims`] value. A claimed block is invisible to new pins but still indexed and intact, so a
//! claim can still be given back. Only when the save is sure to get every slot it needs does it
//! **finish** the claims (index entry removed, then `release` bumps the generation) and take the
//! slots; dropping [`Claims`] unfinished **cancels** every claim (`EVICTING -> READY`): nothing is
//! evicted (invariant I7). Every proposal is settled with the policy exactly once: `on_cancel` or
//! `on_remove` (the contract in [`crate::evict`]).
//!
//! Free slots always come first: before claims are finished, any slot freed meanwhile replaces a
//! claim, and the free list's pop is exact (`None` only when it was empty at some instant), so no
//! block is evicted while a slot is free (invariant I9).

use super::core::Core;
use super::core::EvictionHold;
use super::stats::add;
use crate::error::TierError;
use crate::index::SlotRef;
use crate::slab::slot::SlotId;

/// Why blocks are evicted ([`Claims::finish`]; counted in [`crate::TierStats`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum EvictReason {
    /// A save needed the slots ([`Core::acquire_slots`]).
    Capacity,
    /// Asked for: [`crate::HostTier::evict`] ([`Core::evict_into`]).
    Explicit,
}

/// Claimed victims (see the module docs). Dropping it cancels every claim still held.
pub struct Claims<'a> {
    core: &'a Core,
    victims: Vec<(SlotId, u64)>,
    /// Never claim a block of a hinted key ([`Want::Admitted`] with
    /// [`crate::TierConfig::protect_hinted`]).
    spare_hinted: bool,
    /// The caller holds the eviction lock's shared side: other selections may run meanwhile
    /// ([`crate::evict::Ranking::beside_others`]). False by default: the exclusive side.
    beside_others: bool,
}

impl<'a> Claims<'a> {
    /// No claims yet. The caller holds the eviction lock for as long as this value lives.
    pub fn new(core: &'a Core) -> Self {
        Claims { core, victims: Vec::new(), spare_hinted: false, beside_others: false }
    }

    /// No claims yet; the claims made never take a block of a hinted key. The caller holds the
    /// eviction lock for as long as this value lives.
    pub fn sparing_hinted(core: &'a Core) -> Self {
        Claims { core, victims: Vec::new(), spare_hinted: true, beside_others: false }
    }

    /// Says which side of the eviction lock the caller holds now: `true` for the shared side
    /// (its selections may then run beside others'), `false` for the exclusive side.
    pub fn set_beside_others(&mut self, shared: bool) {
        self.beside_others = shared;
    }

    /// Claims held.
    pub fn len(&self) -> usize {
        self.victims.len()
    }

    /// True when no claim is held.
    pub fn is_empty(&self) -> bool {
        self.victims.is_empty()
    }

    /// Asks the policy for up to `n` victims and claims those still unpinned; a proposal whose
    /// claim fails is cancelled with the policy at once. Returns how many were claimed.
    pub fn claim(&mut self, n: usize) -> usize {
        let core = self.core;
        // No more victims exist than slots: a larger `n` (any caller's argument) is clamped before
        // anything is sized by it.
        // (Seeded bug, tests only: `evict-unclamped` sizes the candidates by the caller's `n`.)
        let n = if crate::seeded::seeded("evict-unclamped") { n } else { n.min(core.pool.capacity() as usize) };
        let mut cands = Vec::with_capacity(n);
        // Sparing hinted blocks: the hinted classes are withheld, so the selection offers unhinted
        // blocks only. (Seeded bug, tests only: `protect-hinted-ignored` offers them anyway.)
        let spare = self.spare_hinted && !crate::seeded::seeded("protect-hinted-ignored");
        core.with_ranking(spare, self.beside_others, |ranking| core.policy.select_ranked(n, ranking, &mut cands));
        let before = self.victims.len();
        for s in cands {
            // The CAS refuses a slot that was pinned since the selection: never evict a pinned block.
            match core.control().begin_evict(s) {
                Some(generation) => {
                    super::stats::sub(&core.counters.ready_slots, 1);
                    // Seeded bug (tests only): a claimed slot is not counted as evicting.
                    if !crate::seeded::seeded("evicting-uncounted") {
                        add(&core.counters.evicting_slots, 1);
                    }
                    self.victims.push((s, generation));
                    // Seeded bug (model checking only): the claimed victim goes back to the policy.
                    if crate::seeded::seeded("requeue-claimed-victim") {
                        core.policy.on_cancel(s);
                    }
                }
                None => core.policy.on_cancel(s),
            }
        }
        self.victims.len() - before
    }

    /// Gives the most recent claim back (`EVICTING -> READY`, policy `on_cancel`).
    pub fn cancel_one(&mut self) -> bool {
        let Some((s, generation)) = self.victims.pop() else { return false };
        self.core.control().cancel_evict(s, generation);
        super::stats::sub(&self.core.counters.evicting_slots, 1);
        add(&self.core.counters.ready_slots, 1);
        self.core.policy.on_cancel(s);
        true
    }

    /// Evicts every claimed block, counted as evicted for `reason`: each index entry is removed
    /// before the slot's generation is bumped (so even a reader holding the old entry fails to
    /// pin); the freed slots (not on the free list) are appended to `out`.
    pub fn finish(mut self, out: &mut Vec<SlotId>, reason: EvictReason) {
        let core = self.core;
        // Every victim's key words first, then (as they arrive) its index bucket: the loop below
        // then finds them in the caches instead of waiting for each miss in turn.
        for &(s, _) in &self.victims {
            core.prefetch_slot_key(s);
            core.chains.prefetch_link(s);
        }
        {
            let reader = core.index.reader();
            for &(s, _) in &self.victims {
                let key = core.slot_key(s);
                reader.prefetch(&key);
                core.policy.prefetch(s, key.hash64());
            }
        }
        for (s, generation) in std::mem::take(&mut self.victims) {
            let key = core.slot_key(s);
            let removed = core.index.remove_if(&key, SlotRef { slot: s, generation });
            debug_assert!(removed, "ready block in slot {} had no index entry", s.0);
            core.policy.on_remove(s);
            // Its parent may be a leaf now (a selection that ran since this block was claimed
            // filed the parent as interior). (Seeded bug, tests only: `child-removal-unannounced`
            // does not tell the policy.)
            if let Some(p) = core.chains.unlink(s).filter(|_| !crate::seeded::seeded("child-removal-unannounced")) {
                core.policy.on_child_removed(p);
            }
            core.control().release(s);
            core.on_evicted(s, generation, &key);
            // Its resident children are orphans now: the policy re-files them (orphans go first).
            core.chains.take_children(SlotRef { slot: s, generation }, |c| core.policy.on_reclass(c));
            super::stats::sub(&core.counters.evicting_slots, 1);
            add(&core.counters.evictions, 1);
            if reason == EvictReason::Explicit {
                add(&core.counters.explicit_evictions, 1);
            }
            out.push(s);
        }
    }
}

impl Drop for Claims<'_> {
    fn drop(&mut self) {
        while self.cancel_one() {}
    }
}

impl std::fmt::Debug for Claims<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Claims").field("victims", &self.victims).finish()
    }
}

/// How many slots [`Core::acquire_slots`] must get.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Want {
    /// Exactly this many, or none ([`TierError::PoolExhausted`]).
    Exactly(usize),
    /// As many as it can, up to this many.
    UpTo(usize),
    /// As [`Want::UpTo`], for a [`crate::Fit::Prefix`] save: with
    /// [`crate::TierConfig::protect_hinted`], no block of a hinted key is evicted for it.
    Admitted(usize),
}

impl Core {
    /// Takes slots for a save: free ones first, then evicting (see the module docs).
    ///
    /// # Errors
    /// [`TierError::PoolExhausted`] for [`Want::Exactly`] when not enough slots could be had (free
    /// slots taken go back to the free list, claimed blocks stay resident: nothing is evicted).
    pub fn acquire_slots(&self, want: Want) -> Result<Vec<SlotId>, TierError> {
        let cap = self.pool.capacity() as usize;
        let n = match want {
            Want::Exactly(n) if n > cap => return Err(TierError::PoolExhausted { needed: n, got: 0 }),
            Want::Exactly(n) => n,
            // More than the pool can never be had: ask for all of it.
            Want::UpTo(n) | Want::Admitted(n) => n.min(cap),
        };
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
        let mut serialise = self.lock_eviction_timed(self.selects_concurrently());
        let mut claims = match want {
            Want::Admitted(_) if self.protect_hinted() => Claims::sparing_hinted(self),
            _ => Claims::new(self),
        };
        claims.set_beside_others(serialise.is_shared());
        loop {
            let mut stalls = 0;
            while got.len() + claims.len() < n && stalls < 3 {
                fill(&mut got, n - claims.len());
                let short = n - got.len() - claims.len();
                if short == 0 {
                    break;
                }
                if claims.claim(short) == 0 {
                    stalls += 1;
                }
            }
            // Short under the shared side: the selections searched only the shards they could
            // get beside others', and another save may yet give back the blocks it claimed.
            // Before anything is refused, select again alone, where a selection searches every
            // shard. The claims made so far are given back first: no thread lets go of a shared
            // hold with a claim it may still give back, so while a thread holds the exclusive side
            // every claim held elsewhere is being finished (its block is on its way out), and a
            // refusal there is one the serialised tier would make too. The free slots taken are
            // kept. (Seeded bugs, tests only: `refusal-under-shared-hold` refuses without
            // selecting alone; `escalation-keeps-claims` keeps its claims while it waits.)
            if got.len() + claims.len() < n
                && serialise.is_shared()
                && !crate::seeded::seeded("refusal-under-shared-hold")
            {
                if !crate::seeded::seeded("escalation-keeps-claims") {
                    while claims.cancel_one() {}
                }
                drop(serialise);
                serialise = self.lock_eviction_timed(false);
                claims.set_beside_others(false);
                continue;
            }
            break;
        }
        // Never evict while a slot is free: a slot freed since the last pop replaces a claim.
        // (Seeded bug, tests only: `evict-while-free` skips this step.)
        while !claims.is_empty() && !crate::seeded::seeded("evict-while-free") {
            match self.pool.alloc() {
                Some(s) => {
                    got.push(s);
                    claims.cancel_one();
                }
                None => break,
            }
        }
        if got.len() + claims.len() < n {
            if let Want::Exactly(_) = want {
                let have = got.len() + claims.len();
                // Seeded bug (tests only): a save that cannot fit evicts what it claimed anyway.
                if crate::seeded::seeded("unfit-save-evicts") {
                    claims.finish(&mut got, EvictReason::Capacity);
                } else {
                    drop(claims);
                }
                for s in got {
                    self.pool.free(s);
                }
                return Err(TierError::PoolExhausted { needed: n, got: have });
            }
        }
        // The claims are this save's alone now (`EVICTING`: no pin, no other claim can take them),
        // so finishing them (index removals, chain links, the policy's `on_remove`) needs no
        // serialising: other saves select while this one finishes (see `finish_unlocked`).
        Self::finish_unlocked(serialise, claims, &mut got, EvictReason::Capacity);
        Ok(got)
    }

    /// Lets go of the eviction lock, then finishes `claims` (a save's or an asked-for eviction's
    /// last step: index removals, chain links, the policy's `on_remove`, the generation bumps).
    /// A claimed block is `EVICTING`: no pin and no other claim can take it, and only its claimant
    /// settles it, so the finish needs no serialising and other saves select while it runs. A plan
    /// that meets one of these blocks waits for its finish ([`Core::plan_save`]).
    fn finish_unlocked(serialise: EvictionHold<'_>, claims: Claims<'_>, out: &mut Vec<SlotId>, reason: EvictReason) {
        drop(serialise);
        claims.finish(out, reason);
    }

    /// Evicts up to `n` unpinned ready blocks chosen by the policy and appends their (now free,
    /// generation-bumped, not on the free list) slots to `out`. Returns how many were evicted. An
    /// `n` above the pool's capacity means the capacity (nothing is sized by `n` itself).
    pub fn evict_into(&self, n: usize, out: &mut Vec<SlotId>) -> usize {
        let n = if crate::seeded::seeded("evict-unclamped") { n } else { n.min(self.pool.capacity() as usize) };
        // Exclusive: an asked-for eviction evicts up to `n` whatever shards they are in.
        let serialise = self.lock_eviction_timed(false);
        let mut claims = Claims::new(self);
        let mut stalls = 0;
        while claims.len() < n && stalls < 3 {
            if claims.claim(n - claims.len()) == 0 {
                stalls += 1;
            }
        }
        let evicted = claims.len();
        // Seeded bug (tests only): an asked-for eviction is counted as a save's.
        let reason = if crate::seeded::seeded("explicit-evicts-as-capacity") {
            EvictReason::Capacity
        } else {
            EvictReason::Explicit
        };
        Self::finish_unlocked(serialise, claims, out, reason);
        evicted
    }
}
