#!/bin/bash
# Stage a data set to each machine's local disk, then train from it, with mpirun/mpiexec.
#
# Run:   STAGE_SRC=/shared/data HOSTFILE=hosts NODES=2 bash jobs/mpirun/stage_then_train.sh
# Step 1 puts a copy of STAGE_SRC in STAGE_DEST on every machine (a packed data set goes
# through `hpcddp stage`: read once, broadcast over MPI); step 2 trains from the local copy,
# which it gets as --data DEST (DATA_ARG). Hostfile and allocations: see multi_node_ddp.sh.
# On Slurm prefer jobs/slurm/stage_then_train.sbatch. Guide: docs/jobs.md.

# ---- settings (each may also come from the environment) -------------------------------------
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

set -euo pipefail
export OMP_NUM_THREADS=$CPUS_PER_RANK SCRATCH STAGED_DATA=$STAGE_DEST

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
        for v in PATH LD_LIBRARY_PATH PYTHONPATH VIRTUAL_ENV OMP_NUM_THREADS CKPT_DIR TMPDIR \
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

# Stage: one rank per machine. A packed data set (manifest.json, from `hpcddp pack`) goes
# through `hpcddp stage` (read once per node group, broadcast, verified, READY marker); any
# other directory is copied per machine, to a temporary name and then renamed.
mpi_cmd 1 "$NODES"
echo "[job] $(date +%T) staging $STAGE_SRC -> $STAGE_DEST on $NODES machine(s)"
if [ -f "$STAGE_SRC/manifest.json" ]; then
    run_step "${MPI_CMD[@]}" hpcddp stage --no-progress "$STAGE_SRC" "$STAGE_DEST"
else
    run_step "${MPI_CMD[@]}" bash -c '
        set -e; [ -d "$2" ] && exit 0; tmp="$2.partial.$(hostname).$$"
        mkdir -p "$(dirname "$2")"; cp -r "$1" "$tmp"; mv -T "$tmp" "$2" 2>/dev/null || rm -rf "$tmp"
    ' stage "$STAGE_SRC" "$STAGE_DEST"
fi
if [ -n "$DATA_ARG" ]; then ARGS+=("$DATA_ARG" "$STAGE_DEST"); fi

mpi_cmd "$RANKS_PER_NODE" $((NODES * RANKS_PER_NODE))
mkdir -p "$CKPT_DIR"
echo "[job] $(date +%T) ${MPI_CMD[*]} hpcddp run $SCRIPT ${ARGS[*]}"
run_step "${MPI_CMD[@]}" hpcddp run "$SCRIPT" "${ARGS[@]}"
echo "[job] $(date +%T) done"
