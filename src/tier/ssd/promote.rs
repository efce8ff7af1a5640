//! Promotion: a query's prefix continued from the SSD tier into fresh host slots (see the module
//! docs of [`crate::tier::ssd`] for the steps and why each block is either verified or never served).

use super::directory::{DiskRef, DiskSlots};
use super::SsdTier;
use crate::disk::{BatchEngine, DiskError, ReadRequest};
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::sync::Arc;
use crate::tier::core::Core;
use crate::tier::evictor::Want;
use crate::tier::lease::LeasedBlock;
use crate::tier::pins::WriteReservation;
use std::collections::HashSet;

/// The host side of a promotion of `keys`: takes host slots as a save does (free first, then
/// eviction of unpinned ready blocks) and reserves them `WRITING` under the keys, in order,
/// stopping at the first key another save reserved first (that save's block will be found by later
/// queries) or when no more slots could be had. Returns the reservation of the leading keys;
/// publish it with [`WriteReservation::commit_leading_pinned`] once the blocks are read and
/// verified.
pub fn reserve_promotion(core: &Arc<Core>, keys: &[ContentKey]) -> WriteReservation {
    let got = core.acquire_slots(Want::UpTo(keys.len())).unwrap_or_default();
    let mut reservation = WriteReservation::new(core);
    let mut free = got.into_iter();
    for k in keys {
        let Some(slot) = free.next() else { break };
        if !reservation.reserve(*k, slot, u32::MAX) {
            break;
        }
    }
    for slot in free {
        core.pool().free(slot);
    }
    reservation
}

/// What became of one block of a promotion's run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Read, and its key, generation and checksum verified: copied into its host slot.
    Verified,
    /// Read, and it failed verification: the slot holds no sound copy (dropped, and erased on disk).
    Unverified,
    /// Not read (an I/O error, a batch refused, no host slot for it): the block stays on disk.
    Unread,
}

/// The disk pins of a promotion's run ([`DiskSlots::pin`]): dropping the guard unpins every one
/// not yet handed on, so a panic anywhere in a promotion (the host side's eviction, the read, the
/// verification, a log line) never leaves a disk slot pinned, and so never evictable again.
struct RunPins<'a> {
    slots: &'a DiskSlots,
    run: Vec<(ContentKey, DiskRef)>,
    /// `run[..done]` were handed on (unpinned, or dropped) by the promotion itself.
    done: usize,
}

impl RunPins<'_> {
    /// Unpins the run from `len` on (blocks no host slot was had for).
    fn truncate(&mut self, len: usize) {
        while self.run.len() > len.max(self.done) {
            let (_, d) = self.run.pop().expect("a pin past len");
            self.slots.unpin(d, false);
        }
    }
}

impl Drop for RunPins<'_> {
    fn drop(&mut self) {
        // Seeded bug (tests only): the pins of a promotion that panicked stay held for good.
        if crate::seeded::seeded("promotion-panic-keeps-pins") {
            return;
        }
        for &(_, d) in &self.run[self.done..] {
            self.slots.unpin(d, false);
        }
    }
}

impl SsdTier {
    /// Continues a lease's prefix from disk: promotes the longest run of `keys` (the keys after the
    /// host prefix, the first of them missing from the host) whose blocks the SSD tier holds, the
    /// host does not, and that verify, and appends them to `blocks`, each with one pin taken for
    /// the lease. Stops at a key already in `blocks` or repeated in the run, at a key the host
    /// holds (the lease continues from the host there), at a key a save reserved on the host
    /// first, when no host slot can be had, and at the first block that fails to read or verify.
    /// A block that was read and failed verification is dropped from the SSD tier and its slot's
    /// trailer cleared on disk; a block that could not be read (an I/O error) stays. Returns how
    /// many blocks it appended.
    pub(crate) fn promote(&self, core: &Arc<Core>, keys: &[ContentKey], blocks: &mut Vec<LeasedBlock>) -> usize {
        let max = keys.len().min(core.pool().capacity() as usize);
        let leased: HashSet<ContentKey> = blocks.iter().map(|b| b.key).collect();
        let mut in_run = HashSet::new();
        let mut pins = RunPins { slots: &self.slots, run: Vec::new(), done: 0 };
        for k in &keys[..max] {
            // A key the host holds ends the run: the lease takes it from the host (a promotion never
            // re-reads a block the host has).
            // (Seeded bug, tests only: `promotion-rereads-host-blocks` reads it from the drive.)
            if leased.contains(k) || !in_run.insert(*k) {
                break;
            }
            if !crate::seeded::seeded("promotion-rereads-host-blocks") && core.index().get(k).is_some() {
                break;
            }
            match self.slots.pin(k) {
                Some(d) => pins.run.push((*k, d)),
                None => break,
            }
        }
        if pins.run.is_empty() {
            return 0;
        }
        let run_keys: Vec<ContentKey> = pins.run.iter().map(|(k, _)| *k).collect();
        let reservation = reserve_promotion(core, &run_keys);
        pins.truncate(reservation.len());
        let outcomes = self.read_into(core, &pins.run, &reservation);
        let verified = outcomes.iter().take_while(|&&o| o == Outcome::Verified).count();
        for (i, &outcome) in outcomes.iter().enumerate() {
            let (key, d) = pins.run[i];
            // Handed on before the step, whose first act is the unpin: a panic after it never
            // unpins twice.
            pins.done = i + 1;
            // Seeded bug (tests only): a block that could not be read is dropped as if it had
            // failed verification.
            let dropped = outcome == Outcome::Unverified
                || (outcome == Outcome::Unread && i == verified && crate::seeded::seeded("promotion-drops-unread"));
            if i < verified {
                self.slots.unpin(d, true);
            } else if dropped {
                // Read and not sound: never served, dropped, and erased on disk so that a restart
                // does not find it again.
                self.slots.drop_unverified(d, |slot| self.erase(slot));
                self.count_promotion_failure();
                tracing::warn!(key = %key, disk_slot = d.slot, "an SSD tier block failed verification: dropped");
            } else {
                self.slots.unpin(d, false);
                if i == verified {
                    self.count_promotion_failure();
                    tracing::warn!(key = %key, disk_slot = d.slot, "an SSD tier block could not be read: kept");
                }
            }
        }
        let committed = reservation.commit_leading_pinned(verified, |r| {
            self.mark_clean(r.slot, r.generation);
            core.policy.on_reclass(r.slot);
        });
        self.count_promoted(committed.len() as u64);
        for r in &committed {
            blocks.push(LeasedBlock { key: r.key, slot: SlotRef { slot: r.slot, generation: r.generation } });
        }
        committed.len()
    }

    /// Clears the trailer of global disk slot `slot` on disk (a block that failed verification),
    /// so that the next scan finds the slot blank. A failure is logged: the block then fails
    /// verification again after a restart, and is dropped again.
    fn erase(&self, slot: u32) {
        // Seeded bug (tests only): the block is dropped from memory only.
        if crate::seeded::seeded("unverified-kept-on-disk") {
            return;
        }
        let (file, local) = self.locate(slot);
        if let Err(e) = file.clear(local) {
            tracing::warn!(error = %e, disk_slot = slot, "an SSD tier slot that failed verification could not be cleared");
        }
    }

    /// Reads the disk blocks of `run` into the reserved host slots (same order) at the tier's read
    /// depth, one batch per file. Returns each block's outcome; only the leading verified ones
    /// may be served.
    fn read_into(&self, core: &Core, run: &[(ContentKey, DiskRef)], reservation: &WriteReservation) -> Vec<Outcome> {
        let len = self.payload_bytes() as usize;
        let mut outcomes = vec![Outcome::Unread; run.len()];
        // The run's positions, grouped by the file that holds each block (one batch per file).
        let mut by_file: Vec<Vec<usize>> = vec![Vec::new(); self.files.len()];
        for (i, (_, d)) in run.iter().enumerate() {
            by_file[self.file_of(d.slot)].push(i);
        }
        for (f, picked) in by_file.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
            let requests: Vec<ReadRequest> = picked
                .iter()
                .map(|&i| {
                    let (key, d) = run[i];
                    ReadRequest { slot: self.locate(d.slot).1, key, generation: d.file_generation }
                })
                .collect();
            let mut outs: Vec<&mut [u8]> = picked
                .iter()
                .map(|&i| {
                    let slot = reservation.entries()[i].slot;
                    // SAFETY: the slot is WRITING and owned by `reservation` (reserved above; no
                    // query can pin it and no evictor can claim it until it is committed or
                    // aborted), the slots of one reservation are distinct, so these `len`-byte
                    // slices (one block each, inside the pool's mapping, which `core` keeps alive)
                    // never overlap and nothing else reads or writes them meanwhile.
                    unsafe { std::slice::from_raw_parts_mut(core.pool().slot_ptr(slot), len) }
                })
                .collect();
            match self.file(f).read_batch(&requests, &mut outs, self.read_depth(), BatchEngine::IoUring) {
                Ok(report) => {
                    for (&i, r) in picked.iter().zip(&report.results) {
                        outcomes[i] = match r {
                            Ok(()) => Outcome::Verified,
                            Err(DiskError::Unverified { .. }) => Outcome::Unverified,
                            Err(_) => Outcome::Unread,
                        };
                    }
                }
                Err(e) => tracing::warn!(error = %e, "an SSD tier read batch was refused"),
            }
        }
        // Seeded bug (tests only): a block that failed verification is promoted anyway.
        if crate::seeded::seeded("promotion-unverified") {
            outcomes.fill(Outcome::Verified);
        }
        outcomes
    }
}
