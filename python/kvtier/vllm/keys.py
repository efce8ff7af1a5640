"""Content keys for vLLM blocks.

A key names a block's whole prefix: the lineage hash of the block's token ids chained to the key
of the block before it (``Namespace.chain``), so equal keys mean equal prefixes. kvtier hashes the
token ids itself rather than reusing vLLM's block hashes: those depend on the engine's
``prefix_caching_hash_algo`` (the non-cryptographic ones are seeded randomly per engine process
unless ``PYTHONHASHSEED`` is set), while engines that share a pool (data-parallel ranks, a prefill
and a decode instance, restarts, other vLLM versions) must agree on every key.

The namespace folds everything that makes two engines' blocks interchangeable: the model and its
revision, the dtypes, the block size, the platform, vLLM's KV layout, the per-layer page bytes,
and the tensor-parallel shard. A request's LoRA adapter and ``cache_salt`` seed the first block's
parent, so they partition the keys too. The scheduler and the workers compute the same keys from
the same facts without talking to each other.
"""

from __future__ import annotations

import json
from typing import Any, List, Mapping, Optional, Sequence

from .._kvtier import Namespace

__all__ = ["FORMAT", "base_namespace", "shard_namespace", "RequestKeys"]

#: Bumped when the key derivation changes, so old pools never hit.
FORMAT = "kvtier.vllm/1"


def _describe(facts: Mapping[str, Any], **more: Any) -> bytes:
    return json.dumps({"format": FORMAT, **facts, **more}, sort_keys=True, default=str).encode()


def base_namespace(facts: Mapping[str, Any]) -> Namespace:
    """The namespace of the lineage chain (the engine's facts, no shard)."""
    return Namespace.from_description(_describe(facts))


def shard_namespace(facts: Mapping[str, Any], tp_rank: int, tp_size: int) -> Namespace:
    """The namespace a tensor-parallel shard's keys are folded with: shard ``tp_rank`` of
    ``tp_size`` stores its own slice of each block under ``shard.keys(base_keys)``."""
    return Namespace.from_description(_describe(facts, tp=[int(tp_rank), int(tp_size)]))


class RequestKeys:
    """The lineage keys of one request's full blocks, extended as its tokens grow.

    ``salt``: the request's LoRA adapter and ``cache_salt`` (bytes; empty for none).
    """

    __slots__ = ("_ns", "_block_size", "_parent", "keys")

    def __init__(self, ns: Namespace, block_size: int, salt: bytes = b""):
        self._ns = ns
        self._block_size = block_size
        self._parent: Optional[bytes] = ns.key(b"salt:" + salt) if salt else None
        self.keys: List[bytes] = []

    def upto(self, token_ids: Sequence[int], blocks: int) -> List[bytes]:
        """The keys of the first ``blocks`` full blocks of ``token_ids`` (which must hold them)."""
        bs = self._block_size
        while len(self.keys) < blocks:
            i = len(self.keys)
            parent = self.keys[-1] if self.keys else self._parent
            self.keys.append(self._ns.chain(parent, list(token_ids[i * bs : (i + 1) * bs])))
        return self.keys[:blocks]
