"""Heartbeats under ULFM: Open MPI's failure detector without its own thread, fed by one of ours.

Where a job runs with ULFM across nodes, hpcddp switches on Open MPI's heartbeat detector
(hpcddp.comm._mpi): every rank sends a heartbeat each second to a neighbour, which takes it for
lost after 5 s without one. That is how an elastic job finds a node that dropped off the
network (docs/elastic.md).

The detector can send its heartbeats from a thread of its own (``mpi_ft_detector_thread``),
but in Open MPI 5.0 that thread starts inside MPI_Init, between its two fences, and sends its
first heartbeat at once: a neighbour still in the first fence has not yet registered the
handler for that message, and calls a null pointer (seen in CI: in 3 of 40 start-ups of 2
nodes x 2 ranks on a loaded machine, never with the thread off). The dead neighbour's failure
event then reaches the others inside the same MPI_Init, where ULFM revokes a communicator
not yet made: every process of the job segfaults before the script runs a line.

Without its thread the detector starts after MPI_Init's last fence, safely, but runs only
inside MPI's progress engine: a rank that computes for 5 s without an MPI call sends no
heartbeat and is taken for dead (seen: a 12 s sleep on one rank, its neighbour suspecting it
after 5 s). So hpcddp runs the detector without its thread, and this module keeps the progress
engine turning: a pump thread calls MPI_Iprobe (each call is one turn of opal_progress) a few
times every INTERVAL seconds on a private communicator.

The pump is C (hpcddp/comm/_heartbeat.c) where the C module was built: it never needs the GIL,
so heartbeats go on while the rank holds it (an h5py read, a large unpickle). Without it, a
Python thread does the same, and a rank that holds the GIL for longer than the detector's
timeout can be taken for lost (docs/elastic.md, "What it costs when nothing fails").

The pump needs MPI_THREAD_MULTIPLE (another thread calls MPI beside the script): where hpcddp
asks for a lower thread level, the detector keeps its own thread (hpcddp.comm._mpi). It ends
before MPI_Finalize, whoever calls it (hpcddp.comm.startup, the script, mpi4py at exit).
"""
import os
import threading
from typing import Optional

from hpcddp.launch.mpilib import other_mpi

#: seconds between rounds of probes: the detector's timers fire every period/10 (0.1 s)
INTERVAL = 0.1
#: MPI_Iprobe calls per round: Open MPI runs its timers in one opal_progress call in 8
PROBES = 8
#: the tag probed for; nothing is ever sent on the pump's communicator
TAG = 0x4842   # "HB"

_lock = threading.Lock()
_pump: Optional["_Pump"] = None


class _Pump:
    """One pump: the C thread, or the Python one (KIND says which)."""

    def __init__(self, MPI):
        self.pid = os.getpid()
        self.comm = MPI.COMM_SELF.Dup()
        self.comm.Set_errhandler(MPI.ERRORS_RETURN)
        self.comm.Set_name("hpcddp-heartbeat-pump")
        self.c_module, self.why_python = _load_c(MPI)
        self.thread = None
        self.stopping = threading.Event()
        self.python_rounds = 0
        if self.c_module is not None:
            self.kind = "C thread"
            self.c_module.start(MPI._handleof(self.comm), INTERVAL, PROBES, TAG)
        else:
            self.kind = "Python thread"
            self.thread = threading.Thread(target=self._run_python, name="hpcddp-heartbeat",
                                           daemon=True)
            self.thread.start()

    def _run_python(self) -> None:
        while not self.stopping.wait(INTERVAL):
            for _ in range(PROBES):
                self.comm.Iprobe(0, TAG)   # mpi4py releases the GIL inside MPI
            self.python_rounds += 1

    def rounds(self) -> int:
        return self.c_module.rounds() if self.c_module is not None else self.python_rounds

    def stop(self) -> None:
        if self.c_module is not None:
            self.c_module.stop()
        else:
            self.stopping.set()
            self.thread.join()
        self.comm.Free()


def _load_c(MPI):
    """(the C pump, "") when it can run here, else (None, why not)."""
    try:
        from hpcddp.comm import _heartbeat
    except ImportError as e:
        return None, f"not built ({e})"
    why_not = other_mpi(_heartbeat, MPI)
    return (None, why_not) if why_not else (_heartbeat, "")


def start(MPI) -> str:
    """Start the pump (once per process; MPI started with MPI_THREAD_MULTIPLE). Returns which
    pump runs: "C thread" or "Python thread"."""
    global _pump
    with _lock:
        if _pump is None:
            _pump = _Pump(MPI)
            # MPI_Finalize first frees COMM_SELF's attributes: whoever calls it (the script,
            # mpi4py at exit), the pump ends before MPI does
            keyval = MPI.Comm.Create_keyval(delete_fn=lambda comm, key, value: stop())
            MPI.COMM_SELF.Set_attr(keyval, True)
        return _pump.kind


def stop() -> bool:
    """End the pump and wait for it (before MPI_Finalize). False if none ran."""
    global _pump
    with _lock:
        pump, _pump = _pump, None
    if pump is None:
        return False
    if pump.pid != os.getpid():
        # a forked child (its exit handlers ran): the thread and MPI are its parent's
        return False
    pump.stop()
    return True


def rounds() -> int:
    """Rounds of probes the running pump made (0 when none runs)."""
    pump = _pump
    return 0 if pump is None else pump.rounds()


def running() -> Optional[str]:
    """Which pump runs in this process ("C thread", "Python thread"), or None."""
    pump = _pump
    return None if pump is None else pump.kind
