"""Run on the virtual cluster (tests/test_vcluster.py): FSDP2 across real nodes vs one process.

2 nodes x 2 ranks. HSDP: a (replicate, shard) = (2, 2) device mesh, each node's two ranks
shard the model (all_gather / reduce_scatter inside the node, on shared memory) and the two
replicas all-reduce their gradient shards across the nodes (over TCP: the ring's links or
MPI, as the start-up race decides). Then plain FSDP2 over all 4 ranks (its all_gathers and
reduce_scatters cross the nodes). Each trains 3 Adam steps on its share of every batch
(float64) against a one-process reference trained on the whole batch; every parameter must
match it (1e-10). At the end the job destroys its groups and the default group (what the
groups held is released) and all-reduces once more over a fresh group.

Prints "[rankR] vcluster-fsdp2 ok" on success.
"""
from __future__ import annotations

import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hpcddp

assert "HPCDDP_RANKS_PER_NODE" not in os.environ
hpcddp.init(abort_on_exception=True)
dist.init_process_group("hpcddp")
rank, size = dist.get_rank(), dist.get_world_size()
assert size == 4
TOL = 1e-10
WIDTH = 512          # ~0.5 M parameters: 2 MiB gradient shards cross the nodes (float64)


def reference():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH), nn.Tanh(),
                         nn.Linear(WIDTH, 4)).double()


def train(mesh, share: int, index: int) -> None:
    """FSDP2 on MESH; this rank trains on part INDEX of SHARE of each batch."""
    ref = reference()
    model = copy.deepcopy(ref)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opts = [torch.optim.Adam(m.parameters(), lr=0.01) for m in (model, ref)]
    g = torch.Generator().manual_seed(7)
    batch = 8 * share
    for _ in range(3):
        x = torch.randn(batch, 16, generator=g, dtype=torch.float64)
        y = torch.randn(batch, 4, generator=g, dtype=torch.float64)
        for o in opts:
            o.zero_grad()
        part = slice(index * 8, index * 8 + 8)
        nn.functional.mse_loss(model(x[part]), y[part]).backward()
        nn.functional.mse_loss(ref(x), y).backward()
        for o in opts:
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        diff = (full - q).abs().max().item()
        assert diff < TOL, f"{name} differs from the one-process reference by {diff:.3e}"


# HSDP: mesh rows are nodes (ranks 0,1 on node1; 2,3 on node2 under --host node1:2,node2:2)
hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
nodes = [None] * size
dist.all_gather_object(nodes, hpcddp.get_topology().node)
assert nodes == [0, 0, 1, 1], nodes
replica = hsdp["replicate"].get_local_rank()
# the replicas split the batch in two; both ranks of a replica see the same half, and FSDP
# averages over the shard group too, so each rank takes its replica's half
train(hsdp, share=2, index=replica)
# plain FSDP2 over the 4 ranks, each with its quarter
flat = init_device_mesh("cpu", (4,), mesh_dim_names=("dp",))
train(flat, share=4, index=rank)

g = dist.new_group(list(range(size)))
t = torch.ones(1 << 18, dtype=torch.float64)
dist.all_reduce(t, group=g)
assert t.eq(size).all()
dist.destroy_process_group(g)
dist.destroy_process_group()
dist.init_process_group("hpcddp")
t = torch.ones(1 << 18, dtype=torch.float64)
dist.all_reduce(t)
assert t.eq(size).all()
print(f"[rank{rank}] vcluster-fsdp2 ok", flush=True)
dist.destroy_process_group()
