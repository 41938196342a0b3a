"""One rank skips a collective and goes on computing in Python: the others wait for it.

Rank 3 (or the last rank) skips all_reduce #6 and sits in a Python loop; the stall report
must say it has not called all_reduce #6 on WORLD and is in Python at this file's line.
With the argument ``async`` every all_reduce is called with async_op=True (on the async
engine where it is on) and waited for after some compute: the report is the same. With
``first_all_gather`` call #6 is the job's first all_gather (list form) instead, whose path
first makes the group's private duplicate (MPI_Comm_dup, inside the op): the others wait
there, where the watchdog once did not see them wait.
"""
import sys
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
    if step == 6 and sys.argv[1:] == ["first_all_gather"]:
        hpcddp.all_gather([torch.empty_like(t) for _ in range(size)], t)
    elif sys.argv[1:] == ["async"]:
        w = hpcddp.all_reduce(t, async_op=True)
        sum(range(1000))
        w.wait()
    else:
        hpcddp.all_reduce(t)
print(f"[rank{rank}] done", flush=True)
