"""Abort on exception: one rank's uncaught exception ends the whole job, promptly.

Without it the other ranks wait forever in their next collective (the seeds' most common
hang). Like ``python -m mpi4py``: print the traceback with the rank prefix, then MPI_Abort.
"""
from __future__ import annotations

import io
import sys
import threading
import traceback

_installed = False


ABORT_EXIT_CODE = 1


def _abort_with(exc_type, exc, tb) -> None:
    from hpcddp.comm import output as _log
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    try:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        _log.log(f"uncaught exception, aborting the job (abort_on_exception; exit code "
                 f"{ABORT_EXIT_CODE}):\n{text}")
    finally:
        from hpcddp.comm._mpi import MPI
        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.COMM_WORLD.Abort(ABORT_EXIT_CODE)
        sys.exit(1)


def install_abort_on_exception() -> None:
    """Make an uncaught exception (main thread or any thread) abort the MPI job."""
    global _installed
    if _installed:
        return
    _installed = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, SystemExit):
            return previous(exc_type, exc, tb)
        _abort_with(exc_type, exc, tb)

    sys.excepthook = hook
    threading.excepthook = lambda args: _abort_with(args.exc_type, args.exc_value,
                                                    args.exc_traceback)


def install_rank_prefixed_excepthook() -> None:
    """Print an uncaught exception's traceback with the rank prefix (nothing else changes:
    the process exits as Python would). Only replaces Python's default hook."""
    if sys.excepthook is not sys.__excepthook__:
        return

    def hook(exc_type, exc, tb):
        from hpcddp.comm import output as _log
        if issubclass(exc_type, KeyboardInterrupt):
            return sys.__excepthook__(exc_type, exc, tb)
        text = "".join(traceback.format_exception(exc_type, exc, tb))
        try:
            if isinstance(sys.stderr, io.StringIO):
                # torch.distributed's own hook captures stderr to prefix it: don't prefix twice
                sys.stderr.write(text)
            else:
                _log.log(text.rstrip("\n"))
        except Exception:
            sys.__excepthook__(exc_type, exc, tb)

    sys.excepthook = hook
