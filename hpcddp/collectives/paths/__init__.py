"""The dispatch table: every op's paths in the order they are tried, the path objects, and
:func:`route`, an op's rows for :func:`hpcddp.collectives.call.take`.

A path is an object that owns its ops, one method per op it serves (``OPS`` names them): the
MPI path (:mod:`.mpi`, every op; counts over MPI's int limit in pieces), the shared-memory
arena (:mod:`.arena`), cross-memory attach (:mod:`.cma`), the hierarchical path (:mod:`.hier`),
the ring over TCP links (:mod:`.ring`), the list forms' point-to-point exchange (:mod:`.lists`)
and the two device paths for CUDA tensors (:mod:`.device`). A path that serves a call from
some size on has ``min_bytes`` (a compare, so small calls skip it without a function call)
and ``applies(call, made, op)`` (what the group and the job decide: ranks on one node, a
start-up race against MPI, a switch in docs/settings.md); the MPI path always applies. A
node-local path also has ``floor(comm, op)``: from which size it can serve the op on a group,
and its state for the group where made and raced (``made``, handed to applies so that it
need not look it up), read from what the group has made and raced (no message), so take()
keeps each group's rows without the paths that cannot serve it and skips the others below
their start with a compare. A path that
can replay an op has its planner, ``plan_<op>`` (take's memo calls it).

An op (reduce.py, gather.py, alltoall.py, p2p.py) validates its arguments once into a
:class:`~hpcddp.collectives.call.Call` and hands it to ``take`` with its route: take records
it, runs the first of the op's rows that applies, ends the record, answers and plans a
repeat. The plan-hit rows (``before_call``) run before validation, on the raw arguments of a
call planned before (hpcddp.collectives._plans); ``hpcddp info`` prints the whole table for
the running job, each path open or closed and why (:func:`table`).

Adding a path: one class (its ops as methods, ``OPS``, ``min_bytes``, ``applies``, ``state``;
its mechanism in the same module where it has no other user, as the arena's) and its rows
below. Adding an op: a row list here, a method on each path that serves it
(:func:`route` refuses at import a row whose path lacks the method).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from hpcddp.collectives import _node, _plans
from hpcddp.collectives.call import Call, pair, take  # noqa: F401  (the ops' import)
from hpcddp.collectives.paths.arena import ARENA
from hpcddp.collectives.paths.cma import CMA
from hpcddp.collectives.paths.device import CUDA_AWARE as _CUDA_AWARE, STAGED as _STAGED
from hpcddp.collectives.paths.hier import HIER
from hpcddp.collectives.paths.lists import LISTS, REDUCE_SCATTER_FROM
from hpcddp.collectives.paths.mpi import MPI_PATH
from hpcddp.collectives.paths.ring import RING
from hpcddp.diagnostics.mismatch import AGREE_BYTES


@dataclass(frozen=True)
class Path:
    """A row of the table: NAME and WHEN as ``hpcddp info`` shows them, VIA the path object
    that runs it (None: a row the op runs itself, a plan hit or the barrier, whose state
    STATE_OF gives)."""
    name: str
    when: str
    via: object = None
    state_of: Callable[[object, str], str] | None = None
    before_call: bool = False                     # a plan hit, tried before validation

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


# every plan is made on the second call in a row on the same tensors (take's memo: fresh
# tensors per call never pay for one), so the hits answer from the third
def _hit(when: str, state=_plan_hit) -> Path:
    return Path("plan hit", when, state_of=state, before_call=True)


BELOW = f"below {_mib(AGREE_BYTES)}"
PLAN = _hit(f"the same tensors as the two calls before, blocking, {BELOW}")
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
_ON = "on TCP links of its own, or MPI point-to-point (HPCDDP_RING_TRANSPORT)"
RING_ROW = Path("ring", f"SUM/AVG/PREMUL_SUM of float32/64, int32/64, several nodes, {_ON}, "
                        f"{RACED}", RING)
RING_GATHER_ROW = Path("ring", f"several nodes, {_ON}, {RACED}", RING)
PIECES = "; over MPI's count limit of 2^31-1 elements, in pieces"


def _mpi(call: str, pieces: bool = True) -> Path:
    return Path(f"MPI {call}", "otherwise" + (PIECES if pieces else ""), MPI_PATH)


PATHS: dict[str, tuple[Path, ...]] = {
    "all_reduce": (_hit(f"SUM of the tensor of the two calls before, {BELOW}"), *DEVICE,
                   ARENA_ROW, HIER_ROW, RING_ROW, _mpi("Allreduce")),
    "broadcast": (_hit(f"the tensor of the two calls before, from the same root, blocking, "
                       f"{BELOW}"), *DEVICE, Path("CMA", RACED, CMA), HIER_ROW, _mpi("Bcast")),
    "reduce": (_hit(f"SUM of the tensor of the two calls before, onto the same root, blocking, "
                    f"{BELOW}"), *DEVICE, _mpi("Reduce")),
    "reduce_scatter": (_hit(f"SUM of the tensors of the two calls before, blocking, {BELOW}: "
                            f"the list copied into one buffer"), *DEVICE, ARENA_ROW,
                       Path("point-to-point", f"the list form, SUM/AVG/PREMUL_SUM, non-bool, "
                            f"from {_mib(REDUCE_SCATTER_FROM)}", LISTS),
                       _mpi("Reduce_scatter_block", pieces=False)),
    "reduce_scatter_tensor": (_hit(f"SUM of the tensors of the two calls before, blocking, "
                                   f"{BELOW}"), *DEVICE, ARENA_ROW, HIER_ROW, RING_ROW,
                              _mpi("Reduce_scatter_block", pieces=False)),
    "all_gather": (PLAN, *DEVICE, LISTS_ROW, _mpi("Allgather")),
    "all_gather_into_tensor": (PLAN, *DEVICE, HIER_ROW, RING_GATHER_ROW, _mpi("Allgather")),
    "gather": (_hit(f"the tensors of the two calls before, to the same root, blocking, {BELOW}"),
               *DEVICE, Path("point-to-point", "each block into its tensor of the root's list",
                             LISTS), _mpi("Gather(v)")),
    "scatter": (_hit(f"the tensors of the two calls before, from the same root, blocking, "
                     f"{BELOW}"), *DEVICE,
                Path("point-to-point", "each block from its tensor of the root's list", LISTS),
                _mpi("Scatter(v)")),
    "all_to_all": (PLAN, *DEVICE, LISTS_ROW, _mpi("Ialltoallv", pieces=False)),
    "all_to_all_single": (_hit("even blocks, the same tensors as the two calls before"),
                          *DEVICE, _mpi("Ialltoallv", pieces=False)),
    # the C hit checks the peer and tag a plan was made with
    "send/recv/isend/irecv": (_hit("the tensor of the two calls before, with the peer and tag "
                                   "of the plan (C module only)", _p2p_plan_hit),
                              *DEVICE, _mpi("Send/Recv (or Isend/Irecv)")),
    "barrier": (Path("MPI Barrier", "always", state_of=lambda comm, op: "open"),),
}

# ops whose MPI requests are posted on the caller's thread, never queued on the engine: MPI
# orders point-to-point messages among themselves, and a blocking send queued behind a
# blocking receive would deadlock two ranks that exchange. Their path records them, under
# their own numbering (the C plan hit records the same way).
POSTED = frozenset({"send/recv/isend/irecv"})


def route(op: str, method: str | None = None) -> tuple:
    """OP's rows for :func:`~hpcddp.collectives.call.take`: each row's path, its method
    METHOD (default OP) and its planner, in table order. Refused at import: a row whose path
    does not serve the op, device rows that do not come first, a last row that does not
    always apply."""
    rows = [p for p in PATHS[op] if not p.before_call]
    name = method or op
    missing = [p.name for p in rows if name not in p.via.OPS or not callable(
        getattr(p.via, name, None))]
    host = rows[len(DEVICE):]
    if missing or tuple(rows[:len(DEVICE)]) != DEVICE or host[-1].applies is not None:
        raise RuntimeError(f"route({op!r}): the table's rows are {[p.name for p in rows]} (the "
                           f"device rows first, a last row that always applies); the rows "
                           f"whose path has no method {name!r}: {missing}")
    # each row: its method for the op, and its planner (``plan_<op>``) where it has one
    runs = [(getattr(p.via, name), getattr(p.via, f"plan_{name}", None)) for p in host]
    # below every middle row's min_bytes a call goes straight to the last row, the one a
    # small call takes: no row to ask (0 where a middle row applies at any size)
    floor = min((p.min_bytes for p in host[:-1]), default=1 << 62)
    # each row's floor on a group (a node-local path's ``floor``: from which size it can serve
    # there, as far as the group's made and raced state says; take() keeps the group's rows)
    floors = [getattr(p.via, "floor", None) for p in host]
    collective = op not in POSTED
    aware, direct, staged = CUDA_AWARE.applies, getattr(CUDA_AWARE.via, name), \
        getattr(STAGED.via, name)
    # a device call the CUDA-aware row takes runs take's steps with that row as its only one
    on_device = (aware, direct, staged, _node.NEVER, (direct, None), (), collective, name, None)
    return (aware, direct, staged, floor, runs[-1],
            tuple((p.min_bytes, p.applies and functools.partial(p.applies, op=op), run, plan,
                   f and functools.partial(f, op=op))
                  for p, (run, plan), f in zip(host, runs, floors)),
            collective, name, on_device)


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
