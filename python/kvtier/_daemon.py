"""What the engine connectors (``kvtier.vllm``, ``kvtier.sglang``) tell a user about ``kvtierd``."""

from __future__ import annotations

from typing import Any


def daemon_command(geometry: Any, pool: str = "8GiB") -> str:
    """The ``kvtierd`` command line whose pool (``pool``, a size string) fits ``geometry``'s
    blocks: what a connector logs at start, and puts in its error when a daemon's layout does not
    fit the engine's."""
    arenas = " ".join(f"--arena {a['name']}:{a['bytes_per_page']}" for a in geometry.arenas)
    return f"kvtierd --model {geometry.model} --page-tokens {geometry.page_tokens} {arenas} --pool {pool}"
