"""``hpcddp bench ddp``: DDP training steps/s over hpcddp and over gloo, and compute-only.

For each model, three copies start from the same weights (one seed) and train on the same
synthetic batches (seeded per rank) with the same optimizer and DDP bucket size:

``hpcddp``   ``DistributedDataParallel(model, bucket_cap_mb=B)`` on the default (hpcddp) group
``gloo``     the same over ``dist.new_group(backend="gloo")``
``compute``  the bare model, no DDP and no communication: the ceiling a perfect
             communication layer would reach on this machine (every rank computes at once,
             so it also pays for the cores the ranks share)

A round runs N steps of each mode, in an order rotated every round; round 1 is dropped. A
step's time is the MAX over ranks; ratios are per-round paired. hpcddp and gloo take exactly
the same steps, so after the run their weights must agree (the 2-value sums are the same
floating-point additions): that is the correctness check.
"""
from __future__ import annotations

import gc

# name -> (input features, hidden width, hidden layers h->h). Parameters:
#   10M: 1024*2048 + 2*2048*2048 + 2048*10 (+ biases) = 10.5 M
#   50M: 1024*4096 + 3*4096*4096 + 4096*10 (+ biases) = 54.6 M
MODELS = {"tiny": (32, 64, 1), "10M": (1024, 2048, 2), "50M": (1024, 4096, 3)}
CLASSES = 10
MODES = ("hpcddp", "gloo", "compute")


def build_model(name: str, seed: int):
    import torch
    from torch import nn
    d_in, width, depth = MODELS[name]
    torch.manual_seed(seed)
    layers = [nn.Linear(d_in, width), nn.ReLU()]
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*layers)


def _batches(name: str, batch: int, seed: int, rank: int, count: int = 4):
    import torch
    g = torch.Generator().manual_seed(seed * 1000 + rank + 1)
    d_in = MODELS[name][0]
    return [(torch.randn(batch, d_in, generator=g),
             torch.randint(0, CLASSES, (batch,), generator=g)) for _ in range(count)]


class _Trainer:
    def __init__(self, model, data):
        import torch
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.01)
        self.data = data
        self.i = 0
        self.loss = torch.nn.functional.cross_entropy

    def step(self) -> None:
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.opt.zero_grad(set_to_none=True)
        self.loss(self.model(x), y).backward()
        self.opt.step()


def run(models=("10M", "50M"), batch: int = 32, steps: int | None = None, rounds: int = 5,
        bucket_mb: float = 25.0, seed: int = 0, round_s: float = 1.0, progress=None,
        ctx=None) -> dict | None:
    """Run the DDP benchmark; collective over the world. Returns the result on rank 0."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from hpcddp.bench import machine, protocol
    from hpcddp.bench.comm import Context
    from hpcddp.comm import MPI
    bad = [m for m in models if m not in MODELS]
    if bad:
        raise ValueError(f"bench ddp: unknown model(s) {bad}; valid: {', '.join(MODELS)}")
    if rounds < 2:
        raise ValueError(f"bench ddp: rounds must be >= 2 (round 1 is discarded), got {rounds}")
    ctx = ctx or Context(need_gloo=True)
    ctl = ctx.ctl
    setup = machine.describe(ctl, ctx.n)
    meter = machine.LoadMeter(ctl)
    meter.start()
    rows = []
    correct_all = True
    for name in models:
        base = build_model(name, seed)
        params = sum(p.numel() for p in base.parameters())
        data = _batches(name, batch, seed, ctx.rank)
        copies = {m: build_model(name, seed) for m in MODES}
        for m in copies.values():
            m.load_state_dict(base.state_dict())
        trainers = {
            "hpcddp": _Trainer(DDP(copies["hpcddp"], bucket_cap_mb=bucket_mb), data),
            "gloo": _Trainer(DDP(copies["gloo"], process_group=ctx.gloo,
                                 bucket_cap_mb=bucket_mb), data),
            "compute": _Trainer(copies["compute"], data),
        }
        fns = {m: trainers[m].step for m in MODES}
        # same k for every mode, so hpcddp and gloo take identical steps (the check below)
        if steps:
            k = steps
            for fn in fns.values():
                fn()
        else:
            k = max(protocol.calibrate(fns["hpcddp"], ctl, round_s, max_k=1000, warmup=1), 2)
            _align(trainers)
        import numpy as np
        local = np.zeros((rounds, len(MODES)))
        for r in range(rounds):
            order = MODES[r % 3:] + MODES[:r % 3]
            for m in order:
                local[r, MODES.index(m)] = protocol.time_batch(fns[m], k, ctl)
        both = np.empty_like(local)
        ctl.Allreduce(local, both, op=MPI.MAX)
        # correctness, outside timing
        diff = max((a - b).abs().max().item() for a, b in
                   zip(copies["hpcddp"].parameters(), copies["gloo"].parameters()))
        flat = torch.cat([p.detach().reshape(-1) for p in copies["hpcddp"].parameters()])
        csum = float(flat.double().sum())
        spread_ranks = ctl.allreduce(csum, op=MPI.MAX) - ctl.allreduce(csum, op=MPI.MIN)
        diff = ctl.allreduce(diff, op=MPI.MAX)
        scale = max(1.0, float(flat.abs().max()))
        correct = bool(diff <= 1e-4 * scale and abs(spread_ranks) <= 1e-6 * max(1.0, abs(csum)))
        correct_all &= correct
        if ctx.rank == 0:
            times = {m: both[:, i].tolist() for i, m in enumerate(MODES)}
            kept = {m: t[1:] for m, t in times.items()}
            stats = {m: {"step_ms": protocol.median(t) * 1e3,
                         "steps_per_s": 1.0 / protocol.median(t),
                         "q1_ms": protocol.quantile(t, 0.25) * 1e3,
                         "q3_ms": protocol.quantile(t, 0.75) * 1e3} for m, t in kept.items()}
            ratios = {"hpcddp/gloo": protocol.spread(protocol.paired(kept["gloo"], kept["hpcddp"])),
                      "hpcddp/compute": protocol.spread(
                          protocol.paired(kept["compute"], kept["hpcddp"])),
                      "gloo/compute": protocol.spread(
                          protocol.paired(kept["compute"], kept["gloo"])),
                      "hpcddp_comm_ms": protocol.spread(
                          [d * 1e3 for d in protocol.paired(kept["hpcddp"], kept["compute"],
                                                            "diff")]),
                      "gloo_comm_ms": protocol.spread(
                          [d * 1e3 for d in protocol.paired(kept["gloo"], kept["compute"],
                                                            "diff")])}
            rows.append({"model": name, "params": params, "grad_bytes": params * 4,
                         "batch_per_rank": batch, "steps_per_round": k, "times_s": times,
                         "stats": stats, "ratios": ratios, "max_param_diff": diff,
                         "rank_checksum_spread": spread_ranks, "correct": correct})
            if progress:
                progress(f"{name} ({params / 1e6:.1f}M params) done")
        del trainers, copies, fns, base
        gc.collect()
    load = meter.stop()
    from hpcddp.collectives import _node  # what the node-local paths' races chose (setup)
    if ctx.rank != 0:
        return None
    result = {"kind": "hpcddp-bench-ddp", "version": 1, "setup": setup, "load": load,
              "node_paths": list(_node.decisions),
              "config": {"models": list(models), "batch_per_rank": batch, "rounds": rounds,
                         "discarded_rounds": 1, "bucket_cap_mb": bucket_mb, "seed": seed,
                         "optimizer": "SGD lr=0.01", "ranks": ctx.n,
                         "model_shapes": {m: MODELS[m] for m in models}},
              "models": rows, "correct": correct_all}
    result["targets"] = targets(result)
    return result


def _align(trainers) -> None:
    """Bring every mode to the same number of steps taken (calibration ran hpcddp only)."""
    target = trainers["hpcddp"].i
    for m in ("gloo", "compute"):
        while trainers[m].i < target:
            trainers[m].step()


def targets(result: dict) -> list[dict]:
    out = []
    for m in result.get("models", []):
        if m["model"] == "10M":
            v = m["ratios"]["hpcddp/gloo"]["median"]
            out.append({"target": "DDP 10M: hpcddp steps/s ≥ 1.25× gloo", "op": "ddp",
                        "bytes": m["grad_bytes"], "ratio": "hpcddp/gloo", "value": v,
                        "limit": 1.25, "ok": bool(v >= 1.25)})
    return out


def table(result: dict, markdown: bool = False) -> str:
    from hpcddp.bench.report import _num, _render
    header = ["model", "params", "batch/rank", "compute steps/s", "hpcddp steps/s",
              "gloo steps/s", "hpcddp/gloo", "hpcddp/compute", "hpcddp comm ms/step",
              "gloo comm ms/step", "check"]
    rows = []
    for m in result.get("models", []):
        st, r = m["stats"], m["ratios"]

        def rat(key):
            x = r[key]
            return f"{_num(x['median'])} ({_num(x['q1'])}–{_num(x['q3'])})"
        rows.append([m["model"], f"{m['params'] / 1e6:.1f} M", str(m["batch_per_rank"]),
                     _num(st["compute"]["steps_per_s"]), _num(st["hpcddp"]["steps_per_s"]),
                     _num(st["gloo"]["steps_per_s"]), rat("hpcddp/gloo"),
                     rat("hpcddp/compute"), rat("hpcddp_comm_ms"), rat("gloo_comm_ms"),
                     "ok" if m["correct"] else f"WRONG (max diff {m['max_param_diff']:.3g})"])
    cfg = result.get("config", {})
    title = (f"DDP training, {cfg.get('ranks')} ranks, MLP, SGD, bucket_cap_mb "
             f"{cfg.get('bucket_cap_mb')}: median steps/s over rounds (MAX over ranks); ratios: "
             f"median (quartiles) of per-round paired ratios; comm = step time − compute step")
    return _render(title, header, rows, markdown)
