//! loom models of the slot free list (`kvtier::internals::FreeList`): concurrent pops and pushes never hand one slot id to
//! two owners (the ABA failure of an untagged Treiber stack), every id is back at the end, and a pop
//! never reports the list empty while it was not (a sweep over the shards alone can miss an id).
//!
//! Run with `ci/loom.sh` (it builds with the loom cfgs, facts in docs/invariants.md), or by hand:
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom --cfg crossbeam_sanitize" LOOM_MAX_PREEMPTIONS=2 \
//!  CARGO_TARGET_DIR=target/loom cargo test --release --features loom --test loom_freelist`
//! Seeded bugs (built with `KVTIER_SEEDED_BUGS=1`, planted with `KVTIER_SEEDED_BUG=NAME` at run
//! time; `ci/loom.sh bites loom_freelist`):
//! - `freelist-aba` (no tag increment): both ownership models fail: two owners touch one slot's
//!   bytes (a loom causality violation) or an id is handed out twice. A push CAS weakened from
//!   Release to Relaxed fails the same way (checked by hand).
//! - `freelist-missed-pop` (a pop gives up after one sweep): `pop_racing_push_and_pop_finds_an_id`
//!   fails with "pop returned None although an id was on the list throughout".
#![cfg(loom)]

use kvtier::internals::FreeList;
use loom::cell::UnsafeCell;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Arc;
use loom::thread;

/// The list plus one "owned" flag per id, set by whoever popped it, and one plain (non-atomic) cell
/// per id standing for the slot's bytes: its owner writes it after the pop and reads it before the
/// push, so loom reports a data race if a push -> pop handover lacked a happens-before edge (the
/// Release push / Acquire pop orderings).
struct Model {
    list: FreeList,
    owned: Vec<AtomicBool>,
    bytes: Vec<UnsafeCell<u32>>,
}

impl Model {
    fn new(n: u32, shards: usize) -> Arc<Self> {
        Arc::new(Model {
            list: FreeList::with_shards(n, shards),
            owned: (0..n).map(|_| AtomicBool::new(false)).collect(),
            bytes: (0..n).map(|_| UnsafeCell::new(0)).collect(),
        })
    }
    fn pop(&self, hint: usize) -> Option<u32> {
        let id = self.list.pop_near(hint)?;
        assert!(!self.owned[id as usize].swap(true, Ordering::Relaxed), "id {id} handed to two owners (ABA)");
        // SAFETY: the pop made this thread the id's only owner (checked above).
        self.bytes[id as usize].with_mut(|b| unsafe { *b = *b + 1 + hint as u32 });
        Some(id)
    }
    fn push(&self, hint: usize, id: u32) {
        // SAFETY: this thread still owns the id.
        let _ = self.bytes[id as usize].with(|b| unsafe { *b });
        self.owned[id as usize].store(false, Ordering::Relaxed);
        self.list.push_near(hint, id);
    }
    /// After every thread joined: all ids are back, each exactly once.
    fn check_all_back(&self) {
        let n = self.list.capacity();
        assert_eq!(self.list.len(), n as usize);
        let mut seen = vec![false; n as usize];
        while let Some(id) = self.list.pop_near(0) {
            assert!(!seen[id as usize], "id {id} on the list twice");
            seen[id as usize] = true;
        }
        assert!(seen.iter().all(|&s| s), "ids missing: {seen:?}");
    }
}

/// The classic ABA schedule: A pops (reads top 0, below 1) while B pops 0, pops 1, pushes 0 back.
/// Without the tag A's CAS installs 1 (owned by B) as the top and A's next pop takes it. Three ids,
/// not two: A's pop holds a reservation while it reads, so B can pop two ids only if a third is free.
#[test]
fn aba_two_threads_one_shard() {
    loom::model(|| {
        let m = Model::new(3, 1);
        let a = {
            let m = m.clone();
            thread::spawn(move || {
                let x = m.pop(0);
                let y = m.pop(0);
                for id in [y, x].into_iter().flatten() {
                    m.push(0, id);
                }
            })
        };
        let b = {
            let m = m.clone();
            thread::spawn(move || {
                let x = m.pop(0);
                let y = m.pop(0);
                if let Some(x) = x {
                    m.push(0, x);
                }
                if let Some(y) = y {
                    m.push(0, y);
                }
            })
        };
        a.join().unwrap();
        b.join().unwrap();
        m.check_all_back();
    });
}

/// Two shards, three slots, three threads with different homes: stealing across shards keeps
/// single ownership and loses nothing.
#[test]
fn steal_three_threads_two_shards() {
    loom::model(|| {
        let m = Model::new(3, 2);
        let handles: Vec<_> = (0..2usize)
            .map(|t| {
                let m = m.clone();
                thread::spawn(move || {
                    let x = m.pop(t);
                    if let Some(x) = x {
                        // Free on the other shard, so ids migrate between stacks.
                        m.push(t + 1, x);
                    }
                    if let Some(y) = m.pop(t) {
                        m.push(t, y);
                    }
                })
            })
            .collect();
        // The main thread is the third participant.
        if let Some(z) = m.pop(1) {
            m.push(0, z);
        }
        for h in handles {
            h.join().unwrap();
        }
        m.check_all_back();
    });
}

/// Two shards, two ids: id 1 sits on shard 1 throughout; the main thread holds id 0. Thread B pushes
/// id 0 onto shard 0 and then pops near shard 1, while the main thread pops near shard 0. The list
/// holds at least one id at every instant, so both pops must find one. A pop that sweeps once can
/// miss: it sees shard 0 empty, B pushes id 0 there and takes id 1 from shard 1, and the sweep then
/// sees shard 1 empty. The reservation on the `avail` count makes the pop sweep again instead.
#[test]
fn pop_racing_push_and_pop_finds_an_id() {
    loom::model(|| {
        let m = Model::new(2, 2);
        let held = m.pop(0).expect("id 0 from shard 0");
        assert_eq!(held, 0);
        let b = {
            let m = m.clone();
            thread::spawn(move || {
                m.push(0, held);
                let got = m.pop(1);
                assert!(got.is_some(), "pop after a push on the same thread found nothing");
                got
            })
        };
        let mine = m.pop(0);
        assert!(mine.is_some(), "pop returned None although an id was on the list throughout");
        let theirs = b.join().unwrap();
        for id in [mine, theirs].into_iter().flatten() {
            m.push(0, id);
        }
        m.check_all_back();
    });
}
