// kvtier copy descriptors shared by the CUDA kernels (kvtier_copy.cu) and the Rust side
// (src/cuda/desc.rs). Every struct here has a `#[repr(C)]` twin in Rust; a CPU test
// (tests/descriptors.rs) parses this file and checks that the field names, types and offsets match,
// and the static_asserts below check the sizes on the CUDA side.
//
// Units: all sizes and offsets are bytes; all addresses are 64-bit device addresses (for host
// memory: the device alias of the registered pool, never the host address).
#ifndef KVTIER_COPY_CUH
#define KVTIER_COPY_CUH

typedef unsigned long long kvt_u64;
typedef unsigned int kvt_u32;

// Bytes of one work item ("segment"): a chunk of an arena's page is cut into segments of at most
// this many bytes, and each warp moves one segment at a time.
#define KVT_SEG_BYTES 4096
// Threads per CTA of the copy kernels.
#define KVT_THREADS 512
// Pairs carried inside the kernel parameters (no upload for small batches).
#define KVT_INLINE_PAIRS 64

// One arena of a rank: page p of the arena starts at base + p * page_stride and holds
// bytes_per_page bytes, which live at slot_offset inside a host slot. 32 B.
struct kvt_arena {
    kvt_u64 base;
    kvt_u64 page_stride;
    kvt_u64 bytes_per_page;
    kvt_u64 slot_offset;
};

// One block to move: GPU page gpu_page (of every arena) <-> host slot `slot`. 16 B, the layout of
// Rust's `CopyPair`.
struct kvt_pair {
    kvt_u64 gpu_page;
    kvt_u32 slot;
    kvt_u32 reserved;
};

// One segment of a block: bytes [offset, offset + len) of arena `arena`'s chunk; len is a
// multiple of 16 and at most KVT_SEG_BYTES. A geometry's segments, in arena order, form its
// segment table (built once per backend). 16 B.
struct kvt_seg {
    kvt_u32 arena;
    kvt_u32 offset;
    kvt_u32 len;
    kvt_u32 reserved;
};

// Arguments of the save/restore kernels (passed by value). Work item w is segment
// (w % segs_per_block) of pair (w / segs_per_block); a launch moves items [item_begin, item_end)
// (a whole batch: [0, n_pairs * segs_per_block); a staged piece: any sub-range, also part of a block).
struct kvt_copy_args {
    kvt_u64 arenas;        // const kvt_arena*: the arena table (device memory)
    kvt_u64 segs;          // const kvt_seg*: the segment table (device memory)
    kvt_u64 pairs;         // const kvt_pair*: the batch (device memory), or 0: use inline_pairs
    kvt_u64 host_base;     // device address of host slot 0 (pool alias) or of the staging buffer
    kvt_u64 slot_bytes;    // host slot stride
    kvt_u64 item_begin;    // first work item of the launch
    kvt_u64 item_end;      // one past the last work item
    kvt_u32 segs_per_block;
    kvt_u32 flags;         // KVT_FLAG_*
    struct kvt_pair inline_pairs[KVT_INLINE_PAIRS];
};

// flags: the host-side slot of pair i is i (staging buffer), not pairs[i].slot.
#define KVT_FLAG_SLOT_IS_INDEX 1u

// Arguments of the fill and verify kernels (pattern of kvtier_pattern.cuh).
struct kvt_pattern_args {
    kvt_u64 arenas;        // const kvt_arena*
    kvt_u64 segs;          // const kvt_seg*
    kvt_u64 pages;         // const kvt_u64*: GPU page of item i
    kvt_u64 seeds;         // const kvt_u64*: pattern seed of item i
    kvt_u64 mismatch;      // kvt_u64*: verify: atomicMin of (i * n_arenas + arena) on a mismatch
    kvt_u64 n;             // items
    kvt_u64 delay_ns;      // each CTA waits this long before touching memory (ordering tests)
    kvt_u32 segs_per_block;
    kvt_u32 n_arenas;
};

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
static_assert(sizeof(kvt_arena) == 32, "kvt_arena is 32 B");
static_assert(sizeof(kvt_pair) == 16, "kvt_pair is 16 B (Rust CopyPair)");
static_assert(sizeof(kvt_seg) == 16, "kvt_seg is 16 B");
static_assert(sizeof(kvt_copy_args) == 64 + 16 * KVT_INLINE_PAIRS, "kvt_copy_args size");
static_assert(sizeof(kvt_pattern_args) == 64, "kvt_pattern_args size");
#endif

#endif
