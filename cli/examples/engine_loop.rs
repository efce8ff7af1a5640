//! A small serving-engine loop over one shared host tier: the way an engine wires kvtier in.
//!
//! N rank threads (data-parallel engine ranks, one per GPU) share one `HostTier`. Requests from the
//! trace are spread round-robin over the ranks. Each rank keeps a simulated HBM prefix cache over its
//! own GPU pages. Per request a rank:
//!
//! 1. probes its HBM prefix cache for the longest cached prefix (those pages are used in place);
//! 2. queries the host tier for the next run of pages and takes a lease on the hits;
//! 3. reserves free GPU pages (evicting HBM-cached pages, never pages still being saved: the rank's
//!    `load().save_gpu_pages` is what it must not reuse), restores the leased blocks into them and
//!    waits;
//! 4. prefills the rest (writes the bytes derived from each page's key);
//! 5. "runs" the request: checks every page of the prompt byte for byte;
//! 6. on release keeps the pages in its HBM cache and saves the sealed pages to the host tier,
//!    fire-and-forget: a completion callback unpins the GPU pages when the copy has landed.
//!
//! Any host-tier failure (pool full, injected copy faults, a restore error) degrades to a full
//! prefill; the output is still verified correct. Runs on the host backend by default; with
//! `--features cuda` and `--backend cuda`, rank r uses GPU r (modulo the GPU count). It prints per
//! rank where the pages came from, then the host tier's restores and their latency (p50, p99).
//!
//! ```text
//! cargo run --release --example engine_loop
//! cargo run --release --features cuda --example engine_loop -- --backend cuda
//! ```
//!
//! # Why the defaults
//! The host tier only serves a page that a rank's own HBM cache lacks: a prefix another rank
//! computed, or one its HBM evicted. The first 80 requests of the conversation trace (the bundled
//! sample) share only their first block, a system prompt that every rank keeps in HBM, and no
//! conversation returns among them, so a run over them never restores anything. Conversations return
//! minutes later (the first follow-up is request 134, the median about 420 requests after the turn
//! before), so the default run takes the first 400 requests of the whole trace shipped in `data/`,
//! keeps each prompt's first 16 pages (1,024 tokens; a returning conversation still shares them) and
//! gives each rank 64 GPU pages (four prompts) and the shared host pool 4 GiB (1,244 GLM-5.2 slots,
//! about 150 prompts): the host tier then holds what HBM has dropped, and about 15 requests restore
//! 8 pages each from it. It takes 20 to 35 s and 5 GB of memory on a 2-core machine without a GPU.

use clap::Parser;
use hdrhistogram::Histogram;
use kvtier::BackendKind;
use kvtier::FaultyBackend;
use kvtier::{ContentKey, Fit, Geometry, HostTier, PolicyKind, SaveOptions, TierConfig, WaitFor};
use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "A serving-engine loop over one host tier shared by several ranks")]
struct Args {
    /// Engine ranks (threads; one GPU each with --backend cuda).
    #[arg(long, default_value_t = 2)]
    ranks: usize,
    /// Requests to run from the start of the trace.
    #[arg(long, default_value_t = 400)]
    requests: usize,
    /// Trace (Mooncake JSON Lines, plain or zstd); default: the whole conversation trace in data/.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/data/mooncake_conversation_trace.jsonl.zst"))]
    trace: std::path::PathBuf,
    /// Geometry preset.
    #[arg(long, default_value = "glm52")]
    geometry: String,
    /// Host pool size in bytes (e.g. 4GiB; GB = 10^9 B, GiB = 2^30 B), shared by all ranks.
    #[arg(long, default_value = "4GiB", value_parser = kvtier_cli::size::parse_bytes)]
    pool: u64,
    /// GPU pages per rank (the rank's HBM prefix cache and working pages).
    #[arg(long, default_value_t = 64)]
    gpu_pages: u64,
    /// Longest prompt in pages (longer prompts are truncated, as an engine's context limit would).
    #[arg(long, default_value_t = 16)]
    max_pages: usize,
    /// Fraction of copy batches that fail (injected faults).
    #[arg(long, default_value_t = 0.05)]
    fault_rate: f64,
    /// Copy backend.
    #[arg(long, default_value = "host", value_parser = str::parse::<BackendKind>)]
    backend: BackendKind,
}

#[derive(Copy, Clone, PartialEq, Eq)]
enum Page {
    Free,
    /// Holds the block of `key_of[page]`, last used at `tick`.
    Cached {
        tick: u64,
    },
    InUse,
}

/// One rank's GPU pages and HBM prefix cache.
struct Hbm {
    pages: Vec<Page>,
    /// Saves in flight that still read each page: such a page is never handed out for writing.
    saving: Vec<u32>,
    key_of: Vec<Option<ContentKey>>,
    cached: HashMap<ContentKey, u64>,
    tick: u64,
}

impl Hbm {
    fn new(n: u64) -> Self {
        let n = n as usize;
        Hbm { pages: vec![Page::Free; n], saving: vec![0; n], key_of: vec![None; n], cached: HashMap::new(), tick: 0 }
    }

    /// Takes `n` pages: free ones first, then the least recently used cached pages with no save in
    /// flight. `None` if not enough can be had now.
    fn take(&mut self, n: usize) -> Option<Vec<u64>> {
        let mut free: Vec<u64> =
            (0..self.pages.len() as u64).filter(|&p| self.pages[p as usize] == Page::Free).collect();
        if free.len() < n {
            let mut evictable: Vec<(u64, u64)> = (0..self.pages.len() as u64)
                .filter_map(|p| match self.pages[p as usize] {
                    Page::Cached { tick } if self.saving[p as usize] == 0 => Some((tick, p)),
                    _ => None,
                })
                .collect();
            if free.len() + evictable.len() < n {
                return None;
            }
            evictable.sort_unstable();
            for &(_, p) in &evictable[..n - free.len()] {
                if let Some(k) = self.key_of[p as usize].take() {
                    if self.cached.get(&k) == Some(&p) {
                        self.cached.remove(&k);
                    }
                }
                free.push(p);
            }
        }
        free.truncate(n);
        for &p in &free {
            self.pages[p as usize] = Page::InUse;
        }
        Some(free)
    }
}

#[derive(Debug)]
struct RankReport {
    requests: u64,
    pages: u64,
    hbm_hit_pages: u64,
    host_hit_pages: u64,
    prefilled_pages: u64,
    degraded_requests: u64,
    save_errors: u64,
    verified_pages: u64,
    /// Latency of each successful restore, submission to completion, in ns.
    restore_ns: Histogram<u64>,
}

impl Default for RankReport {
    fn default() -> Self {
        RankReport {
            requests: 0,
            pages: 0,
            hbm_hit_pages: 0,
            host_hit_pages: 0,
            prefilled_pages: 0,
            degraded_requests: 0,
            save_errors: 0,
            verified_pages: 0,
            restore_ns: Histogram::new(3).expect("3 significant digits"),
        }
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let requests = kvtier_cli::trace::load(&args.trace)?;
    let requests: Vec<_> = requests.into_iter().take(args.requests).collect();
    let geometry = Geometry::preset(&args.geometry, args.gpu_pages)?;
    let pool_bytes = args.pool;
    let mut cfg = TierConfig::new(geometry.clone(), pool_bytes);
    cfg.policy = PolicyKind::Lru;
    let tier = HostTier::new(cfg)?;
    println!(
        "tier: {} slots of {} B ({}), {} ranks, backend {}, fault rate {}",
        tier.capacity(),
        geometry.slot_bytes(),
        tier.pool().backing().name(),
        args.ranks,
        args.backend,
        args.fault_rate
    );
    let started = Instant::now();
    let reports: Vec<RankReport> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.ranks)
            .map(|r| {
                let (tier, geometry, args, requests) = (&tier, &geometry, &args, &requests);
                s.spawn(move || rank_loop(r, tier, geometry, args, requests))
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect::<Result<_, String>>()
    })?;
    let wall = started.elapsed().as_secs_f64();
    println!("\nrank  requests  pages  hbm-hit  host-hit  prefilled  degraded  save-err  verified");
    for (r, x) in reports.iter().enumerate() {
        println!(
            "{r:>4}  {:>8}  {:>5}  {:>7}  {:>8}  {:>9}  {:>8}  {:>8}  {:>8}",
            x.requests,
            x.pages,
            x.hbm_hit_pages,
            x.host_hit_pages,
            x.prefilled_pages,
            x.degraded_requests,
            x.save_errors,
            x.verified_pages
        );
    }
    let s = tier.stats();
    println!(
        "\ntier: {} blocks saved, {} restored, {} evictions, {} save failures, {} restore failures; wall {wall:.1} s",
        s.saved_blocks, s.restored_blocks, s.evictions, s.save_failed_blocks, s.restore_failed_blocks
    );
    let mut restore_ns = Histogram::<u64>::new(3).expect("3 significant digits");
    for x in &reports {
        restore_ns.add(&x.restore_ns).expect("auto-resizing histograms always add");
    }
    let us = |q: f64| restore_ns.value_at_quantile(q) as f64 / 1e3;
    let host_hits: u64 = reports.iter().map(|x| x.host_hit_pages).sum();
    if restore_ns.is_empty() {
        println!("host tier: no restore (no request found a prefix in the host tier that its rank's HBM lacked)");
    } else {
        println!(
            "host tier: {} restores of {host_hits} pages; restore latency p50 {:.0} us, p99 {:.0} us, max {:.0} us",
            restore_ns.len(),
            us(0.5),
            us(0.99),
            us(1.0)
        );
    }
    let pages: u64 = reports.iter().map(|x| x.pages).sum();
    let verified: u64 = reports.iter().map(|x| x.verified_pages).sum();
    println!("verification: {verified} of {pages} prompt pages correct");
    if verified != pages {
        return Err("verification failed".into());
    }
    Ok(())
}

fn rank_loop(
    rank: usize,
    tier: &HostTier,
    geometry: &Geometry,
    args: &Args,
    requests: &[kvtier_cli::trace::TraceRequest],
) -> Result<RankReport, String> {
    let arenas = args.backend.arenas(rank as u32 % args.backend.devices(), geometry).map_err(|e| e.to_string())?;
    let backend = arenas.backend().map_err(|e| e.to_string())?;
    let backend = Box::new(FaultyBackend::new(backend, args.fault_rate, 0x5eed + rank as u64));
    let handle = tier.attach(backend).map_err(|e| e.to_string())?;
    let hbm = Arc::new((Mutex::new(Hbm::new(args.gpu_pages)), Condvar::new()));
    let ns = handle.namespace();
    let mut rep = RankReport::default();
    for req in requests.iter().skip(rank).step_by(args.ranks) {
        let mut keys = req.page_keys(&ns, geometry.page_tokens());
        keys.truncate(args.max_pages.min(args.gpu_pages as usize));
        let n = keys.len();
        rep.requests += 1;
        rep.pages += n as u64;
        // 1. HBM prefix cache.
        let (mut pages, g) = {
            let mut st = hbm.0.lock().unwrap();
            let mut pages = Vec::new();
            for k in &keys {
                match st.cached.get(k).copied() {
                    Some(p) if matches!(st.pages[p as usize], Page::Cached { .. }) && !pages.contains(&p) => {
                        pages.push(p)
                    }
                    _ => break,
                }
            }
            for &p in &pages {
                st.pages[p as usize] = Page::InUse;
            }
            let g = pages.len();
            (pages, g)
        };
        rep.hbm_hit_pages += g as u64;
        // 2. Host tier query for the rest of the prefix.
        let lease = tier.query(&keys[g..]);
        // 3. Reserve GPU pages; wait for in-flight saves to release pages if needed.
        let fresh = {
            let mut st = hbm.0.lock().unwrap();
            loop {
                if let Some(p) = st.take(n - g) {
                    break p;
                }
                st = hbm.1.wait(st).unwrap();
            }
        };
        pages.extend_from_slice(&fresh);
        let h = lease.len();
        let t0 = Instant::now();
        let restored = h > 0
            && match handle.restore(&lease, &pages[g..g + h], WaitFor::Nothing) {
                Ok(c) => c.wait().is_ok(),
                Err(_) => false,
            };
        if restored {
            rep.restore_ns
                .record(t0.elapsed().as_nanos().try_into().unwrap_or(u64::MAX))
                .expect("an auto-resizing histogram records any value");
        }
        drop(lease);
        let from = if restored {
            rep.host_hit_pages += h as u64;
            g + h
        } else {
            if h > 0 {
                rep.degraded_requests += 1;
            }
            g
        };
        // 4. Prefill the rest.
        arenas.fill(&pages[from..], &keys[from..]).map_err(|e| e.to_string())?;
        rep.prefilled_pages += (n - from) as u64;
        // 5. "Run" the request: every page of the prompt must hold its key's bytes.
        arenas.verify(&pages, &keys).map_err(|e| format!("rank {rank}: {e}"))?;
        rep.verified_pages += n as u64;
        // 6. Release: keep pages in the HBM cache; save sealed pages fire-and-forget.
        {
            let mut st = hbm.0.lock().unwrap();
            st.tick += 1;
            let tick = st.tick;
            for (k, &p) in keys.iter().zip(&pages) {
                if let Some(old) = st.cached.insert(*k, p) {
                    // The key was cached in another page too: forget that copy (it is freed now, or
                    // by `take` once the saves reading it have landed).
                    if old != p && st.pages[old as usize] != Page::InUse {
                        st.key_of[old as usize] = None;
                        if st.saving[old as usize] == 0 {
                            st.pages[old as usize] = Page::Free;
                        }
                    }
                }
                st.key_of[p as usize] = Some(*k);
                st.pages[p as usize] = Page::Cached { tick };
            }
        }
        // Every page counts as "being saved" from before the save is submitted, so a completion
        // that lands at once can never run ahead of the count.
        {
            let mut st = hbm.0.lock().unwrap();
            for &p in &pages {
                st.saving[p as usize] += 1;
            }
        }
        let release = |ps: &[u64]| {
            let mut st = hbm.0.lock().unwrap();
            for &p in ps {
                st.saving[p as usize] -= 1;
            }
            hbm.1.notify_all();
        };
        match handle.save_with(&keys, &pages, WaitFor::Nothing, SaveOptions::new().fit(Fit::Prefix)) {
            Ok(t) => {
                let mut copied = vec![false; n];
                for &i in &t.saving {
                    copied[i] = true;
                }
                let saved: Vec<u64> = (0..n).filter(|&i| copied[i]).map(|i| pages[i]).collect();
                let untouched: Vec<u64> = (0..n).filter(|&i| !copied[i]).map(|i| pages[i]).collect();
                release(&untouched);
                let hbm2 = hbm.clone();
                t.handle.on_complete(move |_| {
                    let mut st = hbm2.0.lock().unwrap();
                    for &p in &saved {
                        st.saving[p as usize] -= 1;
                    }
                    hbm2.1.notify_all();
                });
            }
            Err(_) => {
                rep.save_errors += 1;
                release(&pages);
            }
        }
    }
    handle.shutdown(std::time::Duration::from_secs(60)).map_err(|e| e.to_string())?;
    Ok(rep)
}
