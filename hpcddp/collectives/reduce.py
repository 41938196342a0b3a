"""Reductions: all_reduce, reduce, reduce_scatter, reduce_scatter_tensor.

Signatures and semantics follow torch.distributed. ``group`` is an hpcddp Communicator (None:
the world); with ``async_op=True`` a :class:`~hpcddp.collectives.work.Work` is returned,
otherwise None once the op is complete. All members of the group call each op.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcddp.collectives import _hier
from hpcddp.collectives import _large
from hpcddp.collectives import _shm
from hpcddp.collectives import _lists
from hpcddp.collectives._plans import hit as _plan_hit, make_plan
from hpcddp.collectives._common import (IN_PLACE, CompletedWork, as_array, check_list,
                                        finish_or_work, post_reduce, pre_reduce, record,
                                        record_end, reduce_op, resolve, same_spec)
from hpcddp.collectives import _device
from hpcddp.comm.buffers import DeviceTensor
from hpcddp.diagnostics import mismatch as _mismatch

SUM = dist.ReduceOp.SUM


def all_reduce(tensor, op=SUM, group=None, async_op=False):
    """Reduce TENSOR across the group with OP, in place on every rank.

    Rank r holds x_r before; every rank holds op(x_0, ..., x_{n-1}) after.
    """
    # hot path: SUM on a tensor reduced before (hpcddp.collectives._plans). Blocking whatever
    # async_op: see below.
    if (op is SUM or op == SUM) and _plan_hit(tensor, group):
        return None if not async_op else CompletedWork([tensor])
    comm = resolve(group, "all_reduce")
    try:
        arr = as_array(tensor, "all_reduce", "tensor")
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it)
        return _device.all_reduce(tensor, op, comm, async_op)
    mop, kind = reduce_op(op, tensor.dtype, "all_reduce")
    # recorded (and, if large, agreed on by every rank) before the arena is asked for: its
    # first use is collective, and the arguments that choose it are the ones agreed on
    entry = record(comm, "all_reduce", tensor.shape, tensor.dtype, red=kind)
    if _shm.usable(comm, arr.nbytes, tensor.dtype, kind):
        pre_reduce(tensor, op, kind)
        check = _mismatch.agreement(comm, entry, kind)
        if not _shm.arena(comm).all_reduce(tensor.view(-1), check):
            check.refuse(entry)
        post_reduce(tensor, kind, comm.size)
        record_end(entry)
        return CompletedWork([tensor]) if async_op else None
    if _hier.usable(comm, arr.nbytes) and not _large.too_big(arr):   # several nodes
        _hier.agree(comm, entry, kind)
        pre_reduce(tensor, op, kind)
        _hier.hier(comm).all_reduce(arr, mop)
        post_reduce(tensor, kind, comm.size)
        record_end(entry)
        return CompletedWork([tensor]) if async_op else None
    if kind == SUM_KIND and not _large.too_big(arr):   # == : torch hands out new enum objects
        make_plan(tensor, group, comm, arr, mop)
    if kind != SUM_KIND:
        pre_reduce(tensor, op, kind)
    # The blocking MPI call, with or without async_op: MPI never matches a blocking collective
    # on one rank with a non-blocking one on another, and torch code mixes them for one
    # all_reduce (Join: the joined ranks' plain call against the others' async_op=True).
    # Allreduce is also faster than Iallreduce+Wait (docs/benchmarks.md). async_op: a
    # completed Work.
    try:
        comm.mpi.Allreduce(IN_PLACE, arr, mop)
    except _large.REFUSED:  # over MPI's count limit: pieces (costs nothing until then)
        if not _large.too_big(arr):
            raise
        _large.allreduce_now(comm, arr, mop)
    if kind != SUM_KIND:
        post_reduce(tensor, kind, comm.size)
    record_end(entry)
    if not async_op:
        return None
    return CompletedWork([tensor])


SUM_KIND = dist.ReduceOp.RedOpType.SUM


def reduce(tensor, dst, op=SUM, group=None, async_op=False):
    """Reduce TENSOR across the group onto group rank DST (in place there).

    Rank DST holds op(x_0, ..., x_{n-1}) after; the other ranks' tensors are left as they were.
    """
    comm = resolve(group, "reduce")
    comm.check_rank(dst, "reduce", "dst")
    try:
        arr = as_array(tensor, "reduce", "tensor")
    except DeviceTensor:
        return _device.reduce(tensor, dst, op, comm, async_op)
    mop, kind = reduce_op(op, tensor.dtype, "reduce")
    entry = record(comm, "reduce", tensor.shape, tensor.dtype, dst, red=kind)
    root = comm.rank == dst
    big = _large.too_big(arr)
    if root:
        pre_reduce(tensor, op, kind)
        reqs = (_large.reduce(comm, arr, mop, dst) if big
                else [comm.mpi.Ireduce(IN_PLACE, arr, mop, root=dst)])
    else:
        send = tensor.clone() if kind == dist.ReduceOp.RedOpType.PREMUL_SUM else tensor
        pre_reduce(send, op, kind)
        reqs = (_large.reduce(comm, as_array(send), mop, dst) if big
                else [comm.mpi.Ireduce(as_array(send), None, mop, root=dst)])
        if send is not tensor:
            return finish_or_work(async_op, entry, reqs, [tensor], keep=send)
    finish = (lambda: post_reduce(tensor, kind, comm.size)) if root else None
    return finish_or_work(async_op, entry, reqs, [tensor], finish)


def reduce_scatter_tensor(output, input, op=SUM, group=None, async_op=False):
    """Reduce INPUT (n equal blocks, one per rank) across the group; rank r gets block r.

    input: n * output.numel() elements on every rank. Rank r holds op over ranks of input's
    r-th block in OUTPUT after.
    """
    comm = resolve(group, "reduce_scatter_tensor")
    try:
        out = as_array(output, "reduce_scatter_tensor", "output")
        inp = as_array(input, "reduce_scatter_tensor", "input")
    except DeviceTensor:
        return _device.reduce_scatter_tensor(output, input, op, comm, async_op)
    if input.dtype != output.dtype:
        raise TypeError(f"reduce_scatter_tensor: input has dtype {input.dtype}, expected "
                        f"{output.dtype} (output's)")
    if input.numel() != output.numel() * comm.size:
        raise ValueError(f"reduce_scatter_tensor: input has {input.numel()} elements, expected "
                         f"{output.numel() * comm.size} (output's {output.numel()} x group size "
                         f"{comm.size})")
    if _large.too_big(inp):
        _large.refuse("reduce_scatter_tensor", "input", input.numel())
    mop, kind = reduce_op(op, output.dtype, "reduce_scatter_tensor")
    entry = record(comm, "reduce_scatter", output.shape, output.dtype, red=kind)  # agreed first
    if _shm.usable(comm, inp.nbytes, output.dtype, kind):
        flat = input.view(-1)
        c = output.numel()
        return _shm_reduce_scatter(output, [flat[j * c:(j + 1) * c] for j in range(comm.size)],
                                   op, kind, comm, async_op, entry)
    if _hier.usable(comm, inp.nbytes):   # several nodes
        _hier.agree(comm, entry, kind)
        if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
            input = input.clone()
            pre_reduce(input, op, kind)
            inp = as_array(input)
        _hier.hier(comm).reduce_scatter(inp, out, mop)
        post_reduce(output, kind, comm.size)
        record_end(entry)
        return CompletedWork([output]) if async_op else None
    return _reduce_scatter_mpi(output, input, inp, out, op, mop, kind, comm, async_op, entry)


def _reduce_scatter_mpi(output, input, inp, out, op, mop, kind, comm, async_op, entry):
    if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
        input = input.clone()
        pre_reduce(input, op, kind)
        inp = as_array(input)
    req = comm.mpi.Ireduce_scatter_block(inp, out, mop)
    return finish_or_work(async_op, entry, [req], [output],
                          lambda: post_reduce(output, kind, comm.size), keep=input)


def reduce_scatter(output, input_list, op=SUM, group=None, async_op=False):
    """Like reduce_scatter_tensor with INPUT_LIST[r] as block r (one tensor per rank)."""
    comm = resolve(group, "reduce_scatter")
    try:
        as_array(output, "reduce_scatter", "output")
    except DeviceTensor:
        return _device.reduce_scatter(output, input_list, op, comm, async_op)
    check_list(input_list, comm.size, "reduce_scatter", "input_list")
    same_spec(input_list, output, "reduce_scatter", "input_list")
    mop, kind = reduce_op(op, output.dtype, "reduce_scatter")  # a refused op names this function
    entry = record(comm, "reduce_scatter", output.shape, output.dtype, red=kind)  # agreed first
    if _shm.usable(comm, output.nbytes * comm.size, output.dtype, kind):
        return _shm_reduce_scatter(output, [t.view(-1) for t in input_list], op, kind, comm,
                                   async_op, entry)
    if _lists.use_p2p(comm, output.numel()):
        if _lists.reduce_scatter_supported(kind, output.dtype):  # zero-copy inputs
            return _lists.reduce_scatter(output, input_list, kind, comm, async_op, entry)
    flat = torch.cat([t.reshape(-1) for t in input_list]) if input_list else output.new_empty(0)
    return _reduce_scatter_mpi(output, flat, as_array(flat), as_array(output), op, mop, kind,
                               comm, async_op, entry)


def _shm_reduce_scatter(output, blocks, op, kind, comm, async_op, entry):
    """reduce_scatter through the node's shared-memory arena (hpcddp.collectives._shm)."""
    if kind == dist.ReduceOp.RedOpType.PREMUL_SUM:
        blocks = [b.clone() for b in blocks]
        for b in blocks:
            pre_reduce(b, op, kind)
    check = _mismatch.agreement(comm, entry, kind)
    if not _shm.arena(comm).reduce_scatter(blocks, output.view(-1), check):
        check.refuse(entry)
    post_reduce(output, kind, comm.size)
    record_end(entry)
    return CompletedWork([output]) if async_op else None
