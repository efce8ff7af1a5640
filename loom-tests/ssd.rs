//! loom models of the SSD tier's transitions over the real tier core and the real disk slots: a
//! demotion's pin keeps its host block from eviction and reuse while the demotion reads it; a
//! promoted block is published already pinned for its lease, so no evictor can take it first; a
//! disk slot pinned for a promotion's read is never evicted and rewritten under it.
//!
//! Run with `ci/loom.sh`. Seeded bugs each model must catch (see docs/invariants.md):
//! `demotion-unpinned` (demotion_pin_holds_off_eviction), `promotion-commit-unpinned`
//! (promoted_block_is_pinned_from_its_commit), `evict-pinned` (pinned_disk_slot_is_never_rewritten).
#![cfg(loom)]

mod common;

use common::*;
use kvtier::internals::ssd::{pin_for_demotion, reserve_promotion, DiskSlots, Job};
use kvtier::internals::SlotState;
use loom::sync::Arc;
use loom::thread;

/// A demotion (its host side, as the demotion thread runs it) pins the block its job names and
/// reads it; an evictor that wants the only slot, and a save that would reuse it, race it. While
/// the demotion holds its pin the slot keeps the block (its recorded key stands for its bytes).
#[test]
fn demotion_pin_holds_off_eviction() {
    loom::model(|| {
        let core = core(1);
        let r = save_ready(&core, key(0));
        let job = Job::new(r.slot, r.generation, key(0));
        let c = core.clone();
        let evictor = thread::spawn(move || {
            if evict_one(&c).is_some() {
                save_ready(&c, key(1));
            }
        });
        if let Some(pin) = pin_for_demotion(&core, &job) {
            // What the demotion copies to the drive: the block must still be key 0's, start to end.
            assert_eq!(core.slot_key(r.slot), key(0), "a demotion read a block that was evicted under it");
            thread::yield_now();
            assert_eq!(core.slot_key(r.slot), key(0), "a demotion read a block that was evicted under it");
            drop(pin);
        }
        evictor.join().unwrap();
    });
}

/// A promotion (its host side: slots reserved under the keys, then published) commits its block
/// with the lease's pin already on it, while an evictor wants the only slot: the block is never
/// evictable between its commit and its lease.
#[test]
fn promoted_block_is_pinned_from_its_commit() {
    loom::model(|| {
        let core = core(1);
        let c = core.clone();
        let evictor = thread::spawn(move || {
            evict_one(&c);
        });
        let reservation = reserve_promotion(&core, &[key(0)]);
        assert_eq!(reservation.len(), 1, "the only slot is free");
        let published = reservation.commit_leading_pinned(1, |_| {});
        let r = published[0];
        let w = core.control().load(r.slot);
        assert!(
            w.state() == SlotState::Ready && w.generation() == r.generation && w.pins() == 1,
            "a promoted block was evictable before its lease pinned it: {w:?}"
        );
        evictor.join().unwrap();
        core.unpin(r.slot);
    });
}

/// A promotion pins a disk block for its read while a demotion needs the only disk slot: the
/// demotion evicts the block only if it is unpinned, never while the read holds it.
#[test]
fn pinned_disk_slot_is_never_rewritten() {
    loom::model(|| {
        let (slots, _) = DiskSlots::new(1, &[]);
        let slots = Arc::new(slots);
        let (d, evicted) = slots.take(&key(0)).expect("a free disk slot");
        assert!(evicted.is_none() && slots.commit(d, key(0)));
        let s = slots.clone();
        let demotion = thread::spawn(move || {
            if let Some((d, evicted)) = s.take(&key(1)) {
                assert_eq!(evicted, Some(key(0)));
                assert!(s.commit(d, key(1)));
            }
        });
        if let Some(d) = slots.pin(&key(0)) {
            assert_eq!(slots.key_of(d.slot), key(0), "a pinned disk slot was rewritten");
            thread::yield_now();
            assert_eq!(slots.key_of(d.slot), key(0), "a pinned disk slot was rewritten");
            slots.unpin(d, true);
        }
        demotion.join().unwrap();
    });
}
