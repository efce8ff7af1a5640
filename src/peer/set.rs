//! The peers an instance knows from configuration ([`PeerSet`]): a few control connections per
//! address, opened on first use and taken by one fetch at a time, a pause after a peer fails, and
//! a query that asks them for what this instance misses.

use super::auth::PeerSecret;
use super::client::{PeerClient, PeerFetch};
use super::transport::PeerTransport;
use super::PeerError;
use crate::key::ContentKey;
use crate::tier::lease::Lease;
use crate::HostTier;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Idle control connections kept per peer (more concurrent fetches open more, closed after).
const IDLE_PER_PEER: usize = 4;
/// Fetches from one peer in flight at once, each on its own connection; a query past it skips
/// the peer ([`PeerError::Busy`]).
const IN_FLIGHT_PER_PEER: usize = 16;
/// The first pause after a peer fails; each further failure doubles it, up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(200);
/// The longest pause after failures.
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// One configured peer: its address, its idle connections, its fetches in flight and its pause
/// after failures.
struct Peer {
    addr: String,
    idle: Mutex<Vec<PeerClient>>,
    in_flight: Mutex<usize>,
    health: Mutex<Health>,
}

/// A peer's failures: asked again only after `until`.
#[derive(Default)]
struct Health {
    until: Option<Instant>,
    pause: Duration,
}

/// The peers of one in-process tier, from configuration (a list of `host:port` addresses of their
/// [`super::PeerServer`]s), all reached through one transport (this instance's registered pool).
/// Each fetch takes a control connection of its own (an idle one, or a new one), so concurrent
/// queries never share a connection and one query's failure breaks only its own; up to 16
/// fetches per peer are in flight at once (a query past that skips the peer,
/// [`PeerError::Busy`]) and up to 4 idle connections per peer are kept, only after a fetch that
/// succeeded or was refused. A peer that fails (anything but a refusal or the caller's deadline)
/// is not asked again for a pause, 200 ms doubling up to 5 s and reset by a success: meanwhile a
/// query records [`PeerError::Paused`] for it without touching the network, and its idle
/// connections are closed.
pub struct PeerSet {
    tier: HostTier,
    transport: Arc<dyn PeerTransport>,
    peers: Vec<Peer>,
    /// The secret proven to every peer (`None`: none, for owners without one on loopback).
    secret: Option<PeerSecret>,
}

/// The outcome of [`PeerSet::query`].
#[derive(Debug)]
pub struct PeerSetFetch {
    /// A lease on the longest prefix of the keys this instance now holds: its own blocks, then
    /// blocks fetched from peers, each pinned. [`Lease::source`] says per block where it came
    /// from (host, SSD tier, or a peer: an earlier peer's blocks too).
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
            peers.push(Peer {
                addr,
                idle: Mutex::new(Vec::new()),
                in_flight: Mutex::new(0),
                health: Mutex::new(Health::default()),
            });
        }
        Ok(PeerSet { tier: tier.clone(), transport, peers, secret: None })
    }

    /// Proves `secret` to every peer (their `PeerServer`s' shared secret, `kvtierd
    /// --peer-secret-file`); `None` (the default) for owners without one.
    pub fn with_secret(mut self, secret: Option<PeerSecret>) -> Self {
        self.secret = secret;
        self
    }

    /// The tier whose pool this set's fetches fill.
    pub(crate) fn tier(&self) -> &HostTier {
        &self.tier
    }

    /// The configured addresses, in order.
    pub fn addrs(&self) -> impl Iterator<Item = &str> {
        self.peers.iter().map(|p| p.addr.as_str())
    }

    /// Leases the longest prefix of `keys` this instance holds or can fetch: its own blocks
    /// (host pool, SSD tier) first; where they fall short, each peer in configuration order is
    /// asked for the keys after the prefix held so far (so a later peer continues where an
    /// earlier one stopped), until every key is held. A peer that fails (unreachable, gone, its
    /// deadline, another protocol version, a refusal, paused after a recent failure) is recorded
    /// in [`PeerSetFetch::errors`] and skipped. Every network step must finish by `deadline`.
    /// Never fails: with no peer answering it is the local query.
    pub fn query(&self, keys: &[ContentKey], deadline: Instant) -> PeerSetFetch {
        self.query_shared(keys, 1, deadline)
    }

    /// [`PeerSet::query`] with a lease of `uses` restores (one per rank that restores it, as
    /// [`HostTier::query_shared`]); `uses == 0` gives a settled lease and asks no peer.
    pub fn query_shared(&self, keys: &[ContentKey], uses: u32, deadline: Instant) -> PeerSetFetch {
        self.query_bounded(keys, uses, deadline, usize::MAX)
    }

    /// [`PeerSet::query_shared`] fetching at most `max_fetch` blocks from peers in all (the tier
    /// daemon bounds it by the asking process's slot budget: fetched blocks take slots being
    /// written until they are published). Counted as one query of the tier; a fully local hit
    /// asks no peer.
    pub fn query_bounded(&self, keys: &[ContentKey], uses: u32, deadline: Instant, max_fetch: usize) -> PeerSetFetch {
        // The local query (host pool, SSD tier) counts as the query; a peer's fetch continues it.
        let mut best = PeerSetFetch {
            lease: self.tier.query_shared(keys, uses),
            fetched: 0,
            peer: None,
            stale: 0,
            errors: Vec::new(),
        };
        for i in 0..self.peers.len() {
            let done = best.lease.len() == keys.len() || best.fetched >= max_fetch;
            // Past the deadline no peer is asked (a peer is not blamed for the caller's time).
            if uses == 0 || done || Instant::now() >= deadline {
                break;
            }
            match self.fetch_inner(i, keys, uses, deadline, max_fetch - best.fetched, false) {
                Ok((f, err)) => {
                    if let Some(e) = err {
                        best.errors.push((i, e));
                    }
                    let PeerFetch { mut lease, stale } = f;
                    best.stale += stale;
                    // The new lease pinned the old one's blocks again (they are this instance's
                    // now) before the old one goes; it keeps where they came from.
                    if lease.len() > best.lease.len() {
                        let brought = lease.from_peer();
                        lease.inherit_sources(&best.lease);
                        best.fetched += brought;
                        best.lease = lease;
                        best.peer = Some(i);
                    }
                }
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
    /// names the instance that holds the request's blocks), on a connection of its own.
    ///
    /// # Errors
    /// [`PeerError::Config`] for an index past the configured peers; [`PeerError::Paused`] if
    /// the peer failed recently; the errors of [`PeerClient::connect`] and
    /// [`PeerClient::fetch`].
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
        let (f, err) = self.fetch_inner(peer, keys, uses, deadline, usize::MAX, true)?;
        f.into_result(err)
    }

    /// A fetch from peer `i` on a connection taken for it: `Err` when no connection could be
    /// had (paused, a failed connect), else the lease and the fetch's error beside it
    /// ([`PeerClient::fetch_partial`]). The connection goes back to the idle ones unless it
    /// broke; the peer's pause is set by a failure (not a refusal) and cleared by a success.
    fn fetch_inner(
        &self,
        i: usize,
        keys: &[ContentKey],
        uses: u32,
        deadline: Instant,
        max_fetch: usize,
        record: bool,
    ) -> Result<(PeerFetch, Option<PeerError>), PeerError> {
        let p = self
            .peers
            .get(i)
            .ok_or_else(|| PeerError::Config(format!("peer {i} of {} configured", self.peers.len())))?;
        if let Some(until) = super::lock(&p.health).until {
            let now = Instant::now();
            if until > now {
                return Err(PeerError::Paused { addr: p.addr.clone(), for_ms: (until - now).as_millis() as u64 });
            }
        }
        {
            let mut n = super::lock(&p.in_flight);
            if *n >= IN_FLIGHT_PER_PEER {
                return Err(PeerError::Busy { addr: p.addr.clone(), in_flight: *n });
            }
            *n += 1;
        }
        // Counted down however the fetch ends.
        struct InFlight<'a>(&'a Mutex<usize>);
        impl Drop for InFlight<'_> {
            fn drop(&mut self) {
                let mut n = super::lock(self.0);
                *n = n.saturating_sub(1);
            }
        }
        let _in_flight = InFlight(&p.in_flight);
        // An idle connection the owner may have closed (idle past half its bound, or closed
        // already) is dropped, not used: its failure would pause a healthy peer.
        let taken = loop {
            let c = super::lock(&p.idle).pop();
            match c {
                Some(c) if c.is_stale() && !crate::seeded::seeded("peer-reuses-stale-connection") => drop(c),
                other => break other,
            }
        };
        let client = match taken {
            Some(c) => c,
            None => match PeerClient::connect_with_secret(
                p.addr.as_str(),
                &self.tier,
                self.transport.clone(),
                self.secret.as_ref(),
                deadline,
            ) {
                Ok(c) => c,
                Err(e) => {
                    self.failed(p, &e);
                    return Err(e);
                }
            },
        };
        let (f, err) = client.fetch_partial(keys, uses, deadline, max_fetch, record);
        let keep = match &err {
            Some(e) => {
                self.failed(p, e);
                matches!(e, PeerError::Refused(_))
            }
            None => {
                *super::lock(&p.health) = Health::default();
                true
            }
        };
        if keep && !client.is_broken() {
            let mut idle = super::lock(&p.idle);
            if idle.len() < IDLE_PER_PEER {
                idle.push(client);
            }
        }
        Ok((f, err))
    }

    /// Pauses peer `p` after `e` and closes its idle connections (not after a refusal, where the
    /// peer answered, nor after the caller's deadline).
    fn failed(&self, p: &Peer, e: &PeerError) {
        if matches!(e, PeerError::Refused(_) | PeerError::Deadline) {
            return;
        }
        let idle: Vec<PeerClient> = std::mem::take(&mut *super::lock(&p.idle));
        let mut h = super::lock(&p.health);
        h.pause = if h.pause.is_zero() { FIRST_PAUSE } else { (h.pause * 2).min(MAX_PAUSE) };
        h.until = Some(Instant::now() + h.pause);
        drop(h);
        drop(idle); // outside the locks: closing a connection forgets its transport peer
    }
}
