"""The connector's settings: vLLM's ``kv_connector_extra_config`` dict, checked once at start.

Every key is optional::

    {"socket": "/run/kvtierd/kvtierd.sock",  # share a running kvtierd's pool (else: serve one)
     "pool": "8GiB",                         # in-process pool size (bytes or a size string)
     "policy": "adaptive-lfu",               # in-process pool's eviction policy
     "load": "sync",                         # "sync" (in the step that needs it) or "async"
     "layerwise": True,                      # sync restores: the forward waits layer by layer
     "layer_group_bytes": "8MiB",            # ... in groups of layers of about this many bytes
     "lease_ttl_s": 30.0,                    # a scheduler lease's longest hold
     "reconnect_s": 1.0,                     # how often a lost daemon is tried again
     "save": True, "load_enabled": True}     # turn either direction off

An unknown key or a bad value raises :class:`kvtier.ConfigError` when the engine starts, never
later.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from ..errors import ConfigError

__all__ = ["ConnectorConfig", "parse_size"]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: Any, what: str) -> int:
    """Bytes from an int or a string such as ``"8GiB"``, ``"512MiB"``, ``"4GB"`` (GB = 10^9 B,
    GiB = 2^30 B; units are case-sensitive, as kvtierd's ``--pool``).

    Raises: ``ConfigError`` for anything else, or a size under one byte.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a size in bytes or a string such as '8GiB', not {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str) and (m := _SIZE.match(value)) and m.group(2) in _UNITS:
        n = int(float(m.group(1)) * _UNITS[m.group(2)])
    else:
        raise ConfigError(
            f"{what} must be a size in bytes or a number with a unit (B, KB, MB, GB, TB, KiB, MiB, GiB, "
            f"TiB), not {value!r}"
        )
    if n < 1:
        raise ConfigError(f"{what} must be at least one byte, not {value!r}")
    return n


def _seconds(extra: Mapping[str, Any], key: str, default: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be a positive number of seconds, not {v!r}")
    return float(v)


def _flag(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    v = extra.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"kv_connector_extra_config[{key!r}] must be true or false, not {v!r}")
    return v


@dataclass(frozen=True)
class ConnectorConfig:
    """What ``kv_connector_extra_config`` asked for. ``socket`` None: the engine's first worker
    serves an in-process pool of ``pool_bytes`` bytes (policy ``policy``) on ``served_socket``,
    and the engine's other processes connect to it."""

    socket: Optional[str]
    pool_bytes: int
    policy: Optional[str]
    load_async: bool
    lease_ttl_s: float
    reconnect_s: float
    save: bool
    load: bool
    layerwise: bool = True
    #: A layer-wise restore moves its layers in groups of consecutive layers: as many groups as the
    #: restore holds this many bytes (bytes; default 8 MiB, about 160 us of PCIe Gen5), at least
    #: one and at most one per layer, the layers split evenly over them (so a group holds about
    #: this much). Each group costs a few microseconds of submission and of hand-over on the GPU
    #: (measured on an H100: 78 one-layer groups made a one-block GLM-5.2 restore 745 us against
    #: 162 in one group).
    layer_group_bytes: int = 8 << 20

    KEYS = ("socket", "pool", "policy", "load", "layerwise", "layer_group_bytes", "lease_ttl_s", "reconnect_s",
            "save", "load_enabled")

    @staticmethod
    def from_extra(extra: Optional[Mapping[str, Any]]) -> "ConnectorConfig":
        """Reads and checks ``kv_connector_extra_config`` (None: every default).

        Raises: ``ConfigError`` naming the key for an unknown key or a bad value.
        """
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(ConnectorConfig.KEYS))
        if unknown:
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {unknown} for kvtier (known: {', '.join(ConnectorConfig.KEYS)})"
            )
        socket = extra.get("socket")
        if socket is not None and (not isinstance(socket, str) or not socket):
            raise ConfigError(f"kv_connector_extra_config['socket'] must be a socket path, not {socket!r}")
        load = extra.get("load", "sync")
        if load not in ("sync", "async"):
            raise ConfigError(f"kv_connector_extra_config['load'] must be 'sync' or 'async', not {load!r}")
        policy = extra.get("policy")
        if policy is not None and not isinstance(policy, str):
            raise ConfigError(f"kv_connector_extra_config['policy'] must be a policy name, not {policy!r}")
        if socket is not None and ("pool" in extra or policy is not None):
            raise ConfigError(
                "kv_connector_extra_config: 'pool' and 'policy' size an in-process pool; with 'socket' the "
                "daemon's own --pool and --policy apply"
            )
        return ConnectorConfig(
            socket=socket,
            pool_bytes=parse_size(extra.get("pool", "4GiB"), "kv_connector_extra_config['pool']"),
            policy=policy,
            load_async=load == "async",
            lease_ttl_s=_seconds(extra, "lease_ttl_s", 30.0),
            reconnect_s=_seconds(extra, "reconnect_s", 1.0),
            save=_flag(extra, "save", True),
            load=_flag(extra, "load_enabled", True),
            layerwise=_flag(extra, "layerwise", True),
            layer_group_bytes=parse_size(extra.get("layer_group_bytes", 8 << 20),
                                         "kv_connector_extra_config['layer_group_bytes']"),
        )
