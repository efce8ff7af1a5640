//! The owner's peer metrics (features `peers` and `metrics`): [`super::PeerServerStats`] as the
//! `kvtier_peer_*` families, read at scrape time.

use super::server::{PeerServer, Shared};
use crate::metrics::{counter, family, gauge};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use std::sync::Arc;

impl PeerServer {
    /// Adds the server's metrics to `registry` (the `kvtier_peer_*` families of
    /// `docs/metrics.md`, read from [`PeerServer::stats`] at scrape time). Call once per server;
    /// the registry keeps what it reads alive (not the server's threads: after a shutdown the
    /// figures stop moving).
    #[cfg_attr(docsrs, doc(cfg(all(feature = "peers", feature = "metrics"))))]
    pub fn register_metrics(&self, registry: &mut prometheus_client::registry::Registry) {
        registry.register_collector(Box::new(PeerCollector(self.shared.clone())));
    }
}

/// Reads a peer server's stats at scrape time.
struct PeerCollector(Arc<Shared>);

impl std::fmt::Debug for PeerCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerCollector").finish_non_exhaustive()
    }
}

impl Collector for PeerCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = self.0.stats();
        let none: &[(&str, &str)] = &[];
        let gauges = [
            ("kvtier_peer_connections", "Peer control connections open now.", s.connections),
            ("kvtier_peer_leases", "Peer leases live now.", s.leases),
            (
                "kvtier_peer_pinned_blocks",
                "Distinct blocks that peer leases and holds pin now (counted against the pin budget).",
                s.pinned_blocks,
            ),
            ("kvtier_peer_pin_budget_blocks", "Blocks peers may pin at once over all their connections.", s.pin_budget),
            ("kvtier_peer_held_blocks", "Blocks held for a peer (P/D handoff) not fetched yet.", s.held_blocks),
        ];
        for (name, help, v) in gauges {
            family(&mut enc, name, help, None, &[(none, gauge(v))])?;
        }
        let counters = [
            (
                "kvtier_peer_connections_accepted",
                "Peer control connections accepted since the server started, refused ones included.",
                s.connections_accepted,
            ),
            (
                "kvtier_peer_leases_granted",
                "Peer queries answered with a lease on at least one block.",
                s.leases_granted,
            ),
            ("kvtier_peer_blocks_leased", "Blocks answered under peer leases.", s.blocks_leased),
            (
                "kvtier_peer_auth_failures",
                "Peer hellos refused because the reader's proof of the shared secret failed (another secret, none, a \
                 replayed proof).",
                s.refused_auth,
            ),
        ];
        for (name, help, v) in counters {
            family(&mut enc, name, help, None, &[(none, counter(v))])?;
        }
        family(
            &mut enc,
            "kvtier_peer_blocks_validated",
            "Blocks a peer read and the owner then validated, by result: valid (its slot still held the key at \
             the generation answered, under a live lease) or invalid (the reader dropped it).",
            None,
            &[
                (&[("result", "valid")][..], counter(s.blocks_validated)),
                (&[("result", "invalid")][..], counter(s.blocks_invalid)),
            ],
        )?;
        family(
            &mut enc,
            "kvtier_peer_refusals",
            "Peer connections and queries refused over a bound, by the bound (PeerLimits' field).",
            None,
            &[
                (&[("limit", "connections")][..], counter(s.refused_connections)),
                (&[("limit", "keys_per_query")][..], counter(s.refused_keys_per_query)),
                (&[("limit", "leases_per_connection")][..], counter(s.refused_leases_per_connection)),
                (&[("limit", "pinned_blocks")][..], counter(s.refused_pinned_blocks)),
            ],
        )
    }
}
