"""The pieced paths for counts over MPI's limit (hpcddp/collectives/_large.py), made cheap: the
limit is lowered to a few elements, so every op that splits a large count splits these small
tensors into pieces, at 2, 3 and 4 ranks, and must still give numpy's (and gloo's) results.
The real thing (over 2**31 - 1 elements) runs at 2 ranks in test_objects_large.py.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hpcddp
import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)
from hpcddp.collectives import _large

MPI_TIMEOUT = 240
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")

PIECED = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
          "all_gather_into_tensor_stacked", "gather", "scatter")
REFUSED = ("reduce_scatter", "reduce_scatter_tensor", "all_to_all_single")
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.bool)


@pytest.fixture(scope="module")
def world():
    return M.init_world()


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(_large, "MAX_COUNT", 4)
    monkeypatch.setattr(_large, "PIECE_BYTES", 8)  # 1 to 8 elements per piece


@pytest.mark.parametrize("fname", PIECED)
def test_pieced_ops(world, small_limit, fname):
    problems = M.run_matrix(world, fname, dtypes=DTYPES)
    assert not problems, "\n".join(problems)


def test_pieced_async(world, small_limit):
    """async_op=True: a Work over all the pieces (the blocking broadcast/all_reduce only piece
    after MPI refuses a count, which a lowered limit never makes it do)."""
    n, r = dist.get_world_size(), dist.get_rank()
    t = M.value(torch.float64, r, (37,))
    dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).wait()
    want = M.reduce_ref("AVG", [M.value(torch.float64, q, (37,)) for q in range(n)],
                        torch.float64)
    assert torch.allclose(t, want)
    t = M.value(torch.bfloat16, r, (21,))
    assert hpcddp.broadcast(t, n - 1, async_op=True).get_future().wait()[0] is t
    assert torch.equal(t, M.value(torch.bfloat16, n - 1, (21,)))


def test_pieced_p2p(world, small_limit):
    n, r = dist.get_world_size(), dist.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    got = torch.zeros(29, dtype=torch.int32)
    rw = dist.irecv(got, prv, tag=3)
    sw = dist.isend(torch.arange(29, dtype=torch.int32) + r, nxt, tag=3)
    sw.wait()
    rw.wait()
    assert torch.equal(got, torch.arange(29, dtype=torch.int32) + prv)
    # blocking, and from any source (the sender is probed, then every piece comes from it)
    if r == 0:
        for _ in range(n - 1):
            t = torch.zeros(11)
            src = hpcddp.recv(t, None, tag=8)
            assert t.eq(src).all(), (src, t)
        with pytest.raises(ValueError, match="irecv: src=None"):
            hpcddp.irecv(torch.zeros(11), None)
    else:
        hpcddp.send(torch.full((11,), float(r)), 0, tag=8)


def test_refused_ops(world, small_limit):
    """Ops without a pieced form refuse clearly on every rank, before any message."""
    n = dist.get_world_size()
    t = torch.zeros(5 * n)
    with pytest.raises(ValueError, match="reduce_scatter_tensor: input needs a count of"):
        dist.reduce_scatter_tensor(torch.zeros(5), t)
    with pytest.raises(ValueError, match="all_to_all_single: input needs a count of"):
        dist.all_to_all_single(torch.zeros(5 * n), t)
    with pytest.raises(ValueError, match="all_to_all: input_tensor_list"):
        hpcddp.all_to_all([torch.zeros(5) for _ in range(n)], [torch.zeros(5) for _ in range(n)])
    dist.barrier()
