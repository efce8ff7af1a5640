//! A `kvtierd` process and engine processes (this test binary re-run as `client_role`) sharing one
//! pool: saves in one process restored in others from one shared lease, random concurrent traffic
//! from 4 processes checked against the daemon's audit, `kill -9` of an engine mid-save and
//! mid-restore, and a daemon restart. Every wait is bounded (`support::DEADLINE`).

mod support;

use kvtier::BackendKind;
use kvtier::{
    Completion, ContentKey, CopyBackend, CopyError, CopyPair, EngineArenas, Fit, Geometry, HostPool, HostTier,
    LeaseToken, SaveOptions, TierError, WaitFor,
};
use kvtier::{MemcpyArenas, MemcpyBackend};
use std::sync::Arc;
use std::time::Duration;
use support::{eventually, Client, Daemon, DEADLINE};

/// GPU pages of a client's (host) arenas: sources from 0, restore destinations from 32 and 48.
const PAGES: u64 = 64;

fn keys(tier: &HostTier, range: std::ops::Range<u64>) -> Vec<ContentKey> {
    range.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

fn env_u64(name: &str) -> u64 {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} not set")).parse().expect("a number")
}

fn say(line: impl std::fmt::Display) {
    println!("{}{line}", support::ROLE_MARK);
}

/// Blocks until the parent writes a line (returned) or closes stdin (None).
fn hear() -> Option<String> {
    let mut s = String::new();
    match std::io::stdin().read_line(&mut s) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(s.trim().to_string()),
    }
}

fn connect() -> HostTier {
    HostTier::connect(std::env::var("KVTIER_SOCKET").expect("KVTIER_SOCKET")).expect("connecting to kvtierd")
}

fn rank_geometry(tier: &HostTier) -> Geometry {
    tier.geometry().with_pages(PAGES).unwrap()
}

/// This client's arenas: host memory, or GPU 0 with `KVTIER_BACKEND=cuda` (the GPU test).
fn arenas_for(tier: &HostTier) -> Arc<dyn EngineArenas> {
    let kind: BackendKind = std::env::var("KVTIER_BACKEND").map_or(BackendKind::Host, |s| s.parse().unwrap());
    kind.arenas(0, &rank_geometry(tier)).unwrap()
}

/// Saves `keys` from pages `0..n` (filled first) with all-or-nothing, and waits.
fn save_all(tier: &HostTier, keys: &[ContentKey]) -> (Arc<dyn EngineArenas>, kvtier::Rank) {
    let arenas = arenas_for(tier);
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let pages: Vec<u64> = (0..keys.len() as u64).collect();
    arenas.fill(&pages, keys).unwrap();
    let t = rank.save(keys, &pages, WaitFor::Nothing).unwrap();
    assert_eq!(t.saving.len() + t.resident, keys.len());
    t.handle.wait_timeout(DEADLINE).expect("save completes in time").unwrap();
    (arenas, rank)
}

/// A host backend whose copies never complete (the process is killed while they "run"). A save
/// first writes its bytes, then scribbles over them (a torn, half-written block); a restore copies
/// nothing.
struct StuckBackend {
    inner: MemcpyBackend,
    pool: Option<(usize, u64)>,
}

/// Set once a stuck copy has done all it will do.
static STUCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn until_stuck() {
    eventually("the copy is stuck", || STUCK.load(std::sync::atomic::Ordering::Acquire));
}

struct Stuck {
    scribble: Vec<(usize, usize)>,
    inner: Box<dyn Completion>,
}

impl Completion for Stuck {
    fn poll(&mut self) -> Result<bool, CopyError> {
        Ok(false)
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        let _ = self.inner.wait();
        for &(addr, len) in &self.scribble {
            // SAFETY: the daemon reserved these slots (WRITING) for this save; nobody else touches
            // them while the copy is in flight, which it is forever.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0xEE, len / 2) };
        }
        STUCK.store(true, std::sync::atomic::Ordering::Release);
        loop {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
}

impl CopyBackend for StuckBackend {
    fn name(&self) -> &'static str {
        "stuck"
    }
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        self.pool = Some((pool.region().host_base, pool.slot_bytes()));
        self.inner.bind_pool(pool)
    }
    unsafe fn save(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        let (base, sb) = self.pool.expect("bound");
        let scribble = batch.iter().map(|p| (base + p.slot as usize * sb as usize, sb as usize)).collect();
        // SAFETY: forwarded; the caller upholds the backend contract.
        Ok(Box::new(Stuck { scribble, inner: unsafe { self.inner.save(batch, wait) }? }))
    }
    unsafe fn restore(&self, _batch: &[CopyPair], _wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        Ok(Box::new(Stuck { scribble: Vec::new(), inner: Box::new(kvtier::Done(Ok(()))) }))
    }
}

fn stuck_rank(tier: &HostTier) -> (Arc<MemcpyArenas>, kvtier::Rank) {
    let arenas = Arc::new(MemcpyArenas::new(&rank_geometry(tier)).unwrap());
    let backend = StuckBackend { inner: MemcpyBackend::new(arenas.clone()), pool: None };
    let rank = tier.attach(Box::new(backend)).unwrap();
    (arenas, rank)
}

/// A tiny deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random saves, queries (shared or not), restores, releases and evictions; every restored byte is
/// verified. Returns the blocks verified.
fn churn(seed: u64, iters: u64, keyspace: u64) -> u64 {
    let tier = connect();
    let all = keys(&tier, 0..keyspace);
    let arenas = arenas_for(&tier);
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut verified = 0;
    for _ in 0..iters {
        let len = 1 + rng.below(8);
        let start = rng.below(keyspace - len);
        let k = &all[start as usize..(start + len) as usize];
        match rng.below(4) {
            0 | 1 => {
                let src: Vec<u64> = (0..len).collect();
                arenas.fill(&src, k).unwrap();
                let fit = if rng.below(2) == 0 { Fit::Prefix } else { Fit::AllOrNothing };
                match rank.save_with(k, &src, WaitFor::Nothing, SaveOptions::new().fit(fit)) {
                    Ok(t) => t.handle.wait_timeout(DEADLINE).expect("save completes in time").unwrap(),
                    // A pool full of others' copies, or this process past its fair share of the
                    // slots being written while the others' shares are unheld (`Limits::writing_slots`).
                    Err(
                        TierError::CannotFit { .. }
                        | TierError::PoolExhausted { .. }
                        | TierError::LimitExceeded { limit: kvtier::Limit::WritingSlots, .. },
                    ) => {}
                    Err(e) => panic!("save: {e}"),
                }
            }
            2 => {
                let uses = 1 + rng.below(2) as u32;
                let lease = tier.try_query_shared(k, uses).unwrap();
                let n = lease.len();
                for u in 0..uses {
                    let m = if n == 0 { 0 } else { 1 + rng.below(n as u64) as usize };
                    let dst: Vec<u64> = (32 + 16 * u as u64..).take(m).collect();
                    let h = rank.restore(&lease, &dst, WaitFor::Nothing).unwrap();
                    h.wait_timeout(DEADLINE).expect("restore completes in time").unwrap();
                    arenas.verify(&dst, &k[..m]).unwrap();
                    verified += m as u64;
                }
                assert!(lease.is_settled(), "every use was taken");
                assert_eq!(
                    rank.restore(&lease, &[], WaitFor::Nothing).map(|_| ()).map_err(|e| e.to_string()),
                    Ok(()),
                    "an empty restore of a settled lease is no error"
                );
            }
            _ => {
                let lease = tier.query(k);
                match rng.below(3) {
                    0 => {
                        lease.release();
                    }
                    1 => drop(lease),
                    _ => {
                        tier.evict(1);
                    }
                }
            }
        }
    }
    rank.shutdown(DEADLINE).unwrap();
    verified
}

/// The client processes' entry point: does nothing unless run as a client by a test.
#[test]
fn client_role() {
    let Ok(role) = std::env::var("KVTIER_CLIENT_ROLE") else { return };
    match role.as_str() {
        // Saves FROM..TO and shares a lease with USES uses; reports its token; on "check" reports
        // the lease's state; exits when stdin closes.
        "share" => {
            let tier = connect();
            let k = keys(&tier, env_u64("FROM")..env_u64("TO"));
            let (_arenas, _rank) = save_all(&tier, &k);
            let lease = tier.query_shared(&k, env_u64("USES") as u32);
            assert_eq!(lease.len(), k.len());
            say(format!("TOKEN {}", hex(&lease.token().expect("a live lease has a token").to_bytes())));
            while let Some(cmd) = hear() {
                if cmd == "check" {
                    say(format!("LEFT {} {}", lease.uses_left(), lease.is_settled()));
                }
            }
        }
        // Opens TOKEN, restores its FROM..TO blocks into its own pages and verifies every byte.
        "open" => {
            let tier = connect();
            let token = LeaseToken::from_bytes(&unhex(&std::env::var("TOKEN").unwrap())).unwrap();
            let lease = tier.open_lease(&token).unwrap();
            let k = keys(&tier, env_u64("FROM")..env_u64("TO"));
            assert_eq!(lease.blocks().iter().map(|b| b.key).collect::<Vec<_>>(), k);
            let arenas = arenas_for(&tier);
            let rank = tier.attach(arenas.backend().unwrap()).unwrap();
            let dst: Vec<u64> = (32..32 + k.len() as u64).collect();
            rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).expect("in time").unwrap();
            arenas.verify(&dst, &k).unwrap();
            say(format!("RESTORED {} rank {}", k.len(), rank.id()));
        }
        "save" => {
            let tier = connect();
            let k = keys(&tier, env_u64("FROM")..env_u64("TO"));
            save_all(&tier, &k);
            say("SAVED");
        }
        // Saves FROM..TO, queries and restores them, verifying every byte.
        "roundtrip" => {
            let tier = connect();
            let k = keys(&tier, env_u64("FROM")..env_u64("TO"));
            let (arenas, rank) = save_all(&tier, &k);
            let lease = tier.query(&k);
            assert_eq!(lease.len(), k.len());
            let dst: Vec<u64> = (32..32 + k.len() as u64).collect();
            rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).expect("in time").unwrap();
            arenas.verify(&dst, &k).unwrap();
            say("VERIFIED");
        }
        // Starts a save of FROM..TO whose copy never ends (after scribbling over its slots).
        "stuck-save" => {
            let tier = connect();
            let k = keys(&tier, env_u64("FROM")..env_u64("TO"));
            let (arenas, rank) = stuck_rank(&tier);
            let pages: Vec<u64> = (0..k.len() as u64).collect();
            arenas.fill(&pages, &k).unwrap();
            let t = rank.save(&k, &pages, WaitFor::Nothing).unwrap();
            assert_eq!(t.saving.len(), k.len());
            until_stuck();
            say("SAVING");
            while hear().is_some() {}
            std::mem::forget(rank); // never drained: the process is killed first
        }
        // Restores FROM..TO (saved before) with a copy that never ends.
        "stuck-restore" => {
            let tier = connect();
            let k = keys(&tier, env_u64("FROM")..env_u64("TO"));
            let (_arenas, rank) = stuck_rank(&tier);
            let lease = tier.query(&k);
            assert_eq!(lease.len(), k.len());
            let dst: Vec<u64> = (32..32 + k.len() as u64).collect();
            let _h = rank.restore(&lease, &dst, WaitFor::Nothing).unwrap();
            until_stuck();
            // The restore's RestoreSubmitted (which settles the lease) is one-way: a round trip on
            // the same connection orders it before the parent reads the daemon's stats.
            let _ = tier.contains(&k[0]);
            say("RESTORING");
            while hear().is_some() {}
            std::mem::forget(rank);
        }
        "churn" => {
            let v = churn(env_u64("SEED"), env_u64("ITERS"), env_u64("KEYSPACE"));
            say(format!("DONE {v}"));
        }
        // Saves and leases 0..4, then (after the daemon restarted) checks that every call fails
        // with a typed error, reconnects and works again.
        "restart" => {
            let tier = connect();
            let k = keys(&tier, 0..4);
            let (arenas, rank) = save_all(&tier, &k);
            let lease = tier.query_shared(&k, 2);
            let token = lease.token().unwrap();
            say("READY");
            assert_eq!(hear().as_deref(), Some("go"));
            let lost = |e: TierError| assert!(matches!(e, TierError::Disconnected { .. }), "{e:?}");
            lost(tier.try_query_shared(&k, 1).unwrap_err());
            assert_eq!(tier.query(&k).len(), 0, "a lost daemon answers queries with a miss");
            // The miss is a lease settled from birth: no use, nothing to share or release, and a
            // restore from it copies nothing.
            let miss = tier.query_shared(&k, 2);
            assert_eq!((miss.is_settled(), miss.is_expired(), miss.uses_left()), (true, false, 0));
            assert!(miss.token().is_none());
            assert!(matches!(rank.restore(&miss, &[32], WaitFor::Nothing), Err(TierError::LeaseTooShort { .. })));
            rank.restore(&miss, &[], WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).expect("ready").unwrap();
            assert!(!miss.release());
            lost(rank.save(&k, &[0, 1, 2, 3], WaitFor::Nothing).unwrap_err());
            lost(rank.restore(&lease, &[32, 33], WaitFor::Nothing).unwrap_err());
            lost(tier.try_stats().unwrap_err());
            assert!(!tier.contains(&k[0]));
            assert!(lease.is_settled(), "a lease of a lost daemon counts as settled");
            match tier.attach(arenas.backend().unwrap()) {
                Err(e) => lost(e),
                Ok(_) => panic!("attach to a lost daemon succeeded"),
            }
            drop((lease, rank, tier));
            // The new daemon: an empty pool, another run (old tokens are foreign).
            let tier = connect();
            assert!(matches!(tier.open_lease(&token), Err(TierError::ForeignLease)));
            assert_eq!(tier.query(&k).len(), 0);
            let (arenas, rank) = save_all(&tier, &k);
            let lease = tier.query(&k);
            let dst = [40, 41, 42, 43];
            rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).expect("in time").unwrap();
            arenas.verify(&dst, &k).unwrap();
            say("OK");
        }
        r => panic!("unknown client role {r}"),
    }
}

fn env(pairs: &[(&str, u64)]) -> Vec<(&'static str, String)> {
    pairs
        .iter()
        .map(|&(k, v)| {
            let k: &'static str = Box::leak(k.to_string().into_boxed_str());
            (k, v.to_string())
        })
        .collect()
}

/// The test process's own view of the daemon, for stats and the audit.
fn observer(d: &Daemon) -> HostTier {
    HostTier::connect(&d.socket).unwrap()
}

fn audit(tier: &HostTier, keys: &[ContentKey]) -> kvtier::internals::AuditReport {
    kvtier::internals::remote_audit(tier, keys).unwrap().unwrap()
}

#[test]
fn one_process_saves_three_others_restore_from_one_shared_lease() {
    let d = Daemon::start(16);
    let mut sharer = Client::start(&d.socket, "share", &env(&[("FROM", 0), ("TO", 8), ("USES", 3)]));
    let token = sharer.expect("TOKEN");
    let openers: Vec<Client> = (0..3)
        .map(|_| {
            let mut e = env(&[("FROM", 0), ("TO", 8)]);
            e.push(("TOKEN", token.clone()));
            Client::start(&d.socket, "open", &e)
        })
        .collect();
    let mut ranks = Vec::new();
    for mut c in openers {
        let l = c.expect("RESTORED 8 rank");
        ranks.push(l.parse::<u32>().unwrap());
        c.finish();
    }
    ranks.sort_unstable();
    ranks.dedup();
    assert_eq!(ranks.len(), 3, "rank ids are unique across processes");
    // Each of the 3 uses was taken by one process: the lease settled.
    sharer.tell("check");
    assert_eq!(sharer.expect("LEFT"), "0 true");
    sharer.finish();
    let obs = observer(&d);
    let all = keys(&obs, 0..8);
    eventually("every lease handle is gone", || obs.stats().live_leases == 0);
    let s = obs.stats();
    assert_eq!((s.saved_blocks, s.restored_blocks, s.pinned_slots, s.writing_slots), (8, 24, 0, 0));
    assert_eq!((s.queries, s.hit_blocks), (1, 8));
    let a = audit(&obs, &all);
    assert_eq!((a.ready, a.free, a.pinned, a.writing, a.evicting), (8, 8, 0, 0, 0));
}

#[test]
fn four_processes_of_random_traffic_keep_every_invariant() {
    let d = Daemon::start_with(24, "s3fifo", None);
    let clients: Vec<Client> = (0..4)
        .map(|i| Client::start(&d.socket, "churn", &env(&[("SEED", 11 + i), ("ITERS", 120), ("KEYSPACE", 48)])))
        .collect();
    let mut verified = 0;
    for mut c in clients {
        verified += c.expect("DONE").parse::<u64>().unwrap();
        c.finish();
    }
    assert!(verified > 0);
    let obs = observer(&d);
    let all = keys(&obs, 0..48);
    eventually("every lease and pin is gone", || {
        let s = obs.stats();
        s.live_leases == 0 && s.pinned_slots == 0
    });
    let s = obs.stats();
    assert_eq!((s.writing_slots, s.quarantined_slots), (0, 0));
    assert!(s.evictions > 0, "the pool (24) is smaller than the keys (48): eviction ran");
    assert_eq!(s.restored_blocks, verified);
    let a = audit(&obs, &all);
    assert_eq!((a.pinned, a.writing, a.evicting), (0, 0, 0));
    assert_eq!(a.ready + a.free, 24, "no slot lost");
    assert_eq!(a.ready as u64, s.index_entries);
}

#[test]
fn kill_9_mid_save_and_mid_restore_loses_nothing_for_the_others() {
    let d = Daemon::start(16);
    let obs = observer(&d);
    let k = keys(&obs, 0..20);
    Client::start(&d.socket, "save", &env(&[("FROM", 0), ("TO", 4)])).finish_after("SAVED");

    let mut saver = Client::start(&d.socket, "stuck-save", &env(&[("FROM", 10), ("TO", 14)]));
    saver.expect("SAVING");
    let mut restorer = Client::start(&d.socket, "stuck-restore", &env(&[("FROM", 0), ("TO", 4)]));
    restorer.expect("RESTORING");
    let s = obs.stats();
    // The restore took its lease's only use (the lease settled); its own pins hold the slots.
    assert_eq!((s.writing_slots, s.pinned_slots, s.live_leases), (4, 4, 0));
    assert!(!obs.contains(&k[10]), "a block whose copy is in flight is invisible");

    saver.kill9();
    restorer.kill9();
    eventually("the dead processes' slots and pins come back", || {
        let s = obs.stats();
        s.writing_slots == 0 && s.pinned_slots == 0 && s.quarantined_slots == 0 && s.live_leases == 0
    });
    let a = audit(&obs, &k);
    assert_eq!((a.ready, a.free, a.writing, a.pinned), (4, 12, 0, 0), "no slot lost, no pin leaked");
    assert!((10..14).all(|i| !obs.contains(&k[i])), "the torn save never became visible");
    assert!((0..4).all(|i| obs.contains(&k[i])));
    // The slots the dead save scribbled on are reused with a new generation: saves and restores of
    // those keys (and the old ones) return the right bytes.
    Client::start(&d.socket, "roundtrip", &env(&[("FROM", 10), ("TO", 14)])).finish_after("VERIFIED");
    Client::start(&d.socket, "roundtrip", &env(&[("FROM", 0), ("TO", 12)])).finish_after("VERIFIED");
    let a = audit(&obs, &k);
    assert_eq!((a.ready, a.free, a.writing, a.pinned), (14, 2, 0, 0), "keys 0..14 resident");
}

#[test]
fn a_daemon_restart_gives_typed_errors_and_a_reconnect_works() {
    let mut d1 = Daemon::start(16);
    let mut c = Client::start(&d1.socket, "restart", &[]);
    c.expect("READY");
    d1.kill();
    let d2 = Daemon::start_with(16, "lru", Some(d1.socket.clone()));
    c.tell("go");
    c.expect("OK");
    c.finish();
    let obs = observer(&d2);
    let s = obs.stats();
    assert_eq!((s.saved_blocks, s.restored_blocks, s.live_leases), (4, 4, 0));
}

trait FinishAfter {
    fn finish_after(self, line: &str);
}

impl FinishAfter for Client {
    fn finish_after(mut self, line: &str) {
        self.expect(line);
        self.finish();
    }
}

/// The same as the host tests with CUDA arenas: a daemon and 4 engine processes on GPU 0, every
/// byte restored across processes checked by the verify kernel. Run on a GPU machine with
/// `cargo test --release -p kvtierd --features cuda --test remote -- --ignored`.
#[test]
#[ignore = "needs a CUDA GPU"]
fn gpu_four_processes_on_one_gpu_restore_each_others_blocks() {
    let cuda = || vec![("KVTIER_BACKEND", "cuda".to_string())];
    let d = Daemon::start(64);
    let mut e = cuda();
    e.extend(env(&[("FROM", 0), ("TO", 16), ("USES", 3)]));
    let mut sharer = Client::start(&d.socket, "share", &e);
    let token = sharer.expect("TOKEN");
    let openers: Vec<Client> = (0..3)
        .map(|_| {
            let mut e = cuda();
            e.extend(env(&[("FROM", 0), ("TO", 16)]));
            e.push(("TOKEN", token.clone()));
            Client::start(&d.socket, "open", &e)
        })
        .collect();
    for mut c in openers {
        c.expect("RESTORED 16 rank");
        c.finish();
    }
    sharer.tell("check");
    assert_eq!(sharer.expect("LEFT"), "0 true");
    sharer.finish();
    // 4 processes of random traffic on one GPU, every restore verified on the device.
    let clients: Vec<Client> = (0..4)
        .map(|i| {
            let mut e = cuda();
            e.extend(env(&[("SEED", 101 + i), ("ITERS", 200), ("KEYSPACE", 96)]));
            Client::start(&d.socket, "churn", &e)
        })
        .collect();
    for mut c in clients {
        assert!(c.expect("DONE").parse::<u64>().unwrap() > 0);
        c.finish();
    }
    let obs = observer(&d);
    eventually("every lease and pin is gone", || obs.stats().pinned_slots == 0);
    let a = audit(&obs, &keys(&obs, 0..96));
    assert_eq!((a.pinned, a.writing, a.evicting, a.ready + a.free), (0, 0, 0, 64));
}

/// `MemTotal` of `/proc/meminfo`, bytes.
fn mem_total() -> u64 {
    let s = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
    let kib: u64 = s
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .expect("MemTotal in /proc/meminfo");
    kib * 1024
}

/// `kvtierd` with a pool of twice `MemTotal` on plain pages (never prefaulted: nothing is
/// touched even if the check were missing), stdout and stderr piped, logging at info.
fn big_pool_daemon(socket: &std::path::Path, extra: &[&str]) -> std::process::Child {
    std::process::Command::new(support::kvtierd_bin())
        .arg("--socket")
        .arg(socket)
        .args(["--geometry", "qwen3-4b", "--backing", "plain", "--pool", &(2 * mem_total()).to_string()])
        .args(extra)
        .env("RUST_LOG", "kvtier=info,kvtierd=info")
        .env_remove("NO_COLOR")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning kvtierd")
}

/// A pool larger than physical memory is refused at start with the typed error's message (exit
/// status 1, nothing served), and is served with `--overcommit`. The log says what was asked and
/// found, and, piped, has no colour codes.
#[test]
fn a_pool_larger_than_memory_is_refused_at_start_unless_overcommitted() {
    use std::io::{BufReader, Read};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtierd.sock");
    let mut child = big_pool_daemon(&socket, &[]);
    let out = child.stdout.take().unwrap();
    if let Some(line) = support::read_line_within(BufReader::new(out), DEADLINE) {
        let _ = child.kill();
        let _ = child.wait();
        panic!("a pool of twice MemTotal must be refused at start, but the daemon serves: {line}");
    }
    let status = support::wait_exit(&mut child, "kvtierd refusing its pool", DEADLINE);
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("exceeds physical memory") && err.contains("--overcommit"), "{err}");
    assert!(err.contains("pool asked:") && err.contains("hugepages free:"), "the start-up is logged: {err}");
    assert!(!err.contains('\x1b'), "no colour codes when stderr is not a terminal: {err:?}");

    let mut child = big_pool_daemon(&socket, &["--overcommit"]);
    let out = child.stdout.take().unwrap();
    let line = support::read_line_within(BufReader::new(out), DEADLINE);
    let _ = child.kill();
    let _ = child.wait();
    let line = line.expect("with --overcommit the daemon serves the pool");
    assert!(line.starts_with("kvtierd: serving Qwen3-4B"), "{line}");
}

/// The daemon's log names a connecting process by its pid as a plain number.
#[test]
fn the_log_names_a_client_by_its_pid() {
    use std::io::{BufRead, BufReader};
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtierd.sock");
    let mut child = std::process::Command::new(support::kvtierd_bin())
        .arg("--socket")
        .arg(&socket)
        .args(["--geometry", "qwen3-4b", "--backing", "plain", "--pool", "64MiB"])
        .env("RUST_LOG", "kvtier=info,kvtierd=info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning kvtierd");
    let line = support::read_line_within(BufReader::new(child.stdout.take().unwrap()), DEADLINE);
    assert!(line.is_some_and(|l| l.starts_with("kvtierd: serving")), "the daemon did not start");
    let (tx, rx) = std::sync::mpsc::channel();
    let err = BufReader::new(child.stderr.take().unwrap());
    std::thread::spawn(move || {
        for l in err.lines().map_while(Result::ok) {
            if tx.send(l).is_err() {
                break;
            }
        }
    });
    let tier = HostTier::connect(&socket).expect("connecting");
    drop(tier);
    let (connected, gone) =
        (format!("process {} (uid", std::process::id()), format!("process {} disconnected", std::process::id()));
    let mut seen = Vec::new();
    let t0 = std::time::Instant::now();
    while !(seen.iter().any(|l: &String| l.contains(&connected)) && seen.iter().any(|l| l.contains(&gone))) {
        match rx.recv_timeout(DEADLINE.saturating_sub(t0.elapsed())) {
            Ok(l) => seen.push(l),
            Err(_) => {
                let _ = child.kill();
                panic!("no connect and disconnect lines with a plain pid within {DEADLINE:?}: {seen:#?}");
            }
        }
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(seen.iter().all(|l| !l.contains("Some(")), "{seen:#?}");
}

/// A locked pool over `RLIMIT_MEMLOCK` is refused at start, before anything is mapped or locked,
/// even with `--overcommit`. Root has `CAP_IPC_LOCK`, for which the kernel ignores the limit, so
/// the daemon runs under `setpriv --bounding-set -ipc_lock` (util-linux) where that is installed.
#[test]
fn a_locked_pool_over_rlimit_memlock_is_refused_at_start() {
    use std::io::BufReader;
    let limits = std::fs::read_to_string("/proc/self/limits").expect("/proc/self/limits");
    let soft = limits
        .lines()
        .find_map(|l| l.strip_prefix("Max locked memory"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<u64>().ok());
    let Some(soft) = soft.filter(|&l| l <= 1 << 30) else {
        eprintln!("skipping: RLIMIT_MEMLOCK is unlimited or above 1 GiB");
        return;
    };
    let Some(setpriv) = ["/usr/bin/setpriv", "/bin/setpriv"].into_iter().find(|p| std::path::Path::new(p).is_file())
    else {
        eprintln!("skipping: no setpriv to drop CAP_IPC_LOCK");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtierd.sock");
    let mut child = std::process::Command::new(setpriv)
        .args(["--bounding-set", "-ipc_lock"])
        .arg(support::kvtierd_bin())
        .arg("--socket")
        .arg(&socket)
        .args(["--geometry", "qwen3-4b", "--backing", "plain", "--mlock", "--overcommit"])
        .args(["--pool", &(soft + (16 << 20)).to_string()])
        .env("RUST_LOG", "kvtier=info,kvtierd=info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning kvtierd under setpriv");
    let out = child.stdout.take().unwrap();
    if let Some(line) = support::read_line_within(BufReader::new(out), DEADLINE) {
        let _ = child.kill();
        let _ = child.wait();
        panic!("a locked pool over RLIMIT_MEMLOCK must be refused at start, but the daemon serves: {line}");
    }
    let status = support::wait_exit(&mut child, "kvtierd refusing its locked pool", DEADLINE);
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(err.contains("exceeds RLIMIT_MEMLOCK"), "the refusal names the limit: {err}");
}
