"""The last rank all-reduces float64 where the others pass float32 (256 KiB against 512 KiB:
below the size at which default mode agrees on the call first; the case turns the
shared-memory arena off, which agrees on every call it serves). The stall report must name
each rank's call and the last rank as the culprit."""
import time

import torch

import hpcddp

rt = hpcddp.init()
r, n = rt.world.rank, rt.world.size
for _ in range(3):
    hpcddp.all_reduce(torch.ones(8))
t = torch.ones(65536, dtype=torch.float64 if r == n - 1 else torch.float32)
print(f"[rank{r}] stall point {time.time():.3f}", flush=True)
hpcddp.all_reduce(t)
print(f"[rank{r}] done", flush=True)
