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


def _spans_nodes() -> bool:
    """Whether the launcher's variables say the job spans nodes (MPI is not started yet)."""
    from hpcddp.launch.env import LaunchEnvError, detect, spans_nodes
    try:
        return spans_nodes(detect())
    except LaunchEnvError:
        return False         # hpcddp.init reports it


def _yield_across_nodes() -> None:
    """Open MPI's ranks spin while they wait for a message; across nodes a wait lasts as long
    as the network takes, and the async engine's thread waits beside the training step's
    threads (hpcddp.collectives.engine). There, ask Open MPI to yield the core while nothing
    has arrived (mpi_yield_when_idle: docs/ddp.md, "How async ops progress"), unless the
    user set it."""
    if _spans_nodes():
        os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


# ULFM's heartbeat detector (Open MPI 5): with it a rank whose node dropped off the network is
# reported failed after DETECTOR_TIMEOUT s, as a killed one is at once; without it (Open MPI's
# default) nothing reports it and an elastic job stalls. Each rank sends one small message
# per DETECTOR_PERIOD s to its neighbour in MPI_COMM_WORLD, which watches for it. The failure
# it finds is passed on over MPI's own reliable broadcast (propagator_with_rbcast): the
# default path, through the launcher, never reached rank 0 on 4 virtual nodes with one cut
# off, and the shrink hung. The detector runs without its own thread, which crashes MPI_Init
# now and then; hpcddp.comm.heartbeat's pump keeps it beating instead.
DETECTOR_PERIOD, DETECTOR_TIMEOUT = "1", "5"


def _detect_unreachable_ranks() -> None:
    """Where ULFM is on (``mpirun --with-ft ulfm``) and the job spans nodes, switch its
    heartbeat detector on, unless the user set it: hpcddp.elastic then survives a node that
    drops off the network (docs/elastic.md, "A node that drops off the network"). On one node
    it would watch nothing (no heartbeats between ranks of a node). MPI reads these when it
    starts. The detector runs without its own thread, fed by hpcddp.comm.heartbeat's pump,
    which needs MPI_THREAD_MULTIPLE: at a lower thread level it keeps its thread."""
    from hpcddp.launch.env import fault_tolerant_job
    if not fault_tolerant_job() or not _spans_nodes():
        return
    pump = settings.get().thread_level == "multiple"
    for name, value in (("detector", "true"), ("detector_thread", "false" if pump else "true"),
                        ("detector_period", DETECTOR_PERIOD),
                        ("detector_timeout", DETECTOR_TIMEOUT),
                        ("propagator_with_rbcast", "true")):
        os.environ.setdefault(f"OMPI_MCA_mpi_ft_{name}", value)


def _detector_needs_pump() -> bool:
    """Whether ULFM's detector runs without its own thread in this job: hpcddp set it so
    above, or the user did before a script started MPI ahead of hpcddp."""
    from hpcddp.launch.env import fault_tolerant_job, ft_setting
    return fault_tolerant_job() and ft_setting("detector") and not ft_setting("detector_thread")


def _guard_the_start():
    """hpcddp.launch.start_guard watches over the start-up from a small process of its own,
    until hpcddp's watchdog runs (:func:`started`): a rank stopped from outside (SIGSTOP) for
    HPCDDP_TIMEOUT is ended, under every launcher; where ULFM is on, or srun started the
    ranks, a rank lost before MPI_Init completes would leave the others waiting in it for
    ever (Open MPI under ULFM does not end the job, srun without --kill-on-bad-exit waits for
    the other tasks): the guard ends the job. Plain mpirun ends the job itself on a loss."""
    from hpcddp.launch.env import LaunchEnvError, detect, fault_tolerant_job
    try:
        info = detect()
    except LaunchEnvError:
        return None         # hpcddp.init reports it
    if info is None:
        return None         # a singleton: nothing waits for it
    ft = fault_tolerant_job()
    step = ""
    job, step_id, node = (os.environ.get(k) for k in ("SLURM_JOB_ID", "SLURM_STEP_ID",
                                                        "SLURM_NODEID"))
    if info.launcher == "slurm" and job and step_id and node:
        step = f"{job}.{step_id}:{node}"
    from hpcddp.launch import start_guard
    return start_guard.start(info.rank, info.size, info.local_rank, info.local_size,
                             settings.get().timeout, fault_tolerant=ft, slurm_step=step,
                             act_on_lost=ft or info.launcher == "slurm")


def started() -> None:
    """hpcddp has started and its watchdog runs: the start-up guard's watch ends."""
    global _guard
    if _guard is not None:
        _guard.done()
        _guard = None


_guard = None
if STARTED_HERE:
    mpi4py.rc.thread_level = settings.get().thread_level
    _yield_across_nodes()
    _detect_unreachable_ranks()
    _guard = _guard_the_start()

try:
    from mpi4py import MPI  # noqa: E402
except RuntimeError as _exc:
    # mpi4py's "cannot load MPI library" names no fix: say which one (hpcddp.launch.mpilib)
    from hpcddp.launch.mpilib import raise_no_mpi
    raise_no_mpi(_exc)
    raise
finally:
    if _guard is not None:
        _guard.mpi_started()

if _detector_needs_pump() and MPI.Query_thread() == MPI.THREAD_MULTIPLE:
    from hpcddp.comm import heartbeat
    heartbeat.start(MPI)

__all__ = ["MPI", "STARTED_HERE"]
