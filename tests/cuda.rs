//! GPU tests of the CUDA backend: byte parity both ways (zero copy, staged, staged with a zero-copy
//! head, in an SM partition), offsets above 2^31, concurrent save and restore, ordering against
//! engine kernels, SM isolation through green contexts, typed driver errors, rejection of bad
//! batches. Every test needs an NVIDIA GPU; run them on the device with `--include-ignored`.
#![cfg(feature = "cuda")]

use cudarc::driver::sys;
use kvtier::EngineArenas;
use kvtier::{cuda_available, CopyMode, CudaArenas, CudaBackend, CudaOptions, Isolation};
use kvtier::{ArenaSpec, ContentKey, CopyBackend, CopyError, CopyPair, Direction, Geometry, PoolRegion, WaitFor};
use memmap2::MmapMut;
use std::any::Any;
use std::collections::BTreeSet;
use std::sync::Arc;

const GPU: &str = "needs an NVIDIA GPU: run on the device with --include-ignored";

/// Host memory standing in for the pool: an anonymous mapping and its registration registry
/// (declared first so it drops, and unregisters, before the mapping is unmapped).
struct TestPool {
    registry: Vec<Box<dyn Any + Send + Sync>>,
    map: MmapMut,
    region: PoolRegion,
}

impl TestPool {
    fn new(slot_bytes: u64, capacity: u32) -> Self {
        let bytes = slot_bytes * capacity as u64;
        let mut map = MmapMut::map_anon(bytes as usize).unwrap();
        let region = PoolRegion { host_base: map.as_mut_ptr() as usize, bytes, slot_bytes, capacity };
        TestPool { registry: Vec::new(), map, region }
    }
    fn bind(&mut self, b: &mut CudaBackend) {
        // SAFETY: the registry drops before the mapping (field order).
        unsafe { b.bind_region(self.region, &mut self.registry).unwrap() }
    }
    fn slot(&self, s: u32) -> &[u8] {
        let sb = self.region.slot_bytes as usize;
        &self.map[s as usize * sb..(s as usize + 1) * sb]
    }
    fn slot_mut(&mut self, s: u32) -> &mut [u8] {
        let sb = self.region.slot_bytes as usize;
        &mut self.map[s as usize * sb..(s as usize + 1) * sb]
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        kvtier::pattern::mix64(self.0)
    }
    /// `n` distinct values from `0..range` in random order.
    fn distinct(&mut self, n: usize, range: u64) -> Vec<u64> {
        let mut all: Vec<u64> = (0..range).collect();
        for i in 0..n {
            let j = i + (self.next() % (range - i as u64)) as usize;
            all.swap(i, j);
        }
        all.truncate(n);
        all
    }
}

fn keys(rng: &mut Rng, n: usize) -> Vec<ContentKey> {
    (0..n)
        .map(|_| {
            let mut k = [0u8; 16];
            k[..8].copy_from_slice(&rng.next().to_le_bytes());
            k[8..].copy_from_slice(&rng.next().to_le_bytes());
            ContentKey::from_bytes(k)
        })
        .collect()
}

/// Host slot `s` holds the pattern of `key` in every arena's chunk.
fn check_slot(g: &Geometry, pool: &TestPool, s: u32, key: &ContentKey) {
    let slot = pool.slot(s);
    for (a, (spec, &off)) in g.arenas().iter().zip(g.chunk_offsets()).enumerate() {
        let chunk = &slot[off as usize..(off + spec.bytes_per_page) as usize];
        if let Some(b) = kvtier::pattern::first_mismatch(key, a, chunk) {
            panic!("slot {s}, arena {} byte {b}: wrong bytes after save", spec.name);
        }
    }
}

fn fill_slot(g: &Geometry, pool: &mut TestPool, s: u32, key: &ContentKey) {
    let offs: Vec<(u64, u64)> = g.arenas().iter().zip(g.chunk_offsets()).map(|(a, &o)| (o, a.bytes_per_page)).collect();
    let slot = pool.slot_mut(s);
    for (a, (off, n)) in offs.into_iter().enumerate() {
        kvtier::pattern::fill(key, a, &mut slot[off as usize..(off + n) as usize]);
    }
}

/// Fill `n` random pages, save them to random slots, check the slots; restore those slots into
/// other random pages and verify them on the GPU.
fn round_trip(g: &Geometry, n: usize, options: CudaOptions, seed: u64) {
    let arenas = CudaArenas::new(0, g, options).unwrap();
    let cap = (n as u32 + 17).max(32);
    let mut pool = TestPool::new(g.slot_bytes(), cap);
    let mut b = CudaBackend::new(0, g, arenas.binding().clone(), options).unwrap();
    assert_eq!(options.reserved_sms > 0, *b.isolation() != Isolation::Off, "{:?}", b.isolation());
    pool.bind(&mut b);
    let mut rng = Rng(seed);
    let ks = keys(&mut rng, n);
    let pages = rng.distinct(n, g.pages());
    let slots: Vec<u32> = rng.distinct(n, cap as u64).into_iter().map(|s| s as u32).collect();
    arenas.fill(&pages, &ks).unwrap();
    let batch: Vec<CopyPair> = pages.iter().zip(&slots).map(|(&p, &s)| CopyPair::new(p, s)).collect();
    // SAFETY: this test owns every slot and page of the batch until wait returns.
    let mut c = unsafe { b.save(&batch, WaitFor::Nothing) }.unwrap();
    c.wait().unwrap();
    for (s, k) in slots.iter().zip(&ks) {
        check_slot(g, &pool, *s, k);
    }
    let pages2 = rng.distinct(n, g.pages());
    let back: Vec<CopyPair> = pages2.iter().zip(&slots).map(|(&p, &s)| CopyPair::new(p, s)).collect();
    // SAFETY: as above.
    let mut c = unsafe { b.restore(&back, WaitFor::Nothing) }.unwrap();
    assert!(c.cuda_event().is_some());
    c.wait().unwrap();
    assert!(c.poll().unwrap());
    arenas.verify(&pages2, &ks).unwrap();
}

fn parity(preset: &str, pages: u64) {
    let g = Geometry::preset(preset, pages).unwrap();
    for (i, n) in [1usize, 8, 64, 256].into_iter().enumerate() {
        // The default: Auto (staged from one block, pieces ramping from 256 KiB inside a block).
        round_trip(&g, n, CudaOptions::default(), 11 + i as u64);
        // Staged with small, odd pieces (cut inside chunks' segment runs and across blocks), the
        // other kernel unroll, other CTA count, default-priority streams and one driver call per
        // copy (the default batches a piece's copies in one).
        let staged = CudaOptions {
            mode: CopyMode::Staged,
            staged_piece_blocks: 3,
            staged_first_piece_bytes: 100_000,
            staged_ctas: 3,
            staged_unroll: 4,
            high_priority: false,
            batched_copies: false,
            ..Default::default()
        };
        round_trip(&g, n, staged, 101 + i as u64);
        let zero = CudaOptions { mode: CopyMode::ZeroCopy, ..Default::default() };
        round_trip(&g, n, zero, 201 + i as u64);
        // Auto choosing zero copy for one block and staged from two.
        let auto2 = CudaOptions { mode: CopyMode::Auto, auto_staged_min_blocks: 2, ..Default::default() };
        round_trip(&g, n, auto2, 301 + i as u64);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn available() {
    let _ = GPU;
    assert!(cuda_available());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn parity_glm52() {
    parity("glm52", 600);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn parity_qwen3_4b_fused_strided() {
    parity("qwen3-4b", 600);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn parity_llama3_8b() {
    parity("llama3-8b", 600);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn parity_every_kernel_variant() {
    let g = Geometry::preset("glm52", 300).unwrap();
    for (i, (ctas, unroll)) in [(1, 4), (1, 8), (3, 4), (16, 8)].into_iter().enumerate() {
        let o = CudaOptions {
            save_ctas: ctas,
            restore_ctas: ctas,
            save_unroll: unroll,
            restore_unroll: unroll,
            ..Default::default()
        };
        round_trip(&g, 65, o, 500 + i as u64);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn offsets_above_2_gib_in_every_arena() {
    // 41,984 B arenas cross 2^31 at page 51,150; the 8,448 B one at page 254,200.
    let pages = 254_400u64;
    let arenas = vec![
        ArenaSpec::packed("mla.a", 41_984, pages),
        ArenaSpec::packed("idx", 8_448, pages),
        ArenaSpec::packed("mla.b", 41_984, pages),
    ];
    let g = Geometry::new("offset-test", 64, arenas).unwrap();
    let top = [pages - 1, pages - 2, 254_200, 254_201, 254_399 - 7];
    let mid = [51_150u64, 51_151, 200_000, 254_250, 254_300];
    for (src, dst) in [(top, mid), (mid, top)] {
        let o = CudaOptions::default();
        let arenas = CudaArenas::new(0, &g, o).unwrap();
        let mut pool = TestPool::new(g.slot_bytes(), 8);
        let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
        pool.bind(&mut b);
        let ks = keys(&mut Rng(7), 5);
        arenas.fill(&src, &ks).unwrap();
        let save: Vec<CopyPair> = src.iter().enumerate().map(|(i, &p)| CopyPair::new(p, i as u32)).collect();
        // SAFETY: the test owns these slots and pages.
        unsafe { b.save(&save, WaitFor::Nothing) }.unwrap().wait().unwrap();
        for (i, k) in ks.iter().enumerate() {
            check_slot(&g, &pool, i as u32, k);
        }
        let rest: Vec<CopyPair> = dst.iter().enumerate().map(|(i, &p)| CopyPair::new(p, i as u32)).collect();
        // SAFETY: as above.
        unsafe { b.restore(&rest, WaitFor::Nothing) }.unwrap().wait().unwrap();
        arenas.verify(&dst, &ks).unwrap();
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn save_and_restore_run_concurrently() {
    let g = Geometry::preset("glm52", 400).unwrap();
    let o = CudaOptions::default();
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let mut pool = TestPool::new(g.slot_bytes(), 128);
    let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    pool.bind(&mut b);
    let mut rng = Rng(99);
    let (ks_save, ks_rest) = (keys(&mut rng, 64), keys(&mut rng, 64));
    let pages = rng.distinct(128, g.pages());
    let (save_pages, rest_pages) = pages.split_at(64);
    arenas.fill(save_pages, &ks_save).unwrap();
    for (i, k) in ks_rest.iter().enumerate() {
        fill_slot(&g, &mut pool, 64 + i as u32, k);
    }
    let save: Vec<CopyPair> = save_pages.iter().enumerate().map(|(i, &p)| CopyPair::new(p, i as u32)).collect();
    let rest: Vec<CopyPair> = rest_pages.iter().enumerate().map(|(i, &p)| CopyPair::new(p, 64 + i as u32)).collect();
    // SAFETY: disjoint slots and pages, owned by the test until both waits return.
    let (mut cs, mut cr) =
        unsafe { (b.save(&save, WaitFor::Nothing).unwrap(), b.restore(&rest, WaitFor::Nothing).unwrap()) };
    cr.wait().unwrap();
    cs.wait().unwrap();
    for (i, k) in ks_save.iter().enumerate() {
        check_slot(&g, &pool, i as u32, k);
    }
    arenas.verify(rest_pages, &ks_rest).unwrap();
}

fn new_stream() -> u64 {
    let mut s: sys::CUstream = std::ptr::null_mut();
    // SAFETY: writes one handle; the device context is current (CudaArenas::new bound it).
    unsafe { kvtier::internals::cuda::ck("cuStreamCreate", sys::cuStreamCreate(&mut s, 1)).unwrap() };
    s as u64
}

fn record(stream: u64) -> u64 {
    let mut e: sys::CUevent = std::ptr::null_mut();
    // SAFETY: creates and records one event on a live stream.
    unsafe {
        kvtier::internals::cuda::ck("cuEventCreate", sys::cuEventCreate(&mut e, 2)).unwrap();
        kvtier::internals::cuda::ck("cuEventRecord", sys::cuEventRecord(e, stream as sys::CUstream)).unwrap();
    }
    e as u64
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn save_waits_for_the_kernel_that_wrote_the_pages() {
    let g = Geometry::preset("glm52", 64).unwrap();
    let o = CudaOptions::default();
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let mut pool = TestPool::new(g.slot_bytes(), 16);
    let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    pool.bind(&mut b);
    kvtier::internals::cuda::bind_device(0).unwrap();
    let engine = new_stream();
    let mut rng = Rng(5);
    let (old, new) = (keys(&mut rng, 8), keys(&mut rng, 8));
    let pages: Vec<u64> = (10..18).collect();
    let batch: Vec<CopyPair> = pages.iter().enumerate().map(|(i, &p)| CopyPair::new(p, i as u32)).collect();
    for by_stream in [false, true] {
        arenas.fill(&pages, &old).unwrap();
        // The "engine" writes the pages slowly (the kernel sleeps 30 ms first).
        let job = arenas.pattern_on(engine, &pages, &new, false, 30_000_000).unwrap();
        let wait = if by_stream { WaitFor::CudaStream(engine) } else { WaitFor::CudaEvent(record(engine)) };
        // SAFETY: the test owns the slots; the pages are written only by the job the save waits for.
        unsafe { b.save(&batch, wait) }.unwrap().wait().unwrap();
        job.wait().unwrap();
        for (i, k) in new.iter().enumerate() {
            check_slot(&g, &pool, i as u32, k);
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn restore_is_ordered_after_old_readers_and_before_new_readers() {
    let g = Geometry::preset("glm52", 64).unwrap();
    let o = CudaOptions::default();
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let mut pool = TestPool::new(g.slot_bytes(), 16);
    let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    pool.bind(&mut b);
    kvtier::internals::cuda::bind_device(0).unwrap();
    let (readers, compute) = (new_stream(), new_stream());
    let mut rng = Rng(6);
    let (old, new) = (keys(&mut rng, 8), keys(&mut rng, 8));
    let pages: Vec<u64> = (20..28).collect();
    arenas.fill(&pages, &old).unwrap();
    for (i, k) in new.iter().enumerate() {
        fill_slot(&g, &mut pool, i as u32, k);
    }
    // A slow reader of the old contents (sleeps 30 ms, then checks them).
    let old_reader = arenas.pattern_on(readers, &pages, &old, true, 30_000_000).unwrap();
    let batch: Vec<CopyPair> = pages.iter().enumerate().map(|(i, &p)| CopyPair::new(p, i as u32)).collect();
    // SAFETY: the test owns the pinned slots and the pages' next contents.
    let c = unsafe { b.restore(&batch, WaitFor::CudaEvent(record(readers))) }.unwrap();
    // The compute stream waits on the completion event, then reads the restored pages.
    let ev = c.cuda_event().unwrap();
    // SAFETY: live stream and event (the completion is alive until after the wait).
    unsafe {
        kvtier::internals::cuda::ck("cuStreamWaitEvent", sys::cuStreamWaitEvent(compute as _, ev as _, 0)).unwrap()
    };
    let new_reader = arenas.pattern_on(compute, &pages, &new, true, 0).unwrap();
    new_reader.wait().unwrap();
    old_reader.wait().unwrap();
    drop(c);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn bad_batches_are_rejected_with_nothing_written() {
    let g = Geometry::preset("glm52", 32).unwrap();
    let o = CudaOptions::default();
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let mut pool = TestPool::new(g.slot_bytes(), 4);
    let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    // Not bound yet.
    // SAFETY: nothing is copied.
    assert!(matches!(unsafe { b.save(&[CopyPair::new(0, 0)], WaitFor::Nothing) }, Err(CopyError::PoolNotBound)));
    pool.bind(&mut b);
    let ks = keys(&mut Rng(8), 4);
    let pages = [0u64, 1, 2, 31];
    arenas.fill(&pages, &ks).unwrap();
    pool.map.fill(0xab);
    type Case = (Vec<CopyPair>, fn(&CopyError) -> bool);
    let bad: [Case; 4] = [
        (vec![CopyPair::new(0, 0), CopyPair::new(32, 1)], |e| {
            matches!(e, CopyError::PageOutOfRange { page: 32, pages: 32 })
        }),
        (vec![CopyPair::new(u64::MAX, 1)], |e| matches!(e, CopyError::PageOutOfRange { .. })),
        (vec![CopyPair::new(1, 0), CopyPair::new(2, 4)], |e| {
            matches!(e, CopyError::SlotOutOfRange { slot: 4, capacity: 4 })
        }),
        (vec![CopyPair::new(1, 2), CopyPair::new(2, 2)], |e| matches!(e, CopyError::DuplicateDestination { .. })),
    ];
    for (batch, want) in &bad {
        // SAFETY: rejected before anything is queued.
        let e = unsafe { b.save(batch, WaitFor::Nothing) }.err().expect("rejected");
        assert!(want(&e), "{e:?}");
    }
    // Restores: out-of-range pages and slots, and a GPU page written twice.
    for batch in [vec![CopyPair::new(32, 0)], vec![CopyPair::new(0, 9)], vec![CopyPair::new(3, 0), CopyPair::new(3, 1)]]
    {
        // SAFETY: rejected before anything is queued.
        assert!(unsafe { b.restore(&batch, WaitFor::Nothing) }.is_err());
    }
    b.drain().unwrap();
    assert!(pool.map.iter().all(|&x| x == 0xab), "a rejected save wrote host memory");
    arenas.verify(&pages, &ks).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn one_registration_serves_every_backend_of_a_pool() {
    let g = Geometry::preset("llama3-8b", 16).unwrap();
    let o = CudaOptions::default();
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let mut pool = TestPool::new(g.slot_bytes(), 4);
    let mut b1 = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    let mut b2 = arenas.backend().unwrap();
    pool.bind(&mut b1);
    // SAFETY: registry outlives nothing it registered (dropped before the map).
    unsafe { b1.bind_region(pool.region, &mut pool.registry).unwrap() };
    assert_eq!(pool.registry.len(), 1);
    let _ = &mut b2;
    let ks = keys(&mut Rng(9), 2);
    arenas.fill(&[3, 4], &ks).unwrap();
    // SAFETY: owned slots/pages.
    unsafe { b1.save(&[CopyPair::new(3, 0), CopyPair::new(4, 1)], WaitFor::Nothing) }.unwrap().wait().unwrap();
    check_slot(&g, &pool, 1, &ks[1]);
    // Dropping the pool's registry first drains and unregisters; the backend then drops cleanly.
    drop(Arc::new(()));
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn bind_pool_through_a_real_host_pool() {
    use kvtier::{HostPool, PoolConfig, SlotId};
    let g = Geometry::preset("glm52", 200).unwrap();
    let pool = HostPool::new(g.slot_bytes(), &PoolConfig::new(24 * g.slot_bytes())).unwrap();
    assert_eq!(pool.capacity(), 24);
    let o = CudaOptions::default();
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    b.bind_pool(&pool).unwrap();
    // A second backend (zero copy) binds the same pool through the same registration.
    let mut z =
        CudaBackend::new(0, &g, arenas.binding().clone(), CudaOptions { mode: CopyMode::ZeroCopy, ..o }).unwrap();
    z.bind_pool(&pool).unwrap();
    assert_eq!(pool.with_registrations(|r| r.len()), 1);
    let mut rng = Rng(77);
    for (round, be) in [&b, &z].into_iter().enumerate() {
        for n in [1usize, 5] {
            let ks = keys(&mut rng, n);
            let pages = rng.distinct(n, g.pages());
            let slots: Vec<SlotId> = (0..n).map(|_| pool.alloc().expect("free slot")).collect();
            arenas.fill(&pages, &ks).unwrap();
            let batch: Vec<CopyPair> = pages.iter().zip(&slots).map(|(&p, s)| CopyPair::new(p, s.get())).collect();
            // SAFETY: the test owns the allocated slots and the pages until wait returns.
            unsafe { be.save(&batch, WaitFor::Nothing) }.unwrap().wait().unwrap();
            for (s, k) in slots.iter().zip(&ks) {
                // SAFETY: the slot is ours and no copy is in flight (waited above).
                let bytes = unsafe { std::slice::from_raw_parts(pool.slot_ptr(*s), g.slot_bytes() as usize) };
                for (a, (spec, &off)) in g.arenas().iter().zip(g.chunk_offsets()).enumerate() {
                    let chunk = &bytes[off as usize..(off + spec.bytes_per_page) as usize];
                    assert_eq!(kvtier::pattern::first_mismatch(k, a, chunk), None, "round {round}, slot {}", s.get());
                }
            }
            let pages2 = rng.distinct(n, g.pages());
            let back: Vec<CopyPair> = pages2.iter().zip(&slots).map(|(&p, s)| CopyPair::new(p, s.get())).collect();
            // SAFETY: as above.
            unsafe { be.restore(&back, WaitFor::Nothing) }.unwrap().wait().unwrap();
            arenas.verify(&pages2, &ks).unwrap();
            for s in slots {
                pool.free(s);
            }
        }
    }
    drop(z);
    drop(b);
    // The pool drains and unregisters on drop.
    drop(pool);
}

/// A tier restore's handle orders the engine's stream with no host sync: the restore waits for a
/// slow reader of the pages' old contents, the engine stream waits on the handle
/// (`CopyHandle::stream_wait`), and a reader queued there right away sees the restored bytes. The
/// handle keeps the event valid after the copy's completion is gone.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn tier_handle_stream_wait_orders_the_engine_stream() {
    use kvtier::{HostTier, TierConfig};
    let g = Geometry::preset("llama3-8b", 64).unwrap();
    let arenas = Arc::new(CudaArenas::new(0, &g, CudaOptions::default()).unwrap());
    let tier = HostTier::new(TierConfig::new(g.clone(), 16 * g.slot_bytes())).unwrap();
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    kvtier::internals::cuda::bind_device(0).unwrap();
    let (readers, compute) = (new_stream(), new_stream());
    let ns = tier.namespace();
    let (old, new): (Vec<ContentKey>, Vec<ContentKey>) = (
        (0..8u32).map(|i| ns.key_from_bytes(format!("old-{i}").as_bytes())).collect(),
        (0..8u32).map(|i| ns.key_from_bytes(format!("new-{i}").as_bytes())).collect(),
    );
    let (src, dst): (Vec<u64>, Vec<u64>) = ((0..8).collect(), vec![41, 17, 33, 9, 60, 22, 50, 12]);
    arenas.fill(&src, &new).unwrap();
    let saved = rank.save(&new, &src, WaitFor::Nothing).unwrap();
    assert!(saved.handle.cuda_event().is_some());
    saved.handle.wait().unwrap();
    arenas.fill(&dst, &old).unwrap();
    let old_reader = arenas.pattern_on(readers, &dst, &old, true, 30_000_000).unwrap();
    let lease = tier.query(&new);
    assert_eq!(lease.len(), 8);
    let h = rank.restore(&lease, &dst, WaitFor::CudaEvent(record(readers))).unwrap();
    h.stream_wait(compute).unwrap();
    let new_reader = arenas.pattern_on(compute, &dst, &new, true, 0).unwrap();
    new_reader.wait().unwrap();
    old_reader.wait().unwrap();
    h.wait().unwrap();
    // The completion is gone (the rank's thread dropped it); the handle still owns the event.
    let ev = h.cuda_event().expect("a CUDA copy has an event");
    // SAFETY: the event is live while `h` is.
    unsafe { kvtier::internals::cuda::ck("cuEventSynchronize", sys::cuEventSynchronize(ev as _)).unwrap() };
    h.stream_wait(compute).unwrap();
    h.stream_wait(0).unwrap(); // the legacy default stream
}

/// Staged with a zero-copy head of odd sizes (cut inside a chunk, rounded up to a segment
/// boundary), a whole-block head, and a head longer than the batch (all zero copy), over inline
/// and uploaded pair lists, small pieces and the fused strided layout.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn parity_with_a_zero_copy_head() {
    for (preset, pages) in [("glm52", 300), ("qwen3-4b", 300)] {
        let g = Geometry::preset(preset, pages).unwrap();
        let heads = [100_000u64, g.block_bytes(), 64 << 20];
        for (i, n) in [1usize, 2, 8, 65].into_iter().enumerate() {
            for (j, &head) in heads.iter().enumerate() {
                let o = CudaOptions {
                    mode: CopyMode::Staged,
                    save_head_bytes: head,
                    restore_head_bytes: head / 2 + 16,
                    staged_piece_blocks: 3,
                    staged_first_piece_bytes: 300_000,
                    ..Default::default()
                };
                round_trip(&g, n, o, 700 + 10 * i as u64 + j as u64);
            }
        }
    }
}

/// The backend's streams belong to a green context of the reserved SMs, the engine partition's
/// streams to the others: kernels on each side run only on their own SMs, and the two sets are
/// disjoint and cover the device.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn green_context_confines_copy_and_engine_kernels_to_disjoint_sms() {
    let g = Geometry::preset("glm52", 16).unwrap();
    let o = CudaOptions { reserved_sms: 8, ..Default::default() };
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    let sms = kvtier::internals::cuda::bind_device(0).unwrap();
    let Isolation::GreenContext { copy_sms, engine_sms } = b.isolation().clone() else {
        panic!("no green context: {:?}", b.isolation());
    };
    assert!(copy_sms >= 8 && copy_sms < sms, "{copy_sms} of {sms}");
    assert_eq!(copy_sms + engine_sms, sms);
    let part = b.sm_partition().expect("isolated");
    assert_eq!((part.copy_sms(), part.engine_sms()), (copy_sms, engine_sms));
    let grid = 8 * sms;
    let ids = |stream: u64| -> BTreeSet<u32> {
        kvtier::internals::cuda::sm_ids(0, stream, grid, 50_000).unwrap().into_iter().collect()
    };
    let copy_side = ids(b.stream(Direction::Restore));
    let copy_save = ids(b.stream(Direction::Save));
    let es = part.engine_stream(false).unwrap();
    let engine_side = ids(es.raw());
    assert_eq!(copy_side.len(), copy_sms as usize, "copy partition SMs: {copy_side:?}");
    assert_eq!(copy_save, copy_side);
    assert_eq!(engine_side.len(), engine_sms as usize);
    assert!(copy_side.is_disjoint(&engine_side));
    assert!(copy_side.iter().chain(&engine_side).all(|&s| s < sms));
    // A second backend with the same reservation shares the split.
    let b2 = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    assert_eq!(ids(b2.stream(Direction::Save)), copy_side);
    assert!(part.engine_context().unwrap() != 0);
}

/// Copies with the kernels in the copy partition move the same bytes as without: every mode, one
/// to 64 blocks, both directions, glm52 (verified on the host and on the GPU).
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn green_context_parity() {
    let g = Geometry::preset("glm52", 300).unwrap();
    let base = CudaOptions { reserved_sms: 8, ..Default::default() };
    let modes = [
        base,
        CudaOptions { mode: CopyMode::ZeroCopy, ..base },
        CudaOptions { mode: CopyMode::Staged, save_head_bytes: 1 << 20, restore_head_bytes: 512 << 10, ..base },
    ];
    let arenas = CudaArenas::new(0, &g, base).unwrap();
    let b = CudaBackend::new(0, &g, arenas.binding().clone(), base).unwrap();
    assert!(matches!(b.isolation(), Isolation::GreenContext { .. }), "{:?}", b.isolation());
    drop((b, arenas));
    for (i, o) in modes.into_iter().enumerate() {
        for (j, n) in [1usize, 8, 64].into_iter().enumerate() {
            round_trip(&g, n, o, 900 + 10 * i as u64 + j as u64);
        }
    }
}

/// The engine side of the split, through the tier: a restore's handle orders a stream of the
/// engine partition (`stream_wait`), and a reader queued there right away sees the restored bytes;
/// a save waits for a writer on that stream.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn green_context_tier_restore_orders_an_engine_partition_stream() {
    use kvtier::{HostTier, TierConfig};
    let g = Geometry::preset("llama3-8b", 64).unwrap();
    // Staged with zero-copy heads, so one small test covers every stream of the copy partition.
    let o =
        CudaOptions { reserved_sms: 8, save_head_bytes: 300_000, restore_head_bytes: 300_000, ..Default::default() };
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let backend = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    let part = backend.sm_partition().expect("isolated");
    let tier = HostTier::new(TierConfig::new(g.clone(), 16 * g.slot_bytes())).unwrap();
    let rank = tier.attach(Box::new(backend)).unwrap();
    let engine = part.engine_stream(false).unwrap();
    let ns = tier.namespace();
    let keys: Vec<ContentKey> = (0..8u32).map(|i| ns.key_from_bytes(format!("green-{i}").as_bytes())).collect();
    let old: Vec<ContentKey> = (0..8u32).map(|i| ns.key_from_bytes(format!("old-{i}").as_bytes())).collect();
    let (src, dst): (Vec<u64>, Vec<u64>) = ((0..8).collect(), vec![40, 17, 33, 9, 61, 22, 50, 12]);
    // A slow writer on the engine stream (sleeps 30 ms first); the save waits for it.
    let writer = arenas.pattern_on(engine.raw(), &src, &keys, false, 30_000_000).unwrap();
    let saved = rank.save(&keys, &src, WaitFor::CudaStream(engine.raw())).unwrap();
    saved.handle.wait().unwrap();
    writer.wait().unwrap();
    arenas.fill(&dst, &old).unwrap();
    let lease = tier.query(&keys);
    assert_eq!(lease.len(), 8);
    let h = rank.restore(&lease, &dst, WaitFor::CudaStream(engine.raw())).unwrap();
    h.stream_wait(engine.raw()).unwrap();
    let reader = arenas.pattern_on(engine.raw(), &dst, &keys, true, 0).unwrap();
    reader.wait().unwrap();
    h.wait().unwrap();
    engine.synchronize().unwrap();
}

/// Too many reserved SMs: the backend says why it is not isolated and copies on the whole device.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn green_context_fallback_when_the_split_is_impossible() {
    let g = Geometry::preset("glm52", 64).unwrap();
    let o = CudaOptions { reserved_sms: 100_000, ..Default::default() };
    let arenas = CudaArenas::new(0, &g, o).unwrap();
    let b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
    match b.isolation() {
        Isolation::Unavailable { reason } => assert!(reason.contains("100000 reserved SMs"), "{reason}"),
        other => panic!("{other:?}"),
    }
    assert!(b.sm_partition().is_none());
    drop(b);
    round_trip(&g, 3, o, 77);
}

/// A failed driver call keeps the driver's result: allocating 4 TiB arenas fails with
/// `CUDA_ERROR_OUT_OF_MEMORY` from `cuMemAlloc`.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn a_failed_driver_call_keeps_its_cuda_result() {
    let g = Geometry::new("huge", 16, vec![ArenaSpec::packed("a", 1 << 20, 1 << 22)]).unwrap();
    let e = CudaArenas::new(0, &g, CudaOptions::default()).expect_err("4 TiB cannot be allocated");
    match &e {
        kvtier::Error::Copy(CopyError::Cuda { call, source, .. }) => {
            assert_eq!(*call, "cuMemAlloc");
            assert_eq!(source.0, sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
            assert!(e.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY (2)"), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

// ---- Layer-wise copies (kvtier) ----

use kvtier::internals::copy_layers;
use kvtier::LayerGroups;

/// A gate on the GPU: a kernel (`kvt_spin_until`) on a stream of its own that runs until the test
/// writes 1 into a host-mapped word, and an event recorded after it: a deterministic stand-in for
/// a slow copy. (A spinning kernel, not `cuStreamWaitValue32`: a stream wait stalls the hardware
/// queue it shares with other streams, a running kernel does not.)
struct Gate {
    flag: *mut u32,
    event: u64,
    stream: u64,
}

// SAFETY: the flag is pinned host memory owned by the gate; the handles may be used anywhere.
unsafe impl Send for Gate {}

impl Gate {
    fn new() -> Self {
        let stream = new_stream();
        let mut host: *mut std::ffi::c_void = std::ptr::null_mut();
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: allocates 4 B of pinned, device-mapped host memory, zeroes it and takes its
        // device address (the context is current).
        unsafe {
            kvtier::internals::cuda::ck(
                "cuMemHostAlloc",
                sys::cuMemHostAlloc(&mut host, 4, sys::CU_MEMHOSTALLOC_DEVICEMAP),
            )
            .unwrap();
            std::ptr::write_volatile(host as *mut u32, 0);
            kvtier::internals::cuda::ck(
                "cuMemHostGetDevicePointer",
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0),
            )
            .unwrap();
        }
        kvtier::internals::cuda::spin_until(0, stream, dev, 1).unwrap();
        Gate { flag: host as *mut u32, event: record(stream), stream }
    }
    fn open(&self) {
        // SAFETY: the flag is live pinned memory; the kernel reads it with volatile loads.
        unsafe { std::ptr::write_volatile(self.flag, 1) };
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.open();
        // SAFETY: waits for the kernel, then frees what `new` created.
        unsafe {
            sys::cuStreamSynchronize(self.stream as _);
            sys::cuStreamDestroy_v2(self.stream as _);
            sys::cuMemFreeHost(self.flag as _);
        }
    }
}

/// Opens a gate after 60 s unless finished first: a test whose work waits for the gated group
/// (or whose submission blocks on it, or whose host thread waits for the whole device, as
/// `cuMemFree` does) fails with a message instead of hanging.
struct Watchdog {
    tx: std::sync::mpsc::Sender<()>,
    dog: std::thread::JoinHandle<bool>,
    fired: Arc<std::sync::atomic::AtomicBool>,
}

impl Watchdog {
    fn start(gate: &Gate) -> Self {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let flag = gate.flag as usize;
        let fired = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let f = fired.clone();
        let dog = std::thread::spawn(move || {
            if rx.recv_timeout(std::time::Duration::from_secs(60)).is_err() {
                f.store(true, std::sync::atomic::Ordering::SeqCst);
                // SAFETY: the gate (and its flag) outlives this thread: `finish` joins it first.
                unsafe { std::ptr::write_volatile(flag as *mut u32, 1) };
                return true;
            }
            false
        });
        Watchdog { tx, dog, fired }
    }
    /// Fails if the watchdog has opened the gate: what the test observed since then (a group
    /// ready, a reader done) may be due to the opened gate, not to the order under test.
    fn check(&self, what: &str) {
        assert!(
            !self.fired.load(std::sync::atomic::Ordering::SeqCst),
            "{what}: the work before the gate waited for the gated last group (the watchdog opened the gate)"
        );
    }
    fn finish(self, what: &str) {
        let _ = self.tx.send(());
        assert!(!self.dog.join().unwrap(), "{what}: the work before the gate waited for the gated last group");
    }
}

fn destroy_stream(s: u64) {
    // SAFETY: a stream this test created; nothing is queued on it any more.
    unsafe {
        sys::cuStreamSynchronize(s as _);
        sys::cuStreamDestroy_v2(s as _);
    }
}

/// Layer-wise restores in every mode, over random and consecutive slots, at 1, 8 and all
/// groups: the bytes equal those of the slots. With the last group's copy held by a gate, the
/// reader of the groups before it runs (and sees their bytes and the old bytes of the last
/// group), the last group is not ready, and the last reader sees everything once the gate opens.
/// While the gate is closed the host calls nothing that waits for the whole device (a pattern job
/// frees no device memory: `cuMemFree` would wait for the gate); the watchdog's check says so if
/// it does.
fn layer_restore(preset: &str, n: usize, groups: u32, options: CudaOptions, consecutive: bool, seed: u64) {
    let g = Geometry::preset(preset, 128).unwrap();
    let arenas = CudaArenas::new(0, &g, options).unwrap();
    let cap = (n as u32 + 17).max(32);
    let mut pool = TestPool::new(g.slot_bytes(), cap);
    let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), options).unwrap();
    pool.bind(&mut b);
    kvtier::internals::cuda::bind_device(0).unwrap();
    let mut rng = Rng(seed);
    let (new, old) = (keys(&mut rng, n), keys(&mut rng, n));
    let pages = rng.distinct(n, g.pages());
    let slots: Vec<u32> = if consecutive {
        (3..3 + n as u32).collect()
    } else {
        rng.distinct(n, cap as u64).into_iter().map(|s| s as u32).collect()
    };
    for (s, k) in slots.iter().zip(&new) {
        fill_slot(&g, &mut pool, *s, k);
    }
    arenas.fill(&pages, &old).unwrap();
    let lg = LayerGroups::new(&g, groups).unwrap();
    let gate = Gate::new();
    let mut waits = vec![WaitFor::Nothing; lg.len()];
    *waits.last_mut().unwrap() = WaitFor::CudaEvent(gate.event);
    let batch: Vec<CopyPair> = pages.iter().zip(&slots).map(|(&p, &s)| CopyPair::new(p, s)).collect();
    let dog = Watchdog::start(&gate);
    let what = format!("{preset} n={n} groups={groups} {:?}", options.mode);
    // SAFETY: the test owns the slots and pages until wait returns.
    let mut c = unsafe { copy_layers(&b, Direction::Restore, &batch, &lg, &waits) }.unwrap();
    let ready = c.layer_readiness().expect("CUDA layer-wise copies have a readiness");
    assert_eq!(ready.groups(), lg.len());
    let reader = new_stream();
    if lg.len() > 1 {
        let before = lg.len() - 2;
        ready.stream_wait(before, reader).unwrap();
        let job = arenas.pattern_on(reader, &pages, &new, true, 0).unwrap();
        let e = job.wait().expect_err("the gated group still holds the old bytes");
        // The first mismatch is the first arena of the gated group (of the first page).
        let want = format!("GPU page {}, arena `{}`", pages[0], g.arenas()[lg.arenas(lg.len() - 1).start].name);
        assert!(e.to_string().contains(&want), "{what}: {e} (want {want})");
        dog.check(&what);
        assert!(!ready.is_ready(lg.len() - 1).unwrap(), "{what}: the gated group is not ready");
        assert!(!c.poll().unwrap(), "nor is the copy");
    }
    dog.finish(&what);
    gate.open();
    ready.stream_wait(lg.len() - 1, reader).unwrap();
    arenas.pattern_on(reader, &pages, &new, true, 0).unwrap().wait().unwrap();
    c.wait().unwrap();
    assert!((0..lg.len()).all(|k| ready.is_ready(k).unwrap()));
    destroy_stream(reader);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn layer_wise_restore_orders_each_group_and_a_gated_last_group_delays_only_its_reader() {
    let staged_small = CudaOptions {
        mode: CopyMode::Staged,
        staged_piece_blocks: 3,
        staged_first_piece_bytes: 100_000,
        staged_ctas: 3,
        staged_unroll: 4,
        ..Default::default()
    };
    let zero = CudaOptions { mode: CopyMode::ZeroCopy, ..Default::default() };
    let mut seed = 1000;
    for preset in ["glm52", "llama3-8b", "qwen3-4b"] {
        for n in [1usize, 8, 100] {
            for groups in [1u32, 8, 500] {
                for (o, consecutive) in [
                    (CudaOptions::default(), true),
                    (CudaOptions::default(), false),
                    (staged_small, true),
                    (zero, false),
                ] {
                    seed += 1;
                    layer_restore(preset, n, groups, o, consecutive, seed);
                }
            }
        }
    }
}

/// A layer-wise save: group g reads the pages only after its own event; the last group's wait is
/// a gate, so the groups before it are read (ready) while it is not; every slot holds the bytes
/// the "engine" wrote once the gate opens.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn layer_wise_save_waits_for_each_groups_event() {
    for (preset, n, groups, mode) in [
        ("glm52", 8usize, 78u32, CopyMode::Auto),
        ("llama3-8b", 70, 32, CopyMode::Auto),
        ("glm52", 3, 8, CopyMode::ZeroCopy),
    ] {
        let g = Geometry::preset(preset, 128).unwrap();
        let o = CudaOptions { mode, ..Default::default() };
        let arenas = CudaArenas::new(0, &g, o).unwrap();
        let mut pool = TestPool::new(g.slot_bytes(), 80);
        let mut b = CudaBackend::new(0, &g, arenas.binding().clone(), o).unwrap();
        pool.bind(&mut b);
        kvtier::internals::cuda::bind_device(0).unwrap();
        let engine = new_stream();
        let mut rng = Rng(77 + n as u64);
        let (old, new) = (keys(&mut rng, n), keys(&mut rng, n));
        let pages = rng.distinct(n, g.pages());
        arenas.fill(&pages, &old).unwrap();
        // The "prefill" writes the pages slowly (30 ms), then records one event per group.
        let job = arenas.pattern_on(engine, &pages, &new, false, 30_000_000).unwrap();
        let lg = LayerGroups::new(&g, groups).unwrap();
        let gate = Gate::new();
        let mut waits: Vec<WaitFor> = (0..lg.len()).map(|_| WaitFor::CudaEvent(record(engine))).collect();
        let last = lg.len() - 1;
        let Some(WaitFor::CudaEvent(e)) = waits.last().copied() else { unreachable!() };
        // The last group waits for the engine's event and the gate.
        let both = new_stream();
        let engine_streams = [engine, both];
        // SAFETY: live stream and events.
        unsafe {
            kvtier::internals::cuda::ck("cuStreamWaitEvent", sys::cuStreamWaitEvent(both as _, e as _, 0)).unwrap();
            kvtier::internals::cuda::ck("cuStreamWaitEvent", sys::cuStreamWaitEvent(both as _, gate.event as _, 0))
                .unwrap();
        }
        waits[last] = WaitFor::CudaEvent(record(both));
        let batch: Vec<CopyPair> = pages.iter().enumerate().map(|(i, &p)| CopyPair::new(p, 2 + i as u32)).collect();
        let dog = Watchdog::start(&gate);
        // SAFETY: the test owns the slots; the pages are written only by the job the save waits for.
        let mut c = unsafe { copy_layers(&b, Direction::Save, &batch, &lg, &waits) }.unwrap();
        let ready = c.layer_readiness().unwrap();
        job.wait().unwrap();
        if last > 0 {
            // A reader of the pages after group last-1's readiness runs while the gate is closed.
            let reader = new_stream();
            ready.stream_wait(last - 1, reader).unwrap();
            arenas.pattern_on(reader, &pages, &new, true, 0).unwrap().wait().unwrap();
            dog.check(preset);
            assert!(!ready.is_ready(last).unwrap(), "{preset}: the gated last group is not ready");
            destroy_stream(reader);
        }
        dog.finish(preset);
        gate.open();
        c.wait().unwrap();
        for (i, k) in new.iter().enumerate() {
            check_slot(&g, &pool, 2 + i as u32, k);
        }
        engine_streams.into_iter().for_each(destroy_stream);
    }
}

/// Through the tier: `Rank::restore_layers` and the handle's `wait_layer` order an engine stream
/// after one layer; after the last layer's wait every page holds the saved bytes.
#[test]
#[ignore = "needs an NVIDIA GPU: run on the device with --include-ignored"]
fn tier_layer_wise_restore_and_save_through_a_rank() {
    use kvtier::{HostTier, SaveOptions, TierConfig};
    let g = Geometry::preset("llama3-8b", 128).unwrap();
    let arenas = Arc::new(CudaArenas::new(0, &g, CudaOptions::default()).unwrap());
    let tier = HostTier::new(TierConfig::new(g.clone(), 40 * g.slot_bytes())).unwrap();
    let rank = tier.attach(arenas.backend().unwrap()).unwrap();
    kvtier::internals::cuda::bind_device(0).unwrap();
    let (engine, compute) = (new_stream(), new_stream());
    let ns = tier.namespace();
    let keys: Vec<ContentKey> = (0..32u32).map(|i| ns.key_from_bytes(format!("k-{i}").as_bytes())).collect();
    let src: Vec<u64> = (0..32).collect();
    let job = arenas.pattern_on(engine, &src, &keys, false, 10_000_000).unwrap();
    let waits: Vec<WaitFor> = (0..8).map(|_| WaitFor::CudaEvent(record(engine))).collect();
    let t = rank.save_layers(&keys, &src, &waits, 8, SaveOptions::default()).unwrap();
    assert!(t.handle.layer_event(31).unwrap().is_some());
    t.handle.wait().unwrap();
    job.wait().unwrap();
    let lease = tier.query(&keys);
    assert_eq!(lease.len(), 32);
    let dst: Vec<u64> = (64..96).collect();
    let h = rank.restore_layers(&lease, &dst, WaitFor::Nothing, 32).unwrap();
    assert_eq!(h.layer_groups().unwrap().len(), 32);
    assert_ne!(h.layer_event(0).unwrap(), h.layer_event(31).unwrap());
    assert!(h.wait_layer(32, compute).is_err());
    h.wait_layer(31, compute).unwrap();
    arenas.pattern_on(compute, &dst, &keys, true, 0).unwrap().wait().unwrap();
    h.wait().unwrap();
    assert!(h.is_layer_ready(0).unwrap());
}
