"""An exception on one rank (rank 2 of 4) at step 3 while the others go on to all_reduce.

argv[1] == "abort": hpcddp.init(abort_on_exception=True): the job ends at once, exit code 1,
with rank 2's traceback. "no-abort": hpcddp.init(abort_on_exception=False): rank 2's script
ends with the exception (Python prints it and runs hpcddp's finalize) while the others wait
in all_reduce: the stall report names it after the timeout. "default" (hpcddp.init()) and
"torch" (dist.init_process_group("hpcddp") only, as a user's torch script): abort on
exception's default (auto): rank 2's exit reports at once, naming it, and the job ends.
"default-computing": as "default", the others computing (not in a call) when rank 2 fails:
its exit ends the job with its own line. "exit": as "default", rank 2 calls sys.exit(4)
instead of raising (a script's error exit); "exit-builtin": the same with site's exit(4).
argv[1] == "abort-hook-raises": as "abort", with an excepthook in front of hpcddp's that raises
before it calls hpcddp's (as torch's DataLoader does when a worker dies: its SIGCHLD handler
raises inside whichever hook runs): the job still ends at once, naming the exception.
"""
import sys
import time

import torch

import hpcddp

mode = sys.argv[1] if len(sys.argv) > 1 else "no-abort"
if mode == "torch":
    import torch.distributed as dist
    dist.init_process_group("hpcddp")
    rank, size, all_reduce = dist.get_rank(), dist.get_world_size(), dist.all_reduce
else:
    rt = hpcddp.init(abort_on_exception=True if mode.startswith("abort") else
                     False if mode == "no-abort" else None)
    rank, size, all_reduce = rt.world.rank, rt.world.size, hpcddp.all_reduce
bad = min(2, size - 1)
if mode == "abort-hook-raises":
    hpcddp_hook = sys.excepthook

    def interrupted_hook(*args):
        raise RuntimeError("DataLoader worker (pid 4242) is killed by signal: Killed.")
        hpcddp_hook(*args)      # never reached

    sys.excepthook = interrupted_hook


def load_batch(step):
    if rank == bad and step == 3:
        print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
        if mode.startswith("exit"):
            print(f"[rank{rank}] corrupt sample in batch {step}: exit 4", flush=True)
            (exit if mode == "exit-builtin" else sys.exit)(4)
        raise ValueError(f"corrupt sample in batch {step}")
    return torch.full((8,), float(step))


for step in range(1, 6):
    batch = load_batch(step)
    if mode == "default-computing" and step == 3:
        time.sleep(60)                  # computing when rank 2 fails
    all_reduce(batch)
print(f"[rank{rank}] done", flush=True)
