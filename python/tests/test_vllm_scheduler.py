"""The vLLM connector's scheduler side without vLLM: the answers it gives a request vLLM cannot
admit yet (asked again every step), and the pool link that reconnects off the caller's thread."""

from __future__ import annotations

import os
import tempfile
import threading
import time

import pytest

torch = pytest.importorskip("torch")

from kvtier.errors import DisconnectedError  # noqa: E402
from kvtier.vllm import link as link_module  # noqa: E402
from kvtier.vllm import scheduler as scheduler_module  # noqa: E402
from kvtier.vllm.config import ConnectorConfig  # noqa: E402
from kvtier.vllm.keys import RequestKeys, base_namespace  # noqa: E402
from kvtier.vllm.link import PoolLink  # noqa: E402
from kvtier.vllm.plan import LoadSpec, SaveSpec, StepPlan  # noqa: E402
from kvtier.vllm.scheduler import SchedulerPlanner  # noqa: E402
from kvtier.vllm.worker import WorkerTransfers  # noqa: E402

BLOCKS, BS, HEADS, HEAD = 32, 16, 2, 16
FACTS = {"model": "test-scheduler", "block_size": BS}


def layers(n=2):
    whole = torch.zeros(n, BLOCKS, HEADS, BS, 2 * HEAD, dtype=torch.float32)
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(n)}


@pytest.fixture
def pool():
    """A worker serving an in-process pool with a request's 5 blocks saved; yields
    (worker, layers, socket, the request's tokens)."""
    sock = os.path.join(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"), "pool.sock")
    kv = layers()
    # One layer group per layer: these blocks are far under the default's 8 MiB a group.
    w = WorkerTransfers(ConnectorConfig.from_extra({"pool": "8MiB", "layer_group_bytes": 1}), FACTS, BS, 0, 1, sock,
                        serve=True)
    w.register(kv, BLOCKS)
    tokens = list(range(7, 7 + 5 * BS + 1))
    for i, t in enumerate(kv.values()):
        t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) + 1000 * i)
    keys = RequestKeys(base_namespace(FACTS), BS).upto(tokens, 5)
    w.save(StepPlan(saves=[SaveSpec("saved", keys, [1, 2, 3, 4, 5])]))
    deadline = time.monotonic() + 30
    while not w.finished({"saved"})[0] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert w.take_stored() == {"saved": 5}
    try:
        yield w, kv, sock, tokens
    finally:
        w.close()


def planner(sock):
    return SchedulerPlanner(ConnectorConfig.from_extra({"socket": sock}), FACTS, BS, 1, sock)


def test_an_answer_stands_while_its_request_waits_and_not_longer(pool, monkeypatch):
    w, kv, sock, tokens = pool
    p = planner(sock)
    try:
        # vLLM asks for a request it cannot admit yet, step after step: one query, one pinning.
        assert p.match("r", tokens, 0) == 5 * BS
        assert p.match("r", tokens, 0) == 5 * BS
        assert p.match("r", tokens, 0) == 5 * BS
        assert (p.stats["queries"], p.stats["answers_reused"]) == (1, 2)
        # The answer is still true when it is reused: its blocks are pinned, so emptying the
        # pool leaves them, and the restore it orders brings back the saved bytes.
        tier = w.link.get()[0]
        tier.evict(tier.capacity)
        # Another range (vLLM's own prefix cache now holds the first two blocks).
        assert p.match("r", tokens, 2 * BS) == 3 * BS
        assert p.stats["queries"] == 2, "the pool is asked again for another range"
        saved = [t[b].clone() for t in kv.values() for b in (3, 4, 5)]
        p.allocated("r", [1, 2, 20, 21, 22], 3 * BS)
        w.start(p.take_plan())
        for name in kv:
            w.wait_layer(name)
        w.wait_loads()
        assert w.take_errors() == set() and w.take_loaded() == {"r"}
        assert all(torch.equal(a, t[b]) for a, (t, b) in zip(saved, [(t, b) for t in kv.values() for b in (20, 21, 22)]))
        assert (w.stats["layer_waits"], w.stats["layers_unwaited"]) == (2, 0)
        # An answer older than half the lease's TTL is asked again (its pins may be near their end).
        p.match("s", tokens, 0)
        monkeypatch.setattr(p, "config", ConnectorConfig.from_extra({"socket": sock, "lease_ttl_s": 1e-9}))
        p.match("s", tokens, 0)
        assert p.stats["queries"] == 4
    finally:
        p.close()


def test_a_miss_stands_for_a_moment_then_the_pool_is_asked_again(pool, monkeypatch):
    _, _, sock, tokens = pool
    p = planner(sock)
    try:
        other = [t + 1 for t in tokens]
        assert p.match("m", other, 0) == 0
        assert p.match("m", other, 0) == 0
        assert (p.stats["queries"], p.stats["answers_reused"]) == (1, 1)
        monkeypatch.setattr(scheduler_module, "MISS_HOLD_S", 0.0)
        time.sleep(0.001)
        assert p.match("m", other, 0) == 0
        assert p.stats["queries"] == 2
    finally:
        p.close()


def test_a_restore_the_forward_did_not_wait_for_layer_by_layer_is_counted(pool):
    w, kv, sock, tokens = pool
    keys = RequestKeys(base_namespace(FACTS), BS).upto(tokens, 2)
    w.start(StepPlan(loads=[LoadSpec("u", keys, [10, 11])]))
    w.wait_layer(next(iter(kv)))  # layer 0 only
    w.wait_layer("model.layers.9.mlp")  # not a KV layer: ignored
    w.wait_loads()
    assert w.take_errors() == set()
    assert (w.stats["layer_waits"], w.stats["layers_unwaited"]) == (1, 1)


def test_layer_groups_hold_layer_group_bytes_and_one_wait_covers_a_group(pool, monkeypatch):
    w, kv, sock, tokens = pool
    per_block = w.geometry.block_bytes
    assert w.layer_groups(5) == 2, "layer_group_bytes 1: one group per layer"
    monkeypatch.setattr(w, "config", ConnectorConfig.from_extra({"pool": "8MiB", "layer_group_bytes": 2 * per_block}))
    assert [w.layer_groups(n) for n in (1, 2, 3, 4, 5)] == [1, 1, 1, 2, 2]
    monkeypatch.setattr(w, "config", ConnectorConfig.from_extra({"pool": "8MiB"}))
    assert w.config.layer_group_bytes == 8 << 20 and w.layer_groups(5) == 1
    # One group: the wait before layer 0 covers layer 1 too, and the bytes are the saved ones.
    keys = RequestKeys(base_namespace(FACTS), BS).upto(tokens, 3)
    saved = [t[b].clone() for t in kv.values() for b in (1, 2, 3)]
    w.start(StepPlan(loads=[LoadSpec("g", keys, [12, 13, 14])]))
    for name in kv:
        w.wait_layer(name)
    w.wait_loads()
    assert w.take_errors() == set() and w.take_loaded() == {"g"}
    assert (w.stats["layer_waits"], w.stats["layers_unwaited"]) == (1, 0)
    assert all(torch.equal(a, t[b]) for a, (t, b) in zip(saved, [(t, b) for t in kv.values() for b in (12, 13, 14)]))


class _Waits:
    """A restore's handle that records the layers the worker waits for."""

    def __init__(self, handle):
        self.handle, self.layers = handle, []

    def wait_layer(self, layer, stream):
        self.layers.append(layer)
        return self.handle.wait_layer(layer, stream)

    def __getattr__(self, name):
        return getattr(self.handle, name)


def test_uneven_layer_groups_take_one_wait_each_at_their_first_layer():
    sock = os.path.join(tempfile.mkdtemp(prefix="kvs-", dir="/tmp"), "pool.sock")
    kv = layers(5)
    w = WorkerTransfers(ConnectorConfig.from_extra({"pool": "8MiB"}), FACTS, BS, 0, 1, sock, serve=True)
    w.register(kv, BLOCKS)
    try:
        for i, t in enumerate(kv.values()):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) - 1000 * i)
        tokens = list(range(3, 3 + 2 * BS + 1))
        keys = RequestKeys(base_namespace(FACTS), BS).upto(tokens, 2)
        w.save(StepPlan(saves=[SaveSpec("s", keys, [4, 5])]))
        deadline = time.monotonic() + 30
        while not w.finished({"s"})[0] and time.monotonic() < deadline:
            time.sleep(0.001)
        saved = [t[b].clone() for t in kv.values() for b in (4, 5)]
        # Two blocks hold two groups' worth: layers [0, 2) and [2, 5).
        w.config = ConnectorConfig.from_extra({"pool": "8MiB", "layer_group_bytes": w.geometry.block_bytes})
        assert w.layer_groups(2) == 2
        w.start(StepPlan(loads=[LoadSpec("g", keys, [20, 21])]))
        (load,) = w._sync
        waits = _Waits(load.handle[0])
        load.handle = (waits, load.handle[1])
        for name in kv:
            w.wait_layer(name)
        w.wait_loads()
        assert waits.layers == [0, 2], "one wait at each group's first layer"
        assert (w.stats["layer_waits"], w.stats["layers_unwaited"]) == (2, 0)
        assert w.take_errors() == set() and w.take_loaded() == {"g"}
        assert all(torch.equal(a, t[b]) for a, (t, b) in zip(saved, [(t, b) for t in kv.values() for b in (20, 21)]))
    finally:
        w.close()


def test_the_first_open_is_inline_and_reconnections_run_off_the_callers_thread(monkeypatch):
    threads = []
    gate = threading.Event()
    outcomes = iter(["ok", "fail", "slow"])

    def open_pool():
        threads.append(threading.current_thread().name)
        what = next(outcomes)
        if what == "fail":
            raise DisconnectedError("no daemon")
        if what == "slow":
            gate.wait(30)
        return what

    link = PoolLink("the test pool", open_pool, reconnect_s=1e-6, wait_s=0.01)
    assert link.get() == "ok" and threads == [threading.current_thread().name]
    link.failed(DisconnectedError("lost"))
    assert link.lost == 1
    time.sleep(0.001)
    assert link.get() is None  # the reconnection failed (on its own thread)
    assert threads[1] == "kvtier-reconnect"
    time.sleep(0.001)
    # A daemon that does not answer: the caller goes on without the pool, again and again.
    assert link.get() is None
    assert link.get() is None
    assert threads[2:] == ["kvtier-reconnect"]
    gate.set()
    deadline = time.monotonic() + 30
    while (value := link.get()) is None and time.monotonic() < deadline:
        time.sleep(0.001)
    assert value == "slow" and link.opened == 2


def test_a_fault_of_ours_on_the_reconnecting_thread_reaches_the_caller():
    calls = []

    def open_pool():
        calls.append(1)
        if len(calls) == 1:
            raise DisconnectedError("no daemon")
        raise ZeroDivisionError("a bug")

    link = PoolLink("the test pool", open_pool, reconnect_s=1e-6, wait_s=5.0)
    assert link.get() is None
    time.sleep(0.001)
    with pytest.raises(ZeroDivisionError):
        link.get()
    assert link_module.RECONNECT_WAIT_S <= 0.1
