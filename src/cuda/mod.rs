//! The CUDA copy backend (feature `cuda`).
//!
//! - [`CudaBackend`]: [`crate::CopyBackend`] over the hand-written gather (save, D2H) and scatter
//!   (restore, H2D) kernels of `cuda/kvtier_copy.cu`: one launch moves every arena of every block of
//!   a batch, reading and writing host slots through the device alias of the registered pool.
//! - [`CudaArenas`]: real HBM arenas for a geometry with pattern fill/verify kernels
//!   ([`crate::copy::EngineArenas`]), for replays, tests and benchmarks.
//! - [`cuda_available`]: whether this machine can run it (for `--backend auto`).
//!
//! The driver and NVRTC are loaded at run time (cudarc, dynamic loading), so this builds and the
//! crate runs on machines without CUDA; there every constructor returns
//! [`crate::CopyError::Unavailable`]. Kernels are compiled with NVRTC for the device's architecture
//! (`sm_XY` from its compute capability) at first use and cached per device.

mod arenas;
mod backend;
pub mod desc;
mod device;

pub use arenas::{CudaArenas, PatternJob};
pub use backend::{CopyMode, CudaBackend, CudaOptions};
pub use device::{cuda_available, device_count};

/// Raw access for benchmarks and tests that compare the kernels against the driver's copy paths.
/// Not a stable API.
#[doc(hidden)]
pub mod raw {
    pub use super::device::ck;
    use super::device::Device;
    use crate::error::CopyError;

    /// Launches the compute probe kernel (`kvt_compute_probe`: dependent FMAs, `iters` per thread)
    /// on `grid` CTAs of 256 threads on `stream` of device `device`; `out` is a device address of
    /// 4 writable bytes.
    ///
    /// # Errors
    /// Device errors.
    pub fn launch_probe(device: u32, stream: u64, grid: u32, out: u64, iters: u32) -> Result<(), CopyError> {
        let d = Device::get(device)?;
        d.bind()?;
        #[repr(C)]
        struct P {
            out: u64,
            iters: u32,
        }
        let p = P { out, iters };
        let params = [&p.out as *const u64 as *mut std::ffi::c_void, &p.iters as *const u32 as *mut std::ffi::c_void];
        // SAFETY: the probe takes (float*, unsigned); params point at live values of those types.
        super::device::ck("cuLaunchKernel", unsafe {
            cudarc::driver::sys::cuLaunchKernel(
                d.kernels.probe,
                grid,
                1,
                1,
                256,
                1,
                1,
                0,
                stream as cudarc::driver::sys::CUstream,
                params.as_ptr() as *mut *mut std::ffi::c_void,
                std::ptr::null_mut(),
            )
        })?;
        Ok(())
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
