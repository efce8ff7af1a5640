//! Trace replay end to end: LRU hits equal an independent reference model, every restored page is
//! verified, bad input gives typed errors, and the `kvtier replay` command line works.

mod support;

use kvtier::MemcpyArenas;
use kvtier::PolicyKind;
use kvtier::{ArenaSpec, BackingChoice, ContentKey, Geometry};
use kvtier::{CopyBackend, EngineArenas};
use kvtier_cli::replay::{self, ReplayConfig, ReplayReport};
use kvtier_cli::trace::{self, TraceRequest};
use kvtier_cli::{Error, ReplayError, TraceError};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::Hash;
use std::process::Command;
use std::sync::Arc;

// ---------------------------------------------------------------------------------------------
// The reference model: a plain LRU over keys, with the replay's prefix-hit semantics.
// ---------------------------------------------------------------------------------------------

/// LRU set of at most `cap` keys: `last` maps key -> last-use tick, `order` tick -> key.
struct Lru<K> {
    cap: usize,
    tick: u64,
    last: HashMap<K, u64>,
    order: BTreeMap<u64, K>,
}

impl<K: Copy + Eq + Hash> Lru<K> {
    fn new(cap: usize) -> Self {
        Lru { cap, tick: 0, last: HashMap::new(), order: BTreeMap::new() }
    }
    fn contains(&self, k: &K) -> bool {
        self.last.contains_key(k)
    }
    /// Marks `k` most recently used, inserting it (and evicting the least recently used key when
    /// full) if absent.
    fn use_key(&mut self, k: K) {
        self.tick += 1;
        if let Some(t) = self.last.insert(k, self.tick) {
            self.order.remove(&t);
        } else if self.last.len() > self.cap {
            let (_, victim) = self.order.pop_first().expect("non-empty");
            self.last.remove(&victim);
        }
        self.order.insert(self.tick, k);
    }
}

/// Hit pages of `requests` (key lists) replayed one at a time through an LRU of `cap` blocks:
/// hits = longest run of leading resident keys, touched in order; then among the rest, resident
/// keys are touched in order and the first `min(missing, cap)` missing keys are inserted in order.
fn model_hits<K: Copy + Eq + Hash>(requests: impl IntoIterator<Item = Vec<K>>, cap: usize) -> u64 {
    let mut lru: Lru<K> = Lru::new(cap);
    let mut hits = 0u64;
    for keys in requests {
        let h = keys.iter().take_while(|k| lru.contains(k)).count();
        hits += h as u64;
        for k in &keys[..h] {
            lru.use_key(*k);
        }
        let (resident, missing): (Vec<K>, Vec<K>) = keys[h..].iter().partition(|k| lru.contains(k));
        // The save pins its own resident blocks: it never evicts them to make room for the rest.
        let room = cap - resident.len();
        for k in resident {
            lru.use_key(k);
        }
        for k in missing.into_iter().take(room) {
            lru.use_key(k);
        }
    }
    hits
}

#[test]
fn model_semantics_by_hand() {
    // cap 3: [1,2] -> 0 hits, {1,2}; [1,2,3] -> 2 hits, {1,2,3}; [4] -> evicts 1; [1,2] -> 0 hits
    // (1 gone); 2 resident is touched, 1 inserted evicting 3.  [2,1] -> 2 hits.
    let reqs = vec![vec![1, 2], vec![1, 2, 3], vec![4], vec![1, 2], vec![2, 1]];
    assert_eq!(model_hits(reqs, 3), 2 + 2);
    // Missing keys beyond the capacity are dropped: [1..=5] with cap 2 keeps {1,2}.
    assert_eq!(model_hits(vec![vec![1, 2, 3, 4, 5], vec![1, 2, 3]], 2), 2);
}

// ---------------------------------------------------------------------------------------------
// Replays on a tiny geometry.
// ---------------------------------------------------------------------------------------------

/// Two packed arenas of 256 B and 128 B per 64-token page: 512 B host slots.
fn tiny_geometry(pages: u64) -> Geometry {
    Geometry::new("test-2arena", 64, vec![ArenaSpec::packed("a", 256, pages), ArenaSpec::packed("b", 128, pages)])
        .unwrap()
}

fn sample() -> Vec<TraceRequest> {
    trace::sample().unwrap()
}

fn replay_lru(requests: &[TraceRequest], slots: u64, concurrency: usize) -> ReplayReport {
    replay_lru_hinted(requests, slots, concurrency, 0)
}

/// Plain LRU (no chain-aware ranking: the reference model is classic LRU), with hints for the next
/// `lookahead` requests.
fn replay_lru_hinted(requests: &[TraceRequest], slots: u64, concurrency: usize, lookahead: usize) -> ReplayReport {
    let pages = replay::gpu_pages_needed(requests, 64, concurrency).unwrap();
    let g = tiny_geometry(pages);
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let config = ReplayConfig {
        policy: PolicyKind::Lru,
        pool_bytes: slots * g.slot_bytes(),
        backing: BackingChoice::Plain,
        gpu_pages: None,
        requests: None,
        concurrency,
        chain_aware: false,
        lookahead,
        ssd: None,
    };
    replay::run(requests, &config, &arenas, &|_| {}).unwrap()
}

/// Requests A (8 pages), C (4), B (4), A on a 12-slot pool: B's save evicts A's first four pages
/// under LRU, so A's return hits nothing; with the queue hinted (A waits while B saves), B's save
/// evicts C instead and A's return hits all 8 pages.
#[test]
fn hints_for_the_queue_keep_a_waiting_request_s_prefix() {
    let line = |id: u64, tokens: u64| {
        format!("{{\"timestamp\":0,\"input_length\":{tokens},\"output_length\":1,\"hash_ids\":[{id}]}}\n")
    };
    let text = [line(1, 512), line(2, 256), line(3, 256), line(1, 512)].concat();
    let reqs = trace::parse_str(&text).unwrap();
    let without = replay_lru_hinted(&reqs, 12, 1, 0);
    let with = replay_lru_hinted(&reqs, 12, 1, 3);
    assert_eq!((without.pages, without.hit_pages), (24, 0));
    assert_eq!((with.pages, with.hit_pages, with.lookahead), (24, 8, 3));
    assert_eq!(with.verified_pages, 8);
}

fn model_for(requests: &[TraceRequest], slots: u64) -> u64 {
    let ns = tiny_geometry(1).namespace();
    model_hits(requests.iter().map(|r| r.page_keys(&ns, 64)), slots as usize)
}

#[test]
fn lru_replay_of_the_sample_equals_the_reference_model() {
    let reqs = sample();
    let total: u64 = reqs.iter().map(|r| r.page_count(64) as u64).sum();
    // Small pools (heavy eviction, requests larger than the pool), a medium one, and one that
    // holds everything.
    for slots in [500u64, 2_000, 8_000, total + 1] {
        let r = replay_lru(&reqs, slots, 1);
        assert_eq!(r.pool_capacity_slots, slots, "pool rounding");
        let want = model_for(&reqs, slots);
        assert_eq!(r.requests, reqs.len() as u64);
        assert_eq!(r.pages, total);
        assert_eq!(r.hit_pages, want, "hit pages with {slots} slots");
        assert_eq!(r.verified_pages, want, "every restored page is verified");
        assert_eq!(r.restored_pages, want);
        if slots <= 2_000 {
            assert!(r.evictions > 0, "a {slots}-slot pool must evict");
        } else if slots > total {
            assert_eq!(r.evictions, 0);
            assert_eq!(r.dropped_pages, 0);
        }
        // Every page is either a hit, or saved, or already resident, or dropped.
        assert_eq!(r.hit_pages + r.saved_pages + r.resident_pages + r.dropped_pages, r.pages);
        assert_eq!(r.in_flight_pages + r.refused_pages, 0);
    }
}

/// A deterministic synthetic trace with heavy, interleaved prefix reuse: 400 requests from 25
/// conversations whose prompts grow turn by turn (half of them behind a shared system block), with
/// partial last pages.
fn synthetic_trace() -> Vec<TraceRequest> {
    let mut x: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |m: u64| {
        x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
        (x >> 33) % m
    };
    let mut turns = [0u64; 25];
    (0..400)
        .map(|i| {
            let c = next(25);
            turns[c as usize] += 1;
            let blocks = (turns[c as usize] + next(3)).min(12);
            let mut hash_ids: Vec<u64> = (0..blocks).map(|b| 1_000 * (c + 1) + b).collect();
            if c % 2 == 0 {
                hash_ids[0] = 7; // a shared system prompt block
            }
            let input_length = blocks * 512 - next(500);
            TraceRequest { timestamp_ms: i, input_length, output_length: 1, hash_ids }
        })
        .collect()
}

#[test]
fn lru_replay_of_a_reuse_heavy_trace_equals_the_reference_model() {
    let reqs = synthetic_trace();
    let total: u64 = reqs.iter().map(|r| r.page_count(64) as u64).sum();
    let mut seen = Vec::new();
    for slots in [40u64, 150, 600, total + 1] {
        let r = replay_lru(&reqs, slots, 1);
        let want = model_for(&reqs, slots);
        assert_eq!(r.hit_pages, want, "hit pages with {slots} slots");
        assert_eq!(r.verified_pages, want);
        assert_eq!(r.hit_pages + r.saved_pages + r.resident_pages + r.dropped_pages, r.pages);
        seen.push(want);
    }
    // The capacities must matter, or the comparison proves little.
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "hits by capacity: {seen:?}");
}

// ---------------------------------------------------------------------------------------------
// Replays over an SSD tier.
// ---------------------------------------------------------------------------------------------

/// The tiny layout with 512-token pages: one page per trace block, 512 B host slots (4 KiB on
/// disk).
fn block_geometry(pages: u64) -> Geometry {
    Geometry::new("test-ssd", 512, vec![ArenaSpec::packed("a", 256, pages), ArenaSpec::packed("b", 128, pages)])
        .unwrap()
}

/// A temporary directory under cargo's target tmpdir (the build disk, where `O_DIRECT` works).
fn ssd_dir() -> tempfile::TempDir {
    let base = env!("CARGO_TARGET_TMPDIR");
    std::fs::create_dir_all(base).unwrap();
    tempfile::tempdir_in(base).unwrap()
}

/// `requests` one at a time through an LRU pool of `slots` blocks of [`block_geometry`] (chain-aware
/// victims), over `ssd`.
fn replay_blocks(requests: &[TraceRequest], slots: u64, ssd: Option<kvtier::SsdConfig>) -> ReplayReport {
    let g = block_geometry(replay::gpu_pages_needed(requests, 512, 1).unwrap());
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let config = ReplayConfig {
        policy: PolicyKind::Lru,
        pool_bytes: slots * g.slot_bytes(),
        backing: BackingChoice::Plain,
        ssd,
        ..Default::default()
    };
    replay::run(requests, &config, &arenas, &|_| {}).unwrap()
}

/// The reuse-heavy trace through a 16-block pool (every request fits) over a drive that holds every
/// block, admitting at the save: every saved block is on the drive after its request (one request
/// at a time waits for its demotions), so the drive's figures are exact; the blocks the pool
/// evicted come back as promoted hits, restored and verified. A second replay on the same file
/// finds every block again.
#[test]
fn a_replay_over_an_ssd_tier_serves_the_blocks_its_pool_evicted() {
    let reqs = synthetic_trace();
    let g = block_geometry(1);
    let distinct: HashSet<ContentKey> = reqs.iter().flat_map(|r| r.page_keys(&g.namespace(), 512)).collect();
    let distinct = distinct.len() as u64;
    let bytes = 4096 + distinct * g.disk_slot_bytes();
    let dir = ssd_dir();
    let ssd = |name: &str| Some(kvtier::SsdConfig::new(dir.path().join(name), bytes).with_admit_uses(1));
    let host_only = replay_blocks(&reqs, 16, None);
    assert!(host_only.ssd.is_none());
    let r = replay_blocks(&reqs, 16, ssd("a.kvtier"));
    let s = r.ssd.clone().expect("the SSD tier's figures");
    assert_eq!(std::fs::metadata(dir.path().join("a.kvtier")).unwrap().len(), bytes);
    assert_eq!((s.files, s.admit.as_str(), s.capacity_blocks, s.disk_slot_bytes), (1, "1", distinct, 4096));
    assert_eq!(s.host_hit_pages + s.promoted_pages, r.hit_pages, "every hit is a host hit or a promoted one");
    assert_eq!(s.promoted_pages, s.promoted_blocks, "the leases' promoted blocks are the drive's reads");
    assert!(s.promoted_pages > 0, "the pool evicts blocks that later requests reuse");
    assert!(r.hit_pages > host_only.hit_pages, "{} hits over the drive, {} without", r.hit_pages, host_only.hit_pages);
    assert_eq!((r.verified_pages, r.dropped_pages, r.refused_pages), (r.hit_pages, 0, 0));
    // Every block was saved once, demoted once, and is still on the drive.
    assert_eq!((s.demoted_blocks, s.blocks, s.disk_evictions), (distinct, distinct, 0));
    assert_eq!((s.bytes_demoted, s.bytes_promoted), (distinct * g.slot_bytes(), s.promoted_blocks * g.slot_bytes()));
    assert_eq!((s.demotions_dropped, s.demotion_failures, s.promotion_failures, s.recovered_blocks), (0, 0, 0, 0));
    assert_eq!(s.io_direct + s.io_buffered, s.demoted_blocks + s.promoted_blocks, "one transfer per block");
    // Deterministic: the same replay on a fresh file gives the same figures.
    let again = replay_blocks(&reqs, 16, ssd("b.kvtier"));
    let t = again.ssd.clone().unwrap();
    assert_eq!((again.hit_pages, t.promoted_pages, t.demoted_blocks), (r.hit_pages, s.promoted_pages, distinct));
    // The first file reopened: its blocks are found again and serve even first requests.
    let reopened = replay_blocks(&reqs, 16, ssd("a.kvtier"));
    let u = reopened.ssd.clone().unwrap();
    assert_eq!((u.recovered_blocks, u.recovered_torn, u.recovered_foreign), (distinct, 0, 0));
    assert_eq!((u.demoted_blocks, u.blocks), (0, distinct), "nothing new to write");
    assert_eq!(u.host_hit_pages + u.promoted_pages, reopened.hit_pages);
    assert!(
        u.promoted_pages > s.promoted_pages,
        "{} promoted after the reopen, {} before",
        u.promoted_pages,
        s.promoted_pages
    );
    assert_eq!(reopened.verified_pages, reopened.hit_pages);
}

/// An SSD file too small for one block is refused before anything is created.
#[test]
fn an_ssd_file_too_small_for_a_block_is_refused_before_anything_is_created() {
    let reqs = &sample()[..2];
    let g = block_geometry(replay::gpu_pages_needed(reqs, 512, 1).unwrap());
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let dir = ssd_dir();
    let (a, b) = (dir.path().join("a.kvtier"), dir.path().join("b.kvtier"));
    let ssd = kvtier::SsdConfig::new(&a, 4096 + 4 * 4096).with_file(&b, 4096 + 4095);
    let config = ReplayConfig {
        pool_bytes: 16 * g.slot_bytes(),
        backing: BackingChoice::Plain,
        ssd: Some(ssd),
        ..Default::default()
    };
    let e = replay::run(reqs, &config, &arenas, &|_| {}).unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e:?}");
    assert!(e.to_string().contains("8191 B hold no block of 512 B"), "{e}");
    assert!(!a.exists() && !b.exists(), "a refused SSD tier created a file");
}

#[test]
fn concurrent_replay_verifies_every_restore() {
    let reqs = &sample()[..40];
    let r = replay_lru(reqs, 2_000, 4);
    assert_eq!(r.requests, 40);
    assert_eq!(r.verified_pages, r.hit_pages);
    assert!(r.hit_pages > 0);
    assert_eq!(r.pages, reqs.iter().map(|q| q.page_count(64) as u64).sum::<u64>());
}

/// Arenas whose prefill writes the wrong bytes for one key (as if a save or restore had corrupted
/// it): the replay must fail verification when that page is restored.
struct Corrupting {
    inner: Arc<MemcpyArenas>,
    victim: ContentKey,
}

impl EngineArenas for Corrupting {
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn fill(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), kvtier::Error> {
        let keys: Vec<ContentKey> =
            keys.iter().map(|k| if *k == self.victim { ContentKey::from_bytes([0xEE; 16]) } else { *k }).collect();
        self.inner.fill(pages, &keys)
    }
    fn verify(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), kvtier::Error> {
        self.inner.verify(pages, keys)
    }
    fn backend(&self) -> Result<Box<dyn CopyBackend>, kvtier::Error> {
        self.inner.backend()
    }
}

#[test]
fn corrupted_restore_fails_the_run() {
    let reqs = &sample()[..2]; // both start with block 0
    let g = tiny_geometry(replay::gpu_pages_needed(reqs, 64, 1).unwrap());
    let arenas = Corrupting {
        inner: Arc::new(MemcpyArenas::new(&g).unwrap()),
        victim: g.namespace().trace_page_key(reqs[0].hash_ids[0], 3),
    };
    let config =
        ReplayConfig { pool_bytes: 1_000 * g.slot_bytes(), backing: BackingChoice::Plain, ..Default::default() };
    match replay::run(reqs, &config, &arenas, &|_| {}) {
        Err(Error::Kvtier(e @ kvtier::Error::Verification { .. })) => {
            assert!(e.to_string().contains("GPU page 3"), "{e}")
        }
        other => panic!("expected a verification failure, got {other:?}"),
    }
}

#[test]
fn request_larger_than_the_gpu_pages_is_a_typed_error() {
    let reqs = trace::parse_str(
        "{\"timestamp\": 0, \"input_length\": 640, \"output_length\": 1, \"hash_ids\": [1, 2]}\n\
         {\"timestamp\": 1, \"input_length\": 1100, \"output_length\": 1, \"hash_ids\": [1, 2, 3]}\n",
    )
    .unwrap();
    let g = tiny_geometry(16);
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let config = ReplayConfig { pool_bytes: 100 * g.slot_bytes(), backing: BackingChoice::Plain, ..Default::default() };
    match replay::run(&reqs, &config, &arenas, &|_| {}) {
        Err(Error::Replay(ReplayError::RequestTooLarge { request: 2, pages: 17, gpu_pages: 16 })) => {}
        other => panic!("expected RequestTooLarge, got {other:?}"),
    }
    let e = replay::run(&reqs, &ReplayConfig { gpu_pages: Some(8), ..config }, &arenas, &|_| {}).unwrap_err();
    assert_eq!(
        e.to_string(),
        "request 1 of the trace has 10 pages but the replay has only 8 GPU pages; raise --gpu-pages to at least 10"
    );
}

#[test]
fn malformed_lines_are_rejected_with_their_line_number() {
    let good = r#"{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]}"#;
    let bad = [
        ("{\"timestamp\": 0,", "not valid JSON"),
        (r#"{"timestamp": 0, "output_length": 1, "hash_ids": [1]}"#, "missing field `input_length`"),
        (r#"{"timestamp": -5, "input_length": 6, "output_length": 1, "hash_ids": [1]}"#, "`timestamp` is negative"),
        (
            r#"{"timestamp": 0, "input_length": 6, "output_length": 1.5, "hash_ids": [1]}"#,
            "`output_length` is not an integer",
        ),
        (r#"{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": []}"#, "`hash_ids` is empty"),
        (r#"{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}"#, "`input_length` is 0"),
        (
            r#"{"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1, "x"]}"#,
            "`hash_ids[1]` must be a non-negative integer",
        ),
    ];
    for (line, want) in bad {
        // Line 4: a blank line is skipped but still counted.
        let text = format!("{good}\n\n{good}\n{line}\n{good}\n");
        match trace::parse_str(&text) {
            Err(TraceError::Malformed { line: 4, message }) => assert!(message.contains(want), "{message}"),
            other => panic!("`{line}`: expected a malformed line 4, got {other:?}"),
        }
    }
}

/// The whole conversation trace shipped in `data/` (zstd) against its published facts and the
/// block-level reference figures in `data/README.md` (the model only; no bytes move). The trace is
/// part of the repository: if it cannot be found the test fails.
#[test]
fn block_level_model_matches_the_published_reference_figures() {
    let path = support::data_file("mooncake_conversation_trace.jsonl.zst");
    let reqs = trace::load(&path).unwrap();
    assert_eq!(reqs.len(), 12_031);
    let refs: u64 = reqs.iter().map(|r| r.hash_ids.len() as u64).sum();
    assert_eq!(refs, 288_500);
    let distinct: HashSet<u64> = reqs.iter().flat_map(|r| r.hash_ids.iter().copied()).collect();
    assert_eq!(distinct.len(), 182_790);
    // The bundled sample is its first 80 requests.
    assert_eq!(reqs[..80], trace::sample().unwrap()[..]);
    assert_eq!(reqs.last().unwrap().timestamp_ms, 3_536_999, "an hour of requests");
    let blocks = || reqs.iter().map(|r| r.hash_ids.clone());
    for (cap, want) in [(usize::MAX, 0.366), (1_243, 0.046), (4_000, 0.086), (9_950, 0.209)] {
        let ratio = model_hits(blocks(), cap) as f64 / refs as f64;
        assert!((ratio - want).abs() < 0.0005, "capacity {cap}: LRU block hit ratio {ratio:.4}, README says {want}");
    }
}

// ---------------------------------------------------------------------------------------------
// The command line.
// ---------------------------------------------------------------------------------------------

fn kvtier(args: &[&str]) -> std::process::Output {
    Command::new(support::kvtier_bin()).args(args).env_remove("RUST_LOG").output().unwrap()
}

/// Three requests on deepseek-v3 (64-token pages, 8 per block): 8 pages, the same 8 again (8 hits),
/// then 10 pages of which the first 8 hit.
const TINY: &str = "\
{\"timestamp\": 0, \"input_length\": 512, \"output_length\": 5, \"hash_ids\": [1]}
{\"timestamp\": 10, \"input_length\": 520, \"output_length\": 5, \"hash_ids\": [1]}

{\"timestamp\": 20, \"input_length\": 700, \"output_length\": 5, \"hash_ids\": [1, 2]}
";

#[test]
fn cli_replays_a_trace_file_and_prints_json() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.jsonl");
    std::fs::write(&p, TINY).unwrap();
    let out = kvtier(&[
        "replay",
        p.to_str().unwrap(),
        "--geometry",
        "deepseek-v3",
        "--pool",
        "64MiB",
        "--backend",
        "host",
        "--backing",
        "plain",
        "--policy",
        "lru",
        "--json",
    ]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 3);
    assert_eq!(v["pages"], 26);
    assert_eq!(v["hit_pages"], 16);
    assert_eq!(v["verified_pages"], 16);
    assert_eq!(v["saved_pages"], 10);
    assert_eq!(v["gpu_pages"], 10);
    assert_eq!(v["backend"], "host");
    assert_eq!(v["pool_backing"], "plain");
    assert_eq!(v["verification"], "passed");
    assert_eq!(v["evictions"], 0);
    assert!(v.get("ssd").is_none(), "no SSD figures without --ssd: {v}");
    // The set-up (the pool made) is timed apart from the replay; the run and the command hold both.
    let secs = |name: &str| v[name].as_f64().unwrap_or_else(|| panic!("no number {name} in {v}"));
    let (setup, replay, run, command) = (secs("setup_s"), secs("wall_s"), secs("run_s"), secs("command_s"));
    assert!(setup > 0.0 && replay > 0.0, "{v}");
    assert!(run >= setup + replay && command >= run, "{v}");

    let out =
        kvtier(&["replay", p.to_str().unwrap(), "--geometry", "deepseek-v3", "--pool", "64MiB", "--backend", "host"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    for row in ["set-up time ", "replay time ", "run time ", "command time: "] {
        let line = text.lines().find(|l| l.starts_with(row)).unwrap_or_else(|| panic!("no {row:?} row: {text}"));
        assert!(line.contains(" s "), "seconds, with the unit: {line}");
    }
    assert!(!text.contains("wall time"), "{text}");
}

/// `--lookahead N` replays twice and reports both runs.
#[test]
fn cli_replay_with_lookahead_reports_with_and_without_hints() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.jsonl");
    std::fs::write(&p, TINY).unwrap();
    let args = ["replay", p.to_str().unwrap(), "--geometry", "deepseek-v3", "--pool", "64MiB", "--backend", "host"];
    let out = kvtier(&[&args[..], &["--backing", "plain", "--lookahead", "2", "--json"]].concat());
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["without_hints"]["lookahead"], 0);
    assert_eq!(v["with_hints"]["lookahead"], 2);
    for run in ["without_hints", "with_hints"] {
        assert_eq!(v[run]["hit_pages"], 16, "{run}");
        assert_eq!(v[run]["policy"], PolicyKind::default().name(), "{run}: the default policy");
        assert_eq!(v[run]["chain_aware"], true, "{run}");
    }
    let out = kvtier(&[&args[..], &["--backing", "plain", "--lookahead", "2"]].concat());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("page hit ratio 0.6154 without hints, 0.6154 with (+0.0%)"), "{text}");
}

/// Two blocks of two pages each on deepseek-v3 (64-token pages): A, A again (2 host hits), B
/// (evicts A from the 2-slot pool), A (2 pages promoted from the drive), B (evicted by A's
/// promotion, never admitted to the drive: 0 hits).
const SWAP: &str = "\
{\"timestamp\": 0, \"input_length\": 128, \"output_length\": 1, \"hash_ids\": [1]}
{\"timestamp\": 1, \"input_length\": 128, \"output_length\": 1, \"hash_ids\": [1]}
{\"timestamp\": 2, \"input_length\": 128, \"output_length\": 1, \"hash_ids\": [2]}
{\"timestamp\": 3, \"input_length\": 128, \"output_length\": 1, \"hash_ids\": [1]}
{\"timestamp\": 4, \"input_length\": 128, \"output_length\": 1, \"hash_ids\": [2]}
";

/// `kvtier replay --ssd PATH:SIZE`: the file is made at the size asked (the header and two disk
/// slots of deepseek-v3 blocks, about 5 MB), the report gains the drive's figures and the hit split
/// (JSON and table), and a second replay on the same file finds its blocks again.
#[test]
fn cli_replay_over_an_ssd_tier_reports_the_hit_split_and_the_drive() {
    let g = Geometry::preset("deepseek-v3", 1).unwrap();
    let dir = ssd_dir();
    let trace = dir.path().join("swap.jsonl");
    std::fs::write(&trace, SWAP).unwrap();
    // A colon in the file's name: the path ends at the flag's last colon.
    let file = dir.path().join("drive:0.kvtier");
    let bytes = 4096 + 2 * g.disk_slot_bytes();
    let flag = format!("{}:{bytes}", file.display());
    let pool = (2 * g.slot_bytes()).to_string();
    let args = ["replay", trace.to_str().unwrap(), "--geometry", "deepseek-v3", "--pool", &pool, "--backend", "host"];
    let args = [&args[..], &["--backing", "plain", "--ssd", &flag, "--ssd-admit", "2"]].concat();
    let run = |extra: &[&str]| {
        let out = kvtier(&[&args[..], extra].concat());
        assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
        out
    };
    let v: serde_json::Value = serde_json::from_slice(&run(&["--json"]).stdout).unwrap();
    assert_eq!(std::fs::metadata(&file).unwrap().len(), bytes, "the file holds two disk slots");
    assert_eq!((v["requests"].as_u64(), v["pages"].as_u64(), v["hit_pages"].as_u64()), (Some(5), Some(10), Some(4)));
    let s = &v["ssd"];
    let n = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("no ssd.{k} in {s}"));
    assert_eq!((n("files"), n("capacity_blocks"), n("disk_slot_bytes")), (1, 2, g.disk_slot_bytes()));
    assert_eq!(s["admit"], "2");
    assert_eq!(
        (n("host_hit_pages"), n("promoted_pages")),
        (2, 2),
        "A's second use from the host, its return from the drive"
    );
    assert_eq!((n("demoted_blocks"), n("blocks"), n("disk_evictions"), n("recovered_blocks")), (2, 2, 0, 0));
    assert_eq!((n("promoted_blocks"), n("bytes_promoted"), n("promotion_failures")), (2, 2 * g.slot_bytes(), 0));
    assert_eq!(n("bytes_demoted"), 2 * g.slot_bytes());
    assert_eq!(n("io_direct") + n("io_buffered"), 4, "two writes, two reads");
    assert_eq!(v["verified_pages"], 4);
    // Again on the same file: A's blocks are found, and promoted at the first request too.
    let text = String::from_utf8(run(&[]).stdout).unwrap();
    for want in [
        "hit pages        6\n",
        "hit split        2 host pages, 4 promoted from the SSD\n",
        "SSD blocks       2 held, 0 evicted, 2 recovered at open (0 torn, 0 foreign)\n",
        "SSD demoted      0 blocks",
    ] {
        assert!(text.contains(want), "`{want}` not in:\n{text}");
    }
    let tier_row = format!(
        "SSD tier         2 disk slots of {} B (0.01 GB), 1 file, admitted after 2 uses\n",
        g.disk_slot_bytes()
    );
    assert!(text.contains(&tier_row), "`{tier_row}` not in:\n{text}");
    let rows = ["SSD promoted     4 blocks", "SSD transfers    "];
    assert!(rows.iter().all(|r| text.contains(r)), "{text}");
}

#[test]
fn cli_errors_are_clear_and_exit_non_zero() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tiny.jsonl");
    std::fs::write(&p, TINY).unwrap();
    let trace = p.to_str().unwrap();
    let small_file = dir.path().join("small.kvtier");
    let small = format!("{}:1MiB", small_file.display());
    // (arguments, exit code, text the error must contain); clap's usage errors exit with 2.
    let mut cases: Vec<(Vec<&str>, i32, &str)> = vec![
        (
            vec!["replay", trace, "--geometry", "deepseek-v3", "--gpu-pages", "9", "--pool", "64MiB"],
            1,
            "error: request 3 of the trace has 10 pages but the replay has only 9 GPU pages",
        ),
        (vec!["replay", trace, "--geometry", "nope"], 1, "error: unknown geometry preset `nope`"),
        (vec!["replay", "/nonexistent/trace.jsonl"], 1, "error: reading trace /nonexistent/trace.jsonl"),
        (vec!["replay", trace, "--geometry", "deepseek-v3", "--pool", "1MiB"], 1, "holds no slot"),
        (vec!["replay", trace, "--pool", "lots"], 2, "`lots` is not a byte size"),
        (vec!["replay", trace, "--policy", "fifo"], 2, "unknown policy `fifo` (known: lru, clock"),
        (vec!["replay", trace, "--backend", "gpu"], 2, "unknown backend `gpu` (known: auto, host, cuda)"),
        (vec!["replay", trace, "--ssd", "drive.kvtier"], 2, "`drive.kvtier` is not PATH:SIZE"),
        (vec!["replay", trace, "--ssd", "drive.kvtier:2tb"], 2, "did you mean 2TB"),
        (
            vec!["replay", trace, "--ssd", "x:1GiB", "--ssd-admit", "0"],
            2,
            "SSD admission `0` is neither `auto` nor a number of uses",
        ),
        (vec!["replay", trace, "--ssd", "x:1GiB", "--lookahead", "2"], 2, "cannot be used with"),
        (vec!["replay", trace, "--geometry", "deepseek-v3", "--pool", "64MiB", "--ssd", &small], 1, "hold no block of"),
    ];
    if cfg!(not(feature = "cuda")) {
        cases.push((vec!["replay", trace, "--backend", "cuda"], 1, "built without CUDA support"));
        cases.push((vec!["replay", trace, "--backend", "cuda"], 1, "--features cuda"));
    }
    for (args, code, want) in cases {
        let out = kvtier(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: stderr `{err}` lacks `{want}`");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    assert!(!small_file.exists(), "a refused SSD file is not created");
    std::fs::write(&p, format!("{TINY}{{\"timestamp\": 1, \"input_length\": 6}}\n")).unwrap();
    let out = kvtier(&["replay", trace, "--geometry", "deepseek-v3"]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(String::from_utf8_lossy(&out.stderr).trim(), "error: trace line 5: missing field `output_length`");
}
