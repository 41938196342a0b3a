"""The async engine (hpcddp.collectives.engine), forced on: every async_op=True collective runs
on its group's communication thread, in issue order.

The suites of test_async.py (the Work API of every op, blocking and async mixed across ranks,
many outstanding ops) and test_ddp.py (DDP parity in float64 against one process, Join, comm
hooks) run again here through the engine, plus what only the engine promises: an async call
returns while a peer has not called yet and completes by itself (no call into hpcddp), a
blocking call issued behind queued ones waits its turn, and a large call's cross-rank
agreement, left to the engine, still names the culprit.
"""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path)
from test_async import *  # noqa: F401,F403  (their tests, run here with the engine on)
from test_ddp import *  # noqa: F401,F403
from hpcddp import settings
from hpcddp.collectives import engine
from hpcddp.comm import startup as _rt
from hpcddp.diagnostics.mismatch import AGREE_BYTES, CollectiveMismatchError

MPI_ENV = {"HPCDDP_ASYNC_ENGINE": "force"}
MPI_TIMEOUT = 300
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def world():
    return M.init_world()


def test_engine_is_on(world):
    assert engine.on(), engine.state()
    assert engine.state().startswith("on (HPCDDP_ASYNC_ENGINE=force")


@pytest.mark.parametrize("numel", [256, AGREE_BYTES // 4 * 2], ids=["1KiB", "16MiB"])
def test_async_returns_while_a_peer_sleeps(world, numel):
    """The last rank calls 1.5 s late; the others' async all_reduce returns at once, is not
    complete, and completes with the exact sum once the late rank comes. 16 MiB is above the
    size whose call every rank agrees on first: that agreement runs on the engine too."""
    n, r = dist.get_world_size(), dist.get_rank()
    late = n - 1
    dist.barrier()
    if r == late:
        time.sleep(1.5)
    t = torch.full((numel,), float(r + 1))
    t0 = time.perf_counter()
    w = dist.all_reduce(t, async_op=True)
    returned = time.perf_counter() - t0
    if r != late:
        assert returned < 0.5, f"all_reduce(async_op=True) took {returned:.3f} s to return"
        assert not w.is_completed()
    w.wait()
    assert w.is_completed() and w.exception() is None
    assert torch.equal(t, torch.full((numel,), float(n * (n + 1) // 2)))


def test_progress_without_calls_into_hpcddp(world):
    """The op completes while the caller only computes: its future is done without a wait."""
    n = dist.get_world_size()
    t = torch.ones(1 << 18)
    fut = dist.all_reduce(t, async_op=True).get_future()
    deadline = time.monotonic() + 60
    a = torch.randn(64, 64)
    while not fut.done():
        assert time.monotonic() < deadline, "the engine never completed the op"
        torch.mm(a, a)
    assert torch.equal(fut.value()[0], torch.full((1 << 18,), float(n)))


def test_blocking_call_waits_behind_queued_ones(world):
    """Async calls, then blocking ones of every kind of path, in one order on every rank but
    async on some ranks and blocking on others: each result exact, none overtaken."""
    n, r = dist.get_world_size(), dist.get_rank()
    ts = [torch.full((1000 * (k + 1),), float(r + k)) for k in range(12)]
    works = []
    for k, t in enumerate(ts):
        a = (r + k) % 3 != 0
        w = dist.all_reduce(t, async_op=a)
        if k % 4 == 3:
            b = torch.full((50,), float(r))
            dist.broadcast(b, k % n)          # blocking, behind whatever is queued
            assert torch.equal(b, torch.full((50,), float(k % n)))
            out = [torch.zeros(3) for _ in range(n)]
            dist.all_gather(out, torch.full((3,), float(r)))
            assert [int(o[0]) for o in out] == list(range(n))
        works.append(w)
    dist.barrier()
    for w in works:
        if w is not None:
            w.wait()
    for k, t in enumerate(ts):
        assert torch.equal(t, torch.full_like(t, float(sum(q + k for q in range(n))))), k


def test_large_mismatch_in_flight_names_the_culprit(world):
    """Behind a queued async op, rank 1 passes another element count to a large async
    all_reduce: the agreement (run on the engine) refuses it on every rank, naming rank 1 (at 2
    ranks, one against one, it names no culprit), and the group stays usable."""
    n, r = dist.get_world_size(), dist.get_rank()
    first = torch.ones(1 << 16)
    w1 = dist.all_reduce(first, async_op=True)
    count = AGREE_BYTES // 4 + (1024 if r == 1 else 0)
    w2 = dist.all_reduce(torch.ones(count), async_op=True)
    w1.wait()
    assert torch.equal(first, torch.full((1 << 16,), float(n)))
    named = "culprit: rank 1" if n > 2 else "rank 1 .*No majority"   # 2 ranks: 1 against 1
    with pytest.raises(CollectiveMismatchError, match=named):
        w2.wait()
    t = torch.ones(8)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((8,), float(n)))


def test_a_refused_premul_sum_in_flight_leaves_the_tensor_as_passed(world, monkeypatch):
    """The engine scales an async PREMUL_SUM all_reduce's tensor in place before its path
    runs; rank 1 passes SUM instead, the arena's agreement (2 MiB, below the size take agrees
    on first) refuses the call on the engine's thread: every rank's Work raises and every
    rank's tensor is as it passed it, not multiplied by the factor."""
    monkeypatch.setattr(settings, "_current", settings.get().replace(shm_allreduce="force"))
    monkeypatch.delitem(_rt.world()._attached, "shm", raising=False)   # a fresh arena
    n, r = dist.get_world_size(), dist.get_rank()
    op = dist.ReduceOp.SUM if r == 1 else dist._make_nccl_premul_sum(3.0)
    t = torch.full(((2 << 20) // 4,), float(r + 1))
    before = t.clone()
    w = dist.all_reduce(t, op=op, async_op=True)
    with pytest.raises(CollectiveMismatchError, match="PREMUL_SUM"):
        w.wait()
    assert torch.equal(t, before), "a refused PREMUL_SUM left the tensor scaled"
    t = torch.ones(8)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((8,), float(n)))


def test_threads_on_different_groups_in_either_order(world):
    """Two threads of the script run collectives on two groups (a checkpoint thread beside the
    training loop), in the opposite order on every other rank: each group's lane keeps its own
    order, so neither waits for the other (one queue for all groups deadlocked here)."""
    import threading
    n, r = dist.get_world_size(), dist.get_rank()
    everyone = list(range(n))
    groups = [dist.new_group(everyone), dist.new_group(everyone)]
    results, errors = {}, []
    go = [threading.Event(), threading.Event()]

    def work(i):
        try:
            go[i].wait(30)
            t = torch.full((64,), float(r + 1 + 10 * i))
            for _ in range(20):
                dist.all_reduce(t, group=groups[i], async_op=True).wait()
                dist.all_reduce(t, group=groups[i])        # blocking, behind it in the lane
                t.div_(n * n)
            results[i] = t
        except BaseException as exc:   # noqa: BLE001  (reported below)
            errors.append(exc)
            go[1 - i].set()
    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    first = r % 2                          # rank 0 starts group 0's thread first, rank 1 group 1's
    go[first].set()
    time.sleep(0.05)
    go[1 - first].set()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "the two groups' threads deadlocked"
    assert not errors, errors
    for i in (0, 1):
        # after the first round every rank holds sum/n; each later round keeps it
        expect = sum(q + 1 + 10 * i for q in range(n)) / n
        assert torch.allclose(results[i], torch.full((64,), expect)), (i, results[i][:4])
