"""The hierarchical all_reduce (hpcddp.collectives._hier) on emulated nodes of 2 ranks: every
reduce op and dtype against numpy, counts that do not split evenly, the same bits on every
rank, and the groups it must refuse (one node; nodes of different sizes). The arena and CMA
are off: on one real host they would take these calls first. tests/test_vcluster.py runs it on real
nodes (separate hosts, TCP between them)."""
from __future__ import annotations



import numpy as np
import pytest
import torch
import torch.distributed as dist

import hpcddp
from hpcddp import collectives as C, settings
from hpcddp.collectives import _hier, paths
from hpcddp.diagnostics.mismatch import CollectiveMismatchError

MPI_SIZES = (2, 3, 4)
MPI_ENV = {"HPCDDP_RANKS_PER_NODE": "2"}    # read by init: nodes of 2 ranks


@pytest.fixture(autouse=True)
def forced(monkeypatch):
    monkeypatch.setattr(settings, "_current", settings.get().replace(
        shm_allreduce="0", cma="0", hier="force"))
    monkeypatch.delitem(hpcddp.world()._attached, "hier", raising=False)   # made afresh


@pytest.fixture(scope="module")
def world():
    return hpcddp.world()


def spy(monkeypatch):
    calls = []
    real = _hier.Hier.all_reduce
    monkeypatch.setattr(_hier.Hier, "all_reduce",
                        lambda self, arr, op: calls.append(arr.size) or real(self, arr, op))
    return calls


def data(rank: int, count: int, dtype) -> np.ndarray:
    rng = np.random.default_rng(100 + rank)
    return rng.integers(-50, 50, count).astype(dtype)


OPS = {"SUM": (dist.ReduceOp.SUM, lambda xs: np.sum(xs, axis=0)),
       "MAX": (dist.ReduceOp.MAX, lambda xs: np.max(xs, axis=0)),
       "MIN": (dist.ReduceOp.MIN, lambda xs: np.min(xs, axis=0)),
       "AVG": (dist.ReduceOp.AVG, lambda xs: np.sum(xs, axis=0) / len(xs))}


@pytest.mark.parametrize("opname", sorted(OPS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int64])
def test_matches_numpy(world, opname, dtype, monkeypatch):
    if opname == "AVG" and dtype is np.int64:
        pytest.skip("AVG is defined for floating dtypes only (as in torch)")
    calls = spy(monkeypatch)
    op, ref = OPS[opname]
    count = (1 << 20) // np.dtype(dtype).itemsize + 13     # >= 1 MiB, not a multiple of 2
    t = torch.from_numpy(data(world.rank, count, dtype))
    C.all_reduce(t, op=op)
    expected = ref([data(r, count, dtype) for r in range(world.size)]).astype(dtype)
    assert np.array_equal(t.numpy(), expected) if dtype is np.int64 else \
        np.allclose(t.numpy(), expected, rtol=1e-6)
    # the same bits on every rank
    bits = world.mpi.allgather(t.numpy().tobytes())
    assert all(b == bits[0] for b in bits)
    used = world.size == 4          # 2 nodes x 2 ranks; 2 ranks: one node; 3: nodes of 2 and 1
    assert (calls == [count]) == used, (world.size, calls)
    state = [r["state"] for r in paths.table(world) if r["path"] == "hierarchical"][0]
    assert state.startswith("open") == used, state


@pytest.mark.parametrize("dtype", [np.float64, np.int64])
def test_a_large_all_reduce_crosses_the_nodes_in_pieces(world, dtype, monkeypatch):
    """From 2 x PIPE_BYTES on the ring's links the all_reduce is a pipeline: each piece
    crosses the nodes on the path's own thread while this thread reduces the next one inside
    the node. The sum equals numpy's, with the same bits on every rank, for 2 to MAX_PIECES
    pieces and counts that split unevenly (pieces of 1 MiB here, to keep the buffers small)."""
    n, me = world.size, world.rank
    pipelined = []
    real = _hier.Hier._all_reduce_pipelined
    monkeypatch.setattr(_hier.Hier, "_all_reduce_pipelined",
                        lambda self, arr, op: pipelined.append(arr.nbytes) or real(self, arr, op))
    monkeypatch.setattr(_hier, "PIPE_BYTES", 1 << 20)
    for count in ((2 << 20) // 8, (5 << 20) // 8 + 13, (12 << 20) // 8 - 7):
        every = [data(r, count, dtype) for r in range(n)]
        t = torch.from_numpy(every[me].copy())
        C.all_reduce(t)
        assert np.array_equal(t.numpy(), np.sum(every, axis=0)), count
        bits = world.mpi.allgather(t.numpy().tobytes())
        assert all(b == bits[0] for b in bits), count
    if n == 4:            # 2 nodes x 2 ranks
        assert _hier.hier(world).pipelines
        assert len(pipelined) == 3, pipelined
    else:
        assert pipelined == [], pipelined


def test_small_calls_stay_on_mpi(world, monkeypatch):
    calls = spy(monkeypatch)
    t = torch.ones(_hier.MIN_BYTES // 2 // 4)
    C.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, world.size)) and calls == []


def test_a_count_mismatch_is_refused_on_every_rank(world):
    if world.size != 4:
        pytest.skip("the hierarchical path runs at 2 nodes x 2 ranks")
    count = (2 << 20) // 4 - (1000 if world.rank == 3 else 0)
    t = torch.ones(count)
    with pytest.raises(CollectiveMismatchError, match="The culprit: rank 3"):
        C.all_reduce(t)
    assert torch.equal(t, torch.ones(count))      # untouched
    C.all_reduce(torch.ones(4))                    # the group is still in step


def groups(world):
    """The world, and the same ranks numbered node by node alternately (group rank 1 on the
    other node than group rank 0): the blocks must still come back in group-rank order."""
    from hpcddp.comm import Communicator
    interleaved = {0: 0, 2: 1, 1: 2, 3: 3}.get(world.rank, world.rank)
    return [("world", None), ("interleaved", Communicator(
        world.mpi.Split(color=0, key=interleaved), "interleaved"))]


@pytest.mark.parametrize("dtype", [np.float32, np.int64])
def test_reduce_scatter_all_gather_broadcast_match_numpy(world, dtype, monkeypatch):
    used = []
    for name in ("reduce_scatter", "all_gather", "broadcast"):
        real = getattr(_hier.Hier, name)
        monkeypatch.setattr(_hier.Hier, name,
                            lambda self, *a, _n=name, _r=real: used.append(_n) or _r(self, *a))
    for label, group in groups(world):
        n = world.size
        me = group.rank if group is not None else world.rank
        c = (1 << 20) // np.dtype(dtype).itemsize // n + 5      # >= 1 MiB in all
        every = [data(r, c * n, dtype) for r in range(n)]        # rank r's input, by group rank
        out = torch.zeros(c, dtype=torch.from_numpy(every[0]).dtype)
        C.reduce_scatter_tensor(out, torch.from_numpy(every[me].copy()), group=group)
        expected = np.sum(every, axis=0)[me * c:(me + 1) * c]
        assert np.array_equal(out.numpy(), expected), (label, "reduce_scatter_tensor")

        big = torch.zeros(c * n, dtype=out.dtype)
        C.all_gather_into_tensor(big, torch.from_numpy(every[me][:c].copy()), group=group)
        assert np.array_equal(big.numpy(), np.concatenate([e[:c] for e in every])), \
            (label, "all_gather_into_tensor")

        for root in range(n):
            t = torch.from_numpy(every[me].copy())
            C.broadcast(t, root, group=group)
            assert np.array_equal(t.numpy(), every[root]), (label, "broadcast", root)
    if world.size == 4:
        assert used.count("reduce_scatter") == used.count("all_gather") == 2, used
        assert used.count("broadcast") == 8, used
    else:
        assert used == [], used


def test_kept_buffers_serve_calls_of_every_size_and_dtype_in_turn(world):
    """The path keeps its scratch buffers from call to call (_node.Scratch): a large call, a
    smaller one of another dtype, then a large one again, each op in turn, all exact (a
    buffer left sized or typed for the call before would show here)."""
    n, me = world.size, world.rank
    for count, dtype in (((3 << 20) // 8, np.float64), ((1 << 20) // 4 + 3, np.int32),
                         ((3 << 20) // 8 + 1, np.int64), ((1 << 20) // 4, np.float32)):
        c = count // n + 1
        every = [data(r, c * n, dtype) for r in range(n)]
        t = torch.from_numpy(every[me][:count].copy())
        C.all_reduce(t)
        assert np.array_equal(t.numpy(), np.sum([e[:count] for e in every], axis=0))
        out = torch.zeros(c, dtype=t.dtype)
        C.reduce_scatter_tensor(out, torch.from_numpy(every[me].copy()))
        assert np.array_equal(out.numpy(), np.sum(every, axis=0)[me * c:(me + 1) * c])
        big = torch.zeros(c * n, dtype=t.dtype)
        C.all_gather_into_tensor(big, torch.from_numpy(every[me][:c].copy()))
        assert np.array_equal(big.numpy(), np.concatenate([e[:c] for e in every]))
    if n == 4:
        assert set(_hier.hier(world).scratch._bufs) >= {"part", "blocks", "received"}
