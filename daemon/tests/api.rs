//! A connected tier answers like an in-process one: the same values and the same errors, call by
//! call. The daemon's server runs on a thread of this test process (`kvtier::Server`), the
//! clients are `HostTier::connect` handles on other threads.

use kvtier::MemcpyArenas;
use kvtier::Server;
use kvtier::{
    ArenaSpec, BackingChoice, CopyError, EngineArenas, Fit, Geometry, HostTier, PolicyKind, SaveOptions, TierConfig,
    TierError, WaitFor,
};
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(60);

fn geometry() -> Geometry {
    Geometry::new("test-model", 16, vec![ArenaSpec::packed("big", 4096, 1), ArenaSpec::packed("small", 1024, 1)])
        .unwrap()
}

fn config(slots: u64) -> TierConfig {
    let g = geometry();
    TierConfig::new(g.clone(), slots * g.slot_bytes()).with_backing(BackingChoice::Plain).with_policy(PolicyKind::Lru)
}

/// A served tier of `slots` slots and the socket's directory (keep it alive).
fn serve(slots: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kvtierd.sock");
    // One process (this test) may hold the whole pool, as an in-process tier's caller may.
    let limits = kvtier::Limits { slots_per_process: slots as usize, ..Default::default() };
    let server_config = kvtier::ServerConfig { limits, group: None };
    let server = Server::bind_with(&path, HostTier::new_shared(config(slots)).unwrap(), server_config).unwrap();
    std::thread::spawn(move || server.run());
    (dir, path)
}

/// The same scripted calls on an in-process tier and on a connected one give the same answers.
fn script(tier: &HostTier) -> Vec<String> {
    let mut out = Vec::new();
    let mut log = |s: String| out.push(s);
    let g = tier.geometry().with_pages(64).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    log(format!(
        "rank {} backend {} policy {} capacity {}",
        rank.id(),
        rank.backend_name(),
        tier.policy_name(),
        tier.capacity()
    ));
    let k: Vec<_> = (0..12).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
    let src: Vec<u64> = (0..12).collect();
    arenas.fill(&src, &k).unwrap();
    // Errors before anything is planned.
    log(format!("{:?}", rank.save(&k[..2], &[1], WaitFor::Nothing).unwrap_err()));
    log(format!("{:?}", rank.save(&k[..1], &[64], WaitFor::Nothing).unwrap_err()));
    // An all-or-nothing save that cannot fit evicts nothing.
    log(format!("{:?}", rank.save(&k[..11], &src[..11], WaitFor::Nothing).unwrap_err()));
    let t = rank.save(&k[..6], &src[..6], WaitFor::Nothing).unwrap();
    t.handle.wait_timeout(WAIT).unwrap().unwrap();
    log(format!("saving {:?} resident {} in flight {} dup {}", t.saving, t.resident, t.in_flight, t.duplicates));
    let dup = [k[0], k[6], k[6]];
    let t = rank.save(&dup, &[0, 6, 6], WaitFor::Nothing).unwrap();
    t.handle.wait_timeout(WAIT).unwrap().unwrap();
    log(format!("saving {:?} resident {} dup {}", t.saving, t.resident, t.duplicates));
    let t = rank
        .save_with(&k[7..10], &src[7..10], WaitFor::Nothing, SaveOptions::new().fit(Fit::Prefix).prefix_depth(7))
        .unwrap();
    t.handle.wait_timeout(WAIT).unwrap().unwrap();
    log(format!("prefix saving {:?} dropped {}", t.saving, t.dropped));
    log(format!("contains {} {}", tier.contains(&k[0]), tier.contains(&k[11])));
    // Leases: a shared one, restored twice, then settled.
    let lease = tier.query_shared(&k[..4], 2);
    log(format!("lease len {} uses {} settled {}", lease.len(), lease.uses_left(), lease.is_settled()));
    log(format!("{:?}", rank.restore(&lease, &[20, 21, 22, 23, 24], WaitFor::Nothing).unwrap_err()));
    log(format!("{:?}", rank.restore(&lease, &[20, 20], WaitFor::Nothing).unwrap_err()));
    log(format!("uses after a refused restore {}", lease.uses_left()));
    rank.restore(&lease, &[20, 21, 22, 23], WaitFor::Nothing).unwrap().wait_timeout(WAIT).unwrap().unwrap();
    arenas.verify(&[20, 21, 22, 23], &k[..4]).unwrap();
    rank.restore(&lease, &[30, 31], WaitFor::Nothing).unwrap().wait_timeout(WAIT).unwrap().unwrap();
    arenas.verify(&[30, 31], &k[..2]).unwrap();
    log(format!("settled {} uses {}", lease.is_settled(), lease.uses_left()));
    log(format!("{:?}", rank.restore(&lease, &[40], WaitFor::Nothing).unwrap_err()));
    let l2 = tier.query(&k[..3]);
    log(format!("release {} again {}", l2.clone().release(), l2.clone().release()));
    let miss = tier.query(&[tier.namespace().trace_page_key(99, 0), k[0]]);
    log(format!("miss len {} settled {} token {}", miss.len(), miss.is_settled(), miss.token_or_none()));
    log(format!("evicted {}", tier.evict(2)));
    let s = tier.stats();
    log(format!(
        "stats q {} hit {} miss {} saved {} restored {} evictions {} pinned {} ready {} free {} refused {} dropped {}",
        s.queries,
        s.hit_blocks,
        s.miss_blocks,
        s.saved_blocks,
        s.restored_blocks,
        s.evictions,
        s.pinned_slots,
        s.ready_slots,
        s.free_slots,
        s.saves_refused,
        s.save_dropped
    ));
    rank.shutdown(WAIT).unwrap();
    out
}

trait TokenOrNone {
    fn token_or_none(&self) -> bool;
}
impl TokenOrNone for kvtier::Lease {
    fn token_or_none(&self) -> bool {
        self.token().is_some()
    }
}

#[test]
fn a_connected_tier_answers_like_an_in_process_one() {
    let local = HostTier::new(config(10)).unwrap();
    let (_dir, path) = serve(10);
    let remote = HostTier::connect(&path).unwrap();
    assert!(remote.is_connected_tier() && !local.is_connected_tier());
    assert_eq!(remote.geometry(), local.geometry());
    assert_eq!(remote.namespace(), local.namespace());
    assert!(remote.pool().shared_fd().is_some());
    let a = script(&local);
    let b = script(&remote);
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x, y);
    }
    assert_eq!(a.len(), b.len());
    let keys: Vec<_> = (0..12).map(|i| remote.namespace().trace_page_key(i, 0)).collect();
    let audit = kvtier::internals::remote_audit(&remote, &keys).unwrap().unwrap();
    assert_eq!(audit, kvtier::internals::core(&local).audit(&keys).unwrap());
    assert!(matches!(kvtier::internals::remote_audit(&local, &keys), Err(TierError::ForeignLease)));
}

#[test]
fn leases_are_foreign_across_tiers_and_tokens_open_on_other_connections() {
    let (_dir, path) = serve(8);
    let a = HostTier::connect(&path).unwrap();
    let b = HostTier::connect(&path).unwrap();
    let local = HostTier::new(config(8)).unwrap();
    let g = a.geometry().with_pages(8).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let ra = a.attach(arenas.backend().unwrap()).unwrap();
    let k: Vec<_> = (0..3).map(|i| a.namespace().trace_page_key(i, 0)).collect();
    arenas.fill(&[0, 1, 2], &k).unwrap();
    ra.save(&k, &[0, 1, 2], WaitFor::Nothing).unwrap().handle.wait_timeout(WAIT).unwrap().unwrap();
    let lease = a.query_shared(&k, 2);
    // A lease of one connection restored by a rank of another handle is foreign, as across tiers.
    let rl = local.attach(arenas.backend().unwrap()).unwrap();
    assert!(matches!(rl.restore(&lease, &[4], WaitFor::Nothing), Err(TierError::ForeignLease)));
    let token = lease.token().unwrap();
    assert_eq!(kvtier::LeaseToken::from_bytes(&token.to_bytes()).unwrap(), token);
    assert!(matches!(local.open_lease(&token), Err(TierError::ForeignLease)));
    let opened = b.open_lease(&token).unwrap();
    assert_eq!(opened.len(), 3);
    // The first handle goes; the lease lives on in the other connection. (Its drop is a one-way
    // message on connection `a`: a round trip there orders it before what `b` does next.)
    drop(lease);
    let _ = a.stats();
    let rb = b.attach(arenas.backend().unwrap()).unwrap();
    rb.restore(&opened, &[5, 6, 7], WaitFor::Nothing).unwrap().wait_timeout(WAIT).unwrap().unwrap();
    arenas.verify(&[5, 6, 7], &k).unwrap();
    assert_eq!((opened.uses_left(), opened.is_settled()), (1, false));
    drop(opened);
    let s = b.stats();
    assert_eq!((s.live_leases, s.pinned_slots), (0, 0), "the last handle settled it");
    assert!(matches!(b.open_lease(&token), Err(TierError::LeaseSettled)));
    // A copy error on submission keeps the lease's use (as in process).
    let l = a.query(&k);
    let e = ra.restore(&l, &[0, 0], WaitFor::Nothing).unwrap_err();
    assert!(matches!(e, TierError::Copy(CopyError::DuplicateDestination { .. })), "{e:?}");
    assert_eq!(l.uses_left(), 1);
    assert_eq!(a.stats().pinned_slots, 3, "only the lease's pins");
}

/// A connected tier's handles share its shutdown (the daemon goes on serving), a lease restores
/// only on a rank of the connection it was leased over (not on another connection's, not across
/// flavours), and the policy and the pool are the daemon's.
#[test]
fn a_connected_tier_keeps_its_shutdown_and_its_leases_to_its_connection() {
    let (_dir, path) = serve(8);
    let a = HostTier::connect(&path).unwrap();
    let b = HostTier::connect(&path).unwrap();
    let local = HostTier::new(config(8)).unwrap();
    assert_eq!((a.policy_name(), a.capacity()), (local.policy_name(), local.capacity()));
    let g = a.geometry().with_pages(8).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let (ra, rb, rl) = (
        a.attach(arenas.backend().unwrap()).unwrap(),
        b.attach(arenas.backend().unwrap()).unwrap(),
        local.attach(arenas.backend().unwrap()).unwrap(),
    );
    let k: Vec<_> = (0..2).map(|i| a.namespace().trace_page_key(i, 0)).collect();
    arenas.fill(&[0, 1], &k).unwrap();
    ra.save(&k, &[0, 1], WaitFor::Nothing).unwrap().handle.wait_timeout(WAIT).unwrap().unwrap();
    rl.save(&k, &[0, 1], WaitFor::Nothing).unwrap().handle.wait_timeout(WAIT).unwrap().unwrap();
    let (la, ll) = (a.query(&k), local.query(&k));
    let foreign = |r: Result<kvtier::CopyHandle, TierError>| {
        assert!(matches!(r, Err(TierError::ForeignLease)), "a lease restores on its own tier's ranks only: {r:?}")
    };
    foreign(rb.restore(&la, &[4], WaitFor::Nothing));
    foreign(ra.restore(&ll, &[4], WaitFor::Nothing));
    foreign(rl.restore(&la, &[4], WaitFor::Nothing));
    assert_eq!((la.uses_left(), ll.uses_left()), (1, 1), "a refused restore takes no use");
    // A clone shares the handle's shutdown; another connection and the daemon go on.
    let a2 = a.clone();
    a2.shutdown();
    assert!(matches!(a.attach(arenas.backend().unwrap()), Err(TierError::ShuttingDown)));
    assert!(matches!(ra.save(&k, &[0, 1], WaitFor::Nothing), Err(TierError::ShuttingDown)));
    assert!(matches!(ra.restore(&la, &[4], WaitFor::Nothing), Err(TierError::ShuttingDown)));
    assert!(a.contains(&k[0]), "queries still answer");
    rb.restore(&b.query(&k), &[4, 5], WaitFor::Nothing).unwrap().wait_timeout(WAIT).unwrap().unwrap();
    arenas.verify(&[4, 5], &k).unwrap();
    // The drop is a one-way message on connection `a`: a round trip there orders it.
    drop((la, ll));
    let _ = a.stats();
    assert_eq!(b.stats().pinned_slots, 0, "every lease settled");
}

#[test]
fn connecting_checks_the_namespace_and_a_missing_daemon_is_a_typed_error() {
    let (dir, path) = serve(4);
    assert!(HostTier::connect_as(&path, &geometry()).is_ok());
    let other = Geometry::new("other-model", 16, vec![ArenaSpec::packed("big", 4096, 1)]).unwrap();
    let e = HostTier::connect_as(&path, &other).unwrap_err();
    assert!(matches!(e, kvtier::Error::Tier(TierError::GeometryMismatch { .. })), "{e:?}");
    let e = HostTier::connect(dir.path().join("nobody.sock")).unwrap_err();
    assert!(matches!(e, kvtier::Error::Tier(TierError::Disconnected { .. })), "{e:?}");
    // A second daemon on a live socket is refused.
    let e = Server::bind(&path, HostTier::new_shared(config(4)).unwrap()).unwrap_err();
    assert!(e.to_string().contains("already listens"), "{e}");
    // A private pool cannot be served.
    let e = Server::bind(dir.path().join("x.sock"), HostTier::new(config(4)).unwrap()).unwrap_err();
    assert!(e.to_string().contains("private"), "{e}");
}

#[test]
fn a_hello_of_another_protocol_version_is_refused() {
    use kvtier::internals::proto::{self, Reply, Request, WireError};
    use std::io::Read;
    let (_dir, path) = serve(4);
    let mut s = std::os::unix::net::UnixStream::connect(&path).unwrap();
    s.set_read_timeout(Some(WAIT)).unwrap();
    let mut buf = Vec::new();
    let hello = Request::Hello { magic: proto::MAGIC, version: proto::PROTOCOL_VERSION + 1, namespace: None };
    proto::write_frame(&mut proto::NoSigPipe(&s), &hello, &mut buf).unwrap();
    let mut marker = [0u8];
    s.read_exact(&mut marker).unwrap();
    assert_eq!(marker[0], proto::MARKER_REFUSED);
    let r: Reply = proto::read_frame(&mut s, &mut buf).unwrap();
    assert_eq!(
        r,
        Reply::Error(WireError::ProtocolMismatch {
            daemon: proto::PROTOCOL_VERSION,
            client: proto::PROTOCOL_VERSION + 1
        })
    );
}

#[test]
fn hints_on_a_connected_tier_go_to_the_daemon() {
    let (_dir, path) = serve(8);
    let a = HostTier::connect(&path).unwrap();
    let b = HostTier::connect(&path).unwrap();
    let k: Vec<_> = (0..3).map(|i| a.namespace().trace_page_key(i, 0)).collect();
    let id = a.hint(&k, std::time::Duration::from_secs(60));
    assert_eq!((a.live_hints(), b.live_hints()), (1, 1), "one hint, held by the daemon's tier");
    assert!(!b.withdraw_hint(id), "a hint belongs to the connection that gave it");
    assert!(a.withdraw_hint(id), "its own connection withdraws it");
    assert!(!a.withdraw_hint(id), "withdrawn once");
    assert_eq!(a.live_hints(), 0);
    // A hint goes with the connection that gave it.
    let _ = a.hint(&k, std::time::Duration::from_secs(3600));
    assert_eq!(b.live_hints(), 1);
    drop(a);
    let t0 = std::time::Instant::now();
    while b.live_hints() != 0 {
        assert!(t0.elapsed() < WAIT, "the hint outlived its connection");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

/// A connected tier's rank copies layer-wise itself (the daemon only reserves and pins): the
/// groups come from the rank's backend (the daemon's geometry carries no layer ids), a layer wait
/// makes its group ready, and the bytes arrive.
#[test]
fn a_connected_rank_saves_and_restores_layer_wise() {
    let (_dir, path) = serve(8);
    let tier = HostTier::connect(&path).unwrap();
    let g = tier.geometry().with_pages(16).unwrap().with_layers(vec![0, 1]).unwrap();
    let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    assert_eq!(rank.layer_groups(2).unwrap().len(), 2, "the backend's layers");
    let k: Vec<_> = (0..3).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
    arenas.fill(&[0, 1, 2], &k).unwrap();
    let t = rank.save_layers(&k, &[0, 1, 2], &[WaitFor::Nothing; 2], 2, SaveOptions::default()).unwrap();
    assert_eq!(t.handle.layer_groups().map(|l| l.len()), Some(2));
    t.handle.wait_timeout(WAIT).unwrap().unwrap();
    let lease = tier.query(&k);
    assert_eq!(lease.len(), 3);
    let h = rank.restore_layers(&lease, &[9, 10, 11], WaitFor::Nothing, 2).unwrap();
    assert_eq!(h.layer_groups().map(|l| l.len()), Some(2));
    h.wait_layer(0, 0).unwrap();
    assert!(h.is_layer_ready(0).unwrap());
    h.wait_timeout(WAIT).unwrap().unwrap();
    arenas.verify(&[9, 10, 11], &k).unwrap();
    assert_eq!(tier.stats().pinned_slots, 0);
}

/// A backend that panics in `restore` after it queued its copy: in process and connected alike
/// the restore fails `BackendPanicked`, the copy's pins are withheld, and the lease keeps its use
/// (a submission that panicked is a failed call), so a retry on another rank is served.
fn submit_panic_script(tier: &HostTier) -> Vec<String> {
    use kvtier::{PanicSite, SubmitPanics};
    let mut out = Vec::new();
    let g = tier.geometry().with_pages(8).unwrap();
    let a = Arc::new(MemcpyArenas::new(&g).unwrap());
    let good = tier.attach(a.backend().unwrap()).unwrap();
    let k: Vec<_> = (0..1).map(|i| tier.namespace().trace_page_key(i, 0)).collect();
    a.fill(&[0], &k).unwrap();
    good.save(&k, &[0], WaitFor::Nothing).unwrap().handle.wait_timeout(WAIT).unwrap().unwrap();
    let b = Arc::new(MemcpyArenas::new(&g).unwrap());
    let (bad, late) = SubmitPanics::new(b.backend().unwrap(), PanicSite::Restore);
    let bad = tier.attach(Box::new(bad)).unwrap();
    let lease = tier.query(&k);
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| bad.restore(&lease, &[7], WaitFor::Nothing)));
    out.push(format!("{:?}", r.map(|r| r.map(|_| ()))));
    let s = tier.stats();
    out.push(format!("quarantined pins {}", s.quarantined_pins));
    let c = Arc::new(MemcpyArenas::new(&g).unwrap());
    let retry = tier.attach(c.backend().unwrap()).unwrap();
    let again = retry.restore(&lease, &[3], WaitFor::Nothing).map(|h| h.wait_timeout(WAIT).unwrap());
    out.push(format!("retry after a submission panic: {again:?}"));
    if again.is_ok() {
        c.verify(&[3], &k).unwrap();
    }
    drop(lease);
    out.push(format!("late copies {}", late.land().unwrap()));
    b.verify(&[7], &k).unwrap();
    out
}

#[test]
fn a_restore_whose_backend_panics_at_submission_keeps_its_use_connected_as_in_process() {
    let local = HostTier::new(config(4)).unwrap();
    let (_dir, path) = serve(4);
    let remote = HostTier::connect(&path).unwrap();
    let a = submit_panic_script(&local);
    assert_eq!(a[2], "retry after a submission panic: Ok(Ok(()))", "in process: {a:?}");
    let b = submit_panic_script(&remote);
    assert_eq!(a, b, "a connected tier must keep the use of a restore whose submission panicked, as in process");
}

/// A connected tier cannot be served again by a second daemon: it owns no state to serve (it has
/// no core), so `bind` refuses it with a typed error instead of serving, or panicking on, nothing.
#[test]
fn a_connected_tier_is_refused_by_a_second_server() {
    let (dir, path) = serve(4);
    let connected = HostTier::connect(&path).unwrap();
    let second = dir.path().join("second.sock");
    match Server::bind(&second, connected) {
        Err(e @ kvtier::Error::ServeConnected) => assert!(e.to_string().contains("connected"), "{e}"),
        Err(e) => panic!("a connected tier was refused with the wrong error: {e}"),
        Ok(_) => panic!("a second daemon served a connected tier"),
    }
    assert!(!second.exists(), "nothing was bound");
}
