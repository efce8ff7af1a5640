use super::mapping::*;
use super::*;
use crate::sync::{AtomicU32, Ordering};
use std::collections::HashSet;
use std::path::Path;
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
    assert_eq!(r, PoolRegion { host_base: r.host_base, bytes: p.mapped_bytes(), slot_bytes: GLM_SLOT, capacity: 3 });
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
