#!/usr/bin/env bash
# Our ResNet-18 training step (bench_autograd) and PyTorch's (resnet18_torch_peer.py) on this CPU,
# alternating in one run so both see the same machine state, then the ratio.
#
#   benchmarks/autograd/compare_torch_cpu.sh [BUILD_DIR] [--reps N] [--rounds R] [--config BATCHxHW[xWIDTH]]
#                                            [--threads T] [--python PY]
#                                            [--channels-last | --channel-blocks]
#
# BUILD_DIR (default build) holds benchmarks/autograd/bench_autograd. Each side times N steps
# (default 5) after a warm-up step: ours as N repetitions of BM_resnet18_train_step (MinTime 2 s:
# a repetition is one step at 32x32 and 8x224, the mean of thousands at the host-bound 2x8x4),
# the peer as N timings of one step each, or of as many as fill 0.2 s where a step is shorter
# (resnet18_torch_peer.py); each takes the median. That pair runs R times (default 3), ours then PyTorch's each round: the
# speed of a shared VM drifts by tens of percent within minutes, so each round's ratio compares
# two measurements taken a few seconds apart, and the table gives the median of the rounds'
# ratios with their range (and the median of each side's round medians). --config picks one
# configuration (32x32, 8x224 or the host-bound 2x8x4: batch x image size [x base width, default
# 64]; default all three). Both sides run on T threads
# (default 1): ours through SHARDKIT_NUM_THREADS, PyTorch's through torch.set_num_threads. PY
# defaults to /usr/bin/python3 when it has torch (Debian's python3-torch), else python3.
# --channels-last runs both sides with channels-last activations (ours: ResNetOptions::
# channels_last; PyTorch: the model and images in torch.channels_last). --channel-blocks runs
# ours with its activations in oneDNN's channel blocks (ResNetOptions::channel_blocks: the NCHW
# step's bits without its reorders) against PyTorch's NCHW step. The load
# average is printed first: other work on the cores skews both sides, not necessarily alike.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
build=build reps=5 rounds=3 configs=() python="" threads=1 layout=0
while (($#)); do
  case $1 in
    --reps) reps=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --config) configs+=("$2"); shift 2 ;;
    --python) python=$2; shift 2 ;;
    --threads) threads=$2; shift 2 ;;
    --channels-last) layout=1; shift ;;
    --channel-blocks) layout=2; shift ;;
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

peer_configs=()
((layout == 1)) && peer_configs+=(--channels-last)
# Without --config: every configuration ours registers in this layout, and the same for the
# peer, so the two sides always run one set (a row missing on either side fails below).
if ((${#configs[@]} == 0)); then
  while read -r name; do
    [[ $name =~ batch:([0-9]+)/HW:([0-9]+)/width:([0-9]+)/ ]] &&
      configs+=("${BASH_REMATCH[1]}x${BASH_REMATCH[2]}x${BASH_REMATCH[3]}")
  done < <("$bench" --benchmark_list_tests=true \
             --benchmark_filter="BM_resnet18_train_step/.*/layout:$layout/")
  ((${#configs[@]})) ||
    { echo "compare_torch_cpu: $bench registers no ResNet-18 step in layout $layout" >&2; exit 1; }
fi
parts=()
for c in "${configs[@]}"; do
  IFS=x read -r batch hw width <<<"$c"
  parts+=("BM_resnet18_train_step/batch:$batch/HW:$hw/width:${width:-64}/layout:$layout/")
  peer_configs+=(--config "$c")
done
filter=$(IFS='|'; echo "${parts[*]}")

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "== $(date -u '+%F %T') UTC, $(nproc) cores, load:$(uptime | sed 's/.*load average://')"
for ((round = 1; round <= rounds; ++round)); do
  echo "== round $round of $rounds, ours: SHARDKIT_NUM_THREADS=$threads $bench --benchmark_filter='$filter' --benchmark_repetitions=$reps"
  SHARDKIT_NUM_THREADS=$threads "$bench" --benchmark_filter="$filter" --benchmark_repetitions="$reps" \
    --benchmark_report_aggregates_only=true --benchmark_out="$tmp/ours.$round.json" \
    --benchmark_out_format=json
  echo "== round $round of $rounds, pytorch: $python $here/resnet18_torch_peer.py --threads $threads --iters $reps"
  "$python" "$here/resnet18_torch_peer.py" --threads "$threads" --warmup 1 --iters "$reps" --json \
    "${peer_configs[@]}" | tee "$tmp/peer.$round.txt"
done
echo "== load after:$(uptime | sed 's/.*load average://')"

"$python" - "$tmp" "$rounds" "$threads" "$layout" "${configs[@]}" <<'PY'
import json, os, re, statistics, sys
tmp, rounds, threads = sys.argv[1], int(sys.argv[2]), sys.argv[3]
requested = [tuple(int(v) for v in (c.split("x") + ["64"])[:3]) for c in sys.argv[5:]]
# (the row says which layout ours ran in when it is not NCHW)
layout = {"0": "", "1": ", channels-last", "2": ", ours in channel blocks"}[sys.argv[4]]


def ours_ms(path):
    """Each configuration's median step time in one round (with --reps 1, its single run)."""
    medians, runs = {}, {}
    try:  # (no benchmark matched the filter: Google Benchmark leaves the file empty)
        benchmarks = json.load(open(path))["benchmarks"]
    except (OSError, ValueError, KeyError):
        benchmarks = []
    for b in benchmarks:
        m = re.search(r"batch:(\d+)/HW:(\d+)/width:(\d+)", b["name"])
        if not m:
            continue
        key = (int(m[1]), int(m[2]), int(m[3]))
        ms = b["real_time"] * {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
        if b.get("aggregate_name") == "median":
            medians[key] = ms
        elif b.get("run_type") == "iteration":
            runs.setdefault(key, []).append(ms)
    return {**{key: statistics.median(v) for key, v in runs.items()}, **medians}


def peer_ms(path):
    peer = {}
    for line in open(path):
        if line.startswith("JSON "):
            r = json.loads(line[5:])
            peer[(r["batch"], r["hw"], r.get("width", 64))] = r["ms_median"]
    return peer


rounds_data = [(ours_ms(os.path.join(tmp, f"ours.{r}.json")),
                peer_ms(os.path.join(tmp, f"peer.{r}.txt"))) for r in range(1, rounds + 1)]
# Every requested configuration in every round on both sides, or no table: a row that silently
# dropped out (not registered in this layout, a peer run that failed to print) read as a pass.
missing = [f"{'x'.join(map(str, k))} (round {r}, {side})" for k in requested
           for r, (ours, peer) in enumerate(rounds_data, 1)
           for side, got in (("ours", ours), ("PyTorch", peer)) if k not in got]
if missing:
    sys.exit("compare_torch_cpu: no time for " + ", ".join(missing))
keys = sorted(set(requested), key=lambda k: (-k[2], -k[0]))
print("| ResNet-18 step | threads | ours ms | ours img/s | PyTorch ms | PyTorch img/s | "
      "ours / PyTorch speed | rounds' range |")
print("|---|---|---|---|---|---|---|---|")
for key in keys:
    pairs = [(ours[key], peer[key]) for ours, peer in rounds_data if key in ours and key in peer]
    ratios = [p / o for o, p in pairs]
    o = statistics.median(o for o, _ in pairs)
    p = statistics.median(p for _, p in pairs)
    batch, hw, width = key
    wide = "" if width == 64 else f", width {width}"
    print(f"| batch {batch}, {hw}x{hw}{wide}{layout} | {threads} | {o:.2f} | {batch * 1e3 / o:.2f} | {p:.2f} | "
          f"{batch * 1e3 / p:.2f} | {statistics.median(ratios):.2f}x | "
          f"{min(ratios):.2f}-{max(ratios):.2f}x ({len(ratios)}) |")
PY
