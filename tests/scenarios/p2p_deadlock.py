"""Both ranks recv first: a point-to-point deadlock the stall report must call one.

argv[1]: ``torch`` (dist.recv) or ``direct`` (hpcddp.recv after a few matched exchanges,
so the recv runs from a plan).
"""
import sys
import time

import torch
import torch.distributed as dist

import hpcddp

hpcddp.init_process_group()
r = dist.get_rank()
t = torch.zeros(4)
if sys.argv[1] == "direct":
    for _ in range(3):
        if r == 0:
            hpcddp.send(t, 1)
            hpcddp.recv(t, 1)
        else:
            hpcddp.recv(t, 0)
            hpcddp.send(t, 0)
print(f"[rank{r}] stall point {time.time():.3f}", flush=True)
(dist.recv if sys.argv[1] == "torch" else hpcddp.recv)(t, 1 - r)
