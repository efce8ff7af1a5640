"""Exceptions raised by kvtier: one class per error kind.

Every exception derives from :class:`KvtierError` and carries the error's fields as attributes
(for example ``CannotFitError.needed``, ``.available`` and ``.capacity``, in slots). The families
mirror the Rust crate's error enums:

- :class:`GeometryError` (also a ``ValueError``): an arena layout, a binding or tensors that
  cannot be used;
- :class:`PoolError`: the host pool could not be created;
- :class:`CopyError`: a copy backend refused or failed a batch;
- :class:`TierError`: a save, query or restore that cannot be carried out (nothing ready is lost).

The host tier is a cache: an engine may catch :class:`KvtierError` around any call and fall back
to a full prefill.
"""

from __future__ import annotations

__all__ = [
    "KvtierError",
    "ConfigError",
    "KeyLengthError",
    "VerificationError",
    # geometry
    "GeometryError",
    "NoArenasError",
    "TooManyArenasError",
    "BadNameError",
    "MissingFieldError",
    "ZeroSizeError",
    "MisalignedError",
    "StrideBelowUnitError",
    "ExtentOverflowError",
    "OverlapError",
    "BaseCountError",
    "NullBaseError",
    "UnknownPresetError",
    "CacheGroupsError",
    "TensorError",
    "DeviceMismatchError",
    "NotContiguousError",
    "ArenaChangedError",
    # pool
    "PoolError",
    "PoolTooSmallError",
    "BadSlotSizeError",
    "NoSuchNumaNodeError",
    "TooManySlotsError",
    "HugePagesUnavailableError",
    "PoolMapError",
    "PoolSyscallError",
    "PoolSlotOutOfRangeError",
    "PoolExceedsMemoryError",
    # copy
    "CopyError",
    "PageOutOfRangeError",
    "SlotOutOfRangeError",
    "DuplicateDestinationError",
    "BackendMismatchError",
    "DeviceError",
    "BackendUnavailableError",
    "BackendShutDownError",
    # tier
    "TierError",
    "LengthMismatchError",
    "CannotFitError",
    "PoolExhaustedError",
    "LeaseSettledError",
    "LeaseTooShortError",
    "ForeignLeaseError",
    "ShuttingDownError",
    "DrainTimeoutError",
    "TooManyPinsError",
    "LeaseExpiredError",
    "GeometryMismatchError",
    "IndexCapacityError",
    "BackendPanickedError",
    "DisconnectedError",
    "ProtocolMismatchError",
    "LimitExceededError",
    "ProtocolError",
    "PanickedError",
    "ForkedChildError",
    "UntrustedDaemonError",
    # peers
    "PeerError",
]


class KvtierError(Exception):
    """Base class of every kvtier exception. ``str(e)`` is the message; the error's fields are
    attributes (ints in bytes, pages, slots or blocks, or strings)."""

    def __init__(self, message: str, **fields: object) -> None:
        super().__init__(message)
        self.message = message
        for name, value in fields.items():
            setattr(self, name, value)


class ConfigError(KvtierError, ValueError):
    """An unknown policy, backing, copy mode or option name, or an SSD tier file that cannot be
    used (``Tier(..., ssd=...)``: too small for one block, a bad ``ssd_*`` option, a path holding
    no kvtier file, no space, an I/O error). Attribute: ``detail`` when raised by the Rust side;
    for an SSD tier file also ``path``, and ``bytes`` (no space) or ``call`` and ``os_error`` (an
    I/O error) where the error has them."""


class KeyLengthError(KvtierError, ValueError):
    """A content key that is not 16 bytes (derive keys with ``Namespace.key``)."""


class VerificationError(KvtierError):
    """Bytes that differ from what they should be. Attribute: ``detail``."""


# --- geometry -------------------------------------------------------------------------------


class GeometryError(KvtierError, ValueError):
    """An arena layout, binding or set of tensors that cannot be used."""


class NoArenasError(GeometryError):
    """The geometry lists no arena."""


class TooManyArenasError(GeometryError):
    """More arenas than the copy kernels support. Attributes: ``count``, ``max``."""


class BadNameError(GeometryError):
    """An arena name that is empty or used twice. Attributes: ``index``, ``name``."""


class MissingFieldError(GeometryError):
    """An empty model name, zero tokens per page, or a bad shard. Attribute: ``field``."""


class ZeroSizeError(GeometryError):
    """A size that must be positive is zero. Attributes: ``arena``, ``field``
    (``bytes_per_page``, ``page_stride`` or ``pages``)."""


class MisalignedError(GeometryError):
    """A page size, page stride or base address that is not a multiple of 16 bytes.
    Attributes: ``arena``, ``field`` (``bytes_per_page``, ``page_stride`` or ``base``), ``value``."""


class StrideBelowUnitError(GeometryError):
    """A page stride smaller than the bytes per page. Attributes: ``arena``, ``stride``, ``unit``."""


class ExtentOverflowError(GeometryError):
    """An arena whose extent overflows 64-bit offsets. Attributes: ``arena``, ``pages``, ``stride``."""


class OverlapError(GeometryError):
    """Two arenas share bytes. Attributes: ``a``, ``b`` (arena names)."""


class BaseCountError(GeometryError):
    """A binding with another number of base addresses than arenas. Attributes: ``got``, ``want``."""


class NullBaseError(GeometryError):
    """A null base address. Attribute: ``arena``."""


class UnknownPresetError(GeometryError):
    """A preset name that does not exist. Attributes: ``name``, ``known``."""


class CacheGroupsError(GeometryError):
    """A hybrid layout (``HybridLayout``) that cannot be used: an empty model name, no cache
    groups or more than 16, an empty or repeated group name, groups whose ``page_tokens`` differ,
    a sliding window of 0 tokens, or state groups only (no attention to restore a prefix of); from
    ``HybridTier``, a sliding-window group whose pool holds fewer blocks than its window spans.
    Attribute: ``reason`` (what is wrong, naming the group)."""


class TensorError(GeometryError):
    """An object that cannot serve as an arena: not a tensor or array, a shape that is not a whole
    number of pages, a read-only array, or tensors that do not match the geometry."""


class DeviceMismatchError(TensorError):
    """Tensors on different devices, or not on the device the rank is attached to. Attributes:
    ``expected``, ``found`` (device strings such as ``cuda:0`` or ``cpu``)."""


class NotContiguousError(TensorError):
    """A page's bytes are not contiguous in a tensor. Attributes: ``index`` (the tensor's
    position), ``shape``, ``strides`` (bytes)."""


class ArenaChangedError(TensorError):
    """A rank's arena tensor was resized, or its storage replaced or freed, after the rank was
    attached (torch ``resize_``, ``set_``, ``untyped_storage().resize_(0)``; numpy
    ``resize(..., refcheck=False)`` of the array or of the array that owns its memory). The rank's
    copies would use memory the tensor no longer owns, so the save or restore is refused before
    anything is copied or taken (a lease keeps its use). Close the rank and attach the tensors as
    they are now. Attributes: ``index`` (the tensor's position), ``field`` (``address``: the
    tensor's, its storage's or its owning array's address moved; ``bytes``: that memory grew or
    shrank), ``attached`` and ``found`` (the field's values then and now, ints: an address or a
    byte count)."""


# --- pool -----------------------------------------------------------------------------------


class PoolError(KvtierError):
    """The host pool could not be created."""


class PoolTooSmallError(PoolError, ValueError):
    """A pool smaller than one slot. Attributes: ``bytes``, ``slot_bytes``."""


class BadSlotSizeError(PoolError, ValueError):
    """A slot size of zero or not a multiple of 16 bytes. Attribute: ``slot_bytes``."""


class NoSuchNumaNodeError(PoolError, ValueError):
    """A NUMA node that does not exist or has no memory. Attribute: ``node``."""


class TooManySlotsError(PoolError, ValueError):
    """More slots than a slot id can name. Attributes: ``slots``, ``max``."""


class HugePagesUnavailableError(PoolError):
    """``backing="hugetlb"`` without enough reserved 2 MiB pages. Attributes: ``needed``, ``free``."""


class PoolMapError(PoolError, MemoryError):
    """``mmap`` of the pool failed. Attributes: ``bytes``, ``backing``, ``os_error``."""


class PoolSyscallError(PoolError, OSError):
    """``mlock``, ``madvise`` or ``mbind`` failed. Attributes: ``call``, ``os_error``."""


class PoolSlotOutOfRangeError(PoolError, IndexError):
    """A slot id outside the pool. Attributes: ``slot``, ``capacity``."""


class PoolExceedsMemoryError(PoolError, MemoryError):
    """A pool larger than this machine can back, refused before anything was mapped (the kernel's
    OOM killer would otherwise end this or another process): larger than physical memory, than
    available memory for a prefaulted or locked pool, than the free 2 MiB hugepages, or than
    ``RLIMIT_MEMLOCK`` for a locked pool. Ask for a smaller ``pool_bytes``. Attributes: ``bytes``
    (what the pool would map), ``available`` (bytes of what it was checked against) and ``what``
    (which limit, in words)."""


# --- copy -----------------------------------------------------------------------------------


class CopyError(KvtierError):
    """A copy backend refused or failed a batch."""


class PageOutOfRangeError(CopyError, IndexError):
    """A page id not below the arenas' page count; nothing was copied. Attributes: ``page``,
    ``pages``."""


class SlotOutOfRangeError(CopyError, IndexError):
    """A host slot id outside the pool; nothing was copied. Attributes: ``slot``, ``capacity``."""


class DuplicateDestinationError(CopyError, ValueError):
    """One batch writes the same page (or slot) twice. Attributes: ``what``, ``id``."""


class BackendMismatchError(CopyError, ValueError):
    """A backend or tensors built for another layout than the tier's. Attribute: ``detail``."""


class DeviceError(CopyError):
    """A CUDA driver (or NVRTC) error. Attributes: ``call`` (the failed function), ``code`` (the
    driver's ``CUresult``, or the ``nvrtcResult`` when ``call`` starts with ``nvrtc``, as an int;
    ``None`` for a device error without one, such as a fault a test injected) and ``detail`` (the
    driver's message)."""

    code: int | None = None


class BackendUnavailableError(CopyError):
    """The backend cannot run here (no CUDA driver, NVRTC or device). Attributes: ``backend``,
    ``reason``."""


class BackendShutDownError(CopyError):
    """The backend is shut down and accepts no copies."""


class BackendPanickedError(CopyError):
    """The copy backend panicked while kvtier waited for a copy: its outcome is unknown, its host
    slots are quarantined (never reused), and its GPU pages may still be in use."""


# --- tier -----------------------------------------------------------------------------------


class TierError(KvtierError):
    """A tier operation that cannot be carried out; nothing ready is lost."""


class LengthMismatchError(TierError, ValueError):
    """Keys and pages differ in number. Attributes: ``keys``, ``pages``."""


class CannotFitError(TierError):
    """A save needs more slots than can be freed; nothing was evicted. Attributes: ``needed``,
    ``available``, ``capacity`` (slots)."""


class PoolExhaustedError(TierError):
    """Eviction could not free enough slots (pinned meanwhile). Attributes: ``needed``, ``got``."""


class LeaseSettledError(TierError):
    """The lease was already released or used up."""


class LeaseExpiredError(LeaseSettledError):
    """The lease outlived the tier's ``lease_ttl_s`` and the tier settled it."""


class GeometryMismatchError(TierError, ValueError):
    """A backend whose block layout differs from the tier's. Attributes: ``backend``, ``tier``
    (model names). Also raised by ``Tier(..., ssd=...)`` for an SSD tier file made for another
    geometry or namespace (or slot count): then ``path`` is the file, and ``backend`` and ``tier``
    describe the file's layout and the tier's in words; the file is left untouched."""


class IndexCapacityError(TierError, ValueError):
    """An index capacity the index cannot address. Attributes: ``requested``, ``max``."""


class LeaseTooShortError(TierError, ValueError):
    """A restore asks for more pages than the lease holds. Attributes: ``asked``, ``held``."""


class ForeignLeaseError(TierError, ValueError):
    """The lease belongs to another tier."""


class ShuttingDownError(TierError):
    """The tier is shutting down, or the rank is closed."""


class DrainTimeoutError(TierError, TimeoutError):
    """Copies still in flight at a drain's deadline (nothing was freed). Attribute: ``in_flight``."""


class TooManyPinsError(TierError):
    """A slot's pin count is at its limit. Attribute: ``slot``."""


class DisconnectedError(TierError, ConnectionError):
    """A tier from :func:`kvtier.connect` lost its daemon (not running, stopped or restarted, or
    the connection broke). Nothing was saved or restored by the call; fall back to prefill and
    connect again. Attribute: ``reason``."""


class ProtocolMismatchError(TierError):
    """The tier daemon speaks another protocol version than this kvtier. Attributes: ``daemon``,
    ``client``."""


class LimitExceededError(TierError, ValueError):
    """A request over one of the tier's bounds on what one request or one connection may make it
    hold; nothing was done and the connection stays usable (split the request, or release what the
    connection holds). Attributes: ``limit`` (the bound's name: ``frame_bytes``,
    ``keys_per_request``, ``evict_blocks``, ``hints_per_connection``, ``hint_keys_per_connection``,
    ``leases_per_connection``, ``copies_per_connection``, ``connections``, ``lease_uses``,
    ``slots_per_process``, ``leased_blocks_per_connection``, ``connections_per_process``,
    ``hint_bytes`` (the daemon's hint tables over all connections), ``writing_slots`` (slots being
    written over all processes, or past this process's fair share)), ``asked`` and ``max`` (in the
    bound's unit: bytes, keys, blocks, hints, leases, copies, connections, uses or slots)."""


class ProtocolError(TierError):
    """A request the daemon protocol does not allow at this point (a second hello, a save finished
    twice, an id this connection was never given); the connection stays usable. Attribute:
    ``reason``."""


class PanickedError(TierError):
    """The code serving a request panicked: the request failed and did nothing visible, every slot
    and pin it may have touched was kept (quarantined where a copy may still use it), and the tier
    stays usable for every caller. Attributes: ``request`` (what was being served) and
    ``panic_message``."""


class ForkedChildError(TierError):
    """A tier from :func:`kvtier.connect` (or its rank or lease) was used in a process forked after
    the connection was made; the connection belongs to the process that connected. Call
    :func:`kvtier.connect` again in the child. Attributes: ``owner`` (the pid that connected) and
    ``current`` (the pid that made the call)."""


class UntrustedDaemonError(TierError, PermissionError):
    """The process listening on the daemon's socket runs as another user than expected (possibly
    an impostor squatting the socket path); nothing but the hello was sent to it. Attributes:
    ``expected`` and ``found`` (uids)."""


# --- peers ----------------------------------------------------------------------------------


class PeerError(KvtierError):
    """A tier's peer roles could not be started (``Tier(..., peers=..., peer_listen=...)``): the
    NIXL runtime is missing or refused the pool's registration (``kind`` ``"transport"``) or the
    listen address cannot be bound (``"connect"``); a value out of range is a
    :class:`ConfigError`.
    A peer that fails during a query raises nothing: see :attr:`kvtier.Lease.peer_errors`.
    Attribute: ``kind``."""
