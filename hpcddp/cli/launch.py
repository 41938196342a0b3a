"""`hpcddp launch`: start a launcher command line (mpirun, mpiexec, srun) so that it always ends."""
import argparse

DESCRIPTION = """\
Run a launcher command line, its output streaming through, and see that it ends with a status
that says what happened. Put it in front of the mpirun of a batch script:

    hpcddp launch -- mpirun -n 8 --hostfile hosts hpcddp run train.py
    hpcddp launch --timeout 3600 -- mpirun -n 8 hpcddp run train.py

Why: Open MPI's mpirun can outlive its job when a node drops off the network. After a rank
aborts (hpcddp's stall report names the unresponsive rank and aborts), mpirun waits for the
unreachable node's daemon to confirm its kill: with Linux's TCP defaults, about 15 minutes. When
its keepalives find the node lost instead, it ends the job but exits 0. Here:
- PRRTE's keepalives are set (30 s, then 3 probes 10 s apart; PRTE_MCA_oob_tcp_keepalive_*
  in the environment win), except under ULFM (--with-ft ulfm: elastic jobs), where a daemon
  found lost would end the survivors' job too;
- an elastic job's launcher still running 10 s (or --abort-grace, where smaller) after every
  survivor left (it waits for a node that dropped off the network) is ended, with the
  survivors' status (docs/elastic.md);
- an elastic job that grew back (a replacement rank joined, or none could start) gets its
  ranks' status: Open MPI's mpirun exits 213 or 137 for a replacement's own job;
- a launcher still running --abort-grace seconds after an abort is ended (SIGTERM twice, then
  SIGKILL) and the status is the abort's error code;
- a launcher that lost a node and exits 0 gets status 1, with a line naming the node;
- under --with-ft ulfm Open MPI's mpirun exits 0 even where every process was killed or
  crashed: a job in which no rank said it ended (hpcddp's ranks print "elastic: rank R of N
  leaves the job" as they do) gets status 1;
- Ctrl-C or SIGTERM end the job (status 130 or 143); SIGUSR1/SIGUSR2 are passed to the
  launcher (Open MPI relays them to every rank: checkpoint-before-preemption);
- --timeout ends the job after that many seconds (status 124).
Otherwise the status is the launcher's own. docs/hangs.md ("A node drops off the network").
"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="end the job after S seconds (status 124); default: no limit")
    parser.add_argument("--abort-grace", type=float, default=None, metavar="S",
                        help="seconds a launcher may take to end its job after a rank aborted "
                             "(default 30), and after every survivor of an elastic job left "
                             "(10, or S where smaller)")
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS",
                        help="the launcher command line, after --")


def run(args) -> int:
    import sys

    from hpcddp.launch.mpirun import ABORT_GRACE, run_job

    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("hpcddp launch: give the launcher command after --, e.g. "
              "`hpcddp launch -- mpirun -n 4 hpcddp run train.py`", file=sys.stderr)
        return 2
    for value, flag in ((args.timeout, "--timeout"), (args.abort_grace, "--abort-grace")):
        if value is not None and not value > 0:
            print(f"hpcddp launch: {flag} must be a positive number of seconds, got {value:g}",
                  file=sys.stderr)
            return 2
    grace = ABORT_GRACE if args.abort_grace is None else args.abort_grace
    try:
        return run_job(cmd, timeout=args.timeout, name="hpcddp launch", abort_grace=grace)
    except FileNotFoundError:
        print(f"hpcddp launch: CMD {cmd[0]!r} not found on PATH", file=sys.stderr)
        return 127
