"""Shared fixtures: a small geometry over numpy arrays (host backend, no GPU needed), and a short
directory for Unix-domain sockets."""

import os
import shutil
import tempfile

import numpy as np
import pytest

import kvtier

PAGE_TOKENS = 16
LAYERS = 2
PAGES = 32
HEADS, DIM = 2, 8  # 16 tokens x 2 heads x 8 dims x 2 B = 512 B per page per arena


def make_arrays(pages=PAGES, layers=LAYERS, dtype=np.float16):
    """Per-layer K and V arrays [pages * 16, heads, dim] in arena order [k0, v0, k1, v1, ...],
    each page filled with values that name its arena and page."""
    out = []
    for a in range(2 * layers):
        x = np.zeros((pages * PAGE_TOKENS, HEADS, DIM), dtype=dtype)
        for p in range(pages):
            x[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS] = a * 1000 + p
        out.append(x)
    return out


def page(arr, p):
    return arr[p * PAGE_TOKENS : (p + 1) * PAGE_TOKENS]


@pytest.fixture
def arrays():
    return make_arrays()


@pytest.fixture
def geometry(arrays):
    names = [f"{kv}.L{l}" for l in range(LAYERS) for kv in ("k", "v")]
    return kvtier.Geometry.from_tensors(arrays, model="test-model", page_tokens=PAGE_TOKENS, names=names)


@pytest.fixture
def tier(geometry):
    return kvtier.Tier(geometry, 8 * geometry.slot_bytes, "lru", backing="plain")


@pytest.fixture
def rank(tier, arrays):
    r = tier.attach_host(arrays)
    yield r
    r.close()


# A Unix-domain socket's path is at most 107 bytes (sun_path); pytest's tmp_path under a long
# TMPDIR (a build directory, say) passes that, and binding there is refused with a ConfigError.
SOCKET_PATH_MAX = 107


@pytest.fixture
def socket_dir(tmp_path):
    """A directory for Unix-domain sockets whose paths stay under 107 bytes: tmp_path where it is
    short enough, otherwise a fresh directory under /tmp (removed after the test)."""
    if len(os.fsencode(tmp_path / "kvtierd.sock")) <= SOCKET_PATH_MAX - 16:
        yield tmp_path
        return
    short = tempfile.mkdtemp(prefix="kvt-", dir="/tmp")
    try:
        yield short
    finally:
        shutil.rmtree(short, ignore_errors=True)
