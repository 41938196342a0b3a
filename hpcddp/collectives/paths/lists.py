"""The point-to-point path of the list forms: all_gather, all_to_all and reduce_scatter on
lists of separate tensors, gather and scatter on the root's list, each block straight from
its tensor into its tensor (hpcddp.collectives._lists), on groups of up to
HPCDDP_LIST_P2P_MAX_RANKS ranks."""
from __future__ import annotations

from hpcddp.collectives import _lists, _plans


# reduce_scatter's whole input from which this path takes it: below, the MPI path's cat and
# MPI_Reduce_scatter_block, planned from the third call (the plan copies the blocks in C),
# beat this path's Python steps and sums (docs/benchmarks.md, "The list reduce_scatter's plan")
REDUCE_SCATTER_FROM = 256 << 10


class ListsPath:
    name = "point-to-point"
    min_bytes = 0
    OPS = frozenset({"all_gather", "all_to_all", "reduce_scatter", "gather", "scatter"})

    @staticmethod
    def state(comm, op) -> str:
        limit = _lists._MAX_RANKS
        return "open" if 1 < comm.size <= limit else \
            f"closed ({comm.size} ranks; HPCDDP_LIST_P2P_MAX_RANKS={limit})"

    @staticmethod
    def applies(c, made, op: str) -> bool:     # MADE: None (no state of its own to race)
        return _lists.use_p2p(c.comm, c.block) and (
            op != "reduce_scatter" or c.nbytes >= REDUCE_SCATTER_FROM
            and _lists.reduce_scatter_supported(c.kind, c.dtype))

    @staticmethod
    def all_gather(c):      # zero-copy: each block straight into its tensor
        return _lists.all_gather(c)

    @staticmethod
    def all_to_all(c):      # zero-copy: each block straight from and into its tensor
        return _lists.all_to_all(c)

    @staticmethod
    def reduce_scatter(c):  # zero-copy inputs
        return _lists.reduce_scatter(c)

    @staticmethod
    def gather(c):          # zero-copy: each block straight into its tensor on the root
        return _lists.gather(c)

    @staticmethod
    def scatter(c):         # zero-copy: each block straight from its tensor on the root
        return _lists.scatter(c)

    # a blocking call's exchange, as it ran, planned (take's memo: the second call in a row)
    @staticmethod
    def plan_all_gather(c):
        _lists.plan(_plans.ALL_GATHER, c)

    @staticmethod
    def plan_all_to_all(c):
        _lists.plan(_plans.ALL_TO_ALL, c)

    @staticmethod
    def plan_gather(c):
        _lists.plan_rooted(_plans.GATHER, c)

    @staticmethod
    def plan_scatter(c):
        _lists.plan_rooted(_plans.SCATTER, c)


LISTS = ListsPath()
