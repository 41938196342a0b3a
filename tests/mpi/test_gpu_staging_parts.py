"""The staging path's parts, rank-locally: chunk schedule, pinned pool, host twins, the
pipeline's copy/wait order (with a copier that hands out fake events). No message is sent;
the file lives with the MPI tests because importing hpcddp.comm starts MPI.
"""
from __future__ import annotations

import threading

import pytest
import torch

from hpcddp import settings
from hpcddp.collectives.work import Work
from hpcddp.collectives._gpu_staging import (Copier, HostCopier, PinnedPool, Staged, Staging,
                                     chunk_schedule)

MPI_SIZES = (2,)


def test_chunk_schedule():
    assert chunk_schedule(0, 4, 64, 128) == []
    assert chunk_schedule(10, 4, 64, 128) == [(0, 10)]             # 40 bytes: below threshold
    assert chunk_schedule(31, 4, 64, 128) == [(0, 31)]             # 124 bytes
    assert chunk_schedule(32, 4, 64, 128) == [(0, 16), (16, 32)]   # 128 bytes: pipelined
    assert chunk_schedule(35, 4, 64, 128) == [(0, 16), (16, 32), (32, 35)]
    assert chunk_schedule(100, 4, 64, 0) == [(0, 100)]             # 0: pipelining off
    assert chunk_schedule(5, 16, 8, 16) == [(i, i + 1) for i in range(5)]  # at least 1 element
    sched = chunk_schedule(10**6 + 3, 2, 4 << 20, 8 << 20)
    assert sched == [(0, 10**6 + 3)]
    sched = chunk_schedule(5 * 2**20 + 7, 2, 4 << 20, 8 << 20)
    assert sched[0] == (0, 2 << 20) and sched[-1][1] == 5 * 2**20 + 7
    assert all(a[1] == b[0] for a, b in zip(sched, sched[1:]))


def test_settings_from_environment(monkeypatch):
    """HPCDDP_STAGING_CHUNK_BYTES and HPCDDP_STAGING_PIPELINE_BYTES, as the job's settings."""
    monkeypatch.setattr(settings, "_current", settings.read(
        {"HPCDDP_STAGING_CHUNK_BYTES": "1024", "HPCDDP_STAGING_PIPELINE_BYTES": "0"}))
    s = Staging(pool=PinnedPool(pin=False))
    assert (s.chunk_bytes, s.pipeline_bytes) == (1024, 0)
    with pytest.raises(ValueError, match="HPCDDP_STAGING_CHUNK_BYTES='4MiB': expected a whole "
                                         "number of bytes"):
        settings.read({"HPCDDP_STAGING_CHUNK_BYTES": "4MiB"})
    with pytest.raises(ValueError, match="depth must be >= 2"):
        Staging(pool=PinnedPool(pin=False), chunk_bytes=1, pipeline_bytes=1, depth=1)


class FakeEvent:
    def __init__(self, name):
        self.name, self.synced = name, 0

    def synchronize(self):
        self.synced += 1

    def __repr__(self):
        return self.name


def test_pool_reuses_blocks_and_waits_for_their_last_copy():
    pool = PinnedPool(pin=False)
    assert PinnedPool.block_size(1) == 1 << 16 and PinnedPool.block_size((1 << 16) + 1) == 1 << 17
    a = pool.acquire(1000)
    ev = FakeEvent("h2d")
    pool.release(a, ev)
    b = pool.acquire(5000)                  # same block size: the same block comes back ...
    assert b is a and ev.synced == 1        # ... after its host-to-device copy finished
    c = pool.acquire(1 << 20)               # a bigger one is new
    assert c is not a and pool.allocations == 2
    pool.release(b)
    pool.release(c)
    assert pool.cached_bytes() == (1 << 16) + (1 << 20)
    pool.clear()
    assert pool.cached_bytes() == 0


def test_pool_cap_drops_what_does_not_fit():
    pool = PinnedPool(pin=False, max_cached_bytes=1 << 17)
    a, b, c = pool.acquire(1), pool.acquire(1), pool.acquire(1)
    for x in (a, b, c):
        pool.release(x)
    assert pool.cached_bytes() == 1 << 17   # two 64 KiB blocks kept, the third dropped


def test_pool_from_many_threads():
    pool = PinnedPool(pin=False)
    seen, errors = [], []

    def worker():
        try:
            for _ in range(50):
                b = pool.acquire(3000)
                b.data[:8].fill_(threading.get_ident() % 251)
                assert int(b.data[0]) == threading.get_ident() % 251   # nobody else holds it
                seen.append(id(b))
                pool.release(b)
        except BaseException as exc:   # noqa: BLE001
            errors.append(exc)
    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and pool.allocations <= 4


@pytest.mark.parametrize("dtype", (torch.bool, torch.uint8, torch.float16, torch.bfloat16,
                                   torch.float32, torch.int64, torch.complex128))
def test_twins_are_aligned_views_of_one_block(dtype):
    pool = PinnedPool(pin=False)
    st = Staged(HostCopier(), pool)
    a = torch.ones(3, 5, dtype=dtype)
    b = torch.zeros(7, dtype=dtype)
    ha, none, hb, he = st.twins([(a, True, False), (None, True, True), (b, False, True),
                                 (torch.empty(0, dtype=dtype), True, True)])
    assert none is None
    assert ha.shape == a.shape and hb.shape == b.shape and he.numel() == 0
    assert ha.dtype == dtype and torch.equal(ha, a)
    base = st.buf.data.data_ptr()
    for h in (ha, hb):
        assert (h.data_ptr() - base) % 256 == 0
    hb.fill_(1)
    st.copy_out()
    assert torch.equal(b, torch.ones(7, dtype=dtype))          # WRITE copied back
    assert torch.equal(a, torch.ones(3, 5, dtype=dtype))
    assert st.buf is None and pool.cached_bytes() > 0          # the block went back


def test_abort_gives_the_block_back():
    pool = PinnedPool(pin=False)
    st = Staged(HostCopier(), pool)
    st.twins([(torch.ones(4), True, True)])
    st.abort()
    assert pool.cached_bytes() == 1 << 16 and st.buf is None


def test_complete_async_copies_back_in_the_work_finish():
    pool = PinnedPool(pin=False)
    st = Staged(HostCopier(), pool)
    out = torch.zeros(4)
    (h,) = st.twins([(out, False, True)])
    h.fill_(5)
    inner = []
    w = Work([], [h], finish=lambda: inner.append(1))
    assert st.complete(w, True, [out]) is w and torch.equal(out, torch.zeros(4))
    w.wait()
    assert inner == [1] and torch.equal(out, torch.full((4,), 5.0))
    assert w.result()[0] is out


class EventCopier(Copier):
    """Hands out named fake events and logs every call, to check the pipeline's ordering."""

    def __init__(self):
        self.log = []
        self.n = 0

    def begin(self, tensors):
        self.log.append(("begin",))

    def _ev(self, kind, host, dev):
        dev.copy_(host) if kind == "h2d" else host.copy_(dev)
        ev = FakeEvent(f"{kind}{self.n}")
        self.n += 1
        self.log.append((kind, ev.name))
        return ev

    def d2h(self, host, dev):
        return self._ev("d2h", host, dev)

    def h2d(self, dev, host):
        return self._ev("h2d", host, dev)

    def wait(self, event):
        self.log.append(("wait", repr(event)))

    def end(self, event):
        self.log.append(("end", repr(event)))


def test_pipeline_waits_before_reusing_a_slot():
    cp = EventCopier()
    pool = PinnedPool(pin=False)
    st = Staging(pool=pool, copier=lambda t: cp, chunk_bytes=16, pipeline_bytes=16, depth=2)
    t = torch.arange(16, dtype=torch.float32)            # 4 chunks of 4, 2 slots
    calls = []
    st.pipeline(t, lambda h: (calls.append(h.tolist()), h.add_(100)), read=True, write=True)
    assert torch.equal(t, torch.arange(16, dtype=torch.float32) + 100)
    assert calls == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    log = cp.log
    assert log[0] == ("begin",) and log[-1][0] == "end"
    names = [e[1] for e in log if e[0] in ("d2h", "h2d")]
    assert names == ["d2h0", "d2h1", "h2d2", "d2h3", "h2d4", "d2h5", "h2d6", "h2d7"]
    # the copy-in of chunk 2 (slot 0) waits for the copy-back of chunk 0 (h2d2) first,
    # and MPI on chunk i waits for chunk i's copy-in
    assert log.index(("wait", "h2d2")) < log.index(("d2h", "d2h3"))
    assert log.index(("wait", "d2h0")) < log.index(("h2d", "h2d2"))
    assert log[-1] == ("end", "h2d7")
    # the block goes back with the last copy-back as its event
    assert pool.cached_bytes() == 1 << 16


def test_pipeline_write_only_waits_before_mpi_overwrites_a_slot():
    """A receiver (broadcast non-root) copies nothing in, but MPI must not write a slot whose
    previous chunk is still being copied back."""
    cp = EventCopier()
    st = Staging(pool=PinnedPool(pin=False), copier=lambda t: cp, chunk_bytes=16,
                 pipeline_bytes=16, depth=2)
    t = torch.zeros(12)
    k = iter(range(3))
    st.pipeline(t, lambda h: h.fill_(next(k) + 1), read=False, write=True)
    assert t.tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 4
    assert [e[0] for e in cp.log if e[0] in ("d2h", "h2d")] == ["h2d"] * 3
    assert ("wait", "h2d0") in cp.log                   # before chunk 2 reused slot 0


def test_pipeline_of_an_empty_tensor_still_calls_mpi():
    st = Staging(pool=PinnedPool(pin=False), chunk_bytes=16, pipeline_bytes=16)
    calls = []
    st.pipeline(torch.empty(0), lambda h: calls.append(h.numel()), read=True, write=True)
    assert calls == [0]
