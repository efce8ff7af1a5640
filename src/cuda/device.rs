//! One CUDA device as the backends see it: its primary context, the copy kernels compiled for its
//! architecture with NVRTC at first use (cached per device for the life of the process), and small
//! checked wrappers over the driver calls the backends make.

use crate::error::CopyError;
use cudarc::driver::sys;
use cudarc::nvrtc::sys as nvrtc;
use std::collections::HashMap;
use std::ffi::{c_char, c_void, CStr, CString};
use std::sync::{Arc, Mutex, OnceLock};

/// The kernel source and headers, embedded at build time.
const SOURCE: &str = include_str!("../../cuda/kvtier_copy.cu");
const HEADERS: [(&str, &str); 2] = [
    ("kvtier_copy.cuh", include_str!("../../cuda/kvtier_copy.cuh")),
    ("kvtier_pattern.cuh", include_str!("../../cuda/kvtier_pattern.cuh")),
];

/// Turns a driver result into `Ok` or [`CopyError::Device`] naming `call` and the driver's message.
pub fn ck(call: &str, r: sys::CUresult) -> Result<(), CopyError> {
    if r == sys::CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const c_char = std::ptr::null();
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: both calls only write a pointer to a static string owned by the driver (or leave it
    // null for an unknown code); we read it as a C string only when non-null.
    let message = unsafe {
        let _ = sys::cuGetErrorName(r, &mut name);
        let _ = sys::cuGetErrorString(r, &mut text);
        let s = |p: *const c_char| {
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        format!("{} ({}): {}", s(name), r as i32, s(text))
    };
    Err(CopyError::Device { call: call.to_string(), message })
}

/// True if the CUDA driver library can be loaded (so calling into it cannot panic on a missing
/// library).
fn driver_present() -> bool {
    // SAFETY: only tries to open the library by its usual names.
    unsafe { sys::is_culib_present() }
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
    // SAFETY: cuInit may be called any number of times; the count is written to a local.
    unsafe {
        ck("cuInit", sys::cuInit(0)).map_err(|e| unavailable(e.to_string()))?;
        let mut n = 0;
        ck("cuDeviceGetCount", sys::cuDeviceGetCount(&mut n)).map_err(|e| unavailable(e.to_string()))?;
        Ok(n.max(0) as u32)
    }
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
}

/// A device: ordinal, retained primary context, compiled module.
pub(crate) struct Device {
    pub ordinal: i32,
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
    /// [`CopyError::Device`] for driver or compile errors (the NVRTC log in the message).
    pub fn get(ordinal: u32) -> Result<Arc<Device>, CopyError> {
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
        let attr = |dev: sys::CUdevice, a: sys::CUdevice_attribute| -> Result<i32, CopyError> {
            let mut v = 0;
            // SAFETY: writes one int; dev is a valid device handle from cuDeviceGet.
            ck("cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut v, a, dev) })?;
            Ok(v)
        };
        let mut dev: sys::CUdevice = 0;
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: plain handle queries; the retained primary context is never released (the
        // Device lives for the process), so every later use of ctx is valid.
        unsafe {
            ck("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
            ck("cuDevicePrimaryCtxRetain", sys::cuDevicePrimaryCtxRetain(&mut ctx, dev))?;
            ck("cuCtxSetCurrent", sys::cuCtxSetCurrent(ctx))?;
        }
        use sys::CUdevice_attribute::*;
        let major = attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
        let minor = attr(dev, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
        let sm_count = attr(dev, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)? as u32;
        if attr(dev, CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY)? == 0 {
            return Err(CopyError::Unavailable { backend: "cuda", reason: "device cannot map host memory".into() });
        }
        let mut name = [0 as c_char; 256];
        // SAFETY: writes at most 256 bytes, NUL-terminated.
        ck("cuDeviceGetName", unsafe { sys::cuDeviceGetName(name.as_mut_ptr(), 256, dev) })?;
        // SAFETY: NUL-terminated by the driver.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned();
        let arch = format!("sm_{major}{minor}");
        let cubin = compile(&arch)?;
        let mut module: sys::CUmodule = std::ptr::null_mut();
        // SAFETY: cubin is a complete CUBIN image from NVRTC; the context is current.
        ck("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, cubin.as_ptr() as *const c_void) })?;
        let f = |n: &str| -> Result<sys::CUfunction, CopyError> {
            let c = CString::new(n).expect("no NUL");
            let mut func: sys::CUfunction = std::ptr::null_mut();
            // SAFETY: module is loaded; c is a NUL-terminated name.
            ck("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut func, module, c.as_ptr()) })?;
            Ok(func)
        };
        let kernels = Kernels {
            save: [f("kvt_save_u4")?, f("kvt_save_u8")?],
            restore: [f("kvt_restore_u4")?, f("kvt_restore_u8")?],
            fill: f("kvt_fill")?,
            verify: f("kvt_verify")?,
            probe: f("kvt_compute_probe")?,
        };
        Ok(Device { ordinal: ordinal as i32, ctx, kernels, sm_count, arch, name })
    }

    /// Makes the device's primary context current on the calling thread.
    ///
    /// # Errors
    /// [`CopyError::Device`] from `cuCtxSetCurrent`.
    pub fn bind(&self) -> Result<(), CopyError> {
        // SAFETY: ctx is a retained primary context, valid for the process.
        ck("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx) })
    }
}

/// Compiles the kernels for `arch` (`sm_XY`) with NVRTC and returns the CUBIN.
fn compile(arch: &str) -> Result<Vec<u8>, CopyError> {
    let err = |call: &str, r: nvrtc::nvrtcResult, log: &str| {
        // SAFETY: returns a pointer to a static string.
        let s = unsafe { CStr::from_ptr(nvrtc::nvrtcGetErrorString(r)) }.to_string_lossy().into_owned();
        CopyError::Device {
            call: call.to_string(),
            message: format!("{s}{}{log}", if log.is_empty() { "" } else { ":\n" }),
        }
    };
    let ok = nvrtc::nvrtcResult::NVRTC_SUCCESS;
    let src = CString::new(SOURCE).expect("no NUL");
    let hdr: Vec<CString> = HEADERS.iter().map(|(_, s)| CString::new(*s).expect("no NUL")).collect();
    let names: Vec<CString> = HEADERS.iter().map(|(n, _)| CString::new(*n).expect("no NUL")).collect();
    let hp: Vec<*const c_char> = hdr.iter().map(|c| c.as_ptr()).collect();
    let np: Vec<*const c_char> = names.iter().map(|c| c.as_ptr()).collect();
    let file = CString::new("kvtier_copy.cu").expect("no NUL");
    let opts: Vec<CString> = [format!("--gpu-architecture={arch}"), "-std=c++17".into(), "-default-device".into()]
        .into_iter()
        .map(|o| CString::new(o).expect("no NUL"))
        .collect();
    let op: Vec<*const c_char> = opts.iter().map(|c| c.as_ptr()).collect();
    let mut prog: nvrtc::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a live NUL-terminated string for the duration of the calls;
    // the program is destroyed on every path below.
    unsafe {
        let r = nvrtc::nvrtcCreateProgram(&mut prog, src.as_ptr(), file.as_ptr(), 2, hp.as_ptr(), np.as_ptr());
        if r != ok {
            return Err(err("nvrtcCreateProgram", r, ""));
        }
        let r = nvrtc::nvrtcCompileProgram(prog, op.len() as i32, op.as_ptr());
        let mut log_len = 0usize;
        nvrtc::nvrtcGetProgramLogSize(prog, &mut log_len);
        let mut log = vec![0u8; log_len.max(1)];
        nvrtc::nvrtcGetProgramLog(prog, log.as_mut_ptr() as *mut c_char);
        let log = String::from_utf8_lossy(&log).trim_end_matches('\0').trim().to_string();
        let result = if r != ok {
            Err(err(&format!("nvrtcCompileProgram({arch})"), r, &log))
        } else {
            let mut n = 0usize;
            let r = nvrtc::nvrtcGetCUBINSize(prog, &mut n);
            let mut cubin = vec![0u8; n];
            if r != ok {
                Err(err("nvrtcGetCUBINSize", r, ""))
            } else {
                let r = nvrtc::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut c_char);
                if r != ok {
                    Err(err("nvrtcGetCUBIN", r, ""))
                } else {
                    Ok(cubin)
                }
            }
        };
        nvrtc::nvrtcDestroyProgram(&mut prog);
        result
    }
}

/// A device allocation (`cuMemAlloc`), freed on drop.
pub(crate) struct DeviceBuffer {
    pub ptr: u64,
    dev: Arc<Device>,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least 1) bytes on `dev`.
    pub fn new(dev: &Arc<Device>, bytes: usize) -> Result<Self, CopyError> {
        dev.bind()?;
        let mut ptr = 0;
        // SAFETY: writes one device address; the context is current.
        ck("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes.max(1)) })?;
        Ok(DeviceBuffer { ptr, dev: dev.clone() })
    }

    /// A buffer holding a copy of `data` (synchronous upload).
    pub fn from_slice<T: Copy>(dev: &Arc<Device>, data: &[T]) -> Result<Self, CopyError> {
        let bytes = std::mem::size_of_val(data);
        let b = Self::new(dev, bytes)?;
        if bytes > 0 {
            // SAFETY: the buffer holds `bytes` bytes; data is a live slice of that size.
            ck("cuMemcpyHtoD", unsafe { sys::cuMemcpyHtoD_v2(b.ptr, data.as_ptr() as *const c_void, bytes) })?;
        }
        Ok(b)
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        // SAFETY: ptr came from cuMemAlloc in this context; owners free it only after the work that
        // uses it has completed (documented at each owner).
        unsafe {
            if self.dev.bind().is_ok() {
                let _ = sys::cuMemFree_v2(self.ptr);
            }
        }
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
    pub fn new(dev: &Arc<Device>) -> Result<Self, CopyError> {
        Self::with_priority(dev, false)
    }

    /// A non-blocking stream on `dev`; `high`: of the device's greatest stream priority (the block
    /// scheduler dispatches its pending CTAs before those of lower-priority streams).
    pub fn with_priority(dev: &Arc<Device>, high: bool) -> Result<Self, CopyError> {
        dev.bind()?;
        let (mut least, mut greatest) = (0i32, 0i32);
        if high {
            // SAFETY: writes two ints; the context is current.
            ck("cuCtxGetStreamPriorityRange", unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) })?;
        }
        let mut raw: sys::CUstream = std::ptr::null_mut();
        // SAFETY: writes one handle; the context is current.
        ck("cuStreamCreateWithPriority", unsafe {
            sys::cuStreamCreateWithPriority(&mut raw, sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32, greatest)
        })?;
        Ok(Stream { raw, dev: dev.clone() })
    }

    /// Blocks until all work queued on the stream has finished.
    pub fn synchronize(&self) -> Result<(), CopyError> {
        self.dev.bind()?;
        // SAFETY: raw is a live stream.
        ck("cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(self.raw) })
    }

    /// Makes the stream wait for `wait` (see [`crate::WaitFor`]).
    pub fn wait_for(&self, wait: crate::WaitFor) -> Result<(), CopyError> {
        match wait {
            crate::WaitFor::Nothing => Ok(()),
            crate::WaitFor::CudaEvent(e) => {
                // SAFETY: the caller passes a live recorded event (WaitFor's contract).
                ck("cuStreamWaitEvent", unsafe { sys::cuStreamWaitEvent(self.raw, e as sys::CUevent, 0) })
            }
            crate::WaitFor::CudaStream(s) => {
                let ev = Event::new(&self.dev)?;
                // SAFETY: s is the caller's live stream; the event is recorded on it and waited
                // on here, then destroyed (the driver keeps the wait valid after destruction).
                unsafe {
                    ck("cuEventRecord", sys::cuEventRecord(ev.raw, s as sys::CUstream))?;
                    ck("cuStreamWaitEvent", sys::cuStreamWaitEvent(self.raw, ev.raw, 0))
                }
            }
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        // SAFETY: drain first so nothing queued outlives the stream's owners' buffers.
        unsafe {
            if self.dev.bind().is_ok() {
                let _ = sys::cuStreamSynchronize(self.raw);
                let _ = sys::cuStreamDestroy_v2(self.raw);
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
    pub fn new(dev: &Arc<Device>) -> Result<Self, CopyError> {
        Self::with_flags(dev, sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32)
    }

    /// A new event with `flags` (`CU_EVENT_*`).
    pub fn with_flags(dev: &Arc<Device>, flags: u32) -> Result<Self, CopyError> {
        dev.bind()?;
        let mut raw: sys::CUevent = std::ptr::null_mut();
        // SAFETY: writes one handle.
        ck("cuEventCreate", unsafe { sys::cuEventCreate(&mut raw, flags) })?;
        Ok(Event { raw, dev: dev.clone() })
    }

    /// Records the event on `stream`.
    pub fn record(&self, stream: sys::CUstream) -> Result<(), CopyError> {
        // SAFETY: both handles are live.
        ck("cuEventRecord", unsafe { sys::cuEventRecord(self.raw, stream) })
    }

    /// Blocks until the event has completed.
    pub fn synchronize(&self) -> Result<(), CopyError> {
        self.dev.bind()?;
        // SAFETY: live event.
        ck("cuEventSynchronize", unsafe { sys::cuEventSynchronize(self.raw) })
    }

    /// Makes `stream` (any context's; 0 = the legacy default stream of this event's device) wait
    /// for the event without a host sync. The device's primary context is pushed for the call and
    /// popped after it, so the calling thread's current context (an engine's) is left as it was.
    pub fn stream_wait(&self, stream: sys::CUstream) -> Result<(), CopyError> {
        // SAFETY: ctx is a retained primary context (valid for the process); the push is undone
        // by the pop below on every path; raw is a live event; the stream is the caller's.
        unsafe {
            ck("cuCtxPushCurrent", sys::cuCtxPushCurrent_v2(self.dev.ctx))?;
            let r = ck("cuStreamWaitEvent", sys::cuStreamWaitEvent(stream, self.raw, 0));
            let mut popped: sys::CUcontext = std::ptr::null_mut();
            let p = ck("cuCtxPopCurrent", sys::cuCtxPopCurrent_v2(&mut popped));
            r.and(p)
        }
    }

    /// True if the event has completed.
    pub fn query(&self) -> Result<bool, CopyError> {
        self.dev.bind()?;
        // SAFETY: live event.
        match unsafe { sys::cuEventQuery(self.raw) } {
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => ck("cuEventQuery", r).map(|_| true),
        }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: live event; destroying a pending event is allowed (resources are released when it
        // completes).
        unsafe {
            let _ = sys::cuEventDestroy_v2(self.raw);
        }
    }
}

/// Launches `f` with one by-value parameter block `args` on `stream`.
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
    ck("cuLaunchKernel", unsafe {
        sys::cuLaunchKernel(f, grid, 1, 1, threads, 1, 1, 0, stream, params.as_mut_ptr(), std::ptr::null_mut())
    })
}
