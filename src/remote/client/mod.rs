//! The client side of the tier daemon's protocol, in wire terms: the connection ([`Conn`]), the
//! daemon's leases as handles ([`RemoteLease`], [`LeaseToken`]), and the connect handshake. The
//! connected tier that an engine sees (`crate::tier::connected`) builds its tickets, leases and
//! handles from these; nothing here knows the in-process tier.
//!
//! [`crate::HostTier::connect`] opens a Unix socket to `kvtierd`, receives the pool's memfd and
//! maps it; the returned tier has the same API as an in-process one. Its ranks run their copies in this
//! process, on this process's mapping of the pool, with their own backend; every state change
//! (lease, pin, reservation, commit, eviction) is one message to the daemon, batched per call:
//!
//! | call | messages |
//! |---|---|
//! | `query` / `query_shared` | one round trip |
//! | `Rank::save` | one round trip (plan, fit, evict, reserve), then one to finish the batch |
//! | `Rank::restore` | one round trip (pins and a use), a one-way "submitted", one to finish |
//!
//! One connection serves every thread of the process; calls take turns on it. A lost connection
//! (the daemon stopped or restarted) fails every later call with [`TierError::Disconnected`](crate::TierError::Disconnected);
//! connect again to go on.

mod connection;
mod handshake;
mod lease;
#[cfg(all(test, not(loom)))]
mod tests;

pub(crate) use connection::{lost, unexpected, Conn};
pub use handshake::ConnectOptions;
pub(crate) use handshake::{connect, Connected};
pub use lease::LeaseToken;
pub(crate) use lease::{PreparedSave, RemoteLease};
