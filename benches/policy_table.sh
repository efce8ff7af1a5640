#!/usr/bin/env bash
# The policy table: page hit ratios of the default policy against the contenders (the simple
# policies plain: LRU, CLOCK, SIEVE, S3-FIFO, 2Q with probation; and LRU with queue-protecting
# admission) on every trace shape, at 1,244 to 9,952 GLM-5.2 slots, without and with hints for a
# 64-request engine queue, with the offline optimum.
#
# Traces: the conversation trace's two halves by time (the first is what the policies were tuned
# on; the second is held out), two traces fitted to it by `kvtier synth` (fitted; fast returns),
# and four stated shapes from `kvtier synth --shape` (agentic, short, shared-prompt, bursty).
# Each (trace, policy) is one `kvtier simulate --json` process (the simple policies plain, the
# default chain-aware; LRU and the default each without hints, with hints, and with hints and
# queue-protecting admission; CLOCK, SIEVE, S3-FIFO and 2Q without hints); they run in parallel,
# one per CPU. `benches/policy_table.py` then prints the tables from the JSON reports.
#
# Usage: benches/policy_table.sh [KVTIER_BINARY] [OUT_DIR] [--quick]
#   KVTIER_BINARY: the `kvtier` command (default: built here with `cargo build --release -p kvtier-cli`).
#   OUT_DIR: where the traces, JSON reports and logs go (default: policy-table).
#   --quick: 300 requests per trace, two pool sizes (a smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
bin="" out="" quick=0
for a in "$@"; do
    case $a in
    --quick) quick=1 ;;
    *) if [[ -z $bin ]]; then bin=$a; else out=$a; fi ;;
    esac
done
if [[ -z $bin ]]; then
    cargo build --release -q -p kvtier-cli
    bin=target/release/kvtier
fi
out=${out:-policy-table}
mkdir -p "$out"
conv=data/mooncake_conversation_trace.jsonl.zst
pools=1244slots,2488slots,4976slots,9952slots
n_long=12000 n_agentic=2000 limit=()
if ((quick)); then
    pools=1244slots,9952slots
    n_long=300 n_agentic=100 limit=(--requests 300)
fi
echo "# $(date -u +%FT%TZ) $(nproc) CPUs, $bin"
"$bin" synth "$conv" --seed 1 --requests "$n_long" -o "$out/synth-fitted.jsonl"
"$bin" synth "$conv" --seed 2 --gap-scale 0.25 --system-prompts 4 --requests "$n_long" -o "$out/synth-fast.jsonl"
"$bin" synth --shape agentic --seed 1 --requests "$n_agentic" -o "$out/agentic.jsonl"
for s in short shared-prompt bursty; do
    "$bin" synth --shape "$s" --seed 1 --requests "$n_long" -o "$out/$s.jsonl"
done
# name|trace arguments
traces=(
    "conversation-first-half|$conv --half first"
    "conversation-second-half|$conv --half second"
    "synth-fitted|$out/synth-fitted.jsonl"
    "synth-fast|$out/synth-fast.jsonl"
    "agentic|$out/agentic.jsonl"
    "short|$out/short.jsonl"
    "shared-prompt|$out/shared-prompt.jsonl"
    "bursty|$out/bursty.jsonl"
)
jobs=()
for t in "${traces[@]}"; do
    IFS='|' read -r name args <<<"$t"
    # The contenders plain, the default chain-aware (as the tier configures it).
    for pc in lru:off clock:off sieve:off s3fifo:off 2q:off adaptive-lfu:on; do
        p=${pc%:*} chain=${pc#*:} opt=--no-optimum hints=""
        [[ $p == lru ]] && opt=""
        [[ $p == lru || $p == adaptive-lfu ]] && hints="--lookahead 64 --protect"
        jobs+=("$bin simulate $args ${limit[*]} --pool $pools --policies $p --chain $chain $hints $opt --json --progress-every 60 > $out/$name.$p.json 2> $out/$name.$p.log")
    done
done
printf '%s\n' "${jobs[@]}" >"$out/commands.txt"
start=$(date +%s)
printf '%s\0' "${jobs[@]}" | xargs -0 -P "$(nproc)" -I{} bash -c '{}'
echo "# simulate runs took $(($(date +%s) - start)) s"
python3 benches/policy_table.py "$out"
