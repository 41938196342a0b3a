"""all_reduce bus bandwidth across virtual nodes: raw mpi4py, hpcddp or gloo (docs/multinode-testing.md).

    scripts/vcluster.sh up 2 --rate 1gbit
    scripts/vcluster.sh run node1 mpirun --allow-run-as-root --host node1:2,node2:2 -n 4 \
        --mca btl tcp,self,sm --mca btl_tcp_if_include eth0 --mca oob_tcp_if_include eth0 \
        python scripts/vcluster/busbw.py mpi          # or: hpcddp, gloo; add --mca coll_han_priority 100

Modes: mpi (MPI_Allreduce), ring (a chunked ring over point-to-point, RING_CHUNK bytes per
message: the prototype of a pipelined path), hpcddp, gloo. float32 all_reduce of 1, 4 and 16 MiB, the median of 3 after one warm-up; busbw = bytes / time
x 2(n-1)/n (the NCCL-tests convention: what each rank's link carries). gloo's store is on node1
port 29511. Prints one line on rank 0, MB/s (1 MB = 1e6 bytes) by MiB, and "cores": the CPU
seconds rank 0's process used over the wall seconds of its timed 16 MiB calls.
"""
import json
import os
import resource
import sys
import time

import numpy as np

mode = sys.argv[1] if len(sys.argv) > 1 else "mpi"
if mode not in ("mpi", "ring", "hpcddp", "gloo"):
    sys.exit(f"busbw.py: mode must be mpi, ring, hpcddp or gloo, got {mode!r}")
CHUNK = int(os.environ.get("RING_CHUNK", str(1 << 20)))   # ring: bytes per message


def ring_allreduce(comm, a, MPI):
    """A ring all-reduce (SUM) over point-to-point, each block sent in CHUNK-byte messages,
    each chunk added as it arrives (the prototype of a pipelined path, measured against
    MPI_Allreduce: docs/benchmarks.md)."""
    r, n = comm.Get_rank(), comm.Get_size()
    right, left = (r + 1) % n, (r - 1) % n
    edges = [len(a) * i // n for i in range(n + 1)]
    block = lambda i: a[edges[i % n]:edges[i % n + 1]]  # noqa: E731
    k = max(1, CHUNK // a.itemsize)
    tmp = np.empty(edges[1] - edges[0] + n, dtype=a.dtype)
    for s in range(n - 1):                      # reduce-scatter
        out, into = block(r - s), block(r - s - 1)
        recvs = [comm.Irecv(tmp[j:j + k][:len(into) - j], left, 7) for j in range(0, len(into), k)]
        sends = [comm.Isend(out[j:j + k], right, 7) for j in range(0, len(out), k)]
        for _ in recvs:
            i = MPI.Request.Waitany(recvs)
            j = i * k
            np.add(into[j:j + k], tmp[j:j + k][:len(into[j:j + k])], out=into[j:j + k])
        MPI.Request.Waitall(sends)
    for s in range(n - 1):                      # all-gather
        out, into = block(r + 1 - s), block(r - s)
        MPI.Request.Waitall([comm.Irecv(into, left, 8), comm.Isend(out, right, 8)])


if mode in ("mpi", "ring"):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()

    def allreduce(a):
        if mode == "ring":
            ring_allreduce(comm, a, MPI)
        else:
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
    a = np.arange((mib << 20) // 4, dtype=np.float32) % 7 + rank
    allreduce(a)
    want = (np.arange(len(a), dtype=np.float32) % 7) * n + n * (n - 1) / 2
    assert np.array_equal(a, want), f"{mode}: wrong all_reduce result at {mib} MiB"
    a = np.ones((mib << 20) // 4, dtype=np.float32)
    times, cpu = [], 0.0
    for _ in range(3):
        barrier()
        c0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        allreduce(a)
        times.append(time.perf_counter() - t0)
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu += c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
    out[mib] = round(a.nbytes / sorted(times)[1] * 2 * (n - 1) / n / 1e6, 1)
    out["cores"] = round(cpu / sum(times), 2)     # this process's cores used while it timed
if rank == 0:
    print(f"{mode} busbw MB/s by MiB: {json.dumps(out)}", flush=True)
