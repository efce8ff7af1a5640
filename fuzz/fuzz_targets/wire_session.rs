//! One daemon session driven by requests decoded from raw bytes (postcard, back to back), against a
//! small in-process tier, as a connection that said hello would run them (the daemon's own
//! `Session`, its bounds, its per-request `catch_unwind`): no request panics, and once the session
//! ends (its process taken as gone) the tier's audit balances with nothing left over: no `WRITING`
//! or `EVICTING` slot, no pin, no lease, no hint.
#![no_main]

use kvtier::internals::drive_session;
use kvtier::Limits;
use kvtier::{ArenaSpec, BackingChoice, Geometry, HostTier, PolicyKind, PoolConfig, TierConfig};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&b, rest)) = data.split_first() else { return };
    // The first byte picks the policy and the capacity (2 to 9 slots).
    let policy = PolicyKind::ALL[(b >> 4) as usize % PolicyKind::ALL.len()];
    let slots = 2 + u64::from(b % 8);
    let g = Geometry::new("fuzz", 16, vec![ArenaSpec::packed("a", 64, 1)]).unwrap();
    let bytes = slots * g.slot_bytes();
    let cfg = TierConfig::new(g, bytes)
        .with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain))
        .with_policy(policy);
    let tier = HostTier::new_shared(cfg).unwrap();
    let limits = Limits {
        keys_per_request: 64,
        hints_per_connection: 4,
        hint_keys_per_connection: 64,
        leases_per_connection: 8,
        copies_per_connection: 8,
        lease_uses: 8,
        ..Limits::default()
    };
    if let Err(e) = drive_session(tier.clone(), limits, rest) {
        panic!("{e}");
    }
    let a = kvtier::internals::core(&tier).audit(&[]).unwrap_or_else(|e| panic!("the audit fails: {e}"));
    assert_eq!((a.writing, a.evicting, a.pinned), (0, 0, 0), "left over after the session: {a:?}");
    assert_eq!(a.free + a.ready, tier.capacity() as usize, "{a:?}");
    let s = tier.stats();
    assert_eq!((s.live_leases, s.quarantined_slots), (0, 0), "{s:?}");
    assert_eq!(tier.live_hints(), 0);
});
