//! Unit tests of the tier that need its internals (slot words, claims, the save plan).

use super::evictor::Claims;
use super::*;
use crate::copy::host::HostArenas;
use crate::copy::{EngineArenas, WaitFor};
use crate::geometry::ArenaSpec;
use crate::index::SlotRef;
use crate::pool::BackingChoice;
use crate::slot::{SlotId, SlotWord};

fn small_tier(slots: u64, policy: crate::PolicyKind) -> (HostTier, std::sync::Arc<HostArenas>, Rank) {
    let g = Geometry::new("tier-unit", 16, vec![ArenaSpec::packed("a", 256, 16)]).unwrap();
    let cfg = TierConfig::new(g.clone(), slots * g.slot_bytes()).with_backing(BackingChoice::Plain).with_policy(policy);
    let tier = HostTier::new(cfg).unwrap();
    let arenas = std::sync::Arc::new(HostArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    (tier, arenas, rank)
}

fn keys(tier: &HostTier, ids: std::ops::Range<u64>) -> Vec<ContentKey> {
    ids.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

fn save_ready(tier: &HostTier, arenas: &std::sync::Arc<HostArenas>, rank: &Rank, k: &[ContentKey], pages: &[u64]) {
    arenas.fill(pages, k).unwrap();
    rank.save(k, pages, WaitFor::Nothing).unwrap().handle.wait().unwrap();
    assert!(k.iter().all(|k| tier.contains(k)));
}

#[test]
fn a_restore_at_the_pin_limit_reports_too_many_pins_and_keeps_the_lease() {
    let (tier, arenas, rank) = small_tier(2, crate::PolicyKind::Lru);
    let k = keys(&tier, 7..8);
    save_ready(&tier, &arenas, &rank, &k, &[0]);
    let lease = tier.query(&k);
    let r = lease.blocks()[0].slot;
    // The lease holds one pin; take the rest up to the limit.
    for _ in 1..SlotWord::MAX_PINS {
        tier.core().pin(r.slot, r.generation).unwrap();
    }
    let e = rank.restore(&lease, &[1], WaitFor::Nothing).unwrap_err();
    assert!(matches!(e, TierError::TooManyPins { slot } if slot == r.slot.0), "{e:?}");
    assert_eq!(lease.uses_left(), 1, "a refused restore leaves the lease usable");
    for _ in 1..SlotWord::MAX_PINS {
        tier.core().unpin(r.slot);
    }
    rank.restore(&lease, &[1], WaitFor::Nothing).unwrap().wait().unwrap();
    arenas.verify(&[1], &k).unwrap();
    assert_eq!(tier.stats().pinned_slots, 0);
}

/// Reliability report, item 8: a save that finds its key's slot EVICTING used to report the key
/// `in_flight` although nothing was saving it. The plan now waits for the eviction to settle.
#[test]
fn a_key_under_eviction_is_planned_after_the_eviction_settles() {
    for cancel in [false, true] {
        let (tier, arenas, rank) = small_tier(2, crate::PolicyKind::Lru);
        let k = keys(&tier, 0..2);
        save_ready(&tier, &arenas, &rank, &k, &[0, 1]);
        let core = tier.core().clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let evictor = {
            let core = core.clone();
            std::thread::spawn(move || {
                let _lock = core.lock_eviction();
                let mut claims = Claims::new(&core);
                assert_eq!(claims.claim(1), 1, "key 0 (least recent) is claimed");
                tx.send(()).unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
                if cancel {
                    drop(claims);
                } else {
                    let mut out = vec![];
                    claims.finish(&mut out);
                    for s in out {
                        core.pool().free(s);
                    }
                }
            })
        };
        rx.recv().unwrap();
        let plan = core.plan_save(&k[..1], &SaveOptions::new());
        evictor.join().unwrap();
        if cancel {
            assert_eq!((plan.missing().len(), plan.resident, plan.in_flight), (0, 1, 0), "cancelled: resident");
        } else {
            assert_eq!((plan.missing().len(), plan.resident, plan.in_flight), (1, 0, 0), "evicted: missing");
        }
    }
}

/// A plan holds a claim on each key it will save: a second plan of the same key sees it in flight
/// and takes no slot for it (two saves of one prefix never both evict for it).
#[test]
fn a_second_plan_of_a_claimed_key_sees_it_in_flight() {
    let (tier, _arenas, _rank) = small_tier(4, crate::PolicyKind::Lru);
    let k = keys(&tier, 0..3);
    let core = tier.core();
    let first = core.plan_save(&k, &SaveOptions::new());
    assert_eq!(first.missing(), &[0, 1, 2]);
    let second = core.plan_save(&k[1..], &SaveOptions::new());
    assert_eq!((second.missing().len(), second.in_flight), (0, 2));
    drop(first);
    let third = core.plan_save(&k[1..], &SaveOptions::new());
    assert_eq!(third.missing(), &[0, 1], "claims are released when the plan goes");
}

/// Reliability report, item 7: a slot freed while the evictor holds claims replaces a claim, so
/// nothing is evicted while a slot is free.
#[test]
fn a_slot_freed_during_claiming_replaces_a_claim() {
    let (tier, arenas, rank) = small_tier(3, crate::PolicyKind::Lru);
    let k = keys(&tier, 0..3);
    save_ready(&tier, &arenas, &rank, &k, &[0, 1, 2]);
    let core = tier.core();
    let _lock = core.lock_eviction();
    let mut claims = Claims::new(core);
    assert_eq!(claims.claim(1), 1);
    // Another thread evicts key 2 by hand meanwhile and frees its slot.
    let r = core.index().get(&k[2]).unwrap();
    let g = core.control().begin_evict(r.slot).unwrap();
    assert!(core.index().remove_if(&k[2], SlotRef { slot: r.slot, generation: g }));
    core.control().release(r.slot);
    core.pool().free(r.slot);
    // What acquire_slots does before finishing: swap claims for free slots.
    let s = core.pool().alloc().expect("the freed slot");
    assert!(claims.cancel_one());
    assert!(claims.is_empty());
    drop(claims);
    assert!(tier.contains(&k[0]), "the claimed block stays resident");
    core.pool().free(s);
}

fn save_chain(rank: &Rank, arenas: &std::sync::Arc<HostArenas>, k: &[ContentKey], pages: &[u64], opts: SaveOptions) {
    arenas.fill(pages, k).unwrap();
    rank.save_with(k, pages, WaitFor::Nothing, opts).unwrap().handle.wait().unwrap();
}

fn slot_of(tier: &HostTier, k: &ContentKey) -> SlotId {
    tier.core().index().get(k).expect("resident").slot
}

/// A chain save links each block to the one before it; the parent counts its children; a block
/// whose parent is evicted is an orphan, and a save of the prefix again re-attaches it.
#[test]
fn chain_links_count_children_detect_orphans_and_reattach() {
    use crate::tier::chain::ChainClass;
    let (tier, arenas, rank) = small_tier(8, crate::PolicyKind::Lru);
    let k = keys(&tier, 0..4);
    save_chain(&rank, &arenas, &k[..2], &[0, 1], SaveOptions::new().prefix_depth(0));
    save_chain(&rank, &arenas, &k[2..], &[2, 3], SaveOptions::new().prefix_depth(2).parent(k[1]));
    let core = tier.core();
    let s: Vec<SlotId> = k.iter().map(|k| slot_of(&tier, k)).collect();
    assert_eq!(core.chain_of(s[0]), (None, 1, ChainClass::Interior));
    assert_eq!(core.chain_of(s[1]), (Some(s[0]), 1, ChainClass::Interior));
    assert_eq!(core.chain_of(s[2]), (Some(s[1]), 1, ChainClass::Interior));
    assert_eq!(core.chain_of(s[3]), (Some(s[2]), 0, ChainClass::Leaf));
    // Without a depth or a parent the keys are not a chain: nothing is linked.
    let other = keys(&tier, 10..12);
    save_chain(&rank, &arenas, &other, &[4, 5], SaveOptions::new());
    assert_eq!(core.chain_of(slot_of(&tier, &other[1])), (None, 0, ChainClass::Leaf));
    // Chain-aware LRU ranks every block of chain 0..4 by the newest tick of its subtree (block 3's,
    // older than the unlinked pair's), deepest first: block 3 goes first.
    let mut out = Vec::new();
    assert_eq!(core.evict_into(1, &mut out), 1);
    assert_eq!(out, vec![s[3]]);
    for x in out {
        tier.pool().free(x);
    }
    assert_eq!(core.chain_of(s[2]), (Some(s[1]), 0, ChainClass::Leaf), "its child left: a leaf");
    // Evict the head alone (the rest pinned): blocks 1 and 2 become orphans.
    let pins = crate::guard::SlotPins::take(core, [1, 2].map(|i| core.index().get(&k[i]).unwrap())).unwrap();
    let other_pins = crate::guard::SlotPins::take(core, other.iter().map(|k| core.index().get(k).unwrap())).unwrap();
    let mut out = Vec::new();
    assert_eq!(core.evict_into(1, &mut out), 1);
    assert_eq!(out, vec![s[0]]);
    drop((pins, other_pins));
    for x in out {
        tier.pool().free(x);
    }
    assert_eq!(core.chain_of(s[1]).2, ChainClass::Orphan);
    assert_eq!(core.chain_of(s[2]).2, ChainClass::Leaf, "its parent (block 1) is still resident");
    // The next save of the whole prefix re-attaches the resident orphan to the new head.
    save_chain(&rank, &arenas, &k[..3], &[0, 1, 2], SaveOptions::new().prefix_depth(0));
    let h = slot_of(&tier, &k[0]);
    assert_eq!(core.chain_of(s[1]), (Some(h), 1, ChainClass::Interior));
    assert_eq!(core.chain_of(h), (None, 1, ChainClass::Interior));
}

/// Orphans go first whatever the policy's order: a block whose parent was evicted is worth nothing.
#[test]
fn orphans_are_evicted_first_with_every_policy() {
    for &policy in crate::PolicyKind::ALL {
        let (tier, arenas, rank) = small_tier(6, policy);
        let k = keys(&tier, 0..6);
        // Chain 0 -> 1 -> 2, then three unrelated blocks saved later (more recent).
        save_chain(&rank, &arenas, &k[..3], &[0, 1, 2], SaveOptions::new().prefix_depth(0));
        save_ready(&tier, &arenas, &rank, &k[3..], &[3, 4, 5]);
        let core = tier.core();
        // Evict the chain's head alone (the rest pinned).
        {
            let pins =
                crate::guard::SlotPins::take(core, [1, 2, 3, 4, 5].map(|i| core.index().get(&k[i]).unwrap())).unwrap();
            let mut out = Vec::new();
            assert_eq!(core.evict_into(1, &mut out), 1, "{policy}");
            drop(pins);
            for x in out {
                tier.pool().free(x);
            }
        }
        assert!(!tier.contains(&k[0]), "{policy}");
        // Blocks 1 and 2 are orphans: the next two victims, before any unrelated block.
        let mut out = Vec::new();
        assert_eq!(core.evict_into(2, &mut out), 2, "{policy}");
        for x in out {
            tier.pool().free(x);
        }
        assert!(!tier.contains(&k[1]) && !tier.contains(&k[2]), "{policy}: orphans evicted first");
        assert!(k[3..].iter().all(|k| tier.contains(k)), "{policy}");
    }
}

/// Hinted blocks are evicted only when no unhinted block is evictable; a withdrawn or expired hint
/// protects nothing; two hints on one key keep it until both end.
#[test]
fn hints_protect_until_withdrawn_or_expired_and_never_block_a_save() {
    for &policy in crate::PolicyKind::ALL {
        let (tier, arenas, rank) = small_tier(4, policy);
        let k = keys(&tier, 0..8);
        save_ready(&tier, &arenas, &rank, &k[..4], &[0, 1, 2, 3]);
        let long = std::time::Duration::from_secs(3600);
        let h1 = tier.hint(&k[..2], long);
        let h2 = tier.hint(&k[1..2], long);
        assert_eq!(tier.live_hints(), 2);
        // Two new blocks: the unhinted 2 and 3 go, whatever the policy's order.
        save_ready(&tier, &arenas, &rank, &k[4..6], &[4, 5]);
        assert!(tier.contains(&k[0]) && tier.contains(&k[1]), "{policy}: hinted blocks kept");
        assert!(!tier.contains(&k[2]) && !tier.contains(&k[3]), "{policy}");
        // Withdrawing h1 leaves key 1 hinted by h2; key 0 is fair game again.
        assert!(tier.withdraw_hint(h1));
        assert!(!tier.withdraw_hint(h1), "a hint is withdrawn once");
        let h3 = tier.hint(&k[4..6], long);
        save_ready(&tier, &arenas, &rank, &k[6..7], &[6]);
        assert!(!tier.contains(&k[0]) && tier.contains(&k[1]), "{policy}: key 0 unhinted, key 1 still hinted");
        // Only hinted blocks are left evictable (1, 4, 5 hinted; 6 is the newest unhinted): a save of
        // two blocks still gets its slots (liveness), taking 6 and then a hinted block.
        let t = rank.save(&k[2..4], &[2, 3], WaitFor::Nothing).unwrap();
        t.handle.wait().unwrap();
        assert_eq!(t.saving, vec![0, 1], "{policy}: a hint never makes a save fail");
        assert!(!tier.contains(&k[6]), "{policy}");
        assert!(tier.withdraw_hint(h2) && tier.withdraw_hint(h3));
        assert_eq!(tier.live_hints(), 0);
        // An expired hint protects nothing and is dropped by the next hint call.
        let h4 = tier.hint(&k[2..4], std::time::Duration::from_millis(1));
        std::thread::sleep(std::time::Duration::from_millis(5));
        let mut out = Vec::new();
        assert_eq!(tier.core().evict_into(4, &mut out), 4, "{policy}");
        for x in out {
            tier.pool().free(x);
        }
        assert!(!tier.withdraw_hint(h4), "expired");
    }
}

/// A key hinted before it is saved is protected from its save on.
#[test]
fn a_hint_on_a_missing_key_protects_it_once_saved() {
    let (tier, arenas, rank) = small_tier(2, crate::PolicyKind::Lru);
    let k = keys(&tier, 0..3);
    let _h = tier.hint(&k[..1], std::time::Duration::from_secs(3600));
    save_ready(&tier, &arenas, &rank, &k[..1], &[0]);
    save_ready(&tier, &arenas, &rank, &k[1..2], &[1]);
    // LRU would evict key 0 (older); it is hinted, so key 1 goes.
    save_ready(&tier, &arenas, &rank, &k[2..3], &[2]);
    assert!(tier.contains(&k[0]) && !tier.contains(&k[1]));
}
