//! The tier's counters ([`TierStats`]) and the slot audit ([`AuditReport`]).
//!
//! Counters are recorded once per operation, from its outcome (a save's [`super::save_plan::SavePlan`]
//! and the slots it got; a copy's completion), never piecemeal along the way.

use crate::copy::Direction;
use crate::sync::{AtomicU64, Ordering};
use crossbeam_utils::CachePadded;
use std::time::Duration;

/// A snapshot of the tier's counters. Block counts are blocks (pages across all arenas); bytes are
/// payload bytes (blocks x [`crate::Geometry::block_bytes`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
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
    /// Save keys skipped because the same key came earlier in the same save.
    pub save_skipped_duplicate: u64,
    /// Save keys dropped by [`crate::Fit::Prefix`] because they did not fit or were not admitted.
    pub save_dropped: u64,
    /// Saves refused whole ([`crate::TierError::CannotFit`] or [`crate::TierError::PoolExhausted`]).
    pub saves_refused: u64,
    /// Blocks whose save copy failed (never made visible).
    pub save_failed_blocks: u64,
    /// Blocks restored (copy completed).
    pub restored_blocks: u64,
    /// Blocks whose restore copy failed.
    pub restore_failed_blocks: u64,
    /// Blocks evicted, for either reason: by saves that needed a slot (capacity), and by
    /// [`crate::HostTier::evict`] ([`TierStats::explicit_evictions`]).
    pub evictions: u64,
    /// Blocks of [`TierStats::evictions`] evicted by [`crate::HostTier::evict`]; the rest were
    /// evicted by saves that needed a slot.
    pub explicit_evictions: u64,
    /// Payload bytes copied GPU -> host by completed saves.
    pub bytes_saved: u64,
    /// Payload bytes copied host -> GPU by completed restores.
    pub bytes_restored: u64,
    /// Leases settled by the tier because they outlived [`crate::TierConfig::lease_ttl`].
    pub expired_leases: u64,
    /// Leases not yet settled.
    pub live_leases: u64,
    /// Age in milliseconds of the oldest unsettled lease (tracked only when
    /// [`crate::TierConfig::lease_ttl`] is set; 0 otherwise or when there is none).
    pub oldest_lease_age_ms: u64,
    /// Slots withheld for good (kept `WRITING`, out of the index) because a save's copy outcome is
    /// unknown (its backend panicked submitting or waiting for it): never reused, since the copy
    /// may still be writing them. The tier daemon also counts here the slots of a disconnected
    /// engine process's saves, until it exits. Counts slots, not pins (see
    /// [`TierStats::quarantined_pins`]).
    pub quarantined_slots: u64,
    /// Slots with at least one pin (lease or restore guard).
    pub pinned_slots: u64,
    /// Slots holding a ready block.
    pub ready_slots: u64,
    /// Slots reserved by saves in flight.
    pub writing_slots: u64,
    /// Slots claimed by an evictor right now (`EVICTING`: invisible to new pins, still indexed
    /// until the claim's finish removes the entry; given back under the eviction lock or finished
    /// just after it, so 0 when quiescent).
    pub evicting_slots: u64,
    /// Slots on the free list.
    pub free_slots: u64,
    /// Slots in the pool.
    pub capacity: u64,
    /// Entries in the index.
    pub index_entries: u64,
    /// Pins kept for good because a restore's copy outcome is unknown (its backend panicked
    /// submitting or waiting for it): their slots stay pinned (`READY`, never evicted), since the
    /// copy may still be reading them. One per slot per restore; the tier daemon also counts the
    /// pins of a disconnected engine process's restores here, until it exits.
    pub quarantined_pins: u64,
}

/// How the tier's eviction lock was used ([`crate::HostTier::eviction_lock_stats`]): the one
/// serial step of a save that must evict. A save (or an SSD tier's promotion into the pool) takes
/// the lock only when the free list cannot give it every slot it needs; while it holds the lock it
/// selects its victims and claims them (the evictions are finished after it lets go).
/// With a policy that selects one save at a time (the lock's exclusive side), `held_ns / holds` is
/// the serial cost of one such save: saves on more threads cannot go faster together than one hold
/// after another. With one whose selections run beside each other (LRU, the prefix-LFU family:
/// the shared side) holds overlap, a hold includes any wait for a shard of the victim order, and a
/// save that selects again alone counts two holds. Sums since the tier was built; wall-clock
/// nanoseconds (`std::time::Instant`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct EvictionLockStats {
    /// Times the lock was taken: by saves and SSD promotions that needed more slots than were
    /// free, and by [`crate::HostTier::evict`].
    pub holds: u64,
    /// Nanoseconds spent waiting for the lock, summed over the holds.
    pub wait_ns: u64,
    /// Nanoseconds the lock was held (victim selection and claims), summed over the holds.
    pub held_ns: u64,
}

/// The live counters behind [`TierStats`].
#[derive(Default)]
pub(crate) struct Counters {
    pub queries: Count,
    pub hit_blocks: Count,
    pub miss_blocks: Count,
    pub saved_blocks: Count,
    pub save_skipped_resident: Count,
    pub save_skipped_in_flight: Count,
    pub save_skipped_duplicate: Count,
    pub save_dropped: Count,
    pub saves_refused: Count,
    pub save_failed_blocks: Count,
    pub restored_blocks: Count,
    pub restore_failed_blocks: Count,
    pub evictions: Count,
    pub explicit_evictions: Count,
    pub bytes_saved: Count,
    pub bytes_restored: Count,
    pub expired_leases: Count,
    pub quarantined_slots: Count,
    pub quarantined_pins: Count,
    // Gauges: updated with wrapping add/sub, read as signed and clamped (a +1 and a -1 of one slot
    // may publish in either order).
    pub live_leases: Count,
    pub pinned_slots: Count,
    pub ready_slots: Count,
    pub writing_slots: Count,
    pub evicting_slots: Count,
    /// Queue-to-completion time of completed copies: save, restore.
    pub copy_latency: [Latency; 2],
    /// The eviction lock's holds and their wait and hold times ([`EvictionLockStats`]).
    pub eviction_lock_holds: Count,
    pub eviction_lock_wait_ns: Count,
    pub eviction_lock_held_ns: Count,
}

/// Upper bounds, in nanoseconds, of the copy latency buckets but the last (`+Inf`): 10 µs to 10 s.
pub(crate) const LATENCY_BOUNDS_NS: [u64; 19] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// The longest single observation added to a latency sum (one hour, in nanoseconds): a value the
/// tier daemon gets from a client cannot wrap the sum.
const LATENCY_MAX_NS: u64 = 3_600_000_000_000;

/// A latency histogram: one count per bucket of [`LATENCY_BOUNDS_NS`] (not cumulative; the last is
/// `+Inf`) and the sum of the observations in nanoseconds. One relaxed add to a bucket and one to
/// the sum per observation (one copy batch, not one block).
pub(crate) struct Latency {
    buckets: [AtomicU64; LATENCY_BOUNDS_NS.len() + 1],
    sum_ns: AtomicU64,
}

impl Default for Latency {
    fn default() -> Self {
        Latency { buckets: std::array::from_fn(|_| AtomicU64::new(0)), sum_ns: AtomicU64::new(0) }
    }
}

/// A snapshot of a [`Latency`] histogram.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct LatencySnapshot {
    /// Observations per bucket of [`LATENCY_BOUNDS_NS`], then `+Inf` (not cumulative).
    pub buckets: [u64; LATENCY_BOUNDS_NS.len() + 1],
    /// Sum of the observations, nanoseconds.
    pub sum_ns: u64,
}

#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
impl LatencySnapshot {
    /// Observations in all.
    pub(crate) fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

impl Latency {
    /// Records one observation of `ns` nanoseconds.
    pub(crate) fn observe(&self, ns: u64) {
        let i = LATENCY_BOUNDS_NS.iter().position(|&b| ns <= b).unwrap_or(LATENCY_BOUNDS_NS.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_ns.fetch_add(ns.min(LATENCY_MAX_NS), Ordering::Relaxed);
    }

    /// The counts now (relaxed loads: a scrape racing an observation may see its bucket or not).
    #[cfg_attr(not(feature = "metrics"), allow(dead_code))]
    pub(crate) fn snapshot(&self) -> LatencySnapshot {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        LatencySnapshot { buckets: std::array::from_fn(|i| load(&self.buckets[i])), sum_ns: load(&self.sum_ns) }
    }
}

impl Counters {
    /// Records a finished copy of `blocks` blocks (`bytes` payload bytes) in direction `dir`, and
    /// for a completed one (`ok`) its queue-to-completion time `latency`, if known.
    pub(crate) fn record_copy(&self, dir: Direction, blocks: u64, bytes: u64, ok: bool, latency: Option<Duration>) {
        if let (true, Some(l)) = (ok, latency) {
            // Seeded bug (tests only): every copy's latency is recorded as a save's.
            let at = if crate::seeded::seeded("copy-latency-one-direction") { Direction::Save } else { dir };
            self.copy_latency[latency_index(at)].observe(l.as_nanos().min(u64::MAX as u128) as u64);
        }
        match (dir, ok) {
            (Direction::Save, true) => {
                add(&self.saved_blocks, blocks);
                add(&self.bytes_saved, bytes);
            }
            (Direction::Restore, true) => {
                add(&self.restored_blocks, blocks);
                add(&self.bytes_restored, bytes);
            }
            (Direction::Save, false) => add(&self.save_failed_blocks, blocks),
            (Direction::Restore, false) => add(&self.restore_failed_blocks, blocks),
        }
    }

    /// Records a query that leased `hits` of `asked` keys.
    pub(crate) fn record_query(&self, asked: usize, hits: usize) {
        add(&self.queries, 1);
        add(&self.hit_blocks, hits as u64);
        add(&self.miss_blocks, (asked - hits) as u64);
    }
}

/// The index of direction `dir` in [`Counters::copy_latency`].
pub(crate) fn latency_index(dir: Direction) -> usize {
    match dir {
        Direction::Save => 0,
        Direction::Restore => 1,
    }
}

/// Stripes of a [`Count`]: one per thread number modulo this (two under loom, where a model has two
/// or three threads).
#[cfg(not(loom))]
const STRIPES: usize = 16;
#[cfg(loom)]
const STRIPES: usize = 2;

/// One of the tier's counters or gauges, spread over [`STRIPES`] cache-line-padded stripes so that
/// saves, commits and evictions on different cores do not all write one cache line (a save of 43
/// blocks that evicts 43 updates them about 300 times). A thread adds to its own stripe (its
/// [`crate::sync::thread_number`] modulo `STRIPES`); a read sums the stripes with wrapping
/// arithmetic, so a gauge's `+1` on one stripe and `-1` on another add up. A read racing updates
/// sees each stripe's value at some moment of the read, as a single relaxed counter's reader would
/// see one of its values; quiescent, the sum is exact. The one decision that reads them,
/// [`super::core::Core::available_slots`] (an all-or-nothing save's pre-check), takes a snapshot
/// either way: the slot acquisition after it is what decides.
pub(crate) struct Count(Box<[CachePadded<AtomicU64>]>);

impl Default for Count {
    fn default() -> Self {
        Count((0..STRIPES).map(|_| CachePadded::new(AtomicU64::new(0))).collect())
    }
}

impl Count {
    #[inline]
    fn stripe(&self) -> &AtomicU64 {
        &self.0[crate::sync::thread_number() % STRIPES]
    }

    /// The sum of the stripes (wrapping).
    #[inline]
    fn sum(&self) -> u64 {
        // Seeded bug (tests only): `count-reads-own-stripe` reads the caller's stripe alone.
        if crate::seeded::seeded("count-reads-own-stripe") {
            return self.stripe().load(Ordering::Relaxed);
        }
        self.0.iter().fold(0u64, |acc, c| acc.wrapping_add(c.load(Ordering::Relaxed)))
    }
}

/// Adds `n` to counter `c` (on the calling thread's stripe).
#[inline]
pub(crate) fn add(c: &Count, n: u64) {
    c.stripe().fetch_add(n, Ordering::Relaxed);
}

/// Subtracts `n` from gauge `c` (wrapping, on the calling thread's stripe).
#[inline]
pub(crate) fn sub(c: &Count, n: u64) {
    c.stripe().fetch_sub(n, Ordering::Relaxed);
}

/// A gauge's value: the stripes' sum read as signed and clamped at 0 (a `-1` may be seen before the
/// `+1` it follows).
#[inline]
pub(crate) fn gauge(c: &Count) -> u64 {
    (c.sum() as i64).max(0) as u64
}

/// A counter's value: the stripes' sum.
#[inline]
pub(crate) fn load(c: &Count) -> u64 {
    c.sum()
}

/// Slot counts by state, from `Core::audit`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AuditReport {
    /// `FREE` slots.
    pub free: usize,
    /// `WRITING` slots (quarantined ones included).
    pub writing: usize,
    /// `READY` slots.
    pub ready: usize,
    /// `EVICTING` slots (0 when quiescent).
    pub evicting: usize,
    /// Slots with at least one pin.
    pub pinned: usize,
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// Counts from more threads than there are stripes: every `+n` is in the sum, and a gauge raised
    /// on one thread and lowered on another reads its true value (0 after both). Seeded bug
    /// `count-reads-own-stripe`.
    #[test]
    fn a_striped_count_sums_every_threads_updates() {
        let (count, gauge_) = (Count::default(), Count::default());
        let threads = 3 * STRIPES;
        std::thread::scope(|s| {
            for t in 0..threads {
                let (count, gauge_) = (&count, &gauge_);
                s.spawn(move || {
                    add(count, t as u64 + 1);
                    add(gauge_, 2);
                });
            }
        });
        let expect = (threads * (threads + 1) / 2) as u64;
        assert_eq!(load(&count), expect, "the sum of every thread's adds");
        assert_eq!(gauge(&gauge_), 2 * threads as u64);
        // Lowered by other threads than those that raised it.
        std::thread::scope(|s| {
            for _ in 0..threads {
                s.spawn(|| sub(&gauge_, 2));
            }
        });
        assert_eq!(gauge(&gauge_), 0, "a gauge raised and lowered on different threads");
        sub(&gauge_, 1);
        assert_eq!(gauge(&gauge_), 0, "a gauge read below zero is clamped");
    }
}
