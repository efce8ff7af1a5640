//! loom models of eviction over the real tier core: eviction, pinning and lookups of one slot race
//! safely; a lookup made before the slot was evicted and reused fails to pin by generation.
//!
//! A third model races a save's plan against an eviction of its key that is finished without the
//! eviction lock; a fourth, two saves selecting at once under the lock's shared side, one of which
//! cannot fit.
//!
//! Run with `ci/loom.sh`. Seeded bugs each model must catch (see docs/invariants.md):
//! `evict-pinned` (evict_vs_pin_vs_lookup), `stale-generation` (stale_lookup_after_reuse_fails),
//! `plan-finishing-in-flight` (plan_racing_an_eviction_being_finished), `refusal-under-shared-hold`
//! and `escalation-keeps-claims` (a_save_beside_a_save_that_cannot_fit_is_not_refused).
#![cfg(loom)]

mod common;

use common::*;
use kvtier::internals::{query, SlotPins, SlotState};
use loom::thread;

/// One thread looks the key up and then queries it (lookup + pin) while the main thread evicts. A
/// lookup sees the block's entry or nothing; a pinned block is never evicted; at the end the slot is
/// exactly one of: still holding the block, or free with its generation bumped.
#[test]
fn evict_vs_pin_vs_lookup() {
    loom::model(|| {
        let core = core(1);
        let k = key(0);
        let r0 = save_ready(&core, k);
        let c = core.clone();
        let pinner = thread::spawn(move || {
            if let Some(r) = c.index().get(&k) {
                assert_eq!(r, r0, "the index never names another slot or generation for the key");
            }
            let lease = query(&c, &[k], 1);
            if let Some(b) = lease.blocks().first() {
                assert_eq!(b.slot, r0);
                assert_holds(&c, r0, "pinned slot");
            }
        });
        let evicted = evict_one(&core);
        pinner.join().unwrap();
        let w = word(&core, r0.slot);
        match evicted {
            Some(s) => {
                assert_eq!(s, r0.slot);
                assert_eq!((w.state(), w.generation()), (SlotState::Free, r0.generation + 1));
                assert!(core.index().get(&k).is_none());
            }
            None => assert_holds(&core, r0, "unevicted block"),
        }
        assert_quiescent(&core, &[k]);
    });
}

/// A reader looks key A up, then pins what it found; meanwhile A is evicted and its slot reused
/// for key B. The pin succeeds only if the slot still holds A (same generation).
#[test]
fn stale_lookup_after_reuse_fails() {
    loom::model(|| {
        let core = core(1);
        let (a, b) = (key(0), key(1));
        save_ready(&core, a);
        let c = core.clone();
        let reader = thread::spawn(move || {
            let Some(r) = c.index().get(&a) else { return };
            thread::yield_now();
            if let Ok(guard) = SlotPins::take(&c, [r]) {
                assert_eq!(c.index().get(&a), Some(r), "pinned slot {} no longer holds key A", r.slot.get());
                assert_holds(&c, r, "pinned slot");
                drop(guard);
            }
        });
        // Evict A (unless the reader pins it first) and reuse the slot for B.
        if evict_one(&core).is_some() {
            save_ready(&core, b);
        }
        reader.join().unwrap();
        assert_quiescent(&core, &[a, b]);
    });
}

/// A save plans a key while another thread evicts it. The eviction finishes its claims after it
/// lets go of the eviction lock (`Core::evict_into`, as a save's `acquire_slots` does), so the plan
/// may meet the block `EVICTING` even once it has held the lock itself: it must then wait for the
/// finish and find the key missing, never count it as in flight (no save holds it). If the plan
/// pins the block first, the eviction takes the other one and the key is resident. Seeded bug
/// `plan-finishing-in-flight` (the plan trusts the lock to have settled every claim).
#[test]
fn plan_racing_an_eviction_being_finished() {
    loom::model(|| {
        let core = core(2);
        let k = [key(0), key(1)];
        save_ready(&core, k[0]);
        save_ready(&core, k[1]);
        let c = core.clone();
        let evictor = thread::spawn(move || evict_one(&c));
        {
            let plan = core.plan_save(&k[..1], &kvtier::SaveOptions::new());
            let seen = (plan.missing().len(), plan.resident, plan.in_flight);
            assert!(
                seen == (1, 0, 0) || seen == (0, 1, 0),
                "key 0 planned as (missing, resident, in flight) = {seen:?}: it is missing or resident, never in flight"
            );
        }
        let evicted = evictor.join().unwrap();
        assert!(evicted.is_some(), "an unpinned block was always there to evict");
        assert_quiescent(&core, &k);
    });
}

/// Two saves select at once under the eviction lock (the shared side for LRU and the prefix-LFU
/// family, whose victim order is in shards, one slot in each here; the exclusive side for the
/// other policies): a two-slot save that cannot fit (the other block is pinned by a query) claims
/// the unpinned block before it finds it cannot, while a one-slot save looks for a victim. The
/// one-slot save must get the unpinned block in every interleaving, with every policy: it is never
/// refused under the shared side (where the other save's claim may yet be given back), and no
/// thread waits for the exclusive side while holding a claim it may give back.
#[test]
fn a_save_beside_a_save_that_cannot_fit_is_not_refused() {
    for &policy in kvtier::PolicyKind::ALL {
        a_save_beside_a_save_that_cannot_fit(policy);
    }
}

fn a_save_beside_a_save_that_cannot_fit(policy: kvtier::PolicyKind) {
    model_long(move || {
        let core = core_with(2, policy);
        let k = [key(0), key(1), key(2), key(3), key(4)];
        save_ready(&core, k[0]);
        save_ready(&core, k[1]);
        let lease = query(&core, &k[1..2], 1);
        assert_eq!(lease.len(), 1, "block 1 is pinned ({policy})");
        let c = core.clone();
        let wide = thread::spawn(move || c.acquire_slots(kvtier::internals::Want::Exactly(2)).map(|s| s.len()));
        let got = core.acquire_slots(kvtier::internals::Want::Exactly(1));
        let wide = wide.join().unwrap();
        assert!(wide.is_err(), "one block is pinned: two slots cannot be had, yet the save got {wide:?} ({policy})");
        let slots =
            got.expect("an unpinned block exists and the other save gives its claim back: the save must get a slot");
        assert_eq!(slots.len(), 1);
        for s in slots {
            core.pool().free(s);
        }
        drop(lease);
        assert!(core.index().get(&k[0]).is_none(), "the unpinned block was evicted for the save ({policy})");
        assert_quiescent(&core, &k[..2]);
    });
}
