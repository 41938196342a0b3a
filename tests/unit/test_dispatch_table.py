"""hpcddp.collectives.paths drives the dispatch: every op's route is its table row list, in the
table's order, and take() runs the first row that applies (tests/mpi/test_paths.py checks the
rows against the paths real calls take)."""
from __future__ import annotations

import importlib

import pytest

from hpcddp.collectives import paths
from hpcddp.collectives.paths import Call, Path, route, take

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


@pytest.mark.parametrize("op", sorted(ROUTES))
def test_every_op_runs_its_table_rows_in_order(op):
    module, name = ROUTES[op]
    aware, on_aware, staged, floor, last, rows, queued = getattr(
        importlib.import_module(f"hpcddp.collectives.{module}"), name)
    # collectives may be queued on the async engine; point-to-point ops never are
    assert queued is (op not in paths.POSTED)
    table = [p for p in paths.PATHS[op] if not p.before_call]
    # the device rows first: CUDA-aware MPI where it applies, else host staging, one runner
    assert tuple(table[:2]) == (paths.CUDA_AWARE, paths.STAGED) == paths.DEVICE
    assert aware is paths.CUDA_AWARE.applies and callable(on_aware) and callable(staged)
    host = table[2:]
    # each row's condition is the table's, told the op (a path serves each op from its own size)
    assert [(m, a and (a.func, a.keywords)) for m, a, _ in rows] == \
        [(p.min_bytes, p.applies and (p.applies, {"op": op})) for p in host]
    # each op's runner for a row is named after the row's kind (_all_reduce_arena, ...)
    kinds = [p.kind for p in host]
    assert [run.__name__.rsplit("_", 1)[-1] for _, _, run in rows] == kinds
    assert last is rows[-1][2] and rows[-1][1] is None
    assert floor == min((p.min_bytes for p in host[:-1]), default=1 << 62)


def test_the_p2p_ops_share_one_row_list():
    p2p = importlib.import_module("hpcddp.collectives.p2p")
    for r in (p2p._SEND, p2p._RECV, p2p._IRECV):
        assert [(m, a) for m, a, _ in r[5]] == [(m, a) for m, a, _ in p2p._ISEND[5]]


def test_route_refuses_a_row_without_a_runner_and_a_runner_without_a_row():
    with pytest.raises(RuntimeError, match=r"route\('broadcast'\).*'CMA', 'hierarchical', "
                                           r"'MPI Bcast.*\['device', 'mpi'\]"):
        route("broadcast", device=print, mpi=print)
    with pytest.raises(RuntimeError, match="runners given"):
        route("reduce", device=print, mpi=print, arena=print)


def _fake_table(monkeypatch, asked):
    def applies(name, answer):
        def f(call, op):
            asked.append(name)
            return answer
        return f
    monkeypatch.setitem(paths.PATHS, "fake", (
        paths.PLAN, *paths.DEVICE,
        Path("shm arena", "", min_bytes=100, applies=applies("arena", False), kind="arena"),
        Path("hierarchical", "", min_bytes=200, applies=applies("hier", True), kind="hier"),
        Path("MPI Fake", "otherwise")))
    return route("fake", device=lambda c, ctx: f"device {ctx.path}", arena=lambda c: "arena",
                 hier=lambda c: "hier", mpi=lambda c: "mpi")


def _call(nbytes, device=False):
    c = Call()
    c.device, c.nbytes, c.queued = device, nbytes, False
    return c


def test_take_runs_the_first_row_that_applies_in_table_order(monkeypatch):
    asked: list = []
    r = _fake_table(monkeypatch, asked)
    staged = take(r, _call(10 << 20, device=True))       # this MPI is not CUDA-aware
    assert staged == "device staging" and asked == []
    assert take(r, _call(50)) == "mpi" and asked == []          # below every threshold
    assert take(r, _call(150)) == "mpi" and asked == ["arena"]  # hier's min_bytes not met
    asked.clear()
    assert take(r, _call(250)) == "hier" and asked == ["arena", "hier"]


def test_a_device_call_takes_the_cuda_aware_row_only_where_it_applies(monkeypatch):
    """CUDA-aware MPI for a known-aware MPI and an MPI-predefined reduce op; host staging for
    an unknown MPI or a user-defined op (bfloat16's), as hpcddp.comm.cuda.decide says."""
    from hpcddp.collectives import _device
    from hpcddp.comm import cuda, ops

    r = _fake_table(monkeypatch, [])
    for aware, custom, row in ((True, False, "direct"), (None, False, "staging"),
                               (False, False, "staging"), (True, True, "staging")):
        monkeypatch.setattr(_device._DEFAULT, "awareness",
                            cuda.CudaAwareness(aware, "test", "faked", "x"))
        c = _call(0, device=True)
        c.mop = object()
        monkeypatch.setattr(ops, "_custom", {"bf16 sum": c.mop} if custom else {})
        assert take(r, c) == f"device {row}", (aware, custom)
    assert _device.cuda_aware is paths.CUDA_AWARE.applies


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
