"""Run on the virtual cluster (tests/test_vcluster.py): DDP across real nodes vs one process.

Each rank trains DistributedDataParallel on its 1/N of every global batch (float64, SGD with
momentum); the one-process reference trains the same model on the whole batch, locally on
every rank. After the steps the weights must equal the reference (1e-12) and be bit-identical
on every rank (gathered over the group, gradients crossed the nodes over TCP).

Prints "[rankR] vcluster-ddp ok max_diff=D" on success.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcddp

assert "HPCDDP_RANKS_PER_NODE" not in os.environ
hpcddp.init(abort_on_exception=True)
dist.init_process_group("hpcddp")
rank, size = dist.get_rank(), dist.get_world_size()
BATCH, STEPS = 12, 4     # 12 divides by 2, 3 and 4 ranks


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 64), nn.Tanh(), nn.Linear(64, 3)).double()


def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(BATCH, 5, generator=g, dtype=torch.float64),
            torch.randn(BATCH, 3, generator=g, dtype=torch.float64))


def train(net, shard):
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for s in range(STEPS):
        x, y = batch(s)
        x, y = shard(x), shard(y)
        opt.zero_grad()
        ((net(x) - y) ** 2).mean().backward()
        opt.step()
    return net


k = BATCH // size
ddp = train(DDP(model()), lambda t: t[rank * k:(rank + 1) * k])
ref = train(model(), lambda t: t)
mine = torch.cat([p.detach().flatten() for p in ddp.module.parameters()])
want = torch.cat([p.detach().flatten() for p in ref.parameters()])
diff = (mine - want).abs().max().item()
assert diff < 1e-12, f"DDP differs from the one-process reference by {diff}"
every = [torch.empty_like(mine) for _ in range(size)]
dist.all_gather(every, mine)
for r, w in enumerate(every):
    assert torch.equal(w, mine), f"rank {r}'s weights differ from rank {rank}'s"
print(f"[rank{rank}] vcluster-ddp ok max_diff={diff:.1e}", flush=True)
dist.destroy_process_group()
hpcddp.finalize()
