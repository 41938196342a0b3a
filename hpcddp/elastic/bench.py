"""What elastic mode costs a healthy run: plain DDP against hpcddp.elastic, in one job.

Run under a fault-tolerant launch (every rank; docs/elastic.md)::

    mpirun --with-ft ulfm -n 2 python -m hpcddp.elastic.bench [--steps 200] [--rounds 5]

Both loops train the same MLP on the same in-memory data with the same global batch; rounds
alternate (plain, elastic, plain, ...) so that a machine's slow phases hit both. Rank 0
prints steps/s per round and the median ratio. Both run under ULFM: what is measured is
the cost of the elastic loop (State, ElasticBatchSampler, step commits, the epoch-end
agreement), not of ULFM's failure detector, which runs for the whole job either way.

With ``--regrow-kill RANK@STEP`` it runs one elastic job instead, with grow-back on: RANK
SIGKILLs itself at STEP, a replacement is spawned, and the lowest rank that saw it all prints
steps/s before the loss and after the job is back at full size (same job, same model)::

    mpirun --with-ft ulfm --oversubscribe -n 4 python -m hpcddp.elastic.bench --regrow-kill 2@100
"""
from __future__ import annotations

import argparse
import statistics
import time


def _data(n, width):
    import torch
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=g)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long())


def _model(width):
    import torch
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 512), torch.nn.ReLU(),
                               torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 2))


def _loop_overhead(w, rounds: int) -> None:
    """The elastic loop's own cost per step: both loops with no model work (an optimizer
    step over one zero-lr parameter), fastest round of each (the least disturbed)."""
    import torch

    from hpcddp import elastic
    n, b = 32000, 64
    ds = torch.utils.data.TensorDataset(torch.randn(n, 4), torch.zeros(n))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sampler = elastic.ElasticBatchSampler(n, b)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
    state = elastic.State(model, opt, sampler, verbose=False)
    plain = torch.utils.data.DataLoader(
        ds, batch_size=b // w.size, drop_last=True,
        sampler=torch.utils.data.DistributedSampler(ds, w.size, w.rank, drop_last=True))

    def plain_loop():
        t = time.perf_counter()
        for _ in plain:
            opt.step()
        return (time.perf_counter() - t) / len(plain)

    def elastic_loop():
        t = time.perf_counter()
        for _ in state.epochs(state.epoch + 1):
            for _ in state.batches(loader):
                with state.step():
                    opt.step()
        return (time.perf_counter() - t) / sampler.steps_per_epoch
    best = [min(x) for x in zip(*[(plain_loop(), elastic_loop()) for _ in range(rounds)])]
    if w.rank == 0:
        print(f"[rank0] loop alone, fastest of {rounds} rounds: plain {best[0] * 1e6:.1f} us "
              f"per step, elastic {best[1] * 1e6:.1f} us per step (+{(best[1] - best[0]) * 1e6:.1f} "
              f"us)", flush=True)


def _elastic_epoch(state, loader, opt, done: dict | None = None) -> None:
    """One epoch of the elastic loop; DONE (if given) gets each committed step's end time."""
    import torch.nn.functional as F
    for _ in state.epochs(state.epoch + 1):
        for x, y in state.batches(loader):
            with state.step():
                loss = F.cross_entropy(state.model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if done is not None:
                done[state.global_step] = time.perf_counter()


def _regrow_run(args) -> int:
    """One elastic job that loses a rank and grows back: steps/s before and after."""
    import torch

    import hpcddp
    from hpcddp import elastic
    torch.set_num_threads(1)
    hpcddp.init()
    hpcddp.init_process_group()      # nothing collective before State: a replacement joins there
    width, warm = 256, 10
    ds = _data(args.steps * args.batch, width)
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = elastic.ElasticBatchSampler(len(ds), args.batch)
    loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
    rank, step = (int(v) for v in args.regrow_kill.split("@"))
    state = elastic.State(model, opt, sampler, regrow=True,
                          fault_injection=f"{rank}@{step}:backward")
    done = {}                        # global step -> the time it completed
    _elastic_epoch(state, loader, opt, done)
    if state.reporting:
        rec = state.recoveries[0]

        def rate(a, b):            # steps/s from step a's end to step b's
            return (b - a) / (done[b] - done[a])
        before = rate(warm, step - 1)
        after = rate(rec.step + warm, state.global_step)
        print(f"[rank{state.original_rank}] {state.size} ranks, {args.batch} samples per step: "
              f"before the loss {before:.1f} steps/s (steps {warm}-{step - 1}), after growing "
              f"back {after:.1f} steps/s (steps {rec.step + warm}-{state.global_step}): "
              f"after/before {after / before:.3f}; failure seen -> full size "
              f"{rec.detect_to_full_size_s:.2f} s", flush=True)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpcddp.elastic.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="steps per round (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=5, help="rounds of each (default: %(default)s)")
    p.add_argument("--batch", type=int, default=64, help="global batch (default: %(default)s)")
    p.add_argument("--regrow-kill", metavar="RANK@STEP", default=None,
                   help="instead: one job with grow-back, RANK killed at STEP (< --steps); "
                        "steps/s before the loss and after the job is whole again")
    args = p.parse_args(argv)
    if args.regrow_kill:
        return _regrow_run(args)
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpcddp
    from hpcddp import elastic
    torch.set_num_threads(1)
    hpcddp.init()
    hpcddp.init_process_group()
    w = hpcddp.world()
    width = 256
    ds = _data(args.steps * args.batch, width)
    local = args.batch // w.size

    def plain():
        model = _model(width)
        ddp = DDP(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        s = torch.utils.data.DistributedSampler(ds, w.size, w.rank, shuffle=True, drop_last=True)
        loader = torch.utils.data.DataLoader(ds, batch_size=local, sampler=s, drop_last=True)
        w.mpi.Barrier()
        t = time.perf_counter()
        for x, y in loader:
            loss = F.cross_entropy(ddp(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        w.mpi.Barrier()
        return len(loader) / (time.perf_counter() - t)

    def elastic_loop():
        model = _model(width)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = elastic.ElasticBatchSampler(len(ds), args.batch)
        loader = torch.utils.data.DataLoader(ds, batch_sampler=sampler)
        state = elastic.State(model, opt, sampler, verbose=False)
        w.mpi.Barrier()
        t = time.perf_counter()
        _elastic_epoch(state, loader, opt)
        w.mpi.Barrier()
        return sampler.steps_per_epoch / (time.perf_counter() - t)

    plain()        # warm-up: first DDP construction, allocator
    rows = []
    for r in range(args.rounds):
        a, b = plain(), elastic_loop()
        rows.append((a, b))
        if w.rank == 0:
            print(f"[rank0] round {r + 1}: plain {a:7.1f} steps/s  elastic {b:7.1f} steps/s  "
                  f"ratio {b / a:.3f}", flush=True)
    if w.rank == 0:
        ratio = statistics.median(b / a for a, b in rows)
        print(f"[rank0] {w.size} ranks, {args.steps} steps of {args.batch} per round, "
              f"{args.rounds} rounds: elastic/plain steps/s median {ratio:.3f} "
              f"(cost {100 * (1 - ratio):+.1f}%)", flush=True)
    _loop_overhead(w, args.rounds)
    import torch.distributed as dist
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
