//! `kvtierd --metrics` scraped by a real Prometheus server (Debian's `prometheus` package): a
//! daemon on loopback, two client processes driving traffic through it, then Prometheus's HTTP API
//! (`/api/v1/query`, `/api/v1/metadata`) checked against the tier's own counters.
//!
//! Skipped, with a message, when `prometheus` is not on `PATH`; with `KVTIER_REQUIRE_PROMETHEUS=1`
//! (CI sets it) its absence fails the test instead. Every wait is bounded (`support::DEADLINE`).

mod support;

use kvtier::{ContentKey, EngineArenas, HostTier, MemcpyArenas, TierStats, WaitFor};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use support::{wait_exit, Client, Daemon, DEADLINE, ROLE_MARK, SLOT_BYTES};

/// The `prometheus` executable on `PATH`, if any.
fn prometheus_bin() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("prometheus")).find(|p| p.is_file())
}

/// A port free on loopback now (bound, then released for the server to take).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A Prometheus server, killed on drop; its log is kept for failure messages.
struct Prometheus {
    child: Child,
    url: String,
    log: PathBuf,
}

impl Prometheus {
    /// Starts `bin` scraping `target` (`HOST:PORT`) every second, its config and storage in `dir`,
    /// and waits until it answers `/-/ready`.
    fn start(bin: &Path, dir: &Path, target: &str) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: kvtierd\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .unwrap();
        let port = free_port();
        let log = dir.join("prometheus.log");
        let child = Command::new(bin)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.join("data").display()))
            .arg(format!("--web.listen-address=127.0.0.1:{port}"))
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawning prometheus");
        let p = Prometheus { child, url: format!("http://127.0.0.1:{port}"), log };
        p.until("Prometheus answers /-/ready", || ureq::get(&format!("{}/-/ready", p.url)).call().is_ok());
        p
    }

    /// Its log so far (for a failure message).
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Polls `cond` every 100 ms until it holds; panics past [`DEADLINE`] with `what` and the log.
    fn until(&self, what: &str, mut cond: impl FnMut() -> bool) {
        let t0 = Instant::now();
        while !cond() {
            assert!(t0.elapsed() < DEADLINE, "{what}: not within {DEADLINE:?}; Prometheus's log:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `GET /api/v1/PATH` with `query`: the answer's `data`, after checking `status` is success.
    fn api(&self, path: &str, query: &[(&str, &str)]) -> Value {
        let mut req = ureq::get(&format!("{}/api/v1/{path}", self.url));
        for (k, v) in query {
            req = req.query(k, v);
        }
        let body = req.call().unwrap_or_else(|e| panic!("GET /api/v1/{path} {query:?}: {e}")).into_string().unwrap();
        let v: Value = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {body}"));
        assert_eq!(v["status"], "success", "{path} {query:?}: {body}");
        v["data"].clone()
    }

    /// The instant vector of PromQL `q` now: each series' labels and value.
    fn query(&self, q: &str) -> Vec<(serde_json::Map<String, Value>, f64)> {
        let data = self.api("query", &[("query", q)]);
        assert_eq!(data["resultType"], "vector", "{q}: {data}");
        data["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                let v = r["value"][1].as_str().unwrap_or_else(|| panic!("{q}: {r}"));
                (r["metric"].as_object().unwrap().clone(), v.parse::<f64>().unwrap())
            })
            .collect()
    }

    /// The one value of PromQL `q` now (panics unless exactly one series answers).
    fn value(&self, q: &str) -> f64 {
        let r = self.query(q);
        assert_eq!(r.len(), 1, "{q}: one series expected, got {r:?}");
        r[0].1
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn keys(tier: &HostTier, range: std::ops::Range<u64>) -> Vec<ContentKey> {
    range.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

fn env_u64(name: &str) -> u64 {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} unset")).parse().unwrap()
}

/// Not a test of its own: the body of the client processes [`Client::start`] runs (it returns at
/// once when run as a test). Role `traffic`: saves keys FROM..TO in batches of 4, queries them
/// with 2 keys beyond (FROM..TO+2: the last two miss), restores the hits, verifies every byte and
/// reports `DONE`.
#[test]
fn client_role() {
    let Ok(role) = std::env::var("KVTIER_CLIENT_ROLE") else { return };
    assert_eq!(role, "traffic");
    let tier = HostTier::connect(Path::new(&std::env::var("KVTIER_SOCKET").unwrap())).unwrap();
    let g = tier.geometry().with_pages(64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let (from, to) = (env_u64("FROM"), env_u64("TO"));
    let k = keys(&tier, from..to);
    let pages: Vec<u64> = (0..k.len() as u64).collect();
    arenas.fill(&pages, &k).unwrap();
    for (ks, ps) in k.chunks(4).zip(pages.chunks(4)) {
        rank.save(ks, ps, WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
    }
    let lease = tier.query(&keys(&tier, from..to + 2));
    assert_eq!(lease.len(), k.len(), "every saved key is leased, the two beyond miss");
    let dst: Vec<u64> = (32..32 + k.len() as u64).collect();
    rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    arenas.verify(&dst, &k).unwrap();
    rank.shutdown(DEADLINE).unwrap();
    println!("{ROLE_MARK}DONE");
}

/// The metrics address the daemon printed (`..., metrics at http://ADDR/metrics`).
fn metrics_addr(d: &Daemon) -> String {
    let at = d.line.split("metrics at http://").nth(1).unwrap_or_else(|| panic!("no metrics address in {:?}", d.line));
    at.strip_suffix("/metrics").expect("the address ends with /metrics").to_string()
}

/// docs/grafana-dashboard.json.
const DASHBOARD: &str = include_str!("../../docs/grafana-dashboard.json");

/// The metric names (`kvtier_*`, `kvtierd_*`) a PromQL expression names.
fn metric_names(q: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = q;
    while let Some(at) = rest.find("kvtier") {
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        out.push(&tail[..end]);
        rest = &tail[end..];
    }
    out
}

/// The family a series name belongs to: the name less `_total` (counters) or `_bucket`, `_sum`,
/// `_count` (histograms), where `metadata` knows that family.
fn family_of<'a>(name: &'a str, metadata: &serde_json::Map<String, Value>) -> &'a str {
    for suffix in ["_total", "_bucket", "_sum", "_count"] {
        if let Some(f) = name.strip_suffix(suffix) {
            if metadata.contains_key(f) {
                return f;
            }
        }
    }
    name
}

#[test]
fn prometheus_scrapes_the_daemon_and_agrees_with_the_tiers_stats() {
    let Some(bin) = prometheus_bin() else {
        let required = std::env::var("KVTIER_REQUIRE_PROMETHEUS").is_ok_and(|v| v == "1");
        assert!(!required, "KVTIER_REQUIRE_PROMETHEUS=1 but `prometheus` is not on PATH (apt-get install prometheus)");
        eprintln!("SKIPPED prometheus_scrapes_the_daemon_and_agrees_with_the_tiers_stats: `prometheus` is not on PATH");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let d = Daemon::start_args(64, "lru", None, &["--metrics", "127.0.0.1:0"]);
    let target = metrics_addr(&d);
    let prom = Prometheus::start(&bin, dir.path(), &target);
    prom.until("Prometheus scraped the daemon once", || {
        prom.query("up{job=\"kvtierd\"}").first().is_some_and(|(_, v)| *v == 1.0)
    });

    // Two engine processes: 12 and 8 blocks saved (3 + 2 save copies), all restored (one copy each).
    let env = |from: u64, to: u64| [("FROM", from.to_string()), ("TO", to.to_string())];
    let mut a = Client::start(&d.socket, "traffic", &env(0, 12));
    let mut b = Client::start(&d.socket, "traffic", &env(100, 108));
    for c in [&mut a, &mut b] {
        c.expect("DONE");
    }
    a.finish();
    b.finish();
    let s: TierStats = HostTier::connect(&d.socket).unwrap().stats();
    assert_eq!((s.saved_blocks, s.hit_blocks, s.miss_blocks, s.restored_blocks), (20, 20, 4, 20), "{s:?}");
    let traffic_done = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs_f64();

    // A scrape taken after the traffic: its samples hold the final counts.
    prom.until("Prometheus scraped the daemon after the traffic", || {
        prom.query("timestamp(kvtier_tier_up{job=\"kvtierd\"})").first().is_some_and(|(_, t)| *t > traffic_done + 0.001)
    });
    let v = |q: &str| prom.value(q);
    let t = "tier=\"host\"";
    assert_eq!(v(&format!("kvtier_hit_blocks_total{{{t}}}")), s.hit_blocks as f64, "hit blocks");
    assert_eq!(v(&format!("kvtier_miss_blocks_total{{{t}}}")), s.miss_blocks as f64, "miss blocks");
    assert_eq!(v(&format!("kvtier_hit_bytes_total{{{t}}}")), (s.hit_blocks * SLOT_BYTES) as f64, "hit bytes");
    assert_eq!(v(&format!("kvtier_queries_total{{{t}}}")), s.queries as f64, "queries");
    assert_eq!(v(&format!("kvtier_save_blocks_total{{{t},outcome=\"saved\"}}")), s.saved_blocks as f64, "saves");
    assert_eq!(v(&format!("kvtier_restore_blocks_total{{{t},outcome=\"restored\"}}")), s.restored_blocks as f64);
    assert_eq!(v(&format!("kvtier_copy_bytes_total{{{t},direction=\"save\"}}")), s.bytes_saved as f64, "bytes saved");
    assert_eq!(v(&format!("kvtier_copy_bytes_total{{{t},direction=\"restore\"}}")), s.bytes_restored as f64);
    assert_eq!(s.bytes_saved, 20 * SLOT_BYTES);
    assert_eq!(v(&format!("kvtier_slots{{{t},state=\"ready\"}}")), s.ready_slots as f64);
    // The copy latency histogram: 5 save copies and 2 restore copies, as the clients made them.
    let lat = |dir: &str| v(&format!("kvtier_copy_latency_seconds_count{{{t},direction=\"{dir}\"}}"));
    assert_eq!((lat("save"), lat("restore")), (5.0, 2.0), "copies in the latency histogram");
    let p99 = v("histogram_quantile(0.99, sum by (le) (kvtier_copy_latency_seconds_bucket{direction=\"save\"}))");
    assert!(p99 > 0.0 && p99 <= 10.0, "a save copy's p99 within the buckets: {p99}");
    // The daemon's own: the two engines' sessions and this test's (for the stats).
    assert!(v("kvtierd_sessions_begun_total") >= 3.0);

    // Every kvtier series Prometheus holds belongs to a family with help text and a type.
    let names = prom.api("label/__name__/values", &[]);
    let names: Vec<&str> = names.as_array().unwrap().iter().filter_map(Value::as_str).collect();
    let ours: Vec<&str> = names.iter().copied().filter(|n| n.starts_with("kvtier")).collect();
    for want in ["kvtier_hit_blocks_total", "kvtier_copy_latency_seconds_bucket", "kvtierd_sessions_begun_total"] {
        assert!(ours.contains(&want), "{want} not among {ours:?}");
    }
    let metadata = prom.api("metadata", &[]);
    let metadata = metadata.as_object().unwrap();
    for name in &ours {
        let family = family_of(name, metadata);
        let m = metadata.get(family).unwrap_or_else(|| panic!("no metadata for {name} ({family}): {metadata:?}"));
        let m = &m[0];
        let (ty, help) = (m["type"].as_str().unwrap(), m["help"].as_str().unwrap());
        assert!(!help.trim().is_empty(), "{family} has no help text: {m}");
        assert!(["counter", "gauge", "histogram"].contains(&ty), "{family} has type {ty:?}");
        if name.ends_with("_total") {
            assert_eq!(ty, "counter", "{name}");
        }
    }
    assert_eq!(metadata["kvtier_copy_latency_seconds"][0]["type"], "histogram");
    assert_eq!(metadata["kvtier_copy_latency_seconds"][0]["unit"], "seconds");

    // The Grafana dashboard (docs/grafana-dashboard.json): every query is valid PromQL that
    // Prometheus answers, over metrics it holds (by family: a counter's `_total` is its family's).
    let dashboard: Value = serde_json::from_str(DASHBOARD).expect("docs/grafana-dashboard.json is JSON");
    let exprs: Vec<String> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|p| p["targets"].as_array().unwrap().iter().map(|t| t["expr"].as_str().unwrap().to_string()))
        .collect();
    assert!(exprs.len() >= 10, "{exprs:?}");
    for e in &exprs {
        let q = e.replace("$__rate_interval", "5s").replace("$__range", "1m").replace("$instance", ".*");
        let data = prom.api("query", &[("query", &q)]);
        for name in metric_names(&q) {
            let family = family_of(name, metadata);
            assert!(metadata.contains_key(family), "the dashboard's {name} ({e}) is no metric Prometheus knows");
        }
        assert!(data["resultType"].is_string(), "{q}: {data}");
    }
    let ratio = exprs.iter().find(|e| e.contains("rate(kvtier_hit_blocks_total")).expect("a hit ratio panel");
    assert!(ratio.contains("kvtier_miss_blocks_total"), "{ratio}");

    // Prometheus exits cleanly on SIGTERM (its storage in the temporary directory).
    let mut prom = prom;
    let pid = nix::unistd::Pid::from_raw(prom.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).unwrap();
    let status = wait_exit(&mut prom.child, "prometheus after SIGTERM", DEADLINE);
    assert!(status.success(), "prometheus exited with {status}; log:\n{}", prom.log());
}
