"""Run on the virtual cluster (tests/test_vcluster_faults.py): all_reduce 4 MiB in a loop, as a
training job's gradient exchange does, until a network fault ends the job.

Rank 0 prints "[rank0] looping" once every rank has done 20 calls over the network: the test
then injects its fault. HPCDDP_TIMEOUT (forwarded by mpirun -x) sets the watchdog's timeout.
"""
from __future__ import annotations

import socket

import torch
import torch.distributed as dist

import hpcddp

hpcddp.init(abort_on_exception=True)
dist.init_process_group("hpcddp")
print(f"rank {dist.get_rank()} of {dist.get_world_size()} on {socket.gethostname()}", flush=True)
grads = torch.ones(1 << 20)
for step in range(1_000_000):
    dist.all_reduce(grads)
    grads.fill_(1.0)
    if step == 20 and dist.get_rank() == 0:
        print("looping", flush=True)
