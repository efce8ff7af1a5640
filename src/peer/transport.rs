//! The byte mover under peer fetches: a trait, so the control protocol and the generation check
//! (src/peer/) do not depend on how bytes cross between instances. The one production
//! implementation is NIXL (`src/peer/nixl.rs`, feature `nixl`); kvtier has no transport of its own.

use std::time::Instant;

/// One read of a whole block slot: `len` bytes at `remote_offset` in the peer's registered host
/// pool into `local_offset` in this instance's host pool (offsets in bytes from each pool's base).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct BlockRead {
    /// Byte offset of the block in the peer's pool.
    pub remote_offset: u64,
    /// Byte offset of the destination slot in this instance's pool.
    pub local_offset: u64,
    /// Bytes to read (the geometry's block bytes).
    pub len: u64,
}

/// A peer the transport has loaded (from its descriptor); valid until [`PeerTransport::remove_peer`].
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct TransportPeer(pub u64);

/// Moves whole blocks from a peer's registered host pool into this instance's pool.
pub trait PeerTransport: Send + Sync + 'static {
    /// What a peer needs to read from this instance's pool (for NIXL: the agent's metadata and the
    /// registered region's base and length), sent to peers in the control connection's hello.
    fn local_descriptor(&self) -> Result<Vec<u8>, TransportError>;
    /// Loads a peer from the descriptor it sent.
    fn add_peer(&self, descriptor: &[u8]) -> Result<TransportPeer, TransportError>;
    /// Forgets a peer loaded by [`add_peer`](Self::add_peer).
    fn remove_peer(&self, peer: TransportPeer);
    /// Performs every read of `reads` as one batch (one NIXL READ request) and returns once all
    /// completed, or an error: the peer went away, `deadline` passed (the reads are cancelled and
    /// the local bytes are unspecified), or a read was out of either pool's range.
    fn read(&self, peer: TransportPeer, reads: &[BlockRead], deadline: Instant) -> Result<(), TransportError>;
}

/// Why a transport operation failed.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The peer disconnected or crashed (NIXL: `NIXL_ERR_REMOTE_DISCONNECT`).
    #[error("the peer disconnected")]
    Disconnected,
    /// The deadline passed before every read completed.
    #[error("the transfer did not complete before its deadline")]
    Deadline,
    /// A read lies outside a pool: which side and the offending range.
    #[error("read out of range: {0}")]
    OutOfRange(String),
    /// A descriptor that does not parse, or that this transport cannot load.
    #[error("bad peer descriptor: {0}")]
    Descriptor(String),
    /// Any other failure the backend reported (its status and message).
    #[error("transport failure: {0}")]
    Backend(String),
}
