"""vLLM's per-layer KV tensors as kvtier arenas.

vLLM hands a worker one tensor per attention layer (``register_kv_caches``). A vLLM block is one
block id across every layer, and kvtier moves it whole: every layer's bytes of that block id go to
one host slot. This module finds, in each tensor, the dimension that indexes blocks and the bytes
one block occupies, for the layouts vLLM's backends hand out:

======================  =========================================  ===========================
backend                 per-layer shape (logical)                   arenas per layer
======================  =========================================  ===========================
CPU                     ``[blocks, kv_heads, block_size, 2*head]``  1 (K and V interleaved)
CUDA FlashAttention     ``[2, blocks, block_size, kv_heads, head]`` 2 (K, then V)
FlashInfer (NHD / HND)  ``[blocks, 2, block_size, kv_heads, head]`` 1 (K then V of the block)
MLA                     ``[blocks, block_size, 656]`` (fp8) etc.    1
======================  =========================================  ===========================

The rule behind the table: the block dimension is the one dimension of size ``num_blocks`` whose
smaller-stride dimensions pack densely below it (a block's bytes are contiguous:
``bytes_per_page``, a multiple of 16, every stride in bytes) and whose larger-stride dimensions
lie wholly above all of its blocks; each index of such a dimension (FlashAttention's K/V) is an
arena of its own. A layout with a
block's bytes not contiguous, arenas that overlap, or an alignment below 16 bytes is refused with
:class:`UnsupportedLayoutError` at start: never a copy of the wrong bytes.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Dict, List, Sequence, Tuple

from .._tensors import describe
from ..errors import ConfigError

__all__ = ["ArenaSpec", "UnsupportedLayoutError", "layer_order", "arenas_of", "layout_signature"]


class UnsupportedLayoutError(ConfigError):
    """A KV tensor whose blocks kvtier cannot move whole (raised by ``register_kv_caches``)."""


@dataclass(frozen=True)
class ArenaSpec:
    """One arena: ``pages`` blocks of ``bytes_per_page`` bytes each ``page_stride`` bytes apart,
    starting ``offset`` bytes into the layer tensor's storage (from the storage's first byte)."""

    name: str
    layer: int
    offset: int
    bytes_per_page: int
    page_stride: int
    pages: int


_DIGITS = re.compile(r"(\d+)")


def layer_order(names: Sequence[str]) -> List[str]:
    """Layer names in model order: by the first integer in the name (vLLM's
    ``model.layers.7.self_attn.attn``), then by name. Both processes of an engine sort the same
    names the same way."""

    def key(n: str) -> Tuple[int, str]:
        m = _DIGITS.search(n)
        return (int(m.group(1)) if m else -1, n)

    return sorted(names, key=key)


def arenas_of(name: str, layer: int, tensor: Any, num_blocks: int) -> List[ArenaSpec]:
    """The arenas of one layer's KV tensor holding ``num_blocks`` blocks.

    Raises: ``UnsupportedLayoutError`` (no dimension of ``num_blocks`` blocks with a dense block
    below it; a block or stride that is not a multiple of 16 bytes; sub-arenas that overlap).
    """
    info = describe(tensor)
    shape, strides = info.shape, info.strides
    storage_start = _storage_ptr(tensor, info.ptr)
    dims = range(len(shape))
    fits = []
    for d in (d for d in dims if shape[d] == num_blocks):
        inner = [i for i in dims if i != d and strides[i] < strides[d]]
        dense = _dense_bytes(shape, strides, inner, info.itemsize)
        if dense is None or dense > strides[d] or dense % 16:
            continue
        # Every other dimension lies wholly above the blocks (an arena each), never between them.
        span = strides[d] * (num_blocks - 1) + dense
        if all(strides[o] >= span for o in dims if o != d and o not in inner and shape[o] > 1):
            fits.append((d, inner, dense))
    if len(fits) > 1:
        raise UnsupportedLayoutError(
            f"KV tensor {name!r} (shape {tuple(shape)}): {len(fits)} dimensions of {num_blocks} could index the "
            "blocks; give the engine more blocks than any other dimension's size"
        )
    found = fits[0] if fits else None
    if found is None:
        raise UnsupportedLayoutError(
            f"KV tensor {name!r} (shape {tuple(shape)}, byte strides {tuple(strides)}): no dimension of "
            f"{num_blocks} blocks with a block's bytes contiguous below it; kvtier moves a block whole and "
            "supports the CPU, FlashAttention, FlashInfer and MLA layouts"
        )
    d, inner, bytes_per_page = found
    page_stride = strides[d]
    outer = [i for i in dims if i != d and i not in inner and shape[i] > 1]
    if bytes_per_page % 16 or page_stride % 16:
        raise UnsupportedLayoutError(
            f"KV tensor {name!r}: a block is {bytes_per_page} B every {page_stride} B; kvtier needs both to be "
            "multiples of 16 B"
        )
    base = info.ptr - storage_start
    specs = []
    span = page_stride * (num_blocks - 1) + bytes_per_page
    outer_ranges = [range(shape[i]) for i in outer]
    for idx in itertools.product(*outer_ranges):
        offset = base + sum(k * strides[i] for k, i in zip(idx, outer))
        suffix = "".join(f".{k}" for k in idx) if outer else ""
        specs.append(ArenaSpec(f"{name}{suffix}", layer, offset, bytes_per_page, page_stride, num_blocks))
    ordered = sorted(specs, key=lambda s: s.offset)
    for a, b in zip(ordered, ordered[1:]):
        if a.offset + span > b.offset:
            raise UnsupportedLayoutError(
                f"KV tensor {name!r}: the blocks of {a.name!r} and {b.name!r} overlap (strides {tuple(strides)})"
            )
    return specs


def _dense_bytes(shape, strides, inner, itemsize):
    """Bytes of the dims ``inner`` if they pack densely (each stride the product of the sizes
    below it), else None."""
    expect = itemsize
    for i in sorted(inner, key=lambda i: strides[i]):
        if shape[i] == 1:
            continue
        if strides[i] != expect:
            return None
        expect *= shape[i]
    return expect


def _storage_ptr(tensor: Any, ptr: int) -> int:
    storage = getattr(tensor, "untyped_storage", None)
    if callable(storage):
        return int(storage().data_ptr())
    return ptr


def layout_signature(specs: Sequence[ArenaSpec]) -> str:
    """The layout facts two engines must share for their blocks to be interchangeable: each
    arena's layer and bytes per page, in order (page strides and counts are each engine's own)."""
    return ";".join(f"{s.layer}:{s.bytes_per_page}" for s in specs)


def byte_views(kv_caches: Dict[str, Any], specs_by_layer: Dict[str, List[ArenaSpec]]) -> List[Any]:
    """One ``uint8`` torch view ``[pages, bytes_per_page]`` with row stride ``page_stride`` per
    arena, over the layer tensors' own storage (no copy), in arena order."""
    import torch

    views = []
    for name, specs in specs_by_layer.items():
        t = kv_caches[name]
        raw = torch.empty(0, dtype=torch.uint8, device=t.device)
        raw.set_(t.untyped_storage())
        for s in specs:
            views.append(raw.as_strided((s.pages, s.bytes_per_page), (s.page_stride, 1), s.offset))
    return views
