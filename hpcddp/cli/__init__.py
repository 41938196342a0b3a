"""The ``hpcddp`` command: a thin dispatcher.

Each subcommand lives in its own module ``hpcddp.cli.<name>`` exposing ``add_arguments(parser)``
and ``run(args) -> int``; it parses arguments and calls the library function that also exists
in the API. Modules are imported only when their subcommand runs, so ``hpcddp --help`` stays fast
and ``hpcddp pack`` never imports MPI.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help). Sorted by what a new user meets first.
COMMANDS = {
    "info": ("hpcddp.cli.info", "show the MPI library, launcher, rank/node layout and versions"),
    "demo": ("hpcddp.cli.demo", "the end-to-end job: pack, stage, train a CNN with DDP over MPI, evaluate"),
    "run": ("hpcddp.cli.run", "run a Python script with hpcddp initialised and abort-on-exception on"),
    "pack": ("hpcddp.cli.pack", "pack files or arrays into a sharded LMDB or HDF5 data set"),
    "stage": ("hpcddp.cli.stage", "stage a packed data set to node-local storage (scatter-then-broadcast)"),
    "launch": ("hpcddp.cli.launch", "start mpirun/srun so that it always ends: keepalives, an end after an abort, a true status"),
    "submit": ("hpcddp.cli.submit", "render a Slurm job from a template and submit it with sbatch"),
    "bench": ("hpcddp.cli.bench", "benchmarks: comm, ddp, stage against raw mpi4py and gloo"),
}


class _Parser(argparse.ArgumentParser):
    """argparse, refusing in one line (which argument, what is wrong, where the help is)
    instead of the whole usage block above a job's log; exit status 2 as argparse's."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hpcddp",
        description="MPI-backed HPC training toolkit for PyTorch. Run a subcommand under "
        "mpirun/srun for a parallel job, e.g. `mpirun -n 4 hpcddp info`.",
    )
    from hpcddp._version import __version__    # not hpcddp's __init__: that imports torch
    parser.add_argument("--version", action="version", version=f"hpcddp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # a real import error inside the module: show it
                raise
            continue  # subcommand not shipped in this build
        p = sub.add_parser(name, help=help_text, description=getattr(mod, "DESCRIPTION", help_text),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    from hpcddp.launch.mpilib import MPILibraryError
    try:
        return int(args._run(args) or 0)
    except MPILibraryError as exc:   # a fix to print, not a traceback
        print(f"hpcddp {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
