"""A point-to-point job that a test kills from outside (tests/test_outside_kill.py).

Every rank but TARGET sends TARGET 4 MiB with ``dist.isend`` and waits on it; TARGET prints
``[rankT] AT PHASE isend pid <pid>`` and never receives, so the sends wait in MPI's
rendezvous (a Waitall over the send's request) until the test's SIGKILL reaches TARGET.
argv: TARGET
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import hpcddp  # noqa: F401  (registers the backend)

target = int(sys.argv[1])
dist.init_process_group("hpcddp")
me = dist.get_rank()
if me == target:
    print(f"[rank{me}] AT PHASE isend pid {os.getpid()}", flush=True)
    time.sleep(120)
else:
    dist.isend(torch.ones(1 << 20), dst=target).wait()
print(f"[rank{me}] DONE", flush=True)
