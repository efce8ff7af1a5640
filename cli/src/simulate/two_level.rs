//! `kvtier simulate --ssd`: page hit ratios of a host pool over an SSD tier (two levels), beside the
//! host pool alone and an unbounded cache.
//!
//! The host level is a real [`kvtier::HostTier`] (`Level`), the same as a host-only run's. The SSD
//! level is the SSD tier's own code without files, [`kvtier::SsdModel`]: its disk directory (victims
//! in recency order, whatever the host policy: the drive is not managed by the host's policy) and
//! its admission ([`kvtier::Admission`]: a fixed number of uses, or `auto`), with as many disk slots
//! as an SSD slot file of the given size holds ([`kvtier::Geometry::disk_slots`]).
//!
//! Per request, with page keys `k` (`n` pages), in trace order, following the tier's events:
//! 1. the host query leases the resident run `k[..h]` (host hits); each leased block has one
//!    more use (the tier's `on_hit`), and is demoted at the use the admission names;
//! 2. the SSD level continues it: the leading run `k[h..h + d]` the drive holds (SSD hits, the
//!    blocks a promotion reads, each made the most recently used on the drive), saved on the host
//!    as the promotion puts them there (1 use, clean); after them the host's run goes on (1.), then
//!    the drive's again, as the tier's query does, until neither holds the next page;
//! 3. the host saves the rest as the host-only run does. A block new to the host has 1 use (its
//!    save: the tier's `on_reserve`); it is shown to the admission (a ghost hit if the drive
//!    evicted it lately) and demoted if one use admits it (the tier's `on_commit`).
//!
//! A demotion is written at once (the tier's demotion thread writes it a little later, while the
//! block is still on the host). Uses are counted per stay on the host, as the tier counts them
//! per host slot: a block evicted from the host starts again at its next save.
//!
//! The host level is built over the model ([`kvtier::HostTier::over_ssd_model`]), so the two levels are chosen
//! together as in the tier: a host block the drive holds a copy of (demoted, or promoted from the
//! drive) is clean, and the core's victim selection takes clean blocks before dirty ones (the
//! tier's own class order, with the host policy's order within each class). A demotion of a key
//! the drive holds already writes nothing but marks the host block clean, as the demotion thread
//! does.

use super::{ratio, HintQueue, Level, Variant};
use crate::error::Error;
use ahash::AHashMap as HashMap;
use ahash::AHashSet as HashSet;
use kvtier::{ContentKey, Demotion, Geometry, SsdAdmit, SsdModel};
use serde::Serialize;
use std::time::Instant;

/// One variant at one host pool size over one SSD tier size with one admission.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct TwoLevelRun {
    /// The variant's label ([`Variant::label`]): the host policy (the drive's victims are in
    /// recency order).
    pub policy: String,
    /// The SSD admission (`"1"`, `"2"`, `"auto"`).
    pub admit: String,
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
    /// Blocks the SSD level evicted to make room for demotions.
    pub ssd_evictions: u64,
    /// Demotions the SSD level dropped: every disk slot pinned or being written (never in a
    /// simulation, where no read is in flight).
    pub ssd_dropped_pages: u64,
    /// Under `auto`: the admission's windows of evictions, and the share of them that ended
    /// admitting after 2 uses (0 for a fixed admission or a drive that never evicted).
    pub auto_windows: u64,
    /// See [`TwoLevelRun::auto_windows`].
    pub auto_tight_share: f64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
}

/// Runs `variant` on a host pool of `host_slots` slots over an SSD level of `ssd_slots` slots
/// admitting by `admit`, over `keys` (one key list per request), calling `progress(1)` after each
/// request.
///
/// # Errors
/// [`Error::Config`] if `admit` is 0 uses; pool mapping errors; tier errors other than a refused
/// save.
pub fn run_two_level(
    keys: &[Vec<ContentKey>],
    variant: Variant,
    host_slots: u32,
    ssd_slots: u32,
    admit: SsdAdmit,
    geometry: &Geometry,
    progress: &dyn Fn(u64),
) -> Result<TwoLevelRun, Error> {
    if admit == SsdAdmit::Uses(0) {
        return Err(Error::Config("the SSD admission threshold is a number of uses, at least 1".into()));
    }
    let max_pages = keys.iter().map(|k| k.len()).max().unwrap_or(1) as u64;
    let mut ssd = SsdModel::new(ssd_slots, admit);
    let host = Level::new(geometry, max_pages, host_slots, variant, Some(&mut ssd))?;
    // Uses of each block during its current stay on the host (the tier's per-slot count).
    let mut uses: HashMap<ContentKey, u32> = HashMap::new();
    let (mut host_hits, mut ssd_hits, mut demoted, mut refused) = (0u64, 0u64, 0u64, 0u64);
    let mut queue = HintQueue::new(variant.lookahead);
    let mut fresh: Vec<bool> = Vec::new();
    let demote = |ssd: &mut SsdModel, key: &ContentKey, demoted: &mut u64, refused: &mut u64| match ssd.demote(key) {
        Demotion::Written(_) => *demoted += 1,
        Demotion::Present => {}
        Demotion::Dropped => *refused += 1,
    };
    let t0 = Instant::now();
    for (i, k) in keys.iter().enumerate() {
        let n = k.len();
        queue.admit(&host.tier, i, keys.len(), |j| keys[j].clone());
        // As the tier's query: the host's run, then the drive's from where it ended, then the
        // host's again after the promoted blocks, and so on (a host block the drive holds may
        // have been dropped from the middle of a prefix the host holds the rest of).
        let mut pos = 0;
        loop {
            let (h, _) = host.query(&k[pos..], pos)?;
            host_hits += h as u64;
            for key in &k[pos..pos + h] {
                let c = uses.entry(*key).or_insert(1);
                *c = c.saturating_add(1);
                // The tier's `on_hit`: a dirty block is demoted at the use the admission names.
                if ssd.admission().admits(*c) {
                    demote(&mut ssd, key, &mut demoted, &mut refused);
                }
            }
            pos += h;
            if pos == n {
                break;
            }
            let d = ssd.promote(&k[pos..]);
            if d == 0 {
                break;
            }
            ssd_hits += d as u64;
            // The promotion puts the blocks in host slots; they have a disk copy (its commit marks
            // them clean).
            save_fresh(&host, k, pos, pos + d, &mut fresh, |key| {
                uses.insert(*key, 1);
                ssd.mark_host_copy(key);
            })?;
            pos += d;
        }
        if pos < n {
            // The engine saves the rest, as the host-only run does.
            save_fresh(&host, k, pos, n, &mut fresh, |key| {
                // Seeded bug (tests only): the drive refuses a block's first demotion, as the
                // host policy's doorkeeper did when the drive was modelled by the host policy.
                if crate::seeded::seeded("sim-ssd-doorkeeper") && !ssd.contains(key) {
                    uses.insert(*key, 1);
                    refused += 1;
                    return;
                }
                let u = ssd.admission().on_save(key);
                uses.insert(*key, u);
                // Seeded bug (tests only): every saved block is admitted, whatever the admission.
                let admitted = crate::seeded::seeded("ssd-admits-any-use") || ssd.admission().admits_save(u);
                if admitted {
                    demote(&mut ssd, key, &mut demoted, &mut refused);
                }
            })?;
        }
        progress(1);
    }
    let wall = t0.elapsed();
    host.close()?;
    let total: u64 = keys.iter().map(|k| k.len() as u64).sum();
    let (windows, tight) = ssd.admission().windows();
    Ok(TwoLevelRun {
        policy: variant.label(),
        admit: admit.to_string(),
        host_slots,
        ssd_slots,
        host_hit_pages: host_hits,
        ssd_hit_pages: ssd_hits,
        host_hit_ratio: ratio(host_hits, total),
        ssd_hit_ratio: ratio(ssd_hits, total),
        hit_ratio: ratio(host_hits + ssd_hits, total),
        demoted_pages: demoted,
        ssd_evictions: ssd.evictions(),
        ssd_dropped_pages: refused,
        auto_windows: windows,
        auto_tight_share: ratio(tight, windows),
        wall_s: wall.as_secs_f64(),
    })
}

/// Saves pages `from..to` of the request of `keys` on `host` and calls `saved` for each key the
/// save put on the host (not resident before, resident after: not a refreshed or dropped one).
fn save_fresh(
    host: &Level,
    keys: &[ContentKey],
    from: usize,
    to: usize,
    fresh: &mut Vec<bool>,
    mut saved: impl FnMut(&ContentKey),
) -> Result<(), Error> {
    fresh.clear();
    fresh.extend(keys[from..to].iter().map(|key| !host.tier.contains(key)));
    host.save(keys, from, to)?;
    for (key, &new) in keys[from..to].iter().zip(fresh.iter()) {
        if new && host.tier.contains(key) {
            saved(key);
        }
    }
    Ok(())
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
