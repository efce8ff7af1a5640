//! [`CudaArenas`]: real HBM arenas for a geometry (one `cuMemAlloc` per arena or fused buffer), with
//! the pattern fill/verify kernels, as the engine side of replays, tests and benchmarks.

use super::backend::{CudaBackend, CudaOptions};
use super::desc::{self, KvtPatternArgs};
use super::device::{launch, Ctx, Device, DeviceBuffer, Event, Stream};
use crate::copy::pattern;
use crate::copy::{CopyBackend, EngineArenas};
use crate::error::Error;
use crate::geometry::{ArenaBinding, Geometry, Placement};
use crate::key::ContentKey;
use cudarc::driver::result as drv;
use cudarc::driver::sys;
use std::sync::{Arc, Mutex};

/// Device arenas for a geometry on one device.
pub struct CudaArenas {
    dev: Arc<Device>,
    geometry: Geometry,
    binding: ArenaBinding,
    _buffers: Vec<DeviceBuffer>,
    arena_table: DeviceBuffer,
    seg_table: DeviceBuffer,
    segs_per_block: u32,
    stream: Stream,
    options: CudaOptions,
    /// Device buffers of finished pattern jobs, with their sizes in bytes, for the next jobs: a job
    /// never frees device memory (`cuMemFree` waits for all the device's work, so an engine
    /// stand-in that freed would wait for every copy in flight, e.g. a gated layer group).
    scratch: Mutex<Vec<(usize, DeviceBuffer)>>,
}

/// A fill or verify queued on a stream; [`PatternJob::wait`] blocks for it (dropping it waits too,
/// since the kernel reads the job's buffer). Neither frees device memory: the job's buffer goes back
/// to its [`CudaArenas`] for the next job, so ending a job waits for its own kernel only, never for
/// other work on the device.
pub struct PatternJob {
    event: Event,
    /// The job's device buffer (its size in bytes and the buffer): the pages (`n` words), the
    /// seeds (`n` words) and the verify's mismatch word.
    scratch: Option<(usize, DeviceBuffer)>,
    /// Device address of the mismatch word, for a verify.
    mismatch: Option<u64>,
    pages: Vec<u64>,
    keys: Vec<ContentKey>,
    arenas: Arc<CudaArenas>,
    /// The kernel has completed (its event was synchronised): the buffer is free to reuse.
    finished: bool,
}

impl PatternJob {
    /// Waits for the kernel. For a verify, checks the result.
    ///
    /// # Errors
    /// [`Error::Verification`] naming the first mismatching page, arena and byte; device errors.
    pub fn wait(mut self) -> Result<(), Error> {
        self.event.synchronize()?;
        self.finished = true;
        let Some(m) = self.mismatch else { return Ok(()) };
        let mut code = [0u64];
        self.arenas.dev.bind()?;
        // SAFETY: m is one u64 of the job's buffer, written by the completed kernel.
        unsafe { drv::memcpy_dtoh_sync(&mut code, m) }.ctx("cuMemcpyDtoH")?;
        let code = code[0];
        if code == u64::MAX {
            return Ok(());
        }
        let n_arenas = self.arenas.geometry.arenas().len() as u64;
        let (i, a) = ((code / n_arenas) as usize, (code % n_arenas) as usize);
        let spec = &self.arenas.geometry.arenas()[a];
        let mut chunk = vec![0u8; spec.bytes_per_page as usize];
        let src = self.arenas.binding.bases()[a] + self.pages[i] * spec.page_stride;
        // SAFETY: src..src+len lies inside arena a (page validated); chunk has len bytes.
        unsafe { drv::memcpy_dtoh_sync(&mut chunk, src) }.ctx("cuMemcpyDtoH")?;
        let off = pattern::first_mismatch(&self.keys[i], a, &chunk).unwrap_or(0);
        Err(Error::Verification { page: self.pages[i], arena: spec.name.clone(), byte: off as u64, key: self.keys[i] })
    }
}

impl Drop for PatternJob {
    fn drop(&mut self) {
        if !self.finished {
            self.finished = self.event.synchronize().is_ok();
        }
        // Seeded bug: the job frees its buffer (`cuMemFree`, which waits for the whole device).
        if self.finished && !crate::seeded::seeded("pattern-job-frees") {
            if let Some(b) = self.scratch.take() {
                self.arenas.scratch.lock().unwrap_or_else(|p| p.into_inner()).push(b);
            }
        }
        // Otherwise (a failed synchronisation: the context is broken) the buffer is freed here.
    }
}

impl CudaArenas {
    /// Allocates arenas for `geometry` on device `device` (`geometry.pages()` pages each); new
    /// backends over them use `options`.
    ///
    /// # Errors
    /// [`crate::CopyError::Unavailable`] / device errors (`CUDA_ERROR_OUT_OF_MEMORY`) as [`Error::Copy`].
    pub fn new(device: u32, geometry: &Geometry, options: CudaOptions) -> Result<Arc<Self>, Error> {
        let dev = Device::get(device)?;
        let mut buffers: Vec<DeviceBuffer> = Vec::new();
        let mut fused: Vec<(u32, usize)> = Vec::new();
        let mut bases = Vec::with_capacity(geometry.arenas().len());
        for a in geometry.arenas() {
            match a.placement {
                Placement::Own => {
                    let b = DeviceBuffer::new(&dev, (a.pages * a.page_stride) as usize)?;
                    bases.push(b.ptr);
                    buffers.push(b);
                }
                Placement::Fused { buffer, offset } => {
                    let idx = match fused.iter().find(|(b, _)| *b == buffer) {
                        Some(&(_, i)) => i,
                        None => {
                            buffers.push(DeviceBuffer::new(&dev, (a.pages * a.page_stride) as usize)?);
                            fused.push((buffer, buffers.len() - 1));
                            buffers.len() - 1
                        }
                    };
                    bases.push(buffers[idx].ptr + offset);
                }
            }
        }
        let binding = ArenaBinding::new(geometry, bases)?;
        let segs = desc::segment_table(geometry)?;
        Ok(Arc::new(CudaArenas {
            arena_table: DeviceBuffer::from_slice(&dev, &desc::arena_table(geometry, &binding))?,
            seg_table: DeviceBuffer::from_slice(&dev, &segs)?,
            segs_per_block: segs.len() as u32,
            stream: Stream::new(&dev)?,
            _buffers: buffers,
            geometry: geometry.clone(),
            binding,
            options,
            dev,
            scratch: Mutex::new(Vec::new()),
        }))
    }

    /// The arenas' device base addresses.
    pub fn binding(&self) -> &ArenaBinding {
        &self.binding
    }

    /// The device ordinal.
    pub fn device(&self) -> u32 {
        self.dev.ordinal as u32
    }

    /// The arenas' own stream (raw `CUstream`), used by [`EngineArenas::fill`]/`verify`.
    pub fn stream(&self) -> u64 {
        self.stream.raw as u64
    }

    fn check(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), Error> {
        crate::copy::check_pages_and_keys(&self.geometry, pages, keys)
    }

    /// Queues a fill (`verify == false`) or verify of `pages[i]` with the pattern of `keys[i]` on
    /// `stream` (a raw `CUstream` of this device), after a delay of `delay_ns` ns inside the kernel
    /// (ordering tests use it to make the kernel slow). Returns at once.
    ///
    /// # Errors
    /// [`Error::PageKeyCount`] / [`crate::CopyError::PageOutOfRange`] for bad input (nothing queued); device errors.
    pub fn pattern_on(
        self: &Arc<Self>,
        stream: u64,
        pages: &[u64],
        keys: &[ContentKey],
        verify: bool,
        delay_ns: u64,
    ) -> Result<PatternJob, Error> {
        self.check(pages, keys)?;
        self.dev.bind()?;
        let n = pages.len();
        // One buffer: the pages, the seeds, the mismatch word (no match yet: u64::MAX).
        let mut words = Vec::with_capacity(2 * n + 1);
        words.extend_from_slice(pages);
        words.extend(keys.iter().map(pattern::seed));
        words.push(u64::MAX);
        let bytes = std::mem::size_of_val(&words[..]);
        let (size, buf) = self.take_scratch(bytes)?;
        let args = KvtPatternArgs {
            arenas: self.arena_table.ptr,
            segs: self.seg_table.ptr,
            pages: buf.ptr,
            seeds: buf.ptr + 8 * n as u64,
            mismatch: if verify { buf.ptr + 16 * n as u64 } else { 0 },
            n: n as u64,
            delay_ns,
            segs_per_block: self.segs_per_block,
            n_arenas: self.geometry.arenas().len() as u32,
        };
        let mismatch = verify.then_some(args.mismatch);
        let k = &self.dev.kernels;
        let f = if verify { k.verify } else { k.fill };
        let event = Event::new(&self.dev)?;
        let grid = (self.dev.sm_count * 4).max(1);
        let queued = (|| -> Result<(), crate::CopyError> {
            // Ordered on the caller's stream (no legacy-stream copy); the driver stages pageable
            // memory before the call returns, so `words` may go.
            // SAFETY: the buffer holds at least `bytes` bytes and no queued work uses it (a new
            // allocation, or one given back after its job's kernel completed).
            unsafe { drv::memcpy_htod_async(args.pages, &words, stream as sys::CUstream) }.ctx("cuMemcpyHtoDAsync")?;
            // SAFETY: args is kvt_pattern_args; its buffer lives in the returned job, whose drop
            // waits for the kernel; pages were checked against the arenas' page count.
            unsafe { launch(f, grid, 256, stream as sys::CUstream, &args)? };
            event.record(stream as sys::CUstream)
        })();
        if let Err(e) = queued {
            // Work may be queued on the buffer: it is freed (`cuMemFree` waits for it), not reused.
            drop(buf);
            return Err(e.into());
        }
        Ok(PatternJob {
            event,
            scratch: Some((size, buf)),
            mismatch,
            pages: pages.to_vec(),
            keys: keys.to_vec(),
            arenas: self.clone(),
            finished: false,
        })
    }

    /// A free device buffer of at least `bytes` bytes: the smallest fitting one that a finished job
    /// gave back, else a new one (`cuMemAlloc` of `bytes` rounded up to a power of two, so buffers
    /// are reused across batch sizes).
    fn take_scratch(&self, bytes: usize) -> Result<(usize, DeviceBuffer), Error> {
        let mut free = self.scratch.lock().unwrap_or_else(|p| p.into_inner());
        let best =
            free.iter().enumerate().filter(|(_, (s, _))| *s >= bytes).min_by_key(|(_, (s, _))| *s).map(|(i, _)| i);
        if let Some(i) = best {
            return Ok(free.swap_remove(i));
        }
        drop(free);
        let size = bytes.next_power_of_two();
        Ok((size, DeviceBuffer::new(&self.dev, size)?))
    }
}

impl EngineArenas for Arc<CudaArenas> {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    fn fill(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), Error> {
        self.pattern_on(self.stream(), pages, keys, false, 0)?.wait()
    }
    fn verify(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), Error> {
        self.pattern_on(self.stream(), pages, keys, true, 0)?.wait()
    }
    fn backend(&self) -> Result<Box<dyn CopyBackend>, Error> {
        let b = CudaBackend::new(self.device(), &self.geometry, self.binding.clone(), self.options)?;
        Ok(Box::new(b.keep_alive(self.clone())))
    }
}

impl std::fmt::Debug for CudaArenas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaArenas")
            .field("model", &self.geometry.model())
            .field("pages", &self.geometry.pages())
            .field("binding", &self.binding)
            .finish()
    }
}

impl std::fmt::Debug for PatternJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PatternJob").field("pages", &self.pages.len()).field("finished", &self.finished).finish()
    }
}
