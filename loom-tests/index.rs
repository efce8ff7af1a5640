#![cfg(loom)]
//! loom models of `BlockIndex` (src/index/): racing inserts, removal against lookups with epoch
//! reclamation, growth (migration) racing readers and writers, and batched load grants.
//!
//! Run with `ci/loom.sh models loom_index`, or by hand (facts in docs/invariants.md):
//! `RUSTFLAGS="--cfg loom --cfg crossbeam_loom --cfg crossbeam_sanitize" LOOM_MAX_PREEMPTIONS=2
//!  CARGO_TARGET_DIR=target/loom cargo test --release --features loom --test loom_index`
//! With the seeded bug `index-early-unpin` planted (`ci/loom.sh bites loom_index`: a build with
//! `KVTIER_SEEDED_BUGS=1`, run with `KVTIER_SEEDED_BUG=index-early-unpin`), must make
//! `remove_races_get_with_reclamation` fail with "use after free".

use kvtier::{BlockIndex, ContentKey, SlotId, SlotRef};
use loom::sync::Arc;
use loom::thread;

fn k(i: u64) -> ContentKey {
    ContentKey::from_words(i, i.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

fn v(slot: u32, generation: u64) -> SlotRef {
    SlotRef { slot: SlotId::new(slot), generation }
}

/// Runs `f` under loom with a preemption bound of 2 unless `LOOM_MAX_PREEMPTIONS` says otherwise,
/// and prints how many interleavings were explored (shown with `--nocapture`).
fn model<F: Fn() + Sync + Send + 'static>(f: F) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let mut b = loom::model::Builder::new();
    if b.preemption_bound.is_none() {
        b.preemption_bound = Some(2);
    }
    // A std counter outside the model: it counts executions, it is not part of them.
    let runs = std::sync::Arc::new(AtomicUsize::new(0));
    let counter = runs.clone();
    b.check(move || {
        counter.fetch_add(1, Ordering::Relaxed);
        f()
    });
    eprintln!("{} interleavings", runs.load(Ordering::Relaxed));
}

/// Advances the epoch far enough that everything retired so far by this thread is reclaimed unless
/// another thread is still pinned in an older epoch.
fn reclaim() {
    for _ in 0..3 {
        crossbeam_epoch::pin().flush();
    }
}

/// Two inserts of one key: exactly one wins, and the loser gets the winner's value.
#[test]
fn racing_inserts_of_one_key() {
    model(|| {
        let ix = Arc::new(BlockIndex::with_capacity(1));
        let ix2 = ix.clone();
        let h = thread::spawn(move || ix2.insert_if_absent(k(1), v(1, 10)));
        let mine = ix.insert_if_absent(k(1), v(2, 20));
        let theirs = h.join().unwrap();
        let stored = ix.get(&k(1)).expect("present");
        match (mine, theirs) {
            (Ok(()), Err(got)) => {
                assert_eq!(stored, v(2, 20));
                assert_eq!(got, stored);
            }
            (Err(got), Ok(())) => {
                assert_eq!(stored, v(1, 10));
                assert_eq!(got, stored);
            }
            other => panic!("not exactly one winner: {other:?}"),
        }
        assert_eq!(ix.len(), 1);
    });
}

/// A lookup racing a removal whose entry is reclaimed inside the model: the reader sees the old value
/// or nothing, and never reads the entry after its destructor ran.
#[test]
fn remove_races_get_with_reclamation() {
    model(|| {
        let ix = Arc::new(BlockIndex::with_capacity(1));
        ix.insert_if_absent(k(1), v(1, 1)).unwrap();
        let ix2 = ix.clone();
        let reader = thread::spawn(move || {
            let got = ix2.get(&k(1));
            assert!(got.is_none() || got == Some(v(1, 1)), "{got:?}");
        });
        assert!(ix.remove_if(&k(1), v(1, 1)));
        reclaim();
        reader.join().unwrap();
        assert_eq!(ix.get(&k(1)), None);
        assert!(ix.is_empty());
    });
}

/// An insert that forces a migration (4 buckets, 2 already used) while a reader looks up the keys
/// that were present before: the reader always finds them with the right value, and the new key
/// either not yet or with its value. The old table is retired and reclaimed inside the model.
#[test]
fn growth_while_reading() {
    model(|| {
        let ix = Arc::new(BlockIndex::with_capacity(0));
        assert_eq!(ix.capacity(), 4);
        ix.insert_if_absent(k(1), v(1, 1)).unwrap();
        ix.insert_if_absent(k(2), v(2, 2)).unwrap();
        let ix2 = ix.clone();
        let writer = thread::spawn(move || {
            assert_eq!(ix2.insert_if_absent(k(3), v(3, 3)), Ok(()));
            reclaim();
        });
        let rd = ix.reader();
        assert_eq!(rd.get(&k(1)), Some(v(1, 1)));
        assert_eq!(rd.get(&k(2)), Some(v(2, 2)));
        let got = rd.get(&k(3));
        assert!(got.is_none() || got == Some(v(3, 3)), "{got:?}");
        drop(rd);
        writer.join().unwrap();
        assert_eq!(ix.capacity(), 8);
        assert_eq!(ix.get(&k(3)), Some(v(3, 3)));
        assert_eq!(ix.len(), 3);
    });
}

/// A removal racing the migration started by an insert: the removal is never lost (it lands before
/// the bucket is frozen, or helps and retries in the new table) and the insert is never lost.
#[test]
fn remove_races_migration() {
    model(|| {
        let ix = Arc::new(BlockIndex::with_capacity(0));
        ix.insert_if_absent(k(1), v(1, 1)).unwrap();
        ix.insert_if_absent(k(2), v(2, 2)).unwrap();
        let ix2 = ix.clone();
        let writer = thread::spawn(move || {
            assert_eq!(ix2.insert_if_absent(k(3), v(3, 3)), Ok(()));
        });
        assert!(ix.remove_if(&k(1), v(1, 1)));
        reclaim();
        writer.join().unwrap();
        assert_eq!(ix.get(&k(1)), None);
        assert_eq!(ix.get(&k(2)), Some(v(2, 2)));
        assert_eq!(ix.get(&k(3)), Some(v(3, 3)));
        assert_eq!(ix.len(), 2);
    });
}

/// Two inserts that both need the migration of a two-chunk table (8 buckets, 4 used; loom chunks are
/// 4 buckets) and help each other finish it: no key is lost or duplicated and the table grows once.
#[test]
fn two_writers_help_one_migration() {
    model(|| {
        let ix = Arc::new(BlockIndex::with_capacity(2));
        assert_eq!(ix.capacity(), 8);
        for i in 1..=4 {
            ix.insert_if_absent(k(i), v(i as u32, i)).unwrap();
        }
        let ix2 = ix.clone();
        let writer = thread::spawn(move || assert_eq!(ix2.insert_if_absent(k(5), v(5, 5)), Ok(())));
        assert_eq!(ix.insert_if_absent(k(6), v(6, 6)), Ok(()));
        writer.join().unwrap();
        assert_eq!(ix.capacity(), 16);
        assert_eq!(ix.len(), 6);
        for i in 1..=6 {
            assert_eq!(ix.get(&k(i)), Some(v(i as u32, i)));
        }
    });
}

/// Load grants are granted to per-thread stripes in batches (2 under loom), so one thread may
/// hold credit another needs: three inserts on one thread racing one on another, into a table with a
/// limit of 4 (8 buckets). No key is lost or duplicated; the table usually fills exactly (the other
/// stripe's leftover credit is taken) and migrates early, to 16 buckets, only when a batch is granted
/// but not yet credited at the moment another thread finds the table full.
#[test]
fn batched_load_grants_race() {
    model(|| {
        let ix = Arc::new(BlockIndex::with_capacity(2));
        assert_eq!(ix.capacity(), 8);
        let ix2 = ix.clone();
        let writer = thread::spawn(move || {
            for i in 1..=3 {
                assert_eq!(ix2.insert_if_absent(k(i), v(i as u32, i)), Ok(()));
            }
        });
        assert_eq!(ix.insert_if_absent(k(4), v(4, 4)), Ok(()));
        writer.join().unwrap();
        assert!(matches!(ix.capacity(), 8 | 16), "capacity {}", ix.capacity());
        assert_eq!(ix.len(), 4);
        assert_eq!(ix.insert_if_absent(k(5), v(5, 5)), Ok(()));
        assert_eq!(ix.capacity(), 16);
        for i in 1..=5 {
            assert_eq!(ix.get(&k(i)), Some(v(i as u32, i)));
        }
    });
}
