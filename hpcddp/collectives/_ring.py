"""Large all_reduce across nodes: a pipelined ring over point-to-point.

Open MPI's MPI_Allreduce over TCP is bimodal from run to run on a shaped 1 Gbit/s link (16 MiB
at about 118 or 77-91 MB/s) and reaches about 0.6 of gloo's bus bandwidth at 4 nodes, while
its point-to-point is steady (8 MiB exchanges at 117-121 MB/s): docs/benchmarks.md. A ring
(reduce-scatter then all-gather, N-1 steps each, so each link carries 2(N-1)/N of the buffer,
the bound) whose blocks travel as CHUNK-byte messages, each chunk added as it arrives, keeps
the link busy: 0.9-0.95 of gloo at 4 nodes in the prototype (scripts/vcluster/busbw.py ring).

Used for SUM (and AVG, PREMUL_SUM: scaled around it) of the dtypes numpy adds natively, in
groups whose ranks span several nodes, from the size where a race against MPI's Allreduce on
the group's first such call finds it faster (_node.crossover, 1 to 8 MiB: with several ranks
per node a flat ring crosses each link twice and loses to MPI; ``HPCDDP_RING``: 0, auto,
force, which skips the race and serves from MIN_BYTES). The messages go over a private
duplicate of the group's communicator, so they never meet the user's point-to-point messages.
"""
from __future__ import annotations

import weakref

import numpy as np

from hpcddp import settings
from hpcddp.collectives import _node
from hpcddp.comm._mpi import MPI

MIN_BYTES = 1 << 20
LADDER = tuple(n for n in _node.LADDER if MIN_BYTES <= n <= 8 << 20)
CHUNK = 1 << 20
MODE = settings.get().ring
ADDABLE = frozenset(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))
_TAG_RS, _TAG_AG = 1, 2

_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # Communicator -> Ring|None


def usable(comm, nbytes: int, arr, mop) -> bool:
    """Whether an all_reduce of ARR (NBYTES) with MPI op MOP on COMM takes the ring (the same
    answer on every rank of COMM: the call's arguments agree, and the group's layout is
    found collectively on first use)."""
    return (MODE != "0" and nbytes >= MIN_BYTES and comm.size > 1 and mop == MPI.SUM
            and arr.dtype in ADDABLE and _node.serves(ring(comm), "all_reduce", nbytes))


def ring(comm):
    """COMM's ring, made on first use (collective), or None where the group is on one node."""
    return _node.per_group(_groups, comm, Ring.make)


class Ring:
    def __init__(self, comm, mpi):
        self.comm = comm
        self.mpi = mpi            # a private duplicate of the group's communicator
        self.starts = _node.Starts("ring", comm, self._race_pair, MODE == "force", MIN_BYTES,
                                   LADDER)

    def _race_pair(self, op: str, nbytes: int):
        """The ring's all_reduce and MPI's on NBYTES of scratch float32 (the start-up race)."""
        arr = np.full(nbytes // 4, 0.0, np.float32)      # touched: no page faults timed
        mpi = self.comm.mpi
        return lambda: self.all_reduce(arr), lambda: mpi.Allreduce(MPI.IN_PLACE, arr, MPI.SUM)

    @classmethod
    def make(cls, comm):
        from hpcddp.comm import startup
        nodes = comm.mpi.allgather(startup.get_topology().node)
        if MODE != "force" and len(set(nodes)) < 2:
            return None
        return cls(comm, comm.mpi.Dup())

    def all_reduce(self, arr: np.ndarray) -> None:
        """ARR (contiguous, 1-D) summed over the group's ranks, in place on every rank."""
        all_reduce(self.mpi, arr)


def all_reduce(mpi, arr: np.ndarray, chunk: int = CHUNK) -> None:
    """The ring over MPI communicator MPI: rank r ends with the sum of every rank's ARR.
    Block b (of N, rank order) is finished by rank b-1 and then passed on, so every rank
    holds the same bits."""
    r, n = mpi.Get_rank(), mpi.Get_size()
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    edges = [arr.size * i // n for i in range(n + 1)]

    def block(i):
        i %= n
        return arr[edges[i]:edges[i + 1]]
    k = max(1, chunk // arr.itemsize)
    tmp = np.empty(max(edges[i + 1] - edges[i] for i in range(n)), dtype=arr.dtype)
    for s in range(n - 1):                       # reduce-scatter
        out, into = block(r - s), block(r - s - 1)
        starts = range(0, into.size, k)
        recvs = [mpi.Irecv(tmp[j:min(j + k, into.size)], left, _TAG_RS) for j in starts]
        sends = [mpi.Isend(out[j:j + k], right, _TAG_RS) for j in range(0, out.size, k)]
        for _ in recvs:                          # add each chunk as it arrives
            j = MPI.Request.Waitany(recvs) * k
            part = into[j:j + k]
            np.add(part, tmp[j:j + part.size], out=part)
        MPI.Request.Waitall(sends)
    for s in range(n - 1):                       # all-gather
        MPI.Request.Waitall([mpi.Irecv(block(r - s), left, _TAG_AG),
                             mpi.Isend(block(r + 1 - s), right, _TAG_AG)])
