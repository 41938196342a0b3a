"""Zero-copy list forms: all_gather, all_to_all and reduce_scatter on lists of separate tensors,
and gather and scatter on the root's list.

MPI's collectives take one contiguous buffer, so a list of separate tensors used to travel
through a flat copy (``torch.cat`` in, ``copy_`` out): one or two extra passes over S bytes,
which on a shared-memory node cost as much as the transfer itself (``hpcddp bench comm``:
list all_gather at 1 MiB was several times slower than the flat call). Here each block goes
straight from the sender's tensor into the receiver's tensor with point-to-point messages,
block j to/from rank j, which is the pairwise algorithm MPI libraries use for these ops on
few ranks; only a rank's own block is copied locally (as MPI_Allgather does too).

The messages travel on a private duplicate of the group's communicator (made on first use,
collectively, by every member: the choice below depends only on the group size), so they can
never match a user's send/recv. Up to ``HPCDDP_LIST_P2P_MAX_RANKS`` ranks (default 8) this
path is used; above, each rank would post 2(n-1) messages per op and the flat collective
(ring/recursive algorithms) wins, so the flat path stays.
"""
from __future__ import annotations

from array import array

import numpy as np
import torch
import torch.distributed as dist

from hpcddp import settings
from hpcddp.collectives import _large
from hpcddp.collectives import _plans
from hpcddp.collectives._common import as_array, wait_or_work
from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import duplicate

TAG = 7
SEQUENCES = (list, tuple)   # what a tensor list may be (hot-path test: type(x) in SEQUENCES)
_MAX_RANKS = settings.get().list_p2p_max_ranks
_RedOpType = dist.ReduceOp.RedOpType


def use_p2p(comm, block: int = 0) -> bool:
    """Same answer on every member: depends on the group size and on BLOCK, the element count
    of one block where every rank's is the same (all_gather, reduce_scatter). A block over
    MPI's count limit takes the flat path, which pieces it or refuses it clearly."""
    return 1 < comm.size <= _MAX_RANKS and block <= _large.MAX_COUNT


def side_comm(comm):
    """The group's private duplicate for list-form messages (collective on first use)."""
    return comm.attached("lists", duplicate)


def _exchange(side, r: int, n: int, sends, recvs, async_op: bool):
    """Block (r+k)%n of SENDS to rank r+k and block (r-k)%n of RECVS from rank r-k, k = 1..n-1.

    Blocking: n-1 Sendrecv steps (the pairwise exchange; ~1.2 us a step cheaper than two
    requests and a Waitall, measured). async_op: the requests, all posted at once, for a Work.
    A rank's Sendrecv matches a peer's Isend/Irecv, so blocking and async calls still mix
    across ranks, which torch code does (Join)."""
    if not async_op:
        for k in range(1, n):
            src, dst = (r - k) % n, (r + k) % n
            side.Sendrecv(sends[dst], dst, TAG, recvs[src], src, TAG)
        return []
    reqs = []
    for k in range(1, n):
        src, dst = (r - k) % n, (r + k) % n
        reqs.append(side.Irecv(recvs[src], src, TAG))
        reqs.append(side.Isend(sends[dst], dst, TAG))
    return reqs


def plan(kind: int, c) -> None:
    """Plan the blocking call C of KIND (_plans.ALL_GATHER or ALL_TO_ALL) that ran its
    exchange: ``c.exchange`` is (OWN, the (destination, source) views of the own block's
    copy or None; SENDS and RECVS, the views to and from each rank, as _exchange takes
    them)."""
    comm = c.comm
    own, sends, recvs = c.exchange
    side = side_comm(comm)
    r, n = comm.rank, comm.size

    def run():
        if own is not None:
            np.copyto(*own)
        _exchange(side, r, n, sends, recvs, False)
    datatype = _plans.datatype_handle(recvs[r])
    prog = None
    if datatype is not None:
        table = ([own[0].ctypes.data, own[1].ctypes.data, own[0].nbytes] if own is not None
                 else [0, 0, 0])
        for k in range(1, n):
            src, dst = (r - k) % n, (r + k) % n
            table += [sends[dst].ctypes.data, sends[dst].size, dst,
                      recvs[src].ctypes.data, recvs[src].size, src]
        prog = (_plans.SENDRECV, MPI._handleof(side), datatype, array("q", table).tobytes(), TAG)
    ref = c.tensor if kind == _plans.ALL_GATHER else c.input[0]
    _plans.make_xplan(kind, c.memo, c.group, comm, c.name, ref.shape, ref.dtype, run, prog)


def plan_rooted(kind: int, c) -> None:
    """Plan the blocking gather or scatter C (KIND _plans.GATHER or SCATTER) that ran here:
    the root's copy of its own block, then one step per other rank that receives (gather) or
    sends (scatter) its block, straight into or from its tensor of the list; another rank's
    one step sends (gather) or receives (scatter) its tensor. The C program is SENDRECV's,
    with MPI_PROC_NULL on the side a step leaves empty."""
    comm, root, arr = c.comm, c.root, c.arr
    side, r = side_comm(comm), comm.rank
    gather_ = kind == _plans.GATHER
    if arr.size > _large.MAX_COUNT:
        return
    if r == root:
        views = c.views
        own = None
        if c.tensors[r].data_ptr() != c.tensor.data_ptr():
            own = (views[r], arr) if gather_ else (arr, views[r])
        steps = [(j, views[j]) for j in range(comm.size) if j != r]

        def run():
            if own is not None:
                np.copyto(*own)
            for j, v in steps:
                (side.Recv if gather_ else side.Send)(v, j, TAG)
        table = [own[0].ctypes.data, own[1].ctypes.data, own[0].nbytes] if own else [0, 0, 0]
        null = MPI.PROC_NULL
        for j, v in steps:
            table += ([0, 0, null, v.ctypes.data, v.size, j] if gather_ else
                      [v.ctypes.data, v.size, j, 0, 0, null])
    else:
        def run():
            (side.Send if gather_ else side.Recv)(arr, root, TAG)
        table = [0, 0, 0] + ([arr.ctypes.data, arr.size, root, 0, 0, MPI.PROC_NULL] if gather_
                             else [0, 0, MPI.PROC_NULL, arr.ctypes.data, arr.size, root])
    datatype = _plans.datatype_handle(arr)
    prog = None if datatype is None else (_plans.SENDRECV, MPI._handleof(side), datatype,
                                          array("q", table).tobytes(), TAG)
    _plans.make_xplan(kind, c.memo, c.group, comm, c.name, c.shape, c.dtype, run, prog,
                      root=root)


def all_gather(c):
    """all_gather Call C, validated: n tensors (``views``: their as_array views), tensor's
    dtype, tensor's element count; ``arr`` is tensor's view."""
    tensor, tensor_list, views, send, comm = c.tensor, c.tensors, c.views, c.arr, c.comm
    side = side_comm(comm)
    r, n = comm.rank, comm.size
    own = (views[r], send) if tensor_list[r].data_ptr() != tensor.data_ptr() else None
    if own is not None:
        np.copyto(*own)   # numpy's copy has a fraction of torch's copy_ fixed cost
    sends = [send] * n
    c.exchange = (own, sends, views)
    return wait_or_work(c, _exchange(side, r, n, sends, views, c.async_op))


def all_to_all(c):
    """all_to_all Call C, validated: n tensors in each list (``out``, ``inp``: their views),
    one dtype. Block sizes are the caller's contract with its peers (a mismatch fails in MPI
    as a truncated message)."""
    output_tensor_list, input_tensor_list, outs, ins, comm = (c.output, c.input, c.out, c.inp,
                                                              c.comm)
    r, n = comm.rank, comm.size
    biggest = max(a.size for a in (*outs, *ins))
    if biggest > _large.MAX_COUNT:   # one message per block: only a block can be too big
        _large.refuse("all_to_all", "input_tensor_list/output_tensor_list", biggest)
    own = ((outs[r], ins[r]) if output_tensor_list[r].data_ptr() != input_tensor_list[r].data_ptr()
           else None)
    if own is not None:
        np.copyto(*own)
    c.exchange = (own, list(ins), list(outs))
    return wait_or_work(c, _exchange(side_comm(comm), r, n, ins, outs, c.async_op))


def gather(c):
    """gather Call C, validated (on the root, ``views``: the gather_list tensors' views): the
    root receives each rank's tensor straight into its tensor of the list (the flat
    MPI_Gather needs a buffer of all of them and a copy out of it: 1.7-5x raw MPI's time from
    64 KiB, docs/benchmarks.md); the others send theirs."""
    comm, root = c.comm, c.root
    side, r = side_comm(comm), comm.rank
    if r != root:
        return _send_or_work(c, side, c.arr, root)
    views = c.views
    if c.tensors[r].data_ptr() != c.tensor.data_ptr():
        np.copyto(views[r], c.arr)
    return wait_or_work(c, [side.Irecv(views[j], j, TAG) for j in range(comm.size) if j != r])


def scatter(c):
    """scatter Call C, validated (on the root, ``views``: the scatter_list tensors' views):
    the root sends each tensor of its list straight to its rank; the others receive theirs
    into their tensor."""
    comm, root = c.comm, c.root
    side, r = side_comm(comm), comm.rank
    if r != root:
        if c.async_op:
            return wait_or_work(c, [side.Irecv(c.arr, root, TAG)])
        side.Recv(c.arr, root, TAG)
        return None
    views = c.views
    if c.tensors[r].data_ptr() != c.tensor.data_ptr():
        np.copyto(c.arr, views[r])
    # keep: the views do not own the list's memory, and torch hands in a list of its own
    return wait_or_work(c, [side.Isend(views[j], j, TAG) for j in range(comm.size) if j != r],
                        keep=list(c.tensors))


def _send_or_work(c, side, arr, dst):
    if c.async_op:        # keep: ARR does not own its memory, and the Work returns nothing
        return wait_or_work(c, [side.Isend(arr, dst, TAG)], keep=c.tensor)
    side.Send(arr, dst, TAG)
    return None


# the SUM family: take() scales a PREMUL_SUM's inputs before and divides an AVG's result after
_SUMMED = (_RedOpType.SUM, _RedOpType.AVG, _RedOpType.PREMUL_SUM)
_scratch: dict = {}   # (elements, dtype) -> up to two free receive buffers


def reduce_scatter_supported(kind, dtype) -> bool:
    """The SUM family on numeric (non-bool) tensors; other ops keep the flat MPI reduction."""
    return kind in _SUMMED and dtype != torch.bool


def reduce_scatter(call):
    """reduce_scatter CALL (a SUM: take() scales around it): rank r receives every peer's
    input_list[r] into scratch and adds it to its own block, zero-copy from the inputs.

    The sum runs in rank order (x_0 + x_1 + ... as MPI's reduction does for few ranks)."""
    output, input_list, comm = call.tensor, call.tensors, call.comm
    side = side_comm(comm)
    r, n = comm.rank, comm.size
    c = output.numel()
    # reuse receive buffers: a fresh multi-MiB torch.empty costs page faults on every call
    # (~15 % of a 25 MiB reduce_scatter here); an op in flight owns its buffer until finish
    free = _scratch.setdefault(((n - 1) * c, output.dtype), [])
    scratch = free.pop() if free else torch.empty((n - 1) * c, dtype=output.dtype)
    recv = {}
    reqs = []
    for k in range(1, n):
        src, dst = (r - k) % n, (r + k) % n
        buf = scratch[(k - 1) * c:k * c]
        recv[src] = buf
        reqs.append(side.Irecv(as_array(buf), src, TAG))
        reqs.append(side.Isend(as_array(input_list[dst]), dst, TAG))
    def finish():
        out = output.view(-1)
        first = True
        for j in range(n):
            part = input_list[j].view(-1) if j == r else recv[j]
            if first:
                out.copy_(part)
                first = False
            else:
                out.add_(part)
        recv.clear()
        if len(free) < 2:
            free.append(scratch)
    return wait_or_work(call, reqs, finish, keep=(scratch, recv))
