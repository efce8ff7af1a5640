//! Hostile and clumsy clients against `kvtierd`: a raw protocol client (frames written by hand over
//! a `UnixStream`) that sends garbage, truncated, oversized and out-of-order frames, never reads
//! its replies, opens too many connections, holds more than its bounds, guesses lease ids, forks
//! and dies mid-save and mid-restore; and a daemon whose request handling panics. After each case a
//! correct engine (`HostTier::connect`) saves and restores with every byte verified, the daemon's
//! audit balances, and no slot, pin, lease or hint is left over. Every wait is bounded.

mod support;

use kvtier::internals::proto::{self, Outcome, Reply, Request, Welcome, WireError};
use kvtier::{
    ArenaSpec, BackingChoice, ContentKey, EngineArenas, Geometry, HostTier, Limit, PoolConfig, TierConfig, TierError,
    WaitFor,
};
use kvtier::{Limits, Server, ServerConfig};
use kvtier::{MemcpyArenas, MemcpyBackend};
use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};
use support::{Client, Daemon, DEADLINE};

/// How long a session's end may take to show (a killed process noticed, a timeout passed).
const SETTLE: Duration = Duration::from_secs(30);

/// Polls `cond` for at most [`SETTLE`]; panics with `what` past that.
fn soon(what: &str, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < SETTLE, "{what}: not true within {SETTLE:?}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn say(line: impl std::fmt::Display) {
    println!("{}{line}", support::ROLE_MARK);
}

fn hear() -> Option<String> {
    let mut s = String::new();
    match std::io::stdin().read_line(&mut s) {
        Ok(0) | Err(_) => None,
        Ok(_) => Some(s.trim().to_string()),
    }
}

/// A client that speaks frames by hand.
struct Raw {
    s: UnixStream,
    buf: Vec<u8>,
    welcome: Option<Welcome>,
}

impl Raw {
    fn connect(path: &Path) -> Raw {
        let s = UnixStream::connect(path).expect("connecting");
        s.set_read_timeout(Some(DEADLINE)).unwrap();
        Raw { s, buf: Vec::new(), welcome: None }
    }

    /// Says hello and reads the welcome (the memfd that rides with the marker byte is dropped by
    /// the kernel: a plain read takes no ancillary data).
    fn hello(path: &Path) -> Raw {
        let mut r = Raw::connect(path);
        r.send(&Request::Hello { magic: proto::MAGIC, version: proto::PROTOCOL_VERSION, namespace: None });
        let (marker, reply) = r.answer();
        assert_eq!(marker, proto::MARKER_POOL, "{reply:?}");
        match reply {
            Reply::Welcome(w) => r.welcome = Some(w),
            r => panic!("expected a welcome, got {r:?}"),
        }
        r
    }

    /// The hello's answer: the marker byte and the reply.
    fn answer(&mut self) -> (u8, Reply) {
        let mut m = [0u8];
        self.s.read_exact(&mut m).expect("the marker byte");
        (m[0], self.recv())
    }

    fn send(&mut self, req: &Request) {
        proto::write_frame(&mut self.s, req, &mut self.buf).expect("sending a frame");
    }

    fn recv(&mut self) -> Reply {
        proto::read_frame(&mut self.s, &mut self.buf).expect("a reply")
    }

    fn call(&mut self, req: &Request) -> Reply {
        self.send(req);
        self.recv()
    }

    fn error(&mut self, req: &Request) -> WireError {
        match self.call(req) {
            Reply::Error(e) => e,
            r => panic!("{req:?}: expected an error, got {r:?}"),
        }
    }

    /// True once the daemon has closed the connection (end of stream or reset).
    fn closed_by_daemon(&mut self) -> bool {
        let mut b = [0u8; 256];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) => return e.kind() == std::io::ErrorKind::ConnectionReset,
            }
        }
    }

    fn query(&mut self, keys: &[ContentKey], uses: u32) -> u64 {
        match self.call(&Request::Query { keys: keys.to_vec(), uses }) {
            Reply::Leased { lease, blocks, .. } => {
                assert_eq!(blocks.len(), keys.len(), "every key is resident");
                lease
            }
            r => panic!("query: {r:?}"),
        }
    }

    fn prepare(&mut self, keys: &[ContentKey]) -> (u64, Vec<u32>) {
        let req = Request::PrepareSave { keys: keys.to_vec(), prefix: false, prefix_depth: None, parent: None };
        match self.call(&req) {
            Reply::SavePrepared { save, slots, .. } => (save, slots),
            r => panic!("prepare: {r:?}"),
        }
    }
}

fn keys(tier: &HostTier, range: std::ops::Range<u64>) -> Vec<ContentKey> {
    range.map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

fn observer(socket: &Path) -> HostTier {
    HostTier::connect(socket).expect("connecting the observer")
}

/// A correct engine saves `range`'s keys, restores them from a lease and verifies every byte; the
/// daemon's audit balances afterwards (what other clients legitimately hold aside).
fn engine_is_served(socket: &Path, range: std::ops::Range<u64>) {
    let tier = HostTier::connect(socket).expect("a correct engine connects");
    let k = keys(&tier, range);
    let g = tier.geometry().with_pages(2 * k.len() as u64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(Box::new(MemcpyBackend::new(arenas.clone()))).unwrap();
    let src: Vec<u64> = (0..k.len() as u64).collect();
    arenas.fill(&src, &k).unwrap();
    let t = rank.save(&k, &src, WaitFor::Nothing).expect("the engine's save");
    t.handle.wait_timeout(DEADLINE).expect("save in time").unwrap();
    let lease = tier.query(&k);
    assert_eq!(lease.len(), k.len(), "the engine's blocks are resident");
    let dst: Vec<u64> = (k.len() as u64..2 * k.len() as u64).collect();
    rank.restore(&lease, &dst, WaitFor::Nothing).unwrap().wait_timeout(DEADLINE).expect("restore in time").unwrap();
    arenas.verify(&dst, &k).expect("the engine restores its own bytes");
    drop(lease);
    rank.shutdown(DEADLINE).unwrap();
    let a = kvtier::internals::remote_audit(&tier, &k).unwrap().expect("the audit balances");
    assert_eq!(a.evicting, 0, "{a:?}");
    assert_eq!((a.free + a.ready + a.writing) as u64, tier.capacity() as u64, "{a:?}");
}

/// [`engine_is_served`], then nothing is left over: no lease, pin, hint or `WRITING` slot.
fn served_and_clean(socket: &Path, range: std::ops::Range<u64>) {
    engine_is_served(socket, range.clone());
    let obs = observer(socket);
    nothing_left_over(&obs, &keys(&obs, range));
}

fn nothing_left_over(tier: &HostTier, k: &[ContentKey]) {
    soon("no lease, pin, hint or WRITING slot is left over", || {
        let s = tier.stats();
        s.live_leases == 0
            && s.pinned_slots == 0
            && s.writing_slots == 0
            && s.quarantined_slots == 0
            && tier.live_hints() == 0
    });
    let a = kvtier::internals::remote_audit(tier, k).unwrap().expect("the audit balances");
    assert_eq!(a.writing + a.evicting + a.pinned, 0, "{a:?}");
    assert_eq!((a.free + a.ready) as u64, tier.capacity() as u64, "{a:?}");
}

/// Threads the daemon may start on its own schedule while a metrics case runs (a CI run saw 3
/// become 4 under 500 idle connections): far below one a connection.
const SPARE_THREADS: u64 = 2;

#[test]
fn garbage_truncated_and_out_of_order_frames_get_typed_answers() {
    let d = Daemon::start(64);
    // Garbage before any hello: its "length" (an HTTP request's first bytes) is far over a hello's.
    let mut r = Raw::connect(&d.socket);
    r.s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let (m, reply) = r.answer();
    assert_eq!(m, proto::MARKER_REFUSED);
    assert!(matches!(reply, Reply::Error(WireError::LimitExceeded { limit: Limit::FrameBytes, .. })), "{reply:?}");
    assert!(r.closed_by_daemon());
    // A first message that is not a hello.
    let mut r = Raw::connect(&d.socket);
    r.send(&Request::Stats);
    let (m, reply) = r.answer();
    assert_eq!(m, proto::MARKER_REFUSED);
    assert!(matches!(reply, Reply::Error(WireError::Protocol(_))), "{reply:?}");
    // Truncated: a frame's first bytes, then the client goes.
    let mut r = Raw::hello(&d.socket);
    r.s.write_all(&[100, 0, 0, 0, 1, 2, 3]).unwrap();
    drop(r);
    // A frame that is no request: answered, and the connection goes on.
    let mut r = Raw::hello(&d.socket);
    r.s.write_all(&[3, 0, 0, 0, 250, 251, 252]).unwrap();
    assert!(matches!(r.recv(), Reply::Error(WireError::Protocol(_))));
    assert!(matches!(r.call(&Request::Stats), Reply::Stats(_)));
    // Out of order: each is protocol misuse, answered on a connection that stays usable.
    let hello = Request::Hello { magic: proto::MAGIC, version: proto::PROTOCOL_VERSION, namespace: None };
    for req in [
        hello,
        Request::FinishSave { save: 7, outcome: Outcome::Done, latency_ns: None },
        Request::FinishRestore { restore: 7, outcome: Outcome::Done, latency_ns: None },
    ] {
        assert!(matches!(r.error(&req), WireError::Protocol(_)), "misuse not answered Protocol: {req:?}");
    }
    // A double finish.
    let obs = observer(&d.socket);
    let k = keys(&obs, 1000..1002);
    let (save, slots) = r.prepare(&k);
    assert_eq!(slots.len(), 2);
    assert_eq!(r.call(&Request::FinishSave { save, outcome: Outcome::Failed, latency_ns: None }), Reply::Done);
    assert!(matches!(
        r.error(&Request::FinishSave { save, outcome: Outcome::Failed, latency_ns: None }),
        WireError::Protocol(_)
    ));
    // Leases it was never given.
    assert_eq!(r.error(&Request::Restore { lease: 1, blocks: 1 }), WireError::ForeignLease);
    assert_eq!(r.error(&Request::ReleaseLease { lease: 2 }), WireError::ForeignLease);
    // The client reads the misuse as its own typed error, not as a lost connection.
    assert!(matches!(TierError::from(WireError::Protocol("x".into())), TierError::Protocol { .. }));
    assert!(matches!(r.call(&Request::Stats), Reply::Stats(_)));
    drop(r);
    served_and_clean(&d.socket, 0..8);
}

#[test]
fn oversized_frames_and_requests_over_a_bound_are_refused_and_the_connection_kept() {
    let d = Daemon::start_args(
        64,
        "lru",
        None,
        &["--max-frame-bytes", "65536", "--max-keys-per-request", "64", "--max-lease-uses", "8"],
    );
    let mut r = Raw::hello(&d.socket);
    let w = r.welcome.clone().unwrap();
    assert_eq!(w.limits.frame_bytes, 65536, "the welcome states the limits");
    assert_eq!(w.limits.keys_per_request, 64);
    // A 1 MiB frame: read and discarded, answered, and the connection stays in step.
    let mut frame = (1u32 << 20).to_le_bytes().to_vec();
    frame.resize(4 + (1 << 20), 0xAB);
    r.s.write_all(&frame).unwrap();
    match r.recv() {
        Reply::Error(WireError::LimitExceeded { limit: Limit::FrameBytes, asked, max }) => {
            assert_eq!((asked, max), (1 << 20, 65536));
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(r.call(&Request::Stats), Reply::Stats(_)));
    let obs = observer(&d.socket);
    let many = keys(&obs, 0..65);
    for req in [
        Request::Query { keys: many.clone(), uses: 1 },
        Request::PrepareSave { keys: many.clone(), prefix: true, prefix_depth: None, parent: None },
        Request::Hint { keys: many.clone(), ttl_ms: 1000 },
        Request::Audit { keys: many.clone() },
    ] {
        match r.error(&req) {
            WireError::LimitExceeded { limit: Limit::KeysPerRequest, asked: 65, max: 64 } => {}
            e => panic!("{}: {e:?}", req.name()),
        }
    }
    match r.error(&Request::Query { keys: many[..2].to_vec(), uses: 9 }) {
        WireError::LimitExceeded { limit: Limit::LeaseUses, asked: 9, max: 8 } => {}
        e => panic!("{e:?}"),
    }
    // Evicting more blocks than exist is evicting all of them, never an allocation of that size.
    assert!(matches!(r.call(&Request::Evict { blocks: u64::MAX }), Reply::Count(0)));
    // One key named 64 times: the lease ends before the first repeat (one pin per slot).
    engine_is_served(&d.socket, 100..101);
    let one = keys(&obs, 100..101);
    match r.call(&Request::Query { keys: vec![one[0]; 64], uses: 1 }) {
        Reply::Leased { lease, blocks, .. } => {
            assert_eq!(blocks.len(), 1);
            assert_eq!(obs.stats().pinned_slots, 1);
            r.send(&Request::DropLease { lease });
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(r.call(&Request::Stats), Reply::Stats(_)));
    drop(r);
    served_and_clean(&d.socket, 0..8);
}

#[test]
fn a_length_prefix_alone_makes_the_daemon_hold_no_memory() {
    // 16 held connections, the observer's and the engine's from this one process.
    let d = Daemon::start_args(64, "lru", None, &["--max-connections-per-process", "32"]);
    let before = d.rss_bytes();
    // 16 connections announce the largest frames, then send 64 bytes and wait. Before any hello a
    // large announcement is refused at once; after a hello the buffer grows only with the bytes.
    let mut held = Vec::new();
    for i in 0..16 {
        if i % 2 == 0 {
            let mut r = Raw::connect(&d.socket);
            let mut f = (proto::MAX_FRAME as u32).to_le_bytes().to_vec();
            f.extend_from_slice(&[0u8; 60]);
            r.s.write_all(&f).unwrap();
            let (m, _) = r.answer();
            assert_eq!(m, proto::MARKER_REFUSED);
            held.push(r);
        } else {
            let mut r = Raw::hello(&d.socket);
            let mut f = ((24u32 << 20) - 1).to_le_bytes().to_vec();
            f.extend_from_slice(&[0u8; 60]);
            r.s.write_all(&f).unwrap();
            held.push(r);
        }
    }
    // The connections' threads read their prefixes at their own pace: watch the daemon's size for
    // a while (a buffer sized to the announced length would be 8 x 24 MiB of zeroes).
    let obs = observer(&d.socket);
    let _ = obs.stats();
    for _ in 0..50 {
        let grown = d.rss_bytes().saturating_sub(before);
        assert!(grown < 64 << 20, "16 length prefixes grew the daemon by {grown} B");
        std::thread::sleep(Duration::from_millis(10));
    }
    drop(held);
    served_and_clean(&d.socket, 0..8);
}

#[test]
fn connections_over_the_limit_are_refused_and_silent_ones_closed_at_the_hello_deadline() {
    let d = Daemon::start_args(64, "lru", None, &["--max-connections", "3", "--hello-timeout", "1"]);
    let held: Vec<Raw> = (0..3).map(|_| Raw::hello(&d.socket)).collect();
    match HostTier::connect(&d.socket) {
        Err(kvtier::Error::Tier(TierError::LimitExceeded { limit: Limit::Connections, max: 3, .. })) => {}
        Err(e) => panic!("expected a typed refusal, got {e}"),
        Ok(_) => panic!("a fourth connection was served with a limit of 3"),
    }
    drop(held);
    // Connections that never say hello are closed at the hello deadline: their places free up.
    let mut silent: Vec<Raw> = (0..3).map(|_| Raw::connect(&d.socket)).collect();
    for r in &mut silent {
        assert!(r.closed_by_daemon(), "a silent connection is closed");
    }
    soon("a correct engine connects once the others are gone", || HostTier::connect(&d.socket).is_ok());
    served_and_clean(&d.socket, 0..8);
}

#[test]
fn a_client_that_never_reads_its_replies_is_dropped_with_everything_it_held() {
    let d = Daemon::start_args(64, "lru", None, &["--write-timeout", "1"]);
    engine_is_served(&d.socket, 0..4);
    let obs = observer(&d.socket);
    let k = keys(&obs, 0..4);
    let mut r = Raw::hello(&d.socket);
    let lease = r.query(&k, 2);
    assert_ne!(lease, 0);
    assert!(matches!(r.call(&Request::Hint { keys: k.clone(), ttl_ms: 3_600_000 }), Reply::Count(_)));
    let (_save, slots) = r.prepare(&keys(&obs, 500..502));
    assert_eq!(slots.len(), 2);
    assert_eq!(obs.stats().live_leases, 1);
    // Requests, never a read: the daemon's replies fill the socket, its write times out, and the
    // connection goes. The client's own writes then fail (bounded by its write timeout).
    r.s.set_write_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut frame = Vec::new();
    proto::encode(&Request::Stats, &mut frame).unwrap();
    let t0 = Instant::now();
    while r.s.write_all(&frame).is_ok() {
        assert!(t0.elapsed() < DEADLINE, "the daemon kept a connection that never reads");
    }
    // The lease and hint went with the connection; the save's slots stay WRITING while this
    // process (which could still be copying into them) lives.
    soon("the lease and the hint are gone", || obs.stats().live_leases == 0 && obs.live_hints() == 0);
    assert_eq!(obs.stats().pinned_slots, 0);
    assert_eq!(obs.stats().quarantined_slots, 2, "the dropped save's slots are withheld, not reused");
    drop(r);
    engine_is_served(&d.socket, 8..16);
}

#[test]
fn hints_leases_and_copies_are_bounded_per_connection_and_go_with_it() {
    let d = Daemon::start_args(
        64,
        "lru",
        None,
        &["--max-hints", "2", "--max-hint-keys", "10", "--max-leases", "2", "--max-copies", "2"],
    );
    engine_is_served(&d.socket, 0..4);
    let obs = observer(&d.socket);
    let k = keys(&obs, 0..12);
    let mut r = Raw::hello(&d.socket);
    // Hints: a key named twice counts once; 2 hints, 10 distinct keys.
    let twice: Vec<ContentKey> = k[..4].iter().chain(&k[..4]).copied().collect();
    assert!(matches!(r.call(&Request::Hint { keys: twice, ttl_ms: 3_600_000 }), Reply::Count(_)));
    match r.error(&Request::Hint { keys: k[..7].to_vec(), ttl_ms: 3_600_000 }) {
        WireError::LimitExceeded { limit: Limit::HintKeysPerConnection, asked: 11, max: 10 } => {}
        e => panic!("{e:?}"),
    }
    let id = match r.call(&Request::Hint { keys: k[..6].to_vec(), ttl_ms: 3_600_000 }) {
        Reply::Count(id) => id,
        other => panic!("{other:?}"),
    };
    match r.error(&Request::Hint { keys: k[..1].to_vec(), ttl_ms: 3_600_000 }) {
        WireError::LimitExceeded { limit: Limit::HintsPerConnection, asked: 3, max: 2 } => {}
        e => panic!("{e:?}"),
    }
    // Another connection cannot withdraw this one's hint.
    let mut other = Raw::hello(&d.socket);
    assert_eq!(other.call(&Request::WithdrawHint { id }), Reply::Bool(false));
    assert_eq!(obs.live_hints(), 2);
    // Leases: two handles.
    r.query(&k[..2], 1);
    r.query(&k[2..4], 1);
    match r.error(&Request::Query { keys: k[..1].to_vec(), uses: 1 }) {
        WireError::LimitExceeded { limit: Limit::LeasesPerConnection, asked: 3, max: 2 } => {}
        e => panic!("{e:?}"),
    }
    // Copies: two saves in flight.
    r.prepare(&keys(&obs, 100..101));
    r.prepare(&keys(&obs, 101..102));
    let req = Request::PrepareSave { keys: keys(&obs, 102..103), prefix: false, prefix_depth: None, parent: None };
    match r.error(&req) {
        WireError::LimitExceeded { limit: Limit::CopiesPerConnection, asked: 3, max: 2 } => {}
        e => panic!("{e:?}"),
    }
    assert_eq!(obs.stats().live_leases, 2);
    // The connection ends (its process lives on: the saves' slots wait for it).
    drop(r);
    soon("the connection's hints and leases are gone", || {
        obs.live_hints() == 0 && obs.stats().live_leases == 0 && obs.stats().pinned_slots == 0
    });
    assert_eq!(obs.stats().quarantined_slots, 2, "the saves' slots wait for the process");
    drop(other);
}

#[test]
fn leased_blocks_are_bounded_per_connection_counting_opened_leases() {
    let d = Daemon::start_args(64, "lru", None, &["--max-leased-blocks", "6"]);
    engine_is_served(&d.socket, 0..4);
    let obs = observer(&d.socket);
    let k = keys(&obs, 0..4);
    let mut r = Raw::hello(&d.socket);
    let lease = r.query(&k, 1);
    match r.call(&Request::Query { keys: k.clone(), uses: 1 }) {
        Reply::Error(WireError::LimitExceeded { limit: Limit::LeasedBlocksPerConnection, asked: 8, max: 6 }) => {}
        other => panic!("a query over the connection's leased blocks was served: {other:?}"),
    }
    // Another connection's lease counts the same once opened here.
    let mut other = Raw::hello(&d.socket);
    let theirs = other.query(&k[..3], 1);
    let instance = r.welcome.as_ref().unwrap().instance;
    match r.call(&Request::OpenLease { instance, lease: theirs }) {
        Reply::Error(WireError::LimitExceeded { limit: Limit::LeasedBlocksPerConnection, asked: 7, max: 6 }) => {}
        other => panic!("an opened lease over the connection's leased blocks was served: {other:?}"),
    }
    assert_eq!(obs.stats().live_leases, 2, "the refusals leased nothing");
    // Dropping a handle gives its blocks back.
    r.send(&Request::DropLease { lease }); // one-way
    assert!(matches!(r.call(&Request::OpenLease { instance, lease: theirs }), Reply::Leased { .. }));
    r.query(&k[..3], 1);
    drop(r);
    drop(other);
    served_and_clean(&d.socket, 8..14);
}

#[test]
fn lease_ids_cannot_be_guessed_and_another_runs_token_is_refused() {
    let d = Daemon::start(64);
    engine_is_served(&d.socket, 0..4);
    let obs = observer(&d.socket);
    let k = keys(&obs, 0..4);
    let mut owner = Raw::hello(&d.socket);
    let lease = owner.query(&k, 1);
    let mut thief = Raw::hello(&d.socket);
    let instance = thief.welcome.as_ref().unwrap().instance;
    // Ids are random 64-bit numbers: none of the first 2,000 is a lease (a chance of 2^-53).
    for guess in (1..=2000u64).chain([lease.wrapping_add(1), lease.wrapping_sub(1)]) {
        match thief.call(&Request::OpenLease { instance, lease: guess }) {
            Reply::Error(WireError::LeaseSettled) => {}
            other => panic!("lease {guess} opened by guessing: {other:?}"),
        }
        assert_eq!(thief.error(&Request::ReleaseLease { lease: guess }), WireError::ForeignLease);
    }
    // The right id with another daemon run's number is refused.
    assert_eq!(thief.error(&Request::OpenLease { instance: instance ^ 1, lease }), WireError::ForeignLease);
    // The owner's lease is untouched.
    match owner.call(&Request::LeaseInfo { lease }) {
        Reply::LeaseInfo { settled: false, uses_left: 1, .. } => {}
        other => panic!("{other:?}"),
    }
    drop(owner);
    drop(thief);
    nothing_left_over(&obs, &k);
}

/// The process a client forked for a test (by its id), killed when the test ends, however it ends.
struct KillOnDrop(i32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        // SAFETY: kill of the one process the client forked for this test, by its id.
        unsafe { libc::kill(self.0, libc::SIGKILL) };
    }
}

#[test]
fn connect_then_fork_then_kill_9_of_the_parent_ends_its_session() {
    let d = Daemon::start(64);
    engine_is_served(&d.socket, 0..4);
    let obs = observer(&d.socket);
    let mut c = Client::start(&d.socket, "fork-and-hold", &[]);
    let child = KillOnDrop(c.expect("FORKED").parse().unwrap());
    assert_eq!(obs.stats().live_leases, 1);
    assert_eq!(obs.live_hints(), 1);
    c.kill9();
    soon("the session of the killed parent ends although its forked child holds the socket", || {
        obs.stats().live_leases == 0 && obs.stats().pinned_slots == 0 && obs.live_hints() == 0
    });
    // SAFETY: signal 0 only checks that the client's forked child exists.
    let alive = unsafe { libc::kill(child.0, 0) } == 0;
    drop(child);
    assert!(alive, "the forked child was alive while the session ended");
    nothing_left_over(&obs, &keys(&obs, 0..4));
    served_and_clean(&d.socket, 8..16);
}

#[test]
fn a_client_killed_mid_save_and_mid_restore_loses_nothing_for_the_others() {
    let d = Daemon::start(64);
    engine_is_served(&d.socket, 0..4);
    let obs = observer(&d.socket);
    let mut c = Client::start(&d.socket, "hold-copies", &[]);
    c.expect("HOLDING");
    let s = obs.stats();
    assert_eq!((s.writing_slots, s.pinned_slots), (3, 4), "{s:?}");
    c.kill9();
    soon("the killed client's slots and pins come back", || {
        let s = obs.stats();
        s.writing_slots == 0 && s.pinned_slots == 0 && s.live_leases == 0
    });
    nothing_left_over(&obs, &keys(&obs, 0..4));
    served_and_clean(&d.socket, 8..16);
}

/// File descriptors the daemon holds open now.
fn daemon_fds(d: &Daemon) -> usize {
    std::fs::read_dir(format!("/proc/{}/fd", d.child.id())).expect("the daemon's fds").count()
}

#[test]
fn a_process_that_parks_slot_after_slot_stops_at_its_bound_and_holds_one_pidfd() {
    // More slots than the cycles, so only the per-process bound stops the parking.
    let d = Daemon::start_args(
        2100,
        "lru",
        None,
        &["--max-slots-per-process", "16", "--max-connections-per-process", "256"],
    );
    engine_is_served(&d.socket, 0..4);
    let obs = observer(&d.socket);
    let fds_before = daemon_fds(&d);
    let mut c = Client::start(&d.socket, "park-loop", &[("KVTIER_CYCLES", "2000".into())]);
    let done = c.expect("DONE");
    let f: Vec<u64> = done.split(' ').map(|x| x.parse().unwrap_or(u64::MAX)).collect();
    assert_eq!(f[0], 1, "a save over the process's slot bound was not refused typed: {done}");
    assert_eq!(f[1], 0, "the refused save reserved slots: {done}");
    assert_eq!((f[2], f[3]), (16, 1984), "parked and refused cycles: {done}");
    soon("the disconnected sessions have ended", || obs.stats().quarantined_slots == 16);
    // One pidfd for the parking process however many connections parked: the daemon's fds stay
    // near what it held before (the observer's and the engine's connections aside).
    soon("the parked sessions hold one pidfd", || daemon_fds(&d) <= fds_before + 8);
    // The daemon goes on accepting; a correct engine (another process's bound) is served.
    engine_is_served(&d.socket, 20..36);
    c.kill9();
    soon("the killed process's parked slots come back", || obs.stats().quarantined_slots == 0);
    served_and_clean(&d.socket, 40..56);
}

#[test]
fn one_process_cannot_take_every_connection() {
    let d = Daemon::start_args(64, "lru", None, &["--max-connections", "8", "--max-connections-per-process", "4"]);
    // A process tries to open every connection the daemon serves (its observer is one of them).
    let mut hog = Client::start(&d.socket, "hog", &[("KVTIER_CONNS", "8".into())]);
    let held = hog.expect("HOLDING");
    assert_eq!(
        held, "3 refused 5 other 0",
        "the process's connections beyond its 4 must be refused typed (ConnectionsPerProcess, max 4)"
    );
    // Another process is served while the first holds every connection it may.
    engine_is_served(&d.socket, 0..4);
    // The first process's closed connections count no more: it opens its bound again.
    hog.tell("close");
    assert_eq!(hog.expect("REOPENED"), "3", "connections closed still counted against the process");
    hog.kill9();
    served_and_clean(&d.socket, 8..16);
}

// ---- The metrics port (`--metrics`): TCP, so beyond the socket's same-uid trust model.

/// The metrics address the daemon printed (`..., metrics at http://ADDR/metrics`).
fn metrics_addr(d: &Daemon) -> String {
    let at = d.line.split("metrics at http://").nth(1).unwrap_or_else(|| panic!("no metrics address in {:?}", d.line));
    at.strip_suffix("/metrics").expect("the address ends with /metrics").to_string()
}

/// A field of the daemon's `/proc/PID/status` (the number before any unit).
fn daemon_status(d: &Daemon, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{}/status", d.child.id())).expect("the daemon's status");
    let line = status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in the status"));
    line.split_whitespace().nth(1).and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("{line}"))
}

/// The daemon's descriptors once two counts 100 ms apart agree (a connection just answered may
/// still be closing).
fn settled_fds(d: &Daemon) -> usize {
    let mut n = daemon_fds(d);
    loop {
        std::thread::sleep(Duration::from_millis(100));
        let m = daemon_fds(d);
        if m == n {
            return n;
        }
        n = m;
    }
}

fn daemon_threads(d: &Daemon) -> u64 {
    daemon_status(d, "Threads:")
}

/// `GET /healthz` on a fresh connection, answered within `within`: the status code, or why not.
fn healthz(addr: &str, within: Duration) -> Result<u16, String> {
    let t0 = Instant::now();
    let mut s = std::net::TcpStream::connect(addr).map_err(|e| format!("connecting: {e}"))?;
    s.set_read_timeout(Some(within)).unwrap();
    s.set_write_timeout(Some(within)).unwrap();
    write!(s, "GET /healthz HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    let mut b = [0u8; 4096];
    loop {
        match s.read(&mut b) {
            Ok(0) => break,
            Ok(n) => raw.extend_from_slice(&b[..n]),
            Err(e) => return Err(format!("no answer after {:?}: {e}", t0.elapsed())),
        }
        if t0.elapsed() > within {
            return Err(format!("no complete answer within {within:?}"));
        }
    }
    let text = String::from_utf8_lossy(&raw);
    text.split(' ').nth(1).and_then(|c| c.parse().ok()).ok_or_else(|| format!("no status in {text:?}"))
}

/// `/healthz` answers 200 within 3 s (a liveness probe's patience, with room for a loaded machine).
fn healthz_answers(addr: &str, during: &str) {
    match healthz(addr, Duration::from_secs(3)) {
        Ok(200) => {}
        other => panic!("/healthz did not answer while {during}: {other:?}"),
    }
}

/// True once the peer has closed `s` (end of stream or reset), reading whatever it sent; false if
/// it is still open after `within`.
fn tcp_closed_within(s: &mut std::net::TcpStream, within: Duration) -> bool {
    let t0 = Instant::now();
    s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
    let mut b = [0u8; 64 << 10];
    while t0.elapsed() < within {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {}
            Err(_) => return true,
        }
    }
    false
}

/// The daemon's threads and memory are back near `(threads, rss)` (a correct engine's and the
/// observer's connections aside): at most 2 threads and 32 MiB more.
fn back_to(d: &Daemon, (threads, rss): (u64, u64)) {
    soon("the daemon's threads are back to what they were", || daemon_threads(d) <= threads + SPARE_THREADS);
    let grown = d.rss_bytes().saturating_sub(rss);
    assert!(grown < 32 << 20, "the daemon stayed {grown} B larger");
}

#[test]
fn half_requests_to_the_metrics_port_hold_no_thread_and_are_closed_at_the_timeout() {
    let d = Daemon::start_args(64, "lru", None, &["--metrics", "127.0.0.1:0", "--metrics-timeout", "1"]);
    let addr = metrics_addr(&d);
    healthz_answers(&addr, "nobody else was connected");
    let before = (daemon_threads(&d), d.rss_bytes());
    // 8 half requests (under the connection bound): each is closed at the timeout.
    let mut half: Vec<std::net::TcpStream> = (0..8)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(&addr).unwrap();
            s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n").unwrap();
            s
        })
        .collect();
    healthz_answers(&addr, "8 half requests were open");
    assert!(
        daemon_threads(&d) <= before.0 + SPARE_THREADS,
        "8 half requests took {} threads",
        daemon_threads(&d).saturating_sub(before.0)
    );
    engine_is_served(&d.socket, 0..8);
    for s in &mut half {
        assert!(tcp_closed_within(s, Duration::from_secs(10)), "a half request was not closed at the 1 s timeout");
    }
    drop(half);
    healthz_answers(&addr, "the half requests had gone");
    served_and_clean(&d.socket, 8..16);
    back_to(&d, before);
}

#[test]
fn many_idle_connections_to_the_metrics_port_hold_one_thread_and_at_most_the_bound() {
    // A timeout longer than the test: only the connection bound closes connections here.
    let d = Daemon::start_args(
        64,
        "lru",
        None,
        &["--metrics", "127.0.0.1:0", "--metrics-connections", "16", "--metrics-timeout", "120"],
    );
    let addr = metrics_addr(&d);
    healthz_answers(&addr, "nobody else was connected");
    let before = (daemon_threads(&d), d.rss_bytes());
    let fds = settled_fds(&d);
    // 500 idle connections: one thread serves them all, and past 16 the oldest are closed.
    let mut idle = Vec::new();
    for i in 0..500 {
        idle.push(std::net::TcpStream::connect(&addr).unwrap_or_else(|e| panic!("connection {i}: {e}")));
    }
    // The daemon may start a thread of its own meanwhile (its reaper, a runtime worker): the
    // bound is a constant, not one thread a connection (500 here).
    let threads = daemon_threads(&d);
    assert!(
        threads <= before.0 + SPARE_THREADS,
        "500 idle connections took the daemon from {} to {threads} threads",
        before.0
    );
    soon("the daemon holds at most 16 metrics connections", || daemon_fds(&d) <= fds + 16 + 2);
    healthz_answers(&addr, "500 idle connections were open");
    assert!(daemon_fds(&d) <= fds + 16 + 2, "the daemon holds {} sockets more than before", daemon_fds(&d) - fds);
    engine_is_served(&d.socket, 0..8);
    drop(idle);
    healthz_answers(&addr, "the idle connections had gone");
    served_and_clean(&d.socket, 8..16);
    back_to(&d, before);
}

#[test]
fn a_metrics_client_that_pipelines_and_never_reads_delays_nobody_and_is_dropped() {
    // A timeout far above the probes' patience: only serving connections side by side answers them.
    let d = Daemon::start_args(64, "lru", None, &["--metrics", "127.0.0.1:0", "--metrics-timeout", "10"]);
    let addr = metrics_addr(&d);
    healthz_answers(&addr, "nobody else was connected");
    let before = (daemon_threads(&d), d.rss_bytes());
    let fds = settled_fds(&d);
    // Requests for the largest answer until the socket takes no more (the daemon's answers fill
    // the client's receive buffer, then the daemon stops reading), bounded in count and time.
    let mut p = std::net::TcpStream::connect(&addr).unwrap();
    p.set_nonblocking(true).unwrap();
    let req = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n";
    let (mut sent, t0) = (0usize, Instant::now());
    let mut stalled = 0;
    while sent < 200_000 && t0.elapsed() < Duration::from_secs(20) && stalled < 50 {
        match p.write(req) {
            Ok(_) => {
                sent += 1;
                stalled = 0;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                stalled += 1;
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(e) => panic!("pipelining: {e} after {sent} requests"),
        }
    }
    assert!(stalled >= 50 || sent == 200_000, "the pipelining client never filled its socket");
    for _ in 0..3 {
        healthz_answers(&addr, "a client pipelined requests and never read");
    }
    engine_is_served(&d.socket, 0..8);
    // The daemon drops the client at the write timeout (10 s), however much it asked.
    assert!(daemon_fds(&d) > fds, "the daemon holds no socket for the pipelining client");
    soon("the non-reading client's connection is closed", || daemon_fds(&d) <= fds);
    drop(p);
    healthz_answers(&addr, "the pipelining client had gone");
    served_and_clean(&d.socket, 8..16);
    back_to(&d, before);
}

// ---- Hints over every connection.

#[test]
fn hints_are_bounded_in_bytes_over_every_connection_and_their_memory_returns() {
    // 2^18 keys a hint: about 30 MB charged (114 B a key); 64 MiB hold two such hints.
    let per = 1usize << 18;
    let budget = 64usize << 20;
    let d = Daemon::start_args(64, "lru", None, &["--max-hint-bytes", &budget.to_string()]);
    let obs = observer(&d.socket);
    let before = d.rss_bytes();
    let hint = |c: u64| Request::Hint {
        keys: (0..per as u64).map(|i| obs.namespace().trace_page_key(i, c)).collect(),
        ttl_ms: 600_000,
    };
    let mut conns: Vec<Raw> = (0..3).map(|_| Raw::hello(&d.socket)).collect();
    let mut ids = Vec::new();
    for (i, r) in conns.iter_mut().enumerate().take(2) {
        match r.call(&hint(i as u64)) {
            Reply::Count(id) if id != 0 => ids.push(id),
            other => panic!("hint {i} within the budget: {other:?}"),
        }
    }
    let peak = d.rss_bytes();
    // The third connection's hint is over the bytes of every connection's hints together.
    match conns[2].call(&hint(2)) {
        Reply::Error(WireError::LimitExceeded { limit: Limit::HintBytes, asked, max }) => {
            assert_eq!(max, budget as u64);
            assert!(asked > max, "{asked} {max}");
        }
        other => panic!("a hint over the daemon's hint bytes was taken: {other:?}"),
    }
    assert_eq!(obs.live_hints(), 2);
    // A connected tier gets the refusal typed (try_hint), never a silent id 0.
    let k: Vec<ContentKey> = (0..per as u64).map(|i| obs.namespace().trace_page_key(i, 9)).collect();
    match obs.try_hint(&k, Duration::from_secs(60)) {
        Err(TierError::LimitExceeded { limit: Limit::HintBytes, max, .. }) => assert_eq!(max, budget as u64),
        other => panic!("a connected tier's hint over the bytes: {other:?}"),
    }
    // Withdrawn, the hints give their memory back.
    for (r, id) in conns.iter_mut().zip(&ids) {
        assert_eq!(r.call(&Request::WithdrawHint { id: *id }), Reply::Bool(true));
    }
    assert_eq!(obs.live_hints(), 0);
    let after = d.rss_bytes();
    assert!(peak > before + (budget as u64) / 4, "two hints of 2^18 keys grew the daemon by {} B only", peak - before);
    assert!(
        after < before + (24 << 20),
        "memory stayed resident after every hint was withdrawn: {} B then {} B more than before",
        peak - before,
        after.saturating_sub(before)
    );
    // Room again for a hint as large.
    assert!(matches!(conns[2].call(&hint(2)), Reply::Count(id) if id != 0));
    drop(conns);
    served_and_clean(&d.socket, 0..8);
}

// ---- Slots being written over every process.

#[test]
fn two_processes_that_never_finish_their_saves_leave_the_others_their_share() {
    // The per-process bound at its default (half the pool): two such processes held every slot.
    let d = Daemon::start_args(64, "lru", None, &["--max-slots-per-process", "32"]);
    // This process is connected first: its fair share is reserved for it.
    let obs = observer(&d.socket);
    let mut hogs: Vec<Client> =
        (0..2).map(|i| Client::start(&d.socket, "hold-writing", &[("KVTIER_TAG", (i + 1).to_string())])).collect();
    for h in &mut hogs {
        h.expect("READY");
    }
    for h in &mut hogs {
        h.tell("go");
    }
    let mut held = 0;
    for h in &mut hogs {
        let line = h.expect("HOLDING");
        let (n, why) = line.split_once(' ').unwrap();
        held += n.parse::<u64>().unwrap();
        assert!(why.contains("WritingSlots") || why.contains("SlotsPerProcess"), "{line}");
    }
    // Three processes connected: a fair share is 64 / 3 = 21 slots.
    assert!(held <= 64 - 21, "two processes that never finish held {held} of 64 slots writing");
    assert_eq!(obs.stats().writing_slots, held);
    engine_is_served(&d.socket, 0..8);
    for h in hogs {
        h.kill9();
    }
    soon("the killed processes' slots come back", || obs.stats().writing_slots == 0);
    served_and_clean(&d.socket, 8..24);
}

/// The client processes' entry point: does nothing unless run as a client by a test.
#[test]
fn client_role() {
    let Ok(role) = std::env::var("KVTIER_CLIENT_ROLE") else { return };
    let socket = std::path::PathBuf::from(std::env::var("KVTIER_SOCKET").unwrap());
    let obs = observer(&socket);
    match role.as_str() {
        // Leases 4 blocks and hints them, forks a child that holds the socket and sleeps, reports
        // the child's pid and waits to be killed.
        "fork-and-hold" => {
            let mut r = Raw::hello(&socket);
            r.query(&keys(&obs, 0..4), 1);
            assert!(matches!(r.call(&Request::Hint { keys: keys(&obs, 0..4), ttl_ms: 3_600_000 }), Reply::Count(_)));
            drop(obs);
            // SAFETY: the child only calls pause (async-signal-safe) until it is killed.
            let pid = unsafe { libc::fork() };
            if pid == 0 {
                loop {
                    // SAFETY: pause takes nothing.
                    unsafe { libc::pause() };
                }
            }
            assert!(pid > 0, "fork failed");
            say(format!("FORKED {pid}"));
            while hear().is_some() {}
        }
        // Asks for more slots than its process may hold, then reconnects `KVTIER_CYCLES` times,
        // each time preparing a 1-block save and disconnecting without finishing it (the slot is
        // withheld until the process exits); reports what was served and waits to be killed.
        "park-loop" => {
            let cycles: u64 = std::env::var("KVTIER_CYCLES").unwrap().parse().unwrap();
            let mut r = Raw::hello(&socket);
            let big =
                Request::PrepareSave { keys: keys(&obs, 5000..5017), prefix: true, prefix_depth: None, parent: None };
            let big_refused = matches!(
                r.call(&big),
                Reply::Error(WireError::LimitExceeded { limit: Limit::SlotsPerProcess, asked: 17, max: 16 })
            );
            let writing_after_refusal = obs.stats().writing_slots;
            drop(r);
            let (mut parked, mut refused) = (0, 0);
            for i in 0..cycles {
                let mut r = Raw::hello(&socket);
                let req = Request::PrepareSave {
                    keys: keys(&obs, 10_000 + i..10_001 + i),
                    prefix: false,
                    prefix_depth: None,
                    parent: None,
                };
                match r.call(&req) {
                    Reply::SavePrepared { slots, .. } if slots.len() == 1 => parked += 1,
                    // Past the per-process bound, or (that bound seeded away) past the process's
                    // fair share of the slots being written over every process.
                    Reply::Error(WireError::LimitExceeded {
                        limit: Limit::SlotsPerProcess | Limit::WritingSlots,
                        ..
                    }) => refused += 1,
                    other => panic!("cycle {i}: {other:?}"),
                }
            }
            say(format!("DONE {} {writing_after_refusal} {parked} {refused}", big_refused as u8));
            while hear().is_some() {}
        }
        // A save of 3 blocks prepared and a restore of 4 blocks pinned, neither finished; waits to
        // be killed.
        "hold-copies" => {
            let mut r = Raw::hello(&socket);
            let (_save, slots) = r.prepare(&keys(&obs, 200..203));
            assert_eq!(slots.len(), 3);
            let lease = r.query(&keys(&obs, 0..4), 1);
            let restore = match r.call(&Request::Restore { lease, blocks: 4 }) {
                Reply::Restoring { restore, slots } => {
                    assert_eq!(slots.len(), 4);
                    restore
                }
                other => panic!("{other:?}"),
            };
            r.send(&Request::RestoreSubmitted { restore });
            assert!(matches!(r.call(&Request::Stats), Reply::Stats(_)));
            say("HOLDING");
            while hear().is_some() {}
        }
        // Opens `KVTIER_CONNS` connections with hellos and holds them; reports how many were
        // served and how many refused with `ConnectionsPerProcess`; on "close" closes them and
        // opens as many as were served again, reporting that count.
        "hog" => {
            let n: usize = std::env::var("KVTIER_CONNS").unwrap().parse().unwrap();
            let open = |socket: &Path| -> Result<Raw, WireError> {
                let mut r = Raw::connect(socket);
                r.send(&Request::Hello { magic: proto::MAGIC, version: proto::PROTOCOL_VERSION, namespace: None });
                match r.answer() {
                    (proto::MARKER_POOL, Reply::Welcome(_)) => Ok(r),
                    (_, Reply::Error(e)) => Err(e),
                    (m, other) => panic!("hello answered {m} {other:?}"),
                }
            };
            let (mut held, mut refused, mut others) = (Vec::new(), 0, 0);
            for _ in 0..n {
                match open(&socket) {
                    Ok(r) => held.push(r),
                    Err(WireError::LimitExceeded { limit: Limit::ConnectionsPerProcess, max: 4, .. }) => refused += 1,
                    Err(_) => others += 1,
                }
            }
            say(format!("HOLDING {} refused {refused} other {others}", held.len()));
            assert_eq!(hear().as_deref(), Some("close"));
            let served = held.len();
            drop(held);
            // The daemon counts a connection until its thread has seen it close.
            let mut again = Vec::new();
            soon("the closed connections are released", || {
                match open(&socket) {
                    Ok(r) => again.push(r),
                    Err(WireError::LimitExceeded { limit: Limit::ConnectionsPerProcess, .. }) => {}
                    Err(e) => panic!("refused with {e:?}"),
                }
                again.len() == served
            });
            say(format!("REOPENED {}", again.len()));
            while hear().is_some() {}
        }
        // Connects, says READY, and on "go" prepares 1-block saves it never finishes until one
        // is refused; reports how many it holds and the refusal, and waits to be killed.
        "hold-writing" => {
            let tag: u64 = std::env::var("KVTIER_TAG").unwrap().parse().unwrap();
            let mut r = Raw::hello(&socket);
            say("READY");
            assert_eq!(hear().as_deref(), Some("go"));
            let (mut held, mut why) = (0, String::from("none"));
            for i in 0..1000 {
                let k = keys(&obs, tag * 100_000 + i..tag * 100_000 + i + 1);
                match r.call(&Request::PrepareSave { keys: k, prefix: false, prefix_depth: None, parent: None }) {
                    Reply::SavePrepared { slots, .. } if slots.len() == 1 => held += 1,
                    Reply::Error(WireError::LimitExceeded { limit, .. }) => {
                        why = format!("{limit:?}");
                        break;
                    }
                    other => {
                        why = format!("{other:?}");
                        break;
                    }
                }
            }
            say(format!("HOLDING {held} {why}"));
            while hear().is_some() {}
        }
        other => panic!("unknown role {other}"),
    }
}

// ---- An in-process daemon: a panicking request handler, a thread that cannot start, the socket.

fn test_tier(slots: u64) -> HostTier {
    let arenas = support::ARENAS.iter().map(|&(n, b)| ArenaSpec::packed(n, b, 1)).collect();
    let g = Geometry::new("test-model", 16, arenas).unwrap();
    let bytes = slots * support::SLOT_BYTES;
    let cfg = TierConfig::new(g, bytes).with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain));
    HostTier::new_shared(cfg).unwrap()
}

/// Starts `server` on its own thread (the thread ends only if `run` returns).
fn serve_in_process(server: Server) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let r = server.run();
        eprintln!("Server::run returned: {r:?}");
    })
}

#[test]
fn a_panicking_request_fails_alone_and_the_sessions_slots_and_leases_stay_sound() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtierd.sock");
    let server = Server::bind(&socket, test_tier(64)).unwrap();
    server.panic_on_requests(|r| matches!(r, Request::LiveHints));
    let run = serve_in_process(server);
    engine_is_served(&socket, 0..4);
    let obs = observer(&socket);
    let k = keys(&obs, 0..4);
    let mut r = Raw::hello(&socket);
    let (save, slots) = r.prepare(&keys(&obs, 300..303));
    assert_eq!(slots.len(), 3);
    let lease = r.query(&k, 1);
    // The panic fails that request, typed; the connection and everything it holds stay.
    match r.call(&Request::LiveHints) {
        Reply::Error(WireError::Panicked { request, .. }) => assert_eq!(request, "LiveHints"),
        other => panic!("{other:?}"),
    }
    let s = obs.stats();
    assert_eq!(s.writing_slots, 3, "the live writer's slots are still its own: {s:?}");
    assert_eq!(s.pinned_slots, 4, "{s:?}");
    // Another engine's saves cannot take those slots while the writer lives.
    engine_is_served(&socket, 8..16);
    assert_eq!(r.call(&Request::FinishSave { save, outcome: Outcome::Done, latency_ns: None }), Reply::Done);
    assert!(obs.contains(&keys(&obs, 300..301)[0]), "the writer's save committed");
    assert!(matches!(r.call(&Request::LeaseInfo { lease }), Reply::LeaseInfo { settled: false, .. }));
    drop(r);
    nothing_left_over(&obs, &k);
    assert!(!run.is_finished());
}

#[test]
fn a_connection_whose_thread_cannot_start_is_refused_and_the_daemon_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("kvtierd.sock");
    // A stack no machine can map: every connection thread fails to start.
    let limits = Limits { thread_stack_bytes: 1 << 62, ..Limits::default() };
    let server = Server::bind_with(&socket, test_tier(16), ServerConfig { limits, group: None }).unwrap();
    let run = serve_in_process(server);
    for _ in 0..3 {
        match HostTier::connect(&socket) {
            Err(kvtier::Error::Tier(TierError::Disconnected { reason })) => {
                assert!(
                    reason.contains("could not start a thread"),
                    "the refusal does not say a thread could not start: {reason}"
                );
            }
            Err(e) => panic!("{e}"),
            Ok(_) => panic!("served without a thread"),
        }
    }
    assert!(!run.is_finished(), "the accept loop goes on");
}

#[test]
fn bind_replaces_only_a_stale_socket_and_makes_it_private() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    // A regular file is never deleted.
    let file = dir.path().join("data.db");
    std::fs::write(&file, b"precious").unwrap();
    match Server::bind(&file, test_tier(4)) {
        Ok(_) => panic!("bind took the path of a regular file"),
        Err(e) => assert!(e.to_string().contains("not a socket"), "{e}"),
    }
    assert_eq!(std::fs::read(&file).unwrap(), b"precious");
    // Nor a directory.
    let sub = dir.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    assert!(Server::bind(&sub, test_tier(4)).is_err());
    assert!(sub.is_dir());
    // A stale socket (nobody accepts) is replaced; a live one is not.
    let sock = dir.path().join("new/kvtierd.sock");
    drop(std::os::unix::net::UnixListener::bind(dir.path().join("stale.sock")).unwrap());
    let stale = Server::bind(dir.path().join("stale.sock"), test_tier(4)).expect("a stale socket is replaced");
    let live = Server::bind(&sock, test_tier(4)).expect("the socket's directory is created");
    let e = Server::bind(&sock, test_tier(4)).unwrap_err().to_string();
    assert!(e.contains("already listens"), "{e}");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&sock), 0o600);
    assert_eq!(mode(sock.parent().unwrap()), 0o700);
    assert_eq!(mode(stale.path()), 0o600);
    drop(live);
    // With a group: 0660 and that group (our own group here, which any process may give its files).
    use std::os::unix::fs::MetadataExt;
    // SAFETY: getegid takes nothing and cannot fail.
    let gid = unsafe { libc::getegid() };
    let grouped = dir.path().join("grouped.sock");
    let server =
        Server::bind_with(&grouped, test_tier(4), ServerConfig { limits: Limits::default(), group: Some(gid) })
            .expect("a socket for a group");
    assert_eq!(mode(&grouped), 0o660);
    assert_eq!(std::fs::metadata(&grouped).unwrap().gid(), gid);
    drop(server);
    // The default path is in a private runtime directory.
    let p = kvtier::default_socket_path();
    assert!(p.ends_with("kvtierd.sock"));
    assert!(!p.starts_with("/tmp/kvtierd.sock"));
}
