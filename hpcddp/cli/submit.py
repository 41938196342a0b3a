"""`hpcddp submit`: render a Slurm job from a template and submit it with sbatch."""
import argparse

# Kept here, not imported from hpcddp.launch.templates, so `hpcddp --help` stays light; a unit
# test checks the two lists agree.
TEMPLATE_NAMES = ("single-node-ddp", "multi-node-ddp", "stage-then-train", "cpu-mpi",
                  "array-sweep")

DESCRIPTION = """\
Render one of the job templates (the same text as jobs/slurm/*.sbatch) with your options, then
submit it with sbatch and print the job id, or print the script with --dry-run. Options you do
not give keep the template's defaults; options that do not apply to the template are refused.

    hpcddp submit single-node-ddp --gpus 4 --tasks-per-node 4 --time 2:00:00 train.py --epochs 10
    hpcddp submit multi-node-ddp --nodes 4 --partition gpu --account proj123 train.py
    hpcddp submit stage-then-train --stage-src /lustre/me/imagenet-packed train.py
    hpcddp submit array-sweep --sweep lr=0.1,0.01,0.001 --max-parallel 2 train.py
    hpcddp submit cpu-mpi --nodes 2 --tasks-per-node 64 --dry-run prep.py > prep.sbatch

Everything after SCRIPT goes to the script. The job runs in the current directory; its log is
%x-%j.out (--output). docs/jobs.md explains each template.

Exit status: 0 submitted; 4 submitted, but Slurm says it will never start as asked (a shape
or time limit over the partition's: the reason is printed; cancel it and submit one that
fits); sbatch's own status where it refuses the job; 127 no sbatch on PATH.
"""

# flag -> (option name, type, help). Types: int, str, list (repeatable).
FLAGS = {
    "--job-name": ("job_name", str, "Slurm job name"),
    "--nodes": ("nodes", int, "nodes"),
    "--tasks-per-node": ("tasks_per_node", int, "MPI ranks per node (one per GPU)"),
    "--gpus": ("gpus", int, "GPUs per node (0: CPU only)"),
    "--cpus-per-task": ("cpus_per_task", int, "cores per rank"),
    "--time": ("time", str, "time limit, e.g. 30, 2:00:00, 1-00:00:00"),
    "--partition": ("partition", str, "partition"),
    "--account": ("account", str, "account to charge"),
    "--output": ("output", str, "log file pattern (%%x name, %%j id)"),
    "--setup": ("setup", "list", "a shell line run before anything else (repeatable): "
                                 "'module load openmpi', 'source venv/bin/activate'"),
    "--mpi": ("mpi", str, "srun --mpi plugin: pmix (default) or pmi2"),
    "--signal-lead": ("signal_lead", int, "seconds before the time limit to checkpoint "
                                          "and requeue (default 120)"),
    "--max-requeues": ("max_requeues", int, "times the job requeues itself at its time limit "
                                            "(default 3; 0: never)"),
    "--elastic": ("elastic", "bool", "survive a lost rank: the script uses hpcddp.elastic and "
                                     "runs under mpirun --with-ft ulfm (docs/elastic.md)"),
    "--spares": ("spares", int, "with --elastic: the last N tasks run as spare processes that "
                                "take lost ranks' places at once (default 0: the job goes on "
                                "smaller)"),
    "--stage-src": ("stage_src", str, "stage-then-train: data set on the shared filesystem"),
    "--stage-dest": ("stage_dest", str, "stage-then-train: node-local destination "
                                        "(default $SCRATCH/data)"),
    "--data-arg": ("data_arg", str, "stage-then-train: the script option that gets the "
                                    "staged path (default --data)"),
    "--sweep": ("sweep", str, "array-sweep: NAME=V1,V2,... (one array task per value)"),
    "--max-parallel": ("max_parallel", int, "array-sweep: array tasks at once (0: no limit)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("template", choices=TEMPLATE_NAMES, metavar="TEMPLATE",
                        help="one of: " + ", ".join(TEMPLATE_NAMES))
    for flag, (dest, typ, text) in FLAGS.items():
        if typ == "list":
            parser.add_argument(flag, dest=dest, action="append", default=None, help=text)
        elif typ == "bool":
            parser.add_argument(flag, dest=dest, action="store_true", default=None, help=text)
        else:
            parser.add_argument(flag, dest=dest, type=typ, default=None, help=text)
    parser.add_argument("--dry-run", action="store_true",
                        help="print the job script instead of submitting it")
    parser.add_argument("--save", metavar="FILE",
                        help="also write the job script to FILE (keep it with your results)")
    parser.add_argument("--sbatch", dest="sbatch_args", action="append", default=[],
                        metavar="ARG", help="extra argument for sbatch (repeatable), e.g. "
                                            "--sbatch=--dependency=afterok:123")
    parser.add_argument("script", metavar="SCRIPT", help="the training script each rank runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script")
    _reject_unknown(parser)


def _reject_unknown(parser: argparse.ArgumentParser) -> None:
    """An unknown option before SCRIPT is an error that lists the valid options.

    (Left alone, argparse hands it to the top-level parser, whose message shows only
    `hpcddp [-h] COMMAND`.)
    """
    parse_known = parser.parse_known_args

    def strict(args=None, namespace=None):
        ns, extras = parse_known(args, namespace)
        if extras:
            valid = ", ".join(list(FLAGS) + ["--dry-run", "--save", "--sbatch"])
            parser.error(f"unknown option(s) {' '.join(extras)}; valid options: {valid} "
                         f"(then SCRIPT and its arguments)")
        return ns, extras

    parser.parse_known_args = strict


def options_from_args(args) -> dict:
    """The template options the user gave (None means: keep the template's default)."""
    opts = {dest: getattr(args, dest) for dest, _, _ in FLAGS.values()
            if getattr(args, dest, None) is not None}
    opts["script"] = args.script
    opts["args"] = list(args.args)
    return opts


def run(args) -> int:
    import subprocess
    import sys

    from hpcddp.launch.templates import TemplateError, render

    try:
        text = render(args.template, **options_from_args(args))
    except TemplateError as exc:
        import re

        from hpcddp.cli._errors import refuse
        # the library names its function ("render('cpu-mpi'): ..."); here the command says it
        return refuse("submit", re.sub(r"^render\('[^']*'\): ", "", str(exc)))
    if args.save:
        with open(args.save, "w") as f:
            f.write(text)
    if args.dry_run:
        sys.stdout.write(text)
        return 0
    cmd = ["sbatch", "--parsable", *args.sbatch_args]
    try:
        # sbatch reads the script from stdin; it copies it at submission, so no file is needed.
        res = subprocess.run(cmd, input=text, capture_output=True, text=True, timeout=120)
    except FileNotFoundError:
        print("hpcddp submit: sbatch not found on PATH: run this on a Slurm login node, or use "
              "--dry-run to see the script", file=sys.stderr)
        return 127
    except subprocess.TimeoutExpired:
        print("hpcddp submit: sbatch did not answer within 120 s (is slurmctld reachable? "
              "`scontrol ping`)", file=sys.stderr)
        return 124
    if res.returncode != 0:
        print(f"hpcddp submit: sbatch failed (exit {res.returncode}): {res.stderr.strip()}",
              file=sys.stderr)
        return res.returncode
    job_id = res.stdout.strip().split(";")[0]
    print(job_id, flush=True)
    print(f"hpcddp submit: {args.template} submitted as job {job_id}; watch it with "
          f"`squeue -j {job_id}`", file=sys.stderr)
    reason = never_starts(job_id)
    if reason:
        print(f"hpcddp submit: warning: job {job_id} is pending with reason {reason}: "
              f"{NEVER_STARTS[reason]}, so it will wait in the queue for good. Cancel it "
              f"(`scancel {job_id}`) and submit a shape that fits (`scontrol show partition` "
              f"lists the limits; --nodes, --tasks-per-node, --cpus-per-task, --gpus, --time)",
              file=sys.stderr)
        return NEVER_STARTS_EXIT
    return 0


NEVER_STARTS_EXIT = 4   # submitted (its id on stdout), but it will never start as asked


# squeue reasons Slurm gives at submission to a job it accepted but that, as asked, no node or
# limit of its partition can ever run (the partition's EnforcePartLimits=NO, Slurm's default,
# queues such jobs instead of refusing them)
NEVER_STARTS = {
    "PartitionConfig": "it asks for more than the partition's nodes can hold (CPUs, GPUs "
                       "or memory per node, or nodes)",
    "PartitionNodeLimit": "it asks for more nodes than the partition allows",
    "PartitionTimeLimit": "its time limit (--time) is over the partition's",
    "BadConstraints": "no node has the features or resources it asks for",
}


def never_starts(job_id: str, looks: int = 3, wait: float = 0.5) -> str | None:
    """The reason JOB_ID will never start (a key of NEVER_STARTS), else None. Asks squeue a
    few times: the reason is set within the scheduler's first look at the job."""
    import subprocess
    import time
    for i in range(looks):
        try:
            res = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"],
                                 capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        state, _, reason = res.stdout.strip().partition(" ")
        if res.returncode != 0 or state != "PENDING":
            return None                      # running, done, or squeue cannot tell
        if reason not in ("", "None"):      # the scheduler has looked at it
            return reason if reason in NEVER_STARTS else None
        if i + 1 < looks:
            time.sleep(wait)
    return None
