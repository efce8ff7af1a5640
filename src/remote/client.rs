//! The client side: a [`HostTier`] whose state machine runs in the tier daemon.
//!
//! [`HostTier::connect`] opens a Unix socket to `kvtierd`, receives the pool's memfd and maps it;
//! the returned tier has the same API as an in-process one. Its ranks run their copies in this
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
//! (the daemon stopped or restarted) fails every later call with [`TierError::Disconnected`];
//! connect again to go on.

use super::proto::{self, Outcome, Reply, Request, WireBlock};
use crate::copy::{CopyPair, Direction};
use crate::error::{Error, Limit, TierError};
use crate::evict::PolicyKind;
use crate::geometry::{ArenaSpec, Geometry, Placement};
use crate::handle::CopyHandle;
use crate::index::SlotRef;
use crate::key::ContentKey;
use crate::lease::{Lease, LeasedBlock};
use crate::pool::{Backing, HostPool, SharedPoolLayout};
use crate::slot::SlotId;
use crate::tier::core::Core;
use crate::tier::{CopyOutcome, Fit, HostTier, Launch, Rank, SaveOptions, SaveTicket, Settle};
use std::io::{BufReader, IoSliceMut, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a call waits for the daemon's reply before it gives the connection up.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

/// Scratch buffer capacity a connection keeps between calls, bytes (a larger one, left by a big
/// request or reply, is freed after its call).
const KEEP_BUF_BYTES: usize = 1 << 20;

/// The request's variant name, for errors (formats only the first few bytes of its `Debug`
/// output, never a whole multi-megabyte key list).
fn name(req: &Request) -> String {
    struct Head(String);
    impl std::fmt::Write for Head {
        fn write_str(&mut self, s: &str) -> std::fmt::Result {
            self.0.push_str(s);
            if self.0.len() >= 24 {
                Err(std::fmt::Error)
            } else {
                Ok(())
            }
        }
    }
    let mut h = Head(String::new());
    let _ = std::fmt::Write::write_fmt(&mut h, format_args!("{req:?}"));
    let end = h.0.find([' ', '{', '(']).unwrap_or(h.0.len());
    h.0.truncate(end);
    h.0
}

/// The bounds a request is checked against before it is sent.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
struct RequestLimits {
    /// Largest request frame payload, bytes ([`Limit::FrameBytes`]).
    frame_bytes: usize,
    /// Keys one query, save, hint or audit may name ([`Limit::KeysPerRequest`]).
    keys_per_request: u64,
}

impl RequestLimits {
    /// The protocol's own bound: [`proto::MAX_FRAME`] bytes, keys bounded by the frame alone.
    #[cfg(test)]
    const PROTOCOL: RequestLimits = RequestLimits { frame_bytes: proto::MAX_FRAME, keys_per_request: u64::MAX };

    /// The daemon's bounds as its welcome states them, never above the protocol's own.
    fn of_daemon(w: &proto::WireLimits) -> RequestLimits {
        RequestLimits {
            frame_bytes: usize::try_from(w.frame_bytes).unwrap_or(usize::MAX).min(proto::MAX_FRAME),
            keys_per_request: w.keys_per_request,
        }
    }
}

/// Keys the request names (queries, saves, hints, audits).
fn key_count(req: &Request) -> Option<usize> {
    match req {
        Request::Query { keys, .. }
        | Request::PrepareSave { keys, .. }
        | Request::Hint { keys, .. }
        | Request::Audit { keys } => Some(keys.len()),
        _ => None,
    }
}

/// Refuses a request over `limits` before anything is encoded or sent (the size is computed
/// without allocating).
///
/// # Errors
/// [`TierError::LimitExceeded`] with [`Limit::KeysPerRequest`] (`asked`: keys) or
/// [`Limit::FrameBytes`] (`asked`: the payload's bytes); [`TierError::Protocol`] if the request
/// cannot be encoded at all.
fn check_request_size(req: &Request, limits: RequestLimits) -> Result<(), TierError> {
    if cfg!(kvtier_seeded_bug = "client-sends-oversized") {
        return Ok(());
    }
    if let Some(n) = key_count(req) {
        if n as u64 > limits.keys_per_request {
            return Err(TierError::LimitExceeded {
                limit: Limit::KeysPerRequest,
                asked: n as u64,
                max: limits.keys_per_request,
            });
        }
    }
    let bytes = postcard::experimental::serialized_size(req)
        .map_err(|e| TierError::Protocol { reason: format!("encoding {}: {e}", name(req)) })?;
    if bytes > limits.frame_bytes {
        return Err(TierError::LimitExceeded {
            limit: Limit::FrameBytes,
            asked: bytes as u64,
            max: limits.frame_bytes as u64,
        });
    }
    Ok(())
}

struct Io {
    reader: BufReader<UnixStream>,
    writer: UnixStream,
    buf: Vec<u8>,
    /// Why the connection is unusable, once it is.
    lost: Option<String>,
}

/// One connection to the tier daemon, shared by the tier handle, its ranks and its leases.
pub(crate) struct Conn {
    io: Mutex<Io>,
    /// The daemon run this connection talks to (lease tokens carry it).
    instance: u64,
    /// The process that connected (a forked child must connect again).
    pid: u32,
    /// What a request may hold (checked before it is sent).
    limits: RequestLimits,
}

fn lost(reason: impl Into<String>) -> TierError {
    TierError::Disconnected { reason: reason.into() }
}

fn unexpected(r: &Reply) -> TierError {
    lost(format!("the daemon sent an unexpected reply: {r:?}"))
}

fn describe(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
            "the daemon closed the connection (it stopped or restarted)".into()
        }
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
            format!("no reply from the daemon within {} s", REPLY_TIMEOUT.as_secs())
        }
        _ => e.to_string(),
    }
}

impl Conn {
    /// Fails with [`TierError::ForkedChild`] unless the calling process is the one that connected:
    /// a forked child shares the parent's socket, and a message from it would interleave with the
    /// parent's on one session. Nothing is sent.
    fn check_owner(&self) -> Result<(), TierError> {
        let current = std::process::id();
        if current != self.pid && !cfg!(kvtier_seeded_bug = "forked-child-unchecked") {
            return Err(TierError::ForkedChild { owner: self.pid, current });
        }
        Ok(())
    }

    /// Sends `req` and, unless it is one-way, waits for its reply. A daemon error comes back as
    /// its [`TierError`] and leaves the connection usable; an I/O failure, or a reply that does not
    /// decode, marks the connection lost.
    ///
    /// Checked before anything is sent, leaving the connection usable: the calling process
    /// ([`TierError::ForkedChild`]) and the request's size ([`TierError::LimitExceeded`]:
    /// [`Limit::KeysPerRequest`] over the connection's key bound, [`Limit::FrameBytes`] over its
    /// frame bound, at most [`proto::MAX_FRAME`] bytes: a query, save, hint or audit of more than
    /// about 4.19 M keys).
    pub(crate) fn call(&self, req: &Request) -> Result<Reply, TierError> {
        self.check_owner()?;
        check_request_size(req, self.limits)?;
        let mut guard = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let Io { reader, writer, buf, lost: why } = &mut *guard;
        if let Some(r) = why {
            return Err(lost(r.clone()));
        }
        // Encoding writes nothing to the socket: its failure is this request's alone.
        proto::encode(req, buf).map_err(|e| TierError::Protocol { reason: format!("encoding {}: {e}", name(req)) })?;
        let r = proto::NoSigPipe(writer).write_all(buf).and_then(|()| {
            if req.is_one_way() {
                Ok(Reply::Done)
            } else {
                proto::read_frame(reader, buf)
            }
        });
        // A reply frame of up to MAX_FRAME bytes is not worth keeping allocated.
        if buf.capacity() > KEEP_BUF_BYTES {
            *buf = Vec::new();
        }
        match r {
            Ok(Reply::Error(e)) => Err(e.into()),
            Ok(reply) => Ok(reply),
            Err(e) => {
                let reason = describe(&e);
                let _ = writer.shutdown(std::net::Shutdown::Both);
                *why = Some(reason.clone());
                Err(lost(reason))
            }
        }
    }

    fn expect_done(&self, req: &Request) -> Result<(), TierError> {
        match self.call(req)? {
            Reply::Done => Ok(()),
            r => Err(unexpected(&r)),
        }
    }

    fn count(&self, req: &Request) -> Result<u64, TierError> {
        match self.call(req)? {
            Reply::Count(n) => Ok(n),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn attach(&self) -> Result<u32, TierError> {
        match self.call(&Request::Attach)? {
            Reply::Attached { rank } => Ok(rank),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn contains(&self, key: &ContentKey) -> Result<bool, TierError> {
        match self.call(&Request::Contains { key: *key })? {
            Reply::Bool(b) => Ok(b),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn evict(&self, n: usize) -> Result<usize, TierError> {
        self.count(&Request::Evict { blocks: n as u64 }).map(|n| n as usize)
    }

    pub(crate) fn hint(&self, keys: &[ContentKey], ttl: std::time::Duration) -> Result<u64, TierError> {
        let ttl_ms = ttl.as_millis().min(u64::MAX as u128) as u64;
        self.count(&Request::Hint { keys: keys.to_vec(), ttl_ms })
    }

    pub(crate) fn withdraw_hint(&self, id: u64) -> Result<bool, TierError> {
        match self.call(&Request::WithdrawHint { id })? {
            Reply::Bool(b) => Ok(b),
            r => Err(unexpected(&r)),
        }
    }

    pub(crate) fn live_hints(&self) -> Result<usize, TierError> {
        self.count(&Request::LiveHints).map(|n| n as usize)
    }

    pub(crate) fn expire_leases(&self) -> Result<usize, TierError> {
        self.count(&Request::ExpireLeases).map(|n| n as usize)
    }

    pub(crate) fn stats(&self) -> Result<crate::TierStats, TierError> {
        match self.call(&Request::Stats)? {
            Reply::Stats(s) => Ok(s.into()),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's audit of its tier over `keys` (see [`Core::audit`]; `kvtier::testing`).
    pub(crate) fn audit(&self, keys: &[ContentKey]) -> Result<Result<crate::tier::AuditReport, String>, TierError> {
        match self.call(&Request::Audit { keys: keys.to_vec() })? {
            Reply::Audit(r) => Ok(r.map(|a| crate::tier::AuditReport {
                free: a.free as usize,
                writing: a.writing as usize,
                ready: a.ready as usize,
                evicting: a.evicting as usize,
                pinned: a.pinned as usize,
            })),
            r => Err(unexpected(&r)),
        }
    }
}

/// A lease held by the tier daemon, as a process sees it (see [`Lease`]).
pub(crate) struct RemoteLease {
    conn: Arc<Conn>,
    /// The daemon's lease id; 0 for a lease settled from birth (nothing leased, or no use).
    id: u64,
}

/// A lease's state as the daemon reports it.
#[derive(Copy, Clone, Debug)]
pub(crate) struct LeaseInfo {
    pub settled: bool,
    pub expired: bool,
    pub uses_left: u32,
}

impl RemoteLease {
    pub(crate) fn info(&self) -> LeaseInfo {
        let gone = LeaseInfo { settled: true, expired: false, uses_left: 0 };
        if self.id == 0 {
            return gone;
        }
        match self.conn.call(&Request::LeaseInfo { lease: self.id }) {
            Ok(Reply::LeaseInfo { settled, expired, uses_left }) => LeaseInfo { settled, expired, uses_left },
            _ => gone,
        }
    }

    pub(crate) fn release(&self) -> bool {
        if self.id == 0 {
            return false;
        }
        matches!(self.conn.call(&Request::ReleaseLease { lease: self.id }), Ok(Reply::Bool(true)))
    }
}

impl Drop for RemoteLease {
    fn drop(&mut self) {
        if self.id != 0 {
            // One-way; a lost connection has dropped the daemon's handles already.
            let _ = self.conn.call(&Request::DropLease { lease: self.id });
        }
    }
}

/// A lease of a connected tier as bytes another process can open ([`Lease::token`],
/// [`HostTier::open_lease`]): the daemon run and the lease id. 16 bytes.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash)]
pub struct LeaseToken {
    instance: u64,
    lease: u64,
}

impl LeaseToken {
    /// The token's 16 bytes (daemon run, then lease id, little-endian).
    pub fn to_bytes(self) -> [u8; 16] {
        let mut b = [0; 16];
        b[..8].copy_from_slice(&self.instance.to_le_bytes());
        b[8..].copy_from_slice(&self.lease.to_le_bytes());
        b
    }

    /// A token from its 16 bytes.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] if `bytes` is not 16 bytes long.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, TierError> {
        let b: [u8; 16] = bytes.try_into().map_err(|_| TierError::ForeignLease)?;
        Ok(LeaseToken {
            instance: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            lease: u64::from_le_bytes(b[8..].try_into().expect("8 bytes")),
        })
    }
}

impl Lease {
    /// This lease as a token another process connected to the same daemon opens with
    /// [`HostTier::open_lease`], so several engine processes (data-parallel ranks) restore from one
    /// lease, each with one of its uses (see [`HostTier::query_shared`]). Every handle, in any
    /// process, keeps the lease alive; it settles as a lease does in one process (consumed,
    /// released, or when the last handle is dropped; a process that exits drops its handles).
    ///
    /// `None` for a lease of an in-process tier, and for a lease settled from birth (nothing
    /// leased): there is nothing to share.
    pub fn token(&self) -> Option<LeaseToken> {
        let r = self.remote()?;
        (r.id != 0).then_some(LeaseToken { instance: r.conn.instance, lease: r.id })
    }
}

fn blocks_of(keys: Option<&[ContentKey]>, wire: Vec<WireBlock>, capacity: u32) -> Result<Vec<LeasedBlock>, TierError> {
    if keys.is_some_and(|k| wire.len() > k.len()) || wire.iter().any(|b| b.slot >= capacity) {
        return Err(lost("the daemon leased blocks this query did not ask for"));
    }
    wire.into_iter()
        .enumerate()
        .map(|(i, b)| {
            if keys.is_some_and(|k| k[i] != b.key) {
                return Err(lost("the daemon leased blocks this query did not ask for"));
            }
            Ok(LeasedBlock { key: b.key, slot: SlotRef { slot: SlotId(b.slot), generation: b.generation } })
        })
        .collect()
}

/// [`HostTier::try_query_shared`] of a connected tier.
pub(crate) fn query(core: &Arc<Core>, conn: &Arc<Conn>, keys: &[ContentKey], uses: u32) -> Result<Lease, TierError> {
    match conn.call(&Request::Query { keys: keys.to_vec(), uses })? {
        Reply::Leased { lease, blocks } => {
            let blocks = blocks_of(Some(keys), blocks, core.pool().capacity())?;
            Ok(Lease::remote_lease(core, blocks, RemoteLease { conn: conn.clone(), id: lease }))
        }
        r => Err(unexpected(&r)),
    }
}

impl From<CopyOutcome> for Outcome {
    fn from(o: CopyOutcome) -> Self {
        match o {
            CopyOutcome::Done => Outcome::Done,
            CopyOutcome::Failed => Outcome::Failed,
            CopyOutcome::Unknown => Outcome::Unknown,
            CopyOutcome::SubmitPanicked if cfg!(kvtier_seeded_bug = "submit-panic-spends-use") => Outcome::Unknown,
            CopyOutcome::SubmitPanicked => Outcome::SubmitPanicked,
        }
    }
}

/// A connected rank's save ([`Rank::save_with`], [`Rank::save_layers`]): the daemon plans and
/// reserves, this process copies whole-block or layer-wise as `how` says, then reports the outcome.
pub(crate) fn save_how(
    rank: &Rank,
    conn: &Arc<Conn>,
    keys: &[ContentKey],
    gpu_pages: &[u64],
    how: Launch<'_>,
    opts: SaveOptions,
) -> Result<SaveTicket, TierError> {
    let req = Request::PrepareSave {
        keys: keys.to_vec(),
        prefix: opts.fit == Fit::Prefix,
        prefix_depth: opts.prefix_depth,
        parent: opts.parent,
    };
    let (save, saving, slots, resident, in_flight, duplicates, dropped) = match conn.call(&req)? {
        Reply::SavePrepared { save, saving, slots, resident, in_flight, duplicates, dropped } => {
            (save, saving, slots, resident as usize, in_flight as usize, duplicates as usize, dropped as usize)
        }
        r => return Err(unexpected(&r)),
    };
    let saving: Vec<usize> = saving.into_iter().map(|i| i as usize).collect();
    let capacity = rank_capacity(rank);
    if saving.len() != slots.len() || saving.iter().any(|&i| i >= keys.len()) || slots.iter().any(|&s| s >= capacity) {
        if save != 0 {
            let _ = conn.call(&Request::FinishSave { save, outcome: Outcome::NotSubmitted });
        }
        return Err(lost("the daemon prepared a save this rank did not ask for"));
    }
    if saving.is_empty() {
        return Ok(SaveTicket { saving, resident, in_flight, duplicates, dropped, handle: CopyHandle::ready() });
    }
    let batch: Vec<CopyPair> = saving.iter().zip(&slots).map(|(&i, &s)| CopyPair::new(gpu_pages[i], s)).collect();
    let c = conn.clone();
    let settle: Settle = Box::new(move |outcome| c.expect_done(&Request::FinishSave { save, outcome: outcome.into() }));
    // SAFETY: the daemon reserved every slot of `batch` (WRITING) for this save and reuses none of
    // them before the FinishSave that `settle` sends after the copy has finished, or before this
    // process is gone; the pool is mapped as long as this rank's tier core lives, which the rank
    // holds. The GPU pages are the caller's, who may not rewrite them before the handle completes.
    match unsafe { rank.launch(Direction::Save, &batch, how, settle) } {
        Ok(handle) => Ok(SaveTicket { saving, resident, in_flight, duplicates, dropped, handle }),
        Err(e) => {
            let _ = conn.call(&Request::FinishSave { save, outcome: Outcome::NotSubmitted });
            Err(e)
        }
    }
}

fn rank_capacity(rank: &Rank) -> u32 {
    rank.core_pool_capacity()
}

/// A connected rank's restore ([`Rank::restore`], [`Rank::restore_layers`]): the daemon pins and
/// takes the use, this process copies whole-block or layer-wise as `how` says.
pub(crate) fn restore_how(
    rank: &Rank,
    lease: &RemoteLease,
    gpu_pages: &[u64],
    how: Launch<'_>,
) -> Result<CopyHandle, TierError> {
    let conn = &lease.conn;
    if gpu_pages.is_empty() {
        if lease.id != 0 {
            conn.expect_done(&Request::ConsumeUse { lease: lease.id })?;
        }
        return Ok(CopyHandle::ready());
    }
    let (restore, slots) = match conn.call(&Request::Restore { lease: lease.id, blocks: gpu_pages.len() as u32 })? {
        Reply::Restoring { restore, slots } => (restore, slots),
        r => return Err(unexpected(&r)),
    };
    if slots.len() != gpu_pages.len() || slots.iter().any(|&s| s >= rank_capacity(rank)) {
        let _ = conn.call(&Request::FinishRestore { restore, outcome: Outcome::NotSubmitted });
        return Err(lost("the daemon pinned slots this restore did not ask for"));
    }
    let batch: Vec<CopyPair> = gpu_pages.iter().zip(&slots).map(|(&p, &s)| CopyPair::new(p, s)).collect();
    let c = conn.clone();
    let settle: Settle = Box::new(move |outcome| {
        // The copy's bytes are in place whatever the daemon says: the handle reports the copy.
        let _ = c.call(&Request::FinishRestore { restore, outcome: outcome.into() });
        Ok(())
    });
    // SAFETY: the daemon pinned every slot of `batch` (READY) for this restore and keeps the pins
    // until the FinishRestore that `settle` sends after the copy has finished, or until this process
    // is gone; the pool stays mapped while the rank lives. The caller owns the GPU pages until the
    // handle completes.
    match unsafe { rank.launch(Direction::Restore, &batch, how, settle) } {
        Ok(handle) => {
            let _ = conn.call(&Request::RestoreSubmitted { restore });
            Ok(handle)
        }
        Err(e) => {
            let _ = conn.call(&Request::FinishRestore { restore, outcome: Outcome::NotSubmitted });
            Err(e)
        }
    }
}

/// Receives the marker byte and, with it, the pool's memfd (if any).
fn recv_marker(stream: &UnixStream) -> std::io::Result<(u8, Option<OwnedFd>)> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!([std::os::fd::RawFd; 2]);
    let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(std::io::Error::from)?;
    let mut fd = None;
    for c in msg.cmsgs().map_err(std::io::Error::from)? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for raw in fds {
                // SAFETY: the kernel installed `raw` in this process for this message; nothing
                // else owns it. Extra fds (none are sent) are closed by their OwnedFd.
                let owned = unsafe { OwnedFd::from_raw_fd(raw) };
                fd.get_or_insert(owned);
            }
        }
    }
    if msg.bytes == 0 {
        return Err(std::io::ErrorKind::UnexpectedEof.into());
    }
    Ok((byte[0], fd))
}

fn geometry_of(w: &proto::Welcome) -> Result<Geometry, TierError> {
    let arenas = w
        .arenas
        .iter()
        .map(|a| ArenaSpec {
            name: a.name.clone(),
            bytes_per_page: a.bytes_per_page,
            page_stride: a.page_stride,
            pages: a.pages,
            placement: match a.fused {
                Some((buffer, offset)) => Placement::Fused { buffer, offset },
                None => Placement::Own,
            },
        })
        .collect();
    let bad = |e: &dyn std::fmt::Display| lost(format!("the daemon's geometry is invalid here: {e}"));
    let mut g = Geometry::new(&w.model, w.page_tokens, arenas).map_err(|e| bad(&e))?;
    if let Some((i, n)) = w.shard {
        g = g.with_shard(i, n).map_err(|e| bad(&e))?;
    }
    if g.namespace() != w.namespace || g.slot_bytes() != w.slot_bytes {
        return Err(lost("the daemon's geometry does not derive its namespace and slot size here"));
    }
    Ok(g)
}

/// How [`HostTier::connect_with`] connects: the namespace to check and the uid the daemon must
/// run as.
///
/// ```
/// # use kvtier::ConnectOptions;
/// // A daemon run by the service account with uid 990 (engines in its group reach the socket).
/// let opts = ConnectOptions::new().expected_uid(990);
/// # let _ = opts;
/// ```
#[derive(Clone, Debug, Default)]
pub struct ConnectOptions {
    geometry: Option<Geometry>,
    expected_uid: Option<u32>,
}

impl ConnectOptions {
    /// The defaults: adopt the daemon's geometry; trust a daemon running as this process's
    /// effective uid, or as root.
    pub fn new() -> Self {
        Self::default()
    }

    /// Checks that the daemon serves `geometry`'s namespace (model, page size, arenas and shard),
    /// as [`HostTier::connect_as`] does.
    pub fn geometry(mut self, geometry: &Geometry) -> Self {
        self.geometry = Some(geometry.clone());
        self
    }

    /// Trusts a daemon running as `uid` (or as root) instead of one running as this process's
    /// effective uid: for a daemon run by a service account whose socket engines reach through
    /// its group.
    pub fn expected_uid(mut self, uid: u32) -> Self {
        self.expected_uid = Some(uid);
        self
    }

    /// The uid the daemon must run as: the one configured, else this process's effective uid.
    pub fn trusted_uid(&self) -> u32 {
        // SAFETY: geteuid has no preconditions and cannot fail.
        self.expected_uid.unwrap_or_else(|| unsafe { libc::geteuid() })
    }
}

/// Refuses a socket whose peer (the process that listens on it, `SO_PEERCRED`) runs as neither
/// `expected` nor root: a process of another uid that took the socket's path would otherwise
/// receive the hello's namespace and every later request's keys. Root is always trusted: it can
/// read any process's memory anyway.
///
/// # Errors
/// [`TierError::UntrustedDaemon`]; [`TierError::Disconnected`] if the credentials cannot be read.
fn check_peer(stream: &UnixStream, expected: u32) -> Result<(), TierError> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(stream, PeerCredentials)
        .map_err(|e| lost(format!("reading the tier daemon's credentials (SO_PEERCRED): {e}")))?;
    let found = cred.uid();
    if found != expected && found != 0 && !cfg!(kvtier_seeded_bug = "daemon-uid-unchecked") {
        return Err(TierError::UntrustedDaemon { expected, found });
    }
    Ok(())
}

/// Sets `FD_CLOEXEC` on `fd` (the standard library already opens sockets with `SOCK_CLOEXEC`;
/// this keeps it so whatever opened them): an `exec`'d program never inherits the session.
fn keep_cloexec(fd: &impl AsRawFd) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, FdFlag};
    let flags = FdFlag::from_bits_retain(fcntl(fd.as_raw_fd(), FcntlArg::F_GETFD)?);
    if !flags.contains(FdFlag::FD_CLOEXEC) {
        fcntl(fd.as_raw_fd(), FcntlArg::F_SETFD(flags | FdFlag::FD_CLOEXEC))?;
    }
    Ok(())
}

fn connect_impl(path: &Path, opts: &ConnectOptions) -> Result<HostTier, Error> {
    let expect = opts.geometry.as_ref();
    let stream = UnixStream::connect(path)
        .map_err(|e| lost(format!("connecting to the tier daemon at {}: {e}", path.display())))?;
    let io_err = |e: std::io::Error| Error::Tier(lost(describe(&e)));
    keep_cloexec(&stream).map_err(io_err)?;
    check_peer(&stream, opts.trusted_uid())?;
    stream.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(io_err)?;
    let mut buf = Vec::new();
    let hello = Request::Hello {
        magic: proto::MAGIC,
        version: proto::PROTOCOL_VERSION,
        namespace: expect.map(|g| g.namespace()),
    };
    proto::write_frame(&mut proto::NoSigPipe(&stream), &hello, &mut buf).map_err(io_err)?;
    let (marker, fd) = recv_marker(&stream).map_err(io_err)?;
    let reader_stream = stream.try_clone().map_err(io_err)?;
    keep_cloexec(&reader_stream).map_err(io_err)?;
    let mut reader = BufReader::new(reader_stream);
    let reply: Reply = proto::read_frame(&mut reader, &mut buf).map_err(io_err)?;
    let welcome = match (marker, reply, fd) {
        (proto::MARKER_POOL, Reply::Welcome(w), Some(fd)) => (w, fd),
        // A refusal of the hello that names no typed reason (the daemon could not start the
        // connection's thread, say): there is no connection, so it is `Disconnected`, not `Protocol`.
        (_, Reply::Error(proto::WireError::Other(m)), _) => {
            return Err(Error::Tier(TierError::Disconnected {
                reason: format!("the daemon refused the connection: {m}"),
            }))
        }
        (_, Reply::Error(e), _) => return Err(Error::Tier(e.into())),
        (_, r, _) => return Err(Error::Tier(unexpected(&r))),
    };
    let (w, fd) = welcome;
    if w.version != proto::PROTOCOL_VERSION {
        return Err(Error::Tier(TierError::ProtocolMismatch { daemon: w.version, client: proto::PROTOCOL_VERSION }));
    }
    let geometry = geometry_of(&w)?;
    let backing = match w.backing.as_str() {
        "hugetlb" => Backing::HugeTlb,
        "thp" => Backing::TransparentHuge,
        _ => Backing::Plain,
    };
    let layout =
        SharedPoolLayout { slot_bytes: w.slot_bytes, capacity: w.capacity, mapped_bytes: w.mapped_bytes, backing };
    let pool = HostPool::attach_shared(fd, layout)?;
    let policy = w.policy.parse::<PolicyKind>().unwrap_or_default();
    // The local core only holds the mapping and the geometry: a one-entry index, no lease clock.
    let core = Core::new(geometry, pool, policy, Some(1), None)?;
    let conn = Conn {
        io: Mutex::new(Io { reader, writer: stream, buf, lost: None }),
        instance: w.instance,
        pid: std::process::id(),
        limits: RequestLimits::of_daemon(&w.limits),
    };
    Ok(HostTier::from_remote(core, Arc::new(conn)))
}

impl HostTier {
    /// Connects to the tier daemon (`kvtierd`) listening on the Unix socket `path` and returns a
    /// tier with the same API as [`HostTier::new`]'s: the daemon owns the index, the slots, the
    /// leases and eviction over a pool in shared memory, which this process maps; ranks attached
    /// here copy between their own GPU arenas and that mapping in this process. Every engine
    /// process connects on its own; they share the daemon's blocks. The tier's geometry is the
    /// daemon's (with the daemon's page count: give each rank's backend its own).
    ///
    /// Before the hello is sent, the daemon's uid (`SO_PEERCRED` of the socket) must be this
    /// process's effective uid or root ([`HostTier::connect_with`] configures another). The pool's
    /// memfd must be size-sealed and as long as the welcome says before it is mapped.
    ///
    /// Connect after forking: a connection serves the process that made it. Its sockets are
    /// close-on-exec, and every call from another process (a child forked after the connection
    /// was made) fails with [`TierError::ForkedChild`] before anything is sent.
    ///
    /// # Errors
    /// [`Error::Tier`] with [`TierError::Disconnected`] (no daemon at `path`, or it hung up),
    /// [`TierError::UntrustedDaemon`] (the socket's peer runs as another uid),
    /// [`TierError::ProtocolMismatch`]; [`Error::Pool`] if the pool cannot be mapped
    /// ([`crate::PoolError::UnsealedSharedPool`], [`crate::PoolError::SharedPoolTooShort`],
    /// [`crate::PoolError::Map`]); [`Error::Tier`] with [`TierError::Index`] (never for the
    /// one-entry local index).
    pub fn connect(path: impl AsRef<Path>) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), &ConnectOptions::new())
    }

    /// [`HostTier::connect`], checking that the daemon serves `geometry`'s namespace (model, page
    /// size, arenas and shard).
    ///
    /// # Errors
    /// As [`HostTier::connect`]; [`TierError::GeometryMismatch`] if the daemon's namespace differs.
    pub fn connect_as(path: impl AsRef<Path>, geometry: &Geometry) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), &ConnectOptions::new().geometry(geometry))
    }

    /// [`HostTier::connect`] with options: the namespace to check ([`ConnectOptions::geometry`])
    /// and the uid the daemon must run as ([`ConnectOptions::expected_uid`]).
    ///
    /// # Errors
    /// As [`HostTier::connect_as`].
    pub fn connect_with(path: impl AsRef<Path>, options: &ConnectOptions) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), options)
    }

    /// True for a tier reached through the tier daemon ([`HostTier::connect`]).
    pub fn is_connected_tier(&self) -> bool {
        self.remote().is_some()
    }

    /// Opens a lease another process shared ([`Lease::token`]), taking a handle on it: the lease
    /// lives while any handle does. The blocks are the lease's, in key order.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] for an in-process tier or a token of another daemon run (the
    /// daemon restarted since); [`TierError::LeaseSettled`] if every handle on it is gone;
    /// [`TierError::Disconnected`].
    pub fn open_lease(&self, token: &LeaseToken) -> Result<Lease, TierError> {
        let conn = self.remote().ok_or(TierError::ForeignLease)?;
        if token.instance != conn.instance {
            return Err(TierError::ForeignLease);
        }
        match conn.call(&Request::OpenLease { instance: token.instance, lease: token.lease })? {
            Reply::Leased { lease, blocks } => {
                let core = self.core();
                let blocks = blocks_of(None, blocks, core.pool().capacity())?;
                Ok(Lease::remote_lease(core, blocks, RemoteLease { conn: conn.clone(), id: lease }))
            }
            r => Err(unexpected(&r)),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::mpsc::{channel, Receiver};

    /// A connection to a scripted daemon on the other end of a socket pair: the daemon answers
    /// each request that wants a reply with the next of `replies` (then hangs up) and hands every
    /// request it received to the returned channel.
    fn scripted(replies: Vec<Reply>) -> (Conn, Receiver<Request>) {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let (tx, rx) = channel();
        std::thread::spawn(move || {
            let mut replies = replies.into_iter();
            let mut r = BufReader::new(theirs.try_clone().unwrap());
            let mut buf = Vec::new();
            while let Ok(req) = proto::read_frame::<Request>(&mut r, &mut buf) {
                let one_way = req.is_one_way();
                let _ = tx.send(req);
                if !one_way {
                    let Some(reply) = replies.next() else { break };
                    proto::write_frame(&mut proto::NoSigPipe(&theirs), &reply, &mut buf).unwrap();
                }
            }
        });
        let io = Io { reader: BufReader::new(ours.try_clone().unwrap()), writer: ours, buf: Vec::new(), lost: None };
        (Conn { io: Mutex::new(io), instance: 1, pid: std::process::id(), limits: RequestLimits::PROTOCOL }, rx)
    }

    fn keys(n: usize) -> Vec<ContentKey> {
        (0..n as u64).map(|i| ContentKey(u128::from(i).to_le_bytes())).collect()
    }

    fn recv(rx: &Receiver<Request>) -> Request {
        rx.recv_timeout(Duration::from_secs(120)).expect("the scripted daemon received a request")
    }

    /// The largest query that fits in one frame: 1 B variant + 4 B key count + 16 B a key + 1 B
    /// uses <= MAX_FRAME.
    const MAX_QUERY_KEYS: usize = (proto::MAX_FRAME - 6) / 16;

    #[test]
    fn a_request_over_the_frame_limit_is_refused_before_anything_is_sent() {
        let (conn, rx) = scripted(vec![Reply::Count(3), Reply::Count(4), Reply::Count(5)]);
        let over = keys(MAX_QUERY_KEYS + 1);
        let e = conn.call(&Request::Query { keys: over.clone(), uses: 1 }).unwrap_err();
        let asked = 6 + 16 * over.len() as u64;
        assert!(
            matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, asked: a, max } if a == asked && max == proto::MAX_FRAME as u64),
            "{e}"
        );
        let e = conn.call(&Request::Hint { keys: over.clone(), ttl_ms: 10 }).unwrap_err();
        assert!(matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, .. }), "{e}");
        let save = Request::PrepareSave { keys: over, prefix: false, prefix_depth: None, parent: None };
        let e = conn.call(&save).unwrap_err();
        assert!(matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, .. }), "{e}");
        // Nothing was sent, and the connection serves the next call.
        assert_eq!(conn.count(&Request::LiveHints).map_err(|e| e.to_string()), Ok(3));
        assert_eq!(recv(&rx), Request::LiveHints);
        // The largest query that fits goes out whole.
        let fits = keys(MAX_QUERY_KEYS);
        assert_eq!(conn.count(&Request::Query { keys: fits.clone(), uses: 1 }).map_err(|e| e.to_string()), Ok(4));
        assert_eq!(recv(&rx), Request::Query { keys: fits, uses: 1 });
        assert_eq!(conn.count(&Request::ExpireLeases).map_err(|e| e.to_string()), Ok(5));
        assert_eq!(recv(&rx), Request::ExpireLeases);
    }

    #[test]
    fn a_request_over_the_connections_bounds_is_refused_before_anything_is_sent() {
        let (mut conn, rx) = scripted(vec![Reply::Count(1)]);
        conn.limits = RequestLimits { frame_bytes: 100, keys_per_request: 8 };
        let e = conn.call(&Request::Hint { keys: keys(9), ttl_ms: 1 }).unwrap_err();
        assert!(matches!(e, TierError::LimitExceeded { limit: Limit::KeysPerRequest, asked: 9, max: 8 }), "{e}");
        // 1 B variant + 1 B count + 8 x 16 B + 1 B uses = 131 B.
        let e = conn.call(&Request::Query { keys: keys(8), uses: 1 }).unwrap_err();
        assert!(matches!(e, TierError::LimitExceeded { limit: Limit::FrameBytes, asked: 131, max: 100 }), "{e}");
        let audit = Request::Audit { keys: keys(5) };
        assert_eq!(conn.count(&audit).map_err(|e| e.to_string()), Ok(1));
        assert_eq!(recv(&rx), audit, "the refused requests sent nothing");
    }

    #[test]
    fn daemon_errors_reach_the_caller_typed_and_keep_the_connection() {
        let limit = proto::WireError::LimitExceeded { limit: Limit::KeysPerRequest, asked: 9, max: 8 };
        let panicked = proto::WireError::Panicked { request: "Evict".into(), message: "boom".into() };
        let (conn, _rx) = scripted(vec![
            Reply::Error(proto::WireError::Protocol("a second hello".into())),
            Reply::Error(limit),
            Reply::Error(panicked),
            Reply::Error(proto::WireError::LeaseSettled),
            Reply::Error(proto::WireError::Other("no save 9 on this connection".into())),
            Reply::Count(7),
        ]);
        let e = conn.call(&Request::Stats).unwrap_err();
        assert!(matches!(&e, TierError::Protocol { reason } if reason == "a second hello"), "{e}");
        let e = conn.call(&Request::Query { keys: keys(9), uses: 1 }).unwrap_err();
        assert!(matches!(e, TierError::LimitExceeded { limit: Limit::KeysPerRequest, asked: 9, max: 8 }), "{e}");
        let e = conn.call(&Request::Evict { blocks: 1 }).unwrap_err();
        assert!(matches!(&e, TierError::Panicked { request, message } if request == "Evict" && message == "boom"));
        let e = conn.call(&Request::ReleaseLease { lease: 3 }).unwrap_err();
        assert!(matches!(e, TierError::LeaseSettled), "{e}");
        let e = conn.call(&Request::FinishSave { save: 9, outcome: Outcome::Done }).unwrap_err();
        assert!(
            matches!(&e, TierError::Protocol { reason } if reason.ends_with("no save 9 on this connection")),
            "{e}"
        );
        assert_eq!(conn.count(&Request::LiveHints).map_err(|e| e.to_string()), Ok(7));
    }

    #[test]
    fn a_call_from_another_process_is_refused_before_anything_is_sent() {
        let (mut conn, rx) = scripted(vec![Reply::Count(1)]);
        let me = std::process::id();
        conn.pid = me + 1;
        let e = conn.call(&Request::Stats).unwrap_err();
        assert!(matches!(e, TierError::ForkedChild { owner, current } if owner == me + 1 && current == me), "{e}");
        // One-way messages (a lease dropped in the child) are refused too.
        let e = conn.call(&Request::DropLease { lease: 5 }).unwrap_err();
        assert!(matches!(e, TierError::ForkedChild { .. }), "{e}");
        conn.pid = me;
        assert_eq!(conn.count(&Request::LiveHints).map_err(|e| e.to_string()), Ok(1));
        assert_eq!(recv(&rx), Request::LiveHints, "the refused calls sent nothing");
    }

    #[test]
    fn a_garbled_reply_is_a_typed_error() {
        let (ours, theirs) = UnixStream::pair().unwrap();
        let io = Io { reader: BufReader::new(ours.try_clone().unwrap()), writer: ours, buf: Vec::new(), lost: None };
        let conn = Conn { io: Mutex::new(io), instance: 1, pid: std::process::id(), limits: RequestLimits::PROTOCOL };
        std::thread::spawn(move || {
            let mut r = BufReader::new(theirs.try_clone().unwrap());
            let mut buf = Vec::new();
            let _ = proto::read_frame::<Request>(&mut r, &mut buf);
            // A frame whose payload is no reply (an unknown variant), then a length past the limit.
            let mut w = proto::NoSigPipe(&theirs);
            w.write_all(&[1, 0, 0, 0, 250]).unwrap();
            let _ = proto::read_frame::<Request>(&mut r, &mut buf);
        });
        let e = conn.call(&Request::Stats).unwrap_err();
        assert!(matches!(e, TierError::Disconnected { .. }), "{e}");
        // The stream is out of step: every later call says so, without touching the socket.
        let e = conn.call(&Request::Stats).unwrap_err();
        assert!(matches!(e, TierError::Disconnected { .. }), "{e}");
    }

    #[test]
    fn request_names_are_short() {
        assert_eq!(name(&Request::Query { keys: keys(100_000), uses: 1 }), "Query");
        assert_eq!(name(&Request::Stats), "Stats");
        assert_eq!(name(&Request::Evict { blocks: 3 }), "Evict");
    }
}
