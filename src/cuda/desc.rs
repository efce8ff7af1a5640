//! Rust twins of the descriptor structs in `cuda/kvtier_copy.cuh` (same field names, order and
//! types; checked by `tests/descriptors.rs`), and the per-geometry tables the kernels read.

use crate::error::CopyError;
use crate::geometry::{ArenaBinding, Geometry};

/// Bytes of one work item (`KVT_SEG_BYTES`).
pub const SEG_BYTES: u64 = 4096;
/// Threads per CTA of the copy kernels (`KVT_THREADS`).
pub const COPY_THREADS: u32 = 512;
/// Pairs passed inside the kernel parameters (`KVT_INLINE_PAIRS`).
pub const INLINE_PAIRS: usize = 64;
/// `KVT_FLAG_SLOT_IS_INDEX`: the host-side slot of pair `i` is `i` (a staging buffer).
pub const FLAG_SLOT_IS_INDEX: u32 = 1;

/// `struct kvt_arena`: one arena of a rank. 32 B.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct KvtArena {
    /// Device address of page 0.
    pub base: u64,
    /// Bytes between consecutive pages.
    pub page_stride: u64,
    /// Copy unit in bytes.
    pub bytes_per_page: u64,
    /// Offset of the arena's chunk inside a host slot, in bytes.
    pub slot_offset: u64,
}

/// `struct kvt_pair`: the CUDA view of [`crate::CopyPair`]. 16 B.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct KvtPair {
    /// GPU page id.
    pub gpu_page: u64,
    /// Host slot id.
    pub slot: u32,
    /// Padding (0).
    pub reserved: u32,
}

/// `struct kvt_seg`: bytes `[offset, offset + len)` of arena `arena`'s chunk. 16 B.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub struct KvtSeg {
    /// Arena index.
    pub arena: u32,
    /// Byte offset inside the chunk.
    pub offset: u32,
    /// Bytes (a multiple of 16, at most [`SEG_BYTES`]).
    pub len: u32,
    /// Padding (0).
    pub reserved: u32,
}

/// `struct kvt_copy_args`: the save/restore kernels' parameter block.
#[repr(C)]
#[derive(Copy, Clone, Debug)]
pub struct KvtCopyArgs {
    /// Device address of the arena table.
    pub arenas: u64,
    /// Device address of the segment table.
    pub segs: u64,
    /// Device address of the pair list, or 0 to use `inline_pairs`.
    pub pairs: u64,
    /// Device address of host slot 0 (pool alias) or of the staging buffer.
    pub host_base: u64,
    /// Host slot stride in bytes.
    pub slot_bytes: u64,
    /// First work item of the launch (item `w` = segment `w % segs_per_block` of pair
    /// `w / segs_per_block`).
    pub item_begin: u64,
    /// One past the last work item of the launch.
    pub item_end: u64,
    /// Segments of one block.
    pub segs_per_block: u32,
    /// `KVT_FLAG_*`.
    pub flags: u32,
    /// Small batches travel here.
    pub inline_pairs: [KvtPair; INLINE_PAIRS],
}

/// `struct kvt_pattern_args`: the fill/verify kernels' parameter block.
#[repr(C)]
#[derive(Copy, Clone, Debug, Default)]
pub struct KvtPatternArgs {
    /// Device address of the arena table.
    pub arenas: u64,
    /// Device address of the segment table.
    pub segs: u64,
    /// Device address of `n` GPU page ids (`u64`).
    pub pages: u64,
    /// Device address of `n` pattern seeds (`u64`).
    pub seeds: u64,
    /// Device address of the verify result (`u64`, `u64::MAX` = no mismatch).
    pub mismatch: u64,
    /// Items.
    pub n: u64,
    /// Delay before touching memory, in ns.
    pub delay_ns: u64,
    /// Segments of one block.
    pub segs_per_block: u32,
    /// Arenas.
    pub n_arenas: u32,
}

/// The arena table of a binding: one [`KvtArena`] per arena, in geometry order.
pub fn arena_table(geometry: &Geometry, binding: &ArenaBinding) -> Vec<KvtArena> {
    geometry
        .arenas()
        .iter()
        .zip(binding.bases())
        .zip(geometry.chunk_offsets())
        .map(|((a, &base), &off)| KvtArena {
            base,
            page_stride: a.page_stride,
            bytes_per_page: a.bytes_per_page,
            slot_offset: off,
        })
        .collect()
}

/// The segment table of a geometry: each arena's chunk cut into pieces of at most [`SEG_BYTES`].
///
/// # Errors
/// [`CopyError::ChunkTooLarge`] if a chunk is 4 GiB or larger (segment offsets are 32-bit).
pub fn segment_table(geometry: &Geometry) -> Result<Vec<KvtSeg>, CopyError> {
    let mut segs = Vec::new();
    for (i, a) in geometry.arenas().iter().enumerate() {
        if a.bytes_per_page >= 1 << 32 {
            return Err(CopyError::ChunkTooLarge { arena: a.name.clone(), bytes: a.bytes_per_page, max: 1 << 32 });
        }
        let mut off = 0;
        while off < a.bytes_per_page {
            let len = SEG_BYTES.min(a.bytes_per_page - off);
            segs.push(KvtSeg { arena: i as u32, offset: off as u32, len: len as u32, reserved: 0 });
            off += len;
        }
    }
    Ok(segs)
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn glm52_segments_cover_every_byte_once() {
        let g = Geometry::preset("glm52", 4).unwrap();
        let segs = segment_table(&g).unwrap();
        // 78 MLA chunks of 41,984 B = 10 x 4096 + 1024; 21 index-K chunks of 8,448 B = 2 x 4096 + 256.
        assert_eq!(segs.len(), 78 * 11 + 21 * 3);
        assert_eq!(segs.iter().map(|s| s.len as u64).sum::<u64>(), g.block_bytes());
        assert!(segs.iter().all(|s| s.len % 16 == 0 && s.len as u64 <= SEG_BYTES));
        assert_eq!(segs[10], KvtSeg { arena: 0, offset: 40_960, len: 1024, reserved: 0 });
    }
}
