//! Regression tests for the fault kinds of the reliability report: each test drives the public API
//! (or, where a race needs a fixed interleaving, the crate's test-only hooks) into a situation that
//! failed before the fix. Every assertion is an exact value.

mod common;

use common::*;
use kvtier::{
    CopyError, EngineArenas, Fit, HostTier, PolicyKind, SaveOptions, TierConfig, TierError, TierStats, WaitFor,
};
use kvtier::{FaultyBackend, PanicSite, SubmitPanics};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

/// Opens the gate when dropped: a test that fails while a gated copy is in flight unwinds instead
/// of waiting for it forever (its rank drains on drop).
struct OpenOnDrop(Gate);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

/// Decrements the counter when dropped (a finished or failed worker).
struct CountDown<'a>(&'a AtomicU64);

impl Drop for CountDown<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Every resident, ready, unpinned block can be evicted once asked for enough victims.
fn assert_all_unpinned_evictable(tier: &HostTier, what: &str) {
    let s = tier.stats();
    assert_eq!(s.pinned_slots, 0, "{what}: pins left");
    let ready = s.ready_slots as usize;
    assert_eq!(tier.evict(ready + 1), ready, "{what}: every unpinned ready block is evictable");
    assert_eq!(tier.stats().ready_slots, 0, "{what}");
}

/// Fault 1 (every policy): savers doing 3-key prefix saves into a 12-slot pool race queries that
/// pin recent keys. SIEVE and S3-FIFO used to corrupt their queues (two selections before the
/// claims settled): saves then failed and most unpinned blocks were never evictable again.
#[test]
fn no_policy_wedges_under_concurrent_prefix_saves_and_pins() {
    for &policy in PolicyKind::ALL {
        let tier = tier(12, policy);
        let next = AtomicU64::new(0);
        let savers = AtomicU64::new(2);
        let refused = AtomicU64::new(0);
        std::thread::scope(|s| {
            for _ in 0..2 {
                let (tier, next, refused, savers) = (&tier, &next, &refused, &savers);
                let a = arenas();
                s.spawn(move || {
                    // The queriers stop when both savers are done, however they end.
                    let _done = CountDown(savers);
                    let rank = tier.attach(a.backend().unwrap()).unwrap();
                    for _ in 0..1500 {
                        let base = next.fetch_add(1, Ordering::Relaxed) % 40;
                        let k = keys(tier, base..base + 3);
                        a.fill(&[0, 1, 2], &k).unwrap();
                        match rank.save_with(&k, &[0, 1, 2], WaitFor::Nothing, SaveOptions::new().fit(Fit::Prefix)) {
                            Ok(t) => t.handle.wait().unwrap(),
                            Err(e) => {
                                refused.fetch_add(1, Ordering::Relaxed);
                                panic!("{policy}: a prefix save failed: {e}");
                            }
                        }
                    }
                });
            }
            for _ in 0..2 {
                let (tier, next, savers) = (&tier, &next, &savers);
                s.spawn(move || {
                    while savers.load(Ordering::Relaxed) > 0 {
                        let base = next.load(Ordering::Relaxed) % 40;
                        let lease = tier.query(&keys(tier, base.saturating_sub(3)..base));
                        std::thread::yield_now();
                        drop(lease);
                    }
                });
            }
        });
        assert_eq!(refused.load(Ordering::Relaxed), 0, "{policy}");
        let all = keys(&tier, 0..43);
        kvtier::internals::core(&tier).audit(&all).unwrap();
        assert_all_unpinned_evictable(&tier, policy.name());
    }
}

/// Fault 3: duplicate keys in one save count once: `[K, K]` with one free slot saves K once.
#[test]
fn duplicate_keys_in_one_save_count_once() {
    let tier = tier(1, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..1);
    a.fill(&[0], &k).unwrap();
    let t = rank.save(&[k[0], k[0]], &[0, 0], WaitFor::Nothing).unwrap();
    t.handle.wait().unwrap();
    assert_eq!((t.saving.clone(), t.duplicates, t.resident, t.in_flight), (vec![0], 1, 0, 0));
    let s = tier.stats();
    assert_eq!((s.saved_blocks, s.save_skipped_duplicate, s.evictions), (1, 1, 0));

    // Into a full pool, [K2, K2] evicts one block, not two.
    let tier = tier_with_blocks(2);
    let (t2, a2, r2) = (&tier.0, &tier.1, &tier.2);
    let k2 = keys(t2, 10..11);
    a2.fill(&[5], &k2).unwrap();
    r2.save(&[k2[0], k2[0]], &[5, 5], WaitFor::Nothing).unwrap().handle.wait().unwrap();
    assert_eq!(t2.stats().evictions, 1);
}

fn tier_with_blocks(n: u64) -> (HostTier, Arc<kvtier::MemcpyArenas>, kvtier::Rank) {
    let t = tier(n, PolicyKind::Lru);
    let a = arenas();
    let rank = t.attach(a.backend().unwrap()).unwrap();
    let k = keys(&t, 0..n);
    let _ = save_filled(&rank, &a, &k, &(0..n).collect::<Vec<_>>());
    (t, a, rank)
}

/// Fault 3: two ranks saving the same prefix at once into a full pool evict for one copy only.
#[test]
fn two_ranks_saving_one_prefix_at_once_do_not_over_evict() {
    let rounds = 300u64;
    let tier = tier(6, PolicyKind::Lru);
    let a = arenas();
    let warm = tier.attach(a.backend().unwrap()).unwrap();
    let _ = save_filled(&warm, &a, &keys(&tier, 1000..1006), &[0, 1, 2, 3, 4, 5]);
    let barrier = Barrier::new(2);
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (tier, barrier) = (&tier, &barrier);
            let a = arenas();
            s.spawn(move || {
                let rank = tier.attach(a.backend().unwrap()).unwrap();
                for r in 0..rounds {
                    let k = keys(tier, 3 * r..3 * r + 3);
                    a.fill(&[0, 1, 2], &k).unwrap();
                    barrier.wait();
                    let t = rank.save(&k, &[0, 1, 2], WaitFor::Nothing).unwrap();
                    t.handle.wait().unwrap();
                    assert_eq!(t.saving.len() + t.in_flight + t.resident, 3);
                    barrier.wait();
                }
            });
        }
    });
    let s = tier.stats();
    assert_eq!(s.evictions, 3 * rounds, "each round evicts exactly the 3 blocks one copy needs");
    assert_eq!(s.saved_blocks, 6 + 3 * rounds);
}

/// Fault 4: a backend whose `Completion::wait` panics fails that copy's handle with a typed error,
/// keeps the completion thread alive and quarantines the copy's slots instead of freeing them.
#[test]
fn a_panicking_completion_quarantines_its_slots_and_the_rank_keeps_working() {
    let tier = tier(8, PolicyKind::Lru);
    let a = arenas();
    let gate = Gate::default();
    let bad = tier.attach(TestBackend::panicking(&a, &gate)).unwrap();
    let k = keys(&tier, 0..4);
    a.fill(&[0, 1, 2, 3], &k).unwrap();
    let h1 = bad.save(&k[..2], &[0, 1], WaitFor::Nothing).unwrap().handle;
    let h2 = bad.save(&k[2..], &[2, 3], WaitFor::Nothing).unwrap().handle;
    gate.open();
    for h in [&h1, &h2] {
        assert!(matches!(h.wait(), Err(TierError::Copy(CopyError::BackendPanicked))), "{:?}", h.wait());
    }
    let s = tier.stats();
    assert_eq!(
        (s.quarantined_slots, s.writing_slots, s.free_slots, s.index_entries),
        (4, 0, 4, 0),
        "a copy whose outcome is unknown must keep its slots"
    );
    assert!(k.iter().all(|key| !tier.contains(key)), "a quarantined block is never visible");
    bad.drain(Duration::from_secs(5)).expect("the completion thread survived: the rank drains");
    // The keys can be saved again elsewhere; the quarantined slots are never reused.
    let good = tier.attach(a.backend().unwrap()).unwrap();
    let _ = save_filled(&good, &a, &k, &[0, 1, 2, 3]);
    assert_eq!(tier.stats().free_slots, 0);
    // A restore whose backend panics keeps its pins: the slots are quarantined, never evicted.
    let lease = tier.query(&k[..1]);
    let b = arenas();
    let gate2 = Gate::default();
    let bad2 = tier.attach(TestBackend::panicking(&b, &gate2)).unwrap();
    let h = bad2.restore(&lease, &[9], WaitFor::Nothing).unwrap();
    gate2.open();
    assert!(matches!(h.wait(), Err(TierError::Copy(CopyError::BackendPanicked))));
    drop(lease);
    let s = tier.stats();
    assert_eq!((s.quarantined_slots, s.quarantined_pins, s.pinned_slots), (4, 1, 1));
    assert_eq!(tier.evict(8), 3, "the quarantined block stays pinned");
    assert!(tier.contains(&k[0]));
}

/// A waker that panics when a copy completes (an executor's bug, on the completion thread) fails
/// nothing else: later copies of the rank complete and the rank drains.
#[test]
fn a_panicking_waker_does_not_stop_the_completion_thread() {
    struct PanicWake;
    impl std::task::Wake for PanicWake {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }
    let tier = tier(8, PolicyKind::Lru);
    let a = arenas();
    let gate = Gate::default();
    let rank = tier.attach(TestBackend::gated(&a, &gate)).unwrap();
    let k = keys(&tier, 0..4);
    a.fill(&[0, 1, 2, 3], &k).unwrap();
    let mut h1 = rank.save(&k[..2], &[0, 1], WaitFor::Nothing).unwrap().handle;
    let waker = std::task::Waker::from(Arc::new(PanicWake));
    let mut cx = std::task::Context::from_waker(&waker);
    assert!(std::future::Future::poll(std::pin::Pin::new(&mut h1), &mut cx).is_pending());
    let h2 = rank.save(&k[2..], &[2, 3], WaitFor::Nothing).unwrap().handle;
    gate.open();
    h1.wait_timeout(Duration::from_secs(30)).expect("the first copy completes").unwrap();
    h2.wait_timeout(Duration::from_secs(30)).expect("a copy queued behind a panicking waker completes").unwrap();
    rank.drain(Duration::from_secs(30)).expect("the rank drains");
    assert!(k.iter().all(|key| tier.contains(key)));
}

/// Fault 5: a NaN fault rate means 0 (no batch fails).
#[test]
fn a_nan_fault_rate_fails_nothing() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(Box::new(FaultyBackend::new(a.backend().unwrap(), f64::NAN, 7))).unwrap();
    let k = keys(&tier, 0..4);
    for (i, key) in k.iter().enumerate() {
        let _ = save_filled(&rank, &a, &[*key], &[i as u64]);
    }
    assert_eq!(tier.stats().save_failed_blocks, 0);
}

/// Fault 6: an index capacity the index cannot address is a typed error, not a panic.
#[test]
fn a_huge_index_capacity_is_a_typed_error() {
    let cfg = tier_config(4, PolicyKind::Lru).with_index_capacity(usize::MAX / 2);
    match HostTier::new(cfg) {
        Err(kvtier::Error::Tier(TierError::Index(kvtier::IndexError::CapacityTooLarge { requested, .. }))) => {
            assert_eq!(requested, usize::MAX / 2)
        }
        other => panic!("expected an index capacity error, got {other:?}"),
    }
}

/// Fault 8: a prefix save whose fit snapshot went stale (blocks pinned meanwhile) saves the prefix
/// it can get slots for; it never fails the whole save.
#[test]
fn a_prefix_save_under_concurrent_pins_saves_what_it_can() {
    let tier = tier(8, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let base = keys(&tier, 100..108);
    let _ = save_filled(&rank, &a, &base, &(0..8).collect::<Vec<_>>());
    let stop = AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                let lease = tier.query(&base[..6]);
                std::thread::yield_now();
                drop(lease);
            }
        });
        // Stops the querier however this thread leaves the scope (a failed assertion included).
        let _stop = StopOnDrop(&stop);
        for r in 0..2000u64 {
            // Fresh keys each round, disjoint from the resident base keys (100..108).
            let k = keys(&tier, 1000 + 3 * r..1000 + 3 * r + 3);
            a.fill(&[10, 11, 12], &k).unwrap();
            let t = rank
                .save_with(&k, &[10, 11, 12], WaitFor::Nothing, SaveOptions::new().fit(Fit::Prefix))
                .unwrap_or_else(|e| panic!("round {r}: a prefix save failed: {e}"));
            t.handle.wait().unwrap();
            assert_eq!(t.saving.len() + t.dropped, 3);
            assert_eq!(t.saving, (0..t.saving.len()).collect::<Vec<_>>(), "a prefix of the keys");
        }
    });
    assert_eq!(tier.stats().saves_refused, 0);
}

/// Lease time-to-live: a forgotten lease pins the whole pool; once it is older than the TTL, a
/// save under pool pressure settles it and gets its slots. Restores already submitted from it keep
/// their own pins; a restore from it afterwards fails with `LeaseExpired`.
#[test]
fn a_forgotten_lease_expires_under_pool_pressure() {
    let ttl = Duration::from_millis(200);
    let tier = HostTier::new(tier_config(4, PolicyKind::Lru).with_lease_ttl(ttl)).unwrap();
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3]);
    let forgotten = tier.query(&k);
    assert_eq!(forgotten.len(), 4);
    // A restore in flight from it when it expires.
    let b = arenas();
    let gate = Gate::default();
    let slow = tier.attach(TestBackend::gated(&b, &gate)).unwrap();
    // Declared after the rank, so dropped first: a failing assertion opens the gate before the
    // rank drains.
    let _open = OpenOnDrop(gate.clone());
    let in_flight = slow.restore(&tier.query_shared(&k[..1], 1), &[20], WaitFor::Nothing).unwrap();
    let more = keys(&tier, 10..12);
    a.fill(&[4, 5], &more).unwrap();
    assert!(
        matches!(rank.save(&more, &[4, 5], WaitFor::Nothing), Err(TierError::CannotFit { available: 0, .. })),
        "a lease younger than the TTL was expired"
    );
    assert!(tier.stats().oldest_lease_age_ms < ttl.as_millis() as u64);
    std::thread::sleep(ttl + Duration::from_millis(50));
    assert!(tier.stats().oldest_lease_age_ms >= ttl.as_millis() as u64);
    let t = rank.save(&more, &[4, 5], WaitFor::Nothing).expect("the expired lease let its blocks go");
    t.handle.wait().unwrap();
    assert!(forgotten.is_expired() && forgotten.is_settled());
    assert!(matches!(rank.restore(&forgotten, &[30], WaitFor::Nothing), Err(TierError::LeaseExpired)));
    let s = tier.stats();
    assert_eq!((s.expired_leases, s.live_leases, s.evictions), (1, 0, 2));
    assert!(tier.contains(&k[0]), "the block under the in-flight restore was not evicted");
    gate.open();
    in_flight.wait().unwrap();
    b.verify(&[20], &k[..1]).unwrap();
    assert_eq!(tier.stats().pinned_slots, 0);
}

/// Without a TTL nothing expires, and the oldest lease age is not tracked.
#[test]
fn without_a_ttl_leases_never_expire() {
    let tier = tier(2, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..2);
    let _ = save_filled(&rank, &a, &k, &[0, 1]);
    let lease = tier.query(&k);
    assert_eq!(tier.expire_leases(), 0);
    let s: TierStats = tier.stats();
    assert_eq!((s.live_leases, s.expired_leases, s.oldest_lease_age_ms), (1, 0, 0));
    drop(lease);
    assert_eq!(tier.stats().live_leases, 0);
}

/// The tier's defaults are one policy: the configuration's and the policy kind's.
#[test]
fn one_default_policy() {
    let g = small_geometry();
    assert_eq!(TierConfig::new(g, 1 << 20).policy, PolicyKind::default());
}

/// Issue 19 item 9(b): a backend that panics in `CopyBackend::save` after it queued its copy. The
/// save fails with `BackendPanicked` (the caller does not unwind), its slot is quarantined (never
/// freed: the queued copy lands later), and a later save never reuses it, so a restore of the later
/// key returns that key's bytes, never the old copy's.
#[test]
fn a_backend_that_panics_in_save_after_queuing_quarantines_the_slot() {
    let tier = tier(2, PolicyKind::Lru);
    let a = arenas();
    let (bad, late) = SubmitPanics::new(a.backend().unwrap(), PanicSite::Save);
    let bad = tier.attach(Box::new(bad)).unwrap();
    let k = keys(&tier, 0..3);
    a.fill(&[0], &k[..1]).unwrap();
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bad.save(&k[..1], &[0], WaitFor::Nothing)));
    let s = tier.stats();
    assert_eq!(
        (s.quarantined_slots, s.writing_slots, s.free_slots, s.index_entries),
        (1, 0, 1, 0),
        "the slot under the queued copy must be quarantined, not freed"
    );
    assert!(matches!(r, Ok(Err(TierError::Copy(CopyError::BackendPanicked)))), "a typed error, not an unwind: {r:?}");
    assert!(!tier.contains(&k[0]));
    // The next save gets the other slot; with that block leased, a further save finds no slot: the
    // quarantined one is never offered.
    let good = tier.attach(a.backend().unwrap()).unwrap();
    let _ = save_filled(&good, &a, &k[1..2], &[1]);
    let lease = tier.query(&k[1..2]);
    a.fill(&[2], &k[2..3]).unwrap();
    assert!(matches!(good.save(&k[2..3], &[2], WaitFor::Nothing), Err(TierError::CannotFit { available: 0, .. })));
    // The old copy lands now; the later key's block is untouched.
    assert_eq!(late.land().unwrap(), 1);
    good.restore(&lease, &[5], WaitFor::Nothing).unwrap().wait().unwrap();
    a.verify(&[5], &k[1..2]).expect("a restore returned the bytes of the copy that landed late");
    bad.drain(Duration::from_secs(5)).unwrap();
    kvtier::internals::core(&tier).audit(&k).unwrap();
}

/// Issue 19 item 9(b): a backend that panics in `CopyBackend::restore` after it queued its copy.
/// The restore fails with `BackendPanicked`, the lease keeps its use (as for any backend error),
/// and the copy's pins are kept for good (`quarantined_pins`): the block is never evicted under the
/// late copy, which then reads the right bytes.
#[test]
fn a_backend_that_panics_in_restore_after_queuing_keeps_its_pins() {
    let tier = tier(2, PolicyKind::Lru);
    let a = arenas();
    let good = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..1);
    let _ = save_filled(&good, &a, &k, &[0]);
    let b = arenas();
    let (bad, late) = SubmitPanics::new(b.backend().unwrap(), PanicSite::Restore);
    let bad = tier.attach(Box::new(bad)).unwrap();
    let lease = tier.query(&k);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bad.restore(&lease, &[7], WaitFor::Nothing)));
    drop(lease);
    let s = tier.stats();
    assert_eq!(
        (s.quarantined_pins, s.quarantined_slots, s.pinned_slots),
        (1, 0, 1),
        "the pin under the queued copy must be kept, not dropped"
    );
    assert!(matches!(r, Ok(Err(TierError::Copy(CopyError::BackendPanicked)))), "a typed error, not an unwind");
    assert_eq!(tier.evict(usize::MAX), 0, "the block under the late copy is never evicted");
    assert_eq!(late.land().unwrap(), 1);
    b.verify(&[7], &k).expect("the late restore read the block it was given");
}

/// Issue 19 item 9(a), with real threads: two ranks restore from one lease with a use each; one
/// rank's first restore fails at submission (a page out of range), and its retry must be served,
/// whatever the other rank did meanwhile (it may have taken the last use and submitted).
#[test]
fn a_shared_lease_serves_the_retry_of_a_restore_that_failed_at_submission() {
    let rounds = 20_000;
    let tier = tier(2, PolicyKind::Lru);
    let a = arenas();
    let warm = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..1);
    let _ = save_filled(&warm, &a, &k, &[0]);
    let ranks: Vec<_> = (0..2)
        .map(|_| {
            let b = arenas();
            (tier.attach(b.backend().unwrap()).unwrap(), b)
        })
        .collect();
    let barrier = Barrier::new(2);
    let lease = std::sync::Mutex::new(None);
    std::thread::scope(|s| {
        for (i, (rank, b)) in ranks.iter().enumerate() {
            let (tier, barrier, lease, k) = (&tier, &barrier, &lease, &k);
            s.spawn(move || {
                for round in 0..rounds {
                    if i == 0 {
                        *lease.lock().unwrap() = Some(tier.query_shared(k, 2));
                    }
                    barrier.wait();
                    let l = lease.lock().unwrap().clone().unwrap();
                    if i == 0 {
                        let e = rank.restore(&l, &[u64::MAX], WaitFor::Nothing).expect_err("page out of range");
                        assert!(matches!(e, TierError::Copy(CopyError::PageOutOfRange { .. })), "{e}");
                    }
                    let h = rank.restore(&l, &[1 + i as u64], WaitFor::Nothing).unwrap_or_else(|e| {
                        panic!("round {round}: rank {i} has a use of the lease, yet its restore failed: {e}")
                    });
                    h.wait().unwrap();
                    b.verify(&[1 + i as u64], k).unwrap();
                    drop(l);
                    barrier.wait();
                    if i == 0 {
                        let l = lease.lock().unwrap().take().unwrap();
                        assert!(l.is_settled(), "both uses were taken and submitted");
                    }
                }
            });
        }
    });
    assert_eq!(tier.stats().pinned_slots, 0);
}
