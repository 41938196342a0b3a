"""Every path answers every op it claims (#31: adding a path is one class and one row, adding an
op one method per path that serves it). For each host path of the dispatch table and each op
in its ``OPS``, the op's route is replaced by one whose only middle row is that path (its
switch forced: no start-up race), the public op runs, and the result is checked against what
numpy says every rank must hold; a spy on the path's method says whether it ran. Emulated
nodes of 2 ranks on one real host: every path must run every op it claims, but the
hierarchical one below 4 ranks (it needs two nodes of 2), where its own ``applies`` says no
and MPI must answer right. The device paths are checked with CPU stand-ins in
test_gpu_staging.py."""
from __future__ import annotations

import importlib

import pytest
import torch

from hpcddp import settings
import hpcddp
from hpcddp import collectives as C
from hpcddp.collectives import paths

MPI_SIZES = (2, 3, 4)
MPI_ENV = {"HPCDDP_RANKS_PER_NODE": "2"}    # read by init: nodes of 2 ranks

K = 1 << 19                   # elements per block: 2 MiB of float32, above every path's floor
# op -> (module, the route it keeps, the method route() takes)
ROUTES = {
    "all_reduce": ("reduce", "_ALL_REDUCE", None),
    "reduce": ("reduce", "_REDUCE", None),
    "reduce_scatter": ("reduce", "_REDUCE_SCATTER", None),
    "reduce_scatter_tensor": ("reduce", "_REDUCE_SCATTER_TENSOR", None),
    "broadcast": ("gather", "_BROADCAST", None),
    "all_gather": ("gather", "_ALL_GATHER", None),
    "all_gather_into_tensor": ("gather", "_ALL_GATHER_INTO_TENSOR", None),
    "gather": ("gather", "_GATHER", None),
    "scatter": ("gather", "_SCATTER", None),
    "all_to_all": ("alltoall", "_ALL_TO_ALL", None),
    "all_to_all_single": ("alltoall", "_ALL_TO_ALL_SINGLE", None),
    "isend": ("p2p", "_ISEND", "isend"),
    "send": ("p2p", "_SEND", "send"),
    "irecv": ("p2p", "_IRECV", "irecv"),
    "recv": ("p2p", "_RECV", "recv"),
}
HOST = (paths.MPI_PATH, paths.ARENA, paths.CMA, paths.HIER, paths.RING, paths.LISTS)
PAIRS = [(type(p).__name__, op) for p in HOST for op in sorted(p.OPS)]


@pytest.fixture(scope="module")
def world():
    return hpcddp.world()


@pytest.fixture(autouse=True)
def forced(monkeypatch):
    """Every switch forced (no race: the path applies wherever the layout allows it), each
    test with the world's node-local state made afresh."""
    monkeypatch.setattr(settings, "_current", settings.get().replace(
        shm_allreduce="force", cma="force", hier="force", ring="force"))
    for key in ("shm", "cma", "hier", "ring"):
        monkeypatch.delitem(hpcddp.world()._attached, key, raising=False)


def _full(value, k=K):
    return torch.full((k,), float(value))


def _check_collective(op: str, n: int, r: int) -> None:
    """Run collective OP on the world and assert what every rank must hold."""
    if op == "all_reduce":
        t = _full(r + 1)
        C.all_reduce(t)
        assert torch.equal(t, _full(n * (n + 1) / 2))
    elif op == "reduce":
        t = _full(r + 1)
        C.reduce(t, n - 1)
        assert torch.equal(t, _full(n * (n + 1) / 2 if r == n - 1 else r + 1))
    elif op == "reduce_scatter_tensor":
        out = torch.empty(K)
        C.reduce_scatter_tensor(out, torch.cat([_full(j * 10 + r) for j in range(n)]))
        assert torch.equal(out, _full(n * r * 10 + n * (n - 1) / 2))
    elif op == "reduce_scatter":
        out = torch.empty(K)
        C.reduce_scatter(out, [_full(j * 10 + r) for j in range(n)])
        assert torch.equal(out, _full(n * r * 10 + n * (n - 1) / 2))
    elif op == "broadcast":
        t = torch.arange(K, dtype=torch.float32) * (r == n - 1)
        C.broadcast(t, n - 1)
        assert torch.equal(t, torch.arange(K, dtype=torch.float32))
    elif op == "all_gather_into_tensor":
        out = torch.empty(n * K)
        C.all_gather_into_tensor(out, _full(r))
        assert torch.equal(out, torch.cat([_full(j) for j in range(n)]))
    else:
        _check_lists(op, n, r)


def _check_lists(op: str, n: int, r: int) -> None:
    if op == "all_gather":
        outs = [torch.empty(K) for _ in range(n)]
        C.all_gather(outs, _full(r))
        assert all(torch.equal(o, _full(j)) for j, o in enumerate(outs))
    elif op == "gather":
        outs = [torch.empty(K) for _ in range(n)] if r == 0 else None
        C.gather(_full(r), outs, 0)
        assert r != 0 or all(torch.equal(o, _full(j)) for j, o in enumerate(outs))
    elif op == "scatter":
        t = torch.empty(K)
        C.scatter(t, [_full(j) for j in range(n)] if r == 0 else None, 0)
        assert torch.equal(t, _full(r))
    elif op == "all_to_all":
        outs = [torch.empty(K) for _ in range(n)]
        C.all_to_all(outs, [_full(r * n + j) for j in range(n)])
        assert all(torch.equal(o, _full(j * n + r)) for j, o in enumerate(outs))
    elif op == "all_to_all_single":
        out = torch.empty(n * K)
        C.all_to_all_single(out, torch.cat([_full(r * n + j) for j in range(n)]))
        assert torch.equal(out, torch.cat([_full(j * n + r) for j in range(n)]))


def _check_p2p(op: str, n: int, r: int) -> None:
    """OP on a ring: each rank sends to the next and receives from the one before; the rest of
    each exchange through the other point-to-point ops (the route replaced is OP's alone)."""
    right, left = (r + 1) % n, (r - 1) % n
    got = torch.empty(K)
    if op in ("isend", "send"):
        work = C.irecv(got, left, tag=3)
        if op == "isend":
            C.isend(_full(r), right, tag=3).wait()
        else:
            C.send(_full(r), right, tag=3)
        work.wait()
    else:
        send = C.isend(_full(r), right, tag=3)
        if op == "irecv":
            C.irecv(got, left, tag=3).wait()
        else:
            assert C.recv(got, None, tag=3) == left
        send.wait()
    assert torch.equal(got, _full(left))


def _only(monkeypatch, op: str, via):
    """OP's route with VIA as its only middle row; the list that VIA's method appends to when
    it runs."""
    module, name, method = ROUTES[op]
    table_op = "send/recv/isend/irecv" if method else op
    ran: list = []
    real = getattr(via, op)

    class Only:                          # VIA, its method for OP spied on
        OPS = frozenset({op})
        min_bytes = via.min_bytes
        applies = via.applies and staticmethod(via.applies)
        state = staticmethod(via.state)

    def run(c):
        ran.append(op)
        return real(c)
    setattr(Only, op, staticmethod(run))
    rows = (*paths.DEVICE, paths.Path("only", "", Only()), paths.PATHS[table_op][-1])
    if via is paths.MPI_PATH:
        rows = (*paths.DEVICE, paths.Path("only", "", Only()))
    monkeypatch.setitem(paths.PATHS, table_op, rows)
    mod = importlib.import_module(f"hpcddp.collectives.{module}")
    monkeypatch.setattr(mod, name, paths.route(table_op, method))
    return ran


@pytest.mark.parametrize("path,op", PAIRS, ids=[f"{p}-{o}" for p, o in PAIRS])
def test_every_path_answers_every_op_it_claims(world, monkeypatch, path, op):
    via = next(p for p in HOST if type(p).__name__ == path)
    ran = _only(monkeypatch, op, via)
    n, r = world.size, world.rank
    if op in ("isend", "send", "irecv", "recv"):
        _check_p2p(op, n, r)
    else:
        _check_collective(op, n, r)
    # every rank took the same row: the path ran on all or on none
    took = world.mpi.allgather(bool(ran))
    assert len(set(took)) == 1, took
    # with its switch forced, every path applies on this layout (one real host: the arena
    # and CMA; the ring, forced, on any group) but the hierarchical one below 4 ranks
    # (hpcddp.collectives._hier.usable: it needs two nodes of 2); there MPI answered above
    if via is paths.HIER and n < 4:
        assert not ran, f"{path} ran {op} on {n} ranks"
        pytest.skip(f"{path} needs at least 4 ranks (two nodes of 2); MPI answered {op}")
    assert ran, f"{path} did not run {op} on {n} ranks ({via.state(world, op)})"
