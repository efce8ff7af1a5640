//! The host copy backend: "GPU arenas" in ordinary host memory, copies with `memcpy`.
//!
//! It exists so the whole tier (pool, index, leases, guards, eviction, replay) runs and is tested on
//! machines without a GPU, with the same batching, ordering and completion protocol as the CUDA
//! backend. A submitted batch is copied on the thread that first waits on (or polls) its completion,
//! which for a tier rank is the rank's completion thread, so `save`/`restore` return at once as
//! they do on a GPU.

use super::layers::{LayerCopy, LayerGroups, LayerReadiness};
use super::{validate_batch, Completion, CopyBackend, CopyPair, Direction, EngineArenas, WaitFor};
use crate::copy::pattern;
use crate::error::{CopyError, Error, GeometryError};
use crate::geometry::{ArenaBinding, Geometry, Placement};
use crate::key::ContentKey;
use crate::slab::pool::{HostPool, PoolRegion};
use std::sync::Arc;

/// Arena memory for the host backend: one anonymous mapping per arena (or per fused buffer), laid
/// out as the geometry says ([`MemcpyArenas::new`]), or memory the caller owns
/// ([`MemcpyArenas::from_binding`]). Mapped pages are not touched until written, so a large page
/// count costs address space, not memory.
pub struct MemcpyArenas {
    geometry: Geometry,
    _buffers: Vec<crate::slab::pool::Mapping>,
    binding: ArenaBinding,
}

impl MemcpyArenas {
    /// Allocates arenas for `geometry` (`geometry.pages()` pages each).
    ///
    /// # Errors
    /// [`Error::ArenaMemory`] if a mapping fails; [`GeometryError`] if the resulting binding is invalid
    /// (it cannot be for a valid geometry).
    pub fn new(geometry: &Geometry) -> Result<Self, Error> {
        let arenas = geometry.arenas();
        let mut buffers: Vec<crate::slab::pool::Mapping> = Vec::new();
        let mut fused: Vec<(u32, usize)> = Vec::new();
        let mut bases = Vec::with_capacity(arenas.len());
        let map = |len: u64| {
            crate::slab::pool::Mapping::anonymous(len as usize)
                .map_err(|source| Error::ArenaMemory { bytes: len, source })
        };
        for a in arenas {
            match a.placement {
                Placement::Own => {
                    let m = map(a.pages * a.page_stride)?;
                    bases.push(m.as_mut_ptr() as u64);
                    buffers.push(m);
                }
                Placement::Fused { buffer, offset } => {
                    let idx = match fused.iter().find(|(b, _)| *b == buffer) {
                        Some(&(_, i)) => i,
                        None => {
                            buffers.push(map(a.pages * a.page_stride)?);
                            fused.push((buffer, buffers.len() - 1));
                            buffers.len() - 1
                        }
                    };
                    bases.push(buffers[idx].as_mut_ptr() as u64 + offset);
                }
            }
        }
        let binding = ArenaBinding::new(geometry, bases).map_err(|e: GeometryError| Error::Geometry(e))?;
        Ok(MemcpyArenas { geometry: geometry.clone(), _buffers: buffers, binding })
    }

    /// Host arenas over memory the caller owns (an engine's CPU KV tensors, numpy arrays, its own
    /// allocations): arena `i` of `geometry` at `binding.bases()[i]`, page `p` at byte
    /// `p * page_stride` from there. Nothing is allocated or freed; the arenas' placement is
    /// ignored (the binding says where they are). Wrap the result in an `Arc` and make a backend
    /// with [`EngineArenas::backend`] or [`MemcpyBackend::new`].
    ///
    /// # Safety
    /// For every arena, the `extent()` bytes from its base must be valid for reads and writes from
    /// any thread, and stay valid until the returned value, every backend made from it and every
    /// copy submitted through those have been dropped or completed (a tier's `Rank` drains its
    /// copies when it is dropped or shut down). While a copy runs, nothing else may write the GPU
    /// pages it reads (save) or access the pages it writes (restore), as for any backend.
    ///
    /// # Errors
    /// [`Error::Geometry`] if `binding` does not fit `geometry` (base count, null or misaligned
    /// base, overflow, overlapping arenas): the checks of [`ArenaBinding::new`].
    pub unsafe fn from_binding(geometry: &Geometry, binding: ArenaBinding) -> Result<Self, Error> {
        // Re-check against this geometry: a binding validated for another geometry proves nothing.
        let binding = ArenaBinding::new(geometry, binding.bases().to_vec())?;
        Ok(MemcpyArenas { geometry: geometry.clone(), _buffers: Vec::new(), binding })
    }

    /// The geometry.
    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// The arenas' base addresses.
    pub fn binding(&self) -> &ArenaBinding {
        &self.binding
    }

    /// Address of arena `arena`'s chunk of page `page` (`bytes_per_page` bytes are valid there).
    ///
    /// Panics if `arena` or `page` is out of range.
    pub fn chunk_ptr(&self, arena: usize, page: u64) -> *mut u8 {
        let a = &self.geometry.arenas()[arena];
        assert!(page < a.pages, "page {page} out of range ({} pages)", a.pages);
        (self.binding.bases()[arena] + page * a.page_stride) as *mut u8
    }

    /// Mutable view of one chunk.
    ///
    /// # Safety
    /// No other reference to this chunk may exist and no copy may be writing or reading it for the
    /// lifetime of the returned slice.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn chunk_mut(&self, arena: usize, page: u64) -> &mut [u8] {
        let len = self.geometry.arenas()[arena].bytes_per_page as usize;
        // SAFETY: chunk_ptr checked the range; the chunk lies inside a live mapping owned by self;
        // exclusivity is the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.chunk_ptr(arena, page), len) }
    }

    /// Shared view of one chunk.
    ///
    /// # Safety
    /// No copy or writer may modify this chunk for the lifetime of the returned slice.
    pub unsafe fn chunk(&self, arena: usize, page: u64) -> &[u8] {
        let len = self.geometry.arenas()[arena].bytes_per_page as usize;
        // SAFETY: as in chunk_mut; shared access is the caller's contract.
        unsafe { std::slice::from_raw_parts(self.chunk_ptr(arena, page), len) }
    }
}

// SAFETY: MemcpyArenas owns its mappings; the raw addresses it hands out are only dereferenced under
// the callers' documented exclusivity contracts.
unsafe impl Send for MemcpyArenas {}
// SAFETY: as above; &MemcpyArenas methods only compute addresses.
unsafe impl Sync for MemcpyArenas {}

impl MemcpyArenas {
    fn check(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), Error> {
        crate::copy::check_pages_and_keys(&self.geometry, pages, keys)
    }
}

/// Host arenas as the engine side of a replay. Callers must not fill or verify pages that a copy is
/// using (the replay only touches pages it owns).
impl EngineArenas for Arc<MemcpyArenas> {
    fn geometry(&self) -> &Geometry {
        &self.geometry
    }
    fn fill(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), Error> {
        self.check(pages, keys)?;
        for (&p, k) in pages.iter().zip(keys) {
            for a in 0..self.geometry.arenas().len() {
                // SAFETY: the caller owns page p (no copy or other reference uses it meanwhile).
                pattern::fill(k, a, unsafe { self.chunk_mut(a, p) });
            }
        }
        Ok(())
    }
    fn verify(&self, pages: &[u64], keys: &[ContentKey]) -> Result<(), Error> {
        self.check(pages, keys)?;
        for (&p, k) in pages.iter().zip(keys) {
            for (a, spec) in self.geometry.arenas().iter().enumerate() {
                // SAFETY: the caller owns page p; nothing writes it while we read.
                if let Some(off) = pattern::first_mismatch(k, a, unsafe { self.chunk(a, p) }) {
                    return Err(Error::Verification { page: p, arena: spec.name.clone(), byte: off as u64, key: *k });
                }
            }
        }
        Ok(())
    }
    fn backend(&self) -> Result<Box<dyn CopyBackend>, Error> {
        Ok(Box::new(MemcpyBackend::new(self.clone())))
    }
}

/// The host backend for one "rank".
pub struct MemcpyBackend {
    arenas: Arc<MemcpyArenas>,
    pool: Option<PoolRegion>,
}

impl MemcpyBackend {
    /// A backend over `arenas`.
    pub fn new(arenas: Arc<MemcpyArenas>) -> Self {
        MemcpyBackend { arenas, pool: None }
    }

    /// The arenas.
    pub fn arenas(&self) -> &Arc<MemcpyArenas> {
        &self.arenas
    }

    fn submit(&self, batch: &[CopyPair], dir: Direction) -> Result<Box<dyn Completion>, CopyError> {
        let pool = self.pool.ok_or(CopyError::PoolNotBound)?;
        validate_batch(batch, self.arenas.geometry.pages(), pool.capacity, dir)?;
        Ok(Box::new(MemcpyCompletion {
            job: Some(MemcpyJob { arenas: self.arenas.clone(), pool, batch: batch.to_vec(), dir }),
        }))
    }
}

impl CopyBackend for MemcpyBackend {
    fn name(&self) -> &'static str {
        "host"
    }
    fn geometry(&self) -> &Geometry {
        &self.arenas.geometry
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        if pool.slot_bytes() != self.arenas.geometry.slot_bytes() {
            return Err(CopyError::SlotSizeMismatch {
                pool: pool.slot_bytes(),
                geometry: self.arenas.geometry.slot_bytes(),
            });
        }
        self.pool = Some(pool.region());
        Ok(())
    }
    unsafe fn save(&self, batch: &[CopyPair], _wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        self.submit(batch, Direction::Save)
    }
    unsafe fn restore(&self, batch: &[CopyPair], _wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        self.submit(batch, Direction::Restore)
    }
    fn layer_copy(&self) -> Option<&dyn LayerCopy> {
        Some(self)
    }
}

/// Layer-wise copies on the host: group by group, in group order, on whichever thread first needs
/// a group (a layer wait, or the completion's `wait` on the rank's completion thread). Waits are
/// ignored as in whole-block copies. The readiness is a CPU-side counter of copied groups.
impl LayerCopy for MemcpyBackend {
    unsafe fn copy_layers(
        &self,
        dir: Direction,
        batch: &[CopyPair],
        groups: &LayerGroups,
        waits: &[WaitFor],
    ) -> Result<Box<dyn Completion>, CopyError> {
        let pool = self.pool.ok_or(CopyError::PoolNotBound)?;
        groups.check(self.arenas.geometry.arenas().len())?;
        groups.check_waits(waits)?;
        validate_batch(batch, self.arenas.geometry.pages(), pool.capacity, dir)?;
        let job = MemcpyJob { arenas: self.arenas.clone(), pool, batch: batch.to_vec(), dir };
        Ok(Box::new(MemcpyLayerCompletion {
            job: Arc::new(MemcpyLayerJob { job, groups: groups.clone(), copied: std::sync::Mutex::new(0) }),
        }))
    }
}

struct MemcpyJob {
    arenas: Arc<MemcpyArenas>,
    pool: PoolRegion,
    batch: Vec<CopyPair>,
    dir: Direction,
}

impl MemcpyJob {
    fn run(&self) {
        self.run_arenas(0..self.arenas.geometry.arenas().len());
    }

    /// Copies arenas `arenas` of every block of the batch.
    fn run_arenas(&self, arenas: std::ops::Range<usize>) {
        let g = &self.arenas.geometry;
        for p in &self.batch {
            let slot_base = self.pool.host_base + p.slot as usize * self.pool.slot_bytes as usize;
            let (specs, offs) = (&g.arenas()[arenas.clone()], &g.chunk_offsets()[arenas.clone()]);
            for (i, (a, off)) in arenas.clone().zip(specs.iter().zip(offs)) {
                let gpu = self.arenas.chunk_ptr(i, p.gpu_page);
                let host = (slot_base + *off as usize) as *mut u8;
                let n = a.bytes_per_page as usize;
                // SAFETY: validate_batch checked page and slot ranges, so both ranges lie inside live
                // mappings (the arenas are held by self.arenas; the pool outlives every rank's
                // completions by the tier's teardown order). The trait contract gives this copy
                // exclusive use of its destinations and a stable source; chunks never overlap.
                unsafe {
                    match self.dir {
                        Direction::Save => std::ptr::copy_nonoverlapping(gpu, host, n),
                        Direction::Restore => std::ptr::copy_nonoverlapping(host, gpu, n),
                    }
                }
            }
        }
    }
}

struct MemcpyCompletion {
    job: Option<MemcpyJob>,
}

impl Completion for MemcpyCompletion {
    fn poll(&mut self) -> Result<bool, CopyError> {
        self.wait().map(|_| true)
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        if let Some(job) = self.job.take() {
            job.run();
        }
        Ok(())
    }
}

/// A layer-wise host copy: the job and how many of its groups have been copied.
struct MemcpyLayerJob {
    job: MemcpyJob,
    groups: LayerGroups,
    copied: std::sync::Mutex<usize>,
}

impl MemcpyLayerJob {
    /// Copies groups up to and including `g` that are not copied yet (in group order).
    fn advance(&self, g: usize) {
        let mut copied = self.copied.lock().unwrap_or_else(|p| p.into_inner());
        while *copied <= g.min(self.groups.len() - 1) {
            self.job.run_arenas(self.groups.arenas(*copied));
            *copied += 1;
        }
    }
}

impl LayerReadiness for MemcpyLayerJob {
    fn groups(&self) -> usize {
        self.groups.len()
    }
    fn cuda_event(&self, g: usize) -> Option<u64> {
        assert!(g < self.groups.len(), "layer group {g} of {}", self.groups.len());
        None
    }
    fn stream_wait(&self, g: usize, _stream: u64) -> Result<(), CopyError> {
        assert!(g < self.groups.len(), "layer group {g} of {}", self.groups.len());
        // Seeded bug: a layer wait that returns before its group is copied.
        if !crate::seeded::seeded("layer-ready-early") {
            self.advance(g);
        }
        Ok(())
    }
    fn is_ready(&self, g: usize) -> Result<bool, CopyError> {
        assert!(g < self.groups.len(), "layer group {g} of {}", self.groups.len());
        Ok(*self.copied.lock().unwrap_or_else(|p| p.into_inner()) > g)
    }
}

struct MemcpyLayerCompletion {
    job: Arc<MemcpyLayerJob>,
}

impl Completion for MemcpyLayerCompletion {
    fn poll(&mut self) -> Result<bool, CopyError> {
        self.wait().map(|_| true)
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        self.job.advance(usize::MAX);
        Ok(())
    }
    fn layer_readiness(&self) -> Option<Arc<dyn LayerReadiness>> {
        Some(self.job.clone())
    }
}

impl std::fmt::Debug for MemcpyArenas {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemcpyArenas")
            .field("model", &self.geometry.model())
            .field("pages", &self.geometry.pages())
            .finish()
    }
}

impl std::fmt::Debug for MemcpyBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemcpyBackend").field("arenas", &self.arenas).field("pool", &self.pool).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::geometry::ArenaSpec;
    use crate::slab::pool::{BackingChoice, PoolConfig};
    use crate::tier::{HostTier, TierConfig};

    /// Two arenas of 64 B pages over caller-owned vectors: save, restore into other pages, and the
    /// caller sees the bytes in its own memory.
    #[test]
    fn arenas_over_caller_memory_save_and_restore() {
        let g = Geometry::new("caller", 4, vec![ArenaSpec::packed("k", 64, 8), ArenaSpec::packed("v", 32, 8)]).unwrap();
        // u128 elements: 16-byte aligned.
        let mut k = vec![0u128; 8 * 64 / 16];
        let mut v = vec![0u128; 8 * 32 / 16];
        let bind = ArenaBinding::new(&g, vec![k.as_mut_ptr() as u64, v.as_mut_ptr() as u64]).unwrap();
        // Engine writes pages 1 and 2.
        for (i, x) in k.iter_mut().enumerate().skip(4).take(8) {
            *x = 1000 + i as u128;
        }
        for (i, x) in v.iter_mut().enumerate().skip(2).take(4) {
            *x = 2000 + i as u128;
        }
        {
            // SAFETY: k and v outlive the arenas, the rank (dropped at the end of this block, which
            // drains its copies) and every copy; nothing touches them while a copy runs.
            let arenas = Arc::new(unsafe { MemcpyArenas::from_binding(&g, bind) }.unwrap());
            let mut cfg = TierConfig::new(g.clone(), 4 * g.slot_bytes());
            cfg.pool = PoolConfig { bytes: 4 * g.slot_bytes(), backing: BackingChoice::Plain, ..Default::default() };
            let tier = HostTier::new(cfg).unwrap();
            let rank = tier.attach(arenas.backend().unwrap()).unwrap();
            let ns = tier.namespace();
            let keys = [ns.key_from_bytes(b"page-1"), ns.key_from_bytes(b"page-2")];
            rank.save(&keys, &[1, 2], WaitFor::Nothing).unwrap().handle.wait().unwrap();
            let lease = tier.query(&keys);
            assert_eq!(lease.len(), 2);
            let h = rank.restore(&lease, &[7, 5], WaitFor::Nothing).unwrap();
            assert_eq!(h.cuda_event(), None);
            h.stream_wait(0).unwrap(); // host backend: waits on the host
            assert!(h.is_done());
        }
        // Page 1 -> page 7, page 2 -> page 5, in both arenas.
        assert_eq!(&k[28..32], &k[4..8]);
        assert_eq!(&k[20..24], &k[8..12]);
        assert_eq!(&v[14..16], &v[2..4]);
        assert_eq!(&v[10..12], &v[4..6]);
        assert_eq!(k[28], 1004);
        assert_eq!(v[11], 2005);
        assert_eq!(k[0], 0, "untouched pages stay untouched");
    }

    /// Four arenas in two layers over host memory the test owns.
    fn two_layer_arenas() -> (Geometry, Arc<MemcpyArenas>, crate::slab::pool::HostPool) {
        let g = Geometry::new(
            "layers",
            4,
            vec![
                ArenaSpec::packed("k.L0", 64, 8),
                ArenaSpec::packed("v.L0", 32, 8),
                ArenaSpec::packed("k.L1", 64, 8),
                ArenaSpec::packed("v.L1", 32, 8),
            ],
        )
        .unwrap()
        .with_layers(vec![0, 0, 1, 1])
        .unwrap();
        let arenas = Arc::new(MemcpyArenas::new(&g).unwrap());
        let cfg = PoolConfig { bytes: 8 * g.slot_bytes(), backing: BackingChoice::Plain, ..Default::default() };
        let pool = crate::slab::pool::HostPool::new(g.slot_bytes(), &cfg).unwrap();
        (g, arenas, pool)
    }

    /// A layer wait copies (at least) its group and nothing of later groups; the completion copies
    /// the rest; the bytes equal a whole-block restore's.
    #[test]
    fn a_layer_wait_makes_its_group_ready_before_later_groups() {
        let (g, arenas, pool) = two_layer_arenas();
        let mut b = MemcpyBackend::new(arenas.clone());
        b.bind_pool(&pool).unwrap();
        let ns = g.namespace();
        let keys: Vec<ContentKey> = (0..3u8).map(|i| ns.key_from_bytes(&[i])).collect();
        let old: Vec<ContentKey> = (10..13u8).map(|i| ns.key_from_bytes(&[i])).collect();
        arenas.fill(&[0, 1, 2], &keys).unwrap();
        let save: Vec<CopyPair> = (0..3).map(|i| CopyPair::new(i, i as u32 + 2)).collect();
        // SAFETY: the test owns these slots and pages until wait returns.
        unsafe { b.save(&save, WaitFor::Nothing) }.unwrap().wait().unwrap();
        arenas.fill(&[5, 6, 7], &old).unwrap();
        let groups = LayerGroups::new(&g, 2).unwrap();
        let back: Vec<CopyPair> = (0..3).map(|i| CopyPair::new(5 + i, i as u32 + 2)).collect();
        // SAFETY: as above.
        let mut c =
            unsafe { super::super::layers::copy_layers(&b, Direction::Restore, &back, &groups, &[WaitFor::Nothing]) }
                .unwrap();
        let ready = c.layer_readiness().expect("a layer-wise host copy has a readiness");
        assert_eq!(ready.groups(), 2);
        assert_eq!(ready.cuda_event(0), None);
        assert!(!ready.is_ready(0).unwrap());
        ready.stream_wait(0, 0).unwrap();
        assert!(ready.is_ready(0).unwrap() && !ready.is_ready(1).unwrap());
        let first_bad = |pages: &[u64], want: &[ContentKey]| -> Option<String> {
            arenas.verify(pages, want).err().map(|e| e.to_string())
        };
        // Layer 0 holds the restored bytes; layer 1 still the old ones.
        for (i, &p) in [5u64, 6, 7].iter().enumerate() {
            for a in 0..4 {
                // SAFETY: no copy writes these pages now (group 0 is done, group 1 not started).
                let chunk = unsafe { arenas.chunk(a, p) };
                let want = if a < 2 { &keys[i] } else { &old[i] };
                assert_eq!(crate::copy::pattern::first_mismatch(want, a, chunk), None, "page {p} arena {a}");
            }
        }
        c.wait().unwrap();
        assert!(ready.is_ready(1).unwrap());
        assert_eq!(first_bad(&[5, 6, 7], &keys), None);
        // Waits: one, or one per group.
        // SAFETY: rejected before anything is copied.
        let e = unsafe {
            super::super::layers::copy_layers(&b, Direction::Restore, &back, &groups, &[WaitFor::Nothing; 3])
        }
        .err()
        .expect("three waits for two groups");
        assert!(matches!(e, CopyError::WaitCount { waits: 3, groups: 2 }), "{e:?}");
    }

    #[test]
    fn from_binding_rechecks_the_binding_against_the_geometry() {
        let g = Geometry::new("caller", 4, vec![ArenaSpec::packed("k", 64, 8), ArenaSpec::packed("v", 64, 8)]).unwrap();
        let one = Geometry::new("one", 4, vec![ArenaSpec::packed("k", 64, 8)]).unwrap();
        let b = ArenaBinding::new(&one, vec![0x1000]).unwrap();
        // SAFETY: rejected before anything could use the address.
        let e = unsafe { MemcpyArenas::from_binding(&g, b) }.expect_err("base count differs");
        assert!(matches!(e, Error::Geometry(GeometryError::BaseCount { got: 1, want: 2 })), "{e:?}");
    }
}
