#!/usr/bin/env bash
# Pictures of kvtierd's metrics from a real run: starts `kvtierd --metrics` (a small pool, a private
# socket) and Debian's `prometheus` (scrape interval 1 s) on loopback, drives traffic through the
# daemon from two client processes for SECONDS, then renders Prometheus's own graph page for four
# series of docs/grafana-dashboard.json (hit ratio, copy GB/s each way, slots by state, copy latency
# p99) to PNG with headless Chromium.
#
# Usage: ci/metrics-picture.sh [OUT_DIR] [SECONDS]      (defaults: docs, 75)
#   KVTIERD=path         the daemon        (default target/release/kvtierd)
#   REMOTE_BENCH=path    client 1: `remote_bench rtt --socket S --keys 43 --iters 500` in a loop (saves 43 blocks, then
#                        queries hits and misses, resident saves, query + restore of the 43 blocks)
#                        (default target/release/examples/remote_bench)
#   TWO_PROCESSES=path   client 2: `two_processes` in a loop (saves 4 blocks, shares a lease, a
#                        second process restores them) (default target/release/examples/two_processes)
#   STAMP=text           file name suffix (default: today's UTC date, YYYY-MM-DD)
# Needs: prometheus, chromium (apt-get install prometheus chromium), curl, python3.
# Build first: cargo build --release -p kvtierd --examples
set -euo pipefail

out=${1:-docs}
secs=${2:-75}
kvtierd=${KVTIERD:-target/release/kvtierd}
remote_bench=${REMOTE_BENCH:-target/release/examples/remote_bench}
two_processes=${TWO_PROCESSES:-target/release/examples/two_processes}
stamp=${STAMP:-$(date -u +%F)}
for b in "$kvtierd" "$remote_bench" "$two_processes"; do
  [[ -x $b ]] || { echo "metrics-picture: $b is not an executable (cargo build --release -p kvtierd --examples)" >&2; exit 1; }
done
for t in prometheus chromium curl python3; do
  command -v "$t" >/dev/null || { echo "metrics-picture: $t not on PATH" >&2; exit 1; }
done
mkdir -p "$out"

dir=$(mktemp -d)
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$dir"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
until_ok() { # until_ok WHAT URL: polls URL every 0.2 s, at most 30 s
  for _ in $(seq 150); do curl -fs -o /dev/null "$2" && return 0; sleep 0.2; done
  echo "metrics-picture: $1 did not answer $2 within 30 s" >&2; exit 1
}

mport=$(free_port)
sock=$dir/kvtierd.sock
"$kvtierd" --socket "$sock" --geometry llama3-8b --pool 256MiB --backing plain --policy lru \
  --metrics "127.0.0.1:$mport" >"$dir/kvtierd.log" 2>&1 &
pids+=($!)
until_ok kvtierd "http://127.0.0.1:$mport/healthz"
echo "kvtierd: $(head -1 "$dir/kvtierd.log")"

pport=$(free_port)
cat >"$dir/prometheus.yml" <<EOF
global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: kvtierd
    static_configs:
      - targets: ['127.0.0.1:$mport']
EOF
prometheus --config.file="$dir/prometheus.yml" --storage.tsdb.path="$dir/data" \
  --web.listen-address="127.0.0.1:$pport" >"$dir/prometheus.log" 2>&1 &
pids+=($!)
until_ok prometheus "http://127.0.0.1:$pport/-/ready"

# Two clients, each a loop of whole client runs until the deadline.
end=$(( $(date +%s) + secs ))
( while (( $(date +%s) < end )); do
    "$remote_bench" rtt --socket "$sock" --keys 43 --iters 500 >/dev/null
  done ) >"$dir/client1.log" 2>&1 &
pids+=($!)
c1=$!
( while (( $(date +%s) < end )); do
    KVTIERD_SOCKET=$sock "$two_processes" >/dev/null; sleep 0.2
  done ) >"$dir/client2.log" 2>&1 &
pids+=($!)
c2=$!
echo "traffic for ${secs} s (remote_bench rtt and two_processes in loops) ..."
wait "$c1" || { echo "metrics-picture: client 1 failed:" >&2; cat "$dir/client1.log" >&2; exit 1; }
wait "$c2" || { echo "metrics-picture: client 2 failed:" >&2; cat "$dir/client2.log" >&2; exit 1; }
sleep 3 # a last scrape or two

# The dashboard's queries, with $instance dropped and $__rate_interval as 5s (5 scrapes).
declare -A expr=(
  [hit-ratio]='sum(rate(kvtier_hit_blocks_total[5s])) / (sum(rate(kvtier_hit_blocks_total[5s])) + sum(rate(kvtier_miss_blocks_total[5s])))'
  [copy-gbps]='sum by (direction) (rate(kvtier_copy_bytes_total[5s])) / 1e9'
  [slots]='sum by (state) (kvtier_slots)'
  [copy-p99]='histogram_quantile(0.99, sum by (le, direction) (rate(kvtier_copy_latency_seconds_bucket[5s])))'
)
range=$(( secs + 15 ))s
for name in hit-ratio copy-gbps slots copy-p99; do
  q=$(python3 -c 'import sys, urllib.parse; print(urllib.parse.quote(sys.argv[1], safe=""))' "${expr[$name]}")
  n=$(curl -fsG "http://127.0.0.1:$pport/api/v1/query" --data-urlencode "query=${expr[$name]}" |
    python3 -c 'import json, sys; print(len(json.load(sys.stdin)["data"]["result"]))')
  (( n > 0 )) || { echo "metrics-picture: $name: no series in Prometheus" >&2; exit 1; }
  url="http://127.0.0.1:$pport/graph?g0.expr=$q&g0.tab=0&g0.stacked=0&g0.show_exemplars=0&g0.range_input=$range"
  png=$out/metrics-$name-$stamp.png
  chromium --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$dir/chromium" --window-size=1400,900 --virtual-time-budget=15000 \
    --hide-scrollbars --screenshot="$png" "$url" >"$dir/chromium.log" 2>&1 ||
    { echo "metrics-picture: chromium failed for $name:" >&2; tail -20 "$dir/chromium.log" >&2; exit 1; }
  echo "$png: ${expr[$name]} ($n series)"
done
