"""Plans: what an op looked up last time for its tensors, so the next call need not.

all_reduce(SUM) plans first, then broadcast and reduce(SUM) plans (the rooted plans); the
exchange plans (all_to_all_single,
all_gather, all_to_all) and point-to-point plans below them. Which calls are planned is one
policy, take's memo (hpcddp.collectives.call): the second call in a row on the same tensors,
by the path that ran it (its ``plan_<op>``: the MPI path's calls, the list forms' exchange),
so the hits below answer from the third call on.

DDP's buckets, loss and metric reductions reduce the same tensors every step. A plan (one
Plan type for every kind, below) keeps, per tensor (by identity, through a weak reference),
the communicator, the MPI work and the shape/dtype for the flight recorder. ``all_reduce``
calls :data:`hit` first: when the tensor is the same object with the same memory and element
count, the group resolves to the same live communicator and the op is SUM, ``hit`` records
the op, runs MPI_Allreduce and answers True; anything else answers False and the full path
validates and re-plans.

``hit`` is C (``_fastpath.c``, built at install by setup.py with the MPI compiler wrapper)
where it was built against the MPI mpi4py runs on, else :func:`hit_py`, the same steps in
Python. At <= 1 KiB on 2 ranks raw mpi4py takes ~0.85 us; the Python hit adds ~0.8 us (the
checks ~0.25, the flight-recorder entry ~0.25, the calls), the C hit ~0.1 us
(``hpcddp bench comm``; docs/benchmarks.md). ``HPCDDP_FASTPATH=0`` keeps the Python hit,
``force`` refuses to start without the C one (tests/unit/test_fastpath.py checks the
development venv has it: a build that silently fell back would leave this path slow).
:data:`xhit`, the exchange plans' hit, is C or :func:`xhit_py` with the same choice.
"""
from __future__ import annotations

import math
import weakref
from functools import partial

from hpcddp import settings
from hpcddp.comm import startup as _rt
from hpcddp.comm._mpi import MPI
from hpcddp.collectives import _large
from hpcddp.diagnostics import recorder as _rec
from hpcddp.diagnostics.mismatch import AGREE_BYTES, checked_start
from hpcddp.launch.mpilib import other_mpi
from hpcddp.collectives._common import IN_PLACE, record, record_end
from hpcddp.collectives.work import count_error, future_of

MAX_PLANS = 4096
plans: dict = {}
ENV_MODE = "HPCDDP_FASTPATH"


# -- one Plan type, one lifetime rule ------------------------------------------------------------
# Every plan (all_reduce, exchange, point-to-point) is a Plan: the C module's type where it is
# built (its constructor unpacks the program into C fields once: _fastpath.c), else PyPlan,
# the same fields for the Python hits. A plan is filed under id() of its call's first tensor
# and holds a weak reference to it (refs[0]): that tensor's death drops the plan, and a new
# id() reusing the key finds the reference dead or another object, so the hit refuses it. A
# full table is cleared: the plans come back on the next calls.
ALLTOALLV, SENDRECV, ALLREDUCE, POINT_TO_POINT, BROADCAST, ALLGATHER, REDUCE_SCATTER, REDUCE = \
    range(8)  # _fastpath.c


class PyPlan:
    """A planned call (the Python hits' Plan; _fastpath.Plan has these fields). REFS, PTRS,
    NUMELS: per tensor of the call; GROUP as passed, its Communicator COMM and COMM.mpi; OP,
    SHAPE, DTYPE: what the recorder writes; RUN: the MPI work in Python; PROG: what C runs
    (None: C cannot); PEER, TAG, UID: point-to-point only."""
    __slots__ = ("refs", "ptrs", "numels", "group", "comm", "mpi", "op", "shape", "dtype",
                 "run", "prog", "peer", "tag", "uid")

    def __init__(self, refs, ptrs, numels, group, comm, mpi, op, shape, dtype, run, prog,
                 peer=None, tag=None, uid=None):
        self.refs, self.ptrs, self.numels = refs, ptrs, numels
        self.group, self.comm, self.mpi = group, comm, mpi
        self.op, self.shape, self.dtype = op, shape, dtype
        self.run, self.prog = run, prog
        self.peer, self.tag, self.uid = peer, tag, uid


def remember(table: dict, tensors: tuple, group, comm, *fields, **p2p) -> None:
    """File a Plan of TENSORS (the call's, in its order) reached through GROUP on COMM, with
    FIELDS (op, shape, dtype, run, prog) and P2P (peer, tag, uid), under the first tensor."""
    rt = _rt._runtime
    if rt is not None and comm is rt.world:
        group = None     # direct calls (group=None) and torch's world group share one plan
    first = tensors[0]
    key = id(first)
    if len(table) >= MAX_PLANS:
        table.clear()
    # the first tensor's death drops the plan; the others are only compared (_drop bound
    # now: a tensor that lives into the interpreter's teardown outlives the module's globals)
    refs = (weakref.ref(first, lambda r, k=key, tb=table, drop=_drop: drop(tb, k, r)),
            *(weakref.ref(t) for t in tensors[1:]))
    table[key] = Plan(refs, tuple(t.data_ptr() for t in tensors),
                      tuple(t.numel() for t in tensors), group, comm, comm.mpi, *fields, **p2p)


def _drop(table: dict, key: int, ref) -> None:
    plan = table.get(key)
    if plan is not None and plan.refs[0] is ref:
        del table[key]


def make_plan(tensor, group, comm, arr, mop) -> None:
    """Remember a validated SUM all_reduce of TENSOR on COMM (reached through GROUP)."""
    if arr.nbytes >= AGREE_BYTES:
        return           # large calls take the full path, whose record() agrees on the call
    datatype = datatype_handle(arr)   # None: no predefined MPI datatype, only the Python hit
    prog = None if datatype is None else (ALLREDUCE, MPI._handleof(comm.mpi), datatype,
                                          MPI._handleof(mop))
    remember(plans, (tensor,), group, comm, "all_reduce", tensor.shape, tensor.dtype,
             partial(comm.mpi.Allreduce, IN_PLACE, arr, mop), prog)


def _holding(table: dict, tensor, group):
    """TABLE's plan for TENSOR on GROUP where it still holds (this object, memory, element
    count, one block, dtype; the group as planned, its communicator alive), else None."""
    plan = table.get(id(tensor))
    if plan is not None and (plan.group is group or plan.comm is group) \
            and plan.refs[0]() is tensor and plan.ptrs[0] == tensor.data_ptr() \
            and plan.numels[0] == tensor.numel() and plan.comm.mpi is plan.mpi \
            and tensor.is_contiguous() and tensor.dtype is plan.dtype:
        # in-place as_strided_ and `t.data = t.view(torch.int32)` keep memory and size
        return plan
    return None


def hit_py(tensor, group) -> bool:
    """Run TENSOR's planned SUM all_reduce on GROUP and answer True, or answer False when
    there is no plan or it no longer holds (the caller takes the full path)."""
    plan = _holding(plans, tensor, group)
    if plan is not None:
        entry = record(plan.comm, "all_reduce", plan.shape, plan.dtype)
        plan.run()
        record_end(entry)
        return True
    return False


# -- broadcast plans ---------------------------------------------------------------------------
# A blocking broadcast of a tensor broadcast before from the same root on the same group (model
# and buffer syncs, a step's small config or flag tensors): what the full path checked is
# the plan; the hit records the op and runs MPI_Bcast (in C: 1.3-1.5 us raw against ~8 us
# through the full Python path at 4 B, docs/benchmarks.md "Where each path starts").
bplans: dict = {}     # id(tensor) -> plan


def make_bplan(tensor, group, comm, arr, root: int) -> None:
    """Remember a validated broadcast of TENSOR from group rank ROOT on COMM (reached
    through GROUP) that MPI's Bcast ran."""
    if arr.nbytes >= AGREE_BYTES:
        return           # large calls take the full path, whose record() agrees on the call
    datatype = datatype_handle(arr)
    root = int(root)
    prog = None if datatype is None else (BROADCAST, MPI._handleof(comm.mpi), datatype, root)
    remember(bplans, (tensor,), group, comm, "broadcast", tensor.shape, tensor.dtype,
             partial(comm.mpi.Bcast, arr, root=root), prog, peer=root)


def bhit_py(tensor, root, group) -> bool:
    """Run TENSOR's planned broadcast from ROOT on GROUP and answer True, or answer False when
    there is no plan or it no longer holds (the caller takes the full path)."""
    return _rooted_hit(bplans, "broadcast", tensor, root, group)


def _rooted_hit(table: dict, op: str, tensor, root, group) -> bool:
    plan = _holding(table, tensor, group) if type(root) is int else None
    if plan is not None and plan.peer == root:
        entry = record(plan.comm, op, plan.shape, plan.dtype, root)
        plan.run()
        record_end(entry)
        return True
    return False


# -- reduce plans ------------------------------------------------------------------------------
# A blocking SUM reduce of a tensor reduced before onto the same root on the same group (a
# step's loss or metrics summed on rank 0): the hit records the op and runs MPI_Reduce, in
# place on the root (in C: docs/benchmarks.md, "The reduce plan hit").
rplans: dict = {}     # id(tensor) -> plan


def make_rplan(tensor, group, comm, arr, mop, root: int) -> None:
    """Remember a validated blocking SUM reduce of TENSOR onto group rank ROOT on COMM
    (reached through GROUP) that MPI's Reduce ran."""
    if arr.nbytes >= AGREE_BYTES:
        return           # large calls take the full path, whose record() agrees on the call
    datatype = datatype_handle(arr)
    root = int(root)
    is_root = comm.rank == root
    prog = None if datatype is None else (REDUCE, MPI._handleof(comm.mpi), datatype,
                                          MPI._handleof(mop), root, is_root)
    run = partial(comm.mpi.Reduce, IN_PLACE, arr, mop, root=root) if is_root else \
        partial(comm.mpi.Reduce, arr, None, mop, root=root)
    remember(rplans, (tensor,), group, comm, "reduce", tensor.shape, tensor.dtype, run, prog,
             peer=root)


def rhit_py(tensor, root, group) -> bool:
    """Run TENSOR's planned SUM reduce onto ROOT on GROUP and answer True, or answer False
    when there is no plan or it no longer holds (the caller takes the full path)."""
    return _rooted_hit(rplans, "reduce", tensor, root, group)


# -- exchange plans ----------------------------------------------------------------------------
# The blocking all_to_all_single (even blocks), all_gather and all_to_all (list forms) of the
# same tensors, called again: most of their fixed cost was Python checking what it had checked
# before (as_array per tensor, dtypes, sizes, the layout; measured by
# `python -m hpcddp.bench.dispatch`, docs/benchmarks.md). A plan keeps, per call, what those
# checks found; a hit verifies every tensor is the same object with the same memory, element
# count and contiguity, on the same live communicator, then records the op and runs it.
A2A_SINGLE, ALL_GATHER, ALL_TO_ALL, ALL_GATHER_TENSOR, REDUCE_SCATTER_TENSOR, GATHER, \
    SCATTER, REDUCE_SCATTER_LIST = range(8)
REDUCTIONS = (REDUCE_SCATTER_TENSOR, REDUCE_SCATTER_LIST)   # their hits compare every dtype
PLANNED_OPS = ("all_reduce", "broadcast", "reduce", "all_to_all_single", "all_gather",
               "all_to_all", "all_gather_into_tensor", "reduce_scatter_tensor", "gather",
               "scatter", "reduce_scatter")   # + send/recv (C)
xplans: tuple = ({}, {}, {}, {}, {}, {}, {}, {})  # per kind: id(first tensor of the call) -> plan
# an exchange plan's program (what the C hit runs; None: only the Python hit runs the plan):
#   (ALLTOALLV, comm, datatype, int32 [send counts, send displs, recv counts, recv displs],
#       0): MPI_Ialltoallv + MPI_Wait from the call's tensor 1 into its tensor 0
#   (SENDRECV, comm, datatype, int64 [copy dst, copy src, copy bytes, then per step: send
#       pointer, count, dst, recv pointer, count, src], tag): the own-block memcpy, then
#       MPI_Sendrecv steps with the tag (hpcddp.collectives._lists._exchange; gather and
#       scatter: the root's steps receive or send only, with MPI_PROC_NULL on the other side)
#   (ALLGATHER, comm, datatype, count): MPI_Allgather of COUNT elements from the call's tensor 1
#       into its tensor 0 (all_gather_into_tensor)
#   (REDUCE_SCATTER, comm, datatype, count, op): MPI_Reduce_scatter_block of
#       COUNT elements per rank from the call's tensor 1 into its tensor 0 (a SUM
#       reduce_scatter_tensor; its hit also checks every tensor's dtype: a reduction adds in it)
#   (REDUCE_SCATTER, comm, datatype, count, op, int64 [per block: dst, src, bytes]): a SUM
#       reduce_scatter of a list (output, *input_list): each block copied into the plan's one
#       buffer (the first dst), then MPI_Reduce_scatter_block from it, as the MPI path's cat


def make_xplan(kind: int, tensors: tuple, group, comm, op: str, shape, dtype, run,
               prog, root=None) -> None:
    """Remember a validated blocking call of KIND on TENSORS (in the call's order) reached
    through GROUP: RUN() does its MPI work in Python, PROG (or None) in C; ROOT: gather's and
    scatter's (the hit's caller compares it: :func:`rooted_xhit`; the record carries it)."""
    if shape is not None and math.prod(shape) * dtype.itemsize >= AGREE_BYTES:
        return    # large calls take the full path, whose record() agrees on the call (SHAPE,
        #           DTYPE: what it records)
    remember(xplans[kind], tensors, group, comm, op, shape, dtype, run, prog, peer=root)


def rooted_xhit(kind: int, tensors: tuple, root, group) -> bool:
    """xhit for gather and scatter: the plan's root must be ROOT too."""
    plan = xplans[kind].get(id(tensors[0]))
    return plan is not None and plan.peer == root and xhit(kind, tensors, group)


def xhit_py(kind: int, tensors: tuple, group) -> bool:
    """Run the planned blocking call of KIND on TENSORS and answer True, or answer False when
    there is no plan or it no longer holds (the caller takes the full path)."""
    plan = xplans[kind].get(id(tensors[0]))
    if plan is None or not (plan.group is group or plan.comm is group) \
            or plan.comm.mpi is not plan.mpi or len(tensors) != len(plan.refs):
        return False
    for t, ref, ptr, numel in zip(tensors, plan.refs, plan.ptrs, plan.numels):
        if ref() is not t or t.data_ptr() != ptr or t.numel() != numel \
                or not t.is_contiguous() \
                or kind in REDUCTIONS and t.dtype is not plan.dtype:
            return False
    entry = record(plan.comm, plan.op, plan.shape, plan.dtype, plan.peer)
    plan.run()
    record_end(entry)
    return True


# -- point-to-point plans ----------------------------------------------------------------------
# isend/irecv/send/recv of a tensor used before with the same peer, tag and group: the C hit
# rechecks the tensor as the plans above do, writes the recorder's p2p entry and starts the
# MPI call; isend/irecv return a C P2PWork (a Python Work cost more to make and wait than raw
# mpi4py's whole Isend/Irecv/Wait pair: docs/benchmarks.md). Only the C module
# runs these plans: without it the full path runs as before and nothing is planned.
ISEND, IRECV, SEND, RECV = range(4)
pplans: tuple = ({}, {})   # sends, recvs: id(tensor) -> plan (a tensor may go both ways)


def make_pplan(recv: bool, tensor, group, comm, arr, peer, tag) -> bool:
    """Plan a validated send (RECV False) or recv of TENSOR (numpy view ARR) with group rank
    PEER (None: any source) and TAG on COMM, reached through GROUP. False where the C hit
    cannot run it (no C module, no predefined MPI datatype, a count over MPI's int)."""
    if _c is None or _large.too_big(arr):    # pieces: the Python path (tests lower the limit)
        return False
    datatype = datatype_handle(arr)
    if datatype is None:
        return False
    prog = (POINT_TO_POINT, MPI._handleof(comm.mpi), datatype, arr.size,
            MPI.ANY_SOURCE if peer is None else peer)   # MPI's peer: any source for None
    remember(pplans[recv], (tensor,), group, comm, "recv" if recv else "send", tensor.shape,
             tensor.dtype, None, prog, peer=peer, tag=tag, uid=comm.uid)
    return True


def _no_phit(op, tensor, peer, tag, group) -> bool:
    return False


def datatype_handle(arr):
    """The MPI datatype mpi4py picks for a numpy view, as the int the C hit takes (None where
    mpi4py has no predefined one)."""
    datatype = MPI._typedict.get(arr.dtype.char)
    return None if datatype is None else MPI._handleof(datatype)


def _load_c():
    """(the C hit, "") when it can run here, else (None, why not)."""
    if record is checked_start:
        return None, "HPCDDP_DEBUG=detail checks every op across ranks (Python hit)"
    try:
        from hpcddp.collectives import _fastpath
    except ImportError as e:
        return None, (f"not built ({e}); reinstall with an MPI C compiler on PATH or in "
                      f"$MPICC: docs/install.md")
    why_not = other_mpi(_fastpath, MPI)
    if why_not:
        return None, why_not
    ring, slots, clock, p2p_seq = _rec.RECORDER.native_writer()
    _fastpath.configure(plans, xplans, ring, slots, clock, MPI.Exception, pplans, p2p_seq,
                        future_of, count_error, bplans, rplans)
    return _fastpath, ""


MODE = settings.get().fastpath
if MODE == "0":
    _c, WHY_PYTHON = None, f"{ENV_MODE}=0"
else:
    _c, WHY_PYTHON = _load_c()
    if _c is None and MODE == "force":
        raise ImportError(f"{ENV_MODE}=force: the C all_reduce hit cannot run: {WHY_PYTHON}")
Plan = PyPlan if _c is None else _c.Plan
hit = hit_py if _c is None else _c.all_reduce_sum
bhit = bhit_py if _c is None else _c.broadcast
rhit = rhit_py if _c is None else _c.reduce_sum
xhit = xhit_py if _c is None else _c.exchange
phit = _no_phit if _c is None else _c.p2p
if _c is not None:
    PLANNED_OPS += ("send/recv",)
# "C" or "Python (why)": `hpcddp info` and the benchmarks' setup print it
KIND = "C" if hit is not hit_py else f"Python ({WHY_PYTHON})"
