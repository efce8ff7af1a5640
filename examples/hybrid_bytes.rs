//! Bytes a restore moves for each hybrid preset, against a layout without cache groups.
//!
//! For every preset of `HybridLayout::PRESETS` and prefixes of 4 k to 128 k tokens: the bytes a
//! restore at that boundary moves (every group's needed blocks: all full-attention blocks, the
//! sliding window's, one state checkpoint) against the bytes an all-layers layout moves (every
//! attention layer's pages of every block, one state checkpoint), and the bytes per restored
//! token of each. GB = 10^9 B. The figures are computed from the layouts (`restore_bytes`,
//! `all_layers_bytes`), then one round trip per preset through a `HybridTier` on the host
//! backend (Gemma-3 at 1,280 tokens, past its window; the others at 128) checks that a restore
//! copies exactly `restore_bytes` (each group's `bytes_restored`) and the right bytes.
//!
//! ```sh
//! cargo run --release --example hybrid_bytes
//! ```

use std::sync::Arc;

use kvtier::{
    EngineArenas, GroupKind, GroupPages, HybridConfig, HybridLayout, HybridTier, MemcpyArenas, TierConfig, WaitFor,
};

fn gb(b: u64) -> String {
    format!("{:.3}", b as f64 / 1e9)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("| model | group | kind | bytes per block |");
    println!("|---|---|---|---|");
    for &name in HybridLayout::PRESETS {
        let l = HybridLayout::preset(name, 1)?;
        for g in l.groups() {
            let kind = match g.kind {
                GroupKind::Full => "full attention".to_string(),
                GroupKind::SlidingWindow { window_tokens } => format!("sliding window, {window_tokens} tokens"),
                GroupKind::State => "recurrent state (one checkpoint)".to_string(),
            };
            println!(
                "| {} | {} ({} arenas) | {kind} | {} |",
                l.model(),
                g.name,
                g.geometry.arenas().len(),
                g.geometry.slot_bytes()
            );
        }
    }
    println!();
    println!(
        "| model | prefix (tokens) | restore, GB | all layers, GB | saved | B per token | all layers, B per token |"
    );
    println!("|---|---|---|---|---|---|---|");
    for &name in HybridLayout::PRESETS {
        let l = HybridLayout::preset(name, 1)?;
        for tokens in [4_096u64, 16_384, 65_536, 131_072] {
            let b = (tokens / l.page_tokens() as u64) as usize;
            let (r, a) = (l.restore_bytes(b), l.all_layers_bytes(b));
            println!(
                "| {} | {tokens} | {} | {} | {:.1}% | {} | {} |",
                l.model(),
                gb(r),
                gb(a),
                100.0 * (1.0 - r as f64 / a as f64),
                r / tokens,
                a / tokens
            );
        }
    }
    println!();
    // One round trip per preset: the bytes copied are `restore_bytes`.
    for &name in HybridLayout::PRESETS {
        // Past Gemma-3's 1,024-token window (64 blocks), so the copy leaves the window out; 8
        // blocks for the state hybrids (their checkpoint arenas are 9 and 78 MB a page).
        let blocks = if name == "gemma3-27b" { 80usize } else { 8 };
        let layout = HybridLayout::preset(name, 2 * blocks as u64)?;
        let mut config = HybridConfig::new(layout.clone(), 0);
        for (t, g) in config.tiers.iter_mut().zip(layout.groups()) {
            *t = TierConfig::new(g.geometry.clone(), blocks as u64 * g.geometry.slot_bytes());
        }
        let tier = HybridTier::new(config)?;
        let arenas = layout
            .groups()
            .iter()
            .map(|g| MemcpyArenas::new(&g.geometry).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let rank = tier.attach(arenas.iter().map(|a| a.backend()).collect::<Result<Vec<_>, _>>()?)?;
        let mut keys = Vec::with_capacity(blocks);
        for i in 0..blocks {
            let tokens = vec![i as u32; layout.page_tokens() as usize];
            let k = layout.namespace().chain(keys.last(), &tokens);
            keys.push(k);
        }
        let group_keys = |g: usize, r: std::ops::Range<usize>| -> Vec<_> {
            keys[r].iter().map(|k| layout.group_key(g, k)).collect()
        };
        let mut pages = Vec::new();
        for (g, arena) in arenas.iter().enumerate() {
            let need = layout.needed(g, blocks);
            let p: Vec<u64> = (0..need.len() as u64).collect();
            arena.fill(&p, &group_keys(g, need.clone()))?;
            pages.push(GroupPages::new(need.start, p));
        }
        rank.save(&keys, &pages, WaitFor::Nothing)?.wait()?;
        let lease = tier.query(&keys);
        assert_eq!(lease.boundary(), blocks);
        let dst: Vec<Vec<u64>> = (0..layout.groups().len())
            .map(|g| (blocks as u64..(blocks + lease.range(g).len()) as u64).collect())
            .collect();
        rank.restore(&lease, &dst, WaitFor::Nothing)?.wait()?;
        let mut copied = 0;
        for g in 0..layout.groups().len() {
            arenas[g].verify(&dst[g], &group_keys(g, lease.range(g)))?;
            copied += tier.group(g).stats().bytes_restored;
        }
        assert_eq!(copied, layout.restore_bytes(blocks));
        println!(
            "{}: a restore at {} tokens copied {copied} B (= restore_bytes) through {} groups, bytes verified",
            layout.model(),
            blocks * layout.page_tokens() as usize,
            layout.groups().len()
        );
    }
    Ok(())
}
