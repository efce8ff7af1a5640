"""Every kvtier error kind is raised as its own exception class, with its fields."""

import numpy as np
import pytest

import kvtier
from kvtier import errors
from conftest import PAGES, make_arrays


def test_every_rust_error_variant_maps_to_its_class_with_fields():
    examples = kvtier._kvtier._error_examples()
    names = {name for name, _ in examples}
    # One class per variant of GeometryError (13), PoolError (9), CopyError (8), TierError (19,
    # Copy aside), plus kvtier::Error's Verification and Config.
    assert len(names) == 13 + 9 + 8 + 19 + 2
    for name, exc in examples:
        cls = getattr(errors, name)
        assert type(exc) is cls, (name, type(exc))
        assert isinstance(exc, kvtier.KvtierError)
        assert str(exc) == exc.message and exc.message
        assert name in errors.__all__
    by = {n: e for n, e in examples}
    assert (by["CannotFitError"].needed, by["CannotFitError"].available, by["CannotFitError"].capacity) == (5, 2, 4)
    assert (by["MisalignedError"].arena, by["MisalignedError"].field, by["MisalignedError"].value) == ("a", "base", 8)
    assert (by["PageOutOfRangeError"].page, by["PageOutOfRangeError"].pages) == (99, 64)
    assert by["DeviceError"].call == "cuLaunchKernel" and by["DeviceError"].code == 700
    assert "CUDA_ERROR_ILLEGAL_ADDRESS" in by["DeviceError"].detail
    assert by["PoolSyscallError"].call == "mlock" and by["PoolSyscallError"].os_error
    assert by["DrainTimeoutError"].in_flight == 2
    assert isinstance(by["DrainTimeoutError"], TimeoutError)
    assert isinstance(by["PageOutOfRangeError"], IndexError)
    assert isinstance(by["OverlapError"], kvtier.GeometryError) and isinstance(by["OverlapError"], ValueError)
    assert isinstance(by["CannotFitError"], kvtier.TierError)
    assert isinstance(by["BackendUnavailableError"], kvtier.CopyError)
    assert isinstance(by["HugePagesUnavailableError"], kvtier.PoolError)
    assert isinstance(by["LeaseExpiredError"], kvtier.LeaseSettledError)
    assert (by["IndexCapacityError"].requested, by["IndexCapacityError"].max) == (1 << 60, 1 << 56)
    assert isinstance(by["BackendPanickedError"], kvtier.CopyError)
    assert isinstance(by["DisconnectedError"], kvtier.TierError) and isinstance(by["DisconnectedError"], ConnectionError)
    assert "restarted" in by["DisconnectedError"].reason
    assert (by["ProtocolMismatchError"].daemon, by["ProtocolMismatchError"].client) == (2, 1)
    assert "used twice" in by["CacheGroupsError"].reason
    assert isinstance(by["CacheGroupsError"], kvtier.GeometryError) and isinstance(by["CacheGroupsError"], ValueError)


def test_the_bounded_protocol_errors_map_to_their_classes_with_fields():
    examples = kvtier._kvtier._error_examples()
    by = {n: e for n, e in examples}
    # Every bound (kvtier::Limit) has its own name; none falls back to "other".
    limits = [e for n, e in examples if n == "LimitExceededError"]
    assert sorted(e.limit for e in limits) == sorted(
        [
            "frame_bytes",
            "keys_per_request",
            "evict_blocks",
            "hints_per_connection",
            "hint_keys_per_connection",
            "leases_per_connection",
            "copies_per_connection",
            "connections",
            "lease_uses",
            "slots_per_process",
            "leased_blocks_per_connection",
            "connections_per_process",
            "hint_bytes",
            "writing_slots",
            "frame_bytes",
        ]
    )
    first = limits[0]
    assert (first.limit, first.asked, first.max) == ("frame_bytes", 1 << 30, 1 << 26)
    assert "frame size" in str(first)
    assert isinstance(first, kvtier.TierError) and isinstance(first, ValueError)
    assert by["ProtocolError"].reason == "a second hello on one connection"
    assert not isinstance(by["ProtocolError"], kvtier.DisconnectedError)
    p = by["PanickedError"]
    assert (p.request, p.panic_message) == ("evict", "capacity overflow") and str(p) == p.message
    assert (by["ForkedChildError"].owner, by["ForkedChildError"].current) == (100, 101)
    u = by["UntrustedDaemonError"]
    assert (u.expected, u.found) == (1000, 0) and isinstance(u, PermissionError)
    for name in ("LimitExceededError", "ProtocolError", "PanickedError", "ForkedChildError", "UntrustedDaemonError"):
        assert issubclass(getattr(kvtier, name), kvtier.TierError)


def test_every_exception_class_is_exported_and_documented():
    for name in errors.__all__:
        cls = getattr(kvtier, name)
        assert issubclass(cls, kvtier.KvtierError) and cls.__doc__


# --- raised through the API ---------------------------------------------------------------


def test_geometry_errors():
    with pytest.raises(kvtier.NoArenasError):
        kvtier.Geometry("m", 16, [])
    with pytest.raises(kvtier.MisalignedError) as e:
        kvtier.Geometry("m", 16, [("a", 40, 40, 4)])
    assert (e.value.field, e.value.value) == ("bytes_per_page", 40)
    with pytest.raises(kvtier.ZeroSizeError):
        kvtier.Geometry("m", 16, [("a", 64, 64, 0)])
    with pytest.raises(kvtier.StrideBelowUnitError):
        kvtier.Geometry("m", 16, [("a", 64, 32, 4)])
    with pytest.raises(kvtier.BadNameError) as e:
        kvtier.Geometry("m", 16, [("a", 64, 64, 4), ("a", 64, 64, 4)])
    assert e.value.index == 1
    with pytest.raises(kvtier.MissingFieldError):
        kvtier.Geometry("", 16, [("a", 64, 64, 4)])
    with pytest.raises(kvtier.ExtentOverflowError):
        kvtier.Geometry("m", 16, [("a", 1 << 40, 1 << 40, 1 << 30)])
    with pytest.raises(kvtier.TooManyArenasError):
        kvtier.Geometry("m", 16, [(f"a{i}", 16, 16, 1) for i in range(257)])
    with pytest.raises(kvtier.UnknownPresetError) as e:
        kvtier.Geometry.preset("gpt-5", 4)
    assert "llama3-8b" in e.value.known
    with pytest.raises(kvtier.MissingFieldError):
        kvtier.Geometry.preset("llama3-8b", 4).with_shard(2, 2)


def test_tensor_checks_device_contiguity_alignment_overlap():
    a = make_arrays()
    # Not contiguous within a page: every other row of a bigger array.
    big = np.zeros((PAGES * 32, 2, 8), dtype=np.float16)
    with pytest.raises(kvtier.NotContiguousError) as e:
        kvtier.Geometry.from_tensors([big[::2]], model="m")
    assert e.value.index == 0
    with pytest.raises(kvtier.NotContiguousError):
        kvtier.Geometry.from_tensors([np.zeros((32, 8, 2), dtype=np.float16).transpose(0, 2, 1)], model="m")
    # 16 B alignment: a base one element past an aligned one; 8-byte pages.
    buf = np.zeros(PAGES * 16 * 16 + 8, dtype=np.uint8)
    off = (-buf.ctypes.data) % 16 + 1
    with pytest.raises(kvtier.MisalignedError) as e:
        kvtier.Geometry.from_tensors([buf[off : off + PAGES * 16 * 16].reshape(PAGES * 16, 16)], model="m")
    assert e.value.field == "base"
    with pytest.raises(kvtier.MisalignedError) as e:
        kvtier.Geometry.from_tensors([np.zeros((PAGES * 16, 1), dtype=np.uint8)], model="m", page_tokens=8)
    assert e.value.field == "bytes_per_page"
    # Two views of the same memory overlap.
    with pytest.raises(kvtier.OverlapError):
        kvtier.Geometry.from_tensors([a[0], a[0]], model="m")
    # Shapes and objects.
    with pytest.raises(kvtier.TensorError):
        kvtier.Geometry.from_tensors([np.zeros((17, 2, 8), dtype=np.float16)], model="m")
    with pytest.raises(kvtier.TensorError):
        kvtier.Geometry.from_tensors(a[0], model="m")  # one array, not a sequence
    with pytest.raises(kvtier.TensorError):
        kvtier.Geometry.from_tensors([], model="m")
    with pytest.raises(kvtier.TensorError):
        kvtier.Geometry.from_tensors([[1, 2, 3]], model="m")
    with pytest.raises(kvtier.ConfigError):
        kvtier.Geometry.from_tensors(a, model="m", layout="heads")


def test_device_mismatch_and_read_only_arrays(tier, geometry):
    torch = pytest.importorskip("torch")
    a = make_arrays()
    # CPU memory cannot be a CUDA rank's arenas.
    with pytest.raises(kvtier.DeviceMismatchError) as e:
        tier.attach_cuda(0, a)
    assert (e.value.expected, e.value.found) == ("cuda:0", "cpu")
    # Mixed devices in one geometry (a fake CUDA array through __cuda_array_interface__).
    class FakeCuda:
        def __init__(self, arr):
            self.__cuda_array_interface__ = dict(arr.__array_interface__, version=3)

    with pytest.raises(kvtier.DeviceMismatchError):
        kvtier.Geometry.from_tensors([a[0], FakeCuda(a[1])], model="m")
    ro = make_arrays()
    ro[1].setflags(write=False)
    with pytest.raises(kvtier.TensorError, match="read-only"):
        tier.attach_host(ro)
    del torch


def test_backend_mismatch_and_unavailable(tier):
    with pytest.raises(kvtier.BackendMismatchError):
        tier.attach_host(make_arrays()[:3])  # 3 tensors for 4 arenas
    wide = [np.zeros((PAGES * 16, 4, 8), dtype=np.float16) for _ in range(4)]
    with pytest.raises(kvtier.BackendMismatchError) as e:
        tier.attach_host(wide)  # 1,024 B per page, the geometry says 512
    assert "512" in e.value.detail
    if not kvtier.cuda_available():
        fake = []

        class FakeCuda:
            def __init__(self, arr):
                self.__cuda_array_interface__ = dict(arr.__array_interface__, version=3)

        fake = [FakeCuda(x) for x in make_arrays()]
        with pytest.raises(kvtier.BackendUnavailableError) as e:
            tier.attach_cuda(0, fake)
        assert e.value.backend == "cuda"


def test_pool_errors(geometry):
    with pytest.raises(kvtier.PoolTooSmallError) as e:
        kvtier.Tier(geometry, geometry.slot_bytes - 1)
    assert e.value.slot_bytes == geometry.slot_bytes
    with pytest.raises(kvtier.NoSuchNumaNodeError) as e:
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, numa_node=4095)
    assert e.value.node == 4095
    with pytest.raises(kvtier.ConfigError):
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, "fifo-ish")
    with pytest.raises(kvtier.ConfigError):
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="huge")


def test_tier_and_copy_errors(tier, rank):
    ns = tier.namespace
    keys = ns.keys([bytes([i]) for i in range(12)])
    with pytest.raises(kvtier.LengthMismatchError) as e:
        rank.save(keys[:2], [0])
    assert (e.value.keys, e.value.pages) == (2, 1)
    with pytest.raises(kvtier.PageOutOfRangeError) as e:
        rank.save(keys[:1], [PAGES])
    assert (e.value.page, e.value.pages) == (PAGES, PAGES)
    with pytest.raises(kvtier.CannotFitError) as e:
        rank.save(keys[:9], list(range(9)))  # 8 slots
    assert (e.value.needed, e.value.available, e.value.capacity) == (9, 8, 8)
    rank.save(keys[:2], [0, 1]).wait()
    with tier.query(keys[:2]) as lease:
        with pytest.raises(kvtier.LeaseTooShortError) as e:
            rank.restore(lease, [4, 5, 6])
        assert (e.value.asked, e.value.held) == (3, 2)
        with pytest.raises(kvtier.DuplicateDestinationError) as e:
            rank.restore(lease, [4, 4])
        assert e.value.id == 4
        with pytest.raises(kvtier.PageOutOfRangeError):
            rank.restore(lease, [4, PAGES + 3])
        assert lease.uses_left == 1, "a refused restore leaves the lease usable"
        other = kvtier.Tier(tier.geometry, 2 * tier.geometry.slot_bytes, backing="plain")
        with other.attach_host(make_arrays()) as r2:
            with pytest.raises(kvtier.ForeignLeaseError):
                r2.restore(lease, [0])
    with pytest.raises(kvtier.LeaseSettledError):
        rank.restore(lease, [4])
    # Pins: every slot pinned by leases -> a save cannot evict them.
    rank.save(keys[2:8], list(range(2, 8))).wait()
    held = tier.query(keys[:8])
    assert len(held) == 8
    with pytest.raises(kvtier.CannotFitError) as e:
        rank.save(keys[8:9], [8])
    assert e.value.available == 0
    held.release()
    with pytest.raises(ValueError):
        rank.save(keys[:1], [0], fit="most")
    with pytest.raises(ValueError):
        rank.save(keys[:1], [0], after_stream=1, after_event=2)
    tier.shutdown()
    with pytest.raises(kvtier.ShuttingDownError):
        rank.save(keys[:1], [0])
    with pytest.raises(kvtier.ShuttingDownError):
        tier.attach_host(make_arrays())


def test_an_engine_can_catch_one_base_class(tier, rank):
    # The host tier is a cache: any failure degrades to a full prefill.
    for bad in (lambda: rank.save([b"x" * 16], [PAGES + 1]), lambda: tier.query([b"x"])):
        with pytest.raises(kvtier.KvtierError):
            bad()


def _meminfo_bytes(field):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} in /proc/meminfo")


def test_a_pool_larger_than_memory_raises_pool_exceeds_memory_error(geometry):
    # Four times physical memory on plain 4 KiB pages: refused before anything is mapped.
    total = _meminfo_bytes("MemTotal")
    asked = 4 * total // geometry.slot_bytes * geometry.slot_bytes
    with pytest.raises(kvtier.PoolExceedsMemoryError) as info:
        kvtier.Tier(geometry, asked, "lru", backing="plain")
    e = info.value
    assert type(e) is errors.PoolExceedsMemoryError
    assert isinstance(e, kvtier.PoolError) and isinstance(e, MemoryError) and isinstance(e, kvtier.KvtierError)
    assert e.bytes >= asked
    assert 0 < e.available <= total
    assert e.what.startswith("physical memory")
    assert str(e) == e.message and f"a pool of {e.bytes} B exceeds" in str(e)
    # The same geometry with a pool that fits is a tier.
    assert kvtier.Tier(geometry, 8 * geometry.slot_bytes, "lru", backing="plain").capacity == 8
