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
    /// completed, or an error: the peer went away, `deadline` passed, or a read was out of either
    /// pool's range. Returns by `deadline` whatever the transfer does.
    ///
    /// `done` tells the caller when no byte of this transfer can land any more: the transport
    /// drops it (or calls [`ReadDone::over`]) once the transfer is over: completed, failed, or
    /// released in a way after which the backend writes nothing more. On `Ok` it must be over.
    /// After an error whose transfer may still be writing the destination (a deadline that passed
    /// mid-transfer, where a cancel is not synchronous), the transport keeps `done` until it
    /// knows, and the caller keeps the destination slots quarantined until then; a transport
    /// that never knows keeps it for good (the slots stay withheld: never a wrong byte).
    fn read_tracked(
        &self,
        peer: TransportPeer,
        reads: &[BlockRead],
        deadline: Instant,
        done: ReadDone,
    ) -> Result<(), TransportError>;

    /// [`PeerTransport::read_tracked`] for a caller that does not reuse the destination after an
    /// error (a benchmark, a test).
    fn read(&self, peer: TransportPeer, reads: &[BlockRead], deadline: Instant) -> Result<(), TransportError> {
        self.read_tracked(peer, reads, deadline, ReadDone::none())
    }
}

/// Told when a read's transfer is over ([`PeerTransport::read_tracked`]): dropping it (or
/// [`ReadDone::over`]) says no byte of that transfer lands any more.
#[must_use = "dropping a ReadDone says the transfer is over"]
pub struct ReadDone(Option<Box<dyn FnOnce() + Send>>);

impl ReadDone {
    /// A `ReadDone` that runs `f` when the transfer is over.
    pub fn new(f: impl FnOnce() + Send + 'static) -> ReadDone {
        ReadDone(Some(Box::new(f)))
    }

    /// A `ReadDone` nobody waits for.
    pub fn none() -> ReadDone {
        ReadDone(None)
    }

    /// Says the transfer is over (the same as dropping it).
    pub fn over(self) {}
}

impl std::fmt::Debug for ReadDone {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("ReadDone").field(&self.0.is_some()).finish()
    }
}

impl Drop for ReadDone {
    fn drop(&mut self) {
        if let Some(f) = self.0.take() {
            f();
        }
    }
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
