#!/usr/bin/env python3
"""Prints the policy table (markdown) from the JSON reports of benches/policy_table.sh.

Usage: benches/policy_table.py OUT_DIR

For each trace: page hit ratios (and, in brackets, the ratio to plain LRU) of the contenders
(the simple policies plain: LRU, CLOCK, SIEVE, S3-FIFO, 2Q with probation; plain LRU with hints and
queue-protecting admission), of the default (adaptive-lfu, chain-aware) without hints, with hints,
with hints and protection, and the offline optimum, at each pool size. Then the default against the
best contender in each cell: without hints (against the best simple policy) and with hints
(against LRU with protection).
"""
import json
import pathlib
import sys

TRACES = [
    ("conversation-first-half", "conversation trace, first half by time (tuned on)"),
    ("conversation-second-half", "conversation trace, second half (held out)"),
    ("synth-fitted", "synth, fitted (held out)"),
    ("synth-fast", "synth, fast returns (held out)"),
    ("agentic", "shape agentic (held out)"),
    ("short", "shape short (held out)"),
    ("shared-prompt", "shape shared-prompt (held out)"),
    ("bursty", "shape bursty (held out)"),
]
SIMPLE = ["lru", "clock", "sieve", "s3fifo", "2q"]
ROWS = [
    ("lru", "LRU"),
    ("clock", "CLOCK"),
    ("sieve", "SIEVE"),
    ("s3fifo", "S3-FIFO"),
    ("2q", "2Q (probation)"),
    ("lru+la64+protect", "LRU, hints + protect"),
    ("adaptive-lfu+chain", "default"),
    ("adaptive-lfu+chain+la64", "default, hints"),
    ("adaptive-lfu+chain+la64+protect", "default, hints + protect"),
    ("optimum", "optimum"),
]


def main(out):
    out = pathlib.Path(out)
    summary = []
    for name, title in TRACES:
        runs, sizes, meta = {}, None, None
        for f in sorted(out.glob(f"{name}.*.json")):
            text = f.read_text()
            if not text.strip():
                print(f"{f}: empty (the run failed: see {f.with_suffix('.log')})", file=sys.stderr)
                continue
            rep = json.loads(text)
            sizes = [s for _, s in rep["sizes"]]
            meta = (rep["requests"], rep["pages"])
            for r in rep["runs"]:
                runs[(r["policy"], r["slots"])] = r["hit_ratio"]
        if sizes is None:
            continue
        print(f"\n**{title}** ({meta[0]:,} requests, {meta[1]:,} pages)\n")
        print("| policy | " + " | ".join(f"{s:,} slots" for s in sizes) + " |")
        print("|---|" + "---|" * len(sizes))
        for key, label in ROWS:
            cells = []
            for s in sizes:
                v, lru = runs.get((key, s)), runs.get(("lru", s))
                cells.append("-" if v is None else f"{v:.4f} ({v / lru:.2f}x)" if lru else f"{v:.4f}")
            print(f"| {label} | " + " | ".join(cells) + " |")
        for s in sizes:
            g = lambda k: runs.get((k, s), float("nan"))
            simple = [(g(k), k) for k in SIMPLE]
            best = max(simple)
            plain = (g("adaptive-lfu+chain") / best[0], best[1])
            hinted = max(g("adaptive-lfu+chain+la64"), g("adaptive-lfu+chain+la64+protect")) / g("lru+la64+protect")
            hinted_plain = g("adaptive-lfu+chain+la64") / g("lru+la64+protect")
            summary.append((name, s, plain, hinted_plain, hinted))
    print("\n**The default against the best contender** (ratio of page hit ratios; >= 1.000: at or above)\n")
    print(
        "| trace | slots | no hints: default / best simple policy (which) "
        "| hints: default / LRU+protect | hints: default+protect / LRU+protect |"
    )
    print("|---|---|---|---|---|")
    for name, s, (p, which), hp, h in summary:
        print(f"| {name} | {s:,} | {p:.3f} ({which}) | {hp:.3f} | {h:.3f} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
