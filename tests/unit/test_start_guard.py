"""hpcddp.launch.start_guard on its own: stand-in ranks (sleeping processes with a launcher's
variables), no MPI. The real case, a rank of an elastic job killed before MPI_Init, is
tests/test_outside_kill.py::test_elastic_rank_killed_before_mpi_started."""
from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

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
