//! An engine that owns its KV arenas and its CUDA stream, and uses kvtier only for the host tier:
//! it allocates one device buffer per arena with cudarc, binds their device pointers
//! (`ArenaBinding` + `CudaBackend::new`), attaches the backend to a `HostTier`, saves pages after
//! the work its compute stream queued on them (`WaitFor::CudaStream`), restores them into other
//! pages, and orders its compute stream on the restore's CUDA event (`CopyHandle::stream_wait`)
//! with no host synchronisation in between. It then reads the arenas back and checks every
//! restored byte. Runs on a machine with an NVIDIA GPU (feature `cuda`):
//!
//! ```text
//! cargo run --release --features cuda --example engine_stream
//! cargo run --release --features cuda --example engine_stream -- --reserved-sms 8
//! ```
//!
//! With `--reserved-sms N` the copy kernels run in a green context of N SMs (rounded up to the
//! device's granularity); an engine that wants its own kernels kept off those SMs launches them on
//! streams of `CudaBackend::sm_partition()` (this example only copies on its stream).

use cudarc::driver::{CudaContext, CudaSlice, DevicePtr};
use kvtier::{ArenaBinding, ContentKey, Geometry, HostTier, TierConfig, WaitFor};
use kvtier::{CudaBackend, CudaOptions};
use std::time::{Duration, Instant};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    if !kvtier::cuda_available() {
        eprintln!("engine_stream needs an NVIDIA GPU with its driver and NVRTC; none found");
        std::process::exit(2);
    }
    let reserved_sms = match std::env::args().skip_while(|a| a != "--reserved-sms").nth(1) {
        Some(n) => n.parse::<u32>().map_err(|e| format!("--reserved-sms: {e}"))?,
        None => 0,
    };
    // Llama-3-8B's layout: 64 arenas (K and V of 32 layers), 32,768 B per 16-token page.
    let pages = 256u64;
    let g = Geometry::preset("llama3-8b", pages)?;

    // The engine's own CUDA setup (cudarc, the device's primary context, which kvtier also uses).
    let ctx = CudaContext::new(0)?;
    // SAFETY: this engine orders its work itself: every use of the arenas is on `compute`, and
    // kvtier's copies are ordered against it with events (WaitFor and stream_wait below).
    unsafe { ctx.disable_event_tracking() };
    let compute = ctx.new_stream()?;
    let mut arenas: Vec<CudaSlice<u8>> =
        g.arenas().iter().map(|a| compute.alloc_zeros::<u8>(a.extent() as usize)).collect::<Result<_, _>>()?;
    let bases: Vec<u64> = arenas.iter().map(|a| a.device_ptr(&compute).0).collect();
    let binding = ArenaBinding::new(&g, bases)?;

    let options = CudaOptions { reserved_sms, ..Default::default() };
    let backend = CudaBackend::new(0, &g, binding, options)?;
    println!("device: {}; copy kernels: {:?}", backend.device_description(), backend.isolation());
    let tier = HostTier::new(TierConfig::new(g.clone(), 64 * g.slot_bytes()))?;
    let rank = tier.attach(Box::new(backend))?;

    // "Prefill": the compute stream writes 32 pages of every arena (here a host-to-device copy of
    // known bytes; in an engine, the attention kernels).
    let ns = tier.namespace();
    let n = 32usize;
    let src: Vec<u64> = (0..n as u64).map(|i| i * 3).collect();
    let keys: Vec<ContentKey> = (0..n).map(|i| ns.key_from_bytes(format!("request-7/block-{i}").as_bytes())).collect();
    for (a, (spec, arena)) in g.arenas().iter().zip(arenas.iter_mut()).enumerate() {
        let mut host = vec![0u8; spec.extent() as usize];
        for (&p, k) in src.iter().zip(&keys) {
            let at = (p * spec.page_stride) as usize;
            kvtier::pattern::fill(k, a, &mut host[at..at + spec.bytes_per_page as usize]);
        }
        compute.memcpy_htod(&host, arena)?;
    }

    // Save after everything queued on the compute stream so far (the pages' writers).
    let stream = compute.cu_stream() as u64;
    let saved = rank.save(&keys, &src, WaitFor::CudaStream(stream))?;
    saved.handle.wait()?;
    println!("saved {} blocks ({} B)", saved.handle.blocks(), saved.handle.bytes());

    // The engine reuses the pages: the compute stream clears every arena.
    for arena in arenas.iter_mut() {
        compute.memset_zeros(arena)?;
    }

    // Admission: look the prefix up, restore it into other pages after the compute stream's
    // queued work (the clearing above stands for the old pages' last readers), and make the
    // compute stream wait for the restore on the device.
    let lease = tier.query(&keys);
    assert_eq!(lease.len(), n, "every saved block is resident");
    let dst: Vec<u64> = (0..n as u64).map(|i| pages - 1 - i * 5).collect();
    let t0 = Instant::now();
    let restore = rank.restore(&lease, &dst, WaitFor::CudaStream(stream))?;
    restore.stream_wait(stream)?;
    let queued = t0.elapsed();

    // Work queued on the compute stream from here on sees the restored pages. Reading the arenas
    // back is such work (and the first host synchronisation).
    let mut checked = 0usize;
    for (a, (spec, arena)) in g.arenas().iter().zip(&arenas).enumerate() {
        let host = compute.clone_dtoh(arena)?;
        for (&p, k) in dst.iter().zip(&keys) {
            let at = (p * spec.page_stride) as usize;
            if let Some(b) = kvtier::pattern::first_mismatch(k, a, &host[at..at + spec.bytes_per_page as usize]) {
                return Err(format!("page {p}, arena {}, byte {b}: not the saved bytes", spec.name).into());
            }
            checked += spec.bytes_per_page as usize;
        }
    }
    restore.wait()?;
    println!(
        "restored {} blocks ({} B): queued in {:.1} us, copy latency {:.1} us; {checked} B checked on the compute \
         stream: equal",
        restore.blocks(),
        restore.bytes(),
        queued.as_secs_f64() * 1e6,
        restore.latency().unwrap_or_default().as_secs_f64() * 1e6,
    );

    // Teardown: the rank (with its backend) drains and goes before the arenas are freed.
    rank.shutdown(Duration::from_secs(10))?;
    drop(tier);
    drop(arenas);
    Ok(())
}
