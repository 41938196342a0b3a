"""Correct point-to-point programs whose ranks wait seconds for each other: never reported.

With HPCDDP_TIMEOUT=600 the coordinator looks at every wait of 2 s or more (a rank tells it);
none of these waits may be called a deadlock or a send without a receiver:

- a chain: rank 0 waits for rank 1, which waits for rank 2, which computes 3 s, then sends;
- a thread: rank 1's main thread waits for rank 0, which waits for rank 1; a worker thread
  of rank 1 sends to rank 0 after 3 s, which unblocks both;
- a late rank in a ring of ``batch_isend_irecv``;
- a receive from any rank, the senders late.
"""
import threading
import time

import torch
import torch.distributed as dist

import hpcddp

hpcddp.init_process_group()
r, n = dist.get_rank(), dist.get_world_size()
t = torch.zeros(4)

if r == n - 1:                                   # the chain
    time.sleep(3.0)
    dist.send(t + 1, r - 1)
else:
    dist.recv(t, r + 1)
    if r > 0:
        dist.send(t, r - 1)

if r == 0:                                       # the thread
    dist.recv(t, 1)
    dist.send(t + 1, 1)
elif r == 1:
    worker = threading.Thread(target=lambda: (time.sleep(3.0), dist.send(t + 5, 0)))
    worker.start()
    dist.recv(t, 0)
    worker.join()

big = torch.full((1 << 18,), float(r))           # the ring, rank 1 late
if r == 1:
    time.sleep(3.0)
ops = [dist.P2POp(dist.isend, big.clone(), (r + 1) % n), dist.P2POp(dist.irecv, big, (r - 1) % n)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
assert big[0].item() == float((r - 1) % n), big[0]

if r == 0:                                       # any source
    for _ in range(n - 1):
        dist.recv(t)
else:
    time.sleep(2.5 * r)
    dist.send(t + r, 0)
print(f"[rank{r}] done", flush=True)
