//! `kvtier simulate`: the tier-driven LRU equals an independent reference model, the offline optimum
//! bounds every policy, the foresight reference reaches the optimum, and the command runs on the
//! whole shipped trace.

mod support;

use kvtier::{ContentKey, Geometry, PolicyKind, SsdAdmit};
use kvtier_cli::simulate::foresight::foresight_hits;
use kvtier_cli::simulate::two_level::{run_two_level, unbounded};
use kvtier_cli::simulate::{belady, belady_ids, page_keys, run_policy, Variant};
use kvtier_cli::trace::{parse_str, TraceRequest};
use std::collections::HashMap;
use std::process::Command;

/// A small synthetic conversation trace: every prompt starts with shared block 0, then the growing
/// history of one of `convs` conversations (skewed choice), with partial last pages.
fn synthetic(seed: u64, requests: usize, convs: u64) -> Vec<TraceRequest> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut rnd = move |m: u64| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m
    };
    let mut hist: Vec<u64> = vec![0; convs as usize];
    (0..requests)
        .map(|_| {
            let c = rnd(convs).min(rnd(convs)); // skewed towards low ids
            hist[c as usize] += 1 + rnd(3);
            let blocks = hist[c as usize].min(12);
            let mut ids = vec![0];
            ids.extend((0..blocks).map(|k| 1000 * (c + 1) + k));
            let input_length = ids.len() as u64 * 512 - rnd(512);
            TraceRequest { timestamp_ms: 0, input_length, output_length: 1, hash_ids: ids }
        })
        .collect()
}

/// Page-level LRU with the simulation's semantics, written independently of the tier: query touches
/// the resident prefix in order; the save touches resident pages of the rest in order, then takes
/// `min(missing, capacity - its resident pages)` slots (free ones first, then the least recently
/// touched pages; its own resident pages are pinned by the save), and
/// the saved pages are touched in order.
fn reference_lru(keys: &[Vec<ContentKey>], cap: usize) -> u64 {
    let mut tick = 0u64;
    let mut res: HashMap<ContentKey, u64> = HashMap::new();
    let mut hits = 0;
    for k in keys {
        let h = k.iter().take_while(|key| res.contains_key(key)).count();
        hits += h as u64;
        for key in &k[..h] {
            tick += 1;
            res.insert(*key, tick);
        }
        let mut missing = Vec::new();
        for key in &k[h..] {
            if let Some(t) = res.get_mut(key) {
                tick += 1;
                *t = tick;
            } else {
                missing.push(*key);
            }
        }
        // The save pins its own resident pages: it takes at most the rest of the pool.
        let own = k[h..].len() - missing.len();
        let take = missing.len().min(cap - own);
        let free = cap - res.len();
        if take > free {
            let mut by_age: Vec<(u64, ContentKey)> = res.iter().map(|(k, t)| (*t, *k)).collect();
            by_age.sort();
            for (_, key) in by_age.into_iter().take(take - free) {
                res.remove(&key);
            }
        }
        for key in &missing[..take] {
            tick += 1;
            res.insert(*key, tick);
        }
    }
    hits
}

fn glm52() -> Geometry {
    Geometry::preset("glm52", 1).unwrap()
}

#[test]
fn lru_through_the_tier_equals_the_reference_model() {
    let g = glm52();
    for (seed, cap) in [(1u64, 40u32), (2, 90), (3, 200)] {
        let keys = page_keys(&synthetic(seed, 300, 12), &g).unwrap();
        let want = reference_lru(&keys, cap as usize);
        let got = run_policy(&keys, Variant::plain(PolicyKind::Lru), cap, &g, &|_| {}).unwrap();
        assert_eq!(got.hit_pages, want, "seed {seed}, {cap} slots");
        assert!(want > 0, "the trace must exercise hits");
    }
}

#[test]
fn optimum_bounds_every_policy() {
    let g = glm52();
    for seed in [4u64, 5, 6] {
        let keys = page_keys(&synthetic(seed, 250, 10), &g).unwrap();
        for cap in [24u32, 64, 150] {
            let opt = belady(&keys, cap);
            for &policy in PolicyKind::ALL {
                for (chain, lookahead) in [(false, 0), (true, 0), (true, 8)] {
                    let v = Variant::new(policy, chain, lookahead);
                    let r = run_policy(&keys, v, cap, &g, &|_| {}).unwrap();
                    let l = v.label();
                    assert!(r.hit_pages <= opt, "{l} got {} > optimum {opt} (seed {seed}, {cap} slots)", r.hit_pages);
                }
            }
        }
    }
}

/// The page keys of requests for one trace block each (`ids`), each 2 full 64-token pages.
fn one_block_requests(g: &Geometry, ids: &[u64]) -> Vec<Vec<ContentKey>> {
    let line = |id: u64| format!("{{\"timestamp\":0,\"input_length\":128,\"output_length\":1,\"hash_ids\":[{id}]}}\n");
    let text: String = ids.iter().map(|&i| line(i)).collect();
    page_keys(&parse_str(&text).unwrap(), g).unwrap()
}

#[test]
fn optimum_is_exact_on_a_tiny_trace() {
    // Pages: each request is one block of 2 full pages (128 tokens of 64-token pages).
    let g = glm52();
    let keys = one_block_requests(&g, &[1, 2, 1, 3, 1, 2]);
    // 4 slots: blocks 1 and 2 both fit; 3 bypasses; hits: 1 (2 pages), 1 (2), 2 (2).
    assert_eq!(belady(&keys, 4), 6);
    // 2 slots: keep block 1 throughout (3 bypasses, 2 bypasses): hits on requests 3 and 5.
    assert_eq!(belady(&keys, 2), 4);
    // LRU on 2 slots: 1, 2 (evicts 1), 1 (evicts 2), 3 (evicts 1), 1, 2: no hits.
    assert_eq!(run_policy(&keys, Variant::plain(PolicyKind::Lru), 2, &g, &|_| {}).unwrap().hit_pages, 0);
}

#[test]
fn foresight_is_exact_on_a_tiny_trace() {
    // Blocks of 2 full pages, requests for blocks 1, 2, 1, 3, 1, 2, on 2 slots (one block).
    let g = glm52();
    let keys = one_block_requests(&g, &[1, 2, 1, 3, 1, 2]);
    let (seqs, next, ids) = belady_ids(&keys);
    let hits = |horizon| foresight_hits(&seqs, &next, ids, 2, horizon);
    // Seeing nothing, it is LRU: no hits (see optimum_is_exact_on_a_tiny_trace).
    assert_eq!(hits(0), 0);
    // Seeing one request ahead is the optimum here: at request 2 block 1 (used by request 3) is
    // kept and block 2 (used by request 6, not seen) is not admitted; at request 4 block 1 (used by
    // request 5) is kept and block 3 (never used again) is not admitted: hits at requests 3 and 5.
    assert_eq!(hits(1), 4);
    assert_eq!(hits(1), belady(&keys, 2));
}

#[test]
fn foresight_of_the_whole_trace_is_the_optimum() {
    let g = glm52();
    for seed in [4u64, 5, 6] {
        let keys = page_keys(&synthetic(seed, 250, 10), &g).unwrap();
        let (seqs, next, ids) = belady_ids(&keys);
        for cap in [24u32, 64, 150] {
            let opt = belady(&keys, cap);
            assert_eq!(foresight_hits(&seqs, &next, ids, cap, 250), opt, "seed {seed}, {cap} slots");
            assert!(
                foresight_hits(&seqs, &next, ids, cap, 0) < opt,
                "seed {seed}, {cap} slots: the trace separates them"
            );
        }
    }
}

#[test]
fn two_levels_are_exact_on_a_tiny_trace() {
    // Blocks of 2 full pages, requests for blocks 1, 2, 1, 3, 1, 2; LRU on the host, the drive's
    // own recency order under it.
    let g = glm52();
    let keys = one_block_requests(&g, &[1, 2, 1, 3, 1, 2]);
    let lru = Variant::plain(PolicyKind::Lru);
    // An unbounded cache hits requests 3, 5 and 6.
    assert_eq!(unbounded(&keys), 6);
    // Host pool of 2 slots (one block): no host hit at all (see optimum_is_exact_on_a_tiny_trace).
    // Admitted after 2 uses, counted per stay on the host as the tier counts them: no block is
    // ever leased from the host, so none reaches 2 uses and nothing is written.
    let r = run_two_level(&keys, lru, 2, 8, SsdAdmit::Uses(2), &g, &|_| {}).unwrap();
    assert_eq!((r.host_hit_pages, r.ssd_hit_pages, r.demoted_pages), (0, 0, 0));
    assert_eq!(r.ssd_evictions, 0);
    // Admitted at the first use, on an SSD of 2 blocks (4 slots): requests 3 and 5 hit block 1 on
    // the SSD (each hit refreshes it); block 3's demotion at request 4 evicts block 2, so request 6
    // misses, and its demotion evicts block 3.
    let r = run_two_level(&keys, lru, 2, 4, SsdAdmit::Uses(1), &g, &|_| {}).unwrap();
    assert_eq!((r.host_hit_pages, r.ssd_hit_pages, r.demoted_pages), (0, 4, 8));
    assert_eq!(r.ssd_evictions, 4);
    // An SSD of 3 blocks holds everything: the two levels reach the unbounded cache; so does
    // `auto`, which admits after 1 use on a drive that never evicts.
    for admit in [SsdAdmit::Uses(1), SsdAdmit::Auto] {
        let r = run_two_level(&keys, lru, 2, 6, admit, &g, &|_| {}).unwrap();
        assert_eq!((r.host_hit_pages + r.ssd_hit_pages, r.demoted_pages, r.ssd_evictions), (6, 6, 0), "{admit}");
    }
    assert!(
        run_two_level(&keys, lru, 2, 6, SsdAdmit::Uses(0), &g, &|_| {}).is_err(),
        "an admission after 0 uses is refused"
    );
}

/// Issue 49: the two levels are chosen together. As the tier does, the host takes its victims
/// among the blocks the drive holds a copy of before the others (a clean block is cheap to drop:
/// the drive gives it back), so the host keeps a block the drive lacks.
#[test]
fn the_host_drops_blocks_the_drive_holds_first() {
    // Blocks of 2 pages: 2, 1, 1, 3, 4, 5, 2, 1 on a host of 8 slots (4 blocks), LRU, admitted to
    // the drive after 2 uses. Request 3 leases block 1 (its 2nd use): it is written to the drive.
    // Request 6 (block 5) needs 2 slots: LRU alone takes block 2 (least recently used), the tier
    // takes block 1 (clean) instead.
    let g = glm52();
    let keys = one_block_requests(&g, &[2, 1, 1, 3, 4, 5, 2, 1]);
    let lru = Variant::plain(PolicyKind::Lru);
    // The host pool alone: only request 3 hits.
    assert_eq!(run_policy(&keys, lru, 8, &g, &|_| {}).unwrap().hit_pages, 2);
    // Over the drive: request 7 finds block 2 on the host, request 8 block 1 on the drive.
    let r = run_two_level(&keys, lru, 8, 64, SsdAdmit::Uses(2), &g, &|_| {}).unwrap();
    assert_eq!(
        (r.host_hit_pages, r.ssd_hit_pages),
        (4, 2),
        "the host kept a block with a disk copy and dropped one without"
    );
    // Written: block 1 (request 3) and block 2 (its 2nd use, request 7).
    assert_eq!((r.demoted_pages, r.ssd_evictions, r.ssd_dropped_pages), (4, 0, 0));
}

/// Issue 49: under prefix-tinylfu the drive refused (`ssd_dropped_pages`) every block's first
/// demotion and never evicted, because the simulation managed the drive with the host's policy,
/// doorkeeper included. The tier's drive has its own recency order and no doorkeeper: whatever
/// the host policy, a drive larger than the trace drops nothing, evicts nothing, and holds every
/// block the host saved once admission after 1 use wrote it.
#[test]
fn the_drive_keeps_its_own_order_whatever_the_host_policy() {
    let g = glm52();
    let keys = page_keys(&synthetic(7, 250, 10), &g).unwrap();
    for &policy in PolicyKind::ALL {
        let r = run_two_level(&keys, Variant::new(policy, true, 0), 24, 4096, SsdAdmit::Uses(1), &g, &|_| {}).unwrap();
        let p = policy.name();
        assert_eq!(r.ssd_dropped_pages, 0, "{p}: the drive refused demotions");
        assert_eq!(r.ssd_evictions, 0, "{p}: a drive larger than the trace evicted");
        assert!(r.ssd_hit_pages > 0, "{p}: the drive served nothing");
    }
}

#[test]
fn the_ssd_only_adds_hits_under_the_host_pools() {
    // The SSD adds hits: both levels together find at least the host pool alone's, up to the
    // unbounded cache's (the host's own share may be smaller: it drops blocks the drive holds
    // first, see the_host_drops_blocks_the_drive_holds_first).
    let g = glm52();
    for seed in [7u64, 8] {
        let keys = page_keys(&synthetic(seed, 250, 10), &g).unwrap();
        let all = unbounded(&keys);
        for &policy in [PolicyKind::Lru, PolicyKind::S3Fifo, PolicyKind::AdaptiveLfu].iter() {
            for (chain, lookahead) in [(false, 0), (true, 4)] {
                let v = Variant::new(policy, chain, lookahead);
                let host = run_policy(&keys, v, 24, &g, &|_| {}).unwrap();
                for ssd in [16u32, 64, 4096] {
                    for admit in [SsdAdmit::Uses(1), SsdAdmit::Uses(2), SsdAdmit::Auto] {
                        let r = run_two_level(&keys, v, 24, ssd, admit, &g, &|_| {}).unwrap();
                        let l = format!("{} admit {admit}", v.label());
                        let both = r.host_hit_pages + r.ssd_hit_pages;
                        // A drive smaller than the host pool (16 slots under 24) may evict the
                        // copies of the clean blocks the host dropped before they come back: a few
                        // percent below the host pool alone there.
                        let lo = if ssd > 24 { host.hit_pages } else { host.hit_pages * 95 / 100 };
                        assert!(both >= lo && both <= all, "{l}, seed {seed}, SSD {ssd}: {both} not in {lo}..={all}");
                        if ssd == 4096 && admit != SsdAdmit::Uses(2) {
                            assert!(r.ssd_hit_pages > 0, "{l}, seed {seed}: an SSD larger than the trace finds pages");
                        }
                    }
                }
            }
        }
    }
}

/// `kvtier simulate` on the shipped, zstd-compressed conversation trace: the JSON report and the
/// SVG plot.
#[test]
fn cli_simulates_the_shipped_trace() {
    let trace = support::data_file("mooncake_conversation_trace.jsonl.zst");
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("hit-ratio.svg");
    let out = Command::new(support::kvtier_bin())
        .args(["simulate", trace.to_str().unwrap(), "--requests", "300", "--pool", "300slots,1200slots"])
        .args(["--policies", "lru,sieve", "--chain", "off", "--json", "--plot", plot.to_str().unwrap()])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["requests"], 300);
    assert_eq!(v["sizes"], serde_json::json!([["300slots", 300], ["1200slots", 1200]]));
    let runs = v["runs"].as_array().unwrap();
    let names: Vec<&str> = runs.iter().map(|r| r["policy"].as_str().unwrap()).collect();
    assert_eq!(names, ["lru", "lru", "sieve", "sieve", "optimum", "optimum"]);
    for r in runs {
        assert!(
            r["hit_pages"].as_u64().unwrap() <= runs[4 + (r["slots"] == 1200) as usize]["hit_pages"].as_u64().unwrap()
        );
    }
    let svg = std::fs::read_to_string(&plot).unwrap();
    assert!(svg.starts_with("<svg"), "{}", &svg[..svg.len().min(200)]);
    // The words of the <text> elements: legend, axis titles, the pool sizes as ticks.
    let texts: Vec<&str> =
        svg.split("<text").skip(1).filter_map(|t| Some(t.split_once('>')?.1.split_once("</text>")?.0.trim())).collect();
    for label in ["lru", "sieve", "optimum", "page hit ratio", "300slots", "1200slots"] {
        assert!(texts.contains(&label), "the plot lacks `{label}`: {texts:?}");
    }
}

/// `kvtier synth` is deterministic per seed and writes a trace `simulate` reads; `simulate --half`
/// and `--lookahead` run on it and on the shipped trace, reporting hinted runs beside the others.
#[test]
fn cli_synth_then_simulate_halves_and_lookahead() {
    let trace = support::data_file("mooncake_conversation_trace.jsonl.zst");
    let dir = tempfile::tempdir().unwrap();
    let synth = |seed: &str, out: &std::path::Path| {
        let o = Command::new(support::kvtier_bin())
            .args(["synth", trace.to_str().unwrap(), "--requests", "150", "--seed", seed, "-o", out.to_str().unwrap()])
            .env_remove("RUST_LOG")
            .output()
            .unwrap();
        assert!(o.status.success(), "stderr: {}", String::from_utf8_lossy(&o.stderr));
        std::fs::read_to_string(out).unwrap()
    };
    let (a, b, c) = (dir.path().join("a.jsonl"), dir.path().join("b.jsonl"), dir.path().join("c.jsonl"));
    let (ta, tb, tc) = (synth("3", &a), synth("3", &b), synth("4", &c));
    assert_eq!(ta, tb, "same seed, same trace");
    assert_ne!(ta, tc);
    let reqs = parse_str(&ta).unwrap();
    assert_eq!(reqs.len(), 150);
    assert!(reqs.iter().all(|r| r.hash_ids[0] == 0), "the measured system prefix (block 0) starts every prompt");
    for (path, extra) in [(a.to_str().unwrap(), None), (trace.to_str().unwrap(), Some("second"))] {
        let mut cmd = Command::new(support::kvtier_bin());
        cmd.args(["simulate", path, "--requests", "150", "--pool", "200slots", "--policies", "lru,adaptive-lfu"])
            .args(["--lookahead", "4", "--json", "--no-optimum"]);
        if let Some(h) = extra {
            cmd.args(["--half", h]);
        }
        let out = cmd.env_remove("RUST_LOG").output().unwrap();
        assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let names: Vec<&str> = v["runs"].as_array().unwrap().iter().map(|r| r["policy"].as_str().unwrap()).collect();
        assert_eq!(
            names,
            [
                "lru",
                "lru+la4",
                "lru+chain",
                "lru+chain+la4",
                "adaptive-lfu",
                "adaptive-lfu+la4",
                "adaptive-lfu+chain",
                "adaptive-lfu+chain+la4"
            ]
        );
        if extra.is_some() {
            assert!(v["trace"].as_str().unwrap().ends_with("(second half by time)"), "{}", v["trace"]);
        }
    }
}

/// Chain-aware LRU through the tier equals an independent model: LRU where every block ranks by
/// the newest tick of the resident blocks that continue it (deeper first on ties), orphans first.
#[test]
fn chain_aware_lru_through_the_tier_equals_its_model() {
    let g = glm52();
    for (seed, cap) in [(11u64, 40u32), (12, 90)] {
        let keys = page_keys(&synthetic(seed, 200, 10), &g).unwrap();
        let v = Variant::new(PolicyKind::Lru, true, 0);
        let got = run_policy(&keys, v, cap, &g, &|_| {}).unwrap();
        assert_eq!(got.hit_pages, reference_chain_lru(&keys, cap as usize), "seed {seed}, {cap} slots");
        // The chain order changes what is evicted (1,227 against 1,250 and 1,952 against 1,912 hits).
        assert_ne!(got.hit_pages, reference_lru(&keys, cap as usize), "seed {seed}: the chains must matter");
    }
}

/// The model of `chain_aware_lru_through_the_tier_equals_its_model`: `reference_lru`'s semantics, with
/// each resident page's parent (the page before it in the request that saved it or found it
/// resident without a live parent) and eviction ordered by (orphan first, newest tick in the
/// subtree, deeper first).
fn reference_chain_lru(keys: &[Vec<ContentKey>], cap: usize) -> u64 {
    #[derive(Clone, Copy)]
    struct Page {
        tick: u64,
        depth: u32,
        parent: Option<(ContentKey, u64)>,
        incarnation: u64,
    }
    let mut tick = 0u64;
    let mut born = 0u64;
    let mut res: HashMap<ContentKey, Page> = HashMap::new();
    let mut hits = 0;
    let live = |res: &HashMap<ContentKey, Page>, p: Option<(ContentKey, u64)>| {
        p.is_some_and(|(k, inc)| res.get(&k).is_some_and(|q| q.incarnation == inc))
    };
    for k in keys {
        let h = k.iter().take_while(|key| res.contains_key(key)).count();
        hits += h as u64;
        for key in &k[..h] {
            tick += 1;
            res.get_mut(key).unwrap().tick = tick;
        }
        let mut missing = Vec::new();
        let mut resident_here = Vec::new();
        for (d, key) in k.iter().enumerate().skip(h) {
            if let Some(p) = res.get_mut(key) {
                tick += 1;
                p.tick = tick;
                resident_here.push(d);
            } else {
                missing.push(d);
            }
        }
        let own = resident_here.len();
        let take = missing.len().min(cap - own);
        let free = cap - res.len();
        if take > free {
            // Eviction: the pinned pages of this save are not candidates.
            let pinned: std::collections::HashSet<ContentKey> = resident_here.iter().map(|&d| k[d]).collect();
            let mut eff: HashMap<ContentKey, u64> = res.iter().map(|(k, p)| (*k, p.tick)).collect();
            let mut by_depth: Vec<(u32, ContentKey)> = res.iter().map(|(k, p)| (p.depth, *k)).collect();
            by_depth.sort_by_key(|&(d, _)| std::cmp::Reverse(d));
            for (_, c) in &by_depth {
                let p = res[c];
                if live(&res, p.parent) {
                    let (pk, _) = p.parent.unwrap();
                    let v = eff[c];
                    let e = eff.get_mut(&pk).unwrap();
                    *e = (*e).max(v);
                }
            }
            let mut cands: Vec<(bool, u64, std::cmp::Reverse<u32>, ContentKey)> = res
                .iter()
                .filter(|(k, _)| !pinned.contains(*k))
                .map(|(k, p)| (p.parent.is_none() || live(&res, p.parent), eff[k], std::cmp::Reverse(p.depth), *k))
                .collect();
            cands.sort();
            for c in cands.into_iter().take(take - free) {
                res.remove(&c.3);
            }
        }
        // Saved pages, then links (each to the page before it, if that one is resident).
        for &d in &missing[..take] {
            tick += 1;
            born += 1;
            res.insert(k[d], Page { tick, depth: d as u32, parent: None, incarnation: born });
        }
        let saved: std::collections::HashSet<usize> = missing[..take].iter().copied().collect();
        for d in h..k.len() {
            if !saved.contains(&d) && !resident_here.contains(&d) {
                continue;
            }
            let Some(parent) = d.checked_sub(1).and_then(|pd| res.get(&k[pd]).map(|p| (k[pd], p.incarnation))) else {
                continue;
            };
            let cur = res[&k[d]].parent;
            if !live(&res, cur) {
                res.get_mut(&k[d]).unwrap().parent = Some(parent);
            }
        }
    }
    hits
}

/// With stderr piped, `simulate` writes progress lines there (`--progress-every 0`: at every
/// step), counting up to the whole run; stdout keeps only the report.
#[test]
fn a_piped_simulate_reports_progress_on_stderr() {
    let trace = support::data_file("mooncake_conversation_trace.jsonl.zst");
    let out = Command::new(support::kvtier_bin())
        .args(["simulate", trace.to_str().unwrap(), "--requests", "100", "--pool", "300slots"])
        .args(["--policies", "lru", "--chain", "off", "--no-optimum", "--json", "--progress-every", "0"])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "stderr: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("progress: ")).collect();
    assert!(!lines.is_empty(), "no progress line on a piped stderr: {err}");
    let last = lines.last().unwrap();
    let (done, len) = last["progress: ".len()..].split_once(' ').unwrap().0.split_once('/').unwrap();
    assert_eq!(done, len, "the last line counts the whole run: {last}");
    let _: serde_json::Value = serde_json::from_slice(&out.stdout).expect("stdout is the JSON report alone");
}

/// A `--plot` path that cannot be written fails before the run: no report, the path named.
#[test]
fn an_unwritable_plot_path_fails_before_the_run() {
    let trace = support::data_file("mooncake_conversation_trace.jsonl.zst");
    let dir = tempfile::tempdir().unwrap();
    let plot = dir.path().join("no-such-dir").join("plot.svg");
    let out = Command::new(support::kvtier_bin())
        .args(["simulate", trace.to_str().unwrap(), "--requests", "100", "--pool", "300slots"])
        .args(["--policies", "lru", "--chain", "off", "--no-optimum", "--plot", plot.to_str().unwrap()])
        .env_remove("RUST_LOG")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.contains("plot.svg"), "the error names the path: {err}");
    assert!(out.stdout.is_empty(), "nothing was simulated: {}", String::from_utf8_lossy(&out.stdout));
}

/// `kvtier simulate --ssd` on the shipped trace: the two-level runs in the JSON report (host share
/// equal to the host-only run's, bounded by the unbounded cache), the table's two-level section,
/// and a size too small for one disk slot refused before any run.
#[test]
fn cli_simulates_an_ssd_tier_under_the_pool() {
    let trace = support::data_file("mooncake_conversation_trace.jsonl.zst");
    let run = |extra: &[&str]| {
        Command::new(support::kvtier_bin())
            .args(["simulate", trace.to_str().unwrap(), "--requests", "300", "--pool", "300slots"])
            .args(["--policies", "lru", "--chain", "off", "--no-optimum", "--ssd", "600slots,2TiB"])
            .args(extra)
            .env_remove("RUST_LOG")
            .output()
            .unwrap()
    };
    let out = run(&["--json", "--ssd-admit", "1"]);
    assert!(out.status.success(), "stderr: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ssd_sizes"], serde_json::json!([["600slots", 600], ["2TiB", 636857]]));
    assert_eq!(v["ssd_admit"], serde_json::json!(["1"]));
    let host = v["runs"][0]["hit_pages"].as_u64().unwrap();
    let two = v["two_level"].as_array().unwrap();
    assert_eq!(two.len(), 2);
    let pages = v["pages"].as_u64().unwrap() as f64;
    let unbounded = v["unbounded_hit_ratio"].as_f64().unwrap();
    for (r, ssd) in two.iter().zip([600, 636857]) {
        assert_eq!(
            (r["policy"].as_str(), r["host_slots"].as_u64(), r["ssd_slots"].as_u64()),
            (Some("lru"), Some(300), Some(ssd))
        );
        // The host drops the blocks the drive holds first: its own share may change, the
        // drive's (larger than the pool) makes up for it.
        let both_pages = r["host_hit_pages"].as_u64().unwrap() + r["ssd_hit_pages"].as_u64().unwrap();
        assert!(both_pages >= host, "{both_pages} pages below the host pool alone's {host}");
        let both = both_pages as f64 / pages;
        assert!((r["hit_ratio"].as_f64().unwrap() - both).abs() < 1e-12);
        assert!(both <= unbounded + 1e-12, "{both} > unbounded {unbounded}");
        assert!(r["ssd_hit_pages"].as_u64().unwrap() > 0, "300 requests reuse pages beyond 300 slots");
    }
    let out = run(&[]);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("two-level page hit ratio"), "{table}");
    assert!(table.contains("+ SSD 2TiB (636857)"), "{table}");
    let out = run(&["--ssd", "3MB"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "stderr: {err}");
    assert!(err.contains("SSD size `3MB` is 0 disk slots of 3452928 B"), "{err}");
    let out = run(&["--ssd-admit", "1,often"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert!(err.contains("SSD admission `often` is neither `auto` nor a number of uses of at least 1"), "{err}");
}
