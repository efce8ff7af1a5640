//! kvtier's slot free list against a mutex free list and crossbeam's `SegQueue` / `ArrayQueue`, in
//! one run, and (opt-in) the host pool's set-up time.
//!
//! Workloads (each at every `--threads` count; harness and options: `benches/harness/mod.rs`):
//!
//! - **`pair`**: one operation = allocate a slot id and free it at once (what a one-block save
//!   that is dropped costs the allocator). `--ops` pairs per thread (1 M).
//! - **`batch43`**: one operation = allocate 43 ids, then free the 43 (a 43-block save and, later,
//!   its eviction). `--ops / 43` batches per thread.
//! - **`setup`** (opt-in: `--workloads setup`): map and prefault a 1 GiB `HostPool` with each
//!   backing available (hugetlb only where 512 pages can be reserved, which needs root; the old
//!   `nr_hugepages` is restored). One row per backing, the median of `--repeat` (at least 3).
//!
//! Before each run a fresh list of `--capacity` ids (65,536) is made and `--prefill` (75%) of them
//! are taken out, as by a pool that is 75% full; the free ids left are spread evenly over the
//! list's shards. kvtier's list is `kvtier::internals::FreeList` (the allocator under `HostPool`).
//!
//! `cargo bench --bench slab -- --help` lists the options; `-- --quick` runs in a few seconds.

#[path = "harness/mod.rs"]
mod harness;

use crossbeam_queue::{ArrayQueue, SegQueue};
use harness::{Args, Measured, Recorder, Report, Row};
use kvtier::internals::FreeList;
use kvtier::{hugetlb_free_pages, Backing, BackingChoice, HostPool, PoolConfig};
use std::hint::black_box;
use std::sync::Mutex;
use std::time::{Duration, Instant};

const BATCH: usize = 43;
const GIB: u64 = 1 << 30;

/// A free list of slot ids every contender implements.
trait SlotList: Sync + Send {
    /// A list holding `free` (each id once) out of `capacity` ids.
    fn build(capacity: u32, free: &[u32]) -> Self;
    fn pop(&self) -> Option<u32>;
    fn push(&self, id: u32);
}

impl SlotList for FreeList {
    fn build(capacity: u32, free: &[u32]) -> Self {
        let f = FreeList::new(capacity);
        let mut taken = 0;
        while f.pop().is_some() {
            taken += 1;
        }
        assert_eq!(taken, capacity);
        // Spread the free ids over the shards, as a pool's history would.
        for (i, &id) in free.iter().enumerate() {
            f.push_near(i, id);
        }
        f
    }
    #[inline]
    fn pop(&self) -> Option<u32> {
        FreeList::pop(self)
    }
    #[inline]
    fn push(&self, id: u32) {
        FreeList::push(self, id)
    }
}

/// The baseline: a stack of ids behind one mutex.
struct MutexList(Mutex<Vec<u32>>);

impl SlotList for MutexList {
    fn build(capacity: u32, free: &[u32]) -> Self {
        let mut v = Vec::with_capacity(capacity as usize);
        v.extend_from_slice(free);
        MutexList(Mutex::new(v))
    }
    #[inline]
    fn pop(&self) -> Option<u32> {
        self.0.lock().unwrap().pop()
    }
    #[inline]
    fn push(&self, id: u32) {
        self.0.lock().unwrap().push(id)
    }
}

impl SlotList for SegQueue<u32> {
    fn build(_capacity: u32, free: &[u32]) -> Self {
        let q = SegQueue::new();
        for &id in free {
            q.push(id);
        }
        q
    }
    #[inline]
    fn pop(&self) -> Option<u32> {
        SegQueue::pop(self)
    }
    #[inline]
    fn push(&self, id: u32) {
        SegQueue::push(self, id)
    }
}

impl SlotList for ArrayQueue<u32> {
    fn build(capacity: u32, free: &[u32]) -> Self {
        let q = ArrayQueue::new(capacity.max(1) as usize);
        for &id in free {
            q.push(id).expect("room for every id");
        }
        q
    }
    #[inline]
    fn pop(&self) -> Option<u32> {
        ArrayQueue::pop(self)
    }
    #[inline]
    fn push(&self, id: u32) {
        ArrayQueue::push(self, id).expect("room for every id")
    }
}

fn free_ids(capacity: u32, prefill: f64) -> Vec<u32> {
    let used = (capacity as f64 * prefill) as u32;
    // A random `1 - prefill` of the ids is free: a pool's free ids are scattered, not one run.
    let mut ids: Vec<u32> = (0..capacity).collect();
    ids.sort_by_key(|&i| harness::mix64(i as u64));
    ids.truncate((capacity - used) as usize);
    ids
}

fn pair_run<L: SlotList>(args: &Args, threads: usize, capacity: u32, ops: u64) -> Measured {
    let free = free_ids(capacity, args.prefill);
    assert!(!free.is_empty(), "--prefill leaves no free id");
    harness::run_repeated(threads, args, || L::build(capacity, &free), |_, _| (), |l, _, _, rec| pairs(l, ops, rec))
}

/// One thread's pairs (never inlined: profilers can attribute a run's work to it).
#[inline(never)]
fn pairs<L: SlotList>(l: &L, ops: u64, rec: &mut Recorder) -> u64 {
    rec.run(ops, |_| {
        let id = l.pop().expect("a free id");
        l.push(black_box(id));
    });
    ops
}

fn batch_run<L: SlotList>(args: &Args, threads: usize, capacity: u32, rounds: u64) -> Measured {
    let free = free_ids(capacity, args.prefill);
    assert!(free.len() >= threads * BATCH, "--capacity too small: {} threads x {BATCH} ids", threads);
    harness::run_repeated(
        threads,
        args,
        || L::build(capacity, &free),
        |_, _| Vec::<u32>::with_capacity(BATCH),
        |l, _, held, rec| batches(l, held, rounds, rec),
    )
}

/// One thread's batches (never inlined: profilers can attribute a run's work to it).
#[inline(never)]
fn batches<L: SlotList>(l: &L, held: &mut Vec<u32>, rounds: u64, rec: &mut Recorder) -> u64 {
    rec.run(rounds, |_| {
        for _ in 0..BATCH {
            held.push(l.pop().expect("a free id"));
        }
        for id in held.drain(..) {
            l.push(black_box(id));
        }
    });
    rounds
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

/// Maps and prefaults a 1 GiB pool per backing; one row each (median of the repeats).
fn setup(args: &Args, report: &mut Report) {
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
                eprintln!("setup/{name}: skipped, got {:?} backing", p.backing());
                continue;
            }
            Err(e) => {
                eprintln!("setup/{name}: skipped: {e}");
                continue;
            }
        }
        // Timed: mmap + madvise + prefault; not the unmap (done before the next map).
        let mut times: Vec<Duration> = (0..args.repeat.max(3))
            .map(|_| {
                let t0 = Instant::now();
                let p = HostPool::new(slot, &cfg(choice)).expect("mapped once already");
                let t = t0.elapsed();
                drop(black_box(p));
                t
            })
            .collect();
        times.sort_unstable();
        let span = times[times.len() / 2];
        report.add(Row {
            workload: "setup".into(),
            variant: "1GiB".into(),
            contender: name.into(),
            m: Measured { threads: 1, ops: 1, span, thread_rate: (0.0, 0.0), lat: [0; 5], samples: 0 },
            unit: "pools",
        });
    }
}

const CONTENDERS: &[&str] = &["kvtier", "mutex", "segqueue", "arrayqueue"];
const WORKLOADS: &[&str] = &["pair", "batch43", "setup"];

macro_rules! dispatch {
    ($name:expr, $f:ident ( $($a:expr),* )) => {
        match $name {
            "kvtier" => $f::<FreeList>($($a),*),
            "mutex" => $f::<MutexList>($($a),*),
            "segqueue" => $f::<SegQueue<u32>>($($a),*),
            "arrayqueue" => $f::<ArrayQueue<u32>>($($a),*),
            other => unreachable!("contender {other} was validated"),
        }
    };
}

fn main() {
    let args = Args::from_env();
    let threads = args.thread_counts();
    let ops = args.ops_or(1_000_000, 200_000);
    let capacity = args.capacity_or(1 << 16, 1 << 14);
    let capacity = u32::try_from(capacity).expect("--capacity fits in 32 bits");
    let contenders = args.pick("contenders", &args.contenders, CONTENDERS, CONTENDERS);
    let workloads = args.pick("workloads", &args.workloads, WORKLOADS, &["pair", "batch43"]);
    let mut report = Report::new(
        "slab",
        &args,
        &[
            ("threads", format!("{threads:?}")),
            (
                "operations per thread",
                format!("{ops} pairs (pair), {} batches of {BATCH} (batch43)", ops / BATCH as u64),
            ),
            ("capacity", format!("{capacity} slot ids, {:.0}% taken before each run", args.prefill * 100.0)),
            ("kvtier free-list shards", FreeList::new(capacity).shards().to_string()),
        ],
    );
    for w in &workloads {
        if w == "setup" {
            if args.selected("setup") {
                setup(&args, &mut report);
            }
            continue;
        }
        for &t in &threads {
            for c in &contenders {
                if !args.selected(&format!("{w} {c}")) {
                    continue;
                }
                let m = match w.as_str() {
                    "pair" => dispatch!(c.as_str(), pair_run(&args, t, capacity, ops)),
                    _ => dispatch!(c.as_str(), batch_run(&args, t, capacity, (ops / BATCH as u64).max(1))),
                };
                report.add(Row {
                    workload: w.clone(),
                    variant: "-".into(),
                    contender: c.clone(),
                    m,
                    unit: if w == "pair" { "pairs" } else { "batches" },
                });
            }
        }
    }
    report.finish(
        &args,
        "pair: allocate + free one id; batch43: allocate 43 ids, then free them (one operation). \
         Lower ns per operation per thread is better.",
    );
}
