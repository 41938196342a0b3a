"""An elastic DDP job for tests/test_elastic.py: a small MLP on a synthetic data set.

argv: OUTDIR [EPOCHS] [GLOBAL_BATCH] [WORKERS]. Kills come from HPCDDP_ELASTIC_KILL;
EL_PAUSE=RANK@STEP:SECONDS has that rank hold the GIL, in C and without an MPI call, for
SECONDS before that step (a long h5py read, as the heartbeat detector meets it). Every
rank appends each committed step's sample indices to OUTDIR/trained.<rank> as it goes (a
killed rank's file keeps what it committed before dying); survivors write
OUTDIR/final.<rank>.json: the parameters' bytes (hex), where training stopped, the
recoveries, and the survivors' world.
"""
import ctypes
import json
import os
import sys

import torch
import torch.nn.functional as F

import hpcddp
import hpcddp.elastic as elastic
from hpcddp.comm import heartbeat, spares


class Indexed(torch.utils.data.Dataset):
    def __init__(self, n):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 16, generator=g, dtype=torch.float64)
        self.y = (self.x[:, :4].sum(1) > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i], i


def main():
    out = sys.argv[1]
    epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 24
    workers = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    torch.set_num_threads(1)
    hpcddp.init(abort_on_exception=os.environ.get("EL_ABORT", "1") == "1")
    hpcddp.init_process_group()
    ds = Indexed(240)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, 0.9)
    sampler = elastic.ElasticBatchSampler(len(ds), batch, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler, num_workers=workers)
    # bucket_cap_mb small: several gradient buckets, so a kill lands inside the reduction
    state = elastic.State(model, opt, sampler, scheduler=sched,
                          ddp_kwargs={"bucket_cap_mb": 0.01}, topology_groups=True)
    me = state.original_rank
    pause = os.environ.get("EL_PAUSE", "")
    pause_rank, pause_step, pause_s = (
        (int(pause.split("@")[0]), *map(int, pause.split("@")[1].split(":"))) if pause
        else (-1, -1, 0))
    log = open(os.path.join(out, f"trained.{me}"), "a")
    for epoch in state.epochs(epochs):
        for x, y, idx in state.batches(loader):
            if me == pause_rank and state.global_step == pause_step:
                print(f"[rank{me}] holding the GIL for {pause_s} s", flush=True)
                ctypes.PyDLL(None).sleep(pause_s)   # a PyDLL call keeps the GIL
            gen = state.generation          # which world this attempt runs on
            log.write(json.dumps(["attempt", epoch, state.global_step, gen, idx.tolist()]) + "\n")
            log.flush()
            with state.step():
                loss = F.cross_entropy(state.model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                log.write(json.dumps(["commit", epoch, state.global_step, gen]) + "\n")
                log.flush()
                sched.step()
    # topology groups were rebuilt: a collective over the node group must work
    g = state.groups["node"]
    t = torch.ones(1)
    torch.distributed.all_reduce(t, group=g)
    blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    with open(os.path.join(out, f"final.{me}.json"), "w") as f:
        json.dump({"rank": me, "size": state.size, "global_step": state.global_step,
                   "params": blob.hex(), "node_group_size": int(t.item()),
                   "num_nodes": hpcddp.get_topology().num_nodes,
                   "heartbeat_pump": heartbeat.running(),
                   # the GPU this process would take (a spare: never a node-mate's)
                   "device_index": (spares.node_index() if elastic.is_replacement()
                                    else hpcddp.get_topology().local_rank),
                   "recoveries": [{k: v for k, v in r.__dict__.items() if k != "cause"}
                                  for r in state.recoveries]}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
