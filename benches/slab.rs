//! Slab pool benchmarks.
//!
//! - `slot_alloc_free`: one `alloc` + `free` pair on a `HostPool` (lock-free sharded free list)
//!   against a `Mutex<Vec<u32>>` free list, in the same run: single thread (`single`), then 1, 2, 4,
//!   8 and 16 threads contending (`threads/N`, throughput = pairs per second over all threads).
//! - `pool_setup`: time to map and prefault a 1 GiB pool with each backing available here (hugetlb
//!   only when 512 pages can be reserved, which needs root; the old `nr_hugepages` is restored).
//!   Timed: mmap, madvise and the prefault (one write per backing page); not the unmap.
//!
//! Run: `cargo bench --bench slab -- --warm-up-time 1 --measurement-time 2`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput};
use kvtier::pool::{hugetlb_free_pages, Backing, BackingChoice, HostPool, PoolConfig};
use std::hint::black_box;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

const SLOTS: u32 = 4096;
const SLOT_BYTES: u64 = 256;
const GIB: u64 = 1 << 30;

/// The baseline: a free list behind one mutex.
struct MutexList(Mutex<Vec<u32>>);

impl MutexList {
    fn new(n: u32) -> Self {
        MutexList(Mutex::new((0..n).rev().collect()))
    }
    fn alloc(&self) -> Option<u32> {
        self.0.lock().unwrap().pop()
    }
    fn free(&self, id: u32) {
        self.0.lock().unwrap().push(id)
    }
}

trait SlotAlloc: Sync {
    fn pair(&self);
}

impl SlotAlloc for HostPool {
    #[inline]
    fn pair(&self) {
        let s = self.alloc().expect("a free slot");
        self.free(black_box(s));
    }
}

impl SlotAlloc for MutexList {
    #[inline]
    fn pair(&self) {
        let s = self.alloc().expect("a free slot");
        self.free(black_box(s));
    }
}

/// `threads` threads each run `iters` alloc+free pairs after a common barrier; the time from the
/// first thread's start to the last thread's finish (each thread reads its own clock, so a slow
/// main thread cannot shorten it).
fn contended<A: SlotAlloc>(a: &A, threads: usize, iters: u64) -> Duration {
    let start = Barrier::new(threads);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let start = &start;
                s.spawn(move || {
                    start.wait();
                    let t0 = Instant::now();
                    for _ in 0..iters {
                        a.pair();
                    }
                    (t0, Instant::now())
                })
            })
            .collect();
        let spans: Vec<(Instant, Instant)> = hs.into_iter().map(|h| h.join().unwrap()).collect();
        let first = spans.iter().map(|s| s.0).min().unwrap();
        let last = spans.iter().map(|s| s.1).max().unwrap();
        last - first
    })
}

fn slot_alloc_free(c: &mut Criterion) {
    let pool =
        HostPool::new(SLOT_BYTES, &PoolConfig::new(SLOTS as u64 * SLOT_BYTES).with_backing(BackingChoice::Plain))
            .unwrap();
    let mutex = MutexList::new(SLOTS);
    let mut g = c.benchmark_group("slot_alloc_free");
    g.throughput(Throughput::Elements(1));
    g.bench_function(BenchmarkId::new("freelist", "single"), |b| b.iter(|| pool.pair()));
    g.bench_function(BenchmarkId::new("mutex_vec", "single"), |b| b.iter(|| mutex.pair()));
    for threads in [1usize, 2, 4, 8, 16] {
        g.throughput(Throughput::Elements(threads as u64));
        g.bench_function(BenchmarkId::new("freelist", format!("threads/{threads}")), |b| {
            b.iter_custom(|iters| contended(&pool, threads, iters))
        });
        g.bench_function(BenchmarkId::new("mutex_vec", format!("threads/{threads}")), |b| {
            b.iter_custom(|iters| contended(&mutex, threads, iters))
        });
    }
    g.finish();
    assert_eq!(pool.free_count(), SLOTS as usize);
}

/// Sets `nr_hugepages` (root only) and restores the old value when dropped.
struct Reserve(Option<String>);

impl Reserve {
    const NR: &'static str = "/proc/sys/vm/nr_hugepages";
    fn at_least(pages: u64) -> Reserve {
        let old = std::fs::read_to_string(Self::NR).ok();
        let cur: u64 = old.as_deref().and_then(|s| s.trim().parse().ok()).unwrap_or(0);
        if hugetlb_free_pages(None) >= pages || std::fs::write(Self::NR, (cur + pages).to_string()).is_err() {
            return Reserve(None);
        }
        Reserve(old)
    }
}

impl Drop for Reserve {
    fn drop(&mut self) {
        if let Some(old) = &self.0 {
            let _ = std::fs::write(Self::NR, old.trim());
        }
    }
}

fn pool_setup(c: &mut Criterion) {
    let mut g = c.benchmark_group("pool_setup");
    g.sample_size(10).sampling_mode(SamplingMode::Flat).throughput(Throughput::Bytes(GIB));
    let slot = 3_452_160; // one GLM-5.2 block
    let cfg = |backing| PoolConfig::new(GIB).with_backing(backing).with_prefault(true);
    let _reserve = Reserve::at_least(GIB / (2 << 20));
    for (name, choice, want) in [
        ("hugetlb", BackingChoice::HugeTlb, Backing::HugeTlb),
        ("thp", BackingChoice::TransparentHuge, Backing::TransparentHuge),
        ("plain", BackingChoice::Plain, Backing::Plain),
    ] {
        match HostPool::new(slot, &cfg(choice)) {
            Ok(p) if p.backing() == want => drop(p),
            Ok(p) => {
                eprintln!("pool_setup/{name}: skipped, got {:?} backing", p.backing());
                continue;
            }
            Err(e) => {
                eprintln!("pool_setup/{name}: skipped: {e}");
                continue;
            }
        }
        g.bench_function(BenchmarkId::new("map_prefault_1GiB", name), |b| {
            // Timed: mmap + madvise + prefault; the unmap of each pool is left out (and done before
            // the next one is mapped, so hugetlb needs only one pool's reservation).
            b.iter_custom(|iters| {
                let mut t = Duration::ZERO;
                for _ in 0..iters {
                    let t0 = Instant::now();
                    let p = HostPool::new(slot, &cfg(choice)).unwrap();
                    t += t0.elapsed();
                    drop(black_box(p));
                }
                t
            })
        });
    }
    g.finish();
}

criterion_group!(benches, slot_alloc_free, pool_setup);
criterion_main!(benches);
