//! [`PeerClient`]: the reader's control connection to one owner (hello, query, validate,
//! release) and its transport peer. The fetch itself is in `fetch`.

use super::proto::{self, Frame, PeerRefusal, PeerReply, PeerRequest, WirePeerBlock, WirePeerLimits};
use super::{namespace_hex, PeerError, PeerTransport, TransportPeer};
use crate::sync::Arc as TierArc;
use crate::tier::core::Core;
use crate::tier::lease::Lease;
use crate::HostTier;
use std::net::{TcpStream, ToSocketAddrs};
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
    /// Connects to the owner at `addr` and says hello: checks the protocol version, the namespace
    /// (`tier`'s) and the block size, and loads the owner's transport descriptor into `transport`.
    /// Every step must finish by `deadline`.
    ///
    /// # Errors
    /// [`PeerError::NotInProcess`] for a connected tier; [`PeerError::Connect`];
    /// [`PeerError::Deadline`]; [`PeerError::Version`], [`PeerError::Namespace`],
    /// [`PeerError::BlockBytes`] (refused hellos); [`PeerError::Refused`] (a descriptor the owner
    /// cannot load); [`PeerError::Transport`] (one this side cannot load);
    /// [`PeerError::OwnerGone`], [`PeerError::Protocol`].
    pub fn connect(
        addr: impl ToSocketAddrs,
        tier: &HostTier,
        transport: Arc<dyn PeerTransport>,
        deadline: Instant,
    ) -> Result<PeerClient, PeerError> {
        let core = tier.in_process_core().ok_or(PeerError::NotInProcess)?.clone();
        let addrs: Vec<_> = addr
            .to_socket_addrs()
            .map_err(|source| PeerError::Connect { addr: "(unresolved)".into(), source })?
            .collect();
        let first = *addrs.first().ok_or_else(|| PeerError::Config("the peer address resolves to nothing".into()))?;
        let stream = TcpStream::connect_timeout(&first, remaining(deadline)?)
            .map_err(|source| PeerError::Connect { addr: first.to_string(), source })?;
        let _ = stream.set_nodelay(true);
        let descriptor = transport.local_descriptor()?;
        let ours = tier.namespace();
        let mut client = PeerClient {
            core,
            transport,
            peer: TransportPeer(u64::MAX),
            block_bytes: 0,
            limits: WirePeerLimits { frame_bytes: 0, keys_per_query: 0, leases_per_connection: 0, max_lease_ttl_ms: 0 },
            stream: Mutex::new((stream, Vec::new())),
            broken: AtomicBool::new(false),
            stale_blocks: AtomicU64::new(0),
            fetched_blocks: AtomicU64::new(0),
            ttl_ms: 10_000,
        };
        let hello = PeerRequest::Hello {
            magic: proto::PEER_MAGIC,
            version: proto::PEER_PROTOCOL_VERSION,
            namespace: ours,
            descriptor,
        };
        match client.call(&hello, deadline)? {
            PeerReply::Welcome { namespace, block_bytes, descriptor, limits } => {
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
            PeerReply::Refused(PeerRefusal::Version { ours: theirs, .. }) => {
                Err(PeerError::Version { ours: proto::PEER_PROTOCOL_VERSION, theirs })
            }
            PeerReply::Refused(PeerRefusal::Namespace { ours: theirs }) => {
                Err(PeerError::Namespace { ours: namespace_hex(&ours), theirs: namespace_hex(&theirs) })
            }
            PeerReply::Refused(r) => Err(PeerError::Refused(format!("{r:?}"))),
            other => Err(PeerError::Protocol(format!("a hello answered {other:?}"))),
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
        stream.set_write_timeout(Some(remaining(deadline)?)).map_err(PeerError::from_io)?;
        proto::write_msg(&mut &*stream, req, &mut scratch).map_err(PeerError::from_io)?;
        stream.set_read_timeout(Some(remaining(deadline)?)).map_err(PeerError::from_io)?;
        match proto::read_msg::<PeerReply>(&mut &*stream, buf, MAX_REPLY).map_err(PeerError::from_io)? {
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
