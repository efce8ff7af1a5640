//! The CPU benchmarks' shared harness (`benches/index.rs`, `benches/slab.rs`, `benches/tier.rs`).
//!
//! Method, in the style of the concurrent-map benchmarks (libcuckoo's universal benchmark and its
//! Rust ports): every measured *run* starts its worker threads once; each thread builds its own
//! state (its pre-generated operation stream, its share of the keys) and then waits at a barrier;
//! released together, each runs its whole stream (a million operations by default) and reads the
//! clock itself at its start and end. Throughput is all operations over the span from the first
//! thread's start to the last thread's end. No thread is spawned and no allocation is made inside
//! the measured span (except what the structure under test does).
//!
//! Latency: one operation in every `--sample` (a power of two, 64 by default) is timed on its own
//! with [`Instant`] into the thread's HDR histogram; the histograms are merged per run. The cost of
//! reading the clock twice is measured at start-up and printed in the header: it is included in
//! every latency figure (so a p50 near that cost means "faster than the clock can tell"). Timing one
//! operation in 64 adds well under a nanosecond per operation to the throughput figures.
//!
//! Every bench binary takes its parameters after `--` (see [`Args`]); `--quick` shrinks everything
//! to a few seconds for a 2-core machine and CI. Results go to stdout as markdown tables and, with
//! `--out DIR`, to `DIR/<bench>.json` (the header and one record per run) and `DIR/<bench>.md`
//! (the printed report); `--tag NAME` names them `NAME.json` and `NAME.md` instead.

#![allow(dead_code)] // each bench binary uses a different part of the harness

use clap::Parser;
use hdrhistogram::Histogram;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Barrier;
use std::time::{Duration, Instant};

/// Command-line parameters shared by the CPU bench binaries (pass them after `--`:
/// `cargo bench --bench index -- --quick`). Every list is comma-separated; a left-out option takes
/// the bench's default (its `--help` lists them).
#[derive(Parser, Debug, Clone)]
#[command(about, disable_version_flag = true)]
pub struct Args {
    /// A few seconds in all: fewer threads, operations and keys (a 2-core machine, CI smoke runs).
    #[arg(long)]
    pub quick: bool,
    /// Thread counts; `all` = the available parallelism. Default: 1,2,4,8,16,all.
    #[arg(long, value_delimiter = ',')]
    pub threads: Option<Vec<String>>,
    /// Operations per thread in each run (a 43-key prefix query, an allocate + free pair, one
    /// admission: one operation each).
    #[arg(long)]
    pub ops: Option<u64>,
    /// Operation mixes as `get/insert/remove` percentages or a name: `read-heavy` (98/1/1),
    /// `mixed` (90/5/5), `write-heavy` (50/25/25). Default: the three names.
    #[arg(long, value_delimiter = ',')]
    pub mixes: Option<Vec<String>>,
    /// Key distributions: `uniform`, `zipf` (scrambled Zipf, exponent `--zipf-theta`).
    #[arg(long, value_delimiter = ',')]
    pub dists: Option<Vec<String>>,
    /// Zipf exponent (0.99: the YCSB default).
    #[arg(long, default_value_t = 0.99)]
    pub zipf_theta: f64,
    /// Capacity the structure is sized for (keys, slots).
    #[arg(long)]
    pub capacity: Option<usize>,
    /// Fraction of the capacity filled before each run.
    #[arg(long, default_value_t = 0.75)]
    pub prefill: f64,
    /// Contenders to run (the bench's `--help` names them). Default: every one but the slow
    /// baselines noted there.
    #[arg(long, value_delimiter = ',')]
    pub contenders: Option<Vec<String>>,
    /// Workloads to run (the bench's `--help` names them). Default: all but opt-in ones.
    #[arg(long, value_delimiter = ',')]
    pub workloads: Option<Vec<String>>,
    /// Time one operation in this many (a power of two; 0: no latency figures).
    #[arg(long, default_value_t = 64)]
    pub sample: u64,
    /// Runs of each configuration; the run with the median throughput is reported.
    #[arg(long, default_value_t = 1)]
    pub repeat: usize,
    /// Pin worker thread `i` to CPU `i mod cpus` (ignored where the system refuses).
    #[arg(long)]
    pub pin: bool,
    /// Seed of the operation streams.
    #[arg(long, default_value_t = 0x6b76_7469_6572)]
    pub seed: u64,
    /// Write `<bench>.json` and `<bench>.md` into this folder.
    #[arg(long)]
    pub out: Option<std::path::PathBuf>,
    /// File stem of `--out`'s files instead of the bench's name (two runs of one bench into one
    /// folder).
    #[arg(long)]
    pub tag: Option<String>,
    /// Hasher of the other maps: `ahash` (default) or `fold` (the same two-word mix kvtier's index
    /// uses; content keys are uniform hashes already).
    #[arg(long, default_value = "ahash")]
    pub hasher: String,
    /// Eviction policy of the tier bench (default: the tier's default).
    #[arg(long)]
    pub policy: Option<String>,
    /// Chain-aware victims in the tier bench (`on`, the tier's default, or `off`).
    #[arg(long, default_value = "on", value_parser = ["on", "off"])]
    pub chain: String,
    /// Chains of the tier bench's prefill hinted for the whole run (`HostTier::hint`, one hint per
    /// chain): the hinted preference classes are live (default 0: none).
    #[arg(long, default_value_t = 0)]
    pub hints: u64,
    /// Passed by `cargo bench`; ignored.
    #[arg(long, hide = true)]
    pub bench: bool,
    /// Run only rows whose name contains one of these.
    pub filter: Vec<String>,
}

impl Args {
    /// Parses the process arguments; exits with a usage message on bad input.
    pub fn from_env() -> Args {
        let a = Args::parse();
        if a.sample != 0 && !a.sample.is_power_of_two() {
            eprintln!("--sample must be 0 or a power of two, got {}", a.sample);
            std::process::exit(2);
        }
        if !(0.0..=1.0).contains(&a.prefill) {
            eprintln!("--prefill must be within 0..=1, got {}", a.prefill);
            std::process::exit(2);
        }
        a
    }

    /// Thread counts, ascending and without repeats (`all` = available parallelism). Default:
    /// 1, 2, 4, 8, 16 and all; `--quick`: 1, 2 and all.
    pub fn thread_counts(&self) -> Vec<usize> {
        let all = cpus();
        let default: &[&str] = if self.quick { &["1", "2", "all"] } else { &["1", "2", "4", "8", "16", "all"] };
        let list: Vec<String> = self.threads.clone().unwrap_or_else(|| default.iter().map(|s| s.to_string()).collect());
        let mut v: Vec<usize> = list
            .iter()
            .map(|s| {
                if s == "all" {
                    all
                } else {
                    s.parse().unwrap_or_else(|_| {
                        eprintln!("--threads: not a count: {s}");
                        std::process::exit(2)
                    })
                }
            })
            .filter(|&t| t > 0)
            .collect();
        v.sort_unstable();
        v.dedup();
        v
    }

    /// `--ops`, else `quick` when `--quick`, else `full`.
    pub fn ops_or(&self, full: u64, quick: u64) -> u64 {
        self.ops.unwrap_or(if self.quick { quick } else { full })
    }

    /// `--capacity`, else `quick` when `--quick`, else `full`.
    pub fn capacity_or(&self, full: usize, quick: usize) -> usize {
        self.capacity.unwrap_or(if self.quick { quick } else { full })
    }

    /// The named items of a list option, validated against `known`; `default` when absent.
    pub fn pick(&self, what: &str, given: &Option<Vec<String>>, known: &[&str], default: &[&str]) -> Vec<String> {
        let v: Vec<String> = given.clone().unwrap_or_else(|| default.iter().map(|s| s.to_string()).collect());
        for s in &v {
            if !known.contains(&s.as_str()) {
                eprintln!("--{what}: unknown `{s}`; known: {}", known.join(", "));
                std::process::exit(2);
            }
        }
        v
    }

    /// Key distributions.
    pub fn distributions(&self) -> Vec<Dist> {
        self.pick("dists", &self.dists, &["uniform", "zipf"], &["uniform", "zipf"])
            .iter()
            .map(|s| if s == "zipf" { Dist::Zipf(self.zipf_theta) } else { Dist::Uniform })
            .collect()
    }

    /// Operation mixes.
    pub fn op_mixes(&self) -> Vec<Mix> {
        let v = self.mixes.clone().unwrap_or_else(|| vec!["read-heavy".into(), "mixed".into(), "write-heavy".into()]);
        v.iter()
            .map(|s| {
                Mix::parse(s).unwrap_or_else(|| {
                    eprintln!("--mixes: `{s}` is neither a name nor get/insert/remove percentages summing to 100");
                    std::process::exit(2)
                })
            })
            .collect()
    }

    /// True if the row `name` passes the positional filters.
    pub fn selected(&self, name: &str) -> bool {
        self.filter.is_empty() || self.filter.iter().any(|f| name.contains(f.as_str()))
    }

    /// The latency sampling mask: an operation `i` is timed when `i & mask == 0`.
    pub fn sample_mask(&self) -> u64 {
        if self.sample == 0 {
            u64::MAX
        } else {
            self.sample - 1
        }
    }
}

/// Cores this process may use.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

// ---------------------------------------------------------------------------------------------
// Operation streams: mixes, key distributions, a small PRNG.

/// An operation mix in percent.
#[derive(Copy, Clone, Debug, PartialEq)]
pub struct Mix {
    /// Name printed in tables.
    pub name: &'static str,
    /// Percent of lookups.
    pub get: u8,
    /// Percent of inserts.
    pub insert: u8,
    /// Percent of removals.
    pub remove: u8,
}

impl Mix {
    /// 98% lookups, 1% inserts, 1% removals.
    pub const READ_HEAVY: Mix = Mix { name: "read-heavy", get: 98, insert: 1, remove: 1 };
    /// 90% lookups, 5% inserts, 5% removals.
    pub const MIXED: Mix = Mix { name: "mixed", get: 90, insert: 5, remove: 5 };
    /// 50% lookups, 25% inserts, 25% removals.
    pub const WRITE_HEAVY: Mix = Mix { name: "write-heavy", get: 50, insert: 25, remove: 25 };

    fn parse(s: &str) -> Option<Mix> {
        match s {
            "read-heavy" => return Some(Mix::READ_HEAVY),
            "mixed" => return Some(Mix::MIXED),
            "write-heavy" => return Some(Mix::WRITE_HEAVY),
            _ => {}
        }
        let p: Vec<u8> = s.split('/').map(|x| x.parse().ok()).collect::<Option<_>>()?;
        if p.len() != 3 || p.iter().map(|&x| x as u32).sum::<u32>() != 100 {
            return None;
        }
        Some(Mix { name: Box::leak(s.to_string().into_boxed_str()), get: p[0], insert: p[1], remove: p[2] })
    }
}

/// How keys (or chains, or slots) are drawn.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Dist {
    /// Every item equally likely.
    Uniform,
    /// Scrambled Zipf with this exponent: item ranks follow Zipf's law, and rank `r` is item
    /// `hash(r) mod n` (as YCSB scrambles it), so the hot items are spread over the structure.
    Zipf(f64),
}

impl Dist {
    /// Name printed in tables.
    pub fn name(&self) -> String {
        match self {
            Dist::Uniform => "uniform".into(),
            Dist::Zipf(t) => format!("zipf{t}"),
        }
    }
}

/// SplitMix64: a small, fast PRNG (and the finaliser used to derive keys).
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    /// The next 64 random bits.
    #[inline]
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// A float in `[0, 1)`.
    #[inline]
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An integer in `0..n` (`n > 0`).
    #[inline]
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

/// The splitmix64 finaliser.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Draws item indices `0..n` from a [`Dist`].
#[derive(Clone, Debug)]
pub struct Sampler {
    n: u64,
    zipf: Option<ZipfParams>,
}

#[derive(Clone, Debug)]
struct ZipfParams {
    theta: f64,
    zetan: f64,
    alpha: f64,
    eta: f64,
    half_pow_theta: f64,
}

impl Sampler {
    /// A sampler over `0..n` (`n > 0`). Zipf precomputes `zeta(n, theta)` (a sum of `n` terms).
    pub fn new(dist: Dist, n: u64) -> Sampler {
        assert!(n > 0, "a sampler needs at least one item");
        let zipf = match dist {
            Dist::Uniform => None,
            Dist::Zipf(theta) => {
                assert!(theta > 0.0 && theta != 1.0, "zipf exponent must be > 0 and != 1");
                // Gray et al., "Quickly generating billion-record synthetic databases" (SIGMOD'94).
                let zeta = |m: u64| (1..=m).map(|i| 1.0 / (i as f64).powf(theta)).sum::<f64>();
                let zetan = zeta(n);
                let zeta2 = zeta(2.min(n));
                let eta = (1.0 - (2.0 / n as f64).powf(1.0 - theta)) / (1.0 - zeta2 / zetan);
                Some(ZipfParams { theta, zetan, alpha: 1.0 / (1.0 - theta), eta, half_pow_theta: 0.5f64.powf(theta) })
            }
        };
        Sampler { n, zipf }
    }

    /// The next item index.
    #[inline]
    pub fn sample(&self, rng: &mut Rng) -> u64 {
        match &self.zipf {
            None => rng.below(self.n),
            Some(z) => {
                let u = rng.unit();
                let uz = u * z.zetan;
                let rank = if uz < 1.0 {
                    0
                } else if uz < 1.0 + z.half_pow_theta {
                    1
                } else {
                    ((self.n as f64 * (z.eta * u - z.eta + 1.0).powf(z.alpha)) as u64).min(self.n - 1)
                };
                let _ = z.theta;
                mix64(rank ^ 0x5bd1_e995) % self.n
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Running threads and recording.

/// One worker's latency recorder: a histogram of sampled operation times in ns.
pub struct Recorder {
    hist: Histogram<u64>,
    mask: u64,
}

impl Recorder {
    fn new(mask: u64) -> Recorder {
        Recorder { hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds"), mask }
    }

    /// Runs `op(i)` for `i in 0..n`, timing every `i` with `i & mask == 0` (see the module docs).
    #[inline(always)]
    pub fn run(&mut self, n: u64, mut op: impl FnMut(u64)) {
        let mask = self.mask;
        if mask == u64::MAX {
            for i in 0..n {
                op(i);
            }
            return;
        }
        for i in 0..n {
            if i & mask == 0 {
                let t0 = Instant::now();
                op(i);
                self.record(t0.elapsed());
            } else {
                op(i);
            }
        }
    }

    /// Records one latency.
    #[inline]
    pub fn record(&mut self, d: Duration) {
        self.hist.saturating_record((d.as_nanos() as u64).max(1));
    }
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct Measured {
    /// Worker threads.
    pub threads: usize,
    /// Operations, all threads together.
    pub ops: u64,
    /// First start to last end.
    pub span: Duration,
    /// Slowest and fastest thread's own operations per second.
    pub thread_rate: (f64, f64),
    /// Sampled latency percentiles in ns: p50, p90, p99, p99.9, max (0 without sampling).
    pub lat: [u64; 5],
    /// Latency samples.
    pub samples: u64,
}

impl Measured {
    /// Million operations per second, all threads together.
    pub fn mops(&self) -> f64 {
        self.ops as f64 / self.span.as_secs_f64() / 1e6
    }

    /// Mean time per operation seen by one thread, in ns (`threads x span / ops`).
    pub fn ns_per_op(&self) -> f64 {
        self.threads as f64 * self.span.as_nanos() as f64 / self.ops as f64
    }
}

/// Runs one measured run: `threads` workers are spawned, each builds its state with `setup(t)`
/// (not timed), all wait at a barrier, then each runs `work(t, state, recorder)`, which returns the
/// operations it did. Optionally pins worker `t` to CPU `t mod cpus`.
pub fn run<S, F, W>(threads: usize, args: &Args, setup: F, work: W) -> Measured
where
    F: Fn(usize) -> S + Sync,
    W: Fn(usize, &mut S, &mut Recorder) -> u64 + Sync,
{
    let barrier = Barrier::new(threads);
    let mask = args.sample_mask();
    let results: Vec<(Instant, Instant, u64, Histogram<u64>)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, setup, work) = (&barrier, &setup, &work);
                let pin = args.pin;
                s.spawn(move || {
                    if pin {
                        pin_to(t % cpus());
                    }
                    let mut state = setup(t);
                    let mut rec = Recorder::new(mask);
                    barrier.wait();
                    let start = Instant::now();
                    let ops = work(t, &mut state, &mut rec);
                    let end = Instant::now();
                    drop(state);
                    (start, end, ops, rec.hist)
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread panicked")).collect()
    });
    let first = results.iter().map(|r| r.0).min().expect("threads > 0");
    let last = results.iter().map(|r| r.1).max().expect("threads > 0");
    let ops = results.iter().map(|r| r.2).sum();
    let rates: Vec<f64> = results.iter().map(|r| r.2 as f64 / (r.1 - r.0).as_secs_f64().max(1e-12)).collect();
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds");
    for r in &results {
        hist.add(&r.3).expect("same bounds");
    }
    let lat = if hist.is_empty() {
        [0; 5]
    } else {
        [
            hist.value_at_quantile(0.5),
            hist.value_at_quantile(0.9),
            hist.value_at_quantile(0.99),
            hist.value_at_quantile(0.999),
            hist.max(),
        ]
    };
    Measured {
        threads,
        ops,
        span: last - first,
        thread_rate: (rates.iter().cloned().fold(f64::INFINITY, f64::min), rates.iter().cloned().fold(0.0, f64::max)),
        lat,
        samples: hist.len(),
    }
}

/// [`run`] `args.repeat` times (with `prepare` before each, not timed) and keeps the run with the
/// median throughput.
pub fn run_repeated<P, S, F, W>(threads: usize, args: &Args, prepare: impl FnMut() -> P, setup: F, work: W) -> Measured
where
    P: Sync,
    F: Fn(&P, usize) -> S + Sync,
    W: Fn(&P, usize, &mut S, &mut Recorder) -> u64 + Sync,
{
    run_repeated_observed(threads, args, prepare, setup, work, |_, _| ()).0
}

/// [`run_repeated`], also keeping what `observe` reads of each run's prepared state once the run
/// has ended (before the state is dropped): the median run's figures and its observation.
pub fn run_repeated_observed<P, S, F, W, X>(
    threads: usize,
    args: &Args,
    mut prepare: impl FnMut() -> P,
    setup: F,
    work: W,
    observe: impl Fn(&P, &Measured) -> X,
) -> (Measured, X)
where
    P: Sync,
    F: Fn(&P, usize) -> S + Sync,
    W: Fn(&P, usize, &mut S, &mut Recorder) -> u64 + Sync,
{
    let mut runs: Vec<(Measured, X)> = (0..args.repeat.max(1))
        .map(|_| {
            let p = prepare();
            let m = run(threads, args, |t| setup(&p, t), |t, s, r| work(&p, t, s, r));
            let x = observe(&p, &m);
            drop(p);
            (m, x)
        })
        .collect();
    runs.sort_by(|a, b| a.0.mops().total_cmp(&b.0.mops()));
    runs.swap_remove(runs.len() / 2)
}

#[cfg(target_os = "linux")]
fn pin_to(cpu: usize) {
    // SAFETY: `set` is a plain bit set sized by the libc type; sched_setaffinity reads it only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

#[cfg(not(target_os = "linux"))]
fn pin_to(_cpu: usize) {}

/// Median cost of two back-to-back [`Instant::now`] calls in ns (what every latency sample
/// includes).
pub fn clock_cost_ns() -> u64 {
    let mut v: Vec<u64> = (0..10_001)
        .map(|_| {
            let t0 = Instant::now();
            let t1 = Instant::now();
            (t1 - t0).as_nanos() as u64
        })
        .collect();
    v.sort_unstable();
    v[v.len() / 2]
}

// ---------------------------------------------------------------------------------------------
// Reporting.

/// One reported run.
#[derive(Clone, Debug)]
pub struct Row {
    /// Workload (`read-heavy`, `prefix43`, `pair`, `query`, ...).
    pub workload: String,
    /// Key distribution or other variant (`uniform`, `zipf0.99`, `-`).
    pub variant: String,
    /// Contender (`kvtier`, `papaya`, ...).
    pub contender: String,
    /// What was measured.
    pub m: Measured,
    /// What one operation is, for the tables' captions.
    pub unit: &'static str,
}

/// Collects rows, prints them as they come and as tables at the end, and writes the files.
pub struct Report {
    bench: &'static str,
    header: String,
    rows: Vec<Row>,
    started: Instant,
}

impl Report {
    /// Starts a report and prints its header (machine, date, command, clock cost).
    pub fn new(bench: &'static str, args: &Args, settings: &[(&str, String)]) -> Report {
        let mut h = String::new();
        let _ = writeln!(h, "# kvtier CPU benchmark `{bench}`\n");
        let _ = writeln!(h, "- machine: {} ({} CPUs available)", cpu_model(), cpus());
        let _ = writeln!(h, "- date (UTC): {}", utc_now());
        let cmd: Vec<String> = std::env::args().skip(1).filter(|a| a != "--bench").collect();
        let _ = writeln!(h, "- arguments: `{}`", cmd.join(" "));
        let _ = writeln!(h, "- kvtier {}, profile {}", env!("CARGO_PKG_VERSION"), profile());
        for (k, v) in settings {
            let _ = writeln!(h, "- {k}: {v}");
        }
        if args.sample == 0 {
            let _ = writeln!(h, "- latency: not sampled");
        } else {
            let _ = writeln!(
                h,
                "- latency: 1 operation in {} timed; two clock reads cost {} ns (included in every latency figure)",
                args.sample,
                clock_cost_ns()
            );
        }
        print!("{h}");
        println!();
        Report { bench, header: h, rows: Vec::new(), started: Instant::now() }
    }

    /// Adds a row and prints it at once (progress).
    pub fn add(&mut self, row: Row) {
        let m = &row.m;
        println!(
            "{:>8.1}s  {:<14} {:<10} {:<16} {:>3} thr  {:>9}/s  {:>8.1} ns/op/thread  p50 {:>6} p99 {:>7} p99.9 {:>8} ns",
            self.started.elapsed().as_secs_f64(),
            row.workload,
            row.variant,
            row.contender,
            m.threads,
            rate(m.mops() * 1e6),
            m.ns_per_op(),
            m.lat[0],
            m.lat[2],
            m.lat[3]
        );
        self.rows.push(row);
    }

    /// Prints the tables (one per workload and variant: contenders x threads) and writes the
    /// files if `--out` was given.
    pub fn finish(self, args: &Args, notes: &str) {
        let mut md = self.header.clone();
        md.push('\n');
        let mut groups: BTreeMap<(usize, String, String), Vec<&Row>> = BTreeMap::new();
        let mut order: Vec<(String, String)> = Vec::new();
        for r in &self.rows {
            let key = (r.workload.clone(), r.variant.clone());
            let pos = order.iter().position(|k| *k == key).unwrap_or_else(|| {
                order.push(key.clone());
                order.len() - 1
            });
            groups.entry((pos, key.0, key.1)).or_default().push(r);
        }
        for ((_, workload, variant), rows) in &groups {
            let mut threads: Vec<usize> = rows.iter().map(|r| r.m.threads).collect();
            threads.sort_unstable();
            threads.dedup();
            let mut contenders: Vec<&str> = Vec::new();
            for r in rows {
                if !contenders.contains(&r.contender.as_str()) {
                    contenders.push(&r.contender);
                }
            }
            let unit = rows[0].unit;
            let _ = writeln!(md, "### {workload}, {variant}: {unit}/s, all threads (ns per operation per thread)\n");
            let _ = write!(md, "| contender |");
            for t in &threads {
                let _ = write!(md, " {t} thr |");
            }
            let _ = writeln!(md, " p50 / p99 / p99.9 ns at {} thr |", threads.last().unwrap_or(&0));
            let _ = writeln!(md, "|---|{}---|", "---|".repeat(threads.len()));
            for c in &contenders {
                let _ = write!(md, "| {c} |");
                let mut last = None;
                for t in &threads {
                    match rows.iter().find(|r| r.contender == *c && r.m.threads == *t) {
                        Some(r) => {
                            let _ = write!(md, " {} ({:.0}) |", rate(r.m.mops() * 1e6), r.m.ns_per_op());
                            last = Some(r);
                        }
                        None => {
                            let _ = write!(md, " - |");
                        }
                    }
                }
                match last {
                    Some(r) => {
                        let _ = writeln!(md, " {} / {} / {} |", r.m.lat[0], r.m.lat[2], r.m.lat[3]);
                    }
                    None => {
                        let _ = writeln!(md, " - |");
                    }
                }
            }
            md.push('\n');
        }
        if !notes.is_empty() {
            md.push_str(notes);
            md.push('\n');
        }
        let _ = writeln!(md, "Total time: {:.1} s", self.started.elapsed().as_secs_f64());
        println!();
        print!("{}", &md[self.header.len()..]);
        if let Some(dir) = &args.out {
            let stem = args.tag.as_deref().unwrap_or(self.bench);
            std::fs::create_dir_all(dir).expect("creating --out");
            std::fs::write(dir.join(format!("{stem}.md")), &md).expect("writing the report");
            std::fs::write(dir.join(format!("{stem}.json")), self.json()).expect("writing the json");
            println!("wrote {}/{stem}.md and .json", dir.display());
        }
    }

    fn json(&self) -> String {
        let mut j = String::from("{\n");
        let _ = writeln!(j, "  \"bench\": \"{}\",", self.bench);
        let _ = writeln!(j, "  \"header\": {},", json_str(&self.header));
        j.push_str("  \"runs\": [\n");
        for (i, r) in self.rows.iter().enumerate() {
            let m = &r.m;
            let _ = write!(
                j,
                "    {{\"workload\": {}, \"variant\": {}, \"contender\": {}, \"unit\": {}, \"threads\": {}, \"ops\": {}, \
                 \"seconds\": {:.6}, \"mops\": {:.4}, \"ns_per_op_per_thread\": {:.2}, \"thread_mops_min\": {:.4}, \
                 \"thread_mops_max\": {:.4}, \"lat_samples\": {}, \"p50_ns\": {}, \"p90_ns\": {}, \"p99_ns\": {}, \
                 \"p999_ns\": {}, \"max_ns\": {}}}",
                json_str(&r.workload),
                json_str(&r.variant),
                json_str(&r.contender),
                json_str(r.unit),
                m.threads,
                m.ops,
                m.span.as_secs_f64(),
                m.mops(),
                m.ns_per_op(),
                m.thread_rate.0 / 1e6,
                m.thread_rate.1 / 1e6,
                m.samples,
                m.lat[0],
                m.lat[1],
                m.lat[2],
                m.lat[3],
                m.lat[4]
            );
            j.push_str(if i + 1 < self.rows.len() { ",\n" } else { "\n" });
        }
        j.push_str("  ]\n}\n");
        j
    }
}

/// A rate with three significant digits and a unit prefix: `12.3 M`, `456 k`, `7.89`.
fn rate(per_sec: f64) -> String {
    let (v, p) = if per_sec >= 1e6 {
        (per_sec / 1e6, " M")
    } else if per_sec >= 1e3 {
        (per_sec / 1e3, " k")
    } else {
        (per_sec, "")
    };
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$}{p}")
}

fn json_str(s: &str) -> String {
    let mut o = String::with_capacity(s.len() + 2);
    o.push('"');
    for c in s.chars() {
        match c {
            '"' => o.push_str("\\\""),
            '\\' => o.push_str("\\\\"),
            '\n' => o.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(o, "\\u{:04x}", c as u32);
            }
            c => o.push(c),
        }
    }
    o.push('"');
    o
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

fn profile() -> &'static str {
    if cfg!(debug_assertions) {
        "debug (figures are meaningless)"
    } else {
        "optimised"
    }
}

/// Now as `YYYY-MM-DD HH:MM` UTC.
fn utc_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (proleptic Gregorian).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}", rem / 3600, rem % 3600 / 60)
}
