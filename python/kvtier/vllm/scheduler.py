"""The scheduler side of the vLLM connector, callable without vLLM.

:class:`SchedulerPlanner` answers vLLM's "how many of this request's tokens can the tier give"
by querying the pool for the request's keys (one lease per tensor-parallel shard, which pins the
blocks until the workers have restored them), turns the blocks vLLM allocates into restore
orders, and turns finished requests into save orders. The workers carry them out
(:mod:`kvtier.vllm.worker`).

What it guarantees: a hit it reports is pinned in the pool (every shard's blocks) until the
workers report the restore over, or ``lease_ttl_s`` passed; a hit never covers the request's
last token (vLLM must compute at least one); a request with multimodal inputs is neither loaded
nor saved (its blocks depend on more than its token ids).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .. import _kvtier
from ..errors import KvtierError
from .config import ConnectorConfig
from .keys import RequestKeys, base_namespace, shard_namespace
from .link import PoolLink
from ._seeded import seeded
from .plan import LoadSpec, SaveSpec, StepPlan

__all__ = ["SchedulerPlanner"]

log = logging.getLogger("kvtier.vllm")


@dataclass
class _Hit:
    leases: List[Any]  # one per shard; pins the blocks
    start: int  # first block to load (vLLM's own prefix cache holds the blocks before it)
    keys: List[bytes]  # base keys of the blocks to load
    since: float


class SchedulerPlanner:
    """The scheduler's view of the pool at ``socket`` for an engine of ``tp_size`` shards."""

    def __init__(self, config: ConnectorConfig, facts: Mapping[str, Any], block_size: int, tp_size: int, socket: str):
        self.config = config
        self.block_size = block_size
        self.socket = socket
        self.base = base_namespace(facts)
        self.shards = [shard_namespace(facts, r, tp_size) for r in range(tp_size)]
        self.link = PoolLink(f"the pool at {socket}", lambda: _kvtier.connect(socket), config.reconnect_s)
        self._keys: Dict[str, RequestKeys] = {}
        self._hits: Dict[str, _Hit] = {}  # answered, not yet allocated
        self._loading: Dict[str, _Hit] = {}  # restore ordered, not yet reported over
        self._plan = StepPlan()
        self._saving: Set[str] = set()
        self.stats = {"queries": 0, "hit_blocks": 0, "load_orders": 0, "save_orders": 0, "saved_requests": 0}

    def _request_keys(self, req_id: str, salt: bytes) -> RequestKeys:
        keys = self._keys.get(req_id)
        if keys is None:
            keys = self._keys[req_id] = RequestKeys(self.base, self.block_size, salt)
        return keys

    def match(
        self, req_id: str, token_ids: Sequence[int], num_computed: int, salt: bytes = b"", multimodal: bool = False
    ) -> int:
        """Tokens past ``num_computed`` (a whole number of blocks: vLLM's own prefix hit) that
        the pool can restore for this request: the longest run of blocks every shard holds,
        never the request's last token. Pins them until :meth:`allocated` (or the lease's TTL).
        Side-effect free towards vLLM: called again, it answers again."""
        self._release_hit(req_id)
        if not self.config.load or multimodal:
            return 0
        bs = self.block_size
        start, end = num_computed // bs, (len(token_ids) - 1) // bs
        if end <= start:
            return 0
        tier = self.link.get()
        if tier is None:
            return 0
        keys = self._request_keys(req_id, salt).upto(token_ids, end)[start:]
        leases: List[Any] = []
        try:
            n = len(keys)
            for shard in self.shards:
                lease = tier.query(shard.keys(keys[:n]))
                leases.append(lease)
                n = min(n, len(lease))
                if n == 0:
                    break
        except KvtierError as e:
            self.link.failed(e)
            n = 0
        self.stats["queries"] += 1
        if n == 0:
            _release(leases)
            return 0
        self._hits[req_id] = _Hit(leases, start, keys[:n], time.monotonic())
        self.stats["hit_blocks"] += n
        return n * bs

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) and will take
        ``num_external`` tokens from the tier: order their restore."""
        hit = self._hits.pop(req_id, None)
        if hit is None:
            return
        n = num_external // self.block_size
        if n == 0:
            _release(hit.leases)
            return
        hit.keys = hit.keys[:n]
        self._plan.loads.append(LoadSpec(req_id, hit.keys, list(block_ids[hit.start : hit.start + n])))
        old = self._loading.pop(req_id, None)
        if old is not None:
            _release(old.leases)
        self._loading[req_id] = hit
        self.stats["load_orders"] += 1

    def finished(
        self, req_id: str, token_ids: Sequence[int], num_computed: int, block_ids: Sequence[int], salt: bytes = b"",
        multimodal: bool = False,
    ) -> int:
        """The request ended with ``block_ids`` holding its first ``num_computed`` tokens' KV.
        Orders the save of its full blocks and returns how many (vLLM must keep the blocks until
        the workers report the save over when that is not 0)."""
        self._release_hit(req_id)
        keys = self._keys.pop(req_id, None)
        if not self.config.save or multimodal:
            return 0
        n = min(num_computed // self.block_size, len(block_ids), max(0, len(token_ids)) // self.block_size)
        # vLLM's null block (id 0) stands for a block it no longer holds: save only before it.
        n = next((i for i, b in enumerate(block_ids[:n]) if b == 0), n)
        if n == 0 or self.link.get() is None:
            return 0
        keys = keys or RequestKeys(self.base, self.block_size, salt)
        blocks = list(block_ids[:n])
        # Seeded bug (tests only): each key saved with the next block's bytes.
        if seeded("vllm-save-keys-shifted") and n > 1:
            blocks = blocks[1:] + blocks[:1]
        self._plan.saves.append(SaveSpec(req_id, keys.upto(token_ids, n), blocks))
        self._saving.add(req_id)
        self.stats["save_orders"] += 1
        return n

    def take_plan(self) -> StepPlan:
        """This step's orders (and the end of any lease held past ``lease_ttl_s``)."""
        plan, self._plan = self._plan, StepPlan()
        now = time.monotonic()
        for table in (self._hits, self._loading):
            for req_id, hit in list(table.items()):
                if now - hit.since > self.config.lease_ttl_s:
                    _release(table.pop(req_id).leases)
        return plan

    def loading(self, req_id: str) -> bool:
        """A restore of this request was ordered and is not reported over."""
        return req_id in self._loading

    def loaded(self, req_ids: Set[str]) -> None:
        """The workers' restores of these requests are over: their leases go."""
        for req_id in req_ids:
            hit = self._loading.pop(req_id, None)
            if hit is not None:
                _release(hit.leases)

    def saved(self, req_ids: Set[str]) -> None:
        """The workers' saves of these requests are over."""
        for req_id in req_ids:
            if req_id in self._saving:
                self._saving.discard(req_id)
                self.stats["saved_requests"] += 1

    def forget(self, req_id: str) -> None:
        self._release_hit(req_id)
        self._keys.pop(req_id, None)

    def _release_hit(self, req_id: str) -> None:
        hit = self._hits.pop(req_id, None)
        if hit is not None:
            _release(hit.leases)

    def close(self) -> None:
        for hit in list(self._hits.values()) + list(self._loading.values()):
            _release(hit.leases)
        self._hits.clear()
        self._loading.clear()
        self.link.close()


def _release(leases: List[Any]) -> None:
    for lease in leases:
        try:
            lease.release()
        except KvtierError:
            pass
