"""The MPI path: every op as the MPI call of its name, the last row of every op's table row
list (it always applies).

Counts over MPI's int limit (2^31-1 elements) are this path's own business: the calls that
MPI refuses travel in pieces (hpcddp.collectives._large), found only when MPI refuses one, so
they cost nothing until then. The planners (``plan_<op>``) file what MPI ran for the
plan-hit rows (hpcddp.collectives._plans) to replay, where take's memo says (the second call
in a row on the same tensors).

Each method takes a validated :class:`~hpcddp.collectives.call.Call` and returns None
once the op is complete (``take`` ends its record and answers) or, for an ``async_op`` call
left in flight, the Work that completes it.
"""
from __future__ import annotations

from array import array

import torch

from hpcddp.collectives import _large, _plans
from hpcddp.collectives._common import (IN_PLACE, as_array, finish_or_work, record_end,
                                        record_p2p, wait_or_work)
from hpcddp.collectives._plans import (ALL_GATHER_TENSOR, REDUCE_SCATTER_LIST,
                                       REDUCE_SCATTER_TENSOR)
from hpcddp.collectives.work import RecvWork, check_count, truncation
from hpcddp.comm._mpi import MPI
from hpcddp.diagnostics.mismatch import AGREE_BYTES


def scatter_copy(flat: torch.Tensor, outputs) -> None:
    """FLAT's consecutive blocks into the tensors OUTPUTS."""
    off = 0
    for t in outputs:
        n = t.numel()
        t.view(-1).copy_(flat[off:off + n])
        off += n


class MPIPath:
    """Every op through MPI; the calls MPI refuses for their counts in pieces."""
    name = "MPI"
    min_bytes = 0
    applies = None          # always: the last row of every op
    OPS = frozenset({"all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter",
                     "broadcast", "all_gather_into_tensor", "all_gather", "gather", "scatter",
                     "all_to_all_single", "all_to_all", "isend", "send", "irecv", "recv"})

    @staticmethod
    def state(comm, op) -> str:
        return "open"

    # -- reductions ------------------------------------------------------------------------

    @staticmethod
    def all_reduce(c):
        arr = c.arr
        # The blocking MPI call, with or without async_op: MPI never matches a blocking
        # collective on one rank with a non-blocking one on another, and torch code mixes
        # them for one all_reduce (Join: the joined ranks' plain call against the others'
        # async_op=True). Allreduce is also faster than Iallreduce+Wait (docs/benchmarks.md).
        try:
            c.comm.mpi.Allreduce(IN_PLACE, arr, c.mop)
        except _large.REFUSED:  # over MPI's count limit: pieces
            if not _large.too_big(arr):
                raise
            _large.allreduce_now(c.comm, arr, c.mop)

    @staticmethod
    def plan_all_reduce(c):         # a SUM (the op's memo); pieces are never planned
        if c.arr.size <= _large.MAX_COUNT:
            _plans.make_plan(c.tensor, c.group, c.comm, c.arr, c.mop)

    @staticmethod
    def reduce(c):
        # The blocking MPI call, with or without async_op, as all_reduce's: Open MPI's
        # Ireduce + wait took 1.5-4.7x Reduce's time from 64 KiB (docs/benchmarks.md,
        # "reduce on the blocking MPI call")
        arr, comm, mop, dst = c.arr, c.comm, c.mop, c.root
        root = comm.rank == dst
        try:
            if root:
                comm.mpi.Reduce(IN_PLACE, arr, mop, root=dst)
            else:
                comm.mpi.Reduce(arr, None, mop, root=dst)
        except _large.REFUSED:  # over MPI's count limit: pieces
            if not _large.too_big(arr):
                raise
            MPI.Request.Waitall(_large.reduce(comm, arr, mop, dst))

    @staticmethod
    def plan_reduce(c):             # a SUM (the op's memo); pieces are never planned
        if c.arr.size <= _large.MAX_COUNT:
            _plans.make_rplan(c.tensor, c.group, c.comm, c.arr, c.mop, c.root)

    @staticmethod
    def reduce_scatter_tensor(c):
        # The blocking MPI call, with or without async_op, as all_reduce's: Open MPI's
        # Ireduce_scatter_block + wait took 1.3-1.5x its time below 1 MiB on one node and 2x
        # at 64 KiB across nodes (docs/benchmarks.md, "reduce_scatter_tensor on the blocking call")
        c.comm.mpi.Reduce_scatter_block(c.inp, c.arr, c.mop)

    @staticmethod
    def plan_reduce_scatter_tensor(c):      # a blocking SUM (the op's memo)
        if c.nbytes < AGREE_BYTES and c.arr.size:   # larger: the full path agrees on it
            mpi, inp, out, mop = c.comm.mpi, c.inp, c.arr, c.mop
            datatype = _plans.datatype_handle(out)
            prog = None if datatype is None else (_plans.REDUCE_SCATTER, MPI._handleof(mpi),
                                                  datatype, out.size, MPI._handleof(mop))
            _plans.make_xplan(REDUCE_SCATTER_TENSOR, (c.tensor, c.input), c.group, c.comm,
                              "reduce_scatter", c.shape, c.dtype,
                              lambda: mpi.Reduce_scatter_block(inp, out, mop), prog)

    @staticmethod
    def reduce_scatter(c):
        c.input = (torch.cat([t.reshape(-1) for t in c.tensors]) if c.tensors
                   else c.tensor.new_empty(0))
        c.inp = as_array(c.input)
        return MPIPath.reduce_scatter_tensor(c)

    @staticmethod
    def plan_reduce_scatter(c):             # a blocking SUM of a list (the op's memo)
        if c.nbytes >= AGREE_BYTES or not c.arr.size \
                or not all(t.is_contiguous() for t in c.tensors):   # the hit copies by pointer
            return
        mpi, buf, inp, out, mop = c.comm.mpi, c.input, c.inp, c.arr, c.mop
        pairs = tuple(zip(buf.split(out.size), (t.view(-1) for t in c.tensors)))

        def run():                          # the call's cat, into this call's buffer
            for block, t in pairs:
                block.copy_(t)
            mpi.Reduce_scatter_block(inp, out, mop)
        datatype = _plans.datatype_handle(out)
        prog = None
        if datatype is not None:
            copies = [x for block, t in pairs
                      for x in (block.data_ptr(), t.data_ptr(), t.numel() * t.element_size())]
            prog = (_plans.REDUCE_SCATTER, MPI._handleof(mpi), datatype, out.size,
                    MPI._handleof(mop), array("q", copies).tobytes())
        _plans.make_xplan(REDUCE_SCATTER_LIST, c.memo, c.group, c.comm, "reduce_scatter",
                          c.shape, c.dtype, run, prog)

    # -- data movement ---------------------------------------------------------------------

    @staticmethod
    def broadcast(c):
        # The blocking MPI call, with or without async_op, as all_reduce's
        try:
            c.comm.mpi.Bcast(c.arr, root=c.root)
        except _large.REFUSED:  # over MPI's count limit: pieces
            if not _large.too_big(c.arr):
                raise
            _large.bcast_now(c.comm, c.arr, c.root)

    @staticmethod
    def plan_broadcast(c):          # calls of AGREE_BYTES or more (pieces too) are not planned
        _plans.make_bplan(c.tensor, c.group, c.comm, c.arr, c.root)

    @staticmethod
    def all_gather_into_tensor(c):
        if _large.too_big(c.out):  # over MPI's count limit: broadcasts in pieces
            return wait_or_work(c, _large.allgather(c.comm, c.inp, c.out))
        # The blocking MPI call, with or without async_op, as all_reduce's; and Open MPI's
        # blocking Allgather is faster than Iallgather + Wait at mid sizes (docs/benchmarks.md)
        c.comm.mpi.Allgather(c.inp, c.out)

    @staticmethod
    def plan_all_gather_into_tensor(c):     # a blocking call (the op's memo)
        if c.inp.size and not _large.too_big(c.out):
            mpi, inp, out = c.comm.mpi, c.inp, c.out
            datatype = _plans.datatype_handle(inp)
            prog = None if datatype is None else (_plans.ALLGATHER, MPI._handleof(mpi),
                                                  datatype, inp.size)
            _plans.make_xplan(ALL_GATHER_TENSOR, (c.output, c.input), c.group, c.comm,
                              "all_gather", c.input.shape, c.input.dtype,
                              lambda: mpi.Allgather(inp, out), prog)

    @staticmethod
    def all_gather(c):
        tensor, tensor_list = c.tensor, c.tensors
        flat = torch.empty(tensor.numel() * c.comm.size, dtype=tensor.dtype)
        reqs = (_large.allgather(c.comm, c.arr, as_array(flat)) if _large.too_big(flat)
                else [c.comm.mpi.Iallgather(c.arr, as_array(flat))])
        return wait_or_work(c, reqs, lambda: scatter_copy(flat, tensor_list), keep=flat)

    @staticmethod
    def gather(c):
        tensor, comm, dst = c.tensor, c.comm, c.root
        if comm.rank != dst:
            reqs = (_large.gather(comm, c.arr, None, dst) if _large.too_big(c.arr, comm.size)
                    else [comm.mpi.Igather(c.arr, None, root=dst)])
            return wait_or_work(c, reqs)
        gather_list = c.tensors
        flat = torch.empty(tensor.numel() * comm.size, dtype=tensor.dtype)
        reqs = (_large.gather(comm, c.arr, as_array(flat), dst) if _large.too_big(flat)
                else [comm.mpi.Igather(c.arr, as_array(flat), root=dst)])
        return wait_or_work(c, reqs, lambda: scatter_copy(flat, gather_list), keep=flat)

    @staticmethod
    def scatter(c):
        comm, src, arr = c.comm, c.root, c.arr
        if comm.rank != src:
            reqs = (_large.scatter(comm, None, arr, src) if _large.too_big(arr, comm.size)
                    else [comm.mpi.Iscatter(None, arr, root=src)])
            return wait_or_work(c, reqs)
        flat = torch.cat([t.reshape(-1) for t in c.tensors])
        reqs = (_large.scatter(comm, as_array(flat), arr, src) if _large.too_big(flat)
                else [comm.mpi.Iscatter(as_array(flat), arr, root=src)])
        return wait_or_work(c, reqs, keep=flat)

    @staticmethod
    def all_to_all_single(c):
        # MPI_Alltoallv on every rank, even splits or not: each rank knows only its own
        # splits, and MPI_Alltoall on a rank with even ones against MPI_Alltoallv on a peer
        # with uneven ones is erroneous MPI (Open MPI's happen to match; another MPI or
        # collective component need not). Its cost over Ialltoall is in docs/benchmarks.md.
        scounts, sdis, rcounts, rdis = c.layout
        req = c.comm.mpi.Ialltoallv([c.inp, (scounts, sdis)], [c.out, (rcounts, rdis)])
        return wait_or_work(c, [req])

    @staticmethod
    def plan_all_to_all_single(c):      # a blocking call of even blocks (the op's memo)
        mpi, inp, out = c.comm.mpi, c.inp, c.out
        counts, displs = c.layout[:2]   # the same both ways: even blocks
        spec = (counts, displs)

        def run():
            mpi.Ialltoallv([inp, spec], [out, spec]).Wait()
        datatype = _plans.datatype_handle(inp)
        prog = None if datatype is None else (
            _plans.ALLTOALLV, MPI._handleof(mpi), datatype,
            array("i", counts + displs + counts + displs).tobytes(), 0)
        _plans.make_xplan(_plans.A2A_SINGLE, (c.output, c.input), c.group, c.comm,
                          "all_to_all", c.input.shape, c.input.dtype, run, prog)

    @staticmethod
    def all_to_all(c):
        outputs, inputs = c.output, c.input
        n = c.comm.size
        flat_in = torch.cat([t.reshape(-1) for t in inputs])
        flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype)
        scounts = [t.numel() for t in inputs]
        rcounts = [t.numel() for t in outputs]
        sdis = [sum(scounts[:i]) for i in range(n)]
        rdis = [sum(rcounts[:i]) for i in range(n)]
        if max(flat_in.numel(), flat_out.numel()) > _large.MAX_COUNT:    # before any message
            record_end(c.entry)
            _large.refuse("all_to_all", "input_tensor_list/output_tensor_list",
                          max(flat_in.numel(), flat_out.numel()))
        req = c.comm.mpi.Ialltoallv([as_array(flat_in), (scounts, sdis)],
                                    [as_array(flat_out), (rcounts, rdis)])

        def finish():
            for t, off, k in zip(outputs, rdis, rcounts):
                t.view(-1).copy_(flat_out[off:off + k])
        return wait_or_work(c, [req], finish, keep=(flat_in, flat_out))

    # -- point-to-point: recorded here, under their own numbering (never agreed on) ---------

    @staticmethod
    def isend(c):
        tensor, comm, arr, dst, tag = c.tensor, c.comm, c.arr, c.root, c.tag
        entry = record_p2p(comm, "send", tensor.shape, tensor.dtype, dst)
        reqs = (_large.send(comm.mpi, arr, dst, tag) if _large.too_big(arr)
                else [comm.mpi.Isend(arr, dst, tag)])
        return finish_or_work(True, entry, reqs, [tensor])

    @staticmethod
    def send(c):
        tensor, comm, arr, dst, tag = c.tensor, c.comm, c.arr, c.root, c.tag
        entry = record_p2p(comm, "send", tensor.shape, tensor.dtype, dst)
        if _large.too_big(arr):
            _large.wait(_large.send(comm.mpi, arr, dst, tag))
        else:
            comm.mpi.Send(arr, dst, tag)
        record_end(entry)

    @staticmethod
    def irecv(c):
        tensor, comm, arr, src, tag = c.tensor, c.comm, c.arr, c.root, c.tag
        entry = record_p2p(comm, "recv", tensor.shape, tensor.dtype, src)
        source = MPI.ANY_SOURCE if src is None else src
        reqs = (_large.recv(comm.mpi, arr, source, tag) if _large.too_big(arr)
                else [comm.mpi.Irecv(arr, source, tag)])
        return RecvWork(reqs, tensor, arr, "irecv", tag, entry)

    @staticmethod
    def recv(c) -> int:
        tensor, comm, arr, src, tag = c.tensor, c.comm, c.arr, c.root, c.tag
        entry = record_p2p(comm, "recv", tensor.shape, tensor.dtype, src)
        source = MPI.ANY_SOURCE if src is None else src
        if _large.too_big(arr):
            if source == MPI.ANY_SOURCE:
                source = _large.probe_source(comm.mpi, tag)
            reqs = _large.recv(comm.mpi, arr, source, tag)
            statuses = [MPI.Status() for _ in reqs]
            try:
                MPI.Request.Waitall(reqs, statuses)
            except MPI.Exception as exc:
                truncation(exc, reqs, statuses)
        else:
            statuses = [MPI.Status()]
            try:
                comm.mpi.Recv(arr, source, tag, statuses[0])
            except MPI.Exception as exc:
                truncation(exc, None, statuses)
        record_end(entry)
        check_count("recv", tensor, statuses, arr.nbytes, tag)
        return statuses[0].Get_source()

    # where the C module runs point-to-point plans (make_pplan says), the call's tensor, peer,
    # tag and group are planned, sends and receives apart
    @staticmethod
    def plan_isend(c):
        _plans.make_pplan(False, c.tensor, c.group, c.comm, c.arr, c.root, c.tag)

    @staticmethod
    def plan_irecv(c):
        _plans.make_pplan(True, c.tensor, c.group, c.comm, c.arr, c.root, c.tag)

    plan_send, plan_recv = plan_isend, plan_irecv


MPI_PATH = MPIPath()
