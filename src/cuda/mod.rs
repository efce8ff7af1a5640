//! The CUDA copy backend (feature `cuda`).
//!
//! - [`CudaBackend`]: [`crate::CopyBackend`] over the hand-written gather (save, D2H) and scatter
//!   (restore, H2D) kernels of `cuda/kvtier_copy.cu`: one launch moves every arena of every block of
//!   a batch, reading and writing host slots through the device alias of the registered pool, or
//!   through an HBM staging buffer and the copy engine ([`CopyMode`]).
//! - SM isolation: with [`CudaOptions::reserved_sms`] the copy kernels run in a green context of a
//!   few SMs and [`CudaBackend::sm_partition`] hands the engine streams on the other SMs
//!   ([`SmPartition`], [`Isolation`]).
//! - [`CudaArenas`]: real HBM arenas for a geometry with pattern fill/verify kernels
//!   ([`crate::copy::EngineArenas`]), for replays, tests and benchmarks.
//! - [`cuda_available`]: whether this machine can run it (for `--backend auto`).
//!
//! The driver and NVRTC are loaded at run time (cudarc, dynamic loading), so this builds and the
//! crate runs on machines without CUDA; there every constructor returns
//! [`crate::CopyError::Unavailable`]. Kernels are compiled with NVRTC for the device's architecture
//! (`sm_XY` from its compute capability) at first use and cached per device. Driver failures are
//! [`crate::CopyError::Cuda`] (keeping the `CUresult`), compile failures
//! [`crate::CopyError::Nvrtc`].

mod arenas;
mod backend;
pub mod desc;
mod device;
mod green;

pub use arenas::{CudaArenas, PatternJob};
pub use backend::{CopyMode, CudaBackend, CudaOptions};
pub use device::{cuda_available, describe_driver_error, device_count, driver_error};
pub use green::{EngineStream, Isolation, SmPartition};

/// The cudarc crate this build uses: its types appear in [`crate::CopyError::Cuda`]
/// (`cudarc::driver::DriverError`, whose `.0` is the `CUresult`) and
/// [`crate::CopyError::Nvrtc`].
pub use cudarc;

/// Raw access for benchmarks and tests that compare the kernels against the driver's copy paths
/// and measure interference with stand-ins for an engine's kernels. Not a stable API.
#[doc(hidden)]
pub(crate) mod raw {
    pub use super::device::ck;
    use super::device::{launch_params, Ctx, Device, DeviceBuffer};
    use crate::error::CopyError;
    use std::ffi::c_void;

    /// Launches the compute probe (`kvt_compute_probe`: `items` items of `iters` dependent FMA
    /// pairs per thread, spread over the grid) on `grid` CTAs of 256 threads on `stream` (a raw
    /// `CUstream` of device `device`, also of an engine partition); `out` is a device address of 4
    /// writable bytes.
    ///
    /// # Errors
    /// Device errors.
    pub fn launch_probe(
        device: u32,
        stream: u64,
        grid: u32,
        out: u64,
        iters: u32,
        items: u32,
    ) -> Result<(), CopyError> {
        let d = Device::get(device)?;
        d.bind()?;
        let (mut o, mut i, mut n) = (out, iters, items);
        let mut p =
            [&mut o as *mut u64 as *mut c_void, &mut i as *mut u32 as *mut c_void, &mut n as *mut u32 as *mut c_void];
        // SAFETY: the probe takes (float*, unsigned, unsigned); p points at live values of those
        // types; `out` is the caller's 4-byte device buffer.
        unsafe { launch_params(d.kernels.probe, grid, 256, stream as _, &mut p) }
    }

    /// Launches the decode-shaped probe (`kvt_decode_probe`: streams `bytes` bytes from HBM at
    /// `buf`, a multiple of 16) on `grid` CTAs of 256 threads on `stream`; `out` as for
    /// [`launch_probe`].
    ///
    /// # Errors
    /// Device errors.
    pub fn launch_decode_probe(
        device: u32,
        stream: u64,
        grid: u32,
        buf: u64,
        bytes: u64,
        out: u64,
    ) -> Result<(), CopyError> {
        let d = Device::get(device)?;
        d.bind()?;
        let (mut b, mut n, mut o) = (buf, bytes / 16, out);
        let mut p =
            [&mut b as *mut u64 as *mut c_void, &mut n as *mut u64 as *mut c_void, &mut o as *mut u64 as *mut c_void];
        // SAFETY: the probe takes (const uint4*, unsigned long long, unsigned*); `buf` holds `bytes`
        // readable bytes (caller's contract).
        unsafe { launch_params(d.kernels.decode_probe, grid, 256, stream as _, &mut p) }
    }

    /// The SM each of `grid` CTAs (32 threads each, each holding its SM for about `hold_ns` ns)
    /// launched on `stream` ran on; synchronises the stream.
    ///
    /// # Errors
    /// Device errors.
    pub fn sm_ids(device: u32, stream: u64, grid: u32, hold_ns: u64) -> Result<Vec<u32>, CopyError> {
        let d = Device::get(device)?;
        let buf = DeviceBuffer::new(&d, grid as usize * 4)?;
        let (mut o, mut h) = (buf.ptr, hold_ns);
        let mut p = [&mut o as *mut u64 as *mut c_void, &mut h as *mut u64 as *mut c_void];
        // SAFETY: kvt_sm_ids takes (unsigned*, unsigned long long); buf holds `grid` words and is
        // freed only after the synchronisation below.
        unsafe {
            launch_params(d.kernels.sm_ids, grid, 32, stream as _, &mut p)?;
            cudarc::driver::result::stream::synchronize(stream as _).ctx("cuStreamSynchronize")?;
        }
        let mut ids = vec![0u32; grid as usize];
        // SAFETY: buf holds `grid` words written by the finished kernel.
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut ids, buf.ptr) }.ctx("cuMemcpyDtoH")?;
        Ok(ids)
    }

    /// Launches `kvt_spin_until` (one CTA of 32 threads) on `stream`: it runs until the `u32` at
    /// device address `flag` (host-mapped memory the host writes, e.g. `cuMemHostAlloc` with
    /// `DEVICEMAP`) is at least `value`, so work queued after it on `stream` waits for the host.
    /// For ordering tests: unlike a stream wait, a running kernel stalls no hardware queue.
    ///
    /// # Errors
    /// Device errors.
    pub fn spin_until(device: u32, stream: u64, flag: u64, value: u32) -> Result<(), CopyError> {
        let d = Device::get(device)?;
        d.bind()?;
        let (mut f, mut v) = (flag, value);
        let mut p = [&mut f as *mut u64 as *mut c_void, &mut v as *mut u32 as *mut c_void];
        // SAFETY: kvt_spin_until takes (const volatile unsigned*, unsigned); `flag` is a readable
        // device address of 4 bytes for as long as the kernel runs (caller's contract).
        unsafe { launch_params(d.kernels.spin_until, 1, 32, stream as _, &mut p) }
    }

    /// Makes device `device`'s primary context current on this thread (compiling the kernels on
    /// first use), returning its SM count.
    ///
    /// # Errors
    /// [`CopyError::Unavailable`] or device errors.
    pub fn bind_device(device: u32) -> Result<u32, CopyError> {
        let d = Device::get(device)?;
        d.bind()?;
        Ok(d.sm_count)
    }
}
