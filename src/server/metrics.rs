//! The daemon's metrics (features `remote` and `metrics`): its tier's (`crate::metrics`) and its
//! own, connections, sessions and refusals over a bound, read from [`Shared`] at scrape time.

use super::shared::Shared;
use super::Server;
use crate::metrics::{counter, family, gauge, limit_label};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::DescriptorEncoder;
use prometheus_client::registry::Registry;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// Reads the daemon's counts at scrape time.
struct DaemonCollector(Arc<Shared>);

impl std::fmt::Debug for DaemonCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DaemonCollector").finish_non_exhaustive()
    }
}

impl Collector for DaemonCollector {
    fn encode(&self, mut enc: DescriptorEncoder<'_>) -> std::fmt::Result {
        let s = &self.0;
        let none: &[(&str, &str)] = &[];
        family(
            &mut enc,
            "kvtierd_connections",
            "Connections open now, from accept until their thread ends (refused ones for the moment \
             they are answered).",
            None,
            &[(none, gauge(s.live.load(Ordering::Relaxed) as u64))],
        )?;
        family(
            &mut enc,
            "kvtierd_connections_accepted",
            "Connections accepted since the daemon started, refused ones included.",
            None,
            &[(none, counter(s.accepted.load(Ordering::Relaxed)))],
        )?;
        family(
            &mut enc,
            "kvtierd_sessions",
            "Sessions open now: connections whose hello was accepted, until they end.",
            None,
            &[(none, gauge(s.sessions.load(Ordering::Relaxed) as u64))],
        )?;
        family(
            &mut enc,
            "kvtierd_sessions_begun",
            "Sessions begun since the daemon started.",
            None,
            &[(none, counter(s.sessions_begun.load(Ordering::Relaxed)))],
        )?;
        let refusals: Vec<(String, u64)> = {
            let r = s.refusals.lock().unwrap_or_else(|p| p.into_inner());
            r.iter().map(|&(l, n)| (limit_label(l), n)).collect()
        };
        let labels: Vec<[(&str, &str); 1]> = refusals.iter().map(|(l, _)| [("limit", l.as_str())]).collect();
        let samples: Vec<(&[(&str, &str)], _)> =
            labels.iter().zip(&refusals).map(|(l, (_, n))| (&l[..], counter(*n))).collect();
        let help = "Requests and connections refused over a bound (answered LimitExceeded, nothing done), by \
                    the bound (the Limit named in the answer, in snake case); a bound never reached has no \
                    sample.";
        if samples.is_empty() {
            // The family is described even before its first sample, so a scrape always lists it.
            enc.encode_descriptor("kvtierd_refusals", help, None, prometheus_client::metrics::MetricType::Counter)?;
            return Ok(());
        }
        family(&mut enc, "kvtierd_refusals", help, None, &samples)
    }
}

impl Server {
    /// Adds the daemon's metrics to `registry` (see `docs/metrics.md`): its tier's (as
    /// [`HostTier::register_metrics`](crate::HostTier::register_metrics)) and its own,
    /// `kvtierd_connections`, `kvtierd_connections_accepted_total`, `kvtierd_sessions`,
    /// `kvtierd_sessions_begun_total` and `kvtierd_refusals_total{limit}`, all read at scrape time.
    /// Call once per server; the registry keeps what it reads alive.
    #[cfg_attr(docsrs, doc(cfg(all(feature = "remote", feature = "metrics"))))]
    pub fn register_metrics(&self, registry: &mut Registry) {
        self.shared.tier.register_metrics(registry);
        registry.register_collector(Box::new(DaemonCollector(self.shared.clone())));
    }
}
