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
//! (the daemon stopped or restarted) fails every later call with [`TierError::Disconnected`];
//! connect again to go on.

use super::proto::{self, Outcome, Reply, Request, WireBlock};
use crate::error::{Error, Limit, TierError};
use crate::evict::PolicyKind;
use crate::geometry::{ArenaSpec, Geometry, Placement};
use crate::key::ContentKey;
use crate::slab::pool::{Backing, HostPool, SharedPoolLayout};
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
    if crate::seeded::seeded("client-sends-oversized") {
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

pub(crate) fn lost(reason: impl Into<String>) -> TierError {
    TierError::Disconnected { reason: reason.into() }
}

pub(crate) fn unexpected(r: &Reply) -> TierError {
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
        if current != self.pid && !crate::seeded::seeded("forked-child-unchecked") {
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

    /// [`Conn::call`] for a request whose reply is `Done`.
    pub(crate) fn expect_done(&self, req: &Request) -> Result<(), TierError> {
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

    pub(crate) fn stats(&self) -> Result<proto::WireStats, TierError> {
        match self.call(&Request::Stats)? {
            Reply::Stats(s) => Ok(s),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's SSD tier's counters (`None` without one).
    pub(crate) fn ssd_stats(&self) -> Result<Option<proto::WireSsdStats>, TierError> {
        match self.call(&Request::SsdStats)? {
            Reply::SsdStats(s) => Ok(s),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's client processes but this connection's own.
    pub(crate) fn clients(&self) -> Result<Vec<proto::WireClient>, TierError> {
        match self.call(&Request::Clients)? {
            Reply::Clients(c) => Ok(c),
            r => Err(unexpected(&r)),
        }
    }

    /// The daemon's audit of its tier over `keys` (the inner `Err` names the first violated
    /// invariant).
    pub(crate) fn audit(&self, keys: &[ContentKey]) -> Result<Result<proto::WireAudit, String>, TierError> {
        match self.call(&Request::Audit { keys: keys.to_vec() })? {
            Reply::Audit(r) => Ok(r),
            r => Err(unexpected(&r)),
        }
    }
}

/// A save the daemon prepared ([`Conn::prepare_save`]): slots reserved for the keys at `saving`.
#[derive(Debug)]
pub(crate) struct PreparedSave {
    /// The daemon's id of the save (0 if nothing is saved).
    pub(crate) save: u64,
    /// Indices into the keys of those saved, one per slot of `slots`.
    pub(crate) saving: Vec<usize>,
    /// The slots reserved (WRITING) for them.
    pub(crate) slots: Vec<u32>,
    /// Keys already resident.
    pub(crate) resident: usize,
    /// Keys being saved by another save.
    pub(crate) in_flight: usize,
    /// Keys repeated in this save.
    pub(crate) duplicates: usize,
    /// Keys dropped (did not fit or were not admitted).
    pub(crate) dropped: usize,
}

impl Conn {
    /// Asks the daemon to plan a save of `keys` (the daemon's fit, eviction and reservations).
    /// Whatever it prepared that this call did not ask for is given back and refused.
    ///
    /// # Errors
    /// The daemon's [`TierError`]; [`TierError::Disconnected`], also for a plan naming keys or
    /// slots out of range (`capacity`: the pool's slots).
    pub(crate) fn prepare_save(
        &self,
        keys: &[ContentKey],
        prefix: bool,
        prefix_depth: Option<u32>,
        parent: Option<ContentKey>,
        capacity: u32,
    ) -> Result<PreparedSave, TierError> {
        let req = Request::PrepareSave { keys: keys.to_vec(), prefix, prefix_depth, parent };
        let p = match self.call(&req)? {
            Reply::SavePrepared { save, saving, slots, resident, in_flight, duplicates, dropped } => PreparedSave {
                save,
                saving: saving.into_iter().map(|i| i as usize).collect(),
                slots,
                resident: resident as usize,
                in_flight: in_flight as usize,
                duplicates: duplicates as usize,
                dropped: dropped as usize,
            },
            r => return Err(unexpected(&r)),
        };
        if p.saving.len() != p.slots.len()
            || p.saving.iter().any(|&i| i >= keys.len())
            || p.slots.iter().any(|&s| s >= capacity)
        {
            if p.save != 0 {
                let _ =
                    self.call(&Request::FinishSave { save: p.save, outcome: Outcome::NotSubmitted, latency_ns: None });
            }
            return Err(lost("the daemon prepared a save this rank did not ask for"));
        }
        Ok(p)
    }

    /// Asks for a lease on the longest ready prefix of `keys` with `uses` restores: the daemon's
    /// lease and its blocks, checked to be a prefix of `keys` within `capacity` slots.
    ///
    /// # Errors
    /// The daemon's [`TierError`]; [`TierError::Disconnected`].
    pub(crate) fn query(
        self: &Arc<Self>,
        keys: &[ContentKey],
        uses: u32,
        capacity: u32,
    ) -> Result<(RemoteLease, Vec<WireBlock>, Vec<crate::source::BlockSource>), TierError> {
        match self.call(&Request::Query { keys: keys.to_vec(), uses })? {
            Reply::Leased { lease, blocks, sources } => {
                check_blocks(Some(keys), &blocks, &sources, capacity)?;
                Ok((RemoteLease { conn: self.clone(), id: lease }, blocks, sources))
            }
            r => Err(unexpected(&r)),
        }
    }

    /// Opens the lease `token` names, taking a handle on it.
    ///
    /// # Errors
    /// [`TierError::ForeignLease`] for a token of another daemon run; the daemon's
    /// [`TierError`]; [`TierError::Disconnected`].
    pub(crate) fn open_lease(
        self: &Arc<Self>,
        token: &LeaseToken,
        capacity: u32,
    ) -> Result<(RemoteLease, Vec<WireBlock>, Vec<crate::source::BlockSource>), TierError> {
        if token.instance != self.instance {
            return Err(TierError::ForeignLease);
        }
        match self.call(&Request::OpenLease { instance: token.instance, lease: token.lease })? {
            Reply::Leased { lease, blocks, sources } => {
                check_blocks(None, &blocks, &sources, capacity)?;
                Ok((RemoteLease { conn: self.clone(), id: lease }, blocks, sources))
            }
            r => Err(unexpected(&r)),
        }
    }
}

/// Refuses leased blocks that are not a prefix of `keys` (when given) or name slots beyond
/// `capacity`, and sources that are neither empty nor one per block.
fn check_blocks(
    keys: Option<&[ContentKey]>,
    wire: &[WireBlock],
    sources: &[crate::source::BlockSource],
    capacity: u32,
) -> Result<(), TierError> {
    let asked = |i: usize, b: &WireBlock| keys.is_none_or(|k| k[i] == b.key);
    if !sources.is_empty() && sources.len() != wire.len() {
        return Err(lost("the daemon named sources for another number of blocks than it leased"));
    }
    if keys.is_some_and(|k| wire.len() > k.len())
        || wire.iter().any(|b| b.slot >= capacity)
        || !wire.iter().enumerate().all(|(i, b)| asked(i, b))
    {
        return Err(lost("the daemon leased blocks this query did not ask for"));
    }
    Ok(())
}

/// A lease held by the tier daemon, as a process sees it (see [`crate::Lease`]).
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
    /// A lease settled from birth over `conn` (nothing leased; the daemon holds nothing for it).
    pub(crate) fn settled(conn: Arc<Conn>) -> RemoteLease {
        RemoteLease { conn, id: 0 }
    }

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

    /// The connection the lease was leased over.
    pub(crate) fn conn(&self) -> &Arc<Conn> {
        &self.conn
    }

    /// The daemon's lease id; 0 for a lease settled from birth.
    pub(crate) fn id(&self) -> u64 {
        self.id
    }

    /// This lease as a token (`None` for a lease settled from birth: nothing to share).
    pub(crate) fn token(&self) -> Option<LeaseToken> {
        (self.id != 0).then_some(LeaseToken { instance: self.conn.instance, lease: self.id })
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

/// A lease of a connected tier as bytes another process can open ([`crate::Lease::token`],
/// [`crate::HostTier::open_lease`]): the daemon run and the lease id. 16 bytes.
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

/// How [`crate::HostTier::connect_with`] connects: the namespace to check and the uid the daemon must
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
    /// as [`crate::HostTier::connect_as`] does.
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
    if found != expected && found != 0 && !crate::seeded::seeded("daemon-uid-unchecked") {
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

/// A connection made ([`connect`]): the connection, and the daemon's geometry, pool (mapped here)
/// and policy.
pub(crate) struct Connected {
    pub(crate) conn: Conn,
    pub(crate) geometry: Geometry,
    pub(crate) pool: HostPool,
    pub(crate) policy: PolicyKind,
}

/// Why a connect to `path` failed, for [`TierError::Disconnected`]'s reason. Where nothing
/// listens there (no socket file, `ENOENT`, or a stale one, `ECONNREFUSED`), no daemon ever ran or
/// it stopped: the reason says so and how to start `kvtierd` on that path.
fn connect_failure(path: &Path, e: &std::io::Error) -> String {
    use std::io::ErrorKind;
    if !matches!(e.kind(), ErrorKind::NotFound | ErrorKind::ConnectionRefused) {
        return format!("connecting to the tier daemon at {}: {e}", path.display());
    }
    let socket = if path == crate::remote::default_socket_path() {
        String::new()
    } else {
        format!(" --socket {}", path.display())
    };
    format!(
        "nothing listens at {} ({e}): no tier daemon runs there; start one with \
         `kvtierd --geometry PRESET --pool SIZE{socket}` (from a source checkout: \
         `cargo run --release -p kvtierd -- --geometry PRESET --pool SIZE{socket}`)",
        path.display()
    )
}

/// Connects to the tier daemon at `path` (see [`crate::HostTier::connect`]).
///
/// # Errors
/// As [`crate::HostTier::connect`].
pub(crate) fn connect(path: &Path, opts: &ConnectOptions) -> Result<Connected, Error> {
    let expect = opts.geometry.as_ref();
    let stream = UnixStream::connect(path).map_err(|e| lost(connect_failure(path, &e)))?;
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
    let conn = Conn {
        io: Mutex::new(Io { reader, writer: stream, buf, lost: None }),
        instance: w.instance,
        pid: std::process::id(),
        limits: RequestLimits::of_daemon(&w.limits),
    };
    Ok(Connected { conn, geometry, pool, policy })
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
        let e = conn.call(&Request::FinishSave { save: 9, outcome: Outcome::Done, latency_ns: None }).unwrap_err();
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
