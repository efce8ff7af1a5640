//! `kvtier simulate`: page hit ratios of the eviction policies on a Mooncake trace, through the real
//! tier (index, slab, policy code) with a copy backend that moves no bytes, plus the offline optimum.
//!
//! Per request (the `replay` semantics with `--concurrency 1`): `n` full pages with keys
//! `namespace.trace_page_key(hash_ids[j / ppb], j % ppb)`; `tier.query(keys)` leases the longest
//! resident prefix (`h` hits); the lease is "restored" through a [`NullBackend`](kvtier::NullBackend) and dropped; pages
//! `h..n` are saved with [`Fit::Prefix`](kvtier::Fit::Prefix) (resident pages are refreshed, missing ones take slots,
//! evicting by the policy) and the save is waited for. The page hit ratio is `sum h / sum n`.
//!
//! The tier is built over a *proxy* geometry with the same page size and a 16-byte slot, so a pool
//! of `S` slots maps `S x 256` bytes at most: a 64 GiB GLM-5.2 pool (19,904 slots) would otherwise
//! need a 64 GiB mapping, which a machine with less memory refuses under the kernel's default
//! overcommit rule even though no byte is ever touched. Slot counts come from the real geometry
//! (`floor(bytes / slot_bytes)`), keys from its namespace; only the mapping is smaller.
//!
//! The optimum ([`belady`]) is computed here, not through the tier: with the same prefix semantics,
//! a missing page is admitted only if some resident page's next use is later than its own, and
//! then the page whose next use is furthest (deepest first on ties) is evicted.

mod belady;
mod config;
pub mod foresight;
mod level;
mod report;
pub mod two_level;

pub use belady::{belady, belady_ids};
pub use config::{SimConfig, Variant};
pub(crate) use level::Level;
pub use level::{HintQueue, SIM_HINT_TTL};
pub use report::{PolicyRun, SimReport};

use crate::error::Error;
use crate::size::{parse_disk_slots, parse_slots};
use crate::trace::{pages_per_block, TraceRequest, TRACE_BLOCK_TOKENS};
use kvtier::{ContentKey, Geometry};
use std::time::{Duration, Instant};

/// The page keys of every request for `geometry` (`min(floor(input_length / page_tokens),
/// ppb x len(hash_ids))` full pages, `ppb = 512 / page_tokens`).
///
/// # Errors
/// [`Error::Config`] if the geometry's page size does not divide 512 tokens.
pub fn page_keys(reqs: &[TraceRequest], geometry: &Geometry) -> Result<Vec<Vec<ContentKey>>, Error> {
    let pt = geometry.page_tokens();
    if pages_per_block(pt).is_none() {
        return Err(Error::Config(format!("page size {pt} tokens does not divide a {TRACE_BLOCK_TOKENS}-token block")));
    }
    let ns = geometry.namespace();
    Ok(reqs.iter().map(|r| r.page_keys(&ns, pt)).collect())
}

/// Runs `variant` on a pool of `slots` slots over `keys` (one key list per request) through a real
/// [`HostTier`](kvtier::HostTier) with a [`NullBackend`](kvtier::NullBackend), calling `progress(1)` after each request.
///
/// # Errors
/// Pool mapping errors ([`kvtier::Error::Pool`]); tier errors other than a refused save.
pub fn run_policy(
    keys: &[Vec<ContentKey>],
    variant: Variant,
    slots: u32,
    geometry: &Geometry,
    progress: &dyn Fn(u64),
) -> Result<PolicyRun, Error> {
    let max_pages = keys.iter().map(|k| k.len()).max().unwrap_or(1) as u64;
    let host = Level::new(geometry, max_pages, slots, variant, None)?;
    let (mut hits, mut dropped, mut saves) = (0u64, 0u64, 0u64);
    let (mut qt, mut st, mut ht) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut queue = HintQueue::new(variant.lookahead);
    let t0 = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        let n = k.len();
        let h0 = Instant::now();
        queue.admit(&host.tier, i, keys.len(), |j| keys[j].clone());
        ht += h0.elapsed();
        let (h, q) = host.query(k, 0)?;
        qt += q;
        hits += h as u64;
        if h < n {
            let s = host.save(k, h, n)?;
            st += s.call;
            saves += 1;
            dropped += s.dropped;
        }
        progress(1);
    }
    let wall = t0.elapsed();
    let evictions = host.evictions();
    let total: u64 = keys.iter().map(|k| k.len() as u64).sum();
    host.close()?;
    Ok(PolicyRun {
        policy: variant.label(),
        chain: variant.chain,
        lookahead: variant.lookahead,
        protect: variant.protect,
        slots,
        hit_pages: hits,
        hit_ratio: ratio(hits, total),
        evictions,
        dropped_pages: dropped,
        wall_s: wall.as_secs_f64(),
        query_ns: qt.as_nanos() as f64 / keys.len().max(1) as f64,
        save_ns: st.as_nanos() as f64 / saves.max(1) as f64,
        hint_ns: if variant.lookahead > 0 { ht.as_nanos() as f64 / keys.len().max(1) as f64 } else { 0.0 },
    })
}

pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Peak resident set size of this process in KiB (`VmHWM`), 0 where unknown.
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// Runs the simulation `config` over `reqs` (a trace called `trace` in the report), calling
/// `progress(1)` after each request of each policy run ([`SimConfig::steps`] in all).
///
/// # Errors
/// [`Error::Config`] for bad sizes or a geometry whose page size does not divide 512 tokens;
/// geometry, pool and tier errors.
pub fn run(trace: &str, reqs: &[TraceRequest], config: &SimConfig, progress: &dyn Fn(u64)) -> Result<SimReport, Error> {
    let geometry = Geometry::preset(&config.geometry, 1)?;
    let keys = page_keys(reqs, &geometry)?;
    let sizes: Vec<(String, u32)> = config
        .pools
        .iter()
        .map(|s| parse_slots(s, geometry.slot_bytes()).map(|n| (s.trim().to_string(), n)))
        .collect::<Result<_, _>>()?;
    let ssd_sizes: Vec<(String, u32)> = config
        .ssd
        .iter()
        .map(|s| parse_disk_slots(s, &geometry).map(|n| (s.trim().to_string(), n)))
        .collect::<Result<_, _>>()?;
    if !ssd_sizes.is_empty() && (config.ssd_admit.is_empty() || config.ssd_admit.contains(&kvtier::SsdAdmit::Uses(0))) {
        return Err(Error::Config("--ssd-admit is `auto` or a number of uses, at least 1".into()));
    }
    let mut runs = Vec::new();
    let mut two = Vec::new();
    for v in config.variants() {
        for (_, slots) in &sizes {
            runs.push(run_policy(&keys, v, *slots, &geometry, progress)?);
            for &admit in &config.ssd_admit {
                for (_, ssd) in &ssd_sizes {
                    two.push(two_level::run_two_level(&keys, v, *slots, *ssd, admit, &geometry, progress)?);
                }
            }
        }
    }
    let total: u64 = keys.iter().map(|k| k.len() as u64).sum();
    if !config.foresight.is_empty() {
        let (seqs, next, ids) = belady_ids(&keys);
        for &horizon in &config.foresight {
            for (_, slots) in &sizes {
                let t0 = Instant::now();
                let hits = foresight::foresight_hits(&seqs, &next, ids, *slots, horizon);
                runs.push(PolicyRun::offline(format!("foresight-{horizon}"), *slots, hits, total, t0));
            }
        }
    }
    if config.optimum {
        for (_, slots) in &sizes {
            let t0 = Instant::now();
            let hits = belady(&keys, *slots);
            runs.push(PolicyRun::offline("optimum".into(), *slots, hits, total, t0));
        }
    }
    Ok(SimReport {
        trace: trace.to_string(),
        requests: reqs.len() as u64,
        pages: total,
        geometry: config.geometry.clone(),
        slot_bytes: geometry.slot_bytes(),
        sizes,
        runs,
        ssd_sizes,
        ssd_admit: config.ssd_admit.iter().map(|a| a.to_string()).collect(),
        two_level: two,
        unbounded_hit_ratio: ratio(two_level::unbounded(&keys), total),
        peak_rss_kib: peak_rss_kib(),
    })
}
