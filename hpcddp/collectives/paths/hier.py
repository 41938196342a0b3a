"""The hierarchical path: groups spanning nodes with the same number of their ranks on each,
MPI inside each node and between one leader per node (hpcddp.collectives._hier), from the
size where its start-up race finds it faster than MPI."""
from __future__ import annotations

from hpcddp.collectives import _hier, _large, _node


class HierPath:
    name = "hierarchical"
    min_bytes = _hier.MIN_BYTES
    OPS = frozenset({"all_reduce", "reduce_scatter_tensor", "broadcast",
                     "all_gather_into_tensor"})
    state = staticmethod(_node.path_state(
        "hier", lambda g: _hier.hier(g),
        "one node, or nodes with different numbers of the group's ranks", _hier.RACED))

    @staticmethod
    def floor(comm, op: str) -> tuple:   # the group's row (call.group_rows)
        return _node.group_floor(comm, "hier", _hier.RACED[op], _hier.MIN_BYTES, 4)

    @staticmethod
    def applies(c, made, op: str) -> bool:   # pieces over MPI's count limit: the MPI row
        c.via = None if _large.too_big(c.arr) else _hier.usable(c.comm, c.nbytes, op, made)
        return c.via is not None         # the group's Hier

    @staticmethod
    def all_reduce(c):
        _hier.agree(c.comm, c.entry, c.kind)
        c.via.all_reduce(c.arr, c.mop)

    @staticmethod
    def reduce_scatter_tensor(c):
        _hier.agree(c.comm, c.entry, c.kind)
        c.via.reduce_scatter(c.inp, c.arr, c.mop)

    @staticmethod
    def broadcast(c):
        _hier.agree(c.comm, c.entry)
        c.via.broadcast(c.arr, c.root)

    @staticmethod
    def all_gather_into_tensor(c):
        _hier.agree(c.comm, c.entry)
        c.via.all_gather(c.inp, c.out)


HIER = HierPath()
