//! Peers: blocks fetched from another instance's host pool through the production path
//! (`PeerServer` on the owner, `PeerClient::fetch` on the reader), with a transport double that
//! copies between the two in-process pools (`peer/double.rs`). Every fetched block is restored to
//! host arenas and checked byte for byte; every failure is checked to leave the reader's tier as it
//! was (no slot taken, no key `WRITING`).

mod common;
#[path = "peer/double.rs"]
mod double;

use common::*;
use double::Fabric;
use kvtier::internals::peer_proto::{self as proto, Frame, PeerRefusal, PeerReply, PeerRequest};
use kvtier::{
    ArenaSpec, BlockSource, ContentKey, EngineArenas, Geometry, HostTier, PeerClient, PeerError, PeerLimits,
    PeerServer, PeerSet, PeerTransport, PolicyKind, TierConfig, TransportError,
};
use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn soon() -> Instant {
    Instant::now() + Duration::from_secs(20)
}

/// An owner of `slots` slots holding `n` saved blocks (keys `0..n` of trace 7), served by a peer
/// server; returns (tier, its transport, server, keys).
struct Owner {
    tier: HostTier,
    transport: Arc<double::CopyTransport>,
    server: Option<Arc<PeerServer>>,
    keys: Vec<ContentKey>,
}

fn owner(fabric: &Arc<Fabric>, slots: u64, n: u64, limits: PeerLimits) -> Owner {
    let tier = tier(slots, PolicyKind::Lru);
    let a = arenas();
    let rank = tier.attach(a.backend().unwrap()).unwrap();
    let keys = keys(&tier, 0..n);
    let pages: Vec<u64> = (0..n).collect();
    let _ = save_filled(&rank, &a, &keys, &pages);
    let transport = fabric.transport(&tier);
    let server = Arc::new(PeerServer::bind(&tier, "127.0.0.1:0", transport.clone(), limits).unwrap());
    Owner { tier, transport, server: Some(server), keys }
}

impl Owner {
    fn addr(&self) -> std::net::SocketAddr {
        self.server.as_ref().unwrap().local_addr()
    }
}

/// Restores `lease` into pages `10..` of fresh arenas and checks the bytes against `keys`.
fn restore_and_verify(tier: &HostTier, lease: &kvtier::Lease, keys: &[ContentKey]) {
    let b = arenas();
    let rank = tier.attach(b.backend().unwrap()).unwrap();
    let pages: Vec<u64> = (0..lease.len() as u64).map(|i| 10 + i).collect();
    rank.restore(lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    b.verify(&pages, &keys[..lease.len()]).unwrap();
}
use kvtier::WaitFor;

/// The reader's tier is as an empty tier is: every slot free, none `WRITING` or pinned, no
/// index entry, no live lease.
fn assert_untouched(tier: &HostTier) {
    let s = tier.stats();
    assert_eq!(
        (s.free_slots, s.writing_slots, s.pinned_slots, s.index_entries, s.live_leases),
        (s.capacity, 0, 0, 0, 0),
        "the reader's tier changed: {s:?}"
    );
}

/// What [`reader_holding`] sets up: an owner `o` and a reader tier connected to it (`client`,
/// through `t`), with the arenas and rank its own blocks were saved from.
struct Reader {
    fabric: Arc<Fabric>,
    o: Owner,
    reader: HostTier,
    arenas: Arc<kvtier::MemcpyArenas>,
    rank: kvtier::Rank,
    t: Arc<double::CopyTransport>,
    client: PeerClient,
}

/// An owner of 8 slots holding 4 blocks, and a reader of 8 slots that holds the owner's blocks at
/// the indices `held` itself (each saved from the page of its index), connected to the owner.
fn reader_holding(held: &[u64]) -> Reader {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 4, PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    let a = arenas();
    let rank = reader.attach(a.backend().unwrap()).unwrap();
    let keys: Vec<ContentKey> = held.iter().map(|&i| o.keys[i as usize]).collect();
    let _ = save_filled(&rank, &a, &keys, held);
    let t = fabric.transport(&reader);
    let client = PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap();
    Reader { fabric, o, reader, arenas: a, rank, t, client }
}

#[test]
fn a_remote_hit_restores_the_owners_bytes_and_the_next_hit_is_local() {
    // The reader holds the first block itself: the lease continues from the peer after it.
    let Reader { fabric: _fabric, o, reader, arenas: _a, rank: _rank, t, client } = reader_holding(&[0]);
    let mut ask = o.keys.clone();
    ask.push(o.tier.namespace().trace_page_key(99, 0)); // held by nobody
    let f = client.fetch(&ask, soon()).unwrap();
    assert_eq!((f.lease.len(), f.lease.from_peer(), f.stale), (4, 3, 0));
    assert_eq!(f.lease.source(0), Some(BlockSource::Host));
    assert!((1..4).all(|i| f.lease.source(i) == Some(BlockSource::Peer)));
    assert_eq!(f.lease.source(4), None);
    assert_eq!(t.reads.load(std::sync::atomic::Ordering::Relaxed), 1, "one transport read for the batch");
    restore_and_verify(&reader, &f.lease, &o.keys);
    // The owner's lease was released; the fetched blocks are now local.
    let server = o.server.as_ref().unwrap();
    assert_eq!(server.live_leases(), 0);
    assert_eq!(o.tier.stats().pinned_slots, 0);
    let local = reader.query(&o.keys);
    assert_eq!(local.len(), 4);
    assert_eq!(client.fetched_blocks(), 3);
    // The owner's counts: one connection (still open), one lease of the 3 blocks it held of the 4
    // asked, all 3 validated, nothing pinned or leased any more.
    let st = server.stats();
    assert_eq!(
        (st.connections, st.connections_accepted, st.leases_granted, st.blocks_leased),
        (1, 1, 1, 3),
        "the owner's stats: {st:?}"
    );
    assert_eq!((st.blocks_validated, st.blocks_invalid, st.leases, st.pinned_blocks), (3, 0, 0, 0), "{st:?}");
}

#[test]
fn a_fetched_run_that_reaches_a_block_held_locally_goes_on_from_there() {
    // The reader holds k0 and k2 (k1 was evicted there, say); the owner holds k0-k3.
    let Reader { fabric: _fabric, o, reader, arenas: _a, rank: _rank, t, client } = reader_holding(&[0, 2]);
    let f = client.fetch(&o.keys, soon()).unwrap();
    let sources: Vec<_> = (0..f.lease.len()).map(|i| f.lease.source(i).unwrap()).collect();
    assert_eq!(
        sources,
        [BlockSource::Host, BlockSource::Peer, BlockSource::Host, BlockSource::Peer],
        "the whole prefix: k1 and k3 from the peer, k0 and k2 local"
    );
    assert_eq!((f.lease.from_peer(), f.stale), (2, 0));
    assert_eq!(t.reads.load(std::sync::atomic::Ordering::Relaxed), 2, "one read per fetched run");
    restore_and_verify(&reader, &f.lease, &o.keys);
    drop(f);
    let s = reader.stats();
    assert_eq!((s.ready_slots, s.writing_slots, s.pinned_slots), (4, 0, 0));
    assert_eq!(o.server.as_ref().unwrap().live_leases(), 0);
}

#[test]
fn a_slot_reused_between_pin_and_read_is_dropped_never_served() {
    let fabric = Fabric::new();
    // The owner's pool holds exactly its 4 blocks: new saves must reuse their slots.
    let o = owner(&fabric, 4, 4, PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    let t = fabric.transport(&reader);
    let client =
        PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap().with_lease_ttl(Duration::from_millis(1));
    let (otier, server) = (o.tier.clone(), o.server.clone().unwrap());
    let others = keys(&o.tier, 100..104);
    let others2 = others.clone();
    // Between the owner's pin and the read: the owner's lease expires, the owner evicts its blocks
    // and saves other keys into the same slots.
    t.on_next_read(move || {
        std::thread::sleep(Duration::from_millis(5));
        assert_eq!(server.expire_leases(), 1);
        assert_eq!(otier.evict(usize::MAX), 4);
        let a = arenas();
        let rank = otier.attach(a.backend().unwrap()).unwrap();
        let _ = save_filled(&rank, &a, &others2, &[0, 1, 2, 3]);
    });
    let f = client.fetch(&o.keys, soon()).unwrap();
    assert_eq!((f.lease.len(), f.stale), (0, 4), "no stale block served");
    drop(f);
    assert_untouched(&reader);
    assert!(o.keys.iter().all(|k| !reader.contains(k)));
    assert_eq!(client.stale_blocks(), 4);
    // The owner counts the four as read but invalid (its lease had expired).
    let st = o.server.as_ref().unwrap().stats();
    assert_eq!((st.blocks_leased, st.blocks_validated, st.blocks_invalid), (4, 0, 4), "{st:?}");
    // The owner now holds the other keys' bytes where the fetched keys were.
    assert_eq!(o.tier.query(&others).len(), 4);
}

#[test]
fn a_lease_that_expires_mid_read_serves_nothing_and_unpins_the_owner() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 3, PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    let t = fabric.transport(&reader);
    let client =
        PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap().with_lease_ttl(Duration::from_millis(1));
    let server = o.server.clone().unwrap();
    t.on_next_read(move || {
        std::thread::sleep(Duration::from_millis(5));
        server.expire_leases();
    });
    let f = client.fetch(&o.keys, soon()).unwrap();
    assert_eq!((f.lease.len(), f.stale), (0, 3), "blocks of an expired lease are never served");
    drop(f);
    assert_untouched(&reader);
    assert_eq!(o.server.as_ref().unwrap().live_leases(), 0);
    assert_eq!(o.tier.stats().pinned_slots, 0, "the expired lease's pins are gone on the owner");
}

#[test]
fn the_owners_lease_pins_its_blocks_until_it_expires() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 4, 4, PeerLimits { max_lease_ttl: Duration::from_millis(50), ..PeerLimits::default() });
    let (mut s, _) = raw_hello(&fabric, o.addr(), o.tier.namespace(), proto::PEER_PROTOCOL_VERSION);
    let Ok(PeerReply::Leased { lease, ttl_ms, blocks }) =
        call(&mut s, &PeerRequest::Query { keys: o.keys.clone(), ttl_ms: u64::MAX })
    else {
        panic!("no lease")
    };
    assert_eq!((ttl_ms, blocks.len()), (50, 4), "a huge TTL is capped at the owner's limit");
    assert_ne!(lease, 0);
    assert_eq!(o.tier.evict(usize::MAX), 0, "leased blocks cannot be evicted");
    std::thread::sleep(Duration::from_millis(60));
    o.server.as_ref().unwrap().expire_leases();
    assert_eq!(call(&mut s, &PeerRequest::Validate { lease, blocks: 4 }).unwrap(), PeerReply::Valid(vec![]));
    assert_eq!(o.tier.stats().pinned_slots, 0);
    assert_eq!(o.tier.evict(usize::MAX), 4, "an expired lease lets its blocks go");
}

#[test]
fn an_owner_gone_mid_read_is_a_typed_error_and_the_reader_is_unchanged() {
    let fabric = Fabric::new();
    let mut o = owner(&fabric, 8, 4, PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    let t = fabric.transport(&reader);
    let client = PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap();
    let (server, otier, fab, id) = (o.server.take().unwrap(), o.tier.clone(), fabric.clone(), o.transport.id);
    t.on_next_read(move || {
        fab.unregister(id);
        drop(server);
        drop(otier);
    });
    let e = client.fetch(&o.keys, soon()).unwrap_err();
    assert!(matches!(e, PeerError::Transport(TransportError::Disconnected)), "{e}");
    assert_untouched(&reader);
    // The control connection is gone too: the next fetch says so.
    let e = client.fetch(&o.keys, soon()).unwrap_err();
    assert!(matches!(e, PeerError::OwnerGone | PeerError::Network(_)), "{e}");
    assert_untouched(&reader);
}

#[test]
fn a_read_past_its_deadline_is_a_typed_error_and_the_reader_is_unchanged() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 4, PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    // The reader holds block 0: its pin is let go with the failed fetch.
    let a = arenas();
    let rank = reader.attach(a.backend().unwrap()).unwrap();
    let _ = save_filled(&rank, &a, &o.keys[..1], &[0]);
    let before = reader.stats();
    let t = fabric.transport(&reader);
    let client = PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    t.on_next_read(move || std::thread::sleep(Duration::from_millis(2500)));
    let e = client.fetch(&o.keys, deadline).unwrap_err();
    assert!(matches!(e, PeerError::Transport(TransportError::Deadline)), "{e}");
    let after = reader.stats();
    assert_eq!(
        (after.free_slots, after.writing_slots, after.pinned_slots, after.index_entries, after.live_leases),
        (before.free_slots, 0, 0, 1, 0)
    );
}

#[test]
fn two_readers_fetch_the_same_blocks_at_once() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 6, PeerLimits::default());
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (fabric, o) = (&fabric, &o);
            s.spawn(move || {
                let reader = tier(8, PolicyKind::Lru);
                let client = PeerClient::connect(o.addr(), &reader, fabric.transport(&reader), soon()).unwrap();
                for _ in 0..20 {
                    let f = client.fetch(&o.keys, soon()).unwrap();
                    assert_eq!(f.lease.len(), 6);
                    restore_and_verify(&reader, &f.lease, &o.keys);
                    drop(f);
                    assert_eq!(reader.evict(usize::MAX), 6);
                }
            });
        }
    });
    assert_eq!(o.server.as_ref().unwrap().live_leases(), 0);
    assert_eq!(o.tier.stats().pinned_slots, 0);
}

/// A raw control connection that has said hello with `version` in namespace `ns` (without a
/// secret, as the owners here have none), with a descriptor the owner can load; returns it and
/// the hello's last reply (the refusal of the hello, or the answer to the proof).
fn raw_hello(
    fabric: &Arc<Fabric>,
    addr: std::net::SocketAddr,
    ns: kvtier::Namespace,
    version: u32,
) -> (TcpStream, PeerReply) {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let descriptor = fabric.transport(&tier(1, PolicyKind::Lru)).local_descriptor().unwrap();
    let nonce = proto::nonce().unwrap();
    let owner_nonce = match call(&mut s, &PeerRequest::Hello { magic: proto::PEER_MAGIC, version, nonce }).unwrap() {
        PeerReply::Challenge { nonce } => nonce,
        r => return (s, r),
    };
    let mac = proto::mac(None, proto::Role::Reader, &nonce, &owner_nonce, &ns, 0, &descriptor);
    let r = call(&mut s, &PeerRequest::Auth { mac, namespace: ns, descriptor }).unwrap();
    (s, r)
}

/// True once the owner has closed `s` (a read sees end of stream or a reset).
fn closed(s: &mut TcpStream) -> bool {
    use std::io::Read;
    let mut b = [0u8; 1];
    matches!(s.read(&mut b), Ok(0) | Err(_))
}

#[test]
fn another_protocol_version_or_namespace_is_refused() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 2, PeerLimits::default());
    let (mut s, r) = raw_hello(&fabric, o.addr(), o.tier.namespace(), proto::PEER_PROTOCOL_VERSION + 1);
    assert_eq!(
        r,
        PeerReply::Refused(PeerRefusal::Version {
            ours: proto::PEER_PROTOCOL_VERSION,
            theirs: proto::PEER_PROTOCOL_VERSION + 1
        })
    );
    assert!(closed(&mut s));
    // A reader of another model: its keys are another namespace's.
    let g = Geometry::new(
        "other-model",
        16,
        vec![ArenaSpec::packed("big", 4096, 64), ArenaSpec::packed("small", 1024, 64)],
    )
    .unwrap();
    let other =
        HostTier::new(TierConfig::new(g.clone(), 8 * g.slot_bytes()).with_backing(kvtier::BackingChoice::Plain))
            .unwrap();
    let e = PeerClient::connect(o.addr(), &other, fabric.transport(&other), soon()).unwrap_err();
    assert!(matches!(e, PeerError::Namespace { .. }), "{e}");
    assert_untouched(&other);
    // The owner goes on serving others.
    let reader = tier(8, PolicyKind::Lru);
    let client = PeerClient::connect(o.addr(), &reader, fabric.transport(&reader), soon()).unwrap();
    assert_eq!(client.fetch(&o.keys, soon()).unwrap().lease.len(), 2);
}

#[test]
fn requests_over_the_limits_are_refused_without_harming_other_connections() {
    let fabric = Fabric::new();
    let limits = PeerLimits { keys_per_query: 4, leases_per_connection: 2, frame_bytes: 4096, ..PeerLimits::default() };
    let o = owner(&fabric, 8, 4, limits);
    let reader = tier(8, PolicyKind::Lru);
    let client = PeerClient::connect(o.addr(), &reader, fabric.transport(&reader), soon()).unwrap();
    let ns = o.tier.namespace();
    // Too many keys: refused, the connection stays usable.
    let (mut s, _) = raw_hello(&fabric, o.addr(), ns, proto::PEER_PROTOCOL_VERSION);
    let many = keys(&o.tier, 0..5);
    assert_eq!(
        call(&mut s, &PeerRequest::Query { keys: many, ttl_ms: 1000 }).unwrap(),
        PeerReply::Refused(PeerRefusal::Limit { what: "keys per query".into(), asked: 5, max: 4 })
    );
    // Too many live leases on one connection.
    for _ in 0..2 {
        assert!(matches!(
            call(&mut s, &PeerRequest::Query { keys: o.keys.clone(), ttl_ms: 1000 }).unwrap(),
            PeerReply::Leased { .. }
        ));
    }
    assert!(matches!(
        call(&mut s, &PeerRequest::Query { keys: o.keys.clone(), ttl_ms: 1000 }).unwrap(),
        PeerReply::Refused(PeerRefusal::Limit { .. })
    ));
    assert_eq!(o.server.as_ref().unwrap().live_leases(), 2);
    let st = o.server.as_ref().unwrap().stats();
    assert_eq!(
        (st.refused_keys_per_query, st.refused_leases_per_connection, st.refused_pinned_blocks, st.leases),
        (1, 1, 0, 2),
        "each refusal counted under its bound: {st:?}"
    );
    // Closing the connection releases its leases.
    drop(s);
    let t0 = Instant::now();
    while o.server.as_ref().unwrap().live_leases() != 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "a closed connection kept its leases");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(o.tier.stats().pinned_slots, 0);
    // An oversized frame (a length prefix of 4 GiB - 1) and a malformed one close that connection only.
    let (mut big, _) = raw_hello(&fabric, o.addr(), ns, proto::PEER_PROTOCOL_VERSION);
    big.write_all(&u32::MAX.to_le_bytes()).unwrap();
    assert!(closed(&mut big));
    let (mut junk, _) = raw_hello(&fabric, o.addr(), ns, proto::PEER_PROTOCOL_VERSION);
    junk.write_all(&[3, 0, 0, 0, 0xff, 0xff, 0xff]).unwrap();
    assert!(closed(&mut junk));
    // A request before the hello closes that connection too.
    let mut early = TcpStream::connect(o.addr()).unwrap();
    early.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    assert_eq!(
        call(&mut early, &PeerRequest::Validate { lease: 1, blocks: 1 }).unwrap(),
        PeerReply::Refused(PeerRefusal::OutOfOrder)
    );
    assert!(closed(&mut early));
    // The other connection is served as before.
    let f = client.fetch(&o.keys, soon()).unwrap();
    assert_eq!(f.lease.len(), 4);
    restore_and_verify(&reader, &f.lease, &o.keys);
}

fn call(s: &mut TcpStream, req: &PeerRequest) -> std::io::Result<PeerReply> {
    let mut buf = Vec::new();
    proto::write_msg(s, req, &mut buf)?;
    match proto::read_msg::<PeerReply>(s, &mut buf, 64 << 20)? {
        Frame::Msg(m) => Ok(m),
        other => panic!("bad reply frame {other:?}"),
    }
}

#[test]
fn peers_pin_no_more_than_their_budget_and_the_owner_keeps_victims() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 4, PeerLimits { pinned_blocks: Some(2), ..PeerLimits::default() });
    let server = o.server.as_ref().unwrap();
    let (mut s, _) = raw_hello(&fabric, o.addr(), o.tier.namespace(), proto::PEER_PROTOCOL_VERSION);
    let leased = |r: PeerReply| match r {
        PeerReply::Leased { blocks, .. } => blocks.len(),
        r => panic!("expected a lease, got {r:?}"),
    };
    // A query of four is answered with the two that fit.
    assert_eq!(
        leased(call(&mut s, &PeerRequest::Query { keys: o.keys.clone(), ttl_ms: 60_000 }).unwrap()),
        2,
        "a query is answered with the prefix that fits the pin budget"
    );
    // Blocks peers pin already cost nothing: a second lease on them is granted...
    assert_eq!(leased(call(&mut s, &PeerRequest::Query { keys: o.keys[..2].to_vec(), ttl_ms: 60_000 }).unwrap()), 2);
    // ... a block not yet pinned is refused, by a query and by a hold.
    assert_eq!(
        call(&mut s, &PeerRequest::Query { keys: o.keys[2..].to_vec(), ttl_ms: 60_000 }).unwrap(),
        PeerReply::Refused(PeerRefusal::Limit { what: "blocks pinned for peers".into(), asked: 2, max: 2 })
    );
    assert_eq!(server.hold(&o.keys[2..], Duration::from_secs(60)), 0);
    assert_eq!(o.tier.stats().pinned_slots, 2);
    let st = server.stats();
    assert_eq!((st.pinned_blocks, st.pin_budget, st.refused_pinned_blocks, st.leases), (2, 2, 1, 2), "{st:?}");
    // The owner's own pressure still finds its victims: the two blocks peers do not pin.
    assert_eq!(o.tier.evict(usize::MAX), 2);
    assert!(o.keys[..2].iter().all(|k| o.tier.contains(k)));
    // Another reader is served the pinned two, bytes checked.
    let reader = tier(8, PolicyKind::Lru);
    let client = PeerClient::connect(o.addr(), &reader, fabric.transport(&reader), soon()).unwrap();
    let f = client.fetch(&o.keys, soon()).unwrap();
    assert_eq!(f.lease.len(), 2);
    restore_and_verify(&reader, &f.lease, &o.keys);
    // A budget of 0 is refused when the server is built.
    let t = tier(4, PolicyKind::Lru);
    let zero = PeerLimits { pinned_blocks: Some(0), ..PeerLimits::default() };
    assert!(matches!(PeerServer::bind(&t, "127.0.0.1:0", fabric.transport(&t), zero), Err(PeerError::Config(_))));
    // So is one over the pool's 4 slots.
    let over = PeerLimits { pinned_blocks: Some(5), ..PeerLimits::default() };
    assert!(matches!(PeerServer::bind(&t, "127.0.0.1:0", fabric.transport(&t), over), Err(PeerError::Config(_))));
}

#[test]
fn the_pin_budget_returns_when_leases_are_released_or_their_connection_closes() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 4, PeerLimits { pinned_blocks: Some(2), ..PeerLimits::default() });
    let server = o.server.as_ref().unwrap();
    let query = |s: &mut TcpStream, keys: &[ContentKey]| match call(
        s,
        &PeerRequest::Query { keys: keys.to_vec(), ttl_ms: 60_000 },
    )
    .unwrap()
    {
        PeerReply::Leased { lease, blocks, .. } => (lease, blocks.len()),
        // Nothing fits the budget.
        PeerReply::Refused(PeerRefusal::Limit { .. }) => (0, 0),
        r => panic!("expected a lease, got {r:?}"),
    };
    let (mut a, _) = raw_hello(&fabric, o.addr(), o.tier.namespace(), proto::PEER_PROTOCOL_VERSION);
    // k0 and k1 fill the budget; released, the budget is whole again for k2 and k3.
    let (lease, n) = query(&mut a, &o.keys[..2]);
    assert_eq!(n, 2);
    assert_eq!(call(&mut a, &PeerRequest::Release { lease }).unwrap(), PeerReply::Released(true));
    let (_, n) = query(&mut a, &o.keys[2..]);
    assert_eq!(n, 2, "a released lease gives its blocks back to the pin budget");
    // The connection closes with k2 and k3 leased: the budget returns when its leases go.
    drop(a);
    let until = Instant::now() + Duration::from_secs(10);
    while server.live_leases() > 0 {
        assert!(Instant::now() < until, "a closed connection's leases are released");
        std::thread::sleep(Duration::from_millis(5));
    }
    let (mut b, _) = raw_hello(&fabric, o.addr(), o.tier.namespace(), proto::PEER_PROTOCOL_VERSION);
    let (_, n) = query(&mut b, &o.keys[..2]);
    assert_eq!(n, 2, "a closed connection gives its blocks back to the pin budget");
    drop(b);
    while server.live_leases() > 0 {
        assert!(Instant::now() < until, "a closed connection's leases are released");
        std::thread::sleep(Duration::from_millis(5));
    }
    // A hold that a fetch ended gives its blocks back too.
    assert_eq!(server.hold(&o.keys[2..], Duration::from_secs(60)), 2);
    let reader = tier(8, PolicyKind::Lru);
    let client = PeerClient::connect(o.addr(), &reader, fabric.transport(&reader), soon()).unwrap();
    let f = client.fetch(&o.keys[2..], soon()).unwrap();
    assert_eq!(f.lease.len(), 2);
    drop((f, client));
    while server.live_leases() > 0 {
        assert!(Instant::now() < until, "a closed connection's leases are released");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(server.held_blocks(), 0);
    assert_eq!(server.hold(&o.keys[..2], Duration::from_secs(60)), 2, "a fetched hold gives its block back");
    assert_eq!(o.tier.stats().pinned_slots, 2);
}

#[test]
fn a_peer_set_query_continues_each_peers_prefix_and_skips_the_failed() {
    let fabric = Fabric::new();
    // Owner A holds k0 k1, owner B k0..k3; the first address has nothing listening.
    let a = owner(&fabric, 8, 2, PeerLimits::default());
    let mut b = owner(&fabric, 8, 4, PeerLimits::default());
    let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let reader = tier(16, PolicyKind::Lru);
    let addrs = [dead.to_string(), a.addr().to_string(), b.addr().to_string()];
    let peers = PeerSet::new(&reader, fabric.transport(&reader), addrs.iter().cloned()).unwrap();
    let k = keys(&reader, 0..6);
    let queries = reader.stats().queries;
    let f = peers.query(&k[..4], soon());
    // The dead address failed: it is paused (200 ms at first), not connected to again at once.
    let paused = peers.query(&k[4..], soon());
    assert!(matches!(paused.errors.first(), Some((0, PeerError::Paused { .. }))), "{:?}", paused.errors);
    drop(paused);
    assert_eq!(f.lease.len(), 4, "the longest prefix across the peers: A's two, then B's next two");
    assert_eq!(f.peer, Some(2));
    assert!(matches!(f.errors.as_slice(), [(0, PeerError::Connect { .. })]), "{:?}", f.errors);
    // A's blocks were local by the time B was asked; the lease still names them as a peer's.
    assert_eq!(f.fetched, 4);
    let sources: Vec<_> = (0..4).map(|i| f.lease.source(i).unwrap()).collect();
    assert_eq!(sources, [BlockSource::Peer; 4], "every block came from a peer, A's two as B's");
    assert_eq!(reader.stats().queries, queries + 2, "one query each, however many peers it asked");
    restore_and_verify(&reader, &f.lease, &k);
    drop(f);
    // Held locally now: no peer is asked.
    let again = peers.query(&k[..4], soon());
    assert_eq!((again.lease.len(), again.peer, again.fetched, again.errors.len()), (4, None, 0, 0));
    assert!((0..4).all(|i| again.lease.source(i) == Some(BlockSource::Host)));
    drop(again);
    // B goes away: its failure is recorded, the local prefix is still served, nothing changed.
    fabric.unregister(b.transport.id);
    drop(b.server.take());
    let before = reader.stats();
    let f = peers.query(&k, soon());
    assert_eq!((f.lease.len(), f.peer), (4, None));
    assert_eq!(f.errors.iter().map(|(i, _)| *i).collect::<Vec<_>>(), vec![0, 2]);
    drop(f);
    let after = reader.stats();
    assert_eq!(
        (after.free_slots, after.index_entries, after.pinned_slots),
        (before.free_slots, before.index_entries, 0)
    );
    // The configuration is checked.
    let t = reader.clone();
    assert!(matches!(PeerSet::new(&t, fabric.transport(&t), ["x:1", "x:1"]), Err(PeerError::Config(_))));
    assert!(matches!(PeerSet::new(&t, fabric.transport(&t), [" "]), Err(PeerError::Config(_))));
    assert!(matches!(peers.fetch_from(3, &k, soon()), Err(PeerError::Config(_))));
}

#[test]
fn blocks_held_for_a_peer_stay_until_fetched_or_their_ttl() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 4, 3, PeerLimits::default());
    let server = o.server.as_ref().unwrap();
    assert_eq!(server.hold(&o.keys[2..], Duration::from_millis(1)), 1);
    assert_eq!(server.hold(&o.keys[..2], Duration::from_secs(60)), 2);
    assert_eq!(o.tier.evict(usize::MAX), 0, "held blocks cannot be evicted");
    // A hold is let go when its TTL passes...
    std::thread::sleep(Duration::from_millis(5));
    server.expire_leases();
    assert_eq!(server.held_blocks(), 2);
    assert_eq!(o.tier.evict(usize::MAX), 1);
    // ... or once a peer fetched its block.
    let reader = tier(8, PolicyKind::Lru);
    let client = PeerClient::connect(o.addr(), &reader, fabric.transport(&reader), soon()).unwrap();
    let f = client.fetch(&o.keys[..2], soon()).unwrap();
    assert_eq!(f.lease.len(), 2);
    restore_and_verify(&reader, &f.lease, &o.keys);
    assert_eq!(server.held_blocks(), 0, "a fetched block is no longer held");
    assert_eq!(o.tier.evict(usize::MAX), 2);
}

#[test]
fn a_key_a_local_save_reserved_first_ends_the_fetched_run() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 4, PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    // A local save of k2 is in flight (WRITING) while the fetch runs.
    let (a, gate) = (arenas(), Gate::default());
    let rank = reader.attach(TestBackend::gated(&a, &gate)).unwrap();
    a.fill(&[5], &o.keys[2..3]).unwrap();
    let ticket = rank.save(&o.keys[2..3], &[5], WaitFor::Nothing).unwrap();
    assert_eq!(reader.stats().writing_slots, 1);
    // The owner holds all four for a peer: only the two fetched are let go.
    assert_eq!(o.server.as_ref().unwrap().hold(&o.keys, Duration::from_secs(60)), 4);
    let client = PeerClient::connect(o.addr(), &reader, fabric.transport(&reader), soon()).unwrap();
    let f = client.fetch(&o.keys, soon()).unwrap();
    assert_eq!((f.lease.len(), f.lease.from_peer(), f.stale), (2, 2, 0), "the run ends at the key being saved");
    assert_eq!(o.server.as_ref().unwrap().held_blocks(), 2, "blocks not read are still held");
    restore_and_verify(&reader, &f.lease, &o.keys);
    drop(f);
    assert_eq!(reader.stats().writing_slots, 1, "the local save's reservation is untouched");
    gate.open();
    ticket.handle.wait().unwrap();
    let s = reader.stats();
    assert_eq!((s.writing_slots, s.ready_slots, s.pinned_slots), (0, 3, 0));
    assert_eq!(o.server.as_ref().unwrap().live_leases(), 0);
    assert_eq!(o.tier.stats().pinned_slots, 2, "the two blocks still held");
}

#[test]
fn a_transport_that_panics_mid_fetch_leaves_no_pin_and_no_reserved_slot() {
    // The reader holds k0 (pinned by the fetch's lease while the owner's run is read); the read of
    // k1-k3 panics inside the transport. The unwind must let go of everything the fetch took.
    let Reader { fabric: _fabric, o, reader, arenas: _a, rank: _rank, t, client } = reader_holding(&[0]);
    t.on_next_read(|| panic!("the transport panics"));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| client.fetch(&o.keys, soon())));
    assert!(r.is_err(), "the transport's panic reaches the caller");
    let s = reader.stats();
    assert_eq!(
        (s.pinned_slots, s.writing_slots, s.live_leases, s.free_slots),
        (0, 0, 0, s.capacity - 1),
        "an unwind through a fetch left pins, reserved slots or a lease behind: {s:?}"
    );
    // The owner's lease on k0-k3 goes when its connection does; a new client fetches them all.
    drop(client);
    let again = PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap();
    let f = again.fetch(&o.keys, soon()).unwrap();
    assert_eq!((f.lease.len(), f.lease.from_peer()), (4, 3));
    restore_and_verify(&reader, &f.lease, &o.keys);
}

#[test]
fn a_read_past_its_deadline_keeps_its_slots_quarantined_until_the_transfer_is_over() {
    // The fetch reserves four of the reader's eight slots; what the reader saves next may land in
    // them if they are let go while the transfer can still write.
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 4, PeerLimits::default());
    let reader = tier(8, PolicyKind::Lru);
    let t = fabric.transport(&reader);
    let client = PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap();
    let late = t.late_next_read();
    let e = client.fetch(&o.keys, Instant::now() + Duration::from_millis(300)).unwrap_err();
    assert!(matches!(e, PeerError::Transport(TransportError::Deadline)), "{e}");
    let s = reader.stats();
    assert_eq!(
        (s.quarantined_slots, s.free_slots, s.writing_slots, s.index_entries),
        (4, 4, 0, 0),
        "a slot a transfer may still write must stay quarantined until the transport says it is over: {s:?}"
    );
    // The reader saves its own blocks meanwhile (into whatever slots it has), then the late
    // bytes land: the reader's blocks keep their own bytes.
    let a = arenas();
    let rank = reader.attach(a.backend().unwrap()).unwrap();
    let mine = keys(&reader, 100..104);
    let saved = save_filled(&rank, &a, &mine, &[0, 1, 2, 3]);
    late.release.send(()).unwrap();
    late.landed.recv_timeout(Duration::from_secs(10)).unwrap();
    let held = reader.query(&mine);
    if !held.is_empty() {
        let b = arenas();
        let r2 = reader.attach(b.backend().unwrap()).unwrap();
        let pages: Vec<u64> = (0..held.len() as u64).map(|i| 10 + i).collect();
        r2.restore(&held, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
        b.verify(&pages, &mine[..held.len()]).expect("a block saved after the failed fetch has its own bytes");
    }
    drop((held, saved));
    // Over: the slots are free again, and the fetch goes through.
    let s = reader.stats();
    assert_eq!(s.quarantined_slots, 0, "the transfer is over: its slots are back: {s:?}");
    assert_eq!(reader.evict(usize::MAX), s.ready_slots as usize);
    // The failed fetch broke its connection: a new one fetches the owner's bytes.
    let again = PeerClient::connect(o.addr(), &reader, t.clone(), soon()).unwrap();
    let f = again.fetch(&o.keys, soon()).unwrap();
    assert_eq!(f.lease.len(), 4);
    restore_and_verify(&reader, &f.lease, &o.keys);
}

#[test]
fn a_peer_set_drops_an_idle_connection_the_owner_closed_and_pauses_no_one() {
    let fabric = Fabric::new();
    let o = owner(&fabric, 8, 4, PeerLimits { idle_timeout: Duration::from_millis(200), ..PeerLimits::default() });
    let server = o.server.as_ref().unwrap();
    let reader = tier(8, PolicyKind::Lru);
    let peers = PeerSet::new(&reader, fabric.transport(&reader), [o.addr().to_string()]).unwrap();
    let f = peers.query(&o.keys[..2], soon());
    assert_eq!((f.lease.len(), f.errors.len()), (2, 0), "{:?}", f.errors);
    drop(f);
    // The connection idles in the set; the owner closes it after its idle timeout.
    let t0 = Instant::now();
    while server.stats().connections > 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the owner closes a connection idle past its timeout");
        std::thread::sleep(Duration::from_millis(5));
    }
    let f = peers.query(&o.keys, soon());
    assert!(
        f.errors.is_empty(),
        "an idle connection the owner closed must not be used (a failure that pauses a healthy peer): {:?}",
        f.errors
    );
    assert_eq!(f.lease.len(), 4);
    restore_and_verify(&reader, &f.lease, &o.keys);
}
