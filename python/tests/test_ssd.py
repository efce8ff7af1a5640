"""The SSD tier under a host tier, through the binding (host backend, CPU only): demotion,
promotion in one lease over both tiers (`Lease.promoted`), restart from the file, and files of
another geometry or bad options refused with typed exceptions. Every block that comes back is
restored into the rank's arrays and compared byte for byte with what was saved. The files are a
few slots each, under pytest's tmp_path."""

import gc
import hashlib

import numpy as np
import pytest

import kvtier
from conftest import LAYERS, PAGE_TOKENS, make_arrays, page


def names():
    return [f"{kv}.L{l}" for l in range(LAYERS) for kv in ("k", "v")]


def file_bytes(geometry, slots):
    """Bytes of an SSD tier file of `slots` disk slots: the 4,096 B header, then the slots."""
    return 4096 + slots * geometry.disk_slot_bytes


def ssd_tier(geometry, path, host, disk, **options):
    """A tier of `host` slots (LRU) over an SSD file of `disk` slots at `path`."""
    return kvtier.Tier(
        geometry, host * geometry.slot_bytes, "lru", backing="plain", ssd=(path, file_bytes(geometry, disk)), **options
    )


def fill_random(arrays, pages, seed):
    """Random bits in `pages` of every arena; returns their bytes, arena by arena."""
    rng = np.random.default_rng(seed)
    for x in arrays:
        for p in pages:
            page(x, p).view(np.uint16)[...] = rng.integers(0, 1 << 16, size=page(x, p).shape, dtype=np.uint16)
    return [[page(x, p).tobytes() for p in pages] for x in arrays]


def restore_and_verify(rank, arrays, lease, dst, saved):
    """Restores every block of `lease` into pages `dst` (zeroed first) and checks them against
    `saved` (as `fill_random` returns it) byte for byte."""
    for x in arrays:
        for p in dst:
            page(x, p)[...] = 0
    assert rank.restore(lease, dst).wait() is True
    for a, x in enumerate(arrays):
        for i, p in enumerate(dst):
            assert page(x, p).tobytes() == saved[a][i], f"arena {a}, block {i} (page {p}) differs"


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_geometry_sizes_ssd_files(geometry):
    # 4 arenas of 512 B: 2,048 B slots, plus the 96 B trailer, rounded up to 4 KiB.
    assert geometry.slot_bytes == 2048 and geometry.disk_slot_bytes == 4096
    assert geometry.disk_slots(file_bytes(geometry, 5)) == 5
    assert geometry.disk_slots(file_bytes(geometry, 5) - 1) == 4
    assert geometry.disk_slots(4096) == 0


def test_evicted_blocks_come_back_from_the_ssd_in_one_lease_over_both_tiers(geometry, arrays, tmp_path):
    path = tmp_path / "tier.kvtier"
    tier = ssd_tier(geometry, path, host=4, disk=8, ssd_admit_uses=1)
    assert path.stat().st_size == file_bytes(geometry, 8)
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"b0", b"b1", b"b2", b"b3", b"b4"])
        saved = fill_random(arrays, [1, 2, 3, 4], seed=1)
        assert rank.save(keys[:4], [1, 2, 3, 4]).wait() is True
        tier.flush_demotions()
        s = tier.ssd_stats()
        assert (s["capacity"], s["blocks"], s["demoted_blocks"]) == (8, 4, 4)
        assert s["bytes_demoted"] == 4 * geometry.slot_bytes and s["demotions_pending"] == 0
        assert tier.evict(4) == 4
        assert not any(tier.contains(k) for k in keys)
        # The host holds b0 and b1 again (saved from the same pages); b2 and b3 are on disk only.
        assert rank.save(keys[:2], [1, 2]).wait() is True
        with tier.query(keys) as lease:
            assert (len(lease), lease.promoted) == (4, 2), "two host blocks, then two promoted ones"
            assert lease.keys == keys[:4]
            assert tier.stats()["pinned_slots"] == 4, "the promoted blocks are pinned for the lease"
            restore_and_verify(rank, arrays, lease, [20, 21, 22, 23], saved)
        s = tier.ssd_stats()
        assert (s["promoted_blocks"], s["bytes_promoted"], s["promotion_failures"]) == (2, 2 * geometry.slot_bytes, 0)
        assert s["io_direct"] + s["io_buffered"] == 4 + 2, "four writes and two reads"
        assert tier.contains(keys[2]) and tier.contains(keys[3]), "promoted blocks are host blocks now"
        t = tier.stats()
        assert (t["hit_blocks"], t["miss_blocks"], t["pinned_slots"]) == (4, 1, 0)
        # Every block now on the host: a second query promotes nothing.
        with tier.query(keys[:4]) as lease:
            assert (len(lease), lease.promoted) == (4, 0)


def test_a_block_is_demoted_at_its_admitting_use_and_not_before(geometry, arrays, tmp_path):
    # Admission after 2 uses: its save, then one query that leases it.
    tier = ssd_tier(geometry, tmp_path / "tier.kvtier", host=8, disk=8, ssd_admit_uses=2)
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"b0", b"b1", b"b2"])
        assert rank.save(keys, [1, 2, 3]).wait() is True
        tier.flush_demotions()
        assert tier.ssd_stats()["demoted_blocks"] == 0, "one use of two does not admit a block"
        with tier.query(keys[:2]) as lease:
            assert (len(lease), lease.promoted) == (2, 0)
        tier.flush_demotions()
        s = tier.ssd_stats()
        assert (s["demoted_blocks"], s["blocks"]) == (2, 2), "the query's use admits b0 and b1 only"


def test_a_new_tier_on_the_same_file_finds_its_blocks_and_serves_them_verified(geometry, tmp_path):
    path = tmp_path / "tier.kvtier"
    first = make_arrays()
    tier = ssd_tier(geometry, path, host=8, disk=8, ssd_admit_uses=1)
    keys = tier.namespace.keys([b"r%d" % i for i in range(6)])
    saved = fill_random(first, [0, 1, 2, 3, 4, 5], seed=2)
    with tier.attach_host(first) as rank:
        assert rank.save(keys, [0, 1, 2, 3, 4, 5]).wait() is True
    tier.flush_demotions()
    assert tier.ssd_stats()["blocks"] == 6
    del tier, rank
    gc.collect()

    second = make_arrays()
    tier = ssd_tier(geometry, path, host=8, disk=8, ssd_admit_uses=1)
    s = tier.ssd_stats()
    assert (s["recovered_blocks"], s["blocks"], s["recovered_torn"], s["recovered_foreign"]) == (6, 6, 0, 0)
    assert tier.stats()["ready_slots"] == 0, "the host pool starts empty"
    with tier.attach_host(second) as rank:
        with tier.query(keys) as lease:
            assert (len(lease), lease.promoted) == (6, 6)
            restore_and_verify(rank, second, lease, [10, 11, 12, 13, 14, 15], saved)
    assert tier.ssd_stats()["promoted_blocks"] == 6


def test_a_file_of_another_geometry_is_refused_and_left_untouched(geometry, arrays, tmp_path):
    path = tmp_path / "tier.kvtier"
    tier = ssd_tier(geometry, path, host=4, disk=4, ssd_admit_uses=1)
    with tier.attach_host(arrays) as rank:
        assert rank.save(tier.namespace.keys([b"x"]), [3]).wait() is True
    tier.flush_demotions()
    del tier, rank
    gc.collect()
    before = digest(path)
    # Same slot size, another model: another namespace.
    other = kvtier.Geometry.from_tensors(arrays, model="another-model", page_tokens=PAGE_TOKENS, names=names())
    assert other.slot_bytes == geometry.slot_bytes and other.namespace != geometry.namespace
    with pytest.raises(kvtier.GeometryMismatchError) as e:
        ssd_tier(other, path, host=4, disk=4)
    assert e.value.path == str(path)
    assert str(e.value).startswith(f"SSD tier: {path}: a disk slot file of another geometry"), str(e.value)
    ns = lambda g: g.namespace.digest.hex()  # noqa: E731
    assert e.value.backend == f"Namespace({ns(geometry)}), blocks of 2048 B, 4 slots", "the file's layout"
    assert e.value.tier == f"Namespace({ns(other)}), blocks of 2048 B, 4 slots", "the tier's layout"
    assert isinstance(e.value, ValueError) and isinstance(e.value, kvtier.KvtierError)
    # The same geometry with another file size is another slot count: refused too.
    with pytest.raises(kvtier.GeometryMismatchError):
        ssd_tier(geometry, path, host=4, disk=6)
    assert digest(path) == before
    # The file still opens for its own geometry, its block found again.
    s = ssd_tier(geometry, path, host=4, disk=4).ssd_stats()
    assert (s["capacity"], s["recovered_blocks"]) == (4, 1)


def test_bad_ssd_files_and_options_raise_config_errors(geometry, tmp_path):
    small = tmp_path / "small.kvtier"
    pool = 4 * geometry.slot_bytes
    with pytest.raises(kvtier.ConfigError, match="holds no block") as e:
        kvtier.Tier(geometry, pool, backing="plain", ssd=(small, 4096 + 100))
    assert e.value.detail and "holds no block" in e.value.detail
    assert not small.exists(), "nothing is made for a refused configuration"
    for bad in ({"ssd_admit_uses": 0}, {"ssd_read_depth": 0}, {"ssd_read_depth": 2000}):
        with pytest.raises(kvtier.ConfigError):
            kvtier.Tier(geometry, pool, backing="plain", ssd=[(small, file_bytes(geometry, 2))], **bad)
    assert not small.exists()
    with pytest.raises(kvtier.ConfigError, match="unknown ssd_io"):
        kvtier.Tier(geometry, pool, backing="plain", ssd=(small, file_bytes(geometry, 2)), ssd_io="fast")
    with pytest.raises(kvtier.ConfigError, match="need an SSD tier"):
        kvtier.Tier(geometry, pool, backing="plain", ssd_admit_uses=1)
    for shape in (str(small), [str(small)], [(small, -1)], []):
        with pytest.raises(kvtier.ConfigError):
            kvtier.Tier(geometry, pool, backing="plain", ssd=shape)
    # A path holding something else than a kvtier file.
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"not a kvtier file" * 1000)
    with pytest.raises(kvtier.ConfigError, match="not a kvtier disk slot file") as e:
        kvtier.Tier(geometry, pool, backing="plain", ssd=(junk, file_bytes(geometry, 2)))
    assert e.value.path == str(junk)
    # A directory that does not exist: an I/O error, with the OS's message.
    missing = tmp_path / "no-such-dir" / "tier.kvtier"
    with pytest.raises(kvtier.ConfigError) as e:
        kvtier.Tier(geometry, pool, backing="plain", ssd=(missing, file_bytes(geometry, 2)))
    assert e.value.path == str(missing) and e.value.os_error and str(missing) in str(e.value)


def test_two_files_and_buffered_io(geometry, arrays, tmp_path):
    a, b = tmp_path / "a.kvtier", tmp_path / "b.kvtier"
    tier = kvtier.Tier(
        geometry,
        2 * geometry.slot_bytes,
        "lru",
        backing="plain",
        ssd=[(a, file_bytes(geometry, 2)), (str(b), file_bytes(geometry, 3))],
        ssd_admit_uses=1,
        ssd_io="buffered",
        ssd_read_depth=2,
    )
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"t0", b"t1"])
        saved = fill_random(arrays, [5, 6], seed=3)
        assert rank.save(keys, [5, 6]).wait() is True
        tier.flush_demotions()
        assert tier.evict(2) == 2
        with tier.query(keys) as lease:
            assert (len(lease), lease.promoted) == (2, 2)
            restore_and_verify(rank, arrays, lease, [7, 8], saved)
    s = tier.ssd_stats()
    assert s["capacity"] == 5 and s["io_direct"] == 0 and s["io_buffered"] == 2 + 2


def test_without_an_ssd_tier_there_are_no_ssd_stats_and_nothing_is_promoted(tier, rank):
    assert tier.ssd_stats() is None
    tier.flush_demotions()  # returns at once
    keys = tier.namespace.keys([b"n0"])
    assert rank.save(keys, [1]).wait() is True
    with tier.query(keys) as lease:
        assert (len(lease), lease.promoted) == (1, 0)


def test_ssd_file_errors_map_to_config_error_with_their_fields():
    examples = [e for _, e in kvtier._kvtier._error_examples() if "/data/kvtier.ssd" in str(e)]
    assert [type(e) for e in examples] == [kvtier.ConfigError] * 3
    no_space, io, bad = examples
    assert no_space.bytes == 1 << 40 and "no space" in str(no_space)
    assert io.call == "opening" and io.os_error and io.os_error in str(io)
    assert bad.detail == "/data/kvtier.ssd: 100 B holds no block"
    assert str(bad) == "SSD tier: disk slot file: /data/kvtier.ssd: 100 B holds no block", "kvtier's message"
