//! What a tier's and a rank's calls hand back: `kvtier.Lease`, `kvtier.CopyHandle` and
//! `kvtier.SaveTicket`.

use super::{deadline_after, passed, py_bool, seconds, slice_until};
use crate::convert::handle_of;
use crate::errors::IntoPyResult;
use crate::reaper;
use kvtier::{CopyHandle, Lease, SaveTicket};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};
use std::mem::ManuallyDrop;

/// Pins on the blocks a query found, in key order, settled exactly once: by the restores it
/// allows (`uses`), by `release()`, by leaving its `with` block, or by garbage collection.
/// `len(lease)` is the number of leading keys found (0: nothing to restore; the lease is falsy).
///
/// On a tier from `kvtier.connect`, `settled`, `uses_left`, `release()`, `__exit__` and `repr`
/// ask the daemon (GIL released); garbage collection never waits (the daemon is told from
/// another thread).
#[pyclass(module = "kvtier", name = "Lease", frozen)]
pub struct PyLease {
    /// Taken only by `Drop`, which hands it to `reaper::drop_lease`.
    pub(super) inner: ManuallyDrop<Lease>,
    /// The peers the query asked that failed, as (address, message).
    peer_errors: Vec<(String, String)>,
}

impl PyLease {
    pub(crate) fn new(inner: Lease) -> Self {
        PyLease { inner: ManuallyDrop::new(inner), peer_errors: Vec::new() }
    }

    /// A lease whose query asked peers, with the ones that failed.
    pub(crate) fn with_peer_errors(inner: Lease, peer_errors: Vec<(String, String)>) -> Self {
        PyLease { inner: ManuallyDrop::new(inner), peer_errors }
    }

    /// The lease (a shared handle: a clone settles the same lease).
    pub(crate) fn lease(&self) -> &Lease {
        &self.inner
    }
}

impl Drop for PyLease {
    fn drop(&mut self) {
        // SAFETY: `inner` is taken once, here, and never used afterwards (self is being dropped).
        let lease = unsafe { ManuallyDrop::take(&mut self.inner) };
        // Seeded bug (tests only): dropped here, waiting for the daemon connection with the GIL.
        if crate::seeded::seeded("lease-drop-inline") {
            drop(lease);
        } else {
            reaper::drop_lease(lease);
        }
    }
}

#[pymethods]
impl PyLease {
    fn __len__(&self) -> usize {
        self.inner.len()
    }
    /// The keys of the leased blocks (16-byte `bytes`), in order.
    #[getter]
    fn keys<'py>(&self, py: Python<'py>) -> Vec<Bound<'py, PyBytes>> {
        self.inner.blocks().iter().map(|b| PyBytes::new(py, b.key.as_bytes())).collect()
    }
    /// Leased blocks the query read back from the SSD tier into host slots (the daemon's SSD tier
    /// for a tier from `kvtier.connect`); `sources` says which. 0 without an SSD tier.
    #[getter]
    fn promoted(&self) -> usize {
        self.inner.promoted()
    }
    /// Where each leased block came from, in key order: `"host"` (resident in the pool),
    /// `"ssd"` (promoted from the SSD tier by this query) or `"peer"` (fetched from a peer's pool
    /// by this query, its generation checked with the owner). For a tier from `kvtier.connect`,
    /// where the daemon's query found it.
    #[getter]
    fn sources(&self) -> Vec<&'static str> {
        (0..self.inner.len())
            .map(|i| match self.inner.source(i) {
                Some(kvtier::BlockSource::Ssd) => "ssd",
                Some(kvtier::BlockSource::Peer) => "peer",
                _ => "host",
            })
            .collect()
    }
    /// Leased blocks this query fetched from peers (`Tier(peers=...)`, or `kvtierd --peer` for a
    /// tier from `kvtier.connect`).
    #[getter]
    #[allow(clippy::wrong_self_convention)] // a Python property (`lease.from_peer`), not a conversion
    fn from_peer(&self) -> usize {
        self.inner.from_peer()
    }
    /// The peers this query asked that failed (unreachable, gone, past `peer_timeout_s`, another
    /// protocol version or model, a refusal), as `(address, message)` pairs; the query went on
    /// without them. Empty for a tier without `peers=`. A daemon's peer failures are in its log.
    #[getter]
    fn peer_errors(&self) -> Vec<(String, String)> {
        self.peer_errors.clone()
    }
    /// True once the lease has settled (its pins are gone). A connected tier's lease asks the
    /// daemon (GIL released); a lost connection counts as settled.
    #[getter]
    fn settled(&self, py: Python<'_>) -> bool {
        let lease: &Lease = &self.inner;
        py.detach(|| lease.is_settled())
    }
    /// Restores this lease still allows (0 once settled). A connected tier's lease asks the
    /// daemon (GIL released).
    #[getter]
    fn uses_left(&self, py: Python<'_>) -> u32 {
        let lease: &Lease = &self.inner;
        py.detach(|| lease.uses_left())
    }
    /// For a lease of a tier from `kvtier.connect`: 16 bytes that another process connected to the
    /// same daemon passes to `Tier.open_lease` to restore from this lease. None for an in-process
    /// tier's lease and for an empty one.
    #[getter]
    fn token<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.inner.token().map(|t| PyBytes::new(py, &t.to_bytes()))
    }
    /// Settles now, dropping the pins (restores already submitted complete normally). Returns True
    /// if this call settled it. GIL released (a daemon round trip on a connected tier).
    fn release(&self, py: Python<'_>) -> bool {
        let lease: &Lease = &self.inner;
        py.detach(|| lease.clone().release())
    }
    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }
    #[pyo3(signature = (*_exc))]
    fn __exit__(&self, py: Python<'_>, _exc: &Bound<'_, PyTuple>) -> bool {
        self.release(py);
        false
    }
    fn __repr__(&self, py: Python<'_>) -> String {
        let lease: &Lease = &self.inner;
        let (uses_left, settled) = py.detach(|| (lease.uses_left(), lease.is_settled()));
        format!("Lease(blocks={}, uses_left={}, settled={})", lease.len(), uses_left, py_bool(settled))
    }
}

/// A submitted save or restore batch. Complete once the bytes have landed and the tier has
/// finalised the batch (saved blocks visible to queries; a restore's pins dropped).
#[pyclass(module = "kvtier", name = "CopyHandle", frozen)]
pub struct PyCopyHandle {
    pub(super) inner: CopyHandle,
}

#[pymethods]
impl PyCopyHandle {
    /// Blocks until the copy is complete, with the GIL released (other Python threads run;
    /// Ctrl-C is checked every 50 ms). `timeout`: seconds, or None to wait for good.
    ///
    /// Returns: True once complete, False if `timeout` passed first (nothing is cancelled).
    /// Raises: the copy's failure (`DeviceError`, ...); a failed save's blocks never become visible.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let deadline = deadline_after(seconds(timeout)?);
        loop {
            match py.detach(|| self.inner.wait_timeout(slice_until(deadline))) {
                Some(r) => return r.py().map(|_| true),
                None if passed(deadline) => return Ok(false),
                None => py.check_signals()?,
            }
        }
    }
    /// True once complete (successfully or not); never blocks.
    fn done(&self) -> bool {
        self.inner.is_done()
    }
    /// The raw `CUevent` (int) recorded after the copy on kvtier's stream, valid while this handle
    /// lives; None for host ranks and empty batches.
    #[getter]
    fn cuda_event(&self) -> Option<u64> {
        self.inner.cuda_event()
    }
    /// Makes `stream` (a raw `CUstream` int, a `torch.cuda.Stream`, or an object with `.ptr`) wait
    /// for the copy without a host sync: kernels queued there afterwards see the restored pages.
    /// For host ranks it waits for completion instead (GIL released).
    ///
    /// Raises: the copy's failure if it has already failed; `DeviceError`.
    fn stream_wait(&self, py: Python<'_>, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = handle_of(stream, &["cuda_stream", "ptr"])?;
        py.detach(|| self.inner.stream_wait(s)).py()
    }
    /// The raw `CUevent` (int) after which layer `layer` (0-based) is in place: its group's event
    /// for a layer-wise copy (`Rank.restore_layers`), the whole copy's `cuda_event` otherwise;
    /// None for host ranks. Layers complete in order.
    ///
    /// Raises: `BackendMismatchError` for a layer the geometry does not have.
    fn layer_event(&self, layer: u32) -> PyResult<Option<u64>> {
        self.inner.layer_event(layer).py()
    }
    /// Makes `stream` (as in `stream_wait`) wait until layer `layer`'s pages are in place, with no
    /// host sync; waiting for layer `l` also covers layers before it. For host ranks it blocks
    /// until the layer's group has been copied (GIL released). A whole-block copy waits for all.
    ///
    /// Raises: the copy's failure if it has already failed; `BackendMismatchError` for a layer the
    /// geometry does not have; `DeviceError`.
    fn wait_layer(&self, py: Python<'_>, layer: u32, stream: &Bound<'_, PyAny>) -> PyResult<()> {
        let s = handle_of(stream, &["cuda_stream", "ptr"])?;
        py.detach(|| self.inner.wait_layer(layer, s)).py()
    }
    /// The end (exclusive, 0-based) of the layer group holding `layer` in a layer-wise copy:
    /// once `wait_layer(layer, ...)` has made a stream wait, every layer below this end is covered
    /// too, so an engine needs one wait per group, not per layer. None for a whole-block copy (one
    /// wait covers every layer).
    ///
    /// Raises: `BackendMismatchError` for a layer the geometry does not have (layer-wise copies).
    fn layer_group_end(&self, layer: u32) -> PyResult<Option<u32>> {
        match self.inner.layer_groups() {
            Some(groups) => {
                let g = groups.group_of_layer(layer).py()?;
                Ok(Some(groups.layers(g).end))
            }
            None => Ok(None),
        }
    }
    /// Layer groups of a layer-wise copy (int), or None for a whole-block copy.
    #[getter]
    fn layer_groups(&self) -> Option<usize> {
        self.inner.layer_groups().map(|g| g.len())
    }
    /// Blocks in the batch.
    #[getter]
    fn blocks(&self) -> usize {
        self.inner.blocks()
    }
    /// Payload bytes the batch moves (blocks x geometry.block_bytes).
    #[getter]
    fn bytes(&self) -> u64 {
        self.inner.bytes()
    }
    /// Seconds from submission to completion, once complete (else None).
    #[getter]
    fn latency(&self) -> Option<f64> {
        self.inner.latency().map(|d| d.as_secs_f64())
    }
    fn __repr__(&self) -> String {
        format!("CopyHandle(blocks={}, done={})", self.inner.blocks(), py_bool(self.inner.is_done()))
    }
}

/// What `Rank.save` did: which keys it is copying and which it skipped, and the copy's handle.
#[pyclass(module = "kvtier", name = "SaveTicket", frozen)]
pub struct PySaveTicket {
    saving: Vec<usize>,
    resident: usize,
    in_flight: usize,
    duplicates: usize,
    dropped: usize,
    handle: Py<PyCopyHandle>,
}

impl PySaveTicket {
    pub(super) fn new(py: Python<'_>, t: SaveTicket) -> PyResult<Self> {
        Ok(PySaveTicket {
            saving: t.saving,
            resident: t.resident,
            in_flight: t.in_flight,
            duplicates: t.duplicates,
            dropped: t.dropped,
            handle: Py::new(py, PyCopyHandle { inner: t.handle })?,
        })
    }
}

#[pymethods]
impl PySaveTicket {
    /// Indices (into the keys given) of the blocks being copied, in order.
    #[getter]
    fn saving(&self) -> Vec<usize> {
        self.saving.clone()
    }
    /// Keys already resident (refreshed, not copied).
    #[getter]
    fn resident(&self) -> usize {
        self.resident
    }
    /// Keys another save is copying right now (skipped).
    #[getter]
    fn in_flight(&self) -> usize {
        self.in_flight
    }
    /// Keys repeated within the save (copied once).
    #[getter]
    fn duplicates(&self) -> usize {
        self.duplicates
    }
    /// Keys not saved by `fit="prefix"` (no room, or not admitted by the policy).
    #[getter]
    fn dropped(&self) -> usize {
        self.dropped
    }
    /// The copy's `CopyHandle` (already complete when nothing needed copying).
    #[getter]
    fn handle(&self, py: Python<'_>) -> Py<PyCopyHandle> {
        self.handle.clone_ref(py)
    }
    /// `handle.wait(timeout)`: once True, the saved blocks are visible to queries.
    #[pyo3(signature = (timeout = None))]
    fn wait(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        self.handle.get().wait(py, timeout)
    }
    /// `handle.done()`.
    fn done(&self) -> bool {
        self.handle.get().done()
    }
    fn __repr__(&self) -> String {
        format!(
            "SaveTicket(saving={}, resident={}, in_flight={}, dropped={}, done={})",
            self.saving.len(),
            self.resident,
            self.in_flight,
            self.dropped,
            py_bool(self.done())
        )
    }
}
