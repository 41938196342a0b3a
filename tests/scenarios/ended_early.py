"""A rank whose script ends (normally: no exception, exit code 0) while the others wait.

``skip``: the last rank leaves the loop before all_reduce #6 (a wrong early exit) and ends
its script; the others wait in all_reduce #6 for ever. The report must come at once, naming
the rank as ended without calling it, not after HPCDDP_TIMEOUT.

``clean``: no false alarm for ranks that end at different times. Rank 0 is the root of the
last broadcast and ends at once while the others are still computing before they call it;
ranks 1 and 2 then run an all_reduce on a group without rank 0, rank 1 waiting 4 s in it for
rank 2; every rank ends. Exit code 0, no report.

``recv``: the last rank ends without the send that rank 1 waits for in ``recv``; ``send``:
rank 1 waits in a large ``send`` (MPI's rendezvous: it waits for the receive) to the last
rank, which ended without receiving. Both must be reported at once, naming the ended rank.

``p2p_clean``: no false alarm for point-to-point with ranks that end first. Rank 0 sends a
small tensor to rank 1 and ends at once; the last rank starts a large ``isend`` to rank 1 and
ends without waiting for it; rank 1 receives both 3 s later (the second from any source).
Exit code 0, no report.
"""
import sys
import time

import torch
import torch.distributed as dist

import hpcddp

hpcddp.init_process_group()
rank, size = dist.get_rank(), dist.get_world_size()
mode = sys.argv[1]
t = torch.ones(256)

if mode == "skip":
    for step in range(1, 10):
        if step == 6 and rank == size - 1:
            print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
            break                       # the bug: this rank stops early, without an error
        dist.all_reduce(t)
elif mode == "clean":
    dist.all_reduce(t)
    others = dist.new_group([1, 2])     # every rank creates it
    if rank != 0:
        time.sleep(3.0)                 # rank 0 has ended by now
    dist.broadcast(t, src=0)
    if rank == 2:
        time.sleep(4.0)                 # rank 1 waits in the group's all_reduce meanwhile
    if rank in (1, 2):
        dist.all_reduce(t, group=others)
        time.sleep(2.0)                 # still computing after rank 0's looks
elif mode in ("recv", "send"):
    dist.all_reduce(t)
    big = torch.ones(1 << 21)           # 8 MiB: a send MPI completes only once it is received
    if rank == 1:
        print(f"[rank{rank}] stall point {time.time():.3f}", flush=True)
        if mode == "recv":
            dist.recv(t, src=size - 1)  # the last rank never sends it
        else:
            dist.send(big, dst=size - 1)    # the last rank never receives it
elif mode == "p2p_clean":
    dist.all_reduce(t)
    big = torch.full((1 << 21,), 2.0)
    if rank == 0:
        dist.send(torch.full_like(t, 7.0), dst=1)  # small: complete at once; then this rank ends
    elif rank == size - 1:
        work = dist.isend(big, dst=1)   # in flight as this rank's script ends
    elif rank == 1:
        time.sleep(3.0)                 # both senders have ended by now
        dist.recv(t, src=0)
        dist.recv(big)                  # any source
        assert t[0].item() == 7.0 and big[-1].item() == 2.0, (t[0], big[-1])
print(f"[rank{rank}] done {t[0].item():g}", flush=True)
