"""The ring path: all_reduce of a group spanning nodes as a pipelined ring over TCP links of
its own (or MPI point-to-point; hpcddp.collectives._ring), from the size where its start-up
race finds it faster than MPI."""
from __future__ import annotations

from hpcddp.collectives import _hier, _large, _node, _ring


class RingPath:
    name = "ring"
    min_bytes = _ring.MIN_BYTES
    OPS = frozenset({"all_reduce"})
    state = staticmethod(_node.path_state(_ring, "HPCDDP_RING", lambda g: _ring.ring(g),
                                          "the group is on one node",
                                          {"all_reduce": "all_reduce"}))

    @staticmethod
    def floor(comm, op: str) -> tuple:   # the group's row (call.group_rows)
        return _node.group_floor(comm, "ring", "all_reduce", _ring.MIN_BYTES)

    @staticmethod
    def applies(c, made, op: str) -> bool:   # pieces over MPI's count limit: the MPI row
        c.via = None if _large.too_big(c.arr) else _ring.usable(c.comm, c.nbytes, c.arr, c.mop,
                                                                made)
        return c.via is not None        # the group's Ring

    @staticmethod
    def all_reduce(c):
        _hier.agree(c.comm, c.entry, c.kind)
        c.via.all_reduce(c.arr)


RING = RingPath()
