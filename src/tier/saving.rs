//! The keys being saved: a save's entry for each key it has planned to copy and not yet reserved
//! (see `save_plan.rs`), so that two saves of one prefix never both take slots for it.

use crate::key::{ContentKey, FoldHashing};
use crate::sync::Mutex;
use crossbeam_utils::CachePadded;
use std::collections::HashSet;

/// Keys that a save has planned to copy and not yet reserved (see the module docs). Sharded by key
/// hash, each shard in its own cache line; an uncontended entry is one short mutex hold.
pub(crate) struct SavingKeys {
    shards: Box<[CachePadded<Mutex<KeySet>>]>,
}

/// One shard's keys.
type KeySet = HashSet<ContentKey, FoldHashing>;

impl SavingKeys {
    const SHARDS: usize = 16;

    pub(crate) fn new() -> Self {
        SavingKeys { shards: (0..Self::SHARDS).map(|_| CachePadded::new(Mutex::new(KeySet::default()))).collect() }
    }

    fn shard(&self, key: &ContentKey) -> &Mutex<KeySet> {
        // Bits 32-35: the set within a shard hashes by the same `hash64` (`FoldHashing`), taking
        // its bucket from the low bits and its tag from the top 7.
        &self.shards[(key.hash64() >> 32) as usize % Self::SHARDS]
    }

    /// True if this call entered `key` (no other save holds it).
    pub(crate) fn enter(&self, key: ContentKey) -> bool {
        crate::sync::lock(self.shard(&key)).insert(key)
    }

    pub(crate) fn release(&self, key: &ContentKey) {
        let removed = crate::sync::lock(self.shard(key)).remove(key);
        debug_assert!(removed, "released a saving entry that was not held");
    }
}
