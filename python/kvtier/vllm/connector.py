"""``KvtierConnector``: kvtier as a vLLM v1 KV connector (imports vLLM; loaded by vLLM).

The two halves live in vLLM's two processes: the scheduler side (EngineCore) decides which
blocks come from the pool and which are saved to it (:class:`~kvtier.vllm.scheduler.SchedulerPlanner`),
the worker side moves the bytes (:class:`~kvtier.vllm.worker.WorkerTransfers`). Both reach one
pool: a running ``kvtierd`` (``"socket"`` in ``kv_connector_extra_config``), shared by every
engine on the host, or without one an in-process pool that the engine's first worker makes and
serves on a private socket for its own scheduler and other workers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Optional, Set

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from .. import _kvtier
from ..errors import ConfigError
from .config import ConnectorConfig
from .plan import StepPlan
from .scheduler import SchedulerPlanner
from .worker import WorkerTransfers

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["KvtierConnector", "KvtierConnectorMetadata", "KvtierWorkerMetadata", "engine_facts"]

log = logging.getLogger("kvtier.vllm")


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    """One step's restore and save orders, scheduler -> workers."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler: the requests whose sync restores are over (their leases can go), and
    for each request whose save ended, how many leading blocks the pool holds (one report per
    worker; the scheduler takes the smallest of its tensor-parallel workers')."""

    loaded: Set[str] = field(default_factory=set)
    stored: Dict[str, List[int]] = field(default_factory=dict)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KvtierWorkerMetadata":
        if isinstance(other, KvtierWorkerMetadata):
            stored = {k: list(v) for k, v in self.stored.items()}
            for k, v in other.stored.items():
                stored.setdefault(k, []).extend(v)
            return KvtierWorkerMetadata(self.loaded | other.loaded, stored)
        return self


def engine_facts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig") -> Dict[str, Any]:
    """What makes two engines' blocks interchangeable (folded into every key's namespace).

    Raises: ``ConfigError`` for what the connector does not support yet (several KV cache groups
    of a hybrid model, pipeline parallelism).
    """
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ConfigError(
            f"kvtier's vLLM connector supports one KV cache group; this model has {len(groups)} (a hybrid model: "
            "sliding-window or state layers beside full attention)"
        )
    pc = vllm_config.parallel_config
    for what, size in (
        ("pipeline parallelism", pc.pipeline_parallel_size),
        ("decode context parallelism", getattr(pc, "decode_context_parallel_size", 1)),
        ("prefill context parallelism", getattr(pc, "prefill_context_parallel_size", 1)),
    ):
        if size != 1:
            raise ConfigError(f"kvtier's vLLM connector does not support {what} yet (size {size})")
    spec = groups[0].kv_cache_spec
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    # Only full attention keeps every block of a prefix: a sliding window's or a state layer's
    # "blocks" are not a prefix's KV (vLLM frees them or holds per-request state).
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec):
        raise ConfigError(
            f"kvtier's vLLM connector supports full attention and MLA KV caches, not {type(spec).__name__}"
        )
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    from vllm.platforms import current_platform

    layout = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(cc, "kv_cache_layout", None)
    if layout is None:
        raise ConfigError("vLLM resolved no KV cache layout (kv_cache_layout) before the connector started")
    hf = getattr(mc, "hf_config", None)
    hf_json = hf.to_json_string(use_diff=False) if hf is not None and hasattr(hf, "to_json_string") else repr(hf)
    return {
        "model": str(mc.model),
        "revision": str(getattr(mc, "revision", None)),
        "hf_config": hashlib.sha256(hf_json.encode()).hexdigest(),
        "quantization": str(getattr(mc, "quantization", None)),
        "dtype": str(mc.dtype),
        "cache_dtype": str(cc.cache_dtype),
        "kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
        "block_size": int(spec.block_size),
        "spec": type(spec).__name__,
        "page_bytes": int(spec.page_size_bytes),
        "layers": len(groups[0].layer_names),
        "platform": str(current_platform.device_type),
        "layout": str(layout),
    }


def _socket_path(config: ConnectorConfig, vllm_config: "VllmConfig") -> str:
    if config.socket is not None:
        return config.socket
    engine = vllm_config.kv_transfer_config.engine_id
    dp = vllm_config.parallel_config.data_parallel_rank
    return os.path.join(os.path.dirname(_kvtier.default_socket_path()), f"vllm-{engine}-dp{dp}.sock")


def _salt(request: "Request") -> bytes:
    """The request's LoRA adapter and ``cache_salt``, unambiguously encoded (empty for none)."""
    lora = getattr(request, "lora_request", None)
    salt = getattr(request, "cache_salt", None)
    if lora is None and not salt:
        return b""
    parts = {"salt": salt}
    if lora is not None:
        parts["lora"] = [lora.lora_name, lora.lora_int_id, str(getattr(lora, "lora_path", ""))]
    return json.dumps(parts, sort_keys=True).encode()


def _uncacheable(request: "Request") -> bool:
    """A request whose blocks depend on more than its token ids: multimodal inputs, or prompt
    embeddings (vLLM's token ids are placeholders there). Neither restored nor saved."""
    return bool(getattr(request, "mm_features", None)) or getattr(request, "prompt_embeds", None) is not None


class KvtierConnector(KVConnectorBase_V1):
    """kvtier's vLLM connector. Load it with::

        --kv-transfer-config '{"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
                               "kv_role": "kv_both", "kv_connector_extra_config": {"pool": "8GiB"}}'

    ``kv_role``: ``kv_both`` (restore and save), ``kv_producer`` (save only: a prefill
    instance), ``kv_consumer`` (restore only: a decode instance). ``kv_connector_extra_config``:
    see :class:`~kvtier.vllm.config.ConnectorConfig`. vLLM's ``kv_load_failure_policy`` is set to
    ``recompute``: a block the tier cannot restore is computed again, never a failed request.
    """

    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource as _Source

        _cache_hit_source = _Source.HOST
    except ImportError:  # a vLLM without per-source hit metrics
        pass

    @property
    def requires_kv_delivery(self) -> bool:
        """False: a save is best effort (a dropped one is a future miss), even for a producer."""
        return False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config: "KVCacheConfig"):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        config = ConnectorConfig.from_extra(ktc.kv_connector_extra_config)
        if ktc.kv_role == "kv_producer":
            config = dataclasses.replace(config, load=False)
        elif ktc.kv_role == "kv_consumer":
            config = dataclasses.replace(config, save=False)
        if getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.info("kvtier: kv_load_failure_policy set to 'recompute' (a block the tier cannot restore is recomputed)")
            ktc.kv_load_failure_policy = "recompute"
        self._config = config
        self._facts = engine_facts(vllm_config, kv_cache_config)
        self._block_size = self._facts["block_size"]
        self._socket = _socket_path(config, vllm_config)
        self._tp_size = vllm_config.parallel_config.tensor_parallel_size
        self._planner: Optional[SchedulerPlanner] = None
        # KV events: what each finished request's save announces once the workers report it.
        self._announce: Dict[str, tuple] = {}
        self._stored_reports: Dict[str, List[int]] = {}
        self._events: List[Any] = []
        self._worker: Optional[WorkerTransfers] = None
        if role == KVConnectorRole.SCHEDULER:
            self._planner = SchedulerPlanner(config, self._facts, self._block_size, self._tp_size, self._socket)
        log.info("kvtier: %s side, pool at %s (%s)", role.name.lower(), self._socket, "kvtierd" if config.socket else "in-process")

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: Dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        tp_rank = get_tensor_model_parallel_rank()
        self._worker = WorkerTransfers(
            self._config, self._facts, self._block_size, tp_rank, self._tp_size, self._socket,
            serve=self._config.socket is None and tp_rank == 0,
        )
        self._worker.register(kv_caches, self._kv_cache_config.num_blocks)

    def _stream(self) -> Any:
        w = self._worker
        return torch.cuda.current_stream() if w is not None and w.device is not None else None

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        stream = self._stream()
        self._worker.start(meta.plan, stream)
        if not self._config.layerwise:
            self._worker.wait_loads(stream)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Layer-wise (the default): the forward waits for this layer's restored pages only (a
        # stream wait on CUDA); wait_for_save, after the forward, settles the rest.
        if self._worker is not None and self._config.layerwise:
            self._worker.wait_layer(layer_name, self._stream())

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        # Blocks are saved whole when their request ends (wait_for_save), not layer by layer.
        return

    def wait_for_save(self) -> None:
        if self._worker is None:
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvtierConnectorMetadata)
        if self._config.layerwise:
            # The step's restores: every layer was waited for in the forward; this reports
            # failures (for get_block_ids_with_load_errors) and the requests restored.
            self._worker.wait_loads(self._stream())
        self._worker.save(meta.plan, self._stream())

    def get_finished(self, finished_req_ids: Set[str]):
        if self._worker is None:
            return None, None
        sending, recving = self._worker.finished(finished_req_ids)
        return sending or None, recving or None

    def get_block_ids_with_load_errors(self) -> Set[int]:
        return self._worker.take_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        if self._worker is None:
            return None
        loaded = self._worker.take_loaded()
        stored = {k: [n] for k, n in self._worker.take_stored().items()}
        return KvtierWorkerMetadata(loaded, stored) if loaded or stored else None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._planner is not None:
            self._planner.close()

    # ---- scheduler side ----

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        assert self._planner is not None
        n = self._planner.match(
            request.request_id, request.all_token_ids, num_computed_tokens, _salt(request), _uncacheable(request)
        )
        return n, n > 0 and self._config.load_async

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self._planner is not None
        block_ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._planner.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self._planner is not None
        return KvtierConnectorMetadata(self._planner.take_plan())

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        assert self._planner is not None
        self._planner.saved(set(connector_output.finished_sending or ()))
        done = set(connector_output.finished_recving or ())
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvtierWorkerMetadata):
            done |= meta.loaded
            for req_id, counts in meta.stored.items():
                reports = self._stored_reports.setdefault(req_id, [])
                reports.extend(counts)
                if len(reports) >= self._tp_size:
                    self._stored_reports.pop(req_id)
                    self._stored_event(req_id, min(reports))
        self._planner.loaded(done)

    def request_finished(self, request: "Request", block_ids: list[int]):
        assert self._planner is not None
        if self._planner.loading(request.request_id):
            # Aborted while its restore is in flight: vLLM frees the blocks when the restore
            # reports (finished_recving); a save now would read blocks still being written.
            self._announce.pop(request.request_id, None)
            self._planner.forget(request.request_id)
            return False, None
        # Tokens a step still in flight will compute have no KV yet (vLLM's async scheduling).
        computed = request.num_computed_tokens - int(getattr(request, "num_in_flight_tokens", 0) or 0)
        n = self._planner.finished(
            request.request_id, request.all_token_ids, computed, block_ids, _salt(request), _uncacheable(request)
        )
        if n:
            hashes = list(getattr(request, "block_hashes", ())[:n])
            lora = getattr(request, "lora_request", None)
            self._announce[request.request_id] = (
                hashes, list(request.all_token_ids[: n * self._block_size]),
                lora.lora_int_id if lora is not None else None, lora.lora_name if lora is not None else None,
            )
        return n > 0, None

    def _stored_event(self, req_id: str, n: int) -> None:
        """Announces the first ``n`` blocks of a finished request's save as stored in the pool
        (``medium="CPU"``), under vLLM's own block hashes of this engine."""
        info = self._announce.pop(req_id, None)
        if info is None or n == 0:
            return
        hashes, tokens, lora_id, lora_name = info
        n = min(n, len(hashes))
        if n == 0:
            return
        from vllm.distributed.kv_events import BlockStored
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

        self._events.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in hashes[:n]], parent_block_hash=None, token_ids=tokens[: n * self._block_size],
            block_size=self._block_size, lora_id=lora_id, medium="CPU", lora_name=lora_name,
        ))

    def take_events(self) -> Iterable[Any]:
        """KV events for vLLM's publisher (``--kv-events-config``): ``BlockStored`` with
        ``medium="CPU"`` for the blocks each finished request's save put in the pool."""
        events, self._events = self._events, []
        return events

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)``: the pool is shared and outlives
        this engine, so nothing is dropped; True."""
        return True
