//! Eviction across cache groups while copies are in flight: a save's blocks are still being
//! written when the hybrid save records them, so the marks they get wait for their copies. Each
//! test holds the saves' copies open with a gate, then checks which window blocks end up cold
//! (`HybridTier::cold_blocks`) through the production path (`HybridRank::save`, `HybridTier::query`,
//! `HybridTier::settle_evictions`).

mod common;

use std::sync::Arc;

use common::{Gate, TestBackend};
use kvtier::{
    ArenaSpec, CacheGroup, ContentKey, Geometry, GroupKind, GroupPages, HybridConfig, HybridLayout, HybridRank,
    HybridTier, MemcpyArenas, PolicyKind, TierConfig, WaitFor,
};

const T: u32 = 16;

/// Full attention (32 blocks) beside a sliding window of `window` tokens (8 blocks), LRU, every
/// copy held until the gate opens (`held`), or never held.
struct Held2 {
    layout: HybridLayout,
    tier: HybridTier,
    rank: HybridRank,
    gate: Gate,
}

impl Held2 {
    fn new(window: u32, held: bool) -> Held2 {
        let geometry = |n: &str| Geometry::new("held", T, vec![ArenaSpec::packed(n, 16, 64)]).unwrap();
        let layout = HybridLayout::new(
            "held",
            vec![
                CacheGroup::new("full", GroupKind::Full, geometry("full")),
                CacheGroup::new("win", GroupKind::SlidingWindow { window_tokens: window }, geometry("win")),
            ],
        )
        .unwrap();
        let mut config = HybridConfig::new(layout.clone(), 1 << 20);
        for ((t, g), n) in config.tiers.iter_mut().zip(layout.groups()).zip([32u64, 8]) {
            *t = TierConfig::new(g.geometry.clone(), n * g.geometry.slot_bytes()).with_policy(PolicyKind::Lru);
        }
        let tier = HybridTier::new(config).unwrap();
        let gate = Gate::default();
        if !held {
            gate.open();
        }
        let backends = layout
            .groups()
            .iter()
            .map(|g| TestBackend::gated(&Arc::new(MemcpyArenas::new(&g.geometry).unwrap()), &gate))
            .collect();
        let rank = tier.attach(backends).unwrap();
        Held2 { layout, tier, rank, gate }
    }

    fn chain(&self, seed: u32, n: usize) -> Vec<ContentKey> {
        let mut keys: Vec<ContentKey> = Vec::new();
        for i in 0..n {
            keys.push(self.layout.namespace().chain(keys.last(), &[seed * 1000 + i as u32; T as usize]));
        }
        keys
    }

    /// Saves blocks `ranges[g]` of `keys` in each group; returns the copies, still held if the
    /// gate is closed.
    fn save(&self, keys: &[ContentKey], ranges: [std::ops::Range<usize>; 2]) -> kvtier::HybridSave {
        let pages: Vec<GroupPages> =
            ranges.iter().map(|r| GroupPages::new(r.start, (0..r.len() as u64).collect())).collect();
        self.rank.save(keys, &pages, WaitFor::Nothing).unwrap()
    }
}

#[test]
fn a_window_block_covered_by_a_query_before_its_copy_landed_is_not_marked_later() {
    // Window of 2 blocks. A prompt of 6 blocks saved whole: blocks 2 and 3 of its window group
    // lie behind its end's window, marked cold once their copies land.
    let alone = Held2::new(32, true);
    let a = alone.chain(1, 6);
    let s = alone.save(&a, [0..6, 2..6]);
    alone.gate.open();
    s.wait().unwrap();
    alone.tier.settle_evictions();
    assert_eq!(alone.tier.cold_blocks(1), 2, "blocks 2 and 3: behind the window, no live boundary");

    // The same, but a branch of the first 4 blocks queries at boundary 4 after the copies landed
    // and before the marks were applied: its window (blocks 2 and 3) is live.
    let branched = Held2::new(32, true);
    let a = branched.chain(1, 6);
    let s = branched.save(&a, [0..6, 2..6]);
    branched.gate.open();
    s.wait().unwrap();
    let mut branch = a[..4].to_vec();
    branch.extend(branched.chain(9, 2));
    assert_eq!(branched.tier.query(&branch).boundary(), 4);
    branched.tier.settle_evictions();
    assert_eq!(branched.tier.cold_blocks(1), 0, "a live boundary's window is never marked cold");
}

#[test]
fn a_continuation_saved_before_the_last_turn_landed_marks_only_what_its_window_left() {
    // Window of 4 blocks: turn 1 ends at boundary 4 (window 0..4), turn 2 at 5 (window 1..5),
    // both saved while the copies are held.
    let h = Held2::new(64, true);
    let a = h.chain(2, 5);
    let s1 = h.save(&a[..4], [0..4, 0..4]);
    let s2 = h.save(&a, [4..5, 4..5]);
    h.gate.open();
    s1.wait().unwrap();
    s2.wait().unwrap();
    h.tier.settle_evictions();
    assert_eq!(h.tier.cold_blocks(1), 1, "only block 0 lies behind boundary 5's window");
}

#[test]
fn a_prompt_saved_again_from_its_first_block_lets_its_old_end_go() {
    let h = Held2::new(32, false);
    let a = h.chain(3, 6);
    h.save(&a[..4], [0..4, 2..4]).wait().unwrap();
    // The engine passes the whole prompt again (the resident blocks are skipped).
    h.save(&a, [0..6, 4..6]).wait().unwrap();
    h.tier.settle_evictions();
    assert_eq!(h.tier.cold_blocks(1), 2, "blocks 2 and 3: boundary 4 is no longer live");
}

#[test]
fn an_attention_block_saved_again_before_its_eviction_was_read_marks_nothing() {
    let h = Held2::new(32, false);
    let a = h.chain(4, 4);
    h.save(&a, [0..4, 2..4]).wait().unwrap();
    assert_eq!(h.tier.group(0).evict(1), 1);
    assert_eq!(h.tier.usable_prefix(&a), 0);
    let gone = (0..4).find(|&i| !h.tier.group(0).contains(&h.layout.group_key(0, &a[i]))).unwrap();
    // Only the evicted block is saved again: the prefix is whole before the log is read.
    h.save(&a, [gone..gone + 1, 0..0]).wait().unwrap();
    assert_eq!(h.tier.usable_prefix(&a), 4);
    assert_eq!(h.tier.cold_blocks(1), 0, "the window of a whole prefix is not cold");
}
