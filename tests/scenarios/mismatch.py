"""Mismatched collectives: rank 1 calls broadcast where the others call all_reduce.

With HPCDDP_DEBUG=detail every rank raises the same CollectiveMismatchError before any data
moves; without it, what MPI does with two different collectives is undefined (here: a hang
or garbage), and the watchdog's report shows who called what.
"""
import time

import torch

import hpcddp
from hpcddp.diagnostics import CollectiveMismatchError

rt = hpcddp.init()
rank = rt.world.rank
t = torch.ones(4)
for step in range(3):
    hpcddp.all_reduce(t)
print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
try:
    if rank == 1:
        hpcddp.broadcast(t, src=0)
    else:
        hpcddp.all_reduce(t)
except CollectiveMismatchError as exc:
    print(f"[rank{rank}] CollectiveMismatchError: {exc}", flush=True)
    raise SystemExit(5)
hpcddp.barrier()
print(f"[rank{rank}] done {t.tolist()}", flush=True)
