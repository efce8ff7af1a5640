//! The tier daemon's wire protocol: versioned, batched, binary.
//!
//! A connection is a Unix stream socket. Every message is one **frame**: a 4-byte little-endian
//! payload length, then the payload, a [`Request`] or a [`Reply`] encoded with `postcard` (serde's
//! compact varint format). A frame is at most [`MAX_FRAME`] bytes; a daemon may set a smaller bound
//! (its [`WireLimits::frame_bytes`], sent in the welcome). A reader never allocates a frame's
//! announced length up front: the buffer grows by at most [`READ_CHUNK`] bytes ahead of the bytes
//! that have arrived, so a length prefix alone costs nothing.
//!
//! The client speaks first: [`Request::Hello`] with [`MAGIC`], [`PROTOCOL_VERSION`] and, optionally,
//! the namespace it expects. The daemon answers with one **marker byte** sent with `sendmsg`:
//! [`MARKER_POOL`] carries the pool's memfd as `SCM_RIGHTS` ancillary data, [`MARKER_REFUSED`]
//! carries nothing; then the [`Reply`] frame ([`Reply::Welcome`] or [`Reply::Error`]).
//!
//! After the hello every [`Request`] gets exactly one [`Reply`], in order, except the one-way
//! messages ([`Request::is_one_way`]), which get none. Everything is batched: one round trip per
//! query or save batch, never per page. Bump [`PROTOCOL_VERSION`] with any change to these types
//! (or to [`WireStats`] and [`WireSsdStats`]).

use crate::error::TierError;
use crate::key::{ContentKey, Namespace};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};

/// The first four bytes of a hello.
pub const MAGIC: [u8; 4] = *b"KVTD";
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 8;
/// Largest frame payload, in bytes (a 1M-key query is 16 MB).
pub const MAX_FRAME: usize = 64 << 20;
/// The most a frame reader grows its buffer ahead of the bytes that have arrived.
pub const READ_CHUNK: usize = 64 << 10;
/// Largest hello frame payload the daemon reads, in bytes (a hello is about 30 B).
pub const MAX_HELLO: usize = 4096;
/// Marker byte before a welcome: the pool's memfd rides with it.
pub const MARKER_POOL: u8 = b'F';
/// Marker byte before a refusal: no fd.
pub const MARKER_REFUSED: u8 = b'E';

/// How a copy ended, as the rank that ran it reports it.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    /// The copy completed.
    Done,
    /// The copy failed; it is over.
    Failed,
    /// The copy's backend panicked while waiting: the copy may still be running in that process.
    Unknown,
    /// The copy was never submitted (the backend refused it).
    NotSubmitted,
    /// The backend panicked while submitting the copy: it may have queued it, so the slots (a
    /// save's) or pins (a restore's) are withheld as for [`Outcome::Unknown`], but the call
    /// failed, so a restore's lease use comes back as for [`Outcome::NotSubmitted`].
    SubmitPanicked,
}

/// A client's message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    /// The first message: [`MAGIC`], [`PROTOCOL_VERSION`], and the namespace the client expects
    /// (`None`: adopt the daemon's geometry).
    Hello {
        /// [`MAGIC`].
        magic: [u8; 4],
        /// [`PROTOCOL_VERSION`].
        version: u32,
        /// The expected namespace.
        namespace: Option<Namespace>,
    },
    /// A rank attaches: its id. -> [`Reply::Attached`].
    Attach,
    /// Lease the longest ready prefix of `keys` with `uses` restores. -> [`Reply::Leased`].
    Query {
        /// Keys, in prompt order.
        keys: Vec<ContentKey>,
        /// Restores the lease allows.
        uses: u32,
    },
    /// Take a handle on a lease another connection made (its token). -> [`Reply::Leased`].
    OpenLease {
        /// The daemon run the token names ([`Welcome::instance`]); another run's token is refused
        /// ([`WireError::ForeignLease`]).
        instance: u64,
        /// The lease.
        lease: u64,
    },
    /// The lease's state. -> [`Reply::LeaseInfo`].
    LeaseInfo {
        /// The lease.
        lease: u64,
    },
    /// Settle the lease now. -> [`Reply::Bool`] (true if this settled it).
    ReleaseLease {
        /// The lease.
        lease: u64,
    },
    /// One-way: this connection drops one handle on the lease (the lease settles when the last
    /// handle, of any connection, is gone).
    DropLease {
        /// The lease.
        lease: u64,
    },
    /// Use up one restore without copying (a zero-page restore). -> [`Reply::Done`].
    ConsumeUse {
        /// The lease.
        lease: u64,
    },
    /// Plan, fit, acquire and reserve a save. -> [`Reply::SavePrepared`].
    PrepareSave {
        /// Keys to save, in prompt order.
        keys: Vec<ContentKey>,
        /// `Fit::Prefix` instead of all-or-nothing.
        prefix: bool,
        /// Prompt depth of the first key.
        prefix_depth: Option<u32>,
        /// The key of the block before the first key in its prompt (chain-aware eviction).
        parent: Option<ContentKey>,
    },
    /// The save's copy ended: commit, abort or quarantine its slots. -> [`Reply::Done`].
    FinishSave {
        /// The save.
        save: u64,
        /// How its copy ended.
        outcome: Outcome,
        /// The copy's queue-to-completion time in nanoseconds, measured by the client, when the
        /// copy ended (`Done`, `Failed`); the daemon's copy latency histogram counts a `Done` one.
        latency_ns: Option<u64>,
    },
    /// Take the restore's pins on the lease's first `blocks` blocks, then one use. ->
    /// [`Reply::Restoring`].
    Restore {
        /// The lease.
        lease: u64,
        /// Blocks to restore (at least 1).
        blocks: u32,
    },
    /// One-way: the restore's copy was submitted (the lease settles if that was its last use).
    RestoreSubmitted {
        /// The restore.
        restore: u64,
    },
    /// The restore's copy ended (or was never submitted): its pins go (are kept, for
    /// [`Outcome::Unknown`] and [`Outcome::SubmitPanicked`], until the process is gone); its use
    /// is spent unless [`Outcome::NotSubmitted`] or [`Outcome::SubmitPanicked`]. One-way since
    /// version 8: the restored bytes are in place whatever the daemon answers, so the copy's handle
    /// completes without waiting a round trip; the connection's later requests are served after it.
    FinishRestore {
        /// The restore.
        restore: u64,
        /// How its copy ended.
        outcome: Outcome,
        /// As for [`Request::FinishSave`].
        latency_ns: Option<u64>,
    },
    /// Is `key` ready? -> [`Reply::Bool`].
    Contains {
        /// The key.
        key: ContentKey,
    },
    /// Evict up to `blocks` unpinned ready blocks. -> [`Reply::Count`].
    Evict {
        /// Blocks.
        blocks: u64,
    },
    /// Settle leases past their time-to-live. -> [`Reply::Count`].
    ExpireLeases,
    /// A scheduler hint on `keys` for `ttl_ms` milliseconds (`HostTier::hint`). -> [`Reply::Count`]
    /// (the hint's id).
    Hint {
        /// Keys the engine's waiting requests will look up.
        keys: Vec<ContentKey>,
        /// Time to live, in milliseconds.
        ttl_ms: u64,
    },
    /// Withdraw hint `id` (`HostTier::withdraw_hint`). -> [`Reply::Bool`].
    WithdrawHint {
        /// The hint's id.
        id: u64,
    },
    /// Hints live in the daemon's tier. -> [`Reply::Count`].
    LiveHints,
    /// The tier's counters. -> [`Reply::Stats`].
    Stats,
    /// The tier's structural audit over `keys` (tests, debugging). -> [`Reply::Audit`].
    Audit {
        /// Keys to check in the index.
        keys: Vec<ContentKey>,
    },
    /// Each connected client process's counters, the asking connection's own left out. ->
    /// [`Reply::Clients`].
    Clients,
    /// The daemon's SSD tier's counters. -> [`Reply::SsdStats`]. Added in version 7.
    SsdStats,
}

impl Request {
    /// True for messages that get no reply.
    pub fn is_one_way(&self) -> bool {
        matches!(self, Request::DropLease { .. } | Request::RestoreSubmitted { .. } | Request::FinishRestore { .. })
    }

    /// The request's name, for logs and [`WireError::Panicked`].
    pub fn name(&self) -> &'static str {
        match self {
            Request::Hello { .. } => "Hello",
            Request::Attach => "Attach",
            Request::Query { .. } => "Query",
            Request::OpenLease { .. } => "OpenLease",
            Request::LeaseInfo { .. } => "LeaseInfo",
            Request::ReleaseLease { .. } => "ReleaseLease",
            Request::DropLease { .. } => "DropLease",
            Request::ConsumeUse { .. } => "ConsumeUse",
            Request::PrepareSave { .. } => "PrepareSave",
            Request::FinishSave { .. } => "FinishSave",
            Request::Restore { .. } => "Restore",
            Request::RestoreSubmitted { .. } => "RestoreSubmitted",
            Request::FinishRestore { .. } => "FinishRestore",
            Request::Contains { .. } => "Contains",
            Request::Evict { .. } => "Evict",
            Request::ExpireLeases => "ExpireLeases",
            Request::Hint { .. } => "Hint",
            Request::WithdrawHint { .. } => "WithdrawHint",
            Request::LiveHints => "LiveHints",
            Request::Stats => "Stats",
            Request::Audit { .. } => "Audit",
            Request::Clients => "Clients",
            Request::SsdStats => "SsdStats",
        }
    }
}

/// The bounds a daemon holds every connection to (its `Limits`), as its welcome states them, so a
/// client can refuse an oversized request before sending it. A request over a bound is answered
/// [`WireError::LimitExceeded`] and does nothing.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireLimits {
    /// Largest request frame payload, bytes ([`crate::error::Limit::FrameBytes`]).
    pub frame_bytes: u64,
    /// Keys one query, save, hint or audit may name ([`crate::error::Limit::KeysPerRequest`]).
    pub keys_per_request: u64,
    /// Hints one connection holds at once ([`crate::error::Limit::HintsPerConnection`]).
    pub hints_per_connection: u64,
    /// Keys over one connection's live hints ([`crate::error::Limit::HintKeysPerConnection`]).
    pub hint_keys_per_connection: u64,
    /// Lease handles one connection holds at once ([`crate::error::Limit::LeasesPerConnection`]).
    pub leases_per_connection: u64,
    /// Saves and restores one connection has in flight (or withheld) at once
    /// ([`crate::error::Limit::CopiesPerConnection`]).
    pub copies_per_connection: u64,
    /// Uses one lease may have ([`crate::error::Limit::LeaseUses`]).
    pub lease_uses: u64,
    /// Connections the daemon serves at once ([`crate::error::Limit::Connections`]).
    pub connections: u64,
    /// Milliseconds a frame may take to arrive once its first byte has.
    pub frame_timeout_ms: u64,
    /// Milliseconds the daemon waits for a reply to be taken before it drops the connection.
    pub write_timeout_ms: u64,
}

/// One leased block.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireBlock {
    /// Its key.
    pub key: ContentKey,
    /// Its slot.
    pub slot: u32,
    /// The slot's generation.
    pub generation: u64,
}

/// One arena of the daemon's geometry.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct WireArena {
    /// Name.
    pub name: String,
    /// Copy unit, bytes.
    pub bytes_per_page: u64,
    /// Page stride, bytes.
    pub page_stride: u64,
    /// Pages.
    pub pages: u64,
    /// `Placement::Fused { buffer, offset }`, or `None` for `Placement::Own`.
    pub fused: Option<(u32, u64)>,
}

/// What a client learns from the daemon's welcome.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Welcome {
    /// [`PROTOCOL_VERSION`] of the daemon.
    pub version: u32,
    /// A random number naming this run of the daemon (lease tokens carry it).
    pub instance: u64,
    /// The daemon's process id.
    pub pid: u32,
    /// Model name.
    pub model: String,
    /// Tokens per page.
    pub page_tokens: u32,
    /// Tensor-parallel shard.
    pub shard: Option<(u32, u32)>,
    /// Arenas, in order.
    pub arenas: Vec<WireArena>,
    /// The namespace (checked against the geometry rebuilt from the fields above).
    pub namespace: Namespace,
    /// Bytes per slot.
    pub slot_bytes: u64,
    /// Slots.
    pub capacity: u32,
    /// Bytes to map.
    pub mapped_bytes: u64,
    /// `hugetlb`, `thp` or `plain`.
    pub backing: String,
    /// The eviction policy's name.
    pub policy: String,
    /// The bounds every connection is held to.
    pub limits: WireLimits,
}

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

/// A [`TierError`] the daemon returns.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[allow(missing_docs)]
pub enum WireError {
    CannotFit {
        needed: u64,
        available: u64,
        capacity: u64,
    },
    PoolExhausted {
        needed: u64,
        got: u64,
    },
    LeaseSettled,
    LeaseExpired,
    LeaseTooShort {
        asked: u64,
        held: u64,
    },
    ForeignLease,
    ShuttingDown,
    TooManyPins {
        slot: u32,
    },
    GeometryMismatch {
        backend: String,
        tier: String,
    },
    ProtocolMismatch {
        daemon: u32,
        client: u32,
    },
    LimitExceeded {
        limit: crate::error::Limit,
        asked: u64,
        max: u64,
    },
    Protocol(String),
    Panicked {
        request: String,
        message: String,
    },
    /// A request the daemon could not serve (an unknown id, a malformed message), as text; a
    /// client reports it as [`TierError::Protocol`] (the connection stays usable).
    Other(String),
}

impl From<&TierError> for WireError {
    fn from(e: &TierError) -> Self {
        use TierError as T;
        match e {
            T::CannotFit { needed, available, capacity } => WireError::CannotFit {
                needed: *needed as u64,
                available: *available as u64,
                capacity: *capacity as u64,
            },
            T::PoolExhausted { needed, got } => WireError::PoolExhausted { needed: *needed as u64, got: *got as u64 },
            T::LeaseSettled => WireError::LeaseSettled,
            T::LeaseExpired => WireError::LeaseExpired,
            T::LeaseTooShort { asked, held } => WireError::LeaseTooShort { asked: *asked as u64, held: *held as u64 },
            T::ForeignLease => WireError::ForeignLease,
            T::ShuttingDown => WireError::ShuttingDown,
            T::TooManyPins { slot } => WireError::TooManyPins { slot: *slot },
            T::GeometryMismatch { backend, tier } => {
                WireError::GeometryMismatch { backend: backend.clone(), tier: tier.clone() }
            }
            T::ProtocolMismatch { daemon, client } => WireError::ProtocolMismatch { daemon: *daemon, client: *client },
            T::LimitExceeded { limit, asked, max } => {
                WireError::LimitExceeded { limit: *limit, asked: *asked, max: *max }
            }
            T::Protocol { reason } => WireError::Protocol(reason.clone()),
            T::Panicked { request, message } => {
                WireError::Panicked { request: request.clone(), message: message.clone() }
            }
            e => WireError::Other(e.to_string()),
        }
    }
}

impl From<WireError> for TierError {
    fn from(w: WireError) -> Self {
        match w {
            WireError::CannotFit { needed, available, capacity } => TierError::CannotFit {
                needed: needed as usize,
                available: available as usize,
                capacity: capacity as usize,
            },
            WireError::PoolExhausted { needed, got } => {
                TierError::PoolExhausted { needed: needed as usize, got: got as usize }
            }
            WireError::LeaseSettled => TierError::LeaseSettled,
            WireError::LeaseExpired => TierError::LeaseExpired,
            WireError::LeaseTooShort { asked, held } => {
                TierError::LeaseTooShort { asked: asked as usize, held: held as usize }
            }
            WireError::ForeignLease => TierError::ForeignLease,
            WireError::ShuttingDown => TierError::ShuttingDown,
            WireError::TooManyPins { slot } => TierError::TooManyPins { slot },
            WireError::GeometryMismatch { backend, tier } => TierError::GeometryMismatch { backend, tier },
            WireError::ProtocolMismatch { daemon, client } => TierError::ProtocolMismatch { daemon, client },
            WireError::LimitExceeded { limit, asked, max } => TierError::LimitExceeded { limit, asked, max },
            WireError::Protocol(reason) => TierError::Protocol { reason },
            WireError::Panicked { request, message } => TierError::Panicked { request, message },
            // Answered on a working connection: the connection stays usable, so never Disconnected.
            WireError::Other(m) => TierError::Protocol { reason: format!("the daemon refused the request: {m}") },
        }
    }
}

/// The daemon's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reply {
    /// The hello was accepted (the memfd came with the marker byte).
    Welcome(Welcome),
    /// The request failed.
    Error(WireError),
    /// Nothing to report.
    Done,
    /// A yes or no.
    Bool(bool),
    /// A count.
    Count(u64),
    /// A rank's id.
    Attached {
        /// The id (attach order over all processes, from 0).
        rank: u32,
    },
    /// A lease (id 0: settled from birth, nothing leased).
    Leased {
        /// The lease.
        lease: u64,
        /// Its blocks, in key order.
        blocks: Vec<WireBlock>,
        /// Where the daemon's query found each block: empty when every block was resident on its
        /// host pool, else one per block (its SSD tier, a peer). Added in version 6.
        sources: Vec<crate::source::BlockSource>,
    },
    /// A lease's state.
    LeaseInfo {
        /// Settled.
        settled: bool,
        /// Settled by expiry.
        expired: bool,
        /// Restores left (0 once settled).
        uses_left: u32,
    },
    /// A prepared save: copy `keys[saving[i]]` into slot `slots[i]`, then finish it.
    SavePrepared {
        /// The save (0 when nothing is to copy).
        save: u64,
        /// Indices of the keys to copy.
        saving: Vec<u32>,
        /// Their slots (`WRITING`, owned by the save until it is finished).
        slots: Vec<u32>,
        /// Keys found resident.
        resident: u32,
        /// Keys another save holds.
        in_flight: u32,
        /// Keys repeated within the save.
        duplicates: u32,
        /// Keys dropped (`Fit::Prefix`).
        dropped: u32,
    },
    /// A restore's pinned slots: copy slot `slots[i]` into the caller's page `i`, then finish it.
    Restoring {
        /// The restore.
        restore: u64,
        /// The pinned slots, in key order.
        slots: Vec<u32>,
    },
    /// The counters.
    Stats(WireStats),
    /// The audit: slot counts, or the first violated invariant.
    Audit(Result<WireAudit, String>),
    /// One row per connected client process (busiest first).
    Clients(Vec<WireClient>),
    /// The SSD tier's counters, `None` when the daemon has no SSD tier (fixed-size: decoding it
    /// allocates nothing). Added in version 7.
    SsdStats(Option<WireSsdStats>),
}

/// Encodes `msg` as one frame (length prefix and payload) into `buf` (cleared first).
///
/// # Errors
/// The encoder's error, or a payload larger than [`MAX_FRAME`].
pub fn encode<T: Serialize>(msg: &T, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    buf.extend_from_slice(&[0; 4]);
    let mut buf2 = postcard::to_extend(msg, std::mem::take(buf)).map_err(invalid)?;
    let len = buf2.len() - 4;
    if len > MAX_FRAME {
        return Err(invalid(format!("a {len} B frame is larger than {MAX_FRAME} B")));
    }
    buf2[..4].copy_from_slice(&(len as u32).to_le_bytes());
    *buf = buf2;
    Ok(())
}

/// Writes `msg` as one frame with a single `write_all` (`buf` is scratch space).
///
/// # Errors
/// Encoding or I/O errors.
pub fn write_frame<T: Serialize>(w: &mut impl Write, msg: &T, buf: &mut Vec<u8>) -> std::io::Result<()> {
    encode(msg, buf)?;
    w.write_all(buf)
}

/// Reads one frame and decodes it (`buf` is scratch space). End of stream before the first byte
/// is [`std::io::ErrorKind::UnexpectedEof`].
///
/// # Errors
/// I/O errors, a frame larger than [`MAX_FRAME`], or a payload that does not decode.
pub fn read_frame<T: for<'de> Deserialize<'de>>(r: &mut impl Read, buf: &mut Vec<u8>) -> std::io::Result<T> {
    let len = read_len(r)?;
    if len > MAX_FRAME {
        return Err(invalid(format!("a {len} B frame is larger than {MAX_FRAME} B")));
    }
    read_payload(r, len, buf)?;
    decode(buf)
}

/// Reads a frame's 4-byte length prefix: the payload's length, bytes.
///
/// # Errors
/// I/O errors ([`std::io::ErrorKind::UnexpectedEof`] at end of stream).
pub fn read_len(r: &mut impl Read) -> std::io::Result<usize> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    Ok(u32::from_le_bytes(len) as usize)
}

/// Reads a payload of `len` bytes into `buf` (cleared first), growing it by at most [`READ_CHUNK`]
/// bytes ahead of what has arrived: a peer that announces 4 GiB and sends 10 bytes makes this
/// hold about 64 KiB, not 4 GiB.
///
/// # Errors
/// I/O errors; [`std::io::ErrorKind::UnexpectedEof`] if the stream ends first.
pub fn read_payload(r: &mut impl Read, len: usize, buf: &mut Vec<u8>) -> std::io::Result<()> {
    buf.clear();
    if crate::seeded::seeded("frame-prealloc") {
        buf.resize(len, 0);
        buf.clear();
    }
    while buf.len() < len {
        let at = buf.len();
        buf.resize(at + (len - at).min(READ_CHUNK), 0);
        match r.read(&mut buf[at..]) {
            Ok(0) => {
                buf.truncate(at);
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            Ok(n) => buf.truncate(at + n),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => buf.truncate(at),
            Err(e) => {
                buf.truncate(at);
                return Err(e);
            }
        }
    }
    Ok(())
}

/// Reads and discards a payload of `len` bytes, [`READ_CHUNK`] at a time (an oversized frame the
/// reader answers without keeping).
///
/// # Errors
/// I/O errors; [`std::io::ErrorKind::UnexpectedEof`] if the stream ends first.
pub fn skip_payload(r: &mut impl Read, mut len: usize) -> std::io::Result<()> {
    let mut scratch = [0u8; 4096];
    while len > 0 {
        let want = len.min(scratch.len());
        match r.read(&mut scratch[..want]) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => len -= n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One frame a daemon read from a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Incoming {
    /// A request.
    Request(Request),
    /// A frame over the reader's bound, `len` payload bytes: read and discarded.
    Oversized {
        /// Its payload's length, bytes.
        len: u64,
    },
    /// A frame within the bound whose payload is no request (the reason).
    Undecodable(String),
}

/// Reads the next frame of a connection: a request, or an oversized or undecodable frame that was
/// read whole, so the connection stays in step. Memory: at most `max_frame` bytes (plus
/// [`READ_CHUNK`]) in `buf`, whatever the length prefix says.
///
/// # Errors
/// I/O errors ([`std::io::ErrorKind::UnexpectedEof`] at end of stream, also mid-frame).
pub fn read_request(r: &mut impl Read, buf: &mut Vec<u8>, max_frame: usize) -> std::io::Result<Incoming> {
    let len = read_len(r)?;
    if len > max_frame {
        skip_payload(r, len)?;
        return Ok(Incoming::Oversized { len: len as u64 });
    }
    read_payload(r, len, buf)?;
    Ok(match decode(buf) {
        Ok(req) => Incoming::Request(req),
        Err(e) => Incoming::Undecodable(e.to_string()),
    })
}

/// Decodes one payload. postcard never allocates more than the payload can hold: a sequence's
/// length prefix only bounds how many elements are read from the payload's bytes (serde caps the
/// up-front reservation at 1 MiB), so a huge prefix on a short payload is an error, not an
/// allocation.
///
/// # Errors
/// [`std::io::ErrorKind::InvalidData`] for a payload that does not decode.
pub fn decode<T: for<'de> Deserialize<'de>>(payload: &[u8]) -> std::io::Result<T> {
    postcard::from_bytes(payload).map_err(invalid)
}

/// Writes to a socket with `MSG_NOSIGNAL`: a peer that is gone is an `EPIPE` error, never a
/// `SIGPIPE` that would kill the process (an engine may not ignore it).
#[derive(Debug)]
pub struct NoSigPipe<'a>(pub &'a std::os::unix::net::UnixStream);

impl Write for NoSigPipe<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        use std::os::fd::AsRawFd;
        nix::sys::socket::send(self.0.as_raw_fd(), buf, nix::sys::socket::MsgFlags::MSG_NOSIGNAL)
            .map_err(std::io::Error::from)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn invalid(e: impl ToString) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip_and_a_43_key_query_is_small() {
        let keys: Vec<ContentKey> = (0..43u8).map(|i| ContentKey([i; 16])).collect();
        let q = Request::Query { keys: keys.clone(), uses: 4 };
        let mut buf = Vec::new();
        encode(&q, &mut buf).unwrap();
        // 4 B length + 1 B variant + 1 B key count + 43 x 16 B + 1 B uses.
        assert_eq!(buf.len(), 4 + 1 + 1 + 43 * 16 + 1);
        let mut scratch = Vec::new();
        let back: Request = read_frame(&mut &buf[..], &mut scratch).unwrap();
        assert_eq!(back, q);
        let reply = Reply::Leased {
            lease: 7,
            blocks: keys.iter().map(|&key| WireBlock { key, slot: 3, generation: 1 << 39 }).collect(),
            sources: (0..43)
                .map(|i| if i < 40 { crate::source::BlockSource::Host } else { crate::source::BlockSource::Peer })
                .collect(),
        };
        encode(&reply, &mut buf).unwrap();
        let back: Reply = read_frame(&mut &buf[..], &mut scratch).unwrap();
        assert_eq!(back, reply);
    }

    #[test]
    fn oversized_and_truncated_frames_are_errors() {
        let mut scratch = Vec::new();
        let huge = ((MAX_FRAME + 1) as u32).to_le_bytes();
        let e = read_frame::<Request>(&mut &huge[..], &mut scratch).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
        let e = read_frame::<Request>(&mut &[5u8, 0, 0, 0, 1][..], &mut scratch).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        let e = read_frame::<Request>(&mut &[][..], &mut scratch).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        // A variant number no request has.
        let e = read_frame::<Request>(&mut &[1u8, 0, 0, 0, 200][..], &mut scratch).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn a_length_prefix_alone_allocates_nothing_near_its_length() {
        // The daemon's reader before any hello: a 64 MiB announcement followed by 60 bytes.
        let mut frame = (MAX_FRAME as u32).to_le_bytes().to_vec();
        frame.extend_from_slice(&[7u8; 60]);
        let mut r = &frame[..];
        let len = read_len(&mut r).unwrap();
        let mut buf = Vec::new();
        let e = read_payload(&mut r, len, &mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert!(buf.capacity() <= 2 * READ_CHUNK, "{} B reserved for 60 B that arrived", buf.capacity());
        let e = read_frame::<Request>(&mut &frame[..], &mut buf).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        assert!(buf.capacity() <= 2 * READ_CHUNK, "{} B reserved for 60 B that arrived", buf.capacity());
        // Skipping reads the bytes without keeping them.
        let mut r = &[1u8; 10_000][..];
        skip_payload(&mut r, 9_000).unwrap();
        assert_eq!(r.len(), 1_000);
    }

    #[test]
    fn a_huge_sequence_length_on_a_short_payload_is_an_error_not_an_allocation() {
        // Query (variant 2) whose key count says 2^63: postcard reads elements from the payload's
        // bytes only, so this fails at once (an up-front reservation of 2^63 x 16 B would abort).
        let mut payload = vec![2u8];
        payload.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x7f]);
        payload.extend_from_slice(&[0u8; 40]);
        assert!(decode::<Request>(&payload).is_err());
        // The same for a hint and an audit.
        for variant in [16u8, 20] {
            payload[0] = variant;
            assert!(decode::<Request>(&payload).is_err());
        }
    }

    #[test]
    fn errors_survive_the_wire() {
        let e = TierError::CannotFit { needed: 5, available: 2, capacity: 4 };
        let back = TierError::from(WireError::from(&e));
        assert_eq!(back.to_string(), e.to_string());
        assert!(matches!(TierError::from(WireError::LeaseExpired), TierError::LeaseExpired));
    }
}
