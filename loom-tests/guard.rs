//! loom models of guards over the real tier core: a restore's own pins keep a slot while its copy is
//! in flight even though its lease settled meanwhile; a save's reserved slot is invisible to queries
//! until its copy committed.
//!
//! Run with `ci/loom.sh`. Seeded bugs each model must catch (see docs/invariants.md):
//! `guard-borrows-lease-pin` (lease_settled_during_copy_keeps_slot), `pin-writing`
//! (reserved_slot_invisible_until_commit).
#![cfg(loom)]

mod common;

use common::*;
use kvtier::internals::{query, restore_with};
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

/// A restore (its lease side, as `Rank::restore` runs it) takes its own pins and the lease's only
/// use, so the lease settles on submission while the "copy" still reads the slot; an evictor races
/// all of it. The slot keeps its block until the copy's pins drop.
///
/// The restore runs on the main thread and the evictor is spawned: loom's DPOR tracks only the last
/// access to an atomic, so the racing writes (pin, lease unpin, guard unpin) must come first in the
/// initial schedule for the evictor's later loads to be raced against each of them.
#[test]
fn lease_settled_during_copy_keeps_slot() {
    loom::model(|| {
        let core = core(1);
        let k = key(0);
        save_ready(&core, k);
        let lease = query(&core, &[k], 1);
        let in_flight = Arc::new(AtomicBool::new(false));
        let (c, f) = (core.clone(), in_flight.clone());
        let evictor = thread::spawn(move || {
            if evict_one(&c).is_some() {
                assert!(!f.load(Ordering::SeqCst), "evicted a slot under an in-flight copy");
            }
        });
        let r = lease.blocks()[0].slot;
        restore_with(&lease, 1, |_| {
            assert!(lease.is_settled(), "the lease's last use settles it on submission");
            in_flight.store(true, Ordering::SeqCst);
            assert_holds(&core, r, "slot under an in-flight copy");
            in_flight.store(false, Ordering::SeqCst);
        })
        .expect("the leased block is pinned");
        drop(lease);
        evictor.join().unwrap();
        assert_quiescent(&core, &[k]);
    });
}

/// A save reserves a slot (WRITING, indexed), writes the bytes, commits. A query racing it either
/// finds nothing or finds the block committed with all its bytes written.
#[test]
fn reserved_slot_invisible_until_commit() {
    loom::model(|| {
        let core = core(1);
        let k = key(0);
        // The block's bytes, as loom-tracked memory: a read not ordered after the write is reported.
        let bytes = Arc::new(UnsafeCell::new(0u64));
        let (c, b) = (core.clone(), bytes.clone());
        let save = thread::spawn(move || {
            let reservation = reserve(&c, k);
            // SAFETY: the slot is WRITING and owned by this save; readers must wait for the commit.
            b.with_mut(|p| unsafe { *p = 0x5eed });
            reservation.commit();
        });
        let lease = query(&core, &[k], 1);
        if !lease.is_empty() {
            // SAFETY: the lease pins a READY slot; its bytes are no longer written.
            let v = bytes.with(|p| unsafe { *p });
            assert_eq!(v, 0x5eed, "a query saw a block whose copy had not completed");
        }
        drop(lease);
        save.join().unwrap();
        assert_quiescent(&core, &[k]);
    });
}
