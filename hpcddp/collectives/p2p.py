"""Point-to-point: send, recv (from one rank or any), isend, irecv, batch_isend_irecv.

Peers are group ranks. Tags are non-negative ints up to the MPI library's MPI_TAG_UB.

A tensor sent (or received into) again with the same peer, tag and group runs from a plan
(hpcddp.collectives._plans: the C hit checks it, records it and starts MPI in one call), and
isend/irecv then return a C ``P2PWork`` (torch Work's methods, one MPI request). The first
call takes the full path below, which validates, plans and starts the same way. Without the
C module, for counts over MPI's int and on the GPU staging path they return a :class:`Work`.

Every receive checks, once it completes, that the message had the tensor's numel: MPI
completes a shorter one as if nothing were wrong and reports a longer one as a bare
MPI_ERR_TRUNCATE. recv raises, and an irecv's ``wait()`` raises (its ``exception()`` holds it),
an error naming the call, the sender, the tag and both sizes (work.count_error).
"""
from __future__ import annotations

from hpcddp.collectives._common import (as_array, finish_or_work, record_end, resolve,
                                        record_p2p as record)
from hpcddp.collectives import _large
from hpcddp.collectives.work import RecvWork, check_count, truncation
from hpcddp.collectives import _device
from hpcddp.collectives._plans import ISEND, IRECV, SEND, RECV, make_pplan, phit
from hpcddp.collectives.paths import Call, route, take
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


def _p2p(fn: str, tensor, peer, group, tag, plan: bool = True) -> Call:
    """The Call of a send (``root``: the destination) or receive (``root``: the source, None
    for any), validated. PLAN False: never the C plan (the GPU staging path edits the Work)."""
    comm = resolve(group, fn)
    if fn.endswith("send"):
        _check_peer(comm, peer, fn, "dst")
    elif peer is not None:
        _check_peer(comm, peer, fn, "src")
    call = Call()
    call.comm, call.group, call.async_op, call.tensor = comm, group, True, tensor
    call.root, call.tag, call.plannable = peer, tag, plan
    try:
        call.arr = as_array(tensor, fn, "tensor")
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it): the device path checks
        call.device, call.nbytes = True, 0
    else:
        _check_tag(tag, fn)
        call.device, call.nbytes = False, call.arr.nbytes
    return call


def isend(tensor, dst, group=None, tag=0):
    """Start sending TENSOR to group rank DST; returns a Work (wait before reusing TENSOR):
    a C P2PWork where hpcddp's C module is built (torch Work's methods), else a Work."""
    work = phit(ISEND, tensor, dst, tag, group)     # the plan-hit row
    if work is not False:
        return work
    return _isend(tensor, dst, group, tag, True)


def _isend(tensor, dst, group, tag, plan: bool):
    """isend's full path; PLAN as in :func:`_p2p`."""
    return take(_ISEND, _p2p("isend", tensor, dst, group, tag, plan))


def _from_plan(c: Call, op: int):
    """Plan the validated call C and run it from its plan (the C hit): what the hit answers,
    or False where it cannot run it (no C module, pieces, the GPU staging path's calls)."""
    if not c.plannable or not make_pplan(op in (IRECV, RECV), c.tensor, c.group, c.comm, c.arr,
                                     c.root, c.tag):
        return False
    # the hit is asked with COMM: GROUP may be a torch group the plan files under None
    return phit(op, c.tensor, c.root, c.tag, c.comm)


def _isend_mpi(c: Call):
    work = _from_plan(c, ISEND)
    if work is not False:
        return work
    tensor, comm, arr, dst, tag = c.tensor, c.comm, c.arr, c.root, c.tag
    entry = record(comm, "send", tensor.shape, tensor.dtype, dst)
    reqs = (_large.send(comm.mpi, arr, dst, tag) if _large.too_big(arr)
            else [comm.mpi.Isend(arr, dst, tag)])
    return finish_or_work(True, entry, reqs, [tensor])


def _isend_device(c: Call, ctx):
    return _device.isend(c.tensor, c.root, c.comm, c.tag, ctx)


_ISEND = route("send/recv/isend/irecv", device=_isend_device, mpi=_isend_mpi)


def send(tensor, dst, group=None, tag=0):
    """Send TENSOR to group rank DST; returns when TENSOR may be reused."""
    if phit(SEND, tensor, dst, tag, group) is not False:    # the plan-hit row
        return
    take(_SEND, _p2p("send", tensor, dst, group, tag))


def _send_mpi(c: Call):
    if _from_plan(c, SEND) is not False:
        return
    tensor, comm, arr, dst, tag = c.tensor, c.comm, c.arr, c.root, c.tag
    entry = record(comm, "send", tensor.shape, tensor.dtype, dst)
    if _large.too_big(arr):
        _large.wait(_large.send(comm.mpi, arr, dst, tag))
    else:
        comm.mpi.Send(arr, dst, tag)
    record_end(entry)


def _send_device(c: Call, ctx):
    return _device.send(c.tensor, c.root, c.comm, c.tag, ctx)


_SEND = route("send/recv/isend/irecv", device=_send_device, mpi=_send_mpi)


def irecv(tensor, src=None, group=None, tag=0):
    """Start receiving into TENSOR from group rank SRC (None: any rank); returns a Work whose
    ``source_rank()`` names the sender once complete (a P2PWork as in :func:`isend`)."""
    work = phit(IRECV, tensor, src, tag, group)     # the plan-hit row
    if work is not False:
        return work
    return _irecv(tensor, src, group, tag, True)


def _irecv(tensor, src, group, tag, plan: bool):
    """irecv's full path; PLAN as in :func:`_p2p`."""
    call = _p2p("irecv", tensor, src, group, tag, plan)
    if not call.device and src is None and _large.too_big(call.arr):
        raise ValueError(f"irecv: src=None (any source) with {tensor.numel()} elements, over this "
                         f"MPI's count limit of {_large.MAX_COUNT}: the message travels in "
                         f"pieces that must come from one sender; give src (or use recv)")
    return take(_IRECV, call)


def _irecv_mpi(c: Call):
    work = _from_plan(c, IRECV)
    if work is not False:
        return work
    tensor, comm, arr, src, tag = c.tensor, c.comm, c.arr, c.root, c.tag
    entry = record(comm, "recv", tensor.shape, tensor.dtype, src)
    source = MPI.ANY_SOURCE if src is None else src
    reqs = (_large.recv(comm.mpi, arr, source, tag) if _large.too_big(arr)
            else [comm.mpi.Irecv(arr, source, tag)])
    return RecvWork(reqs, tensor, arr, "irecv", tag, entry)


def _irecv_device(c: Call, ctx):
    return _device.irecv(c.tensor, c.root, c.comm, c.tag, ctx)


_IRECV = route("send/recv/isend/irecv", device=_irecv_device, mpi=_irecv_mpi)


def recv(tensor, src=None, group=None, tag=0) -> int:
    """Receive into TENSOR from group rank SRC (None: any rank). Returns the sender's rank."""
    source = phit(RECV, tensor, src, tag, group)    # the plan-hit row
    if source is not False:
        return source
    return take(_RECV, _p2p("recv", tensor, src, group, tag))


def _recv_mpi(c: Call) -> int:
    source = _from_plan(c, RECV)
    if source is not False:
        return source
    tensor, comm, arr, src, tag = c.tensor, c.comm, c.arr, c.root, c.tag
    entry = record(comm, "recv", tensor.shape, tensor.dtype, src)
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


def _recv_device(c: Call, ctx):
    return _device.recv(c.tensor, c.root, c.comm, c.tag, ctx)


_RECV = route("send/recv/isend/irecv", device=_recv_device, mpi=_recv_mpi)
