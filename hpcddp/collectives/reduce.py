"""Reductions: all_reduce, reduce, reduce_scatter, reduce_scatter_tensor.

Signatures and semantics follow torch.distributed. ``group`` is an hpcddp Communicator (None:
the world); with ``async_op=True`` a :class:`~hpcddp.collectives.work.Work` is returned,
otherwise None once the op is complete. All members of the group call each op.
"""
from __future__ import annotations

import torch.distributed as dist

from hpcddp.collectives import _large
from hpcddp.collectives import engine as _engine
from hpcddp.collectives._common import (CompletedWork, as_array, check_blocks, check_list,
                                        same_spec)
from hpcddp.collectives._plans import (REDUCE_SCATTER_LIST, REDUCE_SCATTER_TENSOR,
                                       hit as _plan_hit, rhit as _reduce_hit, xhit as _xhit)
from hpcddp.collectives.call import Call, recorded_name, reduce_op, resolve, take
from hpcddp.collectives.paths import route
from hpcddp.comm.buffers import DeviceTensor, one_device

SUM = dist.ReduceOp.SUM
SUM_KIND = dist.ReduceOp.RedOpType.SUM
PREMUL_KIND = dist.ReduceOp.RedOpType.PREMUL_SUM


def _reduction(fn: str, tensor, op, group, async_op, arg: str = "tensor") -> Call:
    """The Call of an op reducing TENSOR with OP (validated; CUDA tensors: ``device``)."""
    call = Call()
    try:
        call.arr = as_array(tensor, fn, arg)
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it): no host view
        call.device, call.nbytes = True, tensor.nbytes
    else:
        call.device, call.nbytes = False, call.arr.nbytes
    call.comm, call.group, call.async_op = resolve(group, fn), group, async_op
    call.tensor, call.dtype, call.op = tensor, tensor.dtype, op
    # the MPI op: on the device too, where a user-defined one (bfloat16) keeps it off the
    # CUDA-aware row
    call.mop, call.kind = reduce_op(op, tensor.dtype, fn)
    # recorded under its reduce op unless a SUM (call.recorded_name; a SUM without the call)
    call.name = fn if call.kind == SUM_KIND else recorded_name(fn, call.kind)
    call.shape, call.root, call.red = tensor.shape, None, call.kind
    call.results, call.memo = [tensor], None
    return call


# -- all_reduce --------------------------------------------------------------------------------

def all_reduce(tensor, op=SUM, group=None, async_op=False):
    """Reduce TENSOR across the group with OP, in place on every rank.

    Rank r holds x_r before; every rank holds op(x_0, ..., x_{n-1}) after.
    """
    # the plan-hit row (hpcddp.collectives._plans): SUM on a tensor reduced before. Blocking
    # whatever async_op (paths/mpi.py says why), unless the async engine takes the call or
    # holds calls issued before it (hpcddp.collectives.engine)
    if (op is SUM or op == SUM) and not _engine.pending \
            and not (async_op and _engine.on()) and _plan_hit(tensor, group):
        return None if not async_op else CompletedWork([tensor])
    call = _reduction("all_reduce", tensor, op, group, async_op)
    if call.kind == SUM_KIND:       # ==: torch hands out new enum objects
        call.memo = (tensor,)       # a SUM is planned on its second call in a row
    return take(_ALL_REDUCE, call)


_ALL_REDUCE = route("all_reduce")


# -- reduce ------------------------------------------------------------------------------------

def reduce(tensor, dst, op=SUM, group=None, async_op=False):
    """Reduce TENSOR across the group onto group rank DST (in place there).

    Rank DST holds op(x_0, ..., x_{n-1}) after; the other ranks' tensors are left as they were.
    """
    # the plan-hit row: SUM of a tensor reduced before onto DST; blocking whatever async_op,
    # as all_reduce's
    if (op is SUM or op == SUM) and not _engine.pending \
            and not (async_op and _engine.on()) and _reduce_hit(tensor, dst, group):
        return None if not async_op else CompletedWork([tensor])
    call = _reduction("reduce", tensor, op, group, async_op)
    call.comm.check_rank(dst, "reduce", "dst")
    call.root = dst
    if call.kind == SUM_KIND:
        call.memo = (tensor,)       # a SUM is planned on its second call in a row
    return take(_REDUCE, call)


_REDUCE = route("reduce")


# -- reduce_scatter_tensor, reduce_scatter -----------------------------------------------------

def reduce_scatter_tensor(output, input, op=SUM, group=None, async_op=False):
    """Reduce INPUT (n equal blocks, one per rank) across the group; rank r gets block r.

    input: n * output.numel() elements on every rank. Rank r holds op over ranks of input's
    r-th block in OUTPUT after.
    """
    # the plan-hit row: the same blocking SUM on the same tensors again (collectives._plans)
    if not async_op and (op is SUM or op == SUM) and not _engine.pending \
            and _xhit(REDUCE_SCATTER_TENSOR, (output, input), group):
        return None
    fn = "reduce_scatter_tensor"
    call = _reduction(fn, output, op, group, async_op, "output")
    call.input, comm = input, call.comm
    try:
        call.inp = as_array(input, fn, "input")
    except DeviceTensor:
        call.device = True
    if call.device:
        one_device(fn, ("output", output), ("input", input))
    check_blocks(fn, input, "input", output, "output", comm.size)
    if _large.too_big(input):
        _large.refuse(fn, "input", input.numel())
    call.nbytes = input.nbytes              # the paths' thresholds are on the whole input
    if not async_op and call.kind == SUM_KIND and not call.device:
        call.memo = (output, input)         # planned on its second call in a row
    call.name = recorded_name("reduce_scatter", call.kind)
    return take(_REDUCE_SCATTER_TENSOR, call)


_REDUCE_SCATTER_TENSOR = route("reduce_scatter_tensor")


def reduce_scatter(output, input_list, op=SUM, group=None, async_op=False):
    """Like reduce_scatter_tensor with INPUT_LIST[r] as block r (one tensor per rank)."""
    # the plan-hit row: the same blocking SUM on the same tensors again (collectives._plans)
    if not async_op and (op is SUM or op == SUM) and not _engine.pending \
            and type(input_list) is list \
            and _xhit(REDUCE_SCATTER_LIST, (output, *input_list), group):
        return None
    fn = "reduce_scatter"
    call = _reduction(fn, output, op, group, async_op, "output")
    call.tensors, comm = input_list, call.comm
    check_list(input_list, comm.size, fn, "input_list")
    same_spec(input_list, output, fn, "input_list")
    call.nbytes = output.nbytes * comm.size
    call.block = output.numel()                 # one block, the same on every rank
    if not async_op and call.kind == SUM_KIND and not call.device:
        call.memo = (output, *input_list)       # planned on its second call in a row
    return take(_REDUCE_SCATTER, call)


_REDUCE_SCATTER = route("reduce_scatter")
