//! `kvtier._kvtier`: the native half of the `kvtier` Python package (PyO3, abi3 for CPython >= 3.10).
//!
//! The classes here wrap kvtier's public API: `Geometry`, `Namespace`, `Tier`, `Rank`, `Lease`,
//! `CopyHandle`, `SaveTicket`, and the hybrid layouts' `CacheGroup`, `HybridLayout`, `HybridTier`,
//! `HybridLease` (`hybrid.rs`). The pure Python half (`kvtier/`) defines the exception classes
//! (`kvtier/errors.py`) and reads tensors and arrays (`kvtier/_tensors.py`); this crate calls into
//! it only on the caller's thread. kvtier's own threads never call into Python.

mod convert;
mod errors;
mod geometry;
mod hybrid;
mod peers;
mod reaper;
mod seeded;
mod tier;

use pyo3::prelude::*;

/// One exception instance of every error variant the binding maps, as `(class_name, exception)`
/// pairs (for the test suite: each must be an instance of `kvtier.errors.<class_name>` carrying the
/// variant's fields). Not a stable API.
#[pyfunction]
fn _error_examples(py: Python<'_>) -> PyResult<Vec<(&'static str, Bound<'_, PyAny>)>> {
    errors::examples().into_iter().map(|(name, r)| Ok((name, r.to_exception(py)?))).collect()
}

/// Blocks (GIL released) until every connected-tier lease that Python garbage-collected before
/// this call has been dropped at the daemon (collection hands them to a thread, so it never
/// waits for the connection). For tests; not a stable API.
#[pyfunction]
fn _settle_dropped_leases(py: Python<'_>) {
    py.detach(reaper::settle)
}

/// True if this machine can run CUDA ranks: the driver and NVRTC libraries load and a device is
/// present. Never raises.
#[pyfunction]
fn cuda_available(py: Python<'_>) -> bool {
    py.detach(kvtier::cuda_available)
}

#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<geometry::PyGeometry>()?;
    m.add_class::<geometry::PyNamespace>()?;
    m.add_class::<tier::PyTier>()?;
    m.add_class::<tier::PyRank>()?;
    m.add_class::<tier::PyLease>()?;
    m.add_class::<tier::PyCopyHandle>()?;
    m.add_class::<tier::PySaveTicket>()?;
    m.add_class::<hybrid::PyCacheGroup>()?;
    m.add_class::<hybrid::PyHybridLayout>()?;
    m.add_class::<hybrid::PyHybridTier>()?;
    m.add_class::<hybrid::PyHybridLease>()?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add_function(wrap_pyfunction!(peers::peers_available, m)?)?;
    m.add_function(wrap_pyfunction!(tier::connect, m)?)?;
    m.add_function(wrap_pyfunction!(tier::default_socket_path, m)?)?;
    m.add_function(wrap_pyfunction!(seeded::_seeded_bug, m)?)?;
    m.add_function(wrap_pyfunction!(tier::_serve, m)?)?;
    m.add_function(wrap_pyfunction!(_error_examples, m)?)?;
    m.add_function(wrap_pyfunction!(_settle_dropped_leases, m)?)?;
    Ok(())
}
