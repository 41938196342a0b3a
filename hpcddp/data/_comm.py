"""What hpcddp.data needs from the MPI layer, in one place (never torch.distributed).

Samplers and datasets run in DataLoader workers and in processes without MPI: they ask here
for the rank and node layout, which comes from ``hpcddp.comm`` when MPI runs in this process
and from the launcher's variables otherwise, and never starts MPI themselves.
"""
from __future__ import annotations


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
