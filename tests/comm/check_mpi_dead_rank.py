#!/usr/bin/env python3
"""A rank that dies for real under mpirun: test_comm's skipped MPI case "a rank killed during
training ..." on 3 processes, where rank 1 SIGKILLs itself between two all_reduces and the
survivors wait with a 60 s timeout. Open MPI's launcher must end the job within a few seconds
(not hang until the timeout), exit non-zero, and say which rank died and how.
Usage: check_mpi_dead_rank.py MPIRUN TEST_COMM"""
import subprocess
import sys
import time

mpirun, program = sys.argv[1], sys.argv[2]
command = [mpirun, "-np", "3", "--oversubscribe", "--allow-run-as-root", program,
           "--test-case=a rank killed during training*", "--no-skip"]
start = time.monotonic()
try:
    run = subprocess.run(command, capture_output=True, text=True, timeout=50)
except subprocess.TimeoutExpired:
    print("FAIL: the job still ran 50 s after rank 1 was killed (the survivors hung)")
    sys.exit(1)
elapsed = time.monotonic() - start
output = run.stdout + run.stderr
print(output[-2000:])
failures = []
if run.returncode == 0:
    failures.append("mpirun exited 0 although rank 1 was killed")
if elapsed >= 20:
    failures.append(f"the job took {elapsed:.1f} s to end (the survivors' timeout is 60 s)")
if "process rank 1" not in output or "signal 9" not in output:
    failures.append("the launcher's message does not name rank 1 and signal 9")
if "completed without rank 1" in output:
    failures.append("a survivor's all_reduce completed without rank 1")
print(f"mpirun exit status {run.returncode}, job ended {elapsed:.1f} s after start")
for failure in failures:
    print("FAIL: " + failure)
sys.exit(1 if failures else 0)
