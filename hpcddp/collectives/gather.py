"""Data movement from one or all ranks: broadcast, all_gather(_into_tensor), gather, scatter.

Signatures and semantics follow torch.distributed; ``group`` is an hpcddp Communicator (None:
the world). All members of the group call each op. Lists of tensors travel through one
contiguous buffer (one MPI call, then a copy); the ``_into_tensor`` forms are zero-copy.
"""
from __future__ import annotations

from hpcddp.collectives import _lists
from hpcddp.collectives import engine as _engine
from hpcddp.collectives._common import (CompletedWork, as_array, as_arrays, check_blocks,
                                        check_list, same_spec)
from hpcddp.collectives._plans import (ALL_GATHER, ALL_GATHER_TENSOR, GATHER, SCATTER,
                                       bhit as _bcast_hit, rooted_xhit as _rooted_hit,
                                       xhit as _xhit)
from hpcddp.collectives.call import Call, pair, resolve, take
from hpcddp.collectives.paths import route
from hpcddp.comm.buffers import DeviceTensor


def _one(fn: str, tensor, group, async_op, root_arg: str | None = None, root=None) -> Call:
    """The Call of an op on one tensor (and, ROOT_ARG, a root rank), validated."""
    call = Call()
    try:
        call.arr = as_array(tensor, fn, "tensor")
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it): no host view
        call.device, call.nbytes = True, tensor.nbytes
    else:
        call.device, call.nbytes = False, call.arr.nbytes
    comm = resolve(group, fn)
    if root_arg is not None:
        comm.check_rank(root, fn, root_arg)
    call.comm, call.group, call.async_op, call.tensor, call.root = (comm, group, async_op,
                                                                    tensor, root)
    call.name, call.shape, call.dtype, call.red = fn, tensor.shape, tensor.dtype, None
    call.results, call.memo = [tensor], None
    return call


# -- broadcast ---------------------------------------------------------------------------------

def broadcast(tensor, src, group=None, async_op=False):
    """Copy TENSOR from group rank SRC to every rank of the group, in place.

    Rank SRC holds x before; every rank holds x after.
    """
    # the plan-hit row (hpcddp.collectives._plans): a tensor broadcast before from SRC;
    # blocking whatever async_op, as all_reduce's (paths/mpi.py says why)
    if not _engine.pending and not (async_op and _engine.on()) and _bcast_hit(tensor, src, group):
        return None if not async_op else CompletedWork([tensor])
    call = _one("broadcast", tensor, group, async_op, "src", src)
    call.memo = None if call.device else (tensor,)
    return take(_BROADCAST, call)


_BROADCAST = route("broadcast")


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
    comm = call.comm
    check_blocks(fn, output_tensor, "output_tensor", input_tensor, "input_tensor", comm.size)
    if call.device:
        call.nbytes = output_tensor.nbytes
    else:
        call.nbytes = call.out.nbytes
        call.arr = call.out                     # the hierarchical row's count test
        if not async_op:
            call.memo = (output_tensor, input_tensor)
    call.name = "all_gather"
    return take(_ALL_GATHER_INTO_TENSOR, call)


_ALL_GATHER_INTO_TENSOR = route("all_gather_into_tensor")


# -- all_gather --------------------------------------------------------------------------------

def all_gather(tensor_list, tensor, group=None, async_op=False):
    """Every rank's TENSOR into TENSOR_LIST (one tensor per rank, rank order), on every rank."""
    # the plan-hit row: the same blocking call on the same tensors again (collectives._plans)
    if not async_op and not _engine.pending and type(tensor_list) in _lists.SEQUENCES \
            and _xhit(ALL_GATHER, (tensor, *tensor_list), group):
        return None
    fn = "all_gather"
    call = _one(fn, tensor, group, async_op)
    call.tensors, comm, block = tensor_list, call.comm, tensor.numel()
    check_list(tensor_list, comm.size, fn, "tensor_list")
    if call.device:
        same_spec(tensor_list, tensor, fn, "tensor_list", same_shape=False)
        sizes = [t.numel() for t in tensor_list]
    else:
        call.views = as_arrays(tensor_list, tensor, fn, "tensor_list", same_shape=False)
        sizes = [v.size for v in call.views]
    for i, k in enumerate(sizes):
        if k != block:
            raise ValueError(f"{fn}: tensor_list[{i}] has {k} elements, expected {block} "
                             f"(tensor's; every rank sends the same size)")
    call.block = block                          # one block, the same on every rank
    call.results = list(tensor_list)
    if not async_op and block and not call.device:
        call.memo = (tensor, *tensor_list)
    return take(_ALL_GATHER, call)


_ALL_GATHER = route("all_gather")


# -- gather, scatter ---------------------------------------------------------------------------

def gather(tensor, gather_list=None, dst=0, group=None, async_op=False):
    """Every rank's TENSOR into GATHER_LIST on group rank DST (rank order).

    gather_list: n tensors shaped like TENSOR on DST; None (or []) on the other ranks.
    """
    # the plan-hit row: the same blocking call on the same tensors, to the same root, again
    tensors = (tensor, *gather_list) if gather_list else (tensor,)
    if not async_op and not _engine.pending and _rooted_hit(GATHER, tensors, dst, group):
        return None
    call = _rooted("gather", tensor, gather_list, dst, group, async_op, "dst", "gather_list",
                   "destination")
    call.memo = None if async_op or call.device else tensors
    return take(_GATHER, call)


def _rooted(fn: str, tensor, lst, root, group, async_op, root_arg, list_arg, role) -> Call:
    """The Call of gather or scatter: LST (LIST_ARG) n tensors like TENSOR on the root, None
    or empty on the other ranks."""
    call = _one(fn, tensor, group, async_op, root_arg, root)
    call.tensors, call.block = lst, tensor.numel()    # every rank's block: the same size
    comm = call.comm
    if comm.rank == root:
        check_list(lst, comm.size, fn, list_arg)
        same_spec(lst, tensor, fn, list_arg)
        if not call.device:
            call.views = [as_array(t, fn, f"{list_arg}[{i}]") for i, t in enumerate(lst)]
    elif lst:
        raise ValueError(f"{fn}: {list_arg} must be None or empty on rank {comm.rank}, "
                         f"which is not the {role} ({root_arg}={root})")
    if fn == "gather":    # gloo's answer: the gathered tensors on the root, none elsewhere
        call.results = list(lst) if comm.rank == root else []
    return call


_GATHER = route("gather")


def scatter(tensor, scatter_list=None, src=0, group=None, async_op=False):
    """SCATTER_LIST[r] on group rank SRC into TENSOR on rank r.

    scatter_list: n tensors shaped like TENSOR on SRC; None (or []) on the other ranks.
    """
    # the plan-hit row, as gather's
    tensors = (tensor, *scatter_list) if scatter_list else (tensor,)
    if not async_op and not _engine.pending and _rooted_hit(SCATTER, tensors, src, group):
        return None
    call = _rooted("scatter", tensor, scatter_list, src, group, async_op, "src",
                   "scatter_list", "source")
    call.memo = None if async_op or call.device else tensors
    return take(_SCATTER, call)


_SCATTER = route("scatter")
