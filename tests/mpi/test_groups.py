"""Sub-groups: every collective x dtype x reduce op on non-contiguous groups, against numpy and
against gloo groups over the same ranks (the engine is test_collectives.py's).

Groups: ``dist.new_group([0, 2])`` and ``dist.new_group([3, 1])`` style rank lists (torch orders
a group's ranks by world rank whatever order they are given in), a group of one rank,
``hpcddp.group_from_comm`` of an mpi4py ``Split`` communicator whose MPI order is the reverse
of the world's, and the topology communicators as torch groups (2 emulated ranks per node).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import hpcddp
import test_collectives as M  # (tests/mpi is on sys.path: pytest's rootdir import)

# two ranks per emulated node, so the topology groups are real sub-groups (read by init)
MPI_ENV = {"HPCDDP_RANKS_PER_NODE": "2"}
MPI_TIMEOUT = 300
pytestmark = pytest.mark.filterwarnings("ignore:.*is deprecated:FutureWarning")


def _new_group_pair(kind, ranks):
    """hpcddp and gloo groups over RANKS (every rank calls, as torch's new_group requires)."""
    pg = dist.new_group(ranks)
    gloo = dist.new_group(ranks, backend="gloo", timeout=M.GLOO_TIMEOUT)
    g = M.Grp(kind, sorted(ranks), pg, None, gloo)
    if g.member:
        g.comm = pg.hpcddp_comm
    return g


@pytest.fixture(scope="module")
def groups():
    M.init_world()
    n = dist.get_world_size()
    r = dist.get_rank()
    out = {}
    out["pair"] = _new_group_pair("pair", [0, 2] if n >= 3 else [1, 0])
    out["reversed"] = _new_group_pair("reversed", [3, 1] if n >= 4 else [n - 1, 1] if n == 3
                                      else [1, 0])
    out["single"] = _new_group_pair("single", [n - 1])
    # group_from_comm: an mpi4py communicator, MPI order the reverse of world order
    from hpcddp.comm import MPI
    split = MPI.COMM_WORLD.Split(color=r % 2, key=-r)
    pg = hpcddp.group_from_comm(split)
    glo = {c: dist.new_group([q for q in range(n) if q % 2 == c], backend="gloo",
                             timeout=M.GLOO_TIMEOUT) for c in (0, 1)}
    mine = sorted(q for q in range(n) if q % 2 == r % 2)
    out["split"] = M.Grp("split", mine, pg, pg.hpcddp_comm, glo[r % 2])
    out["split"].notes.append(split)
    # topology: node groups of 2 ranks, cross-node groups by local rank
    topo = hpcddp.topology_groups()
    node_ranks = {c: [q for q in range(n) if q // 2 == c] for c in range((n + 1) // 2)}
    gl_node = {c: dist.new_group(rs, backend="gloo", timeout=M.GLOO_TIMEOUT)
               for c, rs in node_ranks.items()}
    out["node"] = M.Grp("node", node_ranks[r // 2], topo["node"], topo["node"].hpcddp_comm,
                        gl_node[r // 2])
    cross_ranks = {c: [q for q in range(n) if q % 2 == c] for c in (0, 1)}
    out["cross"] = M.Grp("cross", cross_ranks[r % 2], topo["cross"], topo["cross"].hpcddp_comm,
                         glo[r % 2])
    out["_topo"] = topo
    yield out


def test_group_ranks(groups):
    """torch's view of each group (ranks, group rank) matches the MPI communicator's."""
    r = dist.get_rank()
    for kind in ("pair", "reversed", "single", "split", "node", "cross"):
        g = groups[kind]
        if not g.member:
            assert g.comm is None
            continue
        assert dist.get_process_group_ranks(g.pg) == g.ranks, kind
        assert dist.get_rank(g.pg) == g.rank, kind
        assert dist.get_world_size(g.pg) == g.size, kind
        assert g.comm.size == g.size and g.comm.rank == g.rank, (kind, g.comm)
        assert list(g.comm.world_ranks) == g.ranks, (kind, g.comm.world_ranks)
        assert g.comm.world_ranks[g.comm.rank] == r


def test_topology_groups(groups):
    n, r = dist.get_world_size(), dist.get_rank()
    topo = groups["_topo"]
    assert dist.get_process_group_ranks(topo["node"]) == [q for q in range(n) if q // 2 == r // 2]
    if r % 2 == 0:
        assert dist.get_process_group_ranks(topo["leaders"]) == list(range(0, n, 2))
    else:
        assert topo["leaders"] is None


def test_split_order_is_torchs(groups):
    """group_from_comm renumbers a communicator whose MPI order differs from world order, so a
    world rank given to dist.* names the same process on every rank."""
    g = groups["split"]
    t = torch.tensor([float(dist.get_rank())])
    dist.broadcast(t, src=g.ranks[0], group=g.pg)
    assert t.item() == g.ranks[0]
    t = torch.tensor([float(dist.get_rank())])
    dist.broadcast(t, group_src=g.size - 1, group=g.pg)
    assert t.item() == g.ranks[-1]


KINDS = ("pair", "reversed", "single", "split", "node", "cross")


@pytest.mark.parametrize("fname", M.CASES)
def test_matrix_groups(groups, fname):
    problems = []
    for kind in KINDS:
        problems += M.run_matrix(groups[kind], fname)
    assert not problems, "\n".join(problems)


def test_groups_p2p(groups):
    """send/recv inside a sub-group: ranks are global in dist.*, group ranks in the direct API."""
    g = groups["reversed"]
    if not g.member or g.size < 2:
        return
    me, other = g.rank, 1 - g.rank
    t = torch.full((3,), float(dist.get_rank()))
    if me == 0:
        dist.send(t, dst=g.ranks[other], group=g.pg)
        hpcddp.send(t, other, group=g.comm, tag=5)
    else:
        got = torch.zeros(3)
        src = dist.recv(got, src=g.ranks[other], group=g.pg)
        assert src == g.ranks[other] and got.eq(g.ranks[other]).all()
        got.zero_()
        assert hpcddp.recv(got, None, group=g.comm, tag=5) == other  # group rank of the sender
        assert got.eq(g.ranks[other]).all()


def test_nested_and_many_groups(groups):
    """Many groups in turn (tags of MPI_Comm_create_group must not collide) and a group of a
    group's communicator."""
    n = dist.get_world_size()
    made = [dist.new_group(list(range(k, n))) for k in range(n)]
    for k, pg in enumerate(made):
        if dist.get_rank() >= k:
            t = torch.ones(1)
            dist.all_reduce(t, group=pg)
            assert t.item() == n - k
    sub = groups["node"]
    pg = hpcddp.group_from_comm(sub.comm)
    t = torch.ones(1)
    dist.all_reduce(t, group=pg)
    assert t.item() == sub.size


def _arena_mappings() -> int:
    """How many of hpcddp's shared-memory arenas this process has mapped."""
    with open("/proc/self/maps") as f:
        return sum("/hpcddp-" in line for line in f)


def test_destroyed_groups_release_what_they_held(groups):
    """A job that makes and destroys groups in a loop (a sweep, a test suite, re-made node
    groups) keeps its mappings and descriptors flat: dist.destroy_process_group(g) unmaps the
    group's shared-memory arena, frees its private communicators and the MPI communicator
    hpcddp made for it (each group held ~4 MiB and a descriptor until the process ended).
    A call on the destroyed group is refused by name; a communicator the user gave to
    group_from_comm stays theirs and usable."""
    n = dist.get_world_size()
    from hpcddp.comm import MPI
    base = None
    for round_ in range(40):
        pg = dist.new_group(list(range(n)))
        t = torch.ones(1 << 19)                                   # 2 MiB: the arena's size
        dist.all_reduce(t, group=pg)
        out = [torch.zeros(3) for _ in range(n)]
        dist.all_gather(out, torch.ones(3), group=pg)             # list form: a private dup
        got = [None] * n
        dist.all_gather_object(got, round_, group=pg)             # objects: pkl5
        assert t.eq(n).all() and got == [round_] * n
        comm = pg.hpcddp_comm
        assert comm._attached                 # the paths kept state for it
        dist.destroy_process_group(pg)
        assert comm.mpi is MPI.COMM_NULL and comm._attached == {}
        if round_ == 4:
            base = (len(os.listdir("/proc/self/fd")), _arena_mappings())
    fds, arenas = len(os.listdir("/proc/self/fd")), _arena_mappings()
    assert fds <= base[0] + 1, (base, fds)
    assert arenas <= base[1], (base, arenas)  # held, each group's arena stayed mapped
    with pytest.raises(ValueError, match=r"all_reduce: group .* was destroyed"):
        hpcddp.all_reduce(torch.ones(1), group=pg)
    # a user's communicator outlives the torch group made over it
    split = MPI.COMM_WORLD.Split(color=0, key=dist.get_rank())
    pg = hpcddp.group_from_comm(split)
    dist.all_reduce(torch.ones(1), group=pg)
    dist.destroy_process_group(pg)
    assert split.allreduce(1) == n
    split.Free()
