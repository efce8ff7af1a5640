"""A paged KV cache for Hugging Face transformers whose pages are kvtier arenas.

The engine-side memory is what a paged-attention engine keeps: per layer, one K and one V tensor of
shape ``[pages * page_tokens, kv_heads, head_dim]`` (``PagedKV``). A request owns a list of page
ids in token order (its page table); token ``t`` of the request lives at row
``page_table[t // page_tokens] * page_tokens + t % page_tokens`` of every tensor. These tensors,
in the order ``[k0, v0, k1, v1, ...]``, are exactly kvtier's ``llama3-8b`` arena layout (one page id
indexes all 64 arenas), so a kvtier rank can save and restore whole pages of them.

``PagedCache`` plugs this into the stock transformers models: transformers 5.x attention calls
``past_key_values.update(key_states, value_states, layer_idx)``, which ``PagedLayer`` (a
``DynamicLayer``) answers by writing the new tokens' K/V into their pages and returning the
request's whole K/V gathered from its pages in token order. Where the pages are physically makes
no difference to the values returned, so a prefix restored into other pages gives the same logits.

Layer-wise restores: give ``PagedCache`` the handle of ``Rank.restore_layers`` (``restore=``) and
each layer's ``update`` first makes the current stream wait for that layer's restored pages
(``handle.wait_layer(layer, stream)``, no host sync), so the suffix's layer 0 runs while later
layers are still being copied. Layer-wise saves: with ``record_layers=True`` each ``update`` records
a CUDA event after writing its layer's new K/V (``layer_events``), for ``Rank.save_layers``.

Requires torch and transformers (>= 5); kvtier itself does not.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch
from transformers.cache_utils import Cache, DynamicLayer

__all__ = ["PagedKV", "PagedLayer", "PagedCache"]


class PagedKV:
    """Per-layer paged K and V tensors, ``[pages * page_tokens, kv_heads, head_dim]`` each.

    ``arenas`` lists them as kvtier arenas: ``[k0, v0, k1, v1, ...]`` with names ``k.L{l}`` and
    ``v.L{l}`` (the ``llama3-8b`` preset's order and names). Bytes per page per arena:
    ``page_tokens * kv_heads * head_dim * element_size``.
    """

    def __init__(
        self,
        layers: int,
        pages: int,
        kv_heads: int,
        head_dim: int,
        *,
        page_tokens: int = 16,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
    ) -> None:
        self.layers, self.pages, self.page_tokens = layers, pages, page_tokens
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype
        self.device = torch.device(device)
        shape = (pages * page_tokens, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(layers)]

    @property
    def arenas(self) -> List[torch.Tensor]:
        """The tensors in kvtier arena order: K and V of layer 0, K and V of layer 1, ..."""
        return [t for l in range(self.layers) for t in (self.k[l], self.v[l])]

    @property
    def arena_names(self) -> List[str]:
        """``k.L0, v.L0, k.L1, ...`` (the ``llama3-8b`` preset's names)."""
        return [n for l in range(self.layers) for n in (f"k.L{l}", f"v.L{l}")]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in one arena."""
        return self.page_tokens * self.kv_heads * self.head_dim * self.k[0].element_size()

    def fill_(self, value: float) -> None:
        """Overwrites every page of every arena with ``value`` (e.g. NaN, to prove a restore)."""
        for t in self.arenas:
            t.fill_(value)

    def rows(self, page_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Row indices (int64, on the tensors' device) of tokens ``start .. end - 1`` of a request
        whose pages are ``page_table``."""
        need = -(-end // self.page_tokens)
        if need > len(page_table):
            raise ValueError(f"tokens up to {end} need {need} pages; the page table has {len(page_table)}")
        table = torch.as_tensor(list(page_table[:need]), dtype=torch.int64)
        if self.device.type == "cuda":
            # Pinned and asynchronous: a pageable copy would block the host until everything queued
            # before it on the stream (e.g. a restore it waits for) has finished.
            table = table.pin_memory().to(self.device, non_blocking=True)
        pos = torch.arange(start, end, dtype=torch.int64, device=self.device)
        return table[pos // self.page_tokens] * self.page_tokens + pos % self.page_tokens

    def page_rows(self, pages: Sequence[int]) -> torch.Tensor:
        """Row indices of every token of ``pages`` in order (``len(pages) * page_tokens`` rows)."""
        return self.rows(pages, 0, len(pages) * self.page_tokens)


class PagedLayer(DynamicLayer):
    """One layer's view of a request in ``PagedKV``: ``update`` writes the new tokens' K/V into the
    request's pages and returns its whole K/V (``[1, kv_heads, tokens, head_dim]``) gathered from
    them in token order. Batch size 1."""

    def __init__(self, cache: "PagedCache", layer_idx: int, cached_tokens: int) -> None:
        super().__init__()
        self.cache, self.layer_idx, self.length = cache, layer_idx, cached_tokens
        kv = cache.kv
        self.dtype, self.device = kv.dtype, kv.device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != 1:
            raise ValueError("PagedCache holds one request (batch size 1)")
        kv, n = self.cache.kv, key_states.shape[-2]
        # A layer-wise restore: this layer's prefix pages must be in place before attention reads
        # them (the stream waits; the host does not).
        self.cache.wait_for_layer(self.layer_idx)
        new_rows = self.cache.rows_for(self.length, self.length + n)
        all_rows = self.cache.rows_for(0, self.length + n)
        k_arena, v_arena = kv.k[self.layer_idx], kv.v[self.layer_idx]
        # [1, heads, n, dim] -> [n, heads, dim], scattered into the pages' rows.
        k_arena.index_copy_(0, new_rows, key_states[0].transpose(0, 1))
        v_arena.index_copy_(0, new_rows, value_states[0].transpose(0, 1))
        self.cache.layer_written(self.layer_idx)
        self.length += n
        # Always a fresh gather in token order, so the attention input has the same values and the
        # same memory layout wherever the pages are.
        keys = k_arena.index_select(0, all_rows).transpose(0, 1).unsqueeze(0)
        values = v_arena.index_select(0, all_rows).transpose(0, 1).unsqueeze(0)
        return keys, values

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("PagedCache does not crop")


class PagedCache(Cache):
    """A transformers ``Cache`` over ``PagedKV`` for one request (batch size 1).

    ``page_table``: the request's page ids in token order, enough for every token it will hold
    (``PagedCache.pages_for(tokens)``); ``cached_tokens``: tokens whose K/V are already in those
    pages (0 for a cold request; the restored prefix length for a warm one). Pass it as
    ``past_key_values`` to a stock model: ``model(input_ids, past_key_values=cache)``.

    ``restore``: the ``CopyHandle`` of a ``Rank.restore_layers`` (or ``Rank.restore``) that put
    the cached tokens' pages in place; each layer waits for its own pages on the current stream
    the first time it runs; it may also be assigned after construction (``cache.restore = h``), so
    the cache can be prepared (``prepare``) before the restore is queued. ``record_layers``: record a ``torch.cuda.Event`` after each layer's
    K/V write (``layer_events``, in layer order), for a layer-wise save during the prefill.
    ``time_waits``: record a timing event on the stream just before and just after each layer's
    wait for its restored pages, so ``wait_ms()`` can say how long the stream stood at each one.
    """

    def __init__(
        self,
        kv: PagedKV,
        page_table: Sequence[int],
        cached_tokens: int = 0,
        *,
        restore=None,
        record_layers: bool = False,
        time_waits: bool = False,
    ) -> None:
        self.kv = kv
        self.page_table = list(page_table)
        self._rows: Dict[Tuple[int, int], torch.Tensor] = {}
        self.restore = restore
        self._waited = set()
        self.record_layers = record_layers
        self.layer_events: List[torch.cuda.Event] = []
        self.time_waits = time_waits
        self._wait_events: List[Tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        super().__init__(layers=[PagedLayer(self, l, cached_tokens) for l in range(kv.layers)])

    def wait_for_layer(self, layer: int) -> None:
        """Makes the current stream wait for layer ``layer``'s restored pages (once per layer; a
        whole-block handle waits for the whole copy). No-op without a ``restore`` handle."""
        if self.restore is None or layer in self._waited:
            return
        cuda = self.kv.device.type == "cuda"
        stream = torch.cuda.current_stream(self.kv.device) if cuda else 0
        timed = self.time_waits and cuda
        if timed:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record(stream)
        self.restore.wait_layer(layer, stream)
        if timed:
            after.record(stream)
            self._wait_events.append((layer, before, after))
        self._waited.add(layer)

    def wait_ms(self) -> List[Tuple[int, float]]:
        """With ``time_waits``: ``(layer, ms)`` for each layer wait so far, in the order they ran:
        how long the stream stood at that wait (the GPU time between the events recorded just
        before and just after it; about 0.01 ms when the layer's pages were already in place).
        Synchronises with those events; an empty list without ``time_waits`` or on a CPU."""
        out = []
        for layer, before, after in self._wait_events:
            after.synchronize()
            out.append((layer, before.elapsed_time(after)))
        return out

    def layer_written(self, layer: int) -> None:
        """Called after layer ``layer`` wrote its new K/V: records its event if ``record_layers``."""
        if self.record_layers and self.kv.device.type == "cuda":
            e = torch.cuda.Event()
            e.record(torch.cuda.current_stream(self.kv.device))
            self.layer_events.append(e)

    @staticmethod
    def pages_for(tokens: int, page_tokens: int = 16) -> int:
        """Pages needed for ``tokens`` tokens."""
        return -(-tokens // page_tokens)

    def rows_for(self, start: int, end: int) -> torch.Tensor:
        """Row indices of tokens ``start .. end - 1`` (computed once per forward, shared by all
        layers)."""
        key = (start, end)
        rows = self._rows.get(key)
        if rows is None:
            if len(self._rows) > 8:
                self._rows.clear()
            rows = self._rows[key] = self.kv.rows(self.page_table, start, end)
        return rows

    def prepare(self, new_tokens: int) -> None:
        """Uploads the row indices the next forward of ``new_tokens`` tokens needs (the page table),
        as an engine uploads its block tables when it schedules a request. Call it before queueing
        a layer-wise restore into these pages: an upload queued after the restore shares the copy
        engines with it and waits behind the restore's host-to-device traffic (measured on an H200:
        the layer-wise overlap is lost at 65,536 tokens)."""
        start = self.tokens
        self.rows_for(start, start + new_tokens)
        self.rows_for(0, start + new_tokens)

    def extend(self, pages: Sequence[int]) -> None:
        """Appends pages to the page table (for decoding past its end)."""
        self.page_table.extend(pages)
        self._rows.clear()

    @property
    def tokens(self) -> int:
        """Tokens held (layer 0's count; all layers agree between forwards)."""
        return self.layers[0].length if self.layers else 0

    def full_pages(self) -> List[int]:
        """The pages completely filled so far, in token order (what an engine saves)."""
        return self.page_table[: self.tokens // self.kv.page_tokens]
