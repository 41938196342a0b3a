"""`hpcddp bench comm|ddp|stage|report`: benchmarks against raw mpi4py and gloo, in one job."""
import argparse

DESCRIPTION = """\
Benchmarks that compare hpcddp with what you would use instead, side by side in ONE job
(interleaved rounds, paired ratios, MAX over ranks: docs/benchmarks.md). Run them under your
launcher with exactly the ranks you mean to measure (ranks busy-poll: never more than cores):

    mpirun -n 2 --bind-to core hpcddp bench comm --json comm.json --plot comm.png
    mpirun -n 2 --bind-to core hpcddp bench comm --ops all_reduce --sizes 4-1K --rounds 5
    mpirun -n 2 hpcddp bench ddp --json ddp.json
    HPCDDP_RANKS_PER_NODE=1 mpirun -n 2 hpcddp bench stage --dir /tmp/stage
    hpcddp bench comm --np 2                          # starts mpirun itself
    hpcddp bench ddp --vcluster 2 --rate 1gbit        # across 2 virtual nodes (root)
    hpcddp bench report comm.json --compare docs/benchmarks/comm.json

--compare FILE.json exits 1 if a row is more than --threshold (10 %) worse than the saved
run; rows are compared by their paired ratios (load-independent), absolute times are shown.
"""

SUBCOMMANDS = ("comm", "ddp", "stage", "report")


def _common(p: argparse.ArgumentParser, mpi: bool = True) -> None:
    p.add_argument("--json", metavar="FILE", help="write every figure and the machine setup")
    p.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")
    p.add_argument("--compare", metavar="FILE.json",
                   help="compare with a saved --json result; exit 1 on a regression")
    p.add_argument("--threshold", type=float, default=0.10,
                   help="--compare: fraction a row may be worse before it counts (default 0.10)")
    p.add_argument("--compare-absolute", action="store_true",
                   help="--compare: also gate on absolute median times (same quiet machine only)")
    if mpi:
        p.add_argument("--rounds", type=int, default=None,
                       help="interleaved rounds; the first is discarded (default: comm 9, "
                            "ddp 5, stage 4)")
        p.add_argument("--np", type=int, metavar="N",
                       help="not under a launcher: start `mpirun -n N` (bound one rank per "
                            "core, Open MPI shared memory) on this command and wait")
        p.add_argument("--vcluster", type=int, metavar="N",
                       help="not under a launcher: bring up N virtual nodes of this machine "
                            "(scripts/vcluster.sh, root), run there with the ranks placed "
                            "as across real nodes, and take them down (docs/benchmarks.md)")
        p.add_argument("--rate", metavar="RATE",
                       help="--vcluster: each node's link, a tc rate such as 1gbit "
                            "(default: unshaped); also gives the bound")
        p.add_argument("--ranks-per-node", type=int, default=1, metavar="K",
                       help="--vcluster: ranks on each virtual node (default 1)")
        p.add_argument("--link-rate", metavar="RATE", help=argparse.SUPPRESS)
        p.add_argument("--timeout", type=float, default=3600,
                       help="--np, --vcluster: kill the job after this many seconds "
                            "(default 3600)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    p = sub.add_parser("comm", help="every collective: mpi4py vs hpcddp vs direct API vs gloo "
                       "vs memcpy, 4 B - 64 MiB")
    p.add_argument("--ops", help="comma-separated ops (default: all but the rooted ones): "
                   "all_reduce, broadcast, all_gather, all_gather_into_tensor, reduce_scatter, "
                   "reduce_scatter_tensor, all_to_all, all_to_all_single, send_recv; and, "
                   "named here, reduce, gather, scatter (rank 0 the root)")
    p.add_argument("--sizes", help="comma-separated sizes (4,1K,25MiB) or a range of the "
                   "default sizes (4-32K); default 4 B - 64 MiB")
    p.add_argument("--impls", help="comma-separated implementations (default: mpi4py,hpcddp,"
                   "direct,gloo,memcpy; also hpcddp-async, and direct-unchecked: the direct API "
                   "without the cross-rank call agreement, to measure its cost)")
    p.add_argument("--batch-ms", type=float, default=2.0,
                   help="minimum length of one timed batch in ms (default 2)")
    _common(p)
    p = sub.add_parser("ddp", help="DDP training steps/s over hpcddp and gloo, and compute-only")
    p.add_argument("--models", default="10M,50M",
                   help="comma-separated model sizes: 10M, 50M (MLPs), or tiny (CI)")
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step (default 32)")
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps per round and mode (default: about 1 s per round)")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP bucket_cap_mb for both backends (default 25)")
    p.add_argument("--seed", type=int, default=0)
    _common(p)
    p = sub.add_parser("stage", help="staging throughput and bytes read from the source: "
                       "scatter-then-broadcast vs every rank copies vs cp -r")
    p.add_argument("--dir", help="scratch directory for the source data set and the copies "
                   "(default: a new temporary directory, removed afterwards)")
    p.add_argument("--size-mb", type=float, default=256.0,
                   help="data set size in MiB (default 256)")
    p.add_argument("--files", type=int, default=16, help="shards in the data set (default 16)")
    p.add_argument("--strategies", help="comma-separated: bcast, allgather, ring, every-rank, "
                   "cp, mpi (one raw MPI_Allgather of the same bytes, no files; default: all)")
    p.add_argument("--group-nodes", type=int, metavar="K",
                   help="nodes per staging group (hpcddp stage --group-nodes; default: all)")
    p.add_argument("--warm", action="store_true",
                   help="leave the source in the page cache (default: evict it before each run)")
    _common(p)
    p = sub.add_parser("report", help="print a saved result (table, targets), plot it, compare "
                       "it; no MPI")
    p.add_argument("file", help="a result written by --json")
    p.add_argument("--markdown", action="store_true", help="tables in Markdown (for the docs)")
    _common(p, mpi=False)


def run(args) -> int:
    if not getattr(args, "bench", None):
        print("hpcddp bench: choose a benchmark: " + ", ".join(SUBCOMMANDS) +
              " (hpcddp bench --help)")
        return 2
    if args.bench == "report":
        from hpcddp.bench.cli_impl import report_main
        return report_main(args)
    from hpcddp.bench.cli_impl import main
    return main(args)
