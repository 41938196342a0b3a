"""HPCDDP_STALL_POLICY=warn: a slow rank is reported, the job waits on, and ends normally.

Rank 1 arrives at the third all_reduce argv[1] seconds late (default 9): with HPCDDP_TIMEOUT=3
the report comes (and again after another timeout) but the job is not aborted.
"""
import sys
import time

import torch

import hpcddp

rt = hpcddp.init()
rank = rt.world.rank
late = float(sys.argv[1]) if len(sys.argv) > 1 else 9.0
t = torch.ones(4)
for step in range(1, 5):
    if step == 3 and rank == 1:
        print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
        time.sleep(late)
    hpcddp.all_reduce(t)
print(f"[rank{rank}] done {t[0].item():g}", flush=True)
