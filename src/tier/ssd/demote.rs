//! The demotion thread: writes queued host blocks to disk slots, one at a time, off every save's
//! and query's path.
//!
//! It holds the tier's core only while it writes a job (a [`Weak`] reference upgraded per job).
//! The drop of the tier's last handle (`TierHandle`: every `HostTier` and `Rank`) stops and joins
//! it before it returns, so the thread never holds the core, or its files' locks, past that drop:
//! the core goes with the last handle, or with the last lease that outlives it.

use super::{bump, lock, pin_for_demotion, DemotionQueue, Job, SsdTier};
use crate::tier::core::Core;
use crate::tier::events::{EventMedium, TierEvent};
use std::sync::{Arc, Weak};

/// Starts the demotion thread of `core`'s SSD tier (none without one).
///
/// # Errors
/// The OS error if the thread cannot be spawned.
pub(crate) fn start(core: &Arc<Core>) -> std::io::Result<()> {
    let Some(ssd) = SsdTier::of(core) else { return Ok(()) };
    let queue = ssd.queue.clone();
    let weak = Arc::downgrade(core);
    let handle = std::thread::Builder::new().name("kvtier-demote".into()).spawn(move || run(&queue, &weak))?;
    ssd.set_worker(handle);
    Ok(())
}

fn run(queue: &DemotionQueue, core: &Weak<Core>) {
    loop {
        let job = {
            let mut q = lock(&queue.state);
            loop {
                if q.stop {
                    return;
                }
                if let Some(job) = q.jobs.pop_front() {
                    q.busy = true;
                    break job;
                }
                queue.idle.notify_all();
                q = queue.wake.wait(q).unwrap_or_else(|p| p.into_inner());
            }
        };
        if let Some(core) = core.upgrade() {
            if let Some(ssd) = SsdTier::of(&core) {
                demote(&core, ssd, job);
            }
        }
        let mut q = lock(&queue.state);
        q.busy = false;
        if q.jobs.is_empty() {
            queue.idle.notify_all();
        }
    }
}

/// Writes the block of `job` to a disk slot, if it is still the host block the job names and
/// not on disk yet.
pub(crate) fn demote(core: &Core, ssd: &SsdTier, job: Job) {
    let Job { slot, generation, key } = job;
    if ssd.slots.contains(&key) {
        ssd.mark_clean(slot, generation);
        core.policy.on_reclass(slot);
        bump(&ssd.counters.demotions_skipped, 1);
        return;
    }
    // The pin keeps the block from eviction (and so from being rewritten) during the write.
    let Some(_pin) = pin_for_demotion(core, &job) else {
        bump(&ssd.counters.demotions_skipped, 1);
        return;
    };
    let Some((disk, evicted)) = super::take_disk_slot(&ssd.slots, &ssd.admission, &key) else {
        // Every disk slot is being read or written: drop this demotion.
        bump(&ssd.counters.demotions_dropped, 1);
        return;
    };
    if let Some(old) = evicted {
        bump(&ssd.counters.disk_evictions, 1);
        core.record(TierEvent::Removed { key: old, medium: EventMedium::Disk });
        ssd.forget_clean(core, &old);
    }
    let (file, local) = ssd.locate(disk.slot);
    let len = ssd.payload_bytes() as usize;
    // SAFETY: the slot is pinned READY with `generation` (`pin_for_demotion`, held by `_pin` until this
    // function returns): no save writes it (saves write only WRITING slots they own) and it cannot
    // be evicted and reused, so its `len` bytes (one block, within the pool's mapping, which the
    // core owns and `core` borrows) stay unchanged for this shared borrow.
    let payload = unsafe { std::slice::from_raw_parts(core.pool().slot_ptr(slot), len) };
    match file.write(local, key, disk.file_generation, payload) {
        Ok(()) => {
            if ssd.slots.commit(disk, key) {
                core.record(TierEvent::Stored { key, medium: EventMedium::Disk });
                ssd.mark_clean(slot, generation);
                // Clean blocks go before dirty ones: the policy re-places it.
                core.policy.on_reclass(slot);
                bump(&ssd.counters.demoted_blocks, 1);
                bump(&ssd.counters.bytes_demoted, len as u64);
            } else {
                bump(&ssd.counters.demotions_skipped, 1);
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, key = %key, "an SSD tier demotion failed: the block stays on the host only");
            ssd.slots.abort(disk);
            bump(&ssd.counters.demotion_failures, 1);
        }
    }
}
