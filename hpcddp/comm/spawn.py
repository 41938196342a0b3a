"""Growing a world back: replacement processes for lost ranks, spawned and merged into one world.

The survivors of a shrink (hpcddp.elastic) call :func:`spawn_replacements`, collectively over
their world: MPI_Comm_spawn_multiple starts the job's own command line once per lost rank (on
the lost rank's host while a survivor still runs there, else wherever the launcher has a free
slot), and both sides merge the intercommunicator. Each replacement's ``hpcddp.init`` sees
``MPI_Comm_get_parent`` and calls :func:`join_as_replacement` instead of using its own
MPI_COMM_WORLD (a world of one). Both then run the same three steps:

1. merge (survivors low, replacements high);
2. the survivors' rank 0 broadcasts the join message: which start-up ranks the replacements
   take, in spawn order, and what the survivors' State hands over (hpcddp.elastic);
3. split by start-up rank, so a world grown back to full size numbers its processes as at
   start-up (rank i is start-up rank i), and world ranks are read in the grown world's
   numbering from then on (communicator.set_world_numbering).

Standard library plus mpi4py: no torch.
"""
from __future__ import annotations

import os
import sys

from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import set_world_numbering

def job_command() -> list[str]:
    """The command line this process was started with (interpreter options and -m kept)."""
    return [sys.executable, *getattr(sys, "orig_argv", [sys.executable, *sys.argv])[1:]]


def spawn_replacements(comm, lost: list[int], hosts: dict, my_rank: int, message: dict):
    """Start one replacement per start-up rank in LOST and merge them with COMM's processes.

    Collective over COMM (the survivors). HOSTS: start-up rank -> host name, MY_RANK: this
    survivor's start-up rank, MESSAGE: what the replacements receive (plus "lost"). Returns
    (world communicator, its start-up ranks in rank order, placements: one host or None per
    lost rank). Raises MPI.Exception when the launcher cannot start them (no free slot).
    """
    alive = {hosts.get(r) for r in comm.allgather(my_rank)}
    # the lost rank's node while a survivor runs there (its data, its network), if it has room
    placed = [hosts.get(r) if hosts.get(r) in alive else None for r in lost]
    try:
        inter = _spawn(comm, placed)
    except MPI.Exception:
        if not any(placed):
            raise
        placed = [None] * len(lost)         # Open MPI keeps a lost rank's slot taken
        inter = _spawn(comm, placed)
    merged = inter.Merge(high=False)
    inter.Free()
    merged.bcast(dict(message, lost=list(lost)) if merged.Get_rank() == 0 else None, root=0)
    world, ranks = _by_start_up_rank(merged, my_rank)
    return world, ranks, placed


def _spawn(comm, hosts: list):
    """MPI_Comm_spawn_multiple of the job's command, one process per entry of HOSTS (a host
    name, or None: wherever the launcher has a free slot)."""
    command = job_command()
    infos = []
    for host in hosts:
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())
        if host is not None:
            info.Set("host", host)
        infos.append(info)
    n = len(hosts)
    try:
        return comm.Spawn_multiple([command[0]] * n, [command[1:]] * n, [1] * n, infos, root=0)
    finally:
        for info in infos:
            info.Free()


def join_as_replacement(parent):
    """A replacement's side of spawn_replacements: (world communicator, its start-up ranks,
    this process's start-up rank, the join message)."""
    merged = parent.Merge(high=True)
    message = merged.bcast(None, root=0)
    lost = message["lost"]
    me = lost[merged.Get_rank() - (merged.Get_size() - len(lost))]
    world, ranks = _by_start_up_rank(merged, me)
    return world, ranks, me, message


def _by_start_up_rank(merged, me: int):
    world = merged.Split(0, me)
    merged.Free()
    return world, numbered_by_start_up_rank(world, me)


def numbered_by_start_up_rank(world, me: int) -> list[int]:
    """WORLD (split by start-up rank ME: a grown world) as the job's world from now on: its
    start-up ranks, which world ranks are read in (hpcddp.comm.spares joins this way too)."""
    world.Set_errhandler(MPI.ERRORS_RETURN)
    ranks = world.allgather(me)
    set_world_numbering(world, ranks)
    return ranks
