//! Unit tests of the tier that need its internals (slot words, claims, the save plan).

use super::evictor::Claims;
use super::*;
use crate::copy::host::HostArenas;
use crate::copy::{EngineArenas, WaitFor};
use crate::geometry::ArenaSpec;
use crate::index::SlotRef;
use crate::pool::BackingChoice;
use crate::slot::SlotWord;

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
