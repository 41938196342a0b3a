"""all_reduce bus bandwidth across virtual nodes: raw mpi4py, hpcddp or gloo (docs/multinode-testing.md).

    scripts/vcluster.sh up 2 --rate 1gbit
    scripts/vcluster.sh run node1 mpirun --allow-run-as-root --host node1:2,node2:2 -n 4 \
        --mca btl tcp,self,sm --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
        python scripts/vcluster/busbw.py mpi          # or: hpcddp, gloo; add --mca coll_han_priority 100

float32 all_reduce of 1, 4 and 16 MiB, the median of 3 after one warm-up; busbw = bytes / time
x 2(n-1)/n (the NCCL-tests convention: what each rank's link carries). gloo's store is on node1
port 29511. Prints one line on rank 0, MB/s (1 MB = 1e6 bytes) by MiB.
"""
import json
import os
import sys
import time

import numpy as np

mode = sys.argv[1] if len(sys.argv) > 1 else "mpi"
if mode not in ("mpi", "hpcddp", "gloo"):
    sys.exit(f"busbw.py: mode must be mpi, hpcddp or gloo, got {mode!r}")
if mode == "mpi":
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()

    def allreduce(a):
        comm.Allreduce(MPI.IN_PLACE, a)
    barrier = comm.Barrier
else:
    import torch
    import torch.distributed as dist
    if mode == "hpcddp":
        import hpcddp
        hpcddp.init()
        dist.init_process_group("hpcddp")
    else:
        dist.init_process_group("gloo", init_method="tcp://node1:29511",
                                rank=int(os.environ["OMPI_COMM_WORLD_RANK"]),
                                world_size=int(os.environ["OMPI_COMM_WORLD_SIZE"]))
    rank, n = dist.get_rank(), dist.get_world_size()

    def allreduce(a):
        dist.all_reduce(torch.from_numpy(a))
    barrier = dist.barrier

out = {}
for mib in (1, 4, 16):
    a = np.ones((mib << 20) // 4, dtype=np.float32)
    allreduce(a)
    times = []
    for _ in range(3):
        barrier()
        t0 = time.perf_counter()
        allreduce(a)
        times.append(time.perf_counter() - t0)
    out[mib] = round(a.nbytes / sorted(times)[1] * 2 * (n - 1) / n / 1e6, 1)
if rank == 0:
    print(f"{mode} busbw MB/s by MiB: {json.dumps(out)}", flush=True)
