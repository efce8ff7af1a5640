"""Layer-wise restores and saves through the host backend (numpy arrays as arenas): the geometry's
layers, the groups of a handle, per-layer waits and their errors."""

import pytest

import kvtier
from conftest import LAYERS, PAGE_TOKENS, page


@pytest.fixture
def layered(arrays):
    names = [f"{kv}.L{l}" for l in range(LAYERS) for kv in ("k", "v")]
    g = kvtier.Geometry.from_tensors(arrays, model="test-model", page_tokens=PAGE_TOKENS, names=names)
    assert g.layers == [0, 0, 0, 0]
    g2 = g.with_layers([l for l in range(LAYERS) for _ in ("k", "v")])
    assert g2.layers == [0, 0, 1, 1] and g2 == g and g2.namespace == g.namespace
    with pytest.raises(kvtier.errors.GeometryError):
        g.with_layers([1, 0, 0, 0])
    t = kvtier.Tier(g2, 8 * g2.slot_bytes, "lru", backing="plain")
    r = t.attach_host(arrays)
    yield t, r
    r.close()


def test_layer_wise_restore_waits_per_layer_and_restores_every_byte(layered, arrays):
    tier, rank = layered
    keys = tier.namespace.keys([b"a", b"b"])
    rank.save(keys, [1, 2]).wait()
    with tier.query(keys) as lease:
        h = rank.restore_layers(lease, [7, 8], 2)
    assert h.layer_groups == 2
    assert h.layer_event(0) is None  # host ranks have no device events
    h.wait_layer(0, 0)
    h.wait_layer(1, 0)
    with pytest.raises(kvtier.errors.BackendMismatchError):
        h.wait_layer(2, 0)
    assert h.wait() is True
    for a in arrays:
        assert (page(a, 7) == page(a, 1)).all() and (page(a, 8) == page(a, 2)).all()
    with tier.query(keys) as lease:
        whole = rank.restore(lease, [9])
    assert whole.layer_groups is None
    whole.wait_layer(5, 0)  # a whole-block copy: any layer waits for all of it
    assert (page(arrays[3], 9) == page(arrays[3], 1)).all()


def test_layer_wise_save_takes_one_wait_per_group_or_one(layered, arrays):
    tier, rank = layered
    keys = tier.namespace.keys([b"c", b"d"])
    with pytest.raises(kvtier.errors.BackendMismatchError):
        rank.save_layers(keys, [3, 4], 2, [0, 0, 0])
    with pytest.raises(TypeError):
        rank.save_layers(keys, [3, 4], 2, ["not an event"])
    t = rank.save_layers(keys, [3, 4], 2, [0, 0])
    assert t.wait() is True and t.saving == [0, 1]
    assert t.handle.layer_groups == 2
    with tier.query(keys) as lease:
        assert len(lease) == 2
