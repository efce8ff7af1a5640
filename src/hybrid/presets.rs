//! Hybrid layouts of published models (shapes from their public configurations).

use super::layout::{CacheGroup, GroupKind, HybridLayout};
use crate::error::GeometryError;
use crate::geometry::{ArenaSpec, Geometry};

/// Tokens per block of every preset (a common engine page size).
const PAGE_TOKENS: u32 = 16;

/// A group's geometry: one arena per `(name, bytes per page)`, each on the model layer given.
fn group_geometry(model: &str, arenas: Vec<(String, u64, u32)>, pages: u64) -> Result<Geometry, GeometryError> {
    let layers = arenas.iter().map(|a| a.2).collect();
    let specs = arenas.into_iter().map(|(name, bytes, _)| ArenaSpec::packed(name, bytes, pages)).collect();
    Geometry::new(model, PAGE_TOKENS, specs)?.with_layers(layers)
}

/// Attention layers `layers`, K and V of `kv_heads x head_dim` bf16 values per token, as one arena
/// per layer (`{prefix}.L{l}`, K then V) of 16-token pages.
fn attention(prefix: &str, layers: &[u32], kv_heads: u64, head_dim: u64) -> Vec<(String, u64, u32)> {
    let page = 2 * kv_heads * head_dim * 2 * PAGE_TOKENS as u64;
    layers.iter().map(|&l| (format!("{prefix}.L{l}"), page, l)).collect()
}

/// A layout of a `full` attention group and a `state` group whose checkpoint holds `state(l)`'s
/// arenas for each recurrent layer `l` of `recurrent`.
fn attention_and_state(
    model: &str,
    full: Vec<(String, u64, u32)>,
    recurrent: &[u32],
    state: impl Fn(u32) -> [(String, u64, u32); 2],
    pages: u64,
) -> Result<HybridLayout, GeometryError> {
    let state = recurrent.iter().flat_map(|&l| state(l)).collect();
    HybridLayout::new(
        model,
        vec![
            CacheGroup::new("full", GroupKind::Full, group_geometry(model, full, pages)?),
            CacheGroup::new("state", GroupKind::State, group_geometry(model, state, pages)?),
        ],
    )
}

impl HybridLayout {
    /// Names of the built-in presets, for [`HybridLayout::preset`].
    pub const PRESETS: &'static [&'static str] = &["gemma3-27b", "qwen3-next-80b", "jamba-v0.1"];

    /// A built-in hybrid layout with `pages` GPU pages per arena (for a state group: state slots,
    /// one per checkpoint the engine keeps on the GPU). Every preset pages 16 tokens, bf16 K and V
    /// in one arena per layer.
    ///
    /// - `gemma3-27b`: Gemma-3 27B, 62 layers, 16 KV heads x 128 dims (8,192 B per token per
    ///   layer); layer `l` is full attention when `(l + 1) % 6 == 0` (10 layers: `full`, 1,310,720 B
    ///   per block), the other 52 slide over 1,024 tokens (`sliding`, 6,815,744 B per block).
    /// - `qwen3-next-80b`: Qwen3-Next-80B-A3B, 48 layers; every 4th (`(l + 1) % 4 == 0`, 12 layers)
    ///   full attention with 2 KV heads x 256 dims (`full`, 393,216 B per block); the 36 Gated
    ///   DeltaNet layers keep a conv state of 8,192 channels x 4 taps in bf16 (65,536 B) and a
    ///   recurrent state of 32 heads x 128 x 128 in fp32 (2,097,152 B) (`state`, 77,856,768 B per
    ///   checkpoint).
    /// - `jamba-v0.1`: Jamba-v0.1, 32 layers; layers 4, 12, 20, 28 attention with 8 KV heads x 128
    ///   dims (`full`, 262,144 B per block); the 28 Mamba layers keep a conv state of 8,192 x 4 and
    ///   an SSM state of 8,192 x 16, bf16 (65,536 + 262,144 B) (`state`, 9,175,040 B per checkpoint).
    ///
    /// Sources: the models' published configurations (`num_hidden_layers`, `num_key_value_heads`,
    /// `head_dim`, `sliding_window`, the layer pattern, the linear-attention and Mamba sizes) and
    /// the state shapes of their cache classes in Hugging Face transformers.
    ///
    /// # Errors
    /// [`GeometryError::UnknownPreset`] for another name; the checks of [`Geometry::new`] (a zero
    /// `pages`).
    pub fn preset(name: &str, pages: u64) -> Result<Self, GeometryError> {
        match name {
            "gemma3-27b" => {
                let model = "Gemma-3-27B";
                let (full, sliding): (Vec<u32>, Vec<u32>) = (0..62).partition(|l| (l + 1) % 6 == 0);
                HybridLayout::new(
                    model,
                    vec![
                        CacheGroup::new(
                            "full",
                            GroupKind::Full,
                            group_geometry(model, attention("full", &full, 16, 128), pages)?,
                        ),
                        CacheGroup::new(
                            "sliding",
                            GroupKind::SlidingWindow { window_tokens: 1024 },
                            group_geometry(model, attention("swa", &sliding, 16, 128), pages)?,
                        ),
                    ],
                )
            }
            "qwen3-next-80b" => {
                let (full, linear): (Vec<u32>, Vec<u32>) = (0..48).partition(|l| (l + 1) % 4 == 0);
                let state =
                    |l| [(format!("conv.L{l}"), 8192 * 4 * 2, l), (format!("delta.L{l}"), 32 * 128 * 128 * 4, l)];
                attention_and_state("Qwen3-Next-80B-A3B", attention("full", &full, 2, 256), &linear, state, pages)
            }
            "jamba-v0.1" => {
                let (attn, mamba): (Vec<u32>, Vec<u32>) = (0..32).partition(|l| l % 8 == 4);
                let state = |l| [(format!("conv.L{l}"), 8192 * 4 * 2, l), (format!("ssm.L{l}"), 8192 * 16 * 2, l)];
                attention_and_state("Jamba-v0.1", attention("full", &attn, 8, 128), &mamba, state, pages)
            }
            _ => Err(GeometryError::UnknownPreset { name: name.to_string(), known: Self::PRESETS.join(", ") }),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn slot(l: &HybridLayout, g: usize) -> u64 {
        l.groups()[g].geometry.slot_bytes()
    }

    #[test]
    fn presets_have_their_published_shapes() {
        let g = HybridLayout::preset("gemma3-27b", 2).unwrap();
        assert_eq!((g.groups()[0].geometry.arenas().len(), g.groups()[1].geometry.arenas().len()), (10, 52));
        assert_eq!(g.groups()[0].geometry.arenas()[0].name, "full.L5");
        assert_eq!((slot(&g, 0), slot(&g, 1)), (1_310_720, 6_815_744));
        assert_eq!(g.groups()[1].kind, GroupKind::SlidingWindow { window_tokens: 1024 });
        let q = HybridLayout::preset("qwen3-next-80b", 2).unwrap();
        assert_eq!((q.groups()[0].geometry.arenas().len(), q.groups()[1].geometry.arenas().len()), (12, 72));
        assert_eq!((slot(&q, 0), slot(&q, 1)), (393_216, 77_856_768));
        let j = HybridLayout::preset("jamba-v0.1", 2).unwrap();
        assert_eq!(j.groups()[0].geometry.layers(), &[4, 12, 20, 28]);
        assert_eq!((slot(&j, 0), slot(&j, 1)), (262_144, 9_175_040));
        assert!(matches!(HybridLayout::preset("nope", 1), Err(GeometryError::UnknownPreset { .. })));
    }

    #[test]
    fn a_gemma_restore_moves_the_window_not_every_sliding_page() {
        // 65,536 tokens = 4,096 blocks: every full-attention block, the 64 blocks of the window.
        let g = HybridLayout::preset("gemma3-27b", 1).unwrap();
        assert_eq!(g.restore_bytes(4096), 4096 * 1_310_720 + 64 * 6_815_744);
        assert_eq!(g.all_layers_bytes(4096), 4096 * (1_310_720 + 6_815_744));
    }
}
