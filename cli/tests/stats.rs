//! `kvtier stats`: the command reads a served tier's statistics over its socket and prints them as
//! the tier counts them. The tier is served on a thread of this test process (`kvtier::Server`);
//! the `kvtier` binary is the client. Client processes (the top clients) are this test binary
//! re-run with only the test `client_role`.

mod support;

use kvtier::{ArenaSpec, BackingChoice, EngineArenas, Geometry, HostTier, MemcpyArenas, TierConfig, WaitFor};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

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
    assert!(v["ssd"].is_null(), "no SSD tier: `ssd` is null in {v}");
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

#[test]
fn stats_where_nothing_listens_says_how_to_start_the_daemon() {
    let dir = tempfile::tempdir().unwrap();
    // No socket file at all (ENOENT), then a stale socket file nobody listens on (ECONNREFUSED).
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    for path in [dir.path().join("nobody.sock"), stale] {
        let out = Command::new(support::kvtier_bin()).arg("stats").arg("--socket").arg(&path).output().unwrap();
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("no connection to the tier daemon: nothing listens at {}", path.display())),
            "{err}"
        );
        assert!(err.contains(&format!("kvtierd --geometry PRESET --pool SIZE --socket {}", path.display())), "{err}");
        assert!(err.contains("cargo run --release -p kvtierd -- --geometry PRESET"), "{err}");
    }
}

/// What a daemon process's ready line starts with.
const SERVING: &str = "KVTIER-DAEMON-SERVING ";

/// A daemon process (run only as a child, `KVTIER_SERVE` set to the socket): serves a tier of 8
/// slots there, prints its ready line once it listens, and serves until it is killed.
#[test]
fn daemon_role() {
    let Some(path) = std::env::var_os("KVTIER_SERVE") else { return };
    let g = Geometry::new("stats-model", 16, vec![ArenaSpec::packed("kv", 4096, 1)]).unwrap();
    let cfg = TierConfig::new(g.clone(), 8 * g.slot_bytes()).with_backing(BackingChoice::Plain);
    let server = kvtier::Server::bind(&path, HostTier::new_shared(cfg).unwrap()).unwrap();
    println!("{SERVING}{}", std::process::id());
    server.run().unwrap();
}

/// Starts a daemon process (see [`daemon_role`]) on `socket` and waits until it listens.
fn daemon(socket: &std::path::Path) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "daemon_role", "--nocapture", "--test-threads", "1"])
        .env("KVTIER_SERVE", socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while let Some(line) = lines.next() {
        if line.unwrap().contains(SERVING) {
            std::thread::spawn(move || lines.for_each(drop));
            return child;
        }
    }
    panic!("the daemon ended before it listened: {:?}", child.wait());
}

#[test]
fn stats_watch_waits_for_a_restarted_daemon() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtierd.sock");
    let mut first = daemon(&socket);
    let mut watch = Command::new(support::kvtier_bin())
        .args(["stats", "--watch", "0.2", "--socket"])
        .arg(&socket)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(watch.stdout.take().unwrap()).lines();
    let mut seen = Vec::new();
    let mut until = |what: &str, watch: &mut Child| {
        for line in lines.by_ref() {
            let line = line.unwrap();
            seen.push(line.clone());
            if line.contains(what) {
                return line;
            }
        }
        let _ = watch.kill();
        let mut err = String::new();
        let _ = std::io::Read::read_to_string(watch.stderr.as_mut().unwrap(), &mut err);
        panic!("kvtier stats --watch ended before {what:?}: {:?}\nstdout: {seen:#?}\nstderr: {err}", watch.wait());
    };
    until("(every 0.2 s)", &mut watch);
    first.kill().unwrap();
    first.wait().unwrap();
    let gone = until(" is gone", &mut watch);
    assert!(gone.contains(&socket.display().to_string()), "{gone}");
    assert!(gone.contains("waiting for it to come back"), "{gone}");
    // Still waiting, not exited, while nothing listens.
    std::thread::sleep(Duration::from_millis(600));
    assert!(watch.try_wait().unwrap().is_none(), "kvtier stats --watch exited with the daemon gone");
    let mut second = daemon(&socket);
    until(" is back", &mut watch);
    let table = until("(every 0.2 s)", &mut watch);
    assert!(table.starts_with("kvtierd at"), "{table}");
    watch.kill().unwrap();
    watch.wait().unwrap();
    second.kill().unwrap();
    second.wait().unwrap();
}

/// What a client process's ready line starts with.
const READY: &str = "KVTIER-CLIENT-READY ";

/// A client process (run only as a child, `KVTIER_CLIENT_ROLE` set): connects to
/// `KVTIER_SOCKET`, saves `KVTIER_SAVE` blocks, queries them and one missing key, holds the
/// lease, restores `KVTIER_RESTORE` of them, gives one hint; prints its ready line and waits for a
/// line (or the end) on stdin before it exits.
#[test]
fn client_role() {
    let Some(role) = std::env::var_os("KVTIER_CLIENT_ROLE") else { return };
    let role: u64 = role.to_str().unwrap().parse().unwrap();
    let num = |name: &str| std::env::var(name).unwrap().parse::<u64>().unwrap();
    let (save, restore) = (num("KVTIER_SAVE"), num("KVTIER_RESTORE"));
    let tier = HostTier::connect(std::env::var_os("KVTIER_SOCKET").unwrap()).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&tier.geometry().with_pages(8).unwrap()).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let keys: Vec<_> = (0..save).map(|i| tier.namespace().trace_page_key(100 + role, i)).collect();
    let pages: Vec<u64> = (0..save).collect();
    arenas.fill(&pages, &keys).unwrap();
    rank.save(&keys, &pages, WaitFor::Nothing).unwrap().handle.wait().unwrap();
    let mut asked = keys.clone();
    asked.push(tier.namespace().trace_page_key(900 + role, 0));
    let lease = tier.query(&asked);
    assert_eq!(lease.len() as u64, save);
    let dst: Vec<u64> = (4..4 + restore).collect();
    rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait().unwrap();
    let _hint = tier.hint(&keys[..1], Duration::from_secs(600));
    println!("{READY}{}", std::process::id());
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    drop(lease);
}

/// Starts a client process (see [`client_role`]) and waits for its ready line.
fn client(socket: &std::path::Path, role: u64, save: u64, restore: u64) -> Child {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "client_role", "--nocapture", "--test-threads", "1"])
        .env("KVTIER_CLIENT_ROLE", role.to_string())
        .env("KVTIER_SOCKET", socket)
        .env("KVTIER_SAVE", save.to_string())
        .env("KVTIER_RESTORE", restore.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    while let Some(line) = lines.next() {
        let line = line.unwrap();
        if let Some(at) = line.find(READY) {
            assert_eq!(line[at + READY.len()..].trim(), child.id().to_string());
            // The rest of its output is read to its end, so the child never writes to a closed pipe.
            std::thread::spawn(move || lines.for_each(drop));
            return child;
        }
    }
    panic!("client {role} ended before it was ready: {:?}", child.wait());
}

#[test]
fn stats_shows_each_client_process_with_its_own_counters() {
    let (_dir, socket, tier) = serve();
    let block = tier.geometry().block_bytes();
    // Two processes with different traffic: (saved, restored) blocks.
    let plan = [(3u64, 2u64), (1, 1)];
    let mut children: Vec<Child> =
        plan.iter().enumerate().map(|(i, &(save, restore))| client(&socket, i as u64, save, restore)).collect();
    let out =
        Command::new(support::kvtier_bin()).arg("stats").arg("--socket").arg(&socket).arg("--json").output().unwrap();
    assert!(out.status.success(), "kvtier stats failed: {}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    let rows = v["clients"].as_array().unwrap_or_else(|| panic!("no clients array in {v}"));
    assert_eq!(rows.len(), 2, "one row per client process, the asking one left out: {v}");
    for (child, &(save, restore)) in children.iter().zip(&plan) {
        let row = rows
            .iter()
            .find(|r| r["pid"].as_u64() == Some(child.id() as u64))
            .unwrap_or_else(|| panic!("no row for pid {} in {v}", child.id()));
        let field = |name: &str| row[name].as_u64().unwrap_or_else(|| panic!("no number {name} in {row}"));
        for (name, want) in [
            ("sessions", 1),
            ("lease_handles", 1),
            ("leased_blocks", save),
            ("hints", 1),
            ("hints_given", 1),
            ("copies_in_flight", 0),
            ("queries", 1),
            ("hit_blocks", save),
            ("miss_blocks", 1),
            ("saved_blocks", save),
            ("bytes_saved", save * block),
            ("restored_blocks", restore),
            ("bytes_restored", restore * block),
            ("refused", 0),
        ] {
            assert_eq!(field(name), want, "{name} of pid {} in {row}", child.id());
        }
    }
    // Busiest first: the first process moved more bytes.
    assert_eq!(rows[0]["pid"].as_u64(), Some(children[0].id() as u64), "{v}");
    // The table names both processes.
    let out = Command::new(support::kvtier_bin()).arg("stats").arg("--socket").arg(&socket).output().unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("top clients (2 processes)"), "{text}");
    for c in &children {
        assert!(text.contains(&format!(" {} ", c.id())), "pid {} in {text}", c.id());
    }
    // A process that exits leaves the view.
    let mut first = children.remove(0);
    first.stdin.take().unwrap().write_all(b"bye\n").unwrap();
    assert!(first.wait().unwrap().success());
    let t0 = std::time::Instant::now();
    loop {
        let out = Command::new(support::kvtier_bin())
            .arg("stats")
            .arg("--socket")
            .arg(&socket)
            .arg("--json")
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        if v["clients"].as_array().map(Vec::len) == Some(1) {
            assert_eq!(v["clients"][0]["pid"].as_u64(), Some(children[0].id() as u64), "{v}");
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the exited process is still listed: {v}");
        std::thread::sleep(Duration::from_millis(50));
    }
    for mut c in children {
        drop(c.stdin.take());
        assert!(c.wait().unwrap().success());
    }
}
