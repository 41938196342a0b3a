"""Shared set-up for tests that run *inside* an MPI job (``mpirun -n N pytest --with-mpi``).

These files are started by ``tests/test_mpi_suites.py`` at several sizes, each job under a
timeout. A test that fails on one rank aborts the whole job (MPI_Abort) after printing its
report with the rank's prefix, so the other ranks never wait in a collective that will not come.
"""
import os
import sys

import pytest


def _rank() -> int:
    from hpcddp.launch import detect
    info = detect()
    return info.rank if info else 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when in ("setup", "call"):
        rank = _rank()
        text = "\n".join(f"[rank{rank}] {line}" for line in str(report.longrepr).splitlines())
        sys.stderr.write(f"[rank{rank}] FAILED {item.nodeid}\n{text}\n")
        sys.stderr.flush()
        if "mpi4py.MPI" in sys.modules and os.environ.get("HPCDDP_TEST_NO_ABORT") != "1":
            from mpi4py import MPI
            if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
                MPI.COMM_WORLD.Abort(1)
