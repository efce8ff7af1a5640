//! `BlockIndex` against `papaya::HashMap`, `dashmap::DashMap` and `Mutex<HashMap>`, in one run.
//!
//! Workloads (each at 1, 2, 4, 8, 16 threads; throughput in operations):
//! - `get_hit` / `get_miss`: lookups of present / absent keys in a map of [`KEYS`] entries.
//! - `insert`: `insert_if_absent` of fresh keys into a map pre-sized for them (each thread its own keys).
//! - `remove_reinsert`: `remove_if(key, value)` then re-insert with the next generation (one op = both).
//! - `mix94`: 94% `get_hit`, 3% insert, 3% remove of a per-thread churn window.
//! - `prefix43`: a 43-key prefix query (count the leading hits), one op = the whole query; kvtier
//!   through `reader()` (one epoch pin) and through 43 `get` calls (43 pins).
//!
//! Each sample spawns scoped threads that wait on a barrier and run a fixed op count each; the
//! measured time (`iter_custom`) spans from the first thread's start to the last thread's end. The other maps use
//! `ahash` (a fast hasher, as a production user would), kvtier its own `ContentKey::hash64`.
//!
//! Quick run: `cargo bench --bench index -- --warm-up-time 1 --measurement-time 2`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use dashmap::DashMap;
use kvtier::{BlockIndex, ContentKey, SlotId, SlotRef};
use std::collections::HashMap;
use std::hint::black_box;
use std::sync::{Barrier, Mutex};
use std::time::{Duration, Instant};

/// Entries in the prefilled maps (a 64 GiB host pool holds about 20k GLM-5.2 blocks; this is 3x that).
const KEYS: usize = 65_536;
/// Operations per thread per measured iteration.
const OPS: u64 = 4_096;
/// Blocks in a prefix query (a long prompt's 43 x 64-token blocks, see `docs/`).
const PREFIX: usize = 43;
const THREADS: [usize; 5] = [1, 2, 4, 8, 16];

type ARandom = ahash::RandomState;

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Key `i`: uniform-looking like a real content hash.
fn key(i: u64) -> ContentKey {
    ContentKey::from_words(splitmix(i), splitmix(i ^ 0x5555_0000_0000_0000))
}

fn val(i: u64, generation: u64) -> SlotRef {
    SlotRef { slot: SlotId(i as u32), generation }
}

/// The operations every contender implements with the same semantics.
trait Index: Sync + Sized {
    const NAME: &'static str;
    fn with_capacity(n: usize) -> Self;
    fn get(&self, k: &ContentKey) -> Option<SlotRef>;
    fn insert_if_absent(&self, k: ContentKey, v: SlotRef) -> Result<(), SlotRef>;
    fn remove_if(&self, k: &ContentKey, v: SlotRef) -> bool;
    /// Leading hits of `keys`, under one pin / lock where the map allows it.
    fn prefix(&self, keys: &[ContentKey]) -> usize;
}

impl Index for BlockIndex {
    const NAME: &'static str = "kvtier";
    fn with_capacity(n: usize) -> Self {
        BlockIndex::with_capacity(n)
    }
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        BlockIndex::get(self, k)
    }
    fn insert_if_absent(&self, k: ContentKey, v: SlotRef) -> Result<(), SlotRef> {
        BlockIndex::insert_if_absent(self, k, v)
    }
    fn remove_if(&self, k: &ContentKey, v: SlotRef) -> bool {
        BlockIndex::remove_if(self, k, v)
    }
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        let r = self.reader();
        keys.iter().take_while(|k| r.get(k).is_some()).count()
    }
}

/// kvtier without the batched reader: 43 separate `get` calls (43 epoch pins). Prefix figure only.
struct KvtierEach(BlockIndex);

impl Index for KvtierEach {
    const NAME: &'static str = "kvtier-get-each";
    fn with_capacity(n: usize) -> Self {
        KvtierEach(BlockIndex::with_capacity(n))
    }
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.0.get(k)
    }
    fn insert_if_absent(&self, k: ContentKey, v: SlotRef) -> Result<(), SlotRef> {
        self.0.insert_if_absent(k, v)
    }
    fn remove_if(&self, k: &ContentKey, v: SlotRef) -> bool {
        self.0.remove_if(k, v)
    }
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        keys.iter().take_while(|k| self.0.get(k).is_some()).count()
    }
}

impl Index for papaya::HashMap<ContentKey, SlotRef, ARandom> {
    const NAME: &'static str = "papaya";
    fn with_capacity(n: usize) -> Self {
        papaya::HashMap::with_capacity_and_hasher(n, ARandom::new())
    }
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.pin().get(k).copied()
    }
    fn insert_if_absent(&self, k: ContentKey, v: SlotRef) -> Result<(), SlotRef> {
        match self.pin().try_insert(k, v) {
            Ok(_) => Ok(()),
            Err(e) => Err(*e.current),
        }
    }
    fn remove_if(&self, k: &ContentKey, v: SlotRef) -> bool {
        matches!(self.pin().remove_if(k, |_, cur| *cur == v), Ok(Some(_)))
    }
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        let m = self.pin();
        keys.iter().take_while(|k| m.get(*k).is_some()).count()
    }
}

impl Index for DashMap<ContentKey, SlotRef, ARandom> {
    const NAME: &'static str = "dashmap";
    fn with_capacity(n: usize) -> Self {
        DashMap::with_capacity_and_hasher(n, ARandom::new())
    }
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        DashMap::get(self, k).map(|r| *r)
    }
    fn insert_if_absent(&self, k: ContentKey, v: SlotRef) -> Result<(), SlotRef> {
        match self.entry(k) {
            dashmap::Entry::Occupied(o) => Err(*o.get()),
            dashmap::Entry::Vacant(e) => {
                e.insert(v);
                Ok(())
            }
        }
    }
    fn remove_if(&self, k: &ContentKey, v: SlotRef) -> bool {
        DashMap::remove_if(self, k, |_, cur| *cur == v).is_some()
    }
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        keys.iter().take_while(|k| DashMap::get(self, k).is_some()).count()
    }
}

impl Index for Mutex<HashMap<ContentKey, SlotRef, ARandom>> {
    const NAME: &'static str = "mutex-hashmap";
    fn with_capacity(n: usize) -> Self {
        Mutex::new(HashMap::with_capacity_and_hasher(n, ARandom::new()))
    }
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.lock().unwrap().get(k).copied()
    }
    fn insert_if_absent(&self, k: ContentKey, v: SlotRef) -> Result<(), SlotRef> {
        match self.lock().unwrap().entry(k) {
            std::collections::hash_map::Entry::Occupied(o) => Err(*o.get()),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(v);
                Ok(())
            }
        }
    }
    fn remove_if(&self, k: &ContentKey, v: SlotRef) -> bool {
        let mut m = self.lock().unwrap();
        if m.get(k) == Some(&v) {
            m.remove(k);
            true
        } else {
            false
        }
    }
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        let m = self.lock().unwrap();
        keys.iter().take_while(|k| m.get(k).is_some()).count()
    }
}

/// Runs `work(thread)` on `threads` scoped threads released together by a barrier; returns the span
/// from the first thread's start to the last thread's end. Each thread reads the clock itself, so a
/// descheduled coordinator (16 threads share 2 cores here) cannot shorten the measured span.
fn timed<F: Fn(usize) + Sync>(threads: usize, work: F) -> Duration {
    let barrier = Barrier::new(threads);
    let spans: Vec<(Instant, Instant)> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (barrier, work) = (&barrier, &work);
                s.spawn(move || {
                    barrier.wait();
                    let start = Instant::now();
                    work(t);
                    (start, Instant::now())
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("bench thread panicked")).collect()
    });
    let first = spans.iter().map(|s| s.0).min().expect("at least one thread");
    let last = spans.iter().map(|s| s.1).max().expect("at least one thread");
    last - first
}

fn prefilled<M: Index>(n: usize) -> M {
    let m = M::with_capacity(n);
    for i in 0..n as u64 {
        m.insert_if_absent(key(i), val(i, 1)).unwrap();
    }
    m
}

/// A per-thread pseudo-random walk over `0..KEYS` (odd stride, so it visits every key).
#[inline]
fn nth(t: usize, i: u64) -> u64 {
    (t as u64 * 7_919 + i * 40_503) % KEYS as u64
}

fn all_keys() -> Vec<ContentKey> {
    (0..KEYS as u64).map(key).collect()
}

fn bench_get<M: Index>(c: &mut Criterion, hit: bool) {
    let map: M = prefilled(KEYS);
    let offset = if hit { 0 } else { 1 << 40 };
    let set: Vec<ContentKey> = (0..KEYS as u64).map(|i| key(i + offset)).collect();
    let name = if hit { "get_hit" } else { "get_miss" };
    {
        let mut g = c.benchmark_group(format!("index/{name}"));
        g.sample_size(10);
        for &t in &THREADS {
            g.throughput(Throughput::Elements(OPS * t as u64));
            g.bench_with_input(BenchmarkId::new(M::NAME, t), &t, |b, &t| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            timed(t, |th| {
                                for i in 0..OPS {
                                    black_box(map.get(&set[nth(th, i) as usize]));
                                }
                            })
                        })
                        .sum()
                })
            });
        }
        g.finish();
    }
}

fn bench_insert<M: Index>(c: &mut Criterion) {
    {
        let mut g = c.benchmark_group("index/insert");
        g.sample_size(10);
        for &t in &THREADS {
            g.throughput(Throughput::Elements(OPS * t as u64));
            g.bench_with_input(BenchmarkId::new(M::NAME, t), &t, |b, &t| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        let m = M::with_capacity(OPS as usize * t);
                        total += timed(t, |th| {
                            let base = (th as u64) << 32;
                            for i in 0..OPS {
                                black_box(m.insert_if_absent(key(base + i), val(i, 1))).unwrap();
                            }
                        });
                        drop(m);
                    }
                    total
                })
            });
        }
        g.finish();
    }
}

fn bench_remove_reinsert<M: Index>(c: &mut Criterion) {
    let keys = all_keys();
    {
        // Each thread owns keys `th, th + t, th + 2t, ...` of the prefilled map; generations advance
        // across iterations, tracked per key by the thread that owns it.
        let mut g = c.benchmark_group("index/remove_reinsert");
        g.sample_size(10);
        for &t in &THREADS {
            g.throughput(Throughput::Elements(OPS * t as u64));
            let m: M = prefilled(KEYS);
            let gens: Vec<Mutex<Vec<u64>>> = (0..t).map(|_| Mutex::new(vec![1; KEYS / t + 1])).collect();
            g.bench_with_input(BenchmarkId::new(M::NAME, t), &t, |b, &t| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            timed(t, |th| {
                                let mut gens = gens[th].lock().unwrap();
                                let own = (KEYS - th).div_ceil(t) as u64;
                                for i in 0..OPS {
                                    let j = (i * 40_503) % own;
                                    let id = th as u64 + j * t as u64;
                                    let g = &mut gens[j as usize];
                                    assert!(m.remove_if(&keys[id as usize], val(id, *g)));
                                    *g += 1;
                                    m.insert_if_absent(keys[id as usize], val(id, *g)).unwrap();
                                }
                            })
                        })
                        .sum()
                })
            });
        }
        g.finish();
    }
}

fn bench_mix<M: Index>(c: &mut Criterion) {
    let keys = all_keys();
    {
        // 94 gets (present keys), 3 inserts, 3 removes per 100 ops; each thread churns a private window
        // of 64 extra keys so the map size stays constant.
        let mut g = c.benchmark_group("index/mix94");
        g.sample_size(10);
        for &t in &THREADS {
            g.throughput(Throughput::Elements(OPS * t as u64));
            let m: M = prefilled(KEYS);
            let heads: Vec<Mutex<(u64, u64)>> = (0..t).map(|_| Mutex::new((0, 0))).collect();
            g.bench_with_input(BenchmarkId::new(M::NAME, t), &t, |b, &t| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            timed(t, |th| {
                                let mut h = heads[th].lock().unwrap();
                                let base = (th as u64 + 1) << 40;
                                for i in 0..OPS {
                                    let r = i % 100;
                                    if r < 94 {
                                        black_box(m.get(&keys[nth(th, i) as usize]));
                                    } else if r % 2 == 0 {
                                        let id = base + h.0;
                                        m.insert_if_absent(key(id), val(id, 1)).unwrap();
                                        h.0 += 1;
                                    } else if h.1 + 64 <= h.0 {
                                        let id = base + h.1;
                                        assert!(m.remove_if(&key(id), val(id, 1)));
                                        h.1 += 1;
                                    } else {
                                        black_box(m.get(&keys[nth(th, i) as usize]));
                                    }
                                }
                            })
                        })
                        .sum()
                })
            });
        }
        g.finish();
    }
}

fn bench_prefix<M: Index>(c: &mut Criterion) {
    let map: M = prefilled(KEYS);
    let keys = all_keys();
    let mut g = c.benchmark_group("index/prefix43");
    g.sample_size(10);
    for &t in &THREADS {
        // One op = one 43-key query that hits every key (the most work a query does).
        let q = (OPS / PREFIX as u64).max(1);
        g.throughput(Throughput::Elements(q * t as u64));
        g.bench_with_input(BenchmarkId::new(M::NAME, t), &t, |b, &t| {
            b.iter_custom(|iters| {
                (0..iters)
                    .map(|_| {
                        timed(t, |th| {
                            for i in 0..q {
                                let start = nth(th, i) as usize % (KEYS - PREFIX);
                                assert_eq!(black_box(map.prefix(&keys[start..start + PREFIX])), PREFIX);
                            }
                        })
                    })
                    .sum()
            })
        });
    }
    g.finish();
}

type Papaya = papaya::HashMap<ContentKey, SlotRef, ARandom>;
type Dash = DashMap<ContentKey, SlotRef, ARandom>;
type Locked = Mutex<HashMap<ContentKey, SlotRef, ARandom>>;

/// Runs one workload for every contender, so each figure's bars are measured side by side.
macro_rules! each {
    ($f:ident, $c:expr $(, $arg:expr)*) => {
        $f::<BlockIndex>($c $(, $arg)*);
        $f::<Papaya>($c $(, $arg)*);
        $f::<Dash>($c $(, $arg)*);
        $f::<Locked>($c $(, $arg)*);
    };
}

fn benches(c: &mut Criterion) {
    each!(bench_get, c, true);
    each!(bench_get, c, false);
    each!(bench_insert, c);
    each!(bench_remove_reinsert, c);
    each!(bench_mix, c);
    bench_prefix::<BlockIndex>(c);
    bench_prefix::<KvtierEach>(c);
    bench_prefix::<Papaya>(c);
    bench_prefix::<Dash>(c);
    bench_prefix::<Locked>(c);
}

criterion_group!(index, benches);
criterion_main!(index);
