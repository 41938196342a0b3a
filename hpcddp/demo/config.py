"""The demo's settings: one dataclass, its command-line options, and the way back to argv.

Standard library only: ``hpcddp --help`` imports the CLI module, which imports this.
"""
from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import asdict, dataclass, fields

BACKENDS = ("hpcddp", "gloo")
FORMATS = ("lmdb", "hdf5")
DTYPES = ("float32", "float64")
KILL_PHASES = ("data", "forward", "backward", "optimizer")
DEFAULT_GLOBAL_BATCH = 60   # divisible by 1..6 ranks: the same global batch at any small size


def default_stage_dest() -> str:
    """Node-local scratch for the staged copy: ``$TMPDIR`` (Slurm sets a per-job one) or /tmp."""
    base = os.environ.get("SLURM_TMPDIR") or os.environ.get("TMPDIR") or tempfile.gettempdir()
    user = str(os.getuid()) if hasattr(os, "getuid") else "user"
    return os.path.join(base, f"hpcddp-demo-{user}", "node{node}")


@dataclass
class DemoConfig:
    workdir: str = "hpcddp-demo"
    stage_dest: str = ""                # "" -> default_stage_dest()
    staged: str = ""                    # train from DIR/{train,test}, staged by a job step
    format: str = "lmdb"
    backend: str = "hpcddp"
    epochs: int = 12
    batch_size: int | None = None       # global; None -> DEFAULT_GLOBAL_BATCH rounded up to N
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 5e-4
    seed: int = 0
    workers: int = 1
    limit: int | None = None
    test_fraction: float = 0.2
    dtype: str = "float32"
    shard_size: int = 16 << 10
    checkpoint_every: int = 5
    resume: bool = False
    save_params: str = ""
    results: str = ""
    elastic: bool = False
    regrow: bool = False
    spares: int = 0
    kill_rank: int | None = None
    kill_step: int | None = None
    kill_phase: str = "backward"

    def validate(self) -> None:
        """Raise ValueError naming the option, what it must be, and what it got."""
        def bad(opt, expected, got):
            raise ValueError(f"hpcddp demo: {opt} must be {expected}, got {got!r}")
        if self.format not in FORMATS:
            bad("--format", f"one of {list(FORMATS)}", self.format)
        if self.backend not in BACKENDS:
            bad("--backend", f"one of {list(BACKENDS)}", self.backend)
        if self.dtype not in DTYPES:
            bad("--dtype", f"one of {list(DTYPES)}", self.dtype)
        if self.epochs < 1:
            bad("--epochs", "a positive int", self.epochs)
        if self.batch_size is not None and self.batch_size < 1:
            bad("--batch-size", "a positive int (samples per step, all ranks together)",
                self.batch_size)
        if self.workers < 0:
            bad("--workers", "an int >= 0 (DataLoader worker processes per rank)", self.workers)
        if self.limit is not None and not 20 <= self.limit <= 1797:
            bad("--limit", "an int from 20 to 1797 (samples written, train and test together)",
                self.limit)
        if not 0.0 < self.test_fraction < 1.0:
            bad("--test-fraction", "a number strictly between 0 and 1", self.test_fraction)
        if self.shard_size < 1:
            bad("--shard-size", "a positive int (bytes per shard)", self.shard_size)
        if self.checkpoint_every < 0:
            bad("--checkpoint-every", "an int >= 0 (0: only at the end)", self.checkpoint_every)
        if (self.kill_rank is None) != (self.kill_step is None):
            bad("--kill-rank/--kill-step", "given together", (self.kill_rank, self.kill_step))
        if self.kill_rank is not None:
            if not self.elastic:
                bad("--kill-rank", "used with --elastic (without it a lost rank ends the job)",
                    self.kill_rank)
            if self.kill_rank < 0 or self.kill_step < 0:
                bad("--kill-rank/--kill-step", "ints >= 0", (self.kill_rank, self.kill_step))
        if self.regrow and not self.elastic:
            bad("--regrow", "used with --elastic (it replaces the ranks elastic mode lost)",
                self.regrow)
        if self.spares < 0 or (self.spares and not self.elastic):
            bad("--spares", "an int >= 0, used with --elastic (spare processes replace the "
                "ranks elastic mode lost)", self.spares)
        if self.kill_phase not in KILL_PHASES:
            bad("--kill-phase", f"one of {list(KILL_PHASES)}", self.kill_phase)
        if self.elastic and self.backend != "hpcddp":
            bad("--backend", "hpcddp with --elastic (gloo cannot shrink its group)", self.backend)
        if self.elastic and self.resume:
            bad("--resume", "left out with --elastic (elastic runs recover from the survivors)",
                self.resume)

    def global_batch(self, world_size: int) -> int:
        """The global batch for WORLD_SIZE ranks; it must split evenly across them."""
        if self.batch_size is None:
            b = DEFAULT_GLOBAL_BATCH
            return -(-b // world_size) * world_size
        if self.batch_size % world_size:
            lo = self.batch_size // world_size * world_size
            raise ValueError(
                f"hpcddp demo: --batch-size {self.batch_size} (the global batch) does not split "
                f"evenly across {world_size} ranks; pass a multiple of {world_size}, e.g. "
                f"{lo or world_size} or {lo + world_size}")
        return self.batch_size

    @property
    def stage_dest_resolved(self) -> str:
        return self.stage_dest or default_stage_dest()

    def to_argv(self) -> list[str]:
        """Command-line options that rebuild this config (for the mpirun child processes)."""
        out: list[str] = []
        default = DemoConfig()
        for f in fields(self):
            value, dflt = getattr(self, f.name), getattr(default, f.name)
            if value == dflt:
                continue
            opt = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                out.append(opt)
            else:
                out += [opt, str(value)]
        return out

    def as_dict(self) -> dict:
        return asdict(self)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The demo's options (shared by ``hpcddp demo`` and ``python -m hpcddp.demo.train``)."""
    d = DemoConfig()
    g = parser.add_argument_group("data")
    g.add_argument("--workdir", default=d.workdir, metavar="DIR",
                   help="where the PNG files, the packed data sets and the checkpoints go; on a "
                        "cluster, a shared filesystem every node sees (default: ./%(default)s)")
    g.add_argument("--stage-dest", default=d.stage_dest, metavar="DEST",
                   help="node-local directory to stage into; {node} is replaced by the node "
                        "index (default: $SLURM_TMPDIR or $TMPDIR or /tmp, then "
                        "hpcddp-demo-UID/node{node})")
    g.add_argument("--staged", default=d.staged, metavar="DIR",
                   help="skip writing, packing and staging: train and evaluate from DIR/train "
                        "and DIR/test, staged earlier (`hpcddp stage`, e.g. by a job step); "
                        "$VARS and {node} are resolved on each node (jobs/slurm/demo.sbatch)")
    g.add_argument("--format", choices=FORMATS, default=d.format,
                   help="packed format (default: %(default)s)")
    g.add_argument("--shard-size", type=int, default=d.shard_size, metavar="BYTES",
                   help="bytes of samples per shard; small, so that even this small data set "
                        "has several shards to scatter (default: %(default)s)")
    g.add_argument("--limit", type=int, default=d.limit, metavar="N",
                   help="write only N of the 1,797 digits (a stratified subset; quick tests)")
    g.add_argument("--test-fraction", type=float, default=d.test_fraction, metavar="F",
                   help="fraction of each class held out for evaluation (default: %(default)s)")
    g.add_argument("--workers", type=int, default=d.workers, metavar="N",
                   help="DataLoader worker processes per rank (default: %(default)s)")
    g = parser.add_argument_group("training")
    g.add_argument("--backend", choices=BACKENDS, default=d.backend,
                   help="torch.distributed backend for DDP: hpcddp (MPI) or gloo, to compare "
                        "(default: %(default)s)")
    g.add_argument("--epochs", type=int, default=d.epochs, help="default: %(default)s")
    g.add_argument("--batch-size", type=int, default=d.batch_size, metavar="B",
                   help="global batch (all ranks together; must split evenly across them); "
                        f"default: {DEFAULT_GLOBAL_BATCH}, rounded up to a multiple of the ranks")
    g.add_argument("--lr", type=float, default=d.lr,
                   help="SGD learning rate, cosine-decayed to 0 (default: %(default)s)")
    g.add_argument("--momentum", type=float, default=d.momentum, help="default: %(default)s")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help="default: %(default)s")
    g.add_argument("--seed", type=int, default=d.seed,
                   help="seeds the split, the weights and the shuffling (default: %(default)s)")
    g.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                   help="parameter dtype; float64 makes 1-rank and N-rank runs agree to ~1e-12 "
                        "(default: %(default)s)")
    g = parser.add_argument_group("checkpoints and results")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every, metavar="E",
                   help="save a checkpoint every E epochs and at the end, in WORKDIR/checkpoints "
                        "(0: only at the end; default: %(default)s)")
    g.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in WORKDIR/checkpoints")
    g.add_argument("--save-params", default=d.save_params, metavar="PATH",
                   help="rank 0 saves the final parameters here (torch.save of the state_dict)")
    g.add_argument("--results", default=d.results, metavar="PATH",
                   help="rank 0 writes the results (accuracy, times, samples/s) here as JSON")
    g = parser.add_argument_group("elastic mode (docs/elastic.md)")
    g.add_argument("--elastic", action="store_true",
                   help="survive lost ranks (hpcddp.elastic over ULFM; `hpcddp demo` then starts "
                        "mpirun --with-ft ulfm): training goes on on the survivors")
    g.add_argument("--regrow", action="store_true",
                   help="with --elastic: after a loss, start a replacement rank (MPI_Comm_spawn) "
                        "and go on at full size; without a free slot the job goes on smaller")
    g.add_argument("--spares", type=int, default=d.spares, metavar="S",
                   help="with --elastic: start S spare processes beside the ranks "
                        "(HPCDDP_ELASTIC_SPARES): a lost rank is replaced at once by a spare, "
                        "not by a process started after the loss as --regrow does")
    g.add_argument("--kill-rank", type=int, default=d.kill_rank, metavar="R",
                   help="with --elastic: rank R SIGKILLs itself at step --kill-step (a failure "
                        "to watch the job survive)")
    g.add_argument("--kill-step", type=int, default=d.kill_step, metavar="S",
                   help="the global step (from 0) at which --kill-rank dies")
    g.add_argument("--kill-phase", choices=KILL_PHASES, default=d.kill_phase,
                   help="where in the step it dies (default: %(default)s, inside a gradient "
                        "all-reduce)")


def from_args(args: argparse.Namespace) -> DemoConfig:
    cfg = DemoConfig(**{f.name: getattr(args, f.name) for f in fields(DemoConfig)})
    cfg.validate()
    return cfg
