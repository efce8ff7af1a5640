//! The owner's pin table: the peer leases and holds a [`super::PeerServer`] keeps, and a count of
//! what they pin, under one lock (the server's `Shared::table`).

use crate::tier::lease::Lease;
use std::collections::HashMap;
use std::time::Instant;

/// A lease the owner holds for a peer: the tier lease (its pins), the connection that holds it,
/// and when it expires.
pub(super) struct OwnerLease {
    pub(super) conn: u64,
    pub(super) lease: Lease,
    pub(super) expires: Instant,
}

/// A block kept pinned for a peer to fetch ([`PeerServer::hold`]): its own one-block lease and
/// when the hold ends.
pub(super) struct Hold {
    /// Held for its pin (dropping it settles).
    pub(super) _pins: Lease,
    pub(super) expires: Instant,
}

/// The owner's peer leases and holds, and what they pin, under one lock (the server's
/// `Shared::table`): every insertion and removal goes through its methods, which keep `pins` and `per_conn` exact,
/// so the pin budget and the per-connection limit cost O(keys asked), not O(pinned).
#[derive(Default)]
pub(super) struct PinTable {
    pub(super) leases: HashMap<u64, OwnerLease>,
    pub(super) holds: HashMap<crate::ContentKey, Hold>,
    /// Per key, how many peer leases and holds pin it (only counts above 0): `pins.len()` is the
    /// number of distinct blocks peers pin.
    pub(super) pins: HashMap<crate::ContentKey, u32>,
    /// Peer leases per connection (only counts above 0).
    per_conn: HashMap<u64, u32>,
}

/// Takes one from `key`'s count in `counts`, removing the entry at zero (so `len()` counts the
/// keys above zero). False if `key` had no count.
fn decrement<K: std::hash::Hash + Eq>(counts: &mut HashMap<K, u32>, key: &K) -> bool {
    match counts.get_mut(key) {
        Some(n) if *n > 1 => *n -= 1,
        Some(_) => {
            counts.remove(key);
        }
        None => return false,
    }
    true
}

impl PinTable {
    fn pin(&mut self, key: crate::ContentKey) {
        *self.pins.entry(key).or_insert(0) += 1;
    }

    fn unpin(&mut self, key: &crate::ContentKey) {
        assert!(decrement(&mut self.pins, key), "a peer lease or hold unpinned a key the pin table does not count");
    }

    pub(super) fn insert_lease(&mut self, id: u64, lease: OwnerLease) {
        for b in lease.lease.blocks() {
            self.pin(b.key);
        }
        *self.per_conn.entry(lease.conn).or_insert(0) += 1;
        let old = self.leases.insert(id, lease);
        assert!(old.is_none(), "peer lease id {id} given twice");
    }

    /// Removes lease `id` and its pins; the caller drops the lease outside the lock (settling
    /// unpins the tier's slots).
    pub(super) fn remove_lease(&mut self, id: u64) -> Option<OwnerLease> {
        let lease = self.leases.remove(&id)?;
        // Seeded bug (tests only): `peer-pins-never-returned` keeps a removed lease's blocks in
        // the pin budget.
        if !crate::seeded::seeded("peer-pins-never-returned") {
            for b in lease.lease.blocks() {
                self.unpin(&b.key);
            }
        }
        assert!(
            decrement(&mut self.per_conn, &lease.conn),
            "a peer lease of a connection the pin table does not count"
        );
        Some(lease)
    }

    /// Holds `key` (replacing an earlier hold of it, returned for the caller to drop).
    pub(super) fn insert_hold(&mut self, key: crate::ContentKey, hold: Hold) -> Option<Hold> {
        let old = self.holds.insert(key, hold);
        if old.is_none() {
            self.pin(key);
        }
        old
    }

    pub(super) fn remove_hold(&mut self, key: &crate::ContentKey) -> Option<Hold> {
        let hold = self.holds.remove(key)?;
        self.unpin(key);
        Some(hold)
    }

    /// Counts each distinct key of `keys` as pinned (a query's or a hold's keys while the tier is
    /// queried without the lock: they are in the pin budget from the check on) and returns them,
    /// for [`PinTable::unreserve`] once the lease is filed.
    pub(super) fn reserve(&mut self, keys: &[crate::ContentKey]) -> Vec<crate::ContentKey> {
        let mut seen = std::collections::HashSet::with_capacity(keys.len());
        let distinct: Vec<crate::ContentKey> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
        for k in &distinct {
            self.pin(*k);
        }
        distinct
    }

    /// Takes back the counts of [`PinTable::reserve`].
    pub(super) fn unreserve(&mut self, reserved: &[crate::ContentKey]) {
        for k in reserved {
            self.unpin(k);
        }
    }

    pub(super) fn leases_of(&self, conn: u64) -> usize {
        self.per_conn.get(&conn).map_or(0, |&n| n as usize)
    }
}
