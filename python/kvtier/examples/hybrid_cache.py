"""A paged KV cache for a sliding-window hybrid transformers model (Gemma-3), saved and restored
through a kvtier ``HybridTier``: every full-attention page, and of the sliding layers only the
pages of the window.

A Gemma-3 text model interleaves full-attention layers with sliding-window layers (5 sliding : 1
full; layer ``l`` is full attention when ``(l + 1) % 6 == 0``). The engine memory here is two
cache groups of paged per-layer K and V tensors ``[pages * 16, kv_heads, head_dim]``
(``paged_cache.PagedKV``), each group with its own page ids:

- group 0, ``full`` (``GroupKind::Full``): the full-attention layers; a restore at a boundary of
  ``L`` blocks needs all ``L`` blocks;
- group 1, ``sliding`` (``GroupKind::SlidingWindow``, ``window_tokens = config.sliding_window``):
  the sliding layers; a restore needs only the blocks holding the window's tokens before the
  boundary.

``HybridPagedCache`` plugs this into the stock ``Gemma3ForCausalLM``. What the model reads is
what transformers' own ``DynamicCache`` would hand it: a full layer's ``update`` returns every
token's K/V; a sliding layer's (``PagedSlidingLayer``, a ``DynamicSlidingWindowLayer``) returns
only the last ``sliding_window - 1`` cached tokens and the new ones, exactly the keys its
``get_mask_sizes`` sizes the sliding mask for (``create_sliding_window_causal_mask``: ``kv_offset
= max(seen - sliding_window + 1, 0)``; a query at position ``q`` attends keys ``k`` with
``q - sliding_window < k <= q``). So a sliding page outside the window is never read: it is not
gathered at all (reading it through a mask would not do: ``0 * NaN`` is NaN). A request's page
table may even leave such blocks without a page (``None``); reading one raises ``LookupError``.

kvtier's sliding rule keeps the blocks of the ``window_tokens`` tokens before the boundary; the
model reads ``sliding_window - 1`` of them, so with ``window_tokens = sliding_window`` the restore
covers every read (the same block count unless ``sliding_window - 1`` is a multiple of the page
size, where kvtier keeps one block more).

The protocol (``HybridBench.run_case``), one prompt of ``prefix`` + ``suffix`` tokens:

1. **cold**: prefill the prefix, then the suffix, then ``greedy`` decode steps, in this cache;
2. save the prefix: every full-attention page, and the sliding pages of
   ``layout.needed(1, blocks)`` only (``kvtier.hybrid_save``: each group's rank, group keys);
3. fill every page of both groups with NaN; ``HybridTier.query`` (the longest usable prefix);
   restore each group's leased blocks into *other*, shuffled pages (``kvtier.hybrid_restore``);
   the sliding page table holds no page for the blocks before the window;
4. **warm**: the suffix alone, the same cache class, then the same decode steps.

Checks: the warm suffix logits are bitwise equal to the cold run's (``torch.equal`` on the
bytes: same model, same cache class, same kernels on the same shapes; only where the prefix
pages came from differs), the greedy tokens equal, the restored pages byte-identical to the
saved ones, the logits finite (a NaN page read anywhere would spread), the sliding pages the warm
request does not hold still NaN, the window covering the first sliding block the model reads, and
a warm run whose page table lacks that block refused (it is read from its page). Beside them,
for reference only, the cold logits against transformers' stock ``DynamicCache`` (a different
memory layout, so agreement there is closeness, not necessarily bitwise).

Run it with ``python -m kvtier.examples.hybrid_cache --json results.json`` (``--config tiny``
on a CPU; ``--config gemma3-1b``, Gemma-3-1B's shape, on a GPU). Needs torch and transformers
(>= 5); kvtier itself does not. GB = 10^9 B.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

try:
    import torch
    from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer
except ModuleNotFoundError as e:
    if __name__ != "__main__":
        raise
    # Run as a program without its dependencies: one line that says what to install, not a traceback.
    print(f"kvtier.examples.hybrid_cache needs torch and transformers ({e}): pip install torch transformers", file=sys.stderr)
    sys.exit(2)

import kvtier

from .llama_restore import _bits, _sync
from .paged_cache import PagedKV

__all__ = [
    "CONFIGS",
    "build_model",
    "HybridPagedKV",
    "PagedFullLayer",
    "PagedSlidingLayer",
    "HybridPagedCache",
    "HybridBench",
    "main",
]

PAGE_TOKENS = 16

CONFIGS: Dict[str, dict] = {
    # Small enough for a CPU test: 12 layers (10 sliding over 48 tokens, full at 5 and 11),
    # 16-token pages of 2 KV heads x 32 dims x bf16 = 2,048 B per arena.
    "tiny": dict(
        num_hidden_layers=12,
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        vocab_size=512,
        max_position_embeddings=4096,
        sliding_window=48,
    ),
    # Gemma-3-1B's shape (26 layers: 4 full, 22 sliding over 512 tokens; 1 KV head x 256 dims).
    "gemma3-1b": dict(
        num_hidden_layers=26,
        hidden_size=1152,
        intermediate_size=6912,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        vocab_size=262144,
        max_position_embeddings=32768,
        sliding_window=512,
    ),
}


def build_model(config: str, device: torch.device, seed: int = 0, *, sliding_window: Optional[int] = None):
    """A randomly initialised ``Gemma3ForCausalLM`` of shape ``CONFIGS[config]`` (transformers'
    own ``Gemma3TextConfig``, its default layer pattern: 5 sliding : 1 full) in bf16 with sdpa
    attention, on ``device``, from a fixed seed. ``sliding_window`` (tokens) replaces the
    configuration's."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    shape = dict(CONFIGS[config])
    if sliding_window is not None:
        shape["sliding_window"] = sliding_window
    cfg = Gemma3TextConfig(**shape, attn_implementation="sdpa", dtype=torch.bfloat16)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Gemma3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    return model.eval(), cfg


class HybridPagedKV:
    """A hybrid model's paged K/V memory: one ``PagedKV`` per cache group, each with its own page
    ids; group 0 holds the full-attention layers, group 1 the sliding-window layers.

    ``layer_types``: the model config's (``"full_attention"`` / ``"sliding_attention"`` per
    layer). ``pages``: GPU pages per arena of each group, ``(full, sliding)``. Each group's
    arenas are ``[k, v]`` of its layers in model order (``arenas(g)``), named ``k.L{l}`` /
    ``v.L{l}`` by model layer ``l``; bytes per page per arena ``page_tokens * kv_heads * head_dim *
    element_size``.
    """

    KINDS = ("full_attention", "sliding_attention")

    def __init__(
        self,
        layer_types: Sequence[str],
        pages: Tuple[int, int],
        kv_heads: int,
        head_dim: int,
        *,
        page_tokens: int = PAGE_TOKENS,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        unknown = set(layer_types) - set(self.KINDS)
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)}: this cache pages full and sliding attention only")
        self.layer_types = list(layer_types)
        self.page_tokens, self.dtype, self.device = page_tokens, dtype, torch.device(device)
        #: Model layers of each group, in order.
        self.layers: List[List[int]] = [[l for l, t in enumerate(layer_types) if t == kind] for kind in self.KINDS]
        #: ``where[l] = (group, index of layer l within its group)``.
        self.where: List[Tuple[int, int]] = [
            (self.KINDS.index(t), self.layers[self.KINDS.index(t)].index(l)) for l, t in enumerate(layer_types)
        ]
        self.groups = [
            PagedKV(len(self.layers[g]), pages[g], kv_heads, head_dim, page_tokens=page_tokens, dtype=dtype, device=device)
            for g in range(2)
        ]

    def arenas(self, group: int) -> List[torch.Tensor]:
        """Group ``group``'s tensors in kvtier arena order: K and V of its first layer, ..."""
        return self.groups[group].arenas

    def arena_names(self, group: int) -> List[str]:
        """``k.L{l}``, ``v.L{l}`` for the group's model layers ``l``."""
        return [n for l in self.layers[group] for n in (f"k.L{l}", f"v.L{l}")]

    def arena_layers(self, group: int) -> List[int]:
        """The model layer of each of the group's arenas (for ``Geometry.with_layers``)."""
        return [l for l in self.layers[group] for _ in ("k", "v")]

    def fill_(self, value: float) -> None:
        """Overwrites every page of every arena of both groups with ``value`` (NaN: to prove a
        restore, and that nothing outside it is read)."""
        for kv in self.groups:
            kv.fill_(value)

    def layout(self, model: str, sliding_window: int) -> kvtier.HybridLayout:
        """The kvtier layout of these tensors: group ``full`` and group ``sliding`` with
        ``window_tokens = sliding_window``, each geometry from the group's tensors."""
        geos = [
            kvtier.Geometry.from_tensors(
                self.arenas(g), model=model, page_tokens=self.page_tokens, names=self.arena_names(g)
            ).with_layers(self.arena_layers(g))
            for g in range(2)
        ]
        return kvtier.HybridLayout(
            model,
            [
                kvtier.CacheGroup("full", "full", geos[0]),
                kvtier.CacheGroup("sliding", "sliding", geos[1], window_tokens=sliding_window),
            ],
        )


class _GroupTable:
    """One request's pages in one group: ``table[b]`` is the page id of block ``b`` or ``None``
    (no page: the block is not held, and reading it raises ``LookupError``). Row indices are
    computed once per ``(start, end)`` and shared by the group's layers."""

    def __init__(self, kv: PagedKV, table: Sequence[Optional[int]], group: str) -> None:
        self.kv, self.table, self.group = kv, list(table), group
        self._rows: Dict[Tuple[int, int], torch.Tensor] = {}

    def rows(self, start: int, end: int) -> torch.Tensor:
        """Row indices (int64, on the tensors' device) of tokens ``start .. end - 1``."""
        key = (start, end)
        rows = self._rows.get(key)
        if rows is not None:
            return rows
        T = self.kv.page_tokens
        need = -(-end // T)
        if need > len(self.table):
            raise ValueError(f"tokens up to {end} need {need} pages; the {self.group} page table has {len(self.table)}")
        missing = [b for b in range(start // T, need) if self.table[b] is None]
        if missing:
            raise LookupError(
                f"{self.group} group: tokens {start}..{end - 1} read block(s) {missing}, which hold no page"
            )
        table = torch.as_tensor([-1 if p is None else p for p in self.table[:need]], dtype=torch.int64)
        if self.kv.device.type == "cuda":
            table = table.pin_memory().to(self.kv.device, non_blocking=True)
        pos = torch.arange(start, end, dtype=torch.int64, device=self.kv.device)
        rows = table[pos // T] * T + pos % T
        if len(self._rows) > 8:
            self._rows.clear()
        self._rows[key] = rows
        return rows

    def write(self, layer: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Writes ``[1, heads, n, dim]`` K/V of tokens ``start .. start + n - 1`` into the pages."""
        n = key_states.shape[-2]
        rows = self.rows(start, start + n)
        self.kv.k[layer].index_copy_(0, rows, key_states[0].transpose(0, 1))
        self.kv.v[layer].index_copy_(0, rows, value_states[0].transpose(0, 1))

    def read(self, layer: int, start: int, end: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[1, heads, end - start, dim]`` of tokens ``start .. end - 1``, a fresh gather in
        token order (the same values and memory layout wherever the pages are)."""
        rows = self.rows(start, end)
        keys = self.kv.k[layer].index_select(0, rows).transpose(0, 1).unsqueeze(0)
        values = self.kv.v[layer].index_select(0, rows).transpose(0, 1).unsqueeze(0)
        return keys, values


def _check_batch(key_states: torch.Tensor) -> None:
    if key_states.shape[0] != 1:
        raise ValueError("HybridPagedCache holds one request (batch size 1)")


class PagedFullLayer(DynamicLayer):
    """A full-attention layer of one request in its group's pages: ``update`` writes the new
    tokens' K/V and returns every token's (``[1, kv_heads, tokens, head_dim]``)."""

    def __init__(self, table: _GroupTable, index: int, cached_tokens: int) -> None:
        super().__init__()
        self.table, self.index, self.length = table, index, cached_tokens
        self.dtype, self.device = table.kv.dtype, table.kv.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        _check_batch(key_states)
        n = key_states.shape[-2]
        self.table.write(self.index, self.length, key_states, value_states)
        self.length += n
        return self.table.read(self.index, 0, self.length)

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("HybridPagedCache does not crop")


class PagedSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer of one request in its group's pages. ``update`` writes the new
    tokens' K/V and returns, as ``DynamicSlidingWindowLayer.update`` does, the last
    ``sliding_window - 1`` tokens seen before them and the new ones: tokens
    ``max(seen - sliding_window + 1, 0) .. seen + n - 1``, the keys the inherited
    ``get_mask_sizes`` sizes the sliding mask for. Blocks before those are never read."""

    def __init__(self, table: _GroupTable, index: int, cached_tokens: int, sliding_window: int) -> None:
        super().__init__(sliding_window=sliding_window)
        self.table, self.index = table, index
        self.cumulative_length = cached_tokens
        self.dtype, self.device = table.kv.dtype, table.kv.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        _check_batch(key_states)
        n, seen = key_states.shape[-2], self.cumulative_length
        first = max(seen - self.sliding_window + 1, 0)  # get_mask_sizes' kv_offset, before this update
        self.table.write(self.index, seen, key_states, value_states)
        self.cumulative_length = seen + n
        return self.table.read(self.index, first, seen + n)

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("HybridPagedCache does not crop")


class HybridPagedCache(Cache):
    """A transformers ``Cache`` over ``HybridPagedKV`` for one request (batch size 1).

    ``page_tables``: ``(full, sliding)``, the request's page ids of each group in token order
    (block ``b`` covers tokens ``[b * 16, (b + 1) * 16)``), enough for every token it will hold;
    a sliding entry may be ``None`` for a block before the window (never read).
    ``cached_tokens``: tokens whose K/V are already in those pages (0 cold; the restored prefix
    for a warm request). Pass it as ``past_key_values`` to a stock Gemma-3 model."""

    def __init__(
        self,
        kv: HybridPagedKV,
        page_tables: Sequence[Sequence[Optional[int]]],
        cached_tokens: int = 0,
        *,
        sliding_window: int,
    ) -> None:
        self.kv = kv
        self.tables = [_GroupTable(kv.groups[g], page_tables[g], ("full", "sliding")[g]) for g in range(2)]
        layers: List[DynamicLayer] = []
        for g, i in kv.where:
            if g == 0:
                layers.append(PagedFullLayer(self.tables[0], i, cached_tokens))
            else:
                layers.append(PagedSlidingLayer(self.tables[1], i, cached_tokens, sliding_window))
        super().__init__(layers=layers)

    @property
    def tokens(self) -> int:
        """Tokens held (every layer agrees between forwards)."""
        return self.layers[0].get_seq_length()


class HybridBench:
    """One Gemma-3 model, its two groups of paged KV memory, a kvtier ``HybridTier`` and one rank
    per group over the tensors. ``max_prefix`` (tokens) bounds the prefixes ``run_case`` takes."""

    def __init__(
        self,
        config: str = "tiny",
        device: Optional[str] = None,
        *,
        max_prefix: int = 256,
        suffix: int = 32,
        greedy: int = 8,
        seed: int = 0,
        sliding_window: Optional[int] = None,
    ) -> None:
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.config, self.suffix, self.greedy, self.seed = config, suffix, greedy, seed
        t0 = time.perf_counter()
        self.model, self.cfg = build_model(config, self.device, seed, sliding_window=sliding_window)
        self.model_init_s = time.perf_counter() - t0
        c, T = self.cfg, PAGE_TOKENS
        self.window = c.sliding_window
        prefix_pages = -(-max_prefix // T)
        self.tail_pages = -(-(suffix + greedy) // T)
        window_pages = -(-self.window // T) + 1
        # Full: a cold prefix, a disjoint warm prefix, the tail, spares. Sliding: the cold prefix
        # (every block, as the prefill writes them), the warm window, the tail, spares.
        pages = (2 * prefix_pages + self.tail_pages + 8, prefix_pages + window_pages + self.tail_pages + 8)
        self.kv = HybridPagedKV(
            c.layer_types, pages, c.num_key_value_heads, c.head_dim, page_tokens=T, device=self.device
        )
        model_name = "Gemma-3-1B" if config == "gemma3-1b" else f"Gemma-3/{config}"
        self.layout = self.kv.layout(model_name, self.window)
        slots = [g.geometry.slot_bytes for g in self.layout.groups]
        # Each group's pool: one prefix's blocks and a few spare (the sliding group keeps the window).
        pool = [(prefix_pages + 8) * slots[0], (window_pages + 8) * slots[1]]
        t0 = time.perf_counter()
        self.tier = kvtier.HybridTier(self.layout, pool, "lru")
        if self.device.type == "cuda":
            self.ranks = [self.tier.group(g).attach_cuda(self.device.index or 0, self.kv.arenas(g)) for g in range(2)]
        else:
            self.ranks = [self.tier.group(g).attach_host(self.kv.arenas(g)) for g in range(2)]
        self.attach_s = time.perf_counter() - t0

    def close(self) -> None:
        for r in self.ranks:
            r.close()

    def _stream(self):
        return torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None

    @torch.no_grad()
    def _forward(self, cache, ids: torch.Tensor, keep: int = 0):
        # Attention kernels whose forward pass is deterministic (cuDNN's is left out), so the
        # bitwise comparison compares the restore, not kernel scheduling.
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            return self.model(ids, past_key_values=cache, use_cache=True, logits_to_keep=keep)

    @torch.no_grad()
    def _greedy(self, cache, first: int) -> List[int]:
        toks = [first]
        for _ in range(self.greedy - 1):
            out = self._forward(cache, torch.tensor([[toks[-1]]], device=self.device), keep=1)
            toks.append(int(out.logits[0, -1].argmax()))
        return toks

    def _keys(self, ids: List[int], blocks: int) -> List[bytes]:
        """Lineage content keys (the layout's namespace) of the first ``blocks`` blocks."""
        ns, keys, parent = self.layout.namespace, [], None
        for b in range(blocks):
            parent = ns.chain(parent, ids[b * PAGE_TOKENS : (b + 1) * PAGE_TOKENS])
            keys.append(parent)
        return keys

    def _cache(self, tables, cached_tokens: int = 0) -> HybridPagedCache:
        return HybridPagedCache(self.kv, tables, cached_tokens, sliding_window=self.window)

    def run_case(self, prefix: int, repeats: int = 1, warmup: int = 0) -> dict:
        """The cold / save / NaN / query / restore / warm protocol for a prefix of ``prefix``
        tokens (a multiple of 16), timed ``repeats`` times after ``warmup`` runs. Returns a
        JSON-ready dict (times in ms, bytes in B, ``checks``: the comparisons)."""
        T, dev, kv = PAGE_TOKENS, self.device, self.kv
        if prefix % T or prefix <= 0:
            raise ValueError(f"prefix {prefix} is not a positive whole number of {T}-token pages")
        pp = prefix // T
        rng = random.Random(self.seed + prefix)
        gen = torch.Generator().manual_seed(self.seed + prefix)
        ids = torch.randint(0, self.cfg.vocab_size, (1, prefix + self.suffix), generator=gen)
        id_list = ids[0].tolist()
        ids = ids.to(dev)
        prefix_ids, suffix_ids = ids[:, :prefix], ids[:, prefix:]
        # Pages as a paged allocator hands them out: scattered, each group its own ids.
        perm = [list(range(g.pages)) for g in kv.groups]
        for p in perm:
            rng.shuffle(p)
        ws, we = self.layout.needed(1, pp)  # the window's blocks at the boundary
        wn = we - ws
        cold_full, warm_full = perm[0][:pp], perm[0][pp : 2 * pp]
        tail_full = perm[0][2 * pp : 2 * pp + self.tail_pages]
        cold_sliding, warm_sliding = perm[1][:pp], perm[1][pp : pp + wn]
        tail_sliding = perm[1][pp + wn : pp + wn + self.tail_pages]
        cold_tables = (cold_full + tail_full, cold_sliding + tail_sliding)
        warm_tables = (warm_full + tail_full, [None] * ws + warm_sliding + tail_sliding)
        state: dict = {}

        def timed(fn) -> float:
            _sync(dev)
            t0 = time.perf_counter()
            fn()
            _sync(dev)
            return time.perf_counter() - t0

        def series(fn, before=lambda: None) -> List[float]:
            out = []
            for i in range(warmup + repeats):
                before()
                t = timed(fn)
                if i >= warmup:
                    out.append(t)
            return out

        # 1. Cold: prefix, then suffix, in this cache.
        def cold():
            cache = self._cache(cold_tables)
            self._forward(cache, prefix_ids, keep=1)
            out = self._forward(cache, suffix_ids)
            state["cold_logits"], state["cold_cache"] = out.logits, cache

        cold_s = series(cold)
        cold_logits = state["cold_logits"].clone()
        cold_tokens = self._greedy(state["cold_cache"], int(cold_logits[0, -1].argmax()))
        del state["cold_cache"]
        cold()  # control: a second cold request decodes the same tokens
        cold_again = self._greedy(state["cold_cache"], int(state["cold_logits"][0, -1].argmax()))
        del state["cold_cache"]

        # Reference only: transformers' own cache (DynamicCache with DynamicSlidingWindowLayer).
        from transformers import DynamicCache

        stock = DynamicCache(config=self.model.config)
        self._forward(stock, prefix_ids, keep=1)
        stock_logits = self._forward(stock, suffix_ids).logits
        stock_diff = float((stock_logits.float() - cold_logits.float()).abs().max())
        stock_bitwise = torch.equal(_bits(stock_logits), _bits(cold_logits))
        del stock, stock_logits

        # 2. Save: every full-attention block; of the sliding group the window's blocks only.
        keys = self._keys(id_list, pp)
        tickets = kvtier.hybrid_save(
            self.ranks,
            self.layout,
            keys,
            [(0, cold_full), (ws, cold_sliding[ws:we])],
            after_stream=self._stream(),
            tier=self.tier,
        )
        kvtier.hybrid_wait(tickets)
        saved_blocks = [t.saving for t in tickets]
        rows_saved = [kv.groups[0].page_rows(cold_full), kv.groups[1].page_rows(cold_sliding[ws:we])]
        reference = [[a.index_select(0, rows_saved[g]) for a in kv.arenas(g)] for g in range(2)]

        # 3-4. NaN everywhere, query, restore into other pages, suffix only.
        def nan():
            kv.fill_(float("nan"))

        def warm():
            stream = self._stream()
            with self.tier.query(keys) as lease:
                assert lease.boundary == pp, f"query found a usable prefix of {lease.boundary} of {pp} blocks"
                assert lease.range(1) == (ws, we), (lease.range(1), (ws, we))
                handles = kvtier.hybrid_restore(self.ranks, lease, [warm_full, warm_sliding], after_stream=stream)
            for h in handles:
                h.stream_wait(stream if stream is not None else 0)  # no host sync on a GPU
            cache = self._cache(warm_tables, cached_tokens=prefix)
            out = self._forward(cache, suffix_ids)
            state["warm_logits"], state["warm_cache"], state["handles"] = out.logits, cache, handles

        warm_s = series(warm, before=nan)
        kvtier.hybrid_wait(state["handles"])
        warm_logits = state["warm_logits"].clone()
        rows_warm = [kv.groups[0].page_rows(warm_full), kv.groups[1].page_rows(warm_sliding)]
        pages_equal = all(
            torch.equal(_bits(r), _bits(a.index_select(0, rows_warm[g])))
            for g in range(2)
            for r, a in zip(reference[g], kv.arenas(g))
        )
        # The sliding pages the warm request does not hold are still NaN: had any been read, the
        # logits would not be finite.
        held = set(warm_sliding) | set(tail_sliding)
        unheld = [p for p in range(kv.groups[1].pages) if p not in held]
        unheld_rows = kv.groups[1].page_rows(unheld)
        unheld_nan = all(bool(torch.isnan(a.index_select(0, unheld_rows)).all()) for a in kv.arenas(1))
        warm_tokens = self._greedy(state["warm_cache"], int(warm_logits[0, -1].argmax()))
        del state["warm_cache"]

        # Control: the first sliding block the model reads really is read from the pages (a
        # page table without it refuses the suffix), so "never read" above is a fact of this
        # cache, not of a table that reads nothing.
        reads_from = max(prefix - self.window + 1, 0) // T
        short = list(warm_tables[1])
        short[reads_from] = None
        try:
            self._forward(self._cache((warm_tables[0], short), cached_tokens=prefix), suffix_ids)
            first_read_refused = False
        except LookupError:
            first_read_refused = True

        restore_bytes = self.layout.restore_bytes(pp)
        stats = [self.tier.group(g).stats() for g in range(2)]
        return {
            "prefix_tokens": prefix,
            "suffix_tokens": self.suffix,
            "prefix_blocks": pp,
            "window_blocks": [ws, we],
            "model_reads_sliding_from_block": reads_from,
            # Window blocks kvtier restores that the model does not read (1 where
            # sliding_window - 1 is a multiple of the page size, else 0).
            "extra_window_blocks": reads_from - ws,
            "saved_blocks": [len(s) for s in saved_blocks],
            "restore_bytes": restore_bytes,
            "all_layers_bytes": self.layout.all_layers_bytes(pp),
            "greedy_tokens": warm_tokens,
            "ttft_ms": {
                "cold": statistics.median(cold_s) * 1e3,
                "warm_kvtier": statistics.median(warm_s) * 1e3,
            },
            "samples_ms": {"cold": [t * 1e3 for t in cold_s], "warm_kvtier": [t * 1e3 for t in warm_s]},
            "stock_cache": {"max_abs_logit_diff": stock_diff, "bitwise_equal": stock_bitwise},
            "restored_blocks": [s["restored_blocks"] for s in stats],
            "checks": {
                "logits_bitwise_equal": torch.equal(_bits(warm_logits), _bits(cold_logits)),
                "greedy_tokens_equal": warm_tokens == cold_tokens,
                "cold_greedy_tokens_repeatable": cold_again == cold_tokens,
                "restored_pages_byte_identical": pages_equal,
                "logits_finite": bool(torch.isfinite(warm_logits.float()).all()),
                "unheld_sliding_pages_still_nan": unheld_nan,
                "window_covers_every_read": ws <= reads_from,
                "first_read_block_is_read_from_its_page": first_read_refused,
            },
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
            "layer_types": self.cfg.layer_types,
            "sliding_window": self.window,
            "group_slot_bytes": [g.geometry.slot_bytes for g in self.layout.groups],
            "group_capacity_blocks": [self.tier.group(g).capacity for g in range(2)],
        }
        try:
            import transformers

            env["transformers"] = transformers.__version__
        except ImportError:  # pragma: no cover
            pass
        if self.device.type == "cuda":
            env["gpu"] = torch.cuda.get_device_name(self.device)
        return env


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvtier.examples.hybrid_cache", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", choices=sorted(CONFIGS), default=None, help="model shape (default: gemma3-1b on a GPU, else tiny)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--prefix", default=None, help="comma-separated prefix lengths in tokens (multiples of 16); default 4096 on a GPU, 192 on a CPU")
    p.add_argument("--suffix", type=int, default=None, help="suffix tokens (default 256 on a GPU, 32 on a CPU)")
    p.add_argument("--greedy", type=int, default=16, help="greedy tokens compared after the suffix (default 16)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per measurement; the median is reported (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sliding-window", type=int, default=None, help="tokens of the sliding window (default: the config's)")
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    gpu = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    if gpu:
        # Bitwise comparisons need deterministic kernels: cuBLAS with a fixed workspace (set
        # before CUDA initialises) and torch's deterministic algorithms.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    config = args.config or ("gemma3-1b" if gpu else "tiny")
    prefixes = [int(x) for x in (args.prefix or ("4096" if gpu else "192")).split(",")]
    suffix = args.suffix if args.suffix is not None else (256 if gpu else 32)
    bench = HybridBench(
        config,
        args.device,
        max_prefix=max(prefixes),
        suffix=suffix,
        greedy=args.greedy,
        seed=args.seed,
        sliding_window=args.sliding_window,
    )
    try:
        results = []
        for prefix in prefixes:
            r = bench.run_case(prefix, repeats=args.repeats, warmup=args.warmup)
            results.append(r)
            ok = all(r["checks"].values())
            print(
                f"prefix {prefix:,} tokens: window blocks {r['window_blocks']}, restore {r['restore_bytes']:,} B "
                f"(all layers: {r['all_layers_bytes']:,} B), TTFT cold {r['ttft_ms']['cold']:.1f} ms, "
                f"warm {r['ttft_ms']['warm_kvtier']:.1f} ms, checks {'pass' if ok else 'FAIL'}: {r['checks']}",
                flush=True,
            )
        env = bench.environment()
    finally:
        bench.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": env, "results": results}, f, indent=2)
    return 0 if all(all(r["checks"].values()) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
