//! Peer fetches: blocks read from another instance's host pool. `transport` is the byte mover's
//! trait; `nixl` (feature `nixl`) its NIXL implementation.

pub(crate) mod transport;

#[cfg(feature = "nixl")]
pub(crate) mod nixl;
