#!/usr/bin/env bash
# Our ResNet-18 training step (bench_autograd) and PyTorch's (resnet18_torch_peer.py) on this CPU,
# back to back in one run so both see the same machine state, then the ratio.
#
#   benchmarks/autograd/compare_torch_cpu.sh [BUILD_DIR] [--reps N] [--config BATCHxHW]
#                                            [--threads T] [--python PY]
#
# BUILD_DIR (default build) holds benchmarks/autograd/bench_autograd. Each side times N steps
# (default 5) after a warm-up step: ours as N repetitions of BM_resnet18_train_step (MinTime 2 s
# gives one timed step per repetition at these sizes), the peer as N single-step timings; both
# report the median. --config picks one configuration (32x32 or 8x224: batch x image size; default
# both). Both sides run on T threads (default 1): ours through SHARDKIT_NUM_THREADS, PyTorch's
# through torch.set_num_threads. PY defaults to /usr/bin/python3 when it has torch (Debian's
# python3-torch), else python3. The load average is printed first: other work on the cores skews
# both sides, not necessarily alike.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=build reps=5 configs=() python="" threads=1
while (($#)); do
  case $1 in
    --reps) reps=$2; shift 2 ;;
    --config) configs+=("$2"); shift 2 ;;
    --python) python=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    -*) echo "compare_torch_cpu: unknown option $1" >&2; exit 2 ;;
    *) build=$1; shift ;;
  esac
done
bench="$build/benchmarks/autograd/bench_autograd"
[ -x "$bench" ] || { echo "compare_torch_cpu: $bench not built (ninja -C $build $bench)" >&2; exit 1; }
if [ -z "$python" ]; then
  python=python3
  /usr/bin/python3 -c "import torch" 2>/dev/null && python=/usr/bin/python3
fi
"$python" -c "import torch" 2>/dev/null ||
  { echo "compare_torch_cpu: $python has no torch (Debian: apt-get install python3-torch)" >&2; exit 1; }

filter='BM_resnet18_train_step/'
peer_configs=()
if ((${#configs[@]})); then
  parts=()
  for c in "${configs[@]}"; do
    parts+=("BM_resnet18_train_step/batch:${c%%x*}/HW:${c##*x}/")
    peer_configs+=(--config "$c")
  done
  filter=$(IFS='|'; echo "${parts[*]}")
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== $(date -u '+%F %T') UTC, $(nproc) cores, load:$(uptime | sed 's/.*load average://')"
echo "== ours: SHARDKIT_NUM_THREADS=$threads $bench --benchmark_filter='$filter' --benchmark_repetitions=$reps"
SHARDKIT_NUM_THREADS=$threads "$bench" --benchmark_filter="$filter" --benchmark_repetitions="$reps" \
  --benchmark_report_aggregates_only=true --benchmark_out="$tmp/ours.json" --benchmark_out_format=json
echo "== pytorch: $python $here/resnet18_torch_peer.py --threads $threads --iters $reps"
"$python" "$here/resnet18_torch_peer.py" --threads "$threads" --warmup 1 --iters "$reps" --json \
  "${peer_configs[@]}" | tee "$tmp/peer.txt"
echo "== load after:$(uptime | sed 's/.*load average://')"

"$python" - "$tmp/ours.json" "$tmp/peer.txt" "$threads" <<'PY'
import json, re, statistics, sys
# The median aggregate where there are repetitions; with --reps 1 only the single run is there.
medians, runs = {}, {}
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    m = re.search(r"batch:(\d+)/HW:(\d+)", b["name"])
    if not m:
        continue
    key = (int(m[1]), int(m[2]))
    ms = b["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
    if b.get("aggregate_name") == "median":
        medians[key] = ms
    elif b.get("run_type") == "iteration":
        runs.setdefault(key, []).append(ms)
ours = {**{key: statistics.median(v) for key, v in runs.items()}, **medians}
peer = {}
for line in open(sys.argv[2]):
    if line.startswith("JSON "):
        r = json.loads(line[5:])
        peer[(r["batch"], r["hw"])] = r
threads = sys.argv[3]
print("| ResNet-18 step | threads | ours ms | ours img/s | PyTorch ms | PyTorch img/s | ours / PyTorch |")
print("|---|---|---|---|---|---|---|")
for key in sorted(ours, key=lambda k: -k[0]):
    if key not in peer:
        continue
    batch, hw = key
    o, p = ours[key], peer[key]["ms_median"]
    print(f"| batch {batch}, {hw}x{hw} | {threads} | {o:.0f} | {batch * 1e3 / o:.2f} | {p:.0f} | "
          f"{batch * 1e3 / p:.2f} | {p / o:.2f}x |")
PY
