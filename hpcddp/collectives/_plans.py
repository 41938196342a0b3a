"""Plans: what all_reduce(SUM) looked up last time for a tensor, so the next call need not.

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
"""
from __future__ import annotations

import weakref

from hpcddp.comm import startup as _rt
from hpcddp.comm._mpi import MPI
from hpcddp.collectives import _node
from hpcddp.diagnostics import recorder as _rec
from hpcddp.collectives._common import IN_PLACE, record, record_end

MAX_PLANS = 4096
plans: dict = {}
ENV_MODE = "HPCDDP_FASTPATH"


def _drop(key: int, ref) -> None:
    plan = plans.get(key)
    if plan is not None and plan[0] is ref:
        del plans[key]


def _handles(comm, arr, mop):
    """(communicator, datatype, op) as the ints MPI_Allreduce takes, for the C hit: the
    datatype mpi4py itself picks for the view's typecode (a predefined one, alive as long as
    mpi4py). None where it has none (then only the Python hit runs the plan)."""
    datatype = MPI._typedict.get(arr.dtype.char)
    if datatype is None:
        return None
    return MPI._handleof(comm.mpi), MPI._handleof(datatype), MPI._handleof(mop)


def make_plan(tensor, group, comm, arr, mop) -> None:
    """Remember a validated SUM all_reduce of TENSOR on COMM (reached through GROUP).

    Layout (read by :func:`hit_py` and by _fastpath.c, whose enum names these): 0 weak ref,
    1 data_ptr, 2 the group as passed (None for the world), 3 comm, 4 numel, 5 comm.mpi,
    6 shape, 7 dtype, 8 numpy view, 9 MPI op, 10 (comm, datatype, op) handles or None.
    """
    key = id(tensor)
    rt = _rt._runtime
    if rt is not None and comm is rt.world:
        group = None     # direct calls (group=None) and torch's world group share one plan
    if len(plans) >= MAX_PLANS:
        plans.clear()
    plans[key] = (weakref.ref(tensor, lambda r, k=key: _drop(k, r)), tensor.data_ptr(), group,
                  comm, tensor.numel(), comm.mpi, tensor.shape, tensor.dtype, arr, mop,
                  _handles(comm, arr, mop))


def hit_py(tensor, group) -> bool:
    """Run TENSOR's planned SUM all_reduce on GROUP and answer True, or answer False when
    there is no plan or it no longer holds (the caller takes the full path)."""
    plan = plans.get(id(tensor))
    if plan is not None and (plan[2] is group or plan[3] is group) \
            and plan[0]() is tensor and plan[1] == tensor.data_ptr() \
            and plan[4] == tensor.numel() and plan[3].mpi is plan[5]:
        entry = record(plan[3], "all_reduce", plan[6], plan[7])
        plan[5].Allreduce(IN_PLACE, plan[8], plan[9])
        record_end(entry)
        return True
    return False


def _load_c():
    """(the C hit, "") when it can run here, else (None, why not)."""
    if record is not _rec.start:
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
    _fastpath.configure(plans, _rec.RECORDER.buf, _rec.RECORDER._slots, _rec.TICK,
                        MPI.Exception)
    return _fastpath.all_reduce_sum, ""


MODE = _node.read_mode(ENV_MODE)
if MODE == "0":
    hit, WHY_PYTHON = hit_py, f"{ENV_MODE}=0"
else:
    hit, WHY_PYTHON = _load_c()
    if hit is None:
        if MODE == "force":
            raise ImportError(f"{ENV_MODE}=force: the C all_reduce hit cannot run: {WHY_PYTHON}")
        hit = hit_py
# "C" or "Python (why)": `hpcddp info` and the benchmarks' setup print it
KIND = "C" if hit is not hit_py else f"Python ({WHY_PYTHON})"
