"""Run on the virtual cluster (tests/test_vcluster.py): topology and every collective, real nodes.

Each rank checks what MPI itself found (no HPCDDP_RANKS_PER_NODE): nodes are the distinct host
names, node_comm holds exactly the ranks of my host, leaders and cross-node groups follow, and
node groups split nodes k at a time. Then every torch.distributed collective on the hpcddp group
is checked against numpy, at a small size and at 256 Ki elements, 2 MiB (large messages take the other
paths: shared-memory arenas within a node, rendezvous over TCP between nodes). Every rank builds
every rank's input itself, so the references need no message. Before that, 2 MiB all_reduces
inside each node (raw MPI on the node communicator, hpcddp on a node group) must leave the node's
eth0 byte counters (/proc/net/dev, per network namespace) all but unchanged: shared memory within.

Prints "[rankR] vcluster-collectives ok host=H node=N" on success; any failure raises, and
hpcddp's abort_on_exception turns it into a failed job.
"""
from __future__ import annotations

import os
import socket

import numpy as np
import torch
import torch.distributed as dist

import hpcddp

assert "HPCDDP_RANKS_PER_NODE" not in os.environ, "the virtual cluster must find nodes by itself"

hpcddp.init(abort_on_exception=True)
dist.init_process_group("hpcddp")
rank, size = dist.get_rank(), dist.get_world_size()
R = dist.ReduceOp


def check_topology():
    topo = hpcddp.get_topology()
    hosts = [None] * size
    dist.all_gather_object(hosts, socket.gethostname())
    order = list(dict.fromkeys(hosts))                 # nodes in order of their first rank
    mine = [r for r in range(size) if hosts[r] == hosts[rank]]
    assert not topo.emulated
    assert topo.hostname == hosts[rank]
    assert topo.num_nodes == len(order), (topo.num_nodes, hosts)
    assert topo.node == order.index(hosts[rank]), (topo.node, hosts)
    assert topo.local_size == len(mine) and topo.local_rank == mine.index(rank), (topo, mine)
    assert topo.local_rank == int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])
    assert sorted(topo.node_comm.allgather(rank)) == mine
    if topo.is_leader:
        leaders = [hosts.index(h) for h in order]
        assert topo.leader_comm.allgather(rank) == leaders
    else:
        assert topo.leader_comm is None
    cross = [r for r in range(size) if [x for x in range(size) if hosts[x] == hosts[r]].index(r)
             == topo.local_rank]
    assert topo.cross_comm.allgather(rank) == cross
    for k in (1, 2):
        g = topo.node_groups(k)
        group_nodes = order[(topo.node // k) * k:(topo.node // k + 1) * k]
        members = [r for r in range(size) if hosts[r] in group_nodes]
        assert g.group_comm.allgather(rank) == members, (k, members)
        assert g.group_rank == topo.node // k and g.nodes == len(group_nodes)
    return hosts


def inp(r: int, n: int, dtype=np.float64, salt: int = 0) -> np.ndarray:
    """Rank r's input: exact small values, so sums do not depend on the order of reduction."""
    return (((np.arange(n) * 7 + r * 13 + salt) % 11) - 5).astype(dtype)


def t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(a.copy())


def check_collectives(n: int):
    every = [inp(r, n) for r in range(size)]
    total = np.sum(every, axis=0)

    x = t(every[rank]); dist.all_reduce(x)
    np.testing.assert_array_equal(x.numpy(), total)
    x = t(every[rank]); dist.all_reduce(x, op=R.MAX)
    np.testing.assert_array_equal(x.numpy(), np.max(every, axis=0))
    x = t(every[rank]); dist.all_reduce(x, op=R.AVG)
    np.testing.assert_allclose(x.numpy(), total / size, rtol=1e-12)
    xi = t(inp(rank, n, np.int64)); dist.all_reduce(xi, op=R.PRODUCT)
    np.testing.assert_array_equal(xi.numpy(), np.prod([inp(r, n, np.int64) for r in range(size)], axis=0))
    x32 = t(inp(rank, n, np.float32)); dist.all_reduce(x32)
    np.testing.assert_array_equal(x32.numpy(), total.astype(np.float32))
    xb = t(inp(rank, n, np.float32)).bfloat16(); dist.all_reduce(xb)
    np.testing.assert_array_equal(xb.float().numpy(), total.astype(np.float32))

    for root in {0, size - 1}:
        x = t(every[rank]); dist.broadcast(x, src=root)
        np.testing.assert_array_equal(x.numpy(), every[root])
        x = t(every[rank]); dist.reduce(x, dst=root)
        if rank == root:
            np.testing.assert_array_equal(x.numpy(), total)
        out = [torch.empty(n, dtype=torch.float64) for _ in range(size)] if rank == root else None
        dist.gather(t(every[rank]), out, dst=root)
        if rank == root:
            for r in range(size):
                np.testing.assert_array_equal(out[r].numpy(), every[r])
        parts = [t(inp(r, n, salt=root)) for r in range(size)] if rank == root else None
        y = torch.empty(n, dtype=torch.float64); dist.scatter(y, parts, src=root)
        np.testing.assert_array_equal(y.numpy(), inp(rank, n, salt=root))

    out = [torch.empty(n, dtype=torch.float64) for _ in range(size)]
    dist.all_gather(out, t(every[rank]))
    for r in range(size):
        np.testing.assert_array_equal(out[r].numpy(), every[r])
    flat = torch.empty(n * size, dtype=torch.float64)
    dist.all_gather_single(flat, t(every[rank]))
    np.testing.assert_array_equal(flat.numpy(), np.concatenate(every))

    # reduce_scatter: rank r's input has one block per destination (salt = destination)
    y = torch.empty(n, dtype=torch.float64)
    dist.reduce_scatter(y, [t(inp(rank, n, salt=d)) for d in range(size)])
    np.testing.assert_array_equal(y.numpy(), np.sum([inp(r, n, salt=rank) for r in range(size)], axis=0))
    y = torch.empty(n, dtype=torch.float64)
    dist.reduce_scatter_single(y, t(np.concatenate([inp(rank, n, salt=d) for d in range(size)])))
    np.testing.assert_array_equal(y.numpy(), np.sum([inp(r, n, salt=rank) for r in range(size)], axis=0))

    # all_to_all: block d of rank s goes to rank d; block = inp(s, n, salt=d)
    outs = [torch.empty(n, dtype=torch.float64) for _ in range(size)]
    dist.all_to_all(outs, [t(inp(rank, n, salt=d)) for d in range(size)])
    for s in range(size):
        np.testing.assert_array_equal(outs[s].numpy(), inp(s, n, salt=rank))
    o = torch.empty(n * size, dtype=torch.float64)
    dist.all_to_all_single(o, t(np.concatenate([inp(rank, n, salt=d) for d in range(size)])))
    np.testing.assert_array_equal(o.numpy(), np.concatenate([inp(s, n, salt=rank) for s in range(size)]))

    # point to point around the ring: each rank sends to the next node's rank and back
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    got = torch.empty(n, dtype=torch.float64)
    reqs = [dist.isend(t(every[rank]), nxt), dist.irecv(got, prv)]
    for q in reqs:
        q.wait()
    np.testing.assert_array_equal(got.numpy(), every[prv])
    dist.barrier()


def link_bytes() -> int:
    """Bytes through this node's eth0 so far, both ways (/proc/net/dev is per network namespace)."""
    for line in open("/proc/net/dev"):
        name, _, rest = line.partition(":")
        if name.strip() == "eth0":
            f = rest.split()
            return int(f[0]) + int(f[8])
    raise AssertionError("no eth0 in /proc/net/dev: not inside a virtual node")


def check_node_traffic_stays_in_the_node(hosts):
    """Large all_reduces inside each node (raw MPI and hpcddp) put nothing on the node's link."""
    topo = hpcddp.get_topology()
    groups = {h: dist.new_group([r for r in range(size) if hosts[r] == h]) for h in dict.fromkeys(hosts)}
    mine = groups[hosts[rank]]
    a = np.ones(1 << 18, dtype=np.float64)            # 2 MiB: hpcddp's large-message paths
    x = torch.ones(1 << 18, dtype=torch.float64)
    topo.node_comm.Allreduce(a.copy(), a); dist.all_reduce(x, group=mine)   # warm-up, set-up
    dist.barrier()
    before = link_bytes()
    for _ in range(4):
        topo.node_comm.Allreduce(a.copy(), a)
        dist.all_reduce(x, group=mine)
    topo.node_comm.Barrier()
    moved = link_bytes() - before
    assert moved < (1 << 20), f"{moved} bytes crossed {hosts[rank]}'s link during node-local all_reduces"
    np.testing.assert_array_equal(a, topo.local_size ** 5)
    np.testing.assert_array_equal(x.numpy(), topo.local_size ** 5)
    dist.barrier()


hosts = check_topology()
check_node_traffic_stays_in_the_node(hosts)
for n in (7, 1 << 18):
    check_collectives(n)
if os.environ.get("HPCDDP_HIER") == "force":   # the 2 MiB all_reduces above ran in two levels
    from hpcddp.collectives import paths
    state = [r["state"] for r in paths.table(hpcddp.world()) if r["path"] == "hierarchical"][0]
    assert state.startswith("open from"), state
    print(f"[rank{rank}] hierarchical all_reduce open", flush=True)
objs = [None] * size
dist.all_gather_object(objs, {"rank": rank, "host": hosts[rank]})
assert objs == [{"rank": r, "host": hosts[r]} for r in range(size)]
lst = [hosts] if rank == 0 else [None]
dist.broadcast_object_list(lst, src=0)
assert lst[0] == hosts
print(f"[rank{rank}] vcluster-collectives ok host={hosts[rank]} node={hpcddp.get_topology().node}",
      flush=True)
dist.destroy_process_group()
hpcddp.finalize()
