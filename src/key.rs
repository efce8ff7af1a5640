//! Content keys and namespaces.
//!
//! A [`ContentKey`] is the 16-byte identity of one block's bytes. Engines usually derive it as a
//! chained hash of the block's tokens and its parent block's key (a *lineage* hash, so a key names a
//! whole prefix, not just 64 tokens). A [`Namespace`] is a 16-byte digest of the layout facts (model,
//! tokens per page, each arena's name and copy unit); every key is folded with it
//! ([`Namespace::key`]), so two engines whose layouts differ can never hit each other's blocks.
//! An engine that already hashes its blocks (a 16-byte lineage hash, a 32-byte SHA-256, a 64-bit
//! integer, ...) passes those bytes to [`Namespace::key_from_bytes`].
//!
//! Hashing is XXH3-128 (`xxhash-rust`), the hash public engines already use for block lineage.

use std::fmt;
use xxhash_rust::xxh3::{xxh3_128, xxh3_128_with_seed, Xxh3Default};

/// The 16-byte content key of one block, already folded with its [`Namespace`].
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ContentKey(pub(crate) [u8; 16]);

impl ContentKey {
    /// The key of these 16 bytes (already namespaced: [`Namespace::key`] folds raw bytes in).
    #[inline]
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        ContentKey(bytes)
    }

    /// The key's 16 bytes.
    #[inline]
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// The key as two little-endian 64-bit words (low, high).
    #[inline]
    pub fn words(&self) -> (u64, u64) {
        let lo = u64::from_le_bytes(self.0[0..8].try_into().expect("8 bytes"));
        let hi = u64::from_le_bytes(self.0[8..16].try_into().expect("8 bytes"));
        (lo, hi)
    }

    /// Rebuilds a key from its two little-endian words (the inverse of [`ContentKey::words`]).
    #[inline]
    pub fn from_words(lo: u64, hi: u64) -> Self {
        let mut b = [0u8; 16];
        b[0..8].copy_from_slice(&lo.to_le_bytes());
        b[8..16].copy_from_slice(&hi.to_le_bytes());
        ContentKey(b)
    }

    /// A 64-bit hash of the key for hash tables. Keys are already uniform hashes, so this only
    /// mixes the two halves (so hand-made test keys that differ in one half still spread).
    #[inline]
    pub fn hash64(&self) -> u64 {
        let (lo, hi) = self.words();
        mix64(lo ^ hi.rotate_left(29))
    }
}

/// The splitmix64 finaliser: a bijection of `u64` that spreads every input bit over the output.
#[inline]
fn mix64(x: u64) -> u64 {
    let x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    let x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The `BuildHasher` of the tier's small internal maps and sets (the keys being saved and a save
/// plan's check for repeated keys, keyed by [`ContentKey`]; the chains' child lists, keyed by a
/// packed slot and generation), instead of std's SipHash, which was about 3% of a save's CPU time
/// in a profile of the tier bench: a content key is already a uniform hash, so [`FoldHasher`]
/// hashes one exactly as [`ContentKey::hash64`] does (two words folded, then mixed), and a `u64` by
/// the same mix. Not keyed: a client that chose colliding keys would only slow its own saves (a
/// plan's set holds that save's keys only; the saving set's shards, the keys of the saves in
/// flight).
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct FoldHashing;

impl std::hash::BuildHasher for FoldHashing {
    type Hasher = FoldHasher;
    #[inline]
    fn build_hasher(&self) -> FoldHasher {
        FoldHasher { words: [0; 2], n: 0 }
    }
}

/// The hasher of [`FoldHashing`]: the first two 64-bit words written (little-endian; a byte string
/// of another length is folded into them 8 bytes at a time), then `lo ^ hi.rotate_left(29)`, mixed.
#[derive(Debug)]
pub(crate) struct FoldHasher {
    words: [u64; 2],
    n: usize,
}

impl std::hash::Hasher for FoldHasher {
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..chunk.len()].copy_from_slice(chunk);
            self.write_u64(u64::from_le_bytes(w));
        }
    }
    #[inline]
    fn write_u64(&mut self, x: u64) {
        let i = self.n % 2;
        // A third word and later ones are mixed into the first two, so nothing written is lost.
        self.words[i] = if self.n < 2 { x } else { mix64(self.words[i] ^ x) };
        self.n += 1;
    }
    /// Length prefixes (a slice's or an array's) are not hashed: the maps hashed with this key
    /// fixed-size values only, whose lengths tell nothing.
    #[inline]
    fn write_usize(&mut self, _len: usize) {}
    #[inline]
    fn finish(&self) -> u64 {
        mix64(self.words[0] ^ self.words[1].rotate_left(29))
    }
}

impl fmt::Debug for ContentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentKey(")?;
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

impl fmt::Display for ContentKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in &self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// A 16-byte digest of the layout facts that make blocks interchangeable (see
/// [`crate::Geometry::namespace`]).
#[derive(Copy, Clone, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Namespace(pub(crate) [u8; 16]);

impl fmt::Debug for Namespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Namespace({})", ContentKey(self.0))
    }
}

impl Namespace {
    /// The namespace of these 16 bytes (a digest, as [`Namespace::from_description`] makes).
    #[inline]
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        Namespace(bytes)
    }

    /// The namespace's 16 bytes.
    #[inline]
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }

    /// Digest of an arbitrary canonical description (used by [`crate::Geometry`]).
    pub fn from_description(bytes: &[u8]) -> Self {
        Namespace(xxh3_128(bytes).to_le_bytes())
    }

    /// Folds a raw 16-byte engine hash into this namespace: `XXH3-128(namespace || raw)`.
    #[inline]
    pub fn key(&self, raw: &[u8; 16]) -> ContentKey {
        let mut buf = [0u8; 32];
        buf[..16].copy_from_slice(&self.0);
        buf[16..].copy_from_slice(raw);
        ContentKey(xxh3_128(&buf).to_le_bytes())
    }

    /// Folds an engine's own block hash of any length into this namespace:
    /// `XXH3-128(namespace || bytes)` (the 16 namespace bytes, then `bytes`, no length prefix or
    /// separator), as little-endian bytes. For a 16-byte `bytes` this is exactly [`Namespace::key`],
    /// so engines may switch between the two. The engine's hash should name the block's whole
    /// prefix (a lineage hash): equal bytes mean interchangeable blocks. An empty `bytes` is a
    /// valid (if useless) key.
    pub fn key_from_bytes(&self, bytes: &[u8]) -> ContentKey {
        let mut h = Xxh3Default::new();
        h.update(&self.0);
        h.update(bytes);
        ContentKey(h.digest128().to_le_bytes())
    }

    /// The key of page `page_in_block` of a trace block `block_hash` (the Mooncake trace's
    /// `hash_ids` entries): raw key = `block_hash` (LE u64) || `page_in_block` (LE u64).
    #[inline]
    pub fn trace_page_key(&self, block_hash: u64, page_in_block: u64) -> ContentKey {
        let mut raw = [0u8; 16];
        raw[..8].copy_from_slice(&block_hash.to_le_bytes());
        raw[8..].copy_from_slice(&page_in_block.to_le_bytes());
        self.key(&raw)
    }

    /// A lineage key: the hash of a block's token ids chained to its parent's key, so a key names the
    /// whole prefix up to and including this block. `parent` is `None` for the first block.
    /// Token ids are hashed as little-endian `u32`s.
    pub fn chain(&self, parent: Option<&ContentKey>, tokens: &[u32]) -> ContentKey {
        let seed = match parent {
            Some(p) => p.hash64(),
            None => u64::from_le_bytes(self.0[0..8].try_into().expect("8 bytes")),
        };
        let mut bytes = Vec::with_capacity(tokens.len() * 4);
        for t in tokens {
            bytes.extend_from_slice(&t.to_le_bytes());
        }
        let raw = xxh3_128_with_seed(&bytes, seed).to_le_bytes();
        self.key(&raw)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    /// A content key hashes the same through [`FoldHashing`] as by [`ContentKey::hash64`] (what
    /// the index and the sets' shards use), and distinct `u64`s hash apart.
    #[test]
    fn fold_hashing_hashes_a_key_as_hash64() {
        use std::hash::BuildHasher;
        for i in 0..100u64 {
            let k = ContentKey::from_words(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), !i);
            assert_eq!(FoldHashing.hash_one(k), k.hash64());
        }
        let h: std::collections::HashSet<u64> = (0..1000u64).map(|x| FoldHashing.hash_one(x)).collect();
        assert_eq!(h.len(), 1000);
    }

    #[test]
    fn namespace_separates_keys() {
        let a = Namespace::from_description(b"model-a");
        let b = Namespace::from_description(b"model-b");
        assert_ne!(a.trace_page_key(7, 0), b.trace_page_key(7, 0));
        assert_eq!(a.trace_page_key(7, 3), a.trace_page_key(7, 3));
        assert_ne!(a.trace_page_key(7, 3), a.trace_page_key(7, 4));
    }

    #[test]
    fn words_roundtrip() {
        let k = ContentKey([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]);
        let (lo, hi) = k.words();
        assert_eq!(ContentKey::from_words(lo, hi), k);
        assert_eq!(lo, 0x0807_0605_0403_0201);
    }

    #[test]
    fn key_from_bytes_is_xxh3_of_namespace_then_bytes() {
        let ns = Namespace::from_description(b"m");
        let raw: [u8; 16] = core::array::from_fn(|i| i as u8 * 7);
        // 16 bytes: the same key as Namespace::key.
        assert_eq!(ns.key_from_bytes(&raw), ns.key(&raw));
        // Any length: XXH3-128 over the concatenation (streamed, so long hashes are not copied).
        for len in [0usize, 1, 8, 32, 240, 241, 1000] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 % 251) as u8).collect();
            let mut cat = ns.0.to_vec();
            cat.extend_from_slice(&bytes);
            assert_eq!(ns.key_from_bytes(&bytes), ContentKey(xxh3_128(&cat).to_le_bytes()), "len {len}");
        }
        let other = Namespace::from_description(b"n");
        assert_ne!(ns.key_from_bytes(b"block-hash"), other.key_from_bytes(b"block-hash"));
        assert_ne!(ns.key_from_bytes(b"block-hash"), ns.key_from_bytes(b"block-hasH"));
        // A fixed value (16 zero namespace bytes, then b"kvtier"), so a change of hash, byte order
        // or concatenation order is caught.
        let fixed = Namespace([0u8; 16]).key_from_bytes(b"kvtier");
        assert_eq!(fixed.to_string(), "d2f850f29ca241b996008cdd90cec5bb");
    }

    #[test]
    fn chain_depends_on_parent() {
        let ns = Namespace::from_description(b"m");
        let a = ns.chain(None, &[1, 2, 3]);
        let b = ns.chain(Some(&a), &[1, 2, 3]);
        assert_ne!(a, b);
        assert_eq!(b, ns.chain(Some(&a), &[1, 2, 3]));
    }
}
