"""Which path a call takes: every op's paths in the order its code tries them, and whether each
is open to a group of the running job (``hpcddp info`` prints the table for the world).

An op takes the first path that applies to the call. The conditions on the call (size, reduce
op, a tensor used before) are in ``when``; what the group and the job decide (ranks on one
node, a start-up race against MPI, the C module built, a switch in docs/settings.md) is what
:func:`table` evaluates. Keep this table in the order of the ops' code (reduce.py, gather.py,
alltoall.py, p2p.py): tests/mpi/test_paths.py checks the node-local rows against the paths the
ops really take.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from hpcddp import settings
from hpcddp.collectives import _cma, _hier, _lists, _node, _plans, _shm
from hpcddp.diagnostics.mismatch import AGREE_BYTES


@dataclass(frozen=True)
class Path:
    name: str
    when: str                                   # what the call must be for this path
    state: Callable[[object], str] | None = None  # group -> "open" or "closed (why)"


def _mib(n: int) -> str:
    return f"{n >> 20} MiB"


def _plan_hit(comm) -> str:
    return f"open ({_plans.KIND})"


def _device(comm) -> str:
    from hpcddp.comm.cuda import cuda_awareness
    try:
        aware = cuda_awareness().aware
    except Exception:  # detection must never break the report
        aware = False
    return "open (straight to MPI, which takes device memory)" if aware else \
        "open (staged through pinned host memory)"


def _node_local(mode: str, variable: str, opened, raced: str, unopened: str):
    """The state of a node-local path: its switch (MODE of VARIABLE), then whether OPENED(comm)
    set it up for the group; closed, the start-up race it lost (RACED: its name in
    _node.decisions) or UNOPENED, the other reasons."""
    def state(comm) -> str:
        if getattr(settings.get(), mode) == "0":
            return f"closed ({variable}=0)"
        if comm.size < 2:
            return "closed (one rank)"
        if opened(comm) is not None:
            return "open"
        for d in reversed(_node.decisions):
            if d["path"].startswith(raced) and not d["kept"]:
                return (f"closed (MPI won the start-up race: {d['mpi_s'] * 1e3:.1f} ms, this "
                        f"path {d['ours_s'] * 1e3:.1f} ms)")
        return f"closed ({unopened})"
    return state


_arena = _node_local("shm_allreduce", "HPCDDP_SHM_ALLREDUCE", lambda c: _shm.arena(c),
                     "shm arena", "ranks on several nodes, or no room in /dev/shm")
_cma_state = _node_local("cma", "HPCDDP_CMA", lambda c: _cma.peers(c), "cma",
                         "ranks on several nodes, or the kernel refuses")


_hier_state = _node_local("hier", "HPCDDP_HIER", lambda c: _hier.hier(c), "hier",
                          "one node, or nodes with different numbers of the group's ranks")


def _p2p_lists(comm) -> str:
    limit = _lists._MAX_RANKS
    return "open" if 1 < comm.size <= limit else \
        f"closed ({comm.size} ranks; HPCDDP_LIST_P2P_MAX_RANKS={limit})"


PLAN = Path("plan hit", "the same tensors as a call before, blocking, "
            f"below {_mib(AGREE_BYTES)}", _plan_hit)
DEVICE = Path("device", "CUDA tensors", _device)
ARENA = Path("shm arena", f"SUM/AVG/PREMUL_SUM, non-bool, from {_mib(_shm.MIN_BYTES)}", _arena)
LISTS = Path("point-to-point", "the list form", _p2p_lists)
HIER = Path("hierarchical", "several nodes, the same number of ranks on each, from "
            f"{_mib(_hier.MIN_BYTES)}", _hier_state)
PIECES = "MPI pieces", "over MPI's count limit of 2^31-1 elements"


def _mpi(call: str, pieces: bool = True) -> tuple:
    rows = (Path(f"MPI {call}", "otherwise"),)
    return rows + ((Path(*PIECES),) if pieces else ())


PATHS: dict[str, tuple[Path, ...]] = {
    "all_reduce": (Path("plan hit", f"SUM of a tensor reduced before, below {_mib(AGREE_BYTES)}",
                        _plan_hit), DEVICE, ARENA,
                   HIER) + _mpi("Allreduce"),
    "broadcast": (DEVICE, Path("CMA", f"from {_mib(_cma.MIN_BYTES)}", _cma_state), HIER)
    + _mpi("Bcast"),
    "reduce": (DEVICE,) + _mpi("Reduce"),
    "reduce_scatter": (DEVICE, ARENA, LISTS) + _mpi("Reduce_scatter_block", pieces=False),
    "reduce_scatter_tensor": (DEVICE, ARENA, HIER) + _mpi("Reduce_scatter_block",
                                                          pieces=False),
    "all_gather": (PLAN, DEVICE, LISTS) + _mpi("Allgather"),
    "all_gather_into_tensor": (DEVICE, HIER) + _mpi("Allgather"),
    "gather": (DEVICE,) + _mpi("Gather(v)"),
    "scatter": (DEVICE,) + _mpi("Scatter(v)"),
    "all_to_all": (PLAN, DEVICE, LISTS) + _mpi("Ialltoallv", pieces=False),
    "all_to_all_single": (Path("plan hit", "even blocks, the same tensors as a call before",
                               _plan_hit), DEVICE) + _mpi("Ialltoallv", pieces=False),
    "send/recv/isend/irecv": (Path("plan hit", "a tensor sent or received before, same peer "
                                   "and tag (C module only)", _plan_hit), DEVICE)
    + _mpi("Send/Recv (or Isend/Irecv)", pieces=False),
    "barrier": (Path("MPI Barrier", "always"),),
}


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
                if p.state not in cache:
                    cache[p.state] = p.state(comm)
                state = cache[p.state]
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
