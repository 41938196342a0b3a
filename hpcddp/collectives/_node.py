"""What hpcddp's node-local fast paths share: the /dev/shm arena (_shm) and cross-memory
attach (_cma) are used only by groups whose ranks all share one node, each behind its own
switch, and each only where a race against MPI says it is faster."""
from __future__ import annotations

import math
import time

from hpcddp.comm._mpi import MPI

# What each group's race decided, in order: {"path", "group", "ours_s", "mpi_s", "kept"}.
# Benchmarks report it (a job where MPI won runs at MPI's speed: that must show).
decisions: list[dict] = []


def per_group(cache, comm, make):
    """CACHE[COMM] (a WeakKeyDictionary: a freed group drops its entry), made by MAKE(COMM)
    on first use: collective, every rank of COMM calls it for the same op."""
    try:
        return cache[comm]
    except KeyError:
        pass
    made = cache[comm] = make(comm)
    return made


def one_node(comm) -> bool:
    """Whether every rank of COMM runs on this node (collective; the same answer everywhere)."""
    node = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED)
    same = node.Get_size() == comm.size
    node.Free()
    return same


def race(path: str, comm, ours, mpis, tries: int = 3) -> bool:
    """Whether OURS beat MPIS: the best of TRIES interleaved runs of each, as the slowest rank
    saw it (collective: every rank gets the same times, so decides alike). Kept in
    ``decisions`` under PATH."""
    best = [math.inf, math.inf]
    for _ in range(tries):
        for i, op in enumerate((ours, mpis)):
            comm.mpi.Barrier()
            t = time.perf_counter()
            op()
            best[i] = min(best[i], time.perf_counter() - t)
    ours_s, mpi_s = (comm.mpi.allreduce(t, op=MPI.MAX) for t in best)
    decisions.append({"path": path, "group": comm.name, "ranks": comm.size,
                      "ours_s": ours_s, "mpi_s": mpi_s, "kept": ours_s < mpi_s})
    return ours_s < mpi_s
