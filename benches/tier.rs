//! The tier's CPU paths under concurrency, moving no bytes: what an engine pays per admission.
//!
//! The tier is a real `HostTier` over a pool of tiny slots (one 16-byte page each, padded to the
//! pool's slot alignment; their bytes are never touched), with
//! the default eviction policy unless `--policy` names another. Every operation works on a chain of
//! 43 blocks (a long prompt). Two ways to drive it (the contenders):
//!
//! - **`core`**: synchronously on the worker thread, through `kvtier::internals`, calling the
//!   functions the tier itself calls: the lease side of a restore (`internals::restore_with`: the
//!   restore's own pins, a use of the lease, settle), and a save's plan, slot acquisition (free
//!   slots first, then eviction), index reservation and commit (what `Rank::save_with` does on the
//!   engine's thread plus what its completion thread does once the copy is done).
//! - **`rank`**: the public API, one `Rank` per worker thread with a copy backend that moves
//!   nothing and completes at once: `HostTier::query`, `Rank::restore`, `Rank::save_with`; pins are
//!   dropped and saves committed on each rank's completion threads. Latency is the engine thread's
//!   call; throughput counts until every rank has drained.
//! - **`rank+metrics`** (feature `metrics`, not run unless named: `--contenders rank,rank+metrics`):
//!   `rank` with the tier's metrics registered (`HostTier::register_metrics`) and a scraper thread
//!   encoding the registry as OpenMetrics text every 10 ms for the whole run (100 scrapes a second,
//!   100 times Prometheus' densest usual interval): what metrics cost the tier's paths.
//!
//! Workloads (each at every `--threads` count; harness and options: `benches/harness/mod.rs`):
//!
//! - **`query`**: the pool is filled to `--prefill` (75%) with ready chains; one operation =
//!   query a chain (drawn uniform or Zipf) for a lease on its 43 blocks, restore them (no bytes),
//!   drop the lease. `--ops / 5` per thread (200 k).
//! - **`save`**: an empty pool with room for every save of the run; one operation = save a fresh
//!   chain of 43 blocks (plan, 43 free slots, 43 index reservations, commit). `--ops / 100` per
//!   thread (10 k chains).
//! - **`evict`**: a full pool of ready chains; one operation = save a fresh chain, which evicts 43
//!   blocks chosen by the policy. `--ops / 2000` per thread (500 chains: 21.5 k evictions).
//! - **`admission`**: a full pool; chains are drawn (uniform or Zipf) from twice as many as fit;
//!   one operation = query the chain, restore its resident prefix, save the rest (evicting).
//!   `--ops / 2000` per thread.
//! - **`acquire`** (not run unless named; `core` only): `evict` with the latency columns timing the
//!   slot acquisition alone (`Core::acquire_slots`: the selection of 43 victims, their claims, their
//!   finish), every save; what a selection costs as the pool grows.
//!
//! After the tables, for every reported run (the median of `--repeat`) whose saves evicted: the
//! tier's eviction lock in that run (`HostTier::eviction_lock_stats`): its holds (a save that
//! evicts takes it once), the wait for it and the hold per hold in microseconds (the hold is the
//! victim selection and the claims, the one serial step of an evicting save), and the share of the
//! run's span it was held: near 1, saves queue on it and more threads cannot evict faster.
//!
//! `--capacity` is the pool's slot count (32,768: a 100 GiB pool of GLM-5.2 blocks; the `save`
//! workload sizes its own pool). The cost of eviction at scale is the `evict` workload at
//! `--capacity 10000`, `100000` and `1000000` (a million slots, the SSD tier's scale); `--policy`,
//! `--chain off` (plain victims, no orphan class) and `--hints N` (N chains of the prefill hinted:
//! the hinted classes are live) pick the variant.
//! `cargo bench --bench tier -- --help` lists the options; `-- --quick` runs in a few seconds.

#[path = "harness/mod.rs"]
mod harness;

use harness::{Args, Dist, Measured, Report, Rng, Row, Sampler};
use kvtier::internals::{self, Core, Want, WriteReservation};
use kvtier::BackingChoice;
use kvtier::NullBackend;
use kvtier::WaitFor;
use kvtier::{ArenaSpec, ContentKey, Geometry, PolicyKind, TierError};
use kvtier::{EvictionLockStats, HostTier, Rank, SaveOptions, TierConfig};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Blocks in a chain (a long prompt's 43 blocks of 64 tokens).
const CHAIN: usize = 43;
/// GPU pages of the (imaginary) engine arenas: one chain's worth.
const PAGES: u64 = CHAIN as u64;

fn geometry() -> Geometry {
    Geometry::new("cpu-bench", 64, vec![ArenaSpec::packed("kv", 16, PAGES)]).expect("a valid geometry")
}

/// Block `j` of chain `c`.
#[inline]
fn chain_key(c: u64, j: usize) -> ContentKey {
    let x = (c << 8) | j as u64;
    ContentKey::from_words(harness::mix64(x ^ 0x7469_6572_0000_0001), harness::mix64(x ^ 0x6b76_0000_0000_0002))
}

fn chain(c: u64) -> [ContentKey; CHAIN] {
    std::array::from_fn(|j| chain_key(c, j))
}

/// A fresh chain id for thread `t`'s `n`-th save (never one of the shared chains).
fn fresh(t: usize, n: u64) -> u64 {
    ((t as u64 + 1) << 40) | n
}

/// A save through the tier's own steps, on this thread (the `core` contender): plan, acquire
/// (free slots, then eviction), reserve in the index, commit. Returns the blocks saved.
fn save_core(core: &Arc<Core>, keys: &[ContentKey], opts: &SaveOptions) -> Result<usize, TierError> {
    save_core_timed(core, keys, opts, None)
}

/// [`save_core`], with the slot acquisition alone (the selection of victims, their claims and
/// their finish) recorded into `acquire` when given (the `acquire` workload).
fn save_core_timed(
    core: &Arc<Core>,
    keys: &[ContentKey],
    opts: &SaveOptions,
    acquire: Option<&mut harness::Recorder>,
) -> Result<usize, TierError> {
    let mut plan = core.plan_save(keys, opts);
    let need = plan.missing().len();
    if need == 0 {
        return Ok(0);
    }
    // The clock is read only when the acquisition is timed: the other workloads pay nothing.
    let t0 = acquire.is_some().then(Instant::now);
    let slots = core.acquire_slots(Want::Exactly(need));
    if let (Some(rec), Some(t0)) = (acquire, t0) {
        rec.record(t0.elapsed());
    }
    let slots = slots?;
    plan.truncate(slots.len());
    let mut reservation = WriteReservation::new(core);
    for (&i, slot) in plan.missing().iter().zip(slots) {
        reservation.reserve(keys[i], slot, i as u32);
    }
    drop(plan);
    reservation.commit();
    Ok(need)
}

/// A tier of `slots` slots with `chains` ready chains (`0..chains`), saved by all cores.
/// A scraper of the tier's metrics (the `rank+metrics` contender): a thread encoding the registry
/// every [`SCRAPE_EVERY`] until dropped.
struct Scraper {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
}

/// How often the `rank+metrics` contender's scraper encodes the registry.
#[cfg_attr(not(feature = "metrics"), allow(dead_code))]
const SCRAPE_EVERY: Duration = Duration::from_millis(10);

impl Scraper {
    #[cfg(feature = "metrics")]
    fn start(tier: &HostTier) -> Scraper {
        let mut registry = kvtier::prometheus_client::registry::Registry::default();
        tier.register_metrics(&mut registry);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut scrapes, mut text) = (0u64, String::new());
            while !stopped.load(Ordering::Relaxed) {
                text.clear();
                kvtier::prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
                std::hint::black_box(&text);
                scrapes += 1;
                std::thread::sleep(SCRAPE_EVERY);
            }
            scrapes
        });
        Scraper { stop, thread: Some(thread) }
    }

    #[cfg(not(feature = "metrics"))]
    fn start(_: &HostTier) -> Scraper {
        eprintln!("--contenders rank+metrics needs the metrics feature: cargo bench --features metrics --bench tier");
        std::process::exit(2)
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let scrapes = t.join().expect("the scraper thread");
            assert!(scrapes > 0, "the scraper never scraped");
        }
    }
}

/// What one run prepares: the tier, and for `rank+metrics` its scraper (stopped on drop).
struct Bench {
    tier: HostTier,
    _scraper: Option<Scraper>,
    /// The eviction lock's figures before the run (after the pool was filled).
    lock_before: EvictionLockStats,
}

fn tier_with(args: &Args, slots: u64, chains: u64) -> HostTier {
    let policy: PolicyKind = args.policy.as_deref().map_or_else(PolicyKind::default, |p| {
        p.parse().unwrap_or_else(|e| {
            eprintln!("--policy: {e}");
            std::process::exit(2)
        })
    });
    let g = geometry();
    let bytes = slots * g.slot_bytes();
    let cfg = TierConfig::new(g, bytes)
        .with_backing(BackingChoice::Plain)
        .with_policy(policy)
        .with_chain_aware(args.chain == "on");
    let tier = HostTier::new(cfg).expect("a tier of 16-byte slots");
    assert_eq!(tier.capacity() as u64, slots, "pool slot count");
    let core = internals::core(&tier);
    let w = harness::cpus().min(16) as u64;
    std::thread::scope(|s| {
        for t in 0..w {
            s.spawn(move || {
                let opts = SaveOptions::default();
                let mut c = t;
                while c < chains {
                    save_core(core, &chain(c), &opts).expect("room for the prefill");
                    c += w;
                }
            });
        }
    });
    // Hinted chains (spread over the prefill), kept for the tier's lifetime: the hints' ids are
    // never withdrawn and their time-to-live outlasts the run.
    let n = args.hints.min(chains);
    for i in 0..n {
        let _ = tier.hint(&chain(i * (chains / n.max(1))), Duration::from_secs(24 * 3600));
    }
    tier
}

/// Per-thread state: the thread's rank (the `rank` contender) and its chain draws.
struct Worker {
    rank: Option<Rank>,
    draws: Vec<u32>,
    fresh: u64,
}

fn worker(tier: &HostTier, args: &Args, t: usize, rank: bool, draws: u64, sampler: Option<&Sampler>) -> Worker {
    let rank = rank.then(|| tier.attach(Box::new(NullBackend::new(geometry()))).expect("attach a rank"));
    let draws = match sampler {
        Some(s) => {
            let mut rng = Rng::new(args.seed ^ harness::mix64(t as u64 + 7));
            (0..draws).map(|_| s.sample(&mut rng) as u32).collect()
        }
        None => Vec::new(),
    };
    Worker { rank, draws, fresh: 0 }
}

fn drain(w: &Worker) {
    if let Some(r) = &w.rank {
        r.drain(Duration::from_secs(600)).expect("rank drained");
    }
}

const PAGE_IDS: [u64; CHAIN] = {
    let mut p = [0u64; CHAIN];
    let mut i = 0;
    while i < CHAIN {
        p[i] = i as u64;
        i += 1;
    }
    p
};

/// Query + restore of a chain's resident prefix; returns the prefix length.
#[inline]
fn query_restore(tier: &HostTier, w: &Worker, keys: &[ContentKey], errors: &AtomicU64) -> usize {
    let lease = tier.query(keys);
    let h = lease.len();
    if h > 0 {
        let ok = match &w.rank {
            None => internals::restore_with(&lease, h, |slots| std::hint::black_box(slots.len())).is_ok(),
            Some(r) => r.restore(&lease, &PAGE_IDS[..h], WaitFor::Nothing).is_ok(),
        };
        if !ok {
            errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    h
}

#[inline]
fn save(tier: &HostTier, w: &Worker, keys: &[ContentKey], errors: &AtomicU64) {
    let opts = SaveOptions::default();
    let ok = match &w.rank {
        None => save_core(internals::core(tier), keys, &opts).is_ok(),
        Some(r) => {
            let pages = &PAGE_IDS[CHAIN - keys.len()..];
            r.save_with(keys, pages, WaitFor::Nothing, opts).is_ok()
        }
    };
    if !ok {
        errors.fetch_add(1, Ordering::Relaxed);
    }
}

struct Plan {
    workload: &'static str,
    dist: Option<Dist>,
    ops: u64,
}

fn run_one(
    args: &Args,
    plan: &Plan,
    threads: usize,
    capacity: u64,
    (rank, metrics): (bool, bool),
    errors: &AtomicU64,
) -> (Measured, LockUse) {
    let ops = plan.ops;
    let chains = capacity / CHAIN as u64;
    // What the pool holds before the run, and which chains the operations draw from.
    let (slots, filled, universe) = match plan.workload {
        "query" => (capacity, ((capacity as f64 * args.prefill) as u64 / CHAIN as u64).max(1), 0),
        "save" => (threads as u64 * ops * CHAIN as u64 + CHAIN as u64, 0, 0),
        "evict" | "acquire" => (capacity, chains, 0),
        _ => (capacity, chains, 2 * chains),
    };
    let sampler = match (plan.workload, plan.dist) {
        ("query", Some(d)) => Some(Sampler::new(d, filled)),
        ("admission", Some(d)) => Some(Sampler::new(d, universe)),
        _ => None,
    };
    let workload = plan.workload;
    let setup = |b: &Bench, t| worker(&b.tier, args, t, rank, ops, sampler.as_ref());
    let work = |b: &Bench, t, w: &mut Worker, rec: &mut harness::Recorder| {
        let tier = &b.tier;
        match workload {
            "query" => rec.run(ops, |i| {
                let keys = chain(w.draws[i as usize] as u64);
                let h = query_restore(tier, w, &keys, errors);
                debug_assert_eq!(h, CHAIN);
            }),
            "save" | "evict" => rec.run(ops, |_| {
                w.fresh += 1;
                let keys = chain(fresh(t, w.fresh));
                save(tier, w, &keys, errors);
            }),
            "acquire" => {
                for _ in 0..ops {
                    w.fresh += 1;
                    let keys = chain(fresh(t, w.fresh));
                    let opts = SaveOptions::default();
                    if save_core_timed(internals::core(tier), &keys, &opts, Some(&mut *rec)).is_err() {
                        errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            _ => rec.run(ops, |i| {
                let keys = chain(w.draws[i as usize] as u64);
                let h = query_restore(tier, w, &keys, errors);
                if h < CHAIN {
                    save(tier, w, &keys[h..], errors);
                }
            }),
        }
        drain(w);
        ops
    };
    // Each run's use of the eviction lock is kept beside its figures.
    let lock = |tier: &HostTier| tier.eviction_lock_stats().unwrap_or_default();
    harness::run_repeated_observed(
        threads,
        args,
        || {
            let tier = tier_with(args, slots, filled);
            let scraper = metrics.then(|| Scraper::start(&tier));
            Bench { lock_before: lock(&tier), tier, _scraper: scraper }
        },
        setup,
        work,
        |b, m| {
            let (before, after) = (b.lock_before, lock(&b.tier));
            LockUse {
                holds: after.holds.saturating_sub(before.holds),
                wait_ns: after.wait_ns.saturating_sub(before.wait_ns),
                held_ns: after.held_ns.saturating_sub(before.held_ns),
                span_ns: m.span.as_nanos() as u64,
            }
        },
    )
}

/// How a run used the tier's eviction lock (`HostTier::eviction_lock_stats`, the run's share).
struct LockUse {
    holds: u64,
    wait_ns: u64,
    held_ns: u64,
    /// The run's span (first start to last end).
    span_ns: u64,
}

impl LockUse {
    /// A row of the eviction lock table: holds, wait and hold per hold (us), held share of the span.
    fn row(&self) -> String {
        let per = |ns: u64| ns as f64 / self.holds.max(1) as f64 / 1e3;
        format!(
            "{} | {:.1} | {:.1} | {:.2}",
            self.holds,
            per(self.wait_ns),
            per(self.held_ns),
            self.held_ns as f64 / self.span_ns.max(1) as f64
        )
    }
}

const CONTENDERS: &[&str] = &["core", "rank", "rank+metrics"];
/// The contenders run unless `--contenders` names others (`rank+metrics` needs feature `metrics`).
const DEFAULT_CONTENDERS: &[&str] = &["core", "rank"];
const WORKLOADS: &[&str] = &["query", "save", "evict", "admission", "acquire"];
/// The workloads run unless `--workloads` names others (`acquire` is `evict` timed differently).
const DEFAULT_WORKLOADS: &[&str] = &["query", "save", "evict", "admission"];

fn main() {
    let args = Args::from_env();
    let threads = args.thread_counts();
    let ops = args.ops_or(1_000_000, 200_000);
    let capacity = args.capacity_or(1 << 15, 1 << 13) as u64;
    assert!(capacity >= 4 * CHAIN as u64, "--capacity must hold a few chains");
    let contenders = args.pick("contenders", &args.contenders, CONTENDERS, DEFAULT_CONTENDERS);
    let workloads = args.pick("workloads", &args.workloads, WORKLOADS, DEFAULT_WORKLOADS);
    let dists = args.distributions();
    let mut report = Report::new(
        "tier",
        &args,
        &[
            ("threads", format!("{threads:?}")),
            (
                "operations per thread",
                format!(
                    "{} queries (query), {} chains of {CHAIN} (save), {} chains (evict, admission, acquire)",
                    ops / 5,
                    ops / 100,
                    ops / 2000
                ),
            ),
            (
                "pool",
                format!(
                    "{capacity} slots of {} B, never touched ({} chains of {CHAIN})",
                    geometry().slot_bytes(),
                    capacity / CHAIN as u64
                ),
            ),
            ("policy", args.policy.clone().unwrap_or_else(|| PolicyKind::default().name().to_string())),
            ("chain-aware victims", args.chain.clone()),
            ("hinted chains", format!("{} of the prefill's (43 blocks each)", args.hints)),
        ],
    );
    let mut failures = Vec::new();
    let mut locks: Vec<String> = Vec::new();
    for w in &workloads {
        let w: &'static str = WORKLOADS.iter().find(|k| *k == w).expect("validated");
        let variants: Vec<Option<Dist>> =
            if matches!(w, "query" | "admission") { dists.iter().map(|d| Some(*d)).collect() } else { vec![None] };
        let n = match w {
            "query" => ops / 5,
            "save" => ops / 100,
            _ => ops / 2000,
        }
        .max(1);
        for dist in variants {
            let variant = dist.map_or_else(|| "-".to_string(), |d| d.name());
            let plan = Plan { workload: w, dist, ops: n };
            for &t in &threads {
                for c in &contenders {
                    // `acquire` times a step of the tier's own save path: the `core` contender only.
                    if !args.selected(&format!("{w} {variant} {c}")) || (w == "acquire" && c != "core") {
                        continue;
                    }
                    let errors = AtomicU64::new(0);
                    let how = (c.starts_with("rank"), c == "rank+metrics");
                    let (m, lock) = run_one(&args, &plan, t, capacity, how, &errors);
                    if lock.holds > 0 {
                        locks.push(format!("| {w} | {variant} | {c} | {t} | {} |", lock.row()));
                    }
                    let e = errors.load(Ordering::Relaxed);
                    if e > 0 {
                        failures.push(format!("{w} {variant} {c} {t} threads: {e} refused operations"));
                    }
                    report.add(Row {
                        workload: w.to_string(),
                        variant: variant.clone(),
                        contender: c.clone(),
                        m,
                        unit: if w == "query" { "queries" } else { "chains" },
                    });
                }
            }
        }
    }
    let mut notes = String::from(
        "One operation works on a chain of 43 blocks: divide ns per operation by 43 for a block's cost. \
         core: the tier's steps on the worker thread; rank: the public API, commits and unpins on the ranks' \
         completion threads (counted until drained); rank+metrics: rank with the tier's metrics registered and \
         scraped every 10 ms. acquire: the evict workload with its latency columns timing the slot acquisition \
         alone (the selection of 43 victims, their claims and their finish), every save timed whatever --sample \
         says; its throughput is the whole save's.",
    );
    if !locks.is_empty() {
        notes.push_str(
            "\n\nThe eviction lock (`HostTier::eviction_lock_stats`) in each reported run: holds (a save that \
             evicts takes it once), wait and hold per hold in us (the hold: victim selection and claims), and the \
             share of the run's span it was held (near 1: saves queue on it, eviction is their bottleneck).\n\n\
             | workload | variant | contender | threads | holds | wait us | held us | held / span |\n\
             |---|---|---|---|---|---|---|---|",
        );
        for l in &locks {
            notes.push('\n');
            notes.push_str(l);
        }
    }
    for f in &failures {
        notes.push_str(&format!("\n- {f} (CannotFit / PoolExhausted / lease errors)"));
    }
    report.finish(&args, &notes);
}
