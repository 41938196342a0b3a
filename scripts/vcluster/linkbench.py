"""Latency and bandwidth between two ranks on two virtual nodes (docs/multinode-testing.md).

    scripts/vcluster.sh up 2 --rate 1gbit --delay 0.1ms
    scripts/vcluster.sh run node1 mpirun --host node1:1,node2:1 -n 2 --allow-run-as-root \
        --mca btl tcp,self --mca btl_tcp_if_include eth0 python scripts/vcluster/linkbench.py

Latency: half the round trip of an 8-byte ping-pong (median of 200), through MPI and through a
plain TCP socket (tcp_latency_us: the link without MPI's busy polling). Bandwidth: rank 0 sends
16 MiB messages to rank 1 for about a second and waits for a 1-byte reply (the median of 5
repetitions of 4 messages); 1 Gbit/s = 125 MB/s. Prints one JSON line on rank 0.
"""
import json
import socket
import statistics
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert comm.Get_size() == 2, "linkbench: run exactly 2 ranks, one per node"
peer = 1 - rank
hosts = comm.allgather(socket.gethostname())

small = np.zeros(1, dtype=np.float64)
lat = []
for i in range(220):
    comm.Barrier()
    t0 = time.perf_counter()
    if rank == 0:
        comm.Send(small, peer); comm.Recv(small, peer)
    else:
        comm.Recv(small, peer); comm.Send(small, peer)
    if i >= 20:
        lat.append((time.perf_counter() - t0) / 2)

# The same ping-pong on a plain blocking TCP socket: the link's own latency, without MPI's
# busy-polling ranks, which on a loaded machine wait for a CPU time slice (milliseconds).
if rank == 1:
    srv = socket.create_server((socket.gethostbyname(hosts[1]), 0))
    comm.send(srv.getsockname(), dest=0)
    conn, _ = srv.accept()
else:
    conn = socket.create_connection(comm.recv(source=1))
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
tcp_lat = []
for i in range(220):
    t0 = time.perf_counter()
    if rank == 0:
        conn.sendall(b"x" * 8); conn.recv(8)
    else:
        conn.recv(8); conn.sendall(b"x" * 8)
    if i >= 20:
        tcp_lat.append((time.perf_counter() - t0) / 2)
conn.close()

big = np.ones(16 << 20, dtype=np.uint8)
ack = np.zeros(1, dtype=np.uint8)
rates = []
for rep in range(6):
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(4):
        if rank == 0:
            comm.Send(big, peer)
        else:
            comm.Recv(big, peer)
    if rank == 0:
        comm.Recv(ack, peer)
    else:
        comm.Send(ack, peer)
    if rep:
        rates.append(4 * big.nbytes / (time.perf_counter() - t0))

if rank == 0:
    print(json.dumps({"hosts": hosts, "latency_us": round(statistics.median(lat) * 1e6, 1),
                      "tcp_latency_us": round(statistics.median(tcp_lat) * 1e6, 1),
                      "bandwidth_MBps": round(statistics.median(rates) / 1e6, 1),
                      "bandwidth_Gbps": round(statistics.median(rates) * 8 / 1e9, 3)}), flush=True)
