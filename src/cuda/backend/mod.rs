//! [`CudaBackend`]: the [`CopyBackend`] over the gather/scatter kernels of `cuda/kvtier_copy.cu`.
//!
//! Per backend: one arena table and one segment table in device memory (uploaded at construction),
//! two non-blocking streams (saves and restores run concurrently), pooled descriptor buffers for
//! pair lists of more than [`INLINE_PAIRS`] pairs (pinned host copy + device copy, returned to the
//! pool only after the batch's completion event), and, in staged mode, a lazily allocated HBM
//! staging buffer per direction. With [`CudaOptions::reserved_sms`] every stream of the backend
//! belongs to a green context of a few SMs (see `green.rs`).
//!
//! A batch is: validate on the host ([`validate_batch`]: no out-of-range id reaches a kernel) ->
//! `cuStreamWaitEvent` for its [`WaitFor`] -> pair upload (large batches) -> one kernel launch (zero
//! copy: the kernel reads and writes host slots through the pool's device alias) or the staged
//! pipeline -> event record. The completion shares the event with the tier's handles
//! ([`Completion::shared_event`]), so an engine's stream can wait on it after the completion is
//! gone; `wait` is `cuEventSynchronize`.

use super::desc::{self, KvtCopyArgs, KvtPair, COPY_THREADS, FLAG_SLOT_IS_INDEX, INLINE_PAIRS};
use super::device::{ck, launch, Ctx, Device, DeviceBuffer, Event, Stream};
use super::green::{Isolation, Partition, Side, SmPartition};
use crate::copy::{validate_batch, Completion, CopyBackend, CopyEvent, CopyPair, Direction, WaitFor};
use crate::error::CopyError;
use crate::geometry::{ArenaBinding, Geometry};
use crate::slab::pool::{HostPool, PoolRegion};
use cudarc::driver::result as drv;
use cudarc::driver::sys;
use std::any::Any;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

mod layers;
mod options;
mod staged;
#[cfg(all(test, not(loom)))]
mod tests;

pub use options::{CopyMode, CudaOptions};
use staged::{ramp, Staging};

/// The pool's registration with the driver, kept in [`HostPool::with_registrations`] so it is
/// dropped (unregistered) before the pool unmaps. Shared by every backend bound to the pool, on any
/// device (the registration is portable).
struct CudaRegistration {
    host_base: usize,
    bytes: u64,
    devices: Mutex<Vec<Arc<Device>>>,
}

impl Drop for CudaRegistration {
    fn drop(&mut self) {
        let devices = self.devices.lock().unwrap_or_else(|p| p.into_inner());
        // Drain every context that holds an alias of the region before unregistering, so no copy
        // still reads or writes it (green contexts' work belongs to the primary context).
        for d in devices.iter() {
            if d.bind().is_ok() {
                let _ = drv::ctx::synchronize();
            }
        }
        if let Some(d) = devices.first() {
            let _ = d.bind();
        }
        // Host registration has no `driver::result` wrapper.
        // SAFETY: the region was registered by us with this base address and nothing uses it now.
        let _ = unsafe { sys::cuMemHostUnregister(self.host_base as *mut c_void) };
    }
}

/// The bound pool as the kernels see it.
#[derive(Copy, Clone, Debug)]
struct BoundPool {
    alias: u64,
    capacity: u32,
    slot_bytes: u64,
}

/// Pinned host memory (`cuMemHostAlloc`), freed on drop.
struct Pinned {
    ptr: *mut u8,
    dev: Arc<Device>,
}

// SAFETY: plain memory owned by this value.
unsafe impl Send for Pinned {}
// SAFETY: as above.
unsafe impl Sync for Pinned {}

impl Pinned {
    fn new(dev: &Arc<Device>, bytes: usize) -> Result<Self, CopyError> {
        dev.bind()?;
        // SAFETY: returns `bytes` of pinned memory owned by this value.
        let p = unsafe { drv::malloc_host(bytes.max(1), 0) }.ctx("cuMemHostAlloc")?;
        Ok(Pinned { ptr: p as *mut u8, dev: dev.clone() })
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let _ = self.dev.bind();
        // SAFETY: allocated by cuMemHostAlloc; owners free only after the copies reading it finished.
        let _ = unsafe { drv::free_host(self.ptr as *mut c_void) };
    }
}

/// A pooled pair-list buffer: pinned host copy and device copy of up to `cap` pairs.
struct DescBuf {
    cap: usize,
    host: Pinned,
    dev: DeviceBuffer,
}

/// One direction's submission state.
struct Lane {
    stream: Stream,
    submit: Mutex<Option<Staging>>,
}

impl Lane {
    /// After a failed submission (the caller holds `staging`, the lane's submit lock): blocks
    /// until everything queued on the lane's stream and on its staging copy and head streams has
    /// run, so no copy the failed batch queued still reads or writes a buffer about to be given
    /// back. Errors of the synchronisation itself are the failure already being reported.
    fn drain_after_failure(&self, staging: &Option<Staging>) {
        let _ = self.stream.synchronize();
        if let Some(s) = staging {
            let _ = s.copy.synchronize();
            let _ = s.head.synchronize();
        }
    }
}

/// Shared state of a backend, kept alive by in-flight completions.
struct Inner {
    dev: Arc<Device>,
    geometry: Geometry,
    options: CudaOptions,
    arena_table: DeviceBuffer,
    seg_table: DeviceBuffer,
    segs_per_block: u32,
    /// Data bytes of a block before segment `s`.
    seg_cum: Vec<u64>,
    /// Byte range `[start, end)` of segment `s` inside a host slot.
    seg_span: Vec<(u64, u64)>,
    save: Lane,
    restore: Lane,
    descs: Mutex<Vec<DescBuf>>,
    /// The copy partition the backend's streams belong to, if isolated.
    partition: Option<Arc<Partition>>,
    isolation: Isolation,
}

impl Inner {
    fn take_desc(&self, n: usize) -> Result<DescBuf, CopyError> {
        let mut pool = self.descs.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = pool.iter().position(|d| d.cap >= n) {
            return Ok(pool.swap_remove(i));
        }
        drop(pool);
        let cap = n.next_power_of_two().max(256);
        let bytes = cap * std::mem::size_of::<KvtPair>();
        Ok(DescBuf { cap, host: Pinned::new(&self.dev, bytes)?, dev: DeviceBuffer::new(&self.dev, bytes)? })
    }

    fn give_desc(&self, d: DescBuf) {
        self.descs.lock().unwrap_or_else(|p| p.into_inner()).push(d);
    }

    /// A new stream for the backend's work: in the copy partition when isolated.
    fn new_stream(&self) -> Result<Stream, CopyError> {
        new_stream(&self.dev, self.partition.as_deref(), self.options.high_priority)
    }
}

fn new_stream(dev: &Arc<Device>, partition: Option<&Partition>, high: bool) -> Result<Stream, CopyError> {
    match partition {
        Some(p) => p.stream(Side::Copy, high),
        None => Stream::with_priority(dev, high),
    }
}

/// The CUDA copy backend for one rank: one device, its arenas (raw device pointers), the pool.
pub struct CudaBackend {
    inner: Arc<Inner>,
    pool: Option<BoundPool>,
    _keepalive: Option<Arc<dyn Any + Send + Sync>>,
}

impl CudaBackend {
    /// A backend on device `device` (ordinal) over the arenas at `binding`.
    ///
    /// Compiles the kernels on first use of the device (NVRTC, about 0.2 s) and uploads the arena
    /// and segment tables.
    ///
    /// # Errors
    /// [`CopyError::Unavailable`] without a usable CUDA device or NVRTC; [`CopyError::ArenaCount`]
    /// for a binding of another geometry, [`CopyError::ChunkTooLarge`] for a chunk of 4 GiB or
    /// more, [`CopyError::BadArgument`] for bad options; driver errors.
    pub fn new(
        device: u32,
        geometry: &Geometry,
        binding: ArenaBinding,
        options: CudaOptions,
    ) -> Result<Self, CopyError> {
        if binding.bases().len() != geometry.arenas().len() {
            return Err(CopyError::ArenaCount { given: binding.bases().len(), arenas: geometry.arenas().len() });
        }
        for (what, v) in [
            ("save_unroll", options.save_unroll),
            ("restore_unroll", options.restore_unroll),
            ("staged_unroll", options.staged_unroll),
        ] {
            if v != 4 && v != 8 {
                return Err(CopyError::BadArgument { name: what, value: v.into(), allowed: "4 or 8" });
            }
        }
        for (name, v) in [
            ("save_ctas", options.save_ctas as u64),
            ("restore_ctas", options.restore_ctas as u64),
            ("staged_ctas", options.staged_ctas as u64),
            ("staged_piece_blocks", options.staged_piece_blocks as u64),
            ("staged_first_piece_bytes", options.staged_first_piece_bytes),
        ] {
            if v == 0 {
                return Err(CopyError::BadArgument { name, value: 0, allowed: "at least 1" });
            }
        }
        let dev = Device::get(device)?;
        let segs = desc::segment_table(geometry)?;
        let offs = geometry.chunk_offsets();
        let mut seg_cum = Vec::with_capacity(segs.len());
        let mut cum = 0u64;
        for sg in &segs {
            seg_cum.push(cum);
            cum += sg.len as u64;
        }
        let seg_span = segs
            .iter()
            .map(|sg| {
                let start = offs[sg.arena as usize] + sg.offset as u64;
                (start, start + sg.len as u64)
            })
            .collect();
        let high = options.high_priority;
        let (partition, isolation) = match options.reserved_sms {
            0 => (None, Isolation::Off),
            n => match Partition::get(&dev, n) {
                Ok(p) => {
                    let iso = Isolation::GreenContext { copy_sms: p.copy_sms, engine_sms: p.engine_sms };
                    (Some(p), iso)
                }
                Err(reason) => (None, Isolation::Unavailable { reason }),
            },
        };
        let p = partition.as_deref();
        let inner = Inner {
            arena_table: DeviceBuffer::from_slice(&dev, &desc::arena_table(geometry, &binding))?,
            seg_table: DeviceBuffer::from_slice(&dev, &segs)?,
            segs_per_block: segs.len() as u32,
            seg_cum,
            seg_span,
            save: Lane { stream: new_stream(&dev, p, high)?, submit: Mutex::new(None) },
            restore: Lane { stream: new_stream(&dev, p, high)?, submit: Mutex::new(None) },
            descs: Mutex::new(Vec::new()),
            isolation,
            partition: partition.clone(),
            geometry: geometry.clone(),
            options,
            dev,
        };
        Ok(CudaBackend { inner: Arc::new(inner), pool: None, _keepalive: None })
    }

    /// Keeps `owner` (e.g. the arenas' allocations) alive as long as the backend.
    pub fn keep_alive(mut self, owner: Arc<dyn Any + Send + Sync>) -> Self {
        self._keepalive = Some(owner);
        self
    }

    /// The options in use.
    pub fn options(&self) -> &CudaOptions {
        &self.inner.options
    }

    /// Device name and architecture, e.g. `NVIDIA H200 (sm_90, 132 SMs)`.
    pub fn device_description(&self) -> String {
        let d = &self.inner.dev;
        format!("{} ({}, {} SMs)", d.name, d.arch, d.sm_count)
    }

    /// The raw `CUstream` the backend queues `dir`'s copies on (benchmarks record timing events on
    /// it). Work queued there by others is ordered with the backend's copies. Every batch's
    /// completion is recorded on it (a staged batch's other streams join it first).
    pub fn stream(&self, dir: Direction) -> u64 {
        let lane = if dir == Direction::Save { &self.inner.save } else { &self.inner.restore };
        lane.stream.raw as u64
    }

    /// Where the copy kernels run: [`Isolation::Off`] without [`CudaOptions::reserved_sms`],
    /// [`Isolation::GreenContext`] with the SM counts of the split, or
    /// [`Isolation::Unavailable`] with the reason the backend fell back to the whole device.
    pub fn isolation(&self) -> &Isolation {
        &self.inner.isolation
    }

    /// The engine's side of the SM split when the backend is isolated
    /// ([`Isolation::GreenContext`]): streams whose kernels never share an SM with the copy
    /// kernels. `None` otherwise. Every backend of a device with the same
    /// [`CudaOptions::reserved_sms`] shares one split.
    pub fn sm_partition(&self) -> Option<SmPartition> {
        self.inner.partition.clone().map(|inner| SmPartition { inner })
    }

    /// Launches the staged path's HBM kernel alone: gathers (save) every arena of `batch[i]`
    /// into slot `i` of the device buffer at `buf` (slot stride = the geometry's slot bytes), or
    /// scatters (restore) slot `i` into the arenas, on `stream` with `ctas` CTAs. For benchmarks
    /// that time this kernel beside an engine's kernels. Not a stable API.
    ///
    /// # Safety
    /// `buf` must hold `batch.len()` slots of device memory; nothing else may use the pages or the
    /// buffer until the kernel completes; `stream` must be a live stream of this device.
    ///
    /// # Errors
    /// [`CopyError::PageOutOfRange`], [`CopyError::BadArgument`] for more than 64 pairs or a zero
    /// `ctas`; driver errors.
    #[doc(hidden)]
    pub unsafe fn launch_hbm_kernel(
        &self,
        dir: Direction,
        batch: &[CopyPair],
        buf: u64,
        stream: u64,
        ctas: u32,
    ) -> Result<(), CopyError> {
        let inner = &self.inner;
        if batch.len() > INLINE_PAIRS {
            return Err(CopyError::BadArgument {
                name: "pairs of an HBM-staged batch",
                value: batch.len() as u64,
                allowed: "at most 64",
            });
        }
        if ctas == 0 {
            return Err(CopyError::BadArgument { name: "ctas", value: 0, allowed: "at least 1" });
        }
        validate_batch(batch, inner.geometry.pages(), batch.len() as u32, dir)?;
        inner.dev.bind()?;
        let mut args = self.base_args(buf, inner.geometry.slot_bytes(), batch);
        args.flags = FLAG_SLOT_IS_INDEX;
        let k = &inner.dev.kernels;
        let u = if inner.options.staged_unroll == 8 { 1 } else { 0 };
        let f = if dir == Direction::Save { k.save[u] } else { k.restore[u] };
        // SAFETY: args is kvt_copy_args with validated pages, FLAG_SLOT_IS_INDEX keeps every access
        // inside batch.len() slots of `buf` (caller's contract), the tables live in `inner`.
        unsafe { launch(f, ctas, COPY_THREADS, stream as sys::CUstream, &args) }
    }

    /// Kernel arguments for `batch` (at most [`INLINE_PAIRS`] pairs, inline) over `host_base`.
    fn base_args(&self, host_base: u64, slot_bytes: u64, batch: &[CopyPair]) -> KvtCopyArgs {
        let inner = &self.inner;
        let mut args = KvtCopyArgs {
            arenas: inner.arena_table.ptr,
            segs: inner.seg_table.ptr,
            pairs: 0,
            host_base,
            slot_bytes,
            item_begin: 0,
            item_end: batch.len() as u64 * inner.segs_per_block as u64,
            segs_per_block: inner.segs_per_block,
            flags: 0,
            inline_pairs: [KvtPair::default(); INLINE_PAIRS],
        };
        for (d, p) in args.inline_pairs.iter_mut().zip(batch) {
            *d = KvtPair { gpu_page: p.gpu_page, slot: p.slot, reserved: 0 };
        }
        args
    }

    /// The device alias of host slot 0 of the bound pool, if bound.
    pub fn pool_alias(&self) -> Option<u64> {
        self.pool.map(|p| p.alias)
    }

    /// Binds host memory described by `region` (which need not come from a [`HostPool`]): registers
    /// it with the driver once (portable, device-mapped), storing the registration in `registry`,
    /// reusing one already there for the same region, and takes this device's alias of it.
    ///
    /// # Safety
    /// `region` must describe mapped memory that stays mapped until `registry` (the registration
    /// inside it) is dropped; the registry must be dropped before the memory is unmapped.
    ///
    /// # Errors
    /// [`CopyError::SlotSizeMismatch`] if the slot size differs from the geometry's,
    /// [`CopyError::BadPoolRegion`] if the region is not 16-byte aligned or shorter than its
    /// slots; driver errors.
    pub unsafe fn bind_region(
        &mut self,
        region: PoolRegion,
        registry: &mut Vec<Box<dyn Any + Send + Sync>>,
    ) -> Result<(), CopyError> {
        let g = &self.inner.geometry;
        if region.slot_bytes != g.slot_bytes() {
            return Err(CopyError::SlotSizeMismatch { pool: region.slot_bytes, geometry: g.slot_bytes() });
        }
        if region.host_base % 16 != 0 || (region.capacity as u64) * region.slot_bytes > region.bytes {
            return Err(CopyError::BadPoolRegion {
                base: region.host_base as u64,
                bytes: region.bytes,
                capacity: region.capacity,
            });
        }
        self.drain()?;
        let dev = &self.inner.dev;
        dev.bind()?;
        let existing = registry.iter().find_map(|b| {
            b.downcast_ref::<CudaRegistration>().filter(|r| r.host_base == region.host_base && r.bytes == region.bytes)
        });
        let reg = match existing {
            Some(r) => r,
            None => {
                let flags = sys::CU_MEMHOSTREGISTER_PORTABLE | sys::CU_MEMHOSTREGISTER_DEVICEMAP;
                // SAFETY: the caller guarantees the region is mapped until the registration (pushed
                // into the registry below) is dropped, which unregisters it.
                ck("cuMemHostRegister", unsafe {
                    sys::cuMemHostRegister_v2(region.host_base as *mut c_void, region.bytes as usize, flags)
                })?;
                registry.push(Box::new(CudaRegistration {
                    host_base: region.host_base,
                    bytes: region.bytes,
                    devices: Mutex::new(Vec::new()),
                }));
                registry.last().and_then(|b| b.downcast_ref::<CudaRegistration>()).expect("just pushed")
            }
        };
        {
            let mut devs = reg.devices.lock().unwrap_or_else(|p| p.into_inner());
            if !devs.iter().any(|d| d.ordinal == dev.ordinal) {
                devs.push(dev.clone());
            }
        }
        let mut alias = 0u64;
        // SAFETY: the region is registered (portable, device-mapped); writes one device address.
        ck("cuMemHostGetDevicePointer", unsafe {
            sys::cuMemHostGetDevicePointer_v2(&mut alias, region.host_base as *mut c_void, 0)
        })?;
        self.pool = Some(BoundPool { alias, capacity: region.capacity, slot_bytes: region.slot_bytes });
        Ok(())
    }

    /// Blocks until every copy submitted so far has finished.
    ///
    /// # Errors
    /// Driver errors (a failed copy).
    pub fn drain(&self) -> Result<(), CopyError> {
        self.inner.save.stream.synchronize()?;
        self.inner.restore.stream.synchronize()
    }

    fn submit(&self, batch: &[CopyPair], wait: WaitFor, dir: Direction) -> Result<Box<dyn Completion>, CopyError> {
        let pool = self.pool.ok_or(CopyError::PoolNotBound)?;
        let inner = &self.inner;
        validate_batch(batch, inner.geometry.pages(), pool.capacity, dir)?;
        inner.dev.bind()?;
        let lane = if dir == Direction::Save { &inner.save } else { &inner.restore };
        let event = Event::new(&inner.dev)?;
        let mut staging = lane.submit.lock().unwrap_or_else(|p| p.into_inner());
        let stream = lane.stream.raw;
        lane.stream.wait_for(wait)?;
        let (args, desc) = self.upload_pairs(batch, pool, stream)?;
        let staged = self.is_staged(batch.len());
        let result = match staged {
            // SAFETY: args is kvt_copy_args for the whole batch over the pool alias; the tables live
            // in `inner` (kept alive by the completion), the pair list in `desc` (released after
            // completion), the host slots in the registered pool (the registration drains before
            // unregistering), and the arenas are the engine's (trait contract). Every id was
            // validated above.
            false => unsafe { self.launch_zero_copy(&args, dir, stream) },
            true => self.staged(&mut staging, &args, batch, pool, dir, stream),
        };
        let result = result.and_then(|_| event.record(stream));
        if result.is_err() {
            // Nothing may be released while queued work could still use it.
            lane.drain_after_failure(&staging);
        }
        drop(staging);
        if let Err(e) = result {
            if let Some(d) = desc {
                inner.give_desc(d);
            }
            return Err(e);
        }
        Ok(Box::new(CudaCompletion {
            event: Arc::new(BatchEvent(event)),
            desc,
            inner: self.inner.clone(),
            done: false,
            layers: None,
        }))
    }

    /// Kernel arguments for the whole of `batch` over the pool alias; a batch of more than
    /// [`INLINE_PAIRS`] pairs gets a pooled descriptor buffer, uploaded on `stream`, which the
    /// caller must keep until the batch's completion (or give back after a failed submission).
    fn upload_pairs(
        &self,
        batch: &[CopyPair],
        pool: BoundPool,
        stream: sys::CUstream,
    ) -> Result<(KvtCopyArgs, Option<DescBuf>), CopyError> {
        let inner = &self.inner;
        let mut args = self.base_args(pool.alias, pool.slot_bytes, &batch[..batch.len().min(INLINE_PAIRS)]);
        args.item_end = batch.len() as u64 * inner.segs_per_block as u64;
        if batch.len() <= INLINE_PAIRS {
            return Ok((args, None));
        }
        let d = inner.take_desc(batch.len())?;
        let bytes = std::mem::size_of_val(batch);
        // SAFETY: d.host holds cap >= batch.len() pairs; CopyPair and KvtPair are both repr(C)
        // {u64, u32, u32}; the pinned buffer is not in use (pooled buffers return only after
        // their completion), and it stays alive (in the completion) until the copy has run.
        let up = unsafe {
            std::ptr::copy_nonoverlapping(batch.as_ptr() as *const u8, d.host.ptr, bytes);
            let host = std::slice::from_raw_parts(d.host.ptr as *const u8, bytes);
            drv::memcpy_htod_async(d.dev.ptr, host, stream).ctx("cuMemcpyHtoDAsync")
        };
        if let Err(e) = up {
            inner.give_desc(d);
            return Err(e);
        }
        args.pairs = d.dev.ptr;
        args.inline_pairs = [KvtPair::default(); INLINE_PAIRS];
        Ok((args, Some(d)))
    }

    /// Whether a batch of `n` blocks takes the staged path.
    fn is_staged(&self, n: usize) -> bool {
        let o = &self.inner.options;
        match o.mode {
            CopyMode::ZeroCopy => false,
            CopyMode::Staged => true,
            CopyMode::Auto => n >= o.auto_staged_min_blocks as usize,
        }
    }

    /// Launches the zero-copy kernel of `dir` over `args` (its item range) on `stream`.
    ///
    /// # Safety
    /// As the zero-copy launch in `submit`: `args` over the pool alias with validated ids, and its
    /// pair list alive until the launch completes.
    unsafe fn launch_zero_copy(
        &self,
        args: &KvtCopyArgs,
        dir: Direction,
        stream: sys::CUstream,
    ) -> Result<(), CopyError> {
        let o = &self.inner.options;
        let k = &self.inner.dev.kernels;
        let unroll_idx = |u: u32| if u == 8 { 1 } else { 0 };
        let (f, ctas) = match dir {
            Direction::Save => (k.save[unroll_idx(o.save_unroll)], o.save_ctas),
            Direction::Restore => (k.restore[unroll_idx(o.restore_unroll)], o.restore_ctas),
        };
        // SAFETY: the caller's contract.
        unsafe { launch(f, ctas, COPY_THREADS, stream, args) }
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // Teardown drains in-flight copies first (completions also keep the shared state alive).
        let _ = self.drain();
    }
}

impl CopyBackend for CudaBackend {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn geometry(&self) -> &Geometry {
        &self.inner.geometry
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        let region = pool.region();
        // SAFETY: the registration is stored in the pool's own registry, which the pool drops
        // before it unmaps the region (HostPool::with_registrations contract).
        pool.with_registrations(|reg| unsafe { self.bind_region(region, reg) })
    }
    unsafe fn save(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        self.submit(batch, wait, Direction::Save)
    }
    unsafe fn restore(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        self.submit(batch, wait, Direction::Restore)
    }
    fn layer_copy(&self) -> Option<&dyn crate::copy::LayerCopy> {
        Some(self)
    }
}

/// The completion event of one batch, owned by its [`CudaCompletion`] and by every handle that
/// took it ([`Completion::shared_event`]); destroyed when the last owner drops it.
struct BatchEvent(Event);

impl CopyEvent for BatchEvent {
    fn raw(&self) -> u64 {
        self.0.raw as u64
    }
    fn stream_wait(&self, stream: u64) -> Result<(), CopyError> {
        self.0.stream_wait(stream as sys::CUstream)
    }
}

/// A submitted CUDA batch: its completion event, and the descriptor buffer it reads.
struct CudaCompletion {
    event: Arc<BatchEvent>,
    desc: Option<DescBuf>,
    inner: Arc<Inner>,
    done: bool,
    /// A layer-wise batch's per-group events.
    layers: Option<Arc<layers::GroupEvents>>,
}

impl CudaCompletion {
    fn finish(&mut self) {
        self.done = true;
        if let Some(d) = self.desc.take() {
            self.inner.give_desc(d);
        }
    }
}

impl Completion for CudaCompletion {
    fn poll(&mut self) -> Result<bool, CopyError> {
        if self.done {
            return Ok(true);
        }
        match self.event.0.query() {
            Ok(true) => {
                self.finish();
                Ok(true)
            }
            Ok(false) => Ok(false),
            Err(e) => {
                // A failed query means a sticky context error: the work is over either way.
                self.finish();
                Err(e)
            }
        }
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        if self.done {
            return Ok(());
        }
        let r = self.event.0.synchronize();
        self.finish();
        r
    }
    fn shared_event(&self) -> Option<Arc<dyn CopyEvent>> {
        Some(self.event.clone())
    }
    fn layer_readiness(&self) -> Option<Arc<dyn crate::copy::LayerReadiness>> {
        self.layers.clone().map(|l| l as Arc<dyn crate::copy::LayerReadiness>)
    }
}

impl Drop for CudaCompletion {
    fn drop(&mut self) {
        if !self.done {
            // Never release the descriptor buffer under a running copy.
            let _ = self.event.0.synchronize();
            self.finish();
        }
    }
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("model", &self.inner.geometry.model())
            .field("options", &self.inner.options)
            .field("pool_bound", &self.pool.is_some())
            .finish()
    }
}
