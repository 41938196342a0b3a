"""async_op=True: Work.wait(), is_completed(), get_future() (its value is the op's output
tensor list, as with gloo), exception(); many outstanding ops; overlap with computation and
with other ops; both HPCDDP_FUTURE modes (wait, thread).
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import hpcddp
import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)
from hpcddp.collectives import work as W

MPI_TIMEOUT = 240
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def world():
    return M.init_world()


def _ops(n, r, dt=torch.float32):
    """(name, start(group, async_op=True) -> (work, outputs), expected outputs) for every
    collective."""
    v = M.value

    def all_reduce(grp, a=True):
        t = v(dt, r, (5,))
        return dist.all_reduce(t, group=grp, async_op=a), [t]

    def broadcast(grp, a=True):
        t = v(dt, r, (5,))
        return dist.broadcast(t, n - 1, group=grp, async_op=a), [t]

    def reduce(grp, a=True):
        t = v(dt, r, (5,))
        return dist.reduce(t, 0, group=grp, async_op=a), [t]

    def all_gather(grp, a=True):
        out = [torch.zeros(5, dtype=dt) for _ in range(n)]
        return dist.all_gather(out, v(dt, r, (5,)), group=grp, async_op=a), out

    def all_gather_into_tensor(grp, a=True):
        out = torch.zeros(5 * n, dtype=dt)
        return dist.all_gather_into_tensor(out, v(dt, r, (5,)), group=grp, async_op=a), [out]

    def gather(grp, a=True):
        out = [torch.zeros(5, dtype=dt) for _ in range(n)] if r == 0 else None
        return dist.gather(v(dt, r, (5,)), out, 0, group=grp, async_op=a), out or []

    def scatter(grp, a=True):
        ins = [v(dt, 100 + j, (5,)) for j in range(n)] if r == 0 else None
        out = torch.zeros(5, dtype=dt)
        return dist.scatter(out, ins, 0, group=grp, async_op=a), [out]

    def reduce_scatter(grp, a=True):
        out = torch.zeros(3, dtype=dt)
        ins = [v(dt, r * 10 + j, (3,)) for j in range(n)]
        return dist.reduce_scatter(out, ins, group=grp, async_op=a), [out]

    def reduce_scatter_tensor(grp, a=True):
        out = torch.zeros(3, dtype=dt)
        ins = torch.cat([v(dt, r * 10 + j, (3,)) for j in range(n)])
        return dist.reduce_scatter_tensor(out, ins, group=grp, async_op=a), [out]

    def all_to_all_single(grp, a=True):
        out = torch.zeros(2 * n, dtype=dt)
        return dist.all_to_all_single(out, v(dt, r, (2 * n,)), group=grp, async_op=a), [out]

    def all_to_all(grp, a=True):
        out = [torch.zeros(2, dtype=dt) for _ in range(n)]
        ins = [v(dt, r * 10 + j, (2,)) for j in range(n)]
        return dist.all_to_all(out, ins, group=grp, async_op=a), out

    g = M.Grp("world", list(range(n)))
    total = [M.reduce_ref("SUM", [v(dt, q, (5,)) for q in range(n)], dt)]
    expect = {
        "all_reduce": total,
        "broadcast": [v(dt, n - 1, (5,))],
        "reduce": total if r == 0 else [v(dt, r, (5,))],
        "all_gather": [v(dt, q, (5,)) for q in range(n)],
        "all_gather_into_tensor": [torch.cat([v(dt, q, (5,)) for q in range(n)])],
        "gather": [v(dt, q, (5,)) for q in range(n)] if r == 0 else [],
        "scatter": [v(dt, 100 + r, (5,))],
        "reduce_scatter": M.exp_reduce_scatter(g, dt, "SUM"),
        "reduce_scatter_tensor": M.exp_reduce_scatter(g, dt, "SUM"),
        "all_to_all_single": [torch.cat([v(dt, q, (2 * n,))[2 * r:2 * r + 2] for q in range(n)])],
        "all_to_all": [v(dt, q * 10 + r, (2,)) for q in range(n)],
    }
    fns = [all_reduce, broadcast, reduce, all_gather, all_gather_into_tensor, gather, scatter,
           reduce_scatter, reduce_scatter_tensor, all_to_all_single, all_to_all]
    return [(f.__name__, f, expect[f.__name__]) for f in fns]


def _check(outs, want, what):
    assert len(outs) == len(want), what
    for a, b in zip(outs, want):
        assert torch.equal(a, b), f"{what}: {a} != {b}"


def test_work_api_every_op(world):
    n, r = dist.get_world_size(), dist.get_rank()
    for name, start, want in _ops(n, r):
        # wait()
        work, outs = start(None)
        assert isinstance(work, dist.Work), name
        assert work.wait() is True, name
        assert work.is_completed() and work.is_success() and work.exception() is None, name
        _check(outs, want, f"{name} after wait")
        # get_future(): the value is the output tensor list (the same tensors)
        work, outs = start(None)
        value = work.get_future().wait()
        assert isinstance(value, list), name
        if name not in ("reduce", "gather") or r == 0:  # off the root: unspecified
            _check(value, want, f"{name} future value")
        assert work.is_completed(), name
        _check(outs, want, f"{name} after future")
        # is_completed() makes progress on its own: poll, never wait
        work, outs = start(None)
        deadline = time.monotonic() + 60
        while not work.is_completed():
            assert time.monotonic() < deadline, f"{name}: is_completed() never became True"
        _check(outs, want, f"{name} after polling")


def test_blocking_and_async_mix_across_ranks(world):
    """One collective, a plain call on some ranks and async_op=True on others: torch code does
    this (Join), MPI never matches a blocking collective with a non-blocking one, so hpcddp
    must issue the same kind of MPI call for both."""
    n, r = dist.get_world_size(), dist.get_rank()
    for flip in (0, 1):
        for name, start, want in _ops(n, r):
            a = (r + flip) % 2 == 0
            work, outs = start(None, a)
            if a:
                work.wait()
            else:
                assert work is None, name
            _check(outs, want, f"{name} async_op={a}")
        for a in ((r + flip) % 2 == 0, (r + flip) % 2 == 1):
            w = hpcddp.barrier(async_op=a)
            if w is not None:
                w.wait()
            t = torch.tensor([float(r)])
            w = hpcddp.all_reduce(t, op=dist.ReduceOp.MAX, async_op=a)
            if w is not None:
                w.wait()
            assert t.item() == n - 1
        # the same tensor again and again (all_reduce's cached plan), mixed across ranks
        t = torch.ones(3)
        for k in range(4):
            for api in (dist, hpcddp):
                w = api.all_reduce(t, async_op=(r + k + flip) % 2 == 0)
                if w is not None:
                    w.wait()
        assert t.eq(n ** 8).all(), t


def test_blocking_torch_calls_make_no_work(world, monkeypatch):
    """torch passes async_op in the options: a plain ``dist.<op>(...)`` completes in the
    backend and hands torch no Work to wait on (a Work and its wait() cost 4-5 us a call:
    docs/benchmarks.md). async_op=True still gets a Work per op."""
    n, r = dist.get_world_size(), dist.get_rank()
    made = []
    init = W.Work.__init__

    def counting(self, *a, **kw):
        made.append(type(self).__name__)
        init(self, *a, **kw)
    monkeypatch.setattr(W.Work, "__init__", counting)
    for name, start, want in _ops(n, r):
        made.clear()
        work, outs = start(None, False)
        assert work is None and made == [], f"{name}: a blocking call made {made}"
        _check(outs, want, f"{name} blocking")
        work, outs = start(None, True)
        assert made, f"{name}: async_op=True returned no hpcddp Work"
        work.wait()
        _check(outs, want, f"{name} async")
    made.clear()
    dist.barrier()
    assert made == [], f"barrier: a blocking call made {made}"


def test_future_values_like_gloo(world):
    """Where gloo's future has a value, ours has the same tensors (all_gather_into_tensor: gloo
    gives the blocks, hpcddp and NCCL the output tensor; gloo's reduce_scatter Works have no
    future at all)."""
    n, r = dist.get_world_size(), dist.get_rank()
    for name, start, want in _ops(n, r):
        if name in ("all_gather_into_tensor", "reduce"):
            continue
        ours = start(None)[0].get_future().wait()
        work = start(world.gloo)[0]
        try:
            theirs = work.get_future().wait()
        except RuntimeError as exc:  # gloo's reduce_scatter: "Work::getFuture not implemented"
            assert "not implemented" in str(exc), (name, exc)
            work.wait()
            continue
        _check(ours, theirs, f"{name}: hpcddp vs gloo future value")


def test_direct_api_async(world):
    n, r = dist.get_world_size(), dist.get_rank()
    t = M.value(torch.bfloat16, r, (7,))
    w = hpcddp.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True)
    assert isinstance(w, hpcddp.Work)
    fut = w.get_future()
    assert fut.wait()[0] is t
    want = M.reduce_ref("AVG", [M.value(torch.bfloat16, q, (7,)) for q in range(n)], torch.bfloat16)
    assert torch.allclose(t.float(), want.float(), rtol=8e-3, atol=8e-3)
    w = hpcddp.barrier(async_op=True)
    assert w.wait() and w.result() == []


@pytest.mark.parametrize("opname", ["AVG", "PREMUL_SUM"])
def test_async_scaled_reductions_finish_when_waited(world, opname):
    """take() scales around every path: a PREMUL_SUM's inputs before (on copies where the input
    is not the result: the caller's stay as they were), an AVG's result when the Work completes
    (chained onto the path's own finishing step). Every reduction, left in flight while the
    other ranks' inputs change nothing, against numpy."""
    n, r = dist.get_world_size(), dist.get_rank()
    op = M.make_op(opname)
    k = 6
    ins = [M.value(torch.float64, q, (n * k,)) for q in range(n)]
    inp = ins[r].clone()
    out = torch.full((k,), -1.0, dtype=torch.float64)
    w = dist.reduce_scatter_tensor(out, inp, op=op, async_op=True)
    w.wait()
    want = M.reduce_ref(opname, ins, torch.float64)
    assert torch.allclose(out, want[r * k:(r + 1) * k]), (out, want)
    assert torch.equal(inp, ins[r]), "reduce_scatter_tensor changed its input"
    blocks = [b.clone() for b in inp.chunk(n)]
    out2 = torch.full((k,), -1.0, dtype=torch.float64)
    dist.reduce_scatter(out2, blocks, op=op, async_op=True).wait()
    assert torch.allclose(out2, want[r * k:(r + 1) * k]), (out2, want)
    assert torch.equal(torch.cat(blocks), ins[r]), "reduce_scatter changed its input list"
    t = ins[r].clone()
    dist.reduce(t, 0, op=op, async_op=True).wait()
    if r == 0:
        assert torch.allclose(t, want), (t, want)
    else:
        assert torch.equal(t, ins[r]), "reduce changed a non-root's tensor"
    t = ins[r].clone()
    dist.all_reduce(t, op=op, async_op=True).wait()
    assert torch.allclose(t, want), (t, want)


def test_many_outstanding(world):
    """200 outstanding ops of mixed kinds, waited in reverse order."""
    n, r = dist.get_world_size(), dist.get_rank()
    works = []
    for k in range(200):
        kind = k % 4
        if kind == 0:
            t = torch.full((16,), float(r + k))
            works.append((dist.all_reduce(t, async_op=True), t,
                          torch.full((16,), float(sum(q + k for q in range(n))))))
        elif kind == 1:
            t = torch.full((8,), float(r * 1000 + k))
            works.append((dist.broadcast(t, k % n, async_op=True), t,
                          torch.full((8,), float((k % n) * 1000 + k))))
        elif kind == 2:
            t = torch.full((4,), r + k, dtype=torch.int64)
            works.append((hpcddp.all_reduce(t, op=dist.ReduceOp.MAX, async_op=True), t,
                          torch.full((4,), n - 1 + k, dtype=torch.int64)))
        else:
            out = torch.zeros(n, dtype=torch.float64)
            works.append((dist.all_gather_into_tensor(out, torch.tensor([r * 2.0 + k],
                                                                         dtype=torch.float64),
                                                      async_op=True), out,
                          torch.tensor([q * 2.0 + k for q in range(n)], dtype=torch.float64)))
    for k, (w, got, want) in reversed(list(enumerate(works))):
        w.wait()
        assert torch.equal(got, want), f"op {k}: {got} != {want}"


def test_many_outstanding_p2p(world):
    """100 isend/irecv pairs around a ring, all outstanding at once."""
    n, r = dist.get_world_size(), dist.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    recvs = [torch.zeros(3) for _ in range(100)]
    rw = [dist.irecv(t, prv, tag=k) for k, t in enumerate(recvs)]
    sends = [torch.full((3,), float(r * 100 + k)) for k in range(100)]
    sw = [dist.isend(t, nxt, tag=k) for k, t in enumerate(sends)]
    for w in sw + rw:
        w.wait()
    for k, t in enumerate(recvs):
        assert t.eq(prv * 100 + k).all(), (k, t)


def test_overlap_compute_and_other_groups(world):
    """An op in flight while the caller computes and runs other ops (another group, gloo):
    the result is right and nothing waits on anything else."""
    n, r = dist.get_world_size(), dist.get_rank()
    big = torch.full((1 << 20,), float(r + 1))
    w = dist.all_reduce(big, async_op=True)
    a = torch.randn(128, 128)
    for _ in range(5):
        a = torch.tanh(a @ a.T / 128)  # compute while the reduction is in flight
    small = torch.tensor([float(r)])
    hpcddp.all_reduce(small, op=dist.ReduceOp.MAX)  # another op on the same world
    g = torch.tensor([float(r)])
    dist.all_reduce(g, group=world.gloo)
    w.wait()
    assert big.eq(n * (n + 1) / 2).all()
    assert small.item() == n - 1 and g.item() == n * (n - 1) / 2


def test_future_then_chain(world):
    """The comm-hook pattern: get_future().then(...)."""
    n, r = dist.get_world_size(), dist.get_rank()
    t = torch.full((4,), float(r))
    fut = dist.all_reduce(t, async_op=True).get_future()
    chained = fut.then(lambda f: f.value()[0] / n)
    assert torch.allclose(chained.wait(), torch.full((4,), (n - 1) / 2))


def test_thread_future_mode(world, monkeypatch):
    """HPCDDP_FUTURE=thread: get_future() on a pending op returns at once; one progress thread
    completes it."""
    monkeypatch.setattr(W, "_FUTURE_MODE", "thread")
    n, r = dist.get_world_size(), dist.get_rank()
    futs = []
    ts = []
    for k in range(20):
        t = torch.full((1000,), float(r + k))
        futs.append(dist.all_reduce(t, async_op=True).get_future())
        ts.append(t)
    for k, (f, t) in enumerate(zip(futs, ts)):
        assert f.wait()[0] is t
        assert t.eq(sum(q + k for q in range(n))).all()


def test_exception_reported():
    """A failing finishing step: exception() returns it, wait() and the future raise it."""
    def boom():
        raise RuntimeError("finishing step failed")
    w = W.Work([], [torch.zeros(1)], boom)
    with pytest.raises(RuntimeError, match="finishing step failed"):
        w.wait()
    assert isinstance(w.exception(), RuntimeError)
    assert w.is_completed() and not w.is_success()
    w2 = W.Work([], [torch.zeros(1)], boom)
    fut = w2.get_future()
    with pytest.raises(RuntimeError, match="finishing step failed"):
        fut.wait()


def test_failed_future_is_failed_for_cpp_readers_too():
    """torch's Future.set_exception keeps the exception as the future's value for Python only:
    C++ readers (DDP's reducer, a Work made from the future) took it for a result and crashed
    (elastic mode's lost rank in a bucket all-reduce on the async engine). hpcddp's futures of
    failed ops are failed in C++ too, as a C++ Work made from one says."""
    from torch._C._distributed_c10d import _create_work_from_future

    def cpp_view(fut):
        w = _create_work_from_future(fut)
        w.wait()
        return w.is_success(), str(w.exception() or "")
    ok, text = cpp_view(W.completed_future(None, RuntimeError("MPI_ERR_PROC_FAILED: a peer")))
    assert not ok and "MPI_ERR_PROC_FAILED" in text
    source, fut = W.pending_future()
    W.settle(source, None, RuntimeError("MPI_ERR_REVOKED"))
    ok, text = cpp_view(fut)
    assert not ok and "MPI_ERR_REVOKED" in text
    with pytest.raises(RuntimeError, match="MPI_ERR_REVOKED"):
        fut.wait()
    source, fut = W.pending_future()
    W.settle(source, [torch.ones(2)], None)
    assert cpp_view(fut) == (True, "") and torch.equal(fut.wait()[0], torch.ones(2))
    # a plain set_exception future, for contrast: C++ sees a success
    plain = torch.futures.Future()
    plain.set_exception(RuntimeError("invisible"))
    assert cpp_view(plain)[0] is True


def test_async_rooted_ops_keep_the_buffers_they_send(world):
    """An async scatter from a list the caller drops at once (torch hands in its own list),
    and an async gather whose only reference to the sent tensor is the call's, still move the
    right bytes: the Work keeps what its messages read (1 MiB blocks: freed memory is
    unmapped, so a send from it would crash or carry garbage)."""
    import gc
    n, r, k = dist.get_world_size(), dist.get_rank(), 1 << 18
    out = torch.empty(k)
    blocks = [torch.full((k,), float(j + 1)) for j in range(n)] if r == 0 else None
    w = dist.scatter(out, blocks, 0, async_op=True)
    del blocks
    gc.collect()
    scratch = [torch.full((k,), -1.0) for _ in range(n)]   # may reuse the freed memory
    w.wait()
    assert torch.equal(out, torch.full((k,), float(r + 1)))
    got = [torch.empty(k) for _ in range(n)] if r == 0 else None
    w = dist.gather(torch.full((k,), float(r + 7)), got, 0, async_op=True)
    gc.collect()
    scratch += [torch.full((k,), -1.0) for _ in range(n)]
    w.wait()
    if r == 0:
        assert all(torch.equal(t, torch.full((k,), float(j + 7))) for j, t in enumerate(got))
    del scratch
