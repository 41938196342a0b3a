"""hpcddp.launch.start_guard on its own: stand-in ranks (sleeping processes with a launcher's
variables), no MPI. The real case, a rank of an elastic job killed before MPI_Init, is
tests/test_outside_kill.py::test_elastic_rank_killed_before_mpi_started."""
from __future__ import annotations

import os
import signal
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
           namespace: str, limit: float, stopped_limit: float = 0.0, after: bool = False,
           act_on_lost: bool = True, env=None):
    read_fd, write_fd = os.pipe()
    proc = subprocess.Popen([sys.executable, "-I", "-S", GUARD, str(read_fd), str(me.pid),
                             str(rank), str(size), str(local_rank), str(local_size), namespace,
                             str(limit), str(stopped_limit), "1" if after else "0",
                             "1" if act_on_lost else "0"],
                            pass_fds=(read_fd,), stderr=subprocess.PIPE, text=True, env=env)
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


def test_what_the_guard_watches(monkeypatch):
    """No guard where the watchdog is off and nothing else is to watch; the start-up limit
    (with its floor) under ULFM only; a stopped rank after HPCDDP_TIMEOUT under every
    launcher."""
    monkeypatch.delenv("PMIX_NAMESPACE", raising=False)
    assert start_guard.start(0, 2, None, None, None) is None
    for ft, limit in ((True, start_guard.START_TIMEOUT_FLOOR_S), (False, 0.0)):
        guard = start_guard.start(0, 2, 0, 2, 5.0, fault_tolerant=ft)
        try:
            assert guard is not None and guard.proc.args[-5:] == ["-", str(limit), "5.0", "0", "1"]
        finally:
            guard.done()
        assert guard.proc.returncode == 0


def test_a_rank_stopped_while_the_job_starts_is_ended_naming_it():
    """SIGSTOP from outside while the job starts (before hpcddp's watchdog runs): after
    HPCDDP_TIMEOUT the guard names the rank and ends it, so that the launcher ends the job."""
    me = _rank("", 1, 0)
    try:
        guard, fd = _guard(me, 1, 2, -1, 0, "", 0, stopped_limit=1.0)
        me.send_signal(signal.SIGSTOP)
        assert _wait_gone(guard, 20), "the guard did not act"
        err = guard.stderr.read()
        assert f"[rank1] hpcddp: rank 1 (pid {me.pid} on" in err, err
        assert "has been stopped (state T: SIGSTOP, kill -STOP)" in err, err
        assert "before MPI_Init; HPCDDP_TIMEOUT=1 s" in err, err
        assert _wait_gone(me, 5) and me.returncode == -9
        os.close(fd)
    finally:
        me.kill()
        me.wait()


def test_a_rank_stopped_then_resumed_or_suspended_with_its_guard_is_left_alone():
    """Stopped for less than the limit (a pause), or stopped together with its guard for
    longer (a whole job suspended, `scontrol suspend`; the guard resumed first): not ended."""
    me = _rank("", 0, 0)
    guard, fd = _guard(me, 0, 2, -1, 0, "", 0, stopped_limit=1.5)
    try:
        os.write(fd, start_guard.MPI_STARTED)        # after MPI_Init: the same watch
        me.send_signal(signal.SIGSTOP)
        time.sleep(0.8)
        me.send_signal(signal.SIGCONT)
        time.sleep(1.5)
        assert guard.poll() is None and me.poll() is None
        guard.send_signal(signal.SIGSTOP)
        me.send_signal(signal.SIGSTOP)
        time.sleep(start_guard.GAP_S + 0.5)
        guard.send_signal(signal.SIGCONT)            # the guard first: it sees its rank stopped
        time.sleep(0.7)
        me.send_signal(signal.SIGCONT)
        time.sleep(1.5)
        assert guard.poll() is None and me.poll() is None, guard.stderr.read()
        os.close(fd)
        fd = None
        assert _wait_gone(guard, 5) and guard.stderr.read() == ""
    finally:
        if fd is not None:
            os.close(fd)
        for p in (me, guard):
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def _fake_scancel(tmp_path, env=None) -> dict:
    """ENV (default: this one) with a scancel first on PATH that writes its arguments to
    TMP_PATH/scancel.args: the guard's call is seen, no real job is touched."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/scancel.args\n")
    (bin_dir / "scancel").chmod(0o755)
    env = dict(os.environ if env is None else env)
    env["PATH"] = f"{bin_dir}:{os.environ['PATH']}"
    return env


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
    tasks = {0: _task(job, 0, 0, 0), 2: _task(job, 2, 0, 1),
             1: _task(job, 1, 1, 0), 3: _task(job, 3, 1, 1)}
    env = {k: v for k, v in os.environ.items() if k != "SLURM_GTIDS"}
    if gtids:
        env["SLURM_GTIDS"] = gtids
    try:
        time.sleep(0.3)
        tasks[2].kill()
        tasks[2].wait()
        guard, write_fd = _guard(tasks[0], 0, 4, 0, 2, f"step:{job}.0:0", 0,
                                 env=_fake_scancel(tmp_path, env))
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


@pytest.mark.parametrize("srun", [False, True], ids=["ulfm-mpirun", "srun"])
def test_a_sibling_lost_after_mpi_started(tmp_path, srun):
    """Once MPI_Init has completed a lost rank is MPI's, hpcddp.elastic's or the launcher's
    (ULFM, mpirun): the guard leaves it; in an srun step, which ends nothing, the guard still
    ends the step (and its rank), naming the lost one."""
    job = str(900000 + os.getpid() % 99999)
    if srun:
        ranks = {0: _task(job, 0, 0, 0), 1: _task(job, 1, 0, 1)}
        launch = f"step:{job}.0:0"
    else:
        launch = f"test-{uuid.uuid4().hex[:8]}"
        ranks = {0: _rank(launch, 0, 0), 1: _rank(launch, 1, 1)}
    guard, fd = _guard(ranks[0], 0, 2, 0, 2, launch, 0, after=srun,
                       env=_fake_scancel(tmp_path))
    try:
        time.sleep(0.5)
        os.write(fd, start_guard.MPI_STARTED)
        time.sleep(0.3)
        ranks[1].kill()
        ranks[1].wait()
        assert _wait_gone(guard, 2 + 2 * start_guard.SETTLE_S) == srun
        if srun:
            err = guard.stderr.read()
            assert "[rank0] hpcddp: rank 1 on" in err, err
            assert "ended while hpcddp started (killed from outside, the OOM killer, a crash); " \
                "srun without --kill-on-bad-exit does not end the step for it" in err, err
            assert err.rstrip().endswith("which waits for it"), err
            assert (tmp_path / "scancel.args").read_text().split() == ["--signal=KILL", f"{job}.0"]
            assert _wait_gone(ranks[0], 5) and ranks[0].returncode == -9
        else:
            assert ranks[0].poll() is None
    finally:
        os.close(fd)
        for p in (*ranks.values(), guard):
            p.kill()
            p.wait()


def test_a_sibling_stopped_before_its_guard_started_is_ended_once():
    """Plain mpirun: a rank stopped while it still imported torch has no guard of its own; the
    guard of the node's lowest running local rank ends it (the launcher then ends the job),
    once, and leaves its own rank to the launcher; the other guards say nothing."""
    ns = f"test-{uuid.uuid4().hex[:8]}"
    ranks = {r: _rank(ns, r, r) for r in range(3)}
    guards = {}
    try:
        for r in (0, 1):
            guards[r] = _guard(ranks[r], r, 3, r, 3, ns, 0, stopped_limit=1.0, act_on_lost=False)
        ranks[2].send_signal(signal.SIGSTOP)
        assert _wait_gone(ranks[2], 1.0 + start_guard.SIBLING_GRACE_S + 10), "not ended"
        assert ranks[2].returncode == -9
        time.sleep(1.0)
        assert all(ranks[r].poll() is None and guards[r][0].poll() is None for r in (0, 1))
        for r in (0, 1):
            os.close(guards[r][1])
        errs = {r: guards[r][0].communicate(timeout=10)[1] for r in (0, 1)}
        assert f"[rank0] hpcddp: rank 2 (pid {ranks[2].pid} on" in errs[0], errs
        assert "ending it (SIGKILL), so that the launcher ends the job" in errs[0], errs
        assert errs[1] == "", errs
    finally:
        for p in (*ranks.values(), *(g for g, _ in guards.values())):
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
