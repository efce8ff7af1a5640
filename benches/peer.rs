//! Peer reads through NIXL (feature `nixl`): 43 GLM-5.2 blocks (3,452,160 B each, 148.4 MB a
//! batch) read one-sided from another process's host pool, as one NIXL READ per batch. Two
//! contenders over the same bytes: a raw nixl-sys loop (its own agent and registered buffer:
//! create the request, post, poll, release) and `NixlTransport::read` (range checks, the same
//! request). The raw loop is the ceiling `NixlTransport` is held against. GB = 10^9 B.
//!
//! `eval "$(bash ci/nixl.sh)"; cargo bench -p kvtier --features nixl --bench peer`
//! (`UCX_TLS=tcp,self UCX_NET_DEVICES=lo` in front for TCP only). `KVTIER_PEER_BENCH_ITERS` sets
//! the batches per contender (default 50). The bench re-executes itself as the owner process.

use kvtier::nixl_sys::{Agent, MemType, MemoryRegion, NixlDescriptor, OptArgs, XferDescList, XferOp, XferStatus};
use kvtier::{BlockRead, Geometry, HostPool, NixlTransport, PeerTransport, PoolConfig};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const OWNER_ENV: &str = "KVTIER_PEER_BENCH_OWNER";
const BLOCKS: u64 = 43;

fn pool(slot_bytes: u64) -> HostPool {
    HostPool::new(slot_bytes, &PoolConfig::new(BLOCKS * slot_bytes).with_prefault(true)).expect("a host pool")
}

/// The owner: a pool of 43 blocks of known bytes, registered; prints its descriptor, waits for EOF.
fn owner(slot_bytes: u64) {
    let pool = pool(slot_bytes);
    for s in 0..BLOCKS as u32 {
        let p = pool.slot_ptr(kvtier::SlotId::new(s));
        // SAFETY: slot `s` of our own pool: `slot_bytes` bytes, nothing else touches them.
        unsafe { std::ptr::write_bytes(p, s as u8 + 1, slot_bytes as usize) };
    }
    let t = NixlTransport::new(&format!("kvtier-bench-owner-{}", std::process::id()), &pool).expect("the transport");
    let d = t.local_descriptor().expect("the descriptor");
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    println!("descriptor {hex}");
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).is_ok_and(|n| n > 0) {}
}

fn gbps(bytes: u64, iters: u64, t: Duration) -> f64 {
    (bytes * iters) as f64 / t.as_secs_f64() / 1e9
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
    let slot_bytes = Geometry::preset("glm52", 1).expect("the GLM-5.2 preset").slot_bytes();
    if std::env::var_os(OWNER_ENV).is_some() {
        return owner(slot_bytes);
    }
    if std::env::args().any(|a| a == "--list") {
        return; // `cargo bench -- --list`: nothing to list
    }
    if !NixlTransport::runtime_available() {
        eprintln!("peer bench: the NIXL runtime (libnixl_capi.so) was not found; eval \"$(bash ci/nixl.sh)\" first");
        std::process::exit(1);
    }
    let iters: u64 = std::env::var("KVTIER_PEER_BENCH_ITERS").ok().and_then(|v| v.parse().ok()).unwrap_or(50);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .env(OWNER_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the owner process");
    let line = BufReader::new(child.stdout.take().unwrap()).lines().next().expect("the owner's descriptor").unwrap();
    let hex = line.strip_prefix("descriptor ").expect("a descriptor line");
    let d: Vec<u8> = (0..hex.len()).step_by(2).map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap()).collect();
    // The descriptor's documented layout: base at 8, metadata from 28.
    let remote_base = u64::from_le_bytes(d[8..16].try_into().unwrap());
    let md = &d[28..];
    let batch = BLOCKS * slot_bytes;
    println!(
        "peer bench: {BLOCKS} GLM-5.2 blocks of {slot_bytes} B ({:.1} MB) a batch, {iters} batches",
        batch as f64 / 1e6
    );

    // Raw nixl-sys: one agent, the UCX backend, and a host pool like the reader's below (the same
    // mapping and backing), registered by hand.
    {
        let agent = Agent::new(&format!("kvtier-bench-raw-{}", std::process::id())).expect("agent");
        let (_m, params) = agent.get_plugin_params("UCX").expect("UCX plugin");
        let ucx = agent.create_backend("UCX", &params).expect("UCX backend");
        let buffer = pool(slot_bytes);
        let raw = Raw(buffer.region().host_base as *const u8, buffer.region().bytes as usize);
        let mut args = OptArgs::new().unwrap();
        args.add_backend(&ucx).unwrap();
        let _reg = agent.register_memory(&raw, Some(&args)).expect("registration");
        let remote = agent.load_remote_md(md).expect("the owner's metadata");
        let read_batch = || {
            let mut l = XferDescList::new(MemType::Dram).unwrap();
            let mut r = XferDescList::new(MemType::Dram).unwrap();
            for j in 0..BLOCKS {
                l.add_desc(raw.0 as usize + (j * slot_bytes) as usize, slot_bytes as usize, 0);
                r.add_desc((remote_base + j * slot_bytes) as usize, slot_bytes as usize, 0);
            }
            let req = agent.create_xfer_req(XferOp::Read, &l, &r, &remote, Some(&args)).expect("request");
            if agent.post_xfer_req(&req, None).expect("post") {
                while agent.get_xfer_status(&req).expect("status") == XferStatus::InProgress {
                    std::thread::yield_now();
                }
            }
        };
        read_batch(); // connects
                      // SAFETY: the first and last bytes of the batch, inside `buffer`'s mapping.
        let (first, last) = unsafe { (*raw.0, *raw.0.add(batch as usize - 1)) };
        assert_eq!((first, last), (1, BLOCKS as u8), "the raw loop read the owner's bytes");
        let t = Instant::now();
        for _ in 0..iters {
            read_batch();
        }
        let e = t.elapsed();
        println!("raw nixl-sys READ loop:    {:6.2} GB/s  ({:?} a batch)", gbps(batch, iters, e), e / iters as u32);
    }

    // NixlTransport::read of the same blocks into a kvtier host pool.
    {
        let local = pool(slot_bytes);
        let t = NixlTransport::new(&format!("kvtier-bench-reader-{}", std::process::id()), &local).expect("transport");
        let peer = t.add_peer(&d).expect("the owner");
        let reads: Vec<BlockRead> = (0..BLOCKS)
            .map(|j| BlockRead { remote_offset: j * slot_bytes, local_offset: j * slot_bytes, len: slot_bytes })
            .collect();
        let deadline = || Instant::now() + Duration::from_secs(30);
        t.read(peer, &reads, deadline()).expect("a read");
        // SAFETY: the last byte of our own pool's last block slot.
        let last = unsafe { *local.slot_ptr(kvtier::SlotId::new(BLOCKS as u32 - 1)).add(slot_bytes as usize - 1) };
        assert_eq!(last, BLOCKS as u8, "NixlTransport read the owner's bytes");
        let start = Instant::now();
        for _ in 0..iters {
            t.read(peer, &reads, deadline()).expect("a read");
        }
        let e = start.elapsed();
        println!("NixlTransport::read:       {:6.2} GB/s  ({:?} a batch)", gbps(batch, iters, e), e / iters as u32);
    }
    drop(child.stdin.take());
    let _ = child.wait();
}
