"""What the scheduler side tells the workers each step (plain data, picklable, no vLLM types)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List


@dataclass
class LoadSpec:
    """Restore ``keys[i]`` (base lineage keys; each worker folds its shard in) into vLLM block
    ``block_ids[i]`` for request ``req_id``."""

    req_id: str
    keys: List[bytes]
    block_ids: List[int]


@dataclass
class SaveSpec:
    """Save vLLM block ``block_ids[i]`` under ``keys[i]`` (base lineage keys, the request's
    first blocks in order) for finished request ``req_id``; vLLM keeps the blocks until the
    workers report the request in ``finished_sending``."""

    req_id: str
    keys: List[bytes]
    block_ids: List[int]


@dataclass
class StepPlan:
    """One step's loads and saves."""

    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)
