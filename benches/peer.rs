//! Peer fetches through NIXL (feature `nixl`): GLM-5.2 blocks (3,452,160 B each) read from another
//! process's host pool, for requests of 1, 8 and 43 blocks (43 blocks = 148.4 MB). Three contenders
//! over the same owner and the same blocks, in one run:
//!
//! - `raw`: a raw nixl-sys loop (its own agent and registered host pool: create the request, post,
//!   poll, release), the ceiling the others are held against;
//! - `transport`: `NixlTransport::read` (range checks, then the same request);
//! - `fetch`: `PeerClient::fetch`, the whole peer path: local prefix, `Query` (the owner pins the
//!   blocks under a lease), local slots reserved, one NIXL READ, `Validate`, publish, `Release`.
//!   Between two fetches the blocks are evicted from the reader (outside the timed span).
//!
//! With feature `cuda` on a machine with a GPU, 43 blocks are also restored into GPU arenas after
//! each peer fetch (the fetch lands in the reader's pool, then the usual restore kernels run),
//! against the local restore of the same blocks, and read by NIXL straight into GPU arenas
//! registered as VRAM (no host slot in between); the arenas are checked against the patterns.
//!
//! And two control round trips for 43 keys: a peer `Query` answered with a lease (the owner pins
//! 43 blocks), against a local daemon's query of the same 43 keys (`kvtier::Server` on a
//! Unix socket in this process, queried through `HostTier::connect`), both timed from send to
//! reply, interleaved (at least 100 of each). Every contender's bytes are checked against the keys' patterns before timing.
//!
//! Printed per contender and request size: median and mean latency per request (ms) and GB/s
//! (GB = 10^9 B, bytes moved / summed request times); each row also as a fraction of `raw` at its size.
//!
//! ```text
//! eval "$(bash ci/nixl.sh)"; cargo bench -p kvtier --features nixl --bench peer
//! UCX_TLS=tcp,self UCX_NET_DEVICES=lo cargo bench -p kvtier --features nixl --bench peer
//! ```
//!
//! `KVTIER_PEER_BENCH_ITERS` sets the requests per contender and size (default 50). The bench
//! re-executes itself as the owner process; `KVTIER_PEER_BENCH_NETNS=NAME` starts the owner in
//! network namespace `NAME` (`ip netns exec`, root) and `KVTIER_PEER_BENCH_LISTEN=IP:PORT` is the
//! owner's control address there (default `127.0.0.1:0`); `benches/peer_netns.sh` sets up two
//! namespaces joined by a veth pair with `tc netem` delay and runs this bench across them.

use kvtier::internals::peer_proto::{
    mac, nonce, read_msg, write_msg, Frame, PeerReply, PeerRequest, Role, PEER_MAGIC, PEER_PROTOCOL_VERSION,
};
use kvtier::nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, OptArgs, XferDescList, XferOp, XferStatus};
use kvtier::{
    pattern, BlockRead, BlockSource, ContentKey, EngineArenas, Geometry, HostPool, HostTier, MemcpyArenas,
    NixlTransport, PeerClient, PeerLimits, PeerSecret, PeerServer, PeerTransport, PoolConfig, TierConfig, WaitFor,
};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const OWNER_ENV: &str = "KVTIER_PEER_BENCH_OWNER";

/// The peers' secret of the bench's two processes (an owner listening across namespaces needs
/// one).
fn secret() -> PeerSecret {
    PeerSecret::new(b"kvtier peer bench secret".to_vec()).expect("a secret")
}
/// The longest request, blocks (a 2,752-token prefix of 64-token pages).
const BLOCKS: u64 = 43;
/// Request sizes, blocks.
const SIZES: [u64; 3] = [1, 8, 43];

fn geometry() -> Geometry {
    Geometry::preset("glm52", BLOCKS).expect("the GLM-5.2 preset")
}

fn tier_config(g: &Geometry) -> TierConfig {
    TierConfig::new(g.clone(), BLOCKS * g.slot_bytes()).with_backing(kvtier::BackingChoice::Plain)
}

fn keys(ns: kvtier::Namespace) -> Vec<ContentKey> {
    (0..BLOCKS).map(|i| ns.trace_page_key(i, 0)).collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
}

/// Saves the 43 blocks' patterns into `tier` through a host-memory rank.
fn save_all(tier: &HostTier) -> Vec<ContentKey> {
    let gpu = std::sync::Arc::new(MemcpyArenas::new(tier.geometry()).expect("arenas"));
    let rank = tier.attach(gpu.backend().expect("a backend")).expect("a rank");
    let keys = keys(tier.namespace());
    let pages: Vec<u64> = (0..BLOCKS).collect();
    gpu.fill(&pages, &keys).expect("fill");
    rank.save(&keys, &pages, WaitFor::Nothing).expect("a save").handle.wait().expect("the save");
    keys
}

/// The owner: a tier holding the 43 blocks, its pool registered with NIXL, a peer server. Prints
/// `descriptor HEX`, `addr IP:PORT`, `offsets O,O,..` (the blocks' byte offsets in the pool, in
/// key order), then `ready`, and serves until its stdin closes.
fn owner() {
    let g = geometry();
    let tier = HostTier::new(tier_config(&g)).expect("the owner's tier");
    let keys = save_all(&tier);
    let lease = tier.query(&keys); // the raw contenders read these slots: keep them put
    assert_eq!(lease.len() as u64, BLOCKS);
    let offsets: Vec<String> = lease.slots().map(|s| (u64::from(s.get()) * g.slot_bytes()).to_string()).collect();
    let t = std::sync::Arc::new(
        NixlTransport::new(&format!("kvtier-bench-owner-{}", std::process::id()), tier.pool()).expect("transport"),
    );
    let d = t.local_descriptor().expect("the descriptor");
    let listen = std::env::var("KVTIER_PEER_BENCH_LISTEN").unwrap_or_else(|_| "127.0.0.1:0".into());
    // Every block may be pinned for peers (the default keeps an eighth of the pool for the owner).
    let limits = PeerLimits { pinned_blocks: Some(BLOCKS as usize), ..PeerLimits::default() };
    let server =
        PeerServer::bind_with_secret(&tier, listen.as_str(), t, limits, Some(secret())).expect("the peer server");
    let mut out = std::io::stdout().lock();
    writeln!(out, "descriptor {}", hex(&d)).unwrap();
    writeln!(out, "addr {}", server.local_addr()).unwrap();
    writeln!(out, "offsets {}", offsets.join(",")).unwrap();
    writeln!(out, "ready").unwrap();
    out.flush().unwrap();
    drop(out);
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
    drop(lease);
    server.shutdown();
}

/// Checks the block at byte `offset` of `pool` against `key`'s pattern, arena by arena.
fn verify(g: &Geometry, pool: &HostPool, offset: u64, key: &ContentKey, who: &str) {
    let slot = kvtier::SlotId::new((offset / g.slot_bytes()) as u32);
    // SAFETY: a whole slot inside `pool`'s mapping; no read into it is in flight.
    let bytes = unsafe { std::slice::from_raw_parts(pool.slot_ptr(slot), g.slot_bytes() as usize) };
    for (a, (spec, &off)) in g.arenas().iter().zip(g.chunk_offsets()).enumerate() {
        let chunk = &bytes[off as usize..(off + spec.bytes_per_page) as usize];
        assert_eq!(pattern::first_mismatch(key, a, chunk), None, "{who}: the block at {offset}, arena {a} differs");
    }
}

/// One contender's latencies at one size.
struct Series {
    name: &'static str,
    blocks: u64,
    times: Vec<Duration>,
}

impl Series {
    fn gbps(&self, block_bytes: u64) -> f64 {
        let total: Duration = self.times.iter().sum();
        (self.blocks * block_bytes * self.times.len() as u64) as f64 / total.as_secs_f64() / 1e9
    }
    fn median_ms(&self) -> f64 {
        let mut t = self.times.clone();
        t.sort();
        t[t.len() / 2].as_secs_f64() * 1e3
    }
    fn mean_ms(&self) -> f64 {
        self.times.iter().sum::<Duration>().as_secs_f64() * 1e3 / self.times.len() as f64
    }
}

/// With feature `cuda` and a GPU: 43 blocks restored into GPU arenas (device 0) after a peer fetch
/// (the fetch into the reader's pool, then the restore kernels), against the local restore path
/// (query, restore) of the same blocks once they are local, interleaved. The arenas are checked
/// against the keys' patterns once. Returns no series without a GPU.
#[cfg(feature = "cuda")]
fn gpu_stage(reader: &HostTier, client: &PeerClient, keys: &[ContentKey], iters: u64) -> Vec<Series> {
    if !kvtier::cuda_available() {
        println!("gpu: no CUDA device; the GPU stage is not run");
        return Vec::new();
    }
    let arenas = kvtier::CudaArenas::new(0, reader.geometry(), kvtier::CudaOptions::default()).expect("GPU arenas");
    let rank = reader.attach(arenas.backend().expect("a CUDA backend")).expect("a rank");
    let pages: Vec<u64> = (0..BLOCKS).collect();
    let deadline = || Instant::now() + Duration::from_secs(60);
    let fetch_restore = || {
        let s = Instant::now();
        let f = client.fetch(keys, deadline()).expect("a fetch");
        assert_eq!(f.lease.from_peer() as u64, BLOCKS, "every block from the peer");
        rank.restore(&f.lease, &pages, WaitFor::Nothing).expect("a restore").wait().expect("the restore");
        s.elapsed()
    };
    let local_restore = || {
        let s = Instant::now();
        let lease = reader.query(keys);
        assert_eq!(lease.len() as u64, BLOCKS, "every block local");
        rank.restore(&lease, &pages, WaitFor::Nothing).expect("a restore").wait().expect("the restore");
        s.elapsed()
    };
    fetch_restore();
    arenas.verify(&pages, keys).expect("the GPU arenas hold the owner's bytes");
    local_restore();
    reader.evict(usize::MAX);
    let mut through_peer = Series { name: "gpu: peer fetch + restore (43 blocks)", blocks: BLOCKS, times: vec![] };
    let mut local = Series { name: "gpu: local restore (43 blocks)", blocks: BLOCKS, times: vec![] };
    for _ in 0..iters {
        through_peer.times.push(fetch_restore());
        local.times.push(local_restore());
        assert_eq!(reader.evict(usize::MAX) as u64, BLOCKS);
    }
    arenas.verify(&pages, keys).expect("the GPU arenas hold the owner's bytes");
    vec![through_peer, local]
}

/// With feature `cuda` and a GPU: the other path into the GPU, a NIXL READ of the owner's 43 blocks
/// straight into GPU arenas (device 0), no host slot in between: the reader's arenas registered
/// with NIXL as VRAM, one descriptor per (block, arena) chunk (43 x the geometry's arenas), each
/// from the owner's slot at its arena's offset into the arena's page. Timed from the request's
/// creation to its completion; the arenas are checked against the keys' patterns after the first
/// and the last read. `None` (after printing why) when NIXL refuses the VRAM registration or the
/// read (UCX without its CUDA module, or without `libcudart.so.12`).
#[cfg(feature = "cuda")]
fn vram_stage(g: &Geometry, d: &[u8], offsets: &[u64], keys: &[ContentKey], iters: u64) -> Option<Series> {
    if !kvtier::cuda_available() {
        return None;
    }
    let arenas = kvtier::CudaArenas::new(0, g, kvtier::CudaOptions::default()).expect("GPU arenas");
    let agent = Agent::new(&format!("kvtier-bench-vram-{}", std::process::id())).expect("agent");
    let (_m, params) = agent.get_plugin_params("UCX").expect("UCX plugin");
    let shown: Vec<String> = params
        .iter()
        .map(|it| it.filter_map(|p| p.ok()).map(|(k, v)| format!("{k}={v}")).collect())
        .unwrap_or_default();
    println!("vram: UCX backend parameters: {}", shown.join(" "));
    let ucx = agent.create_backend("UCX", &params).expect("UCX backend");
    let mut args = OptArgs::new().unwrap();
    args.add_backend(&ucx).unwrap();
    let bases = arenas.binding().bases().to_vec();
    let mut regs = Vec::new();
    for (spec, &base) in g.arenas().iter().zip(&bases) {
        match agent.register_memory(&Vram(base, spec.extent() as usize), Some(&args)) {
            Ok(r) => regs.push(r),
            Err(e) => {
                println!("vram: NIXL refused to register GPU memory ({e:?}); the straight-into-GPU path is not run");
                return None;
            }
        }
    }
    let remote_base = u64::from_le_bytes(d[8..16].try_into().unwrap());
    let remote = agent.load_remote_md(&d[28..]).expect("the owner's metadata");
    let pages: Vec<u64> = (0..BLOCKS).collect();
    let read = || -> Result<Duration, String> {
        let t = Instant::now();
        let mut l = XferDescList::new(MemType::Vram).unwrap();
        let mut r = XferDescList::new(MemType::Dram).unwrap();
        for (j, &off) in offsets.iter().enumerate().take(BLOCKS as usize) {
            for ((spec, &base), &chunk) in g.arenas().iter().zip(&bases).zip(g.chunk_offsets()) {
                l.add_desc((base + j as u64 * spec.page_stride) as usize, spec.bytes_per_page as usize, 0);
                r.add_desc((remote_base + off + chunk) as usize, spec.bytes_per_page as usize, 0);
            }
        }
        let req = agent.create_xfer_req(XferOp::Read, &l, &r, &remote, Some(&args)).map_err(|e| format!("{e:?}"))?;
        if agent.post_xfer_req(&req, None).map_err(|e| format!("{e:?}"))? {
            loop {
                match agent.get_xfer_status(&req).map_err(|e| format!("{e:?}"))? {
                    XferStatus::InProgress if t.elapsed() > Duration::from_secs(60) => {
                        return Err("no completion within 60 s".into());
                    }
                    XferStatus::InProgress => std::hint::spin_loop(),
                    _ => break,
                }
            }
        }
        Ok(t.elapsed())
    };
    if let Err(e) = read() {
        println!("vram: the READ into GPU memory failed ({e}); the straight-into-GPU path is not run");
        return None;
    }
    arenas.verify(&pages, keys).expect("the GPU arenas hold the owner's bytes (NIXL READ into VRAM)");
    let mut s = Series { name: "gpu: NIXL READ into GPU arenas (43 blocks)", blocks: BLOCKS, times: vec![] };
    for _ in 0..iters {
        s.times.push(read().expect("a READ into GPU memory"));
    }
    arenas.verify(&pages, keys).expect("the GPU arenas hold the owner's bytes (NIXL READ into VRAM)");
    drop(regs);
    Some(s)
}

/// GPU memory registered with NIXL: one arena's extent on device 0.
#[cfg(feature = "cuda")]
#[derive(Debug)]
struct Vram(u64, usize);
#[cfg(feature = "cuda")]
impl MemoryRegion for Vram {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0 as *const u8
    }
    fn size(&self) -> usize {
        self.1
    }
}
#[cfg(feature = "cuda")]
impl NixlDescriptor for Vram {
    fn mem_type(&self) -> MemType {
        MemType::Vram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

/// The raw loop's registered memory: a host pool's mapping.
#[derive(Debug)]
struct Raw(*const u8, usize);
// SAFETY: a plain address and length; the pool it names outlives every use.
unsafe impl Send for Raw {}
// SAFETY: as above; nothing is mutated through it.
unsafe impl Sync for Raw {}
impl MemoryRegion for Raw {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.0
    }
    fn size(&self) -> usize {
        self.1
    }
}
impl NixlDescriptor for Raw {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

fn main() {
    if std::env::var_os(OWNER_ENV).is_some() {
        return owner();
    }
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list`: nothing to list
    }
    if !NixlTransport::runtime_available() {
        eprintln!("peer bench: the NIXL runtime (libnixl_capi.so) was not found; eval \"$(bash ci/nixl.sh)\" first");
        std::process::exit(1);
    }
    let iters: u64 = std::env::var("KVTIER_PEER_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let exe = std::env::current_exe().unwrap();
    let mut cmd = match std::env::var("KVTIER_PEER_BENCH_NETNS") {
        Ok(ns) => {
            let mut c = Command::new("ip");
            c.args(["netns", "exec", &ns]).arg(&exe);
            c
        }
        Err(_) => Command::new(&exe),
    };
    let mut child = cmd.env(OWNER_ENV, "1").stdin(Stdio::piped()).stdout(Stdio::piped()).spawn().expect("the owner");
    let (mut d, mut addr, mut offsets) = (None, None, None);
    for line in BufReader::new(child.stdout.take().unwrap()).lines() {
        let line = line.expect("the owner's output");
        if let Some(x) = line.strip_prefix("descriptor ") {
            d = Some(unhex(x));
        } else if let Some(x) = line.strip_prefix("addr ") {
            addr = Some(x.to_string());
        } else if let Some(x) = line.strip_prefix("offsets ") {
            offsets = Some(x.split(',').map(|o| o.parse::<u64>().unwrap()).collect::<Vec<_>>());
        } else if line == "ready" {
            break;
        }
    }
    let (d, addr, offsets) = (d.expect("descriptor"), addr.expect("addr"), offsets.expect("offsets"));
    let g = geometry();
    let bb = g.slot_bytes();
    let keys = keys(HostTier::new(tier_config(&g)).expect("a tier").namespace());
    println!(
        "peer bench: GLM-5.2 blocks of {bb} B, requests of {SIZES:?} blocks, {iters} requests each; owner at {addr}; \
         UCX_TLS={}",
        std::env::var("UCX_TLS").unwrap_or_else(|_| "(default)".into())
    );
    // The reader's tier (its namespace is the hello's below).
    let reader = HostTier::new(tier_config(&g)).expect("the reader's tier");
    // The three contenders' agents live in this block only: each NIXL agent has a progress thread,
    // and the round trips below are measured without them.
    let (all, gpu) = {
        // Raw nixl-sys: one agent, the UCX backend, and a host pool like the reader's, registered by hand.
        let agent = Agent::new(&format!("kvtier-bench-raw-{}", std::process::id())).expect("agent");
        let (_m, params) = agent.get_plugin_params("UCX").expect("UCX plugin");
        let ucx = agent.create_backend("UCX", &params).expect("UCX backend");
        let buffer = HostPool::new(bb, &PoolConfig::new(BLOCKS * bb).with_prefault(true)).expect("a host pool");
        let raw = Raw(buffer.region().host_base as *const u8, buffer.region().bytes as usize);
        let mut args = OptArgs::new().unwrap();
        args.add_backend(&ucx).unwrap();
        let _reg = agent.register_memory(&raw, Some(&args)).expect("registration");
        // The descriptor's documented layout: base at 8, metadata from 28.
        let remote_base = u64::from_le_bytes(d[8..16].try_into().unwrap());
        let remote = agent.load_remote_md(&d[28..]).expect("the owner's metadata");
        let raw_read = |n: u64| {
            let t = Instant::now();
            let mut l = XferDescList::new(MemType::Dram).unwrap();
            let mut r = XferDescList::new(MemType::Dram).unwrap();
            for j in 0..n {
                l.add_desc(raw.0 as usize + (j * bb) as usize, bb as usize, 0);
                r.add_desc((remote_base + offsets[j as usize]) as usize, bb as usize, 0);
            }
            let req = agent.create_xfer_req(XferOp::Read, &l, &r, &remote, Some(&args)).expect("request");
            if agent.post_xfer_req(&req, None).expect("post") {
                while agent.get_xfer_status(&req).expect("status") == XferStatus::InProgress {
                    std::hint::spin_loop();
                }
            }
            t.elapsed()
        };

        // NixlTransport::read of the same blocks into a kvtier host pool.
        let local = HostPool::new(bb, &PoolConfig::new(BLOCKS * bb).with_prefault(true)).expect("a host pool");
        let transport =
            NixlTransport::new(&format!("kvtier-bench-reader-{}", std::process::id()), &local).expect("transport");
        let peer = transport.add_peer(&d).expect("the owner");
        let reads: Vec<BlockRead> = (0..BLOCKS)
            .map(|j| BlockRead { remote_offset: offsets[j as usize], local_offset: j * bb, len: bb })
            .collect();
        let transport_read = |n: u64| {
            let s = Instant::now();
            transport.read(peer, &reads[..n as usize], Instant::now() + Duration::from_secs(60)).expect("a read");
            s.elapsed()
        };

        // PeerClient::fetch: the whole peer path into a reader tier of 43 slots.
        let t = std::sync::Arc::new(
            NixlTransport::new(&format!("kvtier-bench-fetch-{}", std::process::id()), reader.pool())
                .expect("transport"),
        );
        let client = PeerClient::connect_with_secret(
            addr.as_str(),
            &reader,
            t,
            Some(&secret()),
            Instant::now() + Duration::from_secs(30),
        )
        .expect("a peer connection");
        let fetch = |n: u64| {
            let s = Instant::now();
            let f = client.fetch(&keys[..n as usize], Instant::now() + Duration::from_secs(60)).expect("a fetch");
            let e = s.elapsed();
            assert_eq!((f.lease.len() as u64, f.lease.from_peer() as u64, f.stale), (n, n, 0), "a whole fetch");
            drop(f);
            assert_eq!(reader.evict(usize::MAX) as u64, n, "the fetched blocks evicted");
            e
        };

        // Each contender's bytes, checked once (this also connects every agent).
        raw_read(BLOCKS);
        transport_read(BLOCKS);
        for (j, k) in keys.iter().enumerate() {
            verify(&g, &buffer, j as u64 * bb, k, "raw");
            verify(&g, &local, j as u64 * bb, k, "transport");
        }
        let f = client.fetch(&keys, Instant::now() + Duration::from_secs(60)).expect("a fetch");
        assert!((0..f.lease.len()).all(|i| f.lease.source(i) == Some(BlockSource::Peer)));
        for (s, k) in f.lease.slots().zip(&keys) {
            verify(&g, reader.pool(), u64::from(s.get()) * bb, k, "fetch");
        }
        drop(f);
        reader.evict(usize::MAX);

        // Interleaved request by request, so that no contender gets a quieter stretch of the machine.
        let mut all: Vec<Series> = Vec::new();
        for n in SIZES {
            let mut series: Vec<Series> = ["raw", "transport", "fetch"]
                .into_iter()
                .map(|name| Series { name, blocks: n, times: Vec::with_capacity(iters as usize) })
                .collect();
            for _ in 0..iters {
                series[0].times.push(raw_read(n));
                series[1].times.push(transport_read(n));
                series[2].times.push(fetch(n));
            }
            all.extend(series);
        }
        #[cfg(feature = "cuda")]
        let gpu = {
            let mut gpu = gpu_stage(&reader, &client, &keys, iters);
            gpu.extend(vram_stage(&g, &d, &offsets, &keys, iters));
            gpu
        };
        #[cfg(not(feature = "cuda"))]
        let gpu: Vec<Series> = Vec::new();
        (all, gpu)
    };

    // Control round trips for 43 keys, interleaved: a peer Query (a lease on 43 blocks) against a
    // local daemon's query of the same keys.
    let control_pool = HostPool::new(bb, &PoolConfig::new(bb)).expect("a one-slot pool");
    let control_transport =
        NixlTransport::new(&format!("kvtier-bench-control-{}", std::process::id()), &control_pool).expect("transport");
    let mut stream = TcpStream::connect(addr.as_str()).expect("a control connection");
    stream.set_nodelay(true).unwrap();
    let mut buf = Vec::new();
    let mut call = |req: &PeerRequest| -> PeerReply {
        write_msg(&mut stream, req, &mut buf).expect("a request");
        match read_msg::<PeerReply>(&mut stream, &mut buf, 64 << 20).expect("a reply") {
            Frame::Msg(r) => r,
            f => panic!("a reply frame, not {f:?}"),
        }
    };
    let ours = nonce().expect("a nonce");
    let hello = PeerRequest::Hello { magic: PEER_MAGIC, version: PEER_PROTOCOL_VERSION, nonce: ours };
    let PeerReply::Challenge { nonce: theirs } = call(&hello) else { panic!("the owner's challenge") };
    let descriptor = control_transport.local_descriptor().expect("a descriptor");
    let ns = reader.namespace();
    let proof = mac(Some(&secret()), Role::Reader, &ours, &theirs, &ns, 0, &descriptor);
    let auth = PeerRequest::Auth { mac: proof, namespace: ns, descriptor };
    assert!(matches!(call(&auth), PeerReply::Welcome { .. }), "the owner's welcome");
    let mut peer_query = || {
        let q = PeerRequest::Query { keys: keys.clone(), ttl_ms: 10_000 };
        let s = Instant::now();
        let r = call(&q);
        let e = s.elapsed();
        let PeerReply::Leased { lease, blocks, .. } = r else { panic!("a lease, not {r:?}") };
        assert_eq!(blocks.len() as u64, BLOCKS);
        assert!(matches!(call(&PeerRequest::Release { lease }), PeerReply::Released(true)));
        e
    };
    let dir = std::env::temp_dir().join(format!("kvtier-bench-peer-{}", std::process::id()));
    let daemon_tier = HostTier::new_shared(tier_config(&g)).expect("the daemon's tier");
    save_all(&daemon_tier);
    let server = std::sync::Arc::new(kvtier::Server::bind(dir.join("sock"), daemon_tier).expect("a daemon"));
    let s2 = server.clone();
    std::thread::spawn(move || s2.run());
    let engine = HostTier::connect(dir.join("sock")).expect("a connected tier");
    let daemon_query = || {
        let s = Instant::now();
        let lease = engine.query(&keys);
        let e = s.elapsed();
        assert_eq!(lease.len() as u64, BLOCKS);
        e
    };
    let mut peer_rtt = Series { name: "peer control round trip (Query, 43 keys)", blocks: BLOCKS, times: vec![] };
    let mut daemon_rtt = Series { name: "local daemon round trip (query, 43 keys)", blocks: BLOCKS, times: vec![] };
    peer_query();
    daemon_query();
    for _ in 0..iters.max(100) {
        peer_rtt.times.push(peer_query());
        daemon_rtt.times.push(daemon_query());
    }
    drop(engine);
    let _ = std::fs::remove_dir_all(&dir);

    println!(
        "{:<11} {:>6} {:>12} {:>12} {:>10} {:>9}",
        "contender", "blocks", "median ms", "mean ms", "GB/s", "of raw"
    );
    for s in &all {
        let raw = all.iter().find(|r| r.name == "raw" && r.blocks == s.blocks).unwrap();
        println!(
            "{:<11} {:>6} {:>12.3} {:>12.3} {:>10.2} {:>9.3}",
            s.name,
            s.blocks,
            s.median_ms(),
            s.mean_ms(),
            s.gbps(bb),
            s.gbps(bb) / raw.gbps(bb)
        );
    }
    if let [through_peer, local, rest @ ..] = &gpu[..] {
        for s in [through_peer, local].into_iter().chain(rest) {
            println!(
                "{:<42} median {:8.3} ms  mean {:8.3} ms  {:6.2} GB/s",
                s.name,
                s.median_ms(),
                s.mean_ms(),
                s.gbps(bb)
            );
        }
        println!("peer fetch + restore / local restore (GB/s): {:.3}", through_peer.gbps(bb) / local.gbps(bb));
        for s in rest {
            println!("{} / local restore (GB/s): {:.3}", s.name, s.gbps(bb) / local.gbps(bb));
        }
    }
    for s in [&peer_rtt, &daemon_rtt] {
        println!("{:<42} median {:8.1} us  mean {:8.1} us", s.name, s.median_ms() * 1e3, s.mean_ms() * 1e3);
    }
    println!("peer / daemon round trip (medians): {:.2}", peer_rtt.median_ms() / daemon_rtt.median_ms());
    drop(child.stdin.take());
    let _ = child.wait();
}
