"""Abort on exception: one rank's uncaught exception ends the whole job, promptly.

Without it the other ranks wait forever in their next collective (the seeds' most common
hang). Like ``python -m mpi4py``: print the traceback with the rank prefix, then MPI_Abort.
"""
from __future__ import annotations

import sys
import threading
import traceback

_installed = False


def _abort_with(exc_type, exc, tb) -> None:
    from hpcddp.comm import output as _log
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    try:
        _log.log(f"uncaught exception, aborting the job:\n{text}")
    finally:
        from hpcddp.comm._mpi import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(1)
        sys.exit(1)


def install_abort_on_exception() -> None:
    """Make an uncaught exception (main thread or any thread) abort the MPI job."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, (KeyboardInterrupt, SystemExit)) and exc_type is not KeyboardInterrupt:
            return previous(exc_type, exc, tb)
        _abort_with(exc_type, exc, tb)

    sys.excepthook = hook
    threading.excepthook = lambda args: _abort_with(args.exc_type, args.exc_value, args.exc_traceback)
