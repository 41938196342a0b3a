"""The cross-memory-attach path: a broadcast among ranks on one node split between them, each
copying a part straight from the root's tensor (hpcddp.collectives._cma), from the size where
its start-up race finds it faster than MPI."""
from __future__ import annotations

from hpcddp.collectives import _cma, _node
from hpcddp.diagnostics import mismatch as _mismatch


class CmaPath:
    name = "CMA"
    min_bytes = _cma.MIN_BYTES
    OPS = frozenset({"broadcast"})
    state = staticmethod(_node.path_state("cma", lambda g: _cma.peers(g),
                                          "ranks on several nodes, or the kernel refuses",
                                          {"broadcast": "broadcast"}))

    @staticmethod
    def floor(comm, op: str) -> tuple:   # the group's row (call.group_rows)
        return _node.group_floor(comm, "cma", "broadcast", _cma.MIN_BYTES)

    @staticmethod
    def applies(c, made, op: str) -> bool:
        c.via = _cma.usable(c.comm, c.nbytes, made)     # the group's Peers
        return c.via is not None

    @staticmethod
    def broadcast(c):
        check = _mismatch.agreement(c.comm, c.entry)
        if not c.via.broadcast(c.arr, c.root, check):
            check.refuse(c.entry)


CMA = CmaPath()
