"""Run on the virtual cluster (tests/test_vcluster_faults.py) under `mpirun --with-ft ulfm`,
outside elastic mode, as a user's plain script is: no abort_on_exception, no elastic.State.
With ULFM on, mpirun does not end the job when a rank dies: each survivor's next call fails
with MPI_ERR_PROC_FAILED, and the rank must end naming the lost one (never wait for it in
MPI_Finalize).

DIE_AT_START=R: rank R SIGKILLs itself once MPI has started, before hpcddp.init (as a rank
crashing in MPI's start-up does). Otherwise rank 0 prints "looping" after 20 all_reduces of
4 MiB and every rank goes on until it fails.
"""
from __future__ import annotations

import os
import signal

from mpi4py import MPI  # starts MPI, as a user's script often does first

if os.environ.get("DIE_AT_START") == str(MPI.COMM_WORLD.Get_rank()):
    os.kill(os.getpid(), signal.SIGKILL)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import hpcddp  # noqa: E402,F401  (registers the backend)

dist.init_process_group("hpcddp")
grads = torch.ones(1 << 20)
for step in range(1_000_000):
    dist.all_reduce(grads)
    grads.fill_(1.0)
    if step == 20 and dist.get_rank() == 0:
        print("looping", flush=True)
