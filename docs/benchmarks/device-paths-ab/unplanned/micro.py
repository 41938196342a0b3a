"""Unplanned calls (async_op=True: never planned), 8 B, direct API: us per call, median of 7 batches."""
import json, sys, time
import torch
import hpcddp
from hpcddp import collectives as C
w = hpcddp.init().world
n, r = w.size, w.rank
x = torch.ones(2); out = torch.empty(2 * n); big = torch.ones(2 * n); one = torch.empty(2)
lst = [torch.empty(2) for _ in range(n)]
ops = {
    "all_reduce": lambda: C.all_reduce(x, async_op=True).wait(),
    "all_gather_into_tensor": lambda: C.all_gather_into_tensor(out, x, async_op=True).wait(),
    "reduce_scatter_tensor": lambda: C.reduce_scatter_tensor(one, big, async_op=True).wait(),
    "all_to_all_single": lambda: C.all_to_all_single(out, big, async_op=True).wait(),
    "all_gather": lambda: C.all_gather(lst, x, async_op=True).wait(),
    "all_to_all": lambda: C.all_to_all(lst, [x] * n, async_op=True).wait(),
    "gather": lambda: C.gather(x, lst if r == 0 else None, 0, async_op=True).wait(),
    "broadcast": lambda: C.broadcast(x, 0, async_op=True).wait(),
    "reduce_scatter": lambda: C.reduce_scatter(one, [x] * n, async_op=True).wait(),
}
res = {}
for name, f in ops.items():
    for _ in range(200):
        f()
    ts = []
    for _ in range(7):
        w.mpi.Barrier()
        t0 = time.perf_counter()
        for _ in range(2000):
            f()
        ts.append((time.perf_counter() - t0) / 2000 * 1e6)
    res[name] = sorted(ts)[3]
if r == 0:
    json.dump(res, open(sys.argv[1], "w"))
