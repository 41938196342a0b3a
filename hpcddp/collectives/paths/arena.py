"""The shared-memory arena path: all_reduce and reduce_scatter of ranks on one node through
one shared buffer (hpcddp.collectives._shm), from the size where its start-up race finds it
faster than MPI."""
from __future__ import annotations

from hpcddp.collectives import _node, _shm
from hpcddp.diagnostics import mismatch as _mismatch


class ArenaPath:
    name = "shm arena"
    min_bytes = _shm.MIN_BYTES
    OPS = frozenset({"all_reduce", "reduce_scatter_tensor", "reduce_scatter"})
    state = staticmethod(_node.path_state(_shm, "HPCDDP_SHM_ALLREDUCE", lambda g: _shm.arena(g),
                                          "ranks on several nodes, or no room in /dev/shm",
                                          _shm.RACED))

    @staticmethod
    def floor(comm, op: str) -> int:     # the group's row (call.group_rows)
        return _node.group_floor(comm, "shm", _shm.RACED[op], _shm.MIN_BYTES)

    @staticmethod
    def applies(c, op: str) -> bool:
        c.via = _shm.usable(c.comm, c.nbytes, c.dtype, c.kind, op)     # the group's Arena
        return c.via is not None

    @staticmethod
    def all_reduce(c):
        check = _mismatch.agreement(c.comm, c.entry, c.kind)
        if not c.via.all_reduce(c.tensor.view(-1), check):
            check.refuse(c.entry)

    @staticmethod
    def reduce_scatter_tensor(c):
        flat, k = c.input.view(-1), c.tensor.numel()
        _reduce_scatter(c, [flat[j * k:(j + 1) * k] for j in range(c.comm.size)])

    @staticmethod
    def reduce_scatter(c):
        _reduce_scatter(c, [t.view(-1) for t in c.tensors])


def _reduce_scatter(c, blocks) -> None:
    """C's BLOCKS (one per rank) summed through the arena into its output, C.tensor."""
    check = _mismatch.agreement(c.comm, c.entry, c.kind)
    if not c.via.reduce_scatter(blocks, c.tensor.view(-1), check):
        check.refuse(c.entry)


ARENA = ArenaPath()
