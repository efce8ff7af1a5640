//! The daemon side: serves one [`HostTier`] (with its pool in shared memory) to engine processes.
//!
//! One thread per connection runs the requests of `crate::remote::proto` against the tier with the same
//! code an in-process rank runs: [`HostTier::query_shared`] for queries, the save preparation
//! shared with [`crate::Rank::save_with`], and [`Lease`]'s restore hold, exactly as
//! [`crate::Rank::restore`] takes it. What a connection holds is its own:
//!
//! - **lease handles**: a lease lives while any connection holds a handle on it (the one that
//!   queried, and every one that opened its token); the last handle dropped settles it. Lease ids
//!   are random 64-bit numbers, so a connection can only name a lease it was given (a token);
//! - **saves in flight**: `WRITING` slots reserved for the connection's copy, until it finishes
//!   them;
//! - **restores in flight**: the pins (and, until submitted, the use) of the connection's copy;
//! - **hints**: withdrawn when the connection ends.
//!
//! Every one of these is bounded per connection ([`Limits`]), and so is what a connection makes
//! the daemon hold while it reads (a frame's buffer grows only as its bytes arrive, up to
//! [`Limits::frame_bytes`]); the number of connections is bounded too, in all and per process. A
//! request over a bound is answered [`WireError::LimitExceeded`] and does nothing; the connection
//! stays usable.
//!
//! **A session ends the same way however it ends**: the client closed the socket, a read or write
//! failed or timed out, the process that said hello is gone (the daemon watches its pidfd, so a
//! forked child that still holds the socket does not keep the session alive), or the connection's
//! thread unwound: the session's `Drop` does what its close does. Each request runs under
//! `catch_unwind`: a panic fails that request with [`WireError::Panicked`] and the session's state
//! stays as it was before the request (every map entry changes only after the work that can fail).
//!
//! **A dying engine loses nothing for the others.** When a session ends, its lease handles are
//! dropped at once (its leases settle unless another process holds them) and its hints are
//! withdrawn. Its saves in flight lose their index entries at once (the keys can be saved by
//! others; the half-written blocks were never visible) but their slots stay `WRITING`, and its
//! restores keep their pins, until the **process is gone**: the daemon holds a pidfd of each peer
//! (from `SO_PEERPIDFD`, or `pidfd_open` of the `SO_PEERCRED` pid) and a reaper thread returns the
//! slots to the free list (with a new generation) and drops the pins once it reports the exit,
//! since a copy may run as long as its process does. Without a pidfd they stay withheld for good.
//! Copies whose outcome a rank reported unknown (its backend panicked) are withheld the same way.

use crate::copy::Direction;
use crate::error::{Error, Limit, LimitsError, TierError};
use crate::key::ContentKey;
use crate::remote::proto::{self, Incoming, Outcome, Reply, Request, WireAudit, WireBlock, WireError, WireLimits};
use crate::tier::core::{Core, Reserved};
use crate::tier::lease::{Lease, RestoreHold};
use crate::tier::pins::{SlotPins, WriteReservation};
use crate::tier::prepare::prepare_save;
use crate::tier::{Fit, HostTier, SaveOptions};
use std::collections::{HashMap, HashSet};
use std::io::{BufReader, IoSlice, Read};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// How often the reaper looks for exited processes and closes refused connections.
const REAP_EVERY: Duration = Duration::from_millis(20);
/// How long a refused connection is kept open (its hello drained) so the refusal reaches it.
const REFUSED_LINGER: Duration = Duration::from_secs(1);
/// Refused connections kept lingering at once; beyond this they are closed at once.
const MAX_REFUSED: usize = 64;
/// A connection's frame buffers are given back past this capacity, bytes (an idle connection holds
/// at most this much after a large request).
const KEEP_BUFFER: usize = 1 << 20;

/// Every bound the daemon holds a connection to. A request over one is answered
/// [`WireError::LimitExceeded`] (the [`Limit`] named) and does nothing. The welcome sends them
/// ([`WireLimits`]) so a client can check before sending. Defaults in parentheses; `kvtierd`'s
/// flag for each in the field's docs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Connections served at once (256, `--max-connections`); one more is refused with
    /// [`Limit::Connections`] and closed, the daemon goes on.
    pub connections: usize,
    /// Connections one process (its pid from `SO_PEERCRED`) has open at once (16,
    /// `--max-connections-per-process`); one more is refused with
    /// [`Limit::ConnectionsPerProcess`] and closed. Connections may idle between frames, so
    /// without this one process opening [`Limits::connections`] connections would lock every
    /// other engine out. A connection counts from accept until its thread ends, however it ends.
    pub connections_per_process: usize,
    /// Time from accept to a complete hello (5 s, `--hello-timeout`); past it the connection is
    /// closed.
    pub hello_timeout: Duration,
    /// Time a frame may take to arrive once its length prefix has begun (30 s, `--frame-timeout`);
    /// past it the connection is closed. Between frames a connection may idle for ever.
    pub frame_timeout: Duration,
    /// Time a reply may wait for the client to take it (30 s, `--write-timeout`); past it the
    /// connection is closed (a client that never reads its replies).
    pub write_timeout: Duration,
    /// Largest request frame payload, bytes (24 MiB = 25,165,824 B, `--max-frame-bytes`; at most
    /// [`proto::MAX_FRAME`]). A larger frame is read and discarded in 4 KiB pieces and answered
    /// [`Limit::FrameBytes`].
    pub frame_bytes: usize,
    /// Keys one query, save, hint or audit may name (2^20 = 1,048,576, `--max-keys-per-request`).
    pub keys_per_request: usize,
    /// Hints one connection holds at once (1,024, `--max-hints`).
    pub hints_per_connection: usize,
    /// Distinct keys over one connection's live hints (2^20, `--max-hint-keys`).
    pub hint_keys_per_connection: usize,
    /// Lease handles one connection holds at once (2,048, `--max-leases`).
    pub leases_per_connection: usize,
    /// Blocks over the lease handles one connection holds, each handle (a query's or an
    /// `OpenLease`'s) counting its lease's blocks (262,144 = 2^18, `--max-leased-blocks`); a query
    /// naming more distinct keys than are left, or an `OpenLease` of a larger lease, is refused with
    /// [`Limit::LeasedBlocksPerConnection`]. A lease pins each of its slots once, so leases hold at
    /// most `connections × min(leases_per_connection, leased_blocks_per_connection)` pins of one
    /// slot; binding refuses limits whose product exceeds half of
    /// [`crate::slab::slot::SlotWord::LEASE_PINS`], so no number of leases makes a block unleasable.
    pub leased_blocks_per_connection: usize,
    /// Saves and restores one connection has in flight, or withheld after an unknown outcome, at
    /// once (4,096, `--max-copies`).
    pub copies_per_connection: usize,
    /// Uses one lease may have (1,024, `--max-lease-uses`).
    pub lease_uses: u32,
    /// Slots one process (its pid from `SO_PEERCRED`) holds `WRITING` for saves in flight or
    /// withheld after a save's unknown outcome, over all its connections at once (0: half the
    /// pool's capacity, at least 1; `--max-slots-per-process`). A save naming more keys than the
    /// process has left is refused with [`Limit::SlotsPerProcess`] before anything is reserved, so
    /// one process cannot take every slot, and a process that parks slots connection after
    /// connection stops at this bound (its parked slots share one pidfd).
    pub slots_per_process: usize,
    /// Stack size of a connection's thread, bytes (256 KiB, `--thread-stack`).
    pub thread_stack_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connections: 256,
            connections_per_process: 16,
            hello_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            frame_bytes: 24 << 20,
            keys_per_request: 1 << 20,
            hints_per_connection: 1024,
            hint_keys_per_connection: 1 << 20,
            leases_per_connection: 2048,
            leased_blocks_per_connection: 1 << 18,
            copies_per_connection: 4096,
            lease_uses: 1024,
            slots_per_process: 0,
            thread_stack_bytes: 256 << 10,
        }
    }
}

impl Limits {
    /// The limits as the welcome sends them.
    pub fn wire(&self) -> WireLimits {
        let ms = |d: Duration| d.as_millis().min(u64::MAX as u128) as u64;
        WireLimits {
            frame_bytes: self.frame_bytes as u64,
            keys_per_request: self.keys_per_request as u64,
            hints_per_connection: self.hints_per_connection as u64,
            hint_keys_per_connection: self.hint_keys_per_connection as u64,
            leases_per_connection: self.leases_per_connection as u64,
            copies_per_connection: self.copies_per_connection as u64,
            lease_uses: self.lease_uses as u64,
            connections: self.connections as u64,
            frame_timeout_ms: ms(self.frame_timeout),
            write_timeout_ms: ms(self.write_timeout),
        }
    }

    fn check(&self) -> Result<(), Error> {
        let zero = |d: Duration| d.is_zero();
        if self.connections == 0
            || self.connections_per_process == 0
            || zero(self.hello_timeout)
            || zero(self.frame_timeout)
            || zero(self.write_timeout)
        {
            return Err(LimitsError::Zero.into());
        }
        let now = Instant::now();
        for (name, t) in [("hello", self.hello_timeout), ("frame", self.frame_timeout), ("write", self.write_timeout)] {
            // Each connection computes `now + t`: a timeout the clock cannot add is refused here.
            if now.checked_add(t).and_then(|x| x.checked_add(Duration::from_secs(365 * 86_400))).is_none() {
                return Err(LimitsError::TimeoutTooLarge { which: name, timeout: t }.into());
            }
        }
        let per_slot =
            (self.connections as u128) * (self.leases_per_connection.min(self.leased_blocks_per_connection) as u128);
        let pins = crate::slab::slot::SlotWord::LEASE_PINS as u128 / 2;
        if per_slot > pins && !cfg!(kvtier_seeded_bug = "leased-blocks-unbounded") {
            return Err(LimitsError::LeasePins {
                connections: self.connections,
                leases: self.leases_per_connection,
                leased_blocks: self.leased_blocks_per_connection,
                pins_per_slot: per_slot,
                max: pins,
            }
            .into());
        }
        if self.frame_bytes > proto::MAX_FRAME {
            return Err(LimitsError::FrameTooLarge { bytes: self.frame_bytes, max: proto::MAX_FRAME }.into());
        }
        Ok(())
    }
}

/// How the daemon is set up besides its tier: its [`Limits`] and who may connect.
#[derive(Clone, Debug, Default)]
pub struct ServerConfig {
    /// The bounds every connection is held to.
    pub limits: Limits,
    /// `None`: the socket is `0600`, only the daemon's uid may connect. `Some(gid)`: the socket is
    /// `0660` and belongs to group `gid`, whose members may connect too (`kvtierd --group NAME`);
    /// the socket's directory must let them reach it (one [`Server::bind_with`] creates is `0750`
    /// and of that group).
    pub group: Option<u32>,
}

fn limit(limit: Limit, asked: usize, max: usize) -> TierError {
    TierError::LimitExceeded { limit, asked: asked as u64, max: max as u64 }
}

fn misuse(reason: impl Into<String>) -> TierError {
    if cfg!(kvtier_seeded_bug = "misuse-untyped") {
        return TierError::Disconnected { reason: reason.into() };
    }
    TierError::Protocol { reason: reason.into() }
}

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

type PanicHook = Box<dyn Fn(&Request) -> bool + Send + Sync>;

struct Shared {
    tier: HostTier,
    core: Arc<Core>,
    welcome: proto::Welcome,
    limits: Limits,
    leases: Mutex<HashMap<u64, LeaseEntry>>,
    parked: Mutex<Vec<Parked>>,
    /// Slots each process (by pid) holds being written or withheld, over its connections.
    slots_held: Mutex<HashMap<Option<u32>, usize>>,
    /// [`Limits::slots_per_process`] resolved against the pool's capacity.
    slot_bound: usize,
    /// Connections open now (each counted from accept until its thread ends).
    live: AtomicUsize,
    /// Connections open now by each process (pid from `SO_PEERCRED`), counted like [`Shared::live`].
    live_by_pid: Mutex<HashMap<u32, usize>>,
    /// Refused connections kept open a moment so the refusal reaches the client.
    refused: Mutex<Vec<(Arc<UnixStream>, Instant)>>,
    /// Tests: requests for which this returns true panic in the daemon (see
    /// [`Server::panic_on_requests`]).
    panic_hook: OnceLock<PanicHook>,
}

impl Shared {
    fn new(tier: HostTier, limits: Limits) -> Shared {
        let core = tier.core().clone();
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
            limits: limits.wire(),
        };
        let slot_bound = match limits.slots_per_process {
            0 => (pool.capacity() as usize / 2).max(1),
            n => n,
        };
        Shared {
            tier,
            core,
            welcome,
            limits,
            leases: Mutex::new(HashMap::new()),
            parked: Mutex::new(Vec::new()),
            slots_held: Mutex::new(HashMap::new()),
            slot_bound,
            live: AtomicUsize::new(0),
            live_by_pid: Mutex::new(HashMap::new()),
            refused: Mutex::new(Vec::new()),
            panic_hook: OnceLock::new(),
        }
    }

    /// Takes `n` slots of process `pid`'s bound, or refuses with [`Limit::SlotsPerProcess`].
    fn take_slots(&self, pid: Option<u32>, n: usize) -> Result<(), TierError> {
        let mut held = self.slots_held.lock().unwrap_or_else(|p| p.into_inner());
        let h = held.entry(pid).or_default();
        if h.saturating_add(n) > self.slot_bound && !cfg!(kvtier_seeded_bug = "slots-unbounded-per-process") {
            return Err(limit(Limit::SlotsPerProcess, h.saturating_add(n), self.slot_bound));
        }
        *h += n;
        Ok(())
    }

    /// Gives `n` slots back to process `pid`'s bound.
    fn give_slots(&self, pid: Option<u32>, n: usize) {
        let mut held = self.slots_held.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(h) = held.get_mut(&pid) {
            *h = h.saturating_sub(n);
            if *h == 0 {
                held.remove(&pid);
            }
        }
    }

    /// Returns what a gone process withheld to the tier and its slots to its bound.
    fn release_parked(&self, p: Parked) {
        let (pid, slots) = (p.pid, p.reserved.len());
        p.release(&self.core);
        self.give_slots(pid, slots);
    }

    /// Withholds `p` until its process exits: merged into the entry of the same process (one
    /// pidfd a process, however many connections it parked from); an entry of an exited process
    /// with the same pid (a reused pid) is released first.
    fn park(&self, mut p: Parked) {
        let gone = {
            let mut parked = self.parked.lock().unwrap_or_else(|e| e.into_inner());
            let mut gone = None;
            let same = if cfg!(kvtier_seeded_bug = "parked-pidfd-per-connection") {
                None
            } else {
                parked.iter().position(|q| q.pid == p.pid)
            };
            if let Some(i) = same {
                if parked[i].pidfd.as_ref().is_some_and(exited) {
                    gone = Some(parked.swap_remove(i));
                } else {
                    let q = &mut parked[i];
                    q.reserved.append(&mut p.reserved);
                    q.pins.append(&mut p.pins);
                    return; // p's own pidfd closes here
                }
            }
            parked.push(p);
            gone
        };
        if let Some(g) = gone {
            self.release_parked(g);
        }
    }

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

    /// Registers `lease` under a new random id with one handle.
    fn register(&self, lease: Lease) -> u64 {
        let mut leases = self.leases.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            #[cfg(kvtier_seeded_bug = "sequential-lease-ids")]
            let id = leases.keys().max().map_or(1, |m| m + 1);
            #[cfg(not(kvtier_seeded_bug = "sequential-lease-ids"))]
            let id = random_u64();
            if id != 0 && !leases.contains_key(&id) {
                leases.insert(id, LeaseEntry { lease, holders: 1 });
                return id;
            }
        }
    }
}

/// One connection counted in [`Shared::live`] (and in [`Shared::live_by_pid`] under its
/// process's pid, once [`ConnSlot::count_process`] took it) until dropped, however its thread ends.
struct ConnSlot(Arc<Shared>, Option<u32>);

impl ConnSlot {
    /// Counts this connection against process `pid`'s [`Limits::connections_per_process`]; over the
    /// bound, counts nothing and returns how many the process would have open (with this one).
    fn count_process(&mut self, pid: u32) -> Result<(), usize> {
        let mut by_pid = self.0.live_by_pid.lock().unwrap_or_else(|p| p.into_inner());
        let n = by_pid.entry(pid).or_default();
        if *n >= self.0.limits.connections_per_process && !cfg!(kvtier_seeded_bug = "no-per-process-connection-limit") {
            let asked = *n + 1;
            if *n == 0 {
                by_pid.remove(&pid);
            }
            return Err(asked);
        }
        *n += 1;
        self.1 = Some(pid);
        Ok(())
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        if let Some(pid) = self.1 {
            let mut by_pid = self.0.live_by_pid.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = by_pid.get_mut(&pid) {
                *n -= 1;
                if *n == 0 {
                    by_pid.remove(&pid);
                }
            }
        }
        self.0.live.fetch_sub(1, Ordering::AcqRel);
    }
}

/// True once the process behind `pidfd` has exited.
fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, timeout 0: poll only reads and writes that struct.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0
}

/// What the peer of a connection is.
#[derive(Copy, Clone, Debug)]
struct Peer {
    pid: Option<u32>,
    uid: Option<u32>,
    gid: Option<u32>,
}

/// The pid of the process that connected (`SO_PEERCRED`), if the kernel names one.
fn peer_pid(stream: &UnixStream) -> Option<u32> {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    getsockopt(stream, PeerCredentials).ok().map(|c| c.pid()).filter(|&p| p > 0).map(|p| p as u32)
}

/// The peer's credentials (`SO_PEERCRED`: the process that connected) and a pidfd of that process
/// (`SO_PEERPIDFD`, Linux 6.5; else `pidfd_open`, Linux 5.3).
fn peer_process(stream: &UnixStream) -> (Peer, Option<OwnedFd>) {
    use nix::sys::socket::{getsockopt, sockopt::PeerCredentials};
    let cred = getsockopt(stream, PeerCredentials).ok();
    let pid = cred.map(|c| c.pid()).filter(|&p| p > 0);
    let peer = Peer { pid: pid.map(|p| p as u32), uid: cred.map(|c| c.uid()), gid: cred.map(|c| c.gid()) };
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
        return (peer, Some(unsafe { OwnedFd::from_raw_fd(fd) }));
    }
    let Some(pid) = pid else { return (peer, None) };
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return (peer, None);
    }
    // SAFETY: as above, a new fd owned by nobody else.
    (peer, Some(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

/// A save in flight. Dropped without [`PendingSave::take`] (an unwind anywhere), its slots are
/// withheld for good: the writer may be alive and still copying into them.
struct PendingSave {
    reservation: Option<WriteReservation>,
}

impl PendingSave {
    fn take(mut self) -> WriteReservation {
        self.reservation.take().expect("a pending save's reservation is taken once")
    }
}

impl Drop for PendingSave {
    fn drop(&mut self) {
        if let Some(r) = self.reservation.take() {
            if !cfg!(kvtier_seeded_bug = "pending-copy-drop-frees") {
                r.quarantine();
            }
        }
    }
}

/// A restore in flight. Dropped without [`PendingRestore::take`] (an unwind anywhere), its pins
/// are kept for good and its use stays spent: the reader may be alive and still copying.
struct PendingRestore {
    hold: Option<RestoreHold>,
    pins: Option<SlotPins>,
}

impl PendingRestore {
    fn take(mut self) -> (Option<RestoreHold>, SlotPins) {
        (self.hold.take(), self.pins.take().expect("a pending restore's pins are taken once"))
    }
}

impl Drop for PendingRestore {
    fn drop(&mut self) {
        if cfg!(kvtier_seeded_bug = "pending-copy-drop-frees") {
            return;
        }
        if let Some(p) = self.pins.take() {
            p.quarantine();
        }
        if let Some(c) = self.hold.take() {
            // Never panic out of a drop (it may run while unwinding).
            let _ = catch_unwind(AssertUnwindSafe(|| c.submitted()));
        }
    }
}

/// A hint this connection gave.
struct OwnedHint {
    id: u64,
    keys: usize,
    /// When the tier drops it by itself (`None`: not within this process's clock range).
    expires: Option<Instant>,
}

/// One connection's state. Dropping it ends the session (see the module docs): whatever way its
/// thread ends, nothing it holds is freed under a copy that may still run, and nothing it holds
/// outlives it except what such a copy still needs.
struct Session {
    shared: Arc<Shared>,
    pid: Option<u32>,
    pidfd: Option<OwnedFd>,
    /// Lease id -> handles this connection holds.
    leases: HashMap<u64, u64>,
    /// Handles over `leases`.
    lease_handles: usize,
    /// Lease id -> its blocks, for the leases this connection holds handles on.
    lease_sizes: HashMap<u64, usize>,
    /// Blocks over this connection's handles (each handle counts its lease's blocks).
    leased_blocks: usize,
    saves: HashMap<u64, PendingSave>,
    restores: HashMap<u64, PendingRestore>,
    hints: Vec<OwnedHint>,
    next_id: u64,
    parked: Vec<Reserved>,
    parked_pins: Vec<SlotPins>,
    /// The process is known to be gone when the session ends (fuzzing: nothing runs a copy), so
    /// what it withheld is released at once.
    gone_at_end: bool,
}

impl Session {
    fn new(shared: Arc<Shared>, pid: Option<u32>, pidfd: Option<OwnedFd>) -> Session {
        Session {
            shared,
            pid,
            pidfd,
            leases: HashMap::new(),
            lease_handles: 0,
            lease_sizes: HashMap::new(),
            leased_blocks: 0,
            saves: HashMap::new(),
            restores: HashMap::new(),
            hints: Vec::new(),
            next_id: 0,
            parked: Vec::new(),
            parked_pins: Vec::new(),
            gone_at_end: false,
        }
    }

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

    fn check_keys(&self, n: usize) -> Result<(), TierError> {
        let max = self.shared.limits.keys_per_request;
        if n > max {
            return Err(limit(Limit::KeysPerRequest, n, max));
        }
        Ok(())
    }

    fn check_lease_handle(&self) -> Result<(), TierError> {
        let max = self.shared.limits.leases_per_connection;
        if self.lease_handles >= max {
            return Err(limit(Limit::LeasesPerConnection, self.lease_handles + 1, max));
        }
        Ok(())
    }

    /// Refuses a handle on `n` more leased blocks over [`Limits::leased_blocks_per_connection`].
    fn check_leased_blocks(&self, n: usize) -> Result<(), TierError> {
        let max = self.shared.limits.leased_blocks_per_connection;
        let asked = self.leased_blocks.saturating_add(n);
        if asked > max && !cfg!(kvtier_seeded_bug = "leased-blocks-unbounded") {
            return Err(limit(Limit::LeasedBlocksPerConnection, asked, max));
        }
        Ok(())
    }

    /// Copies this connection has in flight or withheld.
    fn copies(&self) -> usize {
        self.saves.len() + self.restores.len() + self.parked.len() + self.parked_pins.len()
    }

    fn check_copy(&self) -> Result<(), TierError> {
        let max = self.shared.limits.copies_per_connection;
        if self.copies() >= max {
            return Err(limit(Limit::CopiesPerConnection, self.copies() + 1, max));
        }
        Ok(())
    }

    /// Runs one request: a panic fails it with [`TierError::Panicked`] and leaves the session as it
    /// was (its maps change only after the work that can fail).
    fn run(&mut self, req: Request) -> Reply {
        let name = req.name();
        #[cfg(kvtier_seeded_bug = "request-panic-unwinds")]
        return self.handle(req).unwrap_or_else(|e| Reply::Error(WireError::from(&e)));
        #[allow(unreachable_code)]
        match catch_unwind(AssertUnwindSafe(|| self.handle(req))) {
            Ok(Ok(reply)) => reply,
            Ok(Err(e)) => Reply::Error(WireError::from(&e)),
            Err(payload) => {
                let message = panic_message(&*payload);
                tracing::error!("process {:?}: request {name} panicked: {message}", self.pid);
                Reply::Error(WireError::Panicked { request: name.into(), message })
            }
        }
    }

    fn handle(&mut self, req: Request) -> Result<Reply, TierError> {
        if self.shared.panic_hook.get().is_some_and(|h| h(&req)) {
            panic!("a panic injected into {} (Server::panic_on_requests)", req.name());
        }
        let core = self.shared.core.clone();
        let block_bytes = core.geometry().block_bytes();
        Ok(match req {
            Request::Hello { .. } => return Err(misuse("a second hello on a connection that said hello")),
            Request::Attach => Reply::Attached { rank: core.next_rank_id() },
            Request::Query { keys, uses } => {
                self.check_keys(keys.len())?;
                if uses > self.shared.limits.lease_uses {
                    return Err(limit(Limit::LeaseUses, uses as usize, self.shared.limits.lease_uses as usize));
                }
                self.check_lease_handle()?;
                // A prompt's chained keys never repeat: the lease is a prefix, so it ends before
                // the first repeated key and names each slot once.
                let mut seen = HashSet::with_capacity(keys.len().min(4096));
                let distinct = keys.iter().take_while(|k| seen.insert(**k)).count();
                self.check_leased_blocks(distinct)?;
                let lease = self.shared.tier.query_shared(&keys[..distinct], uses);
                if lease.is_settled() {
                    return Ok(Self::leased(0, &lease));
                }
                let reply_blocks = Self::leased(0, &lease);
                let n = lease.len();
                let id = self.shared.register(lease);
                *self.leases.entry(id).or_default() += 1;
                self.lease_handles += 1;
                self.lease_sizes.insert(id, n);
                self.leased_blocks += n;
                match reply_blocks {
                    Reply::Leased { blocks, .. } => Reply::Leased { lease: id, blocks },
                    r => r,
                }
            }
            Request::OpenLease { instance, lease: id } => {
                if instance != self.shared.welcome.instance {
                    return Err(TierError::ForeignLease);
                }
                self.check_lease_handle()?;
                let reply = {
                    let mut leases = self.shared.leases.lock().unwrap_or_else(|p| p.into_inner());
                    let e = leases.get_mut(&id).ok_or(TierError::LeaseSettled)?;
                    self.check_leased_blocks(e.lease.len())?;
                    e.holders += 1;
                    Self::leased(id, &e.lease)
                };
                let n = match &reply {
                    Reply::Leased { blocks, .. } => blocks.len(),
                    _ => 0,
                };
                *self.leases.entry(id).or_default() += 1;
                self.lease_handles += 1;
                self.lease_sizes.insert(id, n);
                self.leased_blocks += n;
                reply
            }
            Request::DropLease { lease: id } => {
                if let Some(n) = self.leases.get_mut(&id) {
                    *n -= 1;
                    let size = self.lease_sizes.get(&id).copied().unwrap_or(0);
                    if *n == 0 {
                        self.leases.remove(&id);
                        self.lease_sizes.remove(&id);
                    }
                    self.leased_blocks = self.leased_blocks.saturating_sub(size);
                    self.lease_handles -= 1;
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
                self.check_keys(keys.len())?;
                self.check_copy()?;
                // At most one slot a key: taken from the process's bound before anything is
                // reserved, the unused part given back once the reservation is known.
                // (never more than the pool holds: a larger save is the tier's CannotFit).
                let want = keys.len().min(core.pool().capacity() as usize);
                self.shared.take_slots(self.pid, want)?;
                let mut opts = SaveOptions::new().fit(if prefix { Fit::Prefix } else { Fit::AllOrNothing });
                opts.prefix_depth = prefix_depth;
                opts.parent = parent;
                let p = match prepare_save(&core, &keys, &opts) {
                    Ok(p) => p,
                    Err(e) => {
                        self.shared.give_slots(self.pid, want);
                        return Err(e);
                    }
                };
                self.shared.give_slots(self.pid, want - p.reservation.len().min(want));
                let slots: Vec<u32> = p.reservation.entries().iter().map(|r| r.slot.0).collect();
                let save = if slots.is_empty() {
                    0
                } else {
                    let id = self.id();
                    self.saves.insert(id, PendingSave { reservation: Some(p.reservation) });
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
                let reservation = self
                    .saves
                    .remove(&save)
                    .ok_or_else(|| misuse(format!("no save {save} in flight on this connection")))?
                    .take();
                let blocks = reservation.len() as u64;
                match outcome {
                    Outcome::Done => {
                        reservation.commit();
                        self.shared.give_slots(self.pid, blocks as usize);
                    }
                    Outcome::Failed | Outcome::NotSubmitted => {
                        drop(reservation);
                        self.shared.give_slots(self.pid, blocks as usize);
                    }
                    Outcome::Unknown | Outcome::SubmitPanicked => {
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
                self.check_copy()?;
                let mut hold = l.begin_restore(blocks as usize)?;
                let pins = hold.take_pins();
                let slots = pins.slots().iter().map(|s| s.0).collect();
                let id = self.id();
                self.restores.insert(id, PendingRestore { hold: Some(hold), pins: Some(pins) });
                Reply::Restoring { restore: id, slots }
            }
            Request::RestoreSubmitted { restore } => {
                if let Some(hold) = self.restores.get_mut(&restore).and_then(|r| r.hold.take()) {
                    hold.submitted();
                }
                Reply::Done
            }
            Request::FinishRestore { restore, outcome } => {
                let (hold, pins) = self
                    .restores
                    .remove(&restore)
                    .ok_or_else(|| misuse(format!("no restore {restore} in flight on this connection")))?
                    .take();
                let blocks = pins.len() as u64;
                match outcome {
                    Outcome::NotSubmitted => {
                        // Pins first, then the use goes back (as an unsubmitted hold does).
                        drop(pins);
                        drop(hold);
                    }
                    Outcome::Done | Outcome::Failed => {
                        if let Some(c) = hold {
                            c.submitted();
                        }
                        drop(pins);
                    }
                    Outcome::Unknown => {
                        // The pins are parked before anything that may panic: an unwind in the
                        // hold's settling cannot unpin under a live copy.
                        core.record_quarantined_pins(pins.len());
                        self.parked_pins.push(pins);
                        if let Some(c) = hold {
                            c.submitted();
                        }
                    }
                    Outcome::SubmitPanicked => {
                        // The backend may have queued the copy: the pins are parked as for an
                        // unknown outcome; the call failed, so the use goes back (as in process).
                        core.record_quarantined_pins(pins.len());
                        self.parked_pins.push(pins);
                        drop(hold);
                    }
                }
                let bytes = if outcome == Outcome::NotSubmitted { 0 } else { blocks * block_bytes };
                core.counters.record_copy(Direction::Restore, blocks, bytes, outcome == Outcome::Done);
                Reply::Done
            }
            Request::Contains { key } => Reply::Bool(self.shared.tier.contains(&key)),
            Request::Evict { blocks } => {
                // Evicting more than the pool holds is evicting all of it: the tier never sees a
                // count above its capacity.
                let n = blocks.min(core.pool().capacity() as u64) as usize;
                Reply::Count(self.shared.tier.evict(n) as u64)
            }
            Request::Hint { keys, ttl_ms } => self.hint(&keys, ttl_ms)?,
            Request::WithdrawHint { id } => {
                // Only this connection's own hints: another's id is no hint of this connection.
                match self.hints.iter().position(|h| h.id == id) {
                    Some(i) => {
                        self.hints.swap_remove(i);
                        Reply::Bool(self.shared.tier.withdraw_hint(crate::tier::HintId::from_number(id)))
                    }
                    None => Reply::Bool(false),
                }
            }
            Request::LiveHints => Reply::Count(self.shared.tier.live_hints() as u64),
            Request::ExpireLeases => Reply::Count(self.shared.tier.expire_leases() as u64),
            Request::Stats => Reply::Stats(self.shared.tier.stats().into()),
            Request::Audit { keys } => {
                self.check_keys(keys.len())?;
                Reply::Audit(core.audit(&keys).map(|a| WireAudit {
                    free: a.free as u64,
                    writing: a.writing as u64,
                    ready: a.ready as u64,
                    evicting: a.evicting as u64,
                    pinned: a.pinned as u64,
                }))
            }
        })
    }

    /// A hint on the distinct `keys`, owned by this connection and bounded in count and keys.
    fn hint(&mut self, keys: &[ContentKey], ttl_ms: u64) -> Result<Reply, TierError> {
        self.check_keys(keys.len())?;
        let now = Instant::now();
        // The tier drops expired hints by itself; they no longer count against this connection.
        self.hints.retain(|h| h.expires.is_none_or(|t| t > now));
        let limits = &self.shared.limits;
        if self.hints.len() >= limits.hints_per_connection {
            return Err(limit(Limit::HintsPerConnection, self.hints.len() + 1, limits.hints_per_connection));
        }
        let mut seen = HashSet::with_capacity(keys.len().min(4096));
        let distinct: Vec<ContentKey> = keys.iter().copied().filter(|k| seen.insert(*k)).collect();
        let held: usize = self.hints.iter().map(|h| h.keys).sum();
        if held + distinct.len() > limits.hint_keys_per_connection {
            return Err(limit(Limit::HintKeysPerConnection, held + distinct.len(), limits.hint_keys_per_connection));
        }
        // The tier cuts a hint at MAX_HINT_TTL; the connection counts it no longer than that.
        let ttl = Duration::from_millis(ttl_ms).min(crate::tier::MAX_HINT_TTL);
        let id = self.shared.tier.hint(&distinct, ttl).get();
        self.hints.push(OwnedHint { id, keys: distinct.len(), expires: now.checked_add(ttl) });
        Ok(Reply::Count(id))
    }

    /// Ends the session (see the type's docs); idempotent.
    fn end(&mut self) {
        let leases = std::mem::take(&mut self.leases);
        let shared = self.shared.clone();
        if let Err(p) = catch_unwind(AssertUnwindSafe(move || {
            for (id, n) in leases {
                shared.drop_handles(id, n);
            }
        })) {
            tracing::error!("process {:?}: dropping its lease handles panicked: {}", self.pid, panic_message(&*p));
        }
        self.lease_handles = 0;
        self.lease_sizes.clear();
        self.leased_blocks = 0;
        for h in std::mem::take(&mut self.hints) {
            if !cfg!(kvtier_seeded_bug = "hints-outlive-connection") {
                self.shared.tier.withdraw_hint(crate::tier::HintId::from_number(h.id));
            }
        }
        let core = self.shared.core.clone();
        // Each step runs under catch_unwind (this may run while the thread unwinds: a panic here
        // would abort the daemon); whatever a panicking step left is withheld for good by the
        // pending copies' drops.
        let restores: Vec<PendingRestore> = self.restores.drain().map(|(_, r)| r).collect();
        for r in restores {
            let (hold, pins) = r.take();
            // The pins are parked first; the copy may have been submitted: the use is spent.
            core.record_quarantined_pins(pins.len());
            self.parked_pins.push(pins);
            if let Some(c) = hold {
                if let Err(p) = catch_unwind(AssertUnwindSafe(|| c.submitted())) {
                    tracing::error!(
                        "process {:?}: settling a restore's use panicked: {}",
                        self.pid,
                        panic_message(&*p)
                    );
                }
            }
        }
        let saves: Vec<PendingSave> = self.saves.drain().map(|(_, s)| s).collect();
        for s in saves {
            let reservation = s.take();
            self.parked.extend_from_slice(reservation.entries());
            if let Err(p) = catch_unwind(AssertUnwindSafe(|| reservation.quarantine())) {
                tracing::error!("process {:?}: withholding a save's slots panicked: {}", self.pid, panic_message(&*p));
            }
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
        if self.gone_at_end {
            self.shared.release_parked(parked);
            return;
        }
        match &parked.pidfd {
            Some(fd) if exited(fd) => self.shared.release_parked(parked),
            Some(_) => {
                tracing::info!(
                    "process {:?} disconnected with {} slots being written and {} pinned restores: \
                     withheld until it exits",
                    parked.pid,
                    parked.reserved.len(),
                    parked.pins.len()
                );
                self.shared.park(parked);
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

impl Drop for Session {
    fn drop(&mut self) {
        #[cfg(not(kvtier_seeded_bug = "session-drop-skips-close"))]
        self.end();
    }
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "a panic without a message".into()
    }
}

fn random_u64() -> u64 {
    let mut b = [0u8; 8];
    let mut got = 0;
    while got < 8 {
        // SAFETY: getrandom writes at most `8 - got` bytes at `b[got..]`, inside `b`.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), 8 - got, 0) };
        if n > 0 {
            got += n as usize;
        } else if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            break;
        }
    }
    if got == 8 {
        return u64::from_le_bytes(b);
    }
    // No getrandom (a kernel before 3.17): /dev/urandom.
    let mut f = std::fs::File::open("/dev/urandom").expect("kvtierd needs getrandom or /dev/urandom for lease ids");
    f.read_exact(&mut b).expect("reading /dev/urandom");
    u64::from_le_bytes(b)
}

/// The tier daemon's server: a [`HostTier`] with its pool in shared memory, a Unix socket, and a
/// thread per connected engine process. See the module docs and `docs/design.md`.
pub struct Server {
    listener: UnixListener,
    shared: Arc<Shared>,
    path: PathBuf,
}

/// The euid of this process.
fn euid() -> u32 {
    // SAFETY: geteuid takes nothing and cannot fail.
    unsafe { libc::geteuid() }
}

/// Makes sure `dir` (the socket's directory) exists; creates it (`0700`, or `0750` of `group`) if
/// it does not. The per-user fallback directory in `/tmp` (see [`crate::remote::default_socket_path`])
/// must be a directory of ours that nobody else can write, or another user could have made it.
fn socket_dir(dir: &Path, group: Option<u32>) -> Result<(), Error> {
    let io = |what: &'static str| move |source| Error::Io { what, path: dir.to_path_buf(), source };
    match std::fs::symlink_metadata(dir) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new()
                .mode(if group.is_some() { 0o750 } else { 0o700 })
                .create(dir)
                .map_err(io("creating the socket's directory"))?;
            if let Some(gid) = group {
                std::os::unix::fs::chown(dir, None, Some(gid)).map_err(|source| Error::Chown {
                    path: dir.to_path_buf(),
                    gid,
                    source,
                })?;
            }
            Ok(())
        }
        Err(e) => Err(io("reading the socket's directory")(e)),
        Ok(m) => {
            if crate::remote::is_per_user_tmp_dir(dir) && (!m.is_dir() || m.uid() != euid() || m.mode() & 0o022 != 0) {
                return Err(Error::UnsafeSocketDir {
                    path: dir.to_path_buf(),
                    uid: euid(),
                    owner: m.uid(),
                    mode: m.mode() & 0o7777,
                });
            }
            Ok(())
        }
    }
}

/// Clears the way for a socket at `path`: nothing there, or a stale socket (nobody accepts on it:
/// a connect is refused), which is removed. Anything else is an error and is left alone.
fn clear_stale_socket(path: &Path) -> Result<(), Error> {
    #[cfg(kvtier_seeded_bug = "bind-deletes-anything")]
    if UnixStream::connect(path).is_err() {
        let _ = std::fs::remove_file(path);
    }
    let m = match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(source) => return Err(Error::Io { what: "reading the socket path", path: path.to_path_buf(), source }),
        Ok(m) => m,
    };
    if !m.file_type().is_socket() {
        let what = if m.is_dir() {
            "a directory"
        } else if m.file_type().is_symlink() {
            "a symbolic link"
        } else if m.is_file() {
            "a regular file"
        } else {
            "not a socket"
        };
        return Err(Error::SocketPathTaken { path: path.to_path_buf(), found: what });
    }
    match UnixStream::connect(path) {
        Ok(_) => Err(Error::DaemonRunning { path: path.to_path_buf() }),
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => std::fs::remove_file(path)
            .map_err(|source| Error::Io { what: "removing the stale socket", path: path.to_path_buf(), source }),
        Err(source) => Err(Error::SocketUnprobed { path: path.to_path_buf(), source }),
    }
}

/// The file `PATH.lock` beside the socket `path`: held (`flock`) while a daemon probes, unlinks
/// and binds `path`.
fn lock_path(path: &Path) -> PathBuf {
    let mut p = path.as_os_str().to_owned();
    p.push(".lock");
    PathBuf::from(p)
}

/// Takes the exclusive `flock` on `PATH.lock` (created `0600` if missing, never through a
/// symbolic link), waiting for a daemon that holds it, so two daemons starting at once cannot
/// unlink each other's fresh socket. Released when the returned file is dropped.
fn lock_bind(path: &Path) -> Result<std::fs::File, Error> {
    use std::os::unix::fs::OpenOptionsExt;
    let lp = lock_path(path);
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(&lp)
        .map_err(|source| Error::Io { what: "opening the socket's lock file", path: lp.clone(), source })?;
    if cfg!(kvtier_seeded_bug = "bind-unlocked") {
        return Ok(f);
    }
    loop {
        // SAFETY: flock on a file descriptor we own; it blocks until the lock is ours.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } == 0 {
            return Ok(f);
        }
        let source = std::io::Error::last_os_error();
        if source.kind() != std::io::ErrorKind::Interrupted {
            return Err(Error::Io { what: "locking", path: lp, source });
        }
    }
}

/// Serializes this process's umask changes around binds: two binds at once on two threads would
/// otherwise restore each other's mask (one binding under the old umask, the mask left `0177`).
static UMASK: Mutex<()> = Mutex::new(());

/// Binds the Unix socket `path` with the process umask set to `0177` (the previous umask is
/// restored before returning), so the socket is never more open than `0600` between `bind` and
/// the mode it is given next, whatever the umask (`002`, `0`) was. The umask is process-wide:
/// a file another thread creates during the bind gets at most `0600` too.
fn bind_socket(path: &Path) -> Result<UnixListener, Error> {
    let _serial = UMASK.lock().unwrap_or_else(|p| p.into_inner());
    bind_under_private_umask(path)
}

/// [`bind_socket`]'s work; the caller holds [`UMASK`].
fn bind_under_private_umask(path: &Path) -> Result<UnixListener, Error> {
    let mask = if cfg!(kvtier_seeded_bug = "bind-umask-window") { None } else { Some(0o177) };
    // SAFETY: umask sets the process's file mode creation mask and returns the old one.
    let old = mask.map(|m| unsafe { libc::umask(m) });
    let bound = UnixListener::bind(path);
    if let Some(old) = old {
        // SAFETY: as above; restores the mask read when it was set.
        unsafe { libc::umask(old) };
    }
    bound.map_err(|source| Error::Io { what: "binding the socket", path: path.to_path_buf(), source })
}

impl Server {
    /// [`Server::bind_with`] with the default [`ServerConfig`] (default [`Limits`], socket `0600`).
    ///
    /// # Errors
    /// As [`Server::bind_with`].
    pub fn bind(path: impl AsRef<Path>, tier: HostTier) -> Result<Server, Error> {
        Self::bind_with(path, tier, ServerConfig::default())
    }

    /// Listens on the Unix socket `path` for engines and serves `tier` to them, holding every
    /// connection to `config.limits`. The socket's directory is created if missing (`0700`); a
    /// socket left at `path` by a daemon that is gone is replaced; anything else at `path` (a
    /// regular file, a directory, a socket a live daemon listens on) is an error and is left
    /// alone. The socket is `0600` (`0660` of `config.group` with a group), and never more open
    /// than `0600` before its mode is set (it is bound under umask `0177`, the process's umask
    /// restored after). Probing, replacing and binding the socket happen under an exclusive
    /// `flock` of the file `PATH.lock` beside it (created `0600`, left in place), so of two
    /// daemons starting at once on one path the second waits and then finds the first listening.
    ///
    /// # Errors
    /// [`Error::PrivatePool`] if `tier`'s pool is not in shared memory (make it with
    /// [`HostTier::new_shared`]); [`Error::Limits`] if the limits are invalid (a zero bound, a
    /// frame bound above [`proto::MAX_FRAME`]); [`Error::DaemonRunning`],
    /// [`Error::SocketPathTaken`] or [`Error::SocketUnprobed`] if something other than a stale
    /// socket is at `path`; [`Error::UnsafeSocketDir`] if the per-user directory in `/tmp` is not
    /// ours; [`Error::Io`] if the directory cannot be made, `PATH.lock` cannot be opened or
    /// locked, or the socket cannot be bound or given its mode; [`Error::Chown`] if the socket
    /// or its directory cannot be given to `config.group`.
    pub fn bind_with(path: impl AsRef<Path>, tier: HostTier, config: ServerConfig) -> Result<Server, Error> {
        let path = path.as_ref().to_path_buf();
        if tier.pool().shared_fd().is_none() {
            return Err(Error::PrivatePool);
        }
        config.limits.check()?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            socket_dir(dir, config.group)?;
        }
        // Held until the socket has its mode: another daemon's probe waits for it.
        let _lock = lock_bind(&path)?;
        clear_stale_socket(&path)?;
        let listener = bind_socket(&path)?;
        let mode = if let Some(gid) = config.group {
            std::os::unix::fs::chown(&path, None, Some(gid)).map_err(|source| Error::Chown {
                path: path.clone(),
                gid,
                source,
            })?;
            0o660
        } else {
            0o600
        };
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).map_err(|source| Error::Io {
            what: if mode == 0o660 { "setting mode 0660 on the socket" } else { "setting mode 0600 on the socket" },
            path: path.clone(),
            source,
        })?;
        let shared = Arc::new(Shared::new(tier, config.limits));
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

    /// The bounds every connection is held to.
    pub fn limits(&self) -> &Limits {
        &self.shared.limits
    }

    /// Tests only: every request for which `hook` returns true panics inside the daemon's request
    /// handling (where a bug in the tier would), so a test can check what a panic leaves behind.
    /// Set once, before [`Server::run`]; later calls are ignored.
    #[doc(hidden)]
    pub fn panic_on_requests(&self, hook: impl Fn(&Request) -> bool + Send + Sync + 'static) {
        let _ = self.shared.panic_hook.set(Box::new(hook));
    }

    /// Serves connections until accepting fails for good (blocking): a thread per connection, and
    /// a reaper thread that releases what dead processes' copies held. A connection over
    /// [`Limits::connections`], or one whose thread cannot start, is refused with a typed error
    /// and closed; the daemon goes on.
    ///
    /// # Errors
    /// Starting the reaper thread.
    pub fn run(&self) -> std::io::Result<()> {
        let reaper = self.shared.clone();
        std::thread::Builder::new().name("kvtierd-reaper".into()).spawn(move || reap(&reaper))?;
        let limits = self.shared.limits;
        let mut n = 0u64;
        for stream in self.listener.incoming() {
            let stream = match stream {
                Ok(s) => s,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // EMFILE, ENOMEM, ECONNABORTED: this connection is lost, the next may work.
                    tracing::warn!("accept: {e}");
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
            };
            n += 1;
            let live = self.shared.live.fetch_add(1, Ordering::AcqRel) + 1;
            let mut slot = ConnSlot(self.shared.clone(), None);
            let stream = Arc::new(stream);
            if live > limits.connections && !cfg!(kvtier_seeded_bug = "no-connection-limit") {
                tracing::warn!("refusing a connection: {} are open, the limit is {}", live - 1, limits.connections);
                let e = WireError::LimitExceeded {
                    limit: Limit::Connections,
                    asked: live as u64,
                    max: limits.connections as u64,
                };
                refuse(&self.shared, stream, e);
                drop(slot);
                continue;
            }
            if let Some(pid) = peer_pid(&stream) {
                if let Err(asked) = slot.count_process(pid) {
                    tracing::warn!(
                        "refusing a connection of process {pid}: it has {} open, the limit is {}",
                        asked - 1,
                        limits.connections_per_process
                    );
                    let e = WireError::LimitExceeded {
                        limit: Limit::ConnectionsPerProcess,
                        asked: asked as u64,
                        max: limits.connections_per_process as u64,
                    };
                    refuse(&self.shared, stream, e);
                    drop(slot);
                    continue;
                }
            }
            let shared = self.shared.clone();
            let s = stream.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("kvtierd-conn-{n}"))
                .stack_size(limits.thread_stack_bytes)
                .spawn(move || serve(shared, &s, slot));
            if let Err(e) = spawned {
                #[cfg(kvtier_seeded_bug = "spawn-failure-stops-daemon")]
                return Err(e);
                tracing::warn!("refusing a connection: its thread cannot start: {e}");
                let e = WireError::Other(format!("the daemon could not start a thread for this connection: {e}"));
                refuse(&self.shared, stream, e);
            }
        }
        Ok(())
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("path", &self.path).field("instance", &self.instance()).finish()
    }
}

/// Sends a refusal (marker and error frame) without blocking and keeps the connection open a
/// moment ([`REFUSED_LINGER`], the reaper drains its hello) so the client reads the refusal rather
/// than a reset.
fn refuse(shared: &Shared, stream: Arc<UnixStream>, e: WireError) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let mut buf = Vec::new();
    if send_answer(&stream, shared, &Reply::Error(e), &mut buf).is_err() {
        return;
    }
    let _ = stream.shutdown(std::net::Shutdown::Write);
    let mut refused = shared.refused.lock().unwrap_or_else(|p| p.into_inner());
    if refused.len() < MAX_REFUSED {
        refused.push((stream, Instant::now()));
    }
}

/// Releases parked slots and pins of processes that have exited; closes refused connections.
fn reap(shared: &Shared) {
    let mut scratch = [0u8; 4096];
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
            shared.release_parked(p);
        }
        let mut refused = shared.refused.lock().unwrap_or_else(|p| p.into_inner());
        refused.retain(|(s, since)| {
            // Drain what the client sent (its hello), so closing does not reset the connection.
            let eof = loop {
                match (&**s).read(&mut scratch) {
                    Ok(0) => break true,
                    Ok(_) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => break e.kind() != std::io::ErrorKind::WouldBlock,
                }
            };
            !eof && since.elapsed() < REFUSED_LINGER
        });
    }
}

/// Sends the hello's answer: the marker byte (with the memfd when accepted), then the reply frame.
fn send_answer(stream: &UnixStream, shared: &Shared, reply: &Reply, buf: &mut Vec<u8>) -> std::io::Result<()> {
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

fn hello_reply(shared: &Shared, req: &Incoming) -> Reply {
    match req {
        Incoming::Request(Request::Hello { magic, version, namespace }) => {
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
        Incoming::Oversized { len } => Reply::Error(WireError::LimitExceeded {
            limit: Limit::FrameBytes,
            asked: *len,
            max: proto::MAX_HELLO as u64,
        }),
        _ => Reply::Error(WireError::Protocol("the first message must be a hello".into())),
    }
}

/// A reader that fails with [`std::io::ErrorKind::TimedOut`] once `until` has passed (each read of
/// the socket below blocks at most its `SO_RCVTIMEO`): a frame cannot take for ever to arrive.
struct Deadline<'a, R> {
    inner: &'a mut R,
    until: Instant,
}

impl<R: Read> Read for Deadline<'_, R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if Instant::now() >= self.until {
            return Err(std::io::ErrorKind::TimedOut.into());
        }
        match self.inner.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Err(std::io::ErrorKind::TimedOut.into()),
            r => r,
        }
    }
}

/// What ended a wait for the next frame.
enum Wake {
    /// Bytes (or the end of the stream) arrived.
    Readable,
    /// The process that said hello is gone.
    Gone,
}

/// Waits until the socket is readable or the process behind `pidfd` has exited.
fn wait_next(sock: RawFd, pidfd: Option<RawFd>) -> std::io::Result<Wake> {
    let mut fds = [
        libc::pollfd { fd: sock, events: libc::POLLIN, revents: 0 },
        libc::pollfd { fd: pidfd.unwrap_or(-1), events: libc::POLLIN, revents: 0 },
    ];
    loop {
        // SAFETY: two valid pollfds (a negative fd is ignored by poll); poll writes only their
        // `revents`.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if fds[1].revents != 0 {
            return Ok(Wake::Gone);
        }
        if fds[0].revents != 0 {
            return Ok(Wake::Readable);
        }
    }
}

fn serve(shared: Arc<Shared>, stream: &UnixStream, _slot: ConnSlot) {
    let limits = shared.limits;
    let (peer, pidfd) = peer_process(stream);
    let pid = peer.pid;
    let write_timeout = (!cfg!(kvtier_seeded_bug = "no-write-timeout")).then_some(limits.write_timeout);
    if stream.set_read_timeout(Some(limits.hello_timeout)).is_err() || stream.set_write_timeout(write_timeout).is_err()
    {
        return;
    }
    let mut buf = Vec::new();
    let mut reader = BufReader::new(stream);
    let hello = {
        let mut r = Deadline { inner: &mut reader, until: Instant::now() + limits.hello_timeout };
        // An oversized hello is refused at once: its bytes are not worth waiting for.
        let read = proto::read_len(&mut r).and_then(|len| {
            if len > proto::MAX_HELLO {
                return Ok(Incoming::Oversized { len: len as u64 });
            }
            proto::read_payload(&mut r, len, &mut buf)?;
            Ok(proto::decode(&buf)
                .map_or_else(|e: std::io::Error| Incoming::Undecodable(e.to_string()), Incoming::Request))
        });
        match read {
            Ok(h) => h,
            Err(e) => {
                tracing::debug!("process {pid:?}: no hello ({e}); closing its connection");
                return;
            }
        }
    };
    let reply = hello_reply(&shared, &hello);
    let accepted = matches!(reply, Reply::Welcome(_));
    if send_answer(stream, &shared, &reply, &mut buf).is_err() || !accepted {
        return;
    }
    if stream.set_read_timeout(Some(limits.frame_timeout)).is_err() {
        return;
    }
    tracing::info!("process {pid:?} (uid {:?}, gid {:?}) connected", peer.uid, peer.gid);
    let pidfd_raw = pidfd.as_ref().map(|f| f.as_raw_fd());
    #[cfg(kvtier_seeded_bug = "session-outlives-process")]
    let pidfd_raw = None;
    let mut session = Session::new(shared, pid, pidfd);
    let mut writer = proto::NoSigPipe(stream);
    let mut out = Vec::new();
    loop {
        if reader.buffer().is_empty() {
            match wait_next(stream.as_raw_fd(), pidfd_raw) {
                Ok(Wake::Readable) => {}
                Ok(Wake::Gone) => {
                    tracing::info!("process {pid:?} is gone: ending its session (another may still hold the socket)");
                    break;
                }
                Err(e) => {
                    tracing::warn!("process {pid:?}: poll: {e}; closing its connection");
                    break;
                }
            }
        } else if let Some(fd) = pidfd_raw {
            // Requests already buffered (pipelined) are not served for a process that is gone.
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd (the session owns the pidfd for as long as this loop
            // runs), timeout 0: poll only reads and writes that struct.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            if n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                tracing::info!("process {pid:?} is gone: ending its session, its buffered requests unserved");
                break;
            }
        }
        let mut r = Deadline { inner: &mut reader, until: Instant::now() + limits.frame_timeout };
        let reply = match proto::read_request(&mut r, &mut buf, limits.frame_bytes) {
            Ok(Incoming::Request(req)) => {
                let one_way = req.is_one_way();
                let reply = session.run(req);
                if one_way {
                    None
                } else {
                    Some(reply)
                }
            }
            #[cfg(kvtier_seeded_bug = "oversized-frame-closes")]
            Ok(Incoming::Oversized { .. }) => break,
            Ok(Incoming::Oversized { len }) => Some(Reply::Error(WireError::LimitExceeded {
                limit: Limit::FrameBytes,
                asked: len,
                max: limits.frame_bytes as u64,
            })),
            Ok(Incoming::Undecodable(why)) => {
                Some(Reply::Error(WireError::Protocol(format!("a frame that is no request of this protocol: {why}"))))
            }
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    tracing::warn!("process {pid:?}: {e}; closing its connection");
                }
                break;
            }
        };
        if buf.capacity() > KEEP_BUFFER {
            buf = Vec::new();
        }
        if let Some(reply) = reply {
            if let Err(e) = proto::write_frame(&mut writer, &reply, &mut out) {
                tracing::warn!("process {pid:?}: sending a reply: {e}; closing its connection");
                break;
            }
            if out.capacity() > KEEP_BUFFER {
                out = Vec::new();
            }
        }
    }
    tracing::info!("process {pid:?} disconnected");
    drop(session);
    // Whoever still holds the socket (a forked child) learns the session is over.
    let _ = stream.shutdown(std::net::Shutdown::Both);
}

/// Fuzzing and tests: runs the requests encoded back to back in `bytes` (postcard, no length
/// prefixes; decoding stops at the first that does not decode) through one session of a daemon
/// serving `tier`, with `limits`, as a connection that said hello would; then ends the session as
/// if its process had exited, so whatever it held goes back. A lease id below 16 names the
/// session's own leases in the order it got them (a real client learns the random ids from the
/// replies). Returns the replies.
///
/// # Errors
/// A request that panicked (no request may panic the daemon), named with its message.
#[doc(hidden)]
pub fn drive_session(tier: HostTier, limits: Limits, mut bytes: &[u8]) -> Result<Vec<Reply>, String> {
    let shared = Arc::new(Shared::new(tier, limits));
    let mut session = Session::new(shared.clone(), None, None);
    session.gone_at_end = true;
    let mut ids: Vec<u64> = Vec::new();
    let mut replies = Vec::new();
    while let Ok((mut req, rest)) = postcard::take_from_bytes::<Request>(bytes) {
        bytes = rest;
        let lease_of = |n: u64| if n < 16 { ids.get(n as usize).copied().unwrap_or(n) } else { n };
        match &mut req {
            Request::OpenLease { instance, lease } => {
                if *instance < 2 {
                    *instance = shared.welcome.instance;
                }
                *lease = lease_of(*lease);
            }
            Request::LeaseInfo { lease }
            | Request::ReleaseLease { lease }
            | Request::DropLease { lease }
            | Request::ConsumeUse { lease }
            | Request::Restore { lease, .. } => *lease = lease_of(*lease),
            _ => {}
        }
        let reply = session.run(req);
        if let Reply::Error(WireError::Panicked { request, message }) = &reply {
            return Err(format!("request {request} panicked: {message}"));
        }
        if let Reply::Leased { lease, .. } = &reply {
            if *lease != 0 && !ids.contains(lease) {
                ids.push(*lease);
            }
        }
        replies.push(reply);
    }
    drop(session);
    Ok(replies)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ArenaSpec, BackingChoice, Geometry, PoolConfig, TierConfig};

    #[test]
    fn a_socket_is_never_more_open_than_0600_whatever_the_umask() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        // No other bind of this process changes the umask meanwhile.
        let _serial = UMASK.lock().unwrap_or_else(|p| p.into_inner());
        // SAFETY: umask sets the process's mask; this test restores it below.
        let before = unsafe { libc::umask(0) };
        let bound = bind_under_private_umask(&path);
        // SAFETY: as above; reads the mask the bind left, then restores the test's own.
        let after = unsafe { libc::umask(before) };
        let _listener = bound.unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(after, 0, "the bind did not restore the process's umask");
        assert_eq!(mode & !0o600, 0, "the socket was bound mode {mode:o} under umask 0: others could connect");
    }

    #[test]
    fn a_bind_waits_for_the_lock_of_a_daemon_starting_on_the_same_path() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        drop(UnixListener::bind(&path).unwrap()); // a stale socket
        let ino = std::fs::metadata(&path).unwrap().ino();
        // Another daemon holds the lock (it is between its probe and its bind).
        let held = lock_bind(&path).unwrap();
        let lock_ino = std::fs::metadata(lock_path(&path)).unwrap().ino();
        assert_eq!(std::fs::metadata(lock_path(&path)).unwrap().permissions().mode() & 0o777, 0o600);
        let p = path.clone();
        let binder = std::thread::spawn(move || {
            let g = Geometry::new("unit", 16, vec![ArenaSpec::packed("a", 4096, 1)]).unwrap();
            let bytes = 4 * g.slot_bytes();
            let cfg = TierConfig::new(g, bytes).with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain));
            Server::bind(&p, HostTier::new_shared(cfg).unwrap())
        });
        // Wait (bounded) until the kernel shows the bind blocked on the lock file's flock, or
        // the bind finished without it.
        let blocked = |ino: u64| {
            std::fs::read_to_string("/proc/locks")
                .unwrap()
                .lines()
                .any(|l| l.contains("->") && l.contains("FLOCK") && l.contains(&format!(":{ino} ")))
        };
        let t0 = Instant::now();
        while !blocked(lock_ino) {
            assert!(!binder.is_finished(), "the bind replaced the socket while another daemon held the lock");
            assert!(t0.elapsed() < Duration::from_secs(60), "the bind never waited for the lock");
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "the waiting bind touched the socket");
        drop(held);
        let server = binder.join().unwrap().expect("the bind goes on once the lock is free");
        assert!(UnixStream::connect(server.path()).is_ok(), "the stale socket was replaced by a listening one");
        // A second bind on the live socket still fails clearly.
        let g = Geometry::new("unit", 16, vec![ArenaSpec::packed("a", 4096, 1)]).unwrap();
        let bytes = 4 * g.slot_bytes();
        let cfg = TierConfig::new(g, bytes).with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain));
        let e = Server::bind(&path, HostTier::new_shared(cfg).unwrap()).unwrap_err().to_string();
        assert!(e.contains("already listens"), "{e}");
    }

    fn shared(slots: u64) -> Arc<Shared> {
        let g = Geometry::new("unit", 16, vec![ArenaSpec::packed("a", 4096, 1)]).unwrap();
        let bytes = slots * g.slot_bytes();
        let cfg = TierConfig::new(g, bytes).with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain));
        // One process may take the whole pool here (the per-process bound is tested in
        // daemon/tests/hostile.rs).
        let limits = Limits { slots_per_process: slots as usize, ..Limits::default() };
        Arc::new(Shared::new(HostTier::new_shared(cfg).unwrap(), limits))
    }

    fn keys(shared: &Shared, r: std::ops::Range<u64>) -> Vec<ContentKey> {
        r.map(|i| shared.tier.namespace().trace_page_key(i, 0)).collect()
    }

    fn prepare(keys: &[ContentKey]) -> Request {
        Request::PrepareSave { keys: keys.to_vec(), prefix: false, prefix_depth: None, parent: None }
    }

    /// A pidfd of this (live) process.
    fn own_pidfd() -> OwnedFd {
        // SAFETY: pidfd_open of our own pid returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id(), 0) };
        assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
        // SAFETY: a new fd nobody else owns.
        unsafe { OwnedFd::from_raw_fd(fd as i32) }
    }

    #[test]
    fn a_session_dropped_by_an_unwinding_thread_withholds_its_writes_and_drops_its_leases() {
        let sh = shared(16);
        let ready = keys(&sh, 0..2);
        let pending = keys(&sh, 10..13);
        let mut s = Session::new(sh.clone(), Some(std::process::id()), Some(own_pidfd()));
        let (sh2, ready2, pending2) = (sh.clone(), ready.clone(), pending.clone());
        let t = std::thread::spawn(move || {
            let Reply::SavePrepared { save, .. } = s.run(prepare(&ready2)) else { panic!("prepare") };
            assert_eq!(s.run(Request::FinishSave { save, outcome: Outcome::Done }), Reply::Done);
            assert!(matches!(s.run(Request::Query { keys: ready2, uses: 1 }), Reply::Leased { .. }));
            let Reply::SavePrepared { slots, .. } = s.run(prepare(&pending2)) else { panic!("prepare") };
            assert_eq!(slots.len(), 3);
            assert_eq!(sh2.core.audit(&[]).unwrap().pinned, 2);
            // The thread unwinds with the session (a bug anywhere outside a request's catch_unwind).
            panic!("the connection's thread unwinds");
        });
        assert!(t.join().is_err());
        let a = sh.core.audit(&ready).unwrap();
        assert_eq!(a.writing, 3, "the live writer's slots are withheld, not freed under its copy: {a:?}");
        assert_eq!(a.pinned, 0, "the session's lease was settled: {a:?}");
        assert!(sh.leases.lock().unwrap().is_empty());
        assert_eq!(sh.parked.lock().unwrap().len(), 1, "withheld until the process is gone");
        // A save by another session gets other slots.
        let others = keys(&sh, 20..33);
        let r = drive(&sh, prepare(&others));
        assert!(matches!(r, Reply::SavePrepared { ref slots, .. } if slots.len() == 13), "{r:?}");
    }

    fn drive(sh: &Arc<Shared>, req: Request) -> Reply {
        let mut s = Session::new(sh.clone(), None, None);
        s.gone_at_end = true;
        s.run(req)
    }

    #[test]
    fn a_panicking_request_is_a_typed_error_and_the_session_goes_on() {
        let sh = shared(8);
        let _ = sh.panic_hook.set(Box::new(|r| matches!(r, Request::Stats)));
        let k = keys(&sh, 0..2);
        let mut s = Session::new(sh.clone(), Some(std::process::id()), Some(own_pidfd()));
        let Reply::SavePrepared { save, .. } = s.run(prepare(&k)) else { panic!("prepare") };
        match s.run(Request::Stats) {
            Reply::Error(WireError::Panicked { request, .. }) => assert_eq!(request, "Stats"),
            r => panic!("{r:?}"),
        }
        assert_eq!(s.run(Request::FinishSave { save, outcome: Outcome::Done }), Reply::Done);
        assert!(sh.tier.contains(&k[0]));
        drop(s);
        assert!(sh.parked.lock().unwrap().is_empty());
    }

    #[test]
    fn limits_under_which_leases_could_saturate_a_slots_pins_are_refused_at_bind() {
        let l = Limits { connections: 1 << 12, leases_per_connection: 1 << 12, ..Limits::default() };
        match l.check() {
            Err(e @ Error::Limits(LimitsError::LeasePins { connections: 4096, leases: 4096, .. })) => {
                assert!(e.to_string().contains("may pin one slot"), "{e}")
            }
            r => panic!("limits that let leases pin one slot 2^24 times were accepted: {r:?}"),
        }
        Limits::default().check().unwrap();
    }

    /// An unwind that drops a session's pending copies before `end` handles them (a panic in an
    /// earlier step of `end`, or anywhere the maps are dropped) withholds their slots and pins.
    #[test]
    fn pending_copies_dropped_by_an_unwind_keep_their_slots_and_pins() {
        let sh = shared(16);
        let ready = keys(&sh, 0..2);
        let mut s = Session::new(sh.clone(), Some(std::process::id()), Some(own_pidfd()));
        let Reply::SavePrepared { save, .. } = s.run(prepare(&ready)) else { panic!("prepare") };
        assert_eq!(s.run(Request::FinishSave { save, outcome: Outcome::Done }), Reply::Done);
        let Reply::Leased { lease, .. } = s.run(Request::Query { keys: ready.clone(), uses: 1 }) else {
            panic!("query")
        };
        assert!(matches!(s.run(Request::Restore { lease, blocks: 2 }), Reply::Restoring { .. }));
        assert!(matches!(s.run(prepare(&keys(&sh, 10..13))), Reply::SavePrepared { .. }));
        // The pending copies' maps go as an unwind would drop them.
        let (saves, restores) = (std::mem::take(&mut s.saves), std::mem::take(&mut s.restores));
        let t = std::thread::spawn(move || {
            let _held = (saves, restores);
            panic!("the connection's thread unwinds with its pending copies");
        });
        assert!(t.join().is_err());
        let a = sh.core.audit(&[]).unwrap();
        assert_eq!(a.writing, 3, "the live writer's slots were freed by an unwind: {a:?}");
        assert_eq!(a.pinned, 2, "the live reader's pins were dropped by an unwind: {a:?}");
        let st = sh.tier.stats();
        assert_eq!((st.quarantined_slots, st.quarantined_pins), (3, 2), "withheld slots and pins: {st:?}");
        s.gone_at_end = true;
        drop(s);
    }

    #[test]
    fn a_timeout_the_clock_cannot_add_is_refused_at_bind() {
        for t in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
            let l = Limits { frame_timeout: t, ..Limits::default() };
            match l.check() {
                Err(e @ Error::Limits(LimitsError::TimeoutTooLarge { which: "frame", .. })) => {
                    assert!(e.to_string().contains("frame timeout"), "{e}")
                }
                r => panic!("a frame timeout of {t:?} was accepted: {r:?}"),
            }
        }
        Limits { frame_timeout: Duration::from_secs(86_400 * 365), ..Limits::default() }.check().unwrap();
    }

    #[test]
    fn drive_session_runs_encoded_requests_and_releases_everything() {
        let sh = shared(8);
        let k = keys(&sh, 0..3);
        let mut bytes = Vec::new();
        for r in [
            prepare(&k),
            Request::FinishSave { save: 1, outcome: Outcome::Done },
            Request::Query { keys: k.clone(), uses: 2 },
            Request::Restore { lease: 0, blocks: 2 },
            prepare(&keys(&sh, 5..7)),
        ] {
            bytes.extend(postcard::to_stdvec(&r).unwrap());
        }
        let replies = drive_session(sh.tier.clone(), Limits::default(), &bytes).unwrap();
        assert_eq!(replies.len(), 5);
        assert!(matches!(replies[3], Reply::Restoring { ref slots, .. } if slots.len() == 2), "{:?}", replies[3]);
        let a = sh.core.audit(&k).unwrap();
        assert_eq!((a.writing, a.pinned, a.ready), (0, 0, 3), "{a:?}");
    }
}
