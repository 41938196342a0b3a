"""Point-to-point: send, recv (from one rank or any), isend, irecv, batch_isend_irecv.

Peers are group ranks. Tags are non-negative ints up to the MPI library's MPI_TAG_UB.

A tensor sent (or received into) a second time in a row is planned with that call's peer, tag
and group (hpcddp.collectives.call.take's memo), and a call with the same ones runs from its plan
(hpcddp.collectives._plans: the C hit checks it, records it and starts MPI in one call);
isend/irecv then return a C ``P2PWork`` (torch Work's methods, one MPI request). The first
calls take the full path below and return a :class:`Work`, as do calls without the C module,
for counts over MPI's int and on the GPU staging path.

Every receive checks, once it completes, that the message had the tensor's numel: MPI
completes a shorter one as if nothing were wrong and reports a longer one as a bare
MPI_ERR_TRUNCATE. recv raises, and an irecv's ``wait()`` raises (its ``exception()`` holds it),
an error naming the call, the sender, the tag and both sizes (work.count_error).
"""
from __future__ import annotations

from hpcddp.collectives._common import as_array
from hpcddp.collectives import _large
from hpcddp.collectives._plans import ISEND, IRECV, SEND, RECV, phit
from hpcddp.collectives.call import Call, resolve, take
from hpcddp.collectives.paths import route
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
    call.root, call.tag, call.plannable, call.red = peer, tag, plan, None
    # planned on its second call in a row (the C hit then starts it: P2PWork); the record is
    # the path's (point-to-point ops have their own numbering)
    call.memo = (tensor,) if plan else None
    try:
        call.arr = as_array(tensor, fn, "tensor")
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it): no host view
        call.device, call.nbytes, call.memo = True, tensor.nbytes, None
    else:
        call.device, call.nbytes = False, call.arr.nbytes
    _check_tag(tag, fn)
    return call


def isend(tensor, dst, group=None, tag=0, *, fn: str = "isend"):
    """Start sending TENSOR to group rank DST; returns a Work (wait before reusing TENSOR):
    a C P2PWork where hpcddp's C module is built (torch Work's methods), else a Work. FN: the
    name errors give the call (the backend's: torch's send and isend both come here)."""
    work = phit(ISEND, tensor, dst, tag, group)     # the plan-hit row
    if work is not False:
        return work
    return _isend(tensor, dst, group, tag, True, fn)


def _isend(tensor, dst, group, tag, plan: bool, fn: str = "isend"):
    """isend's full path; PLAN as in :func:`_p2p`."""
    return take(_ISEND, _p2p(fn, tensor, dst, group, tag, plan))


_ISEND = route("send/recv/isend/irecv", "isend")


def send(tensor, dst, group=None, tag=0):
    """Send TENSOR to group rank DST; returns when TENSOR may be reused."""
    if phit(SEND, tensor, dst, tag, group) is not False:    # the plan-hit row
        return
    take(_SEND, _p2p("send", tensor, dst, group, tag))


_SEND = route("send/recv/isend/irecv", "send")


def irecv(tensor, src=None, group=None, tag=0, *, fn: str = "irecv"):
    """Start receiving into TENSOR from group rank SRC (None: any rank); returns a Work whose
    ``source_rank()`` names the sender once complete (a P2PWork as in :func:`isend`)."""
    work = phit(IRECV, tensor, src, tag, group)     # the plan-hit row
    if work is not False:
        return work
    return _irecv(tensor, src, group, tag, True, fn)


def _irecv(tensor, src, group, tag, plan: bool, fn: str = "irecv"):
    """irecv's full path; PLAN as in :func:`_p2p`."""
    call = _p2p(fn, tensor, src, group, tag, plan)
    if src is None and _large.too_big(tensor):
        raise ValueError(f"{fn}: src=None (any source) with {tensor.numel()} elements, over this "
                         f"MPI's count limit of {_large.MAX_COUNT}: the message travels in "
                         f"pieces that must come from one sender; give src (or use recv)")
    return take(_IRECV, call)


_IRECV = route("send/recv/isend/irecv", "irecv")


def recv(tensor, src=None, group=None, tag=0) -> int:
    """Receive into TENSOR from group rank SRC (None: any rank). Returns the sender's rank."""
    source = phit(RECV, tensor, src, tag, group)    # the plan-hit row
    if source is not False:
        return source
    return take(_RECV, _p2p("recv", tensor, src, group, tag))


_RECV = route("send/recv/isend/irecv", "recv")
