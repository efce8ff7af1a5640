//! `NixlTransport` between two processes (feature `nixl`): this test binary re-executes itself as
//! the owner (`nixl_owner_role`, selected by `KVTIER_NIXL_OWNER`), which saves blocks of known
//! bytes (the key's pattern, `kvtier::pattern`) into its host tier, registers its pool with NIXL and
//! prints its descriptor and the blocks' slot offsets, and serves the peer protocol (`PeerServer`)
//! over the same transport. The first tests load the descriptor and read the blocks one-sided into
//! the reader's pool (`NixlTransport::read`); the last ones fetch them end to end
//! (`PeerClient::fetch`: query, read, generation check, publish). Every byte is checked against
//! the pattern.
//!
//! Run with one test thread (NIXL's agents may deadlock under parallel tests):
//! `cargo test --release -p kvtier --features nixl --test peer_nixl -- --test-threads=1`.
//! Without the NIXL runtime (`libnixl_capi.so` on `LD_LIBRARY_PATH`, `NIXL_PLUGIN_DIR`; see
//! `ci/nixl.sh`) each test is skipped with a message; with `KVTIER_REQUIRE_NIXL=1` (CI sets it) its
//! absence fails them instead. Every wait is bounded.

use kvtier::{
    pattern, ArenaSpec, BlockRead, BlockSource, ContentKey, EngineArenas, Geometry, HostTier, MemcpyArenas,
    NixlTransport, PeerClient, PeerError, PeerLimits, PeerServer, PeerTransport, ReadDone, TierConfig, TransportError,
    WaitFor,
};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

/// Set (to anything) in the owner process.
const OWNER_ENV: &str = "KVTIER_NIXL_OWNER";
/// Blocks the owner saves.
const BLOCKS: u64 = 16;
/// Slots of each side's pool.
const SLOTS: u64 = 24;
/// The longest a step may take before the test fails instead of hanging.
const BOUND: Duration = Duration::from_secs(20);

/// Two arenas of 64 KiB and 16 KiB per page: 80 KiB blocks.
fn geometry() -> Geometry {
    Geometry::new("nixl-test", 16, vec![ArenaSpec::packed("k", 65_536, 32), ArenaSpec::packed("v", 16_384, 32)])
        .unwrap()
}

fn tier() -> HostTier {
    let g = geometry();
    HostTier::new(TierConfig::new(g.clone(), SLOTS * g.slot_bytes()).with_backing(kvtier::BackingChoice::Plain))
        .unwrap()
}

fn keys(tier: &HostTier) -> Vec<ContentKey> {
    (0..BLOCKS).map(|i| tier.namespace().trace_page_key(i, 0)).collect()
}

/// False (after printing why) when the NIXL runtime is missing and not required.
fn runtime(test: &str) -> bool {
    if NixlTransport::runtime_available() {
        return true;
    }
    let required = std::env::var("KVTIER_REQUIRE_NIXL").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "KVTIER_REQUIRE_NIXL=1 but the NIXL runtime was not found: put libnixl_capi.so on LD_LIBRARY_PATH and \
         set NIXL_PLUGIN_DIR (eval \"$(bash ci/nixl.sh)\")"
    );
    // Without the runtime the transport refuses with a typed error (no NIXL call, which would abort).
    let e = NixlTransport::new("kvtier-no-runtime", tier().pool()).unwrap_err();
    assert!(matches!(e, TransportError::Backend(ref m) if m.contains("NIXL runtime not found")), "{e:?}");
    eprintln!("SKIPPED {test}: the NIXL runtime (libnixl_capi.so) was not found; see ci/nixl.sh");
    false
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// The owner: saves `BLOCKS` blocks, prints `descriptor HEX` and `offsets O,O,...`, then `ready`,
/// and waits until its stdin closes (or it is killed). A no-op outside the owner process.
#[test]
fn nixl_owner_role() {
    if std::env::var_os(OWNER_ENV).is_none() {
        return;
    }
    let tier = tier();
    let gpu = std::sync::Arc::new(MemcpyArenas::new(tier.geometry()).unwrap());
    let rank = tier.attach(gpu.backend().unwrap()).unwrap();
    let keys = keys(&tier);
    let pages: Vec<u64> = (0..BLOCKS).collect();
    gpu.fill(&pages, &keys).unwrap();
    rank.save(&keys, &pages, WaitFor::Nothing).unwrap().handle.wait().unwrap();
    let lease = tier.query(&keys); // pins the blocks while the reader reads them
    assert_eq!(lease.len() as u64, BLOCKS);
    let slot_bytes = tier.pool().slot_bytes();
    let offsets: Vec<String> = lease.slots().map(|s| (u64::from(s.get()) * slot_bytes).to_string()).collect();
    let transport = Arc::new(NixlTransport::new(&format!("kvtier-owner-{}", std::process::id()), tier.pool()).unwrap());
    let descriptor = transport.local_descriptor().unwrap();
    // The peer protocol's owner over the same transport (the end-to-end tests below).
    let server = PeerServer::bind(&tier, "127.0.0.1:0", transport, PeerLimits::default()).unwrap();
    let mut out = std::io::stdout().lock();
    writeln!(out, "descriptor {}", hex(&descriptor)).unwrap();
    writeln!(out, "addr {}", server.local_addr()).unwrap();
    writeln!(out, "offsets {}", offsets.join(",")).unwrap();
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    drop(out);
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
    server.shutdown();
    drop(lease);
}

/// An owner process and what it printed.
struct Owner {
    child: Child,
    /// Closing it ends the owner.
    stdin: Option<ChildStdin>,
    descriptor: Vec<u8>,
    /// Byte offsets of blocks `0..BLOCKS` in the owner's pool.
    offsets: Vec<u64>,
    /// The owner's `PeerServer` (control protocol).
    addr: String,
}

impl Owner {
    fn start() -> Owner {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "nixl_owner_role", "--nocapture", "--test-threads=1"])
            .env(OWNER_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            // Drains to the end (a closed pipe would fail the owner's own test output).
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let (mut descriptor, mut offsets, mut addr) = (None, None, None);
        let until = Instant::now() + BOUND;
        loop {
            let line = rx
                .recv_timeout(until.saturating_duration_since(Instant::now()))
                .expect("the owner printed `ready` within the bound (or exited: see its stderr)");
            // The owner's test harness may have printed `test nixl_owner_role ... ` before the line.
            if let Some((_, d)) = line.split_once("descriptor ") {
                descriptor = Some(unhex(d));
            } else if let Some((_, a)) = line.split_once("addr ") {
                addr = Some(a.to_string());
            } else if let Some((_, o)) = line.split_once("offsets ") {
                offsets = Some(o.split(',').map(|x| x.parse().unwrap()).collect());
            } else if line.ends_with("ready") {
                break;
            }
        }
        Owner { child, stdin, descriptor: descriptor.unwrap(), offsets: offsets.unwrap(), addr: addr.unwrap() }
    }

    fn kill(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }
}

impl Drop for Owner {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let until = Instant::now() + BOUND;
        while self.child.try_wait().unwrap().is_none() {
            if Instant::now() > until {
                let _ = self.child.kill();
                let _ = self.child.wait();
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

/// The reader's side: its tier (for the pool) and its transport.
struct Reader {
    tier: HostTier,
    transport: Arc<NixlTransport>,
}

impl Reader {
    fn new(tag: &str) -> Reader {
        let tier = tier();
        let transport =
            Arc::new(NixlTransport::new(&format!("kvtier-reader-{tag}-{}", std::process::id()), tier.pool()).unwrap());
        Reader { tier, transport }
    }

    fn slot_bytes(&self) -> u64 {
        self.tier.pool().slot_bytes()
    }

    /// The bytes of local slot `slot` (a copy).
    fn slot(&self, slot: u32) -> Vec<u8> {
        let p = self.tier.pool().slot_ptr(kvtier::SlotId::new(slot));
        // SAFETY: the slot lies inside the reader's pool mapping, which lives as long as `self`;
        // no read is in flight (reads return only when complete or refused).
        unsafe { std::slice::from_raw_parts(p, self.slot_bytes() as usize) }.to_vec()
    }

    /// Sets every byte of local slot `slot` to `byte`.
    fn fill(&self, slot: u32, byte: u8) {
        let p = self.tier.pool().slot_ptr(kvtier::SlotId::new(slot));
        // SAFETY: as in `slot`; the reader's tier never saves, so nothing else writes the slot.
        unsafe { std::ptr::write_bytes(p, byte, self.slot_bytes() as usize) };
    }

    /// Checks local slot `slot` against the pattern of `key`, arena by arena.
    fn verify(&self, slot: u32, key: &ContentKey) {
        let g = self.tier.geometry();
        let bytes = self.slot(slot);
        for (a, (spec, &off)) in g.arenas().iter().zip(g.chunk_offsets()).enumerate() {
            let chunk = &bytes[off as usize..(off + spec.bytes_per_page) as usize];
            assert_eq!(pattern::first_mismatch(key, a, chunk), None, "local slot {slot}, arena {a}: bytes differ");
        }
    }
}

fn deadline() -> Instant {
    Instant::now() + BOUND
}

#[test]
fn reads_of_1_8_and_16_blocks_in_one_batch_move_the_owners_bytes() {
    if !runtime("reads_of_1_8_and_16_blocks_in_one_batch_move_the_owners_bytes") {
        return;
    }
    let owner = Owner::start();
    let reader = Reader::new("batches");
    let peer = reader.transport.add_peer(&owner.descriptor).unwrap();
    let keys = keys(&reader.tier); // the same geometry: the same namespace and keys
    let sb = reader.slot_bytes();
    for n in [1u64, 8, 16] {
        // Remote block j lands in local slot n-1-j: each descriptor pair is its own mapping.
        let local = |j: u64| (n - 1 - j) as u32;
        for j in 0..n {
            reader.fill(local(j), 0);
        }
        let reads: Vec<BlockRead> = (0..n)
            .map(|j| BlockRead {
                remote_offset: owner.offsets[j as usize],
                local_offset: u64::from(local(j)) * sb,
                len: sb,
            })
            .collect();
        reader.transport.read(peer, &reads, deadline()).unwrap();
        for j in 0..n {
            reader.verify(local(j), &keys[j as usize]);
        }
    }
    reader.transport.remove_peer(peer);
    let read = BlockRead { remote_offset: owner.offsets[0], local_offset: 0, len: sb };
    let e = reader.transport.read(peer, &[read], deadline()).unwrap_err();
    assert!(matches!(e, TransportError::Backend(ref m) if m.contains("not loaded")), "a removed peer: {e:?}");
}

#[test]
fn an_out_of_range_read_is_refused_before_anything_is_read() {
    if !runtime("an_out_of_range_read_is_refused_before_anything_is_read") {
        return;
    }
    let owner = Owner::start();
    let reader = Reader::new("range");
    assert!(matches!(reader.transport.add_peer(b"not a descriptor"), Err(TransportError::Descriptor(_))));
    let peer = reader.transport.add_peer(&owner.descriptor).unwrap();
    let sb = reader.slot_bytes();
    let remote_len = u64::from_le_bytes(owner.descriptor[16..24].try_into().unwrap());
    let local_len = reader.transport.registered_bytes();
    let good = BlockRead { remote_offset: owner.offsets[0], local_offset: 0, len: sb };
    let bad = [
        // Straddles the end of the owner's pool.
        BlockRead { remote_offset: remote_len - sb / 2, local_offset: sb, len: sb },
        // Past the end of the reader's pool.
        BlockRead { remote_offset: owner.offsets[1], local_offset: local_len, len: sb },
        // An offset whose end overflows.
        BlockRead { remote_offset: u64::MAX - 8, local_offset: sb, len: sb },
    ];
    for b in bad {
        reader.fill(0, 0xa5);
        reader.fill(1, 0xa5);
        let e = reader.transport.read(peer, &[good, b], deadline()).unwrap_err();
        assert!(
            matches!(e, TransportError::OutOfRange(_)),
            "an out-of-range read must be refused with OutOfRange: {e:?}"
        );
        assert!(
            reader.slot(0).iter().chain(reader.slot(1).iter()).all(|&x| x == 0xa5),
            "a refused batch read nothing, not even its in-range read"
        );
    }
    // The in-range read alone still works.
    reader.transport.read(peer, &[good], deadline()).unwrap();
    reader.verify(0, &keys(&reader.tier)[0]);
}

#[test]
fn a_deadline_already_passed_gives_deadline_and_reads_nothing() {
    if !runtime("a_deadline_already_passed_gives_deadline_and_reads_nothing") {
        return;
    }
    let owner = Owner::start();
    let reader = Reader::new("deadline");
    let peer = reader.transport.add_peer(&owner.descriptor).unwrap();
    let sb = reader.slot_bytes();
    reader.fill(0, 0xa5);
    let past = Instant::now();
    std::thread::sleep(Duration::from_millis(1));
    let read = BlockRead { remote_offset: owner.offsets[0], local_offset: 0, len: sb };
    let e = reader.transport.read(peer, &[read], past).unwrap_err();
    assert!(matches!(e, TransportError::Deadline), "a passed deadline: {e:?}");
    assert!(reader.slot(0).iter().all(|&x| x == 0xa5), "nothing was posted");
}

#[test]
fn a_read_past_its_deadline_mid_transfer_says_when_the_transfer_is_over() {
    if !runtime("a_read_past_its_deadline_mid_transfer_says_when_the_transfer_is_over") {
        return;
    }
    // Over TCP, both sides (the owner inherits the environment): over shared memory UCX's cma
    // copies within the post, so a deadline would rarely fall mid-transfer. Restored at the end
    // (one test thread: nothing else reads the environment meanwhile).
    let saved: Vec<(&str, Option<std::ffi::OsString>)> =
        ["UCX_TLS", "UCX_NET_DEVICES"].iter().map(|v| (*v, std::env::var_os(v))).collect();
    std::env::set_var("UCX_TLS", "tcp,self");
    std::env::set_var("UCX_NET_DEVICES", "lo");
    let owner = Owner::start();
    let reader = Reader::new("drain");
    let peer = reader.transport.add_peer(&owner.descriptor).unwrap();
    let keys = keys(&reader.tier);
    let sb = reader.slot_bytes();
    let reads: Vec<BlockRead> = (0..BLOCKS)
        .map(|j| BlockRead { remote_offset: owner.offsets[j as usize], local_offset: j * sb, len: sb })
        .collect();
    // A batch of 256 block reads (20 MB: the 16 blocks again and again, into the 24 slots in turn)
    // and deadlines short enough to pass while it is in flight: the read returns at the deadline,
    // and its ReadDone drops only once NIXL reports the transfer over.
    let big: Vec<BlockRead> = (0..256u64)
        .map(|i| BlockRead {
            remote_offset: owner.offsets[(i % BLOCKS) as usize],
            local_offset: (i % SLOTS) * sb,
            len: sb,
        })
        .collect();
    let mut drained = 0;
    let (mut oks, mut early) = (0, 0);
    for attempt in 0..300u32 {
        let over = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let o = over.clone();
        let done = ReadDone::new(move || o.store(true, std::sync::atomic::Ordering::SeqCst));
        let deadline = Instant::now() + Duration::from_micros(50 + u64::from(attempt % 40) * 50);
        let r = reader.transport.read_tracked(peer, &big, deadline, done);
        let at_return = over.load(std::sync::atomic::Ordering::SeqCst);
        match r {
            Ok(()) => {
                oks += 1;
                assert!(at_return, "a completed read's transfer is over when it returns");
            }
            Err(TransportError::Deadline) if !at_return => {
                drained += 1;
                let until = Instant::now() + BOUND;
                while !over.load(std::sync::atomic::Ordering::SeqCst) {
                    assert!(Instant::now() < until, "a transfer past its deadline was never reported over");
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
            Err(TransportError::Deadline) => early += 1,
            Err(e) => panic!("attempt {attempt}: {e:?}"),
        }
        if drained >= 5 {
            break;
        }
    }
    println!("{drained} reads passed their deadline mid-transfer and were drained; {oks} completed, {early} timed out before posting");
    for (v, old) in saved {
        match old {
            Some(x) => std::env::set_var(v, x),
            None => std::env::remove_var(v),
        }
    }
    assert!(drained > 0, "no read passed its deadline mid-transfer: the drain was never exercised");
    // The transport works on after its drains, and forgets the peer (waiting for none left).
    reader.transport.read(peer, &reads, deadline()).unwrap();
    for j in 0..BLOCKS {
        reader.verify(j as u32, &keys[j as usize]);
    }
    reader.transport.remove_peer(peer);
}

#[test]
fn an_owner_killed_during_reads_gives_a_typed_error_in_bounded_time() {
    if !runtime("an_owner_killed_during_reads_gives_a_typed_error_in_bounded_time") {
        return;
    }
    let mut owner = Owner::start();
    let reader = Reader::new("kill");
    let peer = reader.transport.add_peer(&owner.descriptor).unwrap();
    let sb = reader.slot_bytes();
    let reads: Vec<BlockRead> = (0..BLOCKS)
        .map(|j| BlockRead { remote_offset: owner.offsets[j as usize], local_offset: j * sb, len: sb })
        .collect();
    reader.transport.read(peer, &reads, deadline()).unwrap();
    // Reads back to back on another thread; the owner is killed under them.
    let (killed_tx, killed_rx) = mpsc::channel::<Instant>();
    let outcome = std::thread::scope(|s| {
        let reading = s.spawn(|| {
            let mut done = 0u64;
            loop {
                match reader.transport.read(peer, &reads, deadline()) {
                    Ok(()) => done += 1,
                    Err(e) => return (e, Instant::now(), done),
                }
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        killed_tx.send(Instant::now()).unwrap();
        owner.kill();
        reading.join().unwrap()
    });
    let (e, failed_at, done) = outcome;
    let killed_at = killed_rx.recv().unwrap();
    let after = failed_at.saturating_duration_since(killed_at);
    println!("{done} batches of {BLOCKS} blocks read before the kill; the read failed {after:?} after it: {e}");
    assert!(
        matches!(e, TransportError::Disconnected | TransportError::Deadline),
        "a killed owner gives Disconnected (or the deadline): {e:?}"
    );
    assert!(after < Duration::from_secs(10), "the failure came {after:?} after the kill");
    // The owner is gone before this read starts: a typed error again, within the deadline.
    let start = Instant::now();
    let e = reader.transport.read(peer, &reads, Instant::now() + Duration::from_secs(5)).unwrap_err();
    println!("a read from the dead owner failed after {:?}: {e}", start.elapsed());
    assert!(matches!(e, TransportError::Disconnected | TransportError::Deadline), "a dead owner: {e:?}");
    assert!(start.elapsed() < Duration::from_secs(6));
}

impl Reader {
    /// A peer connection to `owner`'s `PeerServer` over this reader's transport.
    fn connect(&self, owner: &Owner) -> PeerClient {
        PeerClient::connect(owner.addr.as_str(), &self.tier, self.transport.clone(), deadline()).unwrap()
    }

    /// The reader's tier is as an empty tier is once its READY blocks are evicted: every slot
    /// free, none `WRITING` or pinned, no index entry, no live lease.
    fn assert_clean(&self) {
        self.tier.evict(usize::MAX);
        let s = self.tier.stats();
        assert_eq!(
            (s.free_slots, s.writing_slots, s.pinned_slots, s.index_entries, s.live_leases),
            (s.capacity, 0, 0, 0, 0),
            "the reader's tier kept something: {s:?}"
        );
    }
}

/// Checks a fetch of every key: all `BLOCKS` from the peer, none stale, each leased slot holding
/// its key's bytes.
fn check_fetch(reader: &Reader, f: &kvtier::PeerFetch, keys: &[ContentKey]) {
    assert_eq!((f.lease.len() as u64, f.lease.from_peer() as u64, f.stale), (BLOCKS, BLOCKS, 0), "a whole fetch");
    assert!((0..f.lease.len()).all(|i| f.lease.source(i) == Some(BlockSource::Peer)));
    for (slot, key) in f.lease.slots().zip(keys) {
        reader.verify(slot.get(), key);
    }
}

#[test]
fn a_peer_fetch_through_nixl_serves_the_owners_bytes_and_the_next_hit_is_local() {
    if !runtime("a_peer_fetch_through_nixl_serves_the_owners_bytes_and_the_next_hit_is_local") {
        return;
    }
    let owner = Owner::start();
    let reader = Reader::new("fetch");
    let keys = keys(&reader.tier);
    let client = reader.connect(&owner);
    let f = client.fetch(&keys, deadline()).unwrap();
    check_fetch(&reader, &f, &keys);
    // Restored through the production path into host arenas, byte for byte.
    let arenas = Arc::new(MemcpyArenas::new(reader.tier.geometry()).unwrap());
    let rank = reader.tier.attach(arenas.backend().unwrap()).unwrap();
    let pages: Vec<u64> = (0..BLOCKS).map(|p| p + 8).collect();
    rank.restore(&f.lease, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
    arenas.verify(&pages, &keys).unwrap();
    drop(f);
    assert_eq!(client.fetched_blocks(), BLOCKS);
    // In the reader's pool now: a plain query hits every block locally, and a second fetch asks
    // the owner for nothing.
    let again = reader.tier.query(&keys);
    assert_eq!(again.len() as u64, BLOCKS);
    assert!((0..again.len()).all(|i| again.source(i) == Some(BlockSource::Host)));
    drop(again);
    let f = client.fetch(&keys, deadline()).unwrap();
    assert_eq!((f.lease.len() as u64, f.lease.from_peer()), (BLOCKS, 0));
    drop(f);
    assert_eq!(client.fetched_blocks(), BLOCKS, "nothing fetched the second time");
    drop((rank, client));
    reader.assert_clean();
}

#[test]
fn two_readers_fetch_the_same_blocks_through_nixl_at_once() {
    if !runtime("two_readers_fetch_the_same_blocks_through_nixl_at_once") {
        return;
    }
    let owner = Owner::start();
    let readers = [Reader::new("twin-a"), Reader::new("twin-b")];
    let keys = keys(&readers[0].tier);
    let start = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        for reader in &readers {
            let (owner, keys, start) = (&owner, &keys, &start);
            s.spawn(move || {
                let client = reader.connect(owner);
                start.wait();
                for _ in 0..10 {
                    let f = client.fetch(keys, deadline()).unwrap();
                    check_fetch(reader, &f, keys);
                    drop(f);
                    assert_eq!(reader.tier.evict(usize::MAX) as u64, BLOCKS);
                }
            });
        }
    });
    for reader in &readers {
        reader.assert_clean();
    }
}

#[test]
fn an_owner_killed_mid_fetch_is_a_typed_error_and_the_reader_keeps_nothing() {
    if !runtime("an_owner_killed_mid_fetch_is_a_typed_error_and_the_reader_keeps_nothing") {
        return;
    }
    let mut owner = Owner::start();
    let reader = Reader::new("kill-fetch");
    let keys = keys(&reader.tier);
    let client = reader.connect(&owner);
    let (killed_tx, killed_rx) = mpsc::channel::<Instant>();
    let (e, failed_at, done) = std::thread::scope(|s| {
        let fetching = s.spawn(|| {
            let mut done = 0u64;
            loop {
                match client.fetch(&keys, deadline()) {
                    Ok(f) => {
                        check_fetch(&reader, &f, &keys);
                        drop(f);
                        reader.tier.evict(usize::MAX);
                        done += 1;
                    }
                    Err(e) => return (e, Instant::now(), done),
                }
            }
        });
        std::thread::sleep(Duration::from_millis(50));
        killed_tx.send(Instant::now()).unwrap();
        owner.kill();
        fetching.join().unwrap()
    });
    let after = failed_at.saturating_duration_since(killed_rx.recv().unwrap());
    println!("{done} fetches of {BLOCKS} blocks before the kill; the fetch failed {after:?} after it: {e}");
    assert!(
        matches!(
            e,
            PeerError::OwnerGone
                | PeerError::Network(_)
                | PeerError::Deadline
                | PeerError::Transport(TransportError::Disconnected | TransportError::Deadline)
        ),
        "a killed owner is a typed error: {e:?}"
    );
    assert!(after < BOUND, "the failure came {after:?} after the kill");
    // Nothing the failed fetch reserved stays behind, and the next fetch fails at once.
    reader.assert_clean();
    let e = client.fetch(&keys, deadline()).unwrap_err();
    assert!(matches!(e, PeerError::OwnerGone | PeerError::Network(_)), "a dead owner: {e:?}");
    reader.assert_clean();
}
