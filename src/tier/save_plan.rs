//! The save path's plan: what a save will do, computed as a value before any slot is taken.
//!
//! [`Core::plan_save`] classifies every key of a save once:
//!
//! - **duplicate**: the same key came earlier in this save (copied once);
//! - **resident**: ready in the pool (recency refreshed, nothing copied). The plan *pins* each
//!   resident block until the save has its slots, so a save never evicts a block of its own chain
//!   (a prefix with a hole at its head is worth nothing);
//! - **in flight**: another save holds it (its copy is in flight, or it is between planning and
//!   reserving);
//! - **missing**: to be saved; the save *enters* each such key in the keys being saved ([`super::saving::SavingKeys`]) until its
//!   slot is reserved in the index, so two saves of one key never both take slots for it (neither
//!   evicts a block for a copy the other makes);
//! - **refused**: missing keys from the policy's first admission refusal on
//!   ([`crate::Fit::Prefix`] only).
//!
//! A key whose slot is being evicted right now is classified after the eviction settles (the
//! eviction lock is taken, which settles a claim being made or given back, and a claim still being
//! finished after it is waited for): it is then missing, or resident again if the claim was cancelled.
//! The rank then fits the plan to the slots it can get and records the counters once, from the plan
//! and the outcome.

use super::config::{Fit, SaveOptions};
use super::core::{Core, KeyState, Reserved};
use super::stats::add;
use crate::evict::InsertInfo;
use crate::index::{IndexReader, SlotRef};
use crate::key::{ContentKey, FoldHashing};
use crate::slab::slot::{PinError, SlotId};
use std::collections::HashSet;

/// What a save will do (see the module docs). Dropping it releases the entries it still holds.
pub struct SavePlan<'a> {
    core: &'a Core,
    /// Indices (into the keys given) of the keys to save, in order; each is entered in the keys being saved.
    missing: Vec<usize>,
    entered: Vec<ContentKey>,
    /// Resident blocks of this save, pinned until the plan is dropped.
    pinned: Vec<SlotId>,
    /// The pinned resident blocks by key position (first occurrences), for chain links.
    resident_at: Vec<(usize, SlotRef)>,
    /// Keys found resident.
    pub resident: usize,
    /// Keys another save holds.
    pub in_flight: usize,
    /// Keys repeated within the save.
    pub duplicates: usize,
    /// Missing keys not saved because the policy refused them or one before them.
    pub refused: usize,
}

impl SavePlan<'_> {
    /// The keys to save (indices into the save's keys, in order).
    pub fn missing(&self) -> &[usize] {
        &self.missing
    }

    /// Keeps only the first `n` keys to save (the rest are dropped: their entries are released).
    pub fn truncate(&mut self, n: usize) {
        for k in self.entered.drain(n.min(self.missing.len())..) {
            self.core.saving.release(&k);
        }
        self.missing.truncate(n);
    }

    /// Records the plan's skip counters (once per save, whatever its outcome).
    pub(crate) fn record(&self) {
        let c = &self.core.counters;
        add(&c.save_skipped_resident, self.resident as u64);
        add(&c.save_skipped_in_flight, self.in_flight as u64);
        add(&c.save_skipped_duplicate, self.duplicates as u64);
    }
}

impl Drop for SavePlan<'_> {
    fn drop(&mut self) {
        for k in self.entered.drain(..) {
            self.core.saving.release(&k);
        }
        for s in self.pinned.drain(..) {
            self.core.unpin(s);
        }
    }
}

impl std::fmt::Debug for SavePlan<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SavePlan")
            .field("missing", &self.missing)
            .field("resident", &self.resident)
            .field("in_flight", &self.in_flight)
            .field("duplicates", &self.duplicates)
            .field("refused", &self.refused)
            .finish()
    }
}

impl Core {
    /// Plans a save of `keys` (see the module docs). Resident keys have their recency refreshed
    /// and stay pinned until the plan is dropped.
    pub fn plan_save(&self, keys: &[ContentKey], opts: &SaveOptions) -> SavePlan<'_> {
        let mut plan = SavePlan {
            core: self,
            missing: Vec::new(),
            entered: Vec::new(),
            pinned: Vec::new(),
            resident_at: Vec::new(),
            resident: 0,
            in_flight: 0,
            duplicates: 0,
            refused: 0,
        };
        let mut seen: HashSet<ContentKey, FoldHashing> = HashSet::with_capacity_and_hasher(keys.len(), FoldHashing);
        let mut evicting = Vec::new();
        {
            let reader = self.index.reader();
            for k in keys {
                reader.prefetch(k);
            }
            for (i, k) in keys.iter().enumerate() {
                if seen.insert(*k) {
                    self.plan_key(&reader, &mut plan, i, k, &mut evicting);
                } else {
                    plan.duplicates += 1;
                }
            }
        }
        // Keys under eviction: once the eviction lock has been ours, no claim on them is being made
        // or given back; one still `EVICTING` then is being finished (without the lock: see
        // `Core::acquire_slots`), a bounded step that never takes the eviction lock, so look again
        // until it has ended.
        while !evicting.is_empty() {
            drop(self.lock_eviction());
            let reader = self.index.reader();
            for i in std::mem::take(&mut evicting) {
                // Seeded bug (tests only): `plan-finishing-in-flight` counts a key whose eviction
                // is being finished as in flight (a save of it), as if the lock had settled it.
                if crate::seeded::seeded("plan-finishing-in-flight")
                    && self.classify(&reader, &keys[i]) == KeyState::Evicting
                {
                    plan.in_flight += 1;
                    continue;
                }
                self.plan_key(&reader, &mut plan, i, &keys[i], &mut evicting);
            }
            if !evicting.is_empty() {
                crate::sync::yield_now();
            }
        }
        // Admission (Fit::Prefix only): every missing key is shown to the policy in order; from its
        // first refusal on nothing is saved (a prefix hit cannot reach past the gap).
        if opts.fit == Fit::Prefix {
            let mut cut = None;
            let missing = u32::try_from(plan.missing.len()).ok();
            for (j, &i) in plan.missing.iter().enumerate() {
                let info = InsertInfo::new(keys[i].hash64(), opts.depth_of(i))
                    .resumed_at(opts.prefix_depth)
                    .save_missing(missing);
                let admitted = self.policy.admit(info);
                if !admitted && cut.is_none() {
                    cut = Some(j);
                }
            }
            if let Some(j) = cut {
                plan.refused = plan.missing.len() - j;
                plan.truncate(j);
            }
        }
        plan
    }

    /// Links the blocks of a save whose keys form a chain ([`SaveOptions::is_chain`]): each block
    /// this save reserved (`reserved[j]` holds key `saving[j]`) or found resident and pinned (in
    /// `plan`) is linked to the block of the key before it (`opts.parent` for the first key), found
    /// among those or in the index (another save's block in flight). A resident block is only
    /// re-linked if its link is dead: its prefix was evicted and is being saved again. Call while the
    /// plan (its pins) and the reservation are held.
    pub(crate) fn link_save(
        &self,
        keys: &[ContentKey],
        opts: &SaveOptions,
        plan: &SavePlan<'_>,
        saving: &[usize],
        reserved: &[Reserved],
    ) {
        let mut at: Vec<Option<SlotRef>> = vec![None; keys.len()];
        for (&i, r) in saving.iter().zip(reserved) {
            at[i] = Some(SlotRef { slot: r.slot, generation: r.generation });
        }
        for &(i, r) in &plan.resident_at {
            at[i] = Some(r);
        }
        for (i, child) in at.iter().enumerate() {
            let Some(child) = child else { continue };
            let parent = match i {
                0 => opts.parent.and_then(|k| self.find_block(&k)),
                _ => at[i - 1].or_else(|| self.find_block(&keys[i - 1])),
            };
            if let Some(p) = parent {
                self.link_chain(child.slot, p);
            }
        }
    }

    /// Classifies key `i` of a save into `plan` (or into `evicting`, to look again once the
    /// eviction lock is free).
    fn plan_key(
        &self,
        reader: &IndexReader<'_>,
        plan: &mut SavePlan<'_>,
        i: usize,
        k: &ContentKey,
        evicting: &mut Vec<usize>,
    ) {
        loop {
            match self.classify(reader, k) {
                KeyState::Ready(r) => match self.pin(r.slot, r.generation) {
                    Ok(()) => {
                        plan.pinned.push(r.slot);
                        plan.resident_at.push((i, r));
                        self.policy.on_hit(r.slot);
                        plan.resident += 1;
                        return;
                    }
                    Err(PinError::Overflow) => {
                        self.policy.on_hit(r.slot);
                        plan.resident += 1;
                        return;
                    }
                    // Evicted or reused since the lookup: look again.
                    Err(PinError::Stale | PinError::NotReady) => {}
                },
                KeyState::Writing => {
                    plan.in_flight += 1;
                    return;
                }
                KeyState::Evicting => {
                    evicting.push(i);
                    return;
                }
                KeyState::Missing => {
                    if !self.saving.enter(*k) {
                        plan.in_flight += 1;
                        return;
                    }
                    // A save that held the key may have reserved it between the look and the entry.
                    if self.classify(reader, k) == KeyState::Missing {
                        let at = plan.missing.partition_point(|&m| m < i);
                        plan.missing.insert(at, i);
                        plan.entered.insert(at, *k);
                        return;
                    }
                    self.saving.release(k);
                }
            }
            crate::sync::spin_loop();
        }
    }
}
