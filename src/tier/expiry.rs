//! A lease's settle state ([`LeaseState`]: its blocks, uses, how it settled) and the
//! [`LeaseClock`]: lease time-to-live ([`crate::TierConfig::lease_ttl`]). Unsettled leases are kept
//! in creation order; those older than the TTL are settled by the tier (their pins dropped; restores
//! already submitted keep their own). Only active when a TTL is configured: without one, a query
//! pays nothing here.

use super::stats::{add, sub, Counters};
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::slab::slot::{SlotControl, SlotId};
use crate::sync::{Arc, AtomicU64, AtomicU8, Mutex, Ordering};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// One leased block.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct LeasedBlock {
    /// The block's content key.
    pub key: ContentKey,
    /// Where it lives (pinned while the lease is unsettled).
    pub slot: SlotRef,
}

/// How a lease settled (the `settled` byte of [`LeaseState`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum Settled {
    Live = 0,
    Consumed = 1,
    Released = 2,
    Dropped = 3,
    Expired = 4,
}

impl Settled {
    fn from_u8(v: u8) -> Settled {
        match v {
            0 => Settled::Live,
            1 => Settled::Consumed,
            2 => Settled::Released,
            3 => Settled::Dropped,
            _ => Settled::Expired,
        }
    }
}

/// The part of a lease the tier's expiry clock may hold too: its blocks, uses and settle state.
/// It holds no reference to the tier (the clock lives inside it): settling is given the slot
/// words and the counters it updates.
pub(crate) struct LeaseState {
    pub(crate) blocks: Vec<LeasedBlock>,
    /// `taken << 32 | left`: uses not taken yet (`left`), and uses taken by restores whose copy
    /// is not submitted yet (`taken`; such a use may come back). The lease is consumed when both
    /// reach 0, so a use given back always finds the lease unsettled (unless it was released,
    /// dropped or expired, which no use can undo).
    pub(crate) uses: AtomicU64,
    pub(crate) settled: AtomicU8,
}

/// One taken use in [`LeaseState::uses`].
pub(crate) const TAKEN: u64 = 1 << 32;

pub(crate) fn uses_word(left: u32) -> AtomicU64 {
    AtomicU64::new(left as u64)
}

impl LeaseState {
    /// Settles the lease as `how` if nobody has, dropping its pins; returns true if this call
    /// settled it. The CAS is what makes settling exactly-once under races.
    pub(crate) fn settle(&self, control: &SlotControl, counters: &Counters, how: Settled) -> bool {
        let first = if crate::seeded::seeded("lease-double-settle") {
            // Seeded bug (model checking only): check-then-act instead of one CAS.
            self.settled.load(Ordering::Acquire) == Settled::Live as u8 && {
                self.settled.store(how as u8, Ordering::Release);
                true
            }
        } else {
            self.settled.compare_exchange(Settled::Live as u8, how as u8, Ordering::AcqRel, Ordering::Acquire).is_ok()
        };
        if first {
            for b in &self.blocks {
                unpin(control, counters, b.slot.slot);
            }
            sub(&counters.live_leases, 1);
            if how == Settled::Expired {
                add(&counters.expired_leases, 1);
            }
        }
        first
    }

    pub(crate) fn how(&self) -> Settled {
        Settled::from_u8(self.settled.load(Ordering::Acquire))
    }

    pub(crate) fn is_settled(&self) -> bool {
        self.how() != Settled::Live
    }
}

/// Drops one pin of `slot`, counting the slot as unpinned in `counters` when it was the last.
pub(crate) fn unpin(control: &SlotControl, counters: &Counters, slot: SlotId) {
    if control.unpin(slot) == 0 {
        sub(&counters.pinned_slots, 1);
    }
}

/// The unsettled leases of a tier, oldest first (see the module docs).
pub(crate) struct LeaseClock {
    ttl: Option<Duration>,
    live: Mutex<VecDeque<(Instant, Arc<LeaseState>)>>,
}

impl LeaseClock {
    pub(crate) fn new(ttl: Option<Duration>) -> Self {
        LeaseClock { ttl, live: Mutex::new(VecDeque::new()) }
    }

    /// Tracks a new unsettled lease (only with a TTL).
    pub(crate) fn register(&self, lease: &Arc<LeaseState>) {
        if self.ttl.is_none() {
            return;
        }
        let mut q = crate::sync::lock(&self.live);
        q.push_back((Instant::now(), lease.clone()));
        // Settled leases stay queued until they reach the front; drop them in bulk once they
        // outnumber the live ones, so the queue stays within twice the live leases.
        if q.len() >= 64 && q.len().is_power_of_two() {
            q.retain(|(_, l)| !l.is_settled());
        }
    }

    /// Settles every lease older than the TTL, dropping their pins on `control` and counting in
    /// `counters`; returns how many this call settled.
    pub(crate) fn expire_due(&self, control: &SlotControl, counters: &Counters) -> usize {
        let Some(ttl) = self.ttl else { return 0 };
        let now = Instant::now();
        let mut expired = 0;
        let mut q = crate::sync::lock(&self.live);
        while let Some((created, lease)) = q.front() {
            if lease.is_settled() {
                q.pop_front();
                continue;
            }
            // Seeded bug (tests only): `lease-expiry-ignores-age` expires leases of any age.
            if now.saturating_duration_since(*created) < ttl && !crate::seeded::seeded("lease-expiry-ignores-age") {
                break;
            }
            if lease.settle(control, counters, Settled::Expired) {
                expired += 1;
            }
            q.pop_front();
        }
        expired
    }

    /// Age of the oldest unsettled lease (only tracked with a TTL).
    pub(crate) fn oldest_age(&self) -> Option<Duration> {
        self.ttl?;
        let mut q = crate::sync::lock(&self.live);
        while q.front().is_some_and(|(_, l)| l.is_settled()) {
            q.pop_front();
        }
        q.front().map(|(created, _)| created.elapsed())
    }
}
