"""DistributedDataParallel over hpcddp.

Parity: DDP on N ranks, each on its 1/N of the batch, reaches the same parameters as one
process training on the whole batch (float64, tolerance 1e-12), with and without
find_unused_parameters / static_graph / no_sync accumulation / comm hooks, in both
HPCDDP_FUTURE modes. The one-process reference runs locally on every rank (no messages).
Also: initial parameter and buffer broadcast, fp16/bf16 compression hooks (compression
tolerance), Join for uneven inputs (against a reference that knows who joined when), and the
same training on a gloo group.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)
from hpcddp.collectives import work as W

MPI_TIMEOUT = 300
TOL = 1e-12
BATCH = 12      # global batch: divisible by 2, 3 and 4 ranks
STEPS = 4


class Net(nn.Module):
    def __init__(self, unused: bool = False):
        super().__init__()
        self.a = nn.Linear(5, 8)
        self.b = nn.Linear(8, 3)
        self.spare = nn.Linear(8, 3) if unused else None  # never used in forward
        self.register_buffer("seen", torch.zeros(1, dtype=torch.float64))

    def forward(self, x):
        self.seen += 1
        return self.b(torch.tanh(self.a(x)))


def make_model(unused=False, seed=0):
    torch.manual_seed(seed)
    return Net(unused).double()


def data(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 5, generator=g, dtype=torch.float64)
    y = torch.randn(BATCH, 3, generator=g, dtype=torch.float64)
    return x, y


def shard(t, rank, n):
    k = t.shape[0] // n
    return t[rank * k:(rank + 1) * k]


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def reference(steps=STEPS, unused=False, micro=1):
    """One process, the whole batch (split in MICRO accumulation steps), plain SGD+momentum."""
    model = make_model(unused)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad()
        for m in range(micro):
            loss = loss_fn(model(shard(x, m, micro)), shard(y, m, micro)) / micro
            loss.backward()
        opt.step()
    return model


def train_ddp(ddp, steps=STEPS, micro=1):
    n, r = dist.get_world_size(), dist.get_rank()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for s in range(steps):
        x, y = data(s)
        xs, ys = shard(x, r, n), shard(y, r, n)
        opt.zero_grad()
        # micro-batches: every rank splits its shard the same way the reference splits the
        # whole batch, so the accumulated gradient is the same average
        for m in range(micro):
            xm, ym = shard(xs, m, micro), shard(ys, m, micro)
            if m < micro - 1:
                with ddp.no_sync():
                    (loss_fn(ddp(xm), ym) / micro).backward()
            else:
                (loss_fn(ddp(xm), ym) / micro).backward()
        opt.step()
    return ddp.module


def assert_same_params(model, ref, tol=TOL, what=""):
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is None and "spare" in name:
            continue
        assert torch.allclose(p, q, rtol=tol, atol=tol), \
            f"{what} {name}: max diff {(p - q).abs().max().item():.3e}"


@pytest.fixture(scope="module")
def world():
    return M.init_world()


@pytest.fixture(params=["wait", "thread"])
def future_mode(request, monkeypatch):
    monkeypatch.setattr(W, "_FUTURE_MODE", request.param)
    return request.param


@pytest.mark.parametrize("opts", [{}, {"find_unused_parameters": True, "unused": True},
                                  {"static_graph": True}, {"gradient_as_bucket_view": True},
                                  {"bucket_cap_mb": 0.0001}],
                         ids=["plain", "find_unused", "static_graph", "bucket_view",
                              "tiny_buckets"])
def test_parity(world, future_mode, opts):
    opts = dict(opts)
    unused = opts.pop("unused", False)
    ddp = DDP(make_model(unused), **opts)
    model = train_ddp(ddp)
    assert_same_params(model, reference(unused=unused), what=f"{future_mode} {opts}")
    if unused:
        assert model.spare.weight.grad is None


def test_parity_no_sync_accumulation(world):
    ddp = DDP(make_model())
    model = train_ddp(ddp, micro=3 if BATCH // dist.get_world_size() % 3 == 0 else 2)
    micro = 3 if BATCH // dist.get_world_size() % 3 == 0 else 2
    assert_same_params(model, reference(micro=micro), what="no_sync")


def test_no_sync_skips_communication(world):
    """Inside no_sync() gradients stay local (they differ across ranks until synced)."""
    r = dist.get_rank()
    ddp = DDP(make_model())
    x, y = data(0)
    with ddp.no_sync():
        loss_fn(ddp(x[r:r + 1]), y[r:r + 1]).backward()
    g = ddp.module.a.weight.grad.clone()
    allg = [torch.zeros_like(g) for _ in range(dist.get_world_size())]
    dist.all_gather(allg, g)
    assert not all(torch.equal(allg[0], t) for t in allg[1:])


def test_broadcast_of_parameters_and_buffers(world):
    """DDP starts from rank 0's parameters and, each forward, rank 0's buffers."""
    r = dist.get_rank()
    model = make_model(seed=100 + r)  # different parameters on every rank
    model.seen.fill_(10.0 * r)
    ddp = DDP(model)
    p = ddp.module.a.weight.detach().clone()
    allp = [torch.zeros_like(p) for _ in range(dist.get_world_size())]
    dist.all_gather(allp, p)
    assert all(torch.equal(allp[0], t) for t in allp)
    assert torch.equal(p, make_model(seed=100).a.weight)
    ddp(torch.zeros(2, 5, dtype=torch.float64))
    assert ddp.module.seen.item() == 1.0  # rank 0's 0 broadcast before the forward, then +1


def test_gloo_ddp_agrees(world):
    ours = train_ddp(DDP(make_model()))
    theirs = train_ddp(DDP(make_model(), process_group=world.gloo))
    assert_same_params(ours, theirs, what="hpcddp vs gloo")


def bf16_hook(process_group, bucket):
    """torch's bf16_compress_hook, under a name torch does not gate on NCCL (no annotations:
    this module's ``from __future__ import annotations`` would turn them into strings, which
    register_comm_hook rejects)."""
    return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)


@pytest.mark.parametrize("hook,tol", [(default_hooks.allreduce_hook, TOL),
                                      (default_hooks.fp16_compress_hook, 2e-3),
                                      (default_hooks.bf16_compress_hook, 2e-2)],
                         ids=["allreduce", "fp16", "bf16"])
def test_comm_hooks(world, hook, tol):
    ddp = DDP(make_model())
    try:
        ddp.register_comm_hook(None, hook)
    except TypeError as exc:
        # torch refuses bf16_compress_hook *by name* unless it was built with CUDA and NCCL
        # (on any backend); the same hook under another name runs over hpcddp (docs/ddp.md)
        assert hook is default_hooks.bf16_compress_hook and "NCCL" in str(exc), exc
        ddp = DDP(make_model())
        ddp.register_comm_hook(None, bf16_hook)
    model = train_ddp(ddp, steps=2)
    assert_same_params(model, reference(steps=2), tol=tol, what=hook.__name__)
    # every rank holds the same parameters, whatever the compression did
    w = model.b.weight.detach().clone()
    allw = [torch.zeros_like(w) for _ in range(dist.get_world_size())]
    dist.all_gather(allw, w)
    assert all(torch.equal(allw[0], t) for t in allw)


def test_comm_hook_on_subgroup(world):
    """A hook with a process-group state: the gradients of a sub-group only."""
    n, r = dist.get_world_size(), dist.get_rank()
    ranks = list(range(0, n, 2))
    pg = dist.new_group(ranks)
    if r not in ranks:
        return
    ddp = DDP(make_model(), process_group=pg)
    ddp.register_comm_hook(pg, default_hooks.allreduce_hook)
    x, y = data(0)
    k = len(ranks)
    i = ranks.index(r)
    loss_fn(ddp(shard(x, i, k)), shard(y, i, k)).backward()
    ref = make_model()
    loss_fn(ref(x[:BATCH // k * k]), y[:BATCH // k * k]).backward()
    assert torch.allclose(ddp.module.a.weight.grad, ref.a.weight.grad, rtol=TOL, atol=TOL)


@pytest.mark.parametrize("find_unused", [False, True], ids=["plain", "find_unused"])
def test_join_uneven_inputs(world, find_unused):
    """Rank r has 2 + r batches; Join shadows the finished ranks' all-reduces with zeros and
    DDP divides by the world size, so step s's gradient is (sum over active ranks) / N. With
    find_unused_parameters the join hook also all-reduces the used-parameter map through
    torch's allreduce(tensor) overload (it crashed: a tensor taken for a list)."""
    n, r = dist.get_world_size(), dist.get_rank()
    per = 2  # samples per rank per step
    ddp = DDP(make_model(), find_unused_parameters=find_unused)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with Join([ddp]):
        for s in range(2 + r):
            x, y = data(s)
            opt.zero_grad()
            loss_fn(ddp(x[r * per:(r + 1) * per]), y[r * per:(r + 1) * per]).backward()
            opt.step()
    # the reference: every rank's gradients at step s, from those still running
    ref = make_model()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(2 + n - 1):
        x, y = data(s)
        grads = [torch.zeros_like(p) for p in ref.parameters()]
        for q in range(n):
            if s < 2 + q:
                m = copy.deepcopy(ref)
                loss_fn(m(x[q * per:(q + 1) * per]), y[q * per:(q + 1) * per]).backward()
                grads = [g + p.grad for g, p in zip(grads, m.parameters())]
        ropt.zero_grad()
        for p, g in zip(ref.parameters(), grads):
            p.grad = g / n
        ropt.step()
    assert_same_params(ddp.module, ref, what="join")
