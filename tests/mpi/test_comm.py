"""The MPI layer inside a real job: start-up, the private world, topology, Communicator."""
import sys

import numpy as np
import pytest

import hpcddp
from hpcddp.comm import MPI, startup


@pytest.fixture(scope="module")
def rt():
    return hpcddp.init()


@pytest.mark.mpi(min_size=2)
def test_init_is_idempotent_and_grants_multiple(rt):
    assert hpcddp.init() is rt
    assert rt.thread_level == "multiple"
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


@pytest.mark.mpi(min_size=2)
def test_world_is_a_private_duplicate(rt):
    w = rt.world
    assert (w.rank, w.size) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    assert MPI.Comm.Compare(w.mpi, MPI.COMM_WORLD) == MPI.CONGRUENT  # same ranks, own context
    assert w.world_ranks == tuple(range(w.size))


@pytest.mark.mpi(min_size=2)
def test_launcher_agrees_with_mpi(rt):
    assert rt.launch is not None and rt.launch.launcher == "openmpi"
    assert (rt.launch.rank, rt.launch.size) == (rt.world.rank, rt.world.size)


@pytest.mark.mpi(min_size=2)
def test_one_host_is_one_node(rt):
    topo = rt.topology
    if topo.emulated:
        pytest.skip("HPCDDP_RANKS_PER_NODE is set for this job")
    assert topo.num_nodes == 1 and topo.node == 0
    assert topo.local_size == rt.world.size
    assert (topo.leader_comm is not None) == (topo.local_rank == 0)
    # the cross-node communicator of one node holds just me
    assert topo.cross_comm.Get_size() == 1


@pytest.mark.mpi(min_size=2)
def test_node_groups_of_one_node(rt):
    g = rt.topology.node_groups(1)
    assert (g.group_rank, g.group_ws, g.nodes) == (0, 1, 1)
    assert g.group_size == rt.world.size and g.local_group_rank == rt.world.rank
    assert g.group_rank_base == 0


@pytest.mark.mpi(min_size=2)
def test_communicator_validates_ranks(rt):
    w = rt.world
    with pytest.raises(ValueError, match=r"src=99 is out of range for group 'WORLD' of size"):
        w.check_rank(99, "broadcast", "src")
    with pytest.raises(ValueError, match="must be an int group rank"):
        w.check_rank("0", "broadcast", "src")


@pytest.mark.mpi(min_size=2)
def test_direct_allreduce_matches_numpy(rt):
    import torch
    w = rt.world
    data = [np.arange(5, dtype=np.float64) * (r + 1) for r in range(w.size)]
    t = torch.from_numpy(data[w.rank].copy())
    hpcddp.all_reduce(t)
    np.testing.assert_array_equal(t.numpy(), np.sum(data, axis=0))


@pytest.mark.mpi(min_size=2)
def test_importing_hpcddp_started_nothing_extra():
    # this process imported hpcddp, then init() ran: MPI is up exactly once
    assert MPI.Is_initialized() and not MPI.Is_finalized()
    assert "hpcddp.comm.startup" in sys.modules and startup.is_initialized()
