//! `kvtierd --peer-listen ADDR` and `kvtierd --peer ADDR` (feature `nixl`): the daemon's shared
//! pool served to another kvtier instance through the peer protocol, the bytes read one-sided
//! through NIXL, and a daemon that reads its clients' misses from such a peer. An engine saves
//! blocks into the daemon; a second instance (an in-process tier in the first test, a second
//! daemon's client in the second) gets them from it, restores them and checks every byte; every
//! peer proves the shared secret of `--peer-secret-file`. A daemon that cannot serve or read peers
//! (no NIXL runtime, an address it cannot bind, one given twice, an open address without a
//! secret, a secret file others can read) exits with a message naming the flag before its socket
//! exists.
//!
//! `cargo test --release -p kvtierd --features nixl --test peer -- --test-threads=1` with the NIXL
//! runtime in the environment (`eval "$(bash ci/nixl.sh)"`). Without it the tests that need it
//! are skipped with a message; with `KVTIER_REQUIRE_NIXL=1` (CI sets it) they fail instead.

mod support;

use kvtier::{
    BackingChoice, BlockSource, ContentKey, EngineArenas, Geometry, HostTier, MemcpyArenas, NixlTransport, PeerClient,
    PeerError, PeerSecret, Rank, TierConfig, WaitFor,
};
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Instant;
use support::{eventually, Daemon, DEADLINE, SLOT_BYTES};

/// False (after printing why) when the NIXL runtime is missing and not required.
fn runtime(test: &str) -> bool {
    if NixlTransport::runtime_available() {
        return true;
    }
    let required = std::env::var("KVTIER_REQUIRE_NIXL").is_ok_and(|v| v == "1");
    assert!(!required, "KVTIER_REQUIRE_NIXL=1 but the NIXL runtime was not found (eval \"$(bash ci/nixl.sh)\")");
    eprintln!("SKIPPED {test}: the NIXL runtime (libnixl_capi.so) was not found; see ci/nixl.sh");
    false
}

/// The peers' shared secret of these tests, in a file of mode 0600 (kept for the test's life).
fn secret_file() -> (tempfile::TempDir, String) {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("peer.secret");
    std::fs::write(&path, "the daemon tests' peer secret\n").unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    (dir, path.to_str().unwrap().to_string())
}

fn keys(tier: &HostTier, n: u64) -> Vec<ContentKey> {
    (0..n).map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

#[test]
fn a_peer_fetches_the_daemons_blocks_through_nixl_and_the_engines_keep_theirs() {
    if !runtime("a_peer_fetches_the_daemons_blocks_through_nixl_and_the_engines_keep_theirs") {
        return;
    }
    let (_dir, secret) = secret_file();
    let args = [
        "--peer-listen",
        "127.0.0.1:0",
        "--peer-pinned-blocks",
        "6",
        "--metrics",
        "127.0.0.1:0",
        "--peer-secret-file",
        secret.as_str(),
    ];
    let d = Daemon::start_args(8, "lru", None, &args);
    let addr = d
        .line
        .split(", peers at ")
        .nth(1)
        .and_then(|rest| rest.split([',', ' ']).next())
        .unwrap_or_else(|| panic!("the daemon's line names its peer address: {}", d.line))
        .to_string();
    // An engine saves four blocks into the daemon's pool.
    let engine = HostTier::connect(&d.socket).unwrap();
    let g = engine.geometry().with_pages(64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = engine.attach(arenas.backend().unwrap()).unwrap();
    let k = keys(&engine, 4);
    arenas.fill(&[0, 1, 2, 3], &k).unwrap();
    rank.save(&k, &[0, 1, 2, 3], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();

    // Another instance of the same model: its own tier, its own NIXL agent.
    let reader =
        HostTier::new(TierConfig::new(engine.geometry().clone(), 8 * SLOT_BYTES).with_backing(BackingChoice::Plain))
            .unwrap();
    assert_eq!(reader.namespace(), engine.namespace());
    let transport =
        Arc::new(NixlTransport::new(&kvtier::unique_agent_name("kvtierd-test-reader"), reader.pool()).unwrap());
    // Without the secret, or with another, the daemon answers nothing but a refusal.
    let e = PeerClient::connect(addr.as_str(), &reader, transport.clone(), Instant::now() + DEADLINE).unwrap_err();
    assert!(matches!(e, PeerError::Auth(_)), "{e}");
    let key = PeerSecret::from_file(&secret).unwrap();
    let client =
        PeerClient::connect_with_secret(addr.as_str(), &reader, transport, Some(&key), Instant::now() + DEADLINE)
            .unwrap();
    let f = client.fetch(&k, Instant::now() + DEADLINE).unwrap();
    assert_eq!((f.lease.len(), f.lease.from_peer(), f.stale), (4, 4, 0), "all four blocks from the daemon");
    assert!((0..4).all(|i| f.lease.source(i) == Some(BlockSource::Peer)));
    let g2 = reader.geometry().with_pages(64).unwrap();
    let mine = Arc::new(MemcpyArenas::new(&g2).unwrap());
    let my_rank = reader.attach(mine.backend().unwrap()).unwrap();
    my_rank.restore(&f.lease, &[10, 11, 12, 13], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    mine.verify(&[10, 11, 12, 13], &k).unwrap();
    drop(f);

    // The peer's lease settled with its connection: the daemon's pool is as the engine left it.
    drop(client);
    eventually("the peer's pins are gone", || engine.stats().pinned_slots == 0);
    // The owner's side on the daemon's /metrics: one lease of four blocks, all four validated,
    // nothing pinned or leased now, the budget as asked; two connections, one refused its proof.
    let metrics = metrics_addr(&d);
    eventually("the peer's lease is gone from the metrics", || sample(&metrics, "kvtier_peer_leases") == 0.0);
    for (series, v) in [
        ("kvtier_peer_leases_granted_total", 1.0),
        ("kvtier_peer_blocks_leased_total", 4.0),
        ("kvtier_peer_blocks_validated_total{result=\"valid\"}", 4.0),
        ("kvtier_peer_blocks_validated_total{result=\"invalid\"}", 0.0),
        ("kvtier_peer_pinned_blocks", 0.0),
        ("kvtier_peer_pin_budget_blocks", 6.0),
        ("kvtier_peer_connections_accepted_total", 2.0),
        ("kvtier_peer_auth_failures_total", 1.0),
        ("kvtier_peer_refusals_total{limit=\"pinned_blocks\"}", 0.0),
    ] {
        assert_eq!(sample(&metrics, series), v, "{series}");
    }
    let again = engine.query(&k);
    assert_eq!(again.len(), 4);
    rank.restore(&again, &[20, 21, 22, 23], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    arenas.verify(&[20, 21, 22, 23], &k).unwrap();
    drop(again);
    rank.shutdown(DEADLINE).unwrap();
}

/// The peer address the daemon printed (`..., peers at ADDR`).
fn peer_addr(d: &Daemon) -> String {
    d.line
        .split(", peers at ")
        .nth(1)
        .and_then(|rest| rest.split([',', ' ']).next())
        .unwrap_or_else(|| panic!("the daemon's line names its peer address: {}", d.line))
        .to_string()
}

/// The prefill side of the daemon-reader tests: a daemon serving its pool to peers (`owner`, at
/// `addr`) and its engine (`tier`, with `arenas` of geometry `g` attached as `rank`).
struct Prefill {
    /// The peers' secret file (its folder kept for the test's life).
    secret: (tempfile::TempDir, String),
    owner: Daemon,
    addr: String,
    tier: HostTier,
    g: Geometry,
    arenas: Arc<MemcpyArenas>,
    rank: Rank,
    keys: Vec<ContentKey>,
}

/// A [`Prefill`] whose engine has filled pages `0..n` with `keys` (`0..n`) and saved the first
/// four: the owner holds four blocks.
fn prefill_owner(n: u64) -> Prefill {
    let secret = secret_file();
    let owner =
        Daemon::start_args(8, "lru", None, &["--peer-listen", "127.0.0.1:0", "--peer-secret-file", secret.1.as_str()]);
    let addr = peer_addr(&owner);
    let tier = HostTier::connect(&owner.socket).unwrap();
    let g = tier.geometry().with_pages(64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let k = keys(&tier, n);
    let pages: Vec<u64> = (0..n).collect();
    arenas.fill(&pages, &k).unwrap();
    rank.save(&k[..4], &pages[..4], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
    Prefill { secret, owner, addr, tier, g, arenas, rank, keys: k }
}

#[test]
fn a_daemon_with_a_peer_leases_its_clients_the_peers_blocks_marked_as_from_the_peer() {
    if !runtime("a_daemon_with_a_peer_leases_its_clients_the_peers_blocks_marked_as_from_the_peer") {
        return;
    }
    // The prefill side: a daemon serving its pool to peers; its engine saves the first four of
    // six keys.
    let Prefill { secret, owner, addr, tier: prefill, g, arenas: _prefill_arenas, rank: prefill_rank, keys: k } =
        prefill_owner(6);

    // The decode side: a daemon that reads its misses from the owner; its engine has saved only
    // the first block itself.
    let args = ["--peer", addr.as_str(), "--peer-timeout-ms", "20000", "--peer-secret-file", secret.1.as_str()];
    let reader = Daemon::start_args(8, "lru", None, &args);
    let decode = HostTier::connect(&reader.socket).unwrap();
    assert_eq!(decode.namespace(), prefill.namespace());
    let decode_arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let decode_rank = decode.attach(decode_arenas.backend().unwrap()).unwrap();
    decode_arenas.fill(&[0], &k[..1]).unwrap();
    decode_rank.save(&k[..1], &[0], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();

    // Six keys asked: one local, three from the peer (it holds four, the first of which the
    // reader has), two nowhere.
    let lease = decode.query_shared(&k, 2);
    assert_eq!(lease.len(), 4, "the local block, then the peer's three after it");
    let sources: Vec<_> = (0..4).map(|i| lease.source(i)).collect();
    assert_eq!(
        sources,
        [Some(BlockSource::Host), Some(BlockSource::Peer), Some(BlockSource::Peer), Some(BlockSource::Peer)]
    );
    assert_eq!(lease.from_peer(), 3);
    decode_rank.restore(&lease, &[10, 11, 12, 13], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    decode_arenas.verify(&[10, 11, 12, 13], &k[..4]).unwrap();
    assert_eq!(lease.uses_left(), 1, "the lease has the two uses asked, one spent");
    drop(lease);

    // The fetched blocks are the reader's now: the next query is local, even with the owner gone.
    prefill_rank.shutdown(DEADLINE).unwrap();
    drop(prefill);
    drop(owner);
    let again = decode.query(&k);
    assert_eq!(again.len(), 4);
    assert!((0..4).all(|i| again.source(i) == Some(BlockSource::Host)), "the second hit is local");
    decode_rank.restore(&again, &[20, 21, 22, 23], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    decode_arenas.verify(&[20, 21, 22, 23], &k[..4]).unwrap();
    drop(again);

    // A key neither has, with the owner gone: the peer's failure is logged and skipped, the
    // client gets the local prefix, and the reader's pool is as it was.
    let other: Vec<ContentKey> = (100..103).map(|i| decode.namespace().trace_page_key(i, 0)).collect();
    let miss = decode.query(&[k[0], other[0], other[1]]);
    assert_eq!(miss.len(), 1);
    assert_eq!(miss.from_peer(), 0);
    drop(miss);
    eventually("the reader's pins are gone", || decode.stats().pinned_slots == 0);
    assert_eq!(decode.stats().writing_slots, 0, "no slot left being written by a failed fetch");
    decode_rank.shutdown(DEADLINE).unwrap();
}

#[test]
fn a_daemon_fetches_for_a_process_no_more_than_its_slot_bound() {
    if !runtime("a_daemon_fetches_for_a_process_no_more_than_its_slot_bound") {
        return;
    }
    let Prefill {
        secret,
        owner: _owner,
        addr,
        tier: _prefill,
        g,
        arenas: _prefill_arenas,
        rank: prefill_rank,
        keys: k,
    } = prefill_owner(4);
    // A process may hold 2 slots being written at once: a query fetches at most 2 blocks.
    let args = [
        "--peer",
        addr.as_str(),
        "--peer-timeout-ms",
        "20000",
        "--max-slots-per-process",
        "2",
        "--peer-secret-file",
        secret.1.as_str(),
    ];
    let reader = Daemon::start_args(8, "lru", None, &args);
    let decode = HostTier::connect(&reader.socket).unwrap();
    let decode_arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let decode_rank = decode.attach(decode_arenas.backend().unwrap()).unwrap();
    let first = decode.query(&k);
    assert_eq!((first.len(), first.from_peer()), (2, 2), "a fetch is charged to the process's slot bound");
    drop(first);
    // The next query has them locally and fetches the next two.
    let second = decode.query(&k);
    let sources: Vec<_> = (0..second.len()).map(|i| second.source(i)).collect();
    assert_eq!(
        sources,
        [Some(BlockSource::Host), Some(BlockSource::Host), Some(BlockSource::Peer), Some(BlockSource::Peer)]
    );
    decode_rank.restore(&second, &[10, 11, 12, 13], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    decode_arenas.verify(&[10, 11, 12, 13], &k).unwrap();
    drop(second);
    decode_rank.shutdown(DEADLINE).unwrap();
    prefill_rank.shutdown(DEADLINE).unwrap();
}

/// The metrics address the daemon printed (`..., metrics at http://ADDR/metrics`).
fn metrics_addr(d: &Daemon) -> String {
    let at = d.line.split("metrics at http://").nth(1).unwrap_or_else(|| panic!("no metrics address in {:?}", d.line));
    at.split("/metrics").next().unwrap().to_string()
}

/// The value of `series` (`name` or `name{labels}`) in a scrape of the daemon's `/metrics`.
fn sample(addr: &str, series: &str) -> f64 {
    let mut s = TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    let line = raw
        .lines()
        .find(|l| l.strip_prefix(series).is_some_and(|rest| rest.starts_with(' ')))
        .unwrap_or_else(|| panic!("no sample {series} in the scrape:\n{raw}"));
    line.rsplit_once(' ').unwrap().1.parse().unwrap()
}

/// `kvtierd` on the test geometry with `extra` arguments and the environment variables `removed`, run to
/// its exit: (status, stderr).
fn refused(socket: &Path, extra: &[&str], removed: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(support::kvtierd_bin());
    cmd.arg("--socket").arg(socket).args(["--model", "test-model", "--page-tokens", "16"]);
    for (name, bytes) in support::ARENAS {
        cmd.arg("--arena").arg(format!("{name}:{bytes}"));
    }
    cmd.args(["--pool", &(4 * SLOT_BYTES).to_string(), "--backing", "plain"]).args(extra);
    for v in removed {
        cmd.env_remove(v);
    }
    cmd.env("RUST_LOG", "kvtier=warn").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let out = cmd.spawn().expect("spawning kvtierd").wait_with_output().expect("kvtierd's exit");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn a_daemon_that_cannot_serve_peers_exits_naming_the_flag_before_its_socket_exists() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtierd.sock");
    // No NIXL runtime on the library path, to serve or to read.
    let (code, err) = refused(&socket, &["--peer-listen", "127.0.0.1:0"], &["LD_LIBRARY_PATH", "NIXL_PLUGIN_DIR"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("kvtierd: --peer-listen 127.0.0.1:0: ") && err.contains("NIXL runtime not found"), "{err}");
    assert!(!socket.exists(), "no socket is left behind");
    let (code, err) = refused(&socket, &["--peer", "127.0.0.1:7000"], &["LD_LIBRARY_PATH", "NIXL_PLUGIN_DIR"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("kvtierd: --peer 127.0.0.1:7000: ") && err.contains("NIXL runtime not found"), "{err}");
    assert!(!socket.exists(), "no socket is left behind");
    // An address that is not loopback without a secret (checked before NIXL starts).
    let (code, err) = refused(&socket, &["--peer-listen", "0.0.0.0:0"], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("kvtierd: --peer-listen 0.0.0.0:0: ") && err.contains("needs --peer-secret-file"), "{err}");
    assert!(!socket.exists(), "no socket is left behind");
    // A secret file its group or others can read, one too short, and a secret without a role.
    let (_dir, path) = secret_file();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let (code, err) = refused(&socket, &["--peer-listen", "0.0.0.0:0", "--peer-secret-file", &path], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("kvtierd: --peer-secret-file: ") && err.contains("chmod 600"), "{err}");
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    }
    std::fs::write(&path, "short\n").unwrap();
    let (code, err) = refused(&socket, &["--peer", "127.0.0.1:7000", "--peer-secret-file", &path], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("too short"), "{err}");
    let (code, err) = refused(&socket, &["--peer-secret-file", &path], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("--peer-secret-file: needs --peer-listen or --peer"), "{err}");
    assert!(!socket.exists(), "no socket is left behind");
    if !runtime("a_daemon_that_cannot_serve_peers_exits_naming_the_flag_before_its_socket_exists (bad address)") {
        return;
    }
    // An address that does not parse (no such IPv4 address).
    let (code, err) = refused(&socket, &["--peer-listen", "256.0.0.1:7000"], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("kvtierd: --peer-listen 256.0.0.1:7000: "), "{err}");
    assert!(!socket.exists(), "no socket is left behind");
    // A pin budget of 0.
    let (code, err) = refused(&socket, &["--peer-listen", "127.0.0.1:0", "--peer-pinned-blocks", "0"], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("pinned blocks must be > 0"), "{err}");
    assert!(!socket.exists(), "no socket is left behind");
    // A peer to read from, given twice; and a peer timeout of 0.
    let (code, err) = refused(&socket, &["--peer", "127.0.0.1:7000", "--peer", "127.0.0.1:7000"], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("kvtierd: --peer 127.0.0.1:7000,127.0.0.1:7000: ") && err.contains("configured twice"),
        "{err}"
    );
    assert!(!socket.exists(), "no socket is left behind");
    let (code, err) = refused(&socket, &["--peer", "127.0.0.1:7000", "--peer-timeout-ms", "0"], &[]);
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("kvtierd: --peer-timeout-ms 0: ") && err.contains("timeout must be > 0"), "{err}");
}
