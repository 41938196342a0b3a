"""hpcddp.collectives.paths, the table `hpcddp info` prints: its node-local rows say what the ops
really do. Each row's state on the world group is checked against the path a call of the
row's kind takes (a spy on the path's entry point), with the switch on, forced and off."""
from __future__ import annotations


import pytest
import torch

from hpcddp import settings
import hpcddp
from hpcddp.comm import startup as _rt
from hpcddp import collectives as C
from hpcddp.collectives import _cma, _lists, _node, paths
from hpcddp.collectives.paths import arena as _arena


@pytest.fixture(scope="module")
def world():
    return hpcddp.world()


def _spy(monkeypatch, owner, name):
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, spy)
    return calls


def _state(world, op, path):
    rows = [r for r in paths.table(world) if r["op"] == op and r["path"] == path]
    assert len(rows) == 1, (op, path)
    return rows[0]["state"]


@pytest.mark.parametrize("mode", ["force", "0"])
def test_arena_row_is_the_path_all_reduce_takes(world, mode, monkeypatch):
    monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce=mode))
    monkeypatch.delitem(_rt.world()._attached, "shm", raising=False)   # a fresh arena
    state = _state(world, "all_reduce", "shm arena")
    calls = _spy(monkeypatch, _arena.Arena, "all_reduce")
    n = world.size
    for count in (2 * _arena.MIN_BYTES // 4, _arena.MIN_BYTES // 2 // 4):   # above, below MIN_BYTES
        t = torch.full((count,), float(world.rank))
        C.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, n * (n - 1) / 2))
    if mode == "force":
        assert state.startswith("open from") and calls == ["all_reduce"], (state, calls)
    else:
        assert state == "closed (HPCDDP_SHM_ALLREDUCE=0)" and calls == [], (state, calls)


@pytest.mark.parametrize("mode", ["force", "0"])
def test_cma_row_is_the_path_broadcast_takes(world, mode, monkeypatch):
    monkeypatch.setattr(settings, "_current", settings.get().replace(cma=mode))
    monkeypatch.delitem(_rt.world()._attached, "cma", raising=False)   # fresh peers
    state = _state(world, "broadcast", "CMA")
    calls = _spy(monkeypatch, _cma.Peers, "broadcast")
    t = torch.full(((2 << 20) // 4,), float(world.rank))
    C.broadcast(t, 0)
    assert torch.equal(t, torch.zeros_like(t))
    assert state.startswith("open") == (calls == ["broadcast"]) == (mode == "force"), \
        (state, calls)


def test_point_to_point_row_is_the_path_list_all_gather_takes(world, monkeypatch):
    state = _state(world, "all_gather", "point-to-point")
    calls = _spy(monkeypatch, _lists, "all_gather")
    outs = [torch.zeros(3) for _ in range(world.size)]
    C.all_gather(outs, torch.full((3,), float(world.rank)), async_op=True).wait()
    assert [o[0].item() for o in outs] == list(range(world.size))
    assert (state == "open") == (calls == ["all_gather"]), (state, calls)


def test_every_op_in_the_table_is_an_op(world):
    for op in paths.PATHS:
        for name in op.split("/"):
            assert callable(getattr(C, name)), name
    text = paths.format_table(paths.table(world))
    assert text.splitlines()[0].startswith("which path a call takes")
    assert "all_reduce" in text and "MPI Allreduce (otherwise; over MPI's count limit" in text


def _forced_race(monkeypatch, owner, times):
    """The start-up race with its times forced: TIMES(op, nbytes, rank) -> (this path's s,
    MPI's s) as this rank measures them. Returns the (op, nbytes) raced on this rank."""
    raced = []
    monkeypatch.setattr(owner, "_race_pair", lambda self, op, nbytes: ((op, nbytes), None))

    def best_times(comm, ours, mpis, tries=3):
        raced.append(ours)
        return times(*ours, comm.rank)
    monkeypatch.setattr(_node, "best_times", best_times)
    return raced


def _same_on_every_rank(world, value):
    values = world.mpi.allgather(value)
    assert all(v == values[0] for v in values), values
    return value


def test_a_path_serves_each_op_from_the_size_its_race_found(world, monkeypatch):
    """The arena loses all_reduce below 2 MiB on rank 0 only: the slowest rank's time decides,
    so every rank hands those sizes to MPI; it wins reduce_scatter from the first size raced.
    Every rank takes the same path for the same call, and each op is raced once."""
    monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce="auto"))
    monkeypatch.delitem(_rt.world()._attached, "shm", raising=False)   # a fresh arena
    slow_below = 2 << 20

    def times(op, nbytes, rank):
        lose = op == "all_reduce" and nbytes < slow_below and rank == 0
        return (2e-3 if lose else 1e-3), 1.5e-3
    raced = _forced_race(monkeypatch, _arena.Arena, times)
    calls = _spy(monkeypatch, _arena.Arena, "all_reduce")
    rs_calls = _spy(monkeypatch, _arena.Arena, "reduce_scatter")
    n = world.size
    took = []
    for nbytes in (1 << 20, slow_below, 4 << 20, (1 << 20) - 4, slow_below - 4):
        t = torch.full((nbytes // 4,), float(world.rank))
        before = len(calls)
        C.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, n * (n - 1) / 2))
        took.append(len(calls) > before)
    assert _same_on_every_rank(world, took) == [False, True, True, False, False]
    out = torch.zeros(_arena.MIN_BYTES // 4)
    C.reduce_scatter_tensor(out, torch.ones(n * out.numel()))
    assert torch.equal(out, torch.full_like(out, n)) and len(rs_calls) == 1
    # up the ladder until the arena won at two sizes in a row
    assert raced == [("all_reduce", b) for b in _node.LADDER[:5]] + \
        [("reduce_scatter", b) for b in _node.LADDER[:2]], raced
    assert _state(world, "all_reduce", "shm arena").startswith("open from 2 MiB (not 5% faster "
                                                               "at 1 MiB: this path 2.00 ms")
    assert _state(world, "reduce_scatter_tensor", "shm arena").startswith(
        "open from 256 KiB (faster at 256 KiB: this path 1.00 ms, MPI 1.50 ms")
    assert len(raced) == 7          # the table reads the decisions, it does not race again
    # the world's rows for all_reduce: the arena from where it won, so a 1 MiB call goes to
    # MPI with a compare (take() asks no path below it)
    from hpcddp.collectives.call import group_rows
    from hpcddp.collectives.reduce import _ALL_REDUCE    # the module's, not the op's
    _, floor, rows, _ = group_rows(_ALL_REDUCE, world)
    assert [row[0] for row in rows if row[2] is paths.ARENA.all_reduce] == [slow_below]
    asked = _spy(monkeypatch, _arena, "usable")             # what the arena's applies asks
    C.all_reduce(torch.ones((1 << 20) // 4))
    C.all_reduce(torch.ones(slow_below // 4))
    assert asked == ["usable"] and floor <= slow_below


def test_a_path_that_loses_at_every_size_is_closed_and_says_why(world, monkeypatch):
    monkeypatch.setattr(settings, "_current", settings.get().replace(cma="auto"))
    monkeypatch.delitem(_rt.world()._attached, "cma", raising=False)   # fresh peers
    raced = _forced_race(monkeypatch, _cma.Peers, lambda op, nbytes, rank: (2e-3, 1e-3))
    calls = _spy(monkeypatch, _cma.Peers, "broadcast")
    t = torch.full(((32 << 20) // 4,), float(world.rank))
    C.broadcast(t, world.size - 1)
    assert torch.equal(t, torch.full_like(t, world.size - 1)) and calls == []
    assert [nbytes for _, nbytes in raced] == list(_cma.LADDER)
    state = _state(world, "broadcast", "CMA")
    assert state.startswith("closed (not 5% faster than MPI at any size raced, up to 32 MiB: "
                            "not 5% faster at 32 MiB: this path 2.00 ms, MPI 1.00 ms; race "), state
