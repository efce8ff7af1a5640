//! The data-parallel deployment run: N engine ranks (one per GPU, or several on one device) over one
//! shared host pool, in three phases.
//!
//! 1. **Churn**: the trace's request stream spread round-robin over the ranks, `--inflight` requests
//!    in flight per rank. Per request: query the host tier, restore the leased prefix into free GPU
//!    pages and verify it byte for byte, prefill the rest, save the new pages, release the GPU pages.
//! 2. **Parity**: `--prompts` prompts of `--prefix-blocks` blocks saved through rank 0 are restored
//!    through every other rank from one shared lease and compared byte for byte.
//! 3. **Mixed load**: every rank restores those prefixes and saves new blocks at once, `--inflight`
//!    workers per rank, for `--mixed-rounds` rounds.
//!
//! Reported per rank and in aggregate: restore and save GB/s (GB = 10^9 B, bytes over the phase's
//! wall time), restore latency p50/p99 (submit to completion of one prefix restore), hit ratio,
//! errors and the verification result. With `--reserve-hugepages` (root) it reserves 2 MiB pages for
//! the pool first and prints how much `HugePages_Free` dropped.
//!
//! ```text
//! cargo run --release --example dp_deployment -- --ranks 4 --requests 80     # host backend
//! cargo run --release --features cuda --example dp_deployment -- --backend cuda --gpu-pages 9000 --pool 32GiB --reserve-hugepages
//! ```

use clap::Parser;
use hdrhistogram::Histogram;
use kvtier::BackendKind;
use kvtier::{ContentKey, EngineArenas, Fit, Geometry, HostTier, PolicyKind, Rank, SaveOptions, TierConfig, WaitFor};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Parser, Debug, Clone)]
#[command(about = "N data-parallel ranks over one shared host pool: churn, parity, mixed load")]
struct Args {
    /// Ranks (default: one per GPU with --backend cuda, else 2).
    #[arg(long)]
    ranks: Option<usize>,
    /// Copy backend.
    #[arg(long, default_value = "host", value_parser = str::parse::<BackendKind>)]
    backend: BackendKind,
    /// Trace (Mooncake JSON Lines, plain or zstd); default: the bundled sample.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Requests of the churn phase (from the start of the trace).
    #[arg(long, default_value_t = 80)]
    requests: usize,
    /// Geometry preset.
    #[arg(long, default_value = "glm52")]
    geometry: String,
    /// Host pool size (e.g. 32GiB).
    #[arg(long, default_value = "4GiB", value_parser = kvtier_cli::size::parse_bytes)]
    pool: u64,
    /// GPU pages per rank.
    #[arg(long, default_value_t = 2048)]
    gpu_pages: u64,
    /// Requests (or mixed-load workers) in flight per rank.
    #[arg(long, default_value_t = 2)]
    inflight: usize,
    /// Parity/mixed prompts.
    #[arg(long, default_value_t = 8)]
    prompts: u64,
    /// Blocks per parity/mixed prompt (43 = a 2,700-token GLM-5.2 prompt).
    #[arg(long, default_value_t = 43)]
    prefix_blocks: u64,
    /// Rounds per mixed-load worker (each: one prefix restore and one 43-block save).
    #[arg(long, default_value_t = 8)]
    mixed_rounds: u64,
    /// Reserve 2 MiB hugepages for the pool first (root) and report HugePages_Free.
    #[arg(long)]
    reserve_hugepages: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
}

/// One rank: its arenas, its tier handle and its free GPU pages.
struct Node {
    id: usize,
    arenas: Arc<dyn EngineArenas>,
    rank: Rank,
    free: Mutex<Vec<u64>>,
    freed: Condvar,
}

impl Node {
    fn take(&self, n: usize) -> Vec<u64> {
        let mut f = self.free.lock().unwrap();
        while f.len() < n {
            f = self.freed.wait(f).unwrap();
        }
        let at = f.len() - n;
        f.split_off(at)
    }
    fn give(&self, pages: Vec<u64>) {
        self.free.lock().unwrap().extend(pages);
        self.freed.notify_all();
    }
}

struct Meter {
    restored: AtomicU64,
    saved: AtomicU64,
    pages: AtomicU64,
    hits: AtomicU64,
    errors: AtomicU64,
    verified: AtomicU64,
    /// Restore latencies in ns (HdrHistogram, 3 significant digits).
    latencies_ns: Mutex<Histogram<u64>>,
}

impl Default for Meter {
    fn default() -> Self {
        Meter {
            restored: AtomicU64::new(0),
            saved: AtomicU64::new(0),
            pages: AtomicU64::new(0),
            hits: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            verified: AtomicU64::new(0),
            latencies_ns: Mutex::new(Histogram::new(3).expect("3 significant digits")),
        }
    }
}

#[derive(serde::Serialize, Clone, Debug)]
struct PhaseRank {
    rank: usize,
    restore_gbps: f64,
    save_gbps: f64,
    restore_p50_us: f64,
    restore_p99_us: f64,
    hit_ratio: f64,
    errors: u64,
    verified_pages: u64,
}

fn summarise(id: usize, m: &Meter, wall: f64) -> PhaseRank {
    let l = m.latencies_ns.lock().unwrap();
    let pct = |q: f64| if l.is_empty() { 0.0 } else { l.value_at_quantile(q) as f64 / 1e3 };
    let pages = m.pages.load(Ordering::Relaxed);
    PhaseRank {
        rank: id,
        restore_gbps: m.restored.load(Ordering::Relaxed) as f64 / wall / 1e9,
        save_gbps: m.saved.load(Ordering::Relaxed) as f64 / wall / 1e9,
        restore_p50_us: pct(0.5),
        restore_p99_us: pct(0.99),
        hit_ratio: if pages == 0 { 0.0 } else { m.hits.load(Ordering::Relaxed) as f64 / pages as f64 },
        errors: m.errors.load(Ordering::Relaxed),
        verified_pages: m.verified.load(Ordering::Relaxed),
    }
}

/// Restores the leased prefix of `keys` into pages of `node`, verifies it, prefills the rest and
/// saves it. Returns after the save completed and the pages are back.
fn serve(tier: &HostTier, node: &Node, keys: &[ContentKey], m: &Meter, block_bytes: u64) {
    let n = keys.len();
    let pages = node.take(n);
    let lease = tier.query(keys);
    let h = lease.len();
    m.pages.fetch_add(n as u64, Ordering::Relaxed);
    let mut from = 0;
    if h > 0 {
        let t = Instant::now();
        match node.rank.restore(&lease, &pages[..h], WaitFor::Nothing).and_then(|c| c.wait()) {
            Ok(()) => {
                let ns = t.elapsed().as_nanos().try_into().unwrap_or(u64::MAX);
                m.latencies_ns.lock().unwrap().record(ns).expect("an auto-resizing histogram records any value");
                m.restored.fetch_add(h as u64 * block_bytes, Ordering::Relaxed);
                m.hits.fetch_add(h as u64, Ordering::Relaxed);
                match node.arenas.verify(&pages[..h], &keys[..h]) {
                    Ok(()) => {
                        m.verified.fetch_add(h as u64, Ordering::Relaxed);
                        from = h;
                    }
                    Err(e) => {
                        eprintln!("rank {}: {e}", node.id);
                        m.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            Err(_) => {
                m.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
    drop(lease);
    if let Err(e) = node.arenas.fill(&pages[from..], &keys[from..]) {
        eprintln!("rank {}: fill: {e}", node.id);
        m.errors.fetch_add(1, Ordering::Relaxed);
    }
    match node.rank.save_with(&keys[from..], &pages[from..], WaitFor::Nothing, SaveOptions::new().fit(Fit::Prefix)) {
        Ok(t) => match t.handle.wait() {
            Ok(()) => {
                m.saved.fetch_add(t.saving.len() as u64 * block_bytes, Ordering::Relaxed);
            }
            Err(_) => {
                m.errors.fetch_add(1, Ordering::Relaxed);
            }
        },
        Err(kvtier::TierError::PoolExhausted { .. }) => {}
        Err(_) => {
            m.errors.fetch_add(1, Ordering::Relaxed);
        }
    }
    node.give(pages);
}

fn hugepages_total() -> u64 {
    std::fs::read_to_string("/proc/sys/vm/nr_hugepages").ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0)
}

fn print_phase(name: &str, rows: &[PhaseRank], wall: f64) {
    println!("\n{name} ({wall:.2} s)");
    println!("rank  restore GB/s  save GB/s  restore p50 us  p99 us  hit ratio  errors  verified pages");
    for r in rows {
        println!(
            "{:>4}  {:>12.2}  {:>9.2}  {:>14.0}  {:>6.0}  {:>9.4}  {:>6}  {:>14}",
            r.rank,
            r.restore_gbps,
            r.save_gbps,
            r.restore_p50_us,
            r.restore_p99_us,
            r.hit_ratio,
            r.errors,
            r.verified_pages
        );
    }
    let sum = |f: fn(&PhaseRank) -> f64| rows.iter().map(f).sum::<f64>();
    println!(
        " all  {:>12.2}  {:>9.2}  {:>14}  {:>6}  {:>9}  {:>6}  {:>14}",
        sum(|r| r.restore_gbps),
        sum(|r| r.save_gbps),
        "",
        "",
        "",
        rows.iter().map(|r| r.errors).sum::<u64>(),
        rows.iter().map(|r| r.verified_pages).sum::<u64>()
    );
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let backend = args.backend.resolve();
    let ndev = backend.devices() as usize;
    let ranks = args.ranks.unwrap_or(if backend == BackendKind::Cuda { ndev } else { 2 });
    let geometry = Geometry::preset(&args.geometry, args.gpu_pages)?;
    let block_bytes = geometry.block_bytes();
    let pool_bytes = args.pool;
    let requests = match &args.trace {
        Some(p) => kvtier_cli::trace::load(p)?,
        None => kvtier_cli::trace::sample()?,
    };
    let requests: Vec<_> = requests.into_iter().take(args.requests).collect();

    let mut cfg = TierConfig::new(geometry.clone(), pool_bytes);
    cfg.policy = PolicyKind::Lru;
    cfg.pool.prefault = true;
    let free_before = kvtier::hugetlb_free_pages(None);
    if args.reserve_hugepages {
        let need = pool_bytes.div_ceil(2 << 20);
        let want = hugepages_total() + need.saturating_sub(free_before);
        std::fs::write("/proc/sys/vm/nr_hugepages", want.to_string())
            .map_err(|e| format!("reserving {want} hugepages (needs root): {e}"))?;
        if kvtier::hugetlb_free_pages(None) >= need {
            cfg.pool.backing = kvtier::BackingChoice::HugeTlb;
        } else {
            println!(
                "only {} of {need} hugepages could be reserved; the pool falls back to automatic backing",
                kvtier::hugetlb_free_pages(None)
            );
        }
    }
    let free_reserved = kvtier::hugetlb_free_pages(None);
    let t0 = Instant::now();
    let tier = HostTier::new(cfg)?;
    let setup = t0.elapsed().as_secs_f64();
    let free_after = kvtier::hugetlb_free_pages(None);
    println!(
        "pool: {} slots x {} B = {:.2} GB, backing {}, mapped and prefaulted in {setup:.2} s; HugePages_Free {} -> {} \
         (reserved) -> {} (after mapping: dropped by {} = {:.2} GiB)",
        tier.capacity(),
        geometry.slot_bytes(),
        tier.capacity() as f64 * geometry.slot_bytes() as f64 / 1e9,
        tier.pool().backing().name(),
        free_before,
        free_reserved,
        free_after,
        free_reserved.saturating_sub(free_after),
        free_reserved.saturating_sub(free_after) as f64 * 2.0 / 1024.0
    );

    let t1 = Instant::now();
    let mut nodes = Vec::new();
    for id in 0..ranks {
        let arenas = backend.arenas((id % ndev) as u32, &geometry)?;
        let rank = tier.attach(arenas.backend()?)?;
        nodes.push(Node { id, arenas, rank, free: Mutex::new((0..args.gpu_pages).collect()), freed: Condvar::new() });
    }
    println!(
        "{ranks} ranks on {} device(s), backend {}, {} GPU pages each; attached (pool registered) in {:.2} s",
        ndev.min(ranks),
        backend,
        args.gpu_pages,
        t1.elapsed().as_secs_f64()
    );
    let ns = tier.namespace();
    let max_pages = args.gpu_pages as usize / args.inflight.max(1);
    let page_tokens = geometry.page_tokens();

    // Phase 1: churn.
    let meters: Vec<Meter> = (0..ranks).map(|_| Meter::default()).collect();
    let t = Instant::now();
    std::thread::scope(|s| {
        for (node, m) in nodes.iter().zip(&meters) {
            let mine: Vec<_> = requests.iter().skip(node.id).step_by(ranks).collect();
            let next = Arc::new(AtomicUsize::new(0));
            for _ in 0..args.inflight {
                let (mine, next, tier, ns) = (mine.clone(), next.clone(), &tier, ns);
                s.spawn(move || loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(r) = mine.get(i) else { break };
                    let mut keys = r.page_keys(&ns, page_tokens);
                    keys.truncate(max_pages);
                    serve(tier, node, &keys, m, block_bytes);
                });
            }
        }
    });
    let wall1 = t.elapsed().as_secs_f64();
    let churn: Vec<PhaseRank> = meters.iter().enumerate().map(|(i, m)| summarise(i, m, wall1)).collect();
    print_phase("phase 1: churn (trace requests, all ranks)", &churn, wall1);
    let evictions = tier.stats().evictions;
    println!("evictions so far: {evictions} (pool of {} slots)", tier.capacity());

    // Phase 2: parity. Prompts saved through rank 0, restored through every other rank.
    let prompts: Vec<Vec<ContentKey>> = (0..args.prompts)
        .map(|p| (0..args.prefix_blocks).map(|j| ns.trace_page_key((1u64 << 40) + p, j)).collect())
        .collect();
    let mut parity_ok = true;
    let mut parity_pages = 0u64;
    for keys in &prompts {
        let src = nodes[0].take(keys.len());
        nodes[0].arenas.fill(&src, keys)?;
        nodes[0].rank.save(keys, &src, WaitFor::Nothing)?.handle.wait()?;
        nodes[0].give(src);
        let lease = tier.query_shared(keys, (ranks - 1).max(1) as u32);
        if lease.len() != keys.len() {
            parity_ok = false;
            println!("parity: only {} of {} blocks resident after the save", lease.len(), keys.len());
            continue;
        }
        for node in &nodes[1..] {
            let dst = node.take(keys.len());
            node.rank.restore(&lease, &dst, WaitFor::Nothing)?.wait()?;
            match node.arenas.verify(&dst, keys) {
                Ok(()) => parity_pages += keys.len() as u64,
                Err(e) => {
                    parity_ok = false;
                    println!("parity: rank {}: {e}", node.id);
                }
            }
            node.give(dst);
        }
    }
    println!(
        "\nphase 2: parity: {} prompts x {} blocks saved through rank 0, {parity_pages} pages restored through ranks \
         1..{ranks} byte-identical: {}",
        args.prompts,
        args.prefix_blocks,
        if parity_ok { "PASS" } else { "FAIL" }
    );

    // Phase 3: mixed load: every rank restores prefixes and saves new blocks at once.
    let meters: Vec<Meter> = (0..ranks).map(|_| Meter::default()).collect();
    let fresh = AtomicU64::new(0);
    let t = Instant::now();
    std::thread::scope(|s| {
        for (node, m) in nodes.iter().zip(&meters) {
            for w in 0..args.inflight {
                let (prompts, tier, fresh, ns) = (&prompts, &tier, &fresh, ns);
                s.spawn(move || {
                    for round in 0..args.mixed_rounds {
                        let keys = &prompts[(node.id + w + round as usize) % prompts.len()];
                        serve(tier, node, keys, m, block_bytes);
                        let f = fresh.fetch_add(1, Ordering::Relaxed);
                        let new: Vec<ContentKey> =
                            (0..args.prefix_blocks).map(|j| ns.trace_page_key((2u64 << 40) + f, j)).collect();
                        serve(tier, node, &new, m, block_bytes);
                    }
                });
            }
        }
    });
    let wall3 = t.elapsed().as_secs_f64();
    let mixed: Vec<PhaseRank> = meters.iter().enumerate().map(|(i, m)| summarise(i, m, wall3)).collect();
    print_phase("phase 3: mixed load (prefix restores and saves on every rank at once)", &mixed, wall3);

    let errors: u64 = churn.iter().chain(&mixed).map(|r| r.errors).sum();
    let s = tier.stats();
    println!(
        "\ntier: {} saved, {} restored, {} evicted, {} save failures, {} restore failures; errors {errors}; parity {}",
        s.saved_blocks,
        s.restored_blocks,
        s.evictions,
        s.save_failed_blocks,
        s.restore_failed_blocks,
        if parity_ok { "PASS" } else { "FAIL" }
    );
    if args.json {
        let j = serde_json::json!({ "ranks": ranks, "backend": backend, "churn": churn, "mixed": mixed,
            "parity_ok": parity_ok, "errors": errors, "tier": s, "pool_backing": tier.pool().backing().name() });
        println!("{}", serde_json::to_string_pretty(&j)?);
    }
    for n in nodes {
        n.rank.shutdown(Duration::from_secs(60))?;
    }
    if args.reserve_hugepages {
        drop(tier);
    }
    if errors > 0 || !parity_ok {
        return Err("errors or parity failure".into());
    }
    Ok(())
}
