"""Small collectives whose ranks disagree, and calls that look alike but agree: the audit.

Modes (argv[1]):
- dtype: rank 2 all_reduces 4 int32 where the others all_reduce 4 float32 (the same 16 bytes:
  MPI completes it with wrong data), then the script ends normally. The audit at the script's
  end names rank 2.
- op: rank 2 all_reduces with MAX where the others SUM (MPI mixes the two: wrong data on
  every rank), then the script ends normally. The audit at the script's end names rank 2.
- root: rank 1 broadcasts from src=1 where the others take src=0, at 2 ranks each side's
  tensor is overwritten by the other's: wrong data, then the job goes on computing for 30 s.
  The audit's look within a second or two ends it.
- clean: nothing disagrees, though much looks alike: two groups of the same ranks (torch names
  them alike) with different calls on each, broadcasts from every root, uneven all_to_all
  splits, gather/scatter, a large all_reduce the agreement refuses on every rank (caught), an
  async op in flight at the end. Must end with exit code 0 and no report.
"""
import sys
import time

import torch
import torch.distributed as dist

import hpcddp
from hpcddp.diagnostics import CollectiveMismatchError

mode = sys.argv[1]
hpcddp.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
t = torch.ones(4)
for _ in range(3):
    dist.all_reduce(t)
print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)

if mode == "dtype":
    x = torch.ones(4, dtype=torch.int32 if rank == 2 else torch.float32)
    dist.all_reduce(x)
    for _ in range(5):
        dist.all_reduce(t)
elif mode == "op":
    x = torch.full((4,), float(rank))
    dist.all_reduce(x, op=dist.ReduceOp.MAX if rank == 2 else dist.ReduceOp.SUM)
    for _ in range(5):
        dist.all_reduce(t)
elif mode == "root":
    x = torch.full((8,), float(rank))
    dist.broadcast(x, src=1 if rank == 1 else 0)
    t0 = time.time()
    while time.time() - t0 < 30:
        dist.all_reduce(t)
        time.sleep(0.01)
elif mode == "clean":
    everyone = list(range(size))
    a, b = dist.new_group(everyone), dist.new_group(everyone)
    for i in range(20):
        dist.all_reduce(torch.ones(3), group=a)
        dist.broadcast(torch.ones(i + 1, dtype=torch.int64), src=i % size, group=b)
    dist.barrier(group=b)
    for root in range(size):
        dist.reduce(torch.ones(5), dst=root)
        dist.broadcast(torch.ones(2, dtype=torch.float64), src=root)
    splits = [rank + 1] * size                     # uneven blocks: sizes differ by rank
    out = torch.empty(sum(r + 1 for r in range(size)))
    dist.all_to_all_single(out, torch.ones(sum(splits)), output_split_sizes=[
        r + 1 for r in range(size)], input_split_sizes=splits)
    dist.gather(torch.ones(2), [torch.empty(2) for _ in range(size)] if rank == 0 else None, dst=0)
    dist.scatter(torch.empty(2), [torch.ones(2) for _ in range(size)] if rank == 0 else None, src=0)
    dist.all_gather_object([None] * size, {"rank": rank})
    big = torch.ones((4 << 20) - (1000 if rank == size - 1 else 0))   # 16 MiB: the agreement
    try:
        dist.all_reduce(big)
    except CollectiveMismatchError as exc:
        print(f"[rank{rank}] refused as expected: {str(exc)[:60]}", flush=True)
    for _ in range(3000):                          # more calls than the recorder keeps
        dist.all_reduce(t)
    dist.all_reduce(t, async_op=True)              # left in flight: joined at the end
dist.barrier()
print(f"[rank{rank}] done", flush=True)
