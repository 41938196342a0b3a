"""A rank SIGKILLed from outside inside a Slurm batch job (the local 2-node Slurm of
tests/test_jobs_slurm.py): through a plain ``srun`` step the job fails naming the task, through
the template's elastic option (``mpirun --with-ft ulfm`` in the allocation) the survivors
finish; either way no process of the job is left on any node (both slurmds run on this host,
so the marker scan of tests/outside_kill.py sees every node's processes). Skips exactly when
test_jobs_slurm.py does.
"""
import json
import os
import pathlib
import re
import shlex
import signal
import sys
import time
import uuid

import pytest

from hpcddp.launch.templates import render
from outside_kill import MARK, environ_of, job_processes, name_of, parent_of
from test_elastic import needs_ulfm
from test_elastic_slurm import lost_in_start_up
from test_jobs_slurm import TERMINAL, Job as SlurmJob, sh, slurm  # noqa: F401

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "scripts" / "outside_kill_train.py")

pytestmark = pytest.mark.timeout(600)


def _batch(out: pathlib.Path, tag: str, elastic: bool, tasks_per_node: int, args) -> str:
    return render("multi-node-ddp", elastic=elastic, job_name="hpcddp-outside-kill", nodes=2,
                  tasks_per_node=tasks_per_node, gpus=0, cpus_per_task=1, time="5",
                  output=f"{out}/kill-%j.out", script=SCRIPT, args=[str(out), *args],
                  setup=[f". {shlex.quote(sys.prefix)}/bin/activate",
                         f"export {MARK}={tag} HPCDDP_TIMEOUT=10 PYTHONUNBUFFERED=1",
                         "export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1"])


def _rank_pid(tag: str, rank: int, job) -> int:
    for pid in job_processes(tag):
        env = environ_of(pid)
        r = env.get("OMPI_COMM_WORLD_RANK", env.get("PMIX_RANK"))
        if r == str(rank) and name_of(parent_of(pid)) in ("slurmstepd", "prted", "prterun"):
            return pid
    raise AssertionError(f"no process of rank {rank} in job {tag} (state {job.state()}):\n"
                         f"{job.logs()[-3000:]}")


def _run(tmp_path, elastic, tasks_per_node, args, target):
    for attempt in (1, 2):
        tag = uuid.uuid4().hex[:12]
        script = tmp_path / "kill.sbatch"
        script.write_text(_batch(tmp_path, tag, elastic, tasks_per_node, args))
        res = sh(["sbatch", "--parsable", str(script)], 60, cwd=tmp_path)
        assert res.returncode == 0, f"sbatch failed: {res.stderr}"
        job = SlurmJob(res.stdout.strip().split(";")[0], tmp_path, "kill-*.out")
        recs = job.wait(lambda recs: re.search(rf"\[rank{target}\] AT PHASE", job.logs()) or (
            recs and recs[0].get("JobState") in TERMINAL),
            timeout=300, what="to reach the phase", poll=0.2)
        # a rank lost in MPI's start-up under ULFM (test_elastic_slurm.lost_in_start_up) ends
        # the job before what this test checks begins: submitted once more
        if attempt == 1 and recs and recs[0].get("JobState") in TERMINAL \
                and lost_in_start_up(job.logs()):
            print(f"a rank was lost in MPI's start-up: submitting again; the first run's log:\n"
                  f"{job.logs()[-3000:]}")
            for log in tmp_path.glob("kill-*.out"):
                log.rename(tmp_path / f"first-attempt-{log.name}")
            continue
        break
    os.kill(_rank_pid(tag, target, job), signal.SIGKILL)
    t_kill = time.monotonic()
    (tmp_path / "killed").touch()       # the target's peers enter its collective now
    recs = job.wait(timeout=400)
    after = time.monotonic() - t_kill
    deadline = time.monotonic() + 10
    while job_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = job_processes(tag)
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes of the job left on the nodes: {left}\n{job.logs()[-3000:]}"
    return job, recs[0], after


def test_srun_step_rank_killed_fails_the_job(slurm, tmp_path):
    job, rec, after = _run(tmp_path, False, 1, ["plain", "forward", "1", "1"], 1)
    log = job.logs()
    assert rec["JobState"] == "FAILED", (rec, log[-3000:])
    assert after <= 10 + 20, f"{after:.1f} s from the kill to the job's end"
    assert re.search(r"task 1: Killed", log), log[-3000:]


@needs_ulfm
def test_elastic_template_rank_killed_survivors_finish(slurm, tmp_path):
    job, rec, _ = _run(tmp_path, True, 2, ["elastic", "backward", "1", "1"], 1)
    log = job.logs()
    assert rec["JobState"] == "COMPLETED", (rec, log[-3000:])
    assert "elastic: lost rank 1" in log
    finals = [json.loads((tmp_path / f"final.{r}.json").read_text()) for r in (0, 2, 3)]
    assert all(f["params"] == finals[0]["params"] and f["size"] == 3 for f in finals)


def test_user_srun_step_rank_killed_before_mpi_started_ends_the_step(slurm, tmp_path):
    """A batch script as users write it, `srun --mpi=pmix python train.py` without
    --kill-on-bad-exit: srun waits for the other tasks, and before hpcddp's start-up guard
    they waited in MPI_Init until the time limit (probed: 3 min of 3). Rank 1 is SIGKILLed
    while it imports torch: its node-mate's guard ends the step (scancel), naming the lost
    rank, within seconds; nothing is left."""
    tag = uuid.uuid4().hex[:12]
    script = tmp_path / "user.sbatch"
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH -N 2 --ntasks-per-node 2 -t 5 -o {tmp_path}/user-%j.out -J hpcddp-user-srun\n"
        f". {shlex.quote(sys.prefix)}/bin/activate\n"
        f"export {MARK}={tag} HPCDDP_TIMEOUT=10 PYTHONUNBUFFERED=1\n"
        f"srun --mpi=pmix python {SCRIPT} {tmp_path} plain none 1 1 fork\n")
    res = sh(["sbatch", "--parsable", str(script)], 60, cwd=tmp_path)
    assert res.returncode == 0, f"sbatch failed: {res.stderr}"
    job = SlurmJob(res.stdout.strip().split(";")[0], tmp_path, "user-*.out")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                pid = _rank_pid(tag, 1, job)
                break
            except AssertionError:
                time.sleep(0.05)
        else:
            pytest.fail(f"rank 1 did not start in 120 s (state {job.state()}):\n"
                        f"{job.logs()[-3000:]}")
        time.sleep(0.3)                  # torch's import takes seconds: before MPI_Init
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        recs = job.wait(timeout=200)
        after = time.monotonic() - t_kill
    finally:                             # a hung job must not hold the nodes for later tests
        sh(["scancel", job.id], 30)
    log = job.logs()
    assert recs and recs[0]["JobState"] != "TIMEOUT", log[-3000:]
    assert after <= 60, f"{after:.1f} s from the kill to the job's end:\n{log[-3000:]}"
    # named by its world rank where this Slurm lists a node's task ids (SLURM_GTIDS)
    gtids = sh(["srun", "-N1", "-n1", "printenv", "SLURM_GTIDS"], 60).stdout.strip()
    lost = "rank 1" if gtids else "the job's local rank 1"
    assert re.search(rf"\[rank0\] hpcddp: {lost} on node\d ended before MPI's "
                     r"start-up completed", log), log[-3000:]
    deadline = time.monotonic() + 10
    while job_processes(tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not job_processes(tag), f"processes of the job left: {job_processes(tag)}"
