"""`hpcddp stage`: copy a packed data set (or, with --files, any directory tree) to node-local
storage, reading the source once per node group (run it on every rank of the job)."""
import argparse

DESCRIPTION = """\
Stage a packed data set (`hpcddp pack`) from the shared file system to node-local storage.
Run it under mpirun/srun with the job's ranks: node leaders split the shards, each reads its
own range once, and MPI carries every shard to every node of the group. Writes go to a
temporary name, are checked against the manifest's CRC-32C and renamed; READY appears last.
A re-run keeps verified shards (resume after a crash). One stager per destination: a second
one waits for the first (--lock-wait), and takes over a lock whose holder died.

    srun hpcddp stage /lustre/me/images.lmdb '$SLURM_TMPDIR/images'
    mpirun -n 8 hpcddp stage /lustre/me/d /dev/shm/d --mode partition --group-nodes 4
    HPCDDP_RANKS_PER_NODE=2 mpirun -n 4 hpcddp stage ./d '/tmp/d-{node}' --json -
    srun hpcddp stage --files /lustre/me/h5files '$SLURM_TMPDIR/h5files'

--files stages a plain directory tree as it is (no packing): each file is checked against
the CRC-32C computed where it was read; symbolic links and special files are refused.

DEST may use $VARS ($SLURM_TMPDIR; quote it so the shell of each node expands nothing early),
{node} (node index: needed when emulated nodes share one disk) and {host}.
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from hpcddp.cli.pack import parse_size
    parser.add_argument("source", help="packed data set directory (shared file system); with "
                                       "--files, any directory tree")
    parser.add_argument("dest", help="node-local directory; may contain $VARS, {node}, {host}")
    parser.add_argument("--files", action="store_true",
                        help="stage SOURCE as a plain directory tree, file for file (no "
                             "manifest needed; symbolic links and special files are refused)")
    parser.add_argument("--mode", choices=("replicate", "partition"), default="replicate",
                        help="replicate: every node gets everything (default); partition: "
                             "each node of a group gets its own range of shards")
    parser.add_argument("--group-nodes", type=int, metavar="K",
                        help="nodes per group; the source is read once per group (default: "
                             "all nodes in one group)")
    parser.add_argument("--strategy", choices=("auto", "bcast", "allgather", "ring", "every-rank"),
                        default="auto",
                        help="how shards reach the group's nodes (auto: ring for groups of "
                             "up to 9 nodes, bcast beyond); every-rank is the baseline with no "
                             "MPI traffic")
    parser.add_argument("--chunk-size", type=parse_size, default="16M", metavar="SIZE",
                        help="bytes per read and per message (default 16M)")
    parser.add_argument("--verify", choices=("auto", "full", "size"), default="auto",
                        help="shards already in DEST: auto hashes those that READY (for this "
                             "manifest) does not vouch for, or that changed (size, mtime, "
                             "ctime, inode) since READY; full always hashes; size only stats. "
                             "--files: auto keeps files with the source's size and mtime, full "
                             "copies every file again")
    parser.add_argument("--lock-wait", type=float, default=1800.0, metavar="SECONDS",
                        help="one stager per destination: wait this long for another stager "
                             "holding DEST's lock (rank 0 says whom: host, pid, job), then fail; "
                             "0 refuses at once (default: %(default)g)")
    parser.add_argument("--fsync", action="store_true", help="fsync each shard before renaming")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.add_argument("--json", metavar="PATH",
                        help="write the summary as JSON (bytes_read_from_source, bytes_written, "
                             "seconds, phases, ...); - is stdout; written by rank 0")
    parser.add_argument("--quiet", action="store_true", help="no summary lines")


def run(args) -> int:
    import sys

    import os

    from hpcddp.cli._errors import one_prefix, refuse
    from hpcddp.launch import detect
    if args.files and not os.path.isdir(args.source):
        what = "does not exist" if not os.path.lexists(args.source) else "is not a directory"
        problem = (f"--files: SOURCE {args.source!r} {what}; expected a directory tree (a single "
                   f"file: stage the directory holding it)")
    elif not args.files and not os.path.isfile(os.path.join(args.source, "manifest.json")):
        what = "does not exist" if not os.path.exists(args.source) else \
            "is not a packed data set (no manifest.json)"
        problem = (f"SOURCE {args.source!r} {what}; make one with `hpcddp pack`, or stage a "
                   f"plain directory tree with --files")
    else:
        problem = None
    if problem:
        # refused before MPI starts: every rank exits 2, the launcher's rank 0 says why
        launched = detect()
        rank = launched.rank if launched is not None else 0
        if rank != 0:
            return 2
        return refuse("stage", problem, prefix="[rank0] ")
    from hpcddp.comm import init, log, world
    from hpcddp.data.staging import StageError, stage, write_json
    init(set_cuda_device=False)      # no torch: thousands of ranks importing it is a storm
    rank = world().rank
    try:
        # bars only on a terminal: in a job's log, the summary lines say what each phase did
        result = stage(args.source, args.dest, mode=args.mode, group_nodes=args.group_nodes,
                       strategy=args.strategy, chunk_bytes=args.chunk_size, verify=args.verify,
                       fsync=args.fsync, progress=not args.no_progress and sys.stderr.isatty(),
                       lock_wait=args.lock_wait, files=args.files)
    except (StageError, ValueError) as exc:
        if rank == 0:
            log(f"hpcddp stage: {one_prefix('stage', str(exc))}")
        return 2 if isinstance(exc, ValueError) else 1
    if rank == 0:
        if not args.quiet:
            for line in result.summary().splitlines():
                print(f"[rank0] {line}", file=sys.stderr if args.json == "-" else sys.stdout,
                      flush=True)
        if args.json:
            write_json(result, args.json)
    return 0
