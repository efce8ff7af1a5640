//! Promotion: a query's prefix continued from the SSD tier into fresh host slots (see the module
//! docs of [`crate::tier::ssd`] for the steps and why each block is either verified or never served).

use super::directory::DiskRef;
use super::SsdTier;
use crate::disk::{BatchEngine, ReadRequest};
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

impl SsdTier {
    /// Continues a lease's prefix from disk: promotes the longest run of `keys` (the keys after the
    /// host prefix, the first of them missing from the host) whose blocks the SSD tier holds, the
    /// host does not, and that verify, and appends them to `blocks`, each with one pin taken for
    /// the lease. Stops at a key already in `blocks` or repeated in the run, at a key the host
    /// holds (the lease continues from the host there), at a key a save reserved on the host
    /// first, when no host slot can be had, and at the first block that fails to read or verify.
    /// Returns how many blocks it appended.
    pub(crate) fn promote(&self, core: &Arc<Core>, keys: &[ContentKey], blocks: &mut Vec<LeasedBlock>) -> usize {
        let max = keys.len().min(core.pool().capacity() as usize);
        let leased: HashSet<ContentKey> = blocks.iter().map(|b| b.key).collect();
        let mut in_run = HashSet::new();
        let mut run: Vec<(ContentKey, DiskRef)> = Vec::new();
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
                Some(d) => run.push((*k, d)),
                None => break,
            }
        }
        if run.is_empty() {
            return 0;
        }
        let run_keys: Vec<ContentKey> = run.iter().map(|(k, _)| *k).collect();
        let reservation = reserve_promotion(core, &run_keys);
        for (_, d) in run.drain(reservation.len()..) {
            self.slots.unpin(d, false);
        }
        let verified = self.read_into(core, &run, &reservation);
        for (i, (key, d)) in run.iter().enumerate() {
            if i < verified {
                self.slots.unpin(*d, true);
            } else if i == verified {
                // The block that failed: never served, and dropped from disk.
                self.count_promotion_failure();
                tracing::warn!(key = %key, disk_slot = d.slot, "an SSD tier block failed to read or verify: dropped");
                self.slots.drop_unverified(*d);
            } else {
                self.slots.unpin(*d, false);
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

    /// Reads the disk blocks of `run` into the reserved host slots (same order) at the tier's read
    /// depth, one batch per file. Returns the length of the leading run that read and verified.
    fn read_into(&self, core: &Core, run: &[(ContentKey, DiskRef)], reservation: &WriteReservation) -> usize {
        let len = self.payload_bytes() as usize;
        let mut ok = vec![false; run.len()];
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
                        ok[i] = r.is_ok();
                    }
                }
                Err(e) => tracing::warn!(error = %e, "an SSD tier read batch was refused"),
            }
        }
        // Seeded bug (tests only): a block that failed verification is promoted anyway.
        if crate::seeded::seeded("promotion-unverified") {
            return run.len();
        }
        ok.iter().take_while(|&&v| v).count()
    }
}
