"""The worker side of the vLLM connector, callable without vLLM.

:class:`WorkerTransfers` owns one rank of the pool over the worker's KV tensors and carries out a
step's :class:`~kvtier.vllm.plan.StepPlan`: restores before the forward that reads them, saves of
finished requests' blocks, and the completions vLLM polls (``finished_sending``,
``finished_recving``, the block ids whose restore failed). Everything here takes plain Python
data and torch tensors, so the copy logic runs and is tested where vLLM cannot be installed
(``python/tests/test_vllm_worker.py``, on a CPU and on a GPU).

Failures never reach the engine: a block that could not be restored is reported for vLLM to
recompute; a save that fails is a future miss (its request is reported finished so vLLM frees
the blocks); a lost daemon is reconnected (``PoolLink``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

from .. import _kvtier
from .._daemon import daemon_command
from .._tensors import describe
from ..errors import BackendMismatchError, ConfigError, GeometryError, KvtierError
from .config import ConnectorConfig
from .keys import shard_namespace
from .layout import ArenaSpec, UnsupportedLayoutError, arenas_of, byte_views, layer_order
from .link import PoolLink
from ._seeded import seeded
from .plan import LoadSpec, SaveSpec, StepPlan

__all__ = ["WorkerTransfers", "daemon_command"]

log = logging.getLogger("kvtier.vllm")


@dataclass
class _Load:
    req_id: str
    block_ids: List[int]
    handle: Optional[Any]  # (CopyHandle, the block ids it restores), None when nothing copies
    waited: int = -1  # the highest layer the forward has waited for (layer-wise restores)



class WorkerTransfers:
    """One worker's copies between vLLM's KV tensors and the pool.

    ``facts``: the engine facts the keys' namespace folds (``kvtier.vllm.keys``);
    ``tp_rank`` / ``tp_size``: this worker's tensor-parallel shard; ``socket``: where the pool is
    served (a kvtierd, or the in-process pool of the engine's first worker); ``serve``: True on the
    worker that makes the in-process pool (no daemon) and serves it on ``socket``.
    """

    def __init__(
        self,
        config: ConnectorConfig,
        facts: Mapping[str, Any],
        block_size: int,
        tp_rank: int,
        tp_size: int,
        socket: str,
        serve: bool,
    ):
        self.config = config
        self.block_size = block_size
        self.socket = socket
        self.serve = serve
        self.shard = shard_namespace(facts, tp_rank, tp_size)
        self.geometry: Optional[Any] = None
        self.device: Optional[int] = None
        self._views: List[Any] = []
        self._tier: Optional[Any] = None  # the in-process pool (serve=True)
        self.link: Optional[PoolLink] = None
        self._loads: Dict[str, _Load] = {}  # async restores in flight
        self._sync: List[_Load] = []  # this step's sync restores, until waited for
        self._saves: Dict[str, Any] = {}  # req_id -> (SaveTicket, blocks), or None when nothing copies
        self._finished: Set[str] = set()  # req ids vLLM has said finished, whose save may still come
        self._errors: Set[int] = set()
        self._loaded: Set[str] = set()  # sync restores done this step (worker meta)
        self._stored: Dict[str, int] = {}  # req_id -> leading blocks in the pool after its save
        # Fault injection for the connector's own tests: `restore-fails` reports every restored
        # block as failed after its copy (vLLM must recompute them and give the same tokens).
        self._fault = os.environ.get("KVTIER_VLLM_FAULT", "")
        self._layer_of: Dict[str, int] = {}  # vLLM layer name -> the geometry's layer index
        self._layers = 0  # KV layers when sync restores go layer-wise (layer_groups); 0: whole blocks
        self.stats = {
            "restored_blocks": 0, "saved_blocks": 0, "load_errors": 0, "save_errors": 0,
            "layer_waits": 0, "layers_unwaited": 0,
        }

    # ---- registration ----

    def register(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        """Takes vLLM's per-layer KV tensors (``{layer_name: tensor}``, ``num_blocks`` blocks
        each) as the arenas of one rank and opens the pool.

        Raises: ``UnsupportedLayoutError`` (a layout whose blocks cannot move whole),
        ``ConfigError`` (tensors on several devices; an in-process pool that cannot be made).
        """
        names = layer_order(list(kv_caches))
        by_layer: Dict[str, List[ArenaSpec]] = {}
        for i, name in enumerate(names):
            by_layer[name] = arenas_of(name, i, kv_caches[name], num_blocks)
        devices = {describe(kv_caches[n]).device for n in names}
        if len(devices) != 1:
            raise ConfigError(f"vLLM's KV tensors are on several devices: {sorted(devices)}")
        kind, index = devices.pop()
        if kind not in ("cpu", "cuda"):
            raise UnsupportedLayoutError(f"vLLM's KV tensors are on a {kind} device; kvtier moves CPU and CUDA memory")
        self.device = index if kind == "cuda" else None
        if kind == "cuda" and index is None:
            raise ConfigError("a CUDA KV tensor without a device index")
        specs = [s for n in names for s in by_layer[n]]
        self._views = byte_views(kv_caches, by_layer)
        arena_names = [f"L{s.layer}" + (f".{k}" if len(by_layer[n]) > 1 else "") for n in names for k, s in enumerate(by_layer[n])]
        g = _kvtier.Geometry.from_tensors(self._views, model="vllm", page_tokens=self.block_size, names=arena_names, layout="pages")
        self.geometry = g.with_layers([s.layer for s in specs])
        self._layer_of = {n: by_layer[n][0].layer for n in names}
        self._layers = len(set(self._layer_of.values())) if self.config.layerwise else 0
        log.info("kvtier: %d arenas, %d B a block; a kvtierd for this layout: %s", len(specs), self.geometry.block_bytes,
                 daemon_command(self.geometry))
        if self.serve:
            c = self.config
            self._tier = _kvtier.Tier(
                self.geometry, c.pool_bytes, c.policy, backing="auto", lease_ttl_s=c.lease_ttl_s, serve=self.socket
            )
            log.info("kvtier: serving a %d-block pool (%d B a block) on %s", self._tier.capacity, self.geometry.slot_bytes, self.socket)
            self.link = PoolLink(f"the pool at {self.socket}", lambda: self._attach(self._tier), self.config.reconnect_s)
        else:
            self.link = PoolLink(f"the pool at {self.socket}", self._connect, self.config.reconnect_s)
        self.link.get()

    def _connect(self) -> Tuple[Any, Any]:
        tier = _kvtier.connect(self.socket)
        return self._attach(tier)

    def _attach(self, tier: Any) -> Tuple[Any, Any]:
        try:
            if self.device is None:
                rank = tier.attach_host(self._views, layout="pages")
            else:
                rank = tier.attach_cuda(self.device, self._views, layout="pages")
        except (BackendMismatchError, GeometryError) as e:
            raise ConfigError(
                f"the pool at {self.socket} holds blocks of another layout ({e}); start kvtierd for this engine with: "
                f"{daemon_command(self.geometry)}"
            ) from e
        return tier, rank

    # ---- a step ----

    def start(self, plan: StepPlan, stream: Any = None) -> None:
        """Starts the plan's restores (``stream``: the CUDA stream the forward runs on, whose
        queued work the restores wait for; None on a CPU). Sync restores move layer by layer
        (unless ``layerwise`` is off), in groups of consecutive layers of about
        ``layer_group_bytes`` of the restore each (:meth:`layer_groups`): the forward waits for
        each group's pages in :meth:`wait_layer` before its first layer's attention, so later
        layers cross the link under the compute of earlier ones; :meth:`wait_loads` then waits for whatever is
        left and reports the step's failures. Async restores move whole and are polled by
        :meth:`finished`."""
        for spec in plan.loads:
            layerwise = self._layers > 0 and not self.config.load_async
            load = _Load(spec.req_id, list(spec.block_ids), self._restore(spec, stream, layerwise))
            if self.config.load_async:
                self._loads[spec.req_id] = load
            else:
                self._sync.append(load)

    def wait_layer(self, layer_name: str, stream: Any = None) -> None:
        """Makes this step's sync restores of layer ``layer_name`` (vLLM's layer name) visible
        to the forward: on a CUDA rank ``stream`` waits for that layer's pages (no host sync),
        on a CPU rank this thread does. A name that is not one of the registered KV layers is
        ignored. A failed copy is reported for vLLM to recompute (its blocks' tokens of this
        step are thrown away by vLLM), never raised."""
        layer = self._layer_of.get(layer_name)
        if layer is None:
            return
        for load in self._sync:
            if load.handle is None or load.waited >= layer:
                continue
            handle, blocks = load.handle
            load.waited = layer
            try:
                # On a host rank the stream argument is unused and the thread waits.
                handle.wait_layer(layer, stream if stream is not None and self.device is not None else 0)
                self.stats["layer_waits"] += 1
                # The wait covers the layer's whole group: its later layers need none.
                end = handle.layer_group_end(layer)
                load.waited = self._layers - 1 if end is None else end - 1
                # Seeded bug (tests only): the wait is taken to cover the next group's first layer.
                if seeded("vllm-group-wait-covers-next") and end is not None:
                    load.waited = end
            except KvtierError as e:
                self._fail(blocks, str(e))
                load.handle = None

    def _restore(self, spec: LoadSpec, stream: Any, layerwise: bool = False) -> Optional[Any]:
        pool = self.link.get() if self.link else None
        if pool is None or not self.config.load:
            self._fail(spec.block_ids, "no pool")
            return None
        tier, rank = pool
        try:
            keys = self.shard.keys(spec.keys)
            # The lease's one use goes to the restore, which keeps its own pins; the lease is then
            # dropped, not released: on a daemon that is a one-way message, not a round trip.
            lease = tier.query(keys)
            n = len(lease)
            if n < len(keys):
                self._fail(spec.block_ids[n:], f"{len(keys) - n} of {len(keys)} blocks no longer in the pool")
            if n == 0:
                return None
            pages = spec.block_ids[:n]
            # Seeded bug (tests only): the last block of a hit is never restored, unreported.
            if seeded("vllm-restore-drops-last") and n > 1:
                pages = pages[:-1]
            if layerwise:
                handle = rank.restore_layers(lease, pages, self.layer_groups(n), after_stream=stream)
            else:
                handle = rank.restore(lease, pages, after_stream=stream)
            del lease
            self.stats["restored_blocks"] += n
            return (handle, spec.block_ids[:n])
        except KvtierError as e:
            self.link.failed(e)
            self._fail(spec.block_ids, str(e))
            return None

    def layer_groups(self, blocks: int) -> int:
        """Layer groups of a layer-wise restore of ``blocks`` blocks: as many as the restore has
        ``layer_group_bytes`` in it, at least one, at most one per layer (kvtier splits the layers
        evenly over them: group ``g`` of ``G`` holds layers ``g * L // G`` to ``(g + 1) * L // G``)."""
        per = self.config.layer_group_bytes
        return max(1, min(self._layers, blocks * self.geometry.block_bytes // per))

    def wait_loads(self, stream: Any = None) -> None:
        """Makes this step's sync restores visible to the forward: on a CUDA rank the stream
        waits for them (no host sync); on a CPU rank this thread does. Called after the forward
        of a layer-wise step, it finds every layer waited for; a layer-wise restore that reaches
        it with layers the forward never waited for is counted in ``layers_unwaited`` (and logged
        once): the engine did not call ``wait_for_layer_load`` for them."""
        for load in self._sync:
            if load.handle is not None:
                handle, blocks = load.handle
                if self._layers and load.waited < self._layers - 1:
                    missed = self._layers - 1 - load.waited
                    if not self.stats["layers_unwaited"]:
                        log.warning("kvtier: the forward read %d layer(s) of a restore without waiting for them", missed)
                    self.stats["layers_unwaited"] += missed
                try:
                    if stream is not None and self.device is not None:
                        handle.stream_wait(stream)
                    else:
                        handle.wait()
                    if self._fault == "restore-fails":
                        self._fail(blocks, "injected by KVTIER_VLLM_FAULT")
                except KvtierError as e:
                    self._fail(blocks, str(e))
            self._loaded.add(load.req_id)
        self._sync.clear()

    def save(self, plan: StepPlan, stream: Any = None) -> None:
        """Starts the plan's saves (after ``stream``'s queued work on a CUDA rank)."""
        for spec in plan.saves:
            self._saves[spec.req_id] = self._save(spec, stream)

    def _save(self, spec: SaveSpec, stream: Any) -> Optional[Any]:
        pool = self.link.get() if self.link else None
        if pool is None or not self.config.save or not spec.keys:
            return None
        tier, rank = pool
        try:
            ticket = rank.save(self.shard.keys(spec.keys), spec.block_ids, after_stream=stream, fit="prefix", prefix_depth=0)
            self.stats["saved_blocks"] += len(ticket.saving)
            return (ticket, len(spec.keys))
        except KvtierError as e:
            self.link.failed(e)
            self.stats["save_errors"] += 1
            log.debug("kvtier: save of %s skipped: %s", spec.req_id, e)
            return None

    def finished(self, finished_req_ids: Sequence[str]) -> Tuple[Set[str], Set[str]]:
        """(requests whose saves are over, requests whose async restores are over), each
        reported once. A save is over when its copy landed or failed; a request is reported only
        once vLLM named it finished (this call or an earlier one)."""
        # vLLM may name a request finished before its save is registered (speculative decoding
        # finalizes after get_finished): keep the name one more call, then forget it.
        stale = self._finished - set(self._saves)
        self._finished = (self._finished - stale) | set(finished_req_ids)
        sending = set()
        for req_id in list(self._saves):
            if req_id not in self._finished:
                continue
            save = self._saves[req_id]
            stored = 0
            if save is not None:
                ticket, blocks = save
                try:
                    if not ticket.done():
                        continue
                    ticket.wait(0)
                    stored = blocks - ticket.dropped
                except KvtierError as e:
                    self.link.failed(e)
                    self.stats["save_errors"] += 1
                    log.debug("kvtier: save of %s failed: %s", req_id, e)
            self._stored[req_id] = stored
            del self._saves[req_id]
            self._finished.discard(req_id)
            sending.add(req_id)
        recving = set()
        for req_id, load in list(self._loads.items()):
            if load.handle is not None:
                handle, blocks = load.handle
                try:
                    if not handle.done():
                        continue
                    handle.wait(0)
                    if self._fault == "restore-fails":
                        self._fail(blocks, "injected by KVTIER_VLLM_FAULT")
                except KvtierError as e:
                    self._fail(blocks, str(e))
            del self._loads[req_id]
            recving.add(req_id)
        return sending, recving

    def take_errors(self) -> Set[int]:
        """Block ids whose restore failed since the last call (vLLM recomputes them)."""
        errors, self._errors = self._errors, set()
        return errors

    def take_stored(self) -> Dict[str, int]:
        """For each request whose save ended since the last call: how many of its leading blocks
        the pool holds now (0 for a save that failed or never started)."""
        stored, self._stored = self._stored, {}
        return stored

    def take_loaded(self) -> Set[str]:
        """Requests whose sync restores this worker finished since the last call."""
        loaded, self._loaded = self._loaded, set()
        return loaded

    def _fail(self, block_ids: Sequence[int], why: str) -> None:
        if block_ids:
            self._errors.update(block_ids)
            self.stats["load_errors"] += len(block_ids)
            log.debug("kvtier: %d blocks not restored (vLLM recomputes them): %s", len(block_ids), why)

    def close(self, timeout: float = 30.0) -> None:
        """Waits for the copies in flight (at most ``timeout`` s), then closes the rank."""
        pool = self.link.get() if self.link else None
        if pool is not None:
            try:
                pool[1].close(timeout)
            except KvtierError as e:
                log.warning("kvtier: closing the rank: %s", e)
        if self.link:
            self.link.close()
