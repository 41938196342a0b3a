"""Large all_reduce, reduce_scatter, all_gather and broadcast across nodes, hierarchically:
inside a node in shared memory, across nodes once per byte.

Why: MPI's flat algorithms treat the ranks of a node as strangers. A ring over node1, node1,
node2, node2 crosses between the nodes twice, each crossing carrying 2(P-1)/P of the buffer
(P ranks); recursive doubling sends the whole buffer across nodes from every rank. When the
network is the bottleneck, the bytes that cross it set the time. NCCL, oneCCL and Open MPI's
coll/han split the work by node instead, as here (N nodes of L ranks, S bytes)::

    1. reduce_scatter inside the node (MPI on the node's communicator: shared memory):
       local rank l holds the node's sum of slice l (S / L)
    2. all_reduce slice l with local rank l of every other node (the "cross" communicator
       of local rank l): L streams at once, each node's link carries 2(N-1)/N x S in all.
       For a sum of the dtypes numpy adds, hpcddp's own ring over point-to-point
       (:mod:`hpcddp.collectives._ring`), as for one rank per node: Open MPI's Allreduce
       over TCP fills the link far less well (docs/benchmarks.md)
    3. all_gather inside the node (shared memory): every rank holds the whole sum

Every element is reduced in the same order on every rank (step 1's, then step 2's), so all
ranks end with the same bits. From 2 x PIPE_BYTES, where step 2 runs on hpcddp's ring over TCP
links, the three steps run on pieces of the buffer as a pipeline: a piece crosses the nodes
on the path's own thread while the node reduces the next one and gathers the one before, so
the link never waits for the node's shared-memory steps (docs/benchmarks.md, "The
hierarchical all_reduce in pieces"). The other ops follow the same split (the tensor forms:
reduce_scatter_tensor, all_gather_into_tensor):

- reduce_scatter: reduce_scatter inside the node, local rank l getting the node's sums of the
  blocks of every node's local rank l; then reduce_scatter of those among the nodes (for a
  sum numpy adds, the first half of hpcddp's ring).
- all_gather: all_gather among the nodes (each rank with its counterparts; hpcddp's ring's
  second half), then inside the node; one copy puts the blocks in rank order.
- broadcast: the root's counterparts receive it across nodes, then each node's copy is
  broadcast inside the node. Used for groups that span several nodes with the same number
(>= 2) of ranks on each, from MIN_BYTES, for the reduce ops MPI has (AVG and PREMUL_SUM run
as SUM, scaled around it as on every path), each op from the size where a race against
MPI's own op, on the op's first call from MIN_BYTES, finds it faster (_node.crossover, up to
8 MiB: every size is a round trip across the network). ``HPCDDP_HIER=0`` turns it off,
``force`` skips the race and serves from MIN_BYTES, ``auto`` (the default) races
(docs/multinode-testing.md has the measurements).
"""
from __future__ import annotations


from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hpcddp.collectives import _node, _ring
from hpcddp.comm import links
from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import free_mpi
from hpcddp.diagnostics import mismatch as _mismatch

MIN_BYTES = _node.LADDER[0]
LADDER = tuple(n for n in _node.LADDER if n <= 8 << 20)
# a large all_reduce on links runs as a pipeline of pieces of about this size, at most
# MAX_PIECES (docs/benchmarks.md, "The hierarchical all_reduce in pieces")
PIPE_BYTES = 4 << 20
MAX_PIECES = 8
# the ops of the table served here -> the op its race measures
RACED = {"all_reduce": "all_reduce", "broadcast": "broadcast",
         "reduce_scatter_tensor": "reduce_scatter", "all_gather_into_tensor": "all_gather"}



def usable(comm, nbytes: int, op: str = "all_reduce", made=None):
    """COMM's node layout where OP (a key of RACED) of NBYTES (at least MIN_BYTES: the
    dispatch table's row tested it) should take this path, else None (the same answer on
    every rank of COMM). MADE: the group's Hier where its row already knows it serves from
    the row's size (made and raced: call.group_rows), else None (made and raced here, on the
    op's first call)."""
    if comm.size < 4:
        return None
    if made is not None:            # the group's rows leave the path out where switched off
        return made
    if _node.switch("hier") == "0":
        return None
    found = hier(comm)
    return found if _node.serves(found, RACED[op], nbytes) else None


def agree(comm, entry, red=None) -> None:
    """The call agreement (diagnostics.mismatch) where the op below AGREE_BYTES has not had it:
    these paths have no synchronisation of their own to carry the hash."""
    check = _mismatch.agreement(comm, entry, red)
    if check is not None:
        check.agree(entry)


def hier(comm):
    """COMM's node layout, made on first use (collective), or None where the group is on one
    node or its nodes hold different numbers of its ranks."""
    return comm.attached("hier", Hier.make)


class Hier:
    def __init__(self, comm, node, cross, where):
        self.comm = comm
        self.node = node          # mpi4py: the group's ranks on my node (rank: local index)
        self.cross = cross        # mpi4py: my counterparts on every node (rank: node index)
        # the ring's private duplicate of cross (its messages never meet cross's collectives)
        self.cross_ring = _ring.connect(cross.Dup()) if _node.switch("ring") != "0" else None
        self.where = where        # group rank -> (node index, local index)
        self.scratch = _node.Scratch()
        self.scratch_ring = _node.Scratch()     # the ring's own, on the crossing thread
        self._crossing_thread = None
        # the pieces cross on a thread of their own: their links' idle check asks MPI
        self.pipelines = isinstance(self.cross_ring, links.Links) and \
            MPI.Query_thread() == MPI.THREAD_MULTIPLE
        n_nodes = cross.Get_size()
        # blocks in (local index, node index) order -> rank order, and back
        self.to_ranks = np.array([l * n_nodes + k for k, l in where])
        self.from_ranks = np.argsort(self.to_ranks)
        self.starts = _node.Starts("hier", comm, self._race_pair, _node.switch("hier") == "force",
                                   MIN_BYTES,
                                   LADDER)

    @classmethod
    def make(cls, comm):
        from hpcddp.comm import startup
        mpi = comm.mpi
        # the job's nodes (real hosts, or emulated: HPCDDP_RANKS_PER_NODE), as topology found
        nodes = mpi.allgather(startup.get_topology().node)
        per_node: dict = {}
        for n in nodes:
            per_node[n] = per_node.get(n, 0) + 1
        sizes = set(per_node.values())
        if len(per_node) < 2 or len(sizes) != 1 or sizes.pop() < 2:
            return None
        index = {n: i for i, n in enumerate(sorted(per_node))}
        seen: dict = {}
        where = []                      # (node index, local index) of each group rank
        for n in nodes:
            where.append((index[n], seen.get(n, 0)))
            seen[n] = seen.get(n, 0) + 1
        k, l = where[comm.rank]
        node = mpi.Split(color=k, key=comm.rank)
        cross = mpi.Split(color=l, key=k)
        return cls(comm, node, cross, where)

    def close(self) -> None:
        """Free the node and cross communicators and close the ring between nodes."""
        if self._crossing_thread is not None:
            self._crossing_thread.shutdown(wait=True)
        if self.cross_ring is not None:
            _ring.close(self.cross_ring)
        free_mpi(self.node)
        free_mpi(self.cross)

    def _race_pair(self, op: str, nbytes: int):
        """This path's OP and MPI's on NBYTES of scratch float32 (the start-up race)."""
        mpi, n = self.comm.mpi, self.comm.size
        arr = np.full(nbytes // 4 // n * n, 0.0, np.float32)   # touched: no page faults timed
        if op == "all_reduce":
            return (lambda: self.all_reduce(arr, MPI.SUM),
                    lambda: mpi.Allreduce(MPI.IN_PLACE, arr, MPI.SUM))
        if op == "broadcast":
            return lambda: self.broadcast(arr, 0), lambda: mpi.Bcast(arr, root=0)
        out = np.full(arr.size // n, 0.0, np.float32)
        if op == "reduce_scatter":
            return (lambda: self.reduce_scatter(arr, out, MPI.SUM),
                    lambda: mpi.Reduce_scatter_block(arr, out, MPI.SUM))
        return lambda: self.all_gather(out, arr), lambda: mpi.Allgather(out, arr)

    def all_reduce(self, arr: np.ndarray, op) -> None:
        """Reduce ARR (a contiguous 1-D view of the tensor) with the MPI op OP, in place.
        From 2 x PIPE_BYTES on links, as a pipeline of pieces (_all_reduce_pipelined)."""
        ring = self.cross_ring is not None and _ring.adds(op, arr)
        if ring and arr.nbytes >= 2 * PIPE_BYTES and self.pipelines:
            return self._all_reduce_pipelined(arr, op)
        piece = _Piece(self, arr, "part")
        piece.reduce_in_node(op)                       # 1.
        if ring:                                       # 2.
            _ring.all_reduce(self.cross_ring, piece.part, self.scratch)
        else:
            self.cross.Allreduce(MPI.IN_PLACE, piece.part, op)
        piece.gather_in_node()                         # 3.

    def _all_reduce_pipelined(self, arr: np.ndarray, op) -> None:
        """The three steps on pieces of about PIPE_BYTES, so that the link is never idle
        while the node reduces or gathers: piece k crosses the nodes (the ring, on this
        Hier's own thread) while this thread reduces piece k+1 inside the node, then
        gathers piece k inside the node while piece k+1 crosses. Each piece is summed in
        the same order on every rank (the same bits everywhere)."""
        count = max(2, min(MAX_PIECES, arr.nbytes // PIPE_BYTES))
        edges = [arr.size * i // count for i in range(count + 1)]
        crossing: list = []              # (piece, the ring's future), oldest first
        try:
            for k in range(count):
                piece = _Piece(self, arr[edges[k]:edges[k + 1]], f"part{k % 3}")
                piece.reduce_in_node(op)
                crossing.append((piece, self._crossing().submit(
                    _ring.all_reduce, self.cross_ring, piece.part, self.scratch_ring)))
                if len(crossing) == 2:
                    done, future = crossing.pop(0)
                    future.result()
                    done.gather_in_node()
            done, future = crossing.pop()
            future.result()
            done.gather_in_node()
        except BaseException:
            # the pieces still crossing end at once (their links close) before the caller
            # gets the error back and reuses the buffers
            if crossing:
                self.cross_ring.broken = self.cross_ring.broken or "an earlier piece failed"
                self.cross_ring.close()
                for _, future in crossing:
                    try:
                        future.result()
                    except BaseException:
                        pass
            raise

    def _crossing(self):
        """The thread that runs the ring's pieces between nodes, in order (made on first use)."""
        if self._crossing_thread is None:
            self._crossing_thread = ThreadPoolExecutor(1, thread_name_prefix="hpcddp-hier-ring")
        return self._crossing_thread

    def reduce_scatter(self, inp: np.ndarray, out: np.ndarray, op) -> None:
        """Rank r gets op over ranks of INP's r-th block (n blocks of OUT's size) in OUT."""
        c = out.size
        blocks = self.scratch.get("blocks", inp.size, inp.dtype)     # (local, node) order
        np.take(inp.reshape(-1, c), self.from_ranks, axis=0, out=blocks.reshape(-1, c))
        part = self.scratch.get("part", c * self.cross.Get_size(), out.dtype)
        self.node.Reduce_scatter_block(blocks, part, op)
        if self.cross_ring is not None and _ring.adds(op, part):
            _ring.reduce_scatter(self.cross_ring, part, out, self.scratch)
        else:
            self.cross.Reduce_scatter_block(part, out, op)

    def all_gather(self, inp: np.ndarray, out: np.ndarray) -> None:
        """Every rank's INP, in rank order, in OUT."""
        c = inp.size
        mine = self.scratch.get("part", c * self.cross.Get_size(), inp.dtype)
        if self.cross_ring is not None:
            _ring.all_gather(self.cross_ring, inp, mine)
        else:
            self.cross.Allgather(inp, mine)
        blocks = self.scratch.get("blocks", out.size, out.dtype)      # (local, node) order
        self.node.Allgather(mine, blocks)
        np.take(blocks.reshape(-1, c), self.to_ranks, axis=0, out=out.reshape(-1, c))

    def broadcast(self, arr: np.ndarray, root: int) -> None:
        """ARR from group rank ROOT to every rank."""
        k, l = self.where[root]
        if self.node.Get_rank() == l:
            self.cross.Bcast(arr, root=k)
        self.node.Bcast(arr, root=l)


class _Piece:
    """A contiguous piece of an all_reduce's buffer, split among the node's ranks: local rank
    l reduces and serves slice l. PART: this rank's slice of the node's sum (a kept buffer
    under KEY: MPI's reduce_scatter takes no IN_PLACE for a part of its own send buffer)."""
    def __init__(self, hier: Hier, arr: np.ndarray, key: str):
        L, me = hier.node.Get_size(), hier.node.Get_rank()
        self.node, self.arr = hier.node, arr
        bounds = [arr.size * j // L for j in range(L + 1)]
        self.counts = [bounds[j + 1] - bounds[j] for j in range(L)]
        self.displs = bounds[:-1]
        self.mine = arr[bounds[me]:bounds[me + 1]]
        self.part = hier.scratch.get(key, self.mine.size, arr.dtype)

    def reduce_in_node(self, op) -> None:
        self.node.Reduce_scatter(self.arr, self.part, self.counts, op)

    def gather_in_node(self) -> None:
        self.mine[...] = self.part
        self.node.Allgatherv(MPI.IN_PLACE, [self.arr, (self.counts, self.displs)])
