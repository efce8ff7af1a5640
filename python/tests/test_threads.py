"""Threads and the GIL: no pair of calls can deadlock, and no daemon round trip holds the GIL.

A deadlock between the GIL and a lock of the binding hangs the whole interpreter, where no
``join(timeout)`` can report it: each scenario runs in a child process, which the test gives a
bounded time (a hang fails the test, and faulthandler prints every thread's stack first). Inside,
each thread is joined with a timeout too. Nothing here measures speed.

Connected-tier scenarios talk to the daemon through ``_relay.Relay``, a relay run by Python
threads: a call gets its reply only while its thread has released the GIL, and ``hold()`` keeps
a thread inside a round trip (deterministically) while another thread acts.
"""

import os
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

# Seconds a scenario's process may run; a deadlock makes it run until then.
LIMIT = int(os.environ.get("KVTIER_TEST_HANG_S", "150"))

PRELUDE = """
import faulthandler, gc, os, sys, threading
import numpy as np
import kvtier
from _relay import Relay

faulthandler.dump_traceback_later({dump}, exit=True)  # a hang: every thread's stack, then exit 1
tmp = sys.argv[1]


def host_arrays(pages, arenas=2, heads=1, dim=8, dtype=np.float16):
    '''Arenas [pages * 16, heads, dim]; page p holds the value p % 1024 (exact in float16).'''
    fill = np.repeat(np.arange(pages) % 1024, 16).astype(dtype)[:, None, None]
    return [np.broadcast_to(fill, (pages * 16, heads, dim)).copy() for _ in range(arenas)]


def keys_of(tier, n, tag=b""):
    return tier.namespace.keys([tag + i.to_bytes(4, "little") for i in range(n)])


def served(geometry, slots):
    '''A daemon on a thread of this process, and a relay in front of it: (relay, connected tier).'''
    daemon = os.path.join(tmp, "daemon.sock")
    kvtier._kvtier._serve(daemon, geometry, slots * geometry.slot_bytes, "lru")
    relay = Relay(daemon, os.path.join(tmp, "relay.sock"))
    return relay, kvtier.connect(relay.path, geometry)


def in_thread(fn):
    '''Runs fn on a thread; returns (thread, box): box[0] is its result or the exception it raised.'''
    box = []

    def run():
        try:
            box.append(fn())
        except BaseException as e:  # noqa: B036 (reported by the caller)
            box.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, box


def joined(t, what):
    t.join(60)
    assert not t.is_alive(), what + " did not return within 60 s"
"""


def run_scenario(socket_dir, body):
    code = PRELUDE.format(dump=LIMIT - 10) + textwrap.dedent(body) + "\nprint('ok')\n"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HERE, env.get("PYTHONPATH")) if p)
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, str(socket_dir)],
            capture_output=True,
            text=True,
            timeout=LIMIT,
            env=env,
            cwd=socket_dir,
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the scenario hung for {LIMIT} s (a deadlock):\n{e.stderr}")
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), (
        f"exit {out.returncode} (a hang shows as faulthandler's stack dump):\n{out.stdout}\n{out.stderr}"
    )


# --- Rank.close() against a call in progress on another thread --------------------------------


def test_close_while_another_thread_drains(socket_dir):
    # drain() waits (GIL released) for a 64 MiB restore; close() comes from the main thread,
    # which takes the GIL back the moment drain() releases it.
    run_scenario(
        socket_dir,
        """
        arrs = host_arrays(128, arenas=16, heads=16, dim=64, dtype=np.float32)  # 64 KiB pages
        g = kvtier.Geometry.from_tensors(arrs, model="close-drain")
        tier = kvtier.Tier(g, 64 * g.slot_bytes, backing="plain")
        for attempt in range(3):
            rank = tier.attach_host(arrs)
            keys = keys_of(tier, 64, bytes([attempt]))
            assert rank.save(keys, range(64)).wait(60)
            with tier.query(keys) as lease:
                h = rank.restore(lease, range(64, 128))
            entered = [False]

            def drain():
                entered[0] = True  # no GIL release between here and drain()'s own
                try:
                    rank.drain()
                except kvtier.ShuttingDownError:
                    pass  # close() came first
                return "drained"

            t, box = in_thread(drain)
            while not entered[0]:
                pass  # holds the GIL: the interpreter switches to the drainer after 5 ms
            rank.close()
            joined(t, "drain()")
            assert box == ["drained"], box
            assert h.wait(60) and rank.closed
            tier.evict(64)
        """,
    )


@pytest.mark.parametrize("call", ["save", "restore"])
def test_close_while_another_thread_saves_or_restores_in_process(socket_dir, call):
    # A save of 65,536 blocks or a restore of as many: long GIL-released sections, entered by a
    # thread that the main thread then interrupts with close().
    run_scenario(
        socket_dir,
        f"""
        call = {call!r}
        n = 1 << 16
        arrs = host_arrays(n, arenas=1)  # 256 B pages
        g = kvtier.Geometry.from_tensors(arrs, model="close-copy")
        tier = kvtier.Tier(g, n * g.slot_bytes, backing="plain")
        for attempt in range(5):
            rank = tier.attach_host(arrs)
            keys = keys_of(tier, n, bytes([attempt]))
            if call == "restore":
                assert rank.save(keys, range(n)).wait(60)
                lease = tier.query(keys)
                assert len(lease) == n
            entered = [False]

            def copy():
                entered[0] = True
                try:
                    if call == "save":
                        h = rank.save(keys, range(n)).handle
                    else:
                        h = rank.restore(lease, range(n))
                except kvtier.ShuttingDownError:
                    return "closed first"
                return h.wait(60)

            t, box = in_thread(copy)
            while not entered[0]:
                pass
            rank.close()
            joined(t, call + "()")
            assert box in ([True], ["closed first"]), box
            assert rank.closed
            if call == "restore":
                lease.release()
            tier.evict(n)
        """,
    )


@pytest.mark.parametrize("call", ["save", "restore"])
def test_close_while_another_thread_is_in_a_daemon_round_trip(socket_dir, call):
    # The relay holds the save's (or restore's) request: that thread is inside its round trip
    # with the GIL released. The main thread lets the request go and, keeping the GIL (no switch
    # for 1,000 s), calls close(): the relay can forward only once close() releases the GIL.
    run_scenario(
        socket_dir,
        f"""
        call = {call!r}
        arrs = host_arrays(32, arenas=2)
        g = kvtier.Geometry.from_tensors(arrs, model="close-remote")
        relay, tier = served(g, 8)
        rank = tier.attach_host(arrs)
        keys = keys_of(tier, 2)
        if call == "restore":
            assert rank.save(keys, [1, 2]).wait(60)
            lease = tier.query(keys)
        relay.hold()
        if call == "save":
            t, box = in_thread(lambda: rank.save(keys, [1, 2]).wait(60))
        else:
            t, box = in_thread(lambda: rank.restore(lease, [3, 4]).wait(60))
        assert relay.held.wait(60), "the request never reached the relay"
        sys.setswitchinterval(1000.0)
        relay.let_go()
        rank.close()
        sys.setswitchinterval(0.005)
        joined(t, call + "()")
        assert box == [True], box
        assert rank.closed
        if call == "restore":
            for a in arrs:
                assert (a[3 * 16 : 5 * 16] == a[1 * 16 : 3 * 16]).all()
        s = tier.stats()
        assert s["pinned_slots"] == 0 and s["live_leases"] == 0, s
        """,
    )


# --- daemon round trips release the GIL ----------------------------------------------------


def test_every_daemon_round_trip_releases_the_gil(socket_dir):
    # Through the relay, a call that kept the GIL across its round trip would get no reply until
    # the client's reply timeout, then raise DisconnectedError.
    run_scenario(
        socket_dir,
        """
        arrs = host_arrays(32, arenas=2)
        g = kvtier.Geometry.from_tensors(arrs, model="gil-remote")
        relay, tier = served(g, 8)
        with tier.attach_host(arrs) as rank:  # attach: a round trip
            keys = keys_of(tier, 3)
            assert rank.save(keys, [1, 2, 3]).wait(60)
            # contains() answers False on a lost connection: a GIL-holding round trip shows here.
            assert tier.contains(keys[0]), "contains() got no reply: it kept the GIL across its round trip"
            assert not tier.contains(keys_of(tier, 1, b"x")[0])
            lease = tier.query(keys, uses=2)
            assert len(lease) == 3 and lease.uses_left == 2 and not lease.settled
            assert "uses_left=2" in repr(lease) and "settled=False" in repr(lease)
            assert rank.restore(lease, [4, 5, 6]).wait(60)
            assert lease.uses_left == 1
            assert lease.release() is True and lease.settled and lease.uses_left == 0
            with tier.query(keys) as held:
                assert not held.settled
            assert held.settled  # __exit__ released it
            # Hold the first handle: a lease dropped before `open_lease` runs may be released
            # first, and its token then names a settled lease.
            first = tier.query(keys)
            other = tier.open_lease(first.token)
            assert len(other) == 3 and other.release()
            first.release()
            h = tier.hint(keys)
            assert tier.withdraw_hint(h)
            assert tier.evict(1) == 1
        assert tier.stats()["pinned_slots"] == 0
        """,
    )


def test_a_lease_collected_while_another_thread_holds_the_connection(socket_dir):
    # One thread is inside a round trip (stats, held by the relay); the main thread drops the
    # last reference to an unreleased lease. Its garbage collection must not wait for the
    # connection with the GIL held (the relay could then never let the round trip finish).
    run_scenario(
        socket_dir,
        """
        arrs = host_arrays(32, arenas=2)
        g = kvtier.Geometry.from_tensors(arrs, model="gc-remote")
        relay, tier = served(g, 8)
        with tier.attach_host(arrs) as rank:
            keys = keys_of(tier, 2)
            assert rank.save(keys, [1, 2]).wait(60)
        lease = tier.query(keys)
        assert len(lease) == 2
        relay.hold()
        t, box = in_thread(tier.stats)
        assert relay.held.wait(60), "the request never reached the relay"
        del lease
        gc.collect()
        relay.let_go()
        joined(t, "stats()")
        assert isinstance(box[0], dict), box
        kvtier._kvtier._settle_dropped_leases()
        s = tier.stats()
        assert s["live_leases"] == 0 and s["pinned_slots"] == 0, s
        """,
    )


def test_a_rank_collected_unclosed_drains_without_the_gil(socket_dir):
    # A save's copy is in flight and its completion's FinishSave is held by the relay (inside its
    # round trip). The main thread drops the last reference to the unclosed rank: its drain waits
    # for that round trip, which the relay finishes only once the main thread lets it go, so the
    # drain must not run here with the GIL held.
    run_scenario(
        socket_dir,
        """
        arrs = host_arrays(32, arenas=2)
        g = kvtier.Geometry.from_tensors(arrs, model="gc-rank")
        relay, tier = served(g, 8)
        rank = tier.attach_host(arrs)
        keys = keys_of(tier, 2)
        relay.hold(after=1)  # the save's PrepareSave goes; its FinishSave is held
        ticket = rank.save(keys, [1, 2])
        assert relay.held.wait(60), "the save's FinishSave never reached the relay"
        del rank
        gc.collect()
        relay.let_go()
        assert ticket.wait(60)
        kvtier._kvtier._settle_dropped_leases()  # the collected rank has drained
        assert all(tier.contains(k) for k in keys)
        s = tier.stats()
        assert s["writing_slots"] == 0, s
        """,
    )


def test_close_with_a_timeout_while_a_call_is_held_keeps_the_rank_for_good(socket_dir):
    # A save held inside its round trip cannot let go of the rank before the relay lets it: a
    # close with a deadline gives up then (DrainTimeoutError), keeps the rank and its tensors
    # (never freed under the call or its copy), and the save still completes.
    run_scenario(
        socket_dir,
        """
        import weakref
        arrs = host_arrays(32, arenas=2)
        g = kvtier.Geometry.from_tensors(arrs, model="close-timeout")
        relay, tier = served(g, 8)
        rank = tier.attach_host(arrs)
        keys = keys_of(tier, 2)
        relay.hold()
        t, box = in_thread(lambda: rank.save(keys, [1, 2]).wait(60))
        assert relay.held.wait(60), "the request never reached the relay"
        try:
            rank.close(timeout=0.2)
            raise AssertionError("close() returned while a save held the rank")
        except kvtier.DrainTimeoutError as e:
            assert e.in_flight >= 1, e.in_flight
        assert rank.closed
        with_refs = [weakref.ref(a) for a in arrs]
        del arrs
        gc.collect()
        assert all(w() is not None for w in with_refs), "a timed-out close released the tensors"
        relay.let_go()
        joined(t, "save()")
        assert box == [True], box
        assert all(tier.contains(k) for k in keys)
        rank.close()  # already closed: returns at once
        """,
    )
