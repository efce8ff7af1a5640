//! SM isolation through CUDA green contexts: a device's SMs split into a small partition for
//! kvtier's copy kernels and the rest for the engine, so neither ever shares an SM with the other.
//!
//! A green context (driver API, CUDA 12.4 or newer) is the device's primary context restricted to a
//! set of SMs: memory, modules and events are the primary context's, but a kernel launched on one
//! of its streams runs only on its SMs. It confines only its own work: another context's kernels
//! may still run on those SMs. So isolation takes both halves: kvtier launches its gather/scatter
//! kernels on streams of the copy partition, and the engine launches its kernels on streams of the
//! complementary partition ([`SmPartition::engine_stream`]). An engine that keeps launching on
//! ordinary streams gets no isolation, only copy kernels confined to a few SMs.
//!
//! cudarc 0.19's `driver::sys` binds the green-context calls with dynamic loading but panics on a
//! missing symbol, so each symbol is looked up in the loaded driver first and a driver without
//! them is reported as [`Isolation::Unavailable`], never a panic. A partition is created once per
//! device and SM count and kept for the life of the process (like the device's kernels), after a
//! smoke test: a kernel launched on a copy-partition stream, ordered by an event of the primary
//! context.

use super::device::{ck, launch_params, Ctx, Device, DeviceBuffer, Event, Stream};
use crate::error::CopyError;
use cudarc::driver::result as drv;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// Where a backend's copy kernels run (see [`crate::cuda::CudaOptions::reserved_sms`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// No SMs reserved: copy kernels run in the primary context, on any SM.
    Off,
    /// Copy kernels run in a green context of `copy_sms` SMs; the other `engine_sms` SMs form the
    /// engine's partition ([`crate::cuda::CudaBackend::sm_partition`]).
    GreenContext {
        /// SMs of the copy partition (the reserved count rounded up to the device's granularity).
        copy_sms: u32,
        /// SMs left for the engine.
        engine_sms: u32,
    },
    /// SMs were reserved but green contexts are not available here (the reason says why); copy
    /// kernels run as with [`Isolation::Off`].
    Unavailable {
        /// Why (missing driver symbols, a driver older than CUDA 12.4, a failed split, ...).
        reason: String,
    },
}

/// Room after a `CUdevResource` for drivers newer than the bindings, whose struct may be longer
/// (CUDA 13.1 appended a pointer field).
#[repr(C)]
struct ResourceBuf {
    res: sys::CUdevResource,
    _slack: [u8; 64],
}

impl ResourceBuf {
    fn zeroed() -> Self {
        // SAFETY: plain-old-data driver struct; all-zero bytes are a valid value (type INVALID).
        unsafe { std::mem::zeroed() }
    }
    fn sm_count(&self) -> u32 {
        // SAFETY: the driver filled an SM resource (type SM), so the union holds `sm`.
        unsafe { self.res.__bindgen_anon_1.sm.smCount }
    }
}

/// The driver functions green contexts need (looked up before any is called).
const SYMBOLS: [&str; 6] = [
    "cuDeviceGetDevResource",
    "cuDevSmResourceSplitByCount",
    "cuDevResourceGenerateDesc",
    "cuGreenCtxCreate",
    "cuGreenCtxStreamCreate",
    "cuCtxFromGreenCtx",
];

/// An SM split of one device: a green context for the copy kernels and one for the engine. Lives
/// for the process (cached per device and reserved count); never destroyed.
pub(crate) struct Partition {
    dev: Arc<Device>,
    copy: sys::CUgreenCtx,
    engine: sys::CUgreenCtx,
    pub copy_sms: u32,
    pub engine_sms: u32,
}

// SAFETY: green context handles are process-wide driver objects usable from any thread (streams
// are created with cuGreenCtxStreamCreate, which needs no current context); the partition is never
// destroyed, so the handles never dangle.
unsafe impl Send for Partition {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for Partition {}

/// Which half of a partition.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Side {
    Copy,
    Engine,
}

impl Partition {
    /// The partition of `dev` with at least `reserved` SMs for copies, created on first use (and
    /// smoke-tested), or why there is none. Failures are cached too.
    pub(crate) fn get(dev: &Arc<Device>, reserved: u32) -> Result<Arc<Partition>, String> {
        type Cache = Mutex<HashMap<(i32, u32), Result<Arc<Partition>, String>>>;
        static CACHE: OnceLock<Cache> = OnceLock::new();
        let mut map = CACHE.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        map.entry((dev.ordinal, reserved)).or_insert_with(|| Self::create(dev, reserved).map(Arc::new)).clone()
    }

    fn create(dev: &Arc<Device>, reserved: u32) -> Result<Partition, String> {
        for name in SYMBOLS {
            // SAFETY: only looks the symbol up in the already loaded driver library.
            let found = unsafe { sys::culib().get::<unsafe extern "C" fn()>(name.as_bytes()) }.is_ok();
            if !found {
                return Err(format!("the CUDA driver has no `{name}` (green contexts need CUDA 12.4 or newer)"));
            }
        }
        let mut version = 0;
        // SAFETY: writes one int.
        ck("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) }).map_err(|e| e.to_string())?;
        if version < 12040 {
            return Err(format!("the CUDA driver is version {version}; green contexts need 12040 (CUDA 12.4)"));
        }
        if reserved >= dev.sm_count {
            return Err(format!("{reserved} reserved SMs leave none of the device's {} for the engine", dev.sm_count));
        }
        dev.bind().map_err(|e| e.to_string())?;
        let (mut all, mut group, mut rest) = (ResourceBuf::zeroed(), ResourceBuf::zeroed(), ResourceBuf::zeroed());
        let mut groups = 1u32;
        // SAFETY: the buffers are valid, writable CUdevResource values with slack after them;
        // `groups` is 1, so the driver writes one result.
        unsafe {
            ck(
                "cuDeviceGetDevResource",
                sys::cuDeviceGetDevResource(
                    dev.cu_device,
                    &mut all.res,
                    sys::CUdevResourceType::CU_DEV_RESOURCE_TYPE_SM,
                ),
            )
            .map_err(|e| e.to_string())?;
            ck(
                "cuDevSmResourceSplitByCount",
                sys::cuDevSmResourceSplitByCount(&mut group.res, &mut groups, &all.res, &mut rest.res, 0, reserved),
            )
            .map_err(|e| e.to_string())?;
        }
        let (copy_sms, engine_sms) = (group.sm_count(), rest.sm_count());
        if groups != 1 || copy_sms == 0 || engine_sms == 0 {
            return Err(format!(
                "splitting {} SMs for {reserved} gave {groups} group(s) of {copy_sms} SMs and {engine_sms} left",
                all.sm_count()
            ));
        }
        let green = |r: &mut ResourceBuf| -> Result<sys::CUgreenCtx, String> {
            let mut desc: sys::CUdevResourceDesc = std::ptr::null_mut();
            let mut g: sys::CUgreenCtx = std::ptr::null_mut();
            // SAFETY: r holds one SM resource from the split above; the descriptor is consumed by
            // cuGreenCtxCreate, which retains the primary context for the green context's life.
            unsafe {
                ck("cuDevResourceGenerateDesc", sys::cuDevResourceGenerateDesc(&mut desc, &mut r.res, 1))
                    .map_err(|e| e.to_string())?;
                let flags = sys::CUgreenCtxCreate_flags::CU_GREEN_CTX_DEFAULT_STREAM as u32;
                ck("cuGreenCtxCreate", sys::cuGreenCtxCreate(&mut g, desc, dev.cu_device, flags))
                    .map_err(|e| e.to_string())?;
            }
            Ok(g)
        };
        let p =
            Partition { dev: dev.clone(), copy: green(&mut group)?, engine: green(&mut rest)?, copy_sms, engine_sms };
        p.smoke_test().map_err(|e| format!("green context smoke test failed: {e}"))?;
        Ok(p)
    }

    /// Launches a kernel of the device's module on a copy-partition stream with the primary
    /// context current, and orders it with an event of the primary context: the two things the
    /// backend relies on.
    fn smoke_test(&self) -> Result<(), CopyError> {
        let s = self.stream(Side::Copy, false)?;
        let out = DeviceBuffer::new(&self.dev, 4)?;
        let (mut o, mut iters, mut items) = (out.ptr, 1u32, 1u32);
        let mut params = [
            &mut o as *mut u64 as *mut c_void,
            &mut iters as *mut u32 as *mut c_void,
            &mut items as *mut u32 as *mut c_void,
        ];
        // SAFETY: kvt_compute_probe takes (float*, unsigned, unsigned); `out` outlives the
        // synchronisation below.
        unsafe { launch_params(self.dev.kernels.probe, 1, 32, s.raw, &mut params)? };
        let ev = Event::new(&self.dev)?;
        ev.record(s.raw)?;
        ev.synchronize()?;
        s.synchronize()
    }

    /// A new non-blocking stream of one side of the partition; `high`: of the greatest priority.
    pub(crate) fn stream(&self, side: Side, high: bool) -> Result<Stream, CopyError> {
        self.dev.bind()?;
        let priority = if high { drv::stream::get_priority_range().ctx("cuCtxGetStreamPriorityRange")?.1 } else { 0 };
        let g = if side == Side::Copy { self.copy } else { self.engine };
        let mut raw: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: g is a live green context (never destroyed); writes one stream handle.
        ck("cuGreenCtxStreamCreate", unsafe { sys::cuGreenCtxStreamCreate(&mut raw, g, flags, priority) })?;
        Ok(Stream::from_raw(&self.dev, raw))
    }

    /// The engine partition as a `CUcontext` (`cuCtxFromGreenCtx`).
    pub(crate) fn engine_context(&self) -> Result<sys::CUcontext, CopyError> {
        let mut c: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: engine is a live green context; writes one handle, valid while it lives.
        ck("cuCtxFromGreenCtx", unsafe { sys::cuCtxFromGreenCtx(&mut c, self.engine) })?;
        Ok(c)
    }
}

/// The engine's side of a backend's SM split: streams whose kernels never run on the SMs kvtier's
/// copy kernels use (see the module docs of `kvtier::cuda` and `docs/cuda.md`).
#[derive(Clone)]
pub struct SmPartition {
    pub(crate) inner: Arc<Partition>,
}

impl std::fmt::Debug for SmPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SmPartition")
            .field("device", &self.inner.dev.ordinal)
            .field("copy_sms", &self.inner.copy_sms)
            .field("engine_sms", &self.inner.engine_sms)
            .finish()
    }
}

impl SmPartition {
    /// SMs reserved for kvtier's copy kernels.
    pub fn copy_sms(&self) -> u32 {
        self.inner.copy_sms
    }

    /// SMs of the engine's partition (the device's SMs minus [`SmPartition::copy_sms`]): size
    /// persistent grids by this.
    pub fn engine_sms(&self) -> u32 {
        self.inner.engine_sms
    }

    /// A new non-blocking stream for the engine's kernels, confined to the engine's SMs; `high`:
    /// of the device's greatest stream priority. Kernels of the device's primary context (CUDA
    /// runtime, torch, cudarc) may be launched on it with the primary context current; memory and
    /// events are shared with the primary context.
    ///
    /// # Errors
    /// [`CopyError::Cuda`] from `cuGreenCtxStreamCreate`.
    pub fn engine_stream(&self, high: bool) -> Result<EngineStream, CopyError> {
        Ok(EngineStream { stream: self.inner.stream(Side::Engine, high)? })
    }

    /// The engine partition as a raw `CUcontext` (`cuCtxFromGreenCtx`), for engines that make it
    /// current instead of launching on [`SmPartition::engine_stream`]s. Valid for the process.
    ///
    /// # Errors
    /// [`CopyError::Cuda`] from the driver.
    pub fn engine_context(&self) -> Result<u64, CopyError> {
        self.inner.engine_context().map(|c| c as u64)
    }
}

/// A stream of the engine's SM partition ([`SmPartition::engine_stream`]); synchronised and
/// destroyed on drop.
pub struct EngineStream {
    stream: Stream,
}

impl std::fmt::Debug for EngineStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineStream").field("raw", &(self.stream.raw as u64)).finish()
    }
}

impl EngineStream {
    /// The raw `CUstream` (e.g. for `torch.cuda.ExternalStream` or `WaitFor::CudaStream`).
    pub fn raw(&self) -> u64 {
        self.stream.raw as u64
    }

    /// Blocks until the work queued on the stream has finished.
    ///
    /// # Errors
    /// [`CopyError::Cuda`] from the driver (a failed kernel).
    pub fn synchronize(&self) -> Result<(), CopyError> {
        self.stream.synchronize()
    }
}
