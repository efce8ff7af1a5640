//! Pools in shared memory: the slots live in a memfd that several processes map (`MAP_SHARED`).
//!
//! The tier daemon (`kvtierd`) makes the pool with [`HostPool::new_shared`] and hands the memfd to
//! every engine process it serves, which maps it with [`HostPool::attach_shared`]; a slot then has
//! the same bytes in every process, at a different address in each. Only the daemon's pool runs the
//! state machine (slot words, free list); an attached pool's words and free list are never used.
//!
//! Backing: a memfd made with `MFD_HUGETLB | MFD_HUGE_2MB` when enough 2 MiB pages are free
//! (`free_hugepages - resv_hugepages`, the pages are reserved when the daemon maps it, never
//! `MAP_NORESERVE`), otherwise an ordinary memfd (shmem): 4 KiB pages, or transparent hugepages
//! where the kernel's shmem THP setting (`/sys/kernel/mm/transparent_hugepage/shmem_enabled`)
//! allows them and the advice is taken. [`HostPool::backing`] reports which.

use super::{
    hugetlb_free_pages, map_len, slot_count, too_big, Backing, BackingChoice, HostPool, Mapping, PoolConfig,
    HUGE_PAGE_BYTES,
};
use crate::error::PoolError;
use nix::sys::mman::{MapFlags, MmapAdvise, ProtFlags};
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// What a process needs besides the memfd to map a shared pool another process made (sent with the
/// fd by the tier daemon).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct SharedPoolLayout {
    /// Bytes per slot (the slot stride).
    pub slot_bytes: u64,
    /// Slots.
    pub capacity: u32,
    /// Bytes to map (`>= capacity * slot_bytes`; a multiple of 2 MiB for hugetlb).
    pub mapped_bytes: u64,
    /// The pages behind the memfd.
    pub backing: Backing,
}

fn memfd(huge: bool) -> Result<OwnedFd, std::io::Error> {
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag as F};
    let mut flags = F::MFD_CLOEXEC;
    if huge {
        flags |= F::MFD_HUGETLB | F::MFD_HUGE_2MB;
    }
    memfd_create(c"kvtier-pool", flags).map_err(std::io::Error::from)
}

fn map_shared(fd: BorrowedFd<'_>, len: usize) -> Result<Mapping, std::io::Error> {
    let nz = NonZeroUsize::new(len).expect("pool mapping length is positive (capacity >= 1)");
    // SAFETY: a new shared mapping of our own memfd at an address the kernel picks: it aliases no
    // Rust object. The returned Mapping owns the range and unmaps it on drop.
    let p = unsafe {
        nix::sys::mman::mmap(None, nz, ProtFlags::PROT_READ | ProtFlags::PROT_WRITE, MapFlags::MAP_SHARED, fd, 0)
    }
    .map_err(std::io::Error::from)?;
    Ok(Mapping { ptr: p.cast(), len })
}

/// True if the kernel may back shmem with transparent hugepages when advised.
fn shmem_thp_allowed() -> bool {
    std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .map(|s| ["[always]", "[within_size]", "[advise]", "[force]"].iter().any(|m| s.contains(m)))
        .unwrap_or(false)
}

/// An ordinary memfd of `data` bytes, mapped; THP advised where shmem THP is allowed.
fn plain_memfd(data: u64, want_thp: bool) -> Result<(Mapping, Backing, OwnedFd), PoolError> {
    let backing_try = if want_thp { Backing::TransparentHuge } else { Backing::Plain };
    let len = map_len(data, backing_try)?;
    let err = |e: std::io::Error| PoolError::Map { bytes: len as u64, backing: "memfd", source: e };
    let fd = memfd(false).map_err(err)?;
    nix::unistd::ftruncate(&fd, len as i64).map_err(|e| err(e.into()))?;
    let map = map_shared(fd.as_fd(), len).map_err(err)?;
    let mut backing = Backing::Plain;
    if want_thp && shmem_thp_allowed() {
        // SAFETY: the range is exactly our own mapping; MADV_HUGEPAGE changes no contents.
        if unsafe { nix::sys::mman::madvise(map.as_void(), len, MmapAdvise::MADV_HUGEPAGE) }.is_ok() {
            backing = Backing::TransparentHuge;
        }
    }
    Ok((map, backing, fd))
}

/// A hugetlb memfd of `data` bytes, mapped (pages reserved by the mapping). `Err(None)`: not
/// enough 2 MiB pages free; `Err(Some(e))`: another failure.
fn hugetlb_memfd(data: u64, node: Option<u32>) -> Result<(Mapping, OwnedFd), (u64, u64, Option<PoolError>)> {
    let len = map_len(data, Backing::HugeTlb).map_err(|e| (0, 0, Some(e)))?;
    let needed = len as u64 / HUGE_PAGE_BYTES;
    let free = hugetlb_free_pages(node);
    if free < needed {
        return Err((needed, free, None));
    }
    let err = |e: std::io::Error| PoolError::Map { bytes: len as u64, backing: "hugetlb memfd", source: e };
    let fd = memfd(true).map_err(|e| (needed, free, Some(err(e))))?;
    nix::unistd::ftruncate(&fd, len as i64).map_err(|e| (needed, free, Some(err(e.into()))))?;
    match map_shared(fd.as_fd(), len) {
        Ok(map) => Ok((map, fd)),
        Err(e) if e.raw_os_error() == Some(libc::ENOMEM) => Err((needed, hugetlb_free_pages(node), None)),
        Err(e) => Err((needed, free, Some(err(e)))),
    }
}

impl HostPool {
    /// Maps a pool of `floor(config.bytes / slot_bytes)` slots in a memfd that other processes can
    /// map ([`HostPool::shared_fd`], [`HostPool::shared_layout`], [`HostPool::attach_shared`]).
    ///
    /// Backing ([`HostPool::backing`] reports it): [`BackingChoice::Auto`] and
    /// [`BackingChoice::HugeTlb`] use a hugetlb memfd when enough 2 MiB pages are free; `Auto`
    /// otherwise falls back to an ordinary memfd (4 KiB pages, or THP where the kernel allows shmem
    /// THP). [`BackingChoice::TransparentHuge`] advises THP on an ordinary memfd;
    /// [`BackingChoice::Plain`] does not. NUMA binding, prefault and `mlock` as for
    /// [`HostPool::new`].
    ///
    /// # Errors
    /// As [`HostPool::new`]; [`PoolError::Map`] also when `memfd_create` or `ftruncate` fails.
    pub fn new_shared(slot_bytes: u64, config: &PoolConfig) -> Result<Self, PoolError> {
        let capacity = slot_count(slot_bytes, config)?;
        let data = capacity as u64 * slot_bytes;
        let (map, backing, fd) = match config.backing {
            BackingChoice::HugeTlb => match hugetlb_memfd(data, config.numa_node) {
                Ok((m, fd)) => (m, Backing::HugeTlb, fd),
                Err((_, _, Some(e))) => return Err(e),
                Err((needed, free, None)) => return Err(PoolError::HugePagesUnavailable { needed, free }),
            },
            BackingChoice::Auto => match hugetlb_memfd(data, config.numa_node) {
                Ok((m, fd)) => (m, Backing::HugeTlb, fd),
                Err((_, _, Some(e))) => return Err(e),
                Err(_) => plain_memfd(data, true)?,
            },
            BackingChoice::TransparentHuge => plain_memfd(data, true)?,
            BackingChoice::Plain => plain_memfd(data, false)?,
        };
        Self::assemble(map, backing, slot_bytes, capacity, config, Some(fd))
    }

    /// Maps a shared pool made by another process ([`HostPool::new_shared`]) from its memfd and
    /// layout. The slot bytes are shared; this pool's slot words and free list are its own and
    /// unused (the owner's state machine decides which slots a process may touch).
    ///
    /// # Errors
    /// [`PoolError::BadSlotSize`]; [`PoolError::Map`] if the layout does not fit in the file
    /// (`capacity * slot_bytes > mapped_bytes`, or the file is shorter than `mapped_bytes`), or if
    /// `fstat` or `mmap` fails.
    pub fn attach_shared(fd: OwnedFd, layout: SharedPoolLayout) -> Result<Self, PoolError> {
        let SharedPoolLayout { slot_bytes, capacity, mapped_bytes, backing } = layout;
        if slot_bytes == 0 || slot_bytes % 16 != 0 {
            return Err(PoolError::BadSlotSize { slot_bytes });
        }
        let bad = |msg: String| PoolError::Map {
            bytes: mapped_bytes,
            backing: backing.name(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, msg),
        };
        let data = (capacity as u64).checked_mul(slot_bytes).ok_or_else(|| too_big(mapped_bytes, backing))?;
        if capacity == 0 || data > mapped_bytes {
            return Err(bad(format!("{capacity} slots of {slot_bytes} B do not fit in {mapped_bytes} B")));
        }
        let size = nix::sys::stat::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd))
            .map_err(|e| PoolError::Map { bytes: mapped_bytes, backing: backing.name(), source: e.into() })?
            .st_size as u64;
        if size < mapped_bytes {
            return Err(bad(format!("the pool's memfd holds {size} B, less than the {mapped_bytes} B to map")));
        }
        let len = usize::try_from(mapped_bytes).map_err(|_| too_big(mapped_bytes, backing))?;
        let map = map_shared(fd.as_fd(), len).map_err(|e| PoolError::Map {
            bytes: mapped_bytes,
            backing: backing.name(),
            source: e,
        })?;
        Self::assemble(map, backing, slot_bytes, capacity, &PoolConfig::new(data), Some(fd))
    }

    /// The memfd of a pool in shared memory (made by [`HostPool::new_shared`] or mapped by
    /// [`HostPool::attach_shared`]); `None` for a private pool.
    pub fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        self.memfd.as_ref().map(|f| f.as_fd())
    }

    /// What another process needs besides [`HostPool::shared_fd`] to map this pool.
    pub fn shared_layout(&self) -> SharedPoolLayout {
        SharedPoolLayout {
            slot_bytes: self.slot_bytes,
            capacity: self.capacity,
            mapped_bytes: self.mapped_bytes(),
            backing: self.backing,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::slot::SlotId;

    #[test]
    fn two_mappings_of_one_memfd_share_bytes() {
        let cfg = PoolConfig::new(10 * 4096 + 100).with_backing(BackingChoice::Plain);
        let owner = HostPool::new_shared(4096, &cfg).unwrap();
        assert_eq!((owner.capacity(), owner.backing(), owner.mapped_bytes()), (10, Backing::Plain, 40_960));
        let layout = owner.shared_layout();
        let fd = owner.shared_fd().unwrap().try_clone_to_owned().unwrap();
        let other = HostPool::attach_shared(fd, layout).unwrap();
        assert_eq!(other.shared_layout(), layout);
        assert_ne!(other.region().host_base, owner.region().host_base);
        // SAFETY: slot 7 lies inside both mappings; no other reference to it exists.
        unsafe {
            owner.slot_ptr(SlotId(7)).add(4095).write_volatile(0xA5);
            assert_eq!(other.slot_ptr(SlotId(7)).add(4095).read_volatile(), 0xA5);
        }
        drop(owner);
        // The memory lives as long as any mapping does.
        // SAFETY: as above.
        assert_eq!(unsafe { other.slot_ptr(SlotId(7)).add(4095).read_volatile() }, 0xA5);
    }

    #[test]
    fn a_layout_that_does_not_fit_is_refused() {
        let owner = HostPool::new_shared(4096, &PoolConfig::new(4 * 4096).with_backing(BackingChoice::Plain)).unwrap();
        let fd = || owner.shared_fd().unwrap().try_clone_to_owned().unwrap();
        let layout = owner.shared_layout();
        let e = HostPool::attach_shared(fd(), SharedPoolLayout { capacity: 5, ..layout }).unwrap_err();
        assert!(matches!(e, PoolError::Map { .. }), "{e}");
        let e = HostPool::attach_shared(fd(), SharedPoolLayout { capacity: 9, mapped_bytes: 9 * 4096, ..layout })
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "mapping 36864 B (plain) failed: the pool's memfd holds 16384 B, less than the 36864 B to map"
        );
        let e = HostPool::attach_shared(fd(), SharedPoolLayout { slot_bytes: 24, ..layout }).unwrap_err();
        assert!(matches!(e, PoolError::BadSlotSize { slot_bytes: 24 }));
    }

    #[test]
    fn auto_reports_its_backing() {
        // Whichever backing was free (other tests change the hugetlb reservation meanwhile).
        let p = HostPool::new_shared(4096, &PoolConfig::new(1 << 20)).unwrap();
        // Both hugetlb and the THP advice round the mapping up to 2 MiB.
        assert_eq!(p.mapped_bytes(), HUGE_PAGE_BYTES, "{:?}", p.backing());
        assert!(p.shared_fd().is_some());
        let private = HostPool::new(4096, &PoolConfig::new(1 << 20)).unwrap();
        assert!(private.shared_fd().is_none());
    }
}
