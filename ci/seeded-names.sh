#!/usr/bin/env bash
# The seeded bugs' names, checked both ways (the compiler no longer checks them: every seeded bug is
# compiled in under KVTIER_SEEDED_BUGS=1 and picked at run time by name, see src/seeded.rs).
# - kvtier, the CLI and the daemon: each `seeded("NAME")` in src/, cli/src/ and daemon/src/ is a bug of some bite table
#   (ci/bites.txt with its GPU-only rows, ci/loom.sh's `bites`, ci/proptest.sh's `bites_bugs`,
#   ci/sanitize.sh's `bites`), and each bug of those tables is a `seeded("NAME")` there.
# - the Python binding: the same between python/src/ and ci/python.sh's `bites_table`.
# - the vLLM connector and the SGLang backend: the same between python/kvtier/ (`seeded("NAME")` in
#   Python) and the `bites_table` of ci/vllm.sh and ci/sglang.sh.
# A bug in no table is never shown to bite; a table's bug with no branch would "bite" nothing (its
# test would pass and the bite fail, but under a misleading message). Exits 1 on any mismatch.
#
# Usage: ci/seeded-names.sh [--list]   (--list prints each name with where it is used)
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import re, sys, pathlib
LIST = "--list" in sys.argv[1:]
NAME = r"[a-z0-9][a-z0-9-]*"

def source_names(*roots):
    found = {}
    for root in roots:
        for p in sorted(pathlib.Path(root).rglob("*.rs")):
            for n, line in enumerate(p.read_text().splitlines(), 1):
                code = line.split("//", 1)[0]
                for m in re.finditer(r'\bseeded\("(' + NAME + r')"\)', code):
                    found.setdefault(m.group(1), []).append(f"{p}:{n}")
    return found

def array_rows(path, array):
    """The first field of each quoted row of the bash array `array=( ... )` in `path`."""
    text = pathlib.Path(path).read_text()
    m = re.search(r"^\s*" + array + r"=\(\n(.*?)^\s*\)", text, re.S | re.M)
    if not m:
        sys.exit(f"ci/seeded-names.sh: no array `{array}=(` in {path}")
    rows = {}
    for n, line in enumerate(m.group(1).splitlines()):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        for word in re.findall(r'"([^"]*)"', line) or line.split():
            rows.setdefault(word.split("|", 1)[0], []).append(path)
    return rows

def python_names(root):
    """`seeded("NAME")` calls in the package's Python code."""
    found = {}
    for p in sorted(pathlib.Path(root).rglob("*.py")):
        for n, line in enumerate(p.read_text().splitlines(), 1):
            for m in re.finditer(r'\bseeded\("(' + NAME + r')"\)', line.split("#", 1)[0]):
                found.setdefault(m.group(1), []).append(f"{p}:{n}")
    return found

def bites_txt(path):
    """The rows of ci/bites.txt, and its GPU-only rows (comments `#   NAME | tests/cuda.rs | ..`)."""
    rows = {}
    for line in pathlib.Path(path).read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            rows.setdefault(line.split("|", 1)[0], []).append(path)
        elif m := re.match(r"#\s+(" + NAME + r") \| tests/", line):
            rows.setdefault(m.group(1), []).append(path + " (GPU-only)")
    return rows

def appended_rows(path, array):
    """The first field of each `array+=("NAME|..")` in `path`."""
    rows = {}
    for m in re.finditer(r"^\s*" + array + r'\+=\("([^"|]*)\|', pathlib.Path(path).read_text(), re.M):
        rows.setdefault(m.group(1), []).append(path)
    if not rows:
        sys.exit(f"ci/seeded-names.sh: no `{array}+=(` in {path}")
    return rows

def merge(*tables):
    out = {}
    for t in tables:
        for k, v in t.items():
            out.setdefault(k, []).extend(v)
    return out

fail = 0
def check(what, src, tables):
    global fail
    for name in sorted(set(src) - set(tables)):
        print(f"FAIL: seeded bug `{name}` ({src[name][0]}) is in no bite table of {what}")
        fail = 1
    for name in sorted(set(tables) - set(src)):
        if not re.fullmatch(NAME, name):
            print(f"FAIL: `{name}` in {tables[name][0]} is not a seeded bug name")
        else:
            print(f"FAIL: seeded bug `{name}` of {tables[name][0]} has no seeded(\"{name}\") branch in {what}")
        fail = 1
    if LIST:
        for name in sorted(set(src) | set(tables)):
            print(f"{name}: {', '.join(src.get(name, []))} | {', '.join(sorted(set(tables.get(name, []))))}")

check("src/, cli/src/ and daemon/src/", source_names("src", "cli/src", "daemon/src"),
      merge(bites_txt("ci/bites.txt"), array_rows("ci/loom.sh", "bites"), array_rows("ci/proptest.sh", "bites_bugs"),
            appended_rows("ci/sanitize.sh", "bites")))
check("python/src/", source_names("python/src"), array_rows("ci/python.sh", "bites_table"))
check("python/kvtier/", python_names("python/kvtier"),
      merge(array_rows("ci/vllm.sh", "bites_table"), array_rows("ci/sglang.sh", "bites_table")))
sys.exit(fail)
PY
