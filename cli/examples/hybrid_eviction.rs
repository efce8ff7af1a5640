//! Eviction across cache groups on a real trace: the hit ratio of a hybrid tier with group
//! eviction on and off.
//!
//! Replays a Mooncake trace (default: the whole conversation trace in data/) through a
//! [`HybridTier`] the way an engine serving a hybrid model would: per request, query the prompt's
//! blocks (512 tokens each, one per trace block), count the usable prefix as hit tokens, then
//! save what the prefill brought: the full-attention blocks after the hit, the sliding window's
//! blocks before the prompt's end, and the state checkpoint at the prompt's end. Two layouts: a
//! full-attention group beside a sliding-window group of 1,024 tokens (Gemma-3's window), and a
//! full-attention group beside a recurrent-state group (one checkpoint per prompt, at its end).
//! The full-attention pool holds `--blocks` blocks, the other group's pool `--share` of that;
//! every pool evicts by `--policy`. Blocks are bookkeeping only (a copy backend that moves no
//! bytes, 256-byte toy slots): what is measured is which blocks stay.
//!
//! ```text
//! cargo run --release -p kvtier-cli --example hybrid_eviction
//! cargo run --release -p kvtier-cli --example hybrid_eviction -- --blocks 2488 --share 0.5
//! ```
//!
//! Prints one row per layout and pool size: prompt tokens, hit tokens with group eviction off and
//! on, and their ratio.

use clap::Parser;
use kvtier::{
    ArenaSpec, CacheGroup, CopyBackend, Geometry, GroupKind, GroupPages, HybridConfig, HybridLayout, HybridTier,
    NullBackend, PolicyKind, TierConfig, WaitFor,
};

/// Tokens per block: one trace block.
const T: u32 = 512;
/// GPU pages per toy arena (a prompt's blocks are saved from pages 0..n).
const GPU_PAGES: u64 = 1 << 16;

#[derive(Parser, Debug)]
#[command(about = "Hit ratio of a hybrid tier with eviction across cache groups on and off")]
struct Args {
    /// Trace (Mooncake JSON Lines, plain or zstd); default: the whole conversation trace in data/.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/data/mooncake_conversation_trace.jsonl.zst"))]
    trace: std::path::PathBuf,
    /// Full-attention pool sizes in blocks (comma-separated).
    #[arg(long, value_delimiter = ',', default_values_t = [1244u64, 2488, 4976, 9952])]
    blocks: Vec<u64>,
    /// The sliding-window or state pool's size as a fraction of the full-attention pool's blocks.
    #[arg(long, default_value_t = 0.25)]
    share: f64,
    /// Eviction policy of every group's pool (a `kvtier simulate` policy name; default: the
    /// tier's default).
    #[arg(long, default_value_t = PolicyKind::default())]
    policy: PolicyKind,
}

fn toy(arena: &str) -> Geometry {
    Geometry::new("hybrid-eviction", T, vec![ArenaSpec::packed(arena, 256, GPU_PAGES)]).expect("toy geometry")
}

/// Hit tokens and prompt tokens of one replay.
fn replay(
    reqs: &[kvtier_cli::trace::TraceRequest],
    kind: GroupKind,
    blocks: u64,
    share: f64,
    policy: PolicyKind,
    group_eviction: bool,
) -> Result<(u64, u64, u64), Box<dyn std::error::Error>> {
    let layout = HybridLayout::new(
        "hybrid-eviction",
        vec![CacheGroup::new("full", GroupKind::Full, toy("full")), CacheGroup::new("other", kind, toy("other"))],
    )?;
    let mut config = HybridConfig::new(layout.clone(), 1 << 20).with_group_eviction(group_eviction);
    let other = ((blocks as f64 * share) as u64).max(2);
    for (t, (g, n)) in config.tiers.iter_mut().zip(layout.groups().iter().zip([blocks, other])) {
        *t = TierConfig::new(g.geometry.clone(), n * g.geometry.slot_bytes()).with_policy(policy);
    }
    let tier = HybridTier::new(config)?;
    let backends: Vec<Box<dyn CopyBackend>> = layout
        .groups()
        .iter()
        .map(|g| Box::new(NullBackend::new(g.geometry.clone())) as Box<dyn CopyBackend>)
        .collect();
    let rank = tier.attach(backends)?;
    let ns = layout.namespace();
    let (mut hit, mut total, mut failed) = (0u64, 0u64, 0u64);
    for r in reqs {
        let keys = r.page_keys(&ns, T);
        let n = keys.len();
        if n == 0 {
            continue;
        }
        let lease = tier.query(&keys);
        let l = lease.boundary();
        drop(lease);
        hit += l as u64 * T as u64;
        total += n as u64 * T as u64;
        if l == n {
            continue;
        }
        let other = match kind {
            // The window's blocks before the prompt's end (those restored among them refreshed).
            GroupKind::SlidingWindow { .. } => {
                let from = layout.needed(1, n).start;
                GroupPages::new(from, (0..(n - from) as u64).collect())
            }
            _ => GroupPages::new(n - 1, vec![0]),
        };
        let pages = [GroupPages::new(l, (0..(n - l) as u64).collect()), other];
        match rank.save(&keys, &pages, WaitFor::Nothing) {
            Ok(s) => s.wait()?,
            Err(_) => failed += 1,
        }
    }
    rank.drain(std::time::Duration::from_secs(10))?;
    Ok((hit, total, failed))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let reqs = kvtier_cli::trace::load(&args.trace)?;
    println!(
        "trace {} ({} requests), {}-token blocks, policy {}, other group's pool {:.2} x the full-attention pool",
        args.trace.file_name().map_or(args.trace.display().to_string(), |n| n.to_string_lossy().into_owned()),
        reqs.len(),
        T,
        args.policy,
        args.share
    );
    println!(
        "{:<26} {:>8} {:>14} {:>12} {:>12} {:>7}",
        "layout", "blocks", "prompt tokens", "hit (off)", "hit (on)", "on/off"
    );
    let layouts = [
        ("full + window 1,024 tok", GroupKind::SlidingWindow { window_tokens: 1024 }),
        ("full + state", GroupKind::State),
    ];
    for (name, kind) in layouts {
        for &blocks in &args.blocks {
            let (off, total, f_off) = replay(&reqs, kind, blocks, args.share, args.policy, false)?;
            let (on, _, f_on) = replay(&reqs, kind, blocks, args.share, args.policy, true)?;
            println!(
                "{:<26} {:>8} {:>14} {:>12} {:>12} {:>7.3}{}",
                name,
                blocks,
                total,
                off,
                on,
                on as f64 / off.max(1) as f64,
                if f_off + f_on > 0 { format!("  ({f_off} / {f_on} saves refused)") } else { String::new() }
            );
        }
    }
    Ok(())
}
