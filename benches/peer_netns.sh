#!/usr/bin/env bash
# The peer bench (benches/peer.rs) across a real network stack: two network namespaces on this
# machine ("hosts" kvt-reader and kvt-owner) joined by a veth pair, UCX held to TCP over it, and
# `tc netem` adding a delay to every packet the reader sends (so each round trip takes that much
# longer). For each delay the bench fetches 1, 8 and 43 GLM-5.2 blocks from the owner's pool,
# checks every byte, and prints latency and GB/s per contender.
#
# Usage (root; iproute2):  bash benches/peer_netns.sh [--iters N] [DELAY_MS ...]
#   defaults: --iters 20, delays 0 1 10
# Needs the NIXL runtime (eval "$(bash ci/nixl.sh)") and builds the bench with --features nixl
# (or runs the bench executable KVTIER_PEER_BENCH_EXE names). A delay above 0 needs the kernel's
# netem qdisc (sch_netem); without it the script says so and exits with status 3.
# The namespaces and the veth pair are removed on exit.
set -euo pipefail
# A bench executable named relative to the caller's directory still names it after the cd below.
if [[ -n ${KVTIER_PEER_BENCH_EXE:-} ]]; then
    KVTIER_PEER_BENCH_EXE=$(realpath -- "$KVTIER_PEER_BENCH_EXE")
fi
cd "$(dirname "$0")/.."
iters=20
delays=()
while (($#)); do
    case $1 in
        --iters) iters=$2; shift 2 ;;
        -h | --help) sed -n 2,13p "$0"; exit 0 ;;
        *) delays+=("$1"); shift ;;
    esac
done
((${#delays[@]})) || delays=(0 1 10)
[[ $(id -u) == 0 ]] || { echo "peer_netns.sh: needs root (ip netns, tc)" >&2; exit 2; }
command -v ip >/dev/null && command -v tc >/dev/null || { echo "peer_netns.sh: needs iproute2 (ip, tc)" >&2; exit 2; }
[[ -n ${LD_LIBRARY_PATH:-} && -n ${NIXL_PLUGIN_DIR:-} ]] || {
    echo "peer_netns.sh: the NIXL runtime is not in the environment: eval \"\$(bash ci/nixl.sh)\" first" >&2
    exit 2
}

reader=kvt-reader owner=kvt-owner
# NIXL's UCX backend refuses a UCX_TLS without a CUDA transport on a machine with NVIDIA GPUs.
tls=tcp,self
[[ -e /dev/nvidiactl ]] && tls+=,cuda_copy
cleanup() {
    ip netns del "$reader" 2>/dev/null || true
    ip netns del "$owner" 2>/dev/null || true
}
trap cleanup EXIT
cleanup
ip netns add "$reader"
ip netns add "$owner"
ip link add kvt-r type veth peer name kvt-o
ip link set kvt-r netns "$reader"
ip link set kvt-o netns "$owner"
# The same device name on both sides, so one UCX_NET_DEVICES fits both processes.
ip -n "$reader" link set kvt-r name kvt0
ip -n "$owner" link set kvt-o name kvt0
ip -n "$reader" addr add 10.201.0.1/24 dev kvt0
ip -n "$owner" addr add 10.201.0.2/24 dev kvt0
for ns in "$reader" "$owner"; do
    ip -n "$ns" link set lo up
    ip -n "$ns" link set kvt0 up
done

if [[ -n ${KVTIER_PEER_BENCH_EXE:-} ]]; then
    bench=$KVTIER_PEER_BENCH_EXE # a bench built elsewhere (a machine without cargo)
else
    cargo bench -p kvtier --features nixl --bench peer --no-run 2>&1 | tail -1
    bench=$(cargo bench -p kvtier --features nixl --bench peer --no-run --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\/peer-[^"]*\)".*/\1/p' | tail -1)
fi
[[ -x $bench ]] || { echo "peer_netns.sh: the bench executable was not found" >&2; exit 1; }

for d in "${delays[@]}"; do
    if [[ $d != 0 ]]; then
        tc -n "$reader" qdisc replace dev kvt0 root netem delay "${d}ms" || {
            echo "peer_netns.sh: tc netem is not available here (a kernel without sch_netem): delay ${d} ms not run" >&2
            exit 3
        }
    else
        tc -n "$reader" qdisc del dev kvt0 root 2>/dev/null || true
    fi
    echo "== netem delay ${d} ms on the reader's side, veth pair between two namespaces"
    ip netns exec "$reader" env UCX_TLS="$tls" UCX_NET_DEVICES=kvt0 KVTIER_PEER_BENCH_ITERS="$iters" \
        KVTIER_PEER_BENCH_NETNS="$owner" KVTIER_PEER_BENCH_LISTEN=10.201.0.2:0 "$bench"
done
