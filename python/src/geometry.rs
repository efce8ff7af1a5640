//! `kvtier.Geometry` and `kvtier.Namespace`.

use crate::convert::{bytes_of, ints_of, key_of};
use crate::errors::IntoPyResult;
use kvtier::{ArenaSpec, ContentKey, Geometry, Namespace, Placement};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};

/// One arena of a tensor as `kvtier._tensors.arena_views` describes it.
#[derive(Clone, Debug)]
pub struct ArenaView {
    pub ptr: u64,
    pub bytes_per_page: u64,
    pub page_stride: u64,
    pub pages: u64,
}

/// Reads per-layer tensors (torch tensors, numpy arrays, `__cuda_array_interface__` objects) with
/// the Python helper, which checks devices and page contiguity and raises the typed exceptions.
pub fn arena_views(
    py: Python<'_>,
    tensors: &Bound<'_, PyAny>,
    page_tokens: u32,
    layout: &str,
    device: Option<(&str, Option<u32>)>,
    writable: bool,
) -> PyResult<Vec<ArenaView>> {
    let helper = py.import("kvtier._tensors")?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("page_tokens", page_tokens)?;
    kwargs.set_item("layout", layout)?;
    kwargs.set_item("device", device)?;
    kwargs.set_item("writable", writable)?;
    let views = helper.getattr("arena_views")?.call((tensors,), Some(&kwargs))?;
    views
        .try_iter()?
        .map(|v| {
            let (ptr, bytes_per_page, page_stride, pages) = v?.extract::<(u64, u64, u64, u64)>()?;
            Ok(ArenaView { ptr, bytes_per_page, page_stride, pages })
        })
        .collect()
}

/// The layout of one block: which arenas (per-layer KV tensors) a page spans and how a block lies
/// in a host slot. Immutable; its `namespace` is folded into every content key.
///
/// Build it from the engine's tensors (`Geometry.from_tensors`), from a preset
/// (`Geometry.preset("llama3-8b", pages)`), or from arena tuples:
/// `Geometry(model, page_tokens, [(name, bytes_per_page, page_stride, pages), ...])`
/// (bytes; `page_stride >= bytes_per_page`, both multiples of 16).
///
/// Raises: a `GeometryError` subclass (`NoArenasError`, `MisalignedError`, `ZeroSizeError`, ...).
#[pyclass(module = "kvtier", name = "Geometry", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyGeometry {
    pub inner: Geometry,
}

#[pymethods]
impl PyGeometry {
    #[new]
    #[pyo3(signature = (model, page_tokens, arenas))]
    fn new(model: &str, page_tokens: u32, arenas: &Bound<'_, PyAny>) -> PyResult<Self> {
        let mut specs = Vec::new();
        for a in arenas.try_iter()? {
            let (name, bytes_per_page, page_stride, pages) = a?.extract::<(String, u64, u64, u64)>()?;
            specs.push(ArenaSpec { name, bytes_per_page, page_stride, pages, placement: Placement::Own });
        }
        Ok(PyGeometry { inner: Geometry::new(model, page_tokens, specs).py()? })
    }

    /// A built-in layout with `pages` GPU pages per arena. Names: `glm52`, `qwen3-4b`,
    /// `deepseek-v3`, `deepseek-v3-bf16`, `llama3-8b` (32 layers, 16-token pages, arenas `k.L{l}`
    /// and `v.L{l}` of 8 heads x 128 dims x bf16 x 16 tokens = 32,768 B per page, in layer order).
    ///
    /// Raises: `UnknownPresetError`.
    #[staticmethod]
    fn preset(name: &str, pages: u64) -> PyResult<Self> {
        Ok(PyGeometry { inner: Geometry::preset(name, pages).py()? })
    }

    /// Names accepted by `Geometry.preset`.
    #[staticmethod]
    fn presets() -> Vec<&'static str> {
        Geometry::PRESETS.to_vec()
    }

    /// The geometry of an engine's paged KV tensors, one arena per tensor, in the order given.
    ///
    /// `tensors`: a sequence of torch tensors, numpy arrays or `__cuda_array_interface__`
    /// objects, all on one device. With `layout="tokens"` (default) dimension 0 indexes tokens:
    /// shape `[pages * page_tokens, ...]` (e.g. `[pages * 16, kv_heads, head_dim]`), a page is
    /// `page_tokens` consecutive rows and must be contiguous. With `layout="pages"` dimension 0
    /// indexes pages (`[pages, page_tokens, kv_heads, head_dim]`, or a strided view into a fused
    /// buffer): the dimensions after 0 must be contiguous, the page stride is `stride(0)`.
    /// Bytes per page = rows per page x product of the other dimensions x element size.
    /// `names`: arena names (default `arena0`, `arena1`, ...); `model` and `page_tokens` and the
    /// names and page sizes make the namespace.
    ///
    /// Raises: `DeviceMismatchError` (tensors on different devices), `NotContiguousError` (a
    /// page's bytes are not contiguous), `TensorError` (not a tensor, a shape that is not a whole
    /// number of pages), `MisalignedError` (page size or stride not a multiple of 16 B), other
    /// `GeometryError`s.
    #[staticmethod]
    #[pyo3(signature = (tensors, *, model, page_tokens = 16, names = None, layout = "tokens"))]
    fn from_tensors(
        py: Python<'_>,
        tensors: &Bound<'_, PyAny>,
        model: &str,
        page_tokens: u32,
        names: Option<Vec<String>>,
        layout: &str,
    ) -> PyResult<Self> {
        let views = arena_views(py, tensors, page_tokens, layout, None, false)?;
        let names = match names {
            Some(n) if n.len() != views.len() => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "{} names for {} tensors",
                    n.len(),
                    views.len()
                )))
            }
            Some(n) => n,
            None => (0..views.len()).map(|i| format!("arena{i}")).collect(),
        };
        let specs = views
            .iter()
            .zip(names)
            .map(|(v, name)| ArenaSpec {
                name,
                bytes_per_page: v.bytes_per_page,
                page_stride: v.page_stride,
                pages: v.pages,
                placement: Placement::Own,
            })
            .collect();
        let g = Geometry::new(model, page_tokens, specs).py()?;
        // The bases must be usable too (alignment, overlap): check them now, not at attach time.
        kvtier::ArenaBinding::new(&g, views.iter().map(|v| v.ptr).collect()).py()?;
        Ok(PyGeometry { inner: g })
    }

    /// Model name (part of the namespace).
    #[getter]
    fn model(&self) -> &str {
        self.inner.model()
    }
    /// Tokens per page (part of the namespace).
    #[getter]
    fn page_tokens(&self) -> u32 {
        self.inner.page_tokens()
    }
    /// Valid page ids are `0 .. pages - 1` (the smallest page count of the arenas).
    #[getter]
    fn pages(&self) -> u64 {
        self.inner.pages()
    }
    /// Bytes of one host slot (the arenas' chunks, each aligned to 256 B).
    #[getter]
    fn slot_bytes(&self) -> u64 {
        self.inner.slot_bytes()
    }
    /// Payload bytes of one block (sum of the arenas' bytes per page).
    #[getter]
    fn block_bytes(&self) -> u64 {
        self.inner.block_bytes()
    }
    /// Bytes one block takes in an SSD tier's file (`Tier(..., ssd=...)`): `slot_bytes` plus the
    /// 96-byte slot trailer (key, generation, checksums), rounded up to 4,096 B.
    #[getter]
    fn disk_slot_bytes(&self) -> u64 {
        self.inner.disk_slot_bytes()
    }
    /// Blocks an SSD tier file of `file_bytes` bytes holds: its 4,096 B header, then slots of
    /// `disk_slot_bytes` (0 when the file is smaller than the header and one slot). A file of
    /// `n` blocks takes `4096 + n * disk_slot_bytes` bytes.
    fn disk_slots(&self, file_bytes: u64) -> u64 {
        self.inner.disk_slots(file_bytes)
    }
    /// The arenas as dicts: `name`, `bytes_per_page`, `page_stride`, `pages` (bytes, pages).
    #[getter]
    fn arenas<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let l = PyList::empty(py);
        for a in self.inner.arenas() {
            let d = PyDict::new(py);
            d.set_item("name", &a.name)?;
            d.set_item("bytes_per_page", a.bytes_per_page)?;
            d.set_item("page_stride", a.page_stride)?;
            d.set_item("pages", a.pages)?;
            l.append(d)?;
        }
        Ok(l)
    }
    /// Tensor-parallel shard `(index, count)`, or None.
    #[getter]
    fn shard(&self) -> Option<(u32, u32)> {
        self.inner.shard()
    }
    /// The namespace folded into this layout's content keys.
    #[getter]
    fn namespace(&self) -> PyNamespace {
        PyNamespace { inner: self.inner.namespace() }
    }
    /// The same layout with `pages` pages per arena (same namespace).
    ///
    /// Raises: `ZeroSizeError`, `ExtentOverflowError`.
    fn with_pages(&self, pages: u64) -> PyResult<Self> {
        Ok(PyGeometry { inner: self.inner.with_pages(pages).py()? })
    }
    /// The same layout with arena `i` in model layer `layers[i]` (ints that never decrease in
    /// arena order), for layer-wise copies (`Rank.restore_layers`, `Rank.save_layers`). The
    /// namespace is unchanged. Presets set the layers; `Geometry(...)` and `from_tensors` put every
    /// arena in layer 0 (one group).
    ///
    /// Raises: `GeometryError` for a count other than the arenas' or a decreasing id.
    fn with_layers(&self, layers: Vec<u32>) -> PyResult<Self> {
        Ok(PyGeometry { inner: self.inner.with_layers(layers).py()? })
    }
    /// The model layer of each arena, in arena order (a list of ints).
    #[getter]
    fn layers(&self) -> Vec<u32> {
        self.inner.layers().to_vec()
    }
    /// The same layout as tensor-parallel shard `index` of `count` (its own namespace).
    ///
    /// Raises: `MissingFieldError` for `count == 0` or `index >= count`.
    fn with_shard(&self, index: u32, count: u32) -> PyResult<Self> {
        Ok(PyGeometry { inner: self.inner.with_shard(index, count).py()? })
    }
    fn __len__(&self) -> usize {
        self.inner.arenas().len()
    }
    fn __repr__(&self) -> String {
        format!(
            "Geometry(model={:?}, page_tokens={}, arenas={}, pages={}, block_bytes={}, slot_bytes={})",
            self.inner.model(),
            self.inner.page_tokens(),
            self.inner.arenas().len(),
            self.inner.pages(),
            self.inner.block_bytes(),
            self.inner.slot_bytes()
        )
    }
}

/// A 16-byte digest of the layout facts that make blocks interchangeable. Every content key is
/// folded with it, so engines with different layouts never hit each other's blocks.
///
/// Keys are `bytes` of length 16. Derive them from the engine's own block hashes with
/// `Namespace.key(hash_bytes)` (XXH3-128 of namespace + bytes, any length) or as lineage hashes of
/// token ids with `Namespace.chain(parent_key, tokens)`.
#[pyclass(module = "kvtier", name = "Namespace", frozen, eq, hash)]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct PyNamespace {
    pub inner: Namespace,
}

fn key_bytes<'py>(py: Python<'py>, k: &ContentKey) -> Bound<'py, PyBytes> {
    PyBytes::new(py, k.as_bytes())
}

#[pymethods]
impl PyNamespace {
    /// A namespace from its 16-byte digest (`Namespace.digest`).
    ///
    /// Raises: `KeyLengthError` if `digest` is not 16 bytes.
    #[new]
    fn new(digest: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyNamespace { inner: Namespace::from_bytes(*key_of(digest)?.as_bytes()) })
    }

    /// A namespace digesting an arbitrary description (e.g. `b"my-model/tp0"`), for keys that do
    /// not come from a `Geometry`.
    #[staticmethod]
    fn from_description(description: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(PyNamespace { inner: Namespace::from_description(&bytes_of(description, "a description")?) })
    }

    /// The 16 digest bytes.
    #[getter]
    fn digest<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, self.inner.as_bytes())
    }

    /// The content key (16 `bytes`) of an engine block hash `data` of any length (bytes-like):
    /// XXH3-128 over the 16 namespace bytes followed by `data`. Equal hashes give equal keys;
    /// the hash should name the block's whole prefix (a lineage hash).
    ///
    /// Raises: `TypeError` for a `str` or an int (encode it first).
    fn key<'py>(&self, py: Python<'py>, data: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        Ok(key_bytes(py, &self.inner.key_from_bytes(&bytes_of(data, "a block hash")?)))
    }

    /// `[self.key(h) for h in hashes]`.
    fn keys<'py>(&self, py: Python<'py>, hashes: &Bound<'_, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        hashes.try_iter()?.map(|h| self.key(py, &h?)).collect()
    }

    /// A lineage key: the hash of a page's token ids (little-endian u32) chained to its parent
    /// page's key (`None` for the first page), so the key names the whole prefix.
    ///
    /// `tokens`: a sequence of ints (a list, a numpy array or a CPU tensor).
    /// Raises: `KeyLengthError` if `parent` is not 16 bytes.
    #[pyo3(signature = (parent, tokens))]
    fn chain<'py>(
        &self,
        py: Python<'py>,
        parent: Option<&Bound<'_, PyAny>>,
        tokens: &Bound<'_, PyAny>,
    ) -> PyResult<Bound<'py, PyBytes>> {
        let parent = parent.map(key_of).transpose()?;
        let toks: Vec<u32> = ints_of(tokens)?
            .into_iter()
            .map(|t| u32::try_from(t).map_err(|_| pyo3::exceptions::PyOverflowError::new_err("token id above u32")))
            .collect::<PyResult<_>>()?;
        Ok(key_bytes(py, &self.inner.chain(parent.as_ref(), &toks)))
    }

    fn __repr__(&self) -> String {
        format!("Namespace({})", ContentKey::from_bytes(*self.inner.as_bytes()))
    }
}
