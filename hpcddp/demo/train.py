"""The demo job: write the digits as PNG files, pack, stage, train with DDP over MPI, evaluate.

Every rank runs :func:`run_job`; rank 0 prints the progress (``[rank0] ...``). Start it with
``hpcddp demo`` (which starts ``mpirun -n 2`` itself), or under any launcher::

    mpirun -n 4 hpcddp demo --epochs 12
    srun --mpi=pmix python -m hpcddp.demo.train --workdir $SCRATCH/demo

Phases, each timed (wall seconds on rank 0, between barriers, so a phase's time is the time of
its slowest rank):

1. data:  rank 0 writes scikit-learn's digits as PNG files in class folders (train/, test/).
2. pack:  rank 0 packs each split into a sharded LMDB (or HDF5) data set (``hpcddp.data.pack``).
3. stage: every node gets its copy in node-local storage, the shared filesystem read once
   (scatter over node leaders, then broadcast within each node; ``hpcddp.data.stage``).
4. train: DDP over the chosen backend; ``hpcddp.data.DistributedSampler`` (torch's order),
   a DataLoader with worker processes reading the staged LMDB, checkpoints from rank 0.
5. evaluate: the held-out split with ``DistributedEvalSampler`` (no padding: every sample
   once) and ``MetricSums`` (sums and counts reduced once): the exact accuracy.

Why 1 rank and N ranks give the same parameters (tests/test_demo.py): the global batch B is
split evenly (B/N per rank); the sampler deals one permutation of seed + epoch round-robin,
so the N local batches of a step are together exactly the 1-rank batch of that step; the loss
is a mean over the local batch and DDP averages gradients over ranks, so the gradient is the
mean over the global batch; ``drop_last`` in sampler and loader keeps the same samples and step
count at every N; the model has no dropout or batch norm. What remains is floating-point
summation order: ~1e-6 apart in float32 after an epoch, ~1e-13 in float64.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hpcddp.demo.config import DemoConfig, add_arguments, from_args

# pixel statistics of the digits (0..1 scale), fixed so every rank normalises alike
MEAN, STD = 0.3, 0.4


def decode_png(data: bytes):
    """PNG bytes -> normalised float32 tensor [1, 8, 8]. Runs in DataLoader workers."""
    import io

    import numpy as np
    import torch
    from PIL import Image
    with Image.open(io.BytesIO(data)) as im:
        arr = np.asarray(im, dtype=np.float32)
    return torch.from_numpy((arr / 255.0 - MEAN) / STD).unsqueeze(0)


def _idle_barrier(comm, poll_s: float = 0.002) -> None:
    """A barrier that sleeps instead of spinning (MPI's blocking barrier busy-polls a core).

    While rank 0 alone writes and packs, the other ranks wait here; spinning would take the
    cores it needs (measured: writing the PNGs took 2x longer beside a spinning barrier).
    """
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll_s)


def _process_age() -> float | None:
    """Seconds since this process started (Linux /proc), or None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class _Phases:
    """Wall time per phase, measured between barriers (rank 0's clock): a phase lasts as long
    as its slowest rank."""

    def __init__(self, comm, joining: bool = False):
        self.comm = comm
        # a replacement rank (elastic --regrow) joins in the middle of training: the barriers
        # before that point were passed before it existed
        self.joining = joining
        self.times: dict[str, float] = {}
        self._name = None
        self._t0 = 0.0

    def start(self, name: str) -> None:
        if not self.joining:
            _idle_barrier(self.comm)
        self._name, self._t0 = name, time.perf_counter()

    def stop(self) -> float:
        if not self.joining:
            _idle_barrier(self.comm)
        dt = time.perf_counter() - self._t0
        self.times[self._name] = dt
        return dt


def run_job(cfg: DemoConfig) -> dict:
    """The whole pipeline; every rank calls it. Returns the results (the same on every rank)."""
    import torch
    import torch.distributed as dist

    import hpcddp
    from hpcddp import data as hdata

    t_job = time.perf_counter()
    age = _process_age()  # python start-up and imports (torch: seconds on a busy machine)
    rt = hpcddp.init(abort_on_exception=True)
    world = rt.world
    comm = world.mpi
    rank, size = world.rank, world.size
    topo = rt.topology

    def say(*parts):
        if hpcddp.world().rank == 0:    # the lowest survivor once elastic mode lost rank 0
            hpcddp.rank_print(*parts)

    torch.set_num_threads(1)  # ranks share the cores; more threads per rank only contend
    global_batch = cfg.global_batch(size)
    workdir = os.path.abspath(cfg.workdir)
    digits_dir = os.path.join(workdir, "digits")
    packed = {s: os.path.join(workdir, "packed", s) for s in ("train", "test")}

    say(f"hpcddp demo: {size} rank(s) on {topo.num_nodes} node(s)"
        f"{' (emulated: HPCDDP_RANKS_PER_NODE=%d)' % topo.local_size if topo.emulated else ''}, "
        f"backend {cfg.backend}, {cfg.format}, {cfg.epochs} epochs, global batch {global_batch} "
        f"({global_batch // size} per rank), {cfg.workers} loader worker(s) per rank")
    # a replacement for a lost rank (--elastic --regrow) joins the job inside elastic.State:
    # until then it makes no collective call (the others are training)
    replacement = rt.joined is not None
    phases = _Phases(comm, joining=replacement)
    ages = [age] if replacement else comm.allgather(age)
    if all(a is not None for a in ages):
        phases.times["launch"] = max(ages)  # process start -> here, slowest rank

    if replacement:
        staged = _staged_for_replacement(cfg, topo, packed)
    elif cfg.staged:
        # a job step staged the data already (jobs/slurm/demo.sbatch): find this node's copy
        base = hdata.resolve_dest(cfg.staged, topo.node, topo.hostname)
        staged = {s: os.path.join(base, s) for s in ("train", "test")}
        say(f"[stage] using the copy staged on each node: {base} (rank 0's node)")
    else:
        staged = _prepare(cfg, phases, say, rank, topo, digits_dir, packed)

    # 4. train
    run = _setup_training(cfg, phases, staged, workdir, global_batch)
    say(f"[train] {len(run.train_ds)} samples, {run.steps_per_epoch} steps of {global_batch} per "
        f"epoch, DDP over {dist.get_backend()} on {dist.get_world_size()} rank(s)")
    trained, preempted, train_s = _train(cfg, run, phases, say, global_batch)
    elastic_info = None
    if run.state is not None:
        elastic_info, lines = _elastic_report(run.state, size)
        for line in lines:
            say(line)
    # 5. evaluate
    metrics, evaluated, eval_s = _evaluate(cfg, run, phases)
    if cfg.save_params and hpcddp.world().rank == 0:
        _save_atomic({k: v.detach().clone() for k, v in run.model.state_dict().items()},
                     cfg.save_params)
    total_s = time.perf_counter() - t_job + phases.times.get("launch", 0.0)
    results = {
        "accuracy": metrics["accuracy"], "test_loss": metrics["loss"],
        "test_samples": evaluated, "train_samples": len(run.train_ds),
        "world_size": hpcddp.world().size, "nodes": topo.num_nodes, "backend": cfg.backend,
        "format": cfg.format, "epochs": cfg.epochs, "global_batch": global_batch,
        "dtype": cfg.dtype, "preempted": preempted,
        "elastic": elastic_info,
        "phases_s": dict(phases.times, total=total_s),
        "train_samples_per_s": trained / train_s if trained else 0.0,
        "eval_samples_per_s": evaluated / eval_s if eval_s > 0 else 0.0,
    }
    _report(cfg, results, say)
    # collectives are done; tearing down the group before MPI finalises keeps exit clean
    dist.destroy_process_group()
    return results


class _Run:
    """What the training set-up made: data sets, sampler and loader, model, optimizer,
    scheduler, checkpointer, the elastic State (or None) and the DDP model, and the epoch
    to start from."""
    __slots__ = ("train_ds", "test_ds", "sampler", "loader", "steps_per_epoch", "model", "opt",
                 "sched", "ckpt", "state", "ddp", "start_epoch")


def _setup_training(cfg: DemoConfig, phases, staged: dict, workdir: str, global_batch: int):
    """Process group, data sets, loaders, model, DDP (or elastic mode's State), and the
    checkpoint to resume from. The first DDP() in a process imports torch._dynamo: seconds on
    a busy machine, whatever the backend."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpcddp
    from hpcddp import data as hdata
    from hpcddp.demo.model import build_model

    world = hpcddp.world()
    rank, size = world.rank, world.size
    run = _Run()
    phases.start("setup")
    hpcddp.init_process_group(cfg.backend)
    run.train_ds = train_ds = hdata.open_dataset(staged["train"], decode=decode_png)
    run.test_ds = hdata.open_dataset(staged["test"], decode=decode_png)
    if cfg.elastic:
        # the same batches as the plain sampler and loader, dealt again after a lost rank
        from hpcddp import elastic
        run.sampler = elastic.ElasticBatchSampler(len(train_ds), global_batch, seed=cfg.seed)
        run.loader = torch.utils.data.DataLoader(
            train_ds, batch_sampler=run.sampler, num_workers=cfg.workers,
            persistent_workers=cfg.workers > 0)
    else:
        run.sampler = hdata.DistributedSampler(train_ds, num_replicas=size, rank=rank,
                                               shuffle=True, seed=cfg.seed, drop_last=True)
        run.loader = torch.utils.data.DataLoader(
            train_ds, batch_size=global_batch // size, sampler=run.sampler, drop_last=True,
            num_workers=cfg.workers, persistent_workers=cfg.workers > 0)
    run.steps_per_epoch = len(run.loader)
    if run.steps_per_epoch == 0:
        raise ValueError(f"hpcddp demo: {len(train_ds)} training samples make no full global "
                         f"batch of {global_batch}; lower --batch-size or raise --limit")

    run.model = model = build_model(cfg.seed, getattr(torch, cfg.dtype))
    run.opt = opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum,
                                    weight_decay=cfg.weight_decay)
    run.sched = sched = torch.optim.lr_scheduler.CosineAnnealingLR(
        opt, T_max=cfg.epochs * run.steps_per_epoch)
    run.ckpt = ckpt = _checkpointer(os.path.join(workdir, "checkpoints"), world)
    run.state = None
    if cfg.elastic:
        kill = None if cfg.kill_rank is None else \
            f"{cfg.kill_rank}@{cfg.kill_step}:{cfg.kill_phase}"

        def after_recovery(st):   # what the demo itself holds on the old world
            phases.comm = st.world.mpi
            ckpt._sync = type(ckpt._sync)(st.world)
        run.state = elastic.State(model, opt, run.sampler, scheduler=sched,
                                  on_recovery=[after_recovery], fault_injection=kill,
                                  regrow=cfg.regrow or None)    # None: spares given
        run.ddp = run.state.model
    else:
        run.ddp = DDP(model)

    run.start_epoch = 0
    if cfg.resume:
        found = ckpt.load_latest()
        if found is not None:
            model.load_state_dict(found.state["model"])
            opt.load_state_dict(found.state["optimizer"])
            sched.load_state_dict(found.state["scheduler"])
            run.start_epoch = found.step
    elif rank == 0 and not (run.state is not None and run.state.replacement):
        _clear_checkpoints(ckpt)
    phases.stop()
    return run


def _train(cfg: DemoConfig, run: _Run, phases, say, global_batch: int) -> tuple:
    """The epochs (elastic mode: through its State): (samples trained, preempted, seconds)."""
    import contextlib

    import torch
    import torch.nn.functional as F

    import hpcddp
    from hpcddp import data as hdata

    state, sampler, sched, opt, ckpt = run.state, run.sampler, run.sched, run.opt, run.ckpt
    dtype = getattr(torch, cfg.dtype)
    size = hpcddp.world().size
    phases.start("train")
    phases.joining = False      # a replacement rank: from here on, in step with the others
    trained = 0
    preempted = False
    epochs = state.epochs(cfg.epochs) if state else range(run.start_epoch, cfg.epochs)
    for epoch in epochs:
        t_ep = time.perf_counter()
        sampler.set_epoch(epoch)
        (state.model if state else run.ddp).train()
        sums = hdata.MetricSums()
        for x, y in (state.batches(run.loader) if state else run.loader):
            with (state.step() if state else contextlib.nullcontext()):
                x = x.to(dtype)
                out = (state.model if state else run.ddp)(x)
                loss = F.cross_entropy(out, y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                sched.step()
                with torch.no_grad():
                    sums.add("loss", loss.detach() * len(y), len(y))
                    sums.add("accuracy", (out.argmax(1) == y).sum(), len(y))
        trained += run.steps_per_epoch * global_batch
        m = sums.reduce(hpcddp.world().mpi)     # smaller after a lost rank (elastic mode)
        dt = time.perf_counter() - t_ep
        say(f"[train] epoch {epoch + 1:>2}/{cfg.epochs}  loss {m['loss']:.4f}  "
            f"train acc {m['accuracy']:.4f}  lr {sched.get_last_lr()[0]:.4f}  "
            f"{run.steps_per_epoch * global_batch / dt:,.0f} samples/s  {dt:.2f} s")
        last = epoch + 1 == cfg.epochs
        if ckpt.should_save(epoch + 1, every=cfg.checkpoint_every) or last:
            ckpt.save({"model": run.model.state_dict(), "optimizer": opt.state_dict(),
                       "scheduler": sched.state_dict(), "epoch": epoch + 1,
                       "config": cfg.as_dict(), "world_size": size}, epoch + 1)
        if ckpt.preempted:
            say(f"[train] stopping after epoch {epoch + 1}: preempted; rerun with --resume")
            preempted = True
            break
    train_s = phases.stop()
    ckpt.restore_signals()
    return trained, preempted, train_s


def _evaluate(cfg: DemoConfig, run: _Run, phases) -> tuple:
    """Every held-out sample exactly once, whatever the number of ranks (after a loss too):
    (metrics, samples evaluated, seconds)."""
    import torch
    import torch.nn.functional as F

    import hpcddp
    from hpcddp import data as hdata

    world = hpcddp.world()
    dtype = getattr(torch, cfg.dtype)
    test_ds = run.test_ds
    phases.start("evaluate")
    eval_sampler = hdata.DistributedEvalSampler(test_ds, num_replicas=world.size,
                                                rank=world.rank)
    eval_loader = torch.utils.data.DataLoader(test_ds, batch_size=256, sampler=eval_sampler,
                                              num_workers=0)
    run.model.eval()  # the plain module: ranks run different batch counts, DDP would sync them
    sums = hdata.MetricSums()
    with torch.no_grad():
        for x, y in eval_loader:
            out = run.model(x.to(dtype))
            sums.add("loss", F.cross_entropy(out, y, reduction="sum"), len(y))
            sums.add("accuracy", (out.argmax(1) == y).sum(), len(y))
    metrics = sums.reduce(world.mpi)
    evaluated = sums.counts.get("accuracy", 0)
    eval_s = phases.stop()
    if evaluated != len(test_ds):
        raise RuntimeError(f"hpcddp demo: evaluated {evaluated} samples, the test split has "
                           f"{len(test_ds)}: the evaluation sampler lost or repeated samples")
    return metrics, evaluated, eval_s


def _report(cfg: DemoConfig, results: dict, say) -> None:
    """The evaluation's line, the summary, and the results file (rank 0)."""
    import hpcddp
    size = results["world_size"]
    say(f"[evaluate] held-out accuracy {results['accuracy']:.4f} on {results['test_samples']} "
        f"samples (each counted once over {size} rank{'s' if size > 1 else ''}), loss "
        f"{results['test_loss']:.4f}")
    for line in _summary_lines(results):
        say(line)
    if hpcddp.world().rank == 0 and cfg.results:
        os.makedirs(os.path.dirname(os.path.abspath(cfg.results)), exist_ok=True)
        with open(cfg.results, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
            f.write("\n")


def _elastic_report(state, started: int) -> tuple[dict, list[str]]:
    """What elastic mode did (the results file's entry, the lines to print), as the lowest
    rank that saw every recovery knows it: a replacement saw only the later ones. Collective."""
    import hpcddp
    mine = None
    if state.reporting:
        mine = ({"lost_ranks": sorted(r for rec in state.recoveries for r in rec.lost),
                 "recoveries": [{k: v for k, v in rec.__dict__.items() if k != "cause"}
                                for rec in state.recoveries]},
                _elastic_lines(state, started))
    return next(g for g in hpcddp.world().mpi.allgather(mine) if g is not None)


def _elastic_lines(state, started: int) -> list[str]:
    """What elastic mode did: the ranks lost, where, and how long recovery took."""
    if not state.recoveries:
        return [f"[elastic] no rank lost: {state.size} of {started} ranks to the end"]
    out = []
    for rec in state.recoveries:
        kill = "" if rec.kill_to_step_s is None else \
            f", kill -> first completed step {rec.kill_to_step_s:.3f} s"
        first = "" if rec.detect_to_step_s is None else \
            f", failure seen -> first completed step {rec.detect_to_step_s:.3f} s"
        out.append(f"[elastic] lost rank{'s' if len(rec.lost) > 1 else ''} "
                   f"{', '.join(map(str, rec.lost))}, training went on from step {rec.step} "
                   f"(epoch {rec.epoch + 1}) on {rec.world_size} rank(s): recovery "
                   f"{rec.seconds:.3f} s{first}{kill}")
        for r, host in rec.replaced:
            kill = "" if rec.kill_to_full_size_s is None else \
                f", kill -> full size {rec.kill_to_full_size_s:.2f} s"
            by = "a spare process" if rec.from_spares else "a new process"
            out.append(f"[elastic] rank {r} replaced by {by} on {host or 'a free slot'}: "
                       f"failure seen -> full size {rec.detect_to_full_size_s:.2f} s{kill}")
        if rec.no_slot:
            out.append(f"[elastic] no free slot for a replacement: went on with "
                       f"{rec.world_size} rank(s)")
    out.append(f"[elastic] finished on {state.size} of {started} ranks")
    return out


def _staged_for_replacement(cfg, topo, packed: dict) -> dict:
    """A replacement rank's data: this node's staged copy where the job staged one here,
    else the packed data on the shared filesystem (staging is over the whole job and ran
    before this process existed)."""
    from hpcddp import data as hdata
    from hpcddp.data.manifest import READY
    out = {}
    for split, src in packed.items():
        dest = hdata.resolve_dest(os.path.join(cfg.stage_dest_resolved, split), topo.node,
                                  topo.hostname)
        out[split] = dest if os.path.exists(os.path.join(dest, READY)) else src
    return out


def _prepare(cfg, phases, say, rank, topo, digits_dir, packed) -> dict:
    """Phases 1-3: write the PNG files, pack them, stage the packs; return the staged paths."""
    from hpcddp import data as hdata
    from hpcddp.demo.digits import write_digits

    # 1. the data set as files, the way users' data sits on a shared filesystem
    phases.start("data")
    summary = None
    if rank == 0:
        summary = write_digits(digits_dir, test_fraction=cfg.test_fraction, seed=cfg.seed,
                               limit=cfg.limit)
    dt = phases.stop()
    if rank == 0:
        sp = summary["splits"]
        say(f"[data] wrote {sp['train']['samples']} train + {sp['test']['samples']} test digits "
            f"as PNG files in {digits_dir}/{{train,test}}/<class>/  ({dt:.2f} s)")

    # 2. pack: one pass over the small files, into a few large shards
    phases.start("pack")
    if rank == 0:
        for split, out in packed.items():
            m = hdata.pack(os.path.join(digits_dir, split), out, format=cfg.format,
                           shard_bytes=cfg.shard_size, label_from_parent=True, overwrite=True,
                           progress=False)
            say(f"[pack] {split}: {m.num_samples} samples -> {len(m.shards)} {cfg.format} "
                f"shard(s), {m.total_bytes / 1024:.0f} KiB in {out}")
    dt = phases.stop()
    say(f"[pack] done ({dt:.2f} s)")

    # 3. stage to node-local storage: shared filesystem read once, replicated over MPI
    phases.start("stage")
    staged = {}
    for split, src in packed.items():
        dest = os.path.join(cfg.stage_dest_resolved, split)
        res = hdata.stage(src, dest, progress=False)
        staged[split] = hdata.resolve_dest(dest, topo.node, topo.hostname)
        if rank == 0:
            for line in _stage_lines(res):
                say(f"[stage] {split}: {line}")
    dt = phases.stop()
    say(f"[stage] done ({dt:.2f} s)")
    return staged


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def _stage_lines(res) -> list[str]:
    """StageResult.summary(), in units that suit a small data set."""
    return [
        f"{res.num_samples} samples, {res.num_shards} shards, {_human(res.dataset_bytes)} -> "
        f"{res.nodes} node(s) in {res.groups} group(s), mode={res.mode} strategy={res.strategy}",
        f"  read from the source: {_human(res.bytes_read_from_source)} "
        f"({res.read_amplification:.2f}x the data set per group); written: "
        f"{_human(res.bytes_written)} ({res.shards_copied} shard copies, {res.shards_skipped} "
        f"already in place)",
        f"  {res.seconds:.2f} s = plan {res.phases.get('plan', 0):.2f} + copy "
        f"{res.phases.get('copy', 0):.2f} + finalize {res.phases.get('finalize', 0):.2f}; "
        f"node-local copies: {_few(res.dest_per_node or [res.dest])}",
    ]


def _few(paths: list, show: int = 2) -> str:
    more = len(paths) - show
    return ", ".join(paths[:show]) + (f" and {more} more" if more > 0 else "")


def _checkpointer(directory: str, world):
    from hpcddp.parallel.checkpoint import Checkpointer
    return Checkpointer(directory, comm=world, keep=2, prefix="demo")


def _clear_checkpoints(ckpt) -> None:
    """A run without --resume starts from scratch: remove the demo's old checkpoints."""
    from hpcddp.parallel.checkpoint import list_checkpoints
    for _, path in list_checkpoints(ckpt.directory, ckpt.prefix):
        os.remove(path)


def _save_atomic(obj, path: str) -> None:
    import torch
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def _summary_lines(r: dict) -> list[str]:
    p = r["phases_s"]
    lines = [f"[summary] accuracy {r['accuracy']:.4f}  ({r['test_samples']} held-out samples, "
             f"{r['world_size']} rank(s), backend {r['backend']})",
             f"[summary] train {r['train_samples_per_s']:,.0f} samples/s, evaluate "
             f"{r['eval_samples_per_s']:,.0f} samples/s",
             "[summary] phase       seconds"]
    for name in ("launch", "data", "pack", "stage", "setup", "train", "evaluate", "total"):
        if name in p:
            lines.append(f"[summary]   {name:<9} {p[name]:8.2f}")
    return lines


def run_checked(cfg: DemoConfig) -> int:
    """Check what needs the world size, then run the job; 0 on success, 2 on a bad option.

    Every rank calls it; a bad option is reported once (rank 0) and every rank returns 2.
    """
    import hpcddp
    world = hpcddp.init(abort_on_exception=True).world
    try:
        cfg.global_batch(world.size)
    except ValueError as exc:
        if world.rank == 0:
            hpcddp.log(str(exc))
        return 2
    if cfg.elastic:
        from hpcddp.elastic import support_problem
        problem = support_problem()
        if problem is not None:
            if world.rank == 0:
                hpcddp.log(f"hpcddp demo --elastic: {problem}")
            return 2
    run_job(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hpcddp.demo.train",
        description="The hpcddp demo job on the ranks of the current launcher (see "
                    "`hpcddp demo --help`).")
    add_arguments(parser)
    try:
        cfg = from_args(parser.parse_args(argv))
    except ValueError as exc:
        print(f"{exc}", file=sys.stderr)
        return 2
    return run_checked(cfg)


if __name__ == "__main__":
    sys.exit(main())
