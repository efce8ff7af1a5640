//! Python values -> kvtier arguments: content keys, page lists, CUDA stream and event handles.

use crate::errors::Raised;
use kvtier::{ContentKey, WaitFor};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// A bytes-like object's bytes (`bytes` directly; anything `bytes()` accepts otherwise:
/// `bytearray`, `memoryview`, a numpy row). A `str` is refused (keys are bytes, not text).
pub fn bytes_of(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u8>> {
    if let Ok(b) = obj.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyInt>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(format!(
            "{what} must be bytes-like (bytes, bytearray, memoryview), not {}",
            obj.get_type().name()?
        )));
    }
    let b = obj.py().get_type::<PyBytes>().call1((obj,))?;
    Ok(b.cast::<PyBytes>()?.as_bytes().to_vec())
}

/// One 16-byte content key.
pub fn key_of(obj: &Bound<'_, PyAny>) -> PyResult<ContentKey> {
    let b = bytes_of(obj, "a content key")?;
    let raw: [u8; 16] = b.as_slice().try_into().map_err(|_| {
        PyErr::from(Raised::custom(
            "KeyLengthError",
            format!("a content key is 16 bytes, got {} (derive keys with Namespace.key)", b.len()),
        ))
    })?;
    Ok(ContentKey::from_bytes(raw))
}

/// A sequence of 16-byte content keys.
pub fn keys_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<ContentKey>> {
    if obj.is_instance_of::<PyBytes>() {
        return Err(pyo3::exceptions::PyTypeError::new_err(
            "keys must be a sequence of 16-byte keys, not one bytes object",
        ));
    }
    obj.try_iter()?.map(|k| key_of(&k?)).collect()
}

/// A sequence of non-negative ints (a list, a tuple, a range, a numpy array or a CPU tensor:
/// anything with `tolist()` is converted through it first).
pub fn ints_of(obj: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let list;
    let obj = if obj.hasattr("tolist")? && !obj.is_instance_of::<PyList>() {
        list = obj.call_method0("tolist")?;
        &list
    } else {
        obj
    };
    obj.try_iter()?.map(|p| p?.extract::<u64>()).collect()
}

/// A raw CUDA handle: an int, or an object carrying one (`torch.cuda.Stream.cuda_stream`,
/// `torch.cuda.Event.cuda_event`, cupy's `.ptr`).
pub fn handle_of(obj: &Bound<'_, PyAny>, attrs: &[&str]) -> PyResult<u64> {
    if let Ok(v) = obj.extract::<u64>() {
        return Ok(v);
    }
    for a in attrs {
        if obj.hasattr(*a)? {
            return obj.getattr(*a)?.extract::<u64>();
        }
    }
    Err(pyo3::exceptions::PyTypeError::new_err(format!(
        "expected a raw CUDA handle (int) or an object with one of the attributes {attrs:?}, got {}",
        obj.get_type().name()?
    )))
}

/// What a copy waits for: `after_event` (a recorded `CUevent`) or `after_stream` (all work queued
/// on a `CUstream` so far), at most one of them.
pub fn wait_for(after_stream: Option<&Bound<'_, PyAny>>, after_event: Option<&Bound<'_, PyAny>>) -> PyResult<WaitFor> {
    match (after_stream, after_event) {
        (Some(_), Some(_)) => {
            Err(pyo3::exceptions::PyValueError::new_err("give after_stream or after_event, not both"))
        }
        (Some(s), None) => Ok(WaitFor::CudaStream(handle_of(s, &["cuda_stream", "ptr"])?)),
        (None, Some(e)) => Ok(WaitFor::CudaEvent(handle_of(e, &["cuda_event", "ptr"])?)),
        (None, None) => Ok(WaitFor::Nothing),
    }
}

/// A JSON value (from a serialised stats struct) as Python objects.
pub fn json_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value as V;
    Ok(match v {
        V::Null => py.None().into_bound(py),
        V::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        V::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        V::String(s) => s.into_pyobject(py)?.into_any(),
        V::Array(a) => {
            let l = PyList::empty(py);
            for x in a {
                l.append(json_to_py(py, x)?)?;
            }
            l.into_any()
        }
        V::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// A serialisable value as a Python dict (or list, or scalar).
pub fn to_py<'py>(py: Python<'py>, v: &impl serde::Serialize) -> PyResult<Bound<'py, PyAny>> {
    let j = serde_json::to_value(v).map_err(|e| pyo3::exceptions::PyRuntimeError::new_err(e.to_string()))?;
    json_to_py(py, &j)
}

/// A count given as a Python int (or any object with `__index__`), clamped to `usize::MAX`: a
/// count beyond every pool asks for everything, and never overflows.
///
/// Raises: `TypeError` (not an int), `ValueError` (negative).
pub fn count_of(obj: &Bound<'_, PyAny>) -> PyResult<usize> {
    if let Ok(n) = obj.extract::<usize>() {
        return Ok(n);
    }
    let int = obj.py().import("operator")?.call_method1("index", (obj,))?;
    if int.lt(0)? {
        return Err(pyo3::exceptions::PyValueError::new_err(format!("a count must be non-negative, got {int}")));
    }
    Ok(usize::MAX)
}
