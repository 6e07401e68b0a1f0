"""Kill chains for the samples' checkpoint tests (custom_loop/check_resume.py, swav/check_swav.py):
a run that checkpoints after every step into DIR (step folders behind DIR/latest) is SIGKILLed
again and again, alternately a few milliseconds after a random later checkpoint was published
and as soon as a save is seen in progress (a temporary file, or a step folder newer than
`latest`); each restart resumes from whatever is there. When a chain of restarts nears the end,
`finish_chain()` runs it to the end and judges it (the caller checks the uninterrupted run's
parameters and that no temporary file is left); then a new chain starts."""
import os
import random
import signal
import subprocess
import time


def latest_step(folder):
    """The step DIR/latest names (step_000000012 -> 12, and a step saved again,
    step_000000012.resaved, -> 12), or 0 when there is none."""
    try:
        with open(os.path.join(folder, "latest")) as f:
            return int(os.path.basename(f.read().strip()).split("_")[1].split(".")[0])
    except (OSError, IndexError, ValueError):
        return 0


def save_in_progress(folder):
    newest = latest_step(folder)
    for _, dirs, files in os.walk(folder):
        if any(".tmp." in f for f in files):
            return True
        if any(d.startswith("step_") and d[5:].isdigit() and int(d[5:]) > newest for d in dirs):
            return True
    return False


def temporary_files(folder):
    return [f for _, _, files in os.walk(folder) for f in files if ".tmp." in f]


def kill_chains(folder, command, finish_chain, kills, finish_from, max_advance, seed):
    """SIGKILLs `command(resume)` (a process list; `resume` is True when a checkpoint exists)
    `kills` times; a chain whose latest step reaches `finish_from` is handed to `finish_chain()`
    (True when it ended right). Returns (killed, killed during a save, chains, good chains)."""
    rng = random.Random(seed)
    killed = during_save = chains = good_chains = missed = 0
    while killed < kills:
        start = latest_step(folder)
        if start >= finish_from:
            chains += 1
            good_chains += finish_chain()
            continue
        process = subprocess.Popen(command(start > 0), stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        if killed % 2 == 0:
            # A few milliseconds after a random later checkpoint was published.
            target = start + rng.randint(1, max_advance)
            while latest_step(folder) < target and process.poll() is None:
                time.sleep(0.0005)
            time.sleep(rng.uniform(0.0, 0.004))
        else:
            # As soon as a save is under way, after at least one step of progress.
            while process.poll() is None and not (latest_step(folder) > start and
                                                  save_in_progress(folder)):
                time.sleep(0.0002)
        if process.poll() is not None:  # it finished before it could be killed: go on
            missed += 1
            if process.returncode != 0 or missed > 10:
                raise SystemExit(f"FAIL: runs to kill ended on their own ({process.returncode})")
            continue
        process.send_signal(signal.SIGKILL)
        process.wait()
        killed += 1
        during_save += save_in_progress(folder)
    chains += 1
    good_chains += finish_chain()
    return killed, during_save, chains, good_chains
