"""kvtier.sglang under SGLang's own HiCache classes (sglang==0.5.23, CPU): the backend is made by
SGLang's ``StorageBackendFactory`` from the same extra config a user passes on the command line,
registered with SGLang's real host pools (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` in
``layer_first``, ``page_first``, ``page_first_direct``), and driven by the cache controller's own
L3 functions (``HiCacheController._page_set_zero_copy``, ``_page_get_zero_copy``,
``_generic_page_set``, ``_generic_page_get``, ``_storage_hit_query``) with SGLang's own page hashes.
Two SGLang processes share one daemon's pool. Every byte is checked through SGLang's
``get_data_page``.

What this does not run: an SGLang engine. sglang 0.5.23's model code needs CUDA builds on a GPU,
and on a CPU the CPU operators of an sgl-kernel built for it (``torch.ops.sgl_kernel.rmsnorm_cpu``
...), which PyPI does not ship; the HiCache storage layer itself is plain Python and torch, and
runs here whole.

Without SGLang these tests skip (reason shown with ``-rs``); with ``KVTIER_REQUIRE_SGLANG=1``
(ci/sglang.sh) a missing SGLang fails instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import types

import pytest

torch = pytest.importorskip("torch")

try:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    from sglang.srt.mem_cache.utils import get_storage_hash_str
except Exception as e:  # noqa: BLE001 - any import failure means no usable SGLang here
    if os.environ.get("KVTIER_REQUIRE_SGLANG") == "1":
        raise RuntimeError(f"KVTIER_REQUIRE_SGLANG=1 but SGLang's HiCache classes do not import: {e!r}") from e
    pytest.skip(f"SGLang's HiCache classes do not import ({type(e).__name__}: {e}); ci/sglang.sh installs sglang==0.5.23",
                allow_module_level=True)

import kvtier  # noqa: E402
from kvtier.sglang import KvtierStore, host_arenas  # noqa: E402

LAYERS, HEADS, DIM, PS, TOKENS, MLA_DIM = 3, 2, 8, 4, 64, 24
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
EXTRA = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore", "interface_v1": 1}

# The host pools, made as SGLang makes them (the device "buffers" are CPU tensors here).
POOLS = """
import torch
from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo, MLABufferInfo
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

LAYERS, HEADS, DIM, PS, TOKENS, MLA_DIM = 3, 2, 8, 4, 64, 24

def host_pool(layout, mla):
    cpu = torch.device("cpu")
    if mla:
        bufs = tuple(torch.zeros(TOKENS, 1, MLA_DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
        info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs]),
                             layer_indices=tuple(range(LAYERS)), device_layer_num=LAYERS, page_size=PS,
                             kv_lora_rank=16, qk_rope_head_dim=8, kv_cache_dim=MLA_DIM, dtype=torch.bfloat16, device=cpu)
        return MLATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS,
                                    target_layer_num=LAYERS)
    k = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    v = tuple(torch.zeros(TOKENS, HEADS, DIM, dtype=torch.bfloat16) for _ in range(LAYERS))
    bufs = KVBuffers(k=k, v=v, k_data_ptrs=torch.tensor([t.data_ptr() for t in k]),
                     v_data_ptrs=torch.tensor([t.data_ptr() for t in v]), layout=KVBufferLayout.NHD)
    info = MHABufferInfo(buffers=bufs, page_size=PS, head_num=HEADS, head_dim=DIM, v_head_dim=DIM,
                         dtype=torch.bfloat16, device=cpu)
    return MHATokenToKVPoolHost(info, 2.0, 0, PS, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=LAYERS)

def fill(pool, seed):
    g = torch.Generator().manual_seed(seed)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=g).to(pool.kv_buffer.dtype))
"""
exec(POOLS)


def storage_config(extra, *, mla, tp_rank=0, tp_size=1):
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name="tiny/random-model", extra_config={**EXTRA, **extra})


def backend(pool, extra, *, mla, **kw):
    """The backend as SGLang's controller makes it (attach_storage_backend): the factory, then
    register_mem_pool_host."""
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra, mla=mla, **kw), pool)
    b.register_mem_pool_host(pool)
    return b


def controller(b, pool):
    """The fields of HiCacheController that its L3 functions read."""
    return types.SimpleNamespace(storage_backend=b, storage_host_pool=pool, mem_pool_host=pool, page_size=PS)


def op(tokens=None):
    return types.SimpleNamespace(request_id="req-1", token_ids=tokens, last_hash=None, prefix_keys=None,
                                 is_terminated=lambda: False)


def host_indices(pages):
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def assert_same_pages(src_pool, src_pages, dst_pool, dst_pages):
    for s, d in zip(src_pages, dst_pages):
        a, b = src_pool.get_data_page(s * PS), dst_pool.get_data_page(d * PS)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"host page {d}: restored bytes differ from page {s}"


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_kvtier_block_is_the_runs_sglangs_zero_copy_backends_move(layout, mla):
    """Each page's arena runs (address, bytes) are exactly the buffers SGLang's own
    ``get_page_buffer_meta`` hands its zero-copy backends (Mooncake, NIXL) for that page."""
    pool = host_pool(layout, mla)
    a = host_arenas(pool)
    pages = [2, 5, TOKENS // PS - 1]
    ptrs, sizes = pool.get_page_buffer_meta(host_indices(pages))
    ours = []
    for p in pages:
        for v in a.views:
            stride = v.stride(0) * v.element_size() * (PS if a.layout == "tokens" else 1)
            ours.append((v.data_ptr() + p * stride, a.block_bytes // len(a.views)))
    assert sorted(zip(ptrs, sizes)) == sorted(ours)


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sglangs_controller_backs_up_and_prefetches_pages_through_kvtier(layout, mla):
    pool = host_pool(layout, mla)
    fill(pool, 7)
    b = backend(pool, {"pool": "8MiB"}, mla=mla)
    assert isinstance(b, KvtierStore) and isinstance(b, HiCacheStorage)
    assert host_arenas(pool).block_bytes == pool.get_data_page(0).numel() * pool.dtype.itemsize
    ctl = controller(b, pool)
    tokens = list(range(100, 100 + 5 * PS))
    hashes = get_storage_hash_str(tokens, None, page_size=PS)  # SGLang's own page hashes
    assert len(hashes) == 5 and all(isinstance(h, str) for h in hashes)
    src = [1, 4, 2, 9, 3]
    # Backup (HiCacheController._page_backup -> _page_set_zero_copy -> batch_set_v1).
    assert HiCacheController._page_set_zero_copy(ctl, hashes, host_indices(src)) is True
    # The hit query the prefetch thread runs (batch_exists over SGLang's hashes of the tokens).
    hit_hashes, hit_tokens = HiCacheController._storage_hit_query(ctl, op(tokens + [1, 2]))
    assert hit_hashes == hashes and hit_tokens == 5 * PS
    # Prefetch (_page_transfer -> _page_get_zero_copy -> batch_get_v1) into other host pages.
    dst = [10, 11, 12, 13, 14]
    assert HiCacheController._page_get_zero_copy(ctl, op(), hashes, host_indices(dst)) == 5
    assert_same_pages(pool, src, pool, dst)
    # A hash kvtier never saw stops the prefetch at that page; the pages before it are restored.
    partial = hashes[:2] + ["f" * 64]
    assert HiCacheController._page_get_zero_copy(ctl, op(), partial, host_indices([5, 6, 7])) == 2
    assert_same_pages(pool, src[:2], pool, [5, 6])
    b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_older_generic_path_moves_sglangs_flat_pages(layout):
    pool = host_pool(layout, False)
    fill(pool, 8)
    b = backend(pool, {"pool": "8MiB"}, mla=False)
    ctl = controller(b, pool)
    hashes = get_storage_hash_str(list(range(3 * PS)), None, page_size=PS)
    assert HiCacheController._generic_page_set(ctl, hashes, host_indices([0, 1, 2])) is True
    assert HiCacheController._generic_page_get(ctl, op(), hashes, host_indices([7, 8, 9])) == 3
    assert_same_pages(pool, [0, 1, 2], pool, [7, 8, 9])
    # Saved by the generic path, read by the zero-copy one: the same bytes under the same key.
    assert HiCacheController._page_get_zero_copy(ctl, op(), hashes, host_indices([3, 4, 5])) == 3
    assert_same_pages(pool, [0, 1, 2], pool, [3, 4, 5])


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
def test_two_sglang_processes_share_one_daemons_pool(socket_dir, mla):
    layout = "page_first"
    pool = host_pool(layout, mla)
    fill(pool, 9)
    a = host_arenas(pool)
    geometry = kvtier.Geometry.from_tensors(a.views, model="sglang", page_tokens=PS, names=a.names, layout=a.layout)
    path = os.path.join(socket_dir, "kvtierd.sock")
    kvtier._kvtier._serve(path, geometry, 64 * geometry.slot_bytes, "lru")
    writer = backend(pool, {"socket": path}, mla=mla, tp_rank=0, tp_size=2)
    hashes = get_storage_hash_str(list(range(4 * PS)), None, page_size=PS)
    assert HiCacheController._page_set_zero_copy(controller(writer, pool), hashes, host_indices([0, 1, 2, 3])) is True
    # Another SGLang process (its own host pool; for MLA another TP rank, which reads the one copy
    # rank 0 wrote) prefetches the pages from the same daemon.
    reader_rank = 1 if mla else 0
    code = POOLS + textwrap.dedent(f"""
        import types
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
        mla = {mla!r}
        pool = host_pool({layout!r}, mla)
        expected = host_pool({layout!r}, mla)
        fill(expected, 9)
        cfg = HiCacheStorageConfig(tp_rank={reader_rank}, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                   is_page_first_layout=True, model_name="tiny/random-model",
                                   extra_config={{**{EXTRA!r}, "socket": {path!r}}})
        b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
        b.register_mem_pool_host(pool)
        ctl = types.SimpleNamespace(storage_backend=b, page_size=PS)
        op = types.SimpleNamespace(request_id="r", is_terminated=lambda: False)
        idx = torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in (8, 9, 10, 11)])
        n = HiCacheController._page_get_zero_copy(ctl, op, {hashes!r}, idx)
        same = [torch.equal(pool.get_data_page(d * PS).view(torch.uint8), expected.get_data_page(s * PS).view(torch.uint8))
                for s, d in zip((0, 1, 2, 3), (8, 9, 10, 11))]
        print("restored", n, "same", same)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "restored 4 same [True, True, True, True]" in out.stdout, out.stdout + out.stderr[-2000:]
    writer.close()
