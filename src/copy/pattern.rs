//! Bytes derived from a content key, for replays and tests that must verify every restored byte.
//!
//! Word `i` (8 bytes, little-endian) of arena `a`'s chunk of the block with key `k` is
//! `mix64(seed(k) + (a << 32) + i)` (wrapping), where `seed(k) = lo ^ rotl(hi, 32)` of the key's two
//! words and `mix64` is the splitmix64 finaliser. The CUDA fill/verify kernels compute the same
//! function (`cuda/kvtier_pattern.cuh`), so bytes written on either side can be checked on the other.

use crate::key::ContentKey;

/// The splitmix64 finaliser.
#[inline(always)]
pub fn mix64(x: u64) -> u64 {
    let z = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The per-key seed of the pattern.
#[inline]
pub fn seed(key: &ContentKey) -> u64 {
    let (lo, hi) = key.words();
    lo ^ hi.rotate_left(32)
}

/// The expected 8-byte word `word` of arena `arena`'s chunk of the block `key`.
#[inline(always)]
pub fn word(seed: u64, arena: usize, word: u64) -> u64 {
    mix64(seed.wrapping_add((arena as u64) << 32).wrapping_add(word))
}

/// Fills `chunk` (a multiple of 8 bytes) with the pattern of `key`'s arena `arena`.
pub fn fill(key: &ContentKey, arena: usize, chunk: &mut [u8]) {
    debug_assert_eq!(chunk.len() % 8, 0);
    let s = seed(key);
    for (i, w) in chunk.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&word(s, arena, i as u64).to_le_bytes());
    }
}

/// Byte offset of the first byte of `chunk` that differs from the pattern, or `None` if all match.
pub fn first_mismatch(key: &ContentKey, arena: usize, chunk: &[u8]) -> Option<usize> {
    debug_assert_eq!(chunk.len() % 8, 0);
    let s = seed(key);
    for (i, w) in chunk.chunks_exact(8).enumerate() {
        let want = word(s, arena, i as u64).to_le_bytes();
        if w != want {
            let b = w.iter().zip(want.iter()).position(|(x, y)| x != y).expect("differs");
            return Some(i * 8 + b);
        }
    }
    None
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn fill_then_verify() {
        let k = ContentKey([7; 16]);
        let mut c = vec![0u8; 256];
        fill(&k, 3, &mut c);
        assert_eq!(first_mismatch(&k, 3, &c), None);
        assert_eq!(first_mismatch(&k, 4, &c), Some(0));
        c[77] ^= 1;
        assert_eq!(first_mismatch(&k, 3, &c), Some(77));
        // Pinned value so the CUDA kernels can be checked against it.
        assert_eq!(word(0, 0, 0), 0);
        assert_eq!(word(1, 0, 0), 0x5692_161d_100b_05e5);
    }
}
