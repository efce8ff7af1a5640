//! `HostPool`: the hugepage slab of fixed-size block slots in one host mapping. (STUB: being written.)

use crate::error::PoolError;
use crate::slot::{SlotControl, SlotId};
use std::any::Any;

/// Which pages back the pool (reported after construction).
#[derive(Copy, Clone, PartialEq, Eq, Debug, serde::Serialize)]
pub enum Backing {
    /// Reserved 2 MiB hugetlb pages (`MAP_HUGETLB`).
    HugeTlb,
    /// Transparent hugepages: a 2 MiB-aligned anonymous mapping advised with `MADV_HUGEPAGE`.
    TransparentHuge,
    /// Ordinary 4 KiB pages.
    Plain,
}

/// Which backing to ask for.
#[derive(Copy, Clone, PartialEq, Eq, Debug, Default)]
pub enum BackingChoice {
    /// hugetlb if enough 2 MiB pages are reserved, else THP, else plain pages.
    #[default]
    Auto,
    /// hugetlb or an error ([`PoolError::HugePagesUnavailable`]).
    HugeTlb,
    /// THP (or plain pages where THP is unavailable).
    TransparentHuge,
    /// Plain pages.
    Plain,
}

/// Pool construction options.
#[derive(Clone, Debug, Default)]
pub struct PoolConfig {
    /// Bytes of host memory for slots; the capacity is `floor(bytes / slot_bytes)` slots.
    pub bytes: u64,
    /// Backing to ask for.
    pub backing: BackingChoice,
    /// `mlock` the mapping.
    pub mlock: bool,
    /// Bind the mapping to this NUMA node (`mbind`).
    pub numa_node: Option<u32>,
    /// Touch every page at construction.
    pub prefault: bool,
}

/// The pool's address range as a plain value, for copy backends.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolRegion {
    /// Host address of slot 0.
    pub host_base: usize,
    /// Mapped bytes.
    pub bytes: u64,
    /// Bytes per slot (the slot stride).
    pub slot_bytes: u64,
    /// Slots.
    pub capacity: u32,
}

/// The slab pool.
pub struct HostPool {
    _p: (),
}

impl HostPool {
    /// Maps the pool.
    pub fn new(_slot_bytes: u64, _config: &PoolConfig) -> Result<Self, PoolError> {
        todo!()
    }
    /// Slots.
    pub fn capacity(&self) -> u32 {
        todo!()
    }
    /// Bytes per slot.
    pub fn slot_bytes(&self) -> u64 {
        todo!()
    }
    /// Backing in use.
    pub fn backing(&self) -> Backing {
        todo!()
    }
    /// Region.
    pub fn region(&self) -> PoolRegion {
        todo!()
    }
    /// Address of a slot.
    pub fn slot_ptr(&self, _slot: SlotId) -> *mut u8 {
        todo!()
    }
    /// Control words.
    pub fn control(&self) -> &SlotControl {
        todo!()
    }
    /// Pops a free slot.
    pub fn alloc(&self) -> Option<SlotId> {
        todo!()
    }
    /// Pushes a slot back.
    pub fn free(&self, _slot: SlotId) {
        todo!()
    }
    /// Approximate free slots.
    pub fn free_count(&self) -> usize {
        todo!()
    }
    /// Registration hook.
    pub fn with_registrations<R>(&self, _f: impl FnOnce(&mut Vec<Box<dyn Any + Send + Sync>>) -> R) -> R {
        todo!()
    }
}
