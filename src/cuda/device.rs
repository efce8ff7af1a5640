//! One CUDA device as the backends see it: its primary context, the copy kernels compiled for its
//! architecture with NVRTC at first use (cached per device for the life of the process), and small
//! owning types (device buffer, stream, event) over the driver calls the backends make.
//!
//! Driver calls go through cudarc's `driver::result` wrappers wherever one exists (device queries,
//! primary context, module loading, allocation, copies, streams, events, launches); their
//! [`DriverError`] becomes [`CopyError::Cuda`] with the name of the call ([`Ctx::ctx`]). Calls that
//! `driver::result` does not wrap (context push/pop, host registration, green contexts) go through
//! `driver::sys` and [`ck`].

use crate::error::CopyError;
use cudarc::driver::result::{self as drv, DriverError};
use cudarc::driver::sys;
use cudarc::nvrtc::result::{self as rtc, NvrtcError};
use cudarc::nvrtc::sys as nvrtc;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel source and headers, embedded at build time.
const SOURCE: &str = include_str!("../../cuda/kvtier_copy.cu");
const HEADERS: [(&str, &str); 2] = [
    ("kvtier_copy.cuh", include_str!("../../cuda/kvtier_copy.cuh")),
    ("kvtier_pattern.cuh", include_str!("../../cuda/kvtier_pattern.cuh")),
];

/// Names a failed driver call: `Result<T, DriverError>` -> `Result<T, CopyError>`.
pub(crate) trait Ctx<T> {
    /// The value, or [`CopyError::Cuda`] naming `call` and keeping the driver's result.
    fn ctx(self, call: &'static str) -> Result<T, CopyError>;
}

impl<T> Ctx<T> for Result<T, DriverError> {
    fn ctx(self, call: &'static str) -> Result<T, CopyError> {
        self.map_err(|source| driver_error(call, source))
    }
}

/// [`CopyError::Cuda`] for the driver call `call` that returned `source`, with the driver's name
/// and description of the error written now (built here, in `cuda/`, not in the error's display).
pub fn driver_error(call: &'static str, source: DriverError) -> CopyError {
    CopyError::Cuda { call, detail: describe_driver_error(&source), source }
}

/// Turns a raw driver result into `Ok` or [`CopyError::Cuda`] naming `call` (for driver calls that
/// cudarc's `driver::result` does not wrap).
///
/// # Errors
/// [`CopyError::Cuda`] for any result other than `CUDA_SUCCESS`.
pub fn ck(call: &'static str, r: sys::CUresult) -> Result<(), CopyError> {
    r.result().ctx(call)
}

/// `CUDA_ERROR_NAME (code): description` for a driver error, asking the driver for the name and
/// description only when its library is loadable (formatting an error never panics on a machine
/// without CUDA, where such errors exist only as constructed values).
pub fn describe_driver_error(e: &DriverError) -> String {
    let code = e.0 as i32;
    if !driver_present() {
        return format!("{:?} ({code})", e.0);
    }
    let text = e.error_string().map(|s| s.to_string_lossy().into_owned()).unwrap_or_default();
    format!("{:?} ({code}): {text}", e.0)
}

/// True if the CUDA driver library can be loaded (so calling into it cannot panic on a missing
/// library). Probed once per process.
pub(crate) fn driver_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: only tries to open the library by its usual names.
    *PRESENT.get_or_init(|| unsafe { sys::is_culib_present() })
}

fn nvrtc_present() -> bool {
    // SAFETY: only tries to open the library by its usual names.
    unsafe { nvrtc::is_culib_present() }
}

/// Number of CUDA devices, or the reason there are none usable.
///
/// # Errors
/// [`CopyError::Unavailable`] when the driver library is missing or `cuInit` fails (with the
/// driver's message).
pub fn device_count() -> Result<u32, CopyError> {
    let unavailable = |reason: String| CopyError::Unavailable { backend: "cuda", reason };
    if !driver_present() {
        return Err(unavailable("the CUDA driver library (libcuda.so) was not found".into()));
    }
    drv::init().ctx("cuInit").map_err(|e| unavailable(e.to_string()))?;
    let n = drv::device::get_count().ctx("cuDeviceGetCount").map_err(|e| unavailable(e.to_string()))?;
    Ok(n.max(0) as u32)
}

/// True if this machine can run the CUDA backend: the driver and NVRTC libraries load and at least
/// one device is present (for `--backend auto`). Never panics.
pub fn cuda_available() -> bool {
    nvrtc_present() && matches!(device_count(), Ok(n) if n > 0)
}

/// Kernel handles of a device's module.
#[derive(Copy, Clone, Debug)]
pub(crate) struct Kernels {
    pub save: [sys::CUfunction; 2],
    pub restore: [sys::CUfunction; 2],
    pub fill: sys::CUfunction,
    pub verify: sys::CUfunction,
    pub probe: sys::CUfunction,
    pub decode_probe: sys::CUfunction,
    pub sm_ids: sys::CUfunction,
    pub spin_until: sys::CUfunction,
}

/// A device: ordinal, retained primary context, compiled module.
pub(crate) struct Device {
    pub ordinal: i32,
    pub cu_device: sys::CUdevice,
    pub ctx: sys::CUcontext,
    pub kernels: Kernels,
    pub sm_count: u32,
    pub arch: String,
    pub name: String,
}

// SAFETY: the context and function handles are process-wide driver objects, valid on any thread
// once the context is made current (Device::bind); the Device is never freed (cached for the life
// of the process), so the handles never dangle.
unsafe impl Send for Device {}
// SAFETY: as above; no interior mutability.
unsafe impl Sync for Device {}

impl Device {
    /// The cached device `ordinal`, initialising the driver, retaining the primary context and
    /// compiling the kernels on first use.
    ///
    /// # Errors
    /// [`CopyError::Unavailable`] when CUDA or NVRTC is missing or the ordinal does not exist;
    /// [`CopyError::Cuda`] for driver errors, [`CopyError::Nvrtc`] for compile errors (with the log).
    pub(crate) fn get(ordinal: u32) -> Result<Arc<Device>, CopyError> {
        static CACHE: OnceLock<Mutex<HashMap<u32, Arc<Device>>>> = OnceLock::new();
        let cache = CACHE.get_or_init(Default::default);
        let mut map = cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(d) = map.get(&ordinal) {
            return Ok(d.clone());
        }
        let d = Arc::new(Self::open(ordinal)?);
        map.insert(ordinal, d.clone());
        Ok(d)
    }

    fn open(ordinal: u32) -> Result<Device, CopyError> {
        let count = device_count()?;
        if ordinal >= count {
            return Err(CopyError::Unavailable {
                backend: "cuda",
                reason: format!("device {ordinal} requested but {count} CUDA device(s) present"),
            });
        }
        if !nvrtc_present() {
            return Err(CopyError::Unavailable {
                backend: "cuda",
                reason: "the NVRTC library (libnvrtc.so) was not found".into(),
            });
        }
        let dev = drv::device::get(ordinal as i32).ctx("cuDeviceGet")?;
        // SAFETY: dev comes from cuDeviceGet; the attribute queries write one int each.
        let attr =
            |a: sys::CUdevice_attribute| unsafe { drv::device::get_attribute(dev, a) }.ctx("cuDeviceGetAttribute");
        // SAFETY: dev comes from cuDeviceGet; the retained primary context is never released (the
        // Device lives for the process), so every later use of ctx is valid.
        let ctx = unsafe { drv::primary_ctx::retain(dev) }.ctx("cuDevicePrimaryCtxRetain")?;
        // SAFETY: ctx is the live primary context retained above.
        unsafe { drv::ctx::set_current(ctx) }.ctx("cuCtxSetCurrent")?;
        use sys::CUdevice_attribute::*;
        let major = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count = attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        if attr(CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? == 0 {
            return Err(CopyError::Unavailable { backend: "cuda", reason: "device cannot map host memory".into() });
        }
        let name = drv::device::get_name(dev).ctx("cuDeviceGetName")?;
        let arch = format!("sm_{major}{minor}");
        let cubin = compile(&arch)?;
        // SAFETY: cubin is a complete CUBIN image from NVRTC; the context is current. The module is
        // never unloaded (the Device lives for the process).
        let module = unsafe { drv::module::load_data(cubin.as_ptr() as *const c_void) }.ctx("cuModuleLoadData")?;
        let f = |n: &str| -> Result<sys::CUfunction, CopyError> {
            // SAFETY: module is loaded and never unloaded.
            unsafe { drv::module::get_function(module, CString::new(n).expect("no NUL")) }.ctx("cuModuleGetFunction")
        };
        let kernels = Kernels {
            save: [f("kvt_save_u4")?, f("kvt_save_u8")?],
            restore: [f("kvt_restore_u4")?, f("kvt_restore_u8")?],
            fill: f("kvt_fill")?,
            verify: f("kvt_verify")?,
            probe: f("kvt_compute_probe")?,
            decode_probe: f("kvt_decode_probe")?,
            sm_ids: f("kvt_sm_ids")?,
            spin_until: f("kvt_spin_until")?,
        };
        Ok(Device { ordinal: ordinal as i32, cu_device: dev, ctx, kernels, sm_count, arch, name })
    }

    /// Makes the device's primary context current on the calling thread.
    ///
    /// # Errors
    /// [`CopyError::Cuda`] from `cuCtxSetCurrent`.
    pub(crate) fn bind(&self) -> Result<(), CopyError> {
        // SAFETY: ctx is a retained primary context, valid for the process.
        unsafe { drv::ctx::set_current(self.ctx) }.ctx("cuCtxSetCurrent")
    }
}

/// Compiles the kernels for `arch` (`sm_XY`) with NVRTC and returns the CUBIN.
///
/// Program creation and the CUBIN read stay on `nvrtc::sys`: cudarc's `nvrtc::result` creates
/// programs without in-memory headers (our source includes `kvtier_copy.cuh` and
/// `kvtier_pattern.cuh`, embedded in the binary, not files on disk) and reads PTX only, while we
/// load a CUBIN compiled for the device's own `sm_XY` (no JIT step at module load). Compiling, the
/// log and destruction use `nvrtc::result`.
fn compile(arch: &str) -> Result<Vec<u8>, CopyError> {
    let fail = |call: &'static str, source: NvrtcError, log: String| CopyError::Nvrtc { call, source, log };
    let src = CString::new(SOURCE).expect("no NUL");
    let hdr: Vec<CString> = HEADERS.iter().map(|(_, s)| CString::new(*s).expect("no NUL")).collect();
    let names: Vec<CString> = HEADERS.iter().map(|(n, _)| CString::new(*n).expect("no NUL")).collect();
    let hp: Vec<*const c_char> = hdr.iter().map(|c| c.as_ptr()).collect();
    let np: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let file = CString::new("kvtier_copy.cu").expect("no NUL");
    let opts = [format!("--gpu-architecture={arch}"), "-std=c++17".into(), "-default-device".into()];
    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live NUL-terminated string for the duration of the call;
    // the program is destroyed below on every path once created.
    unsafe {
        nvrtc::nvrtcCreateProgram(&mut prog, src.as_ptr(), file.as_ptr(), 2, hp.as_ptr(), np.as_ptr())
            .result()
            .map_err(|e| fail("nvrtcCreateProgram", e, String::new()))?;
    }
    // SAFETY: prog is a live program until destroy_program below.
    let result = unsafe {
        let compiled = rtc::compile_program(prog, &opts);
        let log = rtc::get_program_log(prog)
            .map(|l| {
                let bytes: Vec<u8> = l.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
                String::from_utf8_lossy(&bytes).trim().to_string()
            })
            .unwrap_or_default();
        match compiled {
            Err(e) => Err(fail("nvrtcCompileProgram", e, format!("({arch}) {log}"))),
            Ok(()) => {
                let mut n = 0usize;
                match nvrtc::nvrtcGetCUBINSize(prog, &mut n).result() {
                    Err(e) => Err(fail("nvrtcGetCUBINSize", e, String::new())),
                    Ok(()) => {
                        let mut cubin = vec![0u8; n];
                        nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char)
                            .result()
                            .map(|_| cubin)
                            .map_err(|e| fail("nvrtcGetCUBIN", e, String::new()))
                    }
                }
            }
        }
    };
    // SAFETY: prog is live and destroyed exactly once.
    let _ = unsafe { rtc::destroy_program(prog) };
    result
}

/// A device allocation (`cuMemAlloc`), freed on drop.
pub(crate) struct DeviceBuffer {
    pub ptr: u64,
    dev: Arc<Device>,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1) bytes on `dev`.
    pub(super) fn new(dev: &Arc<Device>, bytes: usize) -> Result<Self, CopyError> {
        dev.bind()?;
        // SAFETY: the context is current; the memory is only handed to kernels and copies that
        // write it before anything reads it.
        let ptr = unsafe { drv::malloc_sync(bytes.max(1)) }.ctx("cuMemAlloc")?;
        Ok(DeviceBuffer { ptr, dev: dev.clone() })
    }

    /// A buffer holding a copy of `data` (synchronous upload).
    pub(super) fn from_slice<T: Copy>(dev: &Arc<Device>, data: &[T]) -> Result<Self, CopyError> {
        let b = Self::new(dev, std::mem::size_of_val(data))?;
        if !data.is_empty() {
            // SAFETY: the buffer holds size_of_val(data) bytes; data is a live slice of that size.
            unsafe { drv::memcpy_htod_sync(b.ptr, data) }.ctx("cuMemcpyHtoD")?;
        }
        Ok(b)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: ptr came from cuMemAlloc in this context; owners free it only after the work
            // that uses it has completed (documented at each owner).
            let _ = unsafe { drv::free_sync(self.ptr) };
        }
    }
}

/// Whether the driver has `cuMemcpyBatchAsync_v2` (CUDA 13.0 and later: `cuDriverGetVersion` >=
/// 13000). Probed once per process; false without a driver.
pub(crate) fn batch_copy_available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        if !driver_present() {
            return false;
        }
        let mut version = 0;
        // SAFETY: the library loads (checked above); the call writes one int and needs no cuInit.
        let r = unsafe { sys::cuDriverGetVersion(&mut version) };
        r == sys::CUresult::CUDA_SUCCESS && version >= 13000
    })
}

/// One-dimensional copies (device addresses under unified addressing: device buffers and the
/// pool's device alias) queued together on one stream: a staged piece's slots, a layer group's
/// runs. [`CopyList::submit`] hands the whole list to the driver in one `cuMemcpyBatchAsync` call
/// where it can, instead of one `cuMemcpyAsync` per copy (2-3 us of CPU time each; on an H100 a
/// 128-block GLM-5.2 restore call took 397 us with one call per copy, 230 us batched:
/// `docs/benchmarks.md`).
#[derive(Debug, Default)]
pub(crate) struct CopyList {
    dst: Vec<sys::CUdeviceptr>,
    src: Vec<sys::CUdeviceptr>,
    len: Vec<usize>,
}

impl CopyList {
    /// An empty list with room for `n` copies.
    pub(crate) fn with_capacity(n: usize) -> Self {
        CopyList { dst: Vec::with_capacity(n), src: Vec::with_capacity(n), len: Vec::with_capacity(n) }
    }

    /// Adds a copy of `len` bytes from `src` to `dst`.
    pub(crate) fn push(&mut self, dst: sys::CUdeviceptr, src: sys::CUdeviceptr, len: usize) {
        self.dst.push(dst);
        self.src.push(src);
        self.len.push(len);
    }

    /// Number of copies queued in the list (not yet submitted).
    pub(crate) fn len(&self) -> usize {
        self.len.len()
    }

    /// Queues every copy of the list on `stream`, after the work queued on it so far, and empties
    /// the list. `batched` and a driver of CUDA 13 or later ([`batch_copy_available`]): one
    /// `cuMemcpyBatchAsync` for two or more copies (sources read in stream order); otherwise one
    /// `cuMemcpyAsync` per copy, in order.
    ///
    /// # Errors
    /// [`CopyError::Cuda`] naming the failed call; the list is emptied either way (some copies
    /// may have been queued: the caller synchronises `stream` before releasing anything they
    /// touch, as the backend's failed submissions do).
    ///
    /// # Safety
    /// Every `[dst, dst + len)` and `[src, src + len)` must be valid device (or device-mapped
    /// host) memory of the stream's context until the stream reaches the copy, and nothing else
    /// may write them meanwhile except through work ordered with the stream.
    pub(crate) unsafe fn submit(&mut self, stream: sys::CUstream, batched: bool) -> Result<(), CopyError> {
        let n = self.len();
        let r = if n >= 2 && batched && batch_copy_available() {
            // SAFETY: plain-data FFI struct; all zeros is a valid value (location hints unused:
            // they apply only to managed or pageable memory).
            let mut attrs: sys::CUmemcpyAttributes = unsafe { std::mem::zeroed() };
            attrs.srcAccessOrder = sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM;
            let mut first = 0usize;
            // SAFETY: three arrays of n entries, one attribute applying from copy 0; the ranges
            // are the caller's contract; the driver reads the arrays during the call only.
            let r = unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    self.dst.as_mut_ptr(),
                    self.src.as_mut_ptr(),
                    self.len.as_mut_ptr(),
                    n,
                    &mut attrs,
                    &mut first,
                    1,
                    stream,
                )
            };
            ck("cuMemcpyBatchAsync", r)
        } else {
            let mut r = Ok(());
            for i in 0..n {
                // SAFETY: the caller's contract, copy by copy.
                r = ck("cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(self.dst[i], self.src[i], self.len[i], stream) });
                if r.is_err() {
                    break;
                }
            }
            r
        };
        self.dst.clear();
        self.src.clear();
        self.len.clear();
        r
    }
}

/// A stream owned by a backend, synchronised and destroyed on drop.
pub(crate) struct Stream {
    pub raw: sys::CUstream,
    dev: Arc<Device>,
}

// SAFETY: CUstream handles may be used from any thread with the context current.
unsafe impl Send for Stream {}
// SAFETY: as above; enqueuing is internally synchronised by the driver.
unsafe impl Sync for Stream {}

impl Stream {
    /// A non-blocking stream on `dev` of default priority.
    pub(crate) fn new(dev: &Arc<Device>) -> Result<Self, CopyError> {
        Self::with_priority(dev, false)
    }

    /// A non-blocking stream on `dev`; `high`: of the device's greatest stream priority (the block
    /// scheduler dispatches its pending CTAs before those of lower-priority streams).
    pub(crate) fn with_priority(dev: &Arc<Device>, high: bool) -> Result<Self, CopyError> {
        dev.bind()?;
        let priority = if high { drv::stream::get_priority_range().ctx("cuCtxGetStreamPriorityRange")?.1 } else { 0 };
        let raw = drv::stream::create_with_priority(drv::stream::StreamKind::NonBlocking, priority)
            .ctx("cuStreamCreateWithPriority")?;
        Ok(Stream { raw, dev: dev.clone() })
    }

    /// Takes ownership of `raw`, a stream of `dev`'s primary context or of one of its green
    /// contexts (synchronised and destroyed on drop).
    pub(crate) fn from_raw(dev: &Arc<Device>, raw: sys::CUstream) -> Self {
        Stream { raw, dev: dev.clone() }
    }

    /// Blocks until all work queued on the stream has finished.
    pub(crate) fn synchronize(&self) -> Result<(), CopyError> {
        self.dev.bind()?;
        // SAFETY: raw is a live stream.
        unsafe { drv::stream::synchronize(self.raw) }.ctx("cuStreamSynchronize")
    }

    /// Makes the stream wait for the last record of `event` (taken at this call).
    pub(crate) fn wait_event(&self, event: sys::CUevent) -> Result<(), CopyError> {
        Self::wait_raw(self.raw, event)
    }

    /// Makes the raw `stream` wait for the last record of `event` (taken at this call). Both must
    /// be live handles of one device (the event's record may come from any of its contexts).
    pub(crate) fn wait_raw(stream: sys::CUstream, event: sys::CUevent) -> Result<(), CopyError> {
        // SAFETY: both handles are live (callers' contract; the caller's event by WaitFor's).
        unsafe { drv::stream::wait_event(stream, event, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
            .ctx("cuStreamWaitEvent")
    }

    /// Makes the stream wait for `wait` (see [`crate::WaitFor`]).
    pub(crate) fn wait_for(&self, wait: crate::WaitFor) -> Result<(), CopyError> {
        match wait {
            crate::WaitFor::Nothing => Ok(()),
            // The caller passes a live recorded event (WaitFor's contract).
            crate::WaitFor::CudaEvent(e) => self.wait_event(e as sys::CUevent),
            crate::WaitFor::CudaStream(s) => {
                // The event is recorded on the caller's live stream and waited on here, then
                // destroyed (the driver keeps the wait valid after destruction).
                let ev = Event::new(&self.dev)?;
                ev.record(s as sys::CUstream)?;
                self.wait_event(ev.raw)
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.dev.bind().is_ok() {
            // SAFETY: drain first so nothing queued outlives the stream's owners' buffers; raw is
            // live and destroyed once.
            unsafe {
                let _ = drv::stream::synchronize(self.raw);
                let _ = drv::stream::destroy(self.raw);
            }
        }
    }
}

/// An event (timing disabled unless asked), destroyed on drop.
pub(crate) struct Event {
    pub raw: sys::CUevent,
    dev: Arc<Device>,
}

// SAFETY: CUevent handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

impl Event {
    /// A new event without timing.
    pub(super) fn new(dev: &Arc<Device>) -> Result<Self, CopyError> {
        Self::with_flags(dev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
    }

    /// A new event with `flags`.
    pub(super) fn with_flags(dev: &Arc<Device>, flags: sys::CUevent_flags) -> Result<Self, CopyError> {
        dev.bind()?;
        let raw = drv::event::create(flags).ctx("cuEventCreate")?;
        Ok(Event { raw, dev: dev.clone() })
    }

    /// Records the event on `stream`.
    pub(super) fn record(&self, stream: sys::CUstream) -> Result<(), CopyError> {
        // SAFETY: both handles are live.
        unsafe { drv::event::record(self.raw, stream) }.ctx("cuEventRecord")
    }

    /// Blocks until the event has completed.
    pub(super) fn synchronize(&self) -> Result<(), CopyError> {
        self.dev.bind()?;
        // SAFETY: live event.
        unsafe { drv::event::synchronize(self.raw) }.ctx("cuEventSynchronize")
    }

    /// Makes `stream` (any context's; 0 = the legacy default stream of this event's device) wait
    /// for the event without a host sync. The device's primary context is pushed for the call and
    /// popped after it, so the calling thread's current context (an engine's) is left as it was.
    pub(super) fn stream_wait(&self, stream: sys::CUstream) -> Result<(), CopyError> {
        // Context push/pop have no `driver::result` wrapper.
        // SAFETY: ctx is a retained primary context (valid for the process); the push is undone
        // by the pop below on every path; raw is a live event; the stream is the caller's.
        unsafe {
            ck("cuCtxPushCurrent", sys::cuCtxPushCurrent_v2(self.dev.ctx))?;
            let r = drv::stream::wait_event(stream, self.raw, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
                .ctx("cuStreamWaitEvent");
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            let p = ck("cuCtxPopCurrent", sys::cuCtxPopCurrent_v2(&mut popped));
            r.and(p)
        }
    }

    /// True if the event has completed.
    pub(super) fn query(&self) -> Result<bool, CopyError> {
        self.dev.bind()?;
        // SAFETY: live event.
        match unsafe { drv::event::query(self.raw) } {
            Ok(()) => Ok(true),
            Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => Ok(false),
            Err(e) => Err(e).ctx("cuEventQuery"),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: live event, destroyed once; destroying a pending event is allowed (resources are
        // released when it completes).
        let _ = unsafe { drv::event::destroy(self.raw) };
    }
}

/// Launches `f` with one by-value parameter block `args` on `grid` CTAs of `threads` threads on
/// `stream`.
///
/// # Safety
/// `args` must be the exact parameter type of `f`, and every device address in it must stay valid
/// until the launch completes.
pub(crate) unsafe fn launch<T>(
    f: sys::CUfunction,
    grid: u32,
    threads: u32,
    stream: sys::CUstream,
    args: &T,
) -> Result<(), CopyError> {
    let mut params = [args as *const T as *mut c_void];
    // SAFETY: params points at one live parameter block of the kernel's type (caller's contract);
    // the driver copies it before returning.
    unsafe { drv::launch_kernel(f, (grid, 1, 1), (threads, 1, 1), 0, stream, &mut params) }.ctx("cuLaunchKernel")
}

/// Launches `f` with the parameters `params` (one pointer per kernel parameter).
///
/// # Safety
/// Each pointer must point at a live value of the kernel's parameter type, in order, and every
/// device address among them must stay valid until the launch completes.
pub(crate) unsafe fn launch_params(
    f: sys::CUfunction,
    grid: u32,
    threads: u32,
    stream: sys::CUstream,
    params: &mut [*mut c_void],
) -> Result<(), CopyError> {
    // SAFETY: the caller's contract.
    unsafe { drv::launch_kernel(f, (grid, 1, 1), (threads, 1, 1), 0, stream, params) }.ctx("cuLaunchKernel")
}
