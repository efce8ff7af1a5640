//! Property tests: the tier state machine against its reference model (`tests/machine/mod.rs`), the
//! slab pool (random alloc/free) and the geometry validator (random arena specs and bindings).
//!
//! Case counts come from `PROPTEST_CASES` (proptest's default, 256, when unset); CI runs 10,000
//! (`ci/proptest.sh`). Failing sequences shrink to a minimal one; keep each as a test in
//! `regressions` below.
#![cfg(not(loom))]

mod machine;

use kvtier::SlotId;
use kvtier::{ArenaBinding, ArenaSpec, BackingChoice, Geometry, HostPool, Placement, PolicyKind, PoolConfig};
use kvtier::{COPY_ALIGN, MAX_ARENAS, SLOT_CHUNK_ALIGN};
use machine::{Machine, Op, KEYS, MAX_CAPACITY, MAX_SPAN};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

fn op() -> impl Strategy<Value = Op> {
    let key = 0..KEYS;
    let span = 1..=MAX_SPAN;
    prop_oneof![
        4 => (any::<bool>(), key.clone(), span.clone(), any::<bool>(), prop::bool::weighted(0.15))
            .prop_map(|(gated, start, len, prefix, dup)| Op::Save { gated, start, len, prefix, dup }),
        2 => (any::<bool>(), prop::bool::weighted(0.8)).prop_map(|(save, ok)| Op::Complete { save, ok }),
        4 => (key, span, 0u8..=2).prop_map(|(start, len, uses)| Op::Query { start, len, uses }),
        3 => (0u8..4, 0..=MAX_SPAN, any::<bool>()).prop_map(|(lease, n, gated)| Op::Restore { lease, n, gated }),
        1 => (0u8..4).prop_map(|lease| Op::Release { lease }),
        2 => (0u8..4).prop_map(|lease| Op::Drop { lease }),
        1 => (0u8..4).prop_map(|n| Op::Evict { n }),
        1 => (1..=MAX_CAPACITY).prop_map(|capacity| Op::Resize { capacity }),
        2 => (0..KEYS, 1..=MAX_SPAN).prop_map(|(start, len)| Op::ChainSave { start, len }),
        2 => (0..KEYS, 1..=MAX_SPAN).prop_map(|(start, len)| Op::Hint { start, len }),
        1 => (0u8..4).prop_map(|hint| Op::Withdraw { hint }),
    ]
}

/// One property per eviction policy: random operation sequences on a small tier match the
/// reference model after every step (each policy gets the full case count).
macro_rules! machine_properties {
    ($($name:ident => $policy:expr,)*) => {
        proptest! {
            $(
                #[test]
                fn $name(capacity in 1..=MAX_CAPACITY, ops in prop::collection::vec(op(), 1..24)) {
                    Machine::run($policy, capacity, &ops);
                }
            )*
        }
        /// Every built-in policy has its property above.
        #[test]
        fn every_policy_has_a_state_machine_property() {
            let covered = [$($policy),*];
            for p in PolicyKind::ALL {
                assert!(covered.contains(p), "no state machine property for {p}");
            }
        }
    };
}

machine_properties! {
    tier_matches_reference_model_lru => PolicyKind::Lru,
    tier_matches_reference_model_clock => PolicyKind::Clock,
    tier_matches_reference_model_sieve => PolicyKind::Sieve,
    tier_matches_reference_model_s3fifo => PolicyKind::S3Fifo,
    tier_matches_reference_model_2q => PolicyKind::TwoQ,
    tier_matches_reference_model_prefix_lfu => PolicyKind::PrefixLfu,
    tier_matches_reference_model_prefix_tinylfu => PolicyKind::PrefixTinyLfu,
    tier_matches_reference_model_adaptive_lfu => PolicyKind::AdaptiveLfu,
}

proptest! {
    /// LRU with chain-aware victims (its victim order of leaves and interior blocks): every
    /// invariant but the exact victims, which chain saves reorder.
    #[test]
    fn tier_matches_reference_model_chain_aware_lru(capacity in 1..=MAX_CAPACITY, ops in prop::collection::vec(op(), 1..24)) {
        Machine::run_chain_aware(PolicyKind::Lru, capacity, true, &ops);
    }

    /// Queue-protecting admission ([`kvtier::TierConfig::protect_hinted`]): the same machine, whose
    /// model predicts that a prefix save takes free slots and unhinted victims only and never
    /// evicts a hinted block, while all-or-nothing saves still take hinted blocks last.
    #[test]
    fn tier_matches_reference_model_protecting_hinted_lru(capacity in 1..=MAX_CAPACITY, ops in prop::collection::vec(op(), 1..24)) {
        Machine::run_with(PolicyKind::Lru, capacity, true, &ops);
    }

    #[test]
    fn tier_matches_reference_model_protecting_hinted_adaptive_lfu(capacity in 1..=MAX_CAPACITY, ops in prop::collection::vec(op(), 1..24)) {
        Machine::run_with(PolicyKind::AdaptiveLfu, capacity, true, &ops);
    }
}

/// Sequences found by the property above (or written to pin a scenario); each must keep passing.
mod regressions {
    use super::*;

    /// Found by the property after main made zero-page restores a no-op (model was stale): a
    /// zero-page restore from a settled (zero-use) lease succeeds and changes nothing.
    #[test]
    fn zero_page_restore_of_a_settled_lease_is_a_no_op() {
        Machine::run(
            PolicyKind::Lru,
            1,
            &[Op::Query { start: 0, len: 1, uses: 0 }, Op::Restore { lease: 0, n: 0, gated: false }],
        );
    }

    #[test]
    fn lease_dropped_while_its_restore_is_in_flight() {
        Machine::run(
            PolicyKind::Lru,
            1,
            &[
                Op::Save { gated: false, start: 0, len: 1, prefix: false, dup: false },
                Op::Query { start: 0, len: 1, uses: 1 },
                Op::Restore { lease: 0, n: 1, gated: true },
                Op::Drop { lease: 0 },
                // The restore's guard still pins the block: a save of another key cannot evict it.
                Op::Save { gated: false, start: 1, len: 1, prefix: false, dup: false },
                Op::Evict { n: 1 },
                Op::Complete { save: false, ok: true },
                Op::Save { gated: false, start: 1, len: 1, prefix: false, dup: false },
            ],
        );
    }

    #[test]
    fn failed_save_frees_its_slots_and_stays_invisible() {
        Machine::run(
            PolicyKind::Lru,
            2,
            &[
                Op::Save { gated: true, start: 0, len: 2, prefix: false, dup: false },
                Op::Query { start: 0, len: 2, uses: 1 },
                Op::Save { gated: false, start: 0, len: 2, prefix: true, dup: false },
                Op::Complete { save: true, ok: false },
                Op::Save { gated: false, start: 2, len: 2, prefix: false, dup: false },
            ],
        );
    }

    #[test]
    fn shared_lease_serves_two_restores_then_settles() {
        Machine::run(
            PolicyKind::Lru,
            3,
            &[
                Op::Save { gated: false, start: 3, len: 3, prefix: false, dup: false },
                Op::Query { start: 3, len: 3, uses: 2 },
                Op::Restore { lease: 0, n: 3, gated: true },
                Op::Restore { lease: 0, n: 2, gated: false },
                Op::Restore { lease: 0, n: 1, gated: false },
                Op::Evict { n: 3 },
                Op::Complete { save: false, ok: false },
                Op::Evict { n: 3 },
            ],
        );
    }

    #[test]
    fn resize_down_keeps_the_most_recent_blocks() {
        Machine::run(
            PolicyKind::Lru,
            5,
            &[
                Op::Save { gated: false, start: 0, len: 4, prefix: false, dup: false },
                Op::Query { start: 0, len: 1, uses: 1 },
                Op::Save { gated: true, start: 4, len: 1, prefix: false, dup: false },
                Op::Resize { capacity: 2 },
                Op::Query { start: 0, len: 1, uses: 1 },
            ],
        );
    }

    /// Hinted blocks go last, for LRU exactly in LRU order after every unhinted block; a withdrawn
    /// hint protects nothing; a hint never makes a save fail.
    #[test]
    fn hinted_blocks_go_after_unhinted_ones() {
        for &p in PolicyKind::ALL {
            Machine::run(
                p,
                3,
                &[
                    Op::ChainSave { start: 0, len: 3 },
                    Op::Hint { start: 0, len: 2 },
                    Op::Save { gated: false, start: 5, len: 2, prefix: false, dup: false },
                    Op::Withdraw { hint: 0 },
                    Op::Hint { start: 5, len: 2 },
                    Op::Save { gated: false, start: 7, len: 3, prefix: false, dup: false },
                    Op::Evict { n: 2 },
                ],
            );
        }
    }

    #[test]
    fn prefix_save_under_pins_drops_the_tail() {
        Machine::run(
            PolicyKind::Lru,
            3,
            &[
                Op::Save { gated: false, start: 0, len: 3, prefix: false, dup: false },
                Op::Query { start: 0, len: 2, uses: 1 },
                Op::Save { gated: false, start: 5, len: 3, prefix: false, dup: false },
                Op::Save { gated: true, start: 5, len: 3, prefix: true, dup: false },
                Op::Complete { save: true, ok: true },
                Op::Release { lease: 0 },
                Op::Restore { lease: 0, n: 1, gated: false },
            ],
        );
    }
}

// ---------------------------------------------------------------------------------------------
// The slab pool.

#[derive(Clone, Debug)]
enum PoolOp {
    Alloc,
    Free(usize),
}

fn pool_op() -> impl Strategy<Value = PoolOp> {
    prop_oneof![3 => Just(PoolOp::Alloc), 2 => any::<usize>().prop_map(PoolOp::Free)]
}

/// Writes the slot's id into its first and last 8 bytes.
fn stamp(pool: &HostPool, s: SlotId) {
    let sb = pool.slot_bytes() as usize;
    let p = pool.slot_ptr(s);
    // SAFETY: the caller owns slot `s` (allocated, not freed); its `slot_bytes` bytes are inside the
    // mapping (checked against the region by the caller) and nothing else writes them.
    unsafe {
        p.cast::<u64>().write_unaligned(s.get() as u64);
        p.add(sb - 8).cast::<u64>().write_unaligned(!(s.get() as u64));
    }
}

fn stamped(pool: &HostPool, s: SlotId) -> bool {
    let sb = pool.slot_bytes() as usize;
    let p = pool.slot_ptr(s);
    // SAFETY: as in `stamp`; reads only.
    unsafe {
        p.cast::<u64>().read_unaligned() == s.get() as u64
            && p.add(sb - 8).cast::<u64>().read_unaligned() == !(s.get() as u64)
    }
}

proptest! {
    /// Random alloc/free on pools of random sizes: the capacity is floor(bytes / slot_bytes) and
    /// never past the mapping, no slot is handed to two owners, slots do not overlap (each owner's
    /// stamp survives the others' writes), and the full capacity is reachable.
    #[test]
    fn slab_alloc_free(
        slot_units in 1u64..=64,
        slots in 1u64..=48,
        extra in 0u64..4096,
        ops in prop::collection::vec(pool_op(), 0..96),
    ) {
        let slot_bytes = slot_units * SLOT_CHUNK_ALIGN;
        let bytes = slots * slot_bytes + extra.min(slot_bytes - 1);
        let cfg = PoolConfig::new(bytes).with_backing(BackingChoice::Plain);
        let pool = HostPool::new(slot_bytes, &cfg).expect("pool");
        prop_assert_eq!(pool.capacity() as u64, slots);
        prop_assert_eq!(pool.slot_bytes(), slot_bytes);
        let region = pool.region();
        prop_assert!(region.capacity as u64 * region.slot_bytes <= region.bytes, "capacity past the mapping");
        prop_assert_eq!(region.host_base, pool.slot_ptr(SlotId::new(0)) as usize);
        let last = pool.slot_ptr(SlotId::new(pool.capacity() - 1)) as usize;
        prop_assert!(last + slot_bytes as usize <= region.host_base + region.bytes as usize);
        let mut owned: Vec<SlotId> = Vec::new();
        let mut set = BTreeSet::new();
        for op in ops {
            match op {
                PoolOp::Alloc => match pool.alloc() {
                    Some(s) => {
                        prop_assert!(s.get() < pool.capacity(), "slot {} out of range", s.get());
                        prop_assert!(set.insert(s), "slot {} handed out twice", s.get());
                        stamp(&pool, s);
                        owned.push(s);
                    }
                    None => prop_assert_eq!(owned.len() as u64, slots, "alloc failed with slots free"),
                },
                PoolOp::Free(i) if !owned.is_empty() => {
                    let s = owned.swap_remove(i % owned.len());
                    prop_assert!(stamped(&pool, s), "slot {} was overwritten by another owner", s.get());
                    set.remove(&s);
                    pool.free(s);
                }
                PoolOp::Free(_) => {}
            }
            prop_assert_eq!(pool.free_count() as u64, slots - owned.len() as u64);
        }
        // Everything else is still reachable.
        while let Some(s) = pool.alloc() {
            prop_assert!(set.insert(s), "slot {} handed out twice", s.get());
            stamp(&pool, s);
            owned.push(s);
        }
        prop_assert_eq!(owned.len() as u64, slots, "full capacity reachable");
        for &s in &owned {
            prop_assert!(stamped(&pool, s), "slot {} overlaps another", s.get());
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The geometry validator.

#[derive(Clone, Debug)]
struct RawArena {
    name: u8,
    bytes_per_page: u64,
    page_stride: u64,
    pages: u64,
    fused: Option<(u32, u64)>,
}

fn dim() -> impl Strategy<Value = u64> {
    // Mostly small multiples of 16, sometimes misaligned, zero or huge.
    prop_oneof![
        6 => (1u64..=16).prop_map(|u| u * COPY_ALIGN),
        1 => 0u64..64,
        1 => Just(0u64),
        1 => (40u32..63).prop_map(|e| 1u64 << e),
        1 => any::<u64>(),
    ]
}

fn raw_arena() -> impl Strategy<Value = RawArena> {
    (
        0u8..6,
        dim(),
        prop_oneof![2 => Just(None), 1 => dim().prop_map(Some)],
        prop_oneof![4 => 1u64..8, 1 => Just(0u64), 1 => any::<u64>()],
        prop_oneof![3 => Just(None), 1 => (0u32..2, prop_oneof![(0u64..8).prop_map(|u| u * 16), any::<u64>()]).prop_map(Some)],
    )
        .prop_map(|(name, bytes_per_page, stride, pages, fused)| RawArena {
            name,
            bytes_per_page,
            page_stride: stride.unwrap_or(bytes_per_page),
            pages,
            fused,
        })
}

fn spec(a: &RawArena) -> ArenaSpec {
    ArenaSpec {
        name: if a.name == 0 { String::new() } else { format!("a{}", a.name) },
        bytes_per_page: a.bytes_per_page,
        page_stride: a.page_stride,
        pages: a.pages,
        placement: match a.fused {
            None => Placement::Own,
            Some((buffer, offset)) => Placement::Fused { buffer, offset },
        },
    }
}

/// The documented validity rules of `Geometry::new`, written independently.
fn valid(model: &str, page_tokens: u32, arenas: &[RawArena]) -> bool {
    if model.is_empty() || page_tokens == 0 || arenas.is_empty() || arenas.len() > MAX_ARENAS {
        return false;
    }
    let mut names = BTreeSet::new();
    for a in arenas {
        if a.name == 0 || !names.insert(a.name) {
            return false;
        }
        if a.bytes_per_page == 0 || a.page_stride == 0 || a.pages == 0 {
            return false;
        }
        if a.bytes_per_page % COPY_ALIGN != 0 || a.page_stride % COPY_ALIGN != 0 || a.page_stride < a.bytes_per_page {
            return false;
        }
        let offset = a.fused.map_or(0, |(_, o)| o);
        let end = (a.pages as u128 - 1) * a.page_stride as u128 + a.bytes_per_page as u128 + offset as u128;
        if end > 1u128 << 62 {
            return false;
        }
        if a.fused.is_some()
            && (offset % COPY_ALIGN != 0 || offset as u128 + a.bytes_per_page as u128 > a.page_stride as u128)
        {
            return false;
        }
    }
    for (i, a) in arenas.iter().enumerate() {
        for b in &arenas[i + 1..] {
            if let (Some((ba, oa)), Some((bb, ob))) = (a.fused, b.fused) {
                if ba == bb
                    && (a.page_stride != b.page_stride
                        || a.pages != b.pages
                        || !(oa + a.bytes_per_page <= ob || ob + b.bytes_per_page <= oa))
                {
                    return false;
                }
            }
        }
    }
    true
}

proptest! {
    /// Random arena specs are accepted iff they satisfy the documented rules; an accepted geometry's
    /// slot layout is monotone, aligned, holds every chunk, and its page count is the minimum.
    #[test]
    fn geometry_accepts_exactly_the_valid_specs(
        model in prop_oneof![Just(String::new()), "[a-z]{1,4}"],
        page_tokens in prop_oneof![Just(0u32), 1u32..128],
        raw in prop::collection::vec(raw_arena(), 0..6),
    ) {
        let specs: Vec<ArenaSpec> = raw.iter().map(spec).collect();
        let got = Geometry::new(&model, page_tokens, specs.clone());
        let want = valid(&model, page_tokens, &raw);
        prop_assert_eq!(got.is_ok(), want, "Geometry::new gave {:?}", got);
        if let Ok(g) = got {
            let offs = g.chunk_offsets();
            prop_assert_eq!(offs.len(), specs.len());
            prop_assert_eq!(offs[0], 0);
            let mut end = 0;
            for (a, &o) in specs.iter().zip(offs) {
                prop_assert_eq!(o % SLOT_CHUNK_ALIGN, 0, "chunk offset {} unaligned", o);
                prop_assert!(o >= end, "chunks overlap in the slot");
                end = o + a.bytes_per_page;
            }
            prop_assert_eq!(g.slot_bytes(), end.div_ceil(SLOT_CHUNK_ALIGN) * SLOT_CHUNK_ALIGN);
            prop_assert_eq!(g.block_bytes(), specs.iter().map(|a| a.bytes_per_page).sum::<u64>());
            prop_assert!(g.slot_bytes() >= g.block_bytes());
            prop_assert_eq!(g.pages(), specs.iter().map(|a| a.pages).min().unwrap());
        }
    }

    /// Random base addresses: an accepted binding never lets two arenas share a byte (checked by
    /// brute force over every page's chunk), and arenas with disjoint extents at aligned non-null
    /// bases are always accepted.
    #[test]
    fn binding_accepts_no_overlap(
        arenas in prop::collection::vec((1u64..=4, 0u64..=4, 1u64..=4), 1..4),
        bases in prop::collection::vec(prop_oneof![4 => (1u64..64).prop_map(|u| u * 16), 1 => 0u64..1024, 1 => Just(u64::MAX - 15)], 3),
    ) {
        let specs: Vec<ArenaSpec> = arenas
            .iter()
            .enumerate()
            .map(|(i, &(unit, gap, pages))| ArenaSpec {
                name: format!("a{i}"),
                bytes_per_page: unit * 16,
                page_stride: (unit + gap) * 16,
                pages,
                placement: Placement::Own,
            })
            .collect();
        let g = Geometry::new("m", 16, specs.clone()).expect("valid specs");
        let bases = bases[..specs.len()].to_vec();
        let got = ArenaBinding::new(&g, bases.clone());
        let well_formed = bases.iter().zip(&specs).all(|(&b, a)| b != 0 && b % 16 == 0 && b.checked_add(a.extent()).is_some());
        if !well_formed {
            prop_assert!(got.is_err(), "null, misaligned or overflowing base accepted");
            return Ok(());
        }
        // Brute force: which byte belongs to which arena.
        let mut owner: BTreeMap<u64, usize> = BTreeMap::new();
        let mut overlap = false;
        for (i, (a, &b)) in specs.iter().zip(&bases).enumerate() {
            for p in 0..a.pages {
                for x in 0..a.bytes_per_page {
                    if owner.insert(b + p * a.page_stride + x, i).is_some_and(|o| o != i) {
                        overlap = true;
                    }
                }
            }
        }
        if got.is_ok() {
            prop_assert!(!overlap, "binding accepted arenas that share a byte: {:?}", bases);
        }
        let extents_disjoint = (0..specs.len()).all(|i| {
            (i + 1..specs.len()).all(|j| {
                let (si, ei) = (bases[i], bases[i] + specs[i].extent());
                let (sj, ej) = (bases[j], bases[j] + specs[j].extent());
                ei <= sj || ej <= si
            })
        });
        if extents_disjoint {
            prop_assert!(got.is_ok(), "disjoint arenas rejected: {:?}", got);
        }
    }
}
