"""Run every file in tests/mpi/ as real MPI jobs at 2, 3 and 4 ranks.

Each job is ``mpirun -n N python -m pytest --with-mpi tests/mpi/FILE...`` under a hard timeout,
so the outer pytest prints one summary for everything and a hang becomes a failure. A file
may narrow its sizes with a literal ``MPI_SIZES = (2, 4)`` at top level and its timeout with
``MPI_TIMEOUT = 300`` (seconds), its ranks' environment with ``MPI_ENV = {"HPCDDP_X": "1"}``
(settings are read once per process); ``MPI_NEEDS_CUDA = True`` (every test in it needs a GPU) skips
it here without starting a job where torch sees no CUDA device.

Files that ask for the same environment share one job per size: each job costs its ranks'
start-up (3-10 s on 2 cores: four Pythons importing torch), and one per file made that a quarter of
the suite's time. A file that writes ``os.environ`` at import (its own settings, decided while the
job collects), runs over 600 s, or says ``MPI_OWN_JOB = True`` (it sets up and tears down the
default group itself) gets a job of its own. A job's timeout is the sum of its files'.
"""
import ast
import os
import pathlib
import sys

import pytest

from hpcddp.launch.mpirun import run_mpi

HERE = pathlib.Path(__file__).parent
DEFAULT_SIZES = (2, 3, 4)
DEFAULT_TIMEOUT = 240


def _literal(path: pathlib.Path, name: str, default):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return default


ALONE_ABOVE_S = 600


def _writes_environ(path: pathlib.Path) -> bool:
    """Whether the file assigns to os.environ at top level (so it must not share a process)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and "os.environ" in ast.unparse(node.targets[0]):
            return True
    return False


def _jobs():
    """(files, size, env, timeout, needs_cuda) for each job: files sharing an environment share it."""
    groups: dict = {}
    for path in sorted((HERE / "mpi").glob("test_*.py")):
        env = _literal(path, "MPI_ENV", {})
        cuda = _literal(path, "MPI_NEEDS_CUDA", False)
        timeout = _literal(path, "MPI_TIMEOUT", DEFAULT_TIMEOUT)
        alone = (_writes_environ(path) or timeout > ALONE_ABOVE_S or cuda
                 or _literal(path, "MPI_OWN_JOB", False))
        key = path.name if alone else repr(sorted(env.items()))
        for n in _literal(path, "MPI_SIZES", DEFAULT_SIZES):
            job = groups.setdefault((key, n), {"files": [], "env": env, "timeout": 0, "cuda": cuda})
            job["files"].append(path)
            job["timeout"] += timeout
    for (_, n), job in sorted(groups.items(), key=lambda kv: (kv[0][1], str(kv[1]["files"][0]))):
        name = "+".join(p.stem.removeprefix("test_") for p in job["files"])
        yield pytest.param(job["files"], n, job["env"], job["timeout"], job["cuda"], id=f"np{n}-{name}")


@pytest.mark.parametrize("files,nprocs,job_env,timeout,needs_cuda", list(_jobs()))
def test_mpi_suite(files, nprocs, job_env, timeout, needs_cuda):
    if needs_cuda:
        import torch
        if not torch.cuda.is_available():
            pytest.skip(f"{files[0].name}: every test in it needs a CUDA GPU; torch sees none")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **job_env)
    argv = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "--rootdir", str(HERE.parent), *map(str, files)]
    res = run_mpi(nprocs, argv, timeout=timeout, env=env, cwd=str(HERE.parent))
    assert res.returncode == 0, (
        f"{', '.join(p.name for p in files)} failed at {nprocs} ranks (exit {res.returncode})\n"
        f"--- stdout ---\n{res.stdout[-8000:]}\n--- stderr ---\n{res.stderr[-8000:]}")
