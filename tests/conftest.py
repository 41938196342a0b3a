"""Top-level test configuration.

tests/mpi/ holds tests that must run inside an MPI job; the plain run collects them only
through tests/test_mpi_suites.py (which starts them under mpirun), never directly.
tests/scripts/ and tests/scenarios/ hold programs that tests start as child jobs (one of them
a deliberately failing MPI test): never collected.

Before the run, Open MPI's session directories left in /tmp by launchers that were killed
(our fault tests kill them) are removed where their process is gone: they are named by pid
(/tmp/ompi.PID, /tmp/prted.PID), pids wrap at 32768 here, and a new mpirun or prted that gets
a dead one's pid finds its PMIx rendezvous files and stops ("The PMIx server's listener
thread failed to start", exit 213): seen in CI with a few hundred such directories left.
"""
import os
import pathlib
import re
import shutil
import tempfile

MPI_DIR = pathlib.Path(__file__).parent / "mpi"
collect_ignore = ["scripts", "scenarios"]
_SESSION_DIR = re.compile(r"(ompi|prted|prterun)\.(\d+)$")


def remove_stale_mpi_session_dirs(tmp: str = tempfile.gettempdir()) -> list:
    """Remove TMP's Open MPI session directories whose process no longer runs; their names."""
    gone = []
    for name in os.listdir(tmp):
        m = _SESSION_DIR.match(name)
        if m is None or not os.path.isdir(os.path.join(tmp, name)):
            continue
        try:
            os.kill(int(m.group(2)), 0)
            continue                       # alive (or another user's): kept
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)
        gone.append(name)
    return gone


def pytest_sessionstart(session):
    if not session.config.getoption("--with-mpi", default=False):   # not inside a rank
        remove_stale_mpi_session_dirs()


def pytest_ignore_collect(collection_path, config):
    if config.getoption("--with-mpi", default=False):
        return None
    p = pathlib.Path(collection_path)
    if p == MPI_DIR or MPI_DIR in p.parents:
        return True
    return None
