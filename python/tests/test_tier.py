"""Save, query, restore and verify bytes through the host backend (numpy arrays as arenas)."""

import threading

import numpy as np
import pytest

import kvtier
from conftest import HEADS, DIM, LAYERS, PAGE_TOKENS, PAGES, make_arrays, page


def test_geometry_from_tensors_reads_shape_stride_and_element_size(geometry, arrays):
    assert geometry.model == "test-model"
    assert geometry.page_tokens == 16
    assert len(geometry) == 2 * LAYERS
    assert geometry.pages == PAGES
    assert geometry.block_bytes == 2 * LAYERS * 512
    assert geometry.slot_bytes == 2 * LAYERS * 512  # 512 B chunks are 256 B aligned already
    assert geometry.arenas[0] == {"name": "k.L0", "bytes_per_page": 512, "page_stride": 512, "pages": PAGES}
    assert geometry.arenas[3]["name"] == "v.L1"


def test_pages_layout_and_strided_views_of_a_fused_buffer():
    # One buffer [pages, 2 (k|v), 16, heads, dim]: each of K and V is a strided view whose page
    # stride is twice its page size; the two views interleave page by page.
    fused = np.zeros((PAGES, 2, PAGE_TOKENS, HEADS, DIM), dtype=np.float16)
    views = [fused[:, 0], fused[:, 1]]
    g = kvtier.Geometry.from_tensors(views, model="fused", layout="pages", names=["k", "v"])
    assert [(a["bytes_per_page"], a["page_stride"]) for a in g.arenas] == [(512, 1024), (512, 1024)]
    t = kvtier.Tier(g, 4 * g.slot_bytes, backing="plain")
    with t.attach_host(views, layout="pages") as r:
        fused[3] = 7
        k = t.namespace.keys([b"page-3"])
        r.save(k, [3]).wait()
        with t.query(k) as lease:
            r.restore(lease, [9]).wait()
        assert (fused[9] == 7).all()
        assert (fused[8] == 0).all() and (fused[10] == 0).all()


def test_preset_matches_tensors_with_the_same_layout():
    g = kvtier.Geometry.preset("llama3-8b", 4)
    assert len(g) == 64 and g.block_bytes == 64 * 32768 and g.pages == 4
    assert g.arenas[0]["name"] == "k.L0" and g.arenas[1]["name"] == "v.L0"
    assert "llama3-8b" in kvtier.Geometry.presets()
    # bf16 [pages*16, 8, 128] tensors are 32,768 B per page: int16 arrays of the same shape stand in.
    arrs = [np.zeros((4 * 16, 8, 128), dtype=np.int16) for _ in range(64)]
    names = [a["name"] for a in g.arenas]
    g2 = kvtier.Geometry.from_tensors(arrs, model="Llama-3-8B", names=names)
    assert g2.namespace == g.namespace
    assert g2 == g


def test_save_query_restore_verifies_bytes(tier, rank, arrays):
    ns = tier.namespace
    keys = ns.keys([b"block-a", b"block-b", b"block-c"])
    assert all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    ticket = rank.save(keys, [1, 2, 3])
    assert ticket.wait() is True
    assert ticket.saving == [0, 1, 2] and ticket.resident == 0 and ticket.in_flight == 0 and ticket.dropped == 0
    assert ticket.handle.blocks == 3 and ticket.handle.bytes == 3 * tier.geometry.block_bytes
    assert ticket.handle.cuda_event is None  # host backend
    for k in keys:
        assert tier.contains(k)
    with tier.query(keys + [ns.key(b"missing")]) as lease:
        assert len(lease) == 3 and lease.keys == keys
        assert lease.uses_left == 1 and not lease.settled
        h = rank.restore(lease, [20, 11, 30])
        assert h.wait() is True and h.done()
        assert lease.settled  # its one use is consumed
    for a, x in enumerate(arrays):
        assert (page(x, 20) == a * 1000 + 1).all()
        assert (page(x, 11) == a * 1000 + 2).all()
        assert (page(x, 30) == a * 1000 + 3).all()
        assert (page(x, 12) == a * 1000 + 12).all()  # untouched
    s = tier.stats()
    assert s["saved_blocks"] == 3 and s["restored_blocks"] == 3
    assert s["bytes_saved"] == s["bytes_restored"] == 3 * tier.geometry.block_bytes
    assert s["hit_blocks"] == 3 and s["miss_blocks"] == 1 and s["queries"] == 1
    assert s["pinned_slots"] == 0 and s["ready_slots"] == 3 and s["capacity"] == 8
    assert rank.load() == {"save_gpu_pages": 0, "restore_slots": 0, "batches": 0}


def test_saving_again_skips_resident_keys_and_prefix_fit_drops_the_rest(tier, rank):
    keys = tier.namespace.keys([bytes([i]) for i in range(10)])
    assert rank.save(keys[:2], [0, 1]).wait()
    t = rank.save(keys[:2], [0, 1])
    assert t.resident == 2 and t.saving == [] and t.done()
    assert tier.stats()["save_skipped_resident"] == 2


def test_prefix_fit_saves_what_fits_and_drops_the_rest(geometry, arrays):
    tier = kvtier.Tier(geometry, 8 * geometry.slot_bytes, "lru", backing="plain")
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([bytes([i]) for i in range(10)])
        t = rank.save(keys, list(range(10)), fit="prefix")
        t.wait()
        assert (t.resident, t.saving, t.dropped) == (0, list(range(8)), 2)
        assert tier.stats()["save_dropped"] == 2 and tier.stats()["ready_slots"] == 8


def test_lease_context_manager_releases_on_exit_also_on_error(tier, rank):
    keys = tier.namespace.keys([b"x"])
    rank.save(keys, [0]).wait()
    with pytest.raises(RuntimeError):
        with tier.query(keys) as lease:
            assert tier.stats()["pinned_slots"] == 1
            raise RuntimeError("engine failed")
    assert lease.settled and tier.stats()["pinned_slots"] == 0
    with pytest.raises(kvtier.LeaseSettledError):
        rank.restore(lease, [5])
    # An empty lease is falsy and settled from birth.
    with tier.query(tier.namespace.keys([b"nothing"])) as empty:
        assert not empty and len(empty) == 0 and empty.settled
    # release() settles once.
    lease = tier.query(keys)
    assert lease.release() is True and lease.release() is False


def test_shared_lease_serves_several_ranks(tier, geometry):
    a, b = make_arrays(), make_arrays()
    for x in b:
        x[:] = 0
    with tier.attach_host(a) as ra, tier.attach_host(b) as rb:
        assert (ra.id, rb.id) == (0, 1)
        keys = tier.namespace.keys([b"p0", b"p1"])
        ra.save(keys, [4, 5]).wait()
        with tier.query(keys, uses=2) as lease:
            ra.restore(lease, [6, 7]).wait()
            assert lease.uses_left == 1
            rb.restore(lease, [0, 1]).wait()
        for i, x in enumerate(b):
            assert (page(x, 0) == i * 1000 + 4).all() and (page(x, 1) == i * 1000 + 5).all()


def test_keys_from_bytes_and_lineage_keys(tier):
    ns = tier.namespace
    assert len(ns.digest) == 16
    k1 = ns.key(b"engine-block-hash")
    assert k1 == ns.key(bytearray(b"engine-block-hash")) == ns.key(memoryview(b"engine-block-hash"))
    assert ns.key(b"a" * 100) != ns.key(b"a" * 99)
    # 16-byte hashes and arbitrary lengths share one function; other namespaces give other keys.
    other = kvtier.Namespace.from_description(b"another-model")
    assert other.key(b"engine-block-hash") != k1
    assert kvtier.Namespace(ns.digest) == ns and hash(kvtier.Namespace(ns.digest)) == hash(ns)
    # A fixed value (XXH3-128 over 16 zero bytes then b"kvtier"), as the Rust test asserts.
    assert kvtier.Namespace(bytes(16)).key(b"kvtier").hex() == "d2f850f29ca241b996008cdd90cec5bb"
    # Lineage: a page's key depends on its parent's.
    first = ns.chain(None, [1, 2, 3])
    assert ns.chain(first, [4, 5]) != ns.chain(None, [4, 5])
    assert ns.chain(first, np.array([4, 5])) == ns.chain(first, [4, 5])
    with pytest.raises(TypeError):
        ns.key("a str is not bytes")
    with pytest.raises(kvtier.KeyLengthError):
        tier.query([b"short"])
    with pytest.raises(TypeError):
        tier.query(k1)  # one key is not a sequence of keys


def test_pages_from_numpy_and_ranges(tier, rank, arrays):
    keys = tier.namespace.keys([b"n0", b"n1"])
    rank.save(keys, np.array([3, 4], dtype=np.int64)).wait()
    with tier.query(keys) as lease:
        rank.restore(lease, range(14, 16)).wait()
    assert (page(arrays[0], 15) == 4).all()


def test_a_rank_holds_its_arrays_until_closed(tier):
    import gc
    import weakref

    class Arr(np.ndarray):
        pass

    arrs = [x.view(Arr) for x in make_arrays()]
    refs = [weakref.ref(a) for a in arrs]
    r = tier.attach_host(arrs)
    del arrs
    gc.collect()
    assert all(w() is not None for w in refs), "the rank must keep its arenas alive"
    r.close()
    assert r.closed
    gc.collect()
    assert all(w() is None for w in refs)
    with pytest.raises(kvtier.ShuttingDownError):
        r.save([], [])
    r.close()  # idempotent


def test_wait_releases_the_gil_while_a_slow_copy_runs():
    """A Python thread counts while the main thread is inside `wait()` on a 128 MiB restore (the
    host backend copies on the rank's thread). The switch interval is raised so the interpreter
    never preempts the main thread: the counter can advance only if `wait` released the GIL, so a
    GIL-holding `wait` fails every attempt. (An attempt can also miss if the OS does not run the
    counting thread before the copy ends; three attempts make that negligible.)"""
    import sys

    layers, pages = 8, 128
    arrs = [np.ones((pages * 16, 16, 64), dtype=np.float32) for _ in range(2 * layers)]  # 64 KiB pages
    g = kvtier.Geometry.from_tensors(arrs, model="gil-test")
    t = kvtier.Tier(g, (pages // 2) * g.slot_bytes, backing="plain")
    with t.attach_host(arrs) as r:
        keys = t.namespace.keys([i.to_bytes(4, "little") for i in range(pages // 2)])
        r.save(keys, range(pages // 2)).wait()
        old = sys.getswitchinterval()
        counts = []
        try:
            sys.setswitchinterval(1000.0)
            for _attempt in range(3):
                state, counted, box, go = [0], [0], [None], threading.Event()

                def count():
                    go.wait()
                    h = box[0]
                    while not h.done():  # read without the main thread: never blocks on it
                        if state[0] == 1:
                            counted[0] += 1

                th = threading.Thread(target=count)
                th.start()
                with t.query(keys) as lease:
                    # 64 blocks x 2 MiB, copied on the rank's thread.
                    box[0] = r.restore(lease, range(pages // 2, pages))
                go.set()
                state[0] = 1  # main is about to enter wait(); nothing can preempt it before
                assert box[0].wait() is True
                state[0] = 2
                th.join()
                counts.append(counted[0])
                if counted[0] > 0:
                    break
        finally:
            sys.setswitchinterval(old)
        assert max(counts) > 0, f"no Python thread ran while wait() blocked (counts {counts}): the GIL was held"


def test_torch_cpu_tensors_are_arenas_too():
    torch = pytest.importorskip("torch")
    kv = [torch.zeros((PAGES * 16, HEADS, DIM), dtype=torch.bfloat16) for _ in range(4)]
    g = kvtier.Geometry.from_tensors(kv, model="torch-cpu")
    assert g.block_bytes == 4 * 512
    t = kvtier.Tier(g, 4 * g.slot_bytes, backing="plain")
    with t.attach_host(kv) as r:
        for i, x in enumerate(kv):
            x[16:32] = i + 1.5
        keys = t.namespace.keys([b"t"])
        h = r.save(keys, [1], after_stream=None)
        h.wait()
        with t.query(keys) as lease:
            h = r.restore(lease, [7])
            h.stream_wait(0)  # host rank: waits on the host
            assert h.done()
        for i, x in enumerate(kv):
            assert torch.equal(x[7 * 16 : 8 * 16], torch.full((16, HEADS, DIM), i + 1.5, dtype=torch.bfloat16))


def test_tier_reports_its_configuration(tier):
    assert tier.capacity == 8 and tier.policy == "lru" and tier.backing == "plain"
    assert "Tier(" in repr(tier)
    assert kvtier.Tier(tier.geometry, 4 * tier.geometry.slot_bytes, "s3fifo", backing="plain").policy == "s3fifo"
    assert isinstance(kvtier.cuda_available(), bool)
    assert kvtier.__version__ == "0.1.0"


def test_the_eviction_lock_counts_the_saves_that_evict(geometry, arrays):
    tier = kvtier.Tier(geometry, 4 * geometry.slot_bytes, "lru", backing="plain")
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"a", b"b", b"c", b"d", b"e"])
        rank.save(keys[:4], [0, 1, 2, 3]).wait()
        assert tier.eviction_lock_stats() == {"holds": 0, "wait_ns": 0, "held_ns": 0}  # the free slots sufficed
        rank.save(keys[4:], [4]).wait()  # evicts one block: one hold
        assert tier.evict(1) == 1  # one more
        s = tier.eviction_lock_stats()
        assert set(s) == {"holds", "wait_ns", "held_ns"}
        assert s["holds"] == 2 and s["held_ns"] > 0
        assert tier.stats()["evictions"] == 2


def test_hints_keep_queued_keys_from_eviction(geometry, arrays):
    tier = kvtier.Tier(geometry, 4 * geometry.slot_bytes, "lru", backing="plain")
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"a", b"b", b"c", b"d"])
        rank.save(keys, [0, 1, 2, 3]).wait()
        hint = tier.hint(keys[:1])  # the oldest block: LRU's first victim without the hint
        more = tier.namespace.keys([b"e"])
        rank.save(more, [4]).wait()
        assert tier.contains(keys[0]) and not tier.contains(keys[1])
        assert tier.withdraw_hint(hint) and not tier.withdraw_hint(hint)
        with pytest.raises(kvtier.ConfigError):
            tier.hint(keys, ttl_s=-1.0)
