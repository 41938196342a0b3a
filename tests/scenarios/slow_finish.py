"""No false alarm: a healthy job whose ranks are slow in Python, not stuck.

Rank 0 starts an isend it never waits for (allowed: the message is small and its receiver
takes it), then computes in Python for 2.5 x HPCDDP_TIMEOUT while the others wait in an
all_reduce for a while less than the timeout... and at the end rank 0 writes a "checkpoint"
for 2.5 x timeout while the others wait in hpcddp's finalize. Neither is a hang: no report,
exit code 0.
"""
import os
import time

import torch

import hpcddp

rt = hpcddp.init()
rank = rt.world.rank
timeout = float(os.environ["HPCDDP_TIMEOUT"])
t = torch.ones(4)
if rank == 0:
    hpcddp.isend(torch.arange(4.0), dst=1)        # never waited: still "in flight" on rank 0
elif rank == 1:
    hpcddp.recv(torch.empty(4), src=0)
for step in range(3):
    if rank == 0:
        time.sleep(timeout * 0.6)                  # slow, but each wait is under the timeout
    hpcddp.all_reduce(t)
if rank == 0:
    end = time.monotonic() + 2.5 * timeout         # a long final checkpoint: others finalize
    while time.monotonic() < end:
        sum(range(1000))
print(f"[rank{rank}] done {t[0].item():g}", flush=True)
