"""One rank skips a collective and goes on computing in Python: the others wait for it.

Rank 3 (or the last rank) skips all_reduce #6 and sits in a Python loop; the stall report
must say it has not called all_reduce #6 on WORLD and is in Python at this file's line.
"""
import time

import torch

import hpcddp

rt = hpcddp.init()
rank, size = rt.world.rank, rt.world.size
late = size - 1
t = torch.ones(256)


def slow_python():
    end = time.monotonic() + 120
    while time.monotonic() < end:   # "still computing": in Python, never in an op
        sum(range(1000))


for step in range(1, 10):
    if step == 6 and rank == late:
        print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
        slow_python()
    hpcddp.all_reduce(t)
print(f"[rank{rank}] done", flush=True)
