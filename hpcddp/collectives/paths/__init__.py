"""The dispatch table: every op's paths in the order they are tried, and :func:`take`, the one
place every validated call goes through.

A path is an object that owns its ops, one method per op it serves (``OPS`` names them): the
MPI path (:mod:`.mpi`, every op; counts over MPI's int limit in pieces), the shared-memory
arena (:mod:`.arena`), cross-memory attach (:mod:`.cma`), the hierarchical path (:mod:`.hier`),
the ring over TCP links (:mod:`.ring`), the list forms' point-to-point exchange (:mod:`.lists`)
and the two device paths for CUDA tensors (:mod:`.device`). A path that serves a call from
some size on has ``min_bytes`` (a compare, so small calls skip it without a function call)
and ``applies(call, op)`` (what the group and the job decide: ranks on one node, a start-up
race against MPI, a switch in docs/settings.md); the MPI path always applies.

An op (reduce.py, gather.py, alltoall.py, p2p.py) validates its arguments once into a
:class:`~.call.Call` and hands it to :func:`take` with its :func:`route`: take records the
call in the flight recorder (and, where large, agrees on it across ranks), runs it on the
first path of the op's row list that applies, on the caller's thread or queued on the async
engine, then ends its record and answers (None, or a Work). The plan-hit rows
(``before_call``) run before validation, on the raw arguments of a call the MPI or list path
planned before (hpcddp.collectives._plans); ``hpcddp info`` prints the whole table for the
running job, each path open or closed and why (:func:`table`).

Adding a path: one class (its ops as methods, ``OPS``, ``min_bytes``, ``applies``, ``state``)
and its rows below. Adding an op: a row list here, a method on each path that serves it
(:func:`route` refuses at import a row whose path lacks the method).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from hpcddp.collectives import _node, _plans, _ring
from hpcddp.collectives import engine as _engine
from hpcddp.collectives._common import agree_recorded
from hpcddp.collectives.paths.arena import ARENA
from hpcddp.collectives.paths.call import Call, pair  # noqa: F401  (the ops' import)
from hpcddp.collectives.paths.cma import CMA
from hpcddp.collectives.paths.device import CUDA_AWARE as _CUDA_AWARE, STAGED as _STAGED
from hpcddp.collectives.paths.hier import HIER
from hpcddp.collectives.paths.lists import LISTS
from hpcddp.collectives.paths.mpi import MPI_PATH
from hpcddp.collectives.paths.ring import RING
from hpcddp.collectives.work import CompletedWork
from hpcddp.diagnostics import recorder as _rec
from hpcddp.diagnostics.mismatch import AGREE_BYTES, enabled as _detail

_start = _rec.start
_T_END, _TICK = _rec.T_END, _rec.TICK
# where take runs the cross-rank agreement after the record: every collective with
# HPCDDP_DEBUG=detail, else those of at least AGREE_BYTES (agree_recorded re-tests exactly)
_AGREE_FROM = 0 if _detail() else AGREE_BYTES


@dataclass(frozen=True)
class Path:
    """A row of the table: NAME and WHEN as ``hpcddp info`` shows them, VIA the path object
    that runs it (None: a plan hit, tried before validation, whose STATE is given)."""
    name: str
    when: str
    via: object = None
    state_of: Callable[[object, str], str] | None = None

    @property
    def before_call(self) -> bool:
        return self.via is None

    @property
    def state(self) -> Callable[[object, str], str]:
        return self.state_of if self.via is None else self.via.state

    @property
    def min_bytes(self) -> int:
        return 0 if self.via is None else self.via.min_bytes

    @property
    def applies(self):
        return None if self.via is None else self.via.applies


_mib = _node._mib


def _plan_hit(comm, op) -> str:
    return f"open ({_plans.KIND})"


def _p2p_plan_hit(comm, op) -> str:     # no Python hit: without the C module, no p2p plans
    return "open (C)" if _plans.KIND == "C" else \
        f"closed (point-to-point plans run only in the C module: {_plans.WHY_PYTHON})"


# the exchange plans are made on the second call in a row on the same tensors
# (_plans.worth_planning: fresh tensors per call never pay for one), so they hit from the third
PLAN = Path("plan hit", "the same tensors as the two calls before, blocking, "
            f"below {_mib(AGREE_BYTES)}", state_of=_plan_hit)
# the device rows: every op's first two; take() asks them only for a call on CUDA tensors
CUDA_AWARE = Path("CUDA-aware MPI", "CUDA tensors, an MPI known to be CUDA-aware, not a "
                  "user-defined reduce op: device pointers to MPI", _CUDA_AWARE)
STAGED = Path("host staging", "the other CUDA tensors: pinned host copies, large blocking "
              "ones pipelined", _STAGED)
DEVICE = (CUDA_AWARE, STAGED)
RACED = "from the size where a start-up race finds it faster than MPI"
ARENA_ROW = Path("shm arena", f"SUM/AVG/PREMUL_SUM, non-bool, {RACED}", ARENA)
LISTS_ROW = Path("point-to-point", "the list form", LISTS)
HIER_ROW = Path("hierarchical", f"several nodes, the same number of ranks on each, {RACED}",
                HIER)
RING_ROW = Path("ring", f"SUM/AVG/PREMUL_SUM of float32/64, int32/64, several nodes, on "
                        f"{'TCP links' if _ring.TRANSPORT == 'tcp' else 'MPI point-to-point'}, "
                        f"{RACED}", RING)
PIECES = "; over MPI's count limit of 2^31-1 elements, in pieces"


def _mpi(call: str, pieces: bool = True) -> Path:
    return Path(f"MPI {call}", "otherwise" + (PIECES if pieces else ""), MPI_PATH)


PATHS: dict[str, tuple[Path, ...]] = {
    "all_reduce": (Path("plan hit", f"SUM of a tensor reduced before, below {_mib(AGREE_BYTES)}",
                        state_of=_plan_hit), *DEVICE, ARENA_ROW, HIER_ROW, RING_ROW,
                   _mpi("Allreduce")),
    "broadcast": (Path("plan hit", "a tensor broadcast before from the same root, blocking, "
                       f"below {_mib(AGREE_BYTES)}", state_of=_plan_hit), *DEVICE,
                  Path("CMA", RACED, CMA), HIER_ROW, _mpi("Bcast")),
    "reduce": (*DEVICE, _mpi("Reduce")),
    "reduce_scatter": (*DEVICE, ARENA_ROW,
                       Path("point-to-point", "the list form, SUM/AVG, non-bool", LISTS),
                       _mpi("Reduce_scatter_block", pieces=False)),
    "reduce_scatter_tensor": (*DEVICE, ARENA_ROW, HIER_ROW,
                              _mpi("Reduce_scatter_block", pieces=False)),
    "all_gather": (PLAN, *DEVICE, LISTS_ROW, _mpi("Allgather")),
    "all_gather_into_tensor": (PLAN, *DEVICE, HIER_ROW, _mpi("Allgather")),
    "gather": (*DEVICE, _mpi("Gather(v)")),
    "scatter": (*DEVICE, _mpi("Scatter(v)")),
    "all_to_all": (PLAN, *DEVICE, LISTS_ROW, _mpi("Ialltoallv", pieces=False)),
    "all_to_all_single": (Path("plan hit", "even blocks, the same tensors as the two calls "
                               "before", state_of=_plan_hit), *DEVICE,
                          _mpi("Ialltoallv", pieces=False)),
    "send/recv/isend/irecv": (Path("plan hit", "a tensor sent or received before, same peer "
                                   "and tag (C module only)", state_of=_p2p_plan_hit),
                              *DEVICE, _mpi("Send/Recv (or Isend/Irecv)")),
    "barrier": (Path("MPI Barrier", "always", state_of=lambda comm, op: "open"),),
}

# ops whose MPI requests are posted on the caller's thread, never queued on the engine: MPI
# orders point-to-point messages among themselves, and a blocking send queued behind a
# blocking receive would deadlock two ranks that exchange. Their path records them, under
# their own numbering (the C plan hit records the same way).
POSTED = frozenset({"send/recv/isend/irecv"})


def route(op: str, method: str | None = None) -> tuple:
    """OP's rows for :func:`take`: each row's path and its method METHOD (default OP), in
    table order. Refused at import: a row whose path does not serve the op, device rows that
    do not come first, a last row that does not always apply."""
    rows = [p for p in PATHS[op] if not p.before_call]
    name = method or op
    missing = [p.name for p in rows if name not in p.via.OPS or not callable(
        getattr(p.via, name, None))]
    host = rows[len(DEVICE):]
    if missing or tuple(rows[:len(DEVICE)]) != DEVICE or host[-1].applies is not None:
        raise RuntimeError(f"route({op!r}): the table's rows are {[p.name for p in rows]} (the "
                           f"device rows first, a last row that always applies); the rows "
                           f"whose path has no method {name!r}: {missing}")
    runs = [getattr(p.via, name) for p in host]
    # below every middle row's min_bytes a call goes straight to the last row, the one a
    # small call takes: no row to ask (0 where a middle row applies at any size)
    floor = min((p.min_bytes for p in host[:-1]), default=1 << 62)
    return (CUDA_AWARE.applies, getattr(CUDA_AWARE.via, name), getattr(STAGED.via, name),
            floor, runs[-1],
            tuple((p.min_bytes, p.applies and functools.partial(p.applies, op=op), run)
                  for p, run in zip(host, runs)),
            op not in POSTED)


def take(route: tuple, call: Call):
    """Run CALL on the first of ROUTE's paths that applies (the last, MPI, always does).

    A call on CUDA tensors goes to a device row. A collective is recorded here (and, where
    large, agreed on by every rank before any path is asked: a node-local path's first use is
    collective, and the arguments that choose it are the ones agreed on), runs on the
    caller's thread, or queued on the async engine (hpcddp.collectives.engine) where it is
    async and the engine on, or where calls issued before it are still queued; its path
    returns None once it is complete (take ends the record and answers: None, or a completed
    Work for async_op) or the Work that completes it. Point-to-point ops go straight to their
    path, which records them."""
    if call.device:       # the device rows (a flag, tested without a call)
        _engine.drain()   # the caller's thread keeps its CUDA stream
        return route[1](call) if route[0](call) else route[2](call)
    if not route[6]:
        return _run(route, call)
    if _engine.pending or call.async_op and _engine.on():
        # recorded now, in issue order; the agreement runs on the engine's thread, just
        # before the call, in the same order on every rank
        call.entry = _start(call.comm, call.name, call.shape, call.dtype, call.root)
        run = functools.partial(_queued, route)
        if call.async_op:
            return _engine.submit(run, call)
        _engine.in_order(run, call)
        return None
    # the caller's thread: the rows asked inline (this is every blocking call's way)
    call.entry = entry = _start(call.comm, call.name, call.shape, call.dtype, call.root)
    nbytes = call.nbytes
    if nbytes >= _AGREE_FROM:
        agree_recorded(call.comm, entry, call.red)
    if nbytes < route[3]:    # smaller than every middle row's min_bytes
        done = route[4](call)
    else:
        for min_bytes, applies, run in route[5]:
            if nbytes >= min_bytes and (applies is None or applies(call)):
                done = run(call)
                break
    if done is None:         # complete: the record's end (recorder.end, inline) and answer
        entry[_T_END] = _TICK[0]
        return CompletedWork(call.results) if call.async_op else None
    return done


def _queued(route: tuple, call: Call):
    """A queued CALL on the engine's thread: the cross-rank agreement, its row, its end."""
    entry = call.entry
    agree_recorded(call.comm, entry, call.red)
    done = _run(route, call)
    if done is None:
        entry[_T_END] = _TICK[0]
        return CompletedWork(call.results)
    return done


def _run(route: tuple, call: Call):
    """CALL (on CPU tensors) on the first of ROUTE's host rows that applies: what it returns."""
    nbytes = call.nbytes
    if nbytes < route[3]:
        return route[4](call)
    for min_bytes, applies, run in route[5]:
        if nbytes >= min_bytes and (applies is None or applies(call)):
            return run(call)


def table(comm) -> list[dict]:
    """Every op's paths in order, each with its state on COMM (collective over COMM: the
    node-local paths are set up, and raced, on first use)."""
    cache: dict = {}
    out = []
    for op, paths in PATHS.items():
        for i, p in enumerate(paths, 1):
            if p.state is None:
                state = "open"
            else:
                if (p.state, op) not in cache:
                    cache[p.state, op] = p.state(comm, op)
                state = cache[p.state, op]
            out.append({"op": op, "order": i, "path": p.name, "when": p.when, "state": state})
    return out


def format_table(rows: list[dict]) -> str:
    """The table as text: one block per op, its paths in the order they are tried."""
    lines = ["which path a call takes (the first that applies, in this order):"]
    last = None
    for r in rows:
        op = r["op"] if r["op"] != last else ""
        last = r["op"]
        lines.append(f"  {op:<22} {r['order']}. {r['path']} ({r['when']}): {r['state']}")
    return "\n".join(lines)
