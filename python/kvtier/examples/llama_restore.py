"""A real transformer whose prefix KV is restored through kvtier, with bitwise-equal logits.

A randomly initialised Llama model (``--config llama3-8b``: Llama-3-8B's shape, 32 layers, 8 KV
heads of 128 dims, bf16, sdpa; ``--config tiny`` for CPUs) runs with its KV cache in paged
per-layer tensors ``[pages * 16, kv_heads, head_dim]`` (``paged_cache.PagedKV``), which are kvtier's
arenas (the ``llama3-8b`` preset layout: 64 arenas of 32,768 B per 16-token page).

For each prefix length:

1. **cold**: prefill the prefix, then the suffix; keep the suffix logits and the greedy tokens;
2. save the prefix pages through kvtier (keys: lineage hashes of the pages' token ids);
3. fill every GPU page with NaN, restore the prefix into *different*, shuffled free pages, run only
   the suffix: the logits must be bitwise equal to the cold run's, the greedy tokens identical,
   and the restored pages byte-identical to the saved ones;
4. timings, median of ``--repeats`` after one warm-up: TTFT cold (prefix + suffix prefill to the
   first token), TTFT warm through kvtier (query + restore + the compute stream waiting on the
   restore's event + suffix), TTFT warm through plain torch from pinned memory (one copy per page
   and arena; one copy into a staging buffer + ``index_copy_`` per arena), the suffix alone with the
   prefix resident, and the restore alone in GB/s against a contiguous copy of the same bytes;
5. **warm, layer-wise**: the restore in layer order (``Rank.restore_layers``, ``--layer-groups``
   groups) with each layer's ``update`` making the stream wait for its own pages only, so the
   copy of later layers runs under the suffix's earlier layers (same bitwise checks), beside
   ``max(restore at the contiguous rate, suffix alone)``, the bound it approaches, and (on a GPU)
   the suffix beside a contiguous copy of the same bytes on a side stream with nothing ordered
   between them: what the suffix costs while the restore's bytes cross the link, with no copy
   kernels and no per-layer waits: a reference (measured, not a proven bound) for what a
   layer-wise restore can reach on that machine;
6. with ``--save-layers``: the prefill alone, the prefill followed by a whole-block save, and the
   prefill with a layer-wise save (``Rank.save_layers``, each group after the event its last
   layer recorded), each timed to the end of the save;
7. with ``--ssd PATH``: the tier has an SSD tier in the file ``PATH`` (``--ssd-bytes``; every
   saved block is written to it), and the warm run is timed once more with the prefix served
   from the SSD: before each run every host block is evicted (the host pool keeps none of the
   prefix, as one too small for it among other requests would), so the query promotes the whole
   prefix from the file into host slots (``Lease.promoted``) before the restore. TTFT cold, warm
   from the host and warm from the SSD are reported side by side, with the same bitwise checks.

Run it with ``python -m kvtier.examples.llama_restore --json results.json`` (needs torch and
transformers; a CUDA GPU for the ``llama3-8b`` configuration, about 40 GB of GPU memory with the
32k-token prefix). GB = 10^9 B.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

try:
    import torch

    from .paged_cache import PagedCache, PagedKV
except ModuleNotFoundError as e:
    if __name__ != "__main__":
        raise
    # Run as a program without its dependencies: one line that says what to install, not a traceback.
    print(f"kvtier.examples.llama_restore needs torch and transformers ({e}): pip install torch transformers", file=sys.stderr)
    sys.exit(2)

import kvtier

__all__ = ["CONFIGS", "build_model", "Bench", "main"]

CONFIGS: Dict[str, dict] = {
    # Llama-3-8B's shape (its KV layout is kvtier's `llama3-8b` preset).
    "llama3-8b": dict(
        num_hidden_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        max_position_embeddings=131072,
        rope_theta=500000.0,
    ),
    # Small enough for a CPU test (16-token pages of 2 KV heads x 32 dims x bf16 = 2,048 B).
    "tiny": dict(
        num_hidden_layers=2,
        hidden_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        vocab_size=512,
        max_position_embeddings=4096,
    ),
}

PAGE_TOKENS = 16


def build_model(config: str, device: torch.device, seed: int = 0):
    """A randomly initialised ``LlamaForCausalLM`` of shape ``CONFIGS[config]`` in bf16 with sdpa
    attention, on ``device``, from a fixed seed."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIGS[config], attn_implementation="sdpa", dtype=torch.bfloat16)
    torch.manual_seed(seed)
    # Parameters are created in bf16 on the device directly (no fp32 copy of 8B weights).
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval(), cfg


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for bitwise comparisons (NaN == NaN, -0 != +0)."""
    return t.contiguous().view(torch.uint8)


def _median_ms(samples: List[float]) -> float:
    return statistics.median(samples) * 1e3


class Bench:
    """One model, its paged KV memory, a kvtier tier and rank over the KV tensors, and the
    measurements. ``max_prefix`` bounds the prefixes ``run_case`` accepts."""

    def __init__(
        self,
        config: str = "tiny",
        device: Optional[str] = None,
        *,
        max_prefix: int = 128,
        suffix: int = 32,
        greedy: int = 8,
        seed: int = 0,
        pool_bytes: Optional[int] = None,
        layer_groups: int = 32,
        torch_baselines: bool = True,
        save_layers: bool = False,
        ssd: Optional[str] = None,
        ssd_bytes: Optional[int] = None,
        cuda_options: Optional[dict] = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.config, self.suffix, self.greedy, self.seed = config, suffix, greedy, seed
        self.layer_groups, self.torch_baselines, self.save_layers = layer_groups, torch_baselines, save_layers
        t0 = time.perf_counter()
        self.model, self.cfg = build_model(config, self.device, seed)
        self.model_init_s = time.perf_counter() - t0
        c = self.cfg
        prefix_pages = -(-max_prefix // PAGE_TOKENS)
        self.tail_pages = -(-(suffix + greedy) // PAGE_TOKENS)
        # A cold prefix, a disjoint warm prefix, the suffix/decode pages, and spare pages.
        pages = 2 * prefix_pages + self.tail_pages + 16
        self.kv = PagedKV(
            c.num_hidden_layers,
            pages,
            c.num_key_value_heads,
            c.head_dim,
            page_tokens=PAGE_TOKENS,
            dtype=torch.bfloat16,
            device=self.device,
        )
        model_name = "Llama-3-8B" if config == "llama3-8b" else f"Llama/{config}"
        self.geometry = kvtier.Geometry.from_tensors(
            self.kv.arenas, model=model_name, page_tokens=PAGE_TOKENS, names=self.kv.arena_names
        ).with_layers([l for l in range(c.num_hidden_layers) for _ in ("k", "v")])
        if config == "llama3-8b":
            # The tensors reproduce the preset's layout, so their keys are the preset's.
            assert self.geometry.namespace == kvtier.Geometry.preset("llama3-8b", pages).namespace
        pool = pool_bytes or (prefix_pages + 8) * self.geometry.slot_bytes
        self.ssd = ssd
        ssd_options: dict = {}
        if ssd is not None:
            # Room for the largest prefix (and a few spare slots) unless told otherwise; every
            # saved block is written to the file (admitted at its first use, the save).
            size = ssd_bytes or 4096 + (prefix_pages + 8) * self.geometry.disk_slot_bytes
            ssd_options = dict(ssd=(ssd, size), ssd_admit_uses=1)
        t0 = time.perf_counter()
        self.tier = kvtier.Tier(self.geometry, pool, "lru", **ssd_options)
        if self.device.type == "cuda":
            self.rank = self.tier.attach_cuda(self.device.index or 0, self.kv.arenas, cuda_options=cuda_options or None)
        else:
            self.rank = self.tier.attach_host(self.kv.arenas)
        self.attach_s = time.perf_counter() - t0

    # -- the pieces a request runs ------------------------------------------------------------

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    @torch.no_grad()
    def _forward(self, cache: PagedCache, ids: torch.Tensor, keep: int = 0):
        # Attention kernels whose forward pass is deterministic (cuDNN's is left out), so the
        # bitwise comparisons compare the restore, not kernel scheduling.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return self.model(ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)

    @torch.no_grad()
    def _greedy(self, cache: PagedCache, first: int) -> List[int]:
        toks = [first]
        for _ in range(self.greedy - 1):
            out = self._forward(cache, torch.tensor([[toks[-1]]], device=self.device), keep=1)
            toks.append(int(out.logits[0, -1].argmax()))
        return toks

    def _keys(self, ids: List[int], pages: int) -> List[bytes]:
        """Lineage keys of the first ``pages`` pages of a prompt."""
        ns, keys, parent = self.tier.namespace, [], None
        for p in range(pages):
            parent = ns.chain(parent, ids[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS])
            keys.append(parent)
        return keys

    # -- one prefix length ----------------------------------------------------------------------

    def run_case(self, prefix: int, repeats: int = 5, warmup: int = 1, suffix: Optional[int] = None) -> dict:
        """Runs the cold / save / NaN / restore / warm protocol and the timings for a prefix of
        ``prefix`` tokens (a multiple of 16). Returns a JSON-ready dict (times in ms, rates in GB/s,
        ``checks``: the bitwise comparisons)."""
        if prefix % PAGE_TOKENS:
            raise ValueError(f"prefix {prefix} is not a whole number of {PAGE_TOKENS}-token pages")
        if suffix is not None:
            # Another suffix length (at most the one the tail pages were sized for).
            if -(-(suffix + self.greedy) // PAGE_TOKENS) > self.tail_pages:
                raise ValueError(f"suffix {suffix} needs more tail pages than this Bench has")
            self.suffix = suffix
        dev, kv, T = self.device, self.kv, PAGE_TOKENS
        pp = prefix // T
        rng = random.Random(self.seed + prefix)
        gen = torch.Generator().manual_seed(self.seed + prefix)
        ids = torch.randint(0, self.cfg.vocab_size, (1, prefix + self.suffix), generator=gen)
        id_list = ids[0].tolist()
        ids = ids.to(dev)
        prefix_ids, suffix_ids = ids[:, :prefix], ids[:, prefix:]
        perm = list(range(kv.pages))
        rng.shuffle(perm)  # pages as a paged allocator hands them out: scattered
        cold_pages, warm_pages = perm[:pp], perm[pp : 2 * pp]
        tail = perm[2 * pp : 2 * pp + self.tail_pages]
        block_bytes = self.geometry.block_bytes
        restore_bytes = pp * block_bytes

        def timed(fn: Callable[[], object]) -> float:
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            return time.perf_counter() - t0

        def series(fn: Callable[[], object], before: Callable[[], object] = lambda: None) -> List[float]:
            out = []
            for i in range(warmup + repeats):
                before()
                t = timed(fn)
                if i >= warmup:
                    out.append(t)
            return out

        # 1. Cold: prefix, then suffix (fresh cache each run).
        state: dict = {}

        def cold():
            cache = PagedCache(kv, cold_pages + tail)
            self._forward(cache, prefix_ids, keep=1)
            out = self._forward(cache, suffix_ids)
            state["cold_first"] = int(out.logits[0, -1].argmax())
            state["cold_logits"], state["cold_cache"] = out.logits, cache

        cold_s = series(cold)
        cold_logits = state["cold_logits"].clone()
        cold_tokens = self._greedy(state["cold_cache"], state["cold_first"])
        del state["cold_cache"]
        # Control: a second cold request decodes the same tokens (the platform is deterministic,
        # so a difference after a restore could only come from the restore).
        cold()
        cold_again = self._greedy(state["cold_cache"], state["cold_first"])
        del state["cold_cache"]

        # 2. Save the prefix pages (after the kernels that wrote them).
        keys = self._keys(id_list, pp)
        ticket = self.rank.save(keys, cold_pages, after_stream=self._stream())
        ticket.wait()
        # The SSD tier's writes (with --ssd) finish before anything is timed.
        self.tier.flush_demotions()
        rows_cold, rows_warm = kv.page_rows(cold_pages), kv.page_rows(warm_pages)
        reference = [a.index_select(0, rows_cold) for a in kv.arenas]  # the saved bytes, for checks

        # 3. Warm through kvtier: NaN everywhere, restore into other pages, suffix only.
        def nan():
            kv.fill_(float("nan"))

        # `whole_submit_ms`: how long `restore` holds the calling (engine) thread.
        whole_submit_ms: List[float] = []

        def warm_kvtier():
            stream = self._stream()
            with self.tier.query(keys) as lease:
                assert len(lease) == pp, f"query found {len(lease)} of {pp} pages"
                t_submit = time.perf_counter()
                h = self.rank.restore(lease, warm_pages, after_stream=stream)
                whole_submit_ms.append((time.perf_counter() - t_submit) * 1e3)
            h.stream_wait(stream if stream is not None else 0)  # no host sync on a GPU
            cache = PagedCache(kv, warm_pages + tail, cached_tokens=prefix)
            out = self._forward(cache, suffix_ids)
            state["warm_first"] = int(out.logits[0, -1].argmax())
            state["warm_logits"], state["warm_cache"], state["handle"] = out.logits, cache, h

        warm_s = series(warm_kvtier, before=nan)
        state["handle"].wait()
        warm_logits = state["warm_logits"].clone()
        restored = [a.index_select(0, rows_warm) for a in kv.arenas]
        pages_equal = all(torch.equal(_bits(r), _bits(x)) for r, x in zip(reference, restored))
        del restored
        warm_tokens = self._greedy(state["warm_cache"], state["warm_first"])
        del state["warm_cache"]

        # 3b. Warm, layer-wise: the restore in layer order, each layer's update waits for its pages.
        # `submit_ms`: how long `restore_layers` holds the calling (engine) thread.
        submit_ms: List[float] = []

        def warm_layers():
            stream = self._stream()
            # The page table goes to the GPU before the restore is queued (PagedCache.prepare).
            cache = PagedCache(kv, warm_pages + tail, cached_tokens=prefix, time_waits=True)
            cache.prepare(suffix_ids.shape[-1])
            with self.tier.query(keys) as lease:
                assert len(lease) == pp, f"query found {len(lease)} of {pp} pages"
                t_submit = time.perf_counter()
                h = self.rank.restore_layers(lease, warm_pages, self.layer_groups, after_stream=stream)
                submit_ms.append((time.perf_counter() - t_submit) * 1e3)
            cache.restore = h
            out = self._forward(cache, suffix_ids)
            state["layers_first"] = int(out.logits[0, -1].argmax())
            state["layers_logits"], state["layers_cache"], state["handle"] = out.logits, cache, h
            layer_caches.append(cache)

        layer_caches: List[PagedCache] = []
        layers_s = series(warm_layers, before=nan)
        # How long the engine's stream stood at each layer's wait, per timed run (read after the
        # runs, so the reads add nothing to their times; none on a CPU).
        layer_waits = [w for w in ([ms for _, ms in c.wait_ms()] for c in layer_caches[warmup:]) if w]
        del layer_caches
        state["handle"].wait()
        layers_logits = state["layers_logits"].clone()
        restored = [a.index_select(0, rows_warm) for a in kv.arenas]
        layers_pages_equal = all(torch.equal(_bits(r), _bits(x)) for r, x in zip(reference, restored))
        del restored
        layers_tokens = self._greedy(state["layers_cache"], state["layers_first"])
        del state["layers_cache"]

        # 4. Suffix alone with the prefix resident (the lower bound).
        def suffix_only():
            cache = PagedCache(kv, warm_pages + tail, cached_tokens=prefix)
            out = self._forward(cache, suffix_ids)
            state["suffix_first"] = int(out.logits[0, -1].argmax())

        nan()
        with self.tier.query(keys) as lease:
            # After the NaN fill queued on the compute stream, like every restore into used pages.
            self.rank.restore(lease, warm_pages, after_stream=self._stream()).wait()
        suffix_s = series(suffix_only)
        suffix_equal = state["suffix_first"] == state["warm_first"]

        # 5. Torch baselines from pinned memory, in the engine's layout ([arena, tokens, heads, dim]).
        host = torch.empty(
            (len(kv.arenas), prefix, kv.kv_heads, kv.head_dim), dtype=kv.dtype, pin_memory=dev.type == "cuda"
        )
        for a, r in enumerate(reference):
            host[a].copy_(r)
        if self.ssd is None:
            del reference  # else kept for step 8's checks

        def per_page_copy():
            for a, arena in enumerate(kv.arenas):
                src = host[a]
                for i, p in enumerate(warm_pages):
                    arena[p * T : (p + 1) * T].copy_(src[i * T : (i + 1) * T], non_blocking=True)

        staging = torch.empty(host.shape, dtype=kv.dtype, device=dev)

        def staged_copy():
            staging.copy_(host, non_blocking=True)
            for a, arena in enumerate(kv.arenas):
                arena.index_copy_(0, rows_warm, staging[a])

        def warm_torch(copy):
            def run():
                copy()
                cache = PagedCache(kv, warm_pages + tail, cached_tokens=prefix)
                out = self._forward(cache, suffix_ids)
                state["torch_first"] = int(out.logits[0, -1].argmax())
                state["torch_logits"] = out.logits

            return run

        if self.torch_baselines:
            per_page_s = series(warm_torch(per_page_copy), before=nan)
            per_page_equal = torch.equal(_bits(state["torch_logits"]), _bits(cold_logits))
            staged_s = series(warm_torch(staged_copy), before=nan)
            staged_equal = torch.equal(_bits(state["torch_logits"]), _bits(cold_logits))
        else:
            per_page_s = staged_s = [float("nan")]
            per_page_equal = staged_equal = True

        # 6. The restore alone, against a contiguous copy of the same bytes (same run).
        def kvtier_restore():
            with self.tier.query(keys) as lease:
                h = self.rank.restore(lease, warm_pages, after_stream=self._stream())
            h.wait()

        def kvtier_restore_layers():
            with self.tier.query(keys) as lease:
                h = self.rank.restore_layers(lease, warm_pages, self.layer_groups, after_stream=self._stream())
            h.wait()

        contiguous = torch.empty(host.shape, dtype=kv.dtype, device=dev)
        restore_s = series(kvtier_restore)
        restore_layers_s = series(kvtier_restore_layers)
        per_page_only_s = series(per_page_copy) if self.torch_baselines else [float("nan")]
        staged_only_s = series(staged_copy) if self.torch_baselines else [float("nan")]
        contiguous_s = series(lambda: contiguous.copy_(host, non_blocking=True))

        # 6b. A reference for any overlap: the suffix (prefix resident) while a contiguous copy
        # of the restore's bytes runs on a side stream (copy engine only, no SM, nothing ordered
        # between the two). A layer-wise restore moves the same bytes beside the same kernels and
        # adds its per-layer ordering (a copy paced differently could interfere less, so this is
        # a reference, not a bound). The page table goes up first, as in 3b: an upload queued
        # after the copy would wait behind it on the copy engine.
        if dev.type == "cuda":
            side = torch.cuda.Stream(dev)

            def suffix_beside_copy():
                cache = PagedCache(kv, warm_pages + tail, cached_tokens=prefix)
                cache.prepare(suffix_ids.shape[-1])
                side.wait_stream(torch.cuda.current_stream(dev))
                with torch.cuda.stream(side):
                    contiguous.copy_(host, non_blocking=True)
                out = self._forward(cache, suffix_ids)
                state["beside_first"] = int(out.logits[0, -1].argmax())

            beside_s = series(suffix_beside_copy)
            beside_equal = state["beside_first"] == state["warm_first"]
        else:
            beside_s, beside_equal = [float("nan")], True
        del staging, contiguous, host
        if dev.type == "cuda":
            torch.cuda.empty_cache()

        # 7. Saves during the prefill (pool blocks evicted before each run, so every run saves).
        save_ms: dict = {}
        if self.save_layers and dev.type == "cuda":

            def evict():
                self.tier.evict(self.tier.capacity)

            def prefill(record: bool):
                cache = PagedCache(kv, cold_pages + tail, record_layers=record)
                self._forward(cache, prefix_ids, keep=1)
                return cache

            def prefill_whole_save():
                prefill(False)
                self.rank.save(keys, cold_pages, after_stream=self._stream()).wait()

            def prefill_layer_save():
                cache = prefill(True)
                ev, L, G = cache.layer_events, len(cache.layer_events), self.layer_groups
                # The event after each group's last layer (groups of consecutive layers, as kvtier's).
                ends = [ev[((g + 1) * L) // min(G, L) - 1] for g in range(min(G, L))]
                self.rank.save_layers(keys, cold_pages, len(ends), ends).wait()

            prefill_s = series(lambda: prefill(False))
            whole_save_s = series(prefill_whole_save, before=evict)
            layer_save_s = series(prefill_layer_save, before=evict)
            save_ms = {
                "prefill_alone": _median_ms(prefill_s),
                "prefill_then_whole_save_end": _median_ms(whole_save_s),
                "prefill_with_layer_save_end": _median_ms(layer_save_s),
            }
            save_ms["layer_save_end_over_prefill"] = save_ms["prefill_with_layer_save_end"] / save_ms["prefill_alone"]
            # Leave the prefix saved for anything after this.
            self.rank.save(keys, cold_pages, after_stream=self._stream()).wait()

        # 8. Warm from the SSD tier (--ssd): no host block left before each run, so the query
        # promotes the whole prefix from the file, then the restore and the suffix as in 3.
        ssd_checks: dict = {}
        ssd_s: List[float] = [float("nan")]
        if self.ssd is not None:
            self.tier.flush_demotions()
            state["ssd_promoted"] = []

            def off_the_host():
                nan()
                self.tier.evict(self.tier.capacity)

            def warm_ssd():
                stream = self._stream()
                with self.tier.query(keys) as lease:
                    assert len(lease) == pp, f"query found {len(lease)} of {pp} pages"
                    state["ssd_promoted"].append(lease.promoted)
                    h = self.rank.restore(lease, warm_pages, after_stream=stream)
                h.stream_wait(stream if stream is not None else 0)
                cache = PagedCache(kv, warm_pages + tail, cached_tokens=prefix)
                out = self._forward(cache, suffix_ids)
                state["ssd_first"] = int(out.logits[0, -1].argmax())
                state["ssd_logits"], state["ssd_cache"], state["handle"] = out.logits, cache, h

            ssd_s = series(warm_ssd, before=off_the_host)
            state["handle"].wait()
            restored = [a.index_select(0, rows_warm) for a in kv.arenas]
            ssd_checks = {
                "ssd_whole_prefix_promoted": all(n == pp for n in state["ssd_promoted"]),
                "ssd_logits_bitwise_equal": torch.equal(_bits(state["ssd_logits"]), _bits(cold_logits)),
                "ssd_greedy_tokens_equal": self._greedy(state["ssd_cache"], state["ssd_first"]) == cold_tokens,
                "ssd_restored_pages_byte_identical": all(
                    torch.equal(_bits(r), _bits(x)) for r, x in zip(reference, restored)
                ),
            }
            del restored, reference, state["ssd_cache"]

        gbps = lambda s: restore_bytes / statistics.median(s) / 1e9  # noqa: E731
        checks = {
            "logits_bitwise_equal": torch.equal(_bits(warm_logits), _bits(cold_logits)),
            "greedy_tokens_equal": warm_tokens == cold_tokens,
            "cold_greedy_tokens_repeatable": cold_again == cold_tokens,
            "restored_pages_byte_identical": pages_equal,
            "logits_finite": bool(torch.isfinite(cold_logits.float()).all()),
            "torch_per_page_logits_equal": per_page_equal,
            "torch_staged_logits_equal": staged_equal,
            "suffix_alone_first_token_equal": suffix_equal,
            "suffix_beside_copy_first_token_equal": beside_equal,
            "layer_wise_logits_bitwise_equal": torch.equal(_bits(layers_logits), _bits(cold_logits)),
            "layer_wise_greedy_tokens_equal": layers_tokens == cold_tokens,
            "layer_wise_restored_pages_byte_identical": layers_pages_equal,
            **ssd_checks,
        }
        suffix_ms, contiguous_gbps = _median_ms(suffix_s), gbps(contiguous_s)
        return {
            "prefix_tokens": prefix,
            "suffix_tokens": self.suffix,
            "prefix_pages": pp,
            "restore_bytes": restore_bytes,
            "greedy_tokens": cold_tokens,
            "warm_greedy_tokens": warm_tokens,
            "checks": checks,
            "ttft_ms": {
                "cold": _median_ms(cold_s),
                "warm_kvtier": _median_ms(warm_s),
                "warm_torch_per_page": _median_ms(per_page_s),
                "warm_torch_staged": _median_ms(staged_s),
                "suffix_alone": suffix_ms,
                "model_suffix_plus_contiguous_restore": suffix_ms + restore_bytes / contiguous_gbps / 1e6,
                "warm_kvtier_layers": _median_ms(layers_s),
                "model_max_suffix_contiguous_restore": max(suffix_ms, restore_bytes / contiguous_gbps / 1e6),
                # The suffix beside an unordered contiguous copy of the restore's bytes (step 6b;
                # NaN on a CPU): both done, so at least the copy's own time.
                "suffix_beside_copy": _median_ms(beside_s),
                # With --ssd: the prefix promoted from the SSD tier, then restored (NaN without).
                "warm_ssd": _median_ms(ssd_s),
            },
            "layer_groups": self.layer_groups,
            # Median host time `restore_layers` took to return in the warm, layer-wise runs (the
            # engine's thread queues nothing meanwhile), milliseconds.
            "layers_submit_ms": statistics.median(submit_ms) if submit_ms else float("nan"),
            # How long the engine's stream stood at the layer waits of the warm, layer-wise runs
            # (GPU time between timing events recorded around each wait; NaN on a CPU): the
            # median over the timed runs of layer 0's wait and of all waits together, and every
            # run's per-layer waits in layer order.
            "layer_wait_ms": {
                "first": statistics.median(w[0] for w in layer_waits) if layer_waits else float("nan"),
                "total": statistics.median(sum(w) for w in layer_waits) if layer_waits else float("nan"),
                "per_layer": layer_waits,
            },
            # The same for `restore` in the warm, whole-block runs.
            "whole_submit_ms": statistics.median(whole_submit_ms) if whole_submit_ms else float("nan"),
            "save_ms": save_ms,
            "saved": {"saving": len(ticket.saving), "resident": ticket.resident},
            "restore_gbps": {
                "kvtier": gbps(restore_s),
                "kvtier_layers": gbps(restore_layers_s),
                # The restore's share of the warm TTFT: bytes / (warm TTFT - suffix alone).
                "kvtier_inside_ttft": restore_bytes / max(_median_ms(warm_s) - suffix_ms, 1e-6) / 1e6,
                "torch_per_page": gbps(per_page_only_s),
                "torch_staged": gbps(staged_only_s),
                "contiguous_copy": contiguous_gbps,
            },
            "samples_ms": {
                k: [x * 1e3 for x in v]
                for k, v in {
                    "cold": cold_s,
                    "warm_kvtier": warm_s,
                    "warm_torch_per_page": per_page_s,
                    "warm_torch_staged": staged_s,
                    "suffix_alone": suffix_s,
                    "restore_kvtier": restore_s,
                    "warm_kvtier_layers": layers_s,
                    "restore_kvtier_layers": restore_layers_s,
                    "restore_torch_per_page": per_page_only_s,
                    "restore_torch_staged": staged_only_s,
                    "contiguous_copy": contiguous_s,
                    "suffix_beside_copy": beside_s,
                    "warm_ssd": ssd_s,
                }.items()
            },
            "repeats": repeats,
            "warmup": warmup,
        }

    def environment(self) -> dict:
        env = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "config": self.config,
            "device": str(self.device),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "kvtier": kvtier.__version__,
            "model_init_s": self.model_init_s,
            "tier_and_attach_s": self.attach_s,
            "pool_capacity_blocks": self.tier.capacity,
            "pool_backing": self.tier.backing,
            "block_bytes": self.geometry.block_bytes,
            "arenas": len(self.geometry),
        }
        try:
            import transformers

            env["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover
            pass
        if self.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(self.device)
        if self.ssd is not None:
            env["ssd_path"] = self.ssd
            env["ssd_stats"] = self.tier.ssd_stats()
        return env

    def close(self) -> None:
        self.rank.close()


def add_cuda_option_argument(p: argparse.ArgumentParser) -> None:
    """Adds ``--cuda-option KEY=VALUE`` (repeatable) to ``p``; :func:`cuda_options_from` reads it."""
    p.add_argument(
        "--cuda-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a copy tuning option for Tier.attach_cuda's cuda_options (integer values; mode takes a name), repeatable",
    )


def cuda_options_from(p: argparse.ArgumentParser, opts: List[str]) -> dict:
    """``Tier.attach_cuda``'s ``cuda_options`` from ``--cuda-option`` values: ``mode`` keeps its
    name, ``true``/``false`` become booleans, the rest integers; a malformed one ends the program
    through ``p.error`` (naming it)."""
    cuda_options: dict = {}
    for opt in opts:
        key, sep, value = opt.partition("=")
        if not sep or not key:
            p.error(f"--cuda-option {opt!r}: expected KEY=VALUE")
        if key == "mode":
            cuda_options[key] = value
        elif value.lower() in ("true", "false"):
            cuda_options[key] = value.lower() == "true"
        elif value.isdigit():
            cuda_options[key] = int(value)
        else:
            p.error(f"--cuda-option {opt!r}: the value must be an integer, true or false")
    return cuda_options


NO_GPU = "n/a (no GPU)"
NO_TORCH = "n/a (--no-torch-baselines)"


def _cell(x: float, spec: str = ".1f", unit: str = "", na: str = "n/a") -> str:
    """One table cell: ``x`` formatted with ``spec`` and ``unit``, or ``na`` (why there is no
    figure) where it was not measured (NaN): a cell never reads ``nan``."""
    if x is None or math.isnan(x):
        return na
    return f"{x:{spec}}{unit}"


def markdown(results: List[dict]) -> str:
    """The results as a markdown table (times in ms, rates in GB/s). A figure that was not measured
    says why: ``n/a (no GPU)`` (the copy beside the suffix and the layer waits need CUDA streams
    and events), ``n/a (--no-torch-baselines)``."""
    head = (
        "| prefix tokens | TTFT cold | TTFT warm (kvtier) | TTFT warm (torch per-page) | TTFT warm (torch staging) "
        "| suffix alone | suffix + bytes / contiguous rate | restore kvtier GB/s | torch per-page GB/s "
        "| torch staging GB/s | contiguous copy GB/s | bitwise checks |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n"
    )
    rows = []
    for r in results:
        t, g = r["ttft_ms"], r["restore_gbps"]
        ok = all(r["checks"].values())
        rows.append(
            f"| {r['prefix_tokens']:,} | {_cell(t['cold'], unit=' ms')} | {_cell(t['warm_kvtier'], unit=' ms')} "
            f"| {_cell(t['warm_torch_per_page'], unit=' ms', na=NO_TORCH)} "
            f"| {_cell(t['warm_torch_staged'], unit=' ms', na=NO_TORCH)} | {_cell(t['suffix_alone'], unit=' ms')} "
            f"| {_cell(t['model_suffix_plus_contiguous_restore'], unit=' ms')} | {_cell(g['kvtier'])} "
            f"| {_cell(g['torch_per_page'], na=NO_TORCH)} | {_cell(g['torch_staged'], na=NO_TORCH)} "
            f"| {_cell(g['contiguous_copy'])} | {'pass' if ok else 'FAIL'} |"
        )
    layers_head = (
        "\n| prefix tokens | suffix tokens | TTFT cold | TTFT warm (whole block) | TTFT warm (layer-wise) "
        "| suffix alone | max(restore at contiguous rate, suffix alone) | layer-wise / max "
        "| suffix beside an unordered copy | that / max "
        "| restore GB/s whole | restore GB/s layer-wise | contiguous GB/s | submit ms whole / layer-wise "
        "| layer waits ms, layer 0 / all |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lrows = []
    for r in results:
        t, g = r["ttft_ms"], r["restore_gbps"]
        bound = t["model_max_suffix_contiguous_restore"]
        waits = r["layer_wait_ms"]
        lrows.append(
            f"| {r['prefix_tokens']:,} | {r['suffix_tokens']} | {_cell(t['cold'], unit=' ms')} "
            f"| {_cell(t['warm_kvtier'], unit=' ms')} "
            f"| {_cell(t['warm_kvtier_layers'], unit=' ms')} | {_cell(t['suffix_alone'], unit=' ms')} "
            f"| {_cell(bound, unit=' ms')} "
            f"| {_cell(t['warm_kvtier_layers'] / bound, '.3f')} "
            f"| {_cell(t['suffix_beside_copy'], unit=' ms', na=NO_GPU)} "
            f"| {_cell(t['suffix_beside_copy'] / bound, '.3f', na=NO_GPU)} "
            f"| {_cell(g['kvtier'])} "
            f"| {_cell(g['kvtier_layers'])} | {_cell(g['contiguous_copy'])} "
            f"| {_cell(r['whole_submit_ms'])} / {_cell(r['layers_submit_ms'])} "
            f"| {_cell(waits['first'], na=NO_GPU)} / {_cell(waits['total'], na=NO_GPU)} |"
        )
    saves = [r for r in results if r.get("save_ms")]
    save_table = ""
    if saves:
        save_table = (
            "\n| prefix tokens | prefill alone | prefill, then whole-block save (end) "
            "| prefill with layer-wise save (end) | layer-wise end / prefill |\n|---:|---:|---:|---:|---:|\n"
        )
        for r in saves:
            m = r["save_ms"]
            save_table += (
                f"| {r['prefix_tokens']:,} | {_cell(m['prefill_alone'], unit=' ms')} "
                f"| {_cell(m['prefill_then_whole_save_end'], unit=' ms')} "
                f"| {_cell(m['prefill_with_layer_save_end'], unit=' ms')} "
                f"| {_cell(m['layer_save_end_over_prefill'], '.3f')} |\n"
            )
    ssd = [r for r in results if "ssd_whole_prefix_promoted" in r["checks"]]
    ssd_table = ""
    if ssd:
        ssd_table = (
            "\n| prefix tokens | suffix tokens | TTFT cold | TTFT warm (host hit) | TTFT warm (SSD promote) "
            "| SSD checks |\n|---:|---:|---:|---:|---:|---|\n"
        )
        for r in ssd:
            t = r["ttft_ms"]
            ok = all(v for k, v in r["checks"].items() if k.startswith("ssd_"))
            ssd_table += (
                f"| {r['prefix_tokens']:,} | {r['suffix_tokens']} | {_cell(t['cold'], unit=' ms')} "
                f"| {_cell(t['warm_kvtier'], unit=' ms')} | {_cell(t['warm_ssd'], unit=' ms')} "
                f"| {'pass' if ok else 'FAIL'} |\n"
            )
    return head + "\n".join(rows) + "\n" + layers_head + "\n".join(lrows) + "\n" + save_table + ssd_table


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.examples.llama_restore", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default=None, help="model shape (default: llama3-8b on a GPU, else tiny)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--prefix", default=None, help="comma-separated prefix lengths in tokens (multiples of 16); default 7936,32512 on a GPU, 128 on a CPU")
    p.add_argument("--suffix", default=None, help="comma-separated suffix lengths in tokens (default 256 on a GPU, 32 on a CPU)")
    p.add_argument("--greedy", type=int, default=32, help="greedy tokens compared after the suffix (default 32)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per measurement; the median is reported (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--layer-groups", type=int, default=32, help="layer groups of the layer-wise restore and save (default 32)")
    p.add_argument("--no-torch-baselines", action="store_true", help="skip the plain-torch restore baselines")
    p.add_argument("--save-layers", action="store_true", help="also time saves during the prefill (GPU only)")
    add_cuda_option_argument(p)
    p.add_argument(
        "--ssd",
        default=None,
        metavar="PATH",
        help="put an SSD tier in this file (created if missing; its directory must exist) and also time the warm run "
        "with the prefix promoted from it, no host block left",
    )
    p.add_argument(
        "--ssd-bytes",
        default=None,
        type=int,
        help="size of the --ssd file in bytes (default: the largest prefix's blocks and 8 more, "
        "4096 + blocks x geometry.disk_slot_bytes)",
    )
    a = p.parse_args(argv)
    if a.ssd_bytes is not None and a.ssd is None:
        p.error("--ssd-bytes needs --ssd")
    cuda_options = cuda_options_from(p, a.cuda_option)
    # Bitwise comparisons need deterministic kernels: cuBLAS with a fixed workspace (set before
    # CUDA initialises) and torch's deterministic algorithms.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # Layer-wise restores overlap the suffix only if the engine's stream and kvtier's streams sit
    # on different hardware queues: the driver multiplexes a context's streams onto 8 queues by
    # default, and a queue shared with the restore's stream holds the engine's kernels behind the
    # restore's cross-stream waits. 32 queues (also set before CUDA initialises) separate them.
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    gpu = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    config = a.config or ("llama3-8b" if gpu else "tiny")
    prefixes = [int(x) for x in (a.prefix or ("7936,32512" if gpu else "128")).split(",")]
    suffixes = [int(x) for x in a.suffix.split(",")] if a.suffix is not None else [256 if gpu else 32]
    bench = Bench(
        config,
        a.device,
        max_prefix=max(prefixes),
        suffix=max(suffixes),
        greedy=a.greedy,
        seed=a.seed,
        layer_groups=a.layer_groups,
        torch_baselines=not a.no_torch_baselines,
        save_layers=a.save_layers,
        ssd=a.ssd,
        ssd_bytes=a.ssd_bytes,
        cuda_options=cuda_options,
    )
    results = []
    for n in prefixes:
        for i, sfx in enumerate(suffixes):
            # Saves during the prefill do not depend on the suffix: timed with the first one only.
            bench.save_layers = a.save_layers and i == 0
            r = bench.run_case(n, repeats=a.repeats, warmup=a.warmup, suffix=sfx)
            results.append(r)
            print(f"prefix {n}, suffix {sfx}: {json.dumps(r['checks'])}", file=sys.stderr, flush=True)
    env = bench.environment()
    env["command"] = "python -m kvtier.examples.llama_restore " + " ".join(argv if argv is not None else sys.argv[1:])
    env["tier_stats"] = bench.tier.stats()
    bench.close()
    print(f"{env.get('gpu', env['device'])}, torch {env['torch']}, transformers {env.get('transformers')}, {env['date']}")
    print(markdown(results))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
    return 0 if all(all(r["checks"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
