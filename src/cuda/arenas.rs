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
use std::sync::Arc;

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
}

/// A fill or verify queued on a stream; [`PatternJob::wait`] blocks for it (dropping it waits too,
/// since the kernel reads the job's buffers).
pub struct PatternJob {
    event: Event,
    mismatch: Option<DeviceBuffer>,
    _bufs: (DeviceBuffer, DeviceBuffer),
    pages: Vec<u64>,
    keys: Vec<ContentKey>,
    arenas: Arc<CudaArenas>,
    done: bool,
}

impl PatternJob {
    /// Waits for the kernel. For a verify, checks the result.
    ///
    /// # Errors
    /// [`Error::Verification`] naming the first mismatching page, arena and byte; device errors.
    pub fn wait(mut self) -> Result<(), Error> {
        self.done = true;
        self.event.synchronize()?;
        let Some(m) = &self.mismatch else { return Ok(()) };
        let mut code = [0u64];
        self.arenas.dev.bind()?;
        // SAFETY: m holds one u64, written by the completed kernel.
        unsafe { drv::memcpy_dtoh_sync(&mut code, m.ptr) }.ctx("cuMemcpyDtoH")?;
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
        if !self.done {
            let _ = self.event.synchronize();
        }
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
        let seeds: Vec<u64> = keys.iter().map(pattern::seed).collect();
        let pbuf = DeviceBuffer::from_slice(&self.dev, pages)?;
        let sbuf = DeviceBuffer::from_slice(&self.dev, &seeds)?;
        let mismatch = if verify { Some(DeviceBuffer::from_slice(&self.dev, &[u64::MAX])?) } else { None };
        let args = KvtPatternArgs {
            arenas: self.arena_table.ptr,
            segs: self.seg_table.ptr,
            pages: pbuf.ptr,
            seeds: sbuf.ptr,
            mismatch: mismatch.as_ref().map_or(0, |m| m.ptr),
            n: pages.len() as u64,
            delay_ns,
            segs_per_block: self.segs_per_block,
            n_arenas: self.geometry.arenas().len() as u32,
        };
        let k = &self.dev.kernels;
        let f = if verify { k.verify } else { k.fill };
        let event = Event::new(&self.dev)?;
        let grid = (self.dev.sm_count * 4).max(1);
        // SAFETY: args is kvt_pattern_args; its buffers live in the returned job, whose drop waits
        // for the kernel; pages were checked against the arenas' page count.
        unsafe { launch(f, grid, 256, stream as sys::CUstream, &args)? };
        event.record(stream as sys::CUstream)?;
        Ok(PatternJob {
            event,
            mismatch,
            _bufs: (pbuf, sbuf),
            pages: pages.to_vec(),
            keys: keys.to_vec(),
            arenas: self.clone(),
            done: false,
        })
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
        f.debug_struct("PatternJob").field("pages", &self.pages.len()).field("done", &self.done).finish()
    }
}
