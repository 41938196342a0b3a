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
from hpcddp.collectives._plans import ALL_GATHER, xhit as _xhit
from hpcddp.collectives._common import (CompletedWork, as_array, as_arrays, check_list,
                                        finish_or_work, record, record_end, resolve, same_spec)
from hpcddp.collectives import _device
from hpcddp.comm.buffers import DeviceTensor
from hpcddp.diagnostics import mismatch as _mismatch


def broadcast(tensor, src, group=None, async_op=False):
    """Copy TENSOR from group rank SRC to every rank of the group, in place.

    Rank SRC holds x before; every rank holds x after.
    """
    comm = resolve(group, "broadcast")
    comm.check_rank(src, "broadcast", "src")
    try:
        arr = as_array(tensor, "broadcast", "tensor")
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it)
        return _device.broadcast(tensor, src, comm, async_op)
    entry = record(comm, "broadcast", tensor.shape, tensor.dtype, src)
    if _cma.usable(comm, arr.nbytes):  # ranks of one node: the copy split between them
        check = _mismatch.agreement(comm, entry)
        if not _cma.peers(comm).broadcast(arr, src, check):
            check.refuse(entry)
        record_end(entry)
        return CompletedWork([tensor]) if async_op else None
    if _hier.usable(comm, arr.nbytes) and not _large.too_big(arr):   # several nodes
        _hier.agree(comm, entry)
        _hier.hier(comm).broadcast(arr, src)
        record_end(entry)
        return CompletedWork([tensor]) if async_op else None
    # The blocking MPI call, with or without async_op: MPI never matches a blocking collective
    # on one rank with a non-blocking one on another, and torch code mixes them for one
    # broadcast. async_op: a completed Work (reduce.all_reduce says more).
    try:
        comm.mpi.Bcast(arr, root=src)
    except _large.REFUSED:  # over MPI's count limit: pieces (costs nothing until then)
        if not _large.too_big(arr):
            raise
        _large.bcast_now(comm, arr, src)
    record_end(entry)
    if not async_op:
        return None
    return CompletedWork([tensor])


def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
    """Concatenate every rank's INPUT_TENSOR into OUTPUT_TENSOR (rank order) on every rank.

    output_tensor: n * input.numel() elements (n stacked or concatenated blocks).
    """
    comm = resolve(group, "all_gather_into_tensor")
    try:
        out = as_array(output_tensor, "all_gather_into_tensor", "output_tensor")
        inp = as_array(input_tensor, "all_gather_into_tensor", "input_tensor")
    except DeviceTensor:
        return _device.all_gather_into_tensor(output_tensor, input_tensor, comm, async_op)
    if output_tensor.dtype != input_tensor.dtype:
        raise TypeError(f"all_gather_into_tensor: output_tensor has dtype {output_tensor.dtype}, "
                        f"expected {input_tensor.dtype} (input_tensor's)")
    if output_tensor.numel() != input_tensor.numel() * comm.size:
        raise ValueError(f"all_gather_into_tensor: output_tensor has {output_tensor.numel()} "
                         f"elements, expected {input_tensor.numel() * comm.size} (input's "
                         f"{input_tensor.numel()} x group size {comm.size})")
    entry = record(comm, "all_gather", input_tensor.shape, input_tensor.dtype)
    if _large.too_big(out):  # over MPI's count limit: broadcasts in pieces
        return finish_or_work(async_op, entry, _large.allgather(comm, inp, out), [output_tensor])
    if _hier.usable(comm, out.nbytes):   # several nodes
        _hier.agree(comm, entry)
        _hier.hier(comm).all_gather(inp, out)
        record_end(entry)
        return CompletedWork([output_tensor]) if async_op else None
    # The blocking MPI call, with or without async_op, as all_reduce and broadcast do: a
    # blocking collective never matches a non-blocking one on another rank, so it must be the
    # same call either way; and Open MPI's blocking Allgather is faster than Iallgather + Wait
    # at mid sizes (docs/benchmarks.md). async_op: a completed Work.
    comm.mpi.Allgather(inp, out)
    record_end(entry)
    return CompletedWork([output_tensor]) if async_op else None


def _scatter_copy(flat: torch.Tensor, outputs) -> None:
    off = 0
    for t in outputs:
        n = t.numel()
        t.view(-1).copy_(flat[off:off + n])
        off += n


def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Every rank's TENSOR into TENSOR_LIST (one tensor per rank, rank order), on every rank."""
    # hot path: the same blocking call on the same tensors again (hpcddp.collectives._plans)
    if not async_op and type(tensor_list) in _lists.SEQUENCES \
            and _xhit(ALL_GATHER, (tensor, *tensor_list), group):
        return None
    comm = resolve(group, "all_gather")
    try:
        send = as_array(tensor, "all_gather", "tensor")
    except DeviceTensor:
        return _device.all_gather(tensor_list, tensor, comm, async_op)
    check_list(tensor_list, comm.size, "all_gather", "tensor_list")
    views = as_arrays(tensor_list, tensor, "all_gather", "tensor_list", same_shape=False)
    for i, v in enumerate(views):
        if v.size != send.size:
            raise ValueError(f"all_gather: tensor_list[{i}] has {v.size} elements, expected "
                             f"{send.size} (tensor's; every rank sends the same size)")
    if _lists.use_p2p(comm, send.size):  # zero-copy: each block straight into its tensor
        entry = record(comm, "all_gather", tensor.shape, tensor.dtype)
        return _lists.all_gather(tensor_list, tensor, views, send, comm, async_op, entry,
                                 group)
    flat = torch.empty(tensor.numel() * comm.size, dtype=tensor.dtype)
    entry = record(comm, "all_gather", tensor.shape, tensor.dtype)
    reqs = (_large.allgather(comm, as_array(tensor), as_array(flat)) if _large.too_big(flat)
            else [comm.mpi.Iallgather(as_array(tensor), as_array(flat))])
    return finish_or_work(async_op, entry, reqs, list(tensor_list),
                          lambda: _scatter_copy(flat, tensor_list), keep=flat)


def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """Every rank's TENSOR into GATHER_LIST on group rank DST (rank order).

    gather_list: n tensors shaped like TENSOR on DST; None (or []) on the other ranks.
    """
    comm = resolve(group, "gather")
    comm.check_rank(dst, "gather", "dst")
    try:
        as_array(tensor, "gather", "tensor")
    except DeviceTensor:
        return _device.gather(tensor, gather_list, dst, comm, async_op)
    if comm.rank == dst:
        check_list(gather_list, comm.size, "gather", "gather_list")
        same_spec(gather_list, tensor, "gather", "gather_list")
        flat = torch.empty(tensor.numel() * comm.size, dtype=tensor.dtype)
        entry = record(comm, "gather", tensor.shape, tensor.dtype, dst)
        reqs = (_large.gather(comm, as_array(tensor), as_array(flat), dst)
                if _large.too_big(flat) else
                [comm.mpi.Igather(as_array(tensor), as_array(flat), root=dst)])
        return finish_or_work(async_op, entry, reqs, list(gather_list),
                              lambda: _scatter_copy(flat, gather_list), keep=flat)
    if gather_list:
        raise ValueError(f"gather: gather_list must be None or empty on rank {comm.rank}, which "
                         f"is not the destination (dst={dst})")
    entry = record(comm, "gather", tensor.shape, tensor.dtype, dst)
    reqs = (_large.gather(comm, as_array(tensor), None, dst)
            if _large.too_big(as_array(tensor), comm.size) else
            [comm.mpi.Igather(as_array(tensor), None, root=dst)])
    return finish_or_work(async_op, entry, reqs, [])  # gloo: no outputs off the root


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """SCATTER_LIST[r] on group rank SRC into TENSOR on rank r.

    scatter_list: n tensors shaped like TENSOR on SRC; None (or []) on the other ranks.
    """
    comm = resolve(group, "scatter")
    comm.check_rank(src, "scatter", "src")
    try:
        arr = as_array(tensor, "scatter", "tensor")
    except DeviceTensor:
        return _device.scatter(tensor, scatter_list, src, comm, async_op)
    if comm.rank == src:
        check_list(scatter_list, comm.size, "scatter", "scatter_list")
        same_spec(scatter_list, tensor, "scatter", "scatter_list")
        flat = torch.cat([t.reshape(-1) for t in scatter_list])
        entry = record(comm, "scatter", tensor.shape, tensor.dtype, src)
        reqs = (_large.scatter(comm, as_array(flat), arr, src) if _large.too_big(flat)
                else [comm.mpi.Iscatter(as_array(flat), arr, root=src)])
        return finish_or_work(async_op, entry, reqs, [tensor], keep=flat)
    if scatter_list:
        raise ValueError(f"scatter: scatter_list must be None or empty on rank {comm.rank}, which "
                         f"is not the source (src={src})")
    entry = record(comm, "scatter", tensor.shape, tensor.dtype, src)
    reqs = (_large.scatter(comm, None, arr, src) if _large.too_big(arr, comm.size)
            else [comm.mpi.Iscatter(None, arr, root=src)])
    return finish_or_work(async_op, entry, reqs, [tensor])
