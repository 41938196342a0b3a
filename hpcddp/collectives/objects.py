"""Object collectives on hpcddp Communicators (the direct API).

Pickled with protocol 5 through mpi4py's ``pkl5`` communicators: out-of-band buffers and
messages over 2 GiB work (mpi4py.util.pkl5 splits them). Through torch.distributed, torch's
own ``broadcast_object_list`` & co. run on top of our tensor ops instead.
"""
from __future__ import annotations

from mpi4py.util import pkl5

from hpcddp.collectives import engine as _engine
from hpcddp.collectives._common import record, record_end, resolve



def _ready(group, fn: str):
    """FN's communicator, once the async engine has run every call issued before on it (the
    object collectives run on the caller's thread)."""
    comm = resolve(group, fn)
    _engine.drain(comm)
    return comm


def _p5(comm):
    return comm.attached("pkl5", _pkl5)


def _pkl5(comm):
    return pkl5.Intracomm(comm.mpi)      # the group's own handle, not a duplicate


def broadcast_object(obj, src=0, group=None):
    """Rank SRC's OBJ on every rank (returned)."""
    comm = _ready(group, "broadcast_object")
    comm.check_rank(src, "broadcast_object", "src")
    e = record(comm, "broadcast_object", peer=src)
    out = _p5(comm).bcast(obj, root=src)
    record_end(e)
    return out


def broadcast_object_list(object_list, src=0, group=None) -> None:
    """Replace OBJECT_LIST's items on every rank by rank SRC's (torch's signature)."""
    comm = _ready(group, "broadcast_object_list")
    if not isinstance(object_list, list):
        raise TypeError(f"broadcast_object_list: object_list must be a list, got "
                        f"{type(object_list).__name__}")
    got = broadcast_object(object_list if comm.rank == src else None, src, comm)
    if len(got) != len(object_list):
        raise ValueError(f"broadcast_object_list: object_list has {len(object_list)} items on rank "
                         f"{comm.rank}, rank {src} sent {len(got)}")
    object_list[:] = got


def all_gather_object(object_list, obj, group=None) -> None:
    """OBJECT_LIST[r] = rank r's OBJ, on every rank."""
    comm = _ready(group, "all_gather_object")
    if not isinstance(object_list, list) or len(object_list) != comm.size:
        raise ValueError(f"all_gather_object: object_list must be a list of {comm.size} items "
                         f"(one per rank), got {type(object_list).__name__} of length "
                         f"{len(object_list) if hasattr(object_list, '__len__') else '?'}")
    e = record(comm, "all_gather_object")
    object_list[:] = _p5(comm).allgather(obj)
    record_end(e)


def gather_object(obj, object_gather_list=None, dst=0, group=None) -> None:
    """On rank DST, OBJECT_GATHER_LIST[r] = rank r's OBJ."""
    comm = _ready(group, "gather_object")
    comm.check_rank(dst, "gather_object", "dst")
    if comm.rank == dst and (not isinstance(object_gather_list, list)
                             or len(object_gather_list) != comm.size):
        raise ValueError(f"gather_object: object_gather_list must be a list of {comm.size} items "
                         f"on the destination rank {dst}")
    e = record(comm, "gather_object", peer=dst)
    got = _p5(comm).gather(obj, root=dst)
    record_end(e)
    if comm.rank == dst:
        object_gather_list[:] = got


def scatter_object_list(scatter_object_output_list, scatter_object_input_list=None, src=0,
                        group=None) -> None:
    """Rank r's SCATTER_OBJECT_OUTPUT_LIST[0] = rank SRC's SCATTER_OBJECT_INPUT_LIST[r]."""
    comm = _ready(group, "scatter_object_list")
    comm.check_rank(src, "scatter_object_list", "src")
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_list: scatter_object_output_list must be a list with at "
                         "least one element (the received object goes in [0])")
    if comm.rank == src and (not isinstance(scatter_object_input_list, list)
                             or len(scatter_object_input_list) != comm.size):
        raise ValueError(f"scatter_object_list: scatter_object_input_list must be a list of "
                         f"{comm.size} items on the source rank {src}")
    e = record(comm, "scatter_object_list", peer=src)
    scatter_object_output_list[0] = _p5(comm).scatter(
        scatter_object_input_list if comm.rank == src else None, root=src)
    record_end(e)
