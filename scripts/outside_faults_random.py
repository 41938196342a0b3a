"""Faults from outside at random moments: SIGKILL or SIGSTOP to a random process of a real job
(a rank, or a rank's DataLoader worker) at a uniformly random moment of its life, from its
first process to its end; checks what a user would.

    python scripts/outside_faults_random.py --runs 12 --signal kill [--elastic] [--seed 1]

Each run starts tests/scripts/outside_kill_train.py (DDP, one DataLoader worker per rank,
nothing held: phase "none") on 3 ranks under mpirun (``--elastic``: its elastic mode under
``hpcddp launch -- mpirun --with-ft ulfm``), HPCDDP_TIMEOUT=10. A run is bad when the job is
still running 150 s after its start, a process of it is left, the end came more than
HPCDDP_TIMEOUT + 30 s after the fault, or the job said it succeeded although fewer ranks
finished than should have (plain: all; elastic: all but the one hit). The tests stop or kill
at chosen phases (tests/test_outside_kill.py); this finds the moments between them: it found
the start-up windows of docs/hangs.md, "A rank stopped while the job starts is ended too".
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import signal
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from outside_kill import Job, job_processes, parent_of  # noqa: E402

SCRIPT = str(ROOT / "tests" / "scripts" / "outside_kill_train.py")
TIMEOUT = 10


def _is_guard(pid: int) -> bool:
    """A rank's start-up guard (hpcddp/launch/start_guard.py) is its child too: not a worker."""
    try:
        return b"start_guard" in pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def one_run(rng: random.Random, sig: int, elastic: bool, longest: float) -> dict:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="hpcddp-faults-"))
    argv = [sys.executable, SCRIPT, str(tmp), "elastic" if elastic else "plain", "none", "1",
            "1", "fork"]
    env = dict(os.environ, HPCDDP_TIMEOUT=str(TIMEOUT), EPOCHS="4")
    env.pop("HPCDDP_RANKS_PER_NODE", None)
    if elastic:
        from hpcddp.launch.mpirun import mpirun_command
        job = Job(0, [], outfile=tmp / "out.txt", timeout=150, env=env,
                  cmd=[sys.executable, "-m", "hpcddp", "launch", "--",
                       *mpirun_command(3, argv, fault_tolerant=True)])
    else:
        job = Job(3, argv, outfile=tmp / "out.txt", timeout=150, env=env)
    while not job.ranks() and job.proc.poll() is None:
        time.sleep(0.02)
    delay = rng.uniform(0.0, longest)
    time.sleep(delay)
    ranks = job.ranks()
    by_pid = {pid: r for r, pid in ranks.items()}
    hit = None
    targets = [(p, f"rank {by_pid[p]}") for p in by_pid] + [
        (p, f"worker of rank {by_pid[parent_of(p)]}") for p in job_processes(job.tag)
        if parent_of(p) in by_pid and p not in by_pid and not _is_guard(p)]
    if targets and job.proc.poll() is None:
        pid, hit = rng.choice(targets)
        try:
            job.kill(pid, hit, sig)
        except ProcessLookupError:
            hit = None
    rc, out, after = job.finish()
    left = job.leftovers()
    for pid, _ in targets:          # a stopped process the job left behind
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    done = out.count("DONE")
    need = 2 if elastic else 3
    bad = (rc == 124 or bool(left) or (after is not None and after > TIMEOUT + 30)
           or (hit is not None and rc == 0 and done < need))
    return {"after_start_s": round(delay, 2), "hit": hit, "exit": rc,
            "fault_to_end_s": None if after is None else round(after, 1), "finished": done,
            "left": left, "bad": bad, "output": str(tmp / "out.txt")}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=12)
    p.add_argument("--signal", choices=("kill", "stop"), default="kill")
    p.add_argument("--elastic", action="store_true", help="the elastic job under ULFM")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--longest", type=float, default=16.0,
                   help="latest moment of the fault, seconds after the first rank appeared")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    sig = signal.SIGKILL if a.signal == "kill" else signal.SIGSTOP
    bad = 0
    for i in range(a.runs):
        r = one_run(rng, sig, a.elastic, a.longest)
        bad += r["bad"]
        print(json.dumps({"run": i, **r}), flush=True)
    print(f"{bad} bad run(s) of {a.runs}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
