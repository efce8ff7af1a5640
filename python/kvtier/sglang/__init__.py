"""kvtier under SGLang's hierarchical cache (HiCache) as its L3 storage backend.

SGLang loads :class:`KvtierStore` with no change to SGLang (``sglang`` stays an optional
dependency of kvtier: this package imports and works without it)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic --hicache-storage-backend-extra-config \\
        '{"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore", "interface_v1": 1}'

See ``docs/sglang.md`` in the repository: the settings (:mod:`kvtier.sglang.config`), the keys
(:mod:`kvtier.sglang.keys`), the host pool layouts (:mod:`kvtier.sglang.layout`).
"""

from .config import StoreConfig
from .keys import FORMAT
from .layout import LAYOUTS, HostArenas, UnsupportedHostLayoutError, host_arenas
from .store import SGLANG, KvtierStore, StoreError

__all__ = ["KvtierStore", "StoreConfig", "StoreError", "UnsupportedHostLayoutError", "HostArenas", "host_arenas",
           "LAYOUTS", "FORMAT", "SGLANG"]
