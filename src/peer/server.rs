//! [`PeerServer`]: the owner's side of the peer protocol. One thread accepts (and expires leases
//! past their time-to-live); one thread per connection, at most [`PeerLimits::connections`].

use super::pins::{Hold, OwnerLease, PinTable};
use super::proto::{self, Frame, PeerRefusal, PeerReply, PeerRequest, WirePeerBlock, WirePeerLimits};
use super::{PeerError, PeerTransport};
use crate::slab::slot::SlotState;
use crate::sync::Arc as TierArc;
use crate::tier::core::Core;
use crate::tier::lease::LeasedBlock;
use crate::HostTier;
use std::collections::HashMap;
use std::io::Read;
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
    /// Time from accept to a complete hello (5 s).
    pub hello_timeout: Duration,
    /// Time a frame may take once its first byte arrived (30 s); between frames a connection may
    /// idle.
    pub frame_timeout: Duration,
    /// Time a reply may wait for the reader to take it (30 s).
    pub write_timeout: Duration,
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
    /// Connections refused at accept over [`PeerLimits::connections`].
    pub refused_connections: u64,
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
    stop: AtomicBool,
    /// Peer leases and holds. Queries and holds call the tier (`HostTier::query`: index, slot
    /// pins, an SSD promotion's reads) under it, so the budget check and the lease are one step;
    /// the tier never calls back into the server, so no other lock of this module is taken
    /// under it.
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
    /// Listens on `addr` (e.g. `127.0.0.1:0`) and serves `tier`'s blocks to peers, whose reads go
    /// through `transport` (its descriptor is sent in each welcome).
    ///
    /// # Errors
    /// [`PeerError::NotInProcess`] for a connected tier; [`PeerError::Config`] for a limit of 0 or
    /// a pin budget over the pool's slots; [`PeerError::Transport`] if the transport has no descriptor; [`PeerError::Connect`] if
    /// `addr` cannot be bound.
    pub fn bind(
        tier: &HostTier,
        addr: impl ToSocketAddrs,
        transport: Arc<dyn PeerTransport>,
        limits: PeerLimits,
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
        listener.set_nonblocking(true).map_err(|source| PeerError::Connect { addr: addr.to_string(), source })?;
        let shared = Arc::new(Shared {
            tier: tier.clone(),
            pin_budget,
            core,
            transport,
            limits,
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
        // Under the lease table's lock, as a query, so the pin budget holds for both.
        let mut table = super::lock(&self.shared.table);
        let fit = self.shared.pin_prefix(&table, keys);
        let prefix = self.shared.tier.query(&keys[..fit]);
        let expires = Instant::now() + ttl.min(self.shared.limits.max_hold_ttl);
        // One lease per block, so each is let go when a peer fetched it.
        let (mut held, mut replaced) = (0, Vec::new());
        for b in prefix.blocks() {
            let lease = self.shared.tier.query(std::slice::from_ref(&b.key));
            if lease.is_empty() {
                break;
            }
            held += 1;
            let expires = table.holds.get(&b.key).map_or(expires, |h| h.expires.max(expires));
            replaced.extend(table.insert_hold(b.key, Hold { _pins: lease, expires }));
        }
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

fn accept_loop(shared: &Arc<Shared>, listener: TcpListener) {
    let mut last_expiry = Instant::now();
    while !shared.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, from)) => {
                bump(&shared.counters.connections_accepted, 1);
                if shared.live_conns.load(Ordering::Acquire) >= shared.limits.connections {
                    bump(&shared.counters.refused_connections, 1);
                    tracing::warn!(%from, "peer connection refused: too many connections");
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

/// Reads the next request: the first byte may wait for ever (an idle connection), the rest of the
/// frame must arrive within the frame timeout.
fn next_request(
    shared: &Shared,
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    first_timeout: Option<Duration>,
) -> std::io::Result<Frame<PeerRequest>> {
    stream.set_read_timeout(first_timeout)?;
    let mut first = [0u8; 1];
    loop {
        match stream.read(&mut first) {
            Ok(0) => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            Ok(_) => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    stream.set_read_timeout(Some(shared.limits.frame_timeout))?;
    let mut chained = (&first[..]).chain(&mut *stream);
    proto::read_msg(&mut chained, buf, shared.limits.frame_bytes)
}

fn serve(shared: &Shared, conn: u64, mut stream: TcpStream, from: SocketAddr) {
    let _ = stream.set_write_timeout(Some(shared.limits.write_timeout));
    let _ = stream.set_nodelay(true);
    let mut buf = Vec::new();
    let mut out = Vec::new();
    let mut peer = None;
    let mut first = true;
    loop {
        let timeout = if first { Some(shared.limits.hello_timeout) } else { None };
        let req = match next_request(shared, &mut stream, &mut buf, timeout) {
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
                    tracing::debug!(%from, error = %e, "peer connection closed");
                }
                break;
            }
        };
        let (reply, close) = match (first, req) {
            (true, PeerRequest::Hello { magic, version, namespace, descriptor }) => {
                let ours = shared.tier.namespace();
                if magic != proto::PEER_MAGIC {
                    (PeerReply::Refused(PeerRefusal::Magic), true)
                } else if version != proto::PEER_PROTOCOL_VERSION {
                    (
                        PeerReply::Refused(PeerRefusal::Version {
                            ours: proto::PEER_PROTOCOL_VERSION,
                            theirs: version,
                        }),
                        true,
                    )
                } else if namespace != ours {
                    (PeerReply::Refused(PeerRefusal::Namespace { ours }), true)
                } else {
                    match (shared.transport.add_peer(&descriptor), shared.transport.local_descriptor()) {
                        (Ok(p), Ok(d)) => {
                            peer = Some(p);
                            (
                                PeerReply::Welcome {
                                    namespace: ours,
                                    block_bytes: shared.tier.geometry().slot_bytes(),
                                    descriptor: d,
                                    limits: shared.limits.wire(),
                                },
                                false,
                            )
                        }
                        (Err(e), _) | (_, Err(e)) => (PeerReply::Refused(PeerRefusal::Descriptor(e.to_string())), true),
                    }
                }
            }
            (true, _) | (false, PeerRequest::Hello { .. }) => (PeerReply::Refused(PeerRefusal::OutOfOrder), true),
            (false, req) => (answer(shared, conn, req), false),
        };
        first = false;
        if let Err(e) = proto::write_msg(&mut stream, &reply, &mut out) {
            tracing::debug!(%from, error = %e, "peer connection closed: reply not taken");
            break;
        }
        if close {
            break;
        }
    }
    if let Some(p) = peer {
        shared.transport.remove_peer(p);
    }
    // The accept thread keeps a clone of the stream (to shut it down at stop): close it here so
    // the reader sees the end now.
    let _ = stream.shutdown(Shutdown::Both);
}

fn limit(what: &str, asked: u64, max: u64) -> PeerReply {
    PeerReply::Refused(PeerRefusal::Limit { what: what.into(), asked, max })
}

fn answer(shared: &Shared, conn: u64, req: PeerRequest) -> PeerReply {
    match req {
        PeerRequest::Hello { .. } => PeerReply::Refused(PeerRefusal::OutOfOrder),
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
            // The pin budget is checked and the lease taken under the table's lock, so concurrent
            // queries cannot together pin more than it.
            let mut table = super::lock(&shared.table);
            let fit = shared.pin_prefix(&table, &keys);
            if fit == 0 && !keys.is_empty() {
                bump(&shared.counters.refused_pinned_blocks, 1);
                return limit("blocks pinned for peers", keys.len() as u64, shared.pin_budget as u64);
            }
            let lease = shared.tier.query(&keys[..fit]);
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
                return PeerReply::Leased { lease: 0, ttl_ms, blocks };
            }
            let id = shared.next_lease.fetch_add(1, Ordering::Relaxed);
            let expires =
                Instant::now().checked_add(ttl).unwrap_or_else(|| Instant::now() + Duration::from_secs(1 << 40));
            bump(&shared.counters.leases_granted, 1);
            bump(&shared.counters.blocks_leased, blocks.len() as u64);
            table.insert_lease(id, OwnerLease { conn, lease, expires });
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
