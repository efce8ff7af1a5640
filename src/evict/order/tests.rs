use super::super::{ChainView, EvictionPolicy, InsertInfo, Lru, PrefixLfu, Ranking};
use crate::slab::slot::SlotId;

/// A xorshift stream for the random operations.
fn rng(seed: u64) -> impl FnMut(u64) -> u64 {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    move |m| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x % m.max(1)
    }
}

/// An LRU of `cap` slots, every one inserted (slot `s` at tick `s + 1`).
fn filled_lru(cap: u32) -> Lru {
    let p = Lru::new(cap);
    for s in 0..cap {
        p.on_insert(SlotId(s), InsertInfo::default());
    }
    p
}

/// The tier's preference order as these tests model it: a resident, unpinned slot has its
/// class (of 3); a pinned one is filed by its base class, the same. With `forest`, chains:
/// `forest[s]` is the block slot `s`'s block continues, counted as the tier's chain view
/// counts it (a parent while resident; children while resident, pinned ones included).
fn ranked_in<R>(
    resident: &[bool],
    pinned: &[bool],
    class: &[u8],
    forest: Option<&[Option<u32>]>,
    f: impl FnOnce(&Ranking<'_>) -> R,
) -> R {
    struct Chains<'a> {
        forest: &'a [Option<u32>],
        resident: &'a [bool],
    }
    impl ChainView for Chains<'_> {
        fn parent(&self, slot: SlotId) -> Option<SlotId> {
            self.forest[slot.index()].filter(|&p| self.resident[p as usize]).map(SlotId)
        }
        fn depth(&self, slot: SlotId) -> u32 {
            let mut d = 0;
            let mut s = slot.index();
            while let Some(p) = self.forest[s] {
                d += 1;
                s = p as usize;
            }
            d
        }
        fn resident_children(&self, slot: SlotId) -> Option<u32> {
            let n = (0..self.forest.len()).filter(|&t| self.resident[t] && self.forest[t] == Some(slot.0)).count();
            Some(n as u32)
        }
    }
    let chains = forest.map(|forest| Chains { forest, resident });
    let class_of = |t: SlotId| (resident[t.index()] && !pinned[t.index()]).then_some(class[t.index()]);
    let base_class = |t: SlotId| class[t.index()];
    let chain = chains.as_ref().map(|c| c as &dyn ChainView);
    f(&Ranking {
        classes: 3,
        class_of: &class_of,
        base_class: Some(&base_class),
        empty: None,
        chain,
        beside_others: false,
    })
}

/// Drives two instances of one policy through the same random inserts, hits, pins, class
/// changes (announced with `on_reclass` when a class falls, as the tier does), cancels and
/// evictions; one selects through its victim order, the other by a scan of every slot. Every
/// selection must propose the same slots in the same order.
fn same_as_scan<P: EvictionPolicy>(
    make: impl Fn() -> P,
    scan: impl Fn(&P, usize, &Ranking<'_>, &mut Vec<SlotId>),
    cap: u32,
    seed: u64,
) {
    same_as_scan_in(make, scan, cap, seed, false)
}

/// [`same_as_scan`], with `chains`: under a random forest of chains fixed for the run (the
/// tier's chain view as [`ranked_in`] models it).
fn same_as_scan_in<P: EvictionPolicy>(
    make: impl Fn() -> P,
    scan: impl Fn(&P, usize, &Ranking<'_>, &mut Vec<SlotId>),
    cap: u32,
    seed: u64,
    chains: bool,
) {
    let (order, reference) = (make(), make());
    let mut rnd = rng(seed);
    let forest: Vec<Option<u32>> =
        (0..cap as u64).map(|s| (chains && s > 0 && rnd(4) != 0).then(|| rnd(s) as u32)).collect();
    let forest = chains.then_some(&forest[..]);
    let mut resident = vec![false; cap as usize];
    let mut pinned = vec![false; cap as usize];
    let mut class = vec![0u8; cap as usize];
    let mut key = 0u64;
    for step in 0..4000 {
        let s = rnd(cap as u64) as usize;
        let slot = SlotId(s as u32);
        match rnd(10) {
            0 | 1 if !resident[s] => {
                key += 1;
                let info = InsertInfo::new(key % 23, Some(rnd(12) as u32));
                order.on_insert(slot, info);
                reference.on_insert(slot, info);
                resident[s] = true;
            }
            2..=4 => {
                order.on_hit(slot);
                reference.on_hit(slot);
            }
            5 => pinned[s] = !pinned[s],
            6 => {
                let c = rnd(3) as u8;
                if c < class[s] {
                    order.on_reclass(slot);
                }
                class[s] = c;
            }
            // A commit's filing of the marks so far (the tier's call after every save), with
            // the classes of this moment.
            7 if rnd(2) == 0 => ranked_in(&resident, &pinned, &class, forest, |r| order.file_pending(r)),
            _ => {
                let n = 1 + rnd(4) as usize;
                let (mut a, mut b) = (vec![], vec![]);
                ranked_in(&resident, &pinned, &class, forest, |r| {
                    order.select_ranked(n, r, &mut a);
                    scan(&reference, n, r, &mut b);
                });
                assert_eq!(a, b, "{} seed {seed} step {step}: the victim order and the scan differ", order.name());
                for v in a {
                    if rnd(3) == 0 {
                        order.on_cancel(v);
                        reference.on_cancel(v);
                    } else {
                        order.on_remove(v);
                        reference.on_remove(v);
                        resident[v.index()] = false;
                    }
                }
            }
        }
    }
}

#[test]
fn the_victim_order_proposes_what_a_scan_of_every_slot_would() {
    for seed in 1..=12 {
        same_as_scan(|| Lru::new(24), |p, n, r, out| p.select_by_scan(n, r, out), 24, seed);
        same_as_scan(|| PrefixLfu::new(8), |p, n, r, out| p.select_by_scan(n, r, out), 8, seed);
        same_as_scan(|| PrefixLfu::adaptive(16), |p, n, r, out| p.select_by_scan(n, r, out), 16, seed);
    }
}

/// Chain-aware LRU from its victim order (leaves by tick, then interior blocks, a proposal
/// exposing its parent) against its reference, a scan that proposes one block at a time.
#[test]
fn chain_aware_lru_selects_as_its_leaf_scan() {
    for seed in 1..=24 {
        same_as_scan_in(|| Lru::new(24), |p, n, r, out| p.select_by_leaf_scan(n, r, out), 24, seed, true);
    }
}

/// A commit's filing: the marks of the blocks inserted so far become heap entries at once, so
/// the next selection drains none (the first selection after a pool fills files nothing).
#[test]
fn a_commit_files_the_marks_so_far_and_the_selection_finds_none_left() {
    let cap = 64u32;
    let all = |_: SlotId| Some(0u8);
    let lru = Lru::new(cap);
    let lfu = PrefixLfu::adaptive(cap);
    for s in 0..cap {
        lru.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s % 8)));
        lfu.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s % 8)));
    }
    assert_eq!((lru.order.entries(), lfu.order.entries()), (0, 0), "inserts only mark");
    lru.file_pending(&Ranking::plain(&all));
    lfu.file_pending(&Ranking::plain(&all));
    assert_eq!((lru.order.entries(), lfu.order.entries()), (cap as usize, cap as usize), "every mark is filed");
    let mut left = 0;
    for sh in lru.order.shards.iter().chain(lfu.order.shards.iter()) {
        sh.marks.drain(|_| left += 1);
    }
    assert_eq!(left, 0, "no mark is left for the selection");
    // Nothing left for the selection to file; it proposes what it would have.
    let mut out = vec![];
    lru.select_ranked(2, &Ranking::plain(&all), &mut out);
    assert_eq!(out, vec![SlotId(0), SlotId(1)], "the least recently inserted");
}

/// Filings alone (no selection: a pool not yet full, with hints given and withdrawn on its
/// blocks) must not let retired entries grow without bound. Seeded bug `filing-skips-compaction`.
#[test]
fn filings_alone_do_not_let_retired_entries_pile_up() {
    let cap = 64u32;
    let p = filled_lru(cap);
    let all = |_: SlotId| Some(0u8);
    let bound = 2 * cap as usize + 1024 + cap as usize;
    for round in 0..400 {
        for s in 0..cap / 2 {
            p.on_reclass(SlotId(s));
        }
        p.file_pending(&Ranking::plain(&all));
        assert!(p.order.entries() <= bound, "round {round}: {} entries for {cap} slots", p.order.entries());
    }
}

/// A filing never waits for the order: while a selection (here, this thread) holds it, a
/// commit's filing returns at once and leaves the marks, which the next selection files.
/// Seeded bug `filing-blocks`.
#[test]
fn a_filing_never_waits_for_the_order_and_leaves_its_marks_to_the_holder() {
    let p = filled_lru(8);
    let held = p.order.hold_all();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let all = |_: SlotId| Some(0u8);
            p.file_pending(&Ranking::plain(&all));
            tx.send(()).unwrap();
        });
        let returned = rx.recv_timeout(std::time::Duration::from_secs(10));
        drop(held);
        returned.expect("the filing returned while the order was held");
    });
    assert_eq!(p.order.entries(), 0, "nothing filed while the order was held");
    let all = |_: SlotId| Some(0u8);
    let mut out = vec![];
    p.select_ranked(8, &Ranking::plain(&all), &mut out);
    assert_eq!(out.len(), 8, "the selection filed the marks the filing left");
}

#[test]
fn retired_entries_do_not_pile_up() {
    // Half the blocks are hit and re-placed before every selection: each re-placement retires
    // the slot's entry, which (its key above every victim's) no selection ever pops.
    let cap = 64u32;
    let p = filled_lru(cap);
    let all = |_: SlotId| Some(0u8);
    for round in 0..400 {
        for s in 0..cap / 2 {
            p.on_hit(SlotId(s));
            p.on_reclass(SlotId(s));
        }
        let mut out = vec![];
        p.select_ranked(1, &Ranking::plain(&all), &mut out);
        assert_eq!(out.len(), 1);
        p.on_cancel(out[0]);
        let bound = 2 * cap as usize + 1024 + cap as usize;
        assert!(p.order.entries() <= bound, "round {round}: {} entries for {cap} slots", p.order.entries());
    }
}

/// Selections running at once (beside others: the tier's shared eviction lock) search disjoint shards: none
/// proposes a slot another has proposed (the residency check panics on a second proposal),
/// each gets its victims while every shard has some, a cancelled proposal is offered again,
/// and a selection that then runs alone proposes every resident slot. Seeded bug
/// `lone-selection-takes-one-shard` (a lone selection searches its own shard only).
#[test]
fn selections_at_once_never_share_a_slot_and_a_lone_one_reaches_every_slot() {
    let cap = 4096u32;
    let all = |_: SlotId| Some(0u8);
    for p in [Box::new(filled_lru(cap)) as Box<dyn EvictionPolicy>, {
        let p = PrefixLfu::new(cap);
        for s in 0..cap {
            p.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s % 8)));
        }
        Box::new(p)
    }] {
        assert!(p.concurrent_selection(), "{}", p.name());
        std::thread::scope(|sc| {
            for t in 0..8u64 {
                let p = &p;
                sc.spawn(move || {
                    let mut next = rng(t + 1);
                    for round in 0..200 {
                        let mut out = vec![];
                        let beside = Ranking { beside_others: true, ..Ranking::plain(&all) };
                        p.select_ranked(16, &beside, &mut out);
                        assert_eq!(out.len(), 16, "{} thread {t} round {round}", p.name());
                        let mut seen = out.clone();
                        seen.sort();
                        seen.dedup();
                        assert_eq!(seen.len(), 16, "distinct proposals");
                        for s in out {
                            if next(2) == 0 {
                                p.on_cancel(s);
                            } else {
                                // Evicted, and a new block saved into the slot.
                                p.on_remove(s);
                                p.on_insert(s, InsertInfo::new(next(1 << 20), Some(0)));
                            }
                        }
                    }
                });
            }
        });
        let mut out = vec![];
        p.select_ranked(cap as usize, &Ranking::plain(&all), &mut out);
        assert_eq!(out.len(), cap as usize, "{}: a lone selection reaches every slot", p.name());
    }
}

/// A selection beside others (another selection counted as running) searches only its share
/// of the shards and proposes only slots of the classes it is offered: when its shards hold
/// none, it proposes nothing (the tier then selects again alone), even though other shards
/// hold offered slots; alone, the same ranking reaches them.
#[test]
fn a_selection_beside_others_searches_only_its_share_of_the_shards() {
    let cap = 64u32;
    let p = filled_lru(cap);
    let k = super::ORDER_SHARDS;
    let home = crate::sync::thread_number() % k;
    // Class 0 outside the shards this selection takes (its own and the next k/2 - 1), class 1
    // inside them; only class 0 is offered.
    let share = k / 2;
    let mine = |s: SlotId| (0..share).any(|i| (home + i) % k == s.index() % k);
    let class_of = |s: SlotId| if mine(s) { None } else { Some(0u8) };
    let base = |s: SlotId| if mine(s) { 1u8 } else { 0 };
    let r = Ranking {
        classes: 1,
        class_of: &class_of,
        base_class: Some(&base),
        empty: None,
        chain: None,
        beside_others: true,
    };
    p.order.selectors.store(1, std::sync::atomic::Ordering::Relaxed);
    let mut out = vec![];
    p.select_ranked(4, &r, &mut out);
    p.order.selectors.store(0, std::sync::atomic::Ordering::Relaxed);
    assert!(out.iter().all(|s| !mine(*s)), "beside others, a slot it is not offered was proposed: {out:?}");
    assert!(out.is_empty(), "its shards hold no slot it is offered: {out:?}");
    // Alone, the same ranking reaches the class-0 slots in the other shards.
    let alone = Ranking { beside_others: false, ..r };
    p.select_ranked(4, &alone, &mut out);
    assert_eq!(out.len(), 4);
    assert!(out.iter().all(|s| !mine(*s)));
}
