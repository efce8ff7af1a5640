#!/usr/bin/env bash
# The module graph of kvtier's `src/`, derived from the code, and a check that it has no cycle.
#
# Usage: ci/module-graph.sh [--report] [--quiet]
#   prints every edge `a -> b  (first file:line, number of references)`, then every cycle of concern
#   with the reference behind each of its steps; exits 1 if there is a cycle (0 with --report, which
#   only reports). --quiet prints the cycles only.
#
# What counts (the rule this script checks):
# - Nodes: the top-level modules (`src/x.rs` or `src/x/`, and modules written inline in lib.rs)
#   and the first-level submodules of folders that live in their own file (`tier::core`,
#   `remote::client`, `pool::shared`). Anything deeper, and any module written inline in a file
#   (`sync::imp`, `cuda::raw`), belongs to the node of its file; lib.rs itself is the node `crate`.
#   The module tree is found from the `mod NAME;` / `mod NAME { .. }` declarations from lib.rs
#   down, so no module list is written here.
# - Edges: a node uses another when its code names a path into it: `use crate::..`, `use super::..`,
#   `use self::..`, `use` of a child module by its bare name (2018 paths), and paths in code such
#   as `crate::x::y`, `super::x`, `$crate::x`, or `m::x` where `m` is a child module or a name the
#   module imported. A path is followed through re-exports (`pub use`, `use`) to the module that
#   defines the item: `crate::HostTier` is an edge to `tier`, not to the crate root. Comments, doc
#   comments (hence intra-doc links), string literals and `pub(in path)` visibilities are not code.
#   Items under a cfg that needs `test` (`#[cfg(test)] mod tests`, `#[cfg(all(test, ..))]` items,
#   files starting with `#![cfg(test)]`) are left out; every other cfg (features, loom) is kept.
#   Names that reach a module only through a glob import (`use super::*`) are not followed.
# - Cycles of concern: a cycle between modules of which none is an ancestor of another. The edges
#   between a module and its own ancestor (`tier` <-> `tier::core`, anything <-> `crate`) are the
#   module tree itself and are not part of a cycle; a cycle between siblings (`tier::core` <->
#   `tier::save`) or unrelated modules (`tier::core` <-> `lease`) is. Cycles are also looked for
#   between top-level modules with each folder counted as one module (`lease` -> `tier`, because
#   lease.rs uses `tier/mod.rs`, and `tier::rank` -> `lease` make the cycle `lease` <-> `tier`).
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 - "$@" <<'PY'
import os, re, sys
from collections import defaultdict

REPORT = "--report" in sys.argv[1:]
QUIET = "--quiet" in sys.argv[1:]
SRC = "src"

# ---------------------------------------------------------------- lexing
def strip(text):
    """Comments and the contents of string and char literals become spaces (newlines kept)."""
    out = list(text)
    i, n = 0, len(text)
    def blank(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j); i = j
        elif text.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if text.startswith("/*", j): depth += 1; j += 2
                elif text.startswith("*/", j): depth -= 1; j += 2
                else: j += 1
            blank(i, j); i = j
        elif c in "rb" and re.match(r'(br|r)#*"', text[i:i + 300]) and not (i and (text[i-1].isalnum() or text[i-1] == "_")):
            m = re.match(r'(br|r)(#*)"', text[i:])
            close = '"' + m.group(2)
            j = text.find(close, i + len(m.group(0)))
            j = n if j < 0 else j + len(close)
            blank(i + len(m.group(0)), j - len(close)); i = j
        elif c == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, j); i = j + 1
        elif c == "'":
            # a char literal ('a', '\n', '\u{1F}', '{') or a lifetime ('a)
            if i + 1 < n and text[i + 1] == "\\":
                j = text.find("'", i + 2)
                blank(i + 1, j); i = j + 1
            elif i + 2 < n and text[i + 2] == "'":
                blank(i + 1, i + 2); i = i + 3
            else:
                i += 1
        else:
            i += 1
    return "".join(out)

def blank_range(s, a, b):
    return s[:a] + re.sub(r"[^\n]", " ", s[a:b]) + s[b:]

def match_close(s, i):
    """Index just past the bracket closing the one at s[i]."""
    pairs = {"{": "}", "(": ")", "[": "]"}
    stack = [pairs[s[i]]]
    j = i + 1
    while j < len(s) and stack:
        ch = s[j]
        if ch in pairs: stack.append(pairs[ch])
        elif ch in ")]}":
            stack.pop()
        j += 1
    return j

def item_end(s, i):
    """End of the item starting at s[i] (after its attributes): `;` at depth 0, or its `{ .. }`."""
    j = i
    while j < len(s):
        ch = s[j]
        if ch in "([":
            j = match_close(s, j); continue
        if ch == ";": return j + 1
        if ch == "{": return match_close(s, j)
        if ch == "}": return j  # end of the enclosing block
        j += 1
    return j

def skip_attrs(s, i):
    while True:
        m = re.compile(r"\s*#\s*\[").match(s, i)
        if not m: return i
        i = match_close(s, m.end() - 1)

# ---------------------------------------------------------------- cfg(test)
def needs_test(expr):
    """False if the cfg predicate `expr` is false whenever `test` is off (three-valued)."""
    toks = re.findall(r'\w+|"[^"]*"|[(),=]', expr)
    pos = 0
    def parse():
        nonlocal pos
        name = toks[pos]; pos += 1
        if pos < len(toks) and toks[pos] == "(":
            pos += 1
            args = []
            while toks[pos] != ")":
                args.append(parse())
                if toks[pos] == ",": pos += 1
            pos += 1
            if name == "not": return None if args[0] is None else (not args[0])
            if name == "all":
                return False if False in args else (True if all(a is True for a in args) else None)
            if name == "any":
                return True if True in args else (False if all(a is False for a in args) else None)
            return None
        if pos < len(toks) and toks[pos] == "=":
            pos += 2
            return None
        return False if name == "test" else None
    try:
        return parse() is False
    except (IndexError, ValueError):
        return False

CFG = re.compile(r"#\s*\[\s*cfg\s*\(")
def drop_test_items(s):
    while True:
        for m in CFG.finditer(s):
            close = match_close(s, m.end() - 1)
            if needs_test(s[m.end():close - 1]):
                end_attr = match_close(s, s.index("[", m.start()))
                start = skip_attrs(s, end_attr)
                s = blank_range(s, m.start(), item_end(s, start))
                break
        else:
            return s

# ---------------------------------------------------------------- use trees
def parse_use_tree(t):
    """`a::{b, c::d as e, self}` -> [(['a','b'], 'b'), (['a','c','d'], 'e'), (['a'], 'a')]."""
    t = re.sub(r"\s+", "", re.sub(r"\s+as\s+", "@", t))
    out = []
    def rec(prefix, t):
        parts, depth, cur = [], 0, ""
        for ch in t:
            if ch == "{": depth += 1
            if ch == "}": depth -= 1
            if ch == "," and depth == 0:
                parts.append(cur); cur = ""
            else:
                cur += ch
        parts.append(cur)
        for p in parts:
            if not p: continue
            b = p.find("{")
            if b >= 0:
                head = [x for x in p[:b].split("::") if x]
                rec(prefix + head, p[b + 1:p.rindex("}")])
                continue
            alias = None
            if "@" in p:
                p, alias = p.split("@")
            segs = [x for x in p.split("::") if x]
            if segs == ["self"]:
                out.append((prefix, alias or prefix[-1])); continue
            full = prefix + segs
            out.append((full, alias or full[-1]))
    rec([], t)
    return out

# ---------------------------------------------------------------- the module tree
class Module:
    def __init__(self, path, file, folder_child):
        self.path = path            # tuple of names
        self.file = file
        self.folder_child = folder_child
        self.children = {}          # name -> tuple path
        self.imports = {}           # name -> (list path absolute-ish, relative to self.path)
        self.globs = []
        self.refs = []              # (segments, line, text)

modules = {}

def node_of(path):
    if not path: return "crate"
    if len(path) >= 2 and modules[path[:2]].folder_child:
        return "::".join(path[:2])
    return path[0]

def load(path, file, text, lineno_base, dir_for_children, folder_child):
    mod = Module(path, file, folder_child)
    modules[path] = mod
    # inline modules and file modules declared here
    decl = re.compile(r"(?<![\w$])mod\s+(r#)?(\w+)\s*([;{])")
    while True:
        found = False
        for m in decl.finditer(text):
            # only at depth 0 of this module's text
            if text[:m.start()].count("{") != text[:m.start()].count("}"):
                continue
            name = m.group(2)
            if m.group(3) == ";":
                cand = [os.path.join(dir_for_children, name + ".rs"), os.path.join(dir_for_children, name, "mod.rs")]
                child_file = next((c for c in cand if os.path.exists(c)), None)
                if child_file is None:
                    print(f"warning: {file}: mod {name}; has no file ({' or '.join(cand)})", file=sys.stderr)
                    text = blank_range(text, m.start(), m.end())
                    found = True; break
                ctext = drop_test_items(strip(open(child_file, encoding="utf-8").read()))
                if re.match(r"\s*#!\s*\[\s*cfg\s*\(\s*test\s*\)\s*\]", ctext):
                    text = blank_range(text, m.start(), m.end()); found = True; break
                cdir = os.path.dirname(child_file) if child_file.endswith("mod.rs") else child_file[:-3]
                mod.children[name] = path + (name,)
                load(path + (name,), child_file, ctext, 0, cdir, bool(path) and len(path) == 1)
                text = blank_range(text, m.start(), m.end())
            else:
                open_brace = m.end() - 1
                close = match_close(text, open_brace)
                body = text[open_brace + 1:close - 1]
                lines_before = text[:open_brace + 1].count("\n")
                mod.children[name] = path + (name,)
                load(path + (name,), file, body, lineno_base + lines_before, os.path.join(dir_for_children, name), False)
                text = blank_range(text, m.start(), close)
            found = True
            break
        if not found: break
    # visibility paths are not references
    text = re.sub(r"pub\s*\(\s*in\s+[\w:$]+\s*\)", lambda m: " " * len(m.group(0)), text)
    # use declarations
    for m in re.finditer(r"(?<![\w$])use\s+([^;]*);", text):
        line = lineno_base + text[:m.start()].count("\n") + 1
        tree = m.group(1).strip()
        if tree.startswith("::"): continue
        for segs, alias in parse_use_tree(tree):
            if segs[-1] == "*":
                mod.globs.append(segs[:-1])
                mod.refs.append((segs[:-1], line, "use " + "::".join(segs)))
                continue
            mod.imports[alias] = segs
            mod.refs.append((segs, line, "use " + "::".join(segs)))
        text = blank_range(text, m.start(), m.end())
    mod.code = (text, lineno_base)

root_file = os.path.join(SRC, "lib.rs")
load((), root_file, drop_test_items(strip(open(root_file, encoding="utf-8").read())), 0, SRC, False)

# paths in code
PATH = re.compile(r"(?<![\w:])(\$crate|crate|super|self|[A-Za-z_]\w*)((?:\s*::\s*(?:r#)?\w+)+)")
for mod in modules.values():
    text, base = mod.code
    for m in PATH.finditer(text):
        head = m.group(1)
        segs = [head] + [x.strip() for x in m.group(2).split("::") if x.strip()]
        if head not in ("$crate", "crate", "super", "self") and head not in mod.children and head not in mod.imports:
            continue
        line = base + text[:m.start()].count("\n") + 1
        mod.refs.append((segs, line, re.sub(r"\s+", "", m.group(0))))

# ---------------------------------------------------------------- resolution
def absolute(mod_path, segs, depth=0):
    """Absolute path (tuple of names from the crate root) of `segs` as written in module mod_path,
    or None for an external crate."""
    cur = list(mod_path)
    segs = list(segs)
    if not segs: return None
    if segs[0] in ("crate", "$crate"):
        return tuple(segs[1:])
    if segs[0] == "self":
        return tuple(cur + segs[1:])
    if segs[0] == "super":
        while segs and segs[0] == "super":
            if not cur: return None
            cur.pop(); segs.pop(0)
        if segs and segs[0] == "self": segs.pop(0)
        return tuple(cur + segs)
    m = modules[tuple(mod_path)]
    if segs[0] in m.children:
        return tuple(cur + segs)
    if segs[0] in m.imports and depth < 20:
        tgt = absolute(mod_path, m.imports[segs[0]], depth + 1)
        return None if tgt is None else tuple(tgt) + tuple(segs[1:])
    return None

def target_module(abs_path, depth=0):
    """The module that defines the item (or module) at abs_path, following imports."""
    cur = ()
    i = 0
    while i < len(abs_path):
        name = abs_path[i]
        m = modules[cur]
        if name in m.children:
            cur = m.children[name]; i += 1; continue
        if name in m.imports and depth < 20:
            tgt = absolute(cur, m.imports[name])
            if tgt is None:
                return cur  # an external item re-exported by cur
            return target_module(tuple(tgt) + tuple(abs_path[i + 1:]), depth + 1)
        for g in m.globs:
            gt = absolute(cur, g)
            if gt is not None and gt in modules and depth < 20:
                gm = modules[gt]
                if name in gm.children or name in gm.imports:
                    return target_module(tuple(gt) + tuple(abs_path[i:]), depth + 1)
        return cur  # an item defined in cur
    return cur

edges = defaultdict(list)  # (a, b) -> [(file, line, text)]
nodes = set(node_of(p) for p in modules)
for mod in modules.values():
    a = node_of(mod.path)
    for segs, line, txt in mod.refs:
        ap = absolute(mod.path, segs)
        if ap is None: continue
        b = node_of(target_module(ap))
        if a != b:
            edges[(a, b)].append((mod.file, line, txt))

def ancestor(x, y):
    """True if node x is y's ancestor or y is x's (the module tree's own edges)."""
    if x == "crate" or y == "crate": return True
    return y.startswith(x + "::") or x.startswith(y + "::")

# ---------------------------------------------------------------- cycles
def shortest_path(graph, src, dst):
    """Shortest path src .. dst (breadth first, neighbours in name order), or None."""
    prev, queue = {src: None}, [src]
    for v in queue:
        if v == dst: break
        for w in sorted(graph.get(v, ())):
            if w not in prev:
                prev[w] = v; queue.append(w)
    if dst not in prev: return None
    path = [dst]
    while prev[path[-1]] is not None:
        path.append(prev[path[-1]])
    return path[::-1]

def cycles(graph, skip=frozenset()):
    """For every edge a -> b that lies on a cycle (and is not in skip), the shortest cycle through
    it, each written from its smallest node and listed once."""
    found = set()
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if (a, b) in skip: continue
            back = shortest_path(graph, b, a)
            if back is None: continue
            c = [a] + back
            k = c.index(min(c[:-1]))
            c = c[k:-1] + c[:k] + [c[k]]
            found.add(tuple(c))
    return sorted(found, key=lambda c: (len(c), c))

fine = defaultdict(set)
for (a, b) in edges:
    if not ancestor(a, b):
        fine[a].add(b)
top = defaultdict(set)
top_ev = {}
for (a, b), ev in edges.items():
    ta, tb = a.split("::")[0], b.split("::")[0]
    if "crate" in (ta, tb) or ta == tb: continue
    top[ta].add(tb)
    top_ev.setdefault((ta, tb), (a, b, ev[0]))

fine_cycles = cycles(fine)
covered = set()
for c in fine_cycles:
    tops = [x.split("::")[0] for x in c]
    covered.update((x, y) for x, y in zip(tops, tops[1:]) if x != y)
top_cycles = cycles(top, skip=covered)

def where(ev):
    f, line, txt = ev
    return f"{f}:{line} {txt}"

def components(graph):
    """The strongly connected components of graph with more than one node, sorted."""
    index, low, on, stack, out = {}, {}, set(), [], []
    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v); on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w); low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop(); on.discard(w); comp.append(w)
                if w == v: break
            if len(comp) > 1: out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index: visit(v)
    return sorted(out)

if not QUIET:
    print(f"module graph of {SRC}/: {len(nodes)} modules, {len(edges)} edges (a -> b: a's code names b)")
    for (a, b) in sorted(edges):
        ev = edges[(a, b)]
        tree = "   (module tree)" if ancestor(a, b) else ""
        print(f"  {a} -> {b}  ({where(ev[0])}; {len(ev)} reference{'s' if len(ev) > 1 else ''}){tree}")
    print()
if not fine_cycles and not top_cycles:
    print("ok: no cycle between modules")
    sys.exit(0)
groups = components(fine)
print(f"FOUND {len(fine_cycles)} cycles between modules in {len(groups)} groups (each group: modules that "
      f"all reach each other; each cycle: the shortest through one of the group's edges)")
for g in groups:
    print(f"group: {', '.join(g)}")
    for c in fine_cycles:
        if c[0] in g:
            print("  CYCLE " + " -> ".join(c))
            for a, b in zip(c, c[1:]):
                print(f"      {a} -> {b}: {where(edges[(a, b)][0])}")
if top_cycles:
    print(f"FOUND {len(top_cycles)} more cycles between top-level modules, each folder counted as one module "
          f"(through folder edges on no cycle above)")
    for c in top_cycles:
        print("  CYCLE (folders) " + " -> ".join(c))
        for a, b in zip(c, c[1:]):
            fa, fb, ev = top_ev[(a, b)]
            print(f"      {a} -> {b}: {fa} -> {fb}: {where(ev)}")
if REPORT:
    print("(report only: --report)")
    sys.exit(0)
print("FAIL: import cycles between modules (see the rule at the top of ci/module-graph.sh)")
sys.exit(1)
PY
