"""Content keys for SGLang's HiCache pages.

HiCache names each page by a string hash that already chains the whole prefix (each page's hash
folds the hash of the page before it), so kvtier keys a page by that string alone:
``namespace.key(hash.encode())``. The namespace folds everything that makes two SGLang processes'
pages interchangeable, so a page of another model, layout, dtype, page size or parallel shard never
hits:

- the model name SGLang reports (``HiCacheStorageConfig.model_name``), the host pool's layout
  (``layer_first`` / ``page_first`` / ``page_first_direct``), MHA or MLA, the dtype, the page size
  in tokens, the bytes of each arena's page and the arena count;
- the parallel shard: pipeline stage (``pp_rank``/``pp_size``), attention context-parallel rank,
  decode-context-parallel rank and the logical page size under DCP, and the tensor-parallel rank
  (``tp_rank``/``tp_size``) for MHA. MLA's latent cache is the same on every TP rank, so MLA
  leaves the TP rank out: one copy serves every TP rank (SGLang writes it from one rank only,
  ``HiCacheStorageConfig.is_storage_writer``, as its Mooncake and file backends do).

``dp_rank`` (data-parallel attention) is left out: DP groups hold the same heads, so they share.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Sequence

from .._kvtier import Namespace
from ..errors import ConfigError
from .layout import HostArenas

__all__ = ["FORMAT", "facts", "namespace", "page_keys"]

#: Bumped when the key derivation changes, so old pools never hit.
FORMAT = "kvtier.sglang/1"


def facts(storage_config: Any, arenas: HostArenas) -> Dict[str, Any]:
    """The facts the namespace folds, from SGLang's ``HiCacheStorageConfig`` and the host pool."""
    def get(name: str, default: Any = None) -> Any:
        return getattr(storage_config, name, default)

    mla = bool(get("is_mla_model", False))
    if mla != (arenas.kind == "mla"):
        raise ConfigError(
            f"SGLang says is_mla_model={mla} but its host pool is laid out as {arenas.kind.upper()} "
            f"({arenas.pool_layout})"
        )
    out: Dict[str, Any] = {
        "format": FORMAT,
        "model": get("model_name") or "",
        "kind": arenas.kind,
        "layout": arenas.pool_layout,
        "dtype": arenas.dtype,
        "page_tokens": arenas.page_tokens,
        "arenas": len(arenas.views),
        "block_bytes": arenas.block_bytes,
        "pp": [int(get("pp_rank", 0)), int(get("pp_size", 1))],
        "cp": [int(get("attn_cp_rank", 0)), int(get("attn_cp_size", 1))],
    }
    if int(get("dcp_size", 1) or 1) > 1:
        out["dcp"] = [int(get("dcp_rank", 0)), int(get("dcp_size", 1)), get("logical_page_size")]
    if not mla:
        out["tp"] = [int(get("tp_rank", 0)), int(get("tp_size", 1))]
    else:
        out["tp_size"] = int(get("tp_size", 1)) if int(get("dcp_size", 1) or 1) > 1 else None
    return out


def namespace(fact: Dict[str, Any]) -> Namespace:
    """The namespace of one SGLang shard's pages."""
    return Namespace.from_description(json.dumps(fact, sort_keys=True, default=str).encode())


def page_keys(ns: Namespace, hashes: Sequence[str]) -> List[bytes]:
    """The 16-byte kvtier key of each SGLang page hash (a string).

    Raises: ``ConfigError`` for a hash that is not a non-empty string.
    """
    raw = []
    for h in hashes:
        if not isinstance(h, str) or not h:
            raise ConfigError(f"an SGLang page hash must be a non-empty string, not {h!r}")
        raw.append(h.encode())
    return ns.keys(raw)
