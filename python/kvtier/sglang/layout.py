"""SGLang's host KV pool as kvtier arenas.

HiCache keeps its host tier in one CPU tensor, ``mem_pool_host.kv_buffer``, whose shape depends on
the pool class and ``--hicache-mem-layout`` (``T`` = the pool's tokens, ``P`` = its pages,
``ps`` = ``page_size`` tokens, ``L`` layers, ``H`` heads, ``D`` head dim):

==================  =============================  ========================  ==================
layout              MHA (``MHATokenToKVPoolHost``)  MLA (``MLATokenToKVPoolHost``)  arenas
==================  =============================  ========================  ==================
layer_first         ``[2, L, T, H, D]``             ``[L, T, 1, dim]``        2L (MHA), L (MLA)
page_first          ``[2, T, L, H, D]``             ``[T, L, 1, dim]``        2 (MHA), 1 (MLA)
page_first_direct   ``[2, P, L, ps, H, D]``         ``[P, L, ps, 1, dim]``    2 (MHA), 1 (MLA)
==================  =============================  ========================  ==================

Each arena is a view of ``kv_buffer`` whose dimension 0 indexes tokens (``layout="tokens"``) or
pages (``layout="pages"``), and the arenas are in the order of the tensor's leading dimensions, so
a kvtier block (the page's bytes of every arena, one after another) is byte for byte SGLang's flat
data page (``mem_pool_host.get_data_page(index, flat=True)``), whatever the layout. A page of the
pool is ``host_index // page_size``. Other layouts (``page_head``, ``page_unified``, split K/V
buffers) raise :class:`UnsupportedHostLayoutError` when the pool is registered.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List

from .._tensors import describe
from ..errors import ConfigError

__all__ = ["HostArenas", "UnsupportedHostLayoutError", "host_arenas", "LAYOUTS"]

#: ``--hicache-mem-layout`` values the backend moves.
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class UnsupportedHostLayoutError(ConfigError):
    """A host pool whose pages kvtier cannot move as one block (raised by ``register_mem_pool_host``)."""


@dataclass
class HostArenas:
    """The arenas of one host pool: ``views`` (tensors, one per arena), their ``names``, the
    ``layout`` to attach them with (``"tokens"`` or ``"pages"``), ``page_tokens`` (SGLang's
    ``page_size``), ``pages`` (pages in the pool), ``block_bytes`` (bytes of one page over all
    arenas), ``kind`` (``"mha"`` / ``"mla"``), ``pool_layout`` (SGLang's layout name) and
    ``dtype`` (the element type's name)."""

    views: List[Any]
    names: List[str]
    layout: str
    page_tokens: int
    pages: int
    block_bytes: int
    kind: str
    pool_layout: str
    dtype: str


def host_arenas(pool: Any) -> HostArenas:
    """The arenas of SGLang's host pool ``pool`` (``kv_buffer``, ``layout``, ``page_size``).

    Raises: ``UnsupportedHostLayoutError`` for a layout or a buffer shape of none of the table's
    rows, or a buffer not on the CPU.
    """
    layout = getattr(pool, "layout", None)
    kv = getattr(pool, "kv_buffer", None)
    ps = getattr(pool, "page_size", None)
    if layout not in LAYOUTS:
        raise UnsupportedHostLayoutError(
            f"SGLang host pool layout {layout!r} is not supported by kvtier (supported: {', '.join(LAYOUTS)}; "
            "start SGLang with --hicache-mem-layout page_first, for example)"
        )
    if kv is None or not hasattr(kv, "shape"):
        raise UnsupportedHostLayoutError(f"{type(pool).__name__} has no kv_buffer tensor (split K/V buffers?)")
    if not isinstance(ps, int) or ps < 1:
        raise UnsupportedHostLayoutError(f"{type(pool).__name__}.page_size is {ps!r}, not a positive number of tokens")
    info = describe(kv)
    if info.device[0] != "cpu":
        raise UnsupportedHostLayoutError(f"the host pool's kv_buffer is on {info.device[0]}, not the CPU")
    nd = len(kv.shape)
    mha = {"layer_first": 5, "page_first": 5, "page_first_direct": 6}[layout]
    if nd == mha and kv.shape[0] == 2:
        kind = "mha"
    elif nd == mha - 1:
        kind = "mla"
    else:
        raise UnsupportedHostLayoutError(
            f"a {layout} host pool with kv_buffer of shape {tuple(kv.shape)}: expected {mha} dimensions "
            f"(MHA, leading 2 for K and V) or {mha - 1} (MLA)"
        )
    if layout == "layer_first":
        if kind == "mha":
            views = [kv[c, l] for c in range(2) for l in range(kv.shape[1])]
            names = [f"{'kv'[c]}.L{l}" for c in range(2) for l in range(kv.shape[1])]
        else:
            views = [kv[l] for l in range(kv.shape[0])]
            names = [f"kv.L{l}" for l in range(kv.shape[0])]
        mode = "tokens"
    else:
        views = [kv[0], kv[1]] if kind == "mha" else [kv]
        names = ["k", "v"] if kind == "mha" else ["kv"]
        mode = "tokens" if layout == "page_first" else "pages"
    rows = views[0].shape[0]
    if mode == "tokens" and rows % ps:
        raise UnsupportedHostLayoutError(f"the host pool holds {rows} tokens, not a multiple of page_size = {ps}")
    pages = rows // ps if mode == "tokens" else rows
    item = info.itemsize
    per_page = 1
    for n in views[0].shape[1:]:
        per_page *= int(n)
    per_page *= item * (ps if mode == "tokens" else 1)
    return HostArenas(
        views=views,
        names=names,
        layout=mode,
        page_tokens=ps,
        pages=pages,
        block_bytes=per_page * len(views),
        kind=kind,
        pool_layout=layout,
        dtype=str(getattr(kv, "dtype", item)),
    )
