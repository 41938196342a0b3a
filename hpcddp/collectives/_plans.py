"""Plans: what an op looked up last time for its tensors, so the next call need not.

all_reduce(SUM) plans first; the exchange plans (all_to_all_single, all_gather, all_to_all)
below them.

DDP's buckets, loss and metric reductions reduce the same tensors every step. A plan keeps,
per tensor (by identity, through a weak reference), the communicator, the numpy view, the MPI
op and the shape/dtype for the flight recorder. ``all_reduce`` calls :data:`hit` first: when
the tensor is the same object with the same memory and element count, the group resolves to
the same live communicator and the op is SUM, ``hit`` records the op, runs MPI_Allreduce and
answers True; anything else answers False and the full path validates and re-plans.

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

from hpcddp import settings
from hpcddp.comm import startup as _rt
from hpcddp.comm._mpi import MPI
from hpcddp.collectives import _large
from hpcddp.diagnostics import recorder as _rec
from hpcddp.diagnostics.mismatch import AGREE_BYTES, checked_start
from hpcddp.collectives._common import IN_PLACE, record, record_end
from hpcddp.collectives.work import count_error, future_of

MAX_PLANS = 4096
plans: dict = {}
ENV_MODE = "HPCDDP_FASTPATH"


# -- the one lifetime rule of every plan table ---------------------------------------------------
# A plan is filed under id() of its call's first tensor and holds a weak reference to it (its
# field 0, or the first of the tuple of references there): that tensor's death drops the plan, and a new id() reusing the key finds the
# reference dead or another object, so the hit refuses it. A full table is cleared: the plans
# come back on the next calls.

def remember(table: dict, tensor, make) -> None:
    """File MAKE(weak reference to TENSOR) as TABLE's plan for TENSOR."""
    key = id(tensor)
    if len(table) >= MAX_PLANS:
        table.clear()
    table[key] = make(weakref.ref(tensor, lambda r, k=key, tb=table: _drop(tb, k, r)))


def _drop(table: dict, key: int, ref) -> None:
    plan = table.get(key)
    if plan is not None:
        first = plan[0]
        if first is ref or (type(first) is tuple and first[0] is ref):
            del table[key]


def _handles(comm, arr, mop):
    """(communicator, datatype, op) as the ints MPI_Allreduce takes, for the C hit. None where
    the view's type has no predefined MPI datatype (then only the Python hit runs the plan)."""
    datatype = datatype_handle(arr)
    if datatype is None:
        return None
    return MPI._handleof(comm.mpi), datatype, MPI._handleof(mop)


def make_plan(tensor, group, comm, arr, mop) -> None:
    """Remember a validated SUM all_reduce of TENSOR on COMM (reached through GROUP).

    Layout (read by :func:`hit_py` and by _fastpath.c, whose enum names these): 0 weak ref,
    1 data_ptr, 2 the group as passed (None for the world), 3 comm, 4 numel, 5 comm.mpi,
    6 shape, 7 dtype, 8 numpy view, 9 MPI op, 10 (comm, datatype, op) handles or None.
    """
    if arr.nbytes >= AGREE_BYTES:
        return           # large calls take the full path, whose record() agrees on the call
    rt = _rt._runtime
    if rt is not None and comm is rt.world:
        group = None     # direct calls (group=None) and torch's world group share one plan
    remember(plans, tensor, lambda ref: (
        ref, tensor.data_ptr(), group, comm, tensor.numel(), comm.mpi, tensor.shape,
        tensor.dtype, arr, mop, _handles(comm, arr, mop)))


def hit_py(tensor, group) -> bool:
    """Run TENSOR's planned SUM all_reduce on GROUP and answer True, or answer False when
    there is no plan or it no longer holds (the caller takes the full path)."""
    plan = plans.get(id(tensor))
    if plan is not None and (plan[2] is group or plan[3] is group) \
            and plan[0]() is tensor and plan[1] == tensor.data_ptr() \
            and plan[4] == tensor.numel() and plan[3].mpi is plan[5] \
            and tensor.is_contiguous() and tensor.dtype is plan[7]:
        # in-place as_strided_ and `t.data = t.view(torch.int32)` keep memory and size
        entry = record(plan[3], "all_reduce", plan[6], plan[7])
        plan[5].Allreduce(IN_PLACE, plan[8], plan[9])
        record_end(entry)
        return True
    return False


# -- exchange plans ----------------------------------------------------------------------------
# The blocking all_to_all_single (even blocks), all_gather and all_to_all (list forms) of the
# same tensors, called again: most of their fixed cost was Python checking what it had checked
# before (as_array per tensor, dtypes, sizes, the layout; measured by
# `python -m hpcddp.bench.dispatch`, docs/benchmarks.md). A plan keeps, per call, what those
# checks found; a hit verifies every tensor is the same object with the same memory, element
# count and contiguity, on the same live communicator, then records the op and runs it.
A2A_SINGLE, ALL_GATHER, ALL_TO_ALL = range(3)
PLANNED_OPS = ("all_reduce", "all_to_all_single", "all_gather", "all_to_all")   # + send/recv (C)
xplans: tuple = ({}, {}, {})   # per kind: id(first tensor of the call) -> plan
# plan layout (read by xhit_py and by _fastpath.c, whose enum names these)
(X_REFS, X_PTRS, X_NUMELS, X_GROUP, X_COMM, X_MPI, X_OP, X_SHAPE, X_DTYPE, X_RUN,
 X_PROG, X_LEN) = range(12)
# X_PROG, what the C hit runs (None: only the Python hit runs the plan):
#   (ALLTOALLV, comm, datatype, int32 [send counts, send displs, recv counts, recv displs]):
#       MPI_Ialltoallv + MPI_Wait from the call's tensor 1 into its tensor 0
#   (SENDRECV, comm, datatype, int64 [copy dst, copy src, copy bytes, then per step: send
#       pointer, count, dst, recv pointer, count, src]): the own-block memcpy, then
#       MPI_Sendrecv steps with tag TAG (hpcddp.collectives._lists._exchange)
ALLTOALLV, SENDRECV = range(2)


_seen: tuple = ({}, {}, {})     # per kind: id(first tensor) -> (ids of the call's tensors, plans made)
MAX_REPLANS = 3


def worth_planning(kind: int, tensors: tuple) -> bool:
    """Whether the full path should plan this call: the second call in a row on the same
    tensor objects (a list of fresh tensors per call never gets a plan, which would cost it
    more than it saves), and not a key planned over and over (fresh tensors whose ids the
    allocator reuses look the same by id: after MAX_REPLANS plans it stays unplanned)."""
    table = _seen[kind]
    key = id(tensors[0])
    ids = tuple(map(id, tensors))
    seen = table.get(key)
    if seen is None or seen[0] != ids:
        if len(table) >= MAX_PLANS:
            table.clear()
        table[key] = (ids, 0 if seen is None else seen[1])
        return False
    if seen[1] >= MAX_REPLANS:
        return False
    table[key] = (ids, seen[1] + 1)
    return True


def make_xplan(kind: int, tensors: tuple, group, comm, op: str, shape, dtype, run,
               prog) -> None:
    """Remember a validated blocking call of KIND on TENSORS (in the call's order) reached
    through GROUP: RUN() does its MPI work in Python, PROG (or None) in C."""
    if shape is not None and math.prod(shape) * dtype.itemsize >= AGREE_BYTES:
        return    # large calls take the full path, whose record() agrees on the call (SHAPE,
        #           DTYPE: what it records)
    rt = _rt._runtime
    if rt is not None and comm is rt.world:
        group = None
    # the first tensor's death drops the plan; the others are only compared
    remember(xplans[kind], tensors[0], lambda ref: (
        (ref, *(weakref.ref(t) for t in tensors[1:])), tuple(t.data_ptr() for t in tensors),
        tuple(t.numel() for t in tensors), group, comm, comm.mpi, op, shape, dtype, run, prog))


def xhit_py(kind: int, tensors: tuple, group) -> bool:
    """Run the planned blocking call of KIND on TENSORS and answer True, or answer False when
    there is no plan or it no longer holds (the caller takes the full path)."""
    plan = xplans[kind].get(id(tensors[0]))
    if plan is None or not (plan[X_GROUP] is group or plan[X_COMM] is group) \
            or plan[X_COMM].mpi is not plan[X_MPI] or len(tensors) != len(plan[X_REFS]):
        return False
    for t, ref, ptr, numel in zip(tensors, plan[X_REFS], plan[X_PTRS], plan[X_NUMELS]):
        if ref() is not t or t.data_ptr() != ptr or t.numel() != numel \
                or not t.is_contiguous():
            return False
    entry = record(plan[X_COMM], plan[X_OP], plan[X_SHAPE], plan[X_DTYPE])
    plan[X_RUN]()
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
# plan layout (read by _fastpath.c, whose enum names these); PROG: (comm, datatype, count,
# MPI peer) as ints (MPI_ANY_SOURCE for an irecv/recv from any rank)
(Q_REF, Q_PTR, Q_NUMEL, Q_DTYPE, Q_GROUP, Q_COMM, Q_MPI, Q_PEER, Q_TAG, Q_SHAPE, Q_UID, Q_OP,
 Q_PROG, Q_LEN) = range(14)


def make_pplan(recv: bool, tensor, group, comm, arr, peer, tag) -> bool:
    """Plan a validated send (RECV False) or recv of TENSOR (numpy view ARR) with group rank
    PEER (None: any source) and TAG on COMM, reached through GROUP. False where the C hit
    cannot run it (no C module, no predefined MPI datatype, a count over MPI's int)."""
    if _c is None or _large.too_big(arr):    # pieces: the Python path (tests lower the limit)
        return False
    datatype = datatype_handle(arr)
    if datatype is None:
        return False
    rt = _rt._runtime
    if rt is not None and comm is rt.world:
        group = None
    prog = (MPI._handleof(comm.mpi), datatype, arr.size, MPI.ANY_SOURCE if peer is None else peer)
    remember(pplans[recv], tensor, lambda ref: (
        ref, tensor.data_ptr(), tensor.numel(), tensor.dtype, group, comm, comm.mpi, peer, tag,
        tensor.shape, comm.uid, "recv" if recv else "send", prog))
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
    ours, theirs = _fastpath.library_version(), MPI.Get_library_version()
    if ours.split("\n")[0].strip() != theirs.split("\n")[0].strip():
        return None, (f"built against another MPI ({ours.splitlines()[0]!r}) than mpi4py's "
                      f"({theirs.splitlines()[0]!r}): reinstall hpcddp")
    _fastpath.configure(plans, xplans, _rec.RECORDER.buf, _rec.RECORDER._slots, _rec.TICK,
                        MPI.Exception, pplans, _rec.RECORDER._p2p_seq, future_of, count_error)
    return _fastpath, ""


MODE = settings.get().fastpath
if MODE == "0":
    _c, WHY_PYTHON = None, f"{ENV_MODE}=0"
else:
    _c, WHY_PYTHON = _load_c()
    if _c is None and MODE == "force":
        raise ImportError(f"{ENV_MODE}=force: the C all_reduce hit cannot run: {WHY_PYTHON}")
hit = hit_py if _c is None else _c.all_reduce_sum
xhit = xhit_py if _c is None else _c.exchange
phit = _no_phit if _c is None else _c.p2p
if _c is not None:
    PLANNED_OPS += ("send/recv",)
# "C" or "Python (why)": `hpcddp info` and the benchmarks' setup print it
KIND = "C" if hit is not hit_py else f"Python ({WHY_PYTHON})"
