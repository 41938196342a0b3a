"""The rank's own process: what hpcddp does there, never in a child, and never after its launcher.

Two rules a job needs so that a rank killed from outside (the OOM killer, an admin, a failed
node) ends the job instead of hanging it (docs/hangs.md, "A rank killed from outside"):

1. **Nothing of hpcddp acts in a forked child.** A DataLoader worker (fork), a multiprocessing
   child or an ``os.fork()`` inherits the rank's exception hooks, signal handlers and atexit
   handlers. MPI may not be used there: an orphaned worker that called MPI_Abort through an
   inherited hook blocked in PMIx_Abort forever, holding the GIL and mpirun's output pipes.
   So every hook hpcddp installs asks :func:`in_rank_process` before acting, and the layers
   that install hooks register their undo with :func:`on_fork_child`, which runs in the child
   right after the fork. A child forked from the rank's main thread also gets
   ``PR_SET_PDEATHSIG = SIGKILL`` (Linux): it dies with its rank at once, where torch's own
   worker watchdog needs up to 5 s and a free GIL, and a user's multiprocessing child has no
   watchdog at all. (Forks from other threads do not: the kernel sends the signal when the
   forking *thread* ends.) Children started by spawn or forkserver inherit none of the rank's
   hooks; those that are Python get the same PDEATHSIG at interpreter start, from the
   package's .pth file (_hpcddp_start.py), through ``HPCDDP_RANK_PID``.
2. **A rank whose launcher has gone ends itself.** Under ``mpirun --with-ft ulfm`` Open MPI
   answers an MPI_Abort with SIGTERM and no SIGKILL, and mpirun exits: a rank that catches
   SIGTERM (a Checkpointer does, for preemption) and waits in a collective for the aborted
   rank would run on forever, re-parented to init. :func:`watch_launcher` starts a thread
   that checks every half second whether the process that started this rank (its MPI daemon:
   prted, prterun, slurmstepd, hydra's proxy) is still there, and ends the rank (exit code
   :data:`ORPHAN_EXIT_CODE`) when it is not.

Standard library only: no MPI, no torch (a DataLoader worker may import this module).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

RANK_PID_VARIABLE = "HPCDDP_RANK_PID"
ORPHAN_EXIT_CODE = 143          # as if the launcher's SIGTERM had ended it
WATCH_PERIOD_S = 0.5
# the processes that start ranks: a rank's nearest ancestor with one of these names is its
# launcher (a wrapper script between them is looked through)
LAUNCHER_DAEMONS = ("prted", "prterun", "mpirun", "mpiexec", "orted", "slurmstepd",
                    "hydra_pmi_proxy", "pmi_proxy", "palsd")

_rank_pid: int | None = None
_child_undo: list = []
_fork_state = {"from_main_thread": False, "parent": 0}
_registered = False
_libc = None
_watch: threading.Thread | None = None


def pid_state(pid: int) -> str:
    """'dead' or 'alive', for a PID on this host (a zombie not yet reaped is dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "dead"
    except OSError:          # PermissionError: it exists, another user's
        return "alive"
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                return "dead"
    except (OSError, IndexError):
        pass
    return "alive"


def own() -> None:
    """Mark this process as the rank (hpcddp.init calls it) and arm the fork hooks. Idempotent."""
    global _rank_pid, _registered, _libc
    _rank_pid = os.getpid()
    # for Python processes it starts by exec (spawn, forkserver, subprocess): hpcddp-start.pth
    # gives them the same PDEATHSIG (_hpcddp_start.py)
    os.environ[RANK_PID_VARIABLE] = str(_rank_pid)
    if _registered or not hasattr(os, "register_at_fork"):
        return
    _registered = True
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            _libc = ctypes.CDLL(None, use_errno=True)
        except OSError:
            _libc = None
    os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)


def in_rank_process() -> bool:
    """True in the process hpcddp started MPI in (or before any start): False in its forked
    children, where hpcddp's hooks must do nothing."""
    return _rank_pid is None or os.getpid() == _rank_pid


def on_fork_child(undo) -> None:
    """Run UNDO() (no arguments) in every child forked from the rank, right after the fork:
    put back what the caller installed in the rank (an exception hook, a signal handler)."""
    if undo not in _child_undo:
        _child_undo.append(undo)


def _before_fork() -> None:
    _fork_state["from_main_thread"] = threading.current_thread() is threading.main_thread()
    _fork_state["parent"] = os.getpid()


def _after_fork_in_child() -> None:
    if _rank_pid is None or _fork_state["parent"] != _rank_pid:
        return                  # a grandchild: its parent (our child) already ran this
    for undo in _child_undo:
        try:
            undo()
        except Exception:
            pass
    if _fork_state["from_main_thread"] and _libc is not None:
        PR_SET_PDEATHSIG = 1
        _libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != _fork_state["parent"]:   # the rank died before prctl: too late
            os._exit(1)


# -- the launcher watch --------------------------------------------------------------------------
def _stat(pid: int) -> tuple[str, int]:
    """(name, parent PID) of PID, from /proc; ('', 0) when it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
        name = text[text.index("(") + 1:text.rindex(")")]
        return name, int(text.rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return "", 0


def launcher_pid() -> int:
    """The PID of the process that started this rank: the nearest ancestor named like an MPI
    or Slurm daemon (LAUNCHER_DAEMONS), else the parent."""
    pid = os.getppid()
    for _ in range(8):
        name, parent = _stat(pid)
        if name in LAUNCHER_DAEMONS:
            return pid
        if parent <= 1:
            break
        pid = parent
    return os.getppid()


def watch_launcher(say=None) -> int | None:
    """Start the thread that ends this rank once its launcher is gone (once per process).

    say: prints the one line explaining the exit (default: stderr). Returns the launcher's
    PID, or None when there is none to watch (a rank started by hand, or init's own pid 1).
    """
    global _watch
    if _watch is not None:
        return getattr(_watch, "launcher", None)
    pid = launcher_pid()
    if pid <= 1:
        return None
    name = _stat(pid)[0] or "launcher"

    def run():
        while True:
            time.sleep(WATCH_PERIOD_S)
            if pid_state(pid) == "dead":
                break
        line = (f"hpcddp: this rank's launcher ({name}, pid {pid}) has gone (the job was "
                f"aborted or mpirun was killed): ending this rank (pid {os.getpid()}), exit "
                f"code {ORPHAN_EXIT_CODE}")
        try:
            (say or (lambda s: print(s, file=sys.stderr, flush=True)))(line)
        except Exception:       # its output pipe may have gone with it
            pass
        os._exit(ORPHAN_EXIT_CODE)

    _watch = threading.Thread(target=run, name="hpcddp-launcher-watch", daemon=True)
    _watch.launcher = pid
    _watch.start()
    return pid


def _forget_watch_in_child() -> None:
    global _watch
    _watch = None               # threads do not survive a fork; a child watches nothing


on_fork_child(_forget_watch_in_child)
