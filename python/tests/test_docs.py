"""The Python examples of docs/python.md run as written (on CPU tensors here; on a GPU they use the
CUDA rank)."""

import pathlib
import re

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "python.md"


def test_docs_python_examples_run():
    pytest.importorskip("torch")
    text = DOC.read_text()  # the repository's doc: a missing file is a failure, not a skip
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/python.md has no python example"
    for code in blocks:
        exec(compile(code, str(DOC), "exec"), {"__name__": "__doc_example__"})
