#!/usr/bin/env bash
# The SSD tier's demotion and promotion (benches/ssd.rs) against fio on the same directory, block
# size and queue depths, one after the other: what the tier reaches of what the drive does.
#
# Usage: benches/ssd_vs_fio.sh [DIR]   (default: $KVTIER_DISK_BENCH_DIR or target/disk-bench)
# Needs fio (Debian: apt install fio). Writes a 442 MB file for each run and removes it.
#   demotion  = one pwrite at a time     -> fio write, psync, iodepth 1 (and io_uring, iodepth 8)
#   promotion = io_uring, 8 in flight    -> fio read, io_uring, iodepth 8 (and psync, iodepth 1)
# Block size: one GLM-5.2 disk slot, 3,452,928 B; O_DIRECT. GB = 10^9 B.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-${KVTIER_DISK_BENCH_DIR:-target/disk-bench}}
mkdir -p "$dir"
export KVTIER_DISK_BENCH_DIR=$dir
command -v fio >/dev/null || { echo "fio is not installed (Debian: apt install fio)" >&2; exit 2; }
echo "== $(date -u '+%Y-%m-%d %H:%M UTC'), $(nproc) cores, $(df -T "$dir" | awk 'NR==2 {print $2}') under $dir"
# Built first, so the build does not run between the fio passes and the bench.
cargo bench -p kvtier --bench ssd --no-run 2>&1 | tail -1
bs=3452928
size=$((128 * bs))
run_fio() { # name rw engine depth
    fio --name="$1" --filename="$dir/fio.dat" --size=$size --bs=$bs --direct=1 --ioengine="$3" \
        --iodepth="$4" --rw="$2" --time_based --runtime=10 --numjobs=1 --output-format=terse --terse-version=3 |
        awk -F';' -v n="$1" '{ r = $7 + 0; w = $48 + 0; printf "fio %-16s %8.1f MB/s\n", n, (r + w) * 1024 / 1e6 }'
}
# The bench's shape: 64 transfers back to back, then a pause (the bench's untimed setup), eight
# times; the median burst's MB/s. A drive with a write cache or burst credits runs bursts faster
# than a 10 s stream, so the bench is held against both.
run_fio_bursts() { # name rw engine depth
    for _ in 1 2 3 4 5 6 7 8; do
        fio --name="$1" --filename="$dir/fio.dat" --size=$size --io_size=$((64 * bs)) --bs=$bs --direct=1 \
            --ioengine="$3" --iodepth="$4" --rw="$2" --numjobs=1 --output-format=terse --terse-version=3 |
            awk -F';' '{ print ($7 + $48) * 1024 / 1e6 }'
        sleep 0.2
    done | sort -g | awk -v n="$1" '{ v[NR] = $1 } END { printf "fio %-16s %8.1f MB/s (median of 8 bursts of 64 blocks)\n", n, (v[4] + v[5]) / 2 }'
}
fio_pass() {
    run_fio write_psync_qd1 write psync 1
    run_fio write_uring_qd8 write io_uring 8
    run_fio read_uring_qd8 read io_uring 8
    run_fio read_psync_qd1 read psync 1
    run_fio_bursts write_psync_qd1 write psync 1
    run_fio_bursts read_uring_qd8 read io_uring 8
    rm -f "$dir/fio.dat"
}
# fio before and after the tier's bench: a virtual or shared drive's speed drifts over minutes.
echo "-- fio, before"
fio_pass
echo "-- kvtier (criterion: time per 64 blocks, throughput [low median high])"
cargo bench -p kvtier --bench ssd -- --warm-up-time 2 --measurement-time 10 --noplot 2>&1 |
    grep -E "^ssd_glm52|time:|thrpt:|ssd bench" | grep -v "%"
echo "-- fio, after"
fio_pass
