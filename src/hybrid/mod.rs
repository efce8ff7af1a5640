//! Hybrid models: cache groups for sliding-window layers and recurrent state beside full
//! attention, saved and restored together.
//!
//! A [`HybridLayout`] is a model's named [`CacheGroup`]s, each with its own arenas, page bytes and
//! page ids (a plain [`crate::Geometry`] per group) and a [`GroupKind`] saying which of its blocks
//! a restore at a boundary needs. A [`HybridTier`] keeps one host tier per group and answers the
//! longest prefix the model can restore at ([`HybridTier::query`]), pinning every group's blocks
//! of it together; a [`HybridRank`] saves and restores every group's blocks in one call.
//!
//! ```
//! # use kvtier::*;
//! // 4 full-attention layers and 4 sliding-window layers (32-token window), 16-token blocks.
//! let full = Geometry::new("toy", 16, vec![ArenaSpec::packed("global", 4096, 8)])?;
//! let local = Geometry::new("toy", 16, vec![ArenaSpec::packed("local", 4096, 8)])?;
//! let layout = HybridLayout::new("toy", vec![
//!     CacheGroup::new("global", GroupKind::Full, full.clone()),
//!     CacheGroup::new("local", GroupKind::SlidingWindow { window_tokens: 32 }, local.clone()),
//! ])?;
//! let tier = HybridTier::new(HybridConfig::new(layout.clone(), 1 << 20))?;
//! let (a, b) = (std::sync::Arc::new(MemcpyArenas::new(&full)?), std::sync::Arc::new(MemcpyArenas::new(&local)?));
//! let rank = tier.attach(vec![a.backend()?, b.backend()?])?;
//! let mut keys = vec![layout.namespace().chain(None, &[1; 16])];
//! for i in 1..4 { let k = layout.namespace().chain(Some(&keys[i - 1]), &[i as u32; 16]); keys.push(k); }
//! // Prefill wrote 4 blocks; the sliding-window group still holds the window's last 2 blocks.
//! let gk = |g: usize, r: std::ops::Range<usize>| keys[r].iter().map(|k| layout.group_key(g, k)).collect::<Vec<_>>();
//! a.fill(&[0, 1, 2, 3], &gk(0, 0..4))?;
//! b.fill(&[0, 1], &gk(1, 2..4))?;
//! rank.save(&keys, &[GroupPages::new(0, vec![0, 1, 2, 3]), GroupPages::new(2, vec![0, 1])], WaitFor::Nothing)?.wait()?;
//! let lease = tier.query(&keys);
//! assert_eq!(lease.boundary(), 4); // usable at 4 blocks: the window holds blocks 2 and 3
//! assert_eq!(lease.range(1), 2..4);
//! rank.restore(&lease, &[vec![4, 5, 6, 7], vec![2, 3]], WaitFor::Nothing)?.wait()?;
//! a.verify(&[4, 5, 6, 7], &gk(0, 0..4))?;
//! b.verify(&[2, 3], &gk(1, 2..4))?;
//! // At 3 blocks the window needs block 1, which was never saved: not a place to restore at.
//! assert_eq!(tier.usable_prefix(&keys[..3]), 0);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod evict;
mod layout;
mod presets;
mod tier;

pub use layout::{CacheGroup, GroupKind, HybridLayout, MAX_GROUPS};
pub use tier::{GroupPages, HybridConfig, HybridLease, HybridRank, HybridRestore, HybridSave, HybridTier};
