//! Copy backends: batched gather (save, D2H) and scatter (restore, H2D) of whole blocks.
//!
//! A backend moves every arena of a batch of blocks between one rank's GPU arenas and the host pool
//! in one submission. The tier calls it with a batch of [`CopyPair`]s (GPU page id, host slot) and
//! gets back a [`Completion`] that it waits on (from the rank's completion thread) before it commits
//! saved slots or drops the guards of a restore. Three implementations:
//!
//! - [`host::MemcpyBackend`]: "GPU arenas" in ordinary host memory, copies with `memcpy`. For machines
//!   without a GPU, tests and the replay's host mode.
//! - `cuda::CudaBackend` (feature `cuda`): the hand-written gather/scatter kernels in `cuda/`.
//! - [`null::NullBackend`]: moves nothing; for measuring the tier's own bookkeeping.
//!
//! # Ordering
//! [`WaitFor`] names what a copy must wait for before it reads or writes GPU pages: for a save, the
//! kernels that wrote the pages; for a restore into recycled pages, the readers of their old
//! contents. A completion can expose a CUDA event ([`Completion::cuda_event`]) that the engine's
//! compute stream waits on before it reads restored pages; [`Completion::shared_event`] hands out
//! shared ownership of it, so a [`crate::CopyHandle`] keeps it valid after the completion is gone.

pub(crate) mod fault;
pub(crate) mod host;
pub(crate) mod layers;
pub(crate) mod null;
pub mod pattern;

pub use layers::{LayerCopy, LayerGroups, LayerReadiness};

use crate::error::CopyError;
use crate::geometry::Geometry;
use crate::slab::pool::HostPool;
use std::sync::Arc;

/// One block to move: GPU page `gpu_page` (in every arena) <-> host slot `slot`.
///
/// `repr(C)`, 16 bytes: the CUDA kernels read an array of these from device memory
/// (`struct kvt_pair` in `cuda/kvtier_copy.cuh`).
#[repr(C)]
#[derive(Copy, Clone, Debug, PartialEq, Eq, Default)]
pub struct CopyPair {
    /// GPU page id, `< Geometry::pages()`.
    pub gpu_page: u64,
    /// Host slot id, `< HostPool::capacity()`.
    pub slot: u32,
    /// Padding; always 0.
    pub reserved: u32,
}

impl CopyPair {
    /// A pair with zero padding.
    pub fn new(gpu_page: u64, slot: u32) -> Self {
        CopyPair { gpu_page, slot, reserved: 0 }
    }
}

/// Direction of a copy.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
pub enum Direction {
    /// GPU arenas -> host slots (D2H, gather).
    Save,
    /// Host slots -> GPU arenas (H2D, scatter).
    Restore,
}

/// What a copy waits for before it starts (see the module docs).
///
/// Raw handles are the driver's `CUevent` / `CUstream` values as integers, so engines using any CUDA
/// binding can pass theirs; the host backend ignores them.
#[derive(Copy, Clone, Debug, Default, PartialEq, Eq)]
pub enum WaitFor {
    /// Start at once.
    #[default]
    Nothing,
    /// Wait for this recorded `CUevent`.
    CudaEvent(u64),
    /// Wait for all work queued so far on this `CUstream`.
    CudaStream(u64),
}

/// A submitted batch. The tier waits on it from a completion thread; host slots, pins, GPU page pins
/// and descriptor buffers are released only after [`Completion::wait`] returns (never on a timeout).
pub trait Completion: Send {
    /// True once the copy has finished (successfully or not). Never waits for other work; a backend
    /// that copies on the calling thread (the host backend) does its copy here.
    ///
    /// # Errors
    /// The copy's failure, if it has failed.
    fn poll(&mut self) -> Result<bool, CopyError>;
    /// Blocks until the copy has finished.
    ///
    /// # Errors
    /// The copy's failure; the destination bytes are then unspecified.
    fn wait(&mut self) -> Result<(), CopyError>;
    /// A `CUevent` recorded after the copy, for the engine's stream to wait on (CUDA only). Valid
    /// while the completion lives; [`Completion::shared_event`] keeps it valid longer.
    fn cuda_event(&self) -> Option<u64> {
        self.shared_event().map(|e| e.raw())
    }
    /// The event recorded after the copy, shared: it stays valid (not destroyed) while any clone
    /// of the returned `Arc` lives, also after the completion is dropped. `None` for backends
    /// without device events (the host backend).
    fn shared_event(&self) -> Option<Arc<dyn CopyEvent>> {
        None
    }
    /// The per-layer-group readiness of a layer-wise copy (`layers::copy_layers`), shared: it
    /// stays valid while any clone lives. `None` for whole-block copies.
    fn layer_readiness(&self) -> Option<Arc<dyn LayerReadiness>> {
        None
    }
}

/// A device event recorded on a backend's stream after one copy (see
/// [`Completion::shared_event`]). Destroyed when the last owner drops it (a pending event may be
/// destroyed: the driver releases it when it completes).
pub trait CopyEvent: Send + Sync {
    /// The raw `CUevent` handle.
    fn raw(&self) -> u64;
    /// Makes all work queued on `stream` (a raw `CUstream` of any context; 0 is the legacy default
    /// stream of the event's device) after this call wait for the copy, with no host
    /// synchronisation (`cuStreamWaitEvent`). The calling thread's current context is left as it
    /// was.
    ///
    /// # Errors
    /// The driver's error (the CUDA backend's `CopyError::Cuda`, keeping the `CUresult`).
    fn stream_wait(&self, stream: u64) -> Result<(), CopyError>;
}

/// A batched block mover for one rank (one device and its arenas).
///
/// # Safety contract for callers of `save` and `restore`
/// The caller guarantees, until the returned completion's `wait` has returned: every host slot of a
/// save is exclusively owned by it (state `WRITING`), every host slot of a restore is pinned
/// (state `READY`, pin held), and no other copy writes the same GPU pages. The tier upholds this;
/// benchmarks and tests that call a backend directly must too.
pub trait CopyBackend: Send + Sync {
    /// Short name (`host`, `cuda`) for reports.
    fn name(&self) -> &'static str;
    /// The geometry this backend's arenas follow.
    fn geometry(&self) -> &Geometry;
    /// Binds the host pool before any copy: the CUDA backend registers the region with the driver
    /// (once per pool, kept until the pool is dropped) and obtains its device alias.
    ///
    /// # Errors
    /// [`CopyError::SlotSizeMismatch`] if the pool's slot size differs from the geometry's; driver errors.
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError>;
    /// Gathers every arena of `batch[i].gpu_page` into host slot `batch[i].slot`, after `wait`.
    ///
    /// # Safety
    /// See the trait-level contract.
    ///
    /// # Errors
    /// [`CopyError::PageOutOfRange`] / [`CopyError::SlotOutOfRange`] /
    /// [`CopyError::DuplicateDestination`] before anything is copied; driver errors.
    unsafe fn save(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError>;
    /// Scatters host slot `batch[i].slot` into every arena of `batch[i].gpu_page`, after `wait`.
    ///
    /// # Safety
    /// See the trait-level contract.
    ///
    /// # Errors
    /// As [`CopyBackend::save`].
    unsafe fn restore(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError>;
    /// The backend's layer-wise submission ([`LayerCopy`]), if it has one; `None` (the default)
    /// makes `layers::copy_layers` fall back to one whole-block copy.
    fn layer_copy(&self) -> Option<&dyn LayerCopy> {
        None
    }
}

/// Checks a batch before submission: page ids below `pages`, slots below `capacity`, and no
/// destination written twice (GPU pages for a restore, host slots for a save).
///
/// # Errors
/// [`CopyError::PageOutOfRange`], [`CopyError::SlotOutOfRange`], [`CopyError::DuplicateDestination`].
pub fn validate_batch(batch: &[CopyPair], pages: u64, capacity: u32, dir: Direction) -> Result<(), CopyError> {
    for p in batch {
        if p.gpu_page >= pages {
            return Err(CopyError::PageOutOfRange { page: p.gpu_page, pages });
        }
        if p.slot >= capacity {
            return Err(CopyError::SlotOutOfRange { slot: p.slot, capacity });
        }
    }
    let mut dest: Vec<u64> = match dir {
        Direction::Save => batch.iter().map(|p| p.slot as u64).collect(),
        Direction::Restore => batch.iter().map(|p| p.gpu_page).collect(),
    };
    dest.sort_unstable();
    if let Some(w) = dest.windows(2).find(|w| w[0] == w[1]) {
        let what = if dir == Direction::Save { "host slot" } else { "GPU page" };
        return Err(CopyError::DuplicateDestination { what, id: w[0] });
    }
    Ok(())
}

/// Checks the arguments of [`EngineArenas::fill`] / [`EngineArenas::verify`]: one key per page and
/// every page below `geometry.pages()`.
///
/// # Errors
/// [`crate::Error::PageKeyCount`] for differing lengths, [`CopyError::PageOutOfRange`] for a page id.
pub fn check_pages_and_keys(
    geometry: &Geometry,
    pages: &[u64],
    keys: &[crate::ContentKey],
) -> Result<(), crate::Error> {
    if pages.len() != keys.len() {
        return Err(crate::Error::PageKeyCount { pages: pages.len(), keys: keys.len() });
    }
    if let Some(&p) = pages.iter().find(|&&p| p >= geometry.pages()) {
        return Err(CopyError::PageOutOfRange { page: p, pages: geometry.pages() }.into());
    }
    Ok(())
}

/// A completion that is already finished (used by synchronous backends), with its outcome.
#[derive(Debug)]
pub struct Done(pub Result<(), CopyError>);

impl Completion for Done {
    fn poll(&mut self) -> Result<bool, CopyError> {
        self.0.clone().map(|_| true)
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        self.0.clone()
    }
}

/// The engine side of a replay or test: one rank's GPU arenas that can be filled with the bytes
/// derived from content keys ([`crate::copy::pattern`]), checked against them, and copied by a backend.
/// Implemented by [`host::MemcpyArenas`] (host memory) and, with feature `cuda`, by the CUDA arenas
/// (device memory, fill and verify kernels).
pub trait EngineArenas: Send + Sync {
    /// The geometry the arenas follow.
    fn geometry(&self) -> &Geometry;
    /// "Prefill": writes the pattern of `keys[i]` into every arena of GPU page `pages[i]`.
    /// Returns after the bytes are in place (a copy started afterwards sees them).
    ///
    /// # Errors
    /// [`crate::Error::PageKeyCount`] if the lengths differ, [`CopyError::PageOutOfRange`] if a page
    /// is out of range; device errors.
    fn fill(&self, pages: &[u64], keys: &[crate::ContentKey]) -> Result<(), crate::Error>;
    /// Checks that every arena of GPU page `pages[i]` holds the pattern of `keys[i]`.
    ///
    /// # Errors
    /// [`crate::Error::Verification`] naming the first mismatching page, arena and byte offset;
    /// [`crate::Error::PageKeyCount`] / [`CopyError::PageOutOfRange`] for bad input; device errors.
    fn verify(&self, pages: &[u64], keys: &[crate::ContentKey]) -> Result<(), crate::Error>;
    /// A new copy backend over these arenas, to attach to a tier as one rank.
    ///
    /// # Errors
    /// Backend construction errors (device, registration).
    fn backend(&self) -> Result<Box<dyn CopyBackend>, crate::Error>;
}
