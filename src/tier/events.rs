//! The event log: what the tier stored and removed, in order, for an owner that announces it
//! (the tier daemon's `--kv-events` publisher, which sends it to routers in vLLM's
//! `KVEventBatch` format).
//!
//! Enabled by [`crate::TierConfig::events`] (off by default: a tier nobody reads pays nothing).
//! The core records a [`TierEvent::Stored`] when a block becomes `READY` (a save's commit, or a
//! promotion from the SSD tier or a peer) and a [`TierEvent::Removed`] when eviction releases it;
//! the SSD tier records its own when a demotion lands on disk and when it evicts a disk block.
//! The owner empties the log with [`crate::HostTier::take_events`]. The log holds at most its
//! capacity of events: past that, events are dropped and counted (the subscriber then misses some:
//! a router's view is a hint, never what the tier serves).
//!
//! Order: events of one block are in the order of its life (a block is stored before it is
//! removed: its commit records before `READY` is published, and only a `READY` block is evicted);
//! events of different blocks are in the order their recording took the log's lock.

use crate::key::ContentKey;
use crate::sync::{AtomicU64, Mutex, Ordering};

/// Where a block of a [`TierEvent`] is held.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum EventMedium {
    /// The pinned host pool (vLLM's medium `CPU`).
    Host,
    /// The SSD tier under the pool (vLLM's medium `STORAGE`).
    Disk,
}

impl EventMedium {
    /// The medium's name in vLLM's KV events: `CPU` or `STORAGE`.
    pub fn vllm_name(self) -> &'static str {
        match self {
            EventMedium::Host => "CPU",
            EventMedium::Disk => "STORAGE",
        }
    }
}

/// One entry of the event log ([`crate::HostTier::take_events`]).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum TierEvent {
    /// The block of `key` became resident in `medium` (servable from there).
    Stored {
        /// The block's content key.
        key: ContentKey,
        /// Where.
        medium: EventMedium,
    },
    /// The block of `key` left `medium` (evicted).
    Removed {
        /// The block's content key.
        key: ContentKey,
        /// Where from.
        medium: EventMedium,
    },
}

/// The log itself: a bounded vector behind a lock (one push per committed or evicted block).
pub(crate) struct EventLog {
    events: Mutex<Vec<TierEvent>>,
    capacity: usize,
    lost: AtomicU64,
}

impl EventLog {
    pub(crate) fn new(capacity: usize) -> Self {
        EventLog { events: Mutex::new(Vec::new()), capacity: capacity.max(1), lost: AtomicU64::new(0) }
    }

    /// Records `event` (dropped and counted as lost when the log is full).
    pub(crate) fn push(&self, event: TierEvent) {
        // Seeded bug (tests only): `events-removals-lost` never records an eviction.
        if crate::seeded::seeded("events-removals-lost") && matches!(event, TierEvent::Removed { .. }) {
            return;
        }
        let mut events = crate::sync::lock(&self.events);
        if events.len() < self.capacity {
            events.push(event);
        } else {
            self.lost.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Moves every recorded event to `out`, oldest first; returns the events dropped so far
    /// because the log was full.
    pub(crate) fn take(&self, out: &mut Vec<TierEvent>) -> u64 {
        out.append(&mut crate::sync::lock(&self.events));
        self.lost.load(Ordering::Relaxed)
    }
}

impl std::fmt::Debug for EventLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventLog").field("capacity", &self.capacity).finish_non_exhaustive()
    }
}
