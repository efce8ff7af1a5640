//! Pool set-up cost: map + prefault (+ register with the CUDA driver) a pool of `--bytes`, with
//! reserved hugetlb pages and with transparent hugepages, against one `cuMemHostAlloc` of the same
//! size (feature `cuda`). Times are wall-clock seconds of one run each.
//!
//! ```text
//! cargo run --release --features cuda --example pool_setup -- --bytes 32GiB --reserve-hugepages
//! ```

use clap::Parser;
use kvtier::{BackingChoice, Geometry, HostPool, PoolConfig};
use std::time::Instant;

#[derive(Parser)]
#[command(about = "Time to map, prefault and register a host pool, against cuMemHostAlloc")]
struct Args {
    /// Pool size (e.g. 32GiB).
    #[arg(long, default_value = "32GiB")]
    bytes: String,
    /// Reserve the hugetlb pages first (root); without it the hugetlb row is skipped unless enough
    /// pages are already reserved.
    #[arg(long)]
    reserve_hugepages: bool,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let bytes = kvtier::parse_bytes(&args.bytes).map_err(|e| format!("--bytes {e}"))?;
    let geometry = Geometry::preset("glm52", 1)?;
    let pages_needed = bytes.div_ceil(2 << 20);
    if args.reserve_hugepages {
        std::fs::write("/proc/sys/vm/nr_hugepages", pages_needed.to_string())
            .map_err(|e| format!("reserving {pages_needed} hugepages (needs root): {e}"))?;
    }
    println!(
        "pool of {bytes} B ({:.1} GiB), glm52 slots of {} B; hugetlb pages free: {}",
        bytes as f64 / (1u64 << 30) as f64,
        geometry.slot_bytes(),
        kvtier::hugetlb_free_pages(None)
    );
    println!("{:<28} {:>10} {:>12} {:>10} {:>10}", "method", "map s", "prefault s", "register s", "total s");
    for (name, backing) in
        [("HostPool hugetlb", BackingChoice::HugeTlb), ("HostPool THP", BackingChoice::TransparentHuge)]
    {
        let t = Instant::now();
        let cfg = PoolConfig::new(bytes).with_backing(backing);
        let pool = match HostPool::new(geometry.slot_bytes(), &cfg) {
            Ok(p) => p,
            Err(e) => {
                println!("{name:<28} skipped: {e}");
                continue;
            }
        };
        let map_s = t.elapsed().as_secs_f64();
        drop(pool);
        // Prefault timed separately: map again with prefault on.
        let t = Instant::now();
        let pool = HostPool::new(geometry.slot_bytes(), &cfg.clone().with_prefault(true))?;
        let mapped_prefaulted = t.elapsed().as_secs_f64();
        let reg_s = register(&pool, &geometry)?;
        println!(
            "{name:<28} {map_s:>10.3} {:>12.3} {:>10} {:>10.3}",
            mapped_prefaulted - map_s,
            reg_s.map_or("n/a".to_string(), |r| format!("{r:.3}")),
            mapped_prefaulted + reg_s.unwrap_or(0.0)
        );
    }
    if let Some(s) = host_alloc(bytes)? {
        println!("{:<28} {:>10} {:>12} {:>10} {s:>10.3}", "cuMemHostAlloc (one call)", "", "", "");
    }
    if args.reserve_hugepages {
        std::fs::write("/proc/sys/vm/nr_hugepages", "0")?;
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn register(pool: &HostPool, geometry: &Geometry) -> Result<Option<f64>, Box<dyn std::error::Error>> {
    let arenas = kvtier::CudaArenas::new(0, geometry, kvtier::CudaOptions::default())?;
    let mut backend = kvtier::EngineArenas::backend(&arenas)?;
    let t = Instant::now();
    backend.bind_pool(pool)?;
    Ok(Some(t.elapsed().as_secs_f64()))
}

#[cfg(not(feature = "cuda"))]
fn register(_pool: &HostPool, _geometry: &Geometry) -> Result<Option<f64>, Box<dyn std::error::Error>> {
    Ok(None)
}

#[cfg(feature = "cuda")]
fn host_alloc(bytes: u64) -> Result<Option<f64>, Box<dyn std::error::Error>> {
    use cudarc::driver::sys;
    kvtier::internals::cuda::bind_device(0)?;
    let mut p: *mut std::ffi::c_void = std::ptr::null_mut();
    let t = Instant::now();
    // SAFETY: p is a valid out-pointer; the allocation is freed below and never used otherwise.
    kvtier::internals::cuda::ck("cuMemHostAlloc", unsafe {
        sys::cuMemHostAlloc(&mut p, bytes as usize, sys::CU_MEMHOSTALLOC_PORTABLE | sys::CU_MEMHOSTALLOC_DEVICEMAP)
    })?;
    let s = t.elapsed().as_secs_f64();
    // SAFETY: p came from cuMemHostAlloc above and nothing references it.
    kvtier::internals::cuda::ck("cuMemFreeHost", unsafe { sys::cuMemFreeHost(p) })?;
    Ok(Some(s))
}

#[cfg(not(feature = "cuda"))]
fn host_alloc(_bytes: u64) -> Result<Option<f64>, Box<dyn std::error::Error>> {
    Ok(None)
}
