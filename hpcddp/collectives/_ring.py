"""Large all_reduce across nodes: a pipelined ring, on TCP links between neighbours.

Open MPI's MPI_Allreduce over TCP is bimodal from run to run on a shaped 1 Gbit/s link (16 MiB
at about 118 or 77-91 MB/s) and reaches about 0.6 of gloo's bus bandwidth at 4 nodes, while
its point-to-point is steady (8 MiB exchanges at 117-121 MB/s): docs/benchmarks.md. A ring
(reduce-scatter then all-gather, N-1 steps each, so each link carries 2(N-1)/N of the buffer,
the bound), each chunk added as it arrives, keeps the link busy.

What the ring's bytes travel on (HPCDDP_RING_TRANSPORT): by default hpcddp's own TCP
connections to the two neighbours (hpcddp.comm.links), one stream each way, each step sending
what the step before has reduced so far; the rank waits in the kernel, as gloo's do. Over
MPI's point-to-point (``mpi``: CHUNK-byte messages on a private duplicate of the group's
communicator) the rank polls while it waits and takes a whole core from the training step
beside it: DDP across 2 virtual nodes ran at 0.62 of gloo that way, 1.03 on the links.

Used for SUM (and AVG, PREMUL_SUM: scaled around it) of the dtypes numpy adds natively, in
groups whose ranks span several nodes, from the size where a race against MPI's Allreduce on
the group's first such call finds it faster (_node.crossover, 1 to 8 MiB; over TCP links a tie
within 5% goes to the ring, which leaves the core free: _node.TIE); ``HPCDDP_RING``: 0, auto,
force, which skips the race and serves from MIN_BYTES. Its messages never meet the user's:
they go over its own connections (or its private communicator).
"""
from __future__ import annotations


import numpy as np

from hpcddp import settings
from hpcddp.collectives import _node
from hpcddp.comm import links
from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import free_mpi

MIN_BYTES = 1 << 20
LADDER = tuple(n for n in _node.LADDER if MIN_BYTES <= n <= 8 << 20)
CHUNK = 1 << 20
# over TCP links a received chunk is added once this much of it has landed
ADD_CHUNK = 256 << 10
MODE = settings.get().ring
TRANSPORT = settings.get().ring_transport
ADDABLE = frozenset(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))
_TAG_RS, _TAG_AG = 1, 2



def usable(comm, nbytes: int, arr, mop, made=None):
    """COMM's ring where an all_reduce of ARR (NBYTES, at least MIN_BYTES: the dispatch
    table's row tested it) with MPI op MOP should take it, else None (the same answer on
    every rank of COMM: the call's arguments agree, and the group's layout is found
    collectively on first use). MADE: the group's Ring where its row already knows it
    serves from the row's size (made and raced: call.group_rows), else None (made and raced
    here, on the op's first call)."""
    if MODE == "0" or comm.size < 2 or mop != MPI.SUM or arr.dtype not in ADDABLE:
        return None
    if made is not None:
        return made
    found = ring(comm)
    return found if _node.serves(found, "all_reduce", nbytes) else None


def ring(comm):
    """COMM's ring, made on first use (collective), or None where the group is on one node."""
    return comm.attached("ring", Ring.make)


class Ring:
    def __init__(self, comm, via):
        self.comm = comm
        self.via = via            # TCP links, or a private duplicate of the group's communicator
        # over TCP links a tie with MPI goes to the ring: its wait leaves the core to the caller
        win = _node.TIE if isinstance(via, links.Links) else _node.WIN
        self.starts = _node.Starts("ring", comm, self._race_pair, MODE == "force", MIN_BYTES,
                                   LADDER, win)

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
        return cls(comm, connect(comm.mpi.Dup()))

    def all_reduce(self, arr: np.ndarray) -> None:
        """ARR (contiguous, 1-D) summed over the group's ranks, in place on every rank."""
        all_reduce(self.via, arr)

    def close(self) -> None:
        close(self.via)


def connect(private):
    """What a ring over PRIVATE (a duplicate of the group's communicator, collective) sends
    on: TCP links between neighbours (HPCDDP_RING_TRANSPORT=tcp, where every rank made its
    links), else PRIVATE itself (MPI's point-to-point)."""
    if private.allreduce(int(TRANSPORT == "tcp"), op=MPI.MIN):   # every rank, or none
        made = links.Links.make(private)
        if made is not None:
            return made
    return private


def close(via) -> None:
    """End what :func:`connect` made: the links and their communicator, or the communicator."""
    if isinstance(via, links.Links):
        via.close()
        via = via.mpi
    free_mpi(via)


def all_reduce(via, arr: np.ndarray) -> None:
    """The ring over VIA (Links, or an MPI communicator): rank r ends with the sum of every
    rank's ARR. Block b (of N, rank order) is finished by rank b-1 and then passed on, so
    every rank holds the same bits."""
    if isinstance(via, links.Links):
        _over_links(via, arr)
    else:
        _over_mpi(via, arr)


def _blocks(arr: np.ndarray, n: int):
    edges = [arr.size * i // n for i in range(n + 1)]
    return [arr[edges[i]:edges[i + 1]] for i in range(n)]


def _over_links(via: links.Links, arr: np.ndarray) -> None:
    """Reduce-scatter then all-gather as one stream each way: step t sends the block step t-1
    received, as far as it is reduced (so the link never waits for a whole block), and each
    received chunk is added as it lands."""
    r, n = via.rank, via.size
    if n == 1:
        return
    block = _blocks(arr, n)
    scatter, gather = range(n - 1), range(n - 1)
    sends = [block[(r - t) % n] for t in scatter] + [block[(r + 1 - s) % n] for s in gather]
    into = [block[(r - t - 1) % n] for t in scatter] + [block[(r - s) % n] for s in gather]
    tmp = np.empty(max(b.size for b in block), dtype=arr.dtype)
    recvs = [links.as_bytes(tmp[:into[t].size]) for t in scatter] + \
            [links.as_bytes(into[t]) for t in range(n - 1, 2 * n - 2)]
    done = [0] * (2 * n - 2)              # bytes of each step's block reduced (or landed)
    item, k = arr.itemsize, max(1, ADD_CHUNK // arr.itemsize)

    def received(t, nbytes):
        if t >= n - 1:
            done[t] = nbytes
            return
        have, added = nbytes // item, done[t] // item
        if have - added >= k or have == into[t].size:
            part = into[t][added:have]
            np.add(part, tmp[added:have], out=part)
            done[t] = have * item
    links.exchange(via, [links.as_bytes(b) for b in sends], recvs,
                   lambda t: done[t - 1] if t else sends[0].nbytes, received)


def _over_mpi(mpi, arr: np.ndarray, chunk: int = CHUNK) -> None:
    r, n = mpi.Get_rank(), mpi.Get_size()
    if n == 1:
        return
    right, left = (r + 1) % n, (r - 1) % n
    blocks = _blocks(arr, n)

    def block(i):
        return blocks[i % n]
    k = max(1, chunk // arr.itemsize)
    tmp = np.empty(max(b.size for b in blocks), dtype=arr.dtype)
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
