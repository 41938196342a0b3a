"""What hpcddp.data needs from the MPI layer, in one place (never torch.distributed).

Samplers and datasets run in DataLoader workers and in processes without MPI: they ask here
for the rank and node layout, which comes from ``hpcddp.comm`` when MPI runs in this process
and from the launcher's variables otherwise, and never starts MPI themselves.
"""
from __future__ import annotations

import contextlib


def _runtime():
    import sys
    if "hpcddp.comm.startup" not in sys.modules:
        return None
    from hpcddp.comm import is_initialized, runtime
    return runtime() if is_initialized() else None


def world_position() -> tuple[int, int] | None:
    """(rank, size) in the job, or None outside one."""
    rt = _runtime()
    if rt is not None:
        return rt.world.rank, rt.world.size
    from hpcddp.launch import detect
    info = detect()
    if info is None or info.size is None:
        return None
    return info.rank, info.size


def node_position() -> tuple[int, int] | None:
    """(local_rank, local_size) on this rank's node (emulated nodes included), or None."""
    rt = _runtime()
    if rt is not None:
        return rt.topology.local_rank, rt.topology.local_size
    from hpcddp import settings
    from hpcddp.launch import detect
    info = detect()
    if info is None:
        return None
    k = settings.get().ranks_per_node
    if k:
        first = (info.rank // k) * k
        return info.rank - first, min(k, info.size - first)
    if info.local_rank is None or info.local_size is None:
        return None
    return info.local_rank, info.local_size


def mpi_comm(comm=None):
    """The mpi4py communicator to use: ``comm`` (a Communicator or an mpi4py comm) or hpcddp's
    world (starting MPI if needed)."""
    if comm is None:
        from hpcddp.comm import world
        return world().mpi
    return getattr(comm, "mpi", comm)


_watched: dict = {}      # id(mpi4py comm) -> (comm, its Communicator for the recorder)


@contextlib.contextmanager
def watched(comm, op: str):
    """Hold a staging MPI call (``op``, e.g. "stage:bcast") in the flight recorder while it
    runs, as every hpcddp op is held: a peer that dies or hangs inside ``hpcddp stage`` then
    ends in the watchdog's stall report naming it (docs/hangs.md), not in the job's time
    limit. Each staging communicator has a name ("stage#2 (4 ranks)": the plan's world, its
    node groups and their leaders are distinct communicators) and its own sequence numbers."""
    entry = watch_begin(comm, op)
    try:
        yield
    finally:
        watch_end(entry)


def watch_begin(comm, op: str):
    """:func:`watched`'s start, for a wait that is not one block of code (the ring's rounds)."""
    from hpcddp.comm.communicator import Communicator
    from hpcddp.diagnostics import recorder
    key = id(comm)
    held = _watched.get(key)
    if held is None or held[0] is not comm:
        if len(_watched) > 64:          # communicators of finished stagings
            _watched.clear()
        name = f"stage#{len(_watched) + 1} ({comm.Get_size()} ranks)"
        held = _watched[key] = (comm, Communicator(comm, name))
    return recorder.start(held[1], op)


def watch_end(entry) -> None:
    from hpcddp.diagnostics import recorder
    recorder.end(entry)


def watch_local(entry, what: str | None) -> None:
    """Say in ENTRY what it waits for when that is on this node (WHAT, e.g. "this node's
    writer thread"), or None: the stall report then names this rank as the one the others
    wait for (docs/hangs.md)."""
    from hpcddp.diagnostics import recorder
    entry[recorder.PEER] = what
