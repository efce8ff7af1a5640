"""kvtier.sglang without SGLang: the HiCache L3 backend over fake host pools laid out exactly like
SGLang's (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` with ``layer_first``,
``page_first``, ``page_first_direct``), every byte of every page checked. The same backend under
SGLang's own classes is tested in test_sglang_hicache.py (skipped without SGLang)."""

from __future__ import annotations

import os
import types

import pytest

torch = pytest.importorskip("torch")

import kvtier  # noqa: E402
from kvtier.errors import ConfigError, DisconnectedError, KvtierError  # noqa: E402
from kvtier.sglang import KvtierStore, StoreConfig, UnsupportedHostLayoutError, host_arenas  # noqa: E402
from kvtier.sglang.keys import page_keys  # noqa: E402

LAYERS, HEADS, DIM, PS, TOKENS = 3, 2, 8, 4, 64
MLA_DIM = 24
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


class FakeHostPool:
    """SGLang's host pool as the backend sees it: ``kv_buffer`` of SGLang's shape for the layout
    (memory_pool_host / pool_host/mha.py, pool_host/mla.py), ``layout``, ``page_size``, and
    SGLang's ``get_data_page`` (a page's flat bytes in the buffer's own order)."""

    def __init__(self, layout: str, mla: bool = False, dtype=torch.bfloat16, tokens: int = TOKENS, seed: int = 0):
        self.layout, self.page_size, self.mla = layout, PS, mla
        P = tokens // PS
        if mla:
            shape = {"layer_first": (LAYERS, tokens, 1, MLA_DIM), "page_first": (tokens, LAYERS, 1, MLA_DIM),
                     "page_first_direct": (P, LAYERS, PS, 1, MLA_DIM)}[layout]
        else:
            shape = {"layer_first": (2, LAYERS, tokens, HEADS, DIM), "page_first": (2, tokens, LAYERS, HEADS, DIM),
                     "page_first_direct": (2, P, LAYERS, PS, HEADS, DIM)}[layout]
        self.kv_buffer = torch.zeros(shape, dtype=dtype)
        self.seed = seed

    def fill(self, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv_buffer.copy_(torch.randn(self.kv_buffer.shape, generator=g).to(self.kv_buffer.dtype))

    def get_data_page(self, index: int) -> torch.Tensor:
        kv, ps = self.kv_buffer, self.page_size
        if self.layout == "page_first_direct":
            i = index // ps
            return (kv[i:i + 1] if self.mla else kv[:, i:i + 1]).flatten()
        if self.mla:
            return (kv[:, index:index + ps] if self.layout == "layer_first" else kv[index:index + ps]).flatten()
        return (kv[:, :, index:index + ps] if self.layout == "layer_first" else kv[:, index:index + ps]).flatten()


def storage_config(extra=None, *, mla=False, tp_rank=0, tp_size=1, model="tiny/model", pp_rank=0, pp_size=1):
    """The fields of SGLang's HiCacheStorageConfig the backend reads."""
    return types.SimpleNamespace(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=False, model_name=model, dp_rank=0,
        dcp_size=1, dcp_rank=0, logical_page_size=None,
        extra_config={"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore",
                      "interface_v1": 1, **({"pool": "4MiB"} if extra is None else extra)})


def geometry_of(pool):
    """The kvtier geometry of a host pool: what ``kvtierd`` must serve for it."""
    a = host_arenas(pool)
    return kvtier.Geometry.from_tensors(a.views, model="sglang", page_tokens=PS, names=a.names, layout=a.layout)


def store(pool, extra=None, **kw) -> KvtierStore:
    s = KvtierStore(storage_config(extra, mla=pool.mla, **kw), {})
    s.register_mem_pool_host(pool)
    return s


def indices(pages):
    if not pages:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([torch.arange(p * PS, (p + 1) * PS) for p in pages])


def assert_pages(dst_pool, dst_pages, expected):
    for k, (p, want) in enumerate(zip(dst_pages, expected)):
        got = dst_pool.get_data_page(p * PS)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"page {k} (host page {p}): restored bytes differ from the saved page"


@pytest.mark.parametrize("mla", [False, True], ids=["mha", "mla"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pages_saved_from_the_host_pool_come_back_byte_for_byte(layout, mla):
    pool = FakeHostPool(layout, mla)
    pool.fill(1)
    s = store(pool)
    a = host_arenas(pool)
    assert a.kind == ("mla" if mla else "mha") and a.pages == TOKENS // PS
    assert a.block_bytes == pool.get_data_page(0).numel() * 2  # a block is SGLang's flat page
    src = [3, 0, 7, 5]
    keys = ["h0", "h1", "h2", "h3"]
    saved = [pool.get_data_page(p * PS).clone() for p in src]
    assert s.batch_set_v1(keys, indices(src)) == [True] * 4
    assert s.batch_exists(keys + ["nope"]) == 4 and s.exists("h2") and not s.exists("nope")
    pool.kv_buffer.zero_()
    dst = [9, 10, 2, 14, 15]
    assert s.batch_get_v1(keys + ["nope"], indices(dst)) == [True, True, True, True, False]
    assert_pages(pool, dst[:4], saved)
    for p in set(range(TOKENS // PS)) - set(dst[:4]):  # nothing else written
        assert not pool.get_data_page(p * PS).view(torch.uint8).any(), f"host page {p} was written"
    assert s.stats["saved_pages"] == 4 and s.stats["hit_pages"] == 4 and s.stats["miss_pages"] == 1
    # Saved again: already resident, still True.
    assert s.batch_set_v1(keys[:2], indices(dst[:2])) == [True, True] and s.stats["resident_pages"] == 2
    s.close()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_older_calls_move_flat_pages_through_the_staging_buffer(layout):
    pool = FakeHostPool(layout)
    pool.fill(2)
    s = store(pool, {"pool": "4MiB", "staging_pages": 3})  # 7 pages: three staging rounds
    pages = [0, 1, 2, 3, 4, 5, 6]
    keys = [f"k{p}" for p in pages]
    flat = [pool.get_data_page(p * PS).clone() for p in pages]
    assert s.batch_set(keys, flat) is True
    assert s.set("single", flat[0]) is True
    out = s.batch_get(keys + ["missing"], [torch.zeros_like(f) for f in flat] + [torch.zeros_like(flat[0])])
    assert out[-1] is None
    for k, (got, want) in enumerate(zip(out[:-1], flat)):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"page {k}: restored bytes differ from the saved page"
    assert torch.equal(s.get("single", torch.zeros_like(flat[0])), flat[0])
    assert s.get("missing", torch.zeros_like(flat[0])) is None  # a miss, not a failure
    # The v1 path reads what the older calls stored, and the reverse.
    pool.kv_buffer.zero_()
    assert s.batch_get_v1(keys[:2], indices([8, 9])) == [True, True]
    assert_pages(pool, [8, 9], flat[:2])
    with pytest.raises(ConfigError, match="a page of this host pool is"):
        s.set("short", flat[0][:-8])
    assert s.stats["errors"] == 1


def test_keys_fold_model_layout_and_tp_rank_but_mla_shares_across_tp(socket_dir):
    path = os.path.join(socket_dir, "kvtierd.sock")
    pool = FakeHostPool("page_first")
    pool.fill(3)
    g = host_arenas(pool)
    geometry = kvtier.Geometry.from_tensors(g.views, model="sglang", page_tokens=PS, names=g.names, layout=g.layout)
    kvtier._kvtier._serve(path, geometry, 32 * geometry.slot_bytes, "lru")
    a = store(pool, {"socket": path}, tp_rank=0, tp_size=2)
    saved = [pool.get_data_page(p * PS).clone() for p in (1, 2)]
    assert a.batch_set_v1(["x", "y"], indices([1, 2])) == [True, True]
    # A second SGLang instance on the same daemon (its own host pool): the same shard hits ...
    other = FakeHostPool("page_first")
    b = store(other, {"socket": path}, tp_rank=0, tp_size=2)
    assert b.batch_get_v1(["x", "y"], indices([5, 6])) == [True, True]
    assert_pages(other, [5, 6], saved)
    # ... another TP rank, model or pipeline stage does not.
    for kw in ({"tp_rank": 1, "tp_size": 2}, {"tp_rank": 0, "tp_size": 2, "model": "other/model"},
               {"tp_rank": 0, "tp_size": 2, "pp_rank": 1, "pp_size": 2}):
        assert store(FakeHostPool("page_first"), {"socket": path}, **kw).batch_exists(["x", "y"]) == 0, kw
    # A pool of another layout cannot even attach: the error gives the kvtierd command line for it.
    with pytest.raises(ConfigError, match="kvtierd --model sglang --page-tokens 4"):
        store(FakeHostPool("layer_first"), {"socket": path})

    # MLA: one copy for every TP rank (SGLang writes it from rank 0 only).
    mpath = os.path.join(socket_dir, "mla.sock")
    mla = FakeHostPool("page_first", mla=True)
    mla.fill(4)
    m = host_arenas(mla)
    mg = kvtier.Geometry.from_tensors(m.views, model="sglang", page_tokens=PS, names=m.names, layout=m.layout)
    kvtier._kvtier._serve(mpath, mg, 32 * mg.slot_bytes, "lru")
    w = store(mla, {"socket": mpath}, tp_rank=0, tp_size=4)
    assert w.batch_set_v1(["m0", "m1"], indices([0, 1])) == [True, True]
    reader_pool = FakeHostPool("page_first", mla=True)
    reader = store(reader_pool, {"socket": mpath}, tp_rank=3, tp_size=4)
    assert reader.batch_get_v1(["m0", "m1"], indices([4, 5])) == [True, True]
    assert_pages(reader_pool, [4, 5], [mla.get_data_page(0), mla.get_data_page(PS)])


def test_failures_raise_typed_counted_errors_and_misses_do_not(socket_dir):
    pool = FakeHostPool("layer_first")
    s = KvtierStore(storage_config(), {})
    with pytest.raises(ConfigError, match="has not registered its host pool"):
        s.batch_get_v1(["a"], indices([0]))
    s.register_mem_pool_host(pool)
    with pytest.raises(ConfigError, match="need 8 host indices"):
        s.batch_set_v1(["a", "b"], indices([0]))
    with pytest.raises(ConfigError, match="not the first token of a page"):
        s.batch_get_v1(["a"], torch.arange(1, 1 + PS))
    with pytest.raises(ConfigError, match="non-empty string"):
        s.batch_exists(["a", None])
    assert s.stats["errors"] == 4
    assert s.batch_get_v1(["absent", "b"], indices([0, 1])) == [False, False]  # misses: no error
    assert s.batch_get_v1([], indices([])) == [] and s.batch_exists([]) == 0
    assert s.stats["errors"] == 4 and s.stats["miss_pages"] == 2

    # No daemon at the socket: SGLang still starts; every call raises DisconnectedError until one listens.
    path = os.path.join(socket_dir, "absent.sock")
    d = store(FakeHostPool("layer_first"), {"socket": path})
    for call in (lambda: d.batch_exists(["a"]), lambda: d.batch_get_v1(["a"], indices([0])),
                 lambda: d.batch_set_v1(["a"], indices([0]))):
        with pytest.raises(DisconnectedError):
            call()
    assert d.stats["errors"] == 3
    g = host_arenas(d.mem_pool_host)
    geometry = kvtier.Geometry.from_tensors(g.views, model="sglang", page_tokens=PS, names=g.names, layout=g.layout)
    kvtier._kvtier._serve(path, geometry, 8 * geometry.slot_bytes, "lru")
    d.link._next_try = 0.0  # the link retries at most once a second
    assert d.batch_set_v1(["a"], indices([0])) == [True] and d.batch_exists(["a"]) == 1


def test_a_full_pool_stores_the_leading_pages_and_says_which():
    pool = FakeHostPool("page_first")
    pool.fill(5)
    s = store(pool, {"pool": 4 * geometry_of(pool).slot_bytes, "policy": "lru"})
    assert s._tier.capacity == 4
    keys = [f"p{i}" for i in range(6)]
    held = s.batch_set_v1(keys[:4], indices([0, 1, 2, 3]))
    assert held == [True] * 4
    lease = s._tier.query(page_keys(s.ns, keys[:4]))
    assert len(lease) == 4  # every slot leased: nothing can be evicted
    assert s.batch_set_v1(keys[4:], indices([4, 5])) == [False, False]
    assert s.stats["dropped_pages"] == 2 and s.stats["errors"] == 0
    lease.release()
    assert s.batch_set_v1(keys[4:], indices([4, 5])) == [True, True]


def test_settings_are_checked_when_sglang_makes_the_backend():
    ok = StoreConfig.from_extra({"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore",
                                 "interface_v1": 1, "prefetch_threshold": 256, "pool": "1GiB", "ssd_path": "/tmp/x.ssd", "ssd_bytes": "2GiB"})
    assert ok.pool_bytes == 1 << 30 and ok.ssd == ("/tmp/x.ssd", 2 << 30) and ok.socket is None
    for bad, text in (({"pool_size": 1}, "unknown"), ({"socket": "/s", "pool": "1GiB"}, "daemon's own options"),
                      ({"ssd_path": "/x"}, "go together"), ({"peers": "a:1"}, "list of 'host:port'"),
                      ({"staging_pages": 0}, "from 1 to 4096"), ({"lease_ttl_s": -1}, "positive")):
        with pytest.raises(ConfigError, match=text):
            StoreConfig.from_extra(bad)
    with pytest.raises(ConfigError, match="run kvtierd and set 'socket'"):
        KvtierStore(storage_config(mla=True, tp_size=2), {})
    weird = FakeHostPool("page_first")
    weird.layout = "page_head"
    with pytest.raises(UnsupportedHostLayoutError, match="page_head"):
        store(weird)
    assert issubclass(UnsupportedHostLayoutError, KvtierError)


def test_evicted_pages_come_back_from_the_ssd_tier(tmp_path):
    pool = FakeHostPool("page_first_direct")
    pool.fill(6)
    slot = geometry_of(pool).slot_bytes
    s = store(pool, {"pool": 4 * slot, "ssd_path": str(tmp_path / "tier.ssd"), "ssd_bytes": 64 * geometry_of(pool).disk_slot_bytes,
                     "ssd_admit_uses": 1})
    keys = [f"s{i}" for i in range(10)]
    saved = [pool.get_data_page(p * PS).clone() for p in range(10)]
    for i in range(10):  # one page a call; the earlier ones leave the 4-slot pool for the SSD
        assert s.batch_set_v1([keys[i]], indices([i])) == [True]
        s._tier.flush_demotions()  # demotion is in the background: a page evicted before it is a miss
    assert s.batch_exists(keys[:2]) == 2
    pool.kv_buffer.zero_()
    assert s.batch_get_v1(keys[:2], indices([12, 13])) == [True, True]
    assert_pages(pool, [12, 13], saved[:2])
    assert s._tier.ssd_stats()["promoted_blocks"] >= 2


def test_the_backup_and_prefetch_threads_call_at_once():
    """HiCache backs up on one thread and prefetches on another, into other host pages."""
    import threading

    pool = FakeHostPool("page_first")
    pool.fill(10)
    s = store(pool, {"pool": "8MiB"})
    saved = {p: pool.get_data_page(p * PS).clone() for p in range(4)}
    assert s.batch_set_v1([f"base{p}" for p in range(4)], indices(range(4))) == [True] * 4
    errors = []

    def backup():
        try:
            for i in range(60):
                assert s.batch_set_v1([f"b{i}-{p}" for p in range(4)], indices(range(4))) == [True] * 4
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    def prefetch():
        try:
            for i in range(60):
                dst = [8 + (i % 2) * 4 + k for k in range(4)]
                assert s.batch_get_v1([f"base{p}" for p in range(4)], indices(dst)) == [True] * 4
                assert_pages(pool, dst, [saved[p] for p in range(4)])
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=backup), threading.Thread(target=prefetch)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert s.stats["errors"] == 0 and s.stats["hit_pages"] == 240
