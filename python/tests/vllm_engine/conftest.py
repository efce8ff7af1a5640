"""Fixtures for the tests against a real vLLM engine (vLLM's CPU build, ``ci/vllm.sh``).

Each engine runs in a process of its own (``engine.py``): vLLM keeps process-wide state. Without
vLLM these tests are not collected, unless ``KVTIER_REQUIRE_VLLM=1`` (CI), where that fails.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from support import Daemon, run_engine


def vllm_available() -> bool:
    """A real vLLM imports (a directory named ``vllm`` on the path would import as an empty
    namespace package: it has no ``__file__``)."""
    try:
        import vllm
    except Exception:  # noqa: BLE001 - any import failure means no engine here
        return False
    return getattr(vllm, "__file__", None) is not None


if not vllm_available():
    if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        raise RuntimeError("KVTIER_REQUIRE_VLLM=1 but vllm does not import (install it with ci/vllm-env.sh)")
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session")
def model_dir():
    d = tempfile.mkdtemp(prefix="kvtier-vllm-model-")
    run_engine("make_model", {"model": d})
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def reference(model_dir):
    """Tokens of each prompt from an engine without the connector."""
    return run_engine("plain", {"model": model_dir})


@pytest.fixture
def sock_dir():
    d = tempfile.mkdtemp(prefix="kvv-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(sock_dir):
    d = Daemon(sock_dir)
    yield d
    d.stop()
