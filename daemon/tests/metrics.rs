//! `kvtierd --metrics`: a `kvtierd` process serving `/metrics` and `/healthz` on loopback, driven
//! by a connected tier (`HostTier::connect`) in this test process and scraped over plain HTTP
//! (a `TcpStream`). Every wait is bounded (`support::DEADLINE`).

mod support;

use kvtier::{ContentKey, EngineArenas, HostTier, MemcpyArenas, WaitFor};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::sync::Arc;
use support::{eventually, Daemon, DEADLINE, SLOT_BYTES};

/// The metrics address the daemon printed (`..., metrics at http://ADDR/metrics`).
fn metrics_addr(d: &Daemon) -> String {
    let at = d.line.split("metrics at http://").nth(1).unwrap_or_else(|| panic!("no metrics address in {:?}", d.line));
    at.strip_suffix("/metrics").expect("the address ends with /metrics").to_string()
}

/// `GET path` from the daemon's metrics endpoint: the status code and the body.
fn get(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap_or_else(|e| panic!("reading the answer to GET {path}: {e}"));
    let (head, body) = raw.split_once("\r\n\r\n").unwrap_or_else(|| panic!("no header end in {raw:?}"));
    let status = head.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("status in {head:?}"));
    (status, body.to_string())
}

/// The samples of an OpenMetrics text, `name{labels}` to value, after checking that every family
/// has a `# HELP` with text and a `# TYPE`, every sample a family, every counter sample `_total`
/// (a histogram's `_bucket`, `_sum`, `_count`), and the text ends with `# EOF`.
fn parse(text: &str) -> HashMap<String, f64> {
    let (mut help, mut types, mut samples) = (HashMap::new(), HashMap::<String, String>::new(), HashMap::new());
    assert!(text.ends_with("# EOF\n"), "no EOF marker: {text}");
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, h) = rest.split_once(' ').unwrap_or_else(|| panic!("HELP without text: {line}"));
            assert!(!h.trim().is_empty(), "{name} has an empty help");
            help.insert(name.to_string(), ());
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, t) = rest.split_once(' ').unwrap_or_else(|| panic!("TYPE without a type: {line}"));
            assert!(help.contains_key(name), "# TYPE {name} before its # HELP");
            types.insert(name.to_string(), t.to_string());
        } else if !line.starts_with('#') {
            let (series, v) = line.rsplit_once(' ').unwrap_or_else(|| panic!("not a sample: {line}"));
            let name = series.split('{').next().unwrap();
            let fam = types
                .keys()
                .find(|f| {
                    let suffix = |x: &str| name.strip_suffix(x) == Some(f.as_str());
                    name == f.as_str()
                        || (types[*f] == "counter" && suffix("_total"))
                        || (types[*f] == "histogram" && (suffix("_bucket") || suffix("_sum") || suffix("_count")))
                })
                .unwrap_or_else(|| panic!("sample {series} has no # TYPE before it"));
            if types[fam] == "counter" {
                assert!(name.ends_with("_total"), "counter sample {name} without _total");
            }
            samples.insert(series.to_string(), v.parse::<f64>().unwrap_or_else(|e| panic!("{line}: {e}")));
        }
    }
    assert_eq!(help.len(), types.len(), "every # HELP has its # TYPE");
    samples
}

fn keys(tier: &HostTier, range: std::ops::Range<u64>) -> Vec<ContentKey> {
    range.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

#[test]
fn the_daemon_serves_its_tiers_counters_as_openmetrics() {
    let d = Daemon::start_args(16, "lru", None, &["--metrics", "127.0.0.1:0"]);
    let addr = metrics_addr(&d);
    let tier = HostTier::connect(&d.socket).unwrap();
    let g = tier.geometry().with_pages(64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..8);
    let src: Vec<u64> = (0..6).collect();
    arenas.fill(&src, &k[..6]).unwrap();
    rank.save(&k[..6], &src, WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
    // Two keys already resident: skipped.
    rank.save(&k[..2], &src[..2], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
    let lease = tier.query(&k); // 6 hits, 2 misses
    assert_eq!(lease.len(), 6);
    rank.restore(&lease, &[32, 33, 34, 35, 36, 37], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    arenas.verify(&[32, 33, 34, 35, 36, 37], &k[..6]).unwrap();
    let held = tier.query(&k[..4]); // 4 more hits, held: 4 slots pinned
    let s = tier.stats();
    let (status, body) = get(&addr, "/metrics");
    assert_eq!(status, 200, "{body}");
    let m = parse(&body);
    let v = |series: &str| *m.get(series).unwrap_or_else(|| panic!("no sample {series} in the scrape:\n{body}"));
    // The tier's own counters, and the values this traffic must have given them.
    assert_eq!((s.hit_blocks, s.miss_blocks, s.saved_blocks, s.restored_blocks), (10, 2, 6, 6));
    assert_eq!(s.bytes_saved, 6 * SLOT_BYTES);
    assert_eq!(v("kvtier_hit_blocks_total{tier=\"host\"}"), s.hit_blocks as f64, "hit blocks as the tier counts them");
    assert_eq!(v("kvtier_miss_blocks_total{tier=\"host\"}"), s.miss_blocks as f64);
    assert_eq!(v("kvtier_hit_bytes_total{tier=\"host\"}"), (s.hit_blocks * SLOT_BYTES) as f64);
    assert_eq!(v("kvtier_queries_total{tier=\"host\"}"), s.queries as f64);
    assert_eq!(v("kvtier_save_blocks_total{tier=\"host\",outcome=\"saved\"}"), s.saved_blocks as f64);
    assert_eq!(v("kvtier_save_blocks_total{tier=\"host\",outcome=\"skipped_resident\"}"), 2.0);
    assert_eq!(v("kvtier_restore_blocks_total{tier=\"host\",outcome=\"restored\"}"), s.restored_blocks as f64);
    assert_eq!(v("kvtier_copy_bytes_total{tier=\"host\",direction=\"save\"}"), s.bytes_saved as f64);
    assert_eq!(v("kvtier_copy_bytes_total{tier=\"host\",direction=\"restore\"}"), s.bytes_restored as f64);
    assert_eq!(v("kvtier_slots{tier=\"host\",state=\"pinned\"}"), 4.0);
    assert_eq!(v("kvtier_slots{tier=\"host\",state=\"ready\"}"), 2.0);
    assert_eq!(v("kvtier_slots{tier=\"host\",state=\"free\"}"), 10.0);
    assert_eq!(v("kvtier_leases{tier=\"host\"}"), 1.0);
    assert_eq!(v("kvtier_pool_slots{tier=\"host\"}"), 16.0);
    // One copy each way (the second save copied nothing), timed by the client, counted by the daemon.
    let lat = |dir: &str| v(&format!("kvtier_copy_latency_seconds_count{{tier=\"host\",direction=\"{dir}\"}}"));
    assert_eq!((lat("save"), lat("restore")), (1.0, 1.0), "copies in the daemon's latency histogram");
    assert!(v("kvtier_copy_latency_seconds_sum{tier=\"host\",direction=\"save\"}") > 0.0);
    // The daemon's own: this test's one connection (and its session).
    assert_eq!(v("kvtierd_sessions"), 1.0);
    assert_eq!(v("kvtierd_sessions_begun_total"), 1.0);
    assert_eq!(v("kvtierd_connections"), 1.0);
    // One definition: the connected tier's own registry reports the daemon's tier the same way.
    let mut registry = kvtier::prometheus_client::registry::Registry::default();
    tier.register_metrics(&mut registry);
    let mut text = String::new();
    kvtier::prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
    let mine = parse(&text);
    // All but the copy latency histogram and the eviction lock's figures, which the daemon alone
    // serves (its tier's lock: no save here needed one, so none was taken).
    assert_eq!(v("kvtier_eviction_lock_holds_total{tier=\"host\"}"), 0.0);
    let daemon_only = |k: &str| k.starts_with("kvtier_copy_latency_seconds") || k.starts_with("kvtier_eviction_lock_");
    let theirs: HashMap<_, _> =
        m.iter().filter(|(k, _)| k.starts_with("kvtier_") && !daemon_only(k)).map(|(k, v)| (k.clone(), *v)).collect();
    assert_eq!(mine, theirs, "a connected tier's metrics are its daemon's tier's");
    drop(held);
    rank.shutdown(DEADLINE).unwrap();
}

#[test]
fn refusals_over_a_bound_are_counted_by_limit() {
    let extra = ["--metrics", "127.0.0.1:0", "--max-connections", "1", "--max-leased-blocks", "4"];
    let d = Daemon::start_args(16, "lru", None, &extra);
    let addr = metrics_addr(&d);
    let (_, body) = get(&addr, "/metrics");
    assert!(body.contains("# TYPE kvtierd_refusals counter"), "described before any refusal: {body}");
    let tier = HostTier::connect(&d.socket).unwrap();
    let k = keys(&tier, 0..5);
    for _ in 0..2 {
        // The client cannot check this bound (the welcome does not send it): the daemon refuses.
        let e = tier.try_query_shared(&k, 1).unwrap_err();
        assert!(
            matches!(e, kvtier::TierError::LimitExceeded { limit: kvtier::Limit::LeasedBlocksPerConnection, .. }),
            "{e:?}"
        );
    }
    let e = HostTier::connect(&d.socket).unwrap_err();
    assert!(e.to_string().contains("connections"), "a second connection over --max-connections 1: {e}");
    let (_, body) = get(&addr, "/metrics");
    let m = parse(&body);
    assert_eq!(m.get("kvtierd_refusals_total{limit=\"leased_blocks_per_connection\"}"), Some(&2.0), "{body}");
    assert_eq!(m.get("kvtierd_refusals_total{limit=\"connections\"}"), Some(&1.0), "{body}");
    assert_eq!(m.get("kvtierd_connections_accepted_total"), Some(&2.0), "{body}");
}

#[test]
fn healthz_turns_unhealthy_when_every_slot_stays_pinned_and_healthy_once_released() {
    // A bound of 50 ms: the daemon samples the pool every 12.5 ms.
    let d = Daemon::start_args(4, "lru", None, &["--metrics", "127.0.0.1:0", "--healthz-bound", "0.05"]);
    let addr = metrics_addr(&d);
    let (status, body) = get(&addr, "/healthz");
    assert_eq!(status, 200, "a fresh daemon is healthy: {body}");
    let tier = HostTier::connect(&d.socket).unwrap();
    let g = tier.geometry().with_pages(8).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..4);
    arenas.fill(&[0, 1, 2, 3], &k).unwrap();
    rank.save(&k, &[0, 1, 2, 3], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
    let (status, body) = get(&addr, "/healthz");
    assert_eq!(status, 200, "every slot holds a block but each is evictable: {body}");
    let lease = tier.query(&k); // every slot pinned: nothing free, nothing evictable
    assert_eq!(lease.len(), 4);
    let mut last = String::new();
    eventually("/healthz answers 503 once the pool has been exhausted beyond the bound", || {
        let (status, body) = get(&addr, "/healthz");
        last = body;
        status == 503
    });
    assert!(last.contains("4 pinned"), "the body says why: {last}");
    drop(lease);
    eventually("/healthz answers 200 again once the lease is settled", || get(&addr, "/healthz").0 == 200);
    rank.shutdown(DEADLINE).unwrap();
}

/// A secret file (mode 0600) in a new directory: (the directory, the file's path, the secret).
fn token_file() -> (tempfile::TempDir, String, String) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("metrics.token");
    let token = "a-token-of-more-than-sixteen-bytes";
    std::fs::write(&path, format!("{token}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    (dir, path.to_str().unwrap().to_string(), token.to_string())
}

/// `GET path` with `header` (a whole `Name: value` line, or none): the status code.
fn status_with(addr: &str, path: &str, header: Option<&str>) -> u16 {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    let extra = header.map_or(String::new(), |h| format!("{h}\r\n"));
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\n{extra}Connection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    raw.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or_else(|| panic!("status in {raw:?}"))
}

#[test]
fn with_a_token_file_metrics_asks_every_scrape_for_the_bearer_token_and_healthz_does_not() {
    let (_dir, path, token) = token_file();
    let d = Daemon::start_args(8, "lru", None, &["--metrics", "127.0.0.1:0", "--metrics-token-file", &path]);
    let addr = metrics_addr(&d);
    assert_eq!(status_with(&addr, "/metrics", None), 401, "a scrape without the token is refused");
    assert_eq!(status_with(&addr, "/metrics", Some("Authorization: Bearer not-the-token-at-all")), 401);
    assert_eq!(status_with(&addr, "/metrics", Some(&format!("Authorization: Basic {token}"))), 401);
    assert_eq!(status_with(&addr, "/metrics", Some(&format!("Authorization: Bearer {token}"))), 200);
    assert_eq!(status_with(&addr, "/healthz", None), 200, "health needs no token");
}

#[test]
fn metrics_off_loopback_need_a_token_file() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(support::kvtierd_bin())
        .args(["--model", "m", "--page-tokens", "16", "--arena", "kv:4096", "--pool", "1MiB", "--backing", "plain"])
        .arg("--socket")
        .arg(dir.path().join("kvtierd.sock"))
        .args(["--metrics", "0.0.0.0:0"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--metrics-token-file"), "{err}");
}
