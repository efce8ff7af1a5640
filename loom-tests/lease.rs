//! loom models of leases over the real tier core: a query's pins hold off a concurrent eviction; a
//! lease settles exactly once however restores, releases and the last drop race; a shared lease
//! serves every rank that restores from it. Queries and restores go through the same functions as
//! `HostTier::query_shared` and `Rank::restore` (`internals::query`, `internals::restore_with`).
//!
//! Run with `ci/loom.sh` (cfgs `loom`, `crossbeam_loom`, `crossbeam_sanitize`, feature `loom`,
//! `LOOM_MAX_PREEMPTIONS=2`, release). Seeded bugs each model must catch (see docs/invariants.md):
//! `evict-pinned` (query_pin_holds_off_eviction), `lease-double-settle` (settle_exactly_once),
//! `lease-first-consume-settles` and `restore-use-before-pin` (shared_lease_serves_every_rank),
//! `use-returned-to-settled-lease` (a_failed_submission_keeps_the_use).
#![cfg(loom)]

mod common;

use common::*;
use kvtier::internals::sync::Arc;
use kvtier::internals::{query, restore_failing_submission, restore_with};
use loom::thread;

/// A query pins the ready block; an evictor racing it either evicts first (the query then finds
/// nothing) or finds it pinned and leaves it. While the lease is held the slot keeps its block.
#[test]
fn query_pin_holds_off_eviction() {
    loom::model(|| {
        let core = core(1);
        let k = key(0);
        save_ready(&core, k);
        let c = core.clone();
        let reader = thread::spawn(move || {
            let lease = query(&c, &[k], 1);
            if let Some(b) = lease.blocks().first() {
                assert_holds(&c, b.slot, "slot under a lease");
                thread::yield_now();
                assert_holds(&c, b.slot, "slot under a lease");
            }
            lease.len()
        });
        let evicted = evict_one(&core);
        let found = reader.join().unwrap();
        if evicted.is_some() {
            assert!(core.index().get(&k).is_none());
        } else {
            assert_eq!(found, 1, "eviction is refused only because the query held a pin");
        }
        assert_quiescent(&core, &[k]);
    });
}

/// A restore (its lease side), two releases (two holders of clones) and the drop of the last clone
/// race: the lease settles exactly once (at most one release reports settling it; the pin is
/// dropped exactly once) and the block is evictable afterwards.
#[test]
fn settle_exactly_once() {
    loom::model(|| {
        let core = core(1);
        let k = key(0);
        let r = save_ready(&core, k);
        let lease = query(&core, &[k], 1);
        assert_eq!(lease.len(), 1);
        let (l1, l2) = (lease.clone(), lease.clone());
        let consumer = thread::spawn(move || restore_with(&l1, 1, |_| ()).is_ok());
        let releaser = thread::spawn(move || l2.release());
        let released_main = lease.release();
        let consumed = consumer.join().unwrap();
        let released = releaser.join().unwrap();
        assert!(!(released && released_main), "two releases both settled the lease");
        // A restore fails only when a release settled first.
        assert!(consumed || released || released_main, "nobody settled, yet the restore failed");
        assert_eq!(word(&core, r.slot).pins(), 0, "the lease's pin is dropped exactly once");
        assert_eq!(evict_one(&core), Some(r.slot), "a settled lease no longer pins the block");
        assert_quiescent(&core, &[k]);
    });
}

/// A lease with one use per rank: two ranks restore from it (the restore's lease side, as
/// `Rank::restore` runs it: own pins, then a use, then submit) while an evictor runs. Both ranks get
/// the block; neither restore fails because the other settled the lease and the block was evicted.
#[test]
fn shared_lease_serves_every_rank() {
    loom::model(|| {
        let core = core(1);
        let k = key(0);
        save_ready(&core, k);
        let lease = query(&core, &[k], 2);
        assert_eq!((lease.len(), lease.uses_left()), (1, 2));
        let ranks: Vec<_> = (0..2)
            .map(|_| {
                let (c, l) = (core.clone(), lease.clone());
                thread::spawn(move || {
                    let r = l.blocks()[0].slot;
                    restore_with(&l, 1, |_| assert_holds(&c, r, "slot under a restore's pins"))
                        .unwrap_or_else(|e| panic!("each rank has a use, yet its restore failed: {e}"));
                })
            })
            .collect();
        drop(lease);
        let _ = evict_one(&Arc::clone(&core));
        for r in ranks {
            r.join().unwrap();
        }
        let _ = evict_one(&core);
        assert_quiescent(&core, &[k]);
    });
}

/// A lease with one use per rank; rank A's first restore fails at submission (its hold is dropped
/// unsubmitted: a page out of range, a backend error) and it retries, while rank B restores. In
/// every interleaving (B may take the last use and submit between A's hold and A's failure) A's
/// retry is served: a use is given back only to a lease that is not settled.
#[test]
fn a_failed_submission_keeps_the_use() {
    loom::model(|| {
        let core = core(1);
        let k = key(0);
        save_ready(&core, k);
        let lease = query(&core, &[k], 2);
        let l = lease.clone();
        let rank_b = thread::spawn(move || {
            restore_with(&l, 1, |_| ()).unwrap_or_else(|e| panic!("rank B has a use, yet its restore failed: {e}"))
        });
        restore_failing_submission(&lease, 1)
            .unwrap_or_else(|e| panic!("rank A has a use, yet its restore was refused before submission: {e}"));
        restore_with(&lease, 1, |_| ())
            .unwrap_or_else(|e| panic!("the retry of a restore whose submission failed was refused: {e}"));
        rank_b.join().unwrap();
        assert!(lease.is_settled(), "both uses were submitted: the lease is consumed");
        assert_eq!(word(&core, lease.blocks()[0].slot.slot).pins(), 0, "every pin dropped");
        drop(lease);
        assert_quiescent(&core, &[k]);
    });
}
