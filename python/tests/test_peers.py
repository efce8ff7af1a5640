"""Peers through the binding (host backend, CPU only): a `Tier` that serves its pool to other
instances (`peer_listen=`) and one that reads its misses from them (`peers=`), over NIXL, in two
processes (the owner is a child process: NIXL agents are kept one per process). Every block a
reader gets from the owner is restored into its arrays and compared with the owner's bytes; each
lease says per block where it came from (`Lease.sources`).

The peer tests need a wheel built with the cargo feature `peers` and the NIXL runtime in the
environment (`eval "$(bash ci/nixl.sh)"`); without them they skip, and with
`KVTIER_REQUIRE_NIXL=1` (CI sets it) they fail instead."""

import os
import subprocess
import sys
import textwrap

import pytest

import kvtier
from conftest import LAYERS, PAGE_TOKENS, page

REQUIRED = os.environ.get("KVTIER_REQUIRE_NIXL") == "1"


def need_peers():
    """Skips (or, under KVTIER_REQUIRE_NIXL=1, fails) the test without peers and their runtime."""
    if kvtier.peers_available():
        return
    if REQUIRED:
        pytest.fail("KVTIER_REQUIRE_NIXL=1 but peers are not available (a wheel without `peers`, or no NIXL runtime)")
    pytest.skip("peers need a wheel built with --features peers and the NIXL runtime (ci/nixl.sh)")


def names():
    return [f"{kv}.L{l}" for l in range(LAYERS) for kv in ("k", "v")]


# The owner: a tier serving its pool at a free port, four blocks saved from pages 1-4 of the
# test arrays (page p of arena a holds a * 1000 + p), then its address printed; it holds the
# blocks until its stdin closes.
OWNER = textwrap.dedent(
    """
    import sys
    import kvtier
    sys.path.insert(0, {tests!r})
    from conftest import PAGE_TOKENS, make_arrays
    arrays = make_arrays()
    names = [f"{{kv}}.L{{l}}" for l in range({layers}) for kv in ("k", "v")]
    g = kvtier.Geometry.from_tensors(arrays, model="test-model", page_tokens=PAGE_TOKENS, names=names)
    tier = kvtier.Tier(g, 8 * g.slot_bytes, "lru", backing="plain", peer_listen="127.0.0.1:0")
    keys = tier.namespace.keys([bytes([i]) for i in range(6)])
    with tier.attach_host(arrays) as rank:
        assert rank.save(keys[:4], [1, 2, 3, 4]).wait(60)
    print("owner", tier.peer_address, flush=True)
    sys.stdin.read()
    print("served", tier.peer_stats()["blocks_validated"], flush=True)
    """
).format(tests=os.path.dirname(__file__), layers=LAYERS)


class Owner:
    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", OWNER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline().split()
        if len(line) != 2 or line[0] != "owner":
            self.proc.kill()
            raise AssertionError(f"the owner did not start: {line} {self.proc.stderr.read()}")
        self.address = line[1]

    def finish(self):
        """Closes the owner's stdin and returns what it served (blocks validated for readers)."""
        out, err = self.proc.communicate(timeout=120)
        assert self.proc.returncode == 0, err
        return int(out.split()[-1])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)


@pytest.fixture
def owner():
    need_peers()
    o = Owner()
    yield o
    o.kill()


def restore_and_check(rank, arrays, lease, dst, src):
    """Restores `lease` into pages `dst` (zeroed first) and checks each against the owner's page
    `src` (the test arrays' pattern)."""
    for x in arrays:
        for p in dst:
            page(x, p)[...] = 0
    assert rank.restore(lease, dst).wait(60) is True
    for a, x in enumerate(arrays):
        for d, s in zip(dst, src):
            assert (page(x, d) == a * 1000 + s).all(), f"arena {a}, page {d}: not the owner's page {s}"


def test_a_lease_says_where_each_block_came_from(tier, rank):
    keys = tier.namespace.keys([b"a", b"b"])
    assert rank.save(keys, [1, 2]).wait(60)
    with tier.query(keys) as lease:
        assert (lease.sources, lease.from_peer, lease.promoted, lease.peer_errors) == (["host", "host"], 0, 0, [])
    assert (tier.peers, tier.peer_address, tier.peer_stats()) == ([], None, None)


def test_peer_options_are_refused_with_a_typed_error_without_peers_or_bad(geometry, tmp_path):
    for bad in (0, -1.0, 1e19):
        with pytest.raises(kvtier.ConfigError, match=r"peer_timeout_s must be a number of seconds in \(0, 3600\]"):
            kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peers=["127.0.0.1:1"], peer_timeout_s=bad)
    with pytest.raises(kvtier.ConfigError, match="peer_pinned_blocks bounds what peers pin here: it needs peer_listen="):
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peer_pinned_blocks=2)
    tier = kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain")
    with pytest.raises(kvtier.ConfigError, match="hold_for_peers needs a tier made with peer_listen="):
        tier.hold_for_peers(tier.namespace.keys([b"a"]), 1.0)
    secret = tmp_path / "peer.secret"
    secret.write_text("a peer secret of some length\n")
    secret.chmod(0o644)
    with pytest.raises(kvtier.ConfigError, match="peer_secret_file is the peers' secret: it needs peers= or peer_listen="):
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peer_secret_file=str(secret))
    if kvtier.peers_available():
        # A secret file its group or others may read; an open address without a secret.
        with pytest.raises(kvtier.ConfigError, match="chmod 600"):
            kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peers=["127.0.0.1:1"], peer_secret_file=str(secret))
        with pytest.raises(kvtier.ConfigError, match="needs a shared secret"):
            kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peer_listen="0.0.0.0:0")
        with pytest.raises(kvtier.ConfigError, match="configured twice"):
            kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peers=["127.0.0.1:1", "127.0.0.1:1"])
        with pytest.raises(kvtier.PeerError, match="peer_listen 256.0.0.1:1") as e:
            kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peer_listen="256.0.0.1:1")
        assert e.value.kind == "connect"
        with pytest.raises(kvtier.ConfigError, match="pinned blocks must be > 0"):
            kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peer_listen="127.0.0.1:0", peer_pinned_blocks=0)
        return
    # A wheel without the feature names it; one with it but no runtime says the runtime is missing.
    with pytest.raises((kvtier.ConfigError, kvtier.PeerError)) as e:
        kvtier.Tier(geometry, 4 * geometry.slot_bytes, backing="plain", peer_listen="127.0.0.1:0")
    assert "--features peers" in str(e.value) or "NIXL runtime not found" in str(e.value), str(e.value)


def test_a_tier_with_a_peer_leases_the_peers_blocks_and_the_next_hit_is_local(owner, geometry, arrays):
    tier = kvtier.Tier(geometry, 8 * geometry.slot_bytes, "lru", backing="plain", peers=[owner.address], peer_timeout_s=60)
    assert tier.peers == [owner.address] and tier.peer_address is None
    keys = tier.namespace.keys([bytes([i]) for i in range(6)])
    with tier.attach_host(arrays) as rank:
        # The reader holds the first block itself; the owner holds four; nobody the last two.
        assert rank.save(keys[:1], [1]).wait(60)
        with tier.query(keys, uses=2) as lease:
            assert len(lease) == 4, "the local block, then the peer's three after it"
            assert lease.sources == ["host", "peer", "peer", "peer"]
            assert (lease.from_peer, lease.peer_errors) == (3, [])
            restore_and_check(rank, arrays, lease, [10, 11, 12, 13], [1, 2, 3, 4])
            assert lease.uses_left == 1, "the lease has the two uses asked, one spent"
        assert owner.finish() == 3, "the owner validated the three blocks it served"
        # The fetched blocks are the reader's now: the next hit is local, with the owner gone; the
        # owner's failure to answer the rest is reported, not raised.
        with tier.query(keys) as lease:
            assert lease.sources == ["host"] * 4
            assert [a for a, _ in lease.peer_errors] == [owner.address]
            restore_and_check(rank, arrays, lease, [20, 21, 22, 23], [1, 2, 3, 4])
    s = tier.stats()
    assert (s["pinned_slots"], s["writing_slots"], s["ready_slots"]) == (0, 0, 4)


def test_held_blocks_stay_pinned_for_peers_until_their_ttl(geometry, arrays):
    need_peers()
    tier = kvtier.Tier(geometry, 8 * geometry.slot_bytes, "lru", backing="plain", peer_listen="127.0.0.1:0")
    host, port = tier.peer_address.rsplit(":", 1)
    assert host == "127.0.0.1" and int(port) > 0
    keys = tier.namespace.keys([bytes([i]) for i in range(3)])
    with tier.attach_host(arrays) as rank:
        assert rank.save(keys[:2], [1, 2]).wait(60)
    assert tier.hold_for_peers(keys, 0.05) == 2, "the ready prefix is held"
    assert tier.peer_stats()["held_blocks"] == 2 and tier.stats()["pinned_slots"] == 2
    with pytest.raises(kvtier.ConfigError, match="ttl_s must be a non-negative number of seconds"):
        tier.hold_for_peers(keys, -1.0)
    import time

    deadline = time.monotonic() + 60
    while tier.peer_stats()["held_blocks"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (tier.peer_stats()["held_blocks"], tier.stats()["pinned_slots"]) == (0, 0), "the holds expired"
