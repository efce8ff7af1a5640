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
use nix::sys::mman::{MapFlags, MmapAdvise, ProtFlags};
use std::any::Any;
use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::path::Path;
use std::ptr::NonNull;

mod shared;
pub use shared::{SharedPoolLayout, POOL_SEALS};

/// Bytes in one hugetlb / THP page (2 MiB).
pub const HUGE_PAGE_BYTES: u64 = 2 << 20;

/// Largest pool capacity in slots (slot ids are `u32`; the free list stores `id + 1` in 32 bits).
pub const MAX_SLOTS: u32 = FreeList::MAX_CAPACITY;

/// Pools of at least this many mapped bytes are prefaulted on several threads.
const PARALLEL_PREFAULT_BYTES: usize = 64 << 20;

/// Most threads a prefault uses.
const MAX_PREFAULT_THREADS: usize = 8;

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
    /// very count [`HostPool::new`] maps. Maps nothing.
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

/// 2 MiB hugetlb pages free for a new mapping now: `free_hugepages - resv_hugepages` from
/// `/sys/kernel/mm/hugepages/hugepages-2048kB/`; with `node`, also at most that node's
/// `free_hugepages` under `/sys/devices/system/node/nodeN/hugepages/hugepages-2048kB/` (the
/// kernel keeps reservations only globally). 0 where the files are missing.
pub fn hugetlb_free_pages(node: Option<u32>) -> u64 {
    let read = |p: &str| -> u64 { std::fs::read_to_string(p).ok().and_then(|s| s.trim().parse().ok()).unwrap_or(0) };
    let dir = "/sys/kernel/mm/hugepages/hugepages-2048kB";
    let global = read(&format!("{dir}/free_hugepages")).saturating_sub(read(&format!("{dir}/resv_hugepages")));
    match node {
        None => global,
        Some(n) => {
            global.min(read(&format!("/sys/devices/system/node/node{n}/hugepages/hugepages-2048kB/free_hugepages")))
        }
    }
}

/// The base page size in bytes (`sysconf(_SC_PAGESIZE)`, 4 KiB on x86-64).
fn base_page_bytes() -> usize {
    // SAFETY: sysconf has no preconditions; it only reads a configuration value.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p > 0 {
        p as usize
    } else {
        4096
    }
}

/// One anonymous mapping, unmapped on drop. The crate's one way to map memory (the pool, and the
/// host backend's stand-in GPU arenas).
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Mapping is a plain owned address range; access to the bytes is synchronised by its users
// (slot ownership in the pool, the copy contract in the host backend).
unsafe impl Send for Mapping {}
// SAFETY: as above: `&Mapping` only hands out the address.
unsafe impl Sync for Mapping {}

impl Mapping {
    fn as_void(&self) -> NonNull<c_void> {
        self.ptr.cast()
    }

    /// A private anonymous read-write mapping of `len` bytes (rounded up by the kernel to whole
    /// pages), zero-filled on first touch: pages cost memory only once written.
    ///
    /// # Errors
    /// The OS error of `mmap` (`len == 0` is `EINVAL`).
    pub(crate) fn anonymous(len: usize) -> Result<Self, std::io::Error> {
        if len == 0 {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(Mapping { ptr: anon_map(len, MapFlags::empty())?, len })
    }

    /// The first byte.
    pub(crate) fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is exactly the range this Mapping mapped (and trimmed to) and owns;
        // HostPool drops every registration and outstanding use ends with the pool's lifetime, so
        // nothing refers to it any more.
        let r = unsafe { nix::sys::mman::munmap(self.as_void(), self.len) };
        debug_assert!(r.is_ok(), "munmap of the pool failed: {r:?}");
    }
}

fn round_up(x: u64, to: u64) -> Option<u64> {
    x.checked_add(to - 1).map(|v| v / to * to)
}

fn too_big(bytes: u64, backing: Backing) -> PoolError {
    PoolError::Map {
        bytes,
        backing: backing.name(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "length exceeds the address space"),
    }
}

/// Mapping length for `data` bytes on `backing` pages.
fn map_len(data: u64, backing: Backing) -> Result<usize, PoolError> {
    let page = match backing {
        Backing::HugeTlb | Backing::TransparentHuge => HUGE_PAGE_BYTES,
        Backing::Plain => base_page_bytes() as u64,
    };
    round_up(data, page).and_then(|l| usize::try_from(l).ok()).ok_or_else(|| too_big(data, backing))
}

fn anon_map(len: usize, flags: MapFlags) -> Result<NonNull<u8>, std::io::Error> {
    let len = NonZeroUsize::new(len).expect("pool mapping length is positive (capacity >= 1)");
    // SAFETY: a fresh anonymous private mapping at an address the kernel picks: it aliases no Rust
    // object. The caller owns the returned range and unmaps it (Mapping::drop).
    let p = unsafe {
        nix::sys::mman::mmap_anonymous(
            None,
            len,
            ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
            MapFlags::MAP_PRIVATE | flags,
        )
    };
    p.map(|p| p.cast()).map_err(std::io::Error::from)
}

/// Explicit hugetlb pages. `Err(None)`: not enough reserved (or the kernel said ENOMEM);
/// `Err(Some(e))`: another failure.
fn map_hugetlb(data: u64, node: Option<u32>) -> Result<Mapping, (u64, u64, Option<PoolError>)> {
    let len = map_len(data, Backing::HugeTlb).map_err(|e| (0, 0, Some(e)))?;
    let needed = len as u64 / HUGE_PAGE_BYTES;
    let free = hugetlb_free_pages(node);
    if free < needed {
        return Err((needed, free, None));
    }
    // Never MAP_NORESERVE: the reservation taken here is what makes every later fault succeed.
    match anon_map(len, MapFlags::MAP_HUGETLB | MapFlags::MAP_HUGE_2MB) {
        Ok(ptr) => Ok(Mapping { ptr, len }),
        Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => Err((needed, hugetlb_free_pages(node), None)),
        Err(e) => Err((needed, free, Some(PoolError::Map { bytes: len as u64, backing: "hugetlb", source: e }))),
    }
}

/// A 2 MiB-aligned anonymous mapping (over-map by 2 MiB, trim both ends) advised `MADV_HUGEPAGE`.
/// Reports [`Backing::Plain`] when THP is disabled or the advice is refused.
fn map_thp(data: u64) -> Result<(Mapping, Backing), PoolError> {
    let len = map_len(data, Backing::TransparentHuge)?;
    let huge = HUGE_PAGE_BYTES as usize;
    let total = len.checked_add(huge).ok_or_else(|| too_big(data, Backing::TransparentHuge))?;
    let raw = anon_map(total, MapFlags::empty()).map_err(|e| PoolError::Map {
        bytes: total as u64,
        backing: "thp",
        source: e,
    })?;
    let start = raw.as_ptr() as usize;
    let aligned = start.next_multiple_of(huge);
    let head = aligned - start;
    let tail = total - head - len;
    // Trim: the pieces before `aligned` and after `aligned + len` lie inside the mapping just made
    // (head + len + tail = total), nothing refers to them, and both are page-aligned (mmap returns
    // page-aligned addresses; head, len and tail are multiples of the base page size).
    if head > 0 {
        // SAFETY: see the trim comment above; `raw..raw+head` is our own, unused.
        let _ = unsafe { nix::sys::mman::munmap(raw.cast(), head) };
    }
    if tail > 0 {
        let tail_start = NonNull::new((aligned + len) as *mut c_void).expect("inside a mapping, non-null");
        // SAFETY: see the trim comment above; `aligned+len..raw+total` is our own, unused.
        let _ = unsafe { nix::sys::mman::munmap(tail_start, tail) };
    }
    // SAFETY: aligned is inside a successful mapping, hence non-null.
    let map = Mapping { ptr: unsafe { NonNull::new_unchecked(aligned as *mut u8) }, len };
    let thp_on = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled")
        .map(|s| !s.contains("[never]"))
        .unwrap_or(false);
    // SAFETY: the range is exactly our own mapping; MADV_HUGEPAGE changes no contents.
    let advised = unsafe { nix::sys::mman::madvise(map.as_void(), len, MmapAdvise::MADV_HUGEPAGE) }.is_ok();
    let backing = if thp_on && advised { Backing::TransparentHuge } else { Backing::Plain };
    Ok((map, backing))
}

fn map_plain(data: u64) -> Result<Mapping, PoolError> {
    let len = map_len(data, Backing::Plain)?;
    let ptr = anon_map(len, MapFlags::empty()).map_err(|e| PoolError::Map {
        bytes: len as u64,
        backing: "plain",
        source: e,
    })?;
    Ok(Mapping { ptr, len })
}

/// `mbind(MPOL_BIND, {node})` over the whole mapping (neither nix nor libc wraps mbind).
fn bind_to_node(map: &Mapping, node: u32) -> Result<(), PoolError> {
    let bits = libc::c_ulong::BITS as usize;
    let mut mask = vec![0 as libc::c_ulong; node as usize / bits + 1];
    mask[node as usize / bits] |= 1 << (node as usize % bits);
    // The kernel reads maxnode - 1 bits.
    let maxnode = (mask.len() * bits + 1) as libc::c_ulong;
    // SAFETY: the range is our own page-aligned mapping; `mask` is a live buffer of
    // `(maxnode - 1) / 64` words that the kernel only reads; flags 0 moves no existing pages.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mbind,
            map.ptr.as_ptr() as *mut c_void,
            map.len as libc::c_ulong,
            libc::MPOL_BIND as libc::c_ulong,
            mask.as_ptr(),
            maxnode,
            0 as libc::c_uint,
        )
    };
    if rc != 0 {
        return Err(PoolError::Syscall { call: "mbind", source: std::io::Error::last_os_error() });
    }
    Ok(())
}

/// Writes one byte per `stride` bytes of the mapping (on several threads for large mappings), so
/// every backing page is allocated now rather than on the first copy.
fn prefault(map: &Mapping, stride: usize) {
    let pages = map.len / stride;
    let threads = if map.len >= PARALLEL_PREFAULT_BYTES {
        std::thread::available_parallelism().map_or(1, |p| p.get()).clamp(1, MAX_PREFAULT_THREADS)
    } else {
        1
    };
    let base = map.ptr.as_ptr() as usize;
    let touch = move |from: usize, to: usize| {
        for p in from..to {
            // SAFETY: page p < pages lies inside the live, writable mapping (len = pages * stride);
            // no Rust reference to the pool's bytes exists yet (the pool is under construction).
            unsafe { std::ptr::write_volatile((base + p * stride) as *mut u8, 0) };
        }
    };
    if threads == 1 {
        touch(0, pages);
        return;
    }
    std::thread::scope(|s| {
        for t in 0..threads {
            let (from, to) = (pages * t / threads, pages * (t + 1) / threads);
            s.spawn(move || touch(from, to));
        }
    });
}

/// A field of `/proc/meminfo` in bytes (`None` where the file or the field is missing).
fn meminfo_bytes(field: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    s.lines().find_map(|l| {
        let kib = l.strip_prefix(field)?.strip_prefix(':')?.split_whitespace().next()?.parse::<u64>().ok()?;
        Some(kib.saturating_mul(1024))
    })
}

/// The soft `RLIMIT_MEMLOCK` in bytes, `None` when unlimited or when the process has
/// `CAP_IPC_LOCK` (the kernel then ignores the limit).
fn memlock_limit() -> Option<u64> {
    const CAP_IPC_LOCK: u32 = 14;
    let caps = std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| u64::from_str_radix(l.strip_prefix("CapEff:")?.trim(), 16).ok()));
    if caps.is_some_and(|c| c & (1 << CAP_IPC_LOCK) != 0) {
        return None;
    }
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `r`, which lives for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 || r.rlim_cur == libc::RLIM_INFINITY {
        return None;
    }
    Some(r.rlim_cur)
}

/// Refuses, before anything is mapped, a pool of `data` slot bytes on `backing` pages that memory
/// cannot back (see [`PoolConfig::overcommit`]). The hugetlb reservation itself is checked where
/// the hugetlb mapping is made.
fn check_backable(data: u64, backing: Backing, config: &PoolConfig) -> Result<(), PoolError> {
    let bytes = map_len(data, backing)? as u64;
    if config.mlock && !crate::seeded::seeded("pool-unchecked-memory") {
        if let Some(limit) = memlock_limit() {
            if bytes > limit {
                return Err(PoolError::ExceedsMemory {
                    bytes,
                    available: limit,
                    what: "RLIMIT_MEMLOCK (the pool is locked)",
                });
            }
        }
    }
    if backing == Backing::HugeTlb || config.overcommit {
        return Ok(());
    }
    if let Some(total) = meminfo_bytes("MemTotal").filter(|_| !crate::seeded::seeded("pool-unchecked-memory")) {
        let total = total.saturating_sub(meminfo_bytes("Hugetlb").unwrap_or(0));
        if bytes > total {
            return Err(PoolError::ExceedsMemory {
                bytes,
                available: total,
                what: "physical memory (MemTotal less the hugetlb pool)",
            });
        }
    }
    if config.prefault || config.mlock {
        if let Some(avail) = meminfo_bytes("MemAvailable") {
            if bytes > avail {
                return Err(PoolError::ExceedsMemory {
                    bytes,
                    available: avail,
                    what: "available memory (MemAvailable), which a prefaulted or locked pool takes at start",
                });
            }
            check_headroom(bytes, avail, meminfo_bytes("MemTotal"))?;
        }
    }
    Ok(())
}

/// The least `MemAvailable` a prefaulted or locked pool must leave: max(1 GiB, 5% of `MemTotal`
/// (`total`; 1 GiB when unknown)). Such a pool takes its memory at start; what is left is all the
/// engines, the kernel's caches and the daemon itself have before the OOM killer steps in.
pub(crate) fn headroom(total: Option<u64>) -> u64 {
    (total.unwrap_or(0) / 20).max(1 << 30)
}

/// Refuses ([`PoolError::NoHeadroom`]) a prefaulted or locked pool of `bytes` that would leave less
/// than [`headroom`] of `available` (`MemAvailable`) on a machine of `total` (`MemTotal`).
fn check_headroom(bytes: u64, available: u64, total: Option<u64>) -> Result<(), PoolError> {
    let headroom = headroom(total);
    if available.saturating_sub(bytes) < headroom {
        return Err(PoolError::NoHeadroom { bytes, available, headroom });
    }
    Ok(())
}

/// The pool's capacity in slots for `config`, after the checks every constructor makes (slot size,
/// at least one slot, at most [`MAX_SLOTS`], an existing NUMA node).
fn slot_count(slot_bytes: u64, config: &PoolConfig) -> Result<u32, PoolError> {
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

#[cfg(all(test, not(loom)))]
pub(crate) mod tests {
    use super::*;
    use crate::sync::{AtomicU32, Ordering};
    use std::collections::HashSet;
    use std::sync::Arc;

    const MIB: u64 = 1 << 20;
    const GLM_SLOT: u64 = 3_452_160;

    /// Serializes the tests that read or change the hugetlb reservation.
    pub(crate) static HUGETLB: std::sync::Mutex<()> = std::sync::Mutex::new(());

    fn plain(bytes: u64) -> PoolConfig {
        PoolConfig { bytes, backing: BackingChoice::Plain, ..Default::default() }
    }

    #[test]
    fn a_prefaulted_pool_leaves_max_of_1_gib_and_5_percent_of_memtotal_available() {
        const GIB: u64 = 1 << 30;
        assert_eq!(headroom(None), GIB, "MemTotal unknown: 1 GiB");
        assert_eq!(headroom(Some(16 * GIB)), GIB, "5% of 16 GiB is under 1 GiB");
        assert_eq!(headroom(Some(200 * GIB)), 10 * GIB, "5% of 200 GiB");
        // The report: --pool 22GiB --prefault with 22.1 GiB available on a 24 GiB machine.
        let avail = 22 * GIB + GIB / 10;
        let e = check_headroom(22 * GIB, avail, Some(24 * GIB)).unwrap_err();
        assert!(
            matches!(e, PoolError::NoHeadroom { bytes, available, headroom } if (bytes, available, headroom) == (22 * GIB, avail, 24 * GIB / 20)),
            "{e:?}"
        );
        let msg = e.to_string();
        for want in ["22.00 GiB", "would leave 0.10 GiB of the 22.10 GiB", "1.20 GiB headroom", "at most 20.90 GiB"] {
            assert!(msg.contains(want), "`{msg}` lacks `{want}`");
        }
        // Exactly the headroom left passes; a byte more does not.
        assert!(check_headroom(21 * GIB + GIB / 10, avail, Some(16 * GIB)).is_ok());
        assert!(check_headroom(21 * GIB + GIB / 10 + 1, avail, Some(16 * GIB)).is_err());
        // A pool larger than what is available leaves nothing (no underflow).
        assert!(check_headroom(30 * GIB, avail, Some(200 * GIB)).is_err());
        assert!(check_headroom(180 * GIB, 200 * GIB, Some(200 * GIB)).is_ok(), "10 GiB left of 200: enough");
        assert!(check_headroom(191 * GIB, 200 * GIB, Some(200 * GIB)).is_err(), "9 GiB left of 200: not");
    }

    fn meminfo(field: &str) -> u64 {
        let s = std::fs::read_to_string("/proc/meminfo").unwrap();
        s.lines()
            .find_map(|l| {
                l.strip_prefix(field)?.strip_prefix(':').map(|v| v.trim().split(' ').next().unwrap().parse().unwrap())
            })
            .unwrap()
    }

    /// Sets `nr_hugepages` to `n` (root only) and restores the old value when dropped.
    pub(crate) struct Reserve {
        old: u64,
    }
    const NR: &str = "/proc/sys/vm/nr_hugepages";
    impl Reserve {
        pub(crate) fn set(n: u64) -> Option<Reserve> {
            let old: u64 = std::fs::read_to_string(NR).ok()?.trim().parse().ok()?;
            // SAFETY: geteuid has no preconditions.
            if unsafe { libc::geteuid() } != 0 {
                eprintln!("skipping: changing {NR} needs root");
                return None;
            }
            if let Err(e) = std::fs::write(NR, n.to_string()) {
                eprintln!("skipping: writing {NR}: {e}");
                return None;
            }
            Some(Reserve { old })
        }
    }
    impl Drop for Reserve {
        fn drop(&mut self) {
            let _ = std::fs::write(NR, self.old.to_string());
        }
    }

    #[test]
    fn capacity_rounds_down() {
        let p = HostPool::new(GLM_SLOT, &plain(10 * MIB)).unwrap();
        assert_eq!(p.capacity(), 3);
        assert_eq!(p.slot_bytes(), GLM_SLOT);
        assert!(p.mapped_bytes() >= 3 * GLM_SLOT);
        assert_eq!(p.mapped_bytes(), (3 * GLM_SLOT).next_multiple_of(4096));
        let r = p.region();
        assert_eq!(
            r,
            PoolRegion { host_base: r.host_base, bytes: p.mapped_bytes(), slot_bytes: GLM_SLOT, capacity: 3 }
        );
        assert!(r.capacity as u64 * r.slot_bytes <= r.bytes);
        assert_eq!(p.slot_ptr(SlotId(2)) as usize, r.host_base + 2 * GLM_SLOT as usize);
        // PoolConfig::slots is the count the pool maps (without mapping): 32 GiB of GLM-5.2 slots
        // is 9,953 (floor(34,359,738,368 / 3,452,160) = 9,953.2).
        assert_eq!(plain(10 * MIB).slots(GLM_SLOT).unwrap(), p.capacity());
        assert_eq!(PoolConfig::new(32 << 30).slots(GLM_SLOT).unwrap(), 9953);
        assert!(matches!(PoolConfig::new(GLM_SLOT - 1).slots(GLM_SLOT), Err(PoolError::TooSmall { .. })));
        // Exactly one slot.
        let one = HostPool::new(GLM_SLOT, &plain(GLM_SLOT)).unwrap();
        assert_eq!((one.capacity(), one.free_count()), (1, 1));
    }

    #[test]
    fn thp_mapping_is_aligned_and_rounded() {
        let cfg = PoolConfig { bytes: 10 * MIB, backing: BackingChoice::TransparentHuge, ..Default::default() };
        let p = HostPool::new(GLM_SLOT, &cfg).unwrap();
        assert_eq!(p.capacity(), 3);
        assert_eq!(p.mapped_bytes(), 5 * HUGE_PAGE_BYTES, "3 x 3,452,160 B = 10,356,480 B -> 5 x 2 MiB");
        assert_eq!(p.region().host_base % HUGE_PAGE_BYTES as usize, 0);
        assert!(matches!(p.backing(), Backing::TransparentHuge | Backing::Plain));
    }

    #[test]
    fn bad_sizes_are_typed_errors() {
        assert!(matches!(
            HostPool::new(GLM_SLOT, &plain(GLM_SLOT - 1)),
            Err(PoolError::TooSmall { bytes, slot_bytes: GLM_SLOT }) if bytes == GLM_SLOT - 1
        ));
        assert!(matches!(HostPool::new(256, &plain(0)), Err(PoolError::TooSmall { bytes: 0, slot_bytes: 256 })));
        assert!(matches!(HostPool::new(0, &plain(MIB)), Err(PoolError::BadSlotSize { slot_bytes: 0 })));
        assert!(matches!(HostPool::new(24, &plain(MIB)), Err(PoolError::BadSlotSize { slot_bytes: 24 })));
        let slots = (1u64 << 36) / 16;
        assert!(matches!(
            HostPool::new(16, &plain(1 << 36)),
            Err(PoolError::TooManySlots { slots: s, max }) if s == slots && max == u32::MAX as u64
        ));
        let cfg = PoolConfig { numa_node: Some(4095), ..plain(MIB) };
        assert!(matches!(HostPool::new(256, &cfg), Err(PoolError::NoSuchNumaNode { node: 4095 })));
    }

    /// A pool larger than physical memory is refused before anything is mapped, on every
    /// constructor and every backing; with `overcommit` (no prefault: nothing is touched) it maps.
    #[test]
    fn a_pool_larger_than_memory_is_refused_unless_overcommitted() {
        let total = meminfo("MemTotal") * 1024;
        let bytes = 2 * total;
        for backing in [BackingChoice::Auto, BackingChoice::TransparentHuge, BackingChoice::Plain] {
            let cfg = PoolConfig::new(bytes).with_backing(backing);
            for (shared, r) in [(false, HostPool::new(MIB, &cfg)), (true, HostPool::new_shared(MIB, &cfg))] {
                match r {
                    Err(PoolError::ExceedsMemory { bytes: b, available, what }) => {
                        assert!(b >= bytes / MIB * MIB && available <= total, "{b} B against {available} B of {what}");
                        assert!(what.contains("MemTotal"), "{what}");
                    }
                    r => panic!(
                        "a pool of twice MemTotal ({backing:?}, shared {shared}) must be refused with \
                         ExceedsMemory before it is mapped, got {r:?}"
                    ),
                }
            }
        }
        let e = HostPool::new_shared(MIB, &PoolConfig::new(bytes).with_backing(BackingChoice::Plain)).unwrap_err();
        assert!(e.to_string().contains("--overcommit"), "the message names the way out: {e}");
        let over = PoolConfig::new(bytes).with_backing(BackingChoice::Plain).with_overcommit(true);
        let p = HostPool::new_shared(MIB, &over).expect("an overcommitted shared pool maps (nothing touched)");
        assert_eq!(p.capacity() as u64, bytes / MIB);
        assert!(p.mapped_bytes() >= bytes / MIB * MIB);
    }

    /// A locked pool over `RLIMIT_MEMLOCK` is refused before it is mapped, overcommit or not
    /// (without the check, `mlock` would fail only after the mapping, having locked part of it).
    #[test]
    fn a_locked_pool_over_rlimit_memlock_is_refused() {
        let Some(limit) = memlock_limit().filter(|&l| l <= 4 << 30) else {
            eprintln!("skipping: RLIMIT_MEMLOCK is unlimited, above 4 GiB, or the process has CAP_IPC_LOCK");
            return;
        };
        let bytes = limit + 4 * MIB;
        for over in [false, true] {
            let cfg = plain(bytes).with_mlock(true).with_overcommit(over);
            match HostPool::new(MIB, &cfg) {
                Err(PoolError::ExceedsMemory { available, what, .. }) => {
                    assert_eq!(available, limit);
                    assert!(what.contains("RLIMIT_MEMLOCK"), "{what}");
                }
                r => panic!("a locked pool over RLIMIT_MEMLOCK (overcommit {over}) must be refused first, got {r:?}"),
            }
        }
    }

    /// A prefaulted pool must fit in available memory: it takes all of it at start.
    #[test]
    fn a_prefaulted_pool_larger_than_available_memory_is_refused() {
        let avail = meminfo("MemAvailable") * 1024;
        let total = meminfo("MemTotal") * 1024;
        if total - avail < 2 << 30 {
            eprintln!("skipping: less than 2 GiB between MemAvailable and MemTotal");
            return;
        }
        let bytes = avail + (total - avail) / 2;
        let cfg = PoolConfig::new(bytes).with_backing(BackingChoice::Plain).with_prefault(true);
        match HostPool::new_shared(MIB, &cfg) {
            Err(PoolError::ExceedsMemory { what, .. }) => assert!(what.contains("MemAvailable"), "{what}"),
            r => panic!("a prefaulted pool above MemAvailable must be refused, got {r:?}"),
        }
    }

    #[test]
    fn slot_ptr_range() {
        let p = HostPool::new(4096, &plain(5 * 4096)).unwrap();
        assert!(matches!(p.try_slot_ptr(SlotId(5)), Err(PoolError::SlotOutOfRange { slot: 5, capacity: 5 })));
        assert_eq!(p.try_slot_ptr(SlotId(4)).unwrap(), p.slot_ptr(SlotId(4)));
        let r = std::panic::catch_unwind(|| p.slot_ptr(SlotId(7)));
        let msg = *r.unwrap_err().downcast::<String>().unwrap();
        assert_eq!(msg, "slot 7 is out of range: the pool has 5 slots");
    }

    #[test]
    fn every_slot_once_then_none_then_reuse() {
        let p = HostPool::new(256, &plain(100 * 256 + 255)).unwrap();
        assert_eq!((p.capacity(), p.free_count()), (100, 100));
        let got: HashSet<u32> = (0..100).map(|_| p.alloc().unwrap().0).collect();
        assert_eq!(got, (0..100).collect());
        assert_eq!(p.alloc(), None);
        assert_eq!(p.free_count(), 0);
        p.free(SlotId(42));
        assert_eq!(p.free_count(), 1);
        assert_eq!(p.alloc(), Some(SlotId(42)));
        assert_eq!(p.alloc(), None);
        for s in 0..100 {
            p.free(SlotId(s));
        }
        assert_eq!(p.free_count(), 100);
    }

    #[test]
    fn alloc_does_not_touch_slot_words() {
        let p = HostPool::new(256, &plain(4 * 256)).unwrap();
        let s = p.alloc().unwrap();
        assert_eq!(p.control().load(s).state(), SlotState::Free);
        let g = p.control().reserve(s);
        p.control().release(s);
        p.free(s);
        assert_eq!(p.control().load(s).generation(), g + 1);
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "is not FREE")]
    fn free_of_reserved_slot_panics_in_debug() {
        let p = HostPool::new(256, &plain(4 * 256)).unwrap();
        let s = p.alloc().unwrap();
        p.control().reserve(s);
        p.free(s);
    }

    /// Bytes written to one slot never appear in another: fill every slot with its own pattern,
    /// then check every byte of every slot.
    #[test]
    fn slots_do_not_overlap() {
        let slot = 4096 + 256; // not a multiple of the page size
        let p = HostPool::new(slot, &PoolConfig { bytes: 37 * slot + 100, prefault: true, ..plain(0) }).unwrap();
        let n = p.capacity();
        assert_eq!(n, 37);
        for s in 0..n {
            // SAFETY: slot s lies inside the mapping (slot_ptr checked); no other reference exists.
            let b = unsafe { std::slice::from_raw_parts_mut(p.slot_ptr(SlotId(s)), slot as usize) };
            for (i, x) in b.iter_mut().enumerate() {
                *x = (s as u8).wrapping_mul(31) ^ (i as u8);
            }
        }
        for s in 0..n {
            // SAFETY: as above, shared read.
            let b = unsafe { std::slice::from_raw_parts(p.slot_ptr(SlotId(s)), slot as usize) };
            assert!(b.iter().enumerate().all(|(i, &x)| x == (s as u8).wrapping_mul(31) ^ (i as u8)), "slot {s}");
        }
    }

    /// 4 threads allocate and free; a per-slot owner word proves no slot has two owners at once.
    #[test]
    fn concurrent_alloc_free_single_owner() {
        let p = HostPool::new(256, &plain(64 * 256)).unwrap();
        let owner: Vec<AtomicU32> = (0..64).map(|_| AtomicU32::new(0)).collect();
        std::thread::scope(|s| {
            for t in 1..=4u32 {
                let (p, owner) = (&p, &owner);
                s.spawn(move || {
                    let mut held = Vec::new();
                    for round in 0..20_000u32 {
                        if held.len() < 20 && (round + t) % 4 != 0 {
                            if let Some(slot) = p.alloc() {
                                let prev = owner[slot.index()].swap(t, Ordering::AcqRel);
                                assert_eq!(prev, 0, "slot {} owned by {prev} and {t}", slot.0);
                                // SAFETY: the free list gave this thread the slot exclusively.
                                unsafe { p.slot_ptr(slot).write_volatile(t as u8) };
                                held.push(slot);
                            }
                        } else if let Some(slot) = held.pop() {
                            // SAFETY: still owned by this thread.
                            assert_eq!(unsafe { p.slot_ptr(slot).read_volatile() }, t as u8);
                            assert_eq!(owner[slot.index()].swap(0, Ordering::AcqRel), t);
                            p.free(slot);
                        }
                    }
                    for slot in held {
                        owner[slot.index()].store(0, Ordering::Release);
                        p.free(slot);
                    }
                });
            }
        });
        assert_eq!(p.free_count(), 64);
        let all: HashSet<u32> = std::iter::from_fn(|| p.alloc().map(|s| s.0)).collect();
        assert_eq!(all.len(), 64);
    }

    /// A registration's drop runs while the memory is still mapped (it reads a slot).
    #[test]
    fn registrations_drop_before_unmap() {
        struct Guard {
            addr: usize,
            order: Arc<std::sync::Mutex<Vec<(u32, u8)>>>,
            id: u32,
        }
        impl Drop for Guard {
            fn drop(&mut self) {
                // SAFETY: the pool drops registrations before unmapping, so addr is still mapped.
                let b = unsafe { (self.addr as *const u8).read_volatile() };
                self.order.lock().unwrap().push((self.id, b));
            }
        }
        let order = Arc::new(std::sync::Mutex::new(Vec::new()));
        let p = HostPool::new(4096, &plain(2 * 4096)).unwrap();
        // SAFETY: slot 1 is inside the mapping; nothing else uses it.
        unsafe { p.slot_ptr(SlotId(1)).write(0xAB) };
        let addr = p.slot_ptr(SlotId(1)) as usize;
        for id in [1, 2] {
            let n = p.with_registrations(|r| {
                r.push(Box::new(Guard { addr, order: order.clone(), id }));
                r.len()
            });
            assert_eq!(n, id as usize);
        }
        drop(p);
        assert_eq!(*order.lock().unwrap(), [(2, 0xAB), (1, 0xAB)]);
    }

    #[test]
    fn mlock_and_prefault() {
        let cfg = PoolConfig { mlock: true, prefault: true, ..plain(8 * MIB) };
        match HostPool::new(MIB, &cfg) {
            Ok(p) => assert!(p.is_locked() && p.capacity() == 8),
            Err(PoolError::Syscall { call: "mlock", source }) => eprintln!("mlock refused here: {source}"),
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn numa_node_zero_binds() {
        if !Path::new("/sys/devices/system/node/node0").is_dir() {
            eprintln!("skipping: no /sys/devices/system/node/node0");
            return;
        }
        let cfg = PoolConfig { numa_node: Some(0), prefault: true, ..plain(4 * MIB) };
        let p = HostPool::new(MIB, &cfg).unwrap();
        assert_eq!((p.numa_node(), p.capacity()), (Some(0), 4));
    }

    /// With 2 MiB pages reserved (root), Auto and HugeTlb use them and the free count drops by the
    /// pool's page count once prefaulted.
    #[test]
    fn hugetlb_when_reserved() {
        let _g = HUGETLB.lock().unwrap_or_else(|e| e.into_inner());
        // 3 GLM slots = 10,356,480 B -> 5 hugepages; reserve 8.
        let Some(_r) = Reserve::set(8) else { return };
        let free0 = hugetlb_free_pages(None);
        if free0 < 5 {
            eprintln!("skipping: only {free0} hugepages could be reserved");
            return;
        }
        assert_eq!(meminfo("HugePages_Free"), free0);
        for choice in [BackingChoice::Auto, BackingChoice::HugeTlb] {
            let cfg = PoolConfig { bytes: 10 * MIB, backing: choice, prefault: true, ..Default::default() };
            let p = HostPool::new(GLM_SLOT, &cfg).unwrap();
            assert_eq!(p.backing(), Backing::HugeTlb);
            assert_eq!((p.capacity(), p.mapped_bytes()), (3, 5 * HUGE_PAGE_BYTES));
            assert_eq!(p.region().host_base % HUGE_PAGE_BYTES as usize, 0);
            assert_eq!(meminfo("HugePages_Free"), free0 - 5);
            // Slots are usable end to end.
            // SAFETY: the last byte of the last slot is inside the mapping.
            unsafe { p.slot_ptr(SlotId(2)).add(GLM_SLOT as usize - 1).write(7) };
            drop(p);
            assert_eq!(meminfo("HugePages_Free"), free0);
        }
        // Not enough for an 8-page pool: Auto falls back, HugeTlb names the shortfall.
        let big = PoolConfig { bytes: 9 * HUGE_PAGE_BYTES, ..Default::default() };
        let p = HostPool::new(HUGE_PAGE_BYTES, &big).unwrap();
        assert_ne!(p.backing(), Backing::HugeTlb);
        let err = HostPool::new(HUGE_PAGE_BYTES, &PoolConfig { backing: BackingChoice::HugeTlb, ..big }).unwrap_err();
        assert!(matches!(err, PoolError::HugePagesUnavailable { needed: 9, free } if free == free0), "{err}");
    }

    /// With no pages reserved: Auto falls back to THP or plain pages, explicit HugeTlb is a typed error
    /// naming the pages needed.
    #[test]
    fn hugetlb_fallback_when_none_reserved() {
        let _g = HUGETLB.lock().unwrap_or_else(|e| e.into_inner());
        let _r = Reserve::set(0);
        let free = hugetlb_free_pages(None);
        if free != 0 {
            eprintln!("skipping: {free} hugepages are free and cannot be released (not root?)");
            return;
        }
        let auto = PoolConfig { bytes: 10 * MIB, ..Default::default() };
        let p = HostPool::new(GLM_SLOT, &auto).unwrap();
        assert!(matches!(p.backing(), Backing::TransparentHuge | Backing::Plain), "{:?}", p.backing());
        assert_eq!(p.mapped_bytes(), 5 * HUGE_PAGE_BYTES);
        let err = HostPool::new(GLM_SLOT, &PoolConfig { backing: BackingChoice::HugeTlb, ..auto }).unwrap_err();
        assert!(matches!(err, PoolError::HugePagesUnavailable { needed: 5, free: 0 }), "{err}");
    }
}
