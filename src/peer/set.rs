//! The peers an instance knows from configuration ([`PeerSet`]): one control connection per
//! address, opened on first use and opened again after a failure, and a query that asks them for
//! what this instance misses.

use super::client::{PeerClient, PeerFetch};
use super::transport::PeerTransport;
use super::PeerError;
use crate::key::ContentKey;
use crate::tier::lease::Lease;
use crate::HostTier;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// One configured peer: its address and its control connection, if open.
struct Peer {
    addr: String,
    client: Mutex<Option<Arc<PeerClient>>>,
}

/// The peers of one in-process tier, from configuration (a list of `host:port` addresses of their
/// [`super::PeerServer`]s), all reached through one transport (this instance's registered pool).
/// Connections are opened lazily and dropped on any failure but a refusal, so an owner that
/// restarted is reached again on the next call.
pub struct PeerSet {
    tier: HostTier,
    transport: Arc<dyn PeerTransport>,
    peers: Vec<Peer>,
}

/// The outcome of [`PeerSet::query`].
#[derive(Debug)]
pub struct PeerSetFetch {
    /// A one-use lease on the longest prefix of the keys this instance now holds: its own blocks,
    /// then blocks fetched from peers, each pinned. [`Lease::source`] says `Peer` for the blocks
    /// the last peer brought; those an earlier peer of the same query brought were local by then
    /// and say `Host` ([`PeerSetFetch::fetched`] counts them all).
    pub lease: Lease,
    /// Blocks this query fetched from peers and published locally, over every peer asked.
    pub fetched: usize,
    /// The index (in configuration order) of the last peer whose fetch lengthened the prefix;
    /// `None` when every block was local or no peer had more.
    pub peer: Option<usize>,
    /// Blocks read from peers and dropped because their validation failed.
    pub stale: usize,
    /// The peers that failed, by index, with their typed error (the query went on without them;
    /// the local tier is unchanged by each).
    pub errors: Vec<(usize, PeerError)>,
}

impl std::fmt::Debug for PeerSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSet").field("peers", &self.addrs().collect::<Vec<_>>()).finish()
    }
}

impl PeerSet {
    /// The peers at `addrs` (each `host:port`, resolved when first connected), for `tier`, whose
    /// pool `transport` has registered. Nothing is connected yet.
    ///
    /// # Errors
    /// [`PeerError::NotInProcess`] for a connected tier; [`PeerError::Config`] for an empty
    /// address or one given twice.
    pub fn new<S: Into<String>>(
        tier: &HostTier,
        transport: Arc<dyn PeerTransport>,
        addrs: impl IntoIterator<Item = S>,
    ) -> Result<PeerSet, PeerError> {
        tier.in_process_core().ok_or(PeerError::NotInProcess)?;
        let mut peers: Vec<Peer> = Vec::new();
        for a in addrs {
            let addr: String = a.into();
            if addr.trim().is_empty() {
                return Err(PeerError::Config("a peer address is empty".into()));
            }
            if peers.iter().any(|p| p.addr == addr) {
                return Err(PeerError::Config(format!("peer {addr} is configured twice")));
            }
            peers.push(Peer { addr, client: Mutex::new(None) });
        }
        Ok(PeerSet { tier: tier.clone(), transport, peers })
    }

    /// The tier whose pool this set's fetches fill.
    pub(crate) fn tier(&self) -> &HostTier {
        &self.tier
    }

    /// The configured addresses, in order.
    pub fn addrs(&self) -> impl Iterator<Item = &str> {
        self.peers.iter().map(|p| p.addr.as_str())
    }

    /// Leases the longest prefix of `keys` this instance holds or can fetch: a local query first;
    /// where it falls short, each peer in configuration order is asked for the keys after the
    /// prefix held so far (so a later peer continues where an earlier one stopped), until every
    /// key is held. A peer that fails (unreachable, gone, its deadline, another protocol version,
    /// a refusal) is recorded in [`PeerSetFetch::errors`] and skipped. Every network step must
    /// finish by `deadline`. Never fails: with no peer answering it is the local query.
    pub fn query(&self, keys: &[ContentKey], deadline: Instant) -> PeerSetFetch {
        self.query_shared(keys, 1, deadline)
    }

    /// [`PeerSet::query`] with a lease of `uses` restores (one per rank that restores it, as
    /// [`HostTier::query_shared`]); `uses == 0` gives a settled lease and asks no peer.
    pub fn query_shared(&self, keys: &[ContentKey], uses: u32, deadline: Instant) -> PeerSetFetch {
        let mut best = PeerSetFetch {
            lease: self.tier.query_shared(keys, uses),
            fetched: 0,
            peer: None,
            stale: 0,
            errors: Vec::new(),
        };
        for i in 0..self.peers.len() {
            if best.lease.len() == keys.len() || uses == 0 {
                break;
            }
            match self.fetch_shared_from(i, keys, uses, deadline) {
                // The new lease pinned the old one's blocks again (they are this instance's now)
                // before the old one goes.
                Ok(f) if f.lease.len() > best.lease.len() => {
                    best.stale += f.stale;
                    best.fetched += f.lease.from_peer();
                    best.lease = f.lease;
                    best.peer = Some(i);
                }
                Ok(f) => best.stale += f.stale,
                Err(e) => best.errors.push((i, e)),
            }
            // Seeded bug (tests only): `peers-ask-only-the-first` stops after one peer.
            if crate::seeded::seeded("peers-ask-only-the-first") {
                break;
            }
        }
        best
    }

    /// [`PeerClient::fetch`] from the peer at index `peer` (the prefill/decode case: the router
    /// names the instance that holds the request's blocks), connecting first if needed.
    ///
    /// # Errors
    /// [`PeerError::Config`] for an index past the configured peers; the errors of
    /// [`PeerClient::connect`] and [`PeerClient::fetch`]. After any error but a refusal the
    /// connection is dropped, and the next call connects again.
    pub fn fetch_from(&self, peer: usize, keys: &[ContentKey], deadline: Instant) -> Result<PeerFetch, PeerError> {
        self.fetch_shared_from(peer, keys, 1, deadline)
    }

    /// [`PeerSet::fetch_from`] with a lease of `uses` restores ([`PeerClient::fetch_shared`]).
    ///
    /// # Errors
    /// Those of [`PeerSet::fetch_from`].
    pub fn fetch_shared_from(
        &self,
        peer: usize,
        keys: &[ContentKey],
        uses: u32,
        deadline: Instant,
    ) -> Result<PeerFetch, PeerError> {
        let p = self
            .peers
            .get(peer)
            .ok_or_else(|| PeerError::Config(format!("peer {peer} of {} configured", self.peers.len())))?;
        let client = self.client(p, deadline)?;
        let r = client.fetch_shared(keys, uses, deadline);
        if client.is_broken() || matches!(r, Err(ref e) if !matches!(e, PeerError::Refused(_))) {
            let mut c = super::lock(&p.client);
            if c.as_ref().is_some_and(|c| Arc::ptr_eq(c, &client)) {
                *c = None;
            }
        }
        r
    }

    /// The open connection to `p`, or a new one.
    fn client(&self, p: &Peer, deadline: Instant) -> Result<Arc<PeerClient>, PeerError> {
        if let Some(c) = super::lock(&p.client).as_ref() {
            return Ok(c.clone());
        }
        // Connected outside the lock: a slow peer does not hold up callers that find a connection.
        let c = Arc::new(PeerClient::connect(p.addr.as_str(), &self.tier, self.transport.clone(), deadline)?);
        let mut slot = super::lock(&p.client);
        Ok(slot.get_or_insert(c).clone())
    }
}
