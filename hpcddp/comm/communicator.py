"""Communicator: an MPI intracommunicator with what hpcddp needs to know about it.

Every hpcddp op runs on one of these. ``mpi`` is the mpi4py ``Intracomm``; ``world_ranks``
maps group ranks to world ranks (error messages and diagnostics speak in world ranks too).
Per-communicator sequence numbers count ops, as torch does per process group: the
diagnostics compare them across ranks to name who is where. ``timeout`` is the group's own
stall timeout in seconds (torch's ``init_process_group``/``new_group(timeout=...)``); None
means the job's (HPCDDP_TIMEOUT).
"""
from __future__ import annotations

import itertools

from hpcddp.comm._mpi import MPI

_ids = itertools.count()


class Communicator:
    __slots__ = ("mpi", "rank", "size", "name", "world_ranks", "seq", "uid", "timeout",
                 "__weakref__")

    def __init__(self, mpi_comm, name: str = "", world_ranks=None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.name = name or f"comm{next(_ids)}"
        if world_ranks is None:
            world_ranks = translate_to_world(mpi_comm)
        self.world_ranks = tuple(world_ranks)
        self.seq = 0
        self.uid = next(_ids)
        self.timeout: float | None = None

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, rank={self.rank}, size={self.size})"

    def check_rank(self, r, fn: str, arg: str) -> int:
        """Validate a group rank argument (src/dst/peer) before any message."""
        if not isinstance(r, int) or isinstance(r, bool):
            raise ValueError(f"{fn}: {arg} must be an int group rank, got {type(r).__name__} {r!r}")
        if not 0 <= r < self.size:
            raise ValueError(f"{fn}: {arg}={r} is out of range for group {self.name!r} of size "
                             f"{self.size} (valid: 0..{self.size - 1})")
        return r

    def free(self) -> None:
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            try:
                self.mpi.Free()
            except MPI.Exception:
                pass
        self.mpi = MPI.COMM_NULL


# The numbering world ranks are given in: MPI_COMM_WORLD's ranks, until hpcddp.elastic grows
# a job back with spawned replacements (each has an MPI_COMM_WORLD of its own, and takes the
# start-up rank of the process it replaces): then the grown world's group and its numbering.
_world_group = None
_world_numbers: tuple | None = None


def set_world_numbering(mpi_comm, world_ranks) -> None:
    """From now on world ranks are WORLD_RANKS[i] for MPI_COMM's rank i (every process of
    the job is in MPI_COMM; hpcddp.comm.spawn calls it after a merge)."""
    global _world_group, _world_numbers
    old, _world_group = _world_group, mpi_comm.Get_group()
    _world_numbers = tuple(world_ranks)
    if old is not None:
        old.Free()


def translate_group_to_world(group) -> list[int]:
    """World ranks of GROUP's members, in group order (MPI.UNDEFINED for a process outside
    the job's world)."""
    global _world_group
    if _world_group is None:
        _world_group = MPI.COMM_WORLD.Get_group()
    ranks = MPI.Group.Translate_ranks(group, list(range(group.Get_size())), _world_group)
    if _world_numbers is None:
        return list(ranks)
    return [r if r == MPI.UNDEFINED else _world_numbers[r] for r in ranks]


def translate_to_world(mpi_comm) -> list[int]:
    """World ranks of MPI_COMM's processes, in its rank order."""
    group = mpi_comm.Get_group()
    try:
        return translate_group_to_world(group)
    finally:
        group.Free()
