"""Run on the virtual cluster (tests/test_vcluster.py): reduce_scatter_tensor and
all_gather_into_tensor across real nodes, one rank each, on the ring's halves over hpcddp's
TCP links (HPCDDP_RING=force: no race), against numpy: sums of every dtype the ring adds,
exact; the input left as it was; a gather of a dtype it does not add (bfloat16); block sizes
that do not divide by the chunk; a MAX, which the ring leaves to MPI. Each rank builds every
rank's input itself, so the references need no message.

Prints "[rankR] vcluster-ring-halves ok" on success; any failure raises, and hpcddp's
abort_on_exception turns it into a failed job.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

import hpcddp
from hpcddp.collectives import _ring
from hpcddp.comm import links

hpcddp.init(abort_on_exception=True)
dist.init_process_group("hpcddp")
rank, size = dist.get_rank(), dist.get_world_size()
ran = []
for name in ("reduce_scatter", "all_gather"):
    real = getattr(_ring.Ring, name)
    setattr(_ring.Ring, name, lambda self, *a, _n=name, _r=real: ran.append(_n) or _r(self, *a))


def inputs(count, dtype):
    return [torch.from_numpy(np.random.default_rng(r).integers(-1000, 1000, count)).to(dtype)
            for r in range(size)]


for dtype in (torch.float32, torch.float64, torch.int32, torch.int64):
    c = (3 << 20) // torch.empty(0, dtype=dtype).element_size() // size + 7
    every = inputs(c * size, dtype)
    mine = every[rank].clone()
    out = torch.zeros(c, dtype=dtype)
    dist.reduce_scatter_tensor(out, mine)
    assert torch.equal(out, sum(every)[rank * c:(rank + 1) * c]), dtype
    assert torch.equal(mine, every[rank]), "the input changed"
    dist.reduce_scatter_tensor(out, mine, op=dist.ReduceOp.MAX)
    assert torch.equal(out, torch.stack(every).amax(0)[rank * c:(rank + 1) * c])
    big = torch.zeros(c * size, dtype=dtype)
    dist.all_gather_into_tensor(big, every[rank][:c])
    assert torch.equal(big, torch.cat([e[:c] for e in every]))
c = (2 << 20) // 2 // size + 3
every = inputs(c, torch.bfloat16)
big = torch.zeros(c * size, dtype=torch.bfloat16)
dist.all_gather_into_tensor(big, every[rank])
assert torch.equal(big, torch.cat(every))
assert ran == ["reduce_scatter", "all_gather"] * 4 + ["all_gather"], ran
assert isinstance(_ring.ring(hpcddp.world()).via, links.Links)
print(f"[rank{rank}] vcluster-ring-halves ok", flush=True)
dist.destroy_process_group()
