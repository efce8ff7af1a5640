//! Hybrid restores on one GPU against the link's ceiling and against an engine without cache
//! groups, at 4,096 tokens (256 blocks of 16 tokens):
//!
//! - `gemma3-27b`: `HybridRank::restore` of the full-attention group's 256 blocks and the sliding
//!   group's 64-block window (1,024 tokens), both groups' copies in flight at once; against
//!   (a) one contiguous `cuMemcpyHtoDAsync` of the same bytes from a pinned `cuMemHostAlloc`
//!   buffer, and (b) the restore an engine without groups does: every one of the 62 layers' 256
//!   blocks (one plain `Geometry` of all the layers' arenas, the sliding layers kept as full
//!   attention) through `HostTier` and `Rank::restore`, with its own contiguous copy beside it;
//! - `jamba-v0.1`: the full-attention group's 256 blocks and the one state checkpoint at the
//!   end, against a contiguous copy of the same bytes (an engine without groups moves the same
//!   bytes here: Jamba has no sliding layers, and its recurrent state is one checkpoint either
//!   way).
//!
//! Each contender's GPU pages are filled with the blocks' patterns and saved first; its first
//! restore lands in other GPU pages, overwritten beforehand, and is verified there on the GPU
//! (the contiguous copy: the bytes copied back and compared), so the timing is of a correct copy.
//! Then `HYBRID_COPY_WARMUP` (default 3) untimed and `HYBRID_COPY_ITERS` (default 20) timed
//! rounds, each round running every contender of the model once, in turn. A time is wall clock
//! from the submit to the host seeing the copy complete: `HybridRank::restore` to
//! `HybridRestore::wait` (each query before it, untimed), `Rank::restore` to `CopyHandle::wait`,
//! `cuMemcpyHtoDAsync` to `cuStreamSynchronize`. GB = 10^9 B. Copies use the default
//! `CudaOptions`; the host pools take the backing the tier chooses (printed).
//!
//! ```sh
//! cargo bench --features cuda --bench hybrid_copy
//! ```

use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier::cudarc::driver::sys;
use kvtier::internals::cuda::{bind_device, ck};
use kvtier::{
    ContentKey, CudaArenas, CudaOptions, EngineArenas, Geometry, GroupPages, HostTier, HybridConfig, HybridLayout,
    HybridRank, HybridTier, Rank, TierConfig, WaitFor,
};

/// Blocks of the restored prefix: 4,096 tokens of 16-token blocks.
const BLOCKS: usize = 256;

fn ok(call: &'static str, r: sys::CUresult) {
    ck(call, r).unwrap_or_else(|e| panic!("{e}"));
}

fn env_usize(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// Content keys of a chain of `n` blocks in namespace `ns`.
fn chain(ns: kvtier::Namespace, seed: u32, n: usize) -> Vec<ContentKey> {
    let mut keys: Vec<ContentKey> = Vec::with_capacity(n);
    for i in 0..n {
        let tokens: Vec<u32> = (0..16u32).map(|j| seed.wrapping_mul(7919) ^ (i as u32 * 16 + j)).collect();
        keys.push(ns.chain(keys.last(), &tokens));
    }
    keys
}

/// A hybrid preset on the GPU: a prefix of `BLOCKS` blocks saved, ready to restore into GPU
/// pages `BLOCKS..` of each group.
struct Hybrid {
    // The rank first: it shuts down before the tier and the arenas drop.
    rank: HybridRank,
    tier: HybridTier,
    arenas: Vec<Arc<CudaArenas>>,
    layout: HybridLayout,
    keys: Vec<ContentKey>,
    dst: Vec<Vec<u64>>,
}

impl Hybrid {
    fn new(name: &str) -> Hybrid {
        let layout = HybridLayout::preset(name, 2 * BLOCKS as u64).unwrap();
        let mut config = HybridConfig::new(layout.clone(), 0);
        for (g, t) in config.tiers.iter_mut().enumerate() {
            let geometry = layout.groups()[g].geometry.clone();
            // The blocks a restore at BLOCKS needs, and slack (a window's pool must hold one more).
            let slots = layout.needed(g, BLOCKS).len() as u64 + 4;
            *t = TierConfig::new(geometry.clone(), slots * geometry.slot_bytes());
        }
        let tier = HybridTier::new(config).unwrap();
        let arenas: Vec<Arc<CudaArenas>> =
            layout.groups().iter().map(|g| CudaArenas::new(0, &g.geometry, CudaOptions::default()).unwrap()).collect();
        let rank = tier.attach(arenas.iter().map(|a| a.backend().unwrap()).collect()).unwrap();
        let keys = chain(layout.namespace(), 1, BLOCKS);
        let mut pages = Vec::new();
        let mut dst = Vec::new();
        for (g, a) in arenas.iter().enumerate() {
            let need = layout.needed(g, BLOCKS);
            let src: Vec<u64> = (0..need.len() as u64).collect();
            a.fill(&src, &Self::group_keys(&layout, g, &keys[need.clone()])).unwrap();
            pages.push(GroupPages::new(need.start, src));
            dst.push((BLOCKS as u64..(BLOCKS + need.len()) as u64).collect());
        }
        rank.save(&keys, &pages, WaitFor::Nothing).unwrap().wait().unwrap();
        Hybrid { rank, tier, arenas, layout, keys, dst }
    }

    fn group_keys(layout: &HybridLayout, g: usize, keys: &[ContentKey]) -> Vec<ContentKey> {
        keys.iter().map(|k| layout.group_key(g, k)).collect()
    }

    /// Bytes one restore moves (every group's needed blocks).
    fn bytes(&self) -> u64 {
        self.layout.restore_bytes(BLOCKS)
    }

    /// One restore, timed from the submit to both groups' handles complete; returns the time and
    /// the bytes the handles moved.
    fn restore(&self) -> (Duration, u64) {
        let lease = self.tier.query(&self.keys);
        assert_eq!(lease.boundary(), BLOCKS, "{}: the saved prefix is a hit", self.layout.model());
        let t0 = Instant::now();
        let r = self.rank.restore(&lease, &self.dst, WaitFor::Nothing).unwrap();
        r.wait().unwrap();
        let t = t0.elapsed();
        (t, r.handles.iter().flatten().map(|h| h.bytes()).sum())
    }

    /// Overwrites the destination pages, restores once and verifies every group's pages.
    fn verify(&self) {
        let scrub = chain(self.layout.namespace(), 0xdead, BLOCKS);
        for (g, a) in self.arenas.iter().enumerate() {
            a.fill(&self.dst[g], &Self::group_keys(&self.layout, g, &scrub[..self.dst[g].len()])).unwrap();
        }
        let (_, bytes) = self.restore();
        assert_eq!(bytes, self.bytes(), "{}: bytes restored", self.layout.model());
        for (g, a) in self.arenas.iter().enumerate() {
            let need = self.layout.needed(g, BLOCKS);
            a.verify(&self.dst[g], &Self::group_keys(&self.layout, g, &self.keys[need])).unwrap();
        }
    }
}

/// An engine without cache groups: one geometry of every layer's arenas (Gemma-3's sliding
/// layers as full attention), every block of the prefix saved and restored in every layer.
struct AllLayers {
    rank: Rank,
    tier: HostTier,
    arenas: Arc<CudaArenas>,
    keys: Vec<ContentKey>,
    dst: Vec<u64>,
}

impl AllLayers {
    /// `layout`'s groups as one geometry, arenas ordered by model layer.
    fn new(layout: &HybridLayout) -> AllLayers {
        let mut arenas: Vec<(u32, kvtier::ArenaSpec)> = layout
            .groups()
            .iter()
            .flat_map(|g| g.geometry.layers().iter().copied().zip(g.geometry.arenas().iter().cloned()))
            .collect();
        arenas.sort_by_key(|(l, _)| *l);
        let layers = arenas.iter().map(|(l, _)| *l).collect();
        let model = format!("{} (every layer full attention)", layout.model());
        let geometry = Geometry::new(&model, layout.page_tokens(), arenas.into_iter().map(|(_, a)| a).collect())
            .unwrap()
            .with_layers(layers)
            .unwrap();
        let tier =
            HostTier::new(TierConfig::new(geometry.clone(), (BLOCKS as u64 + 4) * geometry.slot_bytes())).unwrap();
        let arenas = CudaArenas::new(0, &geometry, CudaOptions::default()).unwrap();
        let rank = tier.attach(arenas.backend().unwrap()).unwrap();
        let keys = chain(tier.namespace(), 1, BLOCKS);
        let src: Vec<u64> = (0..BLOCKS as u64).collect();
        arenas.fill(&src, &keys).unwrap();
        rank.save(&keys, &src, WaitFor::Nothing).unwrap().handle.wait().unwrap();
        AllLayers { rank, tier, arenas, keys, dst: (BLOCKS as u64..2 * BLOCKS as u64).collect() }
    }

    fn bytes(&self) -> u64 {
        BLOCKS as u64 * self.tier.geometry().slot_bytes()
    }

    fn restore(&self) -> (Duration, u64) {
        let lease = self.tier.query(&self.keys);
        assert_eq!(lease.len(), BLOCKS, "the saved prefix is a hit");
        let t0 = Instant::now();
        let h = self.rank.restore(&lease, &self.dst, WaitFor::Nothing).unwrap();
        h.wait().unwrap();
        (t0.elapsed(), h.bytes())
    }

    fn verify(&self) {
        self.arenas.fill(&self.dst, &chain(self.tier.namespace(), 0xdead, BLOCKS)).unwrap();
        let (_, bytes) = self.restore();
        assert_eq!(bytes, self.bytes());
        self.arenas.verify(&self.dst, &self.keys).unwrap();
    }
}

/// One pinned host buffer (`cuMemHostAlloc`) and one device buffer of `bytes` bytes, and a
/// non-blocking stream for the copy between them.
struct Contiguous {
    host: *mut c_void,
    dev: sys::CUdeviceptr,
    stream: sys::CUstream,
    bytes: usize,
}

impl Contiguous {
    fn new(bytes: u64) -> Contiguous {
        bind_device(0).unwrap();
        let bytes = bytes as usize;
        let (mut host, mut dev, mut stream) = (std::ptr::null_mut(), 0, std::ptr::null_mut());
        // SAFETY: plain allocations and stream creation on the device's primary context, bound
        // on this thread just above; every out-pointer is a live local.
        unsafe {
            ok("cuMemHostAlloc", sys::cuMemHostAlloc(&mut host, bytes, 0));
            ok("cuMemAlloc", sys::cuMemAlloc_v2(&mut dev, bytes));
            ok("cuStreamCreate", sys::cuStreamCreate(&mut stream, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32));
        }
        Contiguous { host, dev, stream, bytes }
    }

    fn host(&mut self) -> &mut [u8] {
        // SAFETY: `host` is a live pinned allocation of `bytes` bytes owned by self, and no copy
        // is in flight (every copy below is synchronised before it returns).
        unsafe { std::slice::from_raw_parts_mut(self.host as *mut u8, self.bytes) }
    }

    /// Copies `bytes` (at most the buffer's) host to device; returns the time from the submit to
    /// the stream's synchronisation.
    fn copy(&self, bytes: u64) -> Duration {
        assert!(bytes as usize <= self.bytes);
        bind_device(0).unwrap();
        let t0 = Instant::now();
        // SAFETY: both buffers hold `self.bytes >= bytes` bytes and outlive the copy, which is
        // synchronised before this returns.
        unsafe {
            ok("cuMemcpyHtoDAsync", sys::cuMemcpyHtoDAsync_v2(self.dev, self.host, bytes as usize, self.stream));
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(self.stream));
        }
        t0.elapsed()
    }

    /// A pattern in the first `bytes` host bytes, copied to the device, the host bytes zeroed,
    /// copied back, compared.
    fn verify(&mut self, bytes: u64) {
        let key = ContentKey::from_bytes([0x5a; 16]);
        let n = bytes as usize;
        kvtier::pattern::fill(&key, 0, &mut self.host()[..n]);
        self.copy(bytes);
        self.host()[..n].fill(0);
        // SAFETY: as in `copy`, the other way.
        unsafe {
            ok("cuMemcpyDtoHAsync", sys::cuMemcpyDtoHAsync_v2(self.host, self.dev, n, self.stream));
            ok("cuStreamSynchronize", sys::cuStreamSynchronize(self.stream));
        }
        if let Some(b) = kvtier::pattern::first_mismatch(&key, 0, &self.host()[..n]) {
            panic!("contiguous copy: byte {b} differs after the round trip");
        }
    }
}

impl Drop for Contiguous {
    fn drop(&mut self) {
        let _ = bind_device(0);
        // SAFETY: nothing is in flight (every copy was synchronised); the buffers and stream are
        // this struct's own and freed once.
        unsafe {
            let _ = sys::cuStreamDestroy_v2(self.stream);
            let _ = sys::cuMemFree_v2(self.dev);
            let _ = sys::cuMemFreeHost(self.host);
        }
    }
}

/// Times of one contender.
struct Row {
    model: &'static str,
    name: String,
    bytes: u64,
    times: Vec<f64>,
}

impl Row {
    fn new(model: &'static str, name: impl Into<String>, bytes: u64) -> Row {
        Row { model, name: name.into(), bytes, times: Vec::new() }
    }
    fn median(&self) -> f64 {
        let mut v = self.times.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    }
    fn min(&self) -> f64 {
        self.times.iter().copied().fold(f64::INFINITY, f64::min)
    }
    fn gbs(&self) -> f64 {
        self.bytes as f64 / self.median() / 1e9
    }
}

fn machine() {
    bind_device(0).unwrap();
    let mut name = [0 as std::ffi::c_char; 256];
    let (mut dev, mut driver, mut mem) = (0, 0, 0usize);
    // SAFETY: plain queries of device 0 into live locals; `name` holds 256 bytes.
    unsafe {
        ok("cuDeviceGet", sys::cuDeviceGet(&mut dev, 0));
        ok("cuDeviceGetName", sys::cuDeviceGetName(name.as_mut_ptr(), name.len() as i32, dev));
        ok("cuDriverGetVersion", sys::cuDriverGetVersion(&mut driver));
        ok("cuDeviceTotalMem", sys::cuDeviceTotalMem_v2(&mut mem, dev));
    }
    // SAFETY: the driver wrote a NUL-terminated string into `name`.
    let name = unsafe { std::ffi::CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
    println!(
        "device: {name}, {:.1} GiB, CUDA driver {}.{}; host: {} CPUs",
        mem as f64 / (1u64 << 30) as f64,
        driver / 1000,
        driver % 1000 / 10,
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (warmup, iters) = (env_usize("HYBRID_COPY_WARMUP", 3), env_usize("HYBRID_COPY_ITERS", 20).max(1));
    println!("command: {}", args.join(" "));
    machine();
    println!(
        "restore of {BLOCKS} blocks (4,096 tokens); {warmup} warm-up and {iters} timed rounds; wall clock from submit to \
         completion seen by the host; GB = 10^9 B; CudaOptions::default()"
    );
    let mut rows: Vec<Row> = Vec::new();

    // Gemma-3 27B: hybrid, all layers, and contiguous copies of each's bytes.
    {
        let hybrid = Hybrid::new("gemma3-27b");
        let all = AllLayers::new(&hybrid.layout);
        let mut contiguous = Contiguous::new(all.bytes().max(hybrid.bytes()));
        hybrid.verify();
        all.verify();
        contiguous.verify(hybrid.bytes());
        contiguous.verify(all.bytes());
        println!("gemma3-27b: every contender's restored bytes verified");
        for (g, group) in hybrid.layout.groups().iter().enumerate() {
            println!(
                "  group `{}`: {} blocks of {} B, host pool {:?}",
                group.name,
                hybrid.layout.needed(g, BLOCKS).len(),
                group.geometry.slot_bytes(),
                hybrid.tier.group(g).pool().backing()
            );
        }
        println!(
            "  all layers: {BLOCKS} blocks of {} B, host pool {:?}",
            all.tier.geometry().slot_bytes(),
            all.tier.pool().backing()
        );
        let (hb, ab) = (hybrid.bytes(), all.bytes());
        let mut r = [
            Row::new("gemma3-27b", "hybrid restore (full 256 + window 64)", hb),
            Row::new("gemma3-27b", "(a) contiguous, same bytes", hb),
            Row::new("gemma3-27b", "(b) all layers full (62 x 256 blocks)", ab),
            Row::new("gemma3-27b", "contiguous, (b)'s bytes", ab),
        ];
        for i in 0..warmup + iters {
            let t = [hybrid.restore().0, contiguous.copy(hb), all.restore().0, contiguous.copy(ab)];
            if i >= warmup {
                for (row, t) in r.iter_mut().zip(t) {
                    row.times.push(t.as_secs_f64());
                }
            }
        }
        rows.extend(r);
    }

    // Jamba-v0.1: hybrid against a contiguous copy of its bytes.
    {
        let hybrid = Hybrid::new("jamba-v0.1");
        let mut contiguous = Contiguous::new(hybrid.bytes());
        hybrid.verify();
        contiguous.verify(hybrid.bytes());
        println!("jamba-v0.1: every contender's restored bytes verified");
        for (g, group) in hybrid.layout.groups().iter().enumerate() {
            println!(
                "  group `{}`: {} blocks of {} B, host pool {:?}",
                group.name,
                hybrid.layout.needed(g, BLOCKS).len(),
                group.geometry.slot_bytes(),
                hybrid.tier.group(g).pool().backing()
            );
        }
        let hb = hybrid.bytes();
        let mut r = [
            Row::new("jamba-v0.1", "hybrid restore (full 256 + 1 checkpoint)", hb),
            Row::new("jamba-v0.1", "(a) contiguous, same bytes", hb),
        ];
        for i in 0..warmup + iters {
            let t = [hybrid.restore().0, contiguous.copy(hb)];
            if i >= warmup {
                for (row, t) in r.iter_mut().zip(t) {
                    row.times.push(t.as_secs_f64());
                }
            }
        }
        rows.extend(r);
    }

    println!();
    println!("| model | contender | bytes | median ms | min ms | GB/s (median) | of contiguous, same bytes |");
    println!("|---|---|---|---|---|---|---|");
    for row in &rows {
        // The contiguous copy of the same bytes in the same model.
        let base = rows.iter().find(|c| c.model == row.model && c.bytes == row.bytes && c.name.contains("contiguous"));
        let frac = base.map_or("-".to_string(), |b| format!("{:.1}%", row.gbs() / b.gbs() * 100.0));
        println!(
            "| {} | {} | {} | {:.3} | {:.3} | {:.1} | {frac} |",
            row.model,
            row.name,
            row.bytes,
            row.median() * 1e3,
            row.min() * 1e3,
            row.gbs()
        );
    }
    let (h, b) = (&rows[0], &rows[2]);
    println!();
    println!(
        "gemma3-27b at 4,096 tokens: the hybrid restore moves {:.1}% of (b)'s bytes and takes {:.3} ms against {:.3} ms: \
         {:.3} ms saved ({:.1}% of (b)'s time)",
        h.bytes as f64 / b.bytes as f64 * 100.0,
        h.median() * 1e3,
        b.median() * 1e3,
        (b.median() - h.median()) * 1e3,
        (1.0 - h.median() / b.median()) * 100.0
    );
    println!(
        "jamba-v0.1: no (b) row: without groups an engine moves the same bytes (no sliding layers, one checkpoint)"
    );
}
