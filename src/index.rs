//! `BlockIndex`: lock-free content-key -> (slot, generation) hash index. (STUB: being written.)

use crate::key::ContentKey;
use crate::slot::SlotId;

/// Where a block lives: its slot and the slot generation it was saved under.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Hash)]
pub struct SlotRef {
    /// Host slot.
    pub slot: SlotId,
    /// Slot generation at reservation.
    pub generation: u64,
}

/// The index.
pub struct BlockIndex {
    _p: (),
}

impl BlockIndex {
    /// An index sized for about `expected` live entries.
    pub fn with_capacity(_expected: usize) -> Self {
        todo!()
    }
    /// Inserts `key -> value` unless `key` is present; `Err(existing)` if present.
    pub fn insert_if_absent(&self, _key: ContentKey, _value: SlotRef) -> Result<(), SlotRef> {
        todo!()
    }
    /// Looks `key` up.
    pub fn get(&self, _key: &ContentKey) -> Option<SlotRef> {
        todo!()
    }
    /// Removes `key` only if it maps to `expected`.
    pub fn remove_if(&self, _key: &ContentKey, _expected: SlotRef) -> bool {
        todo!()
    }
    /// A reader that pins the epoch once for several lookups.
    pub fn reader(&self) -> IndexReader<'_> {
        todo!()
    }
    /// Live entries.
    pub fn len(&self) -> usize {
        todo!()
    }
    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A batch reader (stub).
pub struct IndexReader<'a> {
    _i: &'a BlockIndex,
}
impl IndexReader<'_> {
    /// Looks `key` up.
    pub fn get(&self, _key: &ContentKey) -> Option<SlotRef> {
        todo!()
    }
}
