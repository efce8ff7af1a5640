"""kvtier: a host-memory tier for LLM inference engines' KV caches.

A *block* is one page of the engine's paged KV cache taken across every per-layer arena (for
Llama-3-8B: the K and V tensors of 32 layers, 64 arenas of 32,768 B per 16-token page). kvtier
saves blocks from GPU pages into a pinned host pool (device -> host, one kernel launch per batch),
finds them again by 16-byte content key, and restores them into any free pages (host -> device),
so a request whose prefix was seen before restores it instead of prefilling it.

    import kvtier
    geometry = kvtier.Geometry.from_tensors(kv, model="llama3-8b", page_tokens=16)
    tier = kvtier.Tier(geometry, pool_bytes=8 << 30)
    rank = tier.attach_cuda(0, kv)                   # kv: [k0, v0, k1, v1, ...], [pages*16, heads, dim]
    keys = tier.namespace.keys(block_hashes)         # 16-byte keys from the engine's block hashes
    rank.save(keys, pages, after_stream=torch.cuda.current_stream())
    with tier.query(keys) as lease:                  # pins the longest resident prefix
        h = rank.restore(lease, free_pages[: len(lease)], after_stream=torch.cuda.current_stream())
        h.stream_wait(torch.cuda.current_stream())   # compute waits for the copy, no host sync

Engines that run one process per GPU rank share one pool through the tier daemon: start
``kvtierd`` once, then ``tier = kvtier.connect()`` (its default socket, ``default_socket_path()``)
in every process gives the same ``Tier`` API over the daemon's pool.

Hybrid models (full attention beside sliding-window attention or recurrent state, e.g. Gemma-3,
Qwen3-Next, Jamba) describe their cache groups in a ``HybridLayout`` (``CacheGroup`` per group,
or ``HybridLayout.preset``); a ``HybridTier`` keeps one ``Tier`` per group (``tier.group(g)``) and
its ``query`` answers the longest prefix every group can restore at (``HybridLease``);
``hybrid_save`` / ``hybrid_restore`` call each group's ``Rank`` with that group's keys.

Peers: a ``Tier`` made with ``peer_listen="host:port"`` serves its pool to other instances, and one
made with ``peers=["host:port", ...]`` reads its misses from theirs through NIXL (a wheel built
with the cargo feature ``peers``, the NIXL runtime loadable: ``peers_available()``);
``Lease.sources`` says per block whether it came from the host pool, the SSD tier or a peer.

See ``docs/python.md`` in the repository for a complete example. Errors are the classes of
:mod:`kvtier.errors`, all subclasses of :class:`KvtierError`, exported here too: for example
``kvtier.PoolExceedsMemoryError`` (a ``Tier`` whose ``pool_bytes`` the machine cannot back,
refused before anything is mapped).
"""

from ._kvtier import (
    CacheGroup,
    CopyHandle,
    Geometry,
    HybridLayout,
    HybridLease,
    HybridTier,
    Lease,
    Namespace,
    Rank,
    SaveTicket,
    Tier,
    __version__,
    connect,
    default_socket_path,
    cuda_available,
    peers_available,
)
from .hybrid import hybrid_restore, hybrid_save, hybrid_wait
from .errors import *  # noqa: F401,F403  (the exception classes)
from .errors import __all__ as _errors_all

__all__ = [
    "Geometry",
    "Namespace",
    "Tier",
    "Rank",
    "Lease",
    "CopyHandle",
    "SaveTicket",
    "CacheGroup",
    "HybridLayout",
    "HybridTier",
    "HybridLease",
    "hybrid_save",
    "hybrid_restore",
    "hybrid_wait",
    "cuda_available",
    "peers_available",
    "connect",
    "default_socket_path",
    "__version__",
    *_errors_all,
]
