"""A rank is killed (SIGKILL, as the out-of-memory killer does) in the middle of training.

argv[1]: "allreduce" -- the victim dies while it waits inside a large all_reduce;
         "ddp"       -- the victim dies inside DDP's backward (a gradient hook), at step 3.
argv[2]: the victim's rank (default 1).

Under plain mpirun, Open MPI itself ends the job when a rank dies (exit 137, "prterun noticed
that process rank 1 ... exited on signal 9"). Under srun (and `mpirun --enable-recovery`,
which the tests use to get the same behaviour) the survivors would wait forever: hpcddp's
stall report names the dead rank.
"""
import os
import signal
import sys
import threading
import time

import torch

import hpcddp

mode = sys.argv[1]
victim = int(sys.argv[2]) if len(sys.argv) > 2 else 1
rt = hpcddp.init()
rank = rt.world.rank


def die():
    print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if mode == "allreduce":
    t = torch.ones(1 << 16)
    for step in range(1, 4):
        hpcddp.all_reduce(t)
    if rank == victim:
        threading.Timer(1.0, die).start()       # dies while blocked in the all_reduce below
    else:
        time.sleep(2.0)                          # so the victim sits in it first
    hpcddp.all_reduce(t)
elif mode == "ddp":
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("hpcddp")
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(),
                                    torch.nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(1, 6):
        x = torch.randn(8, 16)
        loss = model(x).square().mean()
        if rank == victim and step == 3:
            loss.register_hook(lambda g: die())  # runs inside loss.backward()
        loss.backward()
        opt.step()
        opt.zero_grad()
else:
    raise SystemExit(f"sigkill.py: unknown mode {mode!r} (allreduce, ddp)")
print(f"[rank{rank}] done", flush=True)
