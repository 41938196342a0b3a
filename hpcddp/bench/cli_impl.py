"""What ``hpcddp bench`` does once its arguments are parsed (kept out of hpcddp.cli so that
``hpcddp --help`` imports nothing heavy)."""
from __future__ import annotations

import os
import sys

from hpcddp.bench import report
from hpcddp import settings


def _split(text, what: str, valid) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in items if x not in valid]
    if bad:
        raise SystemExit(f"hpcddp bench: unknown {what} {', '.join(bad)}; valid: "
                         f"{', '.join(valid)}")
    return items


def _relaunch_argv(args) -> list[str]:
    """This command line again, without --np (what each rank of the started job runs)."""
    argv = [sys.executable, "-m", "hpcddp", "bench", args.bench]
    skip = {"bench", "np", "timeout", "_run", "command", "vcluster", "rate", "ranks_per_node"}
    for key, value in sorted(vars(args).items()):
        if key in skip or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def _launch(args) -> int:
    from hpcddp.launch.mpirun import _is_open_mpi, find_mpirun, mpirun_command, run_job
    n = args.np
    mpirun = find_mpirun()
    extra = []
    if _is_open_mpi(mpirun):
        # shared memory only (this is one machine), one rank per core where cores suffice
        extra += ["--mca", "pml", "ob1", "--mca", "btl", "self,sm"]
        if n <= (os.cpu_count() or 1):
            extra += ["--bind-to", "core"]
    cmd = mpirun_command(n, _relaunch_argv(args), mpirun=mpirun, extra=extra)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONUNBUFFERED="1")
    print("hpcddp bench: " + " ".join(cmd), file=sys.stderr, flush=True)
    return run_job(cmd, env=env, timeout=args.timeout, name="hpcddp bench")


def main(args) -> int:
    from hpcddp.launch import detect
    launched = detect()
    if launched is None or (launched.size is not None and launched.size <= 1):
        if getattr(args, "vcluster", None):
            from hpcddp.bench import vcluster
            return vcluster.launch(args, _relaunch_argv(args))
        if getattr(args, "np", None):
            return _launch(args)
        print(f"hpcddp bench {args.bench}: needs an MPI job of at least 2 ranks; run it as "
              f"`mpirun -n 2 --bind-to core hpcddp bench {args.bench} ...` or add --np 2",
              file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if args.bench == "comm":
        return _comm(args)
    if args.bench == "ddp":
        return _ddp(args)
    if args.bench == "stage":
        return _stage(args)
    raise SystemExit(f"hpcddp bench: unknown benchmark {args.bench!r}")


def _finish(args, result: dict, text: str, plot) -> int:
    """Rank 0: print, write, plot, compare. Returns the exit status."""
    status = 0
    print(text, flush=True)
    if args.json:
        report.write_json(result, args.json)
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}", flush=True)
    if args.compare:
        old = report.read_json(args.compare)
        regressions, ctext = report.compare(result, old, args.threshold, args.compare_absolute)
        print(ctext, flush=True)
        if regressions:
            status = 1
    return status


def comm_text(result: dict, markdown: bool = False) -> str:
    targets = result.get("targets") or report.comm_targets(result)
    wrong = [(c["op"], c["bytes"], name) for c in result["cells"]
             for name, rec in c["impls"].items() if rec.get("wrong")]
    parts = [report.comm_table(result, markdown=markdown)]
    parts.append("\n".join(report.setup_lines(result)))
    parts.append(report.targets_text(targets))
    if wrong:
        parts.append("WRONG RESULTS: " + "; ".join(f"{op} {b} B {n}" for op, b, n in wrong))
    return "\n\n".join(parts)


def _comm(args) -> int:
    from hpcddp.bench import comm, protocol
    from hpcddp.comm import log
    ops = _split(args.ops, "op", comm.ALL_OPS) if args.ops else list(comm.OPS)
    impls = _split(args.impls, "implementation", comm.ALL_IMPLS) if args.impls \
        else list(comm.IMPLS)
    sizes = protocol.parse_sizes(args.sizes) if args.sizes else list(protocol.DEFAULT_SIZES)
    rounds = args.rounds or 9
    result = comm.run(ops, sizes, impls, rounds, args.batch_ms / 1e3,
                      progress=lambda s: log(f"bench comm: {s}") if settings.get().bench_progress else None)
    _shutdown()
    if result is None:
        return 0
    result["command"] = _command_line()
    if args.link_rate:          # --vcluster ... --rate: the link's own target
        from hpcddp.bench.vcluster import link_bytes_per_s
        result["link_bytes_per_s"] = link_bytes_per_s(args.link_rate)
    report.summarize(result)
    result["targets"] = report.comm_targets(result)
    status = _finish(args, result, comm_text(result), report.plot_comm)
    if any(rec.get("wrong") for c in result["cells"] for rec in c["impls"].values()):
        status = 1
    return status


def ddp_text(result: dict, markdown: bool = False) -> str:
    from hpcddp.bench import ddp
    return "\n\n".join([ddp.table(result, markdown), "\n".join(report.setup_lines(result)),
                        report.targets_text(result.get("targets", []))])


def _ddp(args) -> int:
    from hpcddp.bench import ddp
    from hpcddp.comm import log
    models = _split(args.models, "model", tuple(ddp.MODELS))
    link = None
    if args.link_rate:
        from hpcddp.bench.vcluster import link_bytes_per_s
        link = link_bytes_per_s(args.link_rate)
    result = ddp.run(models, batch=args.batch, steps=args.steps, rounds=args.rounds or 5,
                     bucket_mb=args.bucket_mb, seed=args.seed,
                     progress=lambda s: log(f"bench ddp: {s}"), link_bytes_per_s=link)
    _shutdown()
    if result is None:
        return 0
    result["command"] = _command_line()
    status = _finish(args, result, ddp_text(result), report.plot_ddp)
    if not result.get("correct", True):
        status = 1
    return status


def _stage(args) -> int:
    from hpcddp.bench import stage
    from hpcddp.comm import log
    strategies = _split(args.strategies, "strategy", stage.STRATEGIES) if args.strategies \
        else list(stage.STRATEGIES)
    link = None
    if args.link_rate:
        from hpcddp.bench.vcluster import link_bytes_per_s
        link = link_bytes_per_s(args.link_rate)
    result = stage.run(args.dir, size_mb=args.size_mb, files=args.files,
                       rounds=args.rounds or 4, strategies=strategies, cold=not args.warm,
                       progress=lambda s: log(f"bench stage: {s}"), link_bytes_per_s=link,
                       group_nodes=args.group_nodes)
    if result is None:
        return 0
    result["command"] = _command_line()
    status = _finish(args, result, stage.text(result), stage.plot)
    return status if result.get("correct", True) else 1


def _shutdown() -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()


def _command_line() -> str:
    return " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))


def report_main(args) -> int:
    result = report.read_json(args.file)
    kind = result.get("kind")
    if kind == "hpcddp-bench-comm":
        text, plot = comm_text(result, args.markdown), report.plot_comm
    elif kind == "hpcddp-bench-ddp":
        text, plot = ddp_text(result, args.markdown), report.plot_ddp
    elif kind == "hpcddp-bench-stage":
        from hpcddp.bench import stage
        text, plot = stage.text(result, args.markdown), stage.plot
    else:
        raise SystemExit(f"hpcddp bench report: {args.file} holds an unknown kind {kind!r}")
    if result.get("command"):
        text = f"command: {result['command']}\n\n" + text
    args.json = None
    return _finish(args, result, text, plot)
