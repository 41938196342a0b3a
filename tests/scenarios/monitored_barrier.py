"""monitored_barrier names the ranks that did not arrive, and where they are.

The last rank is still "loading a checkpoint" (in Python) when the others reach
hpcddp.monitored_barrier(timeout=3, wait_all_ranks=True): rank 0 raises BarrierTimeout naming
it and its line; the arrived ranks raise the same error; abort_on_exception ends the job.
"""
import time

import hpcddp

rt = hpcddp.init(abort_on_exception=True)
rank, size = rt.world.rank, rt.world.size


def load_checkpoint():
    time.sleep(60)


if rank == size - 1:
    print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
    load_checkpoint()
hpcddp.monitored_barrier(timeout=3, wait_all_ranks=True)
print(f"[rank{rank}] done", flush=True)
