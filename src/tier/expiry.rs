//! [`LeaseClock`]: lease time-to-live ([`crate::TierConfig::lease_ttl`]). Unsettled leases are kept
//! in creation order; those older than the TTL are settled by the tier (their pins dropped; restores
//! already submitted keep their own). Only active when a TTL is configured: without one, a query
//! pays nothing here.

use super::core::Core;
use crate::lease::{LeaseState, Settled};
use crate::sync::{Arc, Mutex};
use std::collections::VecDeque;
use std::time::{Duration, Instant};

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

    /// Settles every lease older than the TTL; returns how many this call settled.
    pub(crate) fn expire_due(&self, core: &Core) -> usize {
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
            if now.saturating_duration_since(*created) < ttl && !cfg!(kvtier_seeded_bug = "lease-expiry-ignores-age") {
                break;
            }
            if lease.settle(core, Settled::Expired) {
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

impl Core {
    /// Settles every lease older than the tier's lease TTL (none without one); returns how many.
    pub fn expire_leases(&self) -> usize {
        self.leases.expire_due(self)
    }
}
