//! `kvtier.CacheGroup`, `kvtier.HybridLayout`, `kvtier.HybridTier`, `kvtier.HybridLease`: hybrid
//! models (full attention beside sliding-window attention or recurrent state), one host tier per
//! cache group.
//!
//! Threads: as in `crate::tier`, every call that can wait (a query pins blocks in every group's
//! tier, taking its locks) releases the GIL first; nothing here is called back from kvtier's
//! threads. Saves and restores go through each group's own `kvtier.Rank` (`HybridTier.group(g)`
//! is a `kvtier.Tier`), so they keep that class's rules; `kvtier.hybrid` has the Python glue
//! that calls them for every group.

use crate::convert::{key_of, keys_of};
use crate::errors::IntoPyResult;
use crate::geometry::{PyGeometry, PyNamespace};
use crate::tier::{config_error, parse_backing, parse_policy, PyLease, PyTier};
use kvtier::{CacheGroup, GroupKind, HybridConfig, HybridLayout, HybridTier, Lease};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyTuple};
use std::ops::Range;

/// `IndexError` unless `group` indexes one of `count` groups.
fn check_group(group: usize, count: usize) -> PyResult<()> {
    if group >= count {
        return Err(pyo3::exceptions::PyIndexError::new_err(format!(
            "cache group {group} of a layout of {count} groups"
        )));
    }
    Ok(())
}

fn as_tuple(r: Range<usize>) -> (usize, usize) {
    (r.start, r.end)
}

/// One cache group of a hybrid model: a name, what it holds, and its own block layout.
///
/// `CacheGroup(name, kind, geometry, window_tokens=None)`:
///
/// - `name`: unique within the layout (e.g. `"full"`, `"sliding"`, `"state"`).
/// - `kind`: `"full"` (full attention: a restore at boundary `L` blocks needs blocks `0 .. L-1`),
///   `"sliding"` (sliding-window attention over the last `window_tokens` tokens: a restore at
///   `L` needs the blocks holding tokens `[L*T - window_tokens, L*T)`, clamped at 0, `T` the
///   page tokens), or `"state"` (recurrent state: one checkpoint per saved boundary, stored as
///   the block of the boundary's last block `L - 1`; a restore at `L` needs that one block).
/// - `geometry`: the group's arenas (a `Geometry`; its `page_tokens` must be every group's).
///   A group's block is one page id across its arenas, as for a plain tier.
/// - `window_tokens`: tokens of the sliding window (the model config's `sliding_window`), for
///   `kind="sliding"` only.
///
/// Raises: `ConfigError` (an unknown kind, `window_tokens` missing for `"sliding"` or given for
/// another kind); `OverflowError` (a negative or too large `window_tokens`). A window of 0
/// tokens is refused by `HybridLayout` (`CacheGroupsError`).
#[pyclass(module = "kvtier", name = "CacheGroup", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyCacheGroup {
    pub inner: CacheGroup,
}

#[pymethods]
impl PyCacheGroup {
    #[new]
    #[pyo3(signature = (name, kind, geometry, window_tokens = None))]
    fn new(name: String, kind: &str, geometry: &PyGeometry, window_tokens: Option<u32>) -> PyResult<Self> {
        let kind = match (kind, window_tokens) {
            ("full", None) => GroupKind::Full,
            ("state", None) => GroupKind::State,
            ("sliding", Some(w)) => GroupKind::SlidingWindow { window_tokens: w },
            ("sliding", None) => {
                return Err(config_error(format!(
                    "cache group `{name}`: kind=\"sliding\" needs window_tokens (the model's sliding_window)"
                )))
            }
            ("full" | "state", Some(_)) => {
                return Err(config_error(format!(
                    "cache group `{name}`: window_tokens is for kind=\"sliding\" only, not \"{kind}\""
                )))
            }
            (k, _) => return Err(config_error(format!("unknown cache group kind `{k}` (full, sliding, state)"))),
        };
        Ok(PyCacheGroup { inner: CacheGroup::new(name, kind, geometry.inner.clone()) })
    }

    /// The group's name.
    #[getter]
    fn name(&self) -> &str {
        &self.inner.name
    }
    /// `"full"`, `"sliding"` or `"state"`.
    #[getter]
    fn kind(&self) -> &'static str {
        match self.inner.kind {
            GroupKind::Full => "full",
            GroupKind::SlidingWindow { .. } => "sliding",
            GroupKind::State => "state",
        }
    }
    /// The sliding window in tokens (int), or None for a full or state group.
    #[getter]
    fn window_tokens(&self) -> Option<u32> {
        match self.inner.kind {
            GroupKind::SlidingWindow { window_tokens } => Some(window_tokens),
            _ => None,
        }
    }
    /// The group's block layout.
    #[getter]
    fn geometry(&self) -> PyGeometry {
        PyGeometry { inner: self.inner.geometry.clone() }
    }
    fn __repr__(&self) -> String {
        let window = self.window_tokens().map(|w| format!(", window_tokens={w}")).unwrap_or_default();
        format!(
            "CacheGroup({:?}, {:?}{window}, arenas={}, slot_bytes={})",
            self.inner.name,
            self.kind(),
            self.inner.geometry.arenas().len(),
            self.inner.geometry.slot_bytes()
        )
    }
}

/// A validated hybrid layout: a model's cache groups, the namespace they share, and each
/// group's own key space. Immutable.
///
/// `HybridLayout(model, groups)`: `groups` a sequence of `CacheGroup` (1 to 16), in the order
/// the ranks and page lists of every call follow (group index `g`). Or
/// `HybridLayout.preset(name, pages)`.
///
/// Blocks are numbered along the prefix: block `i` covers tokens `[i*T, (i+1)*T)` (`T` =
/// `page_tokens`); a *boundary* `L` (in blocks) is token position `L*T`, where a restore may
/// start the suffix. Engines derive one content key per block in `namespace` (e.g.
/// `namespace.chain(parent, tokens)`); `group_key(g, key)` is that block's key in group `g`.
///
/// Raises: `CacheGroupsError` (empty model name, no groups or more than 16, an empty or repeated
/// group name, groups whose `page_tokens` differ, a sliding window of 0 tokens, state groups
/// only); `TypeError` (an item that is not a `CacheGroup`).
#[pyclass(module = "kvtier", name = "HybridLayout", frozen, eq)]
#[derive(Clone, PartialEq)]
pub struct PyHybridLayout {
    pub inner: HybridLayout,
}

impl PyHybridLayout {
    fn check(&self, group: usize) -> PyResult<()> {
        check_group(group, self.inner.groups().len())
    }
}

#[pymethods]
impl PyHybridLayout {
    #[new]
    fn new(model: String, groups: &Bound<'_, PyAny>) -> PyResult<Self> {
        let groups = groups
            .try_iter()?
            .map(|g| Ok(g?.cast::<PyCacheGroup>()?.get().inner.clone()))
            .collect::<PyResult<Vec<_>>>()?;
        Ok(PyHybridLayout { inner: HybridLayout::new(model, groups).py()? })
    }

    /// A built-in hybrid layout with `pages` GPU pages per arena (state groups: state slots).
    /// Every preset pages 16 tokens, bf16 K and V in one arena per layer:
    /// `gemma3-27b` (groups `full`: 10 layers, 1,310,720 B per block; `sliding`: 52 layers over
    /// a 1,024-token window, 6,815,744 B per block), `qwen3-next-80b` (`full`: 12 layers,
    /// 393,216 B per block; `state`: 36 Gated DeltaNet layers, 77,856,768 B per checkpoint),
    /// `jamba-v0.1` (`full`: 4 layers, 262,144 B per block; `state`: 28 Mamba layers,
    /// 9,175,040 B per checkpoint).
    ///
    /// Raises: `UnknownPresetError`; `ZeroSizeError` (`pages == 0`).
    #[staticmethod]
    fn preset(name: &str, pages: u64) -> PyResult<Self> {
        Ok(PyHybridLayout { inner: HybridLayout::preset(name, pages).py()? })
    }

    /// Names accepted by `HybridLayout.preset`.
    #[staticmethod]
    fn presets() -> Vec<&'static str> {
        HybridLayout::PRESETS.to_vec()
    }

    /// The model name.
    #[getter]
    fn model(&self) -> &str {
        self.inner.model()
    }
    /// Tokens per block, the same in every group.
    #[getter]
    fn page_tokens(&self) -> u32 {
        self.inner.page_tokens()
    }
    /// The groups (`CacheGroup`s), in order.
    #[getter]
    fn groups(&self) -> Vec<PyCacheGroup> {
        self.inner.groups().iter().map(|g| PyCacheGroup { inner: g.clone() }).collect()
    }
    /// The namespace engines derive content keys in (it names every group's layout, the model
    /// and the page size; `Namespace.chain` / `Namespace.key` give the keys).
    #[getter]
    fn namespace(&self) -> PyNamespace {
        PyNamespace { inner: self.inner.namespace() }
    }
    /// The key (16 `bytes`) in group `group` of the block whose content key is `key` (16 bytes,
    /// of `namespace`): XXH3-128 of the group's namespace and `key`. Every group's keys differ.
    ///
    /// Raises: `IndexError` (no such group), `KeyLengthError`.
    fn group_key<'py>(&self, py: Python<'py>, group: usize, key: &Bound<'_, PyAny>) -> PyResult<Bound<'py, PyBytes>> {
        self.check(group)?;
        Ok(PyBytes::new(py, self.inner.group_key(group, &key_of(key)?).as_bytes()))
    }
    /// `[self.group_key(group, k) for k in keys]` (a list of 16-byte `bytes`).
    ///
    /// Raises: `IndexError` (no such group), `KeyLengthError`.
    fn group_keys<'py>(
        &self,
        py: Python<'py>,
        group: usize,
        keys: &Bound<'_, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        self.check(group)?;
        Ok(keys_of(keys)?.iter().map(|k| PyBytes::new(py, self.inner.group_key(group, k).as_bytes())).collect())
    }
    /// The blocks of group `group` a restore at `boundary` (blocks) needs, as `(start, end)`
    /// block indices (`end` exclusive): `(0, boundary)` for full attention, the window's blocks
    /// for a sliding group, `(boundary - 1, boundary)` for a state group; `(0, 0)` at 0.
    ///
    /// Raises: `IndexError` (no such group).
    fn needed(&self, group: usize, boundary: usize) -> PyResult<(usize, usize)> {
        self.check(group)?;
        Ok(as_tuple(self.inner.needed(group, boundary)))
    }
    /// Bytes a restore at `boundary` (blocks) moves, over every group: each group's needed
    /// blocks times its `slot_bytes`.
    fn restore_bytes(&self, boundary: usize) -> u64 {
        self.inner.restore_bytes(boundary)
    }
    /// Bytes the same restore would move if every attention layer were full attention:
    /// `boundary` blocks of every full and sliding group, one checkpoint of every state group.
    fn all_layers_bytes(&self, boundary: usize) -> u64 {
        self.inner.all_layers_bytes(boundary)
    }
    fn __len__(&self) -> usize {
        self.inner.groups().len()
    }
    fn __repr__(&self) -> String {
        let groups: Vec<String> = self.groups().iter().map(|g| g.__repr__()).collect();
        format!(
            "HybridLayout(model={:?}, page_tokens={}, groups=[{}])",
            self.inner.model(),
            self.inner.page_tokens(),
            groups.join(", ")
        )
    }
}

/// A host tier for a hybrid model: one `kvtier.Tier` per cache group (each its own pool, slot
/// size, index and eviction), and queries that answer the longest prefix the model can restore
/// at. Thread-safe.
///
/// `HybridTier(layout, pool_bytes, policy=None, *, backing="auto", group_eviction=True)`:
///
/// - `layout`: a `HybridLayout`.
/// - `pool_bytes`: host memory in bytes, an int split over the groups in proportion to their
///   `slot_bytes` (every group's pool then holds the same number of blocks), or a sequence of
///   ints, group `g`'s pool bytes (a sliding group keeps only its window's blocks per prefix and
///   may be given less).
/// - `policy`, `backing`: as `Tier(...)`'s, for every group's pool.
/// - `group_eviction`: eviction across cache groups (the sliding-window and state blocks no
///   restore can use go first in their groups; saves tell it through `kvtier.hybrid_save(...,
///   tier=tier)`); `False`: each group evicts by its policy alone.
///
/// Attach each GPU to every group: `tier.group(g).attach_cuda(device, group_g_tensors)` (or
/// `attach_host`); save and restore through those ranks with group keys (`kvtier.hybrid_save`,
/// `kvtier.hybrid_restore`).
///
/// Raises: `ConfigError` (unknown policy or backing, a `pool_bytes` list of another length than
/// the groups), `PoolTooSmallError` (a group's pool smaller than one of its slots), the other
/// errors of `Tier(...)`.
#[pyclass(module = "kvtier", name = "HybridTier", frozen)]
pub struct PyHybridTier {
    inner: HybridTier,
}

#[pymethods]
impl PyHybridTier {
    #[new]
    #[pyo3(signature = (layout, pool_bytes, policy = None, *, backing = "auto", group_eviction = true))]
    fn new(
        py: Python<'_>,
        layout: &PyHybridLayout,
        pool_bytes: &Bound<'_, PyAny>,
        policy: Option<&str>,
        backing: &str,
        group_eviction: bool,
    ) -> PyResult<Self> {
        let groups = layout.inner.groups().len();
        let per_group: Option<Vec<u64>> = if pool_bytes.is_instance_of::<PyInt>() {
            None
        } else {
            let v = pool_bytes.try_iter()?.map(|b| b?.extract::<u64>()).collect::<PyResult<Vec<_>>>()?;
            if v.len() != groups {
                return Err(config_error(format!(
                    "pool_bytes: {} sizes for a layout of {groups} cache groups (one per group, or one int)",
                    v.len()
                )));
            }
            Some(v)
        };
        let total = match &per_group {
            Some(v) => v.iter().sum(),
            None => pool_bytes.extract::<u64>()?,
        };
        let mut config = HybridConfig::new(layout.inner.clone(), total).with_group_eviction(group_eviction);
        let policy = policy.map(parse_policy).transpose()?;
        let backing = parse_backing(backing)?;
        for (g, t) in config.tiers.iter_mut().enumerate() {
            if let Some(v) = &per_group {
                t.pool.bytes = v[g];
            }
            if let Some(p) = policy {
                t.policy = p;
            }
            t.pool.backing = backing;
        }
        let inner = py.detach(|| HybridTier::new(config)).py()?;
        Ok(PyHybridTier { inner })
    }

    /// Group `group`'s tier, a `kvtier.Tier` sharing its pool, index and counters: attach its
    /// ranks (`attach_cuda`, `attach_host`), read its `stats()`, `evict(n)`, `contains(group_key)`.
    ///
    /// Raises: `IndexError` (no such group).
    fn group(&self, group: usize) -> PyResult<PyTier> {
        check_group(group, self.inner.layout().groups().len())?;
        Ok(PyTier::wrap(self.inner.group(group).clone()))
    }

    /// Pins the blocks of the longest prefix of `keys` the model can restore at and returns a
    /// `HybridLease` on them in every group (GIL released). `keys`: content keys of
    /// `layout.namespace` (16 bytes each, one per block, the prefix in order; not group keys).
    /// The boundary is the largest `L` at which every full group holds blocks `0 .. L-1`, every
    /// sliding group the window before `L`, and every state group the checkpoint at `L`; 0 is a
    /// miss. `uses`: restores each group's lease allows (one per rank that restores it).
    ///
    /// Raises: `KeyLengthError`.
    #[pyo3(signature = (keys, uses = 1))]
    fn query(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, uses: u32) -> PyResult<PyHybridLease> {
        let keys = keys_of(keys)?;
        let tier = &self.inner;
        let lease = py.detach(|| tier.query_shared(&keys, uses));
        let groups = tier.layout().groups().len();
        let leases =
            (0..groups).map(|g| Py::new(py, PyLease::new(lease.group(g).clone()))).collect::<PyResult<Vec<_>>>()?;
        let ranges = (0..groups).map(|g| lease.range(g)).collect();
        // The clones above hold the pins; dropping the Rust lease here lets go of nothing.
        Ok(PyHybridLease { boundary: lease.boundary(), ranges, leases })
    }

    /// For saves through each group's own rank (`kvtier.hybrid_save` with `tier=` calls it): reads
    /// the full-attention groups' evictions so far and marks the other groups' blocks they left
    /// unusable as the first victims (eviction across cache groups; GIL released). Call it before
    /// saving a sliding-window or state group. Does nothing with `group_eviction=False`.
    fn settle_evictions(&self, py: Python<'_>) {
        let tier = &self.inner;
        py.detach(|| tier.settle_evictions())
    }

    /// For saves through each group's own rank (`kvtier.hybrid_save` with `tier=` calls it):
    /// records that blocks `ranges[g]` (a `(start, end)` pair, end exclusive, or `None` for
    /// nothing) of the prefix `keys` (content keys of `layout.namespace`) were submitted in group
    /// `g`, once per hybrid save after every group's submission: the boundary the prompt now ends
    /// at keeps its window, the window blocks it left behind go first. Does nothing with
    /// `group_eviction=False`.
    ///
    /// Raises: `KeyLengthError`; `GeometryMismatchError` (`ranges` not one per group);
    /// `LengthMismatchError` (a range past `keys`): nothing recorded.
    fn record_save(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, ranges: &Bound<'_, PyAny>) -> PyResult<()> {
        let keys = keys_of(keys)?;
        let ranges = ranges
            .try_iter()?
            .map(|r| {
                let r = r?;
                if r.is_none() {
                    return Ok(0..0);
                }
                let (start, end): (usize, usize) = r.extract()?;
                Ok(start..end)
            })
            .collect::<PyResult<Vec<Range<usize>>>>()?;
        let tier = &self.inner;
        // Seeded bug (tests only): `record-save-ignored` records nothing.
        if crate::seeded::seeded("record-save-ignored") {
            return Ok(());
        }
        py.detach(|| tier.record_save(&keys, &ranges)).py()
    }

    /// Blocks of group `group` marked cold now by eviction across cache groups (the first victims
    /// of their group; 0 with `group_eviction=False` and for full-attention groups).
    ///
    /// Raises: `IndexError` (no such group).
    fn cold_blocks(&self, group: usize) -> PyResult<usize> {
        check_group(group, self.inner.layout().groups().len())?;
        Ok(self.inner.cold_blocks(group))
    }

    /// The longest usable prefix of `keys` in blocks, looked up without pinning (GIL released);
    /// it may be stale by the time it is used: restore from `query`.
    ///
    /// Raises: `KeyLengthError`.
    fn usable_prefix(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        let tier = &self.inner;
        Ok(py.detach(|| tier.usable_prefix(&keys)))
    }

    /// The layout.
    #[getter]
    fn layout(&self) -> PyHybridLayout {
        PyHybridLayout { inner: self.inner.layout().clone() }
    }
    /// The layout's namespace (content keys are derived in it).
    #[getter]
    fn namespace(&self) -> PyNamespace {
        PyNamespace { inner: self.inner.layout().namespace() }
    }
    /// Stops every group's tier (saves, restores and attaches refused; queries still answer).
    fn shutdown(&self) {
        self.inner.shutdown()
    }
    fn __len__(&self) -> usize {
        self.inner.layout().groups().len()
    }
    fn __repr__(&self) -> String {
        let groups: Vec<String> = self
            .inner
            .layout()
            .groups()
            .iter()
            .enumerate()
            .map(|(g, c)| format!("{}: {} blocks", c.name, self.inner.group(g).capacity()))
            .collect();
        format!("HybridTier(model={:?}, groups=[{}])", self.inner.layout().model(), groups.join(", "))
    }
}

/// Pins on the blocks a restore at one boundary needs, in every group (from `HybridTier.query`).
/// Settled by the restores it allows, by `release()`, by leaving its `with` block, or by garbage
/// collection. `len(lease)` is the boundary in blocks (0: a miss; the lease is falsy).
///
/// `group(g)` is group `g`'s `kvtier.Lease`, for `Rank.restore` on that group's rank: restoring
/// `len(range(g))` pages from it writes blocks `range(g)` of the prefix. A full group's lease may
/// hold more blocks than the boundary (its whole ready prefix); a restore of `len(range(g))`
/// pages reads just the first ones.
#[pyclass(module = "kvtier", name = "HybridLease", frozen)]
pub struct PyHybridLease {
    boundary: usize,
    ranges: Vec<Range<usize>>,
    leases: Vec<Py<PyLease>>,
}

impl PyHybridLease {
    fn leases(&self) -> Vec<Lease> {
        self.leases.iter().map(|l| l.get().lease().clone()).collect()
    }
}

#[pymethods]
impl PyHybridLease {
    /// The usable prefix, in blocks (0: a miss); the restored prefix is `boundary * page_tokens`
    /// tokens.
    #[getter]
    fn boundary(&self) -> usize {
        self.boundary
    }
    /// The block indices leased in group `group`, as `(start, end)` (`end` exclusive): what a
    /// restore of that group writes, in order (`layout.needed(group, boundary)`).
    ///
    /// Raises: `IndexError` (no such group).
    fn range(&self, group: usize) -> PyResult<(usize, usize)> {
        check_group(group, self.ranges.len())?;
        Ok(as_tuple(self.ranges[group].clone()))
    }
    /// Every group's `range(g)`, in group order (a list of `(start, end)` block indices).
    #[getter]
    fn ranges(&self) -> Vec<(usize, usize)> {
        self.ranges.iter().cloned().map(as_tuple).collect()
    }
    /// Group `group`'s `kvtier.Lease` (the same object on every call).
    ///
    /// Raises: `IndexError` (no such group).
    fn group(&self, py: Python<'_>, group: usize) -> PyResult<Py<PyLease>> {
        check_group(group, self.leases.len())?;
        Ok(self.leases[group].clone_ref(py))
    }
    /// True once every group's lease has settled.
    #[getter]
    fn settled(&self, py: Python<'_>) -> bool {
        let leases = self.leases();
        py.detach(|| leases.iter().all(|l| l.is_settled()))
    }
    /// Settles every group's lease now (restores already submitted complete normally). Returns
    /// True if this call settled any of them. GIL released.
    fn release(&self, py: Python<'_>) -> bool {
        let leases = self.leases();
        py.detach(|| leases.into_iter().fold(false, |any, l| l.release() | any))
    }
    fn __len__(&self) -> usize {
        self.boundary
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
        let ranges: Vec<String> = self.ranges.iter().map(|r| format!("({}, {})", r.start, r.end)).collect();
        let settled = if self.settled(py) { "True" } else { "False" };
        format!("HybridLease(boundary={}, ranges=[{}], settled={settled})", self.boundary, ranges.join(", "))
    }
}
