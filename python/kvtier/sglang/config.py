"""The backend's settings: SGLang's ``--hicache-storage-backend-extra-config`` dict, checked once
when SGLang makes the backend.

SGLang's own keys of that dict (``backend_name``, ``module_path``, ``class_name``,
``interface_v1``, ``tp_lcm_size``, ``prefetch_threshold``, ``prefetch_timeout_base``,
``prefetch_timeout_per_ki_token``, ``hicache_storage_pass_prefix_keys``) are read by SGLang and
ignored here. Every kvtier key is
optional::

    {"socket": "/run/kvtierd/kvtierd.sock",   # share a running kvtierd's pool (else: in-process)
     "pool": "8GiB",                          # in-process pool size (bytes or a size string)
     "policy": "adaptive-lfu",                # in-process pool's eviction policy
     "lease_ttl_s": 30.0,                     # a lease's longest hold (in-process pool)
     "ssd_path": "/nvme/kvtier.ssd",          # an SSD tier under the in-process pool ...
     "ssd_bytes": "64GiB",                    # ... of this many bytes
     "ssd_admit_uses": 2,                     # a page goes to the SSD at its Nth use (save = 1; default: auto)
     "peers": ["10.0.0.2:7400"],              # read misses from these instances' pools (NIXL)
     "peer_listen": "0.0.0.0:7400",           # serve this pool to peers
     "peer_secret_file": "/etc/kvtier/peer.secret",
     "staging_pages": 16}                     # pages staged at a time by get/set (non-v1 calls)

An unknown key or a bad value raises :class:`kvtier.ConfigError` when SGLang makes the backend,
never later.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional, Tuple

from ..errors import ConfigError
from ..vllm.config import parse_size

__all__ = ["StoreConfig", "SGLANG_KEYS"]

#: Keys of the extra-config dict that SGLang itself reads (the dynamic loader's and HiCache's; some
#: paths of SGLang remove theirs before the backend sees the dict, others leave them).
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys")

_WHAT = "hicache-storage-backend-extra-config"


def _str(extra: Mapping[str, Any], key: str) -> Optional[str]:
    v = extra.get(key)
    if v is not None and (not isinstance(v, str) or not v):
        raise ConfigError(f"{_WHAT}[{key!r}] must be a non-empty string, not {v!r}")
    return v


@dataclass(frozen=True)
class StoreConfig:
    """What the extra config asked for. ``socket`` None: this SGLang process makes its own pool of
    ``pool_bytes`` bytes (with an SSD tier of ``ssd`` = (path, bytes) and peers if asked)."""

    socket: Optional[str]
    pool_bytes: int
    policy: Optional[str]
    lease_ttl_s: Optional[float]
    ssd: Optional[Tuple[str, int]]
    ssd_admit_uses: Optional[int]
    peers: Optional[Tuple[str, ...]]
    peer_listen: Optional[str]
    peer_secret_file: Optional[str]
    staging_pages: int

    KEYS = ("socket", "pool", "policy", "lease_ttl_s", "ssd_path", "ssd_bytes", "ssd_admit_uses", "peers",
            "peer_listen", "peer_secret_file", "staging_pages")

    @staticmethod
    def from_extra(extra: Optional[Mapping[str, Any]]) -> "StoreConfig":
        """Reads and checks the extra config (None: every default).

        Raises: ``ConfigError`` naming the key for an unknown key or a bad value.
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(StoreConfig.KEYS) - set(SGLANG_KEYS))
        if unknown:
            raise ConfigError(f"unknown {_WHAT} key(s) {unknown} for kvtier (known: {', '.join(StoreConfig.KEYS)})")
        socket = _str(extra, "socket")
        policy = _str(extra, "policy")
        own_pool = [k for k in ("pool", "policy", "lease_ttl_s", "ssd_path", "ssd_bytes", "ssd_admit_uses", "peers",
                                "peer_listen", "peer_secret_file") if k in extra]
        if socket is not None and own_pool:
            raise ConfigError(
                f"{_WHAT}: {own_pool} configure an in-process pool; with 'socket' the daemon's own options "
                "(kvtierd --pool, --policy, --ssd, --peer, ...) apply"
            )
        ttl = extra.get("lease_ttl_s")
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or ttl <= 0):
            raise ConfigError(f"{_WHAT}['lease_ttl_s'] must be a positive number of seconds, not {ttl!r}")
        ssd_path = _str(extra, "ssd_path")
        if (ssd_path is None) != ("ssd_bytes" not in extra):
            raise ConfigError(f"{_WHAT}: 'ssd_path' and 'ssd_bytes' go together (an SSD tier file and its size)")
        ssd = (ssd_path, parse_size(extra["ssd_bytes"], f"{_WHAT}['ssd_bytes']")) if ssd_path else None
        admit = extra.get("ssd_admit_uses")
        if admit is not None and (isinstance(admit, bool) or not isinstance(admit, int) or admit < 1 or not ssd):
            raise ConfigError(f"{_WHAT}['ssd_admit_uses'] must be a positive integer, with 'ssd_path', not {admit!r}")
        peers = extra.get("peers")
        if peers is not None:
            if isinstance(peers, str) or not all(isinstance(p, str) and p for p in peers):
                raise ConfigError(f"{_WHAT}['peers'] must be a list of 'host:port' strings, not {peers!r}")
            peers = tuple(peers)
        staging = extra.get("staging_pages", 16)
        if isinstance(staging, bool) or not isinstance(staging, int) or not 1 <= staging <= 4096:
            raise ConfigError(f"{_WHAT}['staging_pages'] must be an integer from 1 to 4096, not {staging!r}")
        return StoreConfig(
            socket=socket,
            pool_bytes=parse_size(extra.get("pool", "4GiB"), f"{_WHAT}['pool']"),
            policy=policy,
            lease_ttl_s=None if ttl is None else float(ttl),
            ssd=ssd,
            ssd_admit_uses=admit,
            peers=peers,
            peer_listen=_str(extra, "peer_listen"),
            peer_secret_file=_str(extra, "peer_secret_file"),
            staging_pages=staging,
        )
