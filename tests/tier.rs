//! HostTier behaviour: lifecycle, leases, guards, eviction, errors. Every assertion is an exact value.

mod common;

use common::*;
use kvtier::{EngineArenas, Fit, PolicyKind, SaveOptions, TierError, WaitFor};
use std::time::Duration;

#[test]
fn saved_blocks_restore_byte_for_byte() {
    let tier = tier(16, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..8);
    let t = save_filled(&rank, &a, &k, &[0, 1, 2, 3, 4, 5, 6, 7]);
    assert_eq!(t.saving, (0..8).collect::<Vec<_>>());
    // Restore into a permutation of other pages on a second rank with its own arenas.
    let b = arenas();
    let rank_b = tier.attach(b.backend().unwrap()).unwrap();
    let lease = tier.query(&k);
    assert_eq!(lease.len(), 8);
    let dst = [63, 10, 40, 11, 12, 50, 13, 20];
    rank_b.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait().unwrap();
    b.verify(&dst, &k).unwrap();
    assert!(lease.is_settled(), "a one-use lease settles when its restore consumes it");
    let s = tier.stats();
    assert_eq!((s.saved_blocks, s.restored_blocks, s.hit_blocks, s.pinned_slots), (8, 8, 8, 0));
    assert_eq!(s.bytes_saved, 8 * 5120);
    assert_eq!(s.bytes_restored, 8 * 5120);
}

#[test]
fn query_leases_the_longest_ready_prefix() {
    let tier = tier(16, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    let _ = save_filled(&rank, &a, &[k[0], k[1], k[3]], &[0, 1, 3]);
    let lease = tier.query(&k);
    assert_eq!(lease.len(), 2);
    assert_eq!(tier.stats().pinned_slots, 2);
    assert_eq!(tier.stats().miss_blocks, 2);
    drop(lease);
    assert_eq!(tier.stats().pinned_slots, 0, "dropping a lease settles it");
}

#[test]
fn resaving_a_resident_block_copies_nothing() {
    let tier = tier(16, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..3);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2]);
    let t = rank.save(&k, &[5, 6, 7], WaitFor::Nothing).unwrap();
    assert!(t.saving.is_empty());
    assert_eq!(t.resident, 3);
    assert_eq!(tier.stats().saved_blocks, 3);
}

#[test]
fn concurrent_saves_of_one_key_copy_once() {
    let tier = tier(64, PolicyKind::Lru);
    let k = keys(&tier, 0..16);
    let pages: Vec<u64> = (0..16).collect();
    let copied: usize = std::thread::scope(|s| {
        let hs: Vec<_> = (0..4)
            .map(|_| {
                let (tier, k, pages) = (&tier, &k, &pages);
                s.spawn(move || {
                    let a = arenas();
                    a.fill(pages, k).unwrap();
                    let rank = tier.attach(a.backend().unwrap()).unwrap();
                    let t = rank.save(k, pages, WaitFor::Nothing).unwrap();
                    t.handle.wait().unwrap();
                    assert_eq!(t.saving.len() + t.resident + t.in_flight, 16);
                    t.saving.len()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).sum()
    });
    assert_eq!(copied, 16, "each key was copied by exactly one save");
    assert_eq!(tier.stats().saved_blocks, 16);
    assert_eq!(tier.stats().index_entries, 16);
}

#[test]
fn a_block_in_flight_is_invisible_unevictable_and_not_saved_twice() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let gate = Gate::default();
    let rank = tier.attach(TestBackend::gated(&a, &gate)).unwrap();
    let k = keys(&tier, 0..1);
    a.fill(&[0], &k).unwrap();
    let t = rank.save(&k, &[0], WaitFor::Nothing).unwrap();
    assert_eq!(rank.load().save_gpu_pages, 1);
    assert!(tier.query(&k).is_empty(), "a WRITING block is invisible to queries");
    assert_eq!(tier.evict(4), 0, "a WRITING block is never evicted");
    let again = rank.save(&k, &[1], WaitFor::Nothing).unwrap();
    assert_eq!((again.saving.len(), again.in_flight), (0, 1));
    assert!(!t.handle.is_done());
    gate.open();
    t.handle.wait().unwrap();
    assert_eq!(tier.query(&k).len(), 1);
    assert_eq!(rank.load().save_gpu_pages, 0);
}

#[test]
fn eviction_never_frees_a_pinned_block_and_refuses_before_evicting() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..10);
    let _ = save_filled(&rank, &a, &k[0..4], &[0, 1, 2, 3]);
    let lease = tier.query(&k[0..2]);
    assert_eq!(lease.len(), 2);
    // Two new blocks: the two unpinned ones (k2, k3) are evicted, never the leased k0, k1.
    let _ = save_filled(&rank, &a, &k[4..6], &[4, 5]);
    assert!(tier.contains(&k[0]) && tier.contains(&k[1]));
    assert!(!tier.contains(&k[2]) && !tier.contains(&k[3]));
    assert_eq!(tier.stats().evictions, 2);
    // Three more cannot fit (2 pinned + capacity 4): refused with nothing evicted.
    a.fill(&[6, 7, 8], &k[6..9]).unwrap();
    match rank.save(&k[6..9], &[6, 7, 8], WaitFor::Nothing) {
        Err(TierError::CannotFit { needed: 3, available: 2, capacity: 4 }) => {}
        other => panic!("expected CannotFit, got {other:?}"),
    }
    assert!(tier.contains(&k[4]) && tier.contains(&k[5]), "a refused save evicts nothing");
    assert_eq!(tier.stats().evictions, 2);
    // With Fit::Prefix the leading two that fit are saved and one is dropped.
    let t = rank.save_with(&k[6..9], &[6, 7, 8], WaitFor::Nothing, SaveOptions::new().fit(Fit::Prefix)).unwrap();
    t.handle.wait().unwrap();
    assert_eq!((t.saving.clone(), t.dropped), (vec![0, 1], 1));
    // The leased blocks survived all of it and still hold their bytes.
    let b = arenas();
    let rank_b = tier.attach(b.backend().unwrap()).unwrap();
    rank_b.restore(&lease, &[30, 31], WaitFor::Nothing).unwrap().wait().unwrap();
    b.verify(&[30, 31], &k[0..2]).unwrap();
}

#[test]
fn a_stale_lookup_fails_by_generation_after_reuse() {
    let tier = tier(1, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..2);
    let _ = save_filled(&rank, &a, &k[0..1], &[0]);
    let stale = kvtier::internals::core(&tier).index().get(&k[0]).unwrap();
    let _ = save_filled(&rank, &a, &k[1..2], &[1]); // evicts k0, reuses its slot
    let fresh = kvtier::internals::core(&tier).index().get(&k[1]).unwrap();
    assert_eq!(fresh.slot, stale.slot);
    assert_eq!(fresh.generation, stale.generation + 1);
    assert!(kvtier::internals::core(&tier).index().get(&k[0]).is_none());
    let control = kvtier::internals::control(tier.pool());
    assert_eq!(control.pin(stale.slot, stale.generation), Err(kvtier::internals::PinError::Stale));
}

#[test]
fn a_lease_settles_exactly_once() {
    let tier = tier(8, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..2);
    let _ = save_filled(&rank, &a, &k, &[0, 1]);
    let lease = tier.query(&k);
    let twin = lease.clone();
    assert_eq!(tier.stats().pinned_slots, 2);
    assert!(lease.release());
    assert!(!twin.is_settled() || twin.uses_left() == 0);
    assert!(!twin.clone().release(), "a second settle does nothing");
    assert_eq!(tier.stats().pinned_slots, 0);
    assert!(matches!(rank.restore(&twin, &[5, 6], WaitFor::Nothing), Err(TierError::LeaseSettled)));
}

#[test]
fn several_ranks_restore_from_one_shared_lease() {
    let tier = tier(8, PolicyKind::Lru);
    let a = arenas();
    let r0 = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..3);
    let _ = save_filled(&r0, &a, &k, &[0, 1, 2]);
    let (b, c) = (arenas(), arenas());
    let (r1, r2) = (tier.attach(b.backend().unwrap()).unwrap(), tier.attach(c.backend().unwrap()).unwrap());
    let lease = tier.query_shared(&k, 2);
    r1.restore(&lease, &[7, 8, 9], WaitFor::Nothing).unwrap().wait().unwrap();
    assert!(!lease.is_settled(), "the first rank's restore leaves the second rank's use");
    r2.restore(&lease, &[3, 4, 5], WaitFor::Nothing).unwrap().wait().unwrap();
    b.verify(&[7, 8, 9], &k).unwrap();
    c.verify(&[3, 4, 5], &k).unwrap();
    assert!(lease.is_settled());
    assert!(matches!(r0.restore(&lease, &[3], WaitFor::Nothing), Err(TierError::LeaseSettled)));
    assert_eq!(tier.stats().pinned_slots, 0);
}

#[test]
fn a_dropped_lease_keeps_its_slots_until_the_restore_completes() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let r0 = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    let _ = save_filled(&r0, &a, &k, &[0, 1, 2, 3]);
    let b = arenas();
    let gate = Gate::default();
    let r1 = tier.attach(TestBackend::gated(&b, &gate)).unwrap();
    let lease = tier.query(&k[0..2]);
    let h = r1.restore(&lease, &[10, 11], WaitFor::Nothing).unwrap();
    drop(lease);
    assert_eq!(tier.stats().pinned_slots, 2, "the restore's guards still pin both slots");
    assert_eq!(tier.evict(4), 2, "only the two unguarded blocks can go");
    assert!(tier.contains(&k[0]) && tier.contains(&k[1]));
    gate.open();
    h.wait().unwrap();
    b.verify(&[10, 11], &k[0..2]).unwrap();
    assert_eq!(tier.stats().pinned_slots, 0);
    assert_eq!(tier.evict(4), 2);
}

#[test]
fn bad_input_gets_typed_errors_and_loses_nothing() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..2);
    let _ = save_filled(&rank, &a, &k[0..1], &[0]);
    assert!(matches!(rank.save(&k, &[1], WaitFor::Nothing), Err(TierError::LengthMismatch { keys: 2, pages: 1 })));
    assert!(matches!(
        rank.save(&k[1..2], &[64], WaitFor::Nothing),
        Err(TierError::Copy(kvtier::CopyError::PageOutOfRange { page: 64, pages: 64 }))
    ));
    let lease = tier.query(&k[0..1]);
    assert!(matches!(
        rank.restore(&lease, &[1, 2], WaitFor::Nothing),
        Err(TierError::LeaseTooShort { asked: 2, held: 1 })
    ));
    assert!(matches!(
        rank.restore(&lease, &[99], WaitFor::Nothing),
        Err(TierError::Copy(kvtier::CopyError::PageOutOfRange { page: 99, .. }))
    ));
    // The failed restore left the lease usable.
    rank.restore(&lease, &[9], WaitFor::Nothing).unwrap().wait().unwrap();
    a.verify(&[9], &k[0..1]).unwrap();
    let other = tier_other();
    let foreign = other.query(&[]);
    assert!(matches!(rank.restore(&foreign, &[], WaitFor::Nothing), Err(TierError::ForeignLease)));
    assert!(tier.contains(&k[0]));
    assert_eq!(tier.stats().index_entries, 1);
}

fn tier_other() -> kvtier::HostTier {
    tier(2, PolicyKind::Lru)
}

#[test]
fn a_failed_save_makes_nothing_visible_and_frees_its_slots() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(TestBackend::failing(&a)).unwrap();
    let k = keys(&tier, 0..3);
    let t = rank.save(&k, &[0, 1, 2], WaitFor::Nothing).unwrap();
    assert!(t.handle.wait().is_err());
    let s = tier.stats();
    assert_eq!((s.save_failed_blocks, s.index_entries, s.free_slots, s.writing_slots), (3, 0, 4, 0));
    assert!(tier.query(&k).is_empty());
}

#[test]
fn handles_can_be_awaited_and_called_back() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let gate = Gate::default();
    let rank = tier.attach(TestBackend::gated(&a, &gate)).unwrap();
    let k = keys(&tier, 0..1);
    let t = rank.save(&k, &[0], WaitFor::Nothing).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    t.handle.on_complete(move |r| tx.send(r.is_ok()).unwrap());
    assert!(t.handle.wait_timeout(Duration::from_millis(20)).is_none());
    let fut = t.handle.clone();
    let waiter = std::thread::spawn(move || block_on(fut));
    gate.open();
    assert!(waiter.join().unwrap().is_ok());
    assert!(rx.recv().unwrap());
    assert!(t.handle.latency().is_some());
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    use std::task::{Context, Poll, Wake, Waker};
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(std::sync::Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut f = std::pin::pin!(f);
    loop {
        if let Poll::Ready(v) = f.as_mut().poll(&mut cx) {
            return v;
        }
        std::thread::park();
    }
}

#[test]
fn shutdown_drains_or_reports_in_flight_copies() {
    let tier = tier(4, PolicyKind::Clock);
    let a = arenas();
    let gate = Gate::default();
    let rank = tier.attach(TestBackend::gated(&a, &gate)).unwrap();
    let k = keys(&tier, 0..1);
    let t = rank.save(&k, &[0], WaitFor::Nothing).unwrap();
    assert!(matches!(rank.drain(Duration::from_millis(20)), Err(TierError::DrainTimeout { in_flight: 1 })));
    gate.open();
    rank.shutdown(Duration::from_secs(10)).unwrap();
    assert!(t.handle.is_done());
    tier.shutdown();
    let b = arenas();
    assert!(matches!(tier.attach(b.backend().unwrap()), Err(TierError::ShuttingDown)));
    assert_eq!(tier.query(&k).len(), 1, "queries still answer after shutdown");
}

#[test]
fn audit_sees_a_consistent_tier_after_churn() {
    let tier = tier(4, PolicyKind::Clock);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..12);
    for c in k.chunks(3) {
        let _ = save_filled(&rank, &a, c, &[0, 1, 2]);
    }
    let lease = tier.query(&k[9..11]);
    let rep = kvtier::internals::core(&tier).audit(&k).unwrap();
    assert_eq!((rep.ready, rep.free, rep.writing, rep.pinned), (4, 0, 0, lease.len()));
}

#[test]
fn a_prefix_save_stops_at_the_first_key_the_policy_refuses() {
    let tier = tier(8, PolicyKind::PrefixTinyLfu);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    a.fill(&[0, 1, 2, 3], &k).unwrap();
    let prefix = SaveOptions::new().fit(Fit::Prefix);
    // First sighting of every key: nothing admitted, all four dropped (and counted by the policy).
    let t = rank.save_with(&k[1..4], &[1, 2, 3], WaitFor::Nothing, prefix).unwrap();
    assert_eq!((t.saving.clone(), t.dropped), (vec![], 3));
    // k0 is new, k1..k3 seen once: the refusal of k0 drops the whole batch.
    let t = rank.save_with(&k, &[0, 1, 2, 3], WaitFor::Nothing, prefix).unwrap();
    assert_eq!((t.saving.clone(), t.dropped), (vec![], 4));
    // Now every key has history: all saved.
    let t = rank.save_with(&k, &[0, 1, 2, 3], WaitFor::Nothing, prefix).unwrap();
    t.handle.wait().unwrap();
    assert_eq!((t.saving.clone(), t.dropped), (vec![0, 1, 2, 3], 0));
    assert_eq!(tier.stats().save_dropped, 7);
    // All-or-nothing saves bypass admission.
    let k2 = keys(&tier, 10..12);
    a.fill(&[4, 5], &k2).unwrap();
    let t = rank.save(&k2, &[4, 5], WaitFor::Nothing).unwrap();
    t.handle.wait().unwrap();
    assert_eq!(t.saving, vec![0, 1]);
    a.verify(&[0, 1, 2, 3], &k).unwrap();
}

#[test]
fn a_panicking_callback_leaves_the_rank_working() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let gate = Gate::default();
    let rank = tier.attach(TestBackend::gated(&a, &gate)).unwrap();
    let k = keys(&tier, 0..2);
    a.fill(&[0, 1], &k).unwrap();
    let first = rank.save(&k[0..1], &[0], WaitFor::Nothing).unwrap();
    first.handle.on_complete(|_| panic!("engine callback bug"));
    let second = rank.save(&k[1..2], &[1], WaitFor::Nothing).unwrap();
    gate.open();
    first.handle.wait().unwrap();
    // Before the fix the panic killed the completion thread and this handle never completed.
    second.handle.wait_timeout(Duration::from_secs(30)).expect("the second save completed").unwrap();
    rank.drain(Duration::from_secs(10)).unwrap();
    assert_eq!(tier.query(&k).len(), 2);
}

#[test]
fn slot_acquisition_that_cannot_be_satisfied_evicts_nothing() {
    // Four ready blocks, two of them leased: a direct request for three slots (as a save racing
    // other savers would make after its fit check) must fail without evicting the two it could take.
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    let _ = save_filled(&rank, &a, &k, &[0, 1, 2, 3]);
    let lease = tier.query(&k[0..2]);
    match kvtier::internals::core(&tier).acquire_slots(kvtier::internals::Want::Exactly(3)) {
        Err(TierError::PoolExhausted { needed: 3, got: 2 }) => {}
        other => panic!("expected PoolExhausted, got {other:?}"),
    }
    assert!(k.iter().all(|key| tier.contains(key)), "every block is still resident");
    let s = tier.stats();
    assert_eq!((s.evictions, s.ready_slots, s.free_slots), (0, 4, 0));
    kvtier::internals::core(&tier).audit(&k).unwrap();
    drop(lease);
}

#[test]
fn a_restore_takes_its_use_before_it_copies_and_gives_it_back_on_failure() {
    let tier = tier(8, PolicyKind::Lru);
    let a = arenas();
    let r0 = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..2);
    let _ = save_filled(&r0, &a, &k, &[0, 1]);
    let b = arenas();
    let gate = Gate::default();
    let r1 = tier.attach(TestBackend::gated(&b, &gate)).unwrap();
    let lease = tier.query(&k);
    // A submission that fails (page out of range) leaves the use in the lease.
    assert!(matches!(r1.restore(&lease, &[5, 99], WaitFor::Nothing), Err(TierError::Copy(_))));
    assert_eq!(lease.uses_left(), 1);
    let h = r1.restore(&lease, &[5, 6], WaitFor::Nothing).unwrap();
    // The one use is taken while the first copy is still in flight: a second rank gets nothing.
    assert!(matches!(r0.restore(&lease, &[7, 8], WaitFor::Nothing), Err(TierError::LeaseSettled)));
    gate.open();
    h.wait().unwrap();
    b.verify(&[5, 6], &k).unwrap();
    assert_eq!(tier.stats().pinned_slots, 0);
}

/// Issue 19 item 1: no argument of `evict` panics or over-allocates: `usize::MAX` and `1 << 40`
/// mean "every evictable block" (at most the pool's capacity), and a later save that needs
/// eviction still works (the eviction lock was not poisoned).
#[test]
fn an_evict_of_any_size_returns_sanely_and_later_saves_still_evict() {
    let tier = tier(4, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..12);
    let _ = save_filled(&rank, &a, &k[..4], &[0, 1, 2, 3]);
    let lease = tier.query(&k[..1]);
    assert_eq!(tier.evict(usize::MAX), 3, "every unpinned block, never the pinned one");
    let _ = save_filled(&rank, &a, &k[4..7], &[4, 5, 6]);
    assert_eq!(tier.evict(1 << 40), 3);
    assert_eq!(tier.evict(usize::MAX), 0);
    drop(lease);
    let _ = save_filled(&rank, &a, &k[7..11], &[7, 8, 9, 10]);
    // The pool is full: this save must evict, through the eviction lock.
    let t = save_filled(&rank, &a, &k[11..12], &[11]);
    assert_eq!(t.saving.len(), 1);
    assert_eq!(tier.stats().evictions, 3 + 3 + 1 + 1);
    kvtier::internals::core(&tier).audit(&k).unwrap();
}

/// Issue 19 item 1 (the audit): a deadline that cannot be represented (`Duration::MAX`) waits
/// without one instead of panicking on `Instant + Duration` overflow.
#[test]
fn timeouts_too_long_for_a_deadline_wait_without_one() {
    let tier = tier(2, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..1);
    a.fill(&[0], &k).unwrap();
    let t = rank.save(&k, &[0], WaitFor::Nothing).unwrap();
    assert!(matches!(t.handle.wait_timeout(Duration::MAX), Some(Ok(()))));
    rank.drain(Duration::MAX).unwrap();
    rank.shutdown(Duration::MAX).unwrap();
}
