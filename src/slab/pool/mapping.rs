//! The pool's memory: [`Mapping`] (one anonymous mapping, unmapped on drop), the hugetlb, THP and
//! plain-page mappings, NUMA binding, prefault, and the checks that memory can back a pool before
//! anything is mapped (physical and available memory, the headroom, `RLIMIT_MEMLOCK`).

use super::config::{Backing, PoolConfig};
use super::HUGE_PAGE_BYTES;
use crate::error::PoolError;
use nix::sys::mman::{MapFlags, MmapAdvise, ProtFlags};
use std::ffi::c_void;
use std::num::NonZeroUsize;
use std::ptr::NonNull;

/// Pools of at least this many mapped bytes are prefaulted on several threads.
const PARALLEL_PREFAULT_BYTES: usize = 64 << 20;

/// Most threads a prefault uses.
const MAX_PREFAULT_THREADS: usize = 8;

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
pub(super) fn base_page_bytes() -> usize {
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
    pub(super) ptr: NonNull<u8>,
    pub(super) len: usize,
}

// SAFETY: a Mapping is a plain owned address range; access to the bytes is synchronised by its users
// (slot ownership in the pool, the copy contract in the host backend).
unsafe impl Send for Mapping {}
// SAFETY: as above: `&Mapping` only hands out the address.
unsafe impl Sync for Mapping {}

impl Mapping {
    pub(super) fn as_void(&self) -> NonNull<c_void> {
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

pub(super) fn too_big(bytes: u64, backing: Backing) -> PoolError {
    PoolError::Map {
        bytes,
        backing: backing.name(),
        source: std::io::Error::new(std::io::ErrorKind::InvalidInput, "length exceeds the address space"),
    }
}

/// Mapping length for `data` bytes on `backing` pages.
pub(super) fn map_len(data: u64, backing: Backing) -> Result<usize, PoolError> {
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
pub(super) fn map_hugetlb(data: u64, node: Option<u32>) -> Result<Mapping, (u64, u64, Option<PoolError>)> {
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
pub(super) fn map_thp(data: u64) -> Result<(Mapping, Backing), PoolError> {
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

pub(super) fn map_plain(data: u64) -> Result<Mapping, PoolError> {
    let len = map_len(data, Backing::Plain)?;
    let ptr = anon_map(len, MapFlags::empty()).map_err(|e| PoolError::Map {
        bytes: len as u64,
        backing: "plain",
        source: e,
    })?;
    Ok(Mapping { ptr, len })
}

/// `mbind(MPOL_BIND, {node})` over the whole mapping (neither nix nor libc wraps mbind).
pub(super) fn bind_to_node(map: &Mapping, node: u32) -> Result<(), PoolError> {
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
pub(super) fn prefault(map: &Mapping, stride: usize) {
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
pub(super) fn memlock_limit() -> Option<u64> {
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
pub(super) fn check_backable(data: u64, backing: Backing, config: &PoolConfig) -> Result<(), PoolError> {
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
pub(super) fn check_headroom(bytes: u64, available: u64, total: Option<u64>) -> Result<(), PoolError> {
    let headroom = headroom(total);
    if available.saturating_sub(bytes) < headroom {
        return Err(PoolError::NoHeadroom { bytes, available, headroom });
    }
    Ok(())
}
