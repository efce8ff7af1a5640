//! Shared setup for the tier loom models (`lease`, `guard`, `evict`, `policy`): a real [`Core`]
//! (pool, index, eviction policy, slot words) over a one-arena geometry, with no ranks or threads of
//! its own, plus the steps the models use, each calling the functions production calls
//! (`acquire_slots`, `WriteReservation::reserve`, `evict_into`, the lease's restore claim).
//!
//! Everything here must run inside `loom::model` (the core's atomics are loom's).
#![allow(dead_code)]

use kvtier::internals::sync::Arc;
use kvtier::internals::{Core, SlotState, SlotWord, Want, WriteReservation};
use kvtier::{ArenaSpec, ContentKey, Geometry, PolicyKind, SlotId, SlotRef};
use kvtier::{BackingChoice, HostPool, PoolConfig};

/// `loom::model` with room for longer executions: 4,000 branches (atomic operations and thread
/// switches) on one path instead of loom's 1,000 (its `LOOM_MAX_BRANCHES` default), for models
/// whose set-up alone runs several saves through a policy with a long path (adaptive-LFU's
/// tuner, each commit's filing of its blocks). Other settings come from loom's environment
/// variables, as with `loom::model`.
pub fn model_long<F: Fn() + Sync + Send + 'static>(f: F) {
    let mut builder = loom::model::Builder::new();
    builder.max_branches = builder.max_branches.max(4_000);
    builder.check(f);
}

/// A core with `slots` host slots of 256 B (one 16 B arena, 4 pages), evicting by LRU.
pub fn core(slots: u32) -> Arc<Core> {
    core_with(slots, PolicyKind::Lru)
}

/// A core with `slots` host slots evicting by `policy`.
pub fn core_with(slots: u32, policy: PolicyKind) -> Arc<Core> {
    let g = Geometry::new("loom", 16, vec![ArenaSpec::packed("a", 16, 4)]).expect("valid geometry");
    let cfg = PoolConfig::new(slots as u64 * g.slot_bytes()).with_backing(BackingChoice::Plain);
    let pool = HostPool::new(g.slot_bytes(), &cfg).expect("pool");
    assert_eq!(pool.capacity(), slots);
    Arc::new(Core::new(g, pool, policy, Some(4), None).expect("core"))
}

/// A core with `slots` host slots evicting by `policy`, with chain-aware victim ranking.
pub fn chain_core_with(slots: u32, policy: PolicyKind) -> Arc<Core> {
    let g = Geometry::new("loom", 16, vec![ArenaSpec::packed("a", 16, 4)]).expect("valid geometry");
    let cfg = PoolConfig::new(slots as u64 * g.slot_bytes()).with_backing(BackingChoice::Plain);
    let pool = HostPool::new(g.slot_bytes(), &cfg).expect("pool");
    Arc::new(Core::new(g, pool, policy, Some(4), None).expect("core").with_chain_aware(true))
}

/// Key number `i` (distinct keys for distinct `i`).
pub fn key(i: u64) -> ContentKey {
    ContentKey::from_words(0x6b76_7469_6572_0000 + i, i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Reserves a slot for `key` (taking a free one or evicting) and returns the reservation.
pub fn reserve(core: &Arc<Core>, key: ContentKey) -> WriteReservation {
    let slots = core.acquire_slots(Want::Exactly(1)).expect("a slot");
    let mut r = WriteReservation::new(core);
    assert!(r.reserve(key, slots[0], u32::MAX), "no other save of {key:?}");
    r
}

/// Saves `key` and commits it: the block is ready. Returns its index entry.
pub fn save_ready(core: &Arc<Core>, key: ContentKey) -> SlotRef {
    reserve(core, key).commit();
    core.index().get(&key).expect("committed block is indexed")
}

/// Evicts at most one unpinned ready block and puts its slot back on the free list.
pub fn evict_one(core: &Arc<Core>) -> Option<SlotId> {
    let mut out = Vec::new();
    core.evict_into(1, &mut out);
    for &s in &out {
        core.pool().free(s);
    }
    out.first().copied()
}

/// The control word of `slot`.
pub fn word(core: &Core, slot: SlotId) -> SlotWord {
    core.control().load(slot)
}

/// Asserts `slot` holds the ready block `r` (state READY, same generation).
pub fn assert_holds(core: &Core, r: SlotRef, what: &str) {
    let w = word(core, r.slot);
    assert!(
        w.state() == SlotState::Ready && w.generation() == r.generation,
        "{what}: slot {} should hold generation {} READY, found {w:?}",
        r.slot.get(),
        r.generation
    );
}

/// After every thread joined: each slot is either free (and on the free list) or ready, unpinned and
/// indexed under exactly one of `keys`; no slot is owned twice.
pub fn assert_quiescent(core: &Core, keys: &[ContentKey]) {
    let cap = core.pool().capacity();
    let mut owner = vec![None; cap as usize];
    for k in keys {
        if let Some(r) = core.index().get(k) {
            assert_holds(core, r, "indexed block");
            assert_eq!(word(core, r.slot).pins(), 0, "pins left on slot {} at the end", r.slot.get());
            assert!(owner[r.slot.index()].replace(*k).is_none(), "slot {} owned twice", r.slot.get());
        }
    }
    let mut free = 0;
    for s in 0..cap {
        let w = word(core, SlotId::new(s));
        match w.state() {
            SlotState::Free => {
                assert_eq!(w.pins(), 0);
                free += 1
            }
            SlotState::Ready => assert!(owner[s as usize].is_some(), "ready slot {s} has no index entry"),
            st => panic!("slot {s} left {st:?}"),
        }
    }
    assert_eq!(core.pool().free_count(), free, "free list and FREE slots disagree");
}
