"""The one place hpcddp imports ``mpi4py.MPI``.

Importing this module starts MPI (mpi4py's behaviour), asking for MPI_THREAD_MULTIPLE because
DDP runs collectives from autograd threads (``HPCDDP_THREAD_LEVEL`` asks for another level).
That is why nothing on hpcddp's import path imports it: ``import hpcddp``, ``hpcddp --help``,
a DataLoader worker importing hpcddp.data never start MPI; :func:`hpcddp.init` does.

We do not defer MPI_Init past this import (mpi4py's ``rc.initialize = False``): any code that
later does ``from mpi4py import MPI`` (the user's script, pytest-mpi) would get an MPI that was
never started and abort on its first call.
"""
import os
import sys

import mpi4py

from hpcddp import settings

STARTED_HERE = "mpi4py.MPI" not in sys.modules


def _yield_across_nodes() -> None:
    """Open MPI's ranks spin while they wait for a message; across nodes a wait lasts as long
    as the network takes, and the async engine's thread waits beside the training step's
    threads (hpcddp.collectives.engine). There, ask Open MPI to yield the core while nothing
    has arrived (mpi_yield_when_idle: docs/ddp.md, "How async ops progress"), unless the
    user set it. The launcher's variables say whether the job spans nodes: MPI is not
    started yet."""
    from hpcddp.launch.env import LaunchEnvError, detect, spans_nodes
    try:
        info = detect()
    except LaunchEnvError:
        return               # hpcddp.init reports it
    if spans_nodes(info):
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


if STARTED_HERE:
    mpi4py.rc.thread_level = settings.get().thread_level
    _yield_across_nodes()

try:
    from mpi4py import MPI  # noqa: E402
except RuntimeError as _exc:
    # mpi4py's "cannot load MPI library" names no fix: say which one (hpcddp.launch.mpilib)
    from hpcddp.launch.mpilib import raise_no_mpi
    raise_no_mpi(_exc)
    raise

__all__ = ["MPI", "STARTED_HERE"]
