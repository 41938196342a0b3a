"""The ring over TCP links (hpcddp.comm.links, hpcddp.collectives._ring), inside one process:
N threads play N ranks joined by socket pairs, so the stream each way, the partial reads and
sends, the adds as chunks land and a neighbour that goes away are exercised without MPI
(tests/mpi/test_ring.py runs it between real ranks)."""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from hpcddp.collectives import _ring
from hpcddp.comm import links
from hpcddp.diagnostics import state


class _FakeComm:
    """What Links asks of its MPI communicator: rank, size, and the check for lost peers."""
    def __init__(self, rank, size):
        self.rank, self.size = rank, size

    def Get_rank(self):
        return self.rank

    def Get_size(self):
        return self.size

    def Iprobe(self, source, tag):
        return False


def _ring_of(n: int) -> list:
    pairs = [socket.socketpair() for _ in range(n)]      # pair i: rank i -> rank i+1
    made = []
    for r in range(n):
        out, into = pairs[r][0], pairs[(r - 1) % n][1]
        for s in (out, into):
            s.setblocking(False)
        made.append(links.Links(_FakeComm(r, n), [out], [into]))
    return made


def _run_ranks(n, body):
    errors, threads = [], []
    for r, link in enumerate(_ring_of(n)):
        def run(r=r, link=link):
            try:
                body(r, link)
            except BaseException as e:      # noqa: BLE001 - reported below
                errors.append((r, e))
        threads.append(threading.Thread(target=run))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a rank of the ring never finished"
    return errors


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("numel, dtype", [(1, np.float32), (4099, np.float64),
                                          ((1 << 20) + 7, np.float32), (300_001, np.int64)])
def test_every_rank_ends_with_the_sum_in_the_same_bits(n, numel, dtype):
    rng = np.random.default_rng(n)
    data = [(rng.standard_normal(numel) * 100).astype(dtype) for _ in range(n)]
    results = [d.copy() for d in data]
    errors = _run_ranks(n, lambda r, link: _ring.all_reduce(link, results[r]))
    assert not errors, errors
    want = np.sum(np.stack(data).astype(np.float64), axis=0)
    for got in results:
        assert np.array_equal(got, results[0])          # one set of bits everywhere
        assert np.allclose(got, want, rtol=1e-5, atol=1e-3)
    if dtype == np.int64:
        assert np.array_equal(results[0], np.sum(np.stack(data), axis=0))


def test_a_neighbour_gone_is_an_error_naming_it():
    """Rank 1 of 3 closes its links (its process ended): its neighbours raise LinkError
    naming it instead of waiting, and the ring refuses later calls."""
    rings = _ring_of(3)
    rings[1].close()
    got = {}

    def run(r):
        try:
            _ring.all_reduce(rings[r], np.ones(1000, np.float32))
        except links.LinkError as e:
            got[r] = str(e)
    threads = [threading.Thread(target=run, args=(r,)) for r in (0, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert set(got) == {0, 2}, got
    assert "rank 1" in got[0] and "rank 1" in got[2], got
    with pytest.raises(links.LinkError, match="broke in an earlier call"):
        _ring.all_reduce(rings[0], np.ones(1000, np.float32))


def test_a_rank_waiting_on_its_links_counts_as_blocked_for_the_watchdog():
    """The watchdog's stall check looks for threads waiting in hpcddp's code: a ring waiting
    in its links' poll is one (it was not: a lossy link stalled the job with no report)."""
    rings = _ring_of(2)
    t = threading.Thread(target=_ring.all_reduce, args=(rings[0], np.ones(1 << 16, np.float32)),
                         name="waits-on-links")
    t.start()
    try:
        deadline = time.monotonic() + 10
        while (t.ident, "waits-on-links") not in state.blocked_threads():
            assert time.monotonic() < deadline, "not seen as blocked"
            time.sleep(0.05)
    finally:
        _ring.all_reduce(rings[1], np.ones(1 << 16, np.float32))   # the peer comes: it ends
        t.join(timeout=30)
    assert not t.is_alive()


def test_addresses_follow_the_chosen_interface(monkeypatch):
    from hpcddp import settings
    monkeypatch.setattr(settings, "_current", settings.read({"HPCDDP_SOCKET_IFNAME": "lo"}))
    assert links.local_addresses() == ["127.0.0.1"]
    monkeypatch.setattr(settings, "_current", settings.read({}))
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "no-such-if0")
    assert links.local_addresses() == ["127.0.0.1"]      # none found: loopback only


def test_pipes_move_queued_transfers_in_order_without_blocking():
    """hpcddp stage's ring posts several chunks per stream ahead: each Pipe moves its queue
    head first, never a later transfer's bytes before an earlier one's, and a Test() that
    cannot move returns at once."""
    a = _ring_of(2)[0]
    out_sock, in_sock = socket.socketpair()
    for s in (out_sock, in_sock):
        s.setblocking(False)
    sends = links.Pipe(a, out_sock, True)
    recvs = links.Pipe(a, in_sock, False)
    rng = np.random.default_rng(3)
    data = [rng.integers(0, 255, n, dtype=np.uint8) for n in (3 << 20, 0, 12345, 1 << 20)]
    got = [np.zeros_like(d) for d in data]
    rx = [recvs.post(g) for g in got]
    assert not rx[0].Test()                  # nothing sent yet: returns at once
    tx = [sends.post(d) for d in data]
    deadline = time.monotonic() + 30
    while not all([t.Test() for t in tx + rx]):     # every transfer tested each time
        assert time.monotonic() < deadline
        links.wait_any([sends, recvs], 0.01)
    assert all(np.array_equal(g, d) for g, d in zip(got, data))


def test_a_subnet_chooses_the_interfaces_in_it(monkeypatch):
    """Open MPI's btl_tcp_if_include also takes subnets (10.1.0.0/16): the addresses in it."""
    from hpcddp import settings
    monkeypatch.setattr(settings, "_current", settings.read({}))
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "127.0.0.0/8")
    assert links.local_addresses() == ["127.0.0.1"]
    monkeypatch.setenv("OMPI_MCA_btl_tcp_if_include", "198.51.100.0/24")  # none here
    assert links.local_addresses() == ["127.0.0.1"]


def test_a_rank_killed_from_outside_ends_its_links_though_a_forked_child_lives():
    """A rank process holding links forks a child that outlives it (a DataLoader worker whose
    parent the OOM killer took): the neighbour sees the stream end when the rank is killed,
    not when the child exits, because a forked child closes its copies of the descriptors."""
    import os
    import signal
    out_sock, in_sock = socket.socketpair()
    ready_r, ready_w = os.pipe()
    rank = os.fork()
    if rank == 0:                                   # the rank process
        try:
            in_sock.close()
            made = links.Links(_FakeComm(0, 2), [out_sock], [out_sock])   # held to the end
            worker = os.fork()
            if worker == 0:                         # its worker: sleeps past the rank's end
                time.sleep(30)
                os._exit(0)
            os.write(ready_w, worker.to_bytes(4, "little"))
            time.sleep(30)
            made.close()
        finally:
            os._exit(1)
    out_sock.close()
    worker = int.from_bytes(os.read(ready_r, 4), "little")
    os.kill(rank, signal.SIGKILL)
    os.waitpid(rank, 0)
    in_sock.settimeout(5.0)
    try:
        start = time.monotonic()
        assert in_sock.recv(1) == b""               # the end, while the worker still sleeps
        assert time.monotonic() - start < 2.0
        os.kill(worker, 0)                          # (it does: raises if it is gone)
    finally:
        os.kill(worker, signal.SIGKILL)
    in_sock.close()
    os.close(ready_r)
    os.close(ready_w)


def test_accept_is_bounded_however_many_strays_come(monkeypatch):
    """Stray connections that connect and say nothing, one after another, cannot keep a rank
    in the links' set-up: the neighbour's connection (made before, in the backlog) is taken
    among them, and without it the wait ends after CONNECT_TIMEOUT_S in all, not per stray."""
    monkeypatch.setattr(links, "CONNECT_TIMEOUT_S", 0.6)
    monkeypatch.setattr(links, "HELLO_WAIT_S", 0.05)
    token = b"t" * 8
    for neighbour_comes in (True, False):
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        stop, strays = threading.Event(), []

        def stray_stream():
            while not stop.is_set():
                s = socket.socket()
                s.settimeout(0.2)                 # a full backlog: connect would wait
                try:
                    s.connect(("127.0.0.1", port))
                except OSError:
                    s.close()
                    continue
                strays.append(s)          # connected, silent
                time.sleep(0.05)
        t = threading.Thread(target=stray_stream)
        t.start()
        time.sleep(0.2)                   # strays first in the backlog
        if neighbour_comes:
            right = socket.create_connection(("127.0.0.1", port))
            right.sendall(links._hello(token, 3, 0))
        start = time.monotonic()
        try:
            if neighbour_comes:
                got = links._accept(listener, token, 3, 1)
                assert len(got) == 1
                got[0].close()
                right.close()
            else:
                with pytest.raises(TimeoutError, match="rank 3's connection did not come"):
                    links._accept(listener, token, 3, 1)
            assert time.monotonic() - start < 1.5
        finally:
            stop.set()
            t.join()
            listener.close()
            for s in strays:
                s.close()


def test_scratch_keeps_one_buffer_per_key_grown_to_the_largest_call():
    from hpcddp.collectives import _node
    s = _node.Scratch()
    a = s.get("x", 1000, np.float64)
    assert a.shape == (1000,) and a.dtype == np.float64
    b = s.get("x", 10, np.int32)                 # smaller, another dtype: the same memory
    assert b.dtype == np.int32 and np.shares_memory(a, b)
    c = s.get("x", 2000, np.float64)             # larger: grown
    assert c.size == 2000 and not np.shares_memory(a, c)
    assert not np.shares_memory(c, s.get("y", 10, np.float64))
    assert not np.shares_memory(_node.FRESH.get("x", 10, np.uint8),
                                _node.FRESH.get("x", 10, np.uint8))
