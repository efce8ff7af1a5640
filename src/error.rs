//! Typed errors. Every fallible public function returns one of these; none of them loses a ready block.
//!
//! One enum per kind of failure, all here in one module ([`GeometryError`], [`PoolError`],
//! [`CopyError`], [`IndexError`], [`TierError`]); [`Error`](enum@Error) wraps them all for callers
//! that do not care which layer failed.

use thiserror::Error;

use crate::key::ContentKey;

/// A byte size that [`crate::parse_bytes`] cannot read, or an SSD tier file that
/// [`crate::parse_ssd_file`] cannot.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SizeError {
    /// No number where the size begins.
    #[error("`{input}` is not a byte size: expected a number with an optional unit (e.g. 4096, 32GB, 4GiB)")]
    Number {
        /// The text given.
        input: String,
    },
    /// A unit that is unknown, or that could mean a decimal or a binary unit (`gb`, `G`).
    #[error(
        "`{input}`: unknown or ambiguous unit `{unit}` (accepted: bytes, B, kB, MB, GB, TB = 10^3..10^12 B, \
         KiB, MiB, GiB, TiB = 2^10..2^40 B; units are case-sensitive){readings}"
    )]
    Unit {
        /// The text given.
        input: String,
        /// The unit as written.
        unit: String,
        /// Both readings of the size, when the unit is a known one miswritten (else empty).
        readings: String,
    },
    /// A fraction that does not come to whole bytes (`1.5B`).
    #[error("`{input}` is not a whole number of bytes")]
    Fraction {
        /// The text given.
        input: String,
    },
    /// More than `u64::MAX` bytes.
    #[error("`{input}` is more than 2^64 - 1 bytes")]
    Overflow {
        /// The text given.
        input: String,
    },
    /// An SSD tier file that is not `PATH:SIZE` ([`crate::parse_ssd_file`]): no colon, or no path
    /// before it.
    #[error("`{input}` is not PATH:SIZE (a file's path, a colon, and a byte size, e.g. /mnt/nvme0/kvtier.ssd:2TiB)")]
    PathAndSize {
        /// The text given.
        input: String,
    },
}

/// A geometry (arena layout) or an arena binding (device base addresses) that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum GeometryError {
    /// The geometry lists no arenas.
    #[error("geometry has no arenas: a block needs at least one")]
    NoArenas,
    /// More arenas than the copy kernels' arena table holds.
    #[error("geometry has {count} arenas; at most {max} are supported")]
    TooManyArenas {
        /// Arenas given.
        count: usize,
        /// Largest supported count.
        max: usize,
    },
    /// An arena name is empty or repeated.
    #[error("arena #{index}: name `{name}` is empty or used twice")]
    BadName {
        /// Position of the arena in the geometry.
        index: usize,
        /// The offending name.
        name: String,
    },
    /// The model name or the tokens per page is missing.
    #[error("geometry field `{field}` must not be empty or zero")]
    MissingField {
        /// Which field.
        field: &'static str,
    },
    /// A size that must be positive is zero.
    #[error("arena `{arena}`: {field} is zero")]
    Zero {
        /// Arena name.
        arena: String,
        /// `bytes_per_page`, `page_stride` or `pages`.
        field: &'static str,
    },
    /// A size or address is not a multiple of 16 bytes (the copy kernels move 16 B per access).
    #[error("arena `{arena}`: {field} = {value} is not a multiple of 16 B")]
    Misaligned {
        /// Arena name.
        arena: String,
        /// `bytes_per_page`, `page_stride` or `base`.
        field: &'static str,
        /// The value in bytes (or the address).
        value: u64,
    },
    /// The page stride is smaller than the copy unit, so consecutive pages would overlap.
    #[error("arena `{arena}`: page stride {stride} B is smaller than the copy unit {unit} B")]
    StrideBelowUnit {
        /// Arena name.
        arena: String,
        /// Page stride in bytes.
        stride: u64,
        /// Bytes per page (copy unit).
        unit: u64,
    },
    /// The arena's extent does not fit in a 64-bit byte offset (or address space).
    #[error("arena `{arena}`: {pages} pages x {stride} B overflows 64-bit byte offsets")]
    Overflow {
        /// Arena name.
        arena: String,
        /// Page count.
        pages: u64,
        /// Page stride in bytes.
        stride: u64,
    },
    /// Two arenas' bytes overlap, so saving one page would read another arena's data.
    #[error("arenas `{a}` and `{b}` overlap in device memory")]
    Overlap {
        /// First arena.
        a: String,
        /// Second arena.
        b: String,
    },
    /// An arena binding gives the wrong number of base addresses.
    #[error("arena binding has {got} base addresses but the geometry has {want} arenas")]
    BaseCount {
        /// Bases given.
        got: usize,
        /// Arenas in the geometry.
        want: usize,
    },
    /// A null base address.
    #[error("arena `{arena}`: base address is null")]
    NullBase {
        /// Arena name.
        arena: String,
    },
    /// A preset name that does not exist.
    #[error("unknown geometry preset `{name}` (known: {known})")]
    UnknownPreset {
        /// Requested name.
        name: String,
        /// Comma-separated list of known presets.
        known: String,
    },
    /// Per-arena layer ids ([`crate::Geometry::with_layers`]) that cannot be used: a count other
    /// than the arenas', or ids that decrease in arena order (a layer's arenas must be neighbours,
    /// so each layer group is one contiguous range of a host slot).
    #[error("arena layers: {reason}")]
    Layers {
        /// What is wrong, naming the arena.
        reason: String,
    },
    /// Cache groups of a hybrid layout ([`crate::HybridLayout::new`]) that cannot be used
    /// together: none, too many, a repeated or empty name, groups of different page sizes, a
    /// sliding window of 0 tokens, or no attention group.
    #[error("cache groups: {reason}")]
    Groups {
        /// What is wrong, naming the group.
        reason: String,
    },
}

/// `b` bytes in GiB, for messages.
fn gib(b: u64) -> f64 {
    b as f64 / (1u64 << 30) as f64
}

/// The host pool could not be created or configured.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum PoolError {
    /// The requested pool is smaller than one slot.
    #[error("pool of {bytes} B holds no slot of {slot_bytes} B")]
    TooSmall {
        /// Requested pool size in bytes.
        bytes: u64,
        /// One slot in bytes.
        slot_bytes: u64,
    },
    /// The slot size is zero or not a multiple of 16 B (the copy kernels move 16 B per access;
    /// [`crate::Geometry::slot_bytes`] is always a multiple of 256 B).
    #[error("slot size {slot_bytes} B is zero or not a multiple of 16 B")]
    BadSlotSize {
        /// The slot size given, in bytes.
        slot_bytes: u64,
    },
    /// The NUMA node asked for does not exist (or has no memory) on this machine.
    #[error("NUMA node {node} does not exist or has no memory (see /sys/devices/system/node/)")]
    NoSuchNumaNode {
        /// Node number given.
        node: u32,
    },
    /// More slots than a slot id can name.
    #[error("pool would hold {slots} slots; at most {max} are supported")]
    TooManySlots {
        /// Slots requested.
        slots: u64,
        /// Largest supported count.
        max: u64,
    },
    /// Explicit hugetlb pages were required but not enough are reserved.
    #[error(
        "hugetlb backing needs {needed} free 2 MiB pages but {free} are free; reserve them first \
         (as root: echo {needed} > /proc/sys/vm/nr_hugepages) or use another backing"
    )]
    HugePagesUnavailable {
        /// 2 MiB pages the pool needs.
        needed: u64,
        /// 2 MiB pages free now (free - reserved).
        free: u64,
    },
    /// `mmap` failed.
    #[error("mapping {bytes} B ({backing}) failed: {source}")]
    Map {
        /// Bytes asked for.
        bytes: u64,
        /// Which backing was tried.
        backing: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// `mlock`, `madvise` or `mbind` failed.
    #[error("{call} on the pool failed: {source}")]
    Syscall {
        /// Which call.
        call: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The pool was asked for a slot id it does not have.
    #[error("slot {slot} is out of range (pool has {capacity} slots)")]
    SlotOutOfRange {
        /// Slot id.
        slot: u32,
        /// Slots in the pool.
        capacity: u32,
    },
    /// The memfd of a shared pool is not sealed against resizing
    /// (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`): any process holding it could truncate it and
    /// kill every process that maps it with `SIGBUS`. Nothing was mapped.
    #[error(
        "the shared pool's memfd has seals {seals:#x}, without all of {required:#x} \
         (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL); refusing to map a file another process can resize"
    )]
    UnsealedSharedPool {
        /// The file's seals (`fcntl(F_GET_SEALS)`; 0 for a file that cannot be sealed).
        seals: u32,
        /// The seals required.
        required: u32,
    },
    /// The memfd of a shared pool is shorter than the layout says it maps. Nothing was mapped.
    #[error("the shared pool's memfd holds {size} B, less than the {needed} B to map")]
    SharedPoolTooShort {
        /// The file's size (`fstat`), bytes.
        size: u64,
        /// Bytes the layout maps, bytes.
        needed: u64,
    },
    /// The pool is larger than the memory that can back it ([`crate::PoolConfig::overcommit`]
    /// skips the checks on physical and available memory, never the one on `RLIMIT_MEMLOCK`).
    /// Checked before anything is mapped: nothing was mapped.
    #[error(
        "a pool of {bytes} B exceeds {what}: {available} B; ask for a smaller pool, or overcommit on \
         purpose (PoolConfig::with_overcommit, kvtierd --overcommit; not for a locked pool)"
    )]
    ExceedsMemory {
        /// Bytes the pool would map.
        bytes: u64,
        /// Bytes of `what` (for `RLIMIT_MEMLOCK`, the soft limit).
        available: u64,
        /// What the pool was checked against: `physical memory (MemTotal less the hugetlb pool)`,
        /// `available memory (MemAvailable), which a prefaulted or locked pool takes at start`, or
        /// `RLIMIT_MEMLOCK (the pool is locked)`.
        what: &'static str,
    },
    /// A prefaulted or locked pool would leave less than the headroom in available memory:
    /// `MemAvailable` less the pool must stay at least max(1 GiB, 5% of `MemTotal`), so that the
    /// engines, the kernel and the daemon itself still have room once the pool took its memory
    /// at start. [`crate::PoolConfig::overcommit`] skips it. Nothing was mapped.
    #[error(
        "a prefaulted or locked pool of {bytes} B ({:.2} GiB) would leave {:.2} GiB of the {:.2} GiB \
         available (MemAvailable), less than the {:.2} GiB headroom kept free (max(1 GiB, 5% of \
         MemTotal)); ask for a pool of at most {:.2} GiB, or overcommit on purpose (kvtierd \
         --overcommit)",
        gib(*bytes), gib(available.saturating_sub(*bytes)), gib(*available), gib(*headroom),
        gib(available.saturating_sub(*headroom))
    )]
    NoHeadroom {
        /// Bytes the pool would map.
        bytes: u64,
        /// `MemAvailable`, bytes.
        available: u64,
        /// Bytes that must stay available: max(1 GiB, 5% of `MemTotal`).
        headroom: u64,
    },
}

/// A copy backend refused or failed a batch.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum CopyError {
    /// A GPU page id is not below the arenas' page count; nothing was written.
    #[error("GPU page {page} is out of range (arenas hold {pages} pages); nothing was copied")]
    PageOutOfRange {
        /// Page id given.
        page: u64,
        /// Page count of the arenas.
        pages: u64,
    },
    /// A host slot id is not below the pool's capacity; nothing was written.
    #[error("host slot {slot} is out of range (pool has {capacity} slots); nothing was copied")]
    SlotOutOfRange {
        /// Slot id given.
        slot: u32,
        /// Pool capacity.
        capacity: u32,
    },
    /// One batch names the same destination twice (two copies would race on it).
    #[error("batch writes {what} {id} twice")]
    DuplicateDestination {
        /// `GPU page` or `host slot`.
        what: &'static str,
        /// The repeated id.
        id: u64,
    },
    /// The backend was asked to copy before a pool was bound to it ([`crate::CopyBackend::bind_pool`];
    /// attaching a backend to a tier binds the tier's pool).
    #[error("backend mismatch: no pool is bound to the backend (bind_pool was not called)")]
    PoolNotBound,
    /// The pool's slot size differs from the backend geometry's slot size.
    #[error("backend mismatch: pool slots are {pool} B, geometry slots {geometry} B")]
    SlotSizeMismatch {
        /// The pool's slot size in bytes.
        pool: u64,
        /// The geometry's slot size ([`crate::Geometry::slot_bytes`]) in bytes.
        geometry: u64,
    },
    /// A pool region whose base is not 16-byte aligned or that is shorter than its slots.
    #[error("backend mismatch: pool region at {base:#x} ({bytes} B) is misaligned or shorter than {capacity} slots")]
    BadPoolRegion {
        /// Host address of the region.
        base: u64,
        /// Length of the region in bytes.
        bytes: u64,
        /// Slots the region claims to hold.
        capacity: u32,
    },
    /// A binding (or a list of tensors) gives another number of arenas than the geometry has.
    #[error("backend mismatch: {given} arena bases (tensors) for a geometry of {arenas} arenas")]
    ArenaCount {
        /// Arena bases (tensors) given.
        given: usize,
        /// Arenas in the geometry.
        arenas: usize,
    },
    /// An arena's memory (a tensor) holds another number of bytes per page than the geometry says.
    #[error("backend mismatch: arena `{arena}`: the tensor holds {given} B per page, the geometry {geometry} B")]
    PageBytesMismatch {
        /// Arena name.
        arena: String,
        /// Bytes per page of the given memory.
        given: u64,
        /// Bytes per page of the geometry's arena.
        geometry: u64,
    },
    /// An arena's copy unit (bytes per page) is too large for the copy kernels.
    #[error(
        "backend mismatch: arena `{arena}`: a {bytes} B copy unit is too large for the CUDA kernels (below {max} B)"
    )]
    ChunkTooLarge {
        /// Arena name.
        arena: String,
        /// Bytes per page of the arena.
        bytes: u64,
        /// The bound in bytes (exclusive): 4 GiB, as segment offsets are 32-bit.
        max: u64,
    },
    /// A backend option or call argument out of its allowed range (an unroll factor, a CTA count,
    /// a layer-group count, the pairs of one staged batch). Nothing was done.
    #[error("backend mismatch: {name} = {value} is not allowed: it must be {allowed}")]
    BadArgument {
        /// The option or argument.
        name: &'static str,
        /// The value given.
        value: u64,
        /// What is allowed, e.g. `4 or 8`, `at least 1`.
        allowed: &'static str,
    },
    /// A layer position the geometry does not have (see [`crate::copy::layers::LayerGroups`]).
    #[error("backend mismatch: layer {layer} does not exist: the geometry has {layers} layers")]
    NoSuchLayer {
        /// The 0-based layer position asked for.
        layer: u32,
        /// Distinct layers of the geometry.
        layers: u32,
    },
    /// Layer groups that do not tile the backend's arenas (groups made for another geometry).
    #[error("backend mismatch: layer groups {groups:?} (arena ranges) do not tile {arenas} arenas")]
    LayerGroupsMismatch {
        /// Each group's range of arena indices.
        groups: Vec<std::ops::Range<usize>>,
        /// Arenas of the backend's geometry.
        arenas: usize,
    },
    /// A layer-wise copy was given a number of waits other than one or one per layer group.
    #[error("backend mismatch: {waits} waits for {groups} layer groups: give one, or one per group")]
    WaitCount {
        /// Waits given.
        waits: usize,
        /// Layer groups of the copy.
        groups: usize,
    },
    /// A fault injected by [`crate::copy::fault::FaultyBackend`] or by a test's backend: the call
    /// failed as a device fault would (nothing copied at submission; at completion, a restore's
    /// pages hold garbage). The CUDA backend (feature `cuda`) reports its real faults as
    /// `CopyError::Cuda` and `CopyError::Nvrtc`.
    #[error("device error in {call}: injected fault")]
    Injected {
        /// Call or stage that failed: `save`, `restore`, `completion`, or the test's name.
        call: &'static str,
    },
    /// A CUDA driver call failed (feature `cuda`); `source` keeps the driver's `CUresult`
    /// (`source.0`), e.g. `CUDA_ERROR_ILLEGAL_ADDRESS` (700) from a failed copy kernel.
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    #[error("CUDA driver call {call} failed: {detail}")]
    Cuda {
        /// The driver function that returned the error, e.g. `cuLaunchKernel`.
        call: &'static str,
        /// `CUDA_ERROR_NAME (code): description`, as `cuda::describe_driver_error` wrote it when
        /// the error was made (`cuda::driver_error`).
        detail: String,
        /// The driver's result.
        #[source]
        source: cudarc::driver::DriverError,
    },
    /// NVRTC could not compile the copy kernels for this device (feature `cuda`); `source` keeps
    /// the `nvrtcResult`, `log` the compiler's log (empty if it wrote none).
    #[cfg(feature = "cuda")]
    #[cfg_attr(docsrs, doc(cfg(feature = "cuda")))]
    #[error("NVRTC call {call} failed: {source:?}{}{log}", if log.is_empty() { "" } else { ":\n" })]
    Nvrtc {
        /// The NVRTC function that failed, e.g. `nvrtcCompileProgram`.
        call: &'static str,
        /// NVRTC's result.
        #[source]
        source: cudarc::nvrtc::result::NvrtcError,
        /// The compile log.
        log: String,
    },
    /// The backend is not available on this machine or build.
    #[error("copy backend `{backend}` is unavailable: {reason}")]
    Unavailable {
        /// Backend name.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// The backend is shutting down and accepts no new copies.
    #[error("copy backend is shut down")]
    ShutDown,
    /// The backend panicked while the tier waited for a copy, so the copy's outcome is unknown:
    /// its host slots are quarantined (never reused), and the engine must treat the copy's GPU
    /// pages as possibly still being read or written.
    #[error("copy backend panicked while waiting for a copy; its host slots are quarantined")]
    BackendPanicked,
}

/// A [`crate::BlockIndex`] that cannot be built as asked.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum IndexError {
    /// The requested capacity needs a bucket array larger than one allocation may be.
    #[error(
        "index capacity of {requested} entries is too large: at most {max} entries \
         (4 buckets of 8 B per entry, in one allocation of at most isize::MAX bytes)"
    )]
    CapacityTooLarge {
        /// Entries asked for.
        requested: usize,
        /// Largest capacity in entries (2^57 on a 64-bit target).
        max: usize,
    },
    /// The bucket array could not be allocated.
    #[error("index capacity of {requested} entries needs {bytes} B of buckets, which could not be allocated")]
    OutOfMemory {
        /// Entries asked for.
        requested: usize,
        /// Bytes of the bucket array.
        bytes: u64,
    },
}

/// An operation of [`crate::HostTier`] that cannot be carried out. Nothing ready is lost.
#[derive(Debug, Clone, Error)]
#[non_exhaustive]
pub enum TierError {
    /// Keys and GPU pages differ in number.
    #[error("{keys} keys but {pages} GPU pages: each key needs exactly one page")]
    LengthMismatch {
        /// Keys given.
        keys: usize,
        /// Pages given.
        pages: usize,
    },
    /// The request needs more slots than the pool could ever free right now; nothing was evicted.
    #[error(
        "save needs {needed} slots but only {available} can be made free ({capacity} in the pool, \
         the rest pinned or in flight); nothing was evicted"
    )]
    CannotFit {
        /// Slots needed.
        needed: usize,
        /// Free plus evictable slots.
        available: usize,
        /// Pool capacity in slots.
        capacity: usize,
    },
    /// Eviction could not free enough slots because they were pinned meanwhile.
    #[error("pool exhausted: needed {needed} slots, got {got}; every other slot is pinned or in flight")]
    PoolExhausted {
        /// Slots needed.
        needed: usize,
        /// Slots obtained before giving up (returned to the pool).
        got: usize,
    },
    /// The lease was already settled (released, dropped, or all its restores consumed).
    #[error("lease is already settled")]
    LeaseSettled,
    /// The lease outlived the tier's lease time-to-live and was settled by the tier.
    #[error("lease expired (it outlived the tier's lease time-to-live) and was settled")]
    LeaseExpired,
    /// The lease has fewer pages than the restore asks for.
    #[error("restore asks for {asked} pages but the lease holds {held}")]
    LeaseTooShort {
        /// Pages asked.
        asked: usize,
        /// Pages held by the lease.
        held: usize,
    },
    /// The lease belongs to another tier.
    #[error("lease belongs to another tier")]
    ForeignLease,
    /// The tier is shutting down.
    #[error("tier is shutting down and accepts no new work")]
    ShuttingDown,
    /// Copies were still in flight when a drain's deadline passed (nothing was freed under them).
    #[error("{in_flight} copy batches still in flight at the drain deadline")]
    DrainTimeout {
        /// Batches in flight.
        in_flight: u64,
    },
    /// A pin count would overflow its field in the slot word.
    #[error("slot {slot} has too many pins")]
    TooManyPins {
        /// Slot id.
        slot: u32,
    },
    /// The copy backend failed.
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// A backend attached to the tier follows another block layout than the tier's.
    #[error(
        "backend geometry `{backend}` does not match the tier's `{tier}` (model, page size, slot size or chunk layout)"
    )]
    GeometryMismatch {
        /// The backend's model name.
        backend: String,
        /// The tier's model name.
        tier: String,
    },
    /// The index could not be built.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// A tier reached through the tier daemon (`HostTier::connect`, feature `remote`) lost its
    /// connection: the daemon is not running, stopped or restarted, or the connection broke.
    /// Nothing was saved or restored by the call; a copy already submitted keeps its own bytes (a
    /// restore's pages hold the right bytes once its handle completes, a save's blocks may not be
    /// visible). The handle stays failed: fall back to prefill and connect again.
    #[error("no connection to the tier daemon: {reason}")]
    Disconnected {
        /// What happened (the I/O error, or the daemon's restart).
        reason: String,
    },
    /// The tier daemon speaks another protocol version than this client.
    #[error("the tier daemon speaks protocol version {daemon}, this client {client}; use matching kvtier builds")]
    ProtocolMismatch {
        /// The daemon's protocol version.
        daemon: u32,
        /// This client's protocol version.
        client: u32,
    },
    /// A request asked for more than a documented bound allows (keys in one request, a frame's
    /// bytes, hints or leases held by one connection, connections to the daemon). Nothing was
    /// done; the connection stays usable.
    #[error("{limit} exceeded: asked for {asked}, the bound is {max}")]
    LimitExceeded {
        /// Which bound.
        limit: Limit,
        /// What the request asked for, in the bound's unit.
        asked: u64,
        /// The bound, in the same unit.
        max: u64,
    },
    /// A request that the protocol does not allow at this point (a second hello, finishing a save
    /// twice, an id this connection was never given). The connection stays usable.
    #[error("protocol misuse: {reason}")]
    Protocol {
        /// What was wrong.
        reason: String,
    },
    /// The code serving a request panicked. The request failed and did nothing visible; every
    /// slot and pin it may have touched was kept (quarantined where a copy may still use it), and
    /// the tier stays usable for every caller.
    #[error("internal fault while serving {request}: {message}; the request failed, the tier stays usable")]
    Panicked {
        /// The request (or call) that was being served.
        request: String,
        /// The panic's message.
        message: String,
    },
    /// A connected tier (`HostTier::connect`) was used from a process other than the one that
    /// connected (a child forked after the connection was made). Connect again in the child.
    #[error("this daemon connection belongs to process {owner}, not to process {current} (a forked child must connect again)")]
    ForkedChild {
        /// The process that connected.
        owner: u32,
        /// The process that made the call.
        current: u32,
    },
    /// The process listening on the daemon's socket is not the expected user: it may be another
    /// user's impostor. Nothing was sent to it beyond the hello's magic and version.
    #[error("the daemon at this socket runs as uid {found}, expected uid {expected}")]
    UntrustedDaemon {
        /// The uid the client expects (its own, or the one configured).
        expected: u32,
        /// The uid the socket's peer runs as (`SO_PEERCRED`).
        found: u32,
    },
}

/// A bound on what one request or one connection may make the tier (or the tier daemon) hold.
/// Each is documented with its default and flag in `docs/design.md` (trust model).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub enum Limit {
    /// Bytes of one protocol frame.
    FrameBytes,
    /// Keys named by one request (a query, save, hint or audit).
    KeysPerRequest,
    /// Blocks one call may evict.
    EvictBlocks,
    /// Scheduler hints one connection holds at once.
    HintsPerConnection,
    /// Keys over all the hints one connection holds.
    HintKeysPerConnection,
    /// Lease handles one connection holds at once.
    LeasesPerConnection,
    /// Saves and restores one connection has in flight at once.
    CopiesPerConnection,
    /// Connections the daemon serves at once.
    Connections,
    /// Restores a lease allows (`uses`).
    LeaseUses,
    /// Slots one process holds `WRITING` (saves in flight) or withheld (saves whose outcome is
    /// unknown) over all its connections.
    SlotsPerProcess,
    /// Blocks over the lease handles one connection holds (each handle counts its lease's blocks).
    LeasedBlocksPerConnection,
    /// Connections one process (by its pid from `SO_PEERCRED`) has open at once.
    ConnectionsPerProcess,
    /// Bytes the tier's hint tables are charged, over every hint of every connection (see
    /// `HINTED_KEY_BYTES` in the docs of [`crate::HostTier::try_hint`]).
    HintBytes,
    /// Slots held `WRITING` (saves in flight or withheld) over every process of a daemon at once,
    /// or beyond a process's fair share of them while others hold theirs.
    WritingSlots,
}

impl std::fmt::Display for Limit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Limit::FrameBytes => "frame size (bytes)",
            Limit::KeysPerRequest => "keys per request",
            Limit::EvictBlocks => "blocks per eviction call",
            Limit::HintsPerConnection => "hints per connection",
            Limit::HintKeysPerConnection => "hinted keys per connection",
            Limit::LeasesPerConnection => "leases per connection",
            Limit::CopiesPerConnection => "copies in flight per connection",
            Limit::Connections => "daemon connections",
            Limit::LeaseUses => "uses per lease",
            Limit::SlotsPerProcess => "slots being written or withheld per process",
            Limit::LeasedBlocksPerConnection => "leased blocks per connection",
            Limit::ConnectionsPerProcess => "daemon connections per process",
            Limit::HintBytes => "bytes of hints held by the daemon (all connections)",
            Limit::WritingSlots => {
                "slots being written or withheld over all processes (or past this process's fair share)"
            }
        })
    }
}

/// Any kvtier error.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    /// See [`GeometryError`].
    #[error(transparent)]
    Geometry(#[from] GeometryError),
    /// See [`PoolError`].
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// See [`CopyError`].
    #[error(transparent)]
    Copy(#[from] CopyError),
    /// See [`TierError`].
    #[error(transparent)]
    Tier(#[from] TierError),
    /// The SSD tier's files could not be opened or made ([`crate::TierConfig::ssd`]); see
    /// [`DiskError`](crate::DiskError).
    #[error("SSD tier: {0}")]
    Ssd(#[from] crate::disk::DiskError),
    /// A thread the tier needs could not be started.
    #[error("{what}: {source}")]
    Thread {
        /// Which thread, e.g. `starting the demotion thread`.
        what: &'static str,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Restored bytes that do not match their keys ([`crate::EngineArenas::verify`]): the first
    /// mismatching page, arena and byte.
    #[error(
        "verification failed: GPU page {page}, arena `{arena}`, byte {byte}: bytes differ from those of key {key}"
    )]
    Verification {
        /// GPU page id.
        page: u64,
        /// Arena name.
        arena: String,
        /// Byte offset of the first wrong byte in the page's chunk of the arena.
        byte: u64,
        /// The content key whose pattern the page should hold.
        key: ContentKey,
    },
    /// Page and key lists of differing lengths ([`crate::EngineArenas::fill`] and `verify` take
    /// one key per GPU page).
    #[error("invalid configuration: {pages} pages but {keys} keys: each page needs one key")]
    PageKeyCount {
        /// GPU pages given.
        pages: usize,
        /// Keys given.
        keys: usize,
    },
    /// Host memory for engine arenas ([`crate::copy::host::MemcpyArenas`]) could not be mapped.
    #[error("invalid configuration: mapping {bytes} B of host arena memory failed: {source}")]
    ArenaMemory {
        /// Bytes asked for.
        bytes: u64,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A file-system call on the tier daemon's socket, its directory or its lock file failed.
    #[error("invalid configuration: {what} {}: {source}", path.display())]
    Io {
        /// What was being done, e.g. `binding the socket`.
        what: &'static str,
        /// The file or directory.
        path: std::path::PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The tier daemon's socket or its directory could not be given to the daemon's group.
    #[error("invalid configuration: giving {} to group {gid}: {source}", path.display())]
    Chown {
        /// The socket or directory.
        path: std::path::PathBuf,
        /// The group id.
        gid: u32,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Something other than a socket is at the tier daemon's socket path; it was left alone.
    #[error(
        "invalid configuration: {} exists and is {found}, not a socket: refusing to replace it (choose another --socket)",
        path.display()
    )]
    SocketPathTaken {
        /// The socket path.
        path: std::path::PathBuf,
        /// What is there: `a directory`, `a symbolic link`, `a regular file` or `not a socket`.
        found: &'static str,
    },
    /// A socket that cannot be probed is at the tier daemon's socket path; it was left alone.
    #[error(
        "invalid configuration: {} is a socket that cannot be probed ({source}): refusing to replace it",
        path.display()
    )]
    SocketUnprobed {
        /// The socket path.
        path: std::path::PathBuf,
        /// The error of the probing `connect`.
        #[source]
        source: std::io::Error,
    },
    /// A tier daemon already listens at the socket path.
    #[error("invalid configuration: a tier daemon already listens at {}", path.display())]
    DaemonRunning {
        /// The socket path.
        path: std::path::PathBuf,
    },
    /// The per-user socket directory in `/tmp` is not a directory of this uid that only it can
    /// write: another user may have made it.
    #[error(
        "invalid configuration: {} is not a directory of uid {uid} that only it can write (owner {owner}, \
         mode {mode:o}): another user may have made it; remove it or choose another --socket",
        path.display()
    )]
    UnsafeSocketDir {
        /// The directory.
        path: std::path::PathBuf,
        /// This process's effective uid.
        uid: u32,
        /// The directory's owner uid.
        owner: u32,
        /// Its permission bits (`mode & 0o7777`).
        mode: u32,
    },
    /// A tier whose pool is private memory cannot be served by the daemon.
    #[error("invalid configuration: the tier's pool is private: build it with HostTier::new_shared")]
    PrivatePool,
    /// A connected tier (`HostTier::connect`, feature `remote`) cannot be served again: a daemon serves a
    /// tier whose state it owns.
    #[error(
        "invalid configuration: the tier is connected to another daemon: serve a tier built with HostTier::new_shared"
    )]
    ServeConnected,
    /// Daemon limits that cannot be used.
    #[error(transparent)]
    Limits(#[from] LimitsError),
}

/// Tier daemon limits (`server::Limits`) that cannot be used; the daemon refuses to start.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum LimitsError {
    /// A connection count or a timeout is zero.
    #[error(
        "invalid configuration: limits: connections, connections per process and every timeout must be above zero"
    )]
    Zero,
    /// A timeout the clock cannot add to the current instant (plus a year of margin).
    #[error("invalid configuration: limits: the {which} timeout of {timeout:?} is too large for the clock")]
    TimeoutTooLarge {
        /// `hello`, `frame` or `write`.
        which: &'static str,
        /// The timeout.
        timeout: std::time::Duration,
    },
    /// Leases over all connections could pin one slot more times than the slot word allows.
    #[error(
        "invalid configuration: limits: {connections} connections × min({leases} leases, {leased_blocks} leased \
         blocks) may pin one slot {pins_per_slot} times, above the {max} the daemon allows leases"
    )]
    LeasePins {
        /// Connections.
        connections: usize,
        /// Leases per connection.
        leases: usize,
        /// Leased blocks per connection.
        leased_blocks: usize,
        /// Pins one slot could get: `connections × min(leases, leased_blocks)`.
        pins_per_slot: u128,
        /// Pins the daemon allows leases on one slot.
        max: u128,
    },
    /// A frame bound above the protocol's.
    #[error("invalid configuration: limits: a frame bound of {bytes} B is above the protocol's {max} B")]
    FrameTooLarge {
        /// The bound asked for, bytes.
        bytes: usize,
        /// The protocol's largest frame, bytes.
        max: usize,
    },
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    /// The typed variants keep their OS error as the source and name their values in the message.
    #[test]
    fn typed_errors_keep_their_source_and_name_their_values() {
        let io = || std::io::Error::from_raw_os_error(libc::EACCES);
        let e = Error::Io { what: "binding the socket", path: "/run/kvtier/x.sock".into(), source: io() };
        assert_eq!(e.source().map(|s| s.to_string()), Some(io().to_string()));
        assert!(e.to_string().starts_with("invalid configuration: binding the socket /run/kvtier/x.sock: "), "{e}");
        let e = Error::ArenaMemory { bytes: 4096, source: io() };
        assert!(e.source().is_some() && e.to_string().contains("4096 B"), "{e}");
        let e = Error::Chown { path: "/tmp/d".into(), gid: 1234, source: io() };
        assert!(e.source().is_some() && e.to_string().contains("group 1234"), "{e}");
        let e = CopyError::SlotSizeMismatch { pool: 512, geometry: 1024 };
        assert_eq!(e.to_string(), "backend mismatch: pool slots are 512 B, geometry slots 1024 B");
        let e = Error::from(LimitsError::FrameTooLarge { bytes: 1 << 27, max: 1 << 26 });
        assert!(matches!(e, Error::Limits(LimitsError::FrameTooLarge { .. })));
        assert!(e.to_string().contains(&format!("{} B is above the protocol's {} B", 1 << 27, 1 << 26)), "{e}");
        let e = Error::Verification { page: 3, arena: "k".into(), byte: 17, key: ContentKey([0; 16]) };
        assert!(e.to_string().starts_with("verification failed: GPU page 3, arena `k`, byte 17:"), "{e}");
    }
}
