//! Completion handles for submitted copies: poll, wait, await, or register a callback.
//!
//! A [`CopyHandle`] is completed by the rank's completion thread after the backend reports the copy
//! finished *and* the tier has finalised it (saved blocks committed and visible, restore guards
//! dropped). So once a save's handle is done, a query finds the blocks; once a restore's handle is
//! done, the GPU pages hold the bytes. Waiting with a timeout never frees anything: memory is
//! released only by completion.

use crate::error::{CopyError, TierError};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

type Callback = Box<dyn FnOnce(&Result<(), CopyError>) + Send>;

#[derive(Default)]
struct State {
    result: Option<Result<(), CopyError>>,
    completed_at: Option<Instant>,
    wakers: Vec<Waker>,
    callbacks: Vec<Callback>,
}

pub(crate) struct HandleShared {
    state: Mutex<State>,
    cv: Condvar,
    submitted_at: Instant,
    blocks: usize,
    bytes: u64,
}

impl HandleShared {
    pub(crate) fn new(blocks: usize, bytes: u64) -> Arc<Self> {
        Arc::new(HandleShared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
            submitted_at: Instant::now(),
            blocks,
            bytes,
        })
    }

    /// Records the outcome and wakes every waiter, future and callback (once).
    pub(crate) fn complete(&self, result: &Result<(), CopyError>) {
        let r = result.clone();
        let (wakers, callbacks) = {
            let mut st = self.state.lock().expect("handle lock");
            debug_assert!(st.result.is_none(), "handle completed twice");
            st.result = Some(r.clone());
            st.completed_at = Some(Instant::now());
            (std::mem::take(&mut st.wakers), std::mem::take(&mut st.callbacks))
        };
        self.cv.notify_all();
        for w in wakers {
            w.wake();
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

/// The copy's outcome as the handle reports it: the backend's error, in its original variant.
fn to_tier(r: &Result<(), CopyError>) -> Result<(), TierError> {
    r.clone().map_err(TierError::Copy)
}

/// A handle to one submitted save or restore batch. Cloning shares it.
#[derive(Clone)]
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
        self.shared.state.lock().expect("handle lock").result.is_some()
    }

    /// The outcome if complete, without blocking.
    pub fn try_result(&self) -> Option<Result<(), TierError>> {
        self.shared.state.lock().expect("handle lock").result.as_ref().map(to_tier)
    }

    /// Blocks until complete.
    ///
    /// # Errors
    /// The copy's failure ([`TierError::Copy`]); a failed save's blocks were never made visible.
    pub fn wait(&self) -> Result<(), TierError> {
        let mut st = self.shared.state.lock().expect("handle lock");
        while st.result.is_none() {
            st = self.shared.cv.wait(st).expect("handle lock");
        }
        to_tier(st.result.as_ref().expect("set"))
    }

    /// Blocks until complete or `timeout` passes; `None` on timeout (nothing is cancelled or freed).
    pub fn wait_timeout(&self, timeout: Duration) -> Option<Result<(), TierError>> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.state.lock().expect("handle lock");
        while st.result.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            st = self.shared.cv.wait_timeout(st, deadline - now).expect("handle lock").0;
        }
        st.result.as_ref().map(to_tier)
    }

    /// Runs `f` with the outcome when the copy completes (at once, on this thread, if it already
    /// has; otherwise on the rank's completion thread, which `f` must not block for long). A panic
    /// in `f` on the completion thread is caught and logged; it does not stop that thread.
    pub fn on_complete(&self, f: impl FnOnce(Result<(), TierError>) + Send + 'static) {
        let mut st = self.shared.state.lock().expect("handle lock");
        if let Some(r) = st.result.clone() {
            drop(st);
            f(to_tier(&r));
        } else {
            st.callbacks.push(Box::new(move |r| f(to_tier(r))));
        }
    }

    /// Time from submission to completion, once complete.
    pub fn latency(&self) -> Option<Duration> {
        let st = self.shared.state.lock().expect("handle lock");
        st.completed_at.map(|t| t.saturating_duration_since(self.shared.submitted_at))
    }
}

/// Awaiting a handle resolves when the copy completes; the waker is called from the rank's
/// completion thread, so an async scheduler is never blocked.
impl Future for CopyHandle {
    type Output = Result<(), TierError>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.shared.state.lock().expect("handle lock");
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
        f.debug_struct("CopyHandle").field("blocks", &self.blocks()).field("done", &self.is_done()).finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
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
}
