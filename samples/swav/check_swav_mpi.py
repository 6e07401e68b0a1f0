#!/usr/bin/env python3
"""The SwAV trainer as CPU processes launched by mpirun, two on this machine: a short run gives
the parameters of the same run as two ranks in threads, bit for bit, and the host memory line
(rank 0's measurement of a rank's step); the kNN figures are the threads'; and a batch whose steps would not fit in this machine's
memory is refused by every process together -- the refusal said once, the job ended, no process
left waiting. Skipped (exit 77) on a machine with more than 1 TB available, which might hold
that batch. Usage: check_swav_mpi.py path/to/mpirun path/to/swav"""
import os
import re
import subprocess
import sys
import tempfile

QUICK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs", "quick_cpu.yaml")
SHORT = ["config.MAX_ITERATIONS=4", "config.TEST_MODEL=False",
         "config.NEAREST_NEIGHBOR.FREQUENCY=0", "config.METRICS.PLOT=False"]


def run(command, timeout=240):
    # (the threads and the processes take the cores' default split: one thread a rank here)
    env = {k: v for k, v in os.environ.items() if k != "SHARDKIT_NUM_THREADS"}
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    return out.returncode, out.stdout + out.stderr


def available_bytes():
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def main():
    mpirun, swav = sys.argv[1], sys.argv[2]
    launch = [mpirun, "-np", "2", "--oversubscribe", "--allow-run-as-root"]
    with tempfile.TemporaryDirectory(prefix="shardkit_check_swav_mpi_") as work:
        def args(name, extra=()):
            return [swav, f"config={QUICK}", f"config.CHECKPOINT.DIR={os.path.join(work, name)}"] \
                + SHORT + list(extra)

        code, threads = run(args("threads"))
        if code != 0:
            raise SystemExit(f"FAIL: the run in threads exited {code}:\n{threads}")
        code, processes = run(launch + args("processes"))
        if code != 0:
            raise SystemExit(f"FAIL: the run under mpirun exited {code}:\n{processes}")
        prints = [re.findall(r"fingerprint ([0-9a-f]{16})", out) for out in (threads, processes)]
        memory = re.findall(r"^host memory: .* 2 ranks on this machine", processes, re.M)
        print(f"fingerprints: threads {prints[0]}, processes {prints[1]}; host memory lines "
              f"under mpirun: {len(memory)}")
        if len(prints[0]) != 1 or prints[0] != prints[1]:
            raise SystemExit("FAIL: the processes' parameters differ from the threads'")
        if len(memory) != 1:
            raise SystemExit(f"FAIL: expected one host memory line (rank 0's):\n{processes}")

        # The kNN at initialisation (each process keeps its shard of the memory bank's features,
        # an all-to-all over MPI brings each query's lists to the process that votes): the
        # threads' figures, network and raw pixels.
        knn = ["config.TEST_MODEL=True", "config.MAX_ITERATIONS=0",
               "config.DATA.TEST.DATA_LIMIT=61", "config.DATA.TEST.BATCHSIZE_PER_REPLICA=8",
               "config.NEAREST_NEIGHBOR.MEMORY_BANK_LIMIT=101", "config.NEAREST_NEIGHBOR.TOPK=5"]
        figures = []
        for name, launcher in (("knn_threads", []), ("knn_processes", launch)):
            code, out = run(launcher + args(name, knn))
            if code != 0:
                raise SystemExit(f"FAIL: the kNN run {name} exited {code}:\n{out}")
            figures.append(re.findall(r"kNN top-1 on 61 test images, (res\S*) [^:]*: ([0-9.]+)% "
                                      r"\(raw pixels ([0-9.]+)%\)", out))
        print(f"kNN at initialisation: threads {figures[0]}, processes {figures[1]}")
        if len(figures[0]) != 8 or figures[0] != figures[1]:
            raise SystemExit("FAIL: the processes' kNN figures differ from the threads'")

        # 30 000 images a rank of Fashion-MNIST's 60 000: the batch fits the sampler's share,
        # its steps of 112-pixel crops (29 MB an image: 1.7 TB for the two) not this machine.
        if available_bytes() > 1e12:
            print("SKIP: more than 1 TB available here, which might hold the batch meant to be "
                  "refused (the runs above agreed)")
            sys.exit(77)
        crops = ("config.DATA.TRAIN.TRANSFORMS=[{name: ImgPilToMultiCrop, total_num_crops: 2,"
                 " size_crops: [112], num_crops: [2], crop_scales: [[0.3, 1]]}, {name: ToTensor},"
                 " {name: Normalize, mean: [0.286], std: [0.353]}]")
        code, refused = run(launch + args(
            "refused", ["config.DATA.TRAIN.BATCHSIZE_PER_REPLICA=30000", crops]))
        said = re.findall(r"^swav: config\.DATA\.TRAIN\.BATCHSIZE_PER_REPLICA = 30000: 2 ranks "
                          r"launched on this machine would hold about .*start fewer processes",
                          refused, re.M)
        print(f"a batch too large for the machine: exit {code}, the refusal said {len(said)} "
              f"time(s)")
        if code == 0 or len(said) != 1 or "fingerprint" in refused:
            raise SystemExit(f"FAIL: expected one refusal and no run:\n{refused}")


if __name__ == "__main__":
    main()
