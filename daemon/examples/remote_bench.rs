//! Measures the tier daemon: the control round trip of a 43-key query, the set-up of a shared pool,
//! and (feature `cuda`) copies from connected processes against copies in one process.
//!
//! ```sh
//! cargo run --release -p kvtierd --example remote_bench -- rtt                # server on a thread
//! cargo run --release -p kvtierd --example remote_bench -- rtt --socket S     # a running kvtierd
//! cargo run --release -p kvtierd --example remote_bench -- pool --bytes 4GiB --backing plain
//! cargo run --release -p kvtierd --features cuda --example remote_bench -- gpu --socket S --procs 4
//! ```

use clap::{Parser, Subcommand};
use kvtier::MemcpyArenas;
use kvtier::Server;
use kvtier::{ArenaSpec, BackingChoice, ContentKey, EngineArenas, Geometry, HostTier, PoolConfig, TierConfig, WaitFor};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand)]
enum What {
    /// Control round trips: query (hit and miss), a resident save, a whole restore's messages.
    Rtt {
        /// A running kvtierd's socket (default: a server on a thread of this process).
        #[arg(long)]
        socket: Option<String>,
        /// Keys per query.
        #[arg(long, default_value_t = 43)]
        keys: usize,
        /// Measured iterations per operation.
        #[arg(long, default_value_t = 20_000)]
        iters: usize,
    },
    /// Set-up time of a shared pool (memfd) and of a private one, prefaulted.
    Pool {
        /// Pool size (e.g. 4GiB).
        #[arg(long, default_value = "1GiB")]
        bytes: String,
        /// auto, hugetlb, thp or plain.
        #[arg(long, default_value = "auto")]
        backing: String,
    },
    /// (feature cuda) Copies between GPU 0 and the pool: one process's save/restore GB/s, connected
    /// or in process, and the aggregate restore GB/s of N processes against N threads.
    #[cfg(feature = "cuda")]
    Gpu(gpu::GpuArgs),
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e6
}

fn report(what: &str, mut v: Vec<Duration>) {
    v.sort_unstable();
    let mean = v.iter().map(|d| d.as_secs_f64()).sum::<f64>() / v.len() as f64 * 1e6;
    println!(
        "{what:<44} p50 {:>7.1} us   p99 {:>7.1} us   mean {:>7.1} us   ({} runs)",
        percentile(&v, 0.5),
        percentile(&v, 0.99),
        mean,
        v.len()
    );
}

fn time(iters: usize, mut f: impl FnMut()) -> Vec<Duration> {
    for _ in 0..iters / 10 {
        f();
    }
    (0..iters)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed()
        })
        .collect()
}

fn small_geometry() -> Geometry {
    Geometry::new("bench-model", 16, vec![ArenaSpec::packed("k", 4096, 1), ArenaSpec::packed("v", 4096, 1)]).unwrap()
}

fn rtt(socket: Option<String>, n: usize, iters: usize) {
    let g = small_geometry();
    let _dir;
    let path = match socket {
        Some(s) => s,
        None => {
            _dir = tempfile::tempdir().unwrap();
            let p = _dir.path().join("kvtierd.sock");
            let cfg = TierConfig::new(g.clone(), 1024 * g.slot_bytes()).with_backing(BackingChoice::Plain);
            let server = Server::bind(&p, HostTier::new_shared(cfg).unwrap()).unwrap();
            std::thread::spawn(move || server.run());
            p.to_string_lossy().into_owned()
        }
    };
    let remote = HostTier::connect(&path).expect("connecting to the daemon");
    let local = HostTier::new(
        TierConfig::new(remote.geometry().clone(), 1024 * remote.geometry().slot_bytes())
            .with_backing(BackingChoice::Plain),
    )
    .unwrap();
    println!("{n}-key operations, {iters} runs each (after {} warm-up runs)", iters / 10);
    for (name, tier) in [("connected", &remote), ("in process", &local)] {
        let rg = tier.geometry().with_pages(2 * n as u64).unwrap();
        let arenas = Arc::new(MemcpyArenas::new(&rg).unwrap());
        let rank = tier.attach(arenas.backend().unwrap()).unwrap();
        let keys: Vec<ContentKey> = (0..n as u64).map(|i| tier.namespace().trace_page_key(7, i)).collect();
        let miss: Vec<ContentKey> = (0..n as u64).map(|i| tier.namespace().trace_page_key(8, i)).collect();
        let pages: Vec<u64> = (0..n as u64).collect();
        arenas.fill(&pages, &keys).unwrap();
        rank.save(&keys, &pages, WaitFor::Nothing).unwrap().handle.wait().unwrap();
        let mut held = Vec::with_capacity(1);
        report(
            &format!("{name}: query, {n} hits, lease dropped"),
            time(iters, || {
                held.push(tier.try_query_shared(&keys, 1).unwrap());
                assert_eq!(held[0].len(), n);
                held.clear();
            }),
        );
        report(
            &format!("{name}: query, {n} misses"),
            time(iters, || {
                assert_eq!(tier.try_query_shared(&miss, 1).unwrap().len(), 0);
            }),
        );
        report(
            &format!("{name}: save, {n} resident keys"),
            time(iters, || {
                assert_eq!(rank.save(&keys, &pages, WaitFor::Nothing).unwrap().resident, n);
            }),
        );
        let dst: Vec<u64> = (n as u64..2 * n as u64).collect();
        report(
            &format!("{name}: query + restore {n} blocks + wait"),
            time(iters / 10, || {
                let lease = tier.query(&keys);
                rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait().unwrap();
            }),
        );
        rank.shutdown(Duration::from_secs(60)).unwrap();
    }
}

fn pool(bytes: &str, backing: &str) {
    let bytes = kvtier::parse_bytes(bytes).unwrap();
    let backing = match backing {
        "auto" => BackingChoice::Auto,
        "hugetlb" => BackingChoice::HugeTlb,
        "thp" => BackingChoice::TransparentHuge,
        _ => BackingChoice::Plain,
    };
    let slot = 2 << 20;
    for shared in [true, false] {
        let cfg = PoolConfig::new(bytes).with_backing(backing).with_prefault(true);
        let t = Instant::now();
        let p = if shared { kvtier::HostPool::new_shared(slot, &cfg) } else { kvtier::HostPool::new(slot, &cfg) };
        let p = p.unwrap();
        let set_up = t.elapsed();
        let name = p.backing().name();
        let t = Instant::now();
        drop(p);
        println!(
            "{} pool, {:.2} GiB, {name} pages: set up and prefaulted in {:.1} ms, unmapped in {:.1} ms",
            if shared { "shared (memfd)" } else { "private" },
            bytes as f64 / (1u64 << 30) as f64,
            set_up.as_secs_f64() * 1e3,
            t.elapsed().as_secs_f64() * 1e3
        );
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::*;
    use kvtier::BackendKind;
    use std::io::{BufRead, Write};

    #[derive(clap::Args)]
    pub struct GpuArgs {
        /// The running kvtierd's socket (serving the llama3-8b geometry).
        #[arg(long)]
        pub socket: String,
        /// Processes (and threads) for the aggregate restore.
        #[arg(long, default_value_t = 4)]
        pub procs: usize,
        /// Blocks per batch (llama3-8b: 2 MiB each).
        #[arg(long, default_value_t = 256)]
        pub blocks: usize,
        /// Batches per measurement.
        #[arg(long, default_value_t = 20)]
        pub rounds: usize,
        /// Internal: run as one of the measured processes (index).
        #[arg(long, hide = true)]
        pub child: Option<usize>,
    }

    /// CLOCK_MONOTONIC in seconds: comparable across processes.
    fn now() -> f64 {
        let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).expect("clock_gettime");
        t.tv_sec() as f64 + t.tv_nsec() as f64 * 1e-9
    }

    /// One rank: its own CUDA arenas on GPU 0, `blocks` saved under keys of `salt`, then `rounds`
    /// restores of them. Returns (bytes restored, start, end) and the save GB/s.
    fn one_rank(tier: &HostTier, salt: u64, a: &GpuArgs, go: impl FnOnce()) -> (u64, f64, f64, f64) {
        let g = tier.geometry().with_pages(2 * a.blocks as u64).unwrap();
        let arenas = BackendKind::Cuda.arenas(0, &g).unwrap();
        let t = Instant::now();
        let rank = tier.attach(arenas.backend().unwrap()).unwrap();
        let attach = t.elapsed();
        let keys: Vec<ContentKey> = (0..a.blocks as u64).map(|i| tier.namespace().trace_page_key(salt, i)).collect();
        let src: Vec<u64> = (0..a.blocks as u64).collect();
        arenas.fill(&src, &keys).unwrap();
        let t = Instant::now();
        rank.save(&keys, &src, WaitFor::Nothing).unwrap().handle.wait().unwrap();
        let save_gbs = (a.blocks as u64 * g.block_bytes()) as f64 / t.elapsed().as_secs_f64() / 1e9;
        let dst: Vec<u64> = (a.blocks as u64..2 * a.blocks as u64).collect();
        let lease = tier.query_shared(&keys, a.rounds as u32 + 1);
        rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait().unwrap(); // warm-up
        arenas.verify(&dst, &keys).unwrap();
        go();
        let start = now();
        for _ in 0..a.rounds {
            rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait().unwrap();
        }
        let end = now();
        arenas.verify(&dst, &keys).unwrap();
        eprintln!("rank {salt}: attach (pool registration) {:.1} ms", attach.as_secs_f64() * 1e3);
        (a.rounds as u64 * a.blocks as u64 * g.block_bytes(), start, end, save_gbs)
    }

    fn aggregate(parts: &[(u64, f64, f64, f64)]) -> f64 {
        let bytes: u64 = parts.iter().map(|p| p.0).sum();
        let start = parts.iter().map(|p| p.1).fold(f64::MAX, f64::min);
        let end = parts.iter().map(|p| p.2).fold(0.0, f64::max);
        bytes as f64 / (end - start) / 1e9
    }

    pub fn run(a: GpuArgs) {
        if let Some(i) = a.child {
            let tier = HostTier::connect(&a.socket).unwrap();
            let r = one_rank(&tier, 1000 + i as u64, &a, || {
                println!("READY");
                std::io::stdout().flush().unwrap();
                let mut s = String::new();
                std::io::stdin().lock().read_line(&mut s).unwrap();
            });
            println!("RESULT {} {} {} {}", r.0, r.1, r.2, r.3);
            return;
        }
        let remote = HostTier::connect(&a.socket).unwrap();
        let g = remote.geometry().clone();
        println!(
            "daemon pool: {} slots of {} B, {} pages; {} blocks x {} rounds per rank",
            remote.capacity(),
            g.slot_bytes(),
            remote.pool().backing().name(),
            a.blocks,
            a.rounds
        );
        let local = HostTier::new(TierConfig::new(g.clone(), remote.pool().mapped_bytes())).unwrap();
        for (name, tier) in [("connected", &remote), ("in process", &local)] {
            let r = one_rank(tier, 1, &a, || {});
            println!("one rank, {name}: save {:.1} GB/s, restore {:.1} GB/s", r.3, aggregate(&[r]));
        }
        // N threads of one process (in-process tier), all started together.
        let barrier = std::sync::Barrier::new(a.procs);
        let parts: Vec<_> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..a.procs)
                .map(|i| {
                    let (local, a, barrier) = (&local, &a, &barrier);
                    s.spawn(move || {
                        one_rank(local, 100 + i as u64, a, || {
                            barrier.wait();
                        })
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        println!("{} threads, one process: aggregate restore {:.1} GB/s", a.procs, aggregate(&parts));
        drop(local);
        // N processes, each connected, started together.
        let exe = std::env::current_exe().unwrap();
        let mut kids: Vec<_> = (0..a.procs)
            .map(|i| {
                std::process::Command::new(&exe)
                    .args(["gpu", "--socket", &a.socket, "--blocks", &a.blocks.to_string()])
                    .args(["--rounds", &a.rounds.to_string(), "--child", &i.to_string()])
                    .stdin(std::process::Stdio::piped())
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let mut outs: Vec<_> =
            kids.iter_mut().map(|k| std::io::BufReader::new(k.stdout.take().unwrap()).lines()).collect();
        for o in &mut outs {
            assert_eq!(o.next().unwrap().unwrap(), "READY");
        }
        for k in &mut kids {
            writeln!(k.stdin.as_mut().unwrap(), "GO").unwrap();
        }
        let parts: Vec<_> = outs
            .iter_mut()
            .map(|o| {
                let l = o.next().unwrap().unwrap();
                let v: Vec<f64> = l.strip_prefix("RESULT ").unwrap().split(' ').map(|x| x.parse().unwrap()).collect();
                (v[0] as u64, v[1], v[2], v[3])
            })
            .collect();
        for mut k in kids {
            assert!(k.wait().unwrap().success());
        }
        println!("{} processes, connected: aggregate restore {:.1} GB/s", a.procs, aggregate(&parts));
    }
}

fn main() {
    match Args::parse().what {
        What::Rtt { socket, keys, iters } => rtt(socket, keys, iters),
        What::Pool { bytes, backing } => pool(&bytes, &backing),
        #[cfg(feature = "cuda")]
        What::Gpu(a) => gpu::run(a),
    }
}
