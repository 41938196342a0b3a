"""The ring path: all_reduce, reduce_scatter_tensor and all_gather_into_tensor of a group
spanning nodes as a pipelined ring over TCP links of its own (or MPI point-to-point;
hpcddp.collectives._ring), each from the size where its start-up race finds it faster than
MPI."""
from __future__ import annotations

from hpcddp.collectives import _hier, _large, _node, _ring


class RingPath:
    name = "ring"
    min_bytes = _ring.MIN_BYTES
    OPS = frozenset(_ring.RACED)
    state = staticmethod(_node.path_state("ring", lambda g: _ring.ring(g),
                                          "the group is on one node", _ring.RACED,
                                          how=lambda ring: ring.transport))

    @staticmethod
    def floor(comm, op: str) -> tuple:   # the group's row (call.group_rows)
        return _node.group_floor(comm, "ring", _ring.RACED[op], _ring.MIN_BYTES)

    @staticmethod
    def applies(c, made, op: str) -> bool:   # pieces over MPI's count limit: the MPI row
        takes = (op == "all_gather_into_tensor" or _ring.adds(c.mop, c.arr)) and \
            not _large.too_big(c.arr)
        c.via = _ring.usable(c.comm, c.nbytes, op, made) if takes else None
        return c.via is not None        # the group's Ring

    @staticmethod
    def all_reduce(c):
        _hier.agree(c.comm, c.entry, c.kind)
        c.via.all_reduce(c.arr)

    @staticmethod
    def reduce_scatter_tensor(c):
        _hier.agree(c.comm, c.entry, c.kind)
        c.via.reduce_scatter(c.inp, c.arr)

    @staticmethod
    def all_gather_into_tensor(c):
        _hier.agree(c.comm, c.entry)
        c.via.all_gather(c.inp, c.out)


RING = RingPath()
