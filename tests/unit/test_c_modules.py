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
