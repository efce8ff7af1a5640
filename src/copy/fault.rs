//! A copy backend wrapper that injects failures, for testing that an engine degrades correctly.
//!
//! The host tier is a cache, never a correctness dependency: when a save or restore fails, the
//! engine must fall back to a full prefill and still produce correct output. [`FaultyBackend`] wraps
//! any backend and makes a deterministic pseudo-random fraction of batches fail, either at
//! submission (the call returns an error) or at completion (the copy "ran" but reports failure; for
//! a restore the destination pages then hold garbage, which is what a real device fault leaves).

use super::{Completion, CopyBackend, CopyPair, WaitFor};
use crate::error::CopyError;
use crate::geometry::Geometry;
use crate::slab::pool::HostPool;
use crate::sync::{AtomicU64, Ordering};

/// Where an injected failure shows up.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum FaultSite {
    /// `save`/`restore` return [`CopyError::Injected`] and nothing is copied.
    Submit,
    /// The copy is submitted but its completion reports [`CopyError::Injected`].
    Completion,
}

/// Wraps a backend and fails about `rate` of its batches (see the module docs).
pub struct FaultyBackend {
    inner: Box<dyn CopyBackend>,
    rate: f64,
    state: AtomicU64,
    injected: AtomicU64,
}

impl FaultyBackend {
    /// Fails a fraction `rate` (clamped to 0.0..=1.0; NaN means 0) of batches, chosen by a generator
    /// seeded with `seed`.
    pub fn new(inner: Box<dyn CopyBackend>, rate: f64, seed: u64) -> Self {
        FaultyBackend {
            inner,
            rate: if rate.is_nan() { 0.0 } else { rate.clamp(0.0, 1.0) },
            state: AtomicU64::new(seed | 1),
            injected: AtomicU64::new(0),
        }
    }

    /// Failures injected so far.
    pub fn injected(&self) -> u64 {
        self.injected.load(Ordering::Relaxed)
    }

    /// Decides the next batch's fate: `None` (no fault) or where it fails.
    fn roll(&self) -> Option<FaultSite> {
        let x = crate::copy::pattern::mix64(self.state.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed));
        let u = (x >> 11) as f64 / (1u64 << 53) as f64;
        if u >= self.rate {
            return None;
        }
        self.injected.fetch_add(1, Ordering::Relaxed);
        Some(if x & 1 == 0 { FaultSite::Submit } else { FaultSite::Completion })
    }

    fn fault(call: &'static str) -> CopyError {
        CopyError::Injected { call }
    }
}

struct Failing(Box<dyn Completion>);

impl Completion for Failing {
    fn poll(&mut self) -> Result<bool, CopyError> {
        match self.0.poll()? {
            true => Err(FaultyBackend::fault("completion")),
            false => Ok(false),
        }
    }
    fn wait(&mut self) -> Result<(), CopyError> {
        // Let the real copy finish first: memory is never released under a running copy.
        self.0.wait()?;
        Err(FaultyBackend::fault("completion"))
    }
    fn cuda_event(&self) -> Option<u64> {
        self.0.cuda_event()
    }
}

impl CopyBackend for FaultyBackend {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn geometry(&self) -> &Geometry {
        self.inner.geometry()
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        self.inner.bind_pool(pool)
    }
    unsafe fn save(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        match self.roll() {
            Some(FaultSite::Submit) => Err(Self::fault("save")),
            // SAFETY: forwarded under the caller's contract.
            Some(FaultSite::Completion) => Ok(Box::new(Failing(unsafe { self.inner.save(batch, wait) }?))),
            // SAFETY: forwarded under the caller's contract.
            None => unsafe { self.inner.save(batch, wait) },
        }
    }
    unsafe fn restore(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        match self.roll() {
            Some(FaultSite::Submit) => Err(Self::fault("restore")),
            // SAFETY: forwarded under the caller's contract.
            Some(FaultSite::Completion) => Ok(Box::new(Failing(unsafe { self.inner.restore(batch, wait) }?))),
            // SAFETY: forwarded under the caller's contract.
            None => unsafe { self.inner.restore(batch, wait) },
        }
    }
}

impl std::fmt::Debug for FaultyBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FaultyBackend").field("inner", &self.inner.name()).field("rate", &self.rate).finish()
    }
}

/// Which call of a [`SubmitPanics`] backend panics.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum PanicSite {
    /// `CopyBackend::save` panics after it queued its copy.
    Save,
    /// `CopyBackend::restore` panics after it queued its copy.
    Restore,
}

struct SubmitPanicsShared {
    inner: std::sync::Mutex<Box<dyn CopyBackend>>,
    geometry: Geometry,
    name: &'static str,
    site: PanicSite,
    /// Copies queued by a call that then panicked, not run yet: `(save?, batch)`.
    queued: std::sync::Mutex<Vec<(bool, Vec<CopyPair>)>>,
}

/// A backend that **panics in `save` or `restore` after it queued the copy** (a buggy user
/// backend): the copy is not lost, it runs later, when the test calls [`SubmitPanicsHandle::land`] (a DMA
/// that lands after its submitter unwound). The other direction is forwarded unchanged. A tier must
/// then keep the copy's slots (quarantine: never reuse a slot the late copy writes, never evict a
/// slot it reads).
pub struct SubmitPanics {
    shared: std::sync::Arc<SubmitPanicsShared>,
}

/// The test's handle on a [`SubmitPanics`] backend attached to a tier.
#[derive(Clone)]
pub struct SubmitPanicsHandle {
    shared: std::sync::Arc<SubmitPanicsShared>,
}

impl SubmitPanics {
    /// Wraps `inner`; `site` says which call panics (every call of it).
    pub fn new(inner: Box<dyn CopyBackend>, site: PanicSite) -> (Self, SubmitPanicsHandle) {
        let shared = std::sync::Arc::new(SubmitPanicsShared {
            geometry: inner.geometry().clone(),
            name: inner.name(),
            inner: std::sync::Mutex::new(inner),
            site,
            queued: std::sync::Mutex::new(Vec::new()),
        });
        (SubmitPanics { shared: shared.clone() }, SubmitPanicsHandle { shared })
    }
}

impl SubmitPanicsHandle {
    /// Runs every queued copy now (the late landing) and waits for it; returns how many batches
    /// ran.
    ///
    /// # Errors
    /// The inner backend's errors.
    pub fn land(&self) -> Result<usize, CopyError> {
        let queued = std::mem::take(&mut *self.shared.queued.lock().unwrap_or_else(|p| p.into_inner()));
        let inner = self.shared.inner.lock().unwrap_or_else(|p| p.into_inner());
        for (save, batch) in &queued {
            // SAFETY: the batch was valid when the tier submitted it (its GPU pages are the test's,
            // in range; its slots are in the pool the inner backend is bound to, which the tier
            // keeps mapped). Host memory only: a slot the tier wrongly reused is overwritten with
            // the old key's bytes, which is exactly the fault this backend exposes.
            let mut c = unsafe {
                if *save {
                    inner.save(batch, WaitFor::Nothing)
                } else {
                    inner.restore(batch, WaitFor::Nothing)
                }
            }?;
            c.wait()?;
        }
        Ok(queued.len())
    }
}

impl CopyBackend for SubmitPanics {
    fn name(&self) -> &'static str {
        self.shared.name
    }
    fn geometry(&self) -> &Geometry {
        &self.shared.geometry
    }
    fn bind_pool(&mut self, pool: &HostPool) -> Result<(), CopyError> {
        self.shared.inner.lock().unwrap_or_else(|p| p.into_inner()).bind_pool(pool)
    }
    unsafe fn save(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        if self.shared.site == PanicSite::Save {
            self.shared.queued.lock().unwrap_or_else(|p| p.into_inner()).push((true, batch.to_vec()));
            panic!("injected panic in CopyBackend::save after queuing the copy");
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.shared.inner.lock().unwrap_or_else(|p| p.into_inner()).save(batch, wait) }
    }
    unsafe fn restore(&self, batch: &[CopyPair], wait: WaitFor) -> Result<Box<dyn Completion>, CopyError> {
        if self.shared.site == PanicSite::Restore {
            self.shared.queued.lock().unwrap_or_else(|p| p.into_inner()).push((false, batch.to_vec()));
            panic!("injected panic in CopyBackend::restore after queuing the copy");
        }
        // SAFETY: forwarded under the caller's contract.
        unsafe { self.shared.inner.lock().unwrap_or_else(|p| p.into_inner()).restore(batch, wait) }
    }
}

impl std::fmt::Debug for SubmitPanicsHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubmitPanicsHandle").field("site", &self.shared.site).finish()
    }
}

impl std::fmt::Debug for SubmitPanics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SubmitPanics").field("inner", &self.shared.name).field("site", &self.shared.site).finish()
    }
}
