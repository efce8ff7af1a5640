"""The Python examples of docs/python.md run as written (on CPU tensors here; on a GPU they use the
CUDA rank), and its quick start's CPU form runs with numpy alone."""

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


def quick_start():
    text = DOC.read_text()
    start = text.index("\n## Quick start\n")
    end = text.index("\n## ", start + 1)
    return text[start:end]


def test_the_quick_starts_cpu_example_runs_without_torch():
    # docs/python.md's quick start shows the CPU form first (`python`, run here as written with
    # numpy only), then the GPU form (`py`: not run without a GPU).
    section = quick_start()
    cpu = re.findall(r"```python\n(.*?)```", section, re.S)
    gpu = re.findall(r"```py\n(.*?)```", section, re.S)
    assert len(cpu) == 1 and len(gpu) == 1, "the quick start shows the CPU form and the GPU form"
    assert "torch" not in cpu[0] and "cuda" not in cpu[0], cpu[0]
    assert "torch.cuda.current_stream()" in gpu[0]
    exec(compile(cpu[0], str(DOC), "exec"), {"__name__": "__quick_start_example__"})
