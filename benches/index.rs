//! kvtier's `BlockIndex` against the best concurrent maps, in one run: papaya, dashmap, scc's
//! `HashMap` and `HashIndex` (and, on request, a `Mutex<HashMap>`).
//!
//! Workloads (each at every `--threads` count; harness and options: `benches/harness/mod.rs`):
//!
//! - **Operation mixes** (`read-heavy` 98/1/1, `mixed` 90/5/5, `write-heavy` 50/25/25 percent
//!   get/insert/remove), with uniform or scrambled-Zipf lookups. Before each run a fresh map sized
//!   for `--capacity` keys is filled to `--prefill` (75%). Each thread then runs its own
//!   pre-generated stream of `--ops` operations (1 M): a lookup takes its key from the stream (a
//!   prefilled key drawn from the distribution: a hit unless a writer removed it meanwhile); a
//!   removal takes the oldest key of the thread's own share of the prefilled keys
//!   (`remove_if(key, value)`, always succeeds), and an insert puts back the key the thread removed
//!   longest ago with the next generation (`insert_if_absent`; a fresh key when it has none), so
//!   the map stays at its fill level. Every contender runs the same streams.
//! - **`prefix43`**: the tier's query: the length of the run of leading hits of a 43-key chain (a
//!   long prompt's blocks), one operation = one query of 43 hits on a read-only prefilled map;
//!   each thread runs `--ops / 5` queries (200 k by default), chains drawn from the distribution.
//!   kvtier through `reader()` (one epoch pin per query) and through 43 `get` calls; papaya with one
//!   pin and scc's `HashIndex` with one guard per query; the others key by key.
//!
//! Keys are 16-byte content keys (uniform hashes). kvtier hashes them with its own two-word mix;
//! the other maps use `--hasher` (ahash by default, or `fold`, the same mix as kvtier's).
//!
//! `cargo bench --bench index -- --help` lists the options; `-- --quick` runs in a few seconds.

#[path = "harness/mod.rs"]
mod harness;

use dashmap::DashMap;
use harness::{Args, Dist, Measured, Mix, Recorder, Report, Rng, Row, Sampler};
use kvtier::{BlockIndex, ContentKey, SlotId, SlotRef};
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};
use std::hint::black_box;
use std::sync::Mutex;

/// Blocks in a prefix query (a long prompt's 43 blocks of 64 tokens).
const PREFIX: usize = 43;

/// Key `i`: uniform like a real content hash.
#[inline]
fn key(i: u64) -> ContentKey {
    ContentKey::from_words(harness::mix64(i ^ 0x0123_4567_89ab_cdef), harness::mix64(i ^ 0x5555_0000_0000_0000))
}

#[inline]
fn val(i: u64, generation: u64) -> SlotRef {
    SlotRef { slot: SlotId::new(i as u32), generation }
}

/// The operations every contender implements with the same meaning.
trait Map: Sync + Send + Sized {
    fn with_capacity(n: usize) -> Self;
    fn get(&self, k: &ContentKey) -> Option<SlotRef>;
    /// Inserts unless present; true if inserted.
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool;
    /// Removes `k` only if it maps to `v`; true if removed.
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool;
    /// Leading hits of `keys`, under one pin / guard / lock where the map has a way to batch.
    fn prefix(&self, keys: &[ContentKey]) -> usize;
}

impl Map for BlockIndex {
    fn with_capacity(n: usize) -> Self {
        BlockIndex::with_capacity(n)
    }
    #[inline]
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        BlockIndex::get(self, k)
    }
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool {
        self.insert_if_absent(k, v).is_ok()
    }
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool {
        self.remove_if(k, v)
    }
    #[inline]
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        let r = self.reader();
        keys.iter().take_while(|k| r.get(k).is_some()).count()
    }
}

/// kvtier without the batched reader: a prefix query by `get` calls (one epoch pin each).
struct KvtierEach(BlockIndex);

impl Map for KvtierEach {
    fn with_capacity(n: usize) -> Self {
        KvtierEach(BlockIndex::with_capacity(n))
    }
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.0.get(k)
    }
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool {
        self.0.insert(k, v)
    }
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool {
        self.0.remove(k, v)
    }
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        keys.iter().take_while(|k| self.0.get(k).is_some()).count()
    }
}

/// The two-word mix kvtier's index uses, as a `BuildHasher` for the other maps (`--hasher fold`).
#[derive(Clone, Copy, Default)]
struct Fold;

struct FoldHasher(u64);

impl BuildHasher for Fold {
    type Hasher = FoldHasher;
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher(0)
    }
}

impl Hasher for FoldHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.0 = self.0.rotate_left(29) ^ u64::from_le_bytes(w);
        }
    }
    #[inline]
    fn write_usize(&mut self, _len: usize) {}
    #[inline]
    fn finish(&self) -> u64 {
        harness::mix64(self.0)
    }
}

type AHash = ahash::RandomState;

impl<S: BuildHasher + Default + Clone + Send + Sync> Map for papaya::HashMap<ContentKey, SlotRef, S> {
    fn with_capacity(n: usize) -> Self {
        papaya::HashMap::with_capacity_and_hasher(n, S::default())
    }
    #[inline]
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.pin().get(k).copied()
    }
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool {
        self.pin().try_insert(k, v).is_ok()
    }
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool {
        matches!(self.pin().remove_if(k, |_, cur| *cur == v), Ok(Some(_)))
    }
    #[inline]
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        let m = self.pin();
        keys.iter().take_while(|k| m.get(*k).is_some()).count()
    }
}

impl<S: BuildHasher + Default + Clone + Send + Sync> Map for DashMap<ContentKey, SlotRef, S> {
    fn with_capacity(n: usize) -> Self {
        DashMap::with_capacity_and_hasher(n, S::default())
    }
    #[inline]
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        DashMap::get(self, k).map(|r| *r)
    }
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool {
        match self.entry(k) {
            dashmap::Entry::Occupied(_) => false,
            dashmap::Entry::Vacant(e) => {
                e.insert(v);
                true
            }
        }
    }
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool {
        self.remove_if(k, |_, cur| *cur == v).is_some()
    }
    #[inline]
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        keys.iter().take_while(|k| DashMap::get(self, k).is_some()).count()
    }
}

impl<S: BuildHasher + Default + Clone + Send + Sync> Map for scc::HashMap<ContentKey, SlotRef, S> {
    fn with_capacity(n: usize) -> Self {
        scc::HashMap::with_capacity_and_hasher(n, S::default())
    }
    #[inline]
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.read_sync(k, |_, v| *v)
    }
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool {
        self.insert_sync(k, v).is_ok()
    }
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool {
        self.remove_if_sync(k, |cur| *cur == v).is_some()
    }
    #[inline]
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        keys.iter().take_while(|k| self.read_sync(*k, |_, _| ()).is_some()).count()
    }
}

impl<S: BuildHasher + Default + Clone + Send + Sync> Map for scc::HashIndex<ContentKey, SlotRef, S> {
    fn with_capacity(n: usize) -> Self {
        scc::HashIndex::with_capacity_and_hasher(n, S::default())
    }
    #[inline]
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.peek_with(k, |_, v| *v)
    }
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool {
        self.insert_sync(k, v).is_ok()
    }
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool {
        self.remove_if_sync(k, |cur| *cur == v)
    }
    #[inline]
    fn prefix(&self, keys: &[ContentKey]) -> usize {
        let g = scc::Guard::new();
        keys.iter().take_while(|k| self.peek(*k, &g).is_some()).count()
    }
}

impl<S: BuildHasher + Default + Clone + Send + Sync> Map for Mutex<HashMap<ContentKey, SlotRef, S>> {
    fn with_capacity(n: usize) -> Self {
        Mutex::new(HashMap::with_capacity_and_hasher(n, S::default()))
    }
    #[inline]
    fn get(&self, k: &ContentKey) -> Option<SlotRef> {
        self.lock().unwrap().get(k).copied()
    }
    fn insert(&self, k: ContentKey, v: SlotRef) -> bool {
        match self.lock().unwrap().entry(k) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(v);
                true
            }
        }
    }
    fn remove(&self, k: &ContentKey, v: SlotRef) -> bool {
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

/// A fresh map sized for `capacity`, holding keys `0..filled` (inserted by all cores).
fn prefilled<M: Map>(capacity: usize, filled: u64) -> M {
    let m = M::with_capacity(capacity);
    let w = harness::cpus().min(16) as u64;
    std::thread::scope(|s| {
        for t in 0..w {
            let m = &m;
            s.spawn(move || {
                let mut i = t;
                while i < filled {
                    assert!(m.insert(key(i), val(i, 1)), "prefill key {i} was present");
                    i += w;
                }
            });
        }
    });
    m
}

/// One thread's pre-generated operations: a kind per operation and, for lookups, the key.
struct Stream {
    kinds: Vec<u8>,
    keys: Vec<ContentKey>,
}

const GET: u8 = 0;
const INSERT: u8 = 1;
const REMOVE: u8 = 2;

/// Every thread's stream for one (mix, distribution, thread count), generated in parallel.
fn streams(args: &Args, mix: Mix, dist: Dist, threads: usize, ops: u64, filled: u64) -> Vec<Stream> {
    let sampler = Sampler::new(dist, filled.max(1));
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let sampler = &sampler;
                s.spawn(move || {
                    let mut rng = Rng::new(args.seed ^ harness::mix64(t as u64 + 1));
                    let mut kinds = Vec::with_capacity(ops as usize);
                    let mut keys = Vec::with_capacity(ops as usize);
                    for _ in 0..ops {
                        let r = rng.below(100) as u8;
                        let kind = if r < mix.get {
                            GET
                        } else if r < mix.get + mix.insert {
                            INSERT
                        } else {
                            REMOVE
                        };
                        kinds.push(kind);
                        keys.push(if kind == GET { key(sampler.sample(&mut rng)) } else { ContentKey::default() });
                    }
                    Stream { kinds, keys }
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("stream generator panicked")).collect()
    })
}

/// A thread's writer state: its share of the keys present (oldest first) and those it removed.
struct Writer {
    present: VecDeque<(u64, u64)>,
    absent: VecDeque<(u64, u64)>,
    fresh: u64,
    failed: u64,
}

fn writer(t: usize, threads: usize, filled: u64) -> Writer {
    let present: VecDeque<(u64, u64)> = (t as u64..filled).step_by(threads).map(|i| (i, 1)).collect();
    Writer { present, absent: VecDeque::new(), fresh: (t as u64 + 1) << 40, failed: 0 }
}

/// One thread's whole stream (never inlined: profilers can attribute a run's work to it).
#[inline(never)]
fn run_stream<M: Map>(m: &M, s: &Stream, w: &mut Writer, rec: &mut Recorder) -> u64 {
    let n = s.kinds.len() as u64;
    rec.run(n, |i| {
        let i = i as usize;
        match s.kinds[i] {
            GET => {
                black_box(m.get(&s.keys[i]));
            }
            INSERT => {
                let (id, g) = w.absent.pop_front().map_or_else(
                    || {
                        w.fresh += 1;
                        (w.fresh, 1)
                    },
                    |(id, g)| (id, g + 1),
                );
                if !m.insert(key(id), val(id, g)) {
                    w.failed += 1;
                }
                w.present.push_back((id, g));
            }
            _ => {
                if let Some((id, g)) = w.present.pop_front() {
                    if !m.remove(&key(id), val(id, g)) {
                        w.failed += 1;
                    }
                    w.absent.push_back((id, g));
                }
            }
        }
    });
    n
}

fn mix_run<M: Map>(args: &Args, threads: usize, capacity: usize, filled: u64, streams: &[Stream]) -> Measured {
    harness::run_repeated(
        threads,
        args,
        || prefilled::<M>(capacity, filled),
        |_, t| writer(t, threads, filled),
        |m, t, w, rec| {
            let n = run_stream(m, &streams[t], w, rec);
            assert_eq!(w.failed, 0, "a write of the thread's own keys failed");
            n
        },
    )
}

fn prefix_run<M: Map>(args: &Args, threads: usize, capacity: usize, filled: u64, dist: Dist, ops: u64) -> Measured {
    let chains = (filled / PREFIX as u64).max(1);
    let keys: Vec<ContentKey> = (0..chains * PREFIX as u64).map(key).collect();
    let sampler = Sampler::new(dist, chains);
    harness::run_repeated(
        threads,
        args,
        || prefilled::<M>(capacity, filled),
        |_, t| {
            let mut rng = Rng::new(args.seed ^ harness::mix64(t as u64 + 101));
            (0..ops).map(|_| sampler.sample(&mut rng) as u32).collect::<Vec<u32>>()
        },
        |m, _, chains, rec| prefix_queries(m, &keys, chains, rec),
    )
}

/// One thread's queries (never inlined: profilers can attribute a run's work to it).
#[inline(never)]
fn prefix_queries<M: Map>(m: &M, keys: &[ContentKey], chains: &[u32], rec: &mut Recorder) -> u64 {
    rec.run(chains.len() as u64, |i| {
        let c = chains[i as usize] as usize * PREFIX;
        let hits = m.prefix(&keys[c..c + PREFIX]);
        debug_assert_eq!(hits, PREFIX);
        black_box(hits);
    });
    chains.len() as u64
}

const CONTENDERS: &[&str] = &["kvtier", "kvtier-get-each", "papaya", "dashmap", "scc", "scc-index", "mutex"];
const WORKLOADS: &[&str] = &["mixes", "prefix43"];

/// Runs `$f::<Type>($args...)` for the contender named `$name` with the chosen hasher.
macro_rules! dispatch {
    ($name:expr, $hasher:expr, $f:ident ( $($a:expr),* )) => {
        match ($name, $hasher) {
            ("kvtier", _) => $f::<BlockIndex>($($a),*),
            ("kvtier-get-each", _) => $f::<KvtierEach>($($a),*),
            ("papaya", "fold") => $f::<papaya::HashMap<ContentKey, SlotRef, Fold>>($($a),*),
            ("papaya", _) => $f::<papaya::HashMap<ContentKey, SlotRef, AHash>>($($a),*),
            ("dashmap", "fold") => $f::<DashMap<ContentKey, SlotRef, Fold>>($($a),*),
            ("dashmap", _) => $f::<DashMap<ContentKey, SlotRef, AHash>>($($a),*),
            ("scc", "fold") => $f::<scc::HashMap<ContentKey, SlotRef, Fold>>($($a),*),
            ("scc", _) => $f::<scc::HashMap<ContentKey, SlotRef, AHash>>($($a),*),
            ("scc-index", "fold") => $f::<scc::HashIndex<ContentKey, SlotRef, Fold>>($($a),*),
            ("scc-index", _) => $f::<scc::HashIndex<ContentKey, SlotRef, AHash>>($($a),*),
            ("mutex", "fold") => $f::<Mutex<HashMap<ContentKey, SlotRef, Fold>>>($($a),*),
            ("mutex", _) => $f::<Mutex<HashMap<ContentKey, SlotRef, AHash>>>($($a),*),
            (other, _) => unreachable!("contender {other} was validated"),
        }
    };
}

fn main() {
    let args = Args::from_env();
    if !["ahash", "fold"].contains(&args.hasher.as_str()) {
        eprintln!("--hasher: ahash or fold, got {}", args.hasher);
        std::process::exit(2);
    }
    let threads = args.thread_counts();
    let ops = args.ops_or(1_000_000, 200_000);
    // A query is 43 lookups: a fifth of the mixes' operation count is 8.6 times their lookups.
    let prefix_ops = (ops / 5).max(1);
    let capacity = args.capacity_or(1 << 20, 1 << 16);
    let filled = (capacity as f64 * args.prefill) as u64;
    let contenders =
        args.pick("contenders", &args.contenders, CONTENDERS, &["kvtier", "papaya", "dashmap", "scc", "scc-index"]);
    let prefix_contenders = args.pick(
        "contenders",
        &args.contenders,
        CONTENDERS,
        &["kvtier", "kvtier-get-each", "papaya", "dashmap", "scc", "scc-index"],
    );
    let workloads = args.pick("workloads", &args.workloads, WORKLOADS, WORKLOADS);
    let mixes = args.op_mixes();
    let dists = args.distributions();
    let mut report = Report::new(
        "index",
        &args,
        &[
            ("threads", format!("{threads:?}")),
            ("operations per thread", format!("{ops} (mixes), {prefix_ops} 43-key queries (prefix43)")),
            ("capacity", format!("{capacity} keys, prefilled to {filled} ({:.0}%)", args.prefill * 100.0)),
            ("other maps' hasher", args.hasher.clone()),
        ],
    );
    let hasher = args.hasher.as_str();
    if workloads.iter().any(|w| w == "mixes") {
        for mix in &mixes {
            for dist in &dists {
                for &t in &threads {
                    let wanted: Vec<&String> = contenders
                        .iter()
                        .filter(|c| *c != "kvtier-get-each")
                        .filter(|c| args.selected(&format!("{} {} {c}", mix.name, dist.name())))
                        .collect();
                    if wanted.is_empty() {
                        continue;
                    }
                    let s = streams(&args, *mix, *dist, t, ops, filled);
                    for c in wanted {
                        let m = dispatch!(c.as_str(), hasher, mix_run(&args, t, capacity, filled, &s));
                        report.add(Row {
                            workload: mix.name.to_string(),
                            variant: dist.name(),
                            contender: c.clone(),
                            m,
                            unit: "ops",
                        });
                    }
                }
            }
        }
    }
    if workloads.iter().any(|w| w == "prefix43") {
        for dist in &dists {
            for &t in &threads {
                for c in &prefix_contenders {
                    if !args.selected(&format!("prefix43 {} {c}", dist.name())) {
                        continue;
                    }
                    let m = dispatch!(c.as_str(), hasher, prefix_run(&args, t, capacity, filled, *dist, prefix_ops));
                    report.add(Row {
                        workload: "prefix43".into(),
                        variant: dist.name(),
                        contender: c.clone(),
                        m,
                        unit: "queries",
                    });
                }
            }
        }
    }
    report.finish(
        &args,
        "Mixes: get/insert/remove percent; lookups drawn from the prefilled keys, writes cycle each thread's own \
         share (the map stays at its fill level). prefix43: one operation = one 43-key query, all hits.",
    );
}
