//! Several ranks sharing one pool under concurrent saves, restores and eviction, with injected copy
//! faults: every restore that succeeds returns the right bytes, and the tier stays consistent.

mod common;

use common::*;
use kvtier::FaultyBackend;
use kvtier::{EngineArenas, Fit, PolicyKind, SaveOptions, TierError, WaitFor};

/// Each rank repeatedly saves a window of shared keys, queries a prefix, restores it into its own
/// pages and verifies. The pool (24 slots) is far smaller than the key space (64), so eviction runs
/// constantly while other ranks hold leases.
fn churn(policy: PolicyKind, fault_rate: f64) {
    let tier = tier(24, policy);
    let all = keys(&tier, 0..64);
    let ranks = 4;
    let (verified, failures): (Vec<u64>, Vec<u64>) = std::thread::scope(|s| {
        let hs: Vec<_> = (0..ranks)
            .map(|r| {
                let (tier, all) = (&tier, &all);
                s.spawn(move || {
                    let a = arenas();
                    let backend = Box::new(FaultyBackend::new(a.backend().unwrap(), fault_rate, 7 + r as u64));
                    let rank = tier.attach(backend).unwrap();
                    let (mut verified, mut failures) = (0u64, 0u64);
                    for i in 0..150usize {
                        let start = (i * 7 + r * 13) % 56;
                        let k = &all[start..start + 8];
                        let src: Vec<u64> = (0..8).collect();
                        a.fill(&src, k).unwrap();
                        match rank.save_with(k, &src, WaitFor::Nothing, SaveOptions::new().fit(Fit::Prefix)) {
                            Ok(t) => {
                                if t.handle.wait().is_err() {
                                    failures += 1;
                                }
                            }
                            Err(TierError::Copy(_)) => failures += 1,
                            // Other ranks hold the rest of the pool pinned or in flight: legal.
                            Err(TierError::PoolExhausted { .. }) => {}
                            Err(e) => panic!("unexpected save error: {e}"),
                        }
                        let lease = tier.query(k);
                        let dst: Vec<u64> = (32..32 + lease.len() as u64).collect();
                        match rank.restore(&lease, &dst, WaitFor::Nothing) {
                            Ok(h) => match h.wait() {
                                Ok(()) => {
                                    a.verify(&dst, &k[..dst.len()]).unwrap();
                                    verified += dst.len() as u64;
                                }
                                Err(_) => failures += 1,
                            },
                            Err(TierError::Copy(_)) => failures += 1,
                            Err(e) => panic!("unexpected restore error: {e}"),
                        }
                    }
                    rank.shutdown(std::time::Duration::from_secs(30)).unwrap();
                    (verified, failures)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).unzip()
    });
    let verified: u64 = verified.iter().sum();
    assert!(verified > 0);
    if fault_rate == 0.0 {
        assert_eq!(failures.iter().sum::<u64>(), 0);
    } else {
        assert!(failures.iter().sum::<u64>() > 0, "faults were injected");
    }
    let s = tier.stats();
    assert_eq!(s.pinned_slots, 0);
    assert_eq!(s.writing_slots, 0);
    assert!(s.evictions > 0);
    let audit = kvtier::internals::core(&tier).audit(&all).unwrap();
    assert_eq!(audit.ready + audit.free, 24);
    assert_eq!(audit.ready as u64, s.index_entries);
}

#[test]
fn ranks_share_one_pool_under_churn_lru() {
    churn(PolicyKind::Lru, 0.0);
}

#[test]
fn ranks_share_one_pool_under_churn_clock_with_faults() {
    churn(PolicyKind::Clock, 0.1);
}

#[test]
fn a_block_saved_by_one_rank_restores_on_every_other() {
    let tier = tier(16, PolicyKind::Lru);
    let arenas: Vec<_> = (0..4).map(|_| arenas()).collect();
    let ranks: Vec<_> = arenas.iter().map(|a| tier.attach(a.backend().unwrap()).unwrap()).collect();
    let k = keys(&tier, 0..8);
    let _ = save_filled(&ranks[0], &arenas[0], &k, &[0, 1, 2, 3, 4, 5, 6, 7]);
    let lease = tier.query_shared(&k, 3);
    let hs: Vec<_> = (1..4)
        .map(|r| ranks[r].restore(&lease, &[20, 21, 22, 23, 24, 25, 26, 27], WaitFor::Nothing).unwrap())
        .collect();
    for h in hs {
        h.wait().unwrap();
    }
    for a in &arenas[1..] {
        a.verify(&[20, 21, 22, 23, 24, 25, 26, 27], &k).unwrap();
    }
    assert!(lease.is_settled());
    assert_eq!(tier.stats().pinned_slots, 0);
}

#[test]
fn tensor_parallel_shards_do_not_share_blocks() {
    let tier = tier(16, PolicyKind::Lru);
    let g0 = small_geometry().with_shard(0, 2).unwrap();
    let g1 = small_geometry().with_shard(1, 2).unwrap();
    let a0 = std::sync::Arc::new(kvtier::MemcpyArenas::new(&g0).unwrap());
    let a1 = std::sync::Arc::new(kvtier::MemcpyArenas::new(&g1).unwrap());
    let r0 = tier.attach(a0.backend().unwrap()).unwrap();
    let r1 = tier.attach(a1.backend().unwrap()).unwrap();
    assert_ne!(r0.namespace(), r1.namespace());
    let k0: Vec<_> = (0..2).map(|i| r0.namespace().trace_page_key(i, 0)).collect();
    let k1: Vec<_> = (0..2).map(|i| r1.namespace().trace_page_key(i, 0)).collect();
    let _ = save_filled(&r0, &a0, &k0, &[0, 1]);
    assert_eq!(tier.query(&k1).len(), 0, "shard 1 never hits shard 0's blocks");
    let _ = save_filled(&r1, &a1, &k1, &[0, 1]);
    assert_eq!(tier.stats().saved_blocks, 4);
    assert_eq!(tier.query(&k0).len(), 2);
}
