"""Data movement from one or all ranks: broadcast, all_gather(_into_tensor), gather, scatter.

Signatures and semantics follow torch.distributed; ``group`` is an hpcddp Communicator (None:
the world). All members of the group call each op. Lists of tensors travel through one
contiguous buffer (one MPI call, then a copy); the ``_into_tensor`` forms are zero-copy.
"""
from __future__ import annotations

import torch

from hpcddp.collectives import _cma
from hpcddp.collectives import _hier
from hpcddp.collectives import _large
from hpcddp.collectives import _lists
from hpcddp.collectives import _plans
from hpcddp.collectives._plans import (ALL_GATHER, ALL_GATHER_TENSOR, bhit as _bcast_hit,
                                       xhit as _xhit)
from hpcddp.collectives._common import (CompletedWork, as_array, as_arrays, check_list,
                                        finish_or_work, record_call, record_end, resolve,
                                        same_spec)
from hpcddp.collectives import _device
from hpcddp.collectives import engine as _engine
from hpcddp.comm._mpi import MPI
from hpcddp.collectives.paths import Call, pair, route, take
from hpcddp.comm.buffers import DeviceTensor
from hpcddp.diagnostics import mismatch as _mismatch


def _one(fn: str, tensor, group, async_op, root_arg: str | None = None, root=None) -> Call:
    """The Call of an op on one tensor (and, ROOT_ARG, a root rank), validated."""
    comm = resolve(group, fn)
    if root_arg is not None:
        comm.check_rank(root, fn, root_arg)
    call = Call()
    call.comm, call.group, call.async_op, call.tensor, call.root = (comm, group, async_op,
                                                                    tensor, root)
    try:
        call.arr = as_array(tensor, fn, "tensor")
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it): the device path checks
        call.device, call.nbytes = True, 0
    else:
        call.device, call.nbytes = False, call.arr.nbytes
    return call


# -- broadcast ---------------------------------------------------------------------------------

def broadcast(tensor, src, group=None, async_op=False):
    """Copy TENSOR from group rank SRC to every rank of the group, in place.

    Rank SRC holds x before; every rank holds x after.
    """
    # the plan-hit row (hpcddp.collectives._plans): a tensor broadcast before from SRC;
    # blocking whatever async_op (see _broadcast_mpi), as all_reduce's
    if not _engine.pending and not (async_op and _engine.on()) and _bcast_hit(tensor, src, group):
        return None if not async_op else CompletedWork([tensor])
    call = _one("broadcast", tensor, group, async_op, "src", src)
    if not call.device:
        record_call(call, "broadcast", tensor.shape, tensor.dtype, src)
    return take(_BROADCAST, call)


def _broadcast_device(c: Call, ctx):
    return _device.broadcast(c.tensor, c.root, c.comm, c.async_op, ctx)


def _broadcast_cma(c: Call):   # ranks of one node: the copy split between them
    check = _mismatch.agreement(c.comm, c.entry)
    if not _cma.peers(c.comm).broadcast(c.arr, c.root, check):
        check.refuse(c.entry)
    record_end(c.entry)
    return CompletedWork([c.tensor]) if c.async_op else None


def _broadcast_hier(c: Call):
    _hier.agree(c.comm, c.entry)
    _hier.hier(c.comm).broadcast(c.arr, c.root)
    record_end(c.entry)
    return CompletedWork([c.tensor]) if c.async_op else None


def _broadcast_mpi(c: Call):
    # The blocking MPI call, with or without async_op: MPI never matches a blocking collective
    # on one rank with a non-blocking one on another, and torch code mixes them for one
    # broadcast. async_op: a completed Work (reduce._all_reduce_mpi says more).
    try:
        c.comm.mpi.Bcast(c.arr, root=c.root)
    except _large.REFUSED:  # over MPI's count limit: pieces (costs nothing until then)
        if not _large.too_big(c.arr):
            raise
        _large.bcast_now(c.comm, c.arr, c.root)
    else:
        _plans.make_bplan(c.tensor, c.group, c.comm, c.arr, c.root)
    record_end(c.entry)
    return CompletedWork([c.tensor]) if c.async_op else None


_BROADCAST = route("broadcast", device=_broadcast_device, cma=_broadcast_cma,
                   hier=_broadcast_hier, mpi=_broadcast_mpi)


# -- all_gather_into_tensor --------------------------------------------------------------------

def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenate every rank's INPUT_TENSOR into OUTPUT_TENSOR (rank order) on every rank.

    output_tensor: n * input.numel() elements (n stacked or concatenated blocks).
    """
    # the plan-hit row: the same blocking call on the same tensors again (collectives._plans)
    if not async_op and not _engine.pending \
            and _xhit(ALL_GATHER_TENSOR, (output_tensor, input_tensor), group):
        return None
    fn = "all_gather_into_tensor"
    call = pair(fn, output_tensor, input_tensor, group, async_op, "output_tensor",
                "input_tensor")
    if not call.device:
        comm = call.comm
        if output_tensor.dtype != input_tensor.dtype:
            raise TypeError(f"{fn}: output_tensor has dtype {output_tensor.dtype}, expected "
                            f"{input_tensor.dtype} (input_tensor's)")
        if output_tensor.numel() != input_tensor.numel() * comm.size:
            raise ValueError(f"{fn}: output_tensor has {output_tensor.numel()} elements, "
                             f"expected {input_tensor.numel() * comm.size} (input's "
                             f"{input_tensor.numel()} x group size {comm.size})")
        call.nbytes = call.out.nbytes
        call.arr = call.out                     # the hierarchical row's count test
        record_call(call, "all_gather", input_tensor.shape, input_tensor.dtype)
    return take(_ALL_GATHER_INTO_TENSOR, call)


def _all_gather_into_tensor_device(c: Call, ctx):
    return _device.all_gather_into_tensor(c.output, c.input, c.comm, c.async_op, ctx)


def _all_gather_into_tensor_hier(c: Call):
    _hier.agree(c.comm, c.entry)
    _hier.hier(c.comm).all_gather(c.inp, c.out)
    record_end(c.entry)
    return CompletedWork([c.output]) if c.async_op else None


def _all_gather_into_tensor_mpi(c: Call):
    if _large.too_big(c.out):  # over MPI's count limit: broadcasts in pieces
        return finish_or_work(c.async_op, c.entry, _large.allgather(c.comm, c.inp, c.out),
                              [c.output])
    # The blocking MPI call, with or without async_op, as all_reduce and broadcast do: a
    # blocking collective never matches a non-blocking one on another rank, so it must be the
    # same call either way; and Open MPI's blocking Allgather is faster than Iallgather + Wait
    # at mid sizes (docs/benchmarks.md). async_op: a completed Work.
    c.comm.mpi.Allgather(c.inp, c.out)
    if not c.async_op and c.inp.size and \
            _plans.worth_planning(ALL_GATHER_TENSOR, (c.output, c.input)):
        _plan_all_gather_into_tensor(c)
    record_end(c.entry)
    return CompletedWork([c.output]) if c.async_op else None


def _plan_all_gather_into_tensor(c: Call) -> None:
    """Plan the validated blocking call on C's tensors (MPI's Allgather ran it) for the next."""
    mpi, inp, out = c.comm.mpi, c.inp, c.out
    datatype = _plans.datatype_handle(inp)
    prog = None if datatype is None else (_plans.ALLGATHER, MPI._handleof(mpi), datatype,
                                          inp.size)
    _plans.make_xplan(ALL_GATHER_TENSOR, (c.output, c.input), c.group, c.comm, "all_gather",
                      c.input.shape, c.input.dtype, lambda: mpi.Allgather(inp, out), prog)


_ALL_GATHER_INTO_TENSOR = route("all_gather_into_tensor", device=_all_gather_into_tensor_device,
                                hier=_all_gather_into_tensor_hier,
                                mpi=_all_gather_into_tensor_mpi)


# -- all_gather --------------------------------------------------------------------------------

def _scatter_copy(flat: torch.Tensor, outputs) -> None:
    off = 0
    for t in outputs:
        n = t.numel()
        t.view(-1).copy_(flat[off:off + n])
        off += n


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Every rank's TENSOR into TENSOR_LIST (one tensor per rank, rank order), on every rank."""
    # the plan-hit row: the same blocking call on the same tensors again (collectives._plans)
    if not async_op and not _engine.pending and type(tensor_list) in _lists.SEQUENCES \
            and _xhit(ALL_GATHER, (tensor, *tensor_list), group):
        return None
    fn = "all_gather"
    call = _one(fn, tensor, group, async_op)
    call.tensors = tensor_list
    if not call.device:
        send, comm = call.arr, call.comm
        check_list(tensor_list, comm.size, fn, "tensor_list")
        call.views = as_arrays(tensor_list, tensor, fn, "tensor_list", same_shape=False)
        for i, v in enumerate(call.views):
            if v.size != send.size:
                raise ValueError(f"{fn}: tensor_list[{i}] has {v.size} elements, expected "
                                 f"{send.size} (tensor's; every rank sends the same size)")
        call.block = send.size                  # one block, the same on every rank
        record_call(call, "all_gather", tensor.shape, tensor.dtype)
    return take(_ALL_GATHER, call)


def _all_gather_device(c: Call, ctx):
    return _device.all_gather(c.tensors, c.tensor, c.comm, c.async_op, ctx)


def _all_gather_lists(c: Call):   # zero-copy: each block straight into its tensor
    return _lists.all_gather(c.tensors, c.tensor, c.views, c.arr, c.comm, c.async_op, c.entry,
                             c.group)


def _all_gather_mpi(c: Call):
    tensor, tensor_list = c.tensor, c.tensors
    flat = torch.empty(tensor.numel() * c.comm.size, dtype=tensor.dtype)
    reqs = (_large.allgather(c.comm, c.arr, as_array(flat)) if _large.too_big(flat)
            else [c.comm.mpi.Iallgather(c.arr, as_array(flat))])
    return finish_or_work(c.async_op, c.entry, reqs, list(tensor_list),
                          lambda: _scatter_copy(flat, tensor_list), keep=flat)


_ALL_GATHER = route("all_gather", device=_all_gather_device, lists=_all_gather_lists,
                    mpi=_all_gather_mpi)


# -- gather, scatter ---------------------------------------------------------------------------

def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """Every rank's TENSOR into GATHER_LIST on group rank DST (rank order).

    gather_list: n tensors shaped like TENSOR on DST; None (or []) on the other ranks.
    """
    return take(_GATHER, _rooted("gather", tensor, gather_list, dst, group, async_op, "dst",
                                 "gather_list", "destination"))


def _rooted(fn: str, tensor, lst, root, group, async_op, root_arg, list_arg, role) -> Call:
    """The Call of gather or scatter: LST (LIST_ARG) n tensors like TENSOR on the root, None
    or empty on the other ranks."""
    call = _one(fn, tensor, group, async_op, root_arg, root)
    call.tensors = lst
    if not call.device:
        comm = call.comm
        if comm.rank == root:
            check_list(lst, comm.size, fn, list_arg)
            same_spec(lst, tensor, fn, list_arg)
        elif lst:
            raise ValueError(f"{fn}: {list_arg} must be None or empty on rank {comm.rank}, "
                             f"which is not the {role} ({root_arg}={root})")
        record_call(call, fn, tensor.shape, tensor.dtype, root)
    return call


def _gather_device(c: Call, ctx):
    return _device.gather(c.tensor, c.tensors, c.root, c.comm, c.async_op, ctx)


def _gather_mpi(c: Call):
    tensor, comm, dst = c.tensor, c.comm, c.root
    if comm.rank != dst:
        reqs = (_large.gather(comm, c.arr, None, dst) if _large.too_big(c.arr, comm.size)
                else [comm.mpi.Igather(c.arr, None, root=dst)])
        return finish_or_work(c.async_op, c.entry, reqs, [])  # gloo: no outputs off the root
    gather_list = c.tensors
    flat = torch.empty(tensor.numel() * comm.size, dtype=tensor.dtype)
    reqs = (_large.gather(comm, c.arr, as_array(flat), dst) if _large.too_big(flat)
            else [comm.mpi.Igather(c.arr, as_array(flat), root=dst)])
    return finish_or_work(c.async_op, c.entry, reqs, list(gather_list),
                          lambda: _scatter_copy(flat, gather_list), keep=flat)


_GATHER = route("gather", device=_gather_device, mpi=_gather_mpi)


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """SCATTER_LIST[r] on group rank SRC into TENSOR on rank r.

    scatter_list: n tensors shaped like TENSOR on SRC; None (or []) on the other ranks.
    """
    return take(_SCATTER, _rooted("scatter", tensor, scatter_list, src, group, async_op, "src",
                                  "scatter_list", "source"))


def _scatter_device(c: Call, ctx):
    return _device.scatter(c.tensor, c.tensors, c.root, c.comm, c.async_op, ctx)


def _scatter_mpi(c: Call):
    comm, src, arr = c.comm, c.root, c.arr
    if comm.rank != src:
        reqs = (_large.scatter(comm, None, arr, src) if _large.too_big(arr, comm.size)
                else [comm.mpi.Iscatter(None, arr, root=src)])
        return finish_or_work(c.async_op, c.entry, reqs, [c.tensor])
    flat = torch.cat([t.reshape(-1) for t in c.tensors])
    reqs = (_large.scatter(comm, as_array(flat), arr, src) if _large.too_big(flat)
            else [comm.mpi.Iscatter(as_array(flat), arr, root=src)])
    return finish_or_work(c.async_op, c.entry, reqs, [c.tensor], keep=flat)


_SCATTER = route("scatter", device=_scatter_device, mpi=_scatter_mpi)
