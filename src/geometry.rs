//! Block geometry: how one block is spread over the engine's GPU arenas and laid out in a host slot.
//!
//! A **block** is one GPU page id taken across every **arena** of a rank (for GLM-5.2: 78 MLA arenas
//! and 21 index-K arenas, 99 in all). Arena `i` holds page `p` at byte offset `p * page_stride[i]`
//! from its base and the copy unit is `bytes_per_page[i]` bytes (`page_stride >= bytes_per_page`;
//! equal when pages are packed, larger when an arena is a strided view into a fused buffer).
//!
//! The **host slot** of a block is the arenas' chunks one after another in arena order, each chunk
//! starting at a multiple of [`SLOT_CHUNK_ALIGN`] bytes; [`Geometry::slot_bytes`] is the end of the
//! last chunk rounded up to that alignment. All offsets are `u64`.
//!
//! [`Geometry`] holds layout facts only (no addresses): it is shared by every rank of a tier and
//! determines the [`Namespace`]. [`ArenaBinding`] adds one rank's device base addresses and is checked
//! for alignment, null pointers, 64-bit overflow and overlap between arenas.

use crate::error::GeometryError;
use crate::key::Namespace;

/// Every copy unit, page stride and base address must be a multiple of this many bytes (the copy
/// kernels move 16 B per access).
pub const COPY_ALIGN: u64 = 16;
/// Each arena's chunk inside a host slot starts at a multiple of this many bytes.
pub const SLOT_CHUNK_ALIGN: u64 = 256;
/// Largest number of arenas per geometry (the kernels' arena table is sized for this).
pub const MAX_ARENAS: usize = 256;

/// How an arena's memory is allocated; used by code that allocates arenas itself (the host backend,
/// tests, benchmarks). Engines bind their own pointers with [`ArenaBinding`] and may ignore it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Placement {
    /// The arena is its own allocation of `pages * page_stride` bytes.
    Own,
    /// The arena lives inside fused buffer number `buffer` (shared with other arenas), at byte
    /// `offset` of every page of that buffer; the buffer's page stride is the arena's page stride.
    Fused {
        /// Fused buffer id (arenas with the same id share one allocation).
        buffer: u32,
        /// Offset of this arena's chunk inside each page of the buffer, in bytes.
        offset: u64,
    },
}

/// One arena: a per-layer (or per-component) region of GPU memory holding one chunk of every page.
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct ArenaSpec {
    /// Name, unique within the geometry (e.g. `mla.L12`).
    pub name: String,
    /// Copy unit: bytes of this arena that belong to one page.
    pub bytes_per_page: u64,
    /// Distance in bytes between consecutive pages (`>= bytes_per_page`).
    pub page_stride: u64,
    /// Pages in the arena.
    pub pages: u64,
    /// How the arena is allocated (see [`Placement`]).
    pub placement: Placement,
}

impl ArenaSpec {
    /// A packed arena (`page_stride == bytes_per_page`) that is its own allocation.
    pub fn packed(name: impl Into<String>, bytes_per_page: u64, pages: u64) -> Self {
        ArenaSpec { name: name.into(), bytes_per_page, page_stride: bytes_per_page, pages, placement: Placement::Own }
    }

    /// Byte length of the arena's extent: `(pages - 1) * page_stride + bytes_per_page`.
    pub fn extent(&self) -> u64 {
        (self.pages - 1) * self.page_stride + self.bytes_per_page
    }
}

/// A validated block layout: arenas, their chunk offsets in a host slot, and the namespace.
///
/// Equality compares the layout (what the bytes of a block are and where they lie); the layer
/// ids of [`Geometry::with_layers`] are an engine's grouping hint and do not enter it.
#[derive(Clone, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub struct Geometry {
    model: String,
    page_tokens: u32,
    arenas: Vec<ArenaSpec>,
    chunk_offsets: Vec<u64>,
    slot_bytes: u64,
    pages: u64,
    /// Tensor-parallel shard `(index, count)` this layout holds, if the block is sharded.
    shard: Option<(u32, u32)>,
    /// Model layer of each arena (non-decreasing in arena order); all 0 unless set.
    layers: Vec<u32>,
    #[cfg_attr(feature = "serde", serde(skip))]
    namespace: Namespace,
}

impl PartialEq for Geometry {
    fn eq(&self, other: &Self) -> bool {
        // Every field but `layers` (see the type's docs).
        self.model == other.model
            && self.page_tokens == other.page_tokens
            && self.arenas == other.arenas
            && self.chunk_offsets == other.chunk_offsets
            && self.slot_bytes == other.slot_bytes
            && self.pages == other.pages
            && self.shard == other.shard
            && self.namespace == other.namespace
    }
}

impl Eq for Geometry {}

fn align_up(x: u64, a: u64) -> Option<u64> {
    x.checked_add(a - 1).map(|v| v / a * a)
}

impl Geometry {
    /// Validates `arenas` and derives the host slot layout and namespace.
    ///
    /// `model` and `page_tokens` (tokens per page) are layout facts that enter the namespace.
    ///
    /// # Errors
    /// [`GeometryError`] for an empty model name or zero `page_tokens`, no arenas, more than
    /// [`MAX_ARENAS`], empty or duplicate names, a zero size, a copy unit or stride that is not a
    /// multiple of [`COPY_ALIGN`], a stride below the copy unit, an extent that overflows `u64`, or
    /// fused arenas that overlap inside their buffer.
    pub fn new(model: &str, page_tokens: u32, arenas: Vec<ArenaSpec>) -> Result<Self, GeometryError> {
        if model.is_empty() {
            return Err(GeometryError::MissingField { field: "model" });
        }
        if page_tokens == 0 {
            return Err(GeometryError::MissingField { field: "page_tokens" });
        }
        if arenas.is_empty() {
            return Err(GeometryError::NoArenas);
        }
        if arenas.len() > MAX_ARENAS {
            return Err(GeometryError::TooManyArenas { count: arenas.len(), max: MAX_ARENAS });
        }
        let mut names = std::collections::HashSet::new();
        for (i, a) in arenas.iter().enumerate() {
            if a.name.is_empty() || !names.insert(a.name.as_str()) {
                return Err(GeometryError::BadName { index: i, name: a.name.clone() });
            }
            for (field, v) in [("bytes_per_page", a.bytes_per_page), ("page_stride", a.page_stride), ("pages", a.pages)]
            {
                if v == 0 {
                    return Err(GeometryError::Zero { arena: a.name.clone(), field });
                }
            }
            for (field, v) in [("bytes_per_page", a.bytes_per_page), ("page_stride", a.page_stride)] {
                if v % COPY_ALIGN != 0 {
                    return Err(GeometryError::Misaligned { arena: a.name.clone(), field, value: v });
                }
            }
            if a.page_stride < a.bytes_per_page {
                return Err(GeometryError::StrideBelowUnit {
                    arena: a.name.clone(),
                    stride: a.page_stride,
                    unit: a.bytes_per_page,
                });
            }
            let ext = (a.pages - 1).checked_mul(a.page_stride).and_then(|v| v.checked_add(a.bytes_per_page));
            let end = match (ext, a.placement) {
                (Some(e), Placement::Fused { offset, .. }) => e.checked_add(offset),
                (e, _) => e,
            };
            if end.is_none() || end.is_some_and(|e| e > (1u64 << 62)) {
                return Err(GeometryError::Overflow { arena: a.name.clone(), pages: a.pages, stride: a.page_stride });
            }
            if let Placement::Fused { offset, .. } = a.placement {
                if offset % COPY_ALIGN != 0 {
                    return Err(GeometryError::Misaligned { arena: a.name.clone(), field: "offset", value: offset });
                }
                if offset + a.bytes_per_page > a.page_stride {
                    return Err(GeometryError::StrideBelowUnit {
                        arena: a.name.clone(),
                        stride: a.page_stride,
                        unit: offset + a.bytes_per_page,
                    });
                }
            }
        }
        // Fused arenas sharing a buffer must agree on stride and page count and not overlap.
        for (i, a) in arenas.iter().enumerate() {
            for b in &arenas[i + 1..] {
                if let (Placement::Fused { buffer: ba, offset: oa }, Placement::Fused { buffer: bb, offset: ob }) =
                    (a.placement, b.placement)
                {
                    if ba != bb {
                        continue;
                    }
                    let disjoint = oa + a.bytes_per_page <= ob || ob + b.bytes_per_page <= oa;
                    if a.page_stride != b.page_stride || a.pages != b.pages || !disjoint {
                        return Err(GeometryError::Overlap { a: a.name.clone(), b: b.name.clone() });
                    }
                }
            }
        }
        let mut chunk_offsets = Vec::with_capacity(arenas.len());
        let mut off = 0u64;
        for a in &arenas {
            chunk_offsets.push(off);
            off = align_up(off + a.bytes_per_page, SLOT_CHUNK_ALIGN).expect("bounded by the overflow check");
        }
        let slot_bytes = off;
        let arenas_len = arenas.len();
        let pages = arenas.iter().map(|a| a.pages).min().expect("non-empty");
        let namespace = Self::derive_namespace(model, page_tokens, &arenas, None);
        Ok(Geometry {
            model: model.to_string(),
            page_tokens,
            arenas,
            chunk_offsets,
            slot_bytes,
            pages,
            shard: None,
            layers: vec![0; arenas_len],
            namespace,
        })
    }

    fn derive_namespace(model: &str, page_tokens: u32, arenas: &[ArenaSpec], shard: Option<(u32, u32)>) -> Namespace {
        // Canonical description: only facts that decide what the bytes of a block mean. Strides,
        // page counts and placement are per-rank memory layout and do not enter it.
        let mut d = Vec::new();
        d.extend_from_slice(b"kvtier-namespace-v1\0");
        d.extend_from_slice(model.as_bytes());
        d.push(0);
        d.extend_from_slice(&page_tokens.to_le_bytes());
        d.extend_from_slice(&(arenas.len() as u64).to_le_bytes());
        for a in arenas {
            d.extend_from_slice(a.name.as_bytes());
            d.push(0);
            d.extend_from_slice(&a.bytes_per_page.to_le_bytes());
        }
        if let Some((i, n)) = shard {
            d.extend_from_slice(b"\0tp-shard\0");
            d.extend_from_slice(&i.to_le_bytes());
            d.extend_from_slice(&n.to_le_bytes());
        }
        Namespace::from_description(&d)
    }

    /// Model name (enters the namespace).
    pub fn model(&self) -> &str {
        &self.model
    }
    /// Tokens per page (enters the namespace).
    pub fn page_tokens(&self) -> u32 {
        self.page_tokens
    }
    /// The arenas in slot order.
    pub fn arenas(&self) -> &[ArenaSpec] {
        &self.arenas
    }
    /// Byte offset of arena `i`'s chunk inside a host slot (a multiple of [`SLOT_CHUNK_ALIGN`]).
    pub fn chunk_offsets(&self) -> &[u64] {
        &self.chunk_offsets
    }
    /// Bytes of one host slot: the chunks laid out in arena order, each aligned to
    /// [`SLOT_CHUNK_ALIGN`]. For `glm52` this is 3,452,160 B.
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }
    /// Bytes one block takes in an SSD tier's slot file: [`Geometry::slot_bytes`] plus the 96-byte
    /// slot trailer (key, generation, checksums), rounded up to 4 KiB, the unit of O_DIRECT I/O.
    /// For `glm52` this is 3,452,928 B (3,452,160 B + 96 B, rounded up).
    pub fn disk_slot_bytes(&self) -> u64 {
        crate::disk::format::slot_stride(self.slot_bytes).expect("a host slot is far below u64::MAX bytes")
    }
    /// Blocks an SSD tier's slot file of `file_bytes` bytes holds: its 4 KiB header, then slots of
    /// [`Geometry::disk_slot_bytes`] (0 when the file is smaller than the header and one slot). A
    /// 2 TiB file of `glm52` blocks holds 636,857 of them.
    pub fn disk_slots(&self, file_bytes: u64) -> u64 {
        let header =
            if crate::seeded::seeded("disk-slots-ignore-header") { 0 } else { crate::disk::format::HEADER_BYTES };
        file_bytes.saturating_sub(header as u64) / self.disk_slot_bytes()
    }
    /// Payload bytes of one block (sum of copy units, without alignment padding).
    pub fn block_bytes(&self) -> u64 {
        self.arenas.iter().map(|a| a.bytes_per_page).sum()
    }
    /// Valid GPU page ids are `0..pages()` (the smallest page count among the arenas).
    pub fn pages(&self) -> u64 {
        self.pages
    }
    /// The namespace folded into every content key of this layout.
    pub fn namespace(&self) -> Namespace {
        self.namespace
    }

    /// The same layout with every arena resized to `pages` pages (the namespace is unchanged).
    ///
    /// # Errors
    /// As [`Geometry::new`] (a zero `pages`, or an extent that overflows).
    pub fn with_pages(&self, pages: u64) -> Result<Self, GeometryError> {
        let arenas = self.arenas.iter().map(|a| ArenaSpec { pages, ..a.clone() }).collect();
        let mut g = Geometry::new(&self.model, self.page_tokens, arenas)?;
        g.layers.clone_from(&self.layers);
        match self.shard {
            Some((i, n)) => g.with_shard(i, n),
            None => Ok(g),
        }
    }

    /// The same layout marked as tensor-parallel shard `index` of `count`: ranks holding different
    /// shards of one block get different namespaces, so their keys never collide in a shared pool
    /// (ranks holding the same shard, as data-parallel ranks do, share blocks).
    ///
    /// # Errors
    /// [`GeometryError::MissingField`] (`shard`) if `count` is 0 or `index >= count`.
    pub fn with_shard(&self, index: u32, count: u32) -> Result<Self, GeometryError> {
        if count == 0 || index >= count {
            return Err(GeometryError::MissingField { field: "shard" });
        }
        let mut g = self.clone();
        g.shard = Some((index, count));
        g.namespace = Self::derive_namespace(&g.model, g.page_tokens, &g.arenas, g.shard);
        Ok(g)
    }

    /// The tensor-parallel shard `(index, count)`, if set by [`Geometry::with_shard`].
    pub fn shard(&self) -> Option<(u32, u32)> {
        self.shard
    }

    /// The same layout with arena `i` belonging to model layer `layers[i]`, for layer-wise copies
    /// ([`crate::copy::LayerGroups`]). Layer ids are a property of the engine, not of the bytes: the
    /// namespace is unchanged. Ids need not start at 0 or be dense, but must not decrease in arena
    /// order (a layer's arenas are neighbours in the slot). The presets set them; a geometry built
    /// with [`Geometry::new`] has every arena in layer 0 (one group).
    ///
    /// # Errors
    /// [`GeometryError::Layers`] for a count other than the arenas' or a decreasing id.
    pub fn with_layers(&self, layers: Vec<u32>) -> Result<Self, GeometryError> {
        if layers.len() != self.arenas.len() {
            return Err(GeometryError::Layers {
                reason: format!("{} layer ids for {} arenas", layers.len(), self.arenas.len()),
            });
        }
        if let Some(i) = (1..layers.len()).find(|&i| layers[i] < layers[i - 1]) {
            return Err(GeometryError::Layers {
                reason: format!(
                    "arena `{}` is in layer {} after arena `{}` in layer {}: ids must not decrease in arena order",
                    self.arenas[i].name,
                    layers[i],
                    self.arenas[i - 1].name,
                    layers[i - 1]
                ),
            });
        }
        let mut g = self.clone();
        g.layers = layers;
        Ok(g)
    }

    /// The model layer of each arena, in arena order (non-decreasing; all 0 unless set by
    /// [`Geometry::with_layers`] or a preset).
    pub fn layers(&self) -> &[u32] {
        &self.layers
    }

    /// Number of distinct layers among the arenas (at least 1).
    pub fn layer_count(&self) -> u32 {
        1 + self.layers.windows(2).filter(|w| w[0] != w[1]).count() as u32
    }

    /// Names of the built-in presets, for [`Geometry::preset`].
    pub const PRESETS: &'static [&'static str] = &["glm52", "qwen3-4b", "deepseek-v3", "deepseek-v3-bf16", "llama3-8b"];

    /// A built-in geometry with `pages` GPU pages per arena.
    ///
    /// - `glm52`: GLM-5.2, 64-token pages; 78 MLA arenas (`mla.L{l}`, 64 x 656 B = 41,984 B per page)
    ///   and 21 index-K arenas (`indexk.L{l}`, 64 x 132 B = 8,448 B) on layers 0, 1, 2 and every 4th
    ///   layer from 6 to 74, ordered by layer (MLA before index-K): 99 arenas, 3,452,160 B per block.
    ///   Source: the workload facts in `docs/design.md` (GLM-5.2 host-tier offload).
    /// - `qwen3-4b`: Qwen3-4B, 16-token pages, one fused page-first bf16 buffer: 36 arenas `kv.L{l}`
    ///   of 65,536 B ([K|V] of one layer) at offset `l * 65,536` in a 2,359,296 B page.
    /// - `deepseek-v3`: DeepSeek-V3 MLA, 61 layers, 64-token pages, fp8_ds_mla 656 B/token: 41,984 B.
    /// - `deepseek-v3-bf16`: the same with bf16 latents, 1,152 B/token: 73,728 B per page.
    /// - `llama3-8b`: Llama-3-8B, 32 layers, 16-token pages, separate K and V arenas of
    ///   8 heads x 128 dims x 2 B x 16 tokens = 32,768 B per page (64 arenas).
    ///
    /// # Errors
    /// [`GeometryError::UnknownPreset`] for another name; the checks of [`Geometry::new`].
    pub fn preset(name: &str, pages: u64) -> Result<Self, GeometryError> {
        match name {
            "glm52" => {
                let (mut arenas, mut layers) = (Vec::with_capacity(99), Vec::with_capacity(99));
                for l in 0..78u64 {
                    arenas.push(ArenaSpec::packed(format!("mla.L{l}"), 64 * 656, pages));
                    layers.push(l as u32);
                    if l <= 2 || (6..=74).contains(&l) && (l - 6) % 4 == 0 {
                        arenas.push(ArenaSpec::packed(format!("indexk.L{l}"), 64 * 132, pages));
                        layers.push(l as u32);
                    }
                }
                Geometry::new("GLM-5.2", 64, arenas)?.with_layers(layers)
            }
            "qwen3-4b" => {
                let seg = 65_536u64;
                let arenas = (0..36u64)
                    .map(|l| ArenaSpec {
                        name: format!("kv.L{l}"),
                        bytes_per_page: seg,
                        page_stride: 36 * seg,
                        pages,
                        placement: Placement::Fused { buffer: 0, offset: l * seg },
                    })
                    .collect();
                Geometry::new("Qwen3-4B", 16, arenas)?.with_layers((0..36).collect())
            }
            "deepseek-v3" | "deepseek-v3-bf16" => {
                let per_token = if name == "deepseek-v3" { 656 } else { 1152 };
                let arenas = (0..61).map(|l| ArenaSpec::packed(format!("mla.L{l}"), 64 * per_token, pages)).collect();
                let model = if name == "deepseek-v3" { "DeepSeek-V3/fp8_ds_mla" } else { "DeepSeek-V3/bf16" };
                Geometry::new(model, 64, arenas)?.with_layers((0..61).collect())
            }
            "llama3-8b" => {
                let unit = 8 * 128 * 2 * 16;
                let mut arenas = Vec::with_capacity(64);
                for l in 0..32 {
                    arenas.push(ArenaSpec::packed(format!("k.L{l}"), unit, pages));
                    arenas.push(ArenaSpec::packed(format!("v.L{l}"), unit, pages));
                }
                Geometry::new("Llama-3-8B", 16, arenas)?.with_layers((0..64).map(|i| i / 2).collect())
            }
            _ => Err(GeometryError::UnknownPreset { name: name.to_string(), known: Self::PRESETS.join(", ") }),
        }
    }
}

/// One rank's device base addresses for a [`Geometry`]'s arenas, validated.
///
/// Base `i` is the address of page 0 of arena `i` (the engine's raw device pointer; for the host
/// backend an ordinary host address). Checked: one base per arena, non-null, 16-byte aligned, the
/// extent `base + (pages - 1) * page_stride + bytes_per_page` fits in `u64`, and no byte of one arena
/// is a byte of another. Arenas with equal strides may interleave (a fused page-first buffer viewed
/// per layer); arenas whose extents intersect otherwise are rejected as overlapping.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArenaBinding {
    bases: Vec<u64>,
}

impl ArenaBinding {
    /// Validates `bases` against `geometry`.
    ///
    /// # Errors
    /// [`GeometryError::BaseCount`], [`GeometryError::NullBase`], [`GeometryError::Misaligned`]
    /// (field `base`), [`GeometryError::Overflow`] or [`GeometryError::Overlap`].
    pub fn new(geometry: &Geometry, bases: Vec<u64>) -> Result<Self, GeometryError> {
        let arenas = geometry.arenas();
        if bases.len() != arenas.len() {
            return Err(GeometryError::BaseCount { got: bases.len(), want: arenas.len() });
        }
        let mut spans = Vec::with_capacity(arenas.len());
        for (a, &b) in arenas.iter().zip(&bases) {
            if b == 0 {
                return Err(GeometryError::NullBase { arena: a.name.clone() });
            }
            if b % COPY_ALIGN != 0 {
                return Err(GeometryError::Misaligned { arena: a.name.clone(), field: "base", value: b });
            }
            let end = b.checked_add(a.extent()).ok_or_else(|| GeometryError::Overflow {
                arena: a.name.clone(),
                pages: a.pages,
                stride: a.page_stride,
            })?;
            spans.push((b, end));
        }
        // Sort by base so only neighbours with intersecting extents need the interleave test.
        let mut order: Vec<usize> = (0..arenas.len()).collect();
        order.sort_by_key(|&i| spans[i].0);
        for (k, &i) in order.iter().enumerate() {
            for &j in &order[k + 1..] {
                if spans[j].0 >= spans[i].1 {
                    break;
                }
                if !Self::interleave_ok(&arenas[i], spans[i].0, &arenas[j], spans[j].0) {
                    return Err(GeometryError::Overlap { a: arenas[i].name.clone(), b: arenas[j].name.clone() });
                }
            }
        }
        Ok(ArenaBinding { bases })
    }

    /// Arena `a` at `ba` and arena `b` at `bb >= ba` with intersecting extents: do their pages
    /// interleave without sharing a byte? Needs equal strides and `b`'s chunk to sit in the gap after
    /// `a`'s chunk in every page.
    fn interleave_ok(a: &ArenaSpec, ba: u64, b: &ArenaSpec, bb: u64) -> bool {
        if a.page_stride != b.page_stride {
            return false;
        }
        let s = a.page_stride;
        let d = (bb - ba) % s;
        d >= a.bytes_per_page && d + b.bytes_per_page <= s
    }

    /// Base address of each arena, in geometry order.
    pub fn bases(&self) -> &[u64] {
        &self.bases
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn glm52_layout_matches_the_workload_facts() {
        let g = Geometry::preset("glm52", 16).unwrap();
        assert_eq!(g.arenas().len(), 99);
        assert_eq!(g.arenas().iter().filter(|a| a.name.starts_with("mla")).count(), 78);
        assert_eq!(g.arenas().iter().filter(|a| a.name.starts_with("indexk")).count(), 21);
        assert_eq!(g.slot_bytes(), 3_452_160);
        assert_eq!(g.block_bytes(), 3_452_160);
        assert_eq!(g.chunk_offsets()[1], 41_984);
        assert!(g.arenas().iter().any(|a| a.name == "indexk.L74"));
        assert!(!g.arenas().iter().any(|a| a.name == "indexk.L3"));
    }

    #[test]
    fn a_disk_slot_is_the_host_slot_and_its_trailer_rounded_up_to_4_kib() {
        let g = Geometry::preset("glm52", 16).unwrap();
        // 3,452,160 B + 96 B = 3,452,256 B -> 843 pages of 4 KiB.
        assert_eq!(g.disk_slot_bytes(), 3_452_928);
        assert_eq!(g.disk_slots(2 << 40), 636_857);
        assert_eq!(g.disk_slots(4096 + 3_452_928), 1);
        assert_eq!(g.disk_slots(4096 + 3_452_927), 0);
        assert_eq!(g.disk_slots(0), 0);
    }

    #[test]
    fn presets_name_each_arenas_layer_and_bad_layers_are_rejected() {
        let g = Geometry::preset("glm52", 4).unwrap();
        assert_eq!(g.layer_count(), 78);
        assert_eq!(g.layers()[..6], [0, 0, 1, 1, 2, 2]);
        assert_eq!(g.layers()[98], 77);
        let l = Geometry::preset("llama3-8b", 4).unwrap();
        assert_eq!((l.layer_count(), l.layers()[63]), (32, 31));
        assert_eq!(l.with_pages(8).unwrap().layers(), l.layers(), "with_pages keeps the layers");
        assert_eq!(Geometry::preset("deepseek-v3", 1).unwrap().layer_count(), 61);
        assert_eq!(Geometry::preset("qwen3-4b", 1).unwrap().layer_count(), 36);
        let two = Geometry::new("m", 16, vec![ArenaSpec::packed("a", 64, 4), ArenaSpec::packed("b", 64, 4)]).unwrap();
        assert_eq!(two.layer_count(), 1, "default: one layer");
        assert_eq!(two.with_layers(vec![3, 9]).unwrap().layer_count(), 2);
        assert_eq!(two.with_layers(vec![3, 9]).unwrap().namespace(), two.namespace());
        assert_eq!(two.with_layers(vec![3, 9]).unwrap(), two, "layers do not enter equality");
        assert!(matches!(two.with_layers(vec![0]), Err(GeometryError::Layers { .. })));
        let e = two.with_layers(vec![1, 0]).unwrap_err();
        assert!(e.to_string().contains("arena `b` is in layer 0 after arena `a` in layer 1"), "{e}");
    }

    #[test]
    fn presets_validate() {
        for p in Geometry::PRESETS {
            let g = Geometry::preset(p, 4).unwrap();
            assert!(g.slot_bytes() >= g.block_bytes());
            assert_eq!(g.slot_bytes() % SLOT_CHUNK_ALIGN, 0);
        }
        assert_eq!(Geometry::preset("qwen3-4b", 1).unwrap().slot_bytes(), 2_359_296);
        assert_eq!(Geometry::preset("llama3-8b", 1).unwrap().slot_bytes(), 64 * 32_768);
        assert!(matches!(Geometry::preset("nope", 1), Err(GeometryError::UnknownPreset { .. })));
    }

    #[test]
    fn namespace_depends_on_layout_not_placement() {
        let a = Geometry::preset("glm52", 16).unwrap();
        let b = Geometry::preset("glm52", 9000).unwrap();
        let c = Geometry::preset("deepseek-v3", 16).unwrap();
        assert_eq!(a.namespace(), b.namespace());
        assert_ne!(a.namespace(), c.namespace());
        let s0 = a.with_shard(0, 2).unwrap();
        let s1 = a.with_shard(1, 2).unwrap();
        assert_ne!(s0.namespace(), s1.namespace());
        assert_ne!(s0.namespace(), a.namespace());
        assert_eq!(s0.with_pages(8).unwrap().namespace(), s0.namespace());
        assert!(a.with_shard(2, 2).is_err());
    }

    #[test]
    fn bad_geometries_are_rejected() {
        let ok = || ArenaSpec::packed("a", 64, 4);
        assert_eq!(Geometry::new("m", 16, vec![]), Err(GeometryError::NoArenas));
        assert!(matches!(Geometry::new("", 16, vec![ok()]), Err(GeometryError::MissingField { field: "model" })));
        assert!(matches!(Geometry::new("m", 0, vec![ok()]), Err(GeometryError::MissingField { .. })));
        assert!(matches!(
            Geometry::new("m", 16, vec![ArenaSpec::packed("a", 40, 4)]),
            Err(GeometryError::Misaligned { field: "bytes_per_page", value: 40, .. })
        ));
        assert!(matches!(
            Geometry::new("m", 16, vec![ArenaSpec::packed("a", 0, 4)]),
            Err(GeometryError::Zero { field: "bytes_per_page", .. })
        ));
        assert!(matches!(
            Geometry::new("m", 16, vec![ArenaSpec::packed("a", 64, 0)]),
            Err(GeometryError::Zero { field: "pages", .. })
        ));
        let mut s = ok();
        s.page_stride = 32;
        assert!(matches!(Geometry::new("m", 16, vec![s]), Err(GeometryError::StrideBelowUnit { .. })));
        assert!(matches!(Geometry::new("m", 16, vec![ok(), ok()]), Err(GeometryError::BadName { index: 1, .. })));
        let huge = ArenaSpec::packed("h", 1 << 40, 1 << 30);
        assert!(matches!(Geometry::new("m", 16, vec![huge]), Err(GeometryError::Overflow { .. })));
        let many = (0..MAX_ARENAS + 1).map(|i| ArenaSpec::packed(format!("a{i}"), 16, 1)).collect();
        assert!(matches!(Geometry::new("m", 16, many), Err(GeometryError::TooManyArenas { .. })));
    }

    #[test]
    fn bindings_check_alignment_overlap_and_interleave() {
        let g = Geometry::new("m", 16, vec![ArenaSpec::packed("a", 64, 4), ArenaSpec::packed("b", 32, 4)]).unwrap();
        assert!(ArenaBinding::new(&g, vec![0x1000, 0x2000]).is_ok());
        assert!(matches!(ArenaBinding::new(&g, vec![0x1000]), Err(GeometryError::BaseCount { got: 1, want: 2 })));
        assert!(matches!(ArenaBinding::new(&g, vec![0, 0x2000]), Err(GeometryError::NullBase { .. })));
        assert!(matches!(
            ArenaBinding::new(&g, vec![0x1008, 0x2000]),
            Err(GeometryError::Misaligned { field: "base", .. })
        ));
        // a spans 0x1000..0x1100; b at 0x10f0 overlaps its last page.
        assert!(matches!(ArenaBinding::new(&g, vec![0x1000, 0x10f0]), Err(GeometryError::Overlap { .. })));
        // Interleaved views of one fused buffer are fine; a shifted view that collides is not.
        let q = Geometry::preset("qwen3-4b", 8).unwrap();
        let bases: Vec<u64> = (0..36u64).map(|l| 0x10_0000 + l * 65_536).collect();
        assert!(ArenaBinding::new(&q, bases.clone()).is_ok());
        let mut bad = bases;
        bad[1] = 0x10_0000 + 32_768;
        assert!(matches!(ArenaBinding::new(&q, bad), Err(GeometryError::Overlap { .. })));
        let top = ArenaBinding::new(&g, vec![u64::MAX - 15, 0x2000]);
        assert!(matches!(top, Err(GeometryError::Overflow { .. })));
    }
}
