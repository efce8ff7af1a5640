//! loom model of `kvtier::freelist::FreeList`: concurrent pops and pushes never hand one slot id to
//! two owners (the ABA failure of an untagged Treiber stack), and every id is back at the end.
//!
//! Run with `ci/loom.sh models loom_freelist`, or by hand (facts in docs/invariants.md):
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom --cfg crossbeam_sanitize" LOOM_MAX_PREEMPTIONS=2 \
//!  CARGO_TARGET_DIR=target/loom cargo test --release --features loom --test loom_freelist`
//! With `--cfg kvtier_seeded_bug="freelist-aba"` added to RUSTFLAGS (no tag increment) both models
//! fail: two owners touch one slot's bytes (a loom causality violation) or an id is handed out
//! twice. A push CAS weakened from Release to Relaxed fails the same way (checked by hand).
#![cfg(loom)]

use kvtier::freelist::FreeList;
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
/// Without the tag A's CAS installs 1 (owned by B) as the top and A's next pop takes it.
#[test]
fn aba_two_threads_one_shard() {
    loom::model(|| {
        let m = Model::new(2, 1);
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
