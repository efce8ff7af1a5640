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
    check_backable, hugetlb_free_pages, map_len, slot_count, too_big, Backing, BackingChoice, HostPool, Mapping,
    PoolConfig, HUGE_PAGE_BYTES,
};
use crate::error::PoolError;
use nix::sys::mman::{MapFlags, MmapAdvise, ProtFlags};
use std::num::NonZeroUsize;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

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

/// The seals a shared pool's memfd carries before any other process sees it
/// (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`): its size is fixed for good, so no process that
/// holds the fd can truncate it under another's mapping (a `SIGBUS` on the next copy), grow it, or
/// add a seal (`F_SEAL_FUTURE_WRITE` would make every later writable mapping fail).
///
/// The seals do not stop `fallocate(FALLOC_FL_PUNCH_HOLE)` or `madvise(MADV_REMOVE)` (only
/// `F_SEAL_WRITE`/`F_SEAL_FUTURE_WRITE` would, and every client needs a writable mapping): on an
/// ordinary memfd a punched range reads back as zeros (a connected process may write any slot
/// anyway); on hugetlb the huge pages go back to the system, and another process's next touch of
/// the range gets `SIGBUS` if no free huge page is left then. Reserve huge pages with headroom
/// (docs/design.md, the pool).
pub const POOL_SEALS: u32 = (libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL) as u32;

fn memfd(huge: bool) -> Result<OwnedFd, std::io::Error> {
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag as F};
    // Sealing is allowed for hugetlb memfds too (Linux 4.16 and later).
    let mut flags = F::MFD_CLOEXEC | F::MFD_ALLOW_SEALING;
    if huge {
        flags |= F::MFD_HUGETLB | F::MFD_HUGE_2MB;
    }
    memfd_create(c"kvtier-pool", flags).map_err(std::io::Error::from)
}

/// Sizes the memfd to `len` bytes and seals its size ([`POOL_SEALS`]).
fn size_and_seal(fd: &OwnedFd, len: usize) -> Result<(), std::io::Error> {
    use nix::fcntl::{fcntl, FcntlArg, SealFlag};
    nix::unistd::ftruncate(fd, len as i64)?;
    if crate::seeded::seeded("unsealed-pool") {
        return Ok(());
    }
    let seals = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
    fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(seals))?;
    Ok(())
}

/// Checks a shared pool's memfd before it is mapped: its size is sealed ([`POOL_SEALS`]) and it
/// holds at least `needed` bytes.
///
/// # Errors
/// [`PoolError::UnsealedSharedPool`] (also for a file that cannot be sealed, reported with seals
/// 0), [`PoolError::SharedPoolTooShort`], [`PoolError::Map`] if `fstat` fails.
fn check_sealed(fd: BorrowedFd<'_>, needed: u64, backing: Backing) -> Result<(), PoolError> {
    use nix::fcntl::{fcntl, FcntlArg};
    // A file that cannot carry seals (not a memfd, or made without MFD_ALLOW_SEALING) has none.
    let seals = fcntl(fd.as_raw_fd(), FcntlArg::F_GET_SEALS).map_or(0, |s| s as u32);
    if seals & POOL_SEALS != POOL_SEALS && !crate::seeded::seeded("attach-unsealed") {
        return Err(PoolError::UnsealedSharedPool { seals, required: POOL_SEALS });
    }
    let size = nix::sys::stat::fstat(fd.as_raw_fd())
        .map_err(|e| PoolError::Map { bytes: needed, backing: backing.name(), source: e.into() })?
        .st_size as u64;
    if size < needed {
        return Err(PoolError::SharedPoolTooShort { size, needed });
    }
    Ok(())
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

/// The kernel's shmem THP setting.
const SHMEM_ENABLED: &str = "/sys/kernel/mm/transparent_hugepage/shmem_enabled";

/// The setting in force of a `shmem_enabled` file's text: the bracketed word (`always`,
/// `within_size`, `advise`, `never`, `deny`, `force`).
fn selected(text: &str) -> Option<&str> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(&text[start..end])
}

/// `Ok(())` if the kernel may back shmem with transparent hugepages when advised, else why not.
fn shmem_thp_allowed() -> Result<(), String> {
    let text = std::fs::read_to_string(SHMEM_ENABLED).map_err(|e| format!("{SHMEM_ENABLED} cannot be read ({e})"))?;
    match selected(&text) {
        Some("always" | "within_size" | "advise" | "force") => Ok(()),
        Some(s) => Err(format!(
            "the kernel's shmem THP setting is `{s}` ({SHMEM_ENABLED}); as root, `echo advise > {SHMEM_ENABLED}` \
             allows it"
        )),
        None => Err(format!("{SHMEM_ENABLED} names no setting ({:?})", text.trim())),
    }
}

/// An ordinary memfd of `data` bytes, mapped; THP advised where shmem THP is allowed. With
/// `want_thp`, the last item says why the pages are plain if they are.
fn plain_memfd(data: u64, want_thp: bool) -> Result<(Mapping, Backing, OwnedFd, Option<String>), PoolError> {
    let backing_try = if want_thp { Backing::TransparentHuge } else { Backing::Plain };
    let len = map_len(data, backing_try)?;
    let err = |e: std::io::Error| PoolError::Map { bytes: len as u64, backing: "memfd", source: e };
    let fd = memfd(false).map_err(err)?;
    size_and_seal(&fd, len).map_err(err)?;
    let map = map_shared(fd.as_fd(), len).map_err(err)?;
    let mut backing = Backing::Plain;
    let mut why_plain = None;
    if want_thp {
        match shmem_thp_allowed() {
            // SAFETY: the range is exactly our own mapping; MADV_HUGEPAGE changes no contents.
            Ok(()) => match unsafe { nix::sys::mman::madvise(map.as_void(), len, MmapAdvise::MADV_HUGEPAGE) } {
                Ok(()) => backing = Backing::TransparentHuge,
                Err(e) => why_plain = Some(format!("the kernel refused MADV_HUGEPAGE on the pool ({e})")),
            },
            Err(why) => why_plain = Some(why),
        }
    }
    Ok((map, backing, fd, why_plain))
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
    size_and_seal(&fd, len).map_err(|e| (needed, free, Some(err(e))))?;
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
    /// The memfd's size is sealed ([`POOL_SEALS`]) before this returns, so no process it is sent
    /// to can resize it.
    ///
    /// # Errors
    /// As [`HostPool::new`] (a pool larger than memory can back is [`PoolError::ExceedsMemory`],
    /// nothing mapped); [`PoolError::Map`] also when `memfd_create`, `ftruncate` or the
    /// sealing `fcntl` fails.
    pub fn new_shared(slot_bytes: u64, config: &PoolConfig) -> Result<Self, PoolError> {
        let capacity = slot_count(slot_bytes, config)?;
        let data = capacity as u64 * slot_bytes;
        let (map, backing, fd) = match config.backing {
            BackingChoice::HugeTlb => {
                check_backable(data, Backing::HugeTlb, config)?;
                match hugetlb_memfd(data, config.numa_node) {
                    Ok((m, fd)) => (m, Backing::HugeTlb, fd),
                    Err((_, _, Some(e))) => return Err(e),
                    Err((needed, free, None)) => return Err(PoolError::HugePagesUnavailable { needed, free }),
                }
            }
            BackingChoice::Auto => {
                let huge = match check_backable(data, Backing::HugeTlb, config) {
                    Ok(()) => hugetlb_memfd(data, config.numa_node),
                    Err(_) => Err((0, 0, None)),
                };
                match huge {
                    Ok((m, fd)) => (m, Backing::HugeTlb, fd),
                    Err((_, _, Some(e))) => return Err(e),
                    Err(_) => {
                        check_backable(data, Backing::TransparentHuge, config)?;
                        // Auto takes plain pages quietly where shmem THP is off.
                        let (map, backing, fd, _) = plain_memfd(data, true)?;
                        (map, backing, fd)
                    }
                }
            }
            BackingChoice::TransparentHuge => {
                check_backable(data, Backing::TransparentHuge, config)?;
                let (map, backing, fd, why_plain) = plain_memfd(data, true)?;
                if let Some(why) = why_plain {
                    // Asked for THP and given 4 KiB pages: say so (copies and the TLB pay for it).
                    tracing::warn!(
                        "backing thp asked for the shared pool, but it is backed by plain 4 KiB pages: {why}"
                    );
                }
                (map, backing, fd)
            }
            BackingChoice::Plain => {
                check_backable(data, Backing::Plain, config)?;
                let (map, backing, fd, _) = plain_memfd(data, false)?;
                (map, backing, fd)
            }
        };
        Self::assemble(map, backing, slot_bytes, capacity, config, Some(fd))
    }

    /// Maps a shared pool made by another process ([`HostPool::new_shared`]) from its memfd and
    /// layout. The slot bytes are shared; this pool's slot words and free list are its own and
    /// unused (the owner's state machine decides which slots a process may touch). The file must
    /// be size-sealed ([`POOL_SEALS`]) and hold `mapped_bytes`, checked before it is mapped: a
    /// file another process could truncate would kill this one with `SIGBUS` on its next copy.
    ///
    /// # Errors
    /// [`PoolError::BadSlotSize`]; [`PoolError::Map`] if the layout does not fit in itself
    /// (`capacity * slot_bytes > mapped_bytes`), or if `fstat` or `mmap` fails;
    /// [`PoolError::UnsealedSharedPool`] if the file's size is not sealed;
    /// [`PoolError::SharedPoolTooShort`] if the file is shorter than `mapped_bytes`.
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
        check_sealed(fd.as_fd(), mapped_bytes, backing)?;
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
    use crate::slab::slot::SlotId;

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
        assert!(matches!(e, PoolError::SharedPoolTooShort { size: 16384, needed: 36864 }), "{e}");
        assert_eq!(e.to_string(), "the shared pool's memfd holds 16384 B, less than the 36864 B to map");
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

    /// Seals of `fd` (`F_GET_SEALS`).
    fn seals(fd: BorrowedFd<'_>) -> u32 {
        nix::fcntl::fcntl(fd.as_raw_fd(), nix::fcntl::FcntlArg::F_GET_SEALS).unwrap() as u32
    }

    /// Every way a holder of the fd could change the file's size, or add a seal, fails `EPERM`, and
    /// the pool's bytes stay mapped and readable.
    fn assert_size_sealed(pool: &HostPool) {
        use nix::fcntl::{fcntl, FcntlArg, SealFlag};
        let fd = pool.shared_fd().unwrap();
        assert_eq!(seals(fd), POOL_SEALS);
        let len = pool.mapped_bytes() as i64;
        // (Sizes a multiple of 2 MiB, which hugetlbfs needs before it looks at the seals.)
        assert_eq!(nix::unistd::ftruncate(fd, 0), Err(nix::errno::Errno::EPERM), "shrink to 0");
        assert_eq!(nix::unistd::ftruncate(fd, len * 2), Err(nix::errno::Errno::EPERM), "grow");
        let add = fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_FUTURE_WRITE));
        assert_eq!(add, Err(nix::errno::Errno::EPERM), "a further seal");
        assert_eq!(nix::sys::stat::fstat(fd.as_raw_fd()).unwrap().st_size, len);
        // SAFETY: the last byte of the last slot lies inside the mapping.
        unsafe {
            let last = pool.slot_ptr(SlotId(pool.capacity() - 1)).add(pool.slot_bytes() as usize - 1);
            last.write_volatile(9);
            assert_eq!(last.read_volatile(), 9);
        }
    }

    #[test]
    fn a_shared_pool_is_size_sealed_before_it_is_shared() {
        for backing in [BackingChoice::Plain, BackingChoice::TransparentHuge] {
            let p = HostPool::new_shared(4096, &PoolConfig::new(8 * 4096).with_backing(backing)).unwrap();
            assert_size_sealed(&p);
        }
    }

    /// Hugetlb memfds accept the seals too (root reserves the 2 MiB pages for the test).
    #[test]
    fn a_hugetlb_shared_pool_is_size_sealed() {
        let _g = crate::slab::pool::tests::HUGETLB.lock().unwrap_or_else(|e| e.into_inner());
        let Some(_r) = crate::slab::pool::tests::Reserve::set(2) else { return };
        if hugetlb_free_pages(None) < 1 {
            eprintln!("skipping: no hugepage could be reserved");
            return;
        }
        let cfg = PoolConfig::new(HUGE_PAGE_BYTES).with_backing(BackingChoice::HugeTlb);
        let p = HostPool::new_shared(4096, &cfg).unwrap();
        assert_eq!(p.backing(), Backing::HugeTlb);
        assert_size_sealed(&p);
        let attached = HostPool::attach_shared(p.shared_fd().unwrap().try_clone_to_owned().unwrap(), p.shared_layout());
        assert_eq!(attached.unwrap().backing(), Backing::HugeTlb);
    }

    /// A memfd of the right size whose size is not sealed is refused before it is mapped; so is a
    /// sealed one that is too short, and a file that cannot be sealed at all.
    #[test]
    fn attach_refuses_an_unsealed_or_short_file() {
        use nix::fcntl::{fcntl, FcntlArg, SealFlag};
        use nix::sys::memfd::{memfd_create, MemFdCreateFlag as F};
        let layout =
            SharedPoolLayout { slot_bytes: 4096, capacity: 4, mapped_bytes: 4 * 4096, backing: Backing::Plain };
        let sized = |flags: F, len: i64| {
            let fd = memfd_create(c"test", flags).unwrap();
            nix::unistd::ftruncate(&fd, len).unwrap();
            fd
        };
        // Made without MFD_ALLOW_SEALING: the kernel reports F_SEAL_SEAL alone.
        let e = HostPool::attach_shared(sized(F::MFD_CLOEXEC, 4 * 4096), layout).unwrap_err();
        assert!(
            matches!(e, PoolError::UnsealedSharedPool { seals, required: POOL_SEALS } if seals == libc::F_SEAL_SEAL as u32),
            "{e}"
        );
        // Sealable, no seals.
        let open = F::MFD_CLOEXEC | F::MFD_ALLOW_SEALING;
        let e = HostPool::attach_shared(sized(open, 4 * 4096), layout).unwrap_err();
        assert!(matches!(e, PoolError::UnsealedSharedPool { seals: 0, .. }), "{e}");
        assert_eq!(
            e.to_string(),
            "the shared pool's memfd has seals 0x0, without all of 0x7 (F_SEAL_SHRINK | F_SEAL_GROW | \
             F_SEAL_SEAL); refusing to map a file another process can resize"
        );
        // Shrink and grow sealed, but further seals allowed: refused too.
        let fd = sized(open, 4 * 4096);
        fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW)).unwrap();
        let e = HostPool::attach_shared(fd, layout).unwrap_err();
        assert!(matches!(e, PoolError::UnsealedSharedPool { seals: 0x6, .. }), "{e}");
        // Fully sealed, but shorter than the layout.
        let fd = sized(open, 3 * 4096);
        let all = SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL;
        fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(all)).unwrap();
        let e = HostPool::attach_shared(fd, layout).unwrap_err();
        assert!(matches!(e, PoolError::SharedPoolTooShort { size: 12288, needed: 16384 }), "{e}");
        // A regular file cannot carry seals.
        let file = tempfile::tempfile().unwrap();
        file.set_len(4 * 4096).unwrap();
        let e = HostPool::attach_shared(OwnedFd::from(file), layout).unwrap_err();
        assert!(matches!(e, PoolError::UnsealedSharedPool { seals: 0, .. }), "{e}");
        // The same file, sealed and long enough, maps.
        let fd = sized(open, 4 * 4096);
        fcntl(fd.as_raw_fd(), FcntlArg::F_ADD_SEALS(all)).unwrap();
        assert_eq!(HostPool::attach_shared(fd, layout).unwrap().capacity(), 4);
    }
}
