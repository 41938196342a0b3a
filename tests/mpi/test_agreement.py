"""Default mode: a large collective whose ranks disagree raises on every rank, never runs.

The last rank passes a different element count, dtype, reduce op or root; every rank must
raise CollectiveMismatchError naming the op, its sequence number, each rank's call and (from
3 ranks) the last rank as the culprit, with every tensor untouched; the group then works
on. Through the shared-memory arena (default on one node), plain MPI (arena off) and
torch.distributed. The sizes: 16 MiB, and 16 MiB minus 4000 bytes on the odd rank (the issue's).
"""
from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

from hpcddp import settings
import hpcddp
from hpcddp.comm import startup as _rt
from hpcddp.collectives import _cma
from hpcddp.collectives.paths import arena as _arena
from hpcddp.diagnostics.mismatch import AGREE_BYTES, CollectiveMismatchError

N = (16 << 20) // 4          # 16 MiB of float32
SHORT = N - 1000             # 4000 bytes fewer


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        hpcddp.init_process_group()
    return dist.group.WORLD


@pytest.fixture(params=["arena", "mpi"])
def path(request, monkeypatch):
    if request.param == "mpi":
        # HPCDDP_SHM_ALLREDUCE=0
        monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce="0"))
    else:   # HPCDDP_SHM_ALLREDUCE=force, a fresh arena (the start-up race may pick MPI)
        monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce="force"))
        monkeypatch.delitem(_rt.world()._attached, "shm", raising=False)   # a fresh arena
    return request.param


def odd() -> bool:
    return dist.get_rank() == dist.get_world_size() - 1


def expect_refused(call, tensor, *needles):
    before = tensor.clone()
    with pytest.raises(CollectiveMismatchError) as info:
        call()
    text = str(info.value)
    for needle in needles:
        assert needle in text, f"{needle!r} not in: {text}"
    n = dist.get_world_size()
    if n >= 3:
        assert f"The culprit: rank {n - 1}," in text, text
    else:
        assert "No majority" in text, text
    assert torch.equal(tensor, before), "a refused collective changed the tensor"
    # the group is still in step: a correct collective runs right after
    t = torch.ones(4)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4,), float(n)))


@pytest.mark.parametrize("api", ["torch", "direct"])
def test_all_reduce_count(world, path, api):
    t = torch.ones(SHORT if odd() else N)
    fn = dist.all_reduce if api == "torch" else hpcddp.all_reduce
    last = dist.get_world_size() - 1
    expect_refused(lambda: fn(t), t, "all_reduce #", f"rank 0 (count {N}, float32, op SUM)",
                   f"rank {last} (count {SHORT}, float32, op SUM)")


def test_all_reduce_dtype_same_bytes(world, path):
    t = torch.ones(N, dtype=torch.int32 if odd() else torch.float32)
    expect_refused(lambda: dist.all_reduce(t), t, "(count 4194304, int32, op SUM)",
                   "(count 4194304, float32, op SUM)")


def test_all_reduce_reduce_op(world, path):
    t = torch.ones(N)
    expect_refused(lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX if odd() else
                                           dist.ReduceOp.SUM), t, "op MAX", "op SUM")


def test_broadcast_root(world):
    t = torch.full((N,), float(dist.get_rank()))
    expect_refused(lambda: dist.broadcast(t, src=1 if odd() else 0), t, "broadcast #",
                   "root 0", "root 1")


def test_reduce_scatter_and_all_gather_into_tensor_counts(world, path):
    n = dist.get_world_size()
    c = SHORT if odd() else N
    out, inp = torch.zeros(c), torch.ones(c * n)
    expect_refused(lambda: dist.reduce_scatter_tensor(out, inp), out, "reduce_scatter #",
                   f"(count {SHORT}, float32, op SUM)")
    big, mine = torch.zeros(c * n), torch.ones(c)
    expect_refused(lambda: dist.all_gather_into_tensor(big, mine), big, "all_gather #",
                   f"(count {SHORT}, float32)")


@pytest.mark.parametrize("op", ["all_reduce", "reduce_scatter_tensor"])
@pytest.mark.parametrize("differs", ["count", "dtype", "reduce op", "premul"])
def test_arena_agrees_below_the_agreement_size(world, op, differs, monkeypatch):
    """From 1 MiB the arena compares the calls' hashes after its first barrier: 2 MiB against
    2 MiB - 4000 B, int32 against float32, AVG against SUM; and PREMUL_SUM on the other
    ranks against SUM: take scales a PREMUL_SUM's input before the path runs (in place for
    all_reduce), so a refusal must hand the caller back the tensor it passed."""
    monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce="force"))
    monkeypatch.delitem(_rt.world()._attached, "shm", raising=False)   # a fresh arena
    n, c = dist.get_world_size(), (2 << 20) // 4
    dtype, red = torch.float32, dist.ReduceOp.SUM
    if odd():
        if differs == "count":
            c -= 1000
        elif differs == "dtype":
            dtype = torch.int32
        elif differs == "reduce op":
            red = dist.ReduceOp.AVG
    elif differs == "premul":
        red = dist._make_nccl_premul_sum(3.0)
    assert 4 * c < AGREE_BYTES and 4 * c >= _arena.MIN_BYTES
    needle = {"count": f"(count {(2 << 20) // 4 - 1000}, float32",
              "dtype": "int32", "reduce op": "op AVG", "premul": "op PREMUL_SUM"}[differs]
    if op == "all_reduce":
        t = torch.ones(c, dtype=dtype)
        expect_refused(lambda: dist.all_reduce(t, op=red), t, "all_reduce #", needle)
        assert _arena.arena(hpcddp.world()) is not None, "the arena was not used"
    else:
        out, inp = torch.zeros(c // n, dtype=dtype), torch.ones(c // n * n, dtype=dtype)
        if differs == "count":
            needle = f"(count {c // n}, float32"
        expect_refused(lambda: dist.reduce_scatter_tensor(out, inp, op=red), out,
                       "reduce_scatter #", needle)


@pytest.mark.parametrize("differs", ["count", "dtype", "root"])
def test_cma_broadcast_agrees_below_the_agreement_size(world, differs, monkeypatch):
    """From 1 MiB a broadcast on one node copies by cross-memory attach, whose address
    exchange carries the call's hash: a different root would have had ranks write into each
    other's tensors."""
    monkeypatch.setattr(settings, "_current", settings.get().replace(cma="force"))
    monkeypatch.delitem(_rt.world()._attached, "cma", raising=False)   # fresh peers
    c, dtype, src = (2 << 20) // 4, torch.float32, 0
    if odd():
        if differs == "count":
            c -= 1000
        elif differs == "dtype":
            dtype = torch.int32
        else:
            src = 1
    t = torch.full((c,), dist.get_rank(), dtype=dtype)
    needle = {"count": f"(count {(2 << 20) // 4 - 1000}, float32", "dtype": "int32",
              "root": "root 1"}[differs]
    expect_refused(lambda: dist.broadcast(t, src=src), t, "broadcast #", needle)
    assert _cma.peers(hpcddp.world()) is not None, "the CMA path was not used"


def test_agreeing_large_calls_still_run(world, path):
    n = dist.get_world_size()
    t = torch.full((AGREE_BYTES // 4 + 5,), float(dist.get_rank()))
    for _ in range(3):      # repeat calls: large ones are never planned, so always agreed
        t.fill_(float(dist.get_rank()))
        dist.all_reduce(t)
        assert torch.equal(t, torch.full_like(t, n * (n - 1) / 2))
