//! The tier side of a save, before any copy: plan, fit, acquire slots, reserve. Shared by an
//! in-process [`crate::Rank::save_with`] and the tier daemon's answer to a remote rank's save
//! (`kvtier::remote`), so both run the very same state machine steps.

use super::config::{Fit, SaveOptions};
use super::core::Core;
use super::evictor::Want;
use super::stats::add;
use crate::error::TierError;
use crate::key::ContentKey;
use crate::sync::Arc;
use crate::tier::pins::WriteReservation;

/// A save whose slots are reserved (`WRITING`, indexed, invisible) and whose copy is next.
#[derive(Debug)]
pub(crate) struct PreparedSave {
    /// Indices (into the keys given) of the blocks to copy, in order; `saving[i]` goes to
    /// `reservation.entries()[i]`.
    pub saving: Vec<usize>,
    /// The reserved slots: commit after the copy completed, drop to abort.
    pub reservation: WriteReservation,
    /// Keys found resident.
    pub resident: usize,
    /// Keys another save holds.
    pub in_flight: usize,
    /// Keys repeated within the save.
    pub duplicates: usize,
    /// Keys dropped by [`Fit::Prefix`] (no room, or not admitted).
    pub dropped: usize,
}

/// Plans a save of `keys`, fits it to the slots it can get (free first, then eviction of unpinned
/// ready blocks) and reserves them; records the save's counters (not the copy's).
///
/// # Errors
/// [`TierError::CannotFit`] ([`Fit::AllOrNothing`]: nothing evicted) or
/// [`TierError::PoolExhausted`] (the slots were pinned meanwhile; nothing evicted).
pub(crate) fn prepare_save(
    core: &Arc<Core>,
    keys: &[ContentKey],
    opts: &SaveOptions,
) -> Result<PreparedSave, TierError> {
    let c = &core.counters;
    let mut plan = core.plan_save(keys, opts);
    plan.record();
    let need = plan.missing().len();
    let want = match opts.fit {
        Fit::AllOrNothing => {
            let mut avail = core.available_slots();
            if need > avail && core.expire_leases() > 0 {
                avail = core.available_slots();
            }
            if need > avail {
                add(&c.saves_refused, 1);
                return Err(TierError::CannotFit {
                    needed: need,
                    available: avail,
                    capacity: core.pool().capacity() as usize,
                });
            }
            Want::Exactly(need)
        }
        Fit::Prefix => {
            if need > core.available_slots() {
                core.expire_leases();
            }
            Want::Admitted(need)
        }
    };
    let slots = core.acquire_slots(want).inspect_err(|_| add(&c.saves_refused, 1))?;
    plan.truncate(slots.len());
    let dropped = need - slots.len() + plan.refused;
    add(&c.save_dropped, dropped as u64);
    let mut reservation = WriteReservation::new(core);
    let mut saving = Vec::with_capacity(slots.len());
    let mut lost = 0;
    for (&i, slot) in plan.missing().iter().zip(slots) {
        let (depth, resumed) = (opts.depth_of(i).unwrap_or(u32::MAX), opts.prefix_depth.unwrap_or(u32::MAX));
        if reservation.reserve_at(keys[i], slot, depth, resumed) {
            saving.push(i);
        } else {
            // Unreachable while the plan's saving entry is held; counted as in flight if it happens.
            lost += 1;
        }
    }
    add(&c.save_skipped_in_flight, lost as u64);
    if opts.is_chain() {
        // While the plan pins the resident blocks and the reservation owns the new ones.
        core.link_save(keys, opts, &plan, &saving, reservation.entries());
    }
    let (resident, in_flight, duplicates) = (plan.resident, plan.in_flight + lost, plan.duplicates);
    // The index entries are in place: the keys' saving entries can go.
    drop(plan);
    Ok(PreparedSave { saving, reservation, resident, in_flight, duplicates, dropped })
}
