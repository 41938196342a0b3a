"""docs/ecosystem.md runs as written: torch's distributed clients, Lightning and accelerate
over hpcddp.

Every ```python title="NAME.py"``` block of the page is written to a temporary directory and
run as its own MPI job, on the number of ranks named by the ```text title="mpirun -n N python
NAME.py"``` block after it; the lines of that text block must appear, in order, in what the job
prints (Lightning and accelerate print lines of their own around them). The scripts check their
own numbers against the same work done in one process (an ``assert``): a wrong result, a
failing rank or a timeout fails the test.

Each script is started by a small runner, as ``python NAME.py`` would start it (runpy,
``__main__``), which then prints on rank 0 the ops hpcddp's flight recorder saw: the tests of
the compiled functional collectives, Lightning and accelerate check that their collectives
reached hpcddp, not a group of their own.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

from hpcddp.launch.mpirun import run_mpi

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "ecosystem.md"
BLOCK = re.compile(r'```python title="(?P<name>[\w.]+\.py)"\n(?P<code>.*?)```\n\n'
                   r'```text title="mpirun -n (?P<n>\d+) python (?P=name)"\n(?P<out>.*?)```', re.S)
EXAMPLES = {"fsdp2_train.py", "dtensor_tp.py", "dcp_save.py", "dcp_load.py", "functional.py",
            "lightning_train.py", "accelerate_train.py", "device_map.py"}
# one job's ceiling: a cold torch.compile or Lightning import on a busy 2-core machine
TIMEOUT = 300

RUNNER = """\
import runpy, sys
from collections import Counter
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
import hpcddp.comm
from hpcddp.diagnostics.recorder import OP, RECORDER
if hpcddp.comm.world().rank == 0:
    ops = Counter(e[OP] for e in RECORDER.entries())
    print("hpcddp ops:", " ".join(f"{op}={n}" for op, n in sorted(ops.items())))
"""


def _examples() -> dict[str, tuple[int, str, str]]:
    """{name: (ranks, code, expected output)} from the page."""
    return {m.group("name"): (int(m.group("n")), m.group("code"), m.group("out"))
            for m in BLOCK.finditer(DOC.read_text())}


def _env(**extra) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               # a rank that fails leaves the others waiting: the stall report ends the job
               # in two minutes instead of at the job's timeout
               HPCDDP_TIMEOUT="120")
    # Lightning's local rank comes from host names: emulated nodes would contradict it
    env.pop("HPCDDP_RANKS_PER_NODE", None)
    env.update(extra)
    return env


def _run(name: str, tmp: pathlib.Path, prefix=(), env=None) -> dict[str, int]:
    """Run the page's NAME in TMP; check its output against the page; return hpcddp's op counts."""
    ranks, code, expected = _examples()[name]
    (tmp / name).write_text(code)
    (tmp / "runner.py").write_text(RUNNER)
    res = run_mpi(ranks, [*prefix, sys.executable, "runner.py", name], timeout=TIMEOUT,
                  env=env or _env(), cwd=str(tmp))
    assert res.returncode == 0, \
        f"{name}\n--- stdout ---\n{res.stdout}\n--- stderr ---\n{res.stderr}"
    printed = res.stdout.splitlines()
    at = 0
    for line in expected.splitlines():
        assert line in printed[at:], (f"{name}: the page's line {line!r} is not in what the "
                                      f"job printed (after line {at}):\n{res.stdout}")
        at = printed.index(line, at) + 1
    ops = [line for line in printed if line.startswith("hpcddp ops:")]
    assert len(ops) == 1, res.stdout
    return {op: int(n) for op, n in (item.split("=") for item in ops[0].split()[2:])}


def _needs(module: str):
    return pytest.mark.skipif(importlib.util.find_spec(module) is None,
                              reason=f"{module} is not installed (pip install -e '.[test]')")


def test_page_has_its_examples_and_is_listed():
    assert set(_examples()) == EXAMPLES
    assert "ecosystem.md" in (ROOT / "mkdocs.yml").read_text()
    assert "(docs/ecosystem.md)" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("name", ["fsdp2_train.py", "dtensor_tp.py", "device_map.py"])
def test_torch_client_example(name, tmp_path):
    ops = _run(name, tmp_path)
    if name == "fsdp2_train.py":   # FSDP2's own traffic: parameters gathered, gradients scattered
        assert ops.get("all_gather", 0) > 0 and ops.get("reduce_scatter", 0) > 0, ops


def test_functional_collectives_eager_and_compiled(tmp_path):
    ops = _run("functional.py", tmp_path)
    # once eagerly, once from the compiled graph: both reached hpcddp
    assert ops == {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 2}, ops


def test_dcp_save_on_2_load_on_3_and_convert(tmp_path):
    import torch
    _run("dcp_save.py", tmp_path)
    _run("dcp_load.py", tmp_path)                 # the page's title: 3 ranks
    by_script = torch.load(tmp_path / "step3.pt")
    (tmp_path / "step3.pt").unlink()
    command = next(line for line in DOC.read_text().splitlines()
                   if line.startswith("python -m torch.distributed.checkpoint.format_utils"))
    res = subprocess.run(command.replace("python", sys.executable, 1), shell=True,
                         cwd=tmp_path, capture_output=True, text=True, timeout=TIMEOUT)
    assert res.returncode == 0, res.stdout + res.stderr
    by_command = torch.load(tmp_path / "step3.pt")
    assert set(by_command) == {"model", "optim"}
    assert by_command["model"].keys() == by_script["model"].keys()
    for key, value in by_script["model"].items():
        assert torch.equal(by_command["model"][key], value), key


# what the ranks of an mpirun in an sbatch script inherit from the batch step
SBATCH_STEP = dict(SLURM_JOB_ID="4242", SLURM_JOB_NAME="train", SLURM_NTASKS="2",
                   SLURM_NNODES="1", SLURM_JOB_NUM_NODES="1", SLURM_NTASKS_PER_NODE="2",
                   SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")


@_needs("lightning")
def test_lightning_trains_over_hpcddp(tmp_path):
    """Inside a Slurm allocation Lightning would pick SLURMEnvironment, and every rank would be
    rank 0 (SLURM_PROCID): the page's plugins=[MPIEnvironment()] must prevail. One run (Lightning
    is slow to start): outside an allocation MPIEnvironment is also Lightning's own choice."""
    ops = _run("lightning_train.py", tmp_path, env=_env(**SBATCH_STEP))
    # DDP's start-up broadcast and gradient all-reduces, sync_dist logging, Lightning's barriers
    assert ops.get("broadcast", 0) > 0 and ops.get("all_reduce", 0) >= 8, ops


@_needs("accelerate")
def test_accelerate_adopts_the_hpcddp_group(tmp_path):
    ops = _run("accelerate_train.py", tmp_path)
    # DDP's broadcast and all-reduces, gather_for_metrics (all_gather), reduce (all_reduce)
    assert ops.get("broadcast", 0) > 0 and ops.get("all_gather", 0) > 0, ops
    assert ops.get("all_reduce", 0) > 0, ops


@_needs("accelerate")
def test_accelerate_without_launcher_variables_on_two_nodes(tmp_path):
    """What srun --mpi=pmix on two nodes shows accelerate: none of the variables it reads, and a
    node count above one. The page's script must print the same."""
    hide = [arg for var in ("SIZE", "RANK", "LOCAL_RANK", "LOCAL_SIZE", "NODE_RANK")
            for arg in ("-u", f"OMPI_COMM_WORLD_{var}")]
    _run("accelerate_train.py", tmp_path, prefix=["env", *hide],
         env=_env(HPCDDP_RANKS_PER_NODE="1"))
