//! kvtier's Rust errors as the Python exceptions of `kvtier/errors.py`: one class per variant,
//! named after it, with the variant's fields as attributes (e.g. `CannotFitError.needed`).
//!
//! The classes are defined in Python (readable docstrings, ordinary subclassing) and looked up by
//! name when an error is raised, on the thread that called into kvtier with the GIL held.

use kvtier::{CopyError, DiskError, Error, GeometryError, IndexError, Limit, PoolError, TierError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

/// An error value ready to become a Python exception: class name, message, attributes.
pub struct Raised {
    class: &'static str,
    message: String,
    fields: Vec<(&'static str, Field)>,
}

/// An exception attribute.
pub enum Field {
    Int(u64),
    Str(String),
}

impl Raised {
    fn new(class: &'static str, message: impl ToString) -> Self {
        Raised { class, message: message.to_string(), fields: Vec::new() }
    }
    fn int(mut self, name: &'static str, v: impl Into<u64>) -> Self {
        self.fields.push((name, Field::Int(v.into())));
        self
    }
    pub(crate) fn str(mut self, name: &'static str, v: impl ToString) -> Self {
        self.fields.push((name, Field::Str(v.to_string())));
        self
    }
    /// A Python-side error of this package (class in `kvtier.errors`).
    pub fn custom(class: &'static str, message: impl ToString) -> Self {
        Raised::new(class, message)
    }
    /// Builds the exception instance.
    pub fn to_exception<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let module = py.import("kvtier.errors")?;
        let cls = module.getattr(self.class)?;
        let kwargs = PyDict::new(py);
        for (name, v) in &self.fields {
            match v {
                Field::Int(i) => kwargs.set_item(*name, *i)?,
                Field::Str(s) => kwargs.set_item(*name, s)?,
            }
        }
        cls.call((self.message.as_str(),), Some(&kwargs))
    }
}

impl From<Raised> for PyErr {
    fn from(r: Raised) -> PyErr {
        Python::attach(|py| match r.to_exception(py) {
            Ok(e) => PyErr::from_value(e),
            Err(e) => e,
        })
    }
}

/// The `detail` attribute of an error whose message starts with its kind (`backend mismatch: `,
/// `invalid configuration: `): the message without that prefix.
fn detail(e: &impl std::fmt::Display, prefix: &str) -> String {
    let m = e.to_string();
    m.strip_prefix(prefix).map(str::to_string).unwrap_or(m)
}

fn usize_(v: usize) -> u64 {
    v as u64
}

/// The Python name of a bound (`LimitExceededError.limit`): the variant's name in snake case.
/// A bound added to kvtier after this binding is `other` (its message still names it).
pub fn limit_name(l: &Limit) -> &'static str {
    match l {
        Limit::FrameBytes => "frame_bytes",
        Limit::KeysPerRequest => "keys_per_request",
        Limit::EvictBlocks => "evict_blocks",
        Limit::HintsPerConnection => "hints_per_connection",
        Limit::HintKeysPerConnection => "hint_keys_per_connection",
        Limit::LeasesPerConnection => "leases_per_connection",
        Limit::CopiesPerConnection => "copies_per_connection",
        Limit::Connections => "connections",
        Limit::LeaseUses => "lease_uses",
        Limit::SlotsPerProcess => "slots_per_process",
        Limit::LeasedBlocksPerConnection => "leased_blocks_per_connection",
        Limit::ConnectionsPerProcess => "connections_per_process",
        Limit::HintBytes => "hint_bytes",
        Limit::WritingSlots => "writing_slots",
        _ => "other",
    }
}

/// Every bound this binding names, in declaration order (for `examples` and the tests).
const LIMITS: [Limit; 14] = [
    Limit::FrameBytes,
    Limit::KeysPerRequest,
    Limit::EvictBlocks,
    Limit::HintsPerConnection,
    Limit::HintKeysPerConnection,
    Limit::LeasesPerConnection,
    Limit::CopiesPerConnection,
    Limit::Connections,
    Limit::LeaseUses,
    Limit::SlotsPerProcess,
    Limit::LeasedBlocksPerConnection,
    Limit::ConnectionsPerProcess,
    Limit::HintBytes,
    Limit::WritingSlots,
];

impl From<&GeometryError> for Raised {
    fn from(e: &GeometryError) -> Self {
        use GeometryError as G;
        let r = |c| Raised::new(c, e);
        match e {
            G::NoArenas => r("NoArenasError"),
            G::TooManyArenas { count, max } => {
                r("TooManyArenasError").int("count", usize_(*count)).int("max", usize_(*max))
            }
            G::BadName { index, name } => r("BadNameError").int("index", usize_(*index)).str("name", name),
            G::MissingField { field } => r("MissingFieldError").str("field", field),
            G::Zero { arena, field } => r("ZeroSizeError").str("arena", arena).str("field", field),
            G::Misaligned { arena, field, value } => {
                r("MisalignedError").str("arena", arena).str("field", field).int("value", *value)
            }
            G::StrideBelowUnit { arena, stride, unit } => {
                r("StrideBelowUnitError").str("arena", arena).int("stride", *stride).int("unit", *unit)
            }
            G::Overflow { arena, pages, stride } => {
                r("ExtentOverflowError").str("arena", arena).int("pages", *pages).int("stride", *stride)
            }
            G::Overlap { a, b } => r("OverlapError").str("a", a).str("b", b),
            G::BaseCount { got, want } => r("BaseCountError").int("got", usize_(*got)).int("want", usize_(*want)),
            G::NullBase { arena } => r("NullBaseError").str("arena", arena),
            G::UnknownPreset { name, known } => r("UnknownPresetError").str("name", name).str("known", known),
            G::Groups { reason } => r("CacheGroupsError").str("reason", reason),
            _ => r("GeometryError"),
        }
    }
}

impl From<&PoolError> for Raised {
    fn from(e: &PoolError) -> Self {
        use PoolError as P;
        let r = |c| Raised::new(c, e);
        match e {
            P::TooSmall { bytes, slot_bytes } => {
                r("PoolTooSmallError").int("bytes", *bytes).int("slot_bytes", *slot_bytes)
            }
            P::BadSlotSize { slot_bytes } => r("BadSlotSizeError").int("slot_bytes", *slot_bytes),
            P::NoSuchNumaNode { node } => r("NoSuchNumaNodeError").int("node", *node),
            P::TooManySlots { slots, max } => r("TooManySlotsError").int("slots", *slots).int("max", *max),
            P::HugePagesUnavailable { needed, free } => {
                r("HugePagesUnavailableError").int("needed", *needed).int("free", *free)
            }
            P::Map { bytes, backing, source } => {
                r("PoolMapError").int("bytes", *bytes).str("backing", backing).str("os_error", source)
            }
            P::Syscall { call, source } => r("PoolSyscallError").str("call", call).str("os_error", source),
            P::SlotOutOfRange { slot, capacity } => {
                r("PoolSlotOutOfRangeError").int("slot", *slot).int("capacity", *capacity)
            }
            P::ExceedsMemory { .. } if crate::seeded::seeded("exceeds-memory-untyped") => r("PoolError"),
            P::ExceedsMemory { bytes, available, what } => {
                r("PoolExceedsMemoryError").int("bytes", *bytes).int("available", *available).str("what", what)
            }
            P::NoHeadroom { bytes, available, .. } => r("PoolExceedsMemoryError")
                .int("bytes", *bytes)
                .int("available", *available)
                .str("what", "available memory (MemAvailable) less the headroom kept free"),
            _ => r("PoolError"),
        }
    }
}

impl From<&CopyError> for Raised {
    fn from(e: &CopyError) -> Self {
        use CopyError as C;
        let r = |c| Raised::new(c, e);
        match e {
            C::PageOutOfRange { page, pages } => r("PageOutOfRangeError").int("page", *page).int("pages", *pages),
            C::SlotOutOfRange { slot, capacity } => {
                r("SlotOutOfRangeError").int("slot", *slot).int("capacity", *capacity)
            }
            C::DuplicateDestination { what, id } => r("DuplicateDestinationError").str("what", what).int("id", *id),
            C::PoolNotBound
            | C::SlotSizeMismatch { .. }
            | C::BadPoolRegion { .. }
            | C::ArenaCount { .. }
            | C::PageBytesMismatch { .. }
            | C::ChunkTooLarge { .. }
            | C::BadArgument { .. }
            | C::NoSuchLayer { .. }
            | C::LayerGroupsMismatch { .. }
            | C::WaitCount { .. } => r("BackendMismatchError").str("detail", detail(e, "backend mismatch: ")),
            C::Injected { call } => r("DeviceError").str("call", call).str("detail", "injected fault"),
            C::Cuda { call, detail, source } => {
                r("DeviceError").str("call", call).int("code", source.0 as u32).str("detail", detail)
            }
            C::Nvrtc { call, source, log } => r("DeviceError")
                .str("call", call)
                .int("code", source.0 as u32)
                .str("detail", format!("{:?}: {log}", source.0)),
            C::Unavailable { backend, reason } => {
                r("BackendUnavailableError").str("backend", backend).str("reason", reason)
            }
            C::ShutDown => r("BackendShutDownError"),
            C::BackendPanicked => r("BackendPanickedError"),
            // A variant added to kvtier after this binding: its base class.
            _ => r("CopyError"),
        }
    }
}

impl From<&TierError> for Raised {
    fn from(e: &TierError) -> Self {
        use TierError as T;
        let r = |c| Raised::new(c, e);
        match e {
            T::LengthMismatch { keys, pages } => {
                r("LengthMismatchError").int("keys", usize_(*keys)).int("pages", usize_(*pages))
            }
            T::CannotFit { needed, available, capacity } => r("CannotFitError")
                .int("needed", usize_(*needed))
                .int("available", usize_(*available))
                .int("capacity", usize_(*capacity)),
            T::PoolExhausted { needed, got } => {
                r("PoolExhaustedError").int("needed", usize_(*needed)).int("got", usize_(*got))
            }
            T::LeaseSettled => r("LeaseSettledError"),
            T::LeaseTooShort { asked, held } => {
                r("LeaseTooShortError").int("asked", usize_(*asked)).int("held", usize_(*held))
            }
            T::ForeignLease => r("ForeignLeaseError"),
            T::ShuttingDown => r("ShuttingDownError"),
            T::DrainTimeout { in_flight } => r("DrainTimeoutError").int("in_flight", *in_flight),
            T::TooManyPins { slot } => r("TooManyPinsError").int("slot", *slot),
            T::LeaseExpired => r("LeaseExpiredError"),
            T::GeometryMismatch { backend, tier } => {
                r("GeometryMismatchError").str("backend", backend).str("tier", tier)
            }
            T::Index(IndexError::CapacityTooLarge { requested, max }) => {
                r("IndexCapacityError").int("requested", usize_(*requested)).int("max", usize_(*max))
            }
            T::Disconnected { reason } => r("DisconnectedError").str("reason", reason),
            T::ProtocolMismatch { daemon, client } => {
                r("ProtocolMismatchError").int("daemon", *daemon).int("client", *client)
            }
            T::LimitExceeded { limit, asked, max } => {
                r("LimitExceededError").str("limit", limit_name(limit)).int("asked", *asked).int("max", *max)
            }
            T::Protocol { reason } => r("ProtocolError").str("reason", reason),
            T::Panicked { request, message } => {
                r("PanickedError").str("request", request).str("panic_message", message)
            }
            T::ForkedChild { owner, current } => r("ForkedChildError").int("owner", *owner).int("current", *current),
            T::UntrustedDaemon { expected, found } => {
                r("UntrustedDaemonError").int("expected", *expected).int("found", *found)
            }
            T::Copy(c) => c.into(),
            // A variant added to kvtier after this binding: its base class.
            _ => r("TierError"),
        }
    }
}

/// An SSD tier file's layout in words (`GeometryMismatchError.backend` / `.tier`).
fn disk_layout(namespace: &kvtier::Namespace, payload_bytes: u64, slots: u64) -> String {
    format!("{namespace:?}, blocks of {payload_bytes} B, {slots} slots")
}

/// An SSD tier's error (`Error::Ssd`, opening its files): a file of another geometry is a
/// `GeometryMismatchError` (as a backend of another layout is); a bad size or option, a path that
/// holds no kvtier file, no space and I/O errors are `ConfigError`s (as kvtier's other file and
/// socket errors are). Each keeps kvtier's message, and `path` where the error names a file.
impl From<&DiskError> for Raised {
    fn from(e: &DiskError) -> Self {
        use DiskError as D;
        let config = || Raised::new("ConfigError", e).str("detail", detail(e, "disk slot file: "));
        match e {
            D::OtherGeometry { path, found, wanted } => Raised::new("GeometryMismatchError", e)
                .str("backend", disk_layout(&found.namespace, found.payload_bytes, found.slots))
                .str("tier", disk_layout(&wanted.namespace, wanted.payload_bytes, wanted.slots))
                .str("path", path.display()),
            D::BadConfig(_) => config(),
            D::NoSpace { path, bytes } => config().str("path", path.display()).int("bytes", *bytes),
            D::NotADiskFile { path, .. } => config().str("path", path.display()),
            D::Io { path, what, source } => {
                config().str("path", path.display()).str("call", what).str("os_error", source)
            }
            // Slot-level errors stay inside the SSD tier (a block that fails verification is
            // never served); a variant added to kvtier after this binding: the base class.
            _ => Raised::new("KvtierError", e),
        }
    }
}

impl From<&Error> for Raised {
    fn from(e: &Error) -> Self {
        match e {
            Error::Geometry(g) => g.into(),
            Error::Pool(p) => p.into(),
            Error::Copy(c) => c.into(),
            Error::Tier(t) => t.into(),
            // Seeded bug (tests only): an SSD tier's errors all raised as the base class.
            Error::Ssd(_) if crate::seeded::seeded("ssd-error-untyped") => Raised::new("KvtierError", e),
            // The class and fields of the file's error, kvtier's whole message (`SSD tier: ...`).
            Error::Ssd(d) => Raised { message: e.to_string(), ..d.into() },
            Error::Verification { .. } => {
                Raised::new("VerificationError", e).str("detail", detail(e, "verification failed: "))
            }
            Error::PageKeyCount { .. }
            | Error::ArenaMemory { .. }
            | Error::Io { .. }
            | Error::Chown { .. }
            | Error::SocketPathTaken { .. }
            | Error::SocketUnprobed { .. }
            | Error::DaemonRunning { .. }
            | Error::UnsafeSocketDir { .. }
            | Error::PrivatePool
            | Error::ServeConnected
            | Error::Limits(_) => Raised::new("ConfigError", e).str("detail", detail(e, "invalid configuration: ")),
            // Trace and replay errors come from the CLI's paths, which the binding does not call.
            _ => Raised::new("KvtierError", e),
        }
    }
}

/// `?`-friendly conversion of any kvtier error into a Python exception.
pub trait IntoPyResult<T> {
    /// The value, or the error as its Python exception.
    fn py(self) -> PyResult<T>;
}

impl<T, E> IntoPyResult<T> for Result<T, E>
where
    for<'a> &'a E: Into<Raised>,
{
    fn py(self) -> PyResult<T> {
        self.map_err(|e| PyErr::from((&e).into()))
    }
}

/// One example of every error variant the binding maps, by class name: the test suite checks that
/// each becomes its exception class with its fields.
pub fn examples() -> Vec<(&'static str, Raised)> {
    let io = || std::io::Error::from_raw_os_error(12);
    let s = |x: &str| x.to_string();
    let geometry = [
        GeometryError::NoArenas,
        GeometryError::TooManyArenas { count: 300, max: 256 },
        GeometryError::BadName { index: 2, name: s("k.L0") },
        GeometryError::MissingField { field: "model" },
        GeometryError::Zero { arena: s("a"), field: "pages" },
        GeometryError::Misaligned { arena: s("a"), field: "base", value: 8 },
        GeometryError::StrideBelowUnit { arena: s("a"), stride: 16, unit: 32 },
        GeometryError::Overflow { arena: s("a"), pages: 1 << 40, stride: 1 << 40 },
        GeometryError::Overlap { a: s("a"), b: s("b") },
        GeometryError::BaseCount { got: 1, want: 2 },
        GeometryError::NullBase { arena: s("a") },
        GeometryError::UnknownPreset { name: s("x"), known: s("glm52") },
        GeometryError::Groups { reason: s("cache group name `full` is used twice") },
    ];
    let pool = [
        PoolError::TooSmall { bytes: 10, slot_bytes: 256 },
        PoolError::BadSlotSize { slot_bytes: 8 },
        PoolError::NoSuchNumaNode { node: 7 },
        PoolError::TooManySlots { slots: 1 << 33, max: 1 << 31 },
        PoolError::HugePagesUnavailable { needed: 4, free: 0 },
        PoolError::Map { bytes: 1 << 20, backing: "thp", source: io() },
        PoolError::Syscall { call: "mlock", source: io() },
        PoolError::SlotOutOfRange { slot: 9, capacity: 4 },
        PoolError::ExceedsMemory {
            bytes: 1 << 40,
            available: 24 << 30,
            what: "physical memory (MemTotal less the hugetlb pool)",
        },
    ];
    let copy = || {
        vec![
            CopyError::PageOutOfRange { page: 99, pages: 64 },
            CopyError::SlotOutOfRange { slot: 9, capacity: 4 },
            CopyError::DuplicateDestination { what: "GPU page", id: 3 },
            CopyError::SlotSizeMismatch { pool: 512, geometry: 1024 },
            CopyError::Injected { call: "injected" },
            // The same class; the last example of a class is the one the tests read.
            kvtier::driver_error(
                "cuLaunchKernel",
                kvtier::cudarc::driver::DriverError(kvtier::cudarc::driver::sys::CUresult::CUDA_ERROR_ILLEGAL_ADDRESS),
            ),
            CopyError::Unavailable { backend: "cuda", reason: s("no GPU") },
            CopyError::ShutDown,
            CopyError::BackendPanicked,
        ]
    };
    let tier = [
        TierError::LengthMismatch { keys: 2, pages: 3 },
        TierError::CannotFit { needed: 5, available: 2, capacity: 4 },
        TierError::PoolExhausted { needed: 5, got: 1 },
        TierError::LeaseSettled,
        TierError::LeaseTooShort { asked: 3, held: 1 },
        TierError::ForeignLease,
        TierError::ShuttingDown,
        TierError::DrainTimeout { in_flight: 2 },
        TierError::TooManyPins { slot: 1 },
        TierError::LeaseExpired,
        TierError::GeometryMismatch { backend: s("a"), tier: s("b") },
        TierError::Index(IndexError::CapacityTooLarge { requested: 1 << 60, max: 1 << 56 }),
        TierError::Disconnected { reason: s("the daemon closed the connection (it stopped or restarted)") },
        TierError::ProtocolMismatch { daemon: 2, client: 1 },
        TierError::Protocol { reason: s("a second hello on one connection") },
        TierError::Panicked { request: s("evict"), message: s("capacity overflow") },
        TierError::ForkedChild { owner: 100, current: 101 },
        TierError::UntrustedDaemon { expected: 1000, found: 0 },
        // One per bound; the last (lease_uses) is the one a by-class lookup reads.
        TierError::LimitExceeded { limit: Limit::FrameBytes, asked: 1 << 30, max: 1 << 26 },
    ];
    let limits = LIMITS.map(|limit| TierError::LimitExceeded { limit, asked: 70_000, max: 65_536 });
    let mut out: Vec<Raised> = Vec::new();
    out.extend(geometry.iter().map(Raised::from));
    out.extend(pool.iter().map(Raised::from));
    out.extend(copy().iter().map(Raised::from));
    out.extend(tier.iter().map(Raised::from));
    out.extend(limits.iter().map(Raised::from));
    // Wrapped variants map to the inner error's class.
    out.extend(copy().into_iter().map(|c| Raised::from(&TierError::Copy(c))));
    out.push(Raised::from(&Error::Verification {
        page: 3,
        arena: s("k"),
        byte: 0,
        key: kvtier::ContentKey::from_bytes([7; 16]),
    }));
    // An SSD tier's file errors map to existing classes (ConfigError, read before the last).
    let path = || std::path::PathBuf::from("/data/kvtier.ssd");
    out.push(Raised::from(&Error::Ssd(DiskError::NoSpace { path: path(), bytes: 1 << 40 })));
    out.push(Raised::from(&Error::Ssd(DiskError::Io { path: path(), what: "opening", source: io() })));
    out.push(Raised::from(&Error::Ssd(DiskError::BadConfig(s("/data/kvtier.ssd: 100 B holds no block")))));
    out.push(Raised::from(&Error::PageKeyCount { pages: 2, keys: 3 }));
    out.into_iter().map(|r| (r.class, r)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_bound_has_its_own_python_name() {
        let names: std::collections::HashSet<&str> = LIMITS.iter().map(limit_name).collect();
        assert_eq!(names.len(), LIMITS.len(), "two bounds share a name");
        assert!(!names.contains("other"), "a bound falls back to `other`: {names:?}");
    }
}
