//! `kvtier simulate --ssd`: page hit ratios of a host pool over an SSD tier (two levels), beside the
//! host pool alone and an unbounded cache.
//!
//! The SSD level is modelled as the SSD tier is designed: its disk slots are managed by the same
//! slot, index and policy code as the host pool's, so it is a second real [`kvtier::HostTier`]
//! (`Level`) with as many slots as an SSD slot file of the given size holds
//! ([`kvtier::Geometry::disk_slots`]: a 4 KiB header, then slots of
//! [`kvtier::Geometry::disk_slot_bytes`]).
//!
//! Per request, with page keys `k` (`n` pages), in trace order:
//! 1. the host query leases the resident prefix `k[..h]` (host hits);
//! 2. the SSD query continues it: the resident prefix `k[h..h + d]` of the SSD level (SSD hits,
//!    the pages a promotion reads);
//! 3. the host saves `k[h..n]` as the host-only run does: the `d` promoted pages and the missing
//!    ones;
//! 4. every page's use count goes up by one; the leading pages used at least `admit` times (the
//!    admission rule, 2 by default: a block seen once is never written to the drive) that the SSD
//!    level lacks are demoted: saved to it, evicting by its policy.
//!
//! Demotion happens at the request that makes a block eligible, where the tier writes back a cold
//! block later, before its host eviction; the SSD level's recency therefore counts from a block's
//! admission, a little older than the tier's. The host level is the same as a host-only run's at the
//! same size; the SSD level only adds hits.

use super::{ratio, HintQueue, Level, Variant};
use crate::error::Error;
use ahash::AHashMap as HashMap;
use ahash::AHashSet as HashSet;
use kvtier::{ContentKey, Geometry};
use serde::Serialize;
use std::time::Instant;

/// One variant at one host pool size over one SSD tier size.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TwoLevelRun {
    /// The variant's label ([`Variant::label`]), the same policy on both levels.
    pub policy: String,
    /// Host pool size in slots.
    pub host_slots: u32,
    /// SSD tier size in disk slots.
    pub ssd_slots: u32,
    /// Pages found in the host pool.
    pub host_hit_pages: u64,
    /// Pages found on the SSD after the host prefix (promoted into the host pool).
    pub ssd_hit_pages: u64,
    /// `host_hit_pages / pages`.
    pub host_hit_ratio: f64,
    /// `ssd_hit_pages / pages`.
    pub ssd_hit_ratio: f64,
    /// `(host_hit_pages + ssd_hit_pages) / pages`: the two-level page hit ratio.
    pub hit_ratio: f64,
    /// Pages written to the SSD (demoted).
    pub demoted_pages: u64,
    /// Blocks the SSD level's policy evicted.
    pub ssd_evictions: u64,
    /// Eligible pages the SSD level refused (did not fit).
    pub ssd_dropped_pages: u64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
}

/// Runs `variant` on a host pool of `host_slots` slots over an SSD level of `ssd_slots` slots,
/// with demotion after `admit` uses (at least 1), over `keys` (one key list per request), calling
/// `progress(1)` after each request.
///
/// # Errors
/// [`Error::Config`] if `admit` is 0; pool mapping errors; tier errors other than a refused save.
pub fn run_two_level(
    keys: &[Vec<ContentKey>],
    variant: Variant,
    host_slots: u32,
    ssd_slots: u32,
    admit: u32,
    geometry: &Geometry,
    progress: &dyn Fn(u64),
) -> Result<TwoLevelRun, Error> {
    if admit == 0 {
        return Err(Error::Config("the SSD admission threshold is a number of uses, at least 1".into()));
    }
    let max_pages = keys.iter().map(|k| k.len()).max().unwrap_or(1) as u64;
    let host = Level::new(geometry, max_pages, host_slots, variant)?;
    let ssd = Level::new(geometry, max_pages, ssd_slots, variant)?;
    let mut uses: HashMap<ContentKey, u32> = HashMap::new();
    let (mut host_hits, mut ssd_hits, mut demoted, mut refused) = (0u64, 0u64, 0u64, 0u64);
    let mut queue = HintQueue::new(variant.lookahead);
    let t0 = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        let n = k.len();
        queue.admit(&host.tier, i, keys.len(), |j| keys[j].clone());
        let (h, _) = host.query(k, 0)?;
        host_hits += h as u64;
        if h < n {
            let (d, _) = ssd.query(&k[h..], h)?;
            ssd_hits += d as u64;
            host.save(k, h, n)?;
        }
        // The leading pages now used `admit` times or more.
        let mut eligible = 0;
        for (j, key) in k.iter().enumerate() {
            let c = uses.entry(*key).or_insert(0);
            *c = c.saturating_add(1);
            let admitted = if crate::seeded::seeded("ssd-admits-any-use") { *c >= 1 } else { *c >= admit };
            if admitted && eligible == j {
                eligible = j + 1;
            }
        }
        // Demote each run of eligible pages the SSD lacks.
        let mut j = 0;
        while j < eligible {
            let from = j;
            while j < eligible && !ssd.tier.contains(&k[j]) {
                j += 1;
            }
            if j == from {
                j += 1; // k[j] is on the SSD already
                continue;
            }
            let s = ssd.save(k, from, j)?;
            demoted += (j - from) as u64 - s.dropped;
            refused += s.dropped;
        }
        progress(1);
    }
    let wall = t0.elapsed();
    let ssd_evictions = ssd.evictions();
    host.close()?;
    ssd.close()?;
    let total: u64 = keys.iter().map(|k| k.len() as u64).sum();
    Ok(TwoLevelRun {
        policy: variant.label(),
        host_slots,
        ssd_slots,
        host_hit_pages: host_hits,
        ssd_hit_pages: ssd_hits,
        host_hit_ratio: ratio(host_hits, total),
        ssd_hit_ratio: ratio(ssd_hits, total),
        hit_ratio: ratio(host_hits + ssd_hits, total),
        demoted_pages: demoted,
        ssd_evictions,
        ssd_dropped_pages: refused,
        wall_s: wall.as_secs_f64(),
    })
}

/// Hit pages of an unbounded cache with the same prefix semantics: per request, the leading pages
/// whose keys an earlier request used.
pub fn unbounded(keys: &[Vec<ContentKey>]) -> u64 {
    let mut seen: HashSet<ContentKey> = HashSet::new();
    let mut hits = 0u64;
    for k in keys {
        hits += k.iter().take_while(|key| seen.contains(*key)).count() as u64;
        seen.extend(k.iter().copied());
    }
    hits
}
