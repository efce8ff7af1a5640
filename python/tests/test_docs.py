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


README = pathlib.Path(__file__).resolve().parents[2] / "README.md"


def test_the_readmes_first_python_example_runs_on_cpu_without_torch():
    # The README shows the CPU form first: it must run here as written, with numpy only.
    text = README.read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 2, "the README shows the CPU form and the GPU form"
    cpu = blocks[0]
    assert "torch" not in cpu and "cuda" not in cpu, cpu
    assert "torch.cuda.current_stream()" in blocks[1]
    exec(compile(cpu, str(README), "exec"), {"__name__": "__readme_example__"})
