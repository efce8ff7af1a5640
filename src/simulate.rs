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

use crate::copy::{CopyBackend, CopyPair, Done, WaitFor};
use crate::error::{CopyError, Error, TierError};
use crate::evict::PolicyKind;
use crate::geometry::{ArenaSpec, Geometry};
use crate::key::ContentKey;
use crate::pool::{BackingChoice, HostPool};
use crate::tier::{Fit, HostTier, SaveOptions, TierConfig};
use crate::trace::{pages_per_block, TraceRequest, TRACE_BLOCK_TOKENS};
use ahash::AHashMap as HashMap;
use serde::Serialize;
use std::collections::BinaryHeap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// `kvtier simulate` options.
#[derive(clap::Args, Clone, Debug)]
pub struct SimulateArgs {
    /// Mooncake-format trace (JSON Lines with `input_length` and `hash_ids`).
    pub trace: PathBuf,
    /// Geometry preset whose slot size turns byte sizes into slots and whose namespace keys pages.
    #[arg(long, default_value = "glm52")]
    pub geometry: String,
    /// Pool sizes, comma-separated: bytes with a unit (`8GiB`, `500MB`) or slots (`9952slots`).
    #[arg(long, default_value = "8GiB,16GiB,32GiB,64GiB")]
    pub pool: String,
    /// Policies to run, comma-separated (default: all built-in ones).
    #[arg(long)]
    pub policies: Option<String>,
    /// Use only the first N requests.
    #[arg(long)]
    pub requests: Option<usize>,
    /// Skip the offline optimum.
    #[arg(long)]
    pub no_optimum: bool,
    /// Print the report as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG plot of hit ratio against pool size here.
    #[arg(long)]
    pub plot: Option<PathBuf>,
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

/// A copy backend that moves nothing: every batch completes at once.
pub struct NullBackend {
    geometry: Geometry,
}

impl NullBackend {
    /// A backend for `geometry` (attach it to a tier of the same geometry).
    pub fn new(geometry: Geometry) -> Self {
        NullBackend { geometry }
    }
}

impl CopyBackend for NullBackend {
    fn name(&self) -> &'static str {
        "null"
    }
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    fn bind_pool(&mut self, _pool: &HostPool) -> Result<(), CopyError> {
        Ok(())
    }
    unsafe fn save(&self, _batch: &[CopyPair], _wait: WaitFor) -> Result<Box<dyn crate::Completion>, CopyError> {
        Ok(Box::new(Done(Ok(()))))
    }
    unsafe fn restore(&self, _batch: &[CopyPair], _wait: WaitFor) -> Result<Box<dyn crate::Completion>, CopyError> {
        Ok(Box::new(Done(Ok(()))))
    }
}

/// One policy at one pool size.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct PolicyRun {
    /// Policy name (`optimum` for the offline bound).
    pub policy: String,
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
    /// Every policy x size, then the optimum per size.
    pub runs: Vec<PolicyRun>,
    /// Peak resident memory of the process in KiB (Linux `VmHWM`), 0 if unknown.
    pub peak_rss_kib: u64,
}

/// Parses a pool size: bytes with a unit (`B`, `KB`/`MB`/`GB`/`TB` = 10^3k, `KiB`/`MiB`/`GiB`/`TiB`
/// = 2^10k) or a slot count with the suffix `slots`; returns slots for `slot_bytes`-byte slots.
///
/// # Errors
/// [`Error::Config`] for an unknown unit, a bad number, or a size below one slot.
pub fn parse_size(s: &str, slot_bytes: u64) -> Result<u32, Error> {
    let t = s.trim();
    let bad = || Error::Config(format!("bad pool size `{s}` (e.g. 32GiB, 500MB, 9952slots)"));
    let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num.parse().map_err(|_| bad())?;
    let slots = if unit.eq_ignore_ascii_case("slots") {
        v
    } else {
        let mult = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024f64.powi(2),
            "gib" => 1024f64.powi(3),
            "tib" => 1024f64.powi(4),
            _ => return Err(bad()),
        };
        ((v * mult).floor() as u64 / slot_bytes) as f64
    };
    if slots < 1.0 || slots.fract() != 0.0 || slots > u32::MAX as f64 / 2.0 {
        return Err(Error::Config(format!("pool size `{s}` is not a whole number of slots >= 1")));
    }
    Ok(slots as u32)
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

/// Runs `policy` on a pool of `slots` slots over `keys` (one key list per request) through a real
/// [`HostTier`] with a [`NullBackend`].
///
/// # Errors
/// Pool mapping errors ([`Error::Pool`]); tier errors other than a refused save.
pub fn run_policy(
    keys: &[Vec<ContentKey>],
    policy: PolicyKind,
    slots: u32,
    geometry: &Geometry,
) -> Result<PolicyRun, Error> {
    let max_pages = keys.iter().map(|k| k.len()).max().unwrap_or(1) as u64;
    let proxy = proxy_geometry(geometry, max_pages)?;
    let bytes = slots as u64 * proxy.slot_bytes();
    let cfg = TierConfig::new(proxy.clone(), bytes).with_backing(BackingChoice::Plain).with_policy(policy);
    let tier = HostTier::new(cfg)?;
    if tier.capacity() != slots {
        return Err(Error::Config(format!("pool of {bytes} B holds {} slots, not {slots}", tier.capacity())));
    }
    let rank = tier.attach(Box::new(NullBackend::new(proxy)))?;
    let pages: Vec<u64> = (0..max_pages).collect();
    let (mut hits, mut dropped, mut saves) = (0u64, 0u64, 0u64);
    let (mut qt, mut st) = (Duration::ZERO, Duration::ZERO);
    let t0 = Instant::now();
    for k in keys {
        let n = k.len();
        let q0 = Instant::now();
        let lease = tier.query(k);
        qt += q0.elapsed();
        let h = lease.len();
        if h > 0 {
            rank.restore(&lease, &pages[..h], WaitFor::Nothing)?.wait()?;
        }
        drop(lease);
        hits += h as u64;
        if h < n {
            let s0 = Instant::now();
            let r = rank.save_with(
                &k[h..],
                &pages[h..n],
                WaitFor::Nothing,
                SaveOptions::new().fit(Fit::Prefix).prefix_depth(h as u32),
            );
            st += s0.elapsed();
            saves += 1;
            match r {
                Ok(t) => {
                    dropped += t.dropped as u64;
                    t.handle.wait()?;
                }
                Err(TierError::CannotFit { .. } | TierError::PoolExhausted { .. }) => dropped += (n - h) as u64,
                Err(e) => return Err(e.into()),
            }
        }
    }
    let wall = t0.elapsed();
    let stats = tier.stats();
    let total: u64 = keys.iter().map(|k| k.len() as u64).sum();
    rank.shutdown(Duration::from_secs(10))?;
    Ok(PolicyRun {
        policy: policy.name().to_string(),
        slots,
        hit_pages: hits,
        hit_ratio: ratio(hits, total),
        evictions: stats.evictions,
        dropped_pages: dropped,
        wall_s: wall.as_secs_f64(),
        query_ns: qt.as_nanos() as f64 / keys.len().max(1) as f64,
        save_ns: st.as_nanos() as f64 / saves.max(1) as f64,
    })
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// The offline optimum (furthest next use) with the simulation's prefix semantics, on `slots`
/// slots. Returns the hit pages.
pub fn belady(keys: &[Vec<ContentKey>], slots: u32) -> u64 {
    // Dense ids per distinct key, and the next request using each occurrence's key.
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
    // Resident pages: their current (next use, depth); a max-heap with lazy deletion.
    let mut resident: Vec<Option<(u32, u32)>> = vec![None; ids.len()];
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

/// Runs the whole simulation described by `args`.
///
/// # Errors
/// [`Error::Config`] for bad sizes, policies or geometry; trace errors; tier errors.
pub fn run(args: &SimulateArgs) -> Result<SimReport, Error> {
    let geometry = Geometry::preset(&args.geometry, 1)?;
    let mut reqs = crate::trace::load(&args.trace)?;
    if let Some(n) = args.requests {
        reqs.truncate(n);
    }
    let keys = page_keys(&reqs, &geometry)?;
    let sizes: Vec<(String, u32)> = args
        .pool
        .split(',')
        .map(|s| parse_size(s, geometry.slot_bytes()).map(|n| (s.trim().to_string(), n)))
        .collect::<Result<_, _>>()?;
    let policies: Vec<PolicyKind> = match &args.policies {
        None => PolicyKind::ALL.to_vec(),
        Some(p) => p
            .split(',')
            .map(|s| s.trim().parse().map_err(|e: crate::evict::UnknownPolicy| Error::Config(e.to_string())))
            .collect::<Result<_, _>>()?,
    };
    let mut runs = Vec::new();
    for &p in &policies {
        for (_, slots) in &sizes {
            runs.push(run_policy(&keys, p, *slots, &geometry)?);
        }
    }
    let total: u64 = keys.iter().map(|k| k.len() as u64).sum();
    if !args.no_optimum {
        for (_, slots) in &sizes {
            let t0 = Instant::now();
            let hits = belady(&keys, *slots);
            runs.push(PolicyRun {
                policy: "optimum".into(),
                slots: *slots,
                hit_pages: hits,
                hit_ratio: ratio(hits, total),
                evictions: 0,
                dropped_pages: 0,
                wall_s: t0.elapsed().as_secs_f64(),
                query_ns: 0.0,
                save_ns: 0.0,
            });
        }
    }
    Ok(SimReport {
        trace: args.trace.display().to_string(),
        requests: reqs.len() as u64,
        pages: total,
        geometry: args.geometry.clone(),
        slot_bytes: geometry.slot_bytes(),
        sizes,
        runs,
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

    /// The report as a text table: page hit ratio per policy and size, then each policy's ratio
    /// to LRU and to the optimum, then the per-request query and save cost.
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
        let head = |s: &mut String, title: &str| {
            let _ = write!(s, "\n{title:<16}");
            for (label, slots) in &self.sizes {
                let _ = write!(s, " {:>18}", format!("{label} ({slots})"));
            }
            let _ = writeln!(s);
        };
        head(&mut s, "hit ratio");
        for p in self.policies() {
            let _ = write!(s, "{p:<16}");
            for (_, slots) in &self.sizes {
                let v = self.get(p, *slots).map_or("-".into(), |r| format!("{:.4}", r.hit_ratio));
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        head(&mut s, "x LRU / %opt");
        for p in self.policies() {
            let _ = write!(s, "{p:<16}");
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
        head(&mut s, "query/save us");
        for p in self.policies().into_iter().filter(|p| *p != "optimum") {
            let _ = write!(s, "{p:<16}");
            for (_, slots) in &self.sizes {
                let v = self
                    .get(p, *slots)
                    .map_or("-".into(), |r| format!("{:.1} / {:.1}", r.query_ns / 1e3, r.save_ns / 1e3));
                let _ = write!(s, " {v:>18}");
            }
            let _ = writeln!(s);
        }
        s
    }

    /// An SVG line plot of page hit ratio (y) against pool size in slots (x, log scale), one line
    /// per policy, the optimum dashed.
    pub fn svg(&self) -> String {
        let (w, h, ml, mr, mt, mb) = (760.0, 460.0, 70.0, 150.0, 40.0, 60.0);
        let pw = w - ml - mr;
        let ph = h - mt - mb;
        let xs: Vec<f64> = self.sizes.iter().map(|(_, n)| *n as f64).collect();
        let (xmin, xmax) = xs.iter().fold((f64::MAX, f64::MIN), |(a, b), &x| (a.min(x), b.max(x)));
        let (lx0, lx1) = (xmin.log2(), if xmax > xmin { xmax.log2() } else { xmin.log2() + 1.0 });
        let ymax = (self.runs.iter().map(|r| r.hit_ratio).fold(0.0, f64::max) * 1.1).clamp(0.05, 1.0);
        let px = |x: f64| ml + (x.log2() - lx0) / (lx1 - lx0) * pw;
        let py = |y: f64| mt + ph - y / ymax * ph;
        let colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2"];
        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="22" text-anchor="middle" font-size="14">Page hit ratio vs host pool size ({}, {} requests)</text>"#,
            ml + pw / 2.0,
            self.geometry,
            self.requests
        );
        for i in 0..=5 {
            let y = ymax * i as f64 / 5.0;
            let (x1, yy, tx, ty) = (ml + pw, py(y), ml - 6.0, py(y) + 4.0);
            let _ = writeln!(
                s,
                r##"<line x1="{ml}" x2="{x1}" y1="{yy:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{tx}" y="{ty:.1}" text-anchor="end">{y:.3}</text>"##
            );
        }
        for (label, n) in &self.sizes {
            let x = px(*n as f64);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" x2="{x:.1}" y1="{mt}" y2="{}" stroke="#eee"/><text x="{x:.1}" y="{}" text-anchor="middle">{label}</text>"##,
                mt + ph,
                mt + ph + 16.0
            );
        }
        let _ = writeln!(
            s,
            r#"<rect x="{ml}" y="{mt}" width="{pw}" height="{ph}" fill="none" stroke="black"/><text x="{}" y="{}" text-anchor="middle">pool size (slots, log scale)</text><text transform="translate(18,{}) rotate(-90)" text-anchor="middle">page hit ratio</text>"#,
            ml + pw / 2.0,
            h - 16.0,
            mt + ph / 2.0
        );
        for (i, p) in self.policies().into_iter().enumerate() {
            let c = if p == "optimum" { "black" } else { colors[i % colors.len()] };
            let dash = if p == "optimum" { r#" stroke-dasharray="6,4""# } else { "" };
            let pts: Vec<String> = self
                .sizes
                .iter()
                .filter_map(|(_, n)| self.get(p, *n).map(|r| format!("{:.1},{:.1}", px(*n as f64), py(r.hit_ratio))))
                .collect();
            let _ = writeln!(
                s,
                r#"<polyline points="{}" fill="none" stroke="{c}" stroke-width="2"{dash}/>"#,
                pts.join(" ")
            );
            for pt in &pts {
                let (x, y) = pt.split_once(',').expect("x,y");
                let _ = writeln!(s, r#"<circle cx="{x}" cy="{y}" r="3" fill="{c}"/>"#);
            }
            let ly = mt + 10.0 + 20.0 * i as f64;
            let lx = ml + pw + 12.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" x2="{}" y1="{ly}" y2="{ly}" stroke="{c}" stroke-width="2"{dash}/><text x="{}" y="{}">{p}</text>"#,
                lx + 24.0,
                lx + 30.0,
                ly + 4.0
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

/// The `simulate` subcommand: runs, prints the table (or JSON) and writes the plot if asked.
///
/// # Errors
/// As [`run`]; [`Error::Config`] if the plot cannot be written.
pub fn cli(args: &SimulateArgs) -> Result<(), Error> {
    let report = run(args)?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report).map_err(|e| Error::Config(e.to_string()))?);
    } else {
        print!("{}", report.table());
    }
    if let Some(p) = &args.plot {
        std::fs::write(p, report.svg()).map_err(|e| Error::Config(format!("writing plot {}: {e}", p.display())))?;
        if !args.json {
            println!("plot written to {}", p.display());
        }
    }
    Ok(())
}
