"""The seed's third example: an exception swallowed inside a custom module on one rank.

MyCustomModule catches the error of its complex operation, prints it and returns None; the
training loop skips batches whose output is None. On rank 1 that happens once (step 3), so
rank 1 skips one backward -- one round of DDP's gradient all_reduce -- and at the end the
other ranks wait in DDP's backward for a round rank 1 never starts.
"""
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import hpcddp

hpcddp.init_process_group()
rank = dist.get_rank()


class MyCustomModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 4)

    def complex_operation(self, x):
        if rank == 1 and self.calls == 3:
            raise FloatingPointError("overflow in complex_operation")
        return self.layer(x)

    def forward(self, x):
        self.calls = getattr(self, "calls", 0) + 1
        try:
            return self.complex_operation(x)
        except Exception as e:
            print(f"[rank{rank}] Error in custom module: {e}", flush=True)   # and goes on


torch.manual_seed(0)
model = DDP(MyCustomModule())
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1, 7):
    out = model(torch.randn(16, 8))
    if out is None:
        continue                                  # "skip the bad batch"
    out.square().mean().backward()
    opt.step()
    opt.zero_grad()
if rank == 1:
    print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
print(f"[rank{rank}] done", flush=True)
