"""hpcddp.collectives.paths drives the dispatch: every op's route is its table row list, in the
table's order, and take() runs the first row that applies (tests/mpi/test_paths.py checks the
rows against the paths real calls take)."""
from __future__ import annotations

import importlib

import pytest

from hpcddp.collectives import paths
from hpcddp.collectives.call import Call, run_host as _run, take
from hpcddp.collectives.paths import Path, route

# each op's route, where its module keeps it
ROUTES = {
    "all_reduce": ("reduce", "_ALL_REDUCE"),
    "reduce": ("reduce", "_REDUCE"),
    "reduce_scatter": ("reduce", "_REDUCE_SCATTER"),
    "reduce_scatter_tensor": ("reduce", "_REDUCE_SCATTER_TENSOR"),
    "broadcast": ("gather", "_BROADCAST"),
    "all_gather": ("gather", "_ALL_GATHER"),
    "all_gather_into_tensor": ("gather", "_ALL_GATHER_INTO_TENSOR"),
    "gather": ("gather", "_GATHER"),
    "scatter": ("gather", "_SCATTER"),
    "all_to_all": ("alltoall", "_ALL_TO_ALL"),
    "all_to_all_single": ("alltoall", "_ALL_TO_ALL_SINGLE"),
    "send/recv/isend/irecv": ("p2p", "_ISEND"),
}
METHOD = {"send/recv/isend/irecv": "isend"}


@pytest.mark.parametrize("op", sorted(ROUTES))
def test_every_op_runs_its_table_rows_in_order(op):
    module, name = ROUTES[op]
    aware, on_aware, staged, floor, last, rows, queued, memo_key, on_device = getattr(
        importlib.import_module(f"hpcddp.collectives.{module}"), name)
    # a device call the CUDA-aware row takes: take's steps with that row alone, never planned
    assert on_device == (aware, on_aware, staged, 1 << 62, (on_aware, None), (), queued,
                         memo_key, None)
    method = METHOD.get(op, op)
    assert memo_key == method   # the plan memo files calls under it
    # collectives may be queued on the async engine; point-to-point ops never are
    assert queued is (op not in paths.POSTED)
    table = [p for p in paths.PATHS[op] if not p.before_call]
    # the device rows first: CUDA-aware MPI where it applies, else host staging, one runner
    assert tuple(table[:2]) == (paths.CUDA_AWARE, paths.STAGED) == paths.DEVICE
    assert aware is paths.CUDA_AWARE.applies
    assert on_aware == getattr(paths.CUDA_AWARE.via, method)
    assert staged == getattr(paths.STAGED.via, method)
    host = table[2:]
    # each row's condition is the table's, told the op (a path serves each op from its own size)
    assert [(m, a and (a.func, a.keywords)) for m, a, _, _, _ in rows] == \
        [(p.min_bytes, p.applies and (p.applies, {"op": op})) for p in host]
    # each row runs its path's method of the op's name
    assert [run for _, _, run, _, _ in rows] == [getattr(p.via, method) for p in host]
    # and its planner where it has one (the MPI path, the list forms)
    assert [plan for _, _, _, plan, _ in rows] == [getattr(p.via, f"plan_{method}", None)
                                                   for p in host]
    # and, for a node-local path, its floor on a group (take's rows per group)
    assert [f and (f.func, f.keywords) for *_, f in rows] == \
        [(p.via.floor, {"op": op}) if hasattr(p.via, "floor") else None for p in host]
    assert last == rows[-1][2:4] and rows[-1][1] is None and rows[-1][4] is None
    assert floor == min((p.min_bytes for p in host[:-1]), default=1 << 62)


def test_the_p2p_ops_share_one_row_list():
    p2p = importlib.import_module("hpcddp.collectives.p2p")
    for r in (p2p._SEND, p2p._RECV, p2p._IRECV):
        assert [(m, a) for m, a, *_ in r[5]] == [(m, a) for m, a, *_ in p2p._ISEND[5]]


def test_every_path_has_a_method_for_every_op_it_claims():
    """Each path object answers each op of its OPS, and each row of the table is on a path
    that claims the row's op (route() refuses the rest at import: tested below);
    tests/mpi/test_path_ops.py runs every (path, op) pair for real against numpy."""
    seen = set()
    for op, rows in paths.PATHS.items():
        for p in rows:
            if p.via is None:
                continue
            seen.add(p.via)
            for name in op.split("/"):
                assert name in p.via.OPS, (op, p.name)
    for via in seen:
        for name in via.OPS:
            assert callable(getattr(via, name, None)), (type(via).__name__, name)
    assert {type(v).__name__ for v in seen} == {"MPIPath", "ArenaPath", "CmaPath", "HierPath",
                                                "RingPath", "ListsPath", "CudaAwarePath",
                                                "StagedPath"}


class _Fake:
    """A path that serves "fake" and answers with its NAME."""
    OPS = frozenset({"fake"})

    def __init__(self, name, min_bytes=0, applies=None):
        self.name, self.min_bytes, self.applies = name, min_bytes, applies

    def state(self, comm, op):
        return "open"

    def fake(self, c, route=None):     # the host staging row is also handed take's route
        return self.name


def test_route_refuses_a_row_whose_path_does_not_serve_the_op(monkeypatch):
    with pytest.raises(RuntimeError, match=r"route\('broadcast'\).*'CMA', 'hierarchical', "
                                           r"'MPI Bcast.*no method 'barrier'"):
        route("broadcast", "barrier")
    monkeypatch.setitem(paths.PATHS, "fake", (*paths.DEVICE, Path("fake", "", _Fake("x"))))
    with pytest.raises(RuntimeError, match=r"'CUDA-aware MPI', 'host staging'\]"):
        route("fake")                   # the device paths do not serve "fake"


def _fake_table(monkeypatch, asked):
    def applies(name, answer):
        def f(call, made, op):
            asked.append(name)
            return answer
        return f
    device = {p: _Fake("device direct" if p is paths.CUDA_AWARE else "device staging")
              for p in paths.DEVICE}
    device[paths.CUDA_AWARE].applies = paths.CUDA_AWARE.applies
    monkeypatch.setattr(paths, "DEVICE", tuple(Path(p.name, p.when, device[p])
                                               for p in paths.DEVICE))
    monkeypatch.setattr(paths, "CUDA_AWARE", paths.DEVICE[0])
    monkeypatch.setattr(paths, "STAGED", paths.DEVICE[1])
    monkeypatch.setitem(paths.PATHS, "fake", (
        paths.PLAN, *paths.DEVICE,
        Path("shm arena", "", _Fake("arena", 100, applies("arena", False))),
        Path("hierarchical", "", _Fake("hier", 200, applies("hier", True))),
        Path("MPI Fake", "otherwise", _Fake("mpi"))))
    return route("fake")


class _Group:
    """What take() reads of a group: its size, its attached state, its rows."""
    def __init__(self, size=2, **attached):
        self.size, self.rows, self._attached = size, {}, attached
        self.seq, self.name, self.rank, self.world_ranks = 0, "fake group", 0, tuple(range(size))


def _call(nbytes, device=False, comm=None):
    c = Call()
    c.device, c.nbytes, c.async_op = device, nbytes, False
    c.comm = comm or _Group()
    return c


def test_take_runs_the_first_row_that_applies_in_table_order(monkeypatch):
    asked: list = []
    r = _fake_table(monkeypatch, asked)
    staged = take(r, _call(10 << 20, device=True))       # this MPI is not CUDA-aware
    assert staged == "device staging" and asked == []
    assert _run(r, _call(50)) == "mpi" and asked == []          # below every threshold
    assert _run(r, _call(150)) == "mpi" and asked == ["arena"]  # hier's min_bytes not met
    asked.clear()
    assert _run(r, _call(250)) == "hier" and asked == ["arena", "hier"]


def test_a_device_call_takes_the_cuda_aware_row_only_where_it_applies(monkeypatch):
    """CUDA-aware MPI for a known-aware MPI and an MPI-predefined reduce op; host staging for
    an unknown MPI or a user-defined op (bfloat16's), as hpcddp.comm.cuda.decide says."""
    from hpcddp.collectives.paths import device
    from hpcddp.comm import cuda, ops

    r = _fake_table(monkeypatch, [])
    for aware, custom, row in ((True, False, "direct"), (None, False, "staging"),
                               (False, False, "staging"), (True, True, "staging")):
        monkeypatch.setattr(device.DEVICE, "awareness",
                            cuda.CudaAwareness(aware, "test", "faked", "x"))
        c = _call(0, device=True)
        c.mop, c.name, c.shape, c.dtype, c.root, c.red = object(), "fake", (0,), None, None, None
        c.memo = None
        monkeypatch.setattr(ops, "_custom", {"bf16 sum": c.mop} if custom else {})
        assert take(r, c) == f"device {row}", (aware, custom)
    assert paths.PATHS["all_reduce"][1].via is device.CUDA_AWARE


def test_the_point_to_point_plan_row_is_closed_without_the_c_module(monkeypatch):
    """Only the C module runs point-to-point plans: hpcddp info must not call the row open
    where the Python hits run (HPCDDP_FASTPATH=0, or no C module)."""
    from hpcddp.collectives import _plans
    row = paths.PATHS["send/recv/isend/irecv"][0]
    monkeypatch.setattr(_plans, "KIND", "C")
    assert row.state(None, "send/recv/isend/irecv") == "open (C)"
    monkeypatch.setattr(_plans, "KIND", "Python (HPCDDP_FASTPATH=0)")
    monkeypatch.setattr(_plans, "WHY_PYTHON", "HPCDDP_FASTPATH=0")
    assert row.state(None, "send/recv/isend/irecv") == \
        "closed (point-to-point plans run only in the C module: HPCDDP_FASTPATH=0)"
    assert paths.PATHS["all_reduce"][0].state(None, "all_reduce").startswith("open (Python")


class _Starts:
    def __init__(self, forced=False, floor=0, **found):
        self.forced, self.floor = forced, floor
        self.found = {op: type("Crossover", (), {"start": at})() for op, at in found.items()}


class _Made:                         # a node-local path's state for a group: its races
    def __init__(self, **kw):
        self.starts = _Starts(**kw)


def test_each_group_keeps_the_rows_that_can_serve_it():
    """take() asks, on a group, only the node-local paths that can serve it, each from the
    size it serves there: read from what the group has made and raced (no message), and
    read again when that changes (hpcddp.collectives.call.group_rows)."""
    from hpcddp.collectives._node import NEVER
    from hpcddp.collectives.call import group_rows
    r = route("all_reduce")
    names = {paths.ARENA.all_reduce: "arena", paths.HIER.all_reduce: "hier",
             paths.RING.all_reduce: "ring", paths.MPI_PATH.all_reduce: "mpi"}

    def rows(comm):
        _, floor, got, _ = group_rows(r, comm)
        return floor, [(names[row[2]], row[0]) for row in got]
    arena_min, ring_min = paths.ARENA.min_bytes, paths.RING.min_bytes
    # nothing made yet: each from its own floor (the first call there makes and races it);
    # the hierarchical path needs 4 ranks
    assert rows(_Group(2)) == (arena_min, [("arena", arena_min), ("ring", ring_min),
                                           ("mpi", 0)])
    assert rows(_Group(4))[1][1] == ("hier", paths.HIER.min_bytes)
    # one node: no ring; the arena raced to start at 2 MiB
    assert rows(_Group(2, shm=_Made(all_reduce=2 << 20), ring=None)) == \
        (2 << 20, [("arena", 2 << 20), ("mpi", 0)])
    # several nodes: no arena; MPI won the ring's race at every size; forced hier from its floor
    assert rows(_Group(4, shm=None, hier=_Made(forced=True, floor=arena_min),
                       ring=_Made(all_reduce=None))) == (arena_min, [("hier", arena_min),
                                                                     ("mpi", 0)])
    assert rows(_Group(2, shm=None, ring=None)) == (NEVER, [("mpi", 0)])


def test_a_switch_turned_off_leaves_its_path_out_of_the_rows(monkeypatch):
    """A node-local path switched off (HPCDDP_SHM_ALLREDUCE=0, ...) is not among a group's
    rows, even where made and raced for the group; the rows a group keeps are made again
    when the settings snapshot is replaced (the switches are read from it, never copied)."""
    from hpcddp import settings
    from hpcddp.collectives.call import group_rows
    r = route("all_reduce")
    group = _Group(2, shm=_Made(all_reduce=2 << 20), ring=None)
    kept = group_rows(r, group)
    assert kept[2][0][2] == paths.ARENA.all_reduce and group_rows(r, group) is kept
    monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce="0"))
    now = group_rows(r, group)
    assert [row[2] for row in now[2]] == [paths.MPI_PATH.all_reduce]
    assert now[3] is settings._current


def test_a_group_reads_its_rows_again_when_its_state_changes():
    """The rows a group keeps are forgotten when what a path attached to it changes (made,
    closed on a failure, released) and when a race finds where a path starts."""
    from hpcddp.comm.communicator import _State
    rows: dict = {}
    state = _State(rows)
    for change in (lambda: state.__setitem__("shm", None), lambda: state.pop("shm"),
                   lambda: state.__setitem__("ring", 1), lambda: state.__delitem__("ring")):
        rows["route"] = "kept"
        change()
        assert rows == {}


def test_a_call_whose_path_raises_is_not_left_in_flight(monkeypatch):
    """The flight recorder closes the record of a call whose path raised, marked as left
    unfinished: a later stall report names it as the call this rank gave up, never as one it
    still waits in."""
    from hpcddp.diagnostics import recorder

    class _Raises(_Fake):
        def fake(self, c):
            raise ValueError("the path failed")
    _fake_table(monkeypatch, [])           # device rows that serve "fake"
    monkeypatch.setitem(paths.PATHS, "fake", (*paths.DEVICE, Path("MPI Fake", "otherwise",
                                                                  _Raises("mpi"))))
    r = route("fake")
    c = _call(64)
    c.name, c.shape, c.dtype, c.root, c.red = "fake", (16,), None, None, None
    with pytest.raises(ValueError, match="the path failed"):
        take(r, c)
    entry = c.entry
    assert entry[recorder.T_END] != 0.0 and entry not in recorder.RECORDER.in_flight()
    assert recorder.describe(entry)["abandoned"]
