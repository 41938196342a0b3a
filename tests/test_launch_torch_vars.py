"""torch's env:// variables under mpirun, and torchrun, in whole jobs (each under a timeout).

A stray ``WORLD_SIZE`` that agrees with mpirun (PyTorch's test tooling exports one) starts, and
rank 0 alone warns, in one line; one that contradicts mpirun fails fast on every rank with the
message, also when ``MASTER_ADDR`` sends ``init_process_group`` through torch's own env://
handler (whose store would otherwise wait torch's 30 minutes for a rank that never comes).
Under torchrun, the error's first words say that torchrun cannot start MPI ranks.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from hpcddp.launch.mpirun import run_mpi

TIMEOUT = 150

SCRIPT = """
import torch, torch.distributed as dist
import hpcddp
dist.init_process_group("hpcddp")
n, r = dist.get_world_size(), dist.get_rank()
t = torch.full((2,), float(r + 1))
dist.all_reduce(t)
assert t.eq(n * (n + 1) / 2).all(), t
print(f"ok {r} {n}", flush=True)
dist.destroy_process_group()
"""

# torch's and the launchers' variables this process may have: a job starts without them
_DROP = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
         "GROUP_RANK", "TORCHELASTIC_RUN_ID", "HPCDDP_LAUNCHER", "HPCDDP_RANKS_PER_NODE")


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def _script(tmp_path) -> str:
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(SCRIPT))
    return str(path)


def test_stray_world_size_that_agrees_starts_and_warns_once(tmp_path):
    res = run_mpi(3, [sys.executable, _script(tmp_path)], timeout=TIMEOUT,
                  env=_env(WORLD_SIZE="3"), cwd=str(tmp_path))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    assert sorted(l for l in res.stdout.splitlines() if l.startswith("ok ")) == \
        [f"ok {r} 3" for r in range(3)], out
    warnings = [l for l in out.splitlines() if "set without RANK" in l]
    assert len(warnings) == 1, out
    assert warnings[0].startswith("[rank0] hpcddp.init: WORLD_SIZE=3 is set without RANK "), out
    assert "Open MPI (mpirun), which is in charge" in warnings[0]
    assert "`unset WORLD_SIZE`" in warnings[0]


def _refused(res, text: str) -> None:
    out = res.stdout + res.stderr
    assert res.returncode not in (0, -9), out      # -9: killed at the timeout, i.e. it hung
    assert "ok " not in res.stdout, out
    assert text in out, out


def test_stray_world_size_that_contradicts_fails_fast(tmp_path):
    res = run_mpi(2, [sys.executable, _script(tmp_path)], timeout=TIMEOUT,
                  env=_env(WORLD_SIZE="3"), cwd=str(tmp_path))
    _refused(res, "LaunchEnvError: detect: WORLD_SIZE=3 contradicts Open MPI (mpirun), which "
                  "started this process: it says size 2 (OMPI_COMM_WORLD_SIZE=2)")
    assert "expected WORLD_SIZE=2, or unset" in res.stderr and "`unset WORLD_SIZE`" in res.stderr


def test_contradiction_with_master_addr_set_fails_fast(tmp_path):
    """MASTER_ADDR set: torch's env:// handler, RANK right (a wrapper derives it), WORLD_SIZE
    wrong. Rank 0's store would wait for a third rank; hpcddp refuses before it waits."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wrapper = 'RANK=$OMPI_COMM_WORLD_RANK exec "$0" "$1"'
    res = run_mpi(2, ["sh", "-c", wrapper, sys.executable, _script(tmp_path)], timeout=TIMEOUT,
                  env=_env(WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)),
                  cwd=str(tmp_path))
    _refused(res, "WORLD_SIZE=3 contradicts Open MPI (mpirun)")


def test_torchrun_says_it_cannot_start_mpi_ranks(tmp_path):
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.access(torchrun, os.X_OK):
        pytest.skip(f"no torchrun beside {sys.executable}")
    script = _script(tmp_path)
    res = subprocess.run([torchrun, "--standalone", "--nproc-per-node", "2", script],
                         capture_output=True, text=True, timeout=TIMEOUT, env=_env(),
                         cwd=str(tmp_path))
    _refused(res, f"LaunchWorldError: torchrun cannot start MPI ranks: run "
                  f"`mpirun -n 2 python {script}` instead")
    assert f"`mpirun -n 2 hpcddp run {script}`" in res.stderr
