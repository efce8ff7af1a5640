"""Reading arena tensors without importing torch or numpy.

kvtier never depends on an array library: it reads the address, shape, strides, element size and
device of whatever the engine passes, through the protocols those libraries expose:

- torch tensors: ``data_ptr()``, ``shape``, ``stride()`` (elements), ``element_size()``, ``device``;
- ``__cuda_array_interface__`` (cupy, numba, ...) and numpy's ``__array_interface__``: ``data``,
  ``shape``, ``strides`` (bytes, or None when C-contiguous), ``typestr``.

Called by the native module (``Geometry.from_tensors``, ``Tier.attach_cuda``, ``Tier.attach_host``)
on the caller's thread.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Sequence, Tuple

from .errors import ConfigError, DeviceMismatchError, NotContiguousError, TensorError

__all__ = ["TensorInfo", "describe", "arena_views"]


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
