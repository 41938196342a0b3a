"""Abort on exception: one rank's uncaught exception ends the whole job, promptly.

Without it the other ranks wait forever in their next collective (the seeds' most common
hang), and the rank itself in MPI's finalize, which waits for them. Three modes
(:func:`set_mode`; ``hpcddp.init(abort_on_exception=)``, else ``HPCDDP_ABORT_ON_EXCEPTION``):

- ``auto`` (the default, with more than one rank): an uncaught exception in the main thread
  is printed as Python prints it (a ``sys.exit`` with a non-zero code counts alike where
  another rank waits in a call for this one), and the rank's exit (:func:`abort_if_the_script_failed`, after the script's own atexit handlers,
  before the watchdog's last wait for every rank and MPI's finalize) reports and ends the
  job;
- ``on`` (``hpcddp run``, ``init(abort_on_exception=True)``): any uncaught exception, also in
  a thread, aborts at once;
- ``off``: neither; the watchdog reports the others' wait after its timeout.

Like ``python -m mpi4py``: print the traceback with the rank prefix, then MPI_Abort;
in a fault-tolerant job (ULFM), where Open MPI does not reliably pass MPI_Abort on, the rank
ends itself instead (docs/hangs.md, "A rank killed from outside"). Only in the rank's own process: a forked child (a DataLoader worker) gets Python's hooks back
and reports its exceptions as Python and torch do, without MPI (hpcddp.launch.process).
"""
from __future__ import annotations

import atexit
import builtins
import io
import os
import signal
import sys
import threading
import time
import traceback

from hpcddp.launch import process
from hpcddp.launch.env import fault_tolerant_job

_installed = False
_mode = "off"            # what set_mode decided last
_explicit = False        # set by an init(abort_on_exception=True/False): later defaults keep it
_uncaught: list = []     # auto: the main thread's uncaught exception, once Python printed it
_recording = False


ABORT_EXIT_CODE = 1
# MPI_Abort tears down the launcher's output forwarding at once: a traceback written just
# before it was lost now and then (seen under mpirun --with-ft ulfm)
OUTPUT_GRACE_S = 0.2
_hooks_before: list = []          # (sys.excepthook, threading.excepthook) before ours


def set_mode(asked, world_size: int) -> None:
    """Abort on exception as ASKED (True: on, False: off, None: HPCDDP_ABORT_ON_EXCEPTION,
    unless an explicit choice came before) in a world of WORLD_SIZE ranks (auto acts from
    2). Run by every hpcddp.init."""
    global _mode, _explicit
    if asked is None:
        if _explicit:
            return
        from hpcddp import settings
        mode = settings.get().abort_on_exception
    else:
        mode, _explicit = ("on" if asked else "off"), True
    _mode = mode
    if mode == "on":
        install_abort_on_exception()
    elif mode == "auto" and world_size > 1:
        _record_uncaught()


def _record_uncaught() -> None:
    """auto: keep the main thread's uncaught exception for the rank's exit; Python (or the
    hook before this one) still prints it."""
    global _recording
    if _recording:
        return
    _recording = True
    previous = sys.excepthook

    def hook(exc_type, exc, tb):
        if not issubclass(exc_type, SystemExit) and process.in_rank_process():
            # torch's DataLoader raises its dead-worker error again from its SIGCHLD handler,
            # inside whatever runs next (this hook, the exit)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            _uncaught[:] = [exc]
        return previous(exc_type, exc, tb)

    sys.excepthook = hook
    sys.exit = _seen_exit(sys.exit)
    for name in ("exit", "quit"):      # site's exit()/quit(), where site is loaded
        if callable(getattr(builtins, name, None)):
            setattr(builtins, name, _seen_exit(getattr(builtins, name)))
    # registered after the watchdog's exit (hpcddp.diagnostics.start_diagnostics), so it runs
    # before it: that one waits for every rank, as MPI's finalize does
    atexit.register(abort_if_the_script_failed)


def _seen_exit(previous):
    """PREVIOUS (sys.exit, exit(), quit()) that first records a non-zero status: a script's
    sys.exit(1) on one rank is its error exit, and the others wait for it as for an exception
    (a bare `raise SystemExit(1)` is not seen: Python has no hook for it)."""
    def exit_(status=None):
        if status not in (None, 0) and process.in_rank_process() and \
                threading.current_thread() is threading.main_thread():
            _uncaught[:] = [SystemExit(status)]
        previous(status)
    return exit_


def abort_if_the_script_failed() -> None:
    """At the rank's exit: in auto mode, after an uncaught exception, abort the job (the
    others wait for this rank in their next collective, and this rank's exit would wait for
    them). Not for a lost rank's error in a fault-tolerant job: hpcddp's exit ends such a rank
    naming the lost one (hpcddp.comm.startup), and elastic mode has recovered or ends it."""
    if _mode != "auto" or not _uncaught or not process.in_rank_process():
        return
    exc = _uncaught[0]
    if fault_tolerant_job():
        # a sys.exit there ends as Python ends it (no report to ask: a rank ended by SIGKILL
        # would turn every rank's sys.exit(2) into lost ranks)
        from hpcddp.comm.failures import is_process_failure
        if isinstance(exc, SystemExit) or is_process_failure(exc):
            return
    elif not _report_first(exc) and isinstance(exc, SystemExit):
        # no rank waits in a call for this one: a script's sys.exit(2) on every rank (a CLI's
        # error exit) ends as Python ends it, with its code
        return
    _abort_with(type(exc), exc, exc.__traceback__, printed=True)


def _report_first(exc) -> bool:
    """Have the watchdog report the job's state at once, naming EXC (Watchdog.report_at_exit),
    and wait while its policy ends the job; back where it found no one waiting (False) or
    the policy is warn (True)."""
    from hpcddp.diagnostics import running_watchdog
    wd = running_watchdog()
    if wd is None:
        return False
    wd.exit_looked.wait(wd.report_at_exit(f"rank {wd.rank}'s script ended {_ended(exc)}"))
    return wd.exit_stalled


def _ended(exc) -> str:
    """How the script ended: 'with sys.exit(2)', 'with an uncaught exception (E: text)'."""
    if isinstance(exc, SystemExit):
        return f"with sys.exit({exc.code!r})"
    return f"with an uncaught exception ({type(exc).__name__}: {exc})"


def _abort_with(exc_type, exc, tb, printed: bool = False) -> None:
    """Report EXC (its whole traceback, or one line where Python PRINTED it already) and end
    the job (in a fault-tolerant job: this rank)."""
    from hpcddp.comm import output as _log
    if threading.current_thread() is threading.main_thread():
        # torch's DataLoader raises from its SIGCHLD handler when a worker died: raised
        # again here, it would skip the report below
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    lines = ([] if isinstance(exc, SystemExit) else
             traceback.format_exception_only(exc_type, exc) if printed else
             traceback.format_exception(exc_type, exc, tb))
    text = "".join(lines) + _dead_loader_workers(exc)
    try:
        try:
            sys.stdout.flush()
        except Exception:
            pass
        # torch.distributed's own excepthook calls this one with sys.stderr swapped for a
        # StringIO that it prints afterwards: after MPI_Abort there is no afterwards
        out = sys.__stderr__ if isinstance(sys.stderr, io.StringIO) else sys.stderr
        if not fault_tolerant_job():
            how = (f"aborting the job (abort_on_exception; exit code {ABORT_EXIT_CODE})"
                   if not printed else
                   f"aborting the job, exit code {ABORT_EXIT_CODE} (the other ranks would "
                   f"wait for this one; HPCDDP_ABORT_ON_EXCEPTION=0 leaves them to the "
                   f"watchdog)")
        elif _end_whole_job:
            how = f"ending this rank, exit code {ABORT_EXIT_CODE} (every rank meets this error)"
        else:
            how = "ending this rank as a lost rank (a fault-tolerant job: the others see it fail)"
        what = ("uncaught exception" if not printed else
                f"the script ended with sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
                else "the script ended with an uncaught exception")
        _log.log(f"{what}, {how}" + (f":\n{text}" if text else ""), file=out)
        time.sleep(OUTPUT_GRACE_S)
    finally:
        from hpcddp.comm._mpi import MPI
        if fault_tolerant_job():
            # Open MPI 5.0 under --with-ft ulfm does not reliably pass an MPI_Abort on: seen,
            # the others waiting in an MPI_Allreduce send to the aborted rank and mpirun
            # alive for minutes, or exiting 0. A process killed by a signal is always seen
            # (ULFM's own failure path: in elastic mode the others recover, else their errors
            # end them too), and one that exits non-zero makes mpirun's status non-zero (but is
            # not seen by the others: only for errors every rank meets itself)
            if _end_whole_job:
                os._exit(ABORT_EXIT_CODE)
            os.kill(os.getpid(), signal.SIGKILL)
        if MPI.Is_initialized() and not MPI.Is_finalized():
            abort_job(ABORT_EXIT_CODE)
        sys.exit(1)


def abort_job(code: int) -> None:
    """MPI_Abort on COMM_WORLD with CODE, the other ranks' watchdogs told first: they would
    see this process gone before MPI's launcher ends them, and report a rank killed from
    outside (Watchdog.abort_coming)."""
    from hpcddp.comm._mpi import MPI
    from hpcddp.diagnostics import running_watchdog
    wd = running_watchdog()
    if wd is not None:
        try:
            wd.abort_coming()
        except Exception:  # noqa: BLE001 - nothing may keep the job from ending
            pass
    MPI.COMM_WORLD.Abort(code)


_end_whole_job = False


def end_whole_job() -> None:
    """Make the next abort end this rank with exit code 1 where ULFM is on, not as a lost rank:
    for errors every rank meets alike (hpcddp.elastic: a rank lost outside state.step()), so
    that mpirun exits non-zero instead of seeing every rank merely lost."""
    global _end_whole_job
    _end_whole_job = True


# A killed worker's sockets close before it becomes a zombie: the batch read it cut can raise
# (EOFError, ConnectionResetError) before torch's check sees the worker dead
CUT_READ_ERRORS = (EOFError, ConnectionError)
WORKER_EXIT_WAIT_S = 1.0


def _dead_loader_workers(exc=None) -> str:
    """torch's line for a DataLoader worker of this process that died, if any: a worker killed
    while its batch was read surfaces as whatever that read raised, and the report should
    still name the worker (after such an EXC, waiting up to WORKER_EXIT_WAIT_S for its exit)."""
    torch_c = getattr(sys.modules.get("torch"), "_C", None)
    check = getattr(torch_c, "_error_if_any_worker_fails", None)
    if check is None:
        return ""
    deadline = time.monotonic() + (WORKER_EXIT_WAIT_S if isinstance(exc, CUT_READ_ERRORS) else 0)
    while True:
        try:
            check()
        except Exception as died:  # noqa: BLE001 - torch says which worker, how
            return f"(and: {died})\n"
        if time.monotonic() >= deadline:
            return ""
        time.sleep(0.01)


def _restore_hooks_in_child() -> None:
    """In a forked child: the exception hooks the rank had before hpcddp's (Python's own,
    unless the user set others), so its exceptions are reported without MPI."""
    if _hooks_before:
        sys.excepthook, threading.excepthook = _hooks_before[0]


def install_abort_on_exception() -> None:
    """Make an uncaught exception (main thread or any thread) abort the MPI job."""
    global _installed, _mode
    _mode = "on"
    if _installed:
        return
    _installed = True
    previous = sys.excepthook
    previous_thread_hook = threading.excepthook

    def hook(exc_type, exc, tb):
        if _mode != "on" or issubclass(exc_type, SystemExit) or not process.in_rank_process():
            return previous(exc_type, exc, tb)
        _abort_with(exc_type, exc, tb)

    def thread_hook(args):
        if _mode != "on" or not process.in_rank_process():
            return previous_thread_hook(args)
        _abort_with(args.exc_type, args.exc_value, args.exc_traceback)

    _hooks_before.append((previous, previous_thread_hook))
    sys.excepthook = hook
    threading.excepthook = thread_hook
    process.on_fork_child(_restore_hooks_in_child)
    atexit.register(_abort_if_an_exception_escaped)    # runs before MPI's finalize (LIFO)


def _abort_if_an_exception_escaped() -> None:
    """At exit after an uncaught exception whose hook never reached ours: torch's DataLoader
    raises from its SIGCHLD handler inside whichever hook runs when a worker dies (seen: inside
    torch.distributed's excepthook, before it called ours), Python prints "Error in
    sys.excepthook" and goes on to exit, and MPI's finalize would wait for the others while
    they wait in their next collective for this rank."""
    exc = getattr(sys, "last_value", None)    # Python sets it for an uncaught exception only
    if _mode != "on" or exc is None or not process.in_rank_process():
        return
    _abort_with(type(exc), exc, exc.__traceback__)


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
