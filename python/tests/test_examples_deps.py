"""The example programs run without torch (or transformers) say what to install in one line and exit
2, instead of a ModuleNotFoundError traceback. Runs where torch or transformers is missing (ci/python.sh
--no-torch)."""

import importlib.util
import subprocess
import sys

import pytest

MISSING = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]


@pytest.mark.skipif(not MISSING, reason="torch and transformers are installed")
@pytest.mark.parametrize("example", ["llama_restore", "hybrid_cache"])
def test_an_example_without_torch_says_what_to_install(example):
    out = subprocess.run(
        [sys.executable, "-m", f"kvtier.examples.{example}"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "pip install torch transformers" in lines[0]
    assert f"kvtier.examples.{example} needs torch and transformers" in lines[0]
