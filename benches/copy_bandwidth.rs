//! Save (D2H) and restore (H2D) bandwidth of GLM-5.2 blocks on one GPU, side by side in one run:
//! the kvtier kernel at 1, 2, 4, 8, 16 CTAs, the staged mode, one `cuMemcpyAsync` per chunk,
//! `cuMemcpyBatchAsync` over all chunks, and one contiguous copy of the same byte count (the
//! link's ceiling in this run); then save and restore at once, and the slowdown of a compute kernel
//! while restores run. Times come from CUDA events recorded around the work on the stream that does
//! it (throughput over completion, not submission). GB = 10^9 B.
//!
//! `cargo bench --features cuda --bench copy_bandwidth` on a machine with an NVIDIA GPU; without
//! the feature this is an empty program.

#[cfg(not(feature = "cuda"))]
fn main() {}

#[cfg(feature = "cuda")]
fn main() {
    imp::main()
}

#[cfg(feature = "cuda")]
mod imp {
    use criterion::{BenchmarkId, Criterion, Throughput};
    use cudarc::driver::sys;
    use kvtier::cuda::raw::ck;
    use kvtier::cuda::{CopyMode, CudaArenas, CudaBackend, CudaOptions};
    use kvtier::{Completion, ContentKey, CopyBackend, CopyPair, Direction, Geometry, PoolRegion, WaitFor};
    use memmap2::MmapMut;
    use std::any::Any;
    use std::ffi::c_void;
    use std::sync::Arc;
    use std::time::Duration;

    const BLOCKS: [usize; 5] = [1, 8, 43, 128, 256];
    const MAX_BLOCKS: usize = 256;

    fn ok(call: &'static str, r: sys::CUresult) {
        ck(call, r).unwrap_or_else(|e| panic!("{e}"));
    }

    struct Timer {
        start: sys::CUevent,
        end: sys::CUevent,
    }

    impl Timer {
        fn new() -> Self {
            let (mut start, mut end) = (std::ptr::null_mut(), std::ptr::null_mut());
            // SAFETY: plain event creation with timing.
            unsafe {
                ok("cuEventCreate", sys::cuEventCreate(&mut start, 0));
                ok("cuEventCreate", sys::cuEventCreate(&mut end, 0));
            }
            Timer { start, end }
        }
        /// Records start on `s`, runs `f` (which queues work), records end on `e_stream`, waits for
        /// it, then drops what `f` returned (completions: waited on after the end event); returns
        /// the elapsed device time.
        fn time<T>(&self, s: u64, e_stream: u64, f: impl FnOnce() -> T) -> Duration {
            // SAFETY: live events and streams.
            unsafe {
                ok("cuEventRecord", sys::cuEventRecord(self.start, s as _));
                let keep = f();
                ok("cuEventRecord", sys::cuEventRecord(self.end, e_stream as _));
                ok("cuEventSynchronize", sys::cuEventSynchronize(self.end));
                drop(keep);
                let mut ms = 0f32;
                ok("cuEventElapsedTime", sys::cuEventElapsedTime_v2(&mut ms, self.start, self.end));
                Duration::from_secs_f64(ms as f64 / 1e3)
            }
        }
    }

    struct Setup {
        g: Geometry,
        arenas: Arc<CudaArenas>,
        registry: Vec<Box<dyn Any + Send + Sync>>,
        _map: MmapMut,
        region: PoolRegion,
        alias: u64,
        stream: u64,
        contiguous: u64,
    }

    impl Setup {
        fn backend(&mut self, o: CudaOptions) -> CudaBackend {
            let mut b = CudaBackend::new(0, &self.g, self.arenas.binding().clone(), o).unwrap();
            // SAFETY: the registry is dropped (field order in Setup: before the mapping).
            unsafe { b.bind_region(self.region, &mut self.registry).unwrap() };
            b
        }
        fn batch(&self, n: usize) -> Vec<CopyPair> {
            // Pages spread over the arena in a scrambled order; slots 0..n.
            (0..n).map(|i| CopyPair::new(((i * 97) % self.g.pages() as usize) as u64, i as u32)).collect()
        }
        /// (dst, src, bytes) of every chunk of a batch.
        fn chunks(&self, n: usize, dir: Direction) -> (Vec<u64>, Vec<u64>, Vec<usize>) {
            let (mut d, mut s, mut z) = (Vec::new(), Vec::new(), Vec::new());
            let bases = self.arenas.binding().bases();
            for p in self.batch(n) {
                for (a, (spec, off)) in self.g.arenas().iter().zip(self.g.chunk_offsets()).enumerate() {
                    let gpu = bases[a] + p.gpu_page * spec.page_stride;
                    let host = self.alias + p.slot as u64 * self.g.slot_bytes() + off;
                    let (dst, src) = if dir == Direction::Save { (host, gpu) } else { (gpu, host) };
                    d.push(dst);
                    s.push(src);
                    z.push(spec.bytes_per_page as usize);
                }
            }
            (d, s, z)
        }
    }

    fn setup() -> Setup {
        let g = Geometry::preset("glm52", 1024).unwrap();
        let arenas = CudaArenas::new(0, &g, CudaOptions::default()).unwrap();
        let bytes = g.slot_bytes() * MAX_BLOCKS as u64;
        let mut map = MmapMut::map_anon(bytes as usize).unwrap();
        map.iter_mut().step_by(4096).for_each(|b| *b = 1);
        let region = PoolRegion {
            host_base: map.as_mut_ptr() as usize,
            bytes,
            slot_bytes: g.slot_bytes(),
            capacity: MAX_BLOCKS as u32,
        };
        let pages: Vec<u64> = (0..g.pages()).collect();
        let keys: Vec<ContentKey> = pages.iter().map(|&p| ContentKey([p as u8 ^ 0x5a; 16])).collect();
        kvtier::copy::EngineArenas::fill(&arenas, &pages, &keys).unwrap();
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let mut contiguous = 0u64;
        // SAFETY: driver setup calls on the bound device.
        unsafe {
            kvtier::cuda::raw::bind_device(0).unwrap();
            ok("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut contiguous, bytes as usize));
        }
        let mut s =
            Setup { g, arenas, registry: Vec::new(), _map: map, region, alias: 0, stream: stream as u64, contiguous };
        let b = s.backend(CudaOptions::default());
        s.alias = b.pool_alias().unwrap();
        s
    }

    fn memcpy_batch(s: &Setup, n: usize, dir: Direction) {
        let (mut d, mut src, mut z) = s.chunks(n, dir);
        let dev = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE, id: 0 };
        let host = sys::CUmemLocation { type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST, id: 0 };
        let (sl, dl) = if dir == Direction::Save { (dev, host) } else { (host, dev) };
        let mut attr = sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: sl,
            dstLocHint: dl,
            flags: 0,
        };
        let mut idx = 0usize;
        // SAFETY: every range lies inside the arenas or the registered pool (CUDA 13 signature, no
        // failIdx).
        unsafe {
            ok(
                "cuMemcpyBatchAsync_v2",
                sys::cuMemcpyBatchAsync_v2(
                    d.as_mut_ptr(),
                    src.as_mut_ptr(),
                    z.as_mut_ptr(),
                    d.len(),
                    &mut attr,
                    &mut idx,
                    1,
                    s.stream as _,
                ),
            )
        };
    }

    fn memcpy_each(s: &Setup, n: usize, dir: Direction) {
        let (d, src, z) = s.chunks(n, dir);
        for i in 0..d.len() {
            // SAFETY: as above.
            unsafe { ok("cuMemcpyAsync", sys::cuMemcpyAsync(d[i], src[i], z[i], s.stream as _)) };
        }
    }

    fn contiguous(s: &Setup, n: usize, dir: Direction) {
        let bytes = n * s.g.slot_bytes() as usize;
        let (d, src) = if dir == Direction::Save { (s.alias, s.contiguous) } else { (s.contiguous, s.alias) };
        // SAFETY: both buffers hold MAX_BLOCKS slots.
        unsafe { ok("cuMemcpyAsync", sys::cuMemcpyAsync(d, src, bytes, s.stream as _)) };
    }

    /// Queues one batch; the timer's end event, recorded next on the backend's stream, marks its
    /// completion, and the returned completion is dropped (waited) after that.
    fn run_backend(b: &CudaBackend, batch: &[CopyPair], dir: Direction) -> Option<Box<dyn Completion>> {
        // SAFETY: the benchmark owns every slot and page; batches of one direction are serialised.
        let c = unsafe {
            match dir {
                Direction::Save => b.save(batch, WaitFor::Nothing),
                Direction::Restore => b.restore(batch, WaitFor::Nothing),
            }
        };
        Some(c.unwrap())
    }

    /// A staged backend's label: CTAs, first piece, unroll and priority when not the defaults.
    fn staged_label(o: &CudaOptions) -> String {
        let d = CudaOptions::default();
        let mut l = format!("staged_{}cta_f{}k", o.staged_ctas, o.staged_first_piece_bytes >> 10);
        if o.staged_unroll != d.staged_unroll {
            l += &format!("_u{}", o.staged_unroll);
        }
        if !o.high_priority {
            l += "_lowprio";
        }
        l
    }

    fn staged_opts(ctas: u32, first_kib: u64, unroll: u32, high: bool) -> CudaOptions {
        CudaOptions {
            mode: CopyMode::Staged,
            staged_ctas: ctas,
            staged_first_piece_bytes: first_kib << 10,
            staged_unroll: unroll,
            high_priority: high,
            ..Default::default()
        }
    }

    pub fn main() {
        // KVT_EXPLORE=1: a short sweep of staged-mode variants (CTAs, first piece, unroll, stream
        // priority) at 1, 8 and 43 blocks instead of the full table.
        let explore = std::env::var_os("KVT_EXPLORE").is_some();
        let mut c = Criterion::default().configure_from_args();
        let mut s = setup();
        let timer = Timer::new();
        let block = s.g.block_bytes();
        let zc_ctas: &[u32] = if explore { &[4] } else { &[1, 2, 4, 8, 16] };
        let kvt: Vec<(u32, CudaBackend)> = zc_ctas
            .iter()
            .map(|&ctas| {
                let o =
                    CudaOptions { save_ctas: ctas, restore_ctas: ctas, mode: CopyMode::ZeroCopy, ..Default::default() };
                (ctas, s.backend(o))
            })
            .collect();
        let d = CudaOptions::default();
        let staged_set: Vec<CudaOptions> = if explore {
            let mut v = Vec::new();
            for ctas in [4, 8, 16] {
                for first in [128, 512, 4096] {
                    v.push(staged_opts(ctas, first, 8, true));
                }
            }
            v.push(staged_opts(8, 256, 4, true));
            v.push(staged_opts(8, 256, 8, true));
            v
        } else {
            vec![CudaOptions { mode: CopyMode::Staged, ..d }]
        };
        let staged: Vec<(String, CudaBackend)> = staged_set.iter().map(|o| (staged_label(o), s.backend(*o))).collect();
        let auto = s.backend(d);
        println!("device: {}", kvt[0].1.device_description());
        println!("defaults: {d:?}");
        let blocks: &[usize] = if explore { &[1, 8, 43] } else { &BLOCKS };
        for dir in [Direction::Save, Direction::Restore] {
            let name = if dir == Direction::Save { "save" } else { "restore" };
            let mut group = c.benchmark_group(format!("glm52_{name}"));
            for &n in blocks {
                let batch = s.batch(n);
                group.throughput(Throughput::Bytes(n as u64 * block));
                let mut timed = |id: BenchmarkId, stream: u64, f: &dyn Fn() -> Option<Box<dyn Completion>>| {
                    group.bench_function(id, |bch| {
                        bch.iter_custom(|iters| (0..iters).map(|_| timer.time(stream, stream, f)).sum())
                    });
                };
                for (ctas, b) in &kvt {
                    let st = b.stream(dir);
                    timed(BenchmarkId::new(format!("kvtier_{ctas}cta"), n), st, &|| run_backend(b, &batch, dir));
                }
                for (label, b) in &staged {
                    timed(BenchmarkId::new(label, n), b.stream(dir), &|| run_backend(b, &batch, dir));
                }
                if !explore {
                    timed(BenchmarkId::new("auto_default", n), auto.stream(dir), &|| run_backend(&auto, &batch, dir));
                    timed(BenchmarkId::new("memcpy_per_chunk", n), s.stream, &|| {
                        memcpy_each(&s, n, dir);
                        None
                    });
                    timed(BenchmarkId::new("memcpy_batch", n), s.stream, &|| {
                        memcpy_batch(&s, n, dir);
                        None
                    });
                }
                timed(BenchmarkId::new("contiguous", n), s.stream, &|| {
                    contiguous(&s, n, dir);
                    None
                });
            }
            group.finish();
        }
        let staged_both: Vec<(String, &CudaBackend)> = if explore {
            staged
                .iter()
                .filter(|(l, _)| l.contains("f512k") || l.contains("f128k") || l.ends_with("_u4"))
                .map(|(l, b)| (l.clone(), b))
                .collect()
        } else {
            staged.iter().map(|(l, b)| (l.clone(), b)).collect()
        };
        both_ways(&mut c, &s, &kvt, &staged_both, &timer, if explore { &[43] } else { &[43, 128] });
        let mut probe_runs: Vec<(String, CudaBackend)> = Vec::new();
        let prios: &[bool] = &[true, false];
        for &high in prios {
            let sets: Vec<CudaOptions> = if explore {
                vec![
                    staged_opts(4, 256, 8, high),
                    staged_opts(8, 256, 8, high),
                    staged_opts(16, 256, 8, high),
                    staged_opts(8, 256, 4, high),
                ]
            } else {
                let mut v = vec![CudaOptions { mode: CopyMode::Staged, high_priority: high, ..d }];
                if high {
                    v.push(CudaOptions { mode: CopyMode::Staged, staged_ctas: 16, ..d });
                }
                v
            };
            for o in sets {
                probe_runs.push((staged_label(&o), s.backend(o)));
            }
            for &ctas in if explore { &[4u32][..] } else { &[2u32, 4, 8][..] } {
                let o = CudaOptions { restore_ctas: ctas, mode: CopyMode::ZeroCopy, high_priority: high, ..d };
                let l = format!("zero-copy {ctas} CTAs{}", if high { "" } else { ", low priority" });
                probe_runs.push((l, s.backend(o)));
            }
        }
        interference(&s, &probe_runs);
        drop(probe_runs);
        drop(kvt);
        drop(staged);
        drop(auto);
        s.registry.clear();
    }

    /// Save n blocks and restore n other blocks at once (separate slots and pages).
    fn both_ways(
        c: &mut Criterion,
        s: &Setup,
        kvt: &[(u32, CudaBackend)],
        staged: &[(String, &CudaBackend)],
        timer: &Timer,
        sizes: &[usize],
    ) {
        let mut group = c.benchmark_group("glm52_save_and_restore");
        let block = s.g.block_bytes();
        // A second stream for the contiguous H2D copy beside the contiguous D2H one.
        let mut s2: sys::CUstream = std::ptr::null_mut();
        // SAFETY: plain stream creation on the bound device.
        unsafe { ok("cuStreamCreate", sys::cuStreamCreate(&mut s2, 1)) };
        for &n in sizes {
            let save: Vec<CopyPair> = s.batch(n);
            let rest: Vec<CopyPair> = (0..n)
                .map(|i| CopyPair::new((512 + i * 3) as u64 % s.g.pages(), (MAX_BLOCKS - 1 - i) as u32))
                .collect();
            group.throughput(Throughput::Bytes(2 * n as u64 * block));
            let runs = kvt.iter().filter(|(c, _)| *c <= 8).map(|(c, b)| (format!("kvtier_{c}cta"), b));
            let bytes = n * s.g.slot_bytes() as usize;
            group.bench_function(BenchmarkId::new("contiguous", n), |bch| {
                bch.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            timer.time(s.stream, s.stream, || {
                                // SAFETY: disjoint halves of the pool and of the device buffer;
                                // the H2D copy starts with the timer and the end waits for it.
                                unsafe {
                                    let half = (MAX_BLOCKS / 2) as u64 * s.g.slot_bytes();
                                    ok("cuStreamWaitEvent", sys::cuStreamWaitEvent(s2, timer.start, 0));
                                    ok(
                                        "cuMemcpyAsync",
                                        sys::cuMemcpyAsync(s.alias, s.contiguous, bytes, s.stream as _),
                                    );
                                    ok(
                                        "cuMemcpyAsync",
                                        sys::cuMemcpyAsync(s.contiguous + half, s.alias + half, bytes, s2),
                                    );
                                    ok("cuEventRecord", sys::cuEventRecord(timer.end, s2));
                                    ok("cuStreamWaitEvent", sys::cuStreamWaitEvent(s.stream as _, timer.end, 0));
                                }
                            })
                        })
                        .sum()
                })
            });
            for (id, b) in runs.chain(staged.iter().map(|(l, b)| (l.clone(), *b))) {
                group.bench_function(BenchmarkId::new(id, n), |bch| {
                    bch.iter_custom(|iters| {
                        (0..iters)
                            .map(|_| {
                                let (ss, rs) = (b.stream(Direction::Save), b.stream(Direction::Restore));
                                timer.time(ss, ss, || {
                                    // The restore starts with the save (waits on the timer's start).
                                    // SAFETY: disjoint slots and pages, owned by the benchmark.
                                    let (a, r) = unsafe {
                                        (
                                            b.save(&save, WaitFor::Nothing).unwrap(),
                                            b.restore(&rest, WaitFor::CudaEvent(timer.start as u64)).unwrap(),
                                        )
                                    };
                                    // End on the save stream after both: make it wait for the restore.
                                    // SAFETY: live stream and event.
                                    unsafe {
                                        ok(
                                            "cuStreamWaitEvent",
                                            sys::cuStreamWaitEvent(ss as _, r.cuda_event().unwrap() as _, 0),
                                        )
                                    };
                                    let _ = rs;
                                    (a, r)
                                })
                            })
                            .sum()
                    })
                });
            }
        }
        group.finish();
    }

    /// A compute-bound probe kernel alone, then while restores of 43 blocks run back to back on the
    /// backend; prints the probe's slowdown and the restores' GB/s during it.
    fn interference(s: &Setup, runs: &[(String, CudaBackend)]) {
        let sms = kvtier::cuda::raw::bind_device(0).unwrap();
        let mut probe_stream: sys::CUstream = std::ptr::null_mut();
        let mut out = 0u64;
        let t = Timer::new();
        let t2 = Timer::new();
        // SAFETY: setup calls.
        unsafe {
            ok("cuStreamCreate", sys::cuStreamCreate(&mut probe_stream, 1));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut out, 4));
        }
        let ps = probe_stream as u64;
        // Half occupancy (4 x 256 threads per SM), so copy CTAs can co-reside like they would next to
        // an engine's kernels; 20 launches of a few ms.
        let probe = || {
            for _ in 0..20 {
                kvtier::cuda::raw::launch_probe(0, ps, sms * 4, out, 200_000, sms * 4).unwrap();
            }
        };
        let alone: Vec<f64> = (0..3).map(|_| t.time(ps, ps, probe).as_secs_f64()).collect();
        let alone = alone.iter().cloned().fold(f64::MAX, f64::min);
        println!(
            "\ninterference: compute probe alone {:.3} ms ({} SMs, {} CTAs x 256 threads x 20 launches)",
            alone * 1e3,
            sms,
            sms * 4
        );
        println!("| restores | probe with restores (ms) | probe slowdown | restore GB/s meanwhile |");
        println!("|---|---|---|---|");
        let batch = s.batch(43);
        let bytes = 43.0 * s.g.block_bytes() as f64;
        for (ctas, b) in runs {
            let rs = b.stream(Direction::Restore);
            let restored = 12usize;
            let mut pending = Vec::new();
            // SAFETY: live events and streams; the benchmark owns the slots and pages.
            let (with, copy_time) = unsafe {
                ok("cuEventRecord", sys::cuEventRecord(t2.start, rs as _));
                for _ in 0..restored {
                    pending.push(b.restore(&batch, WaitFor::Nothing).unwrap());
                }
                ok("cuEventRecord", sys::cuEventRecord(t2.end, rs as _));
                ok("cuEventRecord", sys::cuEventRecord(t.start, ps as _));
                probe();
                ok("cuEventRecord", sys::cuEventRecord(t.end, ps as _));
                ok("cuEventSynchronize", sys::cuEventSynchronize(t.end));
                ok("cuEventSynchronize", sys::cuEventSynchronize(t2.end));
                let (mut m1, mut m2) = (0f32, 0f32);
                ok("cuEventElapsedTime", sys::cuEventElapsedTime_v2(&mut m1, t.start, t.end));
                ok("cuEventElapsedTime", sys::cuEventElapsedTime_v2(&mut m2, t2.start, t2.end));
                (Duration::from_secs_f64(m1 as f64 / 1e3), Duration::from_secs_f64(m2 as f64 / 1e3))
            };
            drop(pending);
            let gbs = restored as f64 * bytes / copy_time.as_secs_f64() / 1e9;
            println!(
                "| {ctas} | {:.3} | {:+.2}% | {:.1} |",
                with.as_secs_f64() * 1e3,
                (with.as_secs_f64() / alone - 1.0) * 100.0,
                gbs
            );
        }
        // SAFETY: teardown of what this function created.
        unsafe {
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(probe_stream));
            let _ = sys::cuMemFree_v2(out);
            let _ = sys::cuStreamDestroy_v2(probe_stream);
        }
        let _ = std::ptr::null::<c_void>();
    }
}
