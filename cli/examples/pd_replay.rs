//! Prefill/decode disaggregation on a real trace, through NIXL (feature `nixl`): a prefill
//! instance and a decode instance, each with its own tier, pool, NIXL agent and arenas, replay one
//! Mooncake trace (default: the bundled conversation sample) in their two roles.
//!
//! Per request, in trace order:
//! 1. **prefill**: query its own pool (a prefix it computed for an earlier request hits there),
//!    "compute" the rest (the blocks' known bytes written into its arenas, `kvtier::pattern`),
//!    save them, and hold the whole prompt's blocks for the decode side (`PeerServer::hold`);
//! 2. **decode**: query through its peers (`PeerSet::query`: its own pool first, then the
//!    prefill instance for the rest, one NIXL READ per request, each block's generation checked
//!    with the owner), restore the lease into its arenas with `Rank::restore` and check every
//!    byte of every block against the key's pattern.
//!
//! One key per 512-token trace block; blocks of 2 arenas x 16 KiB (a toy layout: what is measured
//! is which blocks each side finds and where, not the link). Prints the blocks the decode side
//! found locally, fetched from the prefill side or missed, and the fetch latency.
//!
//! ```text
//! eval "$(bash ci/nixl.sh)"     # the NIXL runtime (PyPI's nixl-cu12 wheel) and its exports
//! cargo run --release -p kvtier-cli --features nixl --example pd_replay
//! UCX_TLS=tcp,self UCX_NET_DEVICES=lo cargo run --release -p kvtier-cli --features nixl --example pd_replay -- --decode-slots 192
//! ```
//!
//! Exits with status 1 if any block the decode side restored differs from its key's bytes, if a
//! block the prefill side held was not found, or if the peer failed (a refusal, the prefill
//! side's pin budget for peers being full, is counted and is not a failure: the decode side
//! prefills); 2 without the NIXL runtime.

use clap::Parser;
use kvtier::{
    ArenaSpec, BlockSource, EngineArenas, Geometry, HostTier, MemcpyArenas, NixlTransport, PeerLimits, PeerServer,
    PeerSet, TierConfig, WaitFor,
};
use kvtier_cli::trace::{self, TraceRequest};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Tokens per block: one trace block.
const PAGE_TOKENS: u32 = 512;
/// Bytes per page of each of the two toy arenas.
const PAGE_BYTES: u64 = 16 << 10;

#[derive(Parser, Debug)]
#[command(about = "A prefill and a decode instance replaying one trace, blocks handed over through NIXL")]
struct Args {
    /// Trace (Mooncake JSON Lines, plain or zstd); default: the bundled conversation sample.
    #[arg(long)]
    trace: Option<std::path::PathBuf>,
    /// Requests replayed (default: all).
    #[arg(long)]
    requests: Option<usize>,
    /// Slots of the prefill instance's pool.
    #[arg(long, default_value_t = 512)]
    prefill_slots: u64,
    /// Slots of the decode instance's pool.
    #[arg(long, default_value_t = 256)]
    decode_slots: u64,
    /// Seconds the prefill side holds a request's blocks for the decode side (a hold of a block
    /// the decode side never fetches, because it had it, lasts this long).
    #[arg(long, default_value_t = 1.0)]
    hold_s: f64,
}

fn geometry(pages: u64) -> Result<Geometry, kvtier::GeometryError> {
    Geometry::new(
        "pd-replay",
        PAGE_TOKENS,
        (0..2).map(|a| ArenaSpec::packed(format!("layer{a}"), PAGE_BYTES, pages)).collect(),
    )
}

/// Milliseconds of the `q` quantile of `v` (sorted in place); 0 for an empty `v`.
fn quantile_ms(v: &mut [Duration], q: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort();
    v[((v.len() - 1) as f64 * q).round() as usize].as_secs_f64() * 1e3
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    if !NixlTransport::runtime_available() {
        eprintln!(
            "pd_replay needs the NIXL runtime: libnixl_capi.so on LD_LIBRARY_PATH and NIXL_PLUGIN_DIR \
             (eval \"$(bash ci/nixl.sh)\")"
        );
        std::process::exit(2);
    }
    let mut reqs: Vec<TraceRequest> = match &args.trace {
        Some(p) => trace::load(p)?,
        None => trace::sample()?,
    };
    reqs.truncate(args.requests.unwrap_or(reqs.len()));
    let longest = reqs.iter().map(|r| r.page_count(PAGE_TOKENS)).max().unwrap_or(0) as u64;
    if longest > args.prefill_slots.min(args.decode_slots) {
        return Err(format!(
            "the longest prompt has {longest} blocks: both pools need at least that many slots \
             (--prefill-slots {}, --decode-slots {})",
            args.prefill_slots, args.decode_slots
        )
        .into());
    }
    // Arenas of one prompt's pages (the decode side restores into the same pages each time).
    let g = geometry(longest.max(1))?;
    let tier = |slots: u64| {
        HostTier::new(TierConfig::new(g.clone(), slots * g.slot_bytes()).with_backing(kvtier::BackingChoice::Plain))
    };
    let hold =
        Duration::try_from_secs_f64(args.hold_s).map_err(|_| format!("--hold-s {}: not seconds", args.hold_s))?;

    let prefill = tier(args.prefill_slots)?;
    let prefill_gpu = Arc::new(MemcpyArenas::new(prefill.geometry())?);
    let prefill_rank = prefill.attach(prefill_gpu.backend()?)?;
    let owner = Arc::new(NixlTransport::new(&format!("pd-replay-prefill-{}", std::process::id()), prefill.pool())?);
    let server = PeerServer::bind(&prefill, "127.0.0.1:0", owner, PeerLimits::default())?;

    let decode = tier(args.decode_slots)?;
    let decode_gpu = Arc::new(MemcpyArenas::new(decode.geometry())?);
    let decode_rank = decode.attach(decode_gpu.backend()?)?;
    let reader = Arc::new(NixlTransport::new(&format!("pd-replay-decode-{}", std::process::id()), decode.pool())?);
    let peers = PeerSet::new(&decode, reader, [server.local_addr().to_string()])?;
    println!(
        "pd_replay: {} requests, blocks of {} B ({PAGE_TOKENS} tokens); prefill pool {} slots (peers at {}), \
         decode pool {} slots",
        reqs.len(),
        g.slot_bytes(),
        args.prefill_slots,
        server.local_addr(),
        args.decode_slots
    );

    let ns = prefill.namespace();
    let (mut blocks, mut prefill_hits, mut local, mut fetched, mut missed, mut stale) = (0, 0, 0, 0, 0, 0);
    let mut fetch_times = Vec::new();
    let mut refusals = 0;
    let mut failures = Vec::new();
    for (i, r) in reqs.iter().enumerate() {
        let keys = r.page_keys(&ns, PAGE_TOKENS);
        let pages: Vec<u64> = (0..keys.len() as u64).collect();
        blocks += keys.len();
        // Prefill: its own prefix, then the rest computed and saved, then the prompt held.
        let hit = prefill.query(&keys).len();
        prefill_hits += hit;
        if hit < keys.len() {
            prefill_gpu.fill(&pages[hit..], &keys[hit..])?;
            prefill_rank.save(&keys[hit..], &pages[hit..], WaitFor::Nothing)?.handle.wait()?;
        }
        let held = server.hold(&keys, hold);
        // Decode: its own pool, then the prefill side; restore and check.
        let t = Instant::now();
        let f = peers.query(&keys, Instant::now() + Duration::from_secs(30));
        let took = t.elapsed();
        // A refusal is the owner's answer (its pin budget for peers is full: holds of blocks the
        // decode side never fetched keep their pins until their TTL); the decode side prefills.
        let refused = f.errors.iter().any(|(_, e)| matches!(e, kvtier::PeerError::Refused(_)));
        refusals += usize::from(refused);
        for (_, e) in f.errors.iter().filter(|(_, e)| !matches!(e, kvtier::PeerError::Refused(_))) {
            failures.push(format!("request {i}: the prefill peer failed: {e}"));
        }
        let lease = f.lease;
        let from_peer = (0..lease.len()).filter(|&j| lease.source(j) == Some(BlockSource::Peer)).count();
        if from_peer > 0 {
            fetch_times.push(took);
        }
        fetched += f.fetched;
        stale += f.stale;
        local += lease.len() - f.fetched;
        missed += keys.len() - lease.len();
        if lease.len() < held && !refused {
            failures.push(format!("request {i}: {held} blocks held for the decode side, {} found", lease.len()));
        }
        if !lease.is_empty() {
            decode_rank.restore(&lease, &pages[..lease.len()], WaitFor::Nothing)?.wait()?;
            if let Err(e) = decode_gpu.verify(&pages[..lease.len()], &keys[..lease.len()]) {
                failures.push(format!("request {i}: {e}"));
            }
        }
    }
    let moved = fetched as f64 * g.slot_bytes() as f64;
    let p50 = quantile_ms(&mut fetch_times, 0.5);
    let p99 = quantile_ms(&mut fetch_times, 0.99);
    println!("prompt blocks {blocks}: prefill side hit {prefill_hits} of its own");
    println!(
        "decode side: {local} blocks local, {fetched} fetched from the prefill side ({:.1} MB), {missed} missed, \
         {stale} dropped stale",
        moved / 1e6
    );
    println!(
        "fetching requests {}: latency p50 {p50:.2} ms, p99 {p99:.2} ms (query, NIXL READ, validation, publish); \
         {refusals} requests refused by the prefill side (its pin budget for peers full)",
        fetch_times.len()
    );
    let s = server.stats();
    println!(
        "prefill peer server: {} leases granted, {} blocks validated, {} invalid, {} blocks still held",
        s.leases_granted, s.blocks_validated, s.blocks_invalid, s.held_blocks
    );
    drop(peers);
    server.shutdown();
    prefill_rank.shutdown(Duration::from_secs(30))?;
    decode_rank.shutdown(Duration::from_secs(30))?;
    if failures.is_empty() {
        println!("verification: passed (every restored block's bytes are its key's)");
        Ok(())
    } else {
        for f in failures.iter().take(10) {
            eprintln!("{f}");
        }
        eprintln!("verification: FAILED ({} problems)", failures.len());
        std::process::exit(1);
    }
}
