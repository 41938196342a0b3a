#!/bin/bash
# A CPU-only MPI job with mpirun/mpiexec: one rank per core, each bound to its core.
#
# Run:   bash jobs/mpirun/cpu_mpi.sh --epochs 3          (RANKS_PER_NODE defaults to nproc)
#        HOSTFILE=hosts NODES=4 bash jobs/mpirun/cpu_mpi.sh
# On Slurm prefer jobs/slurm/cpu_mpi.sbatch. Guide: docs/jobs.md.

# ---- settings (each may also come from the environment) -------------------------------------
NODES=${NODES:-1}
RANKS_PER_NODE=${RANKS_PER_NODE:-$(env -u OMP_NUM_THREADS nproc)}
CPUS_PER_RANK=${CPUS_PER_RANK:-1}   # >1 for ranks that use threads (OMP_NUM_THREADS follows)
HOSTFILE=${HOSTFILE:-}
MPIRUN=${MPIRUN:-mpirun}
SCRIPT=${SCRIPT:-train.py}
ARGS=("$@")
export CKPT_DIR=${CKPT_DIR:-$PWD/checkpoints/cpu_mpi}

set -euo pipefail
# One thread per core a rank owns: otherwise every rank starts a thread per core of the node.
export OMP_NUM_THREADS=$CPUS_PER_RANK

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

mpi_cmd "$RANKS_PER_NODE" $((NODES * RANKS_PER_NODE))
mkdir -p "$CKPT_DIR"
echo "[job] $(date +%T) ${MPI_CMD[*]} hpcddp run $SCRIPT ${ARGS[*]}"
run_step "${MPI_CMD[@]}" hpcddp run "$SCRIPT" "${ARGS[@]}"
echo "[job] $(date +%T) done"
