"""Reading arena tensors without importing torch or numpy.

kvtier never depends on an array library: it reads the address, shape, strides, element size and
device of whatever the engine passes, through the protocols those libraries expose:

- torch tensors: ``data_ptr()``, ``shape``, ``stride()`` (elements), ``element_size()``, ``device``;
- ``__cuda_array_interface__`` (cupy, numba, ...) and numpy's ``__array_interface__``: ``data``,
  ``shape``, ``strides`` (bytes, or None when C-contiguous), ``typestr``.

Called by the native module (``Geometry.from_tensors``, ``Tier.attach_cuda``, ``Tier.attach_host``)
on the caller's thread.

A rank copies into its tensors' memory from its own threads, so that memory must stay the
tensors' for as long as the rank is open. :class:`ArenaWatch` holds each tensor and whatever owns
its memory (a torch tensor's untyped storage, the numpy array at the root of a view's ``base``
chain) and, before each save or restore, checks that none of them was resized or replaced since
the rank was attached (``ArenaChangedError`` otherwise).
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple, Optional, Sequence, Tuple

from .errors import ArenaChangedError, ConfigError, DeviceMismatchError, NotContiguousError, TensorError

__all__ = ["TensorInfo", "describe", "arena_views", "ArenaWatch"]


class TensorInfo(NamedTuple):
    """One tensor as kvtier sees it. ``strides`` are in bytes; ``device`` is ``(type, index)``
    with ``index`` None where unknown (CPU memory, some ``__cuda_array_interface__`` objects)."""

    ptr: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    itemsize: int
    device: Tuple[str, Optional[int]]
    readonly: bool


def _c_strides(shape: Sequence[int], itemsize: int) -> Tuple[int, ...]:
    out = []
    step = itemsize
    for n in reversed(shape):
        out.append(step)
        step *= n
    return tuple(reversed(out))


def _from_interface(iface: dict, device: Tuple[str, Optional[int]], what: str) -> TensorInfo:
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise TensorError(f"{what} has no (pointer, read_only) data entry (a buffer-backed array?)")
    shape = tuple(int(s) for s in iface["shape"])
    typestr = str(iface["typestr"])
    itemsize = int(typestr[2:])
    strides = iface.get("strides")
    strides = _c_strides(shape, itemsize) if strides is None else tuple(int(s) for s in strides)
    return TensorInfo(int(data[0]), shape, strides, itemsize, device, bool(data[1]))


def _device_of(obj: Any) -> Tuple[str, Optional[int]]:
    dev = getattr(obj, "device", None)
    kind = getattr(dev, "type", None)
    index = getattr(dev, "index", getattr(dev, "id", None))
    return (str(kind) if kind is not None else "cuda", None if index is None else int(index))


def describe(obj: Any) -> TensorInfo:
    """The address, shape, byte strides, element size, device and writability of a torch tensor,
    a ``__cuda_array_interface__`` object or a numpy array (in that order of preference).

    Raises: ``TensorError`` for anything else.
    """
    if callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "element_size", None)):
        itemsize = int(obj.element_size())
        dev = obj.device
        index = getattr(dev, "index", None)
        return TensorInfo(
            int(obj.data_ptr()),
            tuple(int(s) for s in obj.shape),
            tuple(int(s) * itemsize for s in obj.stride()),
            itemsize,
            (str(dev.type), None if index is None else int(index)),
            False,
        )
    if hasattr(obj, "__cuda_array_interface__"):
        return _from_interface(obj.__cuda_array_interface__, _device_of(obj), type(obj).__name__)
    if hasattr(obj, "__array_interface__"):
        return _from_interface(obj.__array_interface__, ("cpu", None), type(obj).__name__)
    raise TensorError(
        f"{type(obj).__name__} is not a tensor or array (expected a torch tensor, a numpy array or an "
        "object with __cuda_array_interface__)"
    )


def _device_str(dev: Tuple[str, Optional[int]]) -> str:
    return dev[0] if dev[1] is None else f"{dev[0]}:{dev[1]}"


def _same_device(a: Tuple[str, Optional[int]], b: Tuple[str, Optional[int]]) -> bool:
    return a[0] == b[0] and (a[1] is None or b[1] is None or a[1] == b[1])


def arena_views(
    tensors: Any,
    *,
    page_tokens: int,
    layout: str = "tokens",
    device: Optional[Tuple[str, Optional[int]]] = None,
    writable: bool = False,
) -> list:
    """``[(ptr, bytes_per_page, page_stride, pages), ...]`` for a sequence of per-layer tensors.

    ``layout="tokens"``: dimension 0 indexes tokens, ``page_tokens`` consecutive rows form a page,
    which must be contiguous (``stride(0)`` = the bytes of one row). ``layout="pages"``: dimension 0
    indexes pages; the page stride is ``stride(0)``. In both the dimensions after 0 must be
    C-contiguous (dimensions of size 1 may have any stride). Byte sizes and addresses are checked
    for 16-byte alignment by the caller (``MisalignedError``).

    ``device``: the device every tensor must be on, as ``(type, index)`` (``index`` None: any);
    None: any, but all the same. ``writable``: refuse read-only arrays (restores write them).

    Raises: ``TensorError``, ``DeviceMismatchError``, ``NotContiguousError``, ``ConfigError``
    (unknown layout).
    """
    if layout not in ("tokens", "pages"):
        raise ConfigError(f"unknown layout {layout!r} (tokens, pages)")
    if hasattr(tensors, "__array_interface__") or hasattr(tensors, "data_ptr") or isinstance(tensors, (bytes, str)):
        raise TensorError("pass a sequence of tensors, one per arena (e.g. [k0, v0, k1, v1, ...]), not one tensor")
    try:
        items = list(tensors)
    except TypeError:
        raise TensorError(f"expected a sequence of tensors, got {type(tensors).__name__}") from None
    if not items:
        raise TensorError("no tensors given: a geometry needs at least one arena")
    infos = [describe(t) for t in items]
    want = device if device is not None else infos[0].device
    rows = page_tokens if layout == "tokens" else 1
    out = []
    for i, t in enumerate(infos):
        if not _same_device(want, t.device):
            raise DeviceMismatchError(
                f"tensor {i} is on {_device_str(t.device)}, expected {_device_str(want)}",
                expected=_device_str(want),
                found=_device_str(t.device),
            )
        if writable and t.readonly:
            raise TensorError(f"tensor {i} is read-only; a rank restores into its arenas")
        if not t.shape or any(n <= 0 for n in t.shape):
            raise TensorError(f"tensor {i} has shape {t.shape}: need at least one dimension and no empty one")
        if any(s < 0 for s in t.strides):
            raise NotContiguousError(
                f"tensor {i} has a negative stride {t.strides}", index=i, shape=t.shape, strides=t.strides
            )
        row = t.itemsize
        for n, s in zip(reversed(t.shape[1:]), reversed(t.strides[1:])):
            if n != 1 and s != row:
                raise NotContiguousError(
                    f"tensor {i}: the dimensions after 0 are not contiguous (shape {t.shape}, strides {t.strides} "
                    f"bytes); a page's bytes must be one contiguous run",
                    index=i,
                    shape=t.shape,
                    strides=t.strides,
                )
            row *= n
        if t.shape[0] % rows:
            raise TensorError(
                f"tensor {i} has {t.shape[0]} rows in dimension 0, not a multiple of page_tokens = {page_tokens} "
                "(use layout='pages' if dimension 0 indexes pages)"
            )
        pages = t.shape[0] // rows
        bytes_per_page = rows * row
        if layout == "tokens":
            if t.shape[0] > 1 and t.strides[0] != row:
                raise NotContiguousError(
                    f"tensor {i}: rows are {t.strides[0]} B apart but hold {row} B, so a page of {page_tokens} "
                    "tokens is not contiguous",
                    index=i,
                    shape=t.shape,
                    strides=t.strides,
                )
            page_stride = bytes_per_page
        else:
            page_stride = t.strides[0] if pages > 1 else bytes_per_page
        out.append((t.ptr, bytes_per_page, page_stride, pages))
    return out


def _is_torch(obj: Any) -> bool:
    return callable(getattr(obj, "data_ptr", None)) and callable(getattr(obj, "untyped_storage", None))


def _interface(obj: Any) -> Optional[dict]:
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is None:
        iface = getattr(obj, "__array_interface__", None)
    return iface if isinstance(iface, dict) else None


def _interface_bytes(iface: dict) -> int:
    """The bytes an array interface spans from its address: the extent of its last element."""
    shape = tuple(int(n) for n in iface["shape"])
    itemsize = int(str(iface["typestr"])[2:])
    if any(n == 0 for n in shape):
        return 0
    strides = iface.get("strides")
    strides = _c_strides(shape, itemsize) if strides is None else tuple(int(s) for s in strides)
    return sum((n - 1) * s for n, s in zip(shape, strides)) + itemsize


class _TorchProbe:
    """A torch tensor and its untyped storage, as attached. Holding the storage keeps its memory
    alive if the tensor is given another one (``set_``); the check sees the storage reallocated
    (``resize_``) or freed (``untyped_storage().resize_(0)``)."""

    __slots__ = ("index", "tensor", "storage", "ptr", "storage_ptr", "storage_bytes")

    def __init__(self, index: int, tensor: Any, ptr: int, extent: int) -> None:
        self.index = index
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        self.ptr = int(tensor.data_ptr())
        self.storage_ptr = int(self.storage.data_ptr())
        self.storage_bytes = int(self.storage.nbytes())
        if ptr != self.ptr or not (self.storage_ptr <= ptr and ptr + extent <= self.storage_ptr + self.storage_bytes):
            raise TensorError(f"tensor {index}: its arena is not inside its storage")

    def check(self) -> None:
        i = self.index
        found = int(self.tensor.data_ptr())
        if found != self.ptr:
            raise _changed(i, "address", self.ptr, found, "its data_ptr() moved (set_, or a resize_ that reallocated)")
        storage = self.tensor.untyped_storage()
        found = int(storage.data_ptr())
        if found != self.storage_ptr:
            raise _changed(i, "address", self.storage_ptr, found, "its storage was reallocated or freed")
        found = int(storage.nbytes())
        if found != self.storage_bytes:
            raise _changed(i, "bytes", self.storage_bytes, found, "its storage was resized")


def _data_ptr_method(tensor: Any) -> Any:
    """torch's own ``data_ptr`` (the C method of ``torch._C.TensorBase``), called unbound: what a
    subclass's Python override would say is not what the copy uses."""
    for cls in type(tensor).__mro__:
        if cls.__name__ in ("TensorBase", "_TensorBase") and hasattr(cls, "data_ptr"):
            return cls.data_ptr
    return operator.methodcaller("data_ptr")


class _ArrayProbe:
    """An array-interface object (numpy, ``__cuda_array_interface__``) and the object that owns
    its memory (the root of its ``base`` chain), each with its address and extent as attached. An
    ordinary ``ndarray.resize`` is refused by numpy while this probe holds a reference; the check
    sees ``resize(..., refcheck=False)`` of the array or of its owner."""

    __slots__ = ("index", "objs", "marks", "sizes")

    def __init__(self, index: int, obj: Any) -> None:
        self.index = index
        chain = [obj]
        base = getattr(obj, "base", None)
        while base is not None and _interface(base) is not None and len(chain) < 64:
            chain.append(base)
            base = getattr(base, "base", None)
        # The array itself and its memory's owner (the same object when it owns its memory).
        self.objs = (obj, chain[-1]) if len(chain) > 1 else (obj,)
        self.marks = tuple(self._mark(o) for o in self.objs)
        self.sizes = tuple(self._size(o) for o in self.objs)

    @staticmethod
    def _mark(obj: Any) -> Tuple[Any, ...]:
        """Address, shape and strides as the interface gives them (cheap to compare)."""
        iface = _interface(obj)
        if iface is None:
            return (None, None, None)
        return (iface["data"][0], iface["shape"], iface.get("strides"))

    @staticmethod
    def _size(obj: Any) -> int:
        iface = _interface(obj)
        return 0 if iface is None else _interface_bytes(iface)

    def check(self) -> None:
        for obj, mark, size in zip(self.objs, self.marks, self.sizes):
            found = self._mark(obj)
            if found == mark:
                continue
            what = "it" if obj is self.objs[0] else "the array that owns its memory"
            ptr, found_ptr = int(mark[0] or 0), int(found[0] or 0)
            if found_ptr != ptr:
                raise _changed(self.index, "address", ptr, found_ptr, f"{what} was reallocated")
            found_size = self._size(obj)
            if found_size != size:
                raise _changed(self.index, "bytes", size, found_size, f"{what} was resized")
            # Reshaped in place over the same bytes: the memory is still the one attached.


def _changed(index: int, field: str, attached: int, found: int, why: str) -> ArenaChangedError:
    return ArenaChangedError(
        f"tensor {index} changed since the rank was attached: {why} ({field} {attached:#x} then, {found:#x} now); "
        "the rank's copies would use memory the tensor no longer owns, so nothing was copied. "
        "Close the rank and attach the tensors as they are now",
        index=index,
        field=field,
        attached=attached,
        found=found,
    )


class ArenaWatch:
    """The tensors of one rank, held from attach to close, with what owns their memory.

    ``ArenaWatch(tensors, views)``: ``tensors`` as given to ``attach_cuda`` / ``attach_host``;
    ``views``: their ``(ptr, bytes_per_page, page_stride, pages)`` from :func:`arena_views`.

    ``check()``: raises ``ArenaChangedError`` if a tensor was resized or its storage replaced or
    freed since (called before every save and restore, with the GIL held). ``release()`` drops
    the references (after the rank's copies have drained).
    """

    __slots__ = ("tensors", "probes", "torch_probes", "torch_tensors", "torch_ptrs", "data_ptr", "arrays")

    def __init__(self, tensors: Sequence[Any], views: Sequence[Tuple[int, int, int, int]]) -> None:
        self.tensors = tuple(tensors)
        probes = []
        for i, (t, (ptr, bytes_per_page, page_stride, pages)) in enumerate(zip(self.tensors, views)):
            extent = (int(pages) - 1) * int(page_stride) + int(bytes_per_page)
            probes.append(_TorchProbe(i, t, int(ptr), extent) if _is_torch(t) else _ArrayProbe(i, t))
        self.probes = tuple(probes)
        # The per-call check of torch tensors is one data_ptr() each (about 0.1 us through torch's C
        # method, against 0.6 us for the full probe: a 99-arena rank paid 56 us a call). Under
        # torch a storage never changes its memory in place: resize_ allocates anew and copies,
        # and resize_(0) frees, so either moves the tensor's data_ptr(); a tensor whose data_ptr()
        # is as attached still owns the memory attached. The probes run when one moved, to say why.
        torch_probes = self.torch_probes = tuple(p for p in probes if isinstance(p, _TorchProbe))
        self.torch_tensors = tuple(p.tensor for p in torch_probes)
        self.torch_ptrs = [p.ptr for p in torch_probes]
        self.data_ptr = _data_ptr_method(self.torch_tensors[0]) if torch_probes else None
        self.arrays = tuple(p for p in probes if not isinstance(p, _TorchProbe))

    def check(self) -> None:
        if self.torch_tensors:
            found = list(map(self.data_ptr, self.torch_tensors))
            if found != self.torch_ptrs:
                for p in self.probes:
                    p.check()
                # A subclass whose data_ptr() override hides the move from the probe.
                i = next(i for i, (a, b) in enumerate(zip(self.torch_ptrs, found)) if a != b)
                raise _changed(self.torch_probes[i].index, "address", self.torch_ptrs[i], found[i], "its data_ptr() moved")
        for p in self.arrays:
            p.check()

    def release(self) -> None:
        self.tensors = ()
        self.probes = ()
        self.torch_probes = ()
        self.torch_tensors = ()
        self.torch_ptrs = []
        self.arrays = ()
