//! The daemon side: serves one [`HostTier`] (with its pool in shared memory) to engine processes.
//!
//! One thread per connection runs the requests of [`super::proto`] against the tier with the same
//! code an in-process rank runs: [`HostTier::query_shared`] for queries, the save preparation
//! shared with [`crate::Rank::save_with`], and [`Lease`]'s restore claim, exactly as
//! [`crate::Rank::restore`] takes it. What a connection holds is its own:
//!
//! - **lease handles**: a lease lives while any connection holds a handle on it (the one that
//!   queried, and every one that opened its token); the last handle dropped settles it;
//! - **saves in flight**: `WRITING` slots reserved for the connection's copy, until it finishes
//!   them;
//! - **restores in flight**: the pins (and, until submitted, the use) of the connection's copy.
//!
//! **A dying engine loses nothing for the others.** When a connection ends, its lease handles are
//! dropped at once (its leases settle unless another process holds them). Its saves in flight
//! lose their index entries at once (the keys can be saved by others; the half-written blocks were
//! never visible) but their slots stay `WRITING`, and its restores keep their pins, until the
//! **process is gone**: the daemon holds a pidfd of each peer (from `SO_PEERPIDFD`, or
//! `pidfd_open` of the `SO_PEERCRED` pid) and a reaper thread returns the slots to the free list
//! (with a new generation) and drops the pins once it reports the exit, since a copy may run as
//! long as its process does. Without a pidfd they stay withheld for good. Copies whose outcome a
//! rank reported unknown (its backend panicked) are withheld the same way.

use super::proto::{self, Outcome, Reply, Request, WireAudit, WireBlock, WireError};
use crate::copy::Direction;
use crate::error::{Error, TierError};
use crate::guard::{SlotPins, WriteReservation};
use crate::lease::{Lease, RestoreClaim};
use crate::tier::core::{Core, Reserved};
use crate::tier::prepare::prepare_save;
use crate::tier::{Fit, HostTier, SaveOptions};
use std::collections::HashMap;
use std::io::{BufReader, IoSlice};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How often the reaper looks for exited processes.
const REAP_EVERY: Duration = Duration::from_millis(20);

struct LeaseEntry {
    lease: Lease,
    /// Handles on the lease, over all connections.
    holders: u64,
}

/// Slots and pins withheld for a process's copies until the process is gone.
struct Parked {
    pid: Option<u32>,
    pidfd: Option<OwnedFd>,
    reserved: Vec<Reserved>,
    pins: Vec<SlotPins>,
}

impl Parked {
    fn is_empty(&self) -> bool {
        self.reserved.is_empty() && self.pins.is_empty()
    }

    /// Returns every slot and pin to the tier (the process is gone).
    fn release(self, core: &Core) {
        let n: usize = self.pins.iter().map(|p| p.len()).sum();
        drop(self.pins);
        core.release_quarantined_pins(n);
        let slots = self.reserved.len();
        for r in self.reserved {
            core.release_quarantined(r);
        }
        tracing::info!("process {:?} is gone: released {slots} slots it was writing and {n} pins", self.pid);
    }
}

struct Shared {
    tier: HostTier,
    core: Arc<Core>,
    welcome: proto::Welcome,
    leases: Mutex<HashMap<u64, LeaseEntry>>,
    next_lease: AtomicU64,
    parked: Mutex<Vec<Parked>>,
}

impl Shared {
    /// Drops `n` handles on lease `id`; the lease settles (dropped) with the last one.
    fn drop_handles(&self, id: u64, n: u64) {
        let gone = {
            let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
            match leases.get_mut(&id) {
                Some(e) if e.holders > n => {
                    e.holders -= n;
                    None
                }
                Some(_) => leases.remove(&id),
                None => None,
            }
        };
        drop(gone); // settles outside the lock
    }
}

/// True once the process behind `pidfd` has exited.
fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, timeout 0: poll only reads and writes that struct.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

/// The peer's pid (`SO_PEERCRED`) and a pidfd of it (`SO_PEERPIDFD`, Linux 6.5; else
/// `pidfd_open`, Linux 5.3).
fn peer_process(stream: &UnixStream) -> (Option<u32>, Option<OwnedFd>) {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let pid = getsockopt(stream, PeerCredentials).ok().map(|c| c.pid()).filter(|&p| p > 0);
    // SO_PEERPIDFD is 77 in the generic socket option table (x86-64, arm64); elsewhere only
    // pidfd_open is tried.
    let (rc, fd) = if cfg!(any(target_arch = "x86_64", target_arch = "aarch64")) {
        const SO_PEERPIDFD: libc::c_int = 77;
        let mut fd: libc::c_int = -1;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `fd`, a live c_int.
        let rc = unsafe {
            libc::getsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                SO_PEERPIDFD,
                (&mut fd as *mut libc::c_int).cast(),
                &mut len,
            )
        };
        (rc, fd)
    } else {
        (-1, -1)
    };
    if rc == 0 && fd >= 0 {
        // SAFETY: the kernel made `fd` for us; nothing else owns it.
        return (pid.map(|p| p as u32), Some(unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    let Some(pid) = pid else { return (None, None) };
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return (Some(pid as u32), None);
    }
    // SAFETY: as above, a new fd owned by nobody else.
    (Some(pid as u32), Some(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

struct PendingSave {
    reservation: WriteReservation,
}

struct PendingRestore {
    claim: Option<RestoreClaim>,
    pins: SlotPins,
}

/// One connection's state.
struct Session {
    shared: Arc<Shared>,
    pid: Option<u32>,
    pidfd: Option<OwnedFd>,
    /// Lease id -> handles this connection holds.
    leases: HashMap<u64, u64>,
    saves: HashMap<u64, PendingSave>,
    restores: HashMap<u64, PendingRestore>,
    next_id: u64,
    parked: Vec<Reserved>,
    parked_pins: Vec<SlotPins>,
}

impl Session {
    fn id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// The lease `id`, which this connection must hold a handle on.
    fn lease(&self, id: u64) -> Result<Lease, TierError> {
        if !self.leases.contains_key(&id) {
            return Err(TierError::ForeignLease);
        }
        let leases = self.shared.leases.lock().unwrap_or_else(|p| p.into_inner());
        leases.get(&id).map(|e| e.lease.clone()).ok_or(TierError::LeaseSettled)
    }

    fn leased(lease: u64, l: &Lease) -> Reply {
        let blocks = l
            .blocks()
            .iter()
            .map(|b| WireBlock { key: b.key, slot: b.slot.slot.0, generation: b.slot.generation })
            .collect();
        Reply::Leased { lease, blocks }
    }

    fn handle(&mut self, req: Request) -> Result<Reply, TierError> {
        let core = self.shared.core.clone();
        let block_bytes = core.geometry().block_bytes();
        Ok(match req {
            Request::Hello { .. } => return Err(other("hello sent twice")),
            Request::Attach => Reply::Attached { rank: core.next_rank_id() },
            Request::Query { keys, uses } => {
                let lease = self.shared.tier.query_shared(&keys, uses);
                if lease.is_settled() {
                    return Ok(Self::leased(0, &lease));
                }
                let id = self.shared.next_lease.fetch_add(1, Ordering::Relaxed);
                let reply = Self::leased(id, &lease);
                self.shared
                    .leases
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id, LeaseEntry { lease, holders: 1 });
                *self.leases.entry(id).or_default() += 1;
                reply
            }
            Request::OpenLease { lease: id } => {
                let reply = {
                    let mut leases = self.shared.leases.lock().unwrap_or_else(|p| p.into_inner());
                    let e = leases.get_mut(&id).ok_or(TierError::LeaseSettled)?;
                    e.holders += 1;
                    Self::leased(id, &e.lease)
                };
                *self.leases.entry(id).or_default() += 1;
                reply
            }
            Request::DropLease { lease: id } => {
                if let Some(n) = self.leases.get_mut(&id) {
                    *n -= 1;
                    if *n == 0 {
                        self.leases.remove(&id);
                    }
                    self.shared.drop_handles(id, 1);
                }
                Reply::Done
            }
            Request::LeaseInfo { lease } => {
                let l = self.lease(lease)?;
                Reply::LeaseInfo { settled: l.is_settled(), expired: l.is_expired(), uses_left: l.uses_left() }
            }
            Request::ReleaseLease { lease } => Reply::Bool(self.lease(lease)?.release()),
            Request::ConsumeUse { lease } => {
                self.lease(lease)?.consume_without_copy();
                Reply::Done
            }
            Request::PrepareSave { keys, prefix, prefix_depth, parent } => {
                let mut opts = SaveOptions::new().fit(if prefix { Fit::Prefix } else { Fit::AllOrNothing });
                opts.prefix_depth = prefix_depth;
                opts.parent = parent;
                let p = prepare_save(&core, &keys, &opts)?;
                let slots: Vec<u32> = p.reservation.entries().iter().map(|r| r.slot.0).collect();
                let save = if slots.is_empty() {
                    0
                } else {
                    let id = self.id();
                    self.saves.insert(id, PendingSave { reservation: p.reservation });
                    id
                };
                Reply::SavePrepared {
                    save,
                    saving: p.saving.iter().map(|&i| i as u32).collect(),
                    slots,
                    resident: p.resident as u32,
                    in_flight: p.in_flight as u32,
                    duplicates: p.duplicates as u32,
                    dropped: p.dropped as u32,
                }
            }
            Request::FinishSave { save, outcome } => {
                let PendingSave { reservation } =
                    self.saves.remove(&save).ok_or_else(|| other(format!("no save {save} in flight")))?;
                let blocks = reservation.len() as u64;
                match outcome {
                    Outcome::Done => reservation.commit(),
                    Outcome::Failed | Outcome::NotSubmitted => drop(reservation),
                    Outcome::Unknown => {
                        self.parked.extend_from_slice(reservation.entries());
                        reservation.quarantine();
                    }
                }
                let bytes = if outcome == Outcome::NotSubmitted { 0 } else { blocks * block_bytes };
                core.counters.record_copy(Direction::Save, blocks, bytes, outcome == Outcome::Done);
                Reply::Done
            }
            Request::Restore { lease, blocks } => {
                let l = self.lease(lease)?;
                let mut claim = l.begin_restore(blocks as usize)?;
                let pins = claim.take_pins();
                let slots = pins.slots().iter().map(|s| s.0).collect();
                let id = self.id();
                self.restores.insert(id, PendingRestore { claim: Some(claim), pins });
                Reply::Restoring { restore: id, slots }
            }
            Request::RestoreSubmitted { restore } => {
                if let Some(claim) = self.restores.get_mut(&restore).and_then(|r| r.claim.take()) {
                    claim.submitted();
                }
                Reply::Done
            }
            Request::FinishRestore { restore, outcome } => {
                let PendingRestore { claim, pins } =
                    self.restores.remove(&restore).ok_or_else(|| other(format!("no restore {restore} in flight")))?;
                let blocks = pins.len() as u64;
                match outcome {
                    Outcome::NotSubmitted => {
                        // Pins first, then the use goes back (as an unsubmitted claim does).
                        drop(pins);
                        drop(claim);
                    }
                    Outcome::Done | Outcome::Failed => {
                        if let Some(c) = claim {
                            c.submitted();
                        }
                        drop(pins);
                    }
                    Outcome::Unknown => {
                        if let Some(c) = claim {
                            c.submitted();
                        }
                        core.record_quarantined_pins(pins.len());
                        self.parked_pins.push(pins);
                    }
                }
                let bytes = if outcome == Outcome::NotSubmitted { 0 } else { blocks * block_bytes };
                core.counters.record_copy(Direction::Restore, blocks, bytes, outcome == Outcome::Done);
                Reply::Done
            }
            Request::Contains { key } => Reply::Bool(self.shared.tier.contains(&key)),
            Request::Evict { blocks } => Reply::Count(self.shared.tier.evict(blocks as usize) as u64),
            Request::Hint { keys, ttl_ms } => {
                Reply::Count(self.shared.tier.hint(&keys, std::time::Duration::from_millis(ttl_ms)).get())
            }
            Request::WithdrawHint { id } => {
                Reply::Bool(self.shared.tier.withdraw_hint(crate::tier::HintId::from_number(id)))
            }
            Request::LiveHints => Reply::Count(self.shared.tier.live_hints() as u64),
            Request::ExpireLeases => Reply::Count(self.shared.tier.expire_leases() as u64),
            Request::Stats => Reply::Stats(self.shared.tier.stats().into()),
            Request::Audit { keys } => Reply::Audit(core.audit(&keys).map(|a| WireAudit {
                free: a.free as u64,
                writing: a.writing as u64,
                ready: a.ready as u64,
                evicting: a.evicting as u64,
                pinned: a.pinned as u64,
            })),
        })
    }

    /// The connection ended: drop its lease handles, and withhold what its copies may still touch
    /// until its process is gone.
    fn close(mut self) {
        for (id, n) in std::mem::take(&mut self.leases) {
            self.shared.drop_handles(id, n);
        }
        let core = self.shared.core.clone();
        for (_, PendingRestore { claim, pins }) in self.restores.drain() {
            // The copy may have been submitted: the use is spent, the pins wait for the process.
            if let Some(c) = claim {
                c.submitted();
            }
            core.record_quarantined_pins(pins.len());
            self.parked_pins.push(pins);
        }
        for (_, PendingSave { reservation }) in self.saves.drain() {
            self.parked.extend_from_slice(reservation.entries());
            reservation.quarantine();
        }
        let parked = Parked {
            pid: self.pid,
            pidfd: self.pidfd.take(),
            reserved: std::mem::take(&mut self.parked),
            pins: std::mem::take(&mut self.parked_pins),
        };
        if parked.is_empty() {
            return;
        }
        match &parked.pidfd {
            Some(fd) if exited(fd) => parked.release(&core),
            Some(_) => {
                tracing::info!(
                    "process {:?} disconnected with {} slots being written and {} pinned restores: \
                     withheld until it exits",
                    parked.pid,
                    parked.reserved.len(),
                    parked.pins.len()
                );
                self.shared.parked.lock().unwrap_or_else(|p| p.into_inner()).push(parked);
            }
            None => {
                tracing::warn!(
                    "process {:?} disconnected with copies in flight and no pidfd: {} slots and {} restores' pins \
                     are withheld for good",
                    parked.pid,
                    parked.reserved.len(),
                    parked.pins.len()
                );
                std::mem::forget(parked);
            }
        }
    }
}

fn other(m: impl Into<String>) -> TierError {
    TierError::Disconnected { reason: m.into() }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: getrandom writes at most 8 bytes into `b`.
    let n = unsafe { libc::getrandom(b.as_mut_ptr().cast(), 8, 0) };
    if n == 8 {
        u64::from_le_bytes(b)
    } else {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        t ^ ((std::process::id() as u64) << 32)
    }
}

/// The tier daemon's server: a [`HostTier`] with its pool in shared memory, a Unix socket, and a
/// thread per connected engine process. See the module docs and `docs/design.md`.
pub struct Server {
    listener: UnixListener,
    shared: Arc<Shared>,
    path: PathBuf,
}

impl Server {
    /// Listens on the Unix socket `path` for engines and serves `tier` to them. A socket file left
    /// at `path` by a daemon that is gone is replaced; one a live daemon listens on is an error.
    ///
    /// # Errors
    /// [`Error::Config`] if `tier`'s pool is not in shared memory (make it with
    /// [`HostTier::new_shared`]), if a daemon already listens at `path`, or if the socket cannot be
    /// bound.
    pub fn bind(path: impl AsRef<Path>, tier: HostTier) -> Result<Server, Error> {
        let path = path.as_ref().to_path_buf();
        if tier.pool().shared_fd().is_none() {
            return Err(Error::Config("the tier's pool is private: build it with HostTier::new_shared".into()));
        }
        if path.exists() {
            match UnixStream::connect(&path) {
                Ok(_) => return Err(Error::Config(format!("a tier daemon already listens at {}", path.display()))),
                Err(_) => {
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        let listener = UnixListener::bind(&path)
            .map_err(|e| Error::Config(format!("binding the socket {}: {e}", path.display())))?;
        let core = crate::testing::core(&tier).clone();
        let g = core.geometry();
        let pool = core.pool();
        let welcome = proto::Welcome {
            version: proto::PROTOCOL_VERSION,
            instance: random_u64(),
            pid: std::process::id(),
            model: g.model().to_string(),
            page_tokens: g.page_tokens(),
            shard: g.shard(),
            arenas: g
                .arenas()
                .iter()
                .map(|a| proto::WireArena {
                    name: a.name.clone(),
                    bytes_per_page: a.bytes_per_page,
                    page_stride: a.page_stride,
                    pages: a.pages,
                    fused: match a.placement {
                        crate::Placement::Own => None,
                        crate::Placement::Fused { buffer, offset } => Some((buffer, offset)),
                    },
                })
                .collect(),
            namespace: g.namespace(),
            slot_bytes: g.slot_bytes(),
            capacity: pool.capacity(),
            mapped_bytes: pool.mapped_bytes(),
            backing: pool.backing().name().to_string(),
            policy: core.policy().name().to_string(),
        };
        let shared = Arc::new(Shared {
            tier,
            core,
            welcome,
            leases: Mutex::new(HashMap::new()),
            next_lease: AtomicU64::new(1),
            parked: Mutex::new(Vec::new()),
        });
        Ok(Server { listener, shared, path })
    }

    /// The tier served.
    pub fn tier(&self) -> &HostTier {
        &self.shared.tier
    }

    /// The socket's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The random number naming this run of the daemon (in every lease token).
    pub fn instance(&self) -> u64 {
        self.shared.welcome.instance
    }

    /// Serves connections until accepting fails (blocking): a thread per connection, and a reaper
    /// thread that releases what dead processes' copies held.
    ///
    /// # Errors
    /// The listener's error.
    pub fn run(&self) -> std::io::Result<()> {
        let reaper = self.shared.clone();
        std::thread::Builder::new().name("kvtierd-reaper".into()).spawn(move || reap(&reaper))?;
        let mut n = 0u64;
        for stream in self.listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            n += 1;
            let shared = self.shared.clone();
            std::thread::Builder::new().name(format!("kvtierd-conn-{n}")).spawn(move || serve(shared, stream))?;
        }
        Ok(())
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("path", &self.path).field("instance", &self.instance()).finish()
    }
}

/// Releases parked slots and pins of processes that have exited.
fn reap(shared: &Shared) {
    loop {
        std::thread::sleep(REAP_EVERY);
        let done: Vec<Parked> = {
            let mut parked = shared.parked.lock().unwrap_or_else(|p| p.into_inner());
            let (gone, alive) =
                std::mem::take(&mut *parked).into_iter().partition(|p| p.pidfd.as_ref().is_some_and(exited));
            *parked = alive;
            gone
        };
        for p in done {
            p.release(&shared.core);
        }
    }
}

/// Sends the hello's answer: the marker byte (with the memfd when accepted), then the reply frame.
fn answer_hello(stream: &UnixStream, shared: &Shared, reply: &Reply, buf: &mut Vec<u8>) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let accepted = matches!(reply, Reply::Welcome(_));
    let marker = [if accepted { proto::MARKER_POOL } else { proto::MARKER_REFUSED }];
    let iov = [IoSlice::new(&marker)];
    let fd = shared.core.pool().shared_fd().expect("checked at bind").as_raw_fd();
    let fds = [fd];
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let cmsgs: &[ControlMessage<'_>] = if accepted { &cmsgs } else { &[] };
    sendmsg::<()>(stream.as_raw_fd(), &iov, cmsgs, MsgFlags::MSG_NOSIGNAL, None).map_err(std::io::Error::from)?;
    proto::write_frame(&mut proto::NoSigPipe(stream), reply, buf)
}

fn hello_reply(shared: &Shared, req: &Request) -> Reply {
    match req {
        Request::Hello { magic, version, namespace } => {
            if *magic != proto::MAGIC || *version != proto::PROTOCOL_VERSION {
                return Reply::Error(WireError::ProtocolMismatch { daemon: proto::PROTOCOL_VERSION, client: *version });
            }
            let ours = shared.welcome.namespace;
            if namespace.is_some_and(|n| n != ours) {
                return Reply::Error(WireError::GeometryMismatch {
                    backend: "the client's geometry (another namespace)".into(),
                    tier: shared.welcome.model.clone(),
                });
            }
            Reply::Welcome(shared.welcome.clone())
        }
        _ => Reply::Error(WireError::Other("the first message must be a hello".into())),
    }
}

fn serve(shared: Arc<Shared>, stream: UnixStream) {
    let (pid, pidfd) = peer_process(&stream);
    let mut buf = Vec::new();
    let Ok(read_half) = stream.try_clone() else { return };
    let mut reader = BufReader::new(read_half);
    let hello: Request = match proto::read_frame(&mut reader, &mut buf) {
        Ok(h) => h,
        Err(_) => return,
    };
    let reply = hello_reply(&shared, &hello);
    let accepted = matches!(reply, Reply::Welcome(_));
    if answer_hello(&stream, &shared, &reply, &mut buf).is_err() || !accepted {
        return;
    }
    tracing::info!("process {pid:?} connected");
    let mut session = Session {
        shared,
        pid,
        pidfd,
        leases: HashMap::new(),
        saves: HashMap::new(),
        restores: HashMap::new(),
        next_id: 0,
        parked: Vec::new(),
        parked_pins: Vec::new(),
    };
    let mut writer = proto::NoSigPipe(&stream);
    loop {
        let req: Request = match proto::read_frame(&mut reader, &mut buf) {
            Ok(r) => r,
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    tracing::warn!("process {pid:?}: {e}; closing its connection");
                }
                break;
            }
        };
        let one_way = req.is_one_way();
        let reply = session.handle(req).unwrap_or_else(|e| Reply::Error(WireError::from(&e)));
        if !one_way && proto::write_frame(&mut writer, &reply, &mut buf).is_err() {
            break;
        }
    }
    tracing::info!("process {pid:?} disconnected");
    session.close();
}
