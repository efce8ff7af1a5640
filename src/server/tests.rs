use super::drive::drive_session;
use super::limits::Limits;
use super::session::Session;
use super::shared::Shared;
use super::socket::{bind_under_private_umask, lock_bind, lock_path, UMASK};
use super::Server;
use crate::error::{Error, LimitsError};
use crate::key::ContentKey;
use crate::remote::proto::{Outcome, Reply, Request, WireError};
use crate::tier::HostTier;
use crate::{ArenaSpec, BackingChoice, Geometry, PoolConfig, TierConfig};
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[test]
fn a_socket_is_never_more_open_than_0600_whatever_the_umask() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    // No other bind of this process changes the umask meanwhile.
    let _serial = UMASK.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: umask sets the process's mask; this test restores it below.
    let before = unsafe { libc::umask(0) };
    let bound = bind_under_private_umask(&path);
    // SAFETY: as above; reads the mask the bind left, then restores the test's own.
    let after = unsafe { libc::umask(before) };
    let _listener = bound.unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(after, 0, "the bind did not restore the process's umask");
    assert_eq!(mode & !0o600, 0, "the socket was bound mode {mode:o} under umask 0: others could connect");
}

#[test]
fn a_bind_waits_for_the_lock_of_a_daemon_starting_on_the_same_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    drop(UnixListener::bind(&path).unwrap()); // a stale socket
    let ino = std::fs::metadata(&path).unwrap().ino();
    // Another daemon holds the lock (it is between its probe and its bind).
    let held = lock_bind(&path).unwrap();
    let lock_ino = std::fs::metadata(lock_path(&path)).unwrap().ino();
    assert_eq!(std::fs::metadata(lock_path(&path)).unwrap().permissions().mode() & 0o777, 0o600);
    let p = path.clone();
    let binder = std::thread::spawn(move || {
        let g = Geometry::new("unit", 16, vec![ArenaSpec::packed("a", 4096, 1)]).unwrap();
        let bytes = 4 * g.slot_bytes();
        let cfg = TierConfig::new(g, bytes).with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain));
        Server::bind(&p, HostTier::new_shared(cfg).unwrap())
    });
    // Wait (bounded) until the kernel shows the bind blocked on the lock file's flock, or
    // the bind finished without it.
    let blocked = |ino: u64| {
        std::fs::read_to_string("/proc/locks")
            .unwrap()
            .lines()
            .any(|l| l.contains("->") && l.contains("FLOCK") && l.contains(&format!(":{ino} ")))
    };
    let t0 = Instant::now();
    while !blocked(lock_ino) {
        assert!(!binder.is_finished(), "the bind replaced the socket while another daemon held the lock");
        assert!(t0.elapsed() < Duration::from_secs(60), "the bind never waited for the lock");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(std::fs::metadata(&path).unwrap().ino(), ino, "the waiting bind touched the socket");
    drop(held);
    let server = binder.join().unwrap().expect("the bind goes on once the lock is free");
    assert!(UnixStream::connect(server.path()).is_ok(), "the stale socket was replaced by a listening one");
    // A second bind on the live socket still fails clearly.
    let g = Geometry::new("unit", 16, vec![ArenaSpec::packed("a", 4096, 1)]).unwrap();
    let bytes = 4 * g.slot_bytes();
    let cfg = TierConfig::new(g, bytes).with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain));
    let e = Server::bind(&path, HostTier::new_shared(cfg).unwrap()).unwrap_err().to_string();
    assert!(e.contains("already listens"), "{e}");
}

fn shared(slots: u64) -> Arc<Shared> {
    let g = Geometry::new("unit", 16, vec![ArenaSpec::packed("a", 4096, 1)]).unwrap();
    let bytes = slots * g.slot_bytes();
    let cfg = TierConfig::new(g, bytes).with_pool(PoolConfig::new(bytes).with_backing(BackingChoice::Plain));
    // One process may take the whole pool here (the per-process bound is tested in
    // daemon/tests/hostile.rs).
    let limits = Limits { slots_per_process: slots as usize, ..Limits::default() };
    Arc::new(Shared::new(HostTier::new_shared(cfg).unwrap(), limits))
}

fn keys(shared: &Shared, r: std::ops::Range<u64>) -> Vec<ContentKey> {
    r.map(|i| shared.tier.namespace().trace_page_key(i, 0)).collect()
}

fn prepare(keys: &[ContentKey]) -> Request {
    Request::PrepareSave { keys: keys.to_vec(), prefix: false, prefix_depth: None, parent: None }
}

/// A pidfd of this (live) process.
fn own_pidfd() -> OwnedFd {
    // SAFETY: pidfd_open of our own pid returns a new fd or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, std::process::id(), 0) };
    assert!(fd >= 0, "pidfd_open: {}", std::io::Error::last_os_error());
    // SAFETY: a new fd nobody else owns.
    unsafe { OwnedFd::from_raw_fd(fd as i32) }
}

#[test]
fn a_session_dropped_by_an_unwinding_thread_withholds_its_writes_and_drops_its_leases() {
    let sh = shared(16);
    let ready = keys(&sh, 0..2);
    let pending = keys(&sh, 10..13);
    let mut s = Session::new(sh.clone(), Some(std::process::id()), Some(own_pidfd()));
    let (sh2, ready2, pending2) = (sh.clone(), ready.clone(), pending.clone());
    let t = std::thread::spawn(move || {
        let Reply::SavePrepared { save, .. } = s.run(prepare(&ready2)) else { panic!("prepare") };
        assert_eq!(s.run(Request::FinishSave { save, outcome: Outcome::Done, latency_ns: None }), Reply::Done);
        assert!(matches!(s.run(Request::Query { keys: ready2, uses: 1 }), Reply::Leased { .. }));
        let Reply::SavePrepared { slots, .. } = s.run(prepare(&pending2)) else { panic!("prepare") };
        assert_eq!(slots.len(), 3);
        assert_eq!(sh2.core.audit(&[]).unwrap().pinned, 2);
        // The thread unwinds with the session (a bug anywhere outside a request's catch_unwind).
        panic!("the connection's thread unwinds");
    });
    assert!(t.join().is_err());
    let a = sh.core.audit(&ready).unwrap();
    assert_eq!(a.writing, 3, "the live writer's slots are withheld, not freed under its copy: {a:?}");
    assert_eq!(a.pinned, 0, "the session's lease was settled: {a:?}");
    assert!(sh.leases.lock().unwrap().is_empty());
    assert_eq!(sh.parked.lock().unwrap().len(), 1, "withheld until the process is gone");
    // A save by another session gets other slots.
    let others = keys(&sh, 20..33);
    let r = drive(&sh, prepare(&others));
    assert!(matches!(r, Reply::SavePrepared { ref slots, .. } if slots.len() == 13), "{r:?}");
}

fn drive(sh: &Arc<Shared>, req: Request) -> Reply {
    let mut s = Session::new(sh.clone(), None, None);
    s.gone_at_end = true;
    s.run(req)
}

#[test]
fn a_panicking_request_is_a_typed_error_and_the_session_goes_on() {
    let sh = shared(8);
    let _ = sh.panic_hook.set(Box::new(|r| matches!(r, Request::Stats)));
    let k = keys(&sh, 0..2);
    let mut s = Session::new(sh.clone(), Some(std::process::id()), Some(own_pidfd()));
    let Reply::SavePrepared { save, .. } = s.run(prepare(&k)) else { panic!("prepare") };
    match s.run(Request::Stats) {
        Reply::Error(WireError::Panicked { request, .. }) => assert_eq!(request, "Stats"),
        r => panic!("{r:?}"),
    }
    assert_eq!(s.run(Request::FinishSave { save, outcome: Outcome::Done, latency_ns: None }), Reply::Done);
    assert!(sh.tier.contains(&k[0]));
    drop(s);
    assert!(sh.parked.lock().unwrap().is_empty());
}

#[test]
fn limits_under_which_leases_could_saturate_a_slots_pins_are_refused_at_bind() {
    let l = Limits { connections: 1 << 12, leases_per_connection: 1 << 12, ..Limits::default() };
    match l.check() {
        Err(e @ Error::Limits(LimitsError::LeasePins { connections: 4096, leases: 4096, .. })) => {
            assert!(e.to_string().contains("may pin one slot"), "{e}")
        }
        r => panic!("limits that let leases pin one slot 2^24 times were accepted: {r:?}"),
    }
    Limits::default().check().unwrap();
}

/// An unwind that drops a session's pending copies before `end` handles them (a panic in an
/// earlier step of `end`, or anywhere the maps are dropped) withholds their slots and pins.
#[test]
fn pending_copies_dropped_by_an_unwind_keep_their_slots_and_pins() {
    let sh = shared(16);
    let ready = keys(&sh, 0..2);
    let mut s = Session::new(sh.clone(), Some(std::process::id()), Some(own_pidfd()));
    let Reply::SavePrepared { save, .. } = s.run(prepare(&ready)) else { panic!("prepare") };
    assert_eq!(s.run(Request::FinishSave { save, outcome: Outcome::Done, latency_ns: None }), Reply::Done);
    let Reply::Leased { lease, .. } = s.run(Request::Query { keys: ready.clone(), uses: 1 }) else { panic!("query") };
    assert!(matches!(s.run(Request::Restore { lease, blocks: 2 }), Reply::Restoring { .. }));
    assert!(matches!(s.run(prepare(&keys(&sh, 10..13))), Reply::SavePrepared { .. }));
    // The pending copies' maps go as an unwind would drop them.
    let (saves, restores) = (std::mem::take(&mut s.saves), std::mem::take(&mut s.restores));
    let t = std::thread::spawn(move || {
        let _held = (saves, restores);
        panic!("the connection's thread unwinds with its pending copies");
    });
    assert!(t.join().is_err());
    let a = sh.core.audit(&[]).unwrap();
    assert_eq!(a.writing, 3, "the live writer's slots were freed by an unwind: {a:?}");
    assert_eq!(a.pinned, 2, "the live reader's pins were dropped by an unwind: {a:?}");
    let st = sh.tier.stats();
    assert_eq!((st.quarantined_slots, st.quarantined_pins), (3, 2), "withheld slots and pins: {st:?}");
    s.gone_at_end = true;
    drop(s);
}

#[test]
fn a_timeout_the_clock_cannot_add_is_refused_at_bind() {
    for t in [Duration::MAX, Duration::from_secs(u64::MAX / 2)] {
        let l = Limits { frame_timeout: t, ..Limits::default() };
        match l.check() {
            Err(e @ Error::Limits(LimitsError::TimeoutTooLarge { which: "frame", .. })) => {
                assert!(e.to_string().contains("frame timeout"), "{e}")
            }
            r => panic!("a frame timeout of {t:?} was accepted: {r:?}"),
        }
    }
    Limits { frame_timeout: Duration::from_secs(86_400 * 365), ..Limits::default() }.check().unwrap();
}

#[test]
fn drive_session_runs_encoded_requests_and_releases_everything() {
    let sh = shared(8);
    let k = keys(&sh, 0..3);
    let mut bytes = Vec::new();
    for r in [
        prepare(&k),
        Request::FinishSave { save: 1, outcome: Outcome::Done, latency_ns: None },
        Request::Query { keys: k.clone(), uses: 2 },
        Request::Restore { lease: 0, blocks: 2 },
        prepare(&keys(&sh, 5..7)),
    ] {
        bytes.extend(postcard::to_stdvec(&r).unwrap());
    }
    let replies = drive_session(sh.tier.clone(), Limits::default(), &bytes).unwrap();
    assert_eq!(replies.len(), 5);
    assert!(matches!(replies[3], Reply::Restoring { ref slots, .. } if slots.len() == 2), "{:?}", replies[3]);
    let a = sh.core.audit(&k).unwrap();
    assert_eq!((a.writing, a.pinned, a.ready), (0, 0, 3), "{a:?}");
}

#[test]
fn each_session_counts_its_own_traffic_and_clients_sums_them_by_process() {
    let sh = shared(8);
    let block = sh.core.geometry().block_bytes();
    // Process 101: two sessions (one saves two blocks, one queries them and a missing key, holding
    // the lease); process 202: one session with a refused query and a hint.
    let (k, missing) = (keys(&sh, 0..2), keys(&sh, 50..51));
    let mut a1 = Session::new(sh.clone(), Some(101), None);
    let mut a2 = Session::new(sh.clone(), Some(101), None);
    let mut b = Session::new(sh.clone(), Some(202), None);
    let mut viewer = Session::new(sh.clone(), Some(303), None);
    for s in [&mut a1, &mut a2, &mut b, &mut viewer] {
        s.gone_at_end = true;
    }
    let Reply::SavePrepared { save, .. } = a1.run(prepare(&k)) else { panic!("prepare") };
    assert_eq!(a1.run(Request::FinishSave { save, outcome: Outcome::Done, latency_ns: None }), Reply::Done);
    let asked = vec![k[0], k[1], missing[0]];
    assert!(
        matches!(a2.run(Request::Query { keys: asked, uses: 1 }), Reply::Leased { ref blocks, .. } if blocks.len() == 2)
    );
    let too_many = vec![missing[0]; Limits::default().keys_per_request + 1];
    assert!(matches!(b.run(Request::Query { keys: too_many, uses: 1 }), Reply::Error(WireError::LimitExceeded { .. })));
    assert!(matches!(b.run(Request::Hint { keys: k.clone(), ttl_ms: 60_000 }), Reply::Count(_)));
    let Reply::Clients(rows) = viewer.run(Request::Clients) else { panic!("clients") };
    assert_eq!(rows.iter().map(|r| r.pid).collect::<Vec<_>>(), [Some(101), Some(202)], "busiest first, no viewer");
    let (a, bb) = (&rows[0], &rows[1]);
    assert_eq!((a.sessions, a.saved_blocks, a.bytes_saved), (2, 2, 2 * block));
    assert_eq!((a.queries, a.hit_blocks, a.miss_blocks, a.lease_handles, a.leased_blocks), (1, 2, 1, 1, 2));
    assert_eq!((a.hints, a.refused, a.copies_in_flight), (0, 0, 0));
    assert_eq!((bb.sessions, bb.queries, bb.refused, bb.hints, bb.hints_given, bb.bytes_saved), (1, 0, 1, 1, 1, 0));
    // A session that ends leaves the view with its counts.
    drop(a1);
    let Reply::Clients(rows) = viewer.run(Request::Clients) else { panic!("clients") };
    assert_eq!((rows[0].pid, rows[0].sessions, rows[0].saved_blocks, rows[0].queries), (Some(101), 1, 0, 1));
    drop((a2, b));
    assert_eq!(viewer.run(Request::Clients), Reply::Clients(Vec::new()));
}
