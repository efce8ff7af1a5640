//! Peers: blocks fetched from another kvtier instance's host pool (prefill/decode disaggregation,
//! cluster-wide prefix hits). See `docs/design.md`, section "Peers".
//!
//! - `transport`: [`PeerTransport`], the byte mover; `nixl` (feature `nixl`): its one production
//!   implementation, NIXL. This module never moves block bytes itself.
//! - `proto`: the control protocol over TCP (hello, query, validate, release): length-prefixed
//!   postcard frames in the tier daemon's style, with a magic, a version and limits.
//! - `server`: [`PeerServer`], the owner's side: pins the longest ready prefix of a query under a
//!   lease with a time-to-live and answers each block's byte offset and generation; `pins`: its
//!   table of peer leases and holds with a count of what they pin (the pin budget).
//! - `client` and `fetch`: [`PeerClient`], the reader's side: the local prefix first, then the
//!   missing suffix reserved `WRITING` locally, read in one transport batch, validated with the
//!   owner, and only the leading run of validated blocks published (pinned for the local lease).
//!
//! A block fetched from a peer is served only if, after the bytes arrived, the owner confirmed
//! that its slot still held that key at that generation under a live lease (the lease pinned it,
//! so the bytes read are the key's). Anything else is dropped before any query can see it.

pub(crate) mod auth;
mod client;
mod fetch;
#[cfg(feature = "metrics")]
mod metrics;
mod pins;
pub(crate) mod proto;
mod server;
mod set;
mod transport;

#[cfg(all(feature = "nixl", not(loom)))]
pub(crate) mod nixl;

pub use auth::PeerSecret;
pub use client::{PeerClient, PeerFetch};
pub use server::{PeerLimits, PeerServer, PeerServerStats};
pub use set::{PeerSet, PeerSetFetch};
pub use transport::{BlockRead, PeerTransport, ReadDone, TransportError, TransportPeer};

/// Locks `m`, recovering from poisoning: the peer tables stay consistent across a panic in any
/// one connection's handler (each update is a few map operations that cannot fail; the pin table
/// panics only on a broken invariant of its own). A `std` mutex in every build:
/// peers are network code, outside the loom models (whose `crate::sync` is loom's).
pub(crate) fn lock<T: ?Sized>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Why a peer operation failed. Every failure leaves the local tier as it was: no slot taken, no
/// key left `WRITING`, nothing published.
#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    /// The control connection could not be opened or the listener could not be bound.
    #[error("peer control connection to {addr}: {source}")]
    Connect {
        /// The address tried.
        addr: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The owner closed the control connection or crashed (its leases are released with it).
    #[error("the peer closed the control connection")]
    OwnerGone,
    /// The control connection failed (network loss, a reset, another I/O error).
    #[error("peer control connection failed: {0}")]
    Network(std::io::Error),
    /// The caller's deadline passed before the step finished (the owner's lease is released or
    /// expires; nothing was published).
    #[error("the peer fetch did not complete before its deadline")]
    Deadline,
    /// The handshake's proof of the shared secret failed: the owner refused this side's (another
    /// secret, or a secret on one side only), or the owner's own proof did not check (which).
    #[error("peer authentication failed: {0}")]
    Auth(String),
    /// A peer secret that cannot be used (its file unreadable, open to others, too short).
    #[error("{0}")]
    Secret(String),
    /// The peer speaks another version of the control protocol.
    #[error("the peer speaks peer protocol version {theirs}, this instance {ours}")]
    Version {
        /// This instance's protocol version.
        ours: u32,
        /// The peer's.
        theirs: u32,
    },
    /// The peer's tier has another namespace (another model, dtype or layout): its keys are
    /// another model's blocks.
    #[error("the peer's namespace {theirs} is not this tier's {ours}")]
    Namespace {
        /// This tier's namespace (hex).
        ours: String,
        /// The peer's (hex).
        theirs: String,
    },
    /// The peer's blocks have another size, bytes.
    #[error("the peer's blocks are {theirs} B, this tier's {ours} B")]
    BlockBytes {
        /// This tier's block bytes.
        ours: u64,
        /// The peer's.
        theirs: u64,
    },
    /// The peer refused a request (a limit, an unknown lease); its reason.
    #[error("the peer refused: {0}")]
    Refused(String),
    /// The peer answered something the protocol does not allow (a frame that does not decode, a
    /// reply to another request, keys it was not asked for).
    #[error("peer protocol violation: {0}")]
    Protocol(String),
    /// The byte mover failed (the owner went away mid-read, its deadline, a range).
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The tier is a connected tier (`HostTier::connect`): peers serve and fetch in-process pools
    /// only.
    #[error("peers need an in-process tier (this one is connected to a tier daemon)")]
    NotInProcess,
    /// As many fetches from this peer as [`PeerSet`] allows (16) are in flight: the query went
    /// on without it.
    #[error("{in_flight} fetches from the peer {addr} are in flight already")]
    Busy {
        /// The peer's address.
        addr: String,
        /// Fetches in flight.
        in_flight: usize,
    },
    /// The peer failed recently and is not asked again before its pause ends ([`PeerSet`]
    /// pauses a failed peer 200 ms, doubling up to 5 s, until it answers again).
    #[error("the peer {addr} failed recently: not asked for another {for_ms} ms")]
    Paused {
        /// The peer's address.
        addr: String,
        /// Milliseconds left of the pause.
        for_ms: u64,
    },
    /// A configuration value out of range (which and why).
    #[error("invalid peer configuration: {0}")]
    Config(String),
}

impl PeerError {
    /// Maps an I/O error of the control connection: timeouts are the deadline, end of stream and
    /// resets are the owner gone.
    pub(crate) fn from_io(e: std::io::Error) -> PeerError {
        use std::io::ErrorKind as K;
        match e.kind() {
            K::TimedOut | K::WouldBlock => PeerError::Deadline,
            K::UnexpectedEof | K::ConnectionReset | K::ConnectionAborted | K::BrokenPipe => PeerError::OwnerGone,
            K::InvalidData => PeerError::Protocol(e.to_string()),
            _ => PeerError::Network(e),
        }
    }
}

/// A NIXL agent name that no other instance has: `{prefix}-{host}-{pid}-{random}` (a daemon that
/// is PID 1 in its container has the same PID on every host, and a host name may repeat too; 64
/// random bits do not). A peer's agent name is how NIXL tells loaded peers apart.
pub fn unique_agent_name(prefix: &str) -> String {
    let pid = std::process::id();
    // Seeded bug (tests only): `nixl-agent-name-pid-only` names agents by PID alone.
    if crate::seeded::seeded("nixl-agent-name-pid-only") {
        return format!("{prefix}-{pid}");
    }
    let mut host = [0u8; 64];
    // SAFETY: `host` is a writable buffer of the length passed; gethostname writes at most that
    // many bytes into it.
    let ok = unsafe { libc::gethostname(host.as_mut_ptr().cast(), host.len()) } == 0;
    let host = if ok {
        let end = host.iter().position(|&b| b == 0).unwrap_or(host.len());
        String::from_utf8_lossy(&host[..end]).into_owned()
    } else {
        "host".to_string()
    };
    let mut r = [0u8; 8];
    if getrandom::fill(&mut r).is_err() {
        // No randomness (never on Linux once booted): the clock's nanoseconds instead.
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        r = (t.as_nanos() as u64).to_le_bytes();
    }
    format!("{prefix}-{host}-{pid}-{:016x}", u64::from_le_bytes(r))
}

/// Hex of a namespace's 16 bytes (for messages).
pub(crate) fn namespace_hex(ns: &crate::key::Namespace) -> String {
    ns.0.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn two_agent_names_of_one_process_differ() {
        let (a, b) = (super::unique_agent_name("kvtierd"), super::unique_agent_name("kvtierd"));
        assert_ne!(a, b, "agent names must be unique even for one PID on one host");
        assert!(a.starts_with("kvtierd-") && a.contains(&std::process::id().to_string()), "{a}");
    }
}
