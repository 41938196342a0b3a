"""Print this rank's topology as one JSON line (used by tests/test_comm_jobs.py)."""
import json

import hpcddp

rt = hpcddp.init()
t = rt.topology
g = t.node_groups(2)
cross = t.cross_comm.allgather(rt.world.rank)
leaders = t.leader_comm.allgather(rt.world.rank) if t.leader_comm is not None else None
print(json.dumps({"rank": rt.world.rank, "node": t.node, "nodes": t.num_nodes,
                  "local_rank": t.local_rank, "local_size": t.local_size, "cross": cross,
                  "leaders": leaders, "group_rank": g.group_rank, "group_size": g.group_size,
                  "group_ws": g.group_ws, "local_group_rank": g.local_group_rank,
                  "group_rank_base": g.group_rank_base, "group_nodes": g.nodes}), flush=True)
