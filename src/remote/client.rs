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
use crate::copy::{CopyPair, Direction, WaitFor};
use crate::error::{Error, TierError};
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
use std::io::{BufReader, IoSliceMut};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a call waits for the daemon's reply before it gives the connection up.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// Sends `req` and, unless it is one-way, waits for its reply. A daemon error comes back as
    /// its [`TierError`]; an I/O or protocol failure marks the connection lost.
    pub(crate) fn call(&self, req: &Request) -> Result<Reply, TierError> {
        if std::process::id() != self.pid {
            return Err(lost(format!(
                "this connection belongs to process {} (a forked child must connect again)",
                self.pid
            )));
        }
        let mut guard = self.io.lock().unwrap_or_else(|p| p.into_inner());
        let Io { reader, writer, buf, lost: why } = &mut *guard;
        if let Some(r) = why {
            return Err(lost(r.clone()));
        }
        let r = proto::write_frame(&mut proto::NoSigPipe(writer), req, buf).and_then(|()| {
            if req.is_one_way() {
                Ok(Reply::Done)
            } else {
                proto::read_frame(reader, buf)
            }
        });
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
        }
    }
}

/// [`Rank::save_with`] of a rank of a connected tier (lengths and pages already checked): the
/// daemon prepares the save, this process copies, then tells the daemon how the copy ended.
pub(crate) fn save(
    rank: &Rank,
    conn: &Arc<Conn>,
    keys: &[ContentKey],
    gpu_pages: &[u64],
    wait: WaitFor,
    opts: SaveOptions,
) -> Result<SaveTicket, TierError> {
    save_how(rank, conn, keys, gpu_pages, Launch::Whole(wait), opts)
}

/// [`save`], submitted whole-block or layer-wise ([`Rank::save_layers`]).
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
    match unsafe { rank.launch_how(Direction::Save, &batch, how, settle) } {
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

/// [`Rank::restore`] from a lease of a connected tier (lease and rank checked to share the tier):
/// the daemon takes the restore's pins and a use, this process copies, then tells the daemon.
pub(crate) fn restore(
    rank: &Rank,
    lease: &RemoteLease,
    gpu_pages: &[u64],
    wait: WaitFor,
) -> Result<CopyHandle, TierError> {
    restore_how(rank, lease, gpu_pages, Launch::Whole(wait))
}

/// [`restore`], submitted whole-block or layer-wise ([`Rank::restore_layers`]).
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
    match unsafe { rank.launch_how(Direction::Restore, &batch, how, settle) } {
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

fn connect_impl(path: &Path, expect: Option<&Geometry>) -> Result<HostTier, Error> {
    let stream = UnixStream::connect(path)
        .map_err(|e| lost(format!("connecting to the tier daemon at {}: {e}", path.display())))?;
    let io_err = |e: std::io::Error| Error::Tier(lost(describe(&e)));
    stream.set_read_timeout(Some(REPLY_TIMEOUT)).map_err(io_err)?;
    let mut buf = Vec::new();
    let hello = Request::Hello {
        magic: proto::MAGIC,
        version: proto::PROTOCOL_VERSION,
        namespace: expect.map(|g| g.namespace()),
    };
    proto::write_frame(&mut proto::NoSigPipe(&stream), &hello, &mut buf).map_err(io_err)?;
    let (marker, fd) = recv_marker(&stream).map_err(io_err)?;
    let mut reader = BufReader::new(stream.try_clone().map_err(io_err)?);
    let reply: Reply = proto::read_frame(&mut reader, &mut buf).map_err(io_err)?;
    let welcome = match (marker, reply, fd) {
        (proto::MARKER_POOL, Reply::Welcome(w), Some(fd)) => (w, fd),
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
    /// Connect after forking: a connection serves the process that made it.
    ///
    /// # Errors
    /// [`Error::Tier`] with [`TierError::Disconnected`] (no daemon at `path`, or it hung up),
    /// [`TierError::ProtocolMismatch`]; [`Error::Pool`] if the pool cannot be mapped; [`Error::Tier`]
    /// with [`TierError::Index`] (never for the one-entry local index).
    pub fn connect(path: impl AsRef<Path>) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), None)
    }

    /// [`HostTier::connect`], checking that the daemon serves `geometry`'s namespace (model, page
    /// size, arenas and shard).
    ///
    /// # Errors
    /// As [`HostTier::connect`]; [`TierError::GeometryMismatch`] if the daemon's namespace differs.
    pub fn connect_as(path: impl AsRef<Path>, geometry: &Geometry) -> Result<HostTier, Error> {
        connect_impl(path.as_ref(), Some(geometry))
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
        match conn.call(&Request::OpenLease { lease: token.lease })? {
            Reply::Leased { lease, blocks } => {
                let core = self.core();
                let blocks = blocks_of(None, blocks, core.pool().capacity())?;
                Ok(Lease::remote_lease(core, blocks, RemoteLease { conn: conn.clone(), id: lease }))
            }
            r => Err(unexpected(&r)),
        }
    }
}
