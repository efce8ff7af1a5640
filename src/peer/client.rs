//! [`PeerClient`]: the reader's control connection to one owner (hello, query, validate,
//! release) and its transport peer. The fetch itself is in `fetch`.

use super::auth::{self, PeerSecret, Role};
use super::proto::{self, Frame, PeerRefusal, PeerReply, PeerRequest, Timed, WirePeerBlock, WirePeerLimits};
use super::{namespace_hex, PeerError, PeerTransport, TransportPeer};
use crate::sync::Arc as TierArc;
use crate::tier::core::Core;
use crate::tier::lease::Lease;
use crate::HostTier;
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest reply frame a reader takes, bytes (64 MiB: a query's reply holds 40 B a block).
const MAX_REPLY: usize = 64 << 20;

/// The outcome of [`PeerClient::fetch`]: a local lease and what the peer step did.
#[derive(Debug)]
pub struct PeerFetch {
    /// A one-use lease on the longest prefix this instance now holds: its host blocks, then the
    /// blocks fetched from the peer ([`Lease::source`] says which), each pinned.
    pub lease: Lease,
    /// Blocks the owner leased and the transport read whose validation failed (their slot was
    /// reused, or the owner's lease expired): dropped, never served.
    pub stale: usize,
}

impl PeerFetch {
    /// The fetch's result, given the error of one of its runs ([`PeerClient::fetch_partial`]): a
    /// later run's error is kept only when nothing was fetched (else the lease on the fetched
    /// blocks is the result); this lease is then dropped first, its local pins gone before the
    /// error is returned.
    pub(super) fn into_result(self, err: Option<PeerError>) -> Result<PeerFetch, PeerError> {
        match err {
            None => Ok(self),
            Some(_) if self.lease.from_peer() > 0 => Ok(self),
            Some(e) => {
                drop(self);
                Err(e)
            }
        }
    }
}

/// A reader's control connection to one owner ([`super::PeerServer`]) and the owner's transport
/// peer. Requests on one client are serialized (one at a time); a failed request breaks the
/// connection (later ones fail with [`PeerError::OwnerGone`]): connect again. Dropping it closes
/// the connection, which releases the owner's leases, and forgets the transport peer.
pub struct PeerClient {
    pub(super) core: TierArc<Core>,
    pub(super) transport: Arc<dyn PeerTransport>,
    pub(super) peer: TransportPeer,
    pub(super) block_bytes: u64,
    pub(super) limits: WirePeerLimits,
    stream: Mutex<(TcpStream, Vec<u8>)>,
    broken: AtomicBool,
    pub(super) stale_blocks: AtomicU64,
    pub(super) fetched_blocks: AtomicU64,
    /// Lease time-to-live asked of the owner, ms.
    pub(super) ttl_ms: u64,
    /// When the last request on this connection ended (for [`PeerClient::is_stale`]).
    last_used: Mutex<Instant>,
}

impl std::fmt::Debug for PeerClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerClient").field("peer", &self.peer).field("block_bytes", &self.block_bytes).finish()
    }
}

fn remaining(deadline: Instant) -> Result<Duration, PeerError> {
    let left = deadline.saturating_duration_since(Instant::now());
    if left.is_zero() {
        Err(PeerError::Deadline)
    } else {
        Ok(left)
    }
}

impl PeerClient {
    /// Connects to the owner at `addr` without a secret: [`PeerClient::connect_with_secret`] with
    /// `None` (an owner without a secret, on loopback).
    ///
    /// # Errors
    /// Those of [`PeerClient::connect_with_secret`].
    pub fn connect(
        addr: impl std::fmt::Display,
        tier: &HostTier,
        transport: Arc<dyn PeerTransport>,
        deadline: Instant,
    ) -> Result<PeerClient, PeerError> {
        Self::connect_with_secret(addr, tier, transport, None, deadline)
    }

    /// Connects to the owner at `addr` (`host:port`, or an address) and says hello: both sides
    /// prove `secret` (a challenge-response over fresh nonces: `docs/design.md`, "Trust model:
    /// the peer port"), then this side checks the namespace (`tier`'s) and the block size, and
    /// loads the owner's transport descriptor into `transport`. Every step ends by `deadline`: the
    /// name's resolution (on a thread of its own, left to finish if the deadline passes), each
    /// address it resolves to in turn (each given an even share of the time left), and every read
    /// and write of the hello.
    ///
    /// # Errors
    /// [`PeerError::NotInProcess`] for a connected tier; [`PeerError::Connect`] (no address could
    /// be connected; the last error); [`PeerError::Deadline`]; [`PeerError::Auth`] (the owner
    /// refused this side's proof, or its own proof failed); [`PeerError::Version`],
    /// [`PeerError::Namespace`], [`PeerError::BlockBytes`] (refused hellos);
    /// [`PeerError::Refused`] (the owner's connection limit, a descriptor it cannot load);
    /// [`PeerError::Transport`] (one this side cannot load); [`PeerError::OwnerGone`],
    /// [`PeerError::Protocol`].
    pub fn connect_with_secret(
        addr: impl std::fmt::Display,
        tier: &HostTier,
        transport: Arc<dyn PeerTransport>,
        secret: Option<&PeerSecret>,
        deadline: Instant,
    ) -> Result<PeerClient, PeerError> {
        let core = tier.in_process_core().ok_or(PeerError::NotInProcess)?.clone();
        let addr = addr.to_string();
        let addrs = resolve(&addr, deadline)?;
        let stream = connect_any(&addr, &addrs, deadline)?;
        let _ = stream.set_nodelay(true);
        super::server::keepalive(&stream);
        let descriptor = transport.local_descriptor()?;
        let ours = tier.namespace();
        let mut client = PeerClient {
            core,
            transport,
            peer: TransportPeer(u64::MAX),
            block_bytes: 0,
            limits: WirePeerLimits {
                frame_bytes: 0,
                keys_per_query: 0,
                leases_per_connection: 0,
                max_lease_ttl_ms: 0,
                idle_timeout_ms: 0,
            },
            stream: Mutex::new((stream, Vec::new())),
            broken: AtomicBool::new(false),
            stale_blocks: AtomicU64::new(0),
            fetched_blocks: AtomicU64::new(0),
            ttl_ms: 10_000,
            last_used: Mutex::new(Instant::now()),
        };
        let reader_nonce = auth::nonce()?;
        let hello =
            PeerRequest::Hello { magic: proto::PEER_MAGIC, version: proto::PEER_PROTOCOL_VERSION, nonce: reader_nonce };
        let refused = |r: PeerRefusal| match r {
            PeerRefusal::Version { ours: theirs, .. } => {
                PeerError::Version { ours: proto::PEER_PROTOCOL_VERSION, theirs }
            }
            PeerRefusal::Namespace { ours: theirs } => {
                PeerError::Namespace { ours: namespace_hex(&ours), theirs: namespace_hex(&theirs) }
            }
            PeerRefusal::Auth => PeerError::Auth(
                "the owner refused this instance's proof of the peer secret (another secret, or none on one side)"
                    .into(),
            ),
            PeerRefusal::Connections { max } => {
                PeerError::Refused(format!("the owner serves its maximum of {max} peer connections"))
            }
            r => PeerError::Refused(format!("{r:?}")),
        };
        let owner_nonce = match client.call(&hello, deadline)? {
            PeerReply::Challenge { nonce } => nonce,
            PeerReply::Refused(r) => return Err(refused(r)),
            other => return Err(PeerError::Protocol(format!("a hello answered {other:?}"))),
        };
        let mac = auth::mac(secret, Role::Reader, &reader_nonce, &owner_nonce, &ours, 0, &descriptor);
        match client.call(&PeerRequest::Auth { mac, namespace: ours, descriptor }, deadline)? {
            PeerReply::Welcome { mac, namespace, block_bytes, descriptor, limits } => {
                if !auth::verify(
                    secret,
                    Role::Owner,
                    &reader_nonce,
                    &owner_nonce,
                    &namespace,
                    block_bytes,
                    &descriptor,
                    &mac,
                ) {
                    return Err(PeerError::Auth(
                        "the owner's proof of the peer secret failed: it does not hold this instance's secret".into(),
                    ));
                }
                if namespace != ours {
                    return Err(PeerError::Namespace { ours: namespace_hex(&ours), theirs: namespace_hex(&namespace) });
                }
                let want = tier.geometry().slot_bytes();
                if block_bytes != want {
                    return Err(PeerError::BlockBytes { ours: want, theirs: block_bytes });
                }
                client.peer = client.transport.add_peer(&descriptor)?;
                client.block_bytes = block_bytes;
                client.limits = limits;
                client.ttl_ms = client.ttl_ms.min(limits.max_lease_ttl_ms.max(1));
                Ok(client)
            }
            PeerReply::Refused(r) => Err(refused(r)),
            other => Err(PeerError::Protocol(format!("a proof answered {other:?}"))),
        }
    }

    /// Sets the lease time-to-live asked of the owner for each fetch (default 10 s, capped by the
    /// owner's limit, at least 1 ms).
    pub fn with_lease_ttl(mut self, ttl: Duration) -> Self {
        self.ttl_ms = (ttl.as_millis().min(u64::MAX as u128) as u64).max(1);
        self
    }

    /// Blocks fetched and published by this client so far.
    pub fn fetched_blocks(&self) -> u64 {
        self.fetched_blocks.load(Ordering::Relaxed)
    }

    /// Blocks read and then dropped because validation failed, so far.
    pub fn stale_blocks(&self) -> u64 {
        self.stale_blocks.load(Ordering::Relaxed)
    }

    /// True once a request on this client failed: every later call fails with
    /// [`PeerError::OwnerGone`]; connect again.
    pub fn is_broken(&self) -> bool {
        self.broken.load(Ordering::Acquire)
    }

    /// True if this idle connection should not be used again: it broke, it has idled half the
    /// owner's idle timeout or more (the owner may close it any moment), or the owner closed it
    /// already (or sent something unasked).
    pub(super) fn is_stale(&self) -> bool {
        if self.is_broken() {
            return true;
        }
        let idle_ms = super::lock(&self.last_used).elapsed().as_millis();
        if idle_ms >= u128::from(self.limits.idle_timeout_ms / 2) {
            return true;
        }
        let g = super::lock(&self.stream);
        if g.0.set_nonblocking(true).is_err() {
            return true;
        }
        let mut b = [0u8; 1];
        let open = matches!(g.0.peek(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        let restored = g.0.set_nonblocking(false).is_ok();
        !(open && restored)
    }

    /// One request and its reply, by `deadline`. Any failure once the request is being sent
    /// breaks the connection.
    fn call(&self, req: &PeerRequest, deadline: Instant) -> Result<PeerReply, PeerError> {
        if self.broken.load(Ordering::Acquire) {
            return Err(PeerError::OwnerGone);
        }
        // A deadline passed before anything was sent leaves the connection in step: not broken.
        remaining(deadline)?;
        let r = self.call_once(req, deadline);
        if r.is_err() {
            self.broken.store(true, Ordering::Release);
            if let Ok(g) = self.stream.lock() {
                let _ = g.0.shutdown(std::net::Shutdown::Both);
            }
        }
        r
    }

    fn call_once(&self, req: &PeerRequest, deadline: Instant) -> Result<PeerReply, PeerError> {
        let mut g = super::lock(&self.stream);
        let (stream, buf) = &mut *g;
        let mut scratch = Vec::new();
        // Every read and write of the request and its reply ends by the deadline, however the
        // owner trickles its bytes.
        let mut io = Timed { stream, deadline };
        proto::write_msg(&mut io, req, &mut scratch).map_err(PeerError::from_io)?;
        let reply = proto::read_msg::<PeerReply>(&mut io, buf, MAX_REPLY).map_err(PeerError::from_io)?;
        *super::lock(&self.last_used) = Instant::now();
        match reply {
            Frame::Msg(m) => Ok(m),
            Frame::Oversized(len) => Err(PeerError::Protocol(format!("a {len} B reply is larger than {MAX_REPLY} B"))),
            Frame::Undecodable(why) => Err(PeerError::Protocol(why)),
        }
    }

    /// Query: the owner's lease on the longest ready prefix of `keys`.
    pub(super) fn query(
        &self,
        keys: &[crate::ContentKey],
        deadline: Instant,
    ) -> Result<(u64, Vec<WirePeerBlock>), PeerError> {
        match self.call(&PeerRequest::Query { keys: keys.to_vec(), ttl_ms: self.ttl_ms }, deadline)? {
            PeerReply::Leased { lease, blocks, .. } => Ok((lease, blocks)),
            PeerReply::Refused(r) => Err(PeerError::Refused(format!("{r:?}"))),
            other => Err(PeerError::Protocol(format!("a query answered {other:?}"))),
        }
    }

    /// Validate: per leading block of `lease` (the first `blocks`, those read), still valid
    /// (missing entries count as not).
    pub(super) fn validate(&self, lease: u64, blocks: usize, deadline: Instant) -> Result<Vec<bool>, PeerError> {
        match self.call(&PeerRequest::Validate { lease, blocks: blocks as u64 }, deadline)? {
            PeerReply::Valid(v) => Ok(v),
            PeerReply::Refused(r) => Err(PeerError::Refused(format!("{r:?}"))),
            other => Err(PeerError::Protocol(format!("a validate answered {other:?}"))),
        }
    }

    /// Release: settles the owner's lease.
    pub(super) fn release(&self, lease: u64, deadline: Instant) -> Result<bool, PeerError> {
        match self.call(&PeerRequest::Release { lease }, deadline)? {
            PeerReply::Released(b) => Ok(b),
            PeerReply::Refused(r) => Err(PeerError::Refused(format!("{r:?}"))),
            other => Err(PeerError::Protocol(format!("a release answered {other:?}"))),
        }
    }
}

impl Drop for PeerClient {
    fn drop(&mut self) {
        if self.peer != TransportPeer(u64::MAX) {
            self.transport.remove_peer(self.peer);
        }
    }
}

/// The addresses `addr` names: itself when it is one (no lookup), else a lookup on a thread of its
/// own, waited for until `deadline` (a resolver that hangs is left to finish on that thread).
///
/// # Errors
/// [`PeerError::Deadline`]; [`PeerError::Connect`] if the name does not resolve or resolves to
/// nothing.
pub(crate) fn resolve(addr: &str, deadline: Instant) -> Result<Vec<SocketAddr>, PeerError> {
    if let Ok(a) = addr.parse::<SocketAddr>() {
        return Ok(vec![a]);
    }
    let left = remaining(deadline)?;
    let (tx, rx) = std::sync::mpsc::channel();
    let name = addr.to_string();
    std::thread::Builder::new()
        .name("kvtier-peer-resolve".into())
        .spawn(move || {
            let _ = tx.send(name.to_socket_addrs().map(|a| a.collect::<Vec<_>>()));
        })
        .map_err(|source| PeerError::Connect { addr: addr.into(), source })?;
    match rx.recv_timeout(left) {
        Ok(Ok(addrs)) if !addrs.is_empty() => Ok(addrs),
        Ok(Ok(_)) => Err(PeerError::Connect {
            addr: addr.into(),
            source: std::io::Error::new(std::io::ErrorKind::NotFound, "the name resolves to no address"),
        }),
        Ok(Err(source)) => Err(PeerError::Connect { addr: addr.into(), source }),
        Err(_) => Err(PeerError::Deadline),
    }
}

/// Connects to the first of `addrs` that accepts, in order, each given an even share of the time
/// left to `deadline` (so an address that drops packets leaves time for the next).
///
/// # Errors
/// [`PeerError::Deadline`] once it passed; else [`PeerError::Connect`] with the last address's
/// error.
pub(crate) fn connect_any(name: &str, addrs: &[SocketAddr], deadline: Instant) -> Result<TcpStream, PeerError> {
    // Seeded bug (tests only): `peer-connects-first-address-only` tries only the first.
    let addrs =
        if crate::seeded::seeded("peer-connects-first-address-only") { &addrs[..addrs.len().min(1)] } else { addrs };
    let mut last = None;
    for (i, a) in addrs.iter().enumerate() {
        let left = remaining(deadline)?;
        let share = left / (addrs.len() - i) as u32;
        match TcpStream::connect_timeout(a, share.max(Duration::from_millis(1))) {
            Ok(s) => return Ok(s),
            Err(source) => last = Some(PeerError::Connect { addr: format!("{name} ({a})"), source }),
        }
    }
    Err(last.unwrap_or_else(|| PeerError::Connect {
        addr: name.into(),
        source: std::io::Error::new(std::io::ErrorKind::NotFound, "no address to connect to"),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_connect_tries_every_address_in_turn() {
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
        let live = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let s = connect_any("two", &[dead, live.local_addr().unwrap()], deadline)
            .expect("the second address accepts: a connect tries every address, not only the first");
        assert_eq!(s.peer_addr().unwrap(), live.local_addr().unwrap());
        assert!(matches!(connect_any("one", &[dead], deadline), Err(PeerError::Connect { .. })));
        let past = Instant::now() - Duration::from_millis(1);
        assert!(matches!(connect_any("late", &[dead], past), Err(PeerError::Deadline)));
        assert!(
            matches!(resolve("localhost:1", past), Err(PeerError::Deadline)),
            "a lookup waits for no deadline past"
        );
        assert_eq!(resolve("127.0.0.1:7", past).unwrap().len(), 1, "an address needs no lookup");
    }
}
