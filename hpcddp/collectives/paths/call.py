"""One call of an op, validated once: what :func:`hpcddp.collectives.paths.take` and the paths
read."""
from __future__ import annotations

from hpcddp.collectives._common import as_array, resolve
from hpcddp.comm.buffers import DeviceTensor


class Call:
    """One call of an op, validated once. Every op sets what ``take`` reads: ``comm``,
    ``group``, ``async_op``, ``device`` (the tensors are CUDA tensors, which the CPU
    validation leaves to the device path), ``nbytes``, and what the flight recorder files the
    call under: ``name`` (the recorded op), ``shape``, ``dtype``, ``root`` (the root or peer,
    None without one), ``red`` (a reduction's kind, else None) and ``results`` (what a
    completed async call's Work returns). The rest are the op's own, read only by the paths
    of that op. No __init__: the fields are set where they are found, which costs a small
    call less than an __init__ would (docs/benchmarks.md, "The dispatch table")."""
    __slots__ = ("comm", "group", "async_op", "device", "nbytes", "name", "shape", "dtype",
                 "root", "red", "results", "entry",
                 "tensor", "arr", "output", "out", "input", "inp", "tensors", "views", "op",
                 "mop", "kind", "tag",
                 "block",       # the list forms: one block's element count, the same on every
                                # rank (0: blocks of any size, all_to_all)
                 "splits",      # all_to_all_single on CUDA: (output, input) split sizes
                 "layout",      # all_to_all_single: (send counts, displacements, recv ...)
                 "plannable")   # point-to-point: the C plan may take the call


def pair(fn: str, output, input, group, async_op: bool, out_arg: str = "output",
         in_arg: str = "input") -> Call:
    """The Call of op FN from INPUT into OUTPUT, with their views ``out`` and ``inp`` (or
    ``device`` where one is a CUDA tensor: the device path checks them); nbytes is the op's.
    Recorded under FN with INPUT's shape and dtype, OUTPUT its result (ops refine both)."""
    call = Call()
    call.comm, call.group, call.async_op = resolve(group, fn), group, async_op
    call.output, call.input, call.nbytes = output, input, 0
    try:
        call.out = as_array(output, fn, out_arg)
        call.inp = as_array(input, fn, in_arg)
    except DeviceTensor:  # a CUDA tensor (CPU tensors never raise it)
        call.device = True
    else:
        call.device = False
    # getattr: a device call's tensors are checked by the device path, after this
    call.name, call.shape = fn, getattr(input, "shape", None)
    call.dtype = getattr(input, "dtype", None)
    call.root = call.red = None
    call.results = [output]
    return call
