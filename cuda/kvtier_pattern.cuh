// The verification pattern of src/pattern.rs on the device: word i (8 bytes, little-endian) of
// arena a's chunk of the block with seed s is mix64(s + (a << 32) + i), wrapping, where mix64 is the
// splitmix64 finaliser. Both sides must compute the same bytes (pinned by tests).
#ifndef KVTIER_PATTERN_CUH
#define KVTIER_PATTERN_CUH
#include "kvtier_copy.cuh"

__device__ __forceinline__ kvt_u64 kvt_mix64(kvt_u64 x) {
    kvt_u64 z = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

__device__ __forceinline__ kvt_u64 kvt_word(kvt_u64 seed, kvt_u32 arena, kvt_u64 word) {
    return kvt_mix64(seed + ((kvt_u64)arena << 32) + word);
}

#endif
