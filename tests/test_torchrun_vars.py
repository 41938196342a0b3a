"""A torchrun-style training script runs unchanged under mpirun, srun, and alone (each job under
a timeout).

The script reads ``LOCAL_RANK``, ``RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` from the
environment on its first lines, before importing torch or hpcddp (as scripts written for
torchrun do), then calls ``dist.init_process_group("hpcddp")`` and all-reduces. Under a
launcher, hpcddp-start.pth set those variables at interpreter start (from
OMPI_COMM_WORLD_*, SLURM_*); alone, the script falls back to torchrun's defaults and
init_process_group runs as a world of one. The srun test uses the one-machine Slurm of
tests/test_jobs_slurm.py and skips exactly when that file does.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from hpcddp.launch.mpirun import run_mpi

TIMEOUT = 150

SCRIPT = """
import os, sys
local_rank = int(os.environ["LOCAL_RANK"]) if "{strict}" == "1" else int(os.environ.get("LOCAL_RANK", 0))
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
early = sorted(m for m in ("torch", "mpi4py", "hpcddp") if m in sys.modules)
import torch, torch.distributed as dist
import hpcddp
dist.init_process_group("hpcddp")
assert (dist.get_rank(), dist.get_world_size()) == (rank, world), (rank, world)
t = torch.full((1,), float(rank + 1))
dist.all_reduce(t)
assert t.item() == world * (world + 1) / 2, t
print(f"ok rank={{rank}} world={{world}} local={{local_rank}}/{{local_world}} "
      f"group={{os.environ.get('GROUP_RANK')}} early={{early}}", flush=True)
dist.destroy_process_group()
"""

# torch's and the launchers' variables this process may have: a job starts without them
_DROP = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
         "GROUP_RANK", "GROUP_WORLD_SIZE", "HPCDDP_TORCH_VARS_SET", "TORCHELASTIC_RUN_ID",
         "HPCDDP_LAUNCHER", "HPCDDP_RANKS_PER_NODE")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _script(tmp_path, strict=True) -> str:
    path = tmp_path / "train.py"
    path.write_text(textwrap.dedent(SCRIPT.format(strict="1" if strict else "0")))
    return str(path)


def _oks(res) -> list[str]:
    return sorted(line for line in res.stdout.splitlines() if line.startswith("ok "))


@pytest.mark.parametrize("n", [2, 3])
def test_under_mpirun(tmp_path, n):
    res = run_mpi(n, [sys.executable, _script(tmp_path)], timeout=TIMEOUT, env=_env(),
                  cwd=str(tmp_path))
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    oks = _oks(res)
    assert [line.split(" local=")[0] for line in oks] == \
        [f"ok rank={r} world={n}" for r in range(n)], out
    # one node: local ranks are a permutation of 0..n-1, GROUP_RANK (node) 0 after init
    assert sorted(line.split("local=")[1].split()[0] for line in oks) == \
        [f"{r}/{n}" for r in range(n)], out
    assert all("group=0 early=[]" in line for line in oks), out
    assert "set without" not in out, out   # no stray-variable warning for what hpcddp set


def test_alone_is_a_world_of_one(tmp_path):
    res = subprocess.run([sys.executable, _script(tmp_path, strict=False)], env=_env(),
                         cwd=str(tmp_path), capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert _oks(res) == ["ok rank=0 world=1 local=0/1 group=None early=[]"], res.stdout


def test_under_srun(tmp_path, slurm):
    # a plain srun from the test (not in a batch job): the allocation is the step's
    res = subprocess.run(["srun", "--mpi=pmix", "-n", "2", "-N", "1", "--oversubscribe",
                          sys.executable, _script(tmp_path)], env=_env(), cwd=str(tmp_path),
                         capture_output=True, text=True, timeout=240)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out
    oks = _oks(res)
    assert oks == [f"ok rank={r} world=2 local={r}/2 group=0 early=[]" for r in range(2)], out


from test_jobs_slurm import slurm  # noqa: E402,F401  the one-machine Slurm fixture
