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

use crate::convert::{count_of, key_of, keys_of, to_py};
use crate::errors::IntoPyResult;
use crate::geometry::{arena_views, ArenaView, PyGeometry, PyNamespace};
use kvtier::BackingChoice;
use kvtier::CudaBackend;
use kvtier::{ArenaBinding, HostTier, LeaseToken, Rank, TierConfig, TierError};
use kvtier::{MemcpyArenas, MemcpyBackend};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod handles;
mod options;
mod rank;

pub use handles::{PyCopyHandle, PyLease, PySaveTicket};
pub(crate) use options::{config_error, parse_backing, parse_policy};
use options::{parse_cuda_options, parse_ssd, rank_geometry, ssd_stats_dict, SsdOptions};
use rank::new_rank;
pub use rank::PyRank;

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
    /// `batched_copies`: one driver call for a staged piece's copies where the driver has it;
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
