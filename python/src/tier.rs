//! `kvtier.Tier`, `kvtier.Rank`, `kvtier.Lease`, `kvtier.CopyHandle`, `kvtier.SaveTicket`.
//!
//! Threads: every call runs on the caller's thread. kvtier's completion threads never call into
//! Python (no callbacks are registered). The rule that keeps the GIL and kvtier's locks from
//! deadlocking: **no thread waits while it holds the GIL**. Every call that can wait (a copy, a
//! drain, a daemon round trip, a lock that such a wait may hold) releases the GIL first
//! (`Python::detach`). The only locks taken with the GIL held are the binding's own short ones
//! (`RankCell::state`), which no thread holds across a wait or while it waits for the GIL. A
//! rank's calls in progress hold an `Arc` of it, not a lock across their GIL-released section;
//! `Rank.close` waits for them with the GIL released. A connected tier's lease collected by Python
//! is dropped on another thread (`crate::reaper`), since its destructor cannot release the GIL.

use crate::convert::{count_of, handle_of, ints_of, key_of, keys_of, to_py, wait_for};
use crate::errors::{IntoPyResult, Raised};
use crate::geometry::{arena_views, ArenaView, PyGeometry, PyNamespace};
use crate::reaper;
use kvtier::BackingChoice;
use kvtier::{
    ArenaBinding, ArenaSpec, CopyError, CopyHandle, Fit, Geometry, HostTier, Lease, LeaseToken, PolicyKind, Rank,
    SaveOptions, SaveTicket, TierConfig, TierError,
};
use kvtier::{CopyMode, CudaBackend, CudaOptions};
use kvtier::{MemcpyArenas, MemcpyBackend};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple};
use std::mem::ManuallyDrop;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a GIL-released wait blocks before it checks for Ctrl-C.
const WAIT_SLICE: Duration = Duration::from_millis(50);

/// `True` / `False`, for reprs.
fn py_bool(b: bool) -> &'static str {
    if b {
        "True"
    } else {
        "False"
    }
}

pub(crate) fn config_error(message: String) -> PyErr {
    Raised::custom("ConfigError", message).into()
}

/// A pool backing name of `Tier(..., backing=...)`: `auto`, `hugetlb`, `thp`, `plain`.
///
/// Raises: `ConfigError` for another name.
pub(crate) fn parse_backing(backing: &str) -> PyResult<BackingChoice> {
    Ok(match backing {
        "auto" => BackingChoice::Auto,
        "hugetlb" => BackingChoice::HugeTlb,
        "thp" => BackingChoice::TransparentHuge,
        "plain" => BackingChoice::Plain,
        b => return Err(config_error(format!("unknown backing `{b}` (auto, hugetlb, thp, plain)"))),
    })
}

/// An eviction policy name of `Tier(..., policy=...)`.
///
/// Raises: `ConfigError` for an unknown name (the message lists the known ones).
pub(crate) fn parse_policy(policy: &str) -> PyResult<PolicyKind> {
    policy.parse::<PolicyKind>().map_err(|e| config_error(e.to_string()))
}

/// The host tier: one pinned host pool of block slots, a content index and an eviction policy,
/// shared by every rank (GPU) attached to it. Thread-safe; share one per process.
///
/// `Tier(geometry, pool_bytes, policy=None, *, backing="auto", prefault=False, mlock=False,
/// numa_node=None, lease_ttl_s=None, ssd=None, ssd_admit_uses=None, ssd_io=None,
/// ssd_read_depth=None, peers=None, peer_listen=None, peer_timeout_s=2.0, peer_pinned_blocks=None,
/// peer_secret_file=None, serve=None)`:
///
/// - `geometry`: the block layout (`Geometry`); every attached rank's tensors must match it.
/// - `pool_bytes`: host memory for block slots, in bytes; capacity = `pool_bytes // geometry.slot_bytes`.
/// - `policy`: eviction policy name: `lru`, `clock`, `sieve`, `s3fifo`, `2q`, `prefix-lfu`,
///   `prefix-tinylfu`, `adaptive-lfu` (None: kvtier's default, `adaptive-lfu`).
/// - `backing`: `auto` (hugetlb if reserved, else transparent hugepages), `hugetlb`, `thp`, `plain`.
/// - `prefault`: touch every page now (slower start, no page faults on first saves).
/// - `mlock`: lock the pool in memory. `numa_node`: bind the pool to this NUMA node.
/// - `lease_ttl_s`: seconds after which a forgotten lease may be settled under pool pressure.
/// - `ssd`: an SSD tier under the pool: a `(path, bytes)` pair, or a list of them (one file per
///   drive). Each file (its directory must exist) is created and preallocated if missing, or
///   reopened and its blocks found again (`ssd_stats()["recovered_blocks"]`); it holds
///   `geometry.disk_slots(bytes)` blocks and takes `4096 + blocks * geometry.disk_slot_bytes`
///   bytes. Host blocks are written to it in the background once used `ssd_admit_uses` times
///   (default: decided online, after 1 or 2 uses, from the drive's ghost hits; 1 writes every saved
///   block; 2: the save, then one query), and a query whose host
///   prefix ends where the SSD tier holds the next blocks reads them back into host slots,
///   verified, in the same lease (`Lease.promoted`).
/// - `ssd_io`: `direct` (`O_DIRECT` where the filesystem takes it, the default) or `buffered`.
/// - `ssd_read_depth`: reads in flight while a query promotes blocks (1 to 1,024; default 8).
/// - `serve`: a Unix socket path (str or `os.PathLike`) to serve this tier's pool on, as `kvtierd`
///   does, from a thread of this process: other processes of the same user `kvtier.connect(path)`
///   and share the pool while this process lives (the pool is then in shared memory, 4 KiB pages
///   unless hugepages are reserved). What a single vLLM engine's connector uses instead of a daemon.
///
/// Raises: `PoolTooSmallError` (not one slot), `HugePagesUnavailableError`, `PoolMapError`,
/// `PoolSyscallError`, `NoSuchNumaNodeError`, `TooManySlotsError`, `ConfigError` (unknown policy or
/// backing name; an SSD file too small for one block, a bad `ssd_*` option, `ssd_*` options
/// without `ssd`, a path that holds no kvtier file, no space for the file, an I/O error opening
/// it), `GeometryMismatchError` (an SSD file made for another geometry, namespace or size; the
/// file is left as it was); with `serve`, `ConfigError` (a daemon already listens at the path, the
/// path is taken or its directory is not this user's).
#[pyclass(module = "kvtier", name = "Tier", frozen)]
pub struct PyTier {
    inner: HostTier,
    /// The peer roles `peers=` and `peer_listen=` started (feature `peers`).
    peers: Option<crate::peers::TierPeers>,
    /// The Unix socket `serve=` serves this tier's pool on, or None.
    served: Option<std::path::PathBuf>,
}

impl PyTier {
    /// A `Tier` over `inner` (for a hybrid tier's group: a clone of that group's `HostTier`,
    /// which shares its pool, index and counters).
    pub(crate) fn wrap(inner: HostTier) -> Self {
        PyTier { inner, peers: None, served: None }
    }
}

fn rank_geometry(tier: &Geometry, views: &[ArenaView]) -> PyResult<Geometry> {
    if views.len() != tier.arenas().len() {
        return Err(Raised::from(&CopyError::ArenaCount { given: views.len(), arenas: tier.arenas().len() }).into());
    }
    let mut specs = Vec::with_capacity(views.len());
    for (v, a) in views.iter().zip(tier.arenas()) {
        if v.bytes_per_page != a.bytes_per_page {
            return Err(Raised::from(&CopyError::PageBytesMismatch {
                arena: a.name.clone(),
                given: v.bytes_per_page,
                geometry: a.bytes_per_page,
            })
            .into());
        }
        specs.push(ArenaSpec { page_stride: v.page_stride, pages: v.pages, ..a.clone() });
    }
    let g = Geometry::new(tier.model(), tier.page_tokens(), specs).py()?;
    match tier.shard() {
        Some((i, n)) => g.with_shard(i, n).py(),
        None => Ok(g),
    }
}

fn parse_cuda_options(options: Option<&Bound<'_, PyDict>>) -> PyResult<CudaOptions> {
    let mut o = CudaOptions::default();
    let Some(d) = options else { return Ok(o) };
    for (k, v) in d.iter() {
        let k: String = k.extract()?;
        match k.as_str() {
            "mode" => {
                o.mode = match v.extract::<String>()?.as_str() {
                    "auto" => CopyMode::Auto,
                    "zero-copy" => CopyMode::ZeroCopy,
                    "staged" => CopyMode::Staged,
                    m => return Err(config_error(format!("unknown copy mode `{m}` (auto, zero-copy, staged)"))),
                }
            }
            "save_ctas" => o.save_ctas = v.extract()?,
            "restore_ctas" => o.restore_ctas = v.extract()?,
            "staged_ctas" => o.staged_ctas = v.extract()?,
            "staged_piece_blocks" => o.staged_piece_blocks = v.extract()?,
            "high_priority" => o.high_priority = v.extract()?,
            "reserved_sms" => o.reserved_sms = v.extract()?,
            "save_head_bytes" => o.save_head_bytes = v.extract()?,
            "restore_head_bytes" => o.restore_head_bytes = v.extract()?,
            _ => {
                return Err(config_error(format!(
                    "unknown CUDA option `{k}` (mode, save_ctas, restore_ctas, staged_ctas, \
                     staged_piece_blocks, high_priority, reserved_sms, save_head_bytes, restore_head_bytes)"
                )))
            }
        }
    }
    Ok(o)
}

/// The `ssd_*` keyword arguments of `Tier(...)`; None: kvtier's default.
struct SsdOptions<'a> {
    admit_uses: Option<u32>,
    io: Option<&'a str>,
    read_depth: Option<usize>,
}

/// One `(path, bytes)` pair of `Tier(..., ssd=...)`.
fn ssd_file(item: &Bound<'_, PyAny>) -> PyResult<(std::path::PathBuf, u64)> {
    item.extract::<(std::path::PathBuf, u64)>().map_err(|_| {
        let shown = item.repr().map(|r| r.to_string()).unwrap_or_else(|_| "?".into());
        config_error(format!("ssd: each file is a (path, bytes) pair (bytes: a non-negative int), not {shown}"))
    })
}

/// The `SsdConfig` of `Tier(..., ssd=..., ssd_admit_uses=..., ssd_io=..., ssd_read_depth=...)`,
/// or None without `ssd`. `ssd`: one `(path, bytes)` pair or a sequence of them (one file per
/// drive). The options' ranges are checked by kvtier when the tier opens the files.
fn parse_ssd(ssd: Option<&Bound<'_, PyAny>>, o: SsdOptions<'_>) -> PyResult<Option<kvtier::SsdConfig>> {
    let Some(ssd) = ssd.filter(|s| !s.is_none()) else {
        if o.admit_uses.is_some() || o.io.is_some() || o.read_depth.is_some() {
            return Err(config_error(
                "ssd_admit_uses, ssd_io and ssd_read_depth need an SSD tier: pass ssd=[(path, bytes)]".into(),
            ));
        }
        return Ok(None);
    };
    // One pair (a tuple whose first item is not itself a pair), or a sequence of pairs; a str or
    // bytes is a path without its size.
    let one_pair = match ssd.cast::<PyTuple>() {
        Ok(t) => {
            t.len() == 2 && !(t.get_item(0)?.is_instance_of::<PyTuple>() || t.get_item(0)?.is_instance_of::<PyList>())
        }
        Err(_) => false,
    };
    let files = if one_pair {
        vec![ssd_file(ssd)?]
    } else if ssd.is_instance_of::<pyo3::types::PyString>() || ssd.is_instance_of::<PyBytes>() {
        return Err(config_error(format!(
            "ssd: a (path, bytes) pair or a list of them, not the path {} alone",
            ssd.repr()?
        )));
    } else {
        ssd.try_iter()?.map(|f| ssd_file(&f?)).collect::<PyResult<Vec<_>>>()?
    };
    let mut files = files.into_iter();
    let Some((path, bytes)) = files.next() else {
        return Err(config_error("ssd: an SSD tier needs at least one (path, bytes) file".into()));
    };
    let mut cfg = kvtier::SsdConfig::new(path, bytes);
    for (path, bytes) in files {
        cfg = cfg.with_file(path, bytes);
    }
    if let Some(uses) = o.admit_uses {
        cfg = cfg.with_admit_uses(uses);
    }
    if let Some(io) = o.io {
        cfg = cfg.with_io(match io {
            "direct" => kvtier::IoPreference::Direct,
            "buffered" => kvtier::IoPreference::Buffered,
            m => return Err(config_error(format!("unknown ssd_io `{m}` (direct, buffered)"))),
        });
    }
    if let Some(depth) = o.read_depth {
        cfg = cfg.with_read_depth(depth);
    }
    Ok(Some(cfg))
}

/// The SSD tier's counters (`Tier.ssd_stats`) as a dict of ints.
fn ssd_stats_dict<'py>(py: Python<'py>, s: &kvtier::SsdStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let fields: [(&str, u64); 17] = [
        ("capacity", s.capacity),
        ("blocks", s.blocks),
        ("recovered_blocks", s.recovered_blocks),
        ("recovered_torn", s.recovered_torn),
        ("recovered_foreign", s.recovered_foreign),
        ("demoted_blocks", s.demoted_blocks),
        ("bytes_demoted", s.bytes_demoted),
        ("demotions_skipped", s.demotions_skipped),
        ("demotions_dropped", s.demotions_dropped),
        ("demotion_failures", s.demotion_failures),
        ("demotions_pending", s.demotions_pending),
        ("promoted_blocks", s.promoted_blocks),
        ("bytes_promoted", s.bytes_promoted),
        ("promotion_failures", s.promotion_failures),
        ("disk_evictions", s.disk_evictions),
        ("io_direct", s.io_direct),
        ("io_buffered", s.io_buffered),
    ];
    for (name, v) in fields {
        d.set_item(name, v)?;
    }
    Ok(d)
}

/// Connects to the tier daemon (`kvtierd`) listening on the Unix socket `path` (default:
/// `default_socket_path()`, where `kvtierd` listens without `--socket`) and returns a
/// `Tier` with the same methods as an in-process one: the daemon owns the index, slots, leases and
/// eviction over a pool in shared memory that this process maps; ranks attached here copy between
/// this process's tensors and that pool. Every engine process connects on its own (after forking).
///
/// `geometry`: if given, the daemon must serve its namespace (model, page size, arenas, shard).
///
/// Raises: `DisconnectedError` (no daemon at `path`), `ProtocolMismatchError`,
/// `GeometryMismatchError`, `PoolMapError`, `UntrustedDaemonError` (the socket's daemon runs as
/// another uid than this process, and not as root).
#[pyfunction]
#[pyo3(signature = (path = None, geometry = None))]
pub fn connect(py: Python<'_>, path: Option<std::path::PathBuf>, geometry: Option<&PyGeometry>) -> PyResult<PyTier> {
    let path = path.unwrap_or_else(kvtier::default_socket_path);
    let expect = geometry.map(|g| g.inner.clone());
    let inner = py
        .detach(|| match &expect {
            Some(g) => HostTier::connect_as(&path, g),
            None => HostTier::connect(&path),
        })
        .py()?;
    Ok(PyTier { inner, peers: None, served: None })
}

/// The socket path `kvtierd` listens on when started without `--socket`, and `connect()`'s default:
/// `$XDG_RUNTIME_DIR/kvtierd.sock`, as root `/run/kvtierd/kvtierd.sock`, else
/// `/tmp/kvtierd-$UID/kvtierd.sock` (directories only this user can reach).
#[pyfunction]
pub fn default_socket_path() -> std::path::PathBuf {
    kvtier::default_socket_path()
}

/// Serves a new tier of `pool_bytes` (plain pages, in shared memory) on the Unix socket `path`
/// from a thread of this process, as `kvtierd` does (with no per-process slot bound: the caller is
/// its only client). For tests and examples; run `kvtierd` for
/// engines (a daemon outlives the processes it serves). Not a stable API.
#[pyfunction]
#[pyo3(signature = (path, geometry, pool_bytes, policy = None))]
pub fn _serve(
    py: Python<'_>,
    path: std::path::PathBuf,
    geometry: &PyGeometry,
    pool_bytes: u64,
    policy: Option<&str>,
) -> PyResult<()> {
    let mut cfg = TierConfig::new(geometry.inner.clone(), pool_bytes).with_backing(BackingChoice::Plain);
    if let Some(p) = policy {
        cfg = cfg.with_policy(parse_policy(p)?);
    }
    // One test process is the daemon's only client: it may have the whole pool in flight.
    let limits = kvtier::Limits { slots_per_process: usize::MAX, ..Default::default() };
    let config = kvtier::ServerConfig { limits, group: None };
    let server =
        py.detach(|| HostTier::new_shared(cfg).and_then(|t| kvtier::Server::bind_with(&path, t, config))).py()?;
    std::thread::Builder::new()
        .name("kvtier-serve".into())
        .spawn(move || server.run())
        .map_err(|e| config_error(format!("spawning the server thread: {e}")))?;
    Ok(())
}

/// A tier over `cfg` with its pool in shared memory, served on the Unix socket `path` from a
/// thread of this process (`Tier(serve=path)`), with the daemon's default limits. The server
/// thread lives as long as the process; the socket it leaves behind is replaced by the next bind.
fn serve_tier(path: &std::path::Path, cfg: TierConfig) -> PyResult<HostTier> {
    let tier = HostTier::new_shared(cfg).py()?;
    let server = kvtier::Server::bind(path, tier.clone()).py()?;
    std::thread::Builder::new()
        .name("kvtier-serve".into())
        .spawn(move || server.run())
        .map_err(|e| config_error(format!("spawning the server thread: {e}")))?;
    Ok(tier)
}

/// A `kvtier._tensors.ArenaWatch` over `tensors` (every tensor, not the caller's list, which it
/// may change), built before the rank so a tensor that cannot be watched attaches nothing.
fn arena_watch(py: Python<'_>, tensors: &Bound<'_, PyAny>, views: &[ArenaView]) -> PyResult<Py<PyAny>> {
    let held = PyTuple::new(py, tensors.try_iter()?.collect::<PyResult<Vec<_>>>()?)?;
    let views = PyList::new(py, views.iter().map(|v| (v.ptr, v.bytes_per_page, v.page_stride, v.pages)))?;
    Ok(py.import("kvtier._tensors")?.getattr("ArenaWatch")?.call1((held, views))?.unbind())
}

fn new_rank(rank: Rank, watch: Py<PyAny>, device: Option<u32>) -> PyRank {
    PyRank { cell: RankCell { state: Mutex::new(Some(Arc::new(rank))), released: Condvar::new() }, watch, device }
}

#[pymethods]
impl PyTier {
    #[new]
    #[allow(clippy::too_many_arguments)] // the Python signature's keyword arguments
    #[pyo3(signature = (geometry, pool_bytes, policy = None, *, backing = "auto", prefault = false, mlock = false, numa_node = None, lease_ttl_s = None, ssd = None, ssd_admit_uses = None, ssd_io = None, ssd_read_depth = None, peers = None, peer_listen = None, peer_timeout_s = 2.0, peer_pinned_blocks = None, peer_secret_file = None, serve = None))]
    fn new(
        py: Python<'_>,
        geometry: &PyGeometry,
        pool_bytes: u64,
        policy: Option<&str>,
        backing: &str,
        prefault: bool,
        mlock: bool,
        numa_node: Option<u32>,
        lease_ttl_s: Option<f64>,
        ssd: Option<&Bound<'_, PyAny>>,
        ssd_admit_uses: Option<u32>,
        ssd_io: Option<&str>,
        ssd_read_depth: Option<usize>,
        peers: Option<Vec<String>>,
        peer_listen: Option<&str>,
        peer_timeout_s: f64,
        peer_pinned_blocks: Option<usize>,
        peer_secret_file: Option<std::path::PathBuf>,
        serve: Option<std::path::PathBuf>,
    ) -> PyResult<Self> {
        let ssd = parse_ssd(ssd, SsdOptions { admit_uses: ssd_admit_uses, io: ssd_io, read_depth: ssd_read_depth })?;
        let mut cfg = TierConfig::new(geometry.inner.clone(), pool_bytes);
        if let Some(ssd) = ssd {
            cfg = cfg.with_ssd(ssd);
        }
        if let Some(p) = policy {
            cfg = cfg.with_policy(parse_policy(p)?);
        }
        if let Some(ttl) = lease_ttl_s {
            let ttl = std::time::Duration::try_from_secs_f64(ttl).map_err(|_| {
                config_error(format!("lease_ttl_s must be a non-negative number of seconds, not {ttl}"))
            })?;
            cfg = cfg.with_lease_ttl(ttl);
        }
        let mut pool = kvtier::PoolConfig::new(pool_bytes);
        pool.backing = parse_backing(backing)?;
        pool = pool.with_prefault(prefault).with_mlock(mlock);
        if let Some(node) = numa_node {
            pool = pool.with_numa_node(node);
        }
        let cfg = cfg.with_pool(pool);
        let inner = match &serve {
            // The pool in shared memory, so the processes that connect can map its slots.
            Some(path) => py.detach(|| serve_tier(path, cfg))?,
            None => py.detach(|| HostTier::new(cfg)).py()?,
        };
        let options = crate::peers::PeerOptions {
            peers,
            listen: peer_listen,
            timeout_s: peer_timeout_s,
            pinned_blocks: peer_pinned_blocks,
            secret_file: peer_secret_file,
        };
        let peers = py.detach(|| crate::peers::start(&inner, options))?;
        Ok(PyTier { inner, peers, served: serve })
    }

    /// The Unix socket this tier serves its pool on (`serve=`), or None.
    #[getter]
    fn served(&self) -> Option<std::path::PathBuf> {
        self.served.clone()
    }

    /// Attaches one GPU's paged KV tensors as a rank (a copy backend on CUDA device `device`).
    ///
    /// `tensors`: one per arena of the tier's geometry, in its order (for `llama3-8b`: K and V of
    /// layer 0, K and V of layer 1, ...), CUDA tensors on `device` (torch tensors or
    /// `__cuda_array_interface__` objects); `layout` as in `Geometry.from_tensors`. Each tensor must
    /// hold the geometry's bytes per page; page strides and page counts are the tensors' own.
    /// The rank holds references to the tensors and their storages until it is closed
    /// (`Rank.close`, or garbage collection), after draining its copies, so their memory outlives
    /// every copy; each save and restore first checks that no tensor was resized or given another
    /// storage since (`ArenaChangedError`).
    /// `cuda_options`: optional dict of copy tuning (`mode`: `auto` | `zero-copy` | `staged`,
    /// `save_ctas`, `restore_ctas`, `staged_ctas`, `staged_piece_blocks`, `high_priority`,
    /// `reserved_sms`: SMs reserved for the copy kernels in a green context, 0 = none;
    /// `save_head_bytes`, `restore_head_bytes`: bytes moved zero-copy ahead of a staged batch).
    ///
    /// The kernels are compiled for the device at first use (about 0.2 s) and the host pool is
    /// registered with the driver. The binding loads libcuda at run time and links no CUDA library.
    ///
    /// Raises: `BackendUnavailableError` (no CUDA driver, NVRTC or device), `DeviceMismatchError`,
    /// `NotContiguousError`, `TensorError`, `MisalignedError`, `OverlapError`,
    /// `BackendMismatchError` (tensors that do not match the geometry), `DeviceError`,
    /// `ShuttingDownError`.
    #[pyo3(signature = (device, tensors, *, layout = "tokens", cuda_options = None))]
    fn attach_cuda(
        &self,
        py: Python<'_>,
        device: u32,
        tensors: &Bound<'_, PyAny>,
        layout: &str,
        cuda_options: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PyRank> {
        let g = self.inner.geometry();
        let views = arena_views(py, tensors, g.page_tokens(), layout, Some(("cuda", Some(device))), true)?;
        let rg = rank_geometry(g, &views)?;
        let binding = ArenaBinding::new(&rg, views.iter().map(|v| v.ptr).collect()).py()?;
        let options = parse_cuda_options(cuda_options)?;
        let watch = arena_watch(py, tensors, &views)?;
        let tier = &self.inner;
        let rank = py
            .detach(|| -> Result<Rank, TierError> {
                let backend = CudaBackend::new(device, &rg, binding, options)?;
                tier.attach(Box::new(backend))
            })
            .py()?;
        Ok(new_rank(rank, watch, Some(device)))
    }

    /// Attaches paged KV arrays in host memory as a rank (the host backend: copies are `memcpy`
    /// on the rank's completion thread). For CPU inference and for testing without a GPU.
    ///
    /// `tensors`: one per arena, in the geometry's order: numpy arrays or CPU torch tensors,
    /// writable; `layout` as in `Geometry.from_tensors`. The rank holds references to them (and to
    /// a torch tensor's storage, a numpy view's owning array) until it is closed, after draining
    /// its copies; each save and restore first checks that none was resized or replaced since
    /// (`ArenaChangedError`).
    ///
    /// Raises: `DeviceMismatchError` (not CPU memory), `NotContiguousError`, `TensorError`
    /// (read-only array, shape), `MisalignedError`, `OverlapError`, `BackendMismatchError`,
    /// `ShuttingDownError`; `DisconnectedError` (a connected tier whose daemon is gone).
    #[pyo3(signature = (tensors, *, layout = "tokens"))]
    fn attach_host(&self, py: Python<'_>, tensors: &Bound<'_, PyAny>, layout: &str) -> PyResult<PyRank> {
        let g = self.inner.geometry();
        let views = arena_views(py, tensors, g.page_tokens(), layout, Some(("cpu", None)), true)?;
        let rg = rank_geometry(g, &views)?;
        let binding = ArenaBinding::new(&rg, views.iter().map(|v| v.ptr).collect()).py()?;
        // SAFETY: the arenas are the tensors' memory (checked writable, CPU, inside each tensor by
        // the view helper). The returned PyRank holds references to the tensors (and to what owns
        // their memory, in its ArenaWatch) and releases them only after the Rank (which owns the
        // backend and these arenas) has been dropped, which joins its completion threads, so every
        // copy has finished; a drain that times out leaks the references instead (PyRank::close).
        // A tensor resized or given another storage is caught by the watch before each copy is
        // submitted (the rank's documented contract: not while its copies are in flight).
        let arenas = unsafe { MemcpyArenas::from_binding(&rg, binding) }.py()?;
        let watch = arena_watch(py, tensors, &views)?;
        let backend = Box::new(MemcpyBackend::new(Arc::new(arenas)));
        // A connected tier's attach is a daemon round trip.
        let rank = py.detach(|| self.inner.attach(backend)).py()?;
        Ok(new_rank(rank, watch, None))
    }

    /// Pins the longest run of leading `keys` whose blocks are resident and returns a `Lease` on
    /// them (possibly empty: `len(lease) == 0`). Use it as a context manager so it is released on
    /// exit; an unreleased lease is released when garbage-collected. With an SSD tier, the run
    /// continues past the host's blocks with those the SSD tier holds: they are read into host
    /// slots and verified before this returns (GIL released), the last `lease.promoted` blocks.
    ///
    /// `keys`: a sequence of 16-byte content keys (`Namespace.key`). `uses`: restores allowed
    /// from this lease (one per rank that will restore the same blocks).
    ///
    /// Raises: `KeyLengthError`; `DisconnectedError` (a connected tier whose daemon is gone).
    #[pyo3(signature = (keys, uses = 1))]
    fn query(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, uses: u32) -> PyResult<PyLease> {
        let keys = keys_of(keys)?;
        // Seeded bug (tests only): `py-query-skips-peers` never asks the tier's peers.
        let peers = self.peers.as_ref().filter(|_| !crate::seeded::seeded("py-query-skips-peers"));
        if let Some((lease, errors)) = peers.and_then(|p| py.detach(|| p.query(&keys, uses))) {
            return Ok(PyLease::with_peer_errors(lease, errors));
        }
        let inner = py.detach(|| self.inner.try_query_shared(&keys, uses)).py()?;
        Ok(PyLease::new(inner))
    }

    /// `host:port` this tier serves its pool to peers at (`peer_listen=`; port 0 resolved), or
    /// None.
    #[getter]
    fn peer_address(&self) -> Option<String> {
        self.peers.as_ref().and_then(|p| p.address())
    }

    /// The peers this tier reads its misses from (`peers=`), in the order they are asked.
    #[getter]
    fn peers(&self) -> Vec<String> {
        self.peers.as_ref().map_or_else(Vec::new, |p| p.readers())
    }

    /// Prefill/decode handoff, on the prefill side: keeps the longest ready prefix of `keys`
    /// pinned for peers until a peer has fetched each block or `ttl_s` seconds passed (capped at
    /// the server's limit, 60 s by default), whichever comes first. Returns how many blocks are
    /// held (0 if the first key is not ready). GIL released.
    ///
    /// Raises: `ConfigError` (a tier without `peer_listen`, a `ttl_s` that is not a
    /// non-negative number of seconds); `KeyLengthError`.
    fn hold_for_peers(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, ttl_s: f64) -> PyResult<usize> {
        let keys = keys_of(keys)?;
        let ttl = std::time::Duration::try_from_secs_f64(ttl_s)
            .map_err(|_| config_error(format!("ttl_s must be a non-negative number of seconds, not {ttl_s}")))?;
        let peers = self.peers.as_ref().filter(|p| p.address().is_some());
        let peers = peers.ok_or_else(|| config_error("hold_for_peers needs a tier made with peer_listen=".into()))?;
        Ok(py.detach(|| peers.hold(&keys, ttl)).unwrap_or(0))
    }

    /// The peer server's figures (`peer_listen=`): `connections`, `connections_accepted`,
    /// `live_leases`, `leases_granted`, `blocks_leased`, `blocks_validated`, `blocks_invalid`
    /// (blocks), `pinned_blocks`, `pin_budget`, `held_blocks`; None without a server.
    fn peer_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let Some(figures) = self.peers.as_ref().and_then(|p| p.server_stats()) else { return Ok(None) };
        let d = PyDict::new(py);
        for (k, v) in figures {
            d.set_item(k, v)?;
        }
        Ok(Some(d))
    }

    /// Opens a lease another process shared (`Lease.token`), for a tier from `kvtier.connect`:
    /// each data-parallel process restores from the one lease with one of its uses. The lease
    /// lives while any process holds it.
    ///
    /// Raises: `ForeignLeaseError` (an in-process tier, or a token of an earlier daemon run),
    /// `LeaseSettledError`, `DisconnectedError`.
    fn open_lease(&self, py: Python<'_>, token: &[u8]) -> PyResult<PyLease> {
        let token = LeaseToken::from_bytes(token).py()?;
        let inner = py.detach(|| self.inner.open_lease(&token)).py()?;
        Ok(PyLease::new(inner))
    }

    /// True for a tier from `kvtier.connect` (its state lives in the tier daemon).
    #[getter]
    fn connected(&self) -> bool {
        self.inner.is_connected_tier()
    }

    /// True if the block of `key` is resident (does not pin or refresh it). On a connected tier
    /// a daemon round trip (GIL released); False if the daemon is gone.
    ///
    /// Raises: `KeyLengthError`.
    fn contains(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let key = key_of(key)?;
        // Seeded bug (tests only): the round trip with the GIL held.
        if crate::seeded::seeded("round-trip-holds-gil") {
            return Ok(self.inner.contains(&key));
        }
        Ok(py.detach(|| self.inner.contains(&key)))
    }

    /// Evicts up to `n` unpinned blocks by the policy; returns how many were evicted (at most
    /// `capacity`). `n`: any non-negative int (larger than the pool: every evictable block).
    ///
    /// Raises: `ValueError` (negative `n`), `TypeError` (not an int).
    fn evict(&self, py: Python<'_>, n: &Bound<'_, PyAny>) -> PyResult<usize> {
        // Seeded bug (tests only): a count that must fit usize (2**64 raises OverflowError).
        let n = if crate::seeded::seeded("evict-count-usize") {
            n.extract::<usize>()?
        } else {
            count_of(n)?.min(self.inner.capacity() as usize)
        };
        Ok(py.detach(|| self.inner.evict(n)))
    }

    /// Scheduler hint: `keys` (16-byte keys, a list) will be looked up by requests waiting in the
    /// engine's queue, for at most `ttl_s` seconds (capped by kvtier). Eviction takes none of their
    /// blocks while an unhinted block is evictable (a hint never makes a save fail). Returns the
    /// hint's id (an int) for `withdraw_hint`.
    ///
    /// Raises: `KeyLengthError`, `ConfigError` (a negative or non-finite `ttl_s`),
    /// `LimitExceededError` (a tier daemon's bound: `hint_bytes` over all its connections,
    /// `hints_per_connection`, `hint_keys_per_connection`, `keys_per_request`; nothing is hinted),
    /// `DisconnectedError` (a connected tier whose daemon is gone).
    #[pyo3(signature = (keys, ttl_s = 60.0))]
    fn hint(&self, py: Python<'_>, keys: &Bound<'_, PyAny>, ttl_s: f64) -> PyResult<u64> {
        let keys = keys_of(keys)?;
        let ttl = std::time::Duration::try_from_secs_f64(ttl_s)
            .map_err(|_| config_error(format!("ttl_s must be a non-negative number of seconds, not {ttl_s}")))?;
        Ok(py.detach(|| self.inner.try_hint(&keys, ttl)).py()?.get())
    }

    /// Withdraws hint `id` (its request was admitted or dropped). Returns False if it had already
    /// been withdrawn or had expired.
    fn withdraw_hint(&self, py: Python<'_>, id: u64) -> bool {
        py.detach(|| self.inner.withdraw_hint(kvtier::HintId::from_number(id)))
    }

    /// The tier's counters as a dict of ints: `queries`, `hit_blocks`, `miss_blocks`,
    /// `saved_blocks`, `restored_blocks`, `evictions`, `bytes_saved`, `bytes_restored`,
    /// `pinned_slots`, `ready_slots`, `free_slots`, `capacity`, ... (blocks, slots and bytes).
    ///
    /// Raises: `DisconnectedError` (a connected tier whose daemon is gone).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let s = py.detach(|| self.inner.try_stats()).py()?;
        to_py(py, &s)
    }

    /// How the tier's eviction lock was used, as a dict of ints, or None for a tier from
    /// `kvtier.connect` (the lock is the daemon's; its metrics report it): `holds` (times a save
    /// or an SSD promotion that needed more slots than were free, or `evict`, took the lock),
    /// `wait_ns` and `held_ns` (nanoseconds spent waiting for it and holding it, summed over the
    /// holds). `held_ns / holds` is the serial cost of a save that evicts: saves on several threads
    /// cannot evict faster than one hold after another.
    fn eviction_lock_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        self.inner.eviction_lock_stats().map(|s| to_py(py, &s)).transpose()
    }

    /// The SSD tier's counters as a dict of ints, or None without an SSD tier (for a tier from
    /// `kvtier.connect`, the daemon's SSD tier's; None also when the daemon is gone). Blocks
    /// unless named bytes:
    /// `capacity` (disk slots over every file), `blocks` (on disk now), `recovered_blocks` (found
    /// again in the files when the tier opened them), `recovered_torn`, `recovered_foreign`
    /// (slots found torn, or holding another namespace's block: now free), `demoted_blocks`,
    /// `bytes_demoted`, `demotions_skipped` (evicted or already on disk), `demotions_dropped`
    /// (the demotion queue was full), `demotion_failures` (write errors), `demotions_pending`,
    /// `promoted_blocks`, `bytes_promoted` (read back by queries), `promotion_failures` (blocks
    /// that failed verification: never served, dropped from disk), `disk_evictions`, `io_direct`,
    /// `io_buffered` (transfers with and without `O_DIRECT`).
    fn ssd_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let tier = &self.inner;
        // Seeded bug (tests only): the counters dropped on the way to Python.
        let stats = if crate::seeded::seeded("ssd-stats-unmapped") { None } else { py.detach(|| tier.ssd_stats()) };
        stats.map(|s| ssd_stats_dict(py, &s)).transpose()
    }

    /// Blocks, with the GIL released, until every demotion queued so far is written to the SSD
    /// tier (or skipped, or failed); returns at once without an SSD tier or on a tier from
    /// `kvtier.connect`. Demotions are written in the background (a save never waits for the
    /// drive): call this before a clean shutdown to keep the most on disk, and in tests.
    fn flush_demotions(&self, py: Python<'_>) {
        let tier = &self.inner;
        py.detach(|| tier.flush_demotions())
    }

    /// The block layout.
    #[getter]
    fn geometry(&self) -> PyGeometry {
        PyGeometry { inner: self.inner.geometry().clone() }
    }
    /// The namespace of this tier's keys (the geometry's).
    #[getter]
    fn namespace(&self) -> PyNamespace {
        PyNamespace { inner: self.inner.namespace() }
    }
    /// Slots (blocks) the pool holds.
    #[getter]
    fn capacity(&self) -> u32 {
        self.inner.capacity()
    }
    /// The eviction policy's name.
    #[getter]
    fn policy(&self) -> &'static str {
        self.inner.policy_name()
    }
    /// The pool's backing: `hugetlb`, `thp` or `plain`.
    #[getter]
    fn backing(&self) -> &'static str {
        self.inner.pool().backing().name()
    }
    /// Stops accepting saves, restores and attaches (queries still answer; in-flight copies
    /// complete). Close the ranks afterwards.
    fn shutdown(&self) {
        self.inner.shutdown()
    }
    fn __repr__(&self) -> String {
        format!(
            "Tier(model={:?}, capacity={} blocks, policy={}, backing={})",
            self.inner.geometry().model(),
            self.inner.capacity(),
            self.inner.policy_name(),
            self.inner.pool().backing().name()
        )
    }
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

fn seconds(timeout: Option<f64>) -> PyResult<Option<Duration>> {
    timeout
        .map(|t| {
            Duration::try_from_secs_f64(t).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err("timeout must be a non-negative number of seconds")
            })
        })
        .transpose()
}

/// The instant `timeout` from now (None: no deadline, also for a timeout too large to represent).
fn deadline_after(timeout: Option<Duration>) -> Option<Instant> {
    timeout.and_then(|t| Instant::now().checked_add(t))
}

/// How long the next GIL-released wait may block.
fn slice_until(deadline: Option<Instant>) -> Duration {
    deadline.map_or(WAIT_SLICE, |d| d.saturating_duration_since(Instant::now()).min(WAIT_SLICE))
}

fn passed(deadline: Option<Instant>) -> bool {
    deadline.is_some_and(|d| Instant::now() >= d)
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
    inner: ManuallyDrop<Lease>,
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
    inner: CopyHandle,
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
    fn new(py: Python<'_>, t: SaveTicket) -> PyResult<Self> {
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
