"""Communicator: an MPI intracommunicator with what hpcddp needs to know about it.

Every hpcddp op runs on one of these. ``mpi`` is the mpi4py ``Intracomm``; ``world_ranks``
maps group ranks to world ranks (error messages and diagnostics speak in world ranks too).
Per-communicator sequence numbers count ops, as torch does per process group: the
diagnostics compare them across ranks to name who is where. ``timeout`` is the group's own
stall timeout in seconds (torch's ``init_process_group``/``new_group(timeout=...)``); None
means the job's (HPCDDP_TIMEOUT).

What hpcddp's paths keep for a group (the shared-memory arena, the ring's TCP links, private
duplicates for list-form and object messages) is *attached* to its Communicator and released
with it: :meth:`release` when torch destroys the group (``dist.destroy_process_group``), and
the MPI communicator itself freed too where hpcddp made it (``owned``; a communicator a user
handed to ``group_from_comm`` stays the user's).
"""
from __future__ import annotations

import itertools
import weakref

from hpcddp.comm._mpi import MPI

_ids = itertools.count()
_generations: dict = {}   # (name, world ranks) -> groups of that name made so far (audit_key)
_holding: "weakref.WeakSet" = weakref.WeakSet()   # Communicators with attached state
_PREDEFINED = (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL)


class _State(dict):
    """A group's attached state: any change to it (a path's state made, closed or released)
    forgets the dispatch table's rows for the group (``rows``), which are read from it."""
    __slots__ = ("rows",)

    def __init__(self, rows: dict):
        super().__init__()
        self.rows = rows

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.rows.clear()

    def __delitem__(self, key):
        super().__delitem__(key)
        self.rows.clear()

    def pop(self, *args):
        self.rows.clear()
        return super().pop(*args)


class Communicator:
    __slots__ = ("mpi", "rank", "size", "name", "world_ranks", "seq", "uid", "timeout",
                 "owned", "_attached", "rows", "audit_key", "__weakref__")

    def __init__(self, mpi_comm, name: str = "", world_ranks=None, owned: bool = False):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank()
        self.size = mpi_comm.Get_size()
        self.name = name or f"comm{next(_ids)}"
        if world_ranks is None:
            world_ranks = translate_to_world(mpi_comm)
        self.world_ranks = tuple(world_ranks)
        self.seq = 0
        self.uid = next(_ids)
        # what names this group alike on every member, for the audit to compare recorded calls
        # across ranks (hpcddp.diagnostics.audit): a given name, the members, and how many
        # groups of that name and members this process made before (members make groups in
        # the same order; torch names two groups of the same ranks alike). A generated name
        # counts this process's groups only: such a group is not compared.
        self.audit_key = None
        if name:
            same = (name, self.world_ranks)
            self.audit_key = same + (_generations.get(same, 0),)
            _generations[same] = self.audit_key[2] + 1
        self.timeout: float | None = None
        self.owned = owned            # hpcddp made the MPI communicator: the group's end frees it
        # the dispatch table's rows as they stand on this group, per op: the node-local
        # paths that cannot serve it left out, each from the size it serves (take() reads
        # them; hpcddp.collectives.call.group_rows makes them from the attached state)
        self.rows: dict = {}
        self._attached = _State(self.rows)

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

    def attached(self, key: str, make):
        """What the path KEY keeps for this group: made by MAKE(self) on first use (collective:
        every rank of the group asks for the same KEY in the same call), released with it."""
        try:
            return self._attached[key]
        except KeyError:
            pass
        made = self.attach(key, make(self))
        return made

    def kept(self, key: str):
        """What the path KEY keeps for this group, None if nothing (never makes it)."""
        return self._attached.get(key)

    def attach(self, key: str, value):
        """Keep VALUE as KEY's state (None: the path does not serve this group)."""
        self._attached[key] = value
        _holding.add(self)
        return value

    def release(self) -> None:
        """Close what the paths keep for this group (each object's ``close()``, each private
        MPI communicator freed once), keeping the group's own MPI communicator: a later call
        makes the state again. Local: no message is sent."""
        attached, self._attached = self._attached, _State(self.rows)
        self.rows.clear()
        _holding.discard(self)
        for value in attached.values():
            self._close(value)

    def _close(self, value) -> None:
        if isinstance(value, tuple):
            for v in value:
                self._close(v)
        elif isinstance(value, MPI.Comm):
            # a wrapper of the group's own handle (mpi4py's pkl5) is freed with the group
            if value not in _PREDEFINED and value != self.mpi:
                free_mpi(value)
        elif hasattr(value, "close"):
            value.close()

    def free(self) -> None:
        """:meth:`release`, then free the MPI communicator (MPI's predefined ones stay)."""
        self.release()
        if self.mpi not in _PREDEFINED:
            free_mpi(self.mpi)
        self.mpi = MPI.COMM_NULL


def duplicate(comm: Communicator):
    """A private duplicate of COMM's MPI communicator (collective), as paths attach it:
    ``comm.attached(key, duplicate)``; released with the group."""
    return comm.mpi.Dup()


def free_mpi(mpi_comm) -> None:
    """MPI_Comm_free where it can still be done (local in Open MPI: no message waits)."""
    if MPI.Is_finalized():
        return
    try:
        mpi_comm.Free()
    except MPI.Exception:      # already freed, or its processes lost (ULFM): nothing to do
        pass


def release_all() -> None:
    """Release every group's attached state (hpcddp.finalize, before MPI_Finalize)."""
    for comm in list(_holding):
        comm.release()


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
