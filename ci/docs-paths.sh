#!/usr/bin/env bash
# Docs that cannot drift: the repository paths that README.md and docs/*.md name exist,
# docs/design.md's module map lists exactly the source files there are, and every figure of
# docs/benchmarks.md says where it comes from.
#
# Usage: ci/docs-paths.sh [--report]   (prints each mismatch; exits 1 on any, 0 with --report)
#
# 1. Named paths. In README.md, docs/*.md and docs/results/README.md, every inline code span
#    (`...`), every fenced code block of a shell language (sh, bash, shell, console) and every
#    link target ([..](target)) is read as words; a word that starts with one of the top-level
#    folders src/ cuda/ tests/ benches/ loom-tests/ fuzz/ ci/ examples/ daemon/ cli/ python/
#    (optionally after ./) is a path and must exist in the repository (tracked or not ignored). A
#    link target that is a relative path (not a URL, not only an #anchor) must exist too, resolved
#    from the page's folder. Syntax:
#    - `path::name` (a test or item in that file), `path:LINE`, `path:LINE-LINE` and `#anchor`
#      suffixes are dropped before the check;
#    - globs: `*`, `?`, `[abc]` within a segment, `**` for any number of segments, `{a,b}` for
#      alternatives (src/evict/{sieve,s3fifo}.rs); a glob must match at least one path;
#    - placeholders: `<name>` stands for one segment or part of one (fuzz/corpus/<target>/),
#      `...` as a whole segment for any number of segments (tests/.../mod.rs) and inside a
#      segment for any text (docs/results/bench-...md);
#    - a word whose first folder is not one of those above (target/, /tmp/, crate-relative
#      paths) is not checked: write crate files from the repository root (cli/src/trace.rs).
# 2. The module map. docs/design.md's table with the columns `crate | module | what` (an empty crate
#    cell continues the crate above) maps each crate (its package name in Cargo.toml, the root or a
#    workspace member) to its src/ folder. For the crates it has rows for:
#    - each name in a module cell (`geometry`, `index/`, `main.rs`) is a file `NAME.rs`, a folder
#      `NAME/` or a module written inline in the crate root; in the what cell, each word in
#      backticks that ends in `.rs` or `/` is a file or folder, relative to the row's folder (the
#      first folder module of its module cell) when it is a bare name (`table.rs`), and when it
#      has a `/` inside, to the row's folder if it is there (`backend/layers.rs`) or else to the
#      crate's src/ (`pool/shared.rs`);
#    - every `.rs` file of the crate's src/ other than the crate root (lib.rs) is listed: `x.rs` by
#      the module `x`, `x/mod.rs` by the module `x` or `x/`, any other `x/y.rs` by `y.rs` in x's row
#      or by `x/y.rs` in any row of that crate.
# 3. Figure rows. In docs/benchmarks.md, every table with a digit in a row below its header carries
#    where its figures come from (the convention at the top of that page): either its header has the
#    columns machine, date, commit, command and raw, each non-empty in every row, or a run line
#    stands above it in its section (no heading in between): a paragraph that starts with `Run:`
#    and names `machine:`, `date:` (followed by a YYYY-MM-DD date), `commit:` (followed by a short
#    hexadecimal hash), `command:` (followed by a command in backticks) and `raw:` (followed by a
#    link or `not kept`), in that order. A run line holds until the next heading or run line.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import fnmatch, glob, os, re, subprocess, sys

REPORT = "--report" in sys.argv[1:]
ROOTS = ["src", "cuda", "tests", "benches", "loom-tests", "fuzz", "ci", "examples", "daemon", "cli", "python"]
SHELL_FENCES = {"sh", "bash", "shell", "console"}
problems = []

# The repository's files: tracked, or untracked and not ignored, that exist on disk.
try:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         check=True, capture_output=True).stdout.decode()
    files = sorted(f for f in out.split("\0") if f and os.path.isfile(f))
except (OSError, subprocess.CalledProcessError):
    files = sorted(os.path.relpath(os.path.join(d, f)) for d, _, fs in os.walk(".")
                   if "/target" not in d and "/.git" not in d for f in fs)
dirs = set()
for f in files:
    parts = f.split("/")
    for i in range(1, len(parts)):
        dirs.add("/".join(parts[:i]))
everything = files + sorted(dirs)

def exists(p):
    p = p.rstrip("/")
    return p in dirs or p in set_files

set_files = set(files)

def expand_braces(p):
    m = re.search(r"\{([^{}]*)\}", p)
    if not m: return [p]
    return [x for alt in m.group(1).split(",") for x in expand_braces(p[:m.start()] + alt + p[m.end():])]

def to_regex(p):
    """A path pattern (globs and placeholders) as a regex over repository paths."""
    out = []
    segs = p.rstrip("/").split("/")
    for i, seg in enumerate(segs):
        last = i == len(segs) - 1
        if seg in ("...", "**"):
            out.append(r"(?:[^/]+/)*" if not last else r".*")
            continue
        seg = re.sub(r"<[^<>/]+>", "\0", seg).replace("...", "\1")
        r = fnmatch.translate(seg)
        r = r[r.index("(?s:") + 4:r.rindex(")")] if "(?s:" in r else r.rstrip("\\Z")
        r = r.replace("\0", "[^/]+").replace("\1", "[^/]*")
        out.append(r + ("" if last else "/"))
    return "^" + "".join(out) + "/?$"

def matches(p):
    pats = expand_braces(p)
    for q in pats:
        if not re.search(r"[*?\[<]|\.\.\.", q):
            if exists(q): continue
            return False
        rx = re.compile(to_regex(q))
        if not any(rx.match(x) for x in everything):
            return False
    return True

def clean(word):
    word = word.strip("()[],;:\"'`!").rstrip(".")
    word = re.sub(r"^\./", "", word)
    word = word.split("#")[0]
    word = re.sub(r"::.*$", "", word)
    word = re.sub(r":\d+(-\d+)?$", "", word)
    return word

def is_repo_path(word):
    return any(word == r + "/" or word.startswith(r + "/") for r in ROOTS)

docs = ["README.md"] + sorted(glob.glob("docs/*.md")) + ["docs/results/README.md"]
for doc in docs:
    text = open(doc, encoding="utf-8").read()
    lines = text.split("\n")
    fence, para = None, []   # para: the lines (number, text) of the paragraph being read

    def check_words(words, n):
        for w in words:
            p = clean(w)
            if p and is_repo_path(p) and not matches(p):
                problems.append(f"{doc}:{n}: `{p}` does not exist")

    def paragraph():
        """Code spans and links of a paragraph (a span may run over a line break)."""
        if not para: return
        first = para[0][0]
        joined = "\n".join(t for _, t in para)
        line_of = lambda pos: first + joined.count("\n", 0, pos)
        for m in re.finditer(r"(`+)(.+?)\1", joined, re.S):
            check_words(m.group(2).split(), line_of(m.start()))
        prose = re.sub(r"(`+)(.+?)\1", lambda m: " " * len(m.group(0)), joined, flags=re.S)
        for m in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", prose):
            target = m.group(1)
            t = target.split("#")[0]
            if not t or re.match(r"^[a-z][a-z0-9+.-]*:", t): continue
            resolved = os.path.normpath(os.path.join(os.path.dirname(doc), t))
            if not exists(resolved) and not matches(resolved):
                problems.append(f"{doc}:{line_of(m.start())}: link target `{target}` ({resolved}) does not exist")
        para.clear()

    for n, line in enumerate(lines, 1):
        m = re.match(r"^\s*(```+|~~~+)\s*([\w,+-]*)", line)
        if m:
            paragraph()
            if fence is None:
                fence = (m.group(1), m.group(2).split(",")[0].lower())
            elif line.strip().startswith(fence[0]):
                fence = None
            continue
        if fence is not None:
            if fence[1] in SHELL_FENCES:
                check_words(line.split(), n)
        elif not line.strip():
            paragraph()
        else:
            para.append((n, line))
    paragraph()

# ---------------------------------------------------------------- figure rows
RUN_FIELDS = [("machine:", r"\s*\S"), ("date:", r"\s*20\d\d-\d\d-\d\d\b"), ("commit:", r"\s*[0-9a-f]{7,40}\b"),
              ("command:", r"\s*`[^`]+`"), ("raw:", r"\s*(\[[^\]]+\]\([^)\s]+\)|not kept)")]
SOURCE_COLUMNS = ["machine", "date", "commit", "command", "raw"]

def run_line_problems(text):
    """What a run line lacks: each field in order, each followed by what it must name."""
    missing, pos = [], 0
    for field, follows in RUN_FIELDS:
        i = text.find(field, pos)
        if i < 0:
            missing.append(f"`{field}`")
            continue
        if not re.match(follows, text[i + len(field):]):
            missing.append(f"`{field}` followed by " + {"date:": "a YYYY-MM-DD date", "commit:": "a hexadecimal hash",
                                                        "command:": "a command in backticks", "raw:": "a link or `not kept`",
                                                        "machine:": "a machine"}[field])
        pos = i + len(field)
    return missing

bench = "docs/benchmarks.md"
if os.path.exists(bench):
    lines = open(bench, encoding="utf-8").read().split("\n")
    cells = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]
    run, run_at, fence, i = None, None, False, 0
    tables = rows_checked = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^\s*(```|~~~)", line):
            fence = not fence
            i += 1
            continue
        if fence:
            i += 1
            continue
        if re.match(r"^#{1,6}\s", line):
            run, run_at = None, None
        elif line.startswith("Run:"):
            j = i
            while j < len(lines) and lines[j].strip() and not lines[j].startswith("|"):
                j += 1
            run, run_at = " ".join(l.strip() for l in lines[i:j]), i + 1
            for m in run_line_problems(run):
                problems.append(f"{bench}:{run_at}: run line without {m}")
            i = j
            continue
        elif line.strip().startswith("|"):
            start = i
            while i < len(lines) and lines[i].strip().startswith("|"):
                i += 1
            header, body = cells(lines[start]), [cells(l) for l in lines[start + 2:i]]
            if any(re.search(r"\d", c) for row in body for c in row):
                tables += 1
                cols = [h.lower() for h in header]
                if all(c in cols for c in SOURCE_COLUMNS):
                    for k, row in enumerate(body):
                        rows_checked += 1
                        for c in SOURCE_COLUMNS:
                            idx = cols.index(c)
                            if idx >= len(row) or not row[idx]:
                                problems.append(f"{bench}:{start + 3 + k}: figure row without its {c}")
                        d = row[cols.index("date")] if cols.index("date") < len(row) else ""
                        if d and not re.match(r"20\d\d-\d\d-\d\d\b", d):
                            problems.append(f"{bench}:{start + 3 + k}: date `{d}` is not YYYY-MM-DD")
                elif run is None:
                    problems.append(f"{bench}:{start + 1}: a table of figures with no run line above it in its section "
                                    f"(`Run: machine: ... date: ... commit: ... command: ... raw: ...`) and no "
                                    f"{', '.join(SOURCE_COLUMNS)} columns")
                else:
                    rows_checked += len(body)
            continue
        i += 1

# ---------------------------------------------------------------- the module map
def package_name(manifest):
    sect = None
    for line in open(manifest, encoding="utf-8"):
        s = line.strip()
        if s.startswith("["): sect = s
        m = re.match(r'name\s*=\s*"([^"]+)"', s)
        if m and sect == "[package]":
            return m.group(1)
    return None

crate_dir = {}
for manifest in ["Cargo.toml"] + sorted(glob.glob("*/Cargo.toml")):
    name = package_name(manifest)
    if name:
        crate_dir[name] = os.path.join(os.path.dirname(manifest), "src") if os.path.dirname(manifest) else "src"

design = "docs/design.md"
lines = open(design, encoding="utf-8").read().split("\n")
cells = lambda l: [c.strip() for c in l.strip().strip("|").split("|")]
table, start = [], None
for i, l in enumerate(lines):
    if l.strip().startswith("|") and [c.lower() for c in cells(l)][:3] == ["crate", "module", "what"]:
        start = i
        j = i + 2
        while j < len(lines) and lines[j].strip().startswith("|"):
            table.append((j + 1, cells(lines[j])))
            j += 1
        break
if start is None:
    problems.append(f"{design}: no module map (a table with the columns `crate | module | what`)")

ticks = lambda s: re.findall(r"`([^`]+)`", s)
crate = None
named = {}  # crate -> set of paths relative to its src dir, named by the map
for n, row in table:
    if len(row) < 3: continue
    if ticks(row[0]): crate = ticks(row[0])[0]
    if crate not in crate_dir:
        problems.append(f"{design}:{n}: module map: crate `{crate}` is no package of this workspace")
        continue
    src = crate_dir[crate]
    rels = named.setdefault(crate, set())
    crate_root = next((r for r in ("lib.rs", "main.rs") if os.path.join(src, r) in set_files), None)
    root_text = open(os.path.join(src, crate_root), encoding="utf-8").read() if crate_root else ""
    folder = None
    for m in ticks(row[1]):
        m = m.strip()
        if m.endswith(".rs"):
            if not exists(os.path.join(src, m)):
                problems.append(f"{design}:{n}: module map: `{m}` of `{crate}`: {os.path.join(src, m)} does not exist")
            rels.add(m)
            continue
        name = m.rstrip("/")
        as_file, as_dir = os.path.join(src, name + ".rs"), os.path.join(src, name)
        inline = re.search(r"(?m)^\s*(pub(\([^)]*\))?\s+)?mod\s+" + re.escape(name) + r"\s*\{", root_text)
        if exists(as_dir) and folder is None:
            folder = name
        if exists(as_file): rels.add(name + ".rs")
        if exists(as_dir): rels.add(name + "/mod.rs")
        if not (exists(as_file) or exists(as_dir) or inline):
            problems.append(f"{design}:{n}: module map: module `{m}` of `{crate}`: no {as_file}, {as_dir}/ or inline `mod {name}` in {crate_root}")
    for w in ticks(row[2]):
        w = w.strip()
        if " " in w or not (w.endswith(".rs") or w.endswith("/")): continue
        # A bare name is relative to the row's folder; a name with a `/` is relative to the
        # row's folder when it is there (`backend/layers.rs` in the `cuda/` row), else to src/.
        inner = folder + "/" + w if folder is not None else None
        if "/" not in w.rstrip("/"):
            rel = inner or w
        else:
            rel = inner if inner and exists(os.path.join(src, inner)) else w
        if not exists(os.path.join(src, rel)):
            problems.append(f"{design}:{n}: module map: `{w}` (row of {row[1]}): {os.path.join(src, rel)} does not exist")
        rels.add(rel.rstrip("/") + ("/mod.rs" if w.endswith("/") else ""))
for crate, rels in sorted(named.items()):
    src = crate_dir[crate]
    for f in files:
        if not f.startswith(src + "/") or not f.endswith(".rs"): continue
        rel = f[len(src) + 1:]
        if rel == "lib.rs": continue
        if rel not in rels:
            problems.append(f"{design}: module map: {f} (crate `{crate}`) is not listed")

if not problems:
    print(f"ok: every path named in {len(docs)} pages exists; docs/design.md's module map lists "
          f"{', '.join(sorted(named))}'s source files exactly; every figure row of docs/benchmarks.md "
          f"({rows_checked} rows in {tables} tables) names its machine, date, commit, command and raw output")
    sys.exit(0)
for p in problems:
    print(p)
print(f"{len(problems)} mismatches between the docs and the tree (the rules: the top of ci/docs-paths.sh)")
if REPORT:
    print("(report only: --report)")
    sys.exit(0)
print("FAIL: docs name paths that do not exist, design.md's module map is out of date, or a figure row of benchmarks.md lacks its source")
sys.exit(1)
PY
