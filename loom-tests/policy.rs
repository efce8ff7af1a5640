//! loom model of the eviction mechanism and the policy contract, for **every** built-in policy: a
//! save's slot acquisition (select, claim, cancel on a pin, finish: `Core::acquire_slots`, what
//! `Rank::save_with` calls) races a query that pins a block (`testing::query`, what
//! `HostTier::query` calls). Checked in every interleaving: a pinned block is never evicted; the
//! save gets its slots whenever enough unpinned blocks exist; every proposal is settled with the
//! policy exactly once (the policies' contract checks panic otherwise); and afterwards every
//! resident, ready, unpinned block is still offered by the policy (liveness, invariant I8).
//!
//! Run with `ci/loom.sh`. Seeded bug this model must catch (see docs/invariants.md):
//! `requeue-claimed-victim` (a claimed victim is handed back to the policy as if cancelled).
#![cfg(loom)]

mod common;

use common::*;
use kvtier::testing::{query, Want};
use kvtier::PolicyKind;
use loom::thread;

/// Three ready blocks fill the pool; a save needs two slots while a query pins the oldest block.
fn acquire_races_a_query_pin(policy: PolicyKind) {
    loom::model(move || {
        let core = core_with(3, policy);
        let k: Vec<_> = (0..3).map(key).collect();
        for &key in &k {
            save_ready(&core, key);
        }
        let c = core.clone();
        let k0 = k[0];
        let reader = thread::spawn(move || {
            let lease = query(&c, &[k0], 1);
            if let Some(b) = lease.blocks().first() {
                assert_holds(&c, b.slot, "a block pinned by a query");
            }
            lease.len()
        });
        // The save's acquisition: two of the three blocks must go; the pinned one never.
        let got = core.acquire_slots(Want::Exactly(2));
        reader.join().unwrap();
        let slots = got.expect("two unpinned blocks always exist: the save must get its slots");
        assert_eq!(slots.len(), 2);
        for s in slots {
            core.pool().free(s);
        }
        // Liveness: the survivor (unpinned now) is offered and evicted when asked.
        assert_eq!(k.iter().filter(|key| core.index().get(key).is_some()).count(), 1, "one block survives");
        let mut out = Vec::new();
        assert_eq!(core.evict_into(3, &mut out), 1, "the surviving unpinned block is offered ({policy})");
        for s in out {
            core.pool().free(s);
        }
        assert_quiescent(&core, &k);
    });
}

#[test]
fn acquire_races_a_query_pin_lru() {
    acquire_races_a_query_pin(PolicyKind::Lru);
}

#[test]
fn acquire_races_a_query_pin_clock() {
    acquire_races_a_query_pin(PolicyKind::Clock);
}

#[test]
fn acquire_races_a_query_pin_sieve() {
    acquire_races_a_query_pin(PolicyKind::Sieve);
}

#[test]
fn acquire_races_a_query_pin_s3fifo() {
    acquire_races_a_query_pin(PolicyKind::S3Fifo);
}

#[test]
fn acquire_races_a_query_pin_prefix_lfu() {
    acquire_races_a_query_pin(PolicyKind::PrefixLfu);
}

#[test]
fn acquire_races_a_query_pin_prefix_tinylfu() {
    acquire_races_a_query_pin(PolicyKind::PrefixTinyLfu);
}

/// Every built-in policy has a model above (the list cannot silently fall behind `PolicyKind`).
#[test]
fn every_policy_is_modelled() {
    let source = include_str!("policy.rs");
    for p in PolicyKind::ALL {
        let name = format!("fn acquire_races_a_query_pin_{}()", p.name().replace('-', "_"));
        assert!(source.contains(&name), "no loom model for policy {p}");
    }
}
