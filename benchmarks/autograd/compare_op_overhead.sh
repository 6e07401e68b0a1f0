#!/usr/bin/env bash
# The host cost per autograd op on the CPU, ours (bench_op_overhead) against PyTorch eager's
# (torch_op_overhead.py), alternating for R rounds (default 3) so both see the same machine
# state; prints each round and the median ratio (ours / PyTorch's time: <= 1.0 is the goal).
#   benchmarks/autograd/compare_op_overhead.sh [BUILD_DIR] [--rounds R] [--numel N]
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=build rounds=3 numel=8
while (($#)); do
  case $1 in
    --rounds) rounds=$2; shift 2 ;;
    --numel) numel=$2; shift 2 ;;
    -*) echo "compare_op_overhead: unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
python=python3
/usr/bin/python3 -c 'import torch' 2>/dev/null && python=/usr/bin/python3
ratios=()
for ((r = 1; r <= rounds; r++)); do
  ours=$(SHARDKIT_NUM_THREADS=1 "$build/benchmarks/autograd/bench_op_overhead" \
    --benchmark_filter="BM_tiny_op_chain/numel:$numel\$" --benchmark_min_time=1 \
    --benchmark_format=json | "$python" -c \
    'import json,sys; print(json.load(sys.stdin)["benchmarks"][0]["us_per_op"])')
  theirs=$("$python" "$here/torch_op_overhead.py" "$numel" 5 | sed -E 's/.* ([0-9.]+) us_per_op/\1/')
  ratio=$("$python" -c "print(f'{$ours / $theirs:.2f}')")
  ratios+=("$ratio")
  printf 'round %d: ours %.3f us/op, PyTorch %.3f us/op: %sx its time\n' "$r" "$ours" "$theirs" "$ratio"
done
"$python" -c "import statistics,sys; print('median ratio (ours / PyTorch time):', statistics.median(map(float, sys.argv[1:])))" "${ratios[@]}"
