//! The pool's configuration: which pages back it ([`Backing`], [`BackingChoice`]), the options
//! ([`PoolConfig`]), its address range as a value ([`PoolRegion`]) and the slot count every
//! constructor checks.

use super::MAX_SLOTS;
use crate::error::PoolError;
use std::path::Path;

/// Which pages back the pool (reported after construction).
#[derive(Copy, Clone, PartialEq, Eq, Debug)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Backing {
    /// Reserved 2 MiB hugetlb pages (`MAP_HUGETLB`).
    HugeTlb,
    /// Transparent hugepages: a 2 MiB-aligned anonymous mapping advised with `MADV_HUGEPAGE`.
    TransparentHuge,
    /// Ordinary 4 KiB pages.
    Plain,
}

impl Backing {
    /// Short lower-case name (`hugetlb`, `thp`, `plain`), as in error messages and reports.
    pub fn name(self) -> &'static str {
        match self {
            Backing::HugeTlb => "hugetlb",
            Backing::TransparentHuge => "thp",
            Backing::Plain => "plain",
        }
    }
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

/// Pool construction options. Build with [`PoolConfig::new`] and the `with_*` methods.
#[derive(Clone, Debug, Default)]
#[non_exhaustive]
pub struct PoolConfig {
    /// Bytes of host memory for slots; the capacity is `floor(bytes / slot_bytes)` slots.
    pub bytes: u64,
    /// Backing to ask for.
    pub backing: BackingChoice,
    /// `mlock` the mapping (after the prefault, if any). Failure is [`PoolError::Syscall`] with
    /// `call = "mlock"` (typically `RLIMIT_MEMLOCK` for a non-root user).
    pub mlock: bool,
    /// Bind the mapping to this NUMA node (`mbind(MPOL_BIND)` before any page is touched). A node
    /// that does not exist is [`PoolError::NoSuchNumaNode`].
    pub numa_node: Option<u32>,
    /// Touch every backing page at construction (one write per 2 MiB hugetlb page, per 4 KiB page
    /// otherwise), on up to 8 threads for pools of 64 MiB or more.
    pub prefault: bool,
    /// Map a pool larger than memory can back, on purpose. Without it, before anything is
    /// mapped, a pool on 4 KiB pages or THP is refused with [`PoolError::ExceedsMemory`] when
    /// its mapping is larger than physical memory (`MemTotal` in `/proc/meminfo`, less the
    /// hugetlb pool), or, when it is prefaulted or locked, larger than `MemAvailable` (such a
    /// pool takes its memory at start; the kernel's OOM killer would end this or another
    /// process). A hugetlb pool is checked against the free 2 MiB pages instead, and a locked
    /// pool against `RLIMIT_MEMLOCK` (unless the process has `CAP_IPC_LOCK`) whatever this says.
    pub overcommit: bool,
}

impl PoolConfig {
    /// `bytes` of host memory, backing chosen automatically, no `mlock`, no NUMA binding, no
    /// prefault.
    pub fn new(bytes: u64) -> Self {
        PoolConfig { bytes, ..Default::default() }
    }

    /// The slots a pool of this config holds for slots of `slot_bytes` bytes:
    /// `floor(bytes / slot_bytes)` (a 32 GiB pool of 3,452,160 B GLM-5.2 slots holds 9,953), the
    /// very count [`HostPool::new`](super::HostPool::new) maps. Maps nothing.
    ///
    /// # Errors
    /// As the pool's constructors check before mapping: [`PoolError::BadSlotSize`] (0 or not a
    /// multiple of 16), [`PoolError::TooSmall`] (less than one slot), [`PoolError::TooManySlots`]
    /// (over [`MAX_SLOTS`]), [`PoolError::NoSuchNumaNode`].
    pub fn slots(&self, slot_bytes: u64) -> Result<u32, PoolError> {
        slot_count(slot_bytes, self)
    }

    /// Sets the backing to ask for.
    pub fn with_backing(mut self, backing: BackingChoice) -> Self {
        self.backing = backing;
        self
    }

    /// `mlock`s the mapping (see [`PoolConfig::mlock`]).
    pub fn with_mlock(mut self, mlock: bool) -> Self {
        self.mlock = mlock;
        self
    }

    /// Binds the mapping to NUMA node `node` (see [`PoolConfig::numa_node`]).
    pub fn with_numa_node(mut self, node: u32) -> Self {
        self.numa_node = Some(node);
        self
    }

    /// Touches every backing page at construction (see [`PoolConfig::prefault`]).
    pub fn with_prefault(mut self, prefault: bool) -> Self {
        self.prefault = prefault;
        self
    }

    /// Maps a pool larger than memory can back, on purpose (see [`PoolConfig::overcommit`]).
    pub fn with_overcommit(mut self, overcommit: bool) -> Self {
        self.overcommit = overcommit;
        self
    }
}

/// The pool's address range as a plain value, for copy backends.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct PoolRegion {
    /// Host address of slot 0 (the start of the mapping; 2 MiB aligned for hugetlb and THP).
    pub host_base: usize,
    /// Mapped bytes (`>= capacity * slot_bytes`, a multiple of the backing page size).
    pub bytes: u64,
    /// Bytes per slot (the slot stride).
    pub slot_bytes: u64,
    /// Slots.
    pub capacity: u32,
}

/// The pool's capacity in slots for `config`, after the checks every constructor makes (slot size,
/// at least one slot, at most [`MAX_SLOTS`], an existing NUMA node).
pub(super) fn slot_count(slot_bytes: u64, config: &PoolConfig) -> Result<u32, PoolError> {
    if slot_bytes == 0 || slot_bytes % 16 != 0 {
        return Err(PoolError::BadSlotSize { slot_bytes });
    }
    let slots = config.bytes / slot_bytes;
    if slots == 0 {
        return Err(PoolError::TooSmall { bytes: config.bytes, slot_bytes });
    }
    if slots > MAX_SLOTS as u64 {
        return Err(PoolError::TooManySlots { slots, max: MAX_SLOTS as u64 });
    }
    if let Some(node) = config.numa_node {
        if !Path::new(&format!("/sys/devices/system/node/node{node}")).is_dir() {
            return Err(PoolError::NoSuchNumaNode { node });
        }
    }
    Ok(slots as u32)
}
