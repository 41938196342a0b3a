"""A rank (or its DataLoader worker) SIGKILLed from outside, at every phase of a job.

The OOM killer, a failed node or an admin kill a process from outside; the job must then end
(plain mode) or go on (elastic mode), and leave nothing behind. Each case starts
tests/scripts/outside_kill_train.py (or ``hpcddp stage``/``hpcddp pack``) under mpirun, waits
for the target to say it is inside the phase, SIGKILLs it from this process
(tests/outside_kill.py), and checks what a user would see:

- plain mode: the job ends, non-zero, within the timeout + 10 s, with a line naming the lost
  rank (mpirun's for a killed rank; the rank's own traceback naming the worker for a worker);
- elastic mode: the survivors finish with equal parameters, or the job ends with a line naming
  the lost rank and saying what to do (a loss outside ``state.step()``);
- every case: mpirun has exited and no process of the job is left (also none re-parented to
  init: found by a marker in their environment), and nothing half-written has a final name.
"""
import os
import json
import pathlib
import re
import sys

import pytest

from outside_kill import Job

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "outside_kill_train.py")
HOLD = str(ROOT / "tests" / "scripts" / "hold_in.py")
JOB_TIMEOUT = 10            # HPCDDP_TIMEOUT of the jobs: "within the timeout + 10 s"
WALL = 150                  # the hard limit of each job


def _env(**extra):
    env = dict(os.environ, HPCDDP_TIMEOUT=str(JOB_TIMEOUT))
    for k in ("HPCDDP_RANKS_PER_NODE", "HPCDDP_ELASTIC_KILL"):
        env.pop(k, None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _train(tmp, nprocs, mode, phase, target, workers=1, **env):
    return Job(nprocs, [sys.executable, SCRIPT, str(tmp), mode, phase, str(target), str(workers)],
               outfile=tmp / "out.txt", timeout=WALL, env=_env(**env),
               fault_tolerant=mode == "elastic")


def _kill(job, target, phase, what):
    """SIGKILL the target rank, or (phase data) the worker that said it holds a sample."""
    m = job.wait_for(rf"\[rank{target}\] AT PHASE {phase} pid (\d+)")
    if what == "worker":
        pid = int(m.group(1))
        assert pid in job.workers(target), (pid, job.workers(target))
        job.kill(pid, f"worker of rank {target}")
        return pid
    return job.kill_rank(target)


def _ended_cleanly(job):
    rc, out, after_kill = job.finish()
    left = job.leftovers()
    assert not left, f"processes of the job left after mpirun ended: {left}\n{out[-3000:]}"
    assert rc != 124, f"the job ran into its {WALL} s limit after the kill:\n{out[-4000:]}"
    return rc, out, after_kill


def _names_lost(out, target, what, pid):
    if what == "rank":
        assert f"process rank {target} " in out, out[-3000:]      # mpirun's line
    else:
        # torch says "(pid N) is killed by signal" or "(pid(s) N) exited unexpectedly"
        assert re.search(rf"\[rank{target}\] .*DataLoader worker \(pid(\(s\))? {pid}\)", out), \
            out[-3000:]


PLAIN = [   # (nprocs, phase, target, workers, what, extra env)
    (3, "data", 1, 1, "rank", {}),
    (3, "data", 1, 1, "worker", {}),
    (3, "data", 2, 2, "rank", {}),
    (3, "data", 2, 2, "worker", {}),
    (3, "forward", 1, 1, "rank", {}),
    (3, "backward", 1, 1, "rank", {}),
    (3, "optimizer", 2, 1, "rank", {}),
    (3, "eval", 1, 1, "rank", {}),
    (2, "checkpoint", 0, 1, "rank", {}),
    (3, "arena", 1, 0, "rank", {}),
    (4, "arena", 2, 0, "rank", {"HPCDDP_RANKS_PER_NODE": 2}),   # the hierarchical path
]


@pytest.mark.parametrize("nprocs,phase,target,workers,what,extra", PLAIN,
                         ids=[f"{p}-{w}{k}-{n}r{'-hier' if e else ''}"
                              for n, p, _, k, w, e in PLAIN])
def test_plain_job_ends(tmp_path, nprocs, phase, target, workers, what, extra):
    job = _train(tmp_path, nprocs, "plain", phase, target, workers, **extra)
    pid = _kill(job, target, phase, what)
    rc, out, after_kill = _ended_cleanly(job)
    assert rc != 0, out[-3000:]
    assert after_kill <= JOB_TIMEOUT + 10, f"{after_kill:.1f} s from the kill to the end"
    _names_lost(out, target, what, pid)
    assert "DONE" not in out
    if phase == "checkpoint":       # the save was cut: no checkpoint under its final name
        left = sorted(p.name for p in (tmp_path / "ckpt").glob("ckpt-*.pt"))
        assert left == [], left


ELASTIC = [   # (nprocs, phase, target, workers, what)
    (3, "data", 1, 1, "rank"),
    (3, "data", 1, 1, "worker"),
    (4, "data", 2, 2, "worker"),
    (3, "forward", 1, 1, "rank"),
    (4, "backward", 3, 1, "rank"),
    (3, "optimizer", 0, 1, "rank"),
    (3, "arena", 1, 0, "rank"),
]


@pytest.mark.parametrize("nprocs,phase,target,workers,what", ELASTIC,
                         ids=[f"{p}-{w}{k}-{n}r" for n, p, _, k, w in ELASTIC])
def test_elastic_job_goes_on(tmp_path, nprocs, phase, target, workers, what):
    job = _train(tmp_path, nprocs, "elastic", phase, target, workers)
    pid = _kill(job, target, phase, what)
    rc, out, _ = _ended_cleanly(job)
    assert rc == 0, out[-4000:]
    survivors = sorted(set(range(nprocs)) - {target})
    finals = {int(p.name.split(".")[1]): json.loads(p.read_text())
              for p in tmp_path.glob("final.*.json")}
    assert sorted(finals) == survivors, (sorted(finals), out[-3000:])
    assert len({f["params"] for f in finals.values()}) == 1, "survivors' parameters differ"
    assert all(f["lost"] == [target] and f["size"] == nprocs - 1 for f in finals.values())
    assert "elastic: lost rank" in out
    if what == "worker":
        assert re.search(rf"\[rank{target}\] elastic: DataLoader worker \(pid(\(s\))? {pid}\)",
                         out), out[-3000:]


@pytest.mark.parametrize("phase,nprocs,target", [("eval", 3, 1), ("checkpoint", 3, 0),
                                                  ("collective", 3, 2)])
def test_elastic_loss_outside_the_step_ends_the_job_saying_why(tmp_path, phase, nprocs, target):
    """Outside ``state.step()`` nothing recovers: the job ends with a line naming the lost
    rank and what to do (docs/elastic.md, "Outside the step")."""
    job = _train(tmp_path, nprocs, "elastic", phase, target)
    _kill(job, target, phase, "rank")
    rc, out, after_kill = _ended_cleanly(job)
    assert rc != 0, out[-3000:]
    assert after_kill <= JOB_TIMEOUT + 10
    assert f"rank {target} was lost outside state.step()" in out, out[-4000:]
    if phase == "checkpoint":
        assert sorted((tmp_path / "ckpt").glob("ckpt-*.pt")) == []
