#!/usr/bin/env bash
# The cost of eviction at scale (`benches/tier.rs`, workload `evict`: a full pool, every save of a
# fresh 43-block chain evicts 43 blocks), at 10,000, 100,000 and 1,000,000 slots, for every policy:
# chain-aware victims (the default) without hints, then with 64 chains hinted (the hinted classes
# live), and the slot acquisition alone (the `acquire` workload: selection, claims and finish of the
# 43 victims, every save timed), and a query of a 43-block chain per pool size; then the default
# policy at 1 to 16 threads (throughput against threads) at 100,000 and 1,000,000 slots. Each run
# prints its own table (ns per save, p50/p99/p99.9 of every save timed).
#
# Usage: benches/evict_at_scale.sh [TIER_BENCH_BINARY] [--quick]
#   TIER_BENCH_BINARY: a built `tier` bench (default: built here with `cargo bench --bench tier --no-run`).
#   --quick: 10,000 and 100,000 slots only, fewer saves (a smoke run).
set -euo pipefail
cd "$(dirname "$0")/.."
bin=""
quick=0
for a in "$@"; do
    case $a in
    --quick) quick=1 ;;
    *) bin=$a ;;
    esac
done
if [[ -z $bin ]]; then
    bin=$(cargo bench --bench tier --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("reason")=="compiler-artifact" and m.get("executable") and m["target"]["name"]=="tier"][-1])')
fi
caps=(10000 100000 1000000)
ops=2000000 # 1,000 saves per thread
if ((quick)); then
    caps=(10000 100000)
    ops=200000
fi
run() { "$bin" --workloads evict --contenders core --sample 1 --ops "$ops" "$@" 2>&1 | grep -E '^ +[0-9.]+s +evict' | sed "s|^|$* :|" || true; }
# The slot acquisition alone (selection, claims, finish) timed: the `acquire` workload.
acquire() { "$bin" --workloads acquire --contenders core --ops "$ops" "$@" 2>&1 | grep -E '^ +[0-9.]+s +acquire' | sed "s|^|acquire $* :|" || true; }
echo "# $(date -u +%FT%TZ) $(nproc) CPUs, $bin"
for c in "${caps[@]}"; do
    for p in adaptive-lfu prefix-lfu lru clock sieve s3fifo 2q; do
        run --capacity "$c" --threads 1 --policy "$p"
        run --capacity "$c" --threads 1 --policy "$p" --hints 64
        acquire --capacity "$c" --threads 1 --policy "$p"
    done
    # A query of a 43-block chain against the same pool size (every lookup, pin and policy hit).
    "$bin" --workloads query --contenders core --ops "$ops" --capacity "$c" --threads 1 2>&1 |
        grep -E '^ +[0-9.]+s +query' | sed "s|^|query --capacity $c :|" || true
done
for c in "${caps[@]:1}"; do
    run --capacity "$c" --threads 1,2,4,8,16 --policy adaptive-lfu
done
