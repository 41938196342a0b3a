"""Point-to-point: send/recv (any source reports the sender), isend/irecv, batch_isend_irecv,
tags, send_object_list/recv_object_list; through dist.* on hpcddp, the direct API and gloo.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hpcddp
import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)

MPI_TIMEOUT = 240


@pytest.fixture(scope="module")
def world():
    return M.init_world()


def _ring(api, world, dt, tag=0):
    """Every rank sends its tensor to the next rank and receives from the previous one.
    Even ranks send first: blocking send/recv on a ring without deadlock at any size."""
    n, r = dist.get_world_size(), dist.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    mine = M.value(dt, r, (4, 3))
    got = torch.zeros((4, 3), dtype=dt)
    if api == "direct":
        def send():
            hpcddp.send(mine, nxt, tag=tag)

        def recv():
            return hpcddp.recv(got, prv, tag=tag)
    else:
        grp = world.group(api)

        def send():
            dist.send(mine, nxt, group=grp, tag=tag)

        def recv():
            return dist.recv(got, prv, group=grp, tag=tag)
    if r % 2 == 0:
        send()
        src = recv()
    else:
        src = recv()
        send()
    return src, got


def test_send_recv_every_dtype(world):
    n, r = dist.get_world_size(), dist.get_rank()
    prv = (r - 1) % n
    for dt in M.DTYPES:
        for api in M.APIS:
            if api == "gloo" and dt == torch.int16:
                continue  # gloo: "Invalid scalar type"
            src, got = _ring(api, world, dt)
            assert torch.equal(got, M.value(dt, prv, (4, 3))), (api, dt)
            if api != "gloo":
                assert src == prv, (api, dt, src)


def test_recv_any_source_reports_sender(world):
    n, r = dist.get_world_size(), dist.get_rank()
    for api in ("hpcddp", "direct", "gloo"):
        if r == 0:
            seen = set()
            for _ in range(n - 1):
                t = torch.zeros(2)
                if api == "direct":
                    src = hpcddp.recv(t, None, tag=3)
                else:
                    src = dist.recv(t, group=world.group(api), tag=3)  # src=None: any source
                assert t.tolist() == [src, src * 10.0], (api, src, t)
                seen.add(src)
            assert seen == set(range(1, n)), api
        else:
            t = torch.tensor([float(r), r * 10.0])
            if api == "direct":
                hpcddp.send(t, 0, tag=3)
            else:
                dist.send(t, 0, group=world.group(api), tag=3)
        dist.barrier()


def test_isend_irecv_works(world):
    n, r = dist.get_world_size(), dist.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    for api in ("hpcddp", "direct", "gloo"):
        out = torch.arange(1000, dtype=torch.float64) + r
        inp = torch.zeros(1000, dtype=torch.float64)
        if api == "direct":
            rw = hpcddp.irecv(inp, prv, tag=9)
            sw = hpcddp.isend(out, nxt, tag=9)
        else:
            rw = dist.irecv(inp, prv, group=world.group(api), tag=9)
            sw = dist.isend(out, nxt, group=world.group(api), tag=9)
        sw.wait()
        assert rw.wait() in (True, None)
        assert rw.is_completed() and sw.is_completed()
        assert torch.equal(inp, torch.arange(1000, dtype=torch.float64) + prv), api
        if api != "gloo":
            assert rw.exception() is None


def test_irecv_any_source(world):
    n, r = dist.get_world_size(), dist.get_rank()
    for api in ("hpcddp", "direct", "gloo"):
        if r == 0:
            works = []
            bufs = []
            for _ in range(n - 1):
                t = torch.zeros(1, dtype=torch.int64)
                w = hpcddp.irecv(t, None, tag=4) if api == "direct" else \
                    dist.irecv(t, group=world.group(api), tag=4)
                works.append(w)
                bufs.append(t)
            got = []
            for w, t in zip(works, bufs):
                w.wait()
                src = w.source_rank() if api == "direct" else w._source_rank()
                assert t.item() == src * 100, (api, src, t)
                got.append(src)
            assert sorted(got) == list(range(1, n)), api
        else:
            t = torch.tensor([r * 100])
            (hpcddp.send(t, 0, tag=4) if api == "direct"
             else dist.send(t, 0, group=world.group(api), tag=4))
        dist.barrier()


def test_tags_match_out_of_order(world):
    """Messages are matched by tag, not by order: the receiver takes tag 2 before tag 1."""
    n, r = dist.get_world_size(), dist.get_rank()
    if r > 1:
        return
    peer = 1 - r
    for api in ("hpcddp", "direct", "gloo"):
        grp = world.group(api)
        if r == 0:
            a = torch.full((5,), 1.0)
            b = torch.full((5,), 2.0)
            if api == "direct":
                ws = [hpcddp.isend(a, peer, tag=1), hpcddp.isend(b, peer, tag=2)]
            else:
                ws = [dist.isend(a, peer, group=grp, tag=1), dist.isend(b, peer, group=grp, tag=2)]
            for w in ws:
                w.wait()
        else:
            x, y = torch.zeros(5), torch.zeros(5)
            if api == "direct":
                hpcddp.recv(y, peer, tag=2)
                hpcddp.recv(x, peer, tag=1)
            else:
                dist.recv(y, peer, group=grp, tag=2)
                dist.recv(x, peer, group=grp, tag=1)
            assert x.eq(1).all() and y.eq(2).all(), api


def test_large_tag(world):
    from hpcddp.comm import MPI
    ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
    n, r = dist.get_world_size(), dist.get_rank()
    if r > 1:
        return
    t = torch.tensor([float(r)])
    if r == 0:
        dist.send(t, 1, tag=ub)
    else:
        dist.recv(t, 0, tag=ub)
        assert t.item() == 0


def test_batch_isend_irecv(world):
    """A ring exchange of two tensors per neighbour in one batch, as torch's docs show."""
    n, r = dist.get_world_size(), dist.get_rank()
    nxt, prv = (r + 1) % n, (r - 1) % n
    for api in ("hpcddp", "gloo"):
        grp = world.group(api)
        send_a = torch.full((3,), float(r))
        send_b = torch.arange(4, dtype=torch.int32) * (r + 1)
        recv_a = torch.zeros(3)
        recv_b = torch.zeros(4, dtype=torch.int32)
        ops = [dist.P2POp(dist.isend, send_a, nxt, grp, tag=1),
               dist.P2POp(dist.irecv, recv_a, prv, grp, tag=1),
               dist.P2POp(dist.isend, send_b, prv, grp, tag=2),
               dist.P2POp(dist.irecv, recv_b, nxt, grp, tag=2)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        assert recv_a.eq(prv).all(), (api, recv_a)
        assert torch.equal(recv_b, torch.arange(4, dtype=torch.int32) * (nxt + 1)), (api, recv_b)


def test_send_recv_object_list(world):
    n, r = dist.get_world_size(), dist.get_rank()
    payload = [{"rank": 0, "name": "zero"}, list(range(5)), torch.arange(3.0), None]
    for api in ("hpcddp", "gloo"):
        grp = world.group(api)
        if r == 0:
            for dst in range(1, n):
                dist.send_object_list(payload + [dst], dst=dst, group=grp)
        else:
            objs = [None] * (len(payload) + 1)
            dist.recv_object_list(objs, src=0, group=grp)
            assert objs[0] == payload[0] and objs[1] == payload[1] and objs[3] is None
            assert torch.equal(objs[2], payload[2])
            assert objs[4] == r
        dist.barrier()
    # (torch 2.13's recv_object_list needs src: it refuses src=None before any message)
    if r == 0:
        with pytest.raises(ValueError):
            dist.recv_object_list([None])


def test_large_message(world):
    """8 MB in one send: above every eager limit (rendezvous protocol)."""
    n, r = dist.get_world_size(), dist.get_rank()
    if r > 1:
        return
    k = 2_000_000
    if r == 0:
        dist.send(torch.arange(k, dtype=torch.float32), 1)
    else:
        t = torch.zeros(k, dtype=torch.float32)
        dist.recv(t, 0)
        assert torch.equal(t, torch.arange(k, dtype=torch.float32))


def test_send_from_a_view(world):
    """A contiguous slice of a larger tensor (non-zero storage offset) travels correctly."""
    n, r = dist.get_world_size(), dist.get_rank()
    if r > 1:
        return
    base = torch.arange(20, dtype=torch.float64)
    if r == 0:
        dist.send(base[5:10], 1)
    else:
        out = torch.zeros(20, dtype=torch.float64)
        dist.recv(out[10:15], 0)
        assert out[10:15].tolist() == [5.0, 6.0, 7.0, 8.0, 9.0] and out[:10].eq(0).all()
