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

use crate::key::{ContentKey, Namespace};
use serde::{Deserialize, Serialize};

mod counters;
mod error;
mod frame;
#[cfg(test)]
mod tests;

pub use counters::{WireAudit, WireClient, WireSsdStats, WireStats};
pub use error::WireError;
pub use frame::{
    decode, encode, read_frame, read_len, read_payload, read_request, skip_payload, spin_until_readable, write_frame,
    Incoming, NoSigPipe,
};

/// The first four bytes of a hello.
pub const MAGIC: [u8; 4] = *b"KVTD";
/// The protocol version this build speaks.
pub const PROTOCOL_VERSION: u32 = 7;
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
    /// is spent unless [`Outcome::NotSubmitted`] or [`Outcome::SubmitPanicked`]. -> [`Reply::Done`]:
    /// the copy's handle completes once the daemon has counted the restore, so what any connection
    /// reads of the tier afterwards includes it.
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
        matches!(self, Request::DropLease { .. } | Request::RestoreSubmitted { .. })
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
