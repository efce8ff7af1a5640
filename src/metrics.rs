//! Prometheus metrics (feature `metrics`): the tier's counters as a `prometheus_client` collector
//! ([`HostTier::register_metrics`]), and whether the pool can still take a save ([`PoolHealth`]).
//!
//! Nothing is recorded for the metrics: a scrape takes one [`HostTier::stats`] snapshot (relaxed
//! loads of the counters the tier keeps anyway) and encodes it, so the tier's paths pay nothing
//! new. The copy latency histogram too is kept by the tier (`tier::stats::Latency`, two relaxed
//! adds a completed copy batch) and read at scrape time. One definition serves an engine that keeps the tier in process and the tier daemon
//! (`kvtierd --metrics`, which adds its own connection metrics: `server::metrics`). Every metric
//! and its meaning is listed in `docs/metrics.md`.

use crate::copy::Direction;
#[cfg(all(feature = "remote", not(loom)))]
use crate::error::Limit;
use crate::tier::stats::{latency_index, Latency, LatencySnapshot, LATENCY_BOUNDS_NS};
use crate::tier::{HostTier, TierStats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The `prometheus-client` crate this build uses: its `Registry` is what
/// [`HostTier::register_metrics`] takes, so an engine adds kvtier's metrics to its own endpoint
/// with the same version.
pub use prometheus_client;

/// The `tier` label of the tier's metrics (later tiers, SSD and peer, get their own value).
const TIER: (&str, &str) = ("tier", "host");

/// One family: its descriptor (`name`, `help`, `unit`, the type of `M`), then one sample per
/// label set. A counter's samples get the suffix `_total` from the encoder.
pub(crate) fn family<M: EncodeMetric>(
    enc: &mut DescriptorEncoder<'_>,
    name: &str,
    help: &str,
    unit: Option<&Unit>,
    samples: &[(&[(&str, &str)], M)],
) -> std::fmt::Result {
    let Some((_, first)) = samples.first() else { return Ok(()) };
    let mut m = enc.encode_descriptor(name, help, unit, first.metric_type())?;
    for (labels, v) in samples {
        v.encode(m.encode_family(labels)?)?;
    }
    Ok(())
}

/// A counter sample.
pub(crate) fn counter(v: u64) -> ConstCounter<u64> {
    ConstCounter::new(v)
}

/// A gauge sample.
pub(crate) fn gauge(v: u64) -> ConstGauge<i64> {
    ConstGauge::new(v.min(i64::MAX as u64) as i64)
}

/// A limit's label value: its variant's name in snake case (`Limit::KeysPerRequest` is
/// `keys_per_request`).
#[cfg(all(feature = "remote", not(loom)))]
pub(crate) fn limit_label(l: Limit) -> String {
    let mut out = String::new();
    for (i, c) in format!("{l:?}").chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// Reads a tier's counters at scrape time.
struct TierCollector {
    tier: HostTier,
}

impl std::fmt::Debug for TierCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierCollector").field("tier", &self.tier).finish()
    }
}

impl Collector for TierCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let stats = self.tier.try_stats();
        let t: &[(&str, &str)] = &[TIER];
        family(
            &mut enc,
            "kvtier_tier_up",
            "1 if the tier's counters could be read at this scrape; 0 if not (a connected tier whose \
             daemon is gone: the tier's other metrics are left out).",
            None,
            &[(t, gauge(stats.is_ok() as u64))],
        )?;
        match stats {
            Ok(s) => encode_tier(&mut enc, &s, self.tier.geometry().block_bytes(), self.tier.live_hints() as u64)?,
            Err(_) => return Ok(()),
        }
        // The copy latency histogram lives where the copies are counted: an in-process tier's
        // core (the tier daemon's included, fed by its clients' reports). A connected tier's
        // daemon serves it.
        match self.tier.in_process_core() {
            Some(core) => {
                encode_latency(&mut enc, &core.counters.copy_latency)?;
                encode_eviction_lock(&mut enc, &core.eviction_lock_stats())?;
                match crate::tier::ssd::SsdTier::of(core) {
                    Some(ssd) => encode_ssd(&mut enc, &ssd.stats()),
                    None => Ok(()),
                }
            }
            None => Ok(()),
        }
    }
}

/// One histogram sample: a [`LatencySnapshot`] in seconds.
#[derive(Debug)]
struct LatencyHistogram(LatencySnapshot);

impl EncodeMetric for LatencyHistogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> std::fmt::Result {
        let h = &self.0;
        let buckets: Vec<(f64, u64)> = LATENCY_BOUNDS_NS
            .iter()
            .map(|&ns| ns as f64 / 1e9)
            .chain(std::iter::once(f64::INFINITY))
            .zip(h.buckets)
            .collect();
        encoder.encode_histogram::<NoLabelSet>(h.sum_ns as f64 / 1e9, h.count(), &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

/// Encodes `kvtier_copy_latency_seconds`, one histogram per direction.
fn encode_latency(enc: &mut DescriptorEncoder<'_>, latency: &[Latency; 2]) -> std::fmt::Result {
    let sample = |dir| LatencyHistogram(latency[latency_index(dir)].snapshot());
    family(
        enc,
        "kvtier_copy_latency",
        "Queue-to-completion time of completed copies, by direction: save (GPU to host), restore \
         (host to GPU); from the copy's submission to the backend's completion (one observation a \
         copy batch).",
        Some(&Unit::Seconds),
        &[
            (&[TIER, ("direction", "save")], sample(Direction::Save)),
            (&[TIER, ("direction", "restore")], sample(Direction::Restore)),
        ],
    )
}

/// Encodes the eviction lock's use `e`: its holds, and the seconds waited for it and held.
fn encode_eviction_lock(enc: &mut DescriptorEncoder<'_>, e: &crate::tier::EvictionLockStats) -> std::fmt::Result {
    let t: &[(&str, &str)] = &[TIER];
    let seconds = |ns: u64| ConstCounter::new(ns as f64 / 1e9);
    family(
        enc,
        "kvtier_eviction_lock_holds",
        "Times the eviction lock was taken: by saves and SSD promotions that needed more slots than \
         were free, and by asked-for evictions.",
        None,
        &[(t, counter(e.holds))],
    )?;
    family(
        enc,
        "kvtier_eviction_lock_wait",
        "Time spent waiting for the eviction lock, summed over its holds.",
        Some(&Unit::Seconds),
        &[(t, seconds(e.wait_ns))],
    )?;
    family(
        enc,
        "kvtier_eviction_lock_held",
        "Time the eviction lock was held (victim selection and claims), summed over its holds: \
         divided by the holds, the serial cost of a save that evicts when selections run one at a \
         time (shared holds of selections beside each other overlap).",
        Some(&Unit::Seconds),
        &[(t, seconds(e.held_ns))],
    )
}

/// Encodes the SSD tier's figures `s` ([`crate::SsdStats`]) as `kvtier_ssd_*` families (only a
/// tier with an SSD tier has them).
fn encode_ssd(enc: &mut DescriptorEncoder<'_>, s: &crate::SsdStats) -> std::fmt::Result {
    let t: &[(&str, &str)] = &[TIER];
    let gauges: [(&str, &str, u64); 3] = [
        ("kvtier_ssd_capacity_blocks", "Disk slots over every SSD file.", s.capacity),
        ("kvtier_ssd_blocks", "Blocks on disk now.", s.blocks),
        ("kvtier_ssd_demotions_pending", "Demotions still queued or being written.", s.demotions_pending),
    ];
    for (name, help, v) in gauges {
        family(enc, name, help, None, &[(t, gauge(v))])?;
    }
    let counters: [(&str, &str, Option<&Unit>, u64); 14] = [
        (
            "kvtier_ssd_recovered_blocks",
            "Blocks found again by the scans when the files were opened.",
            None,
            s.recovered_blocks,
        ),
        (
            "kvtier_ssd_recovered_torn",
            "Slots the opening scans found torn or corrupted (now free).",
            None,
            s.recovered_torn,
        ),
        (
            "kvtier_ssd_recovered_foreign",
            "Slots the opening scans found holding another namespace's or slot's block (now free).",
            None,
            s.recovered_foreign,
        ),
        ("kvtier_ssd_demoted_blocks", "Host blocks written to disk.", None, s.demoted_blocks),
        ("kvtier_ssd_demoted", "Payload bytes written by demotions.", Some(&Unit::Bytes), s.bytes_demoted),
        (
            "kvtier_ssd_demotions_skipped",
            "Queued demotions not done: the block was evicted or already on disk.",
            None,
            s.demotions_skipped,
        ),
        ("kvtier_ssd_demotions_dropped", "Demotions not queued because the queue was full.", None, s.demotions_dropped),
        (
            "kvtier_ssd_demotion_failures",
            "Demotions whose write failed (the block stays on the host only).",
            None,
            s.demotion_failures,
        ),
        ("kvtier_ssd_promoted_blocks", "Blocks read back into host slots by queries.", None, s.promoted_blocks),
        ("kvtier_ssd_promoted", "Payload bytes read by promotions.", Some(&Unit::Bytes), s.bytes_promoted),
        (
            "kvtier_ssd_promotion_failures",
            "Blocks a promotion found unverified, and failed reads.",
            None,
            s.promotion_failures,
        ),
        ("kvtier_ssd_disk_evictions", "Disk blocks evicted to make room for demotions.", None, s.disk_evictions),
        ("kvtier_ssd_io_direct", "SSD transfers done with O_DIRECT.", None, s.io_direct),
        ("kvtier_ssd_io_buffered", "SSD transfers done through the page cache.", None, s.io_buffered),
    ];
    for (name, help, unit, v) in counters {
        family(enc, name, help, unit, &[(t, counter(v))])?;
    }
    Ok(())
}

/// Encodes the families of one tier's counters `s` (blocks of `block_bytes` payload bytes, `hints`
/// live scheduler hints).
fn encode_tier(enc: &mut DescriptorEncoder<'_>, s: &TierStats, block_bytes: u64, hints: u64) -> std::fmt::Result {
    let t: &[(&str, &str)] = &[TIER];
    let hits = if crate::seeded::seeded("metrics-hits-from-misses") { s.miss_blocks } else { s.hit_blocks };
    family(enc, "kvtier_queries", "Queries answered.", None, &[(t, counter(s.queries))])?;
    family(enc, "kvtier_hit_blocks", "Blocks found by queries (leased).", None, &[(t, counter(hits))])?;
    family(
        enc,
        "kvtier_miss_blocks",
        "Keys queried but not leased (not resident, or after the first miss).",
        None,
        &[(t, counter(s.miss_blocks))],
    )?;
    family(
        enc,
        "kvtier_hit",
        "Payload bytes of the blocks found by queries (hit blocks x block bytes).",
        Some(&Unit::Bytes),
        &[(t, counter(hits.saturating_mul(block_bytes)))],
    )?;
    family(
        enc,
        "kvtier_miss",
        "Payload bytes of the keys queried but not leased (miss blocks x block bytes).",
        Some(&Unit::Bytes),
        &[(t, counter(s.miss_blocks.saturating_mul(block_bytes)))],
    )?;
    family(
        enc,
        "kvtier_save_blocks",
        "Keys named by saves, by outcome: saved (copied and made ready), skipped_resident (already \
         resident, recency refreshed), skipped_in_flight (another save of it in flight), \
         skipped_duplicate (earlier in the same save), dropped (Fit::Prefix: did not fit or not \
         admitted), failed (the copy failed; never made visible).",
        None,
        &[
            (&[TIER, ("outcome", "saved")], counter(s.saved_blocks)),
            (&[TIER, ("outcome", "skipped_resident")], counter(s.save_skipped_resident)),
            (&[TIER, ("outcome", "skipped_in_flight")], counter(s.save_skipped_in_flight)),
            (&[TIER, ("outcome", "skipped_duplicate")], counter(s.save_skipped_duplicate)),
            (&[TIER, ("outcome", "dropped")], counter(s.save_dropped)),
            (&[TIER, ("outcome", "failed")], counter(s.save_failed_blocks)),
        ],
    )?;
    family(
        enc,
        "kvtier_saves_refused",
        "Saves refused whole (CannotFit or PoolExhausted): nothing of them was saved.",
        None,
        &[(t, counter(s.saves_refused))],
    )?;
    family(
        enc,
        "kvtier_restore_blocks",
        "Blocks of restores whose copy finished, by outcome: restored (copied host to GPU), failed \
         (the copy failed).",
        None,
        &[
            (&[TIER, ("outcome", "restored")], counter(s.restored_blocks)),
            (&[TIER, ("outcome", "failed")], counter(s.restore_failed_blocks)),
        ],
    )?;
    family(
        enc,
        "kvtier_evicted_blocks",
        "Blocks evicted, by reason: capacity (a save needed the slot), explicit (asked for: \
         HostTier::evict, a connected tier's included).",
        None,
        &[
            (&[TIER, ("reason", "capacity")], counter(s.evictions.saturating_sub(s.explicit_evictions))),
            (&[TIER, ("reason", "explicit")], counter(s.explicit_evictions)),
        ],
    )?;
    family(
        enc,
        "kvtier_copy",
        "Payload bytes copied by completed copies, by direction: save (GPU to host), restore (host \
         to GPU).",
        Some(&Unit::Bytes),
        &[
            (&[TIER, ("direction", "save")], counter(s.bytes_saved)),
            (&[TIER, ("direction", "restore")], counter(s.bytes_restored)),
        ],
    )?;
    family(
        enc,
        "kvtier_leases_expired",
        "Leases settled by the tier because they outlived the lease time-to-live.",
        None,
        &[(t, counter(s.expired_leases))],
    )?;
    // Disjoint states: pinned slots are READY, quarantined ones WRITING; `ready` and `writing` are
    // the rest of each.
    let ready = s.ready_slots.saturating_sub(s.pinned_slots);
    family(
        enc,
        "kvtier_slots",
        "Slots of the pool by state (disjoint; they sum to kvtier_pool_slots but for transitions \
         under way): free (on the free list), writing (reserved by saves in flight), quarantined \
         (withheld WRITING: a copy whose outcome is unknown, or the saves of a disconnected \
         process until it exits), ready (holding a block, unpinned: evictable), evicting (claimed \
         by an evictor, evicted or given back within the eviction), pinned (holding a block with \
         at least one pin: a lease or a restore).",
        None,
        &[
            (&[TIER, ("state", "free")], gauge(s.free_slots)),
            (&[TIER, ("state", "writing")], gauge(s.writing_slots)),
            (&[TIER, ("state", "quarantined")], gauge(s.quarantined_slots)),
            (&[TIER, ("state", "ready")], gauge(ready)),
            (&[TIER, ("state", "evicting")], gauge(s.evicting_slots)),
            (&[TIER, ("state", "pinned")], gauge(s.pinned_slots)),
        ],
    )?;
    family(enc, "kvtier_pool_slots", "Slots in the pool (one block each).", None, &[(t, gauge(s.capacity))])?;
    family(
        enc,
        "kvtier_slot",
        "Bytes of one slot's payload (one block).",
        Some(&Unit::Bytes),
        &[(t, gauge(block_bytes))],
    )?;
    family(enc, "kvtier_index_entries", "Entries in the content index.", None, &[(t, gauge(s.index_entries))])?;
    family(
        enc,
        "kvtier_quarantined_pins",
        "Pins kept because a restore's copy outcome is unknown (or its process, disconnected, has \
         not exited yet); their slots stay pinned.",
        None,
        &[(t, gauge(s.quarantined_pins))],
    )?;
    family(enc, "kvtier_leases", "Leases not yet settled.", None, &[(t, gauge(s.live_leases))])?;
    family(
        enc,
        "kvtier_lease_oldest_age",
        "Age of the oldest unsettled lease (tracked only with a lease time-to-live; 0 otherwise or \
         when there is none).",
        Some(&Unit::Seconds),
        &[(t, ConstGauge::new(s.oldest_lease_age_ms as f64 / 1e3))],
    )?;
    family(enc, "kvtier_hints", "Scheduler hints live (given, not withdrawn or expired).", None, &[(t, gauge(hints))])
}

impl HostTier {
    /// Adds this tier's metrics to `registry` (see `docs/metrics.md` for each): hits and misses
    /// (blocks and bytes), saves by outcome, restores, evictions, slots by state, leases, hints,
    /// copy bytes per direction and the copy latency histogram (`kvtier_copy_latency_seconds`,
    /// queue-to-completion seconds per direction), each with the label `tier="host"`, read from the
    /// tier's counters at every scrape (nothing is recorded for them). Register once per tier; the registry keeps
    /// a handle on the tier (a clone), so the tier lives as long as the registry.
    ///
    /// A connected tier ([`HostTier::connect`], feature `remote`) reports its daemon's tier, one
    /// round trip per scrape, all but the copy latency histogram (the daemon serves it); while the
    /// daemon is gone `kvtier_tier_up` is 0 and the others are left out.
    ///
    /// # Examples
    ///
    /// ```
    /// use kvtier::prometheus_client::{encoding::text::encode, registry::Registry};
    /// use kvtier::{ArenaSpec, Geometry, HostTier, TierConfig};
    ///
    /// let geometry = Geometry::new("doc", 16, vec![ArenaSpec::packed("kv", 4096, 8)])?;
    /// let tier = HostTier::new(TierConfig::new(geometry, 1 << 20))?;
    /// let mut registry = Registry::default(); // the engine's own registry
    /// tier.register_metrics(&mut registry);
    /// let mut text = String::new();
    /// encode(&mut text, &registry)?; // OpenMetrics text, what a /metrics endpoint answers
    /// assert!(text.contains("kvtier_hit_blocks_total{tier=\"host\"} 0"));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
    pub fn register_metrics(&self, registry: &mut Registry) {
        registry.register_collector(Box::new(TierCollector { tier: self.clone() }));
    }
}

/// Whether a tier's pool can take a save: a save needs a free slot or an evictable one (ready,
/// unpinned). [`PoolHealth::check`] samples the tier's counters and reports
/// [`Health::Exhausted`] while the pool has had neither, with how long; it is unhealthy once that
/// has lasted longer than the bound (every slot pinned by leases nobody settles, or held by saves
/// that never finish). `kvtierd --metrics` answers `/healthz` with it.
pub struct PoolHealth {
    tier: HostTier,
    bound: Duration,
    /// When the samples began to find no free or evictable slot.
    exhausted_since: Mutex<Option<Instant>>,
}

/// What [`PoolHealth::check`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Health {
    /// The pool has `slots` slots free or evictable (ready, unpinned): a save can get a slot.
    Available {
        /// Free plus ready-and-unpinned slots.
        slots: u64,
    },
    /// No slot has been free or evictable for `duration` (since the first sample that found none):
    /// healthy while `duration` is within `bound`.
    Exhausted {
        /// How long the samples have found no free or evictable slot.
        duration: Duration,
        /// The bound beyond which that is unhealthy.
        bound: Duration,
        /// Slots with at least one pin.
        pinned: u64,
        /// Slots reserved by saves in flight.
        writing: u64,
        /// Slots withheld for good or until a disconnected process exits.
        quarantined: u64,
        /// Slots in the pool.
        capacity: u64,
    },
    /// The tier's counters could not be read (a connected tier whose daemon is gone).
    Unreachable {
        /// Why.
        reason: String,
    },
}

impl Health {
    /// True for [`Health::Available`], and for [`Health::Exhausted`] within its bound.
    pub fn is_healthy(&self) -> bool {
        match self {
            Health::Available { .. } => true,
            Health::Exhausted { .. } if crate::seeded::seeded("healthz-ignores-exhaustion") => true,
            Health::Exhausted { duration, bound, .. } => duration <= bound,
            Health::Unreachable { .. } => false,
        }
    }
}

impl std::fmt::Display for Health {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let verdict = if self.is_healthy() { "ok" } else { "unhealthy" };
        match self {
            Health::Available { slots } => write!(f, "{verdict}: {slots} slots free or evictable"),
            Health::Exhausted { duration, bound, pinned, writing, quarantined, capacity } => write!(
                f,
                "{verdict}: no slot free or evictable for {:.3} s (bound {:.3} s): of {capacity} slots {pinned} \
                 pinned, {writing} being written, {quarantined} quarantined",
                duration.as_secs_f64(),
                bound.as_secs_f64()
            ),
            Health::Unreachable { reason } => write!(f, "{verdict}: the tier's counters cannot be read: {reason}"),
        }
    }
}

impl PoolHealth {
    /// Watches `tier`'s pool; [`Health::Exhausted`] lasting longer than `bound` is unhealthy. The
    /// watch holds a handle on the tier (a clone).
    pub fn new(tier: &HostTier, bound: Duration) -> PoolHealth {
        PoolHealth { tier: tier.clone(), bound, exhausted_since: Mutex::new(None) }
    }

    /// The bound given to [`PoolHealth::new`].
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Samples the tier's counters now (one [`HostTier::try_stats`]). How long the pool has been
    /// exhausted is measured from the first sample that found it so: sample at least as often as
    /// the precision wanted (`kvtierd` samples every quarter of the bound, at most every second).
    pub fn check(&self) -> Health {
        match self.tier.try_stats() {
            Ok(s) => self.check_at(&s, Instant::now()),
            Err(e) => Health::Unreachable { reason: e.to_string() },
        }
    }

    /// [`PoolHealth::check`] of the counters `s` sampled at `now`.
    pub(crate) fn check_at(&self, s: &TierStats, now: Instant) -> Health {
        let slots = s.free_slots + s.ready_slots.saturating_sub(s.pinned_slots);
        let mut since = self.exhausted_since.lock().unwrap_or_else(|p| p.into_inner());
        if slots > 0 {
            *since = None;
            return Health::Available { slots };
        }
        let t0 = *since.get_or_insert(now);
        Health::Exhausted {
            duration: now.saturating_duration_since(t0),
            bound: self.bound,
            pinned: s.pinned_slots,
            writing: s.writing_slots,
            quarantined: s.quarantined_slots,
            capacity: s.capacity,
        }
    }
}

impl std::fmt::Debug for PoolHealth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PoolHealth").field("bound", &self.bound).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::copy::host::MemcpyArenas;
    use crate::copy::{EngineArenas, WaitFor};
    use crate::geometry::{ArenaSpec, Geometry};
    use crate::slab::pool::BackingChoice;
    use crate::tier::TierConfig;
    use std::collections::HashMap;

    /// The samples of an OpenMetrics text, `name{labels}` to value; checks that every sample's
    /// family has a `# HELP` with text and a `# TYPE`, and that the text ends with `# EOF`.
    fn parse(text: &str) -> HashMap<String, f64> {
        let (mut help, mut types, mut samples) = (HashMap::new(), HashMap::new(), HashMap::new());
        assert!(text.ends_with("# EOF\n"), "no EOF marker: {text}");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, h) = rest.split_once(' ').expect("HELP name text");
                assert!(!h.trim().is_empty(), "{name} has an empty help");
                help.insert(name.to_string(), h.to_string());
            } else if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, t) = rest.split_once(' ').expect("TYPE name type");
                types.insert(name.to_string(), t.to_string());
            } else if line.starts_with('#') {
                continue;
            } else {
                let (series, v) = line.rsplit_once(' ').expect("a sample: series value");
                let name = series.split('{').next().unwrap();
                let fam = types
                    .keys()
                    .find(|f| {
                        let suffix = |x: &str| name.strip_suffix(x) == Some(f.as_str());
                        name == f.as_str()
                            || (types[*f] == "counter" && suffix("_total"))
                            || (types[*f] == "histogram" && (suffix("_bucket") || suffix("_sum") || suffix("_count")))
                    })
                    .unwrap_or_else(|| panic!("sample {series} has no # TYPE before it"));
                assert!(help.contains_key(fam), "family {fam} has no # HELP");
                if types[fam] == "counter" {
                    assert!(name.ends_with("_total"), "counter sample {name} without _total");
                }
                samples.insert(series.to_string(), v.parse::<f64>().expect("a number"));
            }
        }
        assert_eq!(help.len(), types.len(), "every # HELP has a # TYPE and back");
        samples
    }

    fn tier(slots: u64) -> (HostTier, std::sync::Arc<MemcpyArenas>, crate::Rank) {
        let g = Geometry::new("metrics-unit", 16, vec![ArenaSpec::packed("a", 256, 16)]).unwrap();
        let cfg = TierConfig::new(g.clone(), slots * g.slot_bytes()).with_backing(BackingChoice::Plain);
        let tier = HostTier::new(cfg).unwrap();
        let arenas = std::sync::Arc::new(MemcpyArenas::new(&g).unwrap());
        let rank = tier.attach(arenas.backend().unwrap()).unwrap();
        (tier, arenas, rank)
    }

    fn scrape(registry: &Registry) -> HashMap<String, f64> {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, registry).unwrap();
        parse(&text)
    }

    #[test]
    fn a_scrape_reports_the_tiers_own_counters() {
        let (tier, arenas, rank) = tier(8);
        let mut registry = Registry::default();
        tier.register_metrics(&mut registry);
        let k: Vec<_> = (0..6).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
        arenas.fill(&[0, 1, 2, 3], &k[..4]).unwrap();
        rank.save(&k[..4], &[0, 1, 2, 3], WaitFor::Nothing).unwrap().handle.wait().unwrap();
        // Two resident keys again: skipped.
        rank.save(&k[..2], &[0, 1], WaitFor::Nothing).unwrap().handle.wait().unwrap();
        let lease = tier.query(&k); // 4 hits, 2 misses
        rank.restore(&lease, &[8, 9, 10, 11], WaitFor::Nothing).unwrap().wait().unwrap();
        let held = tier.query(&k[..3]); // 3 hits, held: 3 slots pinned
        let s = tier.stats();
        let m = scrape(&registry);
        let bb = tier.geometry().block_bytes() as f64;
        let v = |series: &str| *m.get(series).unwrap_or_else(|| panic!("no sample {series} in {m:?}"));
        assert_eq!((s.hit_blocks, s.miss_blocks, s.saved_blocks, s.restored_blocks), (7, 2, 4, 4));
        assert_eq!(v("kvtier_hit_blocks_total{tier=\"host\"}"), s.hit_blocks as f64, "hit blocks");
        assert_eq!(v("kvtier_miss_blocks_total{tier=\"host\"}"), s.miss_blocks as f64);
        assert_eq!(v("kvtier_hit_bytes_total{tier=\"host\"}"), s.hit_blocks as f64 * bb);
        assert_eq!(v("kvtier_miss_bytes_total{tier=\"host\"}"), s.miss_blocks as f64 * bb);
        assert_eq!(v("kvtier_queries_total{tier=\"host\"}"), s.queries as f64);
        assert_eq!(v("kvtier_save_blocks_total{tier=\"host\",outcome=\"saved\"}"), s.saved_blocks as f64);
        assert_eq!(v("kvtier_save_blocks_total{tier=\"host\",outcome=\"skipped_resident\"}"), 2.0);
        assert_eq!(v("kvtier_restore_blocks_total{tier=\"host\",outcome=\"restored\"}"), s.restored_blocks as f64);
        assert_eq!(v("kvtier_copy_bytes_total{tier=\"host\",direction=\"save\"}"), s.bytes_saved as f64);
        assert_eq!(v("kvtier_copy_bytes_total{tier=\"host\",direction=\"restore\"}"), s.bytes_restored as f64);
        assert_eq!(s.bytes_saved as f64, 4.0 * bb);
        assert_eq!(v("kvtier_slots{tier=\"host\",state=\"pinned\"}"), 3.0);
        assert_eq!(v("kvtier_slots{tier=\"host\",state=\"ready\"}"), 1.0);
        assert_eq!(v("kvtier_slots{tier=\"host\",state=\"free\"}"), 4.0);
        assert_eq!(v("kvtier_leases{tier=\"host\"}"), 1.0);
        assert_eq!(v("kvtier_pool_slots{tier=\"host\"}"), 8.0);
        assert_eq!(v("kvtier_tier_up{tier=\"host\"}"), 1.0);
        drop(held);
        assert_eq!(scrape(&registry)["kvtier_slots{tier=\"host\",state=\"pinned\"}"], 0.0, "read at each scrape");
    }

    #[test]
    fn the_copy_latency_histogram_counts_each_completed_copy_in_its_direction() {
        let (tier, arenas, rank) = tier(8);
        let mut registry = Registry::default();
        tier.register_metrics(&mut registry);
        let k: Vec<_> = (0..5).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
        // 5 saves of one block each, then 3 restores (one of two blocks).
        for (i, key) in k.iter().enumerate() {
            arenas.fill(&[i as u64], std::slice::from_ref(key)).unwrap();
            rank.save(std::slice::from_ref(key), &[i as u64], WaitFor::Nothing).unwrap().handle.wait().unwrap();
        }
        for pages in [&[8u64][..], &[9, 10], &[11]] {
            let lease = tier.query(&k[..pages.len()]);
            rank.restore(&lease, pages, WaitFor::Nothing).unwrap().wait().unwrap();
        }
        // A resident key again: nothing copied, no observation.
        let again = rank.save(&k[..1], &[0], WaitFor::Nothing).unwrap();
        assert!(again.saving.is_empty());
        let m = scrape(&registry);
        let v = |series: &str| *m.get(series).unwrap_or_else(|| panic!("no sample {series} in {m:?}"));
        let h = "kvtier_copy_latency_seconds";
        for (dir, n) in [("save", 5.0), ("restore", 3.0)] {
            let l = format!("{{tier=\"host\",direction=\"{dir}\"}}");
            assert_eq!(v(&format!("{h}_count{l}")), n, "{dir} copies observed: one a completed copy");
            let inf = format!("{h}_bucket{{le=\"+Inf\",tier=\"host\",direction=\"{dir}\"}}");
            assert_eq!(v(&inf), n, "the +Inf bucket counts every {dir} copy");
            assert!(v(&format!("{h}_sum{l}")) > 0.0, "{dir} copies took some time");
            // Cumulative buckets: never decreasing up to +Inf.
            let mut le: Vec<(f64, f64)> = m
                .iter()
                .filter_map(|(series, &c)| {
                    let rest = series.strip_prefix(&format!("{h}_bucket{{le=\""))?;
                    let b = rest.strip_suffix(&format!("\",tier=\"host\",direction=\"{dir}\"}}"))?;
                    Some((if b == "+Inf" { f64::INFINITY } else { b.parse().unwrap() }, c))
                })
                .collect();
            le.sort_by(|a, b| a.0.total_cmp(&b.0));
            assert_eq!(le.len(), LATENCY_BOUNDS_NS.len() + 1, "{le:?}");
            assert!(le.windows(2).all(|w| w[0].1 <= w[1].1), "buckets are cumulative: {le:?}");
        }
    }

    #[test]
    fn evictions_are_counted_by_reason_and_claimed_slots_as_evicting() {
        let (tier, arenas, rank) = tier(4);
        let mut registry = Registry::default();
        tier.register_metrics(&mut registry);
        let k: Vec<_> = (0..7).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
        arenas.fill(&[0, 1, 2, 3, 4, 5], &k[..6]).unwrap();
        rank.save(&k[..4], &[0, 1, 2, 3], WaitFor::Nothing).unwrap().handle.wait().unwrap();
        // The pool is full: two saved blocks need two evicted (capacity).
        rank.save(&k[4..6], &[4, 5], WaitFor::Nothing).unwrap().handle.wait().unwrap();
        assert_eq!(tier.evict(1), 1, "one asked for (explicit)");
        let v = |m: &HashMap<String, f64>, series: &str| {
            *m.get(series).unwrap_or_else(|| panic!("no sample {series} in {m:?}"))
        };
        let m = scrape(&registry);
        let s = tier.stats();
        assert_eq!((s.evictions, s.explicit_evictions), (3, 1), "evictions in all, and the explicit ones");
        assert_eq!(v(&m, "kvtier_evicted_blocks_total{tier=\"host\",reason=\"capacity\"}"), 2.0, "evicted for saves");
        assert_eq!(v(&m, "kvtier_evicted_blocks_total{tier=\"host\",reason=\"explicit\"}"), 1.0, "evicted when asked");
        assert_eq!(v(&m, "kvtier_slots{tier=\"host\",state=\"evicting\"}"), 0.0, "no eviction under way");
        // The saves' and the asked-for eviction's holds of the eviction lock: the first save fitted
        // in the free slots (no hold), the second evicted (one), then `evict` (one).
        assert_eq!(v(&m, "kvtier_eviction_lock_holds_total{tier=\"host\"}"), 2.0, "two holds");
        assert!(v(&m, "kvtier_eviction_lock_held_seconds_total{tier=\"host\"}") > 0.0, "held for some time");
        assert!(v(&m, "kvtier_eviction_lock_wait_seconds_total{tier=\"host\"}") >= 0.0);
        // An eviction under way: two blocks claimed (EVICTING), counted apart from the ready ones.
        let core = tier.core().clone();
        let lock = core.lock_eviction();
        let mut claims = crate::tier::evictor::Claims::new(&core);
        assert_eq!(claims.claim(2), 2);
        let m = scrape(&registry);
        assert_eq!(v(&m, "kvtier_slots{tier=\"host\",state=\"evicting\"}"), 2.0, "claimed slots are evicting");
        assert_eq!(v(&m, "kvtier_slots{tier=\"host\",state=\"ready\"}"), 1.0, "the claimed slots are not ready");
        drop(claims); // given back: nothing evicted
        drop(lock);
        let m = scrape(&registry);
        assert_eq!(v(&m, "kvtier_slots{tier=\"host\",state=\"evicting\"}"), 0.0, "given back");
        assert_eq!(v(&m, "kvtier_slots{tier=\"host\",state=\"ready\"}"), 3.0);
        assert_eq!(v(&m, "kvtier_evicted_blocks_total{tier=\"host\",reason=\"capacity\"}"), 2.0);
    }

    #[test]
    fn a_pool_exhausted_beyond_the_bound_is_unhealthy_and_healthy_again_once_a_slot_is_free() {
        let (tier, arenas, rank) = tier(2);
        let bound = Duration::from_millis(500);
        let health = PoolHealth::new(&tier, bound);
        let t0 = Instant::now();
        assert!(matches!(health.check_at(&tier.stats(), t0), Health::Available { slots: 2 }));
        let k: Vec<_> = (0..2).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
        arenas.fill(&[0, 1], &k).unwrap();
        rank.save(&k, &[0, 1], WaitFor::Nothing).unwrap().handle.wait().unwrap();
        let lease = tier.query(&k); // every slot pinned
        let s = tier.stats();
        let at = |d: u64| health.check_at(&s, t0 + Duration::from_millis(d));
        let first = at(1000);
        assert!(matches!(first, Health::Exhausted { duration, pinned: 2, .. } if duration.is_zero()), "{first:?}");
        assert!(at(1500).is_healthy(), "exhausted for exactly the bound: still healthy");
        let late = at(1501);
        assert!(!late.is_healthy(), "exhausted for longer than the bound must be unhealthy: {late}");
        assert!(late.to_string().contains("2 pinned"), "{late}");
        drop(lease);
        let again = health.check_at(&tier.stats(), t0 + Duration::from_millis(2000));
        assert!(again.is_healthy() && matches!(again, Health::Available { slots: 2 }), "{again:?}");
        // The exhaustion clock starts over.
        assert!(at(2600).is_healthy(), "a new exhaustion is measured from its own first sample");
    }

    #[test]
    #[cfg(all(feature = "remote", not(loom)))]
    fn limit_labels_are_snake_case() {
        assert_eq!(limit_label(Limit::KeysPerRequest), "keys_per_request");
        assert_eq!(limit_label(Limit::FrameBytes), "frame_bytes");
    }
}
