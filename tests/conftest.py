"""Top-level test configuration.

tests/mpi/ holds tests that must run inside an MPI job; the plain run collects them only
through tests/test_mpi_suites.py (which starts them under mpirun), never directly.
tests/scripts/ and tests/scenarios/ hold programs that tests start as child jobs (one of them
a deliberately failing MPI test): never collected.
"""
import pathlib

MPI_DIR = pathlib.Path(__file__).parent / "mpi"
collect_ignore = ["scripts", "scenarios"]


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--with-mpi", default=False):
        return None
    p = pathlib.Path(collection_path)
    if p == MPI_DIR or MPI_DIR in p.parents:
        return True
    return None
