"""Hybrid layouts through the Python API (host backend, numpy arenas, no GPU): layout validation,
group keys, the blocks a boundary needs, a save / query / restore round trip with every group's
bytes checked, pins held across groups, and a state checkpoint evicted while its attention blocks
remain stopping the query at the last usable boundary."""

import numpy as np
import pytest

import kvtier

T = 16  # tokens per block
PAGES = 32  # GPU pages per arena
HEADS, DIM = 2, 8  # 16 tokens x 2 heads x 8 dims x 2 B = 512 B per page per arena


def arenas(count, pages=PAGES, seed=0):
    """`count` float16 arenas [pages * 16, heads, dim] of random values."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((pages * T, HEADS, DIM)).astype(np.float16) for _ in range(count)]


def page(arr, p):
    return arr[p * T : (p + 1) * T]


class Toy:
    """One full-attention group (1 arena), one sliding-window group of `window` tokens (2 arenas)
    and, with `state`, a recurrent-state group (1 arena); each group's pool holds `slots` blocks
    (an int, or one per group), LRU. Host ranks over numpy arrays."""

    def __init__(self, window=32, state=True, slots=8, group_eviction=True):
        self.arrays = [arenas(1, seed=1), arenas(2, seed=2)] + ([arenas(1, seed=3)] if state else [])
        names = [["g"], ["l.0", "l.1"], ["ssm"]]
        geos = [
            kvtier.Geometry.from_tensors(a, model="toy", page_tokens=T, names=names[g])
            for g, a in enumerate(self.arrays)
        ]
        groups = [
            kvtier.CacheGroup("global", "full", geos[0]),
            kvtier.CacheGroup("local", "sliding", geos[1], window_tokens=window),
        ]
        if state:
            groups.append(kvtier.CacheGroup("ssm", "state", geos[2]))
        self.layout = kvtier.HybridLayout("toy", groups)
        slots = [slots] * len(geos) if isinstance(slots, int) else slots
        self.tier = kvtier.HybridTier(
            self.layout,
            [n * g.slot_bytes for n, g in zip(slots, geos)],
            "lru",
            backing="plain",
            group_eviction=group_eviction,
        )
        self.ranks = [self.tier.group(g).attach_host(a) for g, a in enumerate(self.arrays)]

    def close(self):
        for r in self.ranks:
            r.close()

    def chain(self, seed, n):
        keys, parent = [], None
        for i in range(n):
            parent = self.layout.namespace.chain(parent, [seed * 1000 + i] * T)
            keys.append(parent)
        return keys

    def save(self, keys, ranges):
        """Saves blocks `ranges[g]` (a (start, end) pair) of each group from GPU pages 0, 1, ...
        (their bytes: whatever the arrays hold there, rewritten with fresh values first) and
        returns each group's saved bytes by block index."""
        saved = []
        for g, (start, end) in enumerate(ranges):
            blocks = {}
            for i, p in enumerate(range(end - start)):
                for a, arr in enumerate(self.arrays[g]):
                    page(arr, p)[:] = np.float16(g * 100 + a * 10 + (start + i) % 10 + 0.5)
                blocks[start + i] = [page(arr, p).copy() for arr in self.arrays[g]]
            saved.append(blocks)
        pages = [(start, list(range(end - start))) if end > start else None for start, end in ranges]
        kvtier.hybrid_wait(kvtier.hybrid_save(self.ranks, self.layout, keys, pages, tier=self.tier))
        return saved

    def restore(self, lease, first_page=16):
        """Restores every group's leased blocks to pages from `first_page`; returns the pages."""
        pages = [list(range(first_page, first_page + (e - s))) for s, e in lease.ranges]
        kvtier.hybrid_wait(kvtier.hybrid_restore(self.ranks, lease, pages))
        return pages

    def restored(self, g, pages):
        return [[page(arr, p).copy() for arr in self.arrays[g]] for p in pages]


@pytest.fixture
def toy():
    t = Toy()
    yield t
    t.close()


def geometry(bytes_per_page=512, page_tokens=T, pages=8, model="m"):
    return kvtier.Geometry(model, page_tokens, [("a", bytes_per_page, bytes_per_page, pages)])


# --- layouts --------------------------------------------------------------------------------


def test_bad_layouts_are_refused_with_the_reason():
    full = kvtier.CacheGroup("full", "full", geometry())

    def reason(model, groups):
        with pytest.raises(kvtier.CacheGroupsError) as e:
            kvtier.HybridLayout(model, groups)
        assert isinstance(e.value, kvtier.GeometryError) and isinstance(e.value, ValueError)
        assert e.value.reason in str(e.value)
        return e.value.reason

    assert "0 cache groups" in reason("m", [])
    assert "model name" in reason("", [full])
    assert "`full` is used twice" in reason("m", [full, full])
    other_page = kvtier.CacheGroup("local", "sliding", geometry(page_tokens=32), window_tokens=8)
    assert "pages 32 tokens" in reason("m", [full, other_page])
    zero = kvtier.CacheGroup("local", "sliding", geometry(), window_tokens=0)
    assert "0 tokens" in reason("m", [full, zero])
    ssm = kvtier.CacheGroup("ssm", "state", geometry())
    assert "at least one group must be attention" in reason("m", [ssm])
    many = [kvtier.CacheGroup(f"g{i}", "full", geometry()) for i in range(17)]
    assert "17 cache groups" in reason("m", many)
    assert "empty name" in reason("m", [kvtier.CacheGroup("", "full", geometry())])


def test_a_cache_group_names_its_kind_and_window():
    g = geometry()
    with pytest.raises(kvtier.ConfigError, match="unknown cache group kind `mamba`"):
        kvtier.CacheGroup("x", "mamba", g)
    with pytest.raises(kvtier.ConfigError, match="needs window_tokens"):
        kvtier.CacheGroup("x", "sliding", g)
    with pytest.raises(kvtier.ConfigError, match="for kind=\"sliding\" only"):
        kvtier.CacheGroup("x", "full", g, window_tokens=32)
    with pytest.raises(OverflowError):
        kvtier.CacheGroup("x", "sliding", g, window_tokens=-1)
    s = kvtier.CacheGroup("local", "sliding", g, window_tokens=40)
    assert (s.name, s.kind, s.window_tokens, s.geometry) == ("local", "sliding", 40, g)
    assert kvtier.CacheGroup("f", "full", g).window_tokens is None
    assert s == kvtier.CacheGroup("local", "sliding", g, window_tokens=40)
    assert "window_tokens=40" in repr(s)
    with pytest.raises(TypeError):
        kvtier.HybridLayout("m", [s, "not a group"])


def test_each_kind_needs_its_own_blocks_at_a_boundary():
    layout = kvtier.HybridLayout(
        "m",
        [
            kvtier.CacheGroup("full", "full", geometry(1024)),
            kvtier.CacheGroup("local", "sliding", geometry(512), window_tokens=40),
            kvtier.CacheGroup("ssm", "state", geometry(4096)),
        ],
    )
    assert (len(layout), layout.model, layout.page_tokens) == (3, "m", T)
    assert [g.name for g in layout.groups] == ["full", "local", "ssm"]
    assert layout.needed(0, 5) == (0, 5)
    assert layout.needed(1, 5) == (2, 5), "tokens 40..80 lie in blocks 2, 3 and 4"
    assert layout.needed(1, 2) == (0, 2), "a window longer than the prefix needs all of it"
    assert layout.needed(2, 5) == (4, 5), "the checkpoint at 5 is block 4's"
    assert all(layout.needed(g, 0) == (0, 0) for g in range(3))
    slot = [g.geometry.slot_bytes for g in layout.groups]
    assert layout.restore_bytes(5) == 5 * slot[0] + 3 * slot[1] + slot[2]
    assert layout.all_layers_bytes(5) == 5 * (slot[0] + slot[1]) + slot[2]
    with pytest.raises(IndexError):
        layout.needed(3, 5)


def test_group_keys_differ_per_group_and_per_layout():
    def two(window):
        return kvtier.HybridLayout(
            "m",
            [
                kvtier.CacheGroup("full", "full", geometry()),
                kvtier.CacheGroup("local", "sliding", geometry(), window_tokens=window),
            ],
        )

    a, b = two(32), two(48)
    assert a.namespace != b.namespace, "the window enters the namespace"
    assert a == two(32) and a != b
    k = a.namespace.chain(None, [1, 2, 3])
    keys = [a.group_key(g, k) for g in range(2)]
    assert len(set(keys + [k])) == 3 and all(isinstance(x, bytes) and len(x) == 16 for x in keys)
    assert a.group_key(0, k) != b.group_key(0, k)
    assert a.group_key(1, k) == two(32).group_key(1, k), "the same layout gives the same keys"
    k2 = a.namespace.chain(k, [4, 5, 6])
    assert a.group_keys(1, [k, k2]) == [a.group_key(1, k), a.group_key(1, k2)]
    with pytest.raises(kvtier.KeyLengthError):
        a.group_key(0, b"short")
    with pytest.raises(IndexError):
        a.group_key(2, k)


def test_presets_have_their_published_shapes():
    assert kvtier.HybridLayout.presets() == ["gemma3-27b", "qwen3-next-80b", "jamba-v0.1"]
    g = kvtier.HybridLayout.preset("gemma3-27b", 2)
    full, sliding = g.groups
    assert (len(full.geometry), len(sliding.geometry)) == (10, 52)
    assert (full.geometry.slot_bytes, sliding.geometry.slot_bytes) == (1_310_720, 6_815_744)
    assert (sliding.kind, sliding.window_tokens) == ("sliding", 1024)
    # 65,536 tokens: every full-attention block, the window's 64 sliding blocks.
    assert g.restore_bytes(4096) == 4096 * 1_310_720 + 64 * 6_815_744
    assert kvtier.HybridLayout.preset("jamba-v0.1", 1).groups[0].geometry.layers == [4, 12, 20, 28]
    assert kvtier.HybridLayout.preset("qwen3-next-80b", 1).groups[1].kind == "state"
    with pytest.raises(kvtier.UnknownPresetError):
        kvtier.HybridLayout.preset("nope", 1)


# --- tiers ----------------------------------------------------------------------------------


def test_a_hybrid_tier_has_one_tier_per_group():
    layout = kvtier.HybridLayout(
        "m",
        [
            kvtier.CacheGroup("full", "full", geometry(1024)),
            kvtier.CacheGroup("local", "sliding", geometry(512), window_tokens=32),
        ],
    )
    slots = [g.geometry.slot_bytes for g in layout.groups]
    # One int: split in proportion to the slot sizes, so both pools hold the same blocks.
    tier = kvtier.HybridTier(layout, 10 * sum(slots), "sieve", backing="plain")
    assert len(tier) == 2 and tier.layout == layout and tier.namespace == layout.namespace
    assert [tier.group(g).capacity for g in range(2)] == [10, 10]
    assert {tier.group(g).policy for g in range(2)} == {"sieve"}
    assert {tier.group(g).backing for g in range(2)} == {"plain"}
    assert isinstance(tier.group(0), kvtier.Tier) and tier.group(1).geometry == layout.groups[1].geometry
    # One size per group.
    tier = kvtier.HybridTier(layout, [10 * slots[0], 3 * slots[1]], backing="plain")
    assert [tier.group(g).capacity for g in range(2)] == [10, 3]
    with pytest.raises(kvtier.ConfigError, match="1 sizes for a layout of 2"):
        kvtier.HybridTier(layout, [1 << 20])
    with pytest.raises(kvtier.ConfigError):
        kvtier.HybridTier(layout, 1 << 20, "nope")
    with pytest.raises(kvtier.ConfigError):
        kvtier.HybridTier(layout, 1 << 20, backing="nope")
    with pytest.raises(kvtier.PoolTooSmallError):
        kvtier.HybridTier(layout, [10 * slots[0], 16], backing="plain")
    with pytest.raises(IndexError):
        tier.group(2)
    empty = tier.query([])
    assert (empty.boundary, len(empty), bool(empty), empty.ranges) == (0, 0, False, [(0, 0), (0, 0)])


def test_save_query_restore_round_trip_moves_every_groups_bytes(toy):
    keys = toy.chain(1, 6)
    # Attention for all 6 blocks, the window before boundary 6 (32 tokens: blocks 4, 5), the
    # checkpoint at 6.
    saved = toy.save(keys, [(0, 6), (4, 6), (5, 6)])
    assert toy.tier.usable_prefix(keys) == 6
    for g, (count, name) in enumerate([(6, "global"), (2, "local"), (1, "ssm")]):
        assert toy.tier.group(g).stats()["saved_blocks"] == count, name
    assert toy.tier.group(1).contains(toy.layout.group_key(1, keys[4]))
    assert not toy.tier.group(1).contains(keys[4]), "groups hold group keys, not content keys"
    with toy.tier.query(keys) as lease:
        assert (lease.boundary, len(lease)) == (6, 6)
        assert lease.ranges == [(0, 6), (4, 6), (5, 6)]
        assert [lease.range(g) for g in range(3)] == [toy.layout.needed(g, 6) for g in range(3)]
        assert isinstance(lease.group(1), kvtier.Lease) and len(lease.group(1)) == 2
        assert lease.group(2) is lease.group(2)
        pages = toy.restore(lease)
    assert lease.settled, "the restore spent each group's one use"
    for g, (start, end) in enumerate([(0, 6), (4, 6), (5, 6)]):
        got = toy.restored(g, pages[g])
        for i, b in enumerate(range(start, end)):
            for a, want in enumerate(saved[g][b]):
                assert np.array_equal(got[i][a], want), (g, b, a)
    assert [toy.tier.group(g).stats()["restored_blocks"] for g in range(3)] == [6, 2, 1]
    # A shorter prefix: boundary 5 needs the window's blocks 3, 4 (3 never saved) and the
    # checkpoint at 5 (never saved): not usable, nor is any boundary below it.
    assert toy.tier.usable_prefix(keys[:5]) == 0
    assert toy.tier.query(keys[:5]).boundary == 0


def test_a_state_checkpoint_evicted_while_its_attention_blocks_remain_stops_the_query_at_the_last_usable_boundary(toy):
    keys = toy.chain(2, 6)
    # Attention for all 6 blocks, the window before 6, and checkpoints at 6, then 2 and 4 (saved
    # in that order, so the LRU state pool holds the checkpoint at 6 as its oldest).
    toy.save(keys, [(0, 6), (4, 6), (5, 6)])
    toy.save(keys, [(0, 0), (0, 2), (1, 2)])
    saved = toy.save(keys, [(0, 0), (2, 4), (3, 4)])
    assert toy.tier.usable_prefix(keys) == 6
    assert toy.tier.group(2).evict(1) == 1, "the checkpoint at 6 goes"
    assert not toy.tier.group(2).contains(toy.layout.group_key(2, keys[5]))
    assert toy.tier.group(0).contains(toy.layout.group_key(0, keys[5])), "its attention blocks remain"
    assert toy.tier.usable_prefix(keys) == 4
    with toy.tier.query(keys) as lease:
        assert lease.boundary == 4, "the query stops at the last usable boundary"
        assert lease.ranges == [(0, 4), (2, 4), (3, 4)]
        pages = toy.restore(lease)
    got = toy.restored(2, pages[2])
    assert all(np.array_equal(x, y) for x, y in zip(got[0], saved[2][3])), "the checkpoint at 4"
    got = toy.restored(1, pages[1])
    assert all(np.array_equal(x, y) for i, b in enumerate((2, 3)) for x, y in zip(got[i], saved[1][b]))
    assert toy.tier.group(2).evict(2) == 2  # the checkpoints at 2 and 4
    lease = toy.tier.query(keys)
    assert lease.boundary == 0, "no checkpoint left: a miss, though attention holds 6 blocks"
    assert toy.tier.group(0).contains(toy.layout.group_key(0, keys[5]))


def test_a_sliding_window_needs_only_the_blocks_of_its_window():
    toy = Toy(window=40, state=False, slots=16)  # 40 tokens: 3 blocks at a block boundary
    try:
        keys = toy.chain(3, 8)
        toy.save(keys, [(0, 8), (5, 8)])
        with toy.tier.query(keys) as lease:
            assert lease.boundary == 8
            assert lease.range(1) == (5, 8), "tokens 88..128 lie in blocks 5, 6 and 7"
        # Boundary 7 needs blocks 4..7 of the window: 4 was never saved, nor 3 and 2 for 6, 5.
        assert toy.tier.usable_prefix(keys[:7]) == 0
        toy.save(keys, [(0, 0), (2, 5)])
        assert toy.tier.usable_prefix(keys[:7]) == 7
    finally:
        toy.close()


def test_every_block_of_a_hybrid_lease_stays_pinned_while_it_is_held(toy):
    keys = toy.chain(4, 5)
    toy.save(keys, [(0, 5), (3, 5), (4, 5)])
    lease = toy.tier.query(keys, uses=2)
    assert lease.boundary == 5 and lease.group(0).uses_left == 2
    for g in range(3):
        assert toy.tier.group(g).evict(1 << 70) == 0, f"group {g}: every block is leased"
    assert "boundary=5" in repr(lease) and "settled=False" in repr(lease)
    assert lease.release() is True and lease.settled
    assert lease.release() is False
    assert toy.tier.group(0).evict(1 << 70) == 5
    assert toy.tier.query(keys).boundary == 0


def test_glue_checks_every_group_before_any_copy(toy):
    keys = toy.chain(5, 3)
    # Group 1's pages run past the keys: nothing is saved in group 0 either.
    with pytest.raises(kvtier.LengthMismatchError) as e:
        kvtier.hybrid_save(toy.ranks, toy.layout, keys, [(0, [0, 1, 2]), (2, [0, 1]), None])
    assert (e.value.keys, e.value.pages) == (3, 4)
    assert toy.tier.group(0).stats()["saved_blocks"] == 0
    with pytest.raises(kvtier.GeometryMismatchError):
        kvtier.hybrid_save(toy.ranks, toy.layout, keys, [(0, [0])])
    with pytest.raises(kvtier.GeometryMismatchError):
        kvtier.hybrid_save(toy.ranks[:2], toy.layout, keys, [(0, [0]), None, None])
    toy.save(keys, [(0, 3), (1, 3), (2, 3)])
    lease = toy.tier.query(keys)
    assert lease.ranges == [(0, 3), (1, 3), (2, 3)]
    with pytest.raises(kvtier.LeaseTooShortError) as e:
        kvtier.hybrid_restore(toy.ranks, lease, [[20, 21, 22], [20, 21, 22], []])
    assert (e.value.asked, e.value.held) == (3, 2)
    assert toy.tier.group(0).stats()["restored_blocks"] == 0, "nothing restored in group 0"
    # A group given no pages is not restored and its lease keeps its use.
    handles = kvtier.hybrid_restore(toy.ranks, lease, [[20, 21, 22], [], []])
    assert handles[1] is None and handles[2] is None and kvtier.hybrid_wait(handles)
    assert lease.group(0).settled and lease.group(1).uses_left == 1
    lease.release()


@pytest.mark.parametrize("group_eviction", [True, False])
def test_a_checkpoint_whose_attention_prefix_was_evicted_goes_before_a_usable_one(group_eviction):
    toy = Toy(slots=[16, 16, 2], group_eviction=group_eviction)
    try:
        a, b, c = toy.chain(1, 4), toy.chain(2, 4), toy.chain(3, 4)
        toy.save(a, [(0, 4), (2, 4), (3, 4)])
        toy.save(b, [(0, 4), (2, 4), (3, 4)])
        # The groups' LRU orders differ: attention keeps B newer, state keeps A's checkpoint newer.
        with toy.tier.group(0).query(toy.layout.group_keys(0, b)) as lease:
            assert len(lease) == 4
        with toy.tier.group(2).query([toy.layout.group_key(2, a[3])]) as lease:
            assert len(lease) == 1
        assert toy.tier.group(0).evict(1) == 1, "one of A's attention blocks goes"
        assert toy.tier.usable_prefix(a) == 0
        toy.save(c, [(0, 4), (2, 4), (3, 4)])
        a_ckpt = toy.tier.group(2).contains(toy.layout.group_key(2, a[3]))
        if group_eviction:
            assert not a_ckpt, "the checkpoint no restore can use went first"
            assert toy.tier.usable_prefix(b) == 4
            assert toy.tier.cold_blocks(2) == 0, "the cold checkpoint was the one evicted"
        else:
            assert a_ckpt and toy.tier.usable_prefix(b) == 0, "by LRU alone B's checkpoint went"
    finally:
        toy.close()


def test_record_save_checks_its_ranges():
    toy = Toy()
    try:
        keys = toy.chain(5, 3)
        with pytest.raises(kvtier.GeometryMismatchError):
            toy.tier.record_save(keys, [(0, 3)])
        with pytest.raises(kvtier.LengthMismatchError):
            toy.tier.record_save(keys, [(0, 4), None, None])
        toy.tier.record_save(keys, [(0, 3), None, None])
        toy.tier.settle_evictions()
        assert [toy.tier.cold_blocks(g) for g in range(3)] == [0, 0, 0]
        with pytest.raises(IndexError):
            toy.tier.cold_blocks(3)
    finally:
        toy.close()
