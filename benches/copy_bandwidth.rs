//! Save (D2H) and restore (H2D) of GLM-5.2 blocks on one GPU, every path side by side in one run,
//! with ratios against the same run's contiguous copy:
//!
//! - `glm52_save`, `glm52_restore` (1 to 256 blocks): the zero-copy kernel at 1-16 CTAs, the
//!   staged mode, the default (`auto_default`), one `cuMemcpyAsync` per chunk, `cuMemcpyBatchAsync`
//!   over all chunks, and one contiguous copy of the same byte count (the link's ceiling);
//! - `small_save`, `small_restore` (the one-block group, with 8 blocks): zero copy, staged, staged
//!   with a zero-copy head of several sizes, the default, contiguous;
//! - `glm52_save_and_restore`: save and restore at once, against two contiguous copies at once,
//!   also with the copy kernels in an SM partition;
//! - `interference_compute`, `interference_decode`: an engine stand-in (a compute-bound probe, and
//!   a memory-bound decode-shaped probe that streams HBM on every SM) alone and while restores run
//!   back to back, for each restore path: staged, zero copy, copy engine only, each with and without
//!   SM isolation (green contexts, the probe in the engine's partition) and stream priorities;
//!   criterion's time is the probe's time per launch, the summary table adds the restores' GB/s;
//! - a diagnostic table: the staged path's HBM scatter kernel alone and beside the compute probe;
//! - `layers_save`, `layers_restore` (8, 43 and 256 blocks): layer-wise copies
//!   (`kvtier`) at 78 groups (one per GLM-5.2 layer), 8 groups and 1 group, beside
//!   the whole-block default and the contiguous copy, so the cost of per-layer readiness shows in
//!   GB/s;
//! - `layer_signal` (a table, no criterion group): a CUDA event per layer group against a counter
//!   the engine's stream waits on with `cuStreamWaitValue32`, on the same stand-in copy: each
//!   one's cost to the copy (GB/s) and its release latency on the engine's stream.
//!   `COPY_BANDWIDTH_LAYERS_ONLY=1` runs these two alone.
//!
//! Times come from CUDA events recorded around the work on the stream that does it (throughput over
//! completion, not submission). GB = 10^9 B. The summary tables at the end (medians of the same
//! samples criterion saw) hold the ratios.
//!
//! `cargo bench --features cuda --bench copy_bandwidth` on a machine with an NVIDIA GPU (a
//! criterion filter selects groups, e.g. `-- 'small_|interference'`); without the feature this is
//! an empty program.

#[cfg(not(feature = "cuda"))]
fn main() {}

#[cfg(feature = "cuda")]
fn main() {
    imp::main()
}

#[cfg(feature = "cuda")]
mod imp {
    use criterion::measurement::WallTime;
    use criterion::{BenchmarkGroup, BenchmarkId, Criterion, SamplingMode, Throughput};
    use cudarc::driver::sys;
    use kvtier::internals::cuda::ck;
    use kvtier::{Completion, ContentKey, CopyBackend, CopyPair, Direction, Geometry, PoolRegion, WaitFor};
    use kvtier::{CopyMode, CudaArenas, CudaBackend, CudaOptions, EngineStream, Isolation};
    use memmap2::MmapMut;
    use std::any::Any;
    use std::cell::RefCell;
    use std::collections::BTreeMap;
    use std::sync::Arc;
    use std::time::Duration;

    const BLOCKS: [usize; 5] = [1, 8, 43, 128, 256];
    const MAX_BLOCKS: usize = 256;
    /// Batch sizes of the layer-wise group.
    const LAYER_BLOCKS: [usize; 3] = [8, 43, 256];
    /// SMs reserved for the copy kernels in the isolated rows.
    const RESERVED_SMS: u32 = 8;
    /// Restores queued back to back in an interference run, 43 blocks each (1.19 GB).
    const RESTORES: usize = 8;
    /// The decode-shaped probe streams this many bytes per launch.
    const DECODE_BYTES: u64 = 1 << 30;

    fn ok(call: &'static str, r: sys::CUresult) {
        ck(call, r).unwrap_or_else(|e| panic!("{e}"));
    }

    fn timing_event() -> sys::CUevent {
        let mut e = std::ptr::null_mut();
        // SAFETY: plain event creation with timing, on the current (bound) context.
        unsafe { ok("cuEventCreate", sys::cuEventCreate(&mut e, 0)) };
        e
    }

    fn record(e: sys::CUevent, stream: u64) {
        // SAFETY: live event and stream.
        unsafe { ok("cuEventRecord", sys::cuEventRecord(e, stream as _)) };
    }

    fn sync(e: sys::CUevent) {
        // SAFETY: live event.
        unsafe { ok("cuEventSynchronize", sys::cuEventSynchronize(e)) };
    }

    /// Seconds from `a` to `b` (both recorded and complete).
    fn secs(a: sys::CUevent, b: sys::CUevent) -> f64 {
        let mut ms = 0f32;
        // SAFETY: live, completed timing events.
        unsafe { ok("cuEventElapsedTime", sys::cuEventElapsedTime_v2(&mut ms, a, b)) };
        ms as f64 / 1e3
    }

    /// Per-iteration seconds of every benchmark, by label, for the ratio tables.
    #[derive(Default)]
    struct Record(RefCell<BTreeMap<String, Vec<f64>>>);

    impl Record {
        fn add(&self, label: &str, v: f64) {
            self.0.borrow_mut().entry(label.to_string()).or_default().push(v);
        }
        fn median(&self, label: &str) -> Option<f64> {
            let m = self.0.borrow();
            let v = m.get(label)?;
            let mut v = v.clone();
            v.sort_by(|a, b| a.total_cmp(b));
            (!v.is_empty()).then(|| v[v.len() / 2])
        }
    }

    struct Timer {
        start: sys::CUevent,
        end: sys::CUevent,
    }

    impl Timer {
        fn new() -> Self {
            Timer { start: timing_event(), end: timing_event() }
        }
        /// Records start on `s`, runs `f` (which queues work), records end on `e_stream`, waits for
        /// it, then drops what `f` returned (completions: waited on after the end event); returns
        /// the elapsed device time.
        fn time<T>(&self, s: u64, e_stream: u64, f: impl FnOnce() -> T) -> Duration {
            record(self.start, s);
            let keep = f();
            record(self.end, e_stream);
            sync(self.end);
            drop(keep);
            Duration::from_secs_f64(secs(self.start, self.end))
        }
        /// One criterion benchmark `id`/`n` of `group`: each iteration is `f` timed on `stream`
        /// with device events, also recorded under `group_name/id/n` for the ratio tables.
        #[allow(clippy::too_many_arguments)]
        fn bench(
            &self,
            group: &mut BenchmarkGroup<'_, WallTime>,
            rec: &Record,
            group_name: &str,
            id: &str,
            n: usize,
            stream: u64,
            f: &dyn Fn() -> Option<Box<dyn Completion>>,
        ) {
            let label = format!("{group_name}/{id}/{n}");
            group.bench_function(BenchmarkId::new(id, n), |bch| {
                bch.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            let t = self.time(stream, stream, f);
                            rec.add(&label, t.as_secs_f64());
                            t
                        })
                        .sum()
                })
            });
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
        sms: u32,
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
        let keys: Vec<ContentKey> = pages.iter().map(|&p| ContentKey::from_bytes([p as u8 ^ 0x5a; 16])).collect();
        kvtier::EngineArenas::fill(&arenas, &pages, &keys).unwrap();
        let sms = kvtier::internals::cuda::bind_device(0).unwrap();
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let mut contiguous = 0u64;
        // SAFETY: driver setup calls on the bound device.
        unsafe {
            ok("cuStreamCreate", sys::cuStreamCreate(&mut stream, 1));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut contiguous, bytes as usize));
        }
        let mut s = Setup {
            g,
            arenas,
            registry: Vec::new(),
            _map: map,
            region,
            alias: 0,
            stream: stream as u64,
            contiguous,
            sms,
        };
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

    fn staged(first_kib: u64, head_kib: u64) -> CudaOptions {
        CudaOptions {
            mode: CopyMode::Staged,
            staged_first_piece_bytes: first_kib << 10,
            save_head_bytes: head_kib << 10,
            restore_head_bytes: head_kib << 10,
            ..Default::default()
        }
    }

    fn zero_copy(ctas: u32) -> CudaOptions {
        CudaOptions { save_ctas: ctas, restore_ctas: ctas, mode: CopyMode::ZeroCopy, ..Default::default() }
    }

    fn dir_name(dir: Direction) -> &'static str {
        if dir == Direction::Save {
            "save"
        } else {
            "restore"
        }
    }

    pub fn main() {
        let mut c = Criterion::default().configure_from_args();
        let mut s = setup();
        let rec = Record::default();
        let timer = Timer::new();
        let d = CudaOptions::default();
        let auto = s.backend(d);
        println!("device: {}", auto.device_description());
        println!("defaults: {d:?}");
        layer_groups(&mut c, &mut s, &rec, &timer, &auto);
        layer_signal(&mut s);
        if std::env::var_os("COPY_BANDWIDTH_LAYERS_ONLY").is_some() {
            drop(auto);
            s.registry.clear();
            return;
        }
        hbm_kernel_beside_probe(&mut s);
        interference(&mut c, &mut s, &rec);
        small_groups(&mut c, &mut s, &rec, &timer, &auto);
        both_ways(&mut c, &mut s, &rec, &timer);
        table_groups(&mut c, &mut s, &rec, &timer, &auto);
        drop(auto);
        s.registry.clear();
    }

    /// The full tables: every path at 1-256 blocks, both directions.
    fn table_groups(c: &mut Criterion, s: &mut Setup, rec: &Record, timer: &Timer, auto: &CudaBackend) {
        let block = s.g.block_bytes();
        let kvt: Vec<(u32, CudaBackend)> = [1, 2, 4, 8, 16].iter().map(|&n| (n, s.backend(zero_copy(n)))).collect();
        let staged_b = s.backend(CudaOptions { mode: CopyMode::Staged, ..Default::default() });
        for dir in [Direction::Save, Direction::Restore] {
            let group_name = format!("glm52_{}", dir_name(dir));
            let mut group = c.benchmark_group(&group_name);
            for &n in &BLOCKS {
                let batch = s.batch(n);
                group.throughput(Throughput::Bytes(n as u64 * block));
                let mut timed = |id: &str, stream: u64, f: &dyn Fn() -> Option<Box<dyn Completion>>| {
                    timer.bench(&mut group, rec, &group_name, id, n, stream, f)
                };
                for (ctas, b) in &kvt {
                    timed(&format!("kvtier_{ctas}cta"), b.stream(dir), &|| run_backend(b, &batch, dir));
                }
                timed("staged", staged_b.stream(dir), &|| run_backend(&staged_b, &batch, dir));
                timed("auto_default", auto.stream(dir), &|| run_backend(auto, &batch, dir));
                timed("memcpy_per_chunk", s.stream, &|| {
                    memcpy_each(s, n, dir);
                    None
                });
                timed("memcpy_batch", s.stream, &|| {
                    memcpy_batch(s, n, dir);
                    None
                });
                timed("contiguous", s.stream, &|| {
                    contiguous(s, n, dir);
                    None
                });
            }
            group.finish();
        }
        ratio_table(rec, "glm52", &BLOCKS);
    }

    /// Layer-wise saves and restores at 78, 8 and 1 groups against the whole-block default.
    fn layer_groups(c: &mut Criterion, s: &mut Setup, rec: &Record, timer: &Timer, auto: &CudaBackend) {
        use kvtier::internals::copy_layers;
        let block = s.g.block_bytes();
        let groups: Vec<(u32, kvtier::LayerGroups)> =
            [78u32, 8, 1].iter().map(|&n| (n, kvtier::LayerGroups::new(&s.g, n).unwrap())).collect();
        for dir in [Direction::Save, Direction::Restore] {
            let group_name = format!("layers_{}", dir_name(dir));
            let mut group = c.benchmark_group(&group_name);
            for &n in &LAYER_BLOCKS {
                let batch = s.batch(n);
                group.throughput(Throughput::Bytes(n as u64 * block));
                let mut timed = |id: &str, stream: u64, f: &dyn Fn() -> Option<Box<dyn Completion>>| {
                    timer.bench(&mut group, rec, &group_name, id, n, stream, f)
                };
                timed("whole_default", auto.stream(dir), &|| run_backend(auto, &batch, dir));
                for (k, lg) in &groups {
                    timed(&format!("layers_{k}"), auto.stream(dir), &|| {
                        // SAFETY: as run_backend: the benchmark owns every slot and page.
                        Some(unsafe { copy_layers(auto, dir, &batch, lg, &[WaitFor::Nothing]) }.unwrap())
                    });
                }
                timed("contiguous", s.stream, &|| {
                    contiguous(s, n, dir);
                    None
                });
            }
            group.finish();
        }
        ratio_table(rec, "layers", &LAYER_BLOCKS);
    }

    /// How a copy tells an engine stream that a layer group is in place, the two ways that cost no
    /// launch, on the same stand-in copy: the restore's bytes of [`MAX_BLOCKS`] GLM-5.2 blocks as
    /// `groups` contiguous host-to-device copies on one stream, each followed by its signal; a
    /// second stream (the engine's) waits for every group's signal in turn.
    ///
    /// - `event`: `cuEventRecord` of a timing-free event per group on the copy stream,
    ///   `cuStreamWaitEvent` on the engine's (what `CopyHandle::wait_layer` does);
    /// - `counter`: `cuStreamWriteValue32(word, g + 1)` on the copy stream, `cuStreamWaitValue32(word
    ///   >= g + 1)` on the engine's, one 4-byte device word per copy;
    /// - `none`: the same copies with no signal (the copy stream's baseline).
    ///
    /// Printed per mechanism and group count: the copy's GB/s with signals and no timing events
    /// inside it (the signal's cost to the copy), and the release latency, from a timing event
    /// recorded on the copy stream after group `g`'s bytes to one recorded on the engine's stream
    /// after its wait for group `g` (median and largest over every group of 20 runs).
    fn layer_signal(s: &mut Setup) {
        const RUNS: usize = 20;
        kvtier::internals::cuda::bind_device(0).unwrap();
        let bytes = MAX_BLOCKS * s.g.slot_bytes() as usize;
        let mut engine: sys::CUstream = std::ptr::null_mut();
        let mut word = 0u64;
        // SAFETY: setup on the bound device.
        unsafe {
            ok("cuStreamCreate", sys::cuStreamCreate(&mut engine, 1));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut word, 4));
        }
        let engine = engine as u64;
        let copy = s.stream;
        let (start, end) = (timing_event(), timing_event());
        println!("\n## layer_signal: event per group against a counter (stream memory operations), {bytes} B restored in groups");
        println!(
            "| signal | groups | copy GB/s (no timing events inside) | release latency median | release latency max |"
        );
        println!("|---|---:|---:|---:|---:|");
        for groups in [78usize, 32, 8] {
            let chunk = bytes / groups;
            let signals: Vec<sys::CUevent> = (0..groups)
                .map(|_| {
                    let mut e = std::ptr::null_mut();
                    // SAFETY: event creation on the bound context.
                    unsafe {
                        ok(
                            "cuEventCreate",
                            sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32),
                        )
                    };
                    e
                })
                .collect();
            let after_copy: Vec<sys::CUevent> = (0..groups).map(|_| timing_event()).collect();
            let after_wait: Vec<sys::CUevent> = (0..groups).map(|_| timing_event()).collect();
            for mech in ["none", "event", "counter"] {
                // Queues one run; `timed` adds the two timing events per group. The counter only
                // grows (run `r`'s group `g` writes `base + g + 1`), so no reset has to be ordered
                // before the engine's next waits.
                let queue = |timed: bool, base: u32| -> Result<(), String> {
                    // SAFETY: the word and buffers are live; every range lies inside the
                    // `contiguous` buffer and the pool alias (both MAX_BLOCKS slots).
                    unsafe {
                        record(start, copy);
                        for g in 0..groups {
                            let off = (g * chunk) as u64;
                            ok(
                                "cuMemcpyAsync",
                                sys::cuMemcpyAsync(s.contiguous + off, s.alias + off, chunk, copy as _),
                            );
                            if timed {
                                record(after_copy[g], copy);
                            }
                            match mech {
                                "event" => {
                                    record(signals[g], copy);
                                    ok("cuStreamWaitEvent", sys::cuStreamWaitEvent(engine as _, signals[g], 0));
                                }
                                "counter" => {
                                    let v = base + g as u32 + 1;
                                    ck("cuStreamWriteValue32", sys::cuStreamWriteValue32_v2(copy as _, word, v, 0))
                                        .map_err(|e| e.to_string())?;
                                    let geq = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;
                                    ck("cuStreamWaitValue32", sys::cuStreamWaitValue32_v2(engine as _, word, v, geq))
                                        .map_err(|e| e.to_string())?;
                                }
                                _ => {}
                            }
                            if timed {
                                record(after_wait[g], engine);
                            }
                        }
                        record(end, copy);
                    }
                    Ok(())
                };
                let mut rates = Vec::new();
                let mut lat = Vec::new();
                let mut failed = None;
                // The word starts at 0 for each mechanism's runs.
                // SAFETY: live word; nothing waits on it now (both streams were synchronised).
                unsafe {
                    ok("cuMemsetD32", sys::cuMemsetD32_v2(word, 0, 1));
                    ok("cuCtxSynchronize", sys::cuCtxSynchronize());
                }
                for run in 0..2 * RUNS + 2 {
                    let timed = run % 2 == 1;
                    if let Err(e) = queue(timed, (run * groups) as u32) {
                        failed = Some(e);
                        break;
                    }
                    sync(end);
                    // SAFETY: live stream.
                    unsafe { ok("cuStreamSynchronize", sys::cuStreamSynchronize(engine as _)) };
                    if run < 2 {
                        continue; // warm-up
                    }
                    if timed {
                        if mech != "none" {
                            lat.extend((0..groups).map(|g| secs(after_copy[g], after_wait[g])));
                        }
                    } else {
                        rates.push((chunk * groups) as f64 / secs(start, end) / 1e9);
                    }
                }
                if let Some(e) = failed {
                    // What the failed run had queued finishes before its events and word go.
                    // SAFETY: plain context synchronisation on the bound context.
                    unsafe { ok("cuCtxSynchronize", sys::cuCtxSynchronize()) };
                    println!("| {mech} | {groups} | not supported here: {e} | | |");
                    continue;
                }
                rates.sort_by(|a, b| a.total_cmp(b));
                lat.sort_by(|a, b| a.total_cmp(b));
                let (med, max) = if lat.is_empty() {
                    ("-".to_string(), "-".to_string())
                } else {
                    (format!("{:.1} us", lat[lat.len() / 2] * 1e6), format!("{:.1} us", lat[lat.len() - 1] * 1e6))
                };
                println!("| {mech} | {groups} | {:.2} | {med} | {max} |", rates[rates.len() / 2]);
            }
            for e in signals.into_iter().chain(after_copy).chain(after_wait) {
                // SAFETY: both streams are synchronised; nothing uses the event any more.
                unsafe { ok("cuEventDestroy", sys::cuEventDestroy_v2(e)) };
            }
        }
        // SAFETY: both streams (and, after a failure, the context) are synchronised above.
        unsafe {
            ok("cuEventDestroy", sys::cuEventDestroy_v2(start));
            ok("cuEventDestroy", sys::cuEventDestroy_v2(end));
            ok("cuMemFree", sys::cuMemFree_v2(word));
            ok("cuStreamDestroy", sys::cuStreamDestroy_v2(engine as _));
        }
    }

    /// The one-block group (1 and 8 blocks): zero copy, staged, staged with a zero-copy head.
    fn small_groups(c: &mut Criterion, s: &mut Setup, rec: &Record, timer: &Timer, auto: &CudaBackend) {
        let block = s.g.block_bytes();
        let variants: Vec<(String, CudaBackend)> = vec![
            ("zero_copy_2cta".into(), s.backend(zero_copy(2))),
            ("zero_copy_4cta".into(), s.backend(zero_copy(4))),
            ("staged_f512k".into(), s.backend(staged(512, 0))),
            ("staged_h512k_f512k".into(), s.backend(staged(512, 512))),
            ("staged_h512k_f1m".into(), s.backend(staged(1024, 512))),
            ("staged_h256k_f4m".into(), s.backend(staged(4096, 256))),
            ("staged_h1m_f1m".into(), s.backend(staged(1024, 1024))),
            ("staged_h512k_f4m".into(), s.backend(staged(4096, 512))),
            ("staged_h1m_f4m".into(), s.backend(staged(4096, 1024))),
        ];
        for dir in [Direction::Save, Direction::Restore] {
            let group_name = format!("small_{}", dir_name(dir));
            let mut group = c.benchmark_group(&group_name);
            for n in [1usize, 8] {
                let batch = s.batch(n);
                group.throughput(Throughput::Bytes(n as u64 * block));
                let mut timed = |id: &str, stream: u64, f: &dyn Fn() -> Option<Box<dyn Completion>>| {
                    timer.bench(&mut group, rec, &group_name, id, n, stream, f)
                };
                timed("contiguous", s.stream, &|| {
                    contiguous(s, n, dir);
                    None
                });
                timed("auto_default", auto.stream(dir), &|| run_backend(auto, &batch, dir));
                for (id, b) in &variants {
                    timed(id, b.stream(dir), &|| run_backend(b, &batch, dir));
                }
            }
            group.finish();
        }
        ratio_table(rec, "small", &[1, 8]);
    }

    /// Median time and % of the contiguous copy of every `{prefix}_{dir}/{id}/{n}` recorded.
    fn ratio_table(rec: &Record, prefix: &str, sizes: &[usize]) {
        for dir in ["save", "restore"] {
            let group = format!("{prefix}_{dir}/");
            let ids: Vec<String> = {
                let m = rec.0.borrow();
                let mut ids: Vec<String> = m
                    .keys()
                    .filter_map(|k| k.strip_prefix(&group))
                    .filter_map(|k| k.rsplit_once('/').map(|(id, _)| id.to_string()))
                    .collect();
                ids.dedup();
                ids
            };
            if ids.is_empty() {
                continue;
            }
            println!("\n{prefix} {dir}: median time, time / contiguous (lower is better), % of contiguous throughput");
            println!("| path | {} |", sizes.iter().map(|n| format!("{n} blocks")).collect::<Vec<_>>().join(" | "));
            println!("|---|{}", "---|".repeat(sizes.len()));
            for id in &ids {
                let cells: Vec<String> = sizes
                    .iter()
                    .map(|n| {
                        let t = rec.median(&format!("{group}{id}/{n}"));
                        let base = rec.median(&format!("{group}contiguous/{n}"));
                        match (t, base) {
                            (Some(t), Some(b)) => {
                                format!("{:.1} us, {:.3}x, {:.1}%", t * 1e6, t / b, b / t * 100.0)
                            }
                            (Some(t), None) => format!("{:.1} us", t * 1e6),
                            _ => "-".into(),
                        }
                    })
                    .collect();
                println!("| {id} | {} |", cells.join(" | "));
            }
        }
    }

    /// Save n blocks and restore n other blocks at once (separate slots and pages), against two
    /// contiguous copies at once (D2H and H2D on two streams: the two-way ceiling).
    fn both_ways(c: &mut Criterion, s: &mut Setup, rec: &Record, timer: &Timer) {
        let d = CudaOptions::default();
        let iso = CudaOptions { reserved_sms: RESERVED_SMS, ..d };
        let runs: Vec<(String, CudaBackend)> = vec![
            ("kvtier_4cta".into(), s.backend(zero_copy(4))),
            ("kvtier_8cta".into(), s.backend(zero_copy(8))),
            ("staged".into(), s.backend(CudaOptions { mode: CopyMode::Staged, ..d })),
            ("auto_default".into(), s.backend(d)),
            ("isolated_auto_default".into(), s.backend(iso)),
            (
                "isolated_staged_h512k".into(),
                s.backend(CudaOptions { reserved_sms: RESERVED_SMS, ..staged(1024, 512) }),
            ),
            ("staged_pieces16".into(), s.backend(CudaOptions { mode: CopyMode::Staged, staged_piece_blocks: 16, ..d })),
            ("staged_h512k_f1m".into(), s.backend(staged(1024, 512))),
            ("staged_h512k_f4m".into(), s.backend(staged(4096, 512))),
        ];
        println!("\nisolated backend: {:?}", runs[4].1.isolation());
        let mut group = c.benchmark_group("glm52_save_and_restore");
        let block = s.g.block_bytes();
        let mut s2: sys::CUstream = std::ptr::null_mut();
        // SAFETY: plain stream creation on the bound device.
        unsafe { ok("cuStreamCreate", sys::cuStreamCreate(&mut s2, 1)) };
        let sizes = [43usize, 128];
        for &n in &sizes {
            let save: Vec<CopyPair> = s.batch(n);
            let rest: Vec<CopyPair> = (0..n)
                .map(|i| CopyPair::new((512 + i * 3) as u64 % s.g.pages(), (MAX_BLOCKS - 1 - i) as u32))
                .collect();
            group.throughput(Throughput::Bytes(2 * n as u64 * block));
            let bytes = n * s.g.slot_bytes() as usize;
            let label = format!("both/contiguous/{n}");
            group.bench_function(BenchmarkId::new("contiguous", n), |bch| {
                bch.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| {
                            let t = timer.time(s.stream, s.stream, || {
                                // SAFETY: disjoint halves of the pool and of the device buffer; the
                                // H2D copy starts with the timer and the end waits for it.
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
                            });
                            rec.add(&label, t.as_secs_f64());
                            t
                        })
                        .sum()
                })
            });
            for (id, b) in &runs {
                let label = format!("both/{id}/{n}");
                group.bench_function(BenchmarkId::new(id, n), |bch| {
                    bch.iter_custom(|iters| {
                        (0..iters)
                            .map(|_| {
                                let ss = b.stream(Direction::Save);
                                let t = timer.time(ss, ss, || {
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
                                    (a, r)
                                });
                                rec.add(&label, t.as_secs_f64());
                                t
                            })
                            .sum()
                    })
                });
            }
        }
        group.finish();
        println!("\nsave and restore at once: aggregate GB/s (2 x n blocks), % of the two contiguous copies at once");
        println!("| path | {} |", sizes.iter().map(|n| format!("{n} blocks each way")).collect::<Vec<_>>().join(" | "));
        println!("|---|{}", "---|".repeat(sizes.len()));
        for id in std::iter::once("contiguous").chain(runs.iter().map(|(id, _)| id.as_str())) {
            let cells: Vec<String> = sizes
                .iter()
                .map(|&n| {
                    let bytes = 2.0 * n as f64 * block as f64;
                    match (rec.median(&format!("both/{id}/{n}")), rec.median(&format!("both/contiguous/{n}"))) {
                        (Some(t), Some(b)) => format!("{:.1} GB/s, {:.1}%", bytes / t / 1e9, b / t * 100.0),
                        _ => "-".into(),
                    }
                })
                .collect();
            println!("| {id} | {} |", cells.join(" | "));
        }
    }

    /// An engine stand-in: the compute or decode-shaped probe on a stream of the whole device or of
    /// an engine partition, sized to that side's SMs, with its launch-boundary timing events.
    struct Probe {
        decode: bool,
        stream: u64,
        sms: u32,
        full_sms: u32,
        out: u64,
        buf: u64,
        events: Vec<sys::CUevent>,
        launches: usize,
    }

    impl Probe {
        /// Queues `self.launches` launches with an event before each and after the last.
        fn queue(&self) {
            for i in 0..self.launches {
                record(self.events[i], self.stream);
                if self.decode {
                    kvtier::internals::cuda::launch_decode_probe(
                        0,
                        self.stream,
                        self.sms * 8,
                        self.buf,
                        DECODE_BYTES,
                        self.out,
                    )
                    .unwrap();
                } else {
                    // The same total work on any number of SMs: 64 items per CTA of the whole GPU.
                    let items = self.full_sms * 4 * 16;
                    kvtier::internals::cuda::launch_probe(0, self.stream, self.sms * 4, self.out, 12_500, items)
                        .unwrap();
                }
            }
            record(self.events[self.launches], self.stream);
        }
        /// Seconds of launch `i`.
        fn launch_secs(&self, i: usize) -> f64 {
            secs(self.events[i], self.events[i + 1])
        }
        /// Mean seconds per launch alone (launches 2.. of one run).
        fn alone(&self) -> f64 {
            self.queue();
            sync(self.events[self.launches]);
            let v: Vec<f64> = (2..self.launches).map(|i| self.launch_secs(i)).collect();
            v.iter().sum::<f64>() / v.len() as f64
        }
    }

    /// A restore path of the interference runs.
    enum Path<'a> {
        Backend(&'a CudaBackend),
        CopyEngineBatch,
        Contiguous,
    }

    struct Outcome {
        /// Mean seconds per probe launch over the launches inside the restore window.
        per_launch: f64,
        /// Restore GB/s over the window.
        gbs: f64,
        /// Probe launches inside the window.
        inside: usize,
    }

    /// The probe, and once it runs, `RESTORES` restores of 43 blocks back to back; the probe's
    /// launches that lie inside the restores' window against the restores' rate.
    fn run_interference(s: &Setup, probe: &Probe, path: &Path<'_>, window: (sys::CUevent, sys::CUevent)) -> Outcome {
        let batch = s.batch(43);
        let stream = match path {
            Path::Backend(b) => b.stream(Direction::Restore),
            _ => s.stream,
        };
        probe.queue();
        sync(probe.events[2]);
        record(window.0, stream);
        let mut pending = Vec::new();
        for _ in 0..RESTORES {
            match path {
                Path::Backend(b) => pending.push(run_backend(b, &batch, Direction::Restore)),
                Path::CopyEngineBatch => memcpy_batch(s, 43, Direction::Restore),
                Path::Contiguous => contiguous(s, 43, Direction::Restore),
            }
        }
        record(window.1, stream);
        sync(window.1);
        sync(probe.events[probe.launches]);
        drop(pending);
        let t0 = probe.events[0];
        let (w0, w1) = (secs(t0, window.0), secs(t0, window.1));
        let inside: Vec<f64> = (0..probe.launches)
            .filter(|&i| secs(t0, probe.events[i]) >= w0 && secs(t0, probe.events[i + 1]) <= w1)
            .map(|i| probe.launch_secs(i))
            .collect();
        if secs(t0, probe.events[probe.launches]) < w1 {
            eprintln!("warning: the probe ended before the restores");
        }
        let bytes = (RESTORES * 43) as f64 * s.g.block_bytes() as f64;
        Outcome {
            per_launch: inside.iter().sum::<f64>() / inside.len().max(1) as f64,
            gbs: bytes / (w1 - w0) / 1e9,
            inside: inside.len(),
        }
    }

    /// The interference groups: each probe alone (whole device, engine partition) and beside
    /// restores of every path.
    fn interference(c: &mut Criterion, s: &mut Setup, rec: &Record) {
        let d = CudaOptions::default();
        let iso = |o: CudaOptions| CudaOptions { reserved_sms: RESERVED_SMS, ..o };
        let paths: Vec<(String, CudaBackend)> = vec![
            ("staged".into(), s.backend(CudaOptions { mode: CopyMode::Staged, ..d })),
            (
                "staged_low_priority".into(),
                s.backend(CudaOptions { mode: CopyMode::Staged, high_priority: false, ..d }),
            ),
            ("zero_copy_4cta".into(), s.backend(zero_copy(4))),
            ("auto_default".into(), s.backend(d)),
            ("isolated_staged".into(), s.backend(iso(CudaOptions { mode: CopyMode::Staged, ..d }))),
            ("isolated_zero_copy_4cta".into(), s.backend(iso(zero_copy(4)))),
            ("isolated_auto_default".into(), s.backend(iso(d))),
            ("isolated_staged_h512k_f1m".into(), s.backend(iso(staged(1024, 512)))),
        ];
        let part = match paths[4].1.isolation() {
            Isolation::GreenContext { .. } => paths[4].1.sm_partition(),
            other => {
                println!("\ninterference: no SM isolation on this machine ({other:?}); isolated rows run unisolated");
                None
            }
        };
        let engine: Option<EngineStream> = part.as_ref().map(|p| p.engine_stream(false).unwrap());
        kvtier::internals::cuda::bind_device(0).unwrap();
        let mut probe_stream: sys::CUstream = std::ptr::null_mut();
        let (mut out, mut buf) = (0u64, 0u64);
        // SAFETY: setup calls on the bound device; the decode probe's buffer is filled once.
        unsafe {
            ok("cuStreamCreate", sys::cuStreamCreate(&mut probe_stream, 1));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut out, 16));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut buf, DECODE_BYTES as usize));
            ok("cuMemsetD32", sys::cuMemsetD32_v2(buf, 0x5a5a_1234, DECODE_BYTES as usize / 4));
            ok("cuCtxSynchronize", sys::cuCtxSynchronize());
        }
        let events: Vec<sys::CUevent> = (0..1024).map(|_| timing_event()).collect();
        let window = (timing_event(), timing_event());
        let (full, engine_sms) = (s.sms, part.as_ref().map_or(s.sms, |p| p.engine_sms()));
        let mut summary: Vec<(String, String, f64, f64, f64, usize)> = Vec::new();
        for decode in [false, true] {
            let kind = if decode { "decode" } else { "compute" };
            let make = |stream: u64, sms: u32, launches: usize| Probe {
                decode,
                stream,
                sms,
                full_sms: full,
                out,
                buf,
                events: events.clone(),
                launches,
            };
            // About 90 ms of probe per run: longer than the restores even at 25 GB/s.
            let per = make(probe_stream as u64, full, 8).alone();
            let launches = ((0.09 / per) as usize).clamp(8, events.len() - 1);
            let whole = make(probe_stream as u64, full, launches);
            let side = make(engine.as_ref().map_or(probe_stream as u64, |e| e.raw()), engine_sms, launches);
            println!(
                "\ninterference_{kind}: {launches} launches of {:.3} ms (whole device, {full} SMs); engine partition {engine_sms} SMs",
                per * 1e3
            );
            let mut group = c.benchmark_group(format!("interference_{kind}"));
            group.sample_size(10).sampling_mode(SamplingMode::Flat);
            group.warm_up_time(Duration::from_millis(300)).measurement_time(Duration::from_secs(1));
            for (id, p) in [("probe_alone", &whole), ("probe_alone_engine_partition", &side)] {
                let label = format!("{kind}/{id}");
                group.bench_function(id, |bch| {
                    bch.iter_custom(|iters| {
                        (0..iters)
                            .map(|_| {
                                let t = p.alone();
                                rec.add(&label, t);
                                Duration::from_secs_f64(t)
                            })
                            .sum()
                    })
                });
            }
            let mut rows: Vec<(String, Path<'_>, &Probe)> = vec![
                ("copy_engine_batch".into(), Path::CopyEngineBatch, &whole),
                ("contiguous".into(), Path::Contiguous, &whole),
            ];
            for (id, b) in &paths {
                let probe = if id.starts_with("isolated") { &side } else { &whole };
                rows.push((id.clone(), Path::Backend(b), probe));
            }
            for (id, path, probe) in &rows {
                let label = format!("{kind}/{id}");
                group.bench_function(id.as_str(), |bch| {
                    bch.iter_custom(|iters| {
                        (0..iters)
                            .map(|_| {
                                let o = run_interference(s, probe, path, window);
                                rec.add(&label, o.per_launch);
                                rec.add(&format!("{label}/gbs"), o.gbs);
                                rec.add(&format!("{label}/inside"), o.inside as f64);
                                Duration::from_secs_f64(o.per_launch)
                            })
                            .sum()
                    })
                });
            }
            group.finish();
            let alone_whole = rec.median(&format!("{kind}/probe_alone")).unwrap_or(f64::NAN);
            let alone_side = rec.median(&format!("{kind}/probe_alone_engine_partition")).unwrap_or(f64::NAN);
            for (id, _, probe) in &rows {
                let label = format!("{kind}/{id}");
                let Some(t) = rec.median(&label) else { continue };
                let own = if std::ptr::eq(*probe, &side) { alone_side } else { alone_whole };
                summary.push((
                    kind.into(),
                    id.clone(),
                    rec.median(&format!("{label}/gbs")).unwrap_or(f64::NAN),
                    (t / own - 1.0) * 100.0,
                    (t / alone_whole - 1.0) * 100.0,
                    rec.median(&format!("{label}/inside")).unwrap_or(0.0) as usize,
                ));
            }
            if !alone_whole.is_nan() && !alone_side.is_nan() {
                println!(
                    "{kind} probe alone: {:.3} ms per launch on {full} SMs, {:.3} ms on the engine partition's {engine_sms} ({:+.2}%)",
                    alone_whole * 1e3,
                    alone_side * 1e3,
                    (alone_side / alone_whole - 1.0) * 100.0
                );
            }
        }
        println!("\nrestores of 43 blocks back to back beside a probe (medians); slowdown of the probe's launches inside the restore window");
        println!("| probe | restore path | restore GB/s | probe slowdown vs alone on its SMs | vs alone on the whole device | launches in window |");
        println!("|---|---|---|---|---|---|");
        for (kind, id, gbs, own, whole, n) in &summary {
            println!("| {kind} | {id} | {gbs:.1} | {own:+.2}% | {whole:+.2}% | {n} |");
        }
        drop(engine);
        // SAFETY: teardown of what this function created (the probe stream drained first).
        unsafe {
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(probe_stream));
            let _ = sys::cuMemFree_v2(out);
            let _ = sys::cuMemFree_v2(buf);
            let _ = sys::cuStreamDestroy_v2(probe_stream);
        }
    }

    /// Why staged restores slow down beside the compute probe: the staged path's HBM scatter
    /// kernel (8 blocks, 8 CTAs) timed alone, beside the probe on the whole device, and in the copy
    /// partition with the probe in the engine partition.
    fn hbm_kernel_beside_probe(s: &mut Setup) {
        let d = CudaOptions::default();
        let plain = s.backend(d);
        let iso = s.backend(CudaOptions { reserved_sms: RESERVED_SMS, ..d });
        let part = iso.sm_partition();
        let engine = part.as_ref().map(|p| p.engine_stream(false).unwrap());
        let batch = s.batch(8);
        let staging: Vec<CopyPair> =
            batch.iter().enumerate().map(|(i, p)| CopyPair::new(p.gpu_page, i as u32)).collect();
        let mut out = 0u64;
        let mut probe_stream: sys::CUstream = std::ptr::null_mut();
        kvtier::internals::cuda::bind_device(0).unwrap();
        // SAFETY: setup on the bound device.
        unsafe {
            ok("cuStreamCreate", sys::cuStreamCreate(&mut probe_stream, 1));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut out, 16));
        }
        let buf = s.contiguous;
        let events: Vec<sys::CUevent> = (0..64).map(|_| timing_event()).collect();
        let (k0, k1) = (timing_event(), timing_event());
        let time_kernels = |b: &CudaBackend, probe: Option<(u64, u32)>| -> (f64, usize) {
            let stream = b.stream(Direction::Restore);
            let p = probe.map(|(ps, sms)| {
                let p = Probe {
                    decode: false,
                    stream: ps,
                    sms,
                    full_sms: s.sms,
                    out,
                    buf: 0,
                    events: events.clone(),
                    launches: 40,
                };
                p.queue();
                sync(p.events[2]);
                p
            });
            let mut v = Vec::new();
            for _ in 0..15 {
                record(k0, stream);
                // SAFETY: the staging buffer holds MAX_BLOCKS slots; the pages are the benchmark's.
                unsafe { b.launch_hbm_kernel(Direction::Restore, &staging, buf, stream, 8).unwrap() };
                record(k1, stream);
                sync(k1);
                v.push(secs(k0, k1));
            }
            let mut overlapped = v.len();
            if let Some(p) = &p {
                sync(p.events[p.launches]);
                // Kernels timed after the probe ended do not count as "beside".
                if secs(p.events[0], p.events[p.launches]) < secs(p.events[0], k1) {
                    overlapped = 0;
                }
            }
            v.sort_by(|a, b| a.total_cmp(b));
            (v[v.len() / 2], overlapped)
        };
        let alone = time_kernels(&plain, None);
        let beside = time_kernels(&plain, Some((probe_stream as u64, s.sms)));
        let isolated = match (&engine, &part) {
            (Some(e), Some(p)) => Some(time_kernels(&iso, Some((e.raw(), p.engine_sms())))),
            _ => None,
        };
        let bytes = 2.0 * 8.0 * s.g.block_bytes() as f64;
        println!("\nthe staged restore's HBM scatter kernel (8 blocks = 27.6 MB read + 27.6 MB written, 8 CTAs), median of 15");
        println!("| condition | kernel time | HBM GB/s (read + write) | timed while the probe ran |");
        println!("|---|---|---|---|");
        let row = |name: &str, (t, n): (f64, usize)| {
            println!("| {name} | {:.1} us | {:.0} | {n} of 15 |", t * 1e6, bytes / t / 1e9);
        };
        row("alone", alone);
        row("beside the compute probe (whole device)", beside);
        if let Some(r) = isolated {
            row("copy partition, probe in the engine partition", r);
        }
        drop(engine);
        // SAFETY: teardown of what this function created.
        unsafe {
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(probe_stream));
            let _ = sys::cuMemFree_v2(out);
            let _ = sys::cuStreamDestroy_v2(probe_stream);
        }
    }
}
