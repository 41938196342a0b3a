"""Strided views and sparse COO tensors through torch.distributed, as gloo takes them.

Every op gets views that are not one block of memory (a transposed matrix, every other
element of a larger buffer) and must give what a one-process reference computes, writing
nothing outside the view (the buffer's other elements keep a sentinel). Sparse all_reduce is
checked against the dense sum, and DDP over nn.Embedding(sparse=True) against one process.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcddp

SENTINEL = -777.0


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        hpcddp.init_process_group()
    return dist.group.WORLD


def rank_vals(r: int, n: int) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float64) + 100.0 * r


def every_other(values: torch.Tensor):
    """(base, view): VIEW is every other element of BASE and holds VALUES; the rest: SENTINEL."""
    base = torch.full((2 * values.numel(),), SENTINEL, dtype=values.dtype)
    view = base[::2]
    view.copy_(values)
    assert not view.is_contiguous()
    return base, view


def untouched(base) -> bool:
    return bool((base[1::2] == SENTINEL).all())


@pytest.mark.parametrize("async_op", [False, True])
def test_all_reduce_transposed_view(world, async_op):
    n, r = dist.get_world_size(), dist.get_rank()
    m = (torch.arange(12, dtype=torch.float64).view(3, 4) + r).t()    # shape 4x3, not contiguous
    assert not m.is_contiguous()
    want = sum(torch.arange(12, dtype=torch.float64).view(3, 4) + k for k in range(n)).t()
    w = dist.all_reduce(m, async_op=async_op)
    if async_op:
        w.wait()
    assert torch.equal(m, want)


def test_broadcast_and_reduce_into_every_other_element(world):
    n, r = dist.get_world_size(), dist.get_rank()
    base, view = every_other(rank_vals(r, 5))
    dist.broadcast(view, src=n - 1)
    assert torch.equal(view, rank_vals(n - 1, 5)) and untouched(base)
    base, view = every_other(rank_vals(r, 5))
    dist.reduce(view, dst=0)
    if r == 0:
        assert torch.equal(view, sum(rank_vals(k, 5) for k in range(n)))
    assert untouched(base)


def test_all_gather_list_and_tensor_with_views(world):
    n, r = dist.get_world_size(), dist.get_rank()
    _, inp = every_other(rank_vals(r, 4))
    pairs = [every_other(torch.zeros(4, dtype=torch.float64)) for _ in range(n)]
    dist.all_gather([v for _, v in pairs], inp)
    for k, (base, v) in enumerate(pairs):
        assert torch.equal(v, rank_vals(k, 4)) and untouched(base)
    out_base, out = every_other(torch.zeros(4 * n, dtype=torch.float64))
    dist.all_gather_into_tensor(out, inp)
    assert torch.equal(out, torch.cat([rank_vals(k, 4) for k in range(n)])) and untouched(out_base)


def test_reduce_scatter_and_all_to_all_single_with_views(world):
    n, r = dist.get_world_size(), dist.get_rank()
    _, inp = every_other(rank_vals(r, 3 * n))
    out_base, out = every_other(torch.zeros(3, dtype=torch.float64))
    dist.reduce_scatter_tensor(out, inp)
    total = sum(rank_vals(k, 3 * n) for k in range(n))
    assert torch.equal(out, total[3 * r:3 * r + 3]) and untouched(out_base)
    out_base, out = every_other(torch.zeros(3 * n, dtype=torch.float64))
    dist.all_to_all_single(out, inp)
    want = torch.cat([rank_vals(k, 3 * n)[3 * r:3 * r + 3] for k in range(n)])
    assert torch.equal(out, want) and untouched(out_base)


def test_scatter_gather_and_p2p_with_views(world):
    n, r = dist.get_world_size(), dist.get_rank()
    out_base, out = every_other(torch.zeros(2, dtype=torch.float64))
    chunks = [every_other(rank_vals(k, 2))[1] for k in range(n)] if r == 0 else None
    dist.scatter(out, chunks, src=0)
    assert torch.equal(out, rank_vals(r, 2)) and untouched(out_base)
    _, mine = every_other(rank_vals(r, 2))
    got = [every_other(torch.zeros(2, dtype=torch.float64)) for _ in range(n)] if r == 0 else None
    dist.gather(mine, [v for _, v in got] if got else None, dst=0)
    if r == 0:
        for k, (base, v) in enumerate(got):
            assert torch.equal(v, rank_vals(k, 2)) and untouched(base)
    # a ring of isend/irecv on views: every rank receives its left neighbour's values
    _, send = every_other(rank_vals(r, 6))
    recv_base, recv = every_other(torch.zeros(6, dtype=torch.float64))
    works = [dist.isend(send, (r + 1) % n), dist.irecv(recv, (r - 1) % n)]
    for w in works:
        w.wait()
    assert torch.equal(recv, rank_vals((r - 1) % n, 6)) and untouched(recv_base)


def test_direct_api_still_names_the_non_contiguous_tensor(world):
    with pytest.raises(TypeError, match="all_reduce: tensor is not contiguous"):
        hpcddp.all_reduce(torch.zeros(3, 4).t())


def test_meta_tensors_refused_clearly(world):
    with pytest.raises(TypeError, match="meta tensor"):
        dist.all_reduce(torch.empty(3, device="meta"))


# -- sparse ---------------------------------------------------------------------------------------
def sparse_of(r: int) -> torch.Tensor:
    """Rank R's uncoalesced sparse 5x3 tensor: overlapping and repeated indices."""
    idx = torch.tensor([[0, r % 5, 4, 0], [1, 2, r % 3, 1]])
    val = torch.tensor([1.0, 2.0 + r, 3.0 * r, 0.5], dtype=torch.float64)
    return torch.sparse_coo_tensor(idx, val, (5, 3))


def test_sparse_all_reduce_sum(world):
    n, r = dist.get_world_size(), dist.get_rank()
    t = sparse_of(r)
    w = dist.all_reduce(t, async_op=True)
    w.wait()
    want = sum(sparse_of(k).to_dense() for k in range(n))
    assert t.is_sparse and torch.equal(t.to_dense(), want)
    assert torch.equal(w.result()[0].to_dense(), want)
    t2 = sparse_of(r)
    dist.all_reduce(t2)
    assert torch.equal(t2.to_dense(), want)


def test_sparse_all_reduce_refuses_other_ops(world):
    with pytest.raises(ValueError, match="ReduceOp.SUM"):
        dist.all_reduce(sparse_of(0), op=dist.ReduceOp.MAX)


class Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 4, sparse=True)
        self.head = nn.Linear(4, 2)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def test_ddp_over_sparse_embedding_matches_one_process(world):
    n, r = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(5)
    ref = Bag().double()
    model = DDP(copy.deepcopy(ref))
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, ref)]
    g = torch.Generator().manual_seed(6)
    for step in range(3):
        ids = torch.randint(0, 20, (2 * n, 3), generator=g)
        y = torch.randn(2 * n, 2, generator=g, dtype=torch.float64)
        for o in opts:
            o.zero_grad()
        nn.functional.mse_loss(model(ids[2 * r:2 * r + 2]), y[2 * r:2 * r + 2]).backward()
        nn.functional.mse_loss(ref(ids), y).backward()
        assert model.module.emb.weight.grad.is_sparse
        for o in opts:
            o.step()
    for (name, p), q in zip(model.module.named_parameters(), ref.parameters()):
        assert torch.allclose(p, q, atol=1e-12), f"{name}: {(p - q).abs().max():.3e}"
