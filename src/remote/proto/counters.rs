//! The counters on the wire: the audit's slot counts ([`WireAudit`]), the tier's and the SSD
//! tier's counters ([`WireStats`], [`WireSsdStats`]) and a client process's ([`WireClient`]).

use serde::{Deserialize, Serialize};

/// The audit's slot counts.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireAudit {
    /// `FREE` slots.
    pub free: u64,
    /// `WRITING` slots.
    pub writing: u64,
    /// `READY` slots.
    pub ready: u64,
    /// `EVICTING` slots.
    pub evicting: u64,
    /// Pinned slots.
    pub pinned: u64,
}

/// [`crate::TierStats`] on the wire, field for field.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct WireStats {
    pub queries: u64,
    pub hit_blocks: u64,
    pub miss_blocks: u64,
    pub saved_blocks: u64,
    pub save_skipped_resident: u64,
    pub save_skipped_in_flight: u64,
    pub save_skipped_duplicate: u64,
    pub save_dropped: u64,
    pub saves_refused: u64,
    pub save_failed_blocks: u64,
    pub restored_blocks: u64,
    pub restore_failed_blocks: u64,
    pub evictions: u64,
    pub explicit_evictions: u64,
    pub bytes_saved: u64,
    pub bytes_restored: u64,
    pub expired_leases: u64,
    pub live_leases: u64,
    pub oldest_lease_age_ms: u64,
    pub quarantined_slots: u64,
    pub pinned_slots: u64,
    pub ready_slots: u64,
    pub writing_slots: u64,
    pub evicting_slots: u64,
    pub free_slots: u64,
    pub capacity: u64,
    pub index_entries: u64,
    pub quarantined_pins: u64,
}

/// [`crate::SsdStats`] on the wire, field for field (the conversions live beside the client's
/// other wire types, in `tier::connected`, so this module names nothing of the tier).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct WireSsdStats {
    pub capacity: u64,
    pub blocks: u64,
    pub recovered_blocks: u64,
    pub recovered_torn: u64,
    pub recovered_foreign: u64,
    pub demoted_blocks: u64,
    pub bytes_demoted: u64,
    pub demotions_skipped: u64,
    pub demotions_dropped: u64,
    pub demotion_failures: u64,
    pub demotions_pending: u64,
    pub promoted_blocks: u64,
    pub bytes_promoted: u64,
    pub promotion_failures: u64,
    pub disk_evictions: u64,
    pub io_direct: u64,
    pub io_buffered: u64,
}

/// [`crate::ClientStats`] on the wire, field for field: one client process's sessions.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub struct WireClient {
    pub pid: Option<u32>,
    pub sessions: u64,
    pub connected_ms: u64,
    pub lease_handles: u64,
    pub leased_blocks: u64,
    pub hints: u64,
    pub copies_in_flight: u64,
    pub queries: u64,
    pub hit_blocks: u64,
    pub miss_blocks: u64,
    pub saved_blocks: u64,
    pub bytes_saved: u64,
    pub restored_blocks: u64,
    pub bytes_restored: u64,
    pub hints_given: u64,
    pub refused: u64,
}
