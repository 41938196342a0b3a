"""All-to-all: all_to_all_single (equal or given splits) and all_to_all (lists).

Signatures and semantics follow torch.distributed; all members of the group call each op.
"""
from __future__ import annotations

from itertools import accumulate

from hpcddp.collectives import _large
from hpcddp.collectives import _lists
from hpcddp.collectives._plans import A2A_SINGLE, ALL_TO_ALL, xhit as _xhit
from hpcddp.collectives._common import as_array, as_arrays, check_list, same_spec
from hpcddp.collectives import engine as _engine
from hpcddp.collectives.call import Call, pair, resolve, take
from hpcddp.collectives.paths import route
from hpcddp.comm.buffers import DeviceTensor

_even: dict = {}   # (group size, elements) -> (counts, displacements) of even blocks


def _splits(splits, total_rows: int, n: int, fn: str, arg: str) -> list[int]:
    if splits is None or len(splits) == 0:
        if total_rows % n:
            raise ValueError(f"{fn}: {arg} not given, so dim 0 ({total_rows}) must divide evenly "
                             f"by the group size {n}")
        return [total_rows // n] * n
    splits = [int(s) for s in splits]
    if len(splits) != n:
        raise ValueError(f"{fn}: {arg} has {len(splits)} entries, expected {n} (one per rank)")
    if any(s < 0 for s in splits) or sum(splits) != total_rows:
        raise ValueError(f"{fn}: {arg}={splits} must be non-negative and sum to dim 0 "
                         f"({total_rows})")
    return splits


def v_layout(output, input, output_split_sizes, input_split_sizes, n: int, r: int, fn: str):
    """(send counts, send displacements, receive counts, receive displacements) in elements
    for MPI_Alltoallv, from the splits along dim 0 (validated, naming FN's arguments); this
    rank's block to itself must be as big in OUTPUT as in INPUT."""
    in_rows = input.shape[0] if input.dim() else 1
    out_rows = output.shape[0] if output.dim() else 1
    row_in = input.numel() // in_rows if in_rows else 0
    row_out = output.numel() // out_rows if out_rows else 0
    sin = _splits(input_split_sizes, in_rows, n, fn, "input_split_sizes")
    sout = _splits(output_split_sizes, out_rows, n, fn, "output_split_sizes")
    scounts = [k * row_in for k in sin]
    rcounts = [k * row_out for k in sout]
    if scounts[r] != rcounts[r]:
        raise ValueError(f"{fn}: this rank's block to itself has {scounts[r]} elements in "
                         f"input but {rcounts[r]} in output (input_split_sizes[{r}] x "
                         f"{row_in} vs output_split_sizes[{r}] x {row_out})")
    return (scounts, list(accumulate(scounts[:-1], initial=0)),
            rcounts, list(accumulate(rcounts[:-1], initial=0)))


def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None,
                      group=None, async_op=False):
    """Split INPUT along dim 0 and send block j to rank j; receive into OUTPUT in rank order.

    Without split sizes, dim 0 is split evenly. Rank i's OUTPUT holds block i of every
    rank's INPUT, concatenated in rank order.
    """
    fn = "all_to_all_single"
    # the plan-hit row: the same blocking even-blocks call again (hpcddp.collectives._plans)
    if not async_op and not _engine.pending and (input_split_sizes is None or len(input_split_sizes) == 0) \
            and (output_split_sizes is None or len(output_split_sizes) == 0) \
            and _xhit(A2A_SINGLE, (output, input), group):
        return None
    call = pair(fn, output, input, group, async_op)
    if call.device:
        n_out, n_in, call.nbytes = output.numel(), input.numel(), input.nbytes
    else:
        n_out, n_in, call.nbytes = call.out.size, call.inp.size, call.inp.nbytes
    # counts, displacements; even blocks of a blocking call are planned on its second call
    call.layout, even = _layout(output, input, n_out, n_in, output_split_sizes,
                                input_split_sizes, call.comm)
    if even and not async_op and n_in and not call.device:
        call.memo = (output, input)
    call.name = "all_to_all"
    return take(_ALL_TO_ALL_SINGLE, call)


def _layout(output, input, n_out, n_in, output_split_sizes, input_split_sizes, comm):
    """((send counts, send displacements, receive counts, receive displacements), whether
    the blocks are even), validated; N_OUT, N_IN: the tensors' element counts."""
    fn = "all_to_all_single"
    if input.dtype != output.dtype:
        raise TypeError(f"{fn}: output has dtype {output.dtype}, expected {input.dtype} (input's)")
    n, r = comm.size, comm.rank
    if max(n_in, n_out) > _large.MAX_COUNT:
        _large.refuse(fn, "input" if n_in > _large.MAX_COUNT else "output", max(n_in, n_out))
    # no splits: None from the direct API, [] from torch.distributed
    if (input_split_sizes is None or len(input_split_sizes) == 0) \
            and (output_split_sizes is None or len(output_split_sizes) == 0) \
            and n_in == n_out \
            and input.dim() and output.dim() and not input.shape[0] % n \
            and not output.shape[0] % n:
        # the common call, even blocks: its counts are cached (building the count lists
        # per call was a sizeable part of a small all_to_all_single: docs/benchmarks.md)
        layout = _even.get((n, n_in))
        if layout is None:
            if len(_even) >= 256:
                _even.clear()
            c = n_in // n
            layout = _even[(n, n_in)] = ([c] * n, [c * j for j in range(n)])
        counts = (*layout, *layout)
    else:
        layout = None
        counts = v_layout(output, input, output_split_sizes, input_split_sizes, n, r, fn)
    if n_in and output.data_ptr() == input.data_ptr():
        raise ValueError(f"{fn}: output and input are the same memory; an all-to-all reads "
                         f"input while it writes output: pass separate tensors")
    return counts, layout is not None


_ALL_TO_ALL_SINGLE = route("all_to_all_single")


def all_to_all(output_tensor_list, input_tensor_list, group=None, async_op=False):
    """Send INPUT_TENSOR_LIST[j] to rank j; receive rank j's into OUTPUT_TENSOR_LIST[j]."""
    fn = "all_to_all"
    # the plan-hit row: the same blocking call on the same tensors again (collectives._plans)
    if not async_op and not _engine.pending and type(output_tensor_list) in _lists.SEQUENCES \
            and type(input_tensor_list) in _lists.SEQUENCES and output_tensor_list \
            and _xhit(ALL_TO_ALL, (*output_tensor_list, *input_tensor_list), group):
        return None
    comm = resolve(group, fn)
    n = comm.size
    check_list(input_tensor_list, n, fn, "input_tensor_list")
    check_list(output_tensor_list, n, fn, "output_tensor_list")
    ref = input_tensor_list[0]
    call = Call()
    call.comm, call.group, call.async_op, call.memo = comm, group, async_op, None
    call.output, call.input = output_tensor_list, input_tensor_list
    call.nbytes = 0                             # the rows below MPI's have no size threshold
    r = comm.rank
    try:
        as_array(ref, fn, "input_tensor_list[0]")
    except DeviceTensor:
        call.device = True
        same_spec(input_tensor_list, ref, fn, "input_tensor_list", same_shape=False)
        same_spec(output_tensor_list, ref, fn, "output_tensor_list", same_shape=False)
        own_out, own_in = output_tensor_list[r].numel(), input_tensor_list[r].numel()
    else:
        call.device = False
        call.inp = as_arrays(input_tensor_list, ref, fn, "input_tensor_list", same_shape=False)
        call.out = as_arrays(output_tensor_list, ref, fn, "output_tensor_list",
                             same_shape=False)
        own_out, own_in = call.out[r].size, call.inp[r].size
        if not async_op:
            call.memo = (*output_tensor_list, *input_tensor_list)
    if own_out != own_in:                       # before the record, on every path
        raise ValueError(f"{fn}: output_tensor_list[{r}] has {own_out} elements but "
                         f"input_tensor_list[{r}] (this rank's block to itself) has {own_in}")
    call.block = 0                              # blocks of any size
    call.name, call.shape, call.dtype, call.root, call.red = (fn, ref.shape, ref.dtype, None,
                                                              None)
    call.results = list(output_tensor_list)
    return take(_ALL_TO_ALL, call)


_ALL_TO_ALL = route("all_to_all")
