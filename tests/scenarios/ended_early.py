"""A rank whose script ends (normally: no exception, exit code 0) while the others wait.

``skip``: the last rank leaves the loop before all_reduce #6 (a wrong early exit) and ends
its script; the others wait in all_reduce #6 for ever. The report must come at once, naming
the rank as ended without calling it, not after HPCDDP_TIMEOUT.

``clean``: no false alarm for ranks that end at different times. Rank 0 is the root of the
last broadcast and ends at once while the others are still computing before they call it;
ranks 1 and 2 then run an all_reduce on a group without rank 0, rank 1 waiting 4 s in it for
rank 2; every rank ends. Exit code 0, no report.
"""
import sys
import time

import torch
import torch.distributed as dist

import hpcddp

hpcddp.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
mode = sys.argv[1]
t = torch.ones(256)

if mode == "skip":
    for step in range(1, 10):
        if step == 6 and rank == size - 1:
            print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
            break                       # the bug: this rank stops early, without an error
        dist.all_reduce(t)
elif mode == "clean":
    dist.all_reduce(t)
    others = dist.new_group([1, 2])     # every rank creates it
    if rank != 0:
        time.sleep(3.0)                 # rank 0 has ended by now
    dist.broadcast(t, src=0)
    if rank == 2:
        time.sleep(4.0)                 # rank 1 waits in the group's all_reduce meanwhile
    if rank in (1, 2):
        dist.all_reduce(t, group=others)
        time.sleep(2.0)                 # still computing after rank 0's looks
print(f"[rank{rank}] done {t[0].item():g}", flush=True)
