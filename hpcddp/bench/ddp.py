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

Across nodes with a known link rate (``--link-rate``, set by ``--vcluster ... --rate``), each
model also gets its bound: the larger of the compute-only step and the gradient bytes a ring
all-reduce moves over each node's link, 2(M-1)/M x the gradients for M nodes. Then the overlap
rows: an all_reduce of one bucket alone, a matmul loop of the same length alone, and both
(``async_op=True``, the compute, ``wait()``), over hpcddp and over gloo; overlap = (op +
compute - both) / min(op, compute): 1 when the op hid entirely behind the compute.
"""
from __future__ import annotations

import gc
import time

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
        ctx=None, link_bytes_per_s: float | None = None) -> dict | None:
    """Run the DDP benchmark; collective over the world. Returns the result on rank 0."""
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
        diff, spread_ranks, correct = _same_parameters(ctl, copies)   # outside timing
        correct_all &= correct
        if ctx.rank == 0:
            rows.append(_model_row(name, params, batch, k, both, diff, spread_ranks, correct))
            if progress:
                progress(f"{name} ({params / 1e6:.1f}M params) done")
        del trainers, copies, fns, base
        gc.collect()
    overlap = _overlap(ctx, max(4, int(bucket_mb * (1 << 20)) // 4 * 4), rounds)
    load = meter.stop()
    from hpcddp.collectives import _node  # what the node-local paths' races chose (setup)
    from hpcddp.comm import startup
    nodes = startup.runtime().topology.num_nodes
    if ctx.rank != 0:
        return None
    if link_bytes_per_s and nodes > 1:
        for row in rows:
            comm_s = 2 * (nodes - 1) / nodes * row["grad_bytes"] / link_bytes_per_s
            row["bound_steps_per_s"] = 1.0 / max(comm_s, 1.0 / row["stats"]["compute"]["steps_per_s"])
    result = {"kind": "hpcddp-bench-ddp", "version": 1, "setup": setup, "load": load,
              "node_paths": list(_node.decisions),
              "config": {"models": list(models), "batch_per_rank": batch, "rounds": rounds,
                         "discarded_rounds": 1, "bucket_cap_mb": bucket_mb, "seed": seed,
                         "optimizer": "SGD lr=0.01", "ranks": ctx.n,
                         "model_shapes": {m: MODELS[m] for m in models},
                         "nodes": nodes, "link_bytes_per_s": link_bytes_per_s},
              "models": rows, "overlap": overlap, "correct": correct_all}
    result["targets"] = targets(result)
    return result


def _same_parameters(ctl, copies) -> tuple:
    """Whether the hpcddp and gloo copies took the same steps, and every rank holds the same
    parameters -> (largest difference, spread of the ranks' checksums, correct)."""
    import torch

    from hpcddp.comm import MPI
    diff = max((a - b).abs().max().item() for a, b in
               zip(copies["hpcddp"].parameters(), copies["gloo"].parameters()))
    flat = torch.cat([p.detach().reshape(-1) for p in copies["hpcddp"].parameters()])
    csum = float(flat.double().sum())
    spread_ranks = ctl.allreduce(csum, op=MPI.MAX) - ctl.allreduce(csum, op=MPI.MIN)
    diff = ctl.allreduce(diff, op=MPI.MAX)
    scale = max(1.0, float(flat.abs().max()))
    return diff, spread_ranks, bool(diff <= 1e-4 * scale
                                    and abs(spread_ranks) <= 1e-6 * max(1.0, abs(csum)))


def _model_row(name, params, batch, k, both, diff, spread_ranks, correct) -> dict:
    """One model's row: each mode's step times (round 1 discarded) and the paired ratios."""
    from hpcddp.bench import protocol
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
    return {"model": name, "params": params, "grad_bytes": params * 4,
            "batch_per_rank": batch, "steps_per_round": k, "times_s": times,
            "stats": stats, "ratios": ratios, "max_param_diff": diff,
            "rank_checksum_spread": spread_ranks, "correct": correct}


def _overlap(ctx, nbytes: int, rounds: int) -> dict:
    """The overlap rows (module docstring): per backend, medians over rounds 2.. of the op,
    the compute, both, and how long the async call took to return (MAX over ranks)."""
    import numpy as np
    import torch
    import torch.distributed as dist

    from hpcddp.comm import MPI
    ctl = ctx.ctl
    t = torch.ones(nbytes // 4)
    a = torch.randn(256, 256)
    groups = {"hpcddp": None, "gloo": ctx.gloo}

    def compute(k: int) -> None:
        for _ in range(k):
            torch.mm(a, a)

    def timed(fn) -> float:
        ctl.Barrier()
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for g in groups.values():
        dist.all_reduce(t, group=g)
    per = timed(lambda: compute(20)) / 20
    # the compute's length: the op's, over hpcddp, the same k on every rank
    k = ctl.bcast(max(1, round(timed(lambda: dist.all_reduce(t)) / per)), root=0)
    local = np.zeros((rounds, len(groups), 4))
    for r in range(rounds):
        for j, (name, g) in enumerate(groups.items()):
            op = timed(lambda: dist.all_reduce(t, group=g))
            comp = timed(lambda: compute(k))
            ctl.Barrier()
            t0 = time.perf_counter()
            w = dist.all_reduce(t, group=g, async_op=True)
            ret = time.perf_counter() - t0
            compute(k)
            w.wait()
            local[r, j] = (op, comp, time.perf_counter() - t0, ret)
    both = np.empty_like(local)
    ctl.Allreduce(local, both, op=MPI.MAX)
    out = {"bytes": nbytes}
    for j, name in enumerate(groups):
        op, comp, whole, ret = (float(np.median(both[1:, j, i])) for i in range(4))
        out[name] = {"op_ms": op * 1e3, "compute_ms": comp * 1e3, "both_ms": whole * 1e3,
                     "returned_ms": ret * 1e3,
                     "overlap": (op + comp - whole) / min(op, comp)}
    return out


def _align(trainers) -> None:
    """Bring every mode to the same number of steps taken (calibration ran hpcddp only)."""
    target = trainers["hpcddp"].i
    for m in ("gloo", "compute"):
        while trainers[m].i < target:
            trainers[m].step()


def targets(result: dict) -> list[dict]:
    """On one node: the 10M model at >= 1.25x gloo's steps/s (shared memory against gloo's
    loopback TCP). Across nodes, where both share the link: the 10M and 50M models at >= 1.1x
    gloo and, where the link's rate gives a bound, >= 0.85x of it."""
    out = []
    across = (result.get("config", {}).get("nodes") or 1) > 1

    def add(m, name, ratio, value, limit):
        out.append({"target": name, "op": "ddp", "bytes": m["grad_bytes"], "ratio": ratio,
                    "value": value, "limit": limit, "ok": bool(value >= limit)})
    for m in result.get("models", []):
        v = m["ratios"]["hpcddp/gloo"]["median"]
        if not across and m["model"] == "10M":
            add(m, "DDP 10M: hpcddp steps/s ≥ 1.25× gloo", "hpcddp/gloo", v, 1.25)
        elif across and m["model"] in ("10M", "50M"):
            add(m, f"DDP {m['model']} across nodes: hpcddp steps/s ≥ 1.1× gloo", "hpcddp/gloo",
                v, 1.1)
            if "bound_steps_per_s" in m:
                add(m, f"DDP {m['model']} across nodes: hpcddp steps/s ≥ 0.85× the bound",
                    "hpcddp/bound", m["stats"]["hpcddp"]["steps_per_s"] / m["bound_steps_per_s"],
                    0.85)
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
    bound = any("bound_steps_per_s" in m for m in result.get("models", []))
    if bound:
        header[5:5] = ["bound steps/s", "hpcddp/bound", "gloo/bound"]
        for row, m in zip(rows, result["models"]):
            b = m["bound_steps_per_s"]
            row[5:5] = [_num(b), _num(m["stats"]["hpcddp"]["steps_per_s"] / b),
                        _num(m["stats"]["gloo"]["steps_per_s"] / b)]
    nodes = cfg.get("nodes") or 1
    title = (f"DDP training, {cfg.get('ranks')} ranks"
             f"{f' on {nodes} nodes' if nodes > 1 else ''}, MLP, SGD, bucket_cap_mb "
             f"{cfg.get('bucket_cap_mb')}: median steps/s over rounds (MAX over ranks); ratios: "
             f"median (quartiles) of per-round paired ratios; comm = step time − compute step")
    if bound:
        title += (f"; bound: max(compute step, 2(M-1)/M x gradients at "
                  f"{cfg['link_bytes_per_s'] / 1e6:.0f} MB/s per link)")
    text = _render(title, header, rows, markdown)
    ov = result.get("overlap")
    if ov:
        oh = ["backend", "all_reduce ms", "compute ms", "both ms", "async call returned ms",
              "overlap"]
        orows = [[name, _num(ov[name]["op_ms"]), _num(ov[name]["compute_ms"]),
                  _num(ov[name]["both_ms"]), _num(ov[name]["returned_ms"]),
                  _num(ov[name]["overlap"])] for name in ("hpcddp", "gloo") if name in ov]
        text += "\n\n" + _render(
            f"overlap: all_reduce of one bucket ({ov['bytes'] / (1 << 20):.0f} MiB) with "
            f"async_op=True beside compute of the same length; overlap = (op + compute - "
            f"both) / min(op, compute), medians over rounds", oh, orows, markdown)
    return text
