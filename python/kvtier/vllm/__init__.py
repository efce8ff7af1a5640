"""kvtier for vLLM: a KV connector that restores prefixes from kvtier's host pool and saves
finished requests' blocks to it.

Load it with vLLM's ``--kv-transfer-config``::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool": "8GiB"}}'

``import kvtier.vllm`` works without vLLM installed: the connector class (which subclasses
vLLM's) is imported on first use of ``kvtier.vllm.KvtierConnector``; the layout, key, scheduler
and worker logic it is built on (``layout``, ``keys``, ``scheduler``, ``worker``) need no vLLM.
See ``docs/vllm.md`` in the repository.
"""

from __future__ import annotations

from typing import Any

from .config import ConnectorConfig, parse_size
from .layout import UnsupportedLayoutError

__all__ = ["KvtierConnector", "ConnectorConfig", "UnsupportedLayoutError", "parse_size"]


def __getattr__(name: str) -> Any:
    if name in ("KvtierConnector", "KvtierConnectorMetadata", "KvtierWorkerMetadata"):
        from . import connector

        return getattr(connector, name)
    raise AttributeError(f"module 'kvtier.vllm' has no attribute {name!r}")
