"""hpcddp.collectives.paths, the table `hpcddp info` prints: its node-local rows say what the ops
really do. Each row's state on the world group is checked against the path a call of the
row's kind takes (a spy on the path's entry point), with the switch on, forced and off."""
from __future__ import annotations

import weakref

import pytest
import torch

import hpcddp
from hpcddp import collectives as C
from hpcddp.collectives import _cma, _lists, _shm, paths


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
    monkeypatch.setattr(_shm, "MODE", mode)
    monkeypatch.setattr(_shm, "_arenas", weakref.WeakKeyDictionary())
    monkeypatch.setattr(paths.settings, "_current",
                        paths.settings.get().replace(shm_allreduce=mode))
    state = _state(world, "all_reduce", "shm arena")
    calls = _spy(monkeypatch, _shm.Arena, "all_reduce")
    n = world.size
    for count in ((2 << 20) // 4, (512 << 10) // 4):     # above and below MIN_BYTES
        t = torch.full((count,), float(world.rank))
        C.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, n * (n - 1) / 2))
    if mode == "force":
        assert state == "open" and calls == ["all_reduce"], (state, calls)
    else:
        assert state == "closed (HPCDDP_SHM_ALLREDUCE=0)" and calls == [], (state, calls)


@pytest.mark.parametrize("mode", ["force", "0"])
def test_cma_row_is_the_path_broadcast_takes(world, mode, monkeypatch):
    monkeypatch.setattr(_cma, "MODE", mode)
    monkeypatch.setattr(_cma, "_peers", weakref.WeakKeyDictionary())
    monkeypatch.setattr(paths.settings, "_current", paths.settings.get().replace(cma=mode))
    state = _state(world, "broadcast", "CMA")
    calls = _spy(monkeypatch, _cma.Peers, "broadcast")
    t = torch.full(((2 << 20) // 4,), float(world.rank))
    C.broadcast(t, 0)
    assert torch.equal(t, torch.zeros_like(t))
    assert (state == "open") == (calls == ["broadcast"]) == (mode == "force"), (state, calls)


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
