"""The seed's first example: gradients all-reduced by hand, on some ranks only.

Each rank averages its gradients with dist.all_reduce after backward, but skips the step when
its loss is not finite (a "guard" many training loops have). Rank 1 gets a batch with a NaN at
step 4, so it makes one all_reduce round fewer than the others: every later call is matched
with the wrong one on the other ranks, and at the end the others wait in an all_reduce that
rank 1 never calls. argv[1] == "ddp-grad-only" skips only the weight's all_reduce (the next
call then has another shape: HPCDDP_DEBUG=detail stops it at once).
"""
import sys
import time

import torch
import torch.distributed as dist

import hpcddp

hpcddp.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
only_weight = len(sys.argv) > 1 and sys.argv[1] == "weight-only"
torch.manual_seed(rank)
model = torch.nn.Linear(8, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 8):
    x = torch.randn(16, 8)
    if rank == 1 and step == 4:
        x[0, 0] = float("nan")                      # one bad sample on one rank
        print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        if torch.isfinite(loss) or (only_weight and p is model.bias):
            dist.all_reduce(p.grad)                 # runs on some ranks only at step 4
            p.grad /= size
    opt.step()
print(f"[rank{rank}] done", flush=True)
