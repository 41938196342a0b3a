"""Large all_reduce, reduce_scatter and all_gather across nodes: a pipelined ring, on TCP
links between neighbours.

Open MPI's MPI_Allreduce over TCP is bimodal from run to run on a shaped 1 Gbit/s link (16 MiB
at about 118 or 77-91 MB/s) and reaches about 0.6 of gloo's bus bandwidth at 4 nodes, while
its point-to-point is steady (8 MiB exchanges at 117-121 MB/s): docs/benchmarks.md. A ring
(reduce-scatter then all-gather, N-1 steps each, so each link carries 2(N-1)/N of the buffer,
the bound), each chunk added as it arrives, keeps the link busy. Its halves serve the other
two ops: reduce_scatter_tensor (Open MPI's Reduce_scatter_block over TCP reached 0.3-0.4 of
the link, 0.7-0.8 of gloo: docs/benchmarks.md) and all_gather_into_tensor; the hierarchical
path's step between nodes uses the same three.

What the ring's bytes travel on (HPCDDP_RING_TRANSPORT): by default hpcddp's own TCP
connections to the two neighbours (hpcddp.comm.links), one stream each way, each step sending
what the step before has reduced so far; the rank waits in the kernel, as gloo's do. Over
MPI's point-to-point (``mpi``: CHUNK-byte messages on a private duplicate of the group's
communicator) the rank polls while it waits and takes a whole core from the training step
beside it: DDP across 2 virtual nodes ran at 0.62 of gloo that way, 1.03 on the links.

Used for SUM (and AVG, PREMUL_SUM: scaled around it) of the dtypes numpy adds natively (the
gather: any dtype), in groups whose ranks span several nodes, each op from the size where a
race against the MPI row's call on the group's first such call finds it faster
(_node.crossover, 256 KiB to 8 MiB; over TCP links a tie within 5% goes to the ring, which
leaves the core free: _node.TIE); ``HPCDDP_RING``: 0, auto, force, which skips the race and
serves from MIN_BYTES. Its messages never meet the user's:
they go over its own connections (or its private communicator).
"""
from __future__ import annotations


import numpy as np

from hpcddp import settings
from hpcddp.collectives import _node
from hpcddp.comm import links
from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import free_mpi

MIN_BYTES = _node.LADDER[0]          # 256 KiB: where its races start
LADDER = tuple(n for n in _node.LADDER if MIN_BYTES <= n <= 8 << 20)
CHUNK = 1 << 20
# over TCP links a received chunk is added once this much of it has landed
ADD_CHUNK = 256 << 10
ADDABLE = frozenset(np.dtype(t) for t in ("float32", "float64", "int32", "int64"))
_TAG_RS, _TAG_AG = 1, 2
# the ops of the table served here -> the op its start-up race measures
RACED = {"all_reduce": "all_reduce", "reduce_scatter_tensor": "reduce_scatter",
         "all_gather_into_tensor": "all_gather"}



def adds(mop, arr) -> bool:
    """Whether the ring's reduce steps sum ARR with the MPI op MOP (a SUM of a dtype numpy
    adds natively)."""
    return mop == MPI.SUM and arr.dtype in ADDABLE


def usable(comm, nbytes: int, op: str, made=None):
    """COMM's ring where OP (a key of RACED; a reduction that :func:`adds`) of NBYTES (at
    least MIN_BYTES: the dispatch table's row tested it) should take it, else None (the same
    answer on every rank of COMM: the call's arguments agree, and the group's layout is found
    collectively on first use). MADE: the group's Ring where its row already knows it serves
    from the row's size (made and raced: call.group_rows), else None (made and raced here, on
    the op's first call)."""
    if comm.size < 2:
        return None
    if made is not None:            # the group's rows leave the path out where switched off
        return made
    if _node.switch("ring") == "0":
        return None
    found = ring(comm)
    return found if _node.serves(found, RACED[op], nbytes) else None


def ring(comm):
    """COMM's ring, made on first use (collective), or None where the group is on one node."""
    return comm.attached("ring", Ring.make)


class Ring:
    def __init__(self, comm, via):
        self.comm = comm
        self.via = via            # TCP links, or a private duplicate of the group's communicator
        self.scratch = _node.Scratch()
        # over TCP links a tie with MPI goes to the ring: its wait leaves the core to the caller
        win = _node.TIE if isinstance(via, links.Links) else _node.WIN
        self.starts = _node.Starts("ring", comm, self._race_pair, _node.switch("ring") == "force",
                                   MIN_BYTES,
                                   LADDER, win)

    @property
    def transport(self) -> str:
        """What the ring sends on, in words (hpcddp info)."""
        if isinstance(self.via, links.Links):
            return "on TCP links"
        wanted = settings.get().ring_transport == "tcp"
        return "on MPI point-to-point" + \
            (" (TCP links could not be made on every rank)" if wanted else
             " (HPCDDP_RING_TRANSPORT=mpi)")

    def _race_pair(self, op: str, nbytes: int):
        """The ring's OP and MPI's, as the MPI row calls it, on NBYTES of scratch float32
        (the start-up race)."""
        mpi, n = self.comm.mpi, self.comm.size
        arr = np.full(nbytes // 4 // n * n, 0.0, np.float32)   # touched: no page faults timed
        if op == "all_reduce":
            return (lambda: self.all_reduce(arr),
                    lambda: mpi.Allreduce(MPI.IN_PLACE, arr, MPI.SUM))
        out = np.full(arr.size // n, 0.0, np.float32)
        if op == "reduce_scatter":
            return (lambda: self.reduce_scatter(arr, out),
                    lambda: mpi.Reduce_scatter_block(arr, out, MPI.SUM))
        return lambda: self.all_gather(out, arr), lambda: mpi.Allgather(out, arr)

    @classmethod
    def make(cls, comm):
        from hpcddp.comm import startup
        nodes = comm.mpi.allgather(startup.get_topology().node)
        if _node.switch("ring") != "force" and len(set(nodes)) < 2:
            return None
        return cls(comm, connect(comm.mpi.Dup()))

    def all_reduce(self, arr: np.ndarray) -> None:
        """ARR (contiguous, 1-D) summed over the group's ranks, in place on every rank."""
        all_reduce(self.via, arr, self.scratch)

    def reduce_scatter(self, inp: np.ndarray, out: np.ndarray) -> None:
        """The sum over the group's ranks of INP's block r (of OUT's size) in OUT on rank r."""
        reduce_scatter(self.via, inp, out, self.scratch)

    def all_gather(self, inp: np.ndarray, out: np.ndarray) -> None:
        """Every rank's INP, in rank order, in OUT."""
        all_gather(self.via, inp, out)

    def close(self) -> None:
        close(self.via)


def connect(private):
    """What a ring over PRIVATE (a duplicate of the group's communicator, collective) sends
    on: TCP links between neighbours (HPCDDP_RING_TRANSPORT=tcp, where every rank made its
    links), else PRIVATE itself (MPI's point-to-point)."""
    tcp = settings.get().ring_transport == "tcp"
    if private.allreduce(int(tcp), op=MPI.MIN):   # every rank, or none
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


def all_reduce(via, arr: np.ndarray, scratch=_node.FRESH) -> None:
    """The ring over VIA (Links, or an MPI communicator): rank r ends with the sum of every
    rank's ARR. Block b (of N, rank order) is finished by rank b-1 and then passed on, so
    every rank holds the same bits. SCRATCH: where its buffers come from (_node.Scratch)."""
    r, n = _rank_size(via)
    if n == 1:
        return
    block = _blocks(arr, n)
    scatter = [block[(r - t - 1) % n] for t in range(n - 1)]      # summed in place
    gather = [block[(r - s) % n] for s in range(n - 1)]
    _pass(via, block[r], scatter + gather, scatter + [None] * (n - 1), scratch)


def reduce_scatter(via, inp: np.ndarray, out: np.ndarray, scratch=_node.FRESH) -> None:
    """The reduce-scatter half of the ring: rank r ends with the sum of every rank's block r
    of INP (N blocks of OUT's size) in OUT; INP is left as it was. Block b is summed from
    rank b+1 on, round the ring."""
    r, n = _rank_size(via)
    block = _blocks(inp, n)
    if n == 1:
        out[...] = block[0]
        return
    work = scratch.get("partial", out.size * (n - 2), out.dtype)   # the sums passed on
    partial = [work[out.size * t:out.size * (t + 1)] for t in range(n - 2)] + [out]
    _pass(via, block[(r - 1) % n], partial, [block[(r - t - 2) % n] for t in range(n - 1)],
          scratch)


def all_gather(via, inp: np.ndarray, out: np.ndarray) -> None:
    """The all-gather half of the ring: every rank's INP, in rank order, in OUT (N blocks of
    INP's size)."""
    r, n = _rank_size(via)
    block = _blocks(out, n)
    block[r][...] = inp
    if n > 1:
        _pass(via, inp, [block[(r - s - 1) % n] for s in range(n - 1)], [None] * (n - 1),
              _node.FRESH)


def _rank_size(via) -> tuple:
    return (via.rank, via.size) if isinstance(via, links.Links) else \
        (via.Get_rank(), via.Get_size())


def _blocks(arr: np.ndarray, n: int):
    edges = [arr.size * i // n for i in range(n + 1)]
    return [arr[edges[i]:edges[i + 1]] for i in range(n)]


def _pass(via, first, into, own, scratch) -> None:
    """The ring's steps, one stream each way: step 0 sends FIRST to the right neighbour, step
    t > 0 what step t-1 made (INTO[t-1]); step t takes the left neighbour's block into
    INTO[t], where OWN[t] is not None as the sum of OWN[t] and what arrived (a reduce step),
    else as it arrived (a gather step). A reduce step receives into SCRATCH's buffer."""
    tmp = scratch.get("received", max((b.size for b, o in zip(into, own) if o is not None),
                                      default=0), first.dtype)
    if isinstance(via, links.Links):
        _over_links(via, first, into, own, tmp)
    else:
        _over_mpi(via, first, into, own, tmp)


def _over_links(via: links.Links, first, into, own, tmp) -> None:
    """Step t sends what step t-1 has made so far (the link never waits for a whole block);
    each received chunk of a reduce step is added as it lands."""
    steps = range(len(into))
    sends = [first] + into[:-1]
    recvs = [links.as_bytes(tmp[:into[t].size] if own[t] is not None else into[t])
             for t in steps]
    done = [0] * len(into)                # bytes of each step's block made (summed or landed)
    item, k = first.itemsize, max(1, ADD_CHUNK // first.itemsize)

    def received(t, nbytes):
        if own[t] is None:
            done[t] = nbytes
            return
        have, added = nbytes // item, done[t] // item
        if have - added >= k or have == into[t].size:
            np.add(own[t][added:have], tmp[added:have], out=into[t][added:have])
            done[t] = have * item
    links.exchange(via, [links.as_bytes(b) for b in sends], recvs,
                   lambda t: done[t - 1] if t else sends[0].nbytes, received)


def _over_mpi(mpi, first, into, own, tmp, chunk: int = CHUNK) -> None:
    r, n = mpi.Get_rank(), mpi.Get_size()
    right, left = (r + 1) % n, (r - 1) % n
    k = max(1, chunk // first.itemsize)
    out = first
    for got, mine in zip(into, own):
        if mine is None:                         # a gather step
            MPI.Request.Waitall([mpi.Irecv(got, left, _TAG_AG), mpi.Isend(out, right, _TAG_AG)])
        else:                                    # a reduce step: each chunk added as it lands
            starts = range(0, got.size, k)
            recvs = [mpi.Irecv(tmp[j:min(j + k, got.size)], left, _TAG_RS) for j in starts]
            sends = [mpi.Isend(out[j:j + k], right, _TAG_RS) for j in range(0, out.size, k)]
            for _ in recvs:
                j = MPI.Request.Waitany(recvs) * k
                end = min(j + k, got.size)
                np.add(mine[j:end], tmp[j:end], out=got[j:end])
            MPI.Request.Waitall(sends)
        out = got
