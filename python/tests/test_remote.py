"""kvtier.connect: a tier whose state lives in the tier daemon, shared by processes."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvtier
from conftest import PAGE_TOKENS, make_arrays, page


@pytest.fixture
def socket_path(tmp_path, geometry):
    path = str(tmp_path / "kvtierd.sock")
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


def test_no_daemon_is_a_typed_error(tmp_path, geometry):
    with pytest.raises(kvtier.DisconnectedError) as e:
        kvtier.connect(str(tmp_path / "nobody.sock"))
    assert "nobody.sock" in e.value.reason
    with pytest.raises(kvtier.ForeignLeaseError):
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain").open_lease(bytes(16))
    assert kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain").query([]).token is None
