#!/usr/bin/env python3
"""Where oneDNN's time goes in a CPU run: reads ONEDNN_VERBOSE=1 output on stdin and prints the
share of oneDNN's execution time per primitive kind, propagation and implementation, with the
reorders split into activations (into and out of blocked layouts) and weights.

  ONEDNN_VERBOSE=1 build/samples/swav/swav config=samples/swav/configs/quick_cpu.yaml \\
      config.MAX_ITERATIONS=100 | benchmarks/autograd/dnnl_verbose_summary.py
  ONEDNN_VERBOSE=1 SHARDKIT_NUM_THREADS=1 build/benchmarks/autograd/bench_autograd \\
      --benchmark_filter='BM_resnet18_train_step/batch:64/' | benchmarks/autograd/dnnl_verbose_summary.py

Each "onednn_verbose,exec" line ends with the call's time in ms (oneDNN 2.x's format:
onednn_verbose,exec,cpu,KIND,IMPL,PROP,FORMATS,ATTRS,AUX,SHAPE,MS). A reorder whose shape's
second dimension is an activation's channel count cannot be told from a weight reorder by shape
alone: weights are told apart by their blocked layouts (those with two block letters, e.g.
ABcd16a16b, or starting "Acdb"/"BAcd").
"""
import collections
import re
import sys


def kind_of(fields):
    kind, impl, prop, formats = fields[3], fields[4], fields[5], fields[6]
    if kind != "reorder":
        return f"{kind} {prop} ({impl})"
    layouts = re.findall(r":blocked:(\w+):", formats)
    if any(re.search(r"[A-Z].*[A-Z]|^Acdb|^BAcd", layout) for layout in layouts):
        return "reorder: weights"
    if len(layouts) == 2 and layouts[0] in ("abcd", "acdb"):
        return f"reorder: activations {layouts[0]} -> blocked"
    return "reorder: activations blocked -> plain"


def main():
    time_ms, calls = collections.Counter(), collections.Counter()
    for line in sys.stdin:
        if not line.startswith("onednn_verbose,exec,"):
            continue
        fields = line.rstrip("\n").split(",")
        try:
            ms = float(fields[-1])
        except ValueError:
            continue
        key = kind_of(fields)
        time_ms[key] += ms
        calls[key] += 1
    total = sum(time_ms.values())
    if total == 0:
        sys.exit("dnnl_verbose_summary: no 'onednn_verbose,exec' lines on stdin "
                 "(run the program with ONEDNN_VERBOSE=1)")
    print(f"oneDNN execution time: {total / 1e3:.2f} s in {sum(calls.values())} calls")
    for key, ms in time_ms.most_common():
        print(f"{100 * ms / total:6.1f}%  {ms / 1e3:8.2f} s  {calls[key]:7d} calls  {key}")


if __name__ == "__main__":
    main()
