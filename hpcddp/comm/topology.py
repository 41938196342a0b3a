"""Node topology: node-local, node-leader and cross-node communicators, and node groups.

A node is the set of ranks sharing memory (MPI_COMM_TYPE_SHARED). On one machine nodes can be
emulated with ``HPCDDP_RANKS_PER_NODE=k``: ranks split into nodes of k consecutive ranks, so
multi-node logic (staging, leaders, cross-node groups) runs and is tested here.

For 6 ranks on 2 nodes of 3::

    node_comm:     [0,1,2] [3,4,5]
    leader_comm:   [0,3]                (None on ranks 1,2,4,5)
    cross_comm:    [0,3] [1,4] [2,5]    (same local rank on every node)

Building these is collective over the parent communicator: every rank calls
:func:`get_topology` (``hpcddp.init`` does it once) and :meth:`Topology.node_groups`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hpcddp import settings
from hpcddp.comm._mpi import MPI
from hpcddp.comm.communicator import Communicator

ENV_RANKS_PER_NODE = "HPCDDP_RANKS_PER_NODE"


def emulated_ranks_per_node(env=None) -> int | None:
    """HPCDDP_RANKS_PER_NODE: ranks per emulated node, or None (nodes are real hosts)."""
    return (settings.get() if env is None else settings.read(env)).ranks_per_node


@dataclass
class NodeGroups:
    """Nodes taken k at a time (the last group may hold fewer), with the seed's quantities.

    group_size: ranks in my group; group_ws: number of groups; group_rank: index of my group;
    local_group_rank: my rank within the group; group_rank_base: world rank of the group's
    first rank; nodes: nodes in my group; node_in_group: my node's index within the group.
    """
    k: int
    group_rank: int
    group_ws: int
    group_size: int
    local_group_rank: int
    group_rank_base: int
    nodes: int
    node_in_group: int
    group_comm: object            # mpi4py comm: every rank of my node group
    group_leader_comm: object     # mpi4py comm: node leaders of my group (None off-leader)


@dataclass
class Topology:
    world: Communicator
    node_comm: object             # mpi4py comm of the ranks on my node
    leader_comm: object           # mpi4py comm of node leaders (local rank 0); None elsewhere
    cross_comm: object            # mpi4py comm of ranks with my local rank on every node
    node: int                     # my node's index, 0..num_nodes-1 (ordered by first rank)
    num_nodes: int
    local_rank: int
    local_size: int
    emulated: bool
    hostname: str
    _groups: dict = field(default_factory=dict, repr=False)

    @property
    def is_leader(self) -> bool:
        return self.local_rank == 0

    def node_groups(self, k: int) -> NodeGroups:
        """Group nodes k at a time (collective: every rank of the world calls it with one k)."""
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"node_groups: k must be a positive int (nodes per group), got {k!r}")
        cached = self._groups.get(k)
        if cached is not None:
            return cached
        w = self.world.mpi
        g = self.node // k
        group_comm = w.Split(color=g, key=w.Get_rank())
        lead = w.Split(color=g if self.is_leader else MPI.UNDEFINED, key=w.Get_rank())
        first_rank = group_comm.allreduce(w.Get_rank(), op=MPI.MIN)
        groups = NodeGroups(
            k=k, group_rank=g, group_ws=(self.num_nodes + k - 1) // k,
            group_size=group_comm.Get_size(), local_group_rank=group_comm.Get_rank(),
            group_rank_base=first_rank, nodes=min(k, self.num_nodes - g * k),
            node_in_group=self.node - g * k, group_comm=group_comm,
            group_leader_comm=None if lead == MPI.COMM_NULL else lead)
        self._groups[k] = groups
        return groups

    def communicators(self) -> dict:
        """The topology's communicators as hpcddp Communicators, by name (None where absent)."""
        def wrap(c, name):
            return None if c is None else Communicator(c, name)
        return {"node": wrap(self.node_comm, f"node{self.node}"),
                "leaders": wrap(self.leader_comm, "leaders"),
                "cross": wrap(self.cross_comm, f"local_rank{self.local_rank}")}


def build_topology(world: Communicator, ranks_per_node: int | None = None,
                   local_key: int | None = None) -> Topology:
    """Split WORLD into nodes (collective over WORLD).

    local_key orders ranks within a node (the launcher's local rank when it gives one, so
    MPI's local ranks match the launcher's numbering, which picks the GPU).
    """
    w = world.mpi
    rank = w.Get_rank()
    if ranks_per_node is None:
        ranks_per_node = emulated_ranks_per_node()
    if ranks_per_node:
        # by start-up rank: after hpcddp.elastic shrinks the world, an emulated node keeps
        # the ranks it had (a lost node's survivors do not shift into other nodes)
        node_comm = w.Split(color=world.world_ranks[rank] // ranks_per_node, key=rank)
    else:
        node_comm = w.Split_type(MPI.COMM_TYPE_SHARED, key=rank if local_key is None else local_key)
    local_rank, local_size = node_comm.Get_rank(), node_comm.Get_size()
    leader = w.Split(color=0 if local_rank == 0 else MPI.UNDEFINED, key=rank)
    if local_rank == 0:
        node_num = (leader.Get_rank(), leader.Get_size())
    else:
        node_num = None
    node, num_nodes = node_comm.bcast(node_num, root=0)
    cross = w.Split(color=local_rank, key=rank)
    return Topology(world=world, node_comm=node_comm,
                    leader_comm=None if leader == MPI.COMM_NULL else leader,
                    cross_comm=cross, node=node, num_nodes=num_nodes, local_rank=local_rank,
                    local_size=local_size, emulated=bool(ranks_per_node),
                    hostname=MPI.Get_processor_name())
