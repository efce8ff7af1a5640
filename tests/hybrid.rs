//! Hybrid layouts through the public API: the usable-prefix rule (a boundary is a hit only when
//! every cache group holds what a restore there needs), pins across groups, bytes restored
//! through each group's arenas, and a reference model of the rule under random saves and
//! evictions.

mod common;

use std::sync::Arc;

use kvtier::{
    ArenaSpec, CacheGroup, ContentKey, EngineArenas, Geometry, GroupKind, GroupPages, HybridConfig, HybridLayout,
    HybridRank, HybridTier, MemcpyArenas, PolicyKind, TierConfig, WaitFor,
};
use proptest::prelude::*;

const T: u32 = 16; // tokens per block
const PAGES: u64 = 64; // GPU pages per arena

/// A toy hybrid: one full-attention group, one sliding-window group of `window` tokens, and (if
/// `state`) a recurrent-state group; each group's slot pool holds `slots` blocks.
struct Toy {
    layout: HybridLayout,
    tier: HybridTier,
    arenas: Vec<Arc<MemcpyArenas>>,
    rank: HybridRank,
}

impl Toy {
    fn new(window: u32, state: bool, slots: u64) -> Toy {
        Toy::with_pools(window, state, &[slots; 3], true)
    }

    /// A toy whose group `g` pool holds `slots[g]` blocks, with eviction across groups on or off.
    fn with_pools(window: u32, state: bool, slots: &[u64], group_eviction: bool) -> Toy {
        let mut groups = vec![
            CacheGroup::new(
                "global",
                GroupKind::Full,
                Geometry::new("toy", T, vec![ArenaSpec::packed("g", 1024, PAGES)]).unwrap(),
            ),
            CacheGroup::new(
                "local",
                GroupKind::SlidingWindow { window_tokens: window },
                Geometry::new(
                    "toy",
                    T,
                    vec![ArenaSpec::packed("l.0", 512, PAGES), ArenaSpec::packed("l.1", 512, PAGES)],
                )
                .unwrap(),
            ),
        ];
        if state {
            groups.push(CacheGroup::new(
                "ssm",
                GroupKind::State,
                Geometry::new("toy", T, vec![ArenaSpec::packed("ssm", 2048, PAGES)]).unwrap(),
            ));
        }
        let layout = HybridLayout::new("toy", groups).unwrap();
        let mut config = HybridConfig::new(layout.clone(), 1 << 30).with_group_eviction(group_eviction);
        for ((t, g), slots) in config.tiers.iter_mut().zip(layout.groups()).zip(slots) {
            *t = TierConfig::new(g.geometry.clone(), slots * g.geometry.slot_bytes()).with_policy(PolicyKind::Lru);
        }
        let tier = HybridTier::new(config).unwrap();
        let arenas: Vec<_> =
            layout.groups().iter().map(|g| Arc::new(MemcpyArenas::new(&g.geometry).unwrap())).collect();
        let rank = tier.attach(arenas.iter().map(|a| a.backend().unwrap()).collect()).unwrap();
        Toy { layout, tier, arenas, rank }
    }

    /// Content keys of a chain of `n` blocks whose tokens all derive from `seed`.
    fn chain(&self, seed: u32, n: usize) -> Vec<ContentKey> {
        let mut keys: Vec<ContentKey> = Vec::with_capacity(n);
        for i in 0..n {
            let tokens = [seed * 1000 + i as u32; T as usize];
            keys.push(self.layout.namespace().chain(keys.last(), &tokens));
        }
        keys
    }

    fn group_keys(&self, g: usize, keys: &[ContentKey], range: std::ops::Range<usize>) -> Vec<ContentKey> {
        keys[range].iter().map(|k| self.layout.group_key(g, k)).collect()
    }

    /// "Prefill" blocks `ranges[g]` of `keys` in each group (bytes derived from the group keys,
    /// GPU pages from 0) and save them.
    fn save(&self, keys: &[ContentKey], ranges: &[std::ops::Range<usize>]) {
        let pages: Vec<GroupPages> = ranges
            .iter()
            .enumerate()
            .map(|(g, r)| {
                let p: Vec<u64> = (0..r.len() as u64).collect();
                self.arenas[g].fill(&p, &self.group_keys(g, keys, r.clone())).unwrap();
                GroupPages::new(r.start, p)
            })
            .collect();
        self.rank.save(keys, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    }

    /// Queries `keys`, restores every group's leased blocks to GPU pages from 32 and checks their
    /// bytes; returns the boundary.
    fn restore_and_verify(&self, keys: &[ContentKey]) -> usize {
        let lease = self.tier.query(keys);
        let pages: Vec<Vec<u64>> =
            (0..self.arenas.len()).map(|g| (32..32 + lease.range(g).len() as u64).collect()).collect();
        self.rank.restore(&lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
        for (g, (arena, p)) in self.arenas.iter().zip(&pages).enumerate() {
            arena.verify(p, &self.group_keys(g, keys, lease.range(g))).unwrap();
        }
        lease.boundary()
    }
}

#[test]
fn a_state_checkpoint_evicted_while_its_attention_blocks_remain_stops_the_query_at_the_last_usable_boundary() {
    let toy = Toy::new(32, true, 8);
    let keys = toy.chain(1, 6);
    // Attention for all 6 blocks, the window before boundary 6, and checkpoints at 6, then 2 and 4
    // (saved in that order, so the LRU state pool holds the checkpoint at 6 as its oldest).
    toy.save(&keys, &[0..6, 4..6, 5..6]);
    toy.save(&keys, &[0..0, 0..2, 1..2]);
    toy.save(&keys, &[0..0, 2..4, 3..4]);
    assert_eq!(toy.tier.usable_prefix(&keys), 6);
    assert_eq!(toy.tier.group(2).evict(1), 1, "the checkpoint at 6 goes");
    assert!(toy.tier.group(0).contains(&toy.layout.group_key(0, &keys[5])), "its attention blocks remain");
    let lease = toy.tier.query(&keys);
    assert_eq!(lease.boundary(), 4, "the query stops at the last usable boundary");
    assert_eq!((lease.range(0), lease.range(1), lease.range(2)), (0..4, 2..4, 3..4));
    drop(lease);
    assert_eq!(toy.restore_and_verify(&keys), 4);
    assert_eq!(toy.tier.group(2).evict(2), 2); // the checkpoints at 2 and 4
    assert_eq!(toy.tier.query(&keys).boundary(), 0, "no checkpoint left: a miss, though attention holds 6 blocks");
}

#[test]
fn a_sliding_window_needs_only_the_blocks_of_its_window() {
    let toy = Toy::new(40, false, 16); // 40 tokens: 3 blocks at a block boundary (2.5 rounded out)
    let keys = toy.chain(2, 8);
    toy.save(&keys, &[0..8, 5..8]);
    let lease = toy.tier.query(&keys);
    assert_eq!(lease.boundary(), 8);
    assert_eq!(lease.range(1), 5..8, "tokens 88..128 lie in blocks 5, 6 and 7");
    drop(lease);
    // Boundary 7 needs blocks 4..7: block 4 was never saved, nor are 3 and 2 for boundaries 6, 5.
    assert_eq!(toy.tier.usable_prefix(&keys[..7]), 0);
    toy.save(&keys, &[0..0, 2..5]);
    assert_eq!(toy.tier.usable_prefix(&keys[..7]), 7);
    assert_eq!(toy.restore_and_verify(&keys[..6]), 6);
    // Boundaries 1 and 2 need the window group's blocks 0 and 1, never saved.
    assert_eq!(toy.tier.usable_prefix(&keys[..2]), 0);
    toy.save(&keys, &[0..0, 0..2]);
    assert_eq!(toy.tier.usable_prefix(&keys[..3]), 3, "boundary 3 needs blocks 0..3 of the window: tokens 8..48");
    assert_eq!(toy.tier.usable_prefix(&keys[..2]), 2);
}

#[test]
fn every_block_of_a_hybrid_lease_stays_while_it_is_held() {
    let toy = Toy::new(32, true, 8);
    let keys = toy.chain(3, 5);
    toy.save(&keys, &[0..5, 3..5, 4..5]);
    let lease = toy.tier.query(&keys);
    assert_eq!(lease.boundary(), 5);
    for g in 0..3 {
        assert_eq!(toy.tier.group(g).evict(usize::MAX), 0, "group {g}: every block is leased");
    }
    let pages: Vec<Vec<u64>> = (0..3).map(|g| (40..40 + lease.range(g).len() as u64).collect()).collect();
    toy.rank.restore(&lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    for (g, (arena, p)) in toy.arenas.iter().zip(&pages).enumerate() {
        arena.verify(p, &toy.group_keys(g, &keys, lease.range(g))).unwrap();
    }
    drop(lease);
    assert_eq!(toy.tier.group(0).evict(usize::MAX), 5, "the restore spent the lease's one use");
}

#[test]
fn a_save_whose_pages_run_past_the_keys_saves_nothing_in_any_group() {
    let toy = Toy::new(32, false, 8);
    let keys = toy.chain(4, 3);
    let err = toy
        .rank
        .save(&keys, &[GroupPages::new(0, vec![0, 1, 2]), GroupPages::new(2, vec![0, 1])], WaitFor::Nothing)
        .unwrap_err();
    assert!(matches!(err, kvtier::TierError::LengthMismatch { keys: 3, pages: 4 }), "{err}");
    assert_eq!(toy.tier.group(0).stats().saved_blocks, 0, "nothing saved in the group before the bad one");
    let err = toy.rank.save(&keys, &[GroupPages::none()], WaitFor::Nothing).unwrap_err();
    assert!(matches!(err, kvtier::TierError::GeometryMismatch { .. }), "{err}");
    let lease = toy.tier.query(&keys);
    let err = toy.rank.restore(&lease, &[vec![], vec![7]], WaitFor::Nothing).unwrap_err();
    assert!(matches!(err, kvtier::TierError::LeaseTooShort { asked: 1, held: 0 }), "{err}");
}

/// The rule, written from its statement: boundary `b` is usable when every group holds its
/// blocks for `b` (full: `0..b`; window: the blocks holding tokens `[b*T - w, b*T)`; state: block
/// `b - 1`), presence read from the group tiers.
fn reference_boundary(toy: &Toy, keys: &[ContentKey], window: u32, state: bool) -> usize {
    let has = |g: usize, i: usize| toy.tier.group(g).contains(&toy.layout.group_key(g, &keys[i]));
    (1..=keys.len())
        .rev()
        .find(|&b| {
            let full = (0..b).all(|i| has(0, i));
            let tokens_from = (b as u32 * T).saturating_sub(window);
            let local = (0..b).filter(|&i| (i as u32 + 1) * T > tokens_from).all(|i| has(1, i));
            let ckpt = !state || has(2, b - 1);
            full && local && ckpt
        })
        .unwrap_or(0)
}

#[derive(Clone, Debug)]
enum Op {
    /// Save blocks of chain `chain` (of `len` blocks): full `0..a`, window blocks `w0..w1`,
    /// checkpoint at block `c` (if any).
    Save {
        chain: u32,
        a: usize,
        w: (usize, usize),
        c: Option<usize>,
    },
    Evict {
        group: usize,
        n: usize,
    },
    Query {
        chain: u32,
        len: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..3u32, 0..=8usize, 0..=8usize, 0..=8usize, proptest::option::of(0..8usize))
            .prop_map(|(chain, a, x, y, c)| Op::Save { chain, a, w: (x.min(y), x.max(y)), c }),
        1 => (0..3usize, 0..4usize).prop_map(|(group, n)| Op::Evict { group, n }),
        3 => (0..3u32, 1..=8usize).prop_map(|(chain, len)| Op::Query { chain, len }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    /// Random saves (any subset of each group's blocks), evictions (small pools also evict on
    /// save) and queries: every query's boundary is the reference rule's, its leases cover the
    /// needed ranges, and the restored bytes are each group's blocks of that prefix.
    #[test]
    fn queries_answer_the_longest_usable_prefix_of_the_reference_rule(
        window in 1..=48u32,
        state in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..40),
    ) {
        let toy = Toy::new(window, state, 10);
        let chains: Vec<Vec<ContentKey>> = (0..3).map(|c| toy.chain(c, 8)).collect();
        for op in ops {
            match op {
                Op::Save { chain, a, w, c } => {
                    let mut ranges = vec![0..a, w.0..w.1];
                    if state {
                        ranges.push(c.map_or(0..0, |c| c..c + 1));
                    }
                    toy.save(&chains[chain as usize], &ranges);
                }
                Op::Evict { group, n } => {
                    if group < toy.arenas.len() {
                        toy.tier.group(group).evict(n);
                    }
                }
                Op::Query { chain, len } => {
                    let keys = &chains[chain as usize][..len];
                    let want = reference_boundary(&toy, keys, window, state);
                    prop_assert_eq!(toy.tier.usable_prefix(keys), want);
                    let got = toy.restore_and_verify(keys);
                    prop_assert_eq!(got, want, "window {} state {}", window, state);
                }
            }
        }
    }
}

#[test]
fn evictions_racing_queries_never_break_a_hybrid_restore() {
    // One thread saves four chains over and over (attention, the window before the end, and
    // checkpoints at 2, 4 and 6); one evicts checkpoints and window blocks; the main thread
    // queries, restores and checks every answer: each group's range is what its boundary needs,
    // and the bytes restored are each group's blocks of that prefix.
    let toy = Toy::new(32, true, 12);
    let chains: Vec<Vec<ContentKey>> = (0..4).map(|c| toy.chain(10 + c, 6)).collect();
    // The main thread decides when the race ends, after enough rounds and enough hits: a bound
    // on the saver alone let a loaded machine finish every save before the first query.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut i = 0;
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                let keys = &chains[i % 4];
                toy.save(keys, &[0..6, 4..6, 5..6]);
                toy.save(keys, &[0..0, 0..4, 1..2]);
                toy.save(keys, &[0..0, 0..0, 3..4]);
                i += 1;
            }
        });
        s.spawn(|| {
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                toy.tier.group(2).evict(1);
                toy.tier.group(1).evict(1);
                std::thread::yield_now();
            }
        });
        // Stops the saver and the evictor however this thread leaves.
        let _stop = common::StopOnDrop(&stop);
        let (mut rounds, mut hits) = (0, 0);
        // At least 200 rounds and 50 hits; at most 100,000 rounds (a scheduler that never runs the
        // saver fails the hit count below instead of hanging).
        while rounds < 100_000 && (rounds < 200 || hits < 50) {
            for keys in &chains {
                let lease = toy.tier.query(keys);
                let b = lease.boundary();
                for g in 0..3 {
                    assert_eq!(lease.range(g), toy.layout.needed(g, b), "group {g} at boundary {b}");
                }
                let pages: Vec<Vec<u64>> = (0..3).map(|g| (32..32 + lease.range(g).len() as u64).collect()).collect();
                toy.rank.restore(&lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
                for (g, (arena, p)) in toy.arenas.iter().zip(&pages).enumerate() {
                    arena.verify(p, &toy.group_keys(g, keys, lease.range(g))).unwrap();
                }
                hits += usize::from(b > 0);
            }
            rounds += 1;
        }
        assert!(hits >= 50, "some queries found a usable prefix ({hits} in {rounds} rounds)");
    });
}

#[test]
fn a_restore_refused_before_any_copy_keeps_every_group_s_use_and_a_retry_is_served() {
    let toy = Toy::new(32, false, 8);
    let keys = toy.chain(5, 4);
    toy.save(&keys, &[0..4, 2..4]);
    let lease = toy.tier.query(&keys);
    assert_eq!(lease.boundary(), 4);
    // Group 1's second page is outside its arenas: refused before group 0 is copied.
    let err = toy.rank.restore(&lease, &[vec![10, 11, 12, 13], vec![20, PAGES]], WaitFor::Nothing).unwrap_err();
    assert!(matches!(err, kvtier::TierError::Copy(kvtier::CopyError::PageOutOfRange { .. })), "{err}");
    assert_eq!(toy.tier.group(0).stats().restored_blocks, 0, "nothing restored in any group");
    assert_eq!(lease.group(0).uses_left(), 1, "group 0's lease keeps its use");
    let err = toy.rank.restore(&lease, &[vec![10, 11, 12, 13], vec![20, 20]], WaitFor::Nothing).unwrap_err();
    assert!(matches!(err, kvtier::TierError::Copy(kvtier::CopyError::DuplicateDestination { .. })), "{err}");
    let pages = [vec![10, 11, 12, 13], vec![20, 21]];
    toy.rank.restore(&lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    toy.arenas[0].verify(&pages[0], &toy.group_keys(0, &keys, 0..4)).unwrap();
    toy.arenas[1].verify(&pages[1], &toy.group_keys(1, &keys, 2..4)).unwrap();
}

#[test]
fn a_save_with_a_page_out_of_range_saves_nothing_in_any_group() {
    let toy = Toy::new(32, false, 8);
    let keys = toy.chain(6, 4);
    let pages = [GroupPages::new(0, vec![0, 1, 2, 3]), GroupPages::new(2, vec![0, PAGES + 3])];
    let err = toy.rank.save(&keys, &pages, WaitFor::Nothing).unwrap_err();
    assert!(matches!(err, kvtier::TierError::Copy(kvtier::CopyError::PageOutOfRange { page: 67, .. })), "{err}");
    assert_eq!(toy.tier.group(0).stats().saved_blocks, 0);
}

#[test]
fn a_lease_of_a_layout_with_other_groups_is_refused() {
    let (two, three) = (Toy::new(32, false, 8), Toy::new(32, true, 8));
    let keys = two.chain(7, 2);
    two.save(&keys, &[0..2, 0..2]);
    let lease = two.tier.query(&keys);
    let err = three.rank.restore(&lease, &[vec![], vec![], vec![]], WaitFor::Nothing).unwrap_err();
    assert!(matches!(err, kvtier::TierError::ForeignLease), "{err}");
}

#[test]
fn a_query_with_no_use_is_a_miss_and_a_miss_pins_nothing() {
    let toy = Toy::new(32, true, 8);
    let keys = toy.chain(8, 4);
    toy.save(&keys, &[0..4, 2..4, 1..2]); // a checkpoint at 2 only
    let none = toy.tier.query_shared(&keys, 0);
    assert!(none.is_empty(), "no use: nothing to restore with");
    drop(none);
    assert_eq!(toy.tier.query(&keys[..1]).boundary(), 0, "no checkpoint at 1, nor a window for it");
    let before = toy.tier.group(0).stats().queries;
    let miss = toy.tier.query(&keys[..1]);
    assert_eq!(toy.tier.group(0).stats().queries, before + 1, "a miss is one query of the attention group");
    assert_eq!(toy.tier.group(0).evict(usize::MAX), 4, "a miss holds no pin");
    drop(miss);
}

#[test]
fn two_full_attention_groups_answer_the_shorter_prefix_and_repeated_keys_end_it() {
    let geo = |name: &str| Geometry::new("toy", T, vec![ArenaSpec::packed(name, 256, PAGES)]).unwrap();
    let layout = HybridLayout::new(
        "toy",
        vec![CacheGroup::new("a", GroupKind::Full, geo("a")), CacheGroup::new("b", GroupKind::Full, geo("b"))],
    )
    .unwrap();
    let tier = HybridTier::new(HybridConfig::new(layout.clone(), 1 << 20)).unwrap();
    let arenas: Vec<_> = layout.groups().iter().map(|g| Arc::new(MemcpyArenas::new(&g.geometry).unwrap())).collect();
    let rank = tier.attach(arenas.iter().map(|a| a.backend().unwrap()).collect()).unwrap();
    let mut keys = vec![layout.namespace().chain(None, &[1; 16])];
    for i in 1..5u32 {
        let k = layout.namespace().chain(keys.last(), &[i; 16]);
        keys.push(k);
    }
    for (g, n) in [(0usize, 5usize), (1, 3)] {
        let gk: Vec<_> = keys[..n].iter().map(|k| layout.group_key(g, k)).collect();
        let p: Vec<u64> = (0..n as u64).collect();
        arenas[g].fill(&p, &gk).unwrap();
    }
    let pages = [GroupPages::new(0, (0..5).collect()), GroupPages::new(0, (0..3).collect())];
    rank.save(&keys, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    assert_eq!(tier.query(&keys).boundary(), 3, "the shorter group's prefix");
    assert_eq!(tier.usable_prefix(&keys), 3);
    let repeated = [keys[0], keys[1], keys[0], keys[2]];
    assert_eq!(tier.query(&repeated).boundary(), 2, "a repeated key ends the prefix");
    assert_eq!(tier.usable_prefix(&repeated), 2, "and the unpinned look agrees");
}

#[test]
fn pools_that_cannot_serve_a_group_are_refused_at_construction() {
    let toy = Toy::new(48, false, 8);
    let mut config = HybridConfig::new(toy.layout.clone(), 1 << 30);
    let local = toy.layout.groups()[1].geometry.clone();
    config.tiers[1] = TierConfig::new(local.clone(), 2 * local.slot_bytes());
    let err = HybridTier::new(config.clone()).unwrap_err();
    assert!(err.to_string().contains("its window needs 3 at once"), "{err}");
    config.tiers[1] = TierConfig::new(local.clone(), 3 * local.slot_bytes())
        .with_ssd(kvtier::SsdConfig::new(std::env::temp_dir().join("kvtier-hybrid-never-made"), 1 << 20));
    let err = HybridTier::new(config).unwrap_err();
    assert!(err.to_string().contains("has an SSD tier"), "{err}");
}

/// Touches group `g`'s blocks `range` of `keys` through the group's own tier (its LRU order only:
/// not a hybrid query, so no boundary becomes live).
fn touch(toy: &Toy, g: usize, keys: &[ContentKey], range: std::ops::Range<usize>) {
    let lease = toy.tier.group(g).query(&toy.group_keys(g, keys, range.clone()));
    assert_eq!(lease.len(), range.len(), "group {g}: blocks {range:?} are resident");
}

#[test]
fn a_checkpoint_whose_attention_prefix_was_evicted_goes_before_a_usable_one() {
    for group_eviction in [true, false] {
        // Attention and window pools hold 16 blocks, the state pool two checkpoints.
        let toy = Toy::with_pools(32, true, &[16, 16, 2], group_eviction);
        let (a, b, c) = (toy.chain(1, 4), toy.chain(2, 4), toy.chain(3, 4));
        toy.save(&a, &[0..4, 2..4, 3..4]);
        toy.save(&b, &[0..4, 2..4, 3..4]);
        // LRU orders differ by group: attention keeps B's blocks newer, state keeps A's
        // checkpoint newer (B's is the state pool's LRU victim).
        touch(&toy, 0, &b, 0..4);
        touch(&toy, 2, &a, 3..4);
        // The attention pool evicts one of A's blocks: A's checkpoint at 4 needs it.
        assert_eq!(toy.tier.group(0).evict(1), 1);
        assert_eq!(toy.tier.usable_prefix(&a), 0, "A's prefix is broken");
        assert_eq!(toy.tier.usable_prefix(&b), 4);
        // C's checkpoint needs a state slot.
        toy.save(&c, &[0..4, 2..4, 3..4]);
        assert_eq!(toy.tier.usable_prefix(&c), 4);
        let a_ckpt = toy.tier.group(2).contains(&toy.layout.group_key(2, &a[3]));
        if group_eviction {
            assert!(!a_ckpt, "the checkpoint no restore can use went first");
            assert_eq!(toy.tier.usable_prefix(&b), 4, "B's usable checkpoint stays");
            assert_eq!(toy.restore_and_verify(&b), 4);
        } else {
            // Each group by its own policy: the LRU victim was B's checkpoint.
            assert!(a_ckpt);
            assert_eq!(toy.tier.usable_prefix(&b), 0);
        }
    }
}

/// Windows of 2 blocks, a window pool of 4 blocks, and a conversation A of 6 blocks in two turns:
/// turn 1 ends at boundary 4 (window blocks 2, 3); turn 2 restores it and continues to 6.
fn two_turns() -> (Toy, Vec<ContentKey>) {
    let toy = Toy::with_pools(32, false, &[32, 4], true);
    let a = toy.chain(1, 6);
    toy.save(&a[..4], &[0..4, 2..4]);
    assert_eq!(toy.restore_and_verify(&a), 4);
    toy.save(&a, &[4..6, 4..6]);
    (toy, a)
}

#[test]
fn window_blocks_behind_every_live_boundary_go_first() {
    let (toy, a) = two_turns();
    // Blocks 2 and 3 are behind A's window now. Make them the window pool's newest blocks
    // (through the group's own tier): by LRU alone, A's live window (4, 5) would go next.
    touch(&toy, 1, &a, 2..4);
    let b = toy.chain(2, 2);
    toy.save(&b, &[0..2, 0..2]);
    assert_eq!(toy.tier.usable_prefix(&b), 2);
    assert_eq!(toy.tier.usable_prefix(&a), 6, "A's live window stays; the blocks behind it went");
    assert_eq!(toy.restore_and_verify(&a), 6);
}

#[test]
fn a_query_at_a_boundary_keeps_its_window_from_going_first() {
    let (toy, a) = two_turns();
    assert_eq!(toy.tier.cold_blocks(1), 2, "blocks 2 and 3 are behind A's window");
    // A branch of A's first 4 blocks: its query at boundary 4 reads blocks 2 and 3 again, so they
    // are a live boundary's window (no longer the first victims).
    let mut branch = a[..4].to_vec();
    branch.extend(toy.chain(9, 2));
    assert_eq!(toy.restore_and_verify(&branch), 4);
    assert_eq!(toy.tier.cold_blocks(1), 0, "the branch's query made its window live");
    // Now A's window (4, 5) is the window pool's oldest: LRU takes it, not the branch's.
    let b = toy.chain(2, 2);
    toy.save(&b, &[0..2, 0..2]);
    assert_eq!(toy.tier.usable_prefix(&branch), 4, "the branch's window stays");
    assert_eq!(toy.tier.usable_prefix(&a), 4, "A's blocks 4 and 5 of the window pool went by LRU");
}

#[test]
fn when_attention_loses_a_prompt_s_tail_the_window_before_the_new_end_is_kept() {
    // Windows of 2 blocks; the window pool holds 4 blocks.
    let toy = Toy::with_pools(32, false, &[16, 4], true);
    let a = toy.chain(1, 6);
    // The window group gets blocks 3, 4, 5: block 3 lies behind the end's window (4, 5).
    toy.save(&a, &[0..6, 3..6]);
    toy.tier.settle_evictions(); // its mark waited for the copy
    assert_eq!(toy.tier.cold_blocks(1), 1);
    // Attention evicts the prompt's tail: the usable prefix now ends at 5, whose window is 3, 4.
    assert_eq!(toy.tier.group(0).evict(1), 1);
    assert!(!toy.tier.group(0).contains(&toy.layout.group_key(0, &a[5])), "chain-aware LRU takes the tail");
    assert_eq!(toy.tier.usable_prefix(&a), 5);
    // Another prompt's window needs two slots: one is free, the other is a victim's.
    let b = toy.chain(2, 2);
    toy.save(&b, &[0..2, 0..2]);
    assert_eq!(toy.tier.usable_prefix(&b), 2);
    assert_eq!(toy.tier.usable_prefix(&a), 5, "the window before the new end stayed; block 5's went");
}
