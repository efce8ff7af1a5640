//! `kvtier stats`: the command reads a served tier's statistics over its socket and prints them as
//! the tier counts them. The tier is served on a thread of this test process (`kvtier::Server`);
//! the `kvtier` binary is the client.

mod support;

use kvtier::{ArenaSpec, BackingChoice, EngineArenas, Geometry, HostTier, MemcpyArenas, TierConfig, WaitFor};
use std::process::Command;
use std::sync::Arc;

/// Serves a tier of 8 slots; returns the socket's directory (keep it alive), the socket and a
/// handle on the served tier.
fn serve() -> (tempfile::TempDir, std::path::PathBuf, HostTier) {
    let g = Geometry::new("stats-model", 16, vec![ArenaSpec::packed("kv", 4096, 1)]).unwrap();
    let cfg = TierConfig::new(g.clone(), 8 * g.slot_bytes()).with_backing(BackingChoice::Plain);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvtierd.sock");
    let server = kvtier::Server::bind(&path, HostTier::new_shared(cfg).unwrap()).unwrap();
    let tier = server.tier().clone();
    std::thread::spawn(move || server.run());
    (dir, path, tier)
}

#[test]
fn stats_json_reports_the_served_tiers_counters() {
    let (_dir, socket, tier) = serve();
    // Traffic: three blocks saved, two of them found and one missed by a query, one evicted.
    let arenas = Arc::new(MemcpyArenas::new(&tier.geometry().with_pages(8).unwrap()).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let keys: Vec<_> = (0..3).map(|i| tier.namespace().trace_page_key(7, i)).collect();
    arenas.fill(&[0, 1, 2], &keys).unwrap();
    rank.save(&keys, &[0, 1, 2], WaitFor::Nothing).unwrap().handle.wait().unwrap();
    let missing = tier.namespace().trace_page_key(8, 0);
    let lease = tier.query(&[keys[0], keys[1], missing]);
    assert_eq!(lease.len(), 2);
    drop(lease);
    assert_eq!(tier.evict(1), 1);

    let out =
        Command::new(support::kvtier_bin()).arg("stats").arg("--socket").arg(&socket).arg("--json").output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "kvtier stats failed: {stderr}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let want = tier.stats();
    let field = |name: &str| v[name].as_u64().unwrap_or_else(|| panic!("no number {name} in {v}"));
    assert_eq!(want.saved_blocks, 3);
    assert_eq!(want.hit_blocks, 2);
    assert_eq!((want.evictions, want.explicit_evictions), (1, 1));
    for (name, value) in [
        ("saved_blocks", want.saved_blocks),
        ("bytes_saved", want.bytes_saved),
        ("hit_blocks", want.hit_blocks),
        ("miss_blocks", want.miss_blocks),
        ("queries", want.queries),
        ("evictions", want.evictions),
        ("explicit_evictions", want.explicit_evictions),
        ("evicting_slots", want.evicting_slots),
        ("capacity", want.capacity),
        ("ready_slots", want.ready_slots),
        ("free_slots", want.free_slots),
        ("live_leases", want.live_leases),
    ] {
        assert_eq!(field(name), value, "{name} in {v}");
    }
    let ratio = v["hit_ratio"].as_f64().expect("hit_ratio");
    let looked = (want.hit_blocks + want.miss_blocks) as f64;
    assert_eq!(ratio, want.hit_blocks as f64 / looked);
}

#[test]
fn stats_prints_a_table_and_names_a_missing_socket() {
    let (_dir, socket, tier) = serve();
    let out = Command::new(support::kvtier_bin()).arg("stats").arg("--socket").arg(&socket).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("hit ratio"), "{text}");
    assert!(text.contains(&format!("{} capacity", tier.capacity())), "{text}");

    let gone = socket.with_file_name("nobody.sock");
    let out = Command::new(support::kvtier_bin()).arg("stats").arg("--socket").arg(&gone).output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("nobody.sock"), "the error names the socket: {err}");
}
