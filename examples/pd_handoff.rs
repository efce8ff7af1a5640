//! Prefill/decode handoff through NIXL on one machine (feature `nixl`): a prefill instance saves a
//! request's blocks into its host pool and holds them for the decode instance
//! (`PeerServer::hold`); the decode instance, told by its router which prefill instance has them,
//! fetches them into its own pool with one NIXL READ (`PeerClient::fetch`, generation-checked by
//! the owner), restores them into its arenas through `Rank::restore` and checks every byte. A second
//! query on the decode side then hits locally. Both instances run in this one process, each with
//! its own tier, pool, NIXL agent and arenas; between hosts only the address changes.
//!
//! ```text
//! eval "$(bash ci/nixl.sh)"     # the NIXL runtime (PyPI's nixl-cu12 wheel) and its exports
//! cargo run --release --features nixl --example pd_handoff
//! UCX_TLS=tcp,self UCX_NET_DEVICES=lo cargo run --release --features nixl --example pd_handoff
//! ```
//!
//! The second run keeps UCX to TCP over loopback, the stand-in for two hosts. Exit status 2 when
//! the NIXL runtime is not found.

use kvtier::{
    ArenaSpec, BlockSource, ContentKey, EngineArenas, Geometry, HostTier, MemcpyArenas, NixlTransport, PeerClient,
    PeerLimits, PeerServer, TierConfig, WaitFor,
};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Blocks of the request handed over.
const BLOCKS: u64 = 32;
/// Slots of each instance's pool.
const SLOTS: u64 = 64;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !NixlTransport::runtime_available() {
        eprintln!(
            "pd_handoff needs the NIXL runtime: libnixl_capi.so on LD_LIBRARY_PATH and NIXL_PLUGIN_DIR \
             (eval \"$(bash ci/nixl.sh)\")"
        );
        std::process::exit(2);
    }
    // A small MLA-like layout: 4 arenas of 36,864 B per 64-token page (160 pages each), 147,456 B a block.
    let g =
        Geometry::new("pd-example", 64, (0..4).map(|l| ArenaSpec::packed(format!("layer{l}"), 36_864, 160)).collect())?;
    let new_tier =
        || HostTier::new(TierConfig::new(g.clone(), SLOTS * g.slot_bytes()).with_backing(kvtier::BackingChoice::Plain));

    // Prefill: compute (here: known bytes written into its arenas), save, hold for the decode side.
    let prefill = new_tier()?;
    let prefill_gpu = Arc::new(MemcpyArenas::new(prefill.geometry())?);
    let prefill_rank = prefill.attach(prefill_gpu.backend()?)?;
    let ns = prefill.namespace();
    let keys: Vec<ContentKey> =
        (0..BLOCKS).map(|i| ns.key_from_bytes(format!("request-42/block-{i}").as_bytes())).collect();
    let pages: Vec<u64> = (0..BLOCKS).collect();
    prefill_gpu.fill(&pages, &keys)?;
    prefill_rank.save(&keys, &pages, WaitFor::Nothing)?.handle.wait()?;
    let owner_transport = Arc::new(NixlTransport::new("kvtier-example-prefill", prefill.pool())?);
    let server = PeerServer::bind(&prefill, "127.0.0.1:0", owner_transport, PeerLimits::default())?;
    let held = server.hold(&keys, Duration::from_secs(30));
    println!(
        "prefill: saved {BLOCKS} blocks of {} B, {held} held for the decode side at {}",
        g.slot_bytes(),
        server.local_addr()
    );

    // Decode: the router names the prefill instance; fetch, restore, check.
    let decode = new_tier()?;
    let decode_gpu = Arc::new(MemcpyArenas::new(decode.geometry())?);
    let decode_rank = decode.attach(decode_gpu.backend()?)?;
    let reader_transport = Arc::new(NixlTransport::new("kvtier-example-decode", decode.pool())?);
    let deadline = Instant::now() + Duration::from_secs(10);
    let client = PeerClient::connect(server.local_addr(), &decode, reader_transport, deadline)?;
    let t0 = Instant::now();
    let fetched = client.fetch(&keys, Instant::now() + Duration::from_secs(10))?;
    let took = t0.elapsed();
    let lease = fetched.lease;
    let from_peer = (0..lease.len()).filter(|&i| lease.source(i) == Some(BlockSource::Peer)).count();
    println!(
        "decode: fetched {} blocks ({from_peer} from the peer, {} stale) in {:.2} ms; {} still held on the prefill side",
        lease.len(),
        fetched.stale,
        took.as_secs_f64() * 1e3,
        server.held_blocks()
    );
    if lease.len() as u64 != BLOCKS {
        return Err(format!("only {} of {BLOCKS} blocks were fetched", lease.len()).into());
    }
    let dst: Vec<u64> = (0..BLOCKS).map(|i| 100 + i).collect();
    decode_rank.restore(&lease, &dst, WaitFor::Nothing)?.wait()?;
    decode_gpu.verify(&dst, &keys)?;
    println!("decode: restored {BLOCKS} blocks into pages 100..{}, every byte checked", 100 + BLOCKS);

    // The fetched blocks are in the decode instance's pool now: the next query hits locally.
    let again = decode.query(&keys);
    let local = (0..again.len()).filter(|&i| again.source(i) == Some(BlockSource::Host)).count();
    println!("decode: a second query hits {} blocks, {local} of them local", again.len());
    drop((again, client));
    server.shutdown();
    Ok(())
}
