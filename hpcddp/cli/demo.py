"""`hpcddp demo`: the end-to-end job (pack, stage, DDP over MPI, exact evaluation)."""
import argparse

from hpcddp.demo.config import add_arguments as _add_demo_arguments

DESCRIPTION = """\
Train a small CNN on real handwritten digits, end to end, the way a cluster job does it:

  1. data      write scikit-learn's 1,797 digits (8x8, shipped with it: no download) as PNG
               files in class folders, with a fixed held-out split (WORKDIR/digits/{train,test})
  2. pack      pack each split into a sharded LMDB (--format hdf5: HDF5) data set
  3. stage     copy it to node-local storage, the shared filesystem read once: scatter over
               node leaders, then broadcast within each node (nodes emulated on one machine)
  4. train     DistributedDataParallel over MPI (--backend gloo: torch's gloo, to compare),
               DistributedSampler, DataLoader workers, checkpoints in WORKDIR/checkpoints
  5. evaluate  the held-out split, every sample counted exactly once; accuracy, samples/s
               and seconds per phase are printed by rank 0

Run it as one command on this machine (it starts `mpirun -n NPROCS` itself, with
HPCDDP_RANKS_PER_NODE=1 so each rank is an emulated node):

    hpcddp demo                      # 2 ranks
    hpcddp demo --nprocs 4 --backend gloo

or under your launcher, on any number of ranks and nodes (no --nprocs then):

    mpirun -n 8 hpcddp demo --workdir /shared/demo
    srun --mpi=pmix hpcddp demo --workdir $SCRATCH/demo --stage-dest '$SLURM_TMPDIR/digits'

With --elastic the job survives lost ranks (mpirun --with-ft ulfm; docs/elastic.md):

    hpcddp demo --elastic --nprocs 3 --kill-rank 1 --kill-step 100
    hpcddp demo --elastic --regrow --nprocs 4 --kill-rank 2 --kill-step 100   # back to 4
    hpcddp demo --elastic --spares 1 --nprocs 4 --kill-rank 2 --kill-step 100 # at once

Expect held-out accuracy of about 0.98 (0.9861 with the default seed) in under a minute on
2 cores. The same seed and global batch give the same final parameters on any number of
ranks (float64: to ~1e-12).
docs/quickstart.md walks through the output.
"""

DEFAULT_NPROCS = 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("launch (only without a launcher: plain `hpcddp demo`)")
    g.add_argument("--nprocs", "-n", type=int, default=None, metavar="N",
                   help=f"ranks to start with mpirun (default: {DEFAULT_NPROCS})")
    g.add_argument("--ranks-per-node", type=int, default=None, metavar="K",
                   help="emulated node size (HPCDDP_RANKS_PER_NODE) for the ranks it starts "
                        "(default: $HPCDDP_RANKS_PER_NODE, else 1: every rank a node)")
    g.add_argument("--timeout", type=float, default=600.0, metavar="SECONDS",
                   help="kill the job if it runs longer (default: %(default)s)")
    g.add_argument("--no-launch", action="store_true",
                   help="run in this process as a 1-rank job instead of starting mpirun")
    _add_demo_arguments(parser)


# what the demo imports beyond hpcddp's own requirements: the `demo` extra
EXTRA = (("sklearn", "scikit-learn"), ("PIL", "pillow"))


def missing_extra() -> list[str]:
    """The demo extra's packages that cannot be imported here."""
    import importlib.util
    return [dist for module, dist in EXTRA if importlib.util.find_spec(module) is None]


def run(args) -> int:
    import sys

    from hpcddp.demo.config import from_args
    from hpcddp.launch import detect

    try:
        cfg = from_args(args)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    missing = missing_extra()
    if missing:       # before any rank starts: every rank would fail alike, mid-job
        print(f"hpcddp demo: needs {' and '.join(missing)} (its data set and images), not "
              f"installed here: pip install 'hpcddp[demo]'", file=sys.stderr)
        return 2
    for name in ("nprocs", "ranks_per_node"):
        value = getattr(args, name)
        if value is not None and value < 1:
            print(f"hpcddp demo: --{name.replace('_', '-')} must be a positive int, got {value}",
                  file=sys.stderr)
            return 2
    launched = detect()
    if launched is not None or args.no_launch:
        if launched is not None and args.nprocs is not None and args.nprocs != launched.size:
            print(f"[rank{launched.rank}] hpcddp demo: --nprocs {args.nprocs} ignored: the "
                  f"launcher started {launched.size} ranks", file=sys.stderr)
        from hpcddp.demo.train import run_checked
        return run_checked(cfg)
    return launch(cfg, nprocs=args.nprocs or DEFAULT_NPROCS,
                  ranks_per_node=args.ranks_per_node, timeout=args.timeout)


def launch(cfg, *, nprocs: int, ranks_per_node=None, timeout: float = 600.0) -> int:
    """Start ``mpirun -n NPROCS python -m hpcddp demo ...`` and stream its output.

    Returns the job's exit status (124 after killing it at TIMEOUT seconds; the job also ends
    with this process: ``run_job``). Unlike ``run_mpi`` (which collects the output for
    tests), the output appears as it comes.
    """
    import os
    import sys
    import time

    from hpcddp.launch.mpirun import (JOB_INTERRUPTED, JOB_TERMINATED, JOB_TIMED_OUT,
                                      mpirun_command, run_job)

    env = dict(os.environ)
    if ranks_per_node is not None:
        env["HPCDDP_RANKS_PER_NODE"] = str(ranks_per_node)
    else:
        env.setdefault("HPCDDP_RANKS_PER_NODE", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONUNBUFFERED", "1")
    argv = [sys.executable, "-m", "hpcddp", "demo", *cfg.to_argv()]
    try:
        # a replacement rank (--regrow) needs a free slot: on this one machine, one more
        # process than the ranks (mpirun_command oversubscribes beyond the cores anyway)
        extra = ["--oversubscribe"] if cfg.regrow and nprocs <= (os.cpu_count() or 1) else []
        if cfg.spares:       # the spares run beside the ranks, waiting in hpcddp.init
            env["HPCDDP_ELASTIC_SPARES"] = str(cfg.spares)
        cmd = mpirun_command(nprocs + cfg.spares, argv, fault_tolerant=cfg.elastic, extra=extra)
    except FileNotFoundError as exc:
        print(f"hpcddp demo: {exc}", file=sys.stderr)
        return 2
    print(f"hpcddp demo: HPCDDP_RANKS_PER_NODE={env['HPCDDP_RANKS_PER_NODE']} "
          f"{' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    rc = run_job(cmd, env=env, timeout=timeout, name="hpcddp demo")
    if rc not in (JOB_TIMED_OUT, JOB_INTERRUPTED, JOB_TERMINATED):
        print(f"hpcddp demo: exit {rc} after {time.perf_counter() - t0:.1f} s wall (mpirun "
              f"start to exit)", file=sys.stderr, flush=True)
    return rc
