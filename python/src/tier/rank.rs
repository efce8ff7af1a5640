//! `kvtier.Rank`: a rank's calls (save, restore, drain, close) and the cell that lets `close`
//! wait for the calls in progress with the GIL released.

use super::handles::{PyCopyHandle, PyLease, PySaveTicket};
use super::options::config_error;
use super::{deadline_after, passed, seconds, slice_until};
use crate::convert::{handle_of, ints_of, keys_of, to_py, wait_for};
use crate::errors::{IntoPyResult, Raised};
use crate::reaper;
use kvtier::{Fit, Lease, Rank, SaveOptions, TierError};
use pyo3::prelude::*;
use pyo3::types::PyTuple;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(super) fn new_rank(rank: Rank, watch: Py<PyAny>, device: Option<u32>) -> PyRank {
    PyRank { cell: RankCell { state: Mutex::new(Some(Arc::new(rank))), released: Condvar::new() }, watch, device }
}

/// One GPU (or host) rank of a `Tier`: saves its pages to the pool and restores blocks into them.
/// Returned by `Tier.attach_cuda` / `Tier.attach_host`; holds the tensors until closed.
///
/// Use it as a context manager, or call `close()`: closing waits for the rank's calls in progress
/// on other threads and drains its in-flight copies (with the GIL released), then releases the
/// tensors. A rank that is garbage-collected unclosed drains too, on a kvtier thread with the GIL
/// released (a connected rank's drain is daemon round trips), and releases its tensors after.
/// Any method may be called from any thread, at the same time as any other.
#[pyclass(module = "kvtier", name = "Rank", frozen)]
pub struct PyRank {
    // Declared (and so dropped) before `watch`: dropping the Rank drains its copies first.
    cell: RankCell,
    /// `kvtier._tensors.ArenaWatch`: the tensors, what owns their memory, and the check that
    /// neither changed.
    watch: Py<PyAny>,
    device: Option<u32>,
}

impl Drop for PyRank {
    fn drop(&mut self) {
        // No call is in progress (each holds a reference to this object): the rank is ours alone.
        let Some(rank) = self.cell.state.get_mut().unwrap_or_else(|p| p.into_inner()).take() else { return };
        let rank = match Arc::try_unwrap(rank) {
            Ok(rank) => rank,
            Err(still_used) => {
                // Unreachable by the reason above; never drop a rank another holder still uses.
                std::mem::forget(still_used);
                std::mem::forget(Python::attach(|py| self.watch.clone_ref(py)));
                return;
            }
        };
        // Seeded bug (tests only): the old drain here, with the GIL held.
        if crate::seeded::seeded("rank-drop-holds-gil") {
            drop(rank);
            return;
        }
        {
            // The tensors go after the drain, on the reaper thread: this clone keeps them alive
            // when `watch` itself is dropped below.
            let watch = Python::attach(|py| self.watch.clone_ref(py));
            reaper::drop_rank(rank, watch);
        }
    }
}

/// The rank of a `PyRank`: shared by the calls in progress on it (each holds an `Arc` for its
/// whole call, GIL-released sections included) and taken out by `close`, which waits for the
/// last of them to let go with the GIL released.
///
/// `state` is held only for a few instructions (never across a wait for the GIL, a copy or a
/// daemon round trip; `Condvar::wait` releases it), so taking it with the GIL held cannot
/// deadlock, and no lock is held across a GIL-released section.
struct RankCell {
    state: Mutex<Option<Arc<Rank>>>,
    /// Signalled whenever a call in progress lets go of the rank.
    released: Condvar,
}

/// A call in progress on a rank: keeps the rank open (and `close` waiting) until dropped.
struct RankUse<'a> {
    cell: &'a RankCell,
    rank: Option<Arc<Rank>>,
}

impl std::ops::Deref for RankUse<'_> {
    type Target = Rank;
    fn deref(&self) -> &Rank {
        self.rank.as_deref().expect("taken only by drop")
    }
}

impl Drop for RankUse<'_> {
    fn drop(&mut self) {
        drop(self.rank.take());
        // Under the lock, so a `close` between its count check and its wait cannot miss this.
        let _state = self.cell.lock();
        self.cell.released.notify_all();
    }
}

/// How `RankCell::close` ended.
enum Closed {
    /// It was closed already (or being closed by another thread).
    Already,
    /// Detached and drained: the tensors may be released.
    Done,
    /// Calls or copies still in progress at the deadline: the rank (its backend, its arenas) and
    /// the tensors are leaked for good, never freed under a copy.
    Stuck(TierError),
}

impl RankCell {
    fn lock(&self) -> MutexGuard<'_, Option<Arc<Rank>>> {
        // Nothing can panic while the lock is held; a poisoned lock still holds a sound value.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The rank for one call, or None once closed.
    fn get(&self) -> Option<RankUse<'_>> {
        let rank = self.lock().clone()?;
        Some(RankUse { cell: self, rank: Some(rank) })
    }

    /// Takes the rank out (later calls find it closed), waits until no call in progress holds it,
    /// then drains and drops it. Blocks: call it with the GIL released. `timeout` bounds the whole
    /// wait; None waits for good.
    fn close(&self, timeout: Option<Duration>) -> Closed {
        let deadline = deadline_after(timeout);
        let mut state = self.lock();
        let Some(rank) = state.take() else { return Closed::Already };
        while Arc::strong_count(&rank) > 1 {
            state = match deadline {
                None => self.released.wait(state).unwrap_or_else(|p| p.into_inner()),
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        let calls = Arc::strong_count(&rank) as u64 - 1;
                        let in_flight = rank.load().batches + calls;
                        // The calls in progress still use the rank: it must never be dropped.
                        std::mem::forget(rank);
                        return Closed::Stuck(TierError::DrainTimeout { in_flight });
                    }
                    self.released.wait_timeout(state, left).unwrap_or_else(|p| p.into_inner()).0
                }
            };
        }
        drop(state);
        let Ok(rank) = Arc::try_unwrap(rank) else {
            unreachable!("no call holds the rank: its count was 1 under the lock that `get` takes")
        };
        match deadline {
            Some(d) => match rank.shutdown(d.saturating_duration_since(Instant::now())) {
                Ok(()) => Closed::Done,
                Err(e) => Closed::Stuck(e),
            },
            None => {
                drop(rank); // drains: joins the completion threads after their queues are empty
                Closed::Done
            }
        }
    }
}

fn closed() -> PyErr {
    Raised::custom("ShuttingDownError", "the rank is closed").into()
}

impl PyRank {
    /// The rank for one call (`ShuttingDownError` once closed).
    fn rank(&self) -> PyResult<RankUse<'_>> {
        self.cell.get().ok_or_else(closed)
    }

    /// Raises `ArenaChangedError` if a tensor was resized or its storage replaced since attach.
    fn check_arenas(&self, py: Python<'_>) -> PyResult<()> {
        // Seeded bug (tests only): no check, so a rank copies into whatever the tensor's old
        // address is now.
        if !crate::seeded::seeded("no-arena-check") {
            self.watch.bind(py).call_method0("check")?;
        }
        Ok(())
    }
}

impl PyRank {
    /// `restore` (`groups: None`) and `restore_layers`: the rank taken under its short lock, the
    /// arenas checked, then the copy submitted with the GIL released.
    fn restore_as(
        &self,
        py: Python<'_>,
        lease: &PyLease,
        pages: &Bound<'_, PyAny>,
        after_stream: Option<&Bound<'_, PyAny>>,
        after_event: Option<&Bound<'_, PyAny>>,
        groups: Option<u32>,
    ) -> PyResult<PyCopyHandle> {
        let pages = ints_of(pages)?;
        let wait = wait_for(after_stream, after_event)?;
        let rank = self.rank()?;
        self.check_arenas(py)?;
        let rank: &Rank = &rank;
        let lease: &Lease = &lease.inner;
        let handle = py
            .detach(|| match groups {
                None => rank.restore(lease, &pages, wait),
                Some(g) => rank.restore_layers(lease, &pages, wait, g),
            })
            .py()?;
        Ok(PyCopyHandle { inner: handle })
    }
}

#[pymethods]
impl PyRank {
    /// Saves the blocks in pages `pages[i]` under `keys[i]` (device -> host, one batch).
    ///
    /// `keys`: 16-byte content keys; `pages`: page ids (ints, `< geometry.pages`), one per key.
    /// `after_stream`: a `CUstream` (int, or a `torch.cuda.Stream`) whose queued work (the kernels
    /// that wrote the pages) the copy waits for; or `after_event`: a recorded `CUevent` (int or
    /// `torch.cuda.Event`). Both are ignored by host ranks (finish writing first).
    /// `fit`: `"all"` (save every missing key or raise `CannotFitError`, evicting nothing) or
    /// `"prefix"` (save the longest leading run that fits and the policy admits).
    /// `prefix_depth`: position of `keys[0]` in its prompt, in pages (for prefix-aware policies).
    ///
    /// Keys already resident are refreshed and skipped; keys being saved by another call are
    /// skipped. The pages must not be rewritten until the returned ticket's `done()` (or `wait()`).
    ///
    /// Returns: `SaveTicket` (`saving`, `resident`, `in_flight`, `dropped`, `handle`, `wait()`).
    /// Raises: `LengthMismatchError`, `PageOutOfRangeError`, `CannotFitError`, `PoolExhaustedError`,
    /// `KeyLengthError`, `ShuttingDownError`, `DeviceError`, `ArenaChangedError` (a tensor resized
    /// or replaced since attach: nothing was saved); on a connected tier also `DisconnectedError`,
    /// `LimitExceededError`, `ForkedChildError`.
    #[pyo3(signature = (keys, pages, after_stream = None, *, after_event = None, fit = "all", prefix_depth = None))]
    #[allow(clippy::too_many_arguments)] // the Python signature's keyword arguments
    fn save(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        after_stream: Option<&Bound<'_, PyAny>>,
        after_event: Option<&Bound<'_, PyAny>>,
        fit: &str,
        prefix_depth: Option<u32>,
    ) -> PyResult<PySaveTicket> {
        let keys = keys_of(keys)?;
        let pages = ints_of(pages)?;
        let wait = wait_for(after_stream, after_event)?;
        let fit = match fit {
            "all" => Fit::AllOrNothing,
            "prefix" => Fit::Prefix,
            f => return Err(config_error(format!("unknown fit `{f}` (all, prefix)"))),
        };
        let rank = self.rank()?;
        self.check_arenas(py)?;
        let rank: &Rank = &rank;
        let ticket = py
            .detach(|| {
                rank.save_with(&keys, &pages, wait, {
                    let opts = SaveOptions::new().fit(fit);
                    match prefix_depth {
                        Some(d) => opts.prefix_depth(d),
                        None => opts,
                    }
                })
            })
            .py()?;
        PySaveTicket::new(py, ticket)
    }

    /// Restores the first `len(pages)` blocks of `lease` into pages `pages[i]` (host -> device, one
    /// batch) and uses up one restore of the lease. The copy holds its own pins: the lease may be
    /// released while it runs.
    ///
    /// `after_stream` / `after_event`: what the copy waits for before it overwrites the pages (the
    /// last readers of their old contents), as in `save`. Before reading the restored pages, make
    /// the engine's stream wait: `handle.stream_wait(torch.cuda.current_stream())` (no host sync),
    /// or `handle.wait()`.
    ///
    /// Returns: `CopyHandle`.
    /// Raises: `LeaseTooShortError`, `LeaseSettledError`, `ForeignLeaseError`,
    /// `PageOutOfRangeError`, `DuplicateDestinationError`, `TooManyPinsError`,
    /// `ShuttingDownError`, `DeviceError`, `ArenaChangedError` (a tensor resized or replaced since
    /// attach: nothing was restored, the lease keeps its use); on a connected tier also
    /// `DisconnectedError`, `ForkedChildError`.
    #[pyo3(signature = (lease, pages, after_stream = None, *, after_event = None))]
    fn restore(
        &self,
        py: Python<'_>,
        lease: &PyLease,
        pages: &Bound<'_, PyAny>,
        after_stream: Option<&Bound<'_, PyAny>>,
        after_event: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCopyHandle> {
        self.restore_as(py, lease, pages, after_stream, after_event, None)
    }

    /// `restore` in layer order: the blocks move one group of layers at a time (`groups` groups of
    /// consecutive layers of the tier's geometry, `Geometry.layers`), every block's first group
    /// first, as one submission. Before layer `l`'s attention, `handle.wait_layer(l, stream)`
    /// makes the engine's stream wait for that layer's pages only (no host sync), so later layers
    /// cross PCIe under the compute of earlier ones. Arguments and errors as `restore`;
    /// `BackendMismatchError` for `groups == 0`.
    #[pyo3(signature = (lease, pages, groups, after_stream = None, *, after_event = None))]
    fn restore_layers(
        &self,
        py: Python<'_>,
        lease: &PyLease,
        pages: &Bound<'_, PyAny>,
        groups: u32,
        after_stream: Option<&Bound<'_, PyAny>>,
        after_event: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyCopyHandle> {
        self.restore_as(py, lease, pages, after_stream, after_event, Some(groups))
    }

    /// `save` in layer order, for a save during the prefill: the copy of layer group `g`
    /// (`groups` groups) reads the pages only after `after_events[g]` (a recorded `CUevent`:
    /// int or `torch.cuda.Event`, recorded after the group's last layer wrote its pages, before
    /// this call), off the engine's stream. `after_events`: one event per group, or one for all.
    /// Returns a `SaveTicket`; errors as `save`.
    #[pyo3(signature = (keys, pages, groups, after_events, *, fit = "all"))]
    fn save_layers(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        pages: &Bound<'_, PyAny>,
        groups: u32,
        after_events: &Bound<'_, PyAny>,
        fit: &str,
    ) -> PyResult<PySaveTicket> {
        let keys = keys_of(keys)?;
        let pages = ints_of(pages)?;
        let waits = after_events
            .try_iter()?
            .map(|e| Ok(kvtier::WaitFor::CudaEvent(handle_of(&e?, &["cuda_event", "ptr"])?)))
            .collect::<PyResult<Vec<_>>>()?;
        let fit = match fit {
            "all" => Fit::AllOrNothing,
            "prefix" => Fit::Prefix,
            f => return Err(config_error(format!("unknown fit `{f}` (all, prefix)"))),
        };
        let rank = self.rank()?;
        self.check_arenas(py)?;
        let rank: &Rank = &rank;
        let ticket = py.detach(|| rank.save_layers(&keys, &pages, &waits, groups, SaveOptions::new().fit(fit))).py()?;
        PySaveTicket::new(py, ticket)
    }

    /// What this rank has in flight, as a dict: `save_gpu_pages` (pages that saves still read:
    /// do not reuse them yet), `restore_slots`, `batches`.
    fn load<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        to_py(py, &self.rank()?.load())
    }

    /// Blocks (GIL released) until nothing is in flight, or `timeout` seconds pass.
    ///
    /// Raises: `DrainTimeoutError`, `ShuttingDownError` (closed).
    #[pyo3(signature = (timeout = None))]
    fn drain(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let deadline = deadline_after(seconds(timeout)?);
        let rank = self.rank()?;
        let rank: &Rank = &rank;
        loop {
            match py.detach(|| rank.drain(slice_until(deadline))) {
                Ok(()) => return Ok(()),
                Err(e) if passed(deadline) => return Err(e).py(),
                Err(_) => py.check_signals()?,
            }
        }
    }

    /// Closes the rank: later calls raise `ShuttingDownError`; then waits, with the GIL released,
    /// for the calls in progress on other threads (a save, restore or drain) to return and for the
    /// in-flight copies to drain, detaches the rank and releases its tensors. Idempotent (a second
    /// call, also one made while the first is waiting, returns at once). With `timeout` (seconds)
    /// and calls or copies still running then, the rank and its tensors are kept for good (never
    /// freed under a copy) and `DrainTimeoutError` is raised (`in_flight`: batches in flight plus
    /// calls in progress).
    #[pyo3(signature = (timeout = None))]
    fn close(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<()> {
        let timeout = seconds(timeout)?;
        // Seeded bug (tests only): waiting for the calls in progress with the GIL held, which a
        // call in progress needs to return.
        let closed = if crate::seeded::seeded("close-waits-holding-gil") {
            self.cell.close(timeout)
        } else {
            py.detach(|| self.cell.close(timeout))
        };
        match closed {
            Closed::Already => Ok(()),
            Closed::Done => {
                self.watch.bind(py).call_method0("release")?;
                Ok(())
            }
            Closed::Stuck(e) => {
                // Copies may still use the tensors' memory: keep them alive for good.
                std::mem::forget(self.watch.clone_ref(py));
                // Seeded bug (tests only): the tensors released under the calls still in progress.
                if crate::seeded::seeded("close-timeout-releases-tensors") {
                    self.watch.bind(py).call_method0("release")?;
                }
                Err(e).py()
            }
        }
    }

    /// True once `close()` has been called.
    #[getter]
    fn closed(&self) -> bool {
        self.cell.lock().is_none()
    }
    /// The rank's id within its tier (attach order, from 0).
    #[getter]
    fn id(&self) -> PyResult<u32> {
        Ok(self.rank()?.id())
    }
    /// The copy backend: `cuda` or `host`.
    #[getter]
    fn backend(&self) -> PyResult<&'static str> {
        Ok(self.rank()?.backend_name())
    }
    /// The CUDA device ordinal, or None for a host rank.
    #[getter]
    fn device(&self) -> Option<u32> {
        self.device
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> PyResult<bool> {
        self.close(py, None)?;
        Ok(false)
    }
    fn __repr__(&self) -> String {
        match self.cell.get() {
            Some(r) => format!("Rank(id={}, backend={}, device={:?})", r.id(), r.backend_name(), self.device),
            None => "Rank(closed)".into(),
        }
    }
}
