"""Reductions: all_reduce, reduce, reduce_scatter, reduce_scatter_tensor.

Signatures and semantics follow torch.distributed. ``group`` is an hpcddp Communicator (None:
the world); with ``async_op=True`` a :class:`~hpcddp.collectives.work.Work` is returned,
otherwise None once the op is complete. All members of the group call each op.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from hpcddp.collectives import _hier
from hpcddp.collectives import _ring
from hpcddp.collectives import _large
from hpcddp.collectives import _shm
from hpcddp.collectives import _lists
from hpcddp.collectives._plans import hit as _plan_hit, make_plan
from hpcddp.collectives._common import (IN_PLACE, CompletedWork, as_array, check_list,
                                        finish_or_work, post_reduce, pre_reduce,
                                        record_call, record_end, reduce_op, resolve,
                                        same_spec)
from hpcddp.collectives import _device
from hpcddp.collectives import engine as _engine
from hpcddp.collectives.paths import Call, route, take
from hpcddp.comm.buffers import DeviceTensor
from hpcddp.diagnostics import mismatch as _mismatch

SUM = dist.ReduceOp.SUM
SUM_KIND = dist.ReduceOp.RedOpType.SUM
PREMUL_KIND = dist.ReduceOp.RedOpType.PREMUL_SUM


def _reduction(fn: str, tensor, op, group, async_op, arg: str = "tensor") -> Call:
    """The Call of an op reducing TENSOR with OP (validated; CUDA tensors: ``device``)."""
    call = Call()
    call.comm, call.group, call.async_op = resolve(group, fn), group, async_op
    call.tensor, call.dtype, call.op = tensor, tensor.dtype, op
    try:
        call.arr = as_array(tensor, fn, arg)
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it): the device path checks
        call.device, call.nbytes = True, 0
    else:
        call.device, call.nbytes = False, call.arr.nbytes
    # the MPI op: on the device too, where a user-defined one (bfloat16) keeps it off the
    # CUDA-aware row
    call.mop, call.kind = reduce_op(op, tensor.dtype, fn)
    return call


# -- all_reduce --------------------------------------------------------------------------------

def all_reduce(tensor, op=SUM, group=None, async_op=False):
    """Reduce TENSOR across the group with OP, in place on every rank.

    Rank r holds x_r before; every rank holds op(x_0, ..., x_{n-1}) after.
    """
    # the plan-hit row (hpcddp.collectives._plans): SUM on a tensor reduced before. Blocking
    # whatever async_op (see _all_reduce_mpi), unless the async engine takes the call or
    # holds calls issued before it (hpcddp.collectives.engine)
    if (op is SUM or op == SUM) and not _engine.pending \
            and not (async_op and _engine.on()) and _plan_hit(tensor, group):
        return None if not async_op else CompletedWork([tensor])
    call = _reduction("all_reduce", tensor, op, group, async_op)
    if not call.device:
        # recorded (and, if large, agreed on by every rank) before the paths are asked: a
        # node-local path's first use is collective, and the arguments that choose it are the
        # ones agreed on
        record_call(call, "all_reduce", tensor.shape, tensor.dtype, red=call.kind)
    return take(_ALL_REDUCE, call)


def _all_reduce_device(c: Call, ctx):
    return _device.all_reduce(c.tensor, c.op, c.comm, c.async_op, ctx)


def _summed_in_place(c: Call, path_sum) -> CompletedWork | None:
    """What the node-local rows share: AVG/PREMUL_SUM's scaling around PATH_SUM() (the
    path's SUM of the tensor in place), the record's end, and the answer (blocking: None)."""
    pre_reduce(c.tensor, c.op, c.kind)
    path_sum()
    post_reduce(c.tensor, c.kind, c.comm.size)
    record_end(c.entry)
    return CompletedWork([c.tensor]) if c.async_op else None


def _all_reduce_arena(c: Call):
    def path_sum():
        check = _mismatch.agreement(c.comm, c.entry, c.kind)
        if not _shm.arena(c.comm).all_reduce(c.tensor.view(-1), check):
            check.refuse(c.entry)
    return _summed_in_place(c, path_sum)


def _all_reduce_hier(c: Call):
    _hier.agree(c.comm, c.entry, c.kind)
    return _summed_in_place(c, lambda: _hier.hier(c.comm).all_reduce(c.arr, c.mop))


def _all_reduce_ring(c: Call):
    _hier.agree(c.comm, c.entry, c.kind)
    return _summed_in_place(c, lambda: _ring.ring(c.comm).all_reduce(c.arr))


def _all_reduce_mpi(c: Call):
    tensor, arr, kind = c.tensor, c.arr, c.kind
    if kind == SUM_KIND and not _large.too_big(arr):   # == : torch hands out new enum objects
        make_plan(tensor, c.group, c.comm, arr, c.mop)
    else:
        pre_reduce(tensor, c.op, kind)
    # The blocking MPI call, with or without async_op: MPI never matches a blocking collective
    # on one rank with a non-blocking one on another, and torch code mixes them for one
    # all_reduce (Join: the joined ranks' plain call against the others' async_op=True).
    # Allreduce is also faster than Iallreduce+Wait (docs/benchmarks.md). async_op: a
    # completed Work.
    try:
        c.comm.mpi.Allreduce(IN_PLACE, arr, c.mop)
    except _large.REFUSED:  # over MPI's count limit: pieces (costs nothing until then)
        if not _large.too_big(arr):
            raise
        _large.allreduce_now(c.comm, arr, c.mop)
    if kind != SUM_KIND:
        post_reduce(tensor, kind, c.comm.size)
    record_end(c.entry)
    return CompletedWork([tensor]) if c.async_op else None


_ALL_REDUCE = route("all_reduce", device=_all_reduce_device, arena=_all_reduce_arena,
                    hier=_all_reduce_hier, ring=_all_reduce_ring, mpi=_all_reduce_mpi)


# -- reduce ------------------------------------------------------------------------------------

def reduce(tensor, dst, op=SUM, group=None, async_op=False):
    """Reduce TENSOR across the group onto group rank DST (in place there).

    Rank DST holds op(x_0, ..., x_{n-1}) after; the other ranks' tensors are left as they were.
    """
    call = _reduction("reduce", tensor, op, group, async_op)
    call.comm.check_rank(dst, "reduce", "dst")
    call.root = dst
    if not call.device:
        record_call(call, "reduce", tensor.shape, tensor.dtype, dst, red=call.kind)
    return take(_REDUCE, call)


def _reduce_device(c: Call, ctx):
    return _device.reduce(c.tensor, c.root, c.op, c.comm, c.async_op, ctx)


def _reduce_mpi(c: Call):
    tensor, comm, mop, kind, dst = c.tensor, c.comm, c.mop, c.kind, c.root
    big = _large.too_big(c.arr)
    if comm.rank == dst:
        pre_reduce(tensor, c.op, kind)
        reqs = (_large.reduce(comm, c.arr, mop, dst) if big
                else [comm.mpi.Ireduce(IN_PLACE, c.arr, mop, root=dst)])
        return finish_or_work(c.async_op, c.entry, reqs, [tensor],
                              lambda: post_reduce(tensor, kind, comm.size))
    send = tensor.clone() if kind == PREMUL_KIND else tensor
    pre_reduce(send, c.op, kind)
    reqs = (_large.reduce(comm, as_array(send), mop, dst) if big
            else [comm.mpi.Ireduce(as_array(send), None, mop, root=dst)])
    return finish_or_work(c.async_op, c.entry, reqs, [tensor],
                          keep=send if send is not tensor else None)


_REDUCE = route("reduce", device=_reduce_device, mpi=_reduce_mpi)


# -- reduce_scatter_tensor, reduce_scatter -----------------------------------------------------

def reduce_scatter_tensor(output, input, op=SUM, group=None, async_op=False):
    """Reduce INPUT (n equal blocks, one per rank) across the group; rank r gets block r.

    input: n * output.numel() elements on every rank. Rank r holds op over ranks of input's
    r-th block in OUTPUT after.
    """
    fn = "reduce_scatter_tensor"
    call = _reduction(fn, output, op, group, async_op, "output")
    call.input = input
    if not call.device:
        try:
            call.inp = as_array(input, fn, "input")
        except DeviceTensor:
            call.device = True
    if not call.device:
        comm, inp = call.comm, call.inp
        if input.dtype != output.dtype:
            raise TypeError(f"{fn}: input has dtype {input.dtype}, expected {output.dtype} "
                            f"(output's)")
        if input.numel() != output.numel() * comm.size:
            raise ValueError(f"{fn}: input has {input.numel()} elements, expected "
                             f"{output.numel() * comm.size} (output's {output.numel()} x group "
                             f"size {comm.size})")
        if _large.too_big(inp):
            _large.refuse(fn, "input", input.numel())
        call.nbytes = inp.nbytes            # the paths' thresholds are on the whole input
        record_call(call, "reduce_scatter", output.shape, output.dtype,
                    red=call.kind)  # agreed first
    return take(_REDUCE_SCATTER_TENSOR, call)


def _reduce_scatter_tensor_device(c: Call, ctx):
    return _device.reduce_scatter_tensor(c.tensor, c.input, c.op, c.comm, c.async_op, ctx)


def _reduce_scatter_tensor_arena(c: Call):
    flat, k = c.input.view(-1), c.tensor.numel()
    return _arena_reduce_scatter(c, [flat[j * k:(j + 1) * k] for j in range(c.comm.size)])


def _premultiplied(c: Call):
    """(input, its view): PREMUL_SUM scales a copy of the input, never the caller's."""
    if c.kind != PREMUL_KIND:
        return c.input, c.inp
    scaled = c.input.clone()
    pre_reduce(scaled, c.op, c.kind)
    return scaled, as_array(scaled)


def _reduce_scatter_tensor_hier(c: Call):
    _hier.agree(c.comm, c.entry, c.kind)
    _, inp = _premultiplied(c)
    _hier.hier(c.comm).reduce_scatter(inp, c.arr, c.mop)
    post_reduce(c.tensor, c.kind, c.comm.size)
    record_end(c.entry)
    return CompletedWork([c.tensor]) if c.async_op else None


def _reduce_scatter_tensor_mpi(c: Call):
    input, inp = _premultiplied(c)
    req = c.comm.mpi.Ireduce_scatter_block(inp, c.arr, c.mop)
    output, kind, size = c.tensor, c.kind, c.comm.size
    return finish_or_work(c.async_op, c.entry, [req], [output],
                          lambda: post_reduce(output, kind, size), keep=input)


_REDUCE_SCATTER_TENSOR = route("reduce_scatter_tensor", device=_reduce_scatter_tensor_device,
                               arena=_reduce_scatter_tensor_arena,
                               hier=_reduce_scatter_tensor_hier, mpi=_reduce_scatter_tensor_mpi)


def reduce_scatter(output, input_list, op=SUM, group=None, async_op=False):
    """Like reduce_scatter_tensor with INPUT_LIST[r] as block r (one tensor per rank)."""
    fn = "reduce_scatter"
    call = _reduction(fn, output, op, group, async_op, "output")
    call.tensors = input_list
    if not call.device:
        comm = call.comm
        check_list(input_list, comm.size, fn, "input_list")
        same_spec(input_list, output, fn, "input_list")
        call.nbytes = output.nbytes * comm.size
        call.block = output.numel()             # one block, the same on every rank
        record_call(call, "reduce_scatter", output.shape, output.dtype,
                    red=call.kind)  # agreed first
    return take(_REDUCE_SCATTER, call)


def _reduce_scatter_device(c: Call, ctx):
    return _device.reduce_scatter(c.tensor, c.tensors, c.op, c.comm, c.async_op, ctx)


def _reduce_scatter_arena(c: Call):
    return _arena_reduce_scatter(c, [t.view(-1) for t in c.tensors])


def _reduce_scatter_lists(c: Call):   # zero-copy inputs
    return _lists.reduce_scatter(c.tensor, c.tensors, c.kind, c.comm, c.async_op, c.entry)


def _reduce_scatter_mpi(c: Call):
    c.input = (torch.cat([t.reshape(-1) for t in c.tensors]) if c.tensors
               else c.tensor.new_empty(0))
    c.inp = as_array(c.input)
    return _reduce_scatter_tensor_mpi(c)


_REDUCE_SCATTER = route("reduce_scatter", device=_reduce_scatter_device,
                        arena=_reduce_scatter_arena, lists=_reduce_scatter_lists,
                        mpi=_reduce_scatter_mpi)


def _arena_reduce_scatter(c: Call, blocks):
    """reduce_scatter through the node's shared-memory arena (hpcddp.collectives._shm)."""
    if c.kind == PREMUL_KIND:
        blocks = [b.clone() for b in blocks]
        for b in blocks:
            pre_reduce(b, c.op, c.kind)
    check = _mismatch.agreement(c.comm, c.entry, c.kind)
    if not _shm.arena(c.comm).reduce_scatter(blocks, c.tensor.view(-1), check):
        check.refuse(c.entry)
    post_reduce(c.tensor, c.kind, c.comm.size)
    record_end(c.entry)
    return CompletedWork([c.tensor]) if c.async_op else None
