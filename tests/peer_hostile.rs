//! The peer port against hostile clients and owners: raw TCP clients that send a wrong secret, no
//! secret, a replayed proof, requests before the proof, hellos and frames a byte at a time, more
//! connections than the limit, huge counts; owners that trickle their replies or cannot prove the
//! secret. After each case a correct peer is served (its bytes restored and checked) and the
//! process's thread count and memory are back within a bound. The owner and the readers run in
//! this process (`PeerServer`, `PeerClient`, `PeerSet`, the production paths), over the transport
//! double of `peer/double.rs`; the tests of this file run one at a time (they count threads).

mod common;
#[path = "peer/double.rs"]
#[allow(dead_code)] // the helpers tests/peer.rs uses
mod double;

use common::*;
use double::Fabric;
use kvtier::internals::peer_proto::{self as proto, Frame, PeerRefusal, PeerReply, PeerRequest, Role};
use kvtier::{
    ContentKey, EngineArenas, HostTier, PeerClient, PeerError, PeerLimits, PeerSecret, PeerServer, PeerSet,
    PeerTransport, PolicyKind, WaitFor,
};
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The tests of this file one at a time: each counts the process's threads.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

const SECRET: &[u8] = b"the peers' shared secret: 42 B long, at least";

fn secret() -> PeerSecret {
    PeerSecret::new(SECRET.to_vec()).unwrap()
}

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// An owner of 8 slots holding 4 saved blocks, serving them with [`SECRET`] at a loopback port.
struct Owner {
    fabric: Arc<Fabric>,
    tier: HostTier,
    server: PeerServer,
    keys: Vec<ContentKey>,
    /// Threads and resident memory (KiB) of the process once the owner is up.
    base: (usize, usize),
}

fn owner(limits: PeerLimits) -> Owner {
    let fabric = Fabric::new();
    let tier = tier(8, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let keys = keys(&tier, 0..4);
    let _ = save_filled(&rank, &a, &keys, &[0, 1, 2, 3]);
    let server =
        PeerServer::bind_with_secret(&tier, "127.0.0.1:0", fabric.transport(&tier), limits, Some(secret())).unwrap();
    let base = (threads(), rss_kib());
    Owner { fabric, tier, server, keys, base }
}

impl Owner {
    fn addr(&self) -> SocketAddr {
        self.server.local_addr()
    }

    /// A correct peer is served: it connects with the secret, fetches the four blocks, restores
    /// them and checks every byte; then the process's threads and memory are back within a bound.
    fn still_serves(&self, case: &str) {
        let reader = tier(8, PolicyKind::Lru);
        let t = self.fabric.transport(&reader);
        let client = PeerClient::connect_with_secret(self.addr(), &reader, t, Some(&secret()), soon())
            .unwrap_or_else(|e| panic!("after {case}: a correct peer must still be served: {e:?}"));
        let f = client.fetch(&self.keys, soon()).unwrap();
        assert_eq!(f.lease.len(), 4, "after {case}: every block served");
        let b = arenas();
        let rank = reader.attach(b.backend().unwrap()).unwrap();
        rank.restore(&f.lease, &[10, 11, 12, 13], WaitFor::Nothing).unwrap().wait().unwrap();
        b.verify(&[10, 11, 12, 13], &self.keys).unwrap_or_else(|e| panic!("after {case}: the bytes: {e:?}"));
        drop((f, client, rank));
        let until = Instant::now() + Duration::from_secs(10);
        while self.server.stats().connections > 0 || threads() > self.base.0 {
            assert!(
                Instant::now() < until,
                "after {case}: {} connections open and {} threads, {} before",
                self.server.stats().connections,
                threads(),
                self.base.0
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let rss = rss_kib();
        assert!(rss < self.base.1 + 64 * 1024, "after {case}: {rss} KiB resident, {} KiB before", self.base.1);
        assert_eq!(self.server.live_leases(), 0, "after {case}: no lease left");
        assert_eq!(self.tier.stats().pinned_slots, 0, "after {case}: nothing pinned");
    }
}

/// A field of /proc/self/status (its first number).
fn status(field: &str) -> usize {
    let s = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = s.lines().find(|l| l.starts_with(field)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

fn threads() -> usize {
    status("Threads:")
}

fn rss_kib() -> usize {
    status("VmRSS:")
}

/// A request as a frame's bytes.
fn freq(msg: &PeerRequest) -> Vec<u8> {
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    proto::write_msg(&mut out, msg, &mut scratch).unwrap();
    out
}

/// A reply as a frame's bytes.
fn frep(msg: &PeerReply) -> Vec<u8> {
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    proto::write_msg(&mut out, msg, &mut scratch).unwrap();
    out
}

fn raw(addr: SocketAddr) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s
}

/// The next reply, or `None` once the owner closed the connection.
fn recv(s: &mut TcpStream) -> Option<PeerReply> {
    match proto::read_msg::<PeerReply>(s, &mut Vec::new(), 64 << 20) {
        Ok(Frame::Msg(m)) => Some(m),
        Ok(other) => panic!("a bad reply frame {other:?}"),
        Err(_) => None,
    }
}

fn call(s: &mut TcpStream, req: &PeerRequest) -> Option<PeerReply> {
    s.write_all(&freq(req)).ok()?;
    recv(s)
}

/// Hello, then the proof made with `key` over `ns`; returns the connection and the proof's answer.
fn handshake(o: &Owner, key: Option<&PeerSecret>, ns: kvtier::Namespace) -> (TcpStream, Option<PeerReply>) {
    let mut s = raw(o.addr());
    let nonce = proto::nonce().unwrap();
    let Some(PeerReply::Challenge { nonce: theirs }) =
        call(&mut s, &PeerRequest::Hello { magic: proto::PEER_MAGIC, version: proto::PEER_PROTOCOL_VERSION, nonce })
    else {
        panic!("no challenge")
    };
    let descriptor = o.fabric.transport(&tier(1, PolicyKind::Lru)).local_descriptor().unwrap();
    let mac = proto::mac(key, Role::Reader, &nonce, &theirs, &ns, 0, &descriptor);
    let r = call(&mut s, &PeerRequest::Auth { mac, namespace: ns, descriptor });
    (s, r)
}

/// True once the owner closed `s` (end of stream or a reset) within `within`.
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut b = [0u8; 64];
    let until = Instant::now() + within;
    loop {
        match s.read(&mut b) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return false
            }
            Err(_) => return true,
        }
        if Instant::now() >= until {
            return false;
        }
    }
}

/// Writes `bytes` one at a time, `every` apart, on a thread of its own, until one fails.
fn trickle(s: &TcpStream, bytes: Vec<u8>, every: Duration) -> std::thread::JoinHandle<()> {
    let mut w = s.try_clone().unwrap();
    std::thread::spawn(move || {
        for b in bytes {
            if w.write_all(&[b]).is_err() {
                return;
            }
            std::thread::sleep(every);
        }
    })
}

#[test]
fn a_wrong_secret_no_secret_or_a_replayed_proof_gets_nothing() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let o = owner(PeerLimits::default());
    let ns = o.tier.namespace();
    let reader = tier(8, PolicyKind::Lru);
    let t = o.fabric.transport(&reader);
    // Through the production client: another secret, and none.
    let other = PeerSecret::new(b"another secret of enough length".to_vec()).unwrap();
    let e = PeerClient::connect_with_secret(o.addr(), &reader, t.clone(), Some(&other), soon());
    assert!(matches!(e, Err(PeerError::Auth(_))), "a wrong secret must be refused: {e:?}");
    let e = PeerClient::connect(o.addr(), &reader, t.clone(), soon());
    assert!(matches!(e, Err(PeerError::Auth(_))), "no secret must be refused: {e:?}");
    assert_untouched(&reader);
    // Raw: the refusal says nothing about the owner (not its namespace), even for a reader of
    // another namespace, and the connection is closed.
    let (mut s, r) = handshake(&o, Some(&other), ns);
    assert_eq!(r, Some(PeerReply::Refused(PeerRefusal::Auth)));
    assert!(closed_within(&mut s, Duration::from_secs(5)));
    let (_, r) = handshake(&o, None, kvtier::Namespace::from_description(b"another model"));
    assert_eq!(r, Some(PeerReply::Refused(PeerRefusal::Auth)), "an unauthenticated reader learns no namespace");
    // A proof recorded from one connection does not open another (the owner's nonce is new).
    let mut a = raw(o.addr());
    let nonce = proto::nonce().unwrap();
    let hello = PeerRequest::Hello { magic: proto::PEER_MAGIC, version: proto::PEER_PROTOCOL_VERSION, nonce };
    let Some(PeerReply::Challenge { nonce: first }) = call(&mut a, &hello) else { panic!("no challenge") };
    let descriptor = o.fabric.transport(&tier(1, PolicyKind::Lru)).local_descriptor().unwrap();
    let mac = proto::mac(Some(&secret()), Role::Reader, &nonce, &first, &ns, 0, &descriptor);
    let proof = PeerRequest::Auth { mac, namespace: ns, descriptor };
    assert!(matches!(call(&mut a, &proof), Some(PeerReply::Welcome { .. })), "the recorded proof was good");
    let mut b = raw(o.addr());
    let Some(PeerReply::Challenge { nonce: second }) = call(&mut b, &hello) else { panic!("no challenge") };
    assert_ne!(first, second, "each connection gets a fresh nonce");
    assert_eq!(call(&mut b, &proof), Some(PeerReply::Refused(PeerRefusal::Auth)), "a replayed proof is refused");
    drop((a, b));
    // A request before the proof is answered with nothing but a refusal, and leases nothing.
    let mut c = raw(o.addr());
    let Some(PeerReply::Challenge { .. }) = call(&mut c, &hello) else { panic!("no challenge") };
    let q = PeerRequest::Query { keys: o.keys.clone(), ttl_ms: 30_000 };
    assert_eq!(call(&mut c, &q), Some(PeerReply::Refused(PeerRefusal::OutOfOrder)));
    assert!(closed_within(&mut c, Duration::from_secs(5)));
    let mut d = raw(o.addr());
    assert_eq!(call(&mut d, &q), Some(PeerReply::Refused(PeerRefusal::OutOfOrder)), "a query before the hello");
    assert_eq!(o.server.live_leases(), 0);
    assert_eq!(o.tier.stats().pinned_slots, 0, "nothing pinned for an unauthenticated connection");
    let st = o.server.stats();
    assert_eq!(st.refused_auth, 5, "each failed proof counted: {st:?}");
    o.still_serves("wrong, missing and replayed proofs");
}

#[test]
fn an_owner_that_cannot_prove_the_secret_is_not_believed() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let o = owner(PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    let ns = reader.namespace();
    let slot_bytes = reader.geometry().slot_bytes();
    // A fake owner: a challenge, then a welcome whose proof is made without the secret.
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = fake.local_addr().unwrap();
    let descriptor = o.fabric.transport(&tier(1, PolicyKind::Lru)).local_descriptor().unwrap();
    let h = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let mut buf = Vec::new();
        let Ok(Frame::Msg(PeerRequest::Hello { nonce, .. })) = proto::read_msg(&mut s, &mut buf, 1 << 20) else {
            return;
        };
        let ours = proto::nonce().unwrap();
        s.write_all(&frep(&PeerReply::Challenge { nonce: ours })).unwrap();
        let _ = proto::read_msg::<PeerRequest>(&mut s, &mut buf, 1 << 20);
        let mac = proto::mac(None, Role::Owner, &nonce, &ours, &ns, slot_bytes, &descriptor);
        let limits = proto::WirePeerLimits {
            frame_bytes: 1 << 20,
            keys_per_query: 64,
            leases_per_connection: 4,
            max_lease_ttl_ms: 1000,
            idle_timeout_ms: 10_000,
        };
        let _ =
            s.write_all(&frep(&PeerReply::Welcome { mac, namespace: ns, block_bytes: slot_bytes, descriptor, limits }));
        std::thread::sleep(Duration::from_millis(200));
    });
    let e = PeerClient::connect_with_secret(at, &reader, o.fabric.transport(&reader), Some(&secret()), soon());
    assert!(
        matches!(e, Err(PeerError::Auth(ref m)) if m.contains("owner's proof")),
        "an owner that cannot prove the secret must not be believed: {e:?}"
    );
    h.join().unwrap();
    o.still_serves("an owner without the secret");
}

#[test]
fn serving_an_open_address_without_a_secret_is_refused_at_start() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let fabric = Fabric::new();
    let t = tier(4, PolicyKind::Lru);
    let e = PeerServer::bind(&t, "0.0.0.0:0", fabric.transport(&t), PeerLimits::default());
    assert!(
        matches!(e, Err(PeerError::Config(ref m)) if m.contains("secret")),
        "an open port without a secret must be refused at start: {e:?}"
    );
    let s = PeerServer::bind_with_secret(&t, "0.0.0.0:0", fabric.transport(&t), PeerLimits::default(), Some(secret()));
    assert!(s.is_ok(), "with a secret it serves: {:?}", s.err());
}

#[test]
fn trickled_hellos_and_frames_end_at_their_bound_not_per_read() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let bound = Duration::from_millis(300);
    let limits = PeerLimits {
        hello_timeout: bound,
        frame_timeout: bound,
        idle_timeout: Duration::from_millis(500),
        ..PeerLimits::default()
    };
    let o = owner(limits);
    let every = Duration::from_millis(50);
    // A hello a byte every 50 ms (over 2 s in all): closed at the hello timeout.
    let hello = PeerRequest::Hello {
        magic: proto::PEER_MAGIC,
        version: proto::PEER_PROTOCOL_VERSION,
        nonce: proto::nonce().unwrap(),
    };
    let mut s = raw(o.addr());
    let t0 = Instant::now();
    let w = trickle(&s, freq(&hello), every);
    assert!(
        closed_within(&mut s, Duration::from_secs(3)) && t0.elapsed() < Duration::from_millis(1500),
        "a hello trickled over {:?} passed a 300 ms hello timeout",
        t0.elapsed()
    );
    w.join().unwrap();
    // A query a byte every 50 ms after a good hello: closed at the frame timeout.
    let (mut s, r) = handshake(&o, Some(&secret()), o.tier.namespace());
    assert!(matches!(r, Some(PeerReply::Welcome { .. })));
    let q = PeerRequest::Query { keys: o.keys.clone(), ttl_ms: 30_000 };
    let t0 = Instant::now();
    let w = trickle(&s, freq(&q), every);
    assert!(
        closed_within(&mut s, Duration::from_secs(4)) && t0.elapsed() < Duration::from_millis(1500),
        "a frame trickled over {:?} passed a 300 ms frame timeout",
        t0.elapsed()
    );
    w.join().unwrap();
    // An authenticated connection that idles is closed after the idle timeout.
    let (mut s, _) = handshake(&o, Some(&secret()), o.tier.namespace());
    let t0 = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(5)), "an idle connection is closed");
    assert!(t0.elapsed() >= Duration::from_millis(400), "not before its idle timeout: {:?}", t0.elapsed());
    o.still_serves("trickled hellos and frames");
}

/// A fake owner at a loopback port: it proves the secret as the real one does, then answers the
/// first query with a reply trickled a byte every 50 ms (`hello_too`: the challenge itself
/// trickled instead).
fn trickling_owner(o: &Owner, reader: &HostTier, hello_too: bool) -> (SocketAddr, std::thread::JoinHandle<()>) {
    let fake = TcpListener::bind("127.0.0.1:0").unwrap();
    let at = fake.local_addr().unwrap();
    let descriptor = o.fabric.transport(&tier(1, PolicyKind::Lru)).local_descriptor().unwrap();
    let (ns, slot_bytes) = (reader.namespace(), reader.geometry().slot_bytes());
    let h = std::thread::spawn(move || {
        let (mut s, _) = fake.accept().unwrap();
        let every = Duration::from_millis(50);
        let mut buf = Vec::new();
        let Ok(Frame::Msg(PeerRequest::Hello { nonce, .. })) = proto::read_msg(&mut s, &mut buf, 1 << 20) else {
            return;
        };
        let ours = proto::nonce().unwrap();
        let challenge = frep(&PeerReply::Challenge { nonce: ours });
        if hello_too {
            let _ = trickle(&s, challenge, every).join();
            std::thread::sleep(Duration::from_secs(2));
            return;
        }
        s.write_all(&challenge).unwrap();
        let _ = proto::read_msg::<PeerRequest>(&mut s, &mut buf, 1 << 20);
        let key = secret();
        let mac = proto::mac(Some(&key), Role::Owner, &nonce, &ours, &ns, slot_bytes, &descriptor);
        let limits = proto::WirePeerLimits {
            frame_bytes: 1 << 20,
            keys_per_query: 64,
            leases_per_connection: 4,
            max_lease_ttl_ms: 1000,
            idle_timeout_ms: 10_000,
        };
        s.write_all(&frep(&PeerReply::Welcome { mac, namespace: ns, block_bytes: slot_bytes, descriptor, limits }))
            .unwrap();
        let Ok(Frame::Msg(PeerRequest::Query { keys, .. })) = proto::read_msg::<PeerRequest>(&mut s, &mut buf, 1 << 20)
        else {
            return;
        };
        let blocks = keys
            .iter()
            .enumerate()
            .map(|(i, k)| proto::WirePeerBlock { key: *k, offset: i as u64 * slot_bytes, generation: 1 })
            .collect();
        let _ = trickle(&s, frep(&PeerReply::Leased { lease: 7, ttl_ms: 1000, blocks }), every).join();
    });
    (at, h)
}

#[test]
fn an_owner_that_trickles_its_replies_is_left_at_the_readers_deadline() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let o = owner(PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    let t = o.fabric.transport(&reader);
    let ms300 = Duration::from_millis(300);
    // The hello's challenge trickled: a 300 ms connect ends at 300 ms.
    let (at, h) = trickling_owner(&o, &reader, true);
    let t0 = Instant::now();
    let e = PeerClient::connect_with_secret(at, &reader, t.clone(), Some(&secret()), t0 + ms300);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(900), "a 300 ms connect held for {took:?}");
    assert!(matches!(e, Err(PeerError::Deadline)), "{e:?}");
    drop(e);
    h.join().unwrap();
    // A query's reply trickled: a 300 ms fetch ends at 300 ms, the reader unchanged.
    let (at, h) = trickling_owner(&o, &reader, false);
    let client = PeerClient::connect_with_secret(at, &reader, t.clone(), Some(&secret()), soon()).unwrap();
    let t0 = Instant::now();
    let e = client.fetch(&o.keys, t0 + ms300);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(900), "a 300 ms fetch held for {took:?}");
    assert!(matches!(e, Err(PeerError::Deadline)), "{e:?}");
    drop(e);
    assert_untouched(&reader);
    drop(client);
    h.join().unwrap();
    // A peer set's query: the same bound.
    let (at, h) = trickling_owner(&o, &reader, false);
    let peers = PeerSet::new(&reader, t, [at.to_string()]).unwrap().with_secret(Some(secret()));
    let t0 = Instant::now();
    let f = peers.query(&o.keys, t0 + ms300);
    let took = t0.elapsed();
    assert!(took < Duration::from_millis(900), "a 300 ms peer set query held for {took:?}");
    assert!(matches!(f.errors.as_slice(), [(0, PeerError::Deadline)]), "{:?}", f.errors);
    drop((f, peers));
    h.join().unwrap();
    o.still_serves("owners that trickle");
}

#[test]
fn connections_over_the_limit_are_told_so_and_the_reader_pauses_no_one() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let o = owner(PeerLimits { connections: 4, hello_timeout: Duration::from_millis(500), ..PeerLimits::default() });
    let held: Vec<TcpStream> = (0..4)
        .map(|_| {
            let (s, r) = handshake(&o, Some(&secret()), o.tier.namespace());
            assert!(matches!(r, Some(PeerReply::Welcome { .. })));
            s
        })
        .collect();
    let reader = tier(8, PolicyKind::Lru);
    let t = o.fabric.transport(&reader);
    let e = PeerClient::connect_with_secret(o.addr(), &reader, t.clone(), Some(&secret()), soon());
    assert!(
        matches!(e, Err(PeerError::Refused(ref m)) if m.contains("maximum of 4")),
        "a connection over the limit gets a typed refusal, not a silent close: {e:?}"
    );
    // A peer set records the refusal and does not pause the peer: once a connection frees, the
    // next query is served.
    let peers = PeerSet::new(&reader, t, [o.addr().to_string()]).unwrap().with_secret(Some(secret()));
    let f = peers.query(&o.keys, soon());
    assert!(matches!(f.errors.as_slice(), [(0, PeerError::Refused(_))]), "{:?}", f.errors);
    drop(f);
    drop(held);
    let until = Instant::now() + Duration::from_secs(10);
    while o.server.stats().connections > 0 {
        assert!(Instant::now() < until, "the closed connections end");
        std::thread::sleep(Duration::from_millis(5));
    }
    let f = peers.query(&o.keys, soon());
    assert!(f.errors.is_empty(), "a refused peer is not paused: {:?}", f.errors);
    assert_eq!(f.lease.len(), 4);
    drop((f, peers));
    // Many connections that say nothing: each ends at the hello timeout, none is served.
    let silent: Vec<TcpStream> = (0..16).map(|_| raw(o.addr())).collect();
    std::thread::sleep(Duration::from_millis(700));
    drop(silent);
    assert!(o.server.stats().refused_connections >= 2);
    o.still_serves("connections over the limit");
}

#[test]
fn huge_counts_and_lengths_are_bounded() {
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let o = owner(PeerLimits { keys_per_query: 16, ..PeerLimits::default() });
    let ns = o.tier.namespace();
    // Before the hello: a frame announcing 4 GiB is not read; the connection is closed.
    let mut s = raw(o.addr());
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(5)));
    // A hello of another version is refused with the owner's version only.
    let mut s = raw(o.addr());
    let hello = PeerRequest::Hello { magic: proto::PEER_MAGIC, version: u32::MAX, nonce: [0; 32] };
    assert_eq!(
        call(&mut s, &hello),
        Some(PeerReply::Refused(PeerRefusal::Version { ours: proto::PEER_PROTOCOL_VERSION, theirs: u32::MAX }))
    );
    // Authenticated: counts over the limits are refused, huge ones are bounded.
    let (mut s, _) = handshake(&o, Some(&secret()), ns);
    let many = keys(&o.tier, 0..17);
    assert_eq!(
        call(&mut s, &PeerRequest::Query { keys: many, ttl_ms: u64::MAX }),
        Some(PeerReply::Refused(PeerRefusal::Limit { what: "keys per query".into(), asked: 17, max: 16 }))
    );
    let r = call(&mut s, &PeerRequest::Query { keys: o.keys.clone(), ttl_ms: u64::MAX });
    let Some(PeerReply::Leased { lease, ttl_ms, .. }) = r else { panic!("{r:?}") };
    assert_eq!(ttl_ms, 30_000, "a huge TTL is capped");
    assert_eq!(
        call(&mut s, &PeerRequest::Validate { lease: lease ^ 1, blocks: u64::MAX }),
        Some(PeerReply::Valid(vec![]))
    );
    let Some(PeerReply::Valid(v)) = call(&mut s, &PeerRequest::Validate { lease, blocks: u64::MAX }) else {
        panic!("no validation")
    };
    assert_eq!(v.len(), 4, "validated no more than the lease holds");
    assert_eq!(call(&mut s, &PeerRequest::Release { lease: u64::MAX }), Some(PeerReply::Released(false)));
    // A second hello on an authenticated connection closes it (its lease released).
    assert_eq!(call(&mut s, &hello), Some(PeerReply::Refused(PeerRefusal::OutOfOrder)));
    assert!(closed_within(&mut s, Duration::from_secs(5)));
    // A frame announcing 4 GiB after the hello: closed, not read.
    let (mut s, _) = handshake(&o, Some(&secret()), ns);
    s.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(5)));
    o.still_serves("huge counts");
}

/// The reader's tier is as an empty tier is.
fn assert_untouched(tier: &HostTier) {
    let s = tier.stats();
    assert_eq!(
        (s.free_slots, s.writing_slots, s.pinned_slots, s.index_entries, s.live_leases),
        (s.capacity, 0, 0, 0, 0),
        "the reader's tier changed: {s:?}"
    );
}
