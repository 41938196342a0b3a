"""FSDP2 training steps across virtual nodes: hpcddp against gloo in one job (docs/benchmarks.md,
"FSDP2 across nodes").

    scripts/vcluster.sh up 2 --rate 1gbit
    scripts/vcluster.sh run node1 mpirun --allow-run-as-root --host node1:1,node2:1 -n 2 \
        --bind-to none --mca btl tcp,self,sm --mca btl_tcp_if_include eth0 \
        --mca oob_tcp_if_include eth0 python scripts/vcluster/fsdp_step.py [--model 10M]

The model is `hpcddp bench ddp`'s MLP (10M: 1024 -> 2048 x 3 -> 10, float32), each Linear and
the whole model `fully_shard`ed over the world: once on hpcddp's default group, once on a gloo
group of the same ranks (DeviceMesh.from_group), both from the same weights. Each step
all-gathers the parameters (forward, and again in backward: reshard after forward) and
reduce-scatters the gradients, then an SGD step (momentum 0.9) on the shards. Rounds alternate the two (and
the order), K steps each after one untimed step; prints one JSON line on rank 0: per backend
the median over rounds of the slowest rank's step time, steps/s, and the bound (the bytes
each rank's link carries per step, 3 (N-1)/N of the parameters, at --link-rate). The two
models must end with the same parameters up to the order of the sums (bit for bit on 2
ranks, where a sum of two has one order; checked to 1e-5 of the largest parameter).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import hpcddp
from hpcddp.bench.ddp import MODELS, build_model
from hpcddp.bench.vcluster import link_bytes_per_s

warnings.filterwarnings("ignore", category=FutureWarning)


def shard(model, group):
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="10M", choices=sorted(MODELS))
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per round and backend")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--link-rate", default="1gbit", help="the link's rate, for the bound")
    args = ap.parse_args()
    torch.set_num_threads(1)
    hpcddp.init(abort_on_exception=True)
    dist.init_process_group("hpcddp")
    rank, n = dist.get_rank(), dist.get_world_size()
    groups = {"hpcddp": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    base = build_model(args.model, 0)
    params = sum(p.numel() for p in base.parameters())
    models = {name: shard(copy.deepcopy(base), g) for name, g in groups.items()}
    opts = {name: torch.optim.SGD(m.parameters(), lr=1e-2, momentum=0.9)
            for name, m in models.items()}
    g = torch.Generator().manual_seed(rank + 1)
    x = torch.randn(args.batch, MODELS[args.model][0], generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    def step(name):
        opts[name].zero_grad()
        torch.nn.functional.cross_entropy(models[name](x), y).backward()
        opts[name].step()

    times = {name: [] for name in models}
    names = list(models)
    for r in range(args.rounds + 1):                 # round 0: warm-up, dropped
        for name in names[r % 2:] + names[:r % 2]:
            step(name)                               # untimed: the link busy, caches warm
            dist.barrier()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(name)
            took = torch.tensor([(time.perf_counter() - t) / args.steps])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if r:
                times[name].append(took.item())
    pairs = [(a.full_tensor(), b.full_tensor()) for a, b in
             zip(models["hpcddp"].parameters(), models["gloo"].parameters())]
    diff = max((a - b).abs().max().item() for a, b in pairs) / \
        max(b.abs().max().item() for _, b in pairs)
    bound_s = 3 * (n - 1) / n * params * 4 / link_bytes_per_s(args.link_rate)
    if rank == 0:
        med = {name: statistics.median(ts) for name, ts in times.items()}
        print(json.dumps({
            "model": args.model, "params": params, "ranks": n, "steps": args.steps,
            "rounds": args.rounds, "step_s": {k: [round(t, 5) for t in v] for k, v in times.items()},
            "steps_per_s": {k: round(1 / v, 3) for k, v in med.items()},
            "hpcddp_over_gloo": round(med["gloo"] / med["hpcddp"], 3),
            "bound_steps_per_s": round(1 / bound_s, 3),
            "over_bound": {k: round(bound_s / v, 3) for k, v in med.items()},
            "param_max_diff": diff}), flush=True)
    assert diff <= 1e-5 and (n > 2 or diff == 0), \
        f"hpcddp's and gloo's FSDP2 models ended {diff:.2e} apart (relative)"
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
