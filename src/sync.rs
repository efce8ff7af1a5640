//! The one place the crate names its synchronisation primitives.
//!
//! Every atomic, `Arc`, `Mutex` and spin hint used by the pool, the index, leases, guards and eviction
//! comes from here. A normal build re-exports `std`; a model-checking build (`--cfg loom`, see
//! `loom-tests/`) re-exports [loom](https://docs.rs/loom)'s instrumented versions, so the same code is
//! explored under every interleaving loom can reach. No other module names `std::sync::atomic`.
//!
//! It also gives each thread a small number, [`thread_number`], for code that spreads threads over
//! per-thread counters or shards, and says how long a waiting thread spins before it sleeps
//! ([`wait_spin`]: a copy's wait, a reply from `kvtierd`, the daemon's wait for a request).

#[cfg(not(loom))]
mod imp {
    pub use std::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
    pub use std::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
    pub use std::thread;

    /// Spin-loop hint for CAS retry loops (loom yields to another thread here instead).
    #[inline]
    pub fn spin_loop() {
        std::hint::spin_loop();
    }

    /// Gives the processor to another thread: for a wait on another thread's bounded step that may
    /// take microseconds (loom yields to another thread here too).
    #[inline]
    pub fn yield_now() {
        std::thread::yield_now();
    }

    /// The calling thread's number: 0, 1, 2, ... in the order threads first call this function
    /// (a thread-local assigned once from a global counter). Never reused while the process runs.
    #[inline]
    pub fn thread_number() -> usize {
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        std::thread_local! {
            static NUMBER: usize = NEXT.fetch_add(1, Ordering::Relaxed);
        }
        NUMBER.with(|n| *n)
    }
}

#[cfg(loom)]
mod imp {
    pub use loom::sync::atomic::{fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};
    pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard};
    pub use loom::thread;

    /// Spin-loop hint for CAS retry loops: under loom this yields so the model makes progress.
    #[inline]
    pub fn spin_loop() {
        loom::hint::spin_loop();
    }

    /// Gives the processor to another thread (a loom yield, so the model makes progress).
    #[inline]
    pub fn yield_now() {
        loom::thread::yield_now();
    }

    /// The calling loom thread's number: 0, 1, 2, ... in the order the threads of the current
    /// execution first call this function. The counter lives in a loom lazy static, so it restarts
    /// in every explored execution and a model's numbers depend only on its schedule; it is a std
    /// atomic, invisible to loom, so numbering adds no interleavings to the model.
    ///
    /// A loom lazy static synchronises like std's `Once` (its first use releases, every later use
    /// acquires), which would add a happens-before edge a real build lacks. Call this once on the
    /// thread that builds a shared structure before sharing it (as [`crate::BlockIndex`]'s
    /// constructor does): the edge then runs from a point that already happens-before every other
    /// thread's use, and adds nothing.
    pub fn thread_number() -> usize {
        loom::lazy_static! {
            static ref NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        }
        loom::thread_local! {
            static NUMBER: usize = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        NUMBER.with(|n| *n)
    }
}

pub use imp::*;

/// Asks the processor to bring the cache line at `p` into its caches for a coming read, without
/// waiting for it: a batch of lookups that each miss the caches (the index's buckets, per-slot
/// arrays of a million slots) issues every line first and then reads them, so the misses overlap
/// instead of running one after the other. Only a hint: never faults, whatever `p` points at, and
/// does nothing on processors other than x86-64 (nor under Miri, which has nothing to prefetch).
#[inline(always)]
pub fn prefetch_read<T>(p: *const T) {
    #[cfg(all(target_arch = "x86_64", not(miri)))]
    // SAFETY: a prefetch is a hint that never faults, even for an unmapped or dangling address,
    // and reads nothing the program sees; SSE (which defines it) is part of the x86-64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(not(all(target_arch = "x86_64", not(miri))))]
    let _ = p;
}

/// Makes the operating system back every page of `v` now. A table of zeros (`vec![0; n]`, or a
/// collect of zero atomics, which the compiler may turn into a zeroed allocation) gets pages the
/// kernel maps on their first write, so without this each first write in a save's or a query's
/// path would take a page fault (about a microsecond, the page zeroed by the kernel) at a random
/// place of a table of up to hundreds of MB at a million slots. With it, construction pays them
/// all at once (on the constructing thread, so the pages come from its NUMA node under the
/// kernel's default first-touch placement). Changes no element's value. Nothing under loom (its
/// atomics are not plain memory).
pub(crate) fn prefault<T>(v: &mut [T]) {
    #[cfg(not(loom))]
    {
        // Seeded bug (tests only): `prefault-skipped` leaves the pages to the first writes.
        if crate::seeded::seeded("prefault-skipped") {
            return;
        }
        // Elements a page apart touch every page the slice starts on or crosses, but the last
        // one, which may hold only its tail: the last element touches that one.
        let step = (4096 / std::mem::size_of::<T>().max(1)).max(1);
        for i in (0..v.len()).step_by(step).chain(v.len().checked_sub(1)) {
            let p: *mut T = &mut v[i];
            // SAFETY: `p` points at an initialised element of `v`, borrowed mutably here, so no
            // one else reads or writes it; the element is moved out bit for bit and written back
            // at once (nothing runs between, nothing is dropped), and the volatile write keeps
            // the compiler from eliding the store that touches the page.
            unsafe { std::ptr::write_volatile(p, std::ptr::read(p)) };
        }
    }
    #[cfg(loom)]
    let _ = v;
}

/// A per-slot table of `n` entries, entry `i` made by `f(i)`, with every page backed at once
/// ([`prefault`]): the tier's and the policies' per-slot arrays, whose first writes would
/// otherwise fault on the save and query paths.
pub(crate) fn table<T>(n: usize, f: impl FnMut(usize) -> T) -> Box<[T]> {
    let mut t: Box<[T]> = (0..n).map(f).collect();
    prefault(&mut t);
    t
}

/// [`lock`] for a lock held for a few microseconds at a time by threads that take it often (the
/// tier's eviction lock: one selection of victims): first tries to take it for a bounded spell of
/// spinning (about 20 tries, backing off up to 64 spin hints between them: tens of microseconds),
/// then blocks as [`lock`] does: a waiter put to sleep in the kernel at each handoff pays a wake-up
/// and a reschedule, which can cost more than the hold it waited for. Under loom this is [`lock`]:
/// the spinning changes how a thread waits, not what it gets.
#[inline]
pub fn lock_spinning<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    spin_then(|| m.try_lock(), || lock(m))
}

/// Tries `try_take` for the bounded spell of spinning [`lock_spinning`] describes, then (or at
/// once on a poisoned lock, or under loom) takes it with `take`, which waits.
#[inline]
fn spin_then<G>(try_take: impl Fn() -> std::sync::TryLockResult<G>, take: impl FnOnce() -> G) -> G {
    #[cfg(not(loom))]
    for attempt in 0..20u32 {
        match try_take() {
            Ok(g) => return g,
            // Poisoned: `take` decides what a poisoned lock gives (it recovers it).
            Err(std::sync::TryLockError::Poisoned(_)) => break,
            Err(std::sync::TryLockError::WouldBlock) => {
                for _ in 0..1u32 << attempt.min(6) {
                    spin_loop();
                }
            }
        }
    }
    #[cfg(loom)]
    let _ = &try_take;
    take()
}

/// Takes `m` if no one holds it now (recovering it if poisoned, as [`lock`] does); `None` if it is
/// held: for work a thread may leave to whoever holds the lock.
#[inline]
pub fn try_lock<T: ?Sized>(m: &Mutex<T>) -> Option<MutexGuard<'_, T>> {
    match m.try_lock() {
        Ok(g) => Some(g),
        Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
        Err(std::sync::TryLockError::WouldBlock) => None,
    }
}

/// Locks `m`, recovering it if a thread panicked while holding it (a poisoned lock is not an error
/// here). Every mutex of the tier guards state whose every update is either a single step that
/// cannot fail half-way or is undone by a drop guard on unwind (eviction claims cancel, save claims
/// and pins are released), so the state behind a lock whose holder panicked is sound: one thread's
/// panic never turns into a panic of every later caller.
#[inline]
pub fn lock<T: ?Sized>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    recover(m.lock())
}

/// [`lock_spinning`] for the exclusive side of a reader-writer lock (the tier's eviction lock
/// taken for a selection that must see every shard): spins for a bounded spell, then blocks;
/// recovers a poisoned lock as [`lock`] does. Under loom it blocks at once.
#[inline]
pub fn write_spinning<T: ?Sized>(m: &RwLock<T>) -> RwLockWriteGuard<'_, T> {
    spin_then(|| m.try_write(), || recover(m.write()))
}

/// The shared side of a reader-writer lock (the tier's eviction lock taken for a selection that
/// may run beside others), recovering a poisoned lock as [`lock`] does.
#[inline]
pub fn read<T: ?Sized>(m: &RwLock<T>) -> RwLockReadGuard<'_, T> {
    recover(m.read())
}

/// A lock's guard, poisoned or not (see [`lock`]).
#[inline]
fn recover<G>(r: std::sync::LockResult<G>) -> G {
    // Seeded bug (tests only): `lock-poisons`, the old `lock().expect(..)`.
    if crate::seeded::seeded("lock-poisons") {
        return r.unwrap_or_else(|_| panic!("a tier lock was poisoned by an earlier panic"));
    }
    r.unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// How long a thread waiting on a [`CopyHandle`](crate::CopyHandle)
/// ([`CopyHandle::wait`](crate::CopyHandle::wait),
/// [`CopyHandle::wait_timeout`](crate::CopyHandle::wait_timeout), Python's `handle.wait()`) spins
/// on the copy's completion before it sleeps: 2 ms by default (a GLM-5.2 restore of about 30 blocks at 55 GB/s), or the
/// environment variable `KVTIER_WAIT_SPIN_US` (microseconds; `0`: sleep at once), read once per
/// process. Spinning costs the waiting thread's core for at most that long; sleeping costs one
/// wake-up (tens of microseconds) after the copy has ended. A value that does not parse as an
/// integer keeps the default, with a warning. The same bound applies to a tier connected to
/// `kvtierd` waiting for a reply, and (at most 200 us) to the daemon's wait for a connection's next
/// request.
pub fn wait_spin() -> std::time::Duration {
    use std::time::Duration;
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| {
        const DEFAULT: Duration = Duration::from_millis(2);
        match std::env::var("KVTIER_WAIT_SPIN_US") {
            Err(_) => DEFAULT,
            Ok(v) => v.trim().parse::<u64>().map(Duration::from_micros).unwrap_or_else(|_| {
                tracing::warn!("KVTIER_WAIT_SPIN_US={v:?} is not a number of microseconds; spinning {DEFAULT:?}");
                DEFAULT
            }),
        }
    })
}

#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;

    /// Pages of `v` the kernel reports resident (`mincore`), and pages it spans.
    fn resident_pages<T>(v: &[T]) -> (usize, usize) {
        // SAFETY: sysconf only reads a system setting.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let start = v.as_ptr() as usize & !(page - 1);
        let end = (v.as_ptr() as usize + std::mem::size_of_val(v)).div_ceil(page) * page;
        let n = (end - start) / page;
        let mut map = vec![0u8; n];
        // SAFETY: `start..end` covers pages of a live allocation (page-aligned as mincore wants);
        // `map` holds one byte per page.
        let rc = unsafe { libc::mincore(start as *mut libc::c_void, end - start, map.as_mut_ptr()) };
        assert_eq!(rc, 0, "mincore: {}", std::io::Error::last_os_error());
        (map.iter().filter(|&&b| b & 1 == 1).count(), n)
    }

    /// A zeroed vector larger than any the allocator recycles (40 MiB: above glibc's largest
    /// threshold for serving an allocation from its heap, so it comes from a fresh mapping whose
    /// pages the kernel backs on first write) is backed page by page after [`prefault`], and
    /// keeps its values; a [`table`] of zero atomics (which an optimised build allocates zeroed)
    /// is backed too. Seeded bug `prefault-skipped` (it fails on the vector, whatever the build).
    #[test]
    fn a_table_is_resident_from_the_start_and_holds_its_values() {
        let mut z = vec![0u32; 10 << 20];
        z[12345] = 9;
        prefault(&mut z);
        let (resident, pages) = resident_pages(&z);
        assert_eq!(resident, pages, "every page of the vector is backed");
        assert_eq!((z[12345], z.iter().map(|&x| x as u64).sum::<u64>()), (9, 9));
        let t = table(8 << 20, |_| AtomicU64::new(0));
        let (resident, pages) = resident_pages(&t);
        assert_eq!(resident, pages, "every page of the table is backed");
        t[12345].store(7, Ordering::Relaxed);
        assert_eq!(t.iter().map(|x| x.load(Ordering::Relaxed)).sum::<u64>(), 7);
    }
}
