"""Run every file in tests/mpi/ as a real MPI job at 2, 3 and 4 ranks.

Each job is ``mpirun -n N python -m pytest --with-mpi tests/mpi/FILE`` under a hard timeout,
so the outer pytest prints one summary for everything and a hang becomes a failure. A file
may narrow its sizes with a literal ``MPI_SIZES = (2, 4)`` at top level and its timeout with
``MPI_TIMEOUT = 300`` (seconds), its ranks' environment with ``MPI_ENV = {"HPCDDP_X": "1"}``
(settings are read once per process); ``MPI_NEEDS_CUDA = True`` (every test in it needs a GPU) skips
it here without starting a job where torch sees no CUDA device (each job costs its ranks'
start-up, 3-10 s on 2 cores, for nothing but skips).
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


def _cases():
    for path in sorted((HERE / "mpi").glob("test_*.py")):
        for n in _literal(path, "MPI_SIZES", DEFAULT_SIZES):
            yield pytest.param(path, n, id=f"{path.stem}-np{n}")


@pytest.mark.parametrize("path,nprocs", list(_cases()))
def test_mpi_suite(path, nprocs):
    if _literal(path, "MPI_NEEDS_CUDA", False):
        import torch
        if not torch.cuda.is_available():
            pytest.skip(f"{path.name}: every test in it needs a CUDA GPU; torch sees none")
    timeout = _literal(path, "MPI_TIMEOUT", DEFAULT_TIMEOUT)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               **_literal(path, "MPI_ENV", {}))
    argv = [sys.executable, "-m", "pytest", "--with-mpi", "-q", "-p", "no:cacheprovider",
            "-o", "addopts=", "--rootdir", str(HERE.parent), str(path)]
    res = run_mpi(nprocs, argv, timeout=timeout, env=env, cwd=str(HERE.parent))
    assert res.returncode == 0, (
        f"{path.name} failed at {nprocs} ranks (exit {res.returncode})\n"
        f"--- stdout ---\n{res.stdout[-8000:]}\n--- stderr ---\n{res.stderr[-8000:]}")
