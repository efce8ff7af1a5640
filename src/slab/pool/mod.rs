//! [`HostPool`]: the hugepage slab of fixed-size block slots in one host mapping.
//!
//! # Layout
//!
//! ```text
//!  host_base                                                     host_base + mapped_bytes
//!  | slot 0 | slot 1 | ... | slot capacity-1 | tail (unused, < one backing page + one slot) |
//!    <-slot_bytes->
//! ```
//!
//! - `capacity = floor(config.bytes / slot_bytes)`: rounded *down*, so no slot reaches past the
//!   memory asked for (a slot reaching past the backing region is a bug class seen in public
//!   host-tier projects). The mapping is `capacity * slot_bytes` rounded *up* to the backing page
//!   size (2 MiB for hugetlb and THP, the base page size, 4 KiB, otherwise), so every slot is mapped.
//! - The slot stride is `slot_bytes` (from [`crate::Geometry::slot_bytes`], a multiple of 256 B; the
//!   pool checks a multiple of 16 B, the copy kernels' access width). Slot `i` starts at
//!   `host_base + i * slot_bytes` (64-bit arithmetic: a 64 GiB pool has offsets far above 2^31).
//!
//! # Backing
//!
//! [`BackingChoice::Auto`] takes the first that works, and [`HostPool::backing`] reports it:
//!
//! 1. [`Backing::HugeTlb`]: reserved 2 MiB hugetlb pages (`MAP_HUGETLB | MAP_HUGE_2MB`), only when
//!    enough are free ([`hugetlb_free_pages`]: `free_hugepages - resv_hugepages`, per NUMA node when
//!    one is configured). `MAP_NORESERVE` is never used: without a reservation the first write to a
//!    page the kernel cannot supply kills the process with SIGBUS; with one, `mmap` fails cleanly.
//! 2. [`Backing::TransparentHuge`]: an anonymous mapping over-mapped by 2 MiB and trimmed to a 2 MiB
//!    aligned start and length, advised with `MADV_HUGEPAGE` (THP in `madvise` mode, as on the dev box
//!    and the H200 machine). Reported as [`Backing::Plain`] when THP is off (`[never]`) or the kernel
//!    refuses the advice.
//! 3. [`Backing::Plain`]: ordinary base pages.
//!
//! Then, in this order: `mbind(MPOL_BIND)` to [`PoolConfig::numa_node`] (before any page is touched,
//! so every page lands on that node), prefault (one write per backing page, on several threads for
//! large pools), `mlock`.
//!
//! # Hot path
//!
//! [`HostPool::alloc`] / [`HostPool::free`] are the lock-free [`FreeList`] (no mutex, no syscall).
//! They only hand out and take back ids; the tier moves slot words through the state machine with
//! [`SlotControl`] (`reserve` after `alloc`, `release` before `free`).
//!
//! # Teardown
//!
//! Registrations (the CUDA backend's `cuMemHostRegister` guard, see [`HostPool::with_registrations`])
//! are dropped before the memory is unmapped.

use crate::error::PoolError;
use crate::slab::freelist::FreeList;
use crate::slab::slot::{SlotControl, SlotId, SlotState};
use crate::sync::Mutex;
use std::any::Any;

mod config;
mod mapping;
mod shared;
#[cfg(all(test, not(loom)))]
pub(crate) mod tests;

use config::slot_count;
pub use config::{Backing, BackingChoice, PoolConfig, PoolRegion};
pub use mapping::hugetlb_free_pages;
pub(crate) use mapping::Mapping;
use mapping::{
    base_page_bytes, bind_to_node, check_backable, map_hugetlb, map_len, map_plain, map_thp, prefault, too_big,
};
pub use shared::{SharedPoolLayout, POOL_SEALS};

/// Bytes in one hugetlb / THP page (2 MiB).
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;

/// Largest pool capacity in slots (slot ids are `u32`; the free list stores `id + 1` in 32 bits).
pub const MAX_SLOTS: u32 = FreeList::MAX_CAPACITY;

/// The slab pool: `capacity` slots of `slot_bytes` bytes in one host mapping, a control word per
/// slot and a lock-free free list of slot ids. See the module docs for layout, backing and teardown.
pub struct HostPool {
    /// Declared first so that, even without the explicit drain in `Drop`, registrations drop before
    /// `map` (fields drop in declaration order).
    registrations: Mutex<Vec<Box<dyn Any + Send + Sync>>>,
    map: Mapping,
    slot_bytes: u64,
    capacity: u32,
    backing: Backing,
    numa_node: Option<u32>,
    locked: bool,
    control: SlotControl,
    free: FreeList,
    /// The memfd behind a pool in shared memory ([`HostPool::new_shared`], [`HostPool::attach_shared`]).
    memfd: Option<std::os::fd::OwnedFd>,
}

// SAFETY: HostPool owns its mapping (a raw pointer, hence not auto-Send); the memory is plain bytes
// not tied to a thread. Every other field (atomics, the Mutex of Send + Sync registrations) is Send.
unsafe impl Send for HostPool {}
// SAFETY: &HostPool methods touch shared state only through atomics (SlotControl, FreeList) or the
// registrations Mutex; slot bytes are handed out as raw pointers whose exclusive use is governed by
// slot ownership (free list + SlotControl state machine), not by &HostPool.
unsafe impl Sync for HostPool {}

impl HostPool {
    /// Maps a pool of `floor(config.bytes / slot_bytes)` slots of `slot_bytes` bytes each.
    ///
    /// # Errors
    /// - [`PoolError::BadSlotSize`]: `slot_bytes` is 0 or not a multiple of 16.
    /// - [`PoolError::TooSmall`]: `config.bytes < slot_bytes` (no slot fits).
    /// - [`PoolError::TooManySlots`]: more than [`MAX_SLOTS`] slots.
    /// - [`PoolError::NoSuchNumaNode`]: `config.numa_node` names a node without a
    ///   `/sys/devices/system/node/nodeN` directory.
    /// - [`PoolError::HugePagesUnavailable`]: [`BackingChoice::HugeTlb`] and fewer free 2 MiB pages
    ///   than `ceil(capacity * slot_bytes / 2 MiB)`.
    /// - [`PoolError::ExceedsMemory`]: the mapping is larger than memory can back (physical
    ///   memory; available memory when prefaulted or locked; `RLIMIT_MEMLOCK` when locked), unless
    ///   [`PoolConfig::overcommit`] (see there). Nothing was mapped.
    /// - [`PoolError::Map`]: `mmap` failed (or the length exceeds the address space).
    /// - [`PoolError::Syscall`]: `mbind` or `mlock` failed.
    pub fn new(slot_bytes: u64, config: &PoolConfig) -> Result<Self, PoolError> {
        let capacity = slot_count(slot_bytes, config)?;
        // <= config.bytes: cannot overflow.
        let data = capacity as u64 * slot_bytes;
        let (map, backing) = match config.backing {
            BackingChoice::HugeTlb => {
                check_backable(data, Backing::HugeTlb, config)?;
                match map_hugetlb(data, config.numa_node) {
                    Ok(m) => (m, Backing::HugeTlb),
                    Err((_, _, Some(e))) => return Err(e),
                    Err((needed, free, None)) => return Err(PoolError::HugePagesUnavailable { needed, free }),
                }
            }
            BackingChoice::Auto => match check_backable(data, Backing::HugeTlb, config)
                .ok()
                .and_then(|()| map_hugetlb(data, config.numa_node).ok())
            {
                Some(m) => (m, Backing::HugeTlb),
                None => {
                    check_backable(data, Backing::TransparentHuge, config)?;
                    map_thp(data)?
                }
            },
            BackingChoice::TransparentHuge => {
                check_backable(data, Backing::TransparentHuge, config)?;
                map_thp(data)?
            }
            BackingChoice::Plain => {
                check_backable(data, Backing::Plain, config)?;
                (map_plain(data)?, Backing::Plain)
            }
        };
        Self::assemble(map, backing, slot_bytes, capacity, config, None)
    }

    /// The common tail of every constructor: NUMA binding, prefault and `mlock` as `config` asks,
    /// then the slot words and the free list.
    fn assemble(
        map: Mapping,
        backing: Backing,
        slot_bytes: u64,
        capacity: u32,
        config: &PoolConfig,
        memfd: Option<std::os::fd::OwnedFd>,
    ) -> Result<Self, PoolError> {
        if let Some(node) = config.numa_node {
            bind_to_node(&map, node)?;
        }
        if config.prefault {
            let stride = if backing == Backing::HugeTlb { HUGE_PAGE_BYTES as usize } else { base_page_bytes() };
            prefault(&map, stride);
        }
        if config.mlock {
            // SAFETY: the range is exactly our own live mapping; mlock changes no contents.
            unsafe { nix::sys::mman::mlock(map.as_void(), map.len) }
                .map_err(|e| PoolError::Syscall { call: "mlock", source: e.into() })?;
        }
        Ok(HostPool {
            registrations: Mutex::new(Vec::new()),
            map,
            slot_bytes,
            capacity,
            backing,
            numa_node: config.numa_node,
            locked: config.mlock,
            control: SlotControl::new(capacity),
            free: FreeList::new(capacity),
            memfd,
        })
    }

    /// Slots in the pool (`floor(config.bytes / slot_bytes)`, `1..=`[`MAX_SLOTS`]).
    #[inline]
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Bytes per slot (the slot stride; a multiple of 16).
    #[inline]
    pub fn slot_bytes(&self) -> u64 {
        self.slot_bytes
    }

    /// Bytes mapped: `capacity * slot_bytes` rounded up to 2 MiB when hugetlb or THP was asked for
    /// (also when THP then turned out unavailable and [`HostPool::backing`] says `Plain`), else to
    /// the base page size (4 KiB).
    #[inline]
    pub fn mapped_bytes(&self) -> u64 {
        self.map.len as u64
    }

    /// Backing in use (for [`BackingChoice::Auto`], the first that worked).
    #[inline]
    pub fn backing(&self) -> Backing {
        self.backing
    }

    /// NUMA node the mapping is bound to (`None`: the kernel's default policy).
    #[inline]
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// True when the mapping is `mlock`ed.
    #[inline]
    pub fn is_locked(&self) -> bool {
        self.locked
    }

    /// The address range as a plain value (copy backends keep this, not the pool).
    pub fn region(&self) -> PoolRegion {
        PoolRegion {
            host_base: self.map.ptr.as_ptr() as usize,
            bytes: self.map.len as u64,
            slot_bytes: self.slot_bytes,
            capacity: self.capacity,
        }
    }

    /// Address of the first byte of `slot`; `slot_bytes` bytes from there belong to it.
    ///
    /// Panics if `slot.0 >= capacity()` (a slot id not from this pool is a broken invariant; see
    /// [`HostPool::try_slot_ptr`] for untrusted ids).
    #[inline]
    pub fn slot_ptr(&self, slot: SlotId) -> *mut u8 {
        match self.try_slot_ptr(slot) {
            Ok(p) => p,
            Err(_) => panic!("slot {} is out of range: the pool has {} slots", slot.0, self.capacity),
        }
    }

    /// Address of the first byte of `slot`.
    ///
    /// # Errors
    /// [`PoolError::SlotOutOfRange`] if `slot.0 >= capacity()`.
    #[inline]
    pub fn try_slot_ptr(&self, slot: SlotId) -> Result<*mut u8, PoolError> {
        if slot.0 >= self.capacity {
            return Err(PoolError::SlotOutOfRange { slot: slot.0, capacity: self.capacity });
        }
        let off = slot.0 as usize * self.slot_bytes as usize;
        // SAFETY: slot < capacity, so off + slot_bytes <= capacity * slot_bytes <= map.len: the
        // result lies inside our mapping.
        Ok(unsafe { self.map.ptr.as_ptr().add(off) })
    }

    /// The control words, one per slot (state, pins, generation; see `src/slot.rs`).
    #[inline]
    pub(crate) fn control(&self) -> &SlotControl {
        &self.control
    }

    /// Pops a free slot id (lock-free, no syscall), or `None` when none is free. The slot's word is
    /// left as it is (`FREE`); the caller takes ownership with `SlotControl::reserve`.
    #[inline]
    pub fn alloc(&self) -> Option<SlotId> {
        self.free.pop().map(SlotId)
    }

    /// Pushes an owned slot back on the free list (lock-free, no syscall). The caller has already
    /// moved its word to `FREE` (`SlotControl::release`); debug builds assert that, and that the
    /// slot is not freed twice.
    ///
    /// Panics if `slot.0 >= capacity()`.
    #[inline]
    pub fn free(&self, slot: SlotId) {
        assert!(slot.0 < self.capacity, "free of slot {}: the pool has {} slots", slot.0, self.capacity);
        debug_assert_eq!(
            self.control.load(slot).state(),
            SlotState::Free,
            "slot {} freed while its word is not FREE (release it first)",
            slot.0
        );
        self.free.push(slot.0);
    }

    /// Free slots: exact when no other thread allocates or frees, approximate otherwise.
    #[inline]
    pub fn free_count(&self) -> usize {
        self.free.len()
    }

    /// Runs `f` with the registration list locked: copy backends keep here whatever must live
    /// exactly as long as the mapping (the CUDA backend's `cuMemHostRegister` guard, whose drop
    /// unregisters). [`HostPool`]'s drop drops every entry, last pushed first, *before* it unmaps
    /// the memory, so no registration outlives the pages it pins. Never called on the hot path.
    pub fn with_registrations<R>(&self, f: impl FnOnce(&mut Vec<Box<dyn Any + Send + Sync>>) -> R) -> R {
        let mut regs = self.registrations.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut regs)
    }
}

impl Drop for HostPool {
    fn drop(&mut self) {
        // Unregister before munmap: drain (newest first) while the mapping is still alive; the
        // mapping itself is unmapped afterwards when the `map` field drops.
        let mut regs = self.registrations.lock().unwrap_or_else(|e| e.into_inner());
        while let Some(r) = regs.pop() {
            drop(r);
        }
    }
}

impl std::fmt::Debug for HostPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostPool")
            .field("region", &self.region())
            .field("backing", &self.backing)
            .field("numa_node", &self.numa_node)
            .field("locked", &self.locked)
            .field("free", &self.free_count())
            .finish()
    }
}
