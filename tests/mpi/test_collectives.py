"""Every collective x dtype x reduce op on the world: hpcddp against numpy and against gloo.

Each op runs three ways on the same inputs: ``dist.*`` on the hpcddp process group, the direct
API (``hpcddp.*`` on a Communicator) and ``dist.*`` on a gloo group over the same ranks. All
three are checked against a numpy reference computed from every rank's inputs (each rank
builds every other rank's input itself, so no message is needed for the reference); gloo and
hpcddp must agree exactly wherever gloo defines the op (torch's semantics are the reference).
Where gloo refuses an op or dtype, hpcddp is checked against numpy alone.

Inputs are small multiples of 0.5 in {0.5, 1, 1.5, 2} with signs: every sum and product of up
to 4 of them is exact even in bfloat16, so results do not depend on the reduction order and
can be compared exactly (AVG divides by the group size and is compared with a tolerance).

The engine (``Grp``, ``CASES``, ``run_matrix``) is shared with test_collectives_groups.py.
Set HPCDDP_SUPPORT_MATRIX=path.json to write the dtype x op matrix these tests proved (rank 0).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hpcddp

MPI_TIMEOUT = 300
# torch 2.13 renames the _tensor forms (all_gather_single...): the old names must still work
pytestmark = pytest.mark.filterwarnings("ignore:.*(is|will be) deprecated:FutureWarning")

R = dist.ReduceOp
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128, torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8,
          torch.bool)
FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX = (torch.complex64, torch.complex128)
OP_NAMES = ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM")
PREMUL_FACTOR = 2.0
APIS = ("hpcddp", "direct", "gloo")
# AVG divides an exact sum by the group size: one rounding in the dtype
TOL = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6, torch.float64: 1e-12,
       torch.complex64: 1e-6, torch.complex128: 1e-12}
GLOO_TIMEOUT = timedelta(seconds=60)

SUPPORT: dict = {}  # (group kind, op fn, dtype, reduce op) -> {api: "ok" | "refused: ..."}


def short(dtype) -> str:
    return str(dtype).replace("torch.", "")


def make_op(name: str):
    if name == "PREMUL_SUM":
        return dist._make_nccl_premul_sum(PREMUL_FACTOR)
    return getattr(R, name)


def defined(opname: str, dtype, api: str = "hpcddp", fname: str = "") -> bool:
    """Where hpcddp defines a reduce op (torch's semantics)."""
    if opname is None:
        return True
    if dtype == torch.bool:  # SUM/MAX/BOR = any, PRODUCT/MIN/BAND = all, BXOR = parity
        return opname not in ("AVG", "PREMUL_SUM")
    if dtype in COMPLEX:
        # MPI defines PRODUCT on complex numbers; torch's all_reduce wrapper refuses it (and
        # PRODUCT/MIN/MAX/bitwise) on complex tensors before any backend sees it
        return opname in ("SUM", "AVG", "PREMUL_SUM") or (
            opname == "PRODUCT" and (api == "direct" or fname != "all_reduce"))
    # (gloo refuses complex PRODUCT in every reduction; MPI's is the true complex product)
    if dtype in FLOATS:
        return opname not in ("BAND", "BOR", "BXOR")
    return opname not in ("AVG", "PREMUL_SUM")  # integers


# -- inputs and the numpy reference ---------------------------------------------------------
def value(dtype, seed: int, shape) -> torch.Tensor:
    """Deterministic input: any rank can build any other rank's (seed = rank, or rank*K+j)."""
    k = int(np.prod(shape)) if len(shape) else 1
    i = np.arange(k)
    base = (i * 7 + seed * 5 + (seed // 3)) % 4            # 0..3
    sign = np.where((i + seed) % 3 == 1, -1, 1)
    if dtype == torch.bool:
        v = ((i * 5 + seed * 3) % 3) != 0
        a = torch.from_numpy(v)
    elif dtype == torch.uint8:
        a = torch.from_numpy(base + 1)
    elif dtype in (torch.int8, torch.int16, torch.int32, torch.int64):
        a = torch.from_numpy((base + 1) * sign)
    elif dtype in COMPLEX:
        re = (base + 1) * sign * 0.5
        im = ((i * 3 + seed) % 4 - 1.5)
        a = torch.from_numpy(re + 1j * im)
    else:
        a = torch.from_numpy((base + 1) * sign * 0.5)
    return a.to(dtype).reshape(shape).clone()


def wide(t: torch.Tensor) -> np.ndarray:
    if t.is_complex():
        return t.to(torch.complex128).numpy()
    if t.is_floating_point():
        return t.to(torch.float64).numpy()
    return t.to(torch.int64).numpy()


def narrow(a, dtype) -> torch.Tensor:
    # int64 -> int8 wraps, int64 -> bool is "non-zero": the ring arithmetic MPI does in the dtype
    return torch.from_numpy(np.ascontiguousarray(a)).to(dtype)


def reduce_ref(opname: str, tensors, dtype) -> torch.Tensor:
    n = len(tensors)
    if opname == "PREMUL_SUM":
        tensors = [t * PREMUL_FACTOR for t in tensors]
    s = np.stack([wide(t) for t in tensors])
    if opname in ("SUM", "PREMUL_SUM"):
        out = s.sum(0)
    elif opname == "AVG":
        out = s.sum(0) / n
    elif opname == "PRODUCT":
        out = s.prod(0)
    elif opname == "MIN":
        out = s.min(0)
    elif opname == "MAX":
        out = s.max(0)
    elif opname == "BAND":
        out = np.bitwise_and.reduce(s, 0)
    elif opname == "BOR":
        out = np.bitwise_or.reduce(s, 0)
    elif opname == "BXOR":
        out = np.bitwise_xor.reduce(s, 0)
    else:
        raise AssertionError(opname)
    return narrow(out, dtype)


# -- the groups a matrix runs on ------------------------------------------------------------
@dataclass
class Grp:
    """One group seen three ways: hpcddp process group, hpcddp Communicator, gloo group."""
    kind: str
    ranks: list                 # world ranks in torch's group order (sorted)
    pg: object = None           # hpcddp torch group (None: the default group)
    comm: object = None         # hpcddp Communicator (direct API)
    gloo: object = None         # gloo torch group over the same ranks
    notes: list = field(default_factory=list)

    @property
    def member(self) -> bool:
        return dist.get_rank() in self.ranks

    @property
    def rank(self) -> int:
        return self.ranks.index(dist.get_rank())

    @property
    def size(self) -> int:
        return len(self.ranks)

    def group(self, api):
        return {"hpcddp": self.pg, "gloo": self.gloo, "direct": self.comm}[api]

    def root(self, api, group_rank: int) -> int:
        """A src/dst argument: torch's API takes world ranks, the direct API group ranks."""
        return group_rank if api == "direct" else self.ranks[group_rank]


_gloo_world = None


def init_world() -> Grp:
    global _gloo_world
    if not dist.is_initialized():
        hpcddp.init_process_group()
    if _gloo_world is None:
        _gloo_world = dist.new_group(backend="gloo", timeout=GLOO_TIMEOUT)
    n = dist.get_world_size()
    return Grp("world", list(range(n)), None, hpcddp.world(), _gloo_world)


def call(api: str, g: Grp, fname: str, *args, **kw):
    fn = getattr(hpcddp if api == "direct" else dist, fname)
    return fn(*args, group=g.group(api), **kw)


# -- one runner per op: (api, group, dtype, reduce op name) -> output tensors on this rank ---
# and one expectation: (group, dtype, reduce op name) -> what this rank must hold
SHAPE = (2, 3)


def run_broadcast(api, g, dt, _):
    t = value(dt, g.rank, SHAPE)
    call(api, g, "broadcast", t, src=g.root(api, g.size - 1))
    return [t]


def exp_broadcast(g, dt, _):
    return [value(dt, g.size - 1, SHAPE)]


def run_all_reduce(api, g, dt, op):
    t = value(dt, g.rank, SHAPE)
    call(api, g, "all_reduce", t, op=make_op(op))
    return [t]


def exp_all_reduce(g, dt, op):
    return [reduce_ref(op, [value(dt, r, SHAPE) for r in range(g.size)], dt)]


def run_reduce(api, g, dt, op):
    t = value(dt, g.rank, SHAPE)
    call(api, g, "reduce", t, dst=g.root(api, g.size - 1), op=make_op(op))
    return [t]


def exp_reduce(g, dt, op):
    if g.rank == g.size - 1:
        return exp_all_reduce(g, dt, op)
    return [value(dt, g.rank, SHAPE)]  # hpcddp leaves the other ranks' tensors as they were


def run_all_gather(api, g, dt, _):
    out = [torch.zeros(SHAPE, dtype=dt) for _ in range(g.size)]
    call(api, g, "all_gather", out, value(dt, g.rank, SHAPE))
    return out


def exp_all_gather(g, dt, _):
    return [value(dt, r, SHAPE) for r in range(g.size)]


def run_all_gather_into_tensor(api, g, dt, _):
    out = torch.zeros((g.size * SHAPE[0], SHAPE[1]), dtype=dt)  # blocks concatenated on dim 0
    call(api, g, "all_gather_into_tensor", out, value(dt, g.rank, SHAPE))
    return [out]


def exp_all_gather_into_tensor(g, dt, _):
    return [torch.cat([value(dt, r, SHAPE) for r in range(g.size)])]


def run_all_gather_into_tensor_stacked(api, g, dt, _):
    out = torch.zeros((g.size,) + SHAPE, dtype=dt)  # blocks stacked on a new dim 0
    call(api, g, "all_gather_into_tensor", out, value(dt, g.rank, SHAPE))
    return [out]


def exp_all_gather_into_tensor_stacked(g, dt, _):
    return [torch.stack([value(dt, r, SHAPE) for r in range(g.size)])]


def run_gather(api, g, dt, _):
    dst = min(1, g.size - 1)
    out = [torch.zeros(SHAPE, dtype=dt) for _ in range(g.size)] if g.rank == dst else None
    call(api, g, "gather", value(dt, g.rank, SHAPE), out, dst=g.root(api, dst))
    return out or []


def exp_gather(g, dt, _):
    return exp_all_gather(g, dt, _) if g.rank == min(1, g.size - 1) else []


def run_scatter(api, g, dt, _):
    src = g.size - 1
    ins = [value(dt, 100 + j, SHAPE) for j in range(g.size)] if g.rank == src else None
    out = torch.zeros(SHAPE, dtype=dt)
    call(api, g, "scatter", out, ins, src=g.root(api, src))
    return [out]


def exp_scatter(g, dt, _):
    return [value(dt, 100 + g.rank, SHAPE)]


BLOCK = 3


def run_reduce_scatter(api, g, dt, op):
    ins = [value(dt, g.rank * 10 + j, (BLOCK,)) for j in range(g.size)]
    out = torch.zeros(BLOCK, dtype=dt)
    call(api, g, "reduce_scatter", out, ins, op=make_op(op))
    return [out]


def exp_reduce_scatter(g, dt, op):
    return [reduce_ref(op, [value(dt, r * 10 + g.rank, (BLOCK,)) for r in range(g.size)], dt)]


def run_reduce_scatter_tensor(api, g, dt, op):
    blocks = [value(dt, g.rank * 10 + j, (BLOCK,)) for j in range(g.size)]
    out = torch.zeros(BLOCK, dtype=dt)
    call(api, g, "reduce_scatter_tensor", out, torch.cat(blocks), op=make_op(op))
    return [out]


exp_reduce_scatter_tensor = exp_reduce_scatter


def run_reduce_scatter_tensor_stacked(api, g, dt, op):
    blocks = [value(dt, g.rank * 10 + j, (BLOCK,)) for j in range(g.size)]
    out = torch.zeros(BLOCK, dtype=dt)
    call(api, g, "reduce_scatter_tensor", out, torch.stack(blocks), op=make_op(op))
    return [out]


exp_reduce_scatter_tensor_stacked = exp_reduce_scatter


def a2a_rows(i: int, j: int) -> int:
    """Rows rank i sends rank j in the unequal cases (0, 1 or 2: empty blocks included)."""
    return (i + 2 * j) % 3


def run_all_to_all(api, g, dt, _):
    ins = [value(dt, g.rank * 10 + j, (2, 2)) for j in range(g.size)]
    outs = [torch.zeros((2, 2), dtype=dt) for j in range(g.size)]
    call(api, g, "all_to_all", outs, ins)
    return outs


def exp_all_to_all(g, dt, _):
    return [value(dt, j * 10 + g.rank, (2, 2)) for j in range(g.size)]


def run_all_to_all_unequal(api, g, dt, _):
    me = g.rank
    ins = [value(dt, me * 10 + j, (a2a_rows(me, j), 2)) for j in range(g.size)]
    outs = [torch.zeros((a2a_rows(j, me), 2), dtype=dt) for j in range(g.size)]
    call(api, g, "all_to_all", outs, ins)
    return outs


def exp_all_to_all_unequal(g, dt, _):
    return [value(dt, j * 10 + g.rank, (a2a_rows(j, g.rank), 2)) for j in range(g.size)]


def run_all_to_all_single(api, g, dt, _):
    n, me = g.size, g.rank
    out = torch.zeros((2 * n, 3), dtype=dt)  # no split sizes: dim 0 split evenly
    call(api, g, "all_to_all_single", out, value(dt, me, (2 * n, 3)))
    return [out]


def exp_all_to_all_single(g, dt, _):
    n, me = g.size, g.rank
    return [torch.cat([value(dt, j, (2 * n, 3))[2 * me:2 * me + 2] for j in range(n)])]


def run_all_to_all_single_unequal(api, g, dt, _):
    n, me = g.size, g.rank
    sin = [a2a_rows(me, j) for j in range(n)]  # empty blocks included
    sout = [a2a_rows(j, me) for j in range(n)]
    out = torch.zeros((sum(sout), 3), dtype=dt)
    call(api, g, "all_to_all_single", out, value(dt, me, (sum(sin), 3)),
         output_split_sizes=sout, input_split_sizes=sin)
    return [out]


def exp_all_to_all_single_unequal(g, dt, _):
    n, me = g.size, g.rank
    parts = []
    for j in range(n):
        rows = [a2a_rows(j, k) for k in range(n)]
        start = sum(rows[:me])
        parts.append(value(dt, j, (sum(rows), 3))[start:start + rows[me]])
    return [torch.cat(parts)]


REDUCING = ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
            "reduce_scatter_tensor_stacked")
CASES = ("broadcast", "all_reduce", "reduce", "all_gather", "all_gather_into_tensor",
         "all_gather_into_tensor_stacked", "gather", "scatter", "reduce_scatter",
         "reduce_scatter_tensor", "reduce_scatter_tensor_stacked", "all_to_all",
         "all_to_all_unequal", "all_to_all_single", "all_to_all_single_unequal")
# the torch function each case calls (error messages name it)
FUNCTION = {c: c.replace("_stacked", "").replace("_unequal", "") for c in CASES}


def _same(got, want, approx: bool) -> str | None:
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"dtype/shape {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
    if approx and (got.is_floating_point() or got.is_complex()):
        tol = TOL[got.dtype]
        if torch.allclose(got.to(torch.complex128 if got.is_complex() else torch.float64),
                          want.to(torch.complex128 if got.is_complex() else torch.float64),
                          rtol=tol, atol=tol):
            return None
    elif torch.equal(got, want):
        return None
    return f"got {got.tolist()} expected {want.tolist()}"


def _holds_result(g: Grp, fname: str) -> bool:
    if fname == "gather":
        return g.rank == min(1, g.size - 1)
    if fname == "reduce":
        return g.rank == g.size - 1
    return True


def run_case(g: Grp, fname: str, dt, op, apis=APIS) -> list:
    """Run one (op, dtype, reduce op) on G through every API; return the problems found."""
    problems = []
    runner, expect = globals()["run_" + fname], globals()["exp_" + fname]
    tag = f"[{g.kind} {fname} {short(dt)}{' ' + op if op else ''}]"
    ok = any(defined(op, dt, api, fname) for api in apis if api != "gloo")
    results = {}
    status = SUPPORT.setdefault((g.kind, fname, short(dt), op), {})
    for api in apis:
        if api == "gloo" and g.gloo is None:
            continue
        should = defined(op, dt, api, fname) if api != "gloo" else None
        try:
            results[api] = runner(api, g, dt, op)
            status[api] = "ok"
        except (ValueError, TypeError, RuntimeError, NotImplementedError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            status[api] = f"refused: {msg[:160]}"
            if should:
                problems.append(f"{tag} {api} raised {type(exc).__name__}: {msg}")
            elif api != "gloo" and not msg.startswith((FUNCTION[fname] + ":",
                                                        FUNCTION[fname] + " does not support")):
                problems.append(f"{tag} {api} refused without naming the function: {msg}")
            continue
        if should is False:
            problems.append(f"{tag} {api} accepted an op hpcddp should refuse")
            continue
    if not ok:
        return problems
    want = expect(g, dt, op)
    approx = op == "AVG"
    for api, got in results.items():
        if api == "gloo":
            if not defined(op, dt, "hpcddp", fname):
                problems.append(f"{tag} gloo defines this op, hpcddp refuses it")
                continue
            if not _holds_result(g, fname):
                continue  # gloo uses the non-root tensors as scratch: torch leaves them unspecified
        if len(got) != len(want):
            problems.append(f"{tag} {api}: {len(got)} outputs, expected {len(want)}")
            continue
        for k, (a, b) in enumerate(zip(got, want)):
            diff = _same(a, b, approx)
            if diff:
                problems.append(f"{tag} {api} output {k} vs numpy: {diff}")
    # gloo agrees with hpcddp exactly wherever both ran (on the root only for rooted ops)
    if "gloo" in results and "hpcddp" in results and _holds_result(g, fname):
        for k, (a, b) in enumerate(zip(results["hpcddp"], results["gloo"])):
            diff = _same(a, b, approx)
            if diff:
                problems.append(f"{tag} hpcddp vs gloo output {k}: {diff}")
    return problems


def run_matrix(g: Grp, fname: str, dtypes=DTYPES, apis=APIS) -> list:
    problems = []
    if not g.member:
        return problems
    ops = OP_NAMES if fname in REDUCING else (None,)
    for dt in dtypes:
        for op in ops:
            problems += run_case(g, fname, dt, op, apis)
    return problems


def dump_support(path: str) -> None:
    rows = [{"group": k[0], "op": k[1], "dtype": k[2], "reduce_op": k[3], **v}
            for k, v in sorted(SUPPORT.items(), key=lambda kv: tuple(map(str, kv[0])))]
    with open(path, "w") as f:
        json.dump({"world_size": dist.get_world_size(), "cases": rows}, f, indent=1)


# -- the tests ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world():
    g = init_world()
    yield g
    path = os.environ.get("HPCDDP_SUPPORT_MATRIX")
    if path and dist.get_rank() == 0:
        dump_support(path)


@pytest.mark.parametrize("fname", CASES)
def test_matrix_world(world, fname):
    problems = run_matrix(world, fname)
    assert not problems, "\n".join(problems)


def test_all_to_all_single_splits_given_on_some_ranks_only(world):
    """Each rank knows only its own splits: ranks that pass none (even blocks) and a rank that
    passes uneven ones (its block to itself is bigger) must still meet in one exchange, in
    blocking and async calls mixed across ranks."""
    n, r, B = dist.get_world_size(), dist.get_rank(), 3
    for flip in (0, 1):
        a = (r + flip) % 2 == 0
        if r == n - 1:
            sp = [B] * (n - 1) + [B + 2]
            inp = value(torch.float32, r, (sum(sp),))
            out = torch.full((sum(sp),), -1.0)
            work = dist.all_to_all_single(out, inp, sp, sp, async_op=a)
            mine = inp[(n - 1) * B:]
        else:
            inp = value(torch.float32, r, (n * B,))
            out = torch.full((n * B,), -1.0)
            work = hpcddp.all_to_all_single(out, inp, async_op=a)
            mine = inp[r * B:(r + 1) * B]
        if work is not None:
            work.wait()
        want = [value(torch.float32, q, (n * B if q < n - 1 else n * B + 2,))[r * B:(r + 1) * B]
                for q in range(n)]
        want[r] = mine
        assert torch.equal(out, torch.cat(want)), (r, flip, out.tolist())


def test_all_to_all_single_without_splits_takes_the_even_path(world):
    """torch passes [] where the direct API passes None: both mean even blocks and take the
    cached-layout path (the general one cost torch's calls ~2 us more)."""
    from hpcddp.collectives import alltoall
    n, r = dist.get_world_size(), dist.get_rank()
    inp = value(torch.float32, r, (7 * n, 2))
    for api in (dist, hpcddp):
        alltoall._even.clear()
        out = torch.zeros(7 * n, 2)
        api.all_to_all_single(out, inp)
        assert list(alltoall._even) == [(n, 14 * n)], api.__name__
        want = torch.cat([value(torch.float32, q, (7 * n, 2))[7 * r:7 * r + 7] for q in range(n)])
        assert torch.equal(out, want), api.__name__


def test_barrier(world):
    for api in APIS:
        assert call(api, world, "barrier") is None
    w = hpcddp.barrier(async_op=True)
    w.wait()
    assert w.is_completed()


def test_monitored_barrier(world):
    # torch's dist.monitored_barrier accepts gloo only; hpcddp's own works on any group
    hpcddp.monitored_barrier(timeout=60)
    hpcddp.monitored_barrier(world.comm, timeout=timedelta(seconds=60), wait_all_ranks=True)
    with pytest.raises(Exception):
        dist.monitored_barrier(timeout=timedelta(seconds=60))  # not gloo: torch refuses locally
    dist.monitored_barrier(world.gloo, timeout=timedelta(seconds=60))


def test_large_half_reductions(world):
    """Large enough for MPI's pipelined algorithms: the 16-bit reductions see partial buffers."""
    n = dist.get_world_size()
    k = 300_003
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        x = value(dt, dist.get_rank(), (k,))
        want = reduce_ref("SUM", [value(dt, r, (k,)) for r in range(n)], dt)
        for api in ("hpcddp", "direct"):
            t = x.clone()
            call(api, world, "all_reduce", t)
            assert torch.equal(t, want), f"{api} {dt}"
        t = x.clone()
        call("hpcddp", world, "all_reduce", t, op=R.MAX)
        assert torch.equal(t, reduce_ref("MAX", [value(dt, r, (k,)) for r in range(n)], dt))


def test_overflow_wraps_like_gloo(world):
    """Integer SUM/PRODUCT wrap around in the dtype, as in torch and gloo."""
    n = dist.get_world_size()
    for dt in (torch.int8, torch.uint8, torch.int32):
        info = torch.iinfo(dt)
        base = torch.tensor([info.max, info.min + 1, 3], dtype=dt)
        for op in ("SUM", "PRODUCT"):
            outs = {}
            for api in APIS:
                t = base.clone()
                call(api, world, "all_reduce", t, op=make_op(op))
                outs[api] = t
            want = reduce_ref(op, [base] * n, dt)
            for api, t in outs.items():
                assert torch.equal(t, want), f"{api} {dt} {op}: {t} != {want}"


def test_scalar_and_empty_tensors(world):
    n = dist.get_world_size()
    r = dist.get_rank()
    for api in APIS:
        s = torch.tensor(float(r + 1))
        call(api, world, "all_reduce", s)
        assert s.item() == n * (n + 1) / 2
        e = torch.zeros(0)
        call(api, world, "all_reduce", e)
        call(api, world, "broadcast", e, src=0)
        outs = [torch.zeros(0) for _ in range(n)]
        call(api, world, "all_gather", outs, e)
        s = torch.tensor(float(r))
        call(api, world, "broadcast", s, src=world.root(api, n - 1))
        assert s.item() == n - 1


def test_premul_sum_tensor_factor(world):
    n = dist.get_world_size()
    factor = torch.tensor(0.5, dtype=torch.float64)
    t = torch.ones(4, dtype=torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(factor))
    assert torch.equal(t, torch.full((4,), 0.5 * n, dtype=torch.float64))


def test_premul_sum_factor_of_another_dtype_keeps_the_tensors_dtype(world):
    """A factor tensor of another dtype (float64, one element: it takes part in type promotion)
    scales float32 tensors in float32, on every reduction: the copies the non-in-place ones
    send keep the dtype MPI is told."""
    n, r = dist.get_world_size(), dist.get_rank()
    op = dist._make_nccl_premul_sum(torch.tensor([0.5], dtype=torch.float64))
    x = torch.arange(4.0 * n) + r
    want = sum(torch.arange(4.0 * n) + q for q in range(n)) * 0.5
    out = torch.zeros(4)
    dist.reduce_scatter_tensor(out, x.clone(), op=op)
    assert torch.equal(out, want[4 * r:4 * (r + 1)]), (out, want)
    out.zero_()
    dist.reduce_scatter(out, list(x.clone().chunk(n)), op=op)
    assert torch.equal(out, want[4 * r:4 * (r + 1)]), (out, want)
    t = x.clone()
    dist.reduce(t, 0, op=op)
    assert torch.equal(t, want if r == 0 else x), (t, want)
    t = x.clone()
    dist.all_reduce(t, op=op)
    assert torch.equal(t, want) and t.dtype == torch.float32, (t, want)


def test_direct_and_torch_apis_share_the_world(world):
    """The direct API with group=None and the default torch group are the same ranks."""
    r = dist.get_rank()
    t = torch.tensor([r], dtype=torch.int64)
    hpcddp.all_reduce(t, op=R.MAX)
    assert t.item() == dist.get_world_size() - 1
    pg = dist.group.WORLD
    t = torch.tensor([r], dtype=torch.int64)
    hpcddp.all_reduce(t, group=pg)  # an hpcddp torch group works as the direct API's group
    assert t.item() == sum(range(dist.get_world_size()))


def test_torch_2_13_names(world):
    """all_gather_single / reduce_scatter_single: torch 2.13's names for the _tensor forms."""
    n, r = dist.get_world_size(), dist.get_rank()
    for dt in (torch.float32, torch.bfloat16, torch.int64):
        for grp in (None, world.gloo):
            out = torch.zeros((n * 2, 3), dtype=dt)
            dist.all_gather_single(out, value(dt, r, SHAPE), group=grp)
            assert torch.equal(out, exp_all_gather_into_tensor(world, dt, None)[0])
            blocks = [value(dt, r * 10 + j, (BLOCK,)) for j in range(n)]
            out = torch.zeros(BLOCK, dtype=dt)
            dist.reduce_scatter_single(out, torch.cat(blocks), op=R.MAX, group=grp)
            assert torch.equal(out, exp_reduce_scatter(world, dt, "MAX")[0]), (dt, grp)


def test_coalesced(world):
    """The coalesced forms torch routes to a backend, against gloo."""
    n, r = dist.get_world_size(), dist.get_rank()
    results = {}
    for name, grp in (("hpcddp", None), ("gloo", world.gloo)):
        ts = [value(torch.float32, r, (3,)), value(torch.float32, r + 7, (2, 2))]
        with pytest.warns(FutureWarning):
            dist.all_reduce_coalesced(ts, group=grp)
        with dist._coalescing_manager(group=grp):
            a = [value(torch.float64, r + k, (4,)) for k in range(3)]
            for t in a:
                dist.all_reduce(t, op=R.MAX, group=grp)
        ag = [torch.zeros(n * 2, dtype=torch.float32) for _ in range(2)]
        with dist._coalescing_manager(group=grp):
            for k, o in enumerate(ag):
                dist.all_gather_into_tensor(o, value(torch.float32, r * 3 + k, (2,)), group=grp)
        rs = [torch.zeros(2, dtype=torch.float32) for _ in range(2)]
        with dist._coalescing_manager(group=grp):
            for k, o in enumerate(rs):
                dist.reduce_scatter_tensor(o, value(torch.float32, r * 3 + k, (2 * n,)), group=grp)
        # all_gather_coalesced (deprecated in torch, still routed to the backend)
        agc = [[torch.zeros(2), torch.zeros(1, 3)] for _ in range(n)]
        dist.all_gather_coalesced(agc, [value(torch.float32, r, (2,)),
                                        value(torch.float32, r + 50, (1, 3))], group=grp)
        # _broadcast_coalesced: DDP's parameter and buffer broadcast
        bc = [value(torch.float64, r, (3,)), value(torch.float64, r + 9, (2, 2))]
        dist._broadcast_coalesced(grp if grp is not None else dist.group.WORLD, bc, 1 << 20,
                                  n - 1)
        results[name] = ts + a + ag + rs + [t for lst in agc for t in lst] + bc
    want = [reduce_ref("SUM", [value(torch.float32, q, (3,)) for q in range(n)], torch.float32),
            reduce_ref("SUM", [value(torch.float32, q + 7, (2, 2)) for q in range(n)],
                       torch.float32)]
    want += [reduce_ref("MAX", [value(torch.float64, q + k, (4,)) for q in range(n)],
                        torch.float64) for k in range(3)]
    want += [torch.cat([value(torch.float32, q * 3 + k, (2,)) for q in range(n)])
             for k in range(2)]
    want += [reduce_ref("SUM", [value(torch.float32, q * 3 + k, (2 * n,))[2 * r:2 * r + 2]
                                for q in range(n)], torch.float32) for k in range(2)]
    want += [t for q in range(n) for t in (value(torch.float32, q, (2,)),
                                          value(torch.float32, q + 50, (1, 3)))]
    want += [value(torch.float64, n - 1, (3,)), value(torch.float64, n - 1 + 9, (2, 2))]
    for name, got in results.items():
        assert len(got) == len(want), name
        for k, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{name} output {k}: {a} != {b}"
