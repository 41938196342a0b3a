"""Run on the virtual cluster (tests/test_vcluster_faults.py): elastic DDP training that a
network fault should not stop, under `hpcddp launch -- mpirun --with-ft ulfm`.

argv: OUTDIR EPOCHS [HIDDEN]. An MLP (HIDDEN units, default 64; 16384 makes a 2.4 MB gradient
bucket, which the ring path takes across nodes), 480 samples, global batch 24 (20 steps an epoch), a pause
per step so that the run outlasts the fault's detection; once the world has recovered (and, where
a lost rank is to be replaced, grown back) the rest runs without it, so that the test does not
wait for a minute of sleeps after what it checks. Rank 0 prints "[rank0] looping"
after 20 steps: the test then injects its fault. Every survivor writes OUTDIR/final.<start-up
rank>.json at the end: the world it ended in, its host, the steps, the ranks lost and the
parameters' bytes (hex).
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

import torch
import torch.nn.functional as F

import hpcddp
import hpcddp.elastic as elastic


def _rings_on_links() -> int:
    """How many of this process's groups ran the ring path over TCP links."""
    import gc
    from hpcddp.comm import links
    from hpcddp.comm.communicator import Communicator
    rings = [c._attached.get("ring") for c in gc.get_objects() if isinstance(c, Communicator)]
    return sum(isinstance(getattr(r, "via", None), links.Links) for r in rings)


def main():
    out, epochs = sys.argv[1], int(sys.argv[2])
    hidden = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    torch.set_num_threads(1)
    hpcddp.init()
    hpcddp.init_process_group()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(480, 16, generator=g, dtype=torch.float64)
    ds = torch.utils.data.TensorDataset(x, (x[:, :4].sum(1) > 0).long())
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.ReLU(),
                                torch.nn.Linear(hidden, 2)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sampler = elastic.ElasticBatchSampler(len(ds), 24, seed=3)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
    state = elastic.State(model, opt, sampler)
    # a replacement joins at the survivors' size: its own start is the full size
    full = state.size

    def waiting_for_the_fault() -> bool:    # every rank agrees: generation and size are shared
        return state.generation == 0 or (state.regrow and state.size < full)

    for _ in state.epochs(epochs):
        for xb, yb in state.batches(loader):
            with state.step():
                loss = F.cross_entropy(state.model(xb), yb)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if waiting_for_the_fault():
                time.sleep(0.05)
            if state.global_step == 20 and state.rank == 0:
                print("[rank0] looping", flush=True)
    blob = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    with open(os.path.join(out, f"final.{state.original_rank}.json"), "w") as f:
        json.dump({"rank": state.original_rank, "size": state.size, "host": socket.gethostname(),
                   "global_step": state.global_step, "params": blob.hex(),
                   "lost": [r.lost for r in state.recoveries],
                   "ring_links": _rings_on_links()}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
