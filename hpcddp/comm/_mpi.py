"""The one place hpcddp imports ``mpi4py.MPI``.

mpi4py initialises MPI when ``mpi4py.MPI`` is first imported unless told otherwise. We tell it
otherwise, so that importing any hpcddp module (a DataLoader worker importing hpcddp.data, a
`hpcddp --help`) never starts MPI; :func:`hpcddp.comm.init` starts it explicitly, asking for
MPI_THREAD_MULTIPLE because DDP calls collectives from autograd threads. If the user's script
imported mpi4py.MPI first, MPI is already running and we leave mpi4py's settings alone.
"""
import sys

import mpi4py

if "mpi4py.MPI" not in sys.modules:
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False

from mpi4py import MPI  # noqa: E402

__all__ = ["MPI"]
