"""CUDA tensors for real: every op in float16/bfloat16/float32 on the staging path, on the
direct path when this MPI is CUDA-aware, through the public API and torch.distributed, the
stream hand-off, and DDP on CUDA over the hpcddp backend.

Skipped where no CUDA device exists (CI has none; the machine this was written on had none,
so these tests had not run when they were committed: see docs/gpu.md). On one GPU every rank
shares device 0, which is enough for correctness. The checks are the same as
test_gpu_staging.py's: results equal the CPU op on the same inputs, exactly (inputs are small
integers, so sums are exact in every dtype whatever the order or chunking).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hpcddp
from hpcddp import collectives as C
from test_gpu_staging import Via   # the public ops under the device paths' settings
from hpcddp.comm import cuda as cuda_mod
from hpcddp.comm.cuda import CudaAwareness
from hpcddp.collectives._gpu_staging import PinnedPool, Staging

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU; CI has none")
MPI_TIMEOUT = 500
MPI_NEEDS_CUDA = True      # tests/test_mpi_suites.py skips it without a GPU
R = dist.ReduceOp
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@pytest.fixture(scope="module")
def comm():
    return hpcddp.init().world


@pytest.fixture(scope="module")
def dev(comm):
    return torch.device("cuda", torch.cuda.current_device())


def data(rank: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    x = (torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 5 - 2
    return x.to(dtype)


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    a = a.cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: {a.flatten()[:8].tolist()} != {b.flatten()[:8].tolist()}"


def wait(w):
    if w is not None:
        w.wait()


def _as_is(x):
    return x


def staging_ctx() -> Via:
    # the MPI taken as not CUDA-aware, so every op stages; chunks of 4 KiB from 8 KiB: a
    # 100k-element tensor crosses ~50-100 chunks
    return Via(CudaAwareness(False, "test", "taken as not CUDA-aware", "test"),
               Staging(pool=PinnedPool(), chunk_bytes=4096, pipeline_bytes=8192), _as_is)


def direct_ctx() -> Via:
    return Via(wrap=_as_is)         # the test runs only where detection says CUDA-aware


def default_ctx() -> Via:
    return Via(wrap=_as_is)


def check_all_ops(comm, to_dev, ctx_factory, dtype) -> None:
    """Every op through the device path (ctx_factory() each call) vs the CPU op."""
    n, me = comm.size, comm.rank
    ops = [("SUM", R.SUM), ("MAX", R.MAX), ("AVG", R.AVG),
           ("PREMUL_SUM", dist._make_nccl_premul_sum(2.0))]
    for size in (0, 5, 100_000):
        x = data(me, size, dtype)
        for name, op in ops:
            ref = x.clone()
            C.all_reduce(ref, op, comm)
            for async_op in (False, True):
                y = to_dev(x.clone())
                wait(ctx_factory().all_reduce(y, op, comm, async_op))
                same(y, ref, f"all_reduce {name} {dtype} n={size} async={async_op}")
        for root in range(n):
            ref = x.clone()
            C.reduce(ref, root, R.SUM, comm)
            y = to_dev(x.clone())
            ctx_factory().reduce(y, root, R.SUM, comm, False)
            same(y, ref, f"reduce root={root} n={size}")
            ref = x.clone()
            C.broadcast(ref, root, comm)
            for async_op in (False, True):
                y = to_dev(x.clone())
                wait(ctx_factory().broadcast(y, root, comm, async_op))
                same(y, ref, f"broadcast src={root} n={size} async={async_op}")
    m = 33
    x = data(me, m, dtype)
    ref = torch.empty(m * n, dtype=dtype)
    C.all_gather_into_tensor(ref, x, comm)
    for async_op in (False, True):
        out = to_dev(torch.zeros(m * n, dtype=dtype))
        wait(ctx_factory().all_gather_into_tensor(out, to_dev(x), comm, async_op))
        same(out, ref, f"all_gather_into_tensor async={async_op}")
        outs = [to_dev(torch.zeros(m, dtype=dtype)) for _ in range(n)]
        wait(ctx_factory().all_gather(outs, to_dev(x), comm, async_op))
        for i in range(n):
            same(outs[i], ref[i * m:(i + 1) * m], f"all_gather[{i}] async={async_op}")
    for root in range(n):
        mine = comm.rank == root
        got = [to_dev(torch.zeros(m, dtype=dtype)) for _ in range(n)] if mine else None
        ctx_factory().gather(to_dev(x), got, root, comm, False)
        if mine:
            for i in range(n):
                same(got[i], data(i, m, dtype), f"gather dst={root}[{i}]")
        pieces = [to_dev(data(me, m, dtype, salt=i)) for i in range(n)] if mine else None
        out = to_dev(torch.zeros(m, dtype=dtype))
        ctx_factory().scatter(out, pieces, root, comm, False)
        same(out, data(root, m, dtype, salt=me), f"scatter src={root}")
    big = data(me, m * n, dtype)
    ref = torch.empty(m, dtype=dtype)
    C.reduce_scatter_tensor(ref, big.clone(), R.SUM, comm)
    out = to_dev(torch.zeros(m, dtype=dtype))
    ctx_factory().reduce_scatter_tensor(out, to_dev(big), R.SUM, comm, False)
    same(out, ref, "reduce_scatter_tensor")
    out = to_dev(torch.zeros(m, dtype=dtype))
    ctx_factory().reduce_scatter(out, [to_dev(c) for c in big.chunk(n)], R.SUM, comm, False)
    same(out, ref, "reduce_scatter")
    a2a = data(me, 2 * n * 3, dtype).view(2 * n, 3)
    ref = torch.empty_like(a2a)
    C.all_to_all_single(ref, a2a, group=comm)
    out = to_dev(torch.zeros_like(a2a))
    ctx_factory().all_to_all_single(out, to_dev(a2a), None, None, comm, False)
    same(out, ref, "all_to_all_single")
    sin = [j + me + 1 for j in range(n)]
    sout = [me + j + 1 for j in range(n)]
    xu = data(me, sum(sin), dtype)
    refu = torch.empty(sum(sout), dtype=dtype)
    C.all_to_all_single(refu, xu, sout, sin, group=comm)
    outu = to_dev(torch.zeros(sum(sout), dtype=dtype))
    ctx_factory().all_to_all_single(outu, to_dev(xu), sout, sin, comm, False)
    same(outu, refu, "all_to_all_single uneven")
    ins = [data(me, j + 2, dtype, salt=j) for j in range(n)]
    refl = [torch.empty(me + 2, dtype=dtype) for _ in range(n)]
    C.all_to_all(refl, ins, group=comm)
    outl = [to_dev(torch.zeros(me + 2, dtype=dtype)) for _ in range(n)]
    ctx_factory().all_to_all(outl, [to_dev(t) for t in ins], comm, False)
    for j in range(n):
        same(outl[j], refl[j], f"all_to_all[{j}]")
    nxt, prv = (me + 1) % n, (me - 1) % n
    got = to_dev(torch.zeros(1000, dtype=dtype))
    rw = ctx_factory().irecv(got, prv, comm, 11)
    ctx_factory().isend(to_dev(data(me, 1000, dtype)), nxt, comm, 11).wait()
    rw.wait()
    same(got, data(prv, 1000, dtype), "isend/irecv ring")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_op_staged(comm, dev, dtype):
    check_all_ops(comm, lambda t: t.to(dev), staging_ctx, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_op_direct(comm, dev, dtype):
    aware = cuda_mod.cuda_awareness()
    if aware.aware is not True:
        pytest.skip(f"this MPI is not CUDA-aware ({aware.status()}): the direct path would be "
                    f"refused")
    check_all_ops(comm, lambda t: t.to(dev), direct_ctx, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_op_default_route(comm, dev, dtype):
    """Whatever detection decided here (printed in the report)."""
    print(f"[rank{comm.rank}] CUDA-aware: {cuda_mod.cuda_aware_status()}")
    check_all_ops(comm, lambda t: t.to(dev), default_ctx, dtype)


def test_public_api_and_stream_handoff(comm, dev):
    """Produced on a side stream, reduced, consumed on the same stream with no explicit
    synchronisation: the op must wait for the producer and hand the result back."""
    side = torch.cuda.Stream(device=dev)
    n = 1 << 22                                       # 16 MiB of float32: pipelined
    with torch.cuda.stream(side):
        x = torch.full((n,), float(comm.rank + 1), device=dev)
        for _ in range(20):                           # keep the stream busy
            x.mul_(1.0)
        C.all_reduce(x, group=comm)
        y = x * 2                                     # same stream, no sync
    side.synchronize()
    expect = float(sum(range(1, comm.size + 1)))
    assert torch.all(x == expect).item()
    assert torch.all(y == 2 * expect).item()
    # async, waited on from the default stream
    with torch.cuda.stream(side):
        z = torch.full((1000,), 1.0, device=dev)
        w = C.all_reduce(z, group=comm, async_op=True)
    w.wait()
    assert torch.all(z == comm.size).item()


def test_torch_distributed_and_ddp_on_cuda(comm, dev):
    """dist.* on CUDA tensors through the hpcddp process group, then DDP on CUDA: gradients
    equal the average of every rank's local gradients."""
    if not dist.is_initialized():                     # a second init raises, as torch's
        hpcddp.init_process_group()                   # "hpcddp", store from MPI
    t = torch.full((10,), float(comm.rank), device=dev)
    dist.all_reduce(t)
    assert torch.all(t == sum(range(comm.size))).item()
    outs = [torch.zeros(3, device=dev) for _ in range(comm.size)]
    dist.all_gather(outs, torch.full((3,), float(comm.rank), device=dev))
    assert [o[0].item() for o in outs] == [float(r) for r in range(comm.size)]

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(dev)
    local = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 4)).to(dev)
    local.load_state_dict(model.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index])
    g = torch.Generator().manual_seed(100 + comm.rank)
    for step in range(3):
        inp = torch.randn(8, 16, generator=g).to(dev)
        ddp.zero_grad()
        local.zero_grad()
        ddp(inp).square().sum().backward()
        local(inp).square().sum().backward()
        for p_ddp, p_loc in zip(model.parameters(), local.parameters()):
            avg = p_loc.grad.detach().cpu().clone()
            C.all_reduce(avg, R.AVG, comm)
            torch.testing.assert_close(p_ddp.grad.cpu(), avg, rtol=1e-5, atol=1e-6)
        with torch.no_grad():
            for p_ddp, p_loc in zip(model.parameters(), local.parameters()):
                p_ddp.sub_(0.01 * p_ddp.grad)
                p_loc.copy_(p_ddp)
    dist.destroy_process_group()
