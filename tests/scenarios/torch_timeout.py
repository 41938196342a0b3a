"""torch's own timeout= bounds a stall: the last rank skips a collective on a group created
with a short torch timeout while HPCDDP_TIMEOUT stays long (600 s).

argv[1]: ``init`` (init_process_group(timeout=2 s), an all_reduce on the world),
``new_group`` (a new_group(timeout=2 s) over every rank, an all_reduce on it), or ``barrier``
(init_process_group(timeout=2 s), dist.barrier: torch's test_barrier_timeout_full_group).
"""
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import hpcddp  # noqa: F401  (registers the backend)

mode = sys.argv[1]
short = timedelta(seconds=2)
dist.init_process_group("hpcddp", timeout=short if mode != "new_group" else None)
group = dist.new_group(list(range(dist.get_world_size())), timeout=short) \
    if mode == "new_group" else None
rank, late = dist.get_rank(), dist.get_world_size() - 1
t = torch.ones(16)
for step in range(1, 5):
    if step == 3 and rank == late:
        print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
        time.sleep(120)
    if mode == "barrier":
        dist.barrier(group)
    else:
        dist.all_reduce(t, group=group)
print(f"[rank{rank}] done", flush=True)
