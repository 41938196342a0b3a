"""The dispatch table: every op's paths in the order they are tried, and the call they read.

An op validates its arguments once into a :class:`Call` (communicator, views, dtype, reduce op,
root, byte count), records it, then takes the first path of its row in :data:`PATHS` that
applies (:func:`take`). A path applies when the call has at least its ``min_bytes`` (a compare,
so small calls skip the node-local paths without a function call) and its ``applies(call)``
answers True (what the group and the job decide: ranks on one node, a start-up race against
MPI, a switch in docs/settings.md). Each op module names how each of its rows runs with
:func:`route`, which refuses at import a row without a runner or a runner without a row: the
order here is the order calls take, by construction.

The plan hits (``before_call`` rows) run before validation, on the raw arguments of a call seen
before (hpcddp.collectives._plans); ``hpcddp info`` prints the whole table for the running job,
each path open or closed and why (:func:`table`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from hpcddp.collectives import _cma, _device, _hier, _large, _lists, _node, _plans, _ring, _shm
from hpcddp.collectives import engine as _engine
from hpcddp.collectives._common import agree_recorded, as_array, resolve
from hpcddp.comm.buffers import DeviceTensor
from hpcddp.diagnostics.mismatch import AGREE_BYTES


class Call:
    """One call of an op, validated once: what its paths read. An op sets the fields it has
    (a reduction its ``mop`` and ``kind``, a rooted op its ``root``, ...); a path reads only
    the fields of the ops it serves. Every op sets ``comm``, ``group``, ``async_op``,
    ``device`` (the tensors are CUDA tensors, which the CPU validation leaves to the device
    path) and ``nbytes``. No __init__: the fields are set where they are found, which costs a
    small call less than an __init__ would (docs/benchmarks.md, "The dispatch table")."""
    __slots__ = ("comm", "group", "async_op", "device", "nbytes", "tensor", "arr", "output",
                 "out", "input", "inp", "tensors", "views", "dtype", "op", "mop", "kind", "root",
                 "tag", "entry", "red", "queued",
                 "block",       # the list forms: one block's element count, the same on every
                                # rank (0: blocks of any size, all_to_all)
                 "splits",      # all_to_all_single on CUDA: (output, input) split sizes
                 "layout",      # all_to_all_single: (send counts, displacements, recv ...)
                 "plannable")   # point-to-point: the C plan may take the call


def pair(fn: str, output, input, group, async_op: bool, out_arg: str = "output",
         in_arg: str = "input") -> Call:
    """The Call of op FN from INPUT into OUTPUT, with their views ``out`` and ``inp`` (or
    ``device`` where one is a CUDA tensor: the device path checks them); nbytes is the op's."""
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
    return call


@dataclass(frozen=True)
class Path:
    name: str
    when: str                                     # what the call must be for this path
    state: Callable[[object, str], str] | None = None  # group, op -> "open ..." or "closed (why)"
    min_bytes: int = 0                            # smaller calls skip it
    # the rest of the condition, given the call and its op (None: always)
    applies: Callable[[Call, str], bool] | None = None
    before_call: bool = False                     # a plan hit: tried before validation
    # how the row runs: the name of its runner in each op module's route() (the device rows
    # share one runner, "device"; the plan hits have none)
    kind: str = "mpi"


_mib = _node._mib


def _plan_hit(comm, op) -> str:
    return f"open ({_plans.KIND})"


def _p2p_plan_hit(comm, op) -> str:     # no Python hit: without the C module, no p2p plans
    return "open (C)" if _plans.KIND == "C" else \
        f"closed (point-to-point plans run only in the C module: {_plans.WHY_PYTHON})"


def _cuda_aware_state(comm, op) -> str:
    from hpcddp.comm.cuda import cuda_awareness
    try:
        found = cuda_awareness()
    except Exception as e:  # detection must never break the report
        return f"closed (detection failed: {e})"
    return "open" if found.aware is True else \
        f"closed (this MPI is not known to be CUDA-aware: {found.status()})"


def _node_local(module, variable: str, opened, unopened: str, raced: dict | None = None):
    """The state of a node-local path for an op: its switch (MODULE.MODE, read from VARIABLE
    at import: the value the path's own usable() tests), then whether
    OPENED(comm) set it up for the group (closed: UNOPENED), then from which size it serves
    the op (RACED: the table's ops -> the op its start-up race measures; the race runs here
    if the op has not had it)."""
    def state(comm, op) -> str:
        if module.MODE == "0":
            return f"closed ({variable}=0)"
        if comm.size < 2:
            return "closed (one rank)"
        path = opened(comm)
        if path is None:
            return f"closed ({unopened})"
        if raced is None:
            return "open"
        starts = path.starts
        start = starts.start(raced[op])
        if starts.forced:
            return f"open from {_mib(start)} ({variable}=force: no race)"
        found = starts.found[raced[op]]
        if start is None:
            return (f"closed ({_node.losing(found.win)} than MPI at any size raced, up to "
                    f"{_mib(found.steps[-1][0])}: {found.why()})")
        return f"open from {_mib(start)} ({found.why()})"
    return state


_arena = _node_local(_shm, "HPCDDP_SHM_ALLREDUCE", lambda c: _shm.arena(c),
                     "ranks on several nodes, or no room in /dev/shm", _shm.RACED)
_cma_state = _node_local(_cma, "HPCDDP_CMA", lambda c: _cma.peers(c),
                         "ranks on several nodes, or the kernel refuses", {"broadcast": "broadcast"})
_hier_state = _node_local(_hier, "HPCDDP_HIER", lambda c: _hier.hier(c),
                          "one node, or nodes with different numbers of the group's ranks",
                          _hier.RACED)


def _p2p_lists(comm, op) -> str:
    limit = _lists._MAX_RANKS
    return "open" if 1 < comm.size <= limit else \
        f"closed ({comm.size} ranks; HPCDDP_LIST_P2P_MAX_RANKS={limit})"


# -- the rows ------------------------------------------------------------------------------------
# applies(call) runs only where the call has min_bytes; it must give the same answer on every
# rank of the group (a collective's arguments agree), and may set up the path on first use
# (collective: every rank asks at the same call).

def _arena_applies(c: Call, op: str) -> bool:
    return _shm.usable(c.comm, c.nbytes, c.dtype, c.kind, op)


def _hier_applies(c: Call, op: str) -> bool:     # pieces over MPI's count limit take the MPI row
    return _hier.usable(c.comm, c.nbytes, op) and not _large.too_big(c.arr)


def _ring_applies(c: Call, op: str) -> bool:    # pieces over MPI's count limit take the MPI row
    return _ring.usable(c.comm, c.nbytes, c.arr, c.mop) and not _large.too_big(c.arr)


def _cma_applies(c: Call, op: str) -> bool:
    return _cma.usable(c.comm, c.nbytes)


def _lists_applies(c: Call, op: str) -> bool:
    """The list forms' point-to-point exchange."""
    return _lists.use_p2p(c.comm, c.block)


def _lists_reduce_scatter_applies(c: Call, op: str) -> bool:
    return _lists.use_p2p(c.comm, c.block) and _lists.reduce_scatter_supported(c.kind, c.dtype)


# the exchange plans are made on the second call in a row on the same tensors
# (_plans.worth_planning: fresh tensors per call never pay for one), so they hit from the third
PLAN = Path("plan hit", "the same tensors as the two calls before, blocking, "
            f"below {_mib(AGREE_BYTES)}", _plan_hit, before_call=True)
# the device rows: every op's first two; take() asks them only for a call on CUDA tensors
CUDA_AWARE = Path("CUDA-aware MPI", "CUDA tensors, an MPI known to be CUDA-aware, not a "
                  "user-defined reduce op: device pointers to MPI", _cuda_aware_state,
                  applies=_device.cuda_aware)
STAGED = Path("host staging", "the other CUDA tensors: pinned host copies, large blocking "
              "ones pipelined", lambda comm, op: "open")
DEVICE = (CUDA_AWARE, STAGED)
RACED = "from the size where a start-up race finds it faster than MPI"
ARENA = Path("shm arena", f"SUM/AVG/PREMUL_SUM, non-bool, {RACED}", _arena,
             min_bytes=_shm.MIN_BYTES, applies=_arena_applies, kind="arena")
LISTS = Path("point-to-point", "the list form", _p2p_lists, applies=_lists_applies,
             kind="lists")
HIER = Path("hierarchical", f"several nodes, the same number of ranks on each, {RACED}",
            _hier_state, min_bytes=_hier.MIN_BYTES, applies=_hier_applies, kind="hier")
RING = Path("ring", f"SUM/AVG/PREMUL_SUM of float32/64, int32/64, several nodes, on "
                    f"{'TCP links' if _ring.TRANSPORT == 'tcp' else 'MPI point-to-point'}, {RACED}",
            _node_local(_ring, "HPCDDP_RING", lambda c: _ring.ring(c),
                        "the group is on one node", {"all_reduce": "all_reduce"}),
            min_bytes=_ring.MIN_BYTES, applies=_ring_applies, kind="ring")
PIECES = "; over MPI's count limit of 2^31-1 elements, in pieces"


def _mpi(call: str, pieces: bool = True) -> Path:
    return Path(f"MPI {call}", "otherwise" + (PIECES if pieces else ""))


PATHS: dict[str, tuple[Path, ...]] = {
    "all_reduce": (Path("plan hit", f"SUM of a tensor reduced before, below {_mib(AGREE_BYTES)}",
                        _plan_hit, before_call=True), *DEVICE, ARENA, HIER, RING,
                   _mpi("Allreduce")),
    "broadcast": (Path("plan hit", "a tensor broadcast before from the same root, blocking, "
                       f"below {_mib(AGREE_BYTES)}", _plan_hit, before_call=True), *DEVICE,
                  Path("CMA", RACED, _cma_state, min_bytes=_cma.MIN_BYTES,
                       applies=_cma_applies, kind="cma"), HIER,
                  _mpi("Bcast")),
    "reduce": (*DEVICE, _mpi("Reduce")),
    "reduce_scatter": (*DEVICE, ARENA, Path("point-to-point", "the list form, SUM/AVG, non-bool",
                                           _p2p_lists, applies=_lists_reduce_scatter_applies,
                                           kind="lists"),
                       _mpi("Reduce_scatter_block", pieces=False)),
    "reduce_scatter_tensor": (*DEVICE, ARENA, HIER, _mpi("Reduce_scatter_block", pieces=False)),
    "all_gather": (PLAN, *DEVICE, LISTS, _mpi("Allgather")),
    "all_gather_into_tensor": (PLAN, *DEVICE, HIER, _mpi("Allgather")),
    "gather": (*DEVICE, _mpi("Gather(v)")),
    "scatter": (*DEVICE, _mpi("Scatter(v)")),
    "all_to_all": (PLAN, *DEVICE, LISTS, _mpi("Ialltoallv", pieces=False)),
    "all_to_all_single": (Path("plan hit", "even blocks, the same tensors as the two calls "
                               "before", _plan_hit, before_call=True), *DEVICE,
                          _mpi("Ialltoallv", pieces=False)),
    "send/recv/isend/irecv": (Path("plan hit", "a tensor sent or received before, same peer "
                                   "and tag (C module only)", _p2p_plan_hit, before_call=True),
                              *DEVICE, _mpi("Send/Recv (or Isend/Irecv)")),
    "barrier": (Path("MPI Barrier", "always"),),
}


def route(op: str, **runs: Callable) -> tuple:
    """OP's rows for :func:`take`. RUNS names how each row runs, by the row's kind:
    ``device`` (a function of the call and the row's DeviceCtx, for both device rows),
    ``arena``, ``cma``, ``hier``, ``lists``, ``mpi``. Every row but the plan hit needs one and
    every one needs a row; the device rows come first, a row that always applies last."""
    rows = [p for p in PATHS[op] if not p.before_call]
    host = rows[len(DEVICE):]
    names = [p.kind for p in host]
    if tuple(rows[:len(DEVICE)]) != DEVICE or host[-1].applies is not None \
            or sorted(["device", *names]) != sorted(runs):
        raise RuntimeError(f"route({op!r}): the table's rows are {[p.name for p in rows]} "
                           f"(the device rows first, a last row that always applies), the "
                           f"runners given {sorted(runs)}")
    device = runs["device"]

    def on_cuda_aware(call):
        return device(call, _device.row_ctx(_device.DIRECT))

    def staged(call):
        return device(call, _device.row_ctx(_device.STAGING))
    # below every middle row's min_bytes a call goes straight to the last row, the one a
    # small call takes: no row to ask (0 where a middle row applies at any size)
    floor = min((p.min_bytes for p in host[:-1]), default=1 << 62)
    return (CUDA_AWARE.applies, on_cuda_aware, staged, floor, runs[names[-1]],
            tuple((p.min_bytes, p.applies and functools.partial(p.applies, op=op), runs[k])
                  for p, k in zip(host, names)),
            op not in POSTED)


# ops whose MPI requests are posted on the caller's thread, never queued on the engine: MPI
# orders point-to-point messages among themselves, and a blocking send queued behind a
# blocking receive would deadlock two ranks that exchange
POSTED = frozenset({"send/recv/isend/irecv"})


def take(route: tuple, call: Call):
    """Run CALL on the first of ROUTE's paths that applies (the last, MPI, always does): on
    the caller's thread, or queued on the async engine (hpcddp.collectives.engine) where the
    call is async and the engine on, or where calls issued before it are still queued."""
    if call.device:       # the device rows (a flag, tested without a call)
        _engine.drain()   # the caller's thread keeps its CUDA stream
        return route[1](call) if route[0](call) else route[2](call)
    if route[6] and call.queued:     # record_call decided it, and left the agreement to it
        run = functools.partial(_agreed_host, route)
        if call.async_op:
            return _engine.submit(run, call)
        _engine.in_order(run, call)
        return None
    return _host(route, call)


def _agreed_host(route: tuple, call: Call):
    """A queued CALL on the engine's thread: the cross-rank agreement record_call left to
    it, then its host row."""
    agree_recorded(call.comm, call.entry, call.red)
    return _host(route, call)


def _host(route: tuple, call: Call):
    """CALL (on CPU tensors) on the first of ROUTE's host rows that applies."""
    _, _, _, floor, last, rows, _ = route
    nbytes = call.nbytes
    if nbytes < floor:    # smaller than every middle row's min_bytes
        return last(call)
    for min_bytes, applies, run in rows:
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
