//! Peers in the binding: an in-process `Tier` that serves its pool to other kvtier instances
//! (`peer_listen=`) and reads its misses from theirs (`peers=`), through NIXL. Compiled with the
//! cargo feature `peers` (kvtier's `nixl`: nixl-sys's stub API, which needs libclang to build and
//! loads the NIXL runtime at run time); without it, a `Tier` given either option raises
//! `ConfigError` naming the feature. A tier from `kvtier.connect` gets peers from its daemon
//! (`kvtierd --peer`) and needs no feature.

use crate::tier::config_error;
use kvtier::HostTier;
use pyo3::prelude::*;
use std::time::Duration;

/// The peer options of `Tier(...)`.
pub(crate) struct PeerOptions<'a> {
    /// `host:port` of each peer to read from, asked in order.
    pub peers: Option<Vec<String>>,
    /// `host:port` to serve this pool at.
    pub listen: Option<&'a str>,
    /// Seconds one query may spend on its peers.
    pub timeout_s: f64,
    /// Blocks peers may keep pinned here at once (None: all but an eighth of the slots).
    #[cfg_attr(not(feature = "peers"), allow(dead_code))]
    pub pinned_blocks: Option<usize>,
    /// The peers' shared secret's file (`kvtier::PeerSecret::from_file`): proven to the peers
    /// read from and asked of those served. Needed to serve at an address that is not loopback.
    #[cfg_attr(not(feature = "peers"), allow(dead_code))]
    pub secret_file: Option<std::path::PathBuf>,
}

impl PeerOptions<'_> {
    fn any(&self) -> bool {
        self.listen.is_some() || self.peers.as_ref().is_some_and(|p| !p.is_empty())
    }
}

/// A tier's peer roles: the server in front of its pool and the peers it reads from.
#[cfg(feature = "peers")]
pub(crate) struct TierPeers {
    server: Option<kvtier::PeerServer>,
    readers: Option<std::sync::Arc<kvtier::PeerSet>>,
    timeout: Duration,
}

/// Without the feature there are never any (`start` refuses the options).
#[cfg(not(feature = "peers"))]
pub(crate) enum TierPeers {}

/// A `PeerError` exception (`kvtier.errors.PeerError`) for a failed peer set-up; a configuration
/// value the library refuses is a `ConfigError`, as the binding's own checks raise.
#[cfg(feature = "peers")]
fn peer_error(what: &str, e: &kvtier::PeerError) -> PyErr {
    if let kvtier::PeerError::Config(m) = e {
        return config_error(format!("{what}: {m}"));
    }
    let kind = match e {
        kvtier::PeerError::Transport(_) => "transport",
        kvtier::PeerError::Connect { .. } => "connect",
        _ => "other",
    };
    crate::errors::Raised::custom("PeerError", format!("{what}: {e}")).str("kind", kind).into()
}

/// Starts the roles `o` asks of `tier` (an in-process tier): one NIXL agent over its pool, named
/// after the process and `tier`'s namespace, shared by the server and the readers.
///
/// Raises: `ConfigError` (no feature `peers`, a timeout that is not a number of seconds in
/// (0, 3600], `peer_pinned_blocks` without `peer_listen`, a peer address empty or given twice, a
/// pin budget of 0 or over the pool); `PeerError` (the NIXL runtime missing, an address that
/// cannot be bound).
pub(crate) fn start(tier: &HostTier, o: PeerOptions<'_>) -> PyResult<Option<TierPeers>> {
    if o.secret_file.is_some() && !o.any() {
        return Err(config_error("peer_secret_file is the peers' secret: it needs peers= or peer_listen=".into()));
    }
    if o.pinned_blocks.is_some() && o.listen.is_none() {
        return Err(config_error("peer_pinned_blocks bounds what peers pin here: it needs peer_listen=".into()));
    }
    if !o.any() {
        return Ok(None);
    }
    let timeout = Duration::try_from_secs_f64(o.timeout_s)
        .ok()
        .filter(|t| !t.is_zero() && *t <= Duration::from_secs(3600))
        .ok_or_else(|| {
            config_error(format!("peer_timeout_s must be a number of seconds in (0, 3600], not {}", o.timeout_s))
        })?;
    start_roles(tier, o, timeout)
}

#[cfg(not(feature = "peers"))]
fn start_roles(_tier: &HostTier, _o: PeerOptions<'_>, _timeout: Duration) -> PyResult<Option<TierPeers>> {
    Err(config_error(
        "peers and peer_listen need a kvtier wheel built with the cargo feature `peers` \
         (maturin build --features peers); this one was built without it"
            .into(),
    ))
}

#[cfg(feature = "peers")]
fn start_roles(tier: &HostTier, o: PeerOptions<'_>, timeout: Duration) -> PyResult<Option<TierPeers>> {
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    static AGENTS: AtomicU64 = AtomicU64::new(0);
    let peers = o.peers.unwrap_or_default();
    if let Some(p) = peers.iter().find(|p| p.trim().is_empty()) {
        return Err(config_error(format!("peers: an address is empty ({p:?})")));
    }
    let secret = match &o.secret_file {
        Some(p) => Some(kvtier::PeerSecret::from_file(p).map_err(|e| config_error(format!("peer_secret_file: {e}")))?),
        None => None,
    };
    let name = format!("{}-{}", kvtier::unique_agent_name("kvtier-py"), AGENTS.fetch_add(1, Ordering::Relaxed));
    let transport: Arc<dyn kvtier::PeerTransport> = Arc::new(
        kvtier::NixlTransport::new(&name, tier.pool())
            .map_err(|e| peer_error("registering the pool with NIXL", &kvtier::PeerError::Transport(e)))?,
    );
    let server = match o.listen {
        None => None,
        Some(addr) => {
            let limits = kvtier::PeerLimits { pinned_blocks: o.pinned_blocks, ..kvtier::PeerLimits::default() };
            Some(
                kvtier::PeerServer::bind_with_secret(tier, addr, transport.clone(), limits, secret.clone())
                    .map_err(|e| peer_error(&format!("peer_listen {addr}"), &e))?,
            )
        }
    };
    let readers = if peers.is_empty() {
        None
    } else {
        let set = kvtier::PeerSet::new(tier, transport, peers)
            .map_err(|e| match e {
                kvtier::PeerError::Config(m) => config_error(format!("peers: {m}")),
                e => peer_error("peers", &e),
            })?
            .with_secret(secret);
        Some(Arc::new(set))
    };
    Ok(Some(TierPeers { server, readers, timeout }))
}

#[cfg(feature = "peers")]
impl TierPeers {
    /// The lease of `keys` with `uses`, continued from the peers when this tier reads from any,
    /// and each failed peer as (address, message). `None` without readers.
    pub(crate) fn query(
        &self,
        keys: &[kvtier::ContentKey],
        uses: u32,
    ) -> Option<(kvtier::Lease, Vec<(String, String)>)> {
        let set = self.readers.as_ref()?;
        let f = set.query_shared(keys, uses, std::time::Instant::now() + self.timeout);
        let errors =
            f.errors.iter().map(|(i, e)| (set.addrs().nth(*i).unwrap_or("?").to_string(), e.to_string())).collect();
        Some((f.lease, errors))
    }

    /// `host:port` the server listens on.
    pub(crate) fn address(&self) -> Option<String> {
        self.server.as_ref().map(|s| s.local_addr().to_string())
    }

    /// The peers read from, in order.
    pub(crate) fn readers(&self) -> Vec<String> {
        self.readers.as_ref().map_or_else(Vec::new, |s| s.addrs().map(str::to_string).collect())
    }

    /// [`kvtier::PeerServer::hold`], or `None` without a server.
    pub(crate) fn hold(&self, keys: &[kvtier::ContentKey], ttl: Duration) -> Option<usize> {
        self.server.as_ref().map(|s| s.hold(keys, ttl))
    }

    /// The server's figures as (name, value) pairs, or `None` without a server.
    pub(crate) fn server_stats(&self) -> Option<Vec<(&'static str, u64)>> {
        let s = self.server.as_ref()?.stats();
        Some(vec![
            ("connections", s.connections),
            ("connections_accepted", s.connections_accepted),
            ("live_leases", s.leases),
            ("leases_granted", s.leases_granted),
            ("blocks_leased", s.blocks_leased),
            ("blocks_validated", s.blocks_validated),
            ("blocks_invalid", s.blocks_invalid),
            ("pinned_blocks", s.pinned_blocks),
            ("pin_budget", s.pin_budget),
            ("held_blocks", s.held_blocks),
            ("refused_connections", s.refused_connections),
            ("auth_failures", s.refused_auth),
        ])
    }
}

#[cfg(not(feature = "peers"))]
impl TierPeers {
    pub(crate) fn query(
        &self,
        _keys: &[kvtier::ContentKey],
        _uses: u32,
    ) -> Option<(kvtier::Lease, Vec<(String, String)>)> {
        match *self {}
    }
    pub(crate) fn address(&self) -> Option<String> {
        match *self {}
    }
    pub(crate) fn readers(&self) -> Vec<String> {
        match *self {}
    }
    pub(crate) fn hold(&self, _keys: &[kvtier::ContentKey], _ttl: Duration) -> Option<usize> {
        match *self {}
    }
    pub(crate) fn server_stats(&self) -> Option<Vec<(&'static str, u64)>> {
        match *self {}
    }
}

/// True if this wheel was built with peers (the cargo feature `peers`) and the NIXL runtime
/// (`libnixl_capi.so` and its UCX plugin, found through `LD_LIBRARY_PATH` and
/// `NIXL_PLUGIN_DIR`) loads. Never raises.
#[pyfunction]
pub fn peers_available() -> bool {
    #[cfg(feature = "peers")]
    {
        kvtier::NixlTransport::runtime_available()
    }
    #[cfg(not(feature = "peers"))]
    {
        false
    }
}
