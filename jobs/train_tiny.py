"""A tiny DDP training script for the job templates: seconds per run, checkpoints, resumable.

Run it under any launcher, directly or through ``hpcddp run`` (which initialises hpcddp and
turns abort-on-exception on)::

    srun --mpi=pmix hpcddp run jobs/train_tiny.py --steps 50 --ckpt-dir ckpt/
    mpirun -n 2 python jobs/train_tiny.py --backend gloo

It fits y = x·w on synthetic data with DistributedDataParallel over the chosen backend
(``hpcddp``: torch.distributed over MPI; ``gloo``: torch's own, bootstrapped through MPI by
``hpcddp.init_process_group``). With ``--ckpt-dir`` it resumes from the newest checkpoint and
saves one when Slurm signals (USR1 before the time limit, TERM on preemption or requeue), then
exits 0 so the job script can requeue. Replace it with your own script: the pattern to copy is
in ``main()``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20, help="training steps in total (default 20)")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds per step, so a test can signal a job mid-run")
    p.add_argument("--backend", default="auto",
                   help="torch.distributed backend: auto (default: hpcddp; with CUDA, NCCL for "
                        "CUDA tensors and hpcddp for the rest), hpcddp, gloo, or a device map")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="where the model trains (auto: this rank's GPU when CUDA is there)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (a sweep varies it)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--ckpt-dir", default=os.environ.get("CKPT_DIR", ""),
                   help="checkpoint directory on a shared filesystem (default $CKPT_DIR; "
                        "empty: no checkpoints)")
    p.add_argument("--ckpt-every", type=int, default=0, help="also save every N steps")
    p.add_argument("--data", default="",
                   help="a (staged) data directory: every rank reads all its files and reports "
                        "the bytes, proving the staging step put them on this node")
    p.add_argument("--out", default="",
                   help="rank 0 writes a JSON summary here ($VARIABLES are expanded, e.g. "
                        "$SLURM_ARRAY_TASK_ID)")
    p.add_argument("--fail-at-step", type=int, default=-1,
                   help="raise an exception at this step on the last rank (tests abort paths)")
    return p.parse_args(argv)


def log(rank: int, msg: str) -> None:
    print(f"[rank{rank}] {msg}", flush=True)


def read_data(path: str) -> tuple[int, int]:
    """(files, bytes) under PATH: a staged data set must be complete on every node."""
    files = total = 0
    for root, _dirs, names in os.walk(path):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                total += len(f.read())
            files += 1
    return files, total


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpcddp
    from hpcddp.parallel.checkpoint import Checkpointer

    torch.set_num_threads(1)  # tiny model; ranks share a few cores
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    # MPI-bootstrapped store: no MASTER_ADDR/MASTER_PORT under mpirun or srun. hpcddp.init
    # (inside) picks this rank's GPU by local rank.
    if args.backend == "auto":
        hpcddp.init_process_group(device="cuda" if use_cuda else None)
    else:
        hpcddp.init_process_group(args.backend)
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    rank, world = dist.get_rank(), dist.get_world_size()
    host = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    log(rank, f"world {world} on {host} backend {dist.get_backend()} device {device} "
              f"restart {os.environ.get('SLURM_RESTART_COUNT', '0')}")

    data_files = data_bytes = None
    if args.data:
        data_files, data_bytes = read_data(args.data)
        log(rank, f"data {args.data}: {data_files} files, {data_bytes} bytes")
        if data_files == 0:
            raise FileNotFoundError(f"train_tiny: --data {args.data} has no files on {host}")

    torch.manual_seed(0)
    true_w = torch.arange(1.0, 9.0, device=device).unsqueeze(1)
    model = DDP(torch.nn.Linear(8, 1, bias=False).to(device),
                device_ids=[device.index] if use_cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)

    ckpt = Checkpointer(args.ckpt_dir) if args.ckpt_dir else None
    start = 0
    resumed_from = None
    if ckpt:
        found = ckpt.load_latest()
        if found:
            model.module.load_state_dict(found.state["model"])
            opt.load_state_dict(found.state["opt"])
            start = resumed_from = found.step + 1

    gen = torch.Generator()
    loss = torch.tensor(float("nan"))
    for step in range(start, args.steps):
        if step == args.fail_at_step and rank == world - 1:
            raise RuntimeError(f"train_tiny: failing on purpose at step {step} (--fail-at-step)")
        # Each step's batch depends only on (rank, step): a resumed run sees the same data as
        # an uninterrupted one, so its result is the same.
        gen.manual_seed(1_000_003 * rank + step)
        x = torch.randn(args.batch, 8, generator=gen).to(device)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if args.step_time:
            time.sleep(args.step_time)
        if rank == 0 and step % 10 == 0:
            log(rank, f"step {step} loss {loss.item():.4g}")
        if ckpt and ckpt.should_save(step, every=args.ckpt_every):
            ckpt.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, step)
            if ckpt.preempted:
                log(rank, f"preempted at step {step}: checkpoint saved, exiting for requeue")
                dist.destroy_process_group()
                return 0

    # Replicas must agree after DDP; the check costs one small all-reduce.
    w = model.module.weight.detach().clone()
    w_sum = w.clone()
    dist.all_reduce(w_sum)
    assert torch.allclose(w_sum, w * world), "train_tiny: replicas diverged"
    if ckpt:
        ckpt.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, args.steps - 1)
    summary = {"world_size": world, "steps": args.steps, "resumed_from": resumed_from,
               "device": str(device),
               "loss": loss.item(), "lr": args.lr, "backend": str(dist.get_backend()),
               "hosts": None, "data_files": data_files, "data_bytes": data_bytes,
               "restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
               "weight": w.flatten().cpu().tolist()}
    hosts = [None] * world
    dist.all_gather_object(hosts, host)
    summary["hosts"] = sorted(set(hosts))
    if rank == 0:
        log(rank, f"done: {args.steps} steps, loss {loss.item():.4g}, nodes {summary['hosts']}")
        if args.out:
            out = os.path.expandvars(args.out)
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out + ".tmp", "w") as f:
                json.dump(summary, f)
            os.replace(out + ".tmp", out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
