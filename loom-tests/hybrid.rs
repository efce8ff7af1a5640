//! loom models of a hybrid tier (one tier per cache group, `HybridTier`) and of the cold marks
//! its eviction across groups sets: a query racing the eviction of a state checkpoint answers a
//! boundary whose every group's blocks it holds; a query racing a save's commit of a checkpoint
//! answers the longer boundary only once the checkpoint is ready, and pinned; a cold mark racing
//! its block's eviction is never left counted, and one racing an eviction of either of two blocks
//! is counted exactly when its block stayed.
//!
//! The query is `HybridTier::query` itself; saves and evictions go through each group's core with
//! the steps production runs (`acquire_slots`, `WriteReservation`, `evict_into`).
//!
//! Run with `ci/loom.sh` (see loom-tests/lease.rs). Seeded bugs each model must catch (see
//! docs/invariants.md): `hybrid-pin-unchecked` and `hybrid-lease-drops-state`
//! (query_racing_a_checkpoint_eviction), `cold-mark-unchecked` (cold_mark_racing_its_blocks_eviction).
//! query_racing_a_checkpoint_commit has none of its own: a block still being written is neither
//! looked up as ready nor pinned, so even a query that skipped its pin check (the first bug) would
//! not answer the longer boundary early; the model holds the property against later changes.
#![cfg(loom)]

mod common;

use common::*;
use kvtier::internals::sync::Arc;
use kvtier::internals::{core as core_of, ColdOutcome, Core};
use kvtier::{ArenaSpec, BackingChoice, CacheGroup, ContentKey, Geometry, GroupKind, HybridConfig, HybridLayout};
use kvtier::{HybridTier, PolicyKind, TierConfig};
use loom::thread;

/// One full-attention group and one state group, each pool of `slots` blocks, evicting by LRU.
fn hybrid(slots: u64) -> HybridTier {
    let geometry = |arena: &str| Geometry::new("loom", 16, vec![ArenaSpec::packed(arena, 16, 4)]).expect("geometry");
    let layout = HybridLayout::new(
        "loom",
        vec![
            CacheGroup::new("attn", GroupKind::Full, geometry("attn")),
            CacheGroup::new("ssm", GroupKind::State, geometry("ssm")),
        ],
    )
    .expect("layout");
    let mut config = HybridConfig::new(layout.clone(), 1 << 20);
    for (t, g) in config.tiers.iter_mut().zip(layout.groups()) {
        let mut c = TierConfig::new(g.geometry.clone(), slots * g.geometry.slot_bytes()).with_policy(PolicyKind::Lru);
        c.pool = c.pool.with_backing(BackingChoice::Plain);
        *t = c;
    }
    HybridTier::new(config).expect("hybrid tier")
}

/// Content keys of a two-block prompt in `tier`'s namespace.
fn prompt(tier: &HybridTier) -> Vec<ContentKey> {
    let ns = tier.layout().namespace();
    let k0 = ns.chain(None, &[1; 16]);
    let k1 = ns.chain(Some(&k0), &[2; 16]);
    vec![k0, k1]
}

/// A two-slot hybrid tier whose attention group holds both blocks of the prompt (ready), its
/// prompt's keys and its state group's core.
fn attention_saved() -> (Arc<HybridTier>, Vec<ContentKey>, Arc<Core>) {
    let tier = Arc::new(hybrid(2));
    let keys = prompt(&tier);
    let attn = core_of(tier.group(0)).clone();
    for k in &keys {
        save_ready(&attn, tier.layout().group_key(0, k));
    }
    let ssm = core_of(tier.group(1)).clone();
    (tier, keys, ssm)
}

/// Asserts every group's lease of `lease` holds the blocks of its range, ready.
fn assert_lease_holds(tier: &HybridTier, lease: &kvtier::HybridLease) {
    for g in 0..tier.layout().groups().len() {
        let l = lease.group(g);
        assert!(
            l.len() >= lease.range(g).len(),
            "group {g}'s lease holds {} blocks of its range {:?}",
            l.len(),
            lease.range(g)
        );
        let core = core_of(tier.group(g));
        for b in &l.blocks()[..lease.range(g).len()] {
            assert_holds(core, b.slot, "a hybrid lease's block");
        }
    }
}

/// A query races an eviction in the state group, which holds the checkpoints at boundaries 2
/// (its LRU victim) and 1: the answer is boundary 2 or 1, and whatever it is, every group's lease
/// holds that boundary's blocks for as long as it is held (the evictor, which runs while the
/// lease is held or before it was taken, cannot take them).
#[test]
fn query_racing_a_checkpoint_eviction() {
    // The eviction selects through chain-aware LRU's victim order (a load of the victim's
    // children count and of its parent's): past loom's default budget of 1,000 branches per
    // execution.
    let mut b = loom::model::Builder::new();
    b.max_branches = 10_000;
    b.check(|| {
        let (tier, keys, ssm) = attention_saved();
        let gk = |g: usize, i: usize| tier.layout().group_key(g, &keys[i]);
        save_ready(&ssm, gk(1, 1)); // the checkpoint at 2 (oldest: the LRU victim)
        save_ready(&ssm, gk(1, 0)); // the checkpoint at 1
        let (t, k) = (tier.clone(), keys.clone());
        let reader = thread::spawn(move || {
            let lease = t.query(&k);
            assert_lease_holds(&t, &lease);
            thread::yield_now();
            assert_lease_holds(&t, &lease);
            lease
        });
        let evicted = evict_one(&ssm);
        // The lease is still held here (the reader handed it back).
        let lease = reader.join().unwrap();
        let boundary = lease.boundary();
        assert!(evicted.is_some(), "the query pins one checkpoint at most: the other is evictable");
        assert_lease_holds(&tier, &lease);
        // The checkpoint left is the one of the boundary answered.
        let left: Vec<usize> = (1..=2).filter(|&b| ssm.index().get(&gk(1, b - 1)).is_some()).collect();
        assert_eq!(left, vec![boundary], "the answer's checkpoint stayed, the other was evicted");
        drop(lease);
    });
}

/// A query races the commit of the checkpoint at boundary 2 (its save reserved the slot before
/// the query began): the answer is 2 only once the checkpoint is ready, and then the lease pins
/// it; before, it is 1.
#[test]
fn query_racing_a_checkpoint_commit() {
    // Its commits' filings look at every shard of the victim order: longer than loom's default
    // budget of 1,000 branches per execution.
    let mut b = loom::model::Builder::new();
    b.max_branches = 10_000;
    b.check(|| {
        let (tier, keys, ssm) = attention_saved();
        let gk = |g: usize, i: usize| tier.layout().group_key(g, &keys[i]);
        save_ready(&ssm, gk(1, 0));
        let writing = reserve(&ssm, gk(1, 1));
        let (t, k) = (tier.clone(), keys.clone());
        let reader = thread::spawn(move || {
            let lease = t.query(&k);
            assert_lease_holds(&t, &lease);
            lease.boundary()
        });
        writing.commit();
        let boundary = reader.join().unwrap();
        assert!(boundary == 1 || boundary == 2, "boundary {boundary}");
        // Every pin is gone with the lease: both checkpoints can be evicted.
        let mut out = Vec::new();
        ssm.evict_into(2, &mut out);
        assert_eq!(out.len(), 2, "the lease's pins were all dropped");
    });
}

/// A cold mark races its block's eviction: afterwards the mark is counted only if its block is
/// still resident (a mark left counted would keep every selection looking for cold blocks).
#[test]
fn cold_mark_racing_its_blocks_eviction() {
    loom::model(|| {
        let core: Arc<Core> = cold_core();
        let k = key(0);
        save_ready(&core, k);
        let c = core.clone();
        let marker = thread::spawn(move || c.mark_cold(&k));
        let evicted = evict_one(&core).is_some();
        let outcome = marker.join().unwrap();
        let resident = core.index().get(&k).is_some();
        assert_eq!(resident, !evicted);
        assert_eq!(
            core.cold_blocks(),
            usize::from(resident && outcome == ColdOutcome::Marked),
            "a cold mark is counted only while its block is resident (marked: {outcome:?}, evicted: {evicted})"
        );
    });
}

/// A one-slot core with cold marks.
fn cold_core() -> Arc<Core> {
    let g = Geometry::new("loom", 16, vec![ArenaSpec::packed("a", 16, 4)]).expect("valid geometry");
    let cfg = kvtier::PoolConfig::new(g.slot_bytes()).with_backing(BackingChoice::Plain);
    let pool = kvtier::HostPool::new(g.slot_bytes(), &cfg).expect("pool");
    Arc::new(Core::new(g, pool, PolicyKind::Lru, Some(4), None).expect("core").with_cold_marks())
}

/// A cold mark races an eviction of one of two blocks: `j` (the LRU victim) or `k` once it is
/// cold. Both outcomes occur (`k` marked first and taken, or `j` taken and `k` left marked), and
/// afterwards the mark is counted exactly when `k` is resident and was marked.
#[test]
fn cold_mark_racing_an_eviction_of_either_block() {
    loom::model(|| {
        let g = Geometry::new("loom", 16, vec![ArenaSpec::packed("a", 16, 4)]).expect("valid geometry");
        let cfg = kvtier::PoolConfig::new(2 * g.slot_bytes()).with_backing(BackingChoice::Plain);
        let pool = kvtier::HostPool::new(g.slot_bytes(), &cfg).expect("pool");
        let core = Arc::new(Core::new(g, pool, PolicyKind::Lru, Some(4), None).expect("core").with_cold_marks());
        let (j, k) = (key(1), key(0));
        save_ready(&core, j);
        save_ready(&core, k);
        let c = core.clone();
        let marker = thread::spawn(move || c.mark_cold(&k));
        assert!(evict_one(&core).is_some(), "two unpinned blocks: one is evicted");
        let outcome = marker.join().unwrap();
        let k_resident = core.index().get(&k).is_some();
        assert_eq!(k_resident, core.index().get(&j).is_none(), "exactly one of the two blocks went");
        assert_eq!(
            core.cold_blocks(),
            usize::from(k_resident && outcome == ColdOutcome::Marked),
            "a cold mark is counted only while its block is resident (marked: {outcome:?}, k resident: {k_resident})"
        );
    });
}
