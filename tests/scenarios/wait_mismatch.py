"""Ranks that wait in different calls as the same collective, with the default timeout.

Rank 1 (of 3) calls something else than the others as the fourth collective on WORLD, and
what MPI makes of it is a wait with no end (or an error, or mixed data):
``op``: a broadcast where the others all-reduce; ``count``: an all_reduce of 2^21 floats
(8 MiB, the size from which calls are agreed on) where the others give one element less;
The coordinator must report it within seconds of the stall point, not after HPCDDP_TIMEOUT.
"""
import sys
import time

import torch

import hpcddp

rt = hpcddp.init()
rank = rt.world.rank
mode = sys.argv[1]
t = torch.ones(4)
for step in range(3):
    hpcddp.all_reduce(t)
print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
odd = rank == 1
if mode == "op":
    if odd:
        hpcddp.broadcast(t, src=0)
    else:
        hpcddp.all_reduce(t)
elif mode == "count":
    hpcddp.all_reduce(torch.ones((1 << 21) - (0 if odd else 1)))
hpcddp.barrier()
print(f"[rank{rank}] done", flush=True)
