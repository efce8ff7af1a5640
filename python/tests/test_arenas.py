"""A rank's tensors keep their memory: a tensor resized or given another storage after attach is
caught before any copy uses memory it no longer owns (``ArenaChangedError``)."""

import numpy as np
import pytest

import kvtier
from conftest import DIM, HEADS, PAGE_TOKENS, PAGES, make_arrays, page


def refused_everywhere(tier, rank, index):
    """Checks that a save and a restore through `rank` are refused with `ArenaChangedError` naming
    tensor `index`, and that nothing was saved, pinned or taken from the lease."""
    before = tier.stats()
    with pytest.raises(kvtier.ArenaChangedError) as e:
        rank.save(tier.namespace.keys([b"after"]), [2])
    assert e.value.index == index and e.value.field in ("address", "bytes")
    assert e.value.attached != e.value.found
    assert isinstance(e.value, kvtier.TensorError)
    with tier.query(tier.namespace.keys([b"before"])) as lease:
        assert len(lease) == 1
        with pytest.raises(kvtier.ArenaChangedError):
            rank.restore(lease, [3])
        assert lease.uses_left == 1, "a refused restore keeps the lease's use"
    s = tier.stats()
    assert (s["saved_blocks"], s["restored_blocks"], s["pinned_slots"]) == (
        before["saved_blocks"],
        before["restored_blocks"],
        0,
    )
    assert not tier.contains(tier.namespace.key(b"after"))


def attached(tier, arrays):
    rank = tier.attach_host(arrays)
    assert rank.save(tier.namespace.keys([b"before"]), [1]).wait(60)
    return rank


def test_numpy_resize_of_an_arena_is_refused(tier):
    arrays = make_arrays()
    rank = attached(tier, arrays)
    # The rank holds a reference, so numpy's own check refuses an ordinary resize...
    with pytest.raises(ValueError):
        arrays[2].resize((2 * PAGES * PAGE_TOKENS, HEADS, DIM))
    # ...and one without the check reallocates (or shrinks) the memory the rank was given.
    arrays[2].resize((2 * PAGES * PAGE_TOKENS, HEADS, DIM), refcheck=False)
    refused_everywhere(tier, rank, 2)
    rank.close()


def test_numpy_resize_of_the_array_that_owns_a_views_memory_is_refused(tier):
    base = np.zeros((4, PAGES * PAGE_TOKENS, HEADS, DIM), dtype=np.float16)
    views = [base[i] for i in range(4)]
    rank = attached(tier, views)
    # The views' own addresses do not move: their memory, owned by `base`, is freed.
    base.resize((1, PAGE_TOKENS, HEADS, DIM), refcheck=False)
    refused_everywhere(tier, rank, 0)  # every view shares the owner: the first is named
    rank.close()


def test_unchanged_arenas_pass_the_check(tier):
    arrays = make_arrays()
    with tier.attach_host(arrays) as rank:
        keys = tier.namespace.keys([b"x"])
        arrays[0][:] = 1  # writing the pages is what the engine does; it changes no address
        assert rank.save(keys, [1]).wait(60)
        with tier.query(keys) as lease:
            assert rank.restore(lease, [5]).wait(60)
        assert (page(arrays[0], 5) == 1).all()


@pytest.mark.parametrize("how", ["resize_", "set_", "storage_resize"])
def test_torch_storage_resized_or_replaced_is_refused(how):
    torch = pytest.importorskip("torch")
    kv = [torch.zeros((PAGES * PAGE_TOKENS, HEADS, DIM), dtype=torch.float16) for _ in range(4)]
    g = kvtier.Geometry.from_tensors(kv, model="torch-storage")
    tier = kvtier.Tier(g, 8 * g.slot_bytes, backing="plain")
    rank = attached(tier, kv)
    t = kv[3]
    if how == "resize_":
        t.resize_(4 * PAGES * PAGE_TOKENS, HEADS, DIM)  # a bigger storage: reallocated
    elif how == "set_":
        t.set_(torch.zeros_like(t))  # another storage; the old one is kept alive by the rank
    else:
        t.untyped_storage().resize_(0)  # the storage's memory freed under the tensor
    refused_everywhere(tier, rank, 3)
    rank.close()
