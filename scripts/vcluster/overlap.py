"""How much of an async all_reduce hides behind compute: hpcddp or gloo (docs/ddp.md).

    scripts/vcluster.sh up 2 --rate 1gbit
    scripts/vcluster.sh run node1 mpirun --allow-run-as-root --host node1:1,node2:1 -n 2 \
        --bind-to none --mca btl tcp,self,sm --mca btl_tcp_if_include eth0 \
        --mca oob_tcp_if_include eth0 python scripts/vcluster/overlap.py hpcddp   # or gloo

For a float32 all_reduce of MIB MiB (default 16): the op alone (blocking, median of 5); a
matmul loop calibrated to the same length; then the async op, the compute, and wait(). The
overlap fraction is (op + compute - both) / min(op, compute): 1 when the op hid entirely behind
the compute, 0 when they ran one after the other. Also how long ``all_reduce(async_op=True)``
took to return. One line on rank 0 (JSON). gloo's store: node1 port 29512.
"""
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

mode = sys.argv[1] if len(sys.argv) > 1 else "hpcddp"
mib = int(sys.argv[2]) if len(sys.argv) > 2 else 16
if mode == "hpcddp":
    import hpcddp  # noqa: F401  (registers the backend)
    dist.init_process_group("hpcddp")
elif mode == "gloo":
    dist.init_process_group("gloo", init_method="tcp://node1:29512",
                            rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                            world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
else:
    sys.exit(f"overlap.py: mode must be hpcddp or gloo, got {mode!r}")
torch.set_num_threads(1)
rank = dist.get_rank()
t = torch.ones((mib << 20) // 4)
a = torch.randn(256, 256)


def compute(k: int) -> None:
    for _ in range(k):
        torch.mm(a, a)


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


dist.all_reduce(t)
op = statistics.median(timed(lambda: dist.all_reduce(t)) for _ in range(5))
per = timed(lambda: compute(50)) / 50
k = max(1, int(op / per))
# every rank computes the same amount: rank 0's count
kk = torch.tensor([k])
dist.broadcast(kk, 0)
k = int(kk)
comp = statistics.median(timed(lambda: compute(k)) for _ in range(3))
both, ret = [], []
for _ in range(5):
    dist.barrier()
    t0 = time.perf_counter()
    w = dist.all_reduce(t, async_op=True)
    ret.append(time.perf_counter() - t0)
    compute(k)
    w.wait()
    both.append(time.perf_counter() - t0)
both_s = statistics.median(both)
overlap = (op + comp - both_s) / min(op, comp)
if rank == 0:
    print(json.dumps({"mode": mode, "MiB": mib, "op_ms": round(op * 1e3, 1),
                      "compute_ms": round(comp * 1e3, 1), "both_ms": round(both_s * 1e3, 1),
                      "returned_ms": round(statistics.median(ret) * 1e3, 2),
                      "overlap": round(overlap, 2)}), flush=True)
dist.destroy_process_group()
