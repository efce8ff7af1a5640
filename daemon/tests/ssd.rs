//! `kvtierd --ssd PATH:SIZE`: the daemon's tier over an SSD tier file, created at the size the flag
//! asks for, written at shutdown and served again after a restart; bad flags refused before
//! anything is created. The files are a few disk slots, under cargo's target tmpdir.

mod support;

use kvtier::{BlockSource, ContentKey, EngineArenas, HostTier, MemcpyArenas, WaitFor};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use support::{Daemon, DEADLINE, SLOT_BYTES};

/// The test geometry's 5,120 B slots take 8,192 B on disk (payload and trailer, rounded up to
/// 4 KiB); a file has a 4,096 B header before its slots.
const DISK_SLOT: u64 = 8192;

fn tmpdir() -> tempfile::TempDir {
    let base = env!("CARGO_TARGET_TMPDIR");
    std::fs::create_dir_all(base).expect("the target tmpdir");
    tempfile::tempdir_in(base).expect("a temporary directory on the build disk")
}

fn keys(tier: &HostTier, range: std::ops::Range<u64>) -> Vec<ContentKey> {
    range.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

/// Stops `d` as an operator does (SIGTERM) and requires a clean exit.
fn stop(d: &mut Daemon) {
    let pid = nix::unistd::Pid::from_raw(d.child.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM to kvtierd");
    let status = support::wait_exit(&mut d.child, "kvtierd after SIGTERM", DEADLINE);
    assert!(status.success(), "kvtierd stopped by SIGTERM exits cleanly: {status}");
    let mut lock = d.socket.clone().into_os_string();
    lock.push(".lock");
    assert!(!Path::new(&lock).exists(), "a clean stop removes the socket's bind lock file");
}

#[test]
fn the_daemon_creates_its_ssd_file_at_the_size_asked_and_serves_its_blocks_after_a_restart() {
    let dir = tmpdir();
    // A colon in the file's name: the path ends at the flag's last colon.
    let path = dir.path().join("drive:0.kvtier");
    // 36 KiB = the 4,096 B header and 4 disk slots.
    let flag = format!("{}:36KiB", path.display());
    let args = ["--ssd", &flag, "--ssd-admit", "1"];
    let mut d = Daemon::start_args(4, "lru", None, &args);
    let len = std::fs::metadata(&path).unwrap_or_else(|e| panic!("{}: {e}: {}", path.display(), d.line)).len();
    assert_eq!(len, 4096 + 4 * DISK_SLOT, "the file holds 4 disk slots");
    assert!(d.line.contains(", SSD tier 4 disk slots of 8192 B, 0 blocks recovered"), "{}", d.line);
    let k = {
        let tier = HostTier::connect(&d.socket).unwrap();
        let g = tier.geometry().with_pages(64).unwrap();
        let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
        let rank = tier.attach(arenas.backend().unwrap()).unwrap();
        let k = keys(&tier, 0..3);
        arenas.fill(&[0, 1, 2], &k).unwrap();
        rank.save(&k, &[0, 1, 2], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
        // Ready in the daemon's pool (committed, so queued for the drive at one use).
        assert_eq!(tier.query(&k).len(), 3);
        rank.shutdown(DEADLINE).unwrap();
        k
    };
    // The demotions still queued are written before the daemon exits.
    stop(&mut d);
    let d = Daemon::start_args(4, "lru", Some(d.socket.clone()), &args);
    assert!(d.line.contains(", SSD tier 4 disk slots of 8192 B, 3 blocks recovered"), "{}", d.line);
    assert_eq!(std::fs::metadata(&path).unwrap().len(), len, "the file is reopened, not remade");
    let tier = HostTier::connect(&d.socket).unwrap();
    assert_eq!(tier.stats().ready_slots, 0, "the new daemon's pool starts empty");
    let g = tier.geometry().with_pages(64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let lease = tier.query(&k);
    assert_eq!(lease.len(), 3, "the blocks come back from the drive");
    // The daemon's lease says where its query found them: all three promoted from the drive.
    assert_eq!(
        (lease.promoted(), (0..3).map(|i| lease.source(i)).collect::<Vec<_>>()),
        (3, vec![Some(BlockSource::Ssd); 3]),
        "the client's lease names the blocks the daemon promoted"
    );
    rank.restore(&lease, &[32, 33, 34], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).unwrap().unwrap();
    arenas.verify(&[32, 33, 34], &k).unwrap();
    drop(lease);
    let s = tier.stats();
    assert_eq!((s.hit_blocks, s.bytes_restored), (3, 3 * SLOT_BYTES));
    rank.shutdown(DEADLINE).unwrap();
}

/// `kvtierd` on the test geometry with `extra` arguments, run to its exit: (status, stderr).
fn refused(socket: &Path, extra: &[&str]) -> (Option<i32>, String) {
    let mut cmd = Command::new(support::kvtierd_bin());
    cmd.arg("--socket").arg(socket).args(["--model", "test-model", "--page-tokens", "16"]);
    for (name, bytes) in support::ARENAS {
        cmd.arg("--arena").arg(format!("{name}:{bytes}"));
    }
    cmd.args(["--pool", &(4 * SLOT_BYTES).to_string(), "--backing", "plain"]).args(extra);
    cmd.env("RUST_LOG", "kvtier=warn").stdin(Stdio::null()).stdout(Stdio::null()).stderr(Stdio::piped());
    let child = cmd.spawn().expect("spawning kvtierd");
    let out = child.wait_with_output().expect("kvtierd's exit");
    (out.status.code(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn bad_ssd_flags_are_refused_naming_the_flag_and_create_nothing() {
    let dir = tmpdir();
    let socket = dir.path().join("kvtierd.sock");
    let a: PathBuf = dir.path().join("a.kvtier");
    let b: PathBuf = dir.path().join("b.kvtier");
    let (a_s, b_s) = (a.display().to_string(), b.display().to_string());
    let cases: Vec<(Vec<String>, String)> = vec![
        (vec!["--ssd".into(), a_s.clone()], format!("kvtierd: --ssd {a_s}: `{a_s}` is not PATH:SIZE")),
        (vec!["--ssd".into(), ":36KiB".into()], "kvtierd: --ssd :36KiB: `:36KiB` is not PATH:SIZE".into()),
        (vec!["--ssd".into(), format!("{a_s}:lots")], format!("kvtierd: --ssd {a_s}:lots: `lots` is not a byte size")),
        (vec!["--ssd".into(), format!("{a_s}:36kib")], "did you mean 36kB (36000 B) or 36KiB (36864 B)?".into()),
        (
            vec!["--ssd".into(), format!("{a_s}:36KiB"), "--ssd-admit".into(), "0".into()],
            "kvtierd: --ssd-admit 0: a block needs at least one use".into(),
        ),
        // A second file too small for one block: the first is not created either.
        (
            vec!["--ssd".into(), format!("{a_s}:36KiB"), "--ssd".into(), format!("{b_s}:12287")],
            format!("kvtierd: --ssd {b_s}:12287: 12287 B hold no block of 5120 B (a 4096 B header, then disk slots of 8192 B)"),
        ),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let (code, err) = refused(&socket, &args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        assert!(err.contains(&want), "{args:?}: stderr `{err}` lacks `{want}`");
        assert!(!a.exists() && !b.exists(), "{args:?}: a refused flag created a file");
        assert!(!socket.exists(), "{args:?}: a refused flag bound the socket");
    }
}

/// `GET /metrics` from the daemon's metrics endpoint (printed in its ready line): the body.
fn scrape(d: &Daemon) -> String {
    use std::io::{Read, Write};
    let at = d.line.split("metrics at http://").nth(1).unwrap_or_else(|| panic!("no metrics address in {:?}", d.line));
    let addr = at.strip_suffix("/metrics").expect("the address ends with /metrics");
    let mut s = std::net::TcpStream::connect(addr).unwrap_or_else(|e| panic!("connecting to {addr}: {e}"));
    s.set_read_timeout(Some(DEADLINE)).unwrap();
    write!(s, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").unwrap();
    let mut raw = String::new();
    s.read_to_string(&mut raw).unwrap();
    raw.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_else(|| panic!("no header end in {raw:?}"))
}

#[test]
fn the_daemons_ssd_tier_is_seen_by_its_metrics_and_by_connected_tiers() {
    let plain = Daemon::start(4);
    assert_eq!(HostTier::connect(&plain.socket).unwrap().ssd_stats(), None, "no SSD tier, no SSD figures");
    drop(plain);

    let dir = tmpdir();
    let flag = format!("{}:36KiB", dir.path().join("d.ssd").display());
    let mut d = Daemon::start_args(4, "lru", None, &["--ssd", &flag, "--ssd-admit", "1", "--metrics", "127.0.0.1:0"]);
    let tier = HostTier::connect(&d.socket).unwrap();
    let s = tier.ssd_stats().expect("a connected tier reads its daemon's SSD figures");
    assert_eq!((s.capacity, s.blocks), (4, 0));
    assert!(scrape(&d).contains("kvtier_ssd_capacity_blocks{tier=\"host\"} 4\n"), "{}", scrape(&d));
    let g = tier.geometry().with_pages(64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let k = keys(&tier, 0..3);
    arenas.fill(&[0, 1, 2], &k).unwrap();
    rank.save(&k, &[0, 1, 2], WaitFor::Nothing).unwrap().handle.wait_timeout(DEADLINE).unwrap().unwrap();
    support::eventually("three blocks demoted", || tier.ssd_stats().is_some_and(|s| s.demoted_blocks == 3));
    let s = tier.try_ssd_stats().unwrap().unwrap();
    assert_eq!((s.blocks, s.bytes_demoted), (3, 3 * SLOT_BYTES));
    let body = scrape(&d);
    for want in ["kvtier_ssd_demoted_blocks_total{tier=\"host\"} 3\n", "kvtier_ssd_blocks{tier=\"host\"} 3\n"] {
        assert!(body.contains(want), "/metrics lacks {want:?}:\n{body}");
    }
    rank.shutdown(DEADLINE).unwrap();
    drop(tier);
    stop(&mut d);
}

/// The peer flags exist in every build; one without the `nixl` feature refuses them saying how to
/// rebuild (not clap's "unexpected argument"), before the pool or the socket is made.
#[cfg(not(feature = "nixl"))]
#[test]
fn peer_flags_without_the_nixl_feature_say_how_to_rebuild() {
    let dir = tmpdir();
    let socket = dir.path().join("kvtierd.sock");
    let secret = dir.path().join("secret").display().to_string();
    for (args, flag) in [
        (vec!["--peer-listen", "127.0.0.1:0"], "--peer-listen"),
        (vec!["--peer", "127.0.0.1:9"], "--peer"),
        (vec!["--peer-secret-file", secret.as_str()], "--peer-secret-file"),
    ] {
        let (code, err) = refused(&socket, &args);
        assert_eq!(code, Some(2), "{args:?}: {err}");
        let want = format!(
            "kvtierd: {flag}: kvtierd was built without the `nixl` feature: rebuild with `cargo build --release -p \
             kvtierd --features nixl`"
        );
        assert!(err.contains(&want), "{args:?}: stderr `{err}` lacks `{want}`");
        assert!(!socket.exists(), "{args:?}: a refused flag bound the socket");
    }
}
