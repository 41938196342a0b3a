"""The ring path (hpcddp.collectives._ring): large all_reduce, reduce_scatter_tensor and
all_gather_into_tensor across nodes, at 2, 3 and 4 ranks on emulated nodes of one rank each,
against a numpy reference: exact sums of every dtype it takes, sizes that divide neither by
the ranks nor by the chunk, AVG and PREMUL_SUM, the same bits on every rank, the rows it
leaves to MPI, and user messages with the same tags beside it.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from hpcddp import settings
import hpcddp
from hpcddp.collectives import _ring, paths
from hpcddp.comm import links

# emulated nodes share one host's shared memory: the arena would take the calls first, and
# MPI's shared-memory Allreduce would win the ring's start-up race (force skips it)
MPI_ENV = {"HPCDDP_RANKS_PER_NODE": "1", "HPCDDP_SHM_ALLREDUCE": "0", "HPCDDP_RING": "force"}
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def world():
    if not dist.is_initialized():
        hpcddp.init_process_group()
    return dist.get_world_size(), dist.get_rank()


def _value(r, numel, dtype):
    return torch.from_numpy((np.arange(numel) * 3 + r * 7) % 11).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
@pytest.mark.parametrize("numel", [(1 << 18) + 3, (3 << 20) + 5], ids=["1MiB+3", "12MiB+5"])
def test_sum_is_exact(world, dtype, numel):
    n, r = world
    assert numel * torch.empty(0, dtype=dtype).element_size() >= _ring.MIN_BYTES
    t = _value(r, numel, dtype)
    dist.all_reduce(t)
    want = sum(_value(q, numel, dtype) for q in range(n))
    assert torch.equal(t, want)
    # every rank holds the same bits
    got = [torch.empty_like(t) for _ in range(n)]
    dist.all_gather(got, t)
    assert all(torch.equal(g, t) for g in got)


def test_the_ring_took_the_call(world, monkeypatch):
    n, _ = world
    calls = []
    real = _ring.Ring.all_reduce
    monkeypatch.setattr(_ring.Ring, "all_reduce", lambda self, arr: (calls.append(arr.size),
                                                                    real(self, arr)))
    t = torch.ones(1 << 20)
    dist.all_reduce(t)
    assert calls == [1 << 20] and torch.equal(t, torch.full((1 << 20,), float(n)))
    # below its size, other dtypes and other ops: MPI's row
    for t, op in ((torch.ones(1000), dist.ReduceOp.SUM),
                  (torch.ones(1 << 20, dtype=torch.float16), dist.ReduceOp.SUM),
                  (torch.ones(1 << 20), dist.ReduceOp.MAX)):
        dist.all_reduce(t, op=op)
    assert calls == [1 << 20]
    assert "ring" in paths.format_table(paths.table(hpcddp.world()))


def test_avg_and_premul_sum(world):
    n, r = world
    t = torch.full(((1 << 20) + 1,), float(r))
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.allclose(t, torch.full_like(t, (n - 1) / 2))
    t = torch.full(((1 << 20) + 1,), float(r + 1), dtype=torch.float64)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.0))
    assert torch.equal(t, torch.full_like(t, float(n * (n + 1))))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_reduce_scatter_tensor_takes_the_ring_and_sums_exactly(world, dtype, monkeypatch):
    """Each rank gets the exact sum of its block, the input is left as it was, the ring ran
    (its first half); a MAX and a call below its size go to MPI's row."""
    n, r = world
    calls = []
    real = _ring.Ring.reduce_scatter
    monkeypatch.setattr(_ring.Ring, "reduce_scatter",
                        lambda self, inp, out: (calls.append(out.size), real(self, inp, out)))
    c = (1 << 20) // torch.empty(0, dtype=dtype).element_size() // n + 3   # >= 1 MiB in all
    inputs = [_value(q, c * n, dtype) for q in range(n)]
    mine = inputs[r].clone()
    out = torch.zeros(c, dtype=dtype)
    dist.reduce_scatter_tensor(out, mine)
    assert torch.equal(out, sum(inputs)[r * c:(r + 1) * c])
    assert torch.equal(mine, inputs[r]) and calls == [c]
    dist.reduce_scatter_tensor(out, mine, op=dist.ReduceOp.MAX)
    assert torch.equal(out, torch.stack(inputs).amax(0)[r * c:(r + 1) * c])
    small = torch.zeros(10, dtype=dtype)
    dist.reduce_scatter_tensor(small, _value(r, 10 * n, dtype))
    assert torch.equal(small, sum(_value(q, 10 * n, dtype) for q in range(n))[r * 10:r * 10 + 10])
    assert calls == [c]
    # AVG: summed on the ring, divided after
    avg = torch.zeros(c, dtype=torch.float64)
    dist.reduce_scatter_tensor(avg, torch.full((c * n,), float(r), dtype=torch.float64),
                               op=dist.ReduceOp.AVG)
    assert torch.equal(avg, torch.full_like(avg, (n - 1) / 2)) and calls == [c, c]
    # PREMUL_SUM: the ring sums copies scaled by the factor; the caller's input is unchanged
    mine = torch.full((c * n,), float(r + 1), dtype=torch.float64)
    dist.reduce_scatter_tensor(avg, mine, op=dist._make_nccl_premul_sum(2.0))
    assert torch.equal(avg, torch.full_like(avg, float(n * (n + 1)))) and calls == [c, c, c]
    assert torch.equal(mine, torch.full_like(mine, float(r + 1)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bfloat16, torch.uint8])
def test_all_gather_into_tensor_takes_the_ring_in_rank_order(world, dtype, monkeypatch):
    """Every rank's input in rank order, for any dtype (a gather adds nothing), the ring ran
    (its second half)."""
    n, r = world
    calls = []
    real = _ring.Ring.all_gather
    monkeypatch.setattr(_ring.Ring, "all_gather",
                        lambda self, inp, out: (calls.append(inp.size), real(self, inp, out)))
    c = (1 << 20) // torch.empty(0, dtype=dtype).element_size() // n + 5
    out = torch.zeros(c * n, dtype=dtype)
    dist.all_gather_into_tensor(out, _value(r, c, dtype))
    assert torch.equal(out, torch.cat([_value(q, c, dtype) for q in range(n)]))
    assert calls == [c]


def test_reduce_scatter_and_all_gather_over_links_match_mpi_and_numpy(world):
    """The ring's halves over TCP links and over MPI's point-to-point give the same bits: the
    reduce-scatter sums block b from rank b+1 on, round the ring, as numpy does in that order;
    blocks of odd sizes, inputs left unchanged."""
    n, r = world
    private = hpcddp.world().mpi.Dup()
    tcp = _ring.ring(hpcddp.world()).via
    rng = np.random.default_rng(11)
    for c in (1, (1 << 16) + 3):
        data = [rng.standard_normal(c * n).astype(np.float32) for _ in range(n)]
        kept = data[r].copy()
        got = {}
        for name, via in (("tcp", tcp), ("mpi", private)):
            out = np.zeros(c, np.float32)
            _ring.reduce_scatter(via, data[r], out)
            got[name] = out
        assert np.array_equal(data[r], kept)
        assert np.array_equal(got["tcp"], got["mpi"])
        acc = data[(r + 1) % n][r * c:(r + 1) * c].copy()
        for q in range(2, n + 1):
            acc += data[(r + q) % n][r * c:(r + 1) * c]
        assert np.array_equal(got["tcp"], acc)
        for via in (tcp, private):
            out = np.zeros(c * n, np.float32)
            _ring.all_gather(via, data[r][:c], out)
            assert np.array_equal(out, np.concatenate([d[:c] for d in data]))
    private.Free()


def test_async_and_user_messages_beside_it(world):
    """An async ring all_reduce with the user's point-to-point messages on the same group and
    the ring's own tags (1, 2): the ring's go over its private communicator."""
    n, r = world
    t = torch.full((1 << 20,), float(r))
    w = dist.all_reduce(t, async_op=True)
    got = torch.zeros(4)
    reqs = [dist.isend(torch.full((4,), float(r)), (r + 1) % n, tag=1),
            dist.irecv(got, (r - 1) % n, tag=1)]
    for q in reqs:
        q.wait()
    w.wait()
    assert torch.equal(got, torch.full((4,), float((r - 1) % n)))
    assert torch.equal(t, torch.full_like(t, float(n * (n - 1) // 2)))


def test_the_group_layout_decides_the_same_everywhere(world):
    """A sub-group: the ring is made collectively on its first large call, or not at all."""
    n, r = world
    if n < 3:
        pytest.skip("needs a proper sub-group")
    g = dist.new_group([0, 2])
    if r in (0, 2):
        t = torch.full((1 << 20,), float(r))
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.full_like(t, 2.0))
        # made on that first call, on both members (cached: no message now)
        assert _ring.ring(g.hpcddp_comm) is not None
    dist.barrier()


def test_the_ring_travels_on_tcp_links_with_the_same_bits_as_over_mpi(world):
    """By default (HPCDDP_RING_TRANSPORT=tcp) the group's ring holds TCP links to its
    neighbours; a sum over them equals, bit for bit, the ring over MPI's point-to-point and
    numpy's sum in the ring's block order, also with blocks of uneven size."""
    n, r = world
    assert isinstance(_ring.ring(hpcddp.world()).via, links.Links)
    private = hpcddp.world().mpi.Dup()
    rng = np.random.default_rng(7)
    for numel in (n - 1, (1 << 18) + 5, 3 << 20):
        data = [rng.standard_normal(numel).astype(np.float32) for _ in range(n)]
        over_tcp, over_mpi = data[r].copy(), data[r].copy()
        _ring.ring(hpcddp.world()).all_reduce(over_tcp)
        _ring.all_reduce(private, over_mpi)
        assert np.array_equal(over_tcp, over_mpi)
        want = np.empty_like(over_tcp)      # block b is summed from rank b on, round the ring
        for b, idx in enumerate(np.array_split(np.arange(numel), [numel * i // n
                                                                  for i in range(1, n)])):
            acc = data[b][idx].copy()
            for q in range(1, n):
                acc += data[(b + q) % n][idx]
            want[idx] = acc
        assert np.array_equal(over_tcp, want)
    private.Free()


def test_info_names_the_transport_the_ring_runs_on(world, monkeypatch):
    """hpcddp info's ring row says which transport the group's ring took: its TCP links by
    default; MPI's point-to-point, and why, on a group made under HPCDDP_RING_TRANSPORT=mpi."""
    def ring_state(comm):
        return [row["state"] for row in paths.table(comm)
                if row["op"] == "all_reduce" and row["path"] == "ring"][0]
    assert "on TCP links" in ring_state(hpcddp.world()), ring_state(hpcddp.world())
    monkeypatch.setattr(settings, "_current", settings.get().replace(ring_transport="mpi"))
    g = dist.new_group(list(range(world[0])))
    state = ring_state(g.hpcddp_comm)
    assert "on MPI point-to-point (HPCDDP_RING_TRANSPORT=mpi)" in state, state
    dist.destroy_process_group(g)


def test_a_stray_connection_is_not_taken_for_a_neighbour(world):
    """Links accept only a peer that shows the group's token and its own rank: a connection
    from elsewhere to the listening port is closed, and the ring is still made."""
    n, r = world
    import socket
    real_accept = links._accept

    def accept_after_a_stray(listener, token, left, channels):
        port = listener.getsockname()[1]
        stray = socket.create_connection(("127.0.0.1", port))
        stray.sendall(b"not the group token at all")
        try:
            return real_accept(listener, token, left, channels)
        finally:
            stray.close()
    links._accept = accept_after_a_stray
    try:
        made = links.Links.make(hpcddp.world().mpi)
    finally:
        links._accept = real_accept
    assert made is not None
    t = np.full(1 << 18, float(r), dtype=np.float64)
    _ring.all_reduce(made, t)
    assert np.array_equal(t, np.full_like(t, n * (n - 1) / 2))
    made.close()
    assert made.out.fileno() == -1 and made.into.fileno() == -1   # closed


def test_no_link_on_one_rank_means_no_links_anywhere(world, capfd):
    """A rank that cannot reach its neighbour says why; every rank then keeps MPI's
    point-to-point (the same choice everywhere)."""
    n, r = world
    real = links._connect

    def unreachable(peer, my_host, hello):
        raise ConnectionRefusedError(111, "Connection refused (forced by the test)")
    links._connect = unreachable if r == n - 1 else real
    try:
        made = links.Links.make(hpcddp.world().mpi)
    finally:
        links._connect = real
    assert made is None
    if r == n - 1:
        assert "no TCP link for the ring" in capfd.readouterr().out


def test_ranks_that_differ_on_the_transport_all_stay_on_mpi(world, monkeypatch):
    """HPCDDP_RING_TRANSPORT read differently on one rank: every rank agrees on MPI's
    point-to-point (no rank left waiting in the links' set-up), and the sum is right."""
    n, r = world
    monkeypatch.setattr(settings, "_current", settings.get().replace(
        ring_transport="mpi" if r == n - 1 else "tcp"))
    private = hpcddp.world().mpi.Dup()
    via = _ring.connect(private)
    assert via is private
    t = np.full(1 << 18, float(r))
    _ring.all_reduce(via, t)
    assert np.array_equal(t, np.full_like(t, n * (n - 1) / 2))
    private.Free()


def test_a_destroyed_group_closes_its_links(world):
    """dist.destroy_process_group(g) closes the ring's TCP links and frees its communicators
    at once (not when Python's garbage collector gets to them): a job that makes and destroys
    groups keeps its sockets and descriptors flat; the remaining groups' rings still sum."""
    n, r = world
    fds = None
    for round_ in range(8):
        g = dist.new_group(list(range(n)))
        t = torch.full((1 << 18,), float(r))
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.full_like(t, float(sum(range(n)))))
        ring = _ring.ring(g.hpcddp_comm)
        assert isinstance(ring.via, links.Links)
        sockets = ring.via.outs + ring.via.intos
        dist.destroy_process_group(g)
        assert all(s.fileno() == -1 for s in sockets), sockets
        assert g.hpcddp_comm._attached == {}
        if round_ == 1:
            fds = len(os.listdir("/proc/self/fd"))
    assert len(os.listdir("/proc/self/fd")) <= fds + 1
    t = torch.ones(1 << 18)
    dist.all_reduce(t)
    assert torch.equal(t, torch.full_like(t, float(n)))


def test_the_links_race_against_mpi_once_per_ring_of_processes(world, monkeypatch):
    """faster_than_mpi races the links against MPI's Sendrecv once per ring of the same
    processes and size (stage's probe, ~35 ms at 1 Gbit/s): a later ask agrees on the verdict
    every rank remembers, without a race; where one rank has forgotten it, all race again
    together (no rank waits in a race the others skip)."""
    n, r = world
    private = hpcddp.world().mpi.Dup()
    made = links.Links.make(private)
    assert made is not None
    key_bytes = (1 << 16) + 8 * n
    raced = []
    real_race = links._race
    monkeypatch.setattr(links, "_race", lambda *a: raced.append(1) or real_race(*a))
    first = links.faster_than_mpi(made, key_bytes)
    again = links.faster_than_mpi(made, key_bytes)
    assert raced == [1] and again == first
    if r == 0:
        links._verdicts.clear()
    third = links.faster_than_mpi(made, key_bytes)
    assert raced == [1, 1] and private.allgather(third) == [third] * n
    made.close()
    private.Free()
