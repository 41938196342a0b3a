"""The device path of every op, run without a GPU: CPU tensors stand in for CUDA tensors.

Each op is called through the public API on ``FakeCuda`` tensors (host memory that says it is
on cuda:0), with the device paths' settings (hpcddp.collectives.paths.device.DEVICE) set to
"staging" (the MPI faked not CUDA-aware) or "direct" (faked CUDA-aware). Here the staging copier is
``HostCopier`` (plain copies, logged) and chunks are tiny (64 bytes, pipelined from 128), so a
1000-element tensor goes through ~60 chunks cycling through 3 pinned slots. The "direct" path
is handed host memory posing as device memory: it exercises the blocking MPI calls,
PREMUL_SUM/AVG handling and the list forms the real direct path uses.

Every result must equal the host path (the CPU op itself) exactly: inputs are small
integer-valued numbers, so sums are exact whatever the order or chunking.

The last tests check the gate: with an MPI that is not CUDA-aware, a device call never
produces a device buffer, and a device buffer for such an MPI is refused.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hpcddp
from hpcddp import settings
from hpcddp import collectives as C
from hpcddp.collectives.paths import device as D
from hpcddp.comm import cuda as cuda_mod
from hpcddp.comm.buffers import DevicePointerRefused, DeviceTensor, as_array
from hpcddp.comm.cuda import CudaAwareness
from hpcddp.collectives._gpu_staging import HostCopier, PinnedPool, Staging

MPI_TIMEOUT = 300
R = dist.ReduceOp
AWARE = CudaAwareness(True, "test", "faked CUDA-aware", "test")
NOT_AWARE = CudaAwareness(False, "test", "faked not CUDA-aware", "test")
CHUNK, PIPELINE = 64, 128
SIZES = (0, 5, 1000)       # empty, one chunk, pipelined with a short last chunk
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64)
POOL = PinnedPool(pin=False)


@pytest.fixture(scope="module")
def comm():
    return hpcddp.init().world


def ctx(path: str, log: list | None = None, aware=None) -> "Via":
    """The public ops on CPU tensors posing as CUDA tensors, the device paths set to PATH."""
    staging = Staging(pool=POOL, copier=lambda t: HostCopier(log), chunk_bytes=CHUNK,
                      pipeline_bytes=PIPELINE)
    if aware is None:
        aware = AWARE if path == "direct" else NOT_AWARE
    return Via(aware, staging)


def _fake(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, FakeCuda):
        return FakeCuda.of(x)
    if isinstance(x, list):
        return [_fake(t) for t in x]
    return x


class Via:
    """hpcddp's op of each name, run with the device paths' settings (paths.device.DEVICE) set
    to AWARENESS and STAGING (None: the process's own), each argument first passed through
    WRAP (here: tensors become FakeCuda views of the same memory; test_gpu_cuda.py's real
    CUDA tensors go as they are)."""

    def __init__(self, awareness=None, staging=None, wrap=_fake):
        self.awareness, self.staging, self.wrap = awareness, staging, wrap

    def __getattr__(self, op):
        fn = getattr(C, op)

        def run(*args):
            saved = D.DEVICE.awareness, D.DEVICE.staging
            D.DEVICE.awareness, D.DEVICE.staging = self.awareness, self.staging
            try:
                return fn(*map(self.wrap, args))
            finally:
                D.DEVICE.awareness, D.DEVICE.staging = saved
        return run


def data(rank: int, n: int, dtype, salt: int = 0) -> torch.Tensor:
    # small integers: exact in bfloat16 for sums of up to 4 ranks and products of 2
    x = (torch.arange(n, dtype=torch.int64) * 7 + rank * 3 + salt) % 5 - 2
    return x.to(dtype)


def wait(w):
    if w is not None:
        w.wait()


def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert torch.equal(a, b), f"{what}: {a[:8].tolist()} != {b[:8].tolist()}"


PATHS = ("staging", "direct")


# -- element-wise reductions and broadcast: the pipelined ones ----------------------------

def _ops_for(dtype):
    ops = [("SUM", R.SUM), ("MAX", R.MAX), ("MIN", R.MIN)]
    if dtype.is_floating_point:
        ops += [("AVG", R.AVG), ("PREMUL_SUM", dist._make_nccl_premul_sum(2.0))]
    else:
        ops += [("BXOR", R.BXOR)]
    return ops


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("async_op", (False, True))
def test_all_reduce(comm, dtype, async_op):
    for n in SIZES:
        for name, op in _ops_for(dtype):
            x = data(comm.rank, n, dtype)
            ref = x.clone()
            C.all_reduce(ref, op, comm)
            for path in PATHS:
                y = x.clone()
                wait(ctx(path).all_reduce(y, op, comm, async_op))
                same(y, ref, f"all_reduce {name} {dtype} n={n} {path} async={async_op}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_every_root(comm, dtype):
    for n in SIZES:
        for dst in range(comm.size):
            for name, op in _ops_for(dtype)[:2] + _ops_for(dtype)[-1:]:
                x = data(comm.rank, n, dtype)
                ref = x.clone()
                C.reduce(ref, dst, op, comm)
                for path in PATHS:
                    for async_op in (False, True):
                        y = x.clone()
                        wait(ctx(path).reduce(y, dst, op, comm, async_op))
                        same(y, ref, f"reduce {name} dst={dst} n={n} {path} async={async_op}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_broadcast_every_source(comm, dtype):
    for n in SIZES:
        for src in range(comm.size):
            x = data(comm.rank, n, dtype)
            ref = x.clone()
            C.broadcast(ref, src, comm)
            for path in PATHS:
                for async_op in (False, True):
                    y = x.clone()
                    wait(ctx(path).broadcast(y, src, comm, async_op))
                    same(y, ref, f"broadcast src={src} n={n} {path} async={async_op}")


def test_pipeline_chunks_and_slot_reuse(comm):
    """1000 float32 = 4000 bytes in 16-element chunks: 63 chunks, each copied in once and out
    once, through 3 slots of 256 bytes, with copy-in of chunk i+1 issued before MPI on i."""
    log: list = []
    x = data(comm.rank, 1000, torch.float32)
    ref = x.clone()
    C.all_reduce(ref, R.SUM, comm)
    y = x.clone()
    ctx("staging", log).all_reduce(y, R.SUM, comm, False)
    same(y, ref, "pipelined all_reduce")
    d2h = [e for e in log if e[0] == "d2h"]
    h2d = [e for e in log if e[0] == "h2d"]
    assert len(d2h) == len(h2d) == 63
    assert sum(e[2] for e in d2h) == 1000 and sum(e[2] for e in h2d) == 1000
    assert {e[1] for e in d2h} == {0, 256, 512}            # three slots, reused
    # the pipeline's order: in(0) in(1) out(0) in(2) out(1) ... (in(i+1) before out(i))
    kinds = [e[0] for e in log]
    assert kinds[:4] == ["d2h", "d2h", "h2d", "d2h"]
    assert kinds[-2:] == ["h2d", "h2d"]


def test_pipeline_roles(comm):
    """broadcast: the source only copies in, the others only copy back; reduce: all copy in,
    only the root copies back."""
    log: list = []
    x = data(comm.rank, 1000, torch.float32)
    ctx("staging", log).broadcast(x, 0, comm, False)
    kinds = {e[0] for e in log}
    assert kinds == ({"d2h"} if comm.rank == 0 else {"h2d"})
    log.clear()
    ctx("staging", log).reduce(x, 0, R.SUM, comm, False)
    kinds = {e[0] for e in log}
    assert kinds == ({"d2h", "h2d"} if comm.rank == 0 else {"d2h"})


def test_async_is_staged_whole(comm):
    """async_op=True stages the whole tensor: one copy in, the host op, one copy back.

    all_reduce and reduce run the blocking MPI call even for async_op (a blocking collective
    never matches a non-blocking one on another rank), so their Work is complete on return and
    the copy back has happened: the tensor holds the result before wait(). gather is a real
    MPI_Igather: the root's copies back run in the Work's finish, after MPI completes.
    """
    log: list = []
    x = data(comm.rank, 1000, torch.float32)
    ref = x.clone()
    C.all_reduce(ref, R.SUM, comm)
    w = ctx("staging", log).all_reduce(x, R.SUM, comm, True)
    assert [e[0] for e in log] == ["d2h", "h2d"]
    same(x, ref, "async staged all_reduce, before wait")
    w.wait()
    assert [e[0] for e in log] == ["d2h", "h2d"]
    same(x, ref, "async staged all_reduce")
    assert w.result()[0].data_ptr() == x.data_ptr()     # x itself, posing as CUDA

    log.clear()
    x = data(comm.rank, 1000, torch.float32)
    ref = x.clone()
    C.reduce(ref, 0, R.SUM, comm)
    w = ctx("staging", log).reduce(x, 0, R.SUM, comm, True)
    assert [e[0] for e in log] == (["d2h", "h2d"] if comm.rank == 0 else ["d2h"])
    if comm.rank == 0:
        same(x, ref, "async staged reduce at the root, before wait")
    w.wait()
    assert w.result()[0].data_ptr() == x.data_ptr()     # x itself, posing as CUDA

    log.clear()
    x = data(comm.rank, 1000, torch.float32)
    got = [torch.empty(1000) for _ in range(comm.size)] if comm.rank == 0 else None
    w = ctx("staging", log).gather(x, got, 0, comm, True)
    assert [e[0] for e in log] == ["d2h"]
    w.wait()
    if comm.rank == 0:
        assert [e[0] for e in log] == ["d2h"] + ["h2d"] * comm.size, log
        for r, t in enumerate(got):
            same(t, data(r, 1000, torch.float32), "async staged gather")


# -- the other ops: whole-op staging, and the direct path's blocking forms -----------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gathers(comm, dtype):
    n = comm.size
    for m in (0, 3, 70):
        x = data(comm.rank, m, dtype)
        ref_t = torch.empty(m * n, dtype=dtype)
        C.all_gather_into_tensor(ref_t, x, comm)
        ref_l = [torch.empty(m, dtype=dtype) for _ in range(n)]
        C.all_gather(ref_l, x, comm)
        for path in PATHS:
            for async_op in (False, True):
                what = f"{dtype} m={m} {path} async={async_op}"
                out = torch.full((m * n,), 9, dtype=dtype)
                wait(ctx(path).all_gather_into_tensor(out, x, comm, async_op))
                same(out, ref_t, "all_gather_into_tensor " + what)
                outs = [torch.full((m,), 9, dtype=dtype) for _ in range(n)]
                wait(ctx(path).all_gather(outs, x, comm, async_op))
                for i in range(n):
                    same(outs[i], ref_l[i], f"all_gather[{i}] " + what)
                for dst in range(n):
                    root = comm.rank == dst
                    ref_g = [torch.empty(m, dtype=dtype) for _ in range(n)] if root else None
                    C.gather(x, ref_g, dst, comm)
                    got = [torch.full((m,), 9, dtype=dtype) for _ in range(n)] if root else None
                    wait(ctx(path).gather(x, got, dst, comm, async_op))
                    if root:
                        for i in range(n):
                            same(got[i], ref_g[i], f"gather dst={dst}[{i}] " + what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scatter(comm, dtype):
    n = comm.size
    for m in (0, 4, 70):
        for src in range(n):
            root = comm.rank == src
            pieces = [data(comm.rank, m, dtype, salt=i) for i in range(n)] if root else None
            ref = torch.empty(m, dtype=dtype)
            C.scatter(ref, pieces, src, comm)
            for path in PATHS:
                for async_op in (False, True):
                    got = torch.full((m,), 9, dtype=dtype)
                    wait(ctx(path).scatter(got, pieces, src, comm, async_op))
                    same(got, ref, f"scatter src={src} m={m} {path} async={async_op}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_reduce_scatter(comm, dtype):
    n = comm.size
    for m in (0, 3, 70):
        for name, op in _ops_for(dtype):
            x = data(comm.rank, m * n, dtype)
            ref = torch.empty(m, dtype=dtype)
            C.reduce_scatter_tensor(ref, x.clone(), op, comm)
            for path in PATHS:
                for async_op in (False, True):
                    what = f"{name} {dtype} m={m} {path} async={async_op}"
                    out = torch.full((m,), 9, dtype=dtype)
                    inp = x.clone()
                    wait(ctx(path).reduce_scatter_tensor(out, inp, op, comm, async_op))
                    same(out, ref, "reduce_scatter_tensor " + what)
                    same(inp, x, "reduce_scatter_tensor leaves its input " + what)
                    out = torch.full((m,), 9, dtype=dtype)
                    wait(ctx(path).reduce_scatter(out, list(x.clone().chunk(n)) if m else
                                                  [torch.empty(0, dtype=dtype) for _ in range(n)],
                                                  op, comm, async_op))
                    same(out, ref, "reduce_scatter " + what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_all_to_all(comm, dtype):
    n = comm.size
    # equal splits, then uneven ones (rank r sends j+r+1 rows to rank j)
    x = data(comm.rank, 4 * n * 3, dtype).view(4 * n, 3)
    ref = torch.empty_like(x)
    C.all_to_all_single(ref, x, group=comm)
    sin = [j + comm.rank + 1 for j in range(n)]
    sout = [comm.rank + j + 1 for j in range(n)]
    xu = data(comm.rank, sum(sin) * 2, dtype).view(sum(sin), 2)
    refu = torch.empty(sum(sout), 2, dtype=dtype)
    C.all_to_all_single(refu, xu, sout, sin, group=comm)
    ins = [data(comm.rank, j + 2, dtype, salt=j) for j in range(n)]
    refl = [torch.empty(comm.rank + 2, dtype=dtype) for _ in range(n)]
    C.all_to_all(refl, ins, group=comm)
    for path in PATHS:
        for async_op in (False, True):
            what = f"{dtype} {path} async={async_op}"
            out = torch.full_like(x, 9)
            wait(ctx(path).all_to_all_single(out, x, None, None, comm, async_op))
            same(out, ref, "all_to_all_single " + what)
            outu = torch.full_like(refu, 9)
            wait(ctx(path).all_to_all_single(outu, xu, sout, sin, comm, async_op))
            same(outu, refu, "all_to_all_single uneven " + what)
            outl = [torch.full_like(t, 9) for t in refl]
            wait(ctx(path).all_to_all(outl, ins, comm, async_op))
            for i in range(n):
                same(outl[i], refl[i], f"all_to_all[{i}] " + what)


@pytest.mark.parametrize("path", PATHS)
def test_point_to_point(comm, path):
    """A ring: rank r sends to r+1 and receives from r-1 (isend/irecv, then blocking
    send/recv ordered by parity, then a receive from any source). Never pipelined: the
    1000-element message stays one message, so a CPU peer's single receive matches it."""
    n = comm.size
    nxt, prv = (comm.rank + 1) % n, (comm.rank - 1) % n
    x = data(comm.rank, 1000, torch.float32)
    expect = data(prv, 1000, torch.float32)
    got = torch.zeros(1000)
    rw = ctx(path).irecv(got, prv, comm, 3)
    sw = ctx(path).isend(x, nxt, comm, 3)
    sw.wait()
    rw.wait()
    same(got, expect, f"isend/irecv {path}")
    got = torch.zeros(1000)
    if comm.rank % 2 == 0:
        ctx(path).send(x, nxt, comm, 4)
        src = ctx(path).recv(got, prv, comm, 4)
    else:
        src = ctx(path).recv(got, prv, comm, 4)
        ctx(path).send(x, nxt, comm, 4)
    assert src == prv
    same(got, expect, f"send/recv {path}")
    # a CPU sender and a staged receiver from any source: message structure matches
    got = torch.zeros(1000)
    rw = ctx(path).irecv(got, None, comm, 5)
    C.send(x, nxt, comm, tag=5)
    rw.wait()
    assert rw.source_rank() == prv
    same(got, expect, f"cpu send -> device irecv(any) {path}")


def test_validation_happens_before_staging(comm):
    """Errors name the op and argument on the calling rank, and the pinned buffer goes back."""
    before = POOL.cached_bytes()
    with pytest.raises(ValueError, match="all_gather: tensor_list has 1 tensors"):
        ctx("staging").all_gather([torch.zeros(3)], torch.zeros(3), comm, False)
    with pytest.raises(TypeError, match="all tensors of one op must be on one device"):
        C.all_gather_into_tensor(FakeCuda.of(torch.zeros(3 * comm.size)), torch.zeros(3), comm)
    with pytest.raises(ValueError, match="expected"):
        ctx("staging").reduce_scatter_tensor(torch.zeros(2), torch.zeros(2 * comm.size + 1),
                                             R.SUM, comm, False)
    assert POOL.cached_bytes() >= before


# -- the gate: CUDA-looking tensors through the public API ----------------------------------

class FakeCuda(torch.Tensor):
    """Host memory that says it is on cuda:0: what the routing sees of a CUDA tensor.
    (is_cuda stays False, so the staging copier is HostCopier and nothing calls CUDA.)"""

    @property
    def is_cpu(self):
        return False

    @property
    def device(self):
        return torch.device("cuda", 0)

    @staticmethod
    def of(t: torch.Tensor) -> "FakeCuda":
        return t.as_subclass(FakeCuda)


@pytest.fixture
def spy_buffers(monkeypatch):
    calls: list = []
    real = cuda_mod.device_buffer

    def spy(t, fn="hpcddp", arg="tensor", **kw):
        calls.append((fn, arg))
        return real(t, fn, arg, **kw)
    monkeypatch.setattr(cuda_mod, "device_buffer", spy)
    return calls


@pytest.fixture
def small_default_staging(monkeypatch):
    monkeypatch.setattr(D.DEVICE, "staging", ctx("staging").staging)


def test_as_array_refuses_device_memory():
    with pytest.raises(DeviceTensor, match="all_reduce: tensor is on cuda:0"):
        as_array(FakeCuda.of(torch.zeros(4)), "all_reduce", "tensor")


def _public_ops_run(comm):
    """Every public op on CUDA-looking tensors; returns nothing, asserts results."""
    n = comm.size
    x = data(comm.rank, 1000, torch.float32)
    ref = x.clone()
    C.all_reduce(ref, R.SUM, comm)
    y = FakeCuda.of(x.clone())
    C.all_reduce(y, group=comm)
    same(y.as_subclass(torch.Tensor), ref, "public all_reduce")
    y = FakeCuda.of(x.clone())
    C.all_reduce(y, group=comm, async_op=True).wait()
    same(y.as_subclass(torch.Tensor), ref, "public async all_reduce")
    b = FakeCuda.of(x.clone())
    C.broadcast(b, 0, comm)
    same(b.as_subclass(torch.Tensor), data(0, 1000, torch.float32), "public broadcast")
    outs = [FakeCuda.of(torch.zeros(5)) for _ in range(n)]
    C.all_gather(outs, FakeCuda.of(data(comm.rank, 5, torch.float32)), comm)
    for i in range(n):
        same(outs[i].as_subclass(torch.Tensor), data(i, 5, torch.float32), "public all_gather")
    o = FakeCuda.of(torch.zeros(5))
    C.reduce_scatter(o, [FakeCuda.of(data(comm.rank, 5, torch.float32, salt=j))
                         for j in range(n)], group=comm)
    expect = sum(data(r, 5, torch.float32, salt=comm.rank) for r in range(n))
    same(o.as_subclass(torch.Tensor), expect, "public reduce_scatter")
    a = FakeCuda.of(torch.zeros(n * 2))
    C.all_to_all_single(a, FakeCuda.of(data(comm.rank, n * 2, torch.float32)), group=comm)
    ins = [FakeCuda.of(data(comm.rank, 2, torch.float32, salt=j)) for j in range(n)]
    outl = [FakeCuda.of(torch.zeros(2)) for _ in range(n)]
    C.all_to_all(outl, ins, group=comm)
    for j in range(n):
        same(outl[j].as_subclass(torch.Tensor), data(j, 2, torch.float32, salt=comm.rank),
             "public all_to_all")


def test_public_ops_stage_when_not_aware(comm, monkeypatch, spy_buffers, small_default_staging):
    """The detection says no: every op takes the staging path and no device buffer is made."""
    monkeypatch.setattr(D.DEVICE, "awareness", NOT_AWARE)
    _public_ops_run(comm)
    assert spy_buffers == []


def test_public_ops_stage_when_unknown(comm, monkeypatch, spy_buffers, small_default_staging):
    monkeypatch.setattr(D.DEVICE, "awareness", CudaAwareness(None, "none", "unknown", "x"))
    _public_ops_run(comm)
    assert spy_buffers == []


def test_public_ops_direct_when_aware(comm, monkeypatch, spy_buffers, small_default_staging):
    """Detection says yes: device buffers go to MPI (here host memory posing as device)."""
    monkeypatch.setattr(D.DEVICE, "awareness", AWARE)
    _public_ops_run(comm)
    assert ("all_reduce", "tensor") in spy_buffers


def test_bfloat16_reductions_stage_even_when_aware(comm, monkeypatch, spy_buffers,
                                                   small_default_staging):
    """bfloat16 reduces with a user-defined MPI op (Python code reading the buffers): never
    given device pointers. Its broadcast (no op) goes direct."""
    monkeypatch.setattr(D.DEVICE, "awareness", AWARE)
    x = data(comm.rank, 100, torch.bfloat16)
    ref = x.clone()
    C.all_reduce(ref, R.SUM, comm)
    y = FakeCuda.of(x.clone())
    C.all_reduce(y, group=comm)
    same(y.as_subclass(torch.Tensor), ref, "bf16 all_reduce")
    assert spy_buffers == []
    C.broadcast(FakeCuda.of(x.clone()), 0, comm)
    assert spy_buffers == [("broadcast", "tensor")]


def test_env_override_drives_the_default_route(comm, monkeypatch, spy_buffers,
                                               small_default_staging):
    """HPCDDP_CUDA_AWARE through the real detection: 0 stages, 1 goes direct."""
    for value, direct in (("0", False), ("1", True)):
        # as if the job had started with HPCDDP_CUDA_AWARE=value (settings are read once)
        monkeypatch.setattr(settings, "_current", settings.get().replace(cuda_aware=value))
        cuda_mod.reset_cache()
        spy_buffers.clear()
        y = FakeCuda.of(data(comm.rank, 10, torch.float32))
        C.all_reduce(y, group=comm)
        assert bool(spy_buffers) is direct, value
    monkeypatch.undo()
    cuda_mod.reset_cache()


def test_device_pointers_only_for_an_mpi_known_to_be_cuda_aware(comm, monkeypatch,
                                                                spy_buffers,
                                                                small_default_staging):
    """A device pointer must never reach an MPI not known to be CUDA-aware: the CUDA-aware row
    does not take the call there (PREMUL_SUM and send included), and a device buffer asked for
    anyway is refused, naming the op and the fix."""
    for aware in (NOT_AWARE, CudaAwareness(None, "none", "cannot tell", "x")):
        monkeypatch.setattr(D.DEVICE, "awareness", aware)
        t = FakeCuda.of(torch.ones(4))
        C.all_reduce(t, dist._make_nccl_premul_sum(3.0), comm)
        assert torch.equal(t.as_subclass(torch.Tensor), torch.full((4,), 3.0 * comm.size))
        n = comm.size
        if n > 1:
            nxt, prv = (comm.rank + 1) % n, (comm.rank - 1) % n
            got = FakeCuda.of(torch.zeros(4))
            w = C.irecv(got, prv, comm, 9)
            C.send(t, nxt, comm, 9)
            w.wait()
    assert spy_buffers == []
    with pytest.raises(DevicePointerRefused, match="all_reduce: .*HPCDDP_CUDA_AWARE=1"):
        cuda_mod.device_buffer(FakeCuda.of(torch.ones(2)), "all_reduce", "tensor", sync=False,
                               awareness=NOT_AWARE)
    with pytest.raises(DevicePointerRefused, match="not known to be CUDA-aware"):
        cuda_mod.device_buffer(torch.ones(2), "send", "tensor", sync=False,
                               awareness=NOT_AWARE)
