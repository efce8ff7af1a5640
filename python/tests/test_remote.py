"""kvtier.connect: a tier whose state lives in the tier daemon, shared by processes."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvtier
from conftest import PAGE_TOKENS, make_arrays, page


@pytest.fixture
def socket_path(socket_dir, geometry):
    path = os.path.join(socket_dir, "kvtierd.sock")
    kvtier._kvtier._serve(path, geometry, 8 * geometry.slot_bytes, "lru")
    return path


def test_a_connected_tier_has_the_tier_api(socket_path, geometry, arrays):
    tier = kvtier.connect(socket_path, geometry)
    assert tier.connected and tier.capacity == 8 and tier.policy == "lru" and tier.backing == "plain"
    assert tier.namespace == geometry.namespace
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"a", b"b", b"c"])
        t = rank.save(keys, [1, 2, 3])
        assert t.wait(60) and t.saving == [0, 1, 2]
        assert tier.contains(keys[0])
        with tier.query(keys) as lease:
            assert len(lease) == 3 and lease.uses_left == 1 and len(lease.token) == 16
            assert rank.restore(lease, [10, 11, 12]).wait(60)
            assert lease.settled
        for a in arrays:
            for src, dst in [(1, 10), (2, 11), (3, 12)]:
                np.testing.assert_array_equal(page(a, dst), page(a, src))
        with pytest.raises(kvtier.LeaseSettledError):
            rank.restore(lease, [13])
        with pytest.raises(kvtier.CannotFitError):
            rank.save(tier.namespace.keys([bytes([i]) for i in range(9)]), list(range(9)))
    s = tier.stats()
    assert (s["saved_blocks"], s["restored_blocks"], s["pinned_slots"], s["live_leases"]) == (3, 3, 0, 0)


CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    import kvtier
    path, token, n_arenas, pages = sys.argv[1], bytes.fromhex(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    tier = kvtier.connect(path)
    lease = tier.open_lease(token)
    arrays = [np.zeros((pages * {t}, 2, 8), dtype=np.float16) for _ in range(n_arenas)]
    with tier.attach_host(arrays) as rank:
        assert rank.restore(lease, [20, 21]).wait(60)
    for a, arr in enumerate(arrays):
        for p, src in [(20, 1), (21, 2)]:
            assert (arr[p * {t} : (p + 1) * {t}] == a * 1000 + src).all(), (a, p)
    print("restored", len(lease), lease.uses_left)
    """
).format(t=PAGE_TOKENS)


def test_another_process_restores_from_a_shared_lease(socket_path, geometry, arrays):
    tier = kvtier.connect(socket_path)
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"x", b"y"])
        assert rank.save(keys, [1, 2]).wait(60)
    lease = tier.query(keys, uses=2)
    assert tier.query(keys, uses=1).token != lease.token
    out = subprocess.run(
        [sys.executable, "-c", CHILD, socket_path, lease.token.hex(), str(len(arrays)), str(len(arrays[0]) // PAGE_TOKENS)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "restored 2 1"
    assert lease.uses_left == 1 and not lease.settled
    lease.release()
    assert tier.stats()["live_leases"] == 0


def test_no_daemon_is_a_typed_error(socket_dir, geometry):
    with pytest.raises(kvtier.DisconnectedError) as e:
        kvtier.connect(os.path.join(socket_dir, "nobody.sock"))
    assert "nobody.sock" in e.value.reason
    with pytest.raises(kvtier.ForeignLeaseError):
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain").open_lease(bytes(16))
    assert kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain").query([]).token is None


def test_evict_takes_any_count_and_clamps_it(socket_path, geometry, arrays):
    # 2**64 - 1 blocks once panicked under the eviction lock; 2**64 and more overflowed the
    # conversion. Any count beyond the pool means "every evictable block"; the tier stays usable.
    local = kvtier.Tier(geometry, 8 * geometry.slot_bytes, "lru", backing="plain")
    for tier in (local, kvtier.connect(socket_path, geometry)):
        with tier.attach_host(make_arrays()) as rank:
            keys = tier.namespace.keys([bytes([i]) for i in range(8)])
            assert rank.save(keys[:3], [0, 1, 2]).wait(60)
            assert tier.evict(2**64) == 3  # beyond usize
            assert rank.save(keys[:3], [0, 1, 2]).wait(60)
            assert tier.evict(2**64 - 1) == 3  # usize::MAX
            assert tier.evict(10**30) == 0 and tier.evict(0) == 0
            with pytest.raises(ValueError):
                tier.evict(-1)
            with pytest.raises(TypeError):
                tier.evict(1.5)
            # A full pool, then a save that must evict: the eviction path still works.
            assert rank.save(keys, range(8)).wait(60)
            more = tier.namespace.keys([b"more"])
            assert rank.save(more, [9], fit="prefix").wait(60)
            assert tier.evict(2**63) == 8 and tier.stats()["ready_slots"] == 0


def test_a_forked_child_gets_forked_child_error(socket_path, geometry, arrays):
    # The connection belongs to the process that connected: a child forked after connect (a
    # multiprocessing worker with the fork start method) gets ForkedChildError from every call,
    # with both pids, and can connect on its own.
    import json
    import os

    tier = kvtier.connect(socket_path, geometry)
    rank = tier.attach_host(arrays)
    keys = tier.namespace.keys([b"f0", b"f1"])
    assert rank.save(keys, [1, 2]).wait(60)
    lease = tier.query(keys)
    parent = os.getpid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report what each call raised, then leave without cleanup
        os.close(r)
        out = {}
        try:
            calls = {
                "stats": tier.stats,
                "query": lambda: tier.query(keys),
                "contains": lambda: tier.contains(keys[0]),
                "save": lambda: rank.save(tier.namespace.keys([b"child"]), [3]),
                "restore": lambda: rank.restore(lease, [4]),
                "release": lease.release,
            }
            for name, call in calls.items():
                try:
                    call()
                    out[name] = "returned"
                except kvtier.ForkedChildError as e:
                    out[name] = ["ForkedChildError", e.owner, e.current]
                except BaseException as e:  # noqa: B036 (reported to the parent)
                    out[name] = [type(e).__name__, str(e)]
            try:
                own = kvtier.connect(socket_path, geometry)
                out["reconnect"] = own.contains(keys[0])
            except BaseException as e:  # noqa: B036
                out["reconnect"] = [type(e).__name__, str(e)]
        finally:
            os.write(w, json.dumps(out).encode())
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        got = json.loads(f.read())
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    # Calls that reach the daemon raise ForkedChildError with both pids. (`release` of a lease
    # is a bool: it returns False in a child whose connection is not its own.)
    for name in ("stats", "query", "save", "restore"):
        assert got[name] == ["ForkedChildError", parent, pid], (name, got)
    assert got["contains"] in (["ForkedChildError", parent, pid], "returned"), got
    assert got["reconnect"] is True, got
    # The parent's connection is untouched.
    assert tier.contains(keys[0]) and len(lease) == 2 and lease.uses_left == 1
    assert rank.restore(lease, [5]).wait(60)
    rank.close()


def test_connect_defaults_to_the_daemons_default_socket(socket_dir, geometry):
    # A child process with XDG_RUNTIME_DIR set: the default socket is inside it, and connect()
    # without a path reaches a daemon served there.
    code = textwrap.dedent(
        f"""
        import os, kvtier
        path = os.fspath(kvtier.default_socket_path())
        assert path == os.path.join({str(socket_dir)!r}, "kvtierd.sock"), path
        g = kvtier.Geometry.preset("llama3-8b", 64)
        kvtier._kvtier._serve(path, g, 4 * g.slot_bytes, "lru")
        tier = kvtier.connect()
        assert tier.connected and tier.capacity == 4
        print("ok")
        """
    )
    env = {**os.environ, "XDG_RUNTIME_DIR": str(socket_dir)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
