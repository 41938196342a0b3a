"""Both ranks recv first: a point-to-point deadlock the stall report must call one.

argv[1]: ``torch`` (dist.recv) or ``direct`` (hpcddp.recv after a few matched exchanges,
so the recv runs from a plan), or ``loader`` (dist.recv while a DataLoader with two workers
and a tqdm progress bar are open, as in a training loop: their threads never send).
"""
import sys
import time

import torch
import torch.distributed as dist

import hpcddp

hpcddp.init_process_group()
r = dist.get_rank()
t = torch.zeros(4)
if sys.argv[1] == "direct":
    for _ in range(3):
        if r == 0:
            hpcddp.send(t, 1)
            hpcddp.recv(t, 1)
        else:
            hpcddp.recv(t, 0)
            hpcddp.send(t, 0)
if sys.argv[1] == "loader":
    from tqdm import tqdm
    data = torch.utils.data.TensorDataset(torch.arange(64.0))
    batches = iter(torch.utils.data.DataLoader(data, batch_size=4, num_workers=2))
    bar = tqdm(total=16, desc=f"rank {r}")
    bar.update(next(batches)[0].numel() // 4)
print(f"[rank{r}] stall point {time.time():.3f}", flush=True)
(hpcddp.recv if sys.argv[1] == "direct" else dist.recv)(t, 1 - r)
