"""Object collectives: broadcast_object_list, all_gather_object, gather_object,
scatter_object_list (and send/recv_object_list in test_p2p.py), through dist.* on hpcddp
(torch's pickling over our tensor ops), through gloo, and through the direct API (mpi4py pkl5,
pickle protocol 5), on the world and on a sub-group. Objects over 2 GiB: test_objects_large.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

import hpcddp
import test_collectives as M  # noqa: E402  (tests/mpi is on sys.path: pytest's rootdir import)

MPI_TIMEOUT = 240


class Point:
    """A user class: pickled by reference to this module, which every rank imports."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __eq__(self, other):
        return isinstance(other, Point) and (self.x, self.y) == (other.x, other.y)


def obj(seed: int):
    """A different object (and size) per seed: nested containers, numpy, tensors, None, text."""
    return {"seed": seed, "items": list(range(seed * 50)), "text": "é" * seed + "ß",
            "arr": np.arange(seed + 1, dtype=np.float64) * 0.5, "none": None,
            "tensor": torch.full((seed + 1,), float(seed)), "point": Point(seed, -seed),
            "tuple": (seed, str(seed))}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.fixture(scope="module")
def groups():
    world = M.init_world()
    n = dist.get_world_size()
    ranks = [n - 1, 0] if n >= 3 else [1]
    pg = dist.new_group(ranks)
    gloo = dist.new_group(ranks, backend="gloo", timeout=M.GLOO_TIMEOUT)
    sub = M.Grp("pair", sorted(ranks), pg, None, gloo)
    if sub.member:
        sub.comm = pg.hpcddp_comm
    return [world, sub]


def _run(api, g, what):
    """Run object collective WHAT on G through API; return what this rank holds after."""
    n, me = g.size, g.rank
    grp = g.group(api)
    direct = api == "direct"
    if what == "broadcast_object_list":
        src = n - 1
        lst = [obj(100 + k) for k in range(3)] if me == src else [None] * 3
        if direct:
            hpcddp.broadcast_object_list(lst, src=src, group=grp)
        else:
            dist.broadcast_object_list(lst, src=g.ranks[src], group=grp)
        return lst
    if what == "all_gather_object":
        out = [None] * n
        (hpcddp if direct else dist).all_gather_object(out, obj(me), group=grp)
        return out
    if what == "gather_object":
        dst = n - 1
        out = [None] * n if me == dst else None
        if direct:
            hpcddp.gather_object(obj(me), out, dst=dst, group=grp)
        else:
            dist.gather_object(obj(me), out, dst=g.ranks[dst], group=grp)
        return out
    if what == "scatter_object_list":
        ins = [obj(200 + j) for j in range(n)] if me == 0 else None
        out = [None]
        if direct:
            hpcddp.scatter_object_list(out, ins, src=0, group=grp)
        else:
            dist.scatter_object_list(out, ins, src=g.ranks[0], group=grp)
        return out
    raise AssertionError(what)


def _expected(g, what):
    n, me = g.size, g.rank
    if what == "broadcast_object_list":
        return [obj(100 + k) for k in range(3)]
    if what == "all_gather_object":
        return [obj(r) for r in range(n)]
    if what == "gather_object":
        return [obj(r) for r in range(n)] if me == n - 1 else None
    return [obj(200 + me)]


@pytest.mark.parametrize("what", ["broadcast_object_list", "all_gather_object", "gather_object",
                                  "scatter_object_list"])
def test_object_collectives(groups, what):
    for g in groups:
        if not g.member:
            continue
        want = _expected(g, what)
        for api in M.APIS:
            got = _run(api, g, what)
            assert same(got, want), f"{g.kind} {what} {api}: {got!r}"


def test_broadcast_object_direct():
    """hpcddp.broadcast_object returns the object; numpy buffers travel out of band (pkl5)."""
    M.init_world()
    n, r = dist.get_world_size(), dist.get_rank()
    big = np.arange(3_000_000, dtype=np.float32) if r == 0 else None
    got = hpcddp.broadcast_object({"a": big, "r": r} if r == 0 else None, src=0)
    assert got["r"] == 0 and np.array_equal(got["a"], np.arange(3_000_000, dtype=np.float32))


def test_unpicklable(groups):
    world = groups[0]
    r = dist.get_rank()
    # an object that cannot be pickled fails on the rank holding it, before any message: the
    # same object on every rank makes every rank fail the same way (no one is left waiting)
    with pytest.raises(Exception):
        dist.all_gather_object([None] * world.size, lambda: r)
    with pytest.raises(Exception):
        hpcddp.all_gather_object([None] * world.size, lambda: r)
    # still in step afterwards
    out = [None] * world.size
    dist.all_gather_object(out, r)
    assert out == list(range(world.size))
