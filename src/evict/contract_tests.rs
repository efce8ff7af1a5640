//! The policy contract (parent module docs) checked for every built-in policy: proposals are
//! distinct, resident and evictable; and liveness: a selection proposes `min(n, k)` slots, `k` being
//! the resident slots it may take, whatever interleaving of insert, hit, select, cancel and remove
//! came before.

use super::{ChainView, EvictionPolicy, InsertInfo, PolicyKind, Ranking};
use crate::slab::slot::SlotId;
use std::collections::BTreeSet;

/// Selects up to `n` victims and evicts all of them (`on_remove`), as a tier whose claims all
/// succeed would.
pub(super) fn select_and_evict(p: &dyn EvictionPolicy, n: usize, evictable: &dyn Fn(SlotId) -> bool) -> Vec<SlotId> {
    let mut out = vec![];
    p.select_victims(n, evictable, &mut out);
    for &s in &out {
        p.on_remove(s);
    }
    out
}

/// The sequence from the reliability report: two selections before the first one's claims settle.
/// Before the contract had `on_cancel`, SIEVE then panicked inside the selection and S3-FIFO lost
/// blocks for good.
#[test]
fn two_selections_before_claims_settle_keep_every_policy_live() {
    for &kind in PolicyKind::ALL {
        let p = kind.build(4);
        for s in 0..4 {
            p.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s)));
        }
        let mut first = vec![];
        p.select_victims(2, &|_| true, &mut first);
        assert_eq!(first.len(), 2, "{kind}");
        let (a, b) = (first[0], first[1]);
        // `a` is claimed (EVICTING: no longer evictable); `b` turned out pinned: cancelled.
        p.on_cancel(b);
        let mut second = vec![];
        p.select_victims(1, &|s| s != a && s != b, &mut second);
        assert_eq!(second.len(), 1, "{kind}");
        let c = second[0];
        assert!(c != a && c != b, "{kind}");
        p.on_remove(a);
        p.on_remove(c);
        // The save reuses slot `a`.
        p.on_insert(a, InsertInfo::new(100, Some(0)));
        // Every resident block (b, a, and the fourth) is offered when enough are asked for.
        let mut all = vec![];
        p.select_victims(4, &|_| true, &mut all);
        let got: BTreeSet<u32> = all.iter().map(|s| s.0).collect();
        let want: BTreeSet<u32> = (0..4).filter(|&s| s != c.0).collect();
        assert_eq!(got, want, "{kind}: resident blocks offered");
    }
}

/// A pinned block at the head of every queue never hides the evictable ones.
#[test]
fn pinned_blocks_never_hide_evictable_ones() {
    for &kind in PolicyKind::ALL {
        let cap = 20;
        let p = kind.build(cap);
        for s in 0..cap {
            p.on_insert(SlotId(s), InsertInfo::new(s as u64, Some(s % 5)));
            for _ in 0..(s % 4) {
                p.on_hit(SlotId(s));
            }
        }
        // Oldest blocks (and every hit block) pinned.
        let pinned = |s: SlotId| s.0 < 12 || s.0 % 3 == 0;
        let mut out = vec![];
        p.select_victims(cap as usize, &|s| !pinned(s), &mut out);
        let got: BTreeSet<u32> = out.iter().map(|s| s.0).collect();
        let want: BTreeSet<u32> = (0..cap).filter(|&s| !pinned(SlotId(s))).collect();
        assert_eq!(got, want, "{kind}");
    }
}

/// Random interleavings of every contract call against a model of the tier's side; checks every
/// proposal and liveness after each step.
#[test]
fn random_interleavings_keep_the_contract_and_liveness() {
    #[derive(Copy, Clone, PartialEq, Eq, Debug)]
    enum St {
        Absent,
        Resident,
        Claimed,
    }
    for &kind in PolicyKind::ALL {
        for seed in 1..=20u64 {
            let cap = 1 + (seed as u32 * 7) % 24;
            let p = kind.build(cap);
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut rnd = move |m: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % m.max(1)
            };
            let mut st = vec![St::Absent; cap as usize];
            let mut pinned = vec![false; cap as usize];
            let mut key = 0u64;
            for step in 0..400 {
                let s = rnd(cap as u64) as usize;
                match rnd(8) {
                    0 | 1 if st[s] == St::Absent => {
                        key += 1;
                        p.on_insert(SlotId(s as u32), InsertInfo::new(key % 40, Some(rnd(30) as u32)));
                        st[s] = St::Resident;
                    }
                    2 => p.on_hit(SlotId(s as u32)),
                    3 => pinned[s] = !pinned[s],
                    4 | 5 => {
                        // A selection (plain, or ranked as the tier calls it: random classes and,
                        // half the time, a random forest of chains); each proposal is claimed, or
                        // cancelled (its claim CAS found a pin), as the tier does.
                        let ok: Vec<bool> = (0..cap as usize).map(|t| st[t] == St::Resident && !pinned[t]).collect();
                        let evictable = |t: SlotId| ok[t.index()];
                        let k = ok.iter().filter(|&&e| e).count();
                        let n = rnd(cap as u64 + 2) as usize;
                        let mut out = vec![];
                        let ranked = rnd(2) == 0;
                        let classes = 1 + rnd(4) as u8;
                        let class: Vec<u8> = (0..cap).map(|_| rnd(classes as u64) as u8).collect();
                        // The tier tells the policy of every class it lowers (`on_reclass`); here
                        // every class may change, so every slot is announced.
                        for t in 0..cap {
                            p.on_reclass(SlotId(t));
                        }
                        let forest = Forest::random(cap, &mut rnd);
                        let class_of = |t: SlotId| ok[t.index()].then_some(class[t.index()]);
                        let base_class = |t: SlotId| class[t.index()];
                        if ranked {
                            let chain = (rnd(2) == 0).then_some(&forest as &dyn ChainView);
                            p.select_ranked(
                                n,
                                &Ranking {
                                    classes,
                                    class_of: &class_of,
                                    base_class: Some(&base_class),
                                    empty: None,
                                    chain,
                                    beside_others: false,
                                },
                                &mut out,
                            );
                            let seq: Vec<u8> = out.iter().map(|v| class[v.index()]).collect();
                            assert!(seq.windows(2).all(|w| w[0] <= w[1]), "{kind}: classes out of order: {seq:?}");
                        } else {
                            p.select_victims(n, &evictable, &mut out);
                        }
                        assert_eq!(out.len(), n.min(k), "{kind} seed {seed} step {step}: liveness");
                        let distinct: BTreeSet<SlotId> = out.iter().copied().collect();
                        assert_eq!(distinct.len(), out.len(), "{kind}: a slot proposed twice");
                        for v in out {
                            assert!(evictable(v), "{kind}: proposed slot {} is not evictable", v.0);
                            if rnd(4) == 0 {
                                p.on_cancel(v);
                            } else {
                                st[v.index()] = St::Claimed;
                            }
                        }
                    }
                    6 => {
                        // Settle the outstanding claims: finish (evict) or give back.
                        for (t, state) in st.iter_mut().enumerate() {
                            if *state == St::Claimed {
                                if rnd(2) == 0 {
                                    p.on_remove(SlotId(t as u32));
                                    *state = St::Absent;
                                } else {
                                    p.on_cancel(SlotId(t as u32));
                                    *state = St::Resident;
                                }
                            }
                        }
                    }
                    _ => {}
                }
            }
            // Quiescent: every resident unpinned block is offered.
            for (t, state) in st.iter_mut().enumerate() {
                if *state == St::Claimed {
                    p.on_cancel(SlotId(t as u32));
                    *state = St::Resident;
                }
            }
            let want: BTreeSet<u32> =
                (0..cap).filter(|&t| st[t as usize] == St::Resident && !pinned[t as usize]).collect();
            let mut out = vec![];
            p.select_victims(cap as usize, &|t| st[t.index()] == St::Resident && !pinned[t.index()], &mut out);
            let got: BTreeSet<u32> = out.iter().map(|s| s.0).collect();
            assert_eq!(got, want, "{kind} seed {seed}: quiescent liveness");
        }
    }
}

/// Random parent links: slot `s` continues a lower slot or none; depth = parent's depth + 1.
struct Forest {
    parent: Vec<Option<u32>>,
    depth: Vec<u32>,
}

impl Forest {
    fn random(cap: u32, rnd: &mut impl FnMut(u64) -> u64) -> Self {
        let mut parent = vec![None; cap as usize];
        let mut depth = vec![0; cap as usize];
        for s in 1..cap as usize {
            if rnd(3) != 0 {
                let p = rnd(s as u64) as usize;
                parent[s] = Some(p as u32);
                depth[s] = depth[p] + 1;
            }
        }
        Forest { parent, depth }
    }
}

impl ChainView for Forest {
    fn parent(&self, slot: SlotId) -> Option<SlotId> {
        self.parent[slot.index()].map(SlotId)
    }
    fn depth(&self, slot: SlotId) -> u32 {
        self.depth[slot.index()]
    }
    fn resident_children(&self, slot: SlotId) -> Option<u32> {
        Some(self.parent.iter().filter(|&&p| p == Some(slot.0)).count() as u32)
    }
}

/// LRU with chains: a block ranks by the newest tick of its subtree, deeper first on ties, so a
/// chain goes from its tail and a chain used recently keeps its head however old the head's own
/// tick is; classes still come first.
#[test]
fn lru_with_chains_takes_chains_whole_from_the_tail() {
    let p = PolicyKind::Lru.build(6);
    // Chain 0 -> 1 -> 2 inserted first (oldest), then 3, then chain 4 -> 5; then block 2 is hit.
    for s in 0..6 {
        p.on_insert(SlotId(s), InsertInfo::default());
    }
    p.on_hit(SlotId(2));
    let forest = Forest { parent: vec![None, Some(0), Some(1), None, None, Some(4)], depth: vec![0, 1, 2, 0, 0, 1] };
    let class_of = |_: SlotId| Some(0);
    let mut out = vec![];
    p.select_ranked(
        6,
        &Ranking {
            classes: 1,
            class_of: &class_of,
            base_class: None,
            empty: None,
            chain: Some(&forest),
            beside_others: false,
        },
        &mut out,
    );
    // Subtree ticks: chain 0..2 = block 2's hit (newest), 3 = its own, chain 4..5 = block 5's.
    assert_eq!(out, [3, 5, 4, 2, 1, 0].map(SlotId).to_vec());
    for s in out {
        p.on_cancel(s);
    }
    // Without the chain view: plain LRU order (block 2 last: it was hit).
    let mut out = vec![];
    p.select_ranked(
        6,
        &Ranking { classes: 1, class_of: &class_of, base_class: None, empty: None, chain: None, beside_others: false },
        &mut out,
    );
    assert_eq!(out, [0, 1, 3, 4, 5, 2].map(SlotId).to_vec());
    for s in out {
        p.on_cancel(s);
    }
    // A class of its own for block 1 sends it first; block 0, whose only child it was, is then a
    // leaf with the oldest tick (its subtree's newer block 2 is past block 1: no query reaches it).
    let class_of = |s: SlotId| Some(u8::from(s != SlotId(1)));
    let mut out = vec![];
    p.select_ranked(
        2,
        &Ranking {
            classes: 2,
            class_of: &class_of,
            base_class: None,
            empty: None,
            chain: Some(&forest),
            beside_others: false,
        },
        &mut out,
    );
    assert_eq!(out, [1, 0].map(SlotId).to_vec());
}

#[test]
fn names_parse_and_unknown_names_list_the_known_ones() {
    for p in PolicyKind::ALL {
        assert_eq!(p.name().parse::<PolicyKind>(), Ok(*p));
    }
    let e = "fifo".parse::<PolicyKind>().unwrap_err();
    assert_eq!(
        e.to_string(),
        "unknown policy `fifo` (known: lru, clock, sieve, s3fifo, 2q, prefix-lfu, prefix-tinylfu, adaptive-lfu)"
    );
}

#[test]
fn a_contract_violation_names_the_call_and_the_slot() {
    for &kind in PolicyKind::ALL {
        let p = kind.build(2);
        p.on_insert(SlotId(1), InsertInfo::default());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.on_remove(SlotId(1))));
        let msg = r.expect_err("removing an unproposed slot must panic");
        let msg = msg.downcast_ref::<String>().cloned().unwrap_or_default();
        assert!(msg.contains("on_remove(slot 1) found it resident, expected proposed"), "{kind}: {msg}");
    }
}
