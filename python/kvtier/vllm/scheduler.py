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

__all__ = ["SchedulerPlanner", "MISS_HOLD_S"]

#: How long a miss answered for a waiting request stands (seconds): vLLM asks again every step
#: for a request it cannot admit yet, and a waiting request's blocks saved meanwhile by another
#: engine are found at most this late (the tier is a cache: a late hit is only a lost hit).
MISS_HOLD_S = 0.5

log = logging.getLogger("kvtier.vllm")


@dataclass
class _Hit:
    leases: List[Any]  # one per shard; pins the blocks
    start: int  # first block to load (vLLM's own prefix cache holds the blocks before it)
    keys: List[bytes]  # base keys of the blocks to load
    since: float
    end: int = 0  # the block the query stopped before (the request's last token's block)


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
        self._misses: Dict[str, Tuple[int, int, float]] = {}  # answered 0: (start, end, when)
        self._loading: Dict[str, _Hit] = {}  # restore ordered, not yet reported over
        self._plan = StepPlan()
        self._saving: Set[str] = set()
        self.stats = {
            "queries": 0, "answers_reused": 0, "hit_blocks": 0, "load_orders": 0, "save_orders": 0, "saved_requests": 0,
        }

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
        Side-effect free towards vLLM: called again, it answers again.

        vLLM asks again every step for a request it could not admit (no free blocks): while the
        pins of the last answer are held (younger than ``lease_ttl_s``) and the request's range
        is unchanged, that answer stands and the pool is not asked again (no round trip, no
        re-pinning); the hit is still pinned, so it is still true."""
        bs = self.block_size
        start, end = num_computed // bs, (len(token_ids) - 1) // bs
        held = self._hits.get(req_id)
        if (
            held is not None
            and self.config.load
            and not multimodal
            and ((held.start, held.end) == (start, end) or seeded("vllm-answer-reused-across-ranges"))
            and time.monotonic() - held.since <= self.config.lease_ttl_s / 2
        ):
            self.stats["answers_reused"] += 1
            return len(held.keys) * bs
        missed = self._misses.get(req_id)
        if missed is not None and missed[:2] == (start, end) and time.monotonic() - missed[2] <= MISS_HOLD_S:
            self.stats["answers_reused"] += 1
            return 0
        self._release_hit(req_id)
        if not self.config.load or multimodal:
            return 0
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
            self._misses[req_id] = (start, end, time.monotonic())
            return 0
        self._misses.pop(req_id, None)
        self._hits[req_id] = _Hit(leases, start, keys[:n], time.monotonic(), end)
        self.stats["hit_blocks"] += n
        return n * bs

    def allocated(self, req_id: str, block_ids: Sequence[int], num_external: int) -> None:
        """vLLM allocated ``block_ids`` (all of the request's blocks) and will take
        ``num_external`` tokens from the tier: order their restore."""
        self._misses.pop(req_id, None)
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
        self._misses.pop(req_id, None)
        hit = self._hits.pop(req_id, None)
        if hit is not None:
            _release(hit.leases)

    def close(self) -> None:
        for hit in list(self._hits.values()) + list(self._loading.values()):
            _release(hit.leases)
        self._hits.clear()
        self._misses.clear()
        self._loading.clear()
        self.link.close()


def _release(leases: List[Any]) -> None:
    for lease in leases:
        try:
            lease.release()
        except KvtierError:
            pass
