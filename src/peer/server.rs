//! [`PeerServer`]: the owner's side of the peer protocol. One thread accepts (and expires leases
//! past their time-to-live); one thread per connection, at most [`PeerLimits::connections`].

use super::auth::{self, PeerSecret, Role};
use super::pins::{Hold, OwnerLease, PinTable};
use super::proto::{self, Frame, PeerRefusal, PeerReply, PeerRequest, Timed, WirePeerBlock, WirePeerLimits};
use super::{PeerError, PeerTransport};
use crate::slab::slot::SlotState;
use crate::sync::Arc as TierArc;
use crate::tier::core::Core;
use crate::tier::lease::LeasedBlock;
use crate::HostTier;
use std::collections::HashMap;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The bounds a [`PeerServer`] holds each connection to. A request over one is refused
/// (a `Refused` reply naming the limit) and does nothing; a frame over [`PeerLimits::frame_bytes`] or one that
/// does not decode closes that connection (logged) and no other. Defaults in parentheses.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PeerLimits {
    /// Connections served at once (64); one more is closed at accept.
    pub connections: usize,
    /// Time from accept to a complete hello, the whole handshake (every frame of it, however it
    /// arrives) included (5 s).
    pub hello_timeout: Duration,
    /// Time a whole frame may take once its first byte arrived, however its bytes trickle (30 s).
    pub frame_timeout: Duration,
    /// Time a whole reply may take to be taken by the reader (30 s).
    pub write_timeout: Duration,
    /// Time an authenticated connection may idle between requests before the owner closes it
    /// (120 s); the welcome tells the reader, whose idle connections are closed before it. TCP
    /// keepalive (probes after 30 s idle, every 10 s, 3 unanswered end it) finds a reader that
    /// vanished sooner.
    pub idle_timeout: Duration,
    /// Largest request frame payload, bytes (1 MiB = 1,048,576 B).
    pub frame_bytes: usize,
    /// Keys one query may name (4,096).
    pub keys_per_query: usize,
    /// Leases one connection holds at once (64).
    pub leases_per_connection: usize,
    /// Longest lease time-to-live (30 s); a query asking more gets this.
    pub max_lease_ttl: Duration,
    /// Longest hold for a peer ([`PeerServer::hold`], 60 s).
    pub max_hold_ttl: Duration,
    /// Blocks that peer leases and holds together may keep pinned at once, over every connection
    /// (`None`: all but an eighth of the pool's slots, the eighth rounded down; `Some(0)` and a
    /// budget over the pool's slots are a [`PeerError::Config`]). A block pinned by several peer
    /// leases and holds counts once. A query is answered with the longest prefix that fits (refused with a limit when nothing
    /// fits) and a hold holds what fits, so peers cannot pin the whole pool and leave the owner's
    /// own saves without a victim.
    pub pinned_blocks: Option<usize>,
}

impl Default for PeerLimits {
    fn default() -> Self {
        PeerLimits {
            connections: 64,
            hello_timeout: Duration::from_secs(5),
            frame_timeout: Duration::from_secs(30),
            write_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(120),
            frame_bytes: 1 << 20,
            keys_per_query: 4096,
            leases_per_connection: 64,
            max_lease_ttl: Duration::from_secs(30),
            max_hold_ttl: Duration::from_secs(60),
            pinned_blocks: None,
        }
    }
}

impl PeerLimits {
    fn wire(&self) -> WirePeerLimits {
        WirePeerLimits {
            frame_bytes: self.frame_bytes as u64,
            keys_per_query: self.keys_per_query as u64,
            leases_per_connection: self.leases_per_connection as u64,
            max_lease_ttl_ms: self.max_lease_ttl.as_millis().min(u64::MAX as u128) as u64,
            idle_timeout_ms: self.idle_timeout.as_millis().min(u64::MAX as u128) as u64,
        }
    }
}

/// What a [`PeerServer`] has done since it started, and what it holds now
/// ([`PeerServer::stats`]; with feature `metrics`, the `kvtier_peer_*` families of
/// `PeerServer::register_metrics`).
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct PeerServerStats {
    /// Control connections open now.
    pub connections: u64,
    /// Connections accepted since the server started (refused ones included).
    pub connections_accepted: u64,
    /// Peer leases live now.
    pub leases: u64,
    /// Peer leases granted (queries answered with at least one block).
    pub leases_granted: u64,
    /// Blocks answered under those leases (each lease's blocks counted once).
    pub blocks_leased: u64,
    /// Blocks a reader read and the owner then validated (slot at its generation, lease live).
    pub blocks_validated: u64,
    /// Blocks a reader read whose validation failed (slot reused, lease expired): the reader
    /// dropped them.
    pub blocks_invalid: u64,
    /// Distinct blocks peer leases and holds pin now.
    pub pinned_blocks: u64,
    /// The pin budget ([`PeerLimits::pinned_blocks`], resolved), blocks.
    pub pin_budget: u64,
    /// Blocks held for a peer ([`PeerServer::hold`]) not fetched yet.
    pub held_blocks: u64,
    /// Connections refused at accept over [`PeerLimits::connections`] (each told so).
    pub refused_connections: u64,
    /// Hellos refused because the reader's proof of the secret failed.
    pub refused_auth: u64,
    /// Queries refused over [`PeerLimits::keys_per_query`].
    pub refused_keys_per_query: u64,
    /// Queries refused over [`PeerLimits::leases_per_connection`].
    pub refused_leases_per_connection: u64,
    /// Queries refused because not even their first block fit the pin budget.
    pub refused_pinned_blocks: u64,
}

/// The server's counters (the cumulative half of [`PeerServerStats`]).
#[derive(Default)]
struct Counters {
    connections_accepted: AtomicU64,
    leases_granted: AtomicU64,
    blocks_leased: AtomicU64,
    blocks_validated: AtomicU64,
    blocks_invalid: AtomicU64,
    refused_connections: AtomicU64,
    refused_auth: AtomicU64,
    refused_keys_per_query: AtomicU64,
    refused_leases_per_connection: AtomicU64,
    refused_pinned_blocks: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

pub(super) struct Shared {
    tier: HostTier,
    /// [`PeerLimits::pinned_blocks`], resolved against the pool's capacity.
    pin_budget: usize,
    core: TierArc<Core>,
    transport: Arc<dyn PeerTransport>,
    limits: PeerLimits,
    /// The peers' shared secret (`None`: the empty key, on loopback only).
    secret: Option<PeerSecret>,
    stop: AtomicBool,
    /// Peer leases and holds. A query or a hold counts its keys against the pin budget under it
    /// (as reserved pins), then calls the tier (`HostTier::query`: index, slot pins, an SSD
    /// promotion's reads) without it, then takes it again to file the lease and drop the
    /// reservation: so the budget holds for concurrent queries, and a slow promotion stalls no
    /// other connection, nor the accept loop.
    table: Mutex<PinTable>,
    next_lease: AtomicU64,
    next_conn: AtomicU64,
    live_conns: AtomicUsize,
    counters: Counters,
    /// Open connections: a clone of each stream (shut down at stop) and its thread.
    conns: Mutex<HashMap<u64, Connection>>,
}

/// An open connection: a clone of its stream and the thread serving it.
type Connection = (TcpStream, Option<JoinHandle<()>>);

/// The owner's side of the peer protocol over one in-process tier (see the module docs). Dropping
/// it (or [`PeerServer::shutdown`]) closes every connection, releases every peer lease and joins
/// every thread.
pub struct PeerServer {
    pub(super) shared: Arc<Shared>,
    addr: SocketAddr,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for PeerServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerServer").field("addr", &self.addr).field("live_leases", &self.live_leases()).finish()
    }
}

impl PeerServer {
    /// Listens on `addr` (a loopback address, e.g. `127.0.0.1:0`) and serves `tier`'s blocks to
    /// peers without a secret: [`PeerServer::bind_with_secret`] with `None`.
    ///
    /// # Errors
    /// Those of [`PeerServer::bind_with_secret`]; an address that is not loopback is a
    /// [`PeerError::Config`].
    pub fn bind(
        tier: &HostTier,
        addr: impl ToSocketAddrs,
        transport: Arc<dyn PeerTransport>,
        limits: PeerLimits,
    ) -> Result<PeerServer, PeerError> {
        Self::bind_with_secret(tier, addr, transport, limits, None)
    }

    /// Listens on `addr` (e.g. `10.0.0.5:7070`) and serves `tier`'s blocks to peers that prove
    /// `secret` in their hello (see the module docs of `auth` and `docs/design.md`, "Trust model:
    /// the peer port"); their reads go through `transport`, whose descriptor is sent only to
    /// them. Without a secret (`None`) only a loopback address is allowed, and only readers
    /// without one are let in.
    ///
    /// # Errors
    /// [`PeerError::NotInProcess`] for a connected tier; [`PeerError::Config`] for a limit of 0,
    /// a pin budget over the pool's slots, or no secret on an address that is not loopback;
    /// [`PeerError::Transport`] if the transport has no descriptor; [`PeerError::Connect`] if
    /// `addr` cannot be bound.
    pub fn bind_with_secret(
        tier: &HostTier,
        addr: impl ToSocketAddrs,
        transport: Arc<dyn PeerTransport>,
        limits: PeerLimits,
        secret: Option<PeerSecret>,
    ) -> Result<PeerServer, PeerError> {
        let core = tier.in_process_core().ok_or(PeerError::NotInProcess)?.clone();
        if limits.connections == 0
            || limits.keys_per_query == 0
            || limits.leases_per_connection == 0
            || limits.pinned_blocks == Some(0)
        {
            return Err(PeerError::Config(
                "connections, keys per query, leases per connection and pinned blocks must be > 0".into(),
            ));
        }
        let capacity = core.pool().capacity() as usize;
        if let Some(n) = limits.pinned_blocks.filter(|&n| n > capacity) {
            return Err(PeerError::Config(format!("pinned blocks ({n}) must be at most the pool's {capacity} slots")));
        }
        let pin_budget = limits.pinned_blocks.unwrap_or(capacity - capacity / 8);
        transport.local_descriptor()?;
        let listener = TcpListener::bind(addr).map_err(|source| PeerError::Connect { addr: "bind".into(), source })?;
        let addr = listener.local_addr().map_err(|source| PeerError::Connect { addr: "bind".into(), source })?;
        // Seeded bug (tests only): `peer-listens-open-without-secret` skips the check.
        if secret.is_none() && !addr.ip().is_loopback() && !crate::seeded::seeded("peer-listens-open-without-secret") {
            return Err(PeerError::Config(format!(
                "serving peers at {addr}, not a loopback address, needs a shared secret (kvtierd --peer-secret-file, \
                 Python peer_secret_file=): \
                 without one anybody who reaches the port reads the pool"
            )));
        }
        listener.set_nonblocking(true).map_err(|source| PeerError::Connect { addr: addr.to_string(), source })?;
        let shared = Arc::new(Shared {
            tier: tier.clone(),
            pin_budget,
            core,
            transport,
            limits,
            secret,
            stop: AtomicBool::new(false),
            table: Mutex::new(PinTable::default()),
            // Lease ids start at a random point: a stale id from an earlier server is not a
            // live lease of this one.
            next_lease: AtomicU64::new(random_start()),
            next_conn: AtomicU64::new(1),
            live_conns: AtomicUsize::new(0),
            counters: Counters::default(),
            conns: Mutex::new(HashMap::new()),
        });
        let s = shared.clone();
        let accept = std::thread::Builder::new()
            .name("kvtier-peer-accept".into())
            .spawn(move || accept_loop(&s, listener))
            .map_err(|source| PeerError::Connect { addr: addr.to_string(), source })?;
        Ok(PeerServer { shared, addr, accept: Some(accept) })
    }

    /// The address the server listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Peer leases live now.
    pub fn live_leases(&self) -> usize {
        super::lock(&self.shared.table).leases.len()
    }

    /// Settles every peer lease past its time-to-live now (the accept thread does it every
    /// 20 ms); returns how many.
    pub fn expire_leases(&self) -> usize {
        self.shared.expire_due()
    }

    /// Prefill/decode handoff: keeps the longest ready prefix of `keys` pinned until a peer has
    /// fetched each of its blocks (the owner validated them for a reader) or `ttl` (capped at
    /// [`PeerLimits::max_hold_ttl`]) passed, whichever comes first. Returns how many blocks are
    /// held (0 if the first key is not ready).
    pub fn hold(&self, keys: &[crate::ContentKey], ttl: Duration) -> usize {
        // The budget counted under the lease table's lock, as a query's, so it holds for both;
        // the tier is queried without it.
        let mut table = super::lock(&self.shared.table);
        let fit = self.shared.pin_prefix(&table, keys);
        let reserved = table.reserve(&keys[..fit]);
        drop(table);
        let prefix = self.shared.tier.query(&keys[..fit]);
        let mut leases = Vec::new();
        for b in prefix.blocks() {
            let lease = self.shared.tier.query(std::slice::from_ref(&b.key));
            if lease.is_empty() {
                break;
            }
            leases.push((b.key, lease));
        }
        let mut table = super::lock(&self.shared.table);
        let expires = Instant::now() + ttl.min(self.shared.limits.max_hold_ttl);
        // One lease per block, so each is let go when a peer fetched it.
        let (mut held, mut replaced) = (0, Vec::new());
        for (key, lease) in leases {
            held += 1;
            let expires = table.holds.get(&key).map_or(expires, |h| h.expires.max(expires));
            replaced.extend(table.insert_hold(key, Hold { _pins: lease, expires }));
        }
        table.unreserve(&reserved);
        drop(table);
        // Outside the lock: settling unpins.
        drop((replaced, prefix));
        held
    }

    /// Blocks held for peers ([`PeerServer::hold`]) that no peer has fetched yet.
    pub fn held_blocks(&self) -> usize {
        super::lock(&self.shared.table).holds.len()
    }

    /// What the server has done and holds now (see [`PeerServerStats`]).
    pub fn stats(&self) -> PeerServerStats {
        self.shared.stats()
    }

    /// Closes every connection, releases every peer lease and joins every thread.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(a) = self.accept.take() {
            let _ = a.join();
        }
        let conns: Vec<_> = super::lock(&self.shared.conns).drain().collect();
        for (_, (stream, handle)) in conns {
            let _ = stream.shutdown(Shutdown::Both);
            if let Some(h) = handle {
                let _ = h.join();
            }
        }
        // Outside the lock: settling unpins.
        let all = std::mem::take(&mut *super::lock(&self.shared.table));
        drop(all);
    }
}

impl Drop for PeerServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Shared {
    pub(super) fn stats(&self) -> PeerServerStats {
        let (leases, pinned_blocks, held_blocks) = {
            let t = super::lock(&self.table);
            (t.leases.len() as u64, t.pins.len() as u64, t.holds.len() as u64)
        };
        let c = &self.counters;
        let n = |a: &AtomicU64| a.load(Ordering::Relaxed);
        PeerServerStats {
            connections: self.live_conns.load(Ordering::Relaxed) as u64,
            connections_accepted: n(&c.connections_accepted),
            leases,
            leases_granted: n(&c.leases_granted),
            blocks_leased: n(&c.blocks_leased),
            blocks_validated: n(&c.blocks_validated),
            blocks_invalid: n(&c.blocks_invalid),
            pinned_blocks,
            pin_budget: self.pin_budget as u64,
            held_blocks,
            refused_connections: n(&c.refused_connections),
            refused_auth: n(&c.refused_auth),
            refused_keys_per_query: n(&c.refused_keys_per_query),
            refused_leases_per_connection: n(&c.refused_leases_per_connection),
            refused_pinned_blocks: n(&c.refused_pinned_blocks),
        }
    }

    /// How many leading `keys` peers may pin without going over the pin budget: keys that peer
    /// leases or holds pin already (`table`, locked) cost nothing, every other distinct key one
    /// block of what is left of the budget. O(keys).
    fn pin_prefix(&self, table: &PinTable, keys: &[crate::ContentKey]) -> usize {
        if crate::seeded::seeded("peer-pins-unbounded") {
            return keys.len();
        }
        let mut room = self.pin_budget.saturating_sub(table.pins.len());
        let mut new = std::collections::HashSet::new();
        keys.iter()
            .take_while(|k| {
                if table.pins.contains_key(*k) || new.contains(*k) {
                    return true;
                }
                let fits = room > 0;
                if fits {
                    room -= 1;
                    new.insert(**k);
                }
                fits
            })
            .count()
    }

    fn expire_due(&self) -> usize {
        if crate::seeded::seeded("peer-lease-never-expires") {
            return 0;
        }
        let now = Instant::now();
        let (gone, holds): (Vec<OwnerLease>, Vec<Hold>) = {
            let mut t = super::lock(&self.table);
            let due: Vec<u64> = t.leases.iter().filter(|(_, l)| l.expires <= now).map(|(&id, _)| id).collect();
            let gone = due.iter().filter_map(|&id| t.remove_lease(id)).collect();
            let due: Vec<crate::ContentKey> =
                t.holds.iter().filter(|(_, h)| h.expires <= now).map(|(k, _)| *k).collect();
            (gone, due.iter().filter_map(|k| t.remove_hold(k)).collect())
        };
        // Dropped outside the lock: settling unpins.
        drop(holds);
        gone.len()
    }

    /// A reader fetched `keys` (validated): their holds settle.
    fn fetched(&self, keys: &[crate::ContentKey]) {
        // Seeded bug (tests only): `peer-hold-outlives-fetch` keeps holds until their TTL.
        if keys.is_empty() || crate::seeded::seeded("peer-hold-outlives-fetch") {
            return;
        }
        let done: Vec<Hold> = {
            let mut t = super::lock(&self.table);
            keys.iter().filter_map(|k| t.remove_hold(k)).collect()
        };
        // Dropped outside the lock: settling unpins.
        drop(done);
    }

    fn release_conn(&self, conn: u64) {
        let gone: Vec<OwnerLease> = {
            let mut t = super::lock(&self.table);
            let ids: Vec<u64> = t.leases.iter().filter(|(_, l)| l.conn == conn).map(|(&id, _)| id).collect();
            ids.iter().filter_map(|&id| t.remove_lease(id)).collect()
        };
        drop(gone);
    }
}

/// A random first lease id (never 0, which means "no lease"), far from 2^64 so ids never wrap.
fn random_start() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(std::process::id() as u64);
    (h.finish() >> 2) | 1
}

/// Refused connections kept open a while (up to this many, each up to [`LINGER`]) so the reader
/// reads the refusal before the close: closing a socket with its hello unread would reset it, and
/// the reset could overtake the refusal.
const LINGERING: usize = 64;
/// How long a refused connection is kept for its reader to take the refusal.
const LINGER: Duration = Duration::from_millis(500);

/// Tells a connection over the limit why it is refused (a `Refused(Connections)` frame, written
/// without blocking into the empty send buffer), then shuts its sending side; returns it for the
/// accept loop to drain and close.
fn refuse_at_accept(shared: &Shared, stream: TcpStream) -> Option<TcpStream> {
    // Seeded bug (tests only): `peer-refuses-silently` closes the connection without a word.
    if crate::seeded::seeded("peer-refuses-silently") {
        return None;
    }
    stream.set_nonblocking(true).ok()?;
    let mut out = Vec::new();
    let refusal = PeerReply::Refused(PeerRefusal::Connections { max: shared.limits.connections as u64 });
    proto::write_msg(&mut &stream, &refusal, &mut out).ok()?;
    stream.shutdown(Shutdown::Write).ok()?;
    Some(stream)
}

/// Reads and drops what a refused connection sends; true once it is done with (its reader
/// closed it, an error, or [`LINGER`] passed).
fn drained(stream: &TcpStream, since: Instant) -> bool {
    let mut scratch = [0u8; 512];
    loop {
        match std::io::Read::read(&mut &*stream, &mut scratch) {
            Ok(0) => return true,
            Ok(_) => continue,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return since.elapsed() >= LINGER,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(_) => return true,
        }
    }
}

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    let mut last_expiry = Instant::now();
    let mut lingering: std::collections::VecDeque<(TcpStream, Instant)> = std::collections::VecDeque::new();
    while !shared.stop.load(Ordering::Acquire) {
        lingering.retain(|(s, since)| !drained(s, *since));
        match listener.accept() {
            Ok((stream, from)) => {
                bump(&shared.counters.connections_accepted, 1);
                if shared.live_conns.load(Ordering::Acquire) >= shared.limits.connections {
                    bump(&shared.counters.refused_connections, 1);
                    tracing::warn!(%from, "peer connection refused: too many connections");
                    if let Some(s) = refuse_at_accept(shared, stream) {
                        if lingering.len() >= LINGERING {
                            lingering.pop_front();
                        }
                        lingering.push_back((s, Instant::now()));
                    }
                    continue;
                }
                let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
                let Ok(clone) = stream.try_clone() else { continue };
                shared.live_conns.fetch_add(1, Ordering::AcqRel);
                let mut conns = super::lock(&shared.conns);
                // Joins the threads of connections that ended, so the table stays bounded.
                conns.retain(|_, (_, h)| !h.as_ref().is_some_and(|h| h.is_finished()));
                let s = shared.clone();
                match std::thread::Builder::new().name("kvtier-peer-conn".into()).spawn(move || {
                    serve(&s, id, stream, from);
                    s.release_conn(id);
                    s.live_conns.fetch_sub(1, Ordering::AcqRel);
                }) {
                    Ok(h) => {
                        conns.insert(id, (clone, Some(h)));
                    }
                    Err(e) => {
                        shared.live_conns.fetch_sub(1, Ordering::AcqRel);
                        tracing::warn!(error = %e, "peer connection refused: no thread");
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(Duration::from_millis(5)),
            Err(e) => {
                tracing::warn!(error = %e, "peer accept failed");
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        if last_expiry.elapsed() >= Duration::from_millis(20) {
            shared.expire_due();
            last_expiry = Instant::now();
        }
    }
}

/// `now + d`, or far in the future when the clock cannot add `d`.
fn after(d: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(d).unwrap_or_else(|| now + Duration::from_secs(1 << 30))
}

/// Turns TCP keepalive on for `stream`: probes after 30 s idle, every 10 s, and 3 unanswered end
/// the connection (a reader or owner that vanished without a FIN). Best effort.
pub(crate) fn keepalive(stream: &TcpStream) {
    use std::os::fd::AsRawFd;
    let fd = stream.as_raw_fd();
    for (level, name, value) in [
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1),
        (libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, 30),
        (libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, 10),
        (libc::IPPROTO_TCP, libc::TCP_KEEPCNT, 3),
    ] {
        let v: libc::c_int = value;
        // SAFETY: `fd` is the open socket `stream` owns for this call; the option value is a
        // c_int on the stack whose size is passed with it.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                name,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
    }
}

/// Reads one request frame, the whole frame by `deadline`.
fn read_request(
    shared: &Shared,
    stream: &TcpStream,
    buf: &mut Vec<u8>,
    deadline: Instant,
) -> std::io::Result<Frame<PeerRequest>> {
    proto::read_msg(&mut Timed { stream, deadline }, buf, shared.limits.frame_bytes)
}

/// Reads the next request of an authenticated connection: the first byte may wait up to the
/// idle timeout, the rest of the frame must arrive within the frame timeout of it.
fn next_request(shared: &Shared, stream: &TcpStream, buf: &mut Vec<u8>) -> std::io::Result<Frame<PeerRequest>> {
    let mut first = [0u8; 1];
    let idle = after(shared.limits.idle_timeout);
    loop {
        match std::io::Read::read(&mut Timed { stream, deadline: idle }, &mut first) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    let mut rest = Timed { stream, deadline: after(shared.limits.frame_timeout) };
    let mut chained = std::io::Read::chain(&first[..], &mut rest);
    proto::read_msg(&mut chained, buf, shared.limits.frame_bytes)
}

/// Why a connection ended before or during its hello (logged).
enum HelloEnd {
    /// A refusal to send, then close.
    Refuse(PeerRefusal, &'static str),
    /// Close without a word (the stream failed, an unreadable frame).
    Close(String),
}

/// What a handshake that checked gives: the reader's transport descriptor, the reader's nonce and
/// the owner's.
type Proven = (Vec<u8>, [u8; auth::NONCE_BYTES], [u8; auth::NONCE_BYTES]);

/// The handshake (module docs of `auth`), all of it by `deadline`: the reader's hello, the
/// challenge, the reader's proof. Returns the reader's transport descriptor and the two nonces
/// once the proof checked and the namespace is the owner's.
fn handshake(
    shared: &Shared,
    stream: &TcpStream,
    buf: &mut Vec<u8>,
    out: &mut Vec<u8>,
    deadline: Instant,
) -> Result<Proven, HelloEnd> {
    let read = |buf: &mut Vec<u8>| match read_request(shared, stream, buf, deadline) {
        Ok(Frame::Msg(r)) => Ok(r),
        Ok(Frame::Oversized(len)) => Err(HelloEnd::Close(format!("an oversized hello frame ({len} B)"))),
        Ok(Frame::Undecodable(why)) => Err(HelloEnd::Close(format!("a malformed hello frame: {why}"))),
        Err(e) => Err(HelloEnd::Close(format!("the hello did not arrive: {e}"))),
    };
    let reader_nonce = match read(buf)? {
        PeerRequest::Hello { magic, .. } if magic != proto::PEER_MAGIC => {
            return Err(HelloEnd::Refuse(PeerRefusal::Magic, "another magic"))
        }
        PeerRequest::Hello { version, .. } if version != proto::PEER_PROTOCOL_VERSION => {
            return Err(HelloEnd::Refuse(
                PeerRefusal::Version { ours: proto::PEER_PROTOCOL_VERSION, theirs: version },
                "another protocol version",
            ))
        }
        PeerRequest::Hello { nonce, .. } => nonce,
        _ => return Err(HelloEnd::Refuse(PeerRefusal::OutOfOrder, "a request before the hello")),
    };
    let owner_nonce = auth::nonce().map_err(|e| HelloEnd::Close(e.to_string()))?;
    proto::write_msg(&mut Timed { stream, deadline }, &PeerReply::Challenge { nonce: owner_nonce }, out)
        .map_err(|e| HelloEnd::Close(format!("the challenge was not taken: {e}")))?;
    let PeerRequest::Auth { mac, namespace, descriptor } = read(buf)? else {
        return Err(HelloEnd::Refuse(PeerRefusal::OutOfOrder, "no proof after the challenge"));
    };
    if !auth::verify(
        shared.secret.as_ref(),
        Role::Reader,
        &reader_nonce,
        &owner_nonce,
        &namespace,
        0,
        &descriptor,
        &mac,
    ) {
        bump(&shared.counters.refused_auth, 1);
        return Err(HelloEnd::Refuse(PeerRefusal::Auth, "the reader's proof of the secret failed"));
    }
    // Authenticated from here: the owner's namespace may be told.
    let ours = shared.tier.namespace();
    if namespace != ours {
        return Err(HelloEnd::Refuse(PeerRefusal::Namespace { ours }, "another namespace"));
    }
    Ok((descriptor, reader_nonce, owner_nonce))
}

fn serve(shared: &Shared, conn: u64, stream: TcpStream, from: SocketAddr) {
    let _ = stream.set_nodelay(true);
    keepalive(&stream);
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let hello_deadline = after(shared.limits.hello_timeout);
    let mut peer = None;
    let welcome = match handshake(shared, &stream, &mut buf, &mut out, hello_deadline) {
        Ok((descriptor, reader_nonce, owner_nonce)) => {
            let added = shared.transport.add_peer(&descriptor);
            if let Ok(p) = &added {
                // Forgotten by `finish` however the connection ends.
                peer = Some(*p);
            }
            match (added, shared.transport.local_descriptor()) {
                (Ok(_), Ok(d)) => {
                    let ours = shared.tier.namespace();
                    let block_bytes = shared.tier.geometry().slot_bytes();
                    let mac = auth::mac(
                        shared.secret.as_ref(),
                        Role::Owner,
                        &reader_nonce,
                        &owner_nonce,
                        &ours,
                        block_bytes,
                        &d,
                    );
                    Ok(PeerReply::Welcome {
                        mac,
                        namespace: ours,
                        block_bytes,
                        descriptor: d,
                        limits: shared.limits.wire(),
                    })
                }
                (Err(e), _) | (_, Err(e)) => {
                    Err(HelloEnd::Refuse(PeerRefusal::Descriptor(e.to_string()), "a descriptor"))
                }
            }
        }
        Err(e) => Err(e),
    };
    let reply = match welcome {
        Ok(w) => w,
        Err(HelloEnd::Refuse(r, why)) => {
            tracing::warn!(%from, reason = why, "peer hello refused");
            let _ = proto::write_msg(
                &mut Timed {
                    stream: &stream,
                    deadline: after(shared.limits.write_timeout.min(Duration::from_secs(1))),
                },
                &PeerReply::Refused(r),
                &mut out,
            );
            finish(shared, peer, &stream);
            return;
        }
        Err(HelloEnd::Close(why)) => {
            tracing::warn!(%from, reason = %why, "peer connection closed in its hello");
            finish(shared, peer, &stream);
            return;
        }
    };
    let mut reply = reply;
    loop {
        if let Err(e) = proto::write_msg(
            &mut Timed { stream: &stream, deadline: after(shared.limits.write_timeout) },
            &reply,
            &mut out,
        ) {
            tracing::debug!(%from, error = %e, "peer connection closed: reply not taken");
            break;
        }
        // A large reply's buffers are not kept for the connection's life.
        if out.capacity() > 1 << 20 {
            out = Vec::new();
        }
        if buf.capacity() > 1 << 20 {
            buf = Vec::new();
        }
        let req = match next_request(shared, &stream, &mut buf) {
            Ok(Frame::Msg(r)) => r,
            Ok(Frame::Oversized(len)) => {
                tracing::warn!(%from, len, max = shared.limits.frame_bytes, "peer connection closed: oversized frame");
                break;
            }
            Ok(Frame::Undecodable(why)) => {
                tracing::warn!(%from, reason = %why, "peer connection closed: malformed frame");
                break;
            }
            Err(e) => {
                if e.kind() != std::io::ErrorKind::UnexpectedEof {
                    tracing::debug!(%from, error = %e, "peer connection closed (idle, a frame past its timeout, or an error)");
                }
                break;
            }
        };
        reply = match req {
            PeerRequest::Hello { .. } | PeerRequest::Auth { .. } => {
                let _ = proto::write_msg(
                    &mut Timed { stream: &stream, deadline: after(shared.limits.write_timeout) },
                    &PeerReply::Refused(PeerRefusal::OutOfOrder),
                    &mut out,
                );
                break;
            }
            req => answer(shared, conn, req),
        };
    }
    finish(shared, peer, &stream);
}

/// Ends a connection: forgets its transport peer and shuts the stream down (the accept thread
/// keeps a clone of it, to shut it down at stop: the reader sees the end now).
fn finish(shared: &Shared, peer: Option<super::TransportPeer>, stream: &TcpStream) {
    if let Some(p) = peer {
        shared.transport.remove_peer(p);
    }
    let _ = stream.shutdown(Shutdown::Both);
}

fn limit(what: &str, asked: u64, max: u64) -> PeerReply {
    PeerReply::Refused(PeerRefusal::Limit { what: what.into(), asked, max })
}

fn answer(shared: &Shared, conn: u64, req: PeerRequest) -> PeerReply {
    match req {
        PeerRequest::Hello { .. } | PeerRequest::Auth { .. } => PeerReply::Refused(PeerRefusal::OutOfOrder),
        PeerRequest::Query { keys, ttl_ms } => {
            if keys.len() > shared.limits.keys_per_query {
                bump(&shared.counters.refused_keys_per_query, 1);
                return limit("keys per query", keys.len() as u64, shared.limits.keys_per_query as u64);
            }
            let held = super::lock(&shared.table).leases_of(conn);
            if held >= shared.limits.leases_per_connection {
                bump(&shared.counters.refused_leases_per_connection, 1);
                return limit("leases per connection", held as u64 + 1, shared.limits.leases_per_connection as u64);
            }
            let ttl = if crate::seeded::seeded("peer-trusts-ttl") {
                Duration::from_millis(ttl_ms)
            } else {
                Duration::from_millis(ttl_ms).min(shared.limits.max_lease_ttl)
            };
            // The pin budget is checked and the keys that fit counted against it (reserved) under
            // the table's lock, so concurrent queries cannot together pin more than it; the tier
            // (an SSD promotion's reads) is queried without the lock.
            let mut table = super::lock(&shared.table);
            let fit = shared.pin_prefix(&table, &keys);
            if fit == 0 && !keys.is_empty() {
                bump(&shared.counters.refused_pinned_blocks, 1);
                return limit("blocks pinned for peers", keys.len() as u64, shared.pin_budget as u64);
            }
            let reserved = table.reserve(&keys[..fit]);
            // Seeded bug (tests only): `peer-table-locked-across-query` queries the tier under the
            // table's lock (every other connection, the stats and the accept loop's expiry wait
            // for an SSD promotion).
            let held = if crate::seeded::seeded("peer-table-locked-across-query") {
                Some(table)
            } else {
                drop(table);
                None
            };
            let lease = shared.tier.query(&keys[..fit]);
            let mut table = held.unwrap_or_else(|| super::lock(&shared.table));
            let slot_bytes = shared.core.pool().slot_bytes();
            let blocks: Vec<WirePeerBlock> = lease
                .blocks()
                .iter()
                .map(|b| WirePeerBlock {
                    key: b.key,
                    offset: b.slot.slot.0 as u64 * slot_bytes,
                    generation: b.slot.generation,
                })
                .collect();
            let ttl_ms = ttl.as_millis().min(u64::MAX as u128) as u64;
            if blocks.is_empty() {
                table.unreserve(&reserved);
                return PeerReply::Leased { lease: 0, ttl_ms, blocks };
            }
            let id = shared.next_lease.fetch_add(1, Ordering::Relaxed);
            let expires =
                Instant::now().checked_add(ttl).unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 40));
            bump(&shared.counters.leases_granted, 1);
            bump(&shared.counters.blocks_leased, blocks.len() as u64);
            table.insert_lease(id, OwnerLease { conn, lease, expires });
            table.unreserve(&reserved);
            PeerReply::Leased { lease: id, ttl_ms, blocks }
        }
        PeerRequest::Validate { lease, blocks } => {
            let now = Instant::now();
            let map = super::lock(&shared.table);
            let Some(l) = map.leases.get(&lease).filter(|l| l.conn == conn) else {
                // Expired, released or never granted: whatever the reader read is invalid
                // (counted up to one query's worth, whatever it claims).
                bump(&shared.counters.blocks_invalid, blocks.min(shared.limits.keys_per_query as u64));
                return PeerReply::Valid(Vec::new());
            };
            let live = (now < l.expires || crate::seeded::seeded("peer-lease-never-expires")) && !l.lease.is_settled();
            let read = &l.lease.blocks()[..(blocks.min(l.lease.len() as u64) as usize)];
            let valid: Vec<bool> = read.iter().map(|b| live && still_holds(&shared.core, b)).collect();
            let fetched: Vec<crate::ContentKey> =
                read.iter().zip(&valid).filter(|(_, &v)| v).map(|(b, _)| b.key).collect();
            drop(map);
            bump(&shared.counters.blocks_validated, fetched.len() as u64);
            bump(&shared.counters.blocks_invalid, (valid.len() - fetched.len()) as u64);
            shared.fetched(&fetched);
            PeerReply::Valid(valid)
        }
        PeerRequest::Release { lease } => {
            let gone = {
                let mut t = super::lock(&shared.table);
                match t.leases.get(&lease) {
                    Some(l) if l.conn == conn => t.remove_lease(lease),
                    _ => None,
                }
            };
            PeerReply::Released(gone.is_some_and(|l| l.lease.release()))
        }
    }
}

/// True if `b`'s slot is `READY` at its generation and the index names it for its key.
fn still_holds(core: &Core, b: &LeasedBlock) -> bool {
    let w = core.control().load(b.slot.slot);
    w.state() == SlotState::Ready
        && w.generation() == b.slot.generation
        && core.index().get(&b.key).is_some_and(|r| r.slot == b.slot.slot && r.generation == b.slot.generation)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer::{BlockRead, ReadDone, TransportError, TransportPeer};
    use crate::{ArenaSpec, BackingChoice, EngineArenas, Geometry, MemcpyArenas, PolicyKind, SsdConfig, TierConfig};

    /// A transport that moves no bytes (the test only queries).
    struct NoBytes;

    impl PeerTransport for NoBytes {
        fn local_descriptor(&self) -> Result<Vec<u8>, TransportError> {
            Ok(vec![1])
        }
        fn add_peer(&self, _: &[u8]) -> Result<TransportPeer, TransportError> {
            Ok(TransportPeer(1))
        }
        fn remove_peer(&self, _: TransportPeer) {}
        fn read_tracked(
            &self,
            _: TransportPeer,
            _: &[BlockRead],
            _: Instant,
            _: ReadDone,
        ) -> Result<(), TransportError> {
            Err(TransportError::Backend("no bytes here".into()))
        }
    }

    fn call(s: &mut TcpStream, req: &PeerRequest) -> PeerReply {
        let mut buf = Vec::new();
        proto::write_msg(s, req, &mut buf).unwrap();
        match proto::read_msg::<PeerReply>(s, &mut buf, 1 << 20).unwrap() {
            Frame::Msg(m) => m,
            other => panic!("a bad reply frame {other:?}"),
        }
    }

    /// Issue 45 item 4: a query whose SSD promotion waits (here for the eviction lock, which the
    /// test holds) keeps no lock of the server: its stats, other connections and the accept
    /// loop's lease expiry go on. Seeded bug `peer-table-locked-across-query`.
    #[test]
    fn a_query_that_waits_in_the_tier_holds_no_lock_of_the_server() {
        let g = Geometry::new("peer-unit", 16, vec![ArenaSpec::packed("a", 4096, 16)]).unwrap();
        let dir = tempfile::tempdir_in(env!("CARGO_MANIFEST_DIR")).unwrap();
        let ssd = SsdConfig::new(dir.path().join("ssd"), 4096 + 8 * 8192)
            .with_admit_uses(1)
            .with_io(crate::IoPreference::Buffered);
        let cfg = TierConfig::new(g.clone(), 4 * g.slot_bytes())
            .with_policy(PolicyKind::Lru)
            .with_backing(BackingChoice::Plain)
            .with_chain_aware(false)
            .with_ssd(ssd);
        let tier = HostTier::new(cfg).unwrap();
        let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
        let rank = tier.attach(arenas.backend().unwrap()).unwrap();
        let k: Vec<crate::ContentKey> = (0..5).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
        arenas.fill(&[0, 1, 2, 3, 4], &k).unwrap();
        rank.save(&k[..4], &[0, 1, 2, 3], crate::WaitFor::Nothing).unwrap().handle.wait().unwrap();
        tier.flush_demotions();
        assert_eq!(tier.evict(1), 1);
        rank.save(&k[4..], &[4], crate::WaitFor::Nothing).unwrap().handle.wait().unwrap();
        assert!(!tier.contains(&k[0]), "k0 is on the SSD only, and the host is full");
        let server = PeerServer::bind(&tier, "127.0.0.1:0", Arc::new(NoBytes), PeerLimits::default()).unwrap();
        let (addr, ns, k0) = (server.local_addr(), tier.namespace(), k[0]);
        // The promotion of k0 must evict a host block: it waits while the test holds the lock.
        let evicting = server.shared.core.lock_eviction();
        let reader = std::thread::spawn(move || {
            let mut s = TcpStream::connect(addr).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
            let nonce = auth::nonce().unwrap();
            let hello = PeerRequest::Hello { magic: proto::PEER_MAGIC, version: proto::PEER_PROTOCOL_VERSION, nonce };
            let PeerReply::Challenge { nonce: theirs } = call(&mut s, &hello) else { panic!("no challenge") };
            let mac = auth::mac(None, Role::Reader, &nonce, &theirs, &ns, 0, &[1]);
            let welcome = call(&mut s, &PeerRequest::Auth { mac, namespace: ns, descriptor: vec![1] });
            assert!(matches!(welcome, PeerReply::Welcome { .. }), "{welcome:?}");
            call(&mut s, &PeerRequest::Query { keys: vec![k0], ttl_ms: 10_000 })
        });
        std::thread::sleep(Duration::from_millis(300)); // the query is in the tier by now
        let (tx, rx) = std::sync::mpsc::channel();
        let shared = server.shared.clone();
        let probe = std::thread::spawn(move || {
            let _ = tx.send(shared.stats().leases);
        });
        let answered = rx.recv_timeout(Duration::from_secs(2)).is_ok();
        let waiting = !reader.is_finished();
        drop(evicting);
        probe.join().unwrap();
        let reply = reader.join().unwrap();
        assert!(waiting, "the query's promotion waited for the eviction lock (the case under test)");
        assert!(answered, "the server's tables stayed locked while a query waited in the tier (an SSD promotion)");
        assert!(matches!(reply, PeerReply::Leased { ref blocks, .. } if blocks.len() == 1), "{reply:?}");
    }
}
