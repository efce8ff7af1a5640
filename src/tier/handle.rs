//! Completion handles for submitted copies: poll, wait, await, or register a callback.
//!
//! A [`CopyHandle`] is completed by the rank's completion thread after the backend reports the copy
//! finished *and* the tier has finalised it (saved blocks committed and visible, restore guards
//! dropped). So once a save's handle is done, a query finds the blocks; once a restore's handle is
//! done, the GPU pages hold the bytes. Waiting with a timeout never frees anything: memory is
//! released only by completion.
//!
//! A handle of a CUDA copy also carries the copy's completion event ([`CopyHandle::cuda_event`]):
//! [`CopyHandle::stream_wait`] orders the engine's compute stream after the copy with no host
//! sync, which is how an engine should consume a restore (the handle then completes on its own
//! shortly after, when the tier has released the copy's pins).
//!
//! A thread that waits first spins for a short while on the handle's completion flag, then sleeps
//! on a condition variable ([`wait_spin`]): a copy of a few blocks ends within tens of
//! microseconds, and a sleeping thread's wake-up costs as much again.

use crate::copy::{CopyEvent, LayerGroups, LayerReadiness};
use crate::error::TierError;
use crate::sync::wait_spin;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

type Callback = Box<dyn FnOnce(&Result<(), TierError>) + Send>;

/// A layer-wise copy's groups and their readiness.
pub(crate) type LayerState = (Arc<LayerGroups>, Arc<dyn LayerReadiness>);

#[derive(Default)]
struct State {
    result: Option<Result<(), TierError>>,
    completed_at: Option<Instant>,
    wakers: Vec<Waker>,
    callbacks: Vec<Callback>,
}

pub(crate) struct HandleShared {
    state: Mutex<State>,
    cv: Condvar,
    /// Set (release) once `state.result` is; read by spinning waiters without the lock.
    done: AtomicBool,
    submitted_at: Instant,
    blocks: usize,
    bytes: u64,
    /// The copy's device event, shared with the backend's completion (kept alive by the handle).
    event: Option<Arc<dyn CopyEvent>>,
    /// A layer-wise copy's groups and per-group readiness ([`CopyHandle::wait_layer`]).
    layers: Option<LayerState>,
}

impl HandleShared {
    pub(crate) fn new(blocks: usize, bytes: u64) -> Arc<Self> {
        Self::with_event(blocks, bytes, None)
    }

    /// A handle state carrying the copy's device event (from [`crate::Completion::shared_event`]).
    pub(crate) fn with_event(blocks: usize, bytes: u64, event: Option<Arc<dyn CopyEvent>>) -> Arc<Self> {
        Self::with_layers(blocks, bytes, event, None)
    }

    /// A handle state of a layer-wise copy: the device event and each layer group's readiness.
    pub(crate) fn with_layers(
        blocks: usize,
        bytes: u64,
        event: Option<Arc<dyn CopyEvent>>,
        layers: Option<LayerState>,
    ) -> Arc<Self> {
        Arc::new(HandleShared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            done: AtomicBool::new(false),
            submitted_at: Instant::now(),
            blocks,
            bytes,
            event,
            layers,
        })
    }

    /// Records the outcome and wakes every waiter, future and callback (once).
    pub(crate) fn complete(&self, result: &Result<(), TierError>) {
        let r = result.clone();
        let (wakers, callbacks) = {
            let mut st = relock(self.state.lock());
            debug_assert!(st.result.is_none(), "handle completed twice");
            st.result = Some(r.clone());
            st.completed_at = Some(Instant::now());
            self.done.store(true, Ordering::Release);
            (std::mem::take(&mut st.wakers), std::mem::take(&mut st.callbacks))
        };
        self.cv.notify_all();
        for w in wakers {
            // A waker that panics (an executor's bug) must not end the rank's completion thread.
            if crate::seeded::seeded("waker-panic-kills-completion") {
                w.wake();
            } else if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wake())).is_err() {
                tracing::error!("a CopyHandle waker panicked; the panic was contained");
            }
        }
        for cb in callbacks {
            // A panicking callback must not unwind through the rank's completion thread: that would
            // leave the rest of its queue unfinished (handles never complete, drains never end).
            let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| cb(&r)));
            if ran.is_err() {
                tracing::error!("a CopyHandle::on_complete callback panicked; the panic was contained");
            }
        }
    }
}

impl HandleShared {
    /// Spins until the handle completes, [`wait_spin`] has passed or `deadline` has; true if it
    /// completed. The first microseconds busy-wait; then the thread yields between checks, so a
    /// machine with fewer cores than busy threads still runs the completion thread.
    fn spin(&self, deadline: Option<Instant>) -> bool {
        let budget = wait_spin();
        if budget.is_zero() || self.done.load(Ordering::Acquire) {
            return self.done.load(Ordering::Acquire);
        }
        let start = Instant::now();
        let end = deadline.map_or(start + budget, |d| d.min(start + budget));
        let mut turns = 0u32;
        while !self.done.load(Ordering::Acquire) {
            turns = turns.wrapping_add(1);
            if turns % 64 == 0 {
                if Instant::now() >= end {
                    return false;
                }
                if start.elapsed() > Duration::from_micros(20) {
                    std::thread::yield_now();
                }
            }
            std::hint::spin_loop();
        }
        true
    }
}

/// The copy's outcome as the handle reports it: the backend's error ([`TierError::Copy`], in its
/// original variant), or the tier's when it could not finalise the copy ([`TierError::Disconnected`]).
fn to_tier(r: &Result<(), TierError>) -> Result<(), TierError> {
    r.clone()
}

/// A handle to one submitted save or restore batch. Cloning shares it.
#[derive(Clone)]
#[must_use = "the GPU pages of a copy may not be reused or read before its handle completes: wait on it or poll it"]
pub struct CopyHandle {
    shared: Arc<HandleShared>,
}

impl CopyHandle {
    pub(crate) fn new(shared: Arc<HandleShared>) -> Self {
        CopyHandle { shared }
    }

    /// A handle that is already complete (a save with nothing to copy).
    pub(crate) fn ready() -> Self {
        let shared = HandleShared::new(0, 0);
        shared.complete(&Ok(()));
        CopyHandle { shared }
    }

    /// Blocks in the batch.
    pub fn blocks(&self) -> usize {
        self.shared.blocks
    }

    /// Payload bytes the batch moves (blocks x bytes per block).
    pub fn bytes(&self) -> u64 {
        self.shared.bytes
    }

    /// True once the copy has completed and been finalised; never blocks.
    pub fn is_done(&self) -> bool {
        relock(self.shared.state.lock()).result.is_some()
    }

    /// The outcome if complete, without blocking.
    pub fn try_result(&self) -> Option<Result<(), TierError>> {
        relock(self.shared.state.lock()).result.as_ref().map(to_tier)
    }

    /// Blocks until complete: spins up to [`wait_spin`] on the completion, then sleeps.
    ///
    /// # Errors
    /// The copy's failure ([`TierError::Copy`]); a failed save's blocks were never made visible.
    pub fn wait(&self) -> Result<(), TierError> {
        self.shared.spin(None);
        let mut st = relock(self.shared.state.lock());
        while st.result.is_none() {
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        to_tier(st.result.as_ref().expect("set"))
    }

    /// Blocks until complete or `timeout` passes; `None` on timeout (nothing is cancelled or freed).
    /// A `timeout` too long to be represented as a deadline (`Duration::MAX`) waits as [`CopyHandle::wait`].
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<(), TierError>> {
        let Some(deadline) = Instant::now().checked_add(timeout) else { return Some(self.wait()) };
        self.shared.spin(Some(deadline));
        let mut st = relock(self.shared.state.lock());
        while st.result.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).unwrap_or_else(|p| p.into_inner()).0;
        }
        st.result.as_ref().map(to_tier)
    }

    /// Runs `f` with the outcome when the copy completes (at once, on this thread, if it already
    /// has; otherwise on the rank's completion thread, which `f` must not block for long). A panic
    /// in `f` on the completion thread is caught and logged; it does not stop that thread.
    pub fn on_complete(&self, f: impl FnOnce(Result<(), TierError>) + Send + 'static) {
        let mut st = relock(self.shared.state.lock());
        if let Some(r) = st.result.clone() {
            drop(st);
            f(to_tier(&r));
        } else {
            st.callbacks.push(Box::new(move |r| f(to_tier(r))));
        }
    }

    /// The raw `CUevent` recorded on the backend's stream after this copy, for an engine that
    /// orders its own work with its CUDA binding (`cudaStreamWaitEvent`, or
    /// [`CopyHandle::stream_wait`]). Valid while any clone of this handle lives. `None` for copies
    /// without a device event: the host backend, and handles of batches that copied nothing.
    ///
    /// Ordering on the event covers the copy's bytes only: a failed copy also completes its event,
    /// so check [`CopyHandle::wait`] (or [`CopyHandle::try_result`]) before trusting the pages.
    pub fn cuda_event(&self) -> Option<u64> {
        self.shared.event.as_ref().map(|e| e.raw())
    }

    /// Makes all work queued on the raw `CUstream` `stream` after this call wait for the copy,
    /// with no host synchronisation (`cuStreamWaitEvent` on [`CopyHandle::cuda_event`]); the
    /// calling thread's current CUDA context is left as it was. For a copy without a device event
    /// (the host backend; an empty batch) it blocks until the copy is complete instead, so the
    /// caller may read the pages when it returns in either case; `stream` is then not used.
    ///
    /// # Errors
    /// The copy's failure if it has already failed ([`TierError::Copy`]); a driver error from
    /// `cuStreamWaitEvent` (`CopyError::Cuda` under the `cuda` feature). A copy that fails after the wait was queued
    /// is reported by [`CopyHandle::wait`], not here.
    pub fn stream_wait(&self, stream: u64) -> Result<(), TierError> {
        match &self.shared.event {
            Some(ev) => {
                if let Some(r) = self.try_result() {
                    r?;
                }
                ev.stream_wait(stream).map_err(TierError::Copy)
            }
            None => self.wait(),
        }
    }

    /// The layer groups of a layer-wise copy ([`crate::Rank::restore_layers`],
    /// [`crate::Rank::save_layers`]); `None` for a whole-block copy.
    pub fn layer_groups(&self) -> Option<&LayerGroups> {
        self.shared.layers.as_ref().map(|(g, _)| &**g)
    }

    /// The group of `layer` and the readiness, for a layer-wise copy.
    fn layer_group(&self, layer: u32) -> Result<Option<(usize, &dyn LayerReadiness)>, TierError> {
        match &self.shared.layers {
            Some((groups, ready)) => Ok(Some((groups.group_of_layer(layer)?, &**ready))),
            None => Ok(None),
        }
    }

    /// The raw `CUevent` after which layer `layer` (0-based, among the geometry's distinct layers;
    /// see [`crate::Geometry::layers`]) is in place: its layer group's event for a layer-wise copy
    /// on a GPU, the whole copy's event ([`CopyHandle::cuda_event`]) for a whole-block copy (any
    /// `layer` is accepted then). `Ok(None)` without device events (the host backend). Valid while
    /// any clone of this handle lives. Groups complete in layer order: layer `l`'s event also
    /// covers every layer before it.
    ///
    /// # Errors
    /// [`TierError::Copy`] with [`crate::CopyError::NoSuchLayer`] for a layer the geometry does not have.
    pub fn layer_event(&self, layer: u32) -> Result<Option<u64>, TierError> {
        match self.layer_group(layer)? {
            Some((g, ready)) => Ok(ready.cuda_event(g)),
            None => Ok(self.cuda_event()),
        }
    }

    /// Makes work queued on the raw `CUstream` `stream` after this call wait until layer `layer`'s
    /// pages are in place (a restore) or have been read (a save), with no host synchronisation
    /// (`cuStreamWaitEvent` on [`CopyHandle::layer_event`]); the calling thread's CUDA context is
    /// left as it was. Without device events (the host backend) it blocks until the layer's group
    /// has been copied instead (it may do that copy itself), so the caller may read those pages
    /// when it returns; `stream` is then not used. For a whole-block copy it is
    /// [`CopyHandle::stream_wait`]. Layers complete in order: waiting for layer `l` also covers
    /// layers `0..l`.
    ///
    /// # Errors
    /// As [`CopyHandle::stream_wait`]; [`TierError::Copy`] with [`crate::CopyError::NoSuchLayer`]
    /// for a layer the geometry does not have (nothing queued).
    pub fn wait_layer(&self, layer: u32, stream: u64) -> Result<(), TierError> {
        match self.layer_group(layer)? {
            Some((g, ready)) => {
                if let Some(r) = self.try_result() {
                    r?;
                }
                ready.stream_wait(g, stream).map_err(TierError::Copy)
            }
            None => self.stream_wait(stream),
        }
    }

    /// True once layer `layer`'s group has been copied (never blocks; for a whole-block copy, once
    /// the copy's event has completed or the handle is done).
    ///
    /// # Errors
    /// As [`CopyHandle::layer_event`]; driver errors.
    pub fn is_layer_ready(&self, layer: u32) -> Result<bool, TierError> {
        match self.layer_group(layer)? {
            Some((g, ready)) => ready.is_ready(g).map_err(TierError::Copy),
            None => Ok(self.is_done()),
        }
    }

    /// Time from submission to completion, once complete.
    pub fn latency(&self) -> Option<Duration> {
        let st = relock(self.shared.state.lock());
        st.completed_at.map(|t| t.saturating_duration_since(self.shared.submitted_at))
    }
}

/// Awaiting a handle resolves when the copy completes; the waker is called from the rank's
/// completion thread, so an async scheduler is never blocked.
impl Future for CopyHandle {
    type Output = Result<(), TierError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = relock(self.shared.state.lock());
        match &st.result {
            Some(r) => Poll::Ready(to_tier(r)),
            None => {
                if !st.wakers.iter().any(|w| w.will_wake(cx.waker())) {
                    st.wakers.push(cx.waker().clone());
                }
                Poll::Pending
            }
        }
    }
}

impl std::fmt::Debug for CopyHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CopyHandle")
            .field("blocks", &self.blocks())
            .field("done", &self.is_done())
            .field("cuda_event", &self.cuda_event())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::error::CopyError;
    use crate::sync::{AtomicUsize, Ordering};

    #[test]
    fn a_panicking_callback_does_not_stop_completion() {
        let shared = HandleShared::new(1, 10);
        let h = CopyHandle::new(shared.clone());
        let ran = Arc::new(AtomicUsize::new(0));
        h.on_complete(|_| panic!("callback bug"));
        let r = ran.clone();
        h.on_complete(move |res| {
            assert!(res.is_ok());
            r.fetch_add(1, Ordering::Relaxed);
        });
        shared.complete(&Ok(()));
        assert_eq!(ran.load(Ordering::Relaxed), 1, "the callback after the panicking one ran");
        assert!(h.wait().is_ok());
    }

    #[test]
    fn a_spinning_waiter_sees_a_completion_from_another_thread_and_stops_at_its_deadline() {
        let shared = HandleShared::new(1, 10);
        // Not complete: the spin ends at its deadline (well before wait_spin's budget) with false.
        assert!(!shared.spin(Some(Instant::now() + Duration::from_micros(50))));
        assert!(!shared.done.load(Ordering::Acquire));
        let (s2, h) = (shared.clone(), CopyHandle::new(shared.clone()));
        let t = std::thread::spawn(move || s2.complete(&Ok(())));
        // Completed by the other thread: either the spin or the condition variable sees it.
        assert!(h.wait().is_ok());
        t.join().unwrap();
        assert!(shared.done.load(Ordering::Acquire));
        assert!(shared.spin(None), "a completed handle's spin returns at once, true");
        assert!(!wait_spin().is_zero() || std::env::var("KVTIER_WAIT_SPIN_US").is_ok());
    }

    /// A stand-in device event that counts its waits and drops.
    struct FakeEvent {
        waits: Arc<AtomicUsize>,
        drops: Arc<AtomicUsize>,
    }
    impl CopyEvent for FakeEvent {
        fn raw(&self) -> u64 {
            0xe7e7
        }
        fn stream_wait(&self, stream: u64) -> Result<(), CopyError> {
            assert_eq!(stream, 0x5_7ea3);
            self.waits.fetch_add(1, Ordering::Relaxed);
            Ok(())
        }
    }
    impl Drop for FakeEvent {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn the_event_lives_as_long_as_a_handle_and_stream_wait_uses_it() {
        let (waits, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let ev: Arc<dyn CopyEvent> = Arc::new(FakeEvent { waits: waits.clone(), drops: drops.clone() });
        let shared = HandleShared::with_event(2, 64, Some(ev.clone()));
        drop(ev); // the backend's completion is gone: the handle alone owns the event now
        let h = CopyHandle::new(shared.clone());
        let h2 = h.clone();
        assert_eq!(h.cuda_event(), Some(0xe7e7));
        // Pending copy: the stream waits on the event, the host does not.
        h.stream_wait(0x5_7ea3).unwrap();
        assert_eq!(waits.load(Ordering::Relaxed), 1);
        assert!(!h.is_done());
        shared.complete(&Ok(()));
        drop(shared);
        drop(h);
        assert_eq!(drops.load(Ordering::Relaxed), 0, "a clone of the handle still holds the event");
        assert_eq!(h2.cuda_event(), Some(0xe7e7));
        drop(h2);
        assert_eq!(drops.load(Ordering::Relaxed), 1);
    }

    #[test]
    fn stream_wait_reports_a_failed_copy_and_waits_on_the_host_without_an_event() {
        let (waits, drops) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let shared = HandleShared::with_event(1, 16, Some(Arc::new(FakeEvent { waits: waits.clone(), drops })));
        shared.complete(&Err(CopyError::Injected { call: "kernel" }.into()));
        let e = CopyHandle::new(shared).stream_wait(0x5_7ea3).unwrap_err();
        assert!(matches!(e, TierError::Copy(CopyError::Injected { call: "kernel" })), "{e:?}");
        assert_eq!(waits.load(Ordering::Relaxed), 0, "no wait is queued on a failed copy");

        // No event (host backend): stream_wait blocks until the copy completes on another thread.
        let shared = HandleShared::new(1, 16);
        let h = CopyHandle::new(shared.clone());
        assert_eq!(h.cuda_event(), None);
        let t = std::thread::spawn(move || shared.complete(&Ok(())));
        h.stream_wait(0).unwrap();
        assert!(h.is_done());
        t.join().unwrap();
        assert_eq!(CopyHandle::ready().cuda_event(), None);
    }
}

/// A handle's lock, recovered if a thread panicked holding it (the state is one result and a list
/// of callbacks, each updated in one step; see [`crate::sync::lock`]).
fn relock<T>(r: std::sync::LockResult<std::sync::MutexGuard<'_, T>>) -> std::sync::MutexGuard<'_, T> {
    r.unwrap_or_else(|p| p.into_inner())
}
