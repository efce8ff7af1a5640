//! Integration test of the pool through the public API, as the tier uses it: `alloc` -> `reserve`
//! -> write -> `commit` -> `begin_evict` -> `release` -> `free`, on 4 threads.
#![cfg(not(loom))]

use kvtier::internals::SlotState;
use kvtier::SlotId;
use kvtier::{BackingChoice, HostPool, PoolConfig};

#[test]
fn slot_lifecycle_on_four_threads() {
    const SLOT: u64 = 4096;
    let pool = HostPool::new(SLOT, &PoolConfig::new(32 * SLOT).with_backing(BackingChoice::Plain)).unwrap();
    let rounds = 2_000u64;
    std::thread::scope(|s| {
        for t in 0..4u8 {
            let pool = &pool;
            s.spawn(move || {
                for r in 0..rounds {
                    let Some(slot) = pool.alloc() else { continue };
                    let ctl = kvtier::internals::control(pool);
                    let g = ctl.reserve(slot);
                    let tag = t.wrapping_mul(61) ^ r as u8;
                    // SAFETY: reserve succeeded, so this thread owns the slot's bytes.
                    let bytes = unsafe { std::slice::from_raw_parts_mut(pool.slot_ptr(slot), SLOT as usize) };
                    bytes.fill(tag);
                    ctl.commit(slot, g);
                    assert_eq!(ctl.pin(slot, g), Ok(1));
                    assert!(bytes.iter().all(|&b| b == tag), "slot {} overwritten while owned", slot.get());
                    assert_eq!(ctl.unpin(slot), 0);
                    assert_eq!(ctl.begin_evict(slot), Some(g));
                    assert_eq!(ctl.release(slot), g + 1);
                    pool.free(slot);
                }
            });
        }
    });
    assert_eq!(pool.free_count(), 32);
    let mut gens = 0;
    for s in 0..32 {
        let w = kvtier::internals::control(&pool).load(SlotId::new(s));
        assert_eq!(w.state(), SlotState::Free);
        gens += w.generation();
    }
    // Every round that got a slot bumped exactly one generation; with 32 slots and at most 4 held at
    // once, every alloc succeeds.
    assert_eq!(gens, 4 * rounds);
}
