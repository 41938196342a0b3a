"""`hpcddp info`: one screen about the job, printed by rank 0."""
import argparse

DESCRIPTION = """\
Show the MPI library and version, thread level, launcher, the rank / local rank / node / host
layout, torch and CUDA, CUDA-aware MPI status, and h5py/lmdb versions. Run it the way you run
your training job, e.g.:

    mpirun -n 4 hpcddp info
    srun --mpi=pmix -n 8 hpcddp info --json
    HPCDDP_RANKS_PER_NODE=2 mpirun -n 4 hpcddp info     # emulate 2 nodes of 2 ranks
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (world_size, nodes, launcher, mpi, cuda_aware, ranks)")


def run(args) -> int:
    import json

    from hpcddp.comm.info import collect_info, format_info
    info = collect_info()
    if info is not None:
        print(json.dumps(info, indent=2) if args.json else format_info(info), flush=True)
    return 0
