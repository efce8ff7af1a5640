//! `kvtier simulate`: page hit ratios of the eviction policies on a Mooncake trace, through the real
//! tier (index, slab, policy code) with a copy backend that moves no bytes, plus the offline optimum.
//!
//! Per request (the `replay` semantics with `--concurrency 1`): `n` full pages with keys
//! `namespace.trace_page_key(hash_ids[j / ppb], j % ppb)`; `tier.query(keys)` leases the longest
//! resident prefix (`h` hits); the lease is "restored" through a [`NullBackend`] and dropped; pages
//! `h..n` are saved with [`Fit::Prefix`] (resident pages are refreshed, missing ones take slots,
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

pub mod foresight;
pub mod two_level;

use crate::error::Error;
use crate::size::{parse_disk_slots, parse_slots};
use crate::trace::{pages_per_block, TraceRequest, TRACE_BLOCK_TOKENS};
use ahash::AHashMap as HashMap;
use kvtier::BackingChoice;
use kvtier::NullBackend;
use kvtier::WaitFor;
use kvtier::{ArenaSpec, ContentKey, Geometry, PolicyKind, TierError};
use kvtier::{Fit, HintId, HostTier, Rank, SaveOptions, TierConfig};
use serde::Serialize;
use std::collections::BinaryHeap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// One tier configuration that [`run_policy`] drives: a policy, chain-aware victims on or off, and
/// scheduler hints for a modelled engine queue.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Variant {
    /// The eviction policy.
    pub policy: PolicyKind,
    /// Chain-aware victims ([`TierConfig::chain_aware`]): orphans, then chain leaves, then the rest.
    pub chain: bool,
    /// Hints for the next `lookahead` requests (0: no hints): before request `i` is queried, the
    /// engine queue holds requests `i + 1 ..= i + lookahead` (trace order), each hinted with
    /// [`HostTier::hint`] while it waits and withdrawn when it is admitted.
    pub lookahead: usize,
    /// Queue-protecting admission ([`TierConfig::protect_hinted`]): a save never evicts a block
    /// a queued request will look up (only with a lookahead).
    pub protect: bool,
}

impl Variant {
    /// `policy` alone: no chain ranking, no hints (the classic policy).
    pub fn plain(policy: PolicyKind) -> Self {
        Variant { policy, chain: false, lookahead: 0, protect: false }
    }

    /// `policy` with chain-aware victims `chain` and hints for `lookahead` requests, without
    /// queue-protecting admission.
    pub fn new(policy: PolicyKind, chain: bool, lookahead: usize) -> Self {
        Variant { policy, chain, lookahead, protect: false }
    }

    /// The row label: the policy's name, `+chain` if chain-aware, `+la{N}` with a lookahead of N,
    /// `+protect` with queue-protecting admission.
    pub fn label(&self) -> String {
        let mut s = self.policy.name().to_string();
        if self.chain {
            s.push_str("+chain");
        }
        if self.lookahead > 0 {
            let _ = write!(s, "+la{}", self.lookahead);
        }
        if self.protect {
            s.push_str("+protect");
        }
        s
    }
}

/// What to simulate (`kvtier simulate`'s options, parsed).
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    /// Geometry preset whose slot size turns byte sizes into slots and whose namespace keys pages.
    pub geometry: String,
    /// Pool sizes as given: bytes with a unit (`8GiB`, `500MB`) or slots (`9952slots`); see
    /// [`parse_slots`].
    pub pools: Vec<String>,
    /// Policies to run, in this order.
    pub policies: Vec<PolicyKind>,
    /// Chain-aware settings to run each policy with (`[false]`, `[true]` or both).
    pub chain: Vec<bool>,
    /// Also run each policy with hints for an engine queue of this many requests (0: not).
    pub lookahead: usize,
    /// With a lookahead, also run each policy with it and queue-protecting admission
    /// ([`Variant::protect`]).
    pub protect: bool,
    /// Also compute the offline optimum ([`belady`]) at each size.
    pub optimum: bool,
    /// Horizons in requests of the foresight reference ([`foresight::foresight_hits`]) to compute at
    /// each size (rows `foresight-R`); empty: none.
    pub foresight: Vec<u32>,
    /// SSD tier sizes as given (bytes with a unit or `Nslots`; see [`parse_disk_slots`]): each
    /// variant also runs over each host pool size with each of these under it
    /// ([`two_level::run_two_level`]). Empty: host pool only.
    pub ssd: Vec<String>,
    /// SSD admissions to run each two-level case with (`auto` by default).
    pub ssd_admit: Vec<kvtier::SsdAdmit>,
}

impl Default for SimConfig {
    /// GLM-5.2, pools of 8, 16, 32 and 64 GiB, every built-in policy with and without chain-aware
    /// victims, no hints, with the optimum.
    fn default() -> Self {
        SimConfig {
            geometry: "glm52".into(),
            pools: ["8GiB", "16GiB", "32GiB", "64GiB"].map(String::from).to_vec(),
            policies: PolicyKind::ALL.to_vec(),
            chain: vec![false, true],
            lookahead: 0,
            protect: false,
            optimum: true,
            foresight: Vec::new(),
            ssd: Vec::new(),
            ssd_admit: vec![kvtier::SsdAdmit::Auto],
        }
    }
}

impl SimConfig {
    /// The variants run, in report order: each policy, with each chain setting, without hints,
    /// (with a lookahead) with them, and (with [`SimConfig::protect`] too) with them and
    /// queue-protecting admission.
    pub fn variants(&self) -> Vec<Variant> {
        let mut v = Vec::new();
        let mut looks = vec![(0, false)];
        if self.lookahead > 0 {
            looks.push((self.lookahead, false));
            if self.protect {
                looks.push((self.lookahead, true));
            }
        }
        for &policy in &self.policies {
            for &chain in &self.chain {
                for &(lookahead, protect) in &looks {
                    v.push(Variant { policy, chain, lookahead, protect });
                }
            }
        }
        v
    }

    /// Requests the policy runs of [`run`] replay in all (`variants x pools x (1 + ssd sizes x
    /// admissions) x requests`): the
    /// length of a progress bar fed by `run`'s `progress`.
    pub fn steps(&self, requests: usize) -> u64 {
        (self.variants().len() * self.pools.len() * (1 + self.ssd.len() * self.ssd_admit.len())) as u64
            * requests as u64
    }
}

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

/// One policy at one pool size.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PolicyRun {
    /// The variant's label ([`Variant::label`]; `optimum` for the offline bound, `foresight-R` for
    /// the foresight reference of horizon `R`).
    pub policy: String,
    /// Chain-aware victims.
    pub chain: bool,
    /// Requests hinted ahead (0: no hints).
    pub lookahead: usize,
    /// Queue-protecting admission ([`Variant::protect`]).
    pub protect: bool,
    /// Pool size in slots.
    pub slots: u32,
    /// Pages found by queries.
    pub hit_pages: u64,
    /// `hit_pages / pages`.
    pub hit_ratio: f64,
    /// Blocks evicted.
    pub evictions: u64,
    /// Missing pages not saved (did not fit, or refused).
    pub dropped_pages: u64,
    /// Wall time of the run in seconds.
    pub wall_s: f64,
    /// Mean time of `tier.query` per request in ns (0 for the optimum).
    pub query_ns: f64,
    /// Mean time of the save call (index probes, slot acquisition with eviction, submission) per
    /// request that saved, in ns (0 for the optimum).
    pub save_ns: f64,
    /// Mean time per request of its hint calls (one `hint` as it joins the queue, one
    /// `withdraw_hint` as it leaves), in ns (0 without hints).
    pub hint_ns: f64,
}

impl PolicyRun {
    /// The row of an offline computation (no tier: no evictions, drops or per-request costs) named
    /// `policy` at `slots` slots: `hits` of `total` pages, timed from `t0`.
    fn offline(policy: String, slots: u32, hits: u64, total: u64, t0: Instant) -> Self {
        PolicyRun {
            policy,
            chain: false,
            lookahead: 0,
            protect: false,
            slots,
            hit_pages: hits,
            hit_ratio: ratio(hits, total),
            evictions: 0,
            dropped_pages: 0,
            wall_s: t0.elapsed().as_secs_f64(),
            query_ns: 0.0,
            save_ns: 0.0,
            hint_ns: 0.0,
        }
    }

    /// True for the rows computed offline from the whole trace (the optimum and the foresight
    /// references), which run no tier.
    pub fn is_offline(policy: &str) -> bool {
        policy == "optimum" || policy.starts_with("foresight-")
    }
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct SimReport {
    /// Trace path.
    pub trace: String,
    /// Requests simulated.
    pub requests: u64,
    /// Full pages over all requests.
    pub pages: u64,
    /// Geometry preset.
    pub geometry: String,
    /// Bytes per slot of the geometry.
    pub slot_bytes: u64,
    /// Pool sizes: (label as given, slots).
    pub sizes: Vec<(String, u32)>,
    /// Every policy x size, then the foresight references per horizon and size, then the optimum per
    /// size.
    pub runs: Vec<PolicyRun>,
    /// SSD tier sizes: (label as given, disk slots); empty without `--ssd`.
    pub ssd_sizes: Vec<(String, u32)>,
    /// SSD admissions run (`"1"`, `"2"`, `"auto"`).
    pub ssd_admit: Vec<String>,
    /// Every variant x host pool size x SSD size (empty without `--ssd`).
    pub two_level: Vec<two_level::TwoLevelRun>,
    /// Page hit ratio of an unbounded cache ([`two_level::unbounded`]).
    pub unbounded_hit_ratio: f64,
    /// Peak resident memory of the process in KiB (Linux `VmHWM`), 0 if unknown.
    pub peak_rss_kib: u64,
}

/// The tier geometry of a simulation: `geometry`'s page size, one 16-byte arena of `pages` pages.
fn proxy_geometry(geometry: &Geometry, pages: u64) -> Result<Geometry, Error> {
    let g = Geometry::new(
        &format!("kvtier-simulate/{}", geometry.model()),
        geometry.page_tokens(),
        vec![ArenaSpec::packed("sim", 16, pages.max(1))],
    )?;
    Ok(g)
}

/// How long a modelled hint lasts: longer than any run, so hints end by withdrawal only.
pub const SIM_HINT_TTL: Duration = Duration::from_secs(24 * 3600);

/// One level of a simulated cache: a real [`HostTier`] of `slots` slots over the proxy geometry,
/// configured as `variant` says, with one [`NullBackend`] rank. Its queries "restore" the leased
/// prefix through the rank and its saves are waited for, as the replay does.
pub(crate) struct Level {
    pub(crate) tier: HostTier,
    rank: Rank,
    /// Page ids `0..max_pages` of the proxy arena: the pages request `i`'s page `j` uses.
    pages: Vec<u64>,
}

/// What [`Level::save`] did.
pub(crate) struct LevelSave {
    /// Pages not saved: they did not fit, or the pool refused them.
    pub(crate) dropped: u64,
    /// Time of the save call itself (probes, slot acquisition with eviction, submission).
    pub(crate) call: Duration,
}

impl Level {
    /// A level of `slots` slots for requests of at most `max_pages` pages.
    ///
    /// # Errors
    /// Geometry and pool errors; [`Error::Config`] if the pool does not come out at `slots`.
    pub(crate) fn new(geometry: &Geometry, max_pages: u64, slots: u32, variant: Variant) -> Result<Level, Error> {
        let proxy = proxy_geometry(geometry, max_pages)?;
        let bytes = slots as u64 * proxy.slot_bytes();
        let cfg = TierConfig::new(proxy.clone(), bytes)
            .with_backing(BackingChoice::Plain)
            .with_policy(variant.policy)
            .with_chain_aware(variant.chain)
            .with_protect_hinted(variant.protect);
        let tier = HostTier::new(cfg)?;
        if tier.capacity() != slots {
            return Err(Error::Config(format!("pool of {bytes} B holds {} slots, not {slots}", tier.capacity())));
        }
        let rank = tier.attach(Box::new(NullBackend::new(proxy)))?;
        Ok(Level { tier, rank, pages: (0..max_pages).collect() })
    }

    /// Leases the longest resident prefix of `keys` (a request's pages from its page `from` on,
    /// which are pages `from..` of the proxy arena), restores it through the null backend and
    /// drops the lease. Returns the prefix's length in pages and the query call's time.
    ///
    /// # Errors
    /// Restore errors of the tier.
    pub(crate) fn query(&self, keys: &[ContentKey], from: usize) -> Result<(usize, Duration), Error> {
        let q0 = Instant::now();
        let lease = self.tier.query(keys);
        let took = q0.elapsed();
        let h = lease.len();
        if h > 0 {
            self.rank.restore(&lease, &self.pages[from..from + h], WaitFor::Nothing)?.wait()?;
        }
        Ok((h, took))
    }

    /// Saves pages `from..to` of a request whose page keys are `keys`, as the blocks at prefix
    /// depth `from..to` chained to `keys[from - 1]`, with [`Fit::Prefix`] (resident pages are
    /// refreshed, missing ones take slots, evicting by the policy), and waits for the save.
    ///
    /// # Errors
    /// Tier errors other than a refused save ([`TierError::CannotFit`],
    /// [`TierError::PoolExhausted`]: counted as dropped pages).
    pub(crate) fn save(&self, keys: &[ContentKey], from: usize, to: usize) -> Result<LevelSave, Error> {
        let s0 = Instant::now();
        let mut opts = SaveOptions::new().fit(Fit::Prefix).prefix_depth(from as u32);
        if from > 0 {
            opts = opts.parent(keys[from - 1]);
        }
        let r = self.rank.save_with(&keys[from..to], &self.pages[from..to], WaitFor::Nothing, opts);
        let call = s0.elapsed();
        let dropped = match r {
            Ok(t) => {
                t.handle.wait()?;
                t.dropped as u64
            }
            Err(TierError::CannotFit { .. } | TierError::PoolExhausted { .. }) => (to - from) as u64,
            Err(e) => return Err(e.into()),
        };
        Ok(LevelSave { dropped, call })
    }

    /// Blocks the level's policy evicted so far.
    pub(crate) fn evictions(&self) -> u64 {
        self.tier.stats().evictions
    }

    /// Detaches the rank.
    ///
    /// # Errors
    /// [`TierError`] if a copy is still in flight after 10 s.
    pub(crate) fn close(self) -> Result<(), Error> {
        self.rank.shutdown(Duration::from_secs(10))?;
        Ok(())
    }
}

/// Runs `variant` on a pool of `slots` slots over `keys` (one key list per request) through a real
/// [`HostTier`] with a [`NullBackend`], calling `progress(1)` after each request.
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
    let host = Level::new(geometry, max_pages, slots, variant)?;
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

/// The modelled engine queue of [`Variant::lookahead`] requests and their hints.
pub struct HintQueue {
    lookahead: usize,
    /// Hints of queued requests, by request index.
    live: std::collections::VecDeque<(usize, HintId)>,
    /// Next request index to enqueue.
    next: usize,
}

impl HintQueue {
    /// A queue of `lookahead` requests (0: no hints at all).
    pub fn new(lookahead: usize) -> Self {
        HintQueue { lookahead, live: Default::default(), next: 0 }
    }

    /// Request `i` of `total` is admitted: requests up to `i + lookahead` are queued (hinted with
    /// their keys, `keys_of(j)`) and request `i`'s own hint is withdrawn. Call once per request, in
    /// order.
    pub fn admit(&mut self, tier: &HostTier, i: usize, total: usize, keys_of: impl Fn(usize) -> Vec<ContentKey>) {
        if self.lookahead == 0 {
            return;
        }
        let end = (i + self.lookahead + 1).min(total);
        while self.next < end {
            self.live.push_back((self.next, tier.hint(&keys_of(self.next), SIM_HINT_TTL)));
            self.next += 1;
        }
        while let Some(&(j, id)) = self.live.front() {
            if j > i {
                break;
            }
            tier.withdraw_hint(id);
            self.live.pop_front();
        }
    }
}

pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Dense ids of `keys`' pages for the offline bounds: per request the id of each page, per request
/// and page the index of the next request using that page (`u32::MAX` if none), and the number of
/// distinct pages.
pub fn belady_ids(keys: &[Vec<ContentKey>]) -> (Vec<Vec<u32>>, Vec<Vec<u32>>, usize) {
    let mut ids: HashMap<ContentKey, u32> = HashMap::new();
    let seqs: Vec<Vec<u32>> = keys
        .iter()
        .map(|k| {
            k.iter()
                .map(|key| {
                    let n = ids.len() as u32;
                    *ids.entry(*key).or_insert(n)
                })
                .collect()
        })
        .collect();
    let never = u32::MAX;
    let mut next_seen = vec![never; ids.len()];
    let mut next: Vec<Vec<u32>> = vec![Vec::new(); seqs.len()];
    for (i, s) in seqs.iter().enumerate().rev() {
        next[i] = s.iter().map(|&p| next_seen[p as usize]).collect();
        for &p in s {
            next_seen[p as usize] = i as u32;
        }
    }
    (seqs, next, ids.len())
}

/// The offline optimum (furthest next use) with the simulation's prefix semantics, on `slots`
/// slots. Returns the hit pages.
pub fn belady(keys: &[Vec<ContentKey>], slots: u32) -> u64 {
    let (seqs, next, ids) = belady_ids(keys);
    // Resident pages: their current (next use, depth); a max-heap with lazy deletion.
    let mut resident: Vec<Option<(u32, u32)>> = vec![None; ids];
    let mut heap: BinaryHeap<(u32, u32, u32)> = BinaryHeap::new();
    let mut count = 0u32;
    let mut hits = 0u64;
    for (i, s) in seqs.iter().enumerate() {
        let h = s.iter().take_while(|&&p| resident[p as usize].is_some()).count();
        hits += h as u64;
        for (d, &p) in s.iter().enumerate() {
            let e = (next[i][d], d as u32);
            if resident[p as usize].is_some() {
                resident[p as usize] = Some(e);
                heap.push((e.0, e.1, p));
                continue;
            }
            if count < slots {
                count += 1;
            } else {
                // Evict the furthest-next-use page if it is used later than this one, else bypass.
                loop {
                    let &(nu, dep, q) = heap.peek().expect("a full pool has resident pages");
                    if resident[q as usize] != Some((nu, dep)) {
                        heap.pop();
                        continue;
                    }
                    break;
                }
                let &(nu, dep, q) = heap.peek().expect("checked above");
                if (nu, dep) <= e {
                    continue;
                }
                heap.pop();
                resident[q as usize] = None;
            }
            resident[p as usize] = Some(e);
            heap.push((e.0, e.1, p));
        }
    }
    hits
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

impl SimReport {
    fn policies(&self) -> Vec<&str> {
        let mut v: Vec<&str> = Vec::new();
        for r in &self.runs {
            if !v.contains(&r.policy.as_str()) {
                v.push(&r.policy);
            }
        }
        v
    }

    fn get(&self, policy: &str, slots: u32) -> Option<&PolicyRun> {
        self.runs.iter().find(|r| r.policy == policy && r.slots == slots)
    }

    /// The report as a text table: page hit ratio per variant and size, then each variant's ratio
    /// to plain LRU and to the optimum, then the per-request query and save cost (and hint cost
    /// with a lookahead).
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "trace {}: {} requests, {} pages; geometry {} ({} B per slot); peak RSS {} MiB",
            self.trace,
            self.requests,
            self.pages,
            self.geometry,
            self.slot_bytes,
            self.peak_rss_kib / 1024
        );
        let w = self.policies().iter().map(|p| p.len()).max().unwrap_or(0).max(16);
        let head = |s: &mut String, title: &str| {
            let _ = write!(s, "\n{title:<w$}");
            for (label, slots) in &self.sizes {
                let _ = write!(s, " {:>18}", format!("{label} ({slots})"));
            }
            let _ = writeln!(s);
        };
        head(&mut s, "hit ratio");
        for p in self.policies() {
            let _ = write!(s, "{p:<w$}");
            for (_, slots) in &self.sizes {
                let v = self.get(p, *slots).map_or("-".into(), |r| format!("{:.4}", r.hit_ratio));
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        head(&mut s, "x LRU / %opt");
        for p in self.policies() {
            let _ = write!(s, "{p:<w$}");
            for (_, slots) in &self.sizes {
                let r = self.get(p, *slots);
                let l = self.get("lru", *slots);
                let o = self.get("optimum", *slots);
                let v = match r {
                    Some(r) => format!(
                        "{} / {}",
                        l.map_or("-".into(), |l| format!("{:.2}x", r.hit_ratio / l.hit_ratio)),
                        o.map_or("-".into(), |o| format!("{:.0}%", 100.0 * r.hit_ratio / o.hit_ratio))
                    ),
                    None => "-".into(),
                };
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        let hints = self.runs.iter().any(|r| r.lookahead > 0);
        head(&mut s, if hints { "query/save/hint us" } else { "query/save us" });
        for p in self.policies().into_iter().filter(|p| !PolicyRun::is_offline(p)) {
            let _ = write!(s, "{p:<w$}");
            for (_, slots) in &self.sizes {
                let v = self.get(p, *slots).map_or("-".into(), |r| {
                    let mut v = format!("{:.1} / {:.1}", r.query_ns / 1e3, r.save_ns / 1e3);
                    if hints {
                        let _ = write!(v, " / {:.1}", r.hint_ns / 1e3);
                    }
                    v
                });
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        if !self.two_level.is_empty() {
            s.push_str(&self.two_level_table(w));
        }
        s
    }

    /// The two-level section of [`SimReport::table`]: per variant and host pool size, the host-only
    /// ratio, then for each SSD size the two-level ratio with its host and SSD shares.
    fn two_level_table(&self, w: usize) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "\ntwo-level page hit ratio: host pool + SSD tier = host share + SSD share (SSD admission after \
             N uses, or auto); unbounded cache {:.4}",
            self.unbounded_hit_ratio
        );
        let _ = write!(s, "{:<w$} {:>6} {:>18} {:>12}", "policy", "admit", "host pool", "host only");
        for (label, slots) in &self.ssd_sizes {
            let _ = write!(s, " {:>26}", format!("+ SSD {label} ({slots})"));
        }
        let _ = writeln!(s);
        for p in self.policies().into_iter().filter(|p| !PolicyRun::is_offline(p)) {
            for (label, slots) in &self.sizes {
                for admit in &self.ssd_admit {
                    let alone = self.get(p, *slots).map_or("-".into(), |r| format!("{:.4}", r.hit_ratio));
                    let _ = write!(s, "{p:<w$} {admit:>6} {:>18} {alone:>12}", format!("{label} ({slots})"));
                    for (_, ssd) in &self.ssd_sizes {
                        let v = self
                            .two_level
                            .iter()
                            .find(|r| {
                                r.policy == p && r.host_slots == *slots && r.ssd_slots == *ssd && r.admit == *admit
                            })
                            .map_or("-".into(), |r| {
                                format!("{:.4} = {:.4} + {:.4}", r.hit_ratio, r.host_hit_ratio, r.ssd_hit_ratio)
                            });
                        let _ = write!(s, " {v:>26}");
                    }
                    let _ = writeln!(s);
                }
            }
        }
        s
    }

    /// The variants the plot draws: all of them when there are at most 12; else plain `lru` (the
    /// baseline), each policy's chain-aware variant with and without hints (its plain variant when
    /// it has no chain-aware one), and the optimum.
    fn plotted(&self) -> Vec<&str> {
        let all = self.policies();
        if all.len() <= 12 {
            return all;
        }
        let chain_of = |p: &str| format!("{}+chain", p.split('+').next().unwrap_or(p));
        all.iter()
            .copied()
            .filter(|p| {
                let base = p.split('+').next().unwrap_or(p);
                let has_chain = all.iter().any(|q| q.starts_with(&chain_of(p)));
                PolicyRun::is_offline(p)
                    || *p == "lru"
                    || p.starts_with(&chain_of(p))
                    || (!has_chain && (*p == base || p.strip_prefix(base).is_some_and(|r| r.starts_with("+la"))))
            })
            .collect()
    }

    /// An SVG line plot (drawn with plotters) of page hit ratio (y) against pool size in slots
    /// (x, log scale), one line per variant (see `SimReport::plotted`: at most one chain setting
    /// per policy when there are many), one colour per policy, hinted runs and the optimum dashed.
    ///
    /// # Errors
    /// [`Error::Plot`] if plotters fails to lay the chart out.
    pub fn svg(&self) -> Result<String, Error> {
        let mut out = String::new();
        self.draw(&mut out).map_err(|e| Error::Plot(e.to_string()))?;
        Ok(out)
    }

    fn draw(&self, out: &mut String) -> Result<(), Box<dyn std::error::Error + '_>> {
        use plotters::prelude::*;
        let size = if self.plotted().len() > 8 { (980, 620) } else { (760, 460) };
        let root = SVGBackend::with_string(out, size).into_drawing_area();
        root.fill(&WHITE)?;
        let slots: Vec<f64> = self.sizes.iter().map(|(_, n)| *n as f64).collect();
        let (lo, hi) = slots.iter().fold((f64::MAX, 1f64), |(a, b), &n| (a.min(n), b.max(n)));
        // A margin of a fifth of a doubling on each side; one size still gets a range.
        let (lo, hi) = (lo.min(hi) / 1.15, hi * 1.15);
        let ymax = (self.runs.iter().map(|r| r.hit_ratio).fold(0.0, f64::max) * 1.1).clamp(0.05, 1.0);
        let mut chart = ChartBuilder::on(&root)
            .caption(
                format!("Page hit ratio vs host pool size ({}, {} requests)", self.geometry, self.requests),
                ("sans-serif", 16),
            )
            .margin(14)
            .x_label_area_size(42)
            .y_label_area_size(56)
            .build_cartesian_2d((lo..hi).log_scale().with_key_points(slots), 0f64..ymax)?;
        // Each pool size is a tick, labelled as given.
        let label = |x: &f64| match self.sizes.iter().find(|(_, n)| *n as f64 == *x) {
            Some((label, _)) => label.clone(),
            None => format!("{x:.0}"),
        };
        chart
            .configure_mesh()
            .x_desc("pool size (log scale)")
            .y_desc("page hit ratio")
            .x_label_formatter(&label)
            .y_label_formatter(&|y| format!("{y:.3}"))
            .draw()?;
        // One colour per policy; hinted runs dashed; the optimum dashed black.
        let mut bases: Vec<String> = Vec::new();
        for p in self.plotted() {
            let points: Vec<(f64, f64)> =
                self.sizes.iter().filter_map(|(_, n)| self.get(p, *n).map(|r| (*n as f64, r.hit_ratio))).collect();
            let base = p.split('+').next().unwrap_or(p).to_string();
            let i = bases.iter().position(|b| *b == base).unwrap_or_else(|| {
                bases.push(base.clone());
                bases.len() - 1
            });
            let hinted = self.runs.iter().any(|r| r.policy == p && r.lookahead > 0);
            let color = if p == "optimum" { BLACK.to_rgba() } else { Palette99::pick(i).to_rgba() };
            let line = color.stroke_width(2);
            if PolicyRun::is_offline(p) || hinted {
                let legend = move |(x, y): (i32, i32)| {
                    EmptyElement::at((x, y))
                        + PathElement::new(vec![(0, 0), (8, 0)], line)
                        + PathElement::new(vec![(13, 0), (21, 0)], line)
                };
                chart.draw_series(DashedLineSeries::new(points.clone(), 6, 4, line))?.label(p).legend(legend);
            } else {
                let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 24, y)], line);
                chart.draw_series(LineSeries::new(points.clone(), line))?.label(p).legend(legend);
            }
            chart.draw_series(points.iter().map(|&xy| Circle::new(xy, 3, color.filled())))?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    }
}
