"""Counts over MPI-3's limit: one MPI call moves at most 2**31 - 1 elements (counts are C ints).

An MPI-4 library with large-count ("_c") functions takes such counts whole; Open MPI 5 does
not, and mpi4py raises MPI_ERR_ARG on every rank before any message. Above the limit hpcddp
splits the op into pieces of at most PIECE_BYTES, each a non-blocking request where the op is
non-blocking (a Work waits on them all):

- broadcast, all_reduce: the same blocking op on each piece, one after the other (these two
  ops are blocking MPI calls whatever async_op says: reduce.all_reduce says why);
- reduce: the same op on each piece (reductions are element-wise);
- all_gather(_into_tensor): one pieced broadcast per rank, of that rank's block;
- gather, scatter: pieced point-to-point messages on a private duplicate of the communicator
  (made on first use, by every member, inside the op), so they never match a user's message;
- send/recv: pieces with the user's tag, in order (MPI keeps the messages of one sender and
  one tag in order).

Why pieces and not one derived datatype of the whole size: Open MPI's broadcast of one
element of a 2 GiB datatype took 51 s here; 1 GiB pieces of bytes took 0.75 s.

Only large calls pay: the ops test the size where they already do other checks, and the
blocking broadcast/all_reduce hot paths only after MPI has refused the call.
"""
from __future__ import annotations

from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import duplicate

MAX_COUNT = 2**31 - 1
# every outstanding reduction piece allocates a temporary of its size inside MPI
PIECE_BYTES = 1 << 28
REFUSED = (MPI.Exception, OverflowError)  # what a too-large count raises, before any message
_TAG = 7


def too_big(arr, blocks: int = 1) -> bool:
    """ARR's count (a numpy view or a tensor; times BLOCKS: the whole buffer of a gather) is
    over MPI's limit."""
    count = arr.numel() if callable(arr.size) else arr.size
    return count * blocks > MAX_COUNT


def wait(reqs) -> None:
    MPI.Request.Waitall(reqs)


def pieces(arr) -> list:
    step = max(1, PIECE_BYTES // arr.itemsize)
    return [arr[o:o + step] for o in range(0, arr.size, step)]


def refuse(fn: str, arg: str, count: int):
    """For ops without a pieced form (all_to_all, reduce_scatter): a clear error, no message."""
    raise ValueError(f"{fn}: {arg} needs a count of {count} elements in one MPI call, over this "
                     f"MPI's limit of {MAX_COUNT} (MPI-3 counts are C ints); split the tensor "
                     f"into smaller calls")


def bcast(comm, arr, root) -> list:
    return [comm.mpi.Ibcast(p, root=root) for p in pieces(arr)]


def bcast_now(comm, arr, root) -> None:
    for p in pieces(arr):
        comm.mpi.Bcast(p, root=root)


def allreduce_now(comm, arr, mop) -> None:
    """One piece at a time: one temporary inside MPI, not one per piece."""
    for p in pieces(arr):
        comm.mpi.Allreduce(MPI.IN_PLACE, p, mop)


def reduce(comm, arr, mop, root) -> list:
    if comm.rank == root:
        return [comm.mpi.Ireduce(MPI.IN_PLACE, p, mop, root=root) for p in pieces(arr)]
    return [comm.mpi.Ireduce(p, None, mop, root=root) for p in pieces(arr)]


def send(mpi, arr, dst, tag) -> list:
    return [mpi.Isend(p, dst, tag) for p in pieces(arr)]


def recv(mpi, arr, src, tag) -> list:
    return [mpi.Irecv(p, src, tag) for p in pieces(arr)]


def probe_source(mpi, tag) -> int:
    """The sender of the next message with TAG (a blocking recv from any source)."""
    status = MPI.Status()
    mpi.Probe(MPI.ANY_SOURCE, tag, status)
    return status.Get_source()


def _p2p(comm):
    return comm.attached("large", duplicate)


def allgather(comm, inp, out) -> list:
    """OUT (n blocks of inp.size) gets rank i's INP in block i, on every rank."""
    b = inp.size
    out[comm.rank * b:(comm.rank + 1) * b] = inp
    reqs = []
    for i in range(comm.size):
        reqs += bcast(comm, out[i * b:(i + 1) * b], i)
    return reqs


def gather(comm, inp, out, root) -> list:
    c = _p2p(comm)
    if comm.rank != root:
        return send(c, inp, root, _TAG)
    b = inp.size
    reqs = []
    for i in range(comm.size):
        if i == root:
            out[i * b:(i + 1) * b] = inp
        else:
            reqs += recv(c, out[i * b:(i + 1) * b], i, _TAG)
    return reqs


def scatter(comm, inp, out, root) -> list:
    c = _p2p(comm)
    if comm.rank != root:
        return recv(c, out, root, _TAG)
    b = out.size
    reqs = []
    for i in range(comm.size):
        if i == root:
            out[:] = inp[i * b:(i + 1) * b]
        else:
            reqs += send(c, inp[i * b:(i + 1) * b], i, _TAG)
    return reqs
