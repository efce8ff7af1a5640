// kvtier gather (save, D2H) and scatter (restore, H2D) kernels, and the pattern fill/verify kernels.
//
// Compiled at run time with NVRTC for the device's architecture (src/cuda/device.rs) and checked
// for sm_80 and sm_90 in CI (cuda/check.sh). No includes beyond our own headers.
//
// Copy kernels: a persistent grid of a few CTAs (the count is a launch parameter: a copy over PCIe
// needs only a handful of SMs and must not starve the engine's compute). Work items are segments
// of at most KVT_SEG_BYTES of one arena's chunk of one block (see kvt_seg); warp `g` takes items
// g, g + warps, g + 2 * warps, ... so neighbouring warps move neighbouring bytes, both the 41,984 B
// and the 8,448 B chunks of GLM-5.2 keep every lane busy, and a batch of one block still spreads
// over every warp. Each lane moves 16 B per access and issues U loads before its first store, so a
// warp has U * 512 B in flight (host reads are round trips of about 1.6 us: restores want a larger
// U or more CTAs than saves). All byte offsets are 64-bit.
#include "kvtier_copy.cuh"
#include "kvtier_pattern.cuh"

// Streaming (evict-first) 16-byte load and store.
__device__ __forceinline__ uint4 kvt_ld_stream(const uint4* p) { return __ldcs(p); }
__device__ __forceinline__ void kvt_st_stream(uint4* p, uint4 v) { __stcs(p, v); }

__device__ __forceinline__ kvt_pair kvt_get_pair(const kvt_copy_args& a, kvt_u64 i) {
    if (a.pairs != 0) {
        const kvt_pair* p = reinterpret_cast<const kvt_pair*>(a.pairs) + i;
        kvt_pair r;
        r.gpu_page = __ldg(&p->gpu_page);
        r.slot = __ldg(&p->slot);
        r.reserved = 0;
        return r;
    }
    return a.inline_pairs[i];
}

// SAVE = true: arenas -> host; false: host -> arenas.
template <bool SAVE, int U>
__device__ __forceinline__ void kvt_copy_body(const kvt_copy_args& a) {
    const kvt_u32 lane = threadIdx.x & 31u;
    const kvt_u64 warp = ((kvt_u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const kvt_u64 nwarps = ((kvt_u64)gridDim.x * blockDim.x) >> 5;
    const kvt_u64 spb = a.segs_per_block;
    const kvt_seg* segs = reinterpret_cast<const kvt_seg*>(a.segs);
    const kvt_arena* arenas = reinterpret_cast<const kvt_arena*>(a.arenas);
    for (kvt_u64 w = a.item_begin + warp; w < a.item_end; w += nwarps) {
        const kvt_u64 i = w / spb;
        const kvt_u32 s = (kvt_u32)(w - i * spb);
        const uint4 sv = __ldg(reinterpret_cast<const uint4*>(segs + s));
        const kvt_u32 arena = sv.x, offset = sv.y, len = sv.z;
        const kvt_pair p = kvt_get_pair(a, i);
        const kvt_arena* ar = arenas + arena;
        const kvt_u64 slot = (a.flags & KVT_FLAG_SLOT_IS_INDEX) ? i : (kvt_u64)p.slot;
        char* dev = reinterpret_cast<char*>(__ldg(&ar->base) + p.gpu_page * __ldg(&ar->page_stride) + offset);
        char* host = reinterpret_cast<char*>(a.host_base + slot * a.slot_bytes + __ldg(&ar->slot_offset) + offset);
        const char* src = SAVE ? dev : host;
        char* dst = SAVE ? host : dev;
        for (kvt_u32 base = 0; base < len; base += 32u * 16u * U) {
            uint4 v[U];
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const kvt_u32 off = base + ((kvt_u32)k * 32u + lane) * 16u;
                if (off < len) v[k] = kvt_ld_stream(reinterpret_cast<const uint4*>(src + off));
            }
#pragma unroll
            for (int k = 0; k < U; ++k) {
                const kvt_u32 off = base + ((kvt_u32)k * 32u + lane) * 16u;
                if (off < len) {
                    if (SAVE) kvt_st_stream(reinterpret_cast<uint4*>(dst + off), v[k]);
                    else *reinterpret_cast<uint4*>(dst + off) = v[k];  // keep restored pages in L2
                }
            }
        }
    }
}

// Variants by loads in flight per lane (U); the Rust side picks one per direction.
#define KVT_COPY_KERNEL(NAME, SAVE, U)                                              \
    extern "C" __global__ void __launch_bounds__(KVT_THREADS) NAME(const kvt_copy_args a) { \
        kvt_copy_body<SAVE, U>(a);                                                  \
    }
KVT_COPY_KERNEL(kvt_save_u4, true, 4)
KVT_COPY_KERNEL(kvt_save_u8, true, 8)
KVT_COPY_KERNEL(kvt_restore_u4, false, 4)
KVT_COPY_KERNEL(kvt_restore_u8, false, 8)

__device__ __forceinline__ void kvt_delay(kvt_u64 ns) {
    if (ns == 0) return;
    if (threadIdx.x == 0) {
        kvt_u64 t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do {
            __nanosleep(1000);
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        } while (t - t0 < ns);
    }
    __syncthreads();
}

// FILL = true: write the pattern; false: compare and record the first mismatching (item, arena).
template <bool FILL>
__device__ __forceinline__ void kvt_pattern_body(const kvt_pattern_args& a) {
    kvt_delay(a.delay_ns);
    const kvt_u32 lane = threadIdx.x & 31u;
    const kvt_u64 warp = ((kvt_u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const kvt_u64 nwarps = ((kvt_u64)gridDim.x * blockDim.x) >> 5;
    const kvt_u64 spb = a.segs_per_block;
    const kvt_u64 total = a.n * spb;
    const kvt_seg* segs = reinterpret_cast<const kvt_seg*>(a.segs);
    const kvt_arena* arenas = reinterpret_cast<const kvt_arena*>(a.arenas);
    const kvt_u64* pages = reinterpret_cast<const kvt_u64*>(a.pages);
    const kvt_u64* seeds = reinterpret_cast<const kvt_u64*>(a.seeds);
    for (kvt_u64 w = warp; w < total; w += nwarps) {
        const kvt_u64 i = w / spb;
        const kvt_seg sg = segs[w - i * spb];
        const kvt_arena ar = arenas[sg.arena];
        const kvt_u64 seed = seeds[i];
        uint4* dev = reinterpret_cast<uint4*>(ar.base + pages[i] * ar.page_stride + sg.offset);
        bool bad = false;
        for (kvt_u32 off = lane * 16u; off < sg.len; off += 32u * 16u) {
            const kvt_u64 word = (kvt_u64)(sg.offset + off) / 8u;
            const kvt_u64 w0 = kvt_word(seed, sg.arena, word), w1 = kvt_word(seed, sg.arena, word + 1);
            uint4 want;
            want.x = (kvt_u32)w0; want.y = (kvt_u32)(w0 >> 32);
            want.z = (kvt_u32)w1; want.w = (kvt_u32)(w1 >> 32);
            if (FILL) {
                dev[off / 16u] = want;
            } else {
                const uint4 got = dev[off / 16u];
                bad |= got.x != want.x || got.y != want.y || got.z != want.z || got.w != want.w;
            }
        }
        if (!FILL && bad) {
            atomicMin(reinterpret_cast<unsigned long long*>(a.mismatch), i * a.n_arenas + sg.arena);
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) kvt_fill(const kvt_pattern_args a) { kvt_pattern_body<true>(a); }
extern "C" __global__ void __launch_bounds__(256) kvt_verify(const kvt_pattern_args a) { kvt_pattern_body<false>(a); }

// Benchmark probes: stand-ins for an engine's kernels when measuring interference from copies.
//
// kvt_compute_probe: compute-bound (dependent FMAs, no memory traffic but one store). The work is
// `items` items of `iters` FMA pairs each, spread over the grid (CTA b takes items b, b + grid, ...),
// so a launch sized to a partition's SMs does the same total work as one sized to the whole GPU.
extern "C" __global__ void kvt_compute_probe(float* out, kvt_u32 iters, kvt_u32 items) {
    float x = threadIdx.x * 1e-3f, y = blockIdx.x * 1e-3f;
    for (kvt_u32 item = blockIdx.x; item < items; item += gridDim.x) {
        for (kvt_u32 i = 0; i < iters; ++i) {
            x = fmaf(x, 0.999f, y);
            y = fmaf(y, 0.999f, x);
        }
    }
    if (x == 12345.0f) out[0] = y;  // never true: keeps the loop alive
}

// kvt_decode_probe: memory-bound like decode attention: every SM streams a large buffer from HBM
// (16-byte loads, 4 in flight per thread, grid-stride over `n16` 16-byte words, far larger than the
// L2), folding what it reads into one word so nothing is optimised away.
extern "C" __global__ void kvt_decode_probe(const uint4* buf, kvt_u64 n16, kvt_u32* out) {
    const kvt_u64 stride = (kvt_u64)gridDim.x * blockDim.x;
    kvt_u32 acc = 0;
    kvt_u64 i = (kvt_u64)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        const uint4 a = buf[i], b = buf[i + stride], c = buf[i + 2 * stride], d = buf[i + 3 * stride];
        acc ^= a.x ^ a.w ^ b.y ^ b.z ^ c.x ^ c.w ^ d.y ^ d.z;
    }
    for (; i < n16; i += stride) {
        const uint4 a = buf[i];
        acc ^= a.x ^ a.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;  // almost never true
}

// kvt_sm_ids: CTA b records the SM it ran on in out[b] after holding it for about `hold_ns` ns (so
// the CTAs of one launch spread over the SMs they may use). For tests of SM partitions.
extern "C" __global__ void kvt_sm_ids(kvt_u32* out, kvt_u64 hold_ns) {
    kvt_delay(hold_ns);
    if (threadIdx.x == 0) {
        kvt_u32 sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        out[blockIdx.x] = sm;
    }
}

// kvt_spin_until: thread 0 of one CTA polls `*flag` (host-mapped memory the host writes) until it is
// at least `value`. A gate for ordering tests that blocks no stream's queue: the launch is
// dispatched and the kernel holds one SM slot while work queued after it on its stream waits.
extern "C" __global__ void kvt_spin_until(const volatile kvt_u32* flag, kvt_u32 value) {
    if (threadIdx.x == 0) {
        while (*flag < value) __nanosleep(2000);
    }
}
