"""Point-to-point: send, recv (from one rank or any), isend, irecv, batch_isend_irecv.

Peers are group ranks. Tags are non-negative ints up to the MPI library's MPI_TAG_UB.
"""
from __future__ import annotations

from hpcddp.collectives._common import (as_array, finish_or_work, record_end, resolve,
                                        record_p2p as record)
from hpcddp.collectives import _large
from hpcddp.collectives.work import Work
from hpcddp.collectives import _device
from hpcddp.comm.buffers import DeviceTensor
from hpcddp.comm._mpi import MPI

_tag_ub: int | None = None


def _check_tag(tag, fn: str) -> int:
    global _tag_ub
    if _tag_ub is None:
        _tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB) or 32767
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= _tag_ub:
        raise ValueError(f"{fn}: tag must be an int in 0..{_tag_ub} (MPI_TAG_UB), got {tag!r}")
    return tag


def _check_peer(comm, peer, fn: str, arg: str) -> int:
    comm.check_rank(peer, fn, arg)
    if peer == comm.rank:
        raise ValueError(f"{fn}: {arg}={peer} is this rank itself; a rank cannot {fn} to itself "
                         f"(copy the tensor instead)")
    return peer


def isend(tensor, dst, group=None, tag=0):
    """Start sending TENSOR to group rank DST; returns a Work (wait before reusing TENSOR)."""
    comm = resolve(group, "isend")
    _check_peer(comm, dst, "isend", "dst")
    try:
        arr = as_array(tensor, "isend", "tensor")
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it)
        return _device.isend(tensor, dst, comm, tag)
    _check_tag(tag, "isend")
    entry = record(comm, "send", tensor.shape, tensor.dtype, dst)
    reqs = (_large.send(comm.mpi, arr, dst, tag) if _large.too_big(arr)
            else [comm.mpi.Isend(arr, dst, tag)])
    return finish_or_work(True, entry, reqs, [tensor])


def send(tensor, dst, group=None, tag=0):
    """Send TENSOR to group rank DST; returns when TENSOR may be reused."""
    comm = resolve(group, "send")
    _check_peer(comm, dst, "send", "dst")
    try:
        arr = as_array(tensor, "send", "tensor")
    except DeviceTensor:
        return _device.send(tensor, dst, comm, tag)
    _check_tag(tag, "send")
    entry = record(comm, "send", tensor.shape, tensor.dtype, dst)
    if _large.too_big(arr):
        _large.wait(_large.send(comm.mpi, arr, dst, tag))
    else:
        comm.mpi.Send(arr, dst, tag)
    record_end(entry)


def irecv(tensor, src=None, group=None, tag=0):
    """Start receiving into TENSOR from group rank SRC (None: any rank); returns a Work whose
    ``source_rank()`` names the sender once complete."""
    comm = resolve(group, "irecv")
    source = MPI.ANY_SOURCE if src is None else _check_peer(comm, src, "irecv", "src")
    try:
        arr = as_array(tensor, "irecv", "tensor")
    except DeviceTensor:
        return _device.irecv(tensor, src, comm, tag)
    _check_tag(tag, "irecv")
    big = _large.too_big(arr)
    if big and src is None:
        raise ValueError(f"irecv: src=None (any source) with {tensor.numel()} elements, over this "
                         f"MPI's count limit of {_large.MAX_COUNT}: the message travels in "
                         f"pieces that must come from one sender; give src (or use recv)")
    entry = record(comm, "recv", tensor.shape, tensor.dtype, src)
    if big:
        return Work(_large.recv(comm.mpi, arr, source, tag), [tensor], None, entry)
    req = comm.mpi.Irecv(arr, source, tag)
    return Work([req], [tensor], None, entry, status=MPI.Status())


def recv(tensor, src=None, group=None, tag=0) -> int:
    """Receive into TENSOR from group rank SRC (None: any rank). Returns the sender's rank."""
    comm = resolve(group, "recv")
    source = MPI.ANY_SOURCE if src is None else _check_peer(comm, src, "recv", "src")
    try:
        arr = as_array(tensor, "recv", "tensor")
    except DeviceTensor:
        return _device.recv(tensor, src, comm, tag)
    _check_tag(tag, "recv")
    entry = record(comm, "recv", tensor.shape, tensor.dtype, src)
    if _large.too_big(arr):
        if source == MPI.ANY_SOURCE:
            source = _large.probe_source(comm.mpi, tag)
        _large.wait(_large.recv(comm.mpi, arr, source, tag))
        record_end(entry)
        return source
    status = MPI.Status()
    comm.mpi.Recv(arr, source, tag, status)
    record_end(entry)
    return status.Get_source()
