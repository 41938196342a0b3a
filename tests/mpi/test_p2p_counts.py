"""A receive whose message is not the tensor's size is an error naming recv/irecv, the sender,
the tag and both sizes (hpcddp.collectives.work.check_count; _fastpath.c for planned ones):
shorter and longer messages, recv and irecv().wait(), from one rank and from any, through the
direct API and torch.distributed; the first call (full path) and repeats (the C plan hit), and
the Python path (no C module: as with HPCDDP_FASTPATH=0). After each error the same tensors
carry a correct exchange, so the ranks keep communicating; correct receives still work.

Messages that are too long stay under Open MPI's eager limit: above it, Open MPI 5 writes the
whole message past the receiving tensor before it reports MPI_ERR_TRUNCATE (docs/collectives.md,
"send and recv"), which no check after the receive can undo.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

import hpcddp
import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)
from hpcddp.collectives import _large, _plans, p2p

MPI_TIMEOUT = 240
REPEATS = 3              # the first call plans; the next ones run from the plan (C hit)
SHORTER, LONGER = (12, 16), (20, 16)    # (elements sent, elements the receiver expects)


@pytest.fixture(scope="module")
def world():
    return M.init_world()


@pytest.fixture(params=["C", "python"])
def path(request, monkeypatch):
    """The C hit where the module is built, or the Python path (phit off, nothing planned)."""
    if request.param == "C" and _plans._c is None:
        pytest.skip(f"no C module here: {_plans.KIND}")     # the same on every rank
    if request.param == "python":
        monkeypatch.setattr(p2p, "phit", _plans._no_phit)
        monkeypatch.setattr(_plans, "_c", None)
    return request.param


def _pair():
    """(this rank's partner, whether it sends) in pairs 0-1, 2-3; None for a rank left over."""
    n, r = dist.get_world_size(), dist.get_rank()
    if r % 2 == 0:
        return (r + 1, True) if r + 1 < n else (None, False)
    return r - 1, False


def _send(api, t, dst, tag):
    (hpcddp.send if api == "direct" else dist.send)(t, dst, tag=tag)


def _recv(api, op, t, src, tag):
    """Receive into T as OP (recv or irecv + wait) through API; returns the sender's rank."""
    if api == "direct":
        if op == "recv":
            return hpcddp.recv(t, src, tag=tag)
        w = hpcddp.irecv(t, src, tag=tag)
        w.wait()
        return w.source_rank()
    if op == "recv":
        return dist.recv(t, src, tag=tag)
    w = dist.irecv(t, src, tag=tag)
    w.wait()
    return w._source_rank()


def _pattern(api, op, src, tag, sent, want, dtype="torch.float32"):
    # torch's dist.recv reaches the backend's recv, which starts an irecv and waits on it
    fn = op if api == "direct" else "i?recv"
    return re.compile(rf"^{fn}: message from rank {src} \(tag {tag}\) has {sent} elements of "
                      rf"{re.escape(dtype)}, expected {want} \(the tensor's numel\); the sender "
                      rf"sent a different size")


def _then_correct(api, op, t, peer, sends, tag):
    """A correct exchange on the same tensor after an error: the ranks still communicate."""
    if sends:
        _send(api, torch.arange(t.numel(), dtype=t.dtype) + 100, peer, tag)
    else:
        assert _recv(api, op, t, peer, tag) == peer
        assert torch.equal(t, torch.arange(t.numel(), dtype=t.dtype) + 100), t


@pytest.mark.parametrize("api", ["direct", "dist"])
@pytest.mark.parametrize("op", ["recv", "irecv"])
@pytest.mark.parametrize("sizes", [SHORTER, LONGER], ids=["shorter", "longer"])
def test_wrong_size_names_the_sizes(world, path, api, op, sizes):
    peer, sends = _pair()
    sent, want = sizes
    tag = 3
    t = torch.full((want,), -1.0)
    for i in range(REPEATS):
        if peer is not None and sends:
            _send(api, torch.arange(sent, dtype=torch.float32), peer, tag)
        elif peer is not None:
            t.fill_(-1.0)
            with pytest.raises(RuntimeError, match=_pattern(api, op, peer, tag, sent, want)) as e:
                _recv(api, op, t, peer, tag)
            if sent < want:          # the message's elements, then the tensor as it was
                assert torch.equal(t[:sent], torch.arange(sent, dtype=torch.float32)), t
                assert t[sent:].eq(-1).all(), t
                assert f"only the tensor's first {sent} elements were received" in str(e.value)
            else:                    # MPI keeps what fits
                assert torch.equal(t, torch.arange(want, dtype=torch.float32)), t
                assert "MPI_ERR_TRUNCATE" in str(e.value)
        if peer is not None:
            _then_correct(api, op, t, peer, sends, tag)
    if path == "C" and peer is not None and not sends:
        assert id(t) in _plans.pplans[1], "the repeats ran without a plan"
    dist.barrier()


@pytest.mark.parametrize("api", ["direct", "dist"])
def test_irecv_work_holds_the_error(world, path, api):
    """is_completed() completes it, exception() holds the error, wait() raises it (again),
    get_future() fails with it (for torch's C++ side too)."""
    peer, sends = _pair()
    tag = 5
    t = torch.zeros(8, dtype=torch.int64)
    for i in range(REPEATS):
        if peer is not None and sends:
            _send(api, torch.arange(5, dtype=torch.int64), peer, tag)
        elif peer is not None:
            w = (hpcddp.irecv(t, peer, tag=tag) if api == "direct"
                 else dist.irecv(t, peer, tag=tag))
            while not w.is_completed():
                pass
            pattern = _pattern(api, "irecv", peer, tag, 5, 8, "torch.int64")
            assert not w.is_success()
            assert isinstance(w.exception(), RuntimeError) and pattern.match(str(w.exception()))
            for _ in range(2):
                with pytest.raises(RuntimeError, match=pattern):
                    w.wait()
            # the future fails as torch's C++ side sees it (a raising callback: torch puts
            # "Got the following error when running the callback: RuntimeError: " first)
            with pytest.raises(RuntimeError, match=pattern.pattern.replace("^", ": ", 1)):
                w.get_future().wait()
        if peer is not None:
            _then_correct(api, "irecv", t, peer, sends, tag)
    dist.barrier()


@pytest.mark.parametrize("api", ["direct", "dist"])
@pytest.mark.parametrize("op", ["recv", "irecv"])
def test_any_source_names_the_sender(world, path, api, op):
    """Rank 0 receives from any rank into n + 1 elements; rank r sends r + 1 elements, the last
    rank n + 3 (a longer message)."""
    n, r = dist.get_world_size(), dist.get_rank()
    tag = 7
    want = n + 1
    sizes = {q: q + 1 for q in range(1, n - 1)} | {n - 1: n + 3}
    t = torch.zeros(want)
    for i in range(REPEATS):
        if r == 0:
            seen = set()
            for _ in range(n - 1):
                with pytest.raises(RuntimeError) as e:
                    _recv(api, op, t, None, tag)
                m = re.match(rf"^i?recv: message from rank (\d+) \(tag {tag}\) has (\d+) "
                             rf"elements of torch.float32, expected {want} ", str(e.value))
                assert m, e.value
                src, sent = int(m.group(1)), int(m.group(2))
                assert sent == sizes[src], e.value
                kept = min(sent, want)
                assert torch.equal(t[:kept], torch.full((kept,), float(src))), (src, t)
                seen.add(src)
            assert seen == set(range(1, n))
        else:
            _send(api, torch.full((sizes[r],), float(r)), 0, tag)
        dist.barrier()
    # then a correct receive from any source, into the same tensor
    if r == 0:
        got = {_recv(api, op, t, None, tag) for _ in range(n - 1)}
        assert got == set(range(1, n))
    else:
        _send(api, torch.zeros(want), 0, tag)
    dist.barrier()


def test_correct_receives_still_work(world, path):
    """Exact sizes, the same tensors again and again: every API and op, every dtype size."""
    peer, sends = _pair()
    tag = 9
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16, torch.bool,
                  torch.complex64, torch.uint8):
        t = torch.zeros(6, dtype=dtype)
        for i in range(REPEATS):
            for api in ("direct", "dist"):
                for op in ("recv", "irecv"):
                    want = (torch.arange(6) + i) % 2 == 0 if dtype == torch.bool \
                        else (torch.arange(6) + i).to(dtype)
                    if peer is not None and sends:
                        _send(api, want, peer, tag)
                    elif peer is not None:
                        assert _recv(api, op, t, peer, tag) == peer
                        assert torch.equal(t, want), (dtype, api, op, i, t)
        if path == "C" and peer is not None and not sends:
            assert id(t) in _plans.pplans[1], dtype
    dist.barrier()


def test_large_shorter_message(world, path):
    """A shorter message above every eager limit (rendezvous): the same error, and the
    tensor's tail untouched."""
    peer, sends = _pair()
    tag = 11
    want, sent = 1 << 18, 200_000          # 1 MiB of float32, and less
    t = torch.full((want,), -1.0)
    for i in range(2):
        if peer is not None and sends:
            _send("direct", torch.arange(sent, dtype=torch.float32), peer, tag)
        elif peer is not None:
            t.fill_(-1.0)
            with pytest.raises(RuntimeError, match=_pattern("direct", "recv", peer, tag, sent,
                                                            want)):
                hpcddp.recv(t, peer, tag=tag)
            assert torch.equal(t[:sent], torch.arange(sent, dtype=torch.float32))
            assert t[sent:].eq(-1).all()
    dist.barrier()


def test_longer_over_the_eager_limit(world, path):
    """A longer message of 16 KiB, over Open MPI's eager limits: the same error. The tensor is
    the head of a buffer as long as the message, because Open MPI 5 writes the whole message
    there (the error says memory after the tensor may be corrupt)."""
    peer, sends = _pair()
    tag = 12
    want, sent = 16, 4096
    buf = torch.zeros(sent)
    t = buf[:want]
    for i in range(REPEATS):
        if peer is not None and sends:
            _send("direct", torch.arange(sent, dtype=torch.float32), peer, tag)
        elif peer is not None:
            with pytest.raises(RuntimeError, match=rf"^recv: message from rank {peer} \(tag "
                               rf"{tag}\) has ({sent}|more than {want}) elements .*"
                               rf"MPI_ERR_TRUNCATE.* memory after this tensor may be corrupt$"):
                hpcddp.recv(t, peer, tag=tag)
            assert torch.equal(t, torch.arange(want, dtype=torch.float32))
        if peer is not None:
            _then_correct("direct", "recv", t, peer, sends, tag)
    dist.barrier()


def test_not_a_whole_number_of_elements(world, path):
    """3 float32 (12 bytes) into float64s: the size in bytes."""
    peer, sends = _pair()
    tag = 13
    t = torch.zeros(2, dtype=torch.float64)
    for i in range(REPEATS):
        if peer is not None and sends:
            hpcddp.send(torch.ones(3), peer, tag=tag)
        elif peer is not None:
            with pytest.raises(RuntimeError, match=rf"^recv: message from rank {peer} \(tag "
                               rf"{tag}\) has 12 bytes \(not a whole number of 8-byte "
                               rf"elements\) of torch.float64, expected 2 "):
                hpcddp.recv(t, peer, tag=tag)
    dist.barrier()


@pytest.mark.parametrize("op", ["recv", "irecv"])
def test_staged_device_receive(world, op, monkeypatch):
    """The GPU staging path receives into a host twin with recv/irecv, so it checks too (CPU
    tensors stand in for CUDA ones, as in test_gpu_staging.py). The CUDA-aware path, which
    hands MPI the device pointer, does not check (hpcddp/collectives/paths/device.py). What
    reaches the tensor differs: a blocking recv copies nothing back after the error, an irecv
    copies back the whole host twin."""
    from hpcddp.collectives.paths import device as D
    from hpcddp.comm.cuda import CudaAwareness
    from hpcddp.collectives._gpu_staging import HostCopier, PinnedPool, Staging

    class FakeCuda(torch.Tensor):       # host memory that says it is on cuda:0
        is_cpu = property(lambda self: False)
        device = property(lambda self: torch.device("cuda", 0))
    monkeypatch.setattr(D.DEVICE, "awareness", CudaAwareness(False, "test", "faked", "test"))
    monkeypatch.setattr(D.DEVICE, "staging", Staging(pool=PinnedPool(pin=False),
                                                     copier=lambda t: HostCopier()))
    comm = hpcddp.world()
    peer, sends = _pair()
    tag = 17
    t = torch.zeros(16)
    if peer is not None and sends:
        hpcddp.send(torch.arange(12, dtype=torch.float32), peer, tag=tag)
    elif peer is not None:
        with pytest.raises(RuntimeError, match=_pattern("direct", op, peer, tag, 12, 16)):
            if op == "recv":
                hpcddp.recv(t.as_subclass(FakeCuda), peer, comm, tag)
            else:
                hpcddp.irecv(t.as_subclass(FakeCuda), peer, comm, tag).wait()
    dist.barrier()


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(_large, "MAX_COUNT", 4)
    monkeypatch.setattr(_large, "PIECE_BYTES", 8)  # 2 float32 per piece


@pytest.mark.parametrize("op", ["recv", "irecv"])
@pytest.mark.parametrize("sizes", [(7, 8), (8, 7)], ids=["shorter", "longer"])
def test_pieced_receive(world, small_limit, op, sizes):
    """Counts over MPI's int travel in pieces (the limit lowered here): the pieces' counts
    add up to the message's. (Sizes with as many pieces on both sides: a sender with fewer
    pieces leaves a receiver waiting for the rest.)"""
    peer, sends = _pair()
    sent, want = sizes
    tag = 15
    t = torch.full((want,), -1.0)
    if peer is not None and sends:
        hpcddp.send(torch.arange(sent, dtype=torch.float32), peer, tag=tag)
    elif peer is not None:
        with pytest.raises(RuntimeError, match=_pattern("direct", op, peer, tag, sent, want)):
            _recv("direct", op, t, peer, tag)
        assert torch.equal(t[:min(sent, want)], torch.arange(min(sent, want), dtype=torch.float32))
    if peer is not None:
        _then_correct("direct", op, t, peer, sends, tag)
    dist.barrier()
