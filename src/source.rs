//! [`BlockSource`]: where a leased block came from. A leaf module: leases, the daemon's protocol
//! and its client all name it.

/// Where a leased block came from ([`crate::Lease::source`]). With feature `remote` it crosses the tier
/// daemon's protocol in this variant order (a reordering is a protocol version bump).
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum BlockSource {
    /// Resident in this instance's host pool when the lease was taken.
    Host,
    /// Read from the SSD tier into a host slot by the lease's query (a promotion).
    Ssd,
    /// Read from a peer instance's host pool into a host slot, its generation validated with the
    /// owner (a peer fetch, feature `peers`).
    Peer,
}
