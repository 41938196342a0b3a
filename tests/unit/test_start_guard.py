"""hpcddp.launch.start_guard on its own: stand-in ranks (sleeping processes with a launcher's
variables), no MPI. The real case, a rank of an elastic job killed before MPI_Init, is
tests/test_outside_kill.py::test_elastic_rank_killed_before_mpi_started."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from hpcddp.launch import start_guard

GUARD = start_guard.__file__


def _rank(namespace: str, rank: int, local_rank: int) -> subprocess.Popen:
    env = dict(os.environ, PMIX_NAMESPACE=namespace, PMIX_RANK=str(rank),
               OMPI_COMM_WORLD_LOCAL_RANK=str(local_rank))
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)


def _guard(me: subprocess.Popen, rank: int, size: int, local_rank: int, local_size: int,
           namespace: str, limit: float):
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-I", "-S", GUARD, str(read_fd), str(me.pid),
                             str(rank), str(size), str(local_rank), str(local_size), namespace,
                             str(limit)],
                            pass_fds=(read_fd,), stderr=subprocess.PIPE, text=True)
    os.close(read_fd)
    return proc, write_fd


def _wait_gone(proc: subprocess.Popen, within: float) -> bool:
    try:
        proc.wait(timeout=within)
        return True
    except subprocess.TimeoutExpired:
        return False


def test_a_sibling_lost_before_the_start_ends_the_rank_naming_it():
    ns = f"test-{uuid.uuid4().hex[:8]}"
    # the launcher's local order differs from the world's: local rank 2 is world rank 1
    ranks = {0: _rank(ns, 0, 0), 1: _rank(ns, 1, 2), 2: _rank(ns, 2, 1)}
    try:
        time.sleep(0.3)
        ranks[1].kill()
        ranks[1].wait()
        guard, fd = _guard(ranks[0], 0, 3, 0, 3, ns, 0)
        assert _wait_gone(guard, 20), "the guard did not act"
        err = guard.stderr.read()
        assert "[rank0] hpcddp: rank 1 of this job on" in err, err
        assert "ended before MPI's start-up completed" in err, err
        assert _wait_gone(ranks[0], 5), "the guarded rank was not ended"
        assert ranks[0].returncode == -9
        assert ranks[2].poll() is None, "a healthy sibling was ended"
        os.close(fd)
    finally:
        for p in ranks.values():
            p.kill()
            p.wait()


def test_a_start_that_completes_ends_the_guard_and_nothing_else():
    ns = f"test-{uuid.uuid4().hex[:8]}"
    ranks = [_rank(ns, r, r) for r in range(2)]
    try:
        guard, fd = _guard(ranks[0], 0, 2, 0, 2, ns, 0)
        time.sleep(1.5)                     # longer than SETTLE_S: every sibling is alive
        assert guard.poll() is None
        os.close(fd)                        # MPI has started (Guard.done)
        assert _wait_gone(guard, 5)
        assert guard.returncode == 0 and guard.stderr.read() == ""
        assert all(p.poll() is None for p in ranks)
    finally:
        for p in ranks:
            p.kill()
            p.wait()


def test_a_start_longer_than_the_limit_ends_the_rank():
    """A rank lost on another node: nothing local to see, the limit ends the wait."""
    me = _rank("", 0, 0)
    try:
        guard, fd = _guard(me, 0, 2, -1, 0, "", 1.0)
        assert _wait_gone(guard, 20)
        err = guard.stderr.read()
        assert "MPI's start-up (MPI_Init) has not completed in 1 s" in err, err
        assert _wait_gone(me, 5) and me.returncode == -9
        os.close(fd)
    finally:
        me.kill()
        me.wait()


def test_the_guard_ends_with_its_rank():
    me = _rank("", 0, 0)
    guard, fd = _guard(me, 0, 2, -1, 0, "", 0)
    try:
        me.kill()
        me.wait()
        assert _wait_gone(guard, 5)
        assert guard.stderr.read() == ""
    finally:
        os.close(fd)
        guard.kill()
        guard.wait()


def test_no_guard_without_anything_to_watch(monkeypatch):
    monkeypatch.delenv("PMIX_NAMESPACE", raising=False)
    assert start_guard.start(0, 2, None, None, None) is None
    guard = start_guard.start(0, 2, 0, 2, 5.0)     # a limit alone: the floor applies
    try:
        assert guard is not None and guard.proc.args[-1] == str(start_guard.START_TIMEOUT_FLOOR_S)
    finally:
        guard.done()
    assert guard.proc.returncode == 0


def _task(job: str, rank: int, node: int, local_rank: int) -> subprocess.Popen:
    """A stand-in task of srun step JOB.0 (no PMIx: srun --mpi=pmi2 sets none)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMIX_", "SLURM_"))}
    env.update(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_NODEID=str(node),
               SLURM_PROCID=str(rank), SLURM_LOCALID=str(local_rank))
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], env=env)


@pytest.mark.parametrize("gtids", ["0,2", None], ids=["SLURM_GTIDS", "no-SLURM_GTIDS"])
def test_a_task_lost_in_an_srun_step_ends_the_step(tmp_path, gtids):
    """srun without --kill-on-bad-exit waits for the other tasks, which wait in MPI_Init: the
    guard that sees a task of its node gone ends the whole step (scancel), then its rank. The
    other node's tasks share this /proc (as a test cluster's slurmds do) and are not taken for
    this node's. The lost task died before the guard first looked: it is named by its world
    rank where Slurm lists the node's task ids (SLURM_GTIDS; here a cyclic distribution, so
    local rank 1 is world rank 2), else by its local rank."""
    job = str(900000 + os.getpid() % 99999)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/scancel.args\n")
    (bin_dir / "scancel").chmod(0o755)
    tasks = {0: _task(job, 0, 0, 0), 2: _task(job, 2, 0, 1),
             1: _task(job, 1, 1, 0), 3: _task(job, 3, 1, 1)}
    env = {k: v for k, v in os.environ.items() if k != "SLURM_GTIDS"}
    if gtids:
        env["SLURM_GTIDS"] = gtids
    try:
        time.sleep(0.3)
        tasks[2].kill()
        tasks[2].wait()
        read_fd, write_fd = os.pipe()
        guard = subprocess.Popen(
            [sys.executable, "-I", "-S", GUARD, str(read_fd), str(tasks[0].pid), "0", "4", "0",
             "2", f"step:{job}.0:0", "0"], pass_fds=(read_fd,), stderr=subprocess.PIPE,
            text=True, env=dict(env, PATH=f"{bin_dir}:{os.environ['PATH']}"))
        os.close(read_fd)
        assert _wait_gone(guard, 20), "the guard did not act"
        err = guard.stderr.read()
        lost = "rank 2" if gtids else "the job's local rank 1"
        assert f"[rank0] hpcddp: {lost} on" in err, err
        assert "srun without --kill-on-bad-exit does not end the step for it" in err, err
        assert (tmp_path / "scancel.args").read_text().split() == ["--signal=KILL", f"{job}.0"]
        assert _wait_gone(tasks[0], 5) and tasks[0].returncode == -9
        assert all(tasks[r].poll() is None for r in (1, 3)), "another node's task was ended"
        os.close(write_fd)
    finally:
        for p in tasks.values():
            p.kill()
            p.wait()
