"""Diagnostics: hangs become short, explained failures (docs/hangs.md).

- :mod:`~hpcddp.diagnostics.recorder`: the flight recorder (every op, per rank, bounded);
- :mod:`~hpcddp.diagnostics.watchdog`: the stall report (HPCDDP_TIMEOUT, HPCDDP_STALL_POLICY),
  naming dead and unresponsive ranks;
- :mod:`~hpcddp.diagnostics.mismatch`: the cross-rank check of every collective
  (HPCDDP_DEBUG=detail);
- :mod:`~hpcddp.diagnostics.abort`: one rank's uncaught exception ends the job.

:func:`start_diagnostics` runs inside :func:`hpcddp.init`; :func:`shutdown_diagnostics` in
:func:`hpcddp.finalize` (and at exit). Depends on ``hpcddp.comm`` only.
"""
from __future__ import annotations

import atexit
import dataclasses
import threading
import time

from hpcddp.diagnostics import config
from hpcddp.diagnostics.abort import install_abort_on_exception
from hpcddp.diagnostics.config import STALL_EXIT_CODE
from hpcddp.diagnostics.mismatch import CollectiveMismatchError
from hpcddp.diagnostics.recorder import RECORDER, FlightRecorder

_watchdog = None
_lock = threading.Lock()
_atexit = False

__all__ = ["CollectiveMismatchError", "FlightRecorder", "RECORDER", "STALL_EXIT_CODE",
           "install_abort_on_exception", "query_ranks", "set_timeout", "shutdown_diagnostics",
           "on_mpi_start", "start_diagnostics", "running_watchdog"]


def on_mpi_start(rt, timeout=None, abort_on_exception: bool | None = None) -> None:
    """What hpcddp.comm's start-up runs (hpcddp.ON_MPI_START): the watchdog on RT's world,
    and abort on exception as hpcddp.init's ABORT_ON_EXCEPTION says (None: the setting;
    hpcddp.diagnostics.abort.set_mode)."""
    start_diagnostics(rt.world, rt.topology.hostname, timeout)
    from hpcddp.diagnostics import abort
    abort.set_mode(abort_on_exception, rt.world.size)


def start_diagnostics(world, host: str, timeout=None, base=None):
    """Start the watchdog on every rank (collective over the world: hpcddp.init calls it).

    timeout: seconds (or a timedelta; 0 turns the watchdog off); None: HPCDDP_TIMEOUT.
    base: the mpi4py communicator the watchdog duplicates for its messages (default
        WORLD's).
    Returns the Watchdog, or None for a single rank or a disabled watchdog.
    """
    global _watchdog, _atexit
    settings = config.read()          # rejects bad values before any message
    if timeout is not None:
        settings = _with_timeout(settings, config.timeout_from(timeout))
    with _lock:
        if _watchdog is not None:
            if timeout is not None:
                _watchdog.set_timeout(settings.timeout)
            return _watchdog
        if world.size < 2:
            return None
        from hpcddp.diagnostics.watchdog import Watchdog
        from hpcddp.diagnostics.abort import install_rank_prefixed_excepthook
        install_rank_prefixed_excepthook()
        wd = Watchdog(world, settings, host, base=base)
        wd.start()
        _watchdog = wd
        if not _atexit:
            _atexit = True
            atexit.register(shutdown_diagnostics)  # before mpi4py's own MPI_Finalize
    return wd


def _with_timeout(s, timeout):
    peer = config.peer_timeout_for(timeout) if timeout is not None else s.peer_timeout
    return dataclasses.replace(s, timeout=timeout, peer_timeout=peer)


def running_watchdog():
    """The running Watchdog (None before init, on one rank, or when disabled). Not named
    ``watchdog``: importing the submodule of that name replaces such a package attribute."""
    return _watchdog


def set_timeout(timeout) -> None:
    """Change HPCDDP_TIMEOUT for this rank's watchdog (seconds, timedelta, 0/'off')."""
    wd = _watchdog
    if wd is not None:
        wd.set_timeout(config.timeout_from(timeout))


def query_ranks(ranks, wait: float):
    """Ask RANKS (world ranks) for their state through the watchdogs: ({rank: snapshot},
    {rank: what is known of a rank that did not answer within WAIT seconds}).
    Returns None when there is no watchdog to ask through."""
    wd = _watchdog
    if wd is None or not wd.multiple:
        return None
    return wd.query(list(ranks), wait)


def stop_without_barrier() -> None:
    """Stop this rank's watchdog at once, with no final barrier (hpcddp.elastic: some of its
    peers are dead). In-flight records are closed as abandoned. Idempotent."""
    global _watchdog
    from hpcddp.diagnostics import recorder
    with _lock:
        wd, _watchdog = _watchdog, None
    now = recorder._now()
    for e in list(recorder.RECORDER.buf):
        if e is not None and e[recorder.T_END] == 0.0:
            e[recorder.T_END] = now
            e.append("abandoned")
    if wd is not None:
        wd._stopping = True
        wd._stop.set()
        if wd.thread.is_alive() and threading.current_thread() is not wd.thread:
            wd.thread.join(timeout=2.0)
        # its communicator has dead members: dropped, not freed (freeing may synchronise)


def shutdown_diagnostics() -> None:
    """Wait for every rank to get here, then stop the watchdog and free its communicators.

    The wait is the watchdog's last job: while this rank waits for ranks still in an op, the
    report names them (a rank ends its script while others wait in a collective it skipped).
    Called by hpcddp.finalize and at exit; idempotent.
    """
    global _watchdog
    from hpcddp.comm._mpi import MPI
    from hpcddp.comm.communicator import release_all
    from hpcddp.diagnostics import recorder
    from hpcddp.launch import process
    if not process.in_rank_process():     # a forked child exiting: the watchdog is the rank's
        return
    with _lock:
        wd = _watchdog
    from hpcddp.comm.failures import lost_ranks
    if wd is not None and lost_ranks(wd.world.mpi):
        stop_without_barrier()      # the barrier would fail (ULFM) or wait for the dead
        return
    with _lock:
        wd, _watchdog = _watchdog, None
    if wd is None or MPI.Is_finalized():
        return
    now = recorder._now()
    for e in list(recorder.RECORDER.buf):
        if e is not None and e[recorder.T_END] == 0.0:
            e[recorder.T_END] = now   # the script has ended: what it left in flight is over
            e.append("abandoned")
    entry = [wd.world.seq, "finalize", wd.world, None, None, None, now, 0.0]
    recorder.RECORDER.add(entry)
    try:
        wd.audit_at_exit()      # this rank's last recorded calls to rank 0 (diagnostics.audit)
        wd.script_ended()       # the coordinator looks for ranks waiting in a call it skipped
        req = wd.diag.Ibarrier()
        while not req.Test():
            time.sleep(0.005)   # the watchdog thread reports if the others never come
        wd.audit_after_barrier()
    finally:
        recorder.end(entry)
        wd.stop()
        release_all()           # what the paths kept for each group, before MPI_Finalize
